#!/usr/bin/env python
"""The lexical channel's weights tuned on the validation split with and without the training filter file, on one
saved model, and the test ranking each choice gives (WordNet-XMC).

    python benchmarks/bench_train_filter.py --model zeroshot                     # the untrained all-MiniLM-L6-v2
    python benchmarks/bench_train_filter.py --model OUT --name siamesexml      # a model saved by a training script

For each arm the data is read as a training script reads it (``--seed 42``: the same validation split of 2,000
training queries), the channel is fitted on the training split and its weights tuned on the validation split
(``fit_lexical_channel``; the ranker is not trained again on the validation queries), then the model with that
channel is evaluated on the test split with its filter file. The two arms differ only in
``--train_filter_file none`` against WordNet's ``filter_labels_train.txt``. Omikuji is not bit-reproducible, so each
arm trains its own ranker (differences under ~0.4 are noise). Results are added to ``--out`` under ``--name``; the
table of docs/validation.md is rendered from them (``--table_only``).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import bench_parser, markdown_table, publish, read_json, result_path, write_json  # noqa: E402

WORDNET = os.path.join(REPO, "outputs", "wordnet-xmc")
ARMS = (("no_filter", "its own-synset pairs scored (before)"), ("filter", "training filter applied (now)"))
SHOWN = ("P@1", "P@5", "PSP@5")


def run_arm(model_dir: str, use_filter: bool) -> dict:
    from transformers import AutoModel

    import hf_xmc  # noqa: F401  (registers the model classes)
    from benchmarks.sweep_defaults import minilm
    from hf_xmc.models import DEXMLModel
    from hf_xmc.training import XMCTrainingArguments
    from hf_xmc.training.lexical import fit_lexical_channel
    from hf_xmc.training.script_utils import XMCDataArguments, build_evaluator, load_data

    data_args = XMCDataArguments(train_file=f"{WORDNET}/trn.json.gz", test_file=f"{WORDNET}/tst.json.gz", label_file=f"{WORDNET}/lbl.json.gz",
                                 test_filter_file=f"{WORDNET}/filter_labels_test.txt", max_seq_length=32,
                                 train_filter_file=f"{WORDNET}/filter_labels_train.txt" if use_filter else "none")
    with tempfile.TemporaryDirectory() as tmp:
        training_args = XMCTrainingArguments(output_dir=tmp, lexical_channel="omikuji", seed=42, disable_tqdm=True)
    data = load_data(data_args, training_args)
    if model_dir == "zeroshot":
        model = DEXMLModel.from_encoder_pretrained(minilm(), max_seq_length=32).eval()
        model.set_labels(data.label_texts, data.label_uids)
        model.build_label_index(batch_size=256, show_progress_bar=False)
    else:
        model = AutoModel.from_pretrained(model_dir).eval()
    start = time.perf_counter()
    channel = fit_lexical_channel(model, data.train, validation=data.validation, seed=42, batch_size=256, rebuild_label_index=False)
    metrics = build_evaluator(data, data_args)(model, show_progress_bar=False)
    return {"weights": [channel.settings["ranker_weight"], channel.settings["text_weight"]], "objective": channel.tuning["objective"],
            "validation_dense": channel.tuning["dense"], **{k: round(metrics[k], 2) for k in ("test_P@1", "test_P@5", "test_PSP@5", "test_dense_P@1", "test_dense_PSP@5")},
            "seconds": round(time.perf_counter() - start, 1)}


def table(results: dict) -> str:
    cells = []
    for name, arms in results.items():
        for arm, description in ARMS:
            r = arms[arm]
            cells.append([name, description, "{:g}, {:g}".format(*r["weights"]), *(f"{r['test_' + m]:.2f}" for m in SHOWN)])
    return markdown_table(["WordNet-XMC model", "validation split", "weights (ranker, text)", *(f"test {m}" for m in SHOWN)], cells, "lll" + "r" * len(SHOWN)) + "\n"


def main(argv=None) -> dict:
    ap = bench_parser(__doc__, result_path("train_filter.json"), docs_block="train_filter", table_only=True)
    ap.add_argument("--model", default="zeroshot", help="a saved model directory, or 'zeroshot' (the untrained all-MiniLM-L6-v2)")
    ap.add_argument("--name", default=None, help="the row's name in --out (default: the model's)")
    args = ap.parse_args(argv)
    results = read_json(args.out) if os.path.exists(args.out) else {}
    if not args.table_only:
        name = args.name or ("untrained all-MiniLM-L6-v2" if args.model == "zeroshot" else os.path.basename(os.path.normpath(args.model)))
        results[name] = {arm: run_arm(args.model, arm == "filter") for arm, _ in ARMS}
        write_json(args.out, results, sort_keys=False)
    publish(table(results), "train_filter", args.update_docs)
    return results


if __name__ == "__main__":
    main()
