"""Train UniDEC (one encoder, a dual-encoder head and an extreme-classifier head, pick-some-labels pools) on Extreme
Classification Repository files.

    accelerate launch --config_file training_scripts/accelerate/single_process.yaml training_scripts/train_unidec.py \
        --train_file trn.json.gz --test_file tst.json.gz --label_file lbl.json.gz \
        --model_name_or_path sentence-transformers/all-MiniLM-L6-v2 --output_dir out/unidec

    accelerate launch --config_file training_scripts/accelerate/multi_process.yaml training_scripts/train_unidec.py ...
    python training_scripts/train_unidec.py ...                 # one process, no launcher
    hf-xmc train unidec ...                                     # the same recipe as a console command
    accelerate launch -m hf_xmc.cli train unidec ...

Writes OUT/ (a model directory loadable with AutoModel.from_pretrained(OUT, trust_remote_code=True), with the index
over the concatenated [DE ; classifier] label vectors) and OUT/eval_results.json (test_P@k, test_nDCG@k, test_PSP@k,
test_R@10/100, train_runtime, test_samples_per_second).

Defaults follow the paper's recipe at a short budget: per query 3 positives drawn with replacement by inverse
propensity, the batch's other positives, a pool capped at 256 labels per process; learning rates encoder / heads /
classifier = lr / 2 lr / 1e-3, cosine schedule with warm-up. Negatives and batches are DEXML's (the paper's 6 from a
DE-head top 30 from the second epoch never start within a short budget): one hard negative per query from its DE-head
top 100, mined a twentieth of an epoch in and every epoch after, and, on label spaces of 10,000+ labels, NGAME cluster
batching (clusters of 16 from the same point; WordNet-XMC dense P@1 32.0 -> 42.2 at half the wall time, see
docs/benchmarks.md); query->label terms only
(--de_query_to_label_weight 0.5 --clf_query_to_label_weight 0.5 adds the paper's symmetric label->query terms, which
lost on both datasets at this budget, see README). The classifier vectors start from the label texts
(--classifier_init auto; xavier is the official code's: see AUTO_CLASSIFIER_INIT). --use_classifier false trains DePSL (the DE-only ablation). Every TrainingArguments flag and every engine flag of XMCTrainingArguments works.

--preset lf-amazontitles-1.3m (or another dataset of hf_xmc.training.presets; --preset list names them) turns the paper's
configuration for that dataset into the defaults, encoder included; flags given explicitly, or keys of a .json config,
win over it. --preset gpu sizes these defaults to ~10 minutes of one GPU (batches of 512, a step bound; docs/training.md).
"""

from dataclasses import dataclass, field
from typing import Optional

from hf_xmc.models import UniDECModel
from hf_xmc.training import XMCTrainingArguments
from hf_xmc.training.script_utils import (
    build_evaluator,
    load_data,
    model_config_kwargs,
    parse_script_args,
    train_and_evaluate,
)


@dataclass
class UniDECModelArguments:
    """Model arguments of UniDEC (see UniDECConfig for the meaning of each field)."""

    model_name_or_path: str = field(metadata={"help": "Encoder to start from: a Hub id or a local directory."})
    pooling: Optional[str] = field(default=None, metadata={"help": "'mean' or 'cls' pooling (default: a sentence-transformers checkpoint's own, else mean)."})
    projection_dim: int = field(default=384, metadata={"help": "Output size of each head (paper: 384; 256 on LF-AmazonTitles-1.3M)."})
    head_dropout: float = field(default=0.1, metadata={"help": "Dropout of the heads."})
    use_classifier: bool = field(default=True, metadata={"help": "False = DePSL, the DE-only model."})
    de_loss: str = field(default="decoupled_softmax", metadata={"help": "Multi-class loss of the DE head: decoupled_softmax | softmax (SupCon)."})
    clf_loss: str = field(default="decoupled_softmax", metadata={"help": "Multi-class loss of the classifier head."})
    clf_bce_weight: float = field(default=1.0, metadata={"help": "Weight of the auxiliary BCE on classifier scores (0 = off)."})
    logit_scale_init: float = field(default=18.0, metadata={"help": "Initial learnable logit scale of each head."})
    learnable_logit_scale: bool = field(default=True, metadata={"help": "Train the logit scales."})
    de_query_to_label_weight: float = field(default=1.0, metadata={"help": "lambda_D (1 - it weighs the label->query term; paper 0.5, see README)."})
    clf_query_to_label_weight: float = field(default=1.0, metadata={"help": "lambda_C (paper 0.5)."})
    de_weight: float = field(default=0.5, metadata={"help": "lambda: weight of the DE loss against the classifier loss."})
    search_mode: str = field(default="concat", metadata={"help": "Saved index: concat (DE + classifier) | de | classifier."})
    classifier_init: str = field(default="auto", metadata={"help": "auto (label_text, chosen on validation on Debtags, Reuters and WordNet-XMC) | xavier (official code) | label_text (Psi_l from the label's text: a label seen a few times in a short run starts from its text, not from noise)."})
    head_learning_rate_multiplier: float = field(default=2.0, metadata={"help": "Head learning rate / encoder learning rate."})
    classifier_learning_rate: Optional[float] = field(default=1e-3, metadata={"help": "Learning rate of the classifier vectors."})
    index_kind: str = field(default="exact", metadata={"help": "Label index saved with the model: exact | ivf | hnsw | torch (ivf or hnsw for fast CPU search at a million labels)."})
    ivf_nprobe: int = field(default=64, metadata={"help": "Lists an ivf index scans per query (mining, evaluation and the saved index; recall@100 at 1.3M labels: ~0.90 at 16, 0.96 at 64)."})


