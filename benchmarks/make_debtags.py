#!/usr/bin/env python3
"""Convert the processed Debtags data into the bundled XC raw files of ``hf_xmc/data/debtags/``.

Input (see /work/shared/data/debtags/README.md): ``processed/docs.jsonl`` ({"package", "text", "tags"}),
``processed/labels.tsv`` (tag <TAB> description) and ``processed/split.txt`` ("trn"/"tst" per doc).

Output: ``trn.json.gz``, ``tst.json.gz``, ``lbl.json.gz`` in the XC raw format (point uid = package
name, title = the ``text`` field, target_ind = indices into labels.tsv order; label uid = tag, label
title = its description) and a ``README.md`` with provenance, licence and statistics. The gzip files
are written with mtime=0 and no embedded name, so re-running gives byte-identical files (for a given
zlib build).

Usage: python benchmarks/make_debtags.py [--src DIR] [--out DIR]
Standard library + hf_xmc.data only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hf_xmc.data import XMCDataset, read_xc_labels, read_xc_raw, write_xc_labels, write_xc_raw  # noqa: E402

DEFAULT_SRC = os.path.join(REPO, "..", "shared", "data", "debtags", "processed")
DEFAULT_OUT = os.path.join(REPO, "hf_xmc", "data", "debtags")


def build_csr(rows: list[list[int]], num_labels: int):
    """Build a float32 binary CSR matrix from per-row sorted label lists (scipy via hf_xmc's deps)."""
    import numpy as np
    import scipy.sparse as sp

    indptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=indptr[1:])
    indices = np.fromiter((j for r in rows for j in r), dtype=np.int64, count=int(indptr[-1]))
    return sp.csr_matrix((np.ones(indices.size, dtype=np.float32), indices, indptr), shape=(len(rows), num_labels))


def read_inputs(src: str) -> tuple[list[str], list[str], list[dict], list[str]]:
    """Read labels.tsv, docs.jsonl and split.txt, checking that they are consistent."""
    tags, descs = [], []
    with open(os.path.join(src, "labels.tsv"), encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 2:
                sys.exit(f"labels.tsv line {n}: expected 'tag<TAB>description'")
            tags.append(parts[0])
            descs.append(parts[1])
    with open(os.path.join(src, "docs.jsonl"), encoding="utf-8") as f:
        docs = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(src, "split.txt"), encoding="utf-8") as f:
        split = [line.strip() for line in f if line.strip()]
    if len(split) != len(docs):
        sys.exit(f"split.txt has {len(split)} lines but docs.jsonl has {len(docs)}")
    if set(split) - {"trn", "tst"}:
        sys.exit(f"unexpected split names: {sorted(set(split) - {'trn', 'tst'})}")
    if len(set(tags)) != len(tags):
        sys.exit("duplicate tags in labels.tsv")
    return tags, descs, docs, split


def describe(name: str, ds: XMCDataset) -> dict:
    """Per-split statistics."""
    nl = [int(x) for x in ds.targets.getnnz(axis=1)]
    nw = [len(t.split()) for t in ds.texts]
    return {"split": name, "points": len(ds), "avg_labels": sum(nl) / max(len(nl), 1),
            "max_labels": max(nl, default=0), "median_words": statistics.median(nw) if nw else 0,
            "avg_words": sum(nw) / max(len(nw), 1)}


def sha256(path: str) -> str:
    """Hex SHA-256 of a file."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


README = """# Debtags (bundled with hf_xmc)

Debian package short description -> Debtags tags. Real, human-curated multi-label data in the
"LF-...Titles" style: the input is a short text (the package name plus its one-line description,
{median_words:g} words at the median) and the labels are Debtags `facet::tag` codes, each with a text
description from the official Debtags vocabulary. It is **not** a published XMC benchmark.

Files (Extreme Classification Repository raw format, gzip JSON lines, read with
`hf_xmc.data.load_debtags()` or `hf_xmc.data.load_xc_dataset`):

| file | lines | content |
|---|---|---|
| `trn.json.gz` | {n_trn:,} | `uid` = package name, `title` = "package : short description", `target_ind` = tag ids |
| `tst.json.gz` | {n_tst:,} | same |
| `lbl.json.gz` | {n_lbl:,} | `uid` = tag (e.g. `devel::library`), `title` = "Facet: Tag description", `target_ind` = [] |

Label ids are 0-based indices into `lbl.json.gz` (the tags sorted alphabetically).

## Provenance

Built by `benchmarks/make_debtags.py` from the processed files of the shared Debtags data
(`processed/docs.jsonl`, `processed/labels.tsv`, `processed/split.txt`, made by its `prepare.py`,
standard library only). The sources come only from the Debian package registry:

- Tag vocabulary (`/usr/share/debtags/vocabulary`) from `debtags_2.1.5_all.deb`, obtained with
  `apt-get download debtags`.
- Package names, short descriptions and tags: the `Package:`, `Description:` and `Tag:` lines of the
  tagged stanzas of `apt-cache dumpavail` (Debian 12 "bookworm" main amd64, package index dated
  2026-07-11, fetched 2026-11-22 after `apt-get update`). Re-fetching later gives a slightly
  different set.
