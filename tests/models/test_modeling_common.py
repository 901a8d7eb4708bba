"""The test mixin every hf_xmc model runs (transformers' ModelTesterMixin, XMC edition).

A model test class sets ``model_class`` and implements ``make_model(encoder_dir, data)`` returning a model with a
tokenizer and labels; the mixin checks save -> reload -> same outputs (in-process and through remote code in a
process where hf_xmc cannot be imported), the prediction contract, and weight initialisation.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from transformers import AutoModel

REMOTE_PREDICT = textwrap.dedent(
    """
    import json, sys
    sys.modules["hf_xmc"] = None  # hf_xmc must not be importable: everything comes from the model directory
    try:
        import hf_xmc  # noqa: F401
        raise SystemExit("hf_xmc is importable")
    except ImportError:
        pass
    from transformers import AutoModel
    model = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True)
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    request = json.loads(sys.argv[2])
    images = {"images": request["images"]} if request["images"] is not None else {}
    if request.get("rebuild_index"):
        model.build_label_index()  # re-encode the labels from what the directory holds (texts, label images)
    if request.get("threshold") is not None:  # a calibrated model: the labels whose probability reaches it
        images["threshold"] = request["threshold"]
    if request.get("query_encoder") is not None:  # the static query encoder, say
        images["query_encoder"] = request["query_encoder"]
    pred = model.predict(request["texts"], k=5, **images)
    result = {"ids": pred.label_ids.tolist(), "scores": pred.scores.tolist(), "texts": pred.label_texts}
    if pred.probabilities is not None:
        result["probabilities"] = pred.probabilities.tolist()
    if request.get("pipeline_inputs") is not None:  # the same directory through pipeline(model=dir), in the same process
        from transformers import pipeline
        pipe = pipeline(model=sys.argv[1], trust_remote_code=True, device="cpu")
        assert type(pipe).__module__.startswith("transformers_modules"), type(pipe).__module__
        inputs = request["pipeline_inputs"]
        chosen = {"query_encoder": request["query_encoder"]} if request.get("query_encoder") is not None else {}
        result["pipeline"] = {"task": pipe.task, "one": pipe(inputs[0], top_k=3, **chosen), "many": pipe(inputs, top_k=5, batch_size=2, **chosen)}
    print("RESULT " + json.dumps(result))
    """
)


def predict_through_remote_code(model_dir, tmp_path, texts, images=None, rebuild_index: bool = False, pipeline_inputs=None, threshold=None,
                                query_encoder=None) -> dict:
    """Top-5 of ``texts`` (and ``images``, paths) from ``model_dir`` loaded with ``trust_remote_code`` in a fresh
    process where hf_xmc cannot be imported, offline (with ``rebuild_index``, after re-encoding the labels); returns
    ``{"ids", "scores", "texts"}`` (and ``"probabilities"`` for a calibrated model; ``threshold`` goes to predict), plus
    ``"pipeline"`` (as :func:`pipeline_through_remote_code` returns it) when ``pipeline_inputs`` are given: one process
    start for both. ``query_encoder`` goes to predict and the pipeline."""
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", PYTHONPATH="")
    request = {"texts": texts, "images": images, "rebuild_index": rebuild_index, "pipeline_inputs": pipeline_inputs, "threshold": threshold,
               "query_encoder": query_encoder}
    proc = subprocess.run(
        [sys.executable, "-c", REMOTE_PREDICT, str(model_dir), json.dumps(request)],
        capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][0][7:])


REMOTE_PIPELINE = textwrap.dedent(
    """
    import json, sys
    sys.modules["hf_xmc"] = None  # as above: the pipeline comes from the model directory, not the package
    from transformers import pipeline
    request = json.loads(sys.argv[2])
    pipe = pipeline(model=sys.argv[1], trust_remote_code=True, device="cpu")
    assert type(pipe).__module__.startswith("transformers_modules"), type(pipe).__module__
    inputs = request["inputs"]
    print("RESULT " + json.dumps({"task": pipe.task, "one": pipe(inputs[0], top_k=3), "many": pipe(inputs, top_k=5, batch_size=2)}))
    """
)


def pipeline_through_remote_code(model_dir, tmp_path, inputs) -> dict:
    """``pipeline(model=model_dir, trust_remote_code=True)`` in a fresh process without hf_xmc: ``{"task", "one"
    (top 3 of inputs[0]), "many" (top 5 of every input, batches of 2)}``; inputs are texts or JSON dicts."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), PYTHONPATH="")
    proc = subprocess.run(
        [sys.executable, "-c", REMOTE_PIPELINE, str(model_dir), json.dumps({"inputs": inputs})],
        capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][0][7:])


