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

from .provenance import check_derived

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


def file_identity_of(path: str) -> str:
    """Which file ``path`` is now: device, inode, size and modification time (a file written over it, even through a
    rename into place, differs in one of them). Read with one ``stat``: no byte of the file is read."""
    st = os.stat(path)
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


class LazyLabelImages(Sequence):
    """The label images of a saved ``mufin_label_images.safetensors`` (:func:`pack_label_images`'s layout), read when
    used: indexing a label (or slicing a range of labels) reads those labels' encoded bytes from the memory-mapped
    file, so re-encoding the labels in batches never holds more than a batch's images. A view may select labels
    (``select``), cap each bag (``capped``, as ``config.max_images``) and end with bags held in memory (``extended``:
    labels added after loading). What a model loads instead of the whole file.

    A view's labels are "sources": ids below the file's label count are the file's labels, the others index
    :attr:`tail` (the in-memory bags, after the file's). Memory: the offsets, 8 bytes per image and per label (12 MB
    for 300K labels of ~4.9 images), plus the selection (8 bytes per label) of a view and the tail's bags as given; a
    file label's images only while its bag is used."""

    def __init__(
        self, path: str, image_offsets: np.ndarray, label_offsets: np.ndarray, labels: Optional[np.ndarray] = None,
        max_images: int = -1, tail: Optional[list] = None, file_identity: Optional[str] = None,
    ):
        self.path, self.image_offsets, self.label_offsets = path, image_offsets, label_offsets
        # the file the offsets were read from (device, inode, size, mtime): a file written over it since (a save into
        # the directory it was loaded from) is never read through these offsets (:meth:`check_file`)
        self.file_identity = file_identity if file_identity is not None else file_identity_of(path)
        self.labels = labels  # the sources this view holds, in its order (None: every file label, then the tail)
        self.max_images = max_images
        self.tail = tail if tail is not None else []  # bags added in memory: source file_labels + j is tail[j]

    @property
    def file_labels(self) -> int:
        """How many labels the file holds (sources below it are read from the file)."""
        return len(self.label_offsets) - 1

    def __len__(self) -> int:
        return len(self.labels) if self.labels is not None else self.file_labels + len(self.tail)

    def _sources(self, rows: Sequence[int]) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        return self.labels[rows] if self.labels is not None else rows

    def _image_ranges(self, file_labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(first, end)`` image in the file of each of ``file_labels`` (``end`` capped by ``max_images``)."""
        first, end = self.label_offsets[file_labels], self.label_offsets[file_labels + 1]
        return first, (np.minimum(end, first + self.max_images) if self.max_images >= 0 else end)

    def _tail_bag(self, source: int) -> list:
        bag = list(self.tail[source - self.file_labels])
        return bag[: self.max_images] if self.max_images >= 0 else bag

    def counts(self) -> np.ndarray:
        """Images per label of the view (capped), read from the offsets (and the tail's lengths) only."""
        sources = self._sources(np.arange(len(self)))
        in_file = sources < self.file_labels
        out = np.zeros(len(sources), dtype=np.int64)
        first, end = self._image_ranges(sources[in_file])
        out[in_file] = end - first
        out[~in_file] = [len(self._tail_bag(int(s))) for s in sources[~in_file]]
        return out

    @property
    def whole_file(self) -> bool:
        """Whether the view is the file as it is (every label in order, no bag cut by the cap, no tail): saving may copy it."""
        uncut = self.max_images < 0 or int(np.diff(self.label_offsets).max(initial=0)) <= self.max_images
        return self.labels is None and not self.tail and uncut

    def select(self, rows: Sequence[int]) -> LazyLabelImages:
        """A view of the labels ``rows`` of this view, in that order."""
        return LazyLabelImages(self.path, self.image_offsets, self.label_offsets, self._sources(rows), self.max_images, self.tail, self.file_identity)

    def capped(self, max_images: int) -> LazyLabelImages:
        """This view with each bag cut at ``max_images`` images (``< 0``: as it is)."""
        if max_images < 0 or (0 <= self.max_images <= max_images):
            return self
        return LazyLabelImages(self.path, self.image_offsets, self.label_offsets, self.labels, max_images, self.tail, self.file_identity)

    def extended(self, bags: Sequence[Sequence[Any]]) -> LazyLabelImages:
        """This view followed by ``bags`` (held in memory): what ``add_labels`` keeps, reading nothing of the file."""
        tail = self.tail + [list(bag) for bag in bags]
        added = self.file_labels + len(self.tail) + np.arange(len(bags), dtype=np.int64)
        labels = None if self.labels is None else np.concatenate([self.labels, added])
        return LazyLabelImages(self.path, self.image_offsets, self.label_offsets, labels, self.max_images, tail, self.file_identity)

    def reads_from(self, path: str) -> bool:
        """Whether this view reads images from the file ``path`` (a save about to write over it must not)."""
        return os.path.realpath(self.path) == os.path.realpath(path)

    def check_file(self) -> None:
        """Refuse in one line to read a file that is no longer the one the offsets came from (written over since it
        was opened: another file's bytes would come back cut at these offsets); ``provenance.py``'s ``label_images``."""
        try:
            check_derived("label_images", {"file": self.file_identity}, {"file": file_identity_of(self.path)}, self.path)
        except ValueError:  # the helper's line names the part; this one says what it means for the images
            raise ValueError(f"{self.path}: the label image file was replaced after this model read its offsets, so its images "
                             "cannot be read through them: load the model again") from None

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._read(range(len(self))[index])
        i = int(index)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"label {index} of {len(self)}")
        return self._read([i])[0]

    def __iter__(self):
        for start in range(0, len(self), 256):  # a few hundred labels a read
            yield from self[start : start + 256]

    def _read(self, rows: Sequence[int]) -> list[list[Any]]:
        """The bags of ``rows``: a file label's encoded image bytes (one slice of the file per label), a tail label's
        bag as it was added."""
        from safetensors import safe_open

        if len(rows) == 0:
            return []
        sources = self._sources(list(rows))
        out: list[list[Any]] = [self._tail_bag(int(s)) if s >= self.file_labels else [] for s in sources]
        in_file = np.flatnonzero(sources < self.file_labels)
        if in_file.size == 0:
            return out
        firsts, ends = self._image_ranges(sources[in_file])
        self.check_file()
        with safe_open(self.path, framework="pt") as f:
            data = f.get_slice("image_bytes")
            for row, first, end in zip(in_file.tolist(), firsts.tolist(), ends.tolist()):
                lo, hi = int(self.image_offsets[first]), int(self.image_offsets[end])
                blob = data[lo:hi].numpy().tobytes() if hi > lo else b""
                out[row] = [blob[int(self.image_offsets[j]) - lo : int(self.image_offsets[j + 1]) - lo] for j in range(first, end)]
        return out


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

__all__ = ["LazyLabelImages", "MUFINProcessor", "file_identity_of", "image_file_bytes", "is_single_image", "pack_label_images", "to_rgb"]
