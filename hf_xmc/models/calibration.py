"""Score calibration: a model's ranking scores mapped to the probability that a label is relevant.

A model's scores rank labels but mean nothing on their own (a cosine for DEXML, a classifier logit for UniDEC, a sum
with the lexical channel's weights). A calibration fitted on validation queries the model has not trained on
(``hf_xmc.training.calibration.fit_score_calibration``) turns them into probabilities, so that a user can ask for
"every label above 0.5" (``model.predict(texts, threshold=0.5)``) instead of a fixed ``k``:

* ``isotonic``: the non-decreasing step function of the score with the least squared error on the validation pairs
  (pool-adjacent-violators), kept as its breakpoints and read by linear interpolation between them, clamped at both
  ends;
* ``platt``: ``1 / (1 + exp(-(a * score + b)))`` (Platt scaling, with Platt's smoothed targets).

Both map a higher score to a probability at least as high, so thresholding the top ``k`` by probability keeps a prefix
of the ranking. Saved in ``config.score_calibration`` (a small dict of numbers: no file, no pickle) and read back by
remote code; memory: the breakpoints, at most a few hundred pairs of floats.

This file is part of the remote-code bundle of every hf_xmc model: it imports numpy only.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

CALIBRATION_METHODS = ("isotonic", "platt")


class ScoreCalibration:
    """A fitted map from scores to probabilities of relevance (module docstring).

    Args:
        method: ``"isotonic"`` or ``"platt"``.
        x / y: the isotonic breakpoints (scores increasing, probabilities non-decreasing).
        a / b: Platt's slope and intercept.
        info: what it was fitted on (queries, depth, which scores), kept in the config beside it.
    """

    def __init__(self, method: str, x: Optional[np.ndarray] = None, y: Optional[np.ndarray] = None, a: float = 1.0, b: float = 0.0,
                 info: Optional[dict] = None):
        if method not in CALIBRATION_METHODS:
            raise ValueError(f"score calibration method must be one of {CALIBRATION_METHODS}, got {method!r}")
        self.method = method
        self.info = dict(info or {})
        if method == "isotonic":
            x = np.asarray(x, dtype=np.float64)
            y = np.asarray(y, dtype=np.float64)
            if x.ndim != 1 or x.shape != y.shape or len(x) == 0:
                raise ValueError(f"isotonic calibration needs breakpoints x and y of one equal length, got {x.shape} and {y.shape}")
            if np.any(np.diff(x) < 0) or np.any(np.diff(y) < -1e-12) or y.min() < 0 or y.max() > 1 or not np.isfinite(x).all():
                raise ValueError("isotonic calibration breakpoints must be finite, x increasing and y non-decreasing in [0, 1]")
            self.x, self.y = x, y
        else:
            if not (np.isfinite(a) and np.isfinite(b)) or a < 0:
                raise ValueError(f"Platt calibration needs a finite slope >= 0 and intercept, got a={a}, b={b}")
            self.a, self.b = float(a), float(b)

    def __call__(self, scores: np.ndarray) -> np.ndarray:
        """The probability of relevance of each score (same shape, float32); ``-inf`` (an empty slot) gives 0."""
        scores = np.asarray(scores, dtype=np.float64)
        finite = np.isfinite(scores)
        safe = np.where(finite, scores, 0.0)
        if self.method == "isotonic":
            probs = np.interp(safe, self.x, self.y)
        else:
            probs = 1.0 / (1.0 + np.exp(-np.clip(self.a * safe + self.b, -50.0, 50.0)))
        return np.where(finite, probs, np.where(scores > 0, 1.0, 0.0)).astype(np.float32)

    def to_dict(self) -> dict:
        """What ``config.score_calibration`` holds (JSON numbers)."""
        out = {"method": self.method}
        if self.method == "isotonic":
            out.update(x=[float(v) for v in self.x], y=[float(v) for v in self.y])
        else:
            out.update(a=self.a, b=self.b)
        out.update(self.info)
        return out

    @classmethod
    def from_dict(cls, values: dict) -> ScoreCalibration:
        """The calibration a config's ``score_calibration`` describes (ValueError on a malformed one)."""
        if not isinstance(values, dict) or "method" not in values:
            raise ValueError(f"score_calibration must be a dict with a 'method', got {type(values).__name__}")
        # the fingerprint of the ranking it was fitted on is the model's to check (XMCPreTrainedModel.score_calibration)
        info = {k: v for k, v in values.items() if k not in ("method", "x", "y", "a", "b", "fingerprint")}
        try:
            if values["method"] == "isotonic":
                return cls("isotonic", x=values["x"], y=values["y"], info=info)
            return cls(values["method"], a=float(values["a"]), b=float(values["b"]), info=info)
        except KeyError as err:
            raise ValueError(f"score_calibration ({values['method']}) lacks {err}") from None