def pipeline_rows(pred, k: int) -> list[list[dict]]:
    """What the XMC pipeline should return for an ``XMCPrediction``: per input its top ``k`` as dictionaries."""
    return [
        [{"label": n, "label_id": i, "score": s} for i, s, n in zip(ids[:k], scores[:k], names[:k]) if i >= 0]
        for ids, scores, names in zip(pred.label_ids.tolist(), pred.scores.tolist(), pred.label_texts)
    ]


def assert_same_rows(got: list[list[dict]], want: list[list[dict]]) -> None:
    assert [[r["label_id"] for r in row] for row in got] == [[r["label_id"] for r in row] for row in want]
    assert [[r["label"] for r in row] for row in got] == [[r["label"] for r in row] for row in want]
    np.testing.assert_allclose([r["score"] for row in got for r in row], [r["score"] for row in want for r in row], atol=1e-5)


def check_push_uploads_exactly_the_model_files(model, tmp_path, capsys) -> None:
    """Save ``model``, litter the directory with what training leaves behind (checkpoints, MUFIN's ``module1/``, logs,
    pickles, optimizer state), then check that ``hf-xmc push --dry_run``, a directory push and ``model.push_to_hub``
    upload exactly the saved files (+ ``eval_results.json`` and the card): what the model class names, no more."""
    from hf_xmc.cli import main as cli_main
    from hf_xmc.hub import push_to_hub
    from hf_xmc.models.hub_files import model_directory_files
    from tests.test_hub import FakeHubApi

    out = tmp_path / "pushed"
    model.save_pretrained(out)
    saved = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert set(model_directory_files(out, type(model))) == saved, "save_pretrained and model_files() disagree"
    leftovers = ["checkpoint-5/model.safetensors", "checkpoint-5/optimizer.pt", "module1/checkpoint-3/model.safetensors",
                 "module1/checkpoint-3/xmc_training_state.pt", "runs/events.out", "training_args.bin", "rng_state.pth", ".tmp-partial"]
    for rel in leftovers:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(b"\x80\x04leftover")  # a pickle's first bytes
    (out / "eval_results.json").write_text(json.dumps({"test_P@1": 12.5}))
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))

    assert cli_main(["push", str(out), "org/m", "--dry_run"]) == 0
    listed = capsys.readouterr().out.split()
    expected = saved | {"eval_results.json", "README.md", "xmc_metrics.png"}  # a results-only card is written first
    assert set(listed) == expected and len(listed) == len(expected)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before  # a dry run writes nothing

    api = FakeHubApi()
    push_to_hub(str(out), "org/m", api=api)
    assert set(api.uploads[0]["files"]) == expected
    api = FakeHubApi()
    model.push_to_hub("org/m", api=api)
    assert set(api.uploads[0]["files"]) == saved | {"README.md"}


