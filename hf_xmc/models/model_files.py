"""The files of a model directory (their names) and what the directory is checked for when it loads.

A model loads whole and right, or not at all: every fault below is found by ``from_pretrained``, not by the first
``predict``, and is refused with a :class:`ModelFileError`, one line that starts with the file's path (a Hub repo's
files are named ``<repo id>/<file>``). Only the weights and the label vectors (safetensors) are trusted; the faiss
index is a cache, checked against the label vectors and rebuilt from them when it does not match
(``label_index.py``). docs/reliability.md ("What a model directory is checked for on load") lists every check.

This file is part of the remote-code bundle of every hf_xmc model: it imports only numpy, torch and safetensors.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Optional

import numpy as np

# the files of a saved model directory besides the label store (label_store.py), the index (label_index.py) and the
# lexical channel (lexical_channel.py)
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
WEIGHT_SHARD_PATTERN = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# an adapter-only save: the encoder's peft adapter, in peft's own layout (PeftModel.from_pretrained(base, repo,
# subfolder="encoder_adapter") reads it), in a subfolder: transformers takes a top-level adapter_config.json for an
# adapter of the whole model and would load it as one
ADAPTER_DIR = "encoder_adapter"
ADAPTER_CONFIG_FILE = f"{ADAPTER_DIR}/adapter_config.json"
ADAPTER_WEIGHTS_FILE = f"{ADAPTER_DIR}/adapter_model.safetensors"
# what tokenizer classes write with save_pretrained (a tokenizer writes some of these)
TOKENIZER_FILES = (
    "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "added_tokens.json", "vocab.txt", "vocab.json",
    "merges.txt", "spiece.model", "sentencepiece.bpe.model", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)
MODEL_CARD_FILE = "README.md"
MODEL_CARD_ASSETS = ("xmc_metrics.png",)  # files the card shows; they travel with it
EVAL_RESULTS_FILE = "eval_results.json"  # a training run's metrics (the training script contract); pushed with the card

# label texts a tokenizer is tried on at load: enough to tell a vocabulary from a handful of special tokens, cheap at
# any label count
TOKENIZER_SAMPLE = 64


class ModelFileError(OSError, ValueError):
    """A file of a model directory that cannot be served as it is. The message is one line that starts with the file's
    path; an ``OSError`` (a file fault) and a ``ValueError`` (bad content) both, so callers that catch either see it."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # one line, whatever an underlying error's text held


def file_name(directory: str, name: str) -> str:
    """How a file of a model directory or Hub repo is named in an error: ``<directory or repo id>/<name>``."""
    return f"{str(directory).rstrip('/')}/{name}"


def check_listed_name(listing: str, name, what: str = "file") -> str:
    """``name`` as listed in the JSON file ``listing`` (a shard of the weights, of the label store, ...), refused
    unless it is a plain relative path inside the model directory: no absolute path, drive, ``..`` part or empty
    name. Returns it."""
    if not isinstance(name, str) or not name.strip():
        raise ModelFileError(f"{listing}: lists {what} {name!r}, which is not a file name")
    parts = re.split(r"[\\/]", name)
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name) or ".." in parts or os.path.isabs(name):
        raise ModelFileError(f"{listing}: lists {what} {name!r}, a path outside the model directory")
    return name


def check_weights_index(fetch: Callable[[str], Optional[str]], weights_file: str, index_file: str) -> None:
    """A sharded checkpoint's ``model.safetensors.index.json`` (read only when there is no single ``weights_file``):
    valid JSON whose ``weight_map`` maps tensor names to shard files inside the model directory."""
    index_path = fetch(index_file)
    if index_path is None or fetch(weights_file) is not None:
        return
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"weight_map is a {type(weight_map).__name__}")
    except (ValueError, KeyError, TypeError) as err:
        raise ModelFileError(f"{index_path}: not a weights index ({type(err).__name__}: {err})") from None
    for shard in dict.fromkeys(weight_map.values()):  # each shard once, in listing order
        check_listed_name(index_path, shard, "weight shard")


