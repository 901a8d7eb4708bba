"""The validation split and what it unlocks: a deterministic split (the same in every process), no validation query
in anything training touches, fusion weights and the score calibration tuned on it, thresholds, evaluation during
training with the best checkpoint kept, the untrained baseline (--max_steps 0), and a calibrated model's reload
through remote code."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from hf_xmc.data import XCData, XMCDataset, carve_validation, default_validation_size, split_validation
from hf_xmc.data.splits import fingerprint, validation_record
from hf_xmc.models import DEXMLModel
from hf_xmc.models.calibration import ScoreCalibration
from hf_xmc.training.calibration import (
    expected_calibration_error,
    fit_platt,
    isotonic_breakpoints,
    ranked_pairs,
    reliability_bins,
)
from tests.models.test_modeling_common import predict_through_remote_code
from tests.test_training import ROOT, contract_args, run_script


def _dataset(n: int) -> XMCDataset:
    targets = sp.csr_matrix((np.ones(n, np.float32), (np.arange(n), np.arange(n) % 7)), shape=(n, 7))
    return XMCDataset(texts=[f"query {i}" for i in range(n)], targets=targets, uids=[f"q{i}" for i in range(n)])


def test_default_size():
    # 5%, at least 500, at most 2,000, never over a fifth of the training queries
    assert [default_validation_size(n) for n in (480, 1000, 5000, 23848, 30000, 100000)] == [96, 200, 500, 1192, 1500, 2000]


def test_split_is_deterministic_disjoint_and_complete():
    data = _dataset(300)
    train, validation = split_validation(data, 40, seed=3)
    again_train, again_validation = split_validation(data, 40, seed=3)
    assert validation.uids == again_validation.uids and train.uids == again_train.uids
    assert len(validation) == 40 and len(train) == 260
    assert set(train.uids).isdisjoint(validation.uids) and set(train.uids) | set(validation.uids) == set(data.uids)
    assert split_validation(data, 40, seed=4)[1].uids != validation.uids  # the seed draws it
    # rows keep their file order and their record numbers (what filter files refer to)
    assert validation.source_rows.tolist() == sorted(validation.source_rows.tolist())
    assert all(data.uids[r] == u for r, u in zip(validation.source_rows, validation.uids))
    full = XCData(train=data, test=_dataset(10), label_texts=[str(i) for i in range(7)], label_uids=[str(i) for i in range(7)])
    carved = carve_validation(full, 40, seed=3)
    assert carved.validation.uids == validation.uids and carved.train.uids == train.uids
    # PSP@k's propensities keep counting every training query
    assert (carved.propensity_targets() != data.targets).nnz == 0 and carved.propensity_targets().shape[0] == 300
    with pytest.raises(ValueError, match="needs more than 300 training queries"):
        split_validation(data, 300, seed=0)


def test_split_is_the_same_in_two_processes(tiny_task):
    """Two fresh interpreters (different hash seeds, as two ranks of a run) carve the same validation queries."""
    _, task_dir = tiny_task
    code = ("import sys; from hf_xmc.data import read_xc_raw; from hf_xmc.data.splits import split_validation, fingerprint; "
            "t = read_xc_raw(sys.argv[1]); print(fingerprint(split_validation(t, 96, 42)[1]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, os.path.join(task_dir, "trn.json.gz")], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=ROOT, PYTHONHASHSEED=str(seed))) for seed in (1, 2)]
    outputs = [p.communicate(timeout=300)[0].strip() for p in procs]
    data, _ = tiny_task
    assert outputs[0] == outputs[1] == fingerprint(split_validation(data.train, 96, 42)[1])


def test_isotonic_by_hand():
    # scores 1..4 with relevance 0, 1, 0, 1: pool-adjacent-violators pools (2, 3) at 0.5
    x, y = isotonic_breakpoints(np.array([3.0, 1.0, 4.0, 2.0]), np.array([0, 0, 1, 1], bool))
    np.testing.assert_allclose(x, [1, 2, 3, 4])
    np.testing.assert_allclose(y, [0, 0.5, 0.5, 1])
    calibration = ScoreCalibration("isotonic", x=x, y=y)
    np.testing.assert_allclose(calibration(np.array([0.0, 1.5, 2.5, 3.5, 9.0, -np.inf])), [0, 0.25, 0.5, 0.75, 1, 0], atol=1e-6)
    # equal scores are pooled first: (2, 2) with relevance (1, 0) is one block at 0.5
    x, y = isotonic_breakpoints(np.array([1.0, 2.0, 2.0, 3.0]), np.array([0, 1, 0, 1], bool))
    np.testing.assert_allclose(x, [1, 2, 3]) and np.testing.assert_allclose(y, [0, 0.5, 1])


def test_platt_solves_its_smoothed_log_loss():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=2000)
    relevant = rng.random(2000) < 1 / (1 + np.exp(-(3 * scores - 1)))
    a, b = fit_platt(scores, relevant)
    n_pos, n_neg = relevant.sum(), (~relevant).sum()
    t = np.where(relevant, (n_pos + 1) / (n_pos + 2), 1 / (n_neg + 2))
    p = 1 / (1 + np.exp(-(a * scores + b)))
    np.testing.assert_allclose([np.dot(p - t, scores), np.sum(p - t)], [0, 0], atol=1e-6)  # the gradient vanishes
    assert 2.5 < a < 3.5 and -1.3 < b < -0.7


def test_ece_and_reliability_by_hand():
    probs, relevant = np.array([0.05, 0.15, 0.95]), np.array([False, False, True])
    # bins 0.0-0.1, 0.1-0.2, 0.9-1.0: |0.05 - 0|, |0.15 - 0|, |0.95 - 1| weighted 1/3 each
    assert expected_calibration_error(probs, relevant) == pytest.approx(100 * (0.05 + 0.15 + 0.05) / 3)
    assert [r["bin"] for r in reliability_bins(probs, relevant)] == ["0.0-0.1", "0.1-0.2", "0.9-1.0"]
    ids = np.array([[2, 0, -1], [1, 2, 0]])
    scores, rel = ranked_pairs(ids, np.array([[3.0, 2.0, -np.inf], [5.0, 4.0, 1.0]]), sp.csr_matrix(np.array([[1, 0, 1], [0, 0, 1]])), depth=3)
    assert scores.tolist() == [3.0, 2.0, 5.0, 4.0, 1.0] and rel.tolist() == [True, True, False, True, False]


@pytest.fixture(scope="module")
def calibrated_model(tiny_encoder_dir, tiny_task):
    data, _ = tiny_task
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, max_seq_length=16)
    model.build_label_index(data.label_texts, data.label_uids)
    scores = model.predict(data.test.texts[:20], k=10).scores
    # a Platt map centred on the median top-10 score: about half of the labels above 0.5
    median = float(np.median(scores))
    model.set_score_calibration(ScoreCalibration("platt", a=20.0, b=-20.0 * median))
    return model


def test_threshold_returns_exactly_the_labels_above_it(calibrated_model, tiny_task):
    data, _ = tiny_task
    texts = data.test.texts[:20]
    full = calibrated_model.predict(texts, k=10)
    np.testing.assert_allclose(full.probabilities, calibrated_model.score_calibration(full.scores), rtol=1e-6)
    cut = calibrated_model.predict(texts, k=10, threshold=0.5)
    keep = full.probabilities >= 0.5
    assert 0 < keep.sum() < keep.size  # the threshold cuts somewhere inside the rankings
    np.testing.assert_array_equal(cut.label_ids, np.where(keep, full.label_ids, -1))
    assert [[t for t in row if t] for row in cut.label_texts] == [[t for t, k in zip(row, m) if k] for row, m in zip(full.label_texts, keep)]
    assert (cut.probabilities[keep] >= 0.5).all() and (cut.probabilities[~keep] == 0).all()
    # without k, a threshold looks at the top 100 (here every label: 40)
    assert calibrated_model.predict(texts[:1], threshold=0.0).label_ids.shape == (1, 100)
    assert (calibrated_model.predict(texts[:1], threshold=0.0).label_ids[0] >= 0).sum() == len(data.label_texts)
    # the pipeline passes it through
    from hf_xmc.models.pipeline_xmc import XMCPipeline

    rows = XMCPipeline(model=calibrated_model, task="xmc")(texts[0], top_k=10, threshold=0.5)
    assert [r["label_id"] for r in rows] == [i for i, k in zip(full.label_ids[0], keep[0]) if k]
    assert all(r["probability"] >= 0.5 for r in rows)


def test_threshold_needs_a_calibration(tiny_encoder_dir, tiny_task):
    data, _ = tiny_task
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, max_seq_length=16)
    model.build_label_index(data.label_texts, data.label_uids)
    assert model.predict(["x"], k=3).probabilities is None
    with pytest.raises(ValueError, match="no score calibration"):
        model.predict(["x"], threshold=0.5)
    with pytest.raises(ValueError, match=r"threshold is a probability in \[0, 1\]"):
        model.predict(["x"], threshold=1.5)


def test_calibrated_model_reloads_through_remote_code_with_equal_probabilities(calibrated_model, tiny_task, tmp_path):
    data, _ = tiny_task
    calibrated_model.save_pretrained(tmp_path / "m")
    assert json.load(open(tmp_path / "m" / "config.json"))["score_calibration"]["method"] == "platt"
    texts = data.test.texts[:5]
    want = calibrated_model.predict(texts, k=5, threshold=0.5)
    got = predict_through_remote_code(tmp_path / "m", tmp_path, texts, threshold=0.5)
    np.testing.assert_array_equal(np.array(got["ids"]), want.label_ids)
    np.testing.assert_allclose(np.array(got["probabilities"]), want.probabilities, rtol=1e-6)
    # a malformed calibration is refused when the model loads, naming it
    config = json.load(open(tmp_path / "m" / "config.json"))
    config["score_calibration"] = {"method": "isotonic", "x": [1, 0], "y": [0, 1]}
    json.dump(config, open(tmp_path / "m" / "config.json", "w"))
    with pytest.raises(ValueError, match="score_calibration is malformed"):
        DEXMLModel.from_pretrained(tmp_path / "m")


def test_no_validation_query_reaches_training(tiny_task, tiny_encoder_dir, tmp_path, monkeypatch):
    """Through the recipe with cluster batching, hard negatives (memory bank, shortlists) and the lexical channel: every
    query a batch, a clustering, a shortlist, the memory bank or the ranker sees is a training query, never a validation
    one; the fusion weights and the calibration are tuned on exactly the validation queries."""
    from hf_xmc.training import callbacks, lexical, samplers, trainer
    from hf_xmc.training import collator as collator_module
    from hf_xmc.training.recipes import dexml

    seen = {"batches": set(), "mined": set(), "clustered": [], "bank": [], "ranker": [], "tuned": [], "calibrated": []}
    call = collator_module.XMCDataCollator.__call__

    def record_batch(self, features):
        seen["batches"].update(self.texts[f["index"]] for f in features)
        return call(self, features)

    mine = callbacks.mine_hard_negatives

    def record_mining(model, texts, *args, **kwargs):
        seen["mined"].update(texts)
        return mine(model, texts, *args, **kwargs)

    update = samplers.ClusterBatchSampler.update_clusters

    def record_clusters(self, embeddings, *args, **kwargs):
        seen["clustered"].append(len(embeddings))
        return update(self, embeddings, *args, **kwargs)

    bank_init = samplers.EmbeddingMemoryBank.__init__

    def record_bank(self, num_samples, *args, **kwargs):
        seen["bank"].append(num_samples)
        return bank_init(self, num_samples, *args, **kwargs)

    train_omikuji = lexical.train_omikuji

    def record_ranker(features, targets, **kwargs):
        seen["ranker"].append(features.shape[0])
        return train_omikuji(features, targets, **kwargs)

    tune = lexical.tune_fusion_weights

    def record_tuning(model, channel, holdout, *args, **kwargs):
        seen["tuned"].append(list(holdout.texts))
        return tune(model, channel, holdout, *args, **kwargs)

    from hf_xmc.training import calibration

    fit = calibration.fit_score_calibration

    def record_calibration(model, evaluator, *args, **kwargs):
        seen["calibrated"].append(list(evaluator.data.texts))
        return fit(model, evaluator, *args, **kwargs)

    monkeypatch.setattr(collator_module.XMCDataCollator, "__call__", record_batch)
    monkeypatch.setattr(callbacks, "mine_hard_negatives", record_mining)
    monkeypatch.setattr(samplers.ClusterBatchSampler, "update_clusters", record_clusters)
    monkeypatch.setattr(trainer, "EmbeddingMemoryBank", type("Bank", (samplers.EmbeddingMemoryBank,), {"__init__": record_bank}))
    monkeypatch.setattr(lexical, "train_omikuji", record_ranker)
    monkeypatch.setattr(lexical, "tune_fusion_weights", record_tuning)
    monkeypatch.setattr(calibration, "fit_score_calibration", record_calibration)
    data, task_dir = tiny_task
    out = tmp_path / "run"
    dexml.main(contract_args(task_dir, tiny_encoder_dir, str(out), epochs="3") + [
        "--cluster_batching", "true", "--cluster_min_labels", "0", "--cluster_curriculum_epochs", "1", "--cluster_refresh_interval", "1",
        "--hard_negatives", "2", "--hard_negative_start_epoch", "1", "--hard_negative_refresh_interval", "1",
        "--lexical_channel", "omikuji", "--save_strategy", "no",
    ])
    model = DEXMLModel.from_pretrained(out)
    _, validation = split_validation(data.train, default_validation_size(len(data.train)), seed=1)
    held = set(validation.texts)
    assert model.config.validation["fingerprint"] == fingerprint(validation) and model.config.validation["queries"] == len(validation) == 96
    n_train = len(data.train) - len(validation)
    assert seen["batches"] and seen["batches"].isdisjoint(held) and len(seen["batches"]) == n_train
    assert seen["mined"] and seen["mined"].isdisjoint(held)
    assert seen["clustered"] and set(seen["clustered"]) == {n_train}
    assert seen["bank"] == [n_train]
    # the ranker first learns from the training queries alone; once tuned, it is trained again on all of them
    assert seen["ranker"][0] <= n_train and seen["ranker"][-1] > n_train
    assert seen["tuned"] == [list(validation.texts)] and seen["calibrated"] == [list(validation.texts)]
    assert model.config.score_calibration["method"] == "isotonic" and model.config.score_calibration["queries"] == 96
    results = json.load(open(out / "eval_results.json"))
    assert 0 <= results["test_ECE"] <= 100 and {"test_ECE_isotonic", "test_ECE_platt"} <= set(results)
    assert "validation split" in open(out / "README.md").read()


def test_eval_strategy_keeps_the_best_checkpoint(tiny_task, tiny_encoder_dir, tmp_path):
    """--eval_strategy epoch evaluates on the validation split (eval_P@1 in the log), --load_best_model_at_end saves the
    best epoch's weights: the saved encoder equals the best checkpoint's."""
    from safetensors.torch import load_file

    _, task_dir = tiny_task
    out = tmp_path / "best"
    proc = run_script(contract_args(task_dir, tiny_encoder_dir, str(out), epochs="3") + [
        "--eval_strategy", "epoch", "--save_strategy", "epoch", "--load_best_model_at_end", "true", "--save_total_limit", "3",
        "--learning_rate", "3e-3", "--hard_negatives", "0", "--cluster_batching", "false",  # random in-batch negatives: the trajectory below
    ])
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoints = sorted(p for p in os.listdir(out) if p.startswith("checkpoint-"))
    state = json.load(open(out / checkpoints[-1] / "trainer_state.json"))
    evals = [row for row in state["log_history"] if "eval_P@1" in row]
    assert len(evals) == 3 and not any(k.startswith("eval_") and "test" in k for row in evals for k in row)
    best = max(evals, key=lambda row: row["eval_P@1"])
    assert state["best_metric"] == pytest.approx(best["eval_P@1"])
    # at this learning rate the second epoch is the best one (98.96 against 97.92 for the third on this task): the saved
    # model is not simply the last state
    assert os.path.basename(state["best_model_checkpoint"]) != checkpoints[-1]
    best_weights = load_file(os.path.join(state["best_model_checkpoint"], "model.safetensors"))
    saved = load_file(out / "model.safetensors")
    encoder_keys = [k for k in saved if k.startswith("encoder.")]
    assert encoder_keys and all(torch.equal(saved[k], best_weights[k]) for k in encoder_keys)
    assert json.load(open(out / "config.json"))["validation"]["queries"] == 96
    # without a validation split the flags are refused in one line, before training
    proc = run_script(contract_args(task_dir, tiny_encoder_dir, str(tmp_path / "none")) + ["--eval_strategy", "epoch", "--validation_size", "0"])
    assert proc.returncode == 2 and "evaluate on a validation split" in proc.stderr.strip().splitlines()[-1]


def test_max_steps_0_is_the_untrained_baseline(tiny_task, tiny_encoder_dir, tmp_path):
    from safetensors.torch import load_file

    _, task_dir = tiny_task
    out = tmp_path / "zeroshot"
    proc = run_script(contract_args(task_dir, tiny_encoder_dir, str(out)) + ["--max_steps", "0", "--lexical_channel", "omikuji"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.load(open(out / "eval_results.json"))
    assert results["train_runtime"] == 0 and results["test_P@1"] >= results["test_dense_P@1"]
    start = load_file(os.path.join(tiny_encoder_dir, "model.safetensors"))
    saved = load_file(out / "model.safetensors")
    assert all(torch.equal(saved["encoder." + k], v) for k, v in start.items() if "encoder." + k in saved)
    assert sum(("encoder." + k) in saved for k in start) >= len(start) - 1  # (pooler weights aside)
    model = DEXMLModel.from_pretrained(out)
    assert model.lexical_channel is not None and model.score_calibration is not None


def test_the_final_validation_metrics_are_the_saved_models_on_the_validation_split(tiny_task, tiny_encoder_dir, tmp_path):
    """A run with a validation split reports the final model's metrics on it (eval_*: what a sweep chooses by, never
    the test split), and they are the saved model's ranking of exactly the validation queries."""
    from hf_xmc.training.evaluation import XMCEvaluator

    data, task_dir = tiny_task
    out = tmp_path / "run"
    proc = run_script(contract_args(task_dir, tiny_encoder_dir, str(out), epochs="1") + ["--validation_size", "96", "--save_strategy", "no"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.load(open(out / "eval_results.json"))
    _, validation = split_validation(data.train, 96, seed=1)
    model = DEXMLModel.from_pretrained(out)
    expected = XMCEvaluator(validation, model.label_texts, name="eval")(model)
    for key in ("eval_P@1", "eval_P@5", "eval_nDCG@5", "eval_R@10"):
        assert results[key] == pytest.approx(expected[key], abs=1e-6), key
    assert results["eval_P@1"] != results["test_P@1"] or results["eval_P@5"] != results["test_P@5"]  # two query sets


def test_a_validation_pair_whose_reverse_is_a_training_pair_is_filtered_not_scored():
    """Where queries and labels share ids (WordNet-XMC, the LF datasets), a validation pair (q, l) whose reverse (l, q)
    is a training pair moves to the validation filter, as the XC repository treats the test split's reciprocal pairs;
    every other pair stays a target, and datasets without shared ids are untouched."""
    rng = np.random.default_rng(0)
    n = 40
    uids = [f"s{i}" for i in range(n)]
    rows, cols = [], []
    for q in range(n):
        for label in rng.choice(n, size=3, replace=False):
            if label != q:
                rows.append(q)
                cols.append(int(label))
    targets = sp.csr_matrix((np.ones(len(rows), dtype=np.float32), (rows, cols)), shape=(n, n))
    train = XMCDataset(texts=[f"t{i}" for i in range(n)], targets=targets, uids=list(uids))
    data = carve_validation(XCData(train=train, test=train, label_texts=[f"l{i}" for i in range(n)], label_uids=list(uids)), 10, seed=3)
    val, kept = data.validation, data.train
    train_pairs = {(kept.uids[r], uids[c]) for r, c in zip(*kept.targets.nonzero())}
    val_pairs = {(val.uids[r], uids[c]) for r, c in zip(*val.targets.nonzero())}
    moved = {(val.uids[r], uids[c]) for r, c in zip(*val.filter_matrix.nonzero())}
    original = {(uids[r], uids[c]) for r, c in zip(rows, cols) if uids[r] in set(val.uids)}
    assert moved and val_pairs | moved == original and not val_pairs & moved
    assert all((label, q) in train_pairs for q, label in moved)
    assert not any((label, q) in train_pairs for q, label in val_pairs)
    assert val.num_reciprocal_pairs_filtered == len(moved) and validation_record(data, "training split")["reciprocal_pairs_filtered"] == len(moved)
    # labels with ids of their own (Debtags' tags, Reuters' topics): nothing moves
    other = carve_validation(XCData(train=train, test=train, label_texts=[f"l{i}" for i in range(n)], label_uids=[f"tag{i}" for i in range(n)]), 10, seed=3)
    assert other.validation.filter_matrix is None and other.validation.targets.nnz == data.validation.targets.nnz + len(moved)
    assert "reciprocal_pairs_filtered" not in validation_record(other, "training split")
