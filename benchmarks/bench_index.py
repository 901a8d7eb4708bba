#!/usr/bin/env python
"""The label store and index at LF-AmazonTitles-1.3M scale: 1.3M label vectors of d=384, fp32 and fp16, searched
exactly (``exact`` / ``torch``: chunked matmul over the memory-mapped store), with HNSW and with IVF, and through
compact int8 / binary codes whose best candidates are rescored from an fp16 store (``codes`` of ``LabelIndex``).

    python benchmarks/bench_index.py [--num_labels 1300000] [--dim 384] [--hnsw_max_labels 300000] [--out F]

Per configuration it measures, each phase in a fresh subprocess (peak RSS = ``VmHWM`` of /proc/self/status, minus
the process's RSS after its imports, so it is what the store and index add):

* build: seconds to build the index over the memory-mapped store, seconds and bytes to save it;
* load + search: seconds to load store and index the way ``from_pretrained`` does, warm search latency per call at
  batch 1 and batch 256 (k=100), recall@100 against exact search on 2,000 queries, and the process's peak RSS over
  load and every search, also as a multiple of the bytes of the label vectors in their stored precision.

The vectors are saved with ``save_label_store`` (1 GB shards: the fp32 store at 1.3M is two shards) and loaded with
``load_label_store``, the functions ``save_pretrained`` / ``from_pretrained`` use. Stores are read from the page
cache (written just before), so load times exclude disk reads.

Data: label and query vectors are drawn from one Gaussian mixture in a 48-dim latent space (``L / 100`` clusters with
Zipf-distributed sizes and cluster-specific spreads), mapped into d=384 by a fixed random linear map, plus small
isotropic noise, then L2-normalised. Why not pure Gaussians: they have an intrinsic dimension of d, where every
point is about equally far from every other and no ANN index finds neighbours (recall figures would say nothing);
real sentence embeddings are clustered and anisotropic with a low intrinsic dimension, which the latent mixture
reproduces. Why not encoding ``make_synthetic_xmc`` label texts with a tiny random encoder: 1.3M forward passes cost
tens of minutes on 2 cores, and a random encoder's geometry is no more realistic than the mixture.

HNSW build time grows fast with L and d (beam search per insert); above ``--hnsw_max_labels`` labels HNSW runs on the
first ``hnsw_max_labels`` labels, against exact search over the same labels, and the table says so. Writes
benchmarks/results/index_scale.json (``--out``) and prints a markdown table; ``--update_docs`` writes it between the
``<!-- bench:index_scale -->`` lines of docs/label_index.md, ``--table_only`` re-renders the table of ``--out``.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import bench_parser, markdown_table, publish, read_json, result_path, write_json  # noqa: E402

NUM_QUERIES = 2000
K = 100
LATENT_DIM = 48


def rss_mb(field: str = "VmRSS") -> float:
    """A field of /proc/self/status in MiB (VmRSS: resident now; VmHWM: the peak so far)."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024


