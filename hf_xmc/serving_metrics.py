"""What ``hf-xmc serve`` tells an operator: Prometheus metrics (``GET /metrics``) and the served model (``GET /info``).

``/metrics`` is Prometheus' text format (version 0.0.4), as Text Embeddings Inference and most model servers expose it:

* ``hf_xmc_requests_total{endpoint, status}``: requests answered, by endpoint (``/predict``, ``/health``, ``/ready``,
  ``/info``, ``/metrics``, ``/labels``, ``other``) and HTTP status (413s refused before parsing included);
* ``hf_xmc_request_duration_seconds{endpoint}``: a histogram of the time from the request's arrival to its answer;
* ``hf_xmc_batch_size``: a histogram of the items each ``predict`` call of the worker served;
* ``hf_xmc_queue_duration_seconds``: a histogram of the time each ``/predict`` request waited in the batcher, from its
  submission to the start of its batch's ``predict`` (``--max_wait_ms`` for company, and the batches before it);
* ``hf_xmc_predict_duration_seconds``: a histogram of the time of each ``predict`` call of the worker (the stages
  below, and building the answer's label records);
* ``hf_xmc_stage_duration_seconds{stage}``: a histogram per stage of a batch's ranking, as the text models time it:
  ``tokenise``, ``encode`` (the query encoder, its tokenisation included), ``search`` (the label index) and ``fuse``
  (the lexical channel);
* gauges: ``hf_xmc_queue_depth`` (items waiting for the worker), ``hf_xmc_worker_up`` (1 while it serves),
  ``hf_xmc_worker_restarts``, ``hf_xmc_labels``.

Memory: a fixed number of counters per (endpoint, status) pair seen and 17 buckets per histogram; nothing per request
is kept. Cost: a lock and a few additions per request, batch and stage (measured in ``benchmarks/bench_serving.py``).
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence
from typing import Any, Optional

#: seconds: from 50 microseconds (a static query encoder's encode) to 10 s (a stalled batch)
LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
STAGES = ("tokenise", "encode", "search", "fuse")
ENDPOINTS = ("/predict", "/health", "/ready", "/info", "/metrics")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, their sum and count. Not thread-safe alone (the caller locks)."""

    def __init__(self, buckets: Sequence[float]):
        self.buckets = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        out, running = [], 0
        sep = "," if labels else ""
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {running}')
        suffix = f"{{{labels}}}" if labels else ""
        out += [f"{name}_sum{suffix} {self.sum:.9g}", f"{name}_count{suffix} {self.count}"]
        return out


def endpoint_of(path: str) -> str:
    """The endpoint label of a request path: a bounded set (a uid in ``/labels/{uid}`` is not a label value)."""
    if path in ENDPOINTS:
        return path
    return "/labels" if path.startswith("/labels/") else "other"


