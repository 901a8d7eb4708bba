#!/usr/bin/env python
"""Sweep a training-script hyper-parameter over several datasets, through the training script contract.

Defaults of ``training_scripts/train_<method>.py`` must hold on data we have not seen, so they are tuned on one
dataset and checked on others. Each run is ``python training_scripts/train_<method>.py --train_file ... --<param>
<value> [extra args]``; the script's ``eval_results.json`` is collected into a table and JSON.

    python benchmarks/sweep_defaults.py --method dexml --param learning_rate --values 1e-4 3e-4 1e-3 \
        --datasets tiny debtags reuters --out benchmarks/results/sweep_dexml_lr.json

Datasets: ``tiny`` (the contract checker's planted task and tiny random BERT, 3 epochs, batch 32, length 16),
``debtags`` (bundled; MiniLM, half an epoch, batch 64) and ``reuters`` (``benchmarks/make_reuters.py``; MiniLM,
1 epoch, batch 32). Extra per-dataset arguments are in ``DATASETS``.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import (  # noqa: E402
    SELECTION_KEYS,
    bench_parser,
    chosen_by_group,
    markdown_table,
    publish,
    read_json,
    result_path,
    write_json,
)

SHOWN = ["test_P@1", "test_P@5", "test_nDCG@5", "test_PSP@1", "test_PSP@5", "test_R@10"]
#: the validation columns beside them: what a choice reads (``benchmarks.harness.SELECTION_KEYS``)
CHOSEN_BY = list(SELECTION_KEYS)
BENCH_SHOWN = ["test_P@1", "test_P@3", "test_P@5", "test_nDCG@5", "test_PSP@1", "test_PSP@3", "test_PSP@5", "test_R@10"]


def training_command(method: str, data_dir: str, encoder: str, output_dir: str, extra: list[str]) -> tuple[list[str], dict]:
    """The command line (and environment) of ``train_<method>.py`` through the training script contract."""
    cmd = [sys.executable, os.path.join(REPO, "training_scripts", f"train_{method}.py"),
           "--train_file", f"{data_dir}/trn.json.gz", "--test_file", f"{data_dir}/tst.json.gz",
           "--label_file", f"{data_dir}/lbl.json.gz", "--model_name_or_path", encoder, "--output_dir", output_dir,
           "--save_strategy", "no", "--disable_tqdm", "true"] + extra
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    return cmd, env


def run_training_script(method: str, data_dir: str, encoder: str, output_dir: str, extra: list[str]) -> tuple[dict, float]:
    """Run ``train_<method>.py`` through the training script contract; returns ``eval_results.json`` and wall seconds."""
    cmd, env = training_command(method, data_dir, encoder, output_dir, extra)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"run failed: {' '.join(cmd)}")
    with open(os.path.join(output_dir, "eval_results.json")) as f:
        return json.load(f), time.perf_counter() - start


def run_modes(modes: dict, args, title: str) -> list[dict]:
    """Run every ``(description, method, extra args)`` of ``modes`` named in ``args.modes`` on every dataset of
    ``args.datasets`` for ``args.epochs`` epochs (batch size of the dataset, max length 32, seed 42), through the training
    scripts (or merge the rows of ``args.from_results``, or with ``args.table_only`` read ``args.out``); write
    ``args.out``, print the markdown table and, with ``args.update_docs``, write it into docs block ``args.marker``.
    Returns the result rows."""
    if args.table_only:
        result = read_json(args.out)
    else:
        rows = merged_rows(args.from_results, args.epochs) if args.from_results else []
        result = {"epochs": args.epochs, "rows": rows or run_mode_rows(modes, args)}
        write_json(args.out, result)
    publish(modes_table(result, title), args.marker, args.update_docs)
    return result["rows"]


def merged_rows(paths: list[str], epochs: str) -> list[dict]:
    """The rows of results files of runs made apart (e.g. side by side), which must hold ``epochs`` epochs."""
    rows = []
    for path in paths:
        part = read_json(path)
        if str(part["epochs"]) != str(epochs):
            raise SystemExit(f"{path} holds {part['epochs']} epoch(s), not {epochs}")
        rows += part["rows"]
    return rows


def run_mode_rows(modes: dict, args) -> list[dict]:
    """One training run per (dataset, mode) of ``args``: the script's test metrics, batch size and wall seconds."""
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for dataset in args.datasets:
            data_dir, encoder, extra_data = prepare(dataset, work)
            batch = extra_data[extra_data.index("--per_device_train_batch_size") + 1]
            common = ["--num_train_epochs", args.epochs, "--per_device_train_batch_size", batch, "--max_seq_length", "32", "--seed", "42",
                      *validation_flags(data_dir)]
            for mode in args.modes:
                desc, method, extra = modes[mode]
                results, seconds = run_training_script(method, data_dir, encoder, os.path.join(work, f"{dataset}-{mode}"), common + extra)
                rows.append({"dataset": dataset, "mode": mode, "description": desc, "args": extra, "batch_size": batch, "wall_seconds": seconds, **results})
                print(f"{dataset} {mode}: " + " ".join(f"{k[5:]}={results[k]:.2f}" for k in BENCH_SHOWN), flush=True)
    return rows


def validation_cells(row: dict, chosen: set[int]) -> list[str]:
    """The validation columns of a sweep row (:data:`CHOSEN_BY`, "-" for rows run before the scripts reported them) and
    the choice mark: ``chosen`` is the best of its dataset on them (:func:`benchmarks.harness.chosen_by_group`)."""
    return [*(f"{row[k]:.2f}" if row.get(k) is not None else "-" for k in CHOSEN_BY), "chosen" if id(row) in chosen else ""]


