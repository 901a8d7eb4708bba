"""Bad data, beyond tests/test_bad_inputs.py: text that no tokenizer takes (lone surrogates), JSON the parser cannot
nest or whose integers Python cannot convert, data files per split in datasets' formats (parquet, csv, json lines)
and a ``--dataset_name`` whose files do not say which split they are. Same conventions: every case ends on one line
that names the file (and the line or row) and the fault, exit status 2, no traceback, the output directory as it was.
``BAD_DATA_KINDS`` counts them, as ``BAD_INPUT_KINDS`` counts the kinds of tests/test_bad_inputs.py.
"""

import io
import os

import pytest

from hf_xmc.data import XMCDataError
from hf_xmc.training.recipes import dexml
from hf_xmc.training.script_utils import run_script
from tests.test_bad_inputs import GOOD, _one_line, _snapshot, _write

DEEP = "[" * 100_000 + "]" * 100_000  # valid JSON that Python's parser cannot nest (RecursionError)


def _table(**columns) -> tuple:
    """A data file built when the case runs (pyarrow is imported lazily): ``("table", columns)``."""
    return ("table", columns)


def _content(name: str, content):
    """The bytes of a case's file: a table becomes parquet / csv by the file's extension."""
    if not (isinstance(content, tuple) and content[0] == "table"):
        return content
    import pyarrow as pa
    import pyarrow.csv as pa_csv
    import pyarrow.parquet as pq

    table = pa.table(content[1])
    out = io.BytesIO()
    if name.endswith(".csv"):
        pa_csv.write_csv(table, out)
    else:
        pq.write_table(table, out)
    return out.getvalue()


LABELS_40 = _table(uid=[f"l{i}" for i in range(40)], text=[f"w{i}" for i in range(40)])
POINTS = _table(uid=["a", "b"], text=["w0 w1", "w2"], labels=[[0, 1], [2]])

