#!/usr/bin/env python
"""GradCache benchmark: peak memory against batch size at a fixed chunk size, and throughput cached vs uncached.

    python benchmarks/bench_gradcache.py [--chunk_size 64] [--memory_batches 64 1024] [--speed_batches 64 256]

A random BERT (hidden 256, 4 layers, 4 heads, vocab 30522, no download) embeds B queries and B labels of 32
tokens (masked mean pooling, L2-normalised); the loss is DecoupledSoftmax over the in-batch pool (B x B, tau
0.05). One step = forward + backward of that loss (no optimizer). GradCache: Gao et al., 2021; DEXML (Gupta et
al., ICLR 2024) B.5.

Every configuration runs in a fresh subprocess so that its memory is its own. On CUDA the peak is
``torch.cuda.max_memory_allocated``. On CPU it is the peak resident set size, sampled every 2 ms by a thread
(``/proc/self/statm``) while the timed steps run, with glibc's mmap threshold pinned
(``MALLOC_MMAP_THRESHOLD_``) so that freed tensors leave the RSS at once; "over set-up" subtracts the memory
held before the first full step (weights, inputs, gradients allocated by one tiny warm-up step). Throughput is
B / (fastest step), the steady figure on a CPU shared with other jobs; the mean is in the JSON.

Writes benchmarks/results/gradcache.json (``--out``) and prints markdown tables; the CUDA figures of an H100 run
are in benchmarks/results/gradcache_cuda.json.
"""

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.harness import bench_parser, markdown_table, result_path, write_json  # noqa: E402

SEQ_LEN, TAU = 32, 0.05


