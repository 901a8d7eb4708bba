"""XMCTrainer: a ``transformers.Trainer`` for XMC models with label pools and index-based evaluation."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerState, TrainingArguments
from transformers.trainer_utils import SaveStrategy, TrainOutput

from ..data import XMCDataset
from ..metrics import inverse_propensity
from ..models.io_utils import progress_bar_disabled
from ..models.static_encoder import FIT_OBJECTIVE_CHOICES as STATIC_FIT_OBJECTIVES
from .callbacks import XMCEpochCallback
from .collator import (
    LabelTokens,
    PSLDataCollator,
    XMCDataCollator,
    XMCTrainDataset,
    label_shard_bounds,
    tokenize_labels,
)
from .evaluation import XMCEvaluator
from .gradcache import cached_loss
from .label_state import initialize_label_state
from .negatives import MINING_PRECISIONS, mining_autocast_dtype, runs_bf16_natively
from .optim import (
    SparseAdamW,
    can_reduce_sparse_gradients,
    clip_grad_norm_,
    has_sparse_gradients,
    sparse_gradient_parameters,
    use_dense_gradients,
)
from .samplers import ClusterBatchSampler, EmbeddingMemoryBank

logger = logging.getLogger(__name__)

# label_pool="all" with gradient_cache_chunk_size=0: labels per encoder chunk and per (batch, chunk) score block
ALL_LABEL_CHUNK_SIZE = 256


@dataclass
class XMCTrainingArguments(TrainingArguments):
    """``TrainingArguments`` with defaults that suit XMC training.

    Differences from transformers: no external loggers by default, raw collator columns kept, 10% linear
    warm-up, weight decay 0.01 (DEXML), a checkpoint per epoch (last two kept), CPU training whenever no
    GPU is visible (so ``accelerate launch --num_processes 2`` joins processes over gloo on CPU machines), and
    ``bf16`` on by default where the device runs bfloat16 natively (``None`` = auto, resolved here).
    """

    report_to: None | str | list[str] = field(default="none", metadata={"help": "Integrations to report to ('none' by default)."})
    remove_unused_columns: bool = field(default=False, metadata={"help": "Keep the collator's columns (must stay False)."})
    warmup_steps: float = field(default=0.1, metadata={"help": "Warm-up: steps, or a fraction of training if < 1."})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay."})
    save_strategy: SaveStrategy | str = field(default="epoch", metadata={"help": "Checkpoint strategy: 'no', 'epoch' or 'steps'."})
    save_total_limit: Optional[int] = field(default=2, metadata={"help": "Checkpoints kept."})
    logging_steps: float = field(default=50, metadata={"help": "Log every N steps."})
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Train into an output directory that already holds a finished model (transformers' old flag)."}
    )
    #: fields whose None default means auto (resolved in __post_init__): the script parser takes true, false or auto
    AUTO_SWITCHES: ClassVar[tuple[str, ...]] = ("bf16",)
    bf16: Optional[bool] = field(default=None, metadata={"help": "bfloat16 mixed precision (autocast) for the training steps. Default auto: on where the device multiplies bfloat16 in hardware (a GPU with bf16, a CPU with AMX or AVX512-BF16: a step 1.26-2.1x faster there), off elsewhere; --bf16 false keeps float32."})

    # --- how batches and label pools are built (hf_xmc) ---
    positive_sampling: str = field(default="uniform", metadata={"help": "Positive sampling: 'uniform' or 'propensity' (by inverse propensity, favours tail labels)."})
    num_positives: int = field(default=1, metadata={"help": "Positives sampled per query per step."})
    cluster_batching: bool = field(default=False, metadata={"help": "NGAME cluster batching: batches of similar queries (re-clustered during training)."})
    cluster_init_size: int = field(default=4, metadata={"help": "Cluster size of the first clustering (doubles at each curriculum epoch)."})
    cluster_curriculum_epochs: list[int] = field(default_factory=lambda: [10, 25, 50, 75, 100, 125, 150, 200], metadata={"help": "Epochs at which the cluster size doubles; clustering starts at the first."})
    cluster_refresh_interval: int = field(default=5, metadata={"help": "Re-cluster every N epochs."})
    cluster_min_labels: int = field(default=0, metadata={"help": "Cluster batching only on a label space of at least this many labels (0: any); on a smaller one similar queries share most of their labels, so a batch of them holds fewer distinct negatives, and batches stay random."})
    cluster_start_epoch: Optional[float] = field(default=None, metadata={"help": "When the queries are first clustered, in epochs (default: the first of --cluster_curriculum_epochs); a fraction clusters within an epoch (0.05: a twentieth into the first; 'concat' mode), from the mining pass's query vectors when the shortlist is mined at that point."})
    cluster_batch_mode: str = field(default="concat", metadata={"help": "'concat' (NGAME, PRIME: shuffled clusters concatenated and cut into batches; clusters grow by the curriculum) or 'one_per_batch' (UniDEC: clusters of at most the global batch size, each batch one cluster; the curriculum does not apply)."})
    hard_negatives: int = field(default=0, metadata={"help": "Hard negatives per query drawn from a mined shortlist (0 = in-batch only; ignored with --label_pool all, where every label is a negative)."})
    hard_negative_top_k: int = field(default=100, metadata={"help": "Shortlist size per query (known positives removed)."})
    hard_negative_start_epoch: float = field(default=5, metadata={"help": "When the shortlist is first mined, in epochs (in-batch negatives before); a fraction mines within an epoch (0.1: a tenth into the first)."})
    hard_negative_refresh_interval: float = field(default=5, metadata={"help": "Re-mine the shortlist every N epochs (a fraction: several times an epoch)."})
    mining_precision: str = field(default="auto", metadata={"help": "Precision of the encoding passes that pick training examples (hard-negative mining, cluster batching): 'auto' (bfloat16 where the device runs it natively: a CPU with AMX or AVX512-BF16, a GPU with bf16; else float32), 'float32' or 'bfloat16'."})
    gradient_cache_chunk_size: int = field(default=0, metadata={"help": "GradCache: encode queries and labels in chunks of N rows (0 = off; with label_pool='all' 0 means 256)."})
    label_pool: str = field(default="in_batch", metadata={"help": "'in_batch' (sampled positives [+ hard negatives]), 'psl' (UniDEC pick-some-labels: sampled positives, hard negatives and the batch's other positives, capped at max_label_pool) or 'all' (every label re-encoded each step: DEXML brute force)."})
    max_label_pool: int = field(default=0, metadata={"help": "label_pool='psl': most labels in a pool (0 = no cap)."})

    # --- a peft adapter on the encoder (hf_xmc; heads, label tables and prototypes stay fully trainable) ---
    peft: Optional[str] = field(default=None, metadata={"help": "'lora': train a LoRA adapter on the encoder instead of all its weights (needs peft)."})
    lora_r: int = field(default=8, metadata={"help": "--peft lora: rank of the update matrices."})
    lora_alpha: float = field(default=16, metadata={"help": "--peft lora: scaling (the update is alpha / r x B A)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "--peft lora: dropout on the adapter's input."})
    lora_target_modules: Optional[str] = field(default=None, metadata={"help": "--peft lora: comma-separated module names (default: peft's choice for the encoder type, e.g. query,value for BERT)."})
    peft_config: Optional[str] = field(default=None, metadata={"help": "A JSON file of any peft config (its to_dict(), with peft_type), instead of --peft lora."})
    save_adapter_only: bool = field(default=False, metadata={"help": "Save the encoder's adapter alone (encoder_adapter/) on its named base encoder, not merged into the encoder's weights."})
    encoder_dropout: Optional[float] = field(default=None, metadata={"help": "Drop probability of the encoder's dropout layers while training (default: the checkpoint's, 0.1 for MiniLM; 0 draws no masks, ~10-14%% of a CPU step)."})

    # --- the lexical channel: TF-IDF ranker + label-text scores fused with the dense score (hf_xmc.training.lexical) ---
    lexical_channel: str = field(default="none", metadata={"help": "'omikuji': after training, fit a lexical channel (TF-IDF + an Omikuji ranker, needs omikuji and scikit-learn) that predict fuses with the dense score; 'none': dense only."})
    lexical_ranker_weight: Optional[float] = field(default=None, metadata={"help": "--lexical_channel: weight of the ranker's score (default: tuned on held-out training queries)."})
    lexical_text_weight: Optional[float] = field(default=None, metadata={"help": "--lexical_channel: weight of the label-text TF-IDF cosine (default: tuned)."})
    lexical_tune_queries: int = field(default=2000, metadata={"help": "--lexical_channel without a validation split (--validation_size 0): training queries held out from the ranker to tune the weights on (at most a tenth)."})
    lexical_refit_ranker: bool = field(default=True, metadata={"help": "--lexical_channel: once the weights are tuned on the validation split, train the ranker again on the training and validation queries (the saved ranker has seen every training query)."})

    # --- a static query encoder fitted to the trained tower, for serving at the CPU's limit (hf_xmc.training.static_encoder) ---
    static_query_encoder: bool = field(default=False, metadata={"help": "After training, the channel and the calibration: fit a static query encoder (a bag of token vectors over the model's tokenizer) to the trained query tower on the training queries, tune its own fusion weights and calibration on the validation split, report eval_static_* / test_static_* and save it with the model (predict(query_encoder='static'))."})
    static_query_encoder_epochs: int = field(default=8, metadata={"help": "--static_query_encoder: passes over the training queries."})
    static_query_encoder_precision: str = field(default="auto", metadata={"help": "--static_query_encoder: precision of the tower's pass over the training queries that makes the fit's targets, as --mining_precision: 'auto' (bfloat16 where the hardware multiplies it natively), 'float32' or 'bfloat16'."})
    static_query_encoder_objective: str = field(default="auto", metadata={"help": "--static_query_encoder: what the fit minimises: 'cosine' (1 - the cosine to the tower's query vector), 'cosine+ranking' (plus a listwise distillation of the tower's ranking of its top labels), 'cosine+labels' (plus the training loss on the training queries' own labels in the frozen label space) or 'cosine+ranking+labels'; 'auto': 'cosine' and 'cosine+labels' both fitted from one pass of the tower, the better on the validation split kept (P@1 + PSP@5 with its own tuned fusion; 'cosine' without a validation split)."})
    static_query_encoder_max_queries: Optional[int] = field(default=None, metadata={"help": "--static_query_encoder: fit on a seeded sample of at most this many training queries (the tower's vectors of each are held in float16: 768 bytes a query at 384 dimensions)."})

    # --- scores turned into probabilities of relevance, fitted on the validation split (hf_xmc.training.calibration) ---
    score_calibration: str = field(default="auto", metadata={"help": "'isotonic' or 'platt': map predict's scores to the probability that a label is relevant (predict(threshold=)); 'auto': isotonic when the run has a validation split; 'none': no calibration."})

    def __post_init__(self):
        if not _accelerator_present():
            self.use_cpu = True
        if self.bf16 is None or self.bf16 == "auto":  # auto: bf16 steps where the hardware runs them natively, float32 elsewhere
            self.bf16 = not self.fp16 and runs_bf16_natively(torch.device("cpu" if self.use_cpu else "cuda"))
        if self.label_pool not in ("in_batch", "psl", "all"):
            raise ValueError(f"label_pool must be 'in_batch', 'psl' or 'all', got {self.label_pool!r}")
        if self.max_label_pool < 0:
            raise ValueError(f"max_label_pool must be >= 0, got {self.max_label_pool}")
        if self.cluster_batch_mode not in ClusterBatchSampler.MODES:
            raise ValueError(f"cluster_batch_mode must be one of {ClusterBatchSampler.MODES}, got {self.cluster_batch_mode!r}")
        start = self.cluster_start_epoch
        if start is not None and (start < 0 or (start != int(start) and self.cluster_batch_mode != "concat")):
            raise ValueError(f"--cluster_start_epoch must be >= 0 (whole epochs with --cluster_batch_mode {self.cluster_batch_mode}: "
                             f"pass --cluster_start_epoch 1, or none to start at the curriculum's first epoch), got {start}")
        if self.positive_sampling not in ("uniform", "propensity"):
            raise ValueError(f"positive_sampling must be 'uniform' or 'propensity', got {self.positive_sampling!r}")
        if self.mining_precision not in MINING_PRECISIONS:
            raise ValueError(f"--mining_precision takes one of {MINING_PRECISIONS}, got {self.mining_precision!r}")
        if self.static_query_encoder_precision not in MINING_PRECISIONS:
            raise ValueError(f"--static_query_encoder_precision takes one of {MINING_PRECISIONS}, got {self.static_query_encoder_precision!r}")
        if self.static_query_encoder_objective not in STATIC_FIT_OBJECTIVES:
            raise ValueError(f"--static_query_encoder_objective takes one of {STATIC_FIT_OBJECTIVES}, got {self.static_query_encoder_objective!r}")
        if self.hard_negative_refresh_interval <= 0:
            raise ValueError(f"--hard_negative_refresh_interval must be > 0, got {self.hard_negative_refresh_interval}")
        for name in ("num_positives", "cluster_init_size", "cluster_refresh_interval", "hard_negative_top_k",
                     "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_train_epochs", "learning_rate", "hard_negatives", "hard_negative_start_epoch", "gradient_cache_chunk_size", "weight_decay", "warmup_steps", "cluster_min_labels"):
            if getattr(self, name, 0) < 0:
                raise ValueError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if self.peft not in (None, "lora"):
            raise ValueError(f"--peft takes 'lora' (or give any peft config with --peft_config FILE), got {self.peft!r}")
        if self.peft and self.peft_config:
            raise ValueError("give --peft lora or --peft_config FILE, not both")
        if (self.peft or self.peft_config) and importlib.util.find_spec("peft") is None:
            raise ValueError(f"{'--peft lora' if self.peft else '--peft_config'} needs peft, which is not installed: pip install 'hf_xmc[peft]'")
        if self.save_adapter_only and not (self.peft or self.peft_config):
            raise ValueError("--save_adapter_only needs an adapter: --peft lora or --peft_config FILE")
        if self.encoder_dropout is not None and not 0 <= self.encoder_dropout < 1:
            raise ValueError(f"--encoder_dropout must be in [0, 1), got {self.encoder_dropout}")
        if self.lexical_channel not in ("none", "omikuji"):
            raise ValueError(f"--lexical_channel takes 'none' or 'omikuji', got {self.lexical_channel!r}")
        if self.lexical_channel == "omikuji":
            missing = [name for name, module in (("omikuji", "omikuji"), ("scikit-learn", "sklearn")) if importlib.util.find_spec(module) is None]
            if missing:
                raise ValueError(f"--lexical_channel omikuji needs {' and '.join(missing)}: pip install 'hf_xmc[lexical]'")
        if self.score_calibration not in ("auto", "isotonic", "platt", "none"):
            raise ValueError(f"--score_calibration takes 'auto', 'isotonic', 'platt' or 'none', got {self.score_calibration!r}")
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            self.metric_for_best_model = "P@1"  # the validation split's P@1 (transformers' default, the loss, is not computed)
        if self.label_pool == "all" and (self.hard_negatives or self.cluster_batching):
            # every label is a negative of every step: nothing to mine, and which queries share a batch changes no pool
            logger.info("--label_pool all: no hard-negative shortlist (--hard_negatives %d) and no cluster batching (--cluster_batching %s)",
                        self.hard_negatives, self.cluster_batching)
            self.hard_negatives, self.cluster_batching = 0, False
        if self.hard_negatives > self.hard_negative_top_k:
            raise ValueError(f"--hard_negatives {self.hard_negatives} exceeds the shortlist they are drawn from (--hard_negative_top_k {self.hard_negative_top_k})")
        super().__post_init__()
        if progress_bar_disabled():  # TQDM_DISABLE=1 or transformers' disable_progress_bar(): every bar of the run off
            self.disable_tqdm = True


def encoder_adapter_config(args: XMCTrainingArguments):
    """The peft config that ``--peft lora`` (with ``--lora_*``) or ``--peft_config FILE`` asks for; None for neither."""
    if not (getattr(args, "peft", None) or getattr(args, "peft_config", None)):
        return None
    from ..models.encoder_utils import import_peft

    peft = import_peft()
    if args.peft_config:
        import json

        try:
            with open(args.peft_config, encoding="utf-8") as f:
                values = json.load(f)
            return peft.get_peft_config(values)
        except (ValueError, KeyError, TypeError) as err:  # not JSON, or not a peft config
            raise ValueError(f"{args.peft_config}: not a peft config ({type(err).__name__}: {err}); write a LoraConfig(...).to_dict() with its peft_type") from None
    modules = [m.strip() for m in args.lora_target_modules.split(",") if m.strip()] if args.lora_target_modules else None
    return peft.LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, target_modules=modules)


def _accelerator_present() -> bool:
    """True when torch sees a CUDA or MPS device."""
    return torch.cuda.is_available() or (getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available())


def set_encoder_dropout(model, p: float) -> int:
    """Set the drop probability of every dropout layer of ``model.encoder`` (the pretrained backbone) to ``p``; returns
    how many layers it set. A LoRA adapter's own dropout (``--lora_dropout``) is left as it is. transformers' BERT-family
    encoders (BERT, MiniLM, DistilBERT, XLM-R) read their attention dropout from the module's ``p``, so it follows.
    Only training changes (dropout is off in eval mode) and nothing of it is saved: the saved encoder config keeps the
    checkpoint's values. Memory: none."""
    count = 0
    for name, module in model.encoder.named_modules():
        if isinstance(module, torch.nn.Dropout) and "lora_" not in name:
            module.p = float(p)
            count += 1
    return count


