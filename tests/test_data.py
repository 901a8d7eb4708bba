"""Tests for hf_xmc.data: XC raw / BoW / filter formats, HF bridge, synthetic generator, bundled Debtags."""

from __future__ import annotations

import gzip
import json
import logging
import os
import pickle
import sys
import tracemalloc

import numpy as np
import pytest
import scipy.sparse as sp

from hf_xmc.data import (
    DEBTAGS_DIR,
    SyntheticLabelTexts,
    XCData,
    XMCDataError,
    XMCDataset,
    filter_predictions,
    from_hf_dataset,
    labels_to_hf_dataset,
    load_debtags,
    load_xc_dataset,
    make_synthetic_xmc,
    read_bow,
    read_filter_file,
    read_sparse_matrix,
    read_xc_labels,
    read_xc_raw,
    to_hf_dataset,
    write_bow,
    write_sparse_matrix,
    write_xc_labels,
    write_xc_raw,
)


def _csr(rows: list[list[int]], num_labels: int) -> sp.csr_matrix:
    """Binary CSR from label lists."""
    m = sp.lil_matrix((len(rows), num_labels), dtype=np.float32)
    for i, r in enumerate(rows):
        for j in r:
            m[i, j] = 1.0
    return m.tocsr()


def _toy(num_labels: int = 6) -> XMCDataset:
    """A small dataset with unicode text, a multi-label row and a single-label row."""
    rows = [[0, 3], [5], [1, 2, 4]]
    return XMCDataset(texts=["héllo wörld", "a \"quoted\" title", "tab\tand\nnewline"],
                      targets=_csr(rows, num_labels), uids=["u0", "u1", "u2"])


def _write_lines(path, lines: list[str]) -> None:
    """Write raw text lines (gzip when the name ends in .gz)."""
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    if str(path).endswith(".gz"):
        data = gzip.compress(data)
    path.write_bytes(data)


def _assert_error(excinfo, path, line: int, *fault_words: str) -> None:
    """The error message names the file, the 1-based line number and the fault."""
    msg = str(excinfo.value)
    assert str(path) in msg, msg
    assert f"line {line}:" in msg, msg
    for w in fault_words:
        assert w in msg, msg
    assert excinfo.value.line == line


def _same_csr(a: sp.spmatrix, b: sp.spmatrix) -> bool:
    """Same shape and same entries."""
    return a.shape == b.shape and abs(sp.csr_matrix(a) - sp.csr_matrix(b)).nnz == 0


def _no_temp_files(directory) -> bool:
    """No leftover temporary files from the atomic writer."""
    return not [p for p in os.listdir(directory) if p.endswith(".tmp")]


# ------------------------------------------------------------------------------------------
# XC raw
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["trn.json.gz", "trn.json"])
def test_xc_raw_round_trip(tmp_path, name):
    ds = _toy()
    path = tmp_path / name
    write_xc_raw(path, ds)
    raw = path.read_bytes()
    assert (raw[:2] == b"\x1f\x8b") == name.endswith(".gz")  # gzip decided by suffix
    back = read_xc_raw(path, num_labels=6)
    assert back.texts == ds.texts and back.uids == ds.uids
    assert _same_csr(back.targets, ds.targets)
    assert back.targets.dtype == np.float32 and back.num_labels == 6 and len(back) == 3
    assert back.num_skipped == 0


def test_xc_raw_gz_output_is_reproducible(tmp_path):
    ds = _toy()
    write_xc_raw(tmp_path / "a.json.gz", ds)
    write_xc_raw(tmp_path / "b.json.gz", ds)
    raw = (tmp_path / "a.json.gz").read_bytes()
    assert raw == (tmp_path / "b.json.gz").read_bytes()  # no (temp) file name embedded
    assert raw[3] == 0 and raw[4:8] == b"\0\0\0\0"  # gzip header: no FNAME flag, mtime = 0


def test_xc_raw_fields_dedup_and_num_labels(tmp_path):
    path = tmp_path / "trn.json"
    _write_lines(path, [
        json.dumps({"uid": "a", "title": "T1", "content": "C1", "target_ind": [4, 1, 4, 1]}),
        json.dumps({"uid": 7, "title": "T2", "target_ind": [2]}),  # no content: fine; int uid -> "7"
        "",  # blank lines are ignored
    ])
    ds = read_xc_raw(path)
    assert ds.num_labels == 5  # max id + 1
    assert ds.texts == ["T1", "T2"] and ds.uids == ["a", "7"]
    assert ds.label_lists() == [[1, 4], [2]]  # duplicates removed, sorted
    assert ds.targets.data.tolist() == [1.0, 1.0, 1.0]
    both = read_xc_raw(path, num_labels=10, text_fields=("title", "content"))
    assert both.texts == ["T1 C1", "T2"] and both.num_labels == 10


