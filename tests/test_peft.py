"""peft adapters on every method's encoder: what trains, merged and adapter-only saves, remote-code reloads, the
error without peft, gradient caching and the training scripts' flags."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from peft import LoraConfig
from transformers import AutoModel

from hf_xmc.models import DEXMLModel, MUFINModel, PRIMEModel, SiameseXMLModel, UniDECModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(method, encoder_dir, data):
    """A tiny model of ``method`` with the task's labels (label state where the method needs one)."""
    torch.manual_seed(0)
    common = dict(max_seq_length=16, label_max_seq_length=16)
    if method == "dexml":
        model = DEXMLModel.from_encoder_pretrained(encoder_dir, **common)
    elif method == "unidec":
        model = UniDECModel.from_encoder_pretrained(encoder_dir, label_space_size=len(data.label_texts), projection_dim=8, **common)
    elif method == "prime":
        model = PRIMEModel.from_encoder_pretrained(encoder_dir, label_space_size=len(data.label_texts), **common)
    elif method == "siamesexml":
        model = SiameseXMLModel.from_encoder_pretrained(encoder_dir, label_space_size=len(data.label_texts), **common)
    else:
        model = MUFINModel.from_encoders_pretrained(encoder_dir, label_space_size=len(data.label_texts), embed_dim=8, attention_heads=2, shortlist_size=8, **common)
    model.set_labels(data.label_texts, data.label_uids)
    if method == "prime":
        from hf_xmc.training.label_state import initialize_label_state

        initialize_label_state(model, data.train.texts, data.train.targets, seed=0, show_progress_bar=False)
    if method == "siamesexml":
        import scipy.sparse as sp

        from hf_xmc.training.siamesexml import build_label_state

        build_label_state(model, data.train.texts, sp.csr_matrix(data.train.targets), None, show_progress_bar=False)
    return model.eval()


