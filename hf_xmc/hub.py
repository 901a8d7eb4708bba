"""Push hf_xmc models to the Hugging Face Hub, from a model object or from a saved model directory.

``push_to_hub(model, "org/name")`` is ``model.push_to_hub("org/name")``: everything ``save_pretrained`` writes (weights,
config with ``auto_map``, the flat remote-code files, tokenizer, labels, label vectors, index and model card) goes
up in one commit. ``push_to_hub("out/unidec", "org/name")`` uploads a directory written by a training script, after checking the
repo id and that it is a complete model directory: exactly the files of :func:`upload_file_list` (what a reload
needs, the card, its plot and ``eval_results.json``); Trainer checkpoints, MUFIN's ``module1/``, logs and pickles
stay local. A directory without a ``README.md`` gets a card built from its ``eval_results.json``, in a staging copy:
a push never writes into the model directory.

Loading is plain transformers: ``AutoModel.from_pretrained("org/name", trust_remote_code=True, revision=...)``
reads the label store through the HF cache, so it also works offline (``HF_HUB_OFFLINE=1``) once the repo is cached.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from typing import Optional

from huggingface_hub import HfApi
from huggingface_hub.utils import validate_repo_id

from .models.hub_files import model_directory_files, upload_model_folder
from .models.model_files import CONFIG_FILE, EVAL_RESULTS_FILE, MODEL_CARD_ASSETS, MODEL_CARD_FILE

__all__ = ["check_model_directory", "model_class_of_directory", "push_to_hub", "upload_file_list"]


def model_class_of_directory(directory: str | os.PathLike) -> type:
    """The hf_xmc model class a saved directory holds, from its ``config.json``'s ``model_type``."""
    from .models import MODEL_CLASSES

    config_path = os.path.join(str(directory), CONFIG_FILE)
    if not os.path.isdir(str(directory)):
        raise ValueError(f"{directory}: not a directory")
    if not os.path.isfile(config_path):
        raise ValueError(f"{directory}: not a saved hf_xmc model, missing {CONFIG_FILE}")
    try:
        with open(config_path, encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except ValueError as err:
        raise ValueError(f"{config_path}: not valid JSON ({err})") from err
    for config_class, model_class in MODEL_CLASSES.values():
        if config_class.model_type == model_type:
            return model_class
    known = ", ".join(sorted(c.model_type for c, _ in MODEL_CLASSES.values()))
    raise ValueError(f"{config_path}: model_type {model_type!r} is not an hf_xmc model ({known})")


def upload_file_list(directory: str | os.PathLike) -> list[str]:
    """Exactly the files a push of ``directory`` uploads: what a reload needs (config, weights, remote code, tokenizer,
    the model class's label store and index, :meth:`~hf_xmc.models.XMCPreTrainedModel.model_files`) plus the card,
    its plot and ``eval_results.json``; never a checkpoint, a log or a pickle. A directory without a card gets one
    before upload (with its plot when there are results), so the card's files are listed too. Raises ``ValueError``
    naming what is missing when ``directory`` is not a complete model directory."""
    files = model_directory_files(directory, model_class_of_directory(directory))
    if MODEL_CARD_FILE not in files:
        files += [MODEL_CARD_FILE, *(MODEL_CARD_ASSETS if EVAL_RESULTS_FILE in files else ())]
    return files


def check_model_directory(directory: str | os.PathLike) -> None:
    """Raise ``ValueError`` naming what is missing if ``directory`` is not a complete, remote-code-loadable model."""
    model_directory_files(directory, model_class_of_directory(directory))


def _card_from_eval_results(directory: str, repo_id: str, into: str) -> None:
    """Write a results-only card for the model in ``directory`` into ``into`` (the push's staging copy) from its
    config and ``eval_results.json``."""
    from transformers import AutoModel

    from .training.cards import generate_model_card, summary_from_metrics

    model = AutoModel.from_pretrained(directory, trust_remote_code=True)
    results_path = os.path.join(directory, "eval_results.json")
    summary = None
    if os.path.isfile(results_path):
        with open(results_path, encoding="utf-8") as f:
            summary = summary_from_metrics(json.load(f))
    card = generate_model_card(model, summary, model_name=repo_id.split("/")[-1], model_id=repo_id)
    card.save(into)


def _staged_copy(directory: str, files: list[str], staging: str) -> None:
    """Link ``files`` of ``directory`` into ``staging`` (symbolic links: nothing is copied; the upload reads through
    them), so that what a push adds (the card) goes there and never into the model directory."""
    for name in files:
        target = os.path.join(staging, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.symlink(os.path.abspath(os.path.join(directory, name)), target)


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
        from .training.cards import refresh_card

        refresh_card(model_or_directory, repo_id=repo_id)  # the card's loading example names the repo it goes to
        return model_or_directory.push_to_hub(
            repo_id, api=api, token=token, revision=revision, private=private, create_pr=create_pr, commit_message=commit_message
        )
    directory = str(model_or_directory)
    validate_repo_id(repo_id)  # a repo id the Hub refuses is named before anything is read or built
    model_class = model_class_of_directory(directory)
    files = model_directory_files(directory, model_class)  # refuse an incomplete directory before any work
    upload = functools.partial(
        upload_model_folder, repo_id=repo_id, api=api, commit_message=commit_message or f"Upload {os.path.basename(os.path.abspath(directory))}",
        private=private, token=token, revision=revision, create_pr=create_pr,
    )
    card_path = os.path.join(directory, MODEL_CARD_FILE)
    card_text = None
    if os.path.isfile(card_path):
        from .training.cards import refresh_card_text

        with open(card_path, encoding="utf-8") as f:
            saved = f.read()
        card_text = refresh_card_text(saved, repo_id=repo_id)  # the loading example names where it now lives
        if card_text == saved:
            return upload(directory, allow_patterns=files)
    # the card is new or changed: it goes into a staging copy of the directory (links), so a push writes nothing into
    # the model directory, whether it fails (an invalid repo id, offline, no permission) or not
    with tempfile.TemporaryDirectory(prefix="hf-xmc-push-") as staging:
        _staged_copy(directory, [f for f in files if f != MODEL_CARD_FILE], staging)
        if card_text is None:
            _card_from_eval_results(directory, repo_id, staging)
        else:
            with open(os.path.join(staging, MODEL_CARD_FILE), "w", encoding="utf-8") as f:
                f.write(card_text)
        return upload(staging, allow_patterns=model_directory_files(staging, model_class))
