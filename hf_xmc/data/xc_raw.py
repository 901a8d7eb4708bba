"""Extreme Classification Repository "raw" JSON-lines format.

The raw text versions of the XC repository datasets (e.g. LF-AmazonTitles-131K) ship as
``trn.json.gz``, ``tst.json.gz`` and ``lbl.json.gz``: one JSON object per line with the keys
``uid``, ``title``, an optional ``content`` and ``target_ind`` (a list of integer label ids,
0-based indices into the lines of ``lbl.json.gz``). Files are gzip-compressed when the name ends
in ``.gz`` and plain text otherwise.

Multimodal datasets (MUFIN) add an optional ``images`` field to points and labels: a list of image
paths (possibly empty). Relative paths resolve against the directory of the JSON file, absolute paths
are kept; in memory every path is absolute. A file in which no line has ``images`` reads as a text-only
dataset (``images=None``), exactly as before.

This module also hosts the small I/O helpers (:class:`XMCDataError`, gzip-aware opening and
atomic writing) shared by the other readers/writers of :mod:`hf_xmc.data`.
"""

from __future__ import annotations

import array
import contextlib
import gzip
import io
import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, Union

import numpy as np
import scipy.sparse as sp

try:  # tqdm is a soft dependency: the readers work without it
    from tqdm.auto import tqdm as _tqdm
except ImportError:  # pragma: no cover - tqdm is installed in every supported environment
    _tqdm = None

__all__ = [
    "XMCDataError",
    "XMCDataset",
    "XCData",
    "read_xc_raw",
    "read_xc_labels",
    "write_xc_raw",
    "write_xc_labels",
    "load_xc_dataset",
]

logger = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]

#: Text fields that may be absent from a line (treated as empty). Every other requested field is required.
OPTIONAL_TEXT_FIELDS = frozenset({"content"})


class XMCDataError(ValueError):
    """A data file is malformed; the message names the file, the 1-based line and the fault."""

    def __init__(self, path: PathLike, line: int | None, fault: str) -> None:
        self.path = os.fspath(path)
        self.line = line
        self.fault = fault
        where = f"{self.path}, line {line}" if line is not None else self.path
        super().__init__(f"{where}: {fault}")

    def __reduce__(self) -> tuple:
        """Pickle support (e.g. across DataLoader / multiprocessing workers)."""
        return type(self), (self.path, self.line, self.fault)


# --------------------------------------------------------------------------------------------
# shared I/O helpers (used by bow.py and filters.py too)
# --------------------------------------------------------------------------------------------


def _is_gz(path: PathLike) -> bool:
    """Return True when the file name ends in ``.gz``."""
    return os.fspath(path).endswith(".gz")


def _open_text(path: PathLike) -> IO[str]:
    """Open a (possibly gzip-compressed, decided by suffix) UTF-8 text file for reading."""
    if _is_gz(path):
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def progress_bar_disabled() -> bool:
    """The data layer's reading of the switch every progress bar asks (``TQDM_DISABLE``, or transformers'
    ``disable_progress_bar()`` / ``HF_HUB_DISABLE_PROGRESS_BARS``): the same rule as the models'
    ``io_utils.progress_bar_disabled``, which the data layer may not import (models sit above it)."""
    from transformers.utils import logging as hf_logging

    return os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false", "no", "off") or not hf_logging.is_progress_bar_enabled()


def _iter_lines(f: IO[str], path: PathLike, desc: str = "reading") -> Iterator[tuple[int, str]]:
    """Yield ``(1-based line number, line without the line terminator)``, with a tqdm bar on a tty.

    Decoding errors (bad gzip stream, invalid UTF-8) are re-raised as :class:`XMCDataError`.
    """
    it: Any = f
    bar = None
    if _tqdm is not None:
        bar = _tqdm(f, desc=f"{desc} {os.path.basename(os.fspath(path))}", unit=" lines",
                    disable=True if progress_bar_disabled() else None, leave=False)
        it = bar
    lineno = 0
    try:
        for lineno, line in enumerate(it, start=1):
            yield lineno, line.rstrip("\r\n")
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise XMCDataError(path, lineno + 1, f"cannot read/decode file: {e}") from e
    finally:
        if bar is not None:
            bar.close()


