"""Training from ``datasets``: the XC task as a DatasetDict (train / test / labels) round-trips through
``save_to_disk`` and data files, trains to the same metrics as the XC files with the same seed, takes labels from a
second dataset, turns ``datasets.Image()`` bytes into image files, and names a Hub dataset on the card."""

import dataclasses
import io
import json
import os

import numpy as np
import pytest

from hf_xmc.data import load_hf_xc_data, xc_data_to_hf_dataset_dict
from hf_xmc.training.script_utils import XMCDataArguments, card_dataset_name, hub_dataset_id, load_data

datasets = pytest.importorskip("datasets")


def assert_same_task(a, b):
    for split in ("train", "test"):
        x, y = getattr(a, split), getattr(b, split)
        assert x.texts == y.texts and x.uids == y.uids
        assert (x.targets != y.targets).nnz == 0 and x.targets.shape == y.targets.shape
    assert list(a.label_texts) == list(b.label_texts) and list(a.label_uids) == list(b.label_uids)


def test_dataset_dict_round_trips_through_disk_and_files(tiny_task, tmp_path):
    data = tiny_task[0]
    dd = xc_data_to_hf_dataset_dict(data)
    assert set(dd) == {"train", "test", "labels"}
    dd.save_to_disk(str(tmp_path / "saved"))
    assert_same_task(load_hf_xc_data(str(tmp_path / "saved")), data)
    # data files, read with datasets.load_dataset (parquet here; json and csv the same way)
    for split in dd:
        dd[split].to_parquet(str(tmp_path / f"{split}.parquet"))
    from_files = load_hf_xc_data(
        str(tmp_path / "train.parquet"), train_files=str(tmp_path / "train.parquet"), test_files=str(tmp_path / "test.parquet"),
        label_dataset_name=str(tmp_path / "labels.parquet"), label_split="train",
    )
    assert_same_task(from_files, data)


def test_parquet_files_go_to_their_own_splits(tiny_task, tmp_path):
    """``train.parquet,test.parquet`` (and a folder of train / test / labels files) give each split its own file's rows:
    the test points never reach training (before, every split read every file). A file that names no split, or two,
    is refused instead of being read as both."""
    data = tiny_task[0]
    dd = xc_data_to_hf_dataset_dict(data)
    folder = tmp_path / "task"
    folder.mkdir()
    for split in dd:
        dd[split].to_parquet(str(folder / f"{split}.parquet"))
    listed = load_hf_xc_data(f"{folder}/train.parquet,{folder}/test.parquet", label_dataset_name=str(folder / "labels.parquet"))
    whole_folder = load_hf_xc_data(str(folder))
    for loaded in (listed, whole_folder):
        assert_same_task(loaded, data)
        assert not set(loaded.train.uids) & set(loaded.test.uids)  # disjoint: train rows != test rows
    with pytest.raises(ValueError, match="train.parquet: no file for split 'test'"):
        load_hf_xc_data(str(folder / "train.parquet"), label_dataset_name=str(folder / "labels.parquet"))
    os.rename(folder / "test.parquet", folder / "train-and-test.parquet")
    with pytest.raises(ValueError, match="train-and-test.parquet is named for split 'train' and for 'test'"):
        load_hf_xc_data(str(folder))


def test_split_files_in_datasets_formats(tiny_task, tmp_path):
    """--train_file / --validation_file / --test_file / --label_file take csv, json lines, parquet (and XC raw files
    beside them), one file per split, as transformers' example scripts do."""
    data, task_dir = tiny_task
    dd = xc_data_to_hf_dataset_dict(data)
    dd["train"].to_csv(str(tmp_path / "train.csv"), index=False)  # labels as "[23 25 35]" strings: CSV has no lists
    dd["test"].to_json(str(tmp_path / "test.jsonl"))  # a json lines file with text / labels, not XC raw fields
    dd["labels"].to_parquet(str(tmp_path / "labels.parquet"))
    args = XMCDataArguments(train_file=str(tmp_path / "train.csv"), test_file=str(tmp_path / "test.jsonl"), label_file=str(tmp_path / "labels.parquet"))
    assert_same_task(load_data(args), data)
    mixed = load_data(dataclasses.replace(args, train_file=f"{task_dir}/trn.json.gz", validation_file=str(tmp_path / "test.jsonl")))
    assert mixed.train.uids == data.train.uids and mixed.validation.uids == data.test.uids


def test_labels_from_a_second_dataset_and_column_names(tiny_task, tmp_path):
    data = tiny_task[0]
    dd = xc_data_to_hf_dataset_dict(data)
    points = datasets.DatasetDict({s: dd[s].rename_columns({"text": "title", "labels": "tags"}) for s in ("train", "test")})
    points.save_to_disk(str(tmp_path / "points"))
    datasets.DatasetDict({"all": dd["labels"].rename_column("text", "name")}).save_to_disk(str(tmp_path / "labels"))
    args = XMCDataArguments(
        dataset_name=str(tmp_path / "points"), label_dataset_name=str(tmp_path / "labels"), label_split="all",
        text_column="title", label_column="tags", label_text_column="name",
    )
    assert_same_task(load_data(args), data)
    assert card_dataset_name(args) == "points" and hub_dataset_id(args) is None
    with pytest.raises(ValueError, match="no split 'valid' \\(splits: train, test\\)"):
        load_data(dataclasses.replace(args, test_split="valid"))
    with pytest.raises(ValueError, match="no data: give --train_file"):
        load_data(XMCDataArguments())
    with pytest.raises(ValueError, match="--label_file missing"):
        load_data(XMCDataArguments(train_file="a", test_file="b"))