def test_xc_raw_unlabeled_points_counted_and_skipped(tmp_path, caplog):
    path = tmp_path / "tst.json.gz"
    _write_lines(path, [json.dumps({"uid": str(i), "title": f"t{i}", "target_ind": [] if i % 2 else [i]})
                        for i in range(5)])
    with caplog.at_level(logging.WARNING, logger="hf_xmc.data.xc_raw"):
        ds = read_xc_raw(path, num_labels=5)
    assert ds.uids == ["0", "2", "4"] and ds.num_skipped == 2
    assert any("skipped 2" in r.getMessage() for r in caplog.records)
    kept = read_xc_raw(path, num_labels=5, skip_unlabeled=False)
    assert len(kept) == 5 and kept.num_skipped == 0
    assert kept.targets.getnnz(axis=1).tolist() == [1, 0, 1, 0, 1]


def test_load_xc_dataset_keeps_unlabeled_test_points_and_skips_unlabeled_training_points(tmp_path):
    """pyxclib averages over every test row (an empty one scores 0): the test file keeps its unlabelled points unless
    ``skip_unlabeled_test_points``; a training point without a label teaches nothing and is always skipped."""
    rows = [json.dumps({"uid": str(i), "title": f"t{i}", "target_ind": [] if i % 2 else [i]}) for i in range(5)]
    for name in ("trn.json", "tst.json"):
        _write_lines(tmp_path / name, rows)
    _write_lines(tmp_path / "lbl.json", [json.dumps({"uid": f"l{j}", "title": f"l{j}"}) for j in range(5)])
    files = [tmp_path / name for name in ("trn.json", "tst.json", "lbl.json")]
    data = load_xc_dataset(*files)
    assert data.train.uids == ["0", "2", "4"] and data.train.num_skipped == 2
    assert data.test.uids == ["0", "1", "2", "3", "4"] and data.test.num_skipped == 0
    assert data.test.targets.getnnz(axis=1).tolist() == [1, 0, 1, 0, 1]
    skipped = load_xc_dataset(*files, skip_unlabeled_test_points=True)
    assert skipped.test.uids == ["0", "2", "4"] and skipped.test.record_indices().tolist() == [0, 2, 4]


GOOD = json.dumps({"uid": "ok", "title": "fine", "target_ind": [0]})


@pytest.mark.parametrize("bad_line, fault", [
    ('{"uid": "x", "title": "t", "target_ind": [1,', "malformed JSON"),
    ('[1, 2, 3]', "expected a JSON object"),
    ('{"title": "t", "target_ind": [1]}', "missing field 'uid'"),
    ('{"uid": "x", "target_ind": [1]}', "missing field 'title'"),
    ('{"uid": "x", "title": "t"}', "missing field 'target_ind'"),
    ('{"uid": "x", "title": 3, "target_ind": [1]}', "field 'title' must be a string"),
    ('{"uid": "x", "title": "t", "target_ind": 1}', "'target_ind' must be a list of ints"),
    ('{"uid": "x", "title": "t", "target_ind": [1.5]}', "'target_ind' must be a list of ints"),
    ('{"uid": "x", "title": "t", "target_ind": [true]}', "'target_ind' must be a list of ints"),
    ('{"uid": "x", "title": "t", "target_ind": [-1]}', "label id -1 is negative"),
    ('{"uid": "x", "title": "t", "target_ind": [2, 10]}', "label id 10 out of range (num_labels=10)"),
])
def test_xc_raw_bad_input(tmp_path, bad_line, fault):
    path = tmp_path / "trn.json.gz"
    _write_lines(path, [GOOD, "", bad_line, GOOD])  # the blank line still counts: fault on line 3
    with pytest.raises(XMCDataError) as ei:
        read_xc_raw(path, num_labels=10)
    _assert_error(ei, path, 3, fault)
    assert isinstance(ei.value, ValueError)
    again = pickle.loads(pickle.dumps(ei.value))  # survives multiprocessing workers
    assert str(again) == str(ei.value) and again.line == 3


def test_xc_raw_corrupt_gzip(tmp_path):
    path = tmp_path / "trn.json.gz"
    path.write_bytes(b"this is not gzip data\n")
    with pytest.raises(XMCDataError) as ei:
        read_xc_raw(path)
    assert str(path) in str(ei.value) and "cannot read/decode" in str(ei.value)


