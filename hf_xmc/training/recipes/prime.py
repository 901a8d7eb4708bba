"""Train PRIME (label prototype network + clipped dynamic-margin triplet loss) on Extreme Classification Repository files.

    python training_scripts/train_prime.py \
        --train_file trn.json.gz --test_file tst.json.gz --label_file lbl.json.gz \
        --model_name_or_path sentence-transformers/all-MiniLM-L6-v2 --output_dir out/prime

    accelerate launch --num_processes 2 training_scripts/train_prime.py ...   # several processes
    hf-xmc train prime ...                                                    # the same recipe as a console command
    accelerate launch --num_processes 2 -m hf_xmc.cli train prime ...

Before the first step the trainer clusters the label embeddings onto the free vectors and sets every label's
centroid from its training queries (initial encoder); both are saved with the model. Writes OUT/ (a model directory
loadable with AutoModel.from_pretrained(OUT, trust_remote_code=True), prototype index included) and
OUT/eval_results.json (test_P@k, test_nDCG@k, test_PSP@k, test_R@10/100, train_runtime, test_samples_per_second).

Defaults are PRIME's recipe at a short budget: 2 positives per query drawn by inverse propensity (--num_positives 1
gives PRIME-lite), NGAME cluster batching from the second epoch (--cluster_batching false for random batches), the
spec's loss constants. Every TrainingArguments flag works, and so do the engine flags of XMCTrainingArguments.

--classifier_stage trains PRIME (W) after PRIME (paper Sec. 4, NGAME's one-vs-all stage): the encoder and prototype
network frozen, query embeddings cached, one classifier per label initialised from the normalised prototypes, trained
(--classifier_epochs at --classifier_learning_rate) with the triplet loss at a fixed margin of 0.2 over each query's
positives and 100 shortlist negatives from the prototype index; the saved model searches the classifiers
(model.set_search_mode("prototype") searches the prototypes again). PRIME's own checkpoints go to OUT/prime/.

--preset lf-amazontitles-1.3m (or another dataset of hf_xmc.training.presets; --preset list names them) turns the paper's
configuration for that dataset into the defaults, encoder included; flags given explicitly, or keys of a .json config,
win over it. --preset gpu sizes these defaults to ~10 minutes of one GPU (batches of 512, a step bound; docs/training.md).
"""

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import scipy.sparse as sp

from hf_xmc.models import PRIMEModel
from hf_xmc.training import XMCTrainer, XMCTrainingArguments, mine_hard_negatives
from hf_xmc.training.classifier_stage import ClassifierStageCollator
from hf_xmc.training.negatives import mining_autocast
from hf_xmc.training.script_utils import (
    build_evaluator,
    load_data,
    model_config_kwargs,
    parse_script_args,
    resume_argument,
    stage_evaluation,
    train_and_evaluate,
    train_stage,
)

logger = logging.getLogger(__name__)


@dataclass
class PRIMEModelArguments:
    """Model arguments of PRIME (see PRIMEConfig for the meaning of each field)."""

    model_name_or_path: str = field(metadata={"help": "Encoder to start from: a Hub id or a local directory."})
    pooling: Optional[str] = field(default=None, metadata={"help": "'mean' or 'cls' pooling (default: a sentence-transformers checkpoint's own, else mean)."})
    num_free_vectors: Optional[int] = field(default=None, metadata={"help": "Free vectors (power of two, 0 = none); default about 2 labels per vector."})
    lpn_intermediate_size: int = field(default=1024, metadata={"help": "Feed-forward size of the prototype network."})
    lpn_dropout: float = field(default=0.1, metadata={"help": "Dropout of the prototype network."})
    centroid_update: str = field(default="ema", metadata={"help": "'ema' (paper eq. 4) or 'frozen' centroids."})
    centroid_momentum: float = field(default=0.95, metadata={"help": "EMA momentum of the centroids."})
    margin_min: float = field(default=0.1, metadata={"help": "Lower clip of the dynamic margin (0 = fixed margin margin_max)."})
    margin_max: float = field(default=0.3, metadata={"help": "Upper clip of the dynamic margin."})
    loss_num_negatives: int = field(default=100, metadata={"help": "Hardest in-pool negatives per anchor."})
    negative_temperature: Optional[float] = field(default=0.1, metadata={"help": "Softmax temperature over violating negatives (1 = unweighted)."})
    positive_selection: str = field(default="sample_one", metadata={"help": "'sample_one' positive per anchor or 'all'."})
    paper_inverted_region: bool = field(default=False, metadata={"help": "The paper's literal case table (ablation)."})
    query_to_label_weight: float = field(default=1.0, metadata={"help": "Weight of the query->label-text term."})
    label_to_query_weight: float = field(default=1.0, metadata={"help": "Weight of the label-text->query term."})
    regularizer_weight: float = field(default=0.1, metadata={"help": "lambda of the regulariser R."})
    regularizer_margin: float = field(default=0.1, metadata={"help": "Margin m' of the regulariser R."})
    index_kind: str = field(default="exact", metadata={"help": "Label index saved with the model: exact | ivf | hnsw | torch (ivf or hnsw for fast CPU search at a million labels)."})
    ivf_nprobe: int = field(default=64, metadata={"help": "Lists an ivf index scans per query (mining, evaluation and the saved index; recall@100 at 1.3M labels: ~0.90 at 16, 0.96 at 64)."})


