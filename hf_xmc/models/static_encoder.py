"""A static query encoder: a bag of token vectors fitted to the model's trained query tower, for serving at the CPU's
limit (a table lookup and a mean instead of a transformer forward).

``model.fit_static_query_encoder(texts)`` (or ``--static_query_encoder`` of every training script, or ``hf-xmc
fit-static``) fits a ``(vocab, dim)`` table over the model's own tokenizer so that the mean of a query's token rows,
L2-normalised, reproduces the tower's search vector of the query (cosine loss, lazy Adam, a few epochs over the
training queries; the rows start from each vocabulary token's vector through the tower, Model2Vec's initialisation;
``objective="cosine+ranking"`` adds a listwise distillation of the tower's ranking of its top labels, which helps
where a bag of tokens cannot follow the tower's every direction: WordNet-XMC, not Debtags; ``"cosine+labels"`` adds
the training loss itself, each training query's own labels against the batch's candidates in the frozen label space,
docs/serving.md; the scripts' default ``auto`` fits the cosine and the label objectives from one pass of the tower,
:func:`prepare_static_fit`, and keeps the better on the validation split).
The label vectors, the index, the lexical channel stay the model's: only the query side changes, chosen per call
(``predict(texts, query_encoder="static")``, the pipeline's ``query_encoder=``, ``hf-xmc predict / serve
--query_encoder static``). The static encoder keeps its own lexical fusion weights and score calibration (tuned on
the validation split with this encoder's ranking, not the tower's), applied while it ranks.

``save_pretrained`` writes ``static_query_encoder.safetensors`` (the table) and ``static_query_encoder.json`` (width,
sequence length, output scale, its fusion weights and calibration, how it was fitted and the **fingerprint of what it
was fitted from**: the tower's weights, query head, query length and tokenizer vocabulary). A static encoder fitted to
other weights (the model trained further, another UniDEC search mode, another tokenizer) maps queries into a space the
label vectors no longer share: it is refused in one line (``provenance.py``, part ``static_query_encoder``, policy
``refuse``). Labels added or removed later are fine: the label vectors are still the tower's (its calibration, tied to
the ranking, is dropped as every calibration is).

Memory: the table, ``vocab x dim x 4`` bytes (all-MiniLM-L6-v2: 30,522 x 384, 47 MB); per call one batch of token ids
(8 bytes a token) and its ``(batch, dim)`` vectors. The fit holds the tower's vectors of the fitted queries in float16
(``queries x dim x 2`` bytes: 2.2M queries x 384 = 1.7 GB; ``max_queries`` caps it), encoded 65,536 at a time, their
token ids (8 bytes a token), plus Adam's two moments of the table (2 x the table); the ranking objective adds the
tower's top ``RANKING_DEPTH`` label ids a query (``queries x 16 x 4`` bytes: 141 MB at 2.2M) and a batch's label rows;
the label term the same plus the fitted queries' label matrix (the caller's CSR, a sample's copy under ``max_queries``).

Remote-code file: imports torch, numpy, safetensors and its siblings only.
"""

from __future__ import annotations

import math
import numbers
import os
import time
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .io_utils import atomic_write, new_directory_staged, progress_bar_disabled, read_json_file, write_json
from .provenance import array_digest, check_derived, digest, fingerprint_of

STATIC_ENCODER_FILE = "static_query_encoder.safetensors"
STATIC_ENCODER_META = "static_query_encoder.json"
QUERY_ENCODERS = ("transformer", "static")
#: queries the fit encodes with the tower at a time (their float32 vectors: 100 MB at 384 dimensions)
FIT_ENCODE_CHUNK = 65_536
#: the fusion weights a static encoder keeps of its own (the channel's other settings are shared)
STATIC_FUSION_KEYS = ("ranker_weight", "text_weight")
#: what the fit minimises (``fit_static_encoder``'s ``objective``)
FIT_OBJECTIVES = ("cosine", "cosine+ranking", "cosine+labels", "cosine+ranking+labels")
#: what ``--static_query_encoder_objective`` / ``hf-xmc fit-static --objective`` take: one of ``FIT_OBJECTIVES``, or
#: ``"auto"``: each of ``AUTO_FIT_OBJECTIVES`` fitted from one tower pass and the best on the validation split kept
#: (``hf_xmc.training.static_encoder``; the label term gains 7.7 dense P@1 on WordNet-XMC and costs 3.7 on Debtags,
#: docs/serving.md)
FIT_OBJECTIVE_CHOICES = ("auto", *FIT_OBJECTIVES)
AUTO_FIT_OBJECTIVES = ("cosine", "cosine+labels")
#: the tower's top labels per fitted query whose order the ranking objective distils, its softmax temperature (a
#: fraction of the median label-vector norm: 0.05 of a cosine for unit label vectors) and its weight beside the cosine
#: (4: the best of 1 / 4 / 16 on WordNet-XMC's validation split, docs/serving.md)
RANKING_DEPTH = 16
RANKING_TEMPERATURE = 0.05
RANKING_WEIGHT = 4.0
#: the weight of the label term beside the cosine (``+labels`` objectives; 1: the one tried, docs/serving.md)
LABEL_WEIGHT = 1.0


