"""Derived parts know what they were derived from (issue 64): the score calibration is tied to the ranking it was
fitted on, the lexical channel to the label set, the calibration is fitted as deep as it is used, fusion weights are
tuned beside the dense weight fuse serves, predict refuses a k or threshold that is no number it can use, a run that
fails after training keeps the trained model, and a resumed run with another validation split is refused."""

import json
import logging
import os

import numpy as np
import pytest
import torch

from hf_xmc.models import DEXMLModel, UniDECModel
from hf_xmc.models import lexical_channel as lexical_channel_module
from hf_xmc.models.calibration import ScoreCalibration
from hf_xmc.models.modeling_xmc import THRESHOLD_DEPTH
from hf_xmc.models.provenance import DERIVED_PARTS, StaleDerivedPartError, changed_inputs, check_derived
from hf_xmc.training.calibration import CALIBRATION_DEPTH, fit_score_calibration
from hf_xmc.training.lexical import fit_lexical_channel, tune_fusion_weights
from tests.test_training import contract_args, run_script

pytest.importorskip("omikuji")


def test_check_derived_applies_each_policy_in_one_line(caplog):
    recorded = {"weights": [1.0, 2.0], "labels": "abc"}
    assert check_derived("score_calibration", recorded, {"weights": [1.0, 2.0 + 1e-14], "labels": "abc"})  # rounding only
    assert check_derived("score_calibration", None, {"labels": "x"})  # a part saved before fingerprints: trusted
    assert changed_inputs(recorded, {"weights": [1.0, 2.001], "labels": "abd", "new": 1}) == ["weights", "labels"]
    with caplog.at_level(logging.WARNING):
        assert not check_derived("score_calibration", recorded, {"labels": "abd"}, "M", "fit it again")
    assert caplog.records[-1].getMessage() == "M: the score calibration was made from other labels than the model's now: dropped; fit it again"
    with pytest.raises(StaleDerivedPartError, match=r"^f.onnx: the onnx export was made from other weights than the model's now: refused; x$"):
        check_derived("onnx_export", recorded, {"weights": [1.5, 2.0]}, "f.onnx", "x")
    assert not check_derived("label_index", recorded, {"labels": "zz"})  # rebuild: the caller makes it again
    assert {p.policy for p in DERIVED_PARTS.values()} == {"rebuild", "drop", "refuse"}


@pytest.fixture()
def fused_model(tiny_encoder_dir, tiny_task):
    """A DEXML model with a lexical channel (Omikuji ranker, tuned weights) and a Platt calibration on its ranking."""
    data, _ = tiny_task
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, max_seq_length=16)
    model.set_labels(data.label_texts, data.label_uids)
    fit_lexical_channel(model, data.train, ranker_weight=1.0, text_weight=0.5, n_threads=1)
    scores = model.predict(data.test.texts[:20], k=10).scores
    model.set_score_calibration(ScoreCalibration("platt", a=20.0, b=-20.0 * float(np.median(scores))))
    return model


