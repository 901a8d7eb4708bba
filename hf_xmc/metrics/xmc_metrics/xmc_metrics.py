# Copyright hf_xmc authors. Licensed under the Apache License, Version 2.0.
"""`evaluate` metric module for extreme multi-label classification (P@k, nDCG@k, PSP@k, PSnDCG@k, R@k).

Load with ``evaluate.load("/abs/path/to/hf_xmc/metrics/xmc_metrics")``. The formulas live in
the sibling file ``xmc_core.py`` (shared with ``hf_xmc.metrics``); ``evaluate`` copies it next
to this script because of the relative import below. Never write `import a, b`: evaluate's
import scanner reads ``import a, b`` as a single package name.
"""

from collections.abc import Sequence
from typing import Optional

import datasets
import evaluate
import numpy as np

from .xmc_core import label_lists_to_csr, pad_rankings, xmc_metrics

_CITATION = """\
@inproceedings{jain2016extreme,
  title     = {Extreme Multi-label Loss Functions for Recommendation, Tagging, Ranking and Other Missing Label Applications},
  author    = {Jain, Himanshu and Prabhu, Yashoteja and Varma, Manik},
  booktitle = {Proceedings of the 22nd ACM SIGKDD International Conference on Knowledge Discovery and Data Mining},
  pages     = {935--944},
  year      = {2016}
}
@misc{Bhatia16,
  author = {Bhatia, K. and Dahiya, K. and Jain, H. and Kar, P. and Mittal, A. and Prabhu, Y. and Varma, M.},
  title  = {The extreme classification repository: Multi-label datasets and code},
  url    = {http://manikvarma.org/downloads/XC/XMLRepository.html},
  year   = {2016}
}
"""

_DESCRIPTION = """\
Ranking metrics for extreme multi-label classification (XMC), computed from the ranked
top-k predicted label ids of each query and its set of true label ids: precision@k (P@k),
nDCG@k, recall@k (R@k) and, when per-label inverse propensities are given, the normalised
propensity-scored precision PSP@k and PSnDCG@k of Jain et al. (2016), with the exact
conventions of pyxclib / napkinxc (averaged over all queries, queries without positives
included). Scores are PERCENTAGES in [0, 100], as the XC repository reports them
(``percent=False`` gives fractions in [0, 1], as most `evaluate` metrics do). R@k is
computed at the cut-offs of ``k_list`` unless ``recall_k_list`` names others.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `list` of `int`): ranked predicted label ids per query, best
        first; rows may have different lengths; negative ids mean "no prediction".
    references (`list` of `list` of `int`): true label ids per query (may be empty).
    k_list (`Sequence[int]`, defaults to `(1, 3, 5)`): cut-offs for P@k, nDCG@k, PSP@k, PSnDCG@k
        (and R@k unless `recall_k_list` is given).
    recall_k_list (`Sequence[int]`, optional): cut-offs for R@k; defaults to `k_list`; `[]`
        for no R@k. (The training scripts report R@10 and R@100: pass `[10, 100]`.)
    inv_propensity (`list` or `np.ndarray` of `float`, optional): inverse propensity of each
        label (e.g. `hf_xmc.metrics.inverse_propensity(train_targets)`); enables PSP@k and PSnDCG@k.
    num_labels (`int`, optional): size of the label space; defaults to `len(inv_propensity)`
        if given, else 1 + the largest label id seen.
    percent (`bool`, defaults to `True`): percentages in [0, 100]; `False`: fractions in [0, 1].
Returns:
    `dict` mapping `"P@k"`, `"nDCG@k"` (and `"PSP@k"`, `"PSnDCG@k"`) for k in `k_list` and
    `"R@k"` for k in `recall_k_list` (default `k_list`) to percentages in [0, 100]
    (fractions with `percent=False`).
Examples:
    >>> xmc = evaluate.load("hf_xmc/metrics/xmc_metrics")
    >>> results = xmc.compute(predictions=[[0, 2, 1], [3, 4, 5]], references=[[0, 1], [5]], k_list=[1, 3])
    >>> sorted(results)
    ['P@1', 'P@3', 'R@1', 'R@3', 'nDCG@1', 'nDCG@3']
    >>> round(results["P@1"], 2), round(results["P@3"], 2), results["R@3"]
    (50.0, 50.0, 100.0)
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class XmcMetrics(evaluate.Metric):
    """XMC ranking metrics (P@k, nDCG@k, PSP@k, PSnDCG@k, R@k) as an `evaluate` metric."""

    def _info(self) -> evaluate.MetricInfo:
        """Describe the metric and its input features."""
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("int64")),
                    "references": datasets.Sequence(datasets.Value("int64")),
                }
            ),
            reference_urls=[
                "https://github.com/kunaldahiya/pyxclib",
                "https://github.com/mwydmuch/napkinXC",
            ],
        )

    def _compute(
        self,
        predictions: list[list[int]],
        references: list[list[int]],
        k_list: Sequence[int] = (1, 3, 5),
        recall_k_list: Optional[Sequence[int]] = None,
        inv_propensity: Optional[Sequence[float]] = None,
        num_labels: Optional[int] = None,
        percent: bool = True,
    ) -> dict:
        """Compute the XMC metrics (percentages, or fractions with ``percent=False``) with the shared hf_xmc
        formulas; R@k at ``recall_k_list``, by default the cut-offs asked for in ``k_list``."""
        if len(predictions) != len(references):
            raise ValueError(f"got {len(predictions)} prediction rows but {len(references)} reference rows")
        inv_p = None if inv_propensity is None else np.asarray(inv_propensity, dtype=np.float64)
        if num_labels is None:
            if inv_p is not None:
                num_labels = int(inv_p.shape[0])
            else:
                max_id = -1
                for row in list(predictions) + list(references):
                    if len(row):
                        max_id = max(max_id, int(np.max(row)))
                num_labels = max_id + 1
        truth = label_lists_to_csr(references, int(num_labels))
        topk = pad_rankings(predictions)
        recall_ks = tuple(k_list) if recall_k_list is None else tuple(recall_k_list)
        scores = xmc_metrics(topk, truth, inv_propensity=inv_p, ks=tuple(k_list), recall_ks=recall_ks)
        return scores if percent else {name: value / 100.0 for name, value in scores.items()}
