"""The quickstart flow (zero-shot vs trained, save, remote-code reload, examples) on Debtags with a tiny encoder."""

import json
import re

import pytest

from hf_xmc import quickstart


def test_quickstart_end_to_end(tiny_encoder_dir, tmp_path, capsys):
    out = tmp_path / "qs"
    args = quickstart.parse_args(["--encoder", tiny_encoder_dir, "--output_dir", str(out), "--num_train_epochs", "0.02",
                                  "--per_device_train_batch_size", "32", "--max_seq_length", "16", "--num_examples", "2"])
    result = quickstart.run(args)
    printed = capsys.readouterr().out
    assert "| metric | zero-shot MiniLM | DEXML (trained) |" in printed
    for metric in quickstart.SHOWN_METRICS:
        assert f"| {metric} |" in printed
    for key in ("test_P@1", "test_PSP@5", "test_R@100"):
        assert 0 <= result["zero_shot"][key] <= 100 and 0 <= result["trained"][key] <= 100
    assert result["train_runtime"] > 0 and result["predict_queries_per_second"] > 0
    saved = json.load(open(out / "quickstart_results.json"))
    assert saved["trained"] == result["trained"]
    # the examples come from the reloaded (remote-code) model: two titles with five tags each
    assert printed.count("(* = a true tag of the package)") == 1
    assert len(re.findall(r"^    [* ] +-?\d+\.\d{3}  \S", printed, flags=re.M)) == 10
    assert (out / "label_index.json").exists() and (out / "modeling_dexml.py").exists()
    # DEXML trains with train_dexml.py's negatives (its hard negatives), which the card lists
    assert re.search(r"\| hard_negatives \| [1-9]", (out / "README.md").read_text())


@pytest.mark.parametrize("method,name", [("prime", "PRIME"), ("unidec", "UniDEC")])
def test_quickstart_trains_other_methods(method, name, tiny_encoder_dir, tmp_path, capsys):
    out = tmp_path / f"qs-{method}"
    args = quickstart.parse_args(["--method", method, "--encoder", tiny_encoder_dir, "--output_dir", str(out), "--num_train_epochs",
                                  "0.02", "--per_device_train_batch_size", "32", "--max_seq_length", "16", "--num_examples", "1"])
    result = quickstart.run(args)
    printed = capsys.readouterr().out
    assert f"| metric | zero-shot MiniLM | {name} (trained) |" in printed
    assert json.load(open(out / "config.json"))["model_type"] == f"hf_xmc_{method}"
    assert (out / f"modeling_{method}.py").exists() and 0 <= result["trained"]["test_P@1"] <= 100
    assert quickstart.parse_args([]).output_dir == "outputs/quickstart-dexml-debtags"