def make_vectors(num_labels: int, num_queries: int, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Clustered, anisotropic unit vectors (see the module docstring); labels are drawn 100k rows at a time."""
    rng = np.random.default_rng(seed)
    clusters = max(1, num_labels // 100)
    centres = rng.standard_normal((clusters, LATENT_DIM)).astype(np.float32)
    spread = rng.uniform(0.2, 0.6, clusters).astype(np.float32)
    weights = 1.0 / np.arange(1, clusters + 1) ** 0.8
    weights /= weights.sum()
    mixing = (rng.standard_normal((LATENT_DIM, dim)) / np.sqrt(LATENT_DIM)).astype(np.float32)

    def draw(n: int) -> np.ndarray:
        c = rng.choice(clusters, size=n, p=weights)
        z = centres[c] + spread[c, None] * rng.standard_normal((n, LATENT_DIM), dtype=np.float32)
        x = z @ mixing + 0.05 * rng.standard_normal((n, dim), dtype=np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    labels = np.empty((num_labels, dim), dtype=np.float32)
    for start in range(0, num_labels, 100_000):
        labels[start : start + 100_000] = draw(min(100_000, num_labels - start))
    return labels, draw(num_queries)


def configurations(num_labels: int, hnsw_labels: int) -> list[dict]:
    """Every measured configuration: kind, store precision, label count, build and search parameters."""
    full, sub = num_labels, hnsw_labels
    configs = [
        {"name": "exact", "kind": "exact", "dtype": "float32", "num_labels": full},
        {"name": "torch", "kind": "torch", "dtype": "float32", "num_labels": full},
        {"name": "exact fp16", "kind": "exact", "dtype": "float16", "num_labels": full},
        {"name": "ivf", "kind": "ivf", "dtype": "float32", "num_labels": full, "search": [{"ivf_nprobe": p} for p in (16, 64, 256)]},
        {"name": "ivf fp16", "kind": "ivf", "dtype": "float16", "num_labels": full, "search": [{"ivf_nprobe": p} for p in (16, 64, 256)]},
        # compact codes scanned, their best rescore_factor x k rescored from the store (fp16 here: read only for those)
        {"name": "exact int8", "kind": "exact", "dtype": "float16", "codes": "int8", "num_labels": full,
         "search": [{"rescore_factor": f} for f in (1, 2, 4)]},
        {"name": "exact binary", "kind": "exact", "dtype": "float16", "codes": "binary", "num_labels": full,
         "search": [{"rescore_factor": f} for f in (4, 10, 20)]},
        {"name": "ivf int8", "kind": "ivf", "dtype": "float16", "codes": "int8", "num_labels": full,
         "search": [{"ivf_nprobe": p, "rescore_factor": 2} for p in (64, 128, 256)]},
        {"name": "ivf binary", "kind": "ivf", "dtype": "float16", "codes": "binary", "num_labels": full,
         "search": [{"ivf_nprobe": p, "rescore_factor": 10} for p in (16, 64, 256)]},
    ]
    if sub < full:  # the ground truth of the HNSW subset
        configs.append({"name": f"exact @{sub:,}", "kind": "exact", "dtype": "float32", "num_labels": sub})
    configs += [
        {"name": "hnsw", "kind": "hnsw", "dtype": "float32", "num_labels": sub, "search": [{"hnsw_ef_search": e} for e in (128, 512)]},
        {"name": "hnsw fp16", "kind": "hnsw", "dtype": "float16", "num_labels": sub, "search": [{"hnsw_ef_search": e} for e in (128, 512)]},
    ]
    return configs


# ---------------------------------------------------------------------------------------------- subprocess workers
def _fetcher(store_dir: str):
    return lambda name: os.path.join(store_dir, name) if os.path.exists(os.path.join(store_dir, name)) else None


def worker_build(cfg: dict) -> dict:
    """Build the index over the memory-mapped store and save it into ``cfg['index_dir']``."""
    from hf_xmc.models.label_index import INDEX_FILE, INDEX_META_FILE, LabelIndex
    from hf_xmc.models.label_store import load_label_store

    base = rss_mb()
    blocks = load_label_store(_fetcher(cfg["store_dir"]))
    start = time.perf_counter()
    index = LabelIndex(blocks, kind=cfg["kind"], use_gpu=False, codes=cfg.get("codes", "float"))
    build_s = time.perf_counter() - start
    os.makedirs(cfg["index_dir"], exist_ok=True)
    start = time.perf_counter()
    index.save(cfg["index_dir"])
    save_s = time.perf_counter() - start
    files = [os.path.join(cfg["index_dir"], n) for n in (INDEX_FILE, INDEX_META_FILE)]
    return {
        "build_s": build_s, "index_save_s": save_s,
        "index_bytes": sum(os.path.getsize(p) for p in files if os.path.exists(p)),
        "build_peak_mb": rss_mb("VmHWM") - base, **({"ivf_nlist": index.ivf_nlist} if cfg["kind"] == "ivf" else {}),
    }


def worker_search(cfg: dict) -> dict:
    """Load store and index as ``from_pretrained`` does, then time searches and collect the 2,000 queries' top-100."""
    import torch

    from hf_xmc.models.label_index import INDEX_FILE, INDEX_META_FILE, LabelIndex
    from hf_xmc.models.label_store import load_label_store

    queries = np.load(cfg["queries"])
    base = rss_mb()
    start = time.perf_counter()
    blocks = load_label_store(_fetcher(cfg["store_dir"]))
    meta, faiss_file = os.path.join(cfg["index_dir"], INDEX_META_FILE), os.path.join(cfg["index_dir"], INDEX_FILE)
    index = LabelIndex.load(blocks, meta, faiss_file if os.path.exists(faiss_file) else None, kind=cfg["kind"], use_gpu=False,
                            codes=cfg.get("codes", "float"))
    load_s = time.perf_counter() - start
    vector_bytes = sum(b.numel() * b.element_size() for b in blocks)
    runs = []
    for params in cfg.get("search") or [{}]:
        for name, value in params.items():
            setattr(index, name, value)
        index.search(queries[:256], K)  # warm: the first exact search pages the store in
        start = time.perf_counter()
        for q in queries[:20]:
            index.search(q[None], K)
        batch1_ms = (time.perf_counter() - start) / 20 * 1000
        start = time.perf_counter()
        for s in range(0, 1024, 256):
            index.search(queries[s : s + 256], K)
        batch256_ms = (time.perf_counter() - start) / 4 * 1000
        ids = np.concatenate([index.search(queries[s : s + 256], K)[1] for s in range(0, len(queries), 256)])
        out = cfg["ids_out"] + "".join(f".{k}={v}" for k, v in params.items()) + ".npy"
        np.save(out, ids)
        runs.append({"params": params, "batch1_ms": batch1_ms, "batch256_ms": batch256_ms, "ids": out})
    peak = rss_mb("VmHWM") - base
    return {
        "load_s": load_s, "vector_bytes": vector_bytes, "search_peak_mb": peak, "codes": index.codes,
        "peak_over_vectors": peak * 2**20 / vector_bytes, "runs": runs, "torch_threads": torch.get_num_threads(),
    }


def run_worker(phase: str, cfg: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", phase, json.dumps(cfg)],
        capture_output=True, text=True, cwd=REPO,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{phase} worker for {cfg['name']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------- driver
def recall_at_k(ids: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(a[a >= 0]) & set(b)) / len(b) for a, b in zip(ids, truth)]))


