#!/usr/bin/env python
"""Debtags benchmark: the quickstart's numbers (zero-shot vs trained DEXML, train time, predict queries/s) next to
the peers a user would pick instead (Omikuji and napkinXC on TF-IDF, and the lexical TF-IDF zero-shot baseline),
all on the same bundled split.

    python benchmarks/bench_debtags.py [--num_train_epochs 1.0] [--update_readme]

Writes benchmarks/results/debtags.json and benchmarks/results/debtags.md; with --update_readme it also replaces
the table between the markers (README.md or docs/) ``<!-- bench:debtags -->`` markers.
"""

import argparse
import os
import platform
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from benchmarks.peers import markdown_table, run_peers  # noqa: E402
from benchmarks.sweep_defaults import update_readme_block  # noqa: E402
from hf_xmc import quickstart  # noqa: E402
from hf_xmc.data import load_debtags  # noqa: E402
from hf_xmc.training.script_utils import write_json_atomic  # noqa: E402

RESULTS_DIR = os.path.join(REPO, "benchmarks", "results")
MARKER = "<!-- bench:debtags -->"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num_train_epochs", type=float, default=None, help="default: the quickstart's")
    ap.add_argument("--output_dir", default=os.path.join(REPO, "outputs", "bench-debtags-dexml"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--update_readme", action="store_true")
    args = ap.parse_args()

    qs_argv = ["--output_dir", args.output_dir, "--num_examples", "0"]
    if args.num_train_epochs is not None:
        qs_argv += ["--num_train_epochs", str(args.num_train_epochs)]
    qs_args = quickstart.parse_args(qs_argv)
    start = time.perf_counter()
    qs = quickstart.run(qs_args)
    job_seconds = time.perf_counter() - start
    n_test = len(load_debtags().test)

    def ours(name, metrics, train_seconds):
        return {
            "method": name,
            "metrics": {k[len("test_"):]: v for k, v in metrics.items() if k.startswith("test_")},
            "train_seconds": train_seconds,
            "predict_queries_per_second": metrics["test_samples_per_second"],
        }

    rows = [
        ours("hf_xmc DEXML, all-MiniLM-L6-v2, trained", qs["trained"], qs["train_runtime"]),
        ours("hf_xmc zero-shot all-MiniLM-L6-v2 (untrained)", qs["zero_shot"], 0.0),
    ]
    rows += run_peers(load_debtags(), k=100, threads=args.threads, seed=0, only=("omikuji", "napkinxc", "zeroshot"))
    table = markdown_table(rows)
    result = {
        "dataset": f"Debtags (bundled): {n_test} test points",
        "quickstart_args": qs["args"],
        "quickstart_wall_seconds": job_seconds,
        "rows": rows,
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
                    "torch": torch.__version__},
    }
    os.makedirs(RESULTS_DIR, exist_ok=True)
    write_json_atomic(os.path.join(RESULTS_DIR, "debtags.json"), result)
    note = (f"\nQuickstart wall time {job_seconds:.0f} s on {os.cpu_count()} CPU cores "
            f"({qs['args']['num_train_epochs']} epoch(s), batch {qs['args']['per_device_train_batch_size']}, "
            f"lr {qs['args']['learning_rate']}). Train s / predict q/s of the peers include TF-IDF featurisation; "
            "ours include tokenisation, encoding and index search.\n")
    with open(os.path.join(RESULTS_DIR, "debtags.md"), "w") as f:
        f.write(table + note)
    print("\n" + table + note)
    if args.update_readme:
        update_readme_block(MARKER, table + note)


if __name__ == "__main__":
    main()
