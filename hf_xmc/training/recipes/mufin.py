"""Train MUFIN (multi-modal extreme classification: ViT + text encoder bags, self- and cross-attention, per-label
classifiers) on Extreme Classification Repository files whose points and labels may carry images.

    python training_scripts/train_mufin.py \
        --train_file trn.json.gz --test_file tst.json.gz --label_file lbl.json.gz \
        --model_name_or_path sentence-transformers/msmarco-distilbert-base-v4 \
        --vision_model_name_or_path google/vit-base-patch32-224-in21k --output_dir out/mufin
    hf-xmc train mufin ...                                                    # the same recipe as a console command

The JSON lines may hold ``"images": [paths]`` (relative to the file's folder). The recipe runs the paper's modules
on the shared trainer, in order: Module I, siamese pre-training (``--siamese_epochs``, lr ``--learning_rate``;
batches of items (the official code), or of labels with ``--num_positives`` items each with ``--siamese_batch_over
labels`` (the paper); triplet loss anchored on the batch's labels, in-batch hard negatives); Module II, label centroids + the bag and
centroid index + a shortlist ``R_i`` of ``--hard_negative_top_k`` labels per training item (positives and
``--train_filter_file`` pairs removed; checkpoints record what it was mined from, and a resume on other data is refused);
Module III, the cross-attention and classifiers start at their initialisation (identity, xavier, alpha 0.5); Module
IV, fine-tuning for ``--num_train_epochs`` with ``--num_positives`` positives and ``--ranker_negatives`` shortlist
negatives per item (cosine-embedding loss), encoders at ``--ranker_learning_rate``, the cross-attention at 10x and
the classifier vectors at 100x that rate (the official code's 5e-5 / 5e-4 / 5e-3); with ``--ranker_label_side
cache`` the pool labels' bags come from a cache of Module II's encoding (no label through the encoders in a step),
re-encoded every ``--ranker_label_refresh_steps``. After Module IV the label
centroids are recomputed and the label bags re-encoded with the final encoder, so the saved index holds one embedding
space. Prediction fuses the shortlist score and the classifier score, ``0.7 c + 0.3 a``; labels without a training
positive are scored zero-shot (``w_l = z_l^1``). Writes OUT/ (loadable with AutoModel.from_pretrained(OUT,
trust_remote_code=True), image processor and label index included) and OUT/eval_results.json; beside ``test_*`` it
holds the metrics over the test points that carry each modality the run uses (``test_with_text_P@1``, ...,
``test_points_with_text``; ``image`` likewise): a point without text is a miss for the text-only ablation whatever it
learns, so ``test_with_text_*`` is what that ablation does where it can.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from transformers import TrainerCallback

from ...data import XCData, XMCDataset
from ...metrics import xmc_metrics
from ...models import MUFINModel
from ...models.provenance import StaleDerivedPartError
from ..evaluation import XMCEvaluator
from ..mufin import (
    MUFINCentroidCallback,
    MUFINDataCollator,
    MUFINLabelRefreshCallback,
    MUFINShortlistRecordCallback,
    mine_mufin_shortlist,
    shortlist_fingerprint,
)
from ..script_utils import (
    build_evaluator,
    load_data,
    model_config_kwargs,
    parse_script_args,
    resume_argument,
    stage_evaluation,
    train_and_evaluate,
    train_stage,
)
from ..trainer import XMCTrainer, XMCTrainingArguments

logger = logging.getLogger("train_mufin")


RANKER_LABEL_SIDES = ("encoder", "cache", "auto")
# --ranker_label_side auto: the cached label side from this many labels on. A Module IV step at batch 64 encodes ~900
# distinct label bags with gradient where labels are many (WordNet-XMC's 53K: 14.6 s a step on 2 cores); where they
# are few the pool is the label space itself, and the paper's end-to-end step costs little more
RANKER_CACHE_MIN_LABELS = 10_000


def resolve_ranker_label_side(side: str, num_labels: int) -> str:
    """``--ranker_label_side`` for a label space of ``num_labels``: ``auto`` is ``cache`` from
    :data:`RANKER_CACHE_MIN_LABELS` labels on, ``encoder`` below; the others as given."""
    if side != "auto":
        return side
    return "cache" if num_labels >= RANKER_CACHE_MIN_LABELS else "encoder"


@dataclass
class MUFINModelArguments:
    """Model arguments of MUFIN (see MUFINConfig for the meaning of each field)."""

    model_name_or_path: str = field(metadata={"help": "Text encoder to start from (the paper: msmarco-distilbert-base-v4)."})
    vision_model_name_or_path: Optional[str] = field(
        default=None,
        metadata={
            "help": "Vision encoder to start from (the paper: ViT-B/32), with its image processor, or 'open_clip:<name>' (an open_clip image tower: "
            "'open_clip:local-dir:/path', 'open_clip:hf-hub:org/repo', 'open_clip:ViT-B-32@laion2b_s34b_b79k'); default: a small ResNet (64 x 64) trained from scratch."
        },
    )
    embed_dim: Optional[int] = field(
        default=None, metadata={"help": "Descriptor dimension D after the parameter-free max-pool (default: 192, or the encoders' smaller width)."}
    )
    attention_heads: int = field(default=12, metadata={"help": "Heads of the self- and cross-attention blocks (D must divide)."})
    attention_dropout: float = field(default=0.3, metadata={"help": "Attention-probability dropout."})
    fusion_beta: float = field(default=0.7, metadata={"help": "Prediction score = beta * classifier + (1 - beta) * shortlist."})
    shortlist_size: int = field(default=100, metadata={"help": "Labels re-scored per item at prediction (|R_t|)."})
    siamese_margin: float = field(default=0.2, metadata={"help": "Module I triplet margin (paper 0.2, code 0.3)."})
    ranker_margin: float = field(default=0.5, metadata={"help": "Module IV cosine-embedding margin."})
    vision_trainable_layers: Optional[int] = field(
        default=None,
        metadata={"help": "Final vision layers trained, -1 = all (paper: the final one; code: 4). Default: 1 for a pretrained tower, all for one built at random."},
    )
    max_images: int = field(default=-1, metadata={"help": "Images kept per item (-1 = all)."})
    item_modalities: str = field(
        default="text,image", metadata={"help": "Descriptors of the points used (train and test): 'text,image', 'text' or 'image' (ablations)."}
    )
    save_label_images: bool = field(
        default=True, metadata={"help": "Store the label images (their file bytes) with the model, so a reload can re-encode the labels from texts and images."}
    )
    index_kind: str = field(
        default="exact",
        metadata={"help": "Index over the label bags and centroids (Module II's shortlists, evaluation, the saved model): exact | ivf | hnsw | torch (ivf or hnsw at 10^5+ labels on a CPU)."},
    )
    ivf_nprobe: int = field(default=64, metadata={"help": "Lists an ivf index scans per query."})


@dataclass
class MUFINTrainingArguments(XMCTrainingArguments):
    """Training defaults for MUFIN (the paper's module order at a short budget). The learning rates are 3e-4 in both
    stages, above the official 2e-4 / 5e-5 (tuned for 200 + 20 epochs): at 2 + 3 epochs 3e-4 won on Emoji-XMC (P@1 29.8
    vs 23.1, multimodal) and on the contract's tiny random-BERT task (32.1 vs 7.1)."""

    learning_rate: float = field(default=3e-4, metadata={"help": "Module I learning rate (encoders and self-attention; code 2e-4)."})
    num_train_epochs: float = field(default=3.0, metadata={"help": "Module IV (fine-tuning) epochs."})
    siamese_epochs: float = field(default=2.0, metadata={"help": "Module I (siamese pre-training) epochs."})
    siamese_max_steps: Optional[int] = field(
        default=None,
        metadata={"help": "Module I steps (-1: --siamese_epochs; default: --max_steps, which then bounds both modules). With it, "
                  "--max_steps bounds Module IV only, so a budget can give the cheap Module I more steps than Module IV."},
    )
    siamese_batch_over: str = field(
        default="items",
        metadata={
            "help": "Module I batches drawn over 'items' (the official code's --doc_first) or 'labels' (the paper: an epoch is a pass over the labels, each with "
            "--num_positives items; few steps where labels are few: P@1 82.3 vs 89.7 on Reuters, 30.0 vs 36.3 on the contract's tiny task, about even on Emoji-XMC)."
        },
    )
    ranker_learning_rate: float = field(default=3e-4, metadata={"help": "Module IV encoder rate (code 5e-5); cross-attention x10, classifiers x100."})
    vision_learning_rate_multiplier: float = field(
        default=1.0, metadata={"help": "Vision encoder learning rate relative to the text encoder's, in both modules (10x was no better on Emoji-XMC)."}
    )
    per_device_train_batch_size: int = field(default=64, metadata={"help": "Items per batch and process."})
    num_positives: int = field(default=2, metadata={"help": "Positives per item and step (|P_l| / |S_i| = 2 in the paper)."})
    ranker_negatives: int = field(default=12, metadata={"help": "Module IV shortlist negatives per item (|T_i|)."})
    hard_negative_top_k: int = field(default=100, metadata={"help": "Module II shortlist size per training item (|R_i|)."})
    ranker_label_side: str = field(
        default="encoder",
        metadata={
            "help": "Module IV's label side: 'encoder' (the paper: each step's pool labels through the encoders, with gradient), 'cache' (their bags "
            "as Module II encoded them, without gradient, re-encoded every --ranker_label_refresh_steps: a step encodes its queries only) or "
            "'auto' ('cache' from 10,000 labels on, 'encoder' below)."
        },
    )
    ranker_label_refresh_steps: int = field(
        default=0, metadata={"help": "With --ranker_label_side cache: re-encode all labels every N Module IV steps (0: only Module II's encoding)."}
    )

    def __post_init__(self):
        if self.siamese_max_steps is not None and self.siamese_max_steps != -1 and self.siamese_max_steps < 1:
            raise ValueError(f"--siamese_max_steps must be -1 (use --siamese_epochs) or at least 1, got {self.siamese_max_steps}")
        if self.ranker_label_side not in RANKER_LABEL_SIDES:
            raise ValueError(f"--ranker_label_side must be one of {', '.join(RANKER_LABEL_SIDES)}, got {self.ranker_label_side!r}")
        if self.ranker_label_refresh_steps < 0:
            raise ValueError(f"--ranker_label_refresh_steps must be >= 0 (0: only Module II's encoding), got {self.ranker_label_refresh_steps}")
        super().__post_init__()


def _stage_args(args: MUFINTrainingArguments, stage: str) -> MUFINTrainingArguments:
    """Per-module copy of the arguments: Module I trains with ``learning_rate`` for ``siamese_epochs`` (or
    ``siamese_max_steps`` steps), Module IV with ``ranker_learning_rate`` for ``num_train_epochs``; ``max_steps`` bounds
    both unless ``siamese_max_steps`` is given; the engine's own mining stays off (Module II mines)."""
    changes = {"hard_negatives": 0, "cluster_batching": False}
    if stage == "siamese":
        changes.update(num_train_epochs=args.siamese_epochs, output_dir=os.path.join(args.output_dir, "module1"), push_to_hub=False)
        if args.siamese_max_steps is not None:  # Module I's own bound; else --max_steps bounds both modules
            changes.update(max_steps=args.siamese_max_steps)
    else:
        changes.update(learning_rate=args.ranker_learning_rate)
    return dataclasses.replace(args, **changes)


def build_collator(model: MUFINModel, data: XCData, args: MUFINTrainingArguments, stage: str) -> MUFINDataCollator:
    """The bag collator of one stage over the training items and all labels."""
    return MUFINDataCollator.for_model(
        model,
        data.train,
        data.label_texts,
        num_positives=args.num_positives,
        num_negatives=args.ranker_negatives,
        seed=args.seed,
        bag_processor=model.prepare_bags,
        images=data.train.images,
        label_images=data.label_images,
        stage=stage,
        batch_over=args.siamese_batch_over,
        cached_label_bags=args.ranker_label_side == "cache",
    )


ITEM_MODALITIES = ("text", "image")


def parse_modalities(modalities: str) -> list[str]:
    """The modalities ``--item_modalities`` names (``'text,image'``, ``'text'``, ``'image'``), in :data:`ITEM_MODALITIES` order."""
    keep = {m.strip() for m in modalities.split(",") if m.strip()}
    if not keep or keep - set(ITEM_MODALITIES):
        raise ValueError(f"item_modalities must name 'text' and/or 'image', got {modalities!r}")
    return [m for m in ITEM_MODALITIES if m in keep]


def keep_modalities(data: XCData, modalities: str) -> XCData:
    """``data`` with the points' texts or images dropped (the single-modality ablations); labels keep theirs."""
    keep = set(parse_modalities(modalities))
    if keep == {"image"} and data.train.images is None:
        raise ValueError("item_modalities='image' but the training points carry no images")
    if keep == {"text", "image"}:
        return data  # whatever the points carry (text-only data stays text-only)

    def strip(split: XMCDataset) -> XMCDataset:
        texts = split.texts if "text" in keep else [""] * len(split.texts)  # a blank text is a missing one
        images = split.images if "image" in keep else None
        return dataclasses.replace(split, texts=texts, images=images)

    train, test = strip(data.train), strip(data.test)
    validation = strip(data.validation) if data.validation is not None else None
    # training points left with no descriptor teach nothing; test points keep their rows (the evaluator counts
    # them as misses: a model cannot rank labels for an item it is shown nothing of)
    described = train.has_descriptor()
    if not described.all():
        logger.info("item_modalities=%s: %d training points without a descriptor dropped", modalities, int((~described).sum()))
        train = train.select(described)
    # PSP@k's propensities stay those of every training point (as a validation split leaves them): the ablations are
    # scored with the multimodal run's, whatever points they drop
    return dataclasses.replace(data, train=train, test=test, validation=validation, all_train_targets=data.propensity_targets())


def points_with(split: XMCDataset, modality: str) -> np.ndarray:
    """Boolean mask of the points of ``split`` that carry ``modality``: a non-blank text (a blank one is a missing
    one, as in ``has_descriptor``), or at least one image."""
    if modality == "text":
        return np.array([bool(t and t.strip()) for t in split.texts], dtype=bool)
    if modality == "image":
        return np.array([bool(split.images is not None and split.images[i]) for i in range(len(split))], dtype=bool)
    raise ValueError(f"modality must be one of {', '.join(ITEM_MODALITIES)}, got {modality!r}")


def modality_subset_metrics(evaluator: XMCEvaluator, points: XMCDataset, modalities: str) -> dict[str, float]:
    """The last evaluation of ``evaluator`` scored again over the points that carry each of ``modalities`` in
    ``points`` (its queries as the data had them, before an ablation dropped a modality): a text-only run cannot hit a
    point that has no text, so its ``test_P@k`` counts those points as misses; these keys leave them out.

    Returns ``<name>_points_with_<modality>`` (the count) and, when it is not 0, ``<name>_with_<modality>_<metric>``
    for P@k, nDCG@k, PSP@k and PSnDCG@k at the evaluator's ``ks``: the same rows of the same ranking (its top
    ``max(ks)``, ``last_predictions``: no R@k), with the evaluator's inverse propensities (of the full training set);
    PSP@k is normalised by the best ranking of these points, so it is not ``test_PSP@k`` rescaled as P@k is."""
    ranking = evaluator.last_predictions
    if ranking is None or len(ranking) != len(points):
        raise ValueError(f"{evaluator.name}: no evaluation of these {len(points)} points to score again")
    out: dict[str, float] = {}
    for modality in parse_modalities(modalities):
        rows = np.flatnonzero(points_with(points, modality))
        out[f"{evaluator.name}_points_with_{modality}"] = int(rows.size)
        if rows.size:
            scored = xmc_metrics(ranking[rows], evaluator.data.targets[rows], evaluator.inv_propensity, ks=evaluator.ks, recall_ks=())
            out.update({f"{evaluator.name}_with_{modality}_{key}": float(value) for key, value in scored.items()})
    return out


class ModalitySubsetCallback(TrainerCallback):
    """Adds :func:`modality_subset_metrics` to the metrics of the test evaluation (the one whose keys carry
    ``evaluator``'s name), in place: ``train_and_evaluate`` logs, writes to ``eval_results.json`` and pushes the dict
    that ``evaluate`` returns, and ``on_evaluate`` is the hook between the evaluation and those. Validation
    evaluations (``eval_*``) are left as they are."""

    def __init__(self, evaluator: XMCEvaluator, points: XMCDataset, modalities: str):
        self.evaluator, self.points, self.modalities = evaluator, points, modalities

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if metrics is not None and f"{self.evaluator.name}_P@{self.evaluator.ks[0]}" in metrics:
            metrics.update(modality_subset_metrics(self.evaluator, self.points, self.modalities))
        return control


def fit_dimensions(config: dict, text_encoder: str, vision_encoder: Optional[str]) -> None:
    """Default ``embed_dim`` = 192 (the paper) or the narrower encoder's width (max-pooling cannot widen), and the
    attention heads reduced to a divisor of it (``gcd``) when they do not divide it."""
    from transformers import AutoConfig

    from ...models.configuration_mufin import OPEN_CLIP_PREFIX, encoder_width
    from ...models.mufin_vision import SMALL_VISION_CONFIG, open_clip_model_config

    if not vision_encoder:
        vision = SMALL_VISION_CONFIG
    elif vision_encoder.startswith(OPEN_CLIP_PREFIX):
        vision = open_clip_model_config(vision_encoder[len(OPEN_CLIP_PREFIX) :])
    else:
        vision = AutoConfig.from_pretrained(vision_encoder)
    widths = [encoder_width(AutoConfig.from_pretrained(text_encoder)), encoder_width(vision)]
    if config["embed_dim"] is None:
        config["embed_dim"] = min([192] + [w for w in widths if w])
    if config["embed_dim"] % config["attention_heads"]:
        heads = math.gcd(config["embed_dim"], config["attention_heads"])
        logger.warning("attention_heads %d does not divide embed_dim %d: using %d heads", config["attention_heads"], config["embed_dim"], heads)
        config["attention_heads"] = heads


def pretrain_and_mine(model: MUFINModel, data: XCData, args: MUFINTrainingArguments, **trainer_kwargs) -> MUFINDataCollator:
    """Modules I and II: siamese pre-training, then the shortlist; returns the Module IV collator holding it
    (``trainer_kwargs``: Module I's validation evaluator)."""
    model.set_labels(data.label_texts, data.label_uids, data.label_images)
    if args.siamese_epochs > 0:
        model.set_training_stage("siamese")
        siamese = _stage_args(args, "siamese")
        collator = build_collator(model, data, siamese, "siamese")
        train = collator.anchor_label_dataset() if args.siamese_batch_over == "labels" else data.train
        train_stage(XMCTrainer(model=model, args=siamese, train_dataset=train, data_collator=collator, **trainer_kwargs), resume_argument(args),
                    data.validation_record)  # a finished stage or checkpoint of another split: refused
    collator = build_collator(model, data, args, "ranker")
    collator.set_shortlist(
        mine_mufin_shortlist(model, data.train.texts, data.train.images, data.train.targets, top_k=args.hard_negative_top_k,
                             show_progress_bar=not args.disable_tqdm, train_filter=data.train.filter_matrix)
    )
    if args.ranker_label_side == "cache":  # Module II's label encoding, kept for Module IV before its trainer resets the labels
        model.cache_ranker_labels(reuse_store=True)
    model.set_training_stage("ranker")
    return collator


def main(argv: Optional[list[str]] = None) -> dict:
    """Parse the arguments, run Modules I-IV, evaluate, save; returns the metrics of ``eval_results.json``."""
    model_args, data_args, training_args = parse_script_args(MUFINModelArguments, MUFINTrainingArguments, argv, method="mufin")
    data = load_data(data_args, training_args)
    side = resolve_ranker_label_side(training_args.ranker_label_side, len(data.label_texts))
    if side != training_args.ranker_label_side:
        logger.info("--ranker_label_side auto: %s for %d labels", side, len(data.label_texts))
        training_args.ranker_label_side = side
    config = model_config_kwargs(model_args, data_args)  # + token budgets and propensity constants
    vision_encoder = config.pop("vision_model_name_or_path")
    if config["vision_trainable_layers"] is None:  # freezing a tower built at random would keep it random
        config["vision_trainable_layers"] = 1 if vision_encoder else -1
    modalities = config.pop("item_modalities")
    test_points = data.test  # the test points' own descriptors: the metrics over those that carry the run's modalities
    data = keep_modalities(data, modalities)
    fit_dimensions(config, model_args.model_name_or_path, vision_encoder)
    model = MUFINModel.from_encoders_pretrained(model_args.model_name_or_path, vision_encoder, label_space_size=len(data.label_texts), **config)
    model.freeze_vision_layers()
    model.vision_learning_rate_multiplier = training_args.vision_learning_rate_multiplier
    evaluator: XMCEvaluator = build_evaluator(data, data_args)
    evaluator.label_images = data.label_images
    collator = pretrain_and_mine(model, data, training_args, **stage_evaluation(data, evaluator))
    # after Module IV the centroids are recomputed with the final encoder: evaluation and the saved index use one space
    callbacks = [MUFINCentroidCallback(data.train.texts, data.train.images, data.train.targets, batch_size=data_args.eval_batch_size),
                 MUFINShortlistRecordCallback(shortlist_fingerprint(data.train.targets, data.train.filter_matrix)),
                 ModalitySubsetCallback(evaluator, test_points, modalities)]
    if training_args.ranker_label_side == "cache":  # the pool's label bags come from the cache, re-encoded on this schedule
        callbacks.insert(0, MUFINLabelRefreshCallback(training_args.ranker_label_refresh_steps, batch_size=data_args.eval_batch_size))
    try:
        return train_and_evaluate(model, data, evaluator, _stage_args(training_args, "ranker"), data_collator=collator, callbacks=callbacks)
    except StaleDerivedPartError as err:  # a resume on other data than its checkpoint's shortlists: one line, status 2
        print(f"train_mufin: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
