"""Sparse bag-of-words text formats of the Extreme Classification Repository.

Two variants, both optionally gzip-compressed (decided by a ``.gz`` suffix):

* **BoW data file** (``train.txt`` / ``test.txt``): a header ``num_points num_features num_labels``
  then one line per point, ``l1,l2,... f:v f:v ...``. A point without labels has an empty label
  list, i.e. its line starts with a space (a first token containing ``:`` is also read as a
  feature). Read with :func:`read_bow`, written with :func:`write_bow`.
* **Sparse matrix file** (``trn_X_Xf.txt``, ``trn_X_Y.txt``, ...): a header ``n_rows n_cols`` then
  one line per row of ``i:v`` pairs (an empty line is an empty row). Read with
  :func:`read_sparse_matrix`, written with :func:`write_sparse_matrix`.

Indices are 0-based. Values are read as float32 and written with 9 significant digits, which
round-trips float32 exactly. Duplicate indices in a row are summed (features) or merged (labels).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

import numpy as np
import scipy.sparse as sp

from .xc_raw import PathLike, XMCDataError, _atomic_text_writer, _iter_lines, _open_text

__all__ = ["read_bow", "write_bow", "read_sparse_matrix", "write_sparse_matrix"]


def _parse_header(lines: Iterator[tuple[int, str]], path: PathLike, names: tuple[str, ...]) -> list[int]:
    """Parse the header line: ``len(names)`` non-negative integers."""
    expected = " ".join(names)
    try:
        lineno, header = next(lines)
    except StopIteration:
        raise XMCDataError(path, 1, f"bad header: file is empty (expected '{expected}')") from None
    parts = header.split()
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(parts) != len(names) or len(values) != len(names) or min(values) < 0:
        raise XMCDataError(path, lineno, f"bad header {header[:80]!r}: expected '{expected}' "
                                         f"({len(names)} non-negative integers)")
    return values


def _parse_pairs(text: str, n_cols: int, path: PathLike, lineno: int, idx: array, val: array,
                 what: str = "column") -> None:
    """Append the ``i:v`` pairs of ``text`` to ``idx``/``val``, checking ``0 <= i < n_cols``."""
    for tok in text.split():
        i_str, sep, v_str = tok.partition(":")
        try:
            if not sep:
                raise ValueError
            i = int(i_str)
            v = float(v_str)
        except ValueError:
            raise XMCDataError(path, lineno, f"malformed pair {tok[:40]!r} (expected 'index:value')") from None
        if not 0 <= i < n_cols:
            raise XMCDataError(path, lineno, f"{what} index {i} out of range [0, {n_cols})")
        idx.append(i)
        val.append(v)


def _too_few_rows(path: PathLike, lineno: int, n_rows: int, found: int) -> XMCDataError:
    """Error for a file that ends before the number of rows declared in its header."""
    return XMCDataError(path, lineno, f"wrong number of rows: header declares {n_rows}, file ends after {found}")


def _too_many_rows(path: PathLike, lineno: int, n_rows: int) -> XMCDataError:
    """Error for a file with more rows than declared in its header."""
    return XMCDataError(path, lineno, f"wrong number of rows: header declares {n_rows}, found more")


def _csr(ptr: list[int], idx: array, val: array | None, shape: tuple[int, int], binary: bool) -> sp.csr_matrix:
    """Assemble a canonical (sorted, duplicate-free) float32 CSR matrix."""
    indices = np.frombuffer(idx, dtype=np.int64) if len(idx) else np.zeros(0, dtype=np.int64)
    if binary:
        data = np.ones(len(indices), dtype=np.float32)
    else:
        data = np.frombuffer(val, dtype=np.float64).astype(np.float32) if len(val) else np.zeros(0, np.float32)
    m = sp.csr_matrix((data, indices.copy(), np.asarray(ptr, dtype=np.int64)), shape=shape)
    m.sum_duplicates()  # also sorts indices
    if binary:
        m.data[:] = 1.0
    return m


def read_bow(path: PathLike) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """Read an XC-repository BoW data file into ``(features, labels)`` float32 CSR matrices."""
    with _open_text(path) as f:
        lines = _iter_lines(f, path)
        n_rows, n_feat, n_lab = _parse_header(lines, path, ("num_points", "num_features", "num_labels"))
        f_idx, f_val, l_idx = array("q"), array("d"), array("q")
        f_ptr, l_ptr = [0], [0]
        lineno, rows = 1, 0
        for lineno, line in lines:
            if rows >= n_rows:
                raise _too_many_rows(path, lineno, n_rows)
            rows += 1
            if not line or line[0].isspace():
                label_part, feat_part = "", line
            else:
                label_part, _, feat_part = line.partition(" ")
                if ":" in label_part:  # no label list at all, the line starts with a feature
                    label_part, feat_part = "", line
            if label_part:
                for tok in label_part.split(","):
                    try:
                        lab = int(tok)
                    except ValueError:
                        raise XMCDataError(path, lineno, f"malformed label list {label_part[:60]!r}") from None
                    if not 0 <= lab < n_lab:
                        raise XMCDataError(path, lineno, f"label index {lab} out of range [0, {n_lab})")
                    l_idx.append(lab)
            _parse_pairs(feat_part, n_feat, path, lineno, f_idx, f_val, what="feature")
            f_ptr.append(len(f_idx))
            l_ptr.append(len(l_idx))
        if rows < n_rows:
            raise _too_few_rows(path, lineno + 1, n_rows, rows)
    X = _csr(f_ptr, f_idx, f_val, (n_rows, n_feat), binary=False)
    Y = _csr(l_ptr, l_idx, None, (n_rows, n_lab), binary=True)
    return X, Y


def read_sparse_matrix(path: PathLike) -> sp.csr_matrix:
    """Read an ``n_rows n_cols`` header + ``i:v`` lines file into a float32 CSR matrix."""
    with _open_text(path) as f:
        lines = _iter_lines(f, path)
        n_rows, n_cols = _parse_header(lines, path, ("n_rows", "n_cols"))
        idx, val = array("q"), array("d")
        ptr = [0]
        lineno, rows = 1, 0
        for lineno, line in lines:
            if rows >= n_rows:
                raise _too_many_rows(path, lineno, n_rows)
            rows += 1
            _parse_pairs(line, n_cols, path, lineno, idx, val)
            ptr.append(len(idx))
        if rows < n_rows:
            raise _too_few_rows(path, lineno + 1, n_rows, rows)
    return _csr(ptr, idx, val, (n_rows, n_cols), binary=False)


def _pairs(indices: list[int], values: list[float]) -> str:
    """Format ``i:v`` pairs (9 significant digits round-trip float32)."""
    return " ".join(f"{i}:{v:.9g}" for i, v in zip(indices, values, strict=True))


def _as_csr(M: object, name: str) -> sp.csr_matrix:
    """Return ``M`` as a canonical CSR matrix (dense arrays are accepted)."""
    m = sp.csr_matrix(M)
    if m.ndim != 2:
        raise ValueError(f"{name} must be 2-D, got shape {m.shape}")
    m = m.copy()
    m.sum_duplicates()
    return m


def write_bow(path: PathLike, X: object, Y: object) -> None:
    """Atomically write features ``X`` and labels ``Y`` (nonzeros = labels) as an XC BoW data file."""
    X, Y = _as_csr(X, "X"), _as_csr(Y, "Y")
    if X.shape[0] != Y.shape[0]:
        raise ValueError(f"X has {X.shape[0]} rows but Y has {Y.shape[0]}")
    Y.eliminate_zeros()
    xi, xv, xp = X.indices.tolist(), X.data.tolist(), X.indptr.tolist()
    yi, yp = Y.indices.tolist(), Y.indptr.tolist()
    with _atomic_text_writer(path) as f:
        f.write(f"{X.shape[0]} {X.shape[1]} {Y.shape[1]}\n")
        for r in range(X.shape[0]):
            labels = ",".join(map(str, yi[yp[r]:yp[r + 1]]))
            feats = _pairs(xi[xp[r]:xp[r + 1]], xv[xp[r]:xp[r + 1]])
            # an unlabeled point starts with a space, as in the XC repository files
            f.write(f"{labels} {feats}\n" if feats or not labels else f"{labels}\n")


def write_sparse_matrix(path: PathLike, M: object) -> None:
    """Atomically write ``M`` as an ``n_rows n_cols`` header + ``i:v`` lines file."""
    m = _as_csr(M, "M")
    mi, mv, mp = m.indices.tolist(), m.data.tolist(), m.indptr.tolist()
    with _atomic_text_writer(path) as f:
        f.write(f"{m.shape[0]} {m.shape[1]}\n")
        for r in range(m.shape[0]):
            f.write(_pairs(mi[mp[r]:mp[r + 1]], mv[mp[r]:mp[r + 1]]))
            f.write("\n")

