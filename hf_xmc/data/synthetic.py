"""Synthetic XMC tasks with planted structure, cheap enough for scale tests with millions of labels.

Every label owns ``words_per_label`` *topic words*; a point draws a few labels (optionally with
Zipf-skewed popularity, as in real XMC data), takes 2 topic words from each of them and mixes them
with ``noise_words`` words drawn from a separate pool of ``noise_vocab`` noise words, in random
order (with ``topic_size``, a point's labels mostly come from one block of popularity ranks, so labels co-occur
by topic). A label's text is ``"label " + its topic words``. So a point's labels are exactly recoverable
from its text, and label-text models (dual encoders) can match points to label texts.

Words are pronounceable strings of 2-letter consonant+vowel syllables, all of the same length
(4, 6, 8 or 10 letters depending on the vocabulary size; always an even length, so never the word
``label``). Word ``x`` of the vocabulary is spelled from an affine bijection of ``x`` (seeded), so
word spelling does not reveal the label id. Topic word ``s`` of label ``l`` is vocabulary entry
``l * words_per_label + s``; noise word ``j`` is entry ``num_labels * words_per_label + j``.

Memory cost:

* labels: O(1). :class:`SyntheticLabelTexts` and :class:`SyntheticLabelUids` are lazy sequences that
  spell a label's text from its id on access, so 10M labels cost nothing until texts are read; the
  Zipf sampler uses a closed-form inverse CDF and an affine id permutation (no per-label arrays).
* points: sampling is vectorised with numpy (no per-point Python loop), in blocks of 131,072 points drawn from one
  generator (a task that fits one block is what a single draw gives). The work arrays of a block take about
  0.5-0.6 KB per point with the defaults (~70 MB per block; with 43 labels per point ~1 GB), whatever the number
  of points. What remains is ~200 bytes per point plus ~25 per word of its text: one Python ``str`` per point text
  (~50 bytes + 9-11 bytes per word), one uid string, and the CSR targets (8 bytes per (point, label) pair: int32
  label id + float32 value). So ~30M short points fit in 24 GiB; labels are free. Measured at the
  LF-AmazonTitles-1.3M shape (2.25M points, 22 labels and ~48 words each): see ``benchmarks/bench_scale.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import overload

import numpy as np
import scipy.sparse as sp

from .xc_raw import XCData, XMCDataset

__all__ = ["make_synthetic_xmc", "SyntheticLabelTexts", "SyntheticLabelUids"]

_CONSONANTS = "bcdfghjklmnprstvwxyz"  # 20
_VOWELS = "aeiou"  # 5 -> 100 syllables
_SYLLABLES = np.array([[ord(c), ord(v)] for c in _CONSONANTS for v in _VOWELS], dtype=np.uint8)
_BASE = len(_SYLLABLES)
_MAX_SYLLABLES = 5  # 100**5 = 1e10 words; keeps a * x < 2**63 for a < 2**29
_CHUNK = 1 << 16
_POINT_BLOCK = 1 << 17  # points drawn at once: bounds the (points, labels per point) work arrays


class _WordCoder:
    """Spells vocabulary ids as fixed-length syllable words through a seeded affine bijection."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        """Pick the word length and the bijection ``x -> (a * x + b) mod BASE**n_syllables``."""
        n_syl = 2
        while _BASE ** n_syl < vocab_size:
            n_syl += 1
        if n_syl > _MAX_SYLLABLES:
            raise ValueError(f"vocabulary of {vocab_size} words is too large (max {_BASE ** _MAX_SYLLABLES})")
        self.n_syl = n_syl
        self.modulus = _BASE ** n_syl
        rng = np.random.default_rng([seed, 0x5EED])
        a = int(rng.integers(1 << 20, 1 << 29))
        while a % 2 == 0 or a % 5 == 0:  # coprime to 100**n, hence a bijection
            a += 1
        self.a = a
        self.b = int(rng.integers(0, self.modulus))

    @property
    def width(self) -> int:
        """Number of letters of every word."""
        return 2 * self.n_syl

    def letters(self, ids: np.ndarray) -> np.ndarray:
        """Return the ``(len(ids), width)`` uint8 ASCII letters of the words with the given ids."""
        x = (np.asarray(ids, dtype=np.int64) * self.a + self.b) % self.modulus
        out = np.empty((x.size, self.width), dtype=np.uint8)
        for s in range(self.n_syl):
            out[:, 2 * s:2 * s + 2] = _SYLLABLES[x % _BASE]
            x //= _BASE
        return out

    def words(self, ids: np.ndarray) -> list[str]:
        """Return the words with the given ids as Python strings."""
        lt = self.letters(ids)
        if not lt.size:
            return []
        s = lt.tobytes().decode("ascii")
        w = self.width
        return [s[i:i + w] for i in range(0, len(s), w)]


class _LazyLabelSequence(Sequence):
    """Base for lazy per-label string sequences (int and slice indexing, chunked iteration)."""

    def __init__(self, num_labels: int) -> None:
        """Store the number of labels."""
        self.num_labels = int(num_labels)

    def __len__(self) -> int:
        """Number of labels."""
        return self.num_labels

    def _many(self, ids: np.ndarray) -> list[str]:
        """Return the strings of the given label ids (vectorised)."""
        raise NotImplementedError

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        """Return the string of one label, or a list for a slice."""
        if isinstance(index, slice):
            return self._many(np.arange(*index.indices(self.num_labels), dtype=np.int64))
        i = int(index)  # accepts numpy integers
        if i < 0:
            i += self.num_labels
        if not 0 <= i < self.num_labels:
            raise IndexError(f"label index {index} out of range for {self.num_labels} labels")
        return self._many(np.array([i], dtype=np.int64))[0]

    def __iter__(self) -> Iterator[str]:
        """Iterate in vectorised chunks."""
        for start in range(0, self.num_labels, _CHUNK):
            yield from self._many(np.arange(start, min(start + _CHUNK, self.num_labels), dtype=np.int64))

    def __repr__(self) -> str:
        """Short representation (never materialises the texts)."""
        return f"{type(self).__name__}(num_labels={self.num_labels})"


class SyntheticLabelTexts(_LazyLabelSequence):
    """Lazy label texts ``"label w1 w2 ..."`` of a synthetic task, computed from the label id on access."""

    def __init__(self, num_labels: int, words_per_label: int, coder: _WordCoder) -> None:
        """Create the lazy sequence (O(1) memory)."""
        super().__init__(num_labels)
        self.words_per_label = int(words_per_label)
        self._coder = coder

    def label_words(self, label_id: int) -> list[str]:
        """Return the topic words of one label."""
        if not 0 <= label_id < self.num_labels:
            raise IndexError(f"label index {label_id} out of range for {self.num_labels} labels")
        wpl = self.words_per_label
        return self._coder.words(np.arange(label_id * wpl, (label_id + 1) * wpl, dtype=np.int64))

    def _many(self, ids: np.ndarray) -> list[str]:
        """Spell the texts of the given label ids."""
        wpl = self.words_per_label
        words = self._coder.words((ids[:, None] * wpl + np.arange(wpl)).reshape(-1))
        return ["label " + " ".join(words[j * wpl:(j + 1) * wpl]) for j in range(len(ids))]


class SyntheticLabelUids(_LazyLabelSequence):
    """Lazy label uids ``"L<id>"`` of a synthetic task."""

    def _many(self, ids: np.ndarray) -> list[str]:
        """Spell the uids of the given label ids."""
        return [f"L{i}" for i in ids.tolist()]


def _label_ranks(rng: np.random.Generator, num_labels: int,
                 zipf_a: float | None) -> tuple[Callable[[int | tuple[int, ...]], np.ndarray], Callable[[np.ndarray], np.ndarray]]:
    """Return ``(draw_ranks, rank_to_id)``: popularity ranks drawn uniformly or by Zipf(zipf_a), and the seeded
    bijection from rank to label id (the identity for uniform draws)."""
    if zipf_a is None:
        return (lambda size: rng.integers(0, num_labels, size=size, dtype=np.int64)), (lambda rank: rank)
    # popularity rank -> label id by an affine bijection mod num_labels (no O(num_labels) array)
    c = int(rng.integers(1, max(num_labels, 2)))
    while math.gcd(c, num_labels) != 1:
        c += 1
    d = int(rng.integers(0, num_labels))
    s = float(zipf_a)
    top = float(num_labels) + 1.0

    def draw_ranks(size: int | tuple[int, ...]) -> np.ndarray:
        """Sample by inverting the CDF of the continuous density x**-s on [1, num_labels + 1)."""
        u = rng.random(size)
        if abs(s - 1.0) < 1e-9:
            x = np.power(top, u)
        else:
            x = np.power(1.0 + u * (top ** (1.0 - s) - 1.0), 1.0 / (1.0 - s))
        return np.clip(np.floor(x).astype(np.int64) - 1, 0, num_labels - 1)

    return draw_ranks, (lambda rank: (rank * c + d) % num_labels)


def _topical_rows(rng: np.random.Generator, draw_ranks: Callable, rank_to_id: Callable, num_labels: int, topic_size: int,
                  topic_share: float) -> Callable[[int, int], np.ndarray]:
    """Return ``rows(n, width) -> (n, width)`` label ids whose columns after the first share the first label's topic
    with probability ``topic_share``.

    Topics are blocks of ``topic_size`` consecutive popularity ranks (popular labels share topics, as the big
    categories of a catalogue do). A topical draw keeps the point's first label's block and takes its position in
    the block from a fresh draw of the same law, so block frequencies keep the law's shape and only the spread
    within a block flattens. O(1) memory per label, as the plain sampler.
    """

    def rows(n: int, width: int) -> np.ndarray:
        ranks = draw_ranks((n, width))
        moved = (ranks[:, :1] // topic_size) * topic_size + ranks % topic_size
        topical = rng.random((n, width)) < topic_share
        topical[:, 0] = False
        ranks = np.where(topical & (moved < num_labels), moved, ranks)
        return rank_to_id(ranks)

    return rows


def make_synthetic_xmc(num_labels: int, num_train: int, num_test: int, words_per_label: int = 4,
                       labels_per_point: tuple[int, int] = (1, 3), noise_words: int = 2,
                       zipf_a: float | None = 1.1, seed: int = 0, noise_vocab: int = 1000,
                       topic_size: int | None = None, topic_share: float = 0.8) -> XCData:
    """Generate a synthetic XMC task with planted label words (see the module docstring for the memory cost).

    With ``topic_size``, labels fall into topics of about that many labels and each label of a point after its first
    comes from the first one's topic with probability ``topic_share`` (else from the whole label space): labels then
    co-occur by topic, as real ones do, instead of at random (a method that smooths over co-occurrence, such as
    SiameseXML's label graph and centroids, otherwise pulls every label towards the mean). ``None`` keeps the
    independent draws (and the very same task for a given seed)."""
    lo, hi = (int(v) for v in labels_per_point)
    if num_labels < 1:
        raise ValueError(f"num_labels must be >= 1, got {num_labels}")
    if num_train < 0 or num_test < 0:
        raise ValueError("num_train and num_test must be >= 0")
    if words_per_label < 1:
        raise ValueError(f"words_per_label must be >= 1, got {words_per_label}")
    if not 1 <= lo <= hi:
        raise ValueError(f"labels_per_point must satisfy 1 <= min <= max, got {labels_per_point}")
    if noise_words < 0 or noise_vocab < 1:
        raise ValueError("noise_words must be >= 0 and noise_vocab >= 1")
    if zipf_a is not None and zipf_a <= 0:
        raise ValueError(f"zipf_a must be > 0 or None, got {zipf_a}")
    if topic_size is not None and topic_size < 1:
        raise ValueError(f"topic_size must be >= 1 or None, got {topic_size}")
    if not 0.0 <= topic_share <= 1.0:
        raise ValueError(f"topic_share must be in [0, 1], got {topic_share}")

    coder = _WordCoder(num_labels * words_per_label + noise_vocab, seed)
    rng = np.random.default_rng(seed)
    draw_ranks, rank_to_id = _label_ranks(rng, num_labels, zipf_a)

    def draw(size: int | tuple[int, ...]) -> np.ndarray:  # redraws of duplicates: never through the topics
        return rank_to_id(draw_ranks(size))

    def draw_rows(n: int, width: int) -> np.ndarray:  # each point's first draw of labels
        return draw((n, width))

    if topic_size is not None:
        draw_rows = _topical_rows(rng, draw_ranks, rank_to_id, num_labels, topic_size, topic_share)
    n = num_train + num_test
    hi = min(hi, num_labels)
    lo = min(lo, hi)
    texts: list[str] = []
    counts, indices = [], []
    for start in range(0, n, _POINT_BLOCK):  # blocks share one generator: a task fitting one block is unchanged
        block_texts, block_counts, block_indices = _sample_points(
            rng, draw, draw_rows, coder, min(_POINT_BLOCK, n - start), lo, hi, num_labels, words_per_label, noise_words,
            noise_vocab,
        )
        texts.extend(block_texts)
        counts.append(block_counts)
        indices.append(block_indices)
        del block_texts
    counts_all = np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts_all, out=indptr[1:])
    index_dtype = np.int32 if num_labels < np.iinfo(np.int32).max and indptr[-1] < np.iinfo(np.int32).max else np.int64
    all_indices = np.concatenate(indices).astype(index_dtype) if indices else np.zeros(0, dtype=index_dtype)
    del indices
    targets = sp.csr_matrix((np.ones(all_indices.size, dtype=np.float32), all_indices, indptr.astype(index_dtype)), shape=(n, num_labels))
    targets.has_sorted_indices = True

    train = XMCDataset(texts=texts[:num_train], targets=targets[:num_train],
                       uids=[f"trn{i}" for i in range(num_train)])
    test = XMCDataset(texts=texts[num_train:], targets=targets[num_train:],
                      uids=[f"tst{i}" for i in range(num_test)])
    return XCData(train=train, test=test,
                  label_texts=SyntheticLabelTexts(num_labels, words_per_label, coder),
                  label_uids=SyntheticLabelUids(num_labels))


def _sample_points(rng: np.random.Generator, draw: Callable, draw_rows: Callable[[int, int], np.ndarray], coder: _WordCoder,
                   n: int, lo: int, hi: int, num_labels: int, words_per_label: int, noise_words: int,
                   noise_vocab: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Draw ``n`` points: their texts, label counts and sorted label ids (concatenated), see the module docstring."""
    # --- labels: (n, hi) draws, of which the first k[i] are used; duplicates within a row are redrawn
    k = rng.integers(lo, hi + 1, size=n)
    cols = np.arange(hi)
    valid = cols[None, :] < k[:, None]
    lab = draw_rows(n, hi)
    for attempt in range(33):
        check = np.where(valid, lab, -1 - cols[None, :])  # unused slots get distinct negative sentinels
        order = np.argsort(check, axis=1, kind="stable")
        srt = np.take_along_axis(check, order, axis=1)
        dup = np.zeros_like(valid)
        dup[:, 1:] = srt[:, 1:] == srt[:, :-1]
        r, j = np.nonzero(dup)
        if not r.size:
            break
        c = order[r, j]
        if attempt == 32:  # give up on pathological cases (tiny label sets): drop the duplicates
            valid[r, c] = False
        else:
            lab[r, c] = draw(r.size)
    counts = valid.sum(axis=1)
    srt = np.sort(np.where(valid, lab, num_labels), axis=1)
    indices = srt[cols[None, :] < counts[:, None]]
    del srt

    # --- words: min(2, wpl) distinct topic words per label + noise words, shuffled within the point
    wpe = min(2, words_per_label)
    offset = rng.integers(0, words_per_label, size=(n, hi, 1))
    slots = (offset + np.arange(wpe)) % words_per_label
    topic = (lab[:, :, None] * words_per_label + slots).reshape(n, hi * wpe)
    topic_valid = np.repeat(valid, wpe, axis=1)
    noise = num_labels * words_per_label + rng.integers(0, noise_vocab, size=(n, noise_words))
    tokens = np.concatenate([topic, noise], axis=1)
    tok_valid = np.concatenate([topic_valid, np.ones((n, noise_words), dtype=bool)], axis=1)
    keys = rng.random(tokens.shape)
    keys[~tok_valid] = 2.0
    order = np.argsort(keys, axis=1)
    tokens = np.take_along_axis(tokens, order, axis=1)
    n_tok = tok_valid.sum(axis=1)
    flat = tokens[np.arange(tokens.shape[1])[None, :] < n_tok[:, None]]
    del keys, order, tokens, topic, noise, tok_valid, topic_valid

    w = coder.width
    buf = np.full((flat.size, w + 1), ord(" "), dtype=np.uint8)
    buf[:, :w] = coder.letters(flat)
    buf[np.cumsum(n_tok) - 1, w] = ord("\n")
    texts = buf.tobytes().decode("ascii").split("\n")[:-1] if n else []
    del buf, flat
    return texts, counts, indices

