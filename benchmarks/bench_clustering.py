#!/usr/bin/env python
"""Clustering benchmark: wall time of ``balanced_2means_tree`` (NGAME cluster batching) on random unit vectors.

    python benchmarks/bench_clustering.py [--sizes 100000 1000000] [--dim 384] [--cluster_sizes 4 64] [--threads 2]

Each configuration runs in its own subprocess, so the reported peak RSS (``ru_maxrss``: input array + working set)
belongs to that configuration alone. The number of clusters is the sampler's ``2^ceil(log2(n / cluster_size))``
(1M points at cluster size 4 -> 2^18 clusters). Writes ``benchmarks/results/clustering.json`` (``--out``) and prints
a markdown table. Random Gaussian data is the worst case for the 2-means iterations (no structure, so most splits
run the full ``max_iter`` rounds); real embeddings converge faster.
"""

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.harness import bench_parser, markdown_table, result_path, write_json  # noqa: E402


def num_clusters_for(n: int, cluster_size: int) -> int:
    """Power-of-two cluster count the sampler uses for ``n`` points and a target cluster size."""
    return 2 ** max(0, math.ceil(math.log2(n / cluster_size)))


def run_one(n: int, dim: int, num_clusters: int, threads: int, seed: int) -> dict:
    """Time one clustering in this process and return its measurements."""
    import resource

    import numpy as np
    import torch

    from hf_xmc.training.clustering import balanced_2means_tree

    torch.set_num_threads(threads)
    x = np.random.default_rng(seed).standard_normal((n, dim), dtype=np.float32)
    load_before = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    assign = balanced_2means_tree(x, num_clusters, seed=seed)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    counts = np.bincount(assign, minlength=num_clusters)
    return {
        "n": n,
        "d": dim,
        "clusters": int(counts.size),
        "seconds": round(seconds, 2),
        "cpu_seconds": round(cpu_seconds, 2),
        "max_cluster_size": int(counts.max()),
        "min_cluster_size": int(counts.min()),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "load_avg_1m_before": round(load_before, 2),
        "torch_threads": threads,
    }


def clustering_table(rows: list[dict]) -> str:
    """Markdown table of the measurements."""
    return markdown_table(
        ["n", "d", "clusters", "seconds", "max / min cluster size", "peak RSS (GiB)"],
        [[f"{r['n']:,}", r["d"], f"{r['clusters']:,}", f"{r['seconds']:.1f}", f"{r['max_cluster_size']} / {r['min_cluster_size']}",
          f"{r['peak_rss_gib']:.2f}"] for r in rows],
        "rrrrrr",
    )


def main() -> None:
    """Run every configuration in a subprocess, print the table and write the JSON results."""
    ap = bench_parser(__doc__, result_path("clustering.json"))
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--cluster_sizes", type=int, nargs="+", default=[4, 64])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--one", type=int, nargs=2, metavar=("N", "NUM_CLUSTERS"), help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.one:
        print(json.dumps(run_one(args.one[0], args.dim, args.one[1], args.threads, args.seed)))
        return

    rows = []
    for n in args.sizes:
        for size in args.cluster_sizes:
            k = num_clusters_for(n, size)
            cmd = [sys.executable, os.path.abspath(__file__), "--one", str(n), str(k), "--dim", str(args.dim),
                   "--threads", str(args.threads), "--seed", str(args.seed)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO})
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["target_cluster_size"] = size
            rows.append(row)
            print(f"n={n:,} clusters={k:,}: {row['seconds']:.1f}s", file=sys.stderr, flush=True)

    import torch

    result = {
        "benchmark": "balanced_2means_tree on standard-normal float32 vectors (cosine), max_iter=20, tol=1e-4",
        "machine": {"cpus": os.cpu_count(), "torch_threads": args.threads, "python": platform.python_version(),
                    "torch": torch.__version__, "processor": platform.processor() or platform.machine()},
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    write_json(args.out, result, sort_keys=False)
    print(clustering_table(rows))


if __name__ == "__main__":
    main()
