"""Labels added to or removed from a trained model without retraining: :class:`LabelSpaceMixin`, a base of
``XMCPreTrainedModel`` (docs/new_labels.md).

Remote-code file. Memory: adding costs the new labels' vectors and per-label rows only; removing, one copy of the kept
vectors.
"""

from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch


class LabelSpaceMixin:
    """``add_labels`` / ``remove_labels`` of ``XMCPreTrainedModel`` (which holds the labels, their vectors, the index
    and the lexical channel); a method with per-label tables overrides :meth:`_grow_label_state` and
    :meth:`_select_label_state`."""

    #: ``save_pretrained(label_precision=)``: the store's precision (float32, float16) or compact search codes
    LABEL_PRECISIONS = ("float32", "float16", "int8", "binary")

    def set_label_precision(self, precision: str) -> None:
        """How the label vectors are kept and searched. ``"float32"`` / ``"float16"``: the store's precision
        (``config.label_embeddings_dtype``), searched as it is; ``"int8"`` / ``"binary"``: the index scans compact codes
        and rescores its best candidates from the store, which keeps its precision (``config.label_codes``, see
        ``label_codes.py``). An index that is current is rebuilt over the stored vectors (no encoding); a stale one is
        dropped and built on first use. Memory: the codes (``d`` or ``d / 8`` bytes a label), or the converted store."""
        if precision not in self.LABEL_PRECISIONS:
            raise ValueError(f"label_precision must be one of {self.LABEL_PRECISIONS}, got {precision!r}")
        config = self.config
        floats = precision in ("float32", "float16")
        dtype, codes = (precision, "float") if floats else (config.label_embeddings_dtype, precision)
        if (dtype, codes) == (config.label_embeddings_dtype, config.label_codes):
            return
        current = self.label_index is not None and self.label_index_is_current()
        config.label_embeddings_dtype, config.label_codes = dtype, codes
        self.label_index = None
        blocks = getattr(self, "label_embedding_blocks", None)
        if blocks is not None:  # the store takes the precision now, index or not: an index built later is over what is saved
            self.label_embedding_blocks = [b.to(getattr(torch, dtype)) for b in blocks]
        if current:
            self._reindex_labels()

    def _reindex_labels(self) -> None:
        """The label index again over the stored label vectors (:meth:`set_label_precision` converted them), in
        ``config``'s codes."""
        if self.label_embedding_blocks is not None:
            self.ensure_label_index()

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
            self._sync_lexical_channel_labels()
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
            self._sync_lexical_channel_labels()
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