def modes_table(result: dict, title: str) -> str:
    """The table of a modes benchmark: one row per (mode, dataset), the validation metrics a choice reads and the
    choice per dataset, the BENCH_SHOWN test metrics (read once per row, to report) and wall seconds."""
    chosen = chosen_by_group(result["rows"], "dataset")
    header = [f"{result['epochs']} epoch(s), {title}", "dataset", *(f"val {k[5:]}" for k in CHOSEN_BY), "by val",
              *(k[5:] for k in BENCH_SHOWN), "wall s"]
    rows = [[r["description"], f"{r['dataset']} (batch {r['batch_size']})", *validation_cells(r, chosen),
             *(f"{r[k]:.2f}" for k in BENCH_SHOWN), f"{r['wall_seconds']:.0f}"]
            for r in result["rows"]]
    return markdown_table(header, rows, "ll" + "r" * len(CHOSEN_BY) + "l" + "r" * (len(BENCH_SHOWN) + 1)) + "\n"


def modes_main(doc: str, modes: dict, default_modes: list[str], results_name: str, marker: str, title: str = "MiniLM-L6, lr 3e-4") -> None:
    """Command line of a modes benchmark (bench_prime, bench_unidec): ``--datasets --epochs --modes --out
    --update_docs --marker --table_only [--from_results A.json B.json]``, then :func:`run_modes`."""
    ap = bench_parser(doc, result_path(results_name), docs_block=marker, marker=True, table_only=True)
    ap.add_argument("--datasets", nargs="+", default=["debtags", "reuters"], choices=["debtags", "reuters"])
    ap.add_argument("--epochs", default="1")
    ap.add_argument("--modes", nargs="+", default=default_modes, choices=list(modes))
    ap.add_argument("--from_results", nargs="+", help="results files of earlier runs (same epochs): merge their rows, run nothing")
    run_modes(modes, ap.parse_args(), title)


def minilm() -> str:
    from hf_xmc.quickstart import minilm_path

    return minilm_path()


#: the training budget and shapes of the real datasets' runs (before any row's own flags, which win)
DATA_FLAGS = {
    "debtags": ["--num_train_epochs", "0.5", "--per_device_train_batch_size", "64", "--max_seq_length", "32"],
    "reuters": ["--num_train_epochs", "1", "--per_device_train_batch_size", "32", "--max_seq_length", "32"],
}


def validation_flags(data_dir: str) -> list[str]:
    """``--validation_size N``: the split a training script holds out by default when it needs one
    (:func:`hf_xmc.data.splits.default_validation_size` of the labelled training queries, drawn with ``--seed``), asked
    for explicitly so that every run of a sweep reports the final model's validation metrics (``eval_*``), which are
    what a choice reads (:func:`benchmarks.harness.choose`); a run that carves one anyway (``--lexical_channel``) holds
    out the same queries."""
    from hf_xmc.data import read_xc_raw
    from hf_xmc.data.splits import default_validation_size

    return ["--validation_size", str(default_validation_size(len(read_xc_raw(os.path.join(data_dir, "trn.json.gz")))))]


def prepare(name: str, work: str) -> tuple[str, str, list[str]]:
    """Return (data directory, encoder, extra script arguments) for a dataset name."""
    if name == "tiny":
        data = os.path.join(work, "tiny")
        subprocess.run([sys.executable, os.path.join(REPO, "..", "shared", "checks", "make_tiny.py"), data], check=True, capture_output=True)
        return data, os.path.join(data, "encoder"), ["--num_train_epochs", "3", "--per_device_train_batch_size", "32", "--max_seq_length", "16", "--seed", "1"]
    if name == "debtags":
        from hf_xmc.data import DEBTAGS_DIR

        return str(DEBTAGS_DIR), minilm(), list(DATA_FLAGS["debtags"])
    if name == "reuters":
        data = os.path.join(REPO, "outputs", "reuters")
        if not os.path.exists(os.path.join(data, "lbl.json.gz")):
            subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "make_reuters.py"), "--out", data], check=True)
        return data, minilm(), list(DATA_FLAGS["reuters"])
    raise SystemExit(f"unknown dataset {name}")


def main() -> None:
    ap = bench_parser(__doc__, None)
    ap.add_argument("--method", default="dexml")
    ap.add_argument("--param", default="learning_rate")
    ap.add_argument("--values", nargs="+", required=True)
    ap.add_argument("--datasets", nargs="+", default=["tiny", "debtags", "reuters"])
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more script arguments for every run")
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as work:
        for name in args.datasets:
            data, encoder, extra = prepare(name, work)
            for value in args.values:
                out = os.path.join(work, f"{name}-{value}")
                results, seconds = run_training_script(args.method, data, encoder, out,
                                                       [f"--{args.param}", value] + extra + validation_flags(data) + args.extra)
                runs.append({"dataset": name, args.param: value, "wall_seconds": seconds, **results})
                print(f"{name:8s} {args.param}={value:8s} " + " ".join(f"{k[5:]}={results[k]:.2f}" for k in SHOWN), flush=True)
    chosen = chosen_by_group(runs, "dataset")  # by the validation split; the test columns are reported, never read to choose
    table = markdown_table(["dataset", args.param, *(f"val {k[5:]}" for k in CHOSEN_BY), "by val", *(k[5:] for k in SHOWN), "wall s"],
                           [[r["dataset"], r[args.param], *validation_cells(r, chosen), *(f"{r[k]:.2f}" for k in SHOWN), f"{r['wall_seconds']:.0f}"]
                            for r in runs],
                           "ll" + "r" * len(CHOSEN_BY) + "l" + "r" * (len(SHOWN) + 1))
    print("\n" + table)
    if args.out:
        write_json(args.out, {"method": args.method, "param": args.param, "extra": args.extra, "runs": runs})


if __name__ == "__main__":
    main()
