"""Compact label codes (int8, binary) with exact rescoring: what the codes cost, that rescored scores are the vectors'
own inner products, recall against exact search, save / load / stale files, and a model saved with
``label_precision`` reloading through remote code without hf_xmc."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModel

import hf_xmc.models.label_index as label_index_module
from hf_xmc.index import LabelIndex
from tests.models.test_modeling_common import predict_through_remote_code
from tests.test_label_index import clustered, recall
from tests.test_label_store import make_model

faiss = pytest.importorskip("faiss")
KINDS = ("exact", "ivf", "hnsw")


def exact_top(labels, queries, k):
    return LabelIndex(labels, kind="torch").search(queries, k)


@pytest.mark.parametrize("codes", ["int8", "binary"])
@pytest.mark.parametrize("kind", KINDS)
def test_coded_search_scores_candidates_exactly_and_costs_its_bytes(kind, codes):
    labels, queries = clustered(3000, 60, dim=64)
    params = {"ivf_nlist": 16, "ivf_nprobe": 16} if kind == "ivf" else {}
    index = LabelIndex(labels, kind=kind, codes=codes, **params)
    assert index.rescore_factor == {"int8": 2, "binary": 10}[codes]
    # the faiss index holds a byte (int8) or a bit (binary) per dimension, not the 4 bytes of the vectors
    stored = index._index.storage if kind == "hnsw" else index._index  # HNSW keeps its codes in a storage index
    stored = faiss.downcast_IndexBinary(stored) if codes == "binary" else faiss.downcast_index(stored)
    assert stored.code_size == {"int8": 64, "binary": 8}[codes]
    scores, ids = index.search(queries, 10)
    assert (ids >= 0).all()
    # every returned score is the exact inner product of the query with the stored vector (rescored, not the codes')
    np.testing.assert_allclose(scores, np.einsum("qd,qkd->qk", queries, labels[ids]), rtol=1e-5, atol=1e-5)
    assert (np.diff(scores, axis=1) <= 1e-6).all()  # best first
    _, want = exact_top(labels, queries, 10)
    assert recall(ids, want) > (0.9 if codes == "int8" else 0.6)


@pytest.mark.parametrize("codes", ["int8", "binary"])
def test_recall_grows_with_the_rescore_factor_and_is_exact_over_every_candidate(codes):
    labels, queries = clustered(2000, 80, dim=64)
    want_s, want = exact_top(labels, queries, 10)
    found = [recall(LabelIndex(labels, kind="exact", codes=codes, rescore_factor=f).search(queries, 10)[1], want) for f in (1, 4, 200)]
    assert found[0] <= found[1] <= found[2] == 1.0
    assert found[0] < 1.0  # the codes alone do lose neighbours: rescoring is what brings them back
    scores, _ = LabelIndex(labels, kind="exact", codes=codes, rescore_factor=200).search(queries, 10)
    np.testing.assert_allclose(scores, want_s, atol=1e-5)


def test_bad_codes_are_refused():
    labels, _ = clustered(100, 1, dim=12)
    with pytest.raises(ValueError, match="multiple of 8"):
        LabelIndex(labels, codes="binary")
    with pytest.raises(ValueError, match="unknown label codes"):
        LabelIndex(labels, codes="int4")


@pytest.mark.parametrize("codes", ["int8", "binary"])
def test_add_and_select_keep_the_codes(codes):
    labels, queries = clustered(1200, 30, dim=32, seed=1)
    index = LabelIndex(labels[:1000], kind="exact", codes=codes, rescore_factor=1000)
    index.add(labels[1000:])
    np.testing.assert_array_equal(index.search(queries, 5)[1], exact_top(labels, queries, 5)[1])
    keep = np.arange(0, 1200, 2)
    kept = index.select(keep)
    assert (kept.codes, kept.rescore_factor, kept.num_labels) == (codes, 1000, 600)
    np.testing.assert_array_equal(kept.search(queries, 5)[1], exact_top(labels[keep], queries, 5)[1])


@pytest.mark.parametrize("codes", ["int8", "binary"])
def test_coded_index_file_is_reused_and_a_file_of_other_codes_rebuilt(tmp_path, monkeypatch, codes):
    labels, queries = clustered(1500, 20, dim=32)
    index = LabelIndex(labels, kind="ivf", codes=codes, ivf_nlist=8, ivf_nprobe=8, rescore_factor=7)
    index.save(tmp_path)
    meta = json.load(open(tmp_path / label_index_module.INDEX_META_FILE))
    assert (meta["codes"], meta["rescore_factor"]) == (codes, 7)
    before = index.search(queries, 5)
    built = []
    original = LabelIndex._build_faiss
    monkeypatch.setattr(LabelIndex, "_build_faiss", lambda self: built.append(self.codes) or original(self))
    paths = dict(meta_path=str(tmp_path / label_index_module.INDEX_META_FILE), index_path=str(tmp_path / label_index_module.INDEX_FILE))
    loaded = LabelIndex.load(labels, **paths)
    assert not built and loaded.restored_from_file and (loaded.codes, loaded.rescore_factor) == (codes, 7)
    np.testing.assert_array_equal(loaded.search(queries, 5)[1], before[1])
    other = "binary" if codes == "int8" else "int8"
    rebuilt = LabelIndex.load(labels, codes=other, **paths)  # the file codes other vectors' bytes: never read as these
    assert built == [other] and not rebuilt.restored_from_file and rebuilt.rescore_factor == {"int8": 2, "binary": 10}[other]
    # a file of the same codes built from other vectors (same shape, the metadata edited to match) is caught and rebuilt
    LabelIndex(labels[::-1].copy(), kind="ivf", codes=codes, ivf_nlist=8).save(tmp_path / "other")
    swapped = LabelIndex.load(labels, meta_path=paths["meta_path"], index_path=str(tmp_path / "other" / label_index_module.INDEX_FILE))
    assert not swapped.restored_from_file


@pytest.mark.parametrize("precision", ["int8", "binary"])
def test_model_saved_with_label_precision_reloads_through_remote_code(tiny_encoder_dir, tiny_task, tmp_path, precision):
    texts = list(tiny_task[0].test.texts[:8])
    model = make_model(tiny_encoder_dir, tiny_task[0])
    full = model.predict(texts, k=5)
    model.save_pretrained(tmp_path / "model", label_precision=precision)
    assert (model.config.label_codes, model.config.label_embeddings_dtype) == (precision, "float32")
    assert model.label_index.codes == precision and model.label_index_is_current()
    config = json.load(open(tmp_path / "model" / "config.json"))
    assert config["label_codes"] == precision and (tmp_path / "model" / label_index_module.INDEX_FILE).exists()
    coded = model.predict(texts, k=5)
    # 40 labels: int8 rescores its top 10, binary its top 50 (every label): binary ranks exactly as float does
    assert (coded.label_ids[:, 0] == full.label_ids[:, 0]).mean() >= 0.75
    if precision == "binary":
        np.testing.assert_array_equal(coded.label_ids, full.label_ids)
    np.testing.assert_allclose(coded.scores[coded.label_ids == full.label_ids], full.scores[coded.label_ids == full.label_ids], atol=1e-5)
    reloaded = AutoModel.from_pretrained(tmp_path / "model")
    assert reloaded.label_index.codes == precision and reloaded.label_index.restored_from_file
    np.testing.assert_array_equal(reloaded.predict(texts, k=5).label_ids, coded.label_ids)
    result = predict_through_remote_code(tmp_path / "model", tmp_path, texts)
    assert result["ids"] == coded.label_ids.tolist()
    np.testing.assert_allclose(np.array(result["scores"]), coded.scores, atol=1e-5)


def test_label_precision_float16_converts_the_store_and_bad_values_are_refused(tiny_encoder_dir, tiny_task, tmp_path):
    model = make_model(tiny_encoder_dir, tiny_task[0], label_codes="int8")
    assert model.label_index.codes == "int8"
    model.save_pretrained(tmp_path / "half", label_precision="float16")
    assert (model.config.label_codes, model.label_embeddings.dtype, model.label_index.codes) == ("float", torch.float16, "float")
    assert not (tmp_path / "half" / label_index_module.INDEX_FILE).exists()
    with pytest.raises(ValueError, match="label_precision must be one of"):
        model.set_label_precision("int4")
    with pytest.raises(ValueError, match="label_codes must be one of"):
        make_model(tiny_encoder_dir, tiny_task[0], label_codes="int4")


def test_precision_set_before_any_index_is_the_saved_store_and_its_codes_reload_without_a_rebuild(tiny_encoder_dir, tiny_task, tmp_path, caplog):
    """float16 then int8 on a model whose index was never built: the store is float16 at once, so the codes are built
    over the float16 vectors that are saved, and the reload reads label_index.faiss instead of training it again."""
    model = make_model(tiny_encoder_dir, tiny_task[0])
    model.label_index = None
    model.set_label_precision("float16")
    assert model.label_embeddings.dtype == torch.float16  # no index to rebuild, the store converted all the same
    model.set_label_precision("int8")
    model.ensure_label_index()
    model.save_pretrained(tmp_path / "model")
    assert json.load(open(tmp_path / "model" / label_index_module.INDEX_META_FILE))["dtype"] == "float16"
    with caplog.at_level("WARNING"):
        reloaded = AutoModel.from_pretrained(tmp_path / "model")
    assert reloaded.label_index.codes == "int8" and reloaded.label_index.restored_from_file
    assert "rebuilding" not in caplog.text
    meta_path = tmp_path / "model" / label_index_module.INDEX_META_FILE
    meta = json.load(open(meta_path))
    json.dump({**meta, "dtype": "float32"}, open(meta_path, "w"))  # an index file of other vectors: rebuilt, and said so
    with caplog.at_level("WARNING"):
        reloaded = AutoModel.from_pretrained(tmp_path / "model")
    assert not reloaded.label_index.restored_from_file and "describes other label vectors" in caplog.text


def test_unknown_codes_in_a_saved_index_file_fall_back_to_searching_the_vectors(tmp_path, caplog):
    labels, queries = clustered(500, 10, dim=32)
    LabelIndex(labels, codes="int8").save(tmp_path)
    meta_path = tmp_path / label_index_module.INDEX_META_FILE
    meta = json.load(open(meta_path))
    json.dump({**meta, "codes": "int4"}, open(meta_path, "w"))  # a hand-edited cache: never a reason to refuse
    loaded = LabelIndex.load(labels, meta_path=str(meta_path), index_path=str(tmp_path / label_index_module.INDEX_FILE))
    assert loaded.codes == "float" and "unknown label codes 'int4'" in caplog.text
    np.testing.assert_array_equal(loaded.search(queries, 5)[1], exact_top(labels, queries, 5)[1])
