"""What XMC papers report beside P@k (issue 65, item 6): coverage@k, the seen / unseen split of P@k and PSP@k, P@k per
train-frequency decile, and the evaluator's keys for them (and its batch-size-1 latency)."""

import numpy as np
import pytest
import scipy.sparse as sp

from hf_xmc.metrics import (
    coverage_at_k,
    inverse_propensity,
    label_lists_to_csr,
    precision_at_k,
    precision_by_frequency_bucket,
    psprecision_at_k,
    seen_unseen_metrics,
    xmc_metrics,
)

# 6 labels; labels 2 and 4 have no training point (unseen)
TRAIN_COUNTS = np.array([5, 3, 0, 1, 0, 2])
# hand-picked inverse propensities (not the Jain et al. formula): the unseen labels have the largest
INV_P = np.array([1.0, 2.0, 10.0, 3.0, 10.0, 1.5])
TRUTH = label_lists_to_csr([[0, 2], [1, 3, 4], []], 6)
TOPK = np.array([[2, 5, 0], [3, 1, 4], [0, -1, 1]])  # at k = 2 the third column is cut


def test_coverage_at_k_hand_computed():
    # true labels of the set: {0, 1, 2, 3, 4} (5); hit within the top 2: 2 (row 0), 3 and 1 (row 1) -> 3 / 5
    assert coverage_at_k(TOPK, TRUTH, 2) == pytest.approx(3 / 5)
    assert coverage_at_k(TOPK, TRUTH, 1) == pytest.approx(2 / 5)  # 2 and 3
    assert coverage_at_k(TOPK, TRUTH, 3) == pytest.approx(5 / 5)  # 0 and 4 at rank 3
    # a label hit by several queries counts once; a label absent from the truth counts in neither term
    twice = label_lists_to_csr([[0], [0], [1]], 6)
    assert coverage_at_k(np.array([[0], [0], [5]]), twice, 1) == pytest.approx(1 / 2)
    assert coverage_at_k(TOPK, label_lists_to_csr([[], [], []], 6), 2) == 0.0


def test_seen_unseen_metrics_hand_computed():
    m = seen_unseen_metrics(TOPK, TRUTH, TRAIN_COUNTS, INV_P, k=2)
    assert m["unseen_labels"] == 2  # labels 2 and 4 occur in the truth
    assert m["unseen_positive_share"] == pytest.approx(2 / 5)  # (0, 2) and (1, 4) of 5 positives
    # hits within the top 2: label 2 (unseen) in row 0, labels 3 and 1 (seen) in row 1; n k = 6
    assert m["unseen_P@2"] == pytest.approx(1 / 6)
    assert m["seen_P@2"] == pytest.approx(2 / 6)
    # ideal PSP@2 terms: row 0 {2: 10, 0: 1}, row 1 the two largest of {1: 2, 3: 3, 4: 10} -> {4: 10, 3: 3}
    # D = 24, D_unseen = 20, D_seen = 4; gains: unseen 10 (label 2), seen 3 + 2 (labels 3 and 1)
    assert m["unseen_PSP@2_mass"] == pytest.approx(20 / 24)
    assert m["unseen_PSP@2"] == pytest.approx(10 / 20)
    # above 1: label 1 (seen) was hit in a slot the ideal ranking gives to label 4 (unseen), as the docstring says
    assert m["seen_PSP@2"] == pytest.approx(5 / 4)
    # without propensities: the counts and the P@k split only
    assert set(seen_unseen_metrics(TOPK, TRUTH, TRAIN_COUNTS, k=2)) == {"unseen_labels", "unseen_positive_share", "seen_P@2", "unseen_P@2"}
    # the train target matrix gives the same as its column counts
    train = sp.csr_matrix(np.repeat(np.eye(6), TRAIN_COUNTS, axis=0))
    assert seen_unseen_metrics(TOPK, TRUTH, train, INV_P, k=2) == m


def test_seen_unseen_decomposes_p_at_k_and_psp_at_k():
    m = seen_unseen_metrics(TOPK, TRUTH, TRAIN_COUNTS, INV_P, k=2)
    assert m["seen_P@2"] + m["unseen_P@2"] == pytest.approx(precision_at_k(TOPK, TRUTH, 2))
    mass = m["unseen_PSP@2_mass"]
    assert mass * m["unseen_PSP@2"] + (1 - mass) * m["seen_PSP@2"] == pytest.approx(psprecision_at_k(TOPK, TRUTH, INV_P, 2))
    assert psprecision_at_k(TOPK, TRUTH, INV_P, 2) == pytest.approx(15 / 24)


