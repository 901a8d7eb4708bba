"""Data files per split, in any format the transformers example scripts read, and which file is which split.

``--train_file`` / ``--validation_file`` / ``--test_file`` / ``--label_file`` each name ONE split's file (as in
transformers' ``run_glue.py``): Extreme Classification Repository raw JSON lines (``trn.json.gz``, read by
:mod:`~hf_xmc.data.xc_raw` exactly as before), or ``.parquet`` / ``.arrow`` / ``.csv`` / ``.json`` / ``.jsonl``
(optionally ``.gz``) read with ``datasets.load_dataset(<format>, data_files={split: file})``. A ``.json[l]`` file is
an XC raw file unless its first record reads as a ``datasets`` row: points with the label column (``labels``) and no
``target_ind``, labels with the label text column (``text``) and none of the XC text fields (``title``).

``--dataset_name`` with several files (comma-separated, or a local folder of data files) assigns each file to the
split its name says (:func:`files_for_split`: ``train.parquet``, ``test-00000-of-00002.parquet``, ``labels/0.parquet``;
``trn`` / ``tst`` / ``lbl``, ``valid`` / ``val`` / ``dev`` count too), and refuses a split that no file, or every file,
names: one file is never read as two splits, so no test point can leak into training.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from .xc_raw import XCData, XMCDataError, XMCDataset, _open_text, check_training_points, read_xc_labels, read_xc_raw

if TYPE_CHECKING:  # pragma: no cover
    import datasets

__all__ = ["DATA_FILE_BUILDERS", "data_file_builder", "files_for_split", "load_data_files", "load_hf_xc_data", "read_labels_file", "read_points_file"]

#: ``datasets`` builders by file extension (after a compression suffix is stripped).
DATA_FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json", ".jsonl": "json"}
COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
#: Other names a file may give each usual split (the XC repository's ``trn`` / ``tst`` / ``lbl`` among them).
SPLIT_ALIASES = {
    "train": ("train", "trn", "training"),
    "test": ("test", "tst", "testing"),
    "validation": ("validation", "valid", "val", "dev"),
    "labels": ("labels", "label", "lbl"),
}


def _stem_and_ext(path: str) -> tuple[str, str]:
    """``(path without its extensions, data extension)``: ``a/trn.json.gz`` -> ``("a/trn", ".json")``."""
    base = path
    for suffix in COMPRESSION_SUFFIXES:
        if base.lower().endswith(suffix):
            base = base[: -len(suffix)]
            break
    stem, ext = os.path.splitext(base)
    return stem, ext.lower()


def data_file_builder(path: str) -> Optional[str]:
    """The ``datasets`` builder of a data file by its extension (``parquet``, ``arrow``, ``csv``, ``json``), or None."""
    return DATA_FILE_BUILDERS.get(_stem_and_ext(path)[1])


def _first_record(path: str) -> Optional[dict]:
    """The first non-blank line of a JSON-lines file as an object, or None when it is not one (the XC reader then
    names the fault with its line)."""
    try:
        with _open_text(path) as f:
            for line in f:
                if line.strip():
                    obj = json.loads(line)
                    return obj if isinstance(obj, dict) else None
    except (OSError, EOFError, ValueError, RecursionError):
        return None
    return None


def _is_xc_raw(path: str, labels: bool, text_fields: Sequence[str], label_column: str, label_text_column: str) -> bool:
    """Whether ``path`` is read by the XC raw readers (True) or with ``datasets`` (False)."""
    builder = data_file_builder(path)
    if builder != "json":
        return builder is None  # an unknown extension stays with the XC reader, whose errors name the line
    record = _first_record(path)
    if record is None:
        return True
    if labels:
        return not (label_text_column in record and not any(field in record for field in text_fields))
    return not (label_column in record and "target_ind" not in record)


def _load_file(path: str, split: str) -> datasets.Dataset:
    """One data file as a ``datasets.Dataset`` (split ``split``); a file that cannot be read is an
    :class:`XMCDataError` naming it."""
    import datasets

    with open(path, "rb"):  # a missing file or a directory: the OSError names it, as the XC readers' open() does
        pass
    builder = data_file_builder(path)
    try:
        return datasets.load_dataset(builder, data_files={split: [os.path.abspath(path)]}, split=split)
    except Exception as err:  # noqa: BLE001 - datasets wraps Arrow's parser errors in its own (not ValueError) types
        cause = err.__cause__ or err
        text = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        raise XMCDataError(path, None, f"cannot read it as {builder}: {text}") from err


def _drop_unlabeled(xc: XMCDataset) -> XMCDataset:
    """``xc`` without its points that have no label (as the XC readers skip them; ``source_rows`` keeps the rows a
    filter file refers to)."""
    keep = np.flatnonzero(np.diff(xc.targets.indptr) > 0)
    if len(keep) == len(xc):
        return xc
    return XMCDataset(
        texts=[xc.texts[i] for i in keep], targets=xc.targets[keep], uids=[xc.uids[i] for i in keep],
        num_skipped=len(xc) - len(keep), source_rows=keep,
        images=[xc.images[i] for i in keep] if xc.images is not None else None,
    )


def points_from_dataset(ds: datasets.Dataset, num_labels: int, where: str, text_column: str = "text", label_column: str = "labels",
                        image_column: str = "images", image_cache_dir: Optional[str] = None, skip_unlabeled: bool = True) -> XMCDataset:
    """The points of a ``datasets.Dataset`` (unlabelled ones skipped, unless not ``skip_unlabeled``: a test split's are
    kept); a fault is a ``ValueError`` that starts with ``where`` (the file, or the dataset and split)."""
    from .hf_bridge import from_hf_dataset

    try:
        xc = from_hf_dataset(ds, num_labels, text_column, label_column, image_column, image_cache_dir)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    return _drop_unlabeled(xc) if skip_unlabeled else xc


def labels_from_dataset(ds: datasets.Dataset, where: str, label_text_column: str = "text", label_image_column: str = "images",
                        image_cache_dir: Optional[str] = None) -> tuple[list[str], list[str], Optional[list[list[str]]]]:
    """``(uids, texts, images)`` of a label table (row i = label id i; ``uid`` column optional, default the row number;
    ``images`` None without the image column)."""
    import pyarrow as pa

    from .hf_bridge import _images_from_column

    if label_text_column not in ds.column_names:
        raise ValueError(f"{where}: no column {label_text_column!r} (columns: {ds.column_names})")
    texts = [str(t) if t is not None else "" for t in ds[label_text_column]]
    if not texts:
        raise ValueError(f"{where}: the label table is empty")
    uids = [str(u) for u in ds["uid"]] if "uid" in ds.column_names else [str(i) for i in range(len(texts))]
    images = None
    if label_image_column in ds.column_names:
        col = ds.with_format("arrow")[:].column(label_image_column).combine_chunks()
        if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):  # one image (or path) per label
            col = pa.ListArray.from_arrays(pa.array(np.arange(len(col) + 1, dtype=np.int32)), col)
        images = _images_from_column(col, label_image_column, image_cache_dir)
    return uids, texts, images


def read_points_file(path: str, num_labels: int, split: str = "train", text_fields: Sequence[str] = ("title",), text_column: str = "text",
                     label_column: str = "labels", image_column: str = "images", image_cache_dir: Optional[str] = None,
                     skip_unlabeled: bool = True) -> XMCDataset:
    """The points of one file: XC raw JSON lines (``text_fields``), or a data file read with ``datasets`` (columns
    ``text_column``, ``label_column``: lists of label ids, or a CSV string such as ``"3 17"`` / ``"[3, 17]"``).
    ``skip_unlabeled``: leave out the points without a label (False: keep them, as a test file is read by default)."""
    if _is_xc_raw(path, False, text_fields, label_column, "text"):
        return read_xc_raw(path, num_labels=num_labels, text_fields=text_fields, skip_unlabeled=skip_unlabeled)
    return points_from_dataset(_load_file(path, split), num_labels, path, text_column, label_column, image_column, image_cache_dir,
                               skip_unlabeled=skip_unlabeled)


def read_labels_file(path: str, text_fields: Sequence[str] = ("title",), label_text_column: str = "text", label_image_column: str = "images",
                     image_cache_dir: Optional[str] = None) -> tuple[list[str], list[str], Optional[list[list[str]]]]:
    """``(uids, texts, images)`` of a label file: XC raw JSON lines (``text_fields``) or a data file read with
    ``datasets`` (``label_text_column``, optional ``uid`` and ``label_image_column``); line / row i = label id i."""
    if _is_xc_raw(path, True, text_fields, "labels", label_text_column):
        return read_xc_labels(path, text_fields=text_fields, return_images=True)
    return labels_from_dataset(_load_file(path, "labels"), path, label_text_column, label_image_column, image_cache_dir)


def load_data_files(
    train_file: Optional[str],
    test_file: str,
    label_file: str,
    validation_file: Optional[str] = None,
    *,
    text_fields: Sequence[str] = ("title",),
    label_text_fields: Optional[Sequence[str]] = None,
    text_column: str = "text",
    label_column: str = "labels",
    image_column: str = "images",
    label_text_column: str = "text",
    label_image_column: str = "images",
    image_cache_dir: Optional[str] = None,
    skip_unlabeled_test_points: bool = False,
) -> XCData:
    """An XMC task from one file per split (``train_file`` None: no training split), each in its own format (see the
    module docstring); label ids are checked against the label file. XC raw files read exactly as
    :func:`~hf_xmc.data.xc_raw.load_xc_dataset` reads them: training and validation points without a label are
    skipped (they carry no signal to train or tune on), test points without one are kept and score 0 (pyxclib's and
    the repository's convention) unless ``skip_unlabeled_test_points``."""
    label_uids, label_texts, label_images = read_labels_file(label_file, tuple(label_text_fields or text_fields), label_text_column,
                                                             label_image_column, image_cache_dir)
    columns = dict(text_fields=tuple(text_fields), text_column=text_column, label_column=label_column, image_column=image_column,
                   image_cache_dir=image_cache_dir)
    train = None
    if train_file:
        train = check_training_points(read_points_file(train_file, len(label_uids), "train", **columns), train_file)
    test = read_points_file(test_file, len(label_uids), "test", **columns, skip_unlabeled=skip_unlabeled_test_points)
    validation = None
    if validation_file:
        validation = read_points_file(validation_file, len(label_uids), "validation", **columns)
        if len(validation) == 0:
            raise XMCDataError(validation_file, None, "no validation point has a label")
    return XCData(train=train, test=test, label_texts=label_texts, label_uids=label_uids, label_images=label_images, validation=validation)


# ------------------------------------------------------------------------------------------------------------------
# which file of a --dataset_name list (or folder) is which split
# ------------------------------------------------------------------------------------------------------------------


def _name_tokens(relative_path: str) -> set[str]:
    """The words of a file's path without its extensions (``data/train-00000-of-00002.parquet`` -> data, train, ...)."""
    return {t for t in re.split(r"[^0-9a-z]+", _stem_and_ext(relative_path.lower())[0]) if t}


def local_data_files(name: str) -> Optional[list[str]]:
    """The data files ``name`` stands for, when it names local files rather than a Hub dataset: a comma-separated
    list of files, or a folder of data files (searched recursively, hidden entries skipped) that is neither a
    ``save_to_disk`` directory nor a dataset whose ``README.md`` declares its configs. None otherwise."""
    files = [f for f in name.split(",") if f]
    if len(files) > 1 or (files and (os.path.isfile(files[0]) or data_file_builder(files[0]))):
        return files  # a missing data file is named at once, not looked up on the Hub
    if not os.path.isdir(name):
        return None
    if any(os.path.exists(os.path.join(name, marker)) for marker in ("dataset_dict.json", "state.json")):
        return None
    readme = os.path.join(name, "README.md")
    if os.path.isfile(readme):
        with open(readme, encoding="utf-8", errors="replace") as f:
            if re.search(r"^configs:", f.read(), flags=re.MULTILINE):
                return None  # datasets reads the folder as its card says
    found = []
    for root, dirs, names in os.walk(name):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.join(root, n) for n in sorted(names) if not n.startswith(".") and data_file_builder(n)]
    return found


