"""Pool losses pinned to hand-computed values (DEXML eqs. 2-5)."""

import math

import pytest
import torch

from hf_xmc.models import (
    BCELoss,
    DecoupledSoftmaxLoss,
    InfoNCELoss,
    SoftmaxLoss,
    decoupled_softmax_loss,
    get_loss,
    softmax_loss,
)

# Two queries, a pool of three labels. Query 0 has positives {0, 1}; query 1 has positive {2}.
LOGITS = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 3.0]])
TARGETS = torch.tensor([[True, True, False], [False, False, True]])
e = math.exp


def test_decoupled_softmax_hand_computed():
    # query 0, positive 0: log(e^2 + e^0) - 2 (positive 1 is NOT in the denominator); positive 1: log(e^1 + e^0) - 1
    q0 = ((math.log(e(2) + e(0)) - 2) + (math.log(e(1) + e(0)) - 1)) / 2  # = (0.126928 + 0.313262) / 2
    # query 1, positive 2: log(e^3 + e^0 + e^1) - 3
    q1 = math.log(e(3) + e(0) + e(1)) - 3  # = 0.169846
    expected = (q0 + q1) / 2  # = 0.194968
    assert abs(expected - 0.194968) < 1e-5
    assert DecoupledSoftmaxLoss()(LOGITS, TARGETS).item() == pytest.approx(expected, abs=1e-6)


def test_softmax_hand_computed():
    lse0 = math.log(e(2) + e(1) + e(0))  # 2.407606: both positives share one denominator
    q0 = ((lse0 - 2) + (lse0 - 1)) / 2
    q1 = math.log(e(0) + e(1) + e(3)) - 3
    expected = (q0 + q1) / 2  # = 0.538726
    assert abs(expected - 0.538726) < 1e-5
    assert SoftmaxLoss()(LOGITS, TARGETS).item() == pytest.approx(expected, abs=1e-6)


def test_infonce_hand_computed():
    # one sampled positive per query (pool positions 1 and 2); query 0's other positive (0) acts as a negative
    q0 = math.log(e(2) + e(1) + e(0)) - 1
    q1 = math.log(e(0) + e(1) + e(3)) - 3
    loss = InfoNCELoss()(LOGITS, TARGETS, positive_index=torch.tensor([1, 2]))
    assert loss.item() == pytest.approx((q0 + q1) / 2, abs=1e-6)
    with pytest.raises(ValueError, match="positive_index"):
        InfoNCELoss()(LOGITS, TARGETS)


def test_bce_hand_computed():
    def softplus(x):
        return math.log1p(e(x))

    pairs = [(2, 1), (1, 1), (0, 0), (0, 0), (1, 0), (3, 1)]
    expected = sum(softplus(s) - y * s for s, y in pairs) / 6
    assert BCELoss()(LOGITS, TARGETS).item() == pytest.approx(expected, abs=1e-6)


def test_decoupled_equals_softmax_with_one_positive_per_query():
    logits = torch.randn(5, 7)
    targets = torch.zeros(5, 7, dtype=torch.bool)
    targets[torch.arange(5), torch.tensor([0, 3, 6, 2, 2])] = True
    assert decoupled_softmax_loss(logits, targets).item() == pytest.approx(softmax_loss(logits, targets).item(), abs=1e-6)


def test_decoupled_never_pushes_a_positive_down():
    # The gradient of DecoupledSoftmax w.r.t. a positive logit is -(1 - sigma) < 0 (descent raises it), even when
    # that positive already dominates; softmax pushes a dominating positive down (DEXML section 4.1).
    logits = torch.tensor([[8.0, 0.0, -1.0, -2.0]], requires_grad=True)
    targets = torch.tensor([[True, True, False, False]])
    decoupled_softmax_loss(logits, targets).backward()
    assert (logits.grad[0, :2] < 0).all()
    logits.grad = None
    softmax_loss(logits, targets).backward()
    assert logits.grad[0, 0] > 0  # softmax: the confident positive gets pushed down


def test_masked_false_negative_is_not_a_negative():
    logits = torch.tensor([[1.0, 5.0, 0.0]])
    # as a negative, label 1's high score dominates the first positive's denominator ...
    as_negative = decoupled_softmax_loss(logits, torch.tensor([[True, False, False]]))
    assert as_negative.item() == pytest.approx(math.log(e(1) + e(5) + e(0)) - 1, abs=1e-6)
    # ... but once marked as a positive it leaves that denominator (and contributes its own term)
    as_positive = decoupled_softmax_loss(logits, torch.tensor([[True, True, False]]))
    expected = ((math.log(e(1) + e(0)) - 1) + (math.log(e(5) + e(0)) - 5)) / 2
    assert as_positive.item() == pytest.approx(expected, abs=1e-6)


def test_rows_without_positive_are_ignored_and_empty_batch_is_zero():
    logits = torch.tensor([[2.0, 1.0], [5.0, 5.0]], requires_grad=True)
    targets = torch.tensor([[True, False], [False, False]])
    loss = decoupled_softmax_loss(logits, targets)
    assert loss.item() == pytest.approx(math.log(e(2) + e(1)) - 2, abs=1e-6)
    empty = decoupled_softmax_loss(logits, torch.zeros(2, 2, dtype=torch.bool))
    assert empty.item() == 0.0
    empty.backward()  # still differentiable


def test_get_loss_names():
    assert isinstance(get_loss("decoupled_softmax"), DecoupledSoftmaxLoss)
    with pytest.raises(ValueError, match="unknown loss"):
        get_loss("hinge")
