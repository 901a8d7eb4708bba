"""MUFIN's building blocks: the attention block ``A(X, Z)`` (``A_S`` and ``A_C``), the per-label classifiers
``w_l = alpha_l z_l^1 + (1 - alpha_l) N(eta_l)``, and the bag helpers (descriptor rows packed into padded bags, the
normalised sum over a bag's real rows). Spec: ``shared/specs/mufin.md`` Sec. 3.

Remote-code file (``modeling_mufin.py`` imports it): torch, numpy and its sibling ``classifier_head.py``.
"""

from typing import Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .classifier_head import ExtremeClassifier


class MUFINAttention(nn.Module):
    """The attention block ``A(X, Z)`` of MUFIN (paper Fig. 2(d); structure from the official code, spec Sec. 3.3).

    Queries come from ``X``, keys and values from ``Z``; padded keys are masked out. Q, K, V and O are ``D x D``
    linear layers initialised to the identity with zero bias (optionally spectral-normalised, as the code), split into
    heads; attention dropout on the probabilities; the output is ``LayerNorm(O(MHA(X, Z)) + X)``: a post-LN residual
    on the *query* side, one layer, no feed-forward sub-layer and no positional encoding (so a bag is a set).
    ``A_S(X) = A(X, X)`` and ``A_C(X, Z) = A(X, Z)`` are two instances with their own parameters.

    Even at the identity init this is not the identity map: it computes ``LN(X + softmax(X Z^T / sqrt(d_h)) Z)``.
    """

    def __init__(self, dim: int, num_heads: int, dropout: float = 0.0, spectral_norm: bool = False):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"the attention width {dim} must be a multiple of the number of heads {num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)
        for proj in self.projections():
            proj._mufin_identity_init = True  # read by MUFINPreTrainedModel._init_weights
        if spectral_norm:
            for proj in self.projections():
                torch.nn.utils.parametrizations.spectral_norm(proj)
        self.dropout = nn.Dropout(dropout)
        self.layer_norm = nn.LayerNorm(dim)

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]:
        """Q, K, V and O."""
        return self.q_proj, self.k_proj, self.v_proj, self.o_proj

    def forward(
        self,
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor,
        key_mask: Optional[torch.Tensor] = None,
        output_attentions: bool = False,
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``hidden_states`` ``(B, m_x, D)`` (queries), ``key_value_states`` ``(B, m_z, D)``, ``key_mask`` ``(B, m_z)``
        (True = real key). Returns ``(B, m_x, D)`` (and the ``(B, heads, m_x, m_z)`` attention probabilities)."""
        batch, m_x, dim = hidden_states.shape
        m_z = key_value_states.shape[1]

        def heads(x: torch.Tensor, m: int) -> torch.Tensor:
            return x.view(batch, m, self.num_heads, self.head_dim).transpose(1, 2)

        query = heads(self.q_proj(hidden_states), m_x)
        key = heads(self.k_proj(key_value_states), m_z)
        value = heads(self.v_proj(key_value_states), m_z)
        scores = (query / self.head_dim**0.5) @ key.transpose(-1, -2)
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask.bool()[:, None, None, :], float("-inf"))
        probs = self.dropout(scores.softmax(dim=-1))
        context = (probs @ value).transpose(1, 2).reshape(batch, m_x, dim)
        out = self.layer_norm(self.o_proj(context) + hidden_states)
        return (out, probs) if output_attentions else out


class MUFINClassifier(nn.Module):
    """Per-label one-vs-all classifiers ``w_l = alpha_l z_l^1 + (1 - alpha_l) N(eta_l)`` (paper Sec. 3, Fig. 2(b)).

    ``eta`` is an [`ExtremeClassifier`] table (xavier-initialised, as the paper's Module III); ``alpha_l in [0, 1]``
    is a 2-way softmax over two logits per label (``alpha_param="softmax2"``, the code: ``(1 - alpha, alpha)``) or a
    sigmoid of one logit, initialised so that ``alpha_l = alpha_init``. The paper's convention is used: ``alpha``
    weighs the label vector, so ``alpha = 1`` is MUFIN(alpha=1) with ``w_l = z_l^1`` (spec Sec. 12.1). With
    ``renormalize`` the result is re-normalised (the code's ``N(.)`` around the mix).
    """

    def __init__(self, num_labels: int, dim: int, alpha_param: str = "softmax2", alpha_init: float = 0.5, renormalize: bool = True):
        super().__init__()
        self.free_vectors = ExtremeClassifier(num_labels, dim)
        self.alpha_param, self.alpha_init, self.renormalize = alpha_param, alpha_init, renormalize
        self.alpha_logits = nn.Parameter(torch.empty(num_labels, 2 if alpha_param == "softmax2" else 1))

    @property
    def num_labels(self) -> int:
        return self.free_vectors.num_labels

    def initial_alpha_logits(self) -> torch.Tensor:
        """Logits that give ``alpha = alpha_init`` (for 0.5 and softmax2: (0, 0), the code's init)."""
        logit = float(np.log(self.alpha_init / (1.0 - self.alpha_init)))
        row = [0.0, logit] if self.alpha_param == "softmax2" else [logit]
        return torch.tensor(row).expand_as(self.alpha_logits)

    def alpha(self, label_ids: torch.Tensor) -> torch.Tensor:
        """``alpha_l`` of ``label_ids`` (any shape), in [0, 1]."""
        logits = self.alpha_logits[label_ids.to(self.alpha_logits.device)]
        return logits.softmax(dim=-1)[..., 1] if self.alpha_param == "softmax2" else torch.sigmoid(logits[..., 0])

    def forward(self, label_ids: torch.Tensor, label_vectors: torch.Tensor) -> torch.Tensor:
        """``w`` of ``label_ids`` ``(n,)`` given their label vectors ``z^1`` ``(n, D)``; returns ``(n, D)``."""
        eta = F.normalize(self.free_vectors.pool_weights(label_ids).to(label_vectors.dtype), dim=-1)
        alpha = self.alpha(label_ids).to(label_vectors.dtype).unsqueeze(-1)
        weights = alpha * label_vectors + (1.0 - alpha) * eta
        return F.normalize(weights, dim=-1) if self.renormalize else weights


def masked_sum_normalize(bags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``N(1^T X)`` over the real rows of each bag: ``(B, m, D)``, ``(B, m)`` -> ``(B, D)`` unit vectors."""
    return F.normalize((bags * mask.unsqueeze(-1).to(bags.dtype)).sum(dim=1), dim=-1)


def pad_bags(rows: torch.Tensor, owners: torch.Tensor, num_items: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack descriptor ``rows`` ``(n, D)`` of items ``owners`` ``(n,)`` into padded bags ``(B, m_max, D)`` + mask.

    Rows keep their order within an item (MUFIN puts images first, then the text). Every item ``0..B-1`` must own at
    least one row: an item with neither text nor image is refused.
    """
    owners = owners.to(rows.device).long()
    num_items = int(owners.max()) + 1 if num_items is None else num_items
    counts = torch.bincount(owners, minlength=num_items)
    if counts.numel() > num_items:
        raise ValueError(f"descriptor rows name item {counts.numel() - 1} but the batch has {num_items} items")
    if bool((counts == 0).any()):
        empty = int((counts == 0).nonzero()[0])
        raise ValueError(f"item {empty} has neither text nor image: every item needs at least one descriptor")
    order = torch.argsort(owners, stable=True)
    sorted_owners = owners[order]
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(owners.numel(), device=rows.device) - starts[sorted_owners]
    bags = rows.new_zeros(num_items, int(counts.max()), rows.shape[-1])
    bags[sorted_owners, position] = rows[order]
    mask = torch.zeros(num_items, bags.shape[1], dtype=torch.bool, device=rows.device)
    mask[sorted_owners, position] = True
    return bags, mask


__all__ = ["MUFINAttention", "MUFINClassifier", "masked_sum_normalize", "pad_bags"]
