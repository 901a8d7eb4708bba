#!/usr/bin/env python
"""Full fine-tuning against LoRA adapters on the encoder: quality, trainable parameters, peak memory, wall time and
the size of what a Hub repo holds.

    python benchmarks/bench_peft.py [--datasets debtags reuters] [--methods dexml unidec] [--ranks 8 32] [--update_readme]

Each run goes through the method's training script with the benchmark budget of the dataset (``sweep_defaults.prepare``:
all-MiniLM-L6-v2, Debtags half an epoch at batch 64, Reuters one epoch at batch 32, 32 tokens, seed 42). ``full``
trains every encoder weight at the method's default learning rate; ``lora-r<R>`` wraps the encoder in LoRA (rank R,
alpha 2R, dropout 0.05, BERT's query and value matrices: peft's default) at ``--lora_learning_rate`` and saves the
adapter alone (``--save_adapter_only``). Per run: P@1 and PSP@5 on the test split, the trainable parameters the
Trainer reports, the peak resident memory of the training process (``ru_maxrss``), wall seconds, and the bytes of the
saved directory's model files (the full model, or the adapter and what lies outside the encoder; the label store and
index are the same in both and counted in both). Writes benchmarks/results/peft.json and, with --update_readme, the
table between the ``<!-- bench:peft -->`` markers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.sweep_defaults import prepare, publish_table, training_command  # noqa: E402


def run(method: str, data_dir: str, encoder: str, out: str, extra: list[str]) -> dict:
    """One training run: its metrics, trainable parameters, peak RSS (MiB), wall seconds and saved model bytes."""
    cmd, env = training_command(method, data_dir, encoder, out, extra)
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS, not the largest of all children so far
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - start
        log.seek(0)
        text = log.read()
    if proc.returncode:
        print(text[-3000:], file=sys.stderr)
        raise SystemExit(f"run failed: {' '.join(cmd)}")
    with open(os.path.join(out, "eval_results.json")) as f:
        results = json.load(f)
    trainable = re.findall(r"Number of trainable parameters = ([\d,]+)", text)
    from hf_xmc.models.modeling_xmc import XMCPreTrainedModel, model_directory_files

    files = model_directory_files(out, XMCPreTrainedModel)
    saved = sum(os.path.getsize(os.path.join(out, name)) for name in files if name not in ("README.md", "xmc_metrics.png", "eval_results.json"))
    return {
        "P@1": results["test_P@1"], "PSP@5": results["test_PSP@5"], "trainable_params": int(trainable[-1].replace(",", "")) if trainable else None,
        "peak_rss_mib": round(usage.ru_maxrss / 1024), "wall_seconds": round(seconds, 1), "saved_mb": round(saved / 1e6, 2),
        # the 1-minute load average at the end: ~1 on this 2-core machine when the run had it to itself
        "load_average_1m": round(os.getloadavg()[0], 2), "finished": time.strftime("%Y-%m-%d %H:%M"),
    }


def write_results(args, rows: list[dict]) -> list[dict]:
    """Write ``rows`` to ``args.out`` with the rows already there for other (dataset, method, variant) runs (read now:
    a run beside this one may have written); returns all of them."""
    done = {(r["dataset"], r["method"], r["variant"]) for r in rows}
    if os.path.exists(args.out):
        with open(args.out) as f:
            rows = rows + [r for r in json.load(f)["rows"] if (r["dataset"], r["method"], r["variant"]) not in done]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"lora_learning_rate": args.lora_learning_rate, "cpu_count": os.cpu_count(), "rows": rows}, f, indent=2)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", nargs="+", default=["debtags", "reuters"], choices=["debtags", "reuters", "tiny"])
    ap.add_argument("--methods", nargs="+", default=["dexml", "unidec"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--lora_learning_rate", default="1e-3", help="Learning rate of the LoRA runs (the encoder's; heads keep their multipliers).")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "peft.json"))
    ap.add_argument("--update_readme", action="store_true")
    ap.add_argument("--table_only", action="store_true", help="Print (and with --update_readme write) the table of --out; run nothing.")
    ap.add_argument("--rerun", action="store_true", help="Run again the (dataset, method, variant) rows --out already has (default: skip them).")
    args = ap.parse_args()
    rows = []
    measured = set()
    if os.path.exists(args.out) and not args.rerun:
        with open(args.out) as f:
            measured = {(r["dataset"], r["method"], r["variant"]) for r in json.load(f)["rows"]}
    with tempfile.TemporaryDirectory() as work:
        for dataset in args.datasets if not args.table_only else ():
            data_dir, encoder, budget = prepare(dataset, work)
            for method in args.methods:
                variants = [("full", [])] + [
                    (f"lora-r{r}", ["--peft", "lora", "--lora_r", str(r), "--lora_alpha", str(2 * r), "--learning_rate", args.lora_learning_rate, "--save_adapter_only", "true"])
                    for r in args.ranks
                ]
                for name, extra in variants:
                    if (dataset, method, name) in measured:
                        continue
                    out = os.path.join(work, f"{dataset}-{method}-{name}")
                    row = {"dataset": dataset, "method": method, "variant": name, **run(method, data_dir, encoder, out, budget + ["--seed", "42"] + extra)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    write_results(args, rows)  # after every run: a long benchmark stopped midway keeps what it measured
    rows = write_results(args, rows)
    table = ["| dataset | method | encoder training | P@1 | PSP@5 | trainable parameters | peak memory (MiB) | wall (s) | load | saved model files (MB) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    def rank(variant: str) -> int:
        return int(variant.rsplit("-r", 1)[1]) if variant.startswith("lora-r") else 0

    for r in sorted(rows, key=lambda r: (r["dataset"], r["method"], r["variant"] != "full", rank(r["variant"]), r["variant"])):
        trainable = f"{r['trainable_params']:,}" if r["trainable_params"] else "-"
        load = f"{r['load_average_1m']:.1f}" if r.get("load_average_1m") is not None else "~1 (quiet)"
        table.append(f"| {r['dataset']} | {r['method']} | {r['variant']} | {r['P@1']:.2f} | {r['PSP@5']:.2f} | {trainable} | {r['peak_rss_mib']:,} | {r['wall_seconds']:.0f} | {load} | {r['saved_mb']:.1f} |")
    publish_table("\n".join(table), "<!-- bench:peft -->", args.update_readme)


if __name__ == "__main__":
    main()
