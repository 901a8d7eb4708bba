#!/usr/bin/env python
"""The README's headline: a headline model's dense and fused P@1 / P@5 / PSP@5 over several seeds (mean +- sample
standard deviation), its train and predict time and its whole budget, beside the tree peers run on the same data.

    python benchmarks/bench_headline.py --datasets debtags --methods dexml --seeds 42 43 44 --update_docs
    python benchmarks/bench_headline.py --table_only --update_docs      # the table of --out, nothing run

A row is ``training_scripts/train_<method>.py`` through the training-script contract with the budget of
:data:`HEADLINES` and ``--lexical_channel omikuji`` (its weights tuned on the default validation split), once per
seed: *dense* is the trained model alone (``test_dense_*``), *fused* what the script saves and serves (``test_*``).
Nothing is chosen here: every number is a test figure of a fixed recipe, reported once. The peers (Omikuji with
Parabel's and Bonsai's settings, napkinXC's PLT, all on TF-IDF of the same training queries) run on the same data with
the same seeds (``peers.run_peers``), and the propensity constants of the dataset's name. Train minutes: the whole
script (training, validation tuning, channel fit, test evaluation, save) for hf_xmc; fit with featurisation for the
peers. Predict ms: per test query, batched, end to end from the text (tokenisation, encoding, index search, the
channel; TF-IDF for the peers). Each row records its commit and the 1-minute load when it ended: the 2-core machine
is shared, and the times are what it did then.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import (  # noqa: E402
    bench_parser,
    git_commit,
    markdown_table,
    publish,
    read_json,
    result_path,
    training_record,
    tuned_settings,
    write_json,
)
from benchmarks.sweep_defaults import prepare, run_training_script  # noqa: E402

SHOWN = ("P@1", "P@5", "PSP@5")
#: per (dataset, method): the flags of the headline run (after the dataset's own) and how the table names its budget
HEADLINES: dict[tuple[str, str], dict] = {
    # the quickstart's run (python -m hf_xmc.quickstart: one epoch at batch 64, lr 3e-4, length 32) with the channel
    ("debtags", "dexml"): {"flags": ["--num_train_epochs", "1"], "budget": "1 epoch at batch 64 (the quickstart's), + channel"},
    ("reuters", "dexml"): {"flags": ["--num_train_epochs", "3"], "budget": "3 epochs at batch 32 (the script's), + channel"},
    # the other methods' figures in the README's method table, at the budgets it names (one seed each until run here)
    ("debtags", "prime"): {"flags": ["--num_train_epochs", "1", "--classifier_stage", "true"],
                           "budget": "1 epoch at batch 64 + 10 classifier epochs (PRIME (W)), + channel"},
    ("debtags", "unidec"): {"flags": ["--num_train_epochs", "1"], "budget": "1 epoch at batch 64, + channel"},
    ("debtags", "siamesexml"): {"flags": ["--num_train_epochs", "2"], "budget": "Module I 2 epochs + Module IV 10 (the script's), + channel"},
}
PEERS = ("omikuji", "omikuji_bonsai", "napkinxc")


def run_model(dataset: str, method: str, seed: int, work: str) -> dict:
    """One seed of a headline model through its training script."""
    data_dir, encoder, data_flags = prepare(dataset, work)
    spec = HEADLINES[(dataset, method)]
    out = os.path.join(work, f"{dataset}-{method}-{seed}")
    results, wall = run_training_script(method, data_dir, encoder, out, [*data_flags, "--seed", str(seed), "--lexical_channel", "omikuji", *spec["flags"]])
    return {"dataset": dataset, "model": method, "seed": seed, "budget": spec["budget"], "flags": spec["flags"], "commit": git_commit(),
            "load_1min": round(os.getloadavg()[0], 2), "train_minutes": round(wall / 60, 2),
            "predict_ms": round(1000.0 / results["test_samples_per_second"], 3),
            "dense": {m: results[f"test_dense_{m}"] for m in SHOWN}, "fused": {m: results[f"test_{m}"] for m in SHOWN},
            "weights": [results.get("lexical_ranker_weight"), results.get("lexical_text_weight")],
            "weights_on_edge": [results.get("lexical_ranker_weight_on_edge"), results.get("lexical_text_weight_on_edge")],  # at their grid's cap
            "validation_fused": {m: results[f"eval_{m}"] for m in SHOWN if f"eval_{m}" in results},
            # the model's own ranking settings tuned on the validation split (SiameseXML's classifier share, ...)
            "tuned": tuned_settings(results),
            "train": training_record(results)}


def run_peer_rows(dataset: str, seed: int, work: str) -> list[dict]:
    """The peers on ``dataset`` with ``seed`` (the propensity constants of its name)."""
    from benchmarks.peers import run_peers
    from hf_xmc.data import read_xc_raw
    from hf_xmc.data.xc_raw import XCData, read_xc_labels
    from hf_xmc.metrics import propensity_constants

    data_dir, _, _ = prepare(dataset, work)
    uids, texts = read_xc_labels(os.path.join(data_dir, "lbl.json.gz"))[:2]
    data = XCData(train=read_xc_raw(os.path.join(data_dir, "trn.json.gz"), num_labels=len(uids)),
                  test=read_xc_raw(os.path.join(data_dir, "tst.json.gz"), num_labels=len(uids), skip_unlabeled=False),
                  label_texts=texts, label_uids=uids)
    a, b = propensity_constants(dataset)
    rows = []
    for peer in run_peers(data, seed=seed, only=list(PEERS), propensity_a=a, propensity_b=b):
        rows.append({"dataset": dataset, "model": peer["method"], "seed": seed, "budget": "library defaults", "commit": git_commit(),
                     "load_1min": round(os.getloadavg()[0], 2), "train_minutes": round(peer["train_seconds"] / 60, 2),
                     "predict_ms": round(1000.0 / peer["predict_queries_per_second"], 3), "peer": {m: peer["metrics"][m] for m in SHOWN}})
    return rows


def spread(values: list[float]) -> str:
    """``mean +- sample std`` of ``values`` (the mean alone for one value)."""
    mean = statistics.fmean(values)
    return f"{mean:.2f} ± {statistics.stdev(values):.2f}" if len(values) > 1 else f"{mean:.2f}"


def table(rows: list[dict]) -> str:
    """Per dataset: each hf_xmc model's dense and fused rankings, then the peers, over the seeds each has run."""
    header = ["dataset", "model", "ranking", "seeds", *SHOWN, "train min", "training in", "predict ms / query", "budget"]
    cells = []
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        here = [r for r in rows if r["dataset"] == dataset]
        models = list(dict.fromkeys(r["model"] for r in here if "peer" not in r)) + list(dict.fromkeys(r["model"] for r in here if "peer" in r))
        for model in models:
            runs = [r for r in here if r["model"] == model]
            seeds = ", ".join(str(r["seed"]) for r in runs)
            for ranking in (("peer",) if "peer" in runs[0] else ("dense", "fused")):
                cells.append([dataset, model, "" if ranking == "peer" else ranking, seeds, *(spread([r[ranking][m] for r in runs]) for m in SHOWN),
                              spread([r["train_minutes"] for r in runs]), precision(runs), spread([r["predict_ms"] for r in runs]), runs[0]["budget"]])
    return markdown_table(header, cells, "llll" + "r" * (len(SHOWN) + 1) + "lrl") + "\n"


