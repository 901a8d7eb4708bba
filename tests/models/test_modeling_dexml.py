"""DEXML model tests: the shared XMC mixin plus DEXML specifics (temperature, losses, normalisation)."""

import math

import pytest
import torch

from hf_xmc.models import DEXMLConfig, DEXMLModel
from tests.models.test_modeling_common import XMCModelTesterMixin


class TestDEXMLModel(XMCModelTesterMixin):
    model_class = DEXMLModel

    def make_model(self, encoder_dir, data):
        model = DEXMLModel.from_encoder_pretrained(encoder_dir, max_seq_length=16, label_max_seq_length=16)
        model.build_label_index(data.label_texts, data.label_uids)
        return model

    def test_logits_are_cosine_over_temperature(self, model, tiny_task):
        data = tiny_task[0]
        tok = model.tokenizer
        q = tok(data.train.texts[:3], padding=True, return_tensors="pt")
        lab = tok(data.label_texts[:4], padding=True, return_tensors="pt")
        model.eval()
        out = model(q["input_ids"], q["attention_mask"], lab["input_ids"], lab["attention_mask"])
        assert torch.allclose(out.query_embeds.norm(dim=1), torch.ones(3), atol=1e-5)
        cosine = out.query_embeds @ out.label_embeds.T
        torch.testing.assert_close(out.logits, cosine / 0.05)
        assert out.loss is None

    @pytest.mark.parametrize("loss", ["decoupled_softmax", "softmax", "infonce", "bce"])
    def test_every_loss_trains(self, tiny_encoder_dir, tiny_task, loss):
        from hf_xmc.training import XMCDataCollator

        data = tiny_task[0]
        torch.manual_seed(0)
        model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, loss=loss, max_seq_length=16, label_max_seq_length=16)
        collator = XMCDataCollator(model.tokenizer, data.train.texts, data.train.targets, data.label_texts, 16, 16)
        batch = collator([{"index": i} for i in range(32)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model.train()
        first = model(**batch).loss.item()
        for _ in range(15):
            out = model(**batch)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
        assert math.isfinite(first) and out.loss.item() < first  # the objective goes down on a fixed batch

    def test_config_validation(self):
        with pytest.raises(ValueError, match="loss must be one of"):
            DEXMLModel(DEXMLConfig(loss="hinge", encoder_config={"model_type": "bert", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 8}))
        with pytest.raises(ValueError, match="pooling"):
            DEXMLModel(DEXMLConfig(pooling="max", encoder_config={"model_type": "bert", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 8}))

    def test_predict_without_labels_is_a_clear_error(self, tiny_encoder_dir):
        model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir)
        with pytest.raises(ValueError, match="no labels"):
            model.predict(["anything"], k=1)


def test_vocab_less_tokenizer_is_rebuilt_from_vocab_txt(tmp_path, tiny_encoder_dir, tiny_task, caplog):
    # transformers 5 ignores BertTokenizerFast(vocab_file=...): such a saved tokenizer maps every word to [UNK]
    import shutil

    from transformers import BertTokenizerFast

    broken = tmp_path / "encoder"
    shutil.copytree(tiny_encoder_dir, broken)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (broken / name).unlink()
    BertTokenizerFast(vocab_file=str(broken / "vocab.txt")).save_pretrained(broken)
    words = tiny_task[0].label_texts[0].split()
    model = DEXMLModel.from_encoder_pretrained(str(broken))
    assert "rebuilt it from vocab.txt" in caplog.text
    assert model.tokenizer.tokenize(" ".join(words)) == words
