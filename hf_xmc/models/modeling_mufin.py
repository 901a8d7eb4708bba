"""MUFIN: multi-modal extreme classification with bag self-attention, label-adapted cross-attention and
one-vs-all classifiers.

Mittal, Dahiya, Malani, Ramamoorthy, Kumar, Agarwal, Kumar, Varma, "Multi-modal Extreme Classification", CVPR 2022.
Datapoints and labels are *items*, each a bag of descriptors: one row per image (a vision encoder, ViT) and one row
for the text (a text encoder, DistilBERT), each reduced to D by a parameter-free adaptive max-pool. A self-attention
block ``A_S`` mixes the bag (``X^1 = A_S(X^0)``), whose normalised sum is the item's vector ``x^1`` (``z_l^1`` for a
label). Label ``l`` is scored for datapoint ``i`` as ``c_il = <w_l, x_i^{2,l}>``: a cross-attention block ``A_C``
lets the datapoint's bag attend to the label's bag (``x_i^{2,l} = N(1^T A_C(X_i^1, Z_l^1))``) and the classifier
``w_l = alpha_l z_l^1 + (1 - alpha_l) N(eta_l)`` mixes the label's own vector with a free vector.

Prediction (spec Sec. 5): one query of the shortlist index with ``x^1`` (the index holds every row of every label
bag ``Z_l^1`` and each label's centroid ``mu_l`` of its training positives, normalised, tagged with the label id),
collapsed to at most ``shortlist_size`` unique labels scored ``a_il = max`` over the label's rows; then ``A_C`` and
the classifier for the shortlist only; ranking by ``s = beta c + (1 - beta) a``. Per query the cost is ``|R_t|``
cross-attention and classifier evaluations whatever the number of labels.

Training (spec Sec. 4) has two stages, chosen by ``forward(stage=...)``: ``"siamese"`` (Module I: scores
``<z_l^1, x_i^1>``, label-anchored triplet loss with hard positives and in-batch hard negatives; no ``A_C``, no
free vectors) and ``"ranker"`` (Module IV: ``c_il`` for each query's pool labels, cosine-embedding loss).

Label store (artifacts beside ``model.safetensors``, read back through ``cached_file``):

* ``mufin_label_bags.safetensors``: the cached label bags ``Z^1`` (ragged: all rows + per-label offsets) and the
  label vectors ``z^1``;
* ``mufin_label_centroids.safetensors``: ``mu_l`` and the number of training positives behind each;
* ``mufin_label_images.safetensors``: the label images as their file bytes (``config.save_label_images``), so a
  reloaded model can re-encode its labels from texts and images;
* ``label_index.json`` (+ ``label_index.faiss`` for HNSW / IVF): the shortlist index, a cache rebuilt from the bags
  and centroids;
* ``preprocessor_config.json`` (the image processor), the tokenizer files and ``labels.jsonl`` (label texts).

Implementation spec: ``shared/specs/mufin.md``. Where the paper and the official code differ the paper is the
default and the code's choice a config flag (see [`MUFINConfig`]).

This file is part of the remote-code bundle: it imports only torch, transformers, numpy, safetensors, PIL
(optional), open_clip (optional: only models with an open_clip image tower need it) and its siblings.
"""

import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, AutoImageProcessor, AutoModel, AutoTokenizer
from transformers import initialization as init
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.utils import ModelOutput, logging

from .classifier_head import ExtremeClassifier
from .configuration_mufin import MUFIN_SEARCH_MODES, OPEN_CLIP_PREFIX, MUFINConfig
from .label_index import INDEX_META_FILE, LabelIndex, atomic_write, progress_bar_disabled
from .model_files import ModelFileError, check_offsets, read_safetensors
from .modeling_xmc import (
    LABEL_EMBEDDINGS_FILE,
    LABEL_EMBEDDINGS_INDEX_FILE,
    XMCPrediction,
    XMCPreTrainedModel,
    _repair_tokenizer,
)
from .xmc_losses import mufin_ranker_loss, mufin_triplet_loss

try:  # Pillow is only needed to read image paths; PIL images passed in work as they are
    from PIL import Image
except ImportError:  # pragma: no cover - Pillow ships with transformers' vision extras
    Image = None

try:  # only for open_clip vision towers (the ``vision`` extra)
    import open_clip
    from open_clip.model import _build_vision_tower
except ImportError:
    open_clip = None

logger = logging.get_logger(__name__)

LABEL_BAGS_FILE = "mufin_label_bags.safetensors"
LABEL_CENTROIDS_FILE = "mufin_label_centroids.safetensors"
LABEL_IMAGES_FILE = "mufin_label_images.safetensors"
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"  # MUFINProcessor (tokenizer + image processor) for AutoProcessor, with its auto_map
MUFIN_STAGES = ("siamese", "ranker")


# ---------------------------------------------------------------------------------------------------- blocks
# The vision tower built when no pretrained one is given (text-only data, or images learnt from scratch): a small ResNet
# for 64 x 64 images (4 stages of one basic block, 32..192 channels, about 0.9M parameters). A convolutional tower, not
# the paper's ViT: trained from scratch on Emoji-XMC (about 1k images) a ViT of the same size learnt almost nothing
# (image-only P@1 7.5 vs 32.6, multimodal 44.3 vs 48.6; README, benchmarks/bench_mufin.py). The paper's ViT is what
# a pretrained checkpoint gives (``vision_name_or_path``).
SMALL_VISION_CONFIG = dict(
    model_type="resnet", num_channels=3, embedding_size=32, hidden_sizes=[32, 64, 128, 192], depths=[1, 1, 1, 1], layer_type="basic",
)
SMALL_VISION_IMAGE_SIZE = 64


def _require_open_clip() -> None:
    if open_clip is None:
        raise ImportError("this MUFIN model has an open_clip vision tower: pip install 'hf_xmc[vision]' (open_clip_torch)")


class OpenCLIPVisionTower(nn.Module):
    """An open_clip image tower behind the interface MUFIN asks of a vision encoder: ``forward(pixel_values=...)``
    returns an output whose ``pooler_output`` is the tower's projected image embedding (``model_cfg["embed_dim"]``).
    Only the image tower of the CLIP ``model_cfg`` is built (its text tower is never needed)."""

    def __init__(self, model_cfg: dict):
        super().__init__()
        _require_open_clip()
        self.visual = _build_vision_tower(model_cfg["embed_dim"], model_cfg["vision_cfg"], quick_gelu=model_cfg.get("quick_gelu", False))

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def forward(self, pixel_values: torch.Tensor, **kwargs) -> BaseModelOutputWithPooling:
        return BaseModelOutputWithPooling(pooler_output=self.visual(pixel_values))


def open_clip_model_config(name: str) -> dict:
    """open_clip's ``model_cfg`` (``embed_dim``, ``vision_cfg``, ``text_cfg``) of a model name (see
    :func:`load_open_clip_tower`), read without building the model."""
    _require_open_clip()
    architecture = name.partition("@")[0]
    if architecture.startswith(("local-dir:", "hf-hub:")):
        schema, _, where = architecture.partition(":")
        if schema == "local-dir":
            path = os.path.join(where, "open_clip_config.json")
        else:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(where, "open_clip_config.json")
        with open(path, encoding="utf-8") as f:
            return json.load(f)["model_cfg"]
    model_cfg = open_clip.get_model_config(architecture)
    if model_cfg is None:
        raise ValueError(f"open_clip knows no model {architecture!r} (open_clip.list_models() names them)")
    return model_cfg


def load_open_clip_tower(name: str) -> tuple[OpenCLIPVisionTower, dict, Any]:
    """A pretrained open_clip image tower by open_clip model name: ``local-dir:/path`` (a folder with
    ``open_clip_config.json`` and weights), ``hf-hub:org/repo``, or an architecture name with an optional pretrained tag
    (``ViT-B-32@laion2b_s34b_b79k``). Returns the tower, the ``open_clip_config`` to store in :class:`MUFINConfig` and
    the matching image processor (resize shortest side, centre crop, the model's mean / std)."""
    architecture, _, tag = name.partition("@")
    model_cfg = open_clip_model_config(name)
    clip = open_clip.create_model(architecture, pretrained=tag or None)
    preprocess = {k: (list(v) if isinstance(v, tuple) else v) for k, v in open_clip.get_model_preprocess_cfg(clip).items()}
    tower = OpenCLIPVisionTower(model_cfg)
    tower.visual.load_state_dict(clip.visual.state_dict())
    size = preprocess.get("size", model_cfg["vision_cfg"].get("image_size", 224))
    height, width = (size, size) if isinstance(size, int) else size
    # imported where a processor is built: importing the image processor classes with the package would warn on
    # every `import hf_xmc` of an install without torchvision
    from transformers import CLIPImageProcessor

    processor = CLIPImageProcessor(
        size={"shortest_edge": min(height, width)}, crop_size={"height": height, "width": width},
        image_mean=list(preprocess.get("mean", OPENAI_CLIP_MEAN)), image_std=list(preprocess.get("std", OPENAI_CLIP_STD)),
    )
    return tower, {"name": name, "model_cfg": model_cfg, "preprocess_cfg": preprocess}, processor


# names of the vision parameters before the layer stack (patch / class / position embeddings, open_clip's conv1 and
# ln_pre): frozen with the early layers
PRE_STACK_MARKERS = ("embed", "conv1", "ln_pre")


