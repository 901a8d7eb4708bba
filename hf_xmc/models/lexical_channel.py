"""The lexical channel: TF-IDF query features scored against the labels, fused with the dense score at predict time.

A dense encoder ranks the tail well (label texts) but, trained for minutes on a CPU, leaves head precision to the
linear tree methods (omikuji, XR-Linear, napkinXC) that learn one sparse weight vector per label from the training
queries' words. The lexical channel adds both kinds of word evidence to any text model of hf_xmc:

* ``ranker``: an Omikuji forest (Parabel-like balanced label trees with sparse linear nodes) over the TF-IDF features
  of the training queries, which scores head labels from the words that predict them. It is trained by
  ``hf_xmc.training.lexical.fit_lexical_channel`` and ranks labels seen in training only.
* ``text``: the cosine between the TF-IDF vectors of the query and of the label text (label-text similarity, which
  also covers labels without training queries and labels added later).

Fusion (:meth:`LexicalChannel.fuse`): the candidates of a query are the dense search's top ``dense_depth`` labels and
the ranker's top ``ranker_depth``; each gets ``dense + ranker_weight * p_ranker + text_weight * cos_text`` (the dense
term times ``dense_weight``, 1 unless set), where
``p_ranker`` is the forest's score (a probability in [0, 1]; 0 for a label the ranker did not return) and a candidate
the dense search did not return gets the dense score of the query's last dense candidate (an upper bound of its own
dense score under exact search). Dense scores are the model's search scores (cosine for the normalised methods), so
the weights are per model, chosen when the channel is fitted and saved in ``config.lexical_channel``.

The TF-IDF transform here is scikit-learn's ``TfidfVectorizer`` (lower-cased ``\\b\\w\\w+\\b`` tokens, word 1..n
grams, sublinear tf, smooth idf, L2 norm) re-implemented over numpy for the vocabulary and idf it fitted, so a
model loads and predicts without scikit-learn. The ranker needs ``omikuji`` at predict time; a model loaded without it
warns once and fuses the dense and text scores only.

Saved as one file, ``lexical_channel.safetensors``: the vocabulary (UTF-8, newline separated, as bytes), ``idf``, the
label TF-IDF rows (CSR ``label_indptr`` / ``label_indices`` / ``label_data``), ``ranker_labels`` (the model's label id
of each ranker label, -1 once removed) and Omikuji's own model files as bytes. No pickle anywhere.

Memory model (``V`` vocabulary terms, ``L`` labels with ``z`` TF-IDF non-zeros each, ``R`` ranker bytes)
------------------------------------------------------------------------------------------------------
* vocabulary: ``V * (~12 + ~90)`` bytes (term bytes + a Python dict entry): ~20 MB at the default 200K terms;
* label rows: ``L * (8 + 8 z)`` bytes: ~170 MB at 1.3M labels of 16 terms (ids int32 + values float32 per term);
* ranker: Omikuji's sparse node weights (kept above ``linear_weight_threshold``), ~``1-3 KB`` per label measured on
  WordNet-XMC's 53K labels; loading writes them to a temporary directory once;
* per query: ``dense_depth + ranker_depth`` candidates; fusion works on chunks of ``FUSE_CHUNK`` queries, at most
  ``FUSE_CHUNK * ranker_depth * dense_depth`` bytes for the candidate matching and ``8 * z`` bytes per text-scored
  candidate pair. Nothing is ``queries x labels``.

This file is part of the remote-code bundle of every hf_xmc model: it imports numpy, safetensors, its sibling
``label_index`` and (optionally) omikuji.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np

from .io_utils import atomic_write
from .model_files import ModelFileError, check_csr, check_listed_name, read_safetensors_with_metadata
from .provenance import array_digest, digest

try:  # the ranker's library: optional at load time (the channel then fuses dense + text scores only)
    import omikuji
except ImportError:  # pragma: no cover - exercised in environments without omikuji
    omikuji = None

logger = logging.getLogger(__name__)

LEXICAL_FILE = "lexical_channel.safetensors"
LEXICAL_FORMAT = "hf_xmc.lexical_channel.v1"
# scikit-learn's default token pattern (two or more word characters), case-folded like its lowercase=True
TOKEN_PATTERN = re.compile(r"(?u)\b\w\w+\b")
# queries fused at a time: bounds the (chunk, ranker_depth, dense_depth) match tensor and the text-score pairs
FUSE_CHUNK = 512
# ranker queries in flight at once (omikuji's predict releases the GIL: each thread walks one query's forest); the
# channel's ``ranker_threads`` attribute changes it, 1 walks them one after the other in this thread
RANKER_THREADS = max(1, min(8, os.cpu_count() or 1))
_RANKER_POOLS: dict[int, ThreadPoolExecutor] = {}  # by size, shared by every channel of the process, made on first use


def ranker_pool(threads: int) -> ThreadPoolExecutor:
    """The process's pool of ``threads`` ranker threads (kept: a served model starts no threads per request)."""
    if threads not in _RANKER_POOLS:
        _RANKER_POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="omikuji")
    return _RANKER_POOLS[threads]
