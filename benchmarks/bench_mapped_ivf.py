#!/usr/bin/env python
"""One-query search of an IVF index read back memory-mapped, with and without faiss's prefetch threads, against the
same index in memory: what ``label_codes.read_code_index`` turns off.

    python benchmarks/bench_mapped_ivf.py [--num_labels 200000] [--codes int8] [--queries 300] [--rounds 3] [--out F]

A ``LabelIndex(kind="ivf", codes=...)`` over ``bench_index.py``'s clustered synthetic unit vectors (d=384; lists of
~280 labels, as the 1.3M-label models' ``default_ivf_nlist`` makes them; 64 probed, the config's default) is saved and
read back three ways: **in memory** (its lists read in, ``own_inverted_lists``), **mapped** (what ``from_pretrained``
does: the lists stay in the file, ``IO_FLAG_MMAP``, prefetch off) and **mapped + prefetch** (faiss's default for
mapped lists: ``OnDiskInvertedLists.prefetch_nthread`` = 32 threads started on every search to read the probed lists
ahead). Each searches ``--queries`` queries one at a time (k=10, the codes' candidates rescored from the float
vectors), twice in a row (the first pass also maps the pages it touches); the three are interleaved for ``--rounds``
rounds and the best round of each pass is kept. The index file is in the page cache (written just before). Writes
benchmarks/results/mapped_ivf.json (``--out``) with the CPU and the 1-minute load.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.bench_index import make_vectors  # noqa: E402
from benchmarks.harness import bench_parser, cpu_name, markdown_table, measured_or_read, result_path  # noqa: E402

K = 10
LIST_SIZE = 280  # labels a list, as default_ivf_nlist makes them at 1.3M (~4,600 lists)
NPROBE = 64
WAYS = ("in memory", "mapped", "mapped + prefetch")


def measure(num_labels: int, codes: str, num_queries: int, rounds: int) -> dict:
    import faiss

    from hf_xmc.models.label_codes import _mapped_ivf, own_inverted_lists
    from hf_xmc.models.label_index import LabelIndex

    labels, queries = make_vectors(num_labels, num_queries, 384)
    nlist = max(1, num_labels // LIST_SIZE)
    with tempfile.TemporaryDirectory(prefix="mapped_ivf_") as work:
        start = time.perf_counter()
        LabelIndex(labels, kind="ivf", codes=codes, ivf_nlist=nlist, ivf_nprobe=NPROBE).save(work)
        build_s = time.perf_counter() - start
        paths = os.path.join(work, "label_index.json"), os.path.join(work, "label_index.faiss")

        def load(way: str) -> LabelIndex:
            index = LabelIndex.load(labels, *paths)  # mapped, prefetch off (read_code_index)
            if way == "in memory":
                own_inverted_lists(index._index)
            elif way == "mapped + prefetch":
                _mapped_ivf(index._index)[1].prefetch_nthread = 32  # faiss's default
            return index

        indexes = {"in memory": load("in memory")}
        ms: dict[str, dict[str, list[float]]] = {way: {"first": [], "second": []} for way in WAYS}
        for _ in range(rounds):
            for way in WAYS:
                if way != "in memory":  # a fresh mapping each round: the first pass maps its pages again
                    indexes[way] = load(way)
                index = indexes[way]
                for name in ("first", "second"):
                    start = time.perf_counter()
                    for i in range(num_queries):
                        index.search(queries[i : i + 1], K)
                    ms[way][name].append((time.perf_counter() - start) / num_queries * 1000)
        same = all((indexes[way].search(queries, K)[1] == indexes["in memory"].search(queries, K)[1]).all() for way in WAYS)
    rows = [{"way": way, "first_pass_ms": round(min(ms[way]["first"]), 3), "second_pass_ms": round(min(ms[way]["second"]), 3),
             "rounds_ms": {k: [round(x, 3) for x in v] for k, v in ms[way].items()}} for way in WAYS]
    return {"num_labels": num_labels, "codes": codes, "nlist": nlist, "nprobe": NPROBE, "queries": num_queries, "rounds": rounds,
            "k": K, "build_s": round(build_s, 1), "same_results": bool(same), "faiss": faiss.__version__, "cpu": cpu_name(),
            "threads": faiss.omp_get_max_threads(), "load_1min": round(os.getloadavg()[0], 2), "date": time.strftime("%Y-%m-%d"), "rows": rows}


def table(result: dict) -> str:
    cells = [[r["way"], f"{r['first_pass_ms']:.2f}", f"{r['second_pass_ms']:.2f}"] for r in result["rows"]]
    return (f"{result['num_labels']:,} labels, {result['codes']} codes, IVF {result['nlist']:,} lists, {result['nprobe']} probed, "
            f"k={result['k']}; one query a search, best of {result['rounds']} rounds; {result['cpu']}, {result['threads']} threads, "
            f"load {result['load_1min']}, {result['date']}; same results: {result['same_results']}\n\n"
            + markdown_table(["index", "first pass ms / query", "second pass ms / query"], cells, "lrr") + "\n")


def main(argv=None) -> dict:
    ap = bench_parser(__doc__, result_path("mapped_ivf.json"), table_only=True)
    ap.add_argument("--num_labels", type=int, default=200_000)
    ap.add_argument("--codes", default="int8", choices=["float", "int8", "binary"])
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    result = measured_or_read(args, lambda: measure(args.num_labels, args.codes, args.queries, args.rounds))
    print(table(result))
    return result


if __name__ == "__main__":
    main()