def test_xc_labels_round_trip_and_errors(tmp_path):
    path = tmp_path / "lbl.json.gz"
    uids, texts = ["tag::a", "tag::b", "ü"], ["Label A", "Label: B", ""]
    write_xc_labels(path, uids, texts)
    assert read_xc_labels(path) == (uids, texts)
    # target_ind is optional in label files; content only when asked for
    plain = tmp_path / "lbl.json"
    _write_lines(plain, ['{"uid": "x", "title": "T", "content": "C"}', '{"uid": "y", "title": "U"}'])
    assert read_xc_labels(plain) == (["x", "y"], ["T", "U"])
    assert read_xc_labels(plain, text_fields=("title", "content")) == (["x", "y"], ["T C", "U"])
    _write_lines(plain, ['{"uid": "x", "title": "T"}', '{"uid": "y"}'])
    with pytest.raises(XMCDataError) as ei:
        read_xc_labels(plain)
    _assert_error(ei, plain, 2, "missing field 'title'")


def test_load_xc_dataset_validates_against_label_file(tmp_path):
    ds = _toy(num_labels=6)
    write_xc_raw(tmp_path / "trn.json.gz", ds)
    write_xc_raw(tmp_path / "tst.json.gz", ds.select([1]))
    write_xc_labels(tmp_path / "lbl.json.gz", [f"l{i}" for i in range(6)], [f"label {i}" for i in range(6)])
    data = load_xc_dataset(tmp_path / "trn.json.gz", tmp_path / "tst.json.gz", tmp_path / "lbl.json.gz")
    assert isinstance(data, XCData)
    assert data.num_labels == 6 and data.train.num_labels == 6 and data.test.num_labels == 6
    assert data.test.uids == ["u1"] and data.label_texts[5] == "label 5" and data.label_uids[0] == "l0"
    # only 5 labels now: label id 5 in the train file (line 2) is out of range
    write_xc_labels(tmp_path / "lbl.json.gz", [f"l{i}" for i in range(5)], [f"label {i}" for i in range(5)])
    with pytest.raises(XMCDataError) as ei:
        load_xc_dataset(tmp_path / "trn.json.gz", tmp_path / "tst.json.gz", tmp_path / "lbl.json.gz")
    _assert_error(ei, tmp_path / "trn.json.gz", 2, "label id 5 out of range (num_labels=5)")


class _NotJSON:
    """Not JSON-serialisable: makes the writer fail mid-way."""


@pytest.mark.parametrize("name", ["trn.json.gz", "trn.json"])
def test_failed_write_leaves_no_partial_file(tmp_path, name):
    path = tmp_path / name
    ds = _toy()
    ds.texts[2] = _NotJSON()  # rows 0 and 1 are written before the failure
    with pytest.raises(TypeError):
        write_xc_raw(path, ds)
    assert not path.exists()
    assert os.listdir(tmp_path) == []  # no temp file left behind
    # an existing file is left intact by a failed overwrite
    write_xc_raw(path, _toy())
    before = path.read_bytes()
    with pytest.raises(TypeError):
        write_xc_raw(path, ds)
    assert path.read_bytes() == before and os.listdir(tmp_path) == [name]
    with pytest.raises(TypeError):
        write_xc_labels(tmp_path / "lbl.json", ["a"], [_NotJSON()])
    assert os.listdir(tmp_path) == [name]


def test_written_file_permissions_follow_umask(tmp_path):
    path = tmp_path / "trn.json"
    write_xc_raw(path, _toy())
    mask = os.umask(0)
    os.umask(mask)
    assert (path.stat().st_mode & 0o777) == (0o666 & ~mask)  # not mkstemp's 0600


def test_xmc_dataset_api():
    ds = _toy()
    assert len(ds) == 3 and ds.num_labels == 6
    sub = ds.select([2, 0])
    assert sub.uids == ["u2", "u0"] and sub.texts == [ds.texts[2], ds.texts[0]]
    assert sub.label_lists() == [[1, 2, 4], [0, 3]]
    masked = ds.select(np.array([False, True, False]))
    assert masked.uids == ["u1"] and masked.label_lists() == [[5]]
    assert len(ds.select([])) == 0
    with pytest.raises(IndexError):
        ds.select([3])
    with pytest.raises(ValueError, match="inconsistent lengths"):
        XMCDataset(texts=["a"], targets=_csr([[0], [1]], 2), uids=["a", "b"])
    coerced = XMCDataset(texts=["a"], targets=sp.coo_matrix(np.array([[0, 1]], dtype=np.int64)), uids=["a"])
    assert isinstance(coerced.targets, sp.csr_matrix) and coerced.targets.dtype == np.float32


# ------------------------------------------------------------------------------------------
# BoW and sparse matrix files
# ------------------------------------------------------------------------------------------