# fusion settings and their defaults (config.lexical_channel holds the fitted model's values)
DEFAULT_SETTINGS = {
    "dense_weight": 1.0,  # 0: the channel alone ranks the candidates (the dense score breaks no ties then)
    "ranker_weight": 1.0,
    "text_weight": 0.0,
    "dense_depth": 100,
    "ranker_depth": 100,
    "beam_size": 10,
}


class CsrRows:
    """Rows of a sparse float32 matrix in CSR form (``indptr`` int64, ``indices`` int32 sorted within a row, ``data``
    float32): the TF-IDF vectors of queries or labels, without scipy."""

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, data: np.ndarray):
        self.indptr = np.asarray(indptr, dtype=np.int64)
        self.indices = np.asarray(indices, dtype=np.int32)
        self.data = np.asarray(data, dtype=np.float32)

    def __len__(self) -> int:
        return len(self.indptr) - 1

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        start, stop = self.indptr[i], self.indptr[i + 1]
        return self.indices[start:stop], self.data[start:stop]

    def select(self, rows: np.ndarray) -> CsrRows:
        """The rows ``rows`` (in that order)."""
        rows = np.asarray(rows, dtype=np.int64)
        counts = self.indptr[rows + 1] - self.indptr[rows]
        indptr = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        positions = _expand_ranges(self.indptr[rows], counts)
        return CsrRows(indptr, self.indices[positions], self.data[positions])

    @staticmethod
    def concat(blocks: Sequence[CsrRows]) -> CsrRows:
        offsets = np.cumsum([0] + [int(b.indptr[-1]) for b in blocks[:-1]])
        indptr = np.concatenate([[0]] + [b.indptr[1:] + off for b, off in zip(blocks, offsets)])
        return CsrRows(indptr, np.concatenate([b.indices for b in blocks]), np.concatenate([b.data for b in blocks]))


def _expand_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])`` without a Python loop."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(counts)
    group_start = np.repeat(ends - counts, counts)
    return np.repeat(starts, counts) + (np.arange(total, dtype=np.int64) - group_start)


def word_ngrams(text: str, ngram_max: int) -> list[str]:
    """The terms of ``text`` as scikit-learn's word analyzer makes them: lower-cased tokens of two or more word
    characters, then every run of 2..``ngram_max`` consecutive tokens joined by a space."""
    tokens = TOKEN_PATTERN.findall(text.lower())
    terms = list(tokens)
    for n in range(2, ngram_max + 1):
        terms.extend(" ".join(tokens[i:i + n]) for i in range(len(tokens) - n + 1))
    return terms


