"""SparseAdamW: AdamW on dense gradients, lazy row-wise AdamW on sparse ones; and XMCTrainer's choice of it."""

import copy
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hf_xmc.models import ExtremeClassifier, UniDECModel
from hf_xmc.training import SparseAdamW, XMCTrainer, XMCTrainingArguments
from hf_xmc.training.optim import sparse_gradient_parameters


def _loss(weight: torch.Tensor, ids: torch.Tensor, target: torch.Tensor, sparse: bool) -> torch.Tensor:
    return (F.embedding(ids, weight, sparse=sparse) - target).pow(2).sum()


@pytest.mark.parametrize("options", [{}, {"amsgrad": True}, {"maximize": True}])
def test_lazy_update_equals_adamw_when_every_row_is_touched(options):
    torch.manual_seed(0)
    start = torch.randn(6, 4)
    sparse, dense = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt_sparse = SparseAdamW([sparse], lr=0.05, weight_decay=0.1, **options)
    opt_dense = torch.optim.AdamW([dense], lr=0.05, weight_decay=0.1, foreach=False, **options)
    for _ in range(6):
        ids = torch.cat([torch.randperm(6), torch.tensor([2, 2, 5])])  # every row, some twice (summed on coalescing)
        target = torch.randn(len(ids), 4)
        _loss(sparse, ids, target, sparse=True).backward()
        _loss(dense, ids, target, sparse=False).backward()
        assert sparse.grad.is_sparse and not sparse.grad.is_coalesced()
        opt_sparse.step()
        opt_dense.step()
        opt_sparse.zero_grad()
        opt_dense.zero_grad()
    assert not torch.equal(sparse, start)
    torch.testing.assert_close(sparse, dense, atol=1e-6, rtol=1e-6)
    for key, value in opt_dense.state[dense].items():
        torch.testing.assert_close(opt_sparse.state[sparse][key], value, atol=1e-6, rtol=1e-6, msg=key)


def test_untouched_rows_do_not_move():
    torch.manual_seed(0)
    start = torch.randn(8, 3)
    weight = torch.nn.Parameter(start.clone())
    optimizer = SparseAdamW([weight], lr=0.1, weight_decay=0.5)  # strong decay: any drift on other rows would show
    touched = torch.tensor([1, 6])
    for _ in range(4):
        _loss(weight, touched, torch.randn(2, 3), sparse=True).backward()
        optimizer.step()
        optimizer.zero_grad()
    others = torch.tensor([0, 2, 3, 4, 5, 7])
    assert torch.equal(weight[others], start[others])  # bit for bit: no weight decay, no moment update
    assert not torch.equal(weight[touched], start[touched])
    state = optimizer.state[weight]
    assert float(state["step"]) == 4
    assert not state["exp_avg"][others].any() and not state["exp_avg_sq"][others].any()
    assert state["exp_avg_sq"][touched].all()


def test_dense_parameters_take_adamw_step_hooks_run_once():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    start = model[0].weight.detach().clone()
    reference = copy.deepcopy(model)
    reference[0].sparse = False
    torch.optim.AdamW(torch.nn.Linear(1, 1).parameters()).step()  # torch wraps AdamW.step with its hooks on first use
    opt = SparseAdamW(model.parameters(), lr=0.01, weight_decay=0.01, fused=True)  # transformers' default: fused
    ref = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.01, fused=True)
    calls = []
    opt.register_step_pre_hook(lambda *args: calls.append("pre"))
    opt.register_step_post_hook(lambda *args: calls.append("post"))
    for _ in range(3):
        ids = torch.tensor([1, 4, 4])
        model(ids).sum().backward()
        reference(ids).sum().backward()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    assert calls == ["pre", "post"] * 3
    torch.testing.assert_close(model[1].weight, reference[1].weight, atol=0, rtol=0)  # AdamW's own (fused) step
    rows = torch.tensor([1, 4])  # the same rows each step: lazy = dense AdamW there; dense AdamW also decays the rest
    torch.testing.assert_close(model[0].weight[rows], reference[0].weight[rows], atol=1e-6, rtol=1e-5)
    others = torch.tensor([0, 2, 3, 5, 6, 7, 8, 9])
    assert torch.equal(model[0].weight[others], start[others]) and not torch.equal(reference[0].weight[others], start[others])


