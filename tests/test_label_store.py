"""The label store of a saved model: sharded safetensors (index JSON + shards, atomic), memory-mapped loading, fp16
vectors, the IVF index, and that directory checks, pushes and remote-code loading all follow a sharded store."""

import json
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModel

import hf_xmc.models.label_store as label_store
import hf_xmc.models.modeling_xmc as modeling_xmc
from hf_xmc.hub import push_to_hub
from hf_xmc.models import DEXMLModel
from hf_xmc.models.hub_files import model_directory_files
from hf_xmc.models.label_store import LABEL_EMBEDDINGS_FILE, LABEL_EMBEDDINGS_INDEX_FILE
from tests.models.test_modeling_common import predict_through_remote_code
from tests.test_hub import FakeHubApi

SHARD_BYTES = 1500  # 11 rows of 32 fp32 values: the tiny task's 40 labels become 4 shards


def make_model(encoder_dir, data, **config):
    torch.manual_seed(0)
    model = DEXMLModel.from_encoder_pretrained(encoder_dir, max_seq_length=16, label_max_seq_length=16, **config)
    model.build_label_index(data.label_texts, data.label_uids)
    return model


@pytest.fixture
def model(tiny_encoder_dir, tiny_task):
    return make_model(tiny_encoder_dir, tiny_task[0])


def shard_names(n):
    return [f"label_embeddings-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def store_files(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith("label_embeddings"))


def test_sharded_store_round_trip(model, tiny_task, tmp_path):
    texts = tiny_task[0].test.texts[:8]
    before = model.predict(texts, k=5)
    model.save_pretrained(tmp_path, label_shard_size=SHARD_BYTES)
    assert store_files(tmp_path) == sorted([*shard_names(4), LABEL_EMBEDDINGS_INDEX_FILE])
    index = json.load(open(tmp_path / LABEL_EMBEDDINGS_INDEX_FILE))
    assert [s["rows"] for s in index["shards"]] == [11, 11, 11, 7]
    assert index["metadata"] == {"num_labels": 40, "dim": 32, "dtype": "float32", "total_size": 40 * 32 * 4}
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]

    reloaded = AutoModel.from_pretrained(tmp_path)
    # the shards stay separate memory-mapped blocks: search runs over them, nothing joins them
    assert [b.shape[0] for b in reloaded.label_embedding_blocks] == [11, 11, 11, 7]
    assert reloaded.label_index.blocks is not None and len(reloaded.label_index.blocks) == 4
    after = reloaded.predict(texts, k=5)
    np.testing.assert_array_equal(before.label_ids, after.label_ids)
    np.testing.assert_allclose(before.scores, after.scores, atol=1e-6)  # GEMMs of other shapes round differently
    assert torch.equal(reloaded.label_embeddings, model.label_embeddings)  # joined on request, bit for bit
    assert len(reloaded.label_embedding_blocks) == 1

    # re-saving as one file replaces the sharded store: no stale shard or index is left to upload
    model.save_pretrained(tmp_path)
    assert store_files(tmp_path) == [LABEL_EMBEDDINGS_FILE]
    np.testing.assert_array_equal(AutoModel.from_pretrained(tmp_path).predict(texts, k=5).label_ids, before.label_ids)


def test_directory_check_and_push_list_the_shards(model, tmp_path):
    model.save_pretrained(tmp_path, label_shard_size=SHARD_BYTES)
    files = model_directory_files(tmp_path, DEXMLModel)
    assert LABEL_EMBEDDINGS_FILE not in files
    assert {LABEL_EMBEDDINGS_INDEX_FILE, *shard_names(4)} <= set(files)
    api = FakeHubApi()
    push_to_hub(str(tmp_path), "org/sharded", api=api)
    uploaded = api.uploads[0]["files"]
    assert {LABEL_EMBEDDINGS_INDEX_FILE, *shard_names(4)} <= set(uploaded)
    assert uploaded[shard_names(4)[2]] == (tmp_path / shard_names(4)[2]).read_bytes()
    # a shard the index names but the directory lacks makes the directory incomplete
    (tmp_path / shard_names(4)[1]).unlink()
    with pytest.raises(ValueError, match=shard_names(4)[1]):
        model_directory_files(tmp_path, DEXMLModel)
    # shard names are checked: an index cannot point outside the model directory
    json.dump({"shards": [{"file": "../model.safetensors", "rows": 40}]}, open(tmp_path / LABEL_EMBEDDINGS_INDEX_FILE, "w"))
    with pytest.raises(ValueError, match="shard names must look like"):
        model_directory_files(tmp_path, DEXMLModel)


