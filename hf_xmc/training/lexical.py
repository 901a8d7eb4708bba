"""Fitting the lexical channel of a model (``hf_xmc/models/lexical_channel.py``): TF-IDF, an Omikuji ranker and the
fusion weights, tuned on held-out training queries.

    channel = fit_lexical_channel(model, data.train, data.label_texts)   # model.predict now fuses it

Steps (each logged with its seconds):

1. TF-IDF vocabulary and idf (scikit-learn ``TfidfVectorizer``: word 1-2 grams, sublinear tf, ``min_df`` 2, at most
   ``max_features`` terms) over the training queries and the label texts, so label words the queries never use
   still count for the label-text channel.
2. The ranker: Omikuji with its library defaults (Parabel-like: 3 trees of balanced 2-means splits, sparse linear
   nodes) on the TF-IDF features of the training queries but the tuning slice, ``n_threads`` threads.
3. The weights: with ``validation`` queries (a split held out of training before the model trained, see
   :mod:`hf_xmc.data.splits`), the ranker trains on every training query and the weights are tuned on the validation
   queries, which neither the dense model nor the ranker has seen; then (``refit_ranker``, or later through
   :func:`refit_lexical_ranker`, once whatever else is tuned on them is) the ranker may be trained again on the training
   and validation queries. Without them, a tuning slice (``tune_queries`` training queries, at most a
   tenth, drawn with ``seed``) is held out of the ranker only: the dense model has seen it in training, so its scores
   there are optimistic and the tuning errs towards small lexical weights (10-50x smaller for the methods with per-label
   parameters, which memorise their training queries). Either way the tuning queries are ranked once by the model's
   dense search and once by the ranker; every pair of the weight grids is scored from those candidates and the pair
   with the best ``P@1 + PSP@5`` is kept (ties: the smaller weights). A grid also holds its cap (the weight past which
   the dense score only breaks the channel's ties) and is extended past its top while the best weight sits there
   (:func:`tune_fusion_weights`), so the chosen pair is at least the dense ranking alone and the channel-dominated
   one on the tuning queries; a weight that still ends on its cap is named in ``channel.tuning["on_edge"]`` and
   logged. Weights given explicitly are not tuned.

Needs ``scikit-learn`` and ``omikuji`` (``pip install hf_xmc[lexical]``). Memory: the TF-IDF matrix of the training
queries (``12`` bytes per non-zero, ~25 per short query: 0.7 GB at 2.2M queries) while the ranker trains, plus
Omikuji's own working set (its training file is written to a temporary directory).
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
from collections.abc import Sequence
from typing import Optional

import numpy as np
import scipy.sparse as sp

from ..data import XMCDataset, filter_predictions, write_bow
from ..metrics import inverse_propensity, xmc_metrics
from ..models.lexical_channel import DEFAULT_SETTINGS, CsrRows, LexicalChannel, TfidfFeatures, _quiet_output

logger = logging.getLogger(__name__)

# the grids every fit scores (on WordNet-XMC the ranker's tuning chose the top of the grid both times it ended lower, at
# 3, then at 10); the tuning adds each grid's cap and extends a grid past its top while the best weight sits there
# (tune_fusion_weights), so these are where the search starts, not its limits
RANKER_WEIGHTS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0)
TEXT_WEIGHTS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)
# the steps a grid is extended by, per decade (0.5 -> 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, ...; 50 -> 75, 100, 150, ...)
WEIGHT_STEPS = (1.0, 1.5, 2.0, 3.0, 5.0, 7.5)
# a grid's cap: the weight at which channel scores that differ by this much are never reordered by the dense term
# (weight_cap); above it the dense score only breaks the channel's ties, so a larger weight ranks the same
TIE_RESOLUTION = 1e-3


def fit_tfidf(texts: Sequence[str], max_features: Optional[int] = 200_000, min_df: int = 2, ngram_max: int = 2) -> TfidfFeatures:
    """Fit the TF-IDF vocabulary and idf on ``texts`` (scikit-learn) as a :class:`TfidfFeatures`."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    vectorizer = TfidfVectorizer(ngram_range=(1, ngram_max), sublinear_tf=True, norm="l2", min_df=min_df, max_features=max_features, dtype=np.float32)
    try:
        vectorizer.fit(list(texts))
    except ValueError as err:  # every text is empty or all terms are pruned
        raise ValueError(f"no TF-IDF vocabulary could be built from the training and label texts ({err})") from None
    terms = np.empty(len(vectorizer.vocabulary_), dtype=object)
    for term, column in vectorizer.vocabulary_.items():
        terms[column] = term
    return TfidfFeatures(terms.tolist(), vectorizer.idf_.astype(np.float32), ngram_max=ngram_max, sublinear_tf=True)


