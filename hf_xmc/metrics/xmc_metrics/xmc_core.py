"""Vectorised extreme multi-label classification (XMC) ranking metrics (numpy/scipy only).

This file is the single implementation of the XMC metrics. It is used both by
``hf_xmc.metrics`` (which loads and re-exports it) and by the ``evaluate`` module
``xmc_metrics.py`` that sits next to it (``evaluate`` copies relatively imported sibling
files into its module cache), so it must only import numpy/scipy and the standard library.

Conventions (identical to pyxclib ``xclib/evaluation/xc_metrics.py`` and napkinxc
``napkinxc.metrics``; all per-query values are averaged over ALL ``n`` queries, queries
without any positive label included):

* ``topk`` is an ``(n, K)`` integer array of predicted label ids, best first. Negative
  entries (e.g. ``-1`` padding) mean "no prediction" and never count as a hit. If
  ``K > k`` only the first ``k`` columns are used; if ``K < k`` the missing ranks are misses.
  A label repeated in a row is credited only once, at its best (first) rank.
* ``truth`` is an ``(n, L)`` scipy sparse matrix; every stored non-zero is a positive.
  ``P_i`` denotes the set of positives of query ``i``.
* Ranks ``r`` are 1-based; the discount is ``1 / log2(r + 1)``.

Definitions (``hit_ir = 1`` iff the label at rank ``r`` of query ``i`` is in ``P_i``):

* ``P@k     = mean_i (1/k) sum_{r<=k} hit_ir``
* ``nDCG@k  = mean_i [sum_{r<=k} hit_ir / log2(r+1)] / [sum_{r<=min(k,|P_i|)} 1 / log2(r+1)]``
  (0 for a query with ``|P_i| = 0``).
* ``R@k     = mean_i (1/|P_i|) sum_{r<=k} hit_ir`` (0 for a query with ``|P_i| = 0``).
* ``PSP@k   = sum_i sum_{r<=k} hit_ir q_{l_ir} / sum_i sum_{r<=min(k,|P_i|)} q*_ir`` where ``q`` is
  the inverse propensity and ``q*_i1 >= q*_i2 >= ...`` are the inverse propensities of
  ``P_i`` sorted decreasingly (i.e. the un-normalised PSP averaged over queries, divided by
  the average best achievable un-normalised PSP; this is pyxclib's ``psprecision`` and
  napkinxc's ``psprecision_at_k(normalize=True)``).
* ``PSnDCG@k = sum_i psdcg_i / idcg_i / sum_i best_psdcg_i / idcg_i`` with
  ``psdcg_i = sum_{r<=k} hit_ir q_{l_ir} / log2(r+1)``,
  ``best_psdcg_i = sum_{r<=min(k,|P_i|)} q*_ir / log2(r+1)`` and ``idcg_i`` the nDCG normaliser
  (pyxclib ``psndcg`` / napkinxc ``psndcg_at_k(normalize=True)``).
* Inverse propensity (Jain et al. 2016, pyxclib ``compute_inv_propesity``):
  ``C = (ln N - 1) (B + 1)^A``, ``q_l = 1 + C (N_l + B)^(-A)`` with ``N`` training points and
  ``N_l`` the training frequency of label ``l``.

All metric functions return fractions in ``[0, 1]``; ``xmc_metrics`` returns percentages.
No ``(n, L)`` dense matrix is ever built: hits are found by a binary search of the
``row * L + label`` keys of the top-k in the (sorted) CSR keys of the ground truth.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import numpy as np
import scipy.sparse as sp

__all__ = [
    "PROPENSITY_CONSTANTS",
    "DATASET_PROPENSITY",
    "propensity_constants",
    "inverse_propensity",
    "label_lists_to_csr",
    "pad_rankings",
    "precision_at_k",
    "ndcg_at_k",
    "recall_at_k",
    "psprecision_at_k",
    "psndcg_at_k",
    "xmc_metrics",
    "precision_by_frequency_bucket",
    "coverage_at_k",
    "seen_unseen_metrics",
]

#: (A, B) constants of the Jain et al. (2016) propensity model per dataset family (pyxclib's documented values).
PROPENSITY_CONSTANTS: dict[str, tuple[float, float]] = {
    "amazon": (0.6, 2.6),
    "wikipedia": (0.5, 0.4),
    "default": (0.55, 1.5),
}

#: The family of :data:`PROPENSITY_CONSTANTS` of each known Extreme Classification Repository dataset, by lower-case
#: name: the repository's convention (and its methods' configs). Amazon product data 0.6 / 2.6, except AmazonCat
#: (0.55 / 1.5: pyxclib issue #7); Wikipedia-derived categories and tags 0.5 / 0.4; WikiSeeAlso (see-also links,
#: whose configs use 0.55 / 1.5) and everything else 0.55 / 1.5. The training presets read their constants here.
DATASET_PROPENSITY: dict[str, str] = {
    "amazon-670k": "amazon",
    "amazon-3m": "amazon",
    "amazontitles-670k": "amazon",
    "amazontitles-3m": "amazon",
    "lf-amazon-131k": "amazon",
    "lf-amazontitles-131k": "amazon",
    "lf-amazontitles-1.3m": "amazon",
    "amazoncat-13k": "default",
    "wikilshtc-325k": "wikipedia",
    "wiki10-31k": "wikipedia",
    "wikipedia-500k": "wikipedia",
    "lf-wikipedia-500k": "wikipedia",
    "lf-wikititles-500k": "wikipedia",
    "lf-wikiseealso-320k": "default",
    "lf-wikiseealsotitles-320k": "default",
    "wikiseealsotitles-350k": "default",
    "eurlex-4k": "default",
    "eurlex-4.3k": "default",
}


def propensity_constants(dataset_name: Optional[str], exact: bool = False) -> tuple[float, float]:
    """Return the (A, B) propensity constants of a dataset: its entry of :data:`DATASET_PROPENSITY` (name compared
    case-insensitively), else by substring ("amazoncat" and "seealso" default, then "amazon", then "wiki"), else the
    default 0.55 / 1.5. ``exact``: a name outside the table is a ``KeyError`` instead of a guess."""
    name = (dataset_name or "").strip().lower()
    if name in DATASET_PROPENSITY:
        return PROPENSITY_CONSTANTS[DATASET_PROPENSITY[name]]
    if exact:
        raise KeyError(f"no propensity constants recorded for dataset {dataset_name!r} (known: {', '.join(DATASET_PROPENSITY)})")
    if "amazoncat" in name or "seealso" in name:
        return PROPENSITY_CONSTANTS["default"]
    if "amazon" in name:
        return PROPENSITY_CONSTANTS["amazon"]
    if "wiki" in name:
        return PROPENSITY_CONSTANTS["wikipedia"]
    return PROPENSITY_CONSTANTS["default"]


def inverse_propensity(train_targets: sp.spmatrix, A: float = 0.55, B: float = 1.5) -> np.ndarray:
    """Return float64[L] inverse propensities 1 + C (n_l + B)^-A, C = (ln N - 1)(B + 1)^A (pyxclib)."""
    if sp.issparse(train_targets):
        num_points = train_targets.shape[0]
        freqs = np.asarray(train_targets.sum(axis=0), dtype=np.float64).ravel()
    else:
        arr = np.asarray(train_targets)
        if arr.ndim != 2:
            raise ValueError(f"train_targets must be a 2-D (n x L) matrix, got shape {arr.shape}")
        num_points = arr.shape[0]
        freqs = arr.sum(axis=0, dtype=np.float64)
    if num_points < 1:
        raise ValueError("train_targets must have at least one row")
    C = (np.log(num_points) - 1.0) * (B + 1.0) ** A
    return 1.0 + C * np.power(freqs + B, -A)


# --------------------------------------------------------------------------------------
# input handling
# --------------------------------------------------------------------------------------


def label_lists_to_csr(label_lists: Sequence[Sequence[int]], num_labels: int) -> sp.csr_matrix:
    """Build a binary (n x num_labels) CSR matrix from per-row lists of label ids (duplicates merged)."""
    lengths = np.fromiter((len(row) for row in label_lists), dtype=np.int64, count=len(label_lists))
    indptr = np.zeros(len(label_lists) + 1, dtype=np.int64)
    np.cumsum(lengths, out=indptr[1:])
    if indptr[-1] > 0:
        indices = np.concatenate([np.asarray(row, dtype=np.int64).ravel() for row in label_lists if len(row)])
    else:
        indices = np.zeros(0, dtype=np.int64)
    if indices.size and (indices.min() < 0 or indices.max() >= num_labels):
        raise ValueError(f"label ids must lie in [0, {num_labels}); got min {indices.min()} and max {indices.max()}")
    mat = sp.csr_matrix(
        (np.ones(indices.size, dtype=np.float64), indices, indptr), shape=(len(label_lists), int(num_labels))
    )
    mat.sum_duplicates()
    mat.data[:] = 1.0
    return mat


def pad_rankings(rankings: Sequence[Sequence[int]], width: Optional[int] = None, pad: int = -1) -> np.ndarray:
    """Stack ragged ranked label-id lists into an (n x width) int64 array padded with ``pad`` (-1)."""
    lengths = [len(row) for row in rankings]
    if width is None:
        width = max(lengths, default=0)
    out = np.full((len(rankings), max(int(width), 0)), pad, dtype=np.int64)
    for i, row in enumerate(rankings):
        m = min(len(row), out.shape[1])
        if m:
            out[i, :m] = np.asarray(row[:m], dtype=np.int64)
    return out


def _check_k(k: int, name: str = "k") -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"{name} must be a positive integer, got {k!r}")
    return int(k)


def _prepare(topk: np.ndarray, truth: sp.spmatrix) -> tuple[np.ndarray, sp.csr_matrix]:
    """Validate shapes and return (int64 topk, canonical binary CSR truth with sorted indices)."""
    topk = np.asarray(topk)
    if topk.ndim != 2:
        raise ValueError(f"topk must be a 2-D (n x K) array of label ids, got shape {topk.shape}")
    if topk.size and not np.issubdtype(topk.dtype, np.integer):
        if not np.issubdtype(topk.dtype, np.floating) or not np.all(np.equal(np.mod(topk, 1), 0)):
            raise ValueError(f"topk must contain integer label ids, got dtype {topk.dtype}")
    topk = topk.astype(np.int64, copy=False)
    if sp.issparse(truth):
        truth = sp.csr_matrix(truth)  # copy-free for csr_matrix/csr_array input
    else:
        arr = np.asarray(truth)
        if arr.ndim != 2:
            raise ValueError(f"truth must be a 2-D (n x L) scipy sparse matrix, got shape {arr.shape}")
        truth = sp.csr_matrix(arr)
    if topk.shape[0] != truth.shape[0]:
        raise ValueError(
            f"topk has {topk.shape[0]} rows but truth has {truth.shape[0]} rows; they must describe the same queries"
        )
    if topk.size and topk.max() >= truth.shape[1]:
        raise ValueError(f"topk contains label id {topk.max()} >= number of labels {truth.shape[1]}")
    if not (truth.has_canonical_format and np.all(truth.data != 0)):
        truth = truth.copy()
        truth.sum_duplicates()
        truth.eliminate_zeros()
    return topk, truth


def _fit_width(topk: np.ndarray, k: int) -> np.ndarray:
    """Return the first k columns of topk, right-padding with -1 when K < k."""
    if topk.shape[1] >= k:
        return topk[:, :k]
    pad = np.full((topk.shape[0], k - topk.shape[1]), -1, dtype=np.int64)
    return np.hstack([topk, pad])


def _hits(topk: np.ndarray, truth: sp.csr_matrix, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Return (bool (n x k) hit mask, int64 (n x k) label ids) for the first k ranks."""
    ids = _fit_width(topk, k)
    n, num_labels = truth.shape
    if n == 0 or truth.nnz == 0:
        return np.zeros(ids.shape, dtype=bool), ids
    rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(truth.indptr))
    truth_keys = rows * num_labels + truth.indices.astype(np.int64)  # sorted (canonical CSR)
    valid = ids >= 0
    query_keys = np.arange(n, dtype=np.int64)[:, None] * num_labels + np.where(valid, ids, 0)
    pos = np.searchsorted(truth_keys, query_keys)
    pos = np.minimum(pos, truth_keys.size - 1)
    hits = valid & (truth_keys[pos] == query_keys)
    if k > 1:
        # credit a label repeated within a row only at its first (best) rank
        order = np.argsort(ids, axis=1, kind="stable")
        sorted_ids = np.take_along_axis(ids, order, axis=1)
        dup_sorted = np.zeros(ids.shape, dtype=bool)
        dup_sorted[:, 1:] = (sorted_ids[:, 1:] == sorted_ids[:, :-1]) & (sorted_ids[:, 1:] >= 0)
        if dup_sorted.any():
            dup = np.zeros(ids.shape, dtype=bool)
            np.put_along_axis(dup, order, dup_sorted, axis=1)
            hits &= ~dup
    return hits, ids


