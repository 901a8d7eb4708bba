"""Training machinery shared by every method: trainer, arguments, collator, evaluator, samplers, hard-negative
mining, gradient caching and the per-label state (free-vector map, centroids) PRIME derives from the data."""

from .clustering import balanced_2means_tree
from .collator import LabelTokens, PSLDataCollator, XMCDataCollator, XMCTrainDataset, tokenize_labels
from .evaluation import XMCEvaluator
from .gradcache import CachedLossOutput, RandContext, cached_loss
from .label_state import free_vector_assignment, initialize_label_state, label_centroids
from .negatives import mine_hard_negatives
from .optim import SparseAdamW
from .samplers import ClusterBatchSampler, EmbeddingMemoryBank
from .trainer import XMCEpochCallback, XMCTrainer, XMCTrainingArguments

__all__ = [
    "CachedLossOutput",
    "ClusterBatchSampler",
    "EmbeddingMemoryBank",
    "LabelTokens",
    "PSLDataCollator",
    "RandContext",
    "SparseAdamW",
    "XMCDataCollator",
    "XMCEpochCallback",
    "XMCEvaluator",
    "XMCTrainDataset",
    "XMCTrainer",
    "XMCTrainingArguments",
    "balanced_2means_tree",
    "cached_loss",
    "free_vector_assignment",
    "initialize_label_state",
    "label_centroids",
    "mine_hard_negatives",
    "tokenize_labels",
]
