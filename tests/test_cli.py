"""The ``hf-xmc`` console command (train / evaluate / predict / push) and the training scripts as thin launchers of
the recipes in ``hf_xmc.training.recipes`` (tiny local task, CPU, no network)."""

import gzip
import importlib
import importlib.util
import inspect
import json
import os
import shutil
import sys

import numpy as np
import pytest

from hf_xmc import cli
from hf_xmc.training.recipes import RECIPES, get_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# metrics that do not measure time: the ones evaluate must reproduce exactly
TIMED = ("test_runtime", "test_samples_per_second")


def run_cli(capsys, *argv):
    """Run ``hf-xmc argv`` in-process; returns (exit status, stdout, stderr)."""
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def trained(tiny_task, tiny_encoder_dir, tmp_path_factory):
    """One short DEXML run through ``hf-xmc train dexml`` (with a filter file): (task dir, filter file, output dir)."""
    _, task_dir = tiny_task
    work = tmp_path_factory.mktemp("cli")
    filter_file = work / "filter.txt"
    filter_file.write_text("0 0\n1 5\n2 7\n")
    out = work / "dexml"
    code = cli.main(["train", "dexml", "--train_file", f"{task_dir}/trn.json.gz", "--test_file", f"{task_dir}/tst.json.gz",
                     "--label_file", f"{task_dir}/lbl.json.gz", "--model_name_or_path", tiny_encoder_dir,
                     "--output_dir", str(out), "--num_train_epochs", "1", "--per_device_train_batch_size", "32",
                     "--max_seq_length", "16", "--learning_rate", "5e-4", "--seed", "1", "--report_to", "none",
                     "--save_strategy", "no", "--disable_tqdm", "true", "--test_filter_file", str(filter_file)])
    assert code == 0
    return task_dir, str(filter_file), str(out)


@pytest.fixture(scope="module")
def reloaded(trained):
    """The trained model loaded the way the CLI loads it (AutoModel + remote code)."""
    from transformers import AutoModel

    return AutoModel.from_pretrained(trained[2], trust_remote_code=True)


# ------------------------------------------------------------------------------------------------ train
def test_train_writes_the_model_and_eval_results(trained):
    _, _, out = trained
    results = json.load(open(os.path.join(out, "eval_results.json")))
    for key in ("test_P@1", "test_P@5", "test_nDCG@3", "test_PSP@1", "test_PSP@5", "test_R@10", "test_R@100"):
        assert 0 <= results[key] <= 100, key
    assert results["train_runtime"] > 0 and results["test_samples_per_second"] > 0
    for name in ("config.json", "model.safetensors", "labels.jsonl", "label_embeddings.safetensors"):
        assert os.path.exists(os.path.join(out, name)), name


def test_train_method_help_is_the_recipes_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "unidec", "--help"])
    assert exit_info.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith("usage: hf-xmc train unidec")
    for flag in ("--projection_dim", "--use_classifier", "--label_pool", "--train_file", "--output_dir", "--learning_rate"):
        assert flag in shown, flag


def test_training_script_help_puts_the_xmc_flags_first():
    """--help: the method's, the data's and hf_xmc's training flags in titled groups before transformers' ~100, a short
    usage, and a --no_<flag> whose help says that it switches <flag> off."""
    from hf_xmc.training.recipes.dexml import DEXMLModelArguments, DEXMLTrainingArguments
    from hf_xmc.training.script_utils import XMCArgumentParser, XMCDataArguments

    shown = XMCArgumentParser((DEXMLModelArguments, XMCDataArguments, DEXMLTrainingArguments), prog="train_dexml.py").format_help()
    order = ["hf_xmc model (DEXMLModelArguments):", "--temperature", "hf_xmc data:", "--train_file", "hf_xmc training:",
             "--label_pool", "--peft", "transformers TrainingArguments:", "--learning_rate", "--adam_beta1"]
    positions = [shown.index(marker) for marker in order]
    assert positions == sorted(positions), list(zip(order, positions))
    assert shown.index("--train_file") < 60 * 80  # within the first screens, not after 800 lines
    assert len(shown.split("options:")[0].splitlines()) <= 3  # the usage names the required flags, not all of them
    negation = shown[shown.index("--no_normalize"):].split("--temperature")[0]
    assert "Switch --normalize off" in " ".join(negation.split()) and "default: False" not in negation


