"""Multi-label losses over a label pool, shared by the hf_xmc models.

Every loss takes ``logits`` of shape ``(batch, pool)`` -- query/label scores already divided by the
temperature -- and a boolean ``targets`` matrix of the same shape marking which pool labels are true
positives of each query. Masking with ``targets`` (rather than assuming one positive per row) is what keeps
in-batch false negatives out of the denominators.

Normalisation follows the DEXML reference code: the loss of a query is the mean over its positives in the
pool, and the batch loss is the mean over queries that have at least one positive in the pool.

MUFIN's losses (label-anchored triplet, cosine embedding) take similarity matrices instead, see their docstrings.

This file is part of the remote-code bundle of every hf_xmc model (torch only).
"""

from __future__ import annotations

import math
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


def get_loss(name: str, **kwargs) -> nn.Module:
    """Instantiate a pool loss by name (see ``LOSSES``); ``kwargs`` go to its constructor (e.g. ``k`` for ``soft_topk``)."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; choose one of {sorted(LOSSES)}")
    return LOSSES[name](**kwargs)


# --------------------------------------------------------------------------------------------------------------------
# SoftTop-k (DEXML eq. 6, Gupta et al., ICLR 2024)
# --------------------------------------------------------------------------------------------------------------------


def _soft_topk_threshold(x: torch.Tensor, k: torch.Tensor, alpha: float, n_iter: int, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-row ``t`` with ``sum_i sigmoid(alpha * (x_i + t)) = k`` over the non-excluded entries, by bisection."""
    with torch.no_grad():
        if mask is None:
            x_max, x_min = x.amax(dim=1, keepdim=True), x.amin(dim=1, keepdim=True)
        else:
            x_max = x.masked_fill(mask, float("-inf")).amax(dim=1, keepdim=True)
            x_min = x.masked_fill(mask, float("inf")).amin(dim=1, keepdim=True)
        lo = -x_max - 10.0 / alpha  # sum z < k here (every z <= sigmoid(-10))
        hi = -x_min + 10.0 / alpha  # sum z > k here (every z >= sigmoid(10))
        for _ in range(n_iter):
            mid = (lo + hi) / 2
            z = torch.sigmoid(alpha * (x + mid))
            if mask is not None:
                z = z.masked_fill(mask, 0.0)
            below = z.sum(dim=1, keepdim=True) < k
            lo = torch.where(below, mid, lo)
            hi = torch.where(below, hi, mid)
        return (lo + hi) / 2


