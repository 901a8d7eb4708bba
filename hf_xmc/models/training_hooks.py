"""The trainer-model contract: everything ``XMCTrainer`` (and the training code under ``hf_xmc/training``) may ask a
model, declared once with its default, as :class:`XMCTrainingHooks`, a base of ``XMCPreTrainedModel``.

A method overrides what it needs; the trainer reads these attributes and calls these methods directly, never probing
for them. The defaults describe a plain dual encoder (DEXML): no per-label state, one learning rate, weight decay on
every weight but biases and norms, gradient caching in any number of processes.

Remote-code file: imports only torch.
"""

from typing import Optional

import torch


class XMCTrainingHooks:
    """What the trainer asks a model (see the module docstring). Memory: nothing; the hooks hold no state."""

    #: Parameter names (or dotted suffixes of them) trained without weight decay, besides transformers' own choice
    #: (biases, norms): PRIME's free-vector bank, SiameseXML's classifier and token embeddings.
    no_weight_decay_parameters: tuple[str, ...] = ()
    #: False when the loss has trainable parameters outside the encoder's forward (PRIME's prototype network, the
    #: classifier tables): a gradient cache replays only the encoder through DDP, so it cannot synchronise their
    #: gradients across processes, and the trainer refuses ``--gradient_cache_chunk_size`` with several processes.
    supports_distributed_gradient_cache: bool = True
    #: False when every process applies the same buffer update itself (PRIME's centroid bank, 4 d bytes per label):
    #: the trainer then turns off DDP's broadcast of buffers from rank 0 at every forward. None: DDP's default.
    ddp_broadcast_buffers: Optional[bool] = None
    #: The search mode hard negatives are mined in (UniDEC: ``"de"``, the paper's Sec. 3.2); None: the one ``predict``
    #: uses. Mining switches to it with ``using_search_mode`` and back.
    hard_negative_search_mode: Optional[str] = None

    @property
    def needs_label_state(self) -> bool:
        """True while per-label state must still be set up from the training data before the first step of a fresh run
        (PRIME: free-vector map and centroids; UniDEC: classifier vectors from the label texts). The trainer then calls
        ``hf_xmc.training.label_state.initialize_label_state``, which calls :meth:`initialize_label_state` first. A
        resumed run never asks: its checkpoint holds the state."""
        return False

    def initialize_label_state(self, train_texts, train_targets, seed: int = 0, batch_size: int = 128, show_progress_bar: Optional[bool] = None) -> bool:
        """Set up the per-label state itself and return True (UniDEC), or return False to leave it to the trainer's
        generic initialiser (PRIME's: free vectors clustered from the label embeddings, centroids streamed over the
        training queries, then ``set_label_state``). Called only while :attr:`needs_label_state` is True."""
        return False

    #: Fields of the model's config that shape its own ranking and that a run tunes on its validation split once
    #: training is over, each with the values tried (``hf_xmc.training.evaluation.tune_ranking_settings``; SiameseXML:
    #: the classifier's share of the fused score). Empty: nothing to tune.
    tunable_ranking_settings: dict[str, tuple[float, ...]] = {}

    def parameter_learning_rates(self, base_lr: float) -> dict[str, float]:
        """Learning rate per parameter-name prefix for the optimizer (UniDEC: the heads at a multiple of ``base_lr``,
        the classifier vectors at their own rate); every other parameter trains at ``base_lr``. Here: none."""
        return {}

    def clustering_vectors(self, query_embeds: torch.Tensor) -> torch.Tensor:
        """The vectors cluster batching groups queries by, from the ``query_embeds`` of the model's output (UniDEC:
        its DE-head space). Here: the query embeddings themselves."""
        return query_embeds

    def pool_loss(self, query_embeds: torch.Tensor, label_embeds: torch.Tensor, targets: Optional[torch.Tensor] = None,
                  positive_index: Optional[torch.Tensor] = None, label_ids: Optional[torch.Tensor] = None,
                  query_positive_ids: Optional[torch.Tensor] = None) -> tuple[Optional[torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, logits, loss_terms)`` of query embeddings against a label pool's: the part of ``forward`` after the
        encoder, which a gradient cache calls once on the whole batch after embedding it in chunks. ``loss_terms``:
        the detached terms of a multi-term objective, for the training log (empty for one term)."""
        raise ValueError(f"{type(self).__name__} has no pool_loss(query_embeds, label_embeds, ...): gradient caching needs it")

    def check_all_label_loss(self) -> None:
        """Raise unless the model can train with ``label_pool="all"`` (every label in every step's softmax; DEXML)."""
        raise ValueError(
            f"{type(self).__name__} does not support label_pool='all' (the all-label mode is DEXML's): use label_pool='in_batch' or 'psl'"
        )

    def all_label_loss(self, query_embeds: torch.Tensor, label_embeds: torch.Tensor, query_positive_ids: torch.Tensor,
                       label_offset: int = 0, chunk_size: int = 1024) -> torch.Tensor:
        """The loss of the queries against every label (``label_pool="all"``); :meth:`check_all_label_loss` says
        whether the model has one."""
        self.check_all_label_loss()
        raise NotImplementedError
