"""Fit and tune a model's static query encoder (``hf_xmc.models.static_encoder``) after training: what
``--static_query_encoder`` of every training script and ``hf-xmc fit-static`` run.

Order: fit the table to the trained tower's vectors of the training queries, then, with the static encoder ranking,
tune its own lexical fusion weights and fit its own score calibration on the validation split (the same grid, the
same objective P@1 + PSP@5 and the same calibration method as the tower's), and report its validation metrics. The
tower's weights, calibration and metrics are not touched.

Memory: the fit's (module docstring of ``hf_xmc.models.static_encoder``); the tuning's as
:func:`hf_xmc.training.lexical.tune_fusion_weights` and the calibration's as the tower's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Optional

import scipy.sparse as sp
import torch

from ..data import XMCDataset
from ..models.static_encoder import AUTO_FIT_OBJECTIVES, FIT_OBJECTIVE_CHOICES, prepare_static_fit
from .lexical import RANKER_WEIGHTS, TEXT_WEIGHTS, queries_seen_by_ranker, tune_fusion_weights
from .negatives import mining_autocast_dtype

logger = logging.getLogger(__name__)


def tune_static_query_encoder(
    model,
    validation: Optional[XMCDataset],
    train_targets: sp.spmatrix,
    validation_evaluator=None,
    calibration_method: str = "none",
    ranker_weight: Optional[float] = None,
    text_weight: Optional[float] = None,
    batch_size: int = 128,
) -> dict:
    """With the model's static encoder ranking: tune the model's own ranking settings (``tunable_ranking_settings``:
    SiameseXML's classifier share) on ``validation_evaluator``'s queries, then the lexical channel's weights left ``None`` on ``validation``
    (the model has a channel and a validation split; else the tower's weights stay), then fit the score calibration
    ``calibration_method`` (``isotonic`` / ``platt``; ``none``: none) on ``validation_evaluator``'s ranking. Returns
    ``static_*`` entries for ``eval_results.json``: the tuned weights, whether each ended on its grid's cap, the
    runtimes."""
    info: dict = {}
    names = list(model.tunable_ranking_settings)
    if names and validation_evaluator is not None:  # its own ranking settings first, as the tower's: the channel fuses on top
        from .evaluation import tune_ranking_settings

        start = time.perf_counter()
        with model.using_query_encoder("static"):  # the tuning writes the config; the block gives the tower its values back
            chosen = tune_ranking_settings(model, validation_evaluator, names)
        model.set_static_ranking_settings(chosen)
        info.update({f"static_tuned_{name}": value for name, value in chosen.items()}, static_ranking_tuning_runtime=round(time.perf_counter() - start, 4))
    with model.using_query_encoder("static"):
        channel = model.current_lexical_channel()
        if channel is not None and validation is not None and (ranker_weight is None or text_weight is None):
            start = time.perf_counter()
            chosen = tune_fusion_weights(model, channel, validation, train_targets,
                                         RANKER_WEIGHTS if ranker_weight is None else (ranker_weight,),
                                         TEXT_WEIGHTS if text_weight is None else (text_weight,), batch_size=batch_size)
            model.set_static_fusion_weights(chosen)
            info.update(static_lexical_ranker_weight=chosen["ranker_weight"], static_lexical_text_weight=chosen["text_weight"],
                        static_lexical_ranker_weight_on_edge=int("ranker_weight" in chosen["on_edge"]),
                        static_lexical_text_weight_on_edge=int("text_weight" in chosen["on_edge"]),
                        static_lexical_tuning_runtime=round(time.perf_counter() - start, 4))
            logger.info("static query encoder: fusion weights tuned on %d validation queries: ranker %g, label text %g", len(validation),
                        chosen["ranker_weight"], chosen["text_weight"])
    info.update(calibrate_static_query_encoder(model, validation_evaluator, calibration_method))
    return info


def calibrate_static_query_encoder(model, validation_evaluator, calibration_method: str) -> dict:
    """Fit the static encoder's own score calibration ``calibration_method`` (``isotonic`` / ``platt``; ``none``:
    none) on ``validation_evaluator``'s ranking with it (its fusion weights as tuned); returns its runtime entry."""
    if calibration_method == "none" or validation_evaluator is None:
        return {}
    from .calibration import fit_score_calibration

    start = time.perf_counter()
    with model.using_query_encoder("static"):  # entered again: the weights just tuned are the ones it fuses with
        fit_score_calibration(model, validation_evaluator, calibration_method)
    return {"static_calibration_runtime": round(time.perf_counter() - start, 4)}


def validation_metrics(model, evaluator, query_encoder: str = "static") -> dict:
    """:func:`~hf_xmc.training.evaluation.validation_objective` of ``model`` ranking with ``query_encoder``, rounded to
    4 decimals as the static encoder's meta records it."""
    from .evaluation import validation_objective

    with model.using_query_encoder(query_encoder):
        measured = validation_objective(model, evaluator)
    return {key: round(value, 4) for key, value in measured.items()}


def fit_and_tune_static_query_encoder(
    model,
    train_texts: Sequence[str],
    validation: Optional[XMCDataset] = None,
    train_targets: Optional[sp.spmatrix] = None,
    validation_evaluator=None,
    calibration_method: str = "none",
    epochs: int = 8,
    max_queries: Optional[int] = None,
    seed: int = 0,
    ranker_weight: Optional[float] = None,
    text_weight: Optional[float] = None,
    batch_size: int = 128,
    show_progress_bar: Optional[bool] = None,
    precision: str = "auto",
    objective: str = "auto",
) -> dict:
    """:meth:`fit_static_query_encoder` on ``train_texts``, then :func:`tune_static_query_encoder`; returns the
    ``static_*`` entries (``static_fit_runtime``: the tower's pass and every fit; the objective kept and its loss, the
    tuned weights, the runtimes).
    ``precision``: of the tower's pass that makes the fit's targets, as ``--mining_precision``
    (:func:`mining_autocast_dtype`: ``"auto"`` is bfloat16 where the hardware multiplies it natively); the fit, the
    tuning and every ranking stay in float32. ``objective``: what the fit minimises
    (:func:`~hf_xmc.models.static_encoder.fit_static_encoder`; the ``+labels`` ones read ``train_targets``, the labels
    of ``train_texts``), or ``"auto"``: each of ``AUTO_FIT_OBJECTIVES`` fitted from one pass of the tower and tuned
    (its ranking settings and fusion weights), the best ``P@1 + PSP@5`` on ``validation_evaluator``'s queries kept (a
    tie keeps the first, the cosine fit), then calibrated; ``static_fit_objective`` says which, the meta's
    ``fit.objective_choice`` each one's score. Without a validation evaluator or training targets ``"auto"`` is the
    cosine fit. Memory: one tower pass (:class:`StaticFitData`) and, while the second fits, the first table (``vocab x
    dim x 4`` bytes)."""
    if objective not in FIT_OBJECTIVE_CHOICES:
        raise ValueError(f"objective must be one of {FIT_OBJECTIVE_CHOICES}, got {objective!r}")
    if train_targets is None and validation is not None:  # before the fit, not after minutes of it
        raise ValueError("tuning the static encoder's fusion weights needs the training targets (their propensities weigh PSP@5)")
    seen = None  # said before the fit, not after minutes of it
    if validation is not None and getattr(model, "lexical_channel", None) is not None:
        seen = queries_seen_by_ranker(model, validation, "the static encoder's fusion weights are tuned on")
    if objective != "auto":
        candidates = (objective,)
    elif validation_evaluator is not None and train_targets is not None:
        candidates = AUTO_FIT_OBJECTIVES
    else:
        candidates = ("cosine",)
        logger.info("static query encoder: objective auto without a validation split and training labels to choose on: the cosine fit")
    start = time.perf_counter()
    dtype = mining_autocast_dtype(precision, model.device)
    uses_labels = any(name.endswith("+labels") for name in candidates)
    data = prepare_static_fit(model, train_texts, train_targets if uses_labels else None, max_queries, seed, show_progress_bar, dtype)
    fit_seconds = time.perf_counter() - start  # the tower's pass and the fits, not the tunings between them
    fitted = {}  # objective -> (encoder, meta, what its tuning reported, its validation score)
    for name in candidates:
        fit_start = time.perf_counter()
        model.fit_static_query_encoder(data, epochs=epochs, seed=seed, show_progress_bar=show_progress_bar, objective=name)
        fit_seconds += time.perf_counter() - fit_start
        fit = model.static_query_encoder_meta["fit"]
        logger.info("static query encoder: %s fitted on %d training queries in %.1f s (loss by epoch %s)", name, fit["queries"],
                    time.perf_counter() - fit_start, fit["epoch_losses"])
        tuned = tune_static_query_encoder(model, validation, train_targets, validation_evaluator, "none", ranker_weight, text_weight,
                                          batch_size=batch_size)
        measured = validation_metrics(model, validation_evaluator) if len(candidates) > 1 else None
        fitted[name] = (model.static_query_encoder, model.static_query_encoder_meta, tuned, measured)
    chosen = candidates[0] if len(candidates) == 1 else max(candidates, key=lambda name: (fitted[name][3]["objective"], -candidates.index(name)))
    encoder, meta, tuned, _ = fitted[chosen]
    if len(candidates) > 1:
        scores = {name: fitted[name][3]["objective"] for name in candidates}
        meta["fit"]["objective_choice"] = {"metric": "validation P@1 + PSP@5", "scores": scores,
                                           "validation": {name: {k: fitted[name][3][k] for k in ("P@1", "PSP@5")} for name in candidates}}
        model.attach_static_query_encoder(encoder, meta)
        logger.info("static query encoder: objective %s kept (validation P@1 + PSP@5 %s)", chosen, scores)
    fit = meta["fit"]
    info = {"static_fit_runtime": round(fit_seconds, 4), "static_fit_objective": chosen, "static_fit_queries": fit["queries"],
            "static_fit_loss": fit["epoch_losses"][-1] if fit["epoch_losses"] else None, "static_fit_encode_seconds": round(data.encode_seconds, 2),
            "static_fit_bf16": int(dtype is torch.bfloat16), **tuned}
    if len(candidates) > 1:
        info.update({f"static_fit_score_{name}": score for name, score in meta["fit"]["objective_choice"]["scores"].items()})
    if seen is not None:
        info["static_tuning_queries_seen_by_ranker"] = seen
    info.update(calibrate_static_query_encoder(model, validation_evaluator, calibration_method))
    return info