def as_scipy(rows: CsrRows, num_features: int) -> sp.csr_matrix:
    """A :class:`CsrRows` as a scipy CSR matrix."""
    return sp.csr_matrix((rows.data, rows.indices, rows.indptr), shape=(len(rows), num_features))


def train_omikuji(features: sp.csr_matrix, targets: sp.csr_matrix, n_threads: Optional[int] = None, **hyper_params):
    """An Omikuji model (library defaults, overridden by ``hyper_params``: ``n_trees``, ``cluster_k``, ...) trained on
    TF-IDF ``features`` and binary ``targets`` (its label ids are the columns of ``targets``). Points without any
    feature are left out (Omikuji cannot read them, and they carry nothing for its linear nodes)."""
    import omikuji

    hp = omikuji.Model.default_hyper_param()
    for name, value in hyper_params.items():
        if not hasattr(hp, name):
            raise ValueError(f"omikuji has no hyper-parameter {name!r}")
        setattr(hp, name, value)
    keep = np.flatnonzero(np.diff(features.indptr) > 0)
    if keep.size == 0:
        raise ValueError("no training query has a known TF-IDF term: the ranker has nothing to learn from")
    with tempfile.TemporaryDirectory(prefix="omikuji_") as tmp:
        path = os.path.join(tmp, "train.txt")
        write_bow(path, features[keep], targets[keep])
        with _quiet_output():  # Omikuji logs on stdout and draws progress bars on stderr
            return omikuji.Model.train_on_data(path, hp, n_threads=n_threads or os.cpu_count() or 1)


