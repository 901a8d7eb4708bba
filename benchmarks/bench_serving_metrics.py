#!/usr/bin/env python
"""What ``/metrics`` costs a request of ``hf-xmc serve``: the request-counting ASGI middleware, the batch counter and
the four stage observations of a text model's ranking, timed in-process against the same ASGI app without them.

    python benchmarks/bench_serving_metrics.py [--requests 200000]

An HTTP round trip over loopback varies by more than this overhead from one request to the next, so it is measured
where it happens: an ASGI app that answers 200 at once, called ``--requests`` times directly (scope, receive, send)
with and without ``request_metrics`` around it, plus one ``batch()`` (with its request's queue wait), four ``stage()``
and one ``predicted()`` call per request (what the worker adds for a batch of one); best of 5 rounds each, interleaved. Writes
``benchmarks/results/serving_metrics_overhead.json``; the goal (issue 66): under 0.1 ms a request.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import bench_parser, cpu_name, result_path, write_json  # noqa: E402
from hf_xmc.serving_metrics import ServingMetrics, request_metrics  # noqa: E402


async def answer(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


async def drive(app, requests: int, metrics: ServingMetrics | None) -> float:
    scope = {"type": "http", "path": "/predict", "method": "POST", "headers": []}

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        return None

    start = time.perf_counter()
    for _ in range(requests):
        await app(scope, receive, send)
        if metrics is not None:  # what the worker adds for a batch of one
            metrics.batch(1, (0.0001,))  # the batch and its request's queue wait
            for stage in ("tokenise", "encode", "search", "fuse"):
                metrics.stage(stage, 0.001)
            metrics.predicted(0.004)
    return time.perf_counter() - start


def measure(requests: int, rounds: int = 5) -> dict:
    metrics = ServingMetrics()
    counted = request_metrics(answer, metrics)
    plain, with_metrics = [], []
    for _ in range(rounds):  # interleaved: the machine's load drifts alike for both
        plain.append(asyncio.run(drive(answer, requests, None)))
        with_metrics.append(asyncio.run(drive(counted, requests, metrics)))
    base, full = min(plain) / requests, min(with_metrics) / requests
    render_start = time.perf_counter()
    metrics.render({"hf_xmc_queue_depth": ("", 0)})
    return {"requests": requests, "rounds": rounds, "plain_us": round(base * 1e6, 3), "with_metrics_us": round(full * 1e6, 3),
            "overhead_us": round((full - base) * 1e6, 3), "render_ms": round((time.perf_counter() - render_start) * 1e3, 3),
            "cpu": cpu_name(), "load_1min": round(os.getloadavg()[0], 2)}


def main(argv=None) -> dict:
    ap = bench_parser(__doc__, result_path("serving_metrics_overhead.json"))
    ap.add_argument("--requests", type=int, default=200_000)
    args = ap.parse_args(argv)
    result = measure(args.requests)
    write_json(args.out, result)
    print(f"per request: {result['plain_us']:.2f} us without metrics, {result['with_metrics_us']:.2f} us with: "
          f"+{result['overhead_us']:.2f} us ({result['cpu']}, load {result['load_1min']}); /metrics renders in {result['render_ms']:.2f} ms")
    return result


if __name__ == "__main__":
    main()
