"""SiameseXML: a siamese encoder, then one extreme classifier per label re-parameterised around the label's text.

Dahiya, Agarwal, Saini, Gururaj, Jiao, Singh, Agarwal, Kar, Varma, "SiameseXML: Siamese Networks meet Extreme
Classifiers with 100M Labels", ICML 2021. One encoder embeds queries and label texts: the *intermediate* embedding
``f_E(.)`` (unit norm; a Hugging Face encoder, or the paper's TF-IDF bag of token embeddings + GELU). Module I trains
it on batches of labels with the point-likelihood loss and in-batch hard negatives. Module II freezes it and builds
per label the label-text vector ``z~_l`` (``f_E(z_l)`` smoothed over correlated labels) and the centroid ``v_l`` of its
training points; one index over both gives every query a shortlist. Module III sets each classifier to
``w_l = N(z~_l + eta_l)`` with ``eta_l = 0``; Module IV trains the refinement vectors ``eta`` and the query-side
residual block ``E(x) = N(g(f_E(x)))`` on each training point's positives and shortlist negatives. Prediction scores
only the shortlist: ``cos(w_l, E(x))`` fused with the shortlist similarity.

Memory per label (fp32, dimension D): ``z~_l`` and ``v_l`` (buffers, ``8 D`` bytes), ``eta_l`` (``4 D``) and, while
training, its two AdamW moments (``8 D``, row-wise updates); the saved label store holds ``[z~ ; v]`` once more for the
index (``8 D``). Per query at prediction: the shortlist (``shortlist_size`` ids and scores) and its classifier rows
(``shortlist_size x D`` floats, in chunks of ``SCORE_CHUNK`` queries).

Implementation spec: ``shared/specs/siamesexml.md`` ([P] paper, [C] official code; the defaults follow [C]).
"""

from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, AutoTokenizer
from transformers import initialization as init

from .classifier_head import ExtremeClassifier, fuse_shortlist_scores, merge_label_scores
from .configuration_siamesexml import SIAMESEXML_SEARCH_MODES, SiameseXMLConfig
from .encoder_utils import POOLERS, repair_tokenizer
from .modeling_xmc import XMCModelOutput, XMCPreTrainedModel
from .xmc_losses import siamese_classifier_loss, siamese_pair_loss

SCORE_CHUNK = 64  # queries whose shortlisted classifier rows are gathered at once (64 x 500 x D floats)
SEARCH_CHUNK = 4096  # queries shortlisted at once: their index hits (2 x 500 per query, ~145 bytes each at the merge) bound search memory


class BagOfEmbeddingsEncoder(nn.Module):
    """The paper's encoder: ``f_E(x) = N(GELU(E x))`` with ``x`` the L2-normalised TF-IDF vector of the text's tokens.

    The vocabulary is the tokenizer's; ``idf`` (a saved buffer, 0 for special and padding tokens) weights every
    token occurrence, so ``E x`` is an embedding bag over the token ids. With ``sparse=True`` the table takes sparse
    gradients (only the rows of the batch's tokens), trained row-wise like the per-label tables.

    Memory: ``V x D`` table + ``V`` IDF weights; per batch ``B x T x T`` booleans to count repeated tokens.
    """

    def __init__(self, vocab_size: int, dim: int, sparse: bool = True):
        super().__init__()
        self.token_embeddings = nn.EmbeddingBag(vocab_size, dim, mode="sum", sparse=sparse)
        self.register_buffer("idf", torch.ones(vocab_size))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.to(self.idf.dtype)
        weights = self.idf[input_ids] * mask
        # ||x||^2 = sum_v (tf_v idf_v)^2 = sum over positions of idf^2 x (count of that position's token)
        same = (input_ids.unsqueeze(2) == input_ids.unsqueeze(1)) & attention_mask.bool().unsqueeze(1)
        norm = (weights.square() * same.sum(dim=2).to(weights.dtype)).sum(dim=1, keepdim=True).sqrt().clamp(min=1e-12)
        bag = self.token_embeddings(input_ids, per_sample_weights=weights / norm)
        return F.normalize(F.gelu(bag), dim=-1)


