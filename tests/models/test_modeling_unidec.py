"""UniDEC model tests: the shared XMC mixin, the two heads, the search modes, the classifier at 10^6 labels and the
training glue (learning rates, DE-space mining and clustering, the training script under 1 and 2 processes)."""

import json
import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from hf_xmc.models import UniDECConfig, UniDECModel
from hf_xmc.training import PSLDataCollator, SparseAdamW, XMCTrainer, XMCTrainingArguments, mine_hard_negatives
from tests.models.test_modeling_common import XMCModelTesterMixin

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_unidec(encoder_dir, data, **kwargs):
    model = UniDECModel.from_encoder_pretrained(
        encoder_dir, label_space_size=len(data.label_texts), projection_dim=12, max_seq_length=16, label_max_seq_length=16, **kwargs
    )
    model.set_labels(data.label_texts, data.label_uids)
    if model.needs_label_state:
        model.initialize_label_state(show_progress_bar=False)
    return model


def psl_batch(model, data, rows=range(24), **kwargs):
    collator = PSLDataCollator(model.tokenizer, data.train.texts, data.train.targets, data.label_texts, 16, 16, num_positives=2, **kwargs)
    return collator([{"index": i} for i in rows])


class TestUniDECModel(XMCModelTesterMixin):
    model_class = UniDECModel

    def make_model(self, encoder_dir, data):
        model = make_unidec(encoder_dir, data)
        with torch.no_grad():  # move classifiers and heads away from their initial values so reloads are meaningful
            model.classifier.weight.add_(0.3 * torch.randn_like(model.classifier.weight))
            model.de_head[0].bias.normal_(0, 0.1)
            model.clf_head[0].bias.normal_(0, 0.1)
        model.build_label_index()
        return model

    def test_heads_shapes_and_norms(self, model, tiny_task):
        data = tiny_task[0]
        batch = model.tokenize(data.test.texts[:5], 16)
        model.eval()
        pooled = model.pooled_embedding(batch["input_ids"], batch["attention_mask"])
        de = model.project(pooled, "de")
        clf = model.clf_head(pooled)
        assert de.shape == (5, 12) and clf.shape == (5, 12)
        torch.testing.assert_close(de.norm(dim=1), torch.ones(5))
        assert not torch.allclose(clf.norm(dim=1), torch.ones(5), atol=1e-2)  # trained un-normalised
        assert model.classifier.weight.shape == (len(data.label_texts), 12)
        assert model.label_embeddings.shape == (len(data.label_texts), 24)  # [DE ; classifier]

    def test_concat_score_is_de_cosine_plus_classifier_cosine(self, model, tiny_task):
        texts = tiny_task[0].test.texts[:6]
        pred = model.predict(texts, k=5)
        de_q, de_l = model.encode_queries(texts), model.encode_labels()
        clf_q = model.encode_texts(texts, 16, head="classifier")
        clf_l = F.normalize(model.classifier.weight.detach(), dim=-1)
        expected = de_q @ de_l.T + clf_q @ clf_l.T
        np.testing.assert_allclose(pred.scores, np.take_along_axis(expected.numpy(), pred.label_ids, 1), atol=1e-5)
        np.testing.assert_array_equal(pred.label_ids, expected.topk(5, dim=1).indices.numpy())

    def test_search_modes(self, model, tiny_task):
        texts = tiny_task[0].test.texts[:6]
        model.set_search_mode("de")
        assert model.label_embeddings is None  # switching drops the concatenated index
        de = model.predict(texts, k=5)
        brute = (model.encode_queries(texts) @ model.encode_labels().T).topk(5, dim=1)
        np.testing.assert_array_equal(de.label_ids, brute.indices.numpy())
        model.set_search_mode("classifier")
        clf = model.predict(texts, k=5)
        brute = (model.encode_texts(texts, 16, head="classifier") @ F.normalize(model.classifier.weight.detach(), dim=-1).T).topk(5, dim=1)
        np.testing.assert_array_equal(clf.label_ids, brute.indices.numpy())
        with pytest.raises(ValueError, match="search mode"):
            model.set_search_mode("both")

    def test_forward_logits_are_the_search_scores(self, model, tiny_task):
        data = tiny_task[0]
        batch = psl_batch(model, data)
        model.eval()
        out = model(**batch)
        q = model.encode_texts([data.train.texts[i] for i in range(24)], 16, head="concat")
        pool = model.label_embeddings[batch["label_ids"]]
        torch.testing.assert_close(out.logits, q @ pool.T, atol=1e-4, rtol=1e-4)


