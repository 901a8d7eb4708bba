"""Quick tests for benchmarks/peers.py (Omikuji, napkinXC PLT, TF-IDF zero-shot) on a tiny planted task."""

import numpy as np
import pytest

from hf_xmc.data import make_synthetic_xmc
from hf_xmc.metrics import precision_at_k

pytest.importorskip("sklearn")
peers = pytest.importorskip("benchmarks.peers")

NUM_LABELS, K = 30, 40  # K > NUM_LABELS: the tail of every row must be -1 padding


@pytest.fixture(scope="module")
def task():
    data = make_synthetic_xmc(num_labels=NUM_LABELS, num_train=300, num_test=100, seed=0)
    X_trn, X_tst, _ = peers.tfidf_features(data.train.texts, data.test.texts)
    return data, X_trn, X_tst


def _check_topk(topk, data, min_p1=80.0):
    """Shape/dtype/id validity, -1 only as trailing padding, no repeats, best-first, P@1 well above chance."""
    truth = data.test.targets
    assert isinstance(topk, np.ndarray) and topk.dtype == np.int64
    assert topk.shape == (truth.shape[0], K)
    assert topk.min() >= -1 and topk.max() < NUM_LABELS
    for row in topk:
        valid = row[row >= 0]
        assert np.all(row[:valid.size] >= 0) and np.all(row[valid.size:] == -1)
        assert np.unique(valid).size == valid.size
    # chance P@1 is the test share of the most frequent label; the planted words make it near 100 %
    chance = 100.0 * np.asarray(truth.sum(axis=0)).max() / truth.shape[0]
    p1 = 100.0 * precision_at_k(topk, truth, 1)
    assert p1 > min_p1 and p1 > chance + 30, (p1, chance)
    # best first: rank 1 is right far more often than rank 5
    hit = np.asarray(truth[np.arange(truth.shape[0]), np.maximum(topk[:, 4], 0)]).ravel() * (topk[:, 4] >= 0)
    assert p1 > 100.0 * hit.mean() + 20


def test_tfidf_features_fit_on_train_only(task):
    data, X_trn, X_tst = task
    assert X_trn.shape[0] == 300 and X_tst.shape == (100, X_trn.shape[1])
    assert X_trn.dtype == np.float32
    np.testing.assert_allclose(np.sqrt(X_trn.multiply(X_trn).sum(axis=1)).A.ravel()[X_trn.getnnz(axis=1) > 0], 1.0,
                               rtol=1e-5)


def test_omikuji(task):
    pytest.importorskip("omikuji")
    data, X_trn, X_tst = task
    topk, train_s, predict_s = peers.run_omikuji(X_trn, data.train.targets, X_tst, k=K, seed=0, n_threads=1)
    assert train_s >= 0 and predict_s >= 0
    _check_topk(topk, data)


def test_napkinxc(task):
    pytest.importorskip("napkinxc")
    data, X_trn, X_tst = task
    topk, train_s, predict_s = peers.run_napkinxc(X_trn, data.train.targets, X_tst, k=K, seed=0, threads=1)
    assert train_s >= 0 and predict_s >= 0
    _check_topk(topk, data)
    again, _, _ = peers.run_napkinxc(X_trn, data.train.targets, X_tst, k=K, seed=0, threads=1)
    np.testing.assert_array_equal(topk, again)  # seeded -> deterministic


def test_tfidf_zero_shot(task):
    data, _, _ = task
    labels = list(data.label_texts)
    topk, fit_s, predict_s = peers.run_tfidf_zero_shot(data.train.texts, data.test.texts, labels, k=K)
    assert fit_s >= 0 and predict_s >= 0
    _check_topk(topk, data)
    # chunked scoring (a few queries per block) gives the same ranking
    small, _, _ = peers.run_tfidf_zero_shot(data.train.texts, data.test.texts, labels, k=K,
                                            max_block_bytes=4 * NUM_LABELS * 7)
    np.testing.assert_array_equal(topk, small)


def test_lists_to_topk():
    out = peers.lists_to_topk([[3, 1], [], [0, 1, 2, 4]], 3)
    np.testing.assert_array_equal(out, [[3, 1, -1], [-1, -1, -1], [0, 1, 2]])
    assert out.dtype == np.int64
