"""``hf-xmc serve``: the endpoint answers as ``predict`` does, batches concurrent requests into one call, refuses bad
input with a 4xx and one line, and the command starts it on a saved model (queried over loopback). Hostile input (issue
64): non-finite numbers, bodies over the limit, image bombs, a full queue, a slow or failing worker are each answered
in bounded time, and ``/health`` says what the worker is doing. ``benchmarks/bench_serve_hostile.py`` is the load
test of the same over a real ``hf-xmc serve``."""

import base64
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from benchmarks.bench_serve_hostile import png_bomb, with_faults
from hf_xmc.models.calibration import ScoreCalibration
from hf_xmc.serving import PredictionBatcher, ServingLimits, create_app
from tests.test_label_store import make_model
from tests.test_mufin_training import task, tiny_model  # noqa: F401 - task: the tiny multimodal task's fixture

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(url: str, body=None, raw: bytes | None = None, timeout: float = 60) -> tuple[int, dict]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"} if data is not None else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@contextlib.contextmanager
def running(app):
    """``app`` behind uvicorn in a thread; yields its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def served(tiny_encoder_dir, tiny_task):
    """The tiny DEXML model behind uvicorn in a thread; batches wait 300 ms for company, so concurrent requests meet."""
    model = make_model(tiny_encoder_dir, tiny_task[0])
    with running(create_app(model, ServingLimits(max_texts=8, max_chars=200, max_k=20), max_batch=64, max_wait_ms=300, wait_for_arrivals=False)) as url:
        yield model, url


def expected(model, texts, k):
    pred = model.predict(texts, k=k)
    return [[(j, pytest.approx(s, abs=1e-5)) for j, s in zip(ids, scores) if j >= 0] for ids, scores in zip(pred.label_ids.tolist(), pred.scores.tolist())]


def test_predict_answers_as_the_model_does_and_labels_are_looked_up(served, tiny_task):
    model, url = served
    texts = list(tiny_task[0].test.texts[:3])
    status, body = call(url + "/predict", {"texts": texts, "k": 4})
    assert status == 200
    assert [[(r["id"], r["score"]) for r in row] for row in body["predictions"]] == expected(model, texts, 4)
    first = body["predictions"][0][0]
    assert (first["uid"], first["text"]) == (model.label_uids[first["id"]], model.label_texts[first["id"]])
    status, health = call(url + "/health")
    assert status == 200 and health["status"] == "ok" and health["labels"] == len(model.label_texts)
    assert call(url + f"/labels/{model.label_uids[5]}") == (200, {"id": 5, "uid": model.label_uids[5], "text": model.label_texts[5]})
    status, body = call(url + "/labels/no-such-uid")
    assert status == 404 and "no-such-uid" in body["error"]


def test_concurrent_requests_are_served_by_one_predict_call(served, tiny_task):
    model, url = served
    texts = list(tiny_task[0].test.texts[:4])
    before = call(url + "/health")[1]
    barrier, answers = threading.Barrier(4), {}

    def ask(i):
        barrier.wait()
        answers[i] = call(url + "/predict", {"texts": [texts[i]], "k": 2 + i})  # each its own k, cut from one call

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = call(url + "/health")[1]
    assert (after["batches"] - before["batches"], after["queries"] - before["queries"]) == (1, 4)
    for i in range(4):
        status, body = answers[i]
        assert status == 200 and len(body["predictions"][0]) == 2 + i
        assert [(r["id"], r["score"]) for r in body["predictions"][0]] == expected(model, [texts[i]], 2 + i)[0]


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"texts": ["q"] * 9}, 413, "texts: 9 texts, at most 8 a request"),
    ({"texts": ["ok", "x" * 201]}, 413, "texts[1]: 201 characters, at most 200"),
    ({"texts": ["q"], "k": 0}, 422, "k: 0, must be between 1 and 20"),
    ({"texts": ["q"], "k": 21}, 422, "k: 21, must be between 1 and 20"),
    ({"texts": []}, 422, "texts: give at least one text"),
    ({"texts": "not a list"}, 422, "texts: "),
    ({"texts": ["q"], "top": 3}, 422, "top: "),
    ({"texts": ["q"], "threshold": 0.5}, 422, "threshold: this model has no calibrated scores"),
    ({"texts": ["q"], "images": [[]]}, 422, "images: DEXMLModel ranks texts only"),
    ({"texts": [None]}, 422, "texts[0]: give a text"),
    (b"{not json", 422, ""),
])
def test_bad_requests_are_refused_with_one_line(served, body, status, message):
    _, url = served
    got, answer = call(url + "/predict", raw=body) if isinstance(body, bytes) else call(url + "/predict", body)
    assert got == status and set(answer) == {"error"}
    assert answer["error"].startswith(message) and "\n" not in answer["error"]


def encoded(path: str) -> str:
    with open(path, "rb") as f:
        return base64.b64encode(f.read()).decode()


@pytest.fixture(scope="module")
def served_mufin(task):  # noqa: F811 - the imported fixture
    """The tiny MUFIN model (text and vision towers, untrained) behind uvicorn: at most 2 images of 20,000 bytes an item,
    1,000,000 pixels a request."""
    data = task[0]
    model = tiny_model(task)
    model.build_label_index(data.label_texts, data.label_uids)
    with running(create_app(model, ServingLimits(max_texts=4, max_images=2, max_image_bytes=20_000, max_pixels=1_000_000), max_wait_ms=300,
                            wait_for_arrivals=False)) as url:
        yield model, data, url


def test_a_model_that_takes_images_is_served_texts_images_and_both(served_mufin):
    from PIL import Image

    model, data, url = served_mufin
    texts, paths = list(data.test.texts[:3]), [bag[0] for bag in data.test.images[:3]]
    # a text alone, an image alone, a text with its image: one request, each item ranked as predict ranks it
    status, body = call(url + "/predict", {"texts": [texts[0], None, texts[2]], "images": [[], [encoded(paths[1])], ["data:image/png;base64," + encoded(paths[2])]], "k": 3})
    assert status == 200
    pred = model.predict([texts[0], None, texts[2]], k=3, images=[[], [Image.open(paths[1])], [Image.open(paths[2])]])
    assert [[(r["id"], r["score"]) for r in row] for row in body["predictions"]] == [
        [(j, pytest.approx(s, abs=1e-5)) for j, s in zip(ids, scores)] for ids, scores in zip(pred.label_ids.tolist(), pred.scores.tolist())]
    text_only = model.predict([texts[0]], k=3).label_ids.tolist()[0]
    image_only = model.predict([None], k=3, images=[[Image.open(paths[1])]]).label_ids.tolist()[0]
    assert text_only != image_only  # the image reached the model: its item is not ranked as the text item is
    status, body = call(url + "/predict", {"images": [[encoded(paths[1])]], "k": 3})  # images without texts
    assert status == 200 and [r["id"] for r in body["predictions"][0]] == image_only


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"texts": ["a"], "images": [[], []]}, 422, "images: 2 items, but texts has 1"),
    ({"texts": [None], "images": [[]]}, 422, "texts[0]: neither a text nor an image"),
    ({}, 422, "texts: give at least one text or image"),
    ({"images": [["not base64!"]]}, 422, "images[0][0]: not base64"),
    ({"images": [[base64.b64encode(b"not an image").decode()]]}, 422, "images[0][0]: not an image file PIL can read"),
    ({"images": [["AAAA", "AAAA", "AAAA"]]}, 413, "images[0]: 3 images, at most 2 an item"),
    ({"images": [["A" * 30_000]]}, 413, "images[0][0]: more than 20000 bytes"),
    ({"images": [[]] * 5}, 413, "texts: 5 items, at most 4 a request"),
    # a 9M-pixel PNG of ~9 KB (an image bomb): refused from its header, before 9 MB of pixels are decoded
    ({"images": [[base64.b64encode(png_bomb(3000, 3000, 1)).decode()]]}, 413, "images[0][0]: 3000x3000 pixels brings the request's images to 9000000 pixels, at most 1000000"),
    ({"images": [[base64.b64encode(png_bomb(800, 800, 1)).decode()] * 2]}, 413, "images[0][1]: 800x800 pixels brings the request's images to 1280000"),
    # its header whole, its pixel data cut: opened when the request comes, refused when the worker decodes it
    ({"images": [[base64.b64encode(png_bomb(64, 64)[:45]).decode()]]}, 422, "images[0][0]: not an image file PIL can read (OSError)"),
])
def test_bad_images_are_refused_with_one_line(served_mufin, body, status, message):
    url = served_mufin[2]
    got, answer = call(url + "/predict", body)
    assert (got, set(answer)) == (status, {"error"})
    assert answer["error"].startswith(message) and "\n" not in answer["error"]


def wait_for_health(url: str, proc: subprocess.Popen, seconds: float = 240):
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None:
        try:
            return call(url + "/health")
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.5)
    raise AssertionError(proc.stdout.read() if proc.poll() is not None else "no answer")


def test_the_serve_command_serves_a_saved_model(tiny_encoder_dir, tiny_task, tmp_path):
    model = make_model(tiny_encoder_dir, tiny_task[0])
    model.set_score_calibration(ScoreCalibration("platt", a=20.0, b=0.0))
    model.save_pretrained(tmp_path / "model")
    texts = list(tiny_task[0].test.texts[:2])
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "hf_xmc.cli", "serve", str(tmp_path / "model"), "--port", str(port), "--max_k", "5",
                             "--max_wait_ms", "1000", "--no_wait_for_arrivals"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert wait_for_health(url, proc)[0] == 200
        status, body = call(url + "/predict", {"texts": texts, "k": 3})
        assert status == 200
        assert [[(r["id"], r["score"]) for r in row] for row in body["predictions"]] == expected(model, texts, 3)
        assert call(url + "/predict", {"texts": texts, "k": 6})[0] == 422  # --max_k 5
        # a NaN threshold ("nan": pydantic makes it a float; NaN: refused by the JSON parser) is a 422, at once
        assert call(url + "/predict", {"texts": ["q"], "threshold": "nan"}, timeout=15)[0] == 422
        assert call(url + "/predict", raw=b'{"texts": ["q"], "threshold": NaN}', timeout=15)[0] == 422
        # SIGTERM while a request waits in its batch (--max_wait_ms 1000): the request is answered, then the server
        # stops; uvicorn raises the signal again once it has shut down, so the process ends as SIGTERM asks
        answers = []
        in_flight = threading.Thread(target=lambda: answers.append(call(url + "/predict", {"texts": texts, "k": 3}, timeout=30)))
        in_flight.start()
        time.sleep(0.4)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
        in_flight.join()
        assert answers[0][0] == 200 and len(answers[0][1]["predictions"]) == 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    bad = subprocess.run([sys.executable, "-m", "hf_xmc.cli", "serve", str(tmp_path / "model"), "--port", "0"],
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and bad.stderr.strip() == "hf-xmc serve: --port must be at least 1, got 0"
    assert np.isfinite(model.predict(texts, k=1).scores).all()


def test_the_serve_command_exits_1_when_its_worker_fails_for_good(tiny_encoder_dir, tiny_task, tmp_path):
    """The server a process supervisor watches: a worker that fails past --max_worker_restarts ends it, status 1."""
    model = make_model(tiny_encoder_dir, tiny_task[0])
    model.save_pretrained(tmp_path / "model")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench_serve_hostile.py")
    proc = subprocess.Popen([sys.executable, bench, "serve-with-faults", str(tmp_path / "model"), "--port", str(port),
                             "--max_worker_restarts", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        assert wait_for_health(url, proc)[0] == 200
        status, answer = call(url + "/predict", {"texts": ["PANIC"], "k": 3}, timeout=15)
        assert status == 500 and "Panic" in answer["error"]
        assert proc.wait(timeout=30) == 1
        assert "hf-xmc serve: the prediction worker failed 1 time(s) in a row; stopped (exit status 1)" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def spawned_workers(parent: int) -> set[int]:
    """The pids of ``parent``'s multiprocessing-spawned children (uvicorn's workers; not its resource tracker)."""
    found = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):  # not a process, or one that just ended
            continue
        if ppid == parent and b"spawn_main" in cmdline:
            found.add(int(entry))
    return found


def until(condition, seconds: float = 120, every: float = 0.2):
    """``condition()``'s first truthy value within ``seconds`` (None when there is none)."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the worker processes from /proc")
