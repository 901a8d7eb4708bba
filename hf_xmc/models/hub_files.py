"""A model directory as the Hub sees it: which files make up the model (what a push uploads and the directory
check reads), its model card files, and the upload itself.

Remote-code file: a model loaded through ``trust_remote_code`` can be saved and pushed again without hf_xmc.
"""

import json
import os
from collections.abc import Sequence
from typing import Optional

from huggingface_hub import HfApi, ModelCardData
from transformers import PreTrainedModel  # an hf_xmc model (model_persistence.XMCPersistenceMixin imports this module)

from .io_utils import atomic_write, write_bytes
from .label_store import LABEL_EMBEDDINGS_FILE, LABEL_EMBEDDINGS_INDEX_FILE, read_label_store_index
from .model_files import CONFIG_FILE, EVAL_RESULTS_FILE, MODEL_CARD_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE


class ModelCardFiles:
    """A model card as files: ``README.md`` (metadata + markdown) and the images it shows, saved next to the model.

    ``hf_xmc.training.cards.generate_model_card`` builds one from a training run; ``from_pretrained`` reads back the card a
    model was saved with, so saving or pushing a loaded model keeps it.
    """

    def __init__(self, files: dict[str, bytes]):
        if MODEL_CARD_FILE not in files:
            raise ValueError(f"a model card needs a {MODEL_CARD_FILE}; got {sorted(files)}")
        self.files = dict(files)

    @property
    def text(self) -> str:
        """The ``README.md`` text."""
        return self.files[MODEL_CARD_FILE].decode("utf-8")

    def save(self, directory: str | os.PathLike) -> None:
        """Write every file of the card into ``directory`` (each through a temp file and a rename)."""
        for name, data in self.files.items():
            atomic_write(os.path.join(str(directory), name), lambda p, data=data: write_bytes(p, data))


def upload_model_folder(
    folder: str,
    repo_id: str,
    *,
    api: Optional[HfApi] = None,
    commit_message: Optional[str] = None,
    commit_description: Optional[str] = None,
    private: Optional[bool] = None,
    token: Optional[bool | str] = None,
    revision: Optional[str] = None,
    create_pr: bool = False,
    allow_patterns: Optional[list[str]] = None,
) -> str:
    """Create ``repo_id`` (and the branch ``revision``) if missing and upload ``folder`` in one commit; returns the
    commit URL. ``allow_patterns`` lists what goes up (the model's files, :func:`model_directory_files`); ``api`` lets
    tests and tools inject an ``HfApi``-like client (default ``HfApi(library_name="hf_xmc")``)."""
    api = api if api is not None else HfApi(library_name="hf_xmc")
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    if revision is not None and not create_pr:
        api.create_branch(repo_id, branch=revision, token=token, exist_ok=True)
    commit = api.upload_folder(
        repo_id=repo_id,
        folder_path=folder,
        commit_message=commit_message,
        commit_description=commit_description,
        token=token,
        revision=revision,
        create_pr=create_pr,
        **({"allow_patterns": allow_patterns} if allow_patterns is not None else {}),
    )
    return str(getattr(commit, "commit_url", commit))


