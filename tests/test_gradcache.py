"""GradCache (``cached_loss``): same gradients as the plain loss with dropout on, inside and outside a Trainer."""

import contextlib
import copy

import pytest
import torch
from torch import nn

from hf_xmc.models.xmc_losses import decoupled_softmax_loss, soft_topk_loss
from hf_xmc.training import gradcache
from hf_xmc.training.gradcache import CachedLossOutput, RandContext, cached_loss

VOCAB, DIM, TAU = 50, 16, 0.1


class TinyEncoder(nn.Module):
    """Embedding -> Linear -> Dropout(0.1) -> masked mean pooling."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.drop = nn.Dropout(0.1)

    def forward(self, input_ids, attention_mask):
        h = self.drop(torch.tanh(self.proj(self.emb(input_ids))))
        m = attention_mask.unsqueeze(-1).float()
        return (h * m).sum(1) / m.sum(1).clamp_min(1)


def _group(rows, seq, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=gen)
    lengths = torch.randint(1, seq + 1, (rows,), generator=gen)
    return {"input_ids": ids, "attention_mask": (torch.arange(seq) < lengths[:, None]).long()}


QUERIES, LABELS = _group(32, 6, 1), _group(24, 5, 2)
TARGETS = torch.rand(32, 24, generator=torch.Generator().manual_seed(3)) < 0.1


def _loss_fn(q, lab):
    return decoupled_softmax_loss(q @ lab.T / TAU, TARGETS)


def _model():
    torch.manual_seed(0)
    return TinyEncoder().train()


def _split(group, size):
    rows = next(iter(group.values())).shape[0]
    return [{k: v[i : i + size] for k, v in group.items()} for i in range(0, rows, size)]


def plain_loss(embed_fn, inputs, loss_fn, chunk_size=None):
    """The uncached loss; with ``chunk_size`` the encoder sees the same chunks (hence dropout draws) as GradCache."""
    embs = [
        embed_fn(group) if chunk_size is None else torch.cat([embed_fn(c) for c in _split(group, chunk_size)])
        for group in inputs
    ]
    return loss_fn(*embs)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _run(model, fn, scale=1.0, seed=123):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = fn(lambda c: model(**c))
    (loss * scale).backward()
    return loss.detach(), _grads(model), torch.get_rng_state()


def _assert_same(g1, g2, atol=1e-5):
    assert g1.keys() == g2.keys()
    for name in g1:
        assert torch.allclose(g1[name], g2[name], atol=atol), name


def test_matches_plain_loss_with_dropout():
    model = _model()
    loss_c, g_c, rng_c = _run(model, lambda f: cached_loss(f, [QUERIES, LABELS], _loss_fn, chunk_size=5))
    loss_p, g_p, rng_p = _run(model, lambda f: plain_loss(f, [QUERIES, LABELS], _loss_fn, chunk_size=5))
    assert loss_c.item() == pytest.approx(loss_p.item(), abs=1e-6)  # (b) same loss value
    _assert_same(g_c, g_p)  # (a) same gradients, dropout active
    assert torch.equal(rng_c, rng_p)  # the replay does not advance the global RNG
    # dropout really is on (the replayed masks matter) ...
    _, g_eval, _ = _run(model.eval(), lambda f: plain_loss(f, [QUERIES, LABELS], _loss_fn, chunk_size=5))
    model.train()
    assert not torch.allclose(g_eval["proj.weight"], g_p["proj.weight"], atol=1e-4)
    # ... and without the RNG replay the gradients would be wrong
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gradcache, "RandContext", lambda *tensors: contextlib.nullcontext())
        _, g_noreplay, _ = _run(model, lambda f: cached_loss(f, [QUERIES, LABELS], _loss_fn, chunk_size=5))
    assert not torch.allclose(g_noreplay["proj.weight"], g_p["proj.weight"], atol=1e-4)


def test_eval_mode_matches_one_shot_full_batch():
    model = _model().eval()
    loss_c, g_c, _ = _run(model, lambda f: cached_loss(f, [QUERIES, LABELS], _loss_fn, chunk_size=7))
    loss_p, g_p, _ = _run(model, lambda f: plain_loss(f, [QUERIES, LABELS], _loss_fn))
    assert loss_c.item() == pytest.approx(loss_p.item(), abs=1e-6)
    _assert_same(g_c, g_p)


def test_grad_output_scaling():
    # (c) Trainer divides the loss by the accumulation steps (and AMP multiplies it) before backward
    model = _model()
    _, g_c, _ = _run(model, lambda f: cached_loss(f, [QUERIES, LABELS], _loss_fn, chunk_size=5), scale=0.5)
    _, g_p, _ = _run(model, lambda f: plain_loss(f, [QUERIES, LABELS], _loss_fn, chunk_size=5))
    _assert_same(g_c, {n: 0.5 * g for n, g in g_p.items()})


def test_chunk_larger_than_batch_is_plain_full_batch():
    # (d) one chunk per group: identical to the one-shot forward, dropout included
    model = _model()
    loss_c, g_c, _ = _run(model, lambda f: cached_loss(f, [QUERIES, LABELS], _loss_fn, chunk_size=100))
    loss_p, g_p, _ = _run(model, lambda f: plain_loss(f, [QUERIES, LABELS], _loss_fn))
    assert loss_c.item() == pytest.approx(loss_p.item(), abs=1e-6)
    _assert_same(g_c, g_p)


def test_tiny_bert_with_dropout_and_soft_topk():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
    )
    bert = BertModel(config, add_pooling_layer=False).train()

    def embed(c):
        return bert(**c).last_hidden_state[:, 0]

    def loss_fn(q, lab):  # fixed generator: the positive subsample is the same in both runs
        return soft_topk_loss(q @ lab.T, TARGETS, k=2, generator=torch.Generator().manual_seed(0))

    _, g_c, _ = _run(bert, lambda f: cached_loss(embed, [QUERIES, LABELS], loss_fn, chunk_size=6))
    _, g_p, _ = _run(bert, lambda f: plain_loss(embed, [QUERIES, LABELS], loss_fn, chunk_size=6))
    _assert_same(g_c, g_p)


def test_loss_fn_parameters_embeddings_ddp_and_no_grad():
    model = _model()
    scale = nn.Parameter(torch.tensor(2.0))

    def loss_fn(q, lab):
        return decoupled_softmax_loss(scale * (q @ lab.T), TARGETS)

    class FakeDDP:
        calls = 0

        @contextlib.contextmanager
        def no_sync(self):
            FakeDDP.calls += 1
            yield

    torch.manual_seed(1)
    out = cached_loss(lambda c: model(**c), [QUERIES, LABELS], loss_fn, 5, ddp_module=FakeDDP(), return_embeddings=True)
    assert isinstance(out, CachedLossOutput) and FakeDDP.calls == 0
    (out.loss * 0.25).backward()
    assert FakeDDP.calls == 7 + 5 - 1  # every replay but the last runs without DDP sync
    g_scale, g_model = scale.grad.clone(), _grads(model)
    model.zero_grad(set_to_none=True)
    scale.grad = None
    torch.manual_seed(1)
    embs = [torch.cat([model(**c) for c in _split(g, 5)]) for g in (QUERIES, LABELS)]
    (loss_fn(*embs) * 0.25).backward()
    assert torch.allclose(g_scale, scale.grad, atol=1e-6)  # loss_fn's own parameter, grad_output-scaled
    _assert_same(g_model, _grads(model))
    assert [e.shape for e in out.embeddings] == [(32, DIM), (24, DIM)]
    assert all(not e.requires_grad for e in out.embeddings)
    assert torch.allclose(out.embeddings[0], embs[0].detach(), atol=1e-6)
    with torch.no_grad():
        loss = cached_loss(lambda c: model(**c), [QUERIES, LABELS], _loss_fn, 5)
    assert not loss.requires_grad
    with pytest.raises(ValueError, match="first dimension"):
        cached_loss(lambda c: model(**c), [{"input_ids": QUERIES["input_ids"], "attention_mask": LABELS["attention_mask"]}], _loss_fn, 5)


def test_rand_context_replays_dropout():
    x = torch.ones(1000)
    ctx = RandContext(x)
    first = nn.functional.dropout(x, 0.5)
    after = torch.get_rng_state()
    with ctx:
        again = nn.functional.dropout(x, 0.5)
    assert torch.equal(first, again)
    assert torch.equal(torch.get_rng_state(), after)


# ---------------------------------------------------------------------------------------------- (e) inside a Trainer


class PairDataset(torch.utils.data.Dataset):
    """Query i's positive is label i (in-batch pool)."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        return {
            "input_ids": QUERIES["input_ids"][i], "attention_mask": QUERIES["attention_mask"][i],
            "label_input_ids": LABELS["input_ids"][i % 24], "label_attention_mask": LABELS["attention_mask"][i % 24],
        }


