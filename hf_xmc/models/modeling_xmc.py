"""Shared modeling base of the hf_xmc models: :class:`XMCPreTrainedModel`, its output and prediction types.

An XMC model here is a text encoder (any Hugging Face ``AutoModel`` backbone) that embeds queries and label texts,
plus what rides with the checkpoint: the tokenizer, the label store (``labels.jsonl`` and the label vectors:
``label_store.py``), the search index over them (a rebuildable cache: ``label_index.py``), an optional lexical
channel (``lexical_channel.py``), a score calibration (``calibration.py``) and the model card (``hub_files.py``).
``save_pretrained`` writes them (so Trainer checkpoints and ``push_to_hub`` carry them) and ``from_pretrained`` reads
them back through ``cached_file`` and checks them (``model_persistence.py``, ``model_files.py``), so a local directory
and a Hub repo id both work. What the encoders share (pooling, gathering, tokenisation, peft) is in ``encoder_utils.py``; the file helpers
(atomic writes, staged directories) in ``io_utils.py``.

This file is part of the remote-code bundle: it imports only torch, transformers, huggingface_hub, numpy,
safetensors, tqdm and its siblings.
"""

import os
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoModel, AutoTokenizer, PreTrainedModel
from transformers.utils import ModelOutput, logging

from .configuration_xmc import XMCConfig
from .encoder_adapter import EncoderAdapterMixin
from .encoder_utils import (
    POOLERS,
    as_requested,
    config_from_sentence_transformers,
    import_peft,
    peft_config_from_dict,
    repair_tokenizer,
    save_sentence_transformers_checkpoint,
    tokenize_texts,
)
from .hub_files import ModelCardFiles
from .io_utils import progress_bar_disabled
from .label_index import LabelIndex
from .label_space import LabelSpaceMixin
from .lexical_channel import LexicalChannel
from .model_persistence import XMCPersistenceMixin
from .model_provenance import ModelProvenanceMixin
from .onnx_encoder import OnnxExportMixin
from .provenance import changed_inputs
from .static_encoder import StaticQueryEncoderMixin
from .training_hooks import XMCTrainingHooks

logger = logging.get_logger(__name__)

THRESHOLD_DEPTH = 100  # labels predict(threshold=) ranks before it keeps those above the threshold (k overrides it)


@dataclass
class XMCPrediction:
    """Top-k predictions for a list of inputs, best first.

    Attributes:
        label_ids: int64 array ``(n, k)``; ``-1`` marks an empty slot (fewer than k labels exist).
        scores: float32 array ``(n, k)``, non-increasing along each row.
        label_texts: ``n`` lists of ``k`` label texts (empty string for an empty slot).
        probabilities: float32 array ``(n, k)``, the calibrated probability that each label is relevant (0 for an
            empty slot); None for a model without a score calibration.
    """

    label_ids: np.ndarray
    scores: np.ndarray
    label_texts: list[list[str]]
    probabilities: Optional[np.ndarray] = None


@dataclass
class XMCModelOutput(ModelOutput):
    """Output of an hf_xmc dual-encoder forward pass.

    Attributes:
        loss: training loss, returned when ``targets`` are given.
        logits: ``(batch, pool)`` query/label-pool scores divided by the temperature.
        query_embeds: ``(batch, dim)`` query embeddings.
        label_embeds: ``(pool, dim)`` label embeddings.
        loss_terms: the detached terms of a multi-term loss (PRIME, UniDEC, SiameseXML), which the trainer logs as
            ``loss_<term>``; None for a loss of one term.
    """

    loss: Optional[torch.FloatTensor] = None
    logits: Optional[torch.FloatTensor] = None
    query_embeds: Optional[torch.FloatTensor] = None
    label_embeds: Optional[torch.FloatTensor] = None
    loss_terms: Optional[dict[str, torch.Tensor]] = None