@dataclass
class PRIMETrainingArguments(XMCTrainingArguments):
    """Training defaults for PRIME at a short budget (see README: tuned on Debtags, checked on Reuters-21578)."""

    learning_rate: float = field(default=3e-4, metadata={"help": "Peak AdamW learning rate (paper Table 10: 3e-4)."})
    num_train_epochs: float = field(default=3.0, metadata={"help": "Training epochs."})
    per_device_train_batch_size: int = field(default=64, metadata={"help": "Queries per batch and process."})
    positive_sampling: str = field(default="propensity", metadata={"help": "'propensity' (paper Appx. I) or 'uniform'."})
    num_positives: int = field(default=2, metadata={"help": "Positives per query: 2 = PRIME, 1 = PRIME-lite."})
    cluster_batching: bool = field(default=True, metadata={"help": "NGAME cluster batching (paper Sec. 4.2)."})
    cluster_init_size: int = field(default=8, metadata={"help": "Queries per cluster at the first clustering."})
    cluster_curriculum_epochs: list[int] = field(default_factory=lambda: [1, 10, 25, 50, 75, 100, 125, 150, 200], metadata={"help": "Epochs at which the cluster size doubles; clustering starts at the first."})
    cluster_refresh_interval: int = field(default=1, metadata={"help": "Re-cluster every N epochs (from the memory bank)."})
    classifier_stage: bool = field(default=False, metadata={"help": "PRIME (W): after PRIME, train one-vs-all classifiers (initialised from the prototypes) with the encoder frozen; the saved model searches them."})
    classifier_epochs: float = field(default=10.0, metadata={"help": "PRIME (W) epochs ([C] 100)."})
    classifier_learning_rate: float = field(default=1e-3, metadata={"help": "PRIME (W) learning rate of the classifiers ([C] SparseAdam 1e-4 over 100 epochs)."})
    classifier_batch_size: int = field(default=256, metadata={"help": "PRIME (W) queries per batch and process ([C] 2048)."})
    classifier_max_positives: int = field(default=5, metadata={"help": "PRIME (W) positives per query and step ([C] n_pos 5)."})
    classifier_shortlist_size: int = field(default=100, metadata={"help": "PRIME (W) negatives per query, mined once from the PRIME prototype index."})


def main(argv: Optional[list[str]] = None) -> dict:
    """Parse the recipe's arguments (``argv``, default ``sys.argv[1:]``; or one ``.json`` file), train, evaluate
    on the test file, save the model to ``--output_dir`` and write ``eval_results.json``; returns the metrics."""
    model_args, data_args, training_args = parse_script_args(PRIMEModelArguments, PRIMETrainingArguments, argv, method="prime")
    data = load_data(data_args, training_args)
    model = PRIMEModel.from_encoder_pretrained(
        model_args.model_name_or_path,
        label_space_size=len(data.label_texts),
        **model_config_kwargs(model_args, data_args),
    )
    evaluator = build_evaluator(data, data_args)
    if not training_args.classifier_stage:
        return train_and_evaluate(model, data, evaluator, training_args)
    stage = dataclasses.replace(training_args, output_dir=os.path.join(training_args.output_dir, "prime"), push_to_hub=False)
    train_stage(XMCTrainer(model=model, args=stage, train_dataset=data.train, label_texts=data.label_texts, label_uids=data.label_uids,
                           **stage_evaluation(data, evaluator)), resume_argument(training_args), data.validation_record)
    collator = prepare_classifier_stage(model, data, training_args)
    stage = dataclasses.replace(
        training_args, num_train_epochs=training_args.classifier_epochs, learning_rate=training_args.classifier_learning_rate,
        per_device_train_batch_size=training_args.classifier_batch_size, weight_decay=0.0, cluster_batching=False,
        hard_negatives=0, gradient_cache_chunk_size=0,
    )
    return train_and_evaluate(model, data, evaluator, stage, data_collator=collator)


def prepare_classifier_stage(model: PRIMEModel, data, args: PRIMETrainingArguments) -> ClassifierStageCollator:
    """PRIME (W) set-up (spec Sec. 6.6): cached query embeddings and shortlist negatives from the trained PRIME model,
    classifiers initialised from its normalised prototypes, everything but the classifiers frozen; returns the batches
    of the shared classifier stage."""
    show = not args.disable_tqdm
    targets = sp.csr_matrix(data.train.targets)
    with mining_autocast(model, args.mining_precision):  # picks negatives only
        shortlist = mine_hard_negatives(model, data.train.texts, targets, top_k=args.classifier_shortlist_size, show_progress_bar=show,
                                        exclude=data.train.filter_matrix)
    vectors = model.encode_texts(data.train.texts, model.config.max_seq_length, show_progress_bar=show, desc="Caching queries", normalize=False)
    model.add_classifier(show_progress_bar=show)
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("classifier."))
    logger.info("PRIME (W): %d classifiers from the prototypes, %d shortlist negatives per query", model.config.label_space_size, shortlist.shape[1])
    return ClassifierStageCollator(targets, shortlist.astype(np.int32), query_vectors=vectors, max_positives=args.classifier_max_positives, seed=args.seed)