def test_no_unseen_label_gives_zero_mass_and_zero_unseen_scores():
    m = seen_unseen_metrics(TOPK, TRUTH, TRAIN_COUNTS + 1, INV_P, k=2)
    assert m["unseen_labels"] == 0 and m["unseen_PSP@2_mass"] == 0.0 and m["unseen_PSP@2"] == 0.0 and m["unseen_P@2"] == 0.0
    assert m["seen_PSP@2"] == pytest.approx(psprecision_at_k(TOPK, TRUTH, INV_P, 2))
    with pytest.raises(ValueError, match="labels but truth has"):
        seen_unseen_metrics(TOPK, TRUTH, TRAIN_COUNTS[:5], INV_P, k=2)
    with pytest.raises(ValueError, match="non-negative"):
        seen_unseen_metrics(TOPK, TRUTH, -TRAIN_COUNTS, INV_P, k=2)


def _random_problem(seed: int, n: int = 300, num_labels: int = 60, K: int = 10):
    """Skewed train counts with about a fifth of the labels unseen, some queries without positives, padded rankings."""
    rng = np.random.default_rng(seed)
    rows = [sorted(rng.choice(num_labels, size=0 if i % 13 == 0 else int(rng.integers(1, 7)), replace=False).tolist()) for i in range(n)]
    truth = label_lists_to_csr(rows, num_labels)
    train = sp.csr_matrix((rng.random((400, num_labels)) < np.linspace(0.4, 0.003, num_labels)).astype(np.float64))
    train = sp.csr_matrix(train.multiply((rng.random(num_labels) > 0.2)[None, :]))
    topk = np.full((n, K), -1, dtype=np.int64)
    for i, pos in enumerate(rows):
        cand = [int(x) for x in rng.permutation(pos)][: int(rng.integers(0, len(pos) + 1))]
        ranking = cand + [int(x) for x in rng.permutation(num_labels) if x not in cand]
        rng.shuffle(ranking[:K])
        width = K if i % 4 else int(rng.integers(0, K + 1))  # some rankings shorter than K (padded with -1)
        topk[i, :width] = ranking[:width]
    return topk, truth, train


def _reference(topk, truth, counts, inv_p, k):
    """Row by row, as the docstrings define the split (an independent, loop-based reading)."""
    n = truth.shape[0]
    hits = {"seen": 0, "unseen": 0}
    gain = {"seen": 0.0, "unseen": 0.0}
    mass = {"seen": 0.0, "unseen": 0.0}
    for i in range(n):
        positives = set(truth[i].indices.tolist())
        seen_here = set()
        for label in topk[i, :k]:
            if label >= 0 and label in positives and label not in seen_here:
                seen_here.add(label)
                side = "unseen" if counts[label] == 0 else "seen"
                hits[side] += 1
                gain[side] += inv_p[label]
        for label in sorted(positives, key=lambda lab: -inv_p[lab])[:k]:
            mass["unseen" if counts[label] == 0 else "seen"] += inv_p[label]
    return {
        f"seen_P@{k}": hits["seen"] / (n * k), f"unseen_P@{k}": hits["unseen"] / (n * k),
        f"seen_PSP@{k}": gain["seen"] / mass["seen"], f"unseen_PSP@{k}": gain["unseen"] / mass["unseen"],
        f"unseen_PSP@{k}_mass": mass["unseen"] / (mass["seen"] + mass["unseen"]),
    }


@pytest.mark.parametrize("seed", [0, 1])
def test_seen_unseen_and_coverage_against_references(seed):
    topk, truth, train = _random_problem(seed)
    counts = np.asarray(train.sum(axis=0)).ravel()
    inv_p = inverse_propensity(train)
    assert (counts == 0).sum() >= 5  # the data must have unseen labels
    for k in (1, 3, 5, 10):
        m = seen_unseen_metrics(topk, truth, counts, inv_p, k)
        ref = _reference(topk, truth, counts, inv_p, k)
        assert 0 < m[f"unseen_P@{k}"] and 0 < m[f"unseen_PSP@{k}_mass"] < 1, (k, m)
        for key, value in ref.items():
            assert m[key] == pytest.approx(value, rel=1e-10), (k, key)
        assert m[f"seen_P@{k}"] + m[f"unseen_P@{k}"] == pytest.approx(precision_at_k(topk, truth, k), rel=1e-12)
        mass = m[f"unseen_PSP@{k}_mass"]
        assert mass * m[f"unseen_PSP@{k}"] + (1 - mass) * m[f"seen_PSP@{k}"] == pytest.approx(psprecision_at_k(topk, truth, inv_p, k), rel=1e-10)
    nm = pytest.importorskip("napkinxc.metrics")
    reference = nm.coverage_at_k(truth, [[int(x) for x in row] for row in topk], k=topk.shape[1])
    for k in range(1, topk.shape[1] + 1):
        assert coverage_at_k(topk, truth, k) == pytest.approx(reference[k - 1], rel=1e-12), k


