"""A corpus of broken model directories, tried the way a user meets them: a copy of a saved tiny model with one file
broken, loaded by ``hf-xmc predict DIR --text x``. Every case ends on one line that names the file and the fault, with
exit status 2, no traceback and nothing written (``MODEL_DIR_CASES``); what is a cache (the label index) is rebuilt
from the label vectors instead, with a warning, and predicts exactly what the intact model predicts
(``REBUILT_CASES``), also through remote code in a process without hf_xmc. A faiss file from a Hub repo is not read
unless asked for. ``MODEL_DIR_KINDS`` counts the kinds for the bad-input total (README "Errors, safety and resuming").
"""

import json
import logging
import os
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file, save_file

from hf_xmc import cli
from hf_xmc.models import DEXMLModel, LabelIndex
from hf_xmc.models.io_utils import file_sha256
from hf_xmc.models.model_files import ModelFileError
from tests.models.test_modeling_common import predict_through_remote_code
from tests.test_bad_inputs import _one_line, _snapshot

pytest.importorskip("omikuji")
faiss = pytest.importorskip("faiss")

QUERIES = ["label sopa vute", "diga goke juni", "x"]


@pytest.fixture(scope="module")
def saved(tiny_task, tiny_encoder_dir, tmp_path_factory) -> dict:
    """A DEXML model with a lexical channel (Omikuji ranker), saved twice: with the exact index (``"exact"``) and with an
    HNSW index whose faiss file is saved beside it (``"hnsw"``); ``"predictions"``: the top-5 of :data:`QUERIES`."""
    from hf_xmc.training.lexical import fit_lexical_channel

    data = tiny_task[0]
    torch.manual_seed(0)
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, max_seq_length=16, label_max_seq_length=16)
    model.build_label_index(data.label_texts, data.label_uids)
    fit_lexical_channel(model, data.train, ranker_weight=0.5, text_weight=0.5, n_threads=1, rebuild_label_index=False)
    root = tmp_path_factory.mktemp("bad-model-dirs")
    model.save_pretrained(root / "exact")
    model.config.index_kind = "hnsw"
    model.label_index = None
    model.ensure_label_index()
    model.save_pretrained(root / "hnsw")
    return {"exact": str(root / "exact"), "hnsw": str(root / "hnsw"), "predictions": model.predict(QUERIES, k=5)}


# ------------------------------------------------------------------------------------------------ how a file is broken
def _edit_tensors(path, edit, framework="pt"):
    """Rewrite the safetensors file ``path`` with ``edit(tensors, metadata)`` applied (in place)."""
    with safe_open(path, framework=framework) as f:
        metadata = dict(f.metadata() or {})
    tensors = load_file(path) if framework == "pt" else _numpy_tensors(path)
    edit(tensors, metadata)
    (save_file if framework == "pt" else save_numpy)(tensors, path, metadata=metadata)