class XMCPreTrainedModel(XMCTrainingHooks, XMCPersistenceMixin, EncoderAdapterMixin, LabelSpaceMixin, OnnxExportMixin, StaticQueryEncoderMixin,
                         ModelProvenanceMixin, PreTrainedModel):
    """Base class of the hf_xmc models: encoder, pooling, label store, label index and ``predict``.

    Subclasses define their training objective (a dual encoder its ``pool_loss``, which :meth:`forward` calls; the
    others their own ``forward``) and may override :meth:`label_search_vectors` / :meth:`query_search_vectors` when their search
    space is not plain label-text embeddings. What the trainer may ask a model is declared, with its defaults, on
    :class:`XMCTrainingHooks` (``training_hooks.py``); the peft adapter methods on :class:`EncoderAdapterMixin`, adding and removing labels on :class:`LabelSpaceMixin`.
    """

    config: XMCConfig
    base_model_prefix = "xmc"
    main_input_name = "input_ids"
    input_modalities = ("text",)
    # the spaces or rankings predict can use, config.search_mode choosing one (set_search_mode); empty: one (DEXML)
    search_modes: tuple[str, ...] = ()
    # whether a search mode changes the label vectors (PRIME, UniDEC: rebuilt after a switch) or only how a shortlist
    # is ranked (SiameseXML, MUFIN)
    search_mode_changes_label_vectors = False
    supports_gradient_checkpointing = True
    # rows of the label store (and index) per label: 2 for SiameseXML, whose index holds label-text vectors and centroids
    label_store_rows_per_label = 1
    # set by XMCTrainer while it writes a checkpoint: weights under the modules' own names (see save_pretrained)
    trainer_checkpoint_keys = False

    def __init__(self, config: XMCConfig):
        super().__init__(config)
        config.validate_xmc()
        self.encoder = self.build_encoder(config)
        if config.encoder_adapter and not config.encoder_adapter_only:  # a checkpoint: its weights load into the wrapper
            self.encoder = import_peft().get_peft_model(self.encoder, peft_config_from_dict(config.encoder_adapter))
        self.embedding_dropout = nn.Dropout(config.embedding_dropout)
        self.save_adapter_only = False  # save_pretrained's default: merged (the adapter folded into the encoder)
        self.tokenizer = None
        self.encoding_autocast_dtype: Optional[torch.dtype] = None  # encode passes under torch.autocast (encoding_autocast)
        self.label_texts: Optional[list[str]] = None
        self.label_uids: Optional[list[str]] = None
        self.label_embedding_blocks: Optional[list[torch.Tensor]] = None  # the label vectors, as row blocks
        self.label_index: Optional[LabelIndex] = None  # with the weights it was built with (label_index_is_current)
        self.model_card: Optional[ModelCardFiles] = None
        # TF-IDF ranker + label-text scores fused with the dense score (lexical_channel.py); None: dense only
        self.lexical_channel: Optional[LexicalChannel] = None

    # ------------------------------------------------------------------ construction
    def build_encoder(self, config: XMCConfig) -> nn.Module:
        """The text encoder: a Hugging Face ``AutoModel`` built from ``config.encoder_config`` (a method with its own
        encoder, e.g. SiameseXML's bag of embeddings, overrides this)."""
        return AutoModel.from_config(config.encoder_config)

    @classmethod
    def from_encoder_pretrained(cls, encoder_name_or_path: str, **config_kwargs) -> "XMCPreTrainedModel":
        """Build a fresh model whose encoder (and tokenizer) start from a pretrained checkpoint.

        ``config_kwargs`` are the method's configuration fields (e.g. ``temperature=0.05``). A sentence-transformers
        checkpoint (``modules.json``) lends its pooling mode to ``pooling`` left out or None, and its normalisation
        when it has a Normalize module (one without keeps the method's cosine scoring); a log line says which; values
        given here win.
        """
        config_kwargs = config_from_sentence_transformers(encoder_name_or_path, config_kwargs)
        encoder = AutoModel.from_pretrained(encoder_name_or_path)
        tokenizer = repair_tokenizer(AutoTokenizer.from_pretrained(encoder_name_or_path), encoder.config, encoder_name_or_path)
        config = cls.config_class(encoder_config=encoder.config.to_dict(), **config_kwargs)
        model = cls(config)
        missing, unexpected = model.encoder.load_state_dict(encoder.state_dict(), strict=False)
        if unexpected or [k for k in missing if not k.endswith("position_ids")]:
            raise ValueError(f"encoder weights of {encoder_name_or_path} do not fit: missing={missing} unexpected={unexpected}")
        model.tokenizer = tokenizer
        model.config.encoder_base_model = str(encoder_name_or_path)
        return model

    # ------------------------------------------------------------------ encoding
    def pooled_embedding(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **encoder_kwargs) -> torch.Tensor:
        """The encoder's pooled (dropout-regularised, float32) output: one raw vector per text."""
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **encoder_kwargs).last_hidden_state
        pooled = POOLERS[self.config.pooling](hidden, attention_mask)
        return self.embedding_dropout(pooled).float()

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, normalize: Optional[bool] = None, **encoder_kwargs) -> torch.Tensor:
        """Encode token ids into one (dropout-regularised, optionally L2-normalised) vector per text.

        ``normalize`` overrides ``config.normalize`` (PRIME feeds raw label embeddings to its prototype network).
        """
        pooled = self.pooled_embedding(input_ids, attention_mask, **encoder_kwargs)
        if self.config.normalize if normalize is None else normalize:
            pooled = F.normalize(pooled, dim=-1)
        return pooled

    def loss_embedding(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The query and label-pool vectors :meth:`forward` hands to ``pool_loss``: here :meth:`embed` (PRIME's
        are not normalised, UniDEC's are the pooled outputs its heads project)."""
        return self.embed(input_ids, attention_mask)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        label_input_ids: Optional[torch.Tensor] = None,
        label_attention_mask: Optional[torch.Tensor] = None,
        targets: Optional[torch.Tensor] = None,
        positive_index: Optional[torch.Tensor] = None,
        label_ids: Optional[torch.Tensor] = None,
        query_positive_ids: Optional[torch.Tensor] = None,
        **kwargs,
    ) -> "XMCModelOutput":
        r"""A dual encoder's training forward: the queries' (and the label pool's) :meth:`loss_embedding`, then the
        method's ``pool_loss`` (DEXML, PRIME, UniDEC; SiameseXML and MUFIN have their own).

        Args:
            input_ids / attention_mask: tokenised queries, ``(batch, seq)``.
            label_input_ids / label_attention_mask: tokenised label pool, ``(pool, seq)``.
            targets: boolean ``(batch, pool)``; True where a pool label is any positive of the query (all of them, not
                just a sampled one, so that false negatives are masked).
            positive_index: ``(batch,)`` pool position of each query's sampled positive (InfoNCE only).
            label_ids / query_positive_ids: pool label ids and each query's positives (``-1``-padded). When several
                processes train together, the pools of all processes are gathered (with gradients) and the targets
                rebuilt from these, so every query sees every process's labels as negatives.

        Returns:
            [`XMCModelOutput`] with ``loss`` (when ``targets`` is given), ``logits`` (batch x pool), ``query_embeds``,
            ``label_embeds`` and ``loss_terms``; without a label pool, ``query_embeds`` only.
        """
        query_embeds = self.loss_embedding(input_ids, attention_mask)
        if label_input_ids is None:
            return XMCModelOutput(query_embeds=query_embeds)
        label_embeds = self.loss_embedding(label_input_ids, label_attention_mask)
        loss, logits, terms = self.pool_loss(query_embeds, label_embeds, targets, positive_index, label_ids, query_positive_ids)
        return XMCModelOutput(loss=loss, logits=logits, query_embeds=query_embeds, label_embeds=label_embeds, loss_terms=terms or None)

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(
                "this model has no tokenizer: load it with from_pretrained(<dir with tokenizer files>) or set "
                "model.tokenizer = AutoTokenizer.from_pretrained(...)"
            )
        return self.tokenizer

    def tokenize(self, texts: Sequence[str], max_length: int) -> dict[str, torch.Tensor]:
        """Tokenise texts with padding to the longest one and truncation to ``max_length`` (long texts cut after
        ``max_length`` words first where that keeps the result: :func:`tokenize_texts`)."""
        with self.timed_stage("tokenise"):
            return tokenize_texts(self._require_tokenizer(), texts, max_length, padding=True, return_tensors="pt")

    @contextmanager
    def timed_stage(self, name: str):
        """Report the block's wall time as stage ``name`` (``tokenise``, ``encode``, ``search``, ``fuse``) to
        ``self.stage_observer(name, seconds)`` when one is set (a server's metrics); nothing otherwise."""
        observer = self.__dict__.get("stage_observer")
        if observer is None:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            observer(name, time.perf_counter() - start)

    @contextmanager
    def encoding_autocast(self, dtype: Optional[torch.dtype]):
        """Run :meth:`encode_texts` (every query / label encoding pass) under ``torch.autocast(dtype)`` inside the
        block; ``None`` leaves it in the weights' precision. The trainer uses it for the passes that only choose
        training examples (hard-negative mining, cluster batching's query embeddings), in bfloat16 where the hardware
        runs it natively (``XMCTrainingArguments.mining_precision``); the vectors come back in float32 either way."""
        previous = self.encoding_autocast_dtype
        self.encoding_autocast_dtype = dtype
        try:
            yield self
        finally:
            self.encoding_autocast_dtype = previous

    def encoding_autocast_context(self) -> torch.autocast:
        """``torch.autocast`` in :attr:`encoding_autocast_dtype` on the model's device (disabled when it is None): what
        every encoding forward runs under (:meth:`encode_texts`, the static encoder's token vectors)."""
        dtype = self.encoding_autocast_dtype
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    @torch.no_grad()
    def encode_texts(
        self,
        texts: Sequence[str],
        max_length: int,
        batch_size: int = 128,
        show_progress_bar: Optional[bool] = None,
        desc: str = "Encoding",
        normalize: Optional[bool] = None,
        dtype: Optional[torch.dtype] = None,
        **embed_kwargs,
    ) -> torch.Tensor:
        """Embed texts in eval mode, batch by batch (longest first to limit padding); returns ``(n, dim)`` on CPU, in
        ``dtype`` when given (each batch cast as it is written, e.g. float16 to halve a large result).

        Memory: the ``(n, dim)`` result (4 bytes per value in float32, 2 in float16) plus one batch; nothing per text
        is kept besides the sort order (8 bytes).

        ``normalize`` overrides ``config.normalize``; ``embed_kwargs`` go to :meth:`embed` (e.g. UniDEC's ``head``).
        """
        if len(texts) == 0:
            raise ValueError("encode_texts got no texts")
        was_training = self.training
        self.eval()
        order = np.argsort(np.fromiter((-len(t) for t in texts), dtype=np.int64, count=len(texts)), kind="stable")
        out: Optional[torch.Tensor] = None  # (n, dim), allocated once the first batch tells the width
        show = len(texts) > 10 * batch_size if show_progress_bar is None else show_progress_bar
        try:
            for start in tqdm(range(0, len(order), batch_size), desc=desc, disable=not show or progress_bar_disabled(), unit="batch"):
                idx = order[start : start + batch_size]
                batch = self.tokenize([texts[i] for i in idx], max_length)
                batch = {k: v.to(self.device) for k, v in batch.items()}
                with self.encoding_autocast_context():
                    emb = self.embed(batch["input_ids"], batch["attention_mask"], normalize=normalize, **embed_kwargs)
                emb = emb.float().cpu() if self.encoding_autocast_dtype is not None else emb.cpu()
                if out is None:
                    out = torch.empty(len(order), emb.shape[1], dtype=dtype or emb.dtype)
                out[torch.from_numpy(idx)] = emb.to(out.dtype)
        finally:
            self.train(was_training)
        return out

    def encode_queries(
        self, texts: Sequence[str], batch_size: int = 128, show_progress_bar: Optional[bool] = None, dtype: Optional[torch.dtype] = None,
        convert_to_numpy: bool = False, convert_to_tensor: Optional[bool] = None,
    ) -> torch.Tensor | np.ndarray:
        """Embed query texts (``max_seq_length`` tokens): a ``(n, dim)`` CPU tensor, or a numpy array with
        ``convert_to_numpy=True`` (sentence-transformers' ``encode`` returns numpy by default; here a tensor stays the
        default, as before; ``convert_to_tensor=True`` wins over ``convert_to_numpy``, as there). ``dtype`` as in
        :meth:`encode_texts`."""
        vectors = self.encode_texts(texts, self.config.max_seq_length, batch_size, show_progress_bar, desc="Encoding queries", dtype=dtype)
        return as_requested(vectors, convert_to_numpy, convert_to_tensor)

    def encode_labels(
        self,
        texts: Optional[Sequence[str]] = None,
        batch_size: int = 128,
        show_progress_bar: Optional[bool] = None,
        normalize: Optional[bool] = None,
        convert_to_numpy: bool = False,
        convert_to_tensor: Optional[bool] = None,
        **embed_kwargs,
    ) -> torch.Tensor | np.ndarray:
        """Embed label texts (``label_max_seq_length`` tokens); defaults to the model's own labels. A tensor, or a numpy
        array with ``convert_to_numpy=True``, as :meth:`encode_queries`."""
        texts = self._require_labels() if texts is None else texts
        vectors = self.encode_texts(
            texts, self.config.label_max_seq_length, batch_size, show_progress_bar, desc="Encoding labels", normalize=normalize, **embed_kwargs
        )
        return as_requested(vectors, convert_to_numpy, convert_to_tensor)

    # ------------------------------------------------------------------ label store and index
    @property
    def label_embeddings(self) -> Optional[torch.Tensor]:
        """``(num_labels, dim)`` label vectors searched by :meth:`predict` (float32, or float16 with
        ``config.label_embeddings_dtype="float16"``), or None. A sharded store loaded from disk is held as its
        memory-mapped shards (``label_embedding_blocks``, which search and save use as they are); reading this
        property joins them into one tensor, a copy, once."""
        blocks = self.label_embedding_blocks
        if blocks is not None and len(blocks) > 1:
            self.label_embedding_blocks = blocks = [torch.cat(blocks)]
        return None if blocks is None else blocks[0]

    @label_embeddings.setter
    def label_embeddings(self, value: Optional[torch.Tensor]) -> None:
        self.label_embedding_blocks = None if value is None else [value]

    def set_labels(self, texts: Sequence[str], uids: Optional[Sequence[str]] = None) -> None:
        """Attach the label space (texts in label-id order); drops any stale embeddings and index."""
        if uids is not None and len(uids) != len(texts):
            raise ValueError(f"got {len(texts)} label texts but {len(uids)} label uids")
        previous = self.label_texts
        self.label_texts = [str(t) for t in texts]
        self.label_uids = [str(u) for u in uids] if uids is not None else [str(i) for i in range(len(texts))]
        self.invalidate_label_index()
        if self.lexical_channel is not None and self.label_texts != previous:
            self.lexical_channel.replace_labels(self.label_texts)
        self._sync_lexical_channel_labels()

    def invalidate_label_index(self) -> None:
        """Forget label vectors and index (they no longer match the weights, e.g. after an optimiser step)."""
        self.label_embeddings = None
        self.label_index = None

    @property
    def label_index(self) -> Optional[LabelIndex]:
        """The search index over the label vectors, or None; setting it records the weights it was built with."""
        return self._label_index

    @label_index.setter
    def label_index(self, index: Optional[LabelIndex]) -> None:
        self._label_index = index
        self._label_index_weights = self.weights_fingerprint() if index is not None else None

    def label_index_is_current(self, label_texts: Optional[Sequence[str]] = None) -> bool:
        """Whether the label index exists, was built with the current weights and (given ``label_texts``) over these
        labels: the evaluator then searches it as it is instead of encoding the labels again."""
        if self._label_index is None or (label_texts is not None and list(label_texts) != self.label_texts):
            return False
        return not changed_inputs({"weights": self._label_index_weights}, {"weights": self.weights_fingerprint()})

    def _require_labels(self) -> list[str]:
        if not self.label_texts:
            raise ValueError("this model has no labels: call model.set_labels(texts) or build_label_index(label_texts)")
        return self.label_texts

    def label_search_vectors(self, batch_size: int = 128, show_progress_bar: Optional[bool] = None) -> torch.Tensor:
        """Vectors indexed for search, one per label (here: the label-text embeddings)."""
        return self.encode_labels(batch_size=batch_size, show_progress_bar=show_progress_bar)

    def query_search_vectors(self, texts: Sequence[str], batch_size: int = 128, show_progress_bar: Optional[bool] = None) -> torch.Tensor:
        """Vectors searched against the label index, one per query."""
        return self.encode_queries(texts, batch_size=batch_size, show_progress_bar=show_progress_bar)

    def build_label_index(
        self,
        label_texts: Optional[Sequence[str]] = None,
        label_uids: Optional[Sequence[str]] = None,
        kind: Optional[str] = None,
        batch_size: int = 128,
        show_progress_bar: Optional[bool] = None,
        cache_dir: Optional[str] = None,
    ) -> LabelIndex:
        """(Re-)encode the labels with the current weights and build the search index over them. ``cache_dir``: read
        the faiss index from there when it was built from these very vectors, else build it and save it there
        (:meth:`LabelIndex.cached`; a resumed run skips the build)."""
        if label_texts is not None:
            self.set_labels(label_texts, label_uids)
        self._require_labels()
        vectors = self.label_search_vectors(batch_size=batch_size, show_progress_bar=show_progress_bar)
        self.label_embeddings = vectors.to(getattr(torch, self.config.label_embeddings_dtype))
        self.label_index = LabelIndex.cached(self.label_embedding_blocks, cache_dir, **self.config.index_params(kind))
        return self.label_index

    @property
    def takes_images(self) -> bool:
        """Whether queries and labels may be images (MUFIN): such a model ranks through its own ``predict`` and takes no
        lexical channel."""
        return "image" in self.input_modalities

    @property
    def search_mode(self) -> Optional[str]:
        """The space or ranking ``predict`` uses (``config.search_mode``, one of :attr:`search_modes`); None for a method
        with one (DEXML)."""
        return self.config.search_mode if self.search_modes else None

    def set_search_mode(self, mode: str) -> None:
        """Switch ``predict`` to ``mode`` (one of :attr:`search_modes`); the label vectors are rebuilt on first use when
        they depend on it (:attr:`search_mode_changes_label_vectors`)."""
        if mode not in self.search_modes:
            raise ValueError(f"search mode must be one of {self.search_modes}, got {mode!r}")
        self._check_search_mode(mode)
        if mode != self.config.search_mode:
            self.config.search_mode = mode
            if self.search_mode_changes_label_vectors:
                self.invalidate_label_index()

    def _check_search_mode(self, mode: str) -> None:
        """Refuse a mode this model cannot search now (PRIME (W) or UniDEC without their classifiers); here none."""

    @contextmanager
    def using_search_mode(self, mode: Optional[str]):
        """Search ``mode`` for the duration of the block (hard-negative mining in :attr:`hard_negative_search_mode`),
        then restore the mode, label vectors and index; None changes nothing."""
        saved = (self.config.search_mode, self.label_embeddings, self.label_index) if mode is not None else None
        try:
            if mode is not None:
                self.config.search_mode = mode
            yield self
        finally:
            if saved is not None:
                self.config.search_mode, self.label_embeddings, self.label_index = saved

    def search(self, query_vectors: torch.Tensor | np.ndarray, k: int = 5) -> tuple[np.ndarray, np.ndarray]:
        """Top-k label ids and scores for precomputed query vectors (builds the index on first use)."""
        return self.ensure_label_index().search(query_vectors, k)

    def set_lexical_channel(self, channel: Optional[LexicalChannel]) -> None:
        """Attach a fitted lexical channel (``hf_xmc.training.lexical.fit_lexical_channel``) whose scores
        :meth:`predict` fuses with the dense ones, or ``None`` to rank by the dense score alone. ``config.lexical_channel``
        keeps its fusion settings; ``save_pretrained`` writes it as ``lexical_channel.safetensors``. A score calibration
        fitted on the previous ranking no longer applies: it is dropped with a warning on the next use."""
        if channel is not None:
            labels = self._require_labels()
            if channel.num_labels != len(labels):
                raise ValueError(f"the lexical channel scores {channel.num_labels} labels but the model has {len(labels)}")
            channel.label_source = self.labels_digest()
        self.lexical_channel = channel
        self.config.lexical_channel = dict(channel.settings) if channel is not None else None

    def search_texts(self, texts: Sequence[str], query_vectors: torch.Tensor | np.ndarray, k: int = 5, return_dense: bool = False):
        """Top-k ``(scores, ids)`` of queries given as texts and their search vectors: the dense search, fused with the
        lexical channel when the model has one (its ``dense_depth`` dense hits and its ranker's hits re-scored). With
        ``return_dense``, returns ``(scores, ids, dense_scores, dense_ids)``: the dense search's own top-k too (the
        same arrays as the fused ones for a model without a channel)."""
        channel = self.current_lexical_channel()
        if channel is None:
            with self.timed_stage("search"):
                scores, ids = self.search(query_vectors, k)
            return (scores, ids, scores, ids) if return_dense else (scores, ids)
        with self.timed_stage("search"):
            dense_scores, dense_ids = self.search(query_vectors, max(k, int(channel.settings["dense_depth"])))
        with self.timed_stage("fuse"):
            scores, ids = channel.fuse(texts, dense_scores, dense_ids, k)
        return (scores, ids, dense_scores[:, :k], dense_ids[:, :k]) if return_dense else (scores, ids)

    def ensure_label_index(self) -> LabelIndex:
        """The label index: built over the stored label vectors, or over freshly encoded labels, on first use."""
        if self.label_index is None:
            if self.label_embedding_blocks is not None:
                self.label_index = LabelIndex(self.label_embedding_blocks, **self.config.index_params())
            else:
                self.build_label_index()
        return self.label_index

    def predict(self, texts: Sequence[str] | str, k: Optional[int] = None, batch_size: int = 128, show_progress_bar: Optional[bool] = None,
                threshold: Optional[float] = None, backend: str = "torch", query_encoder: Optional[str] = None) -> XMCPrediction:
        """Rank the model's labels for each text and return the top ``k`` (ids, scores, label texts and, for a calibrated
        model, probabilities). ``threshold``: keep only the labels whose calibrated probability is at least it, among
        the top ``k`` (default 5, or :data:`THRESHOLD_DEPTH` with a threshold); slots left empty hold ``-1``. ``backend="onnx"``
        encodes the queries with the exported query encoder (:meth:`export_onnx`, ``onnx_encoder.py``).
        ``query_encoder``: ``"transformer"`` (the trained tower) or ``"static"`` (the fitted static encoder, with its own
        fusion weights and calibration: ``static_encoder.py``); None: the model's :attr:`query_encoder`."""
        if isinstance(texts, str):
            texts = [texts]
        with self.using_query_encoder(query_encoder):
            k = self._prediction_depth(k, threshold)
            self._require_labels()
            if len(texts) == 0:  # as pipeline([]) gives []: an empty prediction, not an error
                return self._prediction(np.zeros((0, k), dtype=np.int64), np.zeros((0, k), dtype=np.float32), threshold)
            scores, ids = self.rank(texts, k, batch_size=batch_size, show_progress_bar=show_progress_bar, backend=backend)
            return self._prediction(ids, scores, threshold)

    def rank(self, texts: Sequence[str], k: int, batch_size: int = 128, show_progress_bar: Optional[bool] = None, return_dense: bool = False,
             images: Optional[Sequence] = None, backend: str = "torch"):
        """The one ranking :meth:`predict` and the evaluator share: the top-``k`` ``(scores, ids)`` arrays of the
        queries (the dense search, fused with the lexical channel when the model has one); with ``return_dense``,
        ``(scores, ids, dense_scores, dense_ids)`` (:meth:`search_texts`). ``images``: for a model that takes them."""
        if images is not None:
            raise ValueError(f"{type(self).__name__} ranks texts only: it takes no images")
        with self.timed_stage("encode"):
            queries = self.query_vectors_with(backend, texts, batch_size=batch_size, show_progress_bar=show_progress_bar)
        return self.search_texts(texts, queries, k, return_dense=return_dense)

    def _prediction_depth(self, k: Optional[int], threshold: Optional[float]) -> int:
        """``k`` checked (a whole number >= 1), defaulted (5, or :data:`THRESHOLD_DEPTH` with a threshold), and the
        threshold checked (a finite probability, and a calibration to compare it with)."""
        if threshold is not None:
            if isinstance(threshold, bool) or not isinstance(threshold, (int, float, np.integer, np.floating)):
                raise ValueError(f"threshold is a probability in [0, 1], got {threshold!r}")
            if not 0.0 <= float(threshold) <= 1.0:  # NaN fails both comparisons
                raise ValueError(f"threshold is a probability in [0, 1], got {threshold}")
            if self.score_calibration is None:
                raise ValueError(
                    f"{type(self).__name__} has no score calibration, so its scores are no probabilities to threshold: train with a "
                    "validation split (--score_calibration isotonic) or fit one (hf_xmc.training.calibration.fit_score_calibration)"
                )
        if k is None:
            return THRESHOLD_DEPTH if threshold is not None else 5
        if isinstance(k, bool) or not hasattr(k, "__index__"):  # an int or numpy integer; 2.5 was cut to 2 silently
            raise ValueError(f"k must be a whole number >= 1, got {k!r}")
        k = int(k)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        return k

    def _prediction(self, ids: np.ndarray, scores: np.ndarray, threshold: Optional[float] = None) -> XMCPrediction:
        """An :class:`XMCPrediction` of ranked ``ids`` / ``scores``: label texts, calibrated probabilities, and with a
        ``threshold`` only the labels whose probability reaches it (the rest emptied: ``-1``, ``-inf``, ``""``, 0)."""
        labels = self._require_labels()
        calibration = self.score_calibration
        probabilities = None
        if calibration is not None:
            probabilities = np.where(ids >= 0, calibration(scores), 0.0).astype(np.float32)
            if threshold is not None:
                below = probabilities < np.float32(threshold)
                ids = np.where(below, -1, ids)
                scores = np.where(below, -np.inf, scores).astype(np.float32)
                probabilities = np.where(below, 0.0, probabilities).astype(np.float32)
        names = [[labels[i] if i >= 0 else "" for i in row] for row in ids.tolist()]
        return XMCPrediction(label_ids=ids, scores=scores, label_texts=names, probabilities=probabilities)

    # ------------------------------------------------------------------ what the model needs and came from (its card)
    def base_model_names(self) -> list[str]:
        """``name_or_path`` of every pretrained tower the model started from (here the text encoder; MUFIN adds its
        vision tower): the card's ``base_model``."""
        return [self.config.encoder_config.name_or_path]

    def runtime_requirements(self) -> dict[str, str]:
        """The pip requirements of loading and predicting with this model (no hf_xmc needed), each with why it is
        needed; ``""`` = always. The model card lists them."""
        requirements = {
            "torch": "",
            "transformers>=5.23,<6": "",
            "safetensors": "",
            "faiss-cpu": "the fastest label search (faiss-gpu on a GPU); without it search falls back to exact torch.topk",
        }
        if self.lexical_channel is not None and self.lexical_channel.ranker_files:
            requirements["omikuji"] = "the lexical channel's ranker; without it predict fuses the dense and label-text scores only"
        if self.has_encoder_adapter and (self.save_adapter_only or self.config.encoder_adapter_only):
            requirements["peft>=0.12"] = "the encoder is saved as an adapter: loading rebuilds it from its base encoder and the adapter"
        return requirements

    # ------------------------------------------------------------------ the query encoder as a sentence-transformers checkpoint
    def query_encoder_modules(self) -> list[dict]:
        """What turns the pooled encoder output into this model's query vector, as sentence-transformers modules (read
        by :meth:`save_query_encoder`): ``{"type": "Normalize"}`` and ``{"type": "Dense", "linear": nn.Linear,
        "activation": "torch.nn.modules.activation.Tanh"}`` entries, in order. A method whose query vector is not an
        encoder, a pooling and such layers raises ``NotImplementedError``."""
        return [{"type": "Normalize"}] if self.config.normalize else []

    def save_query_encoder(self, save_directory: str | os.PathLike) -> None:
        """Write the query side of the model (encoder, pooling and the layers of :meth:`query_encoder_modules`) as a
        sentence-transformers checkpoint: ``SentenceTransformer(save_directory).encode(texts)`` gives the vectors
        :meth:`encode_queries` gives (same tokenizer, ``max_seq_length``, pooling and normalisation). The layout is
        sentence-transformers 2-6's (``modules.json``, ``sentence_bert_config.json``, ``1_Pooling/``, ``2_Dense/``,
        ``N_Normalize/``); written to a temporary directory beside ``save_directory`` and renamed, so a failure leaves
        nothing half-written. Memory: one copy of the encoder weights on disk."""
        save_sentence_transformers_checkpoint(
            save_directory, self.encoder, self._require_tokenizer(), self.config.max_seq_length, self.config.pooling,
            self.query_encoder_modules(),
        )