# id: (files to write {name: content}, flags to change (None drops one), the fault's words in the message)
DATA_CASES = {
    # item 7: a lone surrogate is valid JSON ("\ud800") but no character; the tokenizer would fail on it far from the file
    "train_title_lone_surrogate": ({"s.json.gz": GOOD + '{"uid": "x", "title": "a\\ud800b", "target_ind": [0]}\n'}, {"--train_file": "{w}/s.json.gz"},
                                   "{w}/s.json.gz, line 2: field 'title' holds an unpaired surrogate (\\ud800)"),
    "train_uid_lone_surrogate": ({"s.json.gz": GOOD + '{"uid": "x\\udfff", "title": "a", "target_ind": [0]}\n'}, {"--train_file": "{w}/s.json.gz"},
                                 "{w}/s.json.gz, line 2: field 'uid' holds an unpaired surrogate (\\udfff)"),
    "label_title_lone_surrogate": ({"l.json.gz": '{"uid": "l0", "title": "w0"}\n{"uid": "l1", "title": "\\udc00"}\n'}, {"--label_file": "{w}/l.json.gz"},
                                   "{w}/l.json.gz, line 2: field 'title' holds an unpaired surrogate (\\udc00)"),
    "test_title_lone_surrogate": ({"t.json.gz": GOOD + '{"uid": "x", "title": "\\ud800", "target_ind": [0]}\n'}, {"--test_file": "{w}/t.json.gz"},
                                  "{w}/t.json.gz, line 2: field 'title' holds an unpaired surrogate (\\ud800)"),
    "validation_title_lone_surrogate": ({"v.json.gz": '{"uid": "x", "title": "\\udbff", "target_ind": [0]}\n'}, {"--validation_file": "{w}/v.json.gz"},
                                        "{w}/v.json.gz, line 1: field 'title' holds an unpaired surrogate (\\udbff)"),
    # item 9: what Python's json and int() raise beyond their limits, with the file and the line
    "train_targets_nested_too_deep": ({"n.json.gz": GOOD + '{"uid": "x", "title": "a", "target_ind": ' + DEEP + "}\n"}, {"--train_file": "{w}/n.json.gz"},
                                      "{w}/n.json.gz, line 2: malformed JSON (nested too deep)"),
    "train_target_id_5000_digits": ({"d.json.gz": GOOD + '{"uid": "x", "title": "a", "target_ind": [' + "9" * 5000 + "]}\n"}, {"--train_file": "{w}/d.json.gz"},
                                    "{w}/d.json.gz, line 2: label id with 5,000 digits out of range"),
    "test_target_id_beyond_int64": ({"e.json.gz": '{"uid": "x", "title": "a", "target_ind": [' + "9" * 30 + "]}\n"}, {"--test_file": "{w}/e.json.gz"},
                                    "{w}/e.json.gz, line 1: label id 9999999999... (30 digits) out of range (num_labels=40)"),
    # data files per split in datasets' formats, and --dataset_name files that do not say their split
    "dataset_one_file_for_two_splits": ({"all.parquet": POINTS, "lbl.parquet": LABELS_40},
                                        {"--train_file": None, "--test_file": None, "--label_file": None, "--dataset_name": "{w}/all.parquet",
                                         "--label_dataset_name": "{w}/lbl.parquet"},
                                        "{w}/all.parquet: no file for split 'train'"),
    "dataset_file_named_for_two_splits": ({"train_test.parquet": POINTS, "labels.parquet": LABELS_40},
                                          {"--train_file": None, "--test_file": None, "--label_file": None,
                                           "--dataset_name": "{w}/train_test.parquet,{w}/labels.parquet"},
                                          "{w}/train_test.parquet is named for split 'train' and for 'test'"),
    "train_parquet_label_out_of_range": ({"p.parquet": _table(uid=["a"], text=["w0"], labels=[[999]])}, {"--train_file": "{w}/p.parquet"},
                                         "{w}/p.parquet: row 0 (uid 'a'): label id 999 out of range [0, 40)"),
    "train_csv_labels_not_ids": ({"c.csv": _table(text=["w0"], labels=["x y"])}, {"--train_file": "{w}/c.csv"},
                                 "{w}/c.csv: row 0: column 'labels' holds 'x y', not label ids"),
    "train_parquet_not_parquet": ({"g.parquet": b"PAR1 not really"}, {"--train_file": "{w}/g.parquet"}, "{w}/g.parquet: cannot read it as parquet"),
    "label_parquet_without_text_column": ({"l.parquet": _table(name=["w0"])}, {"--label_file": "{w}/l.parquet"},
                                          "{w}/l.parquet: no column 'text'"),
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_training_script_refuses_bad_data(case, tiny_task, tiny_encoder_dir, tmp_path, capsys):
    files, flags, fault = DATA_CASES[case]
    task_dir = tiny_task[1]
    work = tmp_path / "in"
    work.mkdir()
    for name, content in files.items():
        _write(work / name, _content(name, content))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's file")
    args = {"--train_file": f"{task_dir}/trn.json.gz", "--test_file": f"{task_dir}/tst.json.gz", "--label_file": f"{task_dir}/lbl.json.gz",
            "--model_name_or_path": tiny_encoder_dir, "--output_dir": str(out), "--max_steps": "1", "--max_seq_length": "16",
            "--save_strategy": "no", "--report_to": "none", "--disable_tqdm": "true"}
    args.update({k: v.format(w=work) if v is not None else None for k, v in flags.items()})
    argv = [str(a) for k, v in args.items() if v is not None for a in (k, v)]
    before = _snapshot(out)
    status = run_script(dexml.main, argv, prog="train_dexml.py")
    err = capsys.readouterr().err
    assert status == 2, err
    line = _one_line(err, "train_dexml.py")
    assert fault.format(w=work) in line, line
    assert _snapshot(out) == before


def test_predict_input_file_refuses_a_lone_surrogate(tmp_path):
    """``hf-xmc predict --input_file`` reads JSON lines with the same parser: the query's line is named, not the
    tokenizer's TypeError."""
    from hf_xmc.cli import read_queries

    path = _write(tmp_path / "q.jsonl", '{"title": "fine"}\n{"title": "bad \\ud800"}\n')
    with pytest.raises(XMCDataError, match=r"q.jsonl, line 2: field 'title' holds an unpaired surrogate \(\\ud800\)"):
        read_queries(path)
    assert read_queries(_write(tmp_path / "ok.jsonl", '{"title": "an emoji \\ud83d\\ude00"}\n')) == ["an emoji \U0001F600"]  # a pair is a character


def test_a_failing_final_evaluation_keeps_the_trained_model(tiny_task, tiny_encoder_dir, tmp_path, monkeypatch):
    """Training finished, then the test evaluation failed: the trained model is saved before the error comes out."""
    from hf_xmc.training.trainer import XMCTrainer

    task_dir = tiny_task[1]
    out = tmp_path / "out"

    def broken_evaluate(self, *args, **kwargs):
        if kwargs.get("metric_key_prefix") == "test":
            raise RuntimeError("the evaluation broke")
        return original(self, *args, **kwargs)

    original = XMCTrainer.evaluate
    monkeypatch.setattr(XMCTrainer, "evaluate", broken_evaluate)
    argv = ["--train_file", f"{task_dir}/trn.json.gz", "--test_file", f"{task_dir}/tst.json.gz", "--label_file", f"{task_dir}/lbl.json.gz",
            "--model_name_or_path", tiny_encoder_dir, "--output_dir", str(out), "--max_steps", "0", "--max_seq_length", "16",
            "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true"]  # 0 steps: the same path, less time
    with pytest.raises(RuntimeError, match="the evaluation broke"):
        dexml.main(argv)
    saved = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "labels.jsonl"} <= saved, saved
    assert "eval_results.json" not in saved  # no results were made up


BAD_DATA_KINDS = len(DATA_CASES) + 2  # + the predict input's surrogate, + the evaluation that fails after training
