"""Tests for hf_xmc.metrics (XMC ranking metrics) and its `evaluate` module."""

import ast
import inspect
import math
import os
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hf_xmc.metrics import (  # noqa: E402
    EVALUATE_MODULE_PATH,
    PROPENSITY_CONSTANTS,
    inverse_propensity,
    label_lists_to_csr,
    ndcg_at_k,
    pad_rankings,
    precision_at_k,
    precision_by_frequency_bucket,
    propensity_constants,
    psndcg_at_k,
    psprecision_at_k,
    recall_at_k,
    xmc_metrics,
)

L2_3 = 1.0 / math.log2(3)  # discount at rank 2: 0.6309297...

# ---------------------------------------------------------------------------------------
# Hand-computed example: 3 queries, 6 labels.
#   truth  q0 = {0, 2}, q1 = {1, 3, 5}, q2 = {} (no positive)
#   topk   q0 = [0, 1, 2]  -> hits at ranks 1 and 3
#          q1 = [5, -1, 3] -> hits at ranks 1 and 3 (rank 2 is padding; -1 must NOT be read
#                             as label 5 = L-1)
#          q2 = [0, 1, 2]  -> no hit (no positives)
#   inverse propensity q_l = l + 1 = [1, 2, 3, 4, 5, 6]
# ---------------------------------------------------------------------------------------
TRUTH = sp.csr_matrix(
    np.array(
        [
            [1, 0, 1, 0, 0, 0],
            [0, 1, 0, 1, 0, 1],
            [0, 0, 0, 0, 0, 0],
        ],
        dtype=np.float32,
    )
)
TOPK = np.array([[0, 1, 2], [5, -1, 3], [0, 1, 2]])
INV_P = np.arange(1, 7, dtype=np.float64)

# P@1 = (1 + 1 + 0) / 3 = 2/3 ; P@3 = (2/3 + 2/3 + 0) / 3 = 4/9 ; P@5 (K=3 < 5) = (2/5 + 2/5) / 3 = 4/15
P1, P3, P5 = 2 / 3, 4 / 9, 4 / 15
# DCG@3: q0 = q1 = 1 + 1/log2(4) = 1.5; IDCG@3: q0 (2 pos) = 1 + 1/log2 3, q1 (3 pos) = 1 + 1/log2 3 + 1/2
NDCG1 = 2 / 3
NDCG3 = (1.5 / (1 + L2_3) + 1.5 / (1 + L2_3 + 0.5)) / 3  # = 0.5412130
# R@1 = (1/2 + 1/3 + 0) / 3 = 5/18 ; R@3 = (2/2 + 2/3 + 0) / 3 = 5/9
R1, R3 = 5 / 18, 5 / 9
# PSP@1: hits' q = 1 (q0) + 6 (q1) = 7 ; best top-1 q = 3 (q0: max(1, 3)) + 6 (q1) = 9  -> 7/9
# PSP@3: hits' q = (1 + 3) + (6 + 4) = 14 ; best = (3 + 1) + (6 + 4 + 2) = 16           -> 7/8
PSP1, PSP3 = 7 / 9, 7 / 8
# PSnDCG@3: q0 psdcg = 1 + 3/2 = 2.5, best = 3 + 1/log2 3, idcg = 1 + 1/log2 3
#           q1 psdcg = 6 + 4/2 = 8,   best = 6 + 4/log2 3 + 2/2, idcg = 1 + 1/log2 3 + 1/2
_IDCG0, _IDCG1 = 1 + L2_3, 1 + L2_3 + 0.5
PSNDCG3 = (2.5 / _IDCG0 + 8 / _IDCG1) / ((3 + L2_3) / _IDCG0 + (7 + 4 * L2_3) / _IDCG1)  # = 0.7896408
PSNDCG1 = 7 / 9  # (1 + 6) / (3 + 6), idcg@1 = 1 for both rows


