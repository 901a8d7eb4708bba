"""XMCEpochCallback: the start-of-epoch (and within-epoch) work of :class:`~hf_xmc.training.trainer.XMCTrainer`:
the collator's epoch, NGAME re-clustering, the hard-negative schedule, and the checkpointing of what they produce."""

from __future__ import annotations

import logging
import math
import os
import time
from typing import TYPE_CHECKING, Optional

import torch
from transformers import TrainerCallback

from .negatives import mine_hard_negatives, mining_autocast
from .samplers import EmbeddingMemoryBank

if TYPE_CHECKING:
    from .trainer import XMCTrainer

logger = logging.getLogger(__name__)


class XMCEpochCallback(TrainerCallback):
    """Start-of-epoch work of :class:`XMCTrainer` (collator epoch, NGAME re-clustering, hard-negative refresh), and
    the checkpointing of what that work produced, so a resumed run continues with the same batches."""

    # the checkpoint's own state, with no pickle: tensors in safetensors, the rest in JSON
    STATE_FILE = "xmc_training_state.safetensors"
    STATE_META_FILE = "xmc_training_state.json"
    LEGACY_STATE_FILE = "xmc_training_state.pt"  # written by hf_xmc before; read with weights_only=True only

    def __init__(self, trainer: XMCTrainer):
        self.trainer = trainer
        self.mined_epoch: Optional[float] = None  # the schedule point the shortlist was mined for (a resumed run does not re-mine)
        # wall seconds of this process's passes that only pick training examples (XMCTrainer.train reports them as
        # train_mining_seconds / train_clustering_seconds): what a cheaper query tower could take off a training run
        self.mining_seconds = self.clustering_seconds = 0.0

    def mining_due(self, args, epoch: float) -> Optional[float]:
        """The point of the mining schedule (``--hard_negative_start_epoch`` + j ``--hard_negative_refresh_interval``,
        in epochs) that training at ``epoch`` has reached and whose shortlist is not mined yet; None when none is."""
        if not getattr(args, "hard_negatives", 0):
            return None
        start, every = float(args.hard_negative_start_epoch), float(args.hard_negative_refresh_interval)
        if epoch + 1e-9 < start:
            return None
        point = start + math.floor((epoch - start) / every + 1e-9) * every
        if self.mined_epoch is not None and self.mined_epoch >= point - 1e-9:
            return None
        return point

    def mine(self, args, point: float, fill_memory_bank: bool = False) -> None:
        """Mine the shortlist of every training query with the current weights (its filter pairs excluded).
        ``fill_memory_bank``: the pass's query vectors (in the hard-negative search space, which is every model's
        clustering space) also overwrite the memory bank's rows, for a clustering at the same point: no second
        encoding pass and no memory beyond the bank's own."""
        trainer = self.trainer
        data = trainer.xmc_train_data
        bank = trainer.memory_bank if fill_memory_bank else None
        started = time.perf_counter()
        with mining_autocast(trainer.model, args.mining_precision):
            shortlist = mine_hard_negatives(trainer.model, data.texts, data.targets, top_k=args.hard_negative_top_k,
                                            show_progress_bar=not args.disable_tqdm, exclude=data.filter_matrix,
                                            query_sink=bank.update if bank is not None else None)
        trainer.data_collator.set_shortlist(shortlist)
        trainer.model.invalidate_label_index()
        self.mined_epoch = point
        self.mining_seconds += time.perf_counter() - started

    def on_step_begin(self, args, state, control, **kwargs):
        # a schedule point within an epoch (fractional start or interval): mined / clustered between two steps; the
        # batch of this step is already built, so the shortlist and the clusters serve from the next one on
        epoch = float(state.epoch or 0)
        sampler = self.trainer.cluster_sampler
        cluster_now = sampler is not None and sampler.clustering_due_within(epoch)
        point = self.mining_due(args, epoch)
        if point is not None and point != int(point) and hasattr(self.trainer.data_collator, "set_shortlist"):
            logger.info("epoch %.3f: mining the hard-negative shortlist", epoch)
            self.mine(args, point, fill_memory_bank=cluster_now)
        if cluster_now:  # from the bank when the mining pass just filled it, else a fresh encoding pass
            started = time.perf_counter()
            sampler.cluster_within_epoch(self._query_embeddings())
            self.clustering_seconds += time.perf_counter() - started
            logger.info("epoch %.3f: clustered %d queries into clusters of %d", epoch, sampler.num_samples, sampler.cluster_size())
        return control

    def on_epoch_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        epoch = int(state.epoch or 0)
        collator = trainer.data_collator
        if hasattr(collator, "set_epoch"):
            collator.set_epoch(epoch)
        sampler = trainer.cluster_sampler
        if sampler is not None:
            sampler.set_epoch(epoch)
            if sampler.needs_refresh(epoch):  # False when a resumed epoch was already clustered
                started = time.perf_counter()
                sampler.update_clusters(self._query_embeddings())
                self.clustering_seconds += time.perf_counter() - started
                logger.info("epoch %d: clustered %d queries into clusters of %d", epoch, sampler.num_samples, sampler.cluster_size(epoch))
        point = self.mining_due(args, float(epoch))
        if point is not None and point == epoch and hasattr(collator, "set_shortlist"):  # due right at this epoch's start
            self.mine(args, point)
        return control

    @classmethod
    def write_state(cls, directory: str, state: dict) -> None:
        """:meth:`state_dict` as ``xmc_training_state.safetensors`` (the tensors: cluster assignment, memory bank,
        shortlist) + ``xmc_training_state.json`` (epochs, seed, sizes), each written atomically: nothing a resume
        reads is a pickle. Memory: one CPU copy of the shortlist (``4 K`` bytes per training point)."""
        from safetensors.torch import save_file

        from ..models.io_utils import atomic_write, write_json

        tensors: dict[str, torch.Tensor] = {}
        meta = {"mined_epoch": state["mined_epoch"], "sampler": None, "memory_bank": state["memory_bank"] is not None, "shortlist": state["shortlist"] is not None,
                "inputs": state.get("inputs")}
        if state["sampler"] is not None:
            meta["sampler"] = {k: v for k, v in state["sampler"].items() if k != "assignment"}
            if state["sampler"]["assignment"] is not None:
                tensors["sampler.assignment"] = state["sampler"]["assignment"]
        if state["memory_bank"] is not None:
            tensors.update({f"memory_bank.{k}": v for k, v in state["memory_bank"].items()})
        if state["shortlist"] is not None:
            tensors["shortlist"] = torch.as_tensor(state["shortlist"])
        tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        atomic_write(os.path.join(directory, cls.STATE_FILE), lambda p: save_file(tensors, p, metadata={"format": "pt"}))
        atomic_write(os.path.join(directory, cls.STATE_META_FILE), lambda p: write_json(p, meta))

    @classmethod
    def read_state(cls, directory: str) -> Optional[dict]:
        """What :meth:`write_state` wrote in a checkpoint directory, as :meth:`state_dict` returns it; None without
        it. A checkpoint of an older hf_xmc holds ``xmc_training_state.pt``: it is read with ``weights_only=True`` (no
        code runs), and refused with a one-line message when that cannot read it."""
        import json

        from safetensors.torch import load_file

        meta_path, tensor_path = os.path.join(directory, cls.STATE_META_FILE), os.path.join(directory, cls.STATE_FILE)
        if os.path.exists(meta_path) and os.path.exists(tensor_path):
            with open(meta_path, encoding="utf-8") as f:
                meta = json.load(f)
            tensors = load_file(tensor_path)
            sampler = None
            if meta["sampler"] is not None:
                sampler = {**meta["sampler"], "assignment": tensors.get("sampler.assignment")}
            bank = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("memory_bank.")} if meta["memory_bank"] else None
            shortlist = tensors["shortlist"].numpy() if meta["shortlist"] else None
            return {"mined_epoch": meta["mined_epoch"], "sampler": sampler, "memory_bank": bank, "shortlist": shortlist,
                    "inputs": meta.get("inputs"), "path": meta_path}
        legacy = os.path.join(directory, cls.LEGACY_STATE_FILE)
        if not os.path.exists(legacy):
            return None
        try:
            return torch.load(legacy, weights_only=True)
        except Exception as err:  # a pickle of arbitrary objects: never unpickled
            raise ValueError(
                f"{legacy}: not loaded, it is a pickle that torch.load(weights_only=True) refuses ({type(err).__name__}); "
                "resume from a checkpoint written by this version, or start the run again"
            ) from None

    def inputs_fingerprint(self) -> dict:
        """What the state's rows were made from (``provenance.py``, part ``training_shortlists``): the training queries
        (their uids, in order), their targets and the training filter. Memory: one pass over the targets' CSR arrays."""
        from ..models.provenance import array_digest, digest, fingerprint_of

        data = self.trainer.xmc_train_data
        if data is None:
            return {}
        targets = data.targets.tocsr()
        filt = data.filter_matrix
        return fingerprint_of(queries=digest(data.uids), targets=array_digest(targets.indptr, targets.indices),
                              train_filter=array_digest(filt.tocsr().indptr, filt.tocsr().indices) if filt is not None else None)

    def state_dict(self) -> dict:
        """Sampler (assignment and the epoch it was made for), memory bank, shortlist and its epoch, and the
        fingerprint of the training queries they were made for."""
        trainer = self.trainer
        return {
            "inputs": self.inputs_fingerprint(),
            "mined_epoch": self.mined_epoch,
            "sampler": trainer.cluster_sampler.state_dict() if trainer.cluster_sampler is not None else None,
            "memory_bank": trainer.memory_bank.state_dict() if trainer.memory_bank is not None else None,
            "shortlist": getattr(trainer.data_collator, "shortlist", None),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved; refused in one line when it was made for other training queries,
        targets or filter (another --seed carving another validation split, another training file): its rows would
        belong to other queries."""
        from ..models.provenance import check_derived

        if state.get("inputs"):
            check_derived("training_shortlists", state["inputs"], self.inputs_fingerprint(), state.get("path", "the checkpoint's training state"),
                          "resume with the same data, --seed and validation flags, or train into a new --output_dir")
        trainer = self.trainer
        self.mined_epoch = state["mined_epoch"]
        if state["sampler"] is not None and trainer.cluster_sampler is not None:
            trainer.cluster_sampler.load_state_dict(state["sampler"])
        if state["memory_bank"] is not None:
            bank = state["memory_bank"]
            trainer.memory_bank = EmbeddingMemoryBank(len(trainer.xmc_train_data), bank["embeddings"].shape[1])
            trainer.memory_bank.load_state_dict(bank)
        if state["shortlist"] is not None and hasattr(trainer.data_collator, "set_shortlist"):
            trainer.data_collator.set_shortlist(state["shortlist"])

    def _query_embeddings(self) -> torch.Tensor:
        """The memory bank when every query has an embedding in it, else a fresh encoding pass."""
        bank = self.trainer.memory_bank
        if bank is not None and bool(bank.filled.all()):
            return bank.embeddings
        model, args = self.trainer.model, self.trainer.args
        with mining_autocast(model, args.mining_precision):
            return model.encode_queries(self.trainer.xmc_train_data.texts, show_progress_bar=not args.disable_tqdm)
