#!/usr/bin/env python
"""SiameseXML against its own Module-I (siamese embedding only) model, with MiniLM and with the paper's
bag-of-embeddings encoder, through ``training_scripts/train_siamesexml.py`` (the training script contract).

    python benchmarks/bench_siamesexml.py [--datasets debtags reuters] [--encoders minilm boe] [--update_readme]

Each (dataset, encoder) is one training run; the saved model is then evaluated on the test set with each ranking of
its shortlist (``model.set_search_mode``): ``label_text`` = ``cos(f(x), z~_l)``, the Module-I siamese model alone;
``shortlist`` = ``cos(f(x), z~_l) + cos(f(x), v_l)`` (label texts and centroids, Module II); ``classifier`` =
``cos(w_l, E(x))`` (Module IV); ``fusion`` = what ``predict`` returns. Debtags is the bundled dataset (defaults chosen
on it), Reuters-21578 (``benchmarks/make_reuters.py``) the check on data they were not tuned on. Encoders: ``minilm``
= all-MiniLM-L6-v2 fine-tuned (``--encoder_type transformer``), ``boe`` = the TF-IDF bag of MiniLM's token embeddings
(``--encoder_type boe``, the table starting from MiniLM's input embeddings as the paper's starts from FastText).
Writes benchmarks/results/siamesexml.json and, with --update_readme, the table between the README's
``<!-- bench:siamesexml -->`` markers.
"""

import argparse
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.sweep_defaults import BENCH_SHOWN, prepare, run_training_script, update_readme_block  # noqa: E402
from hf_xmc.training.script_utils import write_json_atomic  # noqa: E402

RANKINGS = ("label_text", "shortlist", "classifier", "fusion")
RANKING_NAMES = {
    "label_text": "Module I alone: cos(f(x), z~_l)",
    "shortlist": "shortlist: label text + centroid",
    "classifier": "classifier cos(w_l, E(x))",
    "fusion": "fused (what predict returns)",
}
# per dataset: Module I epochs of each encoder (the bag of embeddings is ~50x cheaper per step)
EPOCHS = {"debtags": {"minilm": "0.5", "boe": "5"}, "reuters": {"minilm": "1", "boe": "10"}}


def evaluate_rankings(model_dir: str, data_dir: str, propensity: tuple[float, float]) -> dict[str, dict]:
    """Test metrics of the saved model under every ranking of its shortlist."""
    from transformers import AutoModel

    from hf_xmc.data import load_xc_dataset
    from hf_xmc.training import XMCEvaluator

    data = load_xc_dataset(f"{data_dir}/trn.json.gz", f"{data_dir}/tst.json.gz", f"{data_dir}/lbl.json.gz")
    model = AutoModel.from_pretrained(model_dir)
    evaluator = XMCEvaluator(data.test, data.label_texts, data.label_uids, train_targets=data.train.targets, propensity_a=propensity[0], propensity_b=propensity[1], name="test")
    out = {}
    for ranking in RANKINGS:
        model.set_search_mode(ranking)
        out[ranking] = evaluator(model, show_progress_bar=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", nargs="+", default=["debtags", "reuters"], choices=["debtags", "reuters"])
    ap.add_argument("--encoders", nargs="+", default=["minilm", "boe"], choices=["minilm", "boe"])
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more script arguments for every run")
    ap.add_argument("--results", default=os.path.join(REPO, "benchmarks", "results", "siamesexml.json"))
    ap.add_argument("--update_readme", action="store_true")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for dataset in args.datasets:
            data_dir, encoder, extra_data = prepare(dataset, work)
            batch = extra_data[extra_data.index("--per_device_train_batch_size") + 1]
            for name in args.encoders:
                epochs = EPOCHS[dataset][name]
                script_args = ["--num_train_epochs", epochs, "--per_device_train_batch_size", batch, "--max_seq_length", "32", "--seed", "42"]
                if name == "boe":
                    script_args += ["--encoder_type", "boe"]
                out = os.path.join(work, f"{dataset}-{name}")
                results, seconds = run_training_script("siamesexml", data_dir, encoder, out, script_args + args.extra)
                rankings = evaluate_rankings(out, data_dir, (0.55, 1.5))
                assert abs(rankings["fusion"]["test_P@1"] - results["test_P@1"]) < 1e-6, "the script's evaluation is the fused ranking"
                for ranking, metrics in rankings.items():
                    rows.append({"dataset": dataset, "encoder": name, "module1_epochs": epochs, "batch_size": batch, "ranking": ranking, "wall_seconds": seconds, "args": script_args + args.extra, **metrics})
                    print(f"{dataset} {name} {ranking}: " + " ".join(f"{k[5:]}={metrics[k]:.2f}" for k in BENCH_SHOWN), flush=True)
    table = "| dataset | encoder (Module I epochs) | ranking | " + " | ".join(k[5:] for k in BENCH_SHOWN) + " | train wall s |\n"
    table += "|---|---|---|" + "---:|" * (len(BENCH_SHOWN) + 1) + "\n"
    for r in rows:
        encoder = {"minilm": "MiniLM-L6", "boe": "bag of embeddings"}[r["encoder"]]
        table += f"| {r['dataset']} | {encoder} ({r['module1_epochs']}) | {RANKING_NAMES[r['ranking']]} | " + " | ".join(f"{r[k]:.2f}" for k in BENCH_SHOWN) + f" | {r['wall_seconds']:.0f} |\n"
    print("\n" + table)
    write_json_atomic(args.results, {"rows": rows})
    if args.update_readme:
        update_readme_block("<!-- bench:siamesexml -->", table)


if __name__ == "__main__":
    main()
