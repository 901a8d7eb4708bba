"""Hard-negative mining (ANCE-style): a periodic shortlist of the labels the current model ranks highest for each
training query, its known positives removed; the collator draws negatives from it (DEXML section 5.4). Also the
precision of the encoding passes that only choose training examples (:func:`mining_autocast_dtype`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np
import scipy.sparse as sp
import torch
from tqdm.auto import tqdm

from ..data import filter_predictions

logger = logging.getLogger(__name__)

# largest (rows x search depth) block searched at once: 4M ids + scores = 48 MB
_SEARCH_BUDGET = 1 << 22
MINING_PRECISIONS = ("auto", "float32", "bfloat16")


#: ``/proc/cpuinfo`` flags of a CPU that multiplies bfloat16 in hardware: Intel's AMX tiles, and the AVX512-BF16 dot
#: product (Intel from Cooper Lake, AMD from Zen 4)
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, ...]:
    """The flags of :data:`CPU_BF16_FLAGS` this CPU has (``cpuinfo``'s ``flags`` lines); none where it cannot be read."""
    try:
        with open(cpuinfo) as f:
            flags = {flag for line in f if line.startswith("flags") for flag in line.split(":", 1)[-1].split()}
    except OSError:
        return ()
    return tuple(flag for flag in CPU_BF16_FLAGS if flag in flags)


@functools.cache
def cpu_multiplies_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (a flag of :data:`CPU_BF16_FLAGS`). bfloat16 autocast paid on
    both kinds measured: AMX (a 2-core Xeon VM, family 6 model 207: a MiniLM encoding pass 2.2-2.4x float32's speed)
    and AVX512-BF16 without AMX (2 cores of an AMD EPYC, Zen 5: ``benchmarks/bench_bf16_cpu.py``, results/bf16_cpu.json).
    Without either, bfloat16 is emulated and float32 stays. False where the flags (of ``cpuinfo``) cannot be read."""
    return bool(cpu_bf16_flags(cpuinfo))


def mining_autocast_dtype(precision: str, device: torch.device) -> Optional[torch.dtype]:
    """The autocast dtype of the passes that choose training examples (hard-negative mining, cluster batching's
    query embeddings) for ``--mining_precision``: ``"bfloat16"``, ``"float32"`` (None: no autocast) or ``"auto"``,
    bfloat16 where the device runs it natively (a CUDA GPU with bf16, a CPU with AMX or AVX512-BF16) and float32
    elsewhere. These passes only rank labels (or group queries) to pick negatives, so bfloat16's ~3 significant digits
    cost nothing that matters; the model's predictions, its saved label index and every evaluation stay in its own precision."""
    if precision not in MINING_PRECISIONS:
        raise ValueError(f"--mining_precision takes one of {MINING_PRECISIONS}, got {precision!r}")
    if precision == "float32":
        return None
    if precision == "bfloat16":
        return torch.bfloat16
    return torch.bfloat16 if runs_bf16_natively(device) else None


def runs_bf16_natively(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices in hardware: a CUDA GPU with bf16 (Ampere on), a CPU with AMX
    or AVX512-BF16 (:func:`cpu_multiplies_bf16`); False elsewhere (MPS, older GPUs and CPUs: emulated or slow)."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_multiplies_bf16()


def mining_autocast(model, precision: str):
    """``model.encoding_autocast`` in the dtype of ``--mining_precision`` on the model's device
    (:func:`mining_autocast_dtype`): the block around a pass that only picks training examples."""
    return model.encoding_autocast(mining_autocast_dtype(precision, model.device))


def mine_hard_negatives(
    model,
    texts: Sequence[str],
    targets: sp.spmatrix,
    top_k: int = 100,
    batch_size: int = 256,
    show_progress_bar: Optional[bool] = None,
    chunk_size: int = 16384,
    exclude: Optional[sp.spmatrix] = None,
    query_sink: Optional[Callable[[np.ndarray, torch.Tensor], None]] = None,
) -> np.ndarray:
    """Top-``top_k`` labels per training query under the current weights, known positives (and the pairs of
    ``exclude``, a ``(n, L)`` matrix such as the training filter file's: labels that are the query itself) removed.

    The labels are re-encoded and indexed with ``model.build_label_index()`` (exact search, as the DEXML code
    does), in the model's ``hard_negative_search_mode`` when it names one. The queries are then encoded, searched
    and filtered ``chunk_size`` at a time, so memory does not grow with the number of queries beyond the result.
    A query is searched ``top_k + |its positives|`` deep (its positives are removed afterwards); queries with many
    positives (head queries of LF-AmazonTitles-1.3M have hundreds) are searched in small groups of their own, so
    one of them never deepens the search of a whole chunk.

    Memory: the result, ``top_k`` int32 ids per query (400 bytes per query at ``top_k=100``; int64 when the label
    space exceeds 2^31), plus per chunk ``chunk_size x d`` query vectors and at most ``_SEARCH_BUDGET`` (id,
    score) pairs of search results; the label index itself is the model's (see ``LabelIndex``).

    ``query_sink(rows, vectors)``, when given, receives every chunk's query vectors (in the search space the labels
    were searched in) with their row ids, in order: a caller that needs them (cluster batching at the same point)
    gets them without a second encoding pass.

    Returns an ``(n, top_k)`` array, ``-1``-padded where fewer negatives exist.
    """
    targets = sp.csr_matrix(targets)
    n = targets.shape[0]
    if n != len(texts):
        raise ValueError(f"{len(texts)} texts but {n} target rows")
    if exclude is not None:
        if exclude.shape != targets.shape:
            raise ValueError(f"exclude has shape {exclude.shape}, expected the targets' {targets.shape}")
        # a pair in either is never a negative: search past both, filter both
        targets = sp.csr_matrix(((targets != 0) + (sp.csr_matrix(exclude) != 0)).astype(np.float32))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    dtype = np.int32 if targets.shape[1] < np.iinfo(np.int32).max else np.int64
    shortlist = np.full((n, top_k), -1, dtype=dtype)
    positives = np.diff(targets.indptr)
    # a model may mine in another space than it predicts in (UniDEC: the DE head only, paper Sec. 3.2)
    show = n > chunk_size if show_progress_bar is None else show_progress_bar
    with model.using_search_mode(model.hard_negative_search_mode):
        model.build_label_index(batch_size=batch_size, show_progress_bar=show_progress_bar)
        for start in tqdm(range(0, n, chunk_size), desc="Mining hard negatives", disable=not show, unit="chunk"):
            stop = min(start + chunk_size, n)
            queries = model.query_search_vectors(texts[start:stop], batch_size=batch_size, show_progress_bar=False)
            rows = np.arange(start, stop)
            if query_sink is not None:
                query_sink(rows, queries)
            for group in _depth_groups(positives[start:stop], top_k):
                depth = top_k + int(positives[start + group].max())
                scores, ids = model.search(queries[torch.from_numpy(group)], depth)
                shortlist[rows[group]], _ = filter_predictions(ids, scores, targets[rows[group]], top_k)
    logger.info("mined a shortlist of %d hard negatives for %d queries", top_k, n)
    return shortlist


def _depth_groups(num_positives: np.ndarray, top_k: int) -> list[np.ndarray]:
    """Row groups of a chunk searched together: rows with at most ``top_k`` positives in one group (searched
    ``2 top_k`` deep at most), the rest sorted by positive count and cut so that rows x depth stays within
    ``_SEARCH_BUDGET``."""
    light = np.flatnonzero(num_positives <= top_k)
    heavy = np.flatnonzero(num_positives > top_k)
    groups = [light[i : i + max(1, _SEARCH_BUDGET // (2 * top_k))] for i in range(0, len(light), max(1, _SEARCH_BUDGET // (2 * top_k)))]
    heavy = heavy[np.argsort(num_positives[heavy], kind="stable")]
    start = 0
    while start < len(heavy):
        # the group's deepest row sets its depth: grow the group while rows x depth fits the budget
        stop = start + 1
        while stop < len(heavy) and (stop + 1 - start) * (top_k + num_positives[heavy[stop]]) <= _SEARCH_BUDGET:
            stop += 1
        groups.append(heavy[start:stop])
        start = stop
    return [g for g in groups if len(g)]
