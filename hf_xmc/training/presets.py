"""Paper configurations per dataset for the training recipes: ``--preset lf-amazontitles-1.3m``; and one budget,
``--preset gpu`` (the recipe's defaults sized to ~10 minutes of one GPU; see :data:`GPU_PRESETS`).

A preset is what a method's paper gives for one Extreme Classification Repository dataset (and, where the paper is
silent, the method's official code, as recorded in ``shared/specs/``), written as values of the recipe's own
arguments. The recipe parses them as *defaults*: a flag on the command line, or a key of a JSON config, wins::

    hf-xmc train prime --preset lf-amazontitles-1.3m --train_file trn.json.gz --test_file tst.json.gz \\
        --label_file lbl.json.gz --test_filter_file filter_labels_test.txt --output_dir out/prime --bf16 true
    python training_scripts/train_unidec.py config.json      # {"preset": "lf-amazon-131k", "train_file": ...}

Every value below cites its source: ``prime.md``, ``dexml.md``, ``unidec.md`` (the specs, section or table of the
paper) or ``official_code_facts.md`` (the official code). What no source gives keeps the recipe's default; each
method's table says which. Common to all presets:

* The encoder is the paper's (a Hub id: a machine without network passes ``--model_name_or_path`` of a local copy).
* Batch sizes and UniDEC's label pool are the paper's *global* values, split over the processes of the run
  (``WORLD_SIZE``, set by ``accelerate launch``): 2 processes on LF-AmazonTitles-1.3M run PRIME with
  ``--per_device_train_batch_size 1600``.
* Mixed precision follows the device, not the preset: ``--bf16`` defaults to auto (bfloat16 autocast on a GPU with
  bf16 or a CPU with AMX or AVX512-BF16, float32 elsewhere); ``--fp16 true`` is what the official codes train with on a GPU,
  ``--bf16 false`` keeps float32.
* The filter file of the dataset (``filter_labels_test.txt``) is not named by the preset: pass
  ``--test_filter_file``, as the published numbers remove those pairs.
* Propensity constants are the Extreme Classification Repository's per dataset family (``official_code_facts.md``
  section 1, pyxclib): Amazon 0.6 / 2.6, Wikipedia categories 0.5 / 0.4, WikiSeeAlso 0.55 / 1.5 (``unidec.md``
  section 6 lists 0.55 / 1.5 for Amazon, which the repository's configs contradict). They are read from the metrics'
  table (``hf_xmc.metrics.core.DATASET_PROPENSITY``, through ``propensity_constants``), so PSP@k of a preset and of
  ``propensity_constants(<dataset name>)`` agree. Long-text datasets read
  ``title`` and ``content`` of the points and labels (NGAME's ``extract_text_and_labels``, ibid.).

Memory: a preset is a few dozen Python scalars; nothing here scales with the data.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

from ..metrics import propensity_constants

__all__ = ["DATASETS", "GPU_PRESETS", "PRESETS", "known_presets", "preset_values"]


def _dataset(name: str, text_fields: str) -> dict[str, Any]:
    """The facts of dataset ``name``: its card name, the JSON fields read as query and label text, and its propensity
    constants from the metrics' table (exact name: a dataset missing there is a ``KeyError`` at import)."""
    a, b = propensity_constants(name, exact=True)
    return {"dataset_name": name, "text_fields": text_fields, "label_text_fields": text_fields, "propensity_a": a, "propensity_b": b}


#: Dataset facts every method's preset shares: the name on the model card, the JSON fields read as text, the
#: propensity constants of PSP@k (and of propensity sampling). Sources: official_code_facts.md section 1.
DATASETS: dict[str, dict[str, Any]] = {
    name.lower(): _dataset(name, fields) for name, fields in (
        ("LF-AmazonTitles-131K", "title"),
        ("LF-Amazon-131K", "title,content"),
        ("LF-AmazonTitles-1.3M", "title"),
        ("LF-WikiTitles-500K", "title"),
        ("LF-Wikipedia-500K", "title,content"),
        ("LF-WikiSeeAlso-320K", "title,content"),
        ("LF-WikiSeeAlsoTitles-320K", "title"),
    )
}

