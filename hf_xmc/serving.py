"""``hf-xmc serve MODEL``: an HTTP endpoint for a saved model (FastAPI + uvicorn), concurrent requests batched.

    hf-xmc serve out/dexml --port 8000
    curl -s localhost:8000/predict -H 'content-type: application/json' -d '{"texts": ["a query"], "k": 5}'

Endpoints:

* ``POST /predict`` ``{"texts": [...], "k": 10, "threshold": null}`` -> ``{"predictions": [[{"id", "uid", "text",
  "score"[, "probability"]}, ...], ...]}``, one list per text, best label first (``threshold``: the labels whose
  calibrated probability reaches it, for a model trained with a validation split);
* ``GET /health`` -> ``{"status": "ok", "model", "labels", "batches", "queries"}`` (batches run and texts served);
* ``GET /labels/{uid}`` -> ``{"id", "uid", "text"}``, 404 for an unknown uid.

Batching: every request joins one queue; a worker thread takes what has arrived, up to ``max_batch`` texts, waiting at
most ``max_wait_ms`` after the first, and runs ``model.predict`` once for them (with the largest ``k`` asked, one call
per distinct ``threshold``); each request gets its own rows, cut to its ``k``. The event loop only parses and answers,
so requests keep arriving while a batch runs. ``--backend onnx`` encodes the queries with the model's exported encoder
(``model.export_onnx``, saved beside the model). Bounds: texts per request, characters per text and ``k`` are refused
with a 4xx and ``{"error": "<one line>"}``, as is a body that is not the JSON above.

Memory: the model as ``from_pretrained`` loads it (its label store memory-mapped), one batch's ``predict`` (``max_batch
x k`` results), and the queued requests' texts (at most ``max_texts x max_chars`` characters each).
"""

import asyncio
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

    max_texts: int = 64
    max_chars: int = 2000
    max_k: int = 100


@dataclass
class _Request:
    texts: list[str]
    k: int
    threshold: Optional[float]
    future: Future = field(default_factory=Future)


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

    def submit(self, texts: list[str], k: int, threshold: Optional[float] = None) -> Future:
        """Queue texts; the future resolves to their ``label_records`` lists."""
        request = _Request(texts, k, threshold)
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

    class PredictRequest(BaseModel):  # defined here, with no postponed annotations: FastAPI reads the body's type
        model_config = ConfigDict(extra="forbid")
        texts: list[str]
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

    @app.post("/predict")
    async def predict(body: PredictRequest):
        if not body.texts:
            raise Refused(422, "texts: give at least one text")
        if len(body.texts) > limits.max_texts:
            raise Refused(413, f"texts: {len(body.texts)} texts, at most {limits.max_texts} a request")
        long = next((i for i, t in enumerate(body.texts) if len(t) > limits.max_chars), None)
        if long is not None:
            raise Refused(413, f"texts[{long}]: {len(body.texts[long])} characters, at most {limits.max_chars}")
        if not 1 <= body.k <= limits.max_k:
            raise Refused(422, f"k: {body.k}, must be between 1 and {limits.max_k}")
        if body.threshold is not None and not getattr(model.config, "score_calibration", None):
            raise Refused(422, "threshold: this model has no calibrated scores (train it with a validation split)")
        try:
            predictions = await asyncio.wrap_future(batcher.submit(list(body.texts), body.k, body.threshold))
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
