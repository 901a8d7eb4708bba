#!/usr/bin/env python
"""DEXML training modes on the bundled Debtags data, each run through ``training_scripts/train_dexml.py``:
in-batch negatives only vs NGAME cluster batching + mined hard negatives (same encoder, epochs, batch size, lr).

    python benchmarks/bench_dexml_modes.py [--epochs 2] [--modes in_batch engine] [--update_readme]

Writes benchmarks/results/dexml_modes.json and, with --update_readme, the table between the markers (README.md or docs/)
``<!-- bench:dexml-modes -->`` markers.
"""

import argparse
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.sweep_defaults import run_training_script, update_readme_block  # noqa: E402
from hf_xmc.data import DEBTAGS_DIR  # noqa: E402
from hf_xmc.quickstart import minilm_path  # noqa: E402
from hf_xmc.training.script_utils import write_json_atomic  # noqa: E402

MARKER = "<!-- bench:dexml-modes -->"
SHOWN = ["test_P@1", "test_P@3", "test_P@5", "test_nDCG@5", "test_PSP@1", "test_PSP@3", "test_PSP@5", "test_R@10"]
MODES = {
    "in_batch": ("in-batch negatives (uniform positives, random batches)", []),
    "engine": (
        "cluster batching (clusters of 16 from epoch 1) + 2 hard negatives/query from a top-100 shortlist (from epoch 1)",
        ["--cluster_batching", "true", "--cluster_init_size", "16", "--cluster_curriculum_epochs", "1",
         "--cluster_refresh_interval", "1", "--hard_negatives", "2", "--hard_negative_start_epoch", "1",
         "--hard_negative_refresh_interval", "1", "--hard_negative_top_k", "100"],
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", default="2")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--update_readme", action="store_true")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for mode in args.modes:
            desc, extra = MODES[mode]
            common = ["--num_train_epochs", args.epochs, "--per_device_train_batch_size", "64", "--max_seq_length", "32", "--seed", "42"]
            results, seconds = run_training_script("dexml", str(DEBTAGS_DIR), minilm_path(), os.path.join(work, mode), common + extra)
            rows.append({"mode": mode, "description": desc, "args": extra, "wall_seconds": seconds, **results})
            print(f"{mode}: " + " ".join(f"{k[5:]}={results[k]:.2f}" for k in SHOWN), flush=True)
    table = f"| DEXML on Debtags, {args.epochs} epochs | " + " | ".join(k[5:] for k in SHOWN) + " | wall s |\n"
    table += "|---|" + "---:|" * (len(SHOWN) + 1) + "\n"
    for r in rows:
        table += f"| {r['description']} | " + " | ".join(f"{r[k]:.2f}" for k in SHOWN) + f" | {r['wall_seconds']:.0f} |\n"
    print("\n" + table)
    write_json_atomic(os.path.join(REPO, "benchmarks", "results", "dexml_modes.json"), {"epochs": args.epochs, "rows": rows})
    if args.update_readme:
        update_readme_block(MARKER, table)


if __name__ == "__main__":
    main()