def check_weights_report(info: dict, weights_path: str, model_name: str, ignore_keys: Callable[[str], bool] = lambda key: False,
                         mismatched_ok: bool = False) -> None:
    """A strict load: transformers' loading report (``output_loading_info``) must show no tensor of the model missing
    from ``weights_path`` (which transformers would initialise at random), none in the file that the model lacks, and
    none of another shape (unless ``mismatched_ok``: the caller passed ``ignore_mismatched_sizes=True``). Keys for
    which ``ignore_keys`` is true (an adapter-only save's encoder, loaded afterwards) are not counted."""
    def listed(keys, what: str) -> None:
        keys = sorted(k for k in keys if not ignore_keys(k))
        if keys:
            more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
            raise ModelFileError(f"{weights_path}: {what} {keys[0]!r}{more}")

    listed(info.get("missing_keys") or (), f"has no tensor for {model_name}'s weight")
    listed(info.get("unexpected_keys") or (), f"holds a tensor that {model_name} has no place for:")
    if not mismatched_ok:
        mismatched = sorted((k, tuple(a), tuple(b)) for k, a, b in (info.get("mismatched_keys") or ()) if not ignore_keys(k))
        if mismatched:
            key, saved, wanted = mismatched[0]
            more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
            raise ModelFileError(f"{weights_path}: tensor {key!r} has shape {list(saved)} but {model_name} needs {list(wanted)}{more}")


def read_safetensors(path: str, framework: str = "pt", keys: Sequence[str] = ()) -> dict:
    """Every tensor of the safetensors file ``path`` (memory-mapped where the framework allows), refusing a file that
    is not valid safetensors (truncated by an interrupted download or copy, or not safetensors at all) or lacks one
    of ``keys``."""
    return read_safetensors_with_metadata(path, framework, keys)[0]


def read_safetensors_with_metadata(path: str, framework: str = "pt", keys: Sequence[str] = ()) -> tuple[dict, dict]:
    """:func:`read_safetensors` and the file's string metadata."""
    with open_safetensors(path, framework, keys) as f:
        return {name: f.get_tensor(name) for name in f.keys()}, f.metadata() or {}


@contextlib.contextmanager
def open_safetensors(path: str, framework: str = "pt", keys: Sequence[str] = ()) -> Iterator:
    """``safetensors.safe_open(path)``, for reading some of its tensors (or slices of them) only. A file that is not
    valid safetensors (or fails while read inside the block) or lacks one of ``keys`` is refused (``ModelFileError``)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework=framework) as f:
            names = set(f.keys())
            missing = [key for key in keys if key not in names]
            if missing:
                raise ModelFileError(f"{path}: holds no tensor {missing[0]!r} (it holds {', '.join(sorted(names)) or 'none'})")
            yield f
    except ModelFileError:
        raise
    except Exception as err:  # SafetensorError, OSError, ...: the file as a whole is unusable
        raise ModelFileError(f"{path}: not valid safetensors, truncated or corrupt ({err})") from None


def read_labels(path: str, data: Optional[bytes] = None) -> tuple[list[str], list[str]]:
    """``labels.jsonl``: one ``{"uid": str, "text": str}`` object per line, in label-id order; ``(uids, texts)``. A row
    that is not such an object (a null, a number, a missing field, a half line) is refused by file and line
    (:func:`parse_labels`). ``data``: the file's bytes when already read. A model reads the file it saved itself on
    demand instead (``label_file.py``)."""
    if data is None:
        with open(path, "rb") as f:
            data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ModelFileError(f"{path}: not UTF-8 text ({err})") from None
    if "\r" in text:  # line ends as a text-mode read turns them (a JSON string holds no raw carriage return)
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return parse_labels(path, text)


def parse_labels(path: str, text: str) -> tuple[list[str], list[str]]:
    """``(uids, texts)`` of the text of a ``labels.jsonl`` read from ``path`` (named in errors), checked as
    :func:`read_labels` says.

    The whole text is parsed as one JSON array first (its newlines made commas: one C-level parse, no string a line;
    a JSON string holds no raw newline, so only the row separators change), with the garbage collector paused while
    its 1.3M rows become objects (a collection would walk every object of the process, torch's included, again and
    again): 0.82 s at 1.3M labels in ``bench_serving.py``'s cold load (``load_parts_s``; 2 cores of an AMD EPYC, Zen 5,
    2026-12-05). Only a text that fails that check is read again line by line, for the line at fault. Memory: the
    file's text twice (as read and as the array), while its rows are parsed."""
    import gc

    text = text.rstrip("\n")
    num_lines = text.count("\n") + 1 if text else 0
    collecting = gc.isenabled()
    gc.disable()
    try:
        try:
            rows = json.loads("[" + text.replace("\n", ",") + "]")
        except ValueError:
            rows = None
        if rows is not None and len(rows) == num_lines and set(map(type, rows)) <= {dict}:  # each check one C-level pass
            try:
                uids, texts = [row["uid"] for row in rows], [row["text"] for row in rows]
            except KeyError:
                uids = texts = None
            if uids is not None and set(map(type, uids)) <= {str} and set(map(type, texts)) <= {str}:
                return uids, texts
    finally:
        if collecting:
            gc.enable()
    uids, texts = [], []
    for line_no, line in enumerate(text.split("\n") if text else (), 1):
        try:
            row = json.loads(line)
        except ValueError as err:
            raise ModelFileError(f"{path}, line {line_no}: malformed JSON ({err})") from None
        if not isinstance(row, dict) or "uid" not in row or "text" not in row:
            raise ModelFileError(f"{path}, line {line_no}: not a {{'uid', 'text'}} JSON object")
        bad = [key for key in ("uid", "text") if not isinstance(row[key], str)]
        if bad:
            raise ModelFileError(f"{path}, line {line_no}: {bad[0]} is {json.dumps(row[bad[0]])}, not a string")
        uids.append(row["uid"])
        texts.append(row["text"])
    return uids, texts