def files_for_split(name: str, files: Sequence[str], split: str, others: Sequence[str] = ()) -> list[str]:
    """The files of ``files`` whose names say ``split`` (its name or an alias of :data:`SPLIT_ALIASES` as a word of
    the path under ``name``). A ``ValueError`` naming ``name`` when none does, or when one also names a split of
    ``others`` (the other splits read from the same files): a file is never read as two splits."""
    base = name if os.path.isdir(name) else ""

    def says(path: str, wanted: str) -> bool:
        return bool(_name_tokens(os.path.relpath(path, base) if base else os.path.basename(path)) & set(SPLIT_ALIASES.get(wanted, (wanted,))))

    chosen = [f for f in files if says(f, split)]
    for f in chosen:
        clash = [other for other in others if other != split and says(f, other)]
        if clash:
            raise ValueError(f"{name}: {f} is named for split {split!r} and for {clash[0]!r}: rename it so that each file names one split")
    if not chosen:
        shown = ", ".join(os.path.basename(f) for f in files[:6]) + (", ..." if len(files) > 6 else "")
        raise ValueError(f"{name}: no file for split {split!r} (a file belongs to the split its name says, e.g. {split}.parquet; "
                         f"files: {shown or 'none'}); or name each split's file: --train_file, --validation_file, --test_file, --label_file")
    return chosen


