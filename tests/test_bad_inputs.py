"""A corpus of bad inputs, tried the way a user meets them: every case ends on one line that names the file (and the
line) or the flag and the fault, with exit status 2 and no traceback, and leaves the output directory as it was.

Training cases go through ``train_dexml.py``'s entry point (``run_script``, in-process), ``hf-xmc`` cases through
the console command's ``main``; the readers that no command exposes (BoW text, images) raise ``XMCDataError`` naming
the file, line and fault. The Space's input bounds are in tests/test_space.py. ``BAD_INPUT_KINDS`` counts them all
for the README ("Errors, safety and resuming").
"""

import errno
import gzip
import io
import json
import os
import sys

import pytest
import torch
from safetensors import SafetensorError

from hf_xmc import cli
from hf_xmc.data import XMCDataError, load_image, read_bow, read_sparse_matrix
from hf_xmc.models import DEXMLModel
from hf_xmc.training.recipes import dexml
from hf_xmc.training.script_utils import run_script

GOOD = '{"uid": "p0", "title": "w0", "target_ind": [0]}\n'


def _write(path, content) -> str:
    data = content.encode() if isinstance(content, str) else content
    if str(path).endswith(".gz") and not data.startswith(b"\x00"):  # a deliberately non-gzip .gz starts with \x00
        data = gzip.compress(data)
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


