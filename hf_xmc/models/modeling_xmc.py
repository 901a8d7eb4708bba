"""Shared modeling base of the hf_xmc models.

An XMC model here is a text encoder (any Hugging Face ``AutoModel`` backbone) that embeds queries and label
texts, plus a *label store* that rides with the checkpoint:

* ``tokenizer``: saved with the model (``tokenizer.json`` ...);
* ``labels.jsonl``: one ``{"uid", "text"}`` per label, in label-id order;
* ``label_embeddings.safetensors``: the label vectors used for search (the source of truth), float32 or float16
  (``config.label_embeddings_dtype``); a store larger than the shard size (1 GB by default) is saved as
  ``label_embeddings-00001-of-0000N.safetensors`` shards named by ``label_embeddings.safetensors.index.json``, and
  loaded memory-mapped, shard by shard, never joined (see :func:`save_label_store`);
* ``label_index.json`` (+ ``label_index.faiss`` for HNSW / IVF): the search index, a rebuildable cache;
* ``README.md`` + ``xmc_metrics.png``: the model card, when the model has one (``hf_xmc.cards`` generates it
  from a training run; a loaded model keeps the card it was loaded with).

``save_pretrained`` writes them (so Trainer checkpoints and ``push_to_hub`` carry them) and ``from_pretrained``
reads them back through ``cached_file``, so a local directory and a Hub repo id both work. ``push_to_hub``
uploads everything ``save_pretrained`` writes in one commit.

This file is part of the remote-code bundle: it imports only torch, transformers, huggingface_hub, numpy,
safetensors, tqdm and its siblings.
"""


import copy
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from huggingface_hub import HfApi, ModelCardData
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoModel, AutoTokenizer, PreTrainedModel
from transformers.utils import ModelOutput, is_peft_available, logging
from transformers.utils.hub import cached_file, convert_file_size_to_int

from .calibration import ScoreCalibration
from .configuration_xmc import XMCConfig
from .label_index import (
    INDEX_FILE,
    INDEX_META_FILE,
    LabelIndex,
    as_label_blocks,
    atomic_write,
    progress_bar_disabled,
    temp_path_for,
    write_json,
)
from .lexical_channel import LEXICAL_FILE, LexicalChannel
from .model_files import (
    DropLoadReport,
    ModelFileError,
    check_loaded_model,
    check_weights_index,
    check_weights_report,
    file_name,
    read_labels,
    read_safetensors,
)

logger = logging.get_logger(__name__)

LABELS_FILE = "labels.jsonl"
LABEL_EMBEDDINGS_FILE = "label_embeddings.safetensors"
LABEL_EMBEDDINGS_INDEX_FILE = "label_embeddings.safetensors.index.json"
LABEL_EMBEDDINGS_KEY = "label_embeddings"  # the tensor's name in the single file and in every shard
LABEL_SHARD_SIZE = "1GB"  # default most bytes per label-vector file: small retries and parallel parts on a Hub upload
LABEL_SHARD_PATTERN = re.compile(r"label_embeddings-\d{5}-of-\d{5}\.safetensors")
MODEL_CARD_FILE = "README.md"
MODEL_CARD_ASSETS = ("xmc_metrics.png",)  # files the card shows; they travel with it
EVAL_RESULTS_FILE = "eval_results.json"  # a training run's metrics (the training script contract); pushed with the card
THRESHOLD_DEPTH = 100  # labels predict(threshold=) ranks before it keeps those above the threshold (k overrides it)
CONFIG_FILE = "config.json"
# an adapter-only save: the encoder's peft adapter, in peft's own layout (PeftModel.from_pretrained(base, repo,
# subfolder="encoder_adapter") reads it), in a subfolder: transformers takes a top-level adapter_config.json for an
# adapter of the whole model and would load it as one
ADAPTER_DIR = "encoder_adapter"
ADAPTER_CONFIG_FILE = f"{ADAPTER_DIR}/adapter_config.json"
ADAPTER_WEIGHTS_FILE = f"{ADAPTER_DIR}/adapter_model.safetensors"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
# what tokenizer classes write with save_pretrained (a tokenizer writes some of these)
TOKENIZER_FILES = (
    "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "added_tokens.json", "vocab.txt", "vocab.json",
    "merges.txt", "spiece.model", "sentencepiece.bpe.model", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)


@dataclass
class XMCPrediction:
    """Top-k predictions for a list of inputs, best first.

    Attributes:
        label_ids: int64 array ``(n, k)``; ``-1`` marks an empty slot (fewer than k labels exist).
        scores: float32 array ``(n, k)``, non-increasing along each row.
        label_texts: ``n`` lists of ``k`` label texts (empty string for an empty slot).
        probabilities: float32 array ``(n, k)``, the calibrated probability that each label is relevant (0 for an
            empty slot); None for a model without a score calibration.
    """

    label_ids: np.ndarray
    scores: np.ndarray
    label_texts: list[list[str]]
    probabilities: Optional[np.ndarray] = None


@dataclass
class XMCModelOutput(ModelOutput):
    """Output of an hf_xmc dual-encoder forward pass.

    Attributes:
        loss: training loss, returned when ``targets`` are given.
        logits: ``(batch, pool)`` query/label-pool scores divided by the temperature.
        query_embeds: ``(batch, dim)`` query embeddings.
        label_embeds: ``(pool, dim)`` label embeddings.
    """

    loss: Optional[torch.FloatTensor] = None
    logits: Optional[torch.FloatTensor] = None
    query_embeds: Optional[torch.FloatTensor] = None
    label_embeds: Optional[torch.FloatTensor] = None