def load_local_split(name: str, files: Sequence[str], split: str, others: Sequence[str] = (), whole: bool = False, **kwargs: Any) -> datasets.Dataset:
    """Split ``split`` of the local data files ``files`` (what :func:`local_data_files` found for ``name``): every file
    when ``whole`` (they are all this split's: ``--label_dataset_name labels.parquet``), else the files whose names say
    ``split`` (:func:`files_for_split`). All of one format."""
    import datasets

    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ValueError(f"{missing[0]}: no such data file" + (f" (in --dataset_name {name})" if missing[0] != name else ""))
    chosen = list(files) if whole else files_for_split(name, files, split, others)
    builders = {data_file_builder(f) for f in chosen}
    if None in builders or len(builders) != 1:
        raise ValueError(f"{name}: split {split!r} mixes or lacks data formats ({', '.join(os.path.basename(f) for f in chosen)}): "
                         f"one of {', '.join(sorted(DATA_FILE_BUILDERS))} per split")
    return datasets.load_dataset(builders.pop(), data_files={split: [os.path.abspath(f) for f in chosen]}, split=split, **kwargs)


# ------------------------------------------------------------------------------------------------------------------
# an XMC task read with datasets (a Hub dataset, a save_to_disk directory, or local data files)
# ------------------------------------------------------------------------------------------------------------------