def test_hand_computed_basic_metrics():
    assert precision_at_k(TOPK, TRUTH, 1) == pytest.approx(P1)
    assert precision_at_k(TOPK, TRUTH, 3) == pytest.approx(P3)
    assert ndcg_at_k(TOPK, TRUTH, 1) == pytest.approx(NDCG1)
    assert ndcg_at_k(TOPK, TRUTH, 3) == pytest.approx(NDCG3)
    assert NDCG3 == pytest.approx(0.5412130, abs=1e-6)
    assert recall_at_k(TOPK, TRUTH, 1) == pytest.approx(R1)
    assert recall_at_k(TOPK, TRUTH, 3) == pytest.approx(R3)


def test_hand_computed_propensity_metrics():
    assert psprecision_at_k(TOPK, TRUTH, INV_P, 1) == pytest.approx(PSP1)
    assert psprecision_at_k(TOPK, TRUTH, INV_P, 3) == pytest.approx(PSP3)
    assert psndcg_at_k(TOPK, TRUTH, INV_P, 1) == pytest.approx(PSNDCG1)
    assert psndcg_at_k(TOPK, TRUTH, INV_P, 3) == pytest.approx(PSNDCG3)
    assert PSNDCG3 == pytest.approx(0.7896408, abs=1e-6)
    # a perfect ranking by decreasing propensity scores 1 on both PS metrics
    best = np.array([[2, 0, -1], [5, 3, 1], [-1, -1, -1]])
    assert psprecision_at_k(best, TRUTH, INV_P, 3) == pytest.approx(1.0)
    assert psndcg_at_k(best, TRUTH, INV_P, 3) == pytest.approx(1.0)
    # the same labels ranked in the wrong order: PSP@3 unchanged, PSnDCG@3 < 1, PSP@1 < 1
    worst_order = np.array([[0, 2, -1], [1, 3, 5], [-1, -1, -1]])
    assert psprecision_at_k(worst_order, TRUTH, INV_P, 3) == pytest.approx(1.0)
    assert psndcg_at_k(worst_order, TRUTH, INV_P, 3) < 0.9
    # PSP@1 = (1 + 2) / (3 + 6)
    assert psprecision_at_k(worst_order, TRUTH, INV_P, 1) == pytest.approx(3 / 9)


def test_k_larger_than_K_counts_missing_ranks_as_misses():
    # K = 3 < k = 5: P@5 = (2/5 + 2/5 + 0) / 3 = 4/15; recall/nDCG cannot change (no new ranks)
    assert precision_at_k(TOPK, TRUTH, 5) == pytest.approx(P5)
    assert recall_at_k(TOPK, TRUTH, 5) == pytest.approx(R3)
    assert ndcg_at_k(TOPK, TRUTH, 5) == pytest.approx(NDCG3)  # idcg uses min(k, |P_i|) <= 3
    assert psprecision_at_k(TOPK, TRUTH, INV_P, 5) == pytest.approx(PSP3)


def test_K_larger_than_k_only_uses_first_k_columns():
    # an extra column with hits must not change @1/@3 values
    wide = np.hstack([TOPK, np.array([[2], [1], [0]]), np.full((3, 4), -1)])
    assert precision_at_k(wide, TRUTH, 3) == pytest.approx(P3)
    assert ndcg_at_k(wide, TRUTH, 3) == pytest.approx(NDCG3)
    assert recall_at_k(wide, TRUTH, 3) == pytest.approx(R3)
    assert psprecision_at_k(wide, TRUTH, INV_P, 3) == pytest.approx(PSP3)
    # ...but @4 sees it: q1 gets its 3rd hit (label 1): P@4 = (2/4 + 3/4 + 0) / 3 = 5/12, R@4 = (1 + 1)/3
    assert precision_at_k(wide, TRUTH, 4) == pytest.approx(5 / 12)
    assert recall_at_k(wide, TRUTH, 4) == pytest.approx(2 / 3)


