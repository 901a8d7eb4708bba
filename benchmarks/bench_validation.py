#!/usr/bin/env python
"""Fusion tuned on a validation split against fusion tuned on training queries, and the score calibration, per text
method and dataset.

    python benchmarks/bench_validation.py --datasets debtags reuters --update_docs
    python benchmarks/make_wordnet.py && python benchmarks/bench_validation.py --datasets wordnet --update_docs
    python benchmarks/bench_validation.py --datasets wordnet --methods prime --rerun --static_query_encoder --update_docs

Each row runs ``training_scripts/train_<method>.py`` through the training-script contract with ``--lexical_channel
omikuji`` and the script's defaults otherwise: a validation split (5% of the training queries, 500-2,000) is held out
before training; the channel's weights and the isotonic score calibration are tuned on it; the script reports the
fused ranking (``test_*``), the dense ranking of the same model (``test_dense_*``) and the calibration's test ECE.
``zeroshot`` is the same script for DEXML with ``--max_steps 0``: the untrained encoder + the channel, the baseline a
trained model must beat. Then, in this process, the saved model is loaded and scored on the test split again for:

* **channel alone**: the candidates (the dense top 100 and the ranker's top 100) ranked by the ranker's score alone
  (the dense order breaks its ties), i.e. the Omikuji peer inside the model;
* **fused before**: the fusion as hf_xmc tuned it before the validation split existed, on this same model: the ranker
  trained on the training queries but 2,000, the weights tuned on those 2,000, which the model trained on
  (``fit_lexical_channel`` without ``validation``);
* **fused, dense normalised** (rows run since it was added): the scale-free alternative the issue asked to try, the
  dense score min-max scaled per query over its top 100 before the same weight grids are tuned on the validation split
  (with a ranker trained on the training split; ``fused_now_same_ranker`` in the JSON is the raw fusion with that same
  ranker, for a like-for-like comparison).

The invariant of the validation-split issue is checked per row: fused now >= max(dense, untrained + channel) - 0.3 on
P@1 and on PSP@5. Wall minutes are the training script's (data, training, channel, calibration, evaluation, save) on
the machine it ran on; each row records the 1-minute load average when it ended. Rows already in ``--out`` are kept
(``--rerun`` runs them again); ``--table_only`` re-renders the tables. ``--static_query_encoder``: the same training
also fits the static query encoder (after the tower's channel and calibration: the tower's figures do not move) and
writes its row of ``bench_static_encoder.py``'s table (``--static_out``), one training for both tables.
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
    data_version,
    dataset_cell,
    markdown_table,
    publish,
    read_json,
    result_path,
    row_dataset_cell,
    tuned_settings,
    write_json,
)
from benchmarks.sweep_defaults import minilm, prepare, run_training_script  # noqa: E402

SHOWN = ("P@1", "P@5", "PSP@1", "PSP@5", "R@100")
METHODS = ("zeroshot", "dexml", "prime", "unidec", "siamesexml")
WORDNET = os.path.join(REPO, "outputs", "wordnet-xmc")
# training flags per (dataset, method) beyond the dataset's own (sweep_defaults.prepare: Debtags half an epoch at batch
# 64, Reuters one epoch at batch 32); WordNet: the 40-CPU-minute budgets of bench_wordnet.py
BUDGETS = {
    ("debtags", "siamesexml"): ["--num_train_epochs", "0.25", "--classifier_epochs", "2"],
    ("reuters", "siamesexml"): ["--num_train_epochs", "0.5", "--classifier_epochs", "5"],
    ("wordnet", "dexml"): ["--max_steps", "800", "--per_device_train_batch_size", "64"],
    ("wordnet", "prime"): ["--max_steps", "650", "--per_device_train_batch_size", "64"],
    ("wordnet", "unidec"): ["--max_steps", "550", "--per_device_train_batch_size", "64"],
    ("wordnet", "siamesexml"): ["--max_steps", "350", "--per_device_train_batch_size", "64", "--classifier_max_steps", "1000"],
}
#: test queries the scripts time one at a time (``--latency_queries``): the batch-size-1 latency beside throughput
LATENCY_QUERIES = 200
DESCRIPTIONS = {"zeroshot": "untrained MiniLM + channel", "dexml": "DEXML", "prime": "PRIME", "unidec": "UniDEC", "siamesexml": "SiameseXML"}


def data_setup(dataset: str, work: str) -> tuple[str, list[str]]:
    """The data directory and the script's data flags of a dataset."""
    if dataset == "wordnet":
        if not os.path.exists(os.path.join(WORDNET, "lbl.json.gz")):
            raise SystemExit(f"{WORDNET}: build WordNet-XMC first (python benchmarks/make_wordnet.py)")
        return WORDNET, ["--test_filter_file", os.path.join(WORDNET, "filter_labels_test.txt"), "--max_seq_length", "32"]
    data_dir, _, flags = prepare(dataset, work)
    return data_dir, flags


