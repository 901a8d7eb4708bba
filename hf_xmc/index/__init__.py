"""Label index: exact and approximate inner-product search over label vectors.

The implementation lives in ``hf_xmc/models/label_index.py`` because it ships with every model as remote
code; this package re-exports it for library users.
"""

from ..models.label_index import INDEX_KINDS, LabelIndex, faiss_available, faiss_gpu_available

__all__ = ["INDEX_KINDS", "LabelIndex", "faiss_available", "faiss_gpu_available"]