def precision(runs: list[dict]) -> str:
    """What the runs' training steps ran in (``--bf16 auto`` resolves per CPU: train minutes compare only within one);
    empty for the peers, ``not recorded`` for rows from before the field."""
    if "peer" in runs[0]:
        return ""
    seen = {r.get("train", {}).get("train_bf16") for r in runs}
    return " / ".join(sorted({"bf16" if v == 1 else "float32" if v == 0 else "not recorded" for v in seen}))


def main(argv=None) -> list[dict]:
    ap = bench_parser(__doc__, result_path("headline.json"), docs_block="headline", table_only=True)
    ap.add_argument("--datasets", nargs="+", default=["debtags"], choices=sorted({d for d, _ in HEADLINES}))
    ap.add_argument("--methods", nargs="+", default=["dexml"], choices=sorted({m for _, m in HEADLINES}))
    ap.add_argument("--seeds", nargs="+", type=int, default=[42, 43, 44])
    ap.add_argument("--no_peers", action="store_true", help="run the hf_xmc rows only")
    ap.add_argument("--rerun", action="store_true", help="run (dataset, model, seed) rows already in --out again")
    args = ap.parse_args(argv)
    rows = read_json(args.out) if os.path.exists(args.out) else []
    if not args.table_only:
        for dataset in args.datasets:
            for seed in args.seeds:
                with tempfile.TemporaryDirectory(prefix="headline_") as work:
                    todo = [m for m in args.methods if (dataset, m) in HEADLINES]
                    for method in todo:
                        if args.rerun or not any((r["dataset"], r["model"], r["seed"]) == (dataset, method, seed) for r in rows):
                            row = run_model(dataset, method, seed, work)
                            rows = [r for r in rows if (r["dataset"], r["model"], r["seed"]) != (dataset, method, seed)] + [row]
                            write_json(args.out, rows, sort_keys=False)  # each row as it ends: a cut run keeps the finished ones
                    if not args.no_peers:
                        peer_rows = run_peer_rows(dataset, seed, work)
                        done = {(r["dataset"], r["model"], r["seed"]) for r in peer_rows}
                        rows = [r for r in rows if (r["dataset"], r["model"], r["seed"]) not in done] + peer_rows
                        write_json(args.out, rows, sort_keys=False)
    publish(table(rows), "headline", args.update_docs)
    return rows


if __name__ == "__main__":
    main()