def model_directory_files(directory: str | os.PathLike, model_class: type[PreTrainedModel], complete: bool = True) -> list[str]:
    """The files of a saved model directory that make up the model, in upload order: ``config.json``, the weights (one
    file, or the index and the shards it names), the remote-code files that ``auto_map`` names with the siblings they
    import, the files of ``model_class.model_files()`` that are present (a sharded label store: its index and the
    shards it names), and ``eval_results.json`` when present.

    Everything else (``checkpoint-*``, ``module1/``, ``runs/``, ``training_args.bin``, optimizer state, temp files)
    stays out: a push uploads exactly this list. Raises ``ValueError`` naming what a reload needs that is missing;
    with ``complete=False`` (a Trainer checkpoint, whose label store is re-encoded on first use) only the config,
    weights and code are required.
    """
    from transformers.dynamic_module_utils import get_relative_import_files

    directory = str(directory)
    if not os.path.isdir(directory):
        raise ValueError(f"{directory}: not a directory")

    def present(name: str) -> bool:
        return os.path.isfile(os.path.join(directory, name))

    files = model_class.model_files()
    label_shards = []
    if LABEL_EMBEDDINGS_INDEX_FILE in files and present(LABEL_EMBEDDINGS_INDEX_FILE):  # a sharded label store
        label_shards = [shard["file"] for shard in read_label_store_index(os.path.join(directory, LABEL_EMBEDDINGS_INDEX_FILE))["shards"]]
    # a sharded store stands in for the single label-vector file
    missing = [
        name for name, required in files.items()
        if complete and required and not present(name) and not (name == LABEL_EMBEDDINGS_FILE and label_shards)
    ]
    missing += [name for name in label_shards if not present(name)]
    weights = [WEIGHTS_FILE] if present(WEIGHTS_FILE) else []
    if not weights and present(WEIGHTS_INDEX_FILE):
        with open(os.path.join(directory, WEIGHTS_INDEX_FILE), encoding="utf-8") as f:
            shards = sorted(set(json.load(f).get("weight_map", {}).values()))
        missing += [name for name in shards if not present(name)]
        weights = [WEIGHTS_INDEX_FILE, *shards]
    if not weights:
        missing.append(f"{WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE}")
    if not present(CONFIG_FILE):
        missing.insert(0, CONFIG_FILE)
    if missing:
        raise ValueError(f"{directory}: not a saved {model_class.__name__} directory, missing {', '.join(missing)}")
    config_path = os.path.join(directory, CONFIG_FILE)
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except ValueError as err:
        raise ValueError(f"{config_path}: not valid JSON ({err})") from err
    modules = sorted({ref.split(".")[0] + ".py" for ref in (config.get("auto_map") or {}).values()})
    if not modules:
        raise ValueError(f"{config_path}: no auto_map, so the model would not load with trust_remote_code=True")
    absent = [name for name in modules if not present(name)]
    if absent:
        raise ValueError(f"{directory}: auto_map names {', '.join(absent)}, which the directory does not hold")
    code = set(modules)
    for name in modules:
        code.update(os.path.relpath(path, directory) for path in get_relative_import_files(os.path.join(directory, name)))
    absent = sorted(name for name in code if not present(name))
    if absent:
        raise ValueError(f"{directory}: the remote code imports {', '.join(absent)}, which the directory does not hold")
    artifacts = [name for name in files if present(name)] + label_shards
    return [CONFIG_FILE, *weights, *sorted(code), *artifacts, *([EVAL_RESULTS_FILE] if present(EVAL_RESULTS_FILE) else [])]


def default_model_card(model: PreTrainedModel, repo_id: str, tags: Optional[Sequence[str]] = None) -> ModelCardFiles:
    """A minimal card for a model without one: metadata and how to load it (``hf_xmc.training.cards`` writes full cards)."""
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag=card_pipeline_tag(model),
        inference=False,  # the Hub's widget runs a stock pipeline on forward(); these models rank through predict()
        tags=["extreme-classification", "xmc", "hf_xmc", model.config.model_type, *(tags or [])],
    )
    num_labels = len(model.label_texts) if model.label_texts is not None else 0
    adapter = model.encoder_adapter_summary()
    text = (
        f"---\n{data.to_yaml()}\n---\n\n# {repo_id.split('/')[-1]}\n\n"
        f"An extreme multi-label classification model (`{type(model).__name__}`, {num_labels:,} labels) from hf_xmc.\n\n"
        + (f"Encoder adapter: {adapter}.\n\n" if adapter else "")
        +
        "```python\nfrom transformers import AutoModel\n\n"
        f'model = AutoModel.from_pretrained("{repo_id}", trust_remote_code=True)\n'
        'pred = model.predict(["a query text"], k=5)  # label_ids, scores, label_texts\n```\n'
    )
    return ModelCardFiles({MODEL_CARD_FILE: text.encode("utf-8")})


def card_pipeline_tag(model: PreTrainedModel) -> Optional[str]:
    """The card's ``pipeline_tag``: none, for every model. The Hub's tag names one of its own tasks, and the task these
    models register (``pipeline_xmc.XMC_PIPELINE_TASK``, found through ``config.custom_pipelines``) is not one of them;
    the nearest, ``text-classification``, makes the Hub's "Use this model" snippet ``pipeline("text-classification",
    model=repo)`` fail (no sequence-classification head). Without a tag the snippet is ``AutoModel.from_pretrained(repo,
    trust_remote_code=True)``, which works, and ``pipeline(model=repo, trust_remote_code=True)`` runs the XMC pipeline."""
    return None
