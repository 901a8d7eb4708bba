"""MUFIN's label store: the label bags ``Z^1``, label vectors ``z^1``, centroids ``mu_l``, label images and the
shortlist index over them, kept on the model, saved beside its weights and read back through ``cached_file``.

* ``mufin_label_bags.safetensors``: the cached label bags ``Z^1`` (ragged: all rows + per-label offsets) and the
  label vectors ``z^1``;
* ``mufin_label_centroids.safetensors``: ``mu_l`` and the number of training positives behind each;
* ``mufin_label_images.safetensors``: the label images as their file bytes (``config.save_label_images``), so a
  reloaded model can re-encode its labels from texts and images;
* ``label_index.json`` (+ ``label_index.faiss`` for HNSW / IVF): the shortlist index, a cache rebuilt from the bags
  and centroids.

Remote-code file (``modeling_mufin.py`` imports it). Memory: ``4 D`` bytes per bag row and per label (vectors and
centroids), the label images' encoded sizes.
"""

import os
import shutil
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers.utils import logging

from .configuration_mufin import MUFINConfig
from .io_utils import atomic_write
from .label_index import INDEX_META_FILE, LabelIndex
from .model_files import ModelFileError, check_offsets, open_safetensors, read_safetensors
from .processing_mufin import LazyLabelImages, pack_label_images

logger = logging.get_logger(__name__)

LABEL_BAGS_FILE = "mufin_label_bags.safetensors"
LABEL_CENTROIDS_FILE = "mufin_label_centroids.safetensors"
LABEL_IMAGES_FILE = "mufin_label_images.safetensors"
# queries shortlisted at once: their raw index hits (3 x (100 + positives) per query, 12 bytes each, and the merge's
# copies) bound search memory, not the number of queries (Module II shortlists every training item in one call)
SHORTLIST_CHUNK = 4096