def _assert_dropped(model, texts, caplog, why):
    with caplog.at_level(logging.WARNING):
        assert model.score_calibration is None
    assert any(f"score calibration was made from other {why}" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert model.config.score_calibration is None and model.predict(texts, k=3).probabilities is None
    with pytest.raises(ValueError, match="no score calibration"):  # never an answer from the map of another ranking
        model.predict(texts, threshold=0.5)


def test_calibration_survives_a_save_but_not_a_channel_removed(fused_model, tiny_task, tmp_path, caplog):
    texts = tiny_task[0].test.texts[:8]
    want = fused_model.predict(texts, k=5, threshold=0.5)
    fused_model.save_pretrained(tmp_path / "m")
    recorded = json.load(open(tmp_path / "m" / "config.json"))["score_calibration"]["fingerprint"]
    assert set(recorded) == {"weights", "labels", "search_mode", "channel", "query_encoder"} and recorded["channel"]
    reloaded = DEXMLModel.from_pretrained(tmp_path / "m")
    got = reloaded.predict(texts, k=5, threshold=0.5)  # the same ranking: the same probabilities
    np.testing.assert_array_equal(got.label_ids, want.label_ids)
    np.testing.assert_allclose(got.probabilities, want.probabilities, rtol=1e-6)
    reloaded.set_lexical_channel(None)  # the dense ranking: another score scale
    _assert_dropped(reloaded, texts, caplog, "channel")


def test_calibration_is_dropped_when_the_ranker_cannot_load(fused_model, tiny_task, tmp_path, caplog, monkeypatch):
    texts = tiny_task[0].test.texts[:8]
    fused_model.save_pretrained(tmp_path / "m")
    monkeypatch.setattr(lexical_channel_module, "omikuji", None)  # a server without omikuji: the ranker term is gone
    reloaded = DEXMLModel.from_pretrained(tmp_path / "m")
    assert reloaded.lexical_channel is not None and not reloaded.lexical_channel.has_ranker
    _assert_dropped(reloaded, texts, caplog, "channel")


def test_calibration_is_dropped_for_other_fusion_weights_weights_or_a_refit_ranker(fused_model, tiny_task, caplog):
    data = tiny_task[0]
    texts = data.test.texts[:8]
    fused_model.lexical_channel.settings["text_weight"] = 0.0  # a refit channel's other weights
    _assert_dropped(fused_model, texts, caplog, "channel")

    fused_model.lexical_channel.settings["text_weight"] = 0.5
    fused_model.set_score_calibration(ScoreCalibration("platt", a=1.0, b=0.0))
    assert fused_model.score_calibration is not None
    fused_model.lexical_channel.set_ranker(fused_model.lexical_channel.ranker)  # trained again: another ranker
    _assert_dropped(fused_model, texts, caplog, "channel")

    fused_model.set_score_calibration(ScoreCalibration("platt", a=1.0, b=0.0))
    with torch.no_grad():
        next(fused_model.parameters()).add_(0.01)  # trained further
    _assert_dropped(fused_model, texts, caplog, "weights")


def test_calibration_is_dropped_under_another_search_mode(tiny_encoder_dir, tiny_task, caplog):
    data = tiny_task[0]
    model = UniDECModel.from_encoder_pretrained(tiny_encoder_dir, label_space_size=len(data.label_texts), max_seq_length=16)
    model.set_labels(data.label_texts)
    model.set_score_calibration(ScoreCalibration("platt", a=5.0, b=0.0))
    model.set_search_mode(model.search_mode)  # the same mode: kept
    assert model.score_calibration is not None
    model.set_search_mode("de" if model.search_mode != "de" else "classifier")
    _assert_dropped(model, data.test.texts[:4], caplog, "search_mode")


def test_calibration_is_dropped_for_another_classifier_share(tiny_encoder_dir, tiny_task, caplog):
    """A model's tunable ranking settings (SiameseXML's classifier share) are part of the ranking a calibration was
    fitted on: a share edited afterwards drops it; a calibration recorded before they were is not checked on them."""
    from tests.models.test_modeling_siamesexml import make_siamesexml

    data = tiny_task[0]
    model = make_siamesexml(tiny_encoder_dir, data)
    model.config.fusion_weight = 0.5
    model.set_score_calibration(ScoreCalibration("platt", a=5.0, b=0.0))
    assert model.config.score_calibration["fingerprint"]["ranking_settings"] == {"fusion_weight": 0.5}
    assert model.score_calibration is not None
    del model.config.score_calibration["fingerprint"]["ranking_settings"]  # as saved before
    model.config.fusion_weight = 0.9
    assert model.score_calibration is not None
    model.set_score_calibration(ScoreCalibration("platt", a=5.0, b=0.0))  # fitted at 0.9
    model.config.fusion_weight = 0.25  # edited by hand afterwards: another ranking
    _assert_dropped(model, data.test.texts[:4], caplog, "ranking_settings")


def test_a_channel_left_behind_by_its_labels_is_rebuilt(fused_model, tiny_task):
    """The lexical channel records the label set its rows were made for; labels changed without it (a label store that
    forgot to tell it) are caught where it is used: its rows are rebuilt, the ranker of the old labels switched off."""
    data = tiny_task[0]
    channel = fused_model.lexical_channel
    texts = list(fused_model.label_texts)
    texts[0], texts[1] = texts[1], texts[0]
    fused_model.label_texts = texts  # behind the channel's back, as MUFIN's label store did
    fused_model.invalidate_label_index()
    fused_model.predict(data.test.texts[:3], k=3)
    assert channel.label_source == fused_model.labels_digest()
    rebuilt = channel.features.transform(texts)
    np.testing.assert_array_equal(channel.label_rows.indptr, rebuilt.indptr)
    assert (channel.ranker_labels == -1).all()  # the ranker knew the old label order


def test_calibration_is_fitted_as_deep_as_threshold_ranks(fused_model, tiny_task):
    """A threshold keeps labels among the top THRESHOLD_DEPTH: the map is fitted on every one of those ranks (here all
    40 labels of each query), not on the top 20 with the rest clamped to its lowest block."""
    from hf_xmc.training.evaluation import XMCEvaluator

    data = tiny_task[0]
    assert CALIBRATION_DEPTH == THRESHOLD_DEPTH
    evaluator = XMCEvaluator(data.test, data.label_texts, data.label_uids, train_targets=data.train.targets, name="eval")
    calibration = fit_score_calibration(fused_model, evaluator, "isotonic")
    assert calibration.info["depth"] == THRESHOLD_DEPTH
    assert calibration.info["pairs"] == len(data.test) * len(data.label_texts)  # every rank, 21-40 included
    lowest = fused_model.predict(data.test.texts[:20], k=len(data.label_texts)).scores[:, -1]
    assert calibration.x.min() <= lowest.min()  # the deepest ranks lie inside the fitted range


def test_fusion_weights_are_tuned_with_the_dense_weight_fuse_serves(fused_model, tiny_task, monkeypatch):
    data = tiny_task[0]
    channel = fused_model.lexical_channel
    channel.settings["dense_weight"] = 0.0
    seen = []
    top_k = lexical_channel_module.FusionCandidates.top_k

    def record(self, ranker_weight, text_weight, k, dense_weight=1.0):
        seen.append(dense_weight)
        return top_k(self, ranker_weight, text_weight, k, dense_weight=dense_weight)

    monkeypatch.setattr(lexical_channel_module.FusionCandidates, "top_k", record)
    tune_fusion_weights(fused_model, channel, data.test, data.train.targets, (0.5, 1.0), (0.0, 0.5))
    assert seen and set(seen) == {0.0}


def test_predict_refuses_a_k_or_threshold_it_cannot_use(fused_model):
    for k in (2.5, 2.0, "3", True):
        with pytest.raises(ValueError, match="k must be a whole number"):
            fused_model.predict(["a query"], k=k)
    assert fused_model.predict(["a query"], k=np.int64(3)).label_ids.shape == (1, 3)
    for threshold in (float("nan"), float("inf"), "nan", "0.5"):
        with pytest.raises(ValueError, match=r"threshold is a probability in \[0, 1\]"):
            fused_model.predict(["a query"], threshold=threshold)
    from hf_xmc.models.pipeline_xmc import XMCPipeline

    pipe = XMCPipeline(model=fused_model, task="xmc")
    with pytest.raises(ValueError, match="top_k must be a whole number"):
        pipe("a query", top_k=2.5)
    with pytest.raises(ValueError, match="threshold is a probability"):
        pipe("a query", threshold=float("nan"))


def test_a_fit_that_fails_after_training_keeps_the_trained_model(tiny_task, tiny_encoder_dir, tmp_path, monkeypatch):
    """A calibration that cannot be fitted (no relevant pair among the validation rankings) used to lose the training:
    the model is saved first, then the error is raised."""
    from hf_xmc.training import calibration
    from hf_xmc.training.recipes import dexml

    def fail(model, evaluator, *args, **kwargs):
        raise ValueError("the 96 validation queries give no relevant and irrelevant labels in their top 100 to calibrate on")

    monkeypatch.setattr(calibration, "fit_score_calibration", fail)
    _, task_dir = tiny_task
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="to calibrate on"):
        dexml.main(contract_args(task_dir, tiny_encoder_dir, str(out), epochs="1") + ["--save_strategy", "no", "--score_calibration", "isotonic"])
    model = DEXMLModel.from_pretrained(out)  # what trained is there, loadable
    assert model.config.score_calibration is None and model.predict(["a query"], k=2).label_ids.shape == (1, 2)


