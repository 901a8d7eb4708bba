"""SiameseXML's training pieces on the shared engine (spec ``shared/specs/siamesexml.md``).

- Module I batches over labels: :class:`SiameseLabelCollator` draws labels with probability ``freq^power``
  (with replacement, ``draws_per_epoch`` per epoch), one positive point per drawn label and a second one for the
  label's centroid estimate; the targets mark every true (point, label) pair of the batch.
- Module II: :func:`label_correlation_matrix` (the random walk with restart that smooths label-text vectors over
  correlated labels), :func:`build_label_state` (``z~ = N(M f(Z))`` and the centroids ``v_l``) and
  :func:`mine_classifier_shortlist` (per training point, its shortlist from the index over ``[z~ ; v]`` plus the
  votes of its nearest training points, positives and the training filter's pairs removed); :class:`ModuleIIStore`
  keeps them on disk for a resumed run, with a fingerprint of what they were mined from.
- Module III is the model's initialisation (``eta = 0``); Module IV trains on
  :class:`~hf_xmc.training.classifier_stage.ClassifierStageCollator` batches.
- :func:`bag_of_embeddings_idf`: document frequencies of the tokenizer's tokens for the bag-of-embeddings encoder.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np
import scipy.sparse as sp
import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from ..data import filter_predictions
from ..models.classifier_head import sum_label_scores
from ..models.encoder_utils import tokenize_texts
from .collator import XMCDataCollator

logger = logging.getLogger(__name__)


def label_sampling_probabilities(targets: sp.spmatrix, power: float = 0.45) -> np.ndarray:
    """``freq_l^power / sum`` over labels (0 for labels without training points): Module I's label distribution
    ([P]: power 0.45; 0 = uniform over labels with points, 1 = the natural, document-batch distribution)."""
    freq = np.asarray(sp.csc_matrix(targets).getnnz(axis=0), dtype=np.float64)
    weights = np.where(freq > 0, np.power(np.maximum(freq, 1.0), power), 0.0)
    if weights.sum() <= 0:
        raise ValueError("no label has a training point: Module I has nothing to draw")
    return weights / weights.sum()


class LabelDrawDataset(Dataset):
    """``num_draws`` items ``{"index": i}``: the i-th label draw of the epoch (the collator maps it to a label)."""

    def __init__(self, num_draws: int):
        if num_draws < 1:
            raise ValueError(f"num_draws must be >= 1, got {num_draws}")
        self.num_draws = int(num_draws)

    def __len__(self) -> int:
        return self.num_draws

    def __getitem__(self, i: int) -> dict[str, int]:
        return {"index": int(i)}


@dataclass
class SiameseLabelCollator(XMCDataCollator):
    """Module I batches over labels (spec Sec. 5).

    Item ``i`` of :class:`LabelDrawDataset` is the i-th draw of the epoch's label sequence (``draws_per_epoch`` labels
    drawn with replacement from :func:`label_sampling_probabilities`, seeded by ``(seed, epoch)``). Per drawn label
    the batch holds one positive point (uniform over the label's points), the label text and a second positive for
    the centroid estimate ``N(f(x'_l) + f(z_l))``; ``targets[b, j]`` is True when point ``b`` is relevant to batch label
    ``j`` (repeated labels and shared positives included).

    Mined label negatives: with ``label_neighbors`` (``(L, K)`` label ids, ``-1``-padded: :func:`mine_label_neighbors`)
    and ``neighbors_per_draw = m``, a batch of ``B`` draws keeps its first ``ceil(B / (1 + m))`` drawn labels, each
    followed by ``m`` labels picked uniformly from its ``K`` neighbours (the batch stays ``B`` labels, so a step costs
    the same): the softmax over the batch's labels then sets a label against the labels most like it instead of ``B``
    random ones. A drawn label without neighbours keeps the draws it would have displaced.

    Args (besides :class:`~hf_xmc.training.collator.XMCDataCollator`'s): ``power`` (0.45), ``draws_per_epoch``,
    ``label_neighbors``, ``neighbors_per_draw``.
    Memory: the epoch's draws (8 bytes each), the CSC copy of the targets and ``8 K`` bytes per label of neighbours.
    """

    power: float = 0.45
    draws_per_epoch: int = 0
    label_neighbors: Optional[np.ndarray] = None
    neighbors_per_draw: int = 0

    def __post_init__(self):
        super().__post_init__()
        self._label_points = self.targets.tocsc()
        self.probabilities = label_sampling_probabilities(self._label_points, self.power)
        if self.draws_per_epoch < 1:
            raise ValueError(f"draws_per_epoch must be >= 1, got {self.draws_per_epoch}")
        self._draws: Optional[np.ndarray] = None
        self._draws_epoch: Optional[int] = None
        if self.neighbors_per_draw < 0:
            raise ValueError(f"neighbors_per_draw must be >= 0, got {self.neighbors_per_draw}")
        if self.neighbors_per_draw and self.label_neighbors is None:
            raise ValueError("neighbors_per_draw > 0 needs label_neighbors (mine_label_neighbors)")
        if self.label_neighbors is not None and self.label_neighbors.shape[0] != len(self.probabilities):
            raise ValueError(f"label_neighbors has {self.label_neighbors.shape[0]} rows for {len(self.probabilities)} labels")

    def epoch_draws(self) -> np.ndarray:
        """The epoch's label draws (int64, ``draws_per_epoch``)."""
        if self._draws is None or self._draws_epoch != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch, 4539])
            self._draws = rng.choice(len(self.probabilities), self.draws_per_epoch, replace=True, p=self.probabilities)
            self._draws_epoch = self.epoch
        return self._draws

    def _random_points(self, labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        start, stop = self._label_points.indptr[labels], self._label_points.indptr[labels + 1]
        return self._label_points.indices[start + (rng.random(len(labels)) * (stop - start)).astype(np.int64)].astype(np.int64)

    def with_neighbors(self, labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The batch's labels with mined negatives: every ``(1 + m)``-th slot a drawn label, the ``m`` slots after it
        its neighbours (a slot whose label has no neighbour keeps its own draw)."""
        group = 1 + self.neighbors_per_draw
        seeds = labels[::group]
        candidates = self.label_neighbors[seeds]  # (S, K)
        valid = (candidates >= 0).sum(axis=1)
        picks = (rng.random((len(seeds), group - 1)) * np.maximum(valid, 1)[:, None]).astype(np.int64)
        mined = np.take_along_axis(candidates, picks, axis=1)  # valid neighbours come first in each row
        grouped = np.concatenate([seeds[:, None], mined], axis=1).reshape(-1)[: len(labels)]
        return np.where(grouped >= 0, grouped, labels)

    def __call__(self, features: list[dict[str, int]]) -> dict[str, torch.Tensor]:
        draws = np.array([f["index"] for f in features], dtype=np.int64)
        labels = self.epoch_draws()[draws]
        rng = self.batch_rng(draws)
        if self.neighbors_per_draw:
            labels = self.with_neighbors(labels, rng)
        points, second = self._random_points(labels, rng), self._random_points(labels, rng)
        targets = torch.from_numpy(self.targets[points][:, labels].toarray() > 0)
        q = tokenize_texts(self.tokenizer, [self.texts[r] for r in points], self.max_seq_length, padding=True, return_tensors="pt")
        c = tokenize_texts(self.tokenizer, [self.texts[r] for r in second], self.max_seq_length, padding=True, return_tensors="pt")
        lab = tokenize_texts(self.tokenizer, [self.label_texts[i] for i in labels], self.label_max_seq_length, padding=True, return_tensors="pt")
        return {
            "input_ids": q["input_ids"],
            "attention_mask": q["attention_mask"],
            "label_input_ids": lab["input_ids"],
            "label_attention_mask": lab["attention_mask"],
            "centroid_input_ids": c["input_ids"],
            "centroid_attention_mask": c["attention_mask"],
            "targets": targets,
            "label_ids": torch.from_numpy(labels),
            "indices": torch.from_numpy(points),
        }


def label_correlation_matrix(
    targets: sp.spmatrix, walk_length: int = 400, restart: float = 0.8, top_k: int = 10, seed: int = 0, chunk_size: int = 20000
) -> sp.csr_matrix:
    """SiameseXML's label-correlation operator ``M`` (spec Sec. 4.2, [C] pyxclib ``RandomWalk.simulate(400, 0.8, 10)``).

    From every label with training points a walk of ``walk_length`` hops on the label-point graph (label -> a random
    positive point -> a random label of that point), restarting at its start label with probability ``restart``
    before each hop; visits are counted, the ``top_k`` most visited labels kept per row and the diagonal always kept
    (its count, or 1 if never visited); then ``M = D_r^-1/2 A D_c^-1/2``. Labels without training points keep only
    ``M_ll = 1``. Vectorised over ``chunk_size`` start labels at a time: memory ``walk_length x chunk_size`` visits
    (8 bytes each) per chunk plus ``top_k + 1`` entries per label.
    """
    y = sp.csr_matrix(targets)
    y.eliminate_zeros()
    by_label = y.tocsc()
    num_labels = y.shape[1]
    label_degree = np.diff(by_label.indptr)
    point_degree = np.diff(y.indptr)
    rng = np.random.default_rng(seed)
    rows, cols, vals = [], [], []
    starts = np.flatnonzero(label_degree > 0)
    for chunk_start in range(0, len(starts), chunk_size):
        start = starts[chunk_start : chunk_start + chunk_size]
        current = start.copy()
        visits = np.empty((walk_length, len(start)), dtype=np.int64)
        for step in range(walk_length):
            back = rng.random(len(start)) < restart
            current[back] = start[back]
            deg = label_degree[current]
            points = by_label.indices[by_label.indptr[current] + (rng.random(len(start)) * deg).astype(np.int64)]
            pdeg = point_degree[points]
            current = y.indices[y.indptr[points] + (rng.random(len(start)) * pdeg).astype(np.int64)]
            visits[step] = current
        local = np.broadcast_to(np.arange(len(start)), visits.shape).ravel()
        counts = sp.csr_matrix((np.ones(visits.size, dtype=np.float32), (local, visits.ravel())), shape=(len(start), num_labels))
        counts.sum_duplicates()
        for i in range(len(start)):
            lo, hi = counts.indptr[i], counts.indptr[i + 1]
            ids, c = counts.indices[lo:hi], counts.data[lo:hi]
            diagonal = float(c[ids == start[i]][0]) if (ids == start[i]).any() else 1.0
            order = np.argsort(-c, kind="stable")[:top_k]
            keep = {int(ids[j]): float(c[j]) for j in order}
            keep[int(start[i])] = diagonal
            rows.extend([int(start[i])] * len(keep))
            cols.extend(keep.keys())
            vals.extend(keep.values())
    isolated = np.flatnonzero(label_degree == 0)
    rows.extend(isolated.tolist())
    cols.extend(isolated.tolist())
    vals.extend([1.0] * len(isolated))
    a = sp.csr_matrix((np.asarray(vals, dtype=np.float64), (np.asarray(rows), np.asarray(cols))), shape=(num_labels, num_labels))
    row_sum, col_sum = np.asarray(a.sum(axis=1)).ravel(), np.asarray(a.sum(axis=0)).ravel()
    d_r = sp.diags(1.0 / np.sqrt(np.maximum(row_sum, 1e-12)))
    d_c = sp.diags(1.0 / np.sqrt(np.maximum(col_sum, 1e-12)))
    return sp.csr_matrix(d_r @ a @ d_c, dtype=np.float32)


@torch.no_grad()
def build_label_state(
    model,
    train_texts: Sequence[str],
    train_targets: sp.spmatrix,
    correlation: Optional[sp.spmatrix] = None,
    batch_size: int = 128,
    show_progress_bar: Optional[bool] = None,
) -> torch.Tensor:
    """Module II's label state from the frozen encoder: ``z~ = N(M f(Z))`` (``f(Z)`` when ``correlation`` is None) and
    ``v_l = N(mean of f(x_i), i in R_l)``, set on the model (:meth:`SiameseXMLModel.set_label_state`). Returns the
    training points' intermediate embeddings ``(N, D)`` (Module IV's inputs and the neighbour index), held in the
    label store's precision (``config.label_embeddings_dtype``: float16 halves them at scale).

    Memory: ``2 D`` (float16) or ``4 D`` bytes per training point and ``8 D`` per label (plus ``M``'s ``top_k + 1``
    entries per label); ``4 D`` more per label while ``M f(Z)`` is formed.
    """
    from .label_state import label_centroids

    labels = model.encode_labels(batch_size=batch_size, show_progress_bar=show_progress_bar)
    if correlation is not None:
        labels = torch.from_numpy(np.asarray(sp.csr_matrix(correlation) @ labels.numpy(), dtype=np.float32))
    dtype = getattr(torch, model.config.label_embeddings_dtype)
    points = model.encode_queries(train_texts, batch_size=batch_size, show_progress_bar=show_progress_bar, dtype=dtype)
    model.set_label_state(labels, label_centroids(points, train_targets))
    return points


@torch.no_grad()
def mine_label_neighbors(
    model, label_texts: Sequence[str], train_targets: sp.spmatrix, k: int = 10, batch_size: int = 128, show_progress_bar: Optional[bool] = None
) -> np.ndarray:
    """Module I's mined label negatives: per label, its ``k`` nearest labels with training points by the encoder's
    label-text vectors ``f(z)`` (itself left out), nearest first, ``-1``-padded; ``(L, k)`` int64. Searched with the
    model's index kind (``config.index_kind``: exact on small label spaces, ivf at 10^6 labels).

    Memory: ``4 D`` bytes per label with points for the vectors (and the index's copy), ``8 (k + 1)`` per label for
    the hits.
    """
    from ..models.label_index import LabelIndex

    with_points = np.flatnonzero(sp.csc_matrix(train_targets).getnnz(axis=0) > 0)
    neighbors = np.full((len(label_texts), k), -1, dtype=np.int64)
    if len(with_points) < 2 or k < 1:
        return neighbors
    vectors = model.encode_labels([label_texts[i] for i in with_points], batch_size=batch_size, show_progress_bar=show_progress_bar).float()
    index = LabelIndex(vectors, kind=model.config.index_kind, ivf_nprobe=model.config.ivf_nprobe)
    _, hits = index.search(vectors, k=k + 1)
    found = np.where(hits >= 0, with_points[np.maximum(hits, 0)], -1)
    found[found == with_points[:, None]] = -1  # the label itself
    order = np.argsort(found < 0, axis=1, kind="stable")  # found labels first, in their rank order
    neighbors[with_points] = np.take_along_axis(found, order, axis=1)[:, :k]
    return neighbors


@torch.no_grad()
def mine_classifier_shortlist(
    model,
    point_vectors: torch.Tensor,
    train_targets: sp.spmatrix,
    size: int = 100,
    knn_neighbors: int = 50,
    knn_weight: float = 0.025,
    chunk_size: int = 8192,
    show_progress_bar: Optional[bool] = None,
    out: Optional[np.ndarray] = None,
    first: int = 0,
    on_chunk: Optional[Callable[[int], None]] = None,
    neighbour_index_dir: Optional[str] = None,
    exclude: Optional[sp.spmatrix] = None,
) -> np.ndarray:
    """Module II's static shortlist of every training point: ``(1 - gamma) (cos_z + cos_v)`` from the model's index over
    ``[z~ ; v]`` plus ``gamma`` times the votes of its ``knn_neighbors`` nearest training points (each neighbour adds
    its cosine to each of its labels, divided by the point's largest vote; ``gamma = knn_weight``, [C] 0.025), best
    ``size`` negatives kept (positives removed, and the pairs of ``exclude``: an ``(N, L)`` matrix such as
    ``--train_filter_file``'s, labels that are the point itself, never Module IV negatives). Returns ``(N, size)``
    int32 label ids, ``-1``-padded.

    Resuming: ``out`` (e.g. :meth:`ModuleIIStore.open_shortlist`'s memory map) is filled in place from row ``first``
    on (rows before it are kept), and ``on_chunk(rows_done)`` is called after each chunk of ``chunk_size`` points.
    ``neighbour_index_dir``: the neighbour index is read from there when it was built from these point vectors, else
    built and saved there (:meth:`LabelIndex.cached`).

    Memory: ``4 x size`` bytes per point, plus one chunk of hits; the neighbour index uses ``point_vectors`` in place
    and its faiss copy holds them at their precision (``2 D`` bytes per point in float16, ``4 D`` in float32); with
    ``exclude``, a CSR union of the targets and its pairs (``8`` bytes per pair).
    """
    from ..models.label_index import LabelIndex

    targets = sp.csr_matrix(train_targets)
    n = point_vectors.shape[0]
    if targets.shape[0] != n:
        raise ValueError(f"{n} point vectors for {targets.shape[0]} target rows")
    removed = targets  # the pairs never shortlisted: the positives (the votes still come from the targets alone) ...
    if exclude is not None:
        if exclude.shape != targets.shape:
            raise ValueError(f"exclude has shape {exclude.shape}, expected the targets' {targets.shape}")
        # ... and the training filter's: searched past and filtered out like positives
        removed = sp.csr_matrix(((targets != 0) + (sp.csr_matrix(exclude) != 0)).astype(np.float32))
    neighbours = None
    if knn_neighbors > 0 and knn_weight > 0:
        neighbours = LabelIndex.cached(point_vectors, neighbour_index_dir, kind=model.config.index_kind, ivf_nprobe=model.config.ivf_nprobe)
    max_positives = int(np.diff(removed.indptr).max()) if removed.nnz else 0
    if out is None:
        out = np.full((n, size), -1, dtype=np.int32)
    elif tuple(out.shape) != (n, size):
        raise ValueError(f"out must have shape {(n, size)}, got {tuple(out.shape)}")
    show = n - first > chunk_size if show_progress_bar is None else show_progress_bar
    began, next_report = time.perf_counter(), first + n // 10
    for start in tqdm(range(first, n, chunk_size), desc="Module II shortlists", disable=not show, unit="chunk"):
        if not show and start >= next_report > first:  # without a progress bar (--disable_tqdm): a line per tenth
            rate = (start - first) / max(time.perf_counter() - began, 1e-9)
            logger.info("Module II shortlists: %d / %d training points, %.0f points/s, ~%.0f min left", start, n, rate, (n - start) / rate / 60)
            next_report += n // 10
        stop = min(start + chunk_size, n)
        queries = point_vectors[start:stop]
        extra = None
        weights = (1.0, 1.0)
        if neighbours is not None:
            weights = (1.0 - knn_weight, 1.0 - knn_weight)
            sims, rows = neighbours.search(queries, min(knn_neighbors, n))
            valid = rows >= 0
            query_of = np.repeat(np.arange(stop - start), valid.sum(axis=1))
            hit_rows, hit_sims = rows[valid], sims[valid]
            counts = np.diff(targets.indptr)[hit_rows]
            vote_query = np.repeat(query_of, counts)
            vote_label = targets[hit_rows].indices.astype(np.int64)  # each neighbour's labels, neighbours in order
            vote_value = np.repeat(hit_sims, counts).astype(np.float64)
            # each point's summed votes, normalised by its largest
            vote_query, vote_label, summed = sum_label_scores(vote_query, vote_label, vote_value, targets.shape[1])
            best = np.zeros(stop - start)
            np.maximum.at(best, vote_query, summed)
            extra = (vote_query, vote_label, summed * (knn_weight / np.maximum(best[vote_query], 1e-12)))
        ids, scores = model.shortlist(queries, size + max_positives, source_weights=weights, extra_hits=extra)
        ids, _ = filter_predictions(ids, scores, removed[start:stop], size)
        out[start:stop] = ids
        if on_chunk is not None:
            on_chunk(stop)
    return out


class ModuleIIStore:
    """What Module II computed, kept under ``directory`` (the recipe's ``OUT/module2``) so that a resumed run reads it
    back instead of computing it again: at 1.3M labels the label state takes ~25 minutes and the shortlists of 2.2M
    training points 2-3 hours on 2 CPU cores.

    - ``label_state.safetensors`` (``z~`` and ``v``, float32: ``8 D`` bytes per label), ``points.npy`` (the training-point
      vectors at the label store's precision: ``2 D`` or ``4 D`` bytes per point) and ``module2.json`` (the settings they
      were made with and the fingerprint of the shortlists' inputs, written last): once, before mining;
    - ``shortlist.npy``: the ``(N, S)`` int32 shortlists (``4 S`` bytes per point), filled in place through a memory map,
      and ``progress.json``: how many leading rows are final, rewritten after each mined chunk is flushed to disk;
    - ``label_index/`` and ``point_index/``: the faiss files of the shortlist index over ``[z~ ; v]`` and of the
      training-point neighbour index (:meth:`LabelIndex.cached`: read back only when built from the same vectors), so
      a resumed run does not build them again (IVF fp16: ``2 D + 8`` bytes per indexed row, ~12 minutes of builds at
      1.3M labels and 2.2M points on 2 CPU cores).

    Every file is written to a temporary name and renamed, so a run killed at any point leaves a readable store. A store
    made with other settings (data shape, shortlist size, neighbour votes, label graph, seed) is not read: Module II
    starts over. ``writer=False`` (the processes other than the first of a multi-process run) only reads.

    ``fingerprint`` (:func:`hf_xmc.models.provenance.fingerprint_of`: the digests of the training targets and the
    training filter, the validation split's fingerprint and the seed) is what the shortlists are mined from; it is
    recorded in ``module2.json`` and a resumed run made from other inputs is refused in one line
    (:meth:`check_inputs`, the ``training_shortlists`` part's ``refuse`` policy): its rows would be other points, its
    negatives another filter's. A store recorded without one (made before fingerprints) is trusted as loaded.
    """

    LABEL_INDEX_DIR = "label_index"
    POINT_INDEX_DIR = "point_index"

    FINGERPRINT_KEY = "fingerprint"
    REFUSED_HINT = ("resume with the run's own --seed, data files and --train_filter_file, or start over without "
                    "--resume_from_checkpoint (or in another --output_dir)")

    def __init__(self, directory: str, settings: dict, writer: bool = True, fingerprint: Optional[dict] = None):
        self.directory = directory
        self.settings = dict(settings)
        self.writer = writer
        self.fingerprint = dict(fingerprint) if fingerprint is not None else None
        self._shortlist: Optional[np.ndarray] = None

    def _record(self) -> Optional[dict]:
        """``module2.json`` as written: the settings and, when recorded, the fingerprint (None without a store)."""
        return self._read_json("module2.json")

    def check_inputs(self) -> None:
        """Refuse (:class:`~hf_xmc.models.provenance.StaleDerivedPartError`, one line) a store whose shortlists were
        mined from other inputs than this run's ``fingerprint``; nothing to check without a store, a recorded
        fingerprint or a current one."""
        from ..models.provenance import check_derived

        record = self._record()
        if self.fingerprint is None or not record:
            return
        check_derived("training_shortlists", record.get(self.FINGERPRINT_KEY), self.fingerprint,
                      subject=self._path("shortlist.npy"), hint=self.REFUSED_HINT)

    def index_dir(self, name: str) -> Optional[str]:
        """Where the index ``name`` (:attr:`LABEL_INDEX_DIR` / :attr:`POINT_INDEX_DIR`) is kept; None for a process that
        does not write (it builds its own: two processes writing one file could leave it and its checksum apart)."""
        return self._path(name) if self.writer else None

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _read_json(self, name: str) -> Optional[dict]:
        try:
            with open(self._path(name)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def _write_json(self, name: str, obj: dict) -> None:
        from ..models.io_utils import write_json_atomic

        write_json_atomic(self._path(name), obj)

    def clear(self) -> None:
        """Remove a previous run's store (its settings file first, so that a partial removal reads as no store)."""
        if not self.writer:
            return
        for name in ("module2.json", "progress.json", "shortlist.npy", "points.npy", "label_state.safetensors"):
            if os.path.exists(self._path(name)):
                os.remove(self._path(name))
        for name in (self.LABEL_INDEX_DIR, self.POINT_INDEX_DIR):
            shutil.rmtree(self._path(name), ignore_errors=True)

    def load_label_state(self, model) -> Optional[torch.Tensor]:
        """Set the stored ``z~`` and ``v`` on ``model`` and return the stored point vectors, or None when there is no
        complete store of these settings (a store of other inputs is refused first: :meth:`check_inputs`)."""
        from safetensors.torch import load_file

        self.check_inputs()
        record = self._record()
        if record is None or {k: v for k, v in record.items() if k != self.FINGERPRINT_KEY} != self.settings:
            return None
        state = load_file(self._path("label_state.safetensors"))
        model.set_label_state(state["label_text_vectors"], state["label_centroids"], normalize=False)  # stored as set
        points = torch.from_numpy(np.array(np.load(self._path("points.npy"), mmap_mode="r")))
        logger.info("%s: Module II's label state and point vectors read back, not computed again", self.directory)
        return points

    def save_label_state(self, model, points: torch.Tensor) -> None:
        """Write ``z~``, ``v`` and the point vectors, then the settings and the fingerprint (which mark the store
        complete)."""
        from safetensors.torch import save_file

        from ..models.io_utils import atomic_write

        if not self.writer:
            return
        self.clear()
        os.makedirs(self.directory, exist_ok=True)
        state = {"label_text_vectors": model.label_text_vectors.detach().cpu(), "label_centroids": model.label_centroids.detach().cpu()}
        atomic_write(self._path("label_state.safetensors"), lambda tmp: save_file(state, tmp))

        def write_points(tmp: str) -> None:
            with open(tmp, "wb") as f:  # np.save(path) would append ".npy" to the temporary name
                np.save(f, points.cpu().numpy())

        atomic_write(self._path("points.npy"), write_points)
        record = dict(self.settings)
        if self.fingerprint is not None:
            record[self.FINGERPRINT_KEY] = self.fingerprint
        self._write_json("module2.json", record)

    def open_shortlist(self, num_points: int, size: int, resume: bool = True) -> tuple[np.ndarray, int]:
        """The shortlist array to mine into and its first row still to mine: with ``resume`` (the label state came from
        this store) the stored memory map (the writer's, opened for update; a non-writer gets an in-memory copy) and
        its progress; else, or when there is none, a new ``-1``-filled one (in the store for the writer) and 0."""
        done = (self._read_json("progress.json") or {}).get("points_done", 0) if resume else 0
        path = self._path("shortlist.npy")
        if done and os.path.exists(path):
            stored = np.load(path, mmap_mode="r+" if self.writer else "r")
            if stored.shape == (num_points, size) and stored.dtype == np.int32:
                logger.info("%s: shortlists of %d / %d training points read back; mining goes on from there", self.directory, done, num_points)
                self._shortlist = stored if self.writer else np.array(stored)
                return self._shortlist, int(done)
        if not self.writer:
            self._shortlist = np.full((num_points, size), -1, dtype=np.int32)
            return self._shortlist, 0
        from ..models.io_utils import temp_path_for

        tmp = temp_path_for(path)
        array = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.int32, shape=(num_points, size))
        array[:] = -1
        array.flush()
        os.replace(tmp, path)
        self._write_json("progress.json", {"points_done": 0})
        self._shortlist = array
        return array, 0

    def mark_done(self, points_done: int) -> None:
        """Flush the mined rows to disk, then record that the first ``points_done`` rows are final."""
        if not self.writer:
            return
        if isinstance(self._shortlist, np.memmap):
            self._shortlist.flush()
        self._write_json("progress.json", {"points_done": int(points_done)})


def bag_of_embeddings_document_frequency(tokenizer, texts: Sequence[str], max_length: int, vocab_size: int, batch_size: int = 4096) -> np.ndarray:
    """How many of ``texts`` contain each token id (the texts cut to ``max_length`` tokens as the encoder sees them).
    Memory: ``8 x vocab_size`` bytes plus one batch of token ids."""
    df = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(texts), batch_size):
        encoded = tokenize_texts(tokenizer, list(texts[start : start + batch_size]), max_length)["input_ids"]
        ids = np.concatenate([np.unique(np.asarray(row, dtype=np.int64)) for row in encoded]) if encoded else np.zeros(0, np.int64)
        df += np.bincount(ids[ids < vocab_size], minlength=vocab_size)
    return df


__all__ = [
    "LabelDrawDataset",
    "ModuleIIStore",
    "SiameseLabelCollator",
    "bag_of_embeddings_document_frequency",
    "build_label_state",
    "label_correlation_matrix",
    "label_sampling_probabilities",
    "mine_classifier_shortlist",
    "mine_label_neighbors",
]