def test_huge_label_space_is_not_densified():
    n, L = 1000, 10**7  # n x L = 1e10 cells: a dense intermediate would exhaust memory (the counts are O(L))
    rng = np.random.default_rng(0)
    true_ids = rng.integers(0, L, size=(n, 2))
    truth = sp.csr_matrix((np.ones(2 * n), (np.repeat(np.arange(n), 2), true_ids.ravel())), shape=(n, L))
    topk = np.hstack([true_ids[:, :1], rng.integers(0, L, size=(n, 4))])
    counts = np.zeros(L, dtype=np.float32)
    counts[true_ids[:, 0]] = 1  # the first label of each query is seen, the second unseen
    assert coverage_at_k(topk, truth, 5) == pytest.approx(np.unique(true_ids[:, 0]).size / np.unique(true_ids).size)
    m = seen_unseen_metrics(topk, truth, counts, k=1)
    assert m["seen_P@1"] == pytest.approx(1.0) and m["unseen_P@1"] == 0.0


# ------------------------------------------------------------------------------------------------ the evaluator
@pytest.fixture(scope="module")
def tiny_model(tiny_encoder_dir):
    import torch

    from hf_xmc.models import DEXMLModel

    torch.manual_seed(0)
    return DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, max_seq_length=16, label_max_seq_length=16)


def _train_with_unseen(data, num_unseen: int = 4) -> sp.csr_matrix:
    """The task's train targets with the first ``num_unseen`` labels' columns emptied: those labels become unseen."""
    keep = np.ones(len(data.label_texts))
    keep[:num_unseen] = 0
    return sp.csr_matrix(data.train.targets.multiply(keep[None, :]))


def _expected_tail(ids, data, train, prefix):
    counts = np.asarray(train.sum(axis=0)).ravel()
    inv_p = inverse_propensity(train)
    split = seen_unseen_metrics(ids, data.test.targets, counts, inv_p, 5)
    out = {f"{prefix}coverage@5": 100 * coverage_at_k(ids, data.test.targets, 5)}
    out.update({f"{prefix}{key}": 100 * split[key] for key in ("seen_P@5", "unseen_P@5", "seen_PSP@5", "unseen_PSP@5")})
    buckets = precision_by_frequency_bucket(ids, data.test.targets, counts, k=5, num_buckets=10)
    out.update({f"{prefix}P@5_decile{b['bucket'] + 1}": 100 * b["precision_contribution"] for b in buckets})
    return out, split