def test_resuming_with_another_validation_split_is_refused(tiny_task, tiny_encoder_dir, tmp_path):
    _, task_dir = tiny_task
    out = tmp_path / "run"
    args = contract_args(task_dir, tiny_encoder_dir, str(out), epochs="1") + ["--save_strategy", "steps", "--save_steps", "5"]
    first = run_script(args + ["--max_steps", "5"])
    assert first.returncode == 0, first.stderr[-2000:]
    assert os.path.isdir(out / "checkpoint-5")
    # the first run held no split out; resumed with the channel (which carves one), it would tune on queries it trained on
    proc = run_script(args + ["--max_steps", "10", "--resume_from_checkpoint", "true", "--lexical_channel", "omikuji"])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert "checkpoint-5: the validation split was made from other source, queries, seed, fingerprint than the model's now: refused" in lines[-1]
    assert "Traceback" not in proc.stderr


def test_resuming_with_a_shortlist_of_other_training_pairs_is_refused(tiny_task, tiny_encoder_dir, tmp_path):
    """The trainer's own checkpoint state (hard-negative shortlist, clusters, memory bank) records the training queries,
    targets and filter it was made for: resumed with another --train_filter_file, its mined negatives would include
    the pairs the filter now forbids, so the resume is refused in one line."""
    _, task_dir = tiny_task
    out = tmp_path / "run"
    args = contract_args(task_dir, tiny_encoder_dir, str(out), epochs="1") + [
        "--save_strategy", "steps", "--save_steps", "4", "--hard_negatives", "2", "--hard_negative_start_epoch", "0"]
    first = run_script(args + ["--max_steps", "4"])
    assert first.returncode == 0, first.stderr[-2000:]
    state = json.load(open(out / "checkpoint-4" / "xmc_training_state.json"))
    assert set(state["inputs"]) == {"queries", "targets", "train_filter"} and state["shortlist"]
    filter_file = tmp_path / "filter.txt"
    filter_file.write_text("0 0\n1 5\n")
    proc = run_script(args + ["--max_steps", "8", "--resume_from_checkpoint", "true", "--train_filter_file", str(filter_file)])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "xmc_training_state.json: the training shortlists were made from other train_filter than the model's now: refused" in proc.stderr.strip().splitlines()[-1]


