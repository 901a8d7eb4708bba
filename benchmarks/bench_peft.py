#!/usr/bin/env python
"""Full fine-tuning against LoRA adapters on the encoder: quality, trainable parameters, peak memory, wall time and
the size of what a Hub repo holds.

    python benchmarks/bench_peft.py [--datasets debtags reuters] [--methods dexml unidec] [--ranks 8 32] [--update_docs]

Each run goes through the method's training script with the benchmark budget of the dataset (``sweep_defaults.prepare``:
all-MiniLM-L6-v2, Debtags half an epoch at batch 64, Reuters one epoch at batch 32, 32 tokens, seed 42). ``full``
trains every encoder weight at the method's default learning rate; ``lora-r<R>`` wraps the encoder in LoRA (rank R,
alpha 2R, dropout 0.05, BERT's query and value matrices: peft's default) at ``--lora_learning_rate`` and saves the
adapter alone (``--save_adapter_only``). Per run: P@1 and PSP@5 on the test split, the trainable parameters the
Trainer reports, the peak resident memory of the training process (``ru_maxrss``), wall seconds, and the bytes of the
saved directory's model files (the full model, or the adapter and what lies outside the encoder; the label store and
index are the same in both and counted in both). Writes benchmarks/results/peft.json (``--out``) and, with
--update_docs, the table between the ``<!-- bench:peft -->`` lines of docs/peft.md and of README.md (the same table in
both); ``--table_only`` re-renders the table of ``--out``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import bench_parser, markdown_table, publish, read_json, result_path, write_json  # noqa: E402
from benchmarks.sweep_defaults import prepare, training_command  # noqa: E402


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
    from hf_xmc.models.hub_files import model_directory_files
    from hf_xmc.models.modeling_xmc import XMCPreTrainedModel

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
        rows = rows + [r for r in read_json(args.out)["rows"] if (r["dataset"], r["method"], r["variant"]) not in done]
    write_json(args.out, {"lora_learning_rate": args.lora_learning_rate, "cpu_count": os.cpu_count(), "rows": rows}, sort_keys=False)
    return rows


def peft_table(rows: list[dict]) -> str:
    """The table of docs/peft.md and the README: per dataset and method, full fine-tuning first, then LoRA by rank."""
    def rank(variant: str) -> int:
        return int(variant.rsplit("-r", 1)[1]) if variant.startswith("lora-r") else 0

    header = ["dataset", "method", "encoder training", "P@1", "PSP@5", "trainable parameters", "peak memory (MiB)", "wall (s)", "load", "saved model files (MB)"]
    cells = []
    for r in sorted(rows, key=lambda r: (r["dataset"], r["method"], r["variant"] != "full", rank(r["variant"]), r["variant"])):
        trainable = f"{r['trainable_params']:,}" if r["trainable_params"] else "-"
        load = f"{r['load_average_1m']:.1f}" if r.get("load_average_1m") is not None else "~1 (quiet)"
        cells.append([r["dataset"], r["method"], r["variant"], f"{r['P@1']:.2f}", f"{r['PSP@5']:.2f}", trainable, f"{r['peak_rss_mib']:,}",
                      f"{r['wall_seconds']:.0f}", load, f"{r['saved_mb']:.1f}"])
    return markdown_table(header, cells, "lll" + "r" * 7)


def main() -> None:
    ap = bench_parser(__doc__, result_path("peft.json"), docs_block="peft", table_only=True)
    ap.add_argument("--datasets", nargs="+", default=["debtags", "reuters"], choices=["debtags", "reuters", "tiny"])
    ap.add_argument("--methods", nargs="+", default=["dexml", "unidec"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--lora_learning_rate", default="1e-3", help="Learning rate of the LoRA runs (the encoder's; heads keep their multipliers).")
    ap.add_argument("--rerun", action="store_true", help="Run again the (dataset, method, variant) rows --out already has (default: skip them).")
    args = ap.parse_args()
    if args.table_only:
        publish(peft_table(read_json(args.out)["rows"]), "peft", args.update_docs)
        return
    rows = []
    measured = set()
    if os.path.exists(args.out) and not args.rerun:
        measured = {(r["dataset"], r["method"], r["variant"]) for r in read_json(args.out)["rows"]}
    with tempfile.TemporaryDirectory() as work:
        for dataset in args.datasets:
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
    publish(peft_table(rows), "peft", args.update_docs)


if __name__ == "__main__":
    main()
