"""PRIME: label prototypes and a dynamic-margin triplet loss for extreme multi-label classification.

Dahiya, Ortego, Jimenez, "Prototypical Extreme Multi-label Classification with a Dynamic Margin Loss", NAACL 2025.
One shared encoder embeds queries and label texts. A query is not scored against the label-text embedding ``h_l``
but against a label *prototype* ``z_l``: the Label Prototype Network (LPN, one transformer encoder layer, no
positional encoding) attends over the set ``[h_l, v_l, c_l]`` and mean-pools it, where ``v_l`` is a learnable free
vector shared by a cluster of similar labels and ``c_l`` is an exponential moving average of the embeddings of the
training queries that carry label ``l``. Training sums the clipped, detached dynamic-margin triplet loss on
query->prototype, query->label-text and label-text->query cosines plus a regulariser that makes prototypes beat
label texts. At inference the prototypes of all labels are computed once, L2-normalised and indexed.

Implementation spec: ``shared/specs/prime.md`` (where paper and official code disagree, the defaults follow the
spec and the alternatives are config flags).
"""


from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from .classifier_head import ExtremeClassifier
from .configuration_prime import PRIME_SEARCH_MODES, PRIMEConfig, default_num_free_vectors
from .encoder_utils import (
    all_gather_id_lists,
    all_gather_rows,
    distributed_world_size,
    gather_label_pool,
    targets_from_positive_ids,
)
from .modeling_xmc import XMCModelOutput, XMCPreTrainedModel
from .xmc_losses import PRIMELoss, dynamic_margin_triplet_loss


class LabelPrototypeNetwork(nn.Module):
    """One post-LN transformer encoder layer over a small *set* of per-label vectors, mean-pooled.

    There is no positional encoding, so the output does not depend on the order of the inputs.
    """

    def __init__(self, hidden_size: int, num_heads: int = 1, intermediate_size: int = 1024, dropout: float = 0.1):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            d_model=hidden_size,
            nhead=num_heads,
            dim_feedforward=intermediate_size,
            dropout=dropout,
            activation="gelu",
            batch_first=True,
            norm_first=False,
        )

    def forward(self, *tokens: torch.Tensor) -> torch.Tensor:
        """``tokens``: tensors of shape ``(num_labels, hidden)``; returns the ``(num_labels, hidden)`` prototypes."""
        return self.layer(torch.stack(tokens, dim=1)).mean(dim=1)


class PRIMEPreTrainedModel(XMCPreTrainedModel):
    """Weights initialisation and loading glue for PRIME."""

    config: PRIMEConfig
    base_model_prefix = "prime"

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, ExtremeClassifier):  # the free-vector bank: an nn.Embedding, but xavier-initialised
            init.xavier_uniform_(module.weight)
            return
        super()._init_weights(module)
        if isinstance(module, PRIMEModel):
            init.zeros_(module.label_centroids)
            init.zeros_(module.free_vector_map)
            init.zeros_(module.label_state_initialized)


