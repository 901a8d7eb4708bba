"""What every derived part of a model was derived from: one way to record it and one way to check it.

A saved hf_xmc model is a bundle of parts computed from other parts: the label index and its int8 / binary codes (from
the label vectors), the lexical channel (from the label texts), the score calibration (from one ranking: the weights,
the labels, the search mode, the channel and its weights), the ONNX export (from the weights and the query head),
MUFIN's label images and shortlist index, the training shortlists (from the targets, the training filter and the
split) and the validation split (from the seed and the size). Each records a **fingerprint** of its inputs when it is
made (:func:`fingerprint_of`: a small dict, one entry per input, saved with the part), and every place that uses it
compares that record with the inputs it sees now (:func:`check_derived`). A part whose inputs changed is then handled
by its **policy** (:data:`DERIVED_PARTS`, and the table in docs/architecture.md):

* ``rebuild``: made again from its inputs, where that is cheap and safe (the index, the channel's label rows);
* ``drop``: removed with a one-line warning, where it is optional (the calibration: no probabilities until refitted);
* ``refuse``: a one-line :class:`StaleDerivedPartError` (exit 2 from a script or the CLI), where using it would be
  wrong (an ONNX export of another head, a resumed run on another split).

A fingerprint entry is a string (a digest, a mode, a name), a number, or a list of floats (the weights' summary,
compared with a relative tolerance of 1e-9: float64 sums in another thread count differ by rounding only). An entry
missing from the record (a part saved before fingerprints) is not compared: it is trusted as loaded.

Memory: a fingerprint is a few dozen bytes; the digests it holds are taken once per state (cached by the callers).

This file is part of the remote-code bundle of every hf_xmc model: it imports only the standard library and numpy.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

logger = logging.getLogger(__name__)

POLICIES = ("rebuild", "drop", "refuse")
# float64 sums of the same weights in another reduction order (threads, device) differ by ~1e-15; one small optimiser
# step on one row of a large table moves them by more than this
WEIGHTS_RTOL = 1e-9


@dataclass(frozen=True)
class DerivedPart:
    """One derived part: its name, what it is derived from and what happens when that changed."""

    name: str
    inputs: tuple[str, ...]
    policy: str
    where: str  # where the record lives


# the parts, their inputs and their policy (docs/architecture.md renders the same table)
DERIVED_PARTS: dict[str, DerivedPart] = {
    part.name: part
    for part in (
        DerivedPart("label_index", ("weights", "labels", "search_mode", "codes"), "rebuild", "label_index.json"),
        DerivedPart("lexical_channel", ("labels",), "rebuild", "config.lexical_channel['fingerprint']"),
        DerivedPart("score_calibration", ("weights", "labels", "search_mode", "channel", "query_encoder"), "drop",
                    "config.score_calibration['fingerprint']"),
        DerivedPart("onnx_export", ("weights", "max_seq_length", "query_head", "file"), "refuse", "query_encoder.json"),
        # a static query encoder maps queries into the tower's space: another tower, head or tokenizer, another space
        DerivedPart("static_query_encoder", ("weights", "query_head", "max_seq_length", "tokenizer"), "refuse", "static_query_encoder.json"),
        # MUFIN's lazy label-image view: the identity of the file its offsets came from (its shortlist index is its
        # label_index, checked as every model's)
        DerivedPart("label_images", ("file",), "refuse", "the view (device, inode, size, mtime of the file)"),
        DerivedPart("training_shortlists", ("targets", "train_filter", "validation", "seed"), "refuse", "the run's stage state"),
        DerivedPart("validation_split", ("source", "queries", "seed", "fingerprint"), "refuse", "config.validation"),
    )
}


class StaleDerivedPartError(ValueError):
    """A derived part whose inputs changed, used where that would be wrong (policy ``refuse``): one line."""


def digest(values: Iterable[Any]) -> str:
    """A short sha256 of a sequence of strings, bytes or other JSON values, order included: the label set's digest."""
    h = hashlib.sha256()
    for value in values:
        if isinstance(value, bytes):
            h.update(value)
        else:
            h.update((value if isinstance(value, str) else json.dumps(value, sort_keys=True)).encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()[:16]


def array_digest(*arrays: np.ndarray) -> str:
    """A short sha256 of arrays' dtypes, shapes and bytes (targets, filters, a CSR matrix's parts)."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.data)
    return h.hexdigest()[:16]


def file_digest(path: str, chunk: int = 1 << 20) -> str:
    """A short sha256 of a file's bytes, read in 1 MiB chunks (an exported ONNX file: its own bytes are checked)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()[:16]


def fingerprint_of(**inputs: Any) -> dict:
    """A fingerprint: the named inputs as JSON values (tuples become lists), ready to be saved with the part."""
    return {name: (list(value) if isinstance(value, tuple) else value) for name, value in inputs.items()}


def changed_inputs(recorded: Optional[Mapping], current: Mapping) -> list[str]:
    """The names of the inputs whose recorded value differs from the current one (inputs the record lacks are not
    compared; lists of floats with a relative tolerance of :data:`WEIGHTS_RTOL`)."""
    if not recorded:
        return []
    changed = []
    for name, now in current.items():
        if name not in recorded:
            continue
        then = recorded[name]
        if isinstance(now, (list, tuple)) and isinstance(then, (list, tuple)) and all(isinstance(v, (int, float)) for v in (*now, *then)):
            same = len(now) == len(then) and bool(np.allclose(then, now, rtol=WEIGHTS_RTOL, atol=1e-12))
        else:
            same = then == now
        if not same:
            changed.append(name)
    return changed


def check_derived(part: str, recorded: Optional[Mapping], current: Mapping, subject: str = "", hint: str = "") -> bool:
    """Whether derived ``part`` (a name of :data:`DERIVED_PARTS`), made from ``recorded`` inputs, is current for the
    ``current`` ones. When it is not, its policy decides: ``rebuild`` returns False (the caller makes it again), ``drop``
    logs one warning line and returns False (the caller removes it), ``refuse`` raises :class:`StaleDerivedPartError`.
    ``subject`` names what is checked (a file, a model class) at the start of the line; ``hint`` says what to do."""
    changed = changed_inputs(recorded, current)
    if not changed:
        return True
    spec = DERIVED_PARTS[part]
    line = (f"{subject + ': ' if subject else ''}the {part.replace('_', ' ')} {'were' if part.endswith('s') else 'was'} made from other "
            f"{', '.join(changed)} than the model's now")
    if spec.policy == "refuse":
        raise StaleDerivedPartError(f"{line}: refused{'; ' + hint if hint else ''}")
    if spec.policy == "drop":
        logger.warning("%s: dropped%s", line, f"; {hint}" if hint else "")
    else:
        logger.info("%s: rebuilt", line)
    return False