def run_row(dataset: str, method: str, work: str, static_latency_queries: int = 0) -> tuple[dict, dict | None]:
    """Train through the script, then score the saved model's other rankings (module docstring). With
    ``static_latency_queries`` (a trained method), the script also fits the static query encoder (after the tower's
    channel and calibration, so the tower's figures are unchanged) and the second value is its row of
    ``bench_static_encoder.py``'s table (that many test queries timed one at a time); else ``None``."""
    data_dir, data_flags = data_setup(dataset, work)
    out = os.path.join(work, f"{dataset}-{method}")
    script = "dexml" if method == "zeroshot" else method
    flags = ["--max_steps", "0"] if method == "zeroshot" else BUDGETS.get((dataset, method), [])
    static = bool(static_latency_queries) and method != "zeroshot"
    extra = [*data_flags, "--seed", "42", "--lexical_channel", "omikuji", "--latency_queries", str(LATENCY_QUERIES),
             *(["--static_query_encoder"] if static else []), *flags]
    results, wall = run_training_script(script, data_dir, minilm(), out, extra)
    row = {"row": f"{dataset}-{method}", "dataset": dataset, "data_version": data_version(dataset, data_dir), "method": method,
           "flags": flags, "wall_seconds": round(wall, 1),
           "load_1min": round(os.getloadavg()[0], 2), "fused_now": pick(results, "test_"), "dense": pick(results, "test_dense_"),
           "weights_now": [results.get("lexical_ranker_weight"), results.get("lexical_text_weight")],
           "ece": {k[len("test_ECE_"):]: v for k, v in results.items() if k.startswith("test_ECE_")},
           "reliability": results.get("calibration_reliability"), "train_runtime": results.get("train_runtime"),
           "tuned": tuned_settings(results),  # the model's own ranking settings
           # the final model on the validation split (before the ranker is trained again on it): the invariant's own ground
           "validation_fused": pick(results, "eval_"), "validation_dense": pick(results, "eval_dense_"),
           "weights_on_edge": [name for name in ("ranker", "text") if results.get(f"lexical_{name}_weight_on_edge")],
           # serving speed of the saved model: one query at a time (what a request waits) and batched throughput
           "latency_bs1_ms": results.get("test_latency_bs1_p50_ms"), "queries_per_second": results.get("test_samples_per_second")}
    row["tail"] = pick_tail(results)  # coverage, seen / unseen, deciles of the script's two rankings
    row.update(post_hoc(out, data_dir, data_flags))
    if not static:
        return row, None
    from benchmarks.bench_static_encoder import measured_row

    return row, measured_row(dataset, method, data_dir, data_flags, extra, results, wall, out, static_latency_queries)


#: label counts of the datasets: a recall cut-off at or above it says nothing (every ranking of the whole label set
#: reaches 100), so its cell is "-" (Reuters' R@100 over 90 topics)
NUM_LABELS = {"wordnet": 52992, "debtags": 597, "reuters": 90}