def _numpy_tensors(path):
    with safe_open(path, framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _truncate(d, name):
    data = open(os.path.join(d, name), "rb").read()
    open(os.path.join(d, name), "wb").write(data[: len(data) // 2])


def _edit_json(d, name, edit):
    path = os.path.join(d, name)
    obj = json.load(open(path))
    edit(obj)
    json.dump(obj, open(path, "w"))


def _edit_line(d, name, line_no, text):
    lines = open(os.path.join(d, name)).read().splitlines()
    lines[line_no - 1] = text
    open(os.path.join(d, name), "w").write("\n".join(lines) + "\n")


def _shard_weights(d, shard):
    """Replace ``model.safetensors`` by an index naming ``shard`` for every tensor (the file moved there)."""
    tensors = load_file(os.path.join(d, "model.safetensors"))
    os.remove(os.path.join(d, "model.safetensors"))
    target = shard if os.path.isabs(shard) else os.path.join(d, shard)
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    save_file(tensors, target, metadata={"format": "pt"})
    json.dump({"metadata": {}, "weight_map": {k: shard for k in tensors}}, open(os.path.join(d, "model.safetensors.index.json"), "w"))


def _drop_weight(t, m):
    del t["encoder.embeddings.token_type_embeddings.weight"]


def _stray_weight(t, m):
    t["stray.weight"] = torch.zeros(2, 2)


def _short_positions(t, m):
    t["encoder.embeddings.position_embeddings.weight"] = t["encoder.embeddings.position_embeddings.weight"][:-1].clone()


def _list_ranker_file(t, m):
    m["ranker_files"] = json.dumps(json.loads(m["ranker_files"]) + ["tree9.cbor"])


def _garbage_ranker(t, m):
    for name in json.loads(m["ranker_files"]):
        t[f"ranker/{name}"] = np.frombuffer(b"not an omikuji model", dtype=np.uint8).copy()


def _ranker_outside(t, m):
    m["ranker_files"] = json.dumps(["../settings.json"])
    t["ranker/../settings.json"] = t.pop("ranker/settings.json")


def _refit_queries_not_hashes(t, m):
    t["ranker_refit_queries"] = np.zeros((2, 3), dtype=np.float32)


def _ranker_labels_out_of_range(t, m):
    t["ranker_labels"] = np.full(len(t["label_indptr"]) - 1, 99, dtype=np.int64)


def _indptr_out_of_range(t, m):
    t["label_indptr"] = t["label_indptr"].copy()
    t["label_indptr"][-1] += 1000


def _indices_out_of_range(t, m):
    t["label_indices"] = t["label_indices"].copy()
    t["label_indices"][0] = 10**6


# id: (how the copy is broken, the words of the one line; {d} = the broken directory)
MODEL_DIR_CASES = {
    "weights_tensor_missing": (lambda d: _edit_tensors(f"{d}/model.safetensors", _drop_weight),
                               "{d}/model.safetensors: has no tensor for DEXMLModel's weight 'encoder.embeddings.token_type_embeddings.weight'"),
    "weights_tensor_unexpected": (lambda d: _edit_tensors(f"{d}/model.safetensors", _stray_weight),
                                  "{d}/model.safetensors: holds a tensor that DEXMLModel has no place for: 'stray.weight'"),
    "weights_tensor_wrong_shape": (lambda d: _edit_tensors(f"{d}/model.safetensors", _short_positions),
                                   "{d}/model.safetensors: tensor 'encoder.embeddings.position_embeddings.weight' has shape [63, 32] but DEXMLModel needs [64, 32]"),
    "weights_shard_outside": (lambda d: _shard_weights(d, "../outside/model-00001-of-00001.safetensors"),
                              "{d}/model.safetensors.index.json: lists weight shard '../outside/model-00001-of-00001.safetensors', a path outside the model directory"),
    "weights_shard_absolute": (lambda d: _shard_weights(d, f"{d}-elsewhere/model.safetensors"),
                               "{d}/model.safetensors.index.json: lists weight shard '{d}-elsewhere/model.safetensors', a path outside the model directory"),
    "tokenizer_json_missing": (lambda d: os.remove(f"{d}/tokenizer.json"),
                               "{d}/tokenizer.json: missing: the tokenizer loaded without it (5 tokens) turns every label text into [UNK]"),
    "tokenizer_files_missing": (lambda d: [os.remove(f"{d}/{n}") for n in ("tokenizer.json", "tokenizer_config.json")],
                                "{d}/tokenizer_config.json: missing: the model has labels but no tokenizer files"),
    "tokenizer_json_truncated": (lambda d: _truncate(d, "tokenizer.json"), "{d}/tokenizer.json: the tokenizer does not load"),
    "labels_row_null": (lambda d: _edit_line(d, "labels.jsonl", 3, '{"uid": null, "text": null}'), "{d}/labels.jsonl, line 3: uid is null, not a string"),
    "labels_text_number": (lambda d: _edit_line(d, "labels.jsonl", 2, '{"uid": "L1", "text": 7}'), "{d}/labels.jsonl, line 2: text is 7, not a string"),
    "label_vectors_truncated": (lambda d: _truncate(d, "label_embeddings.safetensors"),
                                "{d}/label_embeddings.safetensors: not valid safetensors, truncated or corrupt"),
    "label_vectors_wrong_width": (lambda d: _edit_tensors(f"{d}/label_embeddings.safetensors", lambda t, m: t.update(label_embeddings=t["label_embeddings"][:, :-1].contiguous())),
                                 "{d}/label_embeddings.safetensors: label vectors of width 31, but the model's query vectors have 32"),
    "label_vectors_too_few": (lambda d: _edit_tensors(f"{d}/label_embeddings.safetensors", lambda t, m: t.update(label_embeddings=t["label_embeddings"][:-1].contiguous())),
                              "{d}/label_embeddings.safetensors: holds 39 label vectors but labels.jsonl lists 40 labels"),
    "label_shard_outside": (lambda d: json.dump({"metadata": {}, "shards": [{"file": "../label_embeddings.safetensors", "rows": 40}]},
                                                open(f"{d}/label_embeddings.safetensors.index.json", "w")),
                            "{d}/label_embeddings.safetensors.index.json: shard names must look like"),
    "lexical_truncated": (lambda d: _truncate(d, "lexical_channel.safetensors"), "{d}/lexical_channel.safetensors: not valid safetensors, truncated or corrupt"),
    "lexical_missing": (lambda d: os.remove(f"{d}/lexical_channel.safetensors"), "{d}/lexical_channel.safetensors: missing, but config.json names a lexical channel"),
    "lexical_ranker_not_stored": (lambda d: _edit_tensors(f"{d}/lexical_channel.safetensors", _list_ranker_file, "numpy"),
                                  "{d}/lexical_channel.safetensors: lists ranker file 'tree9.cbor' but does not store it"),
    "lexical_ranker_garbage": (lambda d: _edit_tensors(f"{d}/lexical_channel.safetensors", _garbage_ranker, "numpy"),
                               "{d}/lexical_channel.safetensors: the ranker's files do not load as an Omikuji model"),
    "lexical_ranker_outside": (lambda d: _edit_tensors(f"{d}/lexical_channel.safetensors", _ranker_outside, "numpy"),
                               "{d}/lexical_channel.safetensors: lists ranker file '../settings.json', a path outside the model directory"),
    "lexical_ranker_labels_out_of_range": (lambda d: _edit_tensors(f"{d}/lexical_channel.safetensors", _ranker_labels_out_of_range, "numpy"),
                                           "{d}/lexical_channel.safetensors: ranker_labels holds label ids outside [-1, 40)"),
    "lexical_refit_queries_not_hashes": (lambda d: _edit_tensors(f"{d}/lexical_channel.safetensors", _refit_queries_not_hashes, "numpy"),
                                         "{d}/lexical_channel.safetensors: ranker_refit_queries is float32 of shape [2, 3], not a list of 64-bit hashes"),
    "lexical_label_indptr_out_of_range": (lambda d: _edit_tensors(f"{d}/lexical_channel.safetensors", _indptr_out_of_range, "numpy"),
                                          "{d}/lexical_channel.safetensors: label TF-IDF rows: the row pointers do not delimit"),
    "lexical_label_indices_out_of_range": (lambda d: _edit_tensors(f"{d}/lexical_channel.safetensors", _indices_out_of_range, "numpy"),
                                           "{d}/lexical_channel.safetensors: label TF-IDF rows: column id 1000000 out of range"),
    "config_max_seq_length_beyond_positions": (lambda d: _edit_json(d, "config.json", lambda c: c.update(max_seq_length=4096)),
                                               "{d}/config.json: max_seq_length is 4096 but the encoder has 64 positions"),
    "config_label_max_seq_length_beyond_positions": (lambda d: _edit_json(d, "config.json", lambda c: c.update(label_max_seq_length=65)),
                                                     "{d}/config.json: label_max_seq_length is 65 but the encoder has 64 positions"),
}


def _broken_copy(source, tmp_path, break_it) -> str:
    broken = str(tmp_path / "broken")
    shutil.copytree(source, broken)
    break_it(broken)
    return broken


@pytest.mark.parametrize("case", sorted(MODEL_DIR_CASES))
def test_hf_xmc_predict_refuses_a_broken_model_directory(case, saved, tmp_path, capsys):
    break_it, fault = MODEL_DIR_CASES[case]
    broken = _broken_copy(saved["exact"], tmp_path, break_it)
    before = _snapshot(tmp_path)
    status = cli.main(["predict", broken, "--text", "x"])
    err = capsys.readouterr().err
    assert status == 2, err
    line = _one_line(err, "hf-xmc")
    assert fault.format(d=broken) in line, line
    others = [x for x in err.splitlines()[:-1] if x.strip() and "it/s]" not in x]  # (progress bars are the CLI's business)
    assert not others, err  # one line: no load report, no omikuji log
    assert _snapshot(tmp_path) == before  # nothing written beside or into the model


def test_load_errors_are_one_line_value_and_os_errors(saved, tmp_path):
    """In Python the same faults raise a ModelFileError (both a ValueError and an OSError), its message starting with the file."""
    broken = _broken_copy(saved["exact"], tmp_path, MODEL_DIR_CASES["labels_row_null"][0])
    with pytest.raises(ValueError) as info:
        DEXMLModel.from_pretrained(broken)
    assert isinstance(info.value, ModelFileError) and isinstance(info.value, OSError)
    assert str(info.value).startswith(f"{broken}/labels.jsonl, line 3:") and "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------------ caches: rebuilt, not refused
def _swap_faiss(d):
    """An attacker's swap: a faiss file over the same vectors in another order, its sha256 written into label_index.json."""
    vectors = load_file(f"{d}/label_embeddings.safetensors")["label_embeddings"]
    order = torch.randperm(vectors.shape[0], generator=torch.Generator().manual_seed(1))
    faiss.write_index(LabelIndex(vectors[order], kind="hnsw")._index, f"{d}/label_index.faiss")
    _edit_json(d, "label_index.json", lambda meta: meta.update(sha256=file_sha256(f"{d}/label_index.faiss")))


# id: (how the copy of the HNSW model is broken, the words of the warning)
REBUILT_CASES = {
    "index_meta_empty_list": (lambda d: open(f"{d}/label_index.json", "w").write("[]"), "label_index.json is not a JSON object"),
    "index_meta_truncated": (lambda d: _truncate(d, "label_index.json"), "label_index.json is not readable JSON"),
    "index_faiss_truncated": (lambda d: _truncate(d, "label_index.faiss"), "does not match the sha256"),
    "index_faiss_swapped": (_swap_faiss, "label_index.faiss does not index the label vectors it is stored with"),
}


@pytest.mark.parametrize("case", sorted(REBUILT_CASES))
def test_a_broken_index_is_rebuilt_from_the_label_vectors(case, saved, tmp_path, caplog):
    break_it, warning = REBUILT_CASES[case]
    broken = _broken_copy(saved["hnsw"], tmp_path, break_it)
    before = _snapshot(tmp_path)
    with caplog.at_level(logging.WARNING):
        model = DEXMLModel.from_pretrained(broken)
    assert warning in caplog.text
    assert not model.label_index.restored_from_file
    got, want = model.predict(QUERIES, k=5), saved["predictions"]
    np.testing.assert_array_equal(got.label_ids, want.label_ids)
    np.testing.assert_allclose(got.scores, want.scores, rtol=1e-5, atol=1e-6)
    assert _snapshot(tmp_path) == before


def test_an_intact_faiss_file_is_read_back_and_a_swapped_one_is_not_served_through_remote_code(saved, tmp_path):
    """The honest file passes the check against the label vectors (no needless rebuild); a swapped one, loaded by
    remote code in a process without hf_xmc, is rebuilt and predicts what the honest model predicts."""
    assert DEXMLModel.from_pretrained(saved["hnsw"]).label_index.restored_from_file
    assert not DEXMLModel.from_pretrained(saved["hnsw"], use_saved_index=False).label_index.restored_from_file
    broken = _broken_copy(saved["hnsw"], tmp_path, _swap_faiss)
    unchecked = LabelIndex(load_file(f"{broken}/label_embeddings.safetensors")["label_embeddings"], kind="hnsw",
                           _faiss_index=faiss.read_index(f"{broken}/label_index.faiss"))
    assert unchecked.mismatch()  # served as it is, the swapped file would rank other labels
    remote = predict_through_remote_code(broken, tmp_path, QUERIES)
    assert remote["ids"] == saved["predictions"].label_ids.tolist()


def test_a_hub_repo_faiss_file_is_read_only_when_asked_for(saved, tmp_path, monkeypatch):
    """Loading by repo id (an HF cache, offline) builds the index from the label vectors and never fetches the faiss
    file; ``use_saved_index=True`` reads it (checked as a local one is)."""
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / ("a" * 40)
    shutil.copytree(saved["hnsw"], snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("a" * 40)
    fetched = []
    fetch = DEXMLModel._fetch_artifact

    def recording(path, name, hub):
        fetched.append(name)
        return fetch(path, name, hub)

    monkeypatch.setattr(DEXMLModel, "_fetch_artifact", staticmethod(recording))
    model = DEXMLModel.from_pretrained("org/tiny", cache_dir=str(tmp_path / "hub"))
    assert not model.label_index.restored_from_file and "label_index.faiss" not in fetched
    assert DEXMLModel.from_pretrained("org/tiny", cache_dir=str(tmp_path / "hub"), use_saved_index=True).label_index.restored_from_file
    np.testing.assert_array_equal(model.predict(QUERIES, k=5).label_ids, saved["predictions"].label_ids)


MODEL_DIR_KINDS = len(MODEL_DIR_CASES) + len(REBUILT_CASES) + 1  # + a Hub repo's faiss file left unread


def test_labels_file_read_whole_or_line_by_line_gives_the_same_rows_and_faults(tmp_path):
    """labels.jsonl is parsed in one go when every line is a {uid, text} object; texts with line separators of other
    kinds (U+2028, \\r) stay whole, and two objects on one line are the line's fault, not two labels."""
    from hf_xmc.models.model_files import ModelFileError, read_labels

    path = tmp_path / "labels.jsonl"
    rows = [{"uid": "a", "text": "one\u2028two"}, {"uid": "b", "text": "x\ry"}, {"uid": "c", "text": "\u00e9t\u00e9"}]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    assert read_labels(str(path)) == (["a", "b", "c"], ["one\u2028two", "x\ry", "\u00e9t\u00e9"])
    path.write_text('{"uid": "a", "text": "t"}\n{"uid": "b", "text": "u"}, {"uid": "c", "text": "v"}\n', encoding="utf-8")
    with pytest.raises(ModelFileError, match=r"labels.jsonl, line 2: malformed JSON"):
        read_labels(str(path))
    path.write_text('{"uid": "a", "text": "t"}\n\n{"uid": "b", "text": "u"}\n', encoding="utf-8")
    with pytest.raises(ModelFileError, match=r"labels.jsonl, line 2: malformed JSON"):
        read_labels(str(path))
    # rows that parse as JSON but are not {uid: str, text: str} objects fall through to the line-by-line read
    for bad_row, fault in (('{"uid": "b"}', "not a {'uid', 'text'} JSON object"), ('["b", "u"]', "not a {'uid', 'text'} JSON object"),
                           ('{"uid": 2, "text": "u"}', "uid is 2, not a string"), ('{"uid": "b", "text": ["u"]}', 'text is ["u"], not a string')):
        path.write_text(f'{{"uid": "a", "text": "t"}}\n{bad_row}\n', encoding="utf-8")
        with pytest.raises(ModelFileError, match=re.escape(f"labels.jsonl, line 2: {fault}")):
            read_labels(str(path))
    path.write_text('{"uid": "a", "text": "t", "extra": 1}\n', encoding="utf-8")
    assert read_labels(str(path)) == (["a"], ["t"])  # other keys are ignored, as before
