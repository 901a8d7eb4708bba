"""SiameseXML configuration."""

from __future__ import annotations

from .configuration_xmc import XMCConfig

SIAMESEXML_ENCODERS = ("transformer", "boe")
SIAMESEXML_SEARCH_MODES = ("fusion", "classifier", "shortlist", "label_text")
SIAMESEXML_FUSIONS = ("code", "paper")
SIAMESEXML_CLASSIFIER_NEGATIVES = ("threshold", "hardest", "all")
SIAMESEXML_CLASSIFIER_LOSSES = ("likelihood", "bce", "softmax")
SIAMESEXML_SIAMESE_LOSSES = ("likelihood", "softmax")


class SiameseXMLConfig(XMCConfig):
    r"""
    Configuration of [`SiameseXMLModel`], "SiameseXML: Siamese Networks meet Extreme Classifiers with 100M Labels"
    (Dahiya et al., ICML 2021). One shared encoder embeds queries and label texts (the *intermediate* embedding
    ``f_E(.)``, unit norm); a residual layer on the query side gives the *final* embedding ``E(x) = N(g(f_E(x)))``; every
    label has a classifier ``w_l = N(z~_l + eta_l)``, re-parameterised around its label-text vector ``z~_l``; a label's
    centroid ``v_l`` (the mean intermediate embedding of its training points) and ``z~_l`` form the shortlist index.
    Implementation spec: ``shared/specs/siamesexml.md``; [P] = paper, [C] = official code.

    Args:
        label_space_size (`int`):
            Number of labels L (one classifier, label-text vector and centroid per label).
        encoder_type (`str`, *optional*, defaults to `"transformer"`):
            `"transformer"`: any Hugging Face encoder (``encoder_config``), mean-pooled; `"boe"`: the paper's cheap encoder,
            a TF-IDF-weighted bag of token embeddings followed by GELU and L2 normalisation (vocabulary = the tokenizer's,
            IDF weights a saved buffer).
        boe_vocab_size (`int`, *optional*, defaults to 0):
            Rows of the bag-of-embeddings token table (the tokenizer's vocabulary size; only for `"boe"`).
        boe_embedding_dim (`int`, *optional*, defaults to 0):
            D of the bag-of-embeddings encoder (0 = the encoder config's hidden size; [C]: 300, 512 on 1.3M labels).
        residual_dropout (`float`, *optional*, defaults to 0.5):
            Dropout inside the residual block ``g(u) = u + Dropout(ReLU(r SN(W) u + b))`` ([C]: 0.5, spectral norm, ``W``
            initialised to the identity, ``r`` = 1).
        siamese_c / siamese_d (`float`, *optional*, defaults to 0.9 / 1.5):
            Constants of Module I's point likelihood ``p(+1, v) = c exp(d (v - 1))`` ([C]; the paper gives none).
        siamese_hard_negatives (`int`, *optional*, defaults to 1):
            kappa of Module I: hardest in-batch negatives kept per query row ([C] 1; [P] 1-5).
        siamese_loss (`str`, *optional*, defaults to `"softmax"`):
            Module I's loss: `"softmax"` (DEXML's decoupled softmax of ``siamese_scale x cos``, each positive against
            every in-batch negative) or `"likelihood"` ([P] Eq. 5 with ``siamese_c`` / ``siamese_d`` and
            ``siamese_hard_negatives``). The softmax is the default: at the same rate and budget the paper's loss trained a
            weaker encoder (Debtags, half an epoch: shortlist P@1 64.1 against 72.7; docs/benchmarks.md).
        siamese_scale (`float`, *optional*, defaults to 20.0):
            Logit scale of the `"softmax"` Module I loss (1 / temperature).
        siamese_centroid_weight (`float`, *optional*, defaults to 0.3):
            1 - beta of Eq. (6): weight of the centroid term (label-text term: 1 - it; [P] beta = 0.7).
        classifier_c / classifier_d (`float`, *optional*, defaults to 0.75 / 3.0):
            Constants of Module IV's point likelihood ([C]); each term is scaled by 1 / d.
        classifier_negatives (`str`, *optional*, defaults to `"all"`):
            Which shortlist negatives Module IV trains on: `"all"` (every one), `"hardest"` ([P]: the
            ``classifier_hard_negative_factor x |P_i|`` highest-scoring ones) or `"threshold"` ([C]: every one whose
            scaled loss is at least ``classifier_negative_threshold``). With the point likelihood, [P]'s rule beat [C]'s
            mask (the ~100 negatives above cosine 0.44 outweigh the few positives: fused P@1 72.0 vs 76.7 on Debtags with
            the bag of embeddings, 34.2 vs 42.9 on the contract's tiny task); with the default softmax every negative
            counts by how wrong it is, and all of them won (docs/benchmarks.md).
        classifier_negative_threshold (`float`, *optional*, defaults to 0.05):
            [C]'s mask: negatives with a scaled loss below it (cosine < ~0.439 at c = 0.75, d = 3) are ignored.
        classifier_hard_negative_factor (`int`, *optional*, defaults to 3):
            kappa of [P]'s Module IV (2-5): hardest negatives per positive.
        classifier_loss (`str`, *optional*, defaults to `"softmax"`):
            Module IV's loss over the kept slots: `"softmax"` (DEXML's decoupled softmax of ``classifier_scale x cos``
            over each point's positives and kept negatives), `"likelihood"` ([P] Eq. 5 with ``classifier_c`` /
            ``classifier_d``) or `"bce"` (binary cross-entropy of ``classifier_scale x cos``, the spec's alternative).
        classifier_scale (`float`, *optional*, defaults to 20.0):
            Logit scale of the `"bce"` and `"softmax"` losses (1 / temperature; DEXML's 0.05 temperature is 20).
        shortlist_size (`int`, *optional*, defaults to 500):
            Labels kept per query by the shortlist (|S|, [C]: 500); only these are scored at prediction.
        shortlist_per_source (`int`, *optional*, defaults to 300):
            Neighbours fetched per label representation ([C]: 300 from the label-text graph and 300 from the centroid
            graph): one index holds both, and ``2 x`` this many rows are fetched from it.
        fusion (`str`, *optional*, defaults to `"code"`):
            `"code"`: ``beta exp(5 (cos(w_l, E(x)) - 1)) + (1 - beta) sigmoid(sim_l)`` with the shortlist similarity
            ``sim_l = cos(f(x), z~_l) + cos(f(x), v_l)`` ([C] tools/evaluate.py, what the reported numbers use);
            `"paper"`: ``alpha w_l^T E(x) + (1 - alpha) (z~_l + v_l)^T E(x)`` ([P] Sec. 3.3).
        fusion_weight (`float`, *optional*, defaults to 0.5):
            beta (code fusion) or alpha (paper fusion): the classifier's share of the fused score.
        search_mode (`str`, *optional*, defaults to `"fusion"`):
            What `predict` ranks the shortlist by: `"fusion"`, `"classifier"` (``cos(w_l, E(x))``), `"shortlist"`
            (``sim_l``) or `"label_text"` (``cos(f(x), z~_l)`` alone: the Module-I siamese model).
        sparse_label_gradients (`bool`, *optional*, defaults to `True`):
            Gather the rows of the refinement vectors ``eta`` with sparse gradients (trained row-wise by `SparseAdamW`),
            and the bag-of-embeddings token table likewise: memory per label = weights + moments of ``eta``.
        kwargs: the shared fields of [`XMCConfig`] (encoder sub-config, pooling, index, ...).
    """

    model_type = "hf_xmc_siamesexml"

    label_space_size: int = 0
    encoder_type: str = "transformer"
    boe_vocab_size: int = 0
    boe_embedding_dim: int = 0
    residual_dropout: float = 0.5
    siamese_c: float = 0.9
    siamese_d: float = 1.5
    siamese_hard_negatives: int = 1
    siamese_loss: str = "softmax"
    siamese_scale: float = 20.0
    siamese_centroid_weight: float = 0.3
    classifier_c: float = 0.75
    classifier_d: float = 3.0
    classifier_negatives: str = "all"
    classifier_negative_threshold: float = 0.05
    classifier_hard_negative_factor: int = 3
    classifier_loss: str = "softmax"
    classifier_scale: float = 20.0
    shortlist_size: int = 500
    shortlist_per_source: int = 300
    fusion: str = "code"
    fusion_weight: float = 0.5
    search_mode: str = "fusion"
    sparse_label_gradients: bool = True

    @property
    def embedding_dim(self) -> int:
        """D: the size of every embedding, label-text vector, centroid and classifier."""
        if self.encoder_type == "boe" and self.boe_embedding_dim:
            return self.boe_embedding_dim
        return self.encoder_config.hidden_size

    def sequence_length_fault(self) -> str | None:
        """As :meth:`XMCConfig.sequence_length_fault`; a bag of embeddings has no positions to run out of."""
        if self.encoder_type == "boe":
            return None
        return super().sequence_length_fault()

    def validate_xmc(self) -> None:
        super().validate_xmc()
        if self.label_space_size < 1:
            raise ValueError(f"label_space_size must be >= 1, got {self.label_space_size}")
        if self.encoder_type not in SIAMESEXML_ENCODERS:
            raise ValueError(f"encoder_type must be one of {SIAMESEXML_ENCODERS}, got {self.encoder_type!r}")
        if self.encoder_type == "boe" and self.boe_vocab_size < 1:
            raise ValueError(f"encoder_type='boe' needs boe_vocab_size >= 1 (the tokenizer's vocabulary), got {self.boe_vocab_size}")
        if self.boe_embedding_dim < 0:
            raise ValueError(f"boe_embedding_dim must be >= 0, got {self.boe_embedding_dim}")
        if not 0.0 <= self.residual_dropout < 1.0:
            raise ValueError(f"residual_dropout must be in [0, 1), got {self.residual_dropout}")
        for name in ("siamese_c", "classifier_c"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in (0, 1), got {getattr(self, name)}")
        for name in ("siamese_d", "classifier_d"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("siamese_hard_negatives", "classifier_hard_negative_factor", "shortlist_size", "shortlist_per_source"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.siamese_centroid_weight <= 1.0 or not 0.0 <= self.fusion_weight <= 1.0:
            raise ValueError("siamese_centroid_weight and fusion_weight must be in [0, 1]")
        if self.classifier_negatives not in SIAMESEXML_CLASSIFIER_NEGATIVES:
            raise ValueError(f"classifier_negatives must be one of {SIAMESEXML_CLASSIFIER_NEGATIVES}, got {self.classifier_negatives!r}")
        if self.siamese_loss not in SIAMESEXML_SIAMESE_LOSSES:
            raise ValueError(f"siamese_loss must be one of {SIAMESEXML_SIAMESE_LOSSES}, got {self.siamese_loss!r}")
        if self.classifier_loss not in SIAMESEXML_CLASSIFIER_LOSSES:
            raise ValueError(f"classifier_loss must be one of {SIAMESEXML_CLASSIFIER_LOSSES}, got {self.classifier_loss!r}")
        if self.classifier_scale <= 0 or self.siamese_scale <= 0:
            raise ValueError(f"classifier_scale and siamese_scale must be positive, got {self.classifier_scale}, {self.siamese_scale}")
        if self.classifier_negative_threshold < 0:
            raise ValueError(f"classifier_negative_threshold must be >= 0, got {self.classifier_negative_threshold}")
        if self.fusion not in SIAMESEXML_FUSIONS:
            raise ValueError(f"fusion must be one of {SIAMESEXML_FUSIONS}, got {self.fusion!r}")
        if self.search_mode not in SIAMESEXML_SEARCH_MODES:
            raise ValueError(f"search_mode must be one of {SIAMESEXML_SEARCH_MODES}, got {self.search_mode!r}")