def metric_cell(dataset: str, metrics: dict, metric: str) -> str:
    """A metric's table cell: ``"-"`` for a recall cut-off that covers every label of ``dataset``, "" when absent."""
    if metric.startswith("R@") and int(metric[2:]) >= NUM_LABELS.get(dataset, float("inf")):
        return "-"
    return f"{metrics[metric]:.2f}" if metric in metrics else ""


def pick(results: dict, prefix: str) -> dict:
    return {m: results[prefix + m] for m in SHOWN if prefix + m in results}


# ------------------------------------------------------------------------------------------------ tail metrics
#: per ranking, what XMC papers report beside P@k (``XMCEvaluator.tail_metrics`` at k = 5, in percent): coverage@5, P@5
#: and PSP@5 split between labels with training points (seen) and without (unseen), P@5 per train-frequency decile
TAIL_SHOWN = ("coverage@5", "seen_P@5", "unseen_P@5", "seen_PSP@5", "unseen_PSP@5")
TAIL_DECILES = tuple(f"P@5_decile{d}" for d in range(1, 11))
#: the test split's own (the same for every ranking): its unseen labels and their share of PSP@5's ideal mass
TAIL_DATA = ("unseen_labels", "unseen_positive_share", "unseen_PSP@5_mass")
TAIL_HEADER = ["unseen labels (share of PSP@5's ideal mass)", "cov@5", "seen P@5", "unseen P@5", "seen PSP@5", "unseen PSP@5",
               "P@5 by train-frequency decile, head -> tail"]


def pick_tail(results: dict) -> dict:
    """The tail metrics of a script's ``eval_results.json``: ``{"fused": ..., "dense": ...}`` (``test_*`` and
    ``test_dense_*``; the split's own counts under ``fused``); empty dicts from a script run before it reported them."""
    fused = {m: results["test_" + m] for m in (*TAIL_SHOWN, *TAIL_DECILES, *TAIL_DATA) if "test_" + m in results}
    dense = {m: results["test_dense_" + m] for m in (*TAIL_SHOWN, *TAIL_DECILES) if "test_dense_" + m in results}
    return {"fused": fused, "dense": dense}


def tail_cells(metrics: dict | None, data: dict | None = None) -> list[str]:
    """The :data:`TAIL_HEADER` cells of one ranking's tail metrics (``data``: where the split's counts are, default
    ``metrics``): "-" for what a row measured before the scripts reported it lacks."""
    metrics, data = metrics or {}, (data if data is not None else metrics) or {}
    unseen = "-"
    if "unseen_labels" in data and "unseen_PSP@5_mass" in data:
        unseen = f"{int(data['unseen_labels']):,} ({data['unseen_PSP@5_mass']:.1f} %)"
    deciles = [metrics.get(m) for m in TAIL_DECILES]
    by_decile = " / ".join(f"{v:.1f}" for v in deciles) if all(v is not None for v in deciles) else "-"
    return [unseen, *(f"{metrics[m]:.2f}" if m in metrics else "-" for m in TAIL_SHOWN), by_decile]


def has_tail(rows: list[dict]) -> bool:
    """Whether any row carries tail metrics (the tail table is rendered only then: older results render as before)."""
    return any(r.get("tail", {}).get(ranking) for r in rows for ranking in ("fused", "dense"))


TAIL_NOTE = ("Tail metrics (percent, k = 5): *unseen* labels have no training point; *seen / unseen P@5* are P@5's hits "
             "on them over n x 5 (they add up to P@5); *seen / unseen PSP@5* divide the propensity gains of those hits by "
             "the part of PSP@5's ideal mass on those labels (PSP@5 = m x unseen + (1 - m) x seen, m the unseen share in "
             "the first column); *cov@5*: distinct labels hit in some top 5 / distinct labels of the test ground truth; "
             "the deciles are P@5's contributions of ten label groups of equal train positives, head first (unseen labels in "
             "the last); \"-\": measured before the scripts reported it.")


