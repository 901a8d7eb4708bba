"""Hard-negative mining (ANCE-style): a periodic shortlist of the labels the current model ranks highest for each
training query, its known positives removed; the collator draws negatives from it (DEXML section 5.4)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Optional

import numpy as np
import scipy.sparse as sp

from ..data import filter_predictions

logger = logging.getLogger(__name__)


def mine_hard_negatives(
    model,
    texts: Sequence[str],
    targets: sp.spmatrix,
    top_k: int = 100,
    batch_size: int = 256,
    show_progress_bar: Optional[bool] = None,
) -> np.ndarray:
    """Top-``top_k`` labels per training query under the current weights, known positives removed.

    The labels are re-encoded and indexed with ``model.build_label_index()`` (exact search, as the DEXML code
    does), in the model's ``hard_negative_search_mode`` when it names one; returns an ``(n, top_k)`` int64 array, ``-1``-padded where fewer negatives exist.
    """
    targets = sp.csr_matrix(targets)
    if targets.shape[0] != len(texts):
        raise ValueError(f"{len(texts)} texts but {targets.shape[0]} target rows")
    # a model may mine in another space than it predicts in (UniDEC: the DE head only, paper Sec. 3.2)
    mode = getattr(model, "hard_negative_search_mode", None)
    with model.using_search_mode(mode) if mode is not None else nullcontext():
        model.build_label_index(batch_size=batch_size, show_progress_bar=show_progress_bar)
        queries = model.query_search_vectors(texts, batch_size=batch_size, show_progress_bar=show_progress_bar)
        max_pos = int(np.diff(targets.indptr).max()) if targets.nnz else 0
        scores, ids = model.search(queries, top_k + max_pos)
    ids, _ = filter_predictions(ids, scores, targets, top_k)
    logger.info("mined a shortlist of %d hard negatives for %d queries", top_k, len(texts))
    return ids
