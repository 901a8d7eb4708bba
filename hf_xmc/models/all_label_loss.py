"""DEXML's all-label (brute-force) softmax loss, label-chunked and label-sharded (DEXML Sec. 4.2 / B.5).

The DecoupledSoftmax / softmax of ``xmc_losses.py`` over *every* label, without a ``(batch, labels)`` tensor: the
log-sum-exp over the labels is taken chunk by chunk (a custom autograd function recomputes each chunk's scores in
the backward) and, in a run of several processes, over each process's label shard with one all-reduce.

Memory: ``O(batch x chunk_size)`` scores at a time, plus the ``(batch, P_max)`` positive-id lists; never ``batch x
labels``. This file is part of the remote-code bundle of every hf_xmc model (torch only).
"""

from __future__ import annotations

import torch


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its infinities replaced by 0: a safe shift for ``exp(s - lse)`` when a row's ``lse`` is ``-inf``."""
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def unique_positive_ids(positive_ids: torch.Tensor) -> torch.Tensor:
    """Each row's ``-1``-padded label ids with repeats replaced by ``-1`` (rows come back sorted), so that a label listed
    twice counts once, as in a boolean target matrix."""
    ids = positive_ids.sort(dim=1).values
    repeat = torch.zeros_like(ids, dtype=torch.bool)
    repeat[:, 1:] = ids[:, 1:] == ids[:, :-1]
    return ids.masked_fill(repeat, -1)


def _positives_by_chunk(local_ids: torch.Tensor, num_labels: int, chunk_size: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """For each label chunk ``[start, start + chunk_size)`` of a shard: ``(rows, slots, columns)`` of the positives
    that fall in it (query row, position in ``local_ids``, column within the chunk). ``local_ids`` are shard-local
    ids, ``-1`` where a positive is not in the shard. One sort of the ``(B, P)`` ids, then a slice per chunk."""
    rows, slots = (local_ids >= 0).nonzero(as_tuple=True)
    ids = local_ids[rows, slots]
    order = ids.argsort()
    rows, slots, ids = rows[order], slots[order], ids[order]
    starts = list(range(0, num_labels, chunk_size))
    bounds = torch.searchsorted(ids, torch.tensor(starts + [num_labels], device=ids.device)).tolist()
    return [(rows[a:b], slots[a:b], ids[a:b] - start) for start, a, b in zip(starts, bounds[:-1], bounds[1:])]


class _AllLabelSoftmax(torch.autograd.Function):
    """Per-query (Decoupled)Softmax loss against every label of a shard, ``chunk_size`` labels at a time.

    Forward: a running log-sum-exp over the shard's label chunks (positives left out of it when ``decoupled``) and the
    positives' scores read out of the chunk that holds them; with ``distributed`` the per-query log-sum-exps are joined
    across processes (all-reduce MAX, then SUM of ``exp(lse_r - max)``) and the positive scores summed (each positive
    lives on one shard). Backward: the chunk scores are recomputed and turned into gradients for the queries and the
    shard's labels; with ``distributed`` the incoming per-query gradient is summed over processes first, because every
    process's queries are scored against this shard.
    """

    @staticmethod
    def forward(ctx, queries, labels, positive_ids, label_offset, scale, chunk_size, decoupled, distributed):
        work = torch.float32 if queries.dtype in (torch.float16, torch.bfloat16) else queries.dtype
        x = queries.detach().to(work)
        num_labels = labels.shape[0]
        valid = positive_ids >= 0
        local = positive_ids - label_offset
        local = torch.where(valid & (local >= 0) & (local < num_labels), local, torch.full_like(local, -1))
        hits = _positives_by_chunk(local, num_labels, chunk_size)

        lse = x.new_full((x.shape[0],), float("-inf"))
        pos = x.new_zeros(positive_ids.shape)
        for start, (rows, slots, cols) in zip(range(0, num_labels, chunk_size), hits):
            scores = x @ labels[start : start + chunk_size].detach().to(work).T * scale  # (B, chunk): the only B x . buffer
            pos[rows, slots] = scores[rows, cols]
            if decoupled:
                scores[rows, cols] = float("-inf")  # the query's positives are not in its denominator
            lse = torch.logaddexp(lse, torch.logsumexp(scores, dim=1))
        if distributed:
            top = lse.clone()
            torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX)
            shift = _finite_or_zero(top)
            total = torch.exp(lse - shift)
            torch.distributed.all_reduce(total)
            lse = torch.log(total) + shift
            torch.distributed.all_reduce(pos)

        if decoupled:
            per_pair = torch.logaddexp(pos, lse.unsqueeze(1)) - pos
        else:
            per_pair = lse.unsqueeze(1) - pos
        per_query = torch.where(valid, per_pair, torch.zeros_like(per_pair)).sum(dim=1) / valid.sum(dim=1).clamp(min=1)

        ctx.save_for_backward(queries, labels, pos, lse, valid)
        ctx.hits, ctx.scale, ctx.chunk_size, ctx.decoupled, ctx.distributed, ctx.work = hits, scale, chunk_size, decoupled, distributed, work
        return per_query.to(queries.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_per_query):
        queries, labels, pos, lse, valid = ctx.saved_tensors
        work, scale, chunk_size = ctx.work, ctx.scale, ctx.chunk_size
        g = grad_per_query.to(work, copy=True)  # summed in place below: never modify the incoming gradient
        if ctx.distributed:
            torch.distributed.all_reduce(g)  # every process's loss terms reach this shard's labels
        num_pos = valid.sum(dim=1)
        w = g / num_pos.clamp(min=1)
        if ctx.decoupled:
            # d/d pos_ij of logaddexp(pos_ij, lse_i) - pos_ij = -sigmoid(lse_i - pos_ij); d/d lse_i = +sigmoid(...)
            share = torch.sigmoid(lse.unsqueeze(1) - pos) * valid
            grad_pos = -w.unsqueeze(1) * share
            grad_lse = (w.unsqueeze(1) * share).sum(dim=1)
        else:
            grad_pos = -w.unsqueeze(1) * valid
            grad_lse = w * num_pos
        shift = _finite_or_zero(lse).unsqueeze(1)
        x = queries.detach().to(work)
        grad_x = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
        grad_z = torch.empty(labels.shape, dtype=work, device=labels.device) if ctx.needs_input_grad[1] else None
        for start, (rows, slots, cols) in zip(range(0, labels.shape[0], chunk_size), ctx.hits):
            z = labels[start : start + chunk_size].detach().to(work)
            scores = x @ z.T * scale
            if ctx.decoupled:
                scores[rows, cols] = float("-inf")
            coef = torch.exp(scores - shift).mul_(grad_lse.unsqueeze(1))  # d loss / d score, up to the positives' term
            coef.index_put_((rows, cols), grad_pos[rows, slots], accumulate=True)
            coef.mul_(scale)
            if grad_x is not None:
                grad_x.addmm_(coef, z)
            if grad_z is not None:
                grad_z[start : start + chunk_size] = coef.T @ x
        return (
            grad_x.to(queries.dtype) if grad_x is not None else None,
            grad_z.to(labels.dtype) if grad_z is not None else None,
            None, None, None, None, None, None,
        )