def test_log_level_and_transformers_verbosity_are_honoured(tiny_task, tiny_encoder_dir, tmp_path):
    """--log_level warning keeps hf_xmc's and transformers' INFO (the encoder's config) quiet; the default ('passive')
    logs INFO unless transformers' verbosity was turned down."""
    import logging

    import transformers

    from hf_xmc.training.recipes.dexml import DEXMLModelArguments, DEXMLTrainingArguments
    from hf_xmc.training.script_utils import parse_script_args

    task_dir = tiny_task[1]
    base = ["--train_file", f"{task_dir}/trn.json.gz", "--test_file", f"{task_dir}/tst.json.gz", "--label_file", f"{task_dir}/lbl.json.gz",
            "--model_name_or_path", tiny_encoder_dir, "--output_dir", str(tmp_path / "o"), "--report_to", "none"]
    package, verbosity = logging.getLogger("hf_xmc"), transformers.logging.get_verbosity()
    level = package.level
    try:
        seen = {}
        for name, extra, quiet in (("warning", ["--log_level", "warning"], False), ("passive", [], False), ("turned down", [], True)):
            transformers.logging.set_verbosity(logging.ERROR if quiet else logging.WARNING)
            parse_script_args(DEXMLModelArguments, DEXMLTrainingArguments, base + extra, method="dexml")
            seen[name] = (package.getEffectiveLevel(), transformers.logging.get_verbosity())
        assert seen == {"warning": (logging.WARNING, logging.WARNING), "passive": (logging.INFO, logging.INFO),
                        "turned down": (logging.ERROR, logging.ERROR)}
    finally:
        package.setLevel(level)
        transformers.logging.set_verbosity(verbosity)


def test_progress_bars_follow_tqdm_disable_and_transformers(tiny_encoder_dir, capsys, monkeypatch):
    """hf_xmc's "Encoding" bars (and the training runs' disable_tqdm) obey TQDM_DISABLE and transformers'
    disable_progress_bar(), even where a bar is asked for."""
    import transformers

    from hf_xmc.models import DEXMLModel
    from hf_xmc.training import XMCTrainingArguments

    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, max_seq_length=8)
    texts = ["w0 w1"] * 4

    def bar_drawn() -> bool:
        model.encode_texts(texts, 8, batch_size=2, show_progress_bar=True)
        return "Encoding" in capsys.readouterr().err

    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert bar_drawn()
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert not bar_drawn()
    assert XMCTrainingArguments(output_dir="unused", disable_tqdm=False).disable_tqdm is True
    monkeypatch.delenv("TQDM_DISABLE")
    transformers.logging.disable_progress_bar()
    try:
        assert not bar_drawn()
    finally:
        transformers.logging.enable_progress_bar()


