"""What every method's text encoder shares: pooling, gathering rows across processes, tokenisation (and its checks),
the sentence-transformers checkpoint layout (read when a model starts from one, written by ``save_query_encoder``),
and the peft adapter helpers.

Remote-code file: imports only torch, transformers, numpy, safetensors and its siblings; peft lazily.
"""

import json
import os
import re
from collections.abc import Sequence
from enum import Enum
from typing import Optional

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel
from transformers.utils import is_peft_available, logging
from transformers.utils.hub import cached_file

from .io_utils import new_directory_staged
from .model_files import CONFIG_FILE

logger = logging.get_logger(__name__)


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


def config_from_sentence_transformers(path: str, config_kwargs: dict) -> dict:
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


def as_requested(vectors: torch.Tensor, convert_to_numpy: bool, convert_to_tensor: Optional[bool]) -> torch.Tensor | np.ndarray:
    """``encode_*``'s result in the form asked for, with sentence-transformers' rule: ``convert_to_tensor=True`` wins;
    else ``convert_to_numpy=True`` (or ``convert_to_tensor=False``) gives a numpy array (bfloat16 as float32)."""
    if convert_to_tensor or not (convert_to_numpy or convert_to_tensor is False):
        return vectors
    vectors = vectors.detach().cpu()
    return (vectors.float() if vectors.dtype == torch.bfloat16 else vectors).numpy()


def import_peft():
    """The peft module, or an ImportError that names it (models with an encoder adapter need it)."""
    if is_peft_available():  # transformers' remote-code import check skips imports guarded like this
        import peft

        return peft
    raise ImportError("this model's encoder has a peft adapter (config.encoder_adapter): pip install peft")


def saved_adapter_only(path: str, hub: dict) -> bool:
    """Whether the saved model at ``path`` keeps its encoder as an adapter (its weights load after the rest)."""
    config_path = cached_file(path, CONFIG_FILE, _raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False, **hub)
    if config_path is None:
        return False
    try:
        with open(config_path, encoding="utf-8") as f:
            return bool(json.load(f).get("encoder_adapter_only"))
    except ValueError:
        return False  # from_pretrained names the bad file


def peft_config_from_dict(values: dict):
    """A peft config object from its ``to_dict()`` (any adapter type peft knows)."""
    return import_peft().get_peft_config(dict(values))


def json_safe(value):
    """``value`` with sets as sorted lists and enums as their values: what config.json can hold."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(json_safe(v) for v in value)
    if isinstance(value, Enum):  # peft's PeftType / TaskType are str enums
        return value.value
    return value


def repair_tokenizer(tokenizer, encoder_config, name_or_path: str):
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


def save_sentence_transformers_checkpoint(
    save_directory: str | os.PathLike, encoder: PreTrainedModel, tokenizer, max_seq_length: int, pooling: str, modules: Sequence[dict]
) -> None:
    """Write ``encoder`` + ``tokenizer``, a pooling (``"mean"`` / ``"cls"``) and the layers ``modules`` (``{"type":
    "Normalize"}``, ``{"type": "Dense", "linear": nn.Linear, "activation": ...}``, in order) as a sentence-transformers
    checkpoint (the layout of sentence-transformers 2-6: ``modules.json``, ``sentence_bert_config.json``,
    ``1_Pooling/``, ``2_Dense/``, ``N_Normalize/``), through a temporary directory beside ``save_directory`` renamed
    into place, so a failure leaves nothing half-written. ``XMCPreTrainedModel.save_query_encoder`` calls it.
    Memory: one copy of the encoder weights on disk."""
    if not isinstance(encoder, PreTrainedModel):
        raise NotImplementedError(f"{type(encoder).__name__} is no transformers encoder to save as a sentence-transformers checkpoint")
    with new_directory_staged(save_directory, ".tmp-st-") as tmp:
        encoder.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        listing = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
        with open(os.path.join(tmp, "sentence_bert_config.json"), "w", encoding="utf-8") as f:
            json.dump({"max_seq_length": max_seq_length, "do_lower_case": False}, f, indent=2)
        width = encoder.config.hidden_size
        pooling_modes = {"pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean",
                         "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}
        parts = [("Pooling", {"word_embedding_dimension": width, **pooling_modes}, None)]
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
