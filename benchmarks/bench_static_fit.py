#!/usr/bin/env python
"""What bounds the static query encoder on WordNet-XMC: fit objectives and table capacities tried on one saved model,
judged on its validation split (dense ranking only), nothing chosen on test.

    python benchmarks/bench_static_fit.py --model_dir OUT --data_dir outputs/wordnet-xmc --max_seq_length 32
    python benchmarks/bench_static_fit.py --table_only          # the table of --out, nothing run

``OUT`` is a text model saved by a training script (its tower, its label index). The training queries and the
validation split are carved again from ``--data_dir`` as the script carved them (``--seed``, the default split);
the tower's vectors of the training queries are encoded once (bf16 where the CPU multiplies it natively) and shared by
every variant, as are the tower's token vectors each fit starts from (Model2Vec's start). Variants (``VARIANTS``):

* ``cosine``: the library's default fit (``1 - cos`` to the tower's vector, lazy Adam, 8 epochs of 256);
* ``cosine+ranking``: plus the library's ranking distillation (``TowerRanking``, weight 4), its option;
* ``cosine+labels``: plus the library's label term (``TowerRanking.label_loss``, weight 1): the softmax cross-entropy
  of each training query's own labels among the batch's candidates (the union of its queries' labels and the tower's
  top 16), at the ranking term's temperature: the training loss in the frozen label space;
* ``bigrams`` (not in the library): the table gains a row for every pair of adjacent tokens seen at least 3 times in the training queries
  (zero rows at the start: the first prediction is the unigram one), the bag averages both: a larger vocabulary that
  keeps some word order;
* combinations of them.

Reported per variant: the validation split's dense P@1 / P@5 (the static vectors searched in the model's own index,
the training filter's pairs removed as the scripts remove them),
``1 - cos`` to the tower's vectors on the validation queries (held out) and on the training queries (last epoch's
mean), the table's rows and the fit's seconds. Dense figures only: a saved model's ranker was refit on the validation
split (the scripts' default), so fused figures on it are not held out. Memory: the tower's vectors (``queries x dim x
2`` bytes), the table and its two Adam moments; a bigram row costs what a token row does (``dim x 4`` bytes, x 3 while
fitting).
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import (  # noqa: E402
    bench_parser,
    cpu_name,
    git_commit,
    markdown_table,
    publish,
    read_json,
    result_path,
    write_json,
)

#: name -> (ranking weight, label weight, bigram min count); 0 leaves the part out
VARIANTS = {
    "cosine": (0.0, 0.0, 0),
    "cosine+ranking": (4.0, 0.0, 0),
    "cosine+labels": (0.0, 1.0, 0),
    "cosine+ranking+labels": (4.0, 1.0, 0),
    "bigrams": (0.0, 0.0, 3),
    "bigrams+ranking": (4.0, 0.0, 3),
}
EPOCHS, BATCH, LEARNING_RATE = 8, 256, 1e-3


def bigram_vocabulary(token_rows: list[list[int]], min_count: int) -> dict[tuple[int, int], int]:
    """Each pair of adjacent tokens seen at least ``min_count`` times in ``token_rows`` -> its row past the vocabulary."""
    counts = Counter(pair for row in token_rows for pair in zip(row, row[1:]))
    kept = sorted(pair for pair, count in counts.items() if count >= min_count)
    return {pair: i for i, pair in enumerate(kept)}


def flat_bags(token_rows: list[list[int]], vocab_size: int, bigrams: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat ids, offsets and lengths of the bags: each row's tokens, then its known bigrams' rows."""
    bags = [[*row, *(vocab_size + bigrams[p] for p in zip(row, row[1:]) if p in bigrams)] for row in token_rows]
    lengths = torch.tensor([len(b) for b in bags], dtype=torch.long)
    offsets = torch.zeros(len(bags), dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)[:-1]
    return torch.tensor([t for b in bags for t in b], dtype=torch.long), offsets, lengths


