#!/usr/bin/env python
"""The one-vs-all classifier stage against the model it starts from, through the training scripts (the training
script contract): SiameseXML (MiniLM and the paper's bag-of-embeddings encoder) against its Module-I siamese model, and
PRIME (W) against PRIME.

    python benchmarks/bench_classifier_stage.py [--datasets debtags reuters] [--runs siamesexml_minilm siamesexml_boe prime_w] [--update_docs]

Each (dataset, run) is one training run; the saved model is then evaluated on the test set with each of its rankings
(``model.set_search_mode``). SiameseXML: ``label_text`` = ``cos(f(x), z~_l)``, the Module-I siamese model alone;
``shortlist`` = ``cos(f(x), z~_l) + cos(f(x), v_l)`` (label texts and centroids, Module II); ``classifier`` =
``cos(w_l, E(x))`` (Module IV); ``fusion`` = what ``predict`` returns. PRIME (W) (``train_prime.py
--classifier_stage``): ``prototype`` = PRIME (the encoder and prototype network are frozen during the classifier
stage, so this is the PRIME model itself), ``classifier`` = PRIME (W). Debtags is the bundled dataset (defaults chosen
on it), Reuters-21578 (``benchmarks/make_reuters.py``) the check on data they were not tuned on. ``minilm`` =
all-MiniLM-L6-v2 fine-tuned; ``boe`` = the TF-IDF bag of MiniLM's token embeddings (``--encoder_type boe``, the table
starting from MiniLM's input embeddings as the paper's starts from FastText). Writes
benchmarks/results/classifier_stage.json (``--out``) and, with --update_docs, the table between the
``<!-- bench:classifier-stage -->`` lines of docs/benchmarks.md; ``--table_only`` re-renders the table of ``--out``.
"""

import argparse
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import bench_parser, markdown_table, publish, read_json, result_path, write_json  # noqa: E402
from benchmarks.sweep_defaults import BENCH_SHOWN, prepare, run_training_script  # noqa: E402

RANKING_NAMES = {
    "label_text": "Module I alone: cos(f(x), z~_l)",
    "shortlist": "shortlist: label text + centroid",
    "classifier": "classifier",
    "fusion": "fused (what predict returns)",
    "prototype": "PRIME (prototypes)",
}
# run -> (method, encoder, script arguments, rankings evaluated, Module I / PRIME epochs per dataset)
RUNS = {
    "siamesexml_minilm": ("siamesexml", "MiniLM-L6", [], ("label_text", "shortlist", "classifier", "fusion"), {"debtags": "0.25", "reuters": "0.5"}),
    "siamesexml_boe": ("siamesexml", "bag of embeddings", ["--encoder_type", "boe"], ("label_text", "shortlist", "classifier", "fusion"), {"debtags": "5", "reuters": "10"}),
    "prime_w": ("prime", "MiniLM-L6", ["--classifier_stage", "true"], ("prototype", "classifier"), {"debtags": "1", "reuters": "1"}),
}


def evaluate_rankings(model_dir: str, data_dir: str, propensity: tuple[float, float], rankings: tuple[str, ...]) -> dict[str, dict]:
    """Test metrics of the saved model under every ranking of its shortlist."""
    from transformers import AutoModel

    from hf_xmc.data import load_xc_dataset
    from hf_xmc.training import XMCEvaluator

    data = load_xc_dataset(f"{data_dir}/trn.json.gz", f"{data_dir}/tst.json.gz", f"{data_dir}/lbl.json.gz")
    model = AutoModel.from_pretrained(model_dir)
    evaluator = XMCEvaluator(data.test, data.label_texts, data.label_uids, train_targets=data.train.targets, propensity_a=propensity[0], propensity_b=propensity[1], name="test")
    out = {}
    for ranking in rankings:
        model.set_search_mode(ranking)
        out[ranking] = evaluator(model, show_progress_bar=False)
    return out


def run_rows(args) -> list[dict]:
    """One training run per (dataset, run) of ``args``, its saved model scored under each of its rankings; ``args.out``
    is rewritten after every run."""
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for dataset in args.datasets:
            data_dir, encoder, extra_data = prepare(dataset, work)
            batch = extra_data[extra_data.index("--per_device_train_batch_size") + 1]
            for run in args.runs:
                method, encoder_name, run_args, rankings, epochs = RUNS[run]
                script_args = ["--num_train_epochs", epochs[dataset], "--per_device_train_batch_size", batch, "--max_seq_length", "32", "--seed", "42"] + run_args
                out = os.path.join(work, f"{dataset}-{run}")
                results, seconds = run_training_script(method, data_dir, encoder, out, script_args + args.extra)
                metrics_by_ranking = evaluate_rankings(out, data_dir, (0.55, 1.5), rankings)
                final = metrics_by_ranking[rankings[-1]]
                assert abs(final["test_P@1"] - results["test_P@1"]) < 1e-6, "the script's evaluation is the saved model's ranking"
                for ranking, metrics in metrics_by_ranking.items():
                    rows.append({"dataset": dataset, "run": run, "method": method, "encoder": encoder_name, "epochs": epochs[dataset], "batch_size": batch,
                                 "ranking": ranking, "wall_seconds": seconds, "args": script_args + args.extra, **metrics})
                    print(f"{dataset} {run} {ranking}: " + " ".join(f"{k[5:]}={metrics[k]:.2f}" for k in BENCH_SHOWN), flush=True)
                write_json(args.out, {"rows": rows})  # after every run: a long benchmark cut short keeps what it measured
    return rows


def classifier_stage_table(rows: list[dict]) -> str:
    """One row per (dataset, run, ranking): the BENCH_SHOWN metrics and the training's wall seconds."""
    header = ["dataset", "method, encoder (epochs)", "ranking", *(k[5:] for k in BENCH_SHOWN), "train wall s"]
    cells = []
    for r in rows:
        method = {"siamesexml": "SiameseXML", "prime": "PRIME (W)"}[r["method"]]
        cells.append([r["dataset"], f"{method}, {r['encoder']} ({r['epochs']})", RANKING_NAMES[r["ranking"]],
                      *(f"{r[k]:.2f}" for k in BENCH_SHOWN), f"{r['wall_seconds']:.0f}"])
    return markdown_table(header, cells, "lll" + "r" * (len(BENCH_SHOWN) + 1)) + "\n"


def main() -> None:
    ap = bench_parser(__doc__, result_path("classifier_stage.json"), docs_block="classifier-stage", table_only=True)
    ap.add_argument("--datasets", nargs="+", default=["debtags", "reuters"], choices=["debtags", "reuters"])
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--from_results", nargs="+", help="results files of earlier runs (e.g. made side by side): merge their rows, run nothing")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more script arguments for every run")
    args = ap.parse_args()
    if args.table_only:
        rows = read_json(args.out)["rows"]
    else:
        rows = [row for path in args.from_results or () for row in read_json(path)["rows"]]
        rows = rows or run_rows(args)
        write_json(args.out, {"rows": rows})
    publish(classifier_stage_table(rows), "classifier-stage", args.update_docs)


if __name__ == "__main__":
    main()
