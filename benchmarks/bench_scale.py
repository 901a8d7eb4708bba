#!/usr/bin/env python
"""Every method end to end at the LF-AmazonTitles-1.3M shape: seconds and peak RSS per stage, on this machine.

    python benchmarks/bench_scale.py --methods dexml,prime,unidec --num_labels 1300000 --num_train 2200000 \
        --num_test 50000 --steps 200 --out benchmarks/results/scale.json

The task is ``make_synthetic_xmc`` at the shape of LF-AmazonTitles-1.3M (prime.md 8.2: 2.2M training queries, 1.3M
labels, 22.2 labels per query, Zipf-like label frequencies), written once as XC raw files (cached under
``--data_dir``). The encoder is a random BERT with the real vector size (hidden 384) and no transformer layer
(``--encoder_layers 0``: token + position embeddings, LayerNorm, mean pooling), with a WordPiece vocabulary of the
task's syllable pairs (about 20K pieces, a word is two pieces), at 16 tokens: encoding millions of texts then costs
minutes on 2 cores and what grows with the label space and the data dominates. Quality figures (P@1, R@100) of such
an encoder after a few hundred steps say nothing about a method; they show that the pipeline ranks for real.

``--methods`` takes ``method`` or ``method:variant`` entries: ``dexml`` (= ``dexml:in_batch``), ``dexml:hard_neg``,
``dexml:all_label``, ``prime``, ``unidec``. Each runs in fresh processes, through the method's own recipe
(``hf_xmc.training.recipes``, what ``training_scripts/train_<method>.py`` runs) with the paper's batch size for that
method at 1.3M labels, and the training-engine flags that make every stage happen within ``--steps`` steps (the NGAME
clustering and the hard-negative mining at the first epoch instead of later ones):

1. training process: data load, model init, label state (PRIME: free-vector clustering + centroids; UniDEC: nothing
   with xavier classifiers), clustering of all training queries, hard-negative mining over all training queries, the
   training steps, evaluation on the test set (label index build + search), ``save_pretrained``, model card;
2. a second fresh process: ``AutoModel.from_pretrained(dir, trust_remote_code=True)``, ``predict(k=100)`` on the test
   set (P@1, R@100), latency at batch 1 and 256.

``mufin:multimodal`` runs on a task with images (``--images_per_item 4.91 --labels_per_point 1 15``:
MM-AmazonTitles-300K's shape, 586,781 items, 303,296 labels, 8.13 labels and 4.91 images per item, up to 15): each
item and label points at Binomial(15, 4.91 / 15) files of a pool of ``--image_pool`` generated PNG images of
``--image_size`` pixels (mostly the pool images of its labels, so images carry the labels as the texts' planted words
do), read and decoded from disk at every pass as a real dataset's would be, through a random ViT of ``--vision_layers``
layers (0: patch and position embeddings, LayerNorm, pooler) with its image processor.

Every run builds an ``ivf`` label index (``--index_kind``, ``--ivf_nprobe 16``) for hard-negative mining, evaluation
and the saved model: exact search of 2.2M training queries against 1.3M labels is about 10^15 multiply-adds, hours on
2 CPU cores, where IVF at nprobe 16 (recall@100 ~0.90, ``bench_index.py``) takes minutes; the memory is the same.

Per stage it records seconds and peak RSS (``VmHWM`` of /proc/self/status, reset at each stage through
/proc/self/clear_refs), and per run the on-disk size of the saved model. A row longer than a session (SiameseXML's
Module II over 2.2M points with the bag-of-embeddings encoder: ~3 h) can be stopped and continued with ``--resume``:
its training process snapshots its stage figures every 30 s, the recipe keeps Module I's weights and Module II's
store on disk, and the row adds up the processes it ran in (``parts``). Writes a JSON list, one row per method
variant (``completed: false`` with the error's last lines when a run fails), after every run, and prints a table;
``--update_docs`` writes it between the ``<!-- bench:scale -->`` lines of docs/scale.md (``--marker scale-gpu``: the GPU
table's block), ``--table_only`` re-renders the table of ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import shlex
import subprocess
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import RESULTS_DIR, bench_parser, markdown_table, publish, read_json, write_json  # noqa: E402

# rows longer than a session: checkpoints on (weights only, at each training's end: no step reaches --save_steps), so
# SiameseXML's Module I weights and Module II store (OUT/module2) stay on disk and --resume goes on from them
RESUMABLE = ["--save_strategy", "steps", "--save_steps", "1000000", "--save_only_model", "true", "--save_total_limit", "1"]

# paper batch size (queries per step) at LF-AmazonTitles-1.3M and the recipe flags of each variant
VARIANTS = {
    # dexml.md Table 7: batch 8192 at 1.3M; in-batch negatives
    ("dexml", "in_batch"): {"batch_size": 8192, "args": ["--label_pool", "in_batch"]},
    # dexml.md 4: ANCE-style shortlist of 100, one negative per query, mined from the first epoch here
    ("dexml", "hard_neg"): {
        "batch_size": 8192,
        "args": ["--hard_negatives", "1", "--hard_negative_top_k", "100", "--hard_negative_start_epoch", "0"],
    },
    # dexml.md released config AT-1.3M all_decoupled-softmax: bsz 3000, gradient-cache chunk 3000
    ("dexml", "all_label"): {"batch_size": 3000, "args": ["--label_pool", "all", "--gradient_cache_chunk_size", "3000"]},
    # prime.md Table 10: batch 3200 at 1.3M (131,072 free vectors = the default at 1.3M labels); clustering at epoch 0
    ("prime", "default"): {"batch_size": 3200, "args": ["--cluster_curriculum_epochs", "0"]},
    # unidec.md: |Q_B| = 1000 queries, pool |L_B| = 3000, heads of 256 at 1.3M; clustering and mining at epoch 0
    ("unidec", "default"): {
        "batch_size": 1000,
        "args": ["--max_label_pool", "3000", "--projection_dim", "256", "--cluster_curriculum_epochs", "0", "--hard_negative_start_epoch", "0"],
    },
    # siamesexml.md [C]: Module I batches of 4095 labels, Module IV batches of 255 points; 500-label shortlists at
    # prediction, 100 mined negatives per training point (the script default); label store in fp16 (halves [z~ ; v])
    ("siamesexml", "transformer"): {
        "batch_size": 4095,
        "args": ["--classifier_batch_size", "255", "--label_embeddings_dtype", "float16", *RESUMABLE],
    },
    # the paper's encoder: a TF-IDF bag of token embeddings (the random encoder's vocabulary, D = 384)
    ("siamesexml", "boe"): {
        "batch_size": 4095,
        "args": ["--encoder_type", "boe", "--classifier_batch_size", "255", "--label_embeddings_dtype", "float16", *RESUMABLE],
    },
    # mufin.md [CODE]: Module I batches of 1023 items (--doc_first), a 100-label shortlist per item from Module II;
    # text only (the synthetic task has no images). Module IV reads the pool's label bags from a cache of Module II's encoding
    # (the official cheaper ranker's frozen label features): a step at batch 1023 would otherwise encode ~14K label
    # texts with gradient
    ("mufin", "text"): {"batch_size": 1023, "args": ["--ranker_label_side", "cache"]},
    # the same on items and labels with images (--images_per_item: MM-AmazonTitles-300K's 4.91), through a random ViT
    # trained whole (a tower built at random stays random frozen)
    ("mufin", "multimodal"): {"batch_size": 1023, "args": ["--ranker_label_side", "cache", "--vision_trainable_layers", "-1"], "images": True},
}
DEFAULT_VARIANT = {"dexml": "in_batch", "prime": "default", "unidec": "default", "siamesexml": "transformer", "mufin": "text"}
GIB = 1024**3


def parse_methods(spec: str) -> list[tuple[str, str]]:
    """``"dexml,dexml:all_label,prime"`` -> ``[("dexml", "in_batch"), ("dexml", "all_label"), ("prime", "default")]``."""
    out = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        method, _, variant = item.partition(":")
        key = (method, variant or DEFAULT_VARIANT.get(method, "default"))
        if key not in VARIANTS:
            known = ", ".join(f"{m}:{v}" for m, v in VARIANTS)
            raise SystemExit(f"bench_scale.py: unknown method {item!r} (known: {known})")
        out.append(key)
    return out


# --------------------------------------------------------------------------------------------------- stage probes
def _vm_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass


class StageRecorder:
    """Nested stages: inclusive seconds and peak RSS each (a parent's peak includes its children's).

    With ``snapshot_path`` a thread rewrites that file every ``snapshot_seconds`` with the finished stages and the
    open ones up to now, so that a process killed midway (a row longer than a session) leaves its figures behind."""

    def __init__(self, snapshot_path: str | None = None, snapshot_seconds: float = 30.0) -> None:
        import threading

        self.stages: dict[str, dict] = {}
        self.stack: list[list] = []  # [name, start, peak so far]
        self._lock = threading.Lock()
        self._writing = threading.Lock()
        self._stopped = threading.Event()
        self.snapshot_path = snapshot_path
        if snapshot_path:
            def loop():
                while not self._stopped.wait(snapshot_seconds):
                    with self._writing:
                        if not self._stopped.is_set():
                            self.write_snapshot(snapshot_path)

            threading.Thread(target=loop, daemon=True).start()

    def close(self) -> None:
        """Stop the snapshots and remove the file: the process ended, its result carries the figures."""
        self._stopped.set()
        with self._writing:
            if self.snapshot_path and os.path.exists(self.snapshot_path):
                os.remove(self.snapshot_path)

    def snapshot(self) -> dict[str, dict]:
        """The finished stages, and each open stage as if it ended now (seconds so far, peak so far)."""
        with self._lock:
            stages = {k: dict(v) for k, v in self.stages.items()}
            now, hwm = time.perf_counter(), _vm_hwm_bytes()
            for depth, (_, start, peak) in enumerate(self.stack):
                path = ".".join(s[0] for s in self.stack[: depth + 1])
                entry = stages.setdefault(path, {"seconds": 0.0, "peak_rss_gib": 0.0, "calls": 0})
                entry["seconds"] = round(entry["seconds"] + now - start, 3)
                entry["peak_rss_gib"] = round(max(entry["peak_rss_gib"], max(peak, hwm) / GIB), 3)
                entry["calls"] += 1
        return stages

    def write_snapshot(self, path: str) -> None:
        write_json(path, self.snapshot())

    @contextlib.contextmanager
    def stage(self, name: str):
        with self._lock:
            if self.stack:  # the parent's peak up to now, before the reset
                self.stack[-1][2] = max(self.stack[-1][2], _vm_hwm_bytes())
            path = ".".join([s[0] for s in self.stack] + [name])
            _reset_hwm()
            self.stack.append([name, time.perf_counter(), 0])
        try:
            yield
        finally:
            with self._lock:
                _, start, peak = self.stack.pop()
                peak = max(peak, _vm_hwm_bytes())
                entry = self.stages.setdefault(path, {"seconds": 0.0, "peak_rss_gib": 0.0, "calls": 0})
                entry["seconds"] = round(entry["seconds"] + time.perf_counter() - start, 3)
                entry["peak_rss_gib"] = round(max(entry["peak_rss_gib"], peak / GIB), 3)
                entry["calls"] += 1
                if self.stack:
                    self.stack[-1][2] = max(self.stack[-1][2], peak)
                _reset_hwm()

    def wrap(self, owner, attr: str, name: str, kind: str = "function") -> None:
        """Replace ``owner.attr`` by a version timed as stage ``name`` (kind: function | classmethod). A call made
        inside the same stage (an override calling its parent's wrapped method) is not a stage of its own."""
        original = getattr(owner, attr)
        recorder = self

        def timed_call(func, *args, **kwargs):
            if recorder.stack and recorder.stack[-1][0] == name:
                return func(*args, **kwargs)
            with recorder.stage(name):
                return func(*args, **kwargs)

        if kind == "classmethod":
            func = original.__func__

            @functools.wraps(func)
            def timed_cm(cls, *args, **kwargs):
                return timed_call(func, cls, *args, **kwargs)

            setattr(owner, attr, classmethod(timed_cm))
            return

        @functools.wraps(original)
        def timed(*args, **kwargs):
            return timed_call(original, *args, **kwargs)

        setattr(owner, attr, timed)


# --------------------------------------------------------------------------------------------------- data + encoder
#: most images per item or label (MM-AmazonTitles-300K: "up to 15", mufin.md 6)
MAX_IMAGES = 15


def write_image_pool(directory: str, count: int, size: int, seed: int = 0) -> list[str]:
    """``count`` small RGB PNG files of ``size`` x ``size`` pixels (a colour field with one inverted column, both from
    the image's number) that the synthetic items and labels point at; files already there are kept. Returns their
    absolute paths. Memory: the paths (~100 bytes each); disk: ~100 bytes a file at 32 x 32."""
    import numpy as np
    from PIL import Image

    os.makedirs(directory, exist_ok=True)
    colours = np.random.default_rng(seed).integers(0, 256, size=(count, 3), dtype=np.uint8)
    paths = []
    for j in range(count):
        path = os.path.abspath(os.path.join(directory, f"img{j:06d}.png"))
        if not os.path.exists(path):
            pixels = np.empty((size, size, 3), dtype=np.uint8)
            pixels[:] = colours[j]
            pixels[:, j % size] = 255 - colours[j]
            Image.fromarray(pixels).save(path + ".tmp", format="PNG")
            os.replace(path + ".tmp", path)
        paths.append(path)
    return paths


def draw_images(pool: list[str], owners: list, mean_images: float, seed: int, label_share: float = 0.8) -> list[list[str]]:
    """One image list per owner (an item's label ids, or ``[l]`` for label ``l``): Binomial(15, mean / 15) images each
    (MM-AmazonTitles-300K: up to 15, 4.91 an item on average), each the pool image of one of the owner's labels
    (``pool[l % len(pool)]``) with probability ``label_share``, else a random pool image: images carry the labels the
    way the texts' planted words do. The lists hold references to the pool's strings: 8 bytes an image in memory."""
    import numpy as np

    rng = np.random.default_rng(seed)
    counts = rng.binomial(MAX_IMAGES, min(mean_images / MAX_IMAGES, 1.0), size=len(owners))
    out = []
    for labels, k in zip(owners, counts.tolist()):
        if not k:
            out.append([])
            continue
        if len(labels):
            from_labels = rng.random(k) < label_share
            own = np.asarray(labels)[rng.integers(0, len(labels), size=k)]
            picks = np.where(from_labels, own, rng.integers(0, len(pool), size=k)) % len(pool)
        else:  # an owner without labels: random pool images only
            picks = rng.integers(0, len(pool), size=k)
        out.append([pool[j] for j in picks.tolist()])
    return out


def make_task(data_dir: str, num_labels: int, num_train: int, num_test: int, seed: int = 0, topic_size: int | None = None,
              images_per_item: float = 0.0, image_pool: int = 4096, image_size: int = 32, labels_per_point: tuple[int, int] = (1, 43)) -> dict:
    """Write the synthetic task (trn/tst/lbl.json.gz) into ``data_dir`` unless already there; with ``images_per_item``
    every item and label also points at images of a pool of ``image_pool`` generated PNG files (``draw_images``)."""
    done = os.path.join(data_dir, "task.json")
    if os.path.exists(done):
        with open(done) as f:
            return json.load(f)
    import numpy as np

    from hf_xmc.data import make_synthetic_xmc, write_xc_labels, write_xc_raw

    os.makedirs(data_dir, exist_ok=True)
    start = time.perf_counter()
    # 1-43 labels per query (mean 22, as LF-AmazonTitles-1.3M's 22.2); Zipf 0.6 over label ranks: the top label in
    # ~2.5% of the queries, the rarest in ~14 at 1.3M labels (a=1.1 puts one label in almost every query at this depth)
    data = make_synthetic_xmc(
        num_labels, num_train, num_test, labels_per_point=labels_per_point, zipf_a=0.6, noise_words=4, seed=seed, topic_size=topic_size
    )
    label_images = None
    if images_per_item:
        pool = write_image_pool(os.path.join(data_dir, "images"), image_pool, image_size, seed=seed)
        for offset, split in enumerate((data.train, data.test)):
            targets = split.targets
            owners = [targets.indices[targets.indptr[i]:targets.indptr[i + 1]] for i in range(targets.shape[0])]
            split.images = draw_images(pool, owners, images_per_item, seed=seed + 1 + offset)
        label_images = draw_images(pool, [[label] for label in range(num_labels)], images_per_item, seed=seed + 3, label_share=0.5)
    write_xc_raw(os.path.join(data_dir, "trn.json.gz"), data.train)
    write_xc_raw(os.path.join(data_dir, "tst.json.gz"), data.test)
    write_xc_labels(os.path.join(data_dir, "lbl.json.gz"), data.label_uids, data.label_texts, images=label_images)
    counts = np.asarray(data.train.targets.sum(axis=0)).ravel()
    stats = {
        "num_labels": num_labels, "num_train": num_train, "num_test": num_test,
        "labels_per_query": round(float(data.train.targets.nnz / max(num_train, 1)), 2),
        "queries_per_label": round(float(data.train.targets.nnz / num_labels), 2),
        "max_queries_per_label": int(counts.max()), "labels_without_training_query": int((counts == 0).sum()),
        "word_letters": len(data.label_texts[0].split()[1]), "seconds": round(time.perf_counter() - start, 1),
        "topic_size": topic_size,
    }
    if images_per_item:
        stats.update(
            images_per_item=round(sum(map(len, data.train.images)) / max(num_train, 1), 2),
            images_per_label=round(sum(map(len, label_images)) / num_labels, 2), image_pool=image_pool, image_size=image_size,
        )
    with open(done, "w") as f:
        json.dump(stats, f, indent=2)
    return stats


def make_encoder(directory: str, word_letters: int, layers: int, hidden: int = 384) -> str:
    """A random BERT (``layers`` transformer layers, hidden ``hidden``) and a WordPiece tokenizer whose pieces are the
    synthetic words' syllable pairs (``abcd`` and ``##abcd``), so a word is two or three tokens."""
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    import torch
    from transformers import BertConfig, BertModel, BertTokenizer

    from hf_xmc.data.synthetic import _SYLLABLES

    syllables = [bytes(s).decode() for s in _SYLLABLES]
    pairs = [a + b for a in syllables for b in syllables]
    pieces = pairs + syllables
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "label"] + pieces + ["##" + p for p in pieces]
    os.makedirs(directory, exist_ok=True)
    vocab_file = os.path.join(directory, "vocab.txt")
    with open(vocab_file, "w") as f:
        f.write("\n".join(vocab) + "\n")
    tokenizer = BertTokenizer(vocab=vocab_file, do_lower_case=True)
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=6,
        intermediate_size=hidden, max_position_embeddings=64,
    )
    BertModel(config).save_pretrained(directory)
    return directory