def run(args) -> dict:
    from hf_xmc.cli import load_model
    from hf_xmc.models import static_encoder as se
    from hf_xmc.training.script_utils import XMCDataArguments, XMCTrainingArguments, load_data

    torch.manual_seed(0)
    model = load_model(args.model_dir)
    d = args.data_dir
    data = load_data(XMCDataArguments(train_file=f"{d}/trn.json.gz", test_file=f"{d}/tst.json.gz", label_file=f"{d}/lbl.json.gz",
                                      max_seq_length=args.max_seq_length),
                     XMCTrainingArguments(output_dir=os.path.join(args.model_dir, "bench_static_fit"), lexical_channel="omikuji", seed=args.seed))
    texts, val_texts = list(data.train.texts), list(data.validation.texts)
    val_targets, train_targets = data.validation.targets.tocsr(), data.train.targets.tocsr()
    tokenizer, budget = model._require_tokenizer(), int(model.config.max_seq_length) - 2
    started = time.perf_counter()
    dtype = torch.bfloat16 if args.bf16 else None
    with model.encoding_autocast(dtype):
        tower = F.normalize(model.query_search_vectors(texts).float(), dim=1)
        tower_val = F.normalize(model.query_search_vectors(val_texts).float(), dim=1)
        start_rows = se.tower_token_vectors(model)
    encode_seconds = time.perf_counter() - started
    index = model.ensure_label_index()
    teacher = se.TowerRanking(index, tower.half(), se.RANKING_DEPTH, se.RANKING_TEMPERATURE)

    num_labels = val_targets.shape[1]
    removed = data.validation.filter_matrix  # the training filter's pairs (the query's own synset), as the scripts remove them
    removed = removed.tocsr() if removed is not None else None
    extra = int(np.diff(removed.indptr).max()) if removed is not None and removed.nnz else 0

    def precision(vectors: torch.Tensor) -> dict:
        _, found = index.search(vectors, 5 + extra)
        hits = np.zeros((len(found), 5), dtype=bool)
        for i, row in enumerate(found % num_labels):  # a label's other rows (SiameseXML's centroids) are the label
            gone = set(removed.indices[removed.indptr[i]:removed.indptr[i + 1]]) if removed is not None else set()
            top = [j for j in dict.fromkeys(row.tolist()) if j not in gone][:5]
            hits[i, :len(top)] = np.asarray(val_targets[i, top].todense()).ravel() > 0
        return {"P@1": round(100 * float(hits[:, 0].mean()), 2), "P@5": round(100 * float(hits.mean()), 2)}

    token_rows = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=budget)["input_ids"]
    val_rows = tokenizer(val_texts, add_special_tokens=False, truncation=True, max_length=budget)["input_ids"]
    vocab = len(tokenizer)
    rows = []
    tower_row = {"variant": "tower (the trained transformer)", **precision(tower_val)}
    print(tower_row, flush=True)
    for name in args.variants:
        ranking_weight, label_weight, min_count = VARIANTS[name]
        began = time.perf_counter()
        bigrams = bigram_vocabulary(token_rows, min_count) if min_count else {}
        table = nn.EmbeddingBag(vocab + len(bigrams), tower.shape[1], mode="mean", sparse=True)
        table.weight.data[:vocab] = start_rows
        table.weight.data[vocab:] = 0.0
        ids, offsets, lengths = flat_bags(token_rows, vocab, bigrams)
        optimizer = torch.optim.SparseAdam([table.weight], lr=LEARNING_RATE)
        rng = np.random.default_rng(args.seed)
        for _ in range(EPOCHS):
            order = torch.from_numpy(rng.permutation(len(texts)))
            total = 0.0
            for start in range(0, len(order), BATCH):
                batch = order[start : start + BATCH]
                batch = batch[lengths[batch] > 0]
                bag_ids, bag_offsets = se.gather_bags(ids, offsets, lengths, batch)
                predicted = F.normalize(table(bag_ids, bag_offsets), dim=-1)
                wanted = tower[batch]
                cosine = (1.0 - (predicted * wanted).sum(1)).mean()
                loss = cosine
                if ranking_weight:
                    loss = loss + ranking_weight * teacher.loss(batch, predicted, wanted)
                if label_weight:
                    loss = loss + label_weight * teacher.label_loss(batch, predicted, train_targets)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total += cosine.item() * len(batch)
        with torch.no_grad():
            val_ids, val_offsets, _ = flat_bags(val_rows, vocab, bigrams)
            static_val = F.normalize(table(val_ids, val_offsets), dim=-1)
        row = {"variant": name, "ranking_weight": ranking_weight, "label_weight": label_weight, "bigram_min_count": min_count,
               "table_rows": vocab + len(bigrams), "train_cos_loss": round(total / len(texts), 4),
               "val_cos_loss": round(float(1.0 - (static_val * tower_val).sum(1).mean()), 4), "fit_seconds": round(time.perf_counter() - began, 1),
               **precision(static_val)}
        print(row, flush=True)
        rows.append(row)
    return {"model_dir": os.path.abspath(args.model_dir), "data_dir": os.path.abspath(d), "commit": git_commit(), "cpu": cpu_name(),
            "load_1min": round(os.getloadavg()[0], 2), "train_queries": len(texts), "validation_queries": len(val_texts),
            "encode_seconds": round(encode_seconds, 1), "tower": tower_row, "rows": rows}


def table(result: dict) -> str:
    head = ["variant", "table rows", "val dense P@1", "val dense P@5", "1 - cos, val", "1 - cos, train", "fit s"]
    body = [[result["tower"]["variant"], "", f"{result['tower']['P@1']:.2f}", f"{result['tower']['P@5']:.2f}", "", "", ""]]
    body += [[r["variant"], f"{r['table_rows']:,}", f"{r['P@1']:.2f}", f"{r['P@5']:.2f}", r["val_cos_loss"], r["train_cos_loss"], r["fit_seconds"]]
             for r in result["rows"]]
    return markdown_table(head, body) + (f"\n\nMeasured on {result['cpu']} (1-minute load {result['load_1min']}), {result['train_queries']:,} training "
                                         f"queries, {result['validation_queries']:,} validation queries; the tower's vectors encoded in "
                                         f"{result['encode_seconds']} s.")


def main() -> None:
    parser = bench_parser(__doc__, result_path("static_fit.json"), docs_block="static-fit", table_only=True)
    parser.add_argument("--model_dir", help="a text model saved by a training script")
    parser.add_argument("--data_dir", default=os.path.join(REPO, "outputs", "wordnet-xmc"), help="trn / tst / lbl.json.gz of its data")
    parser.add_argument("--max_seq_length", type=int, default=32)
    parser.add_argument("--seed", type=int, default=42, help="the training script's seed (it carves the validation split)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--bf16", type=lambda s: s.lower() in ("1", "true", "yes"), default=True, help="encode the tower's targets in bf16")
    args = parser.parse_args()
    if args.table_only:
        result = read_json(args.out)
    else:
        if not args.model_dir:
            parser.error("--model_dir is required unless --table_only")
        torch.set_num_threads(int(os.environ.get("THREADS", "2")))
        result = run(args)
        write_json(args.out, result, sort_keys=False)
    publish(table(result), "static-fit", args.update_docs)


if __name__ == "__main__":
    main()
