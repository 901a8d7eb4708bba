"""A validation split carved out of the training queries before anything trains.

    train, validation = split_validation(data.train, size=default_validation_size(len(data.train)), seed=42)

Whatever a run tunes after or during training (the lexical channel's fusion weights, the score calibration, the best
checkpoint) is tuned on these queries: the model never trains on them, and the test file stays for the final
evaluation (DESIGN.md). The draw depends on ``(n, size, seed)`` only (numpy's PCG64 from the seed, no global state), so
every process of a multi-process run, and a resumed run, carves the same rows.

Memory: the row ids of the validation queries (8 bytes each) plus the two :meth:`XMCDataset.select` copies (the texts'
references and the CSR rows of the targets).
"""

from __future__ import annotations

import hashlib
from typing import Optional

import numpy as np

from .xc_raw import XCData, XMCDataset

# the default size when a run needs a validation split: 5% of the training queries, at least 500 (a tuning grid scored on
# fewer is noise), at most 2,000 (enough to tune two weights and a calibration map; more only costs time), and never
# more than a fifth of the training queries
DEFAULT_VALIDATION_FRACTION = 0.05
DEFAULT_VALIDATION_MIN = 500
DEFAULT_VALIDATION_MAX = 2000


def default_validation_size(num_train: int) -> int:
    """The validation size a run uses when it needs one and none was asked for (module constants)."""
    size = int(round(DEFAULT_VALIDATION_FRACTION * num_train))
    size = min(max(size, DEFAULT_VALIDATION_MIN), DEFAULT_VALIDATION_MAX)
    return min(size, num_train // 5)


def validation_rows(num_train: int, size: int, seed: int) -> np.ndarray:
    """The sorted row ids of ``size`` validation queries among ``num_train`` (deterministic in its arguments)."""
    if not 0 <= size < num_train:
        raise ValueError(f"a validation split of {size} queries needs more than {size} training queries (there are {num_train})")
    return np.sort(np.random.default_rng(seed).choice(num_train, size=size, replace=False)).astype(np.int64)


def split_validation(train: XMCDataset, size: int, seed: int) -> tuple[XMCDataset, XMCDataset]:
    """``(training part, validation part)`` of ``train``: ``size`` queries drawn with ``seed`` (each part keeps the
    file order and the source-file record numbers of its rows)."""
    rows = validation_rows(len(train), size, seed)
    keep = np.ones(len(train), dtype=bool)
    keep[rows] = False
    return train.select(keep), train.select(rows)


def fingerprint(dataset: XMCDataset) -> str:
    """A short sha256 of a dataset's uids in order: which queries a split holds, recorded in the model's config."""
    digest = hashlib.sha256()
    for uid in dataset.uids:
        digest.update(uid.encode("utf-8", "surrogatepass"))
        digest.update(b"\n")
    return digest.hexdigest()[:16]


def carve_validation(data: XCData, size: int, seed: int) -> XCData:
    """``data`` with ``size`` training queries moved to ``data.validation`` (``data.train`` keeps the rest). The
    propensities of PSP@k keep coming from every training query (:meth:`XCData.propensity_targets`)."""
    if data.validation is not None:
        raise ValueError("the data already has a validation split")
    full = data.train.targets
    train, validation = split_validation(data.train, size, seed)
    return XCData(train=train, test=data.test, label_texts=data.label_texts, label_uids=data.label_uids,
                  label_images=data.label_images, validation=validation, all_train_targets=full)


def validation_record(data: XCData, source: str, seed: Optional[int] = None) -> Optional[dict]:
    """What the saved config and the card say of the validation split (None without one)."""
    if data.validation is None:
        return None
    record = {"source": source, "queries": len(data.validation), "training_queries": len(data.train), "fingerprint": fingerprint(data.validation)}
    if seed is not None:
        record["seed"] = int(seed)
    return record

