"""LabelIndex: exact, HNSW and IVF search, the torch fallback, fp16 and sharded (row-block) vectors, save/load and
stale-cache rebuilds."""

import json
import os

import numpy as np
import pytest
import torch

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
        LabelIndex(labels, kind="annoy")
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
    exact = LabelIndex(labels, kind="exact")  # exact search on CPU needs no faiss at all
    assert exact.kind == "exact" and exact._index is None
    np.testing.assert_array_equal(exact.search(queries, 4)[1], brute_force(labels, queries, 4)[1])


def clustered(num_labels: int, num_queries: int, dim: int = 32, clusters: int = 40, seed: int = 0):
    """Unit vectors around ``clusters`` random centres (labels and queries drawn alike): neighbours are meaningful, so
    ANN recall against exact search is too."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, dim))

    def draw(n):
        x = centres[rng.integers(clusters, size=n)] + 0.6 * rng.standard_normal((n, dim))
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)

    return draw(num_labels), draw(num_queries)


def recall(ids, ref):
    return float(np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(ids, ref)]))


def test_ivf_recall_grows_with_nprobe_and_is_exact_when_probing_every_list():
    labels, queries = clustered(4000, 100)
    _, ref = brute_force(labels, queries, 10)
    index = LabelIndex(labels, kind="ivf", ivf_nprobe=1)
    assert index.ivf_nlist == 100 and isinstance(index._index, faiss.IndexIVFFlat)  # min(4 sqrt(L), L / 40)
    low = recall(index.search(queries, 10)[1], ref)
    index.ivf_nprobe = 16
    mid = recall(index.search(queries, 10)[1], ref)
    index.ivf_nprobe = index.ivf_nlist
    scores, ids = index.search(queries, 10)
    assert low < mid and mid > 0.9
    np.testing.assert_array_equal(ids, ref)
    np.testing.assert_allclose(scores, brute_force(labels, queries, 10)[0], rtol=1e-5, atol=1e-5)


def test_ivf_save_load_restores_kind_and_params_and_reuses_the_file(tmp_path, monkeypatch):
    labels, queries = clustered(2000, 30)
    index = LabelIndex(labels, kind="ivf", ivf_nlist=20, ivf_nprobe=7)
    index.save(str(tmp_path))
    meta = json.load(open(tmp_path / "label_index.json"))
    assert (meta["kind"], meta["ivf_nlist"], meta["ivf_nprobe"], meta["dtype"]) == ("ivf", 20, 7, "float32")
    paths = str(tmp_path / "label_index.json"), str(tmp_path / "label_index.faiss")
    real_build = LabelIndex._build_faiss
    monkeypatch.setattr(LabelIndex, "_build_faiss", lambda self: pytest.fail("the saved index should be reused"))
    loaded = LabelIndex.load(labels, *paths)
    assert (loaded.kind, loaded.ivf_nlist, loaded.ivf_nprobe) == ("ivf", 20, 7)
    np.testing.assert_array_equal(loaded.search(queries, 10)[1], index.search(queries, 10)[1])
    assert LabelIndex.load(labels, *paths, ivf_nprobe=20).ivf_nprobe == 20  # a search parameter: same file
    # another list count, or other vectors of the same shape, rebuild the index
    rebuilt = []
    monkeypatch.setattr(LabelIndex, "_build_faiss", lambda self: rebuilt.append(self.ivf_nlist) or real_build(self))
    assert LabelIndex.load(labels, *paths, ivf_nlist=10).ivf_nlist == 10
    LabelIndex.load(labels[::-1].copy(), *paths)
    assert rebuilt == [10, 20]


def test_cached_index_is_built_once_and_read_back_for_the_same_vectors_only(tmp_path, monkeypatch):
    labels, queries = clustered(2000, 30)
    built = LabelIndex.cached(labels, str(tmp_path / "cache"), kind="ivf", ivf_nlist=20, ivf_nprobe=7)
    assert not built.restored_from_file and (tmp_path / "cache" / "label_index.faiss").is_file()
    real_build = LabelIndex._build_faiss
    monkeypatch.setattr(LabelIndex, "_build_faiss", lambda self: pytest.fail("the cached index should be read back"))
    again = LabelIndex.cached(labels, str(tmp_path / "cache"), kind="ivf", ivf_nlist=20, ivf_nprobe=7)
    assert again.restored_from_file
    np.testing.assert_array_equal(again.search(queries, 10)[1], built.search(queries, 10)[1])
    # other vectors of the same shape: built again, and the cache now holds their index
    monkeypatch.setattr(LabelIndex, "_build_faiss", real_build)
    other, _ = clustered(2000, 30, seed=1)
    rebuilt = LabelIndex.cached(other, str(tmp_path / "cache"), kind="ivf", ivf_nlist=20, ivf_nprobe=7)
    assert not rebuilt.restored_from_file
    assert LabelIndex.cached(other, str(tmp_path / "cache"), kind="ivf", ivf_nlist=20).restored_from_file
    # exact search has no faiss file to keep
    assert not LabelIndex.cached(labels, str(tmp_path / "exact"), kind="exact").restored_from_file
    assert not (tmp_path / "exact" / "label_index.faiss").exists()
    # no directory: built, nothing kept
    assert not LabelIndex.cached(labels, None, kind="ivf", ivf_nlist=20).restored_from_file


def test_stale_hnsw_file_for_other_vectors_of_the_same_shape_is_rebuilt(tmp_path):
    labels, queries = clustered(500, 20)
    LabelIndex(labels, kind="hnsw", hnsw_ef_construction=40).save(str(tmp_path))
    other, _ = clustered(500, 1, seed=1)
    loaded = LabelIndex.load(other, str(tmp_path / "label_index.json"), str(tmp_path / "label_index.faiss"))
    assert recall(loaded.search(queries, 10)[1], brute_force(other, queries, 10)[1]) > 0.95


def test_exact_kinds_keep_no_faiss_copy_and_save_no_faiss_file(tmp_path, vectors):
    labels, _ = vectors
    LabelIndex(labels, kind="hnsw").save(str(tmp_path))
    index = LabelIndex(labels, kind="exact")
    assert index._index is None and index.blocks[0].data_ptr() == labels.ctypes.data  # searches the caller's array
    index.save(str(tmp_path))  # the HNSW file of the earlier save would be a stale upload
    assert not (tmp_path / "label_index.faiss").exists()
    assert json.load(open(tmp_path / "label_index.json"))["kind"] == "exact"


@pytest.mark.parametrize("kind", ["exact", "torch", "hnsw", "ivf"])
def test_row_blocks_search_like_one_array_without_copies(vectors, kind):
    labels, queries = vectors
    blocks = [labels[:130], labels[130:400], labels[400:]]
    whole = LabelIndex(labels, kind=kind, chunk_size=64)
    split = LabelIndex(blocks, kind=kind, chunk_size=64)  # chunks cross the block boundaries
    assert split.num_labels == 500 and [b.data_ptr() for b in split.blocks] == [b.ctypes.data for b in blocks]
    s1, i1 = whole.search(queries, 12)
    s2, i2 = split.search(queries, 12)
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_allclose(s1, s2, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="differ in width or dtype"):
        LabelIndex([labels[:10], labels[10:20, :8]], kind=kind)
    # the public row reads (the static encoder's fit uses them) take rows across the blocks, in the order asked
    rows = np.array([3, 129, 130, 131, 399, 400, 499])
    np.testing.assert_array_equal(split.vectors(rows).numpy(), labels[rows])
    sample = split.sample_vectors(50)
    assert sample.shape == (50, 16) and sample.dtype == np.float32 and len({r.tobytes() for r in sample} - {r.tobytes() for r in labels}) == 0
    np.testing.assert_array_equal(sample, whole.sample_vectors(50))  # a fixed draw


@pytest.mark.parametrize("kind,faiss_type", [("exact", None), ("hnsw", "IndexHNSWSQ"), ("ivf", "IndexIVFScalarQuantizer")])
def test_fp16_vectors_stay_fp16(kind, faiss_type):
    labels, queries = clustered(3000, 50)
    half = labels.astype(np.float16)
    index = LabelIndex(half, kind=kind, hnsw_ef_construction=40, ivf_nprobe=32, chunk_size=1000)
    assert index.dtype == torch.float16 and index.blocks[0].data_ptr() == half.ctypes.data
    if faiss_type:  # faiss holds fp16 codes too, not a widened fp32 copy
        assert type(index._index).__name__ == faiss_type
    scores, ids = index.search(queries, 10)
    ref_scores, ref_ids = brute_force(half.astype(np.float32), queries, 10)
    if kind == "exact":
        np.testing.assert_array_equal(ids, ref_ids)
        np.testing.assert_allclose(scores, ref_scores, rtol=1e-5, atol=1e-5)
    else:
        assert recall(ids, ref_ids) > 0.9


def test_exact_search_keeps_the_score_block_within_budget(monkeypatch, vectors):
    labels, queries = vectors
    monkeypatch.setattr(label_index_module, "SCORE_BLOCK_VALUES", 40 * 50)  # 40 queries -> 50 label rows at a time
    seen = []
    real_chunks = LabelIndex._chunks
    monkeypatch.setattr(LabelIndex, "_chunks", lambda self, rows, blocks=None: seen.append(rows) or real_chunks(self, rows, blocks))
    scores, ids = LabelIndex(labels, kind="exact").search(queries, k=7)
    assert seen == [50]
    np.testing.assert_array_equal(ids, brute_force(labels, queries, 7)[1])


@pytest.mark.parametrize("kind", ["exact", "torch", "ivf", "hnsw"])
def test_add_and_select_in_place(kind):
    """Labels added after the build are searched like labels built in (IVF keeps its trained lists, HNSW its graph:
    the same faiss object grows); select() keeps given rows, renumbered, as an index built over them would."""
    rng = np.random.default_rng(3)
    base = rng.standard_normal((600, 16)).astype("float32")
    extra = rng.standard_normal((40, 16)).astype("float32")
    queries = rng.standard_normal((20, 16)).astype("float32")
    params = {"ivf_nlist": 8, "ivf_nprobe": 8} if kind == "ivf" else {}
    index = LabelIndex(base, kind=kind, **params)
    faiss_before = index._index
    index.add(extra)
    assert index.num_labels == 640 and index._index is faiss_before
    if faiss_before is not None:
        assert faiss_before.ntotal == 640
    full = np.concatenate([base, extra])
    want_s, want_i = LabelIndex(full, kind="torch").search(queries, 10)
    got_s, got_i = index.search(queries, 10)
    if kind == "hnsw":  # approximate: almost all of the exact top-10, the added rows included
        assert np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got_i, want_i)]) > 0.9
    else:  # exact kinds, and IVF probing every list
        np.testing.assert_array_equal(got_i, want_i)
        np.testing.assert_allclose(got_s, want_s, atol=1e-5)
    keep = np.sort(rng.choice(640, 500, replace=False))
    kept = index.select(keep)
    assert kept.num_labels == 500 and kept.kind == index.kind
    if kind == "ivf":  # the trained lists are reused, not re-trained
        assert kept._index is not index._index and kept._index.ntotal == 500
        np.testing.assert_array_equal(faiss_centroids(kept._index), faiss_centroids(index._index))
    want_s, want_i = LabelIndex(full[keep], kind="torch").search(queries, 10)
    got_s, got_i = kept.search(queries, 10)
    if kind == "hnsw":
        assert np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got_i, want_i)]) > 0.9
    else:
        np.testing.assert_array_equal(got_i, want_i)
    with pytest.raises(ValueError, match="increasing label ids"):
        index.select(np.array([3, 1]))


def faiss_centroids(ivf) -> np.ndarray:
    import faiss

    return faiss.rev_swig_ptr(faiss.downcast_index(ivf.quantizer).get_xb(), ivf.nlist * ivf.d).reshape(ivf.nlist, ivf.d).copy()


def test_faiss_file_is_checked_against_its_recorded_sha256(tmp_path, monkeypatch, caplog):
    """label_index.json records the faiss file's sha256 and the label count; a file that does not match (here: a
    valid faiss index of other vectors, which faiss would read happily) is not read but rebuilt, with a warning."""
    import logging

    import faiss

    rng = np.random.default_rng(7)
    labels = rng.standard_normal((300, 16)).astype("float32")
    queries = rng.standard_normal((5, 16)).astype("float32")
    LabelIndex(labels, kind="hnsw").save(str(tmp_path))
    meta = json.load(open(tmp_path / "label_index.json"))
    assert meta["num_labels"] == 300 and len(meta["sha256"]) == 64
    index_path = str(tmp_path / "label_index.faiss")
    assert LabelIndex.load(labels, str(tmp_path / "label_index.json"), index_path)._index.ntotal == 300
    # swap in another, valid HNSW file of the same shape and parameters: only the hash tells
    other = LabelIndex(rng.standard_normal((300, 16)).astype("float32"), kind="hnsw")
    faiss.write_index(other._index, index_path)
    reads = []
    monkeypatch.setattr(label_index_module.faiss, "read_index", lambda *a: reads.append(a) or faiss.read_index(*a))
    with caplog.at_level(logging.WARNING, logger=label_index_module.logger.name):
        loaded = LabelIndex.load(labels, str(tmp_path / "label_index.json"), index_path)
    assert not reads and "does not match the sha256" in caplog.text
    exact = LabelIndex(labels, kind="torch").search(queries, 5)[1]
    assert np.mean([len(set(a) & set(b)) / 5 for a, b in zip(loaded.search(queries, 5)[1], exact)]) > 0.9


@pytest.mark.parametrize("codes", ["float", "int8", "binary"])
def test_a_read_back_ivf_index_maps_its_lists_and_reads_them_in_before_it_changes(tmp_path, codes):
    """An IVF index read back from its file maps its lists read-only (faiss aborts the process on a write to them, and
    would save a reference to the mapped file): it searches as the index it was saved from, and adding labels,
    selecting some or saving it again first read the lists into memory, with the results of the in-memory index."""
    from hf_xmc.models.label_codes import own_inverted_lists

    rng = np.random.default_rng(5)
    base, extra = rng.standard_normal((800, 32)).astype("float32"), rng.standard_normal((30, 32)).astype("float32")
    queries = rng.standard_normal((25, 32)).astype("float32")
    built = LabelIndex(base, kind="ivf", ivf_nlist=8, ivf_nprobe=8, codes=codes)
    built.save(str(tmp_path / "first"))
    paths = str(tmp_path / "first" / "label_index.json"), str(tmp_path / "first" / "label_index.faiss")
    loaded = LabelIndex.load(base, *paths)

    def lists(index):
        ivf = faiss.downcast_IndexBinary(index._index) if codes == "binary" else faiss.extract_index_ivf(index._index)
        return faiss.downcast_InvertedLists(ivf.invlists)

    assert loaded.restored_from_file and isinstance(lists(loaded), faiss.OnDiskInvertedLists)
    # faiss's prefetch threads (32 started on every search) are off: ten times a one-query search over lists in memory
    assert lists(loaded).prefetch_nthread == 0
    for got, want in zip(loaded.search(queries, 10), built.search(queries, 10)):
        np.testing.assert_array_equal(got, want)
    loaded.save(str(tmp_path / "second"))  # written from memory, not as a reference to the first file
    assert isinstance(lists(loaded), faiss.ArrayInvertedLists) and not own_inverted_lists(loaded._index)
    os.remove(paths[1])
    again = LabelIndex.load(base, str(tmp_path / "second" / "label_index.json"), str(tmp_path / "second" / "label_index.faiss"))
    assert again.restored_from_file
    np.testing.assert_array_equal(again.search(queries, 10)[1], built.search(queries, 10)[1])
    again.add(extra)  # mapped lists are read in first; faiss would abort on them
    built.add(extra)
    assert again._index.ntotal == 830
    np.testing.assert_array_equal(again.search(queries, 10)[1], built.search(queries, 10)[1])
    keep = np.sort(rng.choice(830, 700, replace=False))
    np.testing.assert_array_equal(again.select(keep).search(queries, 10)[1], built.select(keep).search(queries, 10)[1])