def make_vision_encoder(directory: str, image_size: int, layers: int, hidden: int = 384) -> str:
    """A random ViT (``layers`` transformer layers, hidden ``hidden``, 2 x 2 patches of ``image_size`` / 2) and its
    image processor: the vision side's counterpart of ``make_encoder`` (patch and position embeddings, LayerNorm and
    pooler at 0 layers), so encoding millions of images costs what decoding and resizing them costs."""
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    import torch
    from transformers import ViTConfig, ViTImageProcessor, ViTModel

    os.makedirs(directory, exist_ok=True)
    torch.manual_seed(0)
    config = ViTConfig(image_size=image_size, patch_size=image_size // 2, hidden_size=hidden, num_hidden_layers=layers,
                       num_attention_heads=6, intermediate_size=hidden)
    ViTModel(config).save_pretrained(directory)  # with its pooler: MUFIN reads pooler_output (vision_pooling "pooler")
    ViTImageProcessor(size={"height": image_size, "width": image_size}).save_pretrained(directory)
    return directory


# --------------------------------------------------------------------------------------------------- workers
def train_worker(cfg: dict) -> dict:
    """One training run through the method's recipe, every stage timed."""
    import importlib

    from hf_xmc.models.modeling_xmc import XMCPreTrainedModel
    from hf_xmc.training import callbacks as callbacks_module
    from hf_xmc.training import trainer as trainer_module
    from hf_xmc.training.recipes import RECIPES
    from hf_xmc.training.samplers import ClusterBatchSampler

    rec = StageRecorder(cfg.get("stages_file"))
    recipe = importlib.import_module(RECIPES[cfg["method"]])
    rec.wrap(recipe, "load_data", "data_load")
    # model_init: the base class's from_encoder_pretrained and each model's own (SiameseXML's BOE encoder, MUFIN's)
    classes, pending = [], [XMCPreTrainedModel]
    while pending:
        cls = pending.pop()
        classes.append(cls)
        pending += cls.__subclasses__()
    for cls in classes:
        if "from_encoder_pretrained" in vars(cls):
            rec.wrap(cls, "from_encoder_pretrained", "model_init", kind="classmethod")
    rec.wrap(trainer_module, "initialize_label_state", "label_state")
    rec.wrap(callbacks_module.XMCEpochCallback, "_query_embeddings", "clustering_encode")
    rec.wrap(ClusterBatchSampler, "update_clusters", "clustering")
    rec.wrap(callbacks_module, "mine_hard_negatives", "hard_negative_mining")
    # SiameseXML's Module II (its recipe's names): the label graph, the label state and the training shortlists
    # (and the bag-of-embeddings encoder's IDF pass over the training and label texts)
    # MUFIN's Module II (centroids, the label bags and their index, the shortlists) and the centroid refresh after
    # Module IV (every training item encoded again)
    for attr, stage in (("label_correlation_matrix", "label_graph"), ("build_label_state", "label_state"), ("mine_classifier_shortlist", "hard_negative_mining"),
                        ("bag_of_embeddings_document_frequency", "boe_idf"), ("mine_mufin_shortlist", "hard_negative_mining")):
        if hasattr(recipe, attr):
            rec.wrap(recipe, attr, stage)
    if hasattr(recipe, "MUFINCentroidCallback"):
        rec.wrap(recipe.MUFINCentroidCallback, "on_train_end", "label_state")
    rec.wrap(trainer_module.XMCTrainer, "train", "train")
    rec.wrap(trainer_module.XMCTrainer, "evaluate", "evaluate")
    rec.wrap(XMCPreTrainedModel, "build_label_index", "index_build")
    rec.wrap(trainer_module.XMCTrainer, "save_model", "save")
    rec.wrap(trainer_module.XMCTrainer, "_save_checkpoint", "checkpoint")
    rec.wrap(trainer_module.XMCTrainer, "create_model_card", "model_card")
    d = cfg["data_dir"]
    argv = [
        "--train_file", os.path.join(d, "trn.json.gz"), "--test_file", os.path.join(d, "tst.json.gz"),
        "--label_file", os.path.join(d, "lbl.json.gz"), "--model_name_or_path", cfg["encoder"],
        "--output_dir", cfg["output_dir"], "--overwrite_output_dir", "true", "--max_steps", str(cfg["steps"]),
        "--per_device_train_batch_size", str(cfg["batch_size"]), "--max_seq_length", str(cfg["max_seq_length"]),
        "--save_strategy", "no", "--logging_steps", "25", "--disable_tqdm", "true", "--seed", "0",
        "--eval_batch_size", "1024", "--propensity_a", "0.6", "--propensity_b", "2.6", "--dataset_name", "synthetic-lf-1.3m-shape",
        "--index_kind", cfg["index_kind"], "--ivf_nprobe", str(cfg["ivf_nprobe"]),
        *cfg["args"],
    ]
    if cfg["method"] == "mufin":  # Module I and Module IV get --steps each; the recipe's fusion as given, no channel
        argv += ["--siamese_max_steps", str(cfg["steps"])]
        if cfg.get("vision_encoder"):
            argv += ["--vision_model_name_or_path", cfg["vision_encoder"]]
    if cfg["method"] == "siamesexml":  # --max_steps bounds Module I only: Module IV gets the same budget of steps
        # [C]'s fusion weight as given, so no validation split is held out to tune it: the pipeline of the committed rows
        argv += ["--classifier_max_steps", str(cfg["steps"]), "--fusion_weight", "0.5"]
    if cfg.get("resume"):
        argv += ["--resume_from_checkpoint", "true"]
    with rec.stage("total"):
        metrics = recipe.main(argv)
    rec.close()
    return {"stages": with_steps_stage(rec.stages), "train_metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))}}


def with_steps_stage(stages: dict[str, dict]) -> dict[str, dict]:
    """Add ``total.train.steps``, the optimisation steps themselves: ``train`` minus the stages nested in it."""
    stages = {k: v for k, v in stages.items() if k != "total.train.steps"}
    children = sum(v["seconds"] for k, v in stages.items() if k.startswith("total.train.") and k.count(".") == 2)
    if "total.train" in stages:
        stages["total.train.steps"] = {"seconds": round(stages["total.train"]["seconds"] - children, 3), "peak_rss_gib": None, "calls": 1}
    return stages


def reload_worker(cfg: dict) -> dict:
    """Fresh process: remote-code reload, predict(k=100) on the test set, latency at batch 1 and 256."""
    import numpy as np
    from transformers import AutoModel

    from hf_xmc.data import read_xc_raw
    from hf_xmc.metrics import xmc_metrics

    rec = StageRecorder()
    with rec.stage("total"):
        with rec.stage("reload"):
            model = AutoModel.from_pretrained(cfg["output_dir"], trust_remote_code=True)
        test = read_xc_raw(os.path.join(cfg["data_dir"], "tst.json.gz"), num_labels=len(model.label_texts))
        images = {"images": test.images} if test.images is not None else {}  # MUFIN's items with images
        with rec.stage("predict"):
            pred = model.predict(test.texts, k=100, batch_size=1024, **images)
        metrics = xmc_metrics(pred.label_ids, test.targets, None, ks=(1, 5), recall_ks=(100,))
        latency = {}
        texts = test.texts
        for batch in (1, 256):
            times = []
            reps = 50 if batch == 1 else 8
            for r in range(reps):
                rows = [(r * batch + j) % len(texts) for j in range(batch)]
                chunk = {"images": [test.images[i] for i in rows]} if images else {}
                start = time.perf_counter()
                model.predict([texts[i] for i in rows], k=100, batch_size=batch, **chunk)
                times.append(time.perf_counter() - start)
            latency[f"batch_{batch}_ms"] = round(1000 * float(np.median(times)), 2)
    return {"stages": rec.stages, "P@1": float(metrics["P@1"]), "P@5": float(metrics["P@5"]), "R@100": float(metrics["R@100"]), "latency": latency}


def _device_name() -> str:
    """The accelerator the training runs will use (accelerate picks CUDA when torch sees it), else "cpu"."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def _saved_bytes(directory: str) -> int:
    total = 0
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            total += os.path.getsize(path)
    return total


def run_worker(kind: str, cfg: dict, log_path: str, timeout: float) -> dict:
    """Run a worker in a fresh Python process; returns its result dict (raises with the log's tail on failure)."""
    result_path = log_path + ".result.json"
    if os.path.exists(result_path):
        os.remove(result_path)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--worker_config", json.dumps(cfg), "--worker_result", result_path]
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    if proc.returncode != 0 or not os.path.exists(result_path):
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{kind} worker failed (exit {proc.returncode}):\n{tail}")
    with open(result_path) as f:
        return json.load(f)


def earlier_parts(log: str, out_dir: str, resume: bool) -> list[dict]:
    """The stage figures of the earlier training processes of a stopped row, oldest first (``resume``: the last
    process's snapshot becomes the newest part); a row that starts fresh (no ``resume``, or nothing stopped) has its
    earlier files and model directory removed, and gets []."""
    import glob
    import shutil

    snapshot = log + ".train.stages.json"
    done = sorted(glob.glob(log + ".train.part*.json"), key=lambda p: int(p.rsplit("part", 1)[1].split(".")[0]))
    if resume and os.path.exists(snapshot):  # the last process was stopped: its figures become the newest part
        os.replace(snapshot, f"{log}.train.part{len(done) + 1}.json")
        done.append(f"{log}.train.part{len(done) + 1}.json")
    if not resume or not done:  # a fresh row
        for path in done + [snapshot]:
            if os.path.exists(path):
                os.remove(path)
        shutil.rmtree(out_dir, ignore_errors=True)
        return []
    parts = []
    for path in done:
        with open(path) as f:
            parts.append(json.load(f))
    return parts


def merge_parts(parts: list[dict]) -> dict:
    """One row's stages from the processes it ran in: seconds and calls summed, the peak the highest of any part.
    A part's open stages were cut at its last snapshot (up to 30 s before it was stopped); the work it lost there is
    done again, and counted, in the next part."""
    merged: dict[str, dict] = {}
    for stages in parts:
        for path, st in stages.items():
            entry = merged.setdefault(path, {"seconds": 0.0, "peak_rss_gib": None, "calls": 0})
            entry["seconds"] = round(entry["seconds"] + st["seconds"], 3)
            entry["calls"] += st.get("calls", 1)
            if st.get("peak_rss_gib") is not None:
                entry["peak_rss_gib"] = max(entry["peak_rss_gib"] or 0.0, st["peak_rss_gib"])
    return merged


def worker_stages(kind: str, stages: dict) -> dict:
    """A worker's stage figures under the row's names: ``total.X`` -> ``kind:X``."""
    return {f"{kind}:{k[len('total.'):] if k.startswith('total.') else k}": v for k, v in stages.items()}


def run_variant(method: str, variant: str, args, task: dict, encoder: str, vision_encoder: str | None = None) -> dict:
    spec = VARIANTS[(method, variant)]
    if bool(spec.get("images")) != bool(task.get("images_per_item")):
        need = "needs a task with images (--images_per_item, e.g. 4.91)" if spec.get("images") else "runs on a text-only task (--images_per_item 0)"
        raise SystemExit(f"bench_scale.py: {method}:{variant} {need}")
    batch_size = args.batch_size or spec["batch_size"]
    steps = args.all_label_steps if variant == "all_label" else args.steps
    extra = list(spec["args"]) + shlex.split(args.train_args)
    if variant == "all_label" and args.batch_size:
        extra[extra.index("--gradient_cache_chunk_size") + 1] = str(min(3000, args.batch_size))
    out_dir = os.path.join(args.work_dir, f"{method}-{variant}")
    cfg = {
        "method": method, "variant": variant, "data_dir": args.data_dir, "encoder": encoder, "output_dir": out_dir,
        "steps": steps, "batch_size": batch_size, "max_seq_length": args.max_seq_length, "args": extra,
        "index_kind": args.index_kind, "ivf_nprobe": args.ivf_nprobe, "vision_encoder": vision_encoder if spec.get("images") else None,
    }
    row = {
        "method": method, "variant": variant, "num_labels": task["num_labels"], "num_train": task["num_train"],
        "num_test": task["num_test"], "steps": steps, "batch_size": batch_size, "encoder_layers": args.encoder_layers,
        "vision_layers": args.vision_layers if spec.get("images") else None,
        "encoder": os.path.basename(os.path.normpath(args.encoder)) if args.encoder else f"random-{args.encoder_layers}l",
        "train_args": args.train_args, "device": _device_name(),
        "index_kind": args.index_kind, "ivf_nprobe": args.ivf_nprobe if args.index_kind == "ivf" else None,
        "completed": False, "peak_rss_gib": None, "saved_bytes": None, "stages": {}, "P@1": None, "R@100": None,
    }
    os.makedirs(args.work_dir, exist_ok=True)
    log = os.path.join(args.work_dir, f"{method}-{variant}")
    cfg["stages_file"] = log + ".train.stages.json"
    parts = earlier_parts(log, out_dir, args.resume)
    cfg["resume"] = bool(parts)
    try:
        train = run_worker("train", cfg, log + ".train.log", args.timeout)
        if parts:
            train["stages"] = with_steps_stage(merge_parts(parts + [train["stages"]]))
            row["parts"] = len(parts) + 1
        row["stages"].update(worker_stages("train", train["stages"]))
        row["saved_bytes"] = _saved_bytes(out_dir)
        row["eval"] = {k: train["train_metrics"][k] for k in ("test_P@1", "test_P@5", "test_R@100", "train_runtime") if k in train["train_metrics"]}
        reload = run_worker("reload", cfg, log + ".reload.log", args.timeout)
        row["stages"].update(worker_stages("reload", reload["stages"]))
        row.update({"P@1": reload["P@1"], "P@5": reload["P@5"], "R@100": reload["R@100"], "latency_ms": reload["latency"], "completed": True})
        row.update(step_rate(row))
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        message = str(err)
        row["error"] = message if len(message) <= 2000 else message.split("\n", 1)[0] + "\n...\n" + message[-1800:]
        if not row["stages"] and os.path.exists(cfg["stages_file"]):  # the training process died (killed, out of memory):
            with open(cfg["stages_file"]) as f:  # its last snapshot says how far it got and at what peak
                snapshot = json.load(f)
            row["stages"].update(worker_stages("train", with_steps_stage(merge_parts(parts + [snapshot])) if parts else snapshot))
    peaks = [v["peak_rss_gib"] for v in row["stages"].values() if v.get("peak_rss_gib") is not None]
    row["peak_rss_gib"] = max(peaks) if peaks else None
    return row


STAGE_COLUMNS = [
    ("data", "train:data_load"), ("label state", "train:train.label_state"), ("cluster", "train:train.clustering_encode"),
    ("", "train:train.clustering"), ("mining", "train:train.hard_negative_mining"), ("steps", "train:train.steps"),
    ("eval", "train:evaluate"), ("save", "train:save"), ("reload", "reload:reload"), ("predict", "reload:predict"),
]


REAL_EPOCH_QUERIES = 2_200_000  # LF-AmazonTitles-1.3M's training queries (prime.md 8.2)


def step_rate(row: dict) -> dict:
    """Seconds per training step (the ``steps`` stage over the row's steps, first steps' warm-up included) and one
    epoch of the real dataset's queries at the row's batch size; empty for SiameseXML and MUFIN, whose runs hold two
    trainings."""
    seconds = (row["stages"].get("train:train.steps") or {}).get("seconds")
    if not seconds or not row.get("steps") or row["method"] in ("siamesexml", "mufin"):
        return {}
    epoch_steps = math.ceil(REAL_EPOCH_QUERIES / row["batch_size"])
    return {
        "seconds_per_step": round(seconds / row["steps"], 4),
        "epoch_steps_real": epoch_steps,
        "epoch_seconds_real": round(epoch_steps * seconds / row["steps"], 1),
    }


def _hours(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 3600:.1f} h"


def format_table(rows: list[dict]) -> str:
    """Markdown table: per variant the seconds (peak GiB) of each stage, size on disk, quality and latency."""
    header = ["method", "labels", "train q", "steps x batch", "index", "data", "label state", "clustering", "mining", "steps", "eval", "save",
              "reload", "predict k=100", "peak RSS GiB", "saved GB", "P@1", "R@100", "ms/query b=1", "ms/batch b=256", "s/step", "1 epoch of 2.2M"]

    def cell(row, key):
        # SiameseXML's label state and mining run between its two trainings, not inside one: "train:<stage>"
        st = row["stages"].get(key) or row["stages"].get(key.replace("train:train.", "train:"))
        if not st:
            return "-"
        peak = f" ({st['peak_rss_gib']:.1f})" if st.get("peak_rss_gib") is not None else ""
        return f"{st['seconds']:.0f}s{peak}"

    cells = []
    for r in rows:
        rate = step_rate(r)
        cluster = "-"
        if r["stages"].get("train:train.clustering"):
            enc = r["stages"].get("train:train.clustering_encode", {"seconds": 0.0})
            cl = r["stages"]["train:train.clustering"]
            cluster = f"{enc['seconds']:.0f}+{cl['seconds']:.0f}s ({max(cl['peak_rss_gib'], enc.get('peak_rss_gib') or 0):.1f})"
        lat = r.get("latency_ms", {})
        name = f"{r['method']}:{r['variant']}" + ("" if r["completed"] else " (failed)")
        if (r.get("task") or {}).get("topic_size"):
            name += f" (topics of {r['task']['topic_size']})"
        if (r.get("task") or {}).get("images_per_item"):
            name += f" ({r['task']['images_per_item']} images an item)"
        if r.get("train_args"):  # rows of one table that differ only in extra flags (an A/B) stay apart
            name += f" `{r['train_args']}`"
        kind = r.get("index_kind", "exact")  # rows from before --index_kind searched exactly
        index = f"{kind} nprobe={r['ivf_nprobe']}" if kind == "ivf" and r.get("ivf_nprobe") else kind
        cells.append([
            name, f"{r['num_labels']:,}", f"{r['num_train']:,}", f"{r['steps']} x {r['batch_size']}", index, cell(r, "train:data_load"),
            cell(r, "train:train.label_state"), cluster, cell(r, "train:train.hard_negative_mining"), cell(r, "train:train.steps"),
            cell(r, "train:evaluate"), cell(r, "train:save"), cell(r, "reload:reload"), cell(r, "reload:predict"),
            r["peak_rss_gib"] if r["peak_rss_gib"] is not None else "-", f"{r['saved_bytes'] / 1e9:.2f}" if r["saved_bytes"] else "-",
            "-" if r["P@1"] is None else round(r["P@1"], 2), "-" if r["R@100"] is None else round(r["R@100"], 2),
            lat.get("batch_1_ms", "-"), lat.get("batch_256_ms", "-"), rate.get("seconds_per_step", "-"), _hours(rate.get("epoch_seconds_real")),
        ])
    return markdown_table(header, cells)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = bench_parser(__doc__, os.path.join(RESULTS_DIR, "scale.json"), docs_block="scale", marker=True, table_only=True)
    parser.add_argument("--methods", default="dexml,dexml:hard_neg,dexml:all_label,prime,unidec")
    parser.add_argument("--num_labels", type=int, default=1_300_000)
    parser.add_argument("--num_train", type=int, default=2_200_000)
    parser.add_argument("--num_test", type=int, default=50_000)
    parser.add_argument("--steps", type=int, default=200, help="Training steps of every variant but all_label.")
    parser.add_argument("--all_label_steps", type=int, default=2, help="Steps of dexml:all_label (each re-encodes every label).")
    parser.add_argument("--batch_size", type=int, default=0, help="Override every variant's paper batch size (0 = paper).")
    parser.add_argument("--max_seq_length", type=int, default=16)
    parser.add_argument(
        "--topic_size", type=int, default=None,
        help="Labels co-occur by topics of this many labels (make_synthetic_xmc topic_size; default: independent draws).",
    )
    parser.add_argument(
        "--index_kind", default="ivf", choices=("exact", "ivf", "hnsw", "torch"),
        help="Label index of every run (mining, evaluation, the saved model). Exact search of 2.2M training queries "
        "against 1.3M labels is ~10^15 multiply-adds, hours on 2 cores: ivf is the CPU choice at this shape.",
    )
    parser.add_argument("--ivf_nprobe", type=int, default=16, help="Lists an ivf index scans (recall@100 ~0.90 at 16 at 1.3M labels).")
    parser.add_argument("--encoder_layers", type=int, default=0, help="Transformer layers of the random encoder (hidden 384).")
    parser.add_argument(
        "--labels_per_point", type=int, nargs=2, default=(1, 43),
        help="Fewest and most labels per item (1 43: LF-AmazonTitles-1.3M's mean 22.2; 1 15 for MM-AmazonTitles-300K's 8.13).",
    )
    parser.add_argument(
        "--images_per_item", type=float, default=0.0,
        help="Mean images per item and label (MM-AmazonTitles-300K: 4.91, up to 15), from a pool of generated PNG files "
        "(0: a text-only task). mufin:multimodal needs them.",
    )
    parser.add_argument("--image_pool", type=int, default=4096, help="Distinct image files the items and labels point at.")
    parser.add_argument("--image_size", type=int, default=32, help="Side of the generated images and of the random ViT's input.")
    parser.add_argument("--vision_layers", type=int, default=0, help="Transformer layers of the random ViT (hidden 384).")
    parser.add_argument(
        "--encoder", default=None,
        help="An encoder directory to use instead of the random one (e.g. all-MiniLM-L6-v2 for the GPU run).",
    )
    parser.add_argument("--train_args", default="", help="Extra flags for every training run, e.g. '--bf16 true' on a GPU.")
    parser.add_argument("--data_dir", default=None, help="Where the task is written / cached (default outputs/scale/<shape>).")
    parser.add_argument("--work_dir", default=None, help="Model directories and logs (default <data_dir>/runs).")
    parser.add_argument("--timeout", type=float, default=4 * 3600, help="Seconds per worker process.")
    parser.add_argument(
        "--resume", action="store_true",
        help="Go on with rows whose training process was stopped (SiameseXML: Module I's weights and Module II's store "
        "are read back; rows with nothing stopped start fresh); the row's stages add up every process's figures, its "
        "'parts' says how many processes it took.",
    )
    parser.add_argument("--merge", action="store_true", help="Keep rows of --out for variants not run now (replace the others).")
    parser.add_argument("--worker", choices=("train", "reload"), help=argparse.SUPPRESS)
    parser.add_argument("--worker_config", help=argparse.SUPPRESS)
    parser.add_argument("--worker_result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        cfg = json.loads(args.worker_config)
        try:
            result = (train_worker if args.worker == "train" else reload_worker)(cfg)
        except Exception:
            traceback.print_exc()
            raise SystemExit(1) from None
        with open(args.worker_result, "w") as f:
            json.dump(result, f)
        return []

    if args.table_only:
        rows = read_json(args.out)
        publish(format_table(rows) + "\n", args.marker, args.update_docs)
        return rows

    variants = parse_methods(args.methods)
    shape = f"L{args.num_labels}-N{args.num_train}-T{args.num_test}"
    if args.topic_size:
        shape += f"-topic{args.topic_size}"
    if tuple(args.labels_per_point) != (1, 43):
        shape += "-lpp{}-{}".format(*args.labels_per_point)
    if args.images_per_item:
        shape += f"-img{args.images_per_item:g}x{args.image_pool}x{args.image_size}"
    args.data_dir = args.data_dir or os.path.join(REPO, "outputs", "scale", shape)
    args.work_dir = args.work_dir or os.path.join(args.data_dir, "runs")
    print(f"task {shape} in {args.data_dir}", flush=True)
    task = make_task(args.data_dir, args.num_labels, args.num_train, args.num_test, topic_size=args.topic_size,
                     images_per_item=args.images_per_item, image_pool=args.image_pool, image_size=args.image_size,
                     labels_per_point=tuple(args.labels_per_point))
    print(json.dumps(task), flush=True)
    if args.encoder:
        encoder = args.encoder
    else:
        encoder = make_encoder(os.path.join(args.data_dir, f"encoder-{args.encoder_layers}l"), task["word_letters"], args.encoder_layers)
    vision_encoder = None
    if args.images_per_item:
        vision_encoder = make_vision_encoder(os.path.join(args.data_dir, f"vit-{args.vision_layers}l"), args.image_size, args.vision_layers)

    rows: list[dict] = []
    if args.merge and os.path.exists(args.out):
        rows = [r for r in read_json(args.out) if (r["method"], r["variant"]) not in variants]
    for method, variant in variants:
        print(f"--- {method}:{variant}", flush=True)
        row = run_variant(method, variant, args, task, encoder, vision_encoder)
        row["task"] = task
        rows = [r for r in rows if (r["method"], r["variant"]) != (method, variant)] + [row]
        write_json(args.out, rows, sort_keys=False)  # after every row: a run stopped later keeps what it measured
        print(format_table([row]), flush=True)
        if not row["completed"]:
            print(row.get("error", ""), flush=True)
    publish(format_table(rows) + "\n", args.marker, args.update_docs)
    return rows


if __name__ == "__main__":
    main()