def _randomise_adapter(model):
    """LoRA's B starts at zero (the adapter a no-op): give it weights so that saving it matters."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


METHODS = ["dexml", "mufin", "prime", "siamesexml", "unidec"]


@pytest.mark.parametrize("method", METHODS)
def test_adapter_trains_only_itself_in_the_encoder_and_saves_both_ways(method, tiny_encoder_dir, tiny_task, tmp_path):
    data = tiny_task[0]
    model = build(method, tiny_encoder_dir, data)
    outside = {n for n, p in model.named_parameters() if p.requires_grad and not n.startswith("encoder.")}
    encoder_params = sum(p.numel() for p in model.encoder.parameters())
    model.add_encoder_adapter(LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["query", "value"]))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    # in the encoder only the adapter trains; heads, label tables and prototypes outside it all still do
    assert {n for n in trainable if n.startswith("encoder.")} and all("lora_" in n for n in trainable if n.startswith("encoder."))
    assert outside <= trainable
    assert sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and n.startswith("encoder.")) < encoder_params / 10
    with pytest.raises(ValueError, match="already has an adapter"):
        model.add_encoder_adapter(LoraConfig(r=2))
    _randomise_adapter(model)
    texts = list(data.test.texts[:12])
    if method in ("prime", "siamesexml", "mufin"):
        model.build_label_index()
    expected = model.predict(texts, k=5)

    # (1) merged (the default): a plain model, loadable without peft; the live model keeps its adapter
    model.save_pretrained(tmp_path / "merged")
    saved = json.load(open(tmp_path / "merged" / "config.json"))
    assert saved["encoder_adapter"] is None and not (tmp_path / "merged" / "encoder_adapter").exists()
    assert model.has_encoder_adapter
    merged = AutoModel.from_pretrained(tmp_path / "merged", trust_remote_code=True)
    assert not merged.has_encoder_adapter and not any("lora_" in n for n, _ in merged.named_parameters())
    got = merged.predict(texts, k=5)
    np.testing.assert_array_equal(got.label_ids, expected.label_ids)
    np.testing.assert_allclose(got.scores, expected.scores, atol=1e-5)

    # (2) adapter-only: the encoder's adapter in peft's layout, the rest beside it; the base named by the config
    model.save_adapter_only = True
    model.save_pretrained(tmp_path / "adapter")
    adapter_dir = tmp_path / "adapter" / "encoder_adapter"
    assert (adapter_dir / "adapter_config.json").exists() and (adapter_dir / "adapter_model.safetensors").exists()
    assert os.path.getsize(tmp_path / "adapter" / "model.safetensors") < os.path.getsize(tmp_path / "merged" / "model.safetensors")
    config = json.load(open(tmp_path / "adapter" / "config.json"))
    assert config["encoder_adapter_only"] and config["encoder_adapter"]["r"] == 4 and config["encoder_base_model"] == tiny_encoder_dir
    reloaded = AutoModel.from_pretrained(tmp_path / "adapter", trust_remote_code=True)
    assert reloaded.has_encoder_adapter and not reloaded.training
    got = reloaded.predict(texts, k=5)
    np.testing.assert_array_equal(got.label_ids, expected.label_ids)
    np.testing.assert_allclose(got.scores, expected.scores, atol=1e-5)

    # merging in place folds the adapter in: same predictions, a plain encoder
    model.merge_encoder_adapter()
    assert not model.has_encoder_adapter and not any("lora_" in n for n, _ in model.named_parameters())
    got = model.predict(texts, k=5)
    np.testing.assert_array_equal(got.label_ids, expected.label_ids)
    np.testing.assert_allclose(got.scores, expected.scores, atol=1e-5)


def test_adapter_needs_peft_and_a_transformer_encoder(tiny_encoder_dir, tiny_task, tmp_path, monkeypatch):
    """Without peft an adapter (or an adapter-only model) is refused by name; a bag-of-embeddings encoder takes none."""
    from hf_xmc.models import encoder_utils

    data = tiny_task[0]
    model = build("dexml", tiny_encoder_dir, data)
    model.add_encoder_adapter(LoraConfig(r=2, target_modules=["query"]))
    model.save_adapter_only = True
    model.save_pretrained(tmp_path / "adapter")
    monkeypatch.setattr(encoder_utils, "is_peft_available", lambda: False)
    with pytest.raises(ImportError, match="pip install peft"):
        build("dexml", tiny_encoder_dir, data).add_encoder_adapter(LoraConfig(r=2))
    with pytest.raises(ImportError, match="pip install peft"):
        DEXMLModel.from_pretrained(tmp_path / "adapter")
    monkeypatch.undo()
    boe = SiameseXMLModel.from_encoder_pretrained(tiny_encoder_dir, label_space_size=40, encoder_type="boe", max_seq_length=16)
    with pytest.raises(ValueError, match="not a transformers encoder"):
        boe.add_encoder_adapter(LoraConfig(r=2))


def test_gradient_cache_with_an_adapter_trains_like_the_plain_loss(tiny_encoder_dir, tiny_task, tmp_path):
    """4 optimiser steps through XMCTrainer with --peft lora: the adapter (and everything else) ends where the
    uncached run ends when the batch is encoded in chunks of 5."""
    from tests.test_training_engine import make_trainer

    data = tiny_task[0]
    peft_args = dict(peft="lora", lora_r=4, lora_dropout=0.0, lora_target_modules="query,value", bf16=False)  # float32: chunks round otherwise
    plain = make_trainer(tiny_encoder_dir, data, tmp_path / "a", encoder_dropout=0.0, max_steps=4, gradient_accumulation_steps=2, **peft_args)
    plain.train()
    cached = make_trainer(tiny_encoder_dir, data, tmp_path / "b", encoder_dropout=0.0, max_steps=4, gradient_accumulation_steps=2, gradient_cache_chunk_size=5, **peft_args)
    cached.train()
    adapted = 0
    for (name, a), (_, b) in zip(plain.model.named_parameters(), cached.model.named_parameters()):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=name)
        adapted += "lora_B" in name and bool(a.abs().sum() > 0)  # the adapter moved (B starts at zero)
    assert adapted == 4


def test_training_script_flags_train_an_adapter_and_save_it_alone(tiny_task, tiny_encoder_dir, tmp_path, capsys):
    """train_unidec.py --peft lora --save_adapter_only: the directory holds the adapter, the card says so, and the
    remote-code reload reproduces the run's test metrics."""
    from hf_xmc.training import XMCEvaluator

    data, task_dir = tiny_task
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "training_scripts", "train_unidec.py"),
           "--train_file", f"{task_dir}/trn.json.gz", "--test_file", f"{task_dir}/tst.json.gz", "--label_file", f"{task_dir}/lbl.json.gz",
           "--model_name_or_path", tiny_encoder_dir, "--output_dir", str(out), "--num_train_epochs", "2", "--per_device_train_batch_size", "32",
           "--max_seq_length", "16", "--projection_dim", "16", "--save_strategy", "no", "--disable_tqdm", "true",
           "--peft", "lora", "--lora_r", "4", "--lora_target_modules", "query,value", "--save_adapter_only", "true"]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "encoder_adapter" / "adapter_model.safetensors").exists()
    card = (out / "README.md").read_text()
    assert "- **Encoder adapter:** LORA (r=4" in card and "saved alone (`encoder_adapter/`)" in card and '"peft>=0.12"' in card
    results = json.load(open(out / "eval_results.json"))
    model = AutoModel.from_pretrained(out, trust_remote_code=True)
    evaluator = XMCEvaluator(data.test, data.label_texts, data.label_uids, train_targets=data.train.targets)
    again = evaluator(model)
    for key in ("test_P@1", "test_P@5", "test_PSP@5"):
        assert again[key] == pytest.approx(results[key], abs=1e-6), key
    # a flag without an adapter, or an adapter type it does not know, is one line and exit status 2
    from hf_xmc.training.recipes import unidec
    from hf_xmc.training.script_utils import run_script

    capsys.readouterr()
    status = run_script(unidec.main, cmd[2:-8] + ["--save_adapter_only", "true"], prog="train_unidec.py")
    assert status == 2 and capsys.readouterr().err.strip().endswith("--save_adapter_only needs an adapter: --peft lora or --peft_config FILE")