_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def _atomic_text_writer(path: PathLike) -> Iterator[IO[str]]:
    """Yield a UTF-8 text stream that atomically replaces ``path`` when the block succeeds.

    Data goes to a temporary file in the same directory, which is fsynced and then moved over
    ``path`` with :func:`os.replace`. On any exception the temporary file is removed and ``path``
    is left untouched. ``.gz`` paths are gzip-compressed with ``mtime=0`` and no embedded file
    name, so the output is byte-reproducible (for a given zlib).
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as raw:
            gz = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) if _is_gz(path) else None
            txt = io.TextIOWrapper(gz if gz is not None else raw, encoding="utf-8", newline="\n")
            try:
                yield txt
            except BaseException:
                with contextlib.suppress(Exception):  # the file is discarded anyway
                    txt.detach()
                raise
            txt.detach()  # flushes; leaves `gz`/`raw` open
            if gz is not None:
                gz.close()  # writes the gzip trailer; does not close `raw`
            raw.flush()
            os.fsync(raw.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# --------------------------------------------------------------------------------------------
# datasets
# --------------------------------------------------------------------------------------------


@dataclass
class XMCDataset:
    """Texts (and optionally images) with their sparse binary label matrix (one row per point).

    ``images`` is ``None`` for a text-only dataset, otherwise one list of image paths per point
    (possibly empty: a point may carry text only).
    """

    texts: list[str]
    targets: sp.csr_matrix  # (n x num_labels) float32 binary
    uids: list[str]
    num_skipped: int = 0  # points skipped by the reader because they had no labels
    # 0-based record number of each point in its source file (None: row i is record i). Filter files index
    # records, so they must be mapped through this when unlabeled points were skipped.
    source_rows: np.ndarray | None = None
    images: list[list[str]] | None = None  # per point: image paths (absolute once read from a file)
    # (n x num_labels) boolean CSR of pairs that are neither relevant nor irrelevant: removed from a ranking before
    # it is scored and never drawn as a negative (a filter file's pairs, e.g. LF datasets' "a point is its own
    # label"); None: no such pairs. Memory: 5 bytes per pair plus 8 per point.
    filter_matrix: sp.csr_matrix | None = None
    # validation pairs whose reverse is a training pair, moved from ``targets`` to ``filter_matrix`` when the split was
    # carved (hf_xmc.data.splits.filter_reciprocal_pairs); recorded in the saved config's validation record
    num_reciprocal_pairs_filtered: int = 0

    def __post_init__(self) -> None:
        """Normalise ``targets`` to CSR float32 and check that the lengths agree."""
        if not sp.issparse(self.targets):
            raise TypeError(f"targets must be a scipy sparse matrix, got {type(self.targets).__name__}")
        if self.targets.ndim != 2:
            raise ValueError(f"targets must be 2-D, got shape {self.targets.shape}")
        if not isinstance(self.targets, sp.csr_matrix) or self.targets.dtype != np.float32:
            self.targets = sp.csr_matrix(self.targets, dtype=np.float32)
        n = self.targets.shape[0]
        if len(self.texts) != n or len(self.uids) != n:
            raise ValueError(
                f"inconsistent lengths: {len(self.texts)} texts, {len(self.uids)} uids, {n} target rows")
        if self.source_rows is not None:
            self.source_rows = np.asarray(self.source_rows, dtype=np.int64)
            if self.source_rows.shape != (n,):
                raise ValueError(f"source_rows has shape {self.source_rows.shape}, expected ({n},)")
        if self.filter_matrix is not None:
            self.filter_matrix = sp.csr_matrix(self.filter_matrix, dtype=bool)
            if self.filter_matrix.shape != self.targets.shape:
                raise ValueError(f"filter_matrix has shape {self.filter_matrix.shape}, expected the targets' {self.targets.shape}")
        if self.images is not None:
            if len(self.images) != n:
                raise ValueError(f"inconsistent lengths: {len(self.images)} image lists, {n} target rows")
            for i, item in enumerate(self.images):
                # a bare string would silently iterate as characters
                if isinstance(item, (str, bytes)) or not isinstance(item, Sequence):
                    raise TypeError(f"images[{i}] must be a list of image paths, got {type(item).__name__}")

    @property
    def num_source_records(self) -> int:
        """Number of records in the source file (points kept + points skipped)."""
        return len(self) + self.num_skipped

    def record_indices(self) -> np.ndarray:
        """Source-file record number of every point (what filter files refer to)."""
        return self.source_rows if self.source_rows is not None else np.arange(len(self), dtype=np.int64)

    def __len__(self) -> int:
        """Number of points."""
        return self.targets.shape[0]

    @property
    def num_labels(self) -> int:
        """Number of labels (columns of ``targets``)."""
        return self.targets.shape[1]

    def has_descriptor(self) -> np.ndarray:
        """Boolean mask of the points with a non-blank text or at least one image (a blank text is a missing one)."""
        return np.array([bool(t and t.strip()) or bool(self.images is not None and self.images[i]) for i, t in enumerate(self.texts)], dtype=bool)

    def select(self, indices: Sequence[int] | np.ndarray) -> XMCDataset:
        """Return the sub-dataset of the given row indices (or boolean mask), in that order (``num_skipped`` = 0)."""
        idx = np.asarray(indices)
        if idx.dtype == bool:
            if idx.shape != (len(self),):
                raise ValueError(f"boolean mask has shape {idx.shape}, expected ({len(self)},)")
            idx = np.flatnonzero(idx)
        idx = idx.astype(np.int64, copy=False).reshape(-1)
        if idx.size and (idx.min() < -len(self) or idx.max() >= len(self)):
            raise IndexError(f"index out of range for dataset of length {len(self)}")
        pos = idx.tolist()
        images = None if self.images is None else [list(self.images[i]) for i in pos]
        filt = None if self.filter_matrix is None else self.filter_matrix[idx]
        return XMCDataset(texts=[self.texts[i] for i in pos], targets=self.targets[idx],
                          uids=[self.uids[i] for i in pos], source_rows=self.record_indices()[idx], images=images, filter_matrix=filt)

    def label_lists(self) -> list[list[int]]:
        """Return the label ids of every point as python lists."""
        t = self.targets
        ind = t.indices.tolist()
        ptr = t.indptr.tolist()
        return [ind[ptr[i]:ptr[i + 1]] for i in range(t.shape[0])]


@dataclass
class XCData:
    """A train/test split plus the label texts (``num_labels == len(label_uids)``)."""

    train: XMCDataset
    test: XMCDataset
    label_texts: Sequence[str]
    label_uids: Sequence[str]
    label_images: list[list[str]] | None = None  # per label: image paths; None when no label has images
    # queries held out of training to tune on (hf_xmc.data.splits); None: no validation split
    validation: XMCDataset | None = None
    # the targets of every training query when ``validation`` was carved out of them (PSP@k's propensities)
    all_train_targets: sp.csr_matrix | None = None
    # what the saved config and the card say of the validation split (hf_xmc.data.splits.validation_record)
    validation_record: dict | None = None

    @property
    def num_labels(self) -> int:
        """Number of labels."""
        return len(self.label_uids)

    def propensity_targets(self) -> sp.csr_matrix:
        """The training targets that PSP@k's inverse propensities are counted from: every training query, the ones a
        validation split took included (so a split does not change the test metrics' propensities)."""
        return self.all_train_targets if self.all_train_targets is not None else self.train.targets


# --------------------------------------------------------------------------------------------
# readers
# --------------------------------------------------------------------------------------------


class _LongInt(int):
    """Stands in for a JSON integer too long for ``int()`` (Python's integer-string conversion limit), so that the
    error names the field that holds it (see :func:`_long_integer_fault`)."""

    digits: int = 0


def _parse_long_int(text: str) -> int:
    """``json.loads``' ``parse_int`` for the error path only: an over-long integer becomes a :class:`_LongInt`."""
    try:
        return int(text)
    except ValueError:
        value = _LongInt(0)
        value.digits = len(text.lstrip("-"))
        return value


def _long_integer_fault(line: str) -> str:
    """The fault of a line holding an integer too long to read: which field holds it (parsed again, on this error path
    only, with :func:`_parse_long_int`)."""
    try:
        obj = json.loads(line, parse_int=_parse_long_int)
    except (ValueError, RecursionError):  # pragma: no cover - the line parsed up to its long integer before
        obj = None
    if isinstance(obj, dict):
        ind = obj.get("target_ind")
        long_ids = [x for x in ind if isinstance(x, _LongInt)] if isinstance(ind, list) else []
        if long_ids:
            return f"label id with {long_ids[0].digits:,} digits out of range"
        for field, value in obj.items():
            if isinstance(value, _LongInt):
                return f"field '{field}' holds an integer of {value.digits:,} digits (too long to read)"
    return f"an integer of more than {sys.get_int_max_str_digits():,} digits (too long to read)"


def _parse_object(line: str, path: PathLike, lineno: int) -> dict[str, Any]:
    """Parse one JSON-lines record, raising :class:`XMCDataError` for bad JSON / non-objects (JSON nested too deep for
    the parser and integers too long to convert included: Python raises RecursionError / ValueError there)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise XMCDataError(path, lineno, f"malformed JSON: {e.msg} (column {e.colno})") from None
    except RecursionError:
        raise XMCDataError(path, lineno, "malformed JSON (nested too deep)") from None
    except ValueError:  # "Exceeds the limit (4300 digits) for integer string conversion"
        raise XMCDataError(path, lineno, _long_integer_fault(line)) from None
    if not isinstance(obj, dict):
        raise XMCDataError(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
    if "\\ud" in line or "\\uD" in line:  # the file decoded as strict UTF-8: only a \\uD800-\\uDFFF escape makes a surrogate
        _check_surrogates(obj, path, lineno)
    return obj


def _check_surrogates(obj: dict[str, Any], path: PathLike, lineno: int) -> None:
    """Refuse a record whose strings (top-level values, and strings in top-level lists) hold a lone surrogate
    (``"\\ud800"``: valid JSON escapes, but no character; tokenizers and UTF-8 writers refuse it later, far from the
    file), naming the field. Run only on lines with such an escape, so reading costs nothing more otherwise."""
    for field, value in obj.items():
        for text in (value if isinstance(value, list) else (value,)):
            if not isinstance(text, str):
                continue
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise XMCDataError(path, lineno, f"field '{field}' holds an unpaired surrogate (\\u{ord(text[e.start]):04x})") from None


def _get_uid(obj: dict[str, Any], path: PathLike, lineno: int) -> str:
    """Return the record's ``uid`` as a string (strings and integers are accepted)."""
    if "uid" not in obj:
        raise XMCDataError(path, lineno, "missing field 'uid'")
    uid = obj["uid"]
    if isinstance(uid, str):
        return uid
    if isinstance(uid, int) and not isinstance(uid, bool):
        return str(uid)
    raise XMCDataError(path, lineno, f"field 'uid' must be a string, got {type(uid).__name__}")


def _get_text(obj: dict[str, Any], text_fields: Sequence[str], path: PathLike, lineno: int) -> str:
    """Join the requested text fields with a space; missing optional fields are skipped."""
    parts = []
    for field in text_fields:
        value = obj.get(field)
        if value is None:
            if field in OPTIONAL_TEXT_FIELDS:
                continue
            raise XMCDataError(path, lineno, f"missing field '{field}'")
        if not isinstance(value, str):
            raise XMCDataError(path, lineno, f"field '{field}' must be a string, got {type(value).__name__}")
        if value:
            parts.append(value)
    return " ".join(parts)


def _get_images(obj: dict[str, Any], base_dir: str, check_images: bool, path: PathLike,
                lineno: int) -> list[str] | None:
    """Return the record's ``images`` as absolute paths (None when the field is absent).

    Relative paths resolve against ``base_dir`` (the JSON file's directory), so a dataset folder can
    be moved as a whole. With ``check_images`` every file must exist (a cheap ``os.path.exists``, so a
    typo surfaces at load time, not hours into training).
    """
    value = obj.get("images")
    if value is None:
        return None
    if not isinstance(value, list):
        raise XMCDataError(path, lineno, f"field 'images' must be a list of image paths, got {type(value).__name__}")
    out = []
    for j, entry in enumerate(value):
        if not isinstance(entry, str) or not entry:
            got = type(entry).__name__ if not isinstance(entry, str) else "an empty string"
            raise XMCDataError(path, lineno, f"field 'images' entry {j} must be a non-empty path string, got {got}")
        resolved = os.path.normpath(os.path.join(base_dir, entry))  # join keeps absolute entries as they are
        if check_images and not os.path.exists(resolved):
            raise XMCDataError(path, lineno, f"image file not found: {entry!r} (resolved to {resolved})")
        out.append(resolved)
    return out


def _finish_images(images: list[list[str] | None]) -> list[list[str]] | None:
    """None when no record had an ``images`` field (text-only file), else one list per record."""
    if all(item is None for item in images):
        return None
    return [item if item is not None else [] for item in images]


_MAX_LABEL_ID = 2**63 - 1


def _short_int(value: int) -> str:
    """An integer for a one-line message: as is up to 20 digits, else its first digits and its length."""
    text = str(value)
    return text if len(text) <= 20 else f"{text[:10]}... ({len(text.lstrip('-')):,} digits)"


def _check_text_fields(text_fields: Sequence[str]) -> tuple[str, ...]:
    """Validate the ``text_fields`` argument."""
    if isinstance(text_fields, str):
        text_fields = (text_fields,)
    fields = tuple(text_fields)
    if not fields:
        raise ValueError("text_fields must name at least one field")
    return fields


def read_xc_raw(path: PathLike, num_labels: int | None = None, text_fields: Sequence[str] = ("title",),
                skip_unlabeled: bool = True, check_images: bool = True) -> XMCDataset:
    """Read an XC-repository raw JSON-lines file (``trn.json.gz``/``tst.json.gz``) into an :class:`XMCDataset`.

    ``skip_unlabeled``: leave out the points whose ``target_ind`` is empty (counted in ``num_skipped``; ``source_rows``
    keeps the records a filter file refers to), as training and validation files are read; False keeps them as rows
    without a positive, as a test file is read by default (pyxclib averages over every test row: such a row scores 0).
    An optional ``images`` field (list of paths, relative to the file's directory) fills
    ``XMCDataset.images``; with ``check_images`` a missing image file is an error naming the line.
    """
    fields = _check_text_fields(text_fields)
    base_dir = os.path.dirname(os.path.abspath(path))
    if num_labels is not None and num_labels < 0:
        raise ValueError(f"num_labels must be >= 0, got {num_labels}")
    texts: list[str] = []
    uids: list[str] = []
    images: list[list[str] | None] = []
    # label ids and row offsets in typed arrays (8 bytes per id; a list of Python ints costs 36 bytes per id, and
    # 1.7 GB of freed int objects at LF-AmazonTitles-1.3M's 48M (query, label) pairs stays in the heap after loading)
    indices = array.array("q")
    indptr = array.array("q", [0])
    records: list[int] = []
    lines = array.array("q")  # the line of each kept point, for the duplicate-uid warning (8 bytes per point)
    skipped = 0
    max_id = -1
    record = -1
    fields_seen = False
    with _open_text(path) as f:
        for lineno, line in _iter_lines(f, path):
            if not line.strip():
                continue  # blank lines (e.g. a trailing one) carry no record
            record += 1
            obj = _parse_object(line, path, lineno)
            uid = _get_uid(obj, path, lineno)
            text = _get_text(obj, fields, path, lineno)
            fields_seen = fields_seen or any(field in obj for field in fields)
            item_images = _get_images(obj, base_dir, check_images, path, lineno)
            if "target_ind" not in obj:
                raise XMCDataError(path, lineno, "missing field 'target_ind'")
            ind = obj["target_ind"]
            if not isinstance(ind, list) or not all(type(x) is int for x in ind):
                raise XMCDataError(path, lineno, f"'target_ind' must be a list of ints, got {json.dumps(ind)[:80]}")
            if ind:
                lo, hi = min(ind), max(ind)
                if lo < 0:
                    raise XMCDataError(path, lineno, f"label id {_short_int(lo)} is negative")
                if num_labels is not None and hi >= num_labels:
                    raise XMCDataError(path, lineno, f"label id {_short_int(hi)} out of range (num_labels={num_labels})")
                if hi > _MAX_LABEL_ID:  # no label file to check against: the int64 id arrays bound it
                    raise XMCDataError(path, lineno, f"label id {_short_int(hi)} out of range (over 2**63 - 1)")
                if len(ind) > 1:
                    ind = sorted(set(ind))
                max_id = max(max_id, hi)
            elif skip_unlabeled:
                skipped += 1
                continue
            texts.append(text)
            uids.append(uid)
            images.append(item_images)
            records.append(record)
            lines.append(lineno)
            indices.extend(ind)
            indptr.append(len(indices))
    if num_labels is None:
        num_labels = max_id + 1
    if record >= 0 and not fields_seen:  # every line lacks every text field asked for: a typo in --text_fields
        raise XMCDataError(path, None, f"no line has the text field(s) {', '.join(repr(f) for f in fields)} (--text_fields)")
    if skipped:
        logger.warning("%s: skipped %d point(s) with no labels", os.fspath(path), skipped)
    elif not skip_unlabeled and len(indptr) > 1:
        empty = int(np.count_nonzero(np.diff(np.frombuffer(indptr, dtype=np.int64)) == 0))
        if empty:
            logger.info("%s: %d point(s) with no labels kept", os.fspath(path), empty)
    warn_duplicate_uids(path, uids, lines, "point")
    targets = sp.csr_matrix(
        (np.ones(len(indices), dtype=np.float32), np.frombuffer(indices, dtype=np.int64),
         np.frombuffer(indptr, dtype=np.int64)),
        shape=(len(texts), num_labels))
    targets.has_sorted_indices = True
    return XMCDataset(texts=texts, targets=targets, uids=uids, num_skipped=skipped,
                      source_rows=np.asarray(records, dtype=np.int64) if skipped else None,
                      images=_finish_images(images))


def warn_duplicate_uids(path: PathLike, uids: Sequence[str], lines: Sequence[int], what: str) -> int:
    """Log a warning when ``uids`` repeat: how many entries repeat an earlier uid, and the first two lines that share
    one. Returns that count. Memory: one sort of the uids (an index array of 8 bytes per entry)."""
    if len(uids) < 2:
        return 0
    values = np.array(uids, dtype=object)
    order = np.argsort(values, kind="stable")
    ranked = values[order]
    repeats = np.flatnonzero(ranked[1:] == ranked[:-1])
    if not repeats.size:
        return 0
    line_of = np.frombuffer(lines, dtype=np.int64) if isinstance(lines, array.array) else np.asarray(lines, dtype=np.int64)
    first = repeats[np.argmin(line_of[order[repeats + 1]])]  # the pair whose second line comes first
    a, b = sorted((int(line_of[order[first]]), int(line_of[order[first + 1]])))
    logger.warning("%s: %d %s(s) repeat a uid seen before (first: lines %d and %d share uid %r)", os.fspath(path), repeats.size, what, a, b, ranked[first])
    return int(repeats.size)


def read_xc_labels(path: PathLike, text_fields: Sequence[str] = ("title",), return_images: bool = False,
                   check_images: bool = True) -> tuple:
    """Read an XC-repository label file (``lbl.json.gz``) into ``(uids, texts)``; ``target_ind`` is ignored.

    With ``return_images`` the result is ``(uids, texts, images)``, ``images`` being one list of
    absolute image paths per label, or ``None`` when no line has an ``images`` field. The fields
    are validated either way (a malformed ``images`` is an error even when it is not returned).
    """
    fields = _check_text_fields(text_fields)
    base_dir = os.path.dirname(os.path.abspath(path))
    uids: list[str] = []
    texts: list[str] = []
    images: list[list[str] | None] = []
    lines = array.array("q")
    with _open_text(path) as f:
        for lineno, line in _iter_lines(f, path):
            if not line.strip():
                continue
            obj = _parse_object(line, path, lineno)
            uids.append(_get_uid(obj, path, lineno))
            texts.append(_get_text(obj, fields, path, lineno))
            images.append(_get_images(obj, base_dir, check_images, path, lineno))
            lines.append(lineno)
    if not uids:
        raise XMCDataError(path, None, "the label file is empty: it has no label line")
    warn_duplicate_uids(path, uids, lines, "label")
    if return_images:
        return uids, texts, _finish_images(images)
    return uids, texts


# --------------------------------------------------------------------------------------------
# writers
# --------------------------------------------------------------------------------------------


def _image_paths_for_file(items: Sequence[Sequence[str]], path: PathLike, relative_images: bool) -> list[list[str]]:
    """Image paths as stored in the JSON file written at ``path``.

    In-memory paths mean what ``open()`` makes of them (relative ones against the working directory).
    With ``relative_images`` a path inside the JSON file's directory is stored relative to it, so the
    dataset folder stays movable; any other path is stored absolute so it still resolves on reading.
    """
    base_dir = os.path.dirname(os.path.abspath(path))
    out = []
    for i, item in enumerate(items):
        if isinstance(item, (str, bytes)) or not isinstance(item, Sequence):
            raise TypeError(f"images[{i}] must be a list of image paths, got {type(item).__name__}")
        row = []
        for entry in item:
            if not isinstance(entry, (str, os.PathLike)) or not os.fspath(entry):
                raise TypeError(f"images[{i}] holds {entry!r}: only non-empty image paths can be written "
                                f"(save PIL images to files first)")
            full = os.path.abspath(os.fspath(entry))
            if relative_images:
                try:
                    rel = os.path.relpath(full, base_dir)
                except ValueError:  # another drive on Windows: no relative path exists
                    rel = os.pardir
                if rel != os.pardir and not rel.startswith(os.pardir + os.sep):
                    full = rel.replace(os.sep, "/")  # '/' so the file reads the same on every OS
            row.append(full)
        out.append(row)
    return out


def write_xc_raw(path: PathLike, dataset: XMCDataset, relative_images: bool = True) -> None:
    """Atomically write ``dataset`` as XC raw JSON-lines (text in ``title``; gzip when ``path`` ends in .gz).

    When ``dataset.images`` is set every line gets an ``images`` list; paths inside the output file's
    directory are written relative to it (``relative_images``), others absolute.
    """
    t = sp.csr_matrix(dataset.targets)
    t.sort_indices()
    n = t.shape[0]
    if len(dataset.texts) != n or len(dataset.uids) != n:
        raise ValueError(
            f"inconsistent dataset: {len(dataset.texts)} texts, {len(dataset.uids)} uids, {n} target rows")
    images = None
    if dataset.images is not None:
        if len(dataset.images) != n:
            raise ValueError(f"inconsistent dataset: {len(dataset.images)} image lists, {n} target rows")
        images = _image_paths_for_file(dataset.images, path, relative_images)
    ind = t.indices.tolist()
    ptr = t.indptr.tolist()
    with _atomic_text_writer(path) as f:
        for i in range(n):
            rec = {"uid": dataset.uids[i], "title": dataset.texts[i], "target_ind": ind[ptr[i]:ptr[i + 1]]}
            if images is not None:
                rec["images"] = images[i]
            f.write(json.dumps(rec, ensure_ascii=False))
            f.write("\n")


def write_xc_labels(path: PathLike, uids: Sequence[str], texts: Sequence[str],
                    images: Sequence[Sequence[str]] | None = None, relative_images: bool = True) -> None:
    """Atomically write a label file (``uid``, ``title``, empty ``target_ind`` and optional ``images`` per line).

    Image paths are stored as in :func:`write_xc_raw`.
    """
    if len(uids) != len(texts):
        raise ValueError(f"{len(uids)} uids but {len(texts)} texts")
    stored = None
    if images is not None:
        if len(images) != len(uids):
            raise ValueError(f"{len(uids)} uids but {len(images)} image lists")
        stored = _image_paths_for_file(images, path, relative_images)
    with _atomic_text_writer(path) as f:
        for i, (uid, text) in enumerate(zip(uids, texts, strict=True)):
            rec = {"uid": uid, "title": text, "target_ind": []}
            if stored is not None:
                rec["images"] = stored[i]
            f.write(json.dumps(rec, ensure_ascii=False))
            f.write("\n")


def check_training_points(train: XMCDataset, path: PathLike) -> XMCDataset:
    """``train``, read from ``path``, refused when it has no labelled point (an empty file, or only unlabelled lines)."""
    if len(train) == 0 and not train.num_skipped:
        raise XMCDataError(path, None, "the training file is empty: it has no point line")
    if len(train) == 0:
        raise XMCDataError(path, None, f"no training point has a label ({train.num_skipped} point(s) without one)")
    return train


def load_xc_dataset(train_file: PathLike, test_file: PathLike, label_file: PathLike,
                    text_fields: Sequence[str] = ("title",),
                    label_text_fields: Sequence[str] | None = None, check_images: bool = True,
                    skip_unlabeled_test_points: bool = False) -> XCData:
    """Load an XC raw dataset (train, test and label files); label ids are checked against the label file.

    ``label_text_fields`` defaults to ``text_fields``. Image paths (optional ``images`` fields) land in
    ``train.images``, ``test.images`` and ``label_images``; ``check_images`` checks that the files exist. Training
    points without a label are skipped; test points without one are kept (every metric averages over them, as pyxclib
    and the repository's tables do: such a point scores 0) unless ``skip_unlabeled_test_points``.
    """
    label_uids, label_texts, label_images = read_xc_labels(
        label_file, text_fields=label_text_fields or text_fields, return_images=True, check_images=check_images)
    num_labels = len(label_uids)
    train = check_training_points(read_xc_raw(train_file, num_labels=num_labels, text_fields=text_fields, check_images=check_images), train_file)
    test = read_xc_raw(test_file, num_labels=num_labels, text_fields=text_fields, check_images=check_images,
                       skip_unlabeled=skip_unlabeled_test_points)
    return XCData(train=train, test=test, label_texts=label_texts, label_uids=label_uids, label_images=label_images)
