"""Compact label codes: int8 and binary copies of the label vectors for search, with exact rescoring.

A :class:`~.label_index.LabelIndex` built with ``codes="int8"`` or ``codes="binary"`` scans a faiss index of compact
codes instead of the float vectors, takes the ``rescore_factor * k`` best candidates and ranks them again by their
exact inner product with the query, read from the float label store (memory-mapped: only the candidates' rows are
touched). The float store stays the source of truth, on disk; the codes are a cache rebuilt from it.

* ``"float"``: no codes, the stored float32 / float16 vectors are searched (the default).
* ``"int8"``: one byte per dimension, uniform between per-dimension minima and maxima learned on a sample of the
  vectors (faiss ``ScalarQuantizer.QT_8bit``): ``IndexScalarQuantizer`` (exact kinds), ``IndexIVFScalarQuantizer``
  (``ivf``, coded without residuals), ``IndexHNSWSQ`` (``hnsw``); candidates ranked by their int8 inner product.
* ``"binary"``: one bit per dimension, its sign (``np.packbits(x > 0)``), the dimension a multiple of 8:
  ``IndexBinaryFlat`` (exact kinds), ``IndexBinaryIVF``, ``IndexBinaryHNSW``; candidates ranked by the Hamming
  distance between the query's sign bits and the label's (an estimate of their angle).

Memory model (``L`` labels of ``d`` dims, ``k`` results, factor ``f``; ``s`` = bytes per stored float):
* codes, held in memory: int8 ``L * d`` bytes (384 B a label at d=384: a quarter of fp32), binary ``L * d / 8``
  (48 B); ``ivf`` adds 8 B a label (ids) and ``nlist`` centroids, ``hnsw`` ~``8 M`` B a label (the graph); an IVF
  index read back from its file maps its lists instead (the page cache's pages, touched as lists are probed);
* building: a training sample of at most ``INT8_TRAIN_ROWS`` (int8 ranges) or the IVF sample, float32;
* per query: ``f * k`` rows of the store read (``f k d s`` bytes of pages touched) and scored in float32; a batch is
  rescored ``RESCORE_BLOCK_VALUES`` floats at a time (64 MiB).

Remote-code file: imports only numpy, torch and (optionally) faiss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Optional

import numpy as np
import torch

try:
    import faiss
except ImportError:  # pragma: no cover - LabelIndex falls back to float search without faiss
    faiss = None

LABEL_CODES = ("float", "int8", "binary")
#: candidates rescored per result when no factor is given: int8 ranks nearly as float does; sign bits need a deeper
#: list (WordNet-XMC's 53K MiniLM label vectors, benchmarks/bench_label_codes.py: recall@100 against exact search
#: 1.0000 for int8 at 2, 0.9745 for binary at 10, 0.9928 at 20)
DEFAULT_RESCORE_FACTOR = {"float": 1, "int8": 2, "binary": 10}
#: label vectors the int8 ranges are learned on (evenly drawn, fixed seed): 150 MiB of float32 at d=384
INT8_TRAIN_ROWS = 100_000
#: query x candidate x dimension floats rescored at once
RESCORE_BLOCK_VALUES = 1 << 24


def check_codes(codes: str, dim: int) -> None:
    """Raise ``ValueError`` naming the fault when ``codes`` cannot code ``dim``-dimensional vectors."""
    if codes not in LABEL_CODES:
        raise ValueError(f"unknown label codes {codes!r}; choose one of {LABEL_CODES}")
    if codes == "binary" and dim % 8:
        raise ValueError(f"binary label codes need a dimension that is a multiple of 8, the label vectors have {dim}")


def query_codes(queries: np.ndarray, codes: str) -> np.ndarray:
    """What the code index is searched with: the float32 queries themselves, or their sign bits for binary codes."""
    return np.packbits(queries > 0, axis=1) if codes == "binary" else queries


def build_code_index(
    codes: str,
    kind: str,
    dim: int,
    chunks: Iterable[np.ndarray],
    training_sample: Callable[[int], np.ndarray],
    hnsw_m: int,
    hnsw_ef_construction: int,
    ivf_nlist: Optional[int],
):
    """The faiss index of ``codes`` for index ``kind`` (``exact`` / ``torch`` both give the flat one), trained on
    ``training_sample(rows)`` (float32 rows of the label vectors) and filled with the float32 ``chunks`` in label-id
    order."""
    check_codes(codes, dim)
    if codes == "int8":
        quantizer = faiss.ScalarQuantizer.QT_8bit
        if kind == "ivf":
            index = faiss.IndexIVFScalarQuantizer(faiss.IndexFlatIP(dim), dim, ivf_nlist, quantizer, faiss.METRIC_INNER_PRODUCT)
            index.by_residual = False  # one set of ranges for the vectors themselves: cheaper to scan, as the fp16 IVF
            index.train(training_sample(0))
        else:
            if kind == "hnsw":
                index = faiss.IndexHNSWSQ(dim, quantizer, hnsw_m, faiss.METRIC_INNER_PRODUCT)
                index.hnsw.efConstruction = hnsw_ef_construction
            else:
                index = faiss.IndexScalarQuantizer(dim, quantizer, faiss.METRIC_INNER_PRODUCT)
            index.train(training_sample(INT8_TRAIN_ROWS))
    else:  # binary: sign bits
        if kind == "ivf":
            index = faiss.IndexBinaryIVF(faiss.IndexBinaryFlat(dim), dim, ivf_nlist)
            index.train(query_codes(training_sample(0), codes))
        elif kind == "hnsw":
            index = faiss.IndexBinaryHNSW(dim, hnsw_m)
            index.hnsw.efConstruction = hnsw_ef_construction
        else:
            index = faiss.IndexBinaryFlat(dim)
    for chunk in chunks:
        index.add(query_codes(chunk, codes))
    return index


def is_binary_index(index) -> bool:
    """Whether ``index`` is one of faiss's binary (Hamming) indexes."""
    return faiss is not None and isinstance(index, faiss.IndexBinary)