def label_text_sample(label_texts: Sequence[Optional[str]], size: int) -> list[str]:
    """Up to ``size`` non-empty label texts spread over the label space, read by position (labels read on demand stay
    unparsed but for these: ``label_file.py``); where the spread draws too few, the non-empty texts of the whole list."""
    def spread(n: int) -> np.ndarray:  # up to ``size`` positions spread evenly over range(n)
        return np.unique(np.linspace(0, n - 1, min(n, size)).astype(np.int64)) if n else np.empty(0, dtype=np.int64)

    positions = spread(len(label_texts))
    sample = [t for t in (label_texts[int(i)] for i in positions) if isinstance(t, str) and t.strip()]
    if len(sample) * 2 >= len(positions):
        return sample
    texts = [t for t in label_texts if isinstance(t, str) and t.strip()]  # mostly image-only labels (MUFIN)
    return [texts[i] for i in spread(len(texts))]


def check_tokenizer(tokenizer, label_texts: Sequence[Optional[str]], directory: str, fetch: Callable[[str], Optional[str]],
                    max_length: int, embedding_rows: Optional[int] = None) -> None:
    """The tokenizer a model with labels needs: present, and able to encode its own label texts. Tried on up to
    :data:`TOKENIZER_SAMPLE` label texts spread over the label space: a tokenizer that turns all of them into unknown
    and special tokens only (what transformers loads from ``tokenizer_config.json`` alone when ``tokenizer.json`` is
    missing: the special tokens and nothing else) is refused, naming the missing file; so is a token id beyond the
    encoder's ``embedding_rows``."""
    if tokenizer is None:
        raise ModelFileError(
            f"{file_name(directory, 'tokenizer_config.json')}: missing: the model has labels but no tokenizer files, so no query "
            "or label text can be encoded"
        )
    sample = label_text_sample(label_texts, TOKENIZER_SAMPLE)
    if not sample:  # image-only labels (MUFIN): nothing to try
        return
    ids = tokenizer(sample, add_special_tokens=False, truncation=True, max_length=max_length)["input_ids"]
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    if getattr(tokenizer, "unk_token_id", None) is not None:
        special.add(tokenizer.unk_token_id)
    words = [i for row in ids for i in row if i not in special]
    if not words:
        unk = getattr(tokenizer, "unk_token", None) or "unknown tokens"
        if fetch("tokenizer.json") is None:
            raise ModelFileError(
                f"{file_name(directory, 'tokenizer.json')}: missing: the tokenizer loaded without it ({len(tokenizer)} tokens) turns "
                f"every label text into {unk}"
            )
        raise ModelFileError(
            f"{file_name(directory, 'tokenizer.json')}: its tokenizer ({len(tokenizer)} tokens) turns every label text into {unk}: "
            "not the vocabulary the model was trained with"
        )
    largest = max(max(row) for row in ids if row)
    if embedding_rows is not None and largest >= embedding_rows:
        raise ModelFileError(
            f"{file_name(directory, 'tokenizer.json')}: gives token id {largest} but the encoder has "
            f"{embedding_rows} token embeddings: not the tokenizer of this model"
        )