def test_training_scripts_are_launchers_of_the_recipes():
    for method in RECIPES:
        path = os.path.join(ROOT, "training_scripts", f"train_{method}.py")
        spec = importlib.util.spec_from_file_location(f"_script_{method}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # the __main__ guard keeps it from training
        assert module.main is get_recipe(method) is importlib.import_module(f"hf_xmc.training.recipes.{method}").main
        assert f"training_scripts/train_{method}.py" in module.__doc__  # usage kept in the script


@pytest.mark.parametrize("method,own_flag", [("dexml", "--temperature"), ("prime", "--num_free_vectors"), ("unidec", "--projection_dim"),
                                             ("siamesexml", "--classifier_max_steps"), ("mufin", "--vision_model_name_or_path")])
def test_training_script_help_lists_the_recipe_flags(method, own_flag, capsys, monkeypatch):
    # the script file run as __main__ in this process (a fresh interpreter per script only re-imports torch)
    import runpy

    script = os.path.join(ROOT, "training_scripts", f"train_{method}.py")
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(script, run_name="__main__")
    assert exit_info.value.code in (0, None)
    stdout = capsys.readouterr().out
    assert stdout.startswith(f"usage: train_{method}.py")
    for flag in (own_flag, "--model_name_or_path", "--train_file", "--test_filter_file", "--output_dir", "--num_train_epochs"):
        assert flag in stdout, (method, flag)


# ------------------------------------------------------------------------------------------------ evaluate
def test_evaluate_reproduces_the_training_runs_test_metrics(trained, capsys, tmp_path):
    task_dir, filter_file, out = trained
    metrics_file = tmp_path / "sub" / "metrics.json"
    code, stdout, stderr = run_cli(capsys, "evaluate", out, "--test_file", f"{task_dir}/tst.json.gz",
                                   "--train_file", f"{task_dir}/trn.json.gz", "--test_filter_file", filter_file,
                                   "--output_file", metrics_file)
    assert code == 0, stderr
    metrics = json.loads(stdout)
    assert json.load(open(metrics_file)) == metrics
    expected = {k: v for k, v in json.load(open(os.path.join(out, "eval_results.json"))).items()
                if k.startswith("test_") and k not in TIMED}
    assert "test_PSP@5" in expected and "test_R@100" in expected
    assert {k: v for k, v in metrics.items() if k not in TIMED} == pytest.approx(expected, abs=1e-9)


def test_evaluate_without_train_file_leaves_psp_out(trained, capsys):
    task_dir, filter_file, out = trained
    code, stdout, stderr = run_cli(capsys, "evaluate", out, "--test_file", f"{task_dir}/tst.json.gz",
                                   "--test_filter_file", filter_file)
    assert code == 0, stderr
    metrics = json.loads(stdout)
    assert not [k for k in metrics if "PS" in k]
    assert "no --train_file" in stderr and "PSP@k" in stderr
    trained_metrics = json.load(open(os.path.join(out, "eval_results.json")))
    for key in ("test_P@1", "test_P@5", "test_nDCG@5", "test_R@10"):
        assert metrics[key] == pytest.approx(trained_metrics[key], abs=1e-9), key


def test_evaluate_reads_a_parquet_test_file_as_its_xc_twin(trained, capsys, tmp_path):
    """``--test_file`` takes the formats the training scripts take: a parquet copy of the test split (``text`` and
    ``labels`` columns) scores exactly as the XC JSON lines file."""
    import datasets

    from hf_xmc.data import read_xc_raw

    task_dir, _, out = trained
    test = read_xc_raw(f"{task_dir}/tst.json.gz", num_labels=None)
    rows = [{"text": t, "labels": test.targets[i].indices.tolist()} for i, t in enumerate(test.texts)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "test.parquet"))
    scores = []
    for test_file in (f"{task_dir}/tst.json.gz", str(tmp_path / "test.parquet")):
        code, stdout, stderr = run_cli(capsys, "evaluate", out, "--test_file", test_file, "--train_file", f"{task_dir}/trn.json.gz")
        assert code == 0, stderr
        scores.append({k: v for k, v in json.loads(stdout).items() if k not in TIMED})
    assert scores[0]["test_P@1"] > 0 and scores[1] == pytest.approx(scores[0], abs=1e-9)


def test_evaluate_applies_the_filter_file(trained, reloaded, tiny_task, capsys, tmp_path):
    """Filtering every test point's top-1 label makes the second-ranked label count for P@1."""
    data, task_dir = tiny_task
    ids = reloaded.predict(data.test.texts, k=2).label_ids
    hits = data.test.targets[np.arange(len(data.test))[:, None], ids].toarray() > 0  # (n, 2): is rank r a true label
    filter_file = tmp_path / "filter_top1.txt"
    filter_file.write_text("".join(f"{i} {row[0]}\n" for i, row in enumerate(ids.tolist())))
    results = {}
    for name, extra in (("plain", []), ("filtered", ["--test_filter_file", filter_file])):
        code, stdout, stderr = run_cli(capsys, "evaluate", trained[2], "--test_file", f"{task_dir}/tst.json.gz", *extra)
        assert code == 0, stderr
        results[name] = json.loads(stdout)
    assert results["plain"]["test_P@1"] == pytest.approx(100 * hits[:, 0].mean())
    assert results["filtered"]["test_P@1"] == pytest.approx(100 * hits[:, 1].mean())
    assert hits[:, 0].mean() != hits[:, 1].mean()  # (the two rankings score apart, so the check can tell them apart)


