#!/usr/bin/env python
"""The Spaces demo under load: rounds of concurrent requests through ``gradio_client``, errors, latency and the
server's memory after each round.

    python benchmarks/bench_space_load.py [--model DIR] [--concurrent 50] [--rounds 3] [--update_docs]

``spaces/app.py`` runs as on a Space (``python app.py`` in a process where hf_xmc cannot be imported: the model
directory brings its own code), on ``--model`` or, by default, a tiny random DEXML model over a planted 40-label task
(``tests/tiny.py``): what is measured is the app and Gradio's queue, not a model. Each round submits
``--concurrent`` requests at once (different texts, k = 5) and waits for all; the server's resident memory
(``VmRSS``) is read after the warm-up and after every round: flat memory is the same figure round after round.
Writes benchmarks/results/space_load.json (``--out``) and, with --update_docs, the table between the
``<!-- bench:space-load -->`` lines of docs/reliability.md; ``--table_only`` re-renders the table of ``--out``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from concurrent.futures import wait

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import bench_parser, markdown_table, publish, read_json, result_path, write_json  # noqa: E402

APP_FILE = os.path.join(REPO, "spaces", "app.py")
SERVE = textwrap.dedent(
    """
    import runpy, sys
    sys.modules["hf_xmc"] = None  # as on a Space: hf_xmc is not installed, the model directory brings its own code
    runpy.run_path(sys.argv[1], run_name="__main__")  # the Space's entry point: demo.launch()
    """
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_space(model_dir: str, log_path: str, timeout: float = 180) -> tuple[subprocess.Popen, str]:
    """``python spaces/app.py`` serving ``model_dir`` (hf_xmc not importable); returns (process, URL) once it answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_XMC_MAX_") and k != "HF_XMC_REVISION"}
    env.update(HF_XMC_MODEL=model_dir, GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port), GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1")
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-c", SERVE, APP_FILE], cwd=os.path.dirname(log_path), env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"spaces/app.py exited with code {proc.returncode}:\n{log.read()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return proc, url
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"spaces/app.py did not answer on {url} within {timeout:.0f} s")
        time.sleep(0.25)


def rss_mib(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (``VmRSS`` of /proc/PID/status)."""
    return int(_status_field(pid, "VmRSS").split()[0]) / 1024


def num_threads(pid: int) -> int:
    """Threads of process ``pid`` (Gradio runs each request in a worker thread of a pool of up to 40)."""
    return int(_status_field(pid, "Threads"))


def _status_field(pid: int, name: str) -> str:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return line.split(":", 1)[1].strip()
    raise RuntimeError(f"no {name} for process {pid}")


def fire_concurrent(client, texts: list[str], k: int) -> tuple[list, list[float], list[str]]:
    """Submit one ``/predict`` request per text at once and wait for all: (results in order, seconds from the first
    submission to each request's result, error messages)."""
    start = time.perf_counter()
    done: dict[int, float] = {}
    jobs = []
    for i, text in enumerate(texts):
        jobs.append(client.submit(text, k, api_name="/predict"))
        jobs[-1].add_done_callback(lambda _, i=i: done.__setitem__(i, time.perf_counter() - start))
    wait(jobs, timeout=600)
    results, seconds, errors = [], [], []
    for i, job in enumerate(jobs):
        try:
            results.append(job.result(timeout=0))
            seconds.append(done.get(i, time.perf_counter() - start))
        except Exception as err:  # noqa: BLE001 - every failure is counted and reported
            results.append(None)
            errors.append(f"{type(err).__name__}: {err}")
    return results, seconds, errors


def tiny_model(directory: str) -> str:
    """A tiny random DEXML model over the planted 40-label task, saved in ``directory``."""
    import torch

    from hf_xmc.models import DEXMLModel
    from tests.tiny import make_tiny_encoder, make_tiny_task

    data, _ = make_tiny_task(os.path.join(directory, "task"))
    encoder = make_tiny_encoder(os.path.join(directory, "encoder"), data)
    torch.manual_seed(0)
    model = DEXMLModel.from_encoder_pretrained(encoder, max_seq_length=16, label_max_seq_length=16)
    model.build_label_index(data.label_texts, data.label_uids)
    out = os.path.join(directory, "model")
    model.save_pretrained(out)
    return out


def space_load_table(result: dict) -> str:
    """One row per round (the warm-up first): requests, errors, timings and the server's memory after it."""
    header = ["round", "requests at once", "errors", "wall (s)", "requests/s", "median answer (s)", "slowest (s)", "server RSS after (MiB)"]
    cells = []
    for row in result["rounds"]:
        if row["round"] == 0:
            cells.append(["warm-up", row["requests"], 0, None, None, None, None, row["rss_mib"]])
        else:
            cells.append([row["round"], row["requests"], row["errors"], row["wall_s"], row["requests_per_s"], str(row["p50_s"]), str(row["max_s"]), row["rss_mib"]])
    return markdown_table(header, cells)


def main() -> None:
    parser = bench_parser(__doc__, result_path("space_load.json"), docs_block="space-load", table_only=True)
    parser.add_argument("--model", default=None, help="Model directory to serve (default: a tiny random DEXML model).")
    parser.add_argument("--concurrent", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.table_only:
        publish(space_load_table(read_json(args.out)), "space-load", args.update_docs)
        return

    from gradio_client import Client

    work = tempfile.mkdtemp(prefix="space-load-")
    model_dir = args.model or tiny_model(work)
    proc, url = start_space(model_dir, os.path.join(work, "server.log"))
    try:
        client = Client(url, verbose=False, analytics_enabled=False)
        texts = [f"query number {i} about packages" for i in range(args.concurrent)]
        fire_concurrent(client, texts[:4], 5)  # warm-up: first requests load lazily imported code
        rows = [{"round": 0, "requests": 4, "errors": 0, "rss_mib": round(rss_mib(proc.pid), 1), "threads": num_threads(proc.pid)}]
        for r in range(1, args.rounds + 1):
            start = time.perf_counter()
            results, seconds, errors = fire_concurrent(client, texts, 5)
            wall = time.perf_counter() - start
            seconds.sort()
            rows.append({
                "round": r, "requests": len(texts), "errors": len(errors), "wall_s": round(wall, 2),
                "requests_per_s": round(len(texts) / wall, 1), "p50_s": round(seconds[len(seconds) // 2], 2) if seconds else None,
                "max_s": round(seconds[-1], 2) if seconds else None, "rss_mib": round(rss_mib(proc.pid), 1), "threads": num_threads(proc.pid), "first_error": errors[0] if errors else None,
            })
            print(json.dumps(rows[-1]), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    result = {"model": "tiny random DEXML (40 labels)" if args.model is None else args.model, "concurrent": args.concurrent,
              "cpu_count": os.cpu_count(), "rounds": rows}
    write_json(args.out, result, sort_keys=False)
    publish(space_load_table(result), "space-load", args.update_docs)


if __name__ == "__main__":
    main()