def test_state_dict_round_trip_and_lr_schedule():
    torch.manual_seed(0)

    def make(weight):
        table = torch.nn.Embedding(12, 4, sparse=True, _weight=weight.clone())
        head = torch.nn.Linear(4, 1)
        head.load_state_dict({"weight": torch.ones(1, 4), "bias": torch.zeros(1)})
        opt = SparseAdamW([{"params": table.parameters(), "lr": 0.1}, {"params": head.parameters(), "weight_decay": 0.0}], lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
        return table, head, opt, sched

    batches = [(torch.randint(0, 12, (5,)), torch.randn(5)) for _ in range(6)]

    def train(table, head, opt, sched, steps):
        for ids, y in steps:
            (head(table(ids)).squeeze(1) - y).pow(2).sum().backward()
            opt.step()
            sched.step()
            opt.zero_grad()

    start = torch.randn(12, 4)
    table, head, opt, sched = make(start)
    train(table, head, opt, sched, batches[:3])
    saved = (copy.deepcopy(table.state_dict()), copy.deepcopy(head.state_dict()), copy.deepcopy(opt.state_dict()), sched.state_dict())
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)  # the schedule drives group["lr"]
    train(table, head, opt, sched, batches[3:])

    table2, head2, opt2, sched2 = make(torch.zeros(12, 4))
    table2.load_state_dict(saved[0])
    head2.load_state_dict(saved[1])
    opt2.load_state_dict(saved[2])
    sched2.load_state_dict(saved[3])
    train(table2, head2, opt2, sched2, batches[3:])
    assert torch.equal(table2.weight, table.weight) and torch.equal(head2.weight, head.weight)  # identical updates
    assert torch.equal(opt2.state[table2.weight]["exp_avg"], opt.state[table.weight]["exp_avg"])


def test_sparse_gradient_parameters_are_the_sparse_tables(tiny_encoder_dir, tiny_task):
    model = UniDECModel.from_encoder_pretrained(tiny_encoder_dir, label_space_size=len(tiny_task[0].label_texts), projection_dim=8)
    assert sparse_gradient_parameters(model) == [model.classifier.weight]  # not the encoder's (dense) word embeddings
    assert isinstance(model.classifier, ExtremeClassifier) and model.classifier.sparse
    dense = UniDECModel.from_encoder_pretrained(tiny_encoder_dir, label_space_size=40, projection_dim=8, sparse_label_gradients=False)
    assert sparse_gradient_parameters(dense) == []


def _unidec_trainer(encoder_dir, data, out_dir, sparse: bool, **kwargs):
    torch.manual_seed(0)
    model = UniDECModel.from_encoder_pretrained(
        encoder_dir, label_space_size=len(data.label_texts), projection_dim=12, max_seq_length=16, label_max_seq_length=16,
        sparse_label_gradients=sparse,
    )
    args = XMCTrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=16, learning_rate=1e-3, save_strategy="no",
                                seed=0, disable_tqdm=True, logging_steps=1, **kwargs)
    return XMCTrainer(model=model, args=args, train_dataset=data.train, label_texts=data.label_texts)


def test_trainer_sparse_path_matches_the_dense_path_when_every_row_is_touched(tiny_encoder_dir, tiny_task, tmp_path):
    # an uncapped PSL pool that every label joins as a "negative": every classifier row is in every pool, so lazy
    # row-wise AdamW is AdamW step for step
    data = tiny_task[0]
    runs = {}
    for sparse in (True, False):
        trainer = _unidec_trainer(tiny_encoder_dir, data, tmp_path / str(sparse), sparse, max_steps=4, label_pool="psl", max_label_pool=0)
        trainer.data_collator.sample_negatives = lambda rows, rng: np.arange(len(data.label_texts))
        initial = trainer.model.classifier.weight.detach().clone()
        trainer.train()
        runs[sparse] = trainer
    sparse_run, dense_run = runs[True], runs[False]
    assert isinstance(sparse_run.optimizer.optimizer, SparseAdamW) and not isinstance(dense_run.optimizer.optimizer, SparseAdamW)
    psi = sparse_run.model.classifier.weight
    assert float(sparse_run.optimizer.optimizer.state[psi]["step"]) == 4  # Psi went through the lazy update each step
    losses = [[e["loss"] for e in run.state.log_history if "loss" in e] for run in (sparse_run, dense_run)]
    assert losses[0] == pytest.approx(losses[1], abs=1e-5) and len(losses[0]) == 4
    for (name, a), (_, b) in zip(sparse_run.model.named_parameters(), dense_run.model.named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)
    assert (psi.detach().cpu() - initial).abs().max() > 1e-3  # and the classifier did train


