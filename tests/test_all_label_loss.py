"""DEXML's all-label mode: the label-chunked (and label-sharded) softmax losses against their dense twins, the label
tokens cache, and XMCTrainer's all-label step against the dense reference, in one and in two processes (the
all-label collator's own test is in test_training.py)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_xmc.data import XMCDataset
from hf_xmc.models import DEXMLModel
from hf_xmc.models.all_label_loss import all_label_softmax_loss, unique_positive_ids
from hf_xmc.models.xmc_losses import decoupled_softmax_loss, softmax_loss
from hf_xmc.training import LabelTokens, XMCTrainer, XMCTrainingArguments, tokenize_labels

# positives: duplicated ids (row 0, row 4), a query without positive (row 2), labels at both ends of the label space
POSITIVE_IDS = torch.tensor(
    [[0, 22, 5, 5], [3, -1, -1, -1], [-1, -1, -1, -1], [7, 8, 9, 10], [22, -1, 22, -1], [11, 0, -1, -1], [15, 16, -1, -1]]
)
NUM_LABELS = 23


def dense_targets(positive_ids: torch.Tensor, num_labels: int) -> torch.Tensor:
    """The boolean ``(B, L)`` target matrix of ``-1``-padded id lists (the reference only)."""
    targets = torch.zeros(positive_ids.shape[0], num_labels, dtype=torch.bool)
    rows, slots = (positive_ids >= 0).nonzero(as_tuple=True)
    targets[rows, positive_ids[rows, slots]] = True
    return targets


def inputs(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(POSITIVE_IDS.shape[0], 5, generator=gen, dtype=dtype).requires_grad_()
    z = torch.randn(NUM_LABELS, 5, generator=gen, dtype=dtype).requires_grad_()
    return q, z


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("chunk_size", [1, 3, 4, 7, 22, 23, 64])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_dense_loss_and_gradients(decoupled, chunk_size, dtype):
    # chunks of 3/4/7 split the positives of rows 0, 3, 5 and 6 across chunks
    q, z = inputs(dtype)
    dense = decoupled_softmax_loss if decoupled else softmax_loss
    ref = dense(q @ z.T / 0.3, dense_targets(POSITIVE_IDS, NUM_LABELS))
    ref_q, ref_z = torch.autograd.grad(ref, [q, z])
    loss = all_label_softmax_loss(q, z, POSITIVE_IDS, 0.3, chunk_size=chunk_size, decoupled=decoupled)
    grad_q, grad_z = torch.autograd.grad(loss, [q, z])
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert loss.dtype == dtype and abs(loss.item() - ref.item()) < tol
    torch.testing.assert_close(grad_q, ref_q, atol=tol, rtol=tol)
    torch.testing.assert_close(grad_z, ref_z, atol=tol, rtol=tol)
    assert grad_z[[1, 2, 4]].abs().max() > 0  # pure negatives get gradient too


def test_label_offset_maps_global_ids_into_the_shard():
    # a process holding labels [10, 23): global ids are shifted by label_offset (positives of other shards are the
    # distributed path's business: here they are left out of the id lists)
    q, z = inputs()
    shard = z[10:].detach().requires_grad_()
    ids = torch.where(POSITIVE_IDS >= 10, POSITIVE_IDS, torch.full_like(POSITIVE_IDS, -1))
    ref = decoupled_softmax_loss(q @ shard.T / 0.5, dense_targets(torch.where(ids >= 0, ids - 10, ids), 13))
    loss = all_label_softmax_loss(q, shard, ids, 0.5, label_offset=10, chunk_size=4)
    assert abs(loss.item() - ref.item()) < 1e-12
    torch.testing.assert_close(torch.autograd.grad(loss, [shard])[0], torch.autograd.grad(ref, [shard])[0])


def test_query_with_every_label_positive_and_empty_batch():
    q, z = inputs()
    every = torch.arange(NUM_LABELS).unsqueeze(0)
    loss = all_label_softmax_loss(q[:1], z, every, 0.3, chunk_size=5)  # no negative at all: each term is 0
    assert loss.item() == 0.0 and torch.isfinite(torch.autograd.grad(loss, [q])[0]).all()
    none = all_label_softmax_loss(q, z, torch.full((7, 2), -1), 0.3, chunk_size=5)
    assert none.item() == 0.0 and none.requires_grad


def test_unique_positive_ids():
    ids = unique_positive_ids(torch.tensor([[5, -1, 5, 2], [-1, -1, -1, -1]]))
    assert sorted(x for x in ids[0].tolist() if x >= 0) == [2, 5] and (ids[1] == -1).all()


class ShapeRecorder(TorchDispatchMode):
    """Records the shape of every tensor an aten op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def test_loss_never_allocates_batch_by_labels():
    B, L, d, chunk = 16, 600, 4, 32
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, d, generator=gen).requires_grad_()
    z = torch.randn(L, d, generator=gen).requires_grad_()
    ids = torch.randint(0, L, (B, 3), generator=gen)
    with ShapeRecorder() as rec:
        loss = all_label_softmax_loss(q, z, ids, 0.1, chunk_size=chunk)
        loss.backward()
    assert (B, chunk) in rec.shapes  # the recorder sees the score blocks
    biggest_per_query = max(int(np.prod(s[1:])) for s in rec.shapes if len(s) >= 2 and s[0] == B)
    assert biggest_per_query <= chunk  # at most B x chunk scores per query row
    assert max(int(np.prod(s)) for s in rec.shapes) <= L * d  # nothing bigger than the shard's embeddings
    assert z.grad.shape == (L, d) and q.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------------- collator and trainer


