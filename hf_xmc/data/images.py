"""Image loading for multimodal XMC items (MUFIN): paths or PIL images -> RGB PIL images.

Items carry zero or more images, given as file paths (what the XC raw ``images`` field holds) or as
PIL images already in memory. Pillow is imported lazily, so text-only use of :mod:`hf_xmc.data`
never needs it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Union

from .xc_raw import XMCDataError

if TYPE_CHECKING:  # pragma: no cover
    from PIL import Image

__all__ = ["ImageInput", "image_cache_directory", "load_image", "load_images"]

#: One image as an item may carry it: a path or an in-memory PIL image.
ImageInput = Union[str, "os.PathLike[str]", "Image.Image"]


def image_cache_directory() -> str:
    """Where images that a ``datasets`` column embeds as bytes are written (one file per distinct image, named by its
    sha256): ``$HF_XMC_IMAGE_CACHE``, else ``$HF_HOME/hf_xmc/images`` (``~/.cache/huggingface/hf_xmc/images``)."""
    if os.environ.get("HF_XMC_IMAGE_CACHE"):
        return os.environ["HF_XMC_IMAGE_CACHE"]
    hf_home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(hf_home, "hf_xmc", "images")


def _pil() -> Any:
    """Import PIL.Image with an actionable message when Pillow is missing."""
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - Pillow comes with matplotlib, a hard dependency
        raise ImportError("loading images needs Pillow: pip install pillow") from e
    return Image


def load_image(image: ImageInput) -> Image.Image:
    """Return ``image`` as an RGB PIL image (a path is opened and fully decoded now).

    An unreadable path raises :class:`~hf_xmc.data.XMCDataError` naming the path and the fault.
    """
    Image = _pil()
    if isinstance(image, Image.Image):
        return image if image.mode == "RGB" else _to_rgb(image)
    if not isinstance(image, (str, os.PathLike)):
        raise TypeError(f"an image must be a path or a PIL image, got {type(image).__name__}")
    path = os.fspath(image)
    try:
        with Image.open(path) as im:
            im.load()  # decode now: a truncated file fails here, naming its path, not later in a collator
            return _to_rgb(im)
    except FileNotFoundError:
        raise XMCDataError(path, None, "image file not found") from None
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise XMCDataError(path, None, f"cannot read image: {e}") from e


def _to_rgb(im: Image.Image) -> Image.Image:
    """Convert to RGB; transparent pixels become white (emoji, logos), not the black that convert() gives.

    A twin of the conversion in ``hf_xmc.models.processing_mufin.to_rgb``, kept on purpose: this layer may not import
    the models, and that remote-code file may not import hf_xmc. ``tests/test_data_images.py`` checks that the two
    give the same pixels."""
    if im.mode in ("RGBA", "LA") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        background = _pil().new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return im if im.mode == "RGB" else im.convert("RGB")


def load_images(images: Iterable[ImageInput]) -> list[Image.Image]:
    """Load one item's images (paths and/or PIL images) as a list of RGB PIL images, in order."""
    if isinstance(images, (str, os.PathLike)):
        # a bare path would otherwise be iterated character by character
        raise TypeError("load_images takes a list of images; wrap a single path in a list")
    return [load_image(image) for image in images]
