"""``labels.jsonl`` read on demand: a model loaded from the file it saved itself parses a label's row when the row is
asked for (a prediction's top k, a sample of the tokenizer check), not 1.3M rows before its first answer.

What makes it safe: ``save_pretrained`` records the file it wrote in ``config.labels_file`` (its sha256, its row
count and the label set's digest, :meth:`labels_digest`). At load the file's bytes are hashed (~40 ms for the 1.3M-label
file of ``bench_serving.py``'s model, against ~0.9 s to parse it); only when they are the bytes that were written, a
file that was valid when written, are its rows left unparsed and the recorded digest trusted. Any other file (edited
by hand, or saved before the record existed) is read and checked row by row as before (:func:`model_files.read_labels`).

Memory model: the file's bytes (~55 B a label at 1.3M synthetic labels) and one int64 row end (8 B a label) while
nothing is parsed; a row parsed on demand is not kept. The first pass over a whole column (``list(model.label_uids)``,
iterating, comparing two label lists, pickling) parses the file once in one C-level call and keeps both columns as
lists: from then on the memory of eagerly read labels (the bytes are dropped).
"""

from __future__ import annotations

import hashlib
import json
import operator
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import numpy as np

from .model_files import parse_labels

#: the config attribute ``save_pretrained`` records the written ``labels.jsonl`` in
RECORD_KEY = "labels_file"
#: the columns of a row, in the order of the file's objects
FIELDS = ("uid", "text")
#: labels encoded and written at a time by :func:`write_labels_file` (~4 MB of bytes at 60 B a row)
WRITE_CHUNK = 65536


def write_labels_file(path: str, uids: Sequence[str], texts: Sequence[str], digest: str) -> dict:
    """Write ``labels.jsonl`` (one ``{"uid", "text"}`` object a line, in label-id order) and return its record for
    ``config.labels_file``: ``{"sha256", "rows", "digest"}`` (``digest``: the label set's, :meth:`labels_digest`). Labels
    still unparsed from a file of this kind are copied as they are (the same bytes, so the same record). Memory: the
    encoded rows of one :data:`WRITE_CHUNK` at a time."""
    h = hashlib.sha256()
    source = getattr(texts, "rows", None)
    with open(path, "wb") as f:
        raw = source.raw if isinstance(source, LabelRows) and source is getattr(uids, "rows", None) else None
        if raw is not None:
            f.write(raw[0])
            h.update(raw[0])
        else:
            for start in range(0, len(texts), WRITE_CHUNK):  # a chunk's bytes at a time
                stop = min(start + WRITE_CHUNK, len(texts))
                chunk = b"".join(json.dumps({"uid": uids[i], "text": texts[i]}, ensure_ascii=False).encode("utf-8") + b"\n" for i in range(start, stop))
                f.write(chunk)
                h.update(chunk)
    return {"sha256": h.hexdigest(), "rows": len(texts), "digest": digest}


def open_labels_file(data: bytes, record: Any, path: str) -> Optional[LabelRows]:
    """The rows of ``labels.jsonl``'s bytes ``data`` left unparsed, if ``record`` (``config.labels_file``) says these are
    the bytes ``save_pretrained`` wrote; else None (the caller parses and checks every row)."""
    if not isinstance(record, dict) or not isinstance(record.get("sha256"), str) or not isinstance(record.get("digest"), str):
        return None
    if not isinstance(record.get("rows"), int) or hashlib.sha256(data).hexdigest() != record["sha256"]:
        return None
    ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 0x0A)  # a JSON string holds no raw newline
    if len(ends) != record["rows"] or (len(data) and data[-1:] != b"\n"):
        return None
    return LabelRows(data, ends, path, record["digest"])


class LabelRows:
    """The rows of one ``labels.jsonl`` as its bytes and row ends (:attr:`raw`, until the whole file is parsed into
    :attr:`columns`); :attr:`uids` and :attr:`texts` are its two columns (:class:`LabelColumn`). Thread-safe: a server's
    threads may read rows while one of them parses the whole file (``columns`` is set before ``raw`` is dropped, and
    ``raw`` is one attribute, so a reader sees the bytes and their row ends of one state)."""

    def __init__(self, data: bytes, ends: np.ndarray, path: str, digest: str):
        self.raw: Optional[tuple[bytes, np.ndarray]] = (data, ends)
        self.path = path
        self.digest = digest
        self.num_rows = len(ends)
        self.columns: Optional[tuple[list[str], list[str]]] = None
        self._lock = threading.Lock()
        self.uids = LabelColumn(self, 0)
        self.texts = LabelColumn(self, 1)

    def value(self, i: int, column: int) -> str:
        """Column ``column`` of label ``i`` (``0 <= i < num_rows``): parsed from its row now, or from the parsed lists."""
        raw = self.raw
        if raw is None:
            return self.columns[column][i]
        data, ends = raw
        start = int(ends[i - 1]) + 1 if i else 0
        return json.loads(data[start : int(ends[i])])[FIELDS[column]]

    def materialize(self) -> tuple[list[str], list[str]]:
        """Both columns as lists, the whole file parsed once (:func:`model_files.parse_labels`); the bytes and row ends
        are dropped after."""
        with self._lock:
            if self.columns is None:
                self.columns = parse_labels(self.path, self.raw[0].decode("utf-8"))
                self.raw = None
        return self.columns


class LabelColumn(Sequence):
    """One column (uids or texts) of :class:`LabelRows`: a read-only sequence of strings, indexed without parsing the
    other rows; a whole-column pass parses the file once (:meth:`LabelRows.materialize`). Compares equal to any sequence
    of the same strings; pickles as a plain list."""

    def __init__(self, rows: LabelRows, column: int):
        self.rows = rows
        self.column = column

    def as_list(self) -> list[str]:
        """The column as a list (the file parsed once, shared by both columns)."""
        return self.rows.materialize()[self.column]

    def __len__(self) -> int:
        return self.rows.num_rows

    def __getitem__(self, index):
        columns = self.rows.columns
        if columns is not None:
            return columns[self.column][index]
        if isinstance(index, slice):
            picked = range(*index.indices(len(self)))
            if len(picked) > max(len(self) // 16, 1024):  # a large part of the column: one parse of the file
                return self.as_list()[index]
            return [self[i] for i in picked]
        i = operator.index(index)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"label id {index} out of range for {len(self)} labels")
        return self.rows.value(i, self.column)

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_list())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LabelColumn) and other.rows is self.rows:
            return other.column == self.column
        if isinstance(other, (str, bytes)) or not isinstance(other, Sequence):
            return NotImplemented
        return len(other) == len(self) and self.as_list() == list(other)

    __hash__ = None  # a list's

    def __add__(self, other):
        return self.as_list() + list(other)

    def __radd__(self, other):
        return list(other) + self.as_list()

    def __reduce__(self):
        return list, (self.as_list(),)

    def __repr__(self) -> str:
        state = "parsed" if self.rows.columns is not None else "read on demand"
        return f"<{len(self)} label {FIELDS[self.column]}s of {self.rows.path}, {state}>"