- Label text is "Facet description: Tag description" from the vocabulary; {n_nodesc} tags have no
  vocabulary text and keep their code as text.
- Split: seeded 80/20 random split (`random.Random(0)`, one draw per package in index order).

## Licence / terms

Debian package metadata (names, descriptions, tags) is public archive metadata. The debtags tool and
the Debtags vocabulary are GPL-2 (Enrico Zini et al.).

## Statistics (measured by make_debtags.py)

| split | points | avg labels/point | max labels/point | avg words | median words |
|---|---|---|---|---|---|
{split_rows}

- {n_lbl} labels; {n_lbl_trn} occur in train, {n_lbl_tst} in test, {n_lbl_tst_only} occur in test but not in train.
- Points without labels: {n_unlabeled} (none are skipped).
- The label distribution is very skewed: most frequent tags (train+test):
{top_tags}
  So P@1 is easy; report PSP@k or macro metrics alongside it.
- Labels with at most 5 points (train+test): {n_rare} of {n_lbl}.

File sizes and SHA-256 (gzip level 9, mtime=0; hashes can differ with another zlib build):

| file | bytes | sha256 |
|---|---|---|
{file_rows}
"""


def main() -> None:
    """Convert, verify by reading back, and write the README."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default=DEFAULT_SRC, help="directory with docs.jsonl, labels.tsv, split.txt")
    ap.add_argument("--out", default=DEFAULT_OUT, help="output directory")
    args = ap.parse_args()

    tags, descs, docs, split = read_inputs(args.src)
    tag_id = {t: i for i, t in enumerate(tags)}
    parts: dict[str, tuple[list[str], list[str], list[list[int]]]] = {"trn": ([], [], []), "tst": ([], [], [])}
    for n, (doc, s) in enumerate(zip(docs, split, strict=True), 1):
        unknown = [t for t in doc["tags"] if t not in tag_id]
        if unknown:
            sys.exit(f"docs.jsonl line {n}: tags not in labels.tsv: {unknown}")
        uids, texts, rows = parts[s]
        uids.append(doc["package"])
        texts.append(doc["text"])
        rows.append(sorted({tag_id[t] for t in doc["tags"]}))

    os.makedirs(args.out, exist_ok=True)
    datasets = {}
    for s, (uids, texts, rows) in parts.items():
        datasets[s] = XMCDataset(texts=texts, targets=build_csr(rows, len(tags)), uids=uids)
        write_xc_raw(os.path.join(args.out, f"{s}.json.gz"), datasets[s])
    write_xc_labels(os.path.join(args.out, "lbl.json.gz"), tags, descs)

    # read back through the public readers: the files must round-trip exactly
    luids, ltexts = read_xc_labels(os.path.join(args.out, "lbl.json.gz"))
    assert luids == tags and ltexts == descs
    for s, ds in datasets.items():
        back = read_xc_raw(os.path.join(args.out, f"{s}.json.gz"), num_labels=len(tags), skip_unlabeled=False)
        assert back.uids == ds.uids and back.texts == ds.texts and (back.targets != ds.targets).nnz == 0

    stats = [describe("train", datasets["trn"]), describe("test", datasets["tst"])]
    freq_trn = [int(x) for x in datasets["trn"].targets.getnnz(axis=0)]
    freq_tst = [int(x) for x in datasets["tst"].targets.getnnz(axis=0)]
    freq = Counter({tags[i]: freq_trn[i] + freq_tst[i] for i in range(len(tags))})
    all_words = [len(t.split()) for ds in datasets.values() for t in ds.texts]
    fields = {
        "median_words": statistics.median(all_words),
        "n_trn": len(datasets["trn"]), "n_tst": len(datasets["tst"]), "n_lbl": len(tags),
        "n_nodesc": sum(1 for t, d in zip(tags, descs, strict=True) if d.endswith(": " + t)),
        "split_rows": "\n".join(f"| {d['split']} | {d['points']:,} | {d['avg_labels']:.2f} | {d['max_labels']} | "
                                f"{d['avg_words']:.2f} | {d['median_words']:g} |" for d in stats),
        "n_lbl_trn": sum(1 for x in freq_trn if x), "n_lbl_tst": sum(1 for x in freq_tst if x),
        "n_lbl_tst_only": sum(1 for a, b in zip(freq_trn, freq_tst, strict=True) if b and not a),
        "n_unlabeled": sum(int((ds.targets.getnnz(axis=1) == 0).sum()) for ds in datasets.values()),
        "top_tags": "\n".join(f"  - `{t}`: {c:,} points" for t, c in freq.most_common(5)),
        "n_rare": sum(1 for c in freq.values() if c <= 5),
        "file_rows": "\n".join(
            f"| `{name}` | {os.path.getsize(os.path.join(args.out, name)):,} | "
            f"`{sha256(os.path.join(args.out, name))}` |" for name in ("trn.json.gz", "tst.json.gz", "lbl.json.gz")),
    }
    with open(os.path.join(args.out, "README.md"), "w", encoding="utf-8") as f:
        f.write(README.format(**fields))
    for d in stats:
        print(d)
    print(f"labels {len(tags)}; files written to {args.out}")


if __name__ == "__main__":
    main()
