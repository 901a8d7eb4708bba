"""UniDEC configuration."""

from __future__ import annotations

from typing import Optional

from .configuration_xmc import XMCConfig

UNIDEC_LOSSES = ("decoupled_softmax", "softmax")
UNIDEC_SEARCH_MODES = ("concat", "de", "classifier")
UNIDEC_CLASSIFIER_INITS = ("label_text", "xavier")


class UniDECConfig(XMCConfig):
    r"""
    Configuration of [`UniDECModel`], "UniDEC: Unified Dual Encoder and Classifier Training for Extreme Multi-Label
    Classification" (Kharbanda et al., WWW 2025). One shared encoder, two heads: the dual-encoder (DE) head
    ``N(g1(Phi(.)))`` for queries and label texts, and the classifier (CLF) head ``g2(Phi(.))`` scored against one
    learnable vector per label (``Psi``). Both heads are trained with the same multi-class loss over a
    pick-some-labels (PSL) label pool; inference searches the concatenated ``[DE ; normalised CLF]`` vectors.

    Args:
        label_space_size (`int`):
            Number of labels L: the classifier has one vector per label.
        projection_dim (`int`, *optional*, defaults to 384):
            Output size d of each head (paper: 384 per head, 256 on LF-AmazonTitles-1.3M).
        head_dropout (`float`, *optional*, defaults to 0.1):
            Dropout at the end of both heads (paper Sec. 4.3).
        use_classifier (`bool`, *optional*, defaults to `True`):
            `False` builds DePSL, the DE-only model (no g2, no Psi; loss = DE loss; search = DE).
        de_loss / clf_loss (`str`, *optional*, defaults to `"decoupled_softmax"`):
            Multi-class loss of each head: `"decoupled_softmax"` (DEXML's, the paper's best) or `"softmax"`
            (SupCon: other positives stay in the denominator).
        clf_bce_weight (`float`, *optional*, defaults to 1.0):
            Weight of the auxiliary binary cross-entropy on the (un-scaled) classifier scores over the pool (the
            headline configuration "CLF loss: Decoupled Softmax + BCE"; 0 turns it off).
        logit_scale_init (`float`, *optional*, defaults to 18.0):
            Initial value of the learnable scale multiplying the scores of each head in the multi-class losses
            (official code: a learnable multiplier initialised at 18; the equivalent temperature is 1/18).
        learnable_logit_scale (`bool`, *optional*, defaults to `True`):
            Train the two scales (one per head) or keep them fixed.
        de_query_to_label_weight / clf_query_to_label_weight (`float`, *optional*, defaults to 0.5):
            lambda_D / lambda_C: weight of the query->label term; the label->query (symmetric) term gets 1 - it.
        de_weight (`float`, *optional*, defaults to 0.5):
            lambda: total loss = lambda * L_DE + (1 - lambda) * L_CLF (1.0 when `use_classifier=False`).
        search_mode (`str`, *optional*, defaults to `"concat"`):
            What `predict` searches: `"concat"` (score = DE cosine + classifier cosine, the paper's default), `"de"`
            (DE head only) or `"classifier"` (normalised classifier vectors only). A model without classifier always
            searches `"de"`.
        classifier_init (`str`, *optional*, defaults to `"xavier"`):
            Starting classifier vectors: `"xavier"` (the official code's random init; better on both real datasets
            measured here) or `"label_text"`, which sets ``Psi_l = N(g2(Phi(z_l)))`` from the initial encoder before
            the first step (spec option B: the classifier starts out as a dual encoder; far better when training is
            only a few dozen steps).
        head_learning_rate_multiplier (`float`, *optional*, defaults to 2.0):
            Learning rate of g1/g2 relative to the encoder's (paper: 2e-4 vs 1e-4).
        classifier_learning_rate (`float`, *optional*, defaults to 1e-3):
            Absolute learning rate of Psi (paper: 1e-3). `None` uses the encoder's.
        sparse_label_gradients (`bool`, *optional*, defaults to `True`):
            Gather the pool's rows of Psi with sparse gradients: `Psi.grad` holds only the pool's rows and
            [`XMCTrainer`] trains with `SparseAdamW` (lazy row-wise AdamW), so training memory per label is weights +
            moments (12 d bytes in fp32) and a step touches only the pool's rows. `False`: a dense L x d gradient
            and a dense AdamW update of every row (16 d bytes per label).
        kwargs: the shared fields of [`XMCConfig`] (encoder sub-config, pooling, index, ...).
    """

    model_type = "hf_xmc_unidec"

    label_space_size: int = 0
    projection_dim: int = 384
    head_dropout: float = 0.1
    use_classifier: bool = True
    de_loss: str = "decoupled_softmax"
    clf_loss: str = "decoupled_softmax"
    clf_bce_weight: float = 1.0
    logit_scale_init: float = 18.0
    learnable_logit_scale: bool = True
    de_query_to_label_weight: float = 0.5
    clf_query_to_label_weight: float = 0.5
    de_weight: float = 0.5
    search_mode: str = "concat"
    classifier_init: str = "xavier"
    head_learning_rate_multiplier: float = 2.0
    classifier_learning_rate: Optional[float] = 1e-3
    sparse_label_gradients: bool = True

    def validate_xmc(self) -> None:
        super().validate_xmc()
        if self.use_classifier and self.label_space_size < 1:
            raise ValueError(f"label_space_size must be >= 1 for the classifier head, got {self.label_space_size}")
        if self.projection_dim < 1:
            raise ValueError(f"projection_dim must be >= 1, got {self.projection_dim}")
        if not 0.0 <= self.head_dropout < 1.0:
            raise ValueError(f"head_dropout must be in [0, 1), got {self.head_dropout}")
        for name in ("de_loss", "clf_loss"):
            if getattr(self, name) not in UNIDEC_LOSSES:
                raise ValueError(f"{name} must be one of {UNIDEC_LOSSES}, got {getattr(self, name)!r}")
        if self.search_mode not in UNIDEC_SEARCH_MODES:
            raise ValueError(f"search_mode must be one of {UNIDEC_SEARCH_MODES}, got {self.search_mode!r}")
        if self.classifier_init not in UNIDEC_CLASSIFIER_INITS:
            raise ValueError(f"classifier_init must be one of {UNIDEC_CLASSIFIER_INITS}, got {self.classifier_init!r}")
        for name in ("de_query_to_label_weight", "clf_query_to_label_weight", "de_weight"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.logit_scale_init <= 0 or self.clf_bce_weight < 0 or self.head_learning_rate_multiplier <= 0:
            raise ValueError("logit_scale_init and head_learning_rate_multiplier must be positive and clf_bce_weight >= 0")
        if self.classifier_learning_rate is not None and self.classifier_learning_rate <= 0:
            raise ValueError(f"classifier_learning_rate must be positive, got {self.classifier_learning_rate}")