class TfidfFeatures:
    """TF-IDF vectors over a fixed vocabulary: ``(1 + ln tf) * idf`` (or ``tf * idf``), L2-normalised per text; equal to
    scikit-learn's ``TfidfVectorizer(ngram_range=(1, ngram_max), sublinear_tf=..., norm="l2").transform`` for the
    vocabulary and ``idf_`` it fitted. Memory: the vocabulary dict (~100 bytes per term) and ``4 V`` bytes of idf."""

    def __init__(self, terms: Sequence[str], idf: np.ndarray, ngram_max: int = 2, sublinear_tf: bool = True):
        if len(terms) != len(idf):
            raise ValueError(f"{len(terms)} vocabulary terms but {len(idf)} idf values")
        self.terms = list(terms)
        self.vocabulary = {term: i for i, term in enumerate(self.terms)}
        self.idf = np.asarray(idf, dtype=np.float32)
        self.ngram_max = int(ngram_max)
        self.sublinear_tf = bool(sublinear_tf)

    @property
    def num_features(self) -> int:
        return len(self.terms)

    def transform(self, texts: Sequence[str]) -> CsrRows:
        """TF-IDF rows of ``texts`` (a text without a known term gets an empty row)."""
        indptr = np.zeros(len(texts) + 1, dtype=np.int64)
        indices: list[np.ndarray] = []
        values: list[np.ndarray] = []
        vocabulary = self.vocabulary
        for row, text in enumerate(texts):
            ids = [vocabulary[t] for t in word_ngrams(str(text), self.ngram_max) if t in vocabulary]
            if ids:
                uniq, counts = np.unique(np.asarray(ids, dtype=np.int32), return_counts=True)
                tf = counts.astype(np.float32)
                if self.sublinear_tf:
                    tf = 1.0 + np.log(tf)
                weights = tf * self.idf[uniq]
                weights /= np.float32(np.sqrt(np.dot(weights, weights)))
                indices.append(uniq)
                values.append(weights.astype(np.float32))
            indptr[row + 1] = indptr[row] + (len(indices[-1]) if ids else 0)
        if not indices:
            return CsrRows(indptr, np.zeros(0, np.int32), np.zeros(0, np.float32))
        return CsrRows(indptr, np.concatenate(indices), np.concatenate(values))


def pair_dot_products(queries: CsrRows, labels: CsrRows, query_rows: np.ndarray, label_rows: np.ndarray, num_features: int) -> np.ndarray:
    """``<queries[query_rows[p]], labels[label_rows[p]]>`` for every pair ``p``, vectorised: each label term of a pair
    is looked up among its query's terms by binary search (``8 bytes`` per label term of the pairs)."""
    out = np.zeros(len(query_rows), dtype=np.float32)
    if len(query_rows) == 0 or len(queries.indices) == 0:
        return out
    row_of_entry = np.repeat(np.arange(len(queries), dtype=np.int64), np.diff(queries.indptr))
    query_keys = row_of_entry * num_features + queries.indices  # sorted: rows in order, terms sorted within a row
    counts = labels.indptr[label_rows + 1] - labels.indptr[label_rows]
    positions = _expand_ranges(labels.indptr[label_rows], counts)
    if positions.size == 0:
        return out
    pair_of_entry = np.repeat(np.arange(len(query_rows), dtype=np.int64), counts)
    keys = query_rows[pair_of_entry].astype(np.int64) * num_features + labels.indices[positions]
    found = np.minimum(np.searchsorted(query_keys, keys), len(query_keys) - 1)
    hit = query_keys[found] == keys
    products = np.where(hit, queries.data[found] * labels.data[positions], np.float32(0))
    return np.bincount(pair_of_entry, weights=products, minlength=len(query_rows)).astype(np.float32)