def split_filter(data_flags: list[str], test, num_labels: int):
    """The test split's filter matrix (rows of ``test``, an ``XMCDataset``) named by ``--test_filter_file`` in
    ``data_flags``, as the scripts apply it, and how many more results a search needs so that ``k`` remain after
    filtering; ``(None, 0)`` without a filter file."""
    import numpy as np

    from hf_xmc.data import read_filter_file

    if "--test_filter_file" not in data_flags:
        return None, 0
    path = data_flags[data_flags.index("--test_filter_file") + 1]
    filt = read_filter_file(path, num_points=test.num_source_records, num_labels=num_labels)[test.record_indices()]
    return filt, (int(np.diff(filt.indptr).max()) if filt.nnz else 0)


def post_hoc(model_dir: str, data_dir: str, data_flags: list[str]) -> dict:
    """The saved model's channel-alone ranking and its fusion tuned the way it was before the validation split."""
    import numpy as np
    from transformers import AutoModel

    import hf_xmc  # noqa: F401  (registers the model classes)
    from hf_xmc.data import filter_predictions
    from hf_xmc.metrics import inverse_propensity, xmc_metrics
    from hf_xmc.models.lexical_channel import FUSE_CHUNK
    from hf_xmc.training import XMCTrainingArguments
    from hf_xmc.training.lexical import fit_lexical_channel
    from hf_xmc.training.script_utils import XMCDataArguments, load_data

    data_args = XMCDataArguments(train_file=f"{data_dir}/trn.json.gz", test_file=f"{data_dir}/tst.json.gz", label_file=f"{data_dir}/lbl.json.gz")
    with tempfile.TemporaryDirectory() as tmp:
        training_args = XMCTrainingArguments(output_dir=tmp, lexical_channel="omikuji", seed=42, disable_tqdm=True)
    data = load_data(data_args, training_args)
    model = AutoModel.from_pretrained(model_dir).eval()
    if model.config.validation["fingerprint"] != data.validation_record["fingerprint"]:
        raise SystemExit(f"{model_dir}: the model's validation split is not the one carved here")
    test = data.test
    filt, extra = split_filter(data_flags, test, len(data.label_texts))
    inv_prop = inverse_propensity(data.propensity_targets(), model.config.propensity_a, model.config.propensity_b)

    def score(ids, scores):
        if filt is not None:
            ids, scores = filter_predictions(ids, scores, filt, 100)
        m = xmc_metrics(ids[:, :100], test.targets, inv_prop, ks=(1, 3, 5), recall_ks=(10, 100))
        return {k: round(float(m[k]), 2) for k in SHOWN}

    vectors = model.query_search_vectors(test.texts, batch_size=256, show_progress_bar=False)
    dense_scores, dense_ids = model.search(vectors, 100 + extra)
    channel = model.lexical_channel
    alone_ids = np.full((len(test), 100 + extra), -1, dtype=np.int64)
    alone_scores = np.full(alone_ids.shape, -np.inf, dtype=np.float32)
    for start in range(0, len(test), FUSE_CHUNK):
        stop = min(start + FUSE_CHUNK, len(test))
        candidates = channel.candidates(test.texts[start:stop], dense_scores[start:stop], dense_ids[start:stop], 1.0, 0.0)
        alone_scores[start:stop], alone_ids[start:stop] = candidates.top_k(1.0, 0.0, 100 + extra, dense_weight=0.0)
    normalised = normalised_fusion(model, data, test, extra, inv_prop, dense_scores, dense_ids, score)
    start = time.perf_counter()
    before = fit_lexical_channel(model, data.train, seed=42, batch_size=256, rebuild_label_index=False)  # the old procedure, on this model
    fused_scores, fused_ids = before.fuse(test.texts, dense_scores, dense_ids, 100 + extra)
    return {"channel_alone": score(alone_ids, alone_scores), "fused_before": score(fused_ids, fused_scores),
            "weights_before": [before.settings["ranker_weight"], before.settings["text_weight"]],
            "before_seconds": round(time.perf_counter() - start, 1), **normalised}


