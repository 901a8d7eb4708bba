"""Gradient caching (GradCache, Gao et al., 2021; used by DEXML, Gupta et al., ICLR 2024, Sec. 4.2 / B.5).

A contrastive/pool loss couples every query with every label of the batch, so it cannot be split into
independent micro-batches the way gradient accumulation does. GradCache makes the encoder's activation memory
independent of the batch size at the cost of a second forward pass:

1. embed every input group (queries, labels, ...) in chunks of ``chunk_size`` rows under ``torch.no_grad()``,
   recording each chunk's RNG state (:class:`RandContext`) so dropout can be replayed;
2. make the concatenated embeddings leaves, compute the full-batch loss on them and cache
   ``G = dloss/d(embeddings)`` (only the ``(rows, d)`` embeddings and the loss graph are alive);
3. return a detached copy of the loss with a backward hook. When the caller runs ``backward`` on it (``Trainer``
   runs ``accelerator.backward(loss)``), the hook re-embeds each chunk with grad, under its RNG snapshot, and
   backpropagates ``grad_output * G[chunk]``. The parameter gradients therefore equal those of the plain
   full-batch loss (with the same dropout masks), and AMP loss scaling and the gradient-accumulation division
   (both multiply the returned loss) reach the encoder through ``grad_output``.

This is the pattern of sentence-transformers' ``CachedLossMixin``; no ``training_step`` override is needed.

Distributed training:

* DDP: every replayed chunk runs a backward, and each backward of a DDP module all-reduces the gradients. Pass
  the DDP-wrapped module as ``ddp_module``: every replay but the last then runs under ``ddp_module.no_sync()``
  and only the last one synchronises the accumulated gradients. ``embed_fn`` must call the *wrapped* module
  (so DDP's forward prepares the reducer), and the last replay must touch every trainable parameter, or DDP
  needs ``find_unused_parameters=True`` (e.g. separate query and label towers: the last chunk is a label chunk).
  Under ``Trainer`` gradient accumulation, non-boundary micro-steps already run inside ``no_sync``. The loss is
  computed on this rank's embeddings only; gathering the other ranks' embeddings into the pool is the
  ``loss_fn``'s job.
* FSDP2 maps ``no_sync`` to ``set_requires_gradient_sync(False)`` and follows the same path (untested here).
* DeepSpeed ZeRO >= 2 is **unsupported**: it refuses several backward passes per step ("Gradient computed twice
  for this partition") and Accelerate's ``no_sync`` is a no-op there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.checkpoint import get_device_states, set_device_states

__all__ = ["CachedLossOutput", "RandContext", "cached_loss"]


class RandContext:
    """Snapshot of the CPU RNG and of the CUDA RNGs of the devices holding ``tensors``; entering it replays them.

    Created before a no-grad forward, then entered around the replayed forward, so that dropout draws the same
    masks (GradCache, Gao et al., 2021). The global RNG state outside the ``with`` block is left untouched
    (``torch.random.fork_rng``). Other accelerators (MPS, XPU) are not snapshotted.
    """

    def __init__(self, *tensors: torch.Tensor):
        self.cpu_state = torch.get_rng_state()
        self.devices, self.device_states = get_device_states(*tensors)
        self._fork: Optional[contextlib.AbstractContextManager] = None

    def __enter__(self) -> RandContext:
        self._fork = torch.random.fork_rng(devices=self.devices, enabled=True)
        self._fork.__enter__()
        torch.set_rng_state(self.cpu_state)
        set_device_states(self.devices, self.device_states)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        fork, self._fork = self._fork, None
        fork.__exit__(exc_type, exc, tb)


class _AutocastState:
    """The autocast settings in force at creation, re-entered for the replay (which runs outside ``autocast``)."""

    DEVICE_TYPES = ("cpu", "cuda")

    def __init__(self):
        self.states = [
            (device, torch.get_autocast_dtype(device))
            for device in self.DEVICE_TYPES
            if torch.is_autocast_enabled(device)
        ]

    def __call__(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for device, dtype in self.states:
            stack.enter_context(torch.autocast(device_type=device, dtype=dtype))
        return stack


@dataclass
class CachedLossOutput:
    """What :func:`cached_loss` returns with ``return_embeddings=True``.

    ``loss`` is the hooked scalar to call ``backward`` on; ``embeddings`` holds one detached ``(rows, d)`` tensor
    per input group (computed with the pre-update weights, e.g. to write into a label-embedding bank).
    """

    loss: torch.Tensor
    embeddings: list[torch.Tensor]


def _num_rows(group: Mapping[str, object]) -> int:
    """The common first dimension of the tensors in one input group."""
    sizes = {v.shape[0] for v in group.values() if isinstance(v, torch.Tensor)}
    if len(sizes) != 1:
        raise ValueError(f"every tensor of an input group must share its first dimension, got sizes {sorted(sizes)}")
    return sizes.pop()


def _split(group: Mapping[str, object], chunk_size: int) -> list[dict[str, object]]:
    """Row chunks of one input group; non-tensor values are passed to every chunk unchanged."""
    rows = _num_rows(group)
    return [
        {key: (v[start : start + chunk_size] if isinstance(v, torch.Tensor) else v) for key, v in group.items()}
        for start in range(0, rows, chunk_size)
    ]


def _other_leaves(loss: torch.Tensor, embeddings: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Leaves of ``loss``'s graph other than ``embeddings``: parameters of ``loss_fn`` itself (e.g. a learned scale)."""
    skip = {id(e) for e in embeddings}
    found, seen, stack = {}, set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if leaf is not None and id(leaf) not in skip:
            found[id(leaf)] = leaf
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(found.values())