def test_old_single_file_store_with_a_flat_faiss_cache_still_loads(model, tiny_task, tmp_path):
    faiss = pytest.importorskip("faiss")
    texts = tiny_task[0].test.texts[:8]
    before = model.predict(texts, k=5)
    model.save_pretrained(tmp_path)
    # what earlier versions wrote for the exact kind: an IndexFlatIP file and metadata without dtype or fingerprint
    flat = faiss.IndexFlatIP(32)
    flat.add(model.label_embeddings.numpy())
    faiss.write_index(flat, str(tmp_path / "label_index.faiss"))
    meta = {"kind": "exact", "num_labels": 40, "dim": 32, "hnsw_m": 32, "hnsw_ef_construction": 200, "hnsw_ef_search": 128,
            "faiss_version": faiss.__version__}
    json.dump(meta, open(tmp_path / "label_index.json", "w"))
    reloaded = AutoModel.from_pretrained(tmp_path)
    assert reloaded.label_index.kind == "exact" and reloaded.label_index._index is None  # the flat copy is not read
    np.testing.assert_array_equal(reloaded.predict(texts, k=5).label_ids, before.label_ids)


def test_a_failed_save_leaves_the_old_store_whole(model, tiny_task, tmp_path, monkeypatch):
    model.save_pretrained(tmp_path, label_shard_size=SHARD_BYTES)
    saved = {name: (tmp_path / name).read_bytes() for name in store_files(tmp_path)}
    calls = []

    def failing_save_file(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full")
        return real_save_file(tensors, path, metadata=metadata)

    real_save_file = label_store.save_file
    monkeypatch.setattr(label_store, "save_file", failing_save_file)
    original = model.label_embeddings
    model.label_embeddings = original + 1.0  # other vectors, so a half-written store would show
    for shard_size in (SHARD_BYTES, 700):  # the same shard names, and other ones (7 shards)
        calls.clear()
        with pytest.raises(OSError, match="disk full"):
            model.save_pretrained(tmp_path, label_shard_size=shard_size)
        assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]
        assert {name: (tmp_path / name).read_bytes() for name in store_files(tmp_path)} == saved
    monkeypatch.undo()
    reloaded = AutoModel.from_pretrained(tmp_path)
    assert torch.equal(reloaded.label_embeddings, original)


def test_fp16_store(tiny_encoder_dir, tiny_task, model, tmp_path):
    texts = tiny_task[0].test.texts[:20]
    half = make_model(tiny_encoder_dir, tiny_task[0], label_embeddings_dtype="float16")
    assert half.label_embeddings.dtype == torch.float16 and half.label_index.dtype == torch.float16
    full, pred = model.predict(texts, k=5), half.predict(texts, k=5)
    np.testing.assert_array_equal(pred.label_ids[:, 0], full.label_ids[:, 0])
    np.testing.assert_allclose(pred.scores, full.scores, atol=2e-3)
    half.save_pretrained(tmp_path / "half")
    model.save_pretrained(tmp_path / "full")
    with safe_open(str(tmp_path / "half" / LABEL_EMBEDDINGS_FILE), framework="pt") as f:
        assert f.get_slice("label_embeddings").get_dtype() == "F16"
    assert (tmp_path / "half" / LABEL_EMBEDDINGS_FILE).stat().st_size < 0.6 * (tmp_path / "full" / LABEL_EMBEDDINGS_FILE).stat().st_size
    reloaded = AutoModel.from_pretrained(tmp_path / "half")
    assert reloaded.label_embeddings.dtype == torch.float16  # kept in the precision it was stored in
    np.testing.assert_array_equal(reloaded.predict(texts, k=5).label_ids, pred.label_ids)
    with pytest.raises(ValueError, match="label_embeddings_dtype"):
        make_model(tiny_encoder_dir, tiny_task[0], label_embeddings_dtype="bfloat16")