def _discounts(k: int) -> np.ndarray:
    return 1.0 / np.log2(np.arange(2, k + 2, dtype=np.float64))


def _num_positives(truth: sp.csr_matrix) -> np.ndarray:
    return np.diff(truth.indptr).astype(np.int64)


def _idcg(num_pos: np.ndarray, k: int) -> np.ndarray:
    """Per-row nDCG normaliser sum_{r<=min(k,|P_i|)} 1/log2(r+1) (0 for rows without positives)."""
    cum = np.concatenate([[0.0], np.cumsum(_discounts(k))])
    return cum[np.minimum(num_pos, k)]


def _check_inv_propensity(inv_propensity: np.ndarray, num_labels: int) -> np.ndarray:
    inv_p = np.asarray(inv_propensity, dtype=np.float64)
    if inv_p.ndim != 1 or inv_p.shape[0] != num_labels:
        raise ValueError(
            f"inv_propensity must be a 1-D array with one entry per label ({num_labels}), got shape {inv_p.shape}"
        )
    return inv_p


def _best_ps_gains(truth: sp.csr_matrix, inv_p: np.ndarray, k: int, discounted: bool) -> np.ndarray:
    """Per row: sum over the min(k,|P_i|) largest inverse propensities of P_i (decreasing, optionally discounted)."""
    n = truth.shape[0]
    if truth.nnz == 0:
        return np.zeros(n, dtype=np.float64)
    rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(truth.indptr))
    w = inv_p[truth.indices]
    order = np.lexsort((-w, rows))  # by row, then decreasing weight
    rank = np.arange(truth.nnz, dtype=np.int64) - truth.indptr[rows]  # rows is already sorted
    w_sorted = w[order]
    keep = rank < k
    gains = w_sorted[keep]
    if discounted:
        gains = gains * _discounts(k)[rank[keep]]
    return np.bincount(rows[keep], weights=gains, minlength=n)


