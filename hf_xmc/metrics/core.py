"""XMC ranking metrics: P@k, nDCG@k, R@k, propensity-scored PSP@k / PSnDCG@k and helpers.

The implementation lives in ``hf_xmc/metrics/xmc_metrics/xmc_core.py`` (numpy/scipy only)
so that the ``evaluate`` module ``hf_xmc/metrics/xmc_metrics/xmc_metrics.py`` can use the
very same code: ``evaluate.load`` copies a metric script together with the sibling files it
imports relatively (``from .xmc_core import ...``) into its module cache, but nothing from
outside that directory. This module loads that file (by path, under the module name
``hf_xmc.metrics._xmc_core``) and re-exports its public API.

Loading by path rather than ``from .xmc_metrics.xmc_core import ...`` is deliberate: the
latter would bind the *directory* ``hf_xmc.metrics.xmc_metrics`` as an attribute of
``hf_xmc.metrics`` and collide with the function ``hf_xmc.metrics.xmc_metrics``.

Definitions (pyxclib ``xc_metrics`` / napkinxc conventions, averaged over all n queries,
queries with no positive label included; ``topk`` is an (n, K) array of label ids best first,
negative ids = no prediction; ``truth`` an (n, L) sparse binary matrix; ranks r are 1-based):

* ``P@k      = mean_i |top-k(i) ∩ P_i| / k``
* ``nDCG@k   = mean_i DCG_i@k / IDCG_i@k``, ``DCG = sum_r hit_ir / log2(r+1)``, IDCG summed over
  ``min(k, |P_i|)`` ranks; 0 for queries without positives.
* ``R@k      = mean_i |top-k(i) ∩ P_i| / |P_i|``; 0 for queries without positives.
* ``PSP@k    = mean_i (1/k) sum_{r<=k} hit_ir q_(l_ir)  /  mean_i (1/k) sum of the k largest q_l, l in P_i``
  with ``q`` the inverse propensity (normalised as pyxclib's ``psprecision`` and napkinxc's
  ``psprecision_at_k(normalize=True)``).
* ``PSnDCG@k = mean_i PSDCG_i@k / IDCG_i@k  /  mean_i best PSDCG_i@k / IDCG_i@k`` where the best
  PSDCG ranks the true labels by decreasing ``q``.
* ``q_l = 1 + C (N_l + B)^(-A)``, ``C = (ln N - 1)(B + 1)^A`` (Jain et al. 2016; pyxclib
  ``compute_inv_propesity``), see :data:`PROPENSITY_CONSTANTS` for the usual (A, B).

The ``*_at_k`` functions return fractions in [0, 1]; :func:`xmc_metrics` returns percentages.

Beside them, from the same top-k ids: :func:`coverage_at_k` (distinct labels hit in some top-k / distinct labels of
the ground truth, napkinXC's convention), :func:`seen_unseen_metrics` (P@k and PSP@k split between labels with and
without training points, with the unseen share of PSP@k's ideal mass) and :func:`precision_by_frequency_bucket` (P@k
per label-frequency bucket; ten buckets give the deciles the evaluator reports).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

_IMPL_NAME = "hf_xmc.metrics._xmc_core"
_IMPL_PATH = Path(__file__).resolve().parent / "xmc_metrics" / "xmc_core.py"


def _load_impl() -> ModuleType:
    """Load xmc_metrics/xmc_core.py once as hf_xmc.metrics._xmc_core."""
    module = sys.modules.get(_IMPL_NAME)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(_IMPL_NAME, _IMPL_PATH)
    if spec is None or spec.loader is None:  # pragma: no cover - broken installation
        raise ImportError(f"cannot load the XMC metric implementation from {_IMPL_PATH}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[_IMPL_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(_IMPL_NAME, None)
        raise
    return module


if TYPE_CHECKING:  # static analysers see the real definitions (and their type hints)
    from .xmc_metrics.xmc_core import (  # noqa: F401
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
else:
    _impl = _load_impl()
    globals().update({name: getattr(_impl, name) for name in _impl.__all__})

#: Directory of the ``evaluate`` metric module (pass it to ``evaluate.load``).
EVALUATE_MODULE_PATH: str = str(_IMPL_PATH.parent)

__all__: list[str] = ["EVALUATE_MODULE_PATH", *_load_impl().__all__]
