"""LabelIndex: maximum-inner-product search over label vectors.

Backends
--------
* ``"exact"``  faiss ``IndexFlatIP`` (exact; moved to every visible GPU when a faiss GPU build and a GPU
  are present).
* ``"hnsw"``   faiss ``IndexHNSWFlat`` with inner-product metric (approximate, CPU only in faiss).
* ``"torch"``  exact chunked ``torch.topk`` over label blocks; the fallback when faiss is not installed
  and the test oracle for the others.

The label vectors are the source of truth; the faiss file written by :meth:`LabelIndex.save` is a cache
that is rebuilt whenever it is missing or was written by another faiss version.

This file is part of the remote-code bundle of every hf_xmc model: it imports only numpy, torch and
(optionally) faiss.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Optional

import numpy as np
import torch

try:  # faiss is optional: the torch backend covers exact search without it
    import faiss
except ImportError:  # pragma: no cover - exercised in environments without faiss
    faiss = None

logger = logging.getLogger(__name__)

INDEX_KINDS = ("exact", "hnsw", "torch")
INDEX_FILE = "label_index.faiss"
INDEX_META_FILE = "label_index.json"


def faiss_available() -> bool:
    """True when the faiss package can be imported."""
    return faiss is not None


def faiss_gpu_available() -> bool:
    """True when faiss was built with GPU support and sees at least one GPU."""
    return faiss is not None and hasattr(faiss, "get_num_gpus") and faiss.get_num_gpus() > 0


class LabelIndex:
    """Inner-product top-k search over a fixed set of label vectors.

    Args:
        embeddings: ``(num_labels, dim)`` float array of label vectors.
        kind: ``"exact"``, ``"hnsw"`` or ``"torch"``. Faiss kinds fall back to ``"torch"`` (exact) with a
            warning when faiss is not installed.
        use_gpu: put a faiss ``exact`` index (or torch search) on GPU; ``None`` means "when available".
        hnsw_m: HNSW graph degree (faiss ``M``).
        hnsw_ef_construction / hnsw_ef_search: HNSW build and query beam widths.
        chunk_size: number of labels scored at once by the torch backend (bounds memory to
            ``batch x chunk_size`` scores).

    Example:
        >>> index = LabelIndex(np.random.randn(1000, 32).astype("float32"), kind="exact")
        >>> scores, ids = index.search(np.random.randn(4, 32).astype("float32"), k=5)
    """

    def __init__(
        self,
        embeddings: np.ndarray | torch.Tensor,
        kind: str = "exact",
        use_gpu: Optional[bool] = None,
        hnsw_m: int = 32,
        hnsw_ef_construction: int = 200,
        hnsw_ef_search: int = 128,
        chunk_size: int = 65536,
        _faiss_index=None,
    ):
        if kind not in INDEX_KINDS:
            raise ValueError(f"unknown index kind {kind!r}; choose one of {INDEX_KINDS}")
        if isinstance(embeddings, torch.Tensor):
            embeddings = embeddings.detach().float().cpu().numpy()
        embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
        if embeddings.ndim != 2 or embeddings.shape[0] == 0:
            raise ValueError(f"label embeddings must be a non-empty 2-D array, got shape {embeddings.shape}")
        if kind != "torch" and faiss is None:
            logger.warning("faiss is not installed: LabelIndex(kind=%r) falls back to exact torch search", kind)
            kind = "torch"
        self.kind = kind
        self.embeddings = embeddings
        self.hnsw_m = hnsw_m
        self.hnsw_ef_construction = hnsw_ef_construction
        self.hnsw_ef_search = hnsw_ef_search
        self.chunk_size = chunk_size
        self.use_gpu = (torch.cuda.is_available() if kind == "torch" else faiss_gpu_available()) if use_gpu is None else use_gpu
        self._index = _faiss_index
        if self.kind != "torch" and self._index is None:
            self._index = self._build_faiss()
        self._gpu_index = None
        self._torch_labels: Optional[torch.Tensor] = None

    @property
    def num_labels(self) -> int:
        """Number of indexed labels."""
        return self.embeddings.shape[0]

    @property
    def dim(self) -> int:
        """Dimension of the label vectors."""
        return self.embeddings.shape[1]

    def _build_faiss(self):
        d = self.dim
        if self.kind == "exact":
            index = faiss.IndexFlatIP(d)
        else:
            index = faiss.IndexHNSWFlat(d, self.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efConstruction = self.hnsw_ef_construction
        index.add(self.embeddings)
        return index

    def _search_index(self):
        """The index to query: a GPU copy of an exact index when asked for and possible."""
        if self.kind == "exact" and self.use_gpu and faiss_gpu_available():
            if self._gpu_index is None:
                self._gpu_index = faiss.index_cpu_to_all_gpus(self._index)
            return self._gpu_index
        if self.kind == "hnsw":
            self._index.hnsw.efSearch = max(self.hnsw_ef_search, 1)
        return self._index

    def search(self, queries: np.ndarray | torch.Tensor, k: int = 10, batch_size: int = 4096) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` labels per query by inner product, best first.

        Returns ``(scores, ids)``: float32 and int64 arrays of shape ``(num_queries, k)``. When ``k``
        exceeds the number of labels, the missing slots hold id ``-1`` and score ``-inf``.
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
            if self.kind == "torch":
                s, i = self._torch_search(q, kk)
            else:
                s, i = self._search_index().search(q, kk)
                s = np.where(i < 0, -np.inf, s)  # HNSW may return fewer than k hits
            scores[start : start + len(q), :kk] = s
            ids[start : start + len(q), :kk] = i
        return scores, ids

    def _torch_search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        device = torch.device("cuda") if self.use_gpu and torch.cuda.is_available() else torch.device("cpu")
        if self._torch_labels is None or self._torch_labels.device != device:
            self._torch_labels = torch.from_numpy(self.embeddings).to(device)
        labels = self._torch_labels
        q = torch.from_numpy(queries).to(device)
        best_s = torch.full((q.shape[0], k), -float("inf"), device=device)
        best_i = torch.full((q.shape[0], k), -1, dtype=torch.long, device=device)
        for start in range(0, labels.shape[0], self.chunk_size):
            block = q @ labels[start : start + self.chunk_size].T
            s, i = torch.topk(block, min(k, block.shape[1]), dim=1)
            merged_s = torch.cat([best_s, s], dim=1)
            merged_i = torch.cat([best_i, i + start], dim=1)
            best_s, order = torch.topk(merged_s, k, dim=1)
            best_i = torch.gather(merged_i, 1, order)
        return best_s.cpu().numpy(), best_i.cpu().numpy()

    def save(self, directory: str) -> None:
        """Write the faiss index (if any) and its metadata atomically into ``directory``."""
        os.makedirs(directory, exist_ok=True)
        meta = {
            "kind": self.kind,
            "num_labels": self.num_labels,
            "dim": self.dim,
            "hnsw_m": self.hnsw_m,
            "hnsw_ef_construction": self.hnsw_ef_construction,
            "hnsw_ef_search": self.hnsw_ef_search,
            "faiss_version": getattr(faiss, "__version__", None) if faiss is not None else None,
        }
        if self.kind != "torch":
            atomic_write(os.path.join(directory, INDEX_FILE), lambda p: faiss.write_index(self._index, p))
        atomic_write(os.path.join(directory, INDEX_META_FILE), lambda p: _write_json(p, meta))

    @classmethod
    def load(
        cls,
        embeddings: np.ndarray | torch.Tensor,
        meta_path: Optional[str] = None,
        index_path: Optional[str] = None,
        kind: Optional[str] = None,
        use_gpu: Optional[bool] = None,
    ) -> LabelIndex:
        """Restore an index for ``embeddings`` from saved files, rebuilding it when they are stale.

        ``meta_path`` / ``index_path`` are local paths to the files written by :meth:`save` (either may be
        ``None``). The saved faiss file is reused only if it matches the embeddings' shape and was written
        by the installed faiss version; otherwise the index is rebuilt from the embeddings.
        """
        meta = {}
        if meta_path and os.path.exists(meta_path):
            with open(meta_path, encoding="utf-8") as f:
                meta = json.load(f)
        kind = kind or meta.get("kind", "exact")
        params = {k: meta[k] for k in ("hnsw_m", "hnsw_ef_construction", "hnsw_ef_search") if k in meta}
        emb = embeddings.detach().float().cpu().numpy() if isinstance(embeddings, torch.Tensor) else embeddings
        saved = None
        if (
            kind != "torch"
            and faiss is not None
            and index_path
            and os.path.exists(index_path)
            and meta.get("kind") == kind
            and meta.get("faiss_version") == getattr(faiss, "__version__", None)
            and meta.get("num_labels") == emb.shape[0]
            and meta.get("dim") == emb.shape[1]
        ):
            try:
                saved = faiss.read_index(index_path)
            except RuntimeError as err:  # a corrupt cache is rebuilt, never trusted
                logger.warning("could not read %s (%s); rebuilding the label index", index_path, err)
        return cls(emb, kind=kind, use_gpu=use_gpu, _faiss_index=saved, **params)


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)


def atomic_write(path: str, write_fn) -> None:
    """Write through ``write_fn(tmp_path)`` into a temp file beside ``path`` and rename it into place."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=directory)
    os.close(fd)
    try:
        write_fn(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
