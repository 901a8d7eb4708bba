"""MUFIN configuration."""

from __future__ import annotations

from typing import Optional

from transformers import AutoConfig, PreTrainedConfig
from transformers.configuration_utils import SubConfigSpec

from .configuration_xmc import XMCConfig

MUFIN_ALPHA_PARAMS = ("softmax2", "sigmoid")
MUFIN_SHORTLIST_INDEXES = ("bag", "vector")
MUFIN_SEARCH_MODES = ("fusion", "retrieval", "classifier")
MUFIN_VISION_POOLINGS = ("pooler", "cls", "mean")
MUFIN_LOSS_REDUCTIONS = ("sum", "mean")


OPEN_CLIP_PREFIX = "open_clip:"


def encoder_width(config: PreTrainedConfig | dict | None) -> Optional[int]:
    """Width of an encoder's pooled output: ``hidden_size`` (transformers), the last stage's channels
    (``hidden_sizes[-1]``: ResNet, ConvNeXt) or an open_clip ``model_cfg``'s ``embed_dim``; None when it names none."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    if get("vision_cfg") is not None:  # an open_clip model_cfg: the image tower projects to embed_dim
        return get("embed_dim")
    if get("hidden_size") is not None:
        return get("hidden_size")
    sizes = get("hidden_sizes")
    return sizes[-1] if sizes else None


class MUFINConfig(XMCConfig):
    r"""
    Configuration of [`MUFINModel`], "Multi-modal Extreme Classification" (Mittal et al., CVPR 2022).

    Items (queries and labels) are *bags* of descriptors: one row per image (vision encoder) and one row for the
    text (text encoder), each max-pooled to ``embed_dim``. A self-attention block ``A_S`` mixes a bag, whose
    normalised sum is the item's vector ``x^1`` / ``z_l^1``; a cross-attention block ``A_C`` adapts a query bag to a
    label bag (``x^{2,l}``), scored against the per-label classifier ``w_l = alpha_l z_l^1 + (1 - alpha_l) N(eta_l)``.
    Prediction shortlists labels with one index query (label bag rows + positive centroids), then fuses the
    classifier score ``c`` and the retrieval score ``a`` as ``s = beta c + (1 - beta) a``.

    Defaults follow the paper; where the paper is silent they follow the official code ([CODE] in
    ``shared/specs/mufin.md``), and where paper and code disagree the code's choice is a flag (noted below).

    Args:
        encoder_config (`PreTrainedConfig` or `dict`, *optional*):
            Text encoder ``E_T`` (any ``AutoModel`` text backbone). Defaults to a DistilBERT config (the paper's
            msmarco-distilbert-base-v4 architecture). Pooling: ``pooling`` (masked mean, as the code).
        vision_config (`PreTrainedConfig` or `dict`, *optional*):
            Vision encoder ``E_V`` (any ``AutoModel`` vision backbone with a pooled output: ViT, ResNet, ConvNeXt,
            ...). Defaults to a ViT config (ViT-B/32 in the code).
        open_clip_config (`dict`, *optional*):
            An open_clip image tower instead of ``vision_config`` (the ``vision`` extra): open_clip's own
            ``open_clip_config.json`` content, ``{"model_cfg": {"embed_dim", "vision_cfg", ...}, "preprocess_cfg":
            {...}}``; only the image tower is built, its projected embedding is the pooled output. Set by
            [`MUFINModel.from_encoders_pretrained`] for a ``"open_clip:<name>"`` vision encoder.
        vision_pooling (`str`, *optional*, defaults to `"pooler"`):
            One vector per image: `"pooler"` (``pooler_output``, ViT's tanh(dense(CLS)); the code's choice), `"cls"`
            (first token of the last hidden state) or `"mean"` (mean over patches).
        max_seq_length (`int`, *optional*, defaults to 32):
            Token budget of a text descriptor, query or label (code: 32).
        embed_dim (`int`, *optional*, defaults to 192):
            D: every descriptor vector is reduced to D by a parameter-free ``AdaptiveMaxPool1d(D)`` (768 -> 192 in
            the paper). Must not exceed either encoder's hidden size.
        attention_heads (`int`, *optional*, defaults to 12):
            Heads of ``A_S`` and ``A_C`` (code: 12, so d_h = 16 at D = 192). Must divide ``embed_dim``.
        attention_dropout (`float`, *optional*, defaults to 0.3):
            Dropout on the attention probabilities (code config: 0.3).
        spectral_norm (`bool`, *optional*, defaults to `True`):
            Wrap Q, K, V, O in ``torch.nn.utils.parametrizations.spectral_norm`` (the code does; the paper does not
            describe the block). With the identity init the spectral norm is 1, so the block starts exactly at
            identity Q/K/V/O either way.
        label_space_size (`int`, *optional*, defaults to 0):
            L: number of labels with a free vector ``eta_l`` and a weight ``alpha_l``. 0 builds no per-label
            parameters (requires ``zero_shot=True``). Labels attached beyond the first L (added after training), and
            labels without training positives (a centroid count of 0), are scored zero-shot: ``w_l = z_l^1``.
        zero_shot (`bool`, *optional*, defaults to `False`):
            MUFIN(alpha=1): ``alpha_l = 1`` for every label, so ``w_l = z_l^1`` exactly and any label set (also
            labels never seen in training) can be scored. The free vectors, if any, are ignored.
        alpha_init (`float`, *optional*, defaults to 0.5):
            Initial ``alpha_l`` (paper Module III and code: 0.5). Must lie in (0, 1).
        alpha_param (`str`, *optional*, defaults to `"softmax2"`):
            How ``alpha_l in [0, 1]`` is parameterised (the paper does not say): `"softmax2"` (the code: a 2-way
            softmax over two logits per label, ``(1 - alpha, alpha)``) or `"sigmoid"` (one logit per label).
        renormalize_classifier (`bool`, *optional*, defaults to `True`):
            Re-normalise ``w_l`` to unit norm (the code). The paper only says the two unit vectors are "linearly
            combined", so `False` is the literal paper. Default `True` because the paper trains Module IV with a
            *cosine* embedding loss (``1 - <x, w>`` for positives, ``[<x, w> - 0.5]_+`` for negatives) and fuses
            ``c`` with the cosine ``a``: both assume ``<x^{2,l}, w_l>`` is a cosine, which it is only for a unit
            ``w_l`` (without it the positive term cannot reach 0 for any alpha strictly inside (0, 1)).
        search_mode (`str`, *optional*, defaults to `"fusion"`):
            Score used by `predict`: `"fusion"` (``s = beta c + (1 - beta) a``, the paper), `"retrieval"` (``a``
            only, the paper's MUFIN-P-I ablations) or `"classifier"` (``c`` only). All rank the shortlist only.
        fusion_beta (`float`, *optional*, defaults to 0.7):
            beta of the fusion (paper and code: 0.7).
        shortlist_size (`int`, *optional*, defaults to 100):
            Unique labels kept per query from the index (paper: at most 100).
        shortlist_index (`str`, *optional*, defaults to `"bag"`):
            What the shortlist index holds per label: `"bag"` (every row of ``Z_l^1`` plus the centroid ``mu_l`` of
            its training positives when it has any; the paper's NN^x, P-I-bag) or `"vector"` (``z_l^1`` only, the
            P-I-vec ablation). Vectors are L2-normalised (cosine search, as the code).
        shortlist_fetch_factor (`int`, *optional*, defaults to 3):
            Raw index hits fetched per query = ``shortlist_fetch_factor * shortlist_size`` before collapsing them to
            unique labels (the paper does not say; spec recommendation ~3x).
        siamese_margin (`float`, *optional*, defaults to 0.2):
            gamma of the Module I triplet loss (paper: 0.2; code: 0.3).
        siamese_num_positives / siamese_num_negatives (`int`, *optional*, defaults to 2 / 3):
            |P_l| hard positives and |N_l| in-batch hard negatives per label anchor in Module I (paper: 2 / 3).
        hard_positive_max_cos (`float`, *optional*, defaults to 0.9):
            Module I positives with ``<z_l^1, x_i^1>`` above this are not sampled (vanishing gradients, paper).
            A label whose positives are all above it falls back to its hardest (least similar) positives.
        siamese_negative_temperature (`float`, *optional*):
            `None` (paper): plain sum of hinges. The code weights each hinge by ``softmax(s_neg / 0.1)`` over the
            anchor's negatives: set 0.1 for that.
        siamese_loss_reduction (`str`, *optional*, defaults to `"sum"`):
            `"sum"` (paper's formula) or `"mean"` over valid triplets.
        ranker_margin (`float`, *optional*, defaults to 0.5):
            gamma of the Module IV cosine-embedding loss (paper and code: 0.5).
        ranker_num_positives / ranker_num_negatives (`int`, *optional*, defaults to 2 / 12):
            |S_i| random positives and |T_i| shortlist hard negatives per query in Module IV (paper: 2 / 12); read
            by the collator that builds the ranker pools.
        ranker_loss_reduction (`str`, *optional*, defaults to `"sum"`):
            `"sum"` (paper's formula) or `"mean"` over the scored (query, label) pairs (the code averages).
        vision_trainable_layers (`int`, *optional*, defaults to 1):
            How many final vision encoder layers [`MUFINModel.freeze_vision_layers`] leaves trainable (paper: "its
            final layer was fine-tuned" = 1; code: 4). The modules after the layer stack (final norm, pooler) stay
            trainable with them; 0 freezes the whole vision encoder, -1 trains all of it.
        max_images (`int`, *optional*, defaults to -1):
            Images kept per item, in the order given (code flag ``KEEP_TOP_K``); -1 keeps all, 0 drops every image
            (a text-only ablation of a trained model).
        save_label_images (`bool`, *optional*, defaults to `True`):
            Store the label images (their file bytes, one ``mufin_label_images.safetensors``) with the model, so a
            reloaded model can re-encode its labels (``build_label_index()``) from texts *and* images. With `False`
            only the encoded bags are saved and a re-encoding of labels that had images must be given them again.
        kwargs: the shared fields of [`XMCConfig`] (pooling, index kind, propensity constants, ...).
    """

    model_type = "hf_xmc_mufin"
    sub_configs_defaults = {
        "encoder_config": SubConfigSpec(config_class=AutoConfig, model_type="distilbert"),
        "vision_config": SubConfigSpec(config_class=AutoConfig, model_type="vit"),
    }

    vision_config: PreTrainedConfig | dict | None = None
    open_clip_config: Optional[dict] = None
    vision_pooling: str = "pooler"
    embed_dim: int = 192
    attention_heads: int = 12
    attention_dropout: float = 0.3
    spectral_norm: bool = True
    label_space_size: int = 0
    zero_shot: bool = False
    alpha_init: float = 0.5
    alpha_param: str = "softmax2"
    renormalize_classifier: bool = True
    search_mode: str = "fusion"
    fusion_beta: float = 0.7
    shortlist_size: int = 100
    shortlist_index: str = "bag"
    shortlist_fetch_factor: int = 3
    siamese_margin: float = 0.2
    siamese_num_positives: int = 2
    siamese_num_negatives: int = 3
    hard_positive_max_cos: float = 0.9
    siamese_negative_temperature: Optional[float] = None
    siamese_loss_reduction: str = "sum"
    ranker_margin: float = 0.5
    ranker_num_positives: int = 2
    ranker_num_negatives: int = 12
    ranker_loss_reduction: str = "sum"
    vision_trainable_layers: int = 1
    max_images: int = -1
    save_label_images: bool = True

    def validate_xmc(self) -> None:
        super().validate_xmc()
        if self.vision_pooling not in MUFIN_VISION_POOLINGS:
            raise ValueError(f"vision_pooling must be one of {MUFIN_VISION_POOLINGS}, got {self.vision_pooling!r}")
        if self.embed_dim < 1 or self.attention_heads < 1 or self.embed_dim % self.attention_heads:
            raise ValueError(f"embed_dim ({self.embed_dim}) must be a positive multiple of attention_heads ({self.attention_heads})")
        vision = ("open_clip_config", self.open_clip_config["model_cfg"]) if self.open_clip_config else ("vision_config", self.vision_config)
        for name, sub in (("encoder_config", self.encoder_config), vision):
            hidden = encoder_width(sub)
            if hidden is not None and hidden < self.embed_dim:
                raise ValueError(f"embed_dim ({self.embed_dim}) exceeds the hidden size of {name} ({hidden}): max-pooling cannot widen")
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got {self.attention_dropout}")
        if self.label_space_size < 0 or (self.label_space_size == 0 and not self.zero_shot):
            raise ValueError(
                f"label_space_size must be >= 1 for the per-label classifiers (got {self.label_space_size}); "
                "use zero_shot=True for a model without free vectors"
            )
        if not 0.0 < self.alpha_init < 1.0:
            raise ValueError(f"alpha_init must lie in (0, 1) (alpha = 1 is zero_shot=True), got {self.alpha_init}")
        if self.alpha_param not in MUFIN_ALPHA_PARAMS:
            raise ValueError(f"alpha_param must be one of {MUFIN_ALPHA_PARAMS}, got {self.alpha_param!r}")
        if self.search_mode not in MUFIN_SEARCH_MODES:
            raise ValueError(f"search_mode must be one of {MUFIN_SEARCH_MODES}, got {self.search_mode!r}")
        if not 0.0 <= self.fusion_beta <= 1.0:
            raise ValueError(f"fusion_beta must be in [0, 1], got {self.fusion_beta}")
        if self.shortlist_size < 1 or self.shortlist_fetch_factor < 1:
            raise ValueError("shortlist_size and shortlist_fetch_factor must be >= 1")
        if self.shortlist_index not in MUFIN_SHORTLIST_INDEXES:
            raise ValueError(f"shortlist_index must be one of {MUFIN_SHORTLIST_INDEXES}, got {self.shortlist_index!r}")
        for name in ("siamese_num_positives", "siamese_num_negatives", "ranker_num_positives", "ranker_num_negatives"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("siamese_loss_reduction", "ranker_loss_reduction"):
            if getattr(self, name) not in MUFIN_LOSS_REDUCTIONS:
                raise ValueError(f"{name} must be one of {MUFIN_LOSS_REDUCTIONS}, got {getattr(self, name)!r}")
        if self.siamese_negative_temperature is not None and self.siamese_negative_temperature <= 0:
            raise ValueError(f"siamese_negative_temperature must be positive or None, got {self.siamese_negative_temperature}")
        if self.open_clip_config is not None:
            if "vision_cfg" not in (self.open_clip_config.get("model_cfg") or {}):
                raise ValueError("open_clip_config must hold open_clip's model_cfg with its vision_cfg (open_clip_config.json)")
            if self.vision_pooling != "pooler":
                raise ValueError("an open_clip vision tower gives one pooled embedding per image: vision_pooling must be 'pooler'")
        if self.vision_trainable_layers < -1:
            raise ValueError(f"vision_trainable_layers must be >= -1 (-1 = all), got {self.vision_trainable_layers}")
        if self.max_images < -1:
            raise ValueError(f"max_images must be -1 (all) or >= 0, got {self.max_images}")
