"""PRIME's clipped dynamic-margin triplet loss and regulariser, pinned to hand-computed values (spec §4, §11.2)."""

import pytest
import torch

from hf_xmc.models import PRIMELoss, dynamic_margin_triplet, dynamic_margin_triplet_loss, prototype_regularizer


@pytest.mark.parametrize(
    "s_p, s_n, expected",
    [(0.2, 0.7, 0.8), (0.5, 0.6, 0.2), (0.5, 0.45, 0.05), (0.5, 0.35, 0.0), (0.9, 0.1, 0.0)],
)
def test_triplet_values_from_the_spec(s_p, s_n, expected):
    # D = s_p - s_n; m = clip(|D|, 0.1, 0.3); loss = max(0, -D + m)
    value = dynamic_margin_triplet(torch.tensor(s_p), torch.tensor(s_n), 0.1, 0.3)
    assert value.item() == pytest.approx(expected, abs=1e-6)


def test_triplet_is_continuous_at_zero_and_non_increasing():
    s_p = torch.tensor(0.5)
    diffs = torch.linspace(-1.0, 1.0, 2001)
    values = dynamic_margin_triplet(s_p, s_p - diffs, 0.1, 0.3)
    assert dynamic_margin_triplet(s_p, s_p, 0.1, 0.3).item() == pytest.approx(0.1)
    assert bool((values[1:] <= values[:-1] + 1e-6).all())
    assert bool((values[diffs >= 0.1 + 1e-6] == 0).all())


@pytest.mark.parametrize("s_p, s_n, grad", [(0.2, 0.7, (-1.0, 1.0)), (0.5, 0.62, (-1.0, 1.0)), (0.5, 0.45, (-1.0, 1.0)), (0.5, 0.3, (0.0, 0.0)), (0.9, 0.1, (0.0, 0.0))])
def test_triplet_gradient_proves_the_margin_is_detached(s_p, s_n, grad):
    # a hard triplet with -D in (0.1, 0.3) (second case) would get (-2, +2) if the margin carried gradient
    p = torch.tensor(s_p, requires_grad=True)
    n = torch.tensor(s_n, requires_grad=True)
    dynamic_margin_triplet(p, n, 0.1, 0.3).backward()
    assert (p.grad.item(), n.grad.item()) == pytest.approx(grad)


def test_paper_inverted_region_flips_the_ambiguous_gradient():
    p = torch.tensor(0.5, requires_grad=True)
    n = torch.tensor(0.45, requires_grad=True)  # 0 < D = 0.05 < gamma_min
    value = dynamic_margin_triplet(p, n, 0.1, 0.3, paper_inverted_region=True)
    value.backward()
    assert value.item() == pytest.approx(0.15)  # D + gamma_min
    assert (p.grad.item(), n.grad.item()) == pytest.approx((1.0, -1.0))
    hard = dynamic_margin_triplet(torch.tensor(0.2), torch.tensor(0.7), 0.1, 0.3, paper_inverted_region=True)
    assert hard.item() == pytest.approx(0.8)  # unchanged for D <= 0


def test_fixed_margin_when_margin_min_is_zero():
    value = dynamic_margin_triplet(torch.tensor(0.5), torch.tensor(0.45), 0.0, 0.3)
    assert value.item() == pytest.approx(0.25)


def test_unweighted_sum_has_the_fixed_margin_gradient():
    # with no temperature weighting, the dynamic margin changes values, not gradients (spec §4.4)
    torch.manual_seed(0)
    scores = torch.rand(6, 9, requires_grad=True)
    targets = torch.zeros(6, 9, dtype=torch.bool)
    targets[torch.arange(6), torch.arange(6)] = True
    dynamic_margin_triplet_loss(scores, targets, num_negatives=100, temperature=None, positive_selection="all").backward()
    dynamic = scores.grad.clone()
    scores.grad = None
    pos = scores.diagonal()[:, None]
    fixed = torch.relu(scores - pos + 0.1).masked_fill(targets, 0).sum(1).mean()
    fixed.backward()
    torch.testing.assert_close(dynamic, scores.grad)