def test_the_serve_command_with_two_workers_serves_from_both_and_replaces_a_dead_one(tiny_encoder_dir, tiny_task, tmp_path):
    """--workers 2: two processes answer on one port, each ranking as the model does with its share of the cores' threads;
    a worker killed is replaced by the parent; SIGTERM stops them all."""
    from hf_xmc.serving import threads_per_worker

    model = make_model(tiny_encoder_dir, tiny_task[0])
    model.save_pretrained(tmp_path / "model")
    texts = list(tiny_task[0].test.texts[:2])
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # what no worker could serve (no ONNX export here) is refused by the parent in one line, before the port is bound
    bad = subprocess.run([sys.executable, "-m", "hf_xmc.cli", "serve", str(tmp_path / "model"), "--port", str(port), "--workers", "2",
                          "--backend", "onnx"], capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=300)
    error = bad.stderr.strip().splitlines()[-1]  # after transformers' weight-loading bar
    assert bad.returncode == 2 and error.startswith("hf-xmc serve: ") and "no exported query encoder" in error
    assert "Traceback" not in bad.stderr
    assert "Uvicorn running" not in bad.stderr + bad.stdout
    proc = subprocess.Popen([sys.executable, "-m", "hf_xmc.cli", "serve", str(tmp_path / "model"), "--port", str(port), "--workers", "2",
                             "--max_wait_ms", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        assert wait_for_health(url, proc)[0] == 200
        workers = until(lambda: len(spawned_workers(proc.pid)) == 2 and spawned_workers(proc.pid))
        assert workers, "two worker processes"
        answered: dict[int, dict] = {}

        def both_answered():  # each request on a new connection: the kernel hands it to either worker
            info = call(url + "/info")[1]
            answered[info["process"]["pid"]] = info["process"]
            return set(answered) == workers

        assert until(both_answered, every=0.05), f"only {sorted(answered)} of {sorted(workers)} answered"
        assert all(p == {"pid": pid, "workers": 2, "torch_threads": threads_per_worker(2)} for pid, p in answered.items())
        for _ in range(4):
            status, body = call(url + "/predict", {"texts": texts, "k": 3})
            assert status == 200 and [[(r["id"], r["score"]) for r in row] for row in body["predictions"]] == expected(model, texts, 3)
        killed = min(workers)
        os.kill(killed, signal.SIGKILL)
        replaced = until(lambda: (lambda now: len(now) == 2 and killed not in now and now)(spawned_workers(proc.pid)))
        assert replaced and replaced & workers == workers - {killed}
        assert until(lambda: call(url + "/info")[1]["process"]["pid"] in replaced - workers, every=0.05)  # the new one serves
        status, body = call(url + "/predict", {"texts": texts, "k": 3})
        assert status == 200 and [[(r["id"], r["score"]) for r in row] for row in body["predictions"]] == expected(model, texts, 3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert not spawned_workers(proc.pid) and not any(os.path.exists(f"/proc/{pid}") for pid in replaced)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------- hostile input (issue 64)
def test_a_nan_threshold_never_leaves_a_request_hanging(served):
    """NaN never equals itself: grouping requests by ``threshold ==`` left a NaN request in no group, never answered."""
    from concurrent.futures import wait

    model, _ = served
    batcher = PredictionBatcher(model, max_wait_ms=300)  # long enough for both requests to share a batch
    try:
        nan, plain = batcher.submit(["a query"], 3, float("nan")), batcher.submit(["a query"], 3)
        wait([nan, plain], timeout=30)
        assert nan.done() and plain.done()
        assert len(plain.result()[0]) == 3
    finally:
        batcher.close(timeout=30)


def test_a_batch_run_again_request_by_request_counts_each_queue_wait_once(tiny_encoder_dir, tiny_task):
    """A batch whose ``predict`` fails runs again a request at a time: three predict calls (batch sizes 2, 1, 1), but
    each request waited in the queue once."""
    from concurrent.futures import wait

    from hf_xmc.serving_metrics import ServingMetrics

    model = make_model(tiny_encoder_dir, tiny_task[0])
    predict = model.predict

    def refuses_bad(texts, *args, **kwargs):
        if any("BAD" in t for t in texts):
            raise ValueError("a bad text")
        return predict(texts, *args, **kwargs)

    model.predict = refuses_bad
    metrics = ServingMetrics()
    batcher = PredictionBatcher(model, max_wait_ms=300, metrics=metrics)  # long enough for both requests to share a batch
    try:
        bad, good = batcher.submit(["BAD"], 3), batcher.submit(["a query"], 3)
        wait([bad, good], timeout=30)
        assert isinstance(bad.exception(), ValueError) and len(good.result()[0]) == 3
    finally:
        batcher.close(timeout=30)
    assert (metrics.batch_sizes.count, metrics.batch_sizes.sum) == (3, 4)
    assert metrics.queue_waits.count == 2 and metrics.predict_durations.count == 1  # one predict answered (the good one)


@pytest.fixture(scope="module")
def hostile(tiny_encoder_dir, tiny_task):
    """A calibrated tiny DEXML model with planted faults (a text with ``PANIC`` raises a ``BaseException``, one with
    ``SLEEP:<s>`` sleeps) behind uvicorn: bodies of at most 20,000 bytes, 6 items queued, answers within 2 s."""
    model = with_faults(make_model(tiny_encoder_dir, tiny_task[0]))
    model.set_score_calibration(ScoreCalibration("platt", a=20.0, b=0.0))
    limits = ServingLimits(max_texts=4, max_chars=200, max_k=20, max_body_bytes=20_000, max_queue=6, request_timeout=2.0, max_worker_restarts=1)
    with running(create_app(model, limits, max_wait_ms=200, wait_for_arrivals=False)) as url:
        yield model, url


@pytest.mark.parametrize(("raw", "message"), [
    (b'{"texts": ["q"], "threshold": NaN}', "threshold: nan, must be a number between 0 and 1"),
    (b'{"texts": ["q"], "threshold": Infinity}', "threshold: inf, must be"),
    (b'{"texts": ["q"], "threshold": -Infinity}', "threshold: -inf, must be"),
    (b'{"texts": ["q"], "threshold": "nan"}', "threshold: nan, must be"),
    (b'{"texts": ["q"], "threshold": "inf"}', "threshold: inf, must be"),
    (b'{"texts": ["q"], "threshold": 1.5}', "threshold: 1.5, must be"),
    (b'{"texts": ["q"], "k": NaN}', "k: "),
    (b'{"texts": ["q"], "k": Infinity}', "k: "),
    (b'{"texts": ["q"], "k": "nan"}', "k: "),
    (b'{"texts": ["q"], "k": 2.5}', "k: "),
])
def test_non_finite_numbers_are_refused_at_once(hostile, raw, message):
    url = hostile[1]
    status, answer = call(url + "/predict", raw=raw, timeout=15)  # a NaN threshold used to hang here for good
    assert (status, set(answer)) == (422, {"error"})
    assert answer["error"].startswith(message) and "\n" not in answer["error"]


def test_a_threshold_still_cuts_by_probability(hostile, tiny_task):
    model, url = hostile
    texts = list(tiny_task[0].test.texts[:2])
    status, body = call(url + "/predict", {"texts": texts, "k": 10, "threshold": 0.5})
    pred = model.predict(texts, k=10, threshold=0.5)
    assert status == 200
    assert [[r["id"] for r in row] for row in body["predictions"]] == [[j for j in ids if j >= 0] for ids in pred.label_ids.tolist()]


def chunked_post(url: str, body: bytes) -> tuple[int, dict]:
    """POST ``body`` in 4 KB chunks, no Content-Length (what a client that streams sends), over a raw socket.

    A server may answer (413) and close before the upload ends; as RFC 9112 section 9.6 asks of a client, sending stops
    when the connection is gone and the answer already sent is read (``http.client`` raises BrokenPipeError there)."""
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=15) as sock:
        sock.sendall(f"POST /predict HTTP/1.1\r\nHost: {host}\r\ncontent-type: application/json\r\n"
                     "transfer-encoding: chunked\r\nconnection: close\r\n\r\n".encode())
        try:
            for i in range(0, len(body), 4096):
                chunk = body[i : i + 4096]
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered early and closed: its answer is in the receive buffer
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, json.loads(response.read())


def test_a_body_over_the_limit_is_refused_before_it_is_parsed(hostile):
    url = hostile[1]
    small = b'{"texts": ["a query"], "k": 3}'
    fits, over = small + b" " * (20_000 - len(small)), small + b" " * (30_000 - len(small))  # valid JSON, blank-padded
    assert call(url + "/predict", raw=fits)[0] == 200
    assert call(url + "/predict", raw=over) == (413, {"error": "body: 30000 bytes, at most 20000"})
    assert chunked_post(url, over) == (413, {"error": "body: more than 20000 bytes"})  # no length given: counted as it comes
    assert chunked_post(url, fits)[0] == 200
    status, answer = call(url + "/predict", raw=b"[" * 9000 + b"]" * 9000)  # nested past the JSON parser's recursion
    assert 400 <= status < 500 and set(answer) == {"error"} and "\n" not in answer["error"]


def test_a_worker_that_raises_a_base_exception_starts_again_and_health_says_so(hostile, tiny_task):
    model, url = hostile
    text = tiny_task[0].test.texts[0]
    before = call(url + "/health")[1]
    barrier, answers = threading.Barrier(2), {}

    def ask(name, texts):
        barrier.wait()
        answers[name] = call(url + "/predict", {"texts": texts, "k": 3}, timeout=15)

    threads = [threading.Thread(target=ask, args=("panic", ["PANIC"])), threading.Thread(target=ask, args=("plain", [text]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    status, answer = answers["panic"]
    assert status == 500 and answer["error"].startswith("prediction failed: the worker stopped on Panic: simulated panic")
    status, answer = answers["plain"]  # in the same batch, or the next: answered all the same
    assert status == 200 and [(r["id"], r["score"]) for r in answer["predictions"][0]] == expected(model, [text], 3)[0]
    status, health = call(url + "/health")
    assert status == 200 and health["status"] == "ok"
    assert health["worker_restarts"] == before["worker_restarts"] + 1 and health["last_fault"].startswith("Panic: simulated panic")
    assert call(url + "/predict", {"texts": [text], "k": 3})[0] == 200  # and the worker serves again


def test_a_full_queue_and_a_stuck_worker_answer_503_in_bounded_time(hostile, tiny_task):
    url = hostile[1]
    texts = list(tiny_task[0].test.texts[:4])
    answers = {}

    def ask(name, body):
        answers[name] = call(url + "/predict", body, timeout=15)

    stuck = threading.Thread(target=ask, args=("stuck", {"texts": ["SLEEP:4"], "k": 3}))
    stuck.start()
    time.sleep(0.6)  # the worker is asleep in predict (from 0.2 s to 4.2 s)
    queued = threading.Thread(target=ask, args=("queued", {"texts": texts, "k": 3}))
    queued.start()
    time.sleep(0.3)
    start = time.monotonic()
    status, answer = call(url + "/predict", {"texts": texts[:3], "k": 3})  # 4 queued + 3 > max_queue 6
    assert (status, answer) == (503, {"error": "server busy: 4 items queued, at most 6; retry later"})
    assert time.monotonic() - start < 1
    time.sleep(1.6)  # the batch has run for more than request_timeout
    status, health = call(url + "/health")
    assert status == 503 and health["status"] == "stalled"
    stuck.join()
    queued.join()
    assert answers["stuck"] == (503, {"error": "no answer within 2 s (request_timeout): the server is overloaded or stuck"})
    assert answers["queued"][0] == 503  # queued behind it: timed out too, its work dropped
    deadline = time.monotonic() + 10
    while call(url + "/health")[0] != 200 and time.monotonic() < deadline:  # the 4 s predict ends
        time.sleep(0.2)
    assert call(url + "/health")[1]["status"] == "ok"
    assert call(url + "/predict", {"texts": texts[:1], "k": 3})[0] == 200


def test_a_worker_that_keeps_failing_is_dead_and_says_so(tiny_encoder_dir, tiny_task):
    model = with_faults(make_model(tiny_encoder_dir, tiny_task[0]))
    deaths = []
    with running(create_app(model, ServingLimits(max_worker_restarts=0), on_dead=deaths.append)) as url:
        status, answer = call(url + "/predict", {"texts": ["PANIC"], "k": 3}, timeout=15)
        assert status == 500 and "Panic" in answer["error"]
        status, health = call(url + "/health")
        assert (status, health["status"]) == (503, "dead")
        status, answer = call(url + "/predict", {"texts": ["a query"], "k": 3}, timeout=15)
        assert status == 503 and answer["error"].startswith("the prediction worker is dead")
    assert deaths == ["1 failure in a row, the last Panic: simulated panic in the ranker's native code"]



def test_label_records_write_a_nan_probability_as_null():
    """MUFIN's image-only items get NaN probabilities (no calibration for their ranking): the server's JSON encoder
    refuses NaN and `hf-xmc predict` would write non-standard JSON, so label_records writes null."""
    import json
    from types import SimpleNamespace

    from hf_xmc.serving import label_records

    model = SimpleNamespace(label_uids=["a", "b", "c"], label_texts=["A", "B", "C"])
    rows = label_records(model, [2, 0, -1], [0.9, 0.5, float("-inf")], [float("nan"), 0.25, 0.0])
    assert rows == [{"id": 2, "uid": "c", "text": "C", "score": 0.9, "probability": None},
                    {"id": 0, "uid": "a", "text": "A", "score": 0.5, "probability": 0.25}]
    json.dumps(rows, allow_nan=False)  # strict JSON
    assert "probability" not in label_records(model, [1], [0.3])[0]


def fetch_text(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.status, response.headers.get("content-type", ""), response.read().decode()


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample of a Prometheus text exposition (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == (f"{name}{{{want}}}" if want else name):
            return float(value)
    return 0.0


def test_metrics_count_requests_stages_and_batches_and_info_describes_the_model(tiny_encoder_dir, tiny_task):
    from hf_xmc import __version__

    model = make_model(tiny_encoder_dir, tiny_task[0])
    texts = list(tiny_task[0].test.texts[:4])
    with running(create_app(model, ServingLimits(max_body_bytes=2000), max_wait_ms=0)) as url:
        for text in texts:
            assert call(url + "/predict", {"texts": [text], "k": 3})[0] == 200
        assert call(url + "/predict", {"texts": texts, "k": 0})[0] == 422
        assert call(url + "/predict", raw=json.dumps({"texts": ["x" * 3000]}).encode())[0] == 413  # refused before parsing
        assert call(url + "/labels/no-such-uid")[0] == 404
        status, ready = call(url + "/ready")
        assert status == 200 and ready["ready"] is True
        status, info = call(url + "/info")
        status_m, content_type, text = fetch_text(url + "/metrics")
    assert status == 200 and status_m == 200 and content_type.startswith("text/plain; version=0.0.4")
    assert metric(text, "hf_xmc_requests_total", endpoint="/predict", status="200") == 4
    assert metric(text, "hf_xmc_requests_total", endpoint="/predict", status="422") == 1
    assert metric(text, "hf_xmc_requests_total", endpoint="/predict", status="413") == 1
    assert metric(text, "hf_xmc_requests_total", endpoint="/labels", status="404") == 1  # no uid in a label value
    assert metric(text, "hf_xmc_request_duration_seconds_count", endpoint="/predict") == 6
    assert metric(text, "hf_xmc_batch_size_count") == 4 and metric(text, "hf_xmc_batch_size_sum") == 4
    # each answered request waited once in the batcher; each predict call took at least its stages' time
    assert metric(text, "hf_xmc_queue_duration_seconds_count") == 4 and metric(text, "hf_xmc_predict_duration_seconds_count") == 4
    stages = sum(metric(text, "hf_xmc_stage_duration_seconds_sum", stage=s) for s in ("encode", "search", "fuse"))
    assert stages <= metric(text, "hf_xmc_predict_duration_seconds_sum") <= metric(text, "hf_xmc_request_duration_seconds_sum", endpoint="/predict")
    for stage in ("tokenise", "encode", "search"):
        assert metric(text, "hf_xmc_stage_duration_seconds_count", stage=stage) >= 4, stage
    assert metric(text, 'hf_xmc_stage_duration_seconds_bucket', stage="encode", le="+Inf") == metric(text, "hf_xmc_stage_duration_seconds_count", stage="encode")
    assert metric(text, "hf_xmc_worker_up") == 1 and metric(text, "hf_xmc_labels") == len(model.label_texts)
    assert info["model"] == "DEXMLModel" and info["labels"] == len(model.label_texts)
    assert info["query_encoder"] == {"default": "transformer", "available": ["transformer"], "backend": "torch", "onnx_export": False}
    assert info["versions"]["hf_xmc"] == __version__ and info["fingerprints"]["labels"] == model.labels_digest()
    assert info["limits"]["max_body_bytes"] == 2000


def test_a_batch_waits_for_company_only_while_a_request_is_on_its_way(tiny_encoder_dir, tiny_task):
    """The server announces every /predict as its headers arrive: a request alone is served at once, not after
    max_wait_ms (here 10 s: the 5 s timeout below would fail if it waited); one announced and still on its way is waited
    for and joins the batch."""
    model = make_model(tiny_encoder_dir, tiny_task[0])
    texts = list(tiny_task[0].test.texts[:2])
    batcher = PredictionBatcher(model, max_wait_ms=10_000, wait_for_arrivals=True)
    try:
        assert len(batcher.submit([texts[0]], 3).result(timeout=5)) == 1  # nobody on the way: no wait
        assert batcher.batches == 1
        batcher.announce()  # the second request's headers are in
        first = batcher.submit([texts[0]], 3)
        time.sleep(0.3)
        assert not first.done()  # waiting for the announced one
        second = batcher.submit([texts[1]], 3, announced=True)
        assert len(first.result(timeout=5)) == 1 and len(second.result(timeout=5)) == 1
        assert batcher.batches == 2 and batcher.queries == 3  # the two in one predict call
        assert batcher.arriving == 0
    finally:
        batcher.close(timeout=10)