class FusionCandidates:
    """The candidate labels of a block of queries (``ids``, ``-1`` = empty slot) with their dense, ranker and text
    scores, each ``(n, dense_depth + ranker_depth)``; :meth:`top_k` weights and ranks them (so weights can be tuned
    without scoring again)."""

    def __init__(self, ids: np.ndarray, dense: np.ndarray, ranker: np.ndarray, text: np.ndarray):
        self.ids, self.dense, self.ranker, self.text = ids, dense, ranker, text

    def top_k(self, ranker_weight: float, text_weight: float, k: int, dense_weight: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """``(scores, ids)`` of the ``k`` best candidates by ``dense_weight * dense + ranker_weight * ranker + text_weight
        * text``."""
        fused = np.float32(dense_weight) * self.dense + np.float32(ranker_weight) * self.ranker + np.float32(text_weight) * self.text
        fused[self.ids < 0] = -np.inf
        depth = min(k, fused.shape[1])
        order = np.argsort(-fused, axis=1, kind="stable")[:, :depth]
        scores = np.take_along_axis(fused, order, axis=1)
        ids = np.where(np.isfinite(scores), np.take_along_axis(self.ids, order, axis=1), -1)
        out_scores = np.full((len(ids), k), -np.inf, dtype=np.float32)
        out_ids = np.full((len(ids), k), -1, dtype=np.int64)
        out_scores[:, :depth], out_ids[:, :depth] = scores, ids
        return out_scores, out_ids


class LexicalChannel:
    """TF-IDF features, the label TF-IDF rows, an optional Omikuji ranker and the fusion weights (module docstring).

    Args:
        features: the TF-IDF vocabulary and idf.
        label_rows: TF-IDF rows of the label texts, one per model label.
        ranker: an ``omikuji.Model`` (or None: no ranker, or omikuji missing at load time).
        ranker_labels: the model label id of each ranker label (``-1``: removed since); None = identity.
        settings: fusion settings (:data:`DEFAULT_SETTINGS` keys).
        ranker_files: Omikuji's saved files (name -> bytes), kept so that a save writes the ranker back even when
            omikuji is not importable.
        ranker_id: which trained ranker this is (made when it is trained, saved with it): part of :meth:`fingerprint`.
        label_source: the digest of the model's label set the label rows were made from (``provenance.py``: the model
            rebuilds the rows when its labels changed without the channel); None when unknown.
        refit_queries: :func:`query_hashes` of the validation queries the ranker was trained on besides the training
            queries (``refit_lexical_ranker``, after everything was tuned on them), so that a later evaluation or tuning
            on those queries can say its fused figures are not held out; None when the ranker saw none (or was saved
            before this was recorded). Memory: 8 bytes per such query (at most the 2,000 of a default split).
    """

    def __init__(
        self,
        features: TfidfFeatures,
        label_rows: CsrRows,
        ranker=None,
        ranker_labels: Optional[np.ndarray] = None,
        settings: Optional[dict] = None,
        ranker_files: Optional[dict[str, bytes]] = None,
        ranker_id: Optional[str] = None,
        label_source: Optional[str] = None,
        refit_queries: Optional[np.ndarray] = None,
    ):
        self.features = features
        self.label_rows = label_rows
        self.ranker = ranker
        self.ranker_files = ranker_files
        if ranker_id is None and (ranker is not None or ranker_files):
            # a ranker saved before ids were: named by its files' bytes, the same on every load
            ranker_id = digest([part for name in sorted(ranker_files) for part in (name, ranker_files[name])]) if ranker_files else new_ranker_id()
        self.ranker_id = ranker_id
        self.label_source = label_source
        self.refit_queries = None if refit_queries is None else np.asarray(refit_queries, dtype=np.uint64)
        self.ranker_labels = None if ranker_labels is None else np.asarray(ranker_labels, dtype=np.int64)
        unknown = set(settings or {}) - set(DEFAULT_SETTINGS)
        if unknown:
            raise ValueError(f"unknown lexical channel settings {sorted(unknown)}; known: {sorted(DEFAULT_SETTINGS)}")
        self.settings = {**DEFAULT_SETTINGS, **(settings or {})}
        self.tuning: Optional[dict] = None  # set by the fit when it tuned the weights: the grid's scores
        self.ranker_threads = RANKER_THREADS

    @property
    def num_labels(self) -> int:
        return len(self.label_rows)

    @property
    def has_ranker(self) -> bool:
        return self.ranker is not None

    def set_ranker(self, ranker, refit_queries: Optional[Sequence[str]] = None) -> None:
        """A newly trained ranker over the channel's labels (the ids are the model's); it gets a new :attr:`ranker_id`.
        ``refit_queries``: the uids of the validation queries it trained on besides the training ones (none: None)."""
        self.ranker, self.ranker_files, self.ranker_labels, self.ranker_id = ranker, None, None, new_ranker_id()
        self.refit_queries = None if refit_queries is None else query_hashes(refit_queries)

    def queries_seen_by_ranker(self, uids: Sequence[str]) -> int:
        """How many of the queries ``uids`` the ranker trained on as :attr:`refit_queries` (0 when none is recorded):
        a fused ranking of those queries is not a held-out figure."""
        if self.refit_queries is None or not len(self.refit_queries) or not len(uids):
            return 0
        return int(np.isin(query_hashes(uids), self.refit_queries, assume_unique=False).sum())

    def fingerprint(self) -> str:
        """A digest of what the channel's scores depend on: its fusion settings, vocabulary and idf, label rows, and the
        ranker it ranks with now (its id, or none: a ranker saved but not loadable without omikuji scores nothing).
        The score calibration records it (``provenance.py``). The vocabulary and label-row digests are taken once per
        state (the rows are replaced, never edited in place); the rest is a few dozen bytes."""
        features = getattr(self, "_features_digest", None)
        if features is None or features[0] is not self.features:
            features = (self.features, array_digest(self.features.idf) + digest(self.features.terms)
                        + f"{self.features.ngram_max}{self.features.sublinear_tf}")
            self._features_digest = features
        rows = getattr(self, "_rows_digest", None)
        if rows is None or rows[0] is not self.label_rows:
            rows = (self.label_rows, array_digest(self.label_rows.indptr, self.label_rows.indices, self.label_rows.data))
            self._rows_digest = rows
        ranker_map = array_digest(self.ranker_labels) if self.ranker_labels is not None else None
        ranker = [self.ranker_id, ranker_map] if self.ranker is not None else None
        return digest([sorted((k, float(v)) for k, v in self.settings.items()), features[1], rows[1], ranker])

    # ------------------------------------------------------------------ scoring
    def rank_with_ranker(self, queries: CsrRows, depth: int) -> tuple[np.ndarray, np.ndarray]:
        """The ranker's top ``depth`` model label ids (``-1`` padded) and scores of each query row."""
        n = len(queries)
        ids = np.full((n, depth), -1, dtype=np.int64)
        scores = np.zeros((n, depth), dtype=np.float32)
        if self.ranker is None or depth == 0:
            return ids, scores
        beam = int(self.settings["beam_size"])
        rows = [i for i in range(n) if queries.indptr[i + 1] > queries.indptr[i]]

        def predict(i: int) -> list:
            terms, values = queries.row(i)
            return self.ranker.predict(list(zip(terms.tolist(), values.tolist())), beam_size=beam, top_k=depth)

        threads = min(int(self.ranker_threads), len(rows))
        if threads > 1:
            found = ranker_pool(int(self.ranker_threads)).map(predict, rows)
        else:
            found = map(predict, rows)
        for i, hits in zip(rows, found):
            if not hits:
                continue
            labels = np.fromiter((label for label, _ in hits), dtype=np.int64, count=len(hits))
            probs = np.fromiter((p for _, p in hits), dtype=np.float32, count=len(hits))
            if self.ranker_labels is not None:
                inside = labels < len(self.ranker_labels)
                labels = np.where(inside, self.ranker_labels[np.minimum(labels, len(self.ranker_labels) - 1)], -1)
            else:  # the ranker's labels are the model's: one it names beyond them (a foreign ranker file) is dropped
                labels = np.where(labels < self.num_labels, labels, -1)
            keep = labels >= 0
            ids[i, : keep.sum()], scores[i, : keep.sum()] = labels[keep], probs[keep]
        return ids, scores

    def fuse(self, texts: Sequence[str], dense_scores: np.ndarray, dense_ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Fused top-``k`` ``(scores, ids)`` of ``texts`` from their dense search hits (``dense_ids`` ``-1`` padded,
        best first; ``dense_depth`` of them is what the fusion is tuned for)."""
        n = len(texts)
        out_scores = np.full((n, k), -np.inf, dtype=np.float32)
        out_ids = np.full((n, k), -1, dtype=np.int64)
        weights = (float(self.settings["ranker_weight"]), float(self.settings["text_weight"]))
        for start in range(0, n, FUSE_CHUNK):
            stop = min(start + FUSE_CHUNK, n)
            candidates = self.candidates(texts[start:stop], dense_scores[start:stop], dense_ids[start:stop], *weights)
            out_scores[start:stop], out_ids[start:stop] = candidates.top_k(*weights, k, dense_weight=float(self.settings["dense_weight"]))
        return out_scores, out_ids

    def candidates(self, texts: Sequence[str], dense_scores: np.ndarray, dense_ids: np.ndarray, ranker_weight: float = 1.0,
                   text_weight: float = 1.0) -> FusionCandidates:
        """The candidates of ``texts`` (their dense hits and the ranker's) with each channel's score, before weighting;
        a channel whose weight is 0 is not computed. Memory: ``n * ranker_depth * dense_depth`` bytes for the matching."""
        dense_scores, dense_ids = np.asarray(dense_scores, np.float32), np.asarray(dense_ids, np.int64)
        if self.num_labels and dense_ids.size and dense_ids.max() >= self.num_labels:
            raise ValueError(f"dense hits name label {int(dense_ids.max())} but the lexical channel has {self.num_labels} labels")
        queries = self.features.transform(texts)
        rank_ids, rank_probs = self.rank_with_ranker(queries, int(self.settings["ranker_depth"]) if ranker_weight else 0)
        dense_valid = dense_ids >= 0
        # a label the dense search did not return: the dense score of the query's last hit (the bound exact search gives)
        floor = np.where(dense_valid.any(1), np.where(dense_valid, dense_scores, np.inf).min(1), 0.0).astype(np.float32)
        # ranker hits among the dense hits: their probabilities go to the dense column, the ranker column is dropped
        match = (rank_ids[:, :, None] == dense_ids[:, None, :]) & (rank_ids[:, :, None] >= 0)
        dense_rank_prob = np.einsum("nrd,nr->nd", match, rank_probs).astype(np.float32)
        ranker_only = (rank_ids >= 0) & ~match.any(2)
        ids = np.concatenate([dense_ids, np.where(ranker_only, rank_ids, -1)], axis=1)
        dense = np.concatenate([np.where(dense_valid, dense_scores, 0), np.repeat(floor[:, None], rank_ids.shape[1], axis=1)], axis=1)
        ranker = np.concatenate([dense_rank_prob, np.where(ranker_only, rank_probs, 0)], axis=1)
        text = np.zeros_like(dense)
        if text_weight:
            rows, cols = np.nonzero(ids >= 0)
            text[rows, cols] = pair_dot_products(queries, self.label_rows, rows, ids[rows, cols], self.features.num_features)
        return FusionCandidates(ids, dense.astype(np.float32), ranker.astype(np.float32), text)

    # ------------------------------------------------------------------ labels added or removed
    def add_labels(self, texts: Sequence[str]) -> None:
        """Append TF-IDF rows for new labels (the ranker does not know them: they get text and dense scores only)."""
        self.label_rows = CsrRows.concat([self.label_rows, self.features.transform(texts)])

    def replace_labels(self, texts: Sequence[str]) -> None:
        """A new label space: the label TF-IDF rows are recomputed; the ranker, trained on the old labels, is kept only
        when the texts are the same ones in the same order (otherwise it is switched off, with a warning)."""
        rows = self.features.transform(texts)
        same = len(rows) == len(self.label_rows) and np.array_equal(rows.indptr, self.label_rows.indptr) and np.array_equal(
            rows.indices, self.label_rows.indices) and np.allclose(rows.data, self.label_rows.data)
        if not same and (self.ranker is not None or self.ranker_files):
            logger.warning("new label texts: the lexical channel's ranker knew the old labels and is switched off")
            self.ranker_labels = np.full(max(len(self.label_rows), 1), -1, dtype=np.int64)
        self.label_rows = rows

    def select_labels(self, keep: np.ndarray) -> None:
        """Keep the labels whose old ids are ``keep``; new id i = old id ``keep[i]`` (the ranker's map follows)."""
        keep = np.asarray(keep, dtype=np.int64)
        old_to_new = np.full(self.num_labels, -1, dtype=np.int64)
        old_to_new[keep] = np.arange(len(keep))
        current = np.arange(self.num_labels) if self.ranker_labels is None else self.ranker_labels
        self.ranker_labels = np.where(current >= 0, old_to_new[np.maximum(current, 0)], -1)
        self.label_rows = self.label_rows.select(keep)

    # ------------------------------------------------------------------ persistence
    def save(self, path: str) -> None:
        """Write ``lexical_channel.safetensors`` to ``path`` (through a temporary file, renamed into place)."""
        from safetensors.numpy import save_file

        files = self.ranker_files
        if self.ranker is not None:
            with tempfile.TemporaryDirectory(prefix="omikuji_") as tmp:
                self.ranker.save(tmp)
                files = {name: _read(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}
            self.ranker_files = files
        tensors = {
            "vocabulary": np.frombuffer("\n".join(self.features.terms).encode("utf-8"), dtype=np.uint8).copy(),
            "idf": self.features.idf,
            "label_indptr": self.label_rows.indptr,
            "label_indices": self.label_rows.indices,
            "label_data": self.label_rows.data,
        }
        if self.ranker_labels is not None:
            tensors["ranker_labels"] = self.ranker_labels
        if self.refit_queries is not None:
            tensors["ranker_refit_queries"] = self.refit_queries
        for name, data in (files or {}).items():
            tensors[f"ranker/{name}"] = np.frombuffer(data, dtype=np.uint8).copy()
        metadata = {
            "format": LEXICAL_FORMAT,
            "ngram_max": str(self.features.ngram_max),
            "sublinear_tf": json.dumps(self.features.sublinear_tf),
            "ranker": "omikuji" if files else "",
            "ranker_files": json.dumps(sorted(files or {})),
            "ranker_id": self.ranker_id or "",
            "label_source": self.label_source or "",
        }
        atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))

    @classmethod
    def load(cls, path: str, settings: Optional[dict] = None) -> LexicalChannel:
        """Read a saved channel, checked whole before anything is served (a :class:`ModelFileError` naming ``path`` and the
        fault: not safetensors, a tensor missing or out of range, a listed ranker file not stored or unreadable); without
        omikuji installed its ranker is skipped with a warning."""
        tensors, metadata = read_safetensors_with_metadata(path, "numpy", ("vocabulary", "idf", "label_indptr", "label_indices", "label_data"))
        if metadata.get("format") != LEXICAL_FORMAT:
            raise ModelFileError(f"{path}: not a lexical channel file (format {metadata.get('format')!r}, expected {LEXICAL_FORMAT!r})")
        try:
            vocabulary = tensors["vocabulary"].tobytes().decode("utf-8")
            ngram_max, sublinear_tf = int(metadata["ngram_max"]), json.loads(metadata["sublinear_tf"])
            names = json.loads(metadata.get("ranker_files", "[]"))
            if not isinstance(names, list):
                raise TypeError(f"ranker_files is a {type(names).__name__}")
        except (ValueError, KeyError, TypeError) as err:  # UnicodeDecodeError is a ValueError
            raise ModelFileError(f"{path}: malformed lexical channel metadata ({type(err).__name__}: {err})") from None
        terms = vocabulary.split("\n") if vocabulary else []
        if tensors["idf"].ndim != 1 or len(tensors["idf"]) != len(terms):
            raise ModelFileError(f"{path}: idf has shape {list(tensors['idf'].shape)} for {len(terms)} vocabulary terms")
        features = TfidfFeatures(terms, tensors["idf"], ngram_max, sublinear_tf)
        check_csr(path, tensors["label_indptr"], tensors["label_indices"], tensors["label_data"], len(terms), "label TF-IDF rows")
        label_rows = CsrRows(tensors["label_indptr"], tensors["label_indices"], tensors["label_data"])
        ranker_labels = tensors.get("ranker_labels")
        if ranker_labels is not None:
            if ranker_labels.ndim != 1 or (len(ranker_labels) and (int(ranker_labels.min()) < -1 or int(ranker_labels.max()) >= len(label_rows))):
                raise ModelFileError(f"{path}: ranker_labels holds label ids outside [-1, {len(label_rows)}) (shape {list(ranker_labels.shape)})")
        refit_queries = tensors.get("ranker_refit_queries")
        if refit_queries is not None and (refit_queries.ndim != 1 or refit_queries.dtype != np.uint64):
            raise ModelFileError(f"{path}: ranker_refit_queries is {refit_queries.dtype} of shape {list(refit_queries.shape)}, not a list of 64-bit hashes")
        files = {}
        for name in names:
            check_listed_name(path, name, "ranker file")
            if "/" in name or "\\" in name:
                raise ModelFileError(f"{path}: lists ranker file {name!r}, which is no plain file name")
            if f"ranker/{name}" not in tensors:
                raise ModelFileError(f"{path}: lists ranker file {name!r} but does not store it")
            files[name] = tensors[f"ranker/{name}"].tobytes()
        ranker = None
        if files:
            if omikuji is None:
                logger.warning(
                    "%s: the lexical channel's ranker needs the omikuji package (pip install omikuji); predicting with the "
                    "dense and label-text scores only", path,
                )
            else:
                try:
                    ranker = load_omikuji(files)
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as err:  # omikuji's RuntimeError, or a Rust panic (a BaseException) on garbage bytes
                    raise ModelFileError(f"{path}: the ranker's files do not load as an Omikuji model ({type(err).__name__}: {err})") from None
        return cls(features, label_rows, ranker, ranker_labels, settings, ranker_files=files or None,
                   ranker_id=metadata.get("ranker_id") or None, label_source=metadata.get("label_source") or None, refit_queries=refit_queries)


def query_hashes(uids: Sequence[str]) -> np.ndarray:
    """Sorted unique 64-bit hashes (blake2b) of query uids: which queries a ranker trained on, in 8 bytes a query."""
    import hashlib

    return np.unique(np.fromiter((int.from_bytes(hashlib.blake2b(uid.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little") for uid in uids),
                                 dtype=np.uint64, count=len(uids)))


def new_ranker_id() -> str:
    """A fresh id for a newly trained ranker (16 hex digits)."""
    import uuid

    return uuid.uuid4().hex[:16]


def load_omikuji(files: dict[str, bytes]):
    """An ``omikuji.Model`` from its saved files (written to a temporary directory, which is removed)."""
    tmp = tempfile.mkdtemp(prefix="omikuji_")
    try:
        for name, data in files.items():
            if os.path.basename(name) != name:
                raise ValueError(f"unexpected ranker file name {name!r}")
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        with _quiet_output():
            return omikuji.Model.load(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _quiet_output:
    """Send file descriptors 1 and 2 to a temporary file while Omikuji's Rust code logs (stdout) and draws progress
    bars (stderr); the captured text is kept in ``.text`` and logged when the wrapped call fails."""

    def __enter__(self):
        self.text = ""
        try:
            self._saved = [os.dup(1), os.dup(2)]
        except OSError:  # no usable descriptors (embedded interpreters): leave them alone
            self._saved = None
            return self
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self._file = tempfile.TemporaryFile()
        os.dup2(self._file.fileno(), 1)
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, exc_type, exc, tb):
        if self._saved is None:
            return False
        for fd, saved in zip((1, 2), self._saved):
            os.dup2(saved, fd)
            os.close(saved)
        self._file.seek(0)
        self.text = self._file.read().decode("utf-8", "replace")
        self._file.close()
        if exc_type is not None and self.text:
            logger.error("omikuji output before the failure:\n%s", self.text[-4000:])
        return False


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()

