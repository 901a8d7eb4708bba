"""Hub integration without a network: pushes go to an injected fake HfApi that records exactly which files would be
uploaded, and loading by repo id goes through a hand-built HF cache (refs/<branch> + snapshots/<sha>) with
HF_HUB_OFFLINE=1, in a process where hf_xmc cannot be imported."""

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from huggingface_hub import ModelCard
from huggingface_hub.utils import filter_repo_objects

from hf_xmc.hub import check_model_directory, push_to_hub
from hf_xmc.models import DEXMLModel
from hf_xmc.training import XMCEvaluator, XMCTrainer, XMCTrainingArguments
from hf_xmc.training.cards import evaluation_summary, generate_model_card

# Everything a pushed DEXML model consists of: weights, config, remote code, tokenizer, label store, index, card (the
# exact index searches the label vectors themselves: no faiss file).
DEXML_REPO_FILES = {
    "config.json", "model.safetensors",
    "configuration_dexml.py", "configuration_xmc.py", "modeling_dexml.py", "modeling_xmc.py", "label_index.py", "xmc_losses.py", "pipeline_xmc.py", "lexical_channel.py", "calibration.py", "model_files.py",
    "io_utils.py", "label_store.py", "hub_files.py", "encoder_utils.py", "encoder_adapter.py", "all_label_loss.py", "training_hooks.py",
    "label_space.py", "label_codes.py", "onnx_encoder.py", "static_encoder.py", "model_provenance.py", "provenance.py", "model_persistence.py", "label_file.py",
    "tokenizer.json", "tokenizer_config.json",
    "labels.jsonl", "label_embeddings.safetensors", "label_index.json",
    "README.md", "xmc_metrics.png",
}

REMOTE_LOAD = textwrap.dedent(
    """
    import json, sys
    sys.modules["hf_xmc"] = None  # everything must come from the cached repo
    from transformers import AutoModel
    model = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True, revision=sys.argv[2])
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    pred = model.predict(json.loads(sys.argv[3]), k=5)
    card = model.model_card.text if model.model_card is not None else None
    print("RESULT " + json.dumps({"ids": pred.label_ids.tolist(), "scores": pred.scores.tolist(), "card": card}))
    """
)


