#!/usr/bin/env python
"""The score calibration fitted on the top 20 labels of each validation query (before issue 64) against fitted as deep
as ``predict(threshold=)`` reads (the top 100, now): its reliability on the test split at ranks 1-20, 21-100 and 1-100.

    python benchmarks/bench_calibration_depth.py --update_docs

The ranking is Debtags' zero-shot model with the lexical channel, as ``--max_steps 0 --lexical_channel omikuji`` builds
it: the untrained MiniLM (DEXML) fused with an Omikuji ranker and the label-text scores, the fusion weights tuned on a
validation split of 1,500 training queries (seed 1), the calibration fitted on the same split (isotonic, the scripts'
default), and measured on the test split. A map fitted on the top 20 clamps every score below its lowest breakpoint to
its lowest block: ranks 21-100 all get that block's probability. ECE (percent) is pair-weighted over 10 equal-width
probability bins; ``pairs`` counts the ranked (query, label) pairs.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import bench_parser, markdown_table, publish, result_path, write_json  # noqa: E402

SLICES = {"1-20": (0, 20), "21-100": (20, 100), "1-100": (0, 100)}


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def measure(validation_size: int = 1500, seed: int = 1) -> dict:
    import numpy as np

    from benchmarks.sweep_defaults import minilm
    from hf_xmc.data import carve_validation, load_debtags
    from hf_xmc.models import DEXMLModel
    from hf_xmc.training.calibration import calibration_metrics, fit_score_calibration, ranked_pairs
    from hf_xmc.training.evaluation import XMCEvaluator
    from hf_xmc.training.lexical import fit_lexical_channel

    start = time.perf_counter()
    data = carve_validation(load_debtags(), validation_size, seed)
    model = DEXMLModel.from_encoder_pretrained(minilm(), max_seq_length=32)
    model.set_labels(data.label_texts, data.label_uids)
    fit_lexical_channel(model, data.train, validation=data.validation)
    test = XMCEvaluator(data.test, data.label_texts, data.label_uids, train_targets=data.propensity_targets(), name="test")
    validation = test.for_queries(data.validation, "eval")
    fitted = {depth: fit_score_calibration(model, validation, "isotonic", depth=depth) for depth in (20, 100)}
    ids, scores, _ = test.predict(model)
    rows = []
    for depth, calibration in fitted.items():
        row = {"fitted_on_top": depth, "breakpoints": len(calibration.x), "lowest_breakpoint": float(calibration.x.min())}
        for name, (first, last) in SLICES.items():
            metrics = calibration_metrics(model, ids, scores, data.test.targets, depth=last, calibration=calibration, first=first)
            pairs_scores, relevant = ranked_pairs(ids, scores, data.test.targets, last, first)
            row[f"ECE@{name}"] = round(metrics["ECE"], 3)
            row[f"pairs@{name}"] = int(len(pairs_scores))
            row[f"relevant@{name}"] = round(100.0 * float(np.mean(relevant)), 3)
            row[f"mean_probability@{name}"] = round(100.0 * float(np.mean(calibration(pairs_scores))), 3)
            row[f"below_range@{name}"] = round(100.0 * float(np.mean(pairs_scores < calibration.x.min())), 3)
            if name == "21-100":
                row["reliability@21-100"] = metrics["reliability"]
        rows.append(row)
    return {"rows": rows, "dataset": "debtags", "validation_queries": len(data.validation), "test_queries": len(data.test),
            "channel": dict(model.lexical_channel.settings), "cpu": cpu_name(), "wall_seconds": round(time.perf_counter() - start, 1)}


def table(result: dict) -> str:
    header = ["fitted on", "ECE 1-20", "ECE 21-100", "ECE 1-100", "mean p / relevant, 21-100", "pairs under its range, 21-100", "breakpoints"]
    body = [[f"top {r['fitted_on_top']}", f"{r['ECE@1-20']:.2f}", f"{r['ECE@21-100']:.2f}", f"{r['ECE@1-100']:.2f}",
             f"{r['mean_probability@21-100']:.2f}% / {r['relevant@21-100']:.2f}%", f"{r['below_range@21-100']:.1f}%", r["breakpoints"]]
            for r in result["rows"]]
    note = (f"\nDebtags, untrained MiniLM + lexical channel, isotonic fitted on {result['validation_queries']:,} validation queries, "
            f"measured on {result['test_queries']:,} test queries ({result['cpu']}, {result['wall_seconds'] / 60:.1f} min).\n")
    return markdown_table(header, body, "lrrrrrr") + note


def main() -> None:
    parser = bench_parser(__doc__, result_path("calibration_depth.json"), docs_block="calibration_depth", table_only=True)
    args = parser.parse_args()
    if args.table_only:
        from benchmarks.harness import read_json

        result = read_json(args.out)
    else:
        result = measure()
        write_json(args.out, result)
    publish(table(result), "calibration_depth", args.update_docs)


if __name__ == "__main__":
    main()
