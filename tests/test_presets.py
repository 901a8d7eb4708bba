"""Recipe presets (``--preset <dataset>``): values land in the parsed arguments, explicit flags and JSON keys win,
unknown names exit with one line, global batch sizes split over processes."""

import dataclasses
import importlib
import json

import pytest

from hf_xmc import cli
from hf_xmc.training import XMCTrainingArguments
from hf_xmc.training.presets import DATASETS, GPU_PRESETS, PRESETS, known_presets, preset_values
from hf_xmc.training.script_utils import parse_script_args

FILES = ["--train_file", "trn.json.gz", "--test_file", "tst.json.gz", "--label_file", "lbl.json.gz"]


def recipe_classes(method):
    """(model arguments, training arguments) dataclasses of ``method``'s recipe."""
    module = importlib.import_module(f"hf_xmc.training.recipes.{method}")
    prefix = {"prime": "PRIME", "dexml": "DEXML", "unidec": "UniDEC", "siamesexml": "SiameseXML"}[method]
    return getattr(module, f"{prefix}ModelArguments"), getattr(module, f"{prefix}TrainingArguments")


def parse(method, *argv, tmp_path):
    model_cls, train_cls = recipe_classes(method)
    return parse_script_args(model_cls, train_cls, [*FILES, "--output_dir", str(tmp_path), *argv], method=method)


@pytest.mark.parametrize("method", sorted(set(PRESETS) | set(GPU_PRESETS)))
def test_every_preset_parses_and_every_value_lands(method, tmp_path):
    assert known_presets(method) and set(known_presets(method)) <= set(DATASETS) | {"gpu"}
    assert known_presets(method)[-1] == "gpu"  # every text method has the one-GPU budget, named last
    for name in known_presets(method):
        encoder = ["--model_name_or_path", "local/encoder"] if name == "gpu" else []  # a budget names no encoder
        parsed = parse(method, "--preset", name, *encoder, tmp_path=tmp_path)
        fields = {f.name: getattr(obj, f.name) for obj in parsed for f in dataclasses.fields(obj)}
        for key, value in preset_values(method, name, world_size=1).items():
            got = fields[key]  # a KeyError here is a preset key that is no argument of the recipe
            got = getattr(got, "value", got)  # enums (lr_scheduler_type)
            assert got == value, (method, name, key, got, value)
        assert fields["preset"] == name


def test_paper_values_of_the_issue_dataset(tmp_path):
    m, d, t = parse("prime", "--preset", "lf-amazontitles-1.3m", tmp_path=tmp_path)
    assert (m.num_free_vectors, t.per_device_train_batch_size, t.num_train_epochs, t.learning_rate) == (131072, 3200, 300, 3e-4)
    assert d.max_seq_length == 32 and (d.propensity_a, d.propensity_b) == (0.6, 2.6)
    assert t.warmup_steps == 100 and t.get_warmup_steps(10_000) == 100  # 100 steps, not a fraction
    assert t.cluster_init_size == 4 and t.cluster_curriculum_epochs == [10, 25, 50, 75, 100, 125, 150, 200]
    assert t.cluster_refresh_interval == 5 and t.cluster_batch_mode == "concat"
    m, d, t = parse("unidec", "--preset", "lf-amazontitles-1.3m", tmp_path=tmp_path)
    assert (m.projection_dim, t.per_device_train_batch_size, t.max_label_pool) == (256, 1098, 3000)
    assert t.cluster_batch_mode == "one_per_batch" and t.hard_negatives == 6 and t.hard_negative_top_k == 30
    m, d, t = parse("dexml", "--preset", "lf-amazontitles-1.3m", tmp_path=tmp_path)
    assert (t.per_device_train_batch_size, t.learning_rate, m.temperature, m.normalize) == (8192, 8e-4, 1.0, False)
    assert t.label_pool == "all" and t.gradient_cache_chunk_size == 1024 and m.pooling == "cls"
    # every label is a negative already: DEXML's default mined negative and cluster batching are dropped
    assert t.hard_negatives == 0 and not t.cluster_batching
    every = XMCTrainingArguments(output_dir=str(tmp_path), label_pool="all", hard_negatives=2, cluster_batching=True)  # any recipe
    assert every.hard_negatives == 0 and not every.cluster_batching
    m, d, t = parse("dexml", "--model_name_or_path", "local/encoder", tmp_path=tmp_path)  # the recipe's own defaults
    assert (t.label_pool, t.hard_negatives, t.hard_negative_top_k, t.hard_negative_start_epoch, t.hard_negative_refresh_interval) == ("in_batch", 1, 100, 0.05, 1.0)
    assert (t.cluster_batching, t.cluster_min_labels, t.cluster_start_epoch, t.cluster_init_size, t.cluster_curriculum_epochs,
            t.cluster_refresh_interval) == (True, 10_000, 0.05, 16, [], 1)


def test_explicit_flags_beat_the_preset(tmp_path):
    m, d, t = parse("prime", "--learning_rate", "1e-3", "--preset", "lf-wikipedia-500k", "--max_seq_length", "64",
                    "--num_free_vectors", "1024", "--model_name_or_path", "local/encoder", tmp_path=tmp_path)
    assert (t.learning_rate, d.max_seq_length, m.num_free_vectors, m.model_name_or_path) == (1e-3, 64, 1024, "local/encoder")
    assert t.num_train_epochs == 50 and t.per_device_train_batch_size == 512  # the rest of the preset still applies
    m, d, t = parse("unidec", "--preset=lf-amazon-131k", "--cluster_batch_mode", "concat", "--use_classifier", "false", tmp_path=tmp_path)
    assert t.cluster_batch_mode == "concat" and m.use_classifier is False and t.per_device_train_batch_size == 576
    # without a preset the recipe defaults hold, and the encoder is required again
    m, d, t = parse("prime", "--model_name_or_path", "enc", tmp_path=tmp_path)
    assert d.preset is None and t.per_device_train_batch_size == 64 and m.num_free_vectors is None
    with pytest.raises(SystemExit):
        parse("prime", tmp_path=tmp_path)