def test_padding_never_hits_and_empty_rows_count_in_mean():
    # truth contains only the last label (L-1 = 5); -1 must not wrap around to it
    truth = sp.csr_matrix(([1.0], ([0], [5])), shape=(2, 6))
    topk = np.array([[-1, -1], [-1, -1]])
    assert precision_at_k(topk, truth, 2) == 0.0
    assert recall_at_k(topk, truth, 2) == 0.0
    assert ndcg_at_k(topk, truth, 2) == 0.0
    assert psprecision_at_k(topk, truth, INV_P, 2) == 0.0
    # one correct prediction: P@1 = (1 + 0) / 2 -- the empty second row still counts in the mean
    topk = np.array([[5, -1], [5, -1]])
    assert precision_at_k(topk, truth, 1) == pytest.approx(0.5)
    assert ndcg_at_k(topk, truth, 1) == pytest.approx(0.5)
    assert recall_at_k(topk, truth, 1) == pytest.approx(0.5)
    # PS metrics are a ratio of sums: the empty row adds 0 to both -> 1
    assert psprecision_at_k(topk, truth, INV_P, 1) == pytest.approx(1.0)
    assert psndcg_at_k(topk, truth, INV_P, 2) == pytest.approx(1.0)


def test_all_rows_empty_and_no_rows():
    truth = sp.csr_matrix((3, 6))
    assert precision_at_k(TOPK, truth, 3) == 0.0
    assert ndcg_at_k(TOPK, truth, 3) == 0.0
    assert recall_at_k(TOPK, truth, 3) == 0.0
    assert psprecision_at_k(TOPK, truth, INV_P, 3) == 0.0
    assert psndcg_at_k(TOPK, truth, INV_P, 3) == 0.0
    res = xmc_metrics(np.zeros((0, 5), dtype=np.int64), sp.csr_matrix((0, 6)), INV_P)
    assert set(res.values()) == {0.0}


def test_repeated_label_is_credited_once():
    truth = sp.csr_matrix(np.array([[1, 0, 1, 0]]))
    # [0, 0, 2]: label 0 only counts at rank 1 -> P@3 = 2/3 (napkinxc would give 3/3)
    assert precision_at_k(np.array([[0, 0, 2]]), truth, 3) == pytest.approx(2 / 3)
    assert recall_at_k(np.array([[0, 0, 0]]), truth, 3) == pytest.approx(1 / 2)
    # DCG = 1 + 1/log2(4) ; IDCG = 1 + 1/log2(3)
    assert ndcg_at_k(np.array([[0, 0, 2]]), truth, 3) == pytest.approx(1.5 / (1 + L2_3))