def test_ivf_fp16_sharded_model_through_remote_code(tiny_encoder_dir, tiny_task, tmp_path, monkeypatch):
    pytest.importorskip("faiss")
    texts = list(tiny_task[0].test.texts[:8])
    model = make_model(tiny_encoder_dir, tiny_task[0], index_kind="ivf", label_embeddings_dtype="float16")
    assert model.label_index.kind == "ivf" and model.label_index.ivf_nlist == 1  # 40 labels: one list
    model.label_index.ivf_nprobe = 3
    before = model.predict(texts, k=5)
    model.save_pretrained(tmp_path / "model", label_shard_size=SHARD_BYTES // 2)
    assert (tmp_path / "model" / "label_index.faiss").exists()
    meta = json.load(open(tmp_path / "model" / "label_index.json"))
    assert (meta["kind"], meta["ivf_nlist"], meta["ivf_nprobe"], meta["dtype"]) == ("ivf", 1, 3, "float16")
    monkeypatch.setattr(modeling_xmc.LabelIndex, "_build_faiss", lambda self: pytest.fail("the saved IVF index should be reused"))
    reloaded = AutoModel.from_pretrained(tmp_path / "model")
    assert (reloaded.label_index.kind, reloaded.label_index.ivf_nlist, reloaded.label_index.ivf_nprobe) == ("ivf", 1, 3)
    np.testing.assert_array_equal(reloaded.predict(texts, k=5).label_ids, before.label_ids)
    # from_pretrained says what each part of the load took; the parts fit in the total
    parts = reloaded.load_seconds
    assert {"weights", "tokenizer", "labels", "label_store", "label_index", "query_encoders", "checks", "total"} <= set(parts)
    assert all(v >= 0 for v in parts.values()) and sum(v for k, v in parts.items() if k != "total") <= parts["total"] + 1e-3
    # the read-back IVF lists are memory-mapped, read-only: a label added is added as to the in-memory index
    new_texts, new_uids = ["a label added later", "another one"], ["added-1", "added-2"]
    model.add_labels(new_texts, new_uids)
    reloaded.add_labels(new_texts, new_uids)
    np.testing.assert_array_equal(reloaded.predict(new_texts + texts, k=5).label_ids, model.predict(new_texts + texts, k=5).label_ids)
    result = predict_through_remote_code(tmp_path / "model", tmp_path, texts)
    assert result["ids"] == before.label_ids.tolist()
    np.testing.assert_allclose(np.array(result["scores"]), before.scores, atol=1e-5)


@pytest.mark.slow
def test_bench_index_runs_small(tmp_path):
    from benchmarks.bench_index import main

    out = tmp_path / "index_scale.json"
    # in process: the subprocess per phase only isolates peak-memory figures, which this smoke test does not check
    report = main(["--num_labels", "3000", "--dim", "32", "--hnsw_max_labels", "1000", "--only", "ivf fp16", "exact int8", "exact binary", "hnsw",
                   "--out", str(out), "--in_process"])
    rows = {r["name"]: r for r in report["results"]}
    assert list(rows) == [
        "exact", "ivf fp16 nprobe=16", "ivf fp16 nprobe=64", "ivf fp16 nprobe=256",  # exact first: the ground truth
        "exact int8 factor=1", "exact int8 factor=2", "exact int8 factor=4",
        "exact binary factor=4", "exact binary factor=10", "exact binary factor=20",
        "exact @1,000", "hnsw ef_search=128", "hnsw ef_search=512",
    ]
    # the codes: a byte / a bit a dimension on disk, recall growing with the candidates rescored from the store
    assert rows["exact int8 factor=1"]["index_bytes"] < 3000 * 32 + 5000 < rows["exact"]["store_bytes"] / 3
    assert rows["exact binary factor=4"]["index_bytes"] < 3000 * 4 + 5000
    for codes, factors in (("int8", (1, 2, 4)), ("binary", (4, 10, 20))):
        found = [rows[f"exact {codes} factor={f}"]["recall@100"] for f in factors]
        assert found == sorted(found) and found[-1] > (0.97 if codes == "int8" else 0.6), (codes, found)
    assert rows["exact"]["recall@100"] == 1.0 and rows["exact"]["index_bytes"] < 1000  # metadata only
    assert rows["ivf fp16 nprobe=256"]["recall@100"] > 0.98  # 75 lists: all probed, fp16 rounding aside
    assert rows["hnsw ef_search=512"]["recall@100"] > 0.98 and rows["hnsw ef_search=512"]["num_labels"] == 1000
    assert rows["ivf fp16 nprobe=16"]["store_bytes"] < 0.6 * rows["exact"]["store_bytes"]
    assert json.load(open(out))["results"] == json.loads(json.dumps(report["results"]))


def test_config_ivf_nprobe_reaches_every_index_the_model_builds(tiny_encoder_dir, tiny_task, tmp_path):
    pytest.importorskip("faiss")
    with pytest.raises(ValueError, match="ivf_nprobe"):
        make_model(tiny_encoder_dir, tiny_task[0], index_kind="ivf", ivf_nprobe=0)
    model = make_model(tiny_encoder_dir, tiny_task[0], index_kind="ivf", ivf_nprobe=5)
    assert model.label_index.ivf_nprobe == 5  # build_label_index (training-time mining and evaluation build this way)
    model.label_index = None
    model.search(model.encode_queries(list(tiny_task[0].test.texts[:2])), k=3)  # index built lazily from the store
    assert model.label_index.ivf_nprobe == 5
    model.save_pretrained(tmp_path / "model")
    reloaded = DEXMLModel.from_pretrained(tmp_path / "model")
    assert reloaded.config.ivf_nprobe == 5 and reloaded.label_index.ivf_nprobe == 5


def test_weights_fingerprint_is_float64_exact_so_thread_counts_agree(tiny_encoder_dir, tiny_task):
    """The fingerprint (which decides whether a label index or an ONNX export still matches the weights) sums in
    float64: a float32 sum depends on the reduction order, so the same weights fingerprinted with another thread count
    (or on another device) could look changed, and an export made there was refused as stale."""
    model = make_model(tiny_encoder_dir, tiny_task[0])
    tensors = [t.detach() for t in (*model.parameters(), *model.buffers())]
    fingerprint = model.weights_fingerprint()
    reference = [v for t in tensors for v in (t.numpy().astype(np.float64).sum(), np.linalg.norm(t.numpy().astype(np.float64).ravel()))]
    np.testing.assert_allclose(fingerprint, reference, rtol=1e-12, atol=1e-12)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert model.label_index_is_current() and model.weights_fingerprint() == pytest.approx(fingerprint, rel=1e-12, abs=1e-12)
    finally:
        torch.set_num_threads(threads)