# id: (files to write {name: content}, flags to change (None drops one), the fault's words in the message)
TRAIN_CASES = {
    "train_file_missing": ({}, {"--train_file": "{w}/absent.json.gz"}, "{w}/absent.json.gz: no such file or directory"),
    "train_file_not_gzip": ({"a.json.gz": b"\x00\x01 not gzip"}, {"--train_file": "{w}/a.json.gz"}, "{w}/a.json.gz, line 1: cannot read/decode file: Not a gzipped file"),
    "train_line_not_json": ({"b.json.gz": GOOD + "{not json\n"}, {"--train_file": "{w}/b.json.gz"}, "{w}/b.json.gz, line 2: malformed JSON"),
    "train_line_not_object": ({"c.json.gz": GOOD + "[1, 2]\n"}, {"--train_file": "{w}/c.json.gz"}, "{w}/c.json.gz, line 2: expected a JSON object, got list"),
    "train_title_missing": ({"d.json.gz": GOOD + '{"uid": "x", "target_ind": [0]}\n'}, {"--train_file": "{w}/d.json.gz"}, "{w}/d.json.gz, line 2: missing field 'title'"),
    "train_title_not_string": ({"e.json.gz": GOOD + '{"uid": "x", "title": 5, "target_ind": [0]}\n'}, {"--train_file": "{w}/e.json.gz"}, "{w}/e.json.gz, line 2: field 'title' must be a string, got int"),
    "train_targets_missing": ({"f.json.gz": GOOD + '{"uid": "x", "title": "a"}\n'}, {"--train_file": "{w}/f.json.gz"}, "{w}/f.json.gz, line 2: missing field 'target_ind'"),
    "train_targets_not_list": ({"g.json.gz": GOOD + '{"uid": "x", "title": "a", "target_ind": "0"}\n'}, {"--train_file": "{w}/g.json.gz"}, "{w}/g.json.gz, line 2: 'target_ind' must be a list of ints"),
    "train_target_float": ({"h.json.gz": GOOD + '{"uid": "x", "title": "a", "target_ind": [1.5]}\n'}, {"--train_file": "{w}/h.json.gz"}, "{w}/h.json.gz, line 2: 'target_ind' must be a list of ints, got [1.5]"),
    "train_target_out_of_range": ({"i.json.gz": GOOD + '{"uid": "x", "title": "a", "target_ind": [999]}\n'}, {"--train_file": "{w}/i.json.gz"}, "{w}/i.json.gz, line 2: label id 999 out of range (num_labels=40)"),
    "train_target_negative": ({"j.json.gz": GOOD + '{"uid": "x", "title": "a", "target_ind": [-1]}\n'}, {"--train_file": "{w}/j.json.gz"}, "{w}/j.json.gz, line 2: label id -1 is negative"),
    "train_file_empty": ({"k.json.gz": ""}, {"--train_file": "{w}/k.json.gz"}, "{w}/k.json.gz: the training file is empty: it has no point line"),
    "train_no_point_labelled": ({"l.json.gz": '{"uid": "x", "title": "a", "target_ind": []}\n'}, {"--train_file": "{w}/l.json.gz"}, "{w}/l.json.gz: no training point has a label (1 point(s) without one)"),
    "train_not_utf8": ({"m.json.gz": GOOD.encode() + b'{"uid": "x", "title": "\xff\xfe", "target_ind": [0]}\n'}, {"--train_file": "{w}/m.json.gz"}, "{w}/m.json.gz, line 1: cannot read/decode file: 'utf-8' codec can't decode"),
    "train_text_fields_absent": ({}, {"--text_fields": "content"}, "trn.json.gz: no line has the text field(s) 'content' (--text_fields)"),
    "label_file_empty": ({"n.json.gz": ""}, {"--label_file": "{w}/n.json.gz"}, "{w}/n.json.gz: the label file is empty: it has no label line"),
    "label_title_missing": ({"o.json.gz": '{"uid": "l0"}\n'}, {"--label_file": "{w}/o.json.gz"}, "{w}/o.json.gz, line 1: missing field 'title'"),
    "test_target_out_of_range": ({"p.json.gz": '{"uid": "x", "title": "a", "target_ind": [999]}\n'}, {"--test_file": "{w}/p.json.gz"}, "{w}/p.json.gz, line 1: label id 999 out of range (num_labels=40)"),
    "filter_file_missing": ({}, {"--test_filter_file": "{w}/absent.txt"}, "{w}/absent.txt: no such file or directory"),
    "filter_line_malformed": ({"q.txt": "0 0\n1 x\n"}, {"--test_filter_file": "{w}/q.txt"}, "{w}/q.txt, line 2: malformed line '1 x' (expected 'point_idx label_idx')"),
    "filter_three_columns": ({"r.txt": "0 0 0\n"}, {"--test_filter_file": "{w}/r.txt"}, "{w}/r.txt, line 1: malformed line '0 0 0'"),
    "filter_point_out_of_range": ({"s.txt": "0 0\n100000 1\n"}, {"--test_filter_file": "{w}/s.txt"}, "{w}/s.txt, line 2: point index 100000 out of range [0, 120)"),
    "encoder_dir_missing": ({}, {"--model_name_or_path": "{w}/no-encoder"}, "{w}/no-encoder: no such model directory (--model_name_or_path)"),
    "encoder_dir_without_config": ({"enc/vocab.txt": "[PAD]\n"}, {"--model_name_or_path": "{w}/enc"}, "{w}/enc: not a model directory (no config.json)"),
    "output_dir_is_a_file": ({"t.txt": "x"}, {"--output_dir": "{w}/t.txt"}, "{w}/t.txt: --output_dir is a file, not a directory"),
    "resume_checkpoint_missing": ({}, {"--resume_from_checkpoint": "{w}/no-checkpoint"}, "{w}/no-checkpoint: --resume_from_checkpoint names no checkpoint directory"),
    "epochs_negative": ({}, {"--num_train_epochs": "-1"}, "--num_train_epochs must be >= 0, got -1.0"),
    "batch_size_zero": ({}, {"--per_device_train_batch_size": "0"}, "--per_device_train_batch_size must be >= 1, got 0"),
    "max_seq_length_zero": ({}, {"--max_seq_length": "0"}, "--max_seq_length must be >= 1, got 0"),
    "hard_negatives_beyond_shortlist": ({}, {"--hard_negatives": "20", "--hard_negative_top_k": "5"}, "--hard_negatives 20 exceeds the shortlist they are drawn from (--hard_negative_top_k 5)"),
    "label_pool_unknown": ({}, {"--label_pool": "everything"}, "label_pool must be 'in_batch', 'psl' or 'all', got 'everything'"),
    "flag_unknown": ({}, {"--no_such_flag": "1"}, "not used by the HfArgumentParser: ['--no_such_flag', '1']"),
    "flag_value_not_a_number": ({}, {"--learning_rate": "abc"}, "error: argument --learning_rate/--learning-rate: invalid float value: 'abc'"),
    "preset_unknown": ({}, {"--preset": "nope"}, "error: --preset: unknown preset 'nope' for dexml"),
    "flag_abbreviated": ({}, {"--max_step": "1"}, "not used by the HfArgumentParser: ['--max_step', '1']"),  # not --max_steps
    "encoder_path_local_typo": ({}, {"--model_name_or_path": "in/no-encoder"}, "in/no-encoder: no such model directory"),  # 'in' is a local dir: no Hub retries
}


