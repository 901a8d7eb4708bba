"""MUFIN's losses pinned to hand-computed values (spec checks 10 and 13)."""

import math

import pytest
import torch

from hf_xmc.models.xmc_losses import mufin_ranker_loss, mufin_triplet_loss

POS = torch.tensor([[0.5, 0.8]])
NEG = torch.tensor([[0.4, 0.1, 0.6]])


def test_triplet_loss_by_hand():
    # pos 0.5: hinges 0.1, 0, 0.3; pos 0.8: 0, 0, 0 -> 0.4 in total over 6 pairs
    assert mufin_triplet_loss(POS, NEG, margin=0.2).item() == pytest.approx(0.4)
    assert mufin_triplet_loss(POS, NEG, margin=0.2, reduction="mean").item() == pytest.approx(0.4 / 6)
    # the official code's margin 0.3: pos 0.5 -> 0.2, 0, 0.4; pos 0.8 -> 0, 0, 0.1
    assert mufin_triplet_loss(POS, NEG, margin=0.3).item() == pytest.approx(0.7)


def test_triplet_loss_masks_and_gradient():
    pos = POS.clone().requires_grad_(True)
    neg_mask = torch.tensor([[True, True, False]])  # the 0.6 negative is padding
    loss = mufin_triplet_loss(pos, NEG, margin=0.2, neg_mask=neg_mask)
    assert loss.item() == pytest.approx(0.1)
    loss.backward()
    assert pos.grad.tolist() == [[-1.0, 0.0]]  # one active hinge, on the 0.5 positive
    pos_mask = torch.tensor([[False, True]])
    assert mufin_triplet_loss(POS, NEG, margin=0.2, pos_mask=pos_mask).item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="reduction"):
        mufin_triplet_loss(POS, NEG, reduction="max")


def test_triplet_loss_negative_weighting():
    # softmax(s_neg / 0.1) over (0.4, 0.1, 0.6) weighs the hinges 0.1 (neg 0.4) and 0.3 (neg 0.6)
    z = math.exp(4) + math.exp(1) + math.exp(6)
    expected = 0.1 * math.exp(4) / z + 0.3 * math.exp(6) / z
    assert mufin_triplet_loss(POS, NEG, margin=0.2, negative_temperature=0.1).item() == pytest.approx(expected, rel=1e-5)


def test_ranker_loss_by_hand():
    pos, neg = torch.tensor([[0.9, 0.3]]), torch.tensor([[0.6, 0.4, 0.7]])
    # (1 - 0.9) + (1 - 0.3) + [0.6 - 0.5]_+ + [0.4 - 0.5]_+ + [0.7 - 0.5]_+ = 0.1 + 0.7 + 0.1 + 0 + 0.2
    assert mufin_ranker_loss(pos, neg, margin=0.5, reduction="sum").item() == pytest.approx(1.1)
    assert mufin_ranker_loss(pos, neg, margin=0.5).item() == pytest.approx(1.1 / 5)
    masked = mufin_ranker_loss(pos, neg, pos_mask=torch.tensor([[True, False]]), reduction="sum")
    assert masked.item() == pytest.approx(0.4)


def test_ranker_loss_rows_of_different_lengths():
    pos = torch.tensor([[0.9, 0.0], [0.5, 0.2]])
    neg = torch.tensor([[0.6, 0.0], [0.9, 0.1]])
    pos_mask = torch.tensor([[True, False], [True, True]])
    neg_mask = torch.tensor([[True, False], [True, True]])
    # row 0: 0.1 + 0.1; row 1: 0.5 + 0.8 + 0.4 + 0 -> 1.9 over 6 valid pairs
    loss = mufin_ranker_loss(pos, neg, pos_mask=pos_mask, neg_mask=neg_mask)
    assert loss.item() == pytest.approx(1.9 / 6)