CHECKPOINT_COMPLETE_FILE = "trainer_state.json"  # what Trainer._save_checkpoint writes last


def checkpoint_is_complete(directory: str) -> bool:
    """Whether a checkpoint's save finished: its ``trainer_state.json``, written last, is there and reads as JSON (a
    run killed while that file itself was written leaves it empty or cut short)."""
    try:
        with open(os.path.join(directory, CHECKPOINT_COMPLETE_FILE), encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError):
        return False
    return True


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
        label_images: per label a list of images, for models that take images (MUFIN).
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
        label_images: Optional[Sequence[Sequence]] = None,
        **kwargs,
    ):
        if args is not None and args.remove_unused_columns:
            raise ValueError("XMCTrainer needs TrainingArguments(remove_unused_columns=False): the collator reads raw columns")
        adapter = encoder_adapter_config(args)
        if adapter is not None:
            if not model.has_encoder_adapter:  # the next stage of a multi-stage recipe trains the same adapter on
                model.add_encoder_adapter(adapter)
            model.save_adapter_only = args.save_adapter_only
        if getattr(args, "encoder_dropout", None) is not None:  # after the adapter: its dropout keeps --lora_dropout
            layers = set_encoder_dropout(model, args.encoder_dropout)
            logger.info("encoder dropout %g on %d layers", args.encoder_dropout, layers)
        if (
            getattr(args, "gradient_cache_chunk_size", 0)
            and args.world_size > 1
            and not model.supports_distributed_gradient_cache
        ):
            raise ValueError(
                f"{type(model).__name__} has trainable parameters in its loss (outside the encoder), whose gradients the "
                "gradient cache cannot synchronise across processes: use --gradient_cache_chunk_size 0 with several "
                "processes, or one process"
            )
        if args is not None and args.ddp_broadcast_buffers is None and model.ddp_broadcast_buffers is False:
            # DDP would re-send every buffer from rank 0 at each forward: PRIME's centroid bank is 4 d bytes per label
            # (2 GB at 1.3M labels) and every rank already applies the same update to its copy
            args.ddp_broadcast_buffers = False
        if getattr(args, "label_pool", None) == "all":
            model.check_all_label_loss()  # raises unless the model has an all-label loss (DEXML)
        if label_texts is not None:  # label images only for models that take them (MUFIN)
            model.set_labels(label_texts, label_uids, *([label_images] if label_images is not None else []))
        xmc_args = args if isinstance(args, XMCTrainingArguments) else None
        if data_collator is None and train_dataset is not None:
            weights = None
            if xmc_args is not None and xmc_args.positive_sampling == "propensity":
                weights = inverse_propensity(train_dataset.targets, model.config.propensity_a, model.config.propensity_b)
            psl = xmc_args is not None and xmc_args.label_pool == "psl"
            pool_kwargs = {"max_label_pool": xmc_args.max_label_pool} if psl else {}
            data_collator = (PSLDataCollator if psl else XMCDataCollator).for_model(
                model,
                train_dataset,
                model._require_labels(),
                num_positives=xmc_args.num_positives if xmc_args is not None else 1,
                positive_weights=weights,
                num_negatives=xmc_args.hard_negatives if xmc_args is not None else 0,
                all_labels=xmc_args is not None and xmc_args.label_pool == "all",
                seed=args.seed if args is not None else 0,
                **pool_kwargs,
            )
        super().__init__(
            model=model,
            args=args,
            # an XMCDataset is served as {"index": i} items; any other dataset (SiameseXML's label draws) as it is
            train_dataset=XMCTrainDataset(train_dataset) if isinstance(train_dataset, XMCDataset) else train_dataset,
            data_collator=data_collator,
            processing_class=model.tokenizer,
            **kwargs,
        )
        self.evaluator = evaluator
        self._loss_term_sums: dict[str, torch.Tensor] = {}
        self._loss_term_count = 0
        self.xmc_train_data = train_dataset if isinstance(train_dataset, XMCDataset) else None
        self.cluster_sampler: Optional[ClusterBatchSampler] = None
        self.memory_bank: Optional[EmbeddingMemoryBank] = None
        self._label_tokens: Optional[LabelTokens] = None  # label_pool="all": this process's label shard, tokenised once
        if xmc_args is not None and train_dataset is not None:
            num_labels = self.xmc_train_data.targets.shape[1] if self.xmc_train_data is not None else 0
            if xmc_args.cluster_batching and num_labels < xmc_args.cluster_min_labels:
                logger.info("%d labels, fewer than --cluster_min_labels %d: random batches (no cluster batching)", num_labels, xmc_args.cluster_min_labels)
                xmc_args.cluster_batching = False  # the card and the saved arguments say what ran
            if xmc_args.cluster_batching and self.xmc_train_data is not None:
                self.cluster_sampler = ClusterBatchSampler(
                    num_samples=len(train_dataset),
                    batch_size=xmc_args.per_device_train_batch_size,
                    init_cluster_size=xmc_args.cluster_init_size,
                    curriculum_epochs=tuple(xmc_args.cluster_curriculum_epochs),
                    refresh_interval=xmc_args.cluster_refresh_interval,
                    seed=xmc_args.seed,
                    drop_last=xmc_args.dataloader_drop_last,
                    num_replicas=xmc_args.world_size,
                    rank=xmc_args.process_index,
                    mode=xmc_args.cluster_batch_mode,
                    start_epoch=xmc_args.cluster_start_epoch,
                )
            self.add_callback(XMCEpochCallback(self))

    def train(self, resume_from_checkpoint=None, **kwargs):
        """``Trainer.train``; when resuming, the sampler, memory bank and shortlist of the checkpoint come back too."""
        path = resume_from_checkpoint
        if path is True:
            path = resume_from_checkpoint = self.last_complete_checkpoint()
            if path is None:
                raise ValueError(f"{self.args.output_dir}: no complete checkpoint to resume from")
        if isinstance(path, str):
            callback = self._epoch_callback()
            saved = XMCEpochCallback.read_state(path) if callback is not None else None
            if saved is not None:
                callback.load_state_dict(saved)
            state = TrainerState.load_from_json(os.path.join(path, CHECKPOINT_COMPLETE_FILE))
            if 0 < self.args.max_steps <= state.global_step:
                # transformers' loop takes a step before it checks max_steps: a run killed after its last checkpoint
                # (during evaluation or the final save) would train one step more than an uninterrupted one
                self._load_from_checkpoint(path)
                self.state = state
                logger.info("%s: training had reached max_steps (%d): its weights are read back, nothing is trained", path, self.args.max_steps)
                return TrainOutput(state.global_step, float("nan"), {"epoch": state.epoch})  # no step, no loss here
        elif self.model.needs_label_state and self.xmc_train_data is not None:
            # a fresh PRIME-style model: free-vector clusters and centroids come from the initial encoder
            data = self.xmc_train_data
            initialize_label_state(self.model, data.texts, data.targets, seed=self.args.seed, show_progress_bar=not self.args.disable_tqdm)
        try:
            output = super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
            # the precisions --bf16 and --mining_precision resolved to ("auto": the hardware's), so rows compare
            output.metrics["train_bf16"] = int(bool(self.args.bf16))
            output.metrics["train_mining_bf16"] = int(mining_autocast_dtype(self.args.mining_precision, self.args.device) is torch.bfloat16)
            callback = self._epoch_callback()
            if callback is not None:  # this process's passes that only picked training examples (within train_runtime)
                output.metrics["train_mining_seconds"] = round(callback.mining_seconds, 3)
                output.metrics["train_clustering_seconds"] = round(callback.clustering_seconds, 3)
            return output
        finally:
            self._release_model()
            forget = getattr(self.model, "invalidate_weights_fingerprint", None)
            if forget is not None:  # whatever wrote the weights (a checkpoint read back, an optimizer of the caller's)
                forget()

    def _release_model(self) -> None:
        """Hand the model back as it came: accelerate wraps its ``forward`` in the run's autocast (bf16 / fp16) and
        marks it prepared, so that without this the trained model would go on encoding under bfloat16 when called
        directly, and a second trainer on it (SiameseXML's Module II, MUFIN's Module IV) would skip its own
        preparation and train under the first run's precision."""
        model = self.accelerator.unwrap_model(self.model_wrapped, keep_fp32_wrapper=False)
        for module in {id(m): m for m in (model, self.model)}.values():
            module.__dict__.pop("_is_accelerate_prepared", None)

    def _epoch_callback(self) -> Optional[XMCEpochCallback]:
        """The trainer's :class:`XMCEpochCallback` (its checkpointed state), or None."""
        return next((c for c in self.callback_handler.callbacks if isinstance(c, XMCEpochCallback)), None)

    def get_decay_parameter_names(self, model) -> list[str]:
        """transformers' choice (no decay on biases and norms) minus the model's ``no_weight_decay_parameters``."""
        names = super().get_decay_parameter_names(model)
        excluded = tuple(self.model.no_weight_decay_parameters)
        return [n for n in names if not any(n == e or n.endswith("." + e) for e in excluded)]

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """transformers' optimizer, with per-module learning rates when the model asks for them, and
        :class:`SparseAdamW` when the model has per-label tables with sparse gradients.

        A model may define ``parameter_learning_rates(base_lr) -> {name prefix: lr}`` (UniDEC: heads at twice the
        encoder's rate, classifier vectors at 1e-3); each prefix gets its own parameter groups (with and without
        weight decay). The schedule scales every group by the same factor.

        Tables with sparse gradients (``nn.Embedding(sparse=True)``, e.g. UniDEC's ``Psi`` and PRIME's free vectors
        with ``config.sparse_label_gradients``) are trained with :class:`SparseAdamW` (AdamW on every dense parameter,
        lazy row-wise AdamW on the tables' pool rows) when the optimizer is transformers' AdamW (``--optim
        adamw_torch`` or ``adamw_torch_fused``, the default), with the same groups and hyper-parameters. With any
        other optimizer (``--optim``, ``optimizer_cls_and_kwargs``, ``optimizers=``) or a data-parallel backend
        without sparse all-reduce (NCCL; gloo has one), the tables switch to dense gradients, with a warning.
        """
        opt_model = self.model if model is None else model
        rates = self.model.parameter_learning_rates(self.args.learning_rate)
        sparse = sparse_gradient_parameters(opt_model)
        if self.optimizer is not None or self.optimizer_cls_and_kwargs is not None or (not rates and not sparse):
            super().create_optimizer(model)
        else:
            decay = set(self.get_decay_parameter_names(opt_model))
            groups: dict[tuple[float, bool], list] = {}
            for name, param in opt_model.named_parameters():
                if not param.requires_grad:
                    continue
                bare = name[len("module."):] if name.startswith("module.") else name
                lr = next((rate for prefix, rate in rates.items() if bare.startswith(prefix)), self.args.learning_rate)
                groups.setdefault((lr, name in decay), []).append(param)
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
            if sparse and optimizer_cls is torch.optim.AdamW and can_reduce_sparse_gradients(self.args.world_size, self.args.n_gpu):
                optimizer_cls = SparseAdamW  # same kwargs (betas, eps, fused): dense parameters take AdamW's own step
            self.optimizer = optimizer_cls(
                [{"params": params, "lr": lr, "weight_decay": self.args.weight_decay if decays else 0.0} for (lr, decays), params in groups.items()],
                **optimizer_kwargs,
            )
        # torch's fused AdamW (the default optim) writes the weights without bumping their version counters, which the
        # model's caches of its weights' fingerprint key on: every step makes the model forget them
        base = getattr(self.optimizer, "optimizer", self.optimizer)
        forget = getattr(self.model, "invalidate_weights_fingerprint", None)
        if forget is not None and hasattr(base, "register_step_post_hook") and not getattr(base, "_forgets_weights_fingerprint", False):
            base.register_step_post_hook(lambda *_: forget())
            base._forgets_weights_fingerprint = True
        if sparse and not isinstance(getattr(self.optimizer, "optimizer", self.optimizer), SparseAdamW):  # Accelerate wraps it
            use_dense_gradients(opt_model)
            logger.warning(
                "%s is not SparseAdamW (or the processes cannot all-reduce sparse gradients): %d per-label table(s) now "
                "take dense gradients (an L x d gradient per table and a dense update of every row each step)",
                type(self.optimizer).__name__, len(sparse),
            )
        return self.optimizer

    def _clip_grad_norm(self, model):
        """transformers' clipping, or, when a per-label table has a sparse gradient, :func:`clip_grad_norm_`
        (torch's fused CUDA kernels have no sparse variant)."""
        if not has_sparse_gradients(model.parameters()):
            return super()._clip_grad_norm(model)
        self.accelerator.unscale_gradients()
        return clip_grad_norm_(model.parameters(), self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        """The logged gradient norm; without clipping (``max_grad_norm <= 0``) sparse gradients are measured as above."""
        if grad_norm is None and has_sparse_gradients(model.parameters()):
            self.accelerator.unscale_gradients()
            grad_norm = clip_grad_norm_(model.parameters(), float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self) -> DataLoader:
        """The stock loader, or one driven by the rank-aware cluster batch sampler (not re-sharded by Accelerate)."""
        if self.cluster_sampler is None:
            return super().get_train_dataloader()
        return DataLoader(
            self.train_dataset,
            batch_sampler=self.cluster_sampler,
            collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )

    # ------------------------------------------------------------------ loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The model's pool loss; with ``gradient_cache_chunk_size`` the encoder runs in chunks (GradCache); with
        ``label_pool="all"`` the loss over every label (:meth:`_all_label_loss`)."""
        # the weights are about to change: label vectors computed before would be stale in a checkpoint
        self.model.invalidate_label_index()
        indices = inputs.pop("indices", None)
        chunk = getattr(self.args, "gradient_cache_chunk_size", 0)
        terms: Optional[dict[str, torch.Tensor]] = None  # a multi-term loss's detached terms, logged as loss_<term>
        if getattr(self.args, "label_pool", None) == "all":
            loss, query_embeds = self._all_label_loss(model, inputs)
            outputs = None
        elif chunk and model.training and torch.is_grad_enabled():
            loss, query_embeds, terms = self._cached_pool_loss(model, inputs, chunk)
            outputs = None
        else:
            outputs = model(**inputs)
            if outputs.loss is None:
                raise ValueError("the model returned no loss: the batch must carry 'targets'")
            loss, query_embeds, terms = outputs.loss, outputs.query_embeds, outputs.loss_terms
        if self.cluster_sampler is not None and indices is not None:
            # UniDEC clusters in its DE-head space
            self._update_memory_bank(indices, self.model.clustering_vectors(query_embeds.detach()))
        if terms and model.training:  # multi-term objectives (PRIME): log each term's mean between two logs
            for name, value in terms.items():  # summed as tensors: read back (one device sync) only when logging
                self._loss_term_sums[name] = self._loss_term_sums.get(name, 0.0) + value
            self._loss_term_count += 1
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: Optional[float] = None) -> None:
        """``Trainer.log``; training logs also carry ``loss_<term>`` for models that report their loss terms."""
        if "loss" in logs and self._loss_term_count:
            for name, total in self._loss_term_sums.items():
                logs[f"loss_{name}"] = round(float(total) / self._loss_term_count, 4)
            self._loss_term_sums, self._loss_term_count = {}, 0
        super().log(logs, start_time)

    def _cached_pool_loss(self, model, inputs: dict, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """GradCache: embed queries and labels in chunks without graph, loss on the whole batch, replay on backward.

        ``model`` (possibly DDP-wrapped) embeds a chunk through its ``forward`` (so DDP sees every replay); the
        loss on the embeddings comes from the unwrapped model's ``pool_loss``.
        """
        unwrapped = self.model
        groups = [
            {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]},
            {"input_ids": inputs["label_input_ids"], "attention_mask": inputs["label_attention_mask"]},
        ]
        extra = {k: inputs.get(k) for k in ("targets", "positive_index", "label_ids", "query_positive_ids")}

        def embed(chunk: dict) -> torch.Tensor:
            return model(**chunk).query_embeds

        terms: dict[str, torch.Tensor] = {}

        def loss_fn(query_embeds: torch.Tensor, label_embeds: torch.Tensor) -> torch.Tensor:
            loss, _, step_terms = unwrapped.pool_loss(query_embeds, label_embeds, **extra)
            terms.update(step_terms)
            return loss

        out = cached_loss(embed, groups, loss_fn, chunk_size, ddp_module=model if hasattr(model, "no_sync") else None, return_embeddings=True)
        return out.loss, out.embeddings[0], terms

    def _label_shard_tokens(self) -> LabelTokens:
        """This process's contiguous shard of the label space (``L / world_size`` labels), tokenised on first use."""
        labels = self.model._require_labels()
        if len(labels) < self.args.world_size:
            raise ValueError(f"label_pool='all' shards the labels across processes: {len(labels)} labels for {self.args.world_size} processes")
        start, stop = label_shard_bounds(len(labels), self.args.process_index, self.args.world_size)
        cached = self._label_tokens
        if cached is None or (cached.start, cached.start + len(cached)) != (start, stop):
            tokens = tokenize_labels(self.model._require_tokenizer(), labels, self.model.config.label_max_seq_length, start, stop)
            self._label_tokens = cached = tokens.to(self.args.device)  # on the device: RandContext snapshots its RNG
            logger.info("label_pool='all': labels [%d, %d) tokenised once for this process (%.1f MB)", start, stop,
                        (tokens.input_ids.nbytes + tokens.lengths.nbytes) / 2**20)
        return cached

    def _all_label_loss(self, model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """DEXML's all-label step: every label is a negative of every query, re-encoded with the current weights.

        This process encodes its shard of the labels (:meth:`_label_shard_tokens`) in chunks through the gradient cache
        (``gradient_cache_chunk_size``, :data:`ALL_LABEL_CHUNK_SIZE` when 0) and the model's ``all_label_loss`` scores
        the queries against it chunk by chunk, joining the shards of all processes. Memory per step: the encoder's
        activations for one chunk, ``(L / world) x d`` label embeddings and their cached gradients (``8 d`` bytes per
        label in float32), ``batch x chunk`` scores, and the shard's token ids (``4 * label_max_seq_length + 4`` bytes
        per label, kept between steps).
        """
        unwrapped = self.model
        if "query_positive_ids" not in inputs:
            raise ValueError("label_pool='all' needs query_positive_ids in the batch: use XMCDataCollator(all_labels=True)")
        chunk = self.args.gradient_cache_chunk_size
        if not chunk:
            chunk = ALL_LABEL_CHUNK_SIZE
            if self._label_tokens is None:
                logger.info("label_pool='all': gradient_cache_chunk_size is 0, encoding and scoring labels in chunks of %d", chunk)
        tokens = self._label_shard_tokens()
        groups = [
            {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]},
            {"label_token_ids": tokens.input_ids, "label_lengths": tokens.lengths},
        ]

        def embed(part: dict) -> torch.Tensor:
            if "label_lengths" in part:
                part = LabelTokens.model_inputs(part["label_token_ids"], part["label_lengths"])
            return model(**part).query_embeds

        def loss_fn(query_embeds: torch.Tensor, label_embeds: torch.Tensor) -> torch.Tensor:
            return unwrapped.all_label_loss(query_embeds, label_embeds, inputs["query_positive_ids"], label_offset=tokens.start, chunk_size=chunk)

        out = cached_loss(embed, groups, loss_fn, chunk, ddp_module=model if hasattr(model, "no_sync") else None, return_embeddings=True)
        return out.loss, out.embeddings[0]

    def _update_memory_bank(self, indices: torch.Tensor, query_embeds: torch.Tensor) -> None:
        """Store this step's query embeddings (from every process) for the next re-clustering."""
        if self.args.world_size > 1:
            indices = self.accelerator.gather(indices.to(self.args.device))
            query_embeds = self.accelerator.gather(query_embeds.contiguous())
        if self.memory_bank is None:
            self.memory_bank = EmbeddingMemoryBank(len(self.xmc_train_data), query_embeds.shape[1])
        self.memory_bank.update(indices.cpu(), query_embeds.float().cpu())

    # ------------------------------------------------------------------ saving and pushing
    TRAINING_ARGS_JSON = "training_args.json"

    def _save_checkpoint(self, model, trial) -> None:
        """``Trainer._save_checkpoint``, with hf_xmc's own state (sampler, memory bank, shortlist) written into the
        checkpoint first, so that ``trainer_state.json``, written last, marks a checkpoint as complete: a run killed
        while it saves leaves an incomplete ``checkpoint-N`` that :meth:`last_complete_checkpoint` passes over."""
        callback = self._epoch_callback()
        if callback is not None and self.args.should_save:
            directory = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
            os.makedirs(directory, exist_ok=True)
            callback.write_state(directory, callback.state_dict())
        unwrapped = self.accelerator.unwrap_model(self.model)
        unwrapped.trainer_checkpoint_keys = True  # resume loads the weights with load_state_dict
        try:
            super()._save_checkpoint(model, trial)
        finally:
            unwrapped.trainer_checkpoint_keys = False

    def last_complete_checkpoint(self) -> Optional[str]:
        """The newest ``checkpoint-N`` of ``output_dir`` that a save finished (its ``trainer_state.json`` reads as
        JSON), or None. Newer ones that a killed save left half-written are removed, with a warning naming them."""
        import re
        import shutil

        out = self.args.output_dir
        if not os.path.isdir(out):
            return None
        steps = sorted(
            (int(m.group(1)), name) for name in os.listdir(out)
            if (m := re.fullmatch(r"checkpoint-(\d+)", name)) and os.path.isdir(os.path.join(out, name))
        )
        while steps and not checkpoint_is_complete(os.path.join(out, steps[-1][1])):
            name = steps.pop()[1]
            logger.warning("%s: an incomplete checkpoint (its save was interrupted), removed; resuming from the one before", os.path.join(out, name))
            if self.args.should_save:
                shutil.rmtree(os.path.join(out, name), ignore_errors=True)
        return os.path.join(out, steps[-1][1]) if steps else None

    def _save(self, output_dir: Optional[str] = None, state_dict=None) -> None:
        """``Trainer._save`` (model with its label store, tokenizer), with the training arguments as JSON
        (``training_args.json``) instead of transformers' pickled ``training_args.bin``: nothing in a model or
        checkpoint directory needs unpickling."""
        super()._save(output_dir, state_dict=state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save:
            pickled = os.path.join(output_dir, "training_args.bin")
            if os.path.exists(pickled):
                os.remove(pickled)
            from ..models.io_utils import write_json_atomic

            write_json_atomic(os.path.join(output_dir, self.TRAINING_ARGS_JSON), self.args.to_dict())

    def _upload_model_directory(self, folder: str, commit_message: str, blocking: bool = True, token=None, revision=None, complete: bool = True):
        """Upload exactly the model files of ``folder`` (``model_directory_files``) to ``hub_model_id``; a checkpoint
        (``complete=False``) may lack the label store, which training invalidates and a reload re-encodes."""
        import transformers.trainer as hf_trainer

        from ..models.hub_files import model_directory_files

        return hf_trainer.hf_api().upload_folder(
            repo_id=self.hub_model_id,
            folder_path=folder,
            commit_message=commit_message,
            token=token if token is not None else self.args.hub_token,
            run_as_future=not blocking,
            allow_patterns=model_directory_files(folder, type(self.accelerator.unwrap_model(self.model)), complete=complete),
            revision=revision if revision is not None else self.args.hub_revision,
        )

    def push_to_hub(self, commit_message: Optional[str] = "End of training", blocking: bool = True, token=None, revision=None, private=None, **kwargs):
        """Save the model to ``output_dir``, write its card and upload exactly the model's files (what a reload needs,
        the card, its plot and ``eval_results.json``) to ``hub_model_id``: never a checkpoint, a log, a pickle or a
        nested folder (MUFIN's ``module1/``), which ``Trainer.push_to_hub`` would send along. ``kwargs`` go to
        :meth:`create_model_card`."""
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        model_name = kwargs.pop("model_name", None)
        if model_name is None:
            model_name = (self.args.hub_model_id or os.path.basename(os.path.abspath(self.args.output_dir))).split("/")[-1]
        if self.hub_model_id is None:
            self.init_hf_repo(token=token if token is not None else self.args.hub_token, private=private)
        self.save_model(_internal_call=True)
        if not self.is_world_process_zero():
            return None
        self.create_model_card(model_name=model_name, **kwargs)
        self._finish_current_push()
        return self._upload_model_directory(self.args.output_dir, commit_message, blocking=blocking, token=token, revision=revision)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """``hub_strategy`` pushes during training: the checkpoint's model files only (a checkpoint is a complete model
        directory, label store included), never its optimizer state or the trainer's own files."""
        if not self.is_world_process_zero() or self.args.hub_strategy == "end":
            return
        if not self.args.hub_always_push and self.push_in_progress is not None and not self.push_in_progress.is_done():
            return
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        step = f"step {self.state.global_step}" if self.args.save_strategy == "steps" else f"epoch {int(self.state.epoch or 0)}"
        from transformers.utils.hub import PushInProgress

        job = self._upload_model_directory(checkpoint_folder, f"Training in progress, {step}", blocking=False, complete=False)
        self.push_in_progress = PushInProgress([job])

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

    def fit_lexical_channel(self, validation: Optional[XMCDataset] = None, batch_size: int = 128):
        """What ``--lexical_channel`` asks, once training is over: a lexical channel fitted on the training queries, the
        weights that ``--lexical_ranker_weight`` / ``--lexical_text_weight`` leave open tuned on ``validation`` (else on
        ``--lexical_tune_queries`` training queries held out from the ranker), attached to the model and returned
        (:func:`hf_xmc.training.lexical.fit_lexical_channel`); None with ``--lexical_channel none``. The training
        scripts call it after :meth:`train`, and so can a user of this trainer."""
        if getattr(self.args, "lexical_channel", "none") == "none":
            return None
        if self.xmc_train_data is None:
            raise ValueError("--lexical_channel: the channel is fitted on the training queries, and this trainer has no XMCDataset to train on")
        from .lexical import fit_lexical_channel

        args = self.args
        return fit_lexical_channel(
            self.model, self.xmc_train_data, self.model.label_texts, self.model.label_uids, ranker_weight=args.lexical_ranker_weight,
            text_weight=args.lexical_text_weight, tune_queries=args.lexical_tune_queries, seed=args.seed, batch_size=batch_size,
            validation=validation,
        )

    def release_training_state(self) -> None:
        """Drop what only training needs, before evaluation and saving at scale: the optimizer and its state (AdamW
        keeps 8 bytes per trainable value: 4 GB for 1.3M per-label rows of 384), the scheduler, the data loaders and
        the collator with the data it holds (SiameseXML's Module II shortlists and point vectors, 2.6 GB at
        2.2M points). ``evaluate``, ``save_model``, ``create_model_card`` and ``push_to_hub`` work as before; training
        again needs a new trainer."""
        import gc

        self.optimizer = self.lr_scheduler = self.data_collator = None
        handler = self.callback_handler  # it keeps the optimizer, the scheduler and the training loader too
        handler.optimizer = handler.lr_scheduler = handler.train_dataloader = None
        self.accelerator.free_memory()  # its references to the prepared optimizer, scheduler, model and loaders
        gc.collect()

    def create_model_card(
        self,
        language: Optional[str] = None,
        license: Optional[str] = None,
        tags: Optional[str | list[str]] = None,
        model_name: Optional[str] = None,
        finetuned_from: Optional[str] = None,
        tasks: Optional[str | list[str]] = None,
        dataset_tags: Optional[str | list[str]] = None,
        dataset: Optional[str | list[str]] = None,
        dataset_args: Optional[str | list[str]] = None,
    ) -> None:
        """Write hf_xmc's model card (``README.md`` + ``xmc_metrics.png``, see :mod:`hf_xmc.training.cards`) into
        ``output_dir`` and attach it to the model, so later saves and ``push_to_hub`` carry it.

        Results come from the evaluator's last run (``trainer.evaluate()``); ``dataset`` names the evaluation data
        (default: the evaluator's ``dataset_name``), ``finetuned_from`` the encoder's Hub id. ``Trainer.push_to_hub``
        calls this before uploading ``output_dir``. ``language``, ``tasks``, ``dataset_tags`` and ``dataset_args``
        are accepted for Trainer compatibility and not used.
        """
        if not self.is_world_process_zero():
            return
        from .cards import evaluation_summary, generate_model_card

        ran = self.evaluator is not None and self.evaluator.last_predictions is not None
        train_metrics = next((row for row in reversed(self.state.log_history) if "train_runtime" in row), None)
        card = generate_model_card(
            self.accelerator.unwrap_model(self.model),
            evaluation_summary(self.evaluator) if ran else None,
            dataset_name=dataset if isinstance(dataset, str) or dataset is None else dataset[0],
            dataset_id=getattr(self.evaluator, "dataset_id", None),
            model_name=model_name,
            model_id=getattr(self, "hub_model_id", None),
            base_model=finetuned_from,
            training_args=self.args,
            train_metrics=train_metrics,
            license=license or "apache-2.0",
            tags=[tags] if isinstance(tags, str) else (tags or ()),
        )
        self.accelerator.unwrap_model(self.model).model_card = card
        card.save(self.args.output_dir)