class MUFINAttention(nn.Module):
    """The attention block ``A(X, Z)`` of MUFIN (paper Fig. 2(d); structure from the official code, spec Sec. 3.3).

    Queries come from ``X``, keys and values from ``Z``; padded keys are masked out. Q, K, V and O are ``D x D``
    linear layers initialised to the identity with zero bias (optionally spectral-normalised, as the code), split into
    heads; attention dropout on the probabilities; the output is ``LayerNorm(O(MHA(X, Z)) + X)``: a post-LN residual
    on the *query* side, one layer, no feed-forward sub-layer and no positional encoding (so a bag is a set).
    ``A_S(X) = A(X, X)`` and ``A_C(X, Z) = A(X, Z)`` are two instances with their own parameters.

    Even at the identity init this is not the identity map: it computes ``LN(X + softmax(X Z^T / sqrt(d_h)) Z)``.
    """

    def __init__(self, dim: int, num_heads: int, dropout: float = 0.0, spectral_norm: bool = False):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"the attention width {dim} must be a multiple of the number of heads {num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)
        for proj in self.projections():
            proj._mufin_identity_init = True  # read by MUFINPreTrainedModel._init_weights
        if spectral_norm:
            for proj in self.projections():
                torch.nn.utils.parametrizations.spectral_norm(proj)
        self.dropout = nn.Dropout(dropout)
        self.layer_norm = nn.LayerNorm(dim)

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]:
        """Q, K, V and O."""
        return self.q_proj, self.k_proj, self.v_proj, self.o_proj

    def forward(
        self,
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor,
        key_mask: Optional[torch.Tensor] = None,
        output_attentions: bool = False,
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``hidden_states`` ``(B, m_x, D)`` (queries), ``key_value_states`` ``(B, m_z, D)``, ``key_mask`` ``(B, m_z)``
        (True = real key). Returns ``(B, m_x, D)`` (and the ``(B, heads, m_x, m_z)`` attention probabilities)."""
        batch, m_x, dim = hidden_states.shape
        m_z = key_value_states.shape[1]

        def heads(x: torch.Tensor, m: int) -> torch.Tensor:
            return x.view(batch, m, self.num_heads, self.head_dim).transpose(1, 2)

        query = heads(self.q_proj(hidden_states), m_x)
        key = heads(self.k_proj(key_value_states), m_z)
        value = heads(self.v_proj(key_value_states), m_z)
        scores = (query / self.head_dim**0.5) @ key.transpose(-1, -2)
        if key_mask is not None:
            scores = scores.masked_fill(~key_mask.bool()[:, None, None, :], float("-inf"))
        probs = self.dropout(scores.softmax(dim=-1))
        context = (probs @ value).transpose(1, 2).reshape(batch, m_x, dim)
        out = self.layer_norm(self.o_proj(context) + hidden_states)
        return (out, probs) if output_attentions else out


class MUFINClassifier(nn.Module):
    """Per-label one-vs-all classifiers ``w_l = alpha_l z_l^1 + (1 - alpha_l) N(eta_l)`` (paper Sec. 3, Fig. 2(b)).

    ``eta`` is an [`ExtremeClassifier`] table (xavier-initialised, as the paper's Module III); ``alpha_l in [0, 1]``
    is a 2-way softmax over two logits per label (``alpha_param="softmax2"``, the code: ``(1 - alpha, alpha)``) or a
    sigmoid of one logit, initialised so that ``alpha_l = alpha_init``. The paper's convention is used: ``alpha``
    weighs the label vector, so ``alpha = 1`` is MUFIN(alpha=1) with ``w_l = z_l^1`` (spec Sec. 12.1). With
    ``renormalize`` the result is re-normalised (the code's ``N(.)`` around the mix).
    """

    def __init__(self, num_labels: int, dim: int, alpha_param: str = "softmax2", alpha_init: float = 0.5, renormalize: bool = True):
        super().__init__()
        self.free_vectors = ExtremeClassifier(num_labels, dim)
        self.alpha_param, self.alpha_init, self.renormalize = alpha_param, alpha_init, renormalize
        self.alpha_logits = nn.Parameter(torch.empty(num_labels, 2 if alpha_param == "softmax2" else 1))

    @property
    def num_labels(self) -> int:
        return self.free_vectors.num_labels

    def initial_alpha_logits(self) -> torch.Tensor:
        """Logits that give ``alpha = alpha_init`` (for 0.5 and softmax2: (0, 0), the code's init)."""
        logit = float(np.log(self.alpha_init / (1.0 - self.alpha_init)))
        row = [0.0, logit] if self.alpha_param == "softmax2" else [logit]
        return torch.tensor(row).expand_as(self.alpha_logits)

    def alpha(self, label_ids: torch.Tensor) -> torch.Tensor:
        """``alpha_l`` of ``label_ids`` (any shape), in [0, 1]."""
        logits = self.alpha_logits[label_ids.to(self.alpha_logits.device)]
        return logits.softmax(dim=-1)[..., 1] if self.alpha_param == "softmax2" else torch.sigmoid(logits[..., 0])

    def forward(self, label_ids: torch.Tensor, label_vectors: torch.Tensor) -> torch.Tensor:
        """``w`` of ``label_ids`` ``(n,)`` given their label vectors ``z^1`` ``(n, D)``; returns ``(n, D)``."""
        eta = F.normalize(self.free_vectors.pool_weights(label_ids).to(label_vectors.dtype), dim=-1)
        alpha = self.alpha(label_ids).to(label_vectors.dtype).unsqueeze(-1)
        weights = alpha * label_vectors + (1.0 - alpha) * eta
        return F.normalize(weights, dim=-1) if self.renormalize else weights


def masked_sum_normalize(bags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``N(1^T X)`` over the real rows of each bag: ``(B, m, D)``, ``(B, m)`` -> ``(B, D)`` unit vectors."""
    return F.normalize((bags * mask.unsqueeze(-1).to(bags.dtype)).sum(dim=1), dim=-1)


def pad_bags(rows: torch.Tensor, owners: torch.Tensor, num_items: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack descriptor ``rows`` ``(n, D)`` of items ``owners`` ``(n,)`` into padded bags ``(B, m_max, D)`` + mask.

    Rows keep their order within an item (MUFIN puts images first, then the text). Every item ``0..B-1`` must own at
    least one row: an item with neither text nor image is refused.
    """
    owners = owners.to(rows.device).long()
    num_items = int(owners.max()) + 1 if num_items is None else num_items
    counts = torch.bincount(owners, minlength=num_items)
    if counts.numel() > num_items:
        raise ValueError(f"descriptor rows name item {counts.numel() - 1} but the batch has {num_items} items")
    if bool((counts == 0).any()):
        empty = int((counts == 0).nonzero()[0])
        raise ValueError(f"item {empty} has neither text nor image: every item needs at least one descriptor")
    order = torch.argsort(owners, stable=True)
    sorted_owners = owners[order]
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(owners.numel(), device=rows.device) - starts[sorted_owners]
    bags = rows.new_zeros(num_items, int(counts.max()), rows.shape[-1])
    bags[sorted_owners, position] = rows[order]
    mask = torch.zeros(num_items, bags.shape[1], dtype=torch.bool, device=rows.device)
    mask[sorted_owners, position] = True
    return bags, mask


def label_centroids_from_embeddings(embeddings: Union[torch.Tensor, np.ndarray], targets: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Label centroids ``mu_l = mean{x_i^1 : y_il = 1}`` as ``Y^T X / counts`` (spec Sec. 4, Module II).

    ``embeddings``: ``(N, D)`` datapoint vectors ``x^1``; ``targets``: ``(N, L)`` scipy sparse matrix (CSR), numpy array
    or torch tensor (non-zero = positive). Returns ``(centroids (L, D) float32, counts (L,) int64)``; a label without
    positives gets a zero row and count 0 (it contributes only its bag rows to the index).
    """
    x = embeddings.detach().float().cpu().numpy() if isinstance(embeddings, torch.Tensor) else np.asarray(embeddings, dtype=np.float32)
    if hasattr(targets, "tocsr"):  # scipy sparse, without importing scipy here
        y = (targets.tocsr() != 0).astype(np.float32)
        sums = np.asarray(y.T @ x, dtype=np.float32)
        counts = np.asarray(y.sum(axis=0)).ravel()
    else:
        y = (targets.detach().cpu().numpy() if isinstance(targets, torch.Tensor) else np.asarray(targets)) != 0
        y = y.astype(np.float32)
        sums, counts = y.T @ x, y.sum(axis=0)
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"targets have {y.shape[0]} rows but there are {x.shape[0]} embeddings")
    centroids = sums / np.maximum(counts, 1.0)[:, None]
    return torch.from_numpy(np.ascontiguousarray(centroids, dtype=np.float32)), torch.from_numpy(counts.astype(np.int64))


def select_siamese_pairs(
    sims: torch.Tensor,
    positives: torch.Tensor,
    num_positives: int,
    num_negatives: int,
    max_positive_cos: float = 0.9,
    generator: Optional[torch.Generator] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Module I pairs per label anchor (spec Sec. 4): hard positives and in-batch hard negatives.

    ``sims`` ``(A, B)``: anchor (label) x point similarities ``<z_l^1, x_j^1>``; ``positives`` ``(A, B)`` bool,
    ``y_jl = +1``. Positives: up to ``num_positives`` drawn uniformly from ``{j : y_jl = 1, sim <= max_positive_cos}``
    (near-duplicates give vanishing gradients); a label whose positives all exceed the threshold falls back to its
    least similar ones. Negatives: the ``num_negatives`` most similar in-batch points with ``y_jl = -1``: points that
    are positives of *other* labels, never of this one. Selection uses detached similarities; the returned sims keep
    their gradient. Returns ``(pos_sims, pos_mask, neg_sims, neg_mask)``, shapes ``(A, P)`` and ``(A, N)``.
    """
    positives = positives.bool()
    detached = sims.detach()
    eligible = positives & (detached <= max_positive_cos)
    fallback = positives.any(dim=1) & ~eligible.any(dim=1)
    random_keys = torch.rand(detached.shape, generator=generator, device=detached.device if generator is None else generator.device)
    random_keys = random_keys.to(detached.device)
    keys = torch.where(fallback.unsqueeze(1), -detached, random_keys)
    candidates = torch.where(fallback.unsqueeze(1), positives, eligible)
    keys = keys.masked_fill(~candidates, float("-inf"))
    pos_idx = keys.topk(min(num_positives, sims.shape[1]), dim=1).indices
    pos_mask = candidates.gather(1, pos_idx)
    neg_keys = detached.masked_fill(positives, float("-inf"))
    neg_idx = neg_keys.topk(min(num_negatives, sims.shape[1]), dim=1).indices
    neg_mask = (~positives).gather(1, neg_idx)
    return sims.gather(1, pos_idx), pos_mask, sims.gather(1, neg_idx), neg_mask


def to_rgb(image: Any) -> Any:
    """An image path, a local ``file://`` URL, encoded image bytes (PNG, JPEG, ...) or PIL image as an RGB PIL image;
    transparent pixels become white (``hf_xmc.data.load_image`` uses this too). Images are never fetched from the
    network."""
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


def _is_single_image(value: Any) -> bool:
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


@dataclass
class MUFINModelOutput(ModelOutput):
    """Output of a MUFIN forward pass.

    Attributes:
        loss: the stage's training loss, returned when ``targets`` are given.
        logits: ``(batch, pool)`` scores: ``<x^1, z_l^1>`` in the siamese stage, ``c_il = <x^{2,l}, w_l>`` in the ranker
            stage (0 where ``pair_mask`` is False).
        query_embeds: ``(batch, D)`` datapoint vectors ``x^1``.
        label_embeds: ``(pool, D)`` label vectors ``z^1``.
        pair_mask: ``(batch, pool)`` pairs scored in the ranker stage.
    """

    loss: Optional[torch.FloatTensor] = None
    logits: Optional[torch.FloatTensor] = None
    query_embeds: Optional[torch.FloatTensor] = None
    label_embeds: Optional[torch.FloatTensor] = None
    pair_mask: Optional[torch.BoolTensor] = None


# ---------------------------------------------------------------------------------------------------- model
class MUFINPreTrainedModel(XMCPreTrainedModel):
    """Weights initialisation and loading glue for MUFIN."""

    config: MUFINConfig
    base_model_prefix = "mufin"
    input_modalities = ("text", "image")
    _no_split_modules = ["MUFINAttention"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, ExtremeClassifier):
            return  # eta is an nn.Embedding, xavier-initialised below with its MUFINClassifier (no normal init first)
        super()._init_weights(module)
        if isinstance(module, nn.Linear) and getattr(module, "_mufin_identity_init", False):
            # Modules I and III: Q, K, V, O of A_S / A_C start at the identity with zero bias. Done per Linear (after
            # the default Linear init above): transformers skips a parent without direct parameters, as MUFINAttention
            parametrized = hasattr(module, "parametrizations")
            init.eye_(module.parametrizations.weight.original if parametrized else module.weight)
            init.zeros_(module.bias)
            if parametrized:
                # power-iteration vectors of the identity (any unit u = v gives sigma = 1), so W / sigma = I exactly
                spectral = module.parametrizations.weight[0]
                unit = torch.full_like(spectral._u, spectral._u.numel() ** -0.5)
                init.copy_(spectral._u, unit)
                init.copy_(spectral._v, unit)
        if isinstance(module, MUFINClassifier):
            init.xavier_uniform_(module.free_vectors.weight)  # paper Module III (the code: kaiming)
            init.copy_(module.alpha_logits, module.initial_alpha_logits())


class MUFINModel(MUFINPreTrainedModel):
    """The MUFIN model: text and vision encoders, ``A_S``, ``A_C``, per-label classifiers and the label store.

    Inputs are items given as texts and/or images (a bag per item): see :meth:`prepare_bags`. ``predict`` ranks the
    model's labels for such items; ``forward`` computes the Module I (``stage="siamese"``) or Module IV
    (``stage="ranker"``) loss on tensor batches.

    Example:
        >>> model = MUFINModel.from_encoders_pretrained(text_dir, vit_dir, label_space_size=2)
        >>> model.build_label_index(["red apple", "green pear"], label_images=[[apple_png], []])
        >>> model.set_label_centroids(*label_centroids_from_embeddings(model.encode_items(train_texts), train_targets))
        >>> model.predict(["an apple"], images=[[photo]], k=1).label_texts
    """

    def __init__(self, config: MUFINConfig):
        super().__init__(config)  # the text encoder E_T, tokenizer slot, label texts
        self.vision_encoder = (
            OpenCLIPVisionTower(config.open_clip_config["model_cfg"]) if config.open_clip_config else AutoModel.from_config(config.vision_config)
        )
        self.descriptor_pool = nn.AdaptiveMaxPool1d(config.embed_dim)  # parameter-free 768 -> 192 (window 4)
        attention = dict(dim=config.embed_dim, num_heads=config.attention_heads, dropout=config.attention_dropout, spectral_norm=config.spectral_norm)
        self.self_attention = MUFINAttention(**attention)  # A_S, shared by datapoints and labels
        self.cross_attention = MUFINAttention(**attention)  # A_C, its own parameters
        self.classifier = (
            MUFINClassifier(config.label_space_size, config.embed_dim, config.alpha_param, config.alpha_init, config.renormalize_classifier)
            if config.label_space_size > 0
            else None
        )
        self.image_processor = None
        self.label_images: Optional[list[list[Any]]] = None
        self.label_images_missing = False  # a loaded model whose label images were not saved (see build_label_index)
        # label store: Z^1 (ragged rows + offsets), z^1, centroids mu_l and their positive counts
        self.label_bag_rows: Optional[torch.Tensor] = None
        self.label_bag_offsets: Optional[torch.Tensor] = None
        self.label_vectors: Optional[torch.Tensor] = None
        self.label_centroids: Optional[torch.Tensor] = None
        self.label_centroid_counts: Optional[torch.Tensor] = None
        self.shortlist_row_labels: Optional[torch.Tensor] = None  # label id of each shortlist index row
        self.training_stage = "siamese"
        self.post_init()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_encoders_pretrained(cls, text_name_or_path: str, vision_name_or_path: Optional[str] = None, **config_kwargs) -> "MUFINModel":
        """A fresh MUFIN whose text and vision encoders (with tokenizer and image processor) start from pretrained
        checkpoints; ``A_S`` / ``A_C`` start at the identity, ``eta`` xavier, ``alpha = alpha_init``. Call
        :meth:`freeze_vision_layers` to apply ``vision_trainable_layers`` before training.

        ``vision_name_or_path`` is an HF vision checkpoint (ViT, ResNet, ...) or ``"open_clip:<name>"``, an open_clip
        image tower (the ``vision`` extra; see :func:`load_open_clip_tower` for the names). Without it the vision tower
        is built at random from ``vision_config`` (default: a small ResNet for 64 x 64 images,
        :data:`SMALL_VISION_CONFIG`) with a resize-and-normalise ``ViTImageProcessor`` (``image_size`` of the config,
        else 64): for text-only data, or images to learn from scratch."""
        text = AutoModel.from_pretrained(text_name_or_path)
        tokenizer = _repair_tokenizer(AutoTokenizer.from_pretrained(text_name_or_path), text.config, text_name_or_path)
        vision_kwargs = {}
        if vision_name_or_path is None:
            vision_config = AutoConfig.for_model(**dict(config_kwargs.pop("vision_config", None) or SMALL_VISION_CONFIG))
            vision = AutoModel.from_config(vision_config)
            size = getattr(vision_config, "image_size", SMALL_VISION_IMAGE_SIZE)
            from transformers import ViTImageProcessor  # here, not at import time (see load_open_clip_tower)

            image_processor = ViTImageProcessor(size={"height": size, "width": size})
            vision_kwargs["vision_config"] = vision.config.to_dict()
        elif str(vision_name_or_path).startswith(OPEN_CLIP_PREFIX):
            vision, vision_kwargs["open_clip_config"], image_processor = load_open_clip_tower(str(vision_name_or_path)[len(OPEN_CLIP_PREFIX) :])
        else:
            vision = AutoModel.from_pretrained(vision_name_or_path)
            image_processor = AutoImageProcessor.from_pretrained(vision_name_or_path)
            vision_kwargs["vision_config"] = vision.config.to_dict()
        config = cls.config_class(encoder_config=text.config.to_dict(), **vision_kwargs, **config_kwargs)
        model = cls(config)
        for name, target, source in (("text", model.encoder, text), ("vision", model.vision_encoder, vision)):
            missing, unexpected = target.load_state_dict(source.state_dict(), strict=False)
            missing = [k for k in missing if not k.endswith("position_ids")]
            if unexpected or missing:
                hint = " (a vision checkpoint without pooler: use vision_pooling='cls')" if any(k.startswith("pooler") for k in missing) else ""
                raise ValueError(f"{name} encoder weights of {source.name_or_path} do not fit: missing={missing} unexpected={unexpected}{hint}")
        model.tokenizer, model.image_processor = tokenizer, image_processor
        model.config.encoder_base_model = str(text_name_or_path)  # what an adapter-only save of the text tower names
        return model

    @classmethod
    def from_encoder_pretrained(cls, encoder_name_or_path: str, **config_kwargs) -> "MUFINModel":
        raise ValueError("MUFIN has a text and a vision encoder: use MUFINModel.from_encoders_pretrained(text_name_or_path, vision_name_or_path)")

    def _vision_layer_stack(self) -> nn.ModuleList:
        """The vision encoder's list of layers: transformer layers (ViT: ``encoder.layer``) or the stages of a
        convolutional backbone (ResNet, ConvNeXt: ``encoder.stages``)."""
        if self.config.open_clip_config:  # open_clip: transformer.resblocks
            depth = self.config.open_clip_config["model_cfg"]["vision_cfg"].get("layers")
        else:
            vision_config = self.config.vision_config
            depth = getattr(vision_config, "num_hidden_layers", None) or len(getattr(vision_config, "depths", None) or ())
        for _, module in self.vision_encoder.named_modules():
            if isinstance(module, nn.ModuleList) and len(module) == depth:
                return module
        raise ValueError(f"cannot find the {depth} layers of the vision encoder {type(self.vision_encoder).__name__}")

    def freeze_vision_layers(self, num_trainable_layers: Optional[int] = None) -> list[str]:
        """Freeze the vision encoder except its last ``num_trainable_layers`` layers or stages (default
        ``config.vision_trainable_layers``: paper 1, code 4) and the modules after them (final norm, pooler);
        embeddings and earlier layers get no gradient. 0 freezes it all, -1 unfreezes it all. The text encoder is
        left as it is (trained end to end). Returns the names of the vision parameters left trainable."""
        n = self.config.vision_trainable_layers if num_trainable_layers is None else num_trainable_layers
        if n == -1:
            self.vision_encoder.requires_grad_(True)
        else:
            layers = self._vision_layer_stack()
            self.vision_encoder.requires_grad_(False)
            if n > 0:
                for layer in list(layers)[-n:]:
                    layer.requires_grad_(True)
                in_stack = {id(p) for p in layers.parameters()}
                for name, param in self.vision_encoder.named_parameters():
                    if id(param) not in in_stack and not any(marker in name for marker in PRE_STACK_MARKERS):  # post-stack: final norm, pooler
                        param.requires_grad_(True)
        return [name for name, p in self.vision_encoder.named_parameters() if p.requires_grad]

    # ------------------------------------------------------------------ inputs
    def _require_image_processor(self):
        if self.image_processor is None and getattr(self, "image_processor_error", None):
            raise ImportError(f"images need the model's image processor, which could not be loaded: {self.image_processor_error} (pip install pillow)")
        if self.image_processor is None:
            raise ValueError(
                "this model has no image processor: load it with from_pretrained(<dir with preprocessor_config.json>) "
                "or set model.image_processor = AutoImageProcessor.from_pretrained(...)"
            )
        return self.image_processor

    def _normalize_items(self, texts: Optional[Sequence[Optional[str]]], images: Optional[Sequence[Any]]) -> tuple[list[Optional[str]], list[list[Any]]]:
        """Items as (text or None, list of images) pairs; a blank text counts as missing."""
        if isinstance(texts, str):
            texts = [texts]
        if _is_single_image(images):
            images = [images]
        if texts is None and images is None:
            raise ValueError("give texts and/or images")
        n = len(texts) if texts is not None else len(images)
        if texts is not None and images is not None and len(texts) != len(images):
            raise ValueError(f"got {len(texts)} texts but {len(images)} image bags: one of each per item (None where absent)")
        out_texts = [t if isinstance(t, str) and t.strip() else None for t in (texts if texts is not None else [None] * n)]
        if texts is not None:
            for i, t in enumerate(texts):
                if t is not None and not isinstance(t, str):
                    raise TypeError(f"item {i}: a text must be a str or None, got {type(t).__name__}")
        bags = []
        for i, value in enumerate(images if images is not None else [None] * n):
            bag = [] if value is None else [value] if _is_single_image(value) else list(value)
            if self.config.max_images >= 0:
                bag = bag[: self.config.max_images]
            bags.append(bag)
            if out_texts[i] is None and not bag:
                raise ValueError(f"item {i} has neither text nor image: every item needs at least one descriptor")
        return out_texts, bags

    def prepare_bags(self, texts: Optional[Sequence[Optional[str]]] = None, images: Optional[Sequence[Any]] = None, max_length: Optional[int] = None) -> dict[str, torch.Tensor]:
        """Tokenise and pre-process items into the tensors ``forward`` / :meth:`embed_bags` take.

        Args:
            texts: one text per item, ``None`` (or blank) where the item has none; or ``None`` for image-only items.
            images: per item a list of images (PIL images or paths; empty or ``None`` for none), or a flat list with
                one image per item; or ``None`` for text-only items. ``config.max_images`` caps a bag.
            max_length: token budget (default ``config.max_seq_length``).

        Returns:
            ``input_ids``, ``attention_mask``, ``text_item_index`` (the item of each text) and ``pixel_values``,
            ``image_item_index`` (the item of each image), the latter pairs only when there are images.
        """
        texts, bags = self._normalize_items(texts, images)
        out: dict[str, torch.Tensor] = {}
        text_items = [i for i, t in enumerate(texts) if t is not None]
        if text_items:
            tokens = self.tokenize([texts[i] for i in text_items], max_length or self.config.max_seq_length)
            out.update(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"], text_item_index=torch.tensor(text_items))
        image_items = [i for i, bag in enumerate(bags) for _ in bag]
        if image_items:
            pil = [to_rgb(image) for bag in bags for image in bag]
            pixels = self._require_image_processor()(images=pil, return_tensors="pt")["pixel_values"]
            out.update(pixel_values=pixels, image_item_index=torch.tensor(image_items))
        out["num_items"] = torch.tensor(len(texts))
        return out

    # ------------------------------------------------------------------ encoding
    def image_descriptors(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """One D-vector per image: the vision encoder's pooled output (``vision_pooling``), max-pooled to D."""
        outputs = self.vision_encoder(pixel_values=pixel_values.to(self.vision_encoder.dtype))
        if self.config.vision_pooling == "pooler":
            pooled = getattr(outputs, "pooler_output", None)
            if pooled is None:
                raise ValueError(f"{type(self.vision_encoder).__name__} has no pooler_output: use vision_pooling='cls' or 'mean'")
            pooled = pooled.flatten(1)  # convolutional backbones (ResNet, ConvNeXt) pool to (N, C, 1, 1)
        elif self.config.vision_pooling == "cls":
            pooled = outputs.last_hidden_state[:, 0]
        else:
            pooled = outputs.last_hidden_state.mean(dim=1)
        return self.descriptor_pool(self.embedding_dropout(pooled).float().unsqueeze(1)).squeeze(1)

    def text_descriptors(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """One D-vector per text: the text encoder's pooled (``pooling``: masked mean) output, max-pooled to D."""
        return self.descriptor_pool(self.pooled_embedding(input_ids, attention_mask).unsqueeze(1)).squeeze(1)

    def descriptor_bags(
        self,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        text_item_index: Optional[torch.Tensor] = None,
        pixel_values: Optional[torch.Tensor] = None,
        image_item_index: Optional[torch.Tensor] = None,
        num_items: Optional[Union[int, torch.Tensor]] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``X^0``: padded bags ``(B, m_max, D)`` of descriptor vectors (each item's images, then its text) + mask.

        Without ``*_item_index`` the i-th text / image belongs to item i.
        """
        rows, owners = [], []
        if pixel_values is not None and pixel_values.shape[0]:
            rows.append(self.image_descriptors(pixel_values))
            owners.append(torch.arange(pixel_values.shape[0]) if image_item_index is None else image_item_index)
        if input_ids is not None and input_ids.shape[0]:
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            rows.append(self.text_descriptors(input_ids, attention_mask))
            owners.append(torch.arange(input_ids.shape[0]) if text_item_index is None else text_item_index)
        if not rows:
            raise ValueError("a bag batch needs texts (input_ids) and/or images (pixel_values)")
        dtype = self.self_attention.layer_norm.weight.dtype
        device = rows[0].device
        owners = torch.cat([o.to(device).long() for o in owners])
        return pad_bags(torch.cat(rows).to(dtype), owners, None if num_items is None else int(num_items))

    def self_attend(self, bags: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``X^1 = A_S(X^0)`` and ``x^1 = N(1^T X^1)`` (padded rows excluded from keys and sum)."""
        attended = self.self_attention(bags, bags, mask)
        return attended, masked_sum_normalize(attended, mask)

    def embed_bags(self, **bag_inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Bag tensors (see :meth:`prepare_bags`) -> ``(X^1 (B, m, D), mask (B, m), x^1 (B, D))``."""
        bags, mask = self.descriptor_bags(**bag_inputs)
        attended, vectors = self.self_attend(bags, mask)
        return attended, mask, vectors

    def label_adapted_embedding(self, query_bags: torch.Tensor, query_mask: torch.Tensor, label_bags: torch.Tensor, label_mask: torch.Tensor) -> torch.Tensor:
        """``x^{2,l} = N(1^T A_C(X^1, Z_l^1))`` for aligned (query, label) pairs: ``(n, m_q, D)`` x ``(n, m_l, D)`` -> ``(n, D)``.
        The sum runs over the query's rows (A_C's output has the query's shape)."""
        return masked_sum_normalize(self.cross_attention(query_bags, label_bags, label_mask), query_mask)

    def trained_classifier_mask(self, label_ids: torch.Tensor) -> torch.Tensor:
        """True where label ``l`` is scored with its own classifier ``w_l``: it has a row in the classifier tables
        (``l < label_space_size``) and training positives (a centroid count > 0, where centroids are known). Other
        labels, those attached after training and those never positive in training (their ``eta_l`` saw no positive,
        spec Sec. 12.16), are scored zero-shot with ``w_l = z_l^1`` (alpha = 1), in the same index."""
        ids = label_ids.long()
        if self.config.zero_shot or self.classifier is None:
            return torch.zeros_like(ids, dtype=torch.bool)
        trained = ids < self.classifier.num_labels
        counts = self.label_centroid_counts
        if counts is not None:
            if counts.numel() == 0:
                return torch.zeros_like(trained)
            counts = counts.to(ids.device)
            trained &= (ids < counts.shape[0]) & (counts[ids.clamp(max=counts.shape[0] - 1)] > 0)
        return trained

    def classifier_weights(self, label_ids: torch.Tensor, label_vectors: torch.Tensor) -> torch.Tensor:
        """``w_l`` for ``label_ids`` given their ``z_l^1``: the alpha-mixed classifier for labels with a trained one
        (:meth:`trained_classifier_mask`), exactly ``z_l^1`` for the others and in ``zero_shot`` mode (alpha = 1)."""
        if self.config.zero_shot or self.classifier is None:
            return label_vectors
        trained = self.trained_classifier_mask(label_ids).to(label_vectors.device)
        table_ids = label_ids.clamp(max=self.classifier.num_labels - 1)  # rows outside the table are masked out below
        return torch.where(trained.unsqueeze(-1), self.classifier(table_ids, label_vectors), label_vectors)

    def score_pairs(
        self,
        query_bags: torch.Tensor,
        query_mask: torch.Tensor,
        label_bags: torch.Tensor,
        label_mask: torch.Tensor,
        label_vectors: torch.Tensor,
        label_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Classifier scores ``c = <x^{2,l}, w_l>`` of aligned (query, label) pairs (one A_C evaluation each)."""
        adapted = self.label_adapted_embedding(query_bags, query_mask, label_bags, label_mask)
        weights = self.classifier_weights(label_ids, label_vectors)
        return (adapted * weights.to(adapted.dtype)).sum(dim=-1)

    @torch.no_grad()
    def encode_items(
        self,
        texts: Optional[Sequence[Optional[str]]] = None,
        images: Optional[Sequence[Any]] = None,
        batch_size: int = 64,
        show_progress_bar: Optional[bool] = None,
        return_bags: bool = False,
    ):
        """Vectors ``x^1`` ``(n, D)`` of items (eval mode, on CPU); with ``return_bags`` also the list of per-item
        ``X^1`` bags (each ``(m_i, D)``)."""
        texts, bags = self._normalize_items(texts, images)
        was_training = self.training
        self.eval()
        vectors, item_bags = [], []
        try:
            starts = range(0, len(texts), batch_size)
            if show_progress_bar and not progress_bar_disabled():
                from tqdm.auto import tqdm

                starts = tqdm(starts, desc="Encoding items", unit="batch")
            for start in starts:
                inputs = self.prepare_bags(texts[start : start + batch_size], bags[start : start + batch_size])
                attended, mask, vec = self.embed_bags(**self._to_device(inputs))
                vectors.append(vec.float().cpu())
                if return_bags:
                    item_bags.extend(attended[i, mask[i]].float().cpu() for i in range(attended.shape[0]))
        finally:
            self.train(was_training)
        out = torch.cat(vectors)
        return (out, item_bags) if return_bags else out

    def _to_device(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: (v.to(self.device) if k != "num_items" else v) for k, v in inputs.items()}

    def encode_queries(self, texts, batch_size: int = 64, show_progress_bar: Optional[bool] = None) -> torch.Tensor:
        """``x^1`` of text-only queries."""
        return self.encode_items(texts, None, batch_size, show_progress_bar)

    def query_encoder_modules(self) -> list[dict]:
        """MUFIN's item vector runs self- and cross-attention over a bag of text and image embeddings: no
        sentence-transformers module list expresses it."""
        raise NotImplementedError("MUFIN's item encoder (attention over text and image bags) has no sentence-transformers form")

    def query_search_vectors(self, texts, batch_size: int = 64, show_progress_bar: Optional[bool] = None) -> torch.Tensor:
        """``x^1`` of text-only queries: what :meth:`search` shortlists with."""
        return self.encode_queries(texts, batch_size, show_progress_bar)

    # ------------------------------------------------------------------ label store
    def set_labels(self, texts: Optional[Sequence[Optional[str]]], uids: Optional[Sequence[str]] = None, images: Optional[Sequence[Any]] = None) -> None:
        """Attach the label space: a text (``None`` or blank = none) and/or a bag of images per label, in label-id
        order. Drops the cached bags and index.

        A model with classifiers for ``label_space_size`` labels takes those labels first, in their training order;
        labels after them (added without retraining) are scored zero-shot (``w_l = z_l^1``) in the same index.
        Centroids are kept when the label count is unchanged, extended with empty rows (count 0) for appended labels,
        and dropped otherwise."""
        if texts is None and images is None:
            raise ValueError("labels need texts and/or images")
        n = len(texts) if texts is not None else len(images)
        known = self.config.label_space_size
        if not self.config.zero_shot and n < known:
            raise ValueError(
                f"this MUFIN model has classifiers for {known} labels (label_space_size) but got {n} labels: give its "
                f"{known} labels in training order, then any new ones (scored zero-shot), or use zero_shot=True"
            )
        if not self.config.zero_shot and n > known:
            logger.info("%d labels after the %d with classifiers are scored zero-shot (w_l = z_l^1)", n - known, known)
        norm_texts, bags = self._normalize_items(texts, images)  # validates: every label needs a descriptor
        super().set_labels(["" if t is None else t for t in norm_texts], uids)
        self.label_images = bags if any(bags) else None
        self.label_images_missing = False
        rows = self.label_centroids.shape[0] if self.label_centroids is not None else n
        if rows < n:
            self._extend_centroids(n - rows)
        elif rows > n:
            self.label_centroids = self.label_centroid_counts = None

    def _extend_centroids(self, count: int) -> None:
        """Zero centroids (count 0) for ``count`` appended labels: they have no training positives."""
        self.label_centroids = torch.cat([self.label_centroids, self.label_centroids.new_zeros(count, self.label_centroids.shape[1])])
        self.label_centroid_counts = torch.cat([self.label_centroid_counts, self.label_centroid_counts.new_zeros(count)])

    @torch.no_grad()
    def add_labels(
        self,
        texts: Optional[Sequence[Optional[str]]] = None,
        uids: Optional[Sequence[str]] = None,
        batch_size: int = 64,
        show_progress_bar: Optional[bool] = None,
        images: Optional[Sequence[Any]] = None,
    ) -> np.ndarray:
        """Append labels (texts and/or image bags), scored zero-shot (``w_l = z_l^1``, no centroid: the rule of labels
        after ``label_space_size``) while trained labels keep their classifiers. Only the new bags are encoded and
        appended to the cached label store; the shortlist index is rebuilt from the cache (no re-encoding). Returns
        the new label ids. Memory: the new labels' bag rows and vectors."""
        self._require_label_store()
        norm_texts, bags = self._normalize_items(texts, images)
        first = len(self.label_texts)
        uids = self._new_label_uids(len(norm_texts), uids)
        vectors, new_bags = self.encode_items(norm_texts, bags, batch_size, show_progress_bar, return_bags=True)
        counts = torch.tensor([b.shape[0] for b in new_bags])
        self.label_bag_rows = torch.cat([self.label_bag_rows, *new_bags]).contiguous()
        self.label_bag_offsets = torch.cat([self.label_bag_offsets, self.label_bag_offsets[-1] + torch.cumsum(counts, 0)])
        self.label_vectors = torch.cat([self.label_vectors, vectors.to(self.label_vectors)]).contiguous()
        if any(bags) or self.label_images is not None:
            self.label_images = (self.label_images or [[] for _ in range(first)]) + [list(b) for b in bags]
        self.label_texts = list(self.label_texts) + ["" if t is None else t for t in norm_texts]
        self.label_uids = list(self.label_uids) + uids
        if self.label_centroids is not None:
            self._extend_centroids(len(norm_texts))
        self.build_shortlist_index()
        return np.arange(first, len(self.label_texts), dtype=np.int64)

    @torch.no_grad()
    def remove_labels(self, uids: Sequence[str]) -> np.ndarray:
        """Remove labels added after training (ids >= ``label_space_size``; MUFIN's classifiers are laid out by training
        order, so trained labels stay). Returns the old ids of the kept labels."""
        self._require_label_store()
        keep = self._kept_label_ids(uids)
        gone = np.setdiff1d(np.arange(len(self.label_uids)), keep)
        if gone.size and gone[0] < self.config.label_space_size:
            raise ValueError(f"label {self.label_uids[gone[0]]!r} has a trained classifier: MUFIN removes only labels added after training")
        rows = torch.from_numpy(keep)
        starts, ends = self.label_bag_offsets[rows], self.label_bag_offsets[rows + 1]
        self.label_bag_rows = torch.cat([self.label_bag_rows[a:b] for a, b in zip(starts.tolist(), ends.tolist())]).contiguous()
        self.label_bag_offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(ends - starts, 0)])
        self.label_vectors = self.label_vectors[rows].contiguous()
        if self.label_images is not None:
            self.label_images = [self.label_images[i] for i in keep]
        self.label_texts = [self.label_texts[i] for i in keep]
        self.label_uids = [self.label_uids[i] for i in keep]
        if self.label_centroids is not None:
            self.label_centroids, self.label_centroid_counts = self.label_centroids[rows], self.label_centroid_counts[rows]
        self.build_shortlist_index()
        return keep

    def invalidate_label_index(self) -> None:
        """Forget the label bags, vectors and index (they no longer match the weights). Centroids are kept: they come
        from training points and are refreshed with :meth:`compute_label_centroids`."""
        super().invalidate_label_index()
        self.label_bag_rows = self.label_bag_offsets = self.label_vectors = None

    @torch.no_grad()
    def build_label_index(
        self,
        label_texts: Optional[Sequence[Optional[str]]] = None,
        label_uids: Optional[Sequence[str]] = None,
        kind: Optional[str] = None,
        batch_size: int = 64,
        show_progress_bar: Optional[bool] = None,
        label_images: Optional[Sequence[Any]] = None,
    ) -> LabelIndex:
        """Encode every label bag with the current weights (``Z_l^1`` and ``z_l^1``, cached) and build the shortlist
        index over them and the centroids. Without arguments, re-encodes the labels already attached: their texts and
        images (a loaded model has the images it was saved with, ``config.save_label_images``). Passing the attached
        label texts again without ``label_images`` keeps the attached images (an evaluator that only knows the label
        texts re-indexes the full multi-modal labels). A loaded model whose labels had images that were not saved
        refuses to re-encode them as text only: give ``label_images`` again."""
        same = (
            label_texts is not None and label_images is None and self.label_texts is not None
            and [t if isinstance(t, str) and t.strip() else "" for t in label_texts] == self.label_texts
        )
        if (same or (label_texts is None and label_images is None)) and self.label_images_missing:
            raise ValueError(
                "the labels of this model had images, which were not saved with it (save_label_images=False): re-encoding "
                "them needs the images again, build_label_index(label_texts, label_images=[...]) (label_images=[[]] * n "
                "re-encodes them as text only)"
            )
        if label_texts is not None or label_images is not None:
            self.set_labels(label_texts, label_uids, self.label_images if same else label_images)
        texts = self._require_labels()
        vectors, bags = self.encode_items(texts, self.label_images, batch_size, show_progress_bar, return_bags=True)
        counts = torch.tensor([b.shape[0] for b in bags])
        self.label_bag_rows = torch.cat(bags).contiguous()
        self.label_bag_offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(counts, 0)])
        self.label_vectors = vectors.contiguous()
        self.label_index = None
        return self.build_shortlist_index(kind)

    def _require_label_store(self) -> None:
        self._require_labels()
        if self.label_vectors is None:
            self.build_label_index()

    def label_bags(self, label_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached ``Z^1`` of ``label_ids`` ``(n,)`` as padded bags ``(n, m, D)`` + mask (m = the longest of them)."""
        label_ids = label_ids.cpu().long()
        start = self.label_bag_offsets[label_ids]
        count = self.label_bag_offsets[label_ids + 1] - start
        width = int(count.max()) if label_ids.numel() else 1
        slots = torch.arange(width)
        mask = slots.unsqueeze(0) < count.unsqueeze(1)
        rows = (start.unsqueeze(1) + slots.unsqueeze(0)).clamp(max=self.label_bag_rows.shape[0] - 1)
        bags = self.label_bag_rows[rows] * mask.unsqueeze(-1)
        return bags, mask

    def shortlist_vectors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The shortlist index rows (unit vectors) and the label id of each.

        ``shortlist_index="bag"``: every row of every ``Z_l^1`` plus ``mu_l`` for labels with training positives, i.e.
        ``sum_l (m_l + 1)`` rows (``m_l`` for labels without positives); ``"vector"``: one ``z_l^1`` per label.
        """
        num_labels = self.label_vectors.shape[0]
        if self.config.shortlist_index == "vector":
            return F.normalize(self.label_vectors, dim=-1), torch.arange(num_labels)
        counts = self.label_bag_offsets[1:] - self.label_bag_offsets[:-1]
        vectors = [self.label_bag_rows]
        owners = [torch.repeat_interleave(torch.arange(num_labels), counts)]
        if self.label_centroids is not None:
            has = (self.label_centroid_counts > 0).nonzero().squeeze(1)
            vectors.append(self.label_centroids[has])
            owners.append(has)
        return F.normalize(torch.cat(vectors).float(), dim=-1), torch.cat(owners)

    def build_shortlist_index(self, kind: Optional[str] = None) -> LabelIndex:
        """(Re)build the shortlist index from the cached label bags and centroids (no encoding)."""
        if self.label_vectors is None:
            raise ValueError("no label bags are cached: call build_label_index(label_texts, label_images=...) first")
        vectors, self.shortlist_row_labels = self.shortlist_vectors()
        self.label_index = LabelIndex(vectors, kind=kind or self.config.index_kind, ivf_nprobe=self.config.ivf_nprobe)
        return self.label_index

    def _require_shortlist_index(self) -> LabelIndex:
        self._require_label_store()
        if self.label_index is None:
            self.build_shortlist_index()
        return self.label_index

    def set_label_centroids(self, centroids: torch.Tensor, counts: Optional[torch.Tensor] = None) -> None:
        """Set ``mu_l`` (``(L, D)``) and the number of training positives behind each (``(L,)``; default: non-zero rows
        count as 1). Labels with count 0 add no centroid to the index. The index is rebuilt on next use."""
        centroids = torch.as_tensor(centroids).detach().float().cpu().contiguous()
        num_labels = len(self.label_texts) if self.label_texts is not None else self.config.label_space_size
        if centroids.ndim != 2 or centroids.shape[1] != self.config.embed_dim or (num_labels and centroids.shape[0] != num_labels):
            raise ValueError(f"centroids must have shape ({num_labels}, {self.config.embed_dim}), got {tuple(centroids.shape)}")
        counts = (centroids.abs().sum(dim=1) > 0).long() if counts is None else torch.as_tensor(counts).long().cpu()
        if counts.shape != (centroids.shape[0],):
            raise ValueError(f"counts must have shape ({centroids.shape[0]},), got {tuple(counts.shape)}")
        self.label_centroids, self.label_centroid_counts = centroids, counts
        self.label_index = None

    def compute_label_centroids(self, texts=None, images=None, targets=None, batch_size: int = 64, show_progress_bar: Optional[bool] = None) -> torch.Tensor:
        """``mu_l = mean{x_i^1 : y_il = 1}`` over training items (texts and/or images, ``targets`` ``(N, L)`` sparse or
        dense), encoded with the current weights; sets them (:meth:`set_label_centroids`) and returns them."""
        if targets is None:
            raise ValueError("compute_label_centroids needs the training targets (N x L)")
        vectors = self.encode_items(texts, images, batch_size, show_progress_bar)
        centroids, counts = label_centroids_from_embeddings(vectors, targets)
        self.set_label_centroids(centroids, counts)
        return centroids

    # ------------------------------------------------------------------ search and prediction
    @property
    def search_mode(self) -> str:
        return self.config.search_mode

    def set_search_mode(self, mode: str) -> None:
        """``predict`` ranks the shortlist by ``"fusion"`` (``beta c + (1 - beta) a``), ``"retrieval"`` (``a``) or
        ``"classifier"`` (``c``)."""
        if mode not in MUFIN_SEARCH_MODES:
            raise ValueError(f"search mode must be one of {MUFIN_SEARCH_MODES}, got {mode!r}")
        self.config.search_mode = mode

    @torch.no_grad()
    def shortlist(self, query_vectors: Union[torch.Tensor, np.ndarray], size: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
        """``R_t`` and ``a_tl`` for query vectors ``x^1``: one index query each, ``shortlist_fetch_factor * size`` raw
        hits collapsed to at most ``size`` unique labels scored by their best row. Returns ``(label_ids, scores)``,
        ``(n, size)`` int64 / float32, best first, ``-1`` / ``-inf`` padded."""
        size = size or self.config.shortlist_size
        index = self._require_shortlist_index()
        queries = F.normalize(torch.as_tensor(query_vectors).float(), dim=-1)
        raw_scores, raw_rows = index.search(queries, min(self.config.shortlist_fetch_factor * size, index.num_labels))
        row_labels = self.shortlist_row_labels.numpy()
        ids = np.full((queries.shape[0], size), -1, dtype=np.int64)
        scores = np.full((queries.shape[0], size), -np.inf, dtype=np.float32)
        for i in range(queries.shape[0]):
            valid = raw_rows[i] >= 0
            labels, row_scores = row_labels[raw_rows[i][valid]], raw_scores[i][valid]
            _, first = np.unique(labels, return_index=True)  # hits are sorted: a label's first hit is its max
            first = np.sort(first)[:size]
            ids[i, : first.size], scores[i, : first.size] = labels[first], row_scores[first]
        return ids, scores

    def search(self, query_vectors: Union[torch.Tensor, np.ndarray], k: int = 5) -> tuple[np.ndarray, np.ndarray]:
        """Retrieval-only top-k (the shortlist scores ``a``) for query vectors ``x^1``; returns ``(scores, ids)``."""
        ids, scores = self.shortlist(query_vectors, max(k, self.config.shortlist_size))
        return scores[:, :k], ids[:, :k]

    @torch.no_grad()
    def predict(
        self,
        texts: Optional[Sequence[Optional[str]]] = None,
        k: Optional[int] = None,
        batch_size: int = 64,
        show_progress_bar: Optional[bool] = None,
        *,
        images: Optional[Sequence[Any]] = None,
        search_mode: Optional[str] = None,
        pair_batch_size: int = 4096,
        threshold: Optional[float] = None,
    ) -> XMCPrediction:
        """Rank the model's labels for items given as texts and/or images (see :meth:`prepare_bags`).

        Per item: ``x^1`` queries the shortlist index once (``R_t``, ``a``); ``A_C`` and the classifier run on the
        shortlist only (``c``, batched over ``pair_batch_size`` pairs); the shortlist is ranked by ``search_mode``
        (default ``config.search_mode``). Labels outside ``R_t`` get no score: slots beyond ``|R_t|`` hold ``-1`` /
        ``-inf`` / ``""``. ``k`` and ``threshold`` as in :meth:`XMCPreTrainedModel.predict` (the calibration is the one of
        ``config.search_mode``'s scores).
        """
        k = self._prediction_depth(k, threshold)
        mode = search_mode or self.config.search_mode
        if mode not in MUFIN_SEARCH_MODES:
            raise ValueError(f"search mode must be one of {MUFIN_SEARCH_MODES}, got {mode!r}")
        norm_texts, bags = self._normalize_items(texts, images)
        self._require_shortlist_index()
        was_training = self.training
        self.eval()
        n = len(norm_texts)
        out_ids = np.full((n, k), -1, dtype=np.int64)
        out_scores = np.full((n, k), -np.inf, dtype=np.float32)
        try:
            for start in range(0, n, batch_size):
                inputs = self.prepare_bags(norm_texts[start : start + batch_size], bags[start : start + batch_size])
                query_bags, query_mask, query_vectors = self.embed_bags(**self._to_device(inputs))
                ids, retrieval = self.shortlist(query_vectors.float().cpu())
                scores = retrieval.copy()
                if mode != "retrieval":
                    classifier = self._shortlist_classifier_scores(query_bags, query_mask, ids, pair_batch_size)
                    scores = classifier if mode == "classifier" else self.config.fusion_beta * classifier + (1.0 - self.config.fusion_beta) * retrieval
                scores = np.where(ids >= 0, scores, -np.inf).astype(np.float32)
                order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
                width = order.shape[1]
                out_ids[start : start + len(ids), :width] = np.take_along_axis(ids, order, 1)
                out_scores[start : start + len(ids), :width] = np.take_along_axis(scores, order, 1)
        finally:
            self.train(was_training)
        return self._prediction(out_ids, out_scores, threshold)

    def _shortlist_classifier_scores(self, query_bags: torch.Tensor, query_mask: torch.Tensor, ids: np.ndarray, pair_batch_size: int) -> np.ndarray:
        """``c_tl`` for every (query, shortlisted label) pair: one A_C + classifier evaluation per pair."""
        scores = np.zeros(ids.shape, dtype=np.float32)
        query_of, slot_of = np.nonzero(ids >= 0)
        for start in range(0, query_of.size, pair_batch_size):
            q = torch.from_numpy(query_of[start : start + pair_batch_size])
            labels = torch.from_numpy(ids[query_of[start : start + pair_batch_size], slot_of[start : start + pair_batch_size]])
            label_bags, label_mask = self.label_bags(labels)
            device = query_bags.device
            c = self.score_pairs(
                query_bags[q.to(device)],
                query_mask[q.to(device)],
                label_bags.to(device, query_bags.dtype),
                label_mask.to(device),
                self.label_vectors[labels].to(device, query_bags.dtype),
                labels.to(device),
            )
            scores[query_of[start : start + pair_batch_size], slot_of[start : start + pair_batch_size]] = c.float().cpu().numpy()
        return scores

    # ------------------------------------------------------------------ training
    # Module IV learning rates relative to the encoders' (official code: 5e-5 / 5e-4 / 5e-3)
    cross_attention_learning_rate_multiplier = 10.0
    classifier_learning_rate_multiplier = 100.0
    # both modules: the vision encoder's rate relative to the text encoder's (10x was no better on Emoji-XMC, README)
    vision_learning_rate_multiplier = 1.0
    # free vectors and alpha logits are per-label tables: no weight decay toward zero
    no_weight_decay_parameters = ("classifier.free_vectors.weight", "classifier.alpha_logits")

    def parameter_learning_rates(self, base_lr: float) -> dict[str, float]:
        """Learning rate per parameter-name prefix (read by the trainer's optimizer): ``A_C`` at 10x and the classifier
        tables at 100x the encoders' rate, as the official Module IV (in Module I they get no gradient); the vision
        encoder at ``vision_learning_rate_multiplier`` x in both modules."""
        rates = {"cross_attention.": base_lr * self.cross_attention_learning_rate_multiplier}
        if self.vision_learning_rate_multiplier != 1.0:
            rates["vision_encoder."] = base_lr * self.vision_learning_rate_multiplier
        if self.classifier is not None:
            rates["classifier."] = base_lr * self.classifier_learning_rate_multiplier
        return rates

    def set_training_stage(self, stage: str) -> None:
        """The loss ``forward`` computes when called without ``stage``: ``"siamese"`` (Module I) or ``"ranker"`` (IV)."""
        if stage not in MUFIN_STAGES:
            raise ValueError(f"stage must be one of {MUFIN_STAGES}, got {stage!r}")
        self.training_stage = stage

    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        text_item_index: Optional[torch.Tensor] = None,
        pixel_values: Optional[torch.Tensor] = None,
        image_item_index: Optional[torch.Tensor] = None,
        num_items: Optional[torch.Tensor] = None,
        label_input_ids: Optional[torch.Tensor] = None,
        label_attention_mask: Optional[torch.Tensor] = None,
        label_text_item_index: Optional[torch.Tensor] = None,
        label_pixel_values: Optional[torch.Tensor] = None,
        label_image_item_index: Optional[torch.Tensor] = None,
        label_num_items: Optional[torch.Tensor] = None,
        label_ids: Optional[torch.Tensor] = None,
        targets: Optional[torch.Tensor] = None,
        pair_mask: Optional[torch.Tensor] = None,
        stage: Optional[str] = None,
        **kwargs,
    ) -> MUFINModelOutput:
        r"""
        Args:
            input_ids / attention_mask / text_item_index / pixel_values / image_item_index / num_items:
                the query items' bags (:meth:`prepare_bags`): B items.
            label_*: the label pool's bags, same layout: P labels.
            label_ids: ``(P,)`` label ids of the pool (they select ``eta`` / ``alpha`` in the ranker stage).
            targets: ``(B, P)`` bool, True where pool label l is a positive of query i (all positives, so in-batch
                negatives are never false negatives).
            pair_mask: ranker stage: ``(B, P)`` bool, the pairs to score (each query's ``S_i`` positives and ``T_i``
                shortlist negatives); default all pairs.
            stage: ``"siamese"`` (Module I: ``<z_l^1, x_i^1>``, triplet loss anchored on each pool label with
                ``siamese_num_positives`` hard positives (cos <= ``hard_positive_max_cos``) and the
                ``siamese_num_negatives`` most similar in-batch negatives; no A_C, no free vectors) or ``"ranker"``
                (Module IV: ``c_il = <x_i^{2,l}, w_l>`` on ``pair_mask``, cosine-embedding loss). Default:
                ``self.training_stage``.

        Returns:
            [`MUFINModelOutput`]; ``loss`` when ``targets`` are given. Without label inputs only ``query_embeds``.
        """
        stage = stage or self.training_stage
        if stage not in MUFIN_STAGES:
            raise ValueError(f"stage must be one of {MUFIN_STAGES}, got {stage!r}")
        query_bags, query_mask, query_vectors = self.embed_bags(
            input_ids=input_ids, attention_mask=attention_mask, text_item_index=text_item_index,
            pixel_values=pixel_values, image_item_index=image_item_index, num_items=num_items,
        )
        if label_input_ids is None and label_pixel_values is None:
            return MUFINModelOutput(query_embeds=query_vectors)
        label_bags, label_mask, label_vectors = self.embed_bags(
            input_ids=label_input_ids, attention_mask=label_attention_mask, text_item_index=label_text_item_index,
            pixel_values=label_pixel_values, image_item_index=label_image_item_index, num_items=label_num_items,
        )
        if targets is not None and targets.shape != (query_vectors.shape[0], label_vectors.shape[0]):
            raise ValueError(f"targets must have shape (queries, pool) = {(query_vectors.shape[0], label_vectors.shape[0])}, got {tuple(targets.shape)}")
        cfg = self.config
        loss = None
        if stage == "siamese":
            logits = query_vectors @ label_vectors.T
            if targets is not None:
                pos, pos_mask, neg, neg_mask = select_siamese_pairs(
                    logits.T, targets.T.bool(), cfg.siamese_num_positives, cfg.siamese_num_negatives, cfg.hard_positive_max_cos
                )
                loss = mufin_triplet_loss(
                    pos, neg, cfg.siamese_margin, pos_mask, neg_mask, cfg.siamese_negative_temperature, cfg.siamese_loss_reduction
                )
            return MUFINModelOutput(loss=loss, logits=logits, query_embeds=query_vectors, label_embeds=label_vectors)

        if label_ids is None and self.classifier is not None and not cfg.zero_shot:
            raise ValueError("the ranker stage needs the pool's label_ids to look up the free vectors and alphas")
        if pair_mask is None:
            pair_mask = torch.ones(query_vectors.shape[0], label_vectors.shape[0], dtype=torch.bool, device=query_vectors.device)
        pair_mask = pair_mask.bool()
        query_of, label_of = pair_mask.nonzero(as_tuple=True)
        pool_ids = label_ids.to(query_vectors.device) if label_ids is not None else torch.arange(label_vectors.shape[0], device=query_vectors.device)
        c = self.score_pairs(
            query_bags[query_of], query_mask[query_of], label_bags[label_of], label_mask[label_of], label_vectors[label_of], pool_ids[label_of]
        )
        logits = torch.zeros(pair_mask.shape, dtype=c.dtype, device=c.device).index_put((query_of, label_of), c)
        if targets is not None:
            positive = targets.bool().to(pair_mask.device)
            loss = mufin_ranker_loss(logits, logits, cfg.ranker_margin, positive & pair_mask, ~positive & pair_mask, cfg.ranker_loss_reduction)
        return MUFINModelOutput(loss=loss, logits=logits, query_embeds=query_vectors, label_embeds=label_vectors, pair_mask=pair_mask)

    # ------------------------------------------------------------------ what the model needs and came from (its card)
    def base_model_names(self) -> list[str]:
        """The text encoder's and the vision tower's ``name_or_path`` (an open_clip tower: its ``hf-hub:`` repo)."""
        names = super().base_model_names()
        if self.config.open_clip_config:
            name = str(self.config.open_clip_config.get("name", ""))
            names.append(name.partition("@")[0][len("hf-hub:") :] if name.startswith("hf-hub:") else "")
        elif self.config.vision_config is not None:
            names.append(self.config.vision_config.name_or_path)
        return names

    def runtime_requirements(self) -> dict[str, str]:
        """The base requirements plus Pillow (image inputs) and, for an open_clip image tower, open_clip_torch."""
        needs = dict(super().runtime_requirements())
        needs["Pillow"] = "image inputs (paths, bytes) and the saved image processor"
        if self.config.open_clip_config:
            needs["open_clip_torch"] = "the open_clip image tower"
        return needs

    # ------------------------------------------------------------------ persistence
    @classmethod
    def model_files(cls) -> dict[str, bool]:
        """The base class's files without ``label_embeddings.safetensors`` (MUFIN's label store is its bags), plus the
        image processor, the label bags (needed), the centroids and the label images (optional)."""
        files = super().model_files()
        del files[LABEL_EMBEDDINGS_FILE], files[LABEL_EMBEDDINGS_INDEX_FILE]
        files.update({IMAGE_PROCESSOR_FILE: True, PROCESSOR_FILE: False, LABEL_BAGS_FILE: True, LABEL_CENTROIDS_FILE: False, LABEL_IMAGES_FILE: False})
        return files

    def _save_model_files(self, save_directory: str, *args, **kwargs) -> None:
        """Weights, config, tokenizer and labels (base class) plus the image processor, the cached label bags, the label
        images (``config.save_label_images``), the centroids and the shortlist index."""
        super()._save_model_files(save_directory, *args, **kwargs)
        if self.image_processor is not None:
            self.image_processor.save_pretrained(save_directory)
            if self.tokenizer is not None:
                # a relative import: processing_mufin.py travels with the remote code (AutoProcessor reads its auto_map)
                from .processing_mufin import MUFINProcessor

                MUFINProcessor(image_processor=self.image_processor, tokenizer=self.tokenizer).save_pretrained(save_directory)
        if self.label_vectors is not None:
            tensors = {"label_bag_rows": self.label_bag_rows, "label_bag_offsets": self.label_bag_offsets, "label_vectors": self.label_vectors}
            tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
            atomic_write(os.path.join(save_directory, LABEL_BAGS_FILE), lambda p: save_file(tensors, p, metadata={"format": "pt"}))
        if self.label_images is not None and self.config.save_label_images:
            images = pack_label_images(self.label_images)
            atomic_write(os.path.join(save_directory, LABEL_IMAGES_FILE), lambda p: save_file(images, p, metadata={"format": "pt"}))
        if self.label_centroids is not None:
            tensors = {"label_centroids": self.label_centroids.contiguous(), "label_centroid_counts": self.label_centroid_counts.contiguous()}
            atomic_write(os.path.join(save_directory, LABEL_CENTROIDS_FILE), lambda p: save_file(tensors, p, metadata={"format": "pt"}))
        if self.label_vectors is not None:
            self._require_shortlist_index().save(save_directory)

    def _load_artifacts(self, path: str, hub: dict) -> None:
        super()._load_artifacts(path, hub)

        def fetch(name: str) -> Optional[str]:
            return self._fetch_artifact(path, name, hub)

        if fetch(IMAGE_PROCESSOR_FILE) is not None:
            # the vision config is handed over so that config.json (with its auto_map) is not read again
            try:
                self.image_processor = AutoImageProcessor.from_pretrained(path, config=self.config.vision_config, **hub)
            except ImportError as err:  # image processors need Pillow: text-only use must still load and predict
                self.image_processor_error = str(err).strip() or type(err).__name__
                logger.warning("MUFIN loaded without its image processor (texts only): %s", self.image_processor_error)
        centroids_path = fetch(LABEL_CENTROIDS_FILE)
        if centroids_path is not None:
            saved = read_safetensors(centroids_path, keys=("label_centroids", "label_centroid_counts"))
            self.label_centroids, self.label_centroid_counts = saved["label_centroids"], saved["label_centroid_counts"]
        bags_path = fetch(LABEL_BAGS_FILE)
        if bags_path is not None:
            saved = read_safetensors(bags_path, keys=("label_bag_rows", "label_bag_offsets", "label_vectors"))
            num_labels = saved["label_vectors"].shape[0]
            if self.label_texts is not None and num_labels != len(self.label_texts):
                raise ModelFileError(f"{bags_path}: holds {num_labels} label bags but labels.jsonl lists {len(self.label_texts)} labels")
            check_offsets(bags_path, saved["label_bag_offsets"].numpy(), num_labels, saved["label_bag_rows"].shape[0], "label_bag_offsets")
            if saved["label_bag_rows"].ndim != 2 or saved["label_vectors"].ndim != 2 or saved["label_bag_rows"].shape[1] != saved["label_vectors"].shape[1]:
                raise ModelFileError(
                    f"{bags_path}: label_bag_rows {list(saved['label_bag_rows'].shape)} and label_vectors {list(saved['label_vectors'].shape)} "
                    "are not (rows, dim) tensors of one width"
                )
            self.label_bag_rows, self.label_bag_offsets, self.label_vectors = saved["label_bag_rows"], saved["label_bag_offsets"], saved["label_vectors"]
            self._label_store_path = bags_path
        images_path = fetch(LABEL_IMAGES_FILE)
        if images_path is not None:
            packed = read_safetensors(images_path, keys=("image_bytes", "image_offsets", "label_image_offsets"))
            check_offsets(images_path, packed["image_offsets"].numpy(), len(packed["image_offsets"]) - 1, packed["image_bytes"].numel(), "image_offsets")
            check_offsets(images_path, packed["label_image_offsets"].numpy(), len(packed["label_image_offsets"]) - 1, len(packed["image_offsets"]) - 1, "label_image_offsets")
            images = unpack_label_images(packed)
            if self.label_texts is not None and len(images) != len(self.label_texts):
                raise ModelFileError(f"{images_path}: holds images of {len(images)} labels but labels.jsonl lists {len(self.label_texts)} labels")
            self.label_images = images if any(images) else None
        elif self.label_bag_offsets is not None and self.label_texts is not None:
            # rows of a label's bag beyond its text are images: had the labels any, re-encoding them needs them back
            text_rows = torch.tensor([1 if t else 0 for t in self.label_texts])
            self.label_images_missing = bool(((self.label_bag_offsets[1:] - self.label_bag_offsets[:-1]) > text_rows).any())
        if bags_path is not None:
            vectors, self.shortlist_row_labels = self.shortlist_vectors()
            # the saved faiss file is reused when it matches these rows and the installed faiss, else rebuilt
            self.label_index = LabelIndex.load(vectors, meta_path=fetch(INDEX_META_FILE), index_path=self._saved_index_path(fetch), kind=self.config.index_kind)


__all__ = [
    "MUFINAttention",
    "MUFINClassifier",
    "MUFINModel",
    "MUFINModelOutput",
    "MUFINPreTrainedModel",
    "label_centroids_from_embeddings",
    "masked_sum_normalize",
    "pad_bags",
    "select_siamese_pairs",
]