class ModelCardFiles:
    """A model card as files: ``README.md`` (metadata + markdown) and the images it shows, saved next to the model.

    ``hf_xmc.cards.generate_model_card`` builds one from a training run; ``from_pretrained`` reads back the card a
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
            atomic_write(os.path.join(str(directory), name), lambda p, data=data: _write_bytes(p, data))


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


def read_label_store_index(index_path: str) -> dict:
    """A ``label_embeddings.safetensors.index.json``: ``{"metadata": {num_labels, dim, dtype, total_size}, "shards":
    [{"file", "rows"}, ...]}`` with the shards in label-id order. Raises ``ValueError`` naming the fault (shard names
    must match ``label_embeddings-0000i-of-0000N.safetensors``: no path leaves the model directory)."""
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
        shards = [(str(shard["file"]), int(shard["rows"])) for shard in index["shards"]]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{index_path}: not a label store index ({type(err).__name__}: {err})") from err
    bad = [name for name, _ in shards if not LABEL_SHARD_PATTERN.fullmatch(name)]
    if bad or not shards:
        raise ValueError(f"{index_path}: shard names must look like label_embeddings-00001-of-00002.safetensors, got {bad or 'none'}")
    return index


def _row_range(blocks: Sequence[torch.Tensor], start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of the row blocks: a view when they lie in one block, else the joined pieces."""
    pieces, offset = [], 0
    for block in blocks:
        lo, hi = max(start, offset), min(stop, offset + block.shape[0])
        if lo < hi:
            pieces.append(block[lo - offset : hi - offset])
        offset += block.shape[0]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def save_label_store(
    directory: str,
    vectors: torch.Tensor | Sequence[torch.Tensor],
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str = LABEL_SHARD_SIZE,
) -> list[str]:
    """Write label vectors (one ``(L, d)`` tensor or its row blocks) into ``directory`` in ``dtype``: as
    ``label_embeddings.safetensors``, or, past ``max_shard_size`` bytes (an int or ``"1GB"``-style string), as row
    shards ``label_embeddings-0000i-of-0000N.safetensors`` named by ``label_embeddings.safetensors.index.json``.
    Returns the files written.

    Never a half store: every file goes to a temp file first (a failure removes them and leaves the old store as it
    was); then the old index JSON is removed, the files are renamed into place and the new index JSON comes last, so
    the directory never names a mix of two stores (a crash in between leaves no store: the labels are then re-encoded
    on first use). Files of the old store that the new one does not overwrite are removed.

    Memory: one shard at a time (safetensors serialises a shard to bytes before writing it; a dtype change or a shard
    spanning two blocks copies it once more).
    """
    blocks = as_label_blocks(vectors)
    num_labels, dim = sum(b.shape[0] for b in blocks), blocks[0].shape[1]
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows_per_shard = max(1, convert_file_size_to_int(max_shard_size) // (dim * itemsize))
    num_shards = math.ceil(num_labels / rows_per_shard)
    if num_shards == 1:
        names = [LABEL_EMBEDDINGS_FILE]
    else:
        names = [f"label_embeddings-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    old = [n for n in os.listdir(directory) if n == LABEL_EMBEDDINGS_FILE or LABEL_SHARD_PATTERN.fullmatch(n)]
    temps, rows = [], []
    try:
        for i, name in enumerate(names):
            shard = _row_range(blocks, i * rows_per_shard, min(num_labels, (i + 1) * rows_per_shard)).to(dtype).contiguous()
            temps.append(temp_path_for(os.path.join(directory, name)))
            save_file({LABEL_EMBEDDINGS_KEY: shard}, temps[-1], metadata={"format": "pt"})
            rows.append(shard.shape[0])
            del shard
    except BaseException:
        for tmp in temps:
            if os.path.exists(tmp):
                os.remove(tmp)
        raise
    index_path = os.path.join(directory, LABEL_EMBEDDINGS_INDEX_FILE)
    if os.path.exists(index_path):  # the old store stops being named before its files are replaced
        os.remove(index_path)
    for tmp, name in zip(temps, names):
        os.replace(tmp, os.path.join(directory, name))
    written = list(names)
    if num_shards > 1:
        index = {
            "metadata": {"num_labels": num_labels, "dim": dim, "dtype": str(dtype).replace("torch.", ""), "total_size": num_labels * dim * itemsize},
            "shards": [{"file": name, "rows": n} for name, n in zip(names, rows)],
        }
        atomic_write(index_path, lambda p: write_json(p, index))
        written.append(LABEL_EMBEDDINGS_INDEX_FILE)
    for name in old:
        if name not in written:
            os.remove(os.path.join(directory, name))
    return written


WEIGHT_SHARD_PATTERN = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
STAGING_PREFIX = ".tmp-save-"


def staged_directory_path(directory: str) -> str:
    """A fresh, empty staging directory beside ``directory`` (same filesystem: it can be renamed into place), named
    ``.tmp-save-<pid>-<name>-*`` so that a later save can tell one left by a killed process (and remove it)."""
    parent, name = os.path.split(directory)
    os.makedirs(parent, exist_ok=True)
    for stale in os.listdir(parent):  # left behind by a save that was killed: its process is gone
        match = re.fullmatch(re.escape(STAGING_PREFIX) + r"(\d+)-" + re.escape(name) + r"-\w+", stale)
        if match and not _process_alive(int(match.group(1))):
            shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-{name}-", dir=parent)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process, or a platform without signals: assume it lives
        return True
    return True


def commit_staged_directory(staging: str, directory: str, replaced: Callable[[str], bool]) -> None:
    """Move the complete directory ``staging`` into place at ``directory`` in one step.

    A missing ``directory`` is a plain rename. An existing one first lends ``staging`` what it holds beyond the model
    (``checkpoint-*``, ``runs/``, ``eval_results.json``, a card: every entry that ``staging`` lacks and ``replaced``
    does not claim as a file of the previous model), as hard links, so nothing is copied; then the two directories
    are exchanged atomically (Linux ``renameat2(RENAME_EXCHANGE)``) and the old one, now at ``staging``, is removed.
    A process killed at any point leaves ``directory`` holding either the old model or the new one, never a mix.
    Where the exchange is not available (another OS or filesystem) two renames do it, with a moment in between
    where ``directory`` is absent.

    Disk: the old and the new model side by side until the exchange (twice the model's size for a moment).
    """
    if not os.path.isdir(directory):
        os.rename(staging, directory)
        return
    for name in os.listdir(directory):
        if name.startswith(".tmp-") or replaced(name) or os.path.lexists(os.path.join(staging, name)):
            continue
        source, target = os.path.join(directory, name), os.path.join(staging, name)
        if os.path.isdir(source) and not os.path.islink(source):
            shutil.copytree(source, target, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(source, target)
    _exchange_directories(staging, directory)
    shutil.rmtree(staging, ignore_errors=True)


def _link_or_copy(source: str, target: str) -> None:
    if os.path.islink(source):
        os.symlink(os.readlink(source), target)
        return
    try:
        os.link(source, target)
    except OSError:  # a filesystem without hard links
        shutil.copy2(source, target)


def _exchange_directories(a: str, b: str) -> None:
    """Swap two directories of one filesystem: atomically with ``renameat2(RENAME_EXCHANGE)``, else by renames."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        renameat2 = None
    if renameat2 is not None:
        at_fdcwd, rename_exchange = -100, 2
        if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
            return
    aside = a + ".old"
    os.rename(b, aside)
    os.rename(a, b)
    os.rename(aside, a)


def load_label_store(fetch: Callable[[str], Optional[str]]) -> Optional[list[torch.Tensor]]:
    """The saved label vectors as memory-mapped row blocks, one per file and never joined (a page costs memory once
    search touches it), in the precision they were saved in; ``None`` when the model has none. ``fetch(name)`` gives
    the local path of a file of the model directory or Hub repo, ``None`` when it has no such file."""
    index_path = fetch(LABEL_EMBEDDINGS_INDEX_FILE)
    if index_path is None:
        path = fetch(LABEL_EMBEDDINGS_FILE)
        return None if path is None else [_mmap_label_vectors(path)]
    blocks = []
    for name, rows in ((shard["file"], shard["rows"]) for shard in read_label_store_index(index_path)["shards"]):
        path = fetch(name)
        if path is None:
            raise ValueError(f"{index_path} names {name}, which the model does not hold")
        blocks.append(_mmap_label_vectors(path))
        if blocks[-1].shape[0] != rows:
            raise ValueError(f"{path} holds {blocks[-1].shape[0]} label vectors but {index_path} says {rows}")
    return as_label_blocks(blocks)  # refuses shards of different widths or precisions


def _mmap_label_vectors(path: str) -> torch.Tensor:
    # safetensors maps the file: no bytes are read until search touches them
    vectors = read_safetensors(path, keys=(LABEL_EMBEDDINGS_KEY,))[LABEL_EMBEDDINGS_KEY]
    if vectors.ndim != 2 or vectors.dtype not in (torch.float32, torch.float16):
        raise ModelFileError(f"{path}: {LABEL_EMBEDDINGS_KEY} is a {vectors.dtype} tensor of shape {list(vectors.shape)}, not (labels, dim) float32 or float16")
    return vectors


def model_directory_files(directory: str | os.PathLike, model_class: type["XMCPreTrainedModel"], complete: bool = True) -> list[str]:
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


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def default_model_card(model: "XMCPreTrainedModel", repo_id: str, tags: Optional[Sequence[str]] = None) -> ModelCardFiles:
    """A minimal card for a model without one: metadata and how to load it (``hf_xmc.cards`` writes full cards)."""
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


def _as_requested(vectors: torch.Tensor, convert_to_numpy: bool, convert_to_tensor: Optional[bool]) -> torch.Tensor | np.ndarray:
    """``encode_*``'s result in the form asked for, with sentence-transformers' rule: ``convert_to_tensor=True`` wins;
    else ``convert_to_numpy=True`` (or ``convert_to_tensor=False``) gives a numpy array (bfloat16 as float32)."""
    if convert_to_tensor or not (convert_to_numpy or convert_to_tensor is False):
        return vectors
    vectors = vectors.detach().cpu()
    return (vectors.float() if vectors.dtype == torch.bfloat16 else vectors).numpy()


def card_pipeline_tag(model: "XMCPreTrainedModel") -> Optional[str]:
    """The card's ``pipeline_tag``: none, for every model. The Hub's tag names one of its own tasks, and the task these
    models register (``pipeline_xmc.XMC_PIPELINE_TASK``, found through ``config.custom_pipelines``) is not one of them;
    the nearest, ``text-classification``, makes the Hub's "Use this model" snippet ``pipeline("text-classification",
    model=repo)`` fail (no sequence-classification head). Without a tag the snippet is ``AutoModel.from_pretrained(repo,
    trust_remote_code=True)``, which works, and ``pipeline(model=repo, trust_remote_code=True)`` runs the XMC pipeline."""
    return None


ST_MODULES_FILE = "modules.json"  # a sentence-transformers checkpoint names its modules (Transformer, Pooling, ...) here
ST_POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
                   "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens": "weightedmean",
                   "pooling_mode_lasttoken": "lasttoken"}  # the layout of sentence-transformers 2-5 (6 reads it too)


def read_sentence_transformers_layout(path: str, **hub) -> Optional[dict]:
    """The pooling mode and normalisation of a sentence-transformers checkpoint (``modules.json``, ``1_Pooling/config.json``,
    ``2_Normalize``) at ``path`` (a directory or Hub id): ``{"pooling", "normalize", "other_modules"}``, or None when
    ``path`` is a plain transformers checkpoint. ``other_modules`` lists what hf_xmc does not run (e.g. a Dense layer)."""
    modules_path = cached_file(path, ST_MODULES_FILE, _raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False, **hub)
    if modules_path is None:
        return None
    try:
        with open(modules_path, encoding="utf-8") as f:
            modules = json.load(f)
        kinds = [(m["type"].rsplit(".", 1)[-1], m.get("path", "")) for m in modules]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{modules_path}: not a sentence-transformers modules list ({err})") from err
    pooling, other = None, []
    for kind, sub in kinds:
        if kind == "Pooling":
            config_path = cached_file(path, f"{sub}/config.json" if sub else "config.json", _raise_exceptions_for_missing_entries=False, **hub)
            if config_path is None:
                raise ValueError(f"{path}: modules.json names a Pooling module in {sub!r}, which has no config.json")
            with open(config_path, encoding="utf-8") as f:
                pooling_config = json.load(f)
            modes = pooling_config.get("pooling_mode")
            if modes is None:
                modes = [mode for key, mode in ST_POOLING_KEYS.items() if pooling_config.get(key)] or ["mean"]
            modes = [modes] if isinstance(modes, str) else list(modes)
            pooling = modes[0] if len(modes) == 1 else "+".join(modes)
        elif kind not in ("Transformer", "Normalize"):
            other.append(kind)
    return {"pooling": pooling or "mean", "normalize": any(kind == "Normalize" for kind, _ in kinds), "other_modules": other}


def _config_from_sentence_transformers(path: str, config_kwargs: dict) -> dict:
    """``config_kwargs`` with ``pooling`` / ``normalize`` taken from a sentence-transformers checkpoint at ``path`` where
    the caller left them out (or None); a log line says which values came from where."""
    kwargs = dict(config_kwargs)
    layout = read_sentence_transformers_layout(path)
    for key in ("pooling", "normalize"):
        if kwargs.get(key) is None:
            kwargs.pop(key, None)
    if layout is None:
        return kwargs
    chosen = []
    for key in ("pooling", "normalize"):
        if key in kwargs:
            chosen.append(f"{key}={kwargs[key]!r} as asked (the checkpoint's: {layout[key]!r})")
        else:
            if key == "pooling" and layout["pooling"] not in POOLERS:
                raise ValueError(
                    f"{path}: the sentence-transformers checkpoint pools with {layout['pooling']!r}, which hf_xmc encoders do not "
                    f"support ({', '.join(POOLERS)}); pass pooling='mean' or 'cls' to use its encoder anyway"
                )
            if key == "normalize" and not layout["normalize"]:
                # every method here scores cosine similarities (PRIME requires it, DEXML's temperature assumes it):
                # a checkpoint without a Normalize module does not turn that off; normalize=False does, when asked
                chosen.append("normalize kept at the method's (cosine scores; the checkpoint has no Normalize module)")
                continue
            kwargs[key] = layout[key]
            chosen.append(f"{key}={layout[key]!r} from the checkpoint")
    logger.info("%s is a sentence-transformers checkpoint: %s", path, ", ".join(chosen))
    if layout["other_modules"]:
        logger.warning("%s: its sentence-transformers modules %s are not part of the hf_xmc encoder", path, ", ".join(layout["other_modules"]))
    return kwargs


def mean_pooling(hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Average the token states that the attention mask keeps."""
    mask = attention_mask.unsqueeze(-1).to(hidden_states.dtype)
    return (hidden_states * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


def cls_pooling(hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The first token's state."""
    return hidden_states[:, 0]


POOLERS = {"mean": mean_pooling, "cls": cls_pooling}


def distributed_world_size() -> int:
    """Number of processes in the default torch.distributed group (1 when not distributed)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def all_gather_rows(tensor: torch.Tensor, with_grad: bool = True) -> torch.Tensor:
    """Concatenate ``tensor`` from every process along dim 0 (processes may hold different numbers of rows).

    With ``with_grad`` it uses ``torch.distributed.nn.functional.all_gather``, whose backward sums the gradients
    every process computed for a slice and hands them to the slice's owner (``accelerator.gather`` would cut the
    graph). Tensors are zero-padded to the largest row count for the collective and the padding is cut out again.
    """
    world = distributed_world_size()
    sizes = [torch.zeros(1, dtype=torch.long, device=tensor.device) for _ in range(world)]
    torch.distributed.all_gather(sizes, torch.tensor([tensor.shape[0]], device=tensor.device))
    sizes = [int(x.item()) for x in sizes]
    pad = max(sizes) - tensor.shape[0]
    padded = torch.cat([tensor, tensor.new_zeros((pad, *tensor.shape[1:]))]) if pad else tensor
    if with_grad:
        from torch.distributed.nn.functional import all_gather

        parts = all_gather(padded)
    else:
        parts = [torch.empty_like(padded) for _ in range(world)]
        torch.distributed.all_gather(parts, padded.contiguous())
    return torch.cat([part[:n] for part, n in zip(parts, sizes)])


def targets_from_positive_ids(query_positive_ids: torch.Tensor, label_ids: torch.Tensor) -> torch.Tensor:
    """Boolean ``(queries, pool)``: True where pool label ``label_ids[j]`` is among query ``i``'s ``-1``-padded positives.

    Built by a binary search of every (query, positive) pair in the sorted pool, so memory is the ``(queries, pool)``
    result plus ``O(queries x P_max)`` keys: never the ``(queries, pool, P_max)`` broadcast a direct comparison needs
    (4 GB of booleans for 256 queries x a 64K pool x 250 positives).
    """
    num_queries, pool = query_positive_ids.shape[0], label_ids.numel()
    targets = torch.zeros(num_queries, pool, dtype=torch.bool, device=label_ids.device)
    if pool == 0 or query_positive_ids.numel() == 0:
        return targets
    positives = query_positive_ids.to(label_ids.device)
    sorted_ids, order = torch.sort(label_ids.reshape(-1))
    slot = torch.searchsorted(sorted_ids, positives).clamp_(max=pool - 1)
    hit = (sorted_ids[slot] == positives) & (positives >= 0)
    rows = torch.arange(num_queries, device=label_ids.device).unsqueeze(1).expand_as(positives)
    # a label present several times in the pool: every copy is a target (equal ids are adjacent once sorted)
    targets[rows[hit], order[slot[hit]]] = True
    duplicated = sorted_ids[1:] == sorted_ids[:-1]
    if bool(duplicated.any()):
        first_of_run = torch.searchsorted(sorted_ids, sorted_ids, right=False)  # each slot's first equal id
        targets[:, order] = targets[:, order[first_of_run]] | targets[:, order]
    return targets


def all_gather_id_lists(ids: torch.Tensor, pad_value: int = -1) -> torch.Tensor:
    """Concatenate ``(rows, width)`` ``pad_value``-padded id lists from every process (widths may differ: they are
    padded to the widest first, which the collective needs)."""
    width = torch.tensor([ids.shape[1]], device=ids.device)
    torch.distributed.all_reduce(width, op=torch.distributed.ReduceOp.MAX)
    pad = int(width.item()) - ids.shape[1]
    if pad:
        ids = torch.cat([ids, ids.new_full((ids.shape[0], pad), pad_value)], dim=1)
    return all_gather_rows(ids, with_grad=False)


def gather_label_pool(
    label_embeds: torch.Tensor, label_ids: torch.Tensor, query_positive_ids: torch.Tensor, positive_index: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Join the label pools of all processes so in-batch negatives span every process.

    Returns the gathered (de-duplicated) label embeddings, the local queries' targets against that pool (rebuilt
    from ``query_positive_ids``, so false negatives stay masked), the pool position of each query's sampled
    positive and the gathered pool's label ids. Gradients reach the label embeddings of every process.
    """
    all_embeds = all_gather_rows(label_embeds, with_grad=True)
    all_ids = all_gather_rows(label_ids, with_grad=False)
    # keep the first occurrence of a label that several processes sampled
    first = torch.ones_like(all_ids, dtype=torch.bool)
    order = torch.argsort(all_ids, stable=True)
    sorted_ids = all_ids[order]
    first[order[1:]] = sorted_ids[1:] != sorted_ids[:-1]
    keep = first.nonzero().squeeze(1)
    embeds, ids = all_embeds[keep], all_ids[keep]
    targets = targets_from_positive_ids(query_positive_ids, ids)
    new_positive_index = None
    if positive_index is not None:
        sampled = label_ids[positive_index]
        new_positive_index = (ids.unsqueeze(0) == sampled.unsqueeze(1)).float().argmax(dim=1)
    return embeds, targets, new_positive_index, ids


# Tokenising a text costs time in proportion to its length, whatever ``max_length`` keeps: a 50-word query cut to 16
# tokens is tokenised whole (3x the work of its first 16 words). Where every whitespace-separated word is tokenised on
# its own (the pre-tokenizer splits at whitespace, the normaliser maps characters one by one), the tokens of a text's
# first n words are a prefix of the text's tokens, so cutting the string after its first ``max_length`` words keeps
# the truncated result whenever that prefix still fills ``max_length`` tokens (a word gives at least one token unless
# it normalises to nothing; such rows are re-tokenised whole).
_WHITESPACE_PRE_TOKENIZERS = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit", "Metaspace", "ByteLevel"}
_SPLITTING_PRE_TOKENIZERS = _WHITESPACE_PRE_TOKENIZERS | {"Digits", "Punctuation", "UnicodeScripts", "CharDelimiterSplit", "Split"}
_CHARWISE_NORMALIZERS = {"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "StripAccents", "Strip", "Prepend", "Precompiled", "Nmt"}


def _splits_at_whitespace(pre_tokenizer: dict) -> bool:
    kind = pre_tokenizer.get("type")
    if kind == "Metaspace":
        return pre_tokenizer.get("split", True) is not False
    if kind == "ByteLevel":
        return pre_tokenizer.get("use_regex", True) is not False
    return kind in _WHITESPACE_PRE_TOKENIZERS


def _charwise_normalizer(normalizer: Optional[dict]) -> bool:
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_charwise_normalizer(n) for n in normalizer.get("normalizers", []))
    if kind == "Replace":  # a one-character pattern cannot join two words
        pattern = normalizer.get("pattern", {})
        return len(pattern.get("String", "xx")) == 1
    return kind in _CHARWISE_NORMALIZERS


def word_prefix_is_exact(tokenizer) -> bool:
    """Whether cutting texts after their first ``max_length`` words keeps ``tokenizer``'s truncated output (see above):
    a fast tokenizer truncating on the right whose pre-tokenizer splits at whitespace and whose normaliser is
    character-wise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "truncation_side", "right") != "right":
        return False
    try:  # the two components' own JSON (~10 us); the whole tokenizer's would hold the vocabulary
        pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer is not None else {}
        normalizer = json.loads(backend.normalizer.__getstate__()) if backend.normalizer is not None else None
    except Exception:  # an exotic backend: keep the plain path
        return False
    members = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not any(_splits_at_whitespace(m) for m in members) or not all(m.get("type") in _SPLITTING_PRE_TOKENIZERS for m in members):
        return False
    return _charwise_normalizer(normalizer)


_word_prefix_patterns: dict[int, "re.Pattern[str]"] = {}


def cut_after_words(texts: Sequence[str], num_words: int) -> tuple[list[str], int]:
    """Each text cut right after its ``num_words``-th whitespace-separated word (texts with fewer words as they are);
    returns the texts and how many were cut. The cut keeps the original characters (no re-joining of words)."""
    pattern = _word_prefix_patterns.get(num_words)
    if pattern is None:  # possessive quantifiers: a text with fewer words fails without backtracking
        pattern = _word_prefix_patterns[num_words] = re.compile(r"\s*+(?:\S++\s++){" + str(num_words - 1) + r"}\S++")
    out, cut = [], 0
    for text in texts:
        match = pattern.match(text) if len(text) > 2 * num_words else None
        if match is not None and match.end() < len(text):
            out.append(text[: match.end()])
            cut += 1
        else:
            out.append(text)
    return out, cut


def tokenize_texts(tokenizer, texts: Sequence[str], max_length: int, **kwargs):
    """``tokenizer(texts, truncation=True, max_length=max_length, **kwargs)``, with each text first cut after its first
    ``max_length`` words where that cannot change the result (:func:`word_prefix_is_exact`): long texts then cost what
    their kept part costs. A cut text whose tokens no longer fill ``max_length`` (words that normalise to nothing)
    sends the whole batch through the plain call. Memory: one cut copy of each text in the batch."""
    texts = list(texts)
    if max_length and max_length > 1 and word_prefix_is_exact(tokenizer):
        short, cut = cut_after_words(texts, max_length)
        if cut:
            encoded = tokenizer(short, truncation=True, max_length=max_length, **kwargs)
            ids = encoded["input_ids"]
            if isinstance(ids, torch.Tensor):
                mask = encoded.get("attention_mask")
                lengths = mask.sum(dim=1).tolist() if mask is not None else [ids.shape[1]] * ids.shape[0]
            else:
                lengths = [len(row) for row in ids]
            if all(n >= max_length for n, a, b in zip(lengths, short, texts) if a is not b):
                return encoded
    return tokenizer(texts, truncation=True, max_length=max_length, **kwargs)


def _import_peft():
    """The peft module, or an ImportError that names it (models with an encoder adapter need it)."""
    if is_peft_available():  # transformers' remote-code import check skips imports guarded like this
        import peft

        return peft
    raise ImportError("this model's encoder has a peft adapter (config.encoder_adapter): pip install peft")


def _saved_adapter_only(path: str, hub: dict) -> bool:
    """Whether the saved model at ``path`` keeps its encoder as an adapter (its weights load after the rest)."""
    config_path = cached_file(path, CONFIG_FILE, _raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False, **hub)
    if config_path is None:
        return False
    try:
        with open(config_path, encoding="utf-8") as f:
            return bool(json.load(f).get("encoder_adapter_only"))
    except ValueError:
        return False  # from_pretrained names the bad file


def _peft_config(values: dict):
    """A peft config object from its ``to_dict()`` (any adapter type peft knows)."""
    return _import_peft().get_peft_config(dict(values))


def _json_safe(value):
    """``value`` with sets as sorted lists and enums as their values: what config.json can hold."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_json_safe(v) for v in value)
    if isinstance(value, Enum):  # peft's PeftType / TaskType are str enums
        return value.value
    return value


def _repair_tokenizer(tokenizer, encoder_config, name_or_path: str):
    """Rebuild a WordPiece tokenizer from ``vocab.txt`` when its saved ``tokenizer.json`` lost the vocabulary.

    transformers 5 ignores the v4 argument ``BertTokenizerFast(vocab_file=...)``, so tokenizers built that way and
    saved hold only the special tokens and map every word to [UNK]. Such a checkpoint still carries its
    ``vocab.txt``; when the tokenizer covers under half of the encoder's embedding rows, reload from it.
    """
    vocab_size = getattr(encoder_config, "vocab_size", None)
    if not vocab_size or len(tokenizer) * 2 >= vocab_size:
        return tokenizer
    vocab_file = cached_file(name_or_path, "vocab.txt", _raise_exceptions_for_missing_entries=False)
    if vocab_file is None:
        logger.warning("tokenizer of %s has %d tokens for %d embedding rows", name_or_path, len(tokenizer), vocab_size)
        return tokenizer
    special = {k: getattr(tokenizer, k) for k in ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token") if getattr(tokenizer, k, None)}
    repaired = type(tokenizer)(vocab=vocab_file, do_lower_case=getattr(tokenizer, "do_lower_case", True), **special)
    logger.warning(
        "tokenizer of %s holds %d tokens but the encoder has %d embedding rows: rebuilt it from vocab.txt (%d tokens)",
        name_or_path, len(tokenizer), vocab_size, len(repaired),
    )
    return repaired


class XMCPreTrainedModel(PreTrainedModel):
    """Base class of the hf_xmc models: encoder, pooling, label store, label index and ``predict``.

    Subclasses define ``forward`` (the method's training objective) and may override
    :meth:`label_search_vectors` / :meth:`query_search_vectors` when their search space is not plain label-text
    embeddings.
    """

    config: XMCConfig
    base_model_prefix = "xmc"
    main_input_name = "input_ids"
    input_modalities = ("text",)
    supports_gradient_checkpointing = True
    # rows of the label store (and index) per label: 2 for SiameseXML, whose index holds label-text vectors and centroids
    label_store_rows_per_label = 1
    # set by XMCTrainer while it writes a checkpoint: weights under the modules' own names (see save_pretrained)
    trainer_checkpoint_keys = False

    def __init__(self, config: XMCConfig):
        super().__init__(config)
        config.validate_xmc()
        self.encoder = self.build_encoder(config)
        if config.encoder_adapter and not config.encoder_adapter_only:  # a checkpoint: its weights load into the wrapper
            self.encoder = _import_peft().get_peft_model(self.encoder, _peft_config(config.encoder_adapter))
        self.embedding_dropout = nn.Dropout(config.embedding_dropout)
        self.save_adapter_only = False  # save_pretrained's default: merged (the adapter folded into the encoder)
        self.tokenizer = None
        self.label_texts: Optional[list[str]] = None
        self.label_uids: Optional[list[str]] = None
        self.label_embedding_blocks: Optional[list[torch.Tensor]] = None  # the label vectors, as row blocks
        self.label_index: Optional[LabelIndex] = None
        self.model_card: Optional[ModelCardFiles] = None
        # TF-IDF ranker + label-text scores fused with the dense score (lexical_channel.py); None: dense only
        self.lexical_channel: Optional[LexicalChannel] = None

    # ------------------------------------------------------------------ construction
    def build_encoder(self, config: XMCConfig) -> nn.Module:
        """The text encoder: a Hugging Face ``AutoModel`` built from ``config.encoder_config`` (a method with its own
        encoder, e.g. SiameseXML's bag of embeddings, overrides this)."""
        return AutoModel.from_config(config.encoder_config)

    @classmethod
    def from_encoder_pretrained(cls, encoder_name_or_path: str, **config_kwargs) -> "XMCPreTrainedModel":
        """Build a fresh model whose encoder (and tokenizer) start from a pretrained checkpoint.

        ``config_kwargs`` are the method's configuration fields (e.g. ``temperature=0.05``). A sentence-transformers
        checkpoint (``modules.json``) lends its pooling mode to ``pooling`` left out or None, and its normalisation
        when it has a Normalize module (one without keeps the method's cosine scoring); a log line says which; values
        given here win.
        """
        config_kwargs = _config_from_sentence_transformers(encoder_name_or_path, config_kwargs)
        encoder = AutoModel.from_pretrained(encoder_name_or_path)
        tokenizer = _repair_tokenizer(AutoTokenizer.from_pretrained(encoder_name_or_path), encoder.config, encoder_name_or_path)
        config = cls.config_class(encoder_config=encoder.config.to_dict(), **config_kwargs)
        model = cls(config)
        missing, unexpected = model.encoder.load_state_dict(encoder.state_dict(), strict=False)
        if unexpected or [k for k in missing if not k.endswith("position_ids")]:
            raise ValueError(f"encoder weights of {encoder_name_or_path} do not fit: missing={missing} unexpected={unexpected}")
        model.tokenizer = tokenizer
        model.config.encoder_base_model = str(encoder_name_or_path)
        return model

    # ------------------------------------------------------------------ encoder adapters (peft)
    @property
    def has_encoder_adapter(self) -> bool:
        """Whether the encoder is wrapped in a peft adapter (:meth:`add_encoder_adapter`)."""
        return bool(self.config.encoder_adapter)

    def add_encoder_adapter(self, peft_config) -> None:
        """Wrap the encoder in a peft adapter (``peft.LoraConfig(...)``, any peft config, or its ``to_dict()``): only
        the adapter's weights train in the encoder, while heads, label tables and prototypes outside it stay fully
        trainable. The config records it (``config.encoder_adapter``), so checkpoints reload with it in place.
        Saving folds it into the encoder by default (:meth:`save_pretrained`); ``model.save_adapter_only = True``
        saves the adapter alone. Memory: the adapter's weights (LoRA: ``2 r (d_in + d_out)`` per wrapped matrix),
        their gradients and optimizer moments; the encoder's own weights get neither."""
        peft = _import_peft()
        if self.has_encoder_adapter:
            raise ValueError("the encoder already has an adapter: merge_encoder_adapter() first, or keep training this one")
        if not hasattr(self.encoder, "config") or not hasattr(self.encoder, "get_input_embeddings"):
            raise ValueError(f"{type(self.encoder).__name__} is not a transformers encoder: peft adapters need one (SiameseXML: encoder_type='transformer')")
        peft_config = _peft_config(peft_config) if isinstance(peft_config, dict) else peft_config
        self.encoder = peft.get_peft_model(self.encoder, peft_config)
        self.config.encoder_adapter = _json_safe(peft_config.to_dict())

    def merge_encoder_adapter(self) -> None:
        """Fold the adapter into the encoder's weights (peft ``merge_and_unload``): a plain encoder again, that saves
        and loads without peft. Training on from here updates every encoder weight."""
        if not self.has_encoder_adapter:
            raise ValueError("the encoder has no adapter to merge")
        self.encoder = self.encoder.merge_and_unload()
        self.config.encoder_adapter = None
        self.config.encoder_adapter_only = False

    def encoder_adapter_summary(self) -> Optional[str]:
        """One line on the encoder's adapter for a model card: its type and settings, its trainable parameters, and how
        the model saves (merged into the encoder, or the adapter alone on its base encoder); None without one."""
        adapter = self.config.encoder_adapter
        if not adapter:
            return None
        settings = ", ".join(
            f"{k}={', '.join(map(str, v)) if isinstance(v, list) else v}" for k in ("r", "lora_alpha", "lora_dropout", "target_modules")
            if (v := adapter.get(k)) is not None
        )
        trainable = sum(p.numel() for p in self.encoder.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.encoder.parameters())
        line = f"{adapter.get('peft_type', 'adapter')} ({settings}), {trainable:,} trainable of the encoder's {total:,} parameters; "
        if self.save_adapter_only or self.config.encoder_adapter_only:
            return line + f"saved alone (`{ADAPTER_DIR}/`) on the base encoder `{self.config.encoder_base_model}`, which loading fetches (needs `peft`)"
        return line + "merged into the encoder's weights (loads without `peft`)"

    def _merged_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights with the adapter folded into a copy of the encoder, under a plain encoder's names.
        Memory: one copy of the encoder."""
        merged = copy.deepcopy(self.encoder).merge_and_unload()
        state = {k: v for k, v in self.state_dict().items() if not k.startswith("encoder.")}
        state.update({f"encoder.{k}": v for k, v in merged.state_dict().items()})
        return state

    # ------------------------------------------------------------------ encoding
    def pooled_embedding(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **encoder_kwargs) -> torch.Tensor:
        """The encoder's pooled (dropout-regularised, float32) output: one raw vector per text."""
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **encoder_kwargs).last_hidden_state
        pooled = POOLERS[self.config.pooling](hidden, attention_mask)
        return self.embedding_dropout(pooled).float()

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, normalize: Optional[bool] = None, **encoder_kwargs) -> torch.Tensor:
        """Encode token ids into one (dropout-regularised, optionally L2-normalised) vector per text.

        ``normalize`` overrides ``config.normalize`` (PRIME feeds raw label embeddings to its prototype network).
        """
        pooled = self.pooled_embedding(input_ids, attention_mask, **encoder_kwargs)
        if self.config.normalize if normalize is None else normalize:
            pooled = F.normalize(pooled, dim=-1)
        return pooled

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(
                "this model has no tokenizer: load it with from_pretrained(<dir with tokenizer files>) or set "
                "model.tokenizer = AutoTokenizer.from_pretrained(...)"
            )
        return self.tokenizer

    def tokenize(self, texts: Sequence[str], max_length: int) -> dict[str, torch.Tensor]:
        """Tokenise texts with padding to the longest one and truncation to ``max_length`` (long texts cut after
        ``max_length`` words first where that keeps the result: :func:`tokenize_texts`)."""
        return tokenize_texts(self._require_tokenizer(), texts, max_length, padding=True, return_tensors="pt")

    @torch.no_grad()
    def encode_texts(
        self,
        texts: Sequence[str],
        max_length: int,
        batch_size: int = 128,
        show_progress_bar: Optional[bool] = None,
        desc: str = "Encoding",
        normalize: Optional[bool] = None,
        dtype: Optional[torch.dtype] = None,
        **embed_kwargs,
    ) -> torch.Tensor:
        """Embed texts in eval mode, batch by batch (longest first to limit padding); returns ``(n, dim)`` on CPU, in
        ``dtype`` when given (each batch cast as it is written, e.g. float16 to halve a large result).

        Memory: the ``(n, dim)`` result (4 bytes per value in float32, 2 in float16) plus one batch; nothing per text
        is kept besides the sort order (8 bytes).

        ``normalize`` overrides ``config.normalize``; ``embed_kwargs`` go to :meth:`embed` (e.g. UniDEC's ``head``).
        """
        if len(texts) == 0:
            raise ValueError("encode_texts got no texts")
        was_training = self.training
        self.eval()
        order = np.argsort(np.fromiter((-len(t) for t in texts), dtype=np.int64, count=len(texts)), kind="stable")
        out: Optional[torch.Tensor] = None  # (n, dim), allocated once the first batch tells the width
        show = len(texts) > 10 * batch_size if show_progress_bar is None else show_progress_bar
        try:
            for start in tqdm(range(0, len(order), batch_size), desc=desc, disable=not show or progress_bar_disabled(), unit="batch"):
                idx = order[start : start + batch_size]
                batch = self.tokenize([texts[i] for i in idx], max_length)
                batch = {k: v.to(self.device) for k, v in batch.items()}
                emb = self.embed(batch["input_ids"], batch["attention_mask"], normalize=normalize, **embed_kwargs).cpu()
                if out is None:
                    out = torch.empty(len(order), emb.shape[1], dtype=dtype or emb.dtype)
                out[torch.from_numpy(idx)] = emb.to(out.dtype)
        finally:
            self.train(was_training)
        return out

    def encode_queries(
        self, texts: Sequence[str], batch_size: int = 128, show_progress_bar: Optional[bool] = None, dtype: Optional[torch.dtype] = None,
        convert_to_numpy: bool = False, convert_to_tensor: Optional[bool] = None,
    ) -> torch.Tensor | np.ndarray:
        """Embed query texts (``max_seq_length`` tokens): a ``(n, dim)`` CPU tensor, or a numpy array with
        ``convert_to_numpy=True`` (sentence-transformers' ``encode`` returns numpy by default; here a tensor stays the
        default, as before; ``convert_to_tensor=True`` wins over ``convert_to_numpy``, as there). ``dtype`` as in
        :meth:`encode_texts`."""
        vectors = self.encode_texts(texts, self.config.max_seq_length, batch_size, show_progress_bar, desc="Encoding queries", dtype=dtype)
        return _as_requested(vectors, convert_to_numpy, convert_to_tensor)

    def encode_labels(
        self,
        texts: Optional[Sequence[str]] = None,
        batch_size: int = 128,
        show_progress_bar: Optional[bool] = None,
        normalize: Optional[bool] = None,
        convert_to_numpy: bool = False,
        convert_to_tensor: Optional[bool] = None,
        **embed_kwargs,
    ) -> torch.Tensor | np.ndarray:
        """Embed label texts (``label_max_seq_length`` tokens); defaults to the model's own labels. A tensor, or a numpy
        array with ``convert_to_numpy=True``, as :meth:`encode_queries`."""
        texts = self._require_labels() if texts is None else texts
        vectors = self.encode_texts(
            texts, self.config.label_max_seq_length, batch_size, show_progress_bar, desc="Encoding labels", normalize=normalize, **embed_kwargs
        )
        return _as_requested(vectors, convert_to_numpy, convert_to_tensor)

    # ------------------------------------------------------------------ label store and index
    @property
    def label_embeddings(self) -> Optional[torch.Tensor]:
        """``(num_labels, dim)`` label vectors searched by :meth:`predict` (float32, or float16 with
        ``config.label_embeddings_dtype="float16"``), or None. A sharded store loaded from disk is held as its
        memory-mapped shards (``label_embedding_blocks``, which search and save use as they are); reading this
        property joins them into one tensor, a copy, once."""
        blocks = self.label_embedding_blocks
        if blocks is not None and len(blocks) > 1:
            self.label_embedding_blocks = blocks = [torch.cat(blocks)]
        return None if blocks is None else blocks[0]

    @label_embeddings.setter
    def label_embeddings(self, value: Optional[torch.Tensor]) -> None:
        self.label_embedding_blocks = None if value is None else [value]

    def set_labels(self, texts: Sequence[str], uids: Optional[Sequence[str]] = None) -> None:
        """Attach the label space (texts in label-id order); drops any stale embeddings and index."""
        if uids is not None and len(uids) != len(texts):
            raise ValueError(f"got {len(texts)} label texts but {len(uids)} label uids")
        previous = self.label_texts
        self.label_texts = [str(t) for t in texts]
        self.label_uids = [str(u) for u in uids] if uids is not None else [str(i) for i in range(len(texts))]
        self.invalidate_label_index()
        if self.lexical_channel is not None and self.label_texts != previous:
            self.lexical_channel.replace_labels(self.label_texts)

    def invalidate_label_index(self) -> None:
        """Forget label vectors and index (they no longer match the weights, e.g. after an optimiser step)."""
        self.label_embeddings = None
        self.label_index = None

    def _require_labels(self) -> list[str]:
        if not self.label_texts:
            raise ValueError("this model has no labels: call model.set_labels(texts) or build_label_index(label_texts)")
        return self.label_texts

    def label_search_vectors(self, batch_size: int = 128, show_progress_bar: Optional[bool] = None) -> torch.Tensor:
        """Vectors indexed for search, one per label (here: the label-text embeddings)."""
        return self.encode_labels(batch_size=batch_size, show_progress_bar=show_progress_bar)

    def query_search_vectors(self, texts: Sequence[str], batch_size: int = 128, show_progress_bar: Optional[bool] = None) -> torch.Tensor:
        """Vectors searched against the label index, one per query."""
        return self.encode_queries(texts, batch_size=batch_size, show_progress_bar=show_progress_bar)

    def build_label_index(
        self,
        label_texts: Optional[Sequence[str]] = None,
        label_uids: Optional[Sequence[str]] = None,
        kind: Optional[str] = None,
        batch_size: int = 128,
        show_progress_bar: Optional[bool] = None,
        cache_dir: Optional[str] = None,
    ) -> LabelIndex:
        """(Re-)encode the labels with the current weights and build the search index over them. ``cache_dir``: read
        the faiss index from there when it was built from these very vectors, else build it and save it there
        (:meth:`LabelIndex.cached`; a resumed run skips the build)."""
        if label_texts is not None:
            self.set_labels(label_texts, label_uids)
        self._require_labels()
        vectors = self.label_search_vectors(batch_size=batch_size, show_progress_bar=show_progress_bar)
        self.label_embeddings = vectors.to(getattr(torch, self.config.label_embeddings_dtype))
        self.label_index = LabelIndex.cached(self.label_embedding_blocks, cache_dir, kind=kind or self.config.index_kind, ivf_nprobe=self.config.ivf_nprobe)
        return self.label_index

    def search(self, query_vectors: torch.Tensor | np.ndarray, k: int = 5) -> tuple[np.ndarray, np.ndarray]:
        """Top-k label ids and scores for precomputed query vectors (builds the index on first use)."""
        return self.ensure_label_index().search(query_vectors, k)

    def set_lexical_channel(self, channel: Optional[LexicalChannel]) -> None:
        """Attach a fitted lexical channel (``hf_xmc.training.lexical.fit_lexical_channel``) whose scores
        :meth:`predict` fuses with the dense ones, or ``None`` to rank by the dense score alone. ``config.lexical_channel``
        keeps its fusion settings; ``save_pretrained`` writes it as ``lexical_channel.safetensors``."""
        if channel is not None:
            if "image" in self.input_modalities:
                raise ValueError(f"{type(self).__name__} ranks texts and images through its own predict: the lexical channel is for text models")
            labels = self._require_labels()
            if channel.num_labels != len(labels):
                raise ValueError(f"the lexical channel scores {channel.num_labels} labels but the model has {len(labels)}")
        self.lexical_channel = channel
        self.config.lexical_channel = dict(channel.settings) if channel is not None else None

    def search_texts(self, texts: Sequence[str], query_vectors: torch.Tensor | np.ndarray, k: int = 5, return_dense: bool = False):
        """Top-k ``(scores, ids)`` of queries given as texts and their search vectors: the dense search, fused with the
        lexical channel when the model has one (its ``dense_depth`` dense hits and its ranker's hits re-scored). With
        ``return_dense``, returns ``(scores, ids, dense_scores, dense_ids)``: the dense search's own top-k too (the
        same arrays as the fused ones for a model without a channel)."""
        channel = self.lexical_channel
        if channel is None:
            scores, ids = self.search(query_vectors, k)
            return (scores, ids, scores, ids) if return_dense else (scores, ids)
        dense_scores, dense_ids = self.search(query_vectors, max(k, int(channel.settings["dense_depth"])))
        scores, ids = channel.fuse(texts, dense_scores, dense_ids, k)
        return (scores, ids, dense_scores[:, :k], dense_ids[:, :k]) if return_dense else (scores, ids)

    def ensure_label_index(self) -> LabelIndex:
        """The label index: built over the stored label vectors, or over freshly encoded labels, on first use."""
        if self.label_index is None:
            if self.label_embedding_blocks is not None:
                self.label_index = LabelIndex(self.label_embedding_blocks, kind=self.config.index_kind, ivf_nprobe=self.config.ivf_nprobe)
            else:
                self.build_label_index()
        return self.label_index

    # ------------------------------------------------------------------ labels added or removed without retraining
    def add_labels(
        self,
        texts: Sequence[str],
        uids: Optional[Sequence[str]] = None,
        batch_size: int = 128,
        show_progress_bar: Optional[bool] = None,
    ) -> np.ndarray:
        """Append labels, scored zero-shot from their text, while the trained labels keep their learned parameters.

        Each method's fallback (:meth:`_grow_label_state`): DEXML the label-text embedding; PRIME the prototype with a
        zero centroid (as for a label without training queries) and the free vector of its nearest trained label;
        UniDEC the DE embedding and a classifier vector at its initialisation (``N(g2(Phi(z_l)))``); SiameseXML
        ``w_l = N(z~_l)`` (``eta_l = 0``, no centroid). The index grows in place (faiss ``add``: no rebuild of the IVF
        lists or the HNSW graph) where the store keeps one row per label; SiameseXML's ``[z~ ; v]`` store is re-laid
        out and its index rebuilt. ``uids`` default to ``"<label id>"`` and must not repeat. Returns the new label ids.
        ``save_pretrained`` writes the grown model; it reloads as any other. Memory: the new labels' vectors and
        per-label rows only.
        """
        labels = self._require_labels()
        texts = [str(t) for t in ([texts] if isinstance(texts, str) else texts)]
        first = len(labels)
        uids = self._new_label_uids(len(texts), uids)
        if not texts:
            return np.zeros(0, dtype=np.int64)
        index = self.ensure_label_index()  # the trained labels' index, before any table grows
        vectors = self._grow_label_state(texts, batch_size, show_progress_bar)
        self.label_texts = list(labels) + texts
        self.label_uids = list(self.label_uids) + uids
        if self.lexical_channel is not None:
            self.lexical_channel.add_labels(texts)
        if vectors is None:  # the store's layout depends on the label count: rebuild from the label state
            self.build_label_index(batch_size=batch_size, show_progress_bar=show_progress_bar)
        else:
            index.add(vectors.to(index.dtype))
            self.label_embedding_blocks = index.blocks
        return np.arange(first, first + len(texts), dtype=np.int64)

    def remove_labels(self, uids: Sequence[str]) -> np.ndarray:
        """Remove the labels with these uids; the others keep their parameters and are renumbered in order (their new
        ids are their ranks among the kept labels). An IVF index keeps its trained lists (the kept vectors are
        re-added), HNSW is rebuilt (faiss cannot delete from it), exact kinds need nothing; SiameseXML rebuilds from
        its label state. Returns the old ids of the kept labels (new id i = old id ``result[i]``). Memory: one copy of
        the kept vectors."""
        labels = self._require_labels()
        keep = self._kept_label_ids(uids)
        index = self.ensure_label_index()
        same_rows = self._select_label_state(torch.from_numpy(keep))
        self.label_texts = [labels[i] for i in keep]
        self.label_uids = [self.label_uids[i] for i in keep]
        if self.lexical_channel is not None:
            self.lexical_channel.select_labels(keep)
        if same_rows:
            self.label_index = index.select(keep)
            self.label_embedding_blocks = self.label_index.blocks
        else:
            self.build_label_index()
        return keep

    def _new_label_uids(self, count: int, uids: Optional[Sequence[str]]) -> list[str]:
        """``uids`` as strings (default ``"<label id>"``), checked to be new and distinct."""
        first = len(self._require_labels())
        uids = [str(first + i) for i in range(count)] if uids is None else [str(u) for u in uids]
        if len(uids) != count:
            raise ValueError(f"got {count} labels but {len(uids)} uids")
        seen = set(self.label_uids)
        for u in uids:  # one pass: new uids are checked against the model's and the earlier new ones
            if u in seen:
                raise ValueError(f"label uids must be new and distinct: {u!r} is taken")
            seen.add(u)
        return uids

    def _kept_label_ids(self, uids: Sequence[str]) -> np.ndarray:
        """Ids of the labels that stay when those with ``uids`` go; refuses an unknown uid and removing every label."""
        self._require_labels()
        wanted = {str(u) for u in ([uids] if isinstance(uids, str) else uids)}
        unknown = wanted - set(self.label_uids)
        if unknown:
            raise ValueError(f"no label has uid {sorted(unknown)[0]!r}")
        keep = np.array([i for i, u in enumerate(self.label_uids) if u not in wanted], dtype=np.int64)
        if keep.size == 0:
            raise ValueError("cannot remove every label: a model needs at least one")
        return keep

    def _grow_label_state(self, texts: list[str], batch_size: int, show_progress_bar: Optional[bool]) -> Optional[torch.Tensor]:
        """Grow the per-label tables for appended labels and return their search vectors (``(n, dim)``, the index's
        space), or None when the whole store must be rebuilt. Here (DEXML): the label-text embeddings."""
        return self.encode_labels(texts, batch_size=batch_size, show_progress_bar=show_progress_bar)

    def _select_label_state(self, keep: torch.Tensor) -> bool:
        """Keep the per-label table rows of the old label ids ``keep``; True when the index rows can be selected the
        same way (one store row per label), False when the store must be rebuilt. Here: no per-label table."""
        return True

    @staticmethod
    def _concat_rows(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return torch.cat([old, new.to(device=old.device, dtype=old.dtype)])

    def predict(self, texts: Sequence[str] | str, k: Optional[int] = None, batch_size: int = 128, show_progress_bar: Optional[bool] = None,
                threshold: Optional[float] = None) -> XMCPrediction:
        """Rank the model's labels for each text and return the top ``k`` (ids, scores, label texts and, for a calibrated
        model, probabilities). ``threshold``: keep only the labels whose calibrated probability is at least it, among
        the top ``k`` (default 5, or :data:`THRESHOLD_DEPTH` with a threshold); slots left empty hold ``-1``."""
        if isinstance(texts, str):
            texts = [texts]
        k = self._prediction_depth(k, threshold)
        self._require_labels()
        if len(texts) == 0:  # as pipeline([]) gives []: an empty prediction, not an error
            return self._prediction(np.zeros((0, k), dtype=np.int64), np.zeros((0, k), dtype=np.float32), threshold)
        queries = self.query_search_vectors(texts, batch_size=batch_size, show_progress_bar=show_progress_bar)
        scores, ids = self.search_texts(texts, queries, k)
        return self._prediction(ids, scores, threshold)

    # ------------------------------------------------------------------ calibrated scores (calibration.py)
    @property
    def score_calibration(self) -> Optional[ScoreCalibration]:
        """The map from predict's scores to probabilities of relevance (``config.score_calibration``), or None."""
        values = self.config.score_calibration
        if not values:
            return None
        cached = getattr(self, "_score_calibration_cache", None)
        if cached is None or cached[0] is not values:
            cached = (values, ScoreCalibration.from_dict(values))
            self._score_calibration_cache = cached
        return cached[1]

    def set_score_calibration(self, calibration: Optional[ScoreCalibration]) -> None:
        """Attach a fitted calibration (``hf_xmc.training.calibration.fit_score_calibration``), saved in the config;
        None removes it."""
        self.config.score_calibration = calibration.to_dict() if calibration is not None else None

    def _prediction_depth(self, k: Optional[int], threshold: Optional[float]) -> int:
        """``k`` checked, defaulted (5, or :data:`THRESHOLD_DEPTH` with a threshold), and the threshold checked."""
        if threshold is not None:
            if not 0.0 <= float(threshold) <= 1.0:
                raise ValueError(f"threshold is a probability in [0, 1], got {threshold}")
            if self.score_calibration is None:
                raise ValueError(
                    f"{type(self).__name__} has no score calibration, so its scores are no probabilities to threshold: train with a "
                    "validation split (--score_calibration isotonic) or fit one (hf_xmc.training.calibration.fit_score_calibration)"
                )
        k = (THRESHOLD_DEPTH if threshold is not None else 5) if k is None else int(k)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        return k

    def _prediction(self, ids: np.ndarray, scores: np.ndarray, threshold: Optional[float] = None) -> XMCPrediction:
        """An :class:`XMCPrediction` of ranked ``ids`` / ``scores``: label texts, calibrated probabilities, and with a
        ``threshold`` only the labels whose probability reaches it (the rest emptied: ``-1``, ``-inf``, ``""``, 0)."""
        labels = self._require_labels()
        calibration = self.score_calibration
        probabilities = None
        if calibration is not None:
            probabilities = np.where(ids >= 0, calibration(scores), 0.0).astype(np.float32)
            if threshold is not None:
                below = probabilities < np.float32(threshold)
                ids = np.where(below, -1, ids)
                scores = np.where(below, -np.inf, scores).astype(np.float32)
                probabilities = np.where(below, 0.0, probabilities).astype(np.float32)
        names = [[labels[i] if i >= 0 else "" for i in row] for row in ids.tolist()]
        return XMCPrediction(label_ids=ids, scores=scores, label_texts=names, probabilities=probabilities)

    # ------------------------------------------------------------------ what the model needs and came from (its card)
    def base_model_names(self) -> list[str]:
        """``name_or_path`` of every pretrained tower the model started from (here the text encoder; MUFIN adds its
        vision tower): the card's ``base_model``."""
        return [self.config.encoder_config.name_or_path]

    def runtime_requirements(self) -> dict[str, str]:
        """The pip requirements of loading and predicting with this model (no hf_xmc needed), each with why it is
        needed; ``""`` = always. The model card lists them."""
        requirements = {
            "torch": "",
            "transformers>=5.23,<6": "",
            "safetensors": "",
            "faiss-cpu": "the fastest label search (faiss-gpu on a GPU); without it search falls back to exact torch.topk",
        }
        if self.lexical_channel is not None and self.lexical_channel.ranker_files:
            requirements["omikuji"] = "the lexical channel's ranker; without it predict fuses the dense and label-text scores only"
        if self.has_encoder_adapter and (self.save_adapter_only or self.config.encoder_adapter_only):
            requirements["peft>=0.12"] = "the encoder is saved as an adapter: loading rebuilds it from its base encoder and the adapter"
        return requirements

    # ------------------------------------------------------------------ the query encoder as a sentence-transformers checkpoint
    def query_encoder_modules(self) -> list[dict]:
        """What turns the pooled encoder output into this model's query vector, as sentence-transformers modules (read
        by :meth:`save_query_encoder`): ``{"type": "Normalize"}`` and ``{"type": "Dense", "linear": nn.Linear,
        "activation": "torch.nn.modules.activation.Tanh"}`` entries, in order. A method whose query vector is not an
        encoder, a pooling and such layers raises ``NotImplementedError``."""
        return [{"type": "Normalize"}] if self.config.normalize else []

    def save_query_encoder(self, save_directory: str | os.PathLike) -> None:
        """Write the query side of the model (encoder, pooling and the layers of :meth:`query_encoder_modules`) as a
        sentence-transformers checkpoint: ``SentenceTransformer(save_directory).encode(texts)`` gives the vectors
        :meth:`encode_queries` gives (same tokenizer, ``max_seq_length``, pooling and normalisation). The layout is
        sentence-transformers 2-6's (``modules.json``, ``sentence_bert_config.json``, ``1_Pooling/``, ``2_Dense/``,
        ``N_Normalize/``); written to a temporary directory beside ``save_directory`` and renamed, so a failure leaves
        nothing half-written. Memory: one copy of the encoder weights on disk."""
        import shutil

        modules = self.query_encoder_modules()
        if not isinstance(self.encoder, PreTrainedModel):
            raise NotImplementedError(f"{type(self).__name__} has no transformers encoder to save as a sentence-transformers checkpoint")
        save_directory = os.path.abspath(str(save_directory))
        if os.path.exists(save_directory) and os.listdir(save_directory):
            raise ValueError(f"{save_directory}: exists and is not empty; give a new directory")
        parent = os.path.dirname(save_directory)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-st-", dir=parent)
        try:
            self.encoder.save_pretrained(tmp)
            self._require_tokenizer().save_pretrained(tmp)
            listing = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
            with open(os.path.join(tmp, "sentence_bert_config.json"), "w", encoding="utf-8") as f:
                json.dump({"max_seq_length": self.config.max_seq_length, "do_lower_case": False}, f, indent=2)
            width = self.encoder.config.hidden_size
            pooling = {"pooling_mode_cls_token": self.config.pooling == "cls", "pooling_mode_mean_tokens": self.config.pooling == "mean",
                       "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}
            parts = [("Pooling", {"word_embedding_dimension": width, **pooling}, None)]
            for module in modules:
                if module["type"] == "Dense":
                    linear = module["linear"]
                    config = {"in_features": linear.in_features, "out_features": linear.out_features, "bias": linear.bias is not None,
                              "activation_function": module.get("activation", "torch.nn.modules.linear.Identity")}
                    weights = {"linear.weight": linear.weight.detach().float().cpu().contiguous()}
                    if linear.bias is not None:
                        weights["linear.bias"] = linear.bias.detach().float().cpu().contiguous()
                    parts.append(("Dense", config, weights))
                elif module["type"] == "Normalize":
                    parts.append(("Normalize", None, None))
                else:
                    raise ValueError(f"unknown query encoder module {module['type']!r}")
            for idx, (kind, config, weights) in enumerate(parts, start=1):
                sub = f"{idx}_{kind}"
                os.makedirs(os.path.join(tmp, sub))
                if config is not None:
                    with open(os.path.join(tmp, sub, "config.json"), "w", encoding="utf-8") as f:
                        json.dump(config, f, indent=2)
                if weights is not None:
                    save_file(weights, os.path.join(tmp, sub, "model.safetensors"))
                listing.append({"idx": idx, "name": str(idx), "path": sub, "type": f"sentence_transformers.models.{kind}"})
            with open(os.path.join(tmp, ST_MODULES_FILE), "w", encoding="utf-8") as f:
                json.dump(listing, f, indent=2)
            with open(os.path.join(tmp, "config_sentence_transformers.json"), "w", encoding="utf-8") as f:
                json.dump({"prompts": {}, "default_prompt_name": None, "similarity_fn_name": "cosine" if modules and modules[-1]["type"] == "Normalize" else "dot"}, f, indent=2)
            if os.path.exists(save_directory):
                os.rmdir(save_directory)  # empty (checked above)
            os.replace(tmp, save_directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    # ------------------------------------------------------------------ persistence
    @classmethod
    def model_files(cls) -> dict[str, bool]:
        """The files :meth:`save_pretrained` writes beside ``config.json``, the weights and the remote code, each mapped
        to whether a reload needs it (``True``) or it is optional (another tokenizer's file, the index cache, the card).
        The directory check and every push read this one list (:func:`model_directory_files`), so a method that saves
        another file names it here. A sharded label store is named by ``label_embeddings.safetensors.index.json``, which
        stands in for ``label_embeddings.safetensors``; its shards are read from it."""
        files = dict.fromkeys(TOKENIZER_FILES, False)
        files.update({"tokenizer_config.json": True, LABELS_FILE: True, LABEL_EMBEDDINGS_FILE: True, LABEL_EMBEDDINGS_INDEX_FILE: False})
        files.update({INDEX_FILE: False, INDEX_META_FILE: False, ADAPTER_CONFIG_FILE: False, ADAPTER_WEIGHTS_FILE: False, LEXICAL_FILE: False})
        files.update(dict.fromkeys((MODEL_CARD_FILE, *MODEL_CARD_ASSETS), False))
        return files

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        *args,
        is_main_process: bool = True,
        label_shard_size: int | str = LABEL_SHARD_SIZE,
        **kwargs,
    ) -> None:
        """Save weights and config (``PreTrainedModel.save_pretrained``) plus tokenizer, labels, label vectors and index
        (the files of :meth:`model_files`). The label vectors are written in ``config.label_embeddings_dtype``, in
        shards of at most ``label_shard_size`` bytes (:func:`save_label_store`). The config names the XMC pipeline
        (``config.custom_pipelines``), whose file travels with the remote code, so ``pipeline(model=dir,
        trust_remote_code=True)`` works on the saved directory.

        Nothing is lost: the model is written into a staging directory beside ``save_directory`` and moved into place
        in one step (:func:`commit_staged_directory`), so a process killed while saving leaves the previous model
        loadable. What the directory holds beyond the model (checkpoints, logs, metrics) stays; the previous model's
        own files that this save does not write again (stale shards, another tokenizer's vocabulary) go."""
        if self.trainer_checkpoint_keys:
            # a Trainer checkpoint: Trainer resumes by load_state_dict, which expects the module's own parameter names,
            # not the original checkpoint names that save_pretrained converts some back to (ViT's in MUFIN)
            kwargs.setdefault("save_original_format", False)
        if not is_main_process:
            super().save_pretrained(save_directory, *args, is_main_process=False, **kwargs)
            return
        save_directory = os.path.realpath(str(save_directory))
        if os.path.isfile(save_directory):
            raise ValueError(f"{save_directory}: is a file, save_pretrained needs a directory")
        staging = staged_directory_path(save_directory)
        try:
            self._save_model_files(staging, *args, label_shard_size=label_shard_size, **kwargs)
            commit_staged_directory(staging, save_directory, self._replaced_on_save)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def _save_adapted_weights(self, save_directory: str, *args, **kwargs) -> None:
        """The weights of a model whose encoder has an adapter: merged (the default: the adapter folded in, the config
        without it, loadable without peft), or adapter-only (``save_adapter_only``: ``adapter_config.json`` +
        ``adapter_model.safetensors`` for the encoder, the weights outside it in ``model.safetensors``, the base
        encoder named by ``config.encoder_base_model``)."""
        kwargs.pop("state_dict", None)  # the Trainer hands its (unmerged) state dict: the weights are chosen here
        adapter, adapter_only = self.config.encoder_adapter, self.config.encoder_adapter_only
        try:
            if self.save_adapter_only:
                if not self.config.encoder_base_model:
                    raise ValueError("an adapter-only save needs config.encoder_base_model (the encoder the adapter was trained on)")
                self.config.encoder_adapter_only = True
                state = {k: v for k, v in self.state_dict().items() if not k.startswith("encoder.")}
                if state:  # (transformers empties the dict it is given)
                    super().save_pretrained(save_directory, *args, state_dict=state, **kwargs)
                else:  # DEXML: nothing outside the encoder, for which transformers would write no weights file
                    super().save_pretrained(save_directory, *args, state_dict={}, **kwargs)
                    save_file({}, os.path.join(save_directory, WEIGHTS_FILE), metadata={"format": "pt"})
                self.encoder.save_pretrained(os.path.join(save_directory, ADAPTER_DIR))  # adapter_config.json + adapter_model.safetensors
            else:
                self.config.encoder_adapter, self.config.encoder_adapter_only = None, False
                super().save_pretrained(save_directory, *args, state_dict=self._merged_state_dict(), **kwargs)
        finally:
            self.config.encoder_adapter, self.config.encoder_adapter_only = adapter, adapter_only

    @classmethod
    def _replaced_on_save(cls, name: str) -> bool:
        """Whether ``name`` in a directory being saved over is a file of the previous model (dropped unless the new save
        writes it again): config, weights and their shards, and :meth:`model_files` but the card (which a training run
        writes after the model)."""
        if name in (MODEL_CARD_FILE, *MODEL_CARD_ASSETS):
            return False
        return (
            name in cls.model_files() or name in (CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE, "generation_config.json", ADAPTER_DIR)
            or bool(WEIGHT_SHARD_PATTERN.fullmatch(name) or LABEL_SHARD_PATTERN.fullmatch(name))
        )

    def _save_model_files(self, save_directory: str, *args, label_shard_size: int | str = LABEL_SHARD_SIZE, **kwargs) -> None:
        """Write every file of the model into the (new, empty) directory ``save_directory``."""
        # a relative import: transformers copies pipeline_xmc.py with the modeling files (and into the remote-code cache)
        from .pipeline_xmc import XMC_PIPELINE_INFO, XMC_PIPELINE_TASK

        self.config.custom_pipelines = {XMC_PIPELINE_TASK: dict(XMC_PIPELINE_INFO)}
        self.config.lexical_channel = dict(self.lexical_channel.settings) if self.lexical_channel is not None else None
        if self.has_encoder_adapter and not self.trainer_checkpoint_keys:
            self._save_adapted_weights(save_directory, *args, **kwargs)
        else:  # a plain encoder, or a Trainer checkpoint (the adapter's own weights and names: resume loads them)
            super().save_pretrained(save_directory, *args, **kwargs)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(save_directory)
        if self.label_texts is not None:
            atomic_write(os.path.join(save_directory, LABELS_FILE), self._write_labels)
        if self.label_embedding_blocks is not None:
            dtype = getattr(torch, self.config.label_embeddings_dtype)
            save_label_store(save_directory, self.label_embedding_blocks, dtype, label_shard_size)
            if self.label_index is not None:
                self.label_index.save(save_directory)
        if self.lexical_channel is not None:
            self.lexical_channel.save(os.path.join(save_directory, LEXICAL_FILE))
        if self.model_card is not None:
            self.model_card.save(save_directory)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: Optional[str] = None,
        commit_description: Optional[str] = None,
        private: Optional[bool] = None,
        token: Optional[bool | str] = None,
        revision: Optional[str] = None,
        create_pr: bool = False,
        max_shard_size: int | str = "50GB",
        tags: Optional[list[str]] = None,
        api: Optional[HfApi] = None,
    ) -> str:
        """Upload the model with its label store and card to the Hub in one commit; returns the commit URL.

        Everything :meth:`save_pretrained` writes goes up: weights (safetensors), config with ``auto_map``, the
        flat remote-code files, tokenizer, ``labels.jsonl``, label vectors, the index and the model card
        (``self.model_card``, or a minimal one when the model has none). Unlike ``PreTrainedModel.push_to_hub``
        the card is not replaced by the Hub's existing one. ``revision`` names a branch (created if missing);
        ``api`` lets tests and tools inject an ``HfApi``-like client.
        """
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp, max_shard_size=max_shard_size)
            if self.model_card is None:
                default_model_card(self, repo_id, tags).save(tmp)
            return upload_model_folder(
                tmp, repo_id, api=api, commit_message=commit_message or f"Upload {type(self).__name__}",
                commit_description=commit_description, private=private, token=token, revision=revision, create_pr=create_pr,
                allow_patterns=model_directory_files(tmp, type(self)),
            )

    def _write_labels(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for uid, text in zip(self.label_uids, self.label_texts):
                f.write(json.dumps({"uid": uid, "text": text}, ensure_ascii=False) + "\n")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, use_saved_index: Optional[bool] = None, **kwargs):
        """Load weights and config, then the tokenizer, labels, label vectors and index saved beside them, and check the
        whole directory before anything is served (:mod:`model_files`): a fault is one :class:`ModelFileError` line naming
        the file. Weights load strictly: a tensor of the model missing from the weights file, one the model has no place
        for, or one of another shape (unless ``ignore_mismatched_sizes=True``) is refused by name.

        ``use_saved_index``: read the saved faiss index (``label_index.faiss``, HNSW / IVF) instead of building it from the
        label vectors. ``None`` (default): from a local directory yes, from a Hub repo no (faiss parses the file's native
        bytes); either way a file read back is checked against the label vectors and rebuilt from them if it does not
        match (:meth:`LabelIndex.load`)."""
        from safetensors import SafetensorError

        path = str(pretrained_model_name_or_path)
        hub = {k: kwargs[k] for k in ("cache_dir", "revision", "token", "local_files_only", "subfolder") if k in kwargs}

        def fetch(name: str) -> Optional[str]:
            return cls._fetch_artifact(path, name, hub)

        check_weights_index(fetch, WEIGHTS_FILE, WEIGHTS_INDEX_FILE)  # before transformers opens a shard it names
        want_info = kwargs.pop("output_loading_info", False)
        mismatched_ok = bool(kwargs.get("ignore_mismatched_sizes", False))
        kwargs["ignore_mismatched_sizes"] = True  # a mismatch comes back in the report and is refused below, by name
        quiet = _saved_adapter_only(path, hub)  # the encoder's weights come later: no "missing" report
        verbosity = logging.get_verbosity()
        report_filter = DropLoadReport()  # its entries become the one-line error below
        logging.get_logger("transformers.modeling_utils").addFilter(report_filter)
        try:
            if quiet:
                logging.set_verbosity_error()
            model, info = super().from_pretrained(pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs)
        except SafetensorError as err:
            raise ModelFileError(
                f"{fetch(WEIGHTS_FILE) or fetch(WEIGHTS_INDEX_FILE) or path}: not valid safetensors ({err}); it is truncated or "
                "corrupt: download it again (or save the model again)"
            ) from None
        except RuntimeError as err:  # transformers' "Error(s) in loading state_dict", weight conversion errors
            if "state_dict" not in str(err) and "conversion" not in str(err):
                raise
            raise ModelFileError(f"{fetch(WEIGHTS_FILE) or fetch(WEIGHTS_INDEX_FILE) or path}: {str(err).strip()}") from None
        finally:
            logging.set_verbosity(verbosity)
            logging.get_logger("transformers.modeling_utils").removeFilter(report_filter)
        weights_path = fetch(WEIGHTS_FILE) or fetch(WEIGHTS_INDEX_FILE) or file_name(path, WEIGHTS_FILE)
        encoder_later = (lambda key: key.startswith("encoder.")) if model.config.encoder_adapter_only else (lambda key: False)
        check_weights_report(info, weights_path, cls.__name__, encoder_later, mismatched_ok)
        model._use_saved_index = os.path.isdir(path) if use_saved_index is None else bool(use_saved_index)
        model._load_artifacts(path, hub)
        model._check_loaded_artifacts(path, fetch)
        return (model, info) if want_info else model

    def _load_encoder_from_base_and_adapter(self, path: str, adapter_path: Optional[str], hub: dict) -> None:
        """An adapter-only save: the encoder's weights from ``config.encoder_base_model``, then the adapter's."""
        peft = _import_peft()
        if adapter_path is None:
            raise ValueError(f"{path}: config.json says the encoder is saved as an adapter, but there is no {ADAPTER_WEIGHTS_FILE}")
        base_hub = {k: v for k, v in hub.items() if k in ("cache_dir", "token", "local_files_only")}  # the base's own revision
        base = AutoModel.from_pretrained(self.config.encoder_base_model, **base_hub)
        missing, unexpected = self.encoder.load_state_dict(base.state_dict(), strict=False)
        if unexpected or [k for k in missing if not k.endswith("position_ids")]:
            raise ValueError(f"{self.config.encoder_base_model}: its weights do not fit this model's encoder (missing {missing[:3]}, unexpected {unexpected[:3]})")
        self.encoder = peft.get_peft_model(self.encoder, _peft_config(self.config.encoder_adapter)).to(next(self.parameters()).device)
        result = peft.set_peft_model_state_dict(self.encoder, read_safetensors(adapter_path))
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"{adapter_path}: adapter weights that the encoder has no place for: {result.unexpected_keys[:3]}")
        self.encoder.train(self.training)  # from_pretrained left the model in eval mode: the adapter's dropout too

    @staticmethod
    def _fetch_artifact(path: str, name: str, hub: dict) -> Optional[str]:
        """Local path of file ``name`` of a model directory or Hub repo (through the HF cache); None if it has none."""
        return cached_file(path, name, _raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False, **hub)

    def _load_artifacts(self, path: str, hub: dict) -> None:
        def fetch(name: str) -> Optional[str]:
            return self._fetch_artifact(path, name, hub)

        if self.config.encoder_adapter_only:
            self._load_encoder_from_base_and_adapter(path, fetch(ADAPTER_WEIGHTS_FILE), hub)

        if fetch("tokenizer_config.json") is not None:
            # Hand over the encoder's config so AutoTokenizer does not re-read config.json (with its auto_map,
            # that would prompt for trust_remote_code again); the tokenizer itself is a stock class.
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(path, config=self.config.encoder_config, **hub)
            except Exception as err:  # a half-written tokenizer.json, a vocabulary file that is no vocabulary, ...
                name = "tokenizer.json" if fetch("tokenizer.json") is not None else "tokenizer_config.json"
                raise ModelFileError(f"{file_name(path, name)}: the tokenizer does not load ({type(err).__name__}: {err})") from None
        labels_path = fetch(LABELS_FILE)
        if labels_path is not None:
            self.label_uids, self.label_texts = read_labels(labels_path)
        blocks = load_label_store(fetch)  # memory-mapped, in the precision they were saved in
        if blocks is not None:
            self._label_store_path = fetch(LABEL_EMBEDDINGS_INDEX_FILE) or fetch(LABEL_EMBEDDINGS_FILE)
            num_vectors = sum(b.shape[0] for b in blocks)
            per_label = self.label_store_rows_per_label
            if self.label_texts is not None and num_vectors != per_label * len(self.label_texts):
                raise ModelFileError(
                    f"{self._label_store_path}: holds {num_vectors} label vectors but {LABELS_FILE} lists {len(self.label_texts)} labels"
                    + (f" ({per_label} vectors per label expected)" if per_label != 1 else "")
                )
            self.label_embedding_blocks = blocks
            self.label_index = LabelIndex.load(blocks, meta_path=fetch(INDEX_META_FILE), index_path=self._saved_index_path(fetch), kind=self.config.index_kind)
        if self.config.score_calibration:
            try:
                ScoreCalibration.from_dict(self.config.score_calibration)
            except (ValueError, TypeError) as err:
                raise ModelFileError(f"{file_name(path, CONFIG_FILE)}: score_calibration is malformed ({err})") from None
        if self.config.lexical_channel:
            lexical_path = fetch(LEXICAL_FILE)
            if lexical_path is None:
                raise ModelFileError(f"{file_name(path, LEXICAL_FILE)}: missing, but config.json names a lexical channel")
            channel = LexicalChannel.load(lexical_path, self.config.lexical_channel)
            if self.label_texts is not None and channel.num_labels != len(self.label_texts):
                raise ModelFileError(f"{lexical_path}: scores {channel.num_labels} labels but {LABELS_FILE} lists {len(self.label_texts)}")
            self.lexical_channel = channel
        card_path = fetch(MODEL_CARD_FILE)
        if card_path is not None:
            files = {MODEL_CARD_FILE: card_path}
            files.update({name: fetch(name) for name in MODEL_CARD_ASSETS})
            self.model_card = ModelCardFiles({name: _read_bytes(p) for name, p in files.items() if p is not None})

    def _saved_index_path(self, fetch: Callable[[str], Optional[str]]) -> Optional[str]:
        """The saved faiss index to read back (``from_pretrained(use_saved_index=)``), or None: the index is then built
        from the label vectors. A Hub repo's faiss file is not even downloaded unless asked for."""
        if not getattr(self, "_use_saved_index", True) or self.config.index_kind not in ("hnsw", "ivf"):
            return None
        return fetch(INDEX_FILE)

    def _check_loaded_artifacts(self, path: str, fetch: Callable[[str], Optional[str]]) -> None:
        """What only the loaded model as a whole can tell (after every ``_load_artifacts``): :func:`check_loaded_model`."""
        check_loaded_model(self, path, fetch, getattr(self, "_label_store_path", None) or path)
