"""``hf-xmc serve MODEL``: an HTTP endpoint for a saved model (FastAPI + uvicorn), concurrent requests batched.

    hf-xmc serve out/dexml --port 8000
    curl -s localhost:8000/predict -H 'content-type: application/json' -d '{"texts": ["a query"], "k": 5}'

Endpoints:

* ``POST /predict`` ``{"texts": [...], "k": 10, "threshold": null}`` -> ``{"predictions": [[{"id", "uid", "text",
  "score"[, "probability"]}, ...], ...]}``, one list per text, best label first (``threshold``: the labels whose
  calibrated probability reaches it, for a model trained with a validation split). A model that takes images (MUFIN)
  also reads ``"images"``: per item a list of base64-encoded image files (PNG, JPEG, ...; a ``data:image/...;base64,``
  prefix is allowed), ``[]`` for none; its ``texts`` may then be left out or hold ``null`` for image-only items;
* ``GET /health`` -> ``{"status": "ok", "model", "labels", "batches", "queries", "queued", "worker_restarts",
  "last_fault"}``, 200; ``"stalled"`` (a batch running longer than the request timeout) or ``"dead"`` (the worker
  stopped for good) with 503;
* ``GET /ready`` -> ``{"ready", "status", "queued"}``: 200 when the worker serves and the queue has room, 503 otherwise
  (readiness, apart from ``/health``'s liveness);
* ``GET /metrics``: Prometheus' text format: requests by endpoint and status, latency histograms per endpoint and per
  stage of a ranking (tokenise, encode, search, fuse), batch sizes, queue depth (``hf_xmc/serving_metrics.py``);
* ``GET /info``: the model class, labels, query encoders, channel, calibration, label index, library versions and the
  fingerprints of the derived parts;
* ``GET /labels/{uid}`` -> ``{"id", "uid", "text"}``, 404 for an unknown uid.

Batching: every request joins one queue; a worker thread takes what has arrived, up to ``max_batch`` texts (and
``max_pixels`` decoded pixels), waiting at most ``max_wait_ms`` after the first, and runs ``model.predict`` once for
them (with the largest ``k`` asked, one call per distinct ``threshold``); each request gets its own rows, cut to its
``k``. A call that raises is repeated request by request, so only the request at fault gets the error. The event loop
only parses and answers, so requests keep arriving while a batch runs. ``--backend onnx`` encodes the queries with the
model's exported encoder (``model.export_onnx``, saved beside the model).

Hostile input (:class:`ServingLimits`): a body over ``max_body_bytes`` is refused (413) before it is parsed, read no
further than that; texts per request, characters per text, ``k``, images per item, bytes per image and decoded pixels
per request (read from the image headers before anything is decoded) are refused with a 4xx, as are non-finite
numbers (``NaN``, ``Infinity``, the string ``"nan"``), an image that does not decode and a body that is not the JSON
above; every refusal is ``{"error": "<one line>"}``. A full queue (``max_queue`` items) answers 503 at once; a request
not answered within ``request_timeout`` seconds answers 503 and its work is dropped if the worker has not started it.
A worker that raises anything (a ``BaseException`` from native code included) fails the requests of its batch (500)
and starts again; after ``max_worker_restarts`` failures in a row with no batch served between them it stops, ``/health``
says ``"dead"``, and :func:`serve` returns 1 (``hf-xmc serve`` exits 1 for a process supervisor to restart).

Memory model: the model as ``from_pretrained`` loads it (its label store memory-mapped); per request being handled
(at most ``max_connections``) its body (at most ``max_body_bytes``, read into memory once) and the parsed JSON (about
as large: base64 strings and texts); the images of the batch in the worker, decoded there just before their
``predict`` (at most ``max_pixels`` pixels in all, 1-4 bytes each; one request over it runs alone); and one batch's
``predict`` (``max_batch x k`` results). The queue holds at most ``max_queue`` items, each inside a request above.
"""

import asyncio
import base64
import binascii
import io
import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field, fields
from typing import Any, Optional

logger = logging.getLogger(__name__)


@dataclass
class ServingLimits:
    """What one request may ask for (larger ones are refused, not truncated) and what the server holds at once."""

    max_texts: int = 64  # items (texts, or texts and image bags) a request
    max_chars: int = 2000
    max_k: int = 100
    max_images: int = 16  # images an item (models that take images)
    max_image_bytes: int = 5_000_000  # encoded bytes an image
    max_body_bytes: int = 10_000_000  # bytes of a request body, refused (413) before parsing
    max_pixels: int = 40_000_000  # decoded pixels of a request's images in all (and of a batch's, unless one request)
    max_queue: int = 256  # items waiting for the worker; more: 503
    request_timeout: float = 30.0  # seconds a request waits for its answer; then 503
    max_connections: int = 64  # requests and connections handled at once (uvicorn's limit_concurrency); more: 503
    max_worker_restarts: int = 3  # worker failures in a row (no batch served between) before the server stops

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            least = 0 if f.name == "max_worker_restarts" else 1
            if f.name == "request_timeout":
                if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                    raise ValueError(f"request_timeout must be a finite number of seconds > 0, got {value}")
            elif not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{f.name} must be an integer >= {least}, got {value!r}")


@dataclass
class _Request:
    texts: list[Optional[str]]  # one per item (None: an image-only item)
    k: int
    threshold: Optional[float]
    images: Optional[list[list[Any]]] = None  # one bag of PIL images (opened, not decoded) per item, or None
    pixels: int = 0  # the images' pixels, from their headers
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)  # when it joined the queue (its wait, for /metrics)
    waited: bool = False  # its queue wait is observed: a batch that fails and runs again request by request counts it once


class ImageRefused(ValueError):
    """An image of a request that cannot be used: ``status`` 413 (too large) or 422 (not an image)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class ServerBusy(RuntimeError):
    """The request was not run: the queue is full, the server is stopping, or its worker is dead (503)."""


class WorkerFailed(RuntimeError):
    """The worker failed while it ran the request's batch (500); the request may be sent again."""


def open_images(bags: Sequence[Sequence[str]], limits: "ServingLimits") -> tuple[list[list[Any]], int]:
    """PIL images of base64-encoded image files, per item, opened but not decoded, and their pixels in all
    (``ImageRefused`` names the first one at fault). Only the files' headers are read: :func:`load_images` decodes."""
    from PIL import Image

    out, pixels = [], 0
    for i, bag in enumerate(bags):
        if len(bag) > limits.max_images:
            raise ImageRefused(413, f"images[{i}]: {len(bag)} images, at most {limits.max_images} an item")
        images = []
        for j, text in enumerate(bag):
            payload = text.split(",", 1)[1] if text.startswith("data:") else text
            if len(payload) > 4 * (limits.max_image_bytes // 3 + 1):  # checked before decoding anything
                raise ImageRefused(413, f"images[{i}][{j}]: more than {limits.max_image_bytes} bytes")
            try:
                raw = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise ImageRefused(422, f"images[{i}][{j}]: not base64") from None
            try:
                image = Image.open(io.BytesIO(raw))  # the header only: size and mode, no pixels yet
            except Image.DecompressionBombError:  # PIL's own ceiling, far above any sensible max_pixels
                raise ImageRefused(413, f"images[{i}][{j}]: a decompression bomb, more than {limits.max_pixels} pixels") from None
            except Exception as err:  # PIL raises several kinds for a file it cannot read
                raise ImageRefused(422, f"images[{i}][{j}]: not an image file PIL can read ({type(err).__name__})") from None
            pixels += image.width * image.height
            if pixels > limits.max_pixels:
                raise ImageRefused(413, f"images[{i}][{j}]: {image.width}x{image.height} pixels brings the request's images "
                                        f"to {pixels} pixels, at most {limits.max_pixels}")
            images.append(image)
        out.append(images)
    return out, pixels


def load_images(bags: Sequence[Sequence[Any]]) -> None:
    """Decode the pixels of images :func:`open_images` opened (``ImageRefused`` 422 for a file that does not decode)."""
    for i, bag in enumerate(bags):
        for j, image in enumerate(bag):
            try:
                image.load()
            except Exception as err:  # a truncated or corrupt file: its header read, its data not
                raise ImageRefused(422, f"images[{i}][{j}]: not an image file PIL can read ({type(err).__name__})") from None


def decode_images(bags: Sequence[Sequence[str]], limits: "ServingLimits") -> list[list[Any]]:
    """PIL images of base64-encoded image files, per item, decoded (:func:`open_images` then :func:`load_images`)."""
    images, _ = open_images(bags, limits)
    load_images(images)
    return images


def label_records(model, ids: Sequence[int], scores: Sequence[float], probabilities: Optional[Sequence[float]] = None) -> list[dict[str, Any]]:
    """``[{"id", "uid", "text", "score"[, "probability"]}, ...]`` of one prediction row, empty slots (id -1) dropped. A
    NaN probability (MUFIN's image-only items, ranked without the channel the calibration was fitted with) is written
    as ``null``: strict JSON has no NaN, and the server's JSON encoder refuses it."""
    uids, names = model.label_uids, model.label_texts

    def probability(c: int) -> dict:
        if probabilities is None:
            return {}
        value = probabilities[c]
        return {"probability": None if value is None or value != value else value}

    return [{"id": j, "uid": uids[j], "text": names[j], "score": s, **probability(c)} for c, (j, s) in enumerate(zip(ids, scores)) if j >= 0]


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _resolve(future: Future, result: Any = None, error: Optional[BaseException] = None) -> None:
    """Set a future's outcome unless it is already settled (a client that timed out cancelled it meanwhile)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


_STOP = object()  # queued by close(): the worker ends after the requests queued before it


class PredictionBatcher:
    """Runs ``model.predict`` in one worker thread over the requests queued meanwhile (module docstring).

    Memory model: at most ``max_queue`` items queued (a submit beyond raises :class:`ServerBusy`), each holding its
    texts and its images opened but not decoded; the worker decodes one batch's images (at most ``max_pixels`` pixels
    unless a single request) and holds one ``predict`` result."""

    def __init__(self, model, max_batch: int = 64, max_wait_ms: float = 2.0, backend: str = "torch", max_queue: int = 256,
                 max_pixels: int = 40_000_000, max_worker_restarts: int = 3, stall_after: float = 30.0,
                 on_dead: Optional[Callable[[str], None]] = None, metrics=None, wait_for_arrivals: bool = False):
        if max_batch < 1 or not (math.isfinite(max_wait_ms) and max_wait_ms >= 0) or max_queue < 1:
            raise ValueError(f"max_batch and max_queue must be >= 1 and max_wait_ms a finite number >= 0, got {max_batch}, "
                             f"{max_queue} and {max_wait_ms}")
        self.model, self.max_batch, self.max_wait, self.backend = model, max_batch, max_wait_ms / 1000, backend
        self.max_queue, self.max_pixels, self.max_worker_restarts = max_queue, max_pixels, max_worker_restarts
        self.stall_after, self.on_dead, self.metrics = stall_after, on_dead, metrics  # metrics: a ServingMetrics, or None
        # wait_for_arrivals: a batch waits max_wait_ms for company only while a request is on its way (announce() was
        # called for it and it has not been submitted yet); alone, it runs at once (the server announces every /predict)
        self.wait_for_arrivals, self.arriving = wait_for_arrivals, 0
        self.batches = self.queries = self.queued = self.restarts = 0
        self.last_fault: Optional[str] = None
        self.dead: Optional[str] = None  # why the worker stopped for good
        self._failures_in_a_row, self._closing = 0, False
        self._current: list[_Request] = []  # the batch the worker runs, and since when
        self._started: Optional[float] = None
        self._held: Optional[_Request] = None  # taken from the queue, left for the next batch (pixels)
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._supervise, name="hf-xmc-batcher", daemon=True)
        self._worker.start()

    def announce(self) -> None:
        """A request is on its way (its body being read and checked): a batch may wait for it (``wait_for_arrivals``)."""
        with self._lock:
            self.arriving += 1

    def withdraw(self) -> None:
        """An announced request will not be submitted (refused, or its client left)."""
        with self._lock:
            self.arriving = max(0, self.arriving - 1)

    def submit(self, texts: list[Optional[str]], k: int, threshold: Optional[float] = None, images: Optional[list[list[Any]]] = None,
               pixels: int = 0, announced: bool = False) -> Future:
        """Queue items (texts; for a model that takes images, a bag of images per item too); the future resolves to
        their ``label_records`` lists. Raises :class:`ServerBusy` when the queue is full, the batcher closed or dead.
        ``announced``: the request was announced (:meth:`announce`); it arrives now (even when refused)."""
        request = _Request(texts, k, threshold, images, pixels)
        with self._lock:
            if announced:
                self.arriving = max(0, self.arriving - 1)
            if self.dead is not None or self._closing:
                raise ServerBusy("the prediction worker is dead" if self.dead is not None else "the server is stopping")
            if self.queued + len(texts) > self.max_queue:
                raise ServerBusy(f"server busy: {self.queued} items queued, at most {self.max_queue}; retry later")
            self.queued += len(texts)
            self._queue.put(request)
        return request.future

    def status(self) -> str:
        """``"ok"``, ``"stalled"`` (a batch has run longer than ``stall_after`` seconds) or ``"dead"``."""
        if self.dead is not None or not self._worker.is_alive():
            return "dead"
        started = self._started
        return "stalled" if started is not None and time.monotonic() - started > self.stall_after else "ok"

    def close(self, timeout: Optional[float] = None) -> None:
        """Serve what is queued, then stop the worker (waiting at most ``timeout`` seconds); later submits are refused."""
        with self._lock:
            self._closing = True
            self._queue.put(_STOP)
        self._worker.join(timeout)
        if self._worker.is_alive():  # stuck in predict: whatever still waits is told so, the daemon thread left behind
            logger.error("hf-xmc serve: the prediction worker did not stop within %s s", timeout)
            self._fail_queued(ServerBusy("the server is stopping"))

    def _fail_queued(self, error: BaseException) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                _resolve(item.future, error=error)
        if self._held is not None:
            _resolve(self._held.future, error=error)
            self._held = None

    def _supervise(self) -> None:
        """The worker thread: runs the batch loop, and starts it again after anything it raises (module docstring)."""
        while True:
            try:
                self._run()
                return
            except BaseException as err:  # noqa: B036 - a native library's panic is a BaseException; the worker must outlive it
                fault = _first_line(err)
                logger.error("hf-xmc serve: the prediction worker failed (%s)", fault, exc_info=True)
                with self._lock:  # counted before any client hears of it: /health asked after the answer agrees
                    self.last_fault, self._failures_in_a_row = fault, self._failures_in_a_row + 1
                    if self._failures_in_a_row > self.max_worker_restarts:
                        n = self._failures_in_a_row
                        self.dead = f"{n} failure{'s' if n > 1 else ''} in a row, the last {fault}"
                    else:
                        self.restarts += 1
                for r in self._current:  # the request at fault, and any of its batch that had not run
                    _resolve(r.future, error=WorkerFailed(f"prediction failed: the worker stopped on {fault}; "
                                                          + ("it starts again" if self.dead is None else "it is dead")))
                self._current, self._started = [], None
                if self.dead is not None:
                    self._fail_queued(ServerBusy(f"the prediction worker is dead ({self.dead})"))
                    if self.on_dead is not None:
                        self.on_dead(self.dead)
                    return

    def _run(self) -> None:
        while True:
            batch, stop = self._take()
            if batch:
                self._current, self._started = batch, time.monotonic()
                self._serve(batch)
                self._current, self._started = [], None
                with self._lock:
                    self._failures_in_a_row = 0
            if stop:
                return

    def _take(self) -> tuple[list[_Request], bool]:
        """The next batch (requests whose client gave up are dropped), and whether the worker stops after it."""
        batch: list[_Request] = []
        size = pixels = 0
        deadline: Optional[float] = None
        while size < self.max_batch:
            if batch and self.wait_for_arrivals and self._held is None and self.arriving == 0 and self._queue.empty():
                break  # nobody is on the way: waiting max_wait_ms would only add it to this batch's latency
            if self._held is not None:
                item, self._held = self._held, None
            else:
                try:
                    item = self._queue.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is _STOP:
                    return batch, True
                with self._lock:
                    self.queued -= len(item.texts)
                if not item.future.set_running_or_notify_cancel():  # its client timed out: nothing to run
                    continue
            if batch and item.pixels and pixels + item.pixels > self.max_pixels:
                self._held = item  # its images would take the batch past max_pixels: the next batch starts with it
                break
            batch.append(item)
            size, pixels = size + len(item.texts), pixels + item.pixels
            if deadline is None:
                deadline = time.monotonic() + self.max_wait
        return batch, False

    def _serve(self, batch: list[_Request]) -> None:
        ready = []
        for r in batch:  # decoded here, one batch at a time: queued requests hold encoded files only
            if r.images is not None:
                try:
                    load_images(r.images)
                except ImageRefused as err:
                    _resolve(r.future, error=err)
                    continue
            ready.append(r)
        groups: dict[Any, list[_Request]] = {}
        for r in ready:  # every request lands in exactly one group (a NaN, never equal to itself, in its own)
            groups.setdefault(r.threshold, []).append(r)
        self._each([(requests, threshold) for threshold, requests in groups.items()])

    def _each(self, calls: list[tuple[list[_Request], Optional[float]]]) -> None:
        """Run ``_predict`` on each (requests, threshold); one that ends the worker (a ``BaseException``) does so after
        the others ran, so a request at fault takes no other request with it."""
        fatal = None
        for requests, threshold in calls:
            try:
                self._predict(requests, threshold)
            except BaseException as err:  # noqa: B036 - raised again below
                fatal = fatal or err
        if fatal is not None:
            raise fatal

    def _predict(self, requests: list[_Request], threshold: Optional[float]) -> None:
        texts = [t for r in requests for t in r.texts]
        try:
            extra = {} if threshold is None else {"threshold": threshold}
            if self.backend != "torch":
                extra["backend"] = self.backend
            if any(r.images is not None for r in requests):  # one bag per item; text-only requests add empty bags
                extra["images"] = [bag for r in requests for bag in (r.images if r.images is not None else [[] for _ in r.texts])]
            started = time.perf_counter()
            if self.metrics is not None:
                self.metrics.batch(len(texts), [started - r.submitted for r in requests if not r.waited])
                for r in requests:
                    r.waited = True
            pred = self.model.predict(texts, k=min(max(r.k for r in requests), len(self.model.label_texts)), **extra)
        except BaseException as err:  # noqa: B036 - re-raised below when it is no Exception and its own
            if len(requests) > 1:  # one request's fault must not fail the others: each runs alone
                self._each([([r], threshold) for r in requests])
            elif isinstance(err, Exception):
                _resolve(requests[0].future, error=err)
            else:  # a panic, SystemExit, ...: the worker stops on it; _supervise fails the request and starts it again
                raise
            return
        with self._lock:  # counted before any client has its answer: /health asked after it agrees
            self.batches, self.queries = self.batches + 1, self.queries + len(texts)
        probabilities = pred.probabilities.tolist() if pred.probabilities is not None else None
        ids, scores, row, answers = pred.label_ids.tolist(), pred.scores.tolist(), 0, []
        for r in requests:
            answers.append([label_records(self.model, ids[i][: r.k], scores[i][: r.k], probabilities[i][: r.k] if probabilities else None)
                            for i in range(row, row + len(r.texts))])
            row += len(r.texts)
        if self.metrics is not None:  # observed before any client has its answer: /metrics asked after it agrees
            self.metrics.predicted(time.perf_counter() - started)
        for r, answer in zip(requests, answers):
            _resolve(r.future, answer)


ANNOUNCED = "hf_xmc.announced"  # set in a /predict request's ASGI scope while it is announced to the batcher


def announce_arrivals(app, batcher: "PredictionBatcher"):
    """ASGI middleware: every ``POST /predict`` is announced to ``batcher`` as soon as its headers arrive, and withdrawn
    if it ends without being submitted, so that a batch waits ``max_wait_ms`` for company only when company is coming."""

    async def announced(scope, receive, send):
        if scope["type"] != "http" or scope.get("path") != "/predict":
            return await app(scope, receive, send)
        batcher.announce()
        scope[ANNOUNCED] = True
        try:
            await app(scope, receive, send)
        finally:
            if scope.pop(ANNOUNCED, False):  # not submitted: refused before the queue, or its client left
                batcher.withdraw()

    return announced


def body_limit(app, max_bytes: int):
    """ASGI middleware: a request body over ``max_bytes`` is answered 413 (JSON ``{"error"}``) and read no further;
    a smaller one is read whole (at most ``max_bytes`` held) and handed on."""

    async def refuse(send, message: str) -> None:
        payload = json.dumps({"error": message}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})

    async def limited(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.strip().isdigit() or int(declared) > max_bytes):
            return await refuse(send, f"body: {declared.decode(errors='replace')[:20]} bytes, at most {max_bytes}")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > max_bytes:  # a chunked body, no length declared
                return await refuse(send, f"body: more than {max_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, handed = b"".join(chunks), False

        async def replay():
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await app(scope, replay, send)

    return limited


def create_app(model, limits: Optional[ServingLimits] = None, max_batch: int = 64, max_wait_ms: float = 2.0, backend: str = "torch",
               on_dead: Optional[Callable[[str], None]] = None, query_encoder: Optional[str] = None, wait_for_arrivals: bool = True,
               workers: int = 1):
    """The FastAPI application serving ``model`` (module docstring), its body limit in front. ``app.state.batcher`` is
    its :class:`PredictionBatcher`, closed when the application shuts down; ``on_dead(reason)`` is called (from the
    worker thread) when the worker stops for good. ``backend="onnx"``: queries are encoded by the model's exported
    encoder (``model.export_onnx``), checked here, before the first request. ``query_encoder="static"``: every request
    is ranked with the model's static query encoder (``model.set_query_encoder``; a missing or stale one is one error
    here); None: the model's own. ``wait_for_arrivals`` (default): a batch waits ``max_wait_ms`` only while another ``/predict``
    has arrived and is being read (:class:`PredictionBatcher`); a request alone runs at once; False: every batch waits
    ``max_wait_ms`` after its first request. ``workers``: how many
    processes serve the port (:func:`serve_workers`), reported by ``/info`` with this one's pid."""
    from contextlib import asynccontextmanager

    import torch
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from pydantic import BaseModel, ConfigDict
    from starlette.exceptions import HTTPException

    from .serving_metrics import CONTENT_TYPE, ServingMetrics, model_info, request_metrics

    limits = limits or ServingLimits()
    check_servable(model, backend, query_encoder)
    metrics = ServingMetrics()
    model.stage_observer = metrics.stage  # the text models time tokenise / encode / search / fuse
    batcher = PredictionBatcher(model, max_batch=max_batch, max_wait_ms=max_wait_ms, backend=backend, max_queue=limits.max_queue,
                                max_pixels=limits.max_pixels, max_worker_restarts=limits.max_worker_restarts,
                                stall_after=limits.request_timeout, on_dead=on_dead, metrics=metrics, wait_for_arrivals=wait_for_arrivals)
    info = model_info(model, backend, limits)  # taken once: what is served does not change while it runs
    info["process"] = {"pid": os.getpid(), "workers": workers, "torch_threads": torch.get_num_threads()}
    label_ids: dict[str, int] = {}  # uid -> id, made on the first /labels request: a pass over every uid (label_file.py)

    takes_images = model.takes_images
    timeout = limits.request_timeout

    class PredictRequest(BaseModel):  # defined here, with no postponed annotations: FastAPI reads the body's type
        model_config = ConfigDict(extra="forbid")
        texts: Optional[list[Optional[str]]] = None
        images: Optional[list[list[str]]] = None  # models that take images: base64-encoded files, a list per item
        k: int = 10
        threshold: Optional[float] = None  # checked finite below: pydantic takes NaN, Infinity and "nan"

    class Refused(Exception):
        def __init__(self, status: int, message: str, headers: Optional[dict] = None):
            self.status, self.message, self.headers = status, message, headers

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(batcher.close, timeout)  # off the loop: the batch in hand may take a while

    app = FastAPI(title=f"hf_xmc {type(model).__name__}", lifespan=lifespan)
    app.state.batcher, app.state.metrics = batcher, metrics
    app.add_middleware(body_limit, max_bytes=limits.max_body_bytes)
    if wait_for_arrivals:  # outside the body limit: announced as its headers arrive
        app.add_middleware(announce_arrivals, batcher=batcher)
    app.add_middleware(request_metrics, metrics=metrics)  # added last: outermost, so the body limit's 413s count too

    @app.exception_handler(Refused)
    async def refused(request: Request, err: Refused):
        return JSONResponse({"error": err.message}, status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
        return JSONResponse({"error": f"{where}: {first.get('msg')}"}, status_code=422)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):  # FastAPI's own: a body it cannot parse, 404, 405
        return JSONResponse({"error": str(err.detail).splitlines()[0] if err.detail else "error"}, status_code=err.status_code,
                            headers=getattr(err, "headers", None))

    def items_of(body: PredictRequest) -> list[Optional[str]]:
        """The request's texts, one per item (``None`` for an image-only item), after the checks of its shape."""
        if body.images is not None and not takes_images:
            raise Refused(422, f"images: {type(model).__name__} ranks texts only")
        texts, bags = body.texts, body.images
        if not texts and not bags:
            raise Refused(422, "texts: give at least one text" + (" or image" if takes_images else ""))
        if texts is not None and bags is not None and len(texts) != len(bags):
            raise Refused(422, f"images: {len(bags)} items, but texts has {len(texts)}")
        items = list(texts) if texts is not None else [None] * len(bags)
        if len(items) > limits.max_texts:
            raise Refused(413, f"texts: {len(items)} {'items' if takes_images else 'texts'}, at most {limits.max_texts} a request")
        for i, text in enumerate(items):
            if text is None and not (takes_images and bags is not None and bags[i]):
                raise Refused(422, f"texts[{i}]: " + ("neither a text nor an image" if takes_images else "give a text"))
        long = next((i for i, t in enumerate(items) if t is not None and len(t) > limits.max_chars), None)
        if long is not None:
            raise Refused(413, f"texts[{long}]: {len(items[long])} characters, at most {limits.max_chars}")
        return items

    @app.post("/predict")
    async def predict(body: PredictRequest, request: Request):
        started = time.monotonic()
        texts = items_of(body)
        if not 1 <= body.k <= limits.max_k:
            raise Refused(422, f"k: {body.k}, must be between 1 and {limits.max_k}")
        if body.threshold is not None and not 0 <= body.threshold <= 1:  # NaN and the infinities fail it too
            raise Refused(422, f"threshold: {body.threshold}, must be a number between 0 and 1")
        if body.threshold is not None and model.score_calibration is None:  # the served query encoder's calibration
            raise Refused(422, "threshold: this model has no calibrated scores (train it with a validation split)")
        images, pixels = None, 0
        try:
            if body.images is not None:  # off the event loop: reading headers and base64 is CPU work
                images, pixels = await asyncio.wait_for(asyncio.to_thread(open_images, body.images, limits), timeout)
            future = batcher.submit(texts, body.k, body.threshold, images, pixels, announced=request.scope.pop(ANNOUNCED, False))
            left = max(0.0, timeout - (time.monotonic() - started))
            predictions = await asyncio.wait_for(asyncio.wrap_future(future), left)
        except ImageRefused as err:
            raise Refused(err.status, str(err)) from None
        except ServerBusy as err:
            raise Refused(503, str(err).splitlines()[0], {"Retry-After": "1"}) from None
        except TimeoutError:
            raise Refused(503, f"no answer within {timeout:g} s (request_timeout): the server is overloaded or stuck",
                          {"Retry-After": "1"}) from None
        except ValueError as err:  # the model's own refusal of an input
            raise Refused(422, str(err).splitlines()[0] if str(err).strip() else type(err).__name__) from None
        except Exception as err:  # WorkerFailed, or anything else predict raised: one line, not a traceback page
            message = str(err) if isinstance(err, WorkerFailed) else f"prediction failed: {_first_line(err)}"
            raise Refused(500, message.splitlines()[0]) from None
        # a response of its own: FastAPI would walk the records through jsonable_encoder first (~0.1 ms a request of
        # k=10, 7x the JSON encoding itself); they are plain str / int / float already
        return JSONResponse({"predictions": predictions})

    @app.get("/health")
    async def health():
        status = batcher.status()
        return JSONResponse({"status": status, "model": type(model).__name__, "labels": len(model.label_texts),
                             "batches": batcher.batches, "queries": batcher.queries, "queued": batcher.queued,
                             "worker_restarts": batcher.restarts, "last_fault": batcher.last_fault},
                            status_code=200 if status == "ok" else 503)

    @app.get("/ready")
    async def ready():
        """Readiness apart from liveness (/health): 503 while the worker is stalled or dead or the queue is full, so a
        load balancer sends requests elsewhere without restarting this process."""
        status = batcher.status()
        full = batcher.queued >= limits.max_queue
        ok = status == "ok" and not full
        return JSONResponse({"ready": ok, "status": status, "queued": batcher.queued}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus():
        gauges = {"hf_xmc_queue_depth": ("Items waiting for the prediction worker.", batcher.queued),
                  "hf_xmc_worker_up": ("1 while the prediction worker serves, 0 when stalled or dead.", float(batcher.status() == "ok")),
                  "hf_xmc_worker_restarts": ("Times the prediction worker started again after failing.", batcher.restarts),
                  "hf_xmc_labels": ("Labels the served model ranks.", len(model.label_texts))}
        return Response(metrics.render(gauges), media_type=CONTENT_TYPE)

    @app.get("/info")
    async def describe():
        return info

    @app.get("/labels/{uid}")
    async def label(uid: str):
        if not label_ids:
            label_ids.update((u, i) for i, u in enumerate(model.label_uids or ()))
        if uid not in label_ids:
            raise Refused(404, f"no label with uid {uid!r}")
        i = label_ids[uid]
        return JSONResponse({"id": i, "uid": uid, "text": model.label_texts[i]})

    return app


def check_servable(model, backend: str = "torch", query_encoder: Optional[str] = None) -> None:
    """Raise the one-line ``ValueError`` that serving ``model`` this way would meet on its first request: no static
    query encoder or a stale one (``query_encoder="static"``), no ONNX export or a stale one (``backend="onnx"``)."""
    if query_encoder is not None:
        model.set_query_encoder(query_encoder)
    if backend != "torch":
        model.query_vectors_with(backend, ["a first query"])


#: the environment variable through which :func:`serve_workers` hands its settings (JSON) to each worker process
WORKER_SPEC_ENV = "HF_XMC_SERVE_WORKER_SPEC"


def threads_per_worker(workers: int) -> int:
    """The cores this process may run on, shared out among ``workers`` processes (at least one thread each)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // workers)


def use_threads(model, threads: int, backend: str = "torch") -> None:
    """Give this process's torch, faiss and onnxruntime ``threads`` threads (torch one with ``backend="onnx"``, as in
    :func:`serve`): processes that share the cores each keep to their share instead of all spinning on every core."""
    import torch

    torch.set_num_threads(1 if backend == "onnx" else threads)
    try:
        import faiss

        faiss.omp_set_num_threads(threads)
    except ImportError:  # no faiss: the label index searches with torch
        pass
    model.onnx_threads = threads


def serve_workers(app_factory: str, spec: dict, workers: int, host: str = "127.0.0.1", port: int = 8000,
                  limits: Optional[ServingLimits] = None, log_level: str = "info", healthcheck_seconds: int = 60) -> int:
    """Serve with ``workers`` processes until interrupted: uvicorn's supervisor binds the port once, spawns the workers
    (each accepts from the shared socket), starts again a worker that dies, and stops them all on SIGINT / SIGTERM.
    ``app_factory`` is the import string of a function that builds one worker's application from ``spec`` (read from
    :data:`WORKER_SPEC_ENV`; ``hf_xmc.cli:serve_worker_app``). Each worker loads the model itself: the label store and a
    read-back IVF index are memory-mapped, so their pages are shared through the page cache; the weights, label texts
    and everything else are per process (``workers`` x the RSS of one, less the mapped pages). ``/metrics``,
    ``/health`` and ``/info`` answer for the worker that takes the request (``/info``'s ``process.pid``); the limits
    (``max_connections``, ``max_queue``) hold per worker. uvicorn pings each worker from the parent and kills one that
    does not answer within ``healthcheck_seconds`` (its own default, 5 s, kills a worker still importing torch on a
    busy machine). Returns 0 once stopped."""
    import uvicorn

    limits = limits or ServingLimits()
    os.environ[WORKER_SPEC_ENV] = json.dumps(spec)  # the spawned workers inherit the environment
    uvicorn.run(app_factory, factory=True, workers=workers, host=host, port=port, log_level=log_level,
                limit_concurrency=limits.max_connections, timeout_graceful_shutdown=math.ceil(limits.request_timeout) + 5,
                timeout_worker_healthcheck=healthcheck_seconds)
    return 0


def serve(model, host: str = "127.0.0.1", port: int = 8000, limits: Optional[ServingLimits] = None, max_batch: int = 64,
          max_wait_ms: float = 2.0, log_level: str = "info", backend: str = "torch", query_encoder: Optional[str] = None,
          wait_for_arrivals: bool = True) -> int:
    """Serve ``model`` with uvicorn until interrupted (SIGINT / SIGTERM: requests in flight are answered first, for at
    most ``request_timeout`` + 5 s) or until the worker dies for good; returns 0, or 1 when the worker died. With
    ``backend="onnx"`` torch keeps one thread: onnxruntime runs the encoder on its own pool, and torch's (left with the
    search's small ops) competing with it for the cores cost more than it saved (predict at batch 1, 200K labels, int8
    codes, 2 cores: 7.7 -> 4.7 ms)."""
    import uvicorn

    if backend == "onnx":
        import torch

        torch.set_num_threads(1)
    limits = limits or ServingLimits()
    server: Optional[uvicorn.Server] = None
    died: list[str] = []

    def on_dead(reason: str) -> None:
        died.append(reason)
        if server is not None:
            server.should_exit = True  # uvicorn checks it every tick: the server stops as on SIGTERM

    app = create_app(model, limits, max_batch, max_wait_ms, backend=backend, on_dead=on_dead, query_encoder=query_encoder,
                     wait_for_arrivals=wait_for_arrivals)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, limit_concurrency=limits.max_connections,
                                           timeout_graceful_shutdown=math.ceil(limits.request_timeout) + 5))
    server.run()
    if died:
        logger.error("hf-xmc serve: the prediction worker is dead (%s)", died[0])
    return 1 if died else 0
