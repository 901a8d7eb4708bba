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

from .clustering import balanced_2means_tree

logger = logging.getLogger(__name__)


def label_centroids(query_embeds: torch.Tensor, targets: sp.spmatrix) -> torch.Tensor:
    """``(L, d)`` L2-normalised mean of the (normalised) embeddings of each label's queries; zero for labels
    without training queries."""
    targets = sp.csr_matrix(targets, dtype=np.float32)
    if targets.shape[0] != query_embeds.shape[0]:
        raise ValueError(f"{query_embeds.shape[0]} query embeddings for {targets.shape[0]} target rows")
    queries = F.normalize(query_embeds.float(), dim=-1).numpy()
    sums = torch.from_numpy(np.asarray(targets.T @ queries, dtype=np.float32))
    return F.normalize(sums, dim=-1)  # zero rows stay zero (normalize divides by max(norm, eps))


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

    A model with its own ``initialize_label_state`` method (UniDEC: classifier vectors from the label texts) does it
    itself.
    """
    if hasattr(model, "initialize_label_state"):
        model.initialize_label_state(train_texts, train_targets, seed=seed, batch_size=batch_size, show_progress_bar=show_progress_bar)
        return
    num_free = int(getattr(model.config, "num_free_vectors", 0) or 0)
    assignment = None
    if num_free:
        label_embeds = model.encode_labels(batch_size=batch_size, show_progress_bar=show_progress_bar)
        assignment = free_vector_assignment(label_embeds, num_free, seed=seed)
        logger.info("label state: %d labels clustered onto %d free vectors", label_embeds.shape[0], int(assignment.max()) + 1)
    queries = model.encode_queries(train_texts, batch_size=batch_size, show_progress_bar=show_progress_bar)
    centroids = label_centroids(queries, train_targets)
    logger.info("label state: centroids of %d labels (%d without training queries)", centroids.shape[0], int((centroids.norm(dim=1) == 0).sum()))
    model.set_label_state(assignment, centroids)
