"""What an hf_xmc model's derived parts are checked against: :class:`ModelProvenanceMixin`, a base of
``XMCPreTrainedModel``.

The fingerprints of the model's own inputs (its weights, its label set, the ranking ``predict`` returns) and the two
derived parts that are checked on every ranking: the lexical channel's label rows (rebuilt when the labels changed
without it) and the score calibration (dropped with a warning when the ranking it was fitted on changed). The helper
that records and compares fingerprints, and the list of derived parts with their policies, is ``provenance.py``;
docs/architecture.md has the table.

Memory: the cached weights fingerprint (two float64 per parameter and buffer) and label digest (16 characters).
Remote-code file: imports torch, numpy and its siblings.
"""

import math
from typing import Optional

import numpy as np
import torch

from .calibration import ScoreCalibration
from .lexical_channel import LexicalChannel
from .provenance import check_derived, digest, fingerprint_of

# How many parameters, buffers and submodules torch has registered on any module in this process: torch calls these
# global hooks on every registration (a new layer, a replaced embedding, a PEFT adapter), so a model's cached list of
# its own tensors is good while the count stands still (ModelProvenanceMixin._weight_tensors).
_REGISTRATIONS = [0]


def _count_registration(*args) -> None:
    _REGISTRATIONS[0] += 1


for _hook in ("register_module_parameter_registration_hook", "register_module_buffer_registration_hook",
              "register_module_module_registration_hook"):
    getattr(torch.nn.modules.module, _hook)(_count_registration)


#: elements of a weight tensor converted to float64 at a time by :meth:`ModelProvenanceMixin.weights_fingerprint`
FINGERPRINT_CHUNK = 1 << 22


def _sum_and_norm(tensor: torch.Tensor) -> tuple[float, float]:
    """``(sum, L2 norm)`` of a tensor's values, accumulated in float64 over chunks of :data:`FINGERPRINT_CHUNK`."""
    flat = tensor.reshape(-1)
    total = squares = 0.0
    for start in range(0, flat.numel(), FINGERPRINT_CHUNK):
        chunk = flat[start : start + FINGERPRINT_CHUNK].double()
        total += float(chunk.sum())
        squares += float(torch.dot(chunk, chunk))
    return total, math.sqrt(squares)