def _collate(items):
    batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
    batch["targets"] = torch.eye(len(items), dtype=torch.bool)
    return batch


def _trainer_run(tmp_path, cached):
    from transformers import Trainer, TrainingArguments

    class PoolTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            queries = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
            labels = {"input_ids": inputs["label_input_ids"], "attention_mask": inputs["label_attention_mask"]}

            def loss_fn(q, lab):
                return decoupled_softmax_loss(q @ lab.T / TAU, inputs["targets"])

            def embed(c):
                return model(**c)

            if cached:
                return cached_loss(embed, [queries, labels], loss_fn, chunk_size=3)
            return plain_loss(embed, [queries, labels], loss_fn, chunk_size=3)

    model = _model()
    before = copy.deepcopy(model.state_dict())
    args = TrainingArguments(
        output_dir=str(tmp_path / ("cached" if cached else "plain")), per_device_train_batch_size=8,
        gradient_accumulation_steps=2, max_steps=2, learning_rate=0.1, optim="sgd", lr_scheduler_type="constant",
        max_grad_norm=0.0,  # no clipping: it would hide a wrong gradient scale (e.g. a lost 1/accumulation_steps)
        use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
        remove_unused_columns=False, seed=0, dataloader_num_workers=0,
    )
    trainer = PoolTrainer(model=model, args=args, train_dataset=PairDataset(), data_collator=_collate)
    torch.manual_seed(7)
    trainer.train()
    return before, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_trainer_with_gradient_accumulation_matches_uncached(tmp_path):
    before, after_cached = _trainer_run(tmp_path, cached=True)
    _, after_plain = _trainer_run(tmp_path, cached=False)
    assert not torch.allclose(before["proj.weight"], after_cached["proj.weight"])  # it trained
    for name in before:
        assert torch.allclose(after_cached[name], after_plain[name], atol=1e-5), name


def test_replay_reenters_callers_autocast():
    # Trainer computes the loss under autocast but calls backward outside it: the replay must re-enter it
    model = _model()
    seen = []

    def embed(c):
        seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return model(**c).float()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = cached_loss(embed, [QUERIES, LABELS], _loss_fn, chunk_size=16)
    assert seen == [(False, True, torch.bfloat16)] * 4  # step 1: 2 + 2 chunks without grad
    loss.backward()
    assert seen[4:] == [(True, True, torch.bfloat16)] * 4  # replays: with grad, same autocast
    assert all(p.grad is not None for p in model.parameters())