def tiny_model(encoder_dir, **kwargs):
    """A tiny DEXML model with dropout off (runs that must agree see the same network)."""
    torch.manual_seed(0)
    model = DEXMLModel.from_encoder_pretrained(encoder_dir, max_seq_length=16, label_max_seq_length=16, **kwargs)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.train()


def all_label_args(output_dir, **kwargs):
    """One plain SGD step per call, no warm-up, decay or clipping: parameter changes are -lr * gradient. Float32
    (bf16=False): the steps are compared with float32 arithmetic done another way (one process, unchunked)."""
    defaults = dict(
        per_device_train_batch_size=8, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=0.0, save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
        label_pool="all", gradient_cache_chunk_size=7, dataloader_num_workers=0, bf16=False,
    )
    defaults.update(kwargs)
    return XMCTrainingArguments(output_dir=str(output_dir), **defaults)


def test_tokenize_labels_once_and_chunk_inputs(tiny_encoder_dir, tiny_task):
    data = tiny_task[0]
    tok = tiny_model(tiny_encoder_dir).tokenizer
    tokens = tokenize_labels(tok, data.label_texts, 16, start=10, stop=30, batch_size=7)
    assert tokens.input_ids.dtype == torch.int32 and tokens.input_ids.shape == (20, 16) and tokens.start == 10
    ref = tok(data.label_texts[12:17], padding=True, truncation=True, max_length=16, return_tensors="pt")
    chunk = LabelTokens.model_inputs(tokens.input_ids[2:7], tokens.lengths[2:7])
    torch.testing.assert_close(chunk["input_ids"], ref["input_ids"])  # each chunk padded to its own longest label
    torch.testing.assert_close(chunk["attention_mask"], ref["attention_mask"])


def dense_reference_grads(encoder_dir, data, rows):
    """The old all-label path: pool = every label, dense (B, L) targets, one full-graph forward."""
    model = tiny_model(encoder_dir)
    tok = model.tokenizer
    q = tok([data.train.texts[r] for r in rows], padding=True, truncation=True, max_length=16, return_tensors="pt")
    lab = tok(list(data.label_texts), padding=True, truncation=True, max_length=16, return_tensors="pt")
    targets = torch.from_numpy(data.train.targets[rows].toarray() > 0)
    out = model(q["input_ids"], q["attention_mask"], lab["input_ids"], lab["attention_mask"], targets=targets)
    out.loss.backward()
    return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_trainer_all_label_step_equals_dense_reference(tiny_encoder_dir, tiny_task, tmp_path):
    data = tiny_task[0]
    rows = list(range(12))
    ref_loss, ref_grads = dense_reference_grads(tiny_encoder_dir, data, rows)

    model = tiny_model(tiny_encoder_dir)
    trainer = XMCTrainer(model=model, args=all_label_args(tmp_path, gradient_cache_chunk_size=5), train_dataset=data.train,
                         label_texts=data.label_texts)
    batch = trainer.data_collator([{"index": r} for r in rows])
    assert "targets" not in batch and "label_input_ids" not in batch
    L = len(data.label_texts)
    with ShapeRecorder() as rec:
        loss = trainer.compute_loss(model, dict(batch))
        loss.backward()
    assert (12, 5) in rec.shapes and not any(12 in s and L in s for s in rec.shapes)  # B x chunk blocks, never B x L
    assert abs(loss.item() - ref_loss) < 1e-5
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_trainer_all_label_training_lowers_the_loss(tiny_encoder_dir, tiny_task, tmp_path, caplog):
    data = tiny_task[0]
    subset = XMCDataset(data.train.texts[:16], data.train.targets[:16], data.train.uids[:16])
    model = tiny_model(tiny_encoder_dir)
    args = all_label_args(tmp_path, per_device_train_batch_size=16, max_steps=5, learning_rate=2e-3, optim="adamw_torch",
                          gradient_cache_chunk_size=0)
    trainer = XMCTrainer(model=model, args=args, train_dataset=subset, label_texts=data.label_texts)
    with caplog.at_level("INFO", logger="hf_xmc.training.trainer"):
        trainer.train()
    assert "gradient_cache_chunk_size is 0, encoding and scoring labels in chunks of 256" in caplog.text
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == 5 and losses[-1] < losses[0] - 0.1, losses  # the same 16 queries every step


