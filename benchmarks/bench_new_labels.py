#!/usr/bin/env python
"""New labels without retraining: hold out 20% of the labels from training, add them afterwards with
``model.add_labels`` (scored zero-shot), and compare with a model retrained with all labels.

    python benchmarks/bench_new_labels.py [--datasets debtags reuters] [--methods dexml unidec] [--held_out 0.2] [--update_docs]

Per dataset and method: the labels are split at random (seed 0) into 80% kept and 20% held out. Run A trains through
the method's training script on the training points restricted to the kept labels (points left without a label are
dropped, as the XC readers drop them), then ``add_labels`` appends the held-out labels (their texts and uids). Run B
trains on all labels with the same budget and seed. Both are scored on the full test set over the full label space
(ids matched by uid), on two subsets: ``new`` = the test points with at least one held-out label (P@1, P@5, PSP@5 over
all their labels, and R@10 of the held-out labels alone), and ``all`` = every test point. Propensities come from the
full training targets. Debtags is the bundled dataset, Reuters-21578 (``benchmarks/make_reuters.py``) the check on
data the defaults were not tuned on. Writes benchmarks/results/new_labels.json (``--out``) and, with --update_docs, the
table between the ``<!-- bench:new-labels -->`` lines of docs/new_labels.md; ``--table_only`` re-renders the table of
``--out``.
"""

import json
import os
import sys
import tempfile
import time

import numpy as np
import scipy.sparse as sp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import bench_parser, markdown_table, publish, read_json, result_path, write_json  # noqa: E402
from benchmarks.sweep_defaults import prepare, run_training_script  # noqa: E402

METHOD_ARGS = {"dexml": [], "unidec": [], "prime": []}


def held_out_task(data, held: np.ndarray, out_dir: str) -> None:
    """XC files of ``data`` restricted to the labels not in ``held`` (label ids renumbered, uids kept)."""
    from hf_xmc.data import XMCDataset, write_xc_labels, write_xc_raw

    kept = np.setdiff1d(np.arange(data.num_labels), held)
    os.makedirs(out_dir, exist_ok=True)
    for name, split in (("trn", data.train), ("tst", data.test)):
        targets = split.targets[:, kept].tocsr()
        rows = np.flatnonzero(np.diff(targets.indptr) > 0)
        write_xc_raw(os.path.join(out_dir, f"{name}.json.gz"), XMCDataset(
            texts=[split.texts[i] for i in rows], targets=targets[rows], uids=[split.uids[i] for i in rows]))
    write_xc_labels(os.path.join(out_dir, "lbl.json.gz"), [data.label_uids[i] for i in kept], [data.label_texts[i] for i in kept])


def score(model, data, held: np.ndarray, inv_p: np.ndarray) -> dict:
    """Metrics of ``model`` on the test set over the full label space (the model's ids mapped to the data's by uid)."""
    from hf_xmc.metrics import xmc_metrics

    position = {u: i for i, u in enumerate(data.label_uids)}
    to_data = np.array([position[u] for u in model.label_uids] + [-1])  # -1 keeps empty slots empty
    missing = set(data.label_uids) - set(model.label_uids)
    if missing:
        raise SystemExit(f"the model lacks {len(missing)} labels of the data")
    pred = model.predict(data.test.texts, k=10, batch_size=256)
    topk = to_data[np.where(pred.label_ids >= 0, pred.label_ids, len(to_data) - 1)]
    truth = data.test.targets
    is_new = np.zeros(data.num_labels, dtype=bool)
    is_new[held] = True
    new_points = np.flatnonzero(np.asarray(truth[:, held].sum(axis=1)).ravel() > 0)
    out = {}
    for subset, rows in (("new", new_points), ("all", np.arange(truth.shape[0]))):
        m = xmc_metrics(topk[rows], truth[rows], inv_p, ks=(1, 5), recall_ks=(10,))
        out[subset] = {k: round(float(m[k]), 2) for k in ("P@1", "P@5", "PSP@5", "R@10")}
        out[subset]["points"] = int(len(rows))
    held_truth = truth[new_points].multiply(sp.csr_matrix(is_new.astype(np.float32))).tocsr()
    out["new"]["R@10 of new labels"] = round(float(xmc_metrics(topk[new_points], held_truth, None, ks=(1,), recall_ks=(10,))["R@10"]), 2)
    return out


