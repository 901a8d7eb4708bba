"""Train SiameseXML (siamese encoder, label-text / centroid shortlist, one re-parameterised classifier per label) on
Extreme Classification Repository files.

    accelerate launch --config_file training_scripts/accelerate/single_process.yaml training_scripts/train_siamesexml.py \
        --train_file trn.json.gz --test_file tst.json.gz --label_file lbl.json.gz \
        --model_name_or_path sentence-transformers/all-MiniLM-L6-v2 --output_dir out/siamesexml

    python training_scripts/train_siamesexml.py ... --encoder_type boe      # the paper's bag-of-embeddings encoder
    hf-xmc train siamesexml ...                                            # the same recipe as a console command

Writes OUT/ (a model directory loadable with AutoModel.from_pretrained(OUT, trust_remote_code=True): encoder, residual
block, label-text vectors, centroids, refinement vectors and the shortlist index over [label texts ; centroids]) and
OUT/eval_results.json (test_P@k, test_nDCG@k, test_PSP@k, test_R@10/100, train_runtime, test_samples_per_second).

The four modules run in order. Module I (--num_train_epochs epochs at --learning_rate, --per_device_train_batch_size
labels per batch): batches over labels drawn in proportion to their points (--label_sampling_power 1; [P] 0.45), one
positive point per label and a second one for the centroid estimate, DEXML's decoupled softmax (scale 20) of each
positive against the batch's other labels (--siamese_loss likelihood: [P]'s point likelihood, c 0.9, d 1.5, with the
hardest in-batch negative per row).
Module II: the encoder is frozen; label-text vectors smoothed by the label random walk (400 hops, restart 0.8, top
10), label centroids, and a shortlist per training point from the index over both plus its 50 nearest training
points' votes, its positives and its --train_filter_file pairs left out (kept under OUT/module2 when the run saves
checkpoints, with a fingerprint of the targets, the filter, the validation split and the seed: a resumed run reads
them back, and one with other inputs, e.g. another --seed, is refused in one line). Module III: w_l = N(z~_l + eta_l), eta = 0. Module IV (--classifier_epochs at
--classifier_learning_rate, --classifier_batch_size points per batch): eta and the residual block on each point's
positives (at most 10) and all of its 100 shortlist negatives, DEXML's decoupled softmax of 20 cos (--classifier_loss
likelihood --classifier_negatives hardest: [P]'s point likelihood, c 0.75, d 3, over the 3 x |P_i| hardest;
--classifier_negatives threshold: [C]'s mask). Prediction fuses 0.5 exp(5 (cos - 1)) + 0.5 sigmoid(shortlist similarity) over a 500-label shortlist.
Every TrainingArguments flag works (it applies to Module I; Module IV takes its own epochs, rate and batch size).
--preset gpu sizes these defaults to ~10 minutes of one GPU (batches of 512, a step bound; docs/training.md).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import scipy.sparse as sp

from hf_xmc.models import SiameseXMLModel
from hf_xmc.models.provenance import array_digest, fingerprint_of
from hf_xmc.training import XMCTrainer, XMCTrainingArguments
from hf_xmc.training.classifier_stage import ClassifierStageCollator
from hf_xmc.training.script_utils import (
    build_evaluator,
    load_data,
    model_config_kwargs,
    parse_script_args,
    resume_argument,
    stage_evaluation,
    stage_finished,
    train_and_evaluate,
    train_stage,
)
from hf_xmc.training.siamesexml import (
    LabelDrawDataset,
    ModuleIIStore,
    SiameseLabelCollator,
    bag_of_embeddings_document_frequency,
    build_label_state,
    label_correlation_matrix,
    mine_classifier_shortlist,
    mine_label_neighbors,
)

logger = logging.getLogger(__name__)


@dataclass
class SiameseXMLModelArguments:
    """Model arguments of SiameseXML (see SiameseXMLConfig for the meaning of each field)."""

    model_name_or_path: str = field(metadata={"help": "Encoder to start from (Hub id or local directory); with --encoder_type boe its tokenizer and token embeddings."})
    encoder_type: str = field(default="transformer", metadata={"help": "transformer (any HF encoder, mean-pooled) | boe (the paper's TF-IDF bag of token embeddings + GELU)."})
    boe_embedding_dim: int = field(default=0, metadata={"help": "D of the boe encoder (0 = the encoder's hidden size, whose token embeddings then start the table)."})
    pooling: Optional[str] = field(default=None, metadata={"help": "'mean' or 'cls' pooling (transformer) (default: a sentence-transformers checkpoint's own, else mean)."})
    residual_dropout: float = field(default=0.5, metadata={"help": "Dropout in the residual block ([C] 0.5)."})
    siamese_c: float = field(default=0.9, metadata={"help": "Module I likelihood constant c ([C] 0.9)."})
    siamese_d: float = field(default=1.5, metadata={"help": "Module I likelihood constant d ([C] 1.5)."})
    siamese_hard_negatives: int = field(default=1, metadata={"help": "Module I in-batch hard negatives per row ([C] 1, [P] 1-5)."})
    siamese_loss: str = field(default="softmax", metadata={"help": "Module I loss: softmax (DEXML's decoupled softmax of --siamese_scale x cos over the in-batch labels) | likelihood ([P] Eq. 5, c and d above, --siamese_hard_negatives)."})
    siamese_scale: float = field(default=20.0, metadata={"help": "Logit scale of the softmax Module I loss (1 / temperature)."})
    siamese_centroid_weight: float = field(default=0.3, metadata={"help": "Weight of the centroid term (1 - beta, [P] beta 0.7)."})
    classifier_c: float = field(default=0.75, metadata={"help": "Module IV likelihood constant c ([C] 0.75)."})
    classifier_d: float = field(default=3.0, metadata={"help": "Module IV likelihood constant d ([C] 3)."})
    classifier_negatives: str = field(default="all", metadata={"help": "all (every shortlist negative; with the softmax, +2.4 dense P@1 on Debtags) | hardest ([P]: kappa x |P_i| hardest) | threshold ([C]: every negative with loss >= 0.05)."})
    classifier_negative_threshold: float = field(default=0.05, metadata={"help": "[C]'s negative-loss threshold."})
    classifier_hard_negative_factor: int = field(default=3, metadata={"help": "kappa of --classifier_negatives hardest ([P] 2-5)."})
    classifier_loss: str = field(default="softmax", metadata={"help": "Module IV loss: softmax (DEXML's decoupled softmax of --classifier_scale x cos) | likelihood ([P] Eq. 5, c and d above) | bce."})
    classifier_scale: float = field(default=20.0, metadata={"help": "Logit scale of the bce / softmax Module IV losses (1 / temperature)."})
    shortlist_size: int = field(default=500, metadata={"help": "Labels scored per query at prediction ([C] 500)."})
    shortlist_per_source: int = field(default=300, metadata={"help": "Neighbours per label representation ([C] 300)."})
    fusion: str = field(default="code", metadata={"help": "code: beta exp(5(cos-1)) + (1-beta) sigmoid(sim) | paper: alpha cos + (1-alpha)(z+v).E(x)."})
    fusion_weight: Optional[float] = field(
        default=None, metadata={"help": "beta (code fusion) or alpha (paper fusion): the classifiers' share of the score (default: tuned on the validation split when the run has one, else 0.5)."}
    )
    search_mode: str = field(default="fusion", metadata={"help": "Saved ranking: fusion | classifier | shortlist | label_text (Module I alone)."})
    index_kind: str = field(default="exact", metadata={"help": "Shortlist index saved with the model: exact | ivf | hnsw | torch."})
    ivf_nprobe: int = field(default=64, metadata={"help": "Lists an ivf index scans per query."})
    label_embeddings_dtype: str = field(default="float32", metadata={"help": "Precision of the saved label store [z~ ; v]: float32 | float16 (half the bytes)."})


@dataclass
class SiameseXMLTrainingArguments(XMCTrainingArguments):
    """Training defaults for SiameseXML (see README: tuned on Debtags, checked on Reuters-21578). The TrainingArguments
    learning rate, epochs and batch size are Module I's (the encoder's); Module IV has its own."""

    learning_rate: float = field(default=3e-4, metadata={"help": "Module I learning rate of a transformer encoder (boe table: x50; [C] 0.01 for its table)."})
    num_train_epochs: float = field(default=2.0, metadata={"help": "Module I epochs (each --label_draws_per_epoch label draws)."})
    per_device_train_batch_size: int = field(default=64, metadata={"help": "Module I labels per batch and process ([C] 4095)."})
    weight_decay: float = field(default=0.0, metadata={"help": "Weight decay ([C]: none)."})
    label_sampling_power: float = field(default=1.0, metadata={"help": "Module I draws labels with probability freq^power (1: in proportion to their points, as query batches do; [P] 0.45)."})
    label_draws_per_epoch: int = field(default=0, metadata={"help": "Label draws per Module I epoch (0 = max(labels, training points); [C]: the number of labels)."})
    label_negatives_per_draw: int = field(default=0, metadata={"help": "Module I mined negatives: each drawn label brings this many of its nearest labels (by the encoder's label-text vectors at Module I's start) into the batch, which stays --per_device_train_batch_size labels (0 = random batches)."})
    label_negative_top_k: int = field(default=10, metadata={"help": "Nearest labels per label that --label_negatives_per_draw picks from."})
    label_correlation: bool = field(default=True, metadata={"help": "Smooth label-text vectors with the label random walk M ([C])."})
    walk_length: int = field(default=400, metadata={"help": "Hops of the random walk per label ([C] 400)."})
    walk_restart: float = field(default=0.8, metadata={"help": "Restart probability before each hop ([C] 0.8)."})
    walk_top_k: int = field(default=10, metadata={"help": "Most-visited labels kept per row of M ([C] 10)."})
    knn_neighbors: int = field(default=50, metadata={"help": "Training-point neighbours voting in Module II's shortlists (0 = off)."})
    knn_weight: float = field(default=0.025, metadata={"help": "gamma: weight of the neighbour votes ([C] 0.025)."})
    train_shortlist_size: int = field(default=100, metadata={"help": "Shortlist negatives per training point in Module IV ([C] 500)."})
    classifier_epochs: float = field(default=10.0, metadata={"help": "Module IV epochs ([C] 20)."})
    classifier_max_steps: int = field(default=-1, metadata={"help": "Module IV steps (-1 = --classifier_epochs); --max_steps bounds Module I only."})
    classifier_learning_rate: float = field(default=2e-3, metadata={"help": "Module IV learning rate of eta and the residual block ([C] 2e-4 to 5e-4 over 20 epochs)."})
    classifier_batch_size: int = field(default=256, metadata={"help": "Module IV points per batch and process ([C] 255)."})
    classifier_max_positives: int = field(default=10, metadata={"help": "Most positives per point and step in Module IV ([C] 10)."})
    train_encoder_in_classifier_stage: bool = field(default=False, metadata={"help": "SiameseXML++: train the encoder in Module IV too (tokens per batch instead of frozen vectors)."})


def module1_dir(args: SiameseXMLTrainingArguments) -> str:
    """Where Module I trains and keeps its checkpoints and finished weights: OUT/module1."""
    return os.path.join(args.output_dir, "module1")


def _module_args(args: SiameseXMLTrainingArguments, module: str) -> SiameseXMLTrainingArguments:
    """Per-module copy of the arguments: Module I keeps the TrainingArguments values (checkpoints under OUT/module1);
    Module IV takes the classifier epochs (or steps), rate and batch size. The engine's own mining and clustering stay off."""
    changes = {"hard_negatives": 0, "cluster_batching": False, "label_pool": "in_batch"}
    if module == "siamese":
        changes.update(output_dir=module1_dir(args), push_to_hub=False)
    else:
        changes.update(
            num_train_epochs=args.classifier_epochs,
            max_steps=args.classifier_max_steps,
            learning_rate=args.classifier_learning_rate,
            per_device_train_batch_size=args.classifier_batch_size,
            gradient_cache_chunk_size=0,
        )
    return dataclasses.replace(args, **changes)


