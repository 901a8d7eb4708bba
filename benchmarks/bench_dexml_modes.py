#!/usr/bin/env python
"""DEXML training modes on the bundled Debtags data, each run through ``training_scripts/train_dexml.py``:
in-batch negatives only vs NGAME cluster batching + mined hard negatives (same encoder, epochs, batch size, lr).

    python benchmarks/bench_dexml_modes.py [--epochs 2] [--modes in_batch engine] [--update_docs]

Writes benchmarks/results/dexml_modes.json (``--out``) and, with --update_docs, the table between the
``<!-- bench:dexml-modes -->`` lines of docs/benchmarks.md; ``--table_only`` re-renders the table of ``--out``.
"""

import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import (  # noqa: E402
    bench_parser,
    chosen_by_group,  # noqa: E402
    markdown_table,
    publish,
    read_json,
    result_path,
    write_json,
)
from benchmarks.sweep_defaults import CHOSEN_BY, minilm, run_training_script, validation_cells, validation_flags  # noqa: E402

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


def dexml_modes_table(result: dict) -> str:
    """One row per mode: the validation metrics a choice reads and the choice, the SHOWN test metrics and wall seconds."""
    chosen = chosen_by_group(result["rows"], lambda r: "debtags")
    header = [f"DEXML on Debtags, {result['epochs']} epochs", *(f"val {k[5:]}" for k in CHOSEN_BY), "by val", *(k[5:] for k in SHOWN), "wall s"]
    rows = [[r["description"], *validation_cells(r, chosen), *(f"{r[k]:.2f}" for k in SHOWN), f"{r['wall_seconds']:.0f}"] for r in result["rows"]]
    return markdown_table(header, rows, "l" + "r" * len(CHOSEN_BY) + "l" + "r" * (len(SHOWN) + 1)) + "\n"


def main() -> None:
    ap = bench_parser(__doc__, result_path("dexml_modes.json"), docs_block="dexml-modes", table_only=True)
    ap.add_argument("--epochs", default="2")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = ap.parse_args()
    if args.table_only:
        publish(dexml_modes_table(read_json(args.out)), "dexml-modes", args.update_docs)
        return
    from hf_xmc.data import DEBTAGS_DIR

    rows = []
    with tempfile.TemporaryDirectory() as work:
        for mode in args.modes:
            desc, extra = MODES[mode]
            common = ["--num_train_epochs", args.epochs, "--per_device_train_batch_size", "64", "--max_seq_length", "32", "--seed", "42",
                      *validation_flags(str(DEBTAGS_DIR))]
            results, seconds = run_training_script("dexml", str(DEBTAGS_DIR), minilm(), os.path.join(work, mode), common + extra)
            rows.append({"mode": mode, "description": desc, "args": extra, "wall_seconds": seconds, **results})
            print(f"{mode}: " + " ".join(f"{k[5:]}={results[k]:.2f}" for k in SHOWN), flush=True)
    result = {"epochs": args.epochs, "rows": rows}
    write_json(args.out, result)
    publish(dexml_modes_table(result), "dexml-modes", args.update_docs)


if __name__ == "__main__":
    main()
