"""The one-vs-all classifier stage shared by the methods with per-label classifiers trained on shortlist negatives
(SiameseXML's Module IV): the batches of that stage.

Each training point brings its positives (at most ``max_positives``, a random subset) and the negatives of its
shortlist (mined once from a frozen encoder, positives removed); the model scores only those candidate rows of its
classifier table, whose gradients are sparse (row-wise ``SparseAdamW`` updates), so a step costs
``batch x (max_positives + shortlist) x D`` whatever the label space. When the encoder is frozen its query vectors
are computed once and the batches carry them instead of tokens (the official SiameseXML code does the same).

Memory: the shortlist (4 bytes per slot and point, int32), the precomputed query vectors (4 D bytes per point, 2 D
in float16, or none with ``texts``), and per batch ``batch x (max_positives + shortlist)`` candidate ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import scipy.sparse as sp
import torch

from ..models.encoder_utils import tokenize_texts
from .collator import EpochSeededBatches


@dataclass
class ClassifierStageCollator(EpochSeededBatches):
    """Batches of the classifier stage: per point its positives and shortlist negatives as candidate label ids.

    Args:
        targets: CSR ``(num_points, num_labels)`` training labels.
        shortlist: ``(num_points, S)`` negative label ids per point (``-1``-padded, positives already removed).
        query_vectors: ``(num_points, D)`` precomputed (frozen-encoder) query vectors; or None and ``texts`` +
            ``tokenizer`` to tokenise the points (a trainable encoder).
        max_positives: most positives per point and step (a random subset; [C]: 10).
        seed: base seed; each batch draws from ``(seed, epoch, its rows)``.

    A batch holds ``query_vectors`` (or ``input_ids`` / ``attention_mask``), ``candidate_ids`` ``(B, P + S)``
    (positives first, ``-1``-padded), ``candidate_targets`` ``(B, P + S)`` and ``indices``.
    """

    targets: sp.csr_matrix
    shortlist: np.ndarray
    query_vectors: Optional[torch.Tensor] = None
    texts: Optional[Sequence[str]] = None
    tokenizer: Any = None
    max_seq_length: int = 32
    max_positives: int = 10
    seed: int = 0
    epoch: int = 0

    def __post_init__(self):
        self.targets = sp.csr_matrix(self.targets)
        n = self.targets.shape[0]
        if self.shortlist.ndim != 2 or self.shortlist.shape[0] != n:
            raise ValueError(f"the shortlist must have one row per training point ({n}), got shape {self.shortlist.shape}")
        if self.query_vectors is None and (self.texts is None or self.tokenizer is None):
            raise ValueError("ClassifierStageCollator needs query_vectors, or texts and a tokenizer")
        if self.query_vectors is not None and self.query_vectors.shape[0] != n:
            raise ValueError(f"{self.query_vectors.shape[0]} query vectors for {n} training points")
        if self.max_positives < 1:
            raise ValueError(f"max_positives must be >= 1, got {self.max_positives}")

    def __call__(self, features: list[dict[str, int]]) -> dict[str, torch.Tensor]:
        rows = np.array([f["index"] for f in features], dtype=np.int64)
        rng = self.batch_rng(rows)
        width = self.max_positives + self.shortlist.shape[1]
        ids = np.full((len(rows), width), -1, dtype=np.int64)
        positive = np.zeros((len(rows), width), dtype=bool)
        for b, r in enumerate(rows):
            labels = self.targets.indices[self.targets.indptr[r] : self.targets.indptr[r + 1]]
            if len(labels) > self.max_positives:
                labels = rng.choice(labels, self.max_positives, replace=False)
            negatives = self.shortlist[r]
            negatives = negatives[negatives >= 0]
            ids[b, : len(labels)] = labels
            positive[b, : len(labels)] = True
            ids[b, len(labels) : len(labels) + len(negatives)] = negatives
        used = int((ids >= 0).sum(axis=1).max()) if len(rows) else 0
        batch = {
            "candidate_ids": torch.from_numpy(ids[:, : max(used, 1)]),
            "candidate_targets": torch.from_numpy(positive[:, : max(used, 1)]),
            "indices": torch.from_numpy(rows),
        }
        if self.query_vectors is not None:
            batch["query_vectors"] = self.query_vectors[torch.from_numpy(rows)].float()  # float16 storage at scale
        else:
            tokens = tokenize_texts(self.tokenizer, [self.texts[r] for r in rows], self.max_seq_length, padding=True, return_tensors="pt")
            batch.update(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
        return batch


__all__ = ["ClassifierStageCollator"]
