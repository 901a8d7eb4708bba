#!/usr/bin/env python
"""What SiameseXML's Module I objective is worth: the encoder it trains, ranked by Module II's shortlist alone.

    python benchmarks/bench_siamesexml_module1.py --dataset debtags --epochs 0.5 --update_docs
    python benchmarks/bench_siamesexml_module1.py --table_only --update_docs      # the table of --out, nothing run

Each variant trains Module I of ``train_siamesexml.py`` (its own functions, the script's defaults plus the variant's
flags, which name every setting they compare so that a later change of default does not change the row), then runs
Module II with the encoder frozen (label-text vectors smoothed by the label random walk, centroids) and scores the
test set by the shortlist's similarity ``cos(f(x), z~_l) + cos(f(x), v_l)`` (``search_mode="shortlist"``) and by the
label texts alone (``"label_text"``), and the same on the default validation split held out of Module I's training
points (``--validation_size``): the variant a decision takes is the best by validation P@1 + PSP@5 of the shortlist
ranking (``by val``), the test columns are reported and never read to choose. Module IV is not run: the classifiers start from these vectors and, with the
encoder frozen, what they add is bounded by it (docs/models.md). Data as ``sweep_defaults.py`` prepares it (Debtags
bundled; Reuters from ``benchmarks/make_reuters.py``), all-MiniLM-L6-v2, seed 42, bf16.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import (  # noqa: E402
    SELECTION_KEYS,
    bench_parser,
    chosen_by_group,
    git_commit,
    markdown_table,
    publish,
    read_json,
    result_path,
    write_json,
)

#: the paper's objective as the script ran it before 2026-11-29: point likelihood (c 0.9, d 1.5) with one hard
#: in-batch negative per row, 1e-4, labels drawn with probability freq^0.45
PAPER = ["--siamese_loss", "likelihood", "--learning_rate", "1e-4", "--label_sampling_power", "0.45"]
VARIANTS: dict[str, list[str]] = {
    "likelihood (before)": PAPER,
    "likelihood, 5 hard negatives": [*PAPER, "--siamese_hard_negatives", "5"],
    "softmax": [*PAPER, "--siamese_loss", "softmax"],
    "softmax, 3e-4": [*PAPER, "--siamese_loss", "softmax", "--learning_rate", "3e-4"],
    "softmax, 3e-4, power 1 (default)": [*PAPER, "--siamese_loss", "softmax", "--learning_rate", "3e-4", "--label_sampling_power", "1.0"],
}
SHOWN = ["test_P@1", "test_P@5", "test_PSP@1", "test_PSP@5", "test_R@100"]


def run_variant(dataset: str, epochs: str, flags: list[str], work: str) -> dict:
    """Module I with ``flags``, Module II, then the test metrics of the shortlist and of the label texts."""
    from benchmarks.sweep_defaults import prepare, validation_flags
    from hf_xmc.models import SiameseXMLModel
    from hf_xmc.training.recipes.siamesexml import (
        SiameseXMLModelArguments,
        SiameseXMLTrainingArguments,
        mine,
        train_siamese,
    )
    from hf_xmc.training.script_utils import (
        build_evaluator,
        load_data,
        model_config_kwargs,
        parse_script_args,
        validation_evaluator,
    )

    data_dir, encoder, data_flags = prepare(dataset, work)
    argv = ["--train_file", f"{data_dir}/trn.json.gz", "--test_file", f"{data_dir}/tst.json.gz", "--label_file", f"{data_dir}/lbl.json.gz",
            "--model_name_or_path", encoder, "--output_dir", os.path.join(work, "out"), "--save_strategy", "no", "--disable_tqdm", "true",
            *data_flags, *validation_flags(data_dir), "--seed", "42", "--bf16", "true", "--num_train_epochs", epochs, *flags]
    model_args, data_args, training_args = parse_script_args(SiameseXMLModelArguments, SiameseXMLTrainingArguments, argv, method="siamesexml")
    model_args.fusion_weight = 0.5  # no Module IV here: nothing is fused
    data = load_data(data_args, training_args, tuned_by_recipe=["--fusion_weight"])
    model = SiameseXMLModel.from_encoder_pretrained(model_args.model_name_or_path, label_space_size=len(data.label_texts), **model_config_kwargs(model_args, data_args))
    model.set_labels(data.label_texts, data.label_uids)
    start = time.perf_counter()
    train_siamese(model, data, training_args)
    module1_seconds = time.perf_counter() - start
    mine(model, data, training_args)
    evaluator = build_evaluator(data, data_args)
    validation = validation_evaluator(data, evaluator)
    row = {"module1_seconds": round(module1_seconds, 1), "load_1min": round(os.getloadavg()[0], 2), "commit": git_commit()}
    for mode in ("shortlist", "label_text"):
        model.config.search_mode = mode
        row[f"{mode}_validation"] = {k: round(v, 2) for k, v in validation(model).items() if k in SELECTION_KEYS}
        row[mode] = {k: round(v, 2) for k, v in evaluator(model).items() if k in SHOWN}
    return row


def table(rows: list[dict]) -> str:
    """One line per (variant, ranking): the validation metrics a choice reads ("-" for rows run before they were
    measured), ``chosen`` on the shortlist line of the best variant per (dataset, epochs), then the test metrics."""
    chosen = chosen_by_group(rows, lambda r: (r["dataset"], r["epochs"]), metrics=lambda r: r.get("shortlist_validation", {}))
    header = ["dataset", "Module I", "epochs", "ranking", *(f"val {k[5:]}" for k in SELECTION_KEYS), "by val", "P@1", "P@5", "PSP@1", "PSP@5", "R@100"]
    cells = []
    for r in rows:
        for mode in ("shortlist", "label_text"):
            val = r.get(f"{mode}_validation", {})
            cells.append([r["dataset"], r["variant"], r["epochs"], {"shortlist": "shortlist (z~ + v)", "label_text": "label text"}[mode],
                          *(f"{val[k]:.2f}" if k in val else "-" for k in SELECTION_KEYS), "chosen" if mode == "shortlist" and id(r) in chosen else "",
                          *(f"{r[mode][k]:.2f}" for k in SHOWN)])
    return markdown_table(header, cells)


def main(argv=None) -> list[dict]:
    ap = bench_parser(__doc__, result_path("siamesexml_module1.json"), docs_block="siamesexml_module1", table_only=True)
    ap.add_argument("--dataset", default="debtags", choices=["debtags", "reuters"])
    ap.add_argument("--epochs", default="0.5", help="Module I epochs of every variant")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args(argv)
    rows = read_json(args.out) if os.path.exists(args.out) else []
    if not args.table_only:
        for name in args.variants:
            with tempfile.TemporaryDirectory(prefix="siamese_m1_") as work:
                row = {"dataset": args.dataset, "variant": name, "epochs": args.epochs, "flags": VARIANTS[name], **run_variant(args.dataset, args.epochs, VARIANTS[name], work)}
            rows = [r for r in rows if (r["dataset"], r["variant"], r["epochs"]) != (args.dataset, name, args.epochs)] + [row]
            write_json(args.out, rows, sort_keys=False)
            print(json.dumps(row), flush=True)
    publish(table(rows), "siamesexml_module1", args.update_docs)
    return rows


if __name__ == "__main__":
    main()