class _LogSoftTopK(torch.autograd.Function):
    """``log SoftTop-k(x)`` with the implicit-differentiation backward of DEXML Sec. 3 (bisection not differentiated)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, k: torch.Tensor, alpha: float, n_iter: int, mask: Optional[torch.Tensor]):
        work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # bisection needs more than 8 mantissa bits
        t = _soft_topk_threshold(work.detach(), k.to(work.dtype), alpha, n_iter, mask)
        a = alpha * (work.detach() + t)
        log_z = a - torch.logaddexp(a, torch.zeros_like(a))  # = log sigmoid(a)
        if mask is not None:
            log_z = log_z.masked_fill(mask, float("-inf"))  # excluded entries: z = 0
        ctx.save_for_backward(a, mask if mask is not None else torch.empty(0, dtype=torch.bool))
        ctx.has_mask = mask is not None
        ctx.alpha = alpha
        return log_z.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_log_z: torch.Tensor):
        a, mask = ctx.saved_tensors
        alpha = ctx.alpha
        g = grad_log_z.to(a.dtype)
        z, one_minus_z = torch.sigmoid(a), torch.sigmoid(-a)  # 1 - z without cancellation
        v = alpha * z * one_minus_z  # sigma'(x + t)
        u = g * alpha * one_minus_z  # g * d log z / d a
        if ctx.has_mask:
            v = v.masked_fill(mask, 0.0)
            u = u.masked_fill(mask, 0.0)
        s = v.sum(dim=1, keepdim=True).clamp_min(torch.finfo(v.dtype).tiny)
        grad_x = u - u.sum(dim=1, keepdim=True) * v / s
        if ctx.has_mask:
            grad_x = grad_x.masked_fill(mask, 0.0)
        return grad_x.to(grad_log_z.dtype), None, None, None, None


def soft_topk_log(
    x: torch.Tensor,
    k,
    alpha: float = 2.0,
    n_iter: int = 32,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``log z`` with ``z = SoftTop-k(x)`` row-wise: ``z_i = sigmoid(alpha * (x_i + t))`` and ``sum_i z_i = k`` (DEXML eq. 6).

    DEXML (Gupta et al., ICLR 2024), after T. Ahle's soft top-k. The per-row threshold ``t`` is found by
    ``n_iter`` bisection halvings of ``[-max x - 10/alpha, -min x + 10/alpha]`` under ``no_grad``; the output is
    ``log z = a - logaddexp(a, 0)`` with ``a = alpha * (x + t)``. The backward is implicit differentiation of
    ``sum_j z_j = k`` (the bisection is not differentiated through): with ``g = dL/dlog z``,
    ``v = alpha z (1 - z)``, ``S = sum v`` and ``u = g alpha (1 - z)``, ``dL/dx = u - (sum u) v / S``; i.e. the
    Jacobian of ``z`` is ``diag(v) - v v^T / S``.

    Args:
        x: finite scores ``(batch, n)`` (a 1-D ``(n,)`` tensor is one row); exclude entries with ``mask``, not ``-inf``.
        k: the soft number of selected entries, an int or a ``(batch,)`` tensor; ``0 < k < #non-excluded``.
        alpha: sigmoid slope (DEXML uses 2 on ``s / tau``).
        n_iter: bisection halvings (DEXML config: 32).
        mask: optional boolean ``(batch, n)``; True entries are excluded: they do not count towards ``sum z``,
            their output is ``-inf`` (``z = 0``) and they get zero gradient.

    Example:
        >>> log_z = soft_topk_log(torch.randn(4, 10), k=3)  # log_z.exp().sum(1) ~= 3
    """
    squeeze = x.dim() == 1
    if squeeze:
        x = x.unsqueeze(0)
        mask = mask.unsqueeze(0) if mask is not None else None
    if x.dim() != 2:
        raise ValueError(f"soft_topk_log expects x of shape (batch, n), got {tuple(x.shape)}")
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if mask is not None:
        mask = mask.to(device=x.device, dtype=torch.bool)
        if mask.shape != x.shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} != x shape {tuple(x.shape)}")
    k_t = torch.as_tensor(k, device=x.device).reshape(-1, 1)
    if k_t.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"k must be a scalar or have one entry per row ({x.shape[0]}), got {k_t.shape[0]}")
    k_t = k_t.expand(x.shape[0], 1)
    n_valid = x.shape[1] - (mask.sum(dim=1, keepdim=True) if mask is not None else 0)
    bad = (k_t <= 0) | (k_t >= n_valid)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        n_row = int(n_valid if isinstance(n_valid, int) else n_valid[row, 0])
        raise ValueError(
            f"SoftTop-k needs 0 < k < number of non-excluded entries; row {row} has k={float(k_t[row, 0]):g} "
            f"and {n_row} entries (is the label pool larger than k?)"
        )
    log_z = _LogSoftTopK.apply(x, k_t, float(alpha), int(n_iter), mask)
    return log_z.squeeze(0) if squeeze else log_z


