"""UniDEC's losses pinned to hand-computed values (spec shared/specs/unidec.md sections 3.4-3.8)."""

import math

import pytest
import torch
import torch.nn.functional as F

from hf_xmc.models import UniDECLoss, symmetric_pool_loss

# 2 queries x 3 pool labels; query 0 has labels 0 and 1, query 1 has label 2
LOGITS = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 3.0]])
TARGETS = torch.tensor([[True, True, False], [False, False, True]])


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


# Decoupled Softmax by hand: for each positive p, log(e^s_p + sum_negatives e^s_n) - s_p
DS_Q2L = ((math.log(math.e**2 + 1) - 2 + math.log(math.e + 1) - 1) / 2 + (math.log(math.e**3 + 1 + math.e) - 3)) / 2
# transposed: label 0 <- [2, 0] (query 0 positive), label 1 <- [1, 1] (query 0), label 2 <- [0, 3] (query 1)
DS_L2Q = ((math.log(math.e**2 + 1) - 2) + math.log(2.0) + (math.log(math.e**3 + 1) - 3)) / 3


def test_decoupled_softmax_symmetric_loss_by_hand():
    terms = symmetric_pool_loss(LOGITS, TARGETS, "decoupled_softmax", query_to_label_weight=0.5)
    assert terms["query_to_label"].item() == pytest.approx(DS_Q2L, abs=1e-6)
    assert terms["label_to_query"].item() == pytest.approx(DS_L2Q, abs=1e-6)
    assert terms["loss"].item() == pytest.approx(0.5 * DS_Q2L + 0.5 * DS_L2Q, abs=1e-6)


def test_supcon_keeps_other_positives_in_the_denominator():
    terms = symmetric_pool_loss(LOGITS, TARGETS, "softmax", query_to_label_weight=1.0)
    # row 0: both positives share one denominator e^2 + e^1 + e^0
    row0 = ((math.log(math.e**2 + math.e + 1) - 2) + (math.log(math.e**2 + math.e + 1) - 1)) / 2
    row1 = math.log(1 + math.e + math.e**3) - 3
    assert terms["query_to_label"].item() == pytest.approx((row0 + row1) / 2, abs=1e-6)
    assert "label_to_query" not in terms  # weight 1 drops the symmetric term exactly
    assert terms["loss"].item() == pytest.approx((row0 + row1) / 2, abs=1e-6)
    # with two positives in a row the decoupled loss is the smaller one
    assert symmetric_pool_loss(LOGITS, TARGETS, "decoupled_softmax", 1.0)["loss"] < terms["loss"]


def test_single_positive_rows_make_both_losses_cross_entropy():
    logits = torch.randn(4, 6)
    targets = torch.zeros(4, 6, dtype=torch.bool)
    targets[torch.arange(4), torch.tensor([0, 3, 5, 1])] = True
    expected = F.cross_entropy(logits, torch.tensor([0, 3, 5, 1]))
    for loss in ("decoupled_softmax", "softmax"):
        assert symmetric_pool_loss(logits, targets, loss, 1.0)["loss"].item() == pytest.approx(expected.item(), abs=1e-6)


def test_label_to_query_is_the_transposed_query_to_label_and_skips_pure_negatives():
    logits = torch.randn(5, 7)
    targets = torch.rand(5, 7) > 0.6
    targets[:, 6] = False  # a hard negative no batch query carries: no label->query term of its own
    targets[torch.arange(5), torch.arange(5)] = True
    l2q = symmetric_pool_loss(logits, targets, "decoupled_softmax", 0.0)["label_to_query"]
    q2l_of_transpose = symmetric_pool_loss(logits.T, targets.T, "decoupled_softmax", 1.0)["query_to_label"]
    torch.testing.assert_close(l2q, q2l_of_transpose)
    without_label_6 = symmetric_pool_loss(logits[:, :6].T, targets[:, :6].T, "decoupled_softmax", 1.0)["loss"]
    torch.testing.assert_close(l2q, without_label_6)
    assert torch.isfinite(l2q)


def test_unidec_loss_combines_heads_and_bce_by_hand():
    de_logits, clf_logits = LOGITS, LOGITS.flip(1)
    clf_scores = torch.tensor([[0.0, 2.0, -1.0], [1.0, 0.0, 0.5]])
    terms = UniDECLoss()(de_logits, TARGETS, clf_logits, clf_scores)
    de = 0.5 * DS_Q2L + 0.5 * DS_L2Q
    clf_ds = symmetric_pool_loss(clf_logits, TARGETS, "decoupled_softmax", 0.5)["loss"].item()
    # BCE by hand: mean over the 6 pairs of softplus(-s) for positives and softplus(s) for negatives
    bce = (softplus(-0.0) + softplus(-2.0) + softplus(-1.0) + softplus(1.0) + softplus(0.0) + softplus(-0.5)) / 6
    assert terms["de"].item() == pytest.approx(de, abs=1e-6)
    assert terms["clf_bce"].item() == pytest.approx(bce, abs=1e-6)
    assert terms["clf"].item() == pytest.approx(clf_ds + bce, abs=1e-6)
    assert terms["loss"].item() == pytest.approx(0.5 * de + 0.5 * (clf_ds + bce), abs=1e-6)
    weighted = UniDECLoss(de_weight=0.25, clf_bce_weight=2.0)(de_logits, TARGETS, clf_logits, clf_scores)
    assert weighted["loss"].item() == pytest.approx(0.25 * de + 0.75 * (clf_ds + 2 * bce), abs=1e-6)


def test_unidec_loss_without_classifier_is_the_de_loss():
    terms = UniDECLoss()(LOGITS, TARGETS)
    assert terms["loss"].item() == pytest.approx(0.5 * DS_Q2L + 0.5 * DS_L2Q, abs=1e-6)
    assert not any(name.startswith("clf") for name in terms)
    with pytest.raises(ValueError, match="clf_scores"):
        UniDECLoss()(LOGITS, TARGETS, LOGITS, None)
    with pytest.raises(ValueError, match="unknown PSL loss"):
        symmetric_pool_loss(LOGITS, TARGETS, "bce")


def test_rows_without_positives_give_a_finite_loss_and_gradient():
    logits = torch.randn(3, 4, requires_grad=True)
    targets = torch.zeros(3, 4, dtype=torch.bool)
    targets[0, 1] = True
    loss = UniDECLoss()(logits, targets, logits * 2, logits)["loss"]
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()