def test_all_label_mode_refuses_unsupported_models_and_losses(tiny_encoder_dir, tiny_task, tmp_path):
    from hf_xmc.models import UniDECModel

    data = tiny_task[0]
    with pytest.raises(ValueError, match="supports the losses"):
        XMCTrainer(model=tiny_model(tiny_encoder_dir, loss="soft_topk"), args=all_label_args(tmp_path), train_dataset=data.train,
                   label_texts=data.label_texts)
    unidec = UniDECModel.from_encoder_pretrained(tiny_encoder_dir, label_space_size=len(data.label_texts), projection_dim=12)
    with pytest.raises(ValueError, match="does not support label_pool='all'"):
        XMCTrainer(model=unidec, args=all_label_args(tmp_path), train_dataset=data.train, label_texts=data.label_texts)


# ------------------------------------------------------------------------------------------------- two processes


@pytest.fixture(scope="module")
def two_process_run(tiny_encoder_dir, tiny_task, tmp_path_factory):
    """tests/dist_all_label.py under torch.distributed.run (2 CPU processes, gloo): the sharded loss on fixed tensors
    and one XMCTrainer all-label step on 8 queries (4 per process); rank 0's results."""
    out = tmp_path_factory.mktemp("dist_all_label")
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_all_label.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.path.dirname(os.path.dirname(worker)))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", "29553", worker, tiny_encoder_dir, tiny_task[1], str(out)],
        capture_output=True, text=True, env=env, timeout=600, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out / "rank0.pt")


@pytest.mark.slow
def test_two_process_sharded_loss_equals_dense(two_process_run):
    run = two_process_run
    q, z = run["queries"].requires_grad_(), run["labels"].requires_grad_()
    ref = decoupled_softmax_loss(q @ z.T / 0.3, dense_targets(run["positive_ids"], z.shape[0]))
    ref_q, ref_z = torch.autograd.grad(ref, [q, z])
    assert run["losses"].tolist() == pytest.approx([ref.item()] * 2, abs=1e-12)  # every process: the global loss
    # gradients as DDP applies them (summed over processes, divided by 2): the one-process gradients
    torch.testing.assert_close(run["query_grads"] / 2, ref_q, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(run["label_grads"] / 2, ref_z, atol=1e-12, rtol=1e-10)


@pytest.mark.slow
def test_two_process_trainer_step_equals_one_process(two_process_run, tiny_encoder_dir, tiny_task, tmp_path):
    from tests.dist_all_label import eight_queries

    data = tiny_task[0]
    model = tiny_model(tiny_encoder_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = XMCTrainer(model=model, args=all_label_args(tmp_path, max_steps=1), train_dataset=eight_queries(data),
                         label_texts=data.label_texts)
    trainer.train()
    one_loss = next(row["loss"] for row in trainer.state.log_history if "loss" in row)
    assert two_process_run["trainer_loss"] == pytest.approx(one_loss, abs=1e-4)
    moved = 0.0
    for name, p in model.named_parameters():
        torch.testing.assert_close(two_process_run["params"][name], p.detach(), atol=1e-5, rtol=1e-4, msg=name)
        moved = max(moved, (p.detach() - before[name]).abs().max().item())
    assert moved > 1e-2  # the step did change the weights