def test_triplet_loss_by_hand_with_softmax_weights():
    # one row, positive at column 0 (0.5), negatives 0.7 (violates: 0.2+0.2 = 0.4), 0.45 (violates: 0.05), 0.1 (no)
    scores = torch.tensor([[0.5, 0.7, 0.45, 0.1]])
    targets = torch.tensor([[True, False, False, False]])
    w = torch.softmax(torch.tensor([0.7, 0.45]) / 0.1, dim=0)
    expected = 0.4 * w[0] + 0.05 * w[1]
    got = dynamic_margin_triplet_loss(scores, targets, num_negatives=100, temperature=0.1)
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    # only the 2 hardest negatives: the 0.1 column cannot matter, same value
    assert dynamic_margin_triplet_loss(scores, targets, num_negatives=2, temperature=0.1).item() == pytest.approx(expected.item(), rel=1e-5)
    # unweighted: the plain sum
    assert dynamic_margin_triplet_loss(scores, targets, temperature=None).item() == pytest.approx(0.45, rel=1e-5)


def test_softmax_weights_cover_only_violators_and_rows_without_violators_are_zero():
    scores = torch.tensor([[0.9, 0.1, 0.2], [0.5, 0.55, -0.3]])
    targets = torch.tensor([[True, False, False], [True, False, False]])
    # row 0 has no violator (D = 0.8, 0.7); row 1: 0.55 violates (0.05 + 0.1 = 0.15), -0.3 does not (D = 0.8)
    got = dynamic_margin_triplet_loss(scores, targets, temperature=0.1)
    assert got.item() == pytest.approx(0.15 / 2, rel=1e-5)  # weight 1 on the single violator, mean over 2 rows


def test_false_negatives_are_never_negatives():
    # column 1 is a positive of row 0 that scores far above everything: as a negative it would dominate
    scores = torch.tensor([[0.5, 0.99, 0.2]])
    targets = torch.tensor([[True, True, False]])
    torch.manual_seed(0)
    values = {round(dynamic_margin_triplet_loss(scores, targets, temperature=None).item(), 6) for _ in range(20)}
    # positive 0.5 vs negative 0.2: 0; positive 0.99 vs 0.2: 0 -> never the 0.99 "negative"
    assert values == {0.0}


def test_rows_without_positive_or_negative_are_skipped():
    scores = torch.tensor([[0.5, 0.7], [0.3, 0.2], [0.1, 0.4]])
    targets = torch.tensor([[True, False], [False, False], [True, True]])
    assert dynamic_margin_triplet_loss(scores, targets, temperature=None).item() == pytest.approx(0.4)
    empty = dynamic_margin_triplet_loss(scores, torch.zeros_like(targets), temperature=None)
    assert empty.item() == 0.0


def test_regularizer_by_hand():
    b = torch.tensor([[0.8, 0.5, 0.1]])  # prototype cosines
    s = torch.tensor([[0.75, 0.3, 0.2]])  # label-text cosines
    targets = torch.tensor([[True, False, False]])
    # positive: relu(0.75 - 0.8 + 0.1) = 0.05; negatives: relu(0.5 - 0.3 + 0.1) = 0.3, relu(0.1 - 0.2 + 0.1) = 0 -> mean 0.3
    assert prototype_regularizer(b, s, targets, margin=0.1).item() == pytest.approx(0.5 * (0.05 + 0.3))
    # nothing violates: b_p >= s_p + 0.1 and b_n <= s_n - 0.1 -> exactly 0, not NaN
    quiet = prototype_regularizer(torch.tensor([[0.9, 0.0]]), torch.tensor([[0.7, 0.3]]), torch.tensor([[True, False]]))
    assert quiet.item() == 0.0


def test_prime_loss_combines_the_terms():
    torch.manual_seed(0)
    b = torch.rand(4, 6) * 2 - 1
    s = torch.rand(4, 6) * 2 - 1
    targets = torch.zeros(4, 6, dtype=torch.bool)
    targets[torch.arange(4), torch.arange(4)] = True  # one positive each: no sampling randomness
    loss = PRIMELoss()
    terms = loss(b, s, targets)
    expected = (
        dynamic_margin_triplet_loss(b, targets)
        + dynamic_margin_triplet_loss(s, targets)
        + dynamic_margin_triplet_loss(s.T, targets.T)
        + 0.1 * prototype_regularizer(b, s, targets)
    )
    assert terms["loss"].item() == pytest.approx(expected.item(), rel=1e-6)
    only_prototype = PRIMELoss(query_to_label_weight=0, label_to_query_weight=0, regularizer_weight=0)(b, s, targets)
    assert set(only_prototype) == {"query_to_prototype", "loss"}
    assert only_prototype["loss"].item() == pytest.approx(terms["query_to_prototype"].item())