def write_code_index(index, path: str) -> None:
    (faiss.write_index_binary if is_binary_index(index) else faiss.write_index)(index, path)


def read_code_index(path: str, codes: str, mapped: bool = False):
    """The faiss index of file ``path`` (binary for ``codes="binary"``). ``mapped``: an IVF index's lists stay in the
    file, memory-mapped read-only (faiss's ``IO_FLAG_MMAP``): nothing of the lists is read at load (the 1.3M-label int8
    IVF file is 516 MB; the label index's part of that model's cold load is 0.36 s with its checks, docs/label_index.md),
    its pages are the page cache's, shared by every process serving the same file, and only the probed lists are read.
    Such an index must not be changed or written as it is: :func:`own_inverted_lists` reads its lists into memory first.
    The mapped lists' prefetch is turned off: faiss's ``OnDiskInvertedLists`` starts ``prefetch_nthread`` (32) threads
    on every search to read the probed lists ahead, which for lists in the page cache only costs: a one-query search of
    64 lists of ~280 int8 codes at 200,000 labels took 2.77 ms with it and 0.55 ms without, 0.64 with the lists in
    memory (``benchmarks/bench_mapped_ivf.py``, alone)."""
    flags = faiss.IO_FLAG_MMAP if mapped else 0
    index = faiss.read_index_binary(path, flags) if codes == "binary" else faiss.read_index(path, flags)
    mapped_ivf = _mapped_ivf(index)
    if mapped_ivf is not None:
        mapped_ivf[1].prefetch_nthread = 0
    return index


def _mapped_ivf(index):
    """``(ivf, lists)``: the IVF part of ``index`` and its memory-mapped (``OnDiskInvertedLists``) lists; None when the
    lists are in memory or there is no IVF."""
    if faiss is None or index is None:
        return None
    if isinstance(index, faiss.IndexBinary):
        ivf = faiss.downcast_IndexBinary(index)
        if not isinstance(ivf, faiss.IndexBinaryIVF):
            return None
    else:
        try:
            ivf = faiss.extract_index_ivf(index)
        except RuntimeError:  # not an IVF index
            return None
    lists = faiss.downcast_InvertedLists(ivf.invlists)
    return (ivf, lists) if isinstance(lists, faiss.OnDiskInvertedLists) else None


def own_inverted_lists(index) -> bool:
    """Read the memory-mapped lists of an IVF index (:func:`read_code_index` with ``mapped``) into memory, so that it
    can be added to, reset, cloned or written (faiss aborts the process on a write to mapped lists, and would write a
    reference to the mapped file instead of the lists); ``False`` when there was nothing to read (lists in memory, or
    no IVF). Memory: the lists' codes and ids (``L * (code bytes + 8)``)."""
    mapped_ivf = _mapped_ivf(index)
    if mapped_ivf is None:
        return False
    ivf, lists = mapped_ivf
    owned = faiss.ArrayInvertedLists(lists.nlist, lists.code_size)
    for list_no in range(lists.nlist):
        size = lists.list_size(list_no)
        if size:
            owned.add_entries(list_no, size, lists.get_ids(list_no), lists.get_codes(list_no))
    ivf.replace_invlists(owned, True)
    owned.this.disown()  # the index owns it now
    return True


def rescore(
    queries: np.ndarray, candidates: np.ndarray, gather: Callable[[np.ndarray], torch.Tensor], k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The top ``k`` of each query's ``candidates`` (label ids, ``-1`` = none) by exact inner product with the float
    label vectors ``gather(increasing ids)`` returns. Returns ``(scores, ids)`` as :meth:`LabelIndex.search` does:
    ``-inf`` / ``-1`` where fewer than ``k`` candidates exist. Queries are rescored a block at a time, each block's
    candidates read once (``RESCORE_BLOCK_VALUES``)."""
    n, depth = candidates.shape
    dim = queries.shape[1]
    scores = np.full((n, k), -np.inf, dtype=np.float32)
    ids = np.full((n, k), -1, dtype=np.int64)
    step = max(1, RESCORE_BLOCK_VALUES // max(1, depth * dim))
    for start in range(0, n, step):
        cand = candidates[start : start + step]
        valid = cand >= 0
        if not valid.any():
            continue
        unique, inverse = np.unique(cand[valid], return_inverse=True)
        vectors = gather(unique).float()
        q = torch.from_numpy(queries[start : start + step])
        block = torch.full(cand.shape, -float("inf"))
        rows = torch.from_numpy(np.nonzero(valid)[0])
        block[torch.from_numpy(valid)] = (q[rows] * vectors[torch.from_numpy(inverse.reshape(-1))]).sum(1)
        top_s, top_j = torch.topk(block, min(k, depth), dim=1)
        top_i = np.take_along_axis(cand, top_j.numpy(), axis=1)
        top_s = top_s.numpy()
        scores[start : start + len(cand), : top_s.shape[1]] = np.where(top_i < 0, -np.inf, top_s)
        ids[start : start + len(cand), : top_i.shape[1]] = np.where(np.isfinite(top_s), top_i, -1)
    return scores, ids
