"""An exported query encoder: the model's query side (tokens -> search vectors) as ONNX, run by onnxruntime.

``model.export_onnx()`` writes ``query_encoder.onnx`` (torch's dynamo exporter; with ``quantize=True`` onnxruntime's
dynamic int8 quantization of the weights) and ``query_encoder.json`` (sequence length, output width, quantized or
not, and the fingerprint of what it was derived from: the weights, the query head it was traced under (UniDEC's
search mode picks one) and the ``.onnx`` file's own bytes) beside the model; ``save_pretrained`` carries both, and
``predict(texts, backend="onnx")`` encodes the queries with it (tokenised by the model's own tokenizer, the search,
the lexical channel and the calibration as with torch). An export of other weights, another head or whose file bytes
changed is refused in one line (``provenance.py``, policy ``refuse``), never used.

Memory: the ONNX file holds the encoder's weights again (float32, or int8 weights: about a quarter), loaded once by
onnxruntime; per call one batch of activations. Remote-code file: onnxruntime and onnx are imported only when used.
"""

import json
import os
from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch
from torch import nn

from .io_utils import atomic_write, read_json_file, write_json
from .provenance import check_derived, file_digest, fingerprint_of

ONNX_ENCODER_FILE = "query_encoder.onnx"
ONNX_ENCODER_META = "query_encoder.json"
QUERY_BACKENDS = ("torch", "onnx")