# ------------------------------------------------------------------------------------------------------------- PRIME
#: PRIME (prime.md). Per dataset: Table 10 (section 6.3). Not given anywhere, so the recipe's defaults stay: the
#: label token budget (the official code uses one max_length for queries and labels: the same here), the model
#: selection, the index kind (exact, as the paper's Faiss IndexFlatIP).
PRIME_COMMON: dict[str, Any] = {
    "model_name_or_path": "sentence-transformers/msmarco-distilbert-base-v4",  # 3.1: the 66M DistilBERT of NGAME [P/C]
    "pooling": "mean",  # 3.1 [P]
    "num_positives": 2,  # 5.2: PRIME samples two positives per query (1 = PRIME-lite)
    "positive_sampling": "propensity",  # 5.1, Appx. I: drawn by inverse propensity
    "margin_min": 0.1,  # Table 10: gamma_min
    "margin_max": 0.3,  # Table 10: gamma_max
    "loss_num_negatives": 100,  # 4.5 [C]: top-100 in-batch negatives per anchor
    "negative_temperature": 0.1,  # 4.5 [C]: softmax(s_n / 0.1) over the violators
    "regularizer_weight": 0.1,  # 4.8, Appx. G: lambda
    "regularizer_margin": 0.1,  # 4.7 [C]: m'
    "centroid_momentum": 0.95,  # 3.4, Appx. G: alpha
    "lpn_intermediate_size": 1024,  # 3.2: FFN 1024
    "lpn_dropout": 0.1,  # 3.2
    "warmup_steps": 100,  # 6.2 [C]: 100 linear warm-up steps (not a fraction)
    "lr_scheduler_type": "linear",  # 6.2 [C]: then linear decay to 0
    "weight_decay": 0.01,  # 6.2, Appx. G (none on the free vectors: the model excludes them)
    "cluster_batching": True,  # 5.4: NGAME batching
    "cluster_batch_mode": "concat",  # 5.4 [C]: shuffled clusters concatenated, cut into batches
    "cluster_init_size": 4,  # 5.4 [C]: sampling_init_cluster_size
    "cluster_curriculum_epochs": [10, 25, 50, 75, 100, 125, 150, 200],  # 5.4 [C]: size doubles; first clustering at 10
    "cluster_refresh_interval": 5,  # 5.4 [C]: re-cluster every 5 epochs from epoch 10
}
PRIME_PRESETS: dict[str, dict[str, Any]] = {  # prime.md 6.3, Table 10 (one A100: the batch is global)
    "lf-amazontitles-131k": {"num_free_vectors": 65536, "per_device_train_batch_size": 3200, "num_train_epochs": 300, "learning_rate": 3e-4, "max_seq_length": 32},
    "lf-amazon-131k": {"num_free_vectors": 65536, "per_device_train_batch_size": 512, "num_train_epochs": 300, "learning_rate": 3e-4, "max_seq_length": 128},
    "lf-amazontitles-1.3m": {"num_free_vectors": 131072, "per_device_train_batch_size": 3200, "num_train_epochs": 300, "learning_rate": 3e-4, "max_seq_length": 32},
    "lf-wikititles-500k": {"num_free_vectors": 65536, "per_device_train_batch_size": 3200, "num_train_epochs": 300, "learning_rate": 2e-4, "max_seq_length": 32},
    "lf-wikipedia-500k": {"num_free_vectors": 65536, "per_device_train_batch_size": 512, "num_train_epochs": 50, "learning_rate": 1e-4, "max_seq_length": 256},
    "lf-wikiseealso-320k": {"num_free_vectors": 65536, "per_device_train_batch_size": 1024, "num_train_epochs": 200, "learning_rate": 1e-4, "max_seq_length": 128},
}

