"""PRIME model tests: the shared XMC mixin plus the prototype network, free vectors, centroids and training glue."""

import json
import math
import os
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModel

from hf_xmc.models import PRIMEConfig, PRIMEModel
from hf_xmc.training import (
    XMCDataCollator,
    XMCTrainer,
    XMCTrainingArguments,
    free_vector_assignment,
    initialize_label_state,
    label_centroids,
)
from tests.models.test_modeling_common import XMCModelTesterMixin

TINY_BERT = {"model_type": "bert", "hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 32, "vocab_size": 50}


def make_prime(encoder_dir, data, **kwargs):
    model = PRIMEModel.from_encoder_pretrained(
        encoder_dir, label_space_size=len(data.label_texts), max_seq_length=16, label_max_seq_length=16, lpn_intermediate_size=64, **kwargs
    )
    model.set_labels(data.label_texts, data.label_uids)
    initialize_label_state(model, data.train.texts, data.train.targets, show_progress_bar=False)
    return model


class TestPRIMEModel(XMCModelTesterMixin):
    model_class = PRIMEModel

    def make_model(self, encoder_dir, data):
        model = make_prime(encoder_dir, data)
        with torch.no_grad():  # move centroids and LPN away from their initial values so reloads are meaningful
            model.label_centroids.add_(0.1 * torch.randn_like(model.label_centroids))
            model.lpn.layer.linear2.bias.normal_()
        model.build_label_index()
        return model

    def test_label_state_round_trips(self, model, tmp_path):
        model.save_pretrained(tmp_path)
        reloaded = AutoModel.from_pretrained(tmp_path)
        assert not reloaded.needs_label_state
        torch.testing.assert_close(reloaded.label_centroids, model.label_centroids)
        torch.testing.assert_close(reloaded.free_vector_map, model.free_vector_map)
        torch.testing.assert_close(reloaded.free_vectors.weight, model.free_vectors.weight)
        # the reloaded weights rebuild the saved prototypes exactly
        torch.testing.assert_close(reloaded.label_search_vectors(), model.label_embeddings, atol=1e-5, rtol=1e-4)

    def test_prototypes_are_unit_norm_and_differ_from_label_texts(self, model):
        protos = model.label_embeddings
        assert protos.shape == (model.config.label_space_size, model.config.encoder_config.hidden_size)
        torch.testing.assert_close(protos.norm(dim=1), torch.ones(len(protos)))
        assert not torch.allclose(protos, model.encode_labels(), atol=1e-3)

    def test_set_labels_checks_the_label_space(self, model):
        with pytest.raises(ValueError, match="built for 40 labels"):
            model.set_labels(["a", "b"])


def test_lpn_is_permutation_invariant(tiny_encoder_dir, tiny_task):
    model = make_prime(tiny_encoder_dir, tiny_task[0])
    model.eval()
    h, v, c = torch.randn(3, 5, model.config.encoder_config.hidden_size).unbind(0)
    torch.testing.assert_close(model.lpn(h, v, c), model.lpn(c, h, v), atol=1e-6, rtol=1e-5)
    assert model.lpn(h, v, c).shape == (5, model.config.encoder_config.hidden_size)


def test_label_state_initialisation(tiny_encoder_dir, tiny_task):
    data = tiny_task[0]
    model = make_prime(tiny_encoder_dir, data)
    assert model.config.num_free_vectors == 16  # 40 labels -> 2^floor(log2 20)
    counts = np.bincount(model.free_vector_map.numpy(), minlength=16)
    assert counts.min() >= 2 and counts.max() <= 3  # balanced clusters over all 16 vectors
    # centroid = normalised mean of the normalised initial embeddings of the label's training queries
    queries = torch.nn.functional.normalize(model.encode_queries(data.train.texts), dim=-1)
    rows = data.train.targets[:, 3].nonzero()[0]
    expected = torch.nn.functional.normalize(queries[rows].mean(0), dim=0)
    torch.testing.assert_close(model.label_centroids[3], expected, atol=1e-5, rtol=1e-4)


def test_label_centroids_zero_for_unseen_labels():
    import scipy.sparse as sp

    targets = sp.csr_matrix(np.array([[1, 0, 0], [1, 1, 0]]))
    cents = label_centroids(torch.tensor([[3.0, 0.0], [0.0, 2.0]]), targets)
    torch.testing.assert_close(cents, torch.tensor([[math.sqrt(0.5), math.sqrt(0.5)], [0.0, 1.0], [0.0, 0.0]]))


def test_free_vector_assignment_is_balanced_and_checks_the_power_of_two():
    labels = torch.randn(64, 8)
    assignment = free_vector_assignment(labels, 8)
    assert np.bincount(assignment.numpy()).tolist() == [8] * 8
    with pytest.raises(ValueError, match="power of two"):
        free_vector_assignment(labels, 6)
    with pytest.raises(ValueError, match="power of two"):
        PRIMEModel(PRIMEConfig(encoder_config=TINY_BERT, label_space_size=10, num_free_vectors=6))


def test_shared_free_vector_gradients_accumulate(tiny_encoder_dir, tiny_task):
    data = tiny_task[0]
    model = make_prime(tiny_encoder_dir, data)
    model.config.centroid_update = "frozen"
    collator = XMCDataCollator(model.tokenizer, data.train.texts, data.train.targets, data.label_texts, 16, 16)
    batch = collator([{"index": i} for i in range(24)])
    model.train()
    centroids_before = model.label_centroids.clone()
    model(**batch).loss.backward()
    pool_vectors = set(model.free_vector_map[batch["label_ids"]].tolist())
    grad = model.free_vectors.weight.grad
    assert grad.is_sparse and grad.shape == model.free_vectors.weight.shape  # sparse_label_gradients: no dense F x d
    grad_rows = grad.coalesce().indices()[0].tolist()
    assert sorted(grad_rows) == sorted(pool_vectors)  # the pool's clusters, once each; absent clusters get nothing
    assert model.lpn.layer.linear1.weight.grad.abs().sum() > 0
    assert model.encoder.embeddings.word_embeddings.weight.grad.abs().sum() > 0
    assert not model.label_centroids.requires_grad
    torch.testing.assert_close(model.label_centroids, centroids_before)  # frozen mode
    # two labels that share a free vector read the same row
    a, b = [i for i in range(40) if model.free_vector_map[i] == model.free_vector_map[0]][:2]
    ids = torch.tensor([a, b])
    torch.testing.assert_close(model.free_vectors(model.free_vector_map[ids])[0], model.free_vectors(model.free_vector_map[ids])[1])


def test_checkpoint_with_the_former_free_vectors_key_loads(tiny_encoder_dir, tiny_task, tmp_path):
    # before the bank became an ExtremeClassifier (sparse gradients, DDP-aware) it was saved as `free_vectors`
    from safetensors.torch import load_file, save_file

    model = make_prime(tiny_encoder_dir, tiny_task[0])
    model.save_pretrained(tmp_path / "old")
    weights = load_file(tmp_path / "old" / "model.safetensors")
    weights["free_vectors"] = weights.pop("free_vectors.weight")
    save_file(weights, tmp_path / "old" / "model.safetensors", metadata={"format": "pt"})
    reloaded = PRIMEModel.from_pretrained(tmp_path / "old")
    torch.testing.assert_close(reloaded.free_vectors.weight, model.free_vectors.weight)
    reloaded.save_pretrained(tmp_path / "new")  # saved again under the current key
    assert "free_vectors.weight" in load_file(tmp_path / "new" / "model.safetensors")
    torch.testing.assert_close(PRIMEModel.from_pretrained(tmp_path / "new").free_vectors.weight, model.free_vectors.weight)


def test_centroid_ema_matches_the_closed_form():
    model = PRIMEModel(PRIMEConfig(encoder_config=TINY_BERT, label_space_size=3, num_free_vectors=2))
    c0 = torch.nn.functional.normalize(torch.randn(16), dim=0)
    model.set_label_state(torch.tensor([0, 1, 1]), torch.stack([c0, c0, c0]))
    h = torch.randn(16)
    targets = torch.tensor([[True, False]])  # one query, positive of pool label 0 (label id 2), not of label id 1
    for _ in range(7):
        model.update_centroids(h[None] * 5.0, torch.tensor([2, 1]), targets)  # the query is normalised first
    hn = torch.nn.functional.normalize(h, dim=0)
    torch.testing.assert_close(model.label_centroids[2], 0.95**7 * c0 + (1 - 0.95**7) * hn)
    torch.testing.assert_close(model.label_centroids[1], c0)  # in the pool but no query owns it
    # two queries with the same label: their mean is the update
    model.update_centroids(torch.stack([h, -h * 0 + 1.0]), torch.tensor([0]), torch.tensor([[True], [True]]))
    mean = (hn + torch.nn.functional.normalize(torch.ones(16), dim=0)) / 2
    torch.testing.assert_close(model.label_centroids[0], 0.95 * c0 + 0.05 * mean)


def test_training_moves_centroids_and_learns(tiny_encoder_dir, tiny_task, tmp_path):
    from hf_xmc.training import XMCEvaluator

    data = tiny_task[0]
    torch.manual_seed(0)
    model = PRIMEModel.from_encoder_pretrained(
        tiny_encoder_dir, label_space_size=len(data.label_texts), max_seq_length=16, label_max_seq_length=16, lpn_intermediate_size=64
    )
    assert model.needs_label_state
    evaluator = XMCEvaluator(data.test, data.label_texts, train_targets=data.train.targets, recall_ks=(10,))
    args = XMCTrainingArguments(
        output_dir=str(tmp_path), num_train_epochs=4, per_device_train_batch_size=32, learning_rate=2e-3, save_strategy="no",
        seed=0, disable_tqdm=True, positive_sampling="propensity", num_positives=2, weight_decay=0.01,
    )
    trainer = XMCTrainer(model=model, args=args, train_dataset=data.train, label_texts=data.label_texts, evaluator=evaluator)
    before = evaluator(model)  # before train(): the trainer initialises the label state when training starts
    trainer.train()
    assert not model.needs_label_state
    initial = PRIMEModel.from_encoder_pretrained(tiny_encoder_dir, label_space_size=40, max_seq_length=16, label_max_seq_length=16)
    initial.set_labels(data.label_texts)
    initialize_label_state(initial, data.train.texts, data.train.targets, show_progress_bar=False)
    moved = (model.label_centroids.cpu() - initial.label_centroids).norm(dim=1)  # the Trainer moved model to the GPU, if any
    assert bool((moved > 1e-3).all())  # every label was a positive in some batch: the EMA moved all centroids
    after = trainer.evaluate()
    assert after["eval_P@1"] > before["test_P@1"] + 20, (before, after)
    # the free-vector bank is trained without weight decay, the LPN weights with it
    groups = trainer.optimizer.param_groups
    bank_group = [g for g in groups if any(p is model.free_vectors.weight for p in g["params"])][0]
    lpn_group = [g for g in groups if any(p is model.lpn.layer.linear1.weight for p in g["params"])][0]
    assert bank_group["weight_decay"] == 0.0 and lpn_group["weight_decay"] == 0.01
    # prototypes beat label texts on the training objective's own ranking (R at work): P@1 by prototype >= by text
    texts = data.test.texts
    queries = model.query_search_vectors(texts)
    truth = data.test.targets
    top_proto = (queries @ model.label_search_vectors().T).argmax(1).numpy()
    top_text = (queries @ model.encode_labels().T).argmax(1).numpy()
    p1_proto = np.mean([truth[i, j] > 0 for i, j in enumerate(top_proto)])
    p1_text = np.mean([truth[i, j] > 0 for i, j in enumerate(top_text)])
    assert p1_proto >= p1_text - 0.02, (p1_proto, p1_text)


def test_auxiliary_terms_off_leaves_the_prototype_term(tiny_encoder_dir, tiny_task):
    data = tiny_task[0]
    model = make_prime(tiny_encoder_dir, data, query_to_label_weight=0.0, label_to_query_weight=0.0, regularizer_weight=0.0)
    collator = XMCDataCollator(model.tokenizer, data.train.texts, data.train.targets, data.label_texts, 16, 16)
    model.train()
    out = model(**collator([{"index": i} for i in range(16)]))
    assert set(out.loss_terms) == {"query_to_prototype"}  # the terms leave the model in its output
    assert out.loss.item() == pytest.approx(out.loss_terms["query_to_prototype"].item())


def test_train_prime_script_contract(tiny_task, tiny_encoder_dir, tmp_path):
    from tests.test_training import CONTRACT_KEYS, contract_args, run_script

    _, task_dir = tiny_task
    out = tmp_path / "out"
    proc = run_script(contract_args(task_dir, tiny_encoder_dir, str(out), epochs="3") + ["--learning_rate", "2e-3"], script="train_prime.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "clustered 480 queries" in proc.stdout + proc.stderr  # cluster batching from the second epoch
    results = json.load(open(out / "eval_results.json"))
    assert all(math.isfinite(results[k]) and 0 <= results[k] <= 100 for k in CONTRACT_KEYS)
    assert results["test_P@1"] > 20
    config = json.load(open(out / "config.json"))
    assert config["model_type"] == "hf_xmc_prime" and config["label_space_size"] == 40
    assert os.path.exists(out / "modeling_prime.py") and os.path.exists(out / "label_embeddings.safetensors")
    reloaded = AutoModel.from_pretrained(out)
    assert not reloaded.needs_label_state


def test_gradient_cache_gives_the_plain_gradients(tiny_encoder_dir, tiny_task):
    # the LPN and free vectors sit in the loss: the cache must backpropagate into them as well as into the encoder
    from hf_xmc.training import cached_loss

    data = tiny_task[0]
    model = make_prime(tiny_encoder_dir, data)
    collator = XMCDataCollator(model.tokenizer, data.train.texts, data.train.targets, data.label_texts, 16, 16, num_positives=2)
    batch = collator([{"index": i} for i in range(20)])
    model.eval()  # no dropout, no centroid update: both runs see the same randomness (positive sampling re-seeded)
    torch.manual_seed(3)
    model(**batch).loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    extra = {k: batch[k] for k in ("targets", "label_ids", "query_positive_ids")}
    groups = [{"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]},
              {"input_ids": batch["label_input_ids"], "attention_mask": batch["label_attention_mask"]}]
    torch.manual_seed(3)
    loss = cached_loss(lambda chunk: model(**chunk).query_embeds, groups, lambda q, lab: model.pool_loss(q, lab, **extra)[0], chunk_size=6)
    loss.backward()
    cached = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(cached) == set(plain) and "free_vectors.weight" in cached and "lpn.layer.linear1.weight" in cached
    assert cached["free_vectors.weight"].is_sparse  # the replayed loss also gathers the bank with sparse gradients
    for name in plain:
        torch.testing.assert_close(cached[name].to_dense(), plain[name].to_dense(), atol=1e-5, rtol=1e-4, msg=name)


def test_distributed_gradient_cache_is_refused(tiny_encoder_dir, tiny_task, tmp_path, monkeypatch):
    data = tiny_task[0]
    model = make_prime(tiny_encoder_dir, data)
    args = XMCTrainingArguments(output_dir=str(tmp_path), gradient_cache_chunk_size=8)
    monkeypatch.setattr(type(args), "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match="gradient cache cannot synchronise"):
        XMCTrainer(model=model, args=args, train_dataset=data.train, label_texts=data.label_texts)


@pytest.mark.slow
def test_train_prime_under_accelerate_two_processes(tiny_task, tiny_encoder_dir, tmp_path):
    from tests.test_training import CONTRACT_KEYS, contract_args, run_script

    _, task_dir = tiny_task
    out = tmp_path / "out"
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29533"]
    proc = run_script(contract_args(task_dir, tiny_encoder_dir, str(out), epochs="2") + ["--learning_rate", "2e-3"], launcher=launcher, script="train_prime.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "Total train batch size (w. parallel, distributed & accumulation) = 64" in log  # 2 processes x 32
    assert "clustered 480 queries" in log
    results = json.load(open(out / "eval_results.json"))
    assert all(0 <= results[k] <= 100 for k in CONTRACT_KEYS)
    assert results["test_P@1"] > 20
    reloaded = AutoModel.from_pretrained(out)
    assert not reloaded.needs_label_state and reloaded.predict(["anything"], k=3).label_ids.shape == (1, 3)


def test_train_prime_is_reproducible_with_a_seed(tiny_task, tiny_encoder_dir, tmp_path):
    # the prototype network and free vectors start random: the script must seed before it builds the model. Both runs
    # share this process (and its advanced RNG state), so an unseeded draw would differ between them.
    from hf_xmc.training.recipes.prime import main
    from tests.test_training import contract_args

    _, task_dir = tiny_task
    results = []
    for name in ("a", "b"):
        main(contract_args(task_dir, tiny_encoder_dir, str(tmp_path / name), epochs="1") + ["--save_strategy", "no", "--report_to", "none"])
        results.append(json.load(open(tmp_path / name / "eval_results.json")))
    assert results[0]["train_loss"] == results[1]["train_loss"]
    assert results[0]["test_P@1"] == results[1]["test_P@1"] and results[0]["test_PSP@5"] == results[1]["test_PSP@5"]


def test_trainer_logs_each_loss_term(tiny_encoder_dir, tiny_task, tmp_path):
    data = tiny_task[0]
    model = make_prime(tiny_encoder_dir, data)
    args = XMCTrainingArguments(output_dir=str(tmp_path), max_steps=4, logging_steps=2, per_device_train_batch_size=16,
                                save_strategy="no", disable_tqdm=True)
    trainer = XMCTrainer(model=model, args=args, train_dataset=data.train, label_texts=data.label_texts)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    for entry in logs:
        terms = [entry[f"loss_{t}"] for t in ("query_to_prototype", "query_to_label", "label_to_query", "regularizer")]
        assert all(t >= 0 for t in terms)
        # the logged loss is the weighted sum of the logged terms (averaged over the same steps)
        assert entry["loss"] == pytest.approx(terms[0] + terms[1] + terms[2] + 0.1 * terms[3], abs=2e-3)


class TestPRIMEWModel(XMCModelTesterMixin):
    """PRIME (W): the one-vs-all classifier stage on top of PRIME (spec Sec. 6.6)."""

    model_class = PRIMEModel

    def make_model(self, encoder_dir, data):
        model = make_prime(encoder_dir, data)
        model.add_classifier(show_progress_bar=False)
        with torch.no_grad():  # classifiers away from the prototypes so reloads are meaningful
            model.classifier.weight.add_(0.2 * torch.randn_like(model.classifier.weight))
        model.build_label_index()
        return model

    def test_classifiers_start_at_the_prototypes(self, tiny_encoder_dir, tiny_task):
        data = tiny_task[0]
        model = make_prime(tiny_encoder_dir, data)
        texts = data.test.texts[:6]
        before = model.predict(texts, k=5)
        prototypes = model.label_search_vectors()
        model.add_classifier(show_progress_bar=False)
        assert model.search_mode == "classifier" and model.config.use_classifier
        torch.testing.assert_close(model.classifier.weight, prototypes)
        after = model.predict(texts, k=5)  # the classifier index holds the same vectors: the same ranking
        np.testing.assert_array_equal(before.label_ids, after.label_ids)
        np.testing.assert_allclose(before.scores, after.scores, atol=1e-5)
        model.set_search_mode("prototype")
        np.testing.assert_array_equal(model.predict(texts, k=5).label_ids, before.label_ids)
        with pytest.raises(ValueError, match="search mode"):
            model.set_search_mode("both")
        with pytest.raises(ValueError, match="use_classifier"):
            PRIMEConfig(label_space_size=3, search_mode="classifier").validate_xmc()

    def test_classifier_loss_by_hand_and_sparse_rows(self, model):
        """Fixed-margin triplet (0.2) over cos(h_q, w_l), softmax(s_n / 0.1) weights over the violating negatives."""
        hidden = model.config.encoder_config.hidden_size
        model.eval()  # no query dropout: the scores are plain cosines
        query = torch.randn(1, hidden)
        ids = torch.tensor([[4, 7, 9, -1]])
        targets = torch.tensor([[True, False, False, False]])
        out = model(query_vectors=query, candidate_ids=ids, candidate_targets=targets)
        w = torch.nn.functional.normalize(model.classifier.weight.detach()[[4, 7, 9]], dim=-1)
        s = (w @ torch.nn.functional.normalize(query[0], dim=0)).tolist()
        hinge = [max(0.0, 0.2 - (s[0] - sn)) for sn in s[1:]]
        weights = [math.exp(sn / 0.1) if h > 0 else math.exp(-100 / 0.1) for sn, h in zip(s[1:], hinge)]
        expected = sum(h * wt for h, wt in zip(hinge, weights)) / sum(weights)
        assert float(out.loss.detach()) == pytest.approx(expected, rel=1e-4, abs=1e-6)
        assert out.logits[0, 3] == -2.0  # the padded slot
        model.train()
        for name, param in model.named_parameters():
            param.requires_grad_(name.startswith("classifier."))
        model(query_vectors=query, candidate_ids=torch.tensor([[4, 7, 9, 11]]), candidate_targets=targets).loss.backward()
        grad = model.classifier.weight.grad
        assert grad.is_sparse and set(grad.coalesce().indices()[0].tolist()) <= {4, 7, 9, 11}
        assert all(p.grad is None for n, p in model.named_parameters() if not n.startswith("classifier."))


def test_prime_classifier_stage_through_the_script(tiny_encoder_dir, tiny_task, tmp_path):
    from hf_xmc.training.recipes.prime import main

    _, directory = tiny_task
    out = tmp_path / "out"
    main([
        "--train_file", f"{directory}/trn.json.gz", "--test_file", f"{directory}/tst.json.gz", "--label_file", f"{directory}/lbl.json.gz",
        "--model_name_or_path", tiny_encoder_dir, "--output_dir", str(out), "--num_train_epochs", "1", "--per_device_train_batch_size", "32",
        "--max_seq_length", "16", "--classifier_stage", "true", "--classifier_epochs", "2", "--save_strategy", "no", "--disable_tqdm", "true",
    ])
    model = AutoModel.from_pretrained(out)
    assert model.search_mode == "classifier" and model.classifier is not None
    stored = model.label_embeddings.clone()
    torch.testing.assert_close(stored, model.classifier.normalized_weights())  # the saved index searches the classifiers
    model.set_search_mode("prototype")
    assert not torch.allclose(model.label_search_vectors(), stored)  # trained away from the prototypes
    assert json.load(open(out / "eval_results.json"))["test_P@1"] >= 0