# --------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------


def _precision_from_hits(hits: np.ndarray, k: int) -> float:
    return float(hits[:, :k].sum(axis=1).mean() / k) if hits.shape[0] else 0.0


def _ndcg_from_hits(hits: np.ndarray, num_pos: np.ndarray, k: int) -> float:
    if hits.shape[0] == 0:
        return 0.0
    dcg = hits[:, :k] @ _discounts(k)
    idcg = _idcg(num_pos, k)
    ndcg = np.divide(dcg, idcg, out=np.zeros_like(dcg), where=idcg > 0)
    return float(ndcg.mean())


def _recall_from_hits(hits: np.ndarray, num_pos: np.ndarray, k: int) -> float:
    if hits.shape[0] == 0:
        return 0.0
    num_hits = hits[:, :k].sum(axis=1).astype(np.float64)
    pos = num_pos.astype(np.float64)
    rec = np.divide(num_hits, pos, out=np.zeros_like(num_hits), where=pos > 0)
    return float(rec.mean())


def _ps_gains(hits: np.ndarray, ids: np.ndarray, inv_p: np.ndarray) -> np.ndarray:
    return np.where(hits, inv_p[np.where(hits, ids, 0)], 0.0)


def _psp_from_gains(gains: np.ndarray, truth: sp.csr_matrix, inv_p: np.ndarray, k: int) -> float:
    # the 1/k factor and the 1/n of both means cancel in the ratio
    den = _best_ps_gains(truth, inv_p, k, discounted=False).sum()
    return float(gains[:, :k].sum() / den) if den > 0 else 0.0


