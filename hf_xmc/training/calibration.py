"""Fitting a model's score calibration (``hf_xmc/models/calibration.py``) on validation queries, and measuring it.

    calibration = fit_score_calibration(model, validation_evaluator)     # model.predict(texts, threshold=0.5) works now

The validation queries (``hf_xmc.data.splits``: held out of training) are ranked by the model exactly as ``predict``
ranks them (the lexical channel fused when the model has one); each of the top ``depth`` labels of each query is one
pair ``(score, relevant)``, and the map is fitted on these pairs. The depth is :data:`CALIBRATION_DEPTH`, the depth
``predict(threshold=)`` ranks before it thresholds (``THRESHOLD_DEPTH``): a map fitted on the top 20 only clamped every
score below its range to its lowest block, while a threshold reads ranks 21-100 too.

* ``isotonic`` (default): pool-adjacent-violators on the pairs sorted by score, i.e. the non-decreasing step function
  with the least squared error (Zadrozny & Elkan 2002); kept as breakpoints, interpolated between them;
* ``platt``: a logistic regression on the score (Platt 1999, with his smoothed targets ``(N+ + 1) / (N+ + 2)`` and
  ``1 / (N- + 2)``), fitted by Newton's method.

:func:`expected_calibration_error` and :func:`reliability_bins` measure a calibration on other queries (the test
split). Memory: the ``queries x depth`` pairs (12 bytes each) and the evaluator's ranking of the validation queries.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import scipy.sparse as sp

from ..models.calibration import CALIBRATION_METHODS, ScoreCalibration

logger = logging.getLogger(__name__)

# ranks per query the calibration is fitted on (and measured at): as deep as predict(threshold=) applies it
# (modeling_xmc.THRESHOLD_DEPTH; a test holds them equal)
CALIBRATION_DEPTH = 100
RELIABILITY_BINS = 10


def ranked_pairs(ids: np.ndarray, scores: np.ndarray, targets: sp.spmatrix, depth: int = CALIBRATION_DEPTH,
                 first: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The ``(score, relevant)`` pairs of ranks ``first + 1`` .. ``depth`` of each query (``-1`` slots left out):
    float64 scores and a bool relevance from the query's row of ``targets``."""
    ids, scores = np.asarray(ids)[:, first:depth], np.asarray(scores, dtype=np.float64)[:, first:depth]
    rows, cols = np.nonzero(ids >= 0)
    labels = ids[rows, cols]
    relevant = np.asarray(sp.csr_matrix(targets)[rows, labels]).ravel() > 0
    return scores[rows, cols], relevant


def isotonic_breakpoints(scores: np.ndarray, relevant: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pool-adjacent-violators: breakpoints ``(x, y)`` of the non-decreasing fit of ``relevant`` on ``scores`` (each
    block of pooled pairs gives its lowest and highest score at the block's mean; equal scores are pooled first)."""
    order = np.argsort(scores, kind="stable")
    x, y = np.asarray(scores, np.float64)[order], np.asarray(relevant, np.float64)[order]
    unique, start = np.unique(x, return_index=True)
    counts = np.diff(np.append(start, len(x)))
    sums = np.add.reduceat(y, start)
    # blocks on a stack: (sum, count, lowest score, highest score)
    block_sum, block_count, block_lo, block_hi = [], [], [], []
    for value, total, count in zip(unique.tolist(), sums.tolist(), counts.tolist()):
        block_sum.append(total)
        block_count.append(count)
        block_lo.append(value)
        block_hi.append(value)
        while len(block_sum) > 1 and block_sum[-2] * block_count[-1] >= block_sum[-1] * block_count[-2]:
            total, count, hi = block_sum.pop(), block_count.pop(), block_hi.pop()
            block_lo.pop()
            block_sum[-1] += total
            block_count[-1] += count
            block_hi[-1] = hi
    means = np.asarray(block_sum) / np.asarray(block_count)
    bx = np.column_stack([block_lo, block_hi]).ravel()
    by = np.repeat(means, 2)
    keep = np.ones(len(bx), dtype=bool)
    keep[1::2] = np.asarray(block_hi) > np.asarray(block_lo)  # a one-score block needs one point
    return bx[keep], np.clip(by[keep], 0.0, 1.0)


def fit_platt(scores: np.ndarray, relevant: np.ndarray, iterations: int = 100) -> tuple[float, float]:
    """Platt scaling ``(a, b)``: ``P(relevant) = 1 / (1 + exp(-(a s + b)))`` by Newton's method on the log loss with
    Platt's smoothed targets (scores are standardised for the solve, the result mapped back)."""
    s = np.asarray(scores, np.float64)
    positives = np.asarray(relevant, bool)
    n_pos, n_neg = int(positives.sum()), int((~positives).sum())
    t = np.where(positives, (n_pos + 1.0) / (n_pos + 2.0), 1.0 / (n_neg + 2.0))
    mean, std = s.mean(), s.std() or 1.0
    z = (s - mean) / std
    w = np.zeros(2)  # slope, intercept in the standardised space
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-np.clip(w[0] * z + w[1], -50, 50)))
        grad = np.array([np.dot(p - t, z), np.sum(p - t)])
        h = p * (1 - p) + 1e-12
        hess = np.array([[np.dot(h, z * z), np.dot(h, z)], [np.dot(h, z), h.sum()]]) + 1e-9 * np.eye(2)
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-10:
            break
    a = max(w[0] / std, 0.0)  # a higher score is never less likely to be relevant
    return float(a), float(w[1] - a * mean)


