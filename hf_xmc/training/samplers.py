"""NGAME cluster batching: a memory bank of query embeddings and a batch sampler over clusters of similar queries.

NGAME (Dahiya et al., "NGAME: Negative Mining-aware Mini-batching for Extreme Classification", WSDM 2023), and
PRIME / DEXA after it, obtain hard in-batch negatives without any ANN mining by building every batch out of a few
whole clusters of similar training queries. The schedule (facts of the official code, LF-AmazonTitles-131K config):

* Each training step writes the detached embeddings of its queries into a memory bank
  (:class:`EmbeddingMemoryBank`), so clustering uses embeddings from the previous epoch(s) at no extra cost.
* Before the first clustering every query is its own cluster: batches are a plain random permutation.
* Re-clustering (balanced hierarchical spherical 2-means, :func:`~hf_xmc.training.clustering.balanced_2means_tree`)
  happens at the start of epochs ``start, start + refresh_interval, ...`` with ``start = min(curriculum_epochs)``
  (10, 15, 20, ... by default), and also whenever the cluster size changes.
* ``start_epoch`` may move the first clustering elsewhere, also *within* an epoch (0.05: a twentieth into the
  first, for runs shorter than an epoch): the queries the epoch has not served yet are then re-ordered by cluster
  (:meth:`ClusterBatchSampler.cluster_within_epoch`), the batches already served stay as they were, so every query is
  still seen once an epoch; re-clustering then happens at the epoch starts after it, every ``refresh_interval``.
* Curriculum: the target cluster size starts at ``init_cluster_size`` (4) and doubles at every epoch of
  ``curriculum_epochs`` (10, 25, 50, 75, 100, 125, 150, 200), i.e. the number of clusters
  ``2^ceil(log2(N / cluster_size))`` halves; the first clustering (epoch 10) already uses the doubled size.
* Each epoch the clusters are shuffled, their members shuffled, everything is concatenated and cut into batches,
  so a batch holds a few whole clusters (clusters may straddle two batches).

With several processes the sampler cuts *global* batches of ``batch_size * num_replicas`` and gives each rank a
contiguous slice, so the similar queries of one global batch are spread over the ranks and an all-gather of the
query / label embeddings reconstructs the whole cluster batch on every rank.

``mode="one_per_batch"`` is UniDEC's batching (official code: the tree is grown to leaves of about the batch size and
each batch is one leaf): the queries are split into ``2^ceil(log2(N / global_batch))`` balanced leaves, so a leaf holds
between half a global batch and a global batch (sizes differ by at most one; the batch size itself when the batch is
``N / 2^k``, as the paper's |Q_B| are), and every batch is one whole leaf; the curriculum does not apply
(clustering starts at ``min(curriculum_epochs)``, before that the leaves are random). Never above the batch size the
user chose (the official code rounds the other way, leaves of 1-2 batch sizes), as that is the memory budget.

Memory: the assignment is 8 bytes per query (int64), an epoch's order another 8 bytes per query; the memory bank
(:class:`EmbeddingMemoryBank`) 4 d bytes per query in float32 (2 d in float16) plus one byte. Batches are index
lists of at most ``batch_size`` entries.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, Optional, Union

import numpy as np
import torch
from torch.utils.data import Sampler

from .clustering import balanced_2means_tree, num_tree_levels

__all__ = ["ClusterBatchSampler", "EmbeddingMemoryBank"]

ArrayLike = Union[np.ndarray, torch.Tensor]


class EmbeddingMemoryBank:
    """CPU store of the latest detached embedding of every training query (rows are written during training).

    Args:
        num_samples: number of training queries (rows).
        dim: embedding size.
        dtype: storage dtype, ``torch.float32`` (default) or ``torch.float16`` / ``"float16"`` to halve memory.
    """

    def __init__(self, num_samples: int, dim: int, dtype: Union[torch.dtype, str] = torch.float32) -> None:
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"unsupported memory-bank dtype {dtype}")
        if num_samples <= 0 or dim <= 0:
            raise ValueError(f"num_samples and dim must be positive, got {num_samples}, {dim}")
        self.embeddings = torch.zeros(num_samples, dim, dtype=dtype)
        self.filled = torch.zeros(num_samples, dtype=torch.bool)

    @property
    def num_samples(self) -> int:
        """Number of rows."""
        return self.embeddings.shape[0]

    @property
    def dim(self) -> int:
        """Embedding size."""
        return self.embeddings.shape[1]

    @property
    def num_filled(self) -> int:
        """Rows written at least once."""
        return int(self.filled.sum())

    @torch.no_grad()
    def update(self, indices: ArrayLike, embeddings: torch.Tensor) -> None:
        """Write ``embeddings[i]`` (detached, moved to CPU) into row ``indices[i]``; later duplicates win."""
        idx = torch.as_tensor(indices).to(device="cpu", dtype=torch.long).reshape(-1)
        emb = embeddings.detach().to(device="cpu", dtype=self.embeddings.dtype)
        if emb.dim() != 2 or emb.shape[0] != idx.numel() or emb.shape[1] != self.dim:
            raise ValueError(f"expected embeddings of shape ({idx.numel()}, {self.dim}), got {tuple(emb.shape)}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_samples):
            raise IndexError(f"memory-bank indices must lie in [0, {self.num_samples})")
        self.embeddings[idx] = emb
        self.filled[idx] = True

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Embeddings and filled mask (tensors only, so ``torch.load(weights_only=True)`` works)."""
        return {"embeddings": self.embeddings.clone(), "filled": self.filled.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore from :meth:`state_dict` (shape must match; the dtype is converted to this bank's)."""
        emb, filled = state["embeddings"], state["filled"]
        if tuple(emb.shape) != tuple(self.embeddings.shape) or filled.numel() != self.num_samples:
            raise ValueError(f"memory-bank state of shape {tuple(emb.shape)} does not match {tuple(self.embeddings.shape)}")
        self.embeddings.copy_(emb.to(self.embeddings.dtype))
        self.filled.copy_(filled.to(torch.bool).reshape(-1))


class ClusterBatchSampler(Sampler[list[int]]):
    """Batch sampler that cuts batches from shuffled clusters of similar queries (NGAME schedule).

    Use it as ``DataLoader(dataset, batch_sampler=sampler)``. Per epoch: ``set_epoch(e)``; if
    ``needs_refresh(e)``, ``update_clusters(embeddings)`` (done automatically at ``iter`` time when a
    ``memory_bank`` is attached); then iterate.

    Args:
        num_samples: number of training queries.
        batch_size: per-rank batch size.
        init_cluster_size: cluster size before the first curriculum step (NGAME: 4).
        curriculum_epochs: epochs at which the cluster size doubles; the first one is also the first clustering.
            Empty: never cluster (random batches).
        refresh_interval: re-cluster every this many epochs from ``min(curriculum_epochs)`` on (from the first epoch
            start at or after ``start_epoch`` when that is given).
        start_epoch: when the queries are first clustered, in epochs (None: ``min(curriculum_epochs)``). A fraction
            clusters within an epoch (``concat`` mode only), through :meth:`cluster_within_epoch`.
        seed: seed of the shuffles and of the clustering.
        drop_last: drop the last incomplete global batch (otherwise it is kept; with several replicas it is
            padded by wrapping around to the start of the epoch's order so that every rank gets a full batch).
        num_replicas / rank: data-parallel world size and this process's rank.
        memory_bank: optional :class:`EmbeddingMemoryBank`; when set, ``__iter__`` re-clusters from it whenever
            :meth:`needs_refresh` says so.
        mode: ``"concat"`` (NGAME: shuffled clusters concatenated and cut into fixed-size batches; clusters grow by
            the curriculum) or ``"one_per_batch"`` (UniDEC: leaves of at most ``batch_size * num_replicas`` queries,
            one leaf per global batch; ``init_cluster_size`` and the later curriculum epochs are not used). In
            ``one_per_batch`` each rank takes a contiguous slice of ``ceil(leaf / num_replicas)`` queries of the leaf
            (a leaf that ``num_replicas`` does not divide repeats its first members to fill the last slice, so that
            every rank steps with the same batch size) and ``drop_last`` does not apply (leaves are nearly equal).
    """

    MODES = ("concat", "one_per_batch")

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        init_cluster_size: int = 4,
        curriculum_epochs: Sequence[int] = (10, 25, 50, 75, 100, 125, 150, 200),
        refresh_interval: int = 5,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
        memory_bank: Optional[EmbeddingMemoryBank] = None,
        mode: str = "concat",
        start_epoch: Optional[float] = None,
    ) -> None:
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {mode!r}")
        if start_epoch is not None and (start_epoch < 0 or (mode != "concat" and start_epoch != int(start_epoch))):
            raise ValueError(f"start_epoch must be >= 0 (a whole number of epochs in {mode!r} mode), got {start_epoch}")
        if num_samples <= 0 or batch_size <= 0 or init_cluster_size <= 0 or refresh_interval <= 0:
            raise ValueError("num_samples, batch_size, init_cluster_size and refresh_interval must be positive")
        if num_replicas <= 0 or not 0 <= rank < num_replicas:
            raise ValueError(f"need 0 <= rank < num_replicas, got rank={rank}, num_replicas={num_replicas}")
        if memory_bank is not None and memory_bank.num_samples != num_samples:
            raise ValueError(f"memory bank has {memory_bank.num_samples} rows, sampler has {num_samples} samples")
        self.num_samples = int(num_samples)
        self.batch_size = int(batch_size)
        self.init_cluster_size = int(init_cluster_size)
        self.curriculum_epochs = tuple(sorted(int(e) for e in curriculum_epochs))
        self.refresh_interval = int(refresh_interval)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.memory_bank = memory_bank
        self.mode = mode
        self.start_epoch = None if start_epoch is None else float(start_epoch)
        self.epoch = 0
        self.assignment: Optional[np.ndarray] = None  # cluster id per query; None = every query its own cluster
        self.assigned_cluster_size: Optional[int] = None  # target cluster size the assignment was made for
        self.clustered_epoch: Optional[int] = None  # epoch at which the assignment was made
        self.split_batch: Optional[int] = None  # the assignment was made within its epoch, after this many batches
        self._order: Optional[np.ndarray] = None  # the epoch's (padded) global order while it is iterated
        self._served = 0  # batches of the epoch yielded so far

    # ----------------------------------------------------------------- schedule
    @property
    def global_batch_size(self) -> int:
        """``batch_size * num_replicas``: the size of the batches cut from the cluster order."""
        return self.batch_size * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Record the epoch about to start (drives the shuffles and the schedule)."""
        self.epoch = int(epoch)

    def cluster_size(self, epoch: Optional[int] = None) -> int:
        """Target cluster size at ``epoch``: ``init_cluster_size`` doubled at every curriculum epoch reached
        (``one_per_batch``: the global batch size, at every epoch)."""
        if self.mode == "one_per_batch":
            return self.global_batch_size
        epoch = self.epoch if epoch is None else int(epoch)
        return self.init_cluster_size * 2 ** sum(epoch >= c for c in self.curriculum_epochs)

    def num_clusters(self, epoch: Optional[int] = None) -> int:
        """``2^ceil(log2(num_samples / cluster_size(epoch)))`` (at least 1)."""
        ratio = self.num_samples / self.cluster_size(epoch)
        return 2 ** max(0, math.ceil(math.log2(ratio))) if ratio > 1 else 1

    @property
    def first_clustering(self) -> float:
        """When the queries are first clustered, in epochs (``start_epoch``, else ``min(curriculum_epochs)``; inf: never)."""
        if self.start_epoch is not None:
            return self.start_epoch
        return float(self.curriculum_epochs[0]) if self.curriculum_epochs else math.inf

    def needs_refresh(self, epoch: Optional[int] = None) -> bool:
        """Whether the queries should be (re)clustered at the start of ``epoch``.

        True from the first clustering on every ``refresh_interval`` epochs (counted from the first epoch start at or
        after it), and whenever the current assignment was made for another cluster size (size doubled, or no
        clustering yet, e.g. after a resume); False if the assignment was already made at this epoch.
        """
        epoch = self.epoch if epoch is None else int(epoch)
        if epoch < self.first_clustering or self.clustered_epoch == epoch:
            return False
        periodic = (epoch - math.ceil(self.first_clustering)) % self.refresh_interval == 0
        return periodic or self.assigned_cluster_size != self.cluster_size(epoch)

    def clustering_due_within(self, epoch: float) -> bool:
        """Whether training at (fractional) ``epoch`` has reached a ``start_epoch`` that falls within an epoch and the
        queries are not clustered yet: the caller then runs :meth:`cluster_within_epoch` between two steps."""
        start = self.start_epoch
        return start is not None and start != int(start) and self.assignment is None and epoch + 1e-9 >= start

    def cluster_within_epoch(self, embeddings: Union[ArrayLike, EmbeddingMemoryBank]) -> np.ndarray:
        """The first clustering, between two steps of the current epoch: cluster the embeddings and re-order the
        queries the epoch has not served yet by cluster (the next batch yielded is cut from them); the batches
        already served keep their queries, so every query is still seen once this epoch. The split point is kept
        (:meth:`state_dict`), so a resumed run rebuilds the same order. Returns the cluster ids."""
        if self.mode != "concat" or self.assignment is not None:
            raise RuntimeError("cluster_within_epoch is the first clustering of a 'concat' sampler")
        assign = self.update_clusters(embeddings, self.epoch)
        self.split_batch = self._served
        if self._order is not None:  # iterating: the rest of the epoch follows the clusters from the next batch on
            self._order = self._padded(self.epoch_order(self.epoch))
        return assign

    def update_clusters(self, embeddings: Union[ArrayLike, EmbeddingMemoryBank], epoch: Optional[int] = None) -> np.ndarray:
        """Cluster the ``(num_samples, d)`` embeddings (or a memory bank) for ``epoch``; stores and returns the ids."""
        epoch = self.epoch if epoch is None else int(epoch)
        if isinstance(embeddings, EmbeddingMemoryBank):
            embeddings = embeddings.embeddings
        if int(embeddings.shape[0]) != self.num_samples:
            raise ValueError(f"got {embeddings.shape[0]} embeddings for {self.num_samples} samples")
        assign = balanced_2means_tree(embeddings, self.num_clusters(epoch), seed=self.seed + epoch)
        self.set_assignment(assign, epoch)
        return assign

    def set_assignment(self, assignment: Optional[ArrayLike], epoch: Optional[int] = None) -> None:
        """Install a cluster assignment computed elsewhere (e.g. on rank 0 and broadcast); None = singletons."""
        epoch = self.epoch if epoch is None else int(epoch)
        if assignment is None:
            self.assignment, self.assigned_cluster_size, self.clustered_epoch = None, None, None
            return
        assign = np.asarray(assignment.cpu() if isinstance(assignment, torch.Tensor) else assignment, dtype=np.int64).reshape(-1)
        if assign.size != self.num_samples:
            raise ValueError(f"assignment has {assign.size} entries for {self.num_samples} samples")
        if assign.size and assign.min() < 0:
            raise ValueError("cluster ids must be non-negative")
        self.assignment = assign
        self.assigned_cluster_size = self.cluster_size(epoch)
        self.clustered_epoch = epoch
        self.split_batch = None

    # ----------------------------------------------------------------- batches
    def epoch_order(self, epoch: Optional[int] = None) -> np.ndarray:
        """The epoch's global order: shuffled clusters, members shuffled inside each (seeded by ``seed + epoch``).
        In the epoch clustered within (:meth:`cluster_within_epoch`): the random order the epoch began with up to
        the split, then the queries it had not served, grouped by cluster."""
        epoch = self.epoch if epoch is None else int(epoch)
        rng = np.random.default_rng(self.seed + epoch)
        if self.assignment is None:
            return rng.permutation(self.num_samples)
        if self.split_batch is not None and self.clustered_epoch == epoch:
            served = rng.permutation(self.num_samples)[: self.split_batch * self.global_batch_size]
            rest = np.ones(self.num_samples, dtype=bool)
            rest[served] = False
            return np.concatenate([served, self._grouped(np.flatnonzero(rest), np.random.default_rng((self.seed, epoch, 1)))])
        return self._grouped(np.arange(self.num_samples), rng)

    def _grouped(self, ids: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """``ids`` ordered by shuffled cluster, members shuffled inside each."""
        num_c = int(self.assignment.max()) + 1
        cluster_pos = np.empty(num_c, dtype=np.int64)
        cluster_pos[rng.permutation(num_c)] = np.arange(num_c)
        within = rng.random(ids.size)
        return ids[np.lexsort((within, cluster_pos[self.assignment[ids]]))]

    def _padded(self, order: np.ndarray) -> np.ndarray:
        """With several replicas, ``order`` wrapped around to fill every rank's last batch."""
        total = len(self) * self.global_batch_size
        if self.num_replicas > 1 and total > order.size:
            order = np.concatenate([order, np.resize(order, total - order.size)])
        return order

    def num_leaves(self) -> int:
        """``one_per_batch``: batches per epoch, the number of leaves of the tree (the same at every epoch, so the
        Trainer's step count holds; an assignment installed with :meth:`set_assignment` counts its clusters)."""
        if self.assignment is not None:
            return int(np.count_nonzero(np.bincount(self.assignment)))
        return 2 ** num_tree_levels(self.num_samples, self.num_clusters())

    def leaf_batches(self, epoch: Optional[int] = None) -> list[np.ndarray]:
        """``one_per_batch``: the epoch's global batches, one leaf each, in shuffled order with shuffled members
        (before the first clustering: a random permutation split into :meth:`num_leaves` near-equal parts)."""
        epoch = self.epoch if epoch is None else int(epoch)
        order = self.epoch_order(epoch)
        if self.assignment is None:
            return np.array_split(order, self.num_leaves())
        # epoch_order groups the members of each cluster; cut it at the cluster boundaries
        ids = self.assignment[order]
        cuts = np.flatnonzero(ids[1:] != ids[:-1]) + 1
        return np.split(order, cuts)

    def __len__(self) -> int:
        """Batches per epoch for this rank (the same on every rank)."""
        if self.mode == "one_per_batch":
            return self.num_leaves()
        full, rest = divmod(self.num_samples, self.global_batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def __iter__(self) -> Iterator[list[int]]:
        """Yield this rank's slice of every global batch of the current epoch."""
        if self.memory_bank is not None and self.needs_refresh(self.epoch):
            self.update_clusters(self.memory_bank, self.epoch)
        if self.mode == "one_per_batch":
            for leaf in self.leaf_batches(self.epoch):
                per_rank = -(-leaf.size // self.num_replicas)
                if per_rank * self.num_replicas > leaf.size:
                    leaf = np.resize(leaf, per_rank * self.num_replicas)  # repeats the leaf's first members
                yield leaf[self.rank * per_rank : (self.rank + 1) * per_rank].tolist()
            return
        # read at every batch: cluster_within_epoch may re-order what the epoch has not served yet
        self._order, self._served = self._padded(self.epoch_order(self.epoch)), 0
        for b in range(len(self)):
            start = b * self.global_batch_size + self.rank * self.batch_size
            batch = self._order[start : start + self.batch_size].tolist()
            self._served = b + 1
            yield batch
        self._order = None

    # ----------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        """Epoch, seed and current assignment (as a LongTensor) so that a resumed run reproduces the batches."""
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "assignment": None if self.assignment is None else torch.from_numpy(self.assignment.copy()),
            "assigned_cluster_size": self.assigned_cluster_size,
            "clustered_epoch": self.clustered_epoch,
            "split_batch": self.split_batch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        if int(state.get("num_samples", self.num_samples)) != self.num_samples:
            raise ValueError(f"sampler state is for {state['num_samples']} samples, not {self.num_samples}")
        self.epoch = int(state["epoch"])
        self.seed = int(state["seed"])
        assign = state.get("assignment")
        if assign is None:
            self.set_assignment(None)
        else:
            self.set_assignment(assign, int(state["clustered_epoch"]))
            self.assigned_cluster_size = state.get("assigned_cluster_size", self.assigned_cluster_size)
            self.split_batch = state.get("split_batch")