def test_trainer_step_moves_only_pool_rows(tiny_encoder_dir, tiny_task, tmp_path):
    data = tiny_task[0]
    trainer = _unidec_trainer(tiny_encoder_dir, data, tmp_path, True, max_steps=1, warmup_steps=0, label_pool="psl", max_label_pool=8)
    before = trainer.model.classifier.weight.detach().clone()
    pools = []
    trainer.model.register_forward_pre_hook(lambda module, args, kwargs: pools.append(kwargs["label_ids"].clone()), with_kwargs=True)
    trainer.train()
    moved = ((trainer.model.classifier.weight.detach().cpu() - before).abs().sum(1) > 0).nonzero().squeeze(1)
    assert sorted(moved.tolist()) == sorted(pools[0].tolist()) and len(moved) <= 8  # weight decay only on pool rows
    # (the UniDEC and PRIME training tests in tests/models/ learn through SparseAdamW: P@1 thresholds there)


def test_other_optimizers_fall_back_to_dense_gradients(tiny_encoder_dir, tiny_task, tmp_path, caplog):
    data = tiny_task[0]
    trainer = _unidec_trainer(tiny_encoder_dir, data, tmp_path, True, max_steps=2, optim="sgd")
    with caplog.at_level(logging.WARNING, logger="hf_xmc.training.trainer"):
        trainer.train()
    assert "take dense gradients" in caplog.text
    assert not trainer.model.classifier.sparse and type(trainer.optimizer.optimizer) is torch.optim.SGD
    lr_of = {id(p): g["initial_lr"] for g in trainer.optimizer.param_groups for p in g["params"]}  # the same groups
    assert lr_of[id(trainer.model.classifier.weight)] == pytest.approx(trainer.model.config.classifier_learning_rate)
    assert lr_of[id(trainer.model.de_head[0].weight)] == pytest.approx(2e-3)


def test_clip_grad_norm_takes_sparse_gradients_like_their_dense_twins():
    from hf_xmc.training.optim import clip_grad_norm_

    def grads(sparse: bool):
        torch.manual_seed(0)
        table, head = torch.nn.Embedding(10, 4, sparse=sparse), torch.nn.Linear(4, 1)
        (head(table(torch.tensor([1, 1, 2, 5]))).pow(2).sum() * 10).backward()  # row 1 twice: uncoalesced
        return [table.weight, head.weight, head.bias]

    sparse_params, dense_params = grads(True), grads(False)
    assert sparse_params[0].grad.is_sparse and not sparse_params[0].grad.is_coalesced()
    by_hand = torch.sqrt(sum(p.grad.pow(2).sum() for p in dense_params))
    norm = clip_grad_norm_(sparse_params, 1.0)
    torch.testing.assert_close(norm, by_hand)
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(dense_params, 1.0))
    assert norm > 10  # so the clipping did scale
    for s, d in zip(sparse_params, dense_params):
        got = s.grad.to_dense() if s.grad.is_sparse else s.grad
        torch.testing.assert_close(got, d.grad)
    total = torch.sqrt(sum((p.grad.to_dense() if p.grad.is_sparse else p.grad).pow(2).sum() for p in sparse_params))
    assert total == pytest.approx(1.0, rel=1e-4)
    unchanged = [p.grad.to_dense().clone() if p.grad.is_sparse else p.grad.clone() for p in sparse_params]
    clip_grad_norm_(sparse_params, float("inf"))  # measures only
    for p, before in zip(sparse_params, unchanged):
        torch.testing.assert_close(p.grad.to_dense() if p.grad.is_sparse else p.grad, before)


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_trainer_clips_sparse_gradients_without_torch_clip(tiny_encoder_dir, tiny_task, tmp_path, monkeypatch, max_grad_norm):
    # torch's clip_grad_norm_ sends a CUDA device's gradients to multi-tensor kernels that have no sparse variant, and
    # UniDEC training stopped at its first step on a GPU; emulate that refusal here: the trainer must not need it
    torch_clip = torch.nn.utils.clip_grad_norm_

    def refuses_sparse(parameters, *args, **kwargs):
        parameters = list(parameters)
        if any(p.grad is not None and p.grad.is_sparse for p in parameters):
            raise NotImplementedError("Could not run 'aten::_foreach_norm.Scalar' with arguments from the 'SparseCUDA' backend")
        return torch_clip(parameters, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", refuses_sparse)
    data = tiny_task[0]
    trainer = _unidec_trainer(tiny_encoder_dir, data, tmp_path, True, max_steps=2, label_pool="psl", max_label_pool=8, max_grad_norm=max_grad_norm)
    trainer.train()
    norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    assert len(norms) == 2 and all(np.isfinite(n) and n > 0 for n in norms)
    assert isinstance(trainer.optimizer.optimizer, SparseAdamW)
