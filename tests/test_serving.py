"""``hf-xmc serve``: the endpoint answers as ``predict`` does, batches concurrent requests into one call, refuses bad
input with a 4xx and one line, and the command starts it on a saved model (queried over loopback)."""

import base64
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from hf_xmc.serving import ServingLimits, create_app
from tests.test_label_store import make_model
from tests.test_mufin_training import task, tiny_model  # noqa: F401 - task: the tiny multimodal task's fixture

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(url: str, body=None, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"} if data is not None else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
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
    with running(create_app(model, ServingLimits(max_texts=8, max_chars=200, max_k=20), max_batch=64, max_wait_ms=300)) as url:
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
    """The tiny MUFIN model (text and vision towers, untrained) behind uvicorn: at most 2 images of 20,000 bytes an item."""
    data = task[0]
    model = tiny_model(task)
    model.build_label_index(data.label_texts, data.label_uids)
    with running(create_app(model, ServingLimits(max_texts=4, max_images=2, max_image_bytes=20_000), max_wait_ms=300)) as url:
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
])
def test_bad_images_are_refused_with_one_line(served_mufin, body, status, message):
    url = served_mufin[2]
    got, answer = call(url + "/predict", body)
    assert (got, set(answer)) == (status, {"error"})
    assert answer["error"].startswith(message) and "\n" not in answer["error"]


def test_the_serve_command_serves_a_saved_model(tiny_encoder_dir, tiny_task, tmp_path):
    model = make_model(tiny_encoder_dir, tiny_task[0])
    model.save_pretrained(tmp_path / "model")
    texts = list(tiny_task[0].test.texts[:2])
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "hf_xmc.cli", "serve", str(tmp_path / "model"), "--port", str(port), "--max_k", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline, health = time.time() + 240, None
        while time.time() < deadline and proc.poll() is None:
            try:
                health = call(f"http://127.0.0.1:{port}/health")
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        assert health is not None and health[0] == 200, proc.stdout.read() if proc.poll() is not None else "no answer"
        status, body = call(f"http://127.0.0.1:{port}/predict", {"texts": texts, "k": 3})
        assert status == 200
        assert [[(r["id"], r["score"]) for r in row] for row in body["predictions"]] == expected(model, texts, 3)
        assert call(f"http://127.0.0.1:{port}/predict", {"texts": texts, "k": 6})[0] == 422  # --max_k 5
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    bad = subprocess.run([sys.executable, "-m", "hf_xmc.cli", "serve", str(tmp_path / "model"), "--port", "0"],
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and bad.stderr.strip() == "hf-xmc serve: --port must be at least 1, got 0"
    assert np.isfinite(model.predict(texts, k=1).scores).all()
