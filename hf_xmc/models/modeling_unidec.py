"""UniDEC: one encoder trained end to end as a dual encoder and as an extreme classifier.

Kharbanda, Gupta, K, Malhotra, Singh, Hsieh, Babbar, "UniDEC: Unified Dual Encoder and Classifier Training for
Extreme Multi-Label Classification", WWW 2025. A shared encoder ``Phi`` embeds queries and label texts. Two heads sit
on it: the dual-encoder (DE) head ``Phi_D = N(g1(Phi(.)))`` (``g1`` = Linear, Tanh, Dropout) for queries and label
texts, and the classifier (CLF) head ``Phi_C = g2(Phi(.))`` (``g2`` = Linear, Dropout, not normalised in training)
for queries, scored against ``Psi``, one learnable vector per label. Every step both heads take the same multi-class
loss (Decoupled Softmax; symmetric query->label and label->query terms; plus BCE for the classifier) over a
*pick-some-labels* pool: a few sampled positives per query, mined hard negatives and the batch's other positives,
capped (see :class:`hf_xmc.training.PSLDataCollator`). Only the classifier rows of the pool are scored, so a step
never builds label-space-sized logits. Inference searches one index over ``[Phi_D(z_l) ; N(Psi_l)]`` with
``[Phi_D(x) ; N(Phi_C(x))]``: score = DE cosine + classifier cosine.

Implementation spec: ``shared/specs/unidec.md`` (values the paper leaves open follow the official code: learnable
logit scale initialised at 18, xavier-initialised classifiers, mean pooling).
"""


from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from .classifier_head import ExtremeClassifier
from .configuration_unidec import UNIDEC_SEARCH_MODES, UniDECConfig
from .encoder_utils import distributed_world_size, gather_label_pool
from .modeling_xmc import XMCPreTrainedModel
from .xmc_losses import UniDECLoss


class UniDECPreTrainedModel(XMCPreTrainedModel):
    """Weights initialisation and loading glue for UniDEC."""

    config: UniDECConfig
    base_model_prefix = "unidec"

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, ExtremeClassifier):  # an nn.Embedding, but not normal-initialised
            init.xavier_uniform_(module.weight)  # official code: xavier-initialised label classifiers
            return
        super()._init_weights(module)
        if isinstance(module, UniDECModel):
            for head in (module.de_head, module.clf_head):
                if head is not None:  # (semi-)orthogonal: the heads start by keeping the pretrained geometry
                    init.orthogonal_(head[0].weight)
                    init.zeros_(head[0].bias)
            init.zeros_(module.label_state_initialized)
            init.constant_(module.de_logit_scale, module.config.logit_scale_init)
            if module.clf_logit_scale is not None:
                init.constant_(module.clf_logit_scale, module.config.logit_scale_init)


