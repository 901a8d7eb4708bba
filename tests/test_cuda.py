"""CUDA paths (skipped without a GPU): the gradient cache's CUDA RNG replay, torch label search on the GPU, and
bf16 training + save/reload/predict on the GPU. benchmarks/gpu_smoke.py runs the wider set of these checks."""

import contextlib

import numpy as np
import pytest
import torch

from hf_xmc.index import LabelIndex
from hf_xmc.models.xmc_losses import decoupled_softmax_loss
from hf_xmc.training import gradcache
from hf_xmc.training.gradcache import cached_loss
from tests.test_gradcache import LABELS, QUERIES, TARGETS, TAU, TinyEncoder, _split
from tests.test_mufin_training import task  # noqa: F401 - the MUFIN colour + word task (a module fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _on_cuda(group):
    return {k: v.cuda() for k, v in group.items()}


def test_cached_loss_replays_cuda_dropout():
    torch.manual_seed(0)
    model = TinyEncoder().cuda().train()
    queries, labels = _on_cuda(QUERIES), _on_cuda(LABELS)
    targets = TARGETS.cuda()

    def loss_fn(q, lab):
        return decoupled_softmax_loss(q @ lab.T / TAU, targets)

    def run(fn):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(123)
        fn().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, torch.cuda.get_rng_state()

    def plain():
        embs = [torch.cat([model(**c) for c in _split(g, 5)]) for g in (queries, labels)]
        return loss_fn(*embs)

    g_cached, rng_cached = run(lambda: cached_loss(lambda c: model(**c), [queries, labels], loss_fn, 5))
    g_plain, rng_plain = run(plain)
    for name in g_plain:
        assert torch.allclose(g_cached[name], g_plain[name], atol=1e-5), name
    assert torch.equal(rng_cached, rng_plain)  # the replay leaves the CUDA RNG where the uncached run does
    with pytest.MonkeyPatch.context() as mp:  # without the replay the CUDA dropout masks differ
        mp.setattr(gradcache, "RandContext", lambda *tensors: contextlib.nullcontext())
        g_noreplay, _ = run(lambda: cached_loss(lambda c: model(**c), [queries, labels], loss_fn, 5))
    assert not torch.allclose(g_noreplay["proj.weight"], g_plain["proj.weight"], atol=1e-4)


def test_torch_label_search_on_cuda_matches_cpu():
    rng = np.random.default_rng(0)
    labels = rng.standard_normal((5000, 32)).astype(np.float32)
    queries = rng.standard_normal((64, 32)).astype(np.float32)
    gpu = LabelIndex(labels, kind="torch", chunk_size=1024)
    s_gpu, i_gpu = gpu.search(queries, k=10)
    assert gpu.use_gpu and gpu._torch_labels.is_cuda
    s_cpu, i_cpu = LabelIndex(labels, kind="torch", use_gpu=False, chunk_size=1024).search(queries, k=10)
    np.testing.assert_array_equal(i_gpu, i_cpu)
    np.testing.assert_allclose(s_gpu, s_cpu, atol=1e-4)


def test_bf16_training_with_gradient_cache_saves_and_reloads_on_cuda(tiny_encoder_dir, tiny_task, tmp_path):
    from transformers import AutoModel

    from hf_xmc.models import DEXMLModel
    from hf_xmc.training import XMCEvaluator, XMCTrainer, XMCTrainingArguments

    data = tiny_task[0]
    torch.manual_seed(0)
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, max_seq_length=16, label_max_seq_length=16)
    evaluator = XMCEvaluator(data.test, data.label_texts, train_targets=data.train.targets, recall_ks=(10,))
    args = XMCTrainingArguments(output_dir=str(tmp_path), max_steps=30, per_device_train_batch_size=32, learning_rate=5e-4,
                                bf16=True, gradient_cache_chunk_size=8, save_strategy="no", seed=0, disable_tqdm=True, report_to=[])
    trainer = XMCTrainer(model=model, args=args, train_dataset=data.train, label_texts=data.label_texts, evaluator=evaluator)
    trainer.train()
    assert next(model.parameters()).is_cuda
    assert trainer.evaluate()["eval_P@1"] > 70
    texts = list(data.test.texts[:32])
    pred = model.predict(texts, k=5)
    trainer.save_model(str(tmp_path / "final"))
    reloaded = AutoModel.from_pretrained(str(tmp_path / "final"), trust_remote_code=True).cuda()
    again = reloaded.predict(texts, k=5)
    np.testing.assert_array_equal(pred.label_ids, again.label_ids)
    np.testing.assert_allclose(pred.scores, again.scores, atol=1e-5)


def test_mufin_bf16_modules_on_cuda_with_images_save_and_reload(task, tmp_path):  # noqa: F811 - the imported fixture
    """MUFIN's Modules I, II and IV in bf16 on the GPU (ViT + text bags), image + text prediction on CUDA, and the same
    ranking after a remote-code reload."""
    from transformers import AutoModel

    from hf_xmc.training import XMCTrainer
    from hf_xmc.training.recipes.mufin import MUFINTrainingArguments, _stage_args, pretrain_and_mine
    from tests.test_mufin_training import tiny_model

    data, *_ = task
    model = tiny_model(task)
    model.freeze_vision_layers(-1)
    args = MUFINTrainingArguments(
        output_dir=str(tmp_path / "out"), siamese_epochs=2, num_train_epochs=2, per_device_train_batch_size=16, bf16=True,
        learning_rate=2e-3, ranker_learning_rate=2e-3, ranker_negatives=3, hard_negative_top_k=6, save_strategy="no",
        report_to=[], disable_tqdm=True, seed=0,
    )
    collator = pretrain_and_mine(model, data, args)
    trainer = XMCTrainer(model=model, args=_stage_args(args, "ranker"), train_dataset=data.train, data_collator=collator)
    assert trainer.train().training_loss > 0
    assert next(model.vision_encoder.parameters()).is_cuda
    model.build_label_index(data.label_texts, data.label_uids, label_images=data.label_images)
    texts, images = list(data.test.texts[:16]), list(data.test.images[:16])
    pred = model.predict(texts, images=images, k=3)
    hits = [len(set(row) & set(data.test.targets[i].indices)) > 0 for i, row in enumerate(pred.label_ids)]
    assert sum(hits) > 16 * 3 / 12  # above chance
    model.save_pretrained(str(tmp_path / "final"))
    reloaded = AutoModel.from_pretrained(str(tmp_path / "final"), trust_remote_code=True).cuda()
    again = reloaded.predict(texts, images=images, k=3)
    np.testing.assert_array_equal(pred.label_ids, again.label_ids)
    np.testing.assert_allclose(pred.scores, again.scores, atol=1e-4)