class XMCModelTesterMixin:
    model_class = None

    def make_model(self, encoder_dir, data):
        raise NotImplementedError

    @pytest.fixture
    def model(self, tiny_encoder_dir, tiny_task):
        torch.manual_seed(0)
        return self.make_model(tiny_encoder_dir, tiny_task[0])

    def test_predict_contract(self, model, tiny_task):
        data = tiny_task[0]
        texts = data.test.texts[:6]
        pred = model.predict(texts, k=5)
        assert pred.label_ids.shape == (6, 5) and pred.label_ids.dtype == np.int64
        assert pred.scores.shape == (6, 5) and pred.scores.dtype == np.float32
        assert np.all(np.diff(pred.scores, axis=1) <= 1e-6)
        assert [[data.label_texts[i] for i in row] for row in pred.label_ids] == pred.label_texts
        # the index agrees with brute-force scoring of the same vectors
        q = model.query_search_vectors(texts)
        brute = (q @ model.label_embeddings.T).topk(5, dim=1).indices.numpy()
        np.testing.assert_array_equal(pred.label_ids, brute)
        single = model.predict(texts[0], k=2)
        assert single.label_ids.shape == (1, 2)
        with pytest.raises(ValueError, match="k must be"):
            model.predict(texts, k=0)

    def test_save_and_reload_same_outputs(self, model, tiny_task, tmp_path):
        data = tiny_task[0]
        texts = data.test.texts[:8]
        before = model.predict(texts, k=5)
        model.save_pretrained(tmp_path)
        for name in ("config.json", "model.safetensors", "labels.jsonl", "label_embeddings.safetensors", "label_index.json", "tokenizer_config.json"):
            assert (tmp_path / name).exists(), name
        assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]
        reloaded = AutoModel.from_pretrained(tmp_path)
        assert type(reloaded) is self.model_class
        after = reloaded.predict(texts, k=5)
        np.testing.assert_array_equal(before.label_ids, after.label_ids)
        np.testing.assert_allclose(before.scores, after.scores, atol=1e-5)
        # re-encoding the labels with the reloaded weights reproduces the saved label vectors
        torch.testing.assert_close(reloaded.label_search_vectors(), model.label_embeddings, atol=1e-5, rtol=1e-4)

    def test_remote_code_reload_and_pipeline_without_hf_xmc(self, model, tiny_task, tmp_path):
        """One save, one fresh process without hf_xmc: ``AutoModel`` + ``predict`` gives the same top-k, and
        ``pipeline(model=dir)`` (named by the config) the same rows as the registered task over the model object."""
        from transformers import pipeline

        from hf_xmc.models import XMC_PIPELINE_TASK

        texts = list(tiny_task[0].test.texts[:8])
        before = model.predict(texts, k=5)
        want = pipeline_rows(model.predict(texts[:4], k=5), 5)
        # in the package: the registered task over a model object
        pipe = pipeline(XMC_PIPELINE_TASK, model=model, device="cpu")
        assert_same_rows(pipe(texts[:4], top_k=5), want)
        assert_same_rows([pipe(texts[1], top_k=2)], [want[1][:2]])
        model_dir = tmp_path / "model"
        model.save_pretrained(model_dir)
        config = json.load(open(model_dir / "config.json"))
        assert set(config["auto_map"]) == {"AutoConfig", "AutoModel"}
        assert config["custom_pipelines"] == {XMC_PIPELINE_TASK: {"impl": "pipeline_xmc.XMCPipeline", "pt": ["AutoModel"], "tf": [], "type": "multimodal"}}
        assert (model_dir / "pipeline_xmc.py").exists()
        result = predict_through_remote_code(model_dir, tmp_path, texts, pipeline_inputs=texts[:4])
        assert result["ids"] == before.label_ids.tolist()
        np.testing.assert_allclose(np.array(result["scores"]), before.scores, atol=1e-5)
        assert result["texts"] == before.label_texts
        piped = result["pipeline"]
        assert piped["task"] == XMC_PIPELINE_TASK
        assert_same_rows([piped["one"]], [want[0][:3]])
        assert_same_rows(piped["many"], want)
        assert set(piped["one"][0]) == {"label", "label_id", "score"}

    def test_add_and_remove_labels_without_retraining(self, model, tiny_task, tmp_path):
        data = tiny_task[0]
        texts = list(data.test.texts[:6])
        old = len(model.label_texts)
        everything = old + 3
        before = model.predict(texts, k=everything)
        new_texts = ["brand new label alpha", "another unseen tag", data.label_texts[0] + " variant"]
        ids = model.add_labels(new_texts, uids=["n1", "n2", "n3"])
        assert ids.tolist() == [old, old + 1, old + 2] and model.label_texts[old:] == new_texts and model.label_uids[-1] == "n3"
        assert model.config.label_space_size == everything if hasattr(model.config, "label_space_size") else True
        # in place == rebuilt: the vectors added for the new labels are what a full re-encoding of the grown model gives
        torch.testing.assert_close(model.label_embeddings.float(), model.label_search_vectors().float(), atol=1e-5, rtol=1e-4)
        after = model.predict(texts, k=everything)
        # the trained labels keep their parameters: each one's score for each query is unchanged
        for row in range(len(texts)):
            was = dict(zip(before.label_ids[row].tolist(), before.scores[row].tolist()))
            now = dict(zip(after.label_ids[row].tolist(), after.scores[row].tolist()))
            common = [i for i in was if 0 <= i < old and i in now]
            assert len(common) >= min(5, old) and all(abs(was[i] - now[i]) < 1e-4 for i in common)
        assert (after.label_ids >= old).any()  # the new labels are searchable
        with pytest.raises(ValueError, match="must be new and distinct"):
            model.add_labels(["x"], uids=["n1"])
        # saved and reloaded through remote code, the grown model predicts the same
        model_dir = tmp_path / "grown"
        model.save_pretrained(model_dir)
        result = predict_through_remote_code(model_dir, tmp_path, texts)
        grown = model.predict(texts, k=5)
        assert result["ids"] == grown.label_ids.tolist()
        # removing the added labels gives back the trained model's predictions; a trained label can go too
        kept = model.remove_labels(["n1", "n2", "n3"])
        assert kept.tolist() == list(range(old)) and len(model.label_texts) == old
        again = model.predict(texts, k=5)
        np.testing.assert_array_equal(again.label_ids, before.label_ids[:, :5])
        np.testing.assert_allclose(again.scores, before.scores[:, :5], atol=1e-5)
        gone = int(before.label_ids[0, 0])
        kept = model.remove_labels([model.label_uids[gone]])
        assert gone not in kept.tolist() and len(model.label_texts) == old - 1
        fewer = model.predict(texts[:1], k=4)
        assert [int(kept[i]) for i in fewer.label_ids[0]] == [i for i in before.label_ids[0].tolist() if i != gone and i < old][:4]
        with pytest.raises(ValueError, match="no label has uid"):
            model.remove_labels(["not-a-uid"])

    def test_push_uploads_exactly_the_model_files(self, model, tmp_path, capsys):
        check_push_uploads_exactly_the_model_files(model, tmp_path, capsys)

    def test_non_persistent_buffers_survive_loading(self, model, tmp_path):
        # from_pretrained materialises weights on the meta device: buffers that are not saved must be re-filled
        model.save_pretrained(tmp_path)
        reloaded = AutoModel.from_pretrained(tmp_path)
        for (name, a), (_, b) in zip(model.named_buffers(), reloaded.named_buffers()):
            torch.testing.assert_close(a, b, msg=f"buffer {name} differs after loading")

    def test_forward_loss_and_gradients(self, model, tiny_task):
        from hf_xmc.training import XMCDataCollator

        data = tiny_task[0]
        collator = XMCDataCollator(model.tokenizer, data.train.texts, data.train.targets, data.label_texts, 16, 16)
        batch = collator([{"index": i} for i in range(16)])
        model.train()
        out = model(**batch)
        assert out.logits.shape == batch["targets"].shape
        assert out.loss.ndim == 0 and torch.isfinite(out.loss)
        out.loss.backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert any(g is not None and g.abs().sum() > 0 for g in grads)
        embeds = model(batch["input_ids"], batch["attention_mask"]).query_embeds
        assert embeds.shape[0] == 16
