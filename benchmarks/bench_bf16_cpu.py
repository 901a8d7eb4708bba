#!/usr/bin/env python
"""Whether bfloat16 autocast pays on this CPU: all-MiniLM-L6-v2's encoding pass and training step, float32 against
bfloat16 autocast, interleaved in one process.

    python benchmarks/bench_bf16_cpu.py [--threads 2] [--rounds 5] [--out F]

What ``--bf16 auto`` and ``--mining_precision auto`` decide from (``hf_xmc.training.negatives.cpu_multiplies_bf16``:
the CPU flags ``amx_bf16`` or ``avx512_bf16``). The two passes each training run makes: an **encoding pass** (the
hard-negative mining's and cluster batching's: 512 queries in batches of 64, no gradient, dynamic padding) and a
**training step** (a batch of 64 queries padded to 32 tokens: forward, an in-batch softmax over the batch's
similarities, backward, AdamW). Each is timed twice in a row per round, float32 then bfloat16, for ``--rounds``
rounds after one warm-up of each; the table gives the best round of each and the ratio of the bests (a ratio of two
figures measured side by side, the one a shared machine lets through). Queries are Debtags' first training titles.
Writes benchmarks/results/bf16_cpu.json (``--out``): the CPU's model name and bf16 flags, threads, the 1-minute load.
"""

from __future__ import annotations

import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import bench_parser, cpu_name, markdown_table, measured_or_read, result_path  # noqa: E402

BATCH = 64
QUERIES = 512
MAX_LENGTH = 32


def measure(threads: int, rounds: int) -> dict:
    import torch
    from transformers import AutoModel, AutoTokenizer

    from benchmarks.sweep_defaults import minilm
    from hf_xmc.data import load_debtags
    from hf_xmc.training.negatives import cpu_bf16_flags

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(minilm())
    model = AutoModel.from_pretrained(minilm())
    texts = list(load_debtags().train.texts[:QUERIES])
    step_batch = tokenizer(texts[:BATCH], padding="max_length", truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def encode(bf16: bool) -> None:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            for start in range(0, len(texts), BATCH):
                batch = tokenizer(texts[start : start + BATCH], padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
                model(**batch).last_hidden_state.mean(1)

    def step(bf16: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            vectors = torch.nn.functional.normalize(model(**step_batch).last_hidden_state.mean(1), dim=-1)
            loss = torch.nn.functional.cross_entropy(vectors @ vectors.T * 20, torch.arange(BATCH))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    rows = []
    for name, run in (("encoding pass (512 queries)", encode), ("training step (batch 64)", step)):
        for bf16 in (False, True):
            run(bf16)  # warm-up: the kernels' first calls
        seconds: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(rounds):
            for bf16 in (False, True):
                start = time.perf_counter()
                run(bf16)
                run(bf16)
                seconds[bf16].append((time.perf_counter() - start) / 2)
        rows.append({"pass": name, "float32_s": round(min(seconds[False]), 4), "bfloat16_s": round(min(seconds[True]), 4),
                     "speedup": round(min(seconds[False]) / min(seconds[True]), 2),
                     "float32_rounds": [round(x, 4) for x in seconds[False]], "bfloat16_rounds": [round(x, 4) for x in seconds[True]]})
    return {"cpu": cpu_name(), "bf16_flags": list(cpu_bf16_flags()), "threads": threads, "rounds": rounds, "torch": torch.__version__,
            "load_1min": round(os.getloadavg()[0], 2), "date": time.strftime("%Y-%m-%d"), "rows": rows}


def table(result: dict) -> str:
    cells = [[r["pass"], f"{r['float32_s'] * 1000:.0f}", f"{r['bfloat16_s'] * 1000:.0f}", f"{r['speedup']:.2f}x"] for r in result["rows"]]
    flags = ", ".join(result["bf16_flags"]) or "none"
    return (f"{result['cpu']} (bf16 flags: {flags}), {result['threads']} thread(s), best of {result['rounds']} rounds, "
            f"load {result['load_1min']}, {result['date']}\n\n"
            + markdown_table(["pass", "float32 ms", "bfloat16 ms", "speed-up"], cells, "lrrr") + "\n")


def main(argv=None) -> dict:
    ap = bench_parser(__doc__, result_path("bf16_cpu.json"), table_only=True)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    result = measured_or_read(args, lambda: measure(args.threads, args.rounds))
    print(table(result))
    return result


if __name__ == "__main__":
    main()
