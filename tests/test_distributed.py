"""Two CPU processes (gloo, launched with torch.distributed.run): the label pools of both processes are gathered with
gradients, and loss and gradients equal a one-process run on the same global batch; DDP all-reduces the sparse
gradients of UniDEC's classifier like dense ones."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hf_xmc.models import DEXMLModel, UniDECModel
from hf_xmc.training import PSLDataCollator, XMCDataCollator


def _no_dropout(model):
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.train()


def tiny_model(encoder_dir):
    """The tiny DEXML model of both runs, dropout off (both runs must see the same network)."""
    torch.manual_seed(0)
    return _no_dropout(DEXMLModel.from_encoder_pretrained(encoder_dir, max_seq_length=16, label_max_seq_length=16))


def tiny_unidec(encoder_dir, sparse_label_gradients=True):
    """A tiny UniDEC model (40 labels), dropout off, the same weights in every process."""
    torch.manual_seed(0)
    model = UniDECModel.from_encoder_pretrained(
        encoder_dir, label_space_size=40, projection_dim=8, max_seq_length=16, label_max_seq_length=16,
        sparse_label_gradients=sparse_label_gradients,
    )
    return _no_dropout(model)


def _run_two_processes(worker_name, encoder_dir, batches, tmp_path, port):
    torch.save(batches, tmp_path / "batches.pt")
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), worker_name)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(os.path.dirname(worker)))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(port), worker, encoder_dir, str(tmp_path / "batches.pt"), str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_two_processes_match_one_process(tiny_encoder_dir, tiny_task, tmp_path):
    data = tiny_task[0]
    collator = XMCDataCollator(tiny_model(tiny_encoder_dir).tokenizer, data.train.texts, data.train.targets, data.label_texts, 16, 16, seed=5)
    rows = list(range(16))
    halves = [collator([{"index": r} for r in rows[:8]]), collator([{"index": r} for r in rows[8:]])]
    _run_two_processes("dist_step.py", tiny_encoder_dir, halves, tmp_path, 29537)
    dist = torch.load(tmp_path / "rank0.pt")

    # one process, the same 16 queries against the union of both processes' pools
    pool = np.unique(np.concatenate([h["label_ids"].numpy() for h in halves]))
    tok = collator.tokenizer
    q = tok([data.train.texts[r] for r in rows], padding=True, truncation=True, max_length=16, return_tensors="pt")
    lab = tok([data.label_texts[i] for i in pool], padding=True, truncation=True, max_length=16, return_tensors="pt")
    targets = torch.from_numpy(data.train.targets[rows][:, pool].toarray() > 0)
    model = tiny_model(tiny_encoder_dir)
    ref = model(q["input_ids"], q["attention_mask"], lab["input_ids"], lab["attention_mask"], targets=targets)
    ref.loss.backward()

    assert dist["pool"] == len(pool) < sum(len(h["label_ids"]) for h in halves)  # shared labels de-duplicated
    assert dist["losses"].mean().item() == pytest.approx(ref.loss.item(), abs=1e-5)
    for name, p in model.named_parameters():
        if p.grad is not None and p.grad.abs().sum() > 0:
            torch.testing.assert_close(dist["grads"][name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_ddp_all_reduces_sparse_classifier_gradients(tiny_encoder_dir, tiny_task, tmp_path):
    data = tiny_task[0]
    model = tiny_unidec(tiny_encoder_dir)
    collator = PSLDataCollator(model.tokenizer, data.train.texts, data.train.targets, data.label_texts, 16, 16, num_positives=2, seed=5)
    halves = [collator([{"index": r} for r in range(8)]), collator([{"index": r} for r in range(8, 16)])]
    _run_two_processes("dist_sparse_step.py", tiny_encoder_dir, halves, tmp_path, 29539)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]

    sparse, dense = ranks[0][True], ranks[0][False]
    assert sparse["layouts"]["classifier.weight"] == torch.sparse_coo and dense["layouts"]["classifier.weight"] == torch.strided
    pool = set(torch.cat([h["label_ids"] for h in halves]).tolist())  # both processes score the gathered pool
    rows = sparse["grads"]["classifier.weight"].abs().sum(1).nonzero().squeeze(1).tolist()
    assert set(rows) == pool and len(pool) < 40
    for name, grad in dense["grads"].items():  # DDP's average of the sparse gradients = that of the dense ones
        torch.testing.assert_close(sparse["grads"][name], grad, atol=1e-6, rtol=1e-5, msg=name)
    for name, weight in sparse["weights"].items():  # the replicas stay identical after the optimizer step
        assert torch.equal(ranks[1][True]["weights"][name], weight), name
        if name != "classifier.weight":
            torch.testing.assert_close(weight, dense["weights"][name], atol=1e-6, rtol=1e-5, msg=name)
    untouched = torch.tensor(sorted(set(range(40)) - pool))
    assert torch.equal(sparse["weights"]["classifier.weight"][untouched], model.classifier.weight[untouched].detach())