def _psndcg_from_gains(
    gains: np.ndarray, truth: sp.csr_matrix, inv_p: np.ndarray, num_pos: np.ndarray, k: int
) -> float:
    psdcg = gains[:, :k] @ _discounts(k)
    best = _best_ps_gains(truth, inv_p, k, discounted=True)
    idcg = _idcg(num_pos, k)
    pos = idcg > 0  # rows without positives contribute 0 to numerator and denominator
    den = (best[pos] / idcg[pos]).sum()
    return float((psdcg[pos] / idcg[pos]).sum() / den) if den > 0 else 0.0


def precision_at_k(topk: np.ndarray, truth: sp.spmatrix, k: int) -> float:
    """Return P@k = mean over all rows of |top-k ∩ P_i| / k (fraction in [0, 1])."""
    k = _check_k(k)
    topk, truth = _prepare(topk, truth)
    hits, _ = _hits(topk, truth, k)
    return _precision_from_hits(hits, k)


def ndcg_at_k(topk: np.ndarray, truth: sp.spmatrix, k: int) -> float:
    """Return nDCG@k with IDCG over min(k, |P_i|) ranks; rows without positives count as 0."""
    k = _check_k(k)
    topk, truth = _prepare(topk, truth)
    hits, _ = _hits(topk, truth, k)
    return _ndcg_from_hits(hits, _num_positives(truth), k)


