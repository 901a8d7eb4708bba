#!/usr/bin/env python
"""Debtags benchmark: the quickstart's numbers (zero-shot vs trained DEXML, train time, predict queries/s) next to
the peers a user would pick instead (Omikuji and napkinXC on TF-IDF, and the lexical TF-IDF zero-shot baseline),
all on the same bundled split.

    python benchmarks/bench_debtags.py [--num_train_epochs 1.0] [--update_docs]

Writes benchmarks/results/debtags.json (``--out``) and the table beside it (benchmarks/results/debtags.md); with
--update_docs it also replaces the table between the ``<!-- bench:debtags -->`` lines of docs/benchmarks.md.
``--table_only`` re-renders the table of ``--out``.
"""

import os
import platform
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.harness import bench_parser, publish, read_json, result_path, write_json, write_text  # noqa: E402
from benchmarks.peers import peers_table, run_peers  # noqa: E402

#: the peers beside the quickstart: Omikuji with Parabel's and Bonsai's settings, napkinXC's PLT, PECOS XR-Linear
#: (in its own interpreter: ``.venv-pecos``, see peers.py; the run stops with the command that makes it when missing) and the
#: label-text TF-IDF zero-shot
PEERS = ("omikuji", "omikuji_bonsai", "napkinxc", "xr_linear", "zeroshot")


def measure(args) -> dict:
    """The quickstart (trained and zero-shot DEXML) and the peers on Debtags."""
    import torch

    from hf_xmc import quickstart
    from hf_xmc.data import load_debtags

    qs_argv = ["--output_dir", args.output_dir, "--num_examples", "0"]
    if args.num_train_epochs is not None:
        qs_argv += ["--num_train_epochs", str(args.num_train_epochs)]
    qs_args = quickstart.parse_args(qs_argv)
    start = time.perf_counter()
    qs = quickstart.run(qs_args)
    job_seconds = time.perf_counter() - start
    n_test = len(load_debtags().test)

    def ours(name, metrics, train_seconds):
        return {
            "method": name,
            "metrics": {k[len("test_"):]: v for k, v in metrics.items() if k.startswith("test_")},
            "train_seconds": train_seconds,
            "predict_queries_per_second": metrics["test_samples_per_second"],
        }

    rows = [
        ours("hf_xmc DEXML, all-MiniLM-L6-v2, trained", qs["trained"], qs["train_runtime"]),
        ours("hf_xmc zero-shot all-MiniLM-L6-v2 (untrained)", qs["zero_shot"], 0.0),
    ]
    rows += run_peers(load_debtags(), k=100, threads=args.threads, seed=0, only=PEERS)
    return {
        "dataset": f"Debtags (bundled): {n_test} test points",
        "quickstart_args": qs["args"],
        "quickstart_wall_seconds": job_seconds,
        "rows": rows,
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
                    "torch": torch.__version__},
    }


def rerun_peers(result: dict, threads: int) -> dict:
    """``result`` with its peer rows measured again (:data:`PEERS`), the hf_xmc rows kept: the peers take seconds,
    the quickstart minutes."""
    from hf_xmc.data import load_debtags

    ours = [r for r in result["rows"] if r["method"].startswith("hf_xmc")]
    return dict(result, rows=ours + run_peers(load_debtags(), k=100, threads=threads, seed=0, only=PEERS))


def debtags_table(result: dict) -> str:
    """The peers table of ``result``'s rows and a note on the quickstart's budget and what the timings include."""
    qs_args = result["quickstart_args"]
    note = (f"\nQuickstart wall time {result['quickstart_wall_seconds']:.0f} s on {result['machine']['cpus']} CPU cores "
            f"({qs_args['num_train_epochs']} epoch(s), batch {qs_args['per_device_train_batch_size']}, "
            f"lr {qs_args['learning_rate']}). Train s / predict q/s of the peers include TF-IDF featurisation; "
            "ours include tokenisation, encoding and index search.\n")
    return peers_table(result["rows"]) + note


def main() -> None:
    ap = bench_parser(__doc__, result_path("debtags.json"), docs_block="debtags", table_only=True)
    ap.add_argument("--num_train_epochs", type=float, default=None, help="default: the quickstart's")
    ap.add_argument("--output_dir", default=os.path.join(REPO, "outputs", "bench-debtags-dexml"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peers_only", action="store_true", help="measure the peers again, keep the hf_xmc rows of --out")
    args = ap.parse_args()
    if args.table_only:
        publish(debtags_table(read_json(args.out)), "debtags", args.update_docs)
        return
    result = rerun_peers(read_json(args.out), args.threads) if args.peers_only else measure(args)
    write_json(args.out, result)
    table = debtags_table(result)
    write_text(os.path.splitext(args.out)[0] + ".md", table)
    publish(table, "debtags", args.update_docs)


if __name__ == "__main__":
    main()
