"""DEXML configuration."""

from __future__ import annotations

from .configuration_xmc import XMCConfig

DEXML_LOSSES = ("decoupled_softmax", "softmax", "infonce", "bce")


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
            `"decoupled_softmax"` (paper eq. 5), `"softmax"` (eq. 3), `"infonce"` (eq. 4, one sampled positive)
            or `"bce"` (eq. 2).
        kwargs: the shared fields of [`XMCConfig`] (encoder sub-config, pooling, normalize, index, ...).
    """

    model_type = "hf_xmc_dexml"

    temperature: float = 0.05
    loss: str = "decoupled_softmax"

    def validate_xmc(self) -> None:
        super().validate_xmc()
        if self.loss not in DEXML_LOSSES:
            raise ValueError(f"loss must be one of {DEXML_LOSSES}, got {self.loss!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