def _snapshot(directory) -> dict:
    """Every path under ``directory`` with its size and modification time (None when it does not exist)."""
    if not os.path.exists(directory):
        return None
    out = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            stat = os.stat(path)
            out[os.path.relpath(path, directory)] = (stat.st_size, stat.st_mtime_ns)
    return out


def _one_line(stderr: str, prefix: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert lines and "Traceback" not in stderr, stderr
    assert lines[-1].startswith(prefix), stderr
    return lines[-1]


# id: (flags, what to change in the environment, the fault's words): an optional dependency missing
TRAIN_ENV_CASES = {
    "peft_not_installed": ({"--peft": "lora"}, lambda mp: mp.setitem(sys.modules, "peft", None), "--peft lora needs peft, which is not installed"),
}


def _output_dir(tmp_path, previous_model=None):
    """The run's --output_dir: a user's file in it, or a copy of ``previous_model`` (a run must leave it as it was)."""
    import shutil

    out = tmp_path / "out"
    if previous_model is not None:
        shutil.copytree(previous_model, out)
    else:
        out.mkdir()
        (out / "notes.txt").write_text("the user's file")
    return out


def _run_training(flags, files, tiny_task, tiny_encoder_dir, tmp_path, out) -> int:
    """Run train_dexml.py's entry point on the tiny task with ``flags`` changed (``{w}``: the input directory, where
    ``files`` are written); returns the exit status."""
    _, task_dir = tiny_task
    work = tmp_path / "in"
    work.mkdir()
    for name, content in files.items():
        os.makedirs(os.path.dirname(work / name), exist_ok=True)
        _write(work / name, content)
    args = {"--train_file": f"{task_dir}/trn.json.gz", "--test_file": f"{task_dir}/tst.json.gz", "--label_file": f"{task_dir}/lbl.json.gz",
            "--model_name_or_path": tiny_encoder_dir, "--output_dir": str(out), "--max_steps": "1", "--max_seq_length": "16",
            "--save_strategy": "no", "--report_to": "none", "--disable_tqdm": "true"}
    args.update({k: v.format(w=work) for k, v in flags.items()})
    if "--num_train_epochs" in flags:
        del args["--max_steps"]
    argv = [str(a) for kv in args.items() if kv[1] is not None for a in kv]
    try:
        return run_script(dexml.main, argv, prog="train_dexml.py")
    except SystemExit as exit_:  # argparse's own faults exit from inside the parser
        return exit_.code


@pytest.mark.parametrize("case", sorted(TRAIN_CASES) + sorted(TRAIN_ENV_CASES))
def test_training_script_refuses_bad_input(case, tiny_task, tiny_encoder_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths ('in/...') resolve against the test's directory
    if case in TRAIN_ENV_CASES:
        flags, change, fault = TRAIN_ENV_CASES[case]
        files = {}
        change(monkeypatch)
    else:
        files, flags, fault = TRAIN_CASES[case]
    out = _output_dir(tmp_path)
    before = _snapshot(out)
    status = _run_training(flags, files, tiny_task, tiny_encoder_dir, tmp_path, out)
    err = capsys.readouterr().err
    assert status == 2, err
    line = _one_line(err, "train_dexml.py" if "error:" not in fault else "")
    assert fault.format(w=tmp_path / "in") in line, line
    assert _snapshot(out) == before


# a full disk while saving: safetensors' native error (raised as the weights are written) and a plain OSError
DISK_FULL = {
    "safetensors": lambda: SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'),
    "oserror": lambda: OSError(errno.ENOSPC, "No space left on device"),
}


def _full_disk(monkeypatch, kind):
    import transformers.modeling_utils

    def save_file(*args, **kwargs):
        raise DISK_FULL[kind]()

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save_file)


def test_full_disk_in_training_is_one_line_and_keeps_the_previous_model(model_dir, tiny_task, tiny_encoder_dir, tmp_path, capsys, monkeypatch):
    """The final save of a run (over a finished model) meets a full disk: one line naming the directory and the space
    the save needs, exit 2, the previous model as it was (saves are staged beside the target)."""
    out = _output_dir(tmp_path, previous_model=model_dir)
    before = _snapshot(out)
    _full_disk(monkeypatch, "safetensors")
    status = _run_training({"--overwrite_output_dir": "true", "--max_steps": "0"}, {}, tiny_task, tiny_encoder_dir, tmp_path, out)
    line = _one_line(capsys.readouterr().err, "train_dexml.py")
    assert status == 2
    assert f"{out}: no space left on device while saving the model (about " in line and " needed, " in line and " free there)" in line, line
    assert _snapshot(out) == before


# ------------------------------------------------------------------------------------------------ hf-xmc
@pytest.fixture(scope="module")
def model_dir(tiny_task, tiny_encoder_dir, tmp_path_factory):
    """A saved (untrained) DEXML model with the tiny task's labels."""
    data = tiny_task[0]
    torch.manual_seed(0)
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, max_seq_length=16, label_max_seq_length=16)
    model.build_label_index(data.label_texts, data.label_uids)
    out = tmp_path_factory.mktemp("cli-model") / "dexml"
    model.save_pretrained(out)
    return str(out)


