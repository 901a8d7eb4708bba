"""The XMC pipeline: ``pipeline(model=dir_or_repo, trust_remote_code=True)("some title", top_k=5)``.

Every hf_xmc model saves this file beside its modeling files and names it in ``config.custom_pipelines`` (task
:data:`XMC_PIPELINE_TASK`), so ``transformers.pipeline`` finds it in the model directory or Hub repo and runs it where
hf_xmc is not installed: like the modeling files, it imports only transformers and the standard library. Inside the
package the task is also registered with ``PIPELINE_REGISTRY`` (``pipeline(XMC_PIPELINE_TASK, model=model)`` with a
model object).

The model tokenises (and MUFIN pre-processes images) itself in ``predict``, which batches and searches the label index
once per batch; the pipeline only turns inputs into ``predict`` calls and the ``XMCPrediction`` into dictionaries.
Memory: one batch of queries at a time (``batch_size``, default 64) plus the ``top_k`` results of every input.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

from transformers import Pipeline

XMC_PIPELINE_TASK = "extreme-multi-label-classification"
XMC_PIPELINE_INFO = {"impl": "pipeline_xmc.XMCPipeline", "pt": ["AutoModel"], "tf": [], "type": "multimodal"}


def _is_image(value: Any) -> bool:
    """A PIL image (by duck typing: PIL is only needed when images are given)."""
    return hasattr(value, "convert") and hasattr(value, "size") and hasattr(value, "mode")


class XMCPipeline(Pipeline):
    """Top-k labels of texts (and, for MUFIN, images) from any hf_xmc model.

    Inputs: a text; for MUFIN also a PIL image, or a dict ``{"text": ..., "image": ...}`` (``"images"``: a list of
    images for one item; an image may be a PIL image, a path or a ``file://`` URL); or a list of these (batched).

    Returns, per input, ``[{"label": text, "label_id": id, "score": s}, ...]`` best first (``top_k`` of them, fewer when
    the model has fewer labels or MUFIN's shortlist is shorter), with ``"probability"`` for a calibrated model; a list
    of such lists for a list of inputs. ``threshold=p`` (a calibrated model) keeps the labels whose probability of being
    relevant is at least ``p``, among the top ``top_k`` (default with a threshold: the model's ``THRESHOLD_DEPTH``, 100).
    ``query_encoder="static"`` ranks with the model's fitted static query encoder (a text model that has one; its own
    fusion weights and calibration), ``"transformer"`` with the trained tower; default: the model's own choice.
    """

    # the model carries its own tokenizer (and MUFIN its image processor): nothing for the pipeline to load
    _load_tokenizer = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_processor = False
    _load_video_processor = False

    def _sanitize_parameters(self, top_k: Optional[int] = None, threshold: Optional[float] = None, query_encoder: Optional[str] = None, **kwargs):
        # passed on as given: model.predict refuses a k that is no whole number and a threshold that is no finite
        # probability (int() / float() here let 2.5 through as 2 and "nan" as NaN)
        forward = {} if top_k is None else {"top_k": top_k}
        if threshold is not None:
            forward["threshold"] = threshold
        if query_encoder is not None:
            forward["query_encoder"] = query_encoder
        return {}, forward, {}

    def __call__(self, inputs: Any, top_k: Optional[int] = None, batch_size: Optional[int] = None, threshold: Optional[float] = None,
                 query_encoder: Optional[str] = None, **kwargs) -> list:
        """Rank the labels of one input or a list of inputs (``batch_size`` inputs per ``predict`` call, default 64)."""
        if kwargs:
            raise TypeError(f"XMCPipeline got unexpected arguments {sorted(kwargs)}")
        if top_k is not None and (isinstance(top_k, bool) or not hasattr(top_k, "__index__") or top_k < 1):
            raise ValueError(f"top_k must be a whole number >= 1, got {top_k!r}")  # an int or numpy integer
        single = not isinstance(inputs, (list, tuple))
        items = [inputs] if single else list(inputs)
        size = batch_size or self._batch_size or 64
        rows: list = []
        for start in range(0, len(items), size):
            rows.extend(self._rank(items[start : start + size], top_k, threshold, query_encoder))
        return rows[0] if single else rows

    # the single-item path of transformers' Pipeline (``pipe.preprocess`` / ``forward`` / ``postprocess``)
    def preprocess(self, inputs: Any) -> dict:
        return {"items": [inputs]}

    def _forward(self, model_inputs: dict, top_k: Optional[int] = None, threshold: Optional[float] = None, query_encoder: Optional[str] = None) -> dict:
        return {"rows": self._rank(model_inputs["items"], top_k, threshold, query_encoder)}

    def postprocess(self, model_outputs: dict) -> list[dict]:
        return model_outputs["rows"][0]

    def _rank(self, items: list, top_k: Optional[int], threshold: Optional[float] = None, query_encoder: Optional[str] = None) -> list[list[dict]]:
        texts, images = self._split(items)
        accepted = inspect.signature(self.model.predict).parameters
        if images is not None and "images" not in accepted:
            raise ValueError(f"{type(self.model).__name__} ranks texts only; got an image input")
        kwargs = {"images": images} if images is not None else {}
        if query_encoder is not None:
            if "query_encoder" not in accepted:
                raise ValueError(f"{type(self.model).__name__} has one query encoder; query_encoder= is for the text models")
            kwargs["query_encoder"] = query_encoder
        if threshold is not None:
            kwargs["threshold"] = threshold
        elif top_k is None:
            top_k = 5
        pred = self.model.predict(texts, k=top_k, batch_size=len(items), **kwargs)
        probabilities = pred.probabilities.tolist() if getattr(pred, "probabilities", None) is not None else [None] * len(pred.label_texts)
        rows = []
        for ids, scores, names, probs in zip(pred.label_ids.tolist(), pred.scores.tolist(), pred.label_texts, probabilities):
            row = []
            for j, (i, s, n) in enumerate(zip(ids, scores, names)):
                if i >= 0:
                    row.append({"label": n, "label_id": i, "score": s, **({"probability": probs[j]} if probs is not None else {})})
            rows.append(row)
        return rows

    @staticmethod
    def _split(items: list) -> tuple[Optional[list], Optional[list]]:
        """Per item a text (or None) and an image bag (or None); ``None`` for a column no item uses."""
        texts: list = []
        bags: list = []
        for i, item in enumerate(items):
            if isinstance(item, str):
                texts.append(item)
                bags.append(None)
            elif _is_image(item):
                texts.append(None)
                bags.append([item])
            elif isinstance(item, dict):
                unknown = set(item) - {"text", "image", "images"}
                if unknown:
                    raise ValueError(f"input {i}: unknown keys {sorted(unknown)} (expected 'text', 'image' or 'images')")
                bag = list(item.get("images") or []) + ([item["image"]] if item.get("image") is not None else [])
                texts.append(item.get("text"))
                bags.append(bag or None)  # paths and file:// URLs are read by the model (MUFIN's to_rgb)
            else:
                raise TypeError(f"input {i}: expected a text, a PIL image or a dict with 'text' / 'image', got {type(item).__name__}")
        if all(b is None for b in bags):
            return texts, None
        return (None if all(t is None for t in texts) else texts), bags

