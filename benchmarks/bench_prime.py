#!/usr/bin/env python
"""PRIME against DEXML (in-batch negatives) at the same budget: same encoder (all-MiniLM-L6-v2), epochs, batch size,
learning rate and seed, every run through its ``training_scripts/train_<method>.py`` contract.

    python benchmarks/bench_prime.py [--datasets debtags reuters] [--epochs 1] [--modes ...] [--update_readme]

Debtags is the bundled dataset (PRIME's defaults were chosen on it); Reuters-21578 (``benchmarks/make_reuters.py``)
is the check on data the defaults were not tuned on. Writes benchmarks/results/prime.json and, with
--update_readme, the table between the README's ``<!-- bench:prime -->`` markers (``--marker`` picks another pair).
"""

import argparse
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.sweep_defaults import prepare, run_training_script, update_readme_block  # noqa: E402
from hf_xmc.training.script_utils import write_json_atomic  # noqa: E402

SHOWN = ["test_P@1", "test_P@3", "test_P@5", "test_nDCG@5", "test_PSP@1", "test_PSP@3", "test_PSP@5", "test_R@10"]
MODES = {
    "dexml": ("DEXML, in-batch negatives (DecoupledSoftmax, uniform positives, random batches)", "dexml", []),
    "prime": ("PRIME, train_prime.py defaults (2 propensity-sampled positives, cluster batching from epoch 1)", "prime", []),
    "prime_random_batches": ("PRIME, random batches (--cluster_batching false)", "prime", ["--cluster_batching", "false"]),
    "prime_lite": ("PRIME-lite (--num_positives 1)", "prime", ["--num_positives", "1"]),
    "prime_no_aux": (
        "PRIME, query->prototype term only (no L_ql, L_lq, R)",
        "prime",
        ["--query_to_label_weight", "0", "--label_to_query_weight", "0", "--regularizer_weight", "0"],
    ),
}
DEFAULT_MODES = ["dexml", "prime", "prime_random_batches"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", nargs="+", default=["debtags", "reuters"], choices=["debtags", "reuters"])
    ap.add_argument("--epochs", default="1")
    ap.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
    ap.add_argument("--results", default=os.path.join(REPO, "benchmarks", "results", "prime.json"))
    ap.add_argument("--update_readme", action="store_true")
    ap.add_argument("--marker", default="prime", help="README marker to fill: <!-- bench:MARKER -->")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for dataset in args.datasets:
            data_dir, encoder, extra_data = prepare(dataset, work)
            batch = extra_data[extra_data.index("--per_device_train_batch_size") + 1]
            common = ["--num_train_epochs", args.epochs, "--per_device_train_batch_size", batch, "--max_seq_length", "32", "--seed", "42"]
            for mode in args.modes:
                desc, method, extra = MODES[mode]
                results, seconds = run_training_script(method, data_dir, encoder, os.path.join(work, f"{dataset}-{mode}"), common + extra)
                rows.append({"dataset": dataset, "mode": mode, "description": desc, "args": extra, "batch_size": batch, "wall_seconds": seconds, **results})
                print(f"{dataset} {mode}: " + " ".join(f"{k[5:]}={results[k]:.2f}" for k in SHOWN), flush=True)
    table = f"| {args.epochs} epoch(s), MiniLM-L6, lr 3e-4 | dataset | " + " | ".join(k[5:] for k in SHOWN) + " | wall s |\n"
    table += "|---|---|" + "---:|" * (len(SHOWN) + 1) + "\n"
    for r in rows:
        table += f"| {r['description']} | {r['dataset']} (batch {r['batch_size']}) | " + " | ".join(f"{r[k]:.2f}" for k in SHOWN) + f" | {r['wall_seconds']:.0f} |\n"
    print("\n" + table)
    write_json_atomic(args.results, {"epochs": args.epochs, "rows": rows})
    if args.update_readme:
        update_readme_block(f"<!-- bench:{args.marker} -->", table)


if __name__ == "__main__":
    main()