class PRIMEModel(PRIMEPreTrainedModel):
    """The PRIME prototype network.

    Besides the encoder and the LPN the model holds, per label, the id of its free vector (``free_vector_map``,
    from a balanced clustering of the initial label embeddings) and its query centroid (``label_centroids``, an
    EMA buffer that moves during training). Both are set from the training data by
    :func:`hf_xmc.training.initialize_label_state`, which :class:`~hf_xmc.training.XMCTrainer` runs when a fresh
    model starts training, and both are saved with the model.

    Example:
        >>> model = PRIMEModel.from_encoder_pretrained("sentence-transformers/all-MiniLM-L6-v2", label_space_size=2)
        >>> model.set_labels(["Games: Strategy", "Development: Library"])
        >>> model.predict(["0ad : Real-time strategy game"], k=1).label_texts
    """

    # parameters trained without weight decay (paper Appx. G: the free-vector bank)
    no_weight_decay_parameters = ("free_vectors.weight",)
    # the LPN and free vectors get their gradients in the loss, outside the DDP-wrapped encoder replays
    supports_distributed_gradient_cache = False
    # every process applies the same centroid update (from the queries of all processes), so DDP need not broadcast
    # the centroid bank (4 d bytes per label) from rank 0 at every forward; XMCTrainer reads this
    ddp_broadcast_buffers = False
    search_modes = PRIME_SEARCH_MODES  # the prototype index, or PRIME (W)'s classifier vectors
    search_mode_changes_label_vectors = True

    def __init__(self, config: PRIMEConfig):
        if config.num_free_vectors is None:
            config.num_free_vectors = default_num_free_vectors(config.label_space_size)
        super().__init__(config)
        hidden = config.encoder_config.hidden_size
        self.lpn = LabelPrototypeNetwork(hidden, config.lpn_num_heads, config.lpn_intermediate_size, config.lpn_dropout)
        # the free-vector bank (F x hidden): a pool reads only its clusters' rows, with sparse gradients by default
        if config.num_free_vectors:
            self.free_vectors = ExtremeClassifier(config.num_free_vectors, hidden, sparse_gradients=config.sparse_label_gradients)
        else:
            self.free_vectors = None
        # PRIME (W): one-vs-all classifiers, trained after PRIME with everything else frozen (add_classifier)
        self.classifier = ExtremeClassifier(config.label_space_size, hidden, sparse_gradients=config.sparse_label_gradients) if config.use_classifier else None
        self.classifier_dropout = nn.Dropout(config.classifier_dropout)
        self.register_buffer("free_vector_map", torch.zeros(config.label_space_size, dtype=torch.long))
        self.register_buffer("label_centroids", torch.zeros(config.label_space_size, hidden))
        self.register_buffer("label_state_initialized", torch.zeros((), dtype=torch.bool))
        self.loss_fn = PRIMELoss(
            num_negatives=config.loss_num_negatives,
            margin_min=config.margin_min,
            margin_max=config.margin_max,
            temperature=config.negative_temperature,
            positive_selection=config.positive_selection,
            paper_inverted_region=config.paper_inverted_region,
            query_to_label_weight=config.query_to_label_weight,
            label_to_query_weight=config.label_to_query_weight,
            regularizer_weight=config.regularizer_weight,
            regularizer_margin=config.regularizer_margin,
        )
        self.post_init()

    # checkpoints written before the free-vector bank became an ExtremeClassifier hold it under ``free_vectors``
    _legacy_key_mapping = {r"^free_vectors$": "free_vectors.weight"}

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """``XMCPreTrainedModel.from_pretrained``; a checkpoint with the bank under its former key ``free_vectors``
        (now ``free_vectors.weight``) loads too, and saves again under the current key."""
        kwargs["key_mapping"] = {**cls._legacy_key_mapping, **(kwargs.get("key_mapping") or {})}
        model = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        # transformers reverses on save the renamings a load used: not this one (its reverse is no valid key)
        used = getattr(model, "_weight_conversions", None)
        if used:
            model._weight_conversions = [c for c in used if list(getattr(c, "source_patterns", ())) != list(cls._legacy_key_mapping)]
        return model

    # ------------------------------------------------------------------ label state
    @property
    def needs_label_state(self) -> bool:
        """True until free-vector map and centroids were set from training data (see :meth:`set_label_state`)."""
        return not bool(self.label_state_initialized)

    @torch.no_grad()
    def set_label_state(self, free_vector_map: Optional[torch.Tensor], centroids: torch.Tensor) -> None:
        """Install the label -> free-vector map (``(L,)`` ids) and the initial centroids (``(L, hidden)``)."""
        num_labels, hidden = self.label_centroids.shape
        if tuple(centroids.shape) != (num_labels, hidden):
            raise ValueError(f"centroids must have shape ({num_labels}, {hidden}), got {tuple(centroids.shape)}")
        if free_vector_map is not None:
            free_vector_map = torch.as_tensor(free_vector_map, dtype=torch.long)
            if tuple(free_vector_map.shape) != (num_labels,):
                raise ValueError(f"free_vector_map must have shape ({num_labels},), got {tuple(free_vector_map.shape)}")
            bank = self.config.num_free_vectors
            if num_labels and (int(free_vector_map.min()) < 0 or int(free_vector_map.max()) >= max(bank, 1)):
                raise ValueError(f"free_vector_map ids must lie in [0, {bank})")
            self.free_vector_map.copy_(free_vector_map)
        self.label_centroids.copy_(centroids.to(self.label_centroids))
        self.label_state_initialized.fill_(True)
        self.invalidate_label_index()

    @torch.no_grad()
    def update_centroids(
        self,
        query_embeds: torch.Tensor,
        label_ids: torch.Tensor,
        targets: torch.Tensor,
        query_positive_ids: Optional[torch.Tensor] = None,
    ) -> None:
        """EMA step (paper eq. 4): ``c_l <- m c_l + (1 - m) mean_i normalise(h_q^i)`` over the batch queries ``i`` that
        have pool label ``l`` as a positive (any of their positives, not only the sampled one).

        Under several processes the queries of every process are gathered (with ``query_positive_ids``), so all
        processes apply the same update to their copies of the buffer.
        """
        queries = F.normalize(query_embeds.detach().float(), dim=-1)
        if distributed_world_size() > 1 and query_positive_ids is not None:
            queries = all_gather_rows(queries, with_grad=False)
            positives = all_gather_id_lists(query_positive_ids)
            targets = targets_from_positive_ids(positives, label_ids)
        targets = targets.bool()
        counts = targets.sum(dim=0)
        owned = counts > 0
        if not bool(owned.any()):
            return
        means = (targets.T.float() @ queries)[owned] / counts[owned].unsqueeze(1)
        ids = label_ids[owned]
        momentum = self.config.centroid_momentum
        self.label_centroids[ids] = momentum * self.label_centroids[ids] + (1.0 - momentum) * means.to(self.label_centroids)

    # ------------------------------------------------------------------ prototypes
    def set_labels(self, texts, uids=None) -> None:
        if len(texts) != self.config.label_space_size:
            raise ValueError(
                f"this PRIME model was built for {self.config.label_space_size} labels (label_space_size) but got "
                f"{len(texts)} label texts; its centroids and free-vector map have one row per label"
            )
        super().set_labels(texts, uids)

    def prototypes(self, label_embeds: torch.Tensor, label_ids: torch.Tensor) -> torch.Tensor:
        """LPN output ``z_l`` for raw label-text embeddings ``(n, hidden)`` of labels ``label_ids`` (not normalised)."""
        tokens = [F.normalize(label_embeds, dim=-1) if self.config.normalize_lpn_inputs else label_embeds]
        if self.free_vectors is not None:
            tokens.append(self.free_vectors(self.free_vector_map[label_ids]).to(label_embeds.dtype))
        tokens.append(self.label_centroids[label_ids].to(label_embeds.dtype))
        return self.lpn(*tokens)

    @torch.no_grad()
    def compute_prototypes(self, label_embeds: torch.Tensor, batch_size: int = 4096) -> torch.Tensor:
        """L2-normalised prototypes of all labels (eval mode) from their raw label-text embeddings; ``(L, hidden)`` on CPU."""
        was_training = self.training
        self.eval()
        out = torch.empty(label_embeds.shape, dtype=torch.float32)  # filled in place: no second (L, hidden) copy
        try:
            for start in range(0, label_embeds.shape[0], batch_size):
                ids = torch.arange(start, min(start + batch_size, label_embeds.shape[0]), device=self.device)
                chunk = label_embeds[start : start + batch_size].to(self.device)
                out[start : start + len(ids)] = F.normalize(self.prototypes(chunk, ids).float(), dim=-1).cpu()
        finally:
            self.train(was_training)
        return out

    def label_search_vectors(self, batch_size: int = 128, show_progress_bar: Optional[bool] = None) -> torch.Tensor:
        """Indexed vectors: the normalised prototypes of all labels, or with ``search_mode="classifier"`` the normalised
        PRIME (W) classifier vectors."""
        if self.config.search_mode == "classifier":
            return self.classifier.normalized_weights()
        raw = self.encode_labels(batch_size=batch_size, show_progress_bar=show_progress_bar, normalize=False)
        return self.compute_prototypes(raw)

    @torch.no_grad()
    def _grow_label_state(self, texts, batch_size, show_progress_bar):
        """New labels: a zero centroid (as a label without training queries gets, prime.md 3.4), the free vector of
        the nearest trained label (searched with the new label's normalised text embedding), and with PRIME (W) a
        classifier vector initialised from the prototype (as :meth:`add_classifier` does); returns the normalised
        prototypes (= those classifier vectors)."""
        raw = self.encode_labels(texts, batch_size=batch_size, show_progress_bar=show_progress_bar, normalize=False)
        old, n = self.label_centroids.shape[0], raw.shape[0]
        _, nearest = self.search(F.normalize(raw.float(), dim=-1), 1)
        self.free_vector_map = self._concat_rows(self.free_vector_map, self.free_vector_map[torch.from_numpy(nearest[:, 0]).to(self.free_vector_map.device)])
        self.label_centroids = self._concat_rows(self.label_centroids, torch.zeros(n, self.label_centroids.shape[1]))
        self.config.label_space_size = old + n
        was_training = self.training
        self.eval()
        try:
            ids = torch.arange(old, old + n, device=self.device)
            vectors = F.normalize(self.prototypes(raw.to(self.device), ids).float(), dim=-1)
        finally:
            self.train(was_training)
        if self.classifier is not None:
            self.classifier.replace_rows(self._concat_rows(self.classifier.weight, vectors))
        return vectors.cpu()

    @torch.no_grad()
    def _select_label_state(self, keep: torch.Tensor) -> bool:
        self.free_vector_map = self.free_vector_map[keep.to(self.free_vector_map.device)]
        self.label_centroids = self.label_centroids[keep.to(self.label_centroids.device)]
        if self.classifier is not None:
            self.classifier.replace_rows(self.classifier.weight[keep.to(self.classifier.weight.device)])
        self.config.label_space_size = int(keep.numel())
        return True

    # ------------------------------------------------------------------ PRIME (W)
    def _check_search_mode(self, mode: str) -> None:
        """``"classifier"`` (PRIME (W)) needs the classifier stage; ``"prototype"`` searches the prototype index."""
        if mode == "classifier" and self.classifier is None:
            raise ValueError("this PRIME model has no classifier stage: call add_classifier() (or train with --classifier_stage)")

    @torch.no_grad()
    def add_classifier(self, batch_size: int = 128, show_progress_bar: Optional[bool] = None) -> None:
        """Start PRIME (W) (spec Sec. 6.6): a classifier vector per label initialised from the normalised prototypes of
        the current model; the search switches to the classifiers. Memory: ``4 x hidden`` bytes per label (plus
        AdamW's moments, row-wise, while training)."""
        prototypes = self.label_search_vectors(batch_size, show_progress_bar) if self.config.search_mode == "prototype" else None
        if self.classifier is None:
            self.config.use_classifier = True
            hidden = self.config.encoder_config.hidden_size
            self.classifier = ExtremeClassifier(self.config.label_space_size, hidden, sparse_gradients=self.config.sparse_label_gradients).to(self.device)
        if prototypes is None:  # already searching classifiers: re-initialise from the prototypes
            self.config.search_mode = "prototype"
            prototypes = self.label_search_vectors(batch_size, show_progress_bar)
        self.classifier.weight.copy_(prototypes.to(self.classifier.weight))
        self.config.search_mode = "classifier"
        self.invalidate_label_index()

    # ------------------------------------------------------------------ training
    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        query_vectors: Optional[torch.Tensor] = None,
        candidate_ids: Optional[torch.Tensor] = None,
        candidate_targets: Optional[torch.Tensor] = None,
        **pool,
    ) -> XMCModelOutput:
        r"""The shared dual-encoder forward (``XMCPreTrainedModel.forward``, whose arguments ``pool`` passes on) around
        PRIME's ``pool_loss``, or PRIME (W)'s classifier stage.

        Args:
            input_ids / attention_mask: tokenised queries, ``(batch, seq)``.
            label_input_ids / label_attention_mask: tokenised label pool, ``(pool, seq)``.
            targets: boolean ``(batch, pool)``; True where a pool label is any positive of the query (false negatives
                are never used as negatives).
            positive_index: unused (PRIME samples its positive per anchor from ``targets``); accepted for the shared
                collator.
            label_ids: ``(pool,)`` label ids of the pool: they select free vectors and centroids (required with a pool).
            query_positive_ids: each query's positives (``-1``-padded), used to rebuild targets across processes.

        Returns:
            [`XMCModelOutput`] with ``loss`` (given ``targets``), ``logits`` (query/prototype cosines, batch x pool),
            and the raw (un-normalised) ``query_embeds`` / ``label_embeds``. In training mode with ``targets``, the
            centroids of the pool labels take one EMA step after the loss is computed.

        PRIME (W) (``candidate_ids`` given, the shared classifier stage): ``query_vectors`` ``(B, hidden)`` cached query
        embeddings (or ``input_ids``), ``candidate_ids`` ``(B, S)`` each query's positives and shortlist negatives
        (``-1``-padded), ``candidate_targets`` its positives; the loss is the triplet of :func:`dynamic_margin_triplet_loss`
        with the fixed margin ``classifier_margin`` over ``cos(dropout(h_q), w_l)``.
        """
        if candidate_ids is not None:
            return self._classifier_forward(input_ids, attention_mask, query_vectors, candidate_ids, candidate_targets)
        return super().forward(input_ids, attention_mask, **pool)

    def loss_embedding(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Raw (un-normalised) embeddings: the prototype network takes the label's, the loss normalises."""
        return self.embed(input_ids, attention_mask, normalize=False)

    def pool_loss(self, query_embeds: torch.Tensor, label_embeds: torch.Tensor, targets: Optional[torch.Tensor] = None,
                  positive_index: Optional[torch.Tensor] = None, label_ids: Optional[torch.Tensor] = None,
                  query_positive_ids: Optional[torch.Tensor] = None) -> tuple[Optional[torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
        """PRIME loss, query/prototype cosines and the loss's detached terms from raw query and label-pool embeddings
        (the part of ``forward`` after the encoder, so a gradient cache can embed in chunks)."""
        if label_ids is None:
            raise ValueError("PRIME needs the pool's label_ids to look up free vectors and centroids")
        if self.training and query_positive_ids is not None and distributed_world_size() > 1:
            label_embeds, targets, positive_index, label_ids = gather_label_pool(label_embeds, label_ids, query_positive_ids, positive_index)
        queries = F.normalize(query_embeds, dim=-1)
        text_scores = queries @ F.normalize(label_embeds, dim=-1).T
        prototype_scores = queries @ F.normalize(self.prototypes(label_embeds, label_ids), dim=-1).T
        loss, logged = None, {}
        if targets is not None:
            terms = self.loss_fn(prototype_scores, text_scores, targets.bool())
            loss = terms["loss"]
            logged = {name: value.detach() for name, value in terms.items() if name != "loss"}  # no device sync per step
            if self.training and self.config.centroid_update == "ema":
                # after the loss: this step's prototypes used the old centroids (official code order)
                self.update_centroids(query_embeds, label_ids, targets, query_positive_ids)
        return loss, prototype_scores, logged

    def _classifier_forward(self, input_ids, attention_mask, query_vectors, candidate_ids, candidate_targets) -> XMCModelOutput:
        if self.classifier is None:
            raise ValueError("this PRIME model has no classifier stage: call add_classifier() first")
        if query_vectors is None:
            query_vectors = self.embed(input_ids, attention_mask, normalize=False)
        queries = F.normalize(self.classifier_dropout(query_vectors.to(self.classifier.weight.device).float()), dim=-1)
        valid = candidate_ids >= 0
        weights = F.normalize(self.classifier.pool_weights(candidate_ids.clamp(min=0).reshape(-1)), dim=-1).reshape(*candidate_ids.shape, -1)
        scores = (weights @ queries.unsqueeze(-1)).squeeze(-1)
        # a padded slot scores -2: below every cosine by more than the margin, so it never violates
        scores = scores.masked_fill(~valid, -2.0)
        loss = None
        if candidate_targets is not None:
            cfg = self.config
            loss = dynamic_margin_triplet_loss(
                scores, candidate_targets.bool() & valid, num_negatives=cfg.loss_num_negatives, margin_min=0.0,
                margin_max=cfg.classifier_margin, temperature=cfg.negative_temperature,
            )
        return XMCModelOutput(loss=loss, logits=scores.detach(), query_embeds=query_vectors)


__all__ = ["LabelPrototypeNetwork", "PRIMEModel", "PRIMEPreTrainedModel"]
