#!/usr/bin/env python
"""Peak memory of a UniDEC model per label: build, index + predict, and one training step (SparseAdamW, what
XMCTrainer uses), at growing label spaces, each size in a fresh process (peak RSS from getrusage).

    python benchmarks/bench_unidec_memory.py [--labels 10000 100000 1000000] [--dim 384] [--update_docs]

The encoder is a small random BERT (hidden 32, MiniLM's tokenizer) so the label-space-dependent parts dominate: the
classifier ``Psi`` (L x d), the saved search vectors ``[DE ; classifier]`` (L x 2d) and the faiss index over them,
and in training Psi's AdamW moments (its gradient is sparse: the pool's rows only). Bytes per label are the slope between the two largest sizes (the
encoder and Python are constant). Writes benchmarks/results/unidec_memory.json (``--out``) and, with --update_docs,
the table between the ``<!-- bench:unidec_memory -->`` lines of docs/models.md; ``--table_only`` re-renders the table
of ``--out``.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import bench_parser, markdown_table, publish, read_json, result_path, write_json  # noqa: E402
from benchmarks.sweep_defaults import minilm  # noqa: E402


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def make_encoder(path: str) -> None:
    from transformers import AutoTokenizer, BertConfig, BertModel

    tokenizer = AutoTokenizer.from_pretrained(minilm())
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def measure(encoder: str, num_labels: int, dim: int, phase: str) -> dict:
    """One phase in this process: 'predict' (build, index, predict) or 'train' (build, one SparseAdamW step on a pool)."""
    import torch

    from hf_xmc.models import UniDECModel
    from hf_xmc.training import PSLDataCollator, SparseAdamW

    torch.manual_seed(0)
    start = time.perf_counter()
    model = UniDECModel.from_encoder_pretrained(encoder, label_space_size=num_labels, projection_dim=dim, classifier_init="xavier", max_seq_length=16, label_max_seq_length=16)
    model.set_labels([f"label number {i}" for i in range(num_labels)])
    after_build = peak_mb()
    if phase == "predict":
        model.build_label_index(batch_size=4096, show_progress_bar=False)
        pred = model.predict(["a query about label number 5", "another query"], k=10)
        assert pred.label_ids.shape == (2, 10)
    else:
        import numpy as np
        import scipy.sparse as sp

        rng = np.random.default_rng(0)
        queries = 64
        targets = sp.csr_matrix((np.ones(queries * 3), (np.repeat(np.arange(queries), 3), rng.integers(0, num_labels, queries * 3))), shape=(queries, num_labels))
        collator = PSLDataCollator(model.tokenizer, [f"query {i}" for i in range(queries)], targets, model.label_texts, 16, 16, num_positives=3, max_label_pool=256)
        batch = collator([{"index": i} for i in range(queries)])
        optimizer = SparseAdamW(model.parameters(), lr=1e-3)  # Psi's gradient is sparse (sparse_label_gradients)
        model.train()
        model(**batch).loss.backward()
        optimizer.step()
    return {"labels": num_labels, "dim": dim, "phase": phase, "peak_mb": peak_mb(), "after_build_mb": after_build, "seconds": time.perf_counter() - start}


def unidec_memory_table(result: dict) -> str:
    """Peak RSS per label-space size and phase, then the bytes per label between the two largest sizes."""
    dim, by = result["dim"], {(r["labels"], r["phase"]): r for r in result["rows"]}
    sizes = list(dict.fromkeys(r["labels"] for r in result["rows"]))  # in the order they ran (--labels)
    cells = [[f"{n:,}", dim, f"{by[n, 'predict']['peak_mb']:.0f}", f"{by[n, 'train']['peak_mb']:.0f}"] for n in sizes]
    per_label = result["bytes_per_label"]
    if per_label:
        big, small = max(sizes), sorted(sizes)[-2]
        cells.append([f"bytes per label (slope {small:,} -> {big:,})", None, f"{per_label['predict']:.0f} ({per_label['predict'] / dim:.1f} x d)",
                      f"{per_label['train']:.0f} ({per_label['train'] / dim:.1f} x d)"])
    header = ["labels L", "d", "peak RSS build + index + predict (MB)", "peak RSS one training step (MB)"]
    return markdown_table(header, cells, "rrrr") + "\n"


def main() -> None:
    ap = bench_parser(__doc__, result_path("unidec_memory.json"), docs_block="unidec_memory", table_only=True)
    ap.add_argument("--labels", nargs="+", type=int, default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.table_only:
        publish(unidec_memory_table(read_json(args.out)), "unidec_memory", args.update_docs)
        return
    if args._child:
        encoder, num_labels, phase = args._child
        print("RESULT " + json.dumps(measure(encoder, int(num_labels), args.dim, phase)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as work:
        make_encoder(work)
        for num_labels in args.labels:
            for phase in ("predict", "train"):
                proc = subprocess.run([sys.executable, __file__, "--dim", str(args.dim), "--_child", work, str(num_labels), phase],
                                      capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=REPO))
                if proc.returncode:
                    raise SystemExit(proc.stderr[-3000:])
                row = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][0][7:])
                rows.append(row)
                print(f"L={num_labels:>9,} {phase:8s} peak {row['peak_mb']:9.0f} MB ({row['seconds']:.0f} s)", flush=True)
    big, small = max(args.labels), sorted(args.labels)[-2] if len(args.labels) > 1 else None
    by = {(r["labels"], r["phase"]): r for r in rows}
    per_label = {}
    if small is not None:
        for phase in ("predict", "train"):
            per_label[phase] = (by[big, phase]["peak_mb"] - by[small, phase]["peak_mb"]) * 2**20 / (big - small)
    result = {"dim": args.dim, "rows": rows, "bytes_per_label": per_label}
    write_json(args.out, result)
    publish(unidec_memory_table(result), "unidec_memory", args.update_docs)


if __name__ == "__main__":
    main()
