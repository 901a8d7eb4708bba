"""Two CPU processes (gloo, accelerate's debug launcher): the label pools of both processes are gathered with
gradients, and loss and gradients equal a one-process run on the same global batch."""

import os

import numpy as np
import pytest
import torch

from hf_xmc.models import DEXMLModel
from hf_xmc.training import XMCDataCollator


def _model(encoder_dir):
    torch.manual_seed(0)
    model = DEXMLModel.from_encoder_pretrained(encoder_dir, max_seq_length=16, label_max_seq_length=16)
    for module in model.modules():  # dropout off: both runs must see the same network
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.train()


def _rank_step(encoder_dir, batches_path, out_dir):
    from accelerate import PartialState

    state = PartialState(cpu=True)
    batch = torch.load(batches_path)[state.process_index]
    model = _model(encoder_dir)
    out = model(**batch)
    out.loss.backward()
    losses = [torch.zeros(()) for _ in range(state.num_processes)]
    torch.distributed.all_gather(losses, out.loss.detach())
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.distributed.all_reduce(p.grad)  # what DDP does (then divides by the world size)
            grads[name] = p.grad / state.num_processes
    if state.is_main_process:
        torch.save({"losses": torch.stack(losses), "grads": grads, "pool": out.logits.shape[1]}, os.path.join(out_dir, "rank0.pt"))
    state.wait_for_everyone()


@pytest.mark.slow
def test_two_processes_match_one_process(tiny_encoder_dir, tiny_task, tmp_path):
    from accelerate import debug_launcher

    data = tiny_task[0]
    collator = XMCDataCollator(_model(tiny_encoder_dir).tokenizer, data.train.texts, data.train.targets, data.label_texts, 16, 16, seed=5)
    rows = list(range(16))
    halves = [collator([{"index": r} for r in rows[:8]]), collator([{"index": r} for r in rows[8:]])]
    torch.save(halves, tmp_path / "batches.pt")

    debug_launcher(_rank_step, args=(tiny_encoder_dir, str(tmp_path / "batches.pt"), str(tmp_path)), num_processes=2)
    dist = torch.load(tmp_path / "rank0.pt")

    # one process, the same 16 queries against the union of both processes' pools
    pool = np.unique(np.concatenate([h["label_ids"].numpy() for h in halves]))
    tok = collator.tokenizer
    q = tok([data.train.texts[r] for r in rows], padding=True, truncation=True, max_length=16, return_tensors="pt")
    lab = tok([data.label_texts[i] for i in pool], padding=True, truncation=True, max_length=16, return_tensors="pt")
    targets = torch.from_numpy(data.train.targets[rows][:, pool].toarray() > 0)
    model = _model(tiny_encoder_dir)
    ref = model(q["input_ids"], q["attention_mask"], lab["input_ids"], lab["attention_mask"], targets=targets)
    ref.loss.backward()

    assert dist["pool"] == len(pool) < sum(len(h["label_ids"]) for h in halves)  # shared labels de-duplicated
    assert dist["losses"].mean().item() == pytest.approx(ref.loss.item(), abs=1e-5)
    for name, p in model.named_parameters():
        if p.grad is not None and p.grad.abs().sum() > 0:
            torch.testing.assert_close(dist["grads"][name], p.grad, atol=1e-5, rtol=1e-4, msg=name)
