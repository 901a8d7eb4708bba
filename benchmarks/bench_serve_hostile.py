#!/usr/bin/env python
"""``hf-xmc serve`` under hostile requests (issue 64): good clients keep asking while another sends non-finite
numbers, 100 MB bodies, image bombs and requests that make the prediction worker fail; the server's memory, every
answer's status and time, and what ``/health`` says are recorded.

    python benchmarks/bench_serve_hostile.py [--seconds 60] [--good_clients 4]

The server is ``hf-xmc serve`` (the CLI, in its own process, over loopback) on a tiny random MUFIN model (text and
image towers, 12 labels: what is measured is the server, not a model), with its default limits except
``--request_timeout 5``. Its ``model.predict`` has faults planted (:func:`with_faults`): a text holding ``PANIC``
raises a ``BaseException`` (what a panic in a native library raises), ``SLEEP:<s>`` sleeps that long. Phases:

1. load: ``--good_clients`` threads send good requests (a text; a text and a 32x32 PNG) back to back, each answer
   compared with the first answer to the same request, while one hostile client sends every hostile kind, round
   after round, for ``--seconds`` (after 3 rounds to warm up); the server's ``VmRSS`` is read after every round and
   ``VmHWM`` (its peak) at the end;
2. stalled: a request that sleeps in ``predict`` past the request timeout: its answer (503 at the timeout) and
   ``/health`` while the worker is stuck (503 ``stalled``) and after (200 ``ok``);
3. SIGTERM with a request in flight: the request's answer and the exit status;
4. a worker that fails for good (a second server, ``--max_worker_restarts 0``): the failing request's answer,
   ``/health``, and the server's exit status.

Writes benchmarks/results/serve_hostile.json (``--out``) and prints a table. ``python bench_serve_hostile.py
serve-with-faults MODEL [serve flags]`` is the server the benchmark and ``tests/test_serving.py`` start.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.harness import bench_parser, markdown_table, result_path, write_json  # noqa: E402


# ------------------------------------------------------------------------------------------------ planted faults
class Panic(BaseException):
    """What a panic in native code (pyo3's ``PanicException``) raises: not an ``Exception``."""


def with_faults(model):
    """Plant faults in ``model.predict`` (in place; returns the model): a text holding ``PANIC`` raises :class:`Panic`,
    one holding ``SLEEP:<seconds>`` sleeps that long first."""
    predict = model.predict

    def faulty(texts, *args, **kwargs):
        for text in texts or ():
            if text and "PANIC" in text:
                raise Panic("simulated panic in the ranker's native code")
            if text and "SLEEP:" in text:
                time.sleep(float(text.split("SLEEP:", 1)[1].split()[0]))
        return predict(texts, *args, **kwargs)

    model.predict = faulty
    return model


def serve_with_faults(argv: list[str]) -> int:
    """``hf-xmc serve`` (``hf_xmc.cli.main``) with :func:`with_faults` planted in the model it loads."""
    from hf_xmc import cli

    load = cli.load_model
    cli.load_model = lambda *args, **kwargs: with_faults(load(*args, **kwargs))
    return cli.main(["serve", *argv])


# ------------------------------------------------------------------------------------------------ hostile payloads
def png_bomb(width: int, height: int, channels: int = 3) -> bytes:
    """A valid PNG of ``width x height`` black pixels, written row by row (its pixels are never held here): a few
    hundred KB that decode to ``width x height x channels`` bytes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    packer, row = zlib.compressobj(9), b"\0" * (1 + width * channels)
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, {1: 0, 3: 2, 4: 6}[channels], 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def small_png(seed: int = 0, size: int = 32) -> bytes:
    """A ``size x size`` PNG of seeded noise (incompressible: cutting it short truncates its pixel data)."""
    import random

    from PIL import Image

    out = io.BytesIO()
    Image.frombytes("RGB", (size, size), random.Random(seed).randbytes(size * size * 3)).save(out, "PNG")
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ------------------------------------------------------------------------------------------------ clients
def post(url: str, body: bytes, timeout: float = 60.0, headers: dict | None = None) -> tuple[int | str, dict | None, float]:
    """POST ``body`` to ``url`` (``http://host:port/path``): (status or the connection fault's name, JSON answer, seconds)."""
    import http.client

    host, port = url.split("//", 1)[1].split("/", 1)[0].split(":")
    path = "/" + url.split("//", 1)[1].split("/", 1)[1]
    start = time.perf_counter()
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"content-type": "application/json", **(headers or {})})
        response = conn.getresponse()
        raw = response.read()
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = {"raw": raw[:200].decode(errors="replace")}
        return response.status, answer, time.perf_counter() - start
    except (OSError, http.client.HTTPException) as err:  # socket.timeout is a hung request: counted as such
        return type(err).__name__, None, time.perf_counter() - start
    finally:
        conn.close()


