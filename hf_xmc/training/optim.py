"""SparseAdamW: AdamW for dense gradients, lazy row-wise AdamW for the sparse gradients of per-label tables.

Per-label tables (UniDEC's classifier ``Psi``, PRIME's free-vector bank: :class:`~hf_xmc.models.ExtremeClassifier`)
gather a step's label pool with ``F.embedding(..., sparse=True)``, so their gradient is a sparse COO tensor holding
only the pool's rows. ``torch.optim.AdamW`` refuses such gradients, and with dense ones it would read and write every
row of the table at every step. :class:`SparseAdamW` applies AdamW to the rows present in the gradient only.

Memory per label (fp32, dimension d), table trained with SparseAdamW: weights ``4d`` + two moments ``8d`` = ``12d``
bytes; no gradient for untouched rows. Per step: the coalesced gradient and a few row buffers, ``O(pool x d)``.
Dense AdamW on the same table: ``16d`` bytes per label (the dense ``L x d`` gradient on top) and ``O(L x d)`` work
per step, whatever the pool size.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Optional

import torch


def _unhooked(step: Callable) -> Callable:
    """``step`` without the wrapper torch puts around an optimizer class's ``step`` on its first instantiation (it runs
    the step hooks): ``SparseAdamW.step`` runs them once itself, and must not run them again for the dense part."""
    return inspect.unwrap(step, stop=lambda f: not getattr(f, "hooked", False))


class SparseAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` that also accepts sparse gradients, with a lazy row-wise update for them.

    Parameters whose ``.grad`` is dense take exactly AdamW's step (same code path, ``foreach`` / ``fused`` included).
    For a parameter whose ``.grad`` is sparse (``nn.Embedding(sparse=True)``, ``F.embedding(..., sparse=True)``), the
    gradient is coalesced (a pool may hold an id twice: the rows are summed) and only its rows ``r`` change:

    - ``m[r] = beta1 m[r] + (1 - beta1) g[r]``; ``v[r] = beta2 v[r] + (1 - beta2) g[r]^2`` (``amsgrad``: running max);
    - ``w[r] = w[r] (1 - lr wd) - lr / (1 - beta1^t) * m[r] / (sqrt(v[r] / (1 - beta2^t)) + eps)``.

    Rows outside the gradient keep their weights (no decay drift) and their moments. ``t`` (bias correction) is one
    step count per parameter, increased at every step where the parameter has a gradient, as in
    ``torch.optim.SparseAdam`` and TensorFlow's LazyAdam: a row first touched late gets corrections of about 1 (a
    first step of about ``lr (1 - beta1) / sqrt(1 - beta2)``, ~3 lr by default, instead of lr). Per-row counts would
    cost 4 more bytes per label. With every row in every gradient the update is AdamW's, step for step.

    The state has AdamW's layout (``step``, ``exp_avg``, ``exp_avg_sq`` [, ``max_exp_avg_sq``] per parameter, moments
    of the parameter's shape, allocated at its first step), so ``state_dict`` / ``load_state_dict`` (checkpoint
    resume) and learning-rate schedules (``group["lr"]``) work as with AdamW, and AdamW state loads into it.

    Memory per row of a sparse-gradient table (fp32, d columns): weights ``4d`` + moments ``8d`` bytes; a step adds the
    coalesced ``(rows, d)`` gradient and row buffers (``O(pool x d)``), never an ``L x d`` tensor.

    Args: those of ``torch.optim.AdamW``. ``differentiable=True`` is refused for sparse gradients.

    Example:
        >>> table = torch.nn.Embedding(1_000_000, 64, sparse=True)
        >>> optimizer = SparseAdamW(table.parameters(), lr=1e-3, weight_decay=0.01)
        >>> table(torch.tensor([3, 17, 3])).sum().backward()
        >>> optimizer.step()  # rows 3 and 17 move, no other row
    """

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One AdamW step for dense gradients and one lazy row-wise step for sparse gradients."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sparse = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None and p.grad.is_sparse]
        # AdamW skips parameters without gradient: hide the sparse ones from it for its step
        grads = [p.grad for _, p in sparse]
        for _, p in sparse:
            p.grad = None
        try:
            _unhooked(torch.optim.AdamW.step)(self)
        finally:
            for (_, p), grad in zip(sparse, grads):
                p.grad = grad
        for group, p in sparse:
            self._sparse_step(group, p)
        return loss

    def _sparse_step(self, group: dict, param: torch.Tensor) -> None:
        """Lazy AdamW on the rows of ``param.grad`` (sparse COO, sparse in dimension 0)."""
        if group["differentiable"]:
            raise RuntimeError("SparseAdamW: differentiable=True is not supported for sparse gradients")
        grad = param.grad.coalesce()
        if grad.sparse_dim() != 1:
            raise RuntimeError(f"SparseAdamW: sparse gradients must be sparse in dimension 0 only, got sparse_dim={grad.sparse_dim()}")
        rows, values = grad.indices()[0], grad.values().to(param.dtype)
        if group["maximize"]:
            values = -values
        state = self.state[param]
        if not state:  # AdamW's layout: the step on the parameter's device only for fused / capturable
            on_device = group["fused"] or group["capturable"]
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device if on_device else "cpu")
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] += 1
        step = float(state["step"])
        beta1, beta2 = (float(b) for b in group["betas"])
        lr, eps, weight_decay = float(group["lr"]), group["eps"], group["weight_decay"]
        if rows.numel() == 0:
            return

        exp_avg = state["exp_avg"].index_select(0, rows).lerp_(values, 1 - beta1)
        exp_avg_sq = state["exp_avg_sq"].index_select(0, rows).mul_(beta2).addcmul_(values, values, value=1 - beta2)
        state["exp_avg"].index_copy_(0, rows, exp_avg)
        state["exp_avg_sq"].index_copy_(0, rows, exp_avg_sq)
        if group["amsgrad"]:
            exp_avg_sq = torch.maximum(state["max_exp_avg_sq"].index_select(0, rows), exp_avg_sq)
            state["max_exp_avg_sq"].index_copy_(0, rows, exp_avg_sq)

        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
        weights = param.index_select(0, rows)
        weights.mul_(1 - lr * weight_decay)  # decoupled weight decay, touched rows only
        weights.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
        param.index_copy_(0, rows, weights)


