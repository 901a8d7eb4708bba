"""XMCTrainer: a ``transformers.Trainer`` for XMC models with label pools and index-based evaluation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import scipy.sparse as sp
import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import SaveStrategy

from ..data import XMCDataset
from .collator import XMCDataCollator, XMCTrainDataset
from .evaluation import XMCEvaluator


@dataclass
class XMCTrainingArguments(TrainingArguments):
    """``TrainingArguments`` with defaults that suit XMC training.

    Differences from transformers: no external loggers by default, raw collator columns kept, 10% linear
    warm-up, weight decay 0.01 (DEXML), a checkpoint per epoch (last two kept), and CPU training whenever no
    GPU is visible (so ``accelerate launch --num_processes 2`` joins processes over gloo on CPU machines).
    """

    report_to: None | str | list[str] = field(default="none", metadata={"help": "Integrations to report to ('none' by default)."})
    remove_unused_columns: bool = field(default=False, metadata={"help": "Keep the collator's columns (must stay False)."})
    warmup_steps: float = field(default=0.1, metadata={"help": "Warm-up: steps, or a fraction of training if < 1."})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay."})
    save_strategy: SaveStrategy | str = field(default="epoch", metadata={"help": "Checkpoint strategy: 'no', 'epoch' or 'steps'."})
    save_total_limit: Optional[int] = field(default=2, metadata={"help": "Checkpoints kept."})
    logging_steps: float = field(default=50, metadata={"help": "Log every N steps."})

    def __post_init__(self):
        if not _accelerator_present():
            self.use_cpu = True
        super().__post_init__()


def _accelerator_present() -> bool:
    """True when torch sees a CUDA or MPS device."""
    return torch.cuda.is_available() or (getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available())


class XMCTrainer(Trainer):
    """Trainer for hf_xmc models.

    It plugs an XMC collator (query batch + label pool + targets) into the stock training loop and replaces
    ``evaluate`` by an :class:`XMCEvaluator` that searches the label index and reports P@k, nDCG@k, PSP@k and
    R@k. Everything else (optimiser, schedule, checkpoints, resume, logging, Accelerate) is transformers'.

    Args:
        model: an hf_xmc model with a tokenizer.
        args: :class:`XMCTrainingArguments` (or plain ``TrainingArguments`` with ``remove_unused_columns=False``).
        train_dataset: training queries and targets.
        label_texts / label_uids: the label space.
        evaluator: an :class:`XMCEvaluator` used by ``evaluate`` (optional).
        data_collator: defaults to :class:`XMCDataCollator` over the training set.
    """

    def __init__(
        self,
        model=None,
        args: Optional[TrainingArguments] = None,
        train_dataset: Optional[XMCDataset] = None,
        label_texts: Optional[Sequence[str]] = None,
        label_uids: Optional[Sequence[str]] = None,
        evaluator: Optional[XMCEvaluator] = None,
        data_collator=None,
        **kwargs,
    ):
        if args is not None and args.remove_unused_columns:
            raise ValueError("XMCTrainer needs TrainingArguments(remove_unused_columns=False): the collator reads raw columns")
        if label_texts is not None:
            model.set_labels(label_texts, label_uids)
        if data_collator is None and train_dataset is not None:
            data_collator = XMCDataCollator(
                tokenizer=model._require_tokenizer(),
                texts=train_dataset.texts,
                targets=sp.csr_matrix(train_dataset.targets),
                label_texts=model._require_labels(),
                max_seq_length=model.config.max_seq_length,
                label_max_seq_length=model.config.label_max_seq_length,
                seed=args.seed if args is not None else 0,
            )
        super().__init__(
            model=model,
            args=args,
            train_dataset=XMCTrainDataset(train_dataset) if train_dataset is not None else None,
            data_collator=data_collator,
            processing_class=model.tokenizer,
            **kwargs,
        )
        self.evaluator = evaluator

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The model's own pool loss (``forward`` with ``targets``)."""
        # the weights are about to change: label vectors computed before would be stale in a checkpoint
        self.model.invalidate_label_index()
        outputs = model(**inputs)
        if outputs.loss is None:
            raise ValueError("the model returned no loss: the batch must carry 'targets'")
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Run the :class:`XMCEvaluator` with the current weights; logs and returns ``<prefix>_<metric>`` values."""
        if self.evaluator is None:
            raise ValueError("XMCTrainer.evaluate needs an evaluator: XMCTrainer(..., evaluator=XMCEvaluator(test_set, ...))")
        was_training = self.model.training
        metrics = self.evaluator(self.model, show_progress_bar=not self.args.disable_tqdm)
        self.model.train(was_training)
        if metric_key_prefix != self.evaluator.name:
            metrics = {metric_key_prefix + key[len(self.evaluator.name):]: value for key, value in metrics.items()}
        metrics["epoch"] = self.state.epoch if self.state.epoch is not None else 0.0
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics
