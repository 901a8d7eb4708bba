"""``hf-xmc serve MODEL``: an HTTP endpoint for a saved model (FastAPI + uvicorn), concurrent requests batched.

    hf-xmc serve out/dexml --port 8000
    curl -s localhost:8000/predict -H 'content-type: application/json' -d '{"texts": ["a query"], "k": 5}'

Endpoints:

* ``POST /predict`` ``{"texts": [...], "k": 10, "threshold": null}`` -> ``{"predictions": [[{"id", "uid", "text",
  "score"[, "probability"]}, ...], ...]}``, one list per text, best label first (``threshold``: the labels whose
  calibrated probability reaches it, for a model trained with a validation split). A model that takes images (MUFIN)
  also reads ``"images"``: per item a list of base64-encoded image files (PNG, JPEG, ...; a ``data:image/...;base64,``
  prefix is allowed), ``[]`` for none; its ``texts`` may then be left out or hold ``null`` for image-only items;
* ``GET /health`` -> ``{"status": "ok", "model", "labels", "batches", "queries"}`` (batches run and texts served);
* ``GET /labels/{uid}`` -> ``{"id", "uid", "text"}``, 404 for an unknown uid.

Batching: every request joins one queue; a worker thread takes what has arrived, up to ``max_batch`` texts, waiting at
most ``max_wait_ms`` after the first, and runs ``model.predict`` once for them (with the largest ``k`` asked, one call
per distinct ``threshold``); each request gets its own rows, cut to its ``k``. The event loop only parses and answers,
so requests keep arriving while a batch runs. ``--backend onnx`` encodes the queries with the model's exported encoder
(``model.export_onnx``, saved beside the model). Bounds: texts per request, characters per text and ``k`` are refused
with a 4xx and ``{"error": "<one line>"}``, as are images per item, bytes per image, an image that does not decode
and a body that is not the JSON above.

Memory: the model as ``from_pretrained`` loads it (its label store memory-mapped), one batch's ``predict`` (``max_batch
x k`` results), and the queued requests' texts (at most ``max_texts x max_chars`` characters each) and decoded images
(at most ``max_texts x max_images`` images of ``max_image_bytes`` encoded bytes each, held as PIL images until their
batch runs).
"""

import asyncio
import base64
import binascii
import io
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ServingLimits:
    """What one request may ask for (larger ones are refused, not truncated)."""

    max_texts: int = 64  # items (texts, or texts and image bags) a request
    max_chars: int = 2000
    max_k: int = 100
    max_images: int = 16  # images an item (models that take images)
    max_image_bytes: int = 5_000_000  # encoded bytes an image


@dataclass
class _Request:
    texts: list[Optional[str]]  # one per item (None: an image-only item)
    k: int
    threshold: Optional[float]
    images: Optional[list[list[Any]]] = None  # one bag of PIL images per item, or None for a text-only request
    future: Future = field(default_factory=Future)


class ImageRefused(ValueError):
    """An image of a request that cannot be used: ``status`` 413 (too large) or 422 (not an image)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def decode_images(bags: Sequence[Sequence[str]], limits: "ServingLimits") -> list[list[Any]]:
    """PIL images of base64-encoded image files, per item (``ImageRefused`` names the first one at fault)."""
    from PIL import Image

    out = []
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
                image = Image.open(io.BytesIO(raw))
                image.load()
            except Exception as err:  # PIL raises several kinds for a file it cannot read
                raise ImageRefused(422, f"images[{i}][{j}]: not an image file PIL can read ({type(err).__name__})") from None
            images.append(image)
        out.append(images)
    return out


def label_records(model, ids: Sequence[int], scores: Sequence[float], probabilities: Optional[Sequence[float]] = None) -> list[dict[str, Any]]:
    """``[{"id", "uid", "text", "score"[, "probability"]}, ...]`` of one prediction row, empty slots (id -1) dropped."""
    uids, names = model.label_uids, model.label_texts
    return [{"id": j, "uid": uids[j], "text": names[j], "score": s, **({"probability": probabilities[c]} if probabilities is not None else {})}
            for c, (j, s) in enumerate(zip(ids, scores)) if j >= 0]


class PredictionBatcher:
    """Runs ``model.predict`` in one worker thread over the requests queued meanwhile (module docstring)."""

    def __init__(self, model, max_batch: int = 64, max_wait_ms: float = 2.0, backend: str = "torch"):
        if max_batch < 1 or max_wait_ms < 0:
            raise ValueError(f"max_batch must be >= 1 and max_wait_ms >= 0, got {max_batch} and {max_wait_ms}")
        self.model, self.max_batch, self.max_wait, self.backend = model, max_batch, max_wait_ms / 1000, backend
        self.batches = self.queries = 0
        self._queue: queue.Queue[Optional[_Request]] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="hf-xmc-batcher", daemon=True)
        self._worker.start()

    def submit(self, texts: list[Optional[str]], k: int, threshold: Optional[float] = None, images: Optional[list[list[Any]]] = None) -> Future:
        """Queue items (texts; for a model that takes images, a bag of images per item too); the future resolves to
        their ``label_records`` lists."""
        request = _Request(texts, k, threshold, images)
        self._queue.put(request)
        return request.future

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join()

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch, size, deadline = [first], len(first.texts), time.monotonic() + self.max_wait
            stop = False
            while size < self.max_batch:
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
                size += len(item.texts)
            for threshold in dict.fromkeys(r.threshold for r in batch):
                self._predict([r for r in batch if r.threshold == threshold], threshold)
            self.batches, self.queries = self.batches + 1, self.queries + size
            if stop:
                return

    def _predict(self, requests: list[_Request], threshold: Optional[float]) -> None:
        texts = [t for r in requests for t in r.texts]
        try:
            extra = {} if threshold is None else {"threshold": threshold}
            if self.backend != "torch":
                extra["backend"] = self.backend
            if any(r.images is not None for r in requests):  # one bag per item; text-only requests add empty bags
                extra["images"] = [bag for r in requests for bag in (r.images if r.images is not None else [[] for _ in r.texts])]
            pred = self.model.predict(texts, k=min(max(r.k for r in requests), len(self.model.label_texts)), **extra)
        except Exception as err:  # every request of the call gets the fault; the worker goes on
            for r in requests:
                r.future.set_exception(err)
            return
        probabilities = pred.probabilities.tolist() if pred.probabilities is not None else None
        ids, scores, row = pred.label_ids.tolist(), pred.scores.tolist(), 0
        for r in requests:
            rows = range(row, row + len(r.texts))
            r.future.set_result([label_records(self.model, ids[i][: r.k], scores[i][: r.k], probabilities[i][: r.k] if probabilities else None)
                                 for i in rows])
            row += len(r.texts)


def create_app(model, limits: Optional[ServingLimits] = None, max_batch: int = 64, max_wait_ms: float = 2.0, backend: str = "torch"):
    """The FastAPI application serving ``model`` (module docstring). ``app.state.batcher`` is its
    :class:`PredictionBatcher`, closed when the application shuts down. ``backend="onnx"``: queries are encoded by the
    model's exported encoder (``model.export_onnx``), checked here, before the first request."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict

    limits = limits or ServingLimits()
    if backend != "torch":
        model.query_vectors_with(backend, ["a first query"])  # no export, or a stale one: one clear error now
    batcher = PredictionBatcher(model, max_batch=max_batch, max_wait_ms=max_wait_ms, backend=backend)
    label_ids = {uid: i for i, uid in enumerate(model.label_uids)}

    takes_images = model.takes_images

    class PredictRequest(BaseModel):  # defined here, with no postponed annotations: FastAPI reads the body's type
        model_config = ConfigDict(extra="forbid")
        texts: Optional[list[Optional[str]]] = None
        images: Optional[list[list[str]]] = None  # models that take images: base64-encoded files, a list per item
        k: int = 10
        threshold: Optional[float] = None

    class Refused(Exception):
        def __init__(self, status: int, message: str):
            self.status, self.message = status, message

    @asynccontextmanager
    async def lifespan(app):
        yield
        batcher.close()

    app = FastAPI(title=f"hf_xmc {type(model).__name__}", lifespan=lifespan)
    app.state.batcher = batcher

    @app.exception_handler(Refused)
    async def refused(request: Request, err: Refused):
        return JSONResponse({"error": err.message}, status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
        return JSONResponse({"error": f"{where}: {first.get('msg')}"}, status_code=422)

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
    async def predict(body: PredictRequest):
        texts = items_of(body)
        if not 1 <= body.k <= limits.max_k:
            raise Refused(422, f"k: {body.k}, must be between 1 and {limits.max_k}")
        if body.threshold is not None and not getattr(model.config, "score_calibration", None):
            raise Refused(422, "threshold: this model has no calibrated scores (train it with a validation split)")
        images = None
        if body.images is not None:
            try:  # off the event loop: decoding is CPU work
                images = await asyncio.to_thread(decode_images, body.images, limits)
            except ImageRefused as err:
                raise Refused(err.status, str(err)) from None
        try:
            predictions = await asyncio.wrap_future(batcher.submit(texts, body.k, body.threshold, images))
        except ValueError as err:  # the model's own refusal of an input
            raise Refused(422, str(err).splitlines()[0]) from None
        return {"predictions": predictions}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": type(model).__name__, "labels": len(model.label_texts),
                "batches": batcher.batches, "queries": batcher.queries}

    @app.get("/labels/{uid}")
    async def label(uid: str):
        if uid not in label_ids:
            raise Refused(404, f"no label with uid {uid!r}")
        i = label_ids[uid]
        return {"id": i, "uid": uid, "text": model.label_texts[i]}

    return app


def serve(model, host: str = "127.0.0.1", port: int = 8000, limits: Optional[ServingLimits] = None, max_batch: int = 64,
          max_wait_ms: float = 2.0, log_level: str = "info", backend: str = "torch") -> None:
    """Serve ``model`` with uvicorn until interrupted. With ``backend="onnx"`` torch keeps one thread: onnxruntime runs
    the encoder on its own pool, and torch's (left with the search's small ops) competing with it for the cores cost
    more than it saved (predict at batch 1, 200K labels, int8 codes, 2 cores: 7.7 -> 4.7 ms)."""
    import uvicorn

    if backend == "onnx":
        import torch

        torch.set_num_threads(1)

    uvicorn.run(create_app(model, limits, max_batch, max_wait_ms, backend=backend), host=host, port=port, log_level=log_level)
