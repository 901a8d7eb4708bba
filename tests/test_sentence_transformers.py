"""sentence-transformers checkpoints, both ways: an ST encoder directory lends its pooling and normalisation to a new
model (unless the caller sets them), and ``model.save_query_encoder(dir)`` writes a checkpoint that
``SentenceTransformer(dir)`` loads and that embeds queries exactly as the model does."""

import json
import logging
import os
import shutil

import numpy as np
import pytest
import torch

from hf_xmc.models import DEXMLModel, MUFINModel, PRIMEModel, SiameseXMLModel, UniDECModel
from hf_xmc.models.encoder_utils import read_sentence_transformers_layout

sentence_transformers = pytest.importorskip("sentence_transformers")  # in the dev extra: CI has it


def make_st_checkpoint(encoder_dir, directory, pooling: str = "cls", normalize: bool = True, legacy: bool = True, dense: bool = False) -> str:
    """The tiny encoder in sentence-transformers' layout: modules.json, 1_Pooling/config.json, [2_Dense], [N_Normalize]."""
    shutil.copytree(encoder_dir, directory)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    os.makedirs(os.path.join(directory, "1_Pooling"))
    if legacy:
        keys = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "max": "pooling_mode_max_tokens"}
        pooling_config = {"word_embedding_dimension": 32, **{key: mode == pooling for mode, key in keys.items()}}
    else:  # sentence-transformers 6 writes one key
        pooling_config = {"embedding_dimension": 32, "pooling_mode": pooling, "include_prompt": True}
    with open(os.path.join(directory, "1_Pooling", "config.json"), "w") as f:
        json.dump(pooling_config, f)
    if dense:
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    if normalize:
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": f"{len(modules)}_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(directory, "modules.json"), "w") as f:
        json.dump(modules, f)
    with open(os.path.join(directory, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 16, "do_lower_case": False}, f)
    return directory


def test_layout_reader(tiny_encoder_dir, tmp_path):
    assert read_sentence_transformers_layout(tiny_encoder_dir) is None  # a plain transformers checkpoint
    st = make_st_checkpoint(tiny_encoder_dir, tmp_path / "a", pooling="cls", normalize=True)
    assert read_sentence_transformers_layout(st) == {"pooling": "cls", "normalize": True, "other_modules": []}
    st = make_st_checkpoint(tiny_encoder_dir, tmp_path / "b", pooling="mean", normalize=False, legacy=False, dense=True)
    assert read_sentence_transformers_layout(st) == {"pooling": "mean", "normalize": False, "other_modules": ["Dense"]}


def test_checkpoint_pooling_and_normalisation_are_used(tiny_encoder_dir, tiny_task, tmp_path, caplog):
    texts = tiny_task[0].test.texts[:6]
    st_dir = make_st_checkpoint(tiny_encoder_dir, tmp_path / "st", pooling="cls", normalize=True)
    with caplog.at_level(logging.INFO, logger="hf_xmc.models.encoder_utils"):
        model = DEXMLModel.from_encoder_pretrained(str(st_dir), max_seq_length=16, pooling=None)
    assert (model.config.pooling, model.config.normalize) == ("cls", True)
    assert "pooling='cls' from the checkpoint" in caplog.text and "sentence-transformers checkpoint" in caplog.text
    # the model embeds as sentence-transformers does with the same directory (its CLS pooling, its normalisation)
    expected = sentence_transformers.SentenceTransformer(str(st_dir), device="cpu").encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(model.encode_queries(texts), expected.cpu(), atol=1e-5, rtol=1e-4)
    # no Normalize module: the method keeps its cosine scoring (PRIME requires it), and the log says so
    plain = make_st_checkpoint(tiny_encoder_dir, tmp_path / "plain", pooling="mean", normalize=False, legacy=False)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_xmc.models.encoder_utils"):
        assert DEXMLModel.from_encoder_pretrained(str(plain)).config.normalize
        assert PRIMEModel.from_encoder_pretrained(str(plain), label_space_size=40).config.pooling == "mean"
    assert "normalize kept at the method's (cosine scores; the checkpoint has no Normalize module)" in caplog.text
    assert not DEXMLModel.from_encoder_pretrained(str(plain), normalize=False).config.normalize  # unless asked
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_xmc.models.encoder_utils"):
        asked = UniDECModel.from_encoder_pretrained(str(st_dir), label_space_size=40, pooling="mean", normalize=False)
    assert (asked.config.pooling, asked.config.normalize) == ("mean", False)
    assert "pooling='mean' as asked (the checkpoint's: 'cls')" in caplog.text
    # a plain checkpoint keeps the config defaults
    assert DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, pooling=None).config.pooling == "mean"