# ------------------------------------------------------------------------------------------------ predict
def assert_matches_predict(records, texts, model, k):
    """The CLI's JSON lines are ``model.predict(texts, k)``: same ids (best first), uids, label texts and scores."""
    pred = model.predict(texts, k=k)
    assert [r["text"] for r in records] == list(texts)
    for record, ids, scores in zip(records, pred.label_ids, pred.scores):
        assert [label["id"] for label in record["labels"]] == ids.tolist()
        assert [label["uid"] for label in record["labels"]] == [model.label_uids[i] for i in ids]
        assert [label["text"] for label in record["labels"]] == [model.label_texts[i] for i in ids]
        np.testing.assert_allclose([label["score"] for label in record["labels"]], scores, rtol=1e-5, atol=1e-6)


def test_predict_texts_to_stdout(trained, reloaded, tiny_task, capsys):
    data, _ = tiny_task
    texts = [data.test.texts[0], data.test.texts[7], "some words nobody wrote"]
    argv = ["predict", trained[2], "--k", "4"]
    for t in texts:
        argv += ["--text", t]
    code, stdout, stderr = run_cli(capsys, *argv)
    assert code == 0, stderr
    records = [json.loads(line) for line in stdout.splitlines()]
    assert len(records) == 3 and all(len(r["labels"]) == 4 for r in records)
    assert_matches_predict(records, texts, reloaded, k=4)


def test_predict_plain_text_file(trained, reloaded, tiny_task, capsys, tmp_path):
    data, _ = tiny_task
    queries = tmp_path / "queries.txt"
    queries.write_text("\n".join(data.test.texts[:10]) + "\n\n")  # a trailing blank line carries no query
    preds = tmp_path / "out" / "preds.jsonl"
    code, stdout, stderr = run_cli(capsys, "predict", trained[2], "--input_file", queries, "--output_file", preds, "--k", "3")
    assert code == 0, stderr
    assert stdout == ""
    assert_matches_predict([json.loads(line) for line in open(preds)], data.test.texts[:10], reloaded, k=3)
    assert os.listdir(tmp_path / "out") == ["preds.jsonl"]  # the temp file was renamed, none left behind


def test_predict_xc_json_file(trained, reloaded, tiny_task, capsys, tmp_path):
    data, task_dir = tiny_task
    preds = tmp_path / "preds.jsonl"
    code, _, stderr = run_cli(capsys, "predict", trained[2], "--input_file", f"{task_dir}/tst.json.gz", "--output_file", preds)
    assert code == 0, stderr
    records = [json.loads(line) for line in open(preds)]
    assert len(records) == len(data.test)
    assert_matches_predict(records, data.test.texts, reloaded, k=5)


# ------------------------------------------------------------------------------------------------ push
def test_push_hands_the_arguments_to_hub_push_to_hub(trained, capsys, monkeypatch):
    from hf_xmc import hub

    calls = []

    def fake_push_to_hub(model_or_directory, repo_id, **kwargs):
        calls.append(((model_or_directory, repo_id), kwargs))
        return f"https://huggingface.co/{repo_id}/commit/abc123"

    real = hub.push_to_hub
    monkeypatch.setattr(hub, "push_to_hub", fake_push_to_hub)
    out = trained[2]
    code, stdout, stderr = run_cli(capsys, "push", out, "org/tiny-dexml", "--revision", "dev", "--private", "--create_pr",
                                   "--commit_message", "first model", "--token", "hf_secret")
    assert code == 0, stderr
    assert stdout.strip() == "https://huggingface.co/org/tiny-dexml/commit/abc123"
    assert calls == [((out, "org/tiny-dexml"), dict(revision="dev", private=True, create_pr=True,
                                                     commit_message="first model", token="hf_secret"))]
    code, _, _ = run_cli(capsys, "push", out, "org/tiny-dexml", "--no-private")
    assert code == 0
    assert calls[1][1] == dict(revision=None, private=False, create_pr=False, commit_message=None, token=None)
    code, _, _ = run_cli(capsys, "push", out, "org/tiny-dexml")
    assert code == 0 and calls[2][1]["private"] is None  # not given: the Hub's default visibility
    inspect.signature(real).bind(*calls[0][0], **calls[0][1])  # the call fits the real function


