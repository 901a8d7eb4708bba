"""The trainer-model contract without hand-offs: a label index knows whether it is current, the evaluator searches a
current one as it is and rebuilds a stale one, and XMCTrainer fits the lexical channel its arguments ask for."""

import pytest
import torch

from hf_xmc.models import DEXMLModel
from hf_xmc.training import XMCEvaluator, XMCTrainer, XMCTrainingArguments


def tiny_dexml(encoder_dir, data) -> DEXMLModel:
    torch.manual_seed(0)
    model = DEXMLModel.from_encoder_pretrained(encoder_dir, max_seq_length=16, label_max_seq_length=16)
    model.set_labels(data.label_texts, data.label_uids)
    return model


def test_the_label_index_knows_whether_the_weights_moved(tiny_encoder_dir, tiny_task):
    data = tiny_task[0]
    model = tiny_dexml(tiny_encoder_dir, data)
    assert not model.label_index_is_current()
    model.build_label_index()
    assert model.label_index_is_current(data.label_texts)
    assert not model.label_index_is_current(data.label_texts[:-1])  # other labels
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():  # one row of the word embeddings, as a sparse update would change it
        model.encoder.embeddings.word_embeddings.weight[7, 0] += 0.5
    assert not model.label_index_is_current(data.label_texts)
    model.build_label_index()
    assert model.label_index_is_current()
    model.load_state_dict(state)  # a load (the best checkpoint, a resumed stage) changes them back
    assert not model.label_index_is_current()


def test_the_evaluator_searches_a_current_index_as_it_is(tiny_encoder_dir, tiny_task, monkeypatch):
    data = tiny_task[0]
    model = tiny_dexml(tiny_encoder_dir, data)
    evaluator = XMCEvaluator(data.test, data.label_texts, data.label_uids, ks=(1, 5), recall_ks=())
    builds = []
    build = model.build_label_index
    monkeypatch.setattr(model, "build_label_index", lambda *a, **kw: builds.append(1) or build(*a, **kw))
    first = evaluator(model)
    assert len(builds) == 1
    assert evaluator(model)["test_P@1"] == first["test_P@1"] and len(builds) == 1  # current: not encoded again
    with torch.no_grad():
        model.encoder.embeddings.word_embeddings.weight.mul_(1.5)
    evaluator(model)
    assert len(builds) == 2  # stale: rebuilt with the present weights


def test_the_trainer_fits_the_lexical_channel_its_arguments_ask_for(tiny_encoder_dir, tiny_task, tmp_path):
    pytest.importorskip("omikuji")
    pytest.importorskip("sklearn")
    data = tiny_task[0]
    for channel in ("none", "omikuji"):
        model = tiny_dexml(tiny_encoder_dir, data)
        args = XMCTrainingArguments(output_dir=str(tmp_path / channel), lexical_channel=channel, report_to=[], use_cpu=True)
        trainer = XMCTrainer(model=model, args=args, train_dataset=data.train, label_texts=data.label_texts, label_uids=data.label_uids)
        fitted = trainer.fit_lexical_channel(data.test.select(range(40)))
        if channel == "none":
            assert fitted is None and model.lexical_channel is None
        else:
            assert fitted is model.lexical_channel and fitted.num_labels == len(data.label_texts)
            assert model.label_index_is_current(data.label_texts)  # built over the labels with the final weights