class FakeHubApi:
    """An HfApi stand-in: records calls; ``upload_folder`` keeps the bytes of every file that would go up (applying
    the ignore patterns the way huggingface_hub does), since the pushed temp directory is deleted afterwards."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.uploads: list[dict] = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return SimpleNamespace(repo_id=repo_id)

    def create_branch(self, repo_id, *, branch, **kwargs):
        self.calls.append(("create_branch", repo_id, branch))

    def upload_folder(self, *, repo_id, folder_path, allow_patterns=None, ignore_patterns=None, run_as_future=False, **kwargs):
        paths = sorted(
            os.path.relpath(os.path.join(root, name), folder_path).replace(os.sep, "/")
            for root, _, names in os.walk(folder_path)
            for name in names
        )
        kept = list(filter_repo_objects(paths, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
        files = {}
        for rel in kept:
            with open(os.path.join(folder_path, rel), "rb") as f:
                files[rel] = f.read()
        sha = f"{len(self.uploads) + 1:040x}"
        self.uploads.append({"repo_id": repo_id, "files": files, "sha": sha, **kwargs})
        self.calls.append(("upload_folder", repo_id, kwargs.get("revision")))
        info = SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/{sha}", oid=sha)
        if run_as_future:
            future = Future()
            future.set_result(info)
            return future
        return info


def build_hf_cache(hf_home, repo_id: str, files: dict[str, bytes], sha: str, branches=("main",)) -> None:
    """Lay out ``files`` as the HF cache holds a downloaded repo: snapshots/<sha>/... and refs/<branch> = sha."""
    repo_dir = os.path.join(str(hf_home), "hub", "models--" + repo_id.replace("/", "--"))
    for rel, data in files.items():
        path = os.path.join(repo_dir, "snapshots", sha, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    os.makedirs(os.path.join(repo_dir, "refs"), exist_ok=True)
    for branch in branches:
        with open(os.path.join(repo_dir, "refs", branch), "w") as f:
            f.write(sha)


def load_from_cache(hf_home, repo_id: str, revision: str, texts) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(hf_home), PYTHONPATH="")
    proc = subprocess.run(
        [sys.executable, "-c", REMOTE_LOAD, repo_id, revision, json.dumps(texts)],
        capture_output=True, text=True, env=env, cwd=str(hf_home), timeout=300, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][0][7:])


@pytest.fixture(scope="module")
def evaluated_model(tiny_encoder_dir, tiny_task):
    """A tiny DEXML model with its label index, evaluated on the tiny test split, carrying its generated card."""
    data, _ = tiny_task
    torch.manual_seed(0)
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir)
    evaluator = XMCEvaluator(data.test, data.label_texts, data.label_uids, train_targets=data.train.targets, dataset_name="tiny-planted")
    metrics = evaluator(model)
    model.model_card = generate_model_card(model, evaluation_summary(evaluator), model_name="tiny-dexml")
    return model, metrics


def test_model_push_uploads_label_store_code_and_card(evaluated_model, tiny_task, tmp_path):
    model, metrics = evaluated_model
    api = FakeHubApi()
    url = model.push_to_hub("org/tiny-dexml", api=api, revision="v1", commit_message="first")
    assert api.calls[0] == ("create_repo", "org/tiny-dexml", {"private": None, "token": None, "exist_ok": True})
    assert ("create_branch", "org/tiny-dexml", "v1") in api.calls
    (upload,) = api.uploads
    assert url.endswith(upload["sha"]) and upload["revision"] == "v1" and upload["commit_message"] == "first"
    assert set(upload["files"]) == DEXML_REPO_FILES
    config = json.loads(upload["files"]["config.json"])
    assert config["auto_map"] == {"AutoConfig": "configuration_dexml.DEXMLConfig", "AutoModel": "modeling_dexml.DEXMLModel"}
    card = ModelCard(upload["files"]["README.md"].decode())
    assert {r.metric_name: r.metric_value for r in card.data.eval_results}["P@1"] == round(metrics["test_P@1"], 2)
    assert upload["files"]["xmc_metrics.png"].startswith(b"\x89PNG")

    # what went up loads by repo id through the HF cache, offline, without hf_xmc, at the branch and at the sha
    texts = tiny_task[0].test.texts[:6]
    before = model.predict(texts, k=5)
    hf_home = tmp_path / "hf_home"
    build_hf_cache(hf_home, "org/tiny-dexml", upload["files"], upload["sha"], branches=("main", "v1"))
    for revision in ("v1", upload["sha"]):
        result = load_from_cache(hf_home, "org/tiny-dexml", revision, texts)
        assert result["ids"] == before.label_ids.tolist()
        np.testing.assert_allclose(np.array(result["scores"]), before.scores, atol=1e-5)
        assert result["card"] == upload["files"]["README.md"].decode()  # the card came back with the model


def test_reloaded_model_keeps_its_card_and_a_cardless_model_gets_a_minimal_one(evaluated_model, tmp_path):
    model, _ = evaluated_model
    model.save_pretrained(tmp_path / "saved")
    reloaded = DEXMLModel.from_pretrained(tmp_path / "saved")
    assert reloaded.model_card.files == model.model_card.files
    api = FakeHubApi()
    reloaded.push_to_hub("org/again", api=api)
    assert api.uploads[0]["files"]["README.md"] == model.model_card.files["README.md"]
    assert ("create_branch", "org/again", None) not in api.calls

    reloaded.model_card = None
    api = FakeHubApi()
    reloaded.push_to_hub("org/bare", api=api, tags=["debtags"])
    files = api.uploads[0]["files"]
    assert set(files) == DEXML_REPO_FILES - {"xmc_metrics.png"}
    card = ModelCard(files["README.md"].decode())
    assert card.data.library_name == "transformers" and "debtags" in card.data.tags
    assert 'AutoModel.from_pretrained("org/bare", trust_remote_code=True)' in card.text


def test_push_directory_checks_it_and_leaves_training_leftovers_local(evaluated_model, tmp_path):
    model, _ = evaluated_model
    out = tmp_path / "out"
    model.save_pretrained(out)
    (out / "checkpoint-10").mkdir()
    (out / "checkpoint-10" / "model.safetensors").write_bytes(b"old")
    (out / "runs").mkdir()
    (out / "runs" / "events").write_text("log")
    (out / ".tmp-partial").write_text("half")
    (out / "eval_results.json").write_text(json.dumps({"test_P@1": 50.0}))
    api = FakeHubApi()
    push_to_hub(str(out), "org/from-dir", api=api, create_pr=True)
    (upload,) = api.uploads
    assert set(upload["files"]) == DEXML_REPO_FILES | {"eval_results.json"}
    assert upload["create_pr"] is True and not any(c[0] == "create_branch" for c in api.calls)
    # the saved card's loading example had a placeholder owner: the pushed one names the repo, the local one is as it was
    local_card = (out / "README.md").read_text()
    assert "<your-username>/tiny-dexml" in local_card
    pushed = upload["files"]["README.md"].decode()
    assert 'from_pretrained("org/from-dir"' in pushed and "<your-username>" not in pushed
    assert (out / "README.md").read_text() == local_card

    # a directory without a card gets one built from eval_results.json before upload
    (out / "README.md").unlink()
    (out / "xmc_metrics.png").unlink()
    api = FakeHubApi()
    push_to_hub(str(out), "org/from-dir", api=api)
    card = ModelCard(api.uploads[0]["files"]["README.md"].decode())
    assert [(r.metric_name, r.metric_value) for r in card.data.eval_results] == [("P@1", 50.0)]

    (out / "labels.jsonl").unlink()
    with pytest.raises(ValueError, match=r"missing labels\.jsonl"):
        push_to_hub(str(out), "org/x", api=FakeHubApi())
    with pytest.raises(ValueError, match="not a directory"):
        check_model_directory(tmp_path / "nowhere")


def test_trainer_push_to_hub_uploads_output_dir_with_the_runs_card(tiny_encoder_dir, tiny_task, tmp_path, monkeypatch):
    import transformers.trainer

    data, _ = tiny_task
    api = FakeHubApi()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: api)
    torch.manual_seed(0)
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir)
    args = XMCTrainingArguments(
        str(tmp_path / "run"), num_train_epochs=1, per_device_train_batch_size=64, learning_rate=1e-3,
        push_to_hub=True, hub_model_id="org/tiny-run", save_strategy="epoch", disable_tqdm=True, use_cpu=True,
    )
    evaluator = XMCEvaluator(data.test, data.label_texts, data.label_uids, train_targets=data.train.targets, dataset_name="tiny-planted")
    trainer = XMCTrainer(model=model, args=args, train_dataset=data.train, label_texts=data.label_texts, label_uids=data.label_uids, evaluator=evaluator)
    trainer.train()
    metrics = trainer.evaluate(metric_key_prefix="test")
    trainer.push_to_hub(commit_message="End of training")
    final = api.uploads[-1]
    assert final["commit_message"] == "End of training"
    assert DEXML_REPO_FILES <= set(final["files"])
    assert not [f for f in final["files"] if f.startswith("checkpoint-")]
    assert set(final["files"]) == DEXML_REPO_FILES  # exactly the model: no training_args.bin, no trainer state
    for upload in api.uploads:  # the pushes at each save too: model files only, never a pickle or a nested path
        assert not [f for f in upload["files"] if "/" in f or f.endswith((".bin", ".pt", ".pth", ".pkl"))], sorted(upload["files"])
        assert {"config.json", "model.safetensors", "modeling_dexml.py"} <= set(upload["files"])
    assert len(api.uploads) >= 2
    run = tmp_path / "run"
    assert not list(run.rglob("training_args.bin")), "a pickled training_args.bin was written"
    assert json.loads((run / "training_args.json").read_text())["learning_rate"] == 0.001
    card = ModelCard(final["files"]["README.md"].decode())
    results = {r.metric_name: r.metric_value for r in card.data.eval_results}
    assert results["PSP@5"] == round(metrics["test_PSP@5"], 2) and results["nDCG@3"] == round(metrics["test_nDCG@3"], 2)
    assert card.data.eval_results[0].dataset_name == "tiny-planted"
    assert 'AutoModel.from_pretrained("org/tiny-run"' in card.text
    assert "| learning_rate | 0.001 |" in card.text
    # the card is attached to the model, so a later save writes it too
    assert model.model_card.files["README.md"] == final["files"]["README.md"]
