#!/usr/bin/env python
"""Which label centroids MUFIN's shortlist index should hold after Module IV, measured on one training run each.

Module II computes the centroids ``mu_l`` with the Module-I encoder; Module IV keeps training the encoders. The recipe
recomputes them with the final encoder (``MUFINCentroidCallback``, spec Sec. 12.11 option (a)). This script runs
``train_mufin.py``'s recipe in-process, keeps the Module-II centroids aside when the refresh happens, and evaluates the
same final model three ways: ``final`` (what the recipe saves), ``module2`` (the Module-II centroids: the mixed index the
recipe had before) and ``none`` (bag rows only, no centroids). It also reports how anisotropic the final ``x^1`` space
is (mean cosine between test queries) and how often a query's best index row is a centroid.

    python benchmarks/bench_mufin_centroids.py [--datasets tiny:1 tiny:2 reuters emoji] [--out FILE]

``tiny:S`` is the contract's tiny random-BERT task with seed S (``../shared/checks/make_tiny.py``); ``reuters`` needs
``benchmarks/make_reuters.py``, ``emoji`` ``benchmarks/make_emoji.py`` (both under ``outputs/``); both use
all-MiniLM-L6-v2 at the recipe's default budget (2 + 3 epochs). Writes benchmarks/results/mufin_centroids.json
(``--out``) and prints the table.
"""

import os
import subprocess
import sys
import tempfile

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import bench_parser, markdown_table, result_path, write_json  # noqa: E402
from benchmarks.sweep_defaults import BENCH_SHOWN, minilm  # noqa: E402
from hf_xmc.models import MUFINModel  # noqa: E402
from hf_xmc.training import mufin as mufin_training  # noqa: E402
from hf_xmc.training.recipes import mufin as recipe  # noqa: E402
from hf_xmc.training.script_utils import XMCDataArguments, build_evaluator, load_data  # noqa: E402


def dataset_args(name: str, work: str) -> tuple[list[str], str]:
    """Training-script arguments (data, encoder, budget) of a dataset entry, and its label."""
    kind, _, seed = name.partition(":")
    if kind == "tiny":
        data = os.path.join(work, "tiny")
        if not os.path.exists(data):
            subprocess.run([sys.executable, os.path.join(REPO, "..", "shared", "checks", "make_tiny.py"), data], check=True, capture_output=True)
        budget = ["--num_train_epochs", "3", "--per_device_train_batch_size", "32", "--max_seq_length", "16", "--seed", seed or "1"]
        encoder = os.path.join(data, "encoder")
    else:
        data = os.path.join(REPO, "outputs", {"reuters": "reuters", "emoji": "emoji-xmc"}[kind])
        if not os.path.exists(os.path.join(data, "lbl.json.gz")):
            raise SystemExit(f"{data} holds no dataset: run benchmarks/make_{'emoji' if kind == 'emoji' else 'reuters'}.py first")
        budget = ["--per_device_train_batch_size", "32", "--max_seq_length", "16" if kind == "emoji" else "32", "--seed", seed or "42"]
        encoder = minilm()
    files = ["--train_file", f"{data}/trn.json.gz", "--test_file", f"{data}/tst.json.gz", "--label_file", f"{data}/lbl.json.gz"]
    return files + ["--model_name_or_path", encoder] + budget, name


def index_statistics(model: MUFINModel, texts, images) -> dict:
    """Mean cosine between test queries ``x^1`` and the share of queries whose best index row is a centroid."""
    queries = torch.nn.functional.normalize(model.encode_items(texts, images), dim=-1)
    rows, _ = model.shortlist_vectors()
    num_bag_rows = model.label_bag_rows.shape[0]
    best = (queries @ rows.T).argmax(dim=1)
    return {"mean_query_cosine": float((queries @ queries.T).mean()), "best_row_is_centroid": float((best >= num_bag_rows).float().mean())}


def run(name: str, work: str) -> list[dict]:
    argv, label = dataset_args(name, work)
    out = os.path.join(work, name.replace(":", "-"))
    argv += ["--output_dir", out, "--save_strategy", "no", "--disable_tqdm", "true"]
    kept = {}
    refresh = mufin_training.MUFINCentroidCallback.on_train_end

    def keep_module2_centroids(self, args, state, control, model=None, **kwargs):
        kept["centroids"], kept["counts"] = model.label_centroids.clone(), model.label_centroid_counts.clone()
        return refresh(self, args, state, control, model=model, **kwargs)

    mufin_training.MUFINCentroidCallback.on_train_end = keep_module2_centroids
    try:
        final_metrics = recipe.main(argv)
    finally:
        mufin_training.MUFINCentroidCallback.on_train_end = refresh
    data_args = XMCDataArguments(train_file=argv[argv.index("--train_file") + 1], test_file=argv[argv.index("--test_file") + 1], label_file=argv[argv.index("--label_file") + 1])
    data = load_data(data_args)
    rows = []
    for variant in ("final", "module2", "none"):
        model = MUFINModel.from_pretrained(out).eval()
        if variant == "module2":
            model.set_label_centroids(kept["centroids"], kept["counts"])
        elif variant == "none":
            model.label_centroids = model.label_centroid_counts = None
            model.label_index = None
        evaluator = build_evaluator(data, data_args)
        evaluator.label_images = data.label_images
        metrics = final_metrics if variant == "final" else evaluator(model)
        stats = index_statistics(model, data.test.texts, data.test.images) if variant != "none" else {}
        rows.append({"dataset": label, "centroids": variant, **{k: metrics[k] for k in BENCH_SHOWN}, **stats})
        print(f"{label} {variant}: " + " ".join(f"{k[5:]}={metrics[k]:.2f}" for k in BENCH_SHOWN) + "".join(f" {k}={v:.3f}" for k, v in stats.items()), flush=True)
    return rows


def main() -> None:
    ap = bench_parser(__doc__, result_path("mufin_centroids.json"))
    ap.add_argument("--datasets", nargs="+", default=["tiny:1", "tiny:2", "tiny:3", "reuters", "emoji"])
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name in args.datasets:
            rows += run(name, work)
    cells = [[r["dataset"], r["centroids"], *(f"{r[k]:.2f}" for k in BENCH_SHOWN),
              *(f"{r[k]:.3f}" if k in r else "-" for k in ("mean_query_cosine", "best_row_is_centroid"))] for r in rows]
    print("\n" + markdown_table(["dataset", "centroids", *(k[5:] for k in BENCH_SHOWN), "query cos", "best row a centroid"], cells,
                                "ll" + "r" * (len(BENCH_SHOWN) + 2)))
    write_json(args.out, {"datasets": args.datasets, "rows": rows})


if __name__ == "__main__":
    main()
