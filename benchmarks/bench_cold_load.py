#!/usr/bin/env python
"""Cold load of a 1.3M-label model with its labels read on demand (``config.labels_file`` recorded, the rows of
``labels.jsonl`` parsed when asked for: ``hf_xmc/models/label_file.py``) against the same directory read whole (the
record removed from ``config.json``: what a model saved before it does).

    python benchmarks/bench_cold_load.py [--rounds 4] [--update_docs]
    BENCH_SERVING_LABELS=100000 python benchmarks/bench_cold_load.py --rounds 1 --out /tmp/c.json   # a quick check

The model is ``bench_serving.py``'s 1.3M int8 directory (all-MiniLM-L6-v2, 1,300,000 synthetic labels with
``bench_index.py``'s clustered vectors, int8 codes, IVF probing 64 lists), built once here. Each round loads each
directory in a fresh process (``bench_serving.cold_load``: transformers imported first and not counted,
``AutoModel.from_pretrained(..., trust_remote_code=True)``, then one query's ``predict``), the two alternating; the
table gives each way's median over the rounds and its parts (``model.load_seconds``), the first predict and the RSS.
Writes benchmarks/results/cold_load.json (``--out``) with the CPU and the 1-minute load.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import bench_parser, cpu_name, markdown_table, publish, read_json, result_path, write_json  # noqa: E402

WAYS = {"on demand": "labels read on demand (the record matches)", "whole": "labels read whole (no record: a model saved before it)"}
PARTS = ("weights", "tokenizer", "labels", "label_store", "label_index", "query_encoders", "checks", "total")


def measure(rounds: int) -> dict:
    from benchmarks.bench_serving import build, cold_load, num_large

    with tempfile.TemporaryDirectory(prefix="cold_load_") as work:
        start = time.perf_counter()
        built = build("1.3m", work, only=["int8-torch"])["int8"]
        build_s = time.perf_counter() - start
        dirs = {"on demand": built["dir"], "whole": os.path.join(work, "whole")}
        shutil.copytree(built["dir"], dirs["whole"])
        config_path = os.path.join(dirs["whole"], "config.json")
        config = json.load(open(config_path))
        if not config.get("labels_file"):
            raise SystemExit(f"{built['dir']}: config.json records no labels_file: the code measured does not read labels on demand")
        del config["labels_file"]
        json.dump(config, open(config_path, "w"), indent=2)
        runs: dict[str, list[dict]] = {way: [] for way in WAYS}
        for _ in range(rounds):
            for way in WAYS:
                runs[way].append(cold_load(dirs[way]))
                print(way, runs[way][-1], flush=True)
        labels_bytes = os.path.getsize(os.path.join(built["dir"], "labels.jsonl"))
    return {"labels": num_large(), "labels_jsonl_bytes": labels_bytes, "build_s": round(build_s, 1), "rounds": rounds, "runs": runs,
            "cpu": cpu_name(), "load_1min": round(os.getloadavg()[0], 2)}


def median_of(runs: list[dict], get) -> float:
    return statistics.median(get(r) for r in runs)


def table(result: dict) -> str:
    cells = []
    for way, what in WAYS.items():
        runs = result["runs"][way]
        parts = [median_of(runs, lambda r, p=p: (r["load_parts_s"] or {}).get(p, 0.0)) for p in PARTS]
        cells.append([what, *(f"{v:.2f}" for v in parts), f"{median_of(runs, lambda r: r['load_s']):.2f}",
                      f"{median_of(runs, lambda r: r['first_predict_s']) * 1000:.0f}", f"{median_of(runs, lambda r: r['rss_loaded_gib']):.2f}"])
    header = ["labels.jsonl", *(f"{p} s" for p in PARTS), "from_pretrained s", "first predict ms", "RSS GiB"]
    note = (f"\n\n{result['labels']:,} labels (`labels.jsonl` {result['labels_jsonl_bytes'] / 2**20:.0f} MiB), medians of {result['rounds']} "
            f"rounds, each a fresh process, the two ways alternating; {result['cpu']}, 1-minute load {result['load_1min']:g} at the end. "
            "`total` is `from_pretrained`'s own clock (`model.load_seconds`); transformers' imports come before it and are not counted.\n")
    return markdown_table(header, cells, "l" + "r" * (len(header) - 1)) + note


def main(argv=None) -> dict:
    ap = bench_parser(__doc__, result_path("cold_load.json"), docs_block="cold_load", table_only=True)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    result = read_json(args.out) if args.table_only else measure(args.rounds)
    if not args.table_only:
        write_json(args.out, result)
    publish(table(result), "cold_load", args.update_docs)
    return result


if __name__ == "__main__":
    main()
