"""SoftTop-k operator and loss (DEXML eq. 6): threshold, implicit-differentiation gradient, masking, subsampling."""

import math

import pytest
import torch

from hf_xmc.models.xmc_losses import (
    LOSSES,
    SoftTopKLoss,
    get_loss,
    sample_positive_subset,
    soft_topk_log,
    soft_topk_loss,
)


def _x(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) * 2


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("alpha", [0.5, 2.0, 40.0])
def test_threshold_makes_z_sum_to_k(k, alpha):
    x = _x(5, 9)
    z = soft_topk_log(x, k, alpha=alpha).exp()
    assert torch.allclose(z.sum(dim=1), torch.full((5,), float(k), dtype=z.dtype), atol=1e-5)
    assert bool(((z >= 0) & (z <= 1)).all())
    if alpha < 40.0:  # monotone in x (at alpha=40 float64 saturates several z at exactly 1)
        assert torch.equal(z.argsort(dim=1), x.argsort(dim=1))
    else:  # steep: close to HardTop-k
        hard = torch.zeros_like(z).scatter_(1, x.topk(k, dim=1).indices, 1.0)
        assert bool(((z * hard).sum(dim=1) > k - 0.5).all())  # the soft mass sits on the hard top-k


def test_float32_and_per_row_k():
    k = torch.tensor([1.0, 2.0, 4.5])
    z = soft_topk_log(_x(3, 8, dtype=torch.float32), k).exp()
    assert torch.allclose(z.sum(dim=1), k, atol=1e-4)
    assert soft_topk_log(_x(2, 8, dtype=torch.bfloat16), 2).dtype == torch.bfloat16


def test_hand_computed_two_entries():
    # n=2, k=1, alpha=1: z1 + z2 = 1 forces x1 + t = -(x2 + t), so t = -(x1 + x2)/2 and z1 = sigmoid((x1 - x2)/2)
    x = torch.tensor([[3.0, 1.0]], dtype=torch.float64, requires_grad=True)
    log_z = soft_topk_log(x, 1, alpha=1.0)
    sig1 = 1 / (1 + math.exp(-1.0))  # 0.7310586
    assert log_z[0, 0].item() == pytest.approx(math.log(sig1), abs=1e-8)  # -0.3132617
    assert log_z[0, 1].item() == pytest.approx(math.log(1 - sig1), abs=1e-8)  # -1.3132617
    # d log z1 / dx = (1 - z1)/2 * (1, -1), the derivative of log sigmoid((x1 - x2)/2)
    (grad,) = torch.autograd.grad(log_z[0, 0], x)
    assert torch.allclose(grad, torch.tensor([[1 - sig1, -(1 - sig1)]], dtype=torch.float64) / 2, atol=1e-8)


def test_gradcheck_implicit_backward():
    # 60 halvings: the float64 threshold is then exact enough for finite differences with eps = 1e-6
    x = _x(3, 6, seed=1).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: soft_topk_log(t, 2, alpha=1.5, n_iter=60), (x,), eps=1e-6, atol=1e-5)


def test_jacobian_is_symmetric_diag_v_minus_vvT_over_S():
    alpha, k = 2.0, 3
    x = _x(7, seed=2)
    f = lambda t: soft_topk_log(t, k, alpha=alpha, n_iter=60).exp()  # noqa: E731
    jac = torch.autograd.functional.jacobian(f, x)  # through the custom backward
    z = f(x)
    v = alpha * z * (1 - z)
    expected = torch.diag(v) - torch.outer(v, v) / v.sum()
    eps = 1e-6
    numerical = torch.stack([(f(x + eps * e) - f(x - eps * e)) / (2 * eps) for e in torch.eye(7, dtype=x.dtype)], dim=1)
    assert torch.allclose(jac, expected, atol=1e-10)
    assert torch.allclose(jac, numerical, atol=1e-6)
    assert torch.allclose(jac, jac.T, atol=1e-12)
    assert torch.allclose(jac.sum(dim=0), torch.zeros(7, dtype=x.dtype), atol=1e-10)  # sum z = k is invariant


