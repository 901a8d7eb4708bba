"""Train DEXML (a pure dual encoder with the DecoupledSoftmax loss) on Extreme Classification Repository files.

    python training_scripts/train_dexml.py \
        --train_file trn.json.gz --test_file tst.json.gz --label_file lbl.json.gz \
        --model_name_or_path sentence-transformers/all-MiniLM-L6-v2 --output_dir out/dexml

    accelerate launch --num_processes 2 training_scripts/train_dexml.py ...   # several processes
    hf-xmc train dexml ...                                                    # the same recipe as a console command
    accelerate launch --num_processes 2 -m hf_xmc.cli train dexml ...

Writes OUT/ (a model directory loadable with AutoModel.from_pretrained(OUT, trust_remote_code=True), label index
included) and OUT/eval_results.json (test_P@k, test_nDCG@k, test_PSP@k, test_R@10/100, train_runtime,
test_samples_per_second). Every TrainingArguments flag works (--learning_rate, --num_train_epochs, --seed, ...), and
so do the training-engine flags of XMCTrainingArguments: --cluster_batching, --hard_negatives, --positive_sampling,
--gradient_cache_chunk_size, --label_pool all (DEXML's brute-force all-label mode), --resume_from_checkpoint.

--preset lf-amazontitles-1.3m (or another dataset of hf_xmc.training.presets; --preset list names them) turns the paper's
configuration for that dataset into the defaults, encoder included; flags given explicitly, or keys of a .json config,
win over it. --preset gpu sizes these defaults to ~10 minutes of one GPU (batches of 512, a step bound; docs/training.md).
"""

from dataclasses import dataclass, field
from typing import Optional

from hf_xmc.models import DEXMLModel
from hf_xmc.training import XMCTrainingArguments
from hf_xmc.training.script_utils import (
    build_evaluator,
    load_data,
    model_config_kwargs,
    parse_script_args,
    train_and_evaluate,
)


@dataclass
class DEXMLModelArguments:
    """Model arguments of DEXML (see DEXMLConfig for the meaning of each field)."""

    model_name_or_path: str = field(metadata={"help": "Encoder to start from: a Hub id or a local directory."})
    pooling: Optional[str] = field(default=None, metadata={"help": "'mean' or 'cls' pooling (default: a sentence-transformers checkpoint's own, else mean)."})
    normalize: bool = field(default=True, metadata={"help": "L2-normalise embeddings (cosine scores)."})
    temperature: float = field(default=0.05, metadata={"help": "Logit temperature (0.05 with normalisation, paper Table 7)."})
    loss: str = field(default="decoupled_softmax", metadata={"help": "decoupled_softmax | softmax | infonce | bce | soft_topk."})
    topk_k: int = field(default=5, metadata={"help": "k of the SoftTop-k loss."})
    topk_alpha: float = field(default=2.0, metadata={"help": "Sigmoid slope of SoftTop-k."})
    embedding_dropout: float = field(default=0.0, metadata={"help": "Dropout on pooled embeddings during training."})
    index_kind: str = field(default="exact", metadata={"help": "Label index saved with the model: exact | ivf | hnsw | torch (ivf or hnsw for fast CPU search at a million labels)."})
    ivf_nprobe: int = field(default=64, metadata={"help": "Lists an ivf index scans per query (mining, evaluation and the saved index; recall@100 at 1.3M labels: ~0.90 at 16, 0.96 at 64)."})


@dataclass
class DEXMLTrainingArguments(XMCTrainingArguments):
    """Training defaults for DEXML: learning rate, epochs and batch tuned on Debtags and checked on Reuters-21578; the
    hard negatives and the cluster batching measured on WordNet-XMC and checked on Debtags and Reuters
    (docs/benchmarks.md, "Dense models alone"). The paper's point is that a dual encoder matches per-label methods
    when its negatives are right (all labels, or hard ones); in-batch negatives alone hardly moved the head of a
    42K-label task."""

    learning_rate: float = field(default=3e-4, metadata={"help": "Peak AdamW learning rate."})
    num_train_epochs: float = field(default=3.0, metadata={"help": "Training epochs."})
    per_device_train_batch_size: int = field(default=64, metadata={"help": "Queries per batch and process."})
    hard_negatives: int = field(default=1, metadata={"help": "Hard negatives per query drawn from a mined shortlist (0 = in-batch only; ignored with --label_pool all, where every label is a negative)."})
    hard_negative_start_epoch: float = field(default=0.05, metadata={"help": "When the shortlist is first mined, in epochs (a twentieth into the first: after the encoder has seen the task)."})
    hard_negative_refresh_interval: float = field(default=1.0, metadata={"help": "Re-mine the shortlist every N epochs (a fraction: several times an epoch)."})
    cluster_batching: bool = field(default=True, metadata={"help": "NGAME cluster batching: batches of similar queries, so the in-batch negatives are hard too (from --cluster_min_labels labels on; off with --label_pool all)."})
    cluster_min_labels: int = field(default=10_000, metadata={"help": "Cluster batching only on label spaces of at least this many labels (XMC's lower end): it paid on WordNet-XMC's 53K and cost dense P@1 on Debtags' 597 and Reuters' 90."})
    cluster_start_epoch: Optional[float] = field(default=0.05, metadata={"help": "First clustering, in epochs (with the first mining pass, from its query vectors); re-clustered every --cluster_refresh_interval epochs after."})
    cluster_init_size: int = field(default=16, metadata={"help": "Queries per cluster (4 clusters per batch of 64)."})
    cluster_curriculum_epochs: list[int] = field(default_factory=list, metadata={"help": "Epochs at which the cluster size doubles (none: the same size throughout)."})
    cluster_refresh_interval: int = field(default=1, metadata={"help": "Re-cluster every N epochs (from the memory bank of the epoch's query embeddings)."})


def main(argv: Optional[list[str]] = None) -> dict:
    """Parse the recipe's arguments (``argv``, default ``sys.argv[1:]``; or one ``.json`` file), train, evaluate
    on the test file, save the model to ``--output_dir`` and write ``eval_results.json``; returns the metrics."""
    model_args, data_args, training_args = parse_script_args(DEXMLModelArguments, DEXMLTrainingArguments, argv, method="dexml")
    data = load_data(data_args, training_args)
    model = DEXMLModel.from_encoder_pretrained(
        model_args.model_name_or_path,
        **model_config_kwargs(model_args, data_args),
    )
    return train_and_evaluate(model, data, build_evaluator(data, data_args), training_args)