# ------------------------------------------------------------------------------------------------------------- DEXML
#: DEXML (dexml.md), the main method: DecoupledSoftmax over all labels with the gradient cache. Per dataset: Table 7
#: (section 5; "treat Table 7 as the paper's preset", its batch sizes as global ones) and the normalisation the code
#: ties to the temperature (section 2: cosine with tau 0.05, raw dot product with tau 1); labels get the queries'
#: token budget (section 10). Not given, so the recipe's defaults stay: the positives per query (the code samples
#: one per query and step), the index kind. LF-Amazon-131K, the Wiki titles sets and LF-WikiSeeAlso-320K have no
#: DEXML configuration in the paper; EURLex-4K (Table 7) is not an LF dataset and has no preset. Cost: every step
#: re-encodes all L labels and scores each process's queries against all of them (per process 4 bytes x batch / G x
#: L of logits, ~2.7 GB at 1.3M labels on the paper's 16 GPUs): the paper's hardware, not a 2-core machine's.
DEXML_COMMON: dict[str, Any] = {
    "model_name_or_path": "distilbert/distilbert-base-uncased",  # 2 [CODE]: tf distilbert-base-uncased
    "pooling": "cls",  # 2 [CODE]: tf_pooler cls
    "loss": "decoupled_softmax",  # 3.4: the proposed loss
    "topk_alpha": 2.0,  # Table 7: alpha (SoftTop-k only)
    "label_pool": "all",  # 4: all L labels are the negatives of every step ("dist-de-all")
    "num_train_epochs": 100,  # 5: 100 epochs for every experiment
    "warmup_steps": 0.1,  # 5 [CODE]: warmup 0.1 of the steps
    "lr_scheduler_type": "linear",  # 5: linear decay with warm-up
    "weight_decay": 0.01,  # 5
}
DEXML_PRESETS: dict[str, dict[str, Any]] = {  # dexml.md section 5, Table 7; tau / normalize: sections 2, 3.6
    "lf-amazontitles-131k": {"max_seq_length": 32, "learning_rate": 4e-4, "per_device_train_batch_size": 4096, "embedding_dropout": 0.0, "gradient_cache_chunk_size": 2048, "temperature": 0.05, "normalize": True},
    "lf-wikipedia-500k": {"max_seq_length": 128, "learning_rate": 4e-4, "per_device_train_batch_size": 4096, "embedding_dropout": 0.1, "gradient_cache_chunk_size": 2048, "temperature": 1.0, "normalize": False},
    "lf-amazontitles-1.3m": {"max_seq_length": 32, "learning_rate": 8e-4, "per_device_train_batch_size": 8192, "embedding_dropout": 0.1, "gradient_cache_chunk_size": 1024, "temperature": 1.0, "normalize": False},
}

