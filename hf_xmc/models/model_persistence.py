"""Saving and loading an hf_xmc model as one directory (or Hub repo): :class:`XMCPersistenceMixin` of
``XMCPreTrainedModel``.

``save_pretrained`` writes the weights and config (``PreTrainedModel.save_pretrained``) and everything that rides with
them: tokenizer, ``labels.jsonl``, the label vectors (``label_store.py``), the label index, the lexical channel, the
ONNX and static query encoders and the model card, into a staging directory renamed into place in one step
(``io_utils.commit_staged_directory``: a process killed while saving leaves the previous model loadable).
``from_pretrained`` reads them back through ``cached_file`` (a local directory and a Hub repo id alike) and checks the
whole directory before anything is served (``model_files.py``); ``push_to_hub`` uploads what ``save_pretrained``
wrote in one commit. The list of a model's files is :meth:`XMCPersistenceMixin.model_files`, read by the directory
check and every push.

Memory: a save holds one batch of label vectors at a time beyond the model (``save_label_store`` writes them in
shards); a load memory-maps the label store.

This file is part of the remote-code bundle: it imports only torch, transformers, huggingface_hub and its siblings.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional

import torch
from huggingface_hub import HfApi
from transformers import AutoTokenizer
from transformers.utils import logging
from transformers.utils.hub import cached_file

from .calibration import ScoreCalibration
from .encoder_utils import saved_adapter_only
from .hub_files import ModelCardFiles, default_model_card, model_directory_files, upload_model_folder
from .io_utils import atomic_write, commit_staged_directory, read_bytes, staged_directory_path
from .label_file import RECORD_KEY as LABELS_RECORD_KEY
from .label_file import open_labels_file, write_labels_file
from .label_index import INDEX_FILE, INDEX_META_FILE, LabelIndex
from .label_store import (
    LABEL_EMBEDDINGS_FILE,
    LABEL_EMBEDDINGS_INDEX_FILE,
    LABEL_SHARD_PATTERN,
    LABEL_SHARD_SIZE,
    LABELS_FILE,
    load_label_store,
    save_label_store,
)
from .lexical_channel import LEXICAL_FILE, LexicalChannel
from .model_files import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_DIR,
    ADAPTER_WEIGHTS_FILE,
    CONFIG_FILE,
    MODEL_CARD_ASSETS,
    MODEL_CARD_FILE,
    TOKENIZER_FILES,
    WEIGHT_SHARD_PATTERN,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    DropLoadReport,
    ModelFileError,
    check_loaded_model,
    check_weights_index,
    check_weights_report,
    file_name,
    read_labels,
)
from .onnx_encoder import ONNX_ENCODER_FILE, ONNX_ENCODER_META
from .static_encoder import STATIC_ENCODER_FILE, STATIC_ENCODER_META


class XMCPersistenceMixin:
    """``save_pretrained`` / ``from_pretrained`` / ``push_to_hub`` of ``XMCPreTrainedModel`` and the files they
    write and read (module docstring). It comes before the other mixins in the model's bases, so its ``super()``
    reaches ``PreTrainedModel``'s."""

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
        files.update(dict.fromkeys((MODEL_CARD_FILE, *MODEL_CARD_ASSETS, ONNX_ENCODER_FILE, ONNX_ENCODER_META, STATIC_ENCODER_FILE, STATIC_ENCODER_META), False))
        return files

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        *args,
        is_main_process: bool = True,
        label_shard_size: int | str = LABEL_SHARD_SIZE,
        label_precision: Optional[str] = None,
        **kwargs,
    ) -> None:
        """Save weights and config (``PreTrainedModel.save_pretrained``) plus tokenizer, labels, label vectors and index
        (the files of :meth:`model_files`). The label vectors are written in ``config.label_embeddings_dtype``, in
        shards of at most ``label_shard_size`` bytes (:func:`save_label_store`). ``label_precision`` (float32, float16,
        int8, binary) changes the model's store or search codes first (:meth:`set_label_precision`). The config names the XMC pipeline
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
        if label_precision is not None:
            self.set_label_precision(label_precision)
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
        # labels.jsonl first: config.json records the file written (a load reads its rows on demand: label_file.py)
        setattr(self.config, LABELS_RECORD_KEY, None)
        if self.label_texts is not None:
            atomic_write(os.path.join(save_directory, LABELS_FILE), self._write_labels)
        if self.has_encoder_adapter and not self.trainer_checkpoint_keys:
            self._save_adapted_weights(save_directory, *args, **kwargs)
        else:  # a plain encoder, or a Trainer checkpoint (the adapter's own weights and names: resume loads them)
            super().save_pretrained(save_directory, *args, **kwargs)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(save_directory)
        if self.label_embedding_blocks is not None:
            dtype = getattr(torch, self.config.label_embeddings_dtype)
            save_label_store(save_directory, self.label_embedding_blocks, dtype, label_shard_size)
            if self.label_index is not None:
                self.label_index.save(save_directory)
        if self.lexical_channel is not None:
            self.lexical_channel.save(os.path.join(save_directory, LEXICAL_FILE))
        self._save_onnx_encoder(save_directory)
        self._save_static_encoder(save_directory)
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
        record = write_labels_file(path, self.label_uids, self.label_texts, self.labels_digest())
        setattr(self.config, LABELS_RECORD_KEY, record)

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
        quiet = saved_adapter_only(path, hub)  # the encoder's weights come later: no "missing" report
        verbosity = logging.get_verbosity()
        report_filter = DropLoadReport()  # its entries become the one-line error below
        logging.get_logger("transformers.modeling_utils").addFilter(report_filter)
        try:
            if quiet:
                logging.set_verbosity_error()
            started = time.perf_counter()
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
        model.load_seconds = {"weights": round(time.perf_counter() - started, 4)}
        model._load_artifacts(path, hub)
        with model._loading("checks"):
            model._check_loaded_artifacts(path, fetch)
        model.load_seconds["total"] = round(time.perf_counter() - started, 4)
        return (model, info) if want_info else model

    @contextmanager
    def _loading(self, part: str) -> Iterator[None]:
        """Time one part of ``from_pretrained`` into ``self.load_seconds`` (weights, tokenizer, labels, label store,
        label index, lexical channel, query encoders, checks, total): what a cold load spends where (``/info`` shows it)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = self.__dict__.setdefault("load_seconds", {})
            seconds[part] = round(seconds.get(part, 0.0) + time.perf_counter() - start, 4)

    @staticmethod
    def _fetch_artifact(path: str, name: str, hub: dict) -> Optional[str]:
        """Local path of file ``name`` of a model directory or Hub repo (through the HF cache); None if it has none."""
        return cached_file(path, name, _raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False, **hub)

    def _load_artifacts(self, path: str, hub: dict) -> None:
        def fetch(name: str) -> Optional[str]:
            return self._fetch_artifact(path, name, hub)

        if self.config.encoder_adapter_only:
            with self._loading("weights"):
                self._load_encoder_from_base_and_adapter(path, fetch(ADAPTER_WEIGHTS_FILE), hub)
        with self._loading("tokenizer"):
            self._load_tokenizer(path, hub, fetch)
        labels_path = fetch(LABELS_FILE)
        if labels_path is not None:
            with self._loading("labels"):
                self._read_labels(labels_path)
        with self._loading("label_store"):
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
            with self._loading("label_index"):
                self.label_index = LabelIndex.load(blocks, meta_path=fetch(INDEX_META_FILE), index_path=self._saved_index_path(fetch),
                                                   kind=self.config.index_kind, codes=self.config.label_codes)
        if self.config.score_calibration:
            try:
                ScoreCalibration.from_dict(self.config.score_calibration)
            except (ValueError, TypeError) as err:
                raise ModelFileError(f"{file_name(path, CONFIG_FILE)}: score_calibration is malformed ({err})") from None
        if self.config.lexical_channel:
            lexical_path = fetch(LEXICAL_FILE)
            if lexical_path is None:
                raise ModelFileError(f"{file_name(path, LEXICAL_FILE)}: missing, but config.json names a lexical channel")
            with self._loading("lexical_channel"):
                channel = LexicalChannel.load(lexical_path, self.config.lexical_channel)
            if self.label_texts is not None and channel.num_labels != len(self.label_texts):
                raise ModelFileError(f"{lexical_path}: scores {channel.num_labels} labels but {LABELS_FILE} lists {len(self.label_texts)}")
            self.lexical_channel = channel
        with self._loading("query_encoders"):
            self._load_onnx_encoder(fetch)
            self._load_static_encoder(fetch)
        card_path = fetch(MODEL_CARD_FILE)
        if card_path is not None:
            files = {MODEL_CARD_FILE: card_path}
            files.update({name: fetch(name) for name in MODEL_CARD_ASSETS})
            self.model_card = ModelCardFiles({name: read_bytes(p) for name, p in files.items() if p is not None})

    def _read_labels(self, path: str) -> None:
        """``labels.jsonl``: left unparsed, its rows read on demand, when it is the file this model's config records
        (``label_file.py``: the recorded label digest is the model's); else read and checked whole (:func:`read_labels`)."""
        with open(path, "rb") as f:
            data = f.read()
        rows = open_labels_file(data, getattr(self.config, LABELS_RECORD_KEY, None), path)
        if rows is None:
            self.label_uids, self.label_texts = read_labels(path, data)
            return
        self.label_uids, self.label_texts = rows.uids, rows.texts
        self.seed_labels_digest(rows.digest)

    def _load_tokenizer(self, path: str, hub: dict, fetch: Callable[[str], Optional[str]]) -> None:
        """The tokenizer saved beside the weights, if any (one :class:`ModelFileError` line when it does not load)."""
        if fetch("tokenizer_config.json") is not None:
            # Hand over the encoder's config so AutoTokenizer does not re-read config.json (with its auto_map,
            # that would prompt for trust_remote_code again); the tokenizer itself is a stock class.
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(path, config=self.config.encoder_config, **hub)
            except Exception as err:  # a half-written tokenizer.json, a vocabulary file that is no vocabulary, ...
                name = "tokenizer.json" if fetch("tokenizer.json") is not None else "tokenizer_config.json"
                raise ModelFileError(f"{file_name(path, name)}: the tokenizer does not load ({type(err).__name__}: {err})") from None

    def _saved_index_path(self, fetch: Callable[[str], Optional[str]]) -> Optional[str]:
        """The saved faiss index to read back (``from_pretrained(use_saved_index=)``), or None: the index is then built
        from the label vectors. A Hub repo's faiss file is not even downloaded unless asked for."""
        if not getattr(self, "_use_saved_index", True) or not LabelIndex.keeps_file(self.config.index_kind, self.config.label_codes):
            return None
        return fetch(INDEX_FILE)

    def _check_loaded_artifacts(self, path: str, fetch: Callable[[str], Optional[str]]) -> None:
        """What only the loaded model as a whole can tell (after every ``_load_artifacts``): :func:`check_loaded_model`."""
        check_loaded_model(self, path, fetch, getattr(self, "_label_store_path", None) or path)