def test_truth_formats_are_canonicalised():
    # duplicate entries, unsorted indices, explicit zeros and dense input give the same result
    data = np.array([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    rows = np.array([0, 0, 0, 1, 1, 1, 0])
    cols = np.array([2, 0, 4, 5, 3, 1, 2])
    messy = sp.coo_matrix((data, (rows, cols)), shape=(3, 6)).tocsr()
    assert precision_at_k(TOPK, messy, 3) == pytest.approx(P3)
    assert ndcg_at_k(TOPK, messy, 3) == pytest.approx(NDCG3)  # |P_0| must be 2, not 3
    assert psndcg_at_k(TOPK, messy, INV_P, 3) == pytest.approx(PSNDCG3)
    assert ndcg_at_k(TOPK, TRUTH.toarray(), 3) == pytest.approx(NDCG3)
    assert precision_at_k(TOPK.astype(np.float64), TRUTH, 3) == pytest.approx(P3)


def test_xmc_metrics_dict_percentages():
    res = xmc_metrics(TOPK, TRUTH, INV_P, ks=(1, 3), recall_ks=(1, 3))
    assert list(res) == ["P@1", "nDCG@1", "P@3", "nDCG@3", "PSP@1", "PSnDCG@1", "PSP@3", "PSnDCG@3", "R@1", "R@3"]
    expected = {
        "P@1": P1,
        "P@3": P3,
        "nDCG@1": NDCG1,
        "nDCG@3": NDCG3,
        "PSP@1": PSP1,
        "PSP@3": PSP3,
        "PSnDCG@1": PSNDCG1,
        "PSnDCG@3": PSNDCG3,
        "R@1": R1,
        "R@3": R3,
    }
    for key, value in expected.items():
        assert res[key] == pytest.approx(100 * value), key
    no_ps = xmc_metrics(TOPK, TRUTH)
    assert set(no_ps) == {"P@1", "P@3", "P@5", "nDCG@1", "nDCG@3", "nDCG@5", "R@10", "R@100"}
    assert no_ps["P@5"] == pytest.approx(100 * P5)
    assert no_ps["R@100"] == pytest.approx(100 * R3)


def test_validation_errors():
    with pytest.raises(ValueError, match="2-D"):
        xmc_metrics(np.array([0, 1, 2]), TRUTH)
    with pytest.raises(ValueError, match="rows"):
        xmc_metrics(TOPK[:2], TRUTH)
    with pytest.raises(ValueError, match="inv_propensity"):
        xmc_metrics(TOPK, TRUTH, inv_propensity=np.ones(5))
    with pytest.raises(ValueError, match="number of labels"):
        precision_at_k(np.array([[6], [0], [0]]), TRUTH, 1)
    with pytest.raises(ValueError, match="positive integer"):
        precision_at_k(TOPK, TRUTH, 0)
    with pytest.raises(ValueError, match="integer"):
        precision_at_k(TOPK + 0.5, TRUTH, 1)


def test_inverse_propensity_formula_and_constants():
    # 4 train points, label frequencies [4, 1, 0]
    train = sp.csr_matrix(np.array([[1, 1, 0], [1, 0, 0], [1, 0, 0], [1, 0, 0]]))
    A, B = 0.55, 1.5
    C = (math.log(4) - 1) * (B + 1) ** A  # = 0.6633...
    expected = [1 + C * (4 + B) ** -A, 1 + C * (1 + B) ** -A, 1 + C * B**-A]
    got = inverse_propensity(train)
    assert got.dtype == np.float64 and got.shape == (3,)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    # rarer labels get larger weights
    assert got[0] < got[1] < got[2]
    np.testing.assert_allclose(
        inverse_propensity(train, 0.6, 2.6),
        1 + (math.log(4) - 1) * 3.6**0.6 * (np.array([4, 1, 0]) + 2.6) ** -0.6,
    )
    assert PROPENSITY_CONSTANTS["default"] == (0.55, 1.5)
    assert propensity_constants("Amazon-670K") == (0.6, 2.6)
    assert propensity_constants("AmazonCat-13K") == (0.55, 1.5)  # pyxclib issue #7: not the Amazon product constants
    assert propensity_constants("WikiLSHTC-325K") == (0.5, 0.4)
    assert propensity_constants("wiki10-31k") == (0.5, 0.4)
    assert propensity_constants("EURLex-4K") == (0.55, 1.5)
    assert propensity_constants(None) == (0.55, 1.5)


def test_propensity_constants_of_known_datasets_and_the_presets_agree():
    """One table: WikiSeeAlso is not a Wikipedia-category dataset (0.55 / 1.5, as its configs and the presets say),
    exact names win over the substring guess, and every training preset's constants are the table's."""
    from hf_xmc.metrics.core import DATASET_PROPENSITY
    from hf_xmc.training.presets import DATASETS

    assert propensity_constants("LF-WikiSeeAlso-320K") == (0.55, 1.5)
    assert propensity_constants("lf-wikiseealsotitles-320k") == (0.55, 1.5)
    assert propensity_constants(" LF-WikiTitles-500K ") == (0.5, 0.4)
    assert propensity_constants("LF-Wikipedia-500K") == (0.5, 0.4)
    assert propensity_constants("LF-AmazonTitles-1.3M") == (0.6, 2.6)
    # names outside the table: the substring fallback
    assert propensity_constants("my-wikiseealso-dump") == (0.55, 1.5)
    assert propensity_constants("AmazonCat-14K") == (0.55, 1.5)
    assert propensity_constants("wiki-categories-1m") == (0.5, 0.4)
    assert propensity_constants("amazon-reviews") == (0.6, 2.6)
    assert propensity_constants("debtags") == (0.55, 1.5)
    with pytest.raises(KeyError, match="no propensity constants recorded for dataset 'debtags'"):
        propensity_constants("debtags", exact=True)
    assert all(name == name.lower() and family in PROPENSITY_CONSTANTS for name, family in DATASET_PROPENSITY.items())
    for key, facts in DATASETS.items():
        assert (facts["propensity_a"], facts["propensity_b"]) == propensity_constants(facts["dataset_name"], exact=True), key
    assert (DATASETS["lf-wikiseealso-320k"]["propensity_a"], DATASETS["lf-wikiseealso-320k"]["propensity_b"]) == (0.55, 1.5)
    assert (DATASETS["lf-wikititles-500k"]["propensity_a"], DATASETS["lf-wikititles-500k"]["propensity_b"]) == (0.5, 0.4)


def test_precision_by_frequency_bucket():
    # train frequencies of the 6 labels; total mass 20, sorted head first: 0,1,2,3,4,5
    freq = np.array([10, 5, 3, 1, 1, 0])
    # 2 buckets: label 0 starts at mass 0 -> bucket 0; label 1 starts at 10 -> floor(2*10/20) = 1
    buckets = precision_by_frequency_bucket(TOPK, TRUTH, freq, k=3, num_buckets=2)
    assert [b["num_labels"] for b in buckets] == [1, 5]
    assert buckets[0]["max_freq"] == 10 and buckets[1]["max_freq"] == 5 and buckets[1]["min_freq"] == 0
    assert [b["train_mass_share"] for b in buckets] == pytest.approx([0.5, 0.5])
    # hits in top-3: q0 -> labels 0, 2 ; q1 -> labels 5, 3  => bucket0: 1 hit, bucket1: 3 hits, n*k = 9
    assert [b["precision_contribution"] for b in buckets] == pytest.approx([1 / 9, 3 / 9])
    assert [b["hit_share"] for b in buckets] == pytest.approx([0.25, 0.75])
    assert sum(b["precision_contribution"] for b in buckets) == pytest.approx(P3)
    # 3 buckets (mass 20/3 each): label0 -> 0, label1 (start 10) -> 1, labels 2..5 (start >= 15) -> 2
    buckets = precision_by_frequency_bucket(TOPK, TRUTH, freq, k=3, num_buckets=3)
    assert [b["num_labels"] for b in buckets] == [1, 1, 4]
    assert [b["precision_contribution"] for b in buckets] == pytest.approx([1 / 9, 0.0, 3 / 9])
    # non-integer masses (float branch): total 20.5, label 1 starts at 10.5 -> floor(2*10.5/20.5) = 1
    buckets_f = precision_by_frequency_bucket(TOPK, TRUTH, np.array([10.5, 5, 3, 1, 1, 0]), k=3, num_buckets=2)
    assert [b["num_labels"] for b in buckets_f] == [1, 5]
    assert [b["train_mass_share"] for b in buckets_f] == pytest.approx([10.5 / 20.5, 10 / 20.5])
    # a train matrix works as well as a frequency vector
    train = sp.csr_matrix(np.repeat(np.eye(6), freq, axis=0))
    assert precision_by_frequency_bucket(TOPK, TRUTH, train, k=3, num_buckets=3) == buckets
    # an impossible split leaves a bucket empty instead of failing
    buckets = precision_by_frequency_bucket(TOPK, TRUTH, np.array([100, 0, 0, 0, 0, 1]), k=1, num_buckets=4)
    assert [b["num_labels"] for b in buckets] == [1, 0, 0, 5]
    assert buckets[1]["min_freq"] is None
    assert sum(b["precision_contribution"] for b in buckets) == pytest.approx(P1)


def test_huge_label_space_is_not_densified():
    # n x L = 1e12 cells: any dense n x L intermediate would exhaust memory
    n, L = 1000, 10**9
    rng = np.random.default_rng(0)
    true_ids = rng.integers(0, L, size=(n, 2))
    truth = sp.csr_matrix((np.ones(2 * n), (np.repeat(np.arange(n), 2), true_ids.ravel())), shape=(n, L))
    topk = np.hstack([true_ids[:, :1], rng.integers(0, L, size=(n, 4))])
    res = xmc_metrics(topk, truth, ks=(1, 5), recall_ks=(5,))
    assert res["P@1"] == pytest.approx(100.0)
    assert res["P@5"] == pytest.approx(20.0, abs=0.1)
    assert res["R@5"] == pytest.approx(50.0, abs=0.1)


# ---------------------------------------------------------------------------------------
# Cross-check against napkinxc (an independent, per-row Python implementation)
# ---------------------------------------------------------------------------------------


def _random_problem(seed=0, n=200, num_labels=50, K=10):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        m = 0 if i % 17 == 0 else int(rng.integers(1, 8))  # some rows without positives
        rows.append(sorted(rng.choice(num_labels, size=m, replace=False).tolist()))
    truth = label_lists_to_csr(rows, num_labels)
    # skewed train label frequencies so that propensities vary a lot
    train = sp.csr_matrix((rng.random((500, num_labels)) < np.linspace(0.5, 0.002, num_labels)).astype(np.float64))
    topk = np.full((n, K), -1, dtype=np.int64)
    for i, pos in enumerate(rows):
        # a noisy ranker: mix true labels with random ones, no repetitions, some padding
        cand = list(rng.permutation(pos))[: int(rng.integers(0, len(pos) + 1))]
        others = [int(x) for x in rng.permutation(num_labels) if x not in cand]
        ranking = cand + others
        rng.shuffle(ranking[: min(K, len(ranking))])
        width = K if i % 5 else int(rng.integers(0, K + 1))
        topk[i, :width] = ranking[:width]
    return topk, truth, train


def test_cross_check_napkinxc():
    nm = pytest.importorskip("napkinxc.metrics")
    topk, truth, train = _random_problem()
    K = topk.shape[1]
    pred_lists = [[int(x) for x in row] for row in topk]  # napkinxc: -1 is never in the truth set

    inv_p = inverse_propensity(train, 0.55, 1.5)
    np.testing.assert_allclose(inv_p, nm.Jain_et_al_inverse_propensity(train, 0.55, 1.5), rtol=1e-12)
    inv_p_amazon = inverse_propensity(train, *propensity_constants("amazon"))
    np.testing.assert_allclose(inv_p_amazon, nm.Jain_et_al_inverse_propensity(train, 0.6, 2.6), rtol=1e-12)
    assert inv_p.max() > 2 * inv_p.min()

    ref = {
        "P": nm.precision_at_k(truth, pred_lists, k=K),
        "nDCG": nm.ndcg_at_k(truth, pred_lists, k=K),
        "R": nm.recall_at_k(truth, pred_lists, k=K),
        "PSP": nm.psprecision_at_k(truth, pred_lists, inv_p, k=K, normalize=True),
        "PSnDCG": nm.psndcg_at_k(truth, pred_lists, inv_p, k=K, normalize=True),
    }
    # the data must make the metrics non-trivial
    assert 0.1 < ref["P"][0] < 0.9 and 0.1 < ref["PSP"][4] < 0.9 and 0.1 < ref["R"][-1] < 0.95
    for k in range(1, K + 1):
        assert precision_at_k(topk, truth, k) == pytest.approx(ref["P"][k - 1], rel=1e-10), k
        assert ndcg_at_k(topk, truth, k) == pytest.approx(ref["nDCG"][k - 1], rel=1e-10), k
        assert recall_at_k(topk, truth, k) == pytest.approx(ref["R"][k - 1], rel=1e-10), k
        assert psprecision_at_k(topk, truth, inv_p, k) == pytest.approx(ref["PSP"][k - 1], rel=1e-10), k
        assert psndcg_at_k(topk, truth, inv_p, k) == pytest.approx(ref["PSnDCG"][k - 1], rel=1e-10), k

    res = xmc_metrics(topk, truth, inv_p, ks=(1, 3, 5), recall_ks=(3, 10))
    for k in (1, 3, 5):
        for name in ("P", "nDCG", "PSP", "PSnDCG"):
            assert res[f"{name}@{k}"] == pytest.approx(100 * ref[name][k - 1], rel=1e-10), (name, k)
    assert res["R@3"] == pytest.approx(100 * ref["R"][2], rel=1e-10)
    assert res["R@10"] == pytest.approx(100 * ref["R"][9], rel=1e-10)
    # K < k: napkinxc on a 10-wide ranking truncated to 4 columns, evaluated at k = 1..6
    narrow = topk[:, :4]
    ref_p6 = nm.precision_at_k(truth, [[int(x) for x in row] for row in narrow], k=6)
    ref_psn6 = nm.psndcg_at_k(truth, [[int(x) for x in row] for row in narrow], inv_p, k=6)
    assert precision_at_k(narrow, truth, 6) == pytest.approx(ref_p6[5], rel=1e-10)
    assert psndcg_at_k(narrow, truth, inv_p, 6) == pytest.approx(ref_psn6[5], rel=1e-10)


# ---------------------------------------------------------------------------------------
# `evaluate` module
# ---------------------------------------------------------------------------------------


def test_evaluate_script_has_no_hf_xmc_import_and_one_import_per_line():
    script = Path(EVALUATE_MODULE_PATH) / "xmc_metrics.py"
    core = Path(EVALUATE_MODULE_PATH) / "xmc_core.py"
    for path, allowed in (
        (script, {"collections", "typing", "datasets", "evaluate", "numpy", "xmc_core"}),
        (core, {"__future__", "collections", "typing", "numpy", "scipy"}),
    ):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert len(node.names) == 1, f"{path.name}: one import per line ({ast.dump(node)})"
                names = [node.names[0].name]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"


def test_evaluate_load_matches_xmc_metrics(tmp_path):
    evaluate = pytest.importorskip("evaluate")
    metric = evaluate.load(EVALUATE_MODULE_PATH, cache_dir=str(tmp_path), keep_in_memory=True)
    # the cached copy of the formulas is byte-identical to the package's single implementation
    cached_core = Path(inspect.getfile(type(metric))).with_name("xmc_core.py")
    assert cached_core.read_bytes() == (Path(EVALUATE_MODULE_PATH) / "xmc_core.py").read_bytes()

    # hand-computed example, ragged predictions (rows need not be padded for evaluate)
    preds = [[0, 1, 2], [5, -1, 3], [0]]
    refs = [[0, 2], [1, 3, 5], []]
    res = metric.compute(
        predictions=preds, references=refs, k_list=[1, 3], recall_k_list=[3], inv_propensity=INV_P.tolist()
    )
    assert res["P@1"] == pytest.approx(100 * P1)
    assert res["P@3"] == pytest.approx(100 * P3)
    assert res["nDCG@3"] == pytest.approx(100 * NDCG3)
    assert res["PSP@3"] == pytest.approx(100 * PSP3)
    assert res["PSnDCG@3"] == pytest.approx(100 * PSNDCG3)
    assert res["R@3"] == pytest.approx(100 * R3)

    # R@k follows k_list unless recall_k_list is given (it added R@10 / R@100 to k_list=[1, 3] before)
    assert sorted(metric.compute(predictions=preds, references=refs, k_list=[1, 3])) == ["P@1", "P@3", "R@1", "R@3", "nDCG@1", "nDCG@3"]
    # percentages by default; percent=False gives the same scores as fractions
    fractions = metric.compute(predictions=preds, references=refs, k_list=[1, 3], percent=False)
    assert fractions["P@1"] == pytest.approx(P1) and fractions["R@3"] == pytest.approx(R3)

    # random data, default k lists (R@k at k_list's cut-offs), batched via add_batch
    topk, truth, train = _random_problem(seed=1, n=60)
    inv_p = inverse_propensity(train)
    expected = xmc_metrics(topk, truth, inv_p, recall_ks=(1, 3, 5))
    rankings = [[int(x) for x in row if x >= 0] for row in topk]
    references = [truth.indices[truth.indptr[i] : truth.indptr[i + 1]].tolist() for i in range(truth.shape[0])]
    metric.add_batch(predictions=rankings[:30], references=references[:30])
    metric.add_batch(predictions=rankings[30:], references=references[30:])
    got = metric.compute(inv_propensity=inv_p)
    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key] == pytest.approx(expected[key], rel=1e-12), key
    # without propensities: no PS keys; num_labels inferred from the data
    got = metric.compute(predictions=rankings, references=references)
    assert "PSP@1" not in got and got["P@5"] == pytest.approx(expected["P@5"], rel=1e-12)


def test_helpers():
    assert pad_rankings([[3, 1], [], [2]]).tolist() == [[3, 1], [-1, -1], [2, -1]]
    assert pad_rankings([[3, 1, 4]], width=2).tolist() == [[3, 1]]
    m = label_lists_to_csr([[2, 0, 2], [], [5]], 6)
    assert m.shape == (3, 6) and m.nnz == 3 and m.toarray()[0].tolist() == [1, 0, 1, 0, 0, 0]
    with pytest.raises(ValueError):
        label_lists_to_csr([[6]], 6)