def _load_split(name: str, config: str | None, split: str, others: Sequence[str] = (), whole: bool = False, **kwargs) -> datasets.Dataset:
    """One split of a Hub dataset, a ``save_to_disk`` directory, or local data files (``.parquet`` / ``.json[l]`` /
    ``.csv`` / ``.arrow``: a comma-separated list or a folder of them). Local files go to the split their names say
    (:func:`files_for_split`; ``others``: the other splits read from ``name``), or all to
    ``split`` when ``whole``; one file is never read as two splits."""
    import datasets

    if os.path.isdir(name) and (os.path.exists(os.path.join(name, "dataset_dict.json")) or os.path.exists(os.path.join(name, "state.json"))):
        loaded = datasets.load_from_disk(name)  # a save_to_disk directory: load_dataset does not read those
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"{name}: no split {split!r} (splits: {', '.join(loaded)})")
            return loaded[split]
        return loaded
    files = local_data_files(name)
    if files is not None:
        sole = not [other for other in others if other != split]  # one file that only this split reads is all of it
        return load_local_split(name, files, split, others, whole=whole or (len(files) == 1 and sole), **kwargs)
    try:
        return datasets.load_dataset(name, config, split=split, **kwargs)
    except ValueError as err:  # an unknown split: name the ones there are
        raise ValueError(f"{name}{f' ({config})' if config else ''}: {err}") from err


