"""XMC evaluation through the label index: encode labels, search the test queries, score the top-k."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Optional

import numpy as np
import scipy.sparse as sp
from tqdm.auto import tqdm

from ..data import XMCDataset, filter_predictions
from ..data.filters import filter_overlap_pairs
from ..metrics import coverage_at_k, inverse_propensity, precision_by_frequency_bucket, seen_unseen_metrics, xmc_metrics
from ..models.io_utils import progress_bar_disabled

logger = logging.getLogger(__name__)

#: label-frequency buckets of ``<name>_P@k_decile<d>`` (``precision_by_frequency_bucket``: equal shares of the train positives)
TAIL_BUCKETS = 10


def tail_metrics(ids: np.ndarray, truth: sp.spmatrix, train_label_counts: Optional[np.ndarray], inv_propensity: Optional[np.ndarray],
                 k: int, ranking_only: bool = False) -> dict[str, float]:
    """What XMC papers report beside P@k, for the ranking ``ids`` (n, >= k) of queries with targets ``truth``: percentages
    (one count) keyed without the ``<name>_`` prefix. Scalars only, so that the Trainer's log, ``eval_results.json``
    and the benchmark rows carry them as they carry P@k.

    * ``coverage@k``: the distinct labels hit in some query's top k over the distinct labels with a positive
      (:func:`hf_xmc.metrics.coverage_at_k`, napkinXC's convention).

    With train targets (:func:`hf_xmc.metrics.seen_unseen_metrics`; *unseen*: no point of the training file has the
    label, the validation split's included):

    * ``seen_P@k`` / ``unseen_P@k``: hits on seen / unseen labels over ``n k``; they add up to P@k;
    * ``seen_PSP@k`` / ``unseen_PSP@k``: the propensity gains of hits on seen / unseen labels over the part of
      PSP@k's ideal mass on seen / unseen labels; ``unseen_PSP@k_mass``: that part's share of the ideal mass ``m``,
      so that ``PSP@k = m unseen_PSP@k + (1 - m) seen_PSP@k``;
    * ``unseen_labels`` (a count: distinct unseen labels with a positive here) and ``unseen_positive_share`` (the
      share of the positives on them);
    * ``P@k_decile1`` .. ``P@k_decile10``: P@k's contribution of each tenth of the labels by train frequency, head
      first, cut at equal shares of the train positives (:func:`hf_xmc.metrics.precision_by_frequency_bucket`; the
      unseen labels are in the last); they add up to P@k.

    ``ranking_only`` leaves out what depends on the data alone (``unseen_labels``, ``unseen_positive_share``,
    ``unseen_PSP@k_mass``): a second ranking of the same queries (the dense one) needs them once."""
    out: dict[str, float] = {f"coverage@{k}": 100.0 * coverage_at_k(ids, truth, k)}
    if train_label_counts is None:
        return out
    data_only = ("unseen_labels", "unseen_positive_share", f"unseen_PSP@{k}_mass")
    for key, value in seen_unseen_metrics(ids, truth, train_label_counts, inv_propensity, k).items():
        if not (ranking_only and key in data_only):
            out[key] = int(value) if key == "unseen_labels" else 100.0 * value
    buckets = precision_by_frequency_bucket(ids, truth, train_label_counts, k=k, num_buckets=TAIL_BUCKETS)
    out.update({f"P@{k}_decile{b['bucket'] + 1}": 100.0 * b["precision_contribution"] for b in buckets})
    return out


class XMCEvaluator:
    """Computes P@k, nDCG@k, PSP@k, PSnDCG@k and R@k of a model on a labelled query set.

    The model's labels are (re-)encoded with its current weights, indexed, and every query is searched for its
    top ``max(recall_ks)`` labels; filter-file pairs are removed before scoring, as the Extreme Classification
    Repository's published numbers do. Metrics are percentages, keyed ``<name>_P@1`` etc.

    Args:
        data: the evaluation queries and their targets.
        label_texts / label_uids: the label space (label-id order).
        train_targets: training label matrix, for the inverse propensities of PSP@k (omit to skip PS metrics).
        propensity_a / propensity_b: constants of the propensity model (pyxclib defaults 0.55 / 1.5).
        filter_matrix: optional CSR ``(num_queries, num_labels)`` of pairs removed from the predictions.
        ks / recall_ks: cut-offs for precision-type metrics and for recall.
        name: key prefix (``"test"`` gives ``test_P@1``) and the split named in model cards.
        batch_size: encoding batch size.
        dataset_name: the dataset's name, for model cards (e.g. ``"LF-AmazonTitles-131K"``).
        dataset_id: its Hub dataset id when the data came from the Hub (the card's ``datasets:`` field).
        label_images: per label a list of images, for models that take images (MUFIN); the queries' images come
            from ``data.images``. Such models are evaluated through their own ``predict`` (shortlist + re-ranking).
        chunk_size: queries encoded and searched at a time (text models), which bounds the query-side memory.
        tail_metrics: also report, at ``k = max(ks)``, what XMC papers show beside P@k (:meth:`tail_metrics`):
            ``<name>_coverage@k``, the seen / unseen split of P@k and PSP@k and P@k per train-frequency decile (the
            last two need ``train_targets``), and for a model with a lexical channel its dense ranking's too.
        latency_queries: ``n > 0`` also reports ``<name>_latency_bs1_p50_ms``, the median wall milliseconds of
            ``model.rank`` on one query at a time over ``n`` queries (:meth:`latency_bs1_ms`); 0 (default): not measured.
        unlabeled_counted: the convention for queries without a label, recorded as ``<name>_unlabeled_points`` (how
            many the file had) and ``<name>_unlabeled_counted``: True when they are rows of ``data`` (scored 0, as
            pyxclib averages), False when the reader skipped them (``data.num_skipped``); None records nothing.

    With ``filter_matrix``, ``<name>_filter_overlap_pairs`` counts the filtered pairs that are also positives: no
    ranking can hit them (a warning is logged when there are any).
    """

    def __init__(
        self,
        data: XMCDataset,
        label_texts: Sequence[str],
        label_uids: Optional[Sequence[str]] = None,
        train_targets: Optional[sp.spmatrix] = None,
        propensity_a: float = 0.55,
        propensity_b: float = 1.5,
        filter_matrix: Optional[sp.spmatrix] = None,
        ks: Sequence[int] = (1, 3, 5),
        recall_ks: Sequence[int] = (10, 100),
        name: str = "test",
        batch_size: int = 256,
        dataset_name: Optional[str] = None,
        dataset_id: Optional[str] = None,
        label_images: Optional[Sequence[Sequence]] = None,
        chunk_size: int = 65536,
        tail_metrics: bool = True,
        latency_queries: int = 0,
        unlabeled_counted: Optional[bool] = None,
    ):
        if data.targets.shape[1] != len(label_texts):
            raise ValueError(f"evaluation targets have {data.targets.shape[1]} label columns but there are {len(label_texts)} labels")
        self.data = data
        self.label_texts = list(label_texts)
        self.label_uids = list(label_uids) if label_uids is not None else None
        self.inv_propensity = inverse_propensity(train_targets, propensity_a, propensity_b) if train_targets is not None else None
        self.train_label_counts = np.asarray(train_targets.sum(axis=0)).ravel() if train_targets is not None else None
        self.propensity_a, self.propensity_b = propensity_a, propensity_b
        self.filter_matrix = sp.csr_matrix(filter_matrix) if filter_matrix is not None else None
        self.filter_overlap = filter_overlap_pairs(self.filter_matrix, data.targets) if self.filter_matrix is not None else 0
        if self.filter_overlap:
            logger.warning("%s: %d filtered (query, label) pairs are also positives: removed from every ranking, they can never be hit",
                           name, self.filter_overlap)
        kept_empty = int(np.count_nonzero(np.diff(data.targets.indptr) == 0))
        if unlabeled_counted is not None and (kept_empty if not unlabeled_counted else data.num_skipped):
            raise ValueError(f"{name}: unlabeled_counted={unlabeled_counted}, but the queries hold {kept_empty} without a label and "
                             f"{data.num_skipped} were skipped by the reader")
        self.unlabeled_counted = unlabeled_counted
        self.unlabeled_points = kept_empty + data.num_skipped  # of the file: kept as rows, or skipped
        self.ks = tuple(ks)
        self.recall_ks = tuple(recall_ks)
        self.name = name
        self.batch_size = batch_size
        self.dataset_name = dataset_name
        self.dataset_id = dataset_id
        if label_images is not None and len(label_images) != len(self.label_texts):
            raise ValueError(f"{len(label_images)} label image lists for {len(self.label_texts)} labels")
        self.label_images = label_images
        self.chunk_size = int(chunk_size)
        self.tail_metrics_enabled = bool(tail_metrics)
        if isinstance(latency_queries, bool) or int(latency_queries) < 0:
            raise ValueError(f"latency_queries is a number of queries >= 0, got {latency_queries!r}")
        self.latency_queries = int(latency_queries)
        # top-max(ks) label ids of the last evaluation (the model card's curves are computed from them)
        self.last_predictions: Optional[np.ndarray] = None
        # a model with a lexical channel: the top-k of its dense search alone (reported as <name>_dense_<metric>)
        self.dense_predictions: Optional[np.ndarray] = None
        # a calibrated model: the reliability diagram's rows of the last evaluation (hf_xmc.training.calibration)
        self.last_reliability: Optional[list[dict]] = None
        self.last_ranking: Optional[tuple[np.ndarray, np.ndarray]] = None  # (ids, scores) behind last_reliability

    def for_queries(self, data: XMCDataset, name: str) -> XMCEvaluator:
        """An evaluator of other queries (a validation split) over the same labels, propensities, cut-offs, batch size
        and label images, named ``name`` (its keys' prefix); the pairs of ``data.filter_matrix`` (``--train_filter_file``
        for queries carved out of the training points) are removed before scoring."""
        other = XMCEvaluator(data, self.label_texts, self.label_uids, ks=self.ks, recall_ks=self.recall_ks, name=name, batch_size=self.batch_size,
                             filter_matrix=data.filter_matrix,
                             dataset_name=self.dataset_name, dataset_id=self.dataset_id, label_images=self.label_images, chunk_size=self.chunk_size,
                             propensity_a=self.propensity_a, propensity_b=self.propensity_b, tail_metrics=self.tail_metrics_enabled)
        other.inv_propensity, other.train_label_counts = self.inv_propensity, self.train_label_counts
        return other

    @property
    def top_k(self) -> int:
        """Depth of the retrieved ranking."""
        return max(self.ks + self.recall_ks)

    def predict(self, model, show_progress_bar: Optional[bool] = None) -> tuple[np.ndarray, np.ndarray, float]:
        """Index the labels with ``model`` (their images too, for a model that takes them; not again when its index is
        current: built over these labels with its present weights) and return ``(ids, scores, query_seconds)`` for the
        evaluation queries, ranked by ``model.rank``: the one ranking ``predict`` uses."""
        k = self.top_k
        extra = int(np.diff(self.filter_matrix.indptr).max()) if self.filter_matrix is not None and self.filter_matrix.nnz else 0
        if not model.label_index_is_current(self.label_texts):
            label_images = {"label_images": self.label_images} if model.takes_images else {}
            model.build_label_index(self.label_texts, self.label_uids, batch_size=self.batch_size, show_progress_bar=show_progress_bar, **label_images)
        start = time.perf_counter()
        scores, ids = self._rank(model, k, extra, show_progress_bar)
        return ids, scores, time.perf_counter() - start

    def _rank(self, model, k: int, extra: int, show_progress_bar: Optional[bool]) -> tuple[np.ndarray, np.ndarray]:
        """Rank and filter the queries ``chunk_size`` at a time: memory is the ``(n, k)`` result (12 bytes per query and
        rank) plus one chunk of query vectors and hits, however many queries there are. A model that takes images gets
        them, and an item with neither a text nor an image (a single-modality ablation) no prediction (``-1``: a miss);
        a model with a lexical channel also gives its dense ranking alone (``dense_predictions``)."""
        texts, n = self.data.texts, len(self.data.texts)
        images = self.data.images if model.takes_images else None
        described = np.flatnonzero(self.data.has_descriptor()) if model.takes_images else np.arange(n)
        ids = np.full((n, k), -1, dtype=np.int64)
        scores = np.full((n, k), -np.inf, dtype=np.float32)
        fused = model.lexical_channel is not None
        show = n > self.chunk_size if show_progress_bar is None else show_progress_bar
        chunks = range(0, len(described), self.chunk_size)
        for start in tqdm(chunks, desc="Searching", disable=not show or len(chunks) < 2 or progress_bar_disabled(), unit="chunk"):
            rows = described[start : start + self.chunk_size]
            ranked = model.rank(
                [texts[i] for i in rows], k + extra, batch_size=self.batch_size, show_progress_bar=show_progress_bar if len(chunks) < 2 else False,
                return_dense=fused, images=[images[i] for i in rows] if images is not None else None,
            )
            chunk_scores, chunk_ids = ranked[0], ranked[1]
            if fused:  # the dense ranking alone is scored too (the channel's gain on the same model)
                dense_scores, dense_ids = ranked[2], ranked[3]
                if self.filter_matrix is not None:
                    dense_ids, dense_scores = filter_predictions(dense_ids, dense_scores, self.filter_matrix[rows], k)
                if self.dense_predictions is None:
                    self.dense_predictions = np.full((n, k), -1, dtype=np.int64)
                self.dense_predictions[rows] = dense_ids[:, :k]
            if self.filter_matrix is not None:
                chunk_ids, chunk_scores = filter_predictions(chunk_ids, chunk_scores, self.filter_matrix[rows], k)
            width = min(k, chunk_ids.shape[1])
            ids[rows, :width], scores[rows, :width] = chunk_ids[:, :width], chunk_scores[:, :width]
        return scores, ids

    def tail_metrics(self, ids: np.ndarray, ranking_only: bool = False) -> dict[str, float]:
        """:func:`tail_metrics` of the ranking ``ids`` of these queries at ``k = max(ks)`` (with this evaluator's train
        counts and propensities)."""
        return tail_metrics(ids, self.data.targets, self.train_label_counts, self.inv_propensity, max(self.ks), ranking_only)

    def latency_bs1_ms(self, model, num_queries: Optional[int] = None) -> float:
        """The median wall milliseconds of ``model.rank`` on one query (batch size 1, its top ``max(ks)``) over
        ``num_queries`` (default ``latency_queries``) queries spread evenly over these, after 3 untimed calls: what one
        served request waits, beside ``samples_per_second``'s batched throughput. The label index is built first when
        it is not current (not timed); the filter pairs are not removed (a step of the benchmark, not of the model)."""
        count = self.latency_queries if num_queries is None else int(num_queries)
        images = self.data.images if model.takes_images else None
        described = np.flatnonzero(self.data.has_descriptor()) if model.takes_images else np.arange(len(self.data))
        if count < 1 or described.size == 0:
            raise ValueError(f"latency at batch size 1 needs at least one query: {count} asked, {described.size} to rank")
        if not model.label_index_is_current(self.label_texts):
            label_images = {"label_images": self.label_images} if model.takes_images else {}
            model.build_label_index(self.label_texts, self.label_uids, batch_size=self.batch_size, show_progress_bar=False, **label_images)
        rows = described[np.unique(np.linspace(0, described.size - 1, num=min(count, described.size)).round().astype(np.int64))]
        k = max(self.ks)

        def rank_one(i: int) -> None:
            model.rank([self.data.texts[i]], k, batch_size=1, show_progress_bar=False, images=[images[i]] if images is not None else None)

        for i in rows[:3]:  # warm-up: lazy initialisation, caches, the allocator
            rank_one(int(i))
        seconds = np.empty(rows.size)
        for j, i in enumerate(rows):
            start = time.perf_counter()
            rank_one(int(i))
            seconds[j] = time.perf_counter() - start
        return float(np.median(seconds) * 1000.0)

    def __call__(self, model, show_progress_bar: Optional[bool] = None) -> dict[str, float]:
        """Evaluate ``model``; returns ``{<name>_<metric>: value}`` plus runtime and queries per second (and, for a model
        with a lexical channel, its dense ranking alone as ``<name>_dense_<metric>``), the :meth:`tail_metrics` unless
        ``tail_metrics=False``, and with ``latency_queries`` the batch-size-1 latency ``<name>_latency_bs1_p50_ms``."""
        start = time.perf_counter()
        self.dense_predictions = None
        ids, scores, query_seconds = self.predict(model, show_progress_bar)
        metrics = xmc_metrics(ids, self.data.targets, self.inv_propensity, ks=self.ks, recall_ks=self.recall_ks)
        self.last_predictions = np.ascontiguousarray(ids[:, : max(self.ks)])
        out = {f"{self.name}_{key}": float(value) for key, value in metrics.items()}
        if model.score_calibration is not None:  # how well its probabilities match these queries
            from .calibration import calibration_metrics

            calibration = calibration_metrics(model, ids, scores, self.data.targets)
            out[f"{self.name}_ECE"] = float(calibration["ECE"])
            self.last_reliability = calibration["reliability"]
            self.last_ranking = (ids, scores)
        if self.dense_predictions is not None:
            dense = xmc_metrics(self.dense_predictions, self.data.targets, self.inv_propensity, ks=self.ks, recall_ks=self.recall_ks)
            out.update({f"{self.name}_dense_{key}": float(value) for key, value in dense.items()})
        if self.tail_metrics_enabled:
            out.update({f"{self.name}_{key}": value for key, value in self.tail_metrics(ids).items()})
            if self.dense_predictions is not None:  # the data's own counts (unseen labels, their mass) are not repeated
                dense = self.tail_metrics(self.dense_predictions, ranking_only=True)
                out.update({f"{self.name}_dense_{key}": value for key, value in dense.items()})
        if self.latency_queries:
            out[f"{self.name}_latency_bs1_p50_ms"] = round(self.latency_bs1_ms(model), 3)
        if self.filter_matrix is not None:
            out[f"{self.name}_filter_overlap_pairs"] = self.filter_overlap
        if self.unlabeled_counted is not None:
            out[f"{self.name}_unlabeled_points"], out[f"{self.name}_unlabeled_counted"] = self.unlabeled_points, self.unlabeled_counted
        out[f"{self.name}_runtime"] = round(time.perf_counter() - start, 4)
        out[f"{self.name}_samples_per_second"] = round(len(self.data) / max(query_seconds, 1e-9), 3)
        return out


def validation_objective(model, evaluator: XMCEvaluator) -> dict[str, float]:
    """``P@1``, ``PSP@5`` and their sum ``objective`` of ``model``'s ranking (``predict``'s: fused with its channel,
    filtered as the evaluator filters) of ``evaluator``'s queries: what every choice on a validation split reads."""
    ids, _, _ = evaluator.predict(model, show_progress_bar=False)
    m = xmc_metrics(ids, evaluator.data.targets, evaluator.inv_propensity, ks=(1, 5), recall_ks=())
    return {"P@1": m["P@1"], "PSP@5": m["PSP@5"], "objective": m["P@1"] + m["PSP@5"]}


def tune_ranking_settings(model, evaluator: XMCEvaluator, names: Optional[Sequence[str]] = None) -> dict[str, float]:
    """Set each of the model's ``tunable_ranking_settings`` (config fields of its own ranking, e.g. SiameseXML's fusion
    weight) to the value with the best ``P@1 + PSP@5`` on ``evaluator``'s queries (a validation split), one field after
    the other (``names``: only these); a tie keeps the value the model had, then the smaller. Returns ``{field: chosen
    value}``; nothing when the model has no such field. Cost: one ranking of the validation queries per value tried (the label index is
    current throughout: the settings do not change the label vectors)."""
    chosen: dict[str, float] = {}
    for name, values in model.tunable_ranking_settings.items():
        if names is not None and name not in names:
            continue
        current = getattr(model.config, name)
        scores = {}
        for value in dict.fromkeys([current, *values]):
            setattr(model.config, name, value)
            scores[value] = validation_objective(model, evaluator)["objective"]
        best = max(scores.values())
        value = current if scores[current] >= best - 1e-9 else min(v for v, score in scores.items() if score >= best - 1e-9)
        setattr(model.config, name, value)
        chosen[name] = value
        logger.info("%s tuned on %d %s queries: %g (P@1 + PSP@5 %s)", name, len(evaluator.data), evaluator.name, value,
                    {f"{v:g}": round(score, 2) for v, score in scores.items()})
    return chosen

