"""Peft adapters on a model's text encoder: :class:`EncoderAdapterMixin`, a base of ``XMCPreTrainedModel``.

An adapter (LoRA or any peft config) wraps the encoder; a save folds it in (the default: loads without peft) or
writes it alone on its base encoder (``save_adapter_only``), and loading rebuilds it from the base and the adapter.

Remote-code file: peft is imported only when an adapter is used.
"""

import copy
import os
from typing import Optional

import torch
from safetensors.torch import save_file
from transformers import AutoModel

from .encoder_utils import import_peft, json_safe, peft_config_from_dict
from .model_files import ADAPTER_DIR, ADAPTER_WEIGHTS_FILE, WEIGHTS_FILE, read_safetensors


class EncoderAdapterMixin:
    """The encoder-adapter part of ``XMCPreTrainedModel`` (which sets ``self.encoder``, ``self.config`` and
    ``self.save_adapter_only``). Memory: the adapter's weights (LoRA: ``2 r (d_in + d_out)`` per wrapped matrix), their
    gradients and optimizer moments; saving a merged model copies the encoder once."""

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
        peft = import_peft()
        if self.has_encoder_adapter:
            raise ValueError("the encoder already has an adapter: merge_encoder_adapter() first, or keep training this one")
        if not hasattr(self.encoder, "config") or not hasattr(self.encoder, "get_input_embeddings"):
            raise ValueError(f"{type(self.encoder).__name__} is not a transformers encoder: peft adapters need one (SiameseXML: encoder_type='transformer')")
        peft_config = peft_config_from_dict(peft_config) if isinstance(peft_config, dict) else peft_config
        self.encoder = peft.get_peft_model(self.encoder, peft_config)
        self.config.encoder_adapter = json_safe(peft_config.to_dict())

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

    def _load_encoder_from_base_and_adapter(self, path: str, adapter_path: Optional[str], hub: dict) -> None:
        """An adapter-only save: the encoder's weights from ``config.encoder_base_model``, then the adapter's."""
        peft = import_peft()
        if adapter_path is None:
            raise ValueError(f"{path}: config.json says the encoder is saved as an adapter, but there is no {ADAPTER_WEIGHTS_FILE}")
        base_hub = {k: v for k, v in hub.items() if k in ("cache_dir", "token", "local_files_only")}  # the base's own revision
        base = AutoModel.from_pretrained(self.config.encoder_base_model, **base_hub)
        missing, unexpected = self.encoder.load_state_dict(base.state_dict(), strict=False)
        if unexpected or [k for k in missing if not k.endswith("position_ids")]:
            raise ValueError(f"{self.config.encoder_base_model}: its weights do not fit this model's encoder (missing {missing[:3]}, unexpected {unexpected[:3]})")
        self.encoder = peft.get_peft_model(self.encoder, peft_config_from_dict(self.config.encoder_adapter)).to(next(self.parameters()).device)
        result = peft.set_peft_model_state_dict(self.encoder, read_safetensors(adapter_path))
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"{adapter_path}: adapter weights that the encoder has no place for: {result.unexpected_keys[:3]}")
        self.encoder.train(self.training)  # from_pretrained left the model in eval mode: the adapter's dropout too