def candidates_of(channel, texts, dense_scores, dense_ids):
    """The channel's fusion candidates of ``texts`` (every channel scored), chunk by chunk, concatenated."""
    from hf_xmc.models.lexical_channel import FUSE_CHUNK, FusionCandidates

    parts = [channel.candidates(texts[i : i + FUSE_CHUNK], dense_scores[i : i + FUSE_CHUNK], dense_ids[i : i + FUSE_CHUNK], 1.0, 1.0)
             for i in range(0, len(texts), FUSE_CHUNK)]
    return FusionCandidates(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("ids", "dense", "ranker", "text")))


def normalise_dense(candidates):
    """The dense column min-max scaled per query over its dense hits (1 = the top hit, 0 = the last one and every
    ranker-only candidate): a scale-free dense score, the same range for every method."""
    valid = candidates.ids >= 0
    dense = np.where(valid, candidates.dense, np.nan)
    low, high = np.nanmin(dense, axis=1, keepdims=True), np.nanmax(dense, axis=1, keepdims=True)
    candidates.dense = np.nan_to_num((candidates.dense - low) / np.maximum(high - low, 1e-6)).astype(np.float32)
    return candidates


def normalised_fusion(model, data, test, extra, inv_prop, dense_scores, dense_ids, score) -> dict:
    """The alternative fusion of the validation-split issue, measured on this model: the dense score normalised per
    query (:func:`normalise_dense`), the weight grids tuned on the validation split as the script tunes the raw fusion,
    a ranker trained on the training split (not yet on the validation one); also the raw fusion with that same
    ranker, so the two differ in the normalisation only."""
    from hf_xmc.metrics import xmc_metrics
    from hf_xmc.training.lexical import RANKER_WEIGHTS, TEXT_WEIGHTS, fit_lexical_channel

    start = time.perf_counter()
    channel = fit_lexical_channel(model, data.train, seed=42, batch_size=256, validation=data.validation, rebuild_label_index=False)  # raw weights, tuned on validation
    validation = data.validation
    val_scores, val_ids = model.search(model.query_search_vectors(validation.texts, batch_size=256, show_progress_bar=False), 100)
    val = normalise_dense(candidates_of(channel, validation.texts, val_scores, val_ids))
    grid = {}
    for wr in RANKER_WEIGHTS:
        for wt in TEXT_WEIGHTS:
            m = xmc_metrics(val.top_k(wr, wt, 5)[1], validation.targets, inv_prop, ks=(1, 5), recall_ks=())
            grid[(wr, wt)] = m["P@1"] + m["PSP@5"]
    best = min((w for w in sorted(grid) if grid[w] >= max(grid.values()) - 1e-9), key=lambda w: (w[0], w[1]))
    raw_test = candidates_of(channel, test.texts, dense_scores, dense_ids)
    raw = raw_test.top_k(channel.settings["ranker_weight"], channel.settings["text_weight"], 100 + extra)
    norm = normalise_dense(raw_test).top_k(*best, 100 + extra)
    return {"fused_now_same_ranker": score(raw[1], raw[0]), "fused_normalised": score(norm[1], norm[0]),
            "weights_normalised": list(best), "normalised_seconds": round(time.perf_counter() - start, 1)}


