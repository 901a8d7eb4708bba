"""Per-label state that some models derive from the training data before the first step.

PRIME needs a label -> free-vector map (balanced 2-means clusters of the initial label-text embeddings, built once)
and label centroids (the normalised mean of the initial embeddings of each label's training queries). Models
declare the need with a ``needs_label_state`` attribute; :class:`~hf_xmc.training.XMCTrainer` calls
:func:`initialize_label_state` for them when a fresh run starts (not when resuming: the checkpoint holds the state).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Optional

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .clustering import balanced_2means_tree

logger = logging.getLogger(__name__)


def label_centroid_sums(sums: torch.Tensor, query_embeds: torch.Tensor, targets: sp.csr_matrix, max_pairs: int = 1 << 18) -> None:
    """Add the L2-normalised ``query_embeds`` of each target row to the ``(L, d)`` running ``sums`` of its labels.

    ``targets`` holds the rows of these queries. Pairs are scattered with ``index_add_`` at most ``max_pairs`` (query,
    label) pairs at a time, so the only label-sized tensor is ``sums`` itself (never an ``(L, d)`` temporary per
    chunk, as ``targets.T @ queries`` would allocate) and the work buffer is ``max_pairs x d`` floats (384 MB at
    d = 384); ``query_embeds`` (float32 or float16) are normalised as they are gathered, never copied whole.
    """
    indptr, indices = targets.indptr, targets.indices
    row = 0
    while row < targets.shape[0]:
        stop = int(np.searchsorted(indptr, indptr[row] + max_pairs, side="right")) - 1
        stop = max(stop, row + 1)
        counts = np.diff(indptr[row : stop + 1])
        rows = torch.from_numpy(np.repeat(np.arange(row, stop), counts))
        labels = torch.from_numpy(indices[indptr[row] : indptr[stop]].astype(np.int64))
        sums.index_add_(0, labels, F.normalize(query_embeds[rows].float(), dim=-1))
        row = stop


def label_centroids(query_embeds: torch.Tensor, targets: sp.spmatrix) -> torch.Tensor:
    """``(L, d)`` L2-normalised mean of the (normalised) embeddings of each label's queries; zero for labels
    without training queries. Memory: the ``(L, d)`` float32 result plus a bounded work buffer
    (:func:`label_centroid_sums`)."""
    targets = sp.csr_matrix(targets)
    if targets.shape[0] != query_embeds.shape[0]:
        raise ValueError(f"{query_embeds.shape[0]} query embeddings for {targets.shape[0]} target rows")
    sums = torch.zeros(targets.shape[1], query_embeds.shape[1], dtype=torch.float32)
    label_centroid_sums(sums, query_embeds, targets)
    return F.normalize(sums, dim=-1, out=sums)  # zero rows stay zero (normalize divides by max(norm, eps))


def streamed_label_centroids(
    model, texts: Sequence[str], targets: sp.spmatrix, batch_size: int = 128, chunk_size: int = 65536, show_progress_bar: Optional[bool] = None
) -> torch.Tensor:
    """:func:`label_centroids` of the model's query embeddings, encoding ``chunk_size`` queries at a time: memory is
    the ``(L, d)`` result plus one chunk of query vectors, whatever the number of training queries (4 bytes x d per
    label; nothing per query)."""
    targets = sp.csr_matrix(targets)
    if targets.shape[0] != len(texts):
        raise ValueError(f"{len(texts)} query texts for {targets.shape[0]} target rows")
    sums: Optional[torch.Tensor] = None
    show = len(texts) > chunk_size if show_progress_bar is None else show_progress_bar
    for start in tqdm(range(0, len(texts), chunk_size), desc="Label centroids", disable=not show, unit="chunk"):
        stop = min(start + chunk_size, len(texts))
        queries = model.encode_queries(texts[start:stop], batch_size=batch_size, show_progress_bar=False)
        if sums is None:
            sums = torch.zeros(targets.shape[1], queries.shape[1], dtype=torch.float32)
        label_centroid_sums(sums, queries, targets[start:stop])
    return F.normalize(sums, dim=-1, out=sums)


def free_vector_assignment(label_embeds: torch.Tensor, num_free_vectors: int, seed: int = 0) -> torch.Tensor:
    """Free-vector id of every label: the leaf of a balanced hierarchical 2-means (cosine) of the label embeddings.

    With more free vectors than labels allow (``2^floor(log2 L)``), the tree stops there and the other vectors stay
    unused.
    """
    if num_free_vectors & (num_free_vectors - 1) or num_free_vectors < 1:
        raise ValueError(f"num_free_vectors must be a power of two, got {num_free_vectors}")
    return torch.from_numpy(balanced_2means_tree(label_embeds, num_free_vectors, seed=seed))


def initialize_label_state(
    model,
    train_texts: Sequence[str],
    train_targets: sp.spmatrix,
    seed: int = 0,
    batch_size: int = 128,
    show_progress_bar: Optional[bool] = None,
) -> None:
    """Set a PRIME-style model's free-vector map and centroids from its current (initial) encoder and the training set.

    A model that sets its state itself (UniDEC: classifier vectors from the label texts) says so from its
    ``initialize_label_state`` (``XMCTrainingHooks``), which is asked first.
    """
    if model.initialize_label_state(train_texts, train_targets, seed=seed, batch_size=batch_size, show_progress_bar=show_progress_bar):
        return
    num_free = int(model.config.num_free_vectors or 0)
    assignment = None
    if num_free:
        label_embeds = model.encode_labels(batch_size=batch_size, show_progress_bar=show_progress_bar)
        assignment = free_vector_assignment(label_embeds, num_free, seed=seed)
        logger.info("label state: %d labels clustered onto %d free vectors", label_embeds.shape[0], int(assignment.max()) + 1)
    centroids = streamed_label_centroids(model, train_texts, train_targets, batch_size=batch_size, show_progress_bar=show_progress_bar)
    logger.info("label state: centroids of %d labels (%d without training queries)", centroids.shape[0], int((centroids.norm(dim=1) == 0).sum()))
    model.set_label_state(assignment, centroids)
