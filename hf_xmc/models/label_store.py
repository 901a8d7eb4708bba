"""The label store: the label vectors a model searches, saved beside its weights and read back memory-mapped.

* ``labels.jsonl``: one ``{"uid", "text"}`` per label, in label-id order;
* ``label_embeddings.safetensors``: the label vectors (the source of truth for search), float32 or float16; a store
  larger than the shard size (1 GB by default) is saved as ``label_embeddings-00001-of-0000N.safetensors`` shards
  named by ``label_embeddings.safetensors.index.json`` and loaded shard by shard, memory-mapped, never joined.

Remote-code file. Memory: saving holds one shard at a time; loading maps the files (a page costs memory once search
touches it).
"""

import json
import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Optional

import torch
from safetensors.torch import save_file
from transformers.utils.hub import convert_file_size_to_int

from .io_utils import atomic_write, temp_path_for, write_json
from .label_index import as_label_blocks
from .model_files import ModelFileError, read_safetensors

LABELS_FILE = "labels.jsonl"
LABEL_EMBEDDINGS_FILE = "label_embeddings.safetensors"
LABEL_EMBEDDINGS_INDEX_FILE = "label_embeddings.safetensors.index.json"
LABEL_EMBEDDINGS_KEY = "label_embeddings"  # the tensor's name in the single file and in every shard
LABEL_SHARD_SIZE = "1GB"  # default most bytes per label-vector file: small retries and parallel parts on a Hub upload
LABEL_SHARD_PATTERN = re.compile(r"label_embeddings-\d{5}-of-\d{5}\.safetensors")


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
