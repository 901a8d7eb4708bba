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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.sweep_defaults import run_modes  # noqa: E402

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
    run_modes(MODES, ap.parse_args(), "MiniLM-L6, lr 3e-4")


if __name__ == "__main__":
    main()