def train_siamese(model: SiameseXMLModel, data, args: SiameseXMLTrainingArguments, **trainer_kwargs) -> None:
    """Module I: siamese training of the encoder on label batches (``trainer_kwargs``: its validation evaluator)."""
    if args.num_train_epochs <= 0:
        return
    draws = args.label_draws_per_epoch or max(len(data.label_texts), len(data.train))
    neighbors = None
    if args.label_negatives_per_draw > 0 and not stage_finished(module1_dir(args), resume_argument(args)):
        neighbors = mine_label_neighbors(model, data.label_texts, data.train.targets, args.label_negative_top_k, show_progress_bar=not args.disable_tqdm)
        logger.info("SiameseXML Module I: %d mined label negatives per draw from each label's %d nearest labels", args.label_negatives_per_draw, args.label_negative_top_k)
    collator = SiameseLabelCollator.for_model(
        model,
        data.train,
        data.label_texts,
        seed=args.seed,
        power=args.label_sampling_power,
        draws_per_epoch=draws,
        label_neighbors=neighbors,
        neighbors_per_draw=args.label_negatives_per_draw if neighbors is not None else 0,
    )
    logger.info("SiameseXML Module I: %d label draws per epoch, %g epochs", draws, args.num_train_epochs)
    trainer = XMCTrainer(model=model, args=_module_args(args, "siamese"), train_dataset=LabelDrawDataset(draws), data_collator=collator, **trainer_kwargs)
    train_stage(trainer, resume_argument(args), data.validation_record)  # a finished stage or checkpoint of another split: refused