class ModelProvenanceMixin:
    """Fingerprints of an ``XMCPreTrainedModel``'s weights, labels and ranking, and the checked lexical channel and
    score calibration (module docstring)."""

    def weights_fingerprint(self) -> tuple[float, ...]:
        """The sum and norm of every parameter and buffer: what an optimiser step (even a sparse one) or a load
        changes. Accumulated in float64: a float32 sum depends on the reduction order, so another thread count (or
        device) gave a different fingerprint for the same weights (a MiniLM bias sum of -0.0436 moved by 2e-6 from 2
        threads to 1, enough to refuse an ONNX export as stale). Memory: one float64 copy of :data:`FINGERPRINT_CHUNK`
        elements at a time (32 MB; converting once and reducing the copy twice took half the time of two reductions
        that each convert: ~50 ms a MiniLM, paid at every load); time: one pass over the weights, taken again only when a weight was written since the last call (torch's
        version counters and storage pointers: an optimiser step, ``load_state_dict`` or ``.to()`` changes them; torch's
        fused AdamW does not bump the counters, hence :meth:`invalidate_weights_fingerprint`)."""
        tensors = self._weight_tensors()
        key = (self.weights_epoch, *((t.data_ptr(), t._version, t.dtype, t.device.type) for t in tensors))
        cached = getattr(self, "_weights_fingerprint_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        value = tuple(v for t in tensors for v in _sum_and_norm(t.detach()))
        self._weights_fingerprint_cache = (key, value)
        return value

    def weights_version(self) -> tuple[int, int]:
        """A cheap key that changes whenever a weight may have been written: :attr:`weights_epoch` and the sum of the
        parameters' and buffers' version counters (no pass over their values). The caches of checks against the weights
        (the ONNX export's, the static encoder's) key on it."""
        return self.weights_epoch, sum(t._version for t in self._weight_tensors())

    def _weight_tensors(self) -> tuple[torch.Tensor, ...]:
        """``(*self.parameters(), *self.buffers())``, walked again only after torch registered a parameter, buffer or
        module anywhere (the global count above) or this model's tensors were converted (:meth:`_apply`): the walk
        over a MiniLM's 123 modules took 0.26 ms, and every ``predict`` checks its derived parts against the weights
        two to four times. Memory: one tuple of references."""
        cached = getattr(self, "_weight_tensors_cache", None)
        if cached is None or cached[0] != _REGISTRATIONS[0]:
            cached = (_REGISTRATIONS[0], (*self.parameters(), *self.buffers()))
            self._weight_tensors_cache = cached
        return cached[1]

    def _apply(self, fn, *args, **kwargs):
        # .to(), .half(), .cuda(), ...: torch may put new Parameter objects in place without registering them
        result = super()._apply(fn, *args, **kwargs)
        self._weight_tensors_cache = None
        return result

    @property
    def weights_epoch(self) -> int:
        """How many times :meth:`invalidate_weights_fingerprint` was called: part of every cache keyed on the weights."""
        return getattr(self, "_weights_epoch", 0)

    def invalidate_weights_fingerprint(self) -> None:
        """Forget what was cached about the weights (their fingerprint, the checks of the ONNX export and the static
        query encoder against them). For code that writes weights in place without bumping torch's version counters:
        torch's fused AdamW (transformers' default ``adamw_torch_fused``) does not, so ``XMCTrainer`` calls this after
        every optimizer step; a training loop of your own with a fused optimizer calls it once it is done."""
        self._weights_epoch = self.weights_epoch + 1
        self._weights_fingerprint_cache = self._weight_tensors_cache = None

    def weights_summary(self) -> list[float]:
        """Four numbers that change with any weight, kept in the fingerprints of derived parts (a config stays small):
        the plain and position-weighted totals of the tensors' norms and absolute sums (no cancellation, so float64
        rounding stays far under the 1e-9 the check allows). Cached as :meth:`weights_fingerprint`."""
        values = np.asarray(self.weights_fingerprint(), dtype=np.float64).reshape(-1, 2)
        position = np.arange(1, len(values) + 1, dtype=np.float64) / max(len(values), 1)
        sums, norms = np.abs(values[:, 0]), values[:, 1]
        return [float(norms.sum()), float((position * norms).sum()), float(sums.sum()), float((position * sums).sum())]

    def labels_digest(self) -> Optional[str]:
        """A digest of the label set (uids and texts, in id order), or None without labels; taken once per label list
        (``set_labels``, ``add_labels`` and ``remove_labels`` assign a new one). Memory: none kept but the digest."""
        texts = self.label_texts
        if texts is None:
            return None
        cached = getattr(self, "_labels_digest_cache", None)
        if cached is None or cached[0] is not texts or cached[1] is not self.label_uids:
            cached = (texts, self.label_uids, digest([*(self.label_uids or ()), "\x01", *texts]))
            self._labels_digest_cache = cached
        return cached[2]

    def seed_labels_digest(self, value: str) -> None:
        """Take ``value`` as the digest of the current label lists (read on demand from the file whose record holds
        it: ``label_file.py``) instead of reading every text for it."""
        self._labels_digest_cache = (self.label_texts, self.label_uids, value)

    def ranking_fingerprint(self) -> dict:
        """What the ranking :meth:`predict` returns is made from: the weights, the labels, the search mode, the lexical
        channel (its weights, rows and ranker, or None), the query encoder and, for a model that has them, the values of
        its ``tunable_ranking_settings`` in use (SiameseXML's classifier share; the static encoder's own while it ranks).
        The score calibration records it when it is attached and is dropped when it no longer matches
        (``provenance.py``; a calibration recorded before the settings were part of it is not checked on them)."""
        channel = self.lexical_channel
        settings = {key: float(getattr(self.config, key)) for key in getattr(self, "tunable_ranking_settings", {})}
        return fingerprint_of(weights=self.weights_summary(), labels=self.labels_digest(), search_mode=self.search_mode,
                              channel=channel.fingerprint() if channel is not None else None, query_encoder=self.query_encoder_fingerprint(),
                              **({"ranking_settings": settings} if settings else {}))

    def current_lexical_channel(self) -> Optional[LexicalChannel]:
        """The lexical channel as :meth:`predict` fuses it, checked against the model's labels first: label rows made for
        another label set (labels changed without the channel) are rebuilt from the label texts (``provenance.py``:
        policy ``rebuild``; a ranker trained on other labels is switched off, with a warning)."""
        channel = self.lexical_channel
        if channel is None or channel.label_source is None:
            return channel
        labels = self.labels_digest()
        if not check_derived("lexical_channel", {"labels": channel.label_source}, {"labels": labels}, type(self).__name__):
            channel.replace_labels(self._require_labels())
            channel.label_source = labels
        return channel

    def _sync_lexical_channel_labels(self) -> None:
        """Record that the channel's label rows now follow the model's labels (after the model updated them itself)."""
        if self.lexical_channel is not None:
            self.lexical_channel.label_source = self.labels_digest()

    @property
    def score_calibration(self) -> Optional[ScoreCalibration]:
        """The map from predict's scores to probabilities of relevance (``config.score_calibration``), or None. It is
        tied to the ranking it was fitted on (:meth:`ranking_fingerprint`, recorded under its ``"fingerprint"``): once
        the weights, labels, search mode, lexical channel (or its ranker: not loadable without omikuji) differ, it is
        dropped with a one-line warning and this is None until it is fitted again (``provenance.py``, policy ``drop``).
        A calibration saved before fingerprints is trusted as loaded. The check costs a few dictionary compares (the
        weights' fingerprint is taken again only after a weight was written)."""
        values = self._calibration_values()  # the tower's (config.score_calibration) or the static encoder's
        if not values:
            return None
        cached = getattr(self, "_score_calibration_cache", None)
        if cached is None or cached[0] is not values:
            cached = (values, ScoreCalibration.from_dict(values))
            self._score_calibration_cache = cached
        recorded = values.get("fingerprint")
        if recorded and not check_derived("score_calibration", recorded, self.ranking_fingerprint(), type(self).__name__,
                                          "no probabilities or threshold= until it is fitted again (fit_score_calibration)"):
            self._store_calibration_values(None)
            return None
        return cached[1]

    def set_score_calibration(self, calibration: Optional[ScoreCalibration]) -> None:
        """Attach a fitted calibration (``hf_xmc.training.calibration.fit_score_calibration``), saved in the config with
        the fingerprint of the ranking it applies to (the current one: :meth:`ranking_fingerprint`); None removes it."""
        if calibration is None:
            self._store_calibration_values(None)
            return
        self._store_calibration_values({**calibration.to_dict(), "fingerprint": self.ranking_fingerprint()})

    def unfused_items(self, texts, images=None) -> np.ndarray:
        """Which items the model ranks without its lexical channel (a boolean per item): none for a text model, whose
        every query is fused. A score calibration fitted with a channel maps the fused ranking's scores, so its fit
        leaves these items out and :meth:`predict` gives them no probabilities (MUFIN: items without a text)."""
        return np.zeros(len(texts) if texts is not None else len(images or ()), dtype=bool)