def recall_at_k(topk: np.ndarray, truth: sp.spmatrix, k: int) -> float:
    """Return R@k = mean over all rows of |top-k ∩ P_i| / |P_i| (rows without positives count as 0)."""
    k = _check_k(k)
    topk, truth = _prepare(topk, truth)
    hits, _ = _hits(topk, truth, k)
    return _recall_from_hits(hits, _num_positives(truth), k)


def psprecision_at_k(topk: np.ndarray, truth: sp.spmatrix, inv_propensity: np.ndarray, k: int) -> float:
    """Return normalised PSP@k = mean_i PSP_i@k / mean_i best achievable PSP_i@k (pyxclib/napkinxc)."""
    k = _check_k(k)
    topk, truth = _prepare(topk, truth)
    inv_p = _check_inv_propensity(inv_propensity, truth.shape[1])
    hits, ids = _hits(topk, truth, k)
    return _psp_from_gains(_ps_gains(hits, ids, inv_p), truth, inv_p, k)


def psndcg_at_k(topk: np.ndarray, truth: sp.spmatrix, inv_propensity: np.ndarray, k: int) -> float:
    """Return normalised PSnDCG@k = mean_i PSnDCG_i@k / mean_i best achievable PSnDCG_i@k (pyxclib/napkinxc)."""
    k = _check_k(k)
    topk, truth = _prepare(topk, truth)
    inv_p = _check_inv_propensity(inv_propensity, truth.shape[1])
    hits, ids = _hits(topk, truth, k)
    return _psndcg_from_gains(_ps_gains(hits, ids, inv_p), truth, inv_p, _num_positives(truth), k)


