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

Around the model, in sibling modules: the blocks ``A_S`` / ``A_C``, the classifiers and the bag helpers
(``mufin_blocks.py``), the label store (``mufin_label_store.py``: label bags ``Z^1``, vectors ``z^1``, centroids
``mu_l``, label images and the shortlist index, saved beside ``model.safetensors``), the vision tower
(``mufin_vision.py``: HF or open_clip, built, loaded and frozen) and the inputs (``processing_mufin.py``: image
decoding and packing, the ``AutoProcessor``). A saved model also holds ``preprocessor_config.json`` (the image
processor), the tokenizer files and ``labels.jsonl`` (label texts).

Implementation spec: ``shared/specs/mufin.md``. Where the paper and the official code differ the paper is the
default and the code's choice a config flag (see [`MUFINConfig`]).

This file is part of the remote-code bundle: it imports only torch, transformers, numpy and its siblings (which add
safetensors, PIL (optional) and open_clip (optional: only models with an open_clip image tower need it)).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np
import torch
from torch import nn
from transformers import AutoImageProcessor, AutoModel, AutoTokenizer
from transformers import initialization as init
from transformers.utils import ModelOutput, logging

from .classifier_head import ExtremeClassifier
from .configuration_mufin import MUFIN_SEARCH_MODES, MUFINConfig
from .encoder_utils import as_requested, repair_tokenizer
from .io_utils import progress_bar_disabled
from .label_store import LABEL_EMBEDDINGS_FILE, LABEL_EMBEDDINGS_INDEX_FILE
from .modeling_xmc import XMCPrediction, XMCPreTrainedModel
from .mufin_blocks import MUFINAttention, MUFINClassifier, masked_sum_normalize, pad_bags
from .mufin_label_store import (
    LABEL_BAGS_FILE,
    LABEL_CENTROIDS_FILE,
    LABEL_IMAGES_FILE,
    MUFINLabelStoreMixin,
    gather_bags,
)
from .mufin_vision import build_vision_tower, freeze_vision_tower, pretrained_vision_tower
from .processing_mufin import LazyLabelImages, MUFINProcessor, is_single_image, to_rgb
from .xmc_losses import mufin_ranker_loss, mufin_triplet_loss

logger = logging.get_logger(__name__)

IMAGE_PROCESSOR_FILE = "preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"  # MUFINProcessor (tokenizer + image processor) for AutoProcessor, with its auto_map
MUFIN_STAGES = ("siamese", "ranker")