class _QueryVectors(nn.Module):
    """``model.embed`` of the query side as a module of two tensors (what the exporter traces)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids, attention_mask, **self.model.query_embed_kwargs())


class OnnxQueryEncoder:
    """An onnxruntime session over an exported query encoder, with the metadata it was exported with."""

    def __init__(self, path: str, meta: dict, threads: Optional[int] = None):
        try:
            import onnxruntime
        except ImportError as err:
            raise ImportError("predict(backend='onnx') needs onnxruntime (pip install onnxruntime)") from err
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:  # onnxruntime's own default: one thread per physical core, too many for processes sharing the cores
            options.intra_op_num_threads = threads
        self.session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.path, self.meta = path, meta

    def encode(self, model, texts: Sequence[str], batch_size: int = 128) -> torch.Tensor:
        """``(n, dim)`` float32 query vectors, batch by batch, longest texts first (as ``encode_texts``)."""
        order = np.argsort(np.fromiter((-len(t) for t in texts), dtype=np.int64, count=len(texts)), kind="stable")
        out = np.empty((len(texts), int(self.meta["dim"])), dtype=np.float32)
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            batch = model.tokenize([texts[i] for i in idx], int(self.meta["max_seq_length"]))
            feeds = {"input_ids": batch["input_ids"].numpy(), "attention_mask": batch["attention_mask"].numpy()}
            out[idx] = self.session.run(None, feeds)[0]
        return torch.from_numpy(out)


class OnnxExportMixin:
    """``export_onnx`` and ``predict(backend="onnx")`` of ``XMCPreTrainedModel``."""

    #: intra-op threads of the onnxruntime session (None: onnxruntime's default, one per physical core); set before the
    #: first ``backend="onnx"`` call (``hf-xmc serve --workers N`` gives each worker process its share of the cores)
    onnx_threads: Optional[int] = None

    def query_embed_kwargs(self) -> dict:
        """What ``embed`` takes besides the tokens to give the search-space query vector (UniDEC: its head)."""
        return {}

    def export_onnx(self, directory: Optional[str] = None, quantize: bool = False, opset: int = 18) -> str:
        """Export the query encoder to ``directory/query_encoder.onnx`` (default: a temporary directory kept with the
        model; ``save_pretrained`` copies it) and attach it for ``predict(backend="onnx")``. ``quantize``: int8
        weights, one scale per output channel (onnxruntime's ``quantize_dynamic``). Returns the file's path. Needs ``onnx``, ``onnxscript``,
        ``onnxruntime``."""
        import tempfile

        directory = directory or tempfile.mkdtemp(prefix="hf_xmc_onnx_")
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, ONNX_ENCODER_FILE)
        was_training, device = self.training, self.device
        self.eval()
        try:
            batch = self.tokenize(["an example query", "a second, longer example query text"], self.config.max_seq_length)
            inputs = (batch["input_ids"].cpu(), batch["attention_mask"].cpu())
            rows, length = torch.export.Dim("batch"), torch.export.Dim("sequence", max=max(2, self.config.max_seq_length))
            module = _QueryVectors(self).to("cpu").eval()
            with torch.no_grad():
                dim = int(module(*inputs).shape[1])
                program = torch.onnx.export(module, inputs, dynamo=True, opset_version=opset, input_names=["input_ids", "attention_mask"],
                                            output_names=["query_vectors"],
                                            dynamic_shapes={"input_ids": {0: rows, 1: length}, "attention_mask": {0: rows, 1: length}})
        finally:
            self.to(device)  # the export ran on CPU
            self.train(was_training)

        def write(tmp: str) -> None:
            program.save(tmp, external_data=False)
            if quantize:
                from onnxruntime.quantization import QuantType, quantize_dynamic

                # per output channel: per tensor lost a sixth of MiniLM's top 10 on WordNet-XMC (overlap with float32
                # 0.82 vs 0.92 per channel), and ran slower (2.5 vs 2.1 ms a query)
                quantize_dynamic(tmp, tmp, weight_type=QuantType.QInt8, per_channel=True)

        atomic_write(path, write)
        meta = {"max_seq_length": self.config.max_seq_length, "dim": dim, "quantized": bool(quantize), "opset": opset,
                "weights": list(self.weights_fingerprint()), "query_head": self.onnx_query_head(), "file": file_digest(path)}
        atomic_write(os.path.join(directory, ONNX_ENCODER_META), lambda p: write_json(p, meta))
        self._onnx_encoder_files = (path, os.path.join(directory, ONNX_ENCODER_META))
        self._onnx_encoder = None
        return path

    def onnx_query_head(self) -> str:
        """What the traced query vector depends on besides the weights: :meth:`query_embed_kwargs` (UniDEC's head)."""
        return json.dumps(self.query_embed_kwargs(), sort_keys=True)

    def onnx_query_encoder(self) -> OnnxQueryEncoder:
        """The attached exported encoder (read on first use); a one-line ``StaleDerivedPartError`` (a ValueError) when
        there is none, or it was exported from other weights, another query head or its file's bytes changed. The weights
        fingerprint (a pass over every weight, tens of milliseconds for a MiniLM) is taken again only when a weight was
        written in place since the last check (torch's version counters), the file's digest once per file, not on
        every predict."""
        files = getattr(self, "_onnx_encoder_files", None)
        if not files:
            raise ValueError(f"{type(self).__name__} has no exported query encoder: call model.export_onnx() (or save one with it)")
        version = (*self.weights_version(), self.onnx_query_head(), self.config.max_seq_length)
        encoder = getattr(self, "_onnx_encoder", None)
        if encoder is not None and getattr(self, "_onnx_checked_version", None) == version:
            return encoder
        meta = read_json_file(files[1]) or {}
        self._check_onnx_export(files[0], meta, check_file=encoder is None)
        if encoder is None:
            self._onnx_encoder = encoder = OnnxQueryEncoder(files[0], meta, threads=self.onnx_threads)
        self._onnx_checked_version = version
        return encoder

    def _check_onnx_export(self, path: str, meta: dict, check_file: bool = True) -> None:
        """Refuse (one line) an export whose recorded inputs are not the model's now: weights (within float64 rounding),
        query length, query head and, with ``check_file``, the ``.onnx`` file's own bytes."""
        recorded = fingerprint_of(weights=meta.get("weights", []), max_seq_length=meta.get("max_seq_length"))
        current = fingerprint_of(weights=list(self.weights_fingerprint()), max_seq_length=self.config.max_seq_length)
        if "query_head" in meta:  # exports from before the head was recorded: weights and length only
            recorded["query_head"], current["query_head"] = meta["query_head"], self.onnx_query_head()
        if check_file and "file" in meta:
            recorded["file"], current["file"] = meta["file"], file_digest(path)
        check_derived("onnx_export", recorded, current, path,
                      "export it again (model.export_onnx())" + (" or switch back with set_search_mode" if self.search_modes else ""))

    def _onnx_matches(self, meta: dict, path: Optional[str] = None) -> bool:
        """Whether an export's metadata names these weights, this query length and head (and, given ``path``, its bytes)."""
        try:
            self._check_onnx_export(path or "", meta, check_file=path is not None)
        except ValueError:
            return False
        return True

    def query_vectors_with(self, backend: str, texts: Sequence[str], batch_size: int = 128, show_progress_bar: Optional[bool] = None) -> torch.Tensor:
        """The search-space query vectors of ``texts`` from ``backend`` (``torch``: ``query_search_vectors``), or from the
        static query encoder while it is the one in use (``StaticQueryEncoderMixin.using_query_encoder``)."""
        if backend not in QUERY_BACKENDS:
            raise ValueError(f"backend must be one of {QUERY_BACKENDS}, got {backend!r}")
        if self.query_encoder == "static":  # the static encoder in use (predict's query_encoder=): no transformer to run
            if backend != "torch":
                raise ValueError(f"backend={backend!r} runs the transformer tower; query_encoder='static' runs none (leave backend='torch')")
            return self.static_query_vectors(texts, batch_size=max(batch_size, 1024))
        if backend == "torch":
            return self.query_search_vectors(texts, batch_size=batch_size, show_progress_bar=show_progress_bar)
        return self.onnx_query_encoder().encode(self, list(texts), batch_size)

    def _save_onnx_encoder(self, save_directory: str) -> None:
        """Copy the attached exported encoder (when it matches the weights) into a directory being saved."""
        files = getattr(self, "_onnx_encoder_files", None)
        if not files or not all(os.path.exists(p) for p in files) or not self._onnx_matches(read_json_file(files[1]) or {}, files[0]):
            return  # none, or exported from other weights, head or bytes: a later predict(backend="onnx") says so
        import shutil

        for source, name in zip(files, (ONNX_ENCODER_FILE, ONNX_ENCODER_META)):
            target = os.path.join(save_directory, name)
            if os.path.abspath(source) != os.path.abspath(target):
                shutil.copyfile(source, target)

    def _load_onnx_encoder(self, fetch) -> None:
        """Attach a saved exported encoder (``fetch(name)``: its local path or None)."""
        path, meta = fetch(ONNX_ENCODER_FILE), fetch(ONNX_ENCODER_META)
        self._onnx_encoder_files = (path, meta) if path and meta else None
        self._onnx_encoder = None
