"""PRIME configuration."""

from __future__ import annotations

from typing import Optional

from .configuration_xmc import XMCConfig

CENTROID_UPDATES = ("ema", "frozen")
POSITIVE_SELECTIONS = ("sample_one", "all")


def default_num_free_vectors(num_labels: int) -> int:
    """About two labels per free vector, as a power of two, capped at 131,072 (paper Table 10: 65,536 for 131K labels,
    131,072 for 1.3M labels)."""
    if num_labels < 2:
        return 1
    return min(131072, 1 << ((num_labels // 2).bit_length() - 1))


PRIME_SEARCH_MODES = ("prototype", "classifier")


class PRIMEConfig(XMCConfig):
    r"""
    Configuration of [`PRIMEModel`], "Prototypical Extreme Multi-label Classification with a Dynamic Margin Loss"
    (Dahiya, Ortego, Jimenez, NAACL 2025). One shared encoder embeds queries and label texts; a query is scored
    against a label *prototype* built by the Label Prototype Network (one transformer encoder layer over the label
    text embedding, a free vector shared by a cluster of labels and the label's EMA centroid of training queries,
    mean-pooled). Defaults follow `shared/specs/prime.md` (the official code where the paper is silent).

    Args:
        label_space_size (`int`):
            Number of labels L (the centroid bank and label->free-vector map have one row per label).
        num_free_vectors (`int`, *optional*):
            Free vectors F, a power of two (0 = no free vectors, the Table 9 ablation). Default: about two labels per
            vector, capped at 131,072 (see `default_num_free_vectors`).
        lpn_num_heads (`int`, *optional*, defaults to 1), lpn_intermediate_size (`int`, *optional*, defaults to 1024),
        lpn_dropout (`float`, *optional*, defaults to 0.1):
            The prototype network's encoder layer (post-LN, GELU).
        normalize_lpn_inputs (`bool`, *optional*, defaults to `False`):
            Feed L2-normalised label embeddings to the prototype network (the paper's notation) instead of the raw
            mean-pooled ones (the official code).
        centroid_update (`str`, *optional*, defaults to `"ema"`):
            `"ema"`: after each step `c_l <- m c_l + (1 - m) mean(normalised h_q of the batch queries with label l)`
            (paper eq. 4); `"frozen"`: keep the initial centroids (what the released code effectively does).
        centroid_momentum (`float`, *optional*, defaults to 0.95):
            EMA momentum alpha.
        margin_min (`float`, *optional*, defaults to 0.1), margin_max (`float`, *optional*, defaults to 0.3):
            Clip range of the dynamic margin (`margin_min = 0` gives a fixed margin of `margin_max`).
        loss_num_negatives (`int`, *optional*, defaults to 100):
            Hardest in-pool negatives per anchor in every loss term.
        negative_temperature (`float`, *optional*, defaults to 0.1):
            Softmax temperature weighting the violating negatives (`None` or 1.0: unweighted sum).
        positive_selection (`str`, *optional*, defaults to `"sample_one"`):
            One sampled positive per anchor (official code) or `"all"` of them (paper eq. 1).
        paper_inverted_region (`bool`, *optional*, defaults to `False`):
            Use the paper's literal case table (inverted gradient for `0 < D < margin_min`); see
            `dynamic_margin_triplet`.
        query_to_label_weight / label_to_query_weight (`float`, *optional*, defaults to 1.0):
            Weights of the query->label-text and label-text->query triplet terms.
        regularizer_weight (`float`, *optional*, defaults to 0.1), regularizer_margin (`float`, *optional*, defaults to 0.1):
            lambda and m' of the regulariser R.
        sparse_label_gradients (`bool`, *optional*, defaults to `True`):
            Gather the pool's free vectors with sparse gradients: the bank's gradient holds only the rows the pool
            reads and [`XMCTrainer`] trains with `SparseAdamW` (lazy row-wise AdamW), so a step touches only those
            rows. `False`: a dense F x hidden gradient and a dense AdamW update of the whole bank. The same holds for
            the PRIME (W) classifier table.
        use_classifier (`bool`, *optional*, defaults to `False`):
            PRIME (W) (paper Sec. 4, spec Sec. 6.6): one one-vs-all classifier vector per label (``L x hidden``),
            trained after PRIME with the encoder and prototype network frozen, initialised from the normalised
            prototypes (see `PRIMEModel.add_classifier`).
        search_mode (`str`, *optional*, defaults to `"prototype"`):
            What `predict` searches: `"prototype"` (PRIME) or `"classifier"` (PRIME (W): the classifier vectors alone,
            not an ensemble, as the paper's Tables 4 and 8).
        classifier_margin (`float`, *optional*, defaults to 0.2), classifier_dropout (`float`, *optional*, defaults to 0.5):
            PRIME (W)'s fixed triplet margin and the dropout on the (cached) query embedding ([C]).
        kwargs: the shared fields of [`XMCConfig`] (encoder sub-config, pooling, index, ...). `normalize` must stay
            True: PRIME scores are cosines.
    """

    model_type = "hf_xmc_prime"

    label_space_size: int = 0
    num_free_vectors: Optional[int] = None
    lpn_num_heads: int = 1
    lpn_intermediate_size: int = 1024
    lpn_dropout: float = 0.1
    normalize_lpn_inputs: bool = False
    centroid_update: str = "ema"
    centroid_momentum: float = 0.95
    margin_min: float = 0.1
    margin_max: float = 0.3
    loss_num_negatives: int = 100
    negative_temperature: Optional[float] = 0.1
    positive_selection: str = "sample_one"
    paper_inverted_region: bool = False
    query_to_label_weight: float = 1.0
    label_to_query_weight: float = 1.0
    regularizer_weight: float = 0.1
    regularizer_margin: float = 0.1
    sparse_label_gradients: bool = True
    use_classifier: bool = False
    search_mode: str = "prototype"
    classifier_margin: float = 0.2
    classifier_dropout: float = 0.5

    def validate_xmc(self) -> None:
        super().validate_xmc()
        if self.label_space_size < 1:
            raise ValueError(f"label_space_size must be the number of labels (>= 1), got {self.label_space_size}")
        if self.num_free_vectors is not None and (self.num_free_vectors < 0 or self.num_free_vectors & (self.num_free_vectors - 1)):
            raise ValueError(f"num_free_vectors must be 0 or a power of two, got {self.num_free_vectors}")
        if not self.normalize:
            raise ValueError("PRIME scores are cosine similarities: normalize must be True")
        if self.centroid_update not in CENTROID_UPDATES:
            raise ValueError(f"centroid_update must be one of {CENTROID_UPDATES}, got {self.centroid_update!r}")
        if not 0.0 <= self.centroid_momentum <= 1.0:
            raise ValueError(f"centroid_momentum must be in [0, 1], got {self.centroid_momentum}")
        if not 0.0 <= self.margin_min <= self.margin_max:
            raise ValueError(f"need 0 <= margin_min <= margin_max, got {self.margin_min}, {self.margin_max}")
        if self.loss_num_negatives < 1:
            raise ValueError(f"loss_num_negatives must be >= 1, got {self.loss_num_negatives}")
        if self.negative_temperature is not None and self.negative_temperature <= 0:
            raise ValueError(f"negative_temperature must be positive or None, got {self.negative_temperature}")
        if self.positive_selection not in POSITIVE_SELECTIONS:
            raise ValueError(f"positive_selection must be one of {POSITIVE_SELECTIONS}, got {self.positive_selection!r}")
        if self.lpn_num_heads < 1 or self.lpn_intermediate_size < 1 or not 0.0 <= self.lpn_dropout < 1.0:
            raise ValueError("lpn_num_heads and lpn_intermediate_size must be >= 1 and lpn_dropout in [0, 1)")
        if self.search_mode not in PRIME_SEARCH_MODES:
            raise ValueError(f"search_mode must be one of {PRIME_SEARCH_MODES}, got {self.search_mode!r}")
        if self.search_mode == "classifier" and not self.use_classifier:
            raise ValueError("search_mode='classifier' needs use_classifier=True (the PRIME (W) classifier table)")
        if self.classifier_margin < 0 or not 0.0 <= self.classifier_dropout < 1.0:
            raise ValueError("classifier_margin must be >= 0 and classifier_dropout in [0, 1)")
