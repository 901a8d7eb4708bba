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

    For every query ``num_positives`` positives are sampled from its labels (uniformly, or proportionally to the
    labels' inverse propensity so tail labels are seen more often); with a hard-negative ``shortlist`` set,
    ``num_negatives`` labels are also drawn from each query's shortlist. The pool is the union of everything
    sampled for the batch. ``targets[b, p]`` is True whenever pool label ``p`` is *any* positive of query ``b``, so
    losses mask false negatives; ``positive_index[b]`` is the pool position of query ``b``'s first sampled
    positive.

    Besides the model inputs the batch carries ``indices`` (training rows, for memory banks), ``label_ids`` (pool
    label ids) and ``query_positive_ids`` (each query's positives, ``-1``-padded) so that targets can be rebuilt
    against a pool gathered from several processes.

    Args:
        tokenizer: the model's tokenizer.
        texts: query texts of the training set.
        targets: CSR ``(num_points, num_labels)`` training label matrix.
        label_texts: texts of all labels, in label-id order.
        max_seq_length / label_max_seq_length: token budgets.
        num_positives: positives sampled per query per step.
        positive_weights: optional per-label sampling weights (e.g. inverse propensities); uniform when None.
        num_negatives: hard negatives drawn per query from ``shortlist`` (ignored while no shortlist is set).
        all_labels: put every label in every pool (DEXML's "all negatives" mode; pair it with gradient caching).
        seed: base seed of the sampling. Each batch draws from a generator seeded by ``(seed, epoch, its rows)``, so
            a batch's samples do not depend on what came before it (a resumed run draws exactly the same).
    """

    tokenizer: Any
    texts: Sequence[str]
    targets: sp.csr_matrix
    label_texts: Sequence[str]
    max_seq_length: int = 32
    label_max_seq_length: int = 32
    num_positives: int = 1
    positive_weights: Optional[np.ndarray] = None
    num_negatives: int = 0
    all_labels: bool = False
    seed: int = 0
    shortlist: Optional[np.ndarray] = field(default=None, repr=False)
    epoch: int = 0

    def __post_init__(self):
        self.targets = sp.csr_matrix(self.targets)
        if self.targets.shape[1] != len(self.label_texts):
            raise ValueError(f"targets have {self.targets.shape[1]} label columns but {len(self.label_texts)} label texts were given")
        if self.positive_weights is not None:
            self.positive_weights = np.asarray(self.positive_weights, dtype=np.float64)
            if self.positive_weights.shape != (len(self.label_texts),) or (self.positive_weights <= 0).any():
                raise ValueError(f"positive_weights must be {len(self.label_texts)} positive numbers, one per label")

    def set_epoch(self, epoch: int) -> None:
        """Epoch number mixed into the per-batch sampling seed."""
        self.epoch = int(epoch)

    def batch_rng(self, rows: np.ndarray) -> np.random.Generator:
        """Generator for one batch, determined by ``(seed, epoch, rows)`` only."""
        return np.random.default_rng([self.seed, self.epoch, *rows.tolist()])

    def set_shortlist(self, shortlist: Optional[np.ndarray]) -> None:
        """Install the hard-negative shortlist: ``(num_points, K)`` label ids per training row, ``-1``-padded."""
        if shortlist is not None and shortlist.shape[0] != self.targets.shape[0]:
            raise ValueError(f"shortlist has {shortlist.shape[0]} rows for {self.targets.shape[0]} training points")
        self.shortlist = shortlist

    def _labels_of(self, r: int) -> np.ndarray:
        return self.targets.indices[self.targets.indptr[r] : self.targets.indptr[r + 1]]

    def _positive_probabilities(self, labels: np.ndarray) -> Optional[np.ndarray]:
        """Draw probabilities over a query's labels: ``positive_weights`` normalised, or None (uniform)."""
        if self.positive_weights is None:
            return None
        w = self.positive_weights[labels]
        return w / w.sum()

    def sample_positives(self, rows: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
        """Sample up to ``num_positives`` distinct positives per query (uniform or by ``positive_weights``)."""
        out = []
        for r in rows:
            labels = self._labels_of(r)
            if len(labels) <= self.num_positives:
                out.append(rng.permutation(labels))
                continue
            out.append(rng.choice(labels, self.num_positives, replace=False, p=self._positive_probabilities(labels)))
        return out

    def sample_negatives(self, rows: np.ndarray, rng: np.random.Generator) -> Optional[np.ndarray]:
        """Draw ``num_negatives`` labels per query uniformly from its shortlist (None without a shortlist)."""
        if self.shortlist is None or self.num_negatives <= 0:
            return None
        out = []
        for r in rows:
            candidates = self.shortlist[r]
            candidates = candidates[candidates >= 0]
            if len(candidates):
                out.append(rng.choice(candidates, min(self.num_negatives, len(candidates)), replace=False))
        return np.concatenate(out) if out else None

    def build_pool(
        self, rows: np.ndarray, sampled: list[np.ndarray], extra_labels: Optional[np.ndarray] = None, rng: Optional[np.random.Generator] = None
    ) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """Pool = unique sampled positives (+ ``extra_labels``); returns pool ids, targets and positive_index."""
        parts = [s for s in sampled if len(s)] + ([extra_labels] if extra_labels is not None else [])
        pool = np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
        targets = torch.from_numpy(self.targets[rows][:, pool].toarray() > 0)
        first = np.array([s[0] if len(s) else -1 for s in sampled])
        positive_index = torch.from_numpy(np.searchsorted(pool, np.maximum(first, 0)).astype(np.int64))
        return pool, targets, positive_index

    def query_positive_ids(self, rows: np.ndarray) -> torch.Tensor:
        """Each query's positive label ids, right-padded with ``-1``: ``(batch, max positives)``."""
        lists = [self._labels_of(r) for r in rows]
        out = torch.full((len(rows), max(1, max(len(x) for x in lists))), -1, dtype=torch.long)
        for i, x in enumerate(lists):
            out[i, : len(x)] = torch.from_numpy(x.astype(np.int64))
        return out

    def __call__(self, features: list[dict[str, int]]) -> dict[str, torch.Tensor]:
        rows = np.array([f["index"] for f in features], dtype=np.int64)
        rng = self.batch_rng(rows)
        sampled = self.sample_positives(rows, rng)
        extra = np.arange(len(self.label_texts)) if self.all_labels else self.sample_negatives(rows, rng)
        pool, targets, positive_index = self.build_pool(rows, sampled, extra, rng)
        q = self.tokenizer([self.texts[r] for r in rows], padding=True, truncation=True, max_length=self.max_seq_length, return_tensors="pt")
        lab = self.tokenizer([self.label_texts[i] for i in pool], padding=True, truncation=True, max_length=self.label_max_seq_length, return_tensors="pt")
        return {
            "input_ids": q["input_ids"],
            "attention_mask": q["attention_mask"],
            "label_input_ids": lab["input_ids"],
            "label_attention_mask": lab["attention_mask"],
            "targets": targets,
            "positive_index": positive_index,
            "indices": torch.from_numpy(rows),
            "label_ids": torch.from_numpy(pool.astype(np.int64)),
            "query_positive_ids": self.query_positive_ids(rows),
        }


@dataclass
class PSLDataCollator(XMCDataCollator):
    """UniDEC's pick-some-labels (PSL) batch: a capped label pool instead of every positive of every query.

    Per query ``num_positives`` positives are drawn *with replacement* (uniformly or by ``positive_weights``), as the
    official code does, so head queries contribute a few labels and tail queries all of theirs. The pool is then
    filled, up to ``max_label_pool`` labels, in three rounds, each ranked by how often the batch drew a label (ties
    broken at random): (1) the sampled positives, (2) the hard negatives drawn from each query's shortlist, (3) the
    batch queries' other positives, so that for torso and tail queries PSL equals pick-all-labels. Targets mark every
    positive of a query present in the pool, whoever brought it in (false negatives are never negatives).

    Args:
        max_label_pool: the cap on the pool (0 = no cap: every sampled positive, hard negative and batch positive).
        fill_with_batch_positives: run round (3).
        (other arguments: :class:`XMCDataCollator`)
    """

    max_label_pool: int = 0
    fill_with_batch_positives: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.max_label_pool < 0:
            raise ValueError(f"max_label_pool must be >= 0, got {self.max_label_pool}")

    def sample_positives(self, rows: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
        """``num_positives`` draws with replacement per query (duplicates kept: they count in the ranking)."""
        out = []
        for r in rows:
            labels = self._labels_of(r)
            if len(labels) == 0:
                out.append(labels.astype(np.int64))
                continue
            out.append(rng.choice(labels, self.num_positives, replace=True, p=self._positive_probabilities(labels)))
        return out

    def build_pool(
        self, rows: np.ndarray, sampled: list[np.ndarray], extra_labels: Optional[np.ndarray] = None, rng: Optional[np.random.Generator] = None
    ) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """Fill the pool by rounds (sampled positives, hard negatives, batch positives) up to the cap."""
        rng = rng if rng is not None else self.batch_rng(rows)
        cap = self.max_label_pool or np.inf
        rounds = [np.concatenate(sampled) if sampled else np.zeros(0, dtype=np.int64)]
        if extra_labels is not None:
            rounds.append(np.asarray(extra_labels))
        if self.fill_with_batch_positives:
            rounds.append(np.concatenate([self._labels_of(r) for r in rows]))
        chosen: list[np.ndarray] = []
        taken: set[int] = set()
        for candidates in rounds:
            room = cap - len(taken)
            if room <= 0 or len(candidates) == 0:
                continue
            ids, counts = np.unique(candidates.astype(np.int64), return_counts=True)
            fresh = np.array([i not in taken for i in ids.tolist()], dtype=bool)
            ids, counts = ids[fresh], counts[fresh]
            shuffle = rng.permutation(len(ids))  # random tie-break, then most frequent first
            ids, counts = ids[shuffle], counts[shuffle]
            ids = ids[np.argsort(-counts, kind="stable")][: int(min(room, len(ids)))]
            chosen.append(ids)
            taken.update(ids.tolist())
        pool = np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, dtype=np.int64)
        targets = torch.from_numpy(self.targets[rows][:, pool].toarray() > 0)
        # positive_index: the first sampled positive that made it into the pool, else any pooled positive (else 0)
        positive_index = targets.float().argmax(dim=1)
        for b, s in enumerate(sampled):
            hit = np.isin(s, pool)
            if hit.any():
                positive_index[b] = int(np.searchsorted(pool, s[hit][0]))
        return pool, targets, positive_index