def expected_calibration_error(probabilities: np.ndarray, relevant: np.ndarray, bins: int = RELIABILITY_BINS) -> float:
    """ECE: over ``bins`` equal-width probability bins, the pair-weighted mean of ``|mean probability - fraction
    relevant|`` (a percentage, like the metrics)."""
    rows = reliability_bins(probabilities, relevant, bins)
    total = sum(r["pairs"] for r in rows)
    return 100.0 * sum(r["pairs"] * abs(r["mean_probability"] - r["fraction_relevant"]) for r in rows) / max(total, 1)


def reliability_bins(probabilities: np.ndarray, relevant: np.ndarray, bins: int = RELIABILITY_BINS) -> list[dict]:
    """The reliability diagram's rows: per non-empty probability bin its range, pairs, mean probability and fraction
    of relevant pairs."""
    p = np.asarray(probabilities, np.float64)
    r = np.asarray(relevant, bool)
    which = np.minimum((p * bins).astype(np.int64), bins - 1)
    rows = []
    for b in range(bins):
        mask = which == b
        if mask.any():
            rows.append({"bin": f"{b / bins:.1f}-{(b + 1) / bins:.1f}", "pairs": int(mask.sum()),
                         "mean_probability": float(p[mask].mean()), "fraction_relevant": float(r[mask].mean())})
    return rows


def fit_score_calibration(model, evaluator, method: str = "isotonic", depth: int = CALIBRATION_DEPTH,
                          also: tuple[str, ...] = ()) -> ScoreCalibration | dict[str, ScoreCalibration]:
    """Fit ``method`` on the ranking of ``evaluator``'s queries (validation queries, an :class:`XMCEvaluator`) by
    ``model`` as ``predict`` ranks them, attach it (``model.set_score_calibration``) and return it.
    The model's index is searched as it is when it is current (``label_index_is_current``). ``also``: other methods
    fitted on the same pairs (not attached), for comparison; then a dict ``{method: calibration}`` is returned."""
    for name in (method, *also):
        if name not in CALIBRATION_METHODS:
            raise ValueError(f"score calibration method must be one of {CALIBRATION_METHODS}, got {name!r}")
    ids, scores, _ = evaluator.predict(model)
    targets = evaluator.data.targets
    # items ranked without the lexical channel (MUFIN's image-only ones) are not on the fused ranking the map is for
    unfused = model.unfused_items(evaluator.data.texts, evaluator.data.images if model.takes_images else None)
    if unfused.any():
        ids, scores, targets = ids[~unfused], scores[~unfused], sp.csr_matrix(targets)[np.flatnonzero(~unfused)]
        logger.info("score calibration: %d validation items ranked without the lexical channel left out", int(unfused.sum()))
    scores_flat, relevant = ranked_pairs(ids, scores, targets, depth)
    if len(scores_flat) == 0 or relevant.all() or not relevant.any():
        raise ValueError(f"the {len(evaluator.data)} validation queries give no relevant and irrelevant labels in their top {depth} to calibrate on")
    info = {"fitted_on": evaluator.name, "queries": int(len(ids)), "depth": int(depth), "pairs": int(len(scores_flat))}
    fitted = {}
    for name in dict.fromkeys((method, *also)):
        if name == "isotonic":
            x, y = isotonic_breakpoints(scores_flat, relevant)
            fitted[name] = ScoreCalibration("isotonic", x=x, y=y, info=info)
        else:
            a, b = fit_platt(scores_flat, relevant)
            fitted[name] = ScoreCalibration("platt", a=a, b=b, info=info)
    model.set_score_calibration(fitted[method])
    logger.info("score calibration (%s) fitted on %d pairs of %d %s queries", method, len(scores_flat), len(evaluator.data), evaluator.name)
    return fitted if also else fitted[method]


def calibration_metrics(model, ids: np.ndarray, scores: np.ndarray, targets: sp.spmatrix, depth: int = CALIBRATION_DEPTH,
                        calibration: Optional[ScoreCalibration] = None, first: int = 0) -> Optional[dict]:
    """``{"ECE": ..., "reliability": [...]}`` of the model's calibration (or ``calibration``) on ranks ``first + 1`` ..
    ``depth`` of a ranking (another split's), or None for an uncalibrated model."""
    calibration = calibration if calibration is not None else model.score_calibration
    if calibration is None:
        return None
    scores_flat, relevant = ranked_pairs(ids, scores, targets, depth, first)
    probabilities = calibration(scores_flat)
    return {"ECE": expected_calibration_error(probabilities, relevant), "reliability": reliability_bins(probabilities, relevant)}
