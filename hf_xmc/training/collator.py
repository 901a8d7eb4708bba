"""Training dataset and collator: queries plus a label pool with multi-label targets."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import scipy.sparse as sp
import torch
from torch.utils.data import Dataset

from ..data import XMCDataset
from ..models.encoder_utils import tokenize_texts


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


def label_shard_bounds(num_labels: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, stop)`` of process ``rank``'s contiguous shard of ``num_labels`` labels (sizes differ by at most one)."""
    return num_labels * rank // world_size, num_labels * (rank + 1) // world_size


@dataclass
class LabelTokens:
    """Token ids of a contiguous range of labels, tokenised once for the all-label mode.

    Memory: ``4 * max_length + 4`` bytes per label (int32 ids, right-padded with the pad id, and an int32 length);
    e.g. 132 bytes per label at 32 tokens, 172 MB for 1.3M labels, split across processes (each holds its shard).
    Chunks are padded only to their own longest label when they become model inputs (:meth:`model_inputs`).

    Attributes:
        input_ids: ``(n, max_length)`` int32.
        lengths: ``(n,)`` int32 token counts.
        start: global id of the first label.
        pad_token_id: the id in padded positions.
    """

    input_ids: torch.Tensor
    lengths: torch.Tensor
    start: int = 0
    pad_token_id: int = 0

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device) -> LabelTokens:
        """The same tokens on ``device``."""
        return LabelTokens(self.input_ids.to(device), self.lengths.to(device), self.start, self.pad_token_id)

    @staticmethod
    def model_inputs(input_ids: torch.Tensor, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
        """``input_ids`` / ``attention_mask`` (int64) of some rows of ``input_ids``, cut to their longest label."""
        width = max(int(lengths.max()), 1) if len(lengths) else 1
        ids = input_ids[:, :width].long()
        mask = (torch.arange(width, device=ids.device).unsqueeze(0) < lengths.unsqueeze(1)).long()
        return {"input_ids": ids, "attention_mask": mask}


def tokenize_labels(
    tokenizer, label_texts: Sequence[str], max_length: int, start: int = 0, stop: Optional[int] = None, batch_size: int = 8192
) -> LabelTokens:
    """Tokenise labels ``start .. stop - 1`` once (``batch_size`` texts at a time) into a :class:`LabelTokens`.

    Rows are written left-aligned whatever the tokenizer's padding side, so that :meth:`LabelTokens.model_inputs` can
    cut a chunk to its longest label.
    """
    stop = len(label_texts) if stop is None else stop
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = np.full((stop - start, max_length), pad, dtype=np.int32)
    lengths = np.zeros(stop - start, dtype=np.int32)
    for a in range(start, stop, batch_size):
        b = min(a + batch_size, stop)
        rows = tokenize_texts(tokenizer, [label_texts[i] for i in range(a, b)], max_length)["input_ids"]
        n = np.fromiter(map(len, rows), dtype=np.int32, count=b - a)
        flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int32, count=int(n.sum()))
        ids[a - start : b - start][np.arange(max_length) < n[:, None]] = flat  # row-major fill: row i gets its n_i ids
        lengths[a - start : b - start] = n
    return LabelTokens(torch.from_numpy(ids), torch.from_numpy(lengths), start, int(pad))


class EpochSeededBatches:
    """Per-batch random draws of a collator with ``seed`` and ``epoch`` attributes: each batch's generator is seeded
    by ``(seed, epoch, its rows)`` only, so a batch draws the same whatever came before it (a resumed run included);
    the trainer calls :meth:`set_epoch` at every epoch start."""

    seed: int
    epoch: int

    def set_epoch(self, epoch: int) -> None:
        """Epoch number mixed into the per-batch sampling seed."""
        self.epoch = int(epoch)

    def batch_rng(self, rows: np.ndarray) -> np.random.Generator:
        """Generator for one batch, determined by ``(seed, epoch, rows)`` only."""
        return np.random.default_rng([self.seed, self.epoch, *np.asarray(rows).tolist()])


@dataclass
class XMCDataCollator(EpochSeededBatches):
    """Builds a training batch: tokenised queries, a label pool and the ``(batch, pool)`` target mask.

    For every query ``num_positives`` positives are sampled from its labels (uniformly, or proportionally to the
    labels' inverse propensity so tail labels are seen more often); with a hard-negative ``shortlist`` set,
    ``num_negatives`` labels are also drawn from each query's shortlist. The pool is the union of everything
    sampled for the batch. ``targets[b, p]`` is True whenever pool label ``p`` is *any* positive of query ``b``, so
    losses mask false negatives; ``positive_index[b]`` is the pool position of query ``b``'s first sampled
    positive.

    With ``all_labels`` (DEXML's all-label mode) the batch holds only the queries, ``indices`` and
    ``query_positive_ids``: the pool is every label, so neither label tokens nor targets are built per batch.

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
        all_labels: DEXML's "all negatives" mode: every label is in every pool, so the batch carries no label tokens and
            no targets, only the queries and their ``query_positive_ids``; the trainer scores the queries against every
            label (its process's shard of :func:`tokenize_labels`) chunk by chunk.
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

    @classmethod
    def for_model(cls, model, train: XMCDataset, label_texts: Sequence[str], **kwargs: Any):
        """The collator over the training set ``train`` and ``label_texts`` with ``model``'s tokenizer and token
        budgets; ``kwargs`` set the other fields (sampling, seed, a subclass's own)."""
        return cls(
            tokenizer=model._require_tokenizer(),
            texts=train.texts,
            targets=sp.csr_matrix(train.targets),
            label_texts=label_texts,
            max_seq_length=model.config.max_seq_length,
            label_max_seq_length=model.config.label_max_seq_length,
            **kwargs,
        )

    def __post_init__(self):
        self.targets = sp.csr_matrix(self.targets)
        if self.targets.shape[1] != len(self.label_texts):
            raise ValueError(f"targets have {self.targets.shape[1]} label columns but {len(self.label_texts)} label texts were given")
        if self.positive_weights is not None:
            self.positive_weights = np.asarray(self.positive_weights, dtype=np.float64)
            if self.positive_weights.shape != (len(self.label_texts),) or (self.positive_weights <= 0).any():
                raise ValueError(f"positive_weights must be {len(self.label_texts)} positive numbers, one per label")

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
        q = tokenize_texts(self.tokenizer, [self.texts[r] for r in rows], self.max_seq_length, padding=True, return_tensors="pt")
        if self.all_labels:  # the pool is every label: no pool tokens, no (batch, L) targets, only id lists
            return {
                "input_ids": q["input_ids"],
                "attention_mask": q["attention_mask"],
                "indices": torch.from_numpy(rows),
                "query_positive_ids": self.query_positive_ids(rows),
            }
        rng = self.batch_rng(rows)
        sampled = self.sample_positives(rows, rng)
        pool, targets, positive_index = self.build_pool(rows, sampled, self.sample_negatives(rows, rng), rng)
        lab = tokenize_texts(self.tokenizer, [self.label_texts[i] for i in pool], self.label_max_seq_length, padding=True, return_tensors="pt")
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
