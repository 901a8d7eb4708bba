"""LabelIndex: maximum-inner-product search over label vectors.

Backends
--------
* ``"exact"``  exact search. On CPU it is the chunked matmul + running top-k of ``"torch"`` straight over the label
  vectors (no copy of them; faiss ``IndexFlatIP`` would hold a second fp32 copy for the same GEMM); on GPU with a
  faiss GPU build, a faiss flat index on every visible GPU, filled chunk by chunk.
* ``"hnsw"``   faiss ``IndexHNSWFlat`` (``IndexHNSWSQ`` fp16 over fp16 vectors), inner product; approximate, CPU.
* ``"ivf"``    faiss ``IndexIVFFlat`` (``IndexIVFScalarQuantizer`` fp16 over fp16 vectors), inner product:
  ``ivf_nlist`` lists from spherical k-means on a sample of the vectors, ``ivf_nprobe`` lists scanned per query.
* ``"torch"``  exact chunked ``torch.topk`` over label blocks, on the GPU when torch sees one; the fallback when
  faiss is not installed and the test oracle for the others.

The label vectors are the source of truth; the faiss file written by :meth:`LabelIndex.save` (``hnsw`` and ``ivf``
only) is a cache that is rebuilt whenever it is missing, unreadable, was written by another faiss version, or was
built from other vectors (its ``label_index.json`` keeps a fingerprint of them). A file read back is also checked
against the vectors themselves (:meth:`LabelIndex.mismatch`: a sample of label vectors searched must find themselves
first, with the scores the vectors give): a faiss file swapped for another one, with its sha256 updated, is rebuilt,
never served.

Memory model (``L`` labels of ``d`` dims; ``s`` = 4 bytes per value for fp32 vectors, 2 for fp16)
------------------------------------------------------------------------------------------------
* the vectors: ``L * d * s``, used in place (a memory-mapped store costs its pages once they are touched; a store
  loaded as several shards stays several blocks, never joined);
* ``exact`` / ``torch`` on CPU: nothing per label; per query batch ``b`` a score block of at most
  ``SCORE_BLOCK_VALUES`` floats (64 MiB) plus, for fp16 vectors, one fp32 chunk of ``rows x d x 4`` bytes;
* ``hnsw``: faiss's own copy, ``L * (d * s + ~8 M + 12)`` bytes (``M = hnsw_m``: 2M int32 neighbours on level 0,
  the upper levels and the level tables): 1,808 B per label measured at d=384, M=32 in fp32 (1.18x the vectors),
  1,040 B in fp16 (1.35x). Searching never touches the vectors, so a loaded index costs only this;
* ``ivf``: faiss's own copy, ``L * (d * s + 8)`` bytes + ``nlist * d * 4`` centroids (1.005x the vectors);
  building also holds a training sample of ``min(L, 40 nlist) x d x 4`` bytes. An IVF index read back from its saved
  file (:meth:`load`) maps its lists from it read-only instead (``label_codes.read_code_index``): only the centroids
  are held, the lists are the page cache's pages, shared between processes; adding, selecting or saving reads them
  into memory first (``own_inverted_lists``).
* ``codes="int8"`` / ``"binary"`` (any kind): faiss holds ``d`` / ``d / 8`` bytes a label (+ the kind's ids or graph)
  instead of ``d * s``, and a search reads ``rescore_factor * k`` rows of the vectors a query (``label_codes.py``).

This file is part of the remote-code bundle of every hf_xmc model: it imports only numpy, torch and
(optionally) faiss.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Iterator, Sequence
from typing import Optional, Union

import numpy as np
import torch

from .io_utils import atomic_write, file_sha256, write_json
from .label_codes import (
    DEFAULT_RESCORE_FACTOR,
    LABEL_CODES,
    build_code_index,
    check_codes,
    is_binary_index,
    own_inverted_lists,
    query_codes,
    read_code_index,
    rescore,
    write_code_index,
)

try:  # faiss is optional: the torch backend covers exact search without it
    import faiss
except ImportError:  # pragma: no cover - exercised in environments without faiss
    faiss = None

logger = logging.getLogger(__name__)

INDEX_KINDS = ("exact", "hnsw", "ivf", "torch")
INDEX_FILE = "label_index.faiss"
INDEX_META_FILE = "label_index.json"
# score block budget of the chunked exact search: (queries x label rows) floats scored at once, 64 MiB
SCORE_BLOCK_VALUES = 1 << 24
# training vectors per IVF list: k-means sees this many (faiss warns below 39; more costs build time, ~linearly)
IVF_TRAIN_POINTS_PER_LIST = 40
# parameters that shape the faiss index: a saved file built with other values is rebuilt
BUILD_PARAMS = ("hnsw_m", "hnsw_ef_construction", "ivf_nlist")
SEARCH_PARAMS = ("hnsw_ef_search", "ivf_nprobe", "rescore_factor")
# label vectors searched in a faiss file read back, to check that it indexes the stored vectors (:meth:`LabelIndex.mismatch`)
VERIFY_SAMPLE = 48
VERIFY_DEPTH = 4

Vectors = Union[np.ndarray, torch.Tensor]


def faiss_available() -> bool:
    """True when the faiss package can be imported."""
    return faiss is not None


def faiss_gpu_available() -> bool:
    """True when faiss was built with GPU support and sees at least one GPU."""
    return faiss is not None and hasattr(faiss, "get_num_gpus") and faiss.get_num_gpus() > 0


def default_ivf_nlist(num_labels: int) -> int:
    """``4 sqrt(L)`` inverted lists (4,560 at 1.3M labels), at most one per ``IVF_TRAIN_POINTS_PER_LIST`` labels, at
    least 1."""
    return max(1, min(int(4 * math.sqrt(num_labels)), num_labels // IVF_TRAIN_POINTS_PER_LIST))


def as_label_blocks(embeddings: Vectors | Sequence[Vectors]) -> list[torch.Tensor]:
    """The label vectors as a list of CPU row blocks ``(rows, d)``, float32 or float16, without copying them when
    they already are (a memory-mapped safetensors tensor stays mapped). ``embeddings`` is one ``(L, d)`` array or
    tensor, or a sequence of them (e.g. the shards of a saved store), in label-id order."""
    parts = [embeddings] if isinstance(embeddings, (np.ndarray, torch.Tensor)) else list(embeddings)
    blocks = []
    for part in parts:
        block = torch.from_numpy(part) if isinstance(part, np.ndarray) and part.dtype in (np.float32, np.float16) else torch.as_tensor(part)
        block = block.detach().cpu()
        if block.dtype not in (torch.float32, torch.float16):
            block = block.float()
        blocks.append(block.contiguous())
    if not blocks or any(b.ndim != 2 for b in blocks) or sum(b.shape[0] for b in blocks) == 0:
        raise ValueError(f"label embeddings must be a non-empty 2-D array, got shapes {[tuple(b.shape) for b in blocks]}")
    if len({b.shape[1] for b in blocks}) > 1 or len({b.dtype for b in blocks}) > 1:
        raise ValueError(f"label blocks differ in width or dtype: {[(tuple(b.shape), b.dtype) for b in blocks]}")
    return blocks


def vectors_fingerprint(blocks: Sequence[torch.Tensor]) -> str:
    """A cheap fingerprint of the label vectors (shape, dtype and 16 evenly spaced rows): a saved faiss file is reused
    only for the vectors it was built from. Reads 16 rows, so a memory-mapped store stays almost untouched."""
    num_labels = sum(b.shape[0] for b in blocks)
    digest = hashlib.sha256(f"{num_labels}x{blocks[0].shape[1]}:{blocks[0].dtype}".encode())
    offsets = np.cumsum([0] + [b.shape[0] for b in blocks])
    for row in np.unique(np.linspace(0, num_labels - 1, 16).astype(np.int64)):
        which = int(np.searchsorted(offsets, row, side="right")) - 1
        digest.update(blocks[which][row - offsets[which]].numpy().tobytes())
    return digest.hexdigest()[:32]


class LabelIndex:
    """Inner-product top-k search over a fixed set of label vectors.

    Args:
        embeddings: ``(num_labels, dim)`` float32 or float16 array/tensor of label vectors, or a list of such row
            blocks (the shards of a saved store). Used in place, never copied (other dtypes are converted to float32).
        kind: ``"exact"``, ``"hnsw"``, ``"ivf"`` or ``"torch"``. ``hnsw`` and ``ivf`` fall back to ``"torch"`` (exact)
            with a warning when faiss is not installed; ``exact`` needs faiss only on GPU.
        use_gpu: search on GPU (a faiss GPU flat index for ``exact``, torch for ``torch``); ``None`` = when available.
        hnsw_m: HNSW graph degree (faiss ``M``).
        hnsw_ef_construction / hnsw_ef_search: HNSW build and query beam widths.
        ivf_nlist: number of IVF lists; ``None`` = :func:`default_ivf_nlist` (``4 sqrt(L)``).
        ivf_nprobe: IVF lists scanned per query (more: higher recall, slower); 64 of the 4,560 default lists at 1.3M
            labels find 96% of the exact top-100 (benchmarks/bench_index.py).
        chunk_size: most label rows scored at once by the chunked exact search (it also keeps the score block within
            ``SCORE_BLOCK_VALUES``) and added to faiss at once.
        codes: ``"float"`` (search the vectors), ``"int8"`` or ``"binary"``: search a faiss index of compact codes and
            rescore its best ``rescore_factor * k`` candidates exactly from the vectors (``label_codes.py``).
        rescore_factor: candidates per result of a coded search (``None``: ``DEFAULT_RESCORE_FACTOR`` of the codes).

    Example:
        >>> index = LabelIndex(np.random.randn(1000, 32).astype("float32"), kind="exact")
        >>> scores, ids = index.search(np.random.randn(4, 32).astype("float32"), k=5)
    """

    def __init__(
        self,
        embeddings: Vectors | Sequence[Vectors],
        kind: str = "exact",
        use_gpu: Optional[bool] = None,
        hnsw_m: int = 32,
        hnsw_ef_construction: int = 200,
        hnsw_ef_search: int = 128,
        ivf_nlist: Optional[int] = None,
        ivf_nprobe: int = 64,
        chunk_size: int = 65536,
        codes: str = "float",
        rescore_factor: Optional[int] = None,
        _faiss_index=None,
    ):
        if kind not in INDEX_KINDS:
            raise ValueError(f"unknown index kind {kind!r}; choose one of {INDEX_KINDS}")
        self.blocks = as_label_blocks(embeddings)
        check_codes(codes, self.dim)
        if (kind in ("hnsw", "ivf") or codes != "float") and faiss is None:
            logger.warning("faiss is not installed: LabelIndex(kind=%r, codes=%r) falls back to exact torch search", kind, codes)
            kind, codes = "torch", "float"
        self.kind = kind
        self.codes = codes
        self.rescore_factor = int(rescore_factor or DEFAULT_RESCORE_FACTOR[codes])
        self.hnsw_m = hnsw_m
        self.hnsw_ef_construction = hnsw_ef_construction
        self.hnsw_ef_search = hnsw_ef_search
        self.ivf_nlist = (ivf_nlist or default_ivf_nlist(self.num_labels)) if kind == "ivf" else ivf_nlist
        if codes == "binary" and kind == "ivf":
            self.ivf_nlist = min(self.ivf_nlist, self.num_labels)  # faiss's binary k-means needs a point per list
        self.ivf_nprobe = ivf_nprobe
        self.chunk_size = chunk_size
        if use_gpu is None:
            use_gpu = faiss_gpu_available() if kind == "exact" else torch.cuda.is_available() if kind == "torch" else False
        self.use_gpu = use_gpu
        self._index = _faiss_index
        self.restored_from_file = False  # True when :meth:`load` read the faiss index from a file instead of building it
        if self._index is None and self._uses_faiss():
            self._index = self._build_faiss()
        self._torch_labels: Optional[torch.Tensor] = None

    @property
    def num_labels(self) -> int:
        """Number of indexed labels."""
        return sum(b.shape[0] for b in self.blocks)

    @property
    def dim(self) -> int:
        """Dimension of the label vectors."""
        return self.blocks[0].shape[1]

    @property
    def dtype(self) -> torch.dtype:
        """Precision the label vectors are held in (float32 or float16)."""
        return self.blocks[0].dtype

    def _uses_faiss(self) -> bool:
        return self.keeps_file(self.kind, self.codes) or (self.kind == "exact" and self.use_gpu and faiss_gpu_available())

    @staticmethod
    def keeps_file(kind: str, codes: str = "float") -> bool:
        """Whether an index of this kind and codes holds a faiss index that :meth:`save` writes (HNSW, IVF, codes)."""
        return kind in ("hnsw", "ivf") or codes != "float"

    def _chunks(self, rows: int, blocks: Optional[Sequence[torch.Tensor]] = None) -> Iterator[tuple[int, torch.Tensor]]:
        """``(first label id, float32 rows)`` over the label vectors, ``rows`` at a time; fp32 blocks are sliced in
        place, fp16 ones widened one chunk at a time."""
        offset = 0
        for block in self.blocks if blocks is None else blocks:
            for start in range(0, block.shape[0], rows):
                yield offset + start, block[start : start + rows].float()
            offset += block.shape[0]

    def _build_faiss(self):
        d, fp16 = self.dim, self.dtype == torch.float16
        if self.codes != "float":
            chunks = (chunk.numpy() for _, chunk in self._chunks(self.chunk_size))
            return build_code_index(self.codes, self.kind, d, chunks, self.sample_vectors, hnsw_m=self.hnsw_m,
                                    hnsw_ef_construction=self.hnsw_ef_construction, ivf_nlist=self.ivf_nlist)
        if self.kind == "hnsw":
            if fp16:  # fp16 codes: faiss holds the vectors at the precision they are stored in
                index = faiss.IndexHNSWSQ(d, faiss.ScalarQuantizer.QT_fp16, self.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            else:
                index = faiss.IndexHNSWFlat(d, self.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efConstruction = self.hnsw_ef_construction
        elif self.kind == "ivf":
            quantizer = faiss.IndexFlatIP(d)  # the IVF constructor sets spherical k-means for inner product
            if fp16:
                index = faiss.IndexIVFScalarQuantizer(quantizer, d, self.ivf_nlist, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
                index.by_residual = False  # fp16 of the vectors themselves is precise enough, and cheaper to scan
            else:
                index = faiss.IndexIVFFlat(quantizer, d, self.ivf_nlist, faiss.METRIC_INNER_PRODUCT)
            index.train(self.sample_vectors())
        else:  # exact on GPU: an empty flat index put on the GPUs, filled chunk by chunk (no CPU copy)
            index = faiss.index_cpu_to_all_gpus(faiss.IndexFlatIP(d))
        for _, chunk in self._chunks(self.chunk_size):
            index.add(chunk.numpy())
        return index

    def vectors(self, label_ids: np.ndarray) -> torch.Tensor:
        """The float32 vectors of the increasing label ids ``label_ids`` as stored (block by block, no copy of the
        whole store; memory: ``len(label_ids) x dim x 4`` bytes)."""
        return self._gather(np.asarray(label_ids, dtype=np.int64)).float()

    def sample_vectors(self, count: int = 0) -> np.ndarray:
        """``count`` label vectors (0: ``IVF_TRAIN_POINTS_PER_LIST * nlist``, to train the IVF lists on), at most all,
        drawn with a fixed seed, float32 (``count x dim x 4`` bytes)."""
        n = min(self.num_labels, count or IVF_TRAIN_POINTS_PER_LIST * self.ivf_nlist)
        rows = np.sort(np.random.default_rng(0).choice(self.num_labels, n, replace=False))
        return self._gather(rows).float().numpy()

    def _gather(self, rows: np.ndarray) -> torch.Tensor:
        """The vectors of increasing label ids ``rows``, in the store's precision, block by block (no copy of the
        whole store)."""
        parts, offset = [], 0
        for block in self.blocks:
            local = rows[(rows >= offset) & (rows < offset + block.shape[0])] - offset
            parts.append(block[torch.from_numpy(local)])
            offset += block.shape[0]
        return torch.cat(parts)

    def _faiss_search_index(self):
        if self.kind == "hnsw":
            self._index.hnsw.efSearch = max(self.hnsw_ef_search, 1)
        elif self.kind == "ivf":
            self._index.nprobe = max(1, min(self.ivf_nprobe, self.ivf_nlist))
        return self._index

    def search(self, queries: Vectors, k: int = 10, batch_size: int = 4096) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` labels per query by inner product, best first.

        Returns ``(scores, ids)``: float32 and int64 arrays of shape ``(num_queries, k)``. When ``k``
        exceeds the number of labels (or an approximate index finds fewer), the missing slots hold id ``-1`` and
        score ``-inf``.
        """
        if isinstance(queries, torch.Tensor):
            queries = queries.detach().float().cpu().numpy()
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise ValueError(f"queries must have shape (n, {self.dim}), got {queries.shape}")
        n = queries.shape[0]
        scores = np.full((n, k), -np.inf, dtype=np.float32)
        ids = np.full((n, k), -1, dtype=np.int64)
        kk = min(k, self.num_labels)
        for start in range(0, n, batch_size):
            q = queries[start : start + batch_size]
            if self.codes != "float":
                s, i = self._search_codes(q, kk)
            elif self._index is not None:
                s, i = self._faiss_search_index().search(q, kk)
                s = np.where(i < 0, -np.inf, s)  # HNSW / IVF may return fewer than k hits
            else:
                s, i = self._exact_search(q, kk)
            scores[start : start + len(q), :kk] = s
            ids[start : start + len(q), :kk] = i
        return scores, ids

    def _search_codes(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The codes' ``rescore_factor * k`` best candidates, ranked again by their exact inner product."""
        depth = min(self.num_labels, max(k, self.rescore_factor * k))
        _, candidates = self._faiss_search_index().search(query_codes(queries, self.codes), depth)
        return rescore(queries, candidates, self._gather, k)

    def _exact_search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Chunked ``queries @ labels.T`` with a running top-k: the score block never exceeds ``SCORE_BLOCK_VALUES``."""
        device = torch.device("cuda") if self.use_gpu and torch.cuda.is_available() else torch.device("cpu")
        blocks = None
        if device.type == "cuda":  # one copy of the vectors in GPU memory (their precision), kept between searches
            if self._torch_labels is None:
                self._torch_labels = torch.empty((self.num_labels, self.dim), dtype=self.dtype, device=device)
                offset = 0
                for block in self.blocks:
                    self._torch_labels[offset : offset + block.shape[0]].copy_(block)
                    offset += block.shape[0]
            blocks = [self._torch_labels]
        q = torch.from_numpy(queries).to(device)
        rows = max(1, min(self.chunk_size, SCORE_BLOCK_VALUES // max(1, q.shape[0])))
        best_s = torch.full((q.shape[0], k), -float("inf"), device=device)
        best_i = torch.full((q.shape[0], k), -1, dtype=torch.long, device=device)
        for start, chunk in self._chunks(rows, blocks):
            block = q @ chunk.T
            s, i = torch.topk(block, min(k, block.shape[1]), dim=1)
            merged_s = torch.cat([best_s, s], dim=1)
            merged_i = torch.cat([best_i, i + start], dim=1)
            best_s, order = torch.topk(merged_s, k, dim=1)
            best_i = torch.gather(merged_i, 1, order)
        return best_s.cpu().numpy(), best_i.cpu().numpy()

    def add(self, vectors: Vectors) -> None:
        """Append label vectors (ids ``num_labels ..``) in place: a new block, and faiss's ``add`` for the kinds that
        hold a faiss index (the IVF lists and HNSW graph are not rebuilt). Memory: the new rows (and faiss's copy)."""
        block = as_label_blocks(vectors)[0]
        if block.shape[1] != self.dim:
            raise ValueError(f"vectors must have {self.dim} columns, got {block.shape[1]}")
        self.blocks.append(block.to(self.dtype))
        if self._index is not None:
            own_inverted_lists(self._index)  # lists read back memory-mapped are read-only
            for _, chunk in self._chunks(self.chunk_size, [self.blocks[-1]]):
                self._index.add(query_codes(chunk.numpy(), self.codes))
        self._torch_labels = None

    def select(self, rows: np.ndarray | torch.Tensor) -> LabelIndex:
        """A new index over the vectors of ``rows`` (in that order, renumbered from 0): labels removed. An IVF index
        keeps its trained lists (the kept vectors are re-added, no k-means); HNSW, which faiss cannot delete from, is
        rebuilt. Memory: one copy of the kept vectors."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (np.any(np.diff(rows) <= 0) or rows[0] < 0 or rows[-1] >= self.num_labels):
            raise ValueError(f"rows must be increasing label ids in [0, {self.num_labels})")
        kept = self._gather(rows)
        params = dict(kind=self.kind, use_gpu=self.use_gpu, hnsw_m=self.hnsw_m, hnsw_ef_construction=self.hnsw_ef_construction,
                      hnsw_ef_search=self.hnsw_ef_search, ivf_nlist=self.ivf_nlist, ivf_nprobe=self.ivf_nprobe, chunk_size=self.chunk_size,
                      codes=self.codes, rescore_factor=self.rescore_factor)
        reuse = None
        if self.kind == "ivf" and self.codes == "float" and self._index is not None:
            own_inverted_lists(self._index)  # faiss clones no memory-mapped lists
            reuse = faiss.clone_index(self._index)
            reuse.reset()  # the trained coarse quantizer stays
            for start in range(0, kept.shape[0], self.chunk_size):
                reuse.add(kept[start : start + self.chunk_size].float().numpy())
        return LabelIndex([kept], _faiss_index=reuse, **params)

    def mismatch(self, sample: int = VERIFY_SAMPLE) -> Optional[str]:
        """Why the faiss index does not search these label vectors (``None`` when it does, or holds no faiss index).

        The label vectors are what is trusted: the index must hold as many vectors of their width, rank by inner
        product, and ``sample`` of them (evenly spread, plus a fixed-seed draw) searched must each come first (or tie
        with a label that scores as high), every hit scored as the stored vectors score it. A file built from other
        vectors, or from these in another order, fails; so does one edited in a sampled row. Cost: ``sample`` searches
        and ``sample * VERIFY_DEPTH`` stored rows read."""
        index = self._index
        if index is None:
            return None
        if int(index.ntotal) != self.num_labels or int(index.d) != self.dim:
            return f"it holds {int(index.ntotal)} vectors of width {int(index.d)}, the label store {self.num_labels} of width {self.dim}"
        if is_binary_index(index) != (self.codes == "binary"):
            return f"it holds {'binary' if is_binary_index(index) else 'float or int8'} codes, the index searches {self.codes} ones"
        if not is_binary_index(index) and getattr(index, "metric_type", faiss.METRIC_INNER_PRODUCT) != faiss.METRIC_INNER_PRODUCT:
            return "it does not rank by inner product"
        n = self.num_labels
        spread = np.linspace(0, n - 1, min(n, sample // 2)).astype(np.int64)
        drawn = np.random.default_rng(0).choice(n, min(n, sample - sample // 2), replace=False)
        rows = np.unique(np.concatenate([spread, drawn]))
        queries = self._gather(rows).float()
        if self.codes != "float":  # the coded search as it serves: candidates from the codes, scores from the vectors
            scores, ids = self._search_codes(queries.numpy(), min(n, VERIFY_DEPTH))
        else:
            scores, ids = self._faiss_search_index().search(queries.numpy(), min(n, VERIFY_DEPTH))
        if ids.min() < -1 or ids.max() >= n:
            return f"it returns label id {int(ids.max()) if ids.max() >= n else int(ids.min())}, outside [0, {n})"
        found = ids.clip(min=0)
        unique, inverse = np.unique(found, return_inverse=True)
        hit_vectors = self._gather(unique).float()[torch.from_numpy(inverse.reshape(-1))].reshape(*found.shape, self.dim)
        true = torch.einsum("qd,qkd->qk", queries, hit_vectors).numpy()
        own = (queries * queries).sum(1).numpy()
        tolerance = (1e-2 if self.dtype == torch.float16 else 1e-3) * np.maximum(1.0, np.abs(own))
        valid = ids >= 0
        wrong = valid & (np.abs(true - scores) > tolerance[:, None])
        if wrong.any():
            j = int(np.nonzero(wrong.any(1))[0][0])
            return f"it scores label {int(rows[j])}'s vector against label {int(ids[j][wrong[j]][0])} unlike the stored vectors"
        first = np.where(valid[:, 0], true[:, 0], -np.inf)
        lost = first < own - tolerance
        if lost.any():
            j = int(np.nonzero(lost)[0][0])
            return f"label {int(rows[j])}'s own vector does not find itself first"
        return None

    def metadata(self) -> dict:
        """What :meth:`save` writes to ``label_index.json``: kind, shape, precision, parameters, faiss version and the
        fingerprint of the vectors the index was built from."""
        return {
            "kind": self.kind,
            "num_labels": self.num_labels,
            "dim": self.dim,
            "dtype": str(self.dtype).replace("torch.", ""),
            "fingerprint": vectors_fingerprint(self.blocks),
            "hnsw_m": self.hnsw_m,
            "hnsw_ef_construction": self.hnsw_ef_construction,
            "hnsw_ef_search": self.hnsw_ef_search,
            "ivf_nlist": self.ivf_nlist,
            "ivf_nprobe": self.ivf_nprobe,
            "codes": self.codes,
            "rescore_factor": self.rescore_factor,
            "faiss_version": getattr(faiss, "__version__", None) if faiss is not None else None,
        }

    def save(self, directory: str) -> None:
        """Write the faiss index (``hnsw`` / ``ivf`` / codes; exact float search needs none) and its metadata atomically
        into ``directory``; a faiss file left there by an earlier save of another kind is removed."""
        os.makedirs(directory, exist_ok=True)
        index_path = os.path.join(directory, INDEX_FILE)
        meta = self.metadata()
        if self.keeps_file(self.kind, self.codes):
            own_inverted_lists(self._index)  # mapped lists would be written as a reference to the file they came from
            atomic_write(index_path, lambda p: write_code_index(self._index, p))
            meta["sha256"] = file_sha256(index_path)  # a file that does not match is never handed to faiss
        elif os.path.exists(index_path):
            os.remove(index_path)
        atomic_write(os.path.join(directory, INDEX_META_FILE), lambda p: write_json(p, meta))

    @classmethod
    def load(
        cls,
        embeddings: Vectors | Sequence[Vectors],
        meta_path: Optional[str] = None,
        index_path: Optional[str] = None,
        kind: Optional[str] = None,
        use_gpu: Optional[bool] = None,
        codes: Optional[str] = None,
        **params,
    ) -> LabelIndex:
        """Restore an index for ``embeddings`` from saved files, rebuilding it when they are stale.

        ``meta_path`` / ``index_path`` are local paths to the files written by :meth:`save` (either may be
        ``None``). The saved parameters are restored; ``params`` (``hnsw_ef_search=...``, ``ivf_nprobe=...``,
        ``chunk_size=...``) override them. The saved faiss file is reused only if it was written by the installed
        faiss version for these vectors (shape, dtype, fingerprint) with the same build parameters, its sha256 matches
        the recorded one and it searches the vectors themselves (:meth:`mismatch`); otherwise the index is rebuilt from
        the embeddings (with a warning where a file was unusable). A ``label_index.json`` that is not a readable JSON
        object counts as absent. Exact kinds read no faiss file.
        """
        meta = _read_index_meta(meta_path)
        kind = kind or meta.get("kind", "exact")
        codes = codes or meta.get("codes", "float")
        if kind not in INDEX_KINDS:
            logger.warning("%s: unknown index kind %r; searching exactly", meta_path, kind)
            kind = "exact"
        if codes not in LABEL_CODES:
            logger.warning("%s: unknown label codes %r; searching the vectors", meta_path, codes)
            codes = "float"
        blocks = as_label_blocks(embeddings)
        fingerprint = vectors_fingerprint(blocks)
        same_store = (
            meta.get("kind") == kind
            and meta.get("num_labels") == sum(b.shape[0] for b in blocks)
            and meta.get("dim") == blocks[0].shape[1]
            and meta.get("dtype", "float32") == str(blocks[0].dtype).replace("torch.", "")
            and meta.get("codes", "float") == codes
            and meta.get("fingerprint", fingerprint) == fingerprint  # files from before fingerprints: checked by search below
        )
        # a parameter that is no positive integer (a hand-edited or damaged file) is left at its default
        restored = {k: meta[k] for k in (*BUILD_PARAMS, *SEARCH_PARAMS) if type(meta.get(k)) is int and meta[k] > 0}
        if meta.get("num_labels") != sum(b.shape[0] for b in blocks):
            restored.pop("ivf_nlist", None)  # sized for another label count
        if meta.get("codes", "float") != codes:
            restored.pop("rescore_factor", None)  # chosen for other codes
        params = {**restored, **params}
        saved = None
        if cls.keeps_file(kind, codes) and not same_store and index_path and os.path.exists(index_path):
            logger.warning("%s describes other label vectors than the store's (%s); rebuilding the label index", meta_path,
                           ", ".join(f"{key} {meta.get(key)!r}" for key in ("kind", "codes", "num_labels", "dim", "dtype")))
        if (
            cls.keeps_file(kind, codes)
            and same_store
            and faiss is not None
            and index_path
            and os.path.exists(index_path)
            and meta.get("faiss_version") == getattr(faiss, "__version__", None)
            and all(params[k] == meta.get(k) for k in BUILD_PARAMS if k in params and k.startswith(kind))
        ):
            if meta.get("sha256") is not None and file_sha256(index_path) != meta["sha256"]:
                logger.warning("%s does not match the sha256 recorded in %s; rebuilding the label index", index_path, INDEX_META_FILE)
            else:
                try:
                    saved = read_code_index(index_path, codes, mapped=kind == "ivf")  # IVF lists stay in the file
                except RuntimeError as err:  # a corrupt cache is rebuilt, never trusted
                    logger.warning("could not read %s (%s); rebuilding the label index", index_path, err)
        index = cls(blocks, kind=kind, use_gpu=use_gpu, codes=codes, _faiss_index=saved, **params)
        if saved is not None:
            fault = index.mismatch()
            if fault:
                logger.warning("%s does not index the label vectors it is stored with (%s); rebuilding the label index from them", index_path, fault)
                return cls(blocks, kind=kind, use_gpu=use_gpu, codes=codes, **params)
        index.restored_from_file = saved is not None
        return index

    @classmethod
    def cached(cls, embeddings: Vectors | Sequence[Vectors], directory: Optional[str], kind: str, **params) -> LabelIndex:
        """An index over ``embeddings`` kept in ``directory`` between runs: the faiss file saved there is read back when
        :meth:`load` trusts it (same vectors by shape and fingerprint, same build parameters and faiss version, sha256),
        else the index is built and saved there (atomically; one writer per directory). For work that a resumed run repeats
        (SiameseXML's Module II: two IVF builds of ~6 minutes each at 1.3M labels and 2.2M points on 2 CPU cores).
        Disk: the faiss file (``L * (d * s + 8)`` bytes for IVF, see the memory model above). ``directory=None``: built,
        not kept."""
        if directory is None:
            return cls(embeddings, kind=kind, **params)
        meta_path, index_path = os.path.join(directory, INDEX_META_FILE), os.path.join(directory, INDEX_FILE)
        params.setdefault("codes", "float")
        index = cls.load(embeddings, meta_path=meta_path, index_path=index_path, kind=kind, **params)
        if index.restored_from_file:
            logger.info("%s: the search index is read back, not built again", directory)
        elif cls.keeps_file(index.kind, index.codes):
            index.save(directory)
        return index


def _read_index_meta(meta_path: Optional[str]) -> dict:
    """``label_index.json`` as a dict; ``{}`` (the index is then built from the label vectors, with a warning) when it
    is missing, truncated, not JSON or not a JSON object: it describes a cache, so it is never a reason to refuse."""
    if not meta_path or not os.path.exists(meta_path):
        return {}
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as err:
        logger.warning("%s is not readable JSON (%s); the label index is built from the label vectors", meta_path, err)
        return {}
    if not isinstance(meta, dict):
        logger.warning("%s is not a JSON object; the label index is built from the label vectors", meta_path)
        return {}
    return meta
