"""Multi-label losses over a label pool, shared by the hf_xmc models.

Every loss takes ``logits`` of shape ``(batch, pool)`` -- query/label scores already divided by the
temperature -- and a boolean ``targets`` matrix of the same shape marking which pool labels are true
positives of each query. Masking with ``targets`` (rather than assuming one positive per row) is what keeps
in-batch false negatives out of the denominators.

Normalisation follows the DEXML reference code: the loss of a query is the mean over its positives in the
pool, and the batch loss is the mean over queries that have at least one positive in the pool.

This file is part of the remote-code bundle of every hf_xmc model (torch only).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def _mean_over_positives(per_pair: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Average ``per_pair`` over each row's positives, then over rows with at least one positive."""
    per_pair = torch.where(targets, per_pair, torch.zeros_like(per_pair))
    num_pos = targets.sum(dim=1)
    has_pos = num_pos > 0
    if not bool(has_pos.any()):
        return per_pair.sum() * 0.0  # keeps the graph alive for an all-empty batch
    per_query = per_pair.sum(dim=1)[has_pos] / num_pos[has_pos]
    return per_query.mean()


def decoupled_softmax_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """DecoupledSoftmax (DEXML eq. 5): for each positive j, ``log(e^s_ij + sum_{l in N_i} e^s_il) - s_ij``.

    The query's other positives are removed from each positive's denominator.
    """
    targets = targets.bool()
    neg_logits = logits.masked_fill(targets, float("-inf"))
    lse_neg = torch.logsumexp(neg_logits, dim=1, keepdim=True)  # -inf when a row has no negative
    per_pair = torch.logaddexp(logits, lse_neg) - logits
    return _mean_over_positives(per_pair, targets)


def softmax_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Multi-label SoftmaxCE (DEXML eq. 3): for each positive j, ``logsumexp_l(s_il) - s_ij`` over the whole pool."""
    targets = targets.bool()
    per_pair = torch.logsumexp(logits, dim=1, keepdim=True) - logits
    return _mean_over_positives(per_pair, targets)


def infonce_loss(logits: torch.Tensor, positive_index: torch.Tensor) -> torch.Tensor:
    """InfoNCE (DEXML eq. 4 with one sampled positive): cross-entropy towards ``positive_index``.

    Every other pool label is a negative, the query's other positives included (the bias that
    DecoupledSoftmax removes).
    """
    return F.cross_entropy(logits, positive_index)


def bce_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One-vs-all binary cross-entropy (DEXML eq. 2), averaged over every (query, label) pair."""
    return F.binary_cross_entropy_with_logits(logits, targets.float())


class DecoupledSoftmaxLoss(nn.Module):
    """DecoupledSoftmax loss of DEXML (Gupta et al., ICLR 2024).

    Inputs: ``logits`` (batch x pool, already divided by the temperature) and boolean ``targets``
    (batch x pool). For each positive, the softmax denominator holds that positive and every negative of
    the query, but none of its other positives, so confidently predicted positives are never pushed down.
    Equals softmax cross-entropy when a query has a single positive.

    Example:
        >>> loss = DecoupledSoftmaxLoss()(torch.randn(4, 10), torch.rand(4, 10) > 0.7)
    """

    citation = (
        "@inproceedings{gupta2024dexml,\n  title={Efficacy of Dual-Encoders for Extreme Multi-Label Classification},\n"
        "  author={Gupta, Nilesh and Devvrit, Fnu and Rawat, Ankit Singh and Bhojanapalli, Srinadh and Jain, Prateek "
        "and Dhillon, Inderjit S},\n  booktitle={ICLR},\n  year={2024}\n}"
    )

    def forward(self, logits: torch.Tensor, targets: torch.Tensor, positive_index: Optional[torch.Tensor] = None) -> torch.Tensor:
        return decoupled_softmax_loss(logits, targets)


class SoftmaxLoss(nn.Module):
    """Multi-label softmax cross-entropy (Menon et al., 2019), the reduction DEXML compares against.

    Each positive's denominator is the whole pool, the query's other positives included, so the optimum
    spreads probability ``1/|P_i|`` over the positives.
    """

    def forward(self, logits: torch.Tensor, targets: torch.Tensor, positive_index: Optional[torch.Tensor] = None) -> torch.Tensor:
        return softmax_loss(logits, targets)


class InfoNCELoss(nn.Module):
    """InfoNCE with one sampled positive per query; needs ``positive_index`` (batch,) into the pool."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor, positive_index: Optional[torch.Tensor] = None) -> torch.Tensor:
        if positive_index is None:
            raise ValueError("InfoNCELoss needs positive_index: the pool position of each query's sampled positive")
        return infonce_loss(logits, positive_index)


class BCELoss(nn.Module):
    """One-vs-all binary cross-entropy over the pool (fails to train dual encoders, DEXML Table 5)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor, positive_index: Optional[torch.Tensor] = None) -> torch.Tensor:
        return bce_loss(logits, targets)


LOSSES = {
    "decoupled_softmax": DecoupledSoftmaxLoss,
    "softmax": SoftmaxLoss,
    "infonce": InfoNCELoss,
    "bce": BCELoss,
}


def get_loss(name: str) -> nn.Module:
    """Instantiate a pool loss by name (``decoupled_softmax``, ``softmax``, ``infonce``, ``bce``)."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; choose one of {sorted(LOSSES)}")
    return LOSSES[name]()