def all_label_softmax_loss(
    query_embeds: torch.Tensor,
    label_embeds: torch.Tensor,
    positive_ids: torch.Tensor,
    temperature: float,
    label_offset: int = 0,
    chunk_size: int = 1024,
    decoupled: bool = True,
    distributed: bool = False,
) -> torch.Tensor:
    r"""DecoupledSoftmax (or, with ``decoupled=False``, multi-label SoftmaxCE) of queries against *all* labels, without
    ever building the ``(B, L)`` score matrix (DEXML, Gupta et al., ICLR 2024, "all negatives").

    Equals ``decoupled_softmax_loss(query_embeds @ all_labels.T / temperature, targets)`` (``softmax_loss``), with
    ``targets`` the boolean matrix of ``positive_ids``: for each positive ``j`` of query ``i``,
    ``log(e^{s_ij} + sum_{l in N_i} e^{s_il}) - s_ij``, a mean over the query's distinct positives, then over the
    queries that have one. Scores are computed ``chunk_size`` labels at a time (a custom autograd function whose
    forward accumulates a log-sum-exp over the chunks and whose backward recomputes each chunk's scores).

    Label sharding: ``label_embeds`` may be one process's contiguous shard of the label space (global ids
    ``label_offset .. label_offset + L_r - 1``). With ``distributed=True`` every process of the default group passes
    the *same* queries and positive ids (the global batch, gathered with gradient) and its own shard; the per-query
    log-sum-exps and positive scores are joined with all-reduces, so every process returns the same global loss. Its
    backward sums the per-query gradients over processes, so each process gets the full gradient of its shard and
    its share of the queries' gradient (a gradient-carrying all-gather sums the shares for the queries' owners): the
    processes' parameter gradients add up to ``world_size`` times the one-process gradient, and DDP's average gives
    exactly the one-process gradient of the global batch.

    Memory per call: ``B x chunk_size`` scores (two such buffers in the backward), ``B x P`` positive scores, the
    ``(L_r, d)`` shard and, in the backward, its ``(L_r, d)`` gradient; nothing of size ``B x L``.

    Args:
        query_embeds: ``(B, d)`` query embeddings (every process's queries when ``distributed``).
        label_embeds: ``(L_r, d)`` embeddings of labels ``label_offset .. label_offset + L_r - 1``.
        positive_ids: ``(B, P)`` global label ids of each query's positives, ``-1``-padded (repeats count once).
        temperature: scores are ``<q, z> / temperature``.
        label_offset: global id of ``label_embeds[0]``.
        chunk_size: labels scored at a time.
        decoupled: DecoupledSoftmax (other positives out of each positive's denominator) or SoftmaxCE.
        distributed: join the shards of every process of the default ``torch.distributed`` group.

    Example:
        >>> q, z = torch.randn(4, 8), torch.randn(100, 8)
        >>> loss = all_label_softmax_loss(q, z, torch.tensor([[3, 7], [5, -1], [99, -1], [-1, -1]]), 0.1, chunk_size=32)
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if query_embeds.shape[0] != positive_ids.shape[0]:
        raise ValueError(f"{query_embeds.shape[0]} queries but {positive_ids.shape[0]} rows of positive ids")
    positive_ids = unique_positive_ids(positive_ids.to(query_embeds.device).long())
    per_query = _AllLabelSoftmax.apply(
        query_embeds, label_embeds, positive_ids, int(label_offset), 1.0 / temperature, int(chunk_size), bool(decoupled), bool(distributed)
    )
    has_pos = (positive_ids >= 0).any(dim=1)
    if not bool(has_pos.any()):
        return per_query.sum() * 0.0  # keeps the graph (and, distributed, the backward's collective) alive
    return per_query[has_pos].mean()