def test_push_warns_of_an_adapter_only_model_with_a_local_base(trained, capsys, tmp_path):
    """The dry run (and the push) says, before anything goes up, that an adapter-only model whose base encoder is a
    local directory loads nowhere else (``hf_xmc.training.cards.adapter_base_warning`` on the saved config)."""
    import shutil

    out = tmp_path / "adapter"
    shutil.copytree(trained[2], out)
    config = json.load(open(out / "config.json"))
    code, _, stderr = run_cli(capsys, "push", str(out), "org/x", "--dry_run")
    assert code == 0 and "warning" not in stderr  # a whole encoder is saved: nothing to say
    config.update(encoder_adapter_only=True, encoder_base_model=str(tmp_path / "my-encoder"))
    (out / "config.json").write_text(json.dumps(config))
    code, stdout, stderr = run_cli(capsys, "push", str(out), "org/x", "--dry_run")
    assert code == 0 and "config.json" in stdout
    assert "warning:" in stderr and "adapter-only" in stderr and str(tmp_path / "my-encoder") in stderr


def test_push_that_fails_offline_writes_nothing(trained, capsys, tmp_path, monkeypatch):
    """A directory without a card: the push builds one in a staging copy, so an upload that fails (offline here)
    leaves the model directory as it was (it used to gain README.md and xmc_metrics.png)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    model = tmp_path / "model"
    shutil.copytree(trained[2], model)
    for name in ("README.md", "xmc_metrics.png"):
        (model / name).unlink(missing_ok=True)
    before = sorted(os.listdir(model))
    code, stdout, stderr = run_cli(capsys, "push", model, "org/name")
    assert code == 1 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1].startswith("hf-xmc push: upload to org/name failed: "), stderr  # (after the card's load bar)
    assert sorted(os.listdir(model)) == before and not [p for p in os.listdir(tmp_path) if p != "model"]


def test_push_failures_are_one_line(trained, tiny_encoder_dir, capsys):
    import huggingface_hub.constants

    # the real push_to_hub refuses a directory that is not a complete model before anything goes up
    line = one_line_error(*run_cli(capsys, "push", tiny_encoder_dir, "org/name"))
    assert tiny_encoder_dir in line and "not an hf_xmc model" in line
    if huggingface_hub.constants.HF_HUB_OFFLINE:  # (conftest's default) the upload itself cannot reach the Hub
        code, stdout, stderr = run_cli(capsys, "push", trained[2], "org/name")
        assert code == 1 and stdout == "" and "Traceback" not in stderr
        assert stderr.strip().splitlines()[-1].startswith("hf-xmc push: upload to org/name failed: ")


# ------------------------------------------------------------------------------------------------ user errors
def one_line_error(code, stdout, stderr):
    assert code == 2, (stdout, stderr)
    # transformers may draw its weight-loading bar before the fault is found; the message itself is one line, last
    lines = [line for line in stderr.strip().splitlines() if line.startswith("hf-xmc")]
    assert len(lines) == 1 and stderr.strip().endswith(lines[0]) and "Traceback" not in stderr, stderr
    return lines[0]


def test_unknown_method(capsys):
    line = one_line_error(*run_cli(capsys, "train", "astec", "--output_dir", "x"))
    assert line.startswith("hf-xmc train:") and "'astec'" in line and "dexml, mufin, prime, siamesexml, unidec" in line


def test_missing_files(trained, capsys, tmp_path):
    task_dir, _, out = trained
    missing = tmp_path / "nope.json.gz"
    line = one_line_error(*run_cli(capsys, "evaluate", out, "--test_file", missing))
    assert str(missing) in line and "no such file" in line and "--test_file" in line
    line = one_line_error(*run_cli(capsys, "evaluate", out, "--test_file", f"{task_dir}/tst.json.gz", "--train_file", missing))
    assert str(missing) in line and "--train_file" in line
    line = one_line_error(*run_cli(capsys, "predict", out, "--input_file", missing))
    assert str(missing) in line and "no such file" in line
    # a missing training file surfaces from the recipe's reader
    line = one_line_error(*run_cli(capsys, "train", "dexml", "--train_file", missing, "--test_file", f"{task_dir}/tst.json.gz",
                                   "--label_file", f"{task_dir}/lbl.json.gz", "--model_name_or_path", "unused",
                                   "--output_dir", tmp_path / "o", "--report_to", "none"))
    assert str(missing) in line and "no such file" in line


def test_bad_model_dirs(trained, tiny_encoder_dir, capsys, tmp_path):
    task_dir = trained[0]
    empty = tmp_path / "empty"
    empty.mkdir()
    line = one_line_error(*run_cli(capsys, "predict", empty, "--text", "x"))
    assert str(empty) in line and "cannot load a model" in line and "config.json" in line
    line = one_line_error(*run_cli(capsys, "predict", tmp_path / "no" / "such" / "dir", "--text", "x"))
    assert "no such model directory" in line
    # a plain encoder directory loads, but it is not an XMC model with labels
    line = one_line_error(*run_cli(capsys, "evaluate", tiny_encoder_dir, "--test_file", f"{task_dir}/tst.json.gz"))
    assert tiny_encoder_dir in line and "not an hf_xmc model" in line
    line = one_line_error(*run_cli(capsys, "push", empty / "x", "org/name"))
    assert "no such model directory" in line
    # a truncated weights file (an interrupted download): named, with what to do, not a bare SafetensorError
    truncated = tmp_path / "truncated"
    shutil.copytree(trained[2], truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5])
    line = one_line_error(*run_cli(capsys, "predict", truncated, "--text", "x"))
    assert str(truncated) in line and "not valid safetensors" in line and "download it again" in line


def test_bad_data_names_the_file_and_line(trained, capsys, tmp_path):
    _, _, out = trained
    bad = tmp_path / "queries.json"
    bad.write_text(json.dumps({"title": "fine"}) + "\n" + json.dumps({"content": "no title"}) + "\n")
    line = one_line_error(*run_cli(capsys, "predict", out, "--input_file", bad))
    assert f"{bad}, line 2: missing field 'title'" in line
    # a test file whose label ids exceed the model's label space
    tst = tmp_path / "tst.json.gz"
    with gzip.open(tst, "wt") as f:
        f.write(json.dumps({"uid": "a", "title": "w", "target_ind": [0, 4000]}) + "\n")
    line = one_line_error(*run_cli(capsys, "evaluate", out, "--test_file", tst))
    assert f"{tst}, line 1" in line and "label id 4000 out of range" in line
    line = one_line_error(*run_cli(capsys, "predict", out, "--text", "x", "--k", "0"))
    assert "--k" in line


# ------------------------------------------------------------------------------------------------ add-labels
def test_add_labels_grows_the_saved_model(trained, reloaded, tiny_task, capsys, tmp_path):
    import gzip

    from transformers import AutoModel

    from hf_xmc.data import write_xc_labels

    labels = tmp_path / "new.json.gz"
    write_xc_labels(str(labels), ["new-a", "new-b"], ["zzzz brand new tag", "another added label"])
    out = tmp_path / "grown"
    gone = reloaded.label_uids[0]
    code, stdout, stderr = run_cli(capsys, "add-labels", trained[2], labels, "--remove", gone, "--output_dir", out)
    assert code == 0, stderr
    report = json.loads(stdout)
    old = len(reloaded.label_texts)
    assert report == {"model": str(out), "labels": old + 1, "added": 2, "removed": 1, "removed_uids": {gone: 1}}
    grown = AutoModel.from_pretrained(out, trust_remote_code=True)
    assert grown.label_uids[-2:] == ["new-a", "new-b"] and gone not in grown.label_uids
    assert grown.label_texts[-1] == "another added label"
    texts = tiny_task[0].test.texts[:5]
    # the labels kept score as before (their vectors travel unchanged); the source directory is untouched
    before, after = reloaded.predict(texts, k=old), grown.predict(texts, k=old + 1)
    for b_ids, b_s, a_ids, a_s in zip(before.label_ids, before.scores, after.label_ids, after.scores):
        was = {reloaded.label_uids[i]: s for i, s in zip(b_ids, b_s)}
        now = {grown.label_uids[i]: s for i, s in zip(a_ids, a_s)}
        assert all(abs(now[u] - was[u]) < 1e-5 for u in now if u in was)
    assert len(AutoModel.from_pretrained(trained[2], trust_remote_code=True).label_texts) == old
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]
    # faults: a uid taken, an unknown uid, nothing to do -- one line, status 2, nothing written
    line = one_line_error(*run_cli(capsys, "add-labels", out, labels))
    assert "must be new and distinct: 'new-a' is taken" in line
    line = one_line_error(*run_cli(capsys, "add-labels", trained[2], "--remove", "nope", "--output_dir", tmp_path / "x"))
    assert "no label has uid 'nope'" in line and not (tmp_path / "x").exists()
    assert "nothing to do" in one_line_error(*run_cli(capsys, "add-labels", trained[2]))
    with gzip.open(labels, "rt") as f:
        assert len(f.readlines()) == 2


# ------------------------------------------------------------------------------------------------ serve (issue 64)
@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "m", "--max_wait_ms", "nan"], "--max_wait_ms must be a finite number, got nan"),
    (["serve", "m", "--max_wait_ms", "-1"], "--max_wait_ms must be at least 0, got -1"),
    (["serve", "m", "--request_timeout", "inf"], "--request_timeout must be a finite number, got inf"),
    (["serve", "m", "--request_timeout", "0"], "--request_timeout must be more than 0 seconds, got 0"),
    (["serve", "m", "--max_body_bytes", "0"], "--max_body_bytes must be at least 1, got 0"),
    (["serve", "m", "--max_pixels", "-5"], "--max_pixels must be at least 1, got -5"),
    (["serve", "m", "--max_queue", "0"], "--max_queue must be at least 1, got 0"),
    (["serve", "m", "--max_connections", "0"], "--max_connections must be at least 1, got 0"),
    (["serve", "m", "--max_worker_restarts", "-1"], "--max_worker_restarts must be at least 0, got -1"),
    (["predict", "m", "--text", "q", "--threshold", "nan"], "--threshold is a probability in [0, 1], got nan"),
])
def test_non_finite_and_out_of_range_numbers_are_refused_before_any_model_loads(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)  # "m" does not exist: a check that came after loading would say so instead
    assert (code, out, err) == (2, "", f"hf-xmc {argv[0]}: {message}\n")


def test_evaluate_refuses_a_non_finite_propensity(capsys, tmp_path):
    test_file = tmp_path / "tst.json"
    test_file.write_text('{"title": "q", "target_ind": [0]}\n')
    for flag, value in (("--propensity_a", "nan"), ("--propensity_b", "-inf")):
        code, _, err = run_cli(capsys, "evaluate", "m", "--test_file", test_file, f"{flag}={value}")  # "-inf" would read as a flag
        assert (code, err) == (2, f"hf-xmc evaluate: {flag} must be a finite number, got {value}\n")


def test_serve_waits_for_arrivals_unless_told_to_wait_a_fixed_time():
    """``hf-xmc serve`` batches with ``--wait_for_arrivals`` by default (measured against the fixed wait at 53K and 1.3M
    labels: docs/serving.md); ``--no_wait_for_arrivals`` brings the fixed wait back. The Python API agrees."""
    import inspect

    from hf_xmc import serving

    parser = cli.build_parser()
    assert parser.parse_args(["serve", "m"]).wait_for_arrivals is True
    assert parser.parse_args(["serve", "m", "--wait_for_arrivals"]).wait_for_arrivals is True
    assert parser.parse_args(["serve", "m", "--no_wait_for_arrivals"]).wait_for_arrivals is False
    for function in (serving.serve, serving.create_app):
        assert inspect.signature(function).parameters["wait_for_arrivals"].default is True


def test_serve_help_says_a_repo_runs_its_code_and_takes_a_revision(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert "runs that repo's own Python code" in text and "trust_remote_code=True" in text
    assert "--revision REVISION" in text and "a commit sha pins it" in text


def test_serve_revision_reaches_from_pretrained_and_is_refused_for_a_directory(capsys, tmp_path, monkeypatch):
    import transformers

    asked = []

    def offline(name, **kwargs):
        asked.append((name, kwargs))
        raise OSError("we are offline")

    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", offline)
    code, _, err = run_cli(capsys, "serve", "org/name", "--revision", "0123456789abcdef0123456789abcdef01234567")
    assert code == 2 and err.startswith("hf-xmc serve: org/name: no such directory, and loading it as a Hub repo id failed")
    assert asked == [("org/name", {"trust_remote_code": True, "revision": "0123456789abcdef0123456789abcdef01234567"})]
    code, _, err = run_cli(capsys, "serve", tmp_path, "--revision", "main")
    assert (code, err) == (2, f"hf-xmc serve: {tmp_path}: --revision pins a commit of a Hub repo, and this is a local directory\n")
    assert len(asked) == 1  # nothing loaded for the directory
