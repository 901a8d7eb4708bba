"""Label filter files and filtered top-k predictions.

Several XC-repository datasets (the "LF-"/"Titles" ones built from cross-linked products or
articles) ship ``filter_labels_train.txt`` / ``filter_labels_test.txt``: one ``point_idx label_idx``
pair per line (0-based, whitespace separated; an empty file is valid). Such a pair must be removed
from the predictions of that point before computing metrics (e.g. a product predicting itself).
"""

from __future__ import annotations

from array import array

import numpy as np
import scipy.sparse as sp

from .xc_raw import PathLike, XMCDataError, _iter_lines, _open_text

__all__ = ["read_filter_file", "filter_predictions", "filter_overlap_pairs"]


def read_filter_file(path: PathLike, num_points: int, num_labels: int) -> sp.csr_matrix:
    """Read a filter file into a boolean ``(num_points x num_labels)`` CSR matrix of pairs to remove."""
    rows, cols = array("q"), array("q")
    with _open_text(path) as f:
        for lineno, line in _iter_lines(f, path):
            parts = line.split()
            if not parts:
                continue  # blank line
            try:
                if len(parts) != 2:
                    raise ValueError
                p, lab = int(parts[0]), int(parts[1])
            except ValueError:
                raise XMCDataError(path, lineno, f"malformed line {line[:60]!r} "
                                                 "(expected 'point_idx label_idx')") from None
            if not 0 <= p < num_points:
                raise XMCDataError(path, lineno, f"point index {p} out of range [0, {num_points})")
            if not 0 <= lab < num_labels:
                raise XMCDataError(path, lineno, f"label index {lab} out of range [0, {num_labels})")
            rows.append(p)
            cols.append(lab)
    r = np.frombuffer(rows, dtype=np.int64) if len(rows) else np.zeros(0, np.int64)
    c = np.frombuffer(cols, dtype=np.int64) if len(cols) else np.zeros(0, np.int64)
    m = sp.csr_matrix((np.ones(len(r), dtype=bool), (r, c)), shape=(num_points, num_labels))
    m.sum_duplicates()
    return m


def filter_predictions(label_ids: np.ndarray, scores: np.ndarray, filter_matrix: sp.spmatrix | None,
                       k: int) -> tuple[np.ndarray, np.ndarray]:
    """Drop filtered (point, label) pairs from ranked predictions and keep the first ``k`` survivors per row.

    ``label_ids``/``scores`` are ``(n, m)`` arrays ranked best-first; negative ids are treated as
    padding and dropped too. Rows with fewer than ``k`` survivors are padded with id ``-1`` and
    score ``-inf``. Returns ``(ids, scores)`` of shape ``(n, k)``, the order of survivors kept.
    """
    ids = np.asarray(label_ids)
    sc = np.asarray(scores)
    if ids.ndim != 2 or sc.shape != ids.shape:
        raise ValueError(f"label_ids and scores must be 2-D arrays of the same shape, got {ids.shape} and {sc.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"label_ids must be integers, got {ids.dtype}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    n, m = ids.shape
    keep = ids >= 0
    if filter_matrix is not None:
        fm = sp.csr_matrix(filter_matrix)
        if fm.shape[0] != n:
            raise ValueError(f"filter matrix has {fm.shape[0]} rows but there are {n} prediction rows")
        fm.eliminate_zeros()
        if fm.nnz:
            num_cols = fm.shape[1]
            # encode each filtered pair as row * num_cols + col; the CSR order makes the keys sorted
            frows = np.repeat(np.arange(n, dtype=np.int64), np.diff(fm.indptr))
            fkeys = frows * num_cols + fm.indices.astype(np.int64)
            fkeys.sort()
            in_range = keep & (ids < num_cols)
            pkeys = np.arange(n, dtype=np.int64)[:, None] * num_cols + np.where(in_range, ids, 0).astype(np.int64)
            pos = np.searchsorted(fkeys, pkeys)
            hit = fkeys[np.minimum(pos, fkeys.size - 1)] == pkeys
            keep &= ~(hit & in_range)
    out_dtype = sc.dtype if np.issubdtype(sc.dtype, np.floating) else np.float32
    out_ids = np.full((n, k), -1, dtype=ids.dtype if np.issubdtype(ids.dtype, np.signedinteger) else np.int64)
    out_sc = np.full((n, k), -np.inf, dtype=out_dtype)
    if n and m and k:
        rank = np.cumsum(keep, axis=1) - 1  # position of each survivor within its row
        sel = keep & (rank < k)
        r, c = np.nonzero(sel)
        out_ids[r, rank[r, c]] = ids[r, c]
        out_sc[r, rank[r, c]] = sc[r, c]
    return out_ids, out_sc


def filter_overlap_pairs(filter_matrix: sp.spmatrix, targets: sp.spmatrix) -> int:
    """Number of (point, label) pairs that are both in ``filter_matrix`` and positives of ``targets``: positives that
    :func:`filter_predictions` removes from every ranking, so no model can ever hit them (the repository's filter files
    list pairs its ground truth no longer holds, so a well-formed dataset gives 0). A filter column beyond the targets'
    is no positive. Memory: a few arrays of ``nnz(filter_matrix)`` entries (the targets are looked up, not copied)."""
    fm, truth = sp.csr_matrix(filter_matrix), sp.csr_matrix(targets)
    if fm.shape[0] != truth.shape[0]:
        raise ValueError(f"filter matrix has {fm.shape[0]} rows but the targets have {truth.shape[0]}")
    rows = np.repeat(np.arange(fm.shape[0], dtype=np.int64), np.diff(fm.indptr))
    keep = (fm.data != 0) & (fm.indices < truth.shape[1])
    if not keep.any():
        return 0
    return int(np.count_nonzero(np.asarray(truth[rows[keep], fm.indices[keep]]).ravel()))
