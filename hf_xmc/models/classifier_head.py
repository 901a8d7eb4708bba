"""Extreme classifiers: one learnable vector per label, trained and searched without dense label x batch logits.

Shared by the methods with per-label tables (UniDEC's ``Psi``, PRIME's free-vector bank, MUFIN's ``eta``). Training
scores a batch only against the rows of its label pool (``pool_weights``), so one step costs ``batch x pool x d``
whatever the label space; inference never scores all labels either: the normalised weights go into the label index
and a query's top-k come from the index search.

Memory per label (fp32, dimension d): weights ``4d`` bytes. Training with ``sparse_gradients=True`` (UniDEC and
PRIME by default, config field ``sparse_label_gradients``) adds AdamW's two moments (``8d``) and no gradient for the
rows outside the pool: ``12d`` bytes per label, plus ``pool x d`` floats of sparse gradient per step, updated
row-wise by :class:`hf_xmc.training.SparseAdamW`. With dense gradients (``sparse_gradients=False``) the gradient is a
full ``L x d`` tensor, zero outside the pool, and AdamW updates every row each step: ``16d`` bytes per label.
Searching adds the normalised copy in the label store and the index (see the README's memory table).

This file is part of the remote-code bundle (torch only).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class ExtremeClassifier(nn.Embedding):
    """``num_labels x dim`` classifier vectors (no bias), scored on label pools.

    An ``nn.Embedding`` so that ``sparse_gradients`` is the module's ``sparse`` flag: the pool's rows are gathered
    with ``F.embedding(..., sparse=True)`` and ``weight.grad`` is a sparse COO tensor holding only those rows, and
    ``DistributedDataParallel`` (which reads that flag on ``nn.Embedding`` modules only) all-reduces it as a sparse
    gradient (the gloo backend; NCCL has no sparse all-reduce). ``torch.optim.AdamW`` refuses sparse gradients:
    train such a table with :class:`hf_xmc.training.SparseAdamW` (what ``XMCTrainer`` picks).

    Args:
        num_labels: L, one row per label id.
        dim: size of a classifier vector (the query head's output size).
        sparse_gradients: gather rows with sparse gradients (``False``: a dense ``L x dim`` gradient, zero outside the
            pool). May be switched later through the ``sparse`` attribute, before a ``DistributedDataParallel`` wrap.

    Example:
        >>> clf = ExtremeClassifier(1_000_000, 64, sparse_gradients=True)
        >>> scores = torch.randn(8, 64) @ clf.pool_weights(torch.tensor([3, 17, 999_999])).T  # (8, 3)
    """

    def __init__(self, num_labels: int, dim: int, sparse_gradients: bool = False):
        if num_labels < 1 or dim < 1:
            raise ValueError(f"an extreme classifier needs num_labels >= 1 and dim >= 1, got {num_labels}, {dim}")
        # an uninitialised table (no normal_ pass over L x d rows): the model's _init_weights sets it
        super().__init__(num_labels, dim, sparse=sparse_gradients, _weight=torch.empty(num_labels, dim))

    @property
    def num_labels(self) -> int:
        return self.weight.shape[0]

    def pool_weights(self, label_ids: torch.Tensor) -> torch.Tensor:
        """The ``(pool, dim)`` rows of ``label_ids`` (only these rows receive gradient, sparse if ``self.sparse``)."""
        if label_ids.numel() and (int(label_ids.min()) < 0 or int(label_ids.max()) >= self.num_labels):
            raise ValueError(f"label ids must lie in [0, {self.num_labels}), got [{int(label_ids.min())}, {int(label_ids.max())}]")
        return self(label_ids.to(self.weight.device))

    @torch.no_grad()
    def replace_rows(self, weight: torch.Tensor) -> None:
        """Swap in a new ``(L', dim)`` table (labels added or removed after training): a new parameter, so an
        optimizer built before no longer holds it."""
        if weight.ndim != 2 or weight.shape[1] != self.embedding_dim or weight.shape[0] < 1:
            raise ValueError(f"a classifier table must have shape (L >= 1, {self.embedding_dim}), got {tuple(weight.shape)}")
        self.weight = nn.Parameter(weight.to(self.weight), requires_grad=self.weight.requires_grad)
        self.num_embeddings = weight.shape[0]

    @torch.no_grad()
    def normalized_weights(self, chunk_size: int = 65536) -> torch.Tensor:
        """L2-normalised classifier vectors ``(L, dim)`` (float32, CPU), computed chunk by chunk: the search space."""
        out = torch.empty(self.weight.shape, dtype=torch.float32)
        for start in range(0, self.num_labels, chunk_size):
            out[start : start + chunk_size] = F.normalize(self.weight[start : start + chunk_size].float(), dim=-1).cpu()
        return out

    def extra_repr(self) -> str:
        return f"num_labels={self.num_labels}, dim={self.embedding_dim}, sparse_gradients={self.sparse}"


def sum_label_scores(query_of: np.ndarray, label_of: np.ndarray, values: np.ndarray, num_labels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sum ``values`` over repeated ``(query, label)`` pairs: returns ``(queries, labels, sums)``, one entry per distinct
    pair, sorted by ``(query, label)`` (int64, int64, float64). Memory: a few arrays of the hits' length."""
    keys = query_of.astype(np.int64) * num_labels + label_of.astype(np.int64)
    unique, inverse = np.unique(keys, return_inverse=True)
    # bincount adds in the hits' order, as np.add.at does, about 4x faster (Module II at 1.3M: millions of hits per chunk)
    sums = np.bincount(inverse.ravel(), weights=values.astype(np.float64), minlength=unique.size)
    return unique // num_labels, unique % num_labels, sums


def merge_label_scores(
    query_of: np.ndarray, label_of: np.ndarray, values: np.ndarray, num_queries: int, num_labels: int, size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Sum the ``values`` of every ``(query, label)`` pair (hits of several searches over label representations, votes
    of neighbours) and keep each query's ``size`` best labels: the shortlist of a classifier stage.

    ``query_of`` / ``label_of`` / ``values``: parallel 1-d arrays, one entry per hit (a label missing from a search adds
    nothing for it). Returns ``(ids, scores)``, ``(num_queries, size)`` int64 / float32, best first, ``-1`` / ``-inf``
    padded. Memory: a few arrays of the hits' length; nothing per label.
    """
    ids = np.full((num_queries, size), -1, dtype=np.int64)
    scores = np.full((num_queries, size), -np.inf, dtype=np.float32)
    if query_of.size == 0:
        return ids, scores
    queries, labels, sums = sum_label_scores(query_of, label_of, values, num_labels)
    order = np.lexsort((-sums, queries))  # by query, best first
    queries, labels, sums = queries[order], labels[order], sums[order]
    rank = np.arange(queries.size) - np.searchsorted(queries, queries)  # position within its query
    keep = rank < size
    ids[queries[keep], rank[keep]] = labels[keep]
    scores[queries[keep], rank[keep]] = sums[keep]
    return ids, scores


def fuse_shortlist_scores(classifier: np.ndarray, shortlist: np.ndarray, weight: float, fusion: str = "code", label_side: np.ndarray | None = None) -> np.ndarray:
    """Fused score of shortlisted labels (SiameseXML; the classifier stage's ranking).

    ``fusion="code"`` (the official evaluation): ``weight * exp(5 (classifier - 1)) + (1 - weight) * sigmoid(shortlist)``
    with ``classifier`` the cosine ``cos(w_l, E(x))`` and ``shortlist`` the summed similarity of the shortlist search.
    ``fusion="paper"``: ``weight * classifier + (1 - weight) * label_side`` where ``label_side`` is the paper's
    ``(z_l + v_l)^T E(x)``.
    """
    if fusion == "code":
        return (weight * np.exp(5.0 * (classifier - 1.0)) + (1.0 - weight) / (1.0 + np.exp(-shortlist))).astype(np.float32)
    if fusion == "paper":
        if label_side is None:
            raise ValueError("fusion='paper' needs the label-side scores (z_l + v_l)^T E(x)")
        return (weight * classifier + (1.0 - weight) * label_side).astype(np.float32)
    raise ValueError(f"fusion must be 'code' or 'paper', got {fusion!r}")


__all__ = ["ExtremeClassifier", "fuse_shortlist_scores", "merge_label_scores", "sum_label_scores"]