def test_json_config_with_a_preset(tmp_path):
    model_cls, train_cls = recipe_classes("unidec")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"preset": "lf-wikiseealso-320k", "train_file": "trn.json.gz", "test_file": "tst.json.gz",
                                  "label_file": "lbl.json.gz", "output_dir": str(tmp_path / "out"), "max_label_pool": 1000}))
    m, d, t = parse_script_args(model_cls, train_cls, [str(config)], method="unidec")
    assert d.preset == "lf-wikiseealso-320k" and d.text_fields == "title,content" and d.max_seq_length == 256
    assert t.per_device_train_batch_size == 677 and t.max_label_pool == 1000  # the file's own key wins
    assert m.model_name_or_path == "sentence-transformers/msmarco-distilbert-base-v4"
    config.write_text(json.dumps({"preset": "nope", "output_dir": "x"}))
    with pytest.raises(SystemExit) as exit_info:
        parse_script_args(model_cls, train_cls, [str(config)], method="unidec")
    assert exit_info.value.code == 2


@pytest.mark.parametrize("name", ["nope", "list"])
def test_unknown_preset_or_list_exits_2_with_one_line(name, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse("dexml", "--preset", name, tmp_path=tmp_path)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lf-amazontitles-131k, lf-wikipedia-500k, lf-amazontitles-1.3m" in err[0]
    assert ("unknown preset 'nope'" in err[0]) == (name == "nope")


def test_hf_xmc_train_passes_the_preset_to_the_recipe(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "prime", "--preset", "lf-amazontitles-13m", "--output_dir", "x"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hf-xmc train prime: error: --preset") and "lf-amazontitles-1.3m" in err[0]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "mufin", "--preset", "lf-amazontitles-1.3m", "--output_dir", "x"])
    assert exit_info.value.code == 2 and "for mufin: none" in capsys.readouterr().err


def test_global_batches_split_over_processes(monkeypatch):
    assert preset_values("unidec", "lf-amazontitles-1.3m", world_size=2)["per_device_train_batch_size"] == 549
    assert preset_values("unidec", "lf-amazontitles-1.3m", world_size=2)["max_label_pool"] == 1500
    monkeypatch.setenv("WORLD_SIZE", "16")
    values = preset_values("dexml", "lf-amazontitles-1.3m")
    assert values["per_device_train_batch_size"] == 512 and values["gradient_cache_chunk_size"] == 1024  # eta is per GPU
    with pytest.raises(KeyError, match="known: lf-amazontitles-131k"):
        preset_values("dexml", "lf-amazon-131k")


def test_gpu_preset_is_a_budget_on_the_recipes_defaults(tmp_path):
    """``--preset gpu`` changes the batch and the step budget only: the recipe's negatives, batching and encoder (no
    paper encoder is named) stay; the batch is per process, not split; explicit flags still win."""
    assert preset_values("unidec", "gpu", world_size=4) == preset_values("unidec", "gpu", world_size=1)
    m, d, t = parse("dexml", "--preset", "gpu", "--model_name_or_path", "local/encoder", tmp_path=tmp_path)
    assert (t.per_device_train_batch_size, t.max_steps, t.learning_rate, d.eval_batch_size) == (512, 1200, 4e-4, 1024)
    assert t.hard_negatives == 1 and t.cluster_batching and t.cluster_init_size == 16 and m.model_name_or_path == "local/encoder"
    assert "model_name_or_path" not in preset_values("dexml", "gpu") and "propensity_a" not in preset_values("dexml", "gpu")
    m, d, t = parse("siamesexml", "--preset", "gpu", "--model_name_or_path", "x", "--max_steps", "10", tmp_path=tmp_path)
    assert (t.per_device_train_batch_size, t.max_steps, t.classifier_batch_size) == (512, 10, 1024)
    m, d, t = parse("unidec", "--preset", "gpu", "--model_name_or_path", "x", tmp_path=tmp_path)
    assert (t.max_label_pool, t.hard_negative_top_k, t.cluster_batch_mode) == (1536, 100, "concat")


def test_the_scripts_default_propensity_constants_are_the_datasets():
    """Without --propensity_a / --propensity_b (and without a preset) PSP@k uses the XC repository's constants of the
    dataset's name (the train file's folder, or --dataset_name); one given flag wins over the name."""
    from hf_xmc.metrics import propensity_constants
    from hf_xmc.training.script_utils import XMCDataArguments

    def constants(path, **kwargs):
        args = XMCDataArguments(train_file=path, test_file=path, label_file=path, **kwargs)
        return args.propensity_a, args.propensity_b

    assert constants("/d/LF-AmazonTitles-131K/trn.json.gz") == (0.6, 2.6) == propensity_constants("LF-AmazonTitles-131K")
    assert constants("/d/LF-WikiTitles-500K/trn.json.gz") == (0.5, 0.4)
    assert constants("/d/LF-WikiSeeAlso-320K/trn.json.gz") == (0.55, 1.5)
    assert constants("/d/debtags/trn.json.gz") == (0.55, 1.5)
    assert constants("/d/LF-AmazonTitles-131K/trn.json.gz", propensity_a=0.3) == (0.3, 2.6)