def invariant(row: dict, zeroshot: dict | None, split: str = "test") -> str:
    """Whether fused now >= max(dense, untrained + channel) - 0.3 on P@1 and PSP@5 (the shortfalls otherwise), on the
    test split or (``split="validation"``) on the validation split, where the tuning can be held to it; "-" for rows
    run before the scripts reported their validation metrics."""
    keys = {"test": ("fused_now", "dense"), "validation": ("validation_fused", "validation_dense")}[split]
    fused, dense = row.get(keys[0]) or {}, row.get(keys[1]) or {}
    untrained = (zeroshot or {}).get(keys[0]) or {}
    if not fused or (zeroshot and not untrained):
        return "-"
    misses = []
    for m in ("P@1", "PSP@5"):
        floor = max(dense.get(m, 0.0), untrained.get(m, 0.0))
        if fused[m] < floor - 0.3:
            misses.append(f"{m} {fused[m] - floor:+.2f}")
    verdict = "yes" if not misses else "no (" + ", ".join(misses) + ")"
    if split == "validation":  # the objective the weights are tuned by: one number, so the only floor a tuning can hold
        objective = fused["P@1"] + fused["PSP@5"]
        floor = max(dense.get("P@1", 0.0) + dense.get("PSP@5", 0.0), untrained.get("P@1", 0.0) + untrained.get("PSP@5", 0.0))
        verdict += f"; on P@1 + PSP@5 (the tuned objective): {'yes' if objective >= floor - 1e-6 else 'no'} ({objective - floor:+.2f})"
    return verdict


def tables(rows: list[dict]) -> str:
    """The rankings of every row (with the invariant's verdict), then the calibration's test ECE per row."""
    header = ["dataset", "model", "ranking", *SHOWN, "weights (ranker, text)", "wall min"]
    cells = []
    for r in rows:
        zs = next((z for z in rows if z["dataset"] == r["dataset"] and z["method"] == "zeroshot"), None)
        wall = f"{r['wall_seconds'] / 60:.1f}"
        lines = [("dense", r["dense"], ""), ("channel alone", r["channel_alone"], ""),
                 ("fused before (tuned on training queries)", r["fused_before"], "{:g}, {:g}".format(*r["weights_before"])),
                 ("**fused now (tuned on validation)**", r["fused_now"], "{:g}, {:g}".format(*r["weights_now"])
                  + "".join(f" ({name} weight on its cap)" for name in r.get("weights_on_edge", [])))]
        if "fused_normalised" in r:  # the scale-free alternative, measured after the run (module docstring)
            lines.append(("fused, dense score min-max normalised per query (tuned on validation)", r["fused_normalised"], "{:g}, {:g}".format(*r["weights_normalised"])))
        if r["method"] == "zeroshot":
            lines = [lines[0], lines[3], *lines[4:]]
        for name, metrics, weights in lines:
            cells.append([row_dataset_cell(r), DESCRIPTIONS[r["method"]], name,
                          *(metric_cell(r["dataset"], metrics, m) for m in SHOWN), weights, wall])
        if r["method"] != "zeroshot":
            question = "fused now >= max(dense, untrained + channel) - 0.3 on P@1 and PSP@5?"
            cells.append([row_dataset_cell(r), DESCRIPTIONS[r["method"]], question, invariant(r, zs),
                          *[None] * (len(SHOWN) + 1)])
            if r.get("validation_fused"):
                cells.append([row_dataset_cell(r), DESCRIPTIONS[r["method"]], "the same on the validation split?",
                              invariant(r, zs, "validation"),
                              *[None] * (len(SHOWN) + 1)])
    fusion = markdown_table(header, cells, "lll" + "r" * len(SHOWN) + "lr")
    # the calibration is fitted and its ECE measured on each query's top 100 since issue 64 (rows run since carry
    # validation metrics); the rows before, on the top 20: more pairs near probability 0 lower a pair-weighted ECE, so
    # the two depths do not compare
    ece = markdown_table(["dataset", "model", "test ECE, isotonic (the default)", "test ECE, Platt", "ranks", "ms a query, one at a time (p50)",
                          "queries/s, batched"],
                         [[row_dataset_cell(r), DESCRIPTIONS[r["method"]], f"{r['ece'].get('isotonic', float('nan')):.2f}", f"{r['ece'].get('platt', float('nan')):.2f}",
                           "top 100" if r.get("validation_fused") else "top 20", speed_cell(r.get("latency_bs1_ms"), "{:.1f}"),
                           speed_cell(r.get("queries_per_second"), "{:,.0f}")]
                          for r in rows], "llrrlrr")
    tail = "\n" + TAIL_NOTE + "\n\n" + tail_table(rows) + "\n" if has_tail(rows) else ""  # once rows carry them
    return fusion + "\n\n" + ece + "\n" + tail