def test_adapter_only_push_and_load_by_repo_id(tiny_encoder_dir, tiny_task, tmp_path):
    """push_to_hub of an adapter-only model uploads the adapter (not the encoder) and a card that says so; the repo,
    laid out as the HF cache holds it, loads by its id (remote code) and predicts the same top-k."""
    from tests.test_hub import FakeHubApi, build_hf_cache

    data = tiny_task[0]
    model = build("unidec", tiny_encoder_dir, data)
    model.add_encoder_adapter(LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["query", "value"]))
    _randomise_adapter(model)
    model.save_adapter_only = True
    texts = list(data.test.texts[:8])
    expected = model.predict(texts, k=5)
    api = FakeHubApi()
    model.push_to_hub("org/unidec-lora", api=api)
    files = api.uploads[-1]["files"]
    assert {"encoder_adapter/adapter_config.json", "encoder_adapter/adapter_model.safetensors", "model.safetensors", "README.md"} <= set(files)
    assert len(files["model.safetensors"]) < 20_000  # the heads and the classifier table, not the encoder
    assert b"saved alone (`encoder_adapter/`)" in files["README.md"]
    build_hf_cache(tmp_path / "hf", "org/unidec-lora", files, api.uploads[-1]["sha"])
    loaded = AutoModel.from_pretrained("org/unidec-lora", trust_remote_code=True, cache_dir=str(tmp_path / "hf" / "hub"), local_files_only=True)
    got = loaded.predict(texts, k=5)
    np.testing.assert_array_equal(got.label_ids, expected.label_ids)
    np.testing.assert_allclose(got.scores, expected.scores, atol=1e-5)
