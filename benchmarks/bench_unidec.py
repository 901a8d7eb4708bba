#!/usr/bin/env python
"""UniDEC against its own DE-only ablation (DePSL) and DEXML at the same budget: same encoder (all-MiniLM-L6-v2),
epochs, batch size, learning rate and seed, every run through its ``training_scripts/train_<method>.py`` contract.

    python benchmarks/bench_unidec.py [--datasets debtags reuters] [--epochs 1] [--modes ...] [--update_docs]

``unidec_*`` modes are train_unidec.py (search over [DE ; classifier]) with the classifier's initialisation and loss
named explicitly (the rows stay valid whatever the defaults); ``depsl`` is the same recipe with
``--use_classifier false`` (no classifier head, no Psi: the DE-only ablation); ``unidec_de`` / ``unidec_clf`` train
UniDEC and search one head only (the paper's UniDEC-de / UniDEC-clf rows); ``batches_*`` compare the two cluster
batchings (``--epochs 3``: clustering starts at the second epoch). Debtags is the bundled dataset (defaults
chosen on it); Reuters-21578 (``benchmarks/make_reuters.py``) is the check on data they were not tuned on. Writes
benchmarks/results/unidec.json (``--out``) and, with --update_docs, the table between the ``<!-- bench:unidec -->`` lines
of docs/benchmarks.md (``--marker`` picks another block); ``--table_only`` re-renders the table of ``--out``.
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.sweep_defaults import modes_main  # noqa: E402

MODES = {
    "depsl": ("DePSL: the UniDEC recipe without classifier (--use_classifier false)", "unidec", ["--use_classifier", "false"]),
    "unidec_text_bce": (
        "UniDEC, classifier from label texts, DS + BCE classifier loss",
        "unidec",
        ["--classifier_init", "label_text", "--clf_bce_weight", "1"],
    ),
    "unidec_xavier_bce": (
        "UniDEC, xavier classifier (official), DS + BCE classifier loss",
        "unidec",
        ["--classifier_init", "xavier", "--clf_bce_weight", "1"],
    ),
    "unidec_text_ds": ("UniDEC, classifier from label texts, DS classifier loss", "unidec", ["--classifier_init", "label_text", "--clf_bce_weight", "0"]),
    "unidec_xavier_ds": ("UniDEC, xavier classifier (official), DS classifier loss", "unidec", ["--classifier_init", "xavier", "--clf_bce_weight", "0"]),
    "unidec_symmetric": (
        "UniDEC defaults + the symmetric label->query terms (--de/--clf_query_to_label_weight 0.5, the paper's)",
        "unidec",
        ["--de_query_to_label_weight", "0.5", "--clf_query_to_label_weight", "0.5"],
    ),
    "unidec_de": ("UniDEC-de: UniDEC defaults trained, DE head searched", "unidec", ["--search_mode", "de"]),
    "unidec_clf": ("UniDEC-clf: UniDEC defaults trained, classifier searched", "unidec", ["--search_mode", "classifier"]),
    "dexml": ("DEXML, in-batch negatives (train_dexml.py defaults)", "dexml", []),
    "batches_concat": (
        "UniDEC defaults, NGAME batches: clusters of 16 concatenated and cut into batches of 64 (--cluster_batch_mode concat)",
        "unidec",
        ["--cluster_batch_mode", "concat"],
    ),
    "batches_one_per_batch": (
        "UniDEC defaults, one cluster per batch: 512 leaves of 46-47 queries (--cluster_batch_mode one_per_batch)",
        "unidec",
        ["--cluster_batch_mode", "one_per_batch"],
    ),
}
DEFAULT_MODES = ["depsl", "unidec_text_bce", "unidec_xavier_bce", "unidec_text_ds", "unidec_xavier_ds"]


def main() -> None:
    modes_main(__doc__, MODES, DEFAULT_MODES, "unidec.json", "unidec")


if __name__ == "__main__":
    main()