def new_labels_table(rows: list[dict]) -> str:
    """Per (dataset, method): the added zero-shot model against the retrained one on the new-label points and on all."""
    header = ["dataset", "method", "model", "new-label points", "P@1", "P@5", "PSP@5", "R@10 of new labels", "all points P@1", "PSP@5"]
    cells = []
    for r in rows:
        n, a = r["new"], r["all"]
        cells.append([f"{r['dataset']} ({r['held_out_labels']} of {r['labels']} labels held out)", r["method"], r["model"], n["points"],
                      f"{n['P@1']:.2f}", f"{n['P@5']:.2f}", f"{n['PSP@5']:.2f}", f"{n['R@10 of new labels']:.2f}", f"{a['P@1']:.2f}", f"{a['PSP@5']:.2f}"])
    return markdown_table(header, cells, "lll" + "r" * 7) + "\n"


def main() -> None:
    ap = bench_parser(__doc__, result_path("new_labels.json"), docs_block="new-labels", table_only=True)
    ap.add_argument("--datasets", nargs="+", default=["debtags", "reuters"], choices=["debtags", "reuters", "tiny"])
    ap.add_argument("--methods", nargs="+", default=["dexml", "unidec"], choices=sorted(METHOD_ARGS))
    ap.add_argument("--held_out", type=float, default=0.2)
    ap.add_argument("--extra", default="", help="extra training-script flags for every run (e.g. '--bf16 true')")
    args = ap.parse_args()
    if args.table_only:
        publish(new_labels_table(read_json(args.out)["rows"]), "new-labels", args.update_docs)
        return

    from transformers import AutoModel

    from hf_xmc.data import load_xc_dataset
    from hf_xmc.metrics import inverse_propensity

    rows = []
    with tempfile.TemporaryDirectory() as work:
        for dataset in args.datasets:
            data_dir, encoder, extra = prepare(dataset, work)
            data = load_xc_dataset(f"{data_dir}/trn.json.gz", f"{data_dir}/tst.json.gz", f"{data_dir}/lbl.json.gz")
            rng = np.random.default_rng(0)
            held = np.sort(rng.choice(data.num_labels, int(round(args.held_out * data.num_labels)), replace=False))
            held_dir = os.path.join(work, f"{dataset}-held")
            held_out_task(data, held, held_dir)
            inv_p = inverse_propensity(data.train.targets)  # the training scripts' default constants (0.55 / 1.5)
            for method in args.methods:
                common = extra + ["--seed", "42"] + METHOD_ARGS[method] + args.extra.split()
                out_a, out_b = os.path.join(work, f"{dataset}-{method}-a"), os.path.join(work, f"{dataset}-{method}-b")
                _, seconds_a = run_training_script(method, held_dir, encoder, out_a, common)
                model = AutoModel.from_pretrained(out_a, trust_remote_code=True)
                start = time.perf_counter()
                model.add_labels([data.label_texts[i] for i in held], uids=[data.label_uids[i] for i in held])
                add_seconds = time.perf_counter() - start
                added = score(model, data, held, inv_p)
                _, seconds_b = run_training_script(method, data_dir, encoder, out_b, common)
                retrained = score(AutoModel.from_pretrained(out_b, trust_remote_code=True), data, held, inv_p)
                for name, result, seconds in (("added zero-shot", added, seconds_a), ("retrained with all", retrained, seconds_b)):
                    rows.append({"dataset": dataset, "method": method, "model": name, "held_out_labels": int(len(held)),
                                 "labels": data.num_labels, "train_seconds": round(seconds, 1), **result})
                rows[-2]["add_labels_seconds"] = round(add_seconds, 2)
                print(json.dumps(rows[-2]), json.dumps(rows[-1]), flush=True)
                write_json(args.out, {"held_out": args.held_out, "extra": args.extra, "rows": rows})  # partial results survive
    write_json(args.out, {"held_out": args.held_out, "extra": args.extra, "rows": rows})
    publish(new_labels_table(rows), "new-labels", args.update_docs)


if __name__ == "__main__":
    main()