# ------------------------------------------------------------------------------------------------------------ UniDEC
#: UniDEC (unidec.md; the paper leaves much open, official_code_facts.md section 4 fills it). Per dataset: Table 1
#: (per-head d) and Table 2 (|Q_B| = batch, |L_B| = label pool). Table 2 reports no |Q_B| / |L_B| for
#: LF-AmazonTitles-131K, LF-WikiTitles-500K and LF-WikiSeeAlsoTitles-320K: those keep the recipe's batch (64) and pool
#: cap (256) (LF-Amazon-131K, on the same queries, used 576 / 3000); LF-Wikipedia-500K's 221 / 3000 are Table 2's
#: DePSL row, the only configuration the paper reports there (UniDEC's Table 8 row gives none). Not given, so the
#: recipe's defaults stay: the label token budget (= max_seq_length), the classifier's initialisation (xavier, as the
#: code). The code's per-dataset classifier dropout (0.2 on LF-WikiSeeAlso-320K) has no flag here. DePSL on
#: LF-AmazonTitles-1.3M (Table 2: 2200 / 4000, d 384) is this preset with ``--use_classifier false
#: --per_device_train_batch_size 2200 --max_label_pool 4000 --projection_dim 384``.
UNIDEC_COMMON: dict[str, Any] = {
    "model_name_or_path": "sentence-transformers/msmarco-distilbert-base-v4",  # official_code_facts 4 (2.1: 6-layer DistilBERT)
    "pooling": "mean",  # official_code_facts 4: mean-pooled SentenceTransformer
    "learning_rate": 1e-4,  # 4: encoder lr
    "head_learning_rate_multiplier": 2.0,  # 4: projections g1, g2 at 2e-4
    "classifier_init": "xavier",  # official_code_facts 4: Psi xavier-initialised (the recipe's auto starts it from the label texts)
    "classifier_learning_rate": 1e-3,  # 4: Psi at 1e-3
    "lr_scheduler_type": "cosine",  # 4: cosine annealing with warm-up
    "num_train_epochs": 150,  # official_code_facts 4: README example (the paper gives none)
    "warmup_steps": 0.02,  # official_code_facts 4: warm-up of 3 epochs = 3 / 150 of training
    "weight_decay": 0.05,  # official_code_facts 4: wd 0.05 (the paper gives none)
    "head_dropout": 0.1,  # 2.2: Dropout(0.1) in g1 and g2
    "logit_scale_init": 18.0,  # official_code_facts 4: learnable temperature multiplier, 18
    "de_loss": "decoupled_softmax",  # 3.4, Table 3 headline: DE loss DS
    "clf_loss": "decoupled_softmax",  # 3.4, Table 3 headline: CLF loss DS + BCE
    "clf_bce_weight": 1.0,  # 3.4: the auxiliary BCE of the headline configuration
    "de_query_to_label_weight": 0.5,  # 3.6: lambda_D = 0.5, all datasets
    "clf_query_to_label_weight": 0.5,  # 3.7: lambda_C = 0.5
    "de_weight": 0.5,  # 3.8: lambda = 0.5
    "search_mode": "concat",  # 5: [Phi_D ; N(Phi_C)] search
    "label_pool": "psl",  # 3.3, 3.5: pick-some-labels pools
    "num_positives": 3,  # 3.5 (beta = 3), official_code_facts 4: num_pos 3
    "positive_sampling": "uniform",  # 3.5: uniform sample; official code np.random.choice
    "hard_negatives": 6,  # 4: eta "typically 6"
    "hard_negative_top_k": 30,  # 3.2: |H_i| = eta * tau = 30
    "hard_negative_start_epoch": 5,  # official_code_facts 4: clustering.start_epoch 5 (shortlist from then)
    "hard_negative_refresh_interval": 5,  # 4, Alg. 1: tau = 5
    "cluster_batching": True,  # 3.5: each batch a cluster of similar queries (DE space)
    "cluster_batch_mode": "one_per_batch",  # 3.5, official_code_facts 4: one cluster per batch, leaf ~ batch size
    "cluster_curriculum_epochs": [5],  # official_code_facts 4: clustering starts at epoch 5 (no curriculum)
    "cluster_start_epoch": None,  # ibid.: at the curriculum's first epoch (the recipe's default starts a twentieth in)
    "cluster_min_labels": 0,  # every paper dataset has 131K+ labels; the recipe's gate is for small label spaces
    "cluster_refresh_interval": 5,  # 4, Alg. 1: re-cluster every tau = 5 epochs
}
UNIDEC_PRESETS: dict[str, dict[str, Any]] = {  # unidec.md section 4 table (Tables 1, 2); token budgets: 2.1 [our default]
    "lf-amazon-131k": {"projection_dim": 384, "per_device_train_batch_size": 576, "max_label_pool": 3000, "max_seq_length": 256},
    "lf-amazontitles-131k": {"projection_dim": 384, "max_seq_length": 32},
    "lf-amazontitles-1.3m": {"projection_dim": 256, "per_device_train_batch_size": 1098, "max_label_pool": 3000, "max_seq_length": 32},
    "lf-wikititles-500k": {"projection_dim": 384, "max_seq_length": 32},
    "lf-wikipedia-500k": {"projection_dim": 384, "per_device_train_batch_size": 221, "max_label_pool": 3000, "max_seq_length": 256},
    "lf-wikiseealso-320k": {"projection_dim": 384, "per_device_train_batch_size": 677, "max_label_pool": 3500, "max_seq_length": 256},
    "lf-wikiseealsotitles-320k": {"projection_dim": 384, "max_seq_length": 32},
}

