"""MUFIN's inputs: image decoding (``to_rgb``), label images packed into one safetensors file, and the tokenizer and
image processor as one ``ProcessorMixin`` (``AutoProcessor.from_pretrained(dir, trust_remote_code=True)`` on a saved
MUFIN model).

Remote-code file: ``modeling_mufin.py`` imports it, so it travels into every saved MUFIN directory, and
``MUFINModel.save_pretrained`` writes ``processor_config.json`` (with an ``auto_map``) beside it, so the processor
loads where hf_xmc is not installed. It prepares inputs as the model does (``MUFINModel.prepare_bags``): texts
tokenised to ``max_length`` tokens, images (PIL images, paths, encoded bytes or local ``file://`` URLs) made RGB on
white and pre-processed. Memory: one batch of token ids and pixels; packing holds the images' encoded bytes.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch
from transformers import BatchFeature, ProcessorMixin

try:  # Pillow is only needed to read image paths and bytes; PIL images passed in work as they are
    from PIL import Image
except ImportError:  # pragma: no cover - Pillow ships with transformers' vision extras
    Image = None


# ---------------------------------------------------------------------------------------------------- images
def to_rgb(image: Any) -> Any:
    """An image path, a local ``file://`` URL, encoded image bytes (PNG, JPEG, ...) or PIL image as an RGB PIL image;
    transparent pixels become white. Images are never fetched from the network.

    ``hf_xmc.data.load_image`` keeps a twin of the conversion (the data layer may not import the models, and this
    remote-code file may not import hf_xmc.data); ``tests/test_data_images.py`` checks that the two agree."""
    if isinstance(image, str) and image.startswith("file://"):
        from urllib.parse import unquote, urlparse

        image = unquote(urlparse(image).path)
    if isinstance(image, (str, os.PathLike, bytes, bytearray, memoryview)):
        encoded = not isinstance(image, (str, os.PathLike))
        if Image is None:
            raise ImportError(f"{'decoding image bytes' if encoded else 'reading image paths'} needs Pillow: pip install pillow")
        if not encoded and not os.path.exists(os.fspath(image)):
            raise FileNotFoundError(f"image file not found: {os.fspath(image)}")
        with Image.open(io.BytesIO(bytes(image)) if encoded else os.fspath(image)) as im:
            im.load()
            image = im.copy()
    if Image is None or not isinstance(image, Image.Image):
        raise TypeError(f"an image must be a path, image bytes or a PIL image, got {type(image).__name__}")
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image if image.mode == "RGB" else image.convert("RGB")


def is_single_image(value: Any) -> bool:
    """True for one image (a path, encoded bytes or a PIL image), False for a bag (a list) of them or ``None``."""
    return isinstance(value, (str, os.PathLike, bytes, bytearray, memoryview)) or (Image is not None and isinstance(value, Image.Image))


def image_file_bytes(image: Any) -> bytes:
    """An image as encoded bytes for storage: a file's own bytes (no re-encoding), bytes as they are, a PIL image as
    PNG."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, (str, os.PathLike)):
        with open(image, "rb") as f:
            return f.read()
    if Image is not None and isinstance(image, Image.Image):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()
    raise TypeError(f"an image must be a path, image bytes or a PIL image, got {type(image).__name__}")


def pack_label_images(label_images: Sequence[Sequence[Any]]) -> dict[str, torch.Tensor]:
    """Label image bags as three tensors for one safetensors file: ``image_bytes`` (uint8, every image's encoded bytes
    back to back), ``image_offsets`` (int64, images + 1) and ``label_image_offsets`` (int64, labels + 1: label ``l``
    owns images ``label_image_offsets[l]:label_image_offsets[l + 1]``).

    Memory: the images' encoded sizes + 8 bytes per image and per label (a few KB per label for small PNGs)."""
    blobs = [image_file_bytes(image) for bag in label_images for image in bag]
    sizes = torch.tensor([len(b) for b in blobs], dtype=torch.int64)
    counts = torch.tensor([len(bag) for bag in label_images], dtype=torch.int64)
    data = np.frombuffer(b"".join(blobs), dtype=np.uint8) if blobs else np.zeros(0, dtype=np.uint8)
    return {
        "image_bytes": torch.from_numpy(data.copy()),
        "image_offsets": torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)]),
        "label_image_offsets": torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)]),
    }


def unpack_label_images(tensors: dict[str, torch.Tensor]) -> list[list[bytes]]:
    """The inverse of :func:`pack_label_images`: per label a list of encoded images (``bytes``, decoded on use)."""
    data = tensors["image_bytes"].numpy().tobytes()
    image_offsets = tensors["image_offsets"].tolist()
    label_offsets = tensors["label_image_offsets"].tolist()
    images = [data[image_offsets[i] : image_offsets[i + 1]] for i in range(len(image_offsets) - 1)]
    return [images[label_offsets[label] : label_offsets[label + 1]] for label in range(len(label_offsets) - 1)]


# ---------------------------------------------------------------------------------------------------- processor
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

__all__ = ["MUFINProcessor", "image_file_bytes", "is_single_image", "pack_label_images", "to_rgb", "unpack_label_images"]
