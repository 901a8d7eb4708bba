"""Push hf_xmc models to the Hugging Face Hub, from a model object or from a saved model directory.

``push_to_hub(model, "org/name")`` is ``model.push_to_hub("org/name")``: everything ``save_pretrained`` writes (weights,
config with ``auto_map``, the flat remote-code files, tokenizer, labels, label vectors, index and model card) goes
up in one commit. ``push_to_hub("out/unidec", "org/name")`` uploads a directory written by a training script as it
is, after checking that it is a complete model directory; Trainer checkpoints and logs in it stay local. A
directory without a ``README.md`` gets a card built from its ``eval_results.json`` (results, no plot).

Loading is plain transformers: ``AutoModel.from_pretrained("org/name", trust_remote_code=True, revision=...)``
reads the label store through the HF cache, so it also works offline (``HF_HUB_OFFLINE=1``) once the repo is cached.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from huggingface_hub import HfApi

from .models.modeling_xmc import LABEL_EMBEDDINGS_FILE, LABELS_FILE, MODEL_CARD_FILE, upload_model_folder

# What a directory needs to load and predict anywhere (the index files are a rebuildable cache, so optional).
REQUIRED_FILES = ("config.json", LABELS_FILE, LABEL_EMBEDDINGS_FILE, "tokenizer_config.json")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
# Training leftovers that stay local: checkpoints, logs, optimizer state, partially written files.
IGNORE_PATTERNS = ["checkpoint-*", "runs/*", "_*", ".*"]  # fnmatch: "*" spans "/"; ".tmp-*" = unfinished writes

__all__ = ["IGNORE_PATTERNS", "check_model_directory", "push_to_hub"]


def check_model_directory(directory: str | os.PathLike) -> None:
    """Raise ``ValueError`` naming what is missing if ``directory`` is not a complete, remote-code-loadable model."""
    directory = str(directory)
    if not os.path.isdir(directory):
        raise ValueError(f"{directory}: not a directory")
    missing = [name for name in REQUIRED_FILES if not os.path.isfile(os.path.join(directory, name))]
    if not any(os.path.isfile(os.path.join(directory, name)) for name in WEIGHT_FILES):
        missing.append(" or ".join(WEIGHT_FILES))
    if missing:
        raise ValueError(f"{directory}: not a saved hf_xmc model, missing {', '.join(missing)}")
    config_path = os.path.join(directory, "config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except ValueError as err:
        raise ValueError(f"{config_path}: not valid JSON ({err})") from err
    code = [ref.split(".")[0] + ".py" for ref in (config.get("auto_map") or {}).values()]
    if not code:
        raise ValueError(f"{config_path}: no auto_map, so the model would not load with trust_remote_code=True")
    absent = [name for name in code if not os.path.isfile(os.path.join(directory, name))]
    if absent:
        raise ValueError(f"{directory}: auto_map names {', '.join(absent)}, which the directory does not hold")


def _card_from_eval_results(directory: str, repo_id: str) -> None:
    """Write a results-only card into ``directory`` (before upload) from its config and ``eval_results.json``."""
    from transformers import AutoModel

    from .cards import generate_model_card, summary_from_metrics

    model = AutoModel.from_pretrained(directory, trust_remote_code=True)
    results_path = os.path.join(directory, "eval_results.json")
    summary = None
    if os.path.isfile(results_path):
        with open(results_path, encoding="utf-8") as f:
            summary = summary_from_metrics(json.load(f))
    card = generate_model_card(model, summary, model_name=repo_id.split("/")[-1], model_id=repo_id)
    card.save(directory)


def push_to_hub(
    model_or_directory,
    repo_id: str,
    *,
    api: Optional[HfApi] = None,
    token: Optional[str] = None,
    revision: Optional[str] = None,
    private: Optional[bool] = None,
    create_pr: bool = False,
    commit_message: Optional[str] = None,
) -> str:
    """Upload an hf_xmc model (an object or a saved directory) to ``repo_id``; returns the commit URL.

    Args:
        model_or_directory: a model (``XMCPreTrainedModel``) or the path of a directory it was saved to.
        repo_id: ``org/name`` (created if missing).
        api: an ``HfApi``-like client (tests inject one; default ``HfApi(library_name="hf_xmc")``).
        token / private / create_pr / commit_message: as in ``HfApi.upload_folder``.
        revision: a branch to commit to (created if missing).
    """
    api = api if api is not None else HfApi(library_name="hf_xmc")
    if not isinstance(model_or_directory, (str, os.PathLike)):
        return model_or_directory.push_to_hub(
            repo_id, api=api, token=token, revision=revision, private=private, create_pr=create_pr, commit_message=commit_message
        )
    directory = str(model_or_directory)
    check_model_directory(directory)
    if not os.path.isfile(os.path.join(directory, MODEL_CARD_FILE)):
        _card_from_eval_results(directory, repo_id)
    return upload_model_folder(
        directory, repo_id, api=api, commit_message=commit_message or f"Upload {os.path.basename(os.path.abspath(directory))}",
        private=private, token=token, revision=revision, create_pr=create_pr, ignore_patterns=IGNORE_PATTERNS,
    )