def main(argv=None) -> dict:
    parser = bench_parser(__doc__, result_path("index_scale.json"), docs_block="index_scale", table_only=True)
    parser.add_argument("--num_labels", type=int, default=1_300_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--hnsw_max_labels", type=int, default=300_000, help="HNSW runs on at most this many labels")
    parser.add_argument("--label_shard_size", default="1GB")
    parser.add_argument("--only", nargs="*", help="names of the configurations to run, e.g. 'ivf fp16' (default: all)")
    parser.add_argument("--work_dir", default=None, help="where stores and indexes go (default: a temp dir, removed)")
    parser.add_argument("--in_process", action="store_true",
                        help="run the build and search phases in this process (no per-phase peak memory: for smoke tests)")
    args = parser.parse_args(argv)
    if args.table_only:
        report = read_json(args.out)
        publish(index_table(report["results"]), "index_scale", args.update_docs)
        return report
    run_phase = run_worker if not args.in_process else (lambda phase, cfg: (worker_build if phase == "build" else worker_search)(json.loads(json.dumps(cfg))))

    import torch

    from hf_xmc.models.label_store import save_label_store

    work = args.work_dir or tempfile.mkdtemp(prefix="bench_index_")
    os.makedirs(work, exist_ok=True)
    hnsw_labels = min(args.num_labels, args.hnsw_max_labels)
    configs = configurations(args.num_labels, hnsw_labels)
    if args.only:  # the named ones, after the exact fp32 runs that give their ground truth
        wanted = [c for c in configs if c["name"] in args.only]
        truth = {c["num_labels"] for c in wanted}
        configs = [c for c in configs if c in wanted or (c["kind"] == "exact" and c["dtype"] == "float32" and c["num_labels"] in truth)]
    try:
        start = time.perf_counter()
        labels, queries = make_vectors(args.num_labels, NUM_QUERIES, args.dim)
        print(f"vectors: {labels.shape} in {time.perf_counter() - start:.1f}s", flush=True)
        np.save(os.path.join(work, "queries.npy"), queries)
        stores = {}
        for n, dtype in sorted({(c["num_labels"], c["dtype"]) for c in configs}):
            store_dir = os.path.join(work, f"store-{n}-{dtype}")
            os.makedirs(store_dir, exist_ok=True)
            start = time.perf_counter()
            files = save_label_store(store_dir, torch.from_numpy(labels[:n]), getattr(torch, dtype), args.label_shard_size)
            stores[(n, dtype)] = {
                "dir": store_dir, "files": files, "save_s": time.perf_counter() - start,
                "bytes": sum(os.path.getsize(os.path.join(store_dir, f)) for f in files),
            }
        del labels

        results, truth = [], {}
        for cfg in configs:
            store = stores[(cfg["num_labels"], cfg["dtype"])]
            cfg = {**cfg, "store_dir": store["dir"], "index_dir": os.path.join(work, "index-" + cfg["name"].replace(" ", "_").replace("@", "").replace(",", "")),
                   "queries": os.path.join(work, "queries.npy")}
            cfg["ids_out"] = cfg["index_dir"] + "-ids"
            print(f"== {cfg['name']} ({cfg['num_labels']:,} labels, {cfg['dtype']})", flush=True)
            built = run_phase("build", cfg)
            print(f"   built in {built['build_s']:.1f}s, peak +{built['build_peak_mb']:.0f} MiB", flush=True)
            searched = run_phase("search", cfg)
            for run in searched.pop("runs"):
                ids = np.load(run.pop("ids"))
                if cfg["kind"] == "exact" and cfg["dtype"] == "float32" and cfg["num_labels"] not in truth:
                    truth[cfg["num_labels"]] = ids
                row = {
                    "name": cfg["name"] + "".join(f" {k.split('_', 1)[1]}={v}" for k, v in run["params"].items()),
                    "kind": cfg["kind"], "dtype": cfg["dtype"], "num_labels": cfg["num_labels"], "dim": args.dim,
                    "store_shards": sum(f.endswith(".safetensors") for f in store["files"]), "store_bytes": store["bytes"], "store_save_s": store["save_s"],
                    **built, **searched, **run, "recall@100": recall_at_k(ids, truth[cfg["num_labels"]]),
                }
                results.append(row)
                print(f"   {row['name']}: recall@100 {row['recall@100']:.4f}, batch1 {row['batch1_ms']:.1f} ms, "
                      f"batch256 {row['batch256_ms']:.0f} ms, peak {row['peak_over_vectors']:.2f}x the vectors", flush=True)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)

    report = {
        "command": "python benchmarks/bench_index.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "num_labels": args.num_labels, "dim": args.dim, "num_queries": NUM_QUERIES, "k": K, "hnsw_labels": hnsw_labels,
        "cpu_count": os.cpu_count(), "load_average_at_end": os.getloadavg()[0], "results": results,
    }
    write_json(args.out, report)
    publish(index_table(results), "index_scale", args.update_docs)
    return report


def index_table(results: list[dict]) -> str:
    """The table of docs/label_index.md: one row per configuration and search setting."""
    header = ["index", "labels", "store (files)", "store on disk", "index on disk", "build s", "load s", "batch 1 ms", "batch 256 ms",
              "recall@100", "peak RSS", "peak RSS / vectors"]
    rows = [[r["name"], f"{r['num_labels']:,}", f"{r['dtype'].replace('float', 'fp')} x{r['store_shards']}", f"{r['store_bytes'] / 1e9:.2f} GB",
             f"{r['index_bytes'] / 1e9:.2f} GB", f"{r['build_s']:.0f}", f"{r['load_s']:.1f}", f"{r['batch1_ms']:.1f}", f"{r['batch256_ms']:.0f}",
             f"{r['recall@100']:.3f}", f"{r['search_peak_mb'] / 1024:.2f} GiB", f"{r['peak_over_vectors']:.2f}x"] for r in results]
    return markdown_table(header, rows, "lrlrrrrrrrrr")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        phase, cfg = sys.argv[2], json.loads(sys.argv[3])
        print(json.dumps((worker_build if phase == "build" else worker_search)(cfg)))
    else:
        main()