def sample_positive_subset(targets: torch.Tensor, k: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Per row, a uniformly random subset of ``min(k, |P_i|)`` of the True entries of ``targets`` (no replacement)."""
    targets = targets.bool()
    device = targets.device if generator is None else generator.device
    keys = torch.rand(targets.shape, generator=generator, device=device).to(targets.device)
    keys = keys.masked_fill(~targets, 2.0)  # non-positives sort last
    order = keys.argsort(dim=1)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(targets.shape[1], device=targets.device).expand_as(order))
    return targets & (rank < k)


def soft_topk_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    k: int = 5,
    alpha: float = 2.0,
    n_iter: int = 32,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """SoftTop-k loss (DEXML eq. 6, code variant): ``l_i = -(1/|P'_i|) sum_{j in P'_i} log SoftTop-k(s_i)_j``.

    DEXML (Gupta et al., ICLR 2024). ``P'_i`` is a uniformly random subset of ``min(k, |P_i|)`` of the query's
    pool positives (without replacement); its other positives are excluded from the operator (the reference
    code's ``-100``), because ``sum_j z_ij = k`` lets at most ``k`` positives approach ``z = 1``. The batch loss is
    the mean over queries with at least one positive. A query whose pool has no entry besides its kept positives
    (nothing to rank against) contributes 0 (the ``t -> inf`` limit) instead of failing.
    """
    targets = targets.bool()
    k = int(k)
    if k <= 0:
        raise ValueError(f"k must be > 0, got {k}")
    if logits.shape[1] <= k:
        raise ValueError(f"SoftTop-k needs a label pool larger than k, got pool {logits.shape[1]} and k={k}")
    keep = sample_positive_subset(targets, k, generator)
    excluded = targets & ~keep
    num_keep = keep.sum(dim=1)
    has_pos = num_keep > 0
    if not bool(has_pos.any()):
        return logits.sum() * 0.0  # keeps the graph alive for an all-empty batch
    n_valid = logits.shape[1] - excluded.sum(dim=1)
    rows = has_pos & (n_valid > k)
    total = logits.sum() * 0.0
    if bool(rows.any()):
        log_z = soft_topk_log(logits[rows], k, alpha=alpha, n_iter=n_iter, mask=excluded[rows])
        kept = keep[rows]
        per_query = -torch.where(kept, log_z, torch.zeros_like(log_z)).sum(dim=1) / num_keep[rows]
        total = total + per_query.sum()
    return total / has_pos.sum()


class SoftTopKLoss(nn.Module):
    """SoftTop-k loss of DEXML (Gupta et al., ICLR 2024): ``-mean_{j in P'_i} log SoftTop-k(s_i)_j``.

    ``SoftTop-k(x)_j = sigmoid(alpha * (x_j + t))`` with ``t`` such that the pool's ``z`` sum to ``k``, so the
    loss is near 0 only when the (at most ``k`` subsampled) positives are all in the soft top-k. DEXML uses
    ``k = 5`` ("SoftTop-5"), ``alpha = 2``, 32 bisection steps.

    Example:
        >>> loss = SoftTopKLoss(k=2)(torch.randn(4, 10), torch.rand(4, 10) > 0.7)
    """

    citation = DecoupledSoftmaxLoss.citation

    def __init__(self, k: int = 5, alpha: float = 2.0, n_iter: int = 32):
        super().__init__()
        self.k, self.alpha, self.n_iter = int(k), float(alpha), int(n_iter)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor, positive_index: Optional[torch.Tensor] = None) -> torch.Tensor:
        return soft_topk_loss(logits, targets, k=self.k, alpha=self.alpha, n_iter=self.n_iter)

    def extra_repr(self) -> str:
        return f"k={self.k}, alpha={self.alpha}, n_iter={self.n_iter}"


LOSSES["soft_topk"] = SoftTopKLoss


# --------------------------------------------------------------------------------------------------------------------
# Clipped dynamic-margin triplet loss and prototype regulariser (PRIME, Dahiya et al., NAACL 2025)
# --------------------------------------------------------------------------------------------------------------------

POSITIVE_SELECTIONS = ("sample_one", "all")


def dynamic_margin_triplet(
    positive_scores: torch.Tensor,
    negative_scores: torch.Tensor,
    margin_min: float = 0.1,
    margin_max: float = 0.3,
    paper_inverted_region: bool = False,
) -> torch.Tensor:
    r"""Per-triplet clipped, detached dynamic-margin loss (PRIME eq. 12-13).

    With ``D = s_p - s_n`` and ``m = clip(|D|, margin_min, margin_max)`` (detached), the loss is
    ``max(0, s_n - s_p + m)``: ``-D + clip(-D)`` for hard triplets (``D <= 0``), ``margin_min - D`` for
    ``0 < D < margin_min`` and 0 beyond. The margin only changes the *value* of hard triplets; their gradient is
    ``(-1, +1)``, as for a fixed margin (without the detach it would double). ``margin_min = 0`` gives the fixed
    margin ``margin_max`` (the paper's "w/o m_d" ablation).

    ``paper_inverted_region=True`` implements the paper's literal case table instead (eq. 3 / 13-14):
    ``D + margin_min`` on ``0 < D < margin_min``, whose gradient ``(+1, -1)`` pulls the negative closer
    ("ambiguous / missing label" region). It has an attractor at ``D = 0``; kept for ablations only.

    ``positive_scores`` broadcasts against ``negative_scores`` (e.g. ``(R, 1)`` against ``(R, k)``).
    """
    diff = positive_scores - negative_scores
    if margin_min > 0:
        margin = diff.abs().detach().clamp(min=margin_min, max=margin_max)
    else:
        margin = torch.full_like(diff, margin_max)
    if not paper_inverted_region:
        return F.relu(margin - diff)  # relu: zero gradient at the exact 0 of the band [margin_min, margin_max]
    hard = -diff + (-diff).detach().clamp(min=margin_min, max=margin_max)
    ambiguous = diff + margin_min
    return torch.where(diff <= 0, hard, torch.where(diff < margin_min, ambiguous, torch.zeros_like(diff)))


def _hardest_negatives(scores: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of the ``k`` highest-scoring non-target columns per row, and which of them are real negatives."""
    k = min(k, scores.shape[1])
    ranked = scores.masked_fill(targets, float("-inf")).topk(k, dim=1).indices
    return scores.gather(1, ranked), ~targets.gather(1, ranked)


def dynamic_margin_triplet_loss(
    scores: torch.Tensor,
    targets: torch.Tensor,
    num_negatives: int = 100,
    margin_min: float = 0.1,
    margin_max: float = 0.3,
    temperature: Optional[float] = 0.1,
    positive_selection: str = "sample_one",
    paper_inverted_region: bool = False,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    r"""PRIME's triplet term over a score matrix (rows = anchors, columns = candidates), as the official code computes it.

    Per anchor row: one positive drawn uniformly from its target columns (``positive_selection="sample_one"``; or
    every positive, averaged, with ``"all"``: the paper's eq. 1), the ``num_negatives`` hardest non-target columns,
    the per-triplet loss of :func:`dynamic_margin_triplet`, and -- with a ``temperature`` -- softmax weights
    ``softmax(s_n / temperature)`` over the *violating* negatives (not detached; ``None`` or 1 sums them
    unweighted). The row loss is the sum over its negatives; the result is the mean over rows that have a positive
    and a negative (rows without one, e.g. labels no batch query owns, are skipped).

    Args:
        scores: ``(R, C)`` cosine similarities.
        targets: boolean ``(R, C)``; True marks positives (every positive, so they are never used as negatives).
    """
    if positive_selection not in POSITIVE_SELECTIONS:
        raise ValueError(f"positive_selection must be one of {POSITIVE_SELECTIONS}, got {positive_selection!r}")
    targets = targets.bool()
    rows = targets.any(dim=1) & ~targets.all(dim=1)
    if not bool(rows.any()):
        return scores.sum() * 0.0
    scores, targets = scores[rows], targets[rows]
    neg_scores, neg_valid = _hardest_negatives(scores, targets, num_negatives)  # (R, k)
    if positive_selection == "sample_one":
        pos = torch.multinomial(targets.float(), 1, generator=generator)
        pos_scores, pos_valid = scores.gather(1, pos), torch.ones_like(pos, dtype=torch.bool)  # (R, 1)
    else:
        num_pos = int(targets.sum(dim=1).max())
        pos = targets.float().topk(num_pos, dim=1).indices
        pos_scores, pos_valid = scores.gather(1, pos), targets.gather(1, pos)  # (R, P)
    per_triplet = dynamic_margin_triplet(pos_scores.unsqueeze(2), neg_scores.unsqueeze(1), margin_min, margin_max, paper_inverted_region)
    per_triplet = per_triplet * neg_valid.unsqueeze(1)  # (R, P, k)
    if temperature is not None and temperature != 1.0:
        violating = (per_triplet > 0) & neg_valid.unsqueeze(1)
        weights = torch.softmax(torch.where(violating, neg_scores.unsqueeze(1), torch.full_like(per_triplet, -100.0)) / temperature, dim=2)
        per_triplet = per_triplet * weights
    per_positive = per_triplet.sum(dim=2) * pos_valid
    per_row = per_positive.sum(dim=1) / pos_valid.sum(dim=1)
    return per_row.mean()


def prototype_regularizer(
    prototype_scores: torch.Tensor,
    text_scores: torch.Tensor,
    targets: torch.Tensor,
    num_negatives: int = 100,
    margin: float = 0.1,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    r"""PRIME's regulariser R (eq. 6-7, hinge form of the official code): prototypes must beat label texts.

    For a sampled positive ``p`` of each query: ``relu(s_qp - b_qp + margin)``; for its ``num_negatives`` hardest
    negatives by prototype score: ``relu(b_qn - s_qn + margin)``. Each part is averaged over its *violating*
    entries only (0 when nothing violates) and ``R = (R_p + R_n) / 2``.

    Args:
        prototype_scores: ``(B, C)`` query/prototype cosines ``b``.
        text_scores: ``(B, C)`` query/label-text cosines ``s``.
        targets: boolean ``(B, C)`` positives.
    """
    targets = targets.bool()
    rows = targets.any(dim=1)
    if not bool(rows.any()):
        return prototype_scores.sum() * 0.0
    b, s, targets = prototype_scores[rows], text_scores[rows], targets[rows]
    pos = torch.multinomial(targets.float(), 1, generator=generator)
    pos_part = F.relu(s.gather(1, pos) - b.gather(1, pos) + margin)
    k = min(num_negatives, b.shape[1])
    neg = b.masked_fill(targets, float("-inf")).topk(k, dim=1).indices
    neg_part = F.relu(b.gather(1, neg) - s.gather(1, neg) + margin) * ~targets.gather(1, neg)
    pos_mean = pos_part.sum() / (pos_part > 0).sum().clamp(min=1)
    neg_mean = neg_part.sum() / (neg_part > 0).sum().clamp(min=1)
    return 0.5 * (pos_mean + neg_mean)


class PRIMELoss(nn.Module):
    r"""PRIME's multi-task objective (eq. 5):
    ``L = L_T(b_q, z) + w_ql * L_T(s_q, l) + w_lq * L_T(s_l, q) + lambda * R``.

    ``L_T`` is :func:`dynamic_margin_triplet_loss` on the query/prototype cosines, the query/label-text cosines and
    their transpose (label-to-query); ``R`` is :func:`prototype_regularizer`.
    """

    def __init__(
        self,
        num_negatives: int = 100,
        margin_min: float = 0.1,
        margin_max: float = 0.3,
        temperature: Optional[float] = 0.1,
        positive_selection: str = "sample_one",
        paper_inverted_region: bool = False,
        query_to_label_weight: float = 1.0,
        label_to_query_weight: float = 1.0,
        regularizer_weight: float = 0.1,
        regularizer_margin: float = 0.1,
    ):
        super().__init__()
        if positive_selection not in POSITIVE_SELECTIONS:
            raise ValueError(f"positive_selection must be one of {POSITIVE_SELECTIONS}, got {positive_selection!r}")
        self.triplet_kwargs = {
            "num_negatives": num_negatives,
            "margin_min": margin_min,
            "margin_max": margin_max,
            "temperature": temperature,
            "positive_selection": positive_selection,
            "paper_inverted_region": paper_inverted_region,
        }
        self.query_to_label_weight = query_to_label_weight
        self.label_to_query_weight = label_to_query_weight
        self.regularizer_weight = regularizer_weight
        self.regularizer_margin = regularizer_margin
        self.num_negatives = num_negatives

    def forward(self, prototype_scores: torch.Tensor, text_scores: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Returns the terms ``query_to_prototype``, ``query_to_label``, ``label_to_query``, ``regularizer`` and ``loss``."""
        targets = targets.bool()
        terms = {"query_to_prototype": dynamic_margin_triplet_loss(prototype_scores, targets, **self.triplet_kwargs)}
        loss = terms["query_to_prototype"]
        if self.query_to_label_weight:
            terms["query_to_label"] = dynamic_margin_triplet_loss(text_scores, targets, **self.triplet_kwargs)
            loss = loss + self.query_to_label_weight * terms["query_to_label"]
        if self.label_to_query_weight:
            terms["label_to_query"] = dynamic_margin_triplet_loss(text_scores.T, targets.T, **self.triplet_kwargs)
            loss = loss + self.label_to_query_weight * terms["label_to_query"]
        if self.regularizer_weight:
            terms["regularizer"] = prototype_regularizer(prototype_scores, text_scores, targets, self.num_negatives, self.regularizer_margin)
            loss = loss + self.regularizer_weight * terms["regularizer"]
        terms["loss"] = loss
        return terms


# --------------------------------------------------------------------------------------------------------------------
# UniDEC (Kharbanda et al., WWW 2025)
# --------------------------------------------------------------------------------------------------------------------

PSL_LOSSES = {"decoupled_softmax": decoupled_softmax_loss, "softmax": softmax_loss}


def symmetric_pool_loss(logits: torch.Tensor, targets: torch.Tensor, loss: str = "decoupled_softmax", query_to_label_weight: float = 0.5) -> dict[str, torch.Tensor]:
    r"""UniDEC's symmetric pick-some-labels loss: ``w * l(queries -> pool) + (1 - w) * l(pool labels -> queries)``.

    The label->query term is the same multi-class loss on the transposed scores: each pool label is an anchor whose
    positives are the batch queries carrying it (labels no batch query carries, pure hard negatives, are skipped).
    ``loss`` is ``"decoupled_softmax"`` (other positives out of each positive's denominator) or ``"softmax"``
    (SupCon). Returns the terms ``query_to_label``, ``label_to_query`` and ``loss``; a term with weight 0 is not computed.
    """
    if loss not in PSL_LOSSES:
        raise ValueError(f"unknown PSL loss {loss!r}; choose one of {sorted(PSL_LOSSES)}")
    loss_fn = PSL_LOSSES[loss]
    targets = targets.bool()
    terms = {}
    total = logits.new_zeros(())
    if query_to_label_weight > 0:
        terms["query_to_label"] = loss_fn(logits, targets)
        total = total + query_to_label_weight * terms["query_to_label"]
    if query_to_label_weight < 1:
        terms["label_to_query"] = loss_fn(logits.T, targets.T)
        total = total + (1.0 - query_to_label_weight) * terms["label_to_query"]
    terms["loss"] = total
    return terms


class UniDECLoss(nn.Module):
    r"""UniDEC's objective (paper Sec. 3.2-3.3 and Table 3's headline configuration):

    ``L = lambda * L_DE + (1 - lambda) * L_CLF`` with
    ``L_DE = lambda_D * l(q -> l) + (1 - lambda_D) * l(l -> q)`` on the scaled DE cosines and
    ``L_CLF = lambda_C * l(q -> l) + (1 - lambda_C) * l(l -> q) + w_bce * BCE`` on the scaled classifier scores,
    where ``l`` is the Decoupled Softmax (or SupCon) over the PSL pool and BCE is the auxiliary one-vs-all loss on
    the un-scaled classifier scores, averaged over every (query, pool label) pair. Without classifier scores (DePSL)
    ``L = L_DE``.

    Example:
        >>> loss = UniDECLoss()(torch.randn(4, 10), torch.rand(4, 10) > 0.7, torch.randn(4, 10), torch.randn(4, 10))
    """

    citation = (
        "@inproceedings{kharbanda2025unidec,\n  title={UniDEC: Unified Dual Encoder and Classifier Training for Extreme "
        "Multi-Label Classification},\n  author={Kharbanda, Siddhant and Gupta, Devaansh and K, Gururaj and Malhotra, Pankaj "
        "and Singh, Amit and Hsieh, Cho-Jui and Babbar, Rohit},\n  booktitle={WWW},\n  year={2025}\n}"
    )

    def __init__(
        self,
        de_loss: str = "decoupled_softmax",
        clf_loss: str = "decoupled_softmax",
        de_query_to_label_weight: float = 0.5,
        clf_query_to_label_weight: float = 0.5,
        de_weight: float = 0.5,
        clf_bce_weight: float = 1.0,
    ):
        super().__init__()
        self.de_loss, self.clf_loss = de_loss, clf_loss
        self.de_query_to_label_weight = de_query_to_label_weight
        self.clf_query_to_label_weight = clf_query_to_label_weight
        self.de_weight = de_weight
        self.clf_bce_weight = clf_bce_weight

    def forward(
        self,
        de_logits: torch.Tensor,
        targets: torch.Tensor,
        clf_logits: Optional[torch.Tensor] = None,
        clf_scores: Optional[torch.Tensor] = None,
    ) -> dict[str, torch.Tensor]:
        """``de_logits`` / ``clf_logits``: scaled ``(batch, pool)`` scores of each head; ``clf_scores``: the un-scaled
        classifier scores for the BCE term; ``targets``: boolean ``(batch, pool)``. Returns every term and ``loss``."""
        targets = targets.bool()
        de = symmetric_pool_loss(de_logits, targets, self.de_loss, self.de_query_to_label_weight)
        terms = {f"de_{name}": value for name, value in de.items() if name != "loss"}
        terms["de"] = de["loss"]
        if clf_logits is None:
            terms["loss"] = de["loss"]
            return terms
        clf = symmetric_pool_loss(clf_logits, targets, self.clf_loss, self.clf_query_to_label_weight)
        terms.update({f"clf_{name}": value for name, value in clf.items() if name != "loss"})
        clf_total = clf["loss"]
        if self.clf_bce_weight:
            if clf_scores is None:
                raise ValueError("the auxiliary BCE term needs the un-scaled classifier scores (clf_scores)")
            terms["clf_bce"] = bce_loss(clf_scores, targets)
            clf_total = clf_total + self.clf_bce_weight * terms["clf_bce"]
        terms["clf"] = clf_total
        terms["loss"] = self.de_weight * de["loss"] + (1.0 - self.de_weight) * clf_total
        return terms


# ---------------------------------------------------------------------------------------------------- MUFIN
def _reduce_pairs(per_pair: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    """Sum, or mean over the valid pairs, of ``per_pair`` (zeros where not ``valid``)."""
    total = torch.where(valid, per_pair, torch.zeros_like(per_pair)).sum()
    if reduction == "sum":
        return total
    if reduction == "mean":
        return total / valid.sum().clamp(min=1)
    raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")


def _full_mask(scores: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ones_like(scores, dtype=torch.bool) if mask is None else mask.bool()


def mufin_triplet_loss(
    pos_sims: torch.Tensor,
    neg_sims: torch.Tensor,
    margin: float = 0.2,
    pos_mask: Optional[torch.Tensor] = None,
    neg_mask: Optional[torch.Tensor] = None,
    negative_temperature: Optional[float] = None,
    reduction: str = "sum",
) -> torch.Tensor:
    """MUFIN Module I (siamese pre-training): label-anchored triplet loss.

    ``L_I = sum_l sum_{i in P_l} sum_{j in N_l} [<z_l, x_j> - <z_l, x_i> + margin]_+`` (paper, margin 0.2; the official
    code uses 0.3). Row ``l`` of ``pos_sims`` ``(B, P)`` holds the anchor's similarities to its hard positives, of
    ``neg_sims`` ``(B, N)`` to its in-batch hard negatives; ``pos_mask`` / ``neg_mask`` mark valid entries (rows may
    have fewer). With ``negative_temperature`` each hinge is weighted by ``softmax(s_neg / tau)`` over the row's valid
    negatives (the official code's variant, tau 0.1), detached like a sampling weight. ``reduction``: ``"sum"``
    (paper) or ``"mean"`` over the valid (positive, negative) pairs.
    """
    pos_valid, neg_valid = _full_mask(pos_sims, pos_mask), _full_mask(neg_sims, neg_mask)
    hinge = (neg_sims.unsqueeze(1) - pos_sims.unsqueeze(2) + margin).clamp(min=0)  # (B, P, N)
    valid = pos_valid.unsqueeze(2) & neg_valid.unsqueeze(1)
    if negative_temperature is not None:
        logits = (neg_sims.detach() / negative_temperature).masked_fill(~neg_valid, float("-inf"))
        weights = torch.softmax(logits, dim=1).nan_to_num(0.0)  # a row without negatives has no pairs anyway
        hinge = hinge * weights.unsqueeze(1)
    return _reduce_pairs(hinge, valid, reduction)


def mufin_ranker_loss(
    pos_scores: torch.Tensor,
    neg_scores: torch.Tensor,
    margin: float = 0.5,
    pos_mask: Optional[torch.Tensor] = None,
    neg_mask: Optional[torch.Tensor] = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """MUFIN Module IV (fine-tuning): cosine-embedding loss over a query's sampled positives and shortlist negatives.

    ``L_IV = sum_i { sum_{l in S_i} (1 - <x_i^{2,l}, w_l>) + sum_{k in T_i} [<x_i^{2,k}, w_k> - margin]_+ }`` (paper,
    margin 0.5). ``pos_scores`` ``(B, S)`` / ``neg_scores`` ``(B, T)`` are the scores ``c_il``; masks mark valid
    entries. ``reduction``: ``"sum"`` (paper) or ``"mean"`` over the valid (query, label) pairs (official code).
    """
    pos_valid, neg_valid = _full_mask(pos_scores, pos_mask), _full_mask(neg_scores, neg_mask)
    per_pair = torch.cat([1.0 - pos_scores, (neg_scores - margin).clamp(min=0)], dim=1)
    return _reduce_pairs(per_pair, torch.cat([pos_valid, neg_valid], dim=1), reduction)


# ---------------------------------------------------------------------------------------------------- SiameseXML
def point_likelihood_nll(scores: torch.Tensor, targets: torch.Tensor, c: float, d: float) -> torch.Tensor:
    """SiameseXML's per-pair negative log-likelihood (paper Eq. 5): with ``p(+1, v) = c exp(d (v - 1))``,
    a positive costs ``-ln c + d (1 - v)`` and a negative ``-ln(1 - c exp(d (v - 1)))``. ``scores`` are cosines
    ``v`` in ``[-1, 1]``, ``targets`` a boolean matrix of the same shape. Example: ``c = 0.75, d = 3`` costs 0.2877 for a
    positive at ``v = 1`` and 0.03806 for a negative at ``v = 0``."""
    if not 0.0 < c < 1.0 or d <= 0:
        raise ValueError(f"the point likelihood needs 0 < c < 1 and d > 0, got c={c}, d={d}")
    positive = -math.log(c) + d * (1.0 - scores)
    negative = -torch.log1p(-c * torch.exp(d * (scores.clamp(max=1.0) - 1.0)))
    return torch.where(targets, positive, negative)


def _keep_hardest(per_pair: torch.Tensor, candidates: torch.Tensor, k: torch.Tensor | int) -> torch.Tensor:
    """Boolean mask of the ``k`` highest ``per_pair`` entries among ``candidates`` per row (``k`` an int or a per-row
    tensor)."""
    masked = per_pair.detach().masked_fill(~candidates, float("-inf"))
    order = masked.argsort(dim=1, descending=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(per_pair.shape[1], device=per_pair.device).expand_as(order))
    k = torch.as_tensor(k, device=per_pair.device).reshape(-1, 1) if not isinstance(k, int) else k
    return candidates & (rank < k)


def siamese_pair_loss(
    scores: torch.Tensor, targets: torch.Tensor, c: float = 0.9, d: float = 1.5, num_hard_negatives: int = 1, loss: str = "likelihood", scale: float = 20.0
) -> torch.Tensor:
    """SiameseXML Module I over a batch of labels (spec Sec. 5, [C] ``kprob_contrastive``).

    ``scores`` ``(B, P)``: cosine of each query row with each batch label; ``targets`` marks every true pair (repeated
    labels and shared positives included). ``loss="likelihood"``: every positive entry costs
    :func:`point_likelihood_nll`; per row only the ``num_hard_negatives`` negatives with the highest loss are kept
    (kappa; positives are never negatives); the loss sums each row and averages over rows. ``loss="softmax"``: DEXML's
    :func:`decoupled_softmax_loss` of ``scale x cos`` (each positive against every in-batch negative of its row).
    """
    if loss == "softmax":
        return decoupled_softmax_loss(scale * scores.float(), targets)
    if loss != "likelihood":
        raise ValueError(f"loss must be 'likelihood' or 'softmax', got {loss!r}")
    per_pair = point_likelihood_nll(scores, targets, c, d)
    keep = targets | _keep_hardest(per_pair, ~targets, num_hard_negatives)
    return torch.where(keep, per_pair, torch.zeros_like(per_pair)).sum(dim=1).mean()


def siamese_classifier_loss(
    scores: torch.Tensor,
    targets: torch.Tensor,
    valid: Optional[torch.Tensor] = None,
    c: float = 0.75,
    d: float = 3.0,
    negatives: str = "threshold",
    threshold: float = 0.05,
    hard_negative_factor: int = 3,
    loss: str = "likelihood",
    scale: float = 20.0,
) -> torch.Tensor:
    """SiameseXML Module IV over each query's positives and shortlist negatives (spec Sec. 5).

    ``scores`` ``(B, S)``: ``cos(w_l, E(x_i))`` of each query's candidate slots; ``targets`` marks positives and
    ``valid`` the filled slots. Which negatives count: ``negatives="threshold"`` ([C]) drops those whose scaled
    likelihood loss is below ``threshold`` (cos < ~0.439 at the defaults); ``"hardest"`` ([P]) keeps the
    ``hard_negative_factor x |P_i|`` highest-scoring ones; ``"all"`` keeps every shortlist negative.

    ``loss``: ``"likelihood"`` ([P] Eq. 5, [C] ``prob_contrastive``): each kept slot costs
    :func:`point_likelihood_nll` divided by ``d``, summed and divided by the batch size; ``"bce"`` (the spec's
    alternative): binary cross-entropy of ``scale x cos`` per kept slot, the same reduction; ``"softmax"``: DEXML's
    :func:`decoupled_softmax_loss` of ``scale x cos`` over each query's positives and kept negatives (each positive
    against the kept negatives, averaged over positives, then queries). The likelihood's gradient is ``1`` per
    positive whatever its cosine and ``~0.1`` for a negative at cosine 0.3, so with cosines of 0-0.5 every ``w_l``
    drifts toward its average query; the two scaled losses weigh each slot by how wrong it is.
    """
    valid = _full_mask(scores, valid)
    positive, negative = valid & targets, valid & ~targets
    likelihood = point_likelihood_nll(scores, targets, c, d) / d
    if negatives == "threshold":
        keep_negative = negative & (likelihood.detach() >= threshold)
    elif negatives == "hardest":
        keep_negative = _keep_hardest(likelihood, negative, hard_negative_factor * positive.sum(dim=1))
    elif negatives == "all":
        keep_negative = negative
    else:
        raise ValueError(f"negatives must be 'threshold', 'hardest' or 'all', got {negatives!r}")
    keep = positive | keep_negative
    if loss == "softmax":
        logits = (scale * scores.float()).masked_fill(~keep, -1e4)  # finite: a dropped slot adds exp(-1e4) = 0, no NaN
        return decoupled_softmax_loss(logits, positive)
    if loss == "likelihood":
        per_pair = likelihood
    elif loss == "bce":
        per_pair = F.binary_cross_entropy_with_logits(scale * scores.float(), targets.float(), reduction="none")
    else:
        raise ValueError(f"loss must be 'likelihood', 'bce' or 'softmax', got {loss!r}")
    return torch.where(keep, per_pair, torch.zeros_like(per_pair)).sum() / scores.shape[0]