#: the committed peers results per dataset (``benchmarks/peers.py``; Debtags' through ``bench_debtags.py``)
PEERS_RESULTS = {"debtags": "debtags.json", "reuters": "peers_reuters.json", "wordnet": "peers_wordnet.json"}
#: bench_dense's recipe that is train_dexml.py's default at this benchmark's budgets (one mined negative a query, no
#: cluster batching under 10,000 labels)
DEXML_DEFAULT_RECIPE = {"debtags": "hard_negatives", "reuters": "hard_negatives"}
TAIL_OVERVIEW_NOTE = ("Per dataset: every peer of its committed peers table (`benchmarks/peers.py`, library defaults, "
                      "TF-IDF) and the hf_xmc rows of this benchmark (the untrained encoder + channel and DEXML with the "
                      "script's defaults, dense and fused), on the test split with its filter file. ")


def tail_overview(rows: list[dict], peers_results: dict[str, dict] | None = None, dense_rows: list[dict] | None = None) -> str:
    """The tail metrics of the three datasets in one table: the peers' (from their committed results, rows that carry
    ``tail``) beside this benchmark's untrained encoder + channel and DEXML rows (dense and fused; where this benchmark
    has no DEXML row with them, bench_dense's row of the script's default recipe at the same budgets,
    :data:`DEXML_DEFAULT_RECIPE`), with P@5 and PSP@5 for scale. ``peers_results``: ``{dataset: results}`` (default:
    read :data:`PEERS_RESULTS`); ``dense_rows``: bench_dense's rows (default: ``dense.json``)."""
    if peers_results is None:
        peers_results = {d: read_json(result_path(f)) for d, f in PEERS_RESULTS.items() if os.path.exists(result_path(f))}
    if dense_rows is None:
        dense_rows = read_json(result_path("dense.json")) if os.path.exists(result_path("dense.json")) else []
    cells = []
    for dataset in ("debtags", "reuters", "wordnet"):
        peers_result = peers_results.get(dataset) or {}
        for r in (r for r in peers_result.get("rows", []) if r.get("tail")):
            m = r["metrics"]
            cells.append([dataset_cell(dataset, peers_result.get("data_version")), r["method"], "peer", f"{m['P@5']:.2f}", f"{m['PSP@5']:.2f}", *tail_cells(r["tail"])])
        ours = [r for r in rows if r["dataset"] == dataset and r["method"] in ("zeroshot", "dexml") and has_tail([r])]
        if not any(r["method"] == "dexml" for r in ours):  # DEXML's default recipe at these budgets, run by bench_dense
            ours += [{**r, "fused_now": r["fused"]} for r in dense_rows if r["dataset"] == dataset and r["method"] == "dexml"
                     and r["recipe"] == DEXML_DEFAULT_RECIPE.get(dataset) and has_tail([r])]
        for r in ours:
            for name, key, metrics in (("dense", "dense", r["dense"]), ("fused (tuned on validation)", "fused", r["fused_now"])):
                cells.append([dataset_cell(dataset, r.get("data_version")), DESCRIPTIONS[r["method"]], name, f"{metrics['P@5']:.2f}", f"{metrics['PSP@5']:.2f}",
                              *tail_cells(r["tail"].get(key), r["tail"].get("fused"))])
    table = markdown_table(["dataset", "model", "ranking", "P@5", "PSP@5", *TAIL_HEADER], cells, "lllrr" + "r" * (len(TAIL_HEADER) - 1) + "l")
    return TAIL_OVERVIEW_NOTE + TAIL_NOTE + "\n\n" + table + "\n"


