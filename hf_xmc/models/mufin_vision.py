"""MUFIN's vision tower: built from its config, loaded from a pretrained checkpoint (an HF vision model or an
open_clip image tower), and partly frozen for training.

The default tower, when no pretrained one is given (text-only data, or images learnt from scratch), is a small ResNet
for 64 x 64 images (4 stages of one basic block, 32..192 channels, about 0.9M parameters). A convolutional tower, not
the paper's ViT: trained from scratch on Emoji-XMC (about 1k images) a ViT of the same size learnt almost nothing
(image-only P@1 7.5 vs 32.6, multimodal 44.3 vs 48.6; README, benchmarks/bench_mufin.py). The paper's ViT is what a
pretrained checkpoint gives (``vision_name_or_path``).

Remote-code file (``modeling_mufin.py`` imports it): torch, transformers and open_clip (optional: only models with an
open_clip image tower need it, the ``vision`` extra).
"""

import json
import os
from typing import Any, Optional

import torch
from torch import nn
from transformers import AutoConfig, AutoImageProcessor, AutoModel
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.modeling_outputs import BaseModelOutputWithPooling

from .configuration_mufin import OPEN_CLIP_PREFIX, MUFINConfig

try:  # only for open_clip vision towers (the ``vision`` extra)
    import open_clip
    from open_clip.model import _build_vision_tower
except ImportError:
    open_clip = None

SMALL_VISION_CONFIG = dict(
    model_type="resnet", num_channels=3, embedding_size=32, hidden_sizes=[32, 64, 128, 192], depths=[1, 1, 1, 1], layer_type="basic",
)
SMALL_VISION_IMAGE_SIZE = 64

# names of the vision parameters before the layer stack (patch / class / position embeddings, open_clip's conv1 and
# ln_pre): frozen with the early layers
PRE_STACK_MARKERS = ("embed", "conv1", "ln_pre")


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


def build_vision_tower(config: MUFINConfig) -> nn.Module:
    """The vision encoder ``config`` describes, with fresh weights: its open_clip image tower, else
    ``AutoModel.from_config(config.vision_config)``."""
    return OpenCLIPVisionTower(config.open_clip_config["model_cfg"]) if config.open_clip_config else AutoModel.from_config(config.vision_config)


def pretrained_vision_tower(vision_name_or_path: Optional[str], vision_config: Optional[dict] = None) -> tuple[nn.Module, dict, Any]:
    """A vision encoder to start MUFIN from: an HF vision checkpoint, ``"open_clip:<name>"`` (:func:`load_open_clip_tower`)
    or, for ``None``, a random tower of ``vision_config`` (default :data:`SMALL_VISION_CONFIG`) with a
    resize-and-normalise ``ViTImageProcessor`` (``image_size`` of the config, else 64).

    Returns the tower, the :class:`MUFINConfig` arguments that describe it (``vision_config`` or ``open_clip_config``)
    and its image processor."""
    if vision_name_or_path is None:
        vision_config = AutoConfig.for_model(**dict(vision_config or SMALL_VISION_CONFIG))
        vision = AutoModel.from_config(vision_config)
        size = getattr(vision_config, "image_size", SMALL_VISION_IMAGE_SIZE)
        from transformers import ViTImageProcessor  # here, not at import time (see load_open_clip_tower)

        return vision, {"vision_config": vision.config.to_dict()}, ViTImageProcessor(size={"height": size, "width": size})
    if str(vision_name_or_path).startswith(OPEN_CLIP_PREFIX):
        vision, open_clip_config, image_processor = load_open_clip_tower(str(vision_name_or_path)[len(OPEN_CLIP_PREFIX) :])
        return vision, {"open_clip_config": open_clip_config}, image_processor
    vision = AutoModel.from_pretrained(vision_name_or_path)
    image_processor = AutoImageProcessor.from_pretrained(vision_name_or_path)
    return vision, {"vision_config": vision.config.to_dict()}, image_processor


def vision_layer_stack(vision_encoder: nn.Module, config: MUFINConfig) -> nn.ModuleList:
    """The vision encoder's list of layers: transformer layers (ViT: ``encoder.layer``; open_clip:
    ``transformer.resblocks``) or the stages of a convolutional backbone (ResNet, ConvNeXt: ``encoder.stages``)."""
    if config.open_clip_config:
        depth = config.open_clip_config["model_cfg"]["vision_cfg"].get("layers")
    else:
        vision_config = config.vision_config
        depth = getattr(vision_config, "num_hidden_layers", None) or len(getattr(vision_config, "depths", None) or ())
    for _, module in vision_encoder.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == depth:
            return module
    raise ValueError(f"cannot find the {depth} layers of the vision encoder {type(vision_encoder).__name__}")


def freeze_vision_tower(vision_encoder: nn.Module, config: MUFINConfig, num_trainable_layers: int) -> list[str]:
    """Freeze ``vision_encoder`` except its last ``num_trainable_layers`` layers or stages and the modules after them
    (final norm, pooler); embeddings and earlier layers get no gradient. 0 freezes it all, -1 unfreezes it all.
    Returns the names of the parameters left trainable."""
    if num_trainable_layers == -1:
        vision_encoder.requires_grad_(True)
    else:
        layers = vision_layer_stack(vision_encoder, config)
        vision_encoder.requires_grad_(False)
        if num_trainable_layers > 0:
            for layer in list(layers)[-num_trainable_layers:]:
                layer.requires_grad_(True)
            in_stack = {id(p) for p in layers.parameters()}
            for name, param in vision_encoder.named_parameters():
                if id(param) not in in_stack and not any(marker in name for marker in PRE_STACK_MARKERS):  # post-stack: final norm, pooler
                    param.requires_grad_(True)
    return [name for name, p in vision_encoder.named_parameters() if p.requires_grad]


__all__ = [
    "OpenCLIPVisionTower",
    "SMALL_VISION_CONFIG",
    "build_vision_tower",
    "freeze_vision_tower",
    "load_open_clip_tower",
    "open_clip_model_config",
    "pretrained_vision_tower",
    "vision_layer_stack",
]