#: Method -> (values of every preset of the method, per-dataset values).
PRESETS: dict[str, tuple[dict[str, Any], dict[str, dict[str, Any]]]] = {
    "prime": (PRIME_COMMON, PRIME_PRESETS),
    "dexml": (DEXML_COMMON, DEXML_PRESETS),
    "unidec": (UNIDEC_COMMON, UNIDEC_PRESETS),
}

# ------------------------------------------------------------------------------------------------------ one GPU
#: ``--preset gpu``: not a paper's configuration but a *budget*: the recipe's own defaults (its negatives, batching,
#: schedule and encoder, which the 40-CPU-minute defaults were tuned with) with the batch a GPU fills and a step count
#: sized to about 10 minutes of one H100 on a WordNet-XMC-sized task (36K training titles, 53K labels), any dataset.
#: Steps, not epochs, bound it, so a larger training set does not take longer to train (its mining and evaluation
#: passes, which encode every label and query, do). Sizing, from the one GPU figure the project has
#: (``benchmarks/results/scale_gpu.json``: DEXML, all-MiniLM-L6-v2, bf16, ~4,400 texts a second through forward and
#: backward on one H200, tokenisation included): a DEXML / UniDEC step of 512 queries encodes ~1,500 texts (query,
#: positive, mined negative): ~0.35 s, so 1,200 steps are ~7 minutes, leaving ~3 for loading, the mining passes, the
#: lexical channel and the evaluation; PRIME's two positives and SiameseXML's label-side batches cost ~1.3x more per
#: step: 900. **Not measured on a GPU yet** (no session that built it had one): ``docs/benchmarks.md`` says so.
#: Learning rates: DEXML's Table 7 value at batch 4,096 (4e-4); the others keep the recipe's (PRIME's and UniDEC's
#: papers train larger batches at the same or a smaller rate). Mixed precision follows the device (``--bf16`` auto).
GPU_PRESETS: dict[str, dict[str, Any]] = {
    "dexml": {"per_device_train_batch_size": 512, "max_steps": 1200, "learning_rate": 4e-4, "eval_batch_size": 1024},
    "unidec": {"per_device_train_batch_size": 512, "max_steps": 1200, "max_label_pool": 1536, "eval_batch_size": 1024},  # pool: ~3 per query (3.5)
    "prime": {"per_device_train_batch_size": 512, "max_steps": 900, "classifier_batch_size": 2048, "eval_batch_size": 1024},  # (W): [C] 2048
    "siamesexml": {"per_device_train_batch_size": 512, "max_steps": 900, "classifier_batch_size": 1024, "eval_batch_size": 1024},
}
GPU_PRESET = "gpu"

#: Values that are global quantities in the papers, split over the processes of a run.
PER_PROCESS_SPLIT = ("per_device_train_batch_size", "max_label_pool")


def known_presets(method: str) -> list[str]:
    """Names of ``method``'s presets: the papers' datasets in table order, then ``gpu`` (empty for a method without
    any)."""
    return (list(PRESETS[method][1]) if method in PRESETS else []) + ([GPU_PRESET] if method in GPU_PRESETS else [])


def preset_values(method: str, name: str, world_size: Optional[int] = None) -> dict[str, Any]:
    """Argument values of ``method``'s preset ``name``: the dataset's facts, the method's common values, the
    dataset's values; global batch sizes and pools divided over ``world_size`` processes (default: ``WORLD_SIZE``,
    1 without a launcher), rounded up. ``KeyError`` naming the known presets otherwise."""
    if name not in known_presets(method):
        known = ", ".join(known_presets(method)) or "none"
        raise KeyError(f"unknown preset {name!r} for {method} (known: {known})")
    if name == GPU_PRESET:  # a budget on the recipe's defaults: per process, nothing split
        return dict(GPU_PRESETS[method])
    common, per_dataset = PRESETS[method]
    values = {**DATASETS[name], **common, **per_dataset[name]}
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else int(world_size)
    for key in PER_PROCESS_SPLIT:
        if key in values and world_size > 1:
            values[key] = math.ceil(values[key] / world_size)
    values = {key: (list(v) if isinstance(v, list) else v) for key, v in values.items()}  # callers may mutate lists
    return values