def get(url: str, timeout: float = 10.0) -> tuple[int | str, dict | None]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
    except OSError as err:
        return type(err).__name__, None


def stream_body(url: str, total: int, chunked: bool, timeout: float = 60.0) -> tuple[int | str, dict | None, float]:
    """Send ``total`` bytes of body (1 MB at a time, never held whole) with a ``Content-Length`` or chunked; the status
    of the answer, or the name of the fault when the server closed the connection first."""
    host, port = url.split("//", 1)[1].split("/", 1)[0].split(":")
    start = time.perf_counter()
    block = b" " * 1_000_000
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        head = f"POST /predict HTTP/1.1\r\nHost: {host}\r\ncontent-type: application/json\r\n"
        head += "transfer-encoding: chunked\r\n\r\n" if chunked else f"content-length: {total}\r\n\r\n"
        try:
            sock.sendall(head.encode())
            sent = 0
            while sent < total:
                piece = block[: total - sent]
                sock.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n" if chunked else piece)
                sent += len(piece)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed before the body ended: read what it said
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                more = sock.recv(65536)
                if not more:
                    break
                data += more
            status_line = data.split(b"\r\n", 1)[0].split()
            if len(status_line) < 2:
                return "ConnectionClosed", None, time.perf_counter() - start
            body = data.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in data else b""
            try:
                answer = json.loads(body) if body else None
            except ValueError:
                answer = None
            return int(status_line[1]), answer, time.perf_counter() - start
        except OSError as err:
            return type(err).__name__, None, time.perf_counter() - start


# ------------------------------------------------------------------------------------------------ the server
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model_dir: str, log_path: str, flags: list[str], timeout: float = 240) -> tuple[subprocess.Popen, str]:
    """``serve-with-faults MODEL --port P FLAGS`` in its own process; returns (process, URL) once ``/health`` answers."""
    port = free_port()
    log = open(log_path, "w+")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=REPO)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve-with-faults", model_dir, "--port", str(port), *flags],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read()[-3000:]}")
        if get(url + "/health", timeout=2)[0] == 200:
            return proc, url
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the server did not answer /health in time")


