"""DEXML configuration."""

from __future__ import annotations

from .configuration_xmc import XMCConfig

DEXML_LOSSES = ("decoupled_softmax", "softmax", "infonce", "bce", "soft_topk")


class DEXMLConfig(XMCConfig):
    r"""
    Configuration of [`DEXMLModel`], the pure dual encoder of "Efficacy of Dual-Encoders for Extreme Multi-Label
    Classification" (Gupta et al., ICLR 2024). Queries and label texts share one encoder; score = inner
    product of the (normalised) embeddings; no per-label parameters.

    Args:
        temperature (`float`, *optional*, defaults to 0.05):
            Logits are `score / temperature`. The paper pairs 0.05 with normalised embeddings (EURLex-4K,
            LF-AmazonTitles-131K) and 1.0 with raw dot products (LF-Wikipedia-500K, LF-AmazonTitles-1.3M).
        loss (`str`, *optional*, defaults to `"decoupled_softmax"`):
            `"decoupled_softmax"` (paper eq. 5), `"softmax"` (eq. 3), `"infonce"` (eq. 4, one sampled positive),
            `"bce"` (eq. 2) or `"soft_topk"` (eq. 6).
        topk_k (`int`, *optional*, defaults to 5):
            k of the SoftTop-k loss ("SoftTop-5" in the paper's main tables).
        topk_alpha (`float`, *optional*, defaults to 2.0):
            Sigmoid slope of SoftTop-k (paper Table 7: 2 on every dataset).
        topk_n_iter (`int`, *optional*, defaults to 32):
            Bisection steps for the SoftTop-k threshold (reference code default).
        kwargs: the shared fields of [`XMCConfig`] (encoder sub-config, pooling, normalize, index, ...).
    """

    model_type = "hf_xmc_dexml"

    temperature: float = 0.05
    loss: str = "decoupled_softmax"
    topk_k: int = 5
    topk_alpha: float = 2.0
    topk_n_iter: int = 32

    def validate_xmc(self) -> None:
        super().validate_xmc()
        if self.loss not in DEXML_LOSSES:
            raise ValueError(f"loss must be one of {DEXML_LOSSES}, got {self.loss!r}")
        if self.topk_k < 1 or self.topk_alpha <= 0 or self.topk_n_iter < 1:
            raise ValueError(f"SoftTop-k needs topk_k >= 1, topk_alpha > 0, topk_n_iter >= 1; got {self.topk_k}, {self.topk_alpha}, {self.topk_n_iter}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