def load_hf_xc_data(
    dataset_name: str,
    dataset_config_name: str | None = None,
    train_split: str | None = "train",
    test_split: str = "test",
    label_dataset_name: str | None = None,
    label_dataset_config_name: str | None = None,
    label_split: str = "labels",
    text_column: str = "text",
    label_column: str = "labels",
    image_column: str = "images",
    label_text_column: str = "text",
    label_image_column: str = "images",
    train_files: str | None = None,
    test_files: str | None = None,
    image_cache_dir: str | None = None,
    validation_split: str | None = None,
    skip_unlabeled_test_points: bool = False,
) -> XCData:
    """An XMC task read with ``datasets``, as transformers' example scripts read theirs.

    Points come from ``dataset_name`` (a Hub id, a ``save_to_disk`` directory, or data files), splits
    ``train_split`` / ``test_split``, columns ``text_column`` and ``label_column`` (lists of label ids) and, when
    present, ``image_column`` (paths, or ``datasets.Image()`` cells) and ``uid``. ``train_files`` / ``test_files``
    name data files per split instead. Labels come from ``label_dataset_name`` (default ``dataset_name``) with
    ``label_dataset_config_name`` (default ``dataset_config_name`` when the labels live in the same dataset), split
    ``label_split``: row i = label id i, ``label_text_column`` (+ ``uid``, ``label_image_column``). Training and
    validation points without a label are skipped as the XC readers skip them (``source_rows`` keeps the rows a filter
    file refers to); test points without one are kept (they score 0, as pyxclib counts them) unless
    ``skip_unlabeled_test_points``.
    ``train_split=None`` reads no training split (evaluation only); ``validation_split`` names a split of validation
    points (``XCData.validation``). Memory: the Arrow tables are memory-mapped; the
    texts and the CSR targets are built once (``8 x`` labels-per-point bytes per point).
    """
    # the splits read from dataset_name's own files: no file of them may be read as two (train = test leaks the test set)
    point_splits = [s for s, files in ((train_split, train_files), (test_split, test_files), (validation_split, None)) if s and not files]
    same = label_dataset_name is None or label_dataset_name == dataset_name
    label_source = label_dataset_name or dataset_name
    label_ds = _load_split(label_source, label_dataset_config_name or (dataset_config_name if same else None), label_split,
                           others=point_splits if same else ())
    label_uids, label_texts, label_images = labels_from_dataset(label_ds, f"labels ({label_source}, split {label_split!r})", label_text_column,
                                                                label_image_column, image_cache_dir)
    others = point_splits + ([label_split] if same else [])

    def points(split: str, files: str | None, skip_unlabeled: bool = True):
        if files:  # named for this split: every file is its
            ds = _load_split(files, None, split, whole=True)
        else:
            ds = _load_split(dataset_name, dataset_config_name, split, others=others)
        return points_from_dataset(ds, len(label_texts), f"{files or dataset_name}, split {split!r}", text_column, label_column, image_column,
                                   image_cache_dir, skip_unlabeled=skip_unlabeled)

    train = points(train_split, train_files) if train_split else None
    test = points(test_split, test_files, skip_unlabeled=skip_unlabeled_test_points)
    if train is not None and len(train) == 0:
        raise ValueError(f"{train_files or dataset_name}, split {train_split!r}: no training point has a label")
    validation = points(validation_split, None) if validation_split else None
    if validation is not None and len(validation) == 0:
        raise ValueError(f"{dataset_name}, split {validation_split!r}: no validation point has a label")
    return XCData(train=train, test=test, label_texts=label_texts, label_uids=label_uids, label_images=label_images, validation=validation)
