"""hf_xmc: extreme multi-label classification methods as Hugging Face models."""

__version__ = "0.1.0"

from .models import (  # noqa: E402  (registers the Auto classes on import)
    DEXMLConfig,
    DEXMLModel,
    LabelIndex,
    PRIMEConfig,
    PRIMEModel,
    UniDECConfig,
    UniDECModel,
    XMCPrediction,
)

__all__ = ["DEXMLConfig", "DEXMLModel", "LabelIndex", "PRIMEConfig", "PRIMEModel", "UniDECConfig", "UniDECModel", "XMCPrediction", "__version__"]