def test_unsupported_checkpoint_pooling_is_refused(tiny_encoder_dir, tmp_path):
    st_dir = make_st_checkpoint(tiny_encoder_dir, tmp_path / "max", pooling="max")
    with pytest.raises(ValueError, match="pools with 'max'.*pass pooling='mean' or 'cls'"):
        DEXMLModel.from_encoder_pretrained(str(st_dir))
    assert DEXMLModel.from_encoder_pretrained(str(st_dir), pooling="mean").config.pooling == "mean"


def _query_vectors(model, texts):
    if isinstance(model, UniDECModel):
        return model.encode_texts(texts, model.config.max_seq_length, head="de")
    return model.encode_queries(texts)


@pytest.mark.parametrize(
    "make",
    [
        lambda enc: DEXMLModel.from_encoder_pretrained(enc, max_seq_length=16),
        lambda enc: DEXMLModel.from_encoder_pretrained(enc, max_seq_length=12, pooling="cls", normalize=False),
        lambda enc: PRIMEModel.from_encoder_pretrained(enc, max_seq_length=16, label_space_size=40),
        lambda enc: UniDECModel.from_encoder_pretrained(enc, max_seq_length=16, label_space_size=40, projection_dim=24),
        lambda enc: SiameseXMLModel.from_encoder_pretrained(enc, max_seq_length=16, label_space_size=40),
    ],
    ids=["dexml", "dexml-cls-raw", "prime", "unidec", "siamesexml"],
)
def test_save_query_encoder_embeds_as_the_model(make, tiny_encoder_dir, tiny_task, tmp_path):
    torch.manual_seed(0)
    model = make(tiny_encoder_dir).eval()
    with torch.no_grad():  # move every weight off its initial value, so a missed layer would show
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    # long texts too: truncation at max_seq_length must agree
    texts = list(tiny_task[0].test.texts[:6]) + [" ".join(tiny_task[0].test.texts[:4])]
    out = tmp_path / "st"
    model.save_query_encoder(out)
    st = sentence_transformers.SentenceTransformer(str(out), device="cpu")
    assert st.max_seq_length == model.config.max_seq_length
    got = st.encode(texts, convert_to_tensor=True).cpu()
    torch.testing.assert_close(got, _query_vectors(model, texts), atol=1e-5, rtol=1e-4)
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".tmp-")]
    with pytest.raises(ValueError, match="not empty"):
        model.save_query_encoder(out)


def test_save_query_encoder_refuses_what_has_no_st_form(tiny_encoder_dir, tmp_path):
    boe = SiameseXMLModel.from_encoder_pretrained(tiny_encoder_dir, encoder_type="boe", label_space_size=40, boe_embedding_dim=32)
    with pytest.raises(NotImplementedError, match="bag-of-embeddings"):
        boe.save_query_encoder(tmp_path / "boe")
    assert not os.path.exists(tmp_path / "boe")
    assert np.all([not n.startswith(".tmp-") for n in os.listdir(tmp_path)])
    with pytest.raises(NotImplementedError, match="MUFIN"):
        MUFINModel.query_encoder_modules(None)


def test_encode_returns_numpy_on_request(tiny_encoder_dir):
    """encode_queries / encode_labels: a tensor by default (as before), numpy with convert_to_numpy=True (what
    sentence-transformers users expect), the same vectors either way; convert_to_tensor=True wins, as in ST."""
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir)
    model.set_labels(["w0 w1", "w2"])
    default = model.encode_queries(["w0", "w1 w2"])
    as_numpy = model.encode_queries(["w0", "w1 w2"], convert_to_numpy=True)
    assert isinstance(default, torch.Tensor) and isinstance(as_numpy, np.ndarray) and as_numpy.dtype == np.float32
    np.testing.assert_allclose(as_numpy, default.numpy(), rtol=1e-6)
    assert isinstance(model.encode_queries(["w0"], convert_to_tensor=False), np.ndarray)
    assert isinstance(model.encode_queries(["w0"], convert_to_numpy=True, convert_to_tensor=True), torch.Tensor)
    labels = model.encode_labels(convert_to_numpy=True)
    assert isinstance(labels, np.ndarray) and labels.shape == (2, default.shape[1])