class ServingMetrics:
    """The server's counters and histograms (module docstring), safe to update from the event loop and the worker."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Counter = Counter()
        self.durations: dict[str, Histogram] = {}
        self.batch_sizes = Histogram(BATCH_BUCKETS)
        self.queue_waits = Histogram(LATENCY_BUCKETS)
        self.predict_durations = Histogram(LATENCY_BUCKETS)
        self.stages = {stage: Histogram(LATENCY_BUCKETS) for stage in STAGES}

    def request(self, path: str, status: int, seconds: float) -> None:
        endpoint = endpoint_of(path)
        with self._lock:
            self.requests[(endpoint, int(status))] += 1
            self.durations.setdefault(endpoint, Histogram(LATENCY_BUCKETS)).observe(seconds)

    def batch(self, size: int, waits: Sequence[float] = ()) -> None:
        """A ``predict`` call of the worker starts on ``size`` items of requests that waited ``waits`` seconds each."""
        with self._lock:
            self.batch_sizes.observe(size)
            for seconds in waits:
                self.queue_waits.observe(seconds)

    def predicted(self, seconds: float) -> None:
        """A ``predict`` call of the worker took ``seconds`` (label records included)."""
        with self._lock:
            self.predict_durations.observe(seconds)

    def stage(self, name: str, seconds: float) -> None:
        """A model's stage observer (``model.stage_observer``): one stage of one ranking took ``seconds``."""
        histogram = self.stages.get(name)
        if histogram is not None:
            with self._lock:
                histogram.observe(seconds)

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        """The text exposition of every metric, with ``gauges`` (name -> (help, value)) read by the caller now."""
        with self._lock:
            lines = ["# HELP hf_xmc_requests_total Requests answered, by endpoint and HTTP status.", "# TYPE hf_xmc_requests_total counter"]
            lines += [f'hf_xmc_requests_total{{endpoint="{e}",status="{s}"}} {n}' for (e, s), n in sorted(self.requests.items())]
            lines += ["# HELP hf_xmc_request_duration_seconds Time from a request's arrival to its answer.",
                      "# TYPE hf_xmc_request_duration_seconds histogram"]
            for endpoint, histogram in sorted(self.durations.items()):
                lines += histogram.lines("hf_xmc_request_duration_seconds", f'endpoint="{endpoint}"')
            lines += ["# HELP hf_xmc_batch_size Items served by one predict call of the worker.", "# TYPE hf_xmc_batch_size histogram"]
            lines += self.batch_sizes.lines("hf_xmc_batch_size")
            lines += ["# HELP hf_xmc_queue_duration_seconds Time a request waited in the batcher before its batch's predict started.",
                      "# TYPE hf_xmc_queue_duration_seconds histogram"]
            lines += self.queue_waits.lines("hf_xmc_queue_duration_seconds")
            lines += ["# HELP hf_xmc_predict_duration_seconds Time of one predict call of the worker (answers' records included).",
                      "# TYPE hf_xmc_predict_duration_seconds histogram"]
            lines += self.predict_durations.lines("hf_xmc_predict_duration_seconds")
            lines += ["# HELP hf_xmc_stage_duration_seconds Time of one stage of a batch's ranking (encode includes tokenise).",
                      "# TYPE hf_xmc_stage_duration_seconds histogram"]
            for stage, histogram in self.stages.items():
                lines += histogram.lines("hf_xmc_stage_duration_seconds", f'stage="{stage}"')
        for name, (help_text, value) in gauges.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value:g}"]
        return "\n".join(lines) + "\n"


def request_metrics(app, metrics: ServingMetrics):
    """ASGI middleware: every HTTP request's endpoint, status and duration into ``metrics`` (outermost, so the body
    limit's 413s are counted too). Pure ASGI, no per-request task or copy: a few microseconds a request."""

    async def counted(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        start, status = time.perf_counter(), 500

        async def watched(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await app(scope, receive, watched)
        finally:
            metrics.request(scope.get("path", ""), status, time.perf_counter() - start)

    return counted


def model_info(model, backend: str = "torch", limits: Optional[Any] = None) -> dict:
    """``GET /info``: what is served: the model class, labels, search mode, query encoders (the default and the ones
    available), lexical channel and calibration, the label index, the versions of the libraries, and the fingerprints of
    the derived parts (``provenance.py``), so that two replicas can be compared, and what loading it took, by part."""
    import platform

    import torch
    import transformers

    from . import __version__

    static = getattr(model, "static_query_encoder", None)
    encoders = ["transformer"] + (["static"] if static is not None else [])
    index = getattr(model, "label_index", None)
    config = model.config
    meta = getattr(model, "static_query_encoder_meta", None) or {}
    fingerprints: dict[str, Any] = {"weights": model.weights_summary(), "labels": model.labels_digest()}
    try:
        fingerprints["ranking"] = model.ranking_fingerprint()
    except Exception:  # a ranking part that cannot be read (a ranker without omikuji): the others still say enough
        fingerprints["ranking"] = None
    if static is not None:
        fingerprints["static_query_encoder"] = meta.get("fitted_from")
    onnx_files = getattr(model, "_onnx_encoder_files", None)
    return {
        "model": type(model).__name__,
        "labels": len(model.label_texts or ()),
        "search_mode": getattr(config, "search_mode", None),
        "query_encoder": {"default": getattr(model, "query_encoder", "transformer"), "available": encoders, "backend": backend,
                          "onnx_export": bool(onnx_files)},
        "lexical_channel": model.lexical_channel is not None,
        "calibrated": model.score_calibration is not None,
        "label_index": {"kind": getattr(config, "index_kind", None), "codes": getattr(config, "label_codes", None),
                        "built": index is not None},
        "versions": {"hf_xmc": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "fingerprints": fingerprints,
        "load_seconds": getattr(model, "load_seconds", None),  # from_pretrained's parts (weights, labels, index, ...)
        "limits": {name: getattr(limits, name) for name in vars(limits)} if limits is not None else None,
    }