class TestDePSLModel(XMCModelTesterMixin):
    model_class = UniDECModel

    def make_model(self, encoder_dir, data):
        model = make_unidec(encoder_dir, data, use_classifier=False)
        with torch.no_grad():
            model.de_head[0].bias.normal_(0, 0.1)
        model.build_label_index()
        return model

    def test_no_classifier_and_de_search_only(self, model):
        assert model.classifier is None and model.clf_head is None and not model.needs_label_state
        assert model.search_mode == "de" and model.label_embeddings.shape[1] == 12
        with pytest.raises(ValueError, match="no classifier"):
            model.set_search_mode("concat")


def test_classifier_gradient_only_on_pool_rows(tiny_encoder_dir, tiny_task):
    data = tiny_task[0]
    model = make_unidec(tiny_encoder_dir, data)
    batch = psl_batch(model, data, max_label_pool=10)
    model.train()
    assert model.config.sparse_label_gradients and model.classifier.sparse
    torch.manual_seed(0)
    model(**batch).loss.backward()
    grad = model.classifier.weight.grad
    assert grad.is_sparse and grad.shape == model.classifier.weight.shape  # no dense L x d gradient
    grad_rows = grad.coalesce().indices()[0].tolist()
    assert sorted(grad_rows) == sorted(batch["label_ids"].tolist())  # every pool row, once, and no other row
    assert model.de_head[0].weight.grad.abs().sum() > 0 and model.clf_head[0].weight.grad.abs().sum() > 0
    # sparse_label_gradients=False (the classifier's sparse flag): the same gradient, dense
    sparse_grad, model.classifier.sparse = grad.to_dense(), False
    model.zero_grad()
    torch.manual_seed(0)  # the same dropout masks
    out = model(**batch)
    out.loss.backward()
    assert model.classifier.weight.grad.layout == torch.strided
    torch.testing.assert_close(model.classifier.weight.grad, sparse_grad)
    assert model.de_logit_scale.grad is not None and model.clf_logit_scale.grad is not None
    assert set(out.loss_terms) >= {"de_query_to_label", "de_label_to_query", "clf_query_to_label", "clf_label_to_query", "clf_bce"}


def test_label_text_classifier_init_and_its_reload(tiny_encoder_dir, tiny_task, tmp_path):
    data = tiny_task[0]
    model = UniDECModel.from_encoder_pretrained(tiny_encoder_dir, label_space_size=len(data.label_texts), projection_dim=12, classifier_init="label_text")
    model.set_labels(data.label_texts)
    assert model.needs_label_state
    model.initialize_label_state(show_progress_bar=False)
    raw = model.encode_labels(head="raw")
    expected = F.normalize(model.clf_head[0](raw), dim=-1)
    torch.testing.assert_close(model.classifier.weight.detach(), expected.detach(), atol=1e-6, rtol=1e-5)
    model.save_pretrained(tmp_path)
    reloaded = AutoModel.from_pretrained(tmp_path)
    assert not reloaded.needs_label_state  # a reloaded (or resumed) model keeps its trained classifiers
    xavier = UniDECModel.from_encoder_pretrained(tiny_encoder_dir, label_space_size=len(data.label_texts), projection_dim=12, classifier_init="xavier")
    assert not xavier.needs_label_state
    bound = (6 / (len(data.label_texts) + 12)) ** 0.5
    assert xavier.classifier.weight.abs().max() <= bound and xavier.classifier.weight.std() > bound / 4


def test_trainer_initialises_label_text_classifiers_before_the_first_step(tiny_encoder_dir, tiny_task, tmp_path):
    data = tiny_task[0]
    model = UniDECModel.from_encoder_pretrained(tiny_encoder_dir, label_space_size=len(data.label_texts), projection_dim=12, classifier_init="label_text")
    args = XMCTrainingArguments(output_dir=str(tmp_path), max_steps=1, learning_rate=1e-12, save_strategy="no", disable_tqdm=True)
    trainer = XMCTrainer(model=model, args=args, train_dataset=data.train, label_texts=data.label_texts)
    trainer.train()
    assert not model.needs_label_state
    norms = model.classifier.weight.detach().norm(dim=1)
    torch.testing.assert_close(norms, torch.ones_like(norms), atol=1e-3, rtol=0)  # unit rows from the label texts


def test_heads_start_orthogonal_and_scales_at_their_init(tiny_encoder_dir, tiny_task):
    model = UniDECModel.from_encoder_pretrained(tiny_encoder_dir, label_space_size=40, projection_dim=12, logit_scale_init=7.0)
    w = model.de_head[0].weight  # (12, 16): orthonormal rows keep the encoder's geometry in the projected space
    torch.testing.assert_close(w @ w.T, torch.eye(12), atol=1e-5, rtol=0)
    assert model.de_logit_scale.item() == 7.0 and model.clf_logit_scale.item() == 7.0