def test_bow_read_xc_repository_text(tmp_path):
    path = tmp_path / "train.txt"
    _write_lines(path, ["4 5 3", "0,2 1:0.5 4:2", " 0:1.25", "1", "3:1 3:2"])
    X, Y = read_bow(path)
    assert X.shape == (4, 5) and Y.shape == (4, 3) and X.dtype == np.float32 and Y.dtype == np.float32
    np.testing.assert_allclose(X.toarray(), [[0, 0.5, 0, 0, 2], [1.25, 0, 0, 0, 0], [0] * 5, [0, 0, 0, 3, 0]])
    np.testing.assert_array_equal(Y.toarray(), [[1, 0, 1], [0, 0, 0], [0, 1, 0], [0, 0, 0]])


@pytest.mark.parametrize("name", ["train.txt", "train.txt.gz"])
def test_bow_round_trip(tmp_path, name):
    rng = np.random.default_rng(0)
    X = sp.random(20, 30, density=0.2, format="csr", dtype=np.float32, random_state=1)
    X.data = rng.standard_normal(X.nnz).astype(np.float32) / 7  # values needing 9 digits
    Y = sp.random(20, 8, density=0.15, format="csr", random_state=2)
    Y.data[:] = 1
    Y = Y.tolil()
    Y[3, :] = 0  # an unlabeled point
    Y = Y.tocsr()
    X = X.tolil()
    X[5, :] = 0
    X[3, :] = 0  # a point with neither labels nor features
    X = X.tocsr()
    X.eliminate_zeros()
    Y.eliminate_zeros()
    path = tmp_path / name
    write_bow(path, X, Y)
    lines = (gzip.decompress(path.read_bytes()) if name.endswith(".gz") else path.read_bytes()).decode().splitlines()
    assert lines[0] == "20 30 8" and len(lines) == 21
    assert lines[4] == " "  # unlabeled points start with a space
    X2, Y2 = read_bow(path)
    assert _same_csr(X2, X) and _same_csr(Y2, Y)
    np.testing.assert_array_equal(X2.data, X.data)  # exact float32 round trip


@pytest.mark.parametrize("lines, line, fault", [
    ([], 1, "bad header"),
    (["3 4"], 1, "bad header"),
    (["2 x 3", " 0:1", " 0:1"], 1, "bad header"),
    (["1 4 3", "0 1:1", "1 2:1"], 3, "wrong number of rows"),
    (["3 4 3", "0 1:1", "1 2:1"], 4, "wrong number of rows"),
    (["2 4 3", "0 1:1", "1 4:1"], 3, "feature index 4 out of range"),
    (["2 4 3", "0 1:1", "3 1:1"], 3, "label index 3 out of range"),
    (["2 4 3", "0 1:1", "1 2"], 3, "malformed pair"),
    (["2 4 3", "0 1:1", "1 2:x"], 3, "malformed pair"),
    (["2 4 3", "0 1:1", "1,,2 2:1"], 3, "malformed label list"),
])
def test_bow_bad_input(tmp_path, lines, line, fault):
    path = tmp_path / "train.txt"
    _write_lines(path, lines)
    with pytest.raises(XMCDataError) as ei:
        read_bow(path)
    _assert_error(ei, path, line, fault)


@pytest.mark.parametrize("name", ["trn_X_Y.txt", "trn_X_Y.txt.gz"])
def test_sparse_matrix_round_trip(tmp_path, name):
    M = sp.random(15, 40, density=0.1, format="csr", dtype=np.float32, random_state=3)
    M = M.tolil()
    M[0, :] = 0  # empty first row -> empty line
    M = M.tocsr()
    M.eliminate_zeros()
    path = tmp_path / name
    write_sparse_matrix(path, M)
    back = read_sparse_matrix(path)
    assert back.shape == (15, 40) and back.dtype == np.float32 and _same_csr(back, M)
    np.testing.assert_array_equal(back.data, M.data)
    dense = np.array([[0, 2.5], [1, 0]])
    write_sparse_matrix(path, dense)  # dense input is accepted
    np.testing.assert_array_equal(read_sparse_matrix(path).toarray(), dense)


@pytest.mark.parametrize("lines, line, fault", [
    (["2 3 4", "0:1", "1:1"], 1, "bad header"),
    (["2 -3", "0:1", "1:1"], 1, "bad header"),
    (["2 3", "0:1", "1:1", "2:1"], 4, "wrong number of rows"),
    (["2 3", "0:1"], 3, "wrong number of rows"),
    (["2 3", "0:1", "3:1"], 3, "column index 3 out of range"),
    (["2 3", "0:1", "-1:1"], 3, "column index -1 out of range"),
    (["2 3", "0:1 1;2", "1:1"], 2, "malformed pair"),
])
def test_sparse_matrix_bad_input(tmp_path, lines, line, fault):
    path = tmp_path / "m.txt"
    _write_lines(path, lines)
    with pytest.raises(XMCDataError) as ei:
        read_sparse_matrix(path)
    _assert_error(ei, path, line, fault)