class UniDECModel(UniDECPreTrainedModel):
    """The UniDEC model (or DePSL, its DE-only variant, with ``use_classifier=False``).

    ``embed`` / ``encode_queries`` / ``encode_labels`` give DE-head embeddings (unit norm); ``predict`` searches the
    space chosen by ``config.search_mode`` (``"concat"``, ``"de"`` or ``"classifier"``, see :meth:`set_search_mode`).

    Example:
        >>> model = UniDECModel.from_encoder_pretrained("sentence-transformers/all-MiniLM-L6-v2", label_space_size=2)
        >>> model.set_labels(["Games: Strategy", "Development: Library"])
        >>> model.predict(["0ad : Real-time strategy game"], k=1).label_texts
    """

    # the logit scales are temperatures, not weights: no decay
    no_weight_decay_parameters = ("de_logit_scale", "clf_logit_scale")
    # the heads and Psi get their gradients in the loss, outside the DDP-wrapped encoder replays of a gradient cache
    supports_distributed_gradient_cache = False
    # training-time hard negatives come from the DE head only (paper Sec. 3.2)
    hard_negative_search_mode = "de"
    search_modes = UNIDEC_SEARCH_MODES  # both heads side by side, the DE head, or the classifier vectors
    search_mode_changes_label_vectors = True

    def __init__(self, config: UniDECConfig):
        super().__init__(config)
        hidden, dim = config.encoder_config.hidden_size, config.projection_dim
        self.de_head = nn.Sequential(nn.Linear(hidden, dim), nn.Tanh(), nn.Dropout(config.head_dropout))
        self.de_logit_scale = nn.Parameter(torch.empty(()), requires_grad=config.learnable_logit_scale)
        if config.use_classifier:
            self.clf_head = nn.Sequential(nn.Linear(hidden, dim), nn.Dropout(config.head_dropout))
            self.classifier = ExtremeClassifier(config.label_space_size, dim, sparse_gradients=config.sparse_label_gradients)
            self.clf_logit_scale = nn.Parameter(torch.empty(()), requires_grad=config.learnable_logit_scale)
        else:
            self.clf_head = None
            self.classifier = None
            self.register_parameter("clf_logit_scale", None)
        # set once the classifier vectors were initialised from the label texts (classifier_init="label_text")
        self.register_buffer("label_state_initialized", torch.zeros((), dtype=torch.bool))
        self.loss_fn = UniDECLoss(
            de_loss=config.de_loss,
            clf_loss=config.clf_loss,
            de_query_to_label_weight=config.de_query_to_label_weight,
            clf_query_to_label_weight=config.clf_query_to_label_weight,
            de_weight=config.de_weight if config.use_classifier else 1.0,
            clf_bce_weight=config.clf_bce_weight,
        )
        self.post_init()

    # ------------------------------------------------------------------ heads
    @property
    def search_mode(self) -> str:
        """The space ``predict`` searches (always ``"de"`` without classifier)."""
        return self.config.search_mode if self.config.use_classifier else "de"

    def _check_search_mode(self, mode: str) -> None:
        """``"concat"`` and ``"classifier"`` need the classifier; ``"de"`` searches the DE head alone."""
        if mode != "de" and not self.config.use_classifier:
            raise ValueError(f"this model has no classifier (use_classifier=False): it can only search 'de', not {mode!r}")

    def project(self, pooled: torch.Tensor, head: str = "de") -> torch.Tensor:
        """Search-space vectors of pooled encoder outputs: ``"de"`` = ``N(g1(.))``, ``"classifier"`` = ``N(g2(.))``,
        ``"concat"`` = both side by side, ``"raw"`` = the pooled vectors themselves."""
        if head == "raw":
            return pooled
        if head == "de":
            return F.normalize(self.de_head(pooled), dim=-1)
        if head == "classifier":
            return F.normalize(self._require_classifier_head()(pooled), dim=-1)
        if head == "concat":
            return torch.cat([self.project(pooled, "de"), self.project(pooled, "classifier")], dim=-1)
        raise ValueError(f"head must be 'de', 'classifier', 'concat' or 'raw', got {head!r}")

    def _require_classifier_head(self) -> nn.Module:
        if self.clf_head is None:
            raise ValueError("this model has no classifier head (use_classifier=False)")
        return self.clf_head

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, normalize: Optional[bool] = None, head: str = "de", **encoder_kwargs) -> torch.Tensor:
        """Encode token ids and apply ``head`` (see :meth:`project`); by default the unit-norm DE embedding.

        ``normalize`` is accepted for the shared encoding helpers and ignored: every head fixes its own normalisation.
        """
        return self.project(self.pooled_embedding(input_ids, attention_mask, **encoder_kwargs), head)

    @torch.no_grad()
    def clustering_vectors(self, query_embeds: torch.Tensor) -> torch.Tensor:
        """DE embeddings (dropout off) of pooled query outputs: UniDEC clusters queries in the DE space."""
        linear, tanh = self.de_head[0], self.de_head[1]
        return F.normalize(tanh(linear(query_embeds.to(linear.weight.dtype))), dim=-1)

    # ------------------------------------------------------------------ labels and search
    def set_labels(self, texts, uids=None) -> None:
        if self.config.use_classifier and len(texts) != self.config.label_space_size:
            raise ValueError(
                f"this UniDEC model was built for {self.config.label_space_size} labels (label_space_size) but got "
                f"{len(texts)} label texts; its classifier has one vector per label"
            )
        super().set_labels(texts, uids)

    @property
    def needs_label_state(self) -> bool:
        """True while a ``classifier_init="label_text"`` classifier still holds its random vectors; the trainer then
        calls :meth:`initialize_label_state` before the first step."""
        return self.classifier is not None and self.config.classifier_init == "label_text" and not bool(self.label_state_initialized)

    @torch.no_grad()
    def initialize_label_state(self, train_texts=None, train_targets=None, seed: int = 0, batch_size: int = 128, show_progress_bar: Optional[bool] = None) -> bool:
        """Set every classifier vector to its label text's normalised classifier-head embedding ``N(g2(Phi(z_l)))``
        (eval mode), so the classifier head starts out scoring like a dual encoder. The training data is not used.
        Returns True: the state is set (``XMCTrainingHooks.initialize_label_state``)."""
        if self.classifier is None:
            raise ValueError("this model has no classifier (use_classifier=False)")
        raw = self.encode_labels(batch_size=batch_size, show_progress_bar=show_progress_bar, head="raw")
        linear = self.clf_head[0]
        for start in range(0, raw.shape[0], 65536):
            chunk = raw[start : start + 65536].to(linear.weight.device, linear.weight.dtype)
            self.classifier.weight[start : start + 65536] = F.normalize(linear(chunk), dim=-1).to(self.classifier.weight.dtype)
        self.label_state_initialized.fill_(True)
        self.invalidate_label_index()
        return True

    def label_search_vectors(self, batch_size: int = 128, show_progress_bar: Optional[bool] = None) -> torch.Tensor:
        """Indexed vectors per label: ``Phi_D(z_l)``, ``N(Psi_l)`` or both concatenated (``search_mode``)."""
        mode = self.search_mode
        parts = []
        if mode in ("de", "concat"):
            parts.append(self.encode_labels(batch_size=batch_size, show_progress_bar=show_progress_bar))
        if mode in ("classifier", "concat"):
            self._require_labels()
            parts.append(self.classifier.normalized_weights())
        return torch.cat(parts, dim=1)

    @torch.no_grad()
    def _grow_label_state(self, texts, batch_size, show_progress_bar):
        """New labels: their DE embeddings, and classifier vectors at the ``label_text`` initialisation
        ``N(g2(Phi(z_l)))`` appended to ``Psi``; returns their vectors in the ``search_mode`` space."""
        raw = self.encode_labels(texts, batch_size=batch_size, show_progress_bar=show_progress_bar, head="raw")
        was_training = self.training
        self.eval()
        try:
            raw = raw.to(self.de_head[0].weight.device, self.de_head[0].weight.dtype)
            parts = []
            if self.search_mode in ("de", "concat"):
                parts.append(self.project(raw, "de"))
            if self.classifier is not None:
                rows = F.normalize(self.clf_head[0](raw), dim=-1)
                self.classifier.replace_rows(self._concat_rows(self.classifier.weight, rows))
                if self.search_mode in ("classifier", "concat"):
                    parts.append(rows)
        finally:
            self.train(was_training)
        self.config.label_space_size = len(self.label_texts) + len(texts)
        return torch.cat([part.float().cpu() for part in parts], dim=1)

    @torch.no_grad()
    def _select_label_state(self, keep: torch.Tensor) -> bool:
        if self.classifier is not None:
            self.classifier.replace_rows(self.classifier.weight[keep.to(self.classifier.weight.device)])
        self.config.label_space_size = int(keep.numel())
        return True

    def query_encoder_modules(self) -> list[dict]:
        """The DE head ``N(tanh(W u + b))`` as a Dense (Tanh) and a Normalize module: :meth:`save_query_encoder` writes
        the dual encoder's query side, ``embed(..., head="de")``."""
        return [{"type": "Dense", "linear": self.de_head[0], "activation": "torch.nn.modules.activation.Tanh"}, {"type": "Normalize"}]

    def query_embed_kwargs(self) -> dict:
        """The exported query encoder (``export_onnx``) gives the vectors of ``search_mode``, as :meth:`query_search_vectors`."""
        return {"head": self.search_mode}

    def query_search_vectors(self, texts, batch_size: int = 128, show_progress_bar: Optional[bool] = None) -> torch.Tensor:
        """Query vectors for ``search_mode``: ``Phi_D(x)``, ``N(Phi_C(x))`` or both concatenated (one encoder pass)."""
        return self.encode_texts(texts, self.config.max_seq_length, batch_size, show_progress_bar, desc="Encoding queries", **self.query_embed_kwargs())

    # ------------------------------------------------------------------ training
    def parameter_learning_rates(self, base_lr: float) -> dict[str, float]:
        """Learning rate per parameter-name prefix (read by the trainer's optimizer): the heads at
        ``head_learning_rate_multiplier`` x the encoder's, the classifier vectors at ``classifier_learning_rate``
        (paper Sec. 4: 1e-4 / 2e-4 / 1e-3)."""
        head = base_lr * self.config.head_learning_rate_multiplier
        rates = {"de_head.": head, "clf_head.": head}
        if self.classifier is not None and self.config.classifier_learning_rate is not None:
            rates["classifier."] = self.config.classifier_learning_rate
        return rates

    def loss_embedding(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The pooled encoder outputs, which the DE and classifier heads project in the loss."""
        return self.pooled_embedding(input_ids, attention_mask)

    def pool_loss(self, query_embeds: torch.Tensor, label_embeds: torch.Tensor, targets: Optional[torch.Tensor] = None,
                  positive_index: Optional[torch.Tensor] = None, label_ids: Optional[torch.Tensor] = None,
                  query_positive_ids: Optional[torch.Tensor] = None) -> tuple[Optional[torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
        """UniDEC loss and search-space scores from pooled query and label-pool embeddings (the part of ``forward``
        after the encoder, so a gradient cache can embed in chunks)."""
        if self.classifier is not None and label_ids is None:
            raise ValueError("UniDEC needs the pool's label_ids to look up the classifier vectors")
        if self.training and label_ids is not None and query_positive_ids is not None and distributed_world_size() > 1:
            label_embeds, targets, positive_index, label_ids = gather_label_pool(label_embeds, label_ids, query_positive_ids, positive_index)
        de_scores = F.normalize(self.de_head(query_embeds), dim=-1) @ F.normalize(self.de_head(label_embeds), dim=-1).T
        clf_scores = None
        if self.classifier is not None:
            clf_queries = self.clf_head(query_embeds)
            pool_vectors = self.classifier.pool_weights(label_ids)  # the pool's rows only: never (batch, L) scores
            clf_scores = clf_queries @ pool_vectors.to(clf_queries.dtype).T
        loss, logged = None, {}
        if targets is not None:
            terms = self.loss_fn(
                de_scores * self.de_logit_scale,
                targets.bool(),
                clf_scores * self.clf_logit_scale if clf_scores is not None else None,
                clf_scores,
            )
            loss = terms["loss"]
            logged = {name: value.detach() for name, value in terms.items() if name != "loss"}  # no device sync per step
        with torch.no_grad():
            if self.search_mode == "de":
                logits = de_scores
            else:
                clf_cosines = F.normalize(clf_queries, dim=-1) @ F.normalize(pool_vectors.to(clf_queries.dtype), dim=-1).T
                logits = clf_cosines if self.search_mode == "classifier" else de_scores + clf_cosines
        return loss, logits.detach(), logged


__all__ = ["UniDECModel", "UniDECPreTrainedModel"]