def label_centroids_from_embeddings(embeddings: Union[torch.Tensor, np.ndarray], targets: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Label centroids ``mu_l = mean{x_i^1 : y_il = 1}`` as ``Y^T X / counts`` (spec Sec. 4, Module II).

    ``embeddings``: ``(N, D)`` datapoint vectors ``x^1``; ``targets``: ``(N, L)`` scipy sparse matrix (CSR), numpy array
    or torch tensor (non-zero = positive). Returns ``(centroids (L, D) float32, counts (L,) int64)``; a label without
    positives gets a zero row and count 0 (it contributes only its bag rows to the index).
    """
    x = embeddings.detach().float().cpu().numpy() if isinstance(embeddings, torch.Tensor) else np.asarray(embeddings, dtype=np.float32)
    if hasattr(targets, "tocsr"):  # scipy sparse, without importing scipy here
        y = (targets.tocsr() != 0).astype(np.float32)
        sums = np.asarray(y.T @ x, dtype=np.float32)
        counts = np.asarray(y.sum(axis=0)).ravel()
    else:
        y = (targets.detach().cpu().numpy() if isinstance(targets, torch.Tensor) else np.asarray(targets)) != 0
        y = y.astype(np.float32)
        sums, counts = y.T @ x, y.sum(axis=0)
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"targets have {y.shape[0]} rows but there are {x.shape[0]} embeddings")
    centroids = sums / np.maximum(counts, 1.0)[:, None]
    return torch.from_numpy(np.ascontiguousarray(centroids, dtype=np.float32)), torch.from_numpy(counts.astype(np.int64))


def gather_bags(bag_rows: torch.Tensor, offsets: torch.Tensor, label_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ragged bags ``bag_rows[offsets[l]:offsets[l + 1]]`` of ``label_ids`` ``(n,)`` as padded bags ``(n, m, D)`` +
    mask (m = the longest of them)."""
    label_ids = label_ids.cpu().long()
    start = offsets[label_ids]
    count = offsets[label_ids + 1] - start
    width = int(count.max()) if label_ids.numel() else 1
    slots = torch.arange(width)
    mask = slots.unsqueeze(0) < count.unsqueeze(1)
    rows = (start.unsqueeze(1) + slots.unsqueeze(0)).clamp(max=bag_rows.shape[0] - 1)
    return bag_rows[rows] * mask.unsqueeze(-1), mask


def open_label_images(path: str) -> LazyLabelImages:
    """The label images of ``path`` as a :class:`LazyLabelImages` view: only the offsets are read (checked against the
    bytes they slice); the images stay in the file until used."""
    with open_safetensors(path, keys=("image_bytes", "image_offsets", "label_image_offsets")) as f:
        num_bytes = int(np.prod(f.get_slice("image_bytes").get_shape()))
        image_offsets, label_offsets = f.get_tensor("image_offsets").numpy(), f.get_tensor("label_image_offsets").numpy()
    check_offsets(path, image_offsets, len(image_offsets) - 1, num_bytes, "image_offsets")
    check_offsets(path, label_offsets, len(label_offsets) - 1, len(image_offsets) - 1, "label_image_offsets")
    return LazyLabelImages(path, image_offsets, label_offsets)


def has_images(bags: Sequence[Sequence[Any]]) -> bool:
    """Whether any bag holds an image (a lazy view answers from its offsets, without reading an image)."""
    return bool(bags.counts().any()) if isinstance(bags, LazyLabelImages) else any(bags)


class MUFINLabelStoreMixin:
    """The label store of :class:`~.modeling_mufin.MUFINModel` (mixed in before its base class, so these methods
    override :class:`~.modeling_xmc.XMCPreTrainedModel`'s and reach them through ``super()``).

    It relies on the model for ``config``, the label texts and uids of the base class, ``encode_items`` (texts and/or
    images -> ``x^1`` and the ``X^1`` bags) and ``_normalize_items`` (items as text + image bag pairs).
    """

    config: MUFINConfig
    label_images: Optional[list[list[Any]]]
    label_images_missing: bool
    label_bag_rows: Optional[torch.Tensor]
    label_bag_offsets: Optional[torch.Tensor]
    label_vectors: Optional[torch.Tensor]
    label_centroids: Optional[torch.Tensor]
    label_centroid_counts: Optional[torch.Tensor]
    shortlist_row_labels: Optional[torch.Tensor]
    ranker_label_cache: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # Module IV's (bag rows, offsets, z^1)

    def set_labels(self, texts: Optional[Sequence[Optional[str]]], uids: Optional[Sequence[str]] = None, images: Optional[Sequence[Any]] = None) -> None:
        """Attach the label space: a text (``None`` or blank = none) and/or a bag of images per label, in label-id
        order. Drops the cached bags and index (and Module IV's ranker label cache, unless the same labels come again:
        the training stage's trainer attaches the labels it was given once more).

        A model with classifiers for ``label_space_size`` labels takes those labels first, in their training order;
        labels after them (added without retraining) are scored zero-shot (``w_l = z_l^1``) in the same index.
        Centroids are kept when the label count is unchanged, extended with empty rows (count 0) for appended labels,
        and dropped otherwise."""
        if texts is None and images is None:
            raise ValueError("labels need texts and/or images")
        n = len(texts) if texts is not None else len(images)
        known = self.config.label_space_size
        if not self.config.zero_shot and n < known:
            raise ValueError(
                f"this MUFIN model has classifiers for {known} labels (label_space_size) but got {n} labels: give its "
                f"{known} labels in training order, then any new ones (scored zero-shot), or use zero_shot=True"
            )
        if not self.config.zero_shot and n > known:
            logger.info("%d labels after the %d with classifiers are scored zero-shot (w_l = z_l^1)", n - known, known)
        norm_texts, bags = self._normalize_items(texts, images)  # validates: every label needs a descriptor
        texts = ["" if t is None else t for t in norm_texts]
        if self.ranker_label_cache is not None:  # Module IV's cache is of the labels it was encoded from
            current = self.label_images if self.label_images is not None else [[] for _ in texts]
            same_images = bags is current or (isinstance(bags, list) and isinstance(current, list) and bags == current)
            if texts != self.label_texts or not same_images:
                self.ranker_label_cache = None
        super().set_labels(texts, uids)
        self.label_images = bags if has_images(bags) else None
        self.label_images_missing = False
        rows = self.label_centroids.shape[0] if self.label_centroids is not None else n
        if rows < n:
            self._extend_centroids(n - rows)
        elif rows > n:
            self.label_centroids = self.label_centroid_counts = None

    def _extend_centroids(self, count: int) -> None:
        """Zero centroids (count 0) for ``count`` appended labels: they have no training positives."""
        self.label_centroids = torch.cat([self.label_centroids, self.label_centroids.new_zeros(count, self.label_centroids.shape[1])])
        self.label_centroid_counts = torch.cat([self.label_centroid_counts, self.label_centroid_counts.new_zeros(count)])

    @torch.no_grad()
    def add_labels(
        self,
        texts: Optional[Sequence[Optional[str]]] = None,
        uids: Optional[Sequence[str]] = None,
        batch_size: int = 64,
        show_progress_bar: Optional[bool] = None,
        images: Optional[Sequence[Any]] = None,
    ) -> np.ndarray:
        """Append labels (texts and/or image bags), scored zero-shot (``w_l = z_l^1``, no centroid: the rule of labels
        after ``label_space_size``) while trained labels keep their classifiers. Only the new bags are encoded and
        appended to the cached label store; the shortlist index is rebuilt from the cache (no re-encoding); a lexical
        channel gets the new labels' text rows (its ranker does not know them: text and dense scores only). Saved label
        images a loaded model reads lazily stay on disk (the new bags follow them in memory). Returns the new label
        ids. Memory: the new labels' bag rows, vectors and images."""
        self._require_label_store()
        norm_texts, bags = self._normalize_items(texts, images)
        first = len(self.label_texts)
        uids = self._new_label_uids(len(norm_texts), uids)
        vectors, new_bags = self.encode_items(norm_texts, bags, batch_size, show_progress_bar, return_bags=True)
        counts = torch.tensor([b.shape[0] for b in new_bags])
        self.label_bag_rows = torch.cat([self.label_bag_rows, *new_bags]).contiguous()
        self.label_bag_offsets = torch.cat([self.label_bag_offsets, self.label_bag_offsets[-1] + torch.cumsum(counts, 0)])
        self.label_vectors = torch.cat([self.label_vectors, vectors.to(self.label_vectors)]).contiguous()
        if isinstance(self.label_images, LazyLabelImages):  # saved label images stay on disk: the new bags follow them
            self.label_images = self.label_images.extended(list(bags))
        elif has_images(bags) or self.label_images is not None:
            self.label_images = list(self.label_images or [[] for _ in range(first)]) + [list(b) for b in bags]
        new_texts = ["" if t is None else t for t in norm_texts]
        self.label_texts = list(self.label_texts) + new_texts
        self.label_uids = list(self.label_uids) + uids
        if self.lexical_channel is not None:  # its label rows follow (the ranker does not know the new labels)
            self.lexical_channel.add_labels(new_texts)
            self._sync_lexical_channel_labels()
        if self.label_centroids is not None:
            self._extend_centroids(len(norm_texts))
        self.build_shortlist_index()
        return np.arange(first, len(self.label_texts), dtype=np.int64)

    @torch.no_grad()
    def remove_labels(self, uids: Sequence[str]) -> np.ndarray:
        """Remove labels added after training (ids >= ``label_space_size``; MUFIN's classifiers are laid out by training
        order, so trained labels stay); a lexical channel keeps the kept labels' text rows, renumbered with them.
        Returns the old ids of the kept labels."""
        self._require_label_store()
        keep = self._kept_label_ids(uids)
        gone = np.setdiff1d(np.arange(len(self.label_uids)), keep)
        if gone.size and gone[0] < self.config.label_space_size:
            raise ValueError(f"label {self.label_uids[gone[0]]!r} has a trained classifier: MUFIN removes only labels added after training")
        rows = torch.from_numpy(keep)
        starts, ends = self.label_bag_offsets[rows], self.label_bag_offsets[rows + 1]
        self.label_bag_rows = torch.cat([self.label_bag_rows[a:b] for a, b in zip(starts.tolist(), ends.tolist())]).contiguous()
        self.label_bag_offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(ends - starts, 0)])
        self.label_vectors = self.label_vectors[rows].contiguous()
        if isinstance(self.label_images, LazyLabelImages):
            self.label_images = self.label_images.select(keep)
        elif self.label_images is not None:
            self.label_images = [self.label_images[i] for i in keep]
        self.label_texts = [self.label_texts[i] for i in keep]
        self.label_uids = [self.label_uids[i] for i in keep]
        if self.lexical_channel is not None:  # its label rows (and the ranker's label map) renumbered as the labels
            self.lexical_channel.select_labels(keep)
            self._sync_lexical_channel_labels()
        if self.label_centroids is not None:
            self.label_centroids, self.label_centroid_counts = self.label_centroids[rows], self.label_centroid_counts[rows]
        self.build_shortlist_index()
        return keep

    def invalidate_label_index(self) -> None:
        """Forget the label bags, vectors and index (they no longer match the weights). Centroids are kept: they come
        from training points and are refreshed with :meth:`compute_label_centroids`."""
        super().invalidate_label_index()
        self.label_bag_rows = self.label_bag_offsets = self.label_vectors = None

    @torch.no_grad()
    def build_label_index(
        self,
        label_texts: Optional[Sequence[Optional[str]]] = None,
        label_uids: Optional[Sequence[str]] = None,
        kind: Optional[str] = None,
        batch_size: int = 64,
        show_progress_bar: Optional[bool] = None,
        label_images: Optional[Sequence[Any]] = None,
    ) -> LabelIndex:
        """Encode every label bag with the current weights (``Z_l^1`` and ``z_l^1``, cached) and build the shortlist
        index over them and the centroids. Without arguments, re-encodes the labels already attached: their texts and
        images (a loaded model has the images it was saved with, ``config.save_label_images``). Passing the attached
        label texts again without ``label_images`` keeps the attached images (an evaluator that only knows the label
        texts re-indexes the full multi-modal labels). A loaded model whose labels had images that were not saved
        refuses to re-encode them as text only: give ``label_images`` again."""
        same = (
            label_texts is not None and label_images is None and self.label_texts is not None
            and [t if isinstance(t, str) and t.strip() else "" for t in label_texts] == self.label_texts
        )
        if (same or (label_texts is None and label_images is None)) and self.label_images_missing:
            raise ValueError(
                "the labels of this model had images, which were not saved with it (save_label_images=False): re-encoding "
                "them needs the images again, build_label_index(label_texts, label_images=[...]) (label_images=[[]] * n "
                "re-encodes them as text only)"
            )
        if label_texts is not None or label_images is not None:
            self.set_labels(label_texts, label_uids, self.label_images if same else label_images)
        self.encode_label_bags(batch_size, show_progress_bar)
        return self.build_shortlist_index(kind)

    @torch.no_grad()
    def encode_label_bags(self, batch_size: int = 64, show_progress_bar: Optional[bool] = None) -> None:
        """Encode the attached labels' bags with the current weights (eval mode) into the store: ``Z_l^1`` (ragged
        rows + offsets) and ``z_l^1``; the shortlist index is dropped (rebuilt on next use). Memory: ``4 D`` bytes per
        bag row and per label."""
        self.label_bag_rows, self.label_bag_offsets, self.label_vectors = self._encode_label_bags(batch_size, show_progress_bar)
        self.label_index = None

    def _encode_label_bags(self, batch_size: int, show_progress_bar: Optional[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(bag rows, offsets, vectors)`` of every attached label with the current weights."""
        texts = self._require_labels()
        vectors, bags = self.encode_items(texts, self.label_images, batch_size, show_progress_bar, return_bags=True)
        counts = torch.tensor([b.shape[0] for b in bags])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(counts, 0)])
        return torch.cat(bags).contiguous(), offsets, vectors.contiguous()

    @torch.no_grad()
    def cache_ranker_labels(self, batch_size: int = 64, show_progress_bar: Optional[bool] = None, reuse_store: bool = False) -> None:
        """Fill Module IV's cached label side (:attr:`ranker_label_cache`, what ``forward`` reads when a ranker batch
        carries the pool's ids without its bags): every label bag encoded with the current weights, or with
        ``reuse_store`` the label store's bags as they are, when it has them (Module II just encoded them). Unlike the
        store, the cache survives weight updates: it is stale on purpose until the next call. Memory: ``4 D`` bytes per
        bag row and per label (shared with the store until either is re-encoded)."""
        if reuse_store and self.label_vectors is not None:
            self.ranker_label_cache = (self.label_bag_rows, self.label_bag_offsets, self.label_vectors)
        else:
            self.ranker_label_cache = self._encode_label_bags(batch_size, show_progress_bar)

    def _reindex_labels(self) -> None:
        """The shortlist index again over the cached label bags and centroids (``set_label_precision``)."""
        if self.label_vectors is not None:
            self.build_shortlist_index()

    def _require_label_store(self) -> None:
        self._require_labels()
        if self.label_vectors is None:
            self.build_label_index()

    def label_bags(self, label_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached ``Z^1`` of ``label_ids`` ``(n,)`` as padded bags ``(n, m, D)`` + mask (m = the longest of them)."""
        return gather_bags(self.label_bag_rows, self.label_bag_offsets, label_ids)

    def shortlist_blocks(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The shortlist index rows as unit-vector row blocks, and the label id of each row.

        ``shortlist_index="bag"``: every row of every ``Z_l^1`` plus ``mu_l`` for labels with training positives, i.e.
        ``sum_l (m_l + 1)`` rows (``m_l`` for labels without positives); ``"vector"``: one ``z_l^1`` per label. The
        index searches the blocks as they are: ``4 D`` bytes per row once, where one concatenated copy held them twice
        while it was built (4 GB more at 1.3M labels with text-only bags).
        """
        num_labels = self.label_vectors.shape[0]
        if self.config.shortlist_index == "vector":
            return [_unit_rows(self.label_vectors.float().clone())], torch.arange(num_labels)
        counts = self.label_bag_offsets[1:] - self.label_bag_offsets[:-1]
        blocks = [_unit_rows(self.label_bag_rows.float().clone())]
        owners = [torch.repeat_interleave(torch.arange(num_labels), counts)]
        if self.label_centroids is not None:
            has = (self.label_centroid_counts > 0).nonzero().squeeze(1)
            if len(has):
                blocks.append(_unit_rows(self.label_centroids[has].float()))
                owners.append(has)
        return blocks, torch.cat(owners)

    def shortlist_vectors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The shortlist index rows (unit vectors, :meth:`shortlist_blocks` in one tensor) and the label id of each."""
        blocks, owners = self.shortlist_blocks()
        return (blocks[0] if len(blocks) == 1 else torch.cat(blocks)), owners

    def build_shortlist_index(self, kind: Optional[str] = None) -> LabelIndex:
        """(Re)build the shortlist index from the cached label bags and centroids (no encoding)."""
        if self.label_vectors is None:
            raise ValueError("no label bags are cached: call build_label_index(label_texts, label_images=...) first")
        blocks, self.shortlist_row_labels = self.shortlist_blocks()
        self.label_index = LabelIndex(blocks, **self.config.index_params(kind))
        return self.label_index

    def _require_shortlist_index(self) -> LabelIndex:
        self._require_label_store()
        if self.label_index is None:
            self.build_shortlist_index()
        return self.label_index

    def ensure_label_index(self) -> LabelIndex:
        """The shortlist index (over the cached label bags and centroids; the labels encoded first if none are)."""
        return self._require_shortlist_index()

    def set_label_centroids(self, centroids: torch.Tensor, counts: Optional[torch.Tensor] = None) -> None:
        """Set ``mu_l`` (``(L, D)``) and the number of training positives behind each (``(L,)``; default: non-zero rows
        count as 1). Labels with count 0 add no centroid to the index. The index is rebuilt on next use."""
        centroids = torch.as_tensor(centroids).detach().float().cpu().contiguous()
        num_labels = len(self.label_texts) if self.label_texts is not None else self.config.label_space_size
        if centroids.ndim != 2 or centroids.shape[1] != self.config.embed_dim or (num_labels and centroids.shape[0] != num_labels):
            raise ValueError(f"centroids must have shape ({num_labels}, {self.config.embed_dim}), got {tuple(centroids.shape)}")
        counts = (centroids.abs().sum(dim=1) > 0).long() if counts is None else torch.as_tensor(counts).long().cpu()
        if counts.shape != (centroids.shape[0],):
            raise ValueError(f"counts must have shape ({centroids.shape[0]},), got {tuple(counts.shape)}")
        self.label_centroids, self.label_centroid_counts = centroids, counts
        self.label_index = None

    def compute_label_centroids(self, texts=None, images=None, targets=None, batch_size: int = 64, show_progress_bar: Optional[bool] = None) -> torch.Tensor:
        """``mu_l = mean{x_i^1 : y_il = 1}`` over training items (texts and/or images, ``targets`` ``(N, L)`` sparse or
        dense), encoded with the current weights; sets them (:meth:`set_label_centroids`) and returns them."""
        if targets is None:
            raise ValueError("compute_label_centroids needs the training targets (N x L)")
        vectors = self.encode_items(texts, images, batch_size, show_progress_bar)
        centroids, counts = label_centroids_from_embeddings(vectors, targets)
        self.set_label_centroids(centroids, counts)
        return centroids

    @torch.no_grad()
    def shortlist(
        self, query_vectors: Union[torch.Tensor, np.ndarray], size: Optional[int] = None, exclude: Optional[Any] = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``R_t`` and ``a_tl`` for query vectors ``x^1``: one index query each, ``shortlist_fetch_factor * size`` raw
        hits collapsed to at most ``size`` unique labels scored by their best row. Returns ``(label_ids, scores)``,
        ``(n, size)`` int64 / float32, best first, ``-1`` / ``-inf`` padded.

        ``exclude``: an ``(n, L)`` scipy CSR matrix of labels left out per query (Module II: the item's positives),
        dropped chunk by chunk from ``size`` + (most labels excluded in a row) unique labels, then ``size`` kept: what
        filtering a wider result would give, without it (at 2.2M items and up to 43 positives, that wider result
        and its filtering held ~12 GB).

        Searched ``SHORTLIST_CHUNK`` queries at a time: memory is the ``12 size`` bytes per query of the result plus
        ``12 shortlist_fetch_factor size`` bytes per query of one chunk's raw hits (Module II's 586K training items at
        MM-AmazonTitles-300K's shape: 0.8 GB of result, 17 MB of hits, where one call held 2.4 GB of hits)."""
        size = size or self.config.shortlist_size
        index = self._require_shortlist_index()
        extra = int(np.diff(exclude.indptr).max()) if exclude is not None and exclude.shape[0] else 0
        fetch = min(self.config.shortlist_fetch_factor * (size + extra), index.num_labels)
        row_labels = self.shortlist_row_labels.numpy()
        n = len(query_vectors)
        if exclude is not None and exclude.shape[0] != n:
            raise ValueError(f"exclude has {exclude.shape[0]} rows for {n} queries")
        ids = np.full((n, size), -1, dtype=np.int64)
        scores = np.full((n, size), -np.inf, dtype=np.float32)
        for start in range(0, n, SHORTLIST_CHUNK):
            queries = F.normalize(torch.as_tensor(query_vectors[start : start + SHORTLIST_CHUNK]).float(), dim=-1)
            raw_scores, raw_rows = index.search(queries, fetch)
            for j in range(queries.shape[0]):
                valid = raw_rows[j] >= 0
                labels, row_scores = row_labels[raw_rows[j][valid]], raw_scores[j][valid]
                _, first = np.unique(labels, return_index=True)  # hits are sorted: a label's first hit is its max
                first = np.sort(first)[: size + extra]
                if extra:
                    left_out = exclude.indices[exclude.indptr[start + j] : exclude.indptr[start + j + 1]]
                    first = first[~np.isin(labels[first], left_out)]
                first = first[:size]
                ids[start + j, : first.size], scores[start + j, : first.size] = labels[first], row_scores[first]
        return ids, scores

    def _save_label_store(self, save_directory: str) -> None:
        """Write the cached label bags, the label images (``config.save_label_images``), the centroids and the shortlist
        index into ``save_directory``."""
        if self.label_vectors is not None:
            tensors = {"label_bag_rows": self.label_bag_rows, "label_bag_offsets": self.label_bag_offsets, "label_vectors": self.label_vectors}
            tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
            atomic_write(os.path.join(save_directory, LABEL_BAGS_FILE), lambda p: save_file(tensors, p, metadata={"format": "pt"}))
        if self.label_images is not None and self.config.save_label_images:
            target = os.path.join(save_directory, LABEL_IMAGES_FILE)
            lazy = self.label_images if isinstance(self.label_images, LazyLabelImages) else None
            if lazy is not None and lazy.whole_file:  # the loaded file as it is: copied, never read in whole
                if os.path.abspath(lazy.path) != os.path.abspath(target):
                    atomic_write(target, lambda p: shutil.copyfile(lazy.path, p))
            else:  # a selection of it is packed anew (read a few hundred labels at a time)
                images = pack_label_images(self.label_images)
                atomic_write(target, lambda p: save_file(images, p, metadata={"format": "pt"}))
        if self.label_centroids is not None:
            tensors = {"label_centroids": self.label_centroids.contiguous(), "label_centroid_counts": self.label_centroid_counts.contiguous()}
            atomic_write(os.path.join(save_directory, LABEL_CENTROIDS_FILE), lambda p: save_file(tensors, p, metadata={"format": "pt"}))
        if self.label_vectors is not None:
            self._require_shortlist_index().save(save_directory)

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        """``XMCPreTrainedModel.save_pretrained``, safe for label images read lazily from ``save_directory`` itself (a
        model saved into the directory it was loaded from): the save replaces that file, so the view moves to the new
        one afterwards (it holds exactly the view's bags, in its order: ``config.save_label_images``), or the bags are
        read into memory first when the save writes no image file (the old one then goes). Either way no image is
        ever read through offsets of a file that was replaced. Memory: the label images' encoded bytes, only in the
        second case."""
        lazy = self.label_images if isinstance(self.label_images, LazyLabelImages) else None
        target = os.path.join(os.path.realpath(str(save_directory)), LABEL_IMAGES_FILE)
        over = lazy is not None and kwargs.get("is_main_process", True) and lazy.reads_from(target)
        if over and not self.config.save_label_images:
            self.label_images = [list(bag) for bag in lazy]
        super().save_pretrained(save_directory, *args, **kwargs)
        if over and self.config.save_label_images:
            self.label_images = open_label_images(target)

    def _load_label_store(self, fetch: Callable[[str], Optional[str]]) -> None:
        """Read the centroids, label bags and label images that ``fetch(name)`` (a local path or ``None``) finds, check
        them against the label texts, and load the shortlist index (its faiss file reused when it still matches)."""
        centroids_path = fetch(LABEL_CENTROIDS_FILE)
        if centroids_path is not None:
            saved = read_safetensors(centroids_path, keys=("label_centroids", "label_centroid_counts"))
            self.label_centroids, self.label_centroid_counts = saved["label_centroids"], saved["label_centroid_counts"]
        bags_path = fetch(LABEL_BAGS_FILE)
        if bags_path is not None:
            saved = read_safetensors(bags_path, keys=("label_bag_rows", "label_bag_offsets", "label_vectors"))
            num_labels = saved["label_vectors"].shape[0]
            if self.label_texts is not None and num_labels != len(self.label_texts):
                raise ModelFileError(f"{bags_path}: holds {num_labels} label bags but labels.jsonl lists {len(self.label_texts)} labels")
            check_offsets(bags_path, saved["label_bag_offsets"].numpy(), num_labels, saved["label_bag_rows"].shape[0], "label_bag_offsets")
            if saved["label_bag_rows"].ndim != 2 or saved["label_vectors"].ndim != 2 or saved["label_bag_rows"].shape[1] != saved["label_vectors"].shape[1]:
                raise ModelFileError(
                    f"{bags_path}: label_bag_rows {list(saved['label_bag_rows'].shape)} and label_vectors {list(saved['label_vectors'].shape)} "
                    "are not (rows, dim) tensors of one width"
                )
            self.label_bag_rows, self.label_bag_offsets, self.label_vectors = saved["label_bag_rows"], saved["label_bag_offsets"], saved["label_vectors"]
            self._label_store_path = bags_path
        images_path = fetch(LABEL_IMAGES_FILE)
        if images_path is not None:
            images = open_label_images(images_path)
            if self.label_texts is not None and len(images) != len(self.label_texts):
                raise ModelFileError(f"{images_path}: holds images of {len(images)} labels but labels.jsonl lists {len(self.label_texts)} labels")
            self.label_images = images if has_images(images) else None
        elif self.label_bag_offsets is not None and self.label_texts is not None:
            # rows of a label's bag beyond its text are images: had the labels any, re-encoding them needs them back
            text_rows = torch.tensor([1 if t else 0 for t in self.label_texts])
            self.label_images_missing = bool(((self.label_bag_offsets[1:] - self.label_bag_offsets[:-1]) > text_rows).any())
        if bags_path is not None:
            blocks, self.shortlist_row_labels = self.shortlist_blocks()
            # the saved faiss file is reused when it matches these rows and the installed faiss, else rebuilt
            self.label_index = LabelIndex.load(blocks, meta_path=fetch(INDEX_META_FILE), index_path=self._saved_index_path(fetch),
                                               kind=self.config.index_kind, codes=self.config.label_codes)


def _unit_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` scaled to unit norm in place (``F.normalize``'s result without its copy)."""
    return rows.div_(rows.norm(dim=-1, keepdim=True).clamp_min(1e-12))


__all__ = ["LABEL_BAGS_FILE", "LABEL_CENTROIDS_FILE", "LABEL_IMAGES_FILE", "MUFINLabelStoreMixin", "label_centroids_from_embeddings"]