def test_set_labels_checks_the_label_space(tiny_encoder_dir, tiny_task):
    model = UniDECModel.from_encoder_pretrained(tiny_encoder_dir, label_space_size=40, projection_dim=12)
    with pytest.raises(ValueError, match="built for 40 labels"):
        model.set_labels(["a", "b"])
    with pytest.raises(ValueError, match="label_space_size"):
        UniDECConfig(encoder_config={"model_type": "bert"}, label_space_size=0).validate_xmc()
    with pytest.raises(ValueError, match="search_mode"):
        UniDECConfig(encoder_config={"model_type": "bert"}, label_space_size=3, search_mode="x").validate_xmc()


def test_optimizer_learning_rates_per_part_and_cosine_schedule(tiny_encoder_dir, tiny_task, tmp_path):
    data = tiny_task[0]
    model = make_unidec(tiny_encoder_dir, data)
    args = XMCTrainingArguments(output_dir=str(tmp_path), learning_rate=1e-4, lr_scheduler_type="cosine", max_steps=10, save_strategy="no")
    trainer = XMCTrainer(model=model, args=args, train_dataset=data.train, label_texts=data.label_texts)
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    lr_of = {id(p): g["initial_lr"] for g in trainer.optimizer.param_groups for p in g["params"]}
    decay_of = {id(p): g["weight_decay"] for g in trainer.optimizer.param_groups for p in g["params"]}
    assert lr_of[id(model.encoder.embeddings.word_embeddings.weight)] == pytest.approx(1e-4)
    assert lr_of[id(model.de_head[0].weight)] == pytest.approx(2e-4) and lr_of[id(model.clf_head[0].weight)] == pytest.approx(2e-4)
    assert lr_of[id(model.classifier.weight)] == pytest.approx(1e-3)
    assert decay_of[id(model.classifier.weight)] == 0.01 and decay_of[id(model.de_logit_scale)] == 0.0
    assert len(lr_of) == sum(1 for p in model.parameters() if p.requires_grad)  # every trainable parameter, once
    assert type(trainer.optimizer) is SparseAdamW and model.classifier.sparse  # Psi: sparse gradients, lazy AdamW
    lrs = []
    for _ in range(10):
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
    assert lrs[0] > 0 and max(lrs) == pytest.approx(max(lrs[:2]))  # warm-up of 1 step, then cosine decay
    assert lrs[-1] == pytest.approx(0.0, abs=1e-9) and all(a >= b for a, b in zip(lrs[1:], lrs[2:]))


def test_hard_negatives_are_mined_with_the_de_head(tiny_encoder_dir, tiny_task):
    data = tiny_task[0]
    model = make_unidec(tiny_encoder_dir, data)
    model.build_label_index()
    saved = model.label_embeddings
    shortlist = mine_hard_negatives(model, data.train.texts[:20], data.train.targets[:20], top_k=5, show_progress_bar=False)
    assert model.search_mode == "concat" and model.label_embeddings is saved  # mode and index restored
    scores = model.encode_queries(data.train.texts[:20]) @ model.encode_labels().T
    scores[torch.from_numpy(data.train.targets[:20].toarray() > 0)] = -10  # known positives are never negatives
    np.testing.assert_array_equal(shortlist, scores.topk(5, dim=1).indices.numpy())


def test_memory_bank_holds_de_embeddings(tiny_encoder_dir, tiny_task, tmp_path):
    data = tiny_task[0]
    model = make_unidec(tiny_encoder_dir, data)
    for module in model.modules():  # no dropout anywhere: train-mode embeddings equal eval-mode ones
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    args = XMCTrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=16, cluster_batching=True,
                                learning_rate=1e-12, save_strategy="no", disable_tqdm=True)
    trainer = XMCTrainer(model=model, args=args, train_dataset=data.train, label_texts=data.label_texts)
    trainer.train()
    filled = trainer.memory_bank.filled.nonzero().squeeze(1)
    assert len(filled) == 16
    torch.testing.assert_close(trainer.memory_bank.embeddings[filled].norm(dim=1), torch.ones(16))
    expected = model.encode_queries([data.train.texts[i] for i in filled.tolist()])
    torch.testing.assert_close(trainer.memory_bank.embeddings[filled], expected, atol=2e-3, rtol=1e-3)


