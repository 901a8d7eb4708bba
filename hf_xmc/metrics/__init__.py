"""Extreme multi-label classification metrics (P@k, nDCG@k, R@k, PSP@k, PSnDCG@k); see :mod:`hf_xmc.metrics.core`."""

from .core import (
    EVALUATE_MODULE_PATH,
    PROPENSITY_CONSTANTS,
    coverage_at_k,
    inverse_propensity,
    label_lists_to_csr,
    ndcg_at_k,
    pad_rankings,
    precision_at_k,
    precision_by_frequency_bucket,
    propensity_constants,
    psndcg_at_k,
    psprecision_at_k,
    recall_at_k,
    seen_unseen_metrics,
    xmc_metrics,
)

__all__ = [
    "EVALUATE_MODULE_PATH",
    "PROPENSITY_CONSTANTS",
    "coverage_at_k",
    "inverse_propensity",
    "label_lists_to_csr",
    "ndcg_at_k",
    "pad_rankings",
    "precision_at_k",
    "precision_by_frequency_bucket",
    "propensity_constants",
    "psndcg_at_k",
    "psprecision_at_k",
    "recall_at_k",
    "seen_unseen_metrics",
    "xmc_metrics",
]