def _csr_digest(matrix) -> str:
    """The digest of a sparse matrix's pairs and values (its CSR parts, indices sorted), whatever its format."""
    m = sp.csr_matrix(matrix)
    if not m.has_sorted_indices:
        m = m.sorted_indices()
    return array_digest(np.asarray(m.shape), m.indptr, m.indices, m.data)


def shortlist_fingerprint(data, args: SiameseXMLTrainingArguments) -> dict:
    """What Module II's training shortlists are mined from (the ``training_shortlists`` part of
    :mod:`hf_xmc.models.provenance`): the digests of the training targets and of the training filter (None without
    one), the validation split's fingerprint (None without one) and the seed. A changed seed at the same validation
    size moves other points into training: the stored rows would belong to other points."""
    record = getattr(data, "validation_record", None)
    filt = data.train.filter_matrix
    return fingerprint_of(
        targets=_csr_digest(data.train.targets),
        train_filter=_csr_digest(sp.csr_matrix(filt, dtype=bool)) if filt is not None else None,
        validation=record.get("fingerprint") if record else None,
        seed=int(args.seed),
    )


def module2_store(model: SiameseXMLModel, targets, args: SiameseXMLTrainingArguments, fingerprint: Optional[dict] = None) -> Optional[ModuleIIStore]:
    """Module II's results on disk (OUT/module2) when the run saves checkpoints, so a resumed run reads them back;
    the first process writes, the others read; ``fingerprint`` (:func:`shortlist_fingerprint`) is recorded with them
    and checked on resume."""
    if args.save_strategy == "no":
        return None
    settings = {
        "num_points": targets.shape[0], "num_labels": targets.shape[1], "targets_nnz": int(targets.nnz),
        "embedding_dim": model.config.embedding_dim, "label_embeddings_dtype": model.config.label_embeddings_dtype,
        "label_correlation": args.label_correlation, "walk_length": args.walk_length, "walk_restart": args.walk_restart,
        "walk_top_k": args.walk_top_k, "seed": args.seed, "train_shortlist_size": args.train_shortlist_size,
        "knn_neighbors": args.knn_neighbors, "knn_weight": args.knn_weight,
    }
    return ModuleIIStore(os.path.join(args.output_dir, "module2"), settings, writer=args.process_index == 0, fingerprint=fingerprint)