def test_mask_excludes_entries_and_zeroes_their_grad():
    x = _x(2, 8, seed=3).requires_grad_()
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, [1, 5]] = True
    mask[1, 0] = True
    g = _x(2, 8, seed=4)
    log_z = soft_topk_log(x, 2, mask=mask)
    assert bool(torch.isinf(log_z[mask]).all()) and bool(torch.isfinite(log_z[~mask]).all())
    (grad,) = torch.autograd.grad(torch.where(mask, 0.0, log_z * g).sum(), x)
    assert bool((grad[mask] == 0).all())
    for row in range(2):  # identical to running the operator on the kept entries alone
        keep = ~mask[row]
        xr = x.detach()[row, keep].clone().requires_grad_()
        log_zr = soft_topk_log(xr, 2)
        assert torch.allclose(log_zr, log_z[row, keep], atol=1e-10)
        (grad_r,) = torch.autograd.grad((log_zr * g[row, keep]).sum(), xr)
        assert torch.allclose(grad_r, grad[row, keep], atol=1e-10)
    # gradcheck on the kept entries, the masked ones being constant inputs
    xk = x.detach()[0, ~mask[0]].clone().requires_grad_()

    def f(t):
        full = x.detach()[0].clone()
        full[~mask[0]] = t
        return soft_topk_log(full, 3, n_iter=60, mask=mask[0])[~mask[0]]

    assert torch.autograd.gradcheck(f, (xk,), eps=1e-6, atol=1e-5)


def test_invalid_k_raises():
    x = _x(2, 4)
    for k in (0, 4, 5):
        with pytest.raises(ValueError, match="0 < k"):
            soft_topk_log(x, k)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[1, :2] = True  # row 1 keeps 2 entries: k=2 is not < 2
    with pytest.raises(ValueError, match="row 1"):
        soft_topk_log(x, 2, mask=mask)
    with pytest.raises(ValueError, match="pool larger than k"):
        soft_topk_loss(_x(2, 5), torch.ones(2, 5, dtype=torch.bool), k=5)


def test_loss_with_one_positive_is_minus_log_z():
    logits = _x(3, 10, seed=5)
    targets = torch.zeros(3, 10, dtype=torch.bool)
    targets[0, 2] = targets[1, 7] = True  # row 2 has no positive: left out of the mean
    log_z = soft_topk_log(logits, 5, alpha=2.0)
    expected = -(log_z[0, 2] + log_z[1, 7]) / 2
    assert SoftTopKLoss(k=5)(logits, targets).item() == pytest.approx(expected.item(), abs=1e-10)
    # a positive far above the rest is in the soft top-5: loss ~ 0
    easy = torch.zeros(1, 10, dtype=torch.float64)
    easy[0, 0] = 20.0
    assert soft_topk_loss(easy, torch.eye(10, dtype=torch.bool)[:1], k=5).item() < 1e-6


def test_positive_subsampling_respects_k():
    targets = torch.zeros(64, 12, dtype=torch.bool)
    targets[:, :8] = True  # 8 positives per row
    targets[0, :8] = False
    targets[0, 3] = True  # row 0: a single positive is always kept
    gen = torch.Generator().manual_seed(0)
    keep = sample_positive_subset(targets, 3, gen)
    assert bool((keep <= targets).all())
    assert keep[0].sum() == 1 and bool(keep[0, 3])
    assert bool((keep[1:].sum(dim=1) == 3).all())
    assert bool((keep[1:, :8].sum(dim=0) > 0).all())  # every positive gets drawn sometimes
    assert torch.equal(keep, sample_positive_subset(targets, 3, torch.Generator().manual_seed(0)))


def test_loss_gradient_only_on_kept_positives_and_pool():
    logits = _x(4, 12, seed=6).requires_grad_()
    targets = torch.zeros(4, 12, dtype=torch.bool)
    targets[:, :6] = True  # 6 positives per row, k = 2: 4 of them are excluded
    loss = soft_topk_loss(logits, targets, k=2, generator=torch.Generator().manual_seed(1))
    (grad,) = torch.autograd.grad(loss, logits)
    assert bool(torch.isfinite(grad).all())
    nonzero = grad[:, :6] != 0
    assert bool((nonzero.sum(dim=1) == 2).all())  # only the 2 kept positives of each row (the rest excluded)
    assert bool((grad[:, 6:] != 0).all())  # every negative is in the pool
    # recomputed by hand from the same subset
    keep = sample_positive_subset(targets, 2, torch.Generator().manual_seed(1))
    log_z = soft_topk_log(logits.detach(), 2, mask=targets & ~keep)
    assert loss.item() == pytest.approx((-log_z[keep].view(4, 2).mean(dim=1)).mean().item(), abs=1e-10)


def test_registered_and_get_loss_kwargs():
    assert LOSSES["soft_topk"] is SoftTopKLoss
    loss = get_loss("soft_topk", k=3, alpha=1.0)
    assert (loss.k, loss.alpha, loss.n_iter) == (3, 1.0, 32)
    assert get_loss("decoupled_softmax").__class__.__name__ == "DecoupledSoftmaxLoss"
    logits = torch.randn(4, 10, requires_grad=True)
    out = loss(logits, torch.zeros(4, 10, dtype=torch.bool))
    out.backward()  # an all-empty batch keeps the graph alive
    assert out.item() == 0.0