def vm_field(pid: int, name: str) -> float:
    """``VmRSS`` / ``VmHWM`` of process ``pid`` in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {name} for process {pid}")


def tiny_mufin(directory: str) -> str:
    """A tiny random MUFIN model (DistilBERT text tower, ViT image tower, 12 labels), saved in ``directory``/model."""
    import torch
    from transformers import BertTokenizer, DistilBertConfig, DistilBertModel, ViTConfig, ViTImageProcessor, ViTModel

    from hf_xmc.models import MUFINModel

    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()
    text_dir, vision_dir = os.path.join(directory, "text"), os.path.join(directory, "vision")
    os.makedirs(text_dir, exist_ok=True)
    with open(os.path.join(text_dir, "vocab.txt"), "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    BertTokenizer(vocab=os.path.join(text_dir, "vocab.txt")).save_pretrained(text_dir)
    torch.manual_seed(0)
    DistilBertModel(DistilBertConfig(vocab_size=len(words) + 5, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                     max_position_embeddings=64)).save_pretrained(text_dir)
    ViTModel(ViTConfig(image_size=32, patch_size=16, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64)).save_pretrained(vision_dir)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(vision_dir)
    model = MUFINModel.from_encoders_pretrained(text_dir, vision_dir, label_space_size=len(words), embed_dim=8, attention_heads=2,
                                                shortlist_size=6, max_seq_length=8, label_max_seq_length=8)
    model.set_labels(words, [f"l{i}" for i in range(len(words))])
    model.build_label_index(words, [f"l{i}" for i in range(len(words))])
    out = os.path.join(directory, "model")
    model.save_pretrained(out)
    return out


# ------------------------------------------------------------------------------------------------ the benchmark
def hostile_kinds() -> list[tuple[str, object]]:
    """(name, payload): JSON bytes to POST, or ``("stream", bytes, chunked)`` for a body streamed."""
    bomb = b64(png_bomb(12_000, 12_000))  # 432 MB of RGB pixels in a few hundred KB
    many = [b64(png_bomb(6_000, 6_000, 1))] * 16  # 16 x 36M pixels: each under --max_pixels, the request over it
    noise = small_png(1, 64)
    truncated = noise[: len(noise) // 2]  # its header whole, half its pixel data
    return [
        ("threshold NaN", b'{"texts": ["alpha"], "k": 3, "threshold": NaN}'),
        ("threshold Infinity", b'{"texts": ["alpha"], "k": 3, "threshold": Infinity}'),
        ('threshold "nan"', b'{"texts": ["alpha"], "k": 3, "threshold": "nan"}'),
        ("k NaN", b'{"texts": ["alpha"], "k": NaN}'),
        ("k -Infinity", b'{"texts": ["alpha"], "k": -Infinity}'),
        ("100 MB body, Content-Length", ("stream", 100_000_000, False)),
        ("100 MB body, chunked", ("stream", 100_000_000, True)),
        ("PNG bomb 12000x12000 RGB", json.dumps({"texts": ["alpha"], "images": [[bomb]], "k": 3}).encode()),
        ("16 PNGs of 6000x6000", json.dumps({"texts": ["alpha"], "images": [many], "k": 3}).encode()),
        ("truncated PNG", json.dumps({"texts": ["alpha"], "images": [[b64(truncated)]], "k": 3}).encode()),
        ("JSON nested 100,000 deep", b'{"texts": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        ("PANIC: worker raises a BaseException", b'{"texts": ["alpha PANIC"], "k": 3}'),
    ]


def send(url: str, payload) -> tuple[int | str, dict | None, float]:
    if isinstance(payload, tuple):
        return stream_body(url + "/predict", payload[1], payload[2])
    return post(url + "/predict", payload)


def same_answer(answer: dict | None, reference: dict) -> bool:
    """The same labels in the same order, scores within 1e-5 (a batch's padding moves them in the last float bits)."""
    if not answer or "predictions" not in answer:
        return False
    rows, ref = answer["predictions"], reference["predictions"]
    return len(rows) == len(ref) and all(
        [r["id"] for r in a] == [r["id"] for r in b] and all(abs(x["score"] - y["score"]) <= 1e-5 for x, y in zip(a, b))
        for a, b in zip(rows, ref))


def load_phase(url: str, pid: int, seconds: float, good_clients: int) -> dict:
    """Good clients back to back while one hostile client sends every hostile kind, round after round, for at least
    ``seconds``; the server's RSS after each round."""
    good = [json.dumps({"texts": ["alpha bravo"], "k": 5}).encode(),
            json.dumps({"texts": ["charlie"], "images": [[b64(small_png(3))]], "k": 5}).encode()]
    reference = [post(url + "/predict", body)[1] for body in good]
    assert all(r and "predictions" in r for r in reference), reference
    kinds = hostile_kinds()
    for _ in range(3):  # warm-up: every code path once, before the memory baseline
        for _, payload in kinds:
            send(url, payload)
        for body in good:
            post(url + "/predict", body)
    stop, lock = threading.Event(), threading.Lock()
    good_log: list[tuple[int | str, bool, float]] = []

    def good_client(i: int) -> None:
        n = i
        while not stop.is_set():
            status, answer, took = post(url + "/predict", good[n % 2])
            with lock:
                good_log.append((status, same_answer(answer, reference[n % 2]), took))
            n += 1

    threads = [threading.Thread(target=good_client, args=(i,)) for i in range(good_clients)]
    rss = [round(vm_field(pid, "VmRSS"), 1)]
    for t in threads:
        t.start()
    hostile: dict[str, list] = {name: [] for name, _ in kinds}
    health: list[dict] = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for name, payload in kinds:
            status, answer, took = send(url, payload)
            hostile[name].append((status, (answer or {}).get("error"), took))
            if name.startswith("PANIC"):
                health.append(get(url + "/health"))
        rss.append(round(vm_field(pid, "VmRSS"), 1))
    stop.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    statuses = sorted({str(s) for s, _, _ in good_log})
    took = sorted(g[2] for g in good_log)
    return {
        "seconds": round(wall, 1), "rounds": len(rss) - 1,
        "good": {"clients": good_clients, "requests": len(good_log), "statuses": {s: sum(str(g[0]) == s for g in good_log) for s in statuses},
                 "same_answer": sum(g[1] for g in good_log), "p50_s": round(took[len(took) // 2], 3), "max_s": round(took[-1], 3)},
        "hostile": {name: {"requests": len(v), "statuses": {str(s): sum(str(x) == str(s) for x, _, _ in v) for s in sorted({str(x) for x, _, _ in v})},
                           "first_error": v[0][1], "max_s": round(max(t for _, _, t in v), 3)} for name, v in hostile.items()},
        "health_after_each_panic": {"answers": sorted({str(h[0]) for h in health}),
                                    "status": sorted({(h[1] or {}).get("status", "?") for h in health}),
                                    "worker_restarts_counted": [(h[1] or {}).get("worker_restarts") for h in health][:5] + ["..."]
                                    + [(h[1] or {}).get("worker_restarts") for h in health][-2:]},
        "rss_mib": {"after_warm_up": rss[0], "after_round": {"1": rss[1], "last": rss[-1]}, "min": min(rss), "max": max(rss),
                    "peak_vmhwm": round(vm_field(pid, "VmHWM"), 1), "every_round": rss},
    }


def stall_phase(url: str, timeout: float) -> dict:
    out: dict = {}

    def stuck():
        out["answer"] = post(url + "/predict", json.dumps({"texts": [f"alpha SLEEP:{timeout + 3}"], "k": 3}).encode())
    t = threading.Thread(target=stuck)
    t.start()
    time.sleep(timeout + 1)
    out["health_while_stuck"] = get(url + "/health")
    t.join()
    time.sleep(3)  # the worker finishes its sleep
    out["health_after"] = get(url + "/health")
    status, answer, seconds = out.pop("answer")
    return {"answer": status, "error": (answer or {}).get("error"), "seconds": round(seconds, 2),
            "health_while_stuck": [out["health_while_stuck"][0], (out["health_while_stuck"][1] or {}).get("status")],
            "health_after": [out["health_after"][0], (out["health_after"][1] or {}).get("status")]}


def sigterm_phase(proc: subprocess.Popen, url: str) -> dict:
    out: dict = {}

    def in_flight():
        out["answer"] = post(url + "/predict", json.dumps({"texts": ["alpha SLEEP:2"], "k": 3}).encode())
    t = threading.Thread(target=in_flight)
    t.start()
    time.sleep(0.7)
    start = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    t.join()
    status, answer, _ = out["answer"]
    return {"in_flight_answer": status, "predictions": bool(answer and answer.get("predictions")), "exit_status": code,
            "seconds_to_exit": round(time.perf_counter() - start, 2)}


def dead_phase(model_dir: str, work: str) -> dict:
    proc, url = start_server(model_dir, os.path.join(work, "dead.log"), ["--max_worker_restarts", "0"])
    status, answer, seconds = post(url + "/predict", b'{"texts": ["alpha PANIC"], "k": 3}')
    start = time.perf_counter()
    code = proc.wait(timeout=60)
    with open(os.path.join(work, "dead.log")) as f:
        last = [line for line in f.read().splitlines() if line.startswith("hf-xmc serve:")]
    return {"answer": status, "error": (answer or {}).get("error"), "exit_status": code,
            "seconds_to_exit": round(time.perf_counter() - start, 2), "stderr": last[-1] if last else None}


def table(result: dict) -> str:
    load = result["load"]
    g = load["good"]
    rows = [[f"good ({g['clients']} clients, back to back)", g["requests"], ", ".join(f"{k}: {v}" for k, v in g["statuses"].items()),
             f"{g['same_answer']} the same ranking as alone", g["max_s"]]]
    for name, h in load["hostile"].items():
        rows.append([name, h["requests"], ", ".join(f"{k}: {v}" for k, v in h["statuses"].items()), (h["first_error"] or "")[:80], h["max_s"]])
    rss = load["rss_mib"]
    lines = [f"load: {load['seconds']} s, {load['rounds']} rounds of every hostile kind; {result['cpu']}, {result['cpu_count']} CPUs", "",
             markdown_table(["requests", "sent", "answers", "first answer", "slowest s"], rows), "",
             f"server RSS MiB: {rss['after_warm_up']} after the warm-up, {rss['after_round']['1']} after round 1, {rss['after_round']['last']} "
             f"after the last; {rss['min']}-{rss['max']} over the rounds, peak (VmHWM) {rss['peak_vmhwm']}",
             f"/health after each PANIC: {load['health_after_each_panic']}",
             f"stalled worker: {result['stalled']}", f"SIGTERM in flight: {result['sigterm']}", f"worker dead for good: {result['dead']}"]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve-with-faults":
        sys.exit(serve_with_faults(sys.argv[2:]))
    parser = bench_parser(__doc__, result_path("serve_hostile.json"))
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the load phase runs (whole rounds)")
    parser.add_argument("--good_clients", type=int, default=4)
    parser.add_argument("--request_timeout", type=float, default=5.0)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="serve-hostile-")
    model_dir = tiny_mufin(work)
    proc, url = start_server(model_dir, os.path.join(work, "server.log"), ["--request_timeout", str(args.request_timeout)])
    try:
        result = {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "model": "tiny random MUFIN (12 labels)",
                  "request_timeout": args.request_timeout, "command": "python benchmarks/bench_serve_hostile.py " + " ".join(sys.argv[1:])}
        result["load"] = load_phase(url, proc.pid, args.seconds, args.good_clients)
        result["health_end_of_load"] = get(url + "/health")[1]
        result["stalled"] = stall_phase(url, args.request_timeout)
        result["sigterm"] = sigterm_phase(proc, url)
    finally:
        if proc.poll() is None:
            proc.kill()
    result["dead"] = dead_phase(model_dir, work)
    write_json(args.out, result, sort_keys=False)
    print(table(result))


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "unknown")
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