def check_resumed_store(model: SiameseXMLModel, data, args: SiameseXMLTrainingArguments) -> None:
    """A resumed run whose stored Module II shortlists were mined from other inputs (another --seed, data or
    --train_filter_file) is refused in one line before any module runs (:meth:`ModuleIIStore.check_inputs`)."""
    if not resume_argument(args):
        return
    store = module2_store(model, data.train.targets, args, shortlist_fingerprint(data, args))
    if store is not None:
        store.check_inputs()


def mine(model: SiameseXMLModel, data, args: SiameseXMLTrainingArguments):
    """Module II (and III): label state and static shortlists from the frozen encoder, the training filter's pairs
    never negatives (as DEXML's, UniDEC's and PRIME's mined negatives); returns Module IV's collator."""
    targets = sp.csr_matrix(data.train.targets)
    show = not args.disable_tqdm
    store = module2_store(model, targets, args, shortlist_fingerprint(data, args))
    points = store.load_label_state(model) if store is not None and resume_argument(args) else None
    resumed = points is not None
    if not resumed:
        correlation = None
        if args.label_correlation:
            correlation = label_correlation_matrix(targets, args.walk_length, args.walk_restart, args.walk_top_k, seed=args.seed)
        points = build_label_state(model, data.train.texts, targets, correlation, show_progress_bar=show)
        if store is not None:
            store.save_label_state(model, points)
    out, first = store.open_shortlist(len(points), args.train_shortlist_size, resume=resumed) if store is not None else (None, 0)
    if store is not None:  # the shortlist index over [z~ ; v], kept in the store (a resumed run reads it back)
        model.build_label_index(cache_dir=store.index_dir(store.LABEL_INDEX_DIR), show_progress_bar=show)
    shortlist = mine_classifier_shortlist(
        model, points, targets, args.train_shortlist_size, args.knn_neighbors, args.knn_weight, show_progress_bar=show,
        out=out, first=first, on_chunk=store.mark_done if store is not None else None,
        neighbour_index_dir=store.index_dir(store.POINT_INDEX_DIR) if store is not None else None,
        exclude=data.train.filter_matrix,
    )
    logger.info("SiameseXML Module II: shortlists of %d negatives for %d training points", shortlist.shape[1], shortlist.shape[0])
    frozen = not args.train_encoder_in_classifier_stage
    for p in model.encoder.parameters():  # with an adapter, only its weights (the trainable ones) train on in Module IV
        p.requires_grad_(not frozen and (p.requires_grad or not model.has_encoder_adapter))
    return ClassifierStageCollator(
        targets=targets,
        shortlist=shortlist,
        query_vectors=points if frozen else None,
        texts=None if frozen else data.train.texts,
        tokenizer=model.tokenizer,
        max_seq_length=model.config.max_seq_length,
        max_positives=args.classifier_max_positives,
        seed=args.seed,
    )