# ---------------------------------------------------------------------------------------------------- training pairs
# Here, not in hf_xmc/training: forward computes the Module I loss from these pairs, and forward must run where
# hf_xmc is not installed (remote code).
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
        loss_terms: always None: each stage's loss is one term (the field the trainer reads of every model's output).
    """

    loss: Optional[torch.FloatTensor] = None
    logits: Optional[torch.FloatTensor] = None
    query_embeds: Optional[torch.FloatTensor] = None
    label_embeds: Optional[torch.FloatTensor] = None
    pair_mask: Optional[torch.BoolTensor] = None
    loss_terms: Optional[dict[str, torch.Tensor]] = None


# ---------------------------------------------------------------------------------------------------- model
class MUFINPreTrainedModel(XMCPreTrainedModel):
    """Weights initialisation and loading glue for MUFIN."""

    config: MUFINConfig
    base_model_prefix = "mufin"
    input_modalities = ("text", "image")
    # predict ranks the shortlist by "fusion" (beta c + (1 - beta) a), "retrieval" (a) or "classifier" (c): no re-indexing
    search_modes = MUFIN_SEARCH_MODES
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


class MUFINModel(MUFINLabelStoreMixin, MUFINPreTrainedModel):
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
        self.vision_encoder = build_vision_tower(config)
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
        # Module IV's cached label side (bag rows, offsets, z^1): stale on purpose between refreshes (cache_ranker_labels)
        self.ranker_label_cache: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
        self.training_stage = "siamese"
        self.post_init()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_encoders_pretrained(cls, text_name_or_path: str, vision_name_or_path: Optional[str] = None, **config_kwargs) -> "MUFINModel":
        """A fresh MUFIN whose text and vision encoders (with tokenizer and image processor) start from pretrained
        checkpoints; ``A_S`` / ``A_C`` start at the identity, ``eta`` xavier, ``alpha = alpha_init``. Call
        :meth:`freeze_vision_layers` to apply ``vision_trainable_layers`` before training.

        ``vision_name_or_path`` is an HF vision checkpoint (ViT, ResNet, ...) or ``"open_clip:<name>"``, an open_clip
        image tower (the ``vision`` extra; see :func:`~.mufin_vision.load_open_clip_tower` for the names). Without it the vision tower
        is built at random from ``vision_config`` (default: a small ResNet for 64 x 64 images,
        :data:`~.mufin_vision.SMALL_VISION_CONFIG`) with a resize-and-normalise ``ViTImageProcessor`` (``image_size`` of the config,
        else 64): for text-only data, or images to learn from scratch."""
        text = AutoModel.from_pretrained(text_name_or_path)
        tokenizer = repair_tokenizer(AutoTokenizer.from_pretrained(text_name_or_path), text.config, text_name_or_path)
        # vision_config sets up a random tower; beside a named tower it stays in config_kwargs (and clashes with its own)
        vision_config = config_kwargs.pop("vision_config", None) if vision_name_or_path is None else None
        vision, vision_kwargs, image_processor = pretrained_vision_tower(vision_name_or_path, vision_config)
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

    def freeze_vision_layers(self, num_trainable_layers: Optional[int] = None) -> list[str]:
        """Freeze the vision encoder except its last ``num_trainable_layers`` layers or stages (default
        ``config.vision_trainable_layers``: paper 1, code 4) and the modules after them (final norm, pooler);
        embeddings and earlier layers get no gradient. 0 freezes it all, -1 unfreezes it all. The text encoder is
        left as it is (trained end to end). Returns the names of the vision parameters left trainable."""
        n = self.config.vision_trainable_layers if num_trainable_layers is None else num_trainable_layers
        return freeze_vision_tower(self.vision_encoder, self.config, n)

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

    def _normalize_items(self, texts: Optional[Sequence[Optional[str]]], images: Optional[Sequence[Any]]) -> tuple[list[Optional[str]], Sequence[list[Any]]]:
        """Items as (text or None, list of images) pairs; a blank text counts as missing. Saved label images
        (``LazyLabelImages``) stay a lazy view (capped at ``config.max_images``): a slice of it reads those bags only."""
        if isinstance(texts, str):
            texts = [texts]
        if is_single_image(images):
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
        if isinstance(images, LazyLabelImages):
            lazy = images.capped(self.config.max_images)
            for i in np.flatnonzero(lazy.counts() == 0):
                if out_texts[i] is None:
                    raise ValueError(f"item {i} has neither text nor image: every item needs at least one descriptor")
            return out_texts, lazy
        bags = []
        for i, value in enumerate(images if images is not None else [None] * n):
            bag = [] if value is None else [value] if is_single_image(value) else list(value)
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

    def encode_queries(
        self, texts, batch_size: int = 64, show_progress_bar: Optional[bool] = None, convert_to_numpy: bool = False,
        convert_to_tensor: Optional[bool] = None,
    ) -> torch.Tensor | np.ndarray:
        """``x^1`` of text-only queries: a tensor, or a numpy array with ``convert_to_numpy=True`` (the rule of the
        text methods' ``encode_queries``)."""
        return as_requested(self.encode_items(texts, None, batch_size, show_progress_bar), convert_to_numpy, convert_to_tensor)

    def query_encoder_modules(self) -> list[dict]:
        """MUFIN's item vector runs self- and cross-attention over a bag of text and image embeddings: no
        sentence-transformers module list expresses it."""
        raise NotImplementedError("MUFIN's item encoder (attention over text and image bags) has no sentence-transformers form")

    def query_search_vectors(self, texts, batch_size: int = 64, show_progress_bar: Optional[bool] = None) -> torch.Tensor:
        """``x^1`` of text-only queries: what :meth:`search` shortlists with."""
        return self.encode_queries(texts, batch_size, show_progress_bar)

    # ------------------------------------------------------------------ search and prediction
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
        ``config.search_mode``'s scores: with another ``search_mode`` here, ``probabilities`` is None and a threshold is
        refused in one line).

        Probabilities come only from the map fitted on the ranking an item gets: with a lexical channel the calibration
        is fitted on the fused ranking, which image-only items never get (:meth:`rank`: they keep the dense one), so
        their rows of ``probabilities`` are NaN (with a one-line warning) and ``threshold=`` with such an item raises a
        one-line ValueError before anything is ranked (:meth:`unfused_items`).
        """
        other_mode = search_mode is not None and search_mode != self.config.search_mode
        if other_mode and threshold is not None and self.score_calibration is not None:
            raise ValueError(f"threshold: the score calibration was fitted on the {self.config.search_mode!r} ranking, not on "
                             f"{search_mode!r}: predict with search_mode={search_mode!r} without threshold=, or set_search_mode and fit it again")
        k = self._prediction_depth(k, threshold)
        uncalibrated = self.unfused_items(texts, images) if self.score_calibration is not None else np.zeros(0, dtype=bool)
        if threshold is not None and uncalibrated.any():
            raise ValueError(
                f"threshold: item {int(np.flatnonzero(uncalibrated)[0])} has no text, so it is ranked without the lexical channel and the score "
                "calibration (fitted on the fused ranking) does not apply to it: predict image-only items without threshold="
            )
        out_scores, out_ids = self.rank(texts, k, batch_size, show_progress_bar, images=images, search_mode=search_mode, pair_batch_size=pair_batch_size)
        prediction = self._prediction(out_ids, out_scores, threshold)
        if other_mode:  # another ranking than the one the calibration was fitted on: no probabilities from its map
            prediction.probabilities = None
        if prediction.probabilities is not None and uncalibrated.any():
            prediction.probabilities[uncalibrated] = np.nan
            logger.warning("%d image-only items are ranked without the lexical channel: their probabilities are NaN (the score "
                           "calibration was fitted on the fused ranking)", int(uncalibrated.sum()))
        return prediction

    def unfused_items(self, texts: Optional[Sequence[Optional[str]]], images: Optional[Sequence[Any]] = None) -> np.ndarray:
        """Which items :meth:`rank` ranks without the lexical channel: with a channel, those without a text (the
        channel scores texts); none without a channel. A score calibration fitted with a channel maps the fused
        ranking's scores, so :meth:`predict` gives these items no probabilities, and a calibration fit should leave them
        out. A boolean array, one entry per item (read from the texts only: no image is opened)."""
        if isinstance(texts, str):
            texts = [texts]
        if is_single_image(images):
            images = [images]
        n = len(texts) if texts is not None else len(images) if images is not None else 0
        if self.lexical_channel is None:
            return np.zeros(n, dtype=bool)
        if texts is None:
            return np.ones(n, dtype=bool)
        return np.array([not (isinstance(t, str) and t.strip()) for t in texts], dtype=bool)

    @torch.no_grad()
    def rank(
        self,
        texts: Optional[Sequence[Optional[str]]],
        k: int,
        batch_size: int = 64,
        show_progress_bar: Optional[bool] = None,
        return_dense: bool = False,
        *,
        images: Optional[Sequence[Any]] = None,
        search_mode: Optional[str] = None,
        pair_batch_size: int = 4096,
    ):
        """The ranking :meth:`predict` and the evaluator share (``XMCPreTrainedModel.rank``): top-``k`` ``(scores, ids)``
        of items given as texts and/or images, ranked by ``search_mode`` over the shortlist (:meth:`predict`). With a
        lexical channel (``fit_lexical_channel``), the items with a text have their ``dense_depth`` dense hits fused
        with the channel's scores of that text; image-only items keep the dense ranking. ``return_dense``: also the
        dense top-``k`` (the same arrays twice without a channel)."""
        mode = search_mode or self.config.search_mode
        if mode not in MUFIN_SEARCH_MODES:
            raise ValueError(f"search mode must be one of {MUFIN_SEARCH_MODES}, got {mode!r}")
        norm_texts, bags = self._normalize_items(texts, images)
        self._require_shortlist_index()
        channel = self.current_lexical_channel()  # its label rows checked against the labels first (rebuilt if stale)
        final_k, k = k, max(k, int(channel.settings["dense_depth"])) if channel is not None else k
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
        dense_scores, dense_ids = out_scores[:, :final_k], out_ids[:, :final_k]
        if channel is None:
            return (dense_scores, dense_ids, dense_scores, dense_ids) if return_dense else (dense_scores, dense_ids)
        scores, ids = dense_scores.copy(), dense_ids.copy()
        with_text = [i for i, text in enumerate(norm_texts) if text is not None and text.strip()]
        if with_text:
            scores[with_text], ids[with_text] = channel.fuse([norm_texts[i] for i in with_text], out_scores[with_text], out_ids[with_text], final_k)
        return (scores, ids, dense_scores, dense_ids) if return_dense else (scores, ids)

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

    def cached_label_side(self, label_ids: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(Z^1 bags, mask, z^1)`` of ``label_ids`` from :attr:`ranker_label_cache` (encoded without gradient by
        :meth:`cache_ranker_labels`), on ``like``'s device and dtype: Module IV's cached label side, where a step sends
        the pool's ids only and no label passes through the encoders."""
        if self.ranker_label_cache is None:
            raise ValueError("a ranker batch without label bags reads them from the ranker label cache: call model.cache_ranker_labels() first")
        rows, offsets, vectors = self.ranker_label_cache
        bags, mask = gather_bags(rows, offsets, label_ids)
        vectors = vectors[label_ids.cpu().long()]
        return bags.to(like.device, like.dtype), mask.to(like.device), vectors.to(like.device, like.dtype)

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
            label_*: the label pool's bags, same layout: P labels. Ranker stage: without them the pool's bags and
                vectors come from the ranker label cache (:meth:`cached_label_side`; no gradient through the label side).
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
            if stage != "ranker" or label_ids is None:
                return MUFINModelOutput(query_embeds=query_vectors)
            label_bags, label_mask, label_vectors = self.cached_label_side(label_ids, query_vectors)
        else:
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
                MUFINProcessor(image_processor=self.image_processor, tokenizer=self.tokenizer).save_pretrained(save_directory)
        self._save_label_store(save_directory)

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
        self._load_label_store(fetch)


__all__ = ["MUFINModel", "MUFINModelOutput", "MUFINPreTrainedModel", "select_siamese_pairs"]
