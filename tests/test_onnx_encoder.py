"""The exported query encoder: ONNX (and int8) agrees with torch, is saved with the model and reloads through remote
code without hf_xmc, and an export of other weights is refused."""

import numpy as np
import pytest
import torch
from transformers import AutoModel

from hf_xmc.models import UniDECModel
from hf_xmc.models.onnx_encoder import ONNX_ENCODER_FILE, ONNX_ENCODER_META
from hf_xmc.serving import PredictionBatcher, create_app
from tests.models.test_modeling_common import predict_through_remote_code
from tests.test_label_store import make_model

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
pytest.importorskip("fastapi")


def test_onnx_query_encoder_ranks_as_torch_and_travels_with_the_model(tiny_encoder_dir, tiny_task, tmp_path):
    data = tiny_task[0]
    texts = list(data.test.texts[:30])
    model = make_model(tiny_encoder_dir, data)
    with pytest.raises(ValueError, match="has no exported query encoder"):  # hf-xmc serve --backend onnx, before any export
        create_app(model, backend="onnx")
    path = model.export_onnx(tmp_path / "export")
    assert path.endswith(ONNX_ENCODER_FILE)
    onnx_vectors = model.query_vectors_with("onnx", texts)
    np.testing.assert_allclose(onnx_vectors.numpy(), model.query_search_vectors(texts).numpy(), atol=1e-5)
    torch_pred, onnx_pred = model.predict(texts, k=10), model.predict(texts, k=10, backend="onnx")
    np.testing.assert_array_equal(onnx_pred.label_ids, torch_pred.label_ids)
    model.save_pretrained(tmp_path / "model")
    assert (tmp_path / "model" / ONNX_ENCODER_FILE).exists() and (tmp_path / "model" / ONNX_ENCODER_META).exists()
    reloaded = AutoModel.from_pretrained(tmp_path / "model")
    np.testing.assert_array_equal(reloaded.predict(texts, k=10, backend="onnx").label_ids, torch_pred.label_ids)
    result = predict_through_remote_code(tmp_path / "model", tmp_path, texts[:4])  # torch backend in a process without hf_xmc
    assert result["ids"] == torch_pred.label_ids[:4, :5].tolist()
    with pytest.raises(ValueError, match="backend must be one of"):
        model.predict(texts, backend="tensorrt")
    batcher = PredictionBatcher(model, max_wait_ms=0, backend="onnx")  # what the server's worker runs
    try:
        served = batcher.submit(texts[:3], 5).result(timeout=60)
        assert [[r["id"] for r in row] for row in served] == torch_pred.label_ids[:3, :5].tolist()
        with torch.no_grad():
            next(model.parameters()).add_(0.5)  # the export is stale now: the worker must encode with it, and refuse
        with pytest.raises(ValueError, match="made from other weights"):
            batcher.submit(texts[:3], 5).result(timeout=60)
    finally:
        batcher.close()


def test_int8_export_is_smaller_and_close(tiny_encoder_dir, tiny_task, tmp_path):
    data = tiny_task[0]
    texts = list(data.test.texts[:40])
    model = make_model(tiny_encoder_dir, data)
    full = model.export_onnx(tmp_path / "fp32")
    small = model.export_onnx(tmp_path / "int8", quantize=True)
    # int8 matrix weights; the tiny encoder's word embeddings (864 x 32, a third of its weights) stay float32
    assert (tmp_path / "int8" / ONNX_ENCODER_FILE).stat().st_size < 0.8 * (tmp_path / "fp32" / ONNX_ENCODER_FILE).stat().st_size
    assert small != full
    model.onnx_threads = 1  # what hf-xmc serve --workers N sets: each process's share of the cores
    quantized = model.query_vectors_with("onnx", texts).numpy()
    assert model.onnx_query_encoder().session.get_session_options().intra_op_num_threads == 1
    exact = model.query_search_vectors(texts).numpy()
    cosine = (quantized * exact).sum(1) / np.linalg.norm(quantized, axis=1) / np.linalg.norm(exact, axis=1)
    assert cosine.min() > 0.95


def test_an_export_of_other_weights_is_refused_and_unidec_exports_its_search_head(tiny_encoder_dir, tiny_task, tmp_path):
    data = tiny_task[0]
    model = make_model(tiny_encoder_dir, data)
    with pytest.raises(ValueError, match="no exported query encoder"):
        model.predict(["a"], backend="onnx")
    model.export_onnx(tmp_path / "a")
    model.predict(["a"], backend="onnx")  # the session is open and checked
    with torch.no_grad():
        next(model.parameters()).add_(0.01)
    with pytest.raises(ValueError, match="made from other weights"):  # checked again after the weights changed
        model.predict(["a"], backend="onnx")
    model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved" / ONNX_ENCODER_FILE).exists()  # a stale export is not carried
    unidec = UniDECModel.from_encoder_pretrained(tiny_encoder_dir, label_space_size=len(data.label_texts), max_seq_length=16)
    unidec.set_search_mode("concat")
    unidec.export_onnx(tmp_path / "u")
    texts = list(data.test.texts[:5])
    np.testing.assert_allclose(unidec.query_vectors_with("onnx", texts).numpy(), unidec.query_search_vectors(texts).numpy(), atol=1e-5)


def test_an_export_traced_under_another_search_head_or_with_other_bytes_is_refused(tiny_encoder_dir, tiny_task, tmp_path):
    """Issue 64 item 4: UniDEC's export freezes the head it was traced under; ONNX queries of the DE head must not
    search the classifier index, and an .onnx file whose bytes changed after the export is not run."""
    data = tiny_task[0]
    texts = list(data.test.texts[:5])
    unidec = UniDECModel.from_encoder_pretrained(tiny_encoder_dir, label_space_size=len(data.label_texts), max_seq_length=16)
    unidec.set_labels(data.label_texts)
    unidec.set_search_mode("de")
    unidec.export_onnx(tmp_path / "u")
    de = unidec.predict(texts, k=5, backend="onnx")
    np.testing.assert_array_equal(de.label_ids, unidec.predict(texts, k=5).label_ids)
    unidec.set_search_mode("classifier")
    with pytest.raises(ValueError, match=r"onnx export was made from other query_head .*set_search_mode"):
        unidec.predict(texts, backend="onnx")
    unidec.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved" / ONNX_ENCODER_FILE).exists()  # an export of another head is not carried either
    unidec.set_search_mode("de")  # back under the head it was traced with: served again
    np.testing.assert_array_equal(unidec.predict(texts, k=5, backend="onnx").label_ids, de.label_ids)

    model = make_model(tiny_encoder_dir, data)
    model.save_pretrained(tmp_path / "m")
    model.export_onnx(tmp_path / "m")
    reference = model.predict(texts, k=5, backend="onnx").label_ids
    reloaded = AutoModel.from_pretrained(tmp_path / "m")
    np.testing.assert_array_equal(reloaded.predict(texts, k=5, backend="onnx").label_ids, reference)
    onnx_file = tmp_path / "m" / ONNX_ENCODER_FILE
    onnx_file.write_bytes(onnx_file.read_bytes() + b"\0")  # a file changed after its export (same weights, same head)
    with pytest.raises(ValueError, match=r"query_encoder.onnx: the onnx export was made from other file"):
        AutoModel.from_pretrained(tmp_path / "m").predict(texts, backend="onnx")