class ResidualBlock(nn.Module):
    """``g(u) = u + Dropout(ReLU(r SN(W) u + b))`` ([C]): ``W`` identity-initialised, learned scale ``r`` (1 at start),
    bias 0. ``SN(W) = W / sigma(W)``, the largest singular value estimated by power iteration as
    ``torch.nn.utils.spectral_norm`` does: one iteration per training forward on the saved left singular vector
    ``power_u`` (an exact SVD with its backward costs ~30x a step's matrix products at D = 384 on a CPU)."""

    def __init__(self, dim: int, dropout: float = 0.5):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dim))
        self.bias = nn.Parameter(torch.empty(dim))
        self.scale = nn.Parameter(torch.empty(()))
        self.register_buffer("power_u", torch.empty(dim))
        self.dropout = nn.Dropout(dropout)

    def spectral_norm(self) -> torch.Tensor:
        """``sigma(W)`` (differentiable in ``W``); the power iteration advances one step in training mode."""
        weight = self.weight
        with torch.no_grad():
            u = self.power_u
            if self.training:
                v = F.normalize(weight.T @ u, dim=0)
                u = F.normalize(weight @ v, dim=0)
                self.power_u.copy_(u)
            v = F.normalize(weight.T @ u, dim=0)
        return u @ weight @ v

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        weight = self.weight / self.spectral_norm()
        return u + self.dropout(F.relu(self.scale * F.linear(u, weight) + self.bias))


class SiameseXMLPreTrainedModel(XMCPreTrainedModel):
    """Weights initialisation and loading glue for SiameseXML."""

    config: SiameseXMLConfig
    base_model_prefix = "siamesexml"

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, ExtremeClassifier):  # eta = 0: w_l starts at N(z~_l) (Module III)
            init.zeros_(module.weight)
            return
        if isinstance(module, BagOfEmbeddingsEncoder):
            init.normal_(module.token_embeddings.weight, std=module.token_embeddings.embedding_dim**-0.5)
            init.ones_(module.idf)
            return
        if isinstance(module, ResidualBlock):
            init.copy_(module.weight, torch.eye(module.weight.shape[0]))
            init.zeros_(module.bias)
            init.ones_(module.scale)
            init.constant_(module.power_u, module.power_u.shape[0] ** -0.5)
            return
        super()._init_weights(module)
        if isinstance(module, SiameseXMLModel):
            init.zeros_(module.label_text_vectors)
            init.zeros_(module.label_centroids)
            init.zeros_(module.label_state_initialized)