def test_bow_failed_write_leaves_no_file(tmp_path):
    path = tmp_path / "train.txt"
    with pytest.raises(ValueError):
        write_bow(path, sp.eye(3, format="csr"), sp.eye(2, format="csr"))  # row mismatch
    assert not path.exists() and os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------------
# filters
# ------------------------------------------------------------------------------------------


def test_read_filter_file(tmp_path):
    path = tmp_path / "filter_labels_test.txt"
    _write_lines(path, ["0 2", "3\t1", "", "0 2", "2 0"])
    F = read_filter_file(path, num_points=4, num_labels=3)
    assert F.shape == (4, 3) and F.dtype == bool and F.nnz == 3
    assert sorted(zip(*F.nonzero(), strict=True)) == [(0, 2), (2, 0), (3, 1)]
    path.write_text("")
    empty = read_filter_file(path, num_points=4, num_labels=3)
    assert empty.shape == (4, 3) and empty.nnz == 0


@pytest.mark.parametrize("lines, line, fault", [
    (["0 1", "0 1 2"], 2, "malformed line"),
    (["0 1", "a 1"], 2, "malformed line"),
    (["0 1", "4 1"], 2, "point index 4 out of range"),
    (["0 1", "", "1 3"], 3, "label index 3 out of range"),
])
def test_read_filter_file_bad_input(tmp_path, lines, line, fault):
    path = tmp_path / "filter_labels_test.txt"
    _write_lines(path, lines)
    with pytest.raises(XMCDataError) as ei:
        read_filter_file(path, num_points=4, num_labels=3)
    _assert_error(ei, path, line, fault)


def test_filter_predictions_hand_made():
    ids = np.array([[5, 1, 7, 2],
                    [3, 4, 0, 1],
                    [9, 8, -1, -1],
                    [2, 0, 1, 6]])
    scores = np.array([[0.9, 0.8, 0.7, 0.6],
                       [0.5, 0.4, 0.3, 0.2],
                       [1.0, 0.5, -np.inf, -np.inf],
                       [3.0, 2.0, 1.0, 0.0]], dtype=np.float32)
    # filtered pairs: (0,1) (0,7) (1,3) (1,4) (1,0) (2,9) ; (3,5) filters a label row 3 never predicted
    F = sp.csr_matrix((np.ones(7, dtype=bool), ([0, 0, 1, 1, 1, 2, 3], [1, 7, 3, 4, 0, 9, 5])), shape=(4, 10))
    out_ids, out_sc = filter_predictions(ids, scores, F, k=2)
    np.testing.assert_array_equal(out_ids, [[5, 2], [1, -1], [8, -1], [2, 0]])
    np.testing.assert_array_equal(out_sc, np.array([[0.9, 0.6], [0.2, -np.inf], [0.5, -np.inf], [3.0, 2.0]],
                                                   dtype=np.float32))
    assert out_sc.dtype == np.float32 and out_ids.dtype == ids.dtype
    # k larger than the number of predictions, no filter: pure padding
    ids5, sc5 = filter_predictions(ids[:1], scores[:1], None, k=5)
    np.testing.assert_array_equal(ids5, [[5, 1, 7, 2, -1]])
    assert np.isneginf(sc5[0, 4]) and sc5[0, 0] == np.float32(0.9)
    # a label id beyond the filter's columns is never filtered (no aliasing into the next row)
    wide_ids, _ = filter_predictions(np.array([[10, 1], [1, 0]]), np.ones((2, 2)),
                                     sp.csr_matrix(([True], ([1], [0])), shape=(2, 10)), k=2)
    np.testing.assert_array_equal(wide_ids, [[10, 1], [1, -1]])


def test_filter_predictions_matches_reference_loop():
    rng = np.random.default_rng(0)
    n, m, L, k = 50, 12, 30, 5
    ids = np.stack([rng.permutation(L)[:m] for _ in range(n)])
    scores = -np.sort(rng.random((n, m)), axis=1)
    F = sp.random(n, L, density=0.2, format="csr", random_state=4).astype(bool)
    out_ids, out_sc = filter_predictions(ids, scores, F, k)
    Fd = F.toarray()
    for i in range(n):
        kept = [(j, s) for j, s in zip(ids[i], scores[i], strict=True) if not Fd[i, j]][:k]
        kept += [(-1, -np.inf)] * (k - len(kept))
        assert out_ids[i].tolist() == [j for j, _ in kept]
        assert out_sc[i].tolist() == [s for _, s in kept]