def xmc_metrics(
    topk: np.ndarray,
    truth: sp.spmatrix,
    inv_propensity: Optional[np.ndarray] = None,
    ks: Sequence[int] = (1, 3, 5),
    recall_ks: Sequence[int] = (10, 100),
) -> dict[str, float]:
    """Return percentages {P@k, nDCG@k[, PSP@k, PSnDCG@k] for k in ks; R@k for k in recall_ks}."""
    topk, truth = _prepare(topk, truth)
    ks = [_check_k(k, "ks entry") for k in ks]
    recall_ks = [_check_k(k, "recall_ks entry") for k in recall_ks]
    inv_p = None if inv_propensity is None else _check_inv_propensity(inv_propensity, truth.shape[1])
    out: dict[str, float] = {}
    k_max = max(ks + recall_ks, default=0)
    if k_max == 0:
        return out
    # The hits at a smaller k are the first k columns of the hits at k_max (a repeated label
    # is credited at its first rank), so the ground-truth lookup is done only once.
    hits, ids = _hits(topk, truth, k_max)
    num_pos = _num_positives(truth)
    for k in ks:
        out[f"P@{k}"] = 100.0 * _precision_from_hits(hits, k)
        out[f"nDCG@{k}"] = 100.0 * _ndcg_from_hits(hits, num_pos, k)
    if inv_p is not None:
        gains = _ps_gains(hits, ids, inv_p)
        for k in ks:
            out[f"PSP@{k}"] = 100.0 * _psp_from_gains(gains, truth, inv_p, k)
            out[f"PSnDCG@{k}"] = 100.0 * _psndcg_from_gains(gains, truth, inv_p, num_pos, k)
    for k in recall_ks:
        out[f"R@{k}"] = 100.0 * _recall_from_hits(hits, num_pos, k)
    return out


def precision_by_frequency_bucket(
    topk: np.ndarray,
    truth: sp.spmatrix,
    train_label_freq: Union[np.ndarray, sp.spmatrix],
    k: int = 5,
    num_buckets: int = 5,
) -> list[dict[str, object]]:
    """Split P@k into contributions of label-frequency buckets of equal train positive mass (head first).

    Labels are sorted by decreasing train frequency (ties by label id) and cut into
    ``num_buckets`` consecutive buckets holding (as nearly as label granularity allows) equal
    shares of the total number of train positives; a label belongs to bucket
    ``floor(num_buckets * mass_before_label / total_mass)``, labels never seen in training fall
    in the last (tail) bucket, and a very frequent label may leave a bucket empty.
    ``train_label_freq`` is either the per-label train counts (length L) or the train target
    matrix (n_train x L). Each returned dict holds ``bucket`` (0 = head), ``num_labels``,
    ``min_freq``/``max_freq`` (None for an empty bucket), ``train_mass_share`` (fraction of train
    positives), ``precision_contribution`` (the bucket's hits / (n k); these sum to
    ``precision_at_k``) and ``hit_share`` (fraction of all top-k hits in the bucket).
    """
    k = _check_k(k)
    num_buckets = _check_k(num_buckets, "num_buckets")
    topk, truth = _prepare(topk, truth)
    num_labels = truth.shape[1]
    freq = _train_label_freq(train_label_freq, num_labels)
    order = np.lexsort((np.arange(num_labels), -freq))  # decreasing frequency, ties by id
    total_mass = freq.sum()
    bucket_of = np.empty(num_labels, dtype=np.int64)
    if total_mass > 0:
        if np.all(freq == np.round(freq)):  # integer counts: exact integer arithmetic
            counts = freq[order].astype(np.int64)
            mass_before = np.concatenate([[0], np.cumsum(counts)[:-1]])
            b_sorted = (num_buckets * mass_before) // int(counts.sum())
        else:
            mass_before = np.concatenate([[0.0], np.cumsum(freq[order])[:-1]])
            b_sorted = np.floor(num_buckets * mass_before / total_mass).astype(np.int64)
        # unseen labels come last with mass_before == total_mass and are clipped into the tail bucket
        bucket_of[order] = np.minimum(b_sorted, num_buckets - 1)
    else:
        bucket_of[:] = num_buckets - 1

    n = truth.shape[0]
    hits, ids = _hits(topk, truth, k)
    hit_buckets = bucket_of[ids[hits]]
    hits_per_bucket = np.bincount(hit_buckets, minlength=num_buckets).astype(np.float64)
    total_hits = hits_per_bucket.sum()
    result: list[dict[str, object]] = []
    for b in range(num_buckets):
        members = freq[bucket_of == b]
        result.append(
            {
                "bucket": b,
                "num_labels": int(members.size),
                "min_freq": float(members.min()) if members.size else None,
                "max_freq": float(members.max()) if members.size else None,
                "train_mass_share": float(members.sum() / total_mass) if total_mass > 0 else 0.0,
                "precision_contribution": float(hits_per_bucket[b] / (n * k)) if n else 0.0,
                "hit_share": float(hits_per_bucket[b] / total_hits) if total_hits > 0 else 0.0,
            }
        )
    return result