class StaticQueryEncoder(nn.Module):
    """Query text -> the model's tokens (no special tokens) -> mean of their rows of a ``(vocab, dim)`` table ->
    L2-normalised, times ``output_scale`` (1 for a tower whose query vectors are unit vectors; else the median norm of
    the tower's vectors it was fitted to, so dense scores keep their range for the fusion). A query without a token
    gets the zero vector (every label scores 0: a fused ranking falls back on the lexical channel).

    Memory: ``vocab x dim x 4`` bytes for the table; a call holds its batch's token ids and vectors."""

    def __init__(self, vocab_size: int, dim: int, output_scale: float = 1.0):
        super().__init__()
        self.embeddings = nn.EmbeddingBag(vocab_size, dim, mode="mean", sparse=True)
        self.output_scale = float(output_scale)

    @property
    def vocab_size(self) -> int:
        return self.embeddings.num_embeddings

    @property
    def dim(self) -> int:
        return self.embeddings.embedding_dim

    def forward(self, token_ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``(batch, dim)`` vectors of bags given as flat ``token_ids`` and each bag's start ``offsets``."""
        return F.normalize(self.embeddings(token_ids, offsets), dim=-1) * self.output_scale

    @staticmethod
    def token_bags(tokenizer, texts: Sequence[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The flat token ids and offsets of ``texts`` as the tower reads them: the same tokenizer and truncation
        (``max_length`` counts the special tokens the tower adds, which the bags leave out)."""
        budget = max(1, int(max_length) - tokenizer.num_special_tokens_to_add(pair=False))
        rows = tokenizer(list(texts), add_special_tokens=False, truncation=True, max_length=budget)["input_ids"]
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows), dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        flat = np.fromiter((t for r in rows for t in r), dtype=np.int64, count=int(lengths.sum()))
        return torch.from_numpy(flat), torch.from_numpy(offsets)

    @torch.no_grad()
    def encode(self, tokenizer, texts: Sequence[str], max_length: int, batch_size: int = 1024, timed=None) -> torch.Tensor:
        """``(n, dim)`` float32 query vectors, ``batch_size`` texts at a time (``timed``: a model's ``timed_stage``, to
        report the tokenisation)."""
        out = torch.empty(len(texts), self.dim)
        for start in range(0, len(texts), batch_size):
            with timed("tokenise") if timed is not None else nullcontext():
                ids, offsets = self.token_bags(tokenizer, texts[start : start + batch_size], max_length)
            out[start : start + len(offsets)] = self(ids.to(self.embeddings.weight.device), offsets.to(self.embeddings.weight.device)).float().cpu()
        return out

    def table_digest(self) -> str:
        """A digest of the table and the output scale: what the encoder's own ranking (its calibration) records."""
        return array_digest(self.embeddings.weight.detach().cpu().numpy(), np.array([self.output_scale]))


# ---------------------------------------------------------------------------------------------------------- fitting
def gather_bags(ids: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat token ids and offsets of the bags ``rows`` of a flat bag store (``ids``, each bag's start ``offsets``
    and ``lengths``), in the order of ``rows``: one vectorised gather (a Python slice a bag took 0.96 s an epoch of
    200,000 queries on one thread, this 0.04 s). Memory: the batch's token ids and two index vectors of that length."""
    sizes = lengths[rows]
    bag_offsets = torch.zeros(len(rows), dtype=torch.long)
    if len(rows) > 1:
        bag_offsets[1:] = torch.cumsum(sizes, 0)[:-1]
    # token j of the batch is token (j - its bag's batch offset) of the bag's run in the store
    shift = torch.repeat_interleave(offsets[rows] - bag_offsets, sizes)
    return ids[torch.arange(len(shift)) + shift], bag_offsets


class TowerRanking:
    """The tower's ranking of the fitted queries, for the ranking objective of :func:`fit_static_encoder`: each
    query's top ``depth`` rows of the model's label index (searched once with the tower's vectors) and a listwise
    distillation loss over a batch's union of them.

    Memory: ``queries x depth x 4`` bytes of row ids (2.2M queries x 16: 141 MB); per batch its union of rows'
    vectors (at most ``batch x depth x dim x 4``: 256 x 16 x 384, 6 MB) and two ``(batch, union)`` score matrices."""

    def __init__(self, index, targets: torch.Tensor, depth: int, temperature: float, chunk: int = FIT_ENCODE_CHUNK):
        started = time.perf_counter()
        self.index = index
        self.top = torch.empty(len(targets), min(depth, index.num_labels), dtype=torch.int32)
        for start in range(0, len(targets), chunk):
            _, ids = index.search(targets[start : start + chunk].float(), self.top.shape[1])
            self.top[start : start + len(ids)] = torch.from_numpy(ids.astype(np.int32))
        sample = index.sample_vectors(min(index.num_labels, 10_000))
        # the scores' scale is the label vectors' (the query side is a direction): the temperature follows it
        self.temperature = float(temperature) * max(float(np.median(np.linalg.norm(sample, axis=1))), 1e-6)
        self.seconds = time.perf_counter() - started

    def loss(self, rows: torch.Tensor, predicted: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
        """``KL(softmax(tower scores / T) || softmax(static scores / T))`` averaged over the batch ``rows``, the scores
        of each query over the union of the batch's top rows (``predicted``, ``wanted``: the static encoder's and the
        tower's unit query vectors)."""
        union = torch.unique(self.top[rows].long())
        union = union[union >= 0]
        labels = self.index.vectors(union.numpy())
        teacher = F.log_softmax(wanted @ labels.T / self.temperature, dim=1)
        student = F.log_softmax(predicted @ labels.T / self.temperature, dim=1)
        return F.kl_div(student, teacher, reduction="batchmean", log_target=True)

    def label_loss(self, rows: torch.Tensor, predicted: torch.Tensor, targets) -> torch.Tensor:
        """The training loss in the frozen label space: for each query of the batch ``rows``, ``-mean log softmax`` of
        its own labels' index rows (``targets``: the fitted queries' CSR label matrix; every row of a label that has
        several, SiameseXML's text vector and centroid) among the batch's candidates, the union of its queries' label
        rows and the tower's top rows, at the ranking term's temperature. A query without a label adds nothing."""
        rows_per_label = max(1, self.index.num_labels // targets.shape[1])
        picked = [targets.indices[targets.indptr[r] : targets.indptr[r + 1]] for r in rows.tolist()]
        positive = [np.concatenate([p + k * targets.shape[1] for k in range(rows_per_label)]) for p in picked]
        counts = torch.tensor([len(p) for p in positive])
        if int(counts.sum()) == 0:
            return predicted.sum() * 0.0
        flat = torch.from_numpy(np.concatenate(positive)).long()
        union = torch.unique(torch.cat([self.top[rows].long().flatten(), flat]))
        union = union[union >= 0]
        log_p = F.log_softmax(predicted @ self.index.vectors(union.numpy()).T / self.temperature, dim=1)
        owner = torch.repeat_interleave(torch.arange(len(rows)), counts)
        per_query = torch.zeros(len(rows)).index_add_(0, owner, log_p[owner, torch.searchsorted(union, flat)])
        has = counts > 0
        return -(per_query[has] / counts[has]).mean()


@torch.no_grad()
def tower_token_vectors(model, batch_size: int = 512, show_progress_bar: Optional[bool] = None) -> torch.Tensor:
    """Each vocabulary token's search vector through the model's query tower, alone between the tokenizer's special
    tokens (Model2Vec's initialisation of a static table): ``(vocab, dim)`` float32, under the model's
    ``encoding_autocast`` dtype when one is set. Memory: the result and one batch."""
    from tqdm.auto import tqdm

    tokenizer = model._require_tokenizer()
    vocab = len(tokenizer)
    # the special tokens the tower wraps a text in ([CLS] ... [SEP]), read off one encoded word
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    wrapped = tokenizer("a")["input_ids"]
    cut = next((i for i in range(len(wrapped) - len(plain) + 1) if wrapped[i : i + len(plain)] == plain), None)
    wrap = None if cut is None else [*wrapped[:cut], -1, *wrapped[cut + len(plain):]]
    position = None if wrap is None else wrap.index(-1)
    was_training = model.training
    model.eval()
    out = None
    show = vocab > 10 * batch_size if show_progress_bar is None else show_progress_bar
    try:
        for start in tqdm(range(0, vocab, batch_size), desc="Static encoder: token vectors", disable=not show or progress_bar_disabled(), unit="batch"):
            ids = torch.arange(start, min(start + batch_size, vocab))
            if position is None:
                input_ids = ids[:, None]
            else:
                input_ids = torch.tensor(wrap, dtype=torch.long).repeat(len(ids), 1)
                input_ids[:, position] = ids
            mask = torch.ones_like(input_ids)
            with model.encoding_autocast_context():  # as encode_texts: model.encoding_autocast(dtype) around the call
                vectors = model.embed(input_ids.to(model.device), mask.to(model.device), **model.query_embed_kwargs()).float().cpu()
            if out is None:
                out = torch.empty(vocab, vectors.shape[1])
            out[start : start + len(ids)] = vectors
    finally:
        model.train(was_training)
    return out


@dataclass
class StaticFitData:
    """What every fit of a static encoder to one tower on one set of queries starts from, computed once and shared by
    several fits (:func:`prepare_static_fit`; ``fit_and_tune_static_query_encoder`` fits two objectives from one):
    the fitted ``texts`` (a seeded sample under ``max_queries``) and their ``labels`` (CSR or None), the tower's unit
    query vectors of them in float16 (``targets``, ``(queries, dim)``) and their median ``scale``, their token bags
    (flat ``ids``, ``offsets``, ``lengths``), the tower's vocabulary rows (``initial_rows``, the tower start; taken on
    first use) and the seconds the tower's pass took.

    Memory: ``queries x dim x 2`` bytes of targets, 8 bytes a token of ids, ``vocab x dim x 4`` bytes once the
    vocabulary rows are taken (the table's size), the label matrix as given."""

    texts: list
    labels: object
    targets: torch.Tensor
    scale: float
    ids: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor
    encode_seconds: float
    encode_dtype: Optional[torch.dtype]
    initial_rows: Optional[torch.Tensor] = None

    @property
    def encode_precision(self) -> str:
        return "float32" if self.encode_dtype is None else str(self.encode_dtype).removeprefix("torch.")


def prepare_static_fit(
    model,
    texts: Sequence[str],
    labels=None,
    max_queries: Optional[int] = None,
    seed: int = 0,
    show_progress_bar: Optional[bool] = None,
    encode_dtype: Optional[torch.dtype] = None,
) -> StaticFitData:
    """The tower's pass over ``texts`` that every fit needs (:class:`StaticFitData`): a seeded sample of
    ``max_queries`` texts (and their rows of ``labels``, the ``(len(texts), num_labels)`` CSR matrix, when given), the
    tower's query vectors of them under ``encode_dtype`` (chunks of ``FIT_ENCODE_CHUNK``, kept normalised in float16),
    their token bags."""
    texts = list(texts)
    if not texts:
        raise ValueError("fit_static_query_encoder got no texts")
    if labels is not None:
        if not hasattr(labels, "tocsr") or labels.shape[0] != len(texts):
            raise ValueError(f"labels must be the CSR label matrix of the {len(texts)} texts, got {getattr(labels, 'shape', type(labels).__name__)}")
        labels = labels.tocsr()
    started = time.perf_counter()
    if max_queries is not None and len(texts) > max_queries:
        sample = np.sort(np.random.default_rng(seed).choice(len(texts), int(max_queries), replace=False))
        texts = [texts[i] for i in sample]
        labels = labels[sample] if labels is not None else None
    # the tower's vectors, normalised, in float16, encoded in chunks (no float32 copy of them all); their norms kept
    targets: Optional[torch.Tensor] = None
    norms = torch.empty(len(texts))
    for start in range(0, len(texts), FIT_ENCODE_CHUNK):
        with model.encoding_autocast(encode_dtype):
            chunk = model.query_search_vectors(texts[start : start + FIT_ENCODE_CHUNK], show_progress_bar=show_progress_bar).float()
        if targets is None:
            targets = torch.empty(len(texts), chunk.shape[1], dtype=torch.float16)
        norms[start : start + len(chunk)] = chunk.norm(dim=1)
        targets[start : start + len(chunk)] = F.normalize(chunk, dim=1).to(torch.float16)  # the fit matches directions
    encode_seconds = time.perf_counter() - started
    unit = bool(torch.allclose(norms, torch.ones_like(norms), atol=1e-3))
    ids, offsets = StaticQueryEncoder.token_bags(model._require_tokenizer(), texts, int(model.config.max_seq_length))
    lengths = torch.diff(torch.cat([offsets, torch.tensor([len(ids)])]))
    return StaticFitData(texts=texts, labels=labels, targets=targets, scale=1.0 if unit else float(norms.median()), ids=ids, offsets=offsets,
                         lengths=lengths, encode_seconds=encode_seconds, encode_dtype=encode_dtype)


def fit_static_encoder(
    model,
    texts: Sequence[str] | StaticFitData,
    epochs: int = 8,
    batch_size: int = 256,
    learning_rate: float = 1e-3,
    init: str = "tower",
    max_queries: Optional[int] = None,
    seed: int = 0,
    show_progress_bar: Optional[bool] = None,
    encode_dtype: Optional[torch.dtype] = None,
    objective: str = "cosine",
    ranking_depth: int = RANKING_DEPTH,
    ranking_temperature: float = RANKING_TEMPERATURE,
    ranking_weight: float = RANKING_WEIGHT,
    labels=None,
    label_weight: float = LABEL_WEIGHT,
) -> tuple[StaticQueryEncoder, dict]:
    """Fit a :class:`StaticQueryEncoder` to ``model``'s query vectors of ``texts`` (the training queries: never the
    validation or test ones, which tune and judge it): minimise ``1 - cos(static(q), tower(q))`` with lazy Adam
    (``torch.optim.SparseAdam``: a step touches only the rows of its batch's tokens) for ``epochs`` passes in shuffled
    batches. ``texts`` may be a :class:`StaticFitData` from :func:`prepare_static_fit` (the tower's pass done once for
    several fits; ``labels``, ``max_queries`` and ``encode_dtype`` are then the prepared ones). ``init``: ``"tower"``
    (each token's vector through the tower, :func:`tower_token_vectors`) or ``"random"`` (normal, std 1 / sqrt(dim)).
    ``max_queries``: fit on a seeded sample of that many texts (memory: the module docstring). ``encode_dtype``: the
    autocast dtype of the tower's passes that make the targets and the initial rows (``torch.bfloat16`` halves them
    where the hardware multiplies bfloat16; the targets are stored in float16 anyway); None: the weights' precision.
    ``objective``: ``"cosine"`` (the tower's direction only) or
    ``"cosine+ranking"``: the cosine loss plus ``ranking_weight`` times a listwise distillation of the tower's ranking
    (:meth:`TowerRanking.loss`: each query's scores over the union of its batch's tower top ``ranking_depth``
    labels, softmax at ``ranking_temperature`` times the median label-vector norm, the static encoder's against the
    tower's), which spends the table's capacity on the order of the labels near the top rather than on every
    direction alike. ``"cosine+labels"`` adds ``label_weight`` times the training loss itself in the frozen label space
    (:meth:`TowerRanking.label_loss`: each query's own labels, ``labels``, the ``(len(texts), num_labels)`` CSR matrix
    of the fitted queries' labels, against the batch's candidates), ``"cosine+ranking+labels"`` both terms: the table
    learns what to retrieve, not only what the tower does (docs/serving.md). Returns the encoder and what the fit did
    (the meta's ``fit`` entry)."""
    from tqdm.auto import tqdm

    if init not in ("tower", "random"):
        raise ValueError(f"init must be 'tower' or 'random', got {init!r}")
    if objective not in FIT_OBJECTIVES:
        raise ValueError(f"objective must be one of {FIT_OBJECTIVES}, got {objective!r}")
    if objective != "cosine" and (not isinstance(ranking_depth, numbers.Integral) or ranking_depth < 1 or not 0 < ranking_temperature < math.inf
                                  or not 0 <= ranking_weight < math.inf):  # NaN and infinity fail the comparisons
        raise ValueError(f"need an integer ranking_depth >= 1, a finite ranking_temperature > 0 and a finite ranking_weight >= 0, "
                         f"got {ranking_depth!r}, {ranking_temperature!r}, {ranking_weight!r}")
    uses_ranking, uses_labels = "+ranking" in objective, objective.endswith("+labels")
    prepared = isinstance(texts, StaticFitData)
    if uses_labels:
        given = texts.labels if prepared else labels
        count = len(texts.texts) if prepared else len(texts)
        if given is None or not hasattr(given, "indptr") or given.shape[0] != count:
            raise ValueError(f"objective {objective!r} needs labels: the CSR label matrix of the {count} texts, got "
                             f"{None if given is None else getattr(given, 'shape', type(given).__name__)}")
        if not 0 <= label_weight < math.inf:
            raise ValueError(f"need a finite label_weight >= 0, got {label_weight!r}")
    if epochs < 0 or batch_size < 1 or not learning_rate > 0:
        raise ValueError(f"need epochs >= 0, batch_size >= 1 and learning_rate > 0, got {epochs}, {batch_size}, {learning_rate}")
    started = time.perf_counter()
    data = texts if prepared else prepare_static_fit(model, texts, labels if uses_labels else None, max_queries, seed, show_progress_bar, encode_dtype)
    rng = np.random.default_rng(seed)
    targets, labels = data.targets, data.labels if uses_labels else None
    teacher = TowerRanking(model.ensure_label_index(), targets, ranking_depth, ranking_temperature) if objective != "cosine" else None
    encoder = StaticQueryEncoder(len(model._require_tokenizer()), targets.shape[1], output_scale=data.scale)
    if init == "tower":
        if data.initial_rows is None:  # taken once per prepared data: every fit from it starts from the same rows
            with model.encoding_autocast(data.encode_dtype):
                data.initial_rows = tower_token_vectors(model, show_progress_bar=show_progress_bar)
        encoder.embeddings.weight.data.copy_(data.initial_rows)
    else:
        generator = torch.Generator().manual_seed(seed)
        encoder.embeddings.weight.data.normal_(0.0, 1.0 / math.sqrt(targets.shape[1]), generator=generator)
    ids, offsets, lengths = data.ids, data.offsets, data.lengths
    optimizer = torch.optim.SparseAdam(encoder.parameters(), lr=learning_rate)
    losses = []
    count = len(data.texts)
    show = count * epochs > 50 * batch_size if show_progress_bar is None else show_progress_bar
    for _ in tqdm(range(epochs), desc="Static encoder: fit", disable=not show or progress_bar_disabled(), unit="epoch"):
        order = torch.from_numpy(rng.permutation(count))
        total, seen = 0.0, 0
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            rows = rows[lengths[rows] > 0]  # a text without a token teaches nothing
            if len(rows) == 0:
                continue
            bag_ids, bag_offsets = gather_bags(ids, offsets, lengths, rows)
            predicted = F.normalize(encoder.embeddings(bag_ids, bag_offsets), dim=-1)
            wanted = targets[rows].float()
            loss = (1.0 - (predicted * wanted).sum(1)).mean()
            if uses_ranking:
                loss = loss + ranking_weight * teacher.loss(rows, predicted, wanted)
            if uses_labels:
                loss = loss + label_weight * teacher.label_loss(rows, predicted, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total, seen = total + loss.item() * len(rows), seen + len(rows)
        losses.append(round(total / max(seen, 1), 5))
    encoder.eval()
    fit = {"queries": count, "epochs": int(epochs), "batch_size": int(batch_size), "learning_rate": float(learning_rate), "init": init,
           "seed": int(seed), "loss": objective, "epoch_losses": losses,
           **({} if teacher is None else {"ranking_depth": int(ranking_depth), "ranking_temperature": float(ranking_temperature),
                                          "ranking_seconds": round(teacher.seconds, 2)}),
           **({"ranking_weight": float(ranking_weight)} if uses_ranking else {}),
           **({"label_weight": float(label_weight)} if uses_labels else {}), "encode_seconds": round(data.encode_seconds, 2),
           "encode_precision": data.encode_precision, "seconds": round(time.perf_counter() - started, 2)}
    return encoder, fit


# ---------------------------------------------------------------------------------------------------------- on the model
class StaticQueryEncoderMixin:
    """The static query encoder of ``XMCPreTrainedModel``: fit, choose per call, save, load, check (module docstring)."""

    static_query_encoder_meta: Optional[dict] = None
    _query_encoder = "transformer"

    @property
    def static_query_encoder(self) -> Optional[StaticQueryEncoder]:
        """The attached static encoder, or None. Kept outside the model's modules on purpose: its table is no weight of
        the model (not in ``model.safetensors``, not in the weights' fingerprint it is checked against)."""
        return self.__dict__.get("_static_encoder")

    def _set_static(self, encoder: Optional[StaticQueryEncoder], meta: Optional[dict], path: Optional[str] = None) -> None:
        object.__setattr__(self, "_static_encoder", encoder)  # not nn.Module.__setattr__: no submodule (see the property)
        self.static_query_encoder_meta = meta
        self._static_checked_version, self._static_encoder_path = None, path

    # ------------------------------------------------------------------ what it was fitted from
    def static_encoder_inputs(self) -> dict:
        """The fingerprint a static encoder records and is checked against: the tower's weights, query head, query
        length and tokenizer vocabulary (its ``len`` and a digest of its tokens in id order, taken once per tokenizer)."""
        tokenizer = self._require_tokenizer()
        cached = getattr(self, "_tokenizer_digest_cache", None)
        if cached is None or cached[0] is not tokenizer:
            vocab = tokenizer.get_vocab()
            tokens = sorted(vocab, key=vocab.__getitem__)  # in id order, joined once: a digest per token cost 0.3 s
            cached = (tokenizer, digest([len(tokenizer), "\x00".join(tokens)]))
            self._tokenizer_digest_cache = cached
        return fingerprint_of(weights=self.weights_summary(), query_head=self.onnx_query_head(), max_seq_length=int(self.config.max_seq_length),
                              tokenizer=cached[1])

    def check_static_query_encoder(self) -> StaticQueryEncoder:
        """The attached static encoder, checked against the model (:meth:`static_encoder_inputs`); a one-line
        ``StaleDerivedPartError`` when it was fitted from other weights, head, length or tokenizer, a ``ValueError``
        when the model has none. The check is repeated only after a weight was written (``weights_version``) or the
        query head, length or tokenizer changed."""
        encoder = self.static_query_encoder
        if encoder is None:
            raise ValueError(f"{type(self).__name__} has no static query encoder: fit one (model.fit_static_query_encoder(texts), "
                             "--static_query_encoder, or hf-xmc fit-static)")
        version = (*self.weights_version(), self.onnx_query_head(), self.config.max_seq_length, id(self.tokenizer))
        if getattr(self, "_static_checked_version", None) != version:
            recorded = (self.static_query_encoder_meta or {}).get("fitted_from")
            check_derived("static_query_encoder", recorded, self.static_encoder_inputs(), getattr(self, "_static_encoder_path", None) or type(self).__name__,
                          "fit it again (model.fit_static_query_encoder(texts))")
            self._static_checked_version = version
        return encoder

    def fit_static_query_encoder(self, texts: Sequence[str], **fit_kwargs) -> StaticQueryEncoder:
        """Fit a static query encoder to this model's query tower on ``texts`` (training queries) and attach it
        (:func:`fit_static_encoder` for the arguments). Its fusion weights start as the tower's and it has no
        calibration: ``hf_xmc.training.static_encoder.tune_static_query_encoder`` tunes both on a validation split."""
        if self.takes_images:
            raise NotImplementedError(f"{type(self).__name__} ranks texts with images: a static query encoder is for the text models")
        encoder, fit = fit_static_encoder(self, texts, **fit_kwargs)
        self.attach_static_query_encoder(encoder, {"fit": fit})
        return encoder

    def attach_static_query_encoder(self, encoder: Optional[StaticQueryEncoder], meta: Optional[dict] = None) -> None:
        """Attach ``encoder`` (fitted to this model now: its fingerprint is recorded) with ``meta`` (its ``fit``, and
        its own ``fusion`` weights and ``score_calibration`` if it has them); None removes it."""
        if encoder is None:
            self._set_static(None, None)
            return
        meta = dict(meta or {})
        meta.update(dim=encoder.dim, vocab_size=encoder.vocab_size, output_scale=encoder.output_scale, max_seq_length=int(self.config.max_seq_length),
                    fitted_from=self.static_encoder_inputs())
        self._set_static(encoder.to(self.device), meta)

    # ------------------------------------------------------------------ choosing it
    @property
    def query_encoder(self) -> str:
        """The query encoder ``predict`` uses when a call does not name one: ``transformer`` (the trained tower) or
        ``static`` (:meth:`set_query_encoder`)."""
        return self._query_encoder

    def set_query_encoder(self, name: str) -> None:
        """Use ``name`` (``transformer`` | ``static``) for every call that does not name one (a server's default)."""
        if name not in QUERY_ENCODERS:
            raise ValueError(f"query_encoder must be one of {QUERY_ENCODERS}, got {name!r}")
        if name == "static":
            self.check_static_query_encoder()
        self._query_encoder = name

    @contextmanager
    def using_query_encoder(self, name: Optional[str]):
        """Rank with query encoder ``name`` inside the block (None: the model's :attr:`query_encoder`): its query
        vectors, its lexical fusion weights and its score calibration; restored after. Not for two threads ranking
        with different encoders on one model at once (a server sets one for good: :meth:`set_query_encoder`)."""
        name = self._query_encoder if name is None else name
        if name not in QUERY_ENCODERS:
            raise ValueError(f"query_encoder must be one of {QUERY_ENCODERS}, got {name!r}")
        if name == "static":
            self.check_static_query_encoder()
        previous = self._query_encoder
        channel = self.lexical_channel
        saved = None
        meta = (self.static_query_encoder_meta or {}) if name == "static" else {}
        fusion = meta.get("fusion")
        if channel is not None and fusion:
            saved = {key: channel.settings[key] for key in STATIC_FUSION_KEYS}
            channel.settings.update({key: float(fusion[key]) for key in STATIC_FUSION_KEYS if key in fusion})
        # its own values of the model's tunable ranking settings (SiameseXML's classifier share), tuned with its ranking;
        # all of them are restored after a static block: a tuning inside it leaves the tower's values as they were
        saved_ranking = {key: getattr(self.config, key) for key in self.tunable_ranking_settings} if name == "static" else {}
        for key, value in (meta.get("ranking") or {}).items():
            if key in saved_ranking:
                setattr(self.config, key, value)
        self._query_encoder = name
        try:
            yield self
        finally:
            self._query_encoder = previous
            if saved is not None:
                channel.settings.update(saved)
            for key, value in saved_ranking.items():
                setattr(self.config, key, value)

    def set_static_fusion_weights(self, weights: dict) -> None:
        """The static encoder's own lexical fusion weights (``ranker_weight``, ``text_weight``), used while it ranks."""
        if self.static_query_encoder_meta is None:
            raise ValueError(f"{type(self).__name__} has no static query encoder")
        self.static_query_encoder_meta["fusion"] = {key: float(weights[key]) for key in STATIC_FUSION_KEYS}

    def set_static_ranking_settings(self, settings: dict) -> None:
        """The static encoder's own values of the model's ``tunable_ranking_settings`` (SiameseXML's ``fusion_weight``:
        the classifiers' share), used while it ranks; the tower keeps the config's."""
        if self.static_query_encoder_meta is None:
            raise ValueError(f"{type(self).__name__} has no static query encoder")
        unknown = set(settings) - set(self.tunable_ranking_settings)
        if unknown:
            raise ValueError(f"{type(self).__name__} has no tunable ranking setting {sorted(unknown)[0]!r}")
        self.static_query_encoder_meta["ranking"] = {key: float(value) for key, value in settings.items()}

    def static_query_vectors(self, texts: Sequence[str], batch_size: int = 1024) -> torch.Tensor:
        """``(n, dim)`` search vectors of ``texts`` from the static encoder (checked first)."""
        encoder = self.check_static_query_encoder()
        return encoder.encode(self._require_tokenizer(), list(texts), int(self.config.max_seq_length), batch_size=max(batch_size, 1),
                              timed=self.timed_stage)

    def query_encoder_fingerprint(self) -> str:
        """What the ranking's query vectors come from, for :meth:`ranking_fingerprint`: ``transformer``, or
        ``static:<digest of its table>`` (taken once per attached table)."""
        if self._query_encoder != "static" or self.static_query_encoder is None:
            return "transformer"
        cached = getattr(self, "_static_digest_cache", None)
        if cached is None or cached[0] is not self.static_query_encoder or cached[1] != self.static_query_encoder.embeddings.weight._version:
            cached = (self.static_query_encoder, self.static_query_encoder.embeddings.weight._version, self.static_query_encoder.table_digest())
            self._static_digest_cache = cached
        return f"static:{cached[2]}"

    def save_static_query_encoder(self, save_directory: str | os.PathLike) -> None:
        """Write the static encoder as a sentence-transformers checkpoint (``StaticEmbedding`` over the model's own
        tokenizer, truncated where the tower truncates, then ``Normalize``, then a ``Dense`` scaling by the output scale
        when it is not 1): ``SentenceTransformer(save_directory).encode(texts)`` gives :meth:`static_query_vectors`.
        Written to a temporary directory beside ``save_directory`` and renamed; refused for a stale encoder."""
        import copy

        from safetensors.torch import save_file

        encoder = self.check_static_query_encoder()
        tokenizer = self._require_tokenizer()
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise NotImplementedError(f"{type(tokenizer).__name__} is not a fast tokenizer: sentence-transformers' StaticEmbedding needs one")
        with new_directory_staged(save_directory, ".tmp-st-static-") as tmp:
            backend = copy.deepcopy(backend)
            backend.no_padding()
            backend.enable_truncation(max_length=max(1, int(self.config.max_seq_length) - tokenizer.num_special_tokens_to_add(pair=False)))
            backend.save(os.path.join(tmp, "tokenizer.json"))
            save_file({"embedding.weight": encoder.embeddings.weight.detach().float().cpu().contiguous()}, os.path.join(tmp, "model.safetensors"))
            listing = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.StaticEmbedding"},
                       {"idx": 1, "name": "1", "path": "1_Normalize", "type": "sentence_transformers.models.Normalize"}]
            os.makedirs(os.path.join(tmp, "1_Normalize"))
            if encoder.output_scale != 1.0:  # a tower of unnormalised vectors: the dense scores keep their range
                os.makedirs(os.path.join(tmp, "2_Dense"))
                write_json(os.path.join(tmp, "2_Dense", "config.json"), {"in_features": encoder.dim, "out_features": encoder.dim, "bias": False,
                                                                         "activation_function": "torch.nn.modules.linear.Identity"})
                save_file({"linear.weight": torch.eye(encoder.dim) * encoder.output_scale}, os.path.join(tmp, "2_Dense", "model.safetensors"))
                listing.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
            write_json(os.path.join(tmp, "modules.json"), listing)
            write_json(os.path.join(tmp, "config_sentence_transformers.json"),
                       {"prompts": {}, "default_prompt_name": None, "similarity_fn_name": "cosine" if encoder.output_scale == 1.0 else "dot"})

    # ------------------------------------------------------------------ its calibration
    def _calibration_values(self) -> Optional[dict]:
        """Where the calibration of the query encoder in use lives: ``config.score_calibration`` for the tower, the
        static encoder's meta for it."""
        if self._query_encoder == "static":
            return (self.static_query_encoder_meta or {}).get("score_calibration")
        return self.config.score_calibration

    def _store_calibration_values(self, values: Optional[dict]) -> None:
        if self._query_encoder == "static":
            if self.static_query_encoder_meta is not None:
                self.static_query_encoder_meta["score_calibration"] = values
        else:
            self.config.score_calibration = values

    # ------------------------------------------------------------------ persistence
    def _save_static_encoder(self, save_directory: str) -> None:
        """Write the attached static encoder (when it is current for the model: a stale one is left out, and a later
        ``query_encoder="static"`` says there is none) as safetensors and its meta as JSON, each through a temp file."""
        if self.static_query_encoder is None:
            return
        try:
            self.check_static_query_encoder()
        except ValueError:
            return
        from safetensors.torch import save_file

        weights = {"embeddings.weight": self.static_query_encoder.embeddings.weight.detach().cpu().contiguous()}
        atomic_write(os.path.join(save_directory, STATIC_ENCODER_FILE), lambda p: save_file(weights, p, metadata={"format": "pt"}))
        atomic_write(os.path.join(save_directory, STATIC_ENCODER_META), lambda p: write_json(p, self.static_query_encoder_meta))

    def _load_static_encoder(self, fetch) -> None:
        """Attach a saved static encoder (``fetch(name)``: its local path or None); its fingerprint is checked on use."""
        from .model_files import ModelFileError

        weights_path, meta_path = fetch(STATIC_ENCODER_FILE), fetch(STATIC_ENCODER_META)
        if weights_path is None and meta_path is None:
            return
        if weights_path is None or meta_path is None:
            missing, present = (STATIC_ENCODER_FILE, meta_path) if weights_path is None else (STATIC_ENCODER_META, weights_path)
            raise ModelFileError(f"{os.path.join(os.path.dirname(present), missing)}: missing, but {os.path.basename(present)} is there (save the model again)")
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            meta = read_json_file(meta_path)
        except (ValueError, UnicodeDecodeError) as err:
            raise ModelFileError(f"{meta_path}: not valid JSON ({err})") from None
        try:
            table = load_file(weights_path)["embeddings.weight"]
        except (SafetensorError, KeyError, OSError) as err:
            raise ModelFileError(f"{weights_path}: not a static encoder's safetensors ({type(err).__name__}: {err})") from None
        if not isinstance(meta, dict) or table.ndim != 2 or list(table.shape) != [meta.get("vocab_size"), meta.get("dim")]:
            raise ModelFileError(f"{weights_path}: a table of shape {tuple(table.shape)} where {STATIC_ENCODER_META} says "
                                 f"{(meta or {}).get('vocab_size')} x {(meta or {}).get('dim')}")
        encoder = StaticQueryEncoder(table.shape[0], table.shape[1], output_scale=float(meta.get("output_scale", 1.0)))
        encoder.embeddings.weight.data.copy_(table)
        encoder.eval()
        self._set_static(encoder.to(self.device), meta, weights_path)