# ------------------------------------------------------------------------------------------
# HF datasets bridge
# ------------------------------------------------------------------------------------------


def test_hf_bridge_round_trip():
    import pyarrow as pa

    ds = _toy()
    hf = to_hf_dataset(ds)
    assert hf.column_names == ["uid", "text", "labels"]
    assert hf.features.arrow_schema.field("labels").type == pa.list_(pa.int32())
    assert hf[2] == {"uid": "u2", "text": ds.texts[2], "labels": [1, 2, 4]}
    back = from_hf_dataset(hf, num_labels=6)
    assert back.uids == ds.uids and back.texts == ds.texts and _same_csr(back.targets, ds.targets)
    # index mappings (select/shuffle) are respected
    sub = from_hf_dataset(hf.select([2, 0]), num_labels=6)
    assert sub.uids == ["u2", "u0"] and sub.label_lists() == [[1, 2, 4], [0, 3]]
    empty = from_hf_dataset(hf.select([]), num_labels=6)
    assert len(empty) == 0 and empty.num_labels == 6


def test_hf_bridge_custom_columns_and_errors():
    import datasets

    hf = datasets.Dataset.from_dict({"sentence": ["a", "b", "c"], "tags": [[0], [1, 1], [2]]})
    ds = from_hf_dataset(hf, num_labels=3, text_column="sentence", label_column="tags")
    assert ds.texts == ["a", "b", "c"] and ds.uids == ["0", "1", "2"] and ds.label_lists() == [[0], [1], [2]]
    with pytest.raises(ValueError, match=r"row 2 \(uid '2'\): label id 2 out of range \[0, 2\)"):
        from_hf_dataset(hf, num_labels=2, text_column="sentence", label_column="tags")
    bad = datasets.Dataset.from_dict({"text": ["a", "b"], "labels": [[0], [-3]]})
    with pytest.raises(ValueError, match="row 1 .*label id -3"):
        from_hf_dataset(bad, num_labels=2)
    with pytest.raises(ValueError, match="no column 'labels'"):
        from_hf_dataset(hf, num_labels=3, text_column="sentence")
    nulltext = datasets.Dataset.from_dict({"text": ["a", None], "labels": [[0], [1]]})
    with pytest.raises(ValueError, match="row 1: column 'text' must be a string"):
        from_hf_dataset(nulltext, num_labels=2)


def test_labels_to_hf_dataset():
    from datasets import Value

    hf = labels_to_hf_dataset(["x", "y"], ["label x", "label y"])
    assert hf.column_names == ["label_id", "uid", "text"]
    assert hf.features["label_id"] == Value("int32")
    assert hf[:] == {"label_id": [0, 1], "uid": ["x", "y"], "text": ["label x", "label y"]}


# ------------------------------------------------------------------------------------------
# synthetic
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [None, 17])
def test_synthetic_planted_structure(block, monkeypatch):
    if block is not None:  # points drawn in many blocks (what bounds memory at millions of points)
        from hf_xmc.data import synthetic

        monkeypatch.setattr(synthetic, "_POINT_BLOCK", block)
    data = make_synthetic_xmc(num_labels=50, num_train=200, num_test=40, words_per_label=4,
                              labels_per_point=(1, 3), noise_words=2, zipf_a=1.1, seed=3)
    assert len(data.train) == 200 and len(data.test) == 40 and data.num_labels == 50
    assert data.train.num_labels == 50 and data.test.uids[0] == "tst0"
    assert isinstance(data.label_texts, SyntheticLabelTexts) and len(data.label_texts) == 50
    all_topic = {w for lab in range(50) for w in data.label_texts.label_words(lab)}
    assert len(all_topic) == 200  # topic words are distinct across labels
    for ds in (data.train, data.test):
        for text, labels in zip(ds.texts, ds.label_lists(), strict=True):
            assert 1 <= len(labels) <= 3 and len(set(labels)) == len(labels)
            words = text.split()
            assert len(words) == 2 * len(labels) + 2  # 2 words per label + 2 noise words
            for lab in labels:
                assert sum(w in data.label_texts.label_words(lab) for w in words) == 2
            assert sum(w not in all_topic for w in words) == 2  # noise words are not topic words
    for lab in (0, 17, 49):
        assert data.label_texts[lab] == "label " + " ".join(data.label_texts.label_words(lab))
    assert data.train.targets.indices.dtype == np.int32 and data.train.targets.has_sorted_indices