def check_loaded_model(model, directory: str, fetch: Callable[[str], Optional[str]], store_path: str) -> None:
    """What only a loaded model as a whole can tell, checked last in ``from_pretrained``: ``config.json``'s sequence
    lengths fit the encoder's positions; a model with labels has a tokenizer that encodes them
    (:func:`check_tokenizer`); and its query vectors have the width of the label vectors in ``store_path`` (one label
    text is encoded to measure it: a forward pass of one short text)."""
    fault = model.config.sequence_length_fault()
    if fault:
        raise ModelFileError(f"{fetch('config.json') or file_name(directory, 'config.json')}: {fault}")
    texts = model.label_texts
    if not texts:
        return
    embeddings = model.encoder.get_input_embeddings() if hasattr(model.encoder, "get_input_embeddings") else None
    check_tokenizer(model.tokenizer, texts, directory, fetch, model.config.label_max_seq_length, getattr(embeddings, "num_embeddings", None))
    if model.label_index is not None:
        probe = next(iter(label_text_sample(texts, 1)), "x")  # the first non-empty text
        width = model.query_search_vectors([probe], batch_size=1, show_progress_bar=False).shape[1]
        if width != model.label_index.dim:
            raise ModelFileError(f"{store_path}: label vectors of width {model.label_index.dim}, but the model's query vectors have {width}")


class DropLoadReport(logging.Filter):
    """Drops transformers' "LOAD REPORT" table (a logging filter): ``from_pretrained`` refuses every entry it would list,
    in one line (:func:`check_weights_report`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)


def _delimits(offsets: np.ndarray, num_rows: int) -> bool:
    """Whether 1-D ``offsets`` slice ``num_rows`` rows into groups: from 0, non-decreasing, ending at ``num_rows``."""
    return int(offsets[0]) == 0 and not bool(np.any(np.diff(offsets) < 0)) and int(offsets[-1]) == num_rows


def check_csr(path: str, indptr: np.ndarray, indices: np.ndarray, data: np.ndarray, num_columns: int, what: str) -> None:
    """CSR rows read from ``path`` (``what`` names them in the error): 1-D arrays, ``indptr`` from 0, non-decreasing, up
    to ``len(indices) == len(data)``, every column id in ``[0, num_columns)``."""
    if indptr.ndim != 1 or indices.ndim != 1 or data.ndim != 1 or len(indptr) < 1:
        raise ModelFileError(f"{path}: {what} are not 1-D arrays (shapes {indptr.shape}, {indices.shape}, {data.shape})")
    if not _delimits(indptr, len(indices)) or len(indices) != len(data):
        raise ModelFileError(
            f"{path}: {what}: the row pointers do not delimit the {len(indices)} entries (first {int(indptr[0])}, last "
            f"{int(indptr[-1])}, {len(data)} values)"
        )
    if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= num_columns):
        raise ModelFileError(f"{path}: {what}: column id {int(indices.max()) if int(indices.min()) >= 0 else int(indices.min())} out of range [0, {num_columns})")


def check_offsets(path: str, offsets, num_groups: int, num_rows: int, what: str) -> None:
    """Group offsets read from ``path`` (``what`` names them): 1-D, ``num_groups + 1`` of them, from 0, non-decreasing,
    ending at ``num_rows`` (the rows the groups slice)."""
    offsets = np.asarray(offsets)
    if offsets.ndim != 1 or len(offsets) != num_groups + 1:
        raise ModelFileError(f"{path}: {what} has shape {list(offsets.shape)}, expected [{num_groups + 1}]")
    if not _delimits(offsets, num_rows):
        raise ModelFileError(f"{path}: {what} do not delimit {num_rows} rows (first {int(offsets[0])}, last {int(offsets[-1])}, or not increasing)")