def test_unlabelled_points_are_read_like_the_xc_readers(tiny_task, tmp_path):
    """Unlabelled test points are kept (they score 0, as pyxclib counts them) unless skip_unlabeled_test_points;
    unlabelled training points are skipped."""
    data = tiny_task[0]
    dd = xc_data_to_hf_dataset_dict(data)
    test = dd["test"].to_list()
    test[1]["labels"] = []
    dd["test"] = datasets.Dataset.from_list(test, features=dd["test"].features)
    dd.save_to_disk(str(tmp_path / "d"))
    kept = load_hf_xc_data(str(tmp_path / "d"))
    assert len(kept.test) == len(data.test) and kept.test.num_skipped == 0 and kept.test.targets[1].nnz == 0
    loaded = load_hf_xc_data(str(tmp_path / "d"), skip_unlabeled_test_points=True)
    assert len(loaded.test) == len(data.test) - 1 and loaded.test.num_skipped == 1
    assert loaded.test.record_indices()[:3].tolist() == [0, 2, 3]  # a filter file's point_idx still means the split's row
    train = dd["train"].to_list()
    for row in train:
        row["labels"] = []
    dd["train"] = datasets.Dataset.from_list(train, features=dd["train"].features)
    dd.save_to_disk(str(tmp_path / "e"))
    with pytest.raises(ValueError, match="no training point has a label"):
        load_hf_xc_data(str(tmp_path / "e"))


def test_image_bytes_become_cached_files(tmp_path, monkeypatch):
    from PIL import Image

    monkeypatch.setenv("HF_XMC_IMAGE_CACHE", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    pixels = [rng.integers(0, 255, (8, 8, 3), dtype=np.uint8) for _ in range(3)]
    encoded = []
    for p in pixels:
        buf = io.BytesIO()
        Image.fromarray(p).save(buf, format="PNG")
        encoded.append({"bytes": buf.getvalue(), "path": None})  # embedded, no path: refused before
    features = datasets.Features({"text": datasets.Value("string"), "labels": datasets.Sequence(datasets.Value("int32")),
                                  "images": datasets.Sequence(datasets.Image())})
    rows = {"text": ["a", "b", "c"], "labels": [[0], [1], [0, 1]], "images": [[encoded[0]], [encoded[1], encoded[2]], []]}
    split = datasets.Dataset.from_dict(rows, features=features)
    labels = datasets.Dataset.from_dict({"text": ["red", "blue"]})
    datasets.DatasetDict({"train": split, "test": split, "labels": labels}).save_to_disk(str(tmp_path / "d"))
    data = load_hf_xc_data(str(tmp_path / "d"))
    assert [len(bag) for bag in data.train.images] == [1, 2, 0]
    for bag, want in zip(data.train.images, [[0], [1, 2]]):
        for path, i in zip(bag, want):
            assert path.startswith(str(tmp_path / "cache")) and path.endswith(".png")
            np.testing.assert_array_equal(np.asarray(Image.open(path).convert("RGB")), pixels[i])
    assert len(os.listdir(tmp_path / "cache")) == 3  # one file per distinct image (train and test share them)


def test_training_from_a_dataset_matches_the_xc_files(tiny_task, tiny_encoder_dir, tmp_path, monkeypatch):
    """Same seed, same data: the same metrics through --dataset_name as through the XC files; the card of a Hub
    dataset names it under ``datasets:``."""
    from hf_xmc.training import script_utils
    from hf_xmc.training.recipes.dexml import main

    data, task_dir = tiny_task
    xc_data_to_hf_dataset_dict(data).save_to_disk(str(tmp_path / "debtags-like"))
    common = ["--model_name_or_path", tiny_encoder_dir, "--num_train_epochs", "1", "--per_device_train_batch_size", "32",
              "--max_seq_length", "16", "--learning_rate", "5e-4", "--seed", "1", "--disable_tqdm", "true", "--save_strategy", "no",
              "--report_to", "none"]
    from_files = main(["--train_file", f"{task_dir}/trn.json.gz", "--test_file", f"{task_dir}/tst.json.gz",
                       "--label_file", f"{task_dir}/lbl.json.gz", "--output_dir", str(tmp_path / "a"), *common])
    monkeypatch.setattr(script_utils, "hub_dataset_id", lambda args: "org/debtags-xmc")  # as if it came from the Hub
    from_dataset = main(["--dataset_name", str(tmp_path / "debtags-like"), "--output_dir", str(tmp_path / "b"), *common])
    keys = [k for k in from_files if k.startswith("test_") and "per_second" not in k and "runtime" not in k]
    assert keys and {k: from_files[k] for k in keys} == {k: from_dataset[k] for k in keys}
    card = (tmp_path / "b" / "README.md").read_text()
    assert "datasets:\n- org/debtags-xmc" in card
    assert json.load(open(tmp_path / "b" / "eval_results.json"))["test_P@1"] == from_dataset["test_P@1"]
