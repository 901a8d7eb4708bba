"""Shared configuration fields of the hf_xmc models (encoder sub-config, pooling, label index)."""

from __future__ import annotations

from transformers import AutoConfig, PreTrainedConfig
from transformers.configuration_utils import SubConfigSpec

POOLING_MODES = ("mean", "cls")
LABEL_EMBEDDINGS_DTYPES = ("float32", "float16")


class XMCConfig(PreTrainedConfig):
    r"""
    Base configuration of an hf_xmc model: a text encoder (any Hugging Face ``AutoModel`` backbone, kept as a
    sub-config) that embeds queries and label texts, plus the label-index settings used at prediction time.
    Method configurations (e.g. [`DEXMLConfig`]) add their own loss and training fields.

    Args:
        encoder_config (`PreTrainedConfig` or `dict`, *optional*):
            Configuration of the text encoder. Defaults to a BERT config.
        pooling (`str`, *optional*, defaults to `"mean"`):
            How token states become one vector: `"mean"` (attention-masked mean) or `"cls"` (first token).
        normalize (`bool`, *optional*, defaults to `True`):
            L2-normalise embeddings, so scores are cosine similarities.
        embedding_dropout (`float`, *optional*, defaults to 0.0):
            Dropout applied to pooled embeddings during training.
        max_seq_length (`int`, *optional*, defaults to 32):
            Token budget of a query text.
        label_max_seq_length (`int`, *optional*, defaults to 32):
            Token budget of a label text.
        index_kind (`str`, *optional*, defaults to `"exact"`):
            Label index used by `predict`: `"exact"` (chunked exact search over the label vectors; a faiss flat index
            on GPU), `"hnsw"` (faiss HNSW), `"ivf"` (faiss inverted lists) or `"torch"` (chunked exact search in torch,
            also the fallback without faiss). See `label_index.py` for the memory each one costs.
        ivf_nprobe (`int`, *optional*, defaults to 64):
            Inverted lists scanned per query by an `"ivf"` index built from this config (more: higher recall, slower;
            at 1.3M labels recall@100 is about 0.90 / 0.96 / 0.99 at 16 / 64 / 256). A loaded index keeps the value
            saved in its `label_index.json`; `model.label_index.ivf_nprobe` changes it at search time.
        label_embeddings_dtype (`str`, *optional*, defaults to `"float32"`):
            Precision of the saved label vectors, on disk and in memory: `"float32"` or `"float16"` (half the bytes;
            search widens fp16 vectors to fp32 one chunk at a time, the faiss indexes store fp16 codes).
        label_codes (`str`, *optional*, defaults to `"float"`):
            What the label index scans: `"float"` (the label vectors), `"int8"` (a byte per dimension) or `"binary"`
            (a bit per dimension, the dimension a multiple of 8); the coded kinds rescore their best candidates exactly
            from the label vectors, which stay on disk (`label_codes.py`). `save_pretrained(label_precision=)` sets it.
        propensity_a / propensity_b (`float`, *optional*):
            Constants of the inverse-propensity model used for PSP@k (pyxclib: 0.55/1.5 by default,
            0.6/2.6 Amazon, 0.5/0.4 Wikipedia).
        encoder_base_model (`str`, *optional*):
            The pretrained encoder the model started from (Hub id or path); set by `from_encoder_pretrained`.
        encoder_adapter (`dict`, *optional*):
            A peft adapter config (its `to_dict()`) that wraps the encoder (`add_encoder_adapter`); None for a plain
            encoder, as after a merged save.
        encoder_adapter_only (`bool`, *optional*, defaults to `False`):
            The saved weights hold the encoder's adapter (`adapter_model.safetensors`), not the encoder: loading
            rebuilds it from `encoder_base_model` plus the adapter (needs peft).
        lexical_channel (`dict`, *optional*):
            Fusion settings of the model's lexical channel (`ranker_weight`, `text_weight`, `dense_depth`, `ranker_depth`,
            `beam_size`; see `lexical_channel.py`), whose TF-IDF vocabulary, label rows and ranker are saved in
            `lexical_channel.safetensors`; None for a dense-only model.
        score_calibration (`dict`, *optional*):
            The map from predict's scores to probabilities of relevance, fitted on validation queries
            (`calibration.py`: `method` isotonic with breakpoints `x`/`y`, or platt with `a`/`b`); None: uncalibrated,
            `predict(threshold=)` refused.
        validation (`dict`, *optional*):
            The validation split the run tuned on (source, number of queries, seed, a fingerprint of their uids).
    """

    model_type = "hf_xmc"
    sub_configs_defaults = {"encoder_config": SubConfigSpec(config_class=AutoConfig, model_type="bert")}

    encoder_config: PreTrainedConfig | dict | None = None
    pooling: str = "mean"
    normalize: bool = True
    embedding_dropout: float = 0.0
    max_seq_length: int = 32
    label_max_seq_length: int = 32
    index_kind: str = "exact"
    ivf_nprobe: int = 64
    label_embeddings_dtype: str = "float32"
    label_codes: str = "float"
    propensity_a: float = 0.55
    propensity_b: float = 1.5
    encoder_base_model: str | None = None
    encoder_adapter: dict | None = None
    encoder_adapter_only: bool = False
    lexical_channel: dict | None = None
    score_calibration: dict | None = None
    validation: dict | None = None

    def validate_xmc(self) -> None:
        """Raise a ValueError naming the first invalid field."""
        if self.pooling not in POOLING_MODES:
            raise ValueError(f"pooling must be one of {POOLING_MODES}, got {self.pooling!r}")
        from .label_index import INDEX_KINDS  # here, not at the top: loading a config needs no torch

        if self.index_kind not in INDEX_KINDS:
            raise ValueError(f"index_kind must be one of {INDEX_KINDS}, got {self.index_kind!r}")
        if self.ivf_nprobe < 1:
            raise ValueError(f"ivf_nprobe must be >= 1, got {self.ivf_nprobe}")
        if self.label_embeddings_dtype not in LABEL_EMBEDDINGS_DTYPES:
            raise ValueError(f"label_embeddings_dtype must be one of {LABEL_EMBEDDINGS_DTYPES}, got {self.label_embeddings_dtype!r}")
        from .label_codes import LABEL_CODES

        if self.label_codes not in LABEL_CODES:
            raise ValueError(f"label_codes must be one of {LABEL_CODES}, got {self.label_codes!r}")
        if not 0.0 <= self.embedding_dropout < 1.0:
            raise ValueError(f"embedding_dropout must be in [0, 1), got {self.embedding_dropout}")

    def index_params(self, kind: str | None = None) -> dict:
        """The :class:`LabelIndex` arguments this config asks for (``kind`` overrides ``index_kind``)."""
        return {"kind": kind or self.index_kind, "ivf_nprobe": self.ivf_nprobe, "codes": self.label_codes}

    def sequence_length_fault(self) -> str | None:
        """Why ``max_seq_length`` / ``label_max_seq_length`` cannot run on the encoder (more tokens than its position
        embeddings: an index error at the first long text), or None. Checked when a saved model loads."""
        encoder = self.encoder_config
        positions = encoder.get("max_position_embeddings") if isinstance(encoder, dict) else getattr(encoder, "max_position_embeddings", None)
        for name in ("max_seq_length", "label_max_seq_length"):
            value = getattr(self, name, None)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                return f"{name} must be a positive integer, got {value!r}"
            if isinstance(positions, int) and value > positions:
                return f"{name} is {value} but the encoder has {positions} positions (max_position_embeddings)"
        return None
