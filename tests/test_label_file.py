"""labels.jsonl read on demand (``hf_xmc/models/label_file.py``): a model reloaded from the file it saved leaves the rows
unparsed, predicts and checks its derived parts without parsing them, and gives what an eager read gives; a file that
is not the one recorded (edited by hand, saved before the record) is read and checked whole, as before."""

import json
import os
import pickle
import shutil

import numpy as np
import pytest

from hf_xmc.models import DEXMLModel
from hf_xmc.models.io_utils import file_sha256
from hf_xmc.models.label_file import LabelColumn
from hf_xmc.models.model_files import read_labels
from hf_xmc.models.provenance import digest
from tests.test_bad_model_dirs import QUERIES, saved  # noqa: F401  (saved: a fixture, the model these tests load)

pytest.importorskip("omikuji")


@pytest.fixture(scope="module")
def labels_saved(saved):  # noqa: F811
    """test_bad_model_dirs.py's saved DEXML model with a lexical channel (its label rows know the label set): its
    directory, its top-5 of QUERIES, its labels as read whole and their digest."""
    directory = saved["exact"]
    uids, texts = read_labels(os.path.join(directory, "labels.jsonl"))
    return {"dir": directory, "predictions": saved["predictions"], "uids": uids, "texts": texts, "digest": digest([*uids, "\x01", *texts])}


def test_a_reloaded_model_predicts_without_parsing_its_labels(labels_saved):
    record = json.load(open(os.path.join(labels_saved["dir"], "config.json")))["labels_file"]
    assert record == {"sha256": file_sha256(os.path.join(labels_saved["dir"], "labels.jsonl")), "rows": len(labels_saved["texts"]), "digest": labels_saved["digest"]}
    model = DEXMLModel.from_pretrained(labels_saved["dir"])
    assert isinstance(model.label_texts, LabelColumn) and isinstance(model.label_uids, LabelColumn)
    got = model.predict(QUERIES, k=5)  # the channel's label rows are checked against the label set: the recorded digest
    assert model.label_texts.rows.columns is None  # nothing parsed but the rows asked for
    np.testing.assert_array_equal(got.label_ids, labels_saved["predictions"].label_ids)
    assert got.label_texts == labels_saved["predictions"].label_texts
    assert model.labels_digest() == labels_saved["digest"] == digest([*labels_saved["uids"], "\x01", *labels_saved["texts"]])
    # by position, slice and from the end, as a list would
    assert model.label_texts[3] == labels_saved["texts"][3] and model.label_uids[-1] == labels_saved["uids"][-1]
    assert model.label_texts[np.int64(2)] == labels_saved["texts"][2] and model.label_texts[1:7:2] == labels_saved["texts"][1:7:2]
    with pytest.raises(IndexError, match="out of range"):
        model.label_texts[len(labels_saved["texts"])]
    assert model.label_texts.rows.columns is None
    # a whole-column pass parses the file once, for both columns
    assert model.label_texts == labels_saved["texts"] and labels_saved["uids"] == model.label_uids and model.label_texts != labels_saved["uids"]
    assert model.label_texts.rows.columns is not None and model.label_texts.rows.raw is None
    assert list(model.label_uids) == labels_saved["uids"] and model.label_texts + ["new"] == [*labels_saved["texts"], "new"]
    assert pickle.loads(pickle.dumps(model.label_texts)) == labels_saved["texts"]
    assert model.labels_digest() == labels_saved["digest"]


def test_saving_an_unparsed_model_again_writes_the_same_file(labels_saved, tmp_path):
    model = DEXMLModel.from_pretrained(labels_saved["dir"])
    model.save_pretrained(tmp_path / "again")
    assert model.label_texts.rows.columns is None  # copied, not parsed
    assert file_sha256(str(tmp_path / "again" / "labels.jsonl")) == file_sha256(os.path.join(labels_saved["dir"], "labels.jsonl"))
    again = DEXMLModel.from_pretrained(tmp_path / "again")
    assert isinstance(again.label_texts, LabelColumn) and again.labels_digest() == labels_saved["digest"]
    np.testing.assert_array_equal(again.predict(QUERIES, k=5).label_ids, labels_saved["predictions"].label_ids)


def test_a_labels_file_edited_by_hand_is_read_whole_and_its_digest_taken_again(labels_saved, tmp_path):
    """Another text on one line (the same row count): not the recorded file, so it is parsed, checked, and the label
    set's digest is taken from it: the channel's label rows (made for the old label set) are rebuilt."""
    directory = str(tmp_path / "edited")
    shutil.copytree(labels_saved["dir"], directory)
    path = os.path.join(directory, "labels.jsonl")
    lines = open(path, encoding="utf-8").read().splitlines()
    lines[2] = json.dumps({"uid": labels_saved["uids"][2], "text": "an edited label"})
    open(path, "w", encoding="utf-8").write("\n".join(lines) + "\n")
    model = DEXMLModel.from_pretrained(directory)
    assert type(model.label_texts) is list and model.label_texts[2] == "an edited label"
    assert model.labels_digest() != labels_saved["digest"] and model.labels_digest() == digest([*model.label_uids, "\x01", *model.label_texts])
    model.predict(QUERIES, k=5)
    assert model.lexical_channel.label_source == model.labels_digest()  # rebuilt for the labels the file holds now
    # a config without the record (a model saved before it): the same eager read
    config = json.load(open(os.path.join(labels_saved["dir"], "config.json")))
    del config["labels_file"]
    old = str(tmp_path / "old")
    shutil.copytree(labels_saved["dir"], old)
    json.dump(config, open(os.path.join(old, "config.json"), "w"))
    model = DEXMLModel.from_pretrained(old)
    assert type(model.label_texts) is list and (model.label_uids, model.label_texts) == read_labels(os.path.join(old, "labels.jsonl"))
    np.testing.assert_array_equal(model.predict(QUERIES, k=5).label_ids, labels_saved["predictions"].label_ids)


def test_a_model_whose_labels_changed_records_the_new_file(labels_saved, tmp_path):
    model = DEXMLModel.from_pretrained(labels_saved["dir"])
    model.set_labels([*labels_saved["texts"][:-1], "a renamed label"], labels_saved["uids"])
    model.build_label_index()
    model.save_pretrained(tmp_path / "renamed")
    again = DEXMLModel.from_pretrained(tmp_path / "renamed")
    assert isinstance(again.label_texts, LabelColumn) and again.label_texts[-1] == "a renamed label"
    assert again.labels_digest() == model.labels_digest() != labels_saved["digest"]
