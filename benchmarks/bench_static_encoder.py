#!/usr/bin/env python
"""The static query encoder against the trained tower it is fitted to: quality (dense and fused P@1 / PSP@5 / R@100
on the test split), the fit's wall time, and one-query-at-a-time latency, per dataset and text method.

    python benchmarks/bench_static_encoder.py --datasets debtags reuters --methods dexml --update_docs
    python benchmarks/bench_static_encoder.py --table_only --update_docs      # the table of --out, nothing run
    python benchmarks/make_wordnet.py && python benchmarks/bench_static_encoder.py --datasets wordnet --methods dexml

A row is ``training_scripts/train_<method>.py`` through the training-script contract with the budget of
``bench_headline.HEADLINES`` (the method's headline recipe; else ``bench_validation.BUDGETS``: WordNet-XMC's
40-CPU-minute budgets, its test filter applied; the scripts' defaults otherwise), ``--lexical_channel omikuji``
and ``--static_query_encoder`` (fitted on the training queries after training; its own fusion weights and calibration
tuned on the default validation split): the *tower* rows are ``test_dense_*`` / ``test_*``, the *static (fitted)*
rows ``test_static_dense_*`` / ``test_static_*``. The *static (initialised only)* row is the same table before the fit
(each vocabulary token through the tower, Model2Vec's start: ``fit_static_query_encoder(epochs=0)`` on the saved
model), dense only: its fusion would need weights of its own. Nothing is chosen on test. Latency: the saved model
loaded again, ``--latency_queries`` test queries ranked one at a time (``predict(texts[i:i+1])``, tokenisation, encoding,
index search and the channel), p50 / p99 in ms, per query encoder, in the same process one after the other (a ratio
measured in one run; the 2-core machine is shared, and each row records its 1-minute load and CPU).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import (  # noqa: E402
    bench_parser,
    cpu_name,
    data_version,
    markdown_table,
    publish,
    read_json,
    result_path,
    row_dataset_cell,
    training_record,
    tuned_settings,
    write_json,
)
from benchmarks.sweep_defaults import minilm, run_training_script, validation_flags  # noqa: E402

SHOWN = ("P@1", "PSP@5", "R@100")
METHODS = ("dexml", "prime", "unidec", "siamesexml")


def latencies(model, texts: list[str], query_encoder: str) -> dict:
    """p50 / p99 ms of ``predict`` on one query at a time with ``query_encoder`` (after 5 warm-up queries)."""
    times = []
    for i, text in enumerate([*texts[:5], *texts]):
        start = time.perf_counter()
        model.predict([text], k=5, query_encoder=query_encoder)
        if i >= 5:
            times.append((time.perf_counter() - start) * 1000)
    return {"p50_ms": round(float(np.percentile(times, 50)), 3), "p99_ms": round(float(np.percentile(times, 99)), 3)}


def initialised_only(model, train, test, data_flags: list[str]) -> dict:
    """Dense test metrics of the static encoder at its start (no fit step), on the saved model (its own encoder kept);
    ``train`` / ``test``: the dataset's read splits (``XMCDataset``, every test row kept); the test split's filter of
    ``data_flags`` (WordNet-XMC's) applied as the scripts apply it."""
    from benchmarks.bench_validation import split_filter
    from hf_xmc.data import filter_predictions
    from hf_xmc.metrics import inverse_propensity, xmc_metrics
    from hf_xmc.models.static_encoder import fit_static_encoder

    filt, extra = split_filter(data_flags, test, len(model.label_texts))
    saved = (model.static_query_encoder, model.static_query_encoder_meta)
    encoder, _ = fit_static_encoder(model, train.texts[:64], epochs=0, show_progress_bar=False)  # the start only
    try:
        model.attach_static_query_encoder(encoder, {"fit": {"epochs": 0}})
        scores, ids = model.search(model.static_query_vectors(list(test.texts)), 100 + extra)
    finally:
        model._set_static(*saved)
    if filt is not None:
        ids, scores = filter_predictions(ids, scores, filt, 100)
    ids = ids[:, :100]
    inv = inverse_propensity(train.targets, model.config.propensity_a, model.config.propensity_b)
    m = xmc_metrics(ids, test.targets, inv, ks=(1, 5), recall_ks=(100,))
    return {k: round(m[k], 2) for k in SHOWN}


def run_row(dataset: str, method: str, latency_queries: int, work: str) -> dict:
    from benchmarks.bench_headline import HEADLINES
    from benchmarks.bench_validation import BUDGETS, data_setup

    data_dir, data_flags = data_setup(dataset, work)  # WordNet-XMC: its test filter and length 32
    encoder = minilm()
    # the method's headline recipe where it has one, else bench_validation's budget (WordNet's 40 CPU minutes)
    flags = HEADLINES.get((dataset, method), {}).get("flags") or BUDGETS.get((dataset, method), [])
    out = os.path.join(work, f"{dataset}-{method}")
    extra = [*data_flags, "--seed", "42", "--lexical_channel", "omikuji", "--static_query_encoder", *validation_flags(data_dir), *flags]
    results, wall = run_training_script(method, data_dir, encoder, out, extra)
    return measured_row(dataset, method, data_dir, data_flags, extra, results, wall, out, latency_queries)


def measured_row(dataset: str, method: str, data_dir: str, data_flags: list[str], extra: list[str], results: dict, wall: float,
                 out: str, latency_queries: int) -> dict:
    """A row of this table from a training script's run with ``--static_query_encoder`` (``extra``: its flags beyond the
    data and the encoder; ``results``: its ``eval_results.json``; ``out``: the saved model), the initialised-only
    ranking and the latencies measured on the saved model here. Shared with ``bench_validation.py
    --static_query_encoder``, whose rows train once for both tables."""
    from transformers import AutoModel

    from hf_xmc.data import read_xc_raw

    model = AutoModel.from_pretrained(out, trust_remote_code=True)
    train = read_xc_raw(os.path.join(data_dir, "trn.json.gz"), num_labels=len(model.label_texts))
    test = read_xc_raw(os.path.join(data_dir, "tst.json.gz"), num_labels=len(model.label_texts), skip_unlabeled=False)
    test_texts = list(test.texts)
    fit = model.static_query_encoder_meta["fit"]

    def pick(prefix: str) -> dict:
        return {k: round(results[f"{prefix}{k}"], 2) for k in SHOWN if f"{prefix}{k}" in results}

    rng = np.random.default_rng(0)
    sample = [test_texts[i] for i in rng.choice(len(test_texts), min(latency_queries, len(test_texts)), replace=False)]
    return {
        "dataset": dataset, "data_version": data_version(dataset, data_dir), "method": method, "flags": extra, "wall_seconds": round(wall, 1),
        "cpu": cpu_name(), "load_1min": round(os.getloadavg()[0], 2),
        "tower": {"dense": pick("test_dense_"), "fused": pick("test_"), "validation_fused": pick("eval_")},
        "static": {"dense": pick("test_static_dense_"), "fused": pick("test_static_"), "validation_fused": pick("eval_static_")},
        "static_init": {"dense": initialised_only(model, train, test, data_flags)},
        "weights": {"tower": [results.get("lexical_ranker_weight"), results.get("lexical_text_weight")],
                    "static": [results.get("static_lexical_ranker_weight"), results.get("static_lexical_text_weight")]},
        "fit": {"seconds": results.get("static_fit_runtime"), "encode_seconds": fit.get("encode_seconds"), "queries": fit.get("queries"),
                "epochs": fit.get("epochs"), "final_loss": fit["epoch_losses"][-1] if fit.get("epoch_losses") else None,
                "encode_precision": fit.get("encode_precision", "float32"), "objective": fit.get("loss", "cosine"),
                **({"objective_choice": fit["objective_choice"]} if fit.get("objective_choice") else {})},
        "tuned": tuned_settings(results),  # SiameseXML's classifier share, ...
        # the static encoder's own values of them, tuned with its ranking (rows measured before: absent)
        "static_tuned": tuned_settings(results, prefix="static_tuned_"),
        # what the training's own passes over the queries cost (does a static tower pay for training too: docs/serving.md)
        "train": training_record(results, extra=("train_runtime",)),
        "latency": {"queries": len(sample), "tower": latencies(model, sample, "transformer"), "static": latencies(model, sample, "static")},
    }


def merge_row(rows: list[dict], row: dict) -> list[dict]:
    """``rows`` with ``row`` in place of the row of its dataset and method (at the end when it is new)."""
    key = (row["dataset"], row["method"])
    if any((r["dataset"], r["method"]) == key for r in rows):
        return [row if (r["dataset"], r["method"]) == key else r for r in rows]
    return [*rows, row]


def precision_name(precision) -> str:
    """The fit's tower pass as the table names it: ``bf16`` or ``float32`` (rows measured before it was recorded)."""
    return "bf16" if precision == "bfloat16" else "float32"


def objective_name(objective, choice=None) -> str:
    """The fit's objective as the table names it: ``cos``, ``cos+rank``, ``cos+lab``, ``cos+rank+lab`` (rows measured
    before it was recorded: cos), with ``, chosen`` when ``--static_query_encoder_objective auto`` picked it on the
    validation split (``choice``: the meta's ``objective_choice``)."""
    name = (objective or "cosine").replace("cosine", "cos").replace("ranking", "rank").replace("labels", "lab")
    return f"{name}, chosen" if choice else name


def static_table(rows: list[dict]) -> str:
    """Per (dataset, method): the tower, the static encoder at its start and fitted; dense and fused test metrics,
    the fit's seconds and the batch-1 p50 / p99."""
    header = ["dataset", "method", "query encoder", *(f"dense {m}" for m in SHOWN), *(f"fused {m}" for m in SHOWN), "fit s",
              "p50 ms", "p99 ms"]
    cells = []
    for r in rows:
        where = row_dataset_cell(r)
        lat = r["latency"]
        cells.append([where, r["method"], "transformer tower (trained)", *(f"{r['tower']['dense'].get(m, '-')}" for m in SHOWN),
                      *(f"{r['tower']['fused'].get(m, '-')}" for m in SHOWN), "", f"{lat['tower']['p50_ms']:.2f}", f"{lat['tower']['p99_ms']:.2f}"])
        cells.append([where, r["method"], "static, initialised only", *(f"{r['static_init']['dense'].get(m, '-')}" for m in SHOWN),
                      *([""] * len(SHOWN)), "", "", ""])
        cells.append([where, r["method"], "static, fitted", *(f"{r['static']['dense'].get(m, '-')}" for m in SHOWN),
                      *(f"{r['static']['fused'].get(m, '-')}" for m in SHOWN), f"{r['fit']['seconds']:.0f} ({precision_name(r['fit'].get('encode_precision'))}, {objective_name(r['fit'].get('objective'), r['fit'].get('objective_choice'))})",
                      f"{lat['static']['p50_ms']:.2f}", f"{lat['static']['p99_ms']:.2f}"])
    table = markdown_table(header, cells, "lll" + "r" * (2 * len(SHOWN) + 3))
    loads: dict[str, list[float]] = {}
    for r in rows:
        loads.setdefault(r["cpu"], []).append(r["load_1min"])
    machines = "; ".join(f"{cpu} (1-minute load {min(v):g}-{max(v):g})" for cpu, v in sorted(loads.items()))
    return table + f"\n\nMeasured on {machines}. Fit s: encoding the training queries with the tower (in the precision named), the start, the fit (objective: cos, the cosine to the tower's vectors; cos+rank, plus the distillation of its ranking; cos+lab, plus the training loss on the training queries' labels; chosen: the better of cos and cos+lab on the validation split, both fits in the seconds).\n"


def main(argv=None) -> list[dict]:
    ap = bench_parser(__doc__, result_path("static_encoder.json"), docs_block="static", table_only=True)
    ap.add_argument("--datasets", nargs="+", default=["debtags", "reuters"], choices=["debtags", "reuters", "wordnet"])
    ap.add_argument("--methods", nargs="+", default=["dexml"], choices=list(METHODS))
    ap.add_argument("--latency_queries", type=int, default=300, help="test queries timed one at a time per query encoder")
    args = ap.parse_args(argv)
    rows = read_json(args.out) if os.path.exists(args.out) else []
    if not args.table_only:
        with tempfile.TemporaryDirectory() as work:
            for dataset in args.datasets:
                for method in args.methods:
                    row = run_row(dataset, method, args.latency_queries, work)
                    rows = merge_row(rows, row)
                    write_json(args.out, rows)
                    print(row, flush=True)
    publish(static_table(rows), "static", args.update_docs)
    return rows


if __name__ == "__main__":
    main()