def speed_cell(value, fmt: str) -> str:
    """A speed cell: "-" for rows run before the scripts reported it."""
    return "-" if value is None else fmt.format(value)


def tail_table(rows: list[dict]) -> str:
    """The tail metrics (:data:`TAIL_HEADER`) of the script's two rankings of every row, dense and fused."""
    cells = []
    for r in rows:
        tail = r.get("tail", {})
        for name, key in (("dense", "dense"), ("fused now (tuned on validation)", "fused")):
            cells.append([row_dataset_cell(r), DESCRIPTIONS[r["method"]], name, *tail_cells(tail.get(key), tail.get("fused"))])
    return markdown_table(["dataset", "model", "ranking", *TAIL_HEADER], cells, "lll" + "r" * (len(TAIL_HEADER) - 1) + "l")


def reliability(rows: list[dict]) -> str:
    """The reliability diagram (as a table) of each dataset's DEXML model: per probability bin, the mean calibrated
    probability against the fraction of relevant labels on the test split."""
    out = []
    for r in rows:
        if r["method"] != "dexml" or not r.get("reliability"):
            continue
        out.append(markdown_table([f"{r['dataset']}, DEXML + channel: probability bin", "pairs", "mean probability", "fraction relevant"],
                                  [[b["bin"], f"{b['pairs']:,}", f"{b['mean_probability']:.3f}", f"{b['fraction_relevant']:.3f}"] for b in r["reliability"]],
                                  "lrrr"))
        out.append("")
    return "\n".join(out)


def main(argv=None) -> list[dict]:
    ap = bench_parser(__doc__, result_path("validation_fusion.json"), docs_block="validation_fusion", table_only=True)
    ap.add_argument("--datasets", nargs="+", default=["debtags", "reuters"], choices=["debtags", "reuters", "wordnet"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--rerun", action="store_true", help="run rows already in --out again")
    ap.add_argument("--static_query_encoder", action="store_true",
                    help="the trained methods' scripts also fit the static query encoder; its row (bench_static_encoder.py's table) goes to --static_out")
    ap.add_argument("--static_out", default=result_path("static_encoder.json"), help="bench_static_encoder.py's results, where --static_query_encoder's rows go")
    ap.add_argument("--static_latency_queries", type=int, default=300, help="--static_query_encoder: test queries timed one at a time per query encoder")
    args = ap.parse_args(argv)
    rows = read_json(args.out) if os.path.exists(args.out) else []
    static_rows = read_json(args.static_out) if args.static_query_encoder and os.path.exists(args.static_out) else []
    order = {(d, m): i for i, (d, m) in enumerate((d, m) for d in ("debtags", "reuters", "wordnet") for m in METHODS)}
    if not args.table_only:
        with tempfile.TemporaryDirectory(prefix="validation_") as work:
            for dataset in args.datasets:
                for method in args.methods:
                    name = f"{dataset}-{method}"
                    if any(r["row"] == name for r in rows) and not args.rerun:
                        continue
                    row, static_row = run_row(dataset, method, work, args.static_latency_queries if args.static_query_encoder else 0)
                    rows = sorted([r for r in rows if r["row"] != name] + [row], key=lambda r: order[(r["dataset"], r["method"])])
                    write_json(args.out, rows, sort_keys=False)
                    if static_row is not None:
                        from benchmarks.bench_static_encoder import merge_row

                        static_rows = merge_row(static_rows, static_row)
                        write_json(args.static_out, static_rows)
                    print(f"{name}: now {row['fused_now']} before {row['fused_before']} dense {row['dense']} ({row['wall_seconds'] / 60:.1f} min)", flush=True)
    publish(tables(rows), "validation_fusion", args.update_docs)
    publish(reliability(rows), "validation_reliability", args.update_docs)
    publish(tail_overview(rows), "tail", args.update_docs)
    if static_rows:
        from benchmarks.bench_static_encoder import static_table

        publish(static_table(static_rows), "static", args.update_docs)
    return rows


if __name__ == "__main__":
    main()
