"""Extreme classifiers: one learnable vector per label, trained and searched without dense label x batch logits.

Shared by the methods with per-label classifiers (UniDEC's ``Psi``; SiameseXML, MUFIN and PRIME's OvA stage reuse
it). Training scores a batch only against the rows of its label pool (``pool_weights``), so one step costs
``batch x pool x d`` whatever the label space; inference never scores all labels either: the normalised weights go
into the label index and a query's top-k come from the index search.

Memory per label (fp32, dimension d): weights ``4d`` bytes; training adds the gradient (``4d``, dense: AdamW
needs dense gradients, rows outside the pool are zero) and AdamW's two moments (``8d``), i.e. ``16d`` bytes per
label; searching adds the normalised copy in the label store and the index (see the README's memory table).

This file is part of the remote-code bundle (torch only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ExtremeClassifier(nn.Module):
    """``num_labels x dim`` classifier vectors (no bias), scored on label pools.

    Args:
        num_labels: L, one row per label id.
        dim: size of a classifier vector (the query head's output size).

    Example:
        >>> clf = ExtremeClassifier(1_000_000, 64)
        >>> scores = torch.randn(8, 64) @ clf.pool_weights(torch.tensor([3, 17, 999_999])).T  # (8, 3)
    """

    def __init__(self, num_labels: int, dim: int):
        super().__init__()
        if num_labels < 1 or dim < 1:
            raise ValueError(f"an extreme classifier needs num_labels >= 1 and dim >= 1, got {num_labels}, {dim}")
        self.weight = nn.Parameter(torch.empty(num_labels, dim))

    @property
    def num_labels(self) -> int:
        return self.weight.shape[0]

    def pool_weights(self, label_ids: torch.Tensor) -> torch.Tensor:
        """The ``(pool, dim)`` rows of ``label_ids`` (only these rows receive gradient)."""
        if label_ids.numel() and (int(label_ids.min()) < 0 or int(label_ids.max()) >= self.num_labels):
            raise ValueError(f"label ids must lie in [0, {self.num_labels}), got [{int(label_ids.min())}, {int(label_ids.max())}]")
        return self.weight.index_select(0, label_ids.to(self.weight.device))

    @torch.no_grad()
    def normalized_weights(self, chunk_size: int = 65536) -> torch.Tensor:
        """L2-normalised classifier vectors ``(L, dim)`` (float32, CPU), computed chunk by chunk: the search space."""
        out = torch.empty(self.weight.shape, dtype=torch.float32)
        for start in range(0, self.num_labels, chunk_size):
            out[start : start + chunk_size] = F.normalize(self.weight[start : start + chunk_size].float(), dim=-1).cpu()
        return out


__all__ = ["ExtremeClassifier"]
