"""Bridge between :class:`~hf_xmc.data.xc_raw.XMCDataset` and Hugging Face ``datasets``.

``datasets`` (and ``pyarrow``) are imported lazily inside the functions, so importing
:mod:`hf_xmc.data` stays cheap. The label lists are moved through Arrow list arrays built directly
from the CSR ``indptr``/``indices`` buffers, without per-row Python lists. Multimodal datasets carry an
``images`` column (a list of image paths per row) when :attr:`XMCDataset.images` is set.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import scipy.sparse as sp

from .xc_raw import XMCDataset

if TYPE_CHECKING:  # pragma: no cover
    import datasets

__all__ = ["to_hf_dataset", "from_hf_dataset", "labels_to_hf_dataset"]


def _in_memory_dataset(table: Any) -> datasets.Dataset:
    """Wrap a ``pyarrow.Table`` as an in-memory ``datasets.Dataset`` (features follow the Arrow schema)."""
    import datasets
    from datasets.table import InMemoryTable

    return datasets.Dataset(InMemoryTable(table))


def _images_array(images: Sequence[Sequence[str]]) -> Any:
    """Arrow ``list<string>`` array of per-row image paths (PIL images cannot go in a path column)."""
    import pyarrow as pa

    for i, item in enumerate(images):
        if isinstance(item, (str, bytes)) or not isinstance(item, Sequence):
            raise TypeError(f"images[{i}] must be a list of image paths, got {type(item).__name__}")
        for entry in item:
            if not isinstance(entry, str):
                raise TypeError(f"images[{i}] holds a {type(entry).__name__}: only image paths go into the "
                                f"'images' column (save PIL images to files first)")
    return pa.array([list(item) for item in images], type=pa.list_(pa.string()))


def _images_from_column(col: Any, column: str) -> list[list[str]]:
    """Per-row image paths from a ``list<string>`` column or a ``Sequence(Image())`` column (its paths)."""
    import pyarrow as pa

    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        raise ValueError(f"column {column!r} must hold lists of image paths, got type {col.type}")
    value_type = col.type.value_type
    if pa.types.is_struct(value_type) and value_type.get_field_index("path") >= 0:
        # datasets' Image feature stores {bytes, path}; only the path fits the paths-per-item contract
        rows = [[None if v is None else v["path"] for v in row] if row is not None else None
                for row in col.to_pylist()]
    elif pa.types.is_string(value_type) or pa.types.is_large_string(value_type):
        rows = col.to_pylist()
    else:
        raise ValueError(f"column {column!r} must hold lists of image paths, got type {col.type}")
    out = []
    for i, row in enumerate(rows):
        if row is None:
            out.append([])  # a null list = no image
            continue
        for entry in row:
            if not isinstance(entry, str) or not entry:
                raise ValueError(f"row {i}: column {column!r} holds an image without a path")
        out.append(row)
    return out


def to_hf_dataset(ds: XMCDataset) -> datasets.Dataset:
    """Convert an :class:`XMCDataset` to a ``datasets.Dataset`` with columns ``uid``, ``text``, ``labels``.

    A multimodal dataset (``ds.images`` set) gets a fourth column ``images`` (list of path strings).
    """
    import pyarrow as pa

    t = sp.csr_matrix(ds.targets)
    t.sort_indices()
    if t.shape[1] > np.iinfo(np.int32).max or t.nnz > np.iinfo(np.int32).max:
        raise ValueError("label ids and the number of (point, label) pairs must fit in int32")
    labels = pa.ListArray.from_arrays(pa.array(t.indptr.astype(np.int32)), pa.array(t.indices.astype(np.int32)))
    columns = {"uid": pa.array(list(ds.uids), type=pa.string()),
               "text": pa.array(list(ds.texts), type=pa.string()),
               "labels": labels}
    if ds.images is not None:
        columns["images"] = _images_array(ds.images)
    return _in_memory_dataset(pa.table(columns))


def from_hf_dataset(hf_ds: datasets.Dataset, num_labels: int, text_column: str = "text",
                    label_column: str = "labels", image_column: str = "images") -> XMCDataset:
    """Convert a ``datasets.Dataset`` (text column + list-of-label-ids column) back to an :class:`XMCDataset`.

    When ``image_column`` exists (lists of paths, or a ``Sequence(Image())`` column whose images have
    paths) it becomes ``XMCDataset.images``; otherwise the dataset is text-only (``images=None``).
    """
    import pyarrow as pa

    for col in (text_column, label_column):
        if col not in hf_ds.column_names:
            raise ValueError(f"dataset has no column {col!r} (columns: {hf_ds.column_names})")
    table = hf_ds.with_format("arrow")[:]  # respects select/shuffle index mappings
    n = table.num_rows

    texts = table.column(text_column).to_pylist()
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"row {i}: column {text_column!r} must be a string, got {type(text).__name__}")
    if "uid" in table.column_names:
        uids = [str(u) for u in table.column("uid").to_pylist()]
    else:
        uids = [str(i) for i in range(n)]

    col = table.column(label_column).combine_chunks() if n else None
    if col is None:
        indptr = np.zeros(1, dtype=np.int64)
        indices = np.zeros(0, dtype=np.int64)
    else:
        if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
            raise ValueError(f"column {label_column!r} must hold lists of label ids, got type {col.type}")
        if col.null_count:
            row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise ValueError(f"row {row}: column {label_column!r} is null")
        offsets = col.offsets.to_numpy().astype(np.int64)
        values = col.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        indptr = offsets - offsets[0]
        if not pa.types.is_integer(values.type):
            raise ValueError(f"column {label_column!r} must hold integer label ids, got type {col.type}")
        if values.null_count:
            pos = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
            row = int(np.searchsorted(indptr, pos, side="right") - 1)
            raise ValueError(f"row {row}: column {label_column!r} contains a null label id")
        indices = values.to_numpy().astype(np.int64)
        bad = (indices < 0) | (indices >= num_labels)
        if bad.any():
            pos = int(np.flatnonzero(bad)[0])
            row = int(np.searchsorted(indptr, pos, side="right") - 1)
            raise ValueError(f"row {row} (uid {uids[row]!r}): label id {int(indices[pos])} out of range "
                             f"[0, {num_labels})")
    targets = sp.csr_matrix((np.ones(len(indices), dtype=np.float32), indices, indptr), shape=(n, num_labels))
    targets.sum_duplicates()
    targets.data[:] = 1.0
    images = None
    if image_column in table.column_names:
        images = _images_from_column(table.column(image_column).combine_chunks(), image_column) if n else []
    return XMCDataset(texts=texts, targets=targets, uids=uids, images=images)


def labels_to_hf_dataset(uids: Sequence[str], texts: Sequence[str],
                         images: Sequence[Sequence[str]] | None = None) -> datasets.Dataset:
    """Build a ``datasets.Dataset`` of labels with columns ``label_id`` (int32), ``uid``, ``text`` [and ``images``]."""
    import pyarrow as pa

    if len(uids) != len(texts):
        raise ValueError(f"{len(uids)} uids but {len(texts)} texts")
    n = len(uids)
    columns = {"label_id": pa.array(np.arange(n, dtype=np.int32)),
               "uid": pa.array(list(uids), type=pa.string()),
               "text": pa.array(list(texts), type=pa.string())}
    if images is not None:
        if len(images) != n:
            raise ValueError(f"{n} uids but {len(images)} image lists")
        columns["images"] = _images_array(images)
    return _in_memory_dataset(pa.table(columns))