def test_synthetic_determinism_and_skew():
    a = make_synthetic_xmc(1000, 3000, 0, seed=1)
    b = make_synthetic_xmc(1000, 3000, 0, seed=1)
    c = make_synthetic_xmc(1000, 3000, 0, seed=2)
    assert a.train.texts == b.train.texts and _same_csr(a.train.targets, b.train.targets)
    assert a.label_texts[:5] == b.label_texts[:5]
    assert a.train.texts != c.train.texts and a.label_texts[:5] != c.label_texts[:5]
    zipf = np.sort(a.train.targets.getnnz(axis=0))[::-1]
    uni = np.sort(make_synthetic_xmc(1000, 3000, 0, zipf_a=None, seed=1).train.targets.getnnz(axis=0))[::-1]
    assert zipf[0] > 5 * uni[0]  # a head label, as in real XMC
    assert (zipf == 0).sum() > (uni == 0).sum()  # and a long tail
    # more labels per point than labels: clamped, still distinct
    tiny = make_synthetic_xmc(2, 50, 0, labels_per_point=(3, 5), seed=0)
    assert tiny.train.targets.getnnz(axis=1).tolist() == [2] * 50


def test_synthetic_topics_make_labels_co_occur():
    def block_share(data, block):  # per point with >= 8 labels: the share of its labels in its most common block
        shares = [np.bincount(np.asarray(labels) // block).max() / len(labels) for labels in data.train.label_lists() if len(labels) >= 8]
        return float(np.mean(shares))

    # uniform draws: rank = label id, so a topic is the id block [25 t, 25 t + 25); 80% of a point's later labels
    # come from its first label's block (minus duplicates, redrawn from everywhere): about 0.7 of its labels
    kwargs = dict(num_labels=1000, num_train=400, num_test=0, labels_per_point=(8, 12), zipf_a=None, seed=5)
    topical = make_synthetic_xmc(**kwargs, topic_size=25, topic_share=0.8)
    independent = make_synthetic_xmc(**kwargs)
    assert block_share(topical, 25) > 0.6 and block_share(independent, 25) < 0.25
    for labels in topical.train.label_lists():
        assert 8 <= len(labels) <= 12 and len(set(labels)) == len(labels)
    again = make_synthetic_xmc(**kwargs, topic_size=25, topic_share=0.8)
    assert again.train.texts == topical.train.texts and _same_csr(again.train.targets, topical.train.targets)
    # with a Zipf law the block frequencies keep their skew: a head and a tail as without topics
    zipf = np.sort(make_synthetic_xmc(2000, 3000, 0, labels_per_point=(1, 20), zipf_a=1.1, seed=1, topic_size=50).train.targets.getnnz(axis=0))
    assert zipf[-20:].sum() > 5 * zipf[:1000].sum() / 50 and (zipf == 0).sum() > 0
    with pytest.raises(ValueError, match="topic_size"):
        make_synthetic_xmc(10, 5, 0, topic_size=0)
    with pytest.raises(ValueError, match="topic_share"):
        make_synthetic_xmc(10, 5, 0, topic_size=2, topic_share=1.5)


def test_synthetic_label_texts_are_lazy():
    data = make_synthetic_xmc(10_000_000, 10, 0, seed=0)
    texts = data.label_texts
    assert len(texts) == 10_000_000 and len(data.label_uids) == 10_000_000
    assert sys.getsizeof(texts) + sum(sys.getsizeof(v) for v in vars(texts).values()) < 10_000
    assert not any(isinstance(v, (list, np.ndarray)) for v in vars(texts).values())
    last = texts[-1]
    assert last == texts[9_999_999] and last.startswith("label ") and len(last.split()) == 5
    assert texts[9_999_998:] == [texts[9_999_998], last]
    assert texts[10:16:2] == [texts[10], texts[12], texts[14]]
    assert data.label_uids[3] == "L3"
    with pytest.raises(IndexError):
        texts[10_000_000]
    assert list(iter(make_synthetic_xmc(5, 1, 0).label_texts))[4] == make_synthetic_xmc(5, 1, 0).label_texts[4]


def test_synthetic_scale_two_million_labels():
    # label texts are lazy: 2M labels cost no per-label strings (they alone would be > 100 MB); numpy's buffers are
    # traced by tracemalloc, so the peak covers the targets too (memory, not wall time: deterministic under load)
    tracemalloc.start()
    try:
        data = make_synthetic_xmc(num_labels=2_000_000, num_train=20_000, num_test=2_000, seed=0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, peak
    assert data.train.targets.shape == (20_000, 2_000_000) and len(data.test) == 2_000
    assert data.train.targets.max() == 1.0 and data.train.targets.getnnz(axis=1).min() >= 1
    row = data.train.label_lists()[123]
    words = set(data.train.texts[123].split())
    assert all(set(data.label_texts.label_words(lab)) & words for lab in row)


# ------------------------------------------------------------------------------------------
# bundled Debtags
# ------------------------------------------------------------------------------------------


def test_load_debtags_stats():
    assert (DEBTAGS_DIR / "trn.json.gz").is_file() and (DEBTAGS_DIR / "README.md").is_file()
    data = load_debtags()
    assert data.num_labels == 597 and len(data.label_texts) == 597
    assert data.train.num_skipped == 0 and data.test.num_skipped == 0
    assert len(data.train) + data.train.num_skipped == 23_848
    assert len(data.test) + data.test.num_skipped == 5_945
    assert data.train.num_labels == data.test.num_labels == 597
    assert 3.5 < data.train.targets.nnz / len(data.train) < 3.9  # 3.69 tags per package on average
    i = data.label_uids.index("devel::library")
    freq = data.train.targets.getnnz(axis=0) + data.test.targets.getnnz(axis=0)
    assert freq[i] == 10_148 and freq.argmax() == i  # the most frequent tag, as in the shared README
    assert data.label_texts[i] == "Software Development: Libraries"
    j = data.test.uids.index("0ad")  # first package of the index; the seeded split puts it in test
    assert data.test.texts[j] == "0ad : Real-time strategy game of ancient warfare"
    assert {data.label_uids[lab] for lab in data.test.label_lists()[j]} == {
        "game::strategy", "interface::graphical", "interface::x11", "role::program", "uitoolkit::sdl",
        "uitoolkit::wxwidgets", "use::gameplaying", "x11::application"}


def _write_gz_lines(path, rows):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")


def test_empty_label_file_and_unlabelled_training_set_are_named(tmp_path):
    """Faults that used to surface as 'label id 25 out of range (num_labels=0)' and as a metrics-module error."""
    _write_gz_lines(tmp_path / "lbl.json.gz", [])
    _write_gz_lines(tmp_path / "trn.json.gz", [{"uid": "a", "title": "x", "target_ind": [0]}])
    _write_gz_lines(tmp_path / "tst.json.gz", [{"uid": "b", "title": "y", "target_ind": [0]}])
    with pytest.raises(XMCDataError, match=r"lbl\.json\.gz: the label file is empty"):
        load_xc_dataset(tmp_path / "trn.json.gz", tmp_path / "tst.json.gz", tmp_path / "lbl.json.gz")
    _write_gz_lines(tmp_path / "lbl.json.gz", [{"uid": "l0", "title": "red"}])
    _write_gz_lines(tmp_path / "trn.json.gz", [{"uid": "a", "title": "x", "target_ind": []}, {"uid": "c", "title": "z", "target_ind": []}])
    with pytest.raises(XMCDataError, match=r"trn\.json\.gz: no training point has a label \(2 point\(s\) without one\)"):
        load_xc_dataset(tmp_path / "trn.json.gz", tmp_path / "tst.json.gz", tmp_path / "lbl.json.gz")


def test_duplicate_uids_are_reported_with_count_and_first_lines(tmp_path, caplog):
    rows = [{"uid": u, "title": "t", "target_ind": [0]} for u in ["a", "b", "c", "b", "a", "b"]]
    _write_gz_lines(tmp_path / "trn.json.gz", rows)
    with caplog.at_level(logging.WARNING, logger="hf_xmc.data.xc_raw"):
        read_xc_raw(tmp_path / "trn.json.gz", num_labels=1)
    assert "trn.json.gz: 3 point(s) repeat a uid seen before (first: lines 2 and 4 share uid 'b')" in caplog.text
    caplog.clear()
    _write_gz_lines(tmp_path / "lbl.json.gz", [{"uid": "x", "title": "t"}, "", {"uid": "y", "title": "u"}, {"uid": "x", "title": "v"}])
    with caplog.at_level(logging.WARNING, logger="hf_xmc.data.xc_raw"):
        uids, _ = read_xc_labels(tmp_path / "lbl.json.gz")
    assert uids == ["x", "y", "x"] and "1 label(s) repeat a uid seen before (first: lines 1 and 4 share uid 'x')" in caplog.text
    caplog.clear()
    _write_gz_lines(tmp_path / "ok.json.gz", [{"uid": u, "title": "t", "target_ind": [0]} for u in "abc"])
    with caplog.at_level(logging.WARNING, logger="hf_xmc.data.xc_raw"):
        read_xc_raw(tmp_path / "ok.json.gz", num_labels=1)
    assert "repeat a uid" not in caplog.text