def fit_lexical_channel(
    model,
    train: XMCDataset,
    label_texts: Optional[Sequence[str]] = None,
    label_uids: Optional[Sequence[str]] = None,
    ranker_weight: Optional[float] = None,
    text_weight: Optional[float] = None,
    tune_queries: int = 2000,
    seed: int = 0,
    n_threads: Optional[int] = None,
    max_features: Optional[int] = 200_000,
    batch_size: int = 128,
    validation: Optional[XMCDataset] = None,
    refit_ranker: bool = False,
    rebuild_label_index: bool = True,
    **settings,
) -> LexicalChannel:
    """Fit a lexical channel for ``model`` on its training data, tune the weights left ``None`` on ``validation``
    (or, without it, on held-out training queries: module docstring), attach it (``model.set_lexical_channel``) and
    return it. The model's label index is rebuilt with its current weights, over ``label_texts`` / ``label_uids``
    (default: the model's labels); ``rebuild_label_index=False`` keeps the index (or the stored label vectors) the
    model already has, for a loaded model whose weights have not changed since they were encoded. ``settings`` override the other fusion settings (``dense_depth``, ``ranker_depth``,
    ``beam_size``). A model that takes images (MUFIN) keeps its attached label images when ``label_texts`` are the
    ones it has, and its weights are tuned on its own ranking of the held-out items with their images."""
    if label_texts is not None and model.takes_images:  # MUFIN: the attached label images are kept for the same texts
        model.build_label_index(label_texts, label_uids, batch_size=batch_size)
        label_texts, rebuild_label_index = None, False  # encoded with the current weights just now
    elif label_texts is not None:
        model.set_labels(label_texts, label_uids)
    labels = model._require_labels()
    if train.targets.shape[1] != len(labels):
        raise ValueError(f"training targets have {train.targets.shape[1]} label columns but the model has {len(labels)} labels")
    settings = {**DEFAULT_SETTINGS, **settings}
    start = time.perf_counter()
    features = fit_tfidf(list(train.texts) + list(labels), max_features=max_features)
    query_rows = features.transform(train.texts)
    label_rows = features.transform(labels)
    logger.info("lexical channel: TF-IDF of %d terms in %.1f s", features.num_features, time.perf_counter() - start)

    tuning = ranker_weight is None or text_weight is None
    n = len(train)
    holdout = np.zeros(0, dtype=np.int64)
    if validation is not None and validation.targets.shape[1] != len(labels):
        raise ValueError(f"validation targets have {validation.targets.shape[1]} label columns but the model has {len(labels)} labels")
    if tuning and validation is None:
        size = min(int(tune_queries), n // 10)
        if size < 20:
            logger.warning("lexical channel: %d training queries are too few to tune the weights on; using the defaults", n)
            tuning = False
        else:
            logger.warning("lexical channel: no validation split, so the weights are tuned on %d training queries the model has seen", size)
            holdout = np.sort(np.random.default_rng(seed).choice(n, size=size, replace=False))
    fit_rows = np.setdiff1d(np.arange(n), holdout)

    start = time.perf_counter()
    ranker = train_omikuji(as_scipy(query_rows.select(fit_rows), features.num_features), train.targets[fit_rows], n_threads=n_threads)
    logger.info("lexical channel: Omikuji ranker on %d queries in %.1f s", len(fit_rows), time.perf_counter() - start)
    channel = LexicalChannel(features, label_rows, ranker, settings=settings)

    # the current weights' label vectors, for the tuning (an evaluation right after can reuse them)
    if rebuild_label_index or label_texts is not None:
        model.build_label_index(batch_size=batch_size)
    else:
        model.ensure_label_index()
    if tuning:
        start = time.perf_counter()
        tune_on = validation if validation is not None else train.select(holdout)
        chosen = tune_fusion_weights(
            model, channel, tune_on, train.targets,
            RANKER_WEIGHTS if ranker_weight is None else (ranker_weight,), TEXT_WEIGHTS if text_weight is None else (text_weight,),
            batch_size=batch_size,
        )
        ranker_weight, text_weight = chosen["ranker_weight"], chosen["text_weight"]
        chosen["tuned_on"] = "validation" if validation is not None else "training"
        channel.tuning = chosen  # what the weights were chosen from (not saved)
        logger.info("lexical channel: weights tuned on %d %s queries in %.1f s: %s", len(tune_on), chosen["tuned_on"], time.perf_counter() - start,
                    {k: v for k, v in chosen.items() if k not in ("grid", "ranker_weights", "text_weights")})
        for name in chosen["on_edge"]:  # the cap: the dense score only breaks the channel's ties at this weight
            logger.warning("lexical channel: the tuned %s ended on its grid's cap (%g): the dense score only breaks the channel's ties", name, chosen[name])
    if validation is not None and refit_ranker:
        refit_lexical_ranker(channel, train, validation, n_threads=n_threads)
    channel.settings.update(ranker_weight=float(ranker_weight if ranker_weight is not None else DEFAULT_SETTINGS["ranker_weight"]),
                            text_weight=float(text_weight if text_weight is not None else DEFAULT_SETTINGS["text_weight"]))
    model.set_lexical_channel(channel)
    return channel


def refit_lexical_ranker(channel: LexicalChannel, train: XMCDataset, validation: XMCDataset, n_threads: Optional[int] = None) -> None:
    """Train the channel's ranker again on the training and the validation queries, once everything tuned on the
    validation queries is (the fusion weights, the score calibration): the saved ranker has seen every query.
    Memory: the TF-IDF rows of both (12 bytes per non-zero) while Omikuji trains."""
    start = time.perf_counter()
    rows = CsrRows.concat([channel.features.transform(train.texts), channel.features.transform(validation.texts)])
    targets = sp.vstack([train.targets, validation.targets], format="csr")
    channel.set_ranker(train_omikuji(as_scipy(rows, channel.features.num_features), targets, n_threads=n_threads), refit_queries=validation.uids)
    logger.info("lexical channel: ranker trained again on the %d training and validation queries in %.1f s", len(rows), time.perf_counter() - start)


def queries_seen_by_ranker(model, queries: XMCDataset, use: str) -> int:
    """How many of ``queries`` the model's lexical ranker trained on (:meth:`LexicalChannel.queries_seen_by_ranker`:
    the validation split a training script refit it on), with a warning naming ``use`` (what the caller does with
    them) when any did: a fused ranking of those queries is not held out, and weights tuned on them favour the ranker.
    0 without a channel, or for a ranker saved before the record existed (nothing is known then)."""
    channel = getattr(model, "lexical_channel", None)
    seen = channel.queries_seen_by_ranker(queries.uids) if channel is not None else 0
    if seen:
        logger.warning("%d of the %d queries %s trained the lexical channel's ranker (the training script refit it on its validation split, "
                       "--lexical_refit_ranker): fused figures on them are not held out; use queries neither the model nor the ranker saw",
                       seen, len(queries), use)
    return seen


def next_weight(weight: float) -> float:
    """The first value of :data:`WEIGHT_STEPS` (1, 1.5, 2, 3, 5, 7.5 per decade) above ``weight`` (> 0): 0.5 -> 0.75,
    50 -> 75, 7.5 -> 10."""
    if not weight > 0:
        raise ValueError(f"a grid is extended above a positive weight, got {weight}")
    decade = 10.0 ** math.floor(math.log10(weight))
    for scale in (decade, 10 * decade):
        for step in WEIGHT_STEPS:
            value = float(f"{step * scale:.6g}")  # 0.15, not 0.15000000000000002
            if value > weight * (1 + 1e-9):
                return value
    raise AssertionError("unreachable: the next decade's first step is above any weight of this one")


def weight_cap(dense_spread: float, grid_top: float) -> float:
    """The largest weight a channel's grid is extended to: the first :func:`next_weight` step from ``grid_top`` at or
    above ``dense_spread / TIE_RESOLUTION``, never below ``grid_top``. ``dense_spread`` is the dense term's largest
    range over one query's candidates (``dense_weight x (max - min)``: at most 2 for cosine scores at ``dense_weight``
    1, so a cap of at most 2,000); past the cap the dense term reorders only the candidates whose channel scores differ
    by less than ``TIE_RESOLUTION`` (it breaks the channel's ties, nothing more), so a larger weight ranks the same.
    A spread of 0 (``dense_weight`` 0: only the ratio of the two channel weights matters) keeps ``grid_top``."""
    target = dense_spread / TIE_RESOLUTION
    cap = grid_top
    if not (np.isfinite(target) and grid_top > 0):
        return cap
    while cap < target * (1 - 1e-9):
        cap = next_weight(cap)
    return cap


def tune_fusion_weights(
    model,
    channel: LexicalChannel,
    holdout: XMCDataset,
    train_targets: sp.spmatrix,
    ranker_weights: Sequence[float] = RANKER_WEIGHTS,
    text_weights: Sequence[float] = TEXT_WEIGHTS,
    batch_size: int = 128,
    extend: bool = True,
) -> dict:
    """The ``(ranker_weight, text_weight)`` with the best ``P@1 + PSP@5`` on ``holdout`` (ties: smaller weights first).

    A grid of one value is a fixed weight and stays so. A grid of more values (the defaults: ranker 0-50, text 0-0.5)
    also gets its cap (:func:`weight_cap`, from the dense scores of these candidates) and, with ``extend``, grows
    while its best weight is the largest value below the cap: the next :func:`next_weight` step is scored against
    every value of the other grid, until the best is interior or the steps reach the cap. So the pairs scored always
    hold both ends of the fusion: weights ``(0, 0)``, the dense ranking alone (where the grids start at 0), and the
    ranker weight at its cap, where the dense score only breaks the channel's ties (the channel's own ranking of the
    candidates); the chosen pair scores at least both of them on ``holdout``, by construction. The lower edge 0 is a
    real limit (the channel off), the cap too as far as the dense score goes (past it the dense score only breaks ties,
    see :func:`weight_cap`; the ratio of the two channel weights is still spanned by the other grid, which starts at
    0); a weight chosen at its cap is named in ``"on_edge"``.

    Returns ``ranker_weight``, ``text_weight``, ``objective`` (its ``P@1 + PSP@5``), ``dense`` (the dense ranking's),
    ``grid`` (every scored pair's, keyed ``"wr,wt"``), ``ranker_weights`` / ``text_weights`` (the final grids, caps
    included) and ``on_edge`` (the names of the tuned weights that ended on their grid's top, ``[]`` when none).

    The model is searched once (its index is built if needed), the channel scored once; every pair re-weights those
    candidates. Memory: ``ranker_depth x dense_depth`` bytes per query while the candidates are matched (10 KB at the
    defaults), then ``(dense_depth + ranker_depth) x 20`` bytes per query for the candidates (ids int64, three float32
    scores) and ``x 12`` more while a pair is ranked (its fused scores and their order)."""
    inv_prop = inverse_propensity(train_targets, model.config.propensity_a, model.config.propensity_b)
    depth = int(channel.settings["dense_depth"])
    model.ensure_label_index()
    # the model's own dense ranking, as predict and the evaluator rank (MUFIN's over the held-out items' texts and images)
    images = holdout.images if model.takes_images else None
    _, _, dense_scores, dense_ids = model.rank(holdout.texts, depth, batch_size=batch_size, show_progress_bar=False, return_dense=True, images=images)
    use_ranker, use_text = any(ranker_weights), any(text_weights)
    candidates = channel.candidates(holdout.texts, dense_scores, dense_ids, float(use_ranker), float(use_text))

    # the holdout's filter pairs (--train_filter_file: a query that is its own label) are not scored, as at test time
    filt = holdout.filter_matrix
    extra = int(np.diff(filt.indptr).max()) if filt is not None and filt.nnz else 0

    def objective(ids: np.ndarray, scores: np.ndarray) -> float:
        if extra:
            ids, _ = filter_predictions(ids, scores, filt, 5)
        m = xmc_metrics(ids[:, :5], holdout.targets, inv_prop, ks=(1, 5), recall_ks=())
        return m["P@1"] + m["PSP@5"]

    dense_weight = float(channel.settings["dense_weight"])  # the weights are tuned beside the dense weight fuse serves
    valid = candidates.ids >= 0
    rows = valid.any(1)
    spread = 0.0
    if rows.any():  # the dense term's largest range over one query's candidates (a ranker-only one has the floor)
        high = np.where(valid, candidates.dense, -np.inf).max(1)[rows]
        low = np.where(valid, candidates.dense, np.inf).min(1)[rows]
        spread = abs(dense_weight) * float((high - low).max())
    grids = {"ranker_weight": sorted({float(w) for w in ranker_weights}), "text_weight": sorted({float(w) for w in text_weights})}
    caps = {}
    for name, values in grids.items():
        if len(values) > 1 and values[-1] > 0:  # tuned, not fixed: its cap is scored too
            caps[name] = weight_cap(spread, values[-1])
            if caps[name] > values[-1]:
                values.append(caps[name])

    scored: dict[tuple[float, float], float] = {}

    def score_all() -> tuple[float, float, float]:
        """Score the pairs not scored yet; the best pair (ties: the smaller weights, ranker first) and its score."""
        best = None
        for wr in grids["ranker_weight"]:
            for wt in grids["text_weight"]:
                if (wr, wt) not in scored:
                    scores, ids = candidates.top_k(wr, wt, 5 + extra, dense_weight=dense_weight)
                    scored[wr, wt] = objective(ids, scores)
                if best is None or scored[wr, wt] > best[0] + 1e-9:
                    best = (scored[wr, wt], wr, wt)
        return best

    best = score_all()
    while extend:
        grew = False
        for name, cap in caps.items():
            values, chosen = grids[name], best[1 if name == "ranker_weight" else 2]
            below = max(w for w in values if w < cap) if values[0] < cap else 0.0
            if chosen >= below > 0 and next_weight(below) < cap:  # best on the top step (or the cap, above a gap)
                values.insert(values.index(below) + 1, next_weight(below))
                grew = True
        if not grew:
            break
        best = score_all()
    on_edge = [name for name in caps if best[1 if name == "ranker_weight" else 2] == grids[name][-1]]
    return {"ranker_weight": best[1], "text_weight": best[2], "objective": round(best[0], 3),
            "dense": round(objective(dense_ids, dense_scores), 3), "on_edge": on_edge,
            "ranker_weights": grids["ranker_weight"], "text_weights": grids["text_weight"],
            "grid": {f"{wr:g},{wt:g}": round(value, 3) for (wr, wt), value in sorted(scored.items())}}
