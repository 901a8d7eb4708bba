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
    if calibration_method != "none" and validation_evaluator is not None:
        from .calibration import fit_score_calibration

        start = time.perf_counter()
        with model.using_query_encoder("static"):  # entered again: the weights just tuned are the ones it fuses with
            fit_score_calibration(model, validation_evaluator, calibration_method)
        info["static_calibration_runtime"] = round(time.perf_counter() - start, 4)
    return info


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
    objective: str = "cosine",
) -> dict:
    """:meth:`fit_static_query_encoder` on ``train_texts``, then :func:`tune_static_query_encoder`; returns the
    ``static_*`` entries (``static_fit_runtime``, the fit's loss, the tuned weights, the runtimes). ``precision``: of
    the tower's pass that makes the fit's targets, as ``--mining_precision`` (:func:`mining_autocast_dtype`: ``"auto"``
    is bfloat16 where the hardware multiplies it natively); the fit, the tuning and every ranking stay in float32.
    ``objective``: what the fit minimises (:func:`~hf_xmc.models.static_encoder.fit_static_encoder`; the ``+labels``
    ones read ``train_targets``, the labels of ``train_texts``)."""
    if train_targets is None and validation is not None:  # before the fit, not after minutes of it
        raise ValueError("tuning the static encoder's fusion weights needs the training targets (their propensities weigh PSP@5)")
    seen = None  # said before the fit, not after minutes of it
    if validation is not None and getattr(model, "lexical_channel", None) is not None:
        seen = queries_seen_by_ranker(model, validation, "the static encoder's fusion weights are tuned on")
    start = time.perf_counter()
    dtype = mining_autocast_dtype(precision, model.device)
    model.fit_static_query_encoder(train_texts, epochs=epochs, max_queries=max_queries, seed=seed, show_progress_bar=show_progress_bar, encode_dtype=dtype,
                                   objective=objective, labels=train_targets if objective.endswith("+labels") else None)
    fit = model.static_query_encoder_meta["fit"]
    info = {"static_fit_runtime": round(time.perf_counter() - start, 4), "static_fit_queries": fit["queries"],
            "static_fit_loss": fit["epoch_losses"][-1] if fit["epoch_losses"] else None, "static_fit_encode_seconds": fit["encode_seconds"],
            "static_fit_bf16": int(dtype is torch.bfloat16)}
    if seen is not None:
        info["static_tuning_queries_seen_by_ranker"] = seen
    logger.info("static query encoder: fitted on %d training queries in %.1f s (%s loss by epoch %s)", fit["queries"],
                info["static_fit_runtime"], fit["loss"], fit["epoch_losses"])
    info.update(tune_static_query_encoder(model, validation, train_targets, validation_evaluator, calibration_method, ranker_weight, text_weight,
                                          batch_size=batch_size))
    return info