# --------------------------------------------------------------------------------------
# coverage and the seen / unseen split (what XMC papers report beside P@k and PSP@k)
# --------------------------------------------------------------------------------------


def coverage_at_k(topk: np.ndarray, truth: sp.spmatrix, k: int) -> float:
    """Return coverage@k = #distinct labels hit in some query's top-k / #distinct labels with a positive in ``truth``.

    The convention of napkinXC's ``napkinxc.metrics.coverage_at_k`` (its ``CoverageAtK``: unique true positives in the
    top k over unique true labels, pooled over the query set): the share of the labels that occur in the evaluated
    ground truth that the model ranks correctly, within the top ``k``, for at least one query. A label without
    positives in ``truth`` (absent from this query set) is in neither count; 0 when ``truth`` has no positive at all.
    Unlike P@k, a model cannot raise it by predicting the head labels well: it counts each label once.
    """
    k = _check_k(k)
    topk, truth = _prepare(topk, truth)
    relevant = np.unique(truth.indices).size
    if relevant == 0:
        return 0.0
    hits, ids = _hits(topk, truth, k)
    return float(np.unique(ids[hits]).size / relevant)


def _train_label_freq(train_label_freq: Union[np.ndarray, sp.spmatrix], num_labels: int) -> np.ndarray:
    """Per-label train counts from a count vector (length L) or a train target matrix (n_train x L), checked."""
    if sp.issparse(train_label_freq):
        freq = np.asarray(train_label_freq.sum(axis=0), dtype=np.float64).ravel()
    else:
        freq = np.asarray(train_label_freq, dtype=np.float64).ravel()
    if freq.shape[0] != num_labels:
        raise ValueError(f"train_label_freq has {freq.shape[0]} labels but truth has {num_labels}")
    if np.any(freq < 0):
        raise ValueError("train_label_freq must be non-negative")
    return freq


