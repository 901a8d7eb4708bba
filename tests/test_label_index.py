"""LabelIndex: exact/HNSW faiss search, the torch fallback, save/load and stale-cache rebuilds."""

import json
import os

import numpy as np
import pytest

import hf_xmc.models.label_index as label_index_module
from hf_xmc.index import LabelIndex

faiss = pytest.importorskip("faiss")


@pytest.fixture(scope="module")
def vectors():
    rng = np.random.default_rng(0)
    labels = rng.standard_normal((500, 16)).astype(np.float32)
    queries = rng.standard_normal((40, 16)).astype(np.float32)
    return labels, queries


def brute_force(labels, queries, k):
    scores = queries @ labels.T
    ids = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, ids, axis=1), ids


@pytest.mark.parametrize("kind", ["exact", "torch"])
def test_exact_kinds_match_brute_force(vectors, kind):
    labels, queries = vectors
    index = LabelIndex(labels, kind=kind, chunk_size=64)  # several torch chunks exercise the running top-k merge
    scores, ids = index.search(queries, k=7, batch_size=16)
    ref_scores, ref_ids = brute_force(labels, queries, 7)
    assert ids.dtype == np.int64 and scores.dtype == np.float32 and ids.shape == (40, 7)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-5, atol=1e-5)
    assert np.all(np.diff(scores, axis=1) <= 0)


def test_hnsw_recall(vectors):
    labels, queries = vectors
    _, ids = LabelIndex(labels, kind="hnsw", hnsw_ef_search=200).search(queries, k=10)
    _, ref = brute_force(labels, queries, 10)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ids, ref)])
    assert recall > 0.95


def test_k_larger_than_label_count_pads(vectors):
    labels, queries = vectors
    scores, ids = LabelIndex(labels[:3], kind="exact").search(queries[:2], k=5)
    assert (ids[:, 3:] == -1).all() and np.isneginf(scores[:, 3:]).all()
    assert sorted(ids[0, :3].tolist()) == [0, 1, 2]


def test_bad_inputs(vectors):
    labels, queries = vectors
    with pytest.raises(ValueError, match="kind"):
        LabelIndex(labels, kind="ivf")
    with pytest.raises(ValueError, match="non-empty 2-D"):
        LabelIndex(labels[:0], kind="exact")
    with pytest.raises(ValueError, match=r"shape \(n, 16\)"):
        LabelIndex(labels, kind="exact").search(queries[:, :8], k=3)


@pytest.mark.parametrize("kind", ["exact", "hnsw"])
def test_save_load_reuses_faiss_file(tmp_path, vectors, kind):
    labels, queries = vectors
    index = LabelIndex(labels, kind=kind)
    index.save(str(tmp_path))
    meta = json.load(open(tmp_path / "label_index.json"))
    assert meta["kind"] == kind and meta["num_labels"] == 500 and meta["faiss_version"] == faiss.__version__
    loaded = LabelIndex.load(labels, str(tmp_path / "label_index.json"), str(tmp_path / "label_index.faiss"))
    assert loaded.kind == kind
    np.testing.assert_array_equal(loaded.search(queries, 5)[1], index.search(queries, 5)[1])
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]


def test_stale_or_corrupt_cache_is_rebuilt(tmp_path, vectors):
    labels, queries = vectors
    LabelIndex(labels, kind="exact").save(str(tmp_path))
    meta_path, index_path = str(tmp_path / "label_index.json"), str(tmp_path / "label_index.faiss")
    # other label vectors than the ones indexed: the saved file must not be trusted
    fewer = labels[:100]
    rebuilt = LabelIndex.load(fewer, meta_path, index_path)
    assert rebuilt.num_labels == 100 and rebuilt.search(queries, 3)[1].max() < 100
    # a corrupt file is rebuilt from the vectors
    with open(index_path, "wb") as f:
        f.write(b"garbage")
    recovered = LabelIndex.load(labels, meta_path, index_path)
    np.testing.assert_array_equal(recovered.search(queries, 5)[1], brute_force(labels, queries, 5)[1])


def test_fallback_without_faiss(monkeypatch, vectors):
    labels, queries = vectors
    monkeypatch.setattr(label_index_module, "faiss", None)
    index = LabelIndex(labels, kind="hnsw")
    assert index.kind == "torch"
    np.testing.assert_array_equal(index.search(queries, 4)[1], brute_force(labels, queries, 4)[1])
