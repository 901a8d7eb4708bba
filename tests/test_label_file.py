"""labels.jsonl read on demand (``hf_xmc/models/label_file.py``): a model reloaded from the file it saved leaves the rows
unparsed, predicts and checks its derived parts without parsing them, and gives what an eager read gives; a file that
is not the one recorded (edited by hand, saved before the record) is read and checked whole, as before."""

import json
import os
import pickle
import shutil

import numpy as np
import pytest
import torch

from hf_xmc.models import DEXMLModel
from hf_xmc.models.io_utils import file_sha256
from hf_xmc.models.label_file import LabelColumn
from hf_xmc.models.model_files import read_labels
from hf_xmc.models.provenance import digest

pytest.importorskip("omikuji")

QUERIES = ["label sopa vute", "diga goke juni", "x"]


@pytest.fixture(scope="module")
def saved(tiny_task, tiny_encoder_dir, tmp_path_factory):
    """A DEXML model with a lexical channel (its label rows know the label set) saved once; its top-5 of QUERIES."""
    from hf_xmc.training.lexical import fit_lexical_channel

    data = tiny_task[0]
    torch.manual_seed(0)
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, max_seq_length=16, label_max_seq_length=16)
    model.build_label_index(data.label_texts, data.label_uids)
    fit_lexical_channel(model, data.train, ranker_weight=0.5, text_weight=0.5, n_threads=1, rebuild_label_index=False)
    directory = str(tmp_path_factory.mktemp("label-file") / "m")
    model.save_pretrained(directory)
    return {"dir": directory, "predictions": model.predict(QUERIES, k=5), "uids": list(model.label_uids), "texts": list(model.label_texts),
            "digest": model.labels_digest()}


def test_a_reloaded_model_predicts_without_parsing_its_labels(saved):
    record = json.load(open(os.path.join(saved["dir"], "config.json")))["labels_file"]
    assert record == {"sha256": file_sha256(os.path.join(saved["dir"], "labels.jsonl")), "rows": len(saved["texts"]), "digest": saved["digest"]}
    model = DEXMLModel.from_pretrained(saved["dir"])
    assert isinstance(model.label_texts, LabelColumn) and isinstance(model.label_uids, LabelColumn)
    got = model.predict(QUERIES, k=5)  # the channel's label rows are checked against the label set: the recorded digest
    assert model.label_texts.rows.columns is None  # nothing parsed but the rows asked for
    np.testing.assert_array_equal(got.label_ids, saved["predictions"].label_ids)
    assert got.label_texts == saved["predictions"].label_texts
    assert model.labels_digest() == saved["digest"] == digest([*saved["uids"], "\x01", *saved["texts"]])
    # by position, slice and from the end, as a list would
    assert model.label_texts[3] == saved["texts"][3] and model.label_uids[-1] == saved["uids"][-1]
    assert model.label_texts[np.int64(2)] == saved["texts"][2] and model.label_texts[1:7:2] == saved["texts"][1:7:2]
    with pytest.raises(IndexError, match="out of range"):
        model.label_texts[len(saved["texts"])]
    assert model.label_texts.rows.columns is None
    # a whole-column pass parses the file once, for both columns
    assert model.label_texts == saved["texts"] and saved["uids"] == model.label_uids and model.label_texts != saved["uids"]
    assert model.label_texts.rows.columns is not None and model.label_texts.rows.data is None
    assert list(model.label_uids) == saved["uids"] and model.label_texts + ["new"] == [*saved["texts"], "new"]
    assert pickle.loads(pickle.dumps(model.label_texts)) == saved["texts"]
    assert model.labels_digest() == saved["digest"]


def test_saving_an_unparsed_model_again_writes_the_same_file(saved, tmp_path):
    model = DEXMLModel.from_pretrained(saved["dir"])
    model.save_pretrained(tmp_path / "again")
    assert model.label_texts.rows.columns is None  # copied, not parsed
    assert file_sha256(str(tmp_path / "again" / "labels.jsonl")) == file_sha256(os.path.join(saved["dir"], "labels.jsonl"))
    again = DEXMLModel.from_pretrained(tmp_path / "again")
    assert isinstance(again.label_texts, LabelColumn) and again.labels_digest() == saved["digest"]
    np.testing.assert_array_equal(again.predict(QUERIES, k=5).label_ids, saved["predictions"].label_ids)


def test_a_labels_file_edited_by_hand_is_read_whole_and_its_digest_taken_again(saved, tmp_path):
    """Another text on one line (the same row count): not the recorded file, so it is parsed, checked, and the label
    set's digest is taken from it: the channel's label rows (made for the old label set) are rebuilt."""
    directory = str(tmp_path / "edited")
    shutil.copytree(saved["dir"], directory)
    path = os.path.join(directory, "labels.jsonl")
    lines = open(path, encoding="utf-8").read().splitlines()
    lines[2] = json.dumps({"uid": saved["uids"][2], "text": "an edited label"})
    open(path, "w", encoding="utf-8").write("\n".join(lines) + "\n")
    model = DEXMLModel.from_pretrained(directory)
    assert type(model.label_texts) is list and model.label_texts[2] == "an edited label"
    assert model.labels_digest() != saved["digest"] and model.labels_digest() == digest([*model.label_uids, "\x01", *model.label_texts])
    model.predict(QUERIES, k=5)
    assert model.lexical_channel.label_source == model.labels_digest()  # rebuilt for the labels the file holds now
    # a config without the record (a model saved before it): the same eager read
    config = json.load(open(os.path.join(saved["dir"], "config.json")))
    del config["labels_file"]
    old = str(tmp_path / "old")
    shutil.copytree(saved["dir"], old)
    json.dump(config, open(os.path.join(old, "config.json"), "w"))
    model = DEXMLModel.from_pretrained(old)
    assert type(model.label_texts) is list and (model.label_uids, model.label_texts) == read_labels(os.path.join(old, "labels.jsonl"))
    np.testing.assert_array_equal(model.predict(QUERIES, k=5).label_ids, saved["predictions"].label_ids)


def test_a_model_whose_labels_changed_records_the_new_file(saved, tmp_path):
    model = DEXMLModel.from_pretrained(saved["dir"])
    model.set_labels([*saved["texts"][:-1], "a renamed label"], saved["uids"])
    model.build_label_index()
    model.save_pretrained(tmp_path / "renamed")
    again = DEXMLModel.from_pretrained(tmp_path / "renamed")
    assert isinstance(again.label_texts, LabelColumn) and again.label_texts[-1] == "a renamed label"
    assert again.labels_digest() == model.labels_digest() != saved["digest"]