def test_evaluator_reports_coverage_seen_unseen_and_deciles(tiny_model, tiny_task):
    from hf_xmc.training import XMCEvaluator

    data = tiny_task[0]
    train = _train_with_unseen(data)
    evaluator = XMCEvaluator(data.test, data.label_texts, train_targets=train, recall_ks=(10,))
    out = evaluator(tiny_model)
    ids = evaluator.last_predictions
    expected, split = _expected_tail(ids, data, train, "test_")
    for key, value in expected.items():
        assert out[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    assert out["test_unseen_labels"] == 4 and isinstance(out["test_unseen_labels"], int)
    assert out["test_unseen_PSP@5_mass"] == pytest.approx(100 * split["unseen_PSP@5_mass"])
    assert out["test_unseen_positive_share"] == pytest.approx(100 * split["unseen_positive_share"])
    # the decompositions hold on the evaluator's own keys
    assert out["test_seen_P@5"] + out["test_unseen_P@5"] == pytest.approx(out["test_P@5"])
    assert sum(out[f"test_P@5_decile{d}"] for d in range(1, 11)) == pytest.approx(out["test_P@5"])
    mass = out["test_unseen_PSP@5_mass"] / 100
    assert mass * out["test_unseen_PSP@5"] + (1 - mass) * out["test_seen_PSP@5"] == pytest.approx(out["test_PSP@5"])
    assert 0 < out["test_unseen_P@5"] and 0 < mass < 1  # the planted task ranks some unseen labels right
    assert all(isinstance(v, (int, float)) for v in out.values())  # scalars: the Trainer's log and JSON carry them
    assert "test_latency_bs1_p50_ms" not in out and not any("_dense_" in k for k in out)  # off by default; no channel

    # a validation twin keeps the setting; without train targets only coverage@k is reported; tail_metrics=False: none
    twin = evaluator.for_queries(data.test, "eval")(tiny_model)
    assert twin["eval_unseen_PSP@5"] == pytest.approx(out["test_unseen_PSP@5"])
    plain = XMCEvaluator(data.test, data.label_texts, recall_ks=(10,))(tiny_model)
    assert plain["test_coverage@5"] == pytest.approx(out["test_coverage@5"])
    assert not [k for k in plain if "seen" in k or "decile" in k]
    off = XMCEvaluator(data.test, data.label_texts, train_targets=train, recall_ks=(10,), tail_metrics=False)(tiny_model)
    assert not [k for k in off if "coverage" in k or "seen" in k or "decile" in k]
    assert {k: v for k, v in off.items() if "P@" in k} == {k: v for k, v in out.items() if k in off and "P@" in k}


def test_evaluator_batch_size_one_latency(tiny_model, tiny_task):
    from hf_xmc.training import XMCEvaluator

    data = tiny_task[0]
    evaluator = XMCEvaluator(data.test, data.label_texts, recall_ks=(10,), latency_queries=7)
    calls = []
    rank = tiny_model.rank

    def counting_rank(texts, k, *args, **kwargs):
        calls.append((len(texts), k, kwargs.get("batch_size")))
        return rank(texts, k, *args, **kwargs)

    tiny_model.rank = counting_rank
    try:
        out = evaluator(tiny_model)
    finally:
        del tiny_model.rank
    assert out["test_latency_bs1_p50_ms"] > 0
    single = [c for c in calls if c[0] == 1]
    assert len(single) == 3 + 7 and all(c == (1, 5, 1) for c in single)  # 3 warm-up + 7 timed, one query each
    with pytest.raises(ValueError, match="latency_queries"):
        XMCEvaluator(data.test, data.label_texts, latency_queries=-1)


def test_evaluator_reports_the_dense_rankings_tail_too(tiny_encoder_dir, tiny_task):
    pytest.importorskip("omikuji")
    from hf_xmc.models import DEXMLModel
    from hf_xmc.training import XMCEvaluator
    from hf_xmc.training.lexical import fit_lexical_channel

    data = tiny_task[0]
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, max_seq_length=16, label_max_seq_length=16)
    model.set_labels(data.label_texts, data.label_uids)
    fit_lexical_channel(model, data.train, ranker_weight=0.5, text_weight=0.1, tune_queries=100, n_threads=1)
    train = _train_with_unseen(data)
    evaluator = XMCEvaluator(data.test, data.label_texts, train_targets=train, recall_ks=(10,))
    out = evaluator(model)
    dense_ids = evaluator.dense_predictions[:, :5]
    expected, _ = _expected_tail(dense_ids, data, train, "test_dense_")
    for key, value in expected.items():
        assert out[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    assert out["test_dense_seen_P@5"] + out["test_dense_unseen_P@5"] == pytest.approx(out["test_dense_P@5"])
    # the split's own counts are reported once, not per ranking
    assert "test_unseen_labels" in out and not [k for k in out if k.startswith("test_dense_unseen_") and k.endswith(("labels", "share", "mass"))]
    fused, _ = _expected_tail(evaluator.last_predictions, data, train, "test_")
    assert out["test_coverage@5"] == pytest.approx(fused["test_coverage@5"])
    assert xmc_metrics(dense_ids, data.test.targets, ks=(5,), recall_ks=())["P@5"] == pytest.approx(out["test_dense_P@5"])


def test_trainer_evaluate_logs_the_tail_keys(tiny_model, tiny_task, tmp_path):
    from hf_xmc.training import XMCEvaluator, XMCTrainer, XMCTrainingArguments

    data = tiny_task[0]
    evaluator = XMCEvaluator(data.test, data.label_texts, train_targets=_train_with_unseen(data), recall_ks=(10,), name="eval")
    args = XMCTrainingArguments(output_dir=str(tmp_path), save_strategy="no", disable_tqdm=True, report_to="none")
    trainer = XMCTrainer(model=tiny_model, args=args, train_dataset=data.train, label_texts=data.label_texts, evaluator=evaluator)
    metrics = trainer.evaluate()
    logged = trainer.state.log_history[-1]
    for key in ("eval_coverage@5", "eval_unseen_PSP@5", "eval_unseen_PSP@5_mass", "eval_unseen_labels", "eval_P@5_decile10"):
        assert logged[key] == metrics[key], key