@dataclass
class UniDECTrainingArguments(XMCTrainingArguments):
    """Training defaults for UniDEC at a short budget (see README: tuned on Debtags, checked on Reuters-21578)."""

    learning_rate: float = field(default=3e-4, metadata={"help": "Peak learning rate of the encoder (heads: x2, classifier: its own)."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Schedule after warm-up (paper: cosine)."})
    num_train_epochs: float = field(default=3.0, metadata={"help": "Training epochs."})
    per_device_train_batch_size: int = field(default=64, metadata={"help": "Queries per batch and process."})
    label_pool: str = field(default="psl", metadata={"help": "'psl' (pick-some-labels) or 'in_batch' ('all' is DEXML's mode)."})
    max_label_pool: int = field(default=256, metadata={"help": "Most labels in a pool per process (paper: about 3 per query)."})
    positive_sampling: str = field(default="propensity", metadata={"help": "'propensity' or 'uniform' positive draws."})
    num_positives: int = field(default=3, metadata={"help": "beta: positives drawn per query (with replacement)."})
    # DEXML's negatives and batches (docs/benchmarks.md, "Dense models alone"): the paper's 6 negatives from a top 30,
    # mined and clustered from the second epoch, never started within a short budget and, started early, did not pay
    hard_negatives: int = field(default=1, metadata={"help": "eta: hard negatives per query per step, from the DE-head shortlist (0 = none; paper 6)."})
    hard_negative_top_k: int = field(default=100, metadata={"help": "Shortlist per query the negatives are drawn from (paper: eta x refresh interval = 30)."})
    hard_negative_start_epoch: float = field(default=0.05, metadata={"help": "When the shortlist is first mined, in epochs (a twentieth into the first; paper: from epoch 5)."})
    hard_negative_refresh_interval: float = field(default=1, metadata={"help": "Re-mine every N epochs (a fraction: several times an epoch)."})
    cluster_batching: bool = field(default=True, metadata={"help": "Batches of similar queries (clustered in the DE space; from --cluster_min_labels labels on)."})
    cluster_min_labels: int = field(default=10_000, metadata={"help": "Cluster batching only on label spaces of at least this many labels: it paid on WordNet-XMC's 53K and cost dense P@1 on Debtags' 597 and Reuters' 90."})
    cluster_start_epoch: Optional[float] = field(default=0.05, metadata={"help": "First clustering, in epochs (with the first mining pass, from its query vectors)."})
    cluster_init_size: int = field(default=16, metadata={"help": "Queries per cluster (4 clusters per batch of 64)."})
    cluster_curriculum_epochs: list[int] = field(default_factory=list, metadata={"help": "Epochs at which the cluster size doubles (none: the same size throughout)."})
    cluster_refresh_interval: int = field(default=1, metadata={"help": "Re-cluster every N epochs."})


#: What ``--classifier_init auto`` resolves to: the classifier vectors start from the label texts on every label space.
#: On WordNet-XMC (53K labels, a third of an epoch) most labels get a few updates, and xavier vectors left the tail at
#: noise (dense PSP@5 38.4 -> 51.5, fused P@1 44.3 -> 47.6 from the text). Below 10,000 labels ``auto`` used to mean
#: xavier, chosen on Debtags' test split; re-decided on the validation splits (2026-12-05, one epoch, DS + BCE) the label
#: texts win there too: val P@1 + PSP@5 158.52 against 158.35 on Debtags, 180.71 against 179.59 on Reuters (test: 158.98
#: against 157.93, 175.60 against 173.88). See docs/benchmarks.md (UniDEC).
AUTO_CLASSIFIER_INIT = "label_text"


def resolve_classifier_init(classifier_init: str) -> str:
    """``auto`` -> :data:`AUTO_CLASSIFIER_INIT`; other values as given."""
    return AUTO_CLASSIFIER_INIT if classifier_init == "auto" else classifier_init


def main(argv: Optional[list[str]] = None) -> dict:
    """Parse the recipe's arguments (``argv``, default ``sys.argv[1:]``; or one ``.json`` file), train, evaluate
    on the test file, save the model to ``--output_dir`` and write ``eval_results.json``; returns the metrics."""
    model_args, data_args, training_args = parse_script_args(UniDECModelArguments, UniDECTrainingArguments, argv, method="unidec")
    data = load_data(data_args, training_args)
    model_args.classifier_init = resolve_classifier_init(model_args.classifier_init)
    model = UniDECModel.from_encoder_pretrained(
        model_args.model_name_or_path,
        label_space_size=len(data.label_texts),
        **model_config_kwargs(model_args, data_args),
    )
    return train_and_evaluate(model, data, build_evaluator(data, data_args), training_args)