@pytest.mark.slow
def test_a_million_label_model_builds_and_predicts(tiny_encoder_dir):
    # the classifier is scored on pools and searched through the index: nothing of size labels x batch is built.
    # The index searches the classifier vectors (search_mode="classifier"): encoding a million label texts is the
    # chunked encoder path of every method (bench_scale's smoke test), 40 s of tokenising here
    num_labels = 1_000_000
    model = UniDECModel.from_encoder_pretrained(tiny_encoder_dir, label_space_size=num_labels, projection_dim=16, max_seq_length=8,
                                                label_max_seq_length=8, search_mode="classifier")
    model.set_labels([f"label {i}" for i in range(num_labels)])
    ids = torch.tensor([0, 17, 523_000, num_labels - 1])
    batch = model.tokenize(["label 5", "label 999999", "something"], 8)
    label_batch = model.tokenize([f"label {i}" for i in ids.tolist()], 8)
    targets = torch.tensor([[True, False, False, False], [False, False, False, True], [False, True, False, False]])
    model.train()
    out = model(batch["input_ids"], batch["attention_mask"], label_batch["input_ids"], label_batch["attention_mask"], targets=targets, label_ids=ids)
    assert out.logits.shape == (3, 4)
    out.loss.backward()
    assert set(model.classifier.weight.grad.coalesce().indices()[0].tolist()) == set(ids.tolist())  # sparse: 4 rows
    model.classifier.weight.grad = None
    model.build_label_index(batch_size=8192, show_progress_bar=False)
    assert model.label_embeddings.shape == (num_labels, 16)
    torch.testing.assert_close(model.label_embeddings, F.normalize(model.classifier.weight.detach(), dim=-1))
    pred = model.predict(["label 5", "something"], k=10)
    assert pred.label_ids.shape == (2, 10) and (pred.label_ids >= 0).all() and (pred.label_ids < num_labels).all()
    q = model.query_search_vectors(["label 5"])
    top = (q @ model.label_embeddings.T).topk(10).indices.numpy()
    np.testing.assert_array_equal(pred.label_ids[:1], top)


def _script_args(task_dir, encoder_dir, out_dir, epochs="2"):
    from tests.test_training import contract_args

    return contract_args(task_dir, encoder_dir, out_dir, epochs=epochs) + ["--projection_dim", "16", "--learning_rate", "2e-3"]


def test_train_unidec_script_contract_and_loss_terms(tiny_task, tiny_encoder_dir, tmp_path):
    from tests.test_training import CONTRACT_KEYS, run_script

    _, task_dir = tiny_task
    out = tmp_path / "out"
    proc = run_script(_script_args(task_dir, tiny_encoder_dir, str(out), epochs="3") + ["--logging_steps", "5"], script="train_unidec.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.load(open(out / "eval_results.json"))
    assert all(0 <= results[k] <= 100 for k in CONTRACT_KEYS)
    assert results["test_P@1"] > 40
    log = proc.stdout + proc.stderr
    assert "loss_clf_bce" in log and "loss_de_query_to_label" in log and "loss_clf_query_to_label" in log
    assert "loss_de_label_to_query" not in log  # the script's default drops the symmetric terms
    reloaded = AutoModel.from_pretrained(out)
    assert isinstance(reloaded, UniDECModel) and reloaded.search_mode == "concat" and not reloaded.needs_label_state
    assert reloaded.config.classifier_init == "label_text"  # --classifier_init auto
    assert reloaded.predict(["anything"], k=3).label_ids.shape == (1, 3)


def test_script_classifier_init_auto_starts_from_the_label_texts():
    from hf_xmc.training.presets import preset_values
    from hf_xmc.training.recipes.unidec import UniDECModelArguments, resolve_classifier_init

    assert UniDECModelArguments(model_name_or_path="x").classifier_init == "auto"
    assert resolve_classifier_init("auto") == "label_text"
    assert resolve_classifier_init("xavier") == "xavier" and resolve_classifier_init("label_text") == "label_text"
    assert preset_values("unidec", "lf-amazontitles-1.3m")["classifier_init"] == "xavier"  # the papers' runs: the official init


@pytest.mark.slow
def test_train_unidec_under_accelerate_two_processes(tiny_task, tiny_encoder_dir, tmp_path):
    from tests.test_training import CONTRACT_KEYS, run_script

    _, task_dir = tiny_task
    out = tmp_path / "out"
    config = os.path.join(ROOT, "training_scripts", "accelerate", "multi_process.yaml")
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--num_processes", "2", "--main_process_port", "29547"]
    # the defaults' mining and clustering (the clustering's 10,000-label gate lifted for the 40-label task)
    proc = run_script(_script_args(task_dir, tiny_encoder_dir, str(out)) + ["--cluster_min_labels", "0"], launcher=launcher, script="train_unidec.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "Total train batch size (w. parallel, distributed & accumulation) = 64" in log  # 2 processes x 32
    assert "mined a shortlist" in log and "clustered 480 queries" in log
    results = json.load(open(out / "eval_results.json"))
    assert all(0 <= results[k] <= 100 for k in CONTRACT_KEYS)
    assert results["test_P@1"] > 20
    reloaded = AutoModel.from_pretrained(out)
    assert reloaded.predict(["anything"], k=3).label_ids.shape == (1, 3)
