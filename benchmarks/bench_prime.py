#!/usr/bin/env python
"""PRIME against DEXML (in-batch negatives) at the same budget: same encoder (all-MiniLM-L6-v2), epochs, batch size,
learning rate and seed, every run through its ``training_scripts/train_<method>.py`` contract.

    python benchmarks/bench_prime.py [--datasets debtags reuters] [--epochs 1] [--modes ...] [--update_docs]

Debtags is the bundled dataset (PRIME's defaults were chosen on it); Reuters-21578 (``benchmarks/make_reuters.py``)
is the check on data the defaults were not tuned on. Writes benchmarks/results/prime.json (``--out``) and, with
--update_docs, the table between the ``<!-- bench:prime -->`` lines of docs/benchmarks.md (``--marker`` picks another
block); ``--table_only`` re-renders the table of ``--out``.
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.sweep_defaults import modes_main  # noqa: E402

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
    modes_main(__doc__, MODES, DEFAULT_MODES, "prime.json", "prime")


if __name__ == "__main__":
    main()
