"""MUFIN's training pieces on the shared engine: the bag collator of its two training stages and Module II (the
augmented-retrieval shortlist that supplies Module IV's hard negatives).

Module I (``stage="siamese"``): a batch of labels (the paper, ``batch_over="labels"``) with ``num_positives`` sampled
positive items each, or a batch of items with the pool of their sampled positives (the official code's
``--doc_first``, ``batch_over="items"``, the default); either way the model's triplet loss is anchored on each pool label, with
in-batch hard negatives (the positives of the other labels). Module II: label centroids from
the Module-I encoder, the bag + centroid index over all labels, and a shortlist ``R_i`` per training item with its
positives removed. Module IV (``stage="ranker"``): per item ``num_positives`` positives (``S_i``) and
``num_negatives`` shortlist negatives (``T_i``); ``pair_mask`` tells the model which (item, label) pairs to score
with cross-attention and the classifier, so the cost per item stays ``|S_i| + |T_i|`` whatever the pool size.
After Module IV, :class:`MUFINCentroidCallback` recomputes the centroids with the final encoder, so the index that
evaluation builds and the model saves holds one embedding space (spec Sec. 12.11, option (a)).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional

import numpy as np
import scipy.sparse as sp
import torch
from transformers import TrainerCallback

from ..data import XMCDataset
from ..models.io_utils import write_json_atomic
from ..models.mufin_label_store import label_centroids_from_embeddings
from ..models.provenance import array_digest, check_derived, fingerprint_of
from .collator import XMCDataCollator

logger = logging.getLogger(__name__)

MUFIN_COLLATOR_STAGES = ("siamese", "ranker")
MUFIN_SIAMESE_BATCHES = ("labels", "items")


@dataclass
class MUFINDataCollator(XMCDataCollator):
    """Batches of MUFIN items and label pools as descriptor bags (see ``MUFINModel.prepare_bags``).

    Args:
        bag_processor: ``model.prepare_bags`` (tokenises texts, pre-processes images, records each descriptor's item).
        images: per training item a list of image paths (or PIL images); None for text-only data.
        label_images: per label a list of images; None for text-only labels.
        stage: ``"siamese"`` (pool = the batch's sampled positives) or ``"ranker"`` (plus ``num_negatives`` shortlist
            negatives per item, and a ``pair_mask`` of each item's own positives and negatives).
        batch_over: what a siamese batch is drawn over: ``"items"`` (the features' ``index`` are training items) or
            ``"labels"`` (they index :attr:`anchor_labels`, the labels with a training positive; each brings
            ``num_positives`` of its positive items; train on :meth:`anchor_label_dataset`). Ranker batches are
            always over items.
        cached_label_bags: ranker batches carry the pool's ``label_ids`` without its bags: the model reads ``Z^1`` /
            ``z^1`` from its ranker label cache (``MUFINModel.cached_label_side``), so no label text or image is
            tokenised, pre-processed or encoded in a step (see :class:`MUFINLabelRefreshCallback`).
        (other arguments: :class:`~hf_xmc.training.collator.XMCDataCollator`; ``tokenizer`` is unused)
    """

    bag_processor: Optional[Callable[..., dict]] = None
    images: Optional[Sequence[Sequence[Any]]] = None
    label_images: Optional[Sequence[Sequence[Any]]] = None
    stage: str = "siamese"
    batch_over: str = "items"
    cached_label_bags: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.bag_processor is None:
            raise ValueError("MUFINDataCollator needs bag_processor=model.prepare_bags")
        if self.stage not in MUFIN_COLLATOR_STAGES:
            raise ValueError(f"stage must be one of {MUFIN_COLLATOR_STAGES}, got {self.stage!r}")
        if self.batch_over not in MUFIN_SIAMESE_BATCHES:
            raise ValueError(f"batch_over must be one of {MUFIN_SIAMESE_BATCHES}, got {self.batch_over!r}")
        if self.images is not None and len(self.images) != len(self.texts):
            raise ValueError(f"{len(self.images)} image lists for {len(self.texts)} training items")
        if self.label_images is not None and len(self.label_images) != len(self.label_texts):
            raise ValueError(f"{len(self.label_images)} label image lists for {len(self.label_texts)} labels")

    def set_stage(self, stage: str) -> None:
        """Switch between the siamese (Module I) and ranker (Module IV) batches."""
        if stage not in MUFIN_COLLATOR_STAGES:
            raise ValueError(f"stage must be one of {MUFIN_COLLATOR_STAGES}, got {stage!r}")
        self.stage = stage

    def sample_item_negatives(self, rows: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
        """``T_i``: up to ``num_negatives`` labels per item drawn uniformly from its shortlist (known positives were
        removed when it was mined); empty lists without a shortlist or outside the ranker stage."""
        empty = np.zeros(0, dtype=np.int64)
        if self.stage != "ranker" or self.shortlist is None or self.num_negatives <= 0:
            return [empty for _ in rows]
        out = []
        for r in rows:
            candidates = self.shortlist[r]
            candidates = candidates[candidates >= 0]
            out.append(rng.choice(candidates, min(self.num_negatives, len(candidates)), replace=False) if len(candidates) else empty)
        return out

    @cached_property
    def _label_items(self) -> sp.csc_matrix:
        """Column ``l``: the training items of label ``l`` (built for label batches only)."""
        return self.targets.tocsc()

    @cached_property
    def anchor_labels(self) -> np.ndarray:
        """The labels with at least one training item: the labels a label-batched Module I draws."""
        return np.flatnonzero(np.diff(self._label_items.indptr) > 0)

    def anchor_label_dataset(self) -> XMCDataset:
        """The Module I training set when batches are drawn over labels: one row per label of :attr:`anchor_labels`
        (row ``j`` is label ``anchor_labels[j]``, its targets the label's training items), so the shared trainer's
        sampler, epochs and step counts run over labels."""
        texts = [self.label_texts[label] or "" for label in self.anchor_labels]
        return XMCDataset(texts=texts, targets=self._label_items[:, self.anchor_labels].T.tocsr(), uids=[str(label) for label in self.anchor_labels])

    def sample_label_items(self, labels: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
        """``P_l`` candidates: up to ``num_positives`` distinct training items per label, uniformly."""
        out = []
        for label in labels:
            items = self._label_items.indices[self._label_items.indptr[label] : self._label_items.indptr[label + 1]]
            out.append(items if len(items) <= self.num_positives else rng.choice(items, self.num_positives, replace=False))
        return out

    def _bags(self, texts: list, images: Optional[list], max_length: int, prefix: str = "") -> dict[str, torch.Tensor]:
        bags = self.bag_processor(texts, images, max_length=max_length)
        return {prefix + key: value for key, value in bags.items()}

    def __call__(self, features: list[dict[str, int]]) -> dict[str, torch.Tensor]:
        index = np.array([f["index"] for f in features], dtype=np.int64)
        if self.stage == "siamese" and self.batch_over == "labels":
            pool = np.unique(self.anchor_labels[index])
            rows = np.unique(np.concatenate(self.sample_label_items(pool, self.batch_rng(pool)))).astype(np.int64)
            return self._batch(rows, pool)
        rows = index
        rng = self.batch_rng(rows)
        positives = self.sample_positives(rows, rng)
        negatives = self.sample_item_negatives(rows, rng)
        parts = [p for p in positives + negatives if len(p)]
        pool = np.unique(np.concatenate(parts)).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
        batch = self._batch(rows, pool, label_bags=not (self.stage == "ranker" and self.cached_label_bags))
        if self.stage == "ranker":
            pair_mask = torch.zeros(len(rows), len(pool), dtype=torch.bool)
            for b, (pos, neg) in enumerate(zip(positives, negatives)):
                pair_mask[b, torch.from_numpy(np.searchsorted(pool, np.concatenate([pos, neg]).astype(np.int64)))] = True
            batch["pair_mask"] = pair_mask
        return batch

    def _batch(self, rows: np.ndarray, pool: np.ndarray, label_bags: bool = True) -> dict[str, torch.Tensor]:
        """Bags of the items ``rows`` and (with ``label_bags``) of the labels ``pool`` (sorted), with every true
        (item, label) pair as target."""
        targets = torch.from_numpy(self.targets[rows][:, pool].toarray() > 0)
        batch = self._bags(
            [self.texts[r] for r in rows], [list(self.images[r]) for r in rows] if self.images is not None else None, self.max_seq_length
        )
        if label_bags:
            batch.update(
                self._bags(
                    [self.label_texts[i] for i in pool],
                    [list(self.label_images[i]) for i in pool] if self.label_images is not None else None,
                    self.label_max_seq_length,
                    prefix="label_",
                )
            )
        batch.update(targets=targets, label_ids=torch.from_numpy(pool), indices=torch.from_numpy(rows))
        return batch


def mine_mufin_shortlist(
    model,
    texts: Sequence[Optional[str]],
    images: Optional[Sequence[Sequence[Any]]],
    targets: sp.spmatrix,
    top_k: int = 100,
    batch_size: int = 64,
    show_progress_bar: Optional[bool] = None,
    train_filter: Optional[sp.spmatrix] = None,
) -> np.ndarray:
    """MUFIN Module II with the current (Module-I) weights: label centroids ``mu_l`` from the training items, the
    label bags and the bag + centroid index re-built, then ``R_i`` for every training item, its positives and its
    ``train_filter`` pairs removed (``--train_filter_file``: on LF datasets the item's own label, the same text, which
    would otherwise be its first Module IV negative; an ``(n, L)`` matrix like ``targets``, None: no filter).

    Returns ``(n, top_k)`` int64 label ids, best first, ``-1``-padded.

    Memory: ``4 D`` bytes per training item (its ``x^1``), ``12 top_k`` per item of shortlist (ids and the scores
    :meth:`shortlist` returns), positives dropped chunk by chunk (no wider result to filter), beside the label store.
    """
    targets = sp.csr_matrix(targets)
    if targets.shape[0] != len(texts):
        raise ValueError(f"{len(texts)} training items but {targets.shape[0]} target rows")
    vectors = model.encode_items(texts, images, batch_size=batch_size, show_progress_bar=show_progress_bar)
    centroids, counts = label_centroids_from_embeddings(vectors, targets)
    model.set_label_centroids(centroids, counts)
    model.build_label_index(batch_size=batch_size, show_progress_bar=show_progress_bar)
    ids, _ = model.shortlist(vectors, size=top_k, exclude=shortlist_exclusions(targets, train_filter))  # dropped chunk by chunk
    logger.info("MUFIN Module II: a shortlist of up to %d labels for %d training items", top_k, len(texts))
    return ids


def shortlist_exclusions(targets: sp.spmatrix, train_filter: Optional[sp.spmatrix] = None) -> sp.csr_matrix:
    """The labels left out of each training item's shortlist: its positives and its training-filter pairs (boolean
    CSR, ``targets``' shape). Memory: one boolean CSR of ``nnz(targets) + nnz(filter)`` entries."""
    targets = sp.csr_matrix(targets, dtype=bool)
    if train_filter is None:
        return targets
    train_filter = sp.csr_matrix(train_filter, dtype=bool)
    if train_filter.shape != targets.shape:
        raise ValueError(f"the training filter has shape {train_filter.shape}, the targets {targets.shape}")
    return sp.csr_matrix(targets + train_filter, dtype=bool)


def shortlist_fingerprint(targets: sp.spmatrix, train_filter: Optional[sp.spmatrix] = None) -> dict:
    """What Module II's shortlists are mined from besides the weights: digests of the targets and of the training
    filter (``"none"`` without one), as :func:`~hf_xmc.models.provenance.fingerprint_of` records them (part
    ``training_shortlists``). Memory: the digests read the CSR arrays once, nothing is copied beyond one sort."""

    def csr_digest(matrix: sp.spmatrix) -> str:
        matrix = sp.csr_matrix(matrix, dtype=bool)
        matrix.sum_duplicates()
        matrix.sort_indices()
        return array_digest(np.asarray(matrix.shape, dtype=np.int64), matrix.indptr.astype(np.int64), matrix.indices.astype(np.int64))

    return fingerprint_of(targets=csr_digest(targets), train_filter=csr_digest(train_filter) if train_filter is not None else "none")


class MUFINShortlistRecordCallback(TrainerCallback):
    """Records what Module IV's shortlists were mined from in every checkpoint (``mufin_shortlist.json``: the
    :func:`shortlist_fingerprint`), and checks it when a run resumes from one: the checkpoint's shortlists come back
    with it (``XMCEpochCallback``), so a run resumed on other targets or another training filter would draw its
    negatives from shortlists mined for other data; that is refused in one line (``StaleDerivedPartError``,
    policy ``refuse``). A checkpoint without the record (written before it existed) is trusted as loaded.
    Memory: a few dozen bytes."""

    RECORD_FILE = "mufin_shortlist.json"

    def __init__(self, fingerprint: dict):
        self.fingerprint = fingerprint

    def on_train_begin(self, args, state, control, **kwargs):
        # on resume the trainer has read trainer_state.json back: global_step names the checkpoint it resumes from
        record = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", self.RECORD_FILE)
        if state.global_step and os.path.isfile(record):
            with open(record, encoding="utf-8") as f:
                recorded = json.load(f).get("fingerprint")
            check_derived("training_shortlists", recorded, self.fingerprint, subject=os.path.dirname(record),
                          hint="resume on the data the run started with (same training file, split and --train_filter_file), or start it again")
        return control

    def _record(self, args, state, control) -> None:
        # written when the trainer decides to save, before the checkpoint's own files: a checkpoint that reads as
        # complete (trainer_state.json, written last) always holds its record
        if control.should_save and args.should_save:
            directory = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            os.makedirs(directory, exist_ok=True)
            write_json_atomic(os.path.join(directory, self.RECORD_FILE), {"fingerprint": self.fingerprint})

    def on_step_end(self, args, state, control, **kwargs):
        self._record(args, state, control)
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        self._record(args, state, control)
        return control


class MUFINLabelRefreshCallback(TrainerCallback):
    """Module IV's cached label side: the model's ranker label cache (every label's ``Z^1``, ``z^1``; the recipe fills
    it from the label store Module II encoded, :func:`mine_mufin_shortlist`; empty, it is filled when the stage
    begins), re-encoded every ``refresh_steps`` optimizer steps (0: never during the stage), dropped when it ends.

    With :class:`MUFINDataCollator`'s ``cached_label_bags`` a ranker step encodes only its queries: the pool's label
    bags come from the cache, without gradient (the text and vision encoders still learn through the query side, which
    shares their weights; the cross-attention and classifiers learn as before). A refresh costs one forward pass over
    all labels, so ``refresh_steps`` trades the label side's staleness against that pass. A resumed stage starts
    from Module II's encoding again (the recipe mines again with Module I's weights read back): the same cache as an
    uninterrupted run with ``refresh_steps`` 0, an older one until the next refresh otherwise. Memory: ``4 D`` bytes
    per bag row and per label while the stage runs (beside the label store, once evaluation re-encodes it).
    """

    def __init__(self, refresh_steps: int = 0, batch_size: int = 64):
        if refresh_steps < 0:
            raise ValueError(f"refresh_steps must be >= 0 (0: never re-encoded during the stage), got {refresh_steps}")
        self.refresh_steps, self.batch_size = refresh_steps, batch_size
        self.refreshes = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # the recipe caches Module II's encoding right after mining (the trainer's set_labels then drops the store);
        # without it (the callback used on its own) the labels are encoded now
        if model.ranker_label_cache is None:
            logger.info("MUFIN Module IV: no cached label bags yet: taken from the label store or encoded now")
            model.cache_ranker_labels(batch_size=self.batch_size, show_progress_bar=not args.disable_tqdm, reuse_store=True)
        return control

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.refresh_steps and state.global_step % self.refresh_steps == 0 and state.global_step < state.max_steps:
            model.cache_ranker_labels(batch_size=self.batch_size, show_progress_bar=False)
            self.refreshes += 1
            logger.info("MUFIN Module IV: label bags re-encoded at step %d", state.global_step)
        return control

    def on_train_end(self, args, state, control, model=None, **kwargs):
        model.ranker_label_cache = None  # the stage is over: predictions use the label store, rebuilt from the final weights
        return control


class MUFINCentroidCallback(TrainerCallback):
    """Recompute the label centroids ``mu_l`` from the training items with the final weights when training ends.

    Module II computes the centroids with the Module-I encoder; Module IV keeps changing the encoders and ``A_S``, so
    without this the index would mix Module-I centroids with label bags re-encoded by the final model (spec Sec. 12.11:
    option (a), the index rebuilt with the final encoder). Evaluation and ``save_pretrained`` then build the index from
    the fresh centroids and bags. Memory: one ``x^1`` per training item (``4 D`` bytes) while it runs, then ``4 D``
    bytes per label.
    """

    def __init__(self, texts: Sequence[Optional[str]], images: Optional[Sequence[Sequence[Any]]], targets: sp.spmatrix, batch_size: int = 64):
        self.texts, self.images, self.targets, self.batch_size = texts, images, sp.csr_matrix(targets), batch_size

    def on_train_end(self, args, state, control, model=None, **kwargs):
        model.compute_label_centroids(self.texts, self.images, self.targets, batch_size=self.batch_size, show_progress_bar=not args.disable_tqdm)
        model.invalidate_label_index()  # bags and index are rebuilt from the final weights on next use
        logger.info("MUFIN: label centroids recomputed with the final encoder from %d training items", len(self.texts))
        return control


__all__ = [
    "MUFINCentroidCallback",
    "MUFINDataCollator",
    "MUFINLabelRefreshCallback",
    "MUFINShortlistRecordCallback",
    "mine_mufin_shortlist",
    "shortlist_exclusions",
    "shortlist_fingerprint",
]
