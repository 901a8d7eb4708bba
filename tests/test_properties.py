"""Property tests (hypothesis): the XC readers read back what the writers wrote, for any texts, uids and label lists;
the metrics stay in their bounds, ignore the order of the queries and agree with a naive implementation."""

import numpy as np
import pytest
import scipy.sparse as sp

from hf_xmc.data import XMCDataset, read_xc_labels, read_xc_raw, write_xc_labels, write_xc_raw
from hf_xmc.metrics import inverse_propensity, ndcg_at_k, precision_at_k, psprecision_at_k, recall_at_k

hypothesis = pytest.importorskip("hypothesis")  # in the dev extra: CI has it
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def datasets(draw):
    num_labels = draw(st.integers(1, 12))
    n = draw(st.integers(1, 15))
    uids = draw(st.lists(st.text(min_size=1, max_size=12), min_size=n, max_size=n, unique=True))
    texts = draw(st.lists(TEXT, min_size=n, max_size=n))
    rows = draw(st.lists(st.lists(st.integers(0, num_labels - 1), max_size=6), min_size=n, max_size=n))
    dense = np.zeros((n, num_labels), dtype=np.float32)
    for i, row in enumerate(rows):
        dense[i, row] = 1.0
    return XMCDataset(texts=texts, targets=sp.csr_matrix(dense), uids=uids), num_labels


@SETTINGS
@given(datasets())
def test_xc_raw_round_trip(tmp_path, drawn):
    data, num_labels = drawn
    path = tmp_path / "trn.json.gz"
    write_xc_raw(path, data)
    back = read_xc_raw(path, num_labels=num_labels)
    kept = np.flatnonzero(np.diff(data.targets.indptr) > 0)  # points without a label are skipped, and counted
    assert back.texts == [data.texts[i] for i in kept] and back.uids == [data.uids[i] for i in kept]
    assert (back.targets != data.targets[kept]).nnz == 0 and back.num_skipped == len(data) - len(kept)
    assert back.record_indices().tolist() == kept.tolist()


@SETTINGS
@given(st.lists(st.tuples(st.text(min_size=1, max_size=12), TEXT), min_size=1, max_size=20, unique_by=lambda p: p[0]))
def test_xc_labels_round_trip(tmp_path, labels):
    path = tmp_path / "lbl.json.gz"
    write_xc_labels(path, [u for u, _ in labels], [t for _, t in labels])
    assert read_xc_labels(path) == ([u for u, _ in labels], [t for _, t in labels])


@st.composite
def rankings(draw):
    num_labels = draw(st.integers(1, 10))
    n = draw(st.integers(1, 12))
    k = draw(st.integers(1, 6))
    truth = np.array(draw(st.lists(st.lists(st.booleans(), min_size=num_labels, max_size=num_labels), min_size=n, max_size=n)), dtype=np.float32)
    # each row: distinct label ids best first, -1 padded (fewer predictions than k)
    topk = np.full((n, k), -1, dtype=np.int64)
    for i in range(n):
        ids = draw(st.lists(st.integers(0, num_labels - 1), max_size=k, unique=True))
        topk[i, : len(ids)] = ids
    return topk, sp.csr_matrix(truth), k


def naive(topk, truth, k):
    dense = truth.toarray() > 0
    p, r, nd = [], [], []
    for row, pos in zip(topk, dense):
        hits = [bool(label >= 0 and pos[label]) for label in row[:k]]
        p.append(sum(hits) / k)
        r.append(sum(hits) / pos.sum() if pos.sum() else 0.0)
        dcg = sum(h / np.log2(rank + 2) for rank, h in enumerate(hits))
        idcg = sum(1 / np.log2(rank + 2) for rank in range(min(k, int(pos.sum()))))
        nd.append(dcg / idcg if idcg else 0.0)
    return np.mean(p), np.mean(r), np.mean(nd)


@SETTINGS
@given(rankings(), st.randoms(use_true_random=False))
def test_metrics_bounds_order_and_naive_agreement(drawn, rnd):
    topk, truth, k = drawn
    p, r, nd = precision_at_k(topk, truth, k), recall_at_k(topk, truth, k), ndcg_at_k(topk, truth, k)
    inv_p = inverse_propensity(truth + sp.csr_matrix(np.ones(truth.shape, dtype=np.float32)))  # every label seen
    ps = psprecision_at_k(topk, truth, inv_p, k)
    for value in (p, r, nd, ps):
        assert 0.0 <= value <= 1.0 + 1e-9
    np.testing.assert_allclose((p, r, nd), naive(topk, truth, k), atol=1e-9)
    order = list(range(topk.shape[0]))
    rnd.shuffle(order)  # the queries' order does not matter
    np.testing.assert_allclose(
        (precision_at_k(topk[order], truth[order], k), recall_at_k(topk[order], truth[order], k),
         ndcg_at_k(topk[order], truth[order], k), psprecision_at_k(topk[order], truth[order], inv_p, k)),
        (p, r, nd, ps), atol=1e-9)
    # predicting exactly the true labels (at most k of them) gives the best nDCG@k there is
    perfect = np.full_like(topk, -1)
    for i, row in enumerate(truth.toarray() > 0):
        ids = np.flatnonzero(row)[:k]
        perfect[i, : len(ids)] = ids
    has = np.asarray(truth.sum(axis=1)).ravel() > 0
    assert ndcg_at_k(perfect, truth, k) == pytest.approx(has.mean())