def cached_loss(
    embed_fn: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    inputs: Sequence[Mapping[str, torch.Tensor]],
    loss_fn: Callable[..., torch.Tensor],
    chunk_size: int,
    ddp_module: Optional[torch.nn.Module] = None,
    return_embeddings: bool = False,
):
    """Full-batch ``loss_fn(*[embed_fn(group) for group in inputs])`` with GradCache memory (Gao et al., 2021).

    The encoder's activations are only ever alive for ``chunk_size`` rows: embeddings ``E_g`` are computed in
    chunks without grad, ``G_g = dloss/dE_g`` is cached from the full-batch loss, and on ``backward`` each chunk
    is re-embedded under its replayed RNG and backpropagated with ``grad_output * G_g[chunk]``. Parameter
    gradients equal those of the plain loss whose encoder runs on the same chunks (DEXML, Gupta et al., ICLR 2024,
    Sec. 4.2 trains its all-label pool this way). Parameters used by ``loss_fn`` itself also receive
    ``grad_output``-scaled gradients.

    Args:
        embed_fn: maps one chunk dict (the group's keys, ``m`` rows) to ``(m, d)`` embeddings; the same function
            serves every group (dispatch on the keys for separate towers). Under DDP, call the wrapped module.
        inputs: input groups, e.g. ``[query_inputs, label_inputs]``; each a dict of tensors sharing dim 0.
        loss_fn: ``loss_fn(*group_embeddings) -> scalar``, e.g. ``lambda q, l: pool_loss(q @ l.T / tau, targets)``.
            It runs once, so any sampling it does (SoftTop-k positive subsets) is not replayed.
        chunk_size: rows per encoder forward.
        ddp_module: the DDP-wrapped model; all replays but the last run under its ``no_sync()``.
        return_embeddings: return a :class:`CachedLossOutput` with the detached embeddings too.

    Returns:
        the loss, a tensor that requires grad and whose ``backward`` fills the parameters' ``.grad`` (or a
        :class:`CachedLossOutput`). Without grad mode it is a plain detached loss and nothing is cached.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not inputs:
        raise ValueError("cached_loss needs at least one input group")
    autocast_state = _AutocastState()

    # Step 1: chunked forward without grad, one RNG snapshot per chunk
    chunks = [_split(group, chunk_size) for group in inputs]
    rand_states: list[list[RandContext]] = []
    embeddings: list[torch.Tensor] = []
    for group_chunks in chunks:
        group_states, group_embs = [], []
        for chunk in group_chunks:
            group_states.append(RandContext(*[v for v in chunk.values() if isinstance(v, torch.Tensor)]))
            with torch.no_grad():
                group_embs.append(embed_fn(chunk))
        rand_states.append(group_states)
        embeddings.append(torch.cat(group_embs, dim=0))
        del group_embs  # the chunks' copies: only the concatenation is kept ((L, d) in DEXML's all-label mode)

    if not torch.is_grad_enabled():
        loss = loss_fn(*embeddings)
        return CachedLossOutput(loss, embeddings) if return_embeddings else loss

    # Step 2: full-batch loss on leaf embeddings; cache d loss / d embeddings
    leaves = [e.detach().requires_grad_() for e in embeddings]
    loss = loss_fn(*leaves)
    if loss.dim() != 0:
        raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
    loss_params = [p for p in _other_leaves(loss, leaves) if p.requires_grad]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True, retain_graph=bool(loss_params))
    cached = [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, grads)]
    del leaves, grads
    loss_graph = loss if loss_params else None  # kept for the loss_fn parameters' own (grad_output-scaled) backward

    # Step 3: a detached loss whose backward hook replays the chunks with the cached gradients
    def replay(grad_output: torch.Tensor) -> None:
        nonlocal loss_graph
        if loss_graph is not None:
            torch.autograd.backward(loss_graph, grad_output, inputs=loss_params)
            loss_graph = None
        jobs = [
            (chunk, state, grad_chunk)
            for group_chunks, group_states, grad in zip(chunks, rand_states, cached)
            for chunk, state, grad_chunk in zip(group_chunks, group_states, grad.split(chunk_size, dim=0))
        ]
        with torch.enable_grad():
            for i, (chunk, state, grad_chunk) in enumerate(jobs):
                last = i == len(jobs) - 1
                sync = contextlib.nullcontext() if last or ddp_module is None else ddp_module.no_sync()
                with sync:
                    with state, autocast_state():  # same dropout masks and precision as in step 1
                        chunk_embs = embed_fn(chunk)
                    torch.autograd.backward(chunk_embs, (grad_output * grad_chunk).to(chunk_embs.dtype))

    out = loss.detach().requires_grad_()
    out.register_hook(replay)
    return CachedLossOutput(out, [e.detach() for e in embeddings]) if return_embeddings else out
