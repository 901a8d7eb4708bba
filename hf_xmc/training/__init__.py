"""Training machinery shared by every method: trainer, arguments, collator and evaluator."""

from .collator import XMCDataCollator, XMCTrainDataset
from .evaluation import XMCEvaluator
from .trainer import XMCTrainer, XMCTrainingArguments

__all__ = ["XMCDataCollator", "XMCEvaluator", "XMCTrainDataset", "XMCTrainer", "XMCTrainingArguments"]