def sparse_gradient_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable parameters of ``model`` that get sparse gradients: weights of ``nn.Embedding`` /
    ``nn.EmbeddingBag`` modules with ``sparse=True`` (e.g. :class:`~hf_xmc.models.ExtremeClassifier` tables), the
    rule ``DistributedDataParallel`` follows too."""
    return [
        module.weight
        for module in model.modules()
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse and module.weight.requires_grad
    ]


def can_reduce_sparse_gradients(world_size: int, n_gpu: int = 1) -> bool:
    """Whether the data-parallel setup can sum sparse gradients: one process, or several joined over gloo (NCCL has no
    sparse all-reduce; ``DataParallel`` over several GPUs is not tried)."""
    if n_gpu > 1:
        return False
    if world_size <= 1:
        return True
    return torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo"


def use_dense_gradients(model: torch.nn.Module) -> int:
    """Switch every sparse-gradient embedding table of ``model`` to dense gradients (for optimizers that need them);
    returns how many were switched. Call it before a ``DistributedDataParallel`` wrap (which reads the flag once)."""
    switched = 0
    for module in model.modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
            module.sparse = False
            switched += 1
    return switched


def has_sparse_gradients(parameters) -> bool:
    """Whether any of ``parameters`` holds a sparse gradient now."""
    return any(p.grad is not None and p.grad.is_sparse for p in parameters)


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` that also takes sparse COO gradients, on every device.

    torch's version hands the gradients of a CUDA device to its fused multi-tensor kernels, which have no sparse
    variant: a per-label table's gradient then stops training on the GPU with "Could not run ... with arguments from
    the 'SparseCUDA' backend". Here a sparse gradient is coalesced first (a row gathered twice in one pool is one row
    of summed gradient, as the optimizer sees it) and its values count in the total norm; the scaling replaces it by
    a scaled copy. Dense gradients are scaled in place, as torch does. Returns the total norm before clipping (a
    0-dim tensor on the first gradient's device).

    Memory: the coalesced sparse gradients (``O(pool x d)`` each) and one scalar per parameter; nothing per label.
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    for p in params:
        if p.grad.is_sparse:
            p.grad = p.grad.coalesce()
    device = params[0].grad.device
    norms = [torch.linalg.vector_norm(p.grad.values() if p.grad.is_sparse else p.grad, norm_type).to(device) for p in params]
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad.is_sparse:
            p.grad = p.grad * coef.to(p.grad.device)
        else:
            p.grad.mul_(coef.to(p.grad.device))
    return total


__all__ = [
    "SparseAdamW",
    "can_reduce_sparse_gradients",
    "clip_grad_norm_",
    "has_sparse_gradients",
    "sparse_gradient_parameters",
    "use_dense_gradients",
]
