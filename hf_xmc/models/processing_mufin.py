"""MUFIN's tokenizer and image processor as one ``ProcessorMixin``: ``AutoProcessor.from_pretrained(dir,
trust_remote_code=True)`` on a saved MUFIN model.

Remote-code file: ``MUFINModel.save_pretrained`` writes ``processor_config.json`` (with an ``auto_map``) and this file
beside the model, so the processor loads where hf_xmc is not installed. It prepares inputs as the model does
(``MUFINModel.prepare_bags``): texts tokenised to ``max_length`` tokens, images (PIL images, paths or local
``file://`` URLs) made RGB on white and pre-processed. Memory: one batch of token ids and pixels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from transformers import BatchFeature, ProcessorMixin

from .modeling_mufin import to_rgb


class MUFINProcessor(ProcessorMixin):
    """Tokenizer + image processor of a MUFIN model.

    ``processor(text=[...], images=[...])`` returns a ``BatchFeature`` with ``input_ids`` / ``attention_mask`` (texts,
    padded to the longest, cut at ``max_length``) and ``pixel_values`` (one row per image).
    """

    def __init__(self, image_processor=None, tokenizer=None, **kwargs):
        super().__init__(image_processor, tokenizer, **kwargs)

    def __call__(
        self,
        text: Optional[str | Sequence[str]] = None,
        images: Optional[Any | Sequence[Any]] = None,
        max_length: Optional[int] = None,
        return_tensors: str = "pt",
        **kwargs,
    ) -> BatchFeature:
        if text is None and images is None:
            raise ValueError("give text and/or images")
        out: dict[str, Any] = {}
        if text is not None:
            texts = [text] if isinstance(text, str) else list(text)
            out.update(self.tokenizer(texts, padding=True, truncation=max_length is not None, max_length=max_length, return_tensors=return_tensors, **kwargs))
        if images is not None:
            batch = [images] if not isinstance(images, (list, tuple)) else list(images)
            out.update(self.image_processor(images=[to_rgb(image) for image in batch], return_tensors=return_tensors))
        return BatchFeature(out)


MUFINProcessor.register_for_auto_class("AutoProcessor")
