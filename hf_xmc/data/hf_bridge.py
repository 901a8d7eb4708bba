"""Bridge between :class:`~hf_xmc.data.xc_raw.XMCDataset` and Hugging Face ``datasets``.

``datasets`` (and ``pyarrow``) are imported lazily inside the functions, so importing
:mod:`hf_xmc.data` stays cheap. The label lists are moved through Arrow list arrays built directly
from the CSR ``indptr``/``indices`` buffers, without per-row Python lists. Multimodal datasets carry an
``images`` column (a list of image paths per row) when :attr:`XMCDataset.images` is set.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import scipy.sparse as sp

from .xc_raw import XMCDataset

if TYPE_CHECKING:  # pragma: no cover
    import datasets


__all__ = ["to_hf_dataset", "from_hf_dataset", "labels_to_hf_dataset", "xc_data_to_hf_dataset_dict"]


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


def _image_file(value: dict, image_cache_dir: str | None) -> str | None:
    """The path of one ``datasets.Image()`` cell: its bytes (when it holds them) written once to
    ``image_cache_dir/<sha256>.<ext>``, else its path. Memory: one image's bytes at a time."""
    data, path = value.get("bytes"), value.get("path")
    if not data:
        return path
    import hashlib
    import os

    from .images import image_cache_directory

    directory = image_cache_dir or image_cache_directory()
    ext = os.path.splitext(path or "")[1].lower()
    if not ext:  # no file name: the format from the header (PIL reads it without decoding the pixels)
        import io

        from PIL import Image

        try:
            with Image.open(io.BytesIO(data)) as image:
                ext = "." + (image.format or "img").lower()
        except Exception:  # not an image PIL knows: loading it later names the file and the fault
            ext = ".img"
    target = os.path.join(directory, hashlib.sha256(data).hexdigest() + ext)
    if not os.path.exists(target):
        os.makedirs(directory, exist_ok=True)
        tmp = f"{target}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    return target


def _images_from_column(col: Any, column: str, image_cache_dir: str | None = None) -> list[list[str]]:
    """Per-row image paths from a ``list<string>`` column or a ``Sequence(Image())`` column (its paths; images
    embedded as bytes are written to ``image_cache_dir``, see :func:`_image_file`)."""
    import pyarrow as pa

    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        raise ValueError(f"column {column!r} must hold lists of image paths, got type {col.type}")
    value_type = col.type.value_type
    if pa.types.is_struct(value_type) and value_type.get_field_index("path") >= 0:
        # datasets' Image feature stores {bytes, path}: embedded bytes become files of the image cache
        rows = [[None if v is None else _image_file(v, image_cache_dir) for v in row] if row is not None else None
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


# a CSV cell of label ids: "3 17", "3,17", "[3, 17]", "" (no label); a character class, so matching is linear
_LABEL_STRING = re.compile(r"[\s\d,;\[\]-]*")


def _label_lists_from_scalars(col: Any, column: str) -> Any:
    """A ``list<int64>`` column from a column of strings (a CSV cell: ids separated by spaces, commas or semicolons,
    optionally in brackets; empty = no label) or of single integer ids. Raises ``ValueError`` naming the first bad row."""
    import pyarrow as pa

    rows = []
    for i, value in enumerate(col.to_pylist()):
        if value is None:
            rows.append(None)
        elif isinstance(value, int):
            rows.append([value])
        else:
            match = _LABEL_STRING.fullmatch(value)
            if match is None:
                raise ValueError(f"row {i}: column {column!r} holds {value[:40]!r}, not label ids (e.g. '3 17' or '[3, 17]')")
            ids = re.findall(r"-?\d+", value)
            long = next((x for x in ids if len(x.lstrip("-")) > 18), None)  # beyond int64 (and int()'s digit limit)
            if long is not None:
                raise ValueError(f"row {i}: column {column!r}: label id {long[:10]}... ({len(long.lstrip('-')):,} digits) out of range")
            rows.append([int(x) for x in ids])
    return pa.array(rows, type=pa.list_(pa.int64()))


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
                    label_column: str = "labels", image_column: str = "images",
                    image_cache_dir: str | None = None) -> XMCDataset:
    """Convert a ``datasets.Dataset`` (text column + list-of-label-ids column) back to an :class:`XMCDataset`.

    When ``image_column`` exists (lists of paths, or a ``Sequence(Image())`` column: embedded image bytes are
    written once to ``image_cache_dir``, default :func:`~hf_xmc.data.images.image_cache_directory`) it becomes
    ``XMCDataset.images``; otherwise the dataset is text-only (``images=None``).
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
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type) or pa.types.is_integer(col.type):
            col = _label_lists_from_scalars(col, label_column)  # a CSV file: "3 17" / "[3, 17]" / one id per row
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
        images = _images_from_column(table.column(image_column).combine_chunks(), image_column, image_cache_dir) if n else []
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


def xc_data_to_hf_dataset_dict(data) -> datasets.DatasetDict:
    """An :class:`~hf_xmc.data.xc_raw.XCData` as one ``DatasetDict`` with splits ``train``, ``test`` and ``labels``
    (the layout :func:`~hf_xmc.data.data_files.load_hf_xc_data` reads by default): ``save_to_disk`` it, or ``push_to_hub`` it."""
    import datasets

    return datasets.DatasetDict({
        "train": to_hf_dataset(data.train),
        "test": to_hf_dataset(data.test),
        "labels": labels_to_hf_dataset(data.label_uids, data.label_texts, data.label_images),
    })