def _rss_mib() -> float:
    """Current resident set size of this process, MiB (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mib() -> float:
    """Peak resident set size of this process so far, MiB (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class RssSampler:
    """Background thread recording the largest RSS seen between ``start()`` and ``stop()`` (MiB)."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.peak, self._stop = interval, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_mib())
            time.sleep(self.interval)

    def start(self) -> "RssSampler":
        self.peak = _rss_mib()
        self._thread.start()
        return self

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mib())
        return self.peak


def worker(batch: int, cached: bool, chunk_size: int, steps: int, warmup: int, threads: int) -> dict:
    """Run one configuration in this process and return its timings and peak memory."""
    import torch
    from transformers import BertConfig, BertModel

    from hf_xmc.models.xmc_losses import decoupled_softmax_loss
    from hf_xmc.training.gradcache import cached_loss

    torch.set_num_threads(threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024, max_position_embeddings=64
    )
    model = BertModel(config, add_pooling_layer=False).to(device).train()

    def group(seed: int, rows: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(5, config.vocab_size, (rows, SEQ_LEN), generator=gen)
        return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}

    def embed(chunk: dict) -> torch.Tensor:
        hidden = model(**chunk).last_hidden_state
        mask = chunk["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    def step(queries: dict, labels: dict) -> float:
        targets = torch.eye(queries["input_ids"].shape[0], dtype=torch.bool, device=device)

        def loss_fn(q: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
            return decoupled_softmax_loss(q @ lab.T / TAU, targets)

        model.zero_grad(set_to_none=False)
        if cached:
            loss = cached_loss(embed, [queries, labels], loss_fn, chunk_size)
        else:
            loss = loss_fn(embed(queries), embed(labels))
        loss.backward()
        return loss.item()

    step(group(90, 2), group(91, 2))  # allocates the gradients, loads the kernels
    queries, labels = group(1, batch), group(2, batch)
    for _ in range(warmup):
        step(queries, labels)
    sampler = None
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = _rss_mib()
        sampler = RssSampler().start()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = step(queries, labels)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else sampler.stop()
    return {
        "batch": batch, "cached": cached, "chunk_size": chunk_size if cached else None, "steps": steps,
        "warmup": warmup, "threads": threads, "device": device, "step_seconds": times,
        "queries_per_s": batch / min(times), "queries_per_s_mean": batch * steps / sum(times),
        "peak_mib": peak, "peak_delta_mib": peak - base, "peak_rss_lifetime_mib": _peak_rss_mib(),
        "memory_metric": "cuda max_memory_allocated" if device == "cuda" else "peak RSS (2 ms sampling)",
        "loss": loss,
    }


def run_config(batch: int, cached: bool, args: argparse.Namespace, steps: int, warmup: int) -> dict:
    """Run :func:`worker` in a fresh Python process and parse its JSON line."""
    spec = json.dumps({"batch": batch, "cached": cached, "chunk_size": args.chunk_size, "steps": steps,
                       "warmup": warmup, "threads": args.threads})
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 17))  # large tensors are mmapped, so frees shrink the RSS
    proc = subprocess.run([sys.executable, __file__, "--worker", spec], capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {spec} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"  {'cached' if cached else 'uncached':8s} B={batch:5d}: {min(result['step_seconds']):.2f} s/step (min), "
          f"{result['queries_per_s']:.1f} q/s, peak {result['peak_mib']:.0f} MiB (+{result['peak_delta_mib']:.0f})",
          flush=True)
    return result


def main() -> None:
    ap = bench_parser(__doc__, result_path("gradcache.json"))
    ap.add_argument("--chunk_size", type=int, default=64)
    ap.add_argument("--memory_batches", type=int, nargs="+", default=[64, 1024])
    ap.add_argument("--speed_batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per throughput configuration")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run (1: steadier on a shared CPU)")
    ap.add_argument("--skip_uncached_memory", action="store_true", help="skip the uncached run at the largest batch")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(**json.loads(args.worker))))
        return

    t0 = time.time()
    print("throughput (cached vs uncached):", flush=True)
    speed = [run_config(b, c, args, steps=args.steps, warmup=0) for b in args.speed_batches for c in (True, False)]
    print(f"memory (chunk size {args.chunk_size}):", flush=True)
    known = {(r["batch"], r["cached"]): r for r in speed}
    largest = max(args.memory_batches)
    memory = []
    for cached in (True, False):
        for b in args.memory_batches:
            if (b, cached) in known:
                memory.append(known[(b, cached)])
            elif cached or (b == largest and not args.skip_uncached_memory):
                memory.append(run_config(b, cached, args, steps=1, warmup=0))

    small, large = min(args.memory_batches), max(args.memory_batches)
    by = {(r["batch"], r["cached"]): r for r in memory + speed}
    ratio_total = by[(large, True)]["peak_mib"] / by[(small, True)]["peak_mib"]
    ratio_delta = by[(large, True)]["peak_delta_mib"] / by[(small, True)]["peak_delta_mib"]
    import torch

    report = {
        "encoder": "random BertModel: hidden 256, 4 layers, 4 heads, intermediate 1024, vocab 30522, seq len 32",
        "loss": "DecoupledSoftmax over the B x B in-batch pool, tau 0.05",
        "chunk_size": args.chunk_size, "threads": args.threads, "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name() if memory[0]["device"] == "cuda" else None,
        "platform": platform.platform(), "processor": platform.processor(),
        "memory": memory, "throughput": speed,
        "memory_ratio_total": ratio_total, "memory_ratio_delta": ratio_delta,
        "memory_ratio_batches": [small, large], "wall_seconds": time.time() - t0,
    }
    write_json(args.out, report)

    print()
    print(f"Peak memory, chunk size {args.chunk_size} ({memory[0]['memory_metric']}, device {memory[0]['device']}):\n")
    print(markdown_table(["batch", "mode", "peak MiB", "peak over set-up MiB"],
                         [[r["batch"], "cached" if r["cached"] else "uncached", f"{r['peak_mib']:.0f}", f"{r['peak_delta_mib']:.0f}"] for r in memory],
                         "rlrr"))
    print(f"\nratio B={large} / B={small} (cached): {ratio_total:.2f}x total, {ratio_delta:.2f}x over set-up\n")
    speed_rows = []
    for b in args.speed_batches:
        c, u = by[(b, True)], by[(b, False)]
        speed_rows.append([b, f"{c['queries_per_s']:.1f}", f"{u['queries_per_s']:.1f}", f"{c['queries_per_s'] / u['queries_per_s']:.2f}"])
    print(markdown_table(["batch", "cached q/s", "uncached q/s", "cached / uncached"], speed_rows, "rrrr"))
    print(f"\nwrote {os.path.relpath(args.out, REPO)} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
