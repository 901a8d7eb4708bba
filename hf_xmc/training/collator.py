"""Training dataset and collator: queries plus a label pool with multi-label targets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import scipy.sparse as sp
import torch
from torch.utils.data import Dataset

from ..data import XMCDataset


class XMCTrainDataset(Dataset):
    """Map-style dataset over the training points of an :class:`~hf_xmc.data.XMCDataset`.

    Items are ``{"index": i}``: the collator looks the text and labels up, so samplers and collators share
    one copy of the data.
    """

    def __init__(self, data: XMCDataset):
        if len(data) == 0:
            raise ValueError("the training set is empty")
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, int]:
        return {"index": int(i)}


@dataclass
class XMCDataCollator:
    """Builds a training batch: tokenised queries, a label pool and the ``(batch, pool)`` target mask.

    For every query one positive (``num_positives`` in general) is sampled from its labels; the pool is the
    union of the sampled positives of the batch (in-batch negatives). ``targets[b, p]`` is True whenever pool
    label ``p`` is *any* positive of query ``b``, so losses can mask false negatives. ``positive_index[b]`` is
    the pool position of query ``b``'s (first) sampled positive.

    Args:
        tokenizer: the model's tokenizer.
        texts: query texts of the training set.
        targets: CSR ``(num_points, num_labels)`` training label matrix.
        label_texts: texts of all labels, in label-id order.
        max_seq_length / label_max_seq_length: token budgets.
        num_positives: positives sampled per query per step.
        seed: seed of the positive-sampling generator.
    """

    tokenizer: Any
    texts: Sequence[str]
    targets: sp.csr_matrix
    label_texts: Sequence[str]
    max_seq_length: int = 32
    label_max_seq_length: int = 32
    num_positives: int = 1
    seed: int = 0
    rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self):
        self.targets = sp.csr_matrix(self.targets)
        if self.targets.shape[1] != len(self.label_texts):
            raise ValueError(f"targets have {self.targets.shape[1]} label columns but {len(self.label_texts)} label texts were given")
        self.rng = np.random.default_rng(self.seed)

    def sample_positives(self, rows: np.ndarray) -> list[np.ndarray]:
        """Uniformly sample up to ``num_positives`` distinct positives for each query row."""
        out = []
        for r in rows:
            labels = self.targets.indices[self.targets.indptr[r] : self.targets.indptr[r + 1]]
            if len(labels) == 0:
                out.append(labels)
            elif len(labels) <= self.num_positives:
                out.append(self.rng.permutation(labels))
            else:
                out.append(self.rng.choice(labels, self.num_positives, replace=False))
        return out

    def build_pool(self, rows: np.ndarray, sampled: list[np.ndarray], extra_labels: Optional[np.ndarray] = None) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """Pool = unique sampled positives (+ ``extra_labels``); returns pool ids, targets and positive_index."""
        parts = [s for s in sampled if len(s)] + ([extra_labels] if extra_labels is not None else [])
        pool = np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
        targets = torch.from_numpy(self.targets[rows][:, pool].toarray() > 0)
        first = np.array([s[0] if len(s) else -1 for s in sampled])
        positive_index = torch.from_numpy(np.searchsorted(pool, np.maximum(first, 0)).astype(np.int64))
        return pool, targets, positive_index

    def __call__(self, features: list[dict[str, int]]) -> dict[str, torch.Tensor]:
        rows = np.array([f["index"] for f in features], dtype=np.int64)
        sampled = self.sample_positives(rows)
        pool, targets, positive_index = self.build_pool(rows, sampled)
        q = self.tokenizer([self.texts[r] for r in rows], padding=True, truncation=True, max_length=self.max_seq_length, return_tensors="pt")
        lab = self.tokenizer([self.label_texts[i] for i in pool], padding=True, truncation=True, max_length=self.label_max_seq_length, return_tensors="pt")
        return {
            "input_ids": q["input_ids"],
            "attention_mask": q["attention_mask"],
            "label_input_ids": lab["input_ids"],
            "label_attention_mask": lab["attention_mask"],
            "targets": targets,
            "positive_index": positive_index,
        }