def main(argv: Optional[list[str]] = None) -> dict:
    """Parse the arguments, run Modules I-IV, evaluate, save; returns the metrics of ``eval_results.json``."""
    model_args, data_args, training_args = parse_script_args(SiameseXMLModelArguments, SiameseXMLTrainingArguments, argv, method="siamesexml")
    tune_beta = model_args.fusion_weight is None  # a beta given on the command line is kept as given
    if tune_beta:
        model_args.fusion_weight = 0.5  # [C]'s value until the validation split tunes it
    data = load_data(data_args, training_args, tuned_by_recipe=["--fusion_weight"] if tune_beta else [])
    model = SiameseXMLModel.from_encoder_pretrained(model_args.model_name_or_path, label_space_size=len(data.label_texts), **model_config_kwargs(model_args, data_args))
    model.set_labels(data.label_texts, data.label_uids)
    check_resumed_store(model, data, training_args)  # before the IDF pass and Module I: a refused resume costs nothing
    module1_restored = training_args.num_train_epochs > 0 and stage_finished(module1_dir(training_args), resume_argument(training_args))
    if model.config.encoder_type == "boe" and not module1_restored:  # a finished Module I's weights carry the IDF
        texts = list(data.train.texts) + list(data.label_texts)
        df = bag_of_embeddings_document_frequency(model.tokenizer, texts, model.config.max_seq_length, model.config.boe_vocab_size)
        model.set_idf(df, len(texts))
    evaluator = build_evaluator(data, data_args)
    train_siamese(model, data, training_args, **stage_evaluation(data, evaluator))
    collator = mine(model, data, training_args)
    return train_and_evaluate(model, data, evaluator, _module_args(training_args, "classifier"), data_collator=collator, tune_settings=None if tune_beta else ())