def _broken_copy(model_dir, work, name, content):
    import shutil

    broken = work / "broken"
    shutil.copytree(model_dir, broken)
    _write(broken / name, content(open(os.path.join(model_dir, name), "rb").read()) if callable(content) else content)
    return str(broken)


# id: (command line with {m} = model, {w} = work dir, {t} = task dir, files to write, the fault's words)
CLI_CASES = {
    "predict_k_negative": (["predict", "{m}", "--text", "x", "--k", "-1"], {}, "--k must be at least 1, got -1"),
    "predict_flag_unknown": (["predict", "{m}", "--text", "x", "--top", "3"], {}, "hf-xmc: error: unrecognized arguments: --top 3"),
    "predict_no_input": (["predict", "{m}"], {}, "give --text, --input_file or --image"),
    "predict_input_line_not_json": (["predict", "{m}", "--input_file", "{w}/q.json"], {"q.json": '{"title": "a"}\n{oops\n'}, "{w}/q.json, line 2: malformed JSON"),
    "predict_input_title_missing": (["predict", "{m}", "--input_file", "{w}/q.json"], {"q.json": '{"title": "a"}\n{"content": "b"}\n'}, "{w}/q.json, line 2: missing field 'title'"),
    "predict_input_missing": (["predict", "{m}", "--input_file", "{w}/absent.txt"], {}, "{w}/absent.txt"),
    "predict_image_on_text_model": (["predict", "{m}", "--image", "{w}/a.png"], {"a.png": b"\x89PNG"}, "--image needs a MUFIN model"),
    "predict_image_missing": (["predict", "{m}", "--image", "{w}/absent.png"], {}, "{w}/absent.png"),
    "model_dir_missing": (["predict", "{w}/no-model", "--text", "x"], {}, "no such model directory"),
    "model_dir_empty": (["predict", "{w}", "--text", "x"], {}, "cannot load a model"),
    "model_weights_truncated": (["predict", "BROKEN:model.safetensors", "--text", "x"], {}, "not valid safetensors"),
    "model_config_not_json": (["predict", "BROKEN:config.json", "--text", "x"], {}, "config.json"),
    "model_labels_truncated": (["predict", "BROKEN:labels.jsonl", "--text", "x"], {}, "labels.jsonl"),
    "evaluate_test_target_out_of_range": (["evaluate", "{m}", "--test_file", "{w}/t.json.gz"], {"t.json.gz": '{"uid": "a", "title": "w", "target_ind": [0, 4000]}\n'}, "{w}/t.json.gz, line 1: label id 4000 out of range"),
    "evaluate_filter_malformed": (["evaluate", "{m}", "--test_file", "{t}/tst.json.gz", "--test_filter_file", "{w}/f.txt"], {"f.txt": "0\n"}, "{w}/f.txt, line 1: malformed line '0'"),
    "add_labels_uid_taken": (["add-labels", "{m}", "{w}/l.json.gz", "--output_dir", "{w}/grown"], {"l.json.gz": '{"uid": "TAKEN", "title": "x"}\n'}, "'TAKEN' is taken"),
    "add_labels_unknown_uid": (["add-labels", "{m}", "--remove", "nope", "--output_dir", "{w}/grown"], {}, "no label has uid 'nope'"),
    # flag values refused before the model loads
    "predict_batch_size_zero": (["predict", "{m}", "--text", "x", "--batch_size", "0"], {}, "--batch_size must be at least 1, got 0"),
    "predict_batch_size_negative": (["predict", "{m}", "--text", "x", "--batch_size", "-1"], {}, "--batch_size must be at least 1, got -1"),
    "evaluate_batch_size_zero": (["evaluate", "{m}", "--test_file", "{t}/tst.json.gz", "--batch_size", "0"], {}, "--batch_size must be at least 1, got 0"),
    "predict_output_file_is_a_directory": (["predict", "{m}", "--text", "x", "--output_file", "{w}"], {}, "{w}: --output_file is a directory"),
    "evaluate_output_file_is_a_directory": (["evaluate", "{m}", "--test_file", "{t}/tst.json.gz", "--output_file", "{w}"], {}, "{w}: --output_file is a directory"),
    "predict_input_is_a_directory": (["predict", "{m}", "--input_file", "{w}"], {}, "{w}: is a directory, not a file (--input_file)"),
    "predict_device_absent": (["predict", "{m}", "--text", "x", "--device", "cuda:64"], {}, "--device cuda:64: torch sees"),  # no GPU, or not 65
    "predict_flag_abbreviated": (["predict", "{m}", "--tex", "x"], {}, "hf-xmc: error: unrecognized arguments: --tex x"),  # not --text
    "model_path_local_typo": (["predict", "in/no-model", "--text", "x"], {}, "in/no-model: no such model directory"),  # 'in' is local: no Hub retries
    "add_labels_output_dir_is_a_file": (["add-labels", "{m}", "{w}/l.json.gz", "--output_dir", "{w}/f.txt"], {"l.json.gz": '{"uid": "new", "title": "x"}\n', "f.txt": "x"}, "{w}/f.txt: --output_dir is a file"),
    "add_labels_blank_text": (["add-labels", "{m}", "{w}/l.json.gz", "--output_dir", "{w}/grown"], {"l.json.gz": '{"uid": "n1", "title": "ok"}\n\n{"uid": "n2", "title": " "}\n'}, "{w}/l.json.gz, line 3: blank label text"),
    # a failing push writes nothing into the model directory (which has no card: the push would build one)
    "push_repo_id_invalid": (["push", "{m}", "not a/valid id"], {}, "not a/valid id: not a valid Hub repo id"),
    "push_dry_run_repo_id_invalid": (["push", "{m}", "org/bad..name", "--dry_run"], {}, "org/bad..name: not a valid Hub repo id"),
}
BROKEN = {
    "model.safetensors": lambda data: data[:5],
    "config.json": lambda data: data[: len(data) // 2],
    "labels.jsonl": lambda data: b"\n".join(data.splitlines()[:3]) + b"\n",
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_hf_xmc_refuses_bad_input(case, model_dir, tiny_task, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths ('in/...') resolve against the test's directory
    assert not os.path.exists(os.path.join(model_dir, "README.md"))  # so a push would build a card: it must not land here
    argv, files, fault = CLI_CASES[case]
    work = tmp_path / "in"
    work.mkdir()
    for name, content in files.items():
        if name == "l.json.gz":
            first_uid = json.loads(open(os.path.join(model_dir, "labels.jsonl")).readline())["uid"]
            content = content.replace("TAKEN", first_uid)
            fault = fault.replace("TAKEN", first_uid)
        _write(work / name, content)
    model = model_dir
    if argv[1].startswith("BROKEN:"):
        name = argv[1].split(":", 1)[1]
        model = _broken_copy(model_dir, tmp_path, name, BROKEN[name])
    fill = {"m": model, "w": str(work), "t": tiny_task[1]}
    argv = [model if a.startswith("BROKEN:") else a.format(**fill) for a in argv]
    before = _snapshot(model_dir), _snapshot(work)
    try:
        status = cli.main(argv)
    except SystemExit as exit_:  # argparse's own faults exit from inside the parser
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2, err
    line = _one_line(err, "hf-xmc")
    assert fault.format(**fill) in line, line
    assert (_snapshot(model_dir), _snapshot(work)) == before  # the model and the inputs untouched, nothing written


# ------------------------------------------------------------------------------------------------ handled, not refused
def _records(stdout: str) -> list[dict]:
    lines = stdout.splitlines()  # what a splitlines() reader sees: one record per line
    return [json.loads(line) for line in lines]


def _spy_k(monkeypatch) -> list:
    """The ``k`` each loaded model's predict is called with (the CLI must clamp it before anything is allocated)."""
    seen, load = [], cli.load_model

    def load_model(path):
        model = load(path)
        predict = model.predict
        model.predict = lambda *args, k=None, **kwargs: seen.append(k) or predict(*args, k=k, **kwargs)
        return model

    monkeypatch.setattr(cli, "load_model", load_model)
    return seen


def _repeated_uid_model(model_dir, work) -> str:
    """A copy of the model whose second label carries the first label's uid (training accepts repeats, with a warning)."""
    import shutil

    copy = work / "repeated"
    shutil.copytree(model_dir, copy)
    rows = [json.loads(line) for line in (copy / "labels.jsonl").read_text().splitlines()]
    rows[1]["uid"] = rows[0]["uid"]
    (copy / "labels.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(copy)


def _check_k_clamped(out, seen, fill):
    (record,) = _records(out)
    assert len(record["labels"]) == 40 and seen == [40], (len(record["labels"]), seen)  # every label, no (1, 10^7) arrays


def _check_removed_exactly(out, seen, fill):
    report = json.loads(out)
    assert (report["labels"], report["removed"], report["removed_uids"]) == (38, 2, {fill["uid"]: 2}), report


# id: (command line, standard input, setup, check(stdout, spy, fill)): faults the commands handle, exit status 0
HANDLED_CASES = {
    "predict_k_beyond_label_count": (["predict", "{m}", "--text", "w0", "--k", "10000000"], None, _spy_k, _check_k_clamped),
    "predict_input_stdin_dash": (["predict", "{m}", "--input_file", "-"], "w0 w1\n\nw2\n", None,
                                 lambda out, seen, fill: [r["text"] for r in _records(out)] == ["w0 w1", "w2"] or pytest.fail(out)),
    "predict_input_dev_stdin": (["predict", "{m}", "--input_file", "/dev/stdin"], "w3\n", None,
                                lambda out, seen, fill: [r["text"] for r in _records(out)] == ["w3"] or pytest.fail(out)),
    "predict_text_with_line_separators": (["predict", "{m}", "--text", "a\u2028b\u2029c\x85d", "--k", "1"], None, None,
                                          lambda out, seen, fill: [r["text"] for r in _records(out)] == ["a\u2028b\u2029c\x85d"] or pytest.fail(out)),
    "add_labels_remove_repeated_uid": (["add-labels", "REPEATED", "--remove", "{uid}", "--output_dir", "{w}/grown"], None, None, _check_removed_exactly),
}


@pytest.mark.parametrize("case", sorted(HANDLED_CASES))
def test_hf_xmc_handles(case, model_dir, tmp_path, capsys, monkeypatch):
    argv, stdin, setup, check = HANDLED_CASES[case]
    work = tmp_path / "in"
    work.mkdir()
    fill = {"m": model_dir, "w": str(work), "uid": json.loads(open(os.path.join(model_dir, "labels.jsonl")).readline())["uid"]}
    argv = [_repeated_uid_model(model_dir, work) if a == "REPEATED" else a.format(**fill) for a in argv]
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    seen = setup(monkeypatch) if setup else None
    before = _snapshot(model_dir)
    status = cli.main(argv)
    captured = capsys.readouterr()
    assert status == 0, captured.err
    check(captured.out, seen, fill)
    assert _snapshot(model_dir) == before


def test_full_disk_in_add_labels_is_one_line_and_keeps_the_model(model_dir, tmp_path, capsys, monkeypatch):
    """add-labels saves in place over the model and meets a full disk: one line naming it, the model as it was."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    before = _snapshot(model)
    _full_disk(monkeypatch, "oserror")
    status = cli.main(["add-labels", str(model), "--remove", json.loads((model / "labels.jsonl").read_text().splitlines()[0])["uid"]])
    line = _one_line(capsys.readouterr().err, "hf-xmc add-labels")
    assert status == 2 and f"{model}: no space left on device while saving the model (about " in line, line
    assert _snapshot(model) == before


def test_predict_of_no_text_is_an_empty_prediction(model_dir):
    """``model.predict([])`` answers like ``pipeline([])``: nothing to rank, an empty prediction (not an error)."""
    from transformers import pipeline

    model = DEXMLModel.from_pretrained(model_dir)
    pred = model.predict([], k=3)
    assert pred.label_ids.shape == pred.scores.shape == (0, 3) and pred.label_texts == []
    assert pipeline(model=model_dir, trust_remote_code=True)([]) == []


# ------------------------------------------------------------------------------------------------ readers
READER_CASES = {
    "bow_header_missing": (read_bow, "b.txt", "", "b.txt, line 1: bad header: file is empty"),
    "bow_header_not_numbers": (read_bow, "b.txt", "3 x 2\n", "b.txt, line 1: bad header '3 x 2'"),
    "bow_pair_malformed": (read_bow, "b.txt", "1 4 2\n0 1:0.5 2\n", "b.txt, line 2: malformed pair '2' (expected 'index:value')"),
    "bow_feature_out_of_range": (read_bow, "b.txt", "1 4 2\n0 9:0.5\n", "b.txt, line 2:"),
    "bow_label_out_of_range": (read_bow, "b.txt", "1 4 2\n5 1:0.5\n", "b.txt, line 2:"),
    "sparse_matrix_rows_short": (read_sparse_matrix, "m.txt", "3 4\n0:1\n", "m.txt"),
    "image_missing": (load_image, "absent.png", None, "absent.png: image file not found"),
    "image_not_an_image": (load_image, "i.png", b"\x89PNG\r\n\x1a\n not really", "i.png: cannot read image"),
    "image_truncated": (load_image, "t.png", "TRUNCATED_PNG", "t.png: cannot read image"),
}


@pytest.mark.parametrize("case", sorted(READER_CASES))
def test_readers_name_the_file_and_line(case, tmp_path):
    reader, name, content, fault = READER_CASES[case]
    if content == "TRUNCATED_PNG":
        from PIL import Image

        Image.new("RGB", (64, 64), "red").save(tmp_path / name)
        data = (tmp_path / name).read_bytes()
        content = data[: len(data) // 2]
    if content is not None:
        _write(tmp_path / name, content)
    with pytest.raises(XMCDataError) as info:
        reader(str(tmp_path / name))
    assert f"{tmp_path}/{fault}" in str(info.value), str(info.value)


def test_image_decompression_bomb_is_refused(tmp_path, monkeypatch):
    """An image whose pixel count passes PIL's bomb limit (here lowered to 10K pixels) is refused by name, not decoded."""
    from PIL import Image

    Image.new("RGB", (300, 300), "red").save(tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000 // 2)
    with pytest.raises(XMCDataError, match="big.png: cannot read image"):
        load_image(str(tmp_path / "big.png"))


# + the decompression bomb, the two full disks and predict([])
BAD_INPUT_KINDS = len(TRAIN_CASES) + len(TRAIN_ENV_CASES) + len(CLI_CASES) + len(HANDLED_CASES) + len(READER_CASES) + 1 + 2 + 1