class SiameseXMLModel(SiameseXMLPreTrainedModel):
    """The SiameseXML model: siamese encoder, residual block, label-text vectors, centroids and refinement vectors.

    ``encode_queries`` / ``encode_labels`` give intermediate embeddings ``f_E`` (unit norm); ``predict`` shortlists with
    them and ranks the shortlist by ``config.search_mode`` (default ``"fusion"``). The label state (``z~``, ``v``) comes
    from the training data (:func:`hf_xmc.training.siamesexml.build_label_state`); a model without one uses
    ``z~_l = f_E(z_l)`` and no centroids.

    Example:
        >>> model = SiameseXMLModel.from_encoder_pretrained("sentence-transformers/all-MiniLM-L6-v2", label_space_size=2)
        >>> model.set_labels(["Games: Strategy", "Development: Library"])
        >>> model.predict(["0ad : Real-time strategy game"], k=1).label_texts
    """

    # refinement vectors and token embeddings are per-row tables: no weight decay toward zero ([C]: none at all)
    no_weight_decay_parameters = ("classifier.weight", "encoder.token_embeddings.weight", "residual.scale")
    # Module IV's classifier rows get their gradients in the loss, outside the encoder
    supports_distributed_gradient_cache = False
    # predict ranks the shortlist by "fusion", "classifier", "shortlist" or "label_text" (no re-indexing)
    search_modes = SIAMESEXML_SEARCH_MODES
    # beta of the fused score (0: the shortlist's similarity alone, 1: the classifiers alone), tuned on the validation
    # split after training: the paper's and the code's fixed value was chosen on their datasets and budgets
    tunable_ranking_settings = {"fusion_weight": (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)}
    # learning rate of the bag-of-embeddings table relative to the base rate ([C]: 0.01 against 2e-4 for a transformer)
    boe_learning_rate_multiplier = 50.0
    # the label store / index holds [z~ ; v]: two rows per label
    label_store_rows_per_label = 2

    def __init__(self, config: SiameseXMLConfig):
        super().__init__(config)
        dim, num_labels = config.embedding_dim, config.label_space_size
        self.residual = ResidualBlock(dim, config.residual_dropout)
        self.classifier = ExtremeClassifier(num_labels, dim, sparse_gradients=config.sparse_label_gradients)  # eta
        self.register_buffer("label_text_vectors", torch.empty(num_labels, dim))  # z~ (unit rows)
        self.register_buffer("label_centroids", torch.empty(num_labels, dim))  # v (unit rows; 0 without points)
        self.register_buffer("label_state_initialized", torch.zeros((), dtype=torch.bool))
        self.post_init()

    def build_encoder(self, config: SiameseXMLConfig) -> nn.Module:
        if config.encoder_type == "boe":
            return BagOfEmbeddingsEncoder(config.boe_vocab_size, config.embedding_dim, sparse=config.sparse_label_gradients)
        return super().build_encoder(config)

    @classmethod
    def from_encoder_pretrained(cls, encoder_name_or_path: str, **config_kwargs) -> "SiameseXMLModel":
        """A fresh model on a pretrained encoder. With ``encoder_type="boe"`` only the tokenizer (the vocabulary) and
        the input token embeddings (when their width is ``boe_embedding_dim``, like [C]'s FastText start) are taken from
        ``encoder_name_or_path``; the IDF weights are set from the training texts (:meth:`set_idf`)."""
        if config_kwargs.get("encoder_type", "transformer") != "boe":
            return super().from_encoder_pretrained(encoder_name_or_path, **config_kwargs)
        config_kwargs = {k: v for k, v in config_kwargs.items() if v is not None or k not in ("pooling", "normalize")}  # no pooling here
        encoder_config = AutoConfig.from_pretrained(encoder_name_or_path)
        tokenizer = repair_tokenizer(AutoTokenizer.from_pretrained(encoder_name_or_path), encoder_config, encoder_name_or_path)
        config = cls.config_class(encoder_config=encoder_config.to_dict(), boe_vocab_size=len(tokenizer), **config_kwargs)
        model = cls(config)
        pretrained = AutoModel.from_pretrained(encoder_name_or_path).get_input_embeddings().weight.detach()
        if pretrained.shape[1] == config.embedding_dim:
            rows = min(pretrained.shape[0], config.boe_vocab_size)
            with torch.no_grad():
                model.encoder.token_embeddings.weight[:rows] = pretrained[:rows]
        model.tokenizer = tokenizer
        return model

    @torch.no_grad()
    def set_idf(self, document_frequency: torch.Tensor | np.ndarray, num_documents: int) -> None:
        """IDF weights of the bag-of-embeddings encoder, ``ln((1 + n) / (1 + df)) + 1`` (smoothed), 0 for the
        tokenizer's special tokens."""
        if self.config.encoder_type != "boe":
            raise ValueError("set_idf applies to encoder_type='boe' only")
        df = torch.as_tensor(np.asarray(document_frequency), dtype=torch.float32)
        if df.shape != self.encoder.idf.shape:
            raise ValueError(f"document_frequency must have shape {tuple(self.encoder.idf.shape)}, got {tuple(df.shape)}")
        idf = torch.log((1.0 + num_documents) / (1.0 + df)) + 1.0
        if self.tokenizer is not None:
            special = [i for i in self.tokenizer.all_special_ids if 0 <= i < idf.shape[0]]
            idf[special] = 0.0
        self.encoder.idf.copy_(idf)
        self.invalidate_label_index()

    # ------------------------------------------------------------------ embeddings
    def pooled_embedding(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **encoder_kwargs) -> torch.Tensor:
        """The intermediate embedding ``f_E`` (unit norm, float32)."""
        if self.config.encoder_type == "boe":
            return self.encoder(input_ids, attention_mask).float()
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **encoder_kwargs).last_hidden_state
        return F.normalize(self.embedding_dropout(POOLERS[self.config.pooling](hidden, attention_mask)).float(), dim=-1)

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, normalize: Optional[bool] = None, head: str = "intermediate", **encoder_kwargs) -> torch.Tensor:
        """``head="intermediate"``: ``f_E(x)``; ``"final"``: ``E(x) = N(g(f_E(x)))`` (query side). Both unit norm;
        ``normalize`` is accepted for the shared helpers and ignored."""
        u = self.pooled_embedding(input_ids, attention_mask, **encoder_kwargs)
        return self.final_embedding(u) if head == "final" else u

    def query_encoder_modules(self) -> list[dict]:
        """``f_E`` of the transformer encoder: pooling, then unit norm (the vector the label store is searched with)."""
        if self.config.encoder_type == "boe":
            raise NotImplementedError("the bag-of-embeddings encoder is not a transformers model: it has no sentence-transformers form")
        return [{"type": "Normalize"}]

    def final_embedding(self, intermediate: torch.Tensor) -> torch.Tensor:
        """``E(x) = N(g(f_E(x)))``: the residual block on top of intermediate embeddings."""
        return F.normalize(self.residual(intermediate.to(self.residual.weight.dtype)), dim=-1)

    def classifier_weights(self, label_ids: torch.Tensor) -> torch.Tensor:
        """``w_l = N(z~_l + eta_l)`` of ``label_ids`` (any shape); gradients reach ``eta`` rows only (sparse when
        ``config.sparse_label_gradients``)."""
        flat = label_ids.reshape(-1)
        vectors = self.label_text_vectors[flat.to(self.label_text_vectors.device)] + self.classifier.pool_weights(flat)
        return F.normalize(vectors, dim=-1).reshape(*label_ids.shape, -1)

    # ------------------------------------------------------------------ label state
    def set_labels(self, texts, uids=None) -> None:
        if len(texts) != self.config.label_space_size:
            raise ValueError(
                f"this SiameseXML model was built for {self.config.label_space_size} labels (label_space_size) but got "
                f"{len(texts)} label texts; it has one classifier per label"
            )
        super().set_labels(texts, uids)

    @torch.no_grad()
    def set_label_state(self, label_text_vectors: torch.Tensor, label_centroids: Optional[torch.Tensor] = None, normalize: bool = True) -> None:
        """Set ``z~`` (``(L, D)``) and the centroids ``v`` (``(L, D)``, zero rows for labels without training points);
        both are L2-normalised here unless ``normalize=False`` (rows that already are, e.g. read back from a store: a
        second normalisation can move their last bits). The classifiers ``w_l = N(z~_l + eta_l)`` move with ``z~``."""
        unit = (lambda x: F.normalize(x, dim=-1)) if normalize else (lambda x: x)
        shape = tuple(self.label_text_vectors.shape)
        for name, value in (("label_text_vectors", label_text_vectors), ("label_centroids", label_centroids)):
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(value.shape)}")
        self.label_text_vectors.copy_(unit(torch.as_tensor(label_text_vectors).float()))
        if label_centroids is None:
            self.label_centroids.zero_()
        else:
            self.label_centroids.copy_(unit(torch.as_tensor(label_centroids).float()))
        self.label_state_initialized.fill_(True)
        self.invalidate_label_index()

    @torch.no_grad()
    def _grow_label_state(self, texts, batch_size, show_progress_bar):
        """New labels: ``z~_l = f_E(z_l)``, no centroid (``v_l = 0``, as a label without training points), ``eta_l = 0``
        so ``w_l = N(z~_l)``. The ``[z~ ; v]`` store is laid out by label count: None (rebuild from the state)."""
        z = F.normalize(self.encode_labels(texts, batch_size=batch_size, show_progress_bar=show_progress_bar).float(), dim=-1)
        self.label_text_vectors = self._concat_rows(self.label_text_vectors, z)
        self.label_centroids = self._concat_rows(self.label_centroids, torch.zeros_like(z))
        self.classifier.replace_rows(self._concat_rows(self.classifier.weight, torch.zeros_like(z)))
        self.config.label_space_size = self.classifier.num_labels
        return None

    @torch.no_grad()
    def _select_label_state(self, keep: torch.Tensor) -> bool:
        self.label_text_vectors = self.label_text_vectors[keep.to(self.label_text_vectors.device)]
        self.label_centroids = self.label_centroids[keep.to(self.label_centroids.device)]
        self.classifier.replace_rows(self.classifier.weight[keep.to(self.classifier.weight.device)])
        self.config.label_space_size = self.classifier.num_labels
        return False

    def label_search_vectors(self, batch_size: int = 128, show_progress_bar: Optional[bool] = None) -> torch.Tensor:
        """The shortlist index rows: ``[z~ ; v]``, ``(2 L, D)`` (row ``L + l`` is label ``l``'s centroid), in the label
        store's precision (written straight into it: no float32 ``2 L x D`` temporary). Without a label state,
        ``z~_l = f_E(z_l)`` of the current encoder becomes it (no centroids)."""
        if not bool(self.label_state_initialized):
            self.set_label_state(self.encode_labels(batch_size=batch_size, show_progress_bar=show_progress_bar))
        num_labels = self.label_text_vectors.shape[0]
        rows = torch.empty((2 * num_labels, self.label_text_vectors.shape[1]), dtype=getattr(torch, self.config.label_embeddings_dtype))
        rows[:num_labels].copy_(self.label_text_vectors)
        rows[num_labels:].copy_(self.label_centroids)
        return rows

    # ------------------------------------------------------------------ shortlist, scores, search
    @torch.no_grad()
    def shortlist(
        self,
        intermediate: torch.Tensor | np.ndarray,
        size: Optional[int] = None,
        source_weights: tuple[float, float] = (1.0, 1.0),
        extra_hits: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Shortlist for intermediate query vectors: ``2 x shortlist_per_source`` hits of the index over ``[z~ ; v]``,
        summed per label (``sim_l = a cos(f(x), z~_l) + b cos(f(x), v_l)`` with ``(a, b) = source_weights``; a label
        missing from a search adds 0), best ``size`` kept. ``extra_hits`` = ``(query_of, label_of, values)`` adds
        more evidence per label (Module II: the votes of training-point neighbours). Returns ``(ids, sims)``,
        ``(n, size)``, ``-1`` / ``-inf`` padded."""
        size = size or self.config.shortlist_size
        num_labels = self.config.label_space_size
        queries = torch.as_tensor(intermediate).float()
        index = self.ensure_label_index()
        fetch = min(2 * max(self.config.shortlist_per_source, size), 2 * num_labels)
        hit_scores, hit_rows = index.search(queries, fetch)
        valid = hit_rows >= 0
        query_of = np.nonzero(valid)[0]
        rows = hit_rows[valid]
        weights = np.where(rows < num_labels, source_weights[0], source_weights[1]).astype(np.float32)
        keep = weights != 0
        parts = [(query_of[keep], rows[keep] % num_labels, hit_scores[valid][keep] * weights[keep])]
        if extra_hits is not None:
            parts.append(extra_hits)
        query_of, label_of, values = (np.concatenate(column) for column in zip(*parts))
        return merge_label_scores(query_of, label_of, values, queries.shape[0], num_labels, size)

    @torch.no_grad()
    def shortlist_scores(self, final: torch.Tensor, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Per shortlisted label: ``classifier`` = ``cos(w_l, E(x))`` and ``label_side`` = ``(z~_l + v_l)^T E(x)`` (the
        paper fusion's second term), in chunks of ``SCORE_CHUNK`` queries. Padded slots score 0."""
        classifier = np.zeros(ids.shape, dtype=np.float32)
        label_side = np.zeros(ids.shape, dtype=np.float32)
        device = self.label_text_vectors.device
        for start in range(0, ids.shape[0], SCORE_CHUNK):
            chunk = torch.from_numpy(np.maximum(ids[start : start + SCORE_CHUNK], 0)).to(device)
            e = final[start : start + SCORE_CHUNK].to(device).unsqueeze(-1)
            classifier[start : start + SCORE_CHUNK] = (self.classifier_weights(chunk) @ e).squeeze(-1).float().cpu().numpy()
            side = self.label_text_vectors[chunk] + self.label_centroids[chunk]
            label_side[start : start + SCORE_CHUNK] = (side @ e).squeeze(-1).float().cpu().numpy()
        return {"classifier": classifier, "label_side": label_side}

    @torch.no_grad()
    def search(self, query_vectors: torch.Tensor | np.ndarray, k: int = 5) -> tuple[np.ndarray, np.ndarray]:
        """Top-k ``(scores, ids)`` for intermediate query vectors (``query_search_vectors``): shortlist, then the
        shortlist ranked by ``config.search_mode``. Labels outside the shortlist get no score (``-1`` / ``-inf``).

        Memory: the ``(n, k)`` result (12 bytes per query and rank) plus one chunk of ``SEARCH_CHUNK`` queries' index hits
        and shortlists (``2 x max(shortlist_per_source, shortlist_size)`` hits per query, ~145 bytes per hit at the
        merge's high point: ~0.55 GiB for 4,096 queries at the defaults), however many queries come in (50K at once:
        ~6.7 GiB)."""
        queries = torch.as_tensor(query_vectors)
        if queries.shape[0] <= SEARCH_CHUNK:
            return self._search_chunk(queries, k)
        scores = np.empty((queries.shape[0], k), dtype=np.float32)
        ids = np.empty((queries.shape[0], k), dtype=np.int64)
        for start in range(0, queries.shape[0], SEARCH_CHUNK):  # each chunk fills its k columns (the shortlist has >= k)
            scores[start : start + SEARCH_CHUNK], ids[start : start + SEARCH_CHUNK] = self._search_chunk(queries[start : start + SEARCH_CHUNK], k)
        return scores, ids

    def _search_chunk(self, query_vectors: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        mode = self.config.search_mode
        was_training = self.training
        self.eval()
        try:
            u = query_vectors.float()
            if mode == "label_text":
                ids, scores = self.shortlist(u, max(k, self.config.shortlist_size), source_weights=(1.0, 0.0))
            else:
                ids, sims = self.shortlist(u, max(k, self.config.shortlist_size))
                if mode == "shortlist":
                    scores = sims
                else:
                    parts = self.shortlist_scores(self.final_embedding(u.to(self.residual.weight.device)), ids)
                    if mode == "classifier":
                        scores = parts["classifier"]
                    else:
                        scores = fuse_shortlist_scores(parts["classifier"], sims, self.config.fusion_weight, self.config.fusion, parts["label_side"])
            scores = np.where(ids >= 0, scores, -np.inf).astype(np.float32)
            order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
            return np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)
        finally:
            self.train(was_training)

    # ------------------------------------------------------------------ training
    def parameter_learning_rates(self, base_lr: float) -> dict[str, float]:
        """The bag-of-embeddings table at ``boe_learning_rate_multiplier`` x the base rate ([C]: 0.01)."""
        return {"encoder.": base_lr * self.boe_learning_rate_multiplier} if self.config.encoder_type == "boe" else {}

    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        label_input_ids: Optional[torch.Tensor] = None,
        label_attention_mask: Optional[torch.Tensor] = None,
        targets: Optional[torch.Tensor] = None,
        centroid_input_ids: Optional[torch.Tensor] = None,
        centroid_attention_mask: Optional[torch.Tensor] = None,
        query_vectors: Optional[torch.Tensor] = None,
        candidate_ids: Optional[torch.Tensor] = None,
        candidate_targets: Optional[torch.Tensor] = None,
        **kwargs,
    ) -> XMCModelOutput:
        r"""
        Module I (label tokens given): ``input_ids`` / ``attention_mask`` are one positive point per batch label,
        ``label_input_ids`` / ``label_attention_mask`` the batch labels' texts, ``targets`` ``(B, P)`` every true
        (point, label) pair, ``centroid_input_ids`` / ``centroid_attention_mask`` (optional) a second positive per label
        for the centroid estimate ``v^_l = N(f(x'_l) + f(z_l))``. Loss = ``(1 - w) L(f(x), f(z)) + w L(f(x), v^)``
        (:func:`siamese_pair_loss`, ``w = siamese_centroid_weight``).

        Module IV (``candidate_ids`` given): ``query_vectors`` ``(B, D)`` precomputed intermediate embeddings (or
        ``input_ids`` to run the encoder, SiameseXML++), ``candidate_ids`` ``(B, S)`` each point's positives and
        shortlist negatives (``-1``-padded), ``candidate_targets`` ``(B, S)`` the positives. Loss =
        :func:`siamese_classifier_loss` of ``cos(w_l, E(x))``.

        Returns [`XMCModelOutput`] with ``loss`` (given targets), ``logits`` (the scores) and ``query_embeds``.
        """
        if candidate_ids is not None:
            return self._classifier_forward(input_ids, attention_mask, query_vectors, candidate_ids, candidate_targets)
        query_embeds = self.pooled_embedding(input_ids, attention_mask)
        if label_input_ids is None:
            return XMCModelOutput(query_embeds=query_embeds)
        label_embeds = self.pooled_embedding(label_input_ids, label_attention_mask)
        scores = query_embeds @ label_embeds.T
        loss, terms = None, None
        if targets is not None:
            cfg = self.config
            targets = targets.bool()
            pair_loss = {"c": cfg.siamese_c, "d": cfg.siamese_d, "num_hard_negatives": cfg.siamese_hard_negatives, "loss": cfg.siamese_loss, "scale": cfg.siamese_scale}
            text_loss = siamese_pair_loss(scores, targets, **pair_loss)
            loss, terms = text_loss, {"label_text": text_loss.detach()}
            if centroid_input_ids is not None and cfg.siamese_centroid_weight > 0:
                centroids = F.normalize(self.pooled_embedding(centroid_input_ids, centroid_attention_mask) + label_embeds, dim=-1)
                centroid_loss = siamese_pair_loss(query_embeds @ centroids.T, targets, **pair_loss)
                loss = (1.0 - cfg.siamese_centroid_weight) * text_loss + cfg.siamese_centroid_weight * centroid_loss
                terms["centroid"] = centroid_loss.detach()
        return XMCModelOutput(loss=loss, logits=scores.detach(), query_embeds=query_embeds, label_embeds=label_embeds, loss_terms=terms)

    def _classifier_forward(self, input_ids, attention_mask, query_vectors, candidate_ids, candidate_targets) -> XMCModelOutput:
        if query_vectors is None:
            if input_ids is None:
                raise ValueError("Module IV needs query_vectors (precomputed f_E(x)) or input_ids")
            query_vectors = self.pooled_embedding(input_ids, attention_mask)
        final = self.final_embedding(query_vectors.to(self.residual.weight.device))
        valid = candidate_ids >= 0
        weights = self.classifier_weights(candidate_ids.clamp(min=0))
        scores = (weights @ final.unsqueeze(-1)).squeeze(-1)
        loss = None
        if candidate_targets is not None:
            cfg = self.config
            loss = siamese_classifier_loss(
                scores, candidate_targets.bool() & valid, valid, cfg.classifier_c, cfg.classifier_d,
                cfg.classifier_negatives, cfg.classifier_negative_threshold, cfg.classifier_hard_negative_factor,
                cfg.classifier_loss, cfg.classifier_scale,
            )
        return XMCModelOutput(loss=loss, logits=scores.detach(), query_embeds=final)


__all__ = ["BagOfEmbeddingsEncoder", "ResidualBlock", "SiameseXMLModel", "SiameseXMLPreTrainedModel"]
