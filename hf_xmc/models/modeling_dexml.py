"""DEXML: a pure dual encoder for extreme multi-label classification.

Gupta et al., "Efficacy of Dual-Encoders for Extreme Multi-Label Classification", ICLR 2024. One shared
encoder embeds queries and label texts; the score is their inner product (cosine when ``normalize``); there
are no per-label parameters, so the model size does not grow with the label space. Training uses the
DecoupledSoftmax loss over a label pool (in-batch positives, optionally hard negatives or all labels),
with the query's other positives masked out of each positive's denominator. In the all-label mode
(:meth:`DEXMLModel.all_label_loss`) every label is a negative in every step, scored chunk by chunk and, with several
processes, sharded across them.
"""


from typing import Optional

import torch

from .all_label_loss import all_label_softmax_loss
from .configuration_dexml import DEXMLConfig
from .encoder_utils import all_gather_id_lists, all_gather_rows, distributed_world_size, gather_label_pool
from .modeling_xmc import XMCPreTrainedModel
from .xmc_losses import get_loss

# losses that the all-label mode (``label_pool="all"``) computes chunk by chunk: name -> ``decoupled`` flag
ALL_LABEL_LOSSES = {"decoupled_softmax": True, "softmax": False}


class DEXMLPreTrainedModel(XMCPreTrainedModel):
    """Weights initialisation and loading glue for DEXML."""

    config: DEXMLConfig
    base_model_prefix = "dexml"


class DEXMLModel(DEXMLPreTrainedModel):
    """The DEXML dual encoder.

    ``forward`` embeds a batch of queries and a pool of labels with the same encoder and, given ``targets``,
    returns the configured pool loss (DecoupledSoftmax by default). ``predict`` ranks the model's labels
    through its label index.

    Example:
        >>> model = DEXMLModel.from_encoder_pretrained("sentence-transformers/all-MiniLM-L6-v2")
        >>> model.build_label_index(["Games: Strategy", "Development: Library"])
        >>> model.predict(["0ad : Real-time strategy game"], k=1).label_texts
    """

    def __init__(self, config: DEXMLConfig):
        super().__init__(config)
        loss_kwargs = {"k": config.topk_k, "alpha": config.topk_alpha, "n_iter": config.topk_n_iter} if config.loss == "soft_topk" else {}
        self.loss_fn = get_loss(config.loss, **loss_kwargs)
        self.post_init()

    def pool_loss(self, query_embeds: torch.Tensor, label_embeds: torch.Tensor, targets: Optional[torch.Tensor] = None,
                  positive_index: Optional[torch.Tensor] = None, label_ids: Optional[torch.Tensor] = None,
                  query_positive_ids: Optional[torch.Tensor] = None) -> tuple[Optional[torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
        """Loss, logits and (no) loss terms of query embeddings against a label pool (the part of ``forward`` after the
        encoder: ``XMCTrainingHooks.pool_loss``). Kept separate so that a gradient cache can embed in chunks and call
        it once on the whole batch.
        """
        if self.training and label_ids is not None and query_positive_ids is not None and distributed_world_size() > 1:
            label_embeds, targets, positive_index, _ = gather_label_pool(label_embeds, label_ids, query_positive_ids, positive_index)
        logits = query_embeds @ label_embeds.T / self.config.temperature
        loss = self.loss_fn(logits, targets.bool(), positive_index) if targets is not None else None
        return loss, logits, {}

    def check_all_label_loss(self) -> None:
        """Raise unless ``config.loss`` has an all-label implementation (DecoupledSoftmax or SoftmaxCE)."""
        if self.config.loss not in ALL_LABEL_LOSSES:
            raise ValueError(
                f"label_pool='all' supports the losses {sorted(ALL_LABEL_LOSSES)}, not {self.config.loss!r}: "
                "use label_pool='in_batch' (optionally with hard negatives) for this loss"
            )

    def all_label_loss(
        self,
        query_embeds: torch.Tensor,
        label_embeds: torch.Tensor,
        query_positive_ids: torch.Tensor,
        label_offset: int = 0,
        chunk_size: int = 1024,
    ) -> torch.Tensor:
        """The configured loss of the queries against *every* label (DEXML's brute-force mode), ``chunk_size`` labels
        at a time; no ``(batch, L)`` tensor is built.

        Args:
            query_embeds: ``(batch, dim)`` this process's query embeddings.
            label_embeds: ``(L_r, dim)`` this process's contiguous shard of the label embeddings (all ``L`` labels with
                one process), starting at global label id ``label_offset``.
            query_positive_ids: ``(batch, P)`` each query's positive label ids, ``-1``-padded.

        With several processes the queries (with gradient) and their positive ids are gathered from every process, and
        the shards' log-sum-exps are joined with all-reduces (:func:`all_label_softmax_loss`): every process returns
        the loss of the global batch, and the DDP-averaged gradient equals the one-process gradient of that batch.
        """
        self.check_all_label_loss()
        distributed = distributed_world_size() > 1
        if distributed:
            query_embeds = all_gather_rows(query_embeds, with_grad=True)
            query_positive_ids = all_gather_id_lists(query_positive_ids)
        return all_label_softmax_loss(
            query_embeds,
            label_embeds,
            query_positive_ids,
            self.config.temperature,
            label_offset=label_offset,
            chunk_size=chunk_size,
            decoupled=ALL_LABEL_LOSSES[self.config.loss],
            distributed=distributed,
        )


__all__ = ["DEXMLModel", "DEXMLPreTrainedModel"]
