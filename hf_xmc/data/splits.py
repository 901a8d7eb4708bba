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
import logging
from typing import Optional

import numpy as np
import scipy.sparse as sp

from .xc_raw import XCData, XMCDataset

logger = logging.getLogger(__name__)

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


def reciprocal_pairs(validation: XMCDataset, train: XMCDataset, label_uids) -> Optional[sp.csr_matrix]:
    """The validation pairs ``(q, l)`` whose reverse is a training pair, as a ``(len(validation), L)`` boolean CSR
    (None when there is none): where queries and labels share one id space (a query whose uid is a label's uid, as in
    WordNet-XMC and the LF datasets, where a product or an article is both), label ``l`` is the training query ``t``
    of the same uid and ``t``'s targets hold the label that is ``q``. A shared encoder or a label-text score can use the
    reversed pair and a tree cannot; the Extreme Classification Repository removes such pairs from the test ground truth
    and lists them in its filter files, and the validation split gets the same treatment (:func:`carve_validation`).
    Memory: a dict of the label uids and one of the training uids (about 100 bytes per label and per training query)."""
    if label_uids is None or not len(validation):
        return None
    label_of = {uid: i for i, uid in enumerate(label_uids)}
    query_label = np.array([label_of.get(uid, -1) for uid in validation.uids], dtype=np.int64)  # the label that is q
    if not (query_label >= 0).any():
        return None
    train_row = {uid: r for r, uid in enumerate(train.uids)}
    label_row = np.array([train_row.get(uid, -1) for uid in label_uids], dtype=np.int64)  # the training query that is l
    t = validation.targets.tocsr()
    rows, cols = [], []
    for q in np.flatnonzero(query_label >= 0):
        labels = t.indices[t.indptr[q]:t.indptr[q + 1]]
        for label in labels[label_row[labels] >= 0]:
            r = label_row[label]
            if query_label[q] in train.targets.indices[train.targets.indptr[r]:train.targets.indptr[r + 1]]:
                rows.append(q)
                cols.append(label)
    if not rows:
        return None
    return sp.csr_matrix((np.ones(len(rows), dtype=bool), (rows, cols)), shape=t.shape)


def filter_reciprocal_pairs(validation: XMCDataset, pairs: sp.csr_matrix) -> XMCDataset:
    """``validation`` with ``pairs`` moved from its targets to its filter pairs (neither a hit nor a miss when scored);
    a query left without a label keeps its row (it scores 0 for every tuned setting alike)."""
    targets = validation.targets.tocsr().copy()
    targets = (targets - targets.multiply(pairs.astype(targets.dtype))).tocsr()
    targets.eliminate_zeros()
    filt = pairs if validation.filter_matrix is None else (validation.filter_matrix + pairs)
    return XMCDataset(texts=validation.texts, targets=targets, uids=validation.uids, source_rows=validation.source_rows,
                      images=validation.images, filter_matrix=sp.csr_matrix(filt, dtype=bool),
                      num_reciprocal_pairs_filtered=validation.num_reciprocal_pairs_filtered + int(pairs.nnz))


def carve_validation(data: XCData, size: int, seed: int) -> XCData:
    """``data`` with ``size`` training queries moved to ``data.validation`` (``data.train`` keeps the rest). The
    propensities of PSP@k keep coming from every training query (:meth:`XCData.propensity_targets`). A validation pair
    whose reverse is a training pair (:func:`reciprocal_pairs`) is moved to the validation filter, as a test split's
    reciprocal pairs are by the Extreme Classification Repository (``validation.num_reciprocal_pairs_filtered`` counts them)."""
    if data.validation is not None:
        raise ValueError("the data already has a validation split")
    full = data.train.targets
    train, validation = split_validation(data.train, size, seed)
    pairs = reciprocal_pairs(validation, train, data.label_uids)
    if pairs is not None:
        validation = filter_reciprocal_pairs(validation, pairs)
        logger.info("validation: %d pairs whose reverse is a training pair moved to the validation filter", pairs.nnz)
    return XCData(train=train, test=data.test, label_texts=data.label_texts, label_uids=data.label_uids,
                  label_images=data.label_images, validation=validation, all_train_targets=full)


def validation_record(data: XCData, source: str, seed: Optional[int] = None) -> Optional[dict]:
    """What the saved config and the card say of the validation split (None without one)."""
    if data.validation is None:
        return None
    record = {"source": source, "queries": len(data.validation), "training_queries": len(data.train), "fingerprint": fingerprint(data.validation)}
    if data.validation.num_reciprocal_pairs_filtered:
        record["reciprocal_pairs_filtered"] = data.validation.num_reciprocal_pairs_filtered
    if seed is not None:
        record["seed"] = int(seed)
    return record