def test_a_fused_optimizer_step_is_seen_once_the_trainer_forgets_the_weights_fingerprint(tiny_encoder_dir):
    """torch's fused AdamW (transformers' default optim) writes the weights without bumping their version counters, so
    the cached fingerprint cannot see its steps: a model trained by a script kept the fingerprint of its untrained
    weights, and its score calibration (recorded after training with that stale fingerprint) was dropped on reload.
    XMCTrainer now forgets the fingerprint after every optimizer step (and after train)."""
    from hf_xmc.training import XMCTrainer, XMCTrainingArguments

    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, max_seq_length=16)
    before = model.weights_fingerprint()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.1, fused=True)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert model.weights_fingerprint() == before  # torch's behaviour: the cache keys on counters the step left alone
    model.invalidate_weights_fingerprint()
    assert model.weights_fingerprint() != before
    # the trainer's optimizer forgets it on every step
    args = XMCTrainingArguments(output_dir=str(tiny_encoder_dir) + "-unused", report_to="none", use_cpu=True)
    trainer = XMCTrainer(model=model, args=args, train_dataset=None)
    trainer.create_optimizer()
    seen = model.weights_fingerprint()
    for p in params:
        p.grad = torch.ones_like(p)
    getattr(trainer.optimizer, "optimizer", trainer.optimizer).step()
    assert model.weights_fingerprint() != seen


def test_the_cached_tensor_list_follows_replaced_parameters_conversions_and_new_modules(tiny_encoder_dir):
    """The weights' fingerprint and version walk a cached list of the model's tensors (the walk cost 0.26 ms, several
    times a predict); a parameter put in place of another, a dtype conversion and a resized embedding must each be
    seen, or a static encoder or ONNX export of the old weights would pass its check."""
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, max_seq_length=16)

    def fresh() -> list[int]:
        return [id(t) for t in (*model.parameters(), *model.buffers())]

    first = model.weights_fingerprint()
    assert [id(t) for t in model._weight_tensors()] == fresh()
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    linear.weight = torch.nn.Parameter(linear.weight.detach() * 2)  # a new object, its version counter at 0
    assert [id(t) for t in model._weight_tensors()] == fresh()
    replaced = model.weights_fingerprint()
    assert replaced != first
    model.half()  # torch's _apply: new storage (rounded values) behind the same Parameter objects
    assert [id(t) for t in model._weight_tensors()] == fresh() and model.weights_fingerprint() != replaced
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:  # torch then puts new Parameter objects in the modules' dictionaries, registering none of them
        model.float()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert [id(t) for t in model._weight_tensors()] == fresh()
    version = model.weights_version()
    with torch.no_grad():
        linear.weight.add_(1.0)  # in place: the version counter moves
    assert model.weights_version() != version
    converted = model.weights_fingerprint()
    model.encoder.resize_token_embeddings(model.encoder.get_input_embeddings().num_embeddings + 8)
    assert [id(t) for t in model._weight_tensors()] == fresh() and model.weights_fingerprint() != converted


def test_the_weights_fingerprint_is_each_tensors_float64_sum_and_norm_however_it_is_chunked(tiny_encoder_dir, monkeypatch):
    """The fingerprint converts each tensor to float64 a chunk at a time (one conversion for both reductions); it must
    be the float64 sum and norm of the values, whatever the chunk size, or saved fingerprints would stop matching."""
    from hf_xmc.models import model_provenance

    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, max_seq_length=16)
    tensors = model._weight_tensors()
    expected = [v for t in tensors for v in (float(t.detach().double().sum()), float(torch.linalg.vector_norm(t.detach().double())))]
    whole = model.weights_fingerprint()
    np.testing.assert_allclose(whole, expected, rtol=1e-12, atol=0)
    monkeypatch.setattr(model_provenance, "FINGERPRINT_CHUNK", 7)  # every tensor in many chunks, the last one short
    model.invalidate_weights_fingerprint()
    chunked = model.weights_fingerprint()
    assert chunked != whole or all(t.numel() <= 7 for t in tensors)  # computed again, not the cached tuple
    np.testing.assert_allclose(chunked, expected, rtol=1e-12, atol=1e-12)
