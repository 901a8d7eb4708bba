"""Data loading for hf_xmc: XC-repository formats, filters, HF ``datasets`` bridge, synthetic and bundled data.

Modules:

* :mod:`~hf_xmc.data.xc_raw` -- raw JSON-lines files (``trn.json.gz``, ``tst.json.gz``, ``lbl.json.gz``),
  :class:`XMCDataset`, :class:`XCData`, :class:`XMCDataError`.
* :mod:`~hf_xmc.data.bow` -- sparse BoW text files (``train.txt``, ``trn_X_Y.txt``).
* :mod:`~hf_xmc.data.filters` -- ``filter_labels_*.txt`` files and filtered top-k predictions.
* :mod:`~hf_xmc.data.images` -- :func:`load_images` (image paths or PIL images -> RGB PIL images).
* :mod:`~hf_xmc.data.hf_bridge` -- conversion to/from ``datasets.Dataset`` (``datasets`` imported lazily).
* :mod:`~hf_xmc.data.data_files` -- one file per split (XC raw, parquet, arrow, csv, json lines) and which file of a
  ``--dataset_name`` list or folder is which split.
* :mod:`~hf_xmc.data.synthetic` -- synthetic tasks with planted structure for scale tests.
* :mod:`~hf_xmc.data.debtags` -- the bundled real Debtags dataset.
"""

from .bow import read_bow, read_sparse_matrix, write_bow, write_sparse_matrix
from .data_files import load_data_files, load_hf_xc_data
from .debtags import DEBTAGS_DIR, load_debtags
from .filters import filter_predictions, read_filter_file
from .hf_bridge import from_hf_dataset, labels_to_hf_dataset, to_hf_dataset, xc_data_to_hf_dataset_dict
from .images import image_cache_directory, load_image, load_images
from .splits import carve_validation, default_validation_size, split_validation
from .synthetic import SyntheticLabelTexts, make_synthetic_xmc
from .xc_raw import (
    XCData,
    XMCDataError,
    XMCDataset,
    load_xc_dataset,
    read_xc_labels,
    read_xc_raw,
    write_xc_labels,
    write_xc_raw,
)

__all__ = [
    "XMCDataset",
    "XCData",
    "XMCDataError",
    "read_xc_raw",
    "read_xc_labels",
    "write_xc_raw",
    "write_xc_labels",
    "load_xc_dataset",
    "load_hf_xc_data",
    "load_data_files",
    "xc_data_to_hf_dataset_dict",
    "image_cache_directory",
    "read_bow",
    "write_bow",
    "read_sparse_matrix",
    "write_sparse_matrix",
    "read_filter_file",
    "filter_predictions",
    "to_hf_dataset",
    "from_hf_dataset",
    "labels_to_hf_dataset",
    "load_image",
    "load_images",
    "make_synthetic_xmc",
    "SyntheticLabelTexts",
    "load_debtags",
    "DEBTAGS_DIR",
    "split_validation",
    "carve_validation",
    "default_validation_size",
]