def _best_ps_terms(truth: sp.csr_matrix, inv_p: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(label ids, inverse propensities) of the terms of the ideal PSP@k: each row's min(k, |P_i|) positives of largest
    inverse propensity, chosen as :func:`_best_ps_gains` chooses them (their weights sum to PSP@k's normaliser)."""
    if truth.nnz == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
    rows = np.repeat(np.arange(truth.shape[0], dtype=np.int64), np.diff(truth.indptr))
    w = inv_p[truth.indices]
    order = np.lexsort((-w, rows))  # by row, then decreasing weight (ties: label order), as _best_ps_gains
    rank = np.arange(truth.nnz, dtype=np.int64) - truth.indptr[rows]
    kept = order[rank < k]
    return truth.indices[kept].astype(np.int64), w[kept]


def seen_unseen_metrics(
    topk: np.ndarray,
    truth: sp.spmatrix,
    train_label_freq: Union[np.ndarray, sp.spmatrix],
    inv_propensity: Optional[np.ndarray] = None,
    k: int = 5,
) -> dict[str, float]:
    """Split P@k (and PSP@k) between the labels without training points ("unseen") and the others ("seen").

    ``train_label_freq`` is the per-label train counts (length L) or the train target matrix; a label is *unseen* when
    its count is 0 (a zero-shot label: a classifier or a tree that learns from the training queries never predicts it;
    only a label-text score can). Returns fractions (the keys with ``{k}`` filled in):

    * ``unseen_labels``: the number of distinct unseen labels with a positive in ``truth``;
    * ``unseen_positive_share``: the share of ``truth``'s positives (query-label pairs) on unseen labels;
    * ``seen_P@{k}`` / ``unseen_P@{k}``: P@k's *contributions*, hits on seen (unseen) labels / (n k), so that
      ``seen_P@k + unseen_P@k = P@k``;
    * with ``inv_propensity``: ``unseen_PSP@{k}_mass``, the share of PSP@k's ideal mass (its normaliser
      ``D = sum_i sum_{r<=min(k,|P_i|)} q*_ir``) on unseen labels, ``m = D_unseen / D`` (``D_unseen``: the inverse
      propensities of the unseen labels among each row's ideal terms; the terms are chosen as for PSP@k itself, by
      decreasing ``q``); ``unseen_PSP@{k}`` = sum of ``q`` over the top-k hits on unseen labels / ``D_unseen``, and
      ``seen_PSP@{k}`` the same over seen labels / ``D - D_unseen``. Hits on seen plus hits on unseen labels are all
      the hits, so ``PSP@k = m * unseen_PSP@k + (1 - m) * seen_PSP@k``. ``unseen_PSP@k`` is at most 1 whenever
      unseen labels have the largest ``q`` (the usual case: ``q`` decreases with the train count when ``N >= 3``);
      ``seen_PSP@k`` can exceed 1 in principle (a hit on a seen label in a slot the ideal ranking gives to an unseen
      one). A ratio whose denominator is 0 is 0 (read it with its mass: ``m = 0`` means no unseen label to find).
    """
    k = _check_k(k)
    topk, truth = _prepare(topk, truth)
    n, num_labels = truth.shape
    unseen = _train_label_freq(train_label_freq, num_labels) == 0
    hits, ids = _hits(topk, truth, k)
    hit_unseen = hits & unseen[np.where(hits, ids, 0)]
    out: dict[str, float] = {
        "unseen_labels": int(np.count_nonzero(unseen[np.unique(truth.indices)])),
        "unseen_positive_share": float(unseen[truth.indices].mean()) if truth.nnz else 0.0,
        f"seen_P@{k}": float((hits & ~hit_unseen).sum() / (n * k)) if n else 0.0,
        f"unseen_P@{k}": float(hit_unseen.sum() / (n * k)) if n else 0.0,
    }
    if inv_propensity is not None:
        inv_p = _check_inv_propensity(inv_propensity, num_labels)
        gains = _ps_gains(hits, ids, inv_p)
        ideal_ids, ideal_w = _best_ps_terms(truth, inv_p, k)
        ideal_unseen = unseen[ideal_ids]
        mass_unseen, mass_seen = float(ideal_w[ideal_unseen].sum()), float(ideal_w[~ideal_unseen].sum())
        gain_unseen, gain_seen = float(gains[hit_unseen].sum()), float(gains[hits & ~hit_unseen].sum())
        total = mass_unseen + mass_seen
        out[f"unseen_PSP@{k}_mass"] = mass_unseen / total if total > 0 else 0.0
        out[f"seen_PSP@{k}"] = gain_seen / mass_seen if mass_seen > 0 else 0.0
        out[f"unseen_PSP@{k}"] = gain_unseen / mass_unseen if mass_unseen > 0 else 0.0
    return out
