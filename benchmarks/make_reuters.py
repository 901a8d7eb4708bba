#!/usr/bin/env python3
"""Convert Reuters-21578 (ModApte split, the 90 topics with train and test documents) into XC raw files.

Reuters is the second real dataset we check defaults on (Debtags is the first). Its licence allows research use
only, so the files are written under ``outputs/`` and never shipped with the package.

    python benchmarks/make_reuters.py [--src ../shared/data/reuters21578/processed] [--out outputs/reuters]

Point: uid = Reuters NEWID, title = headline (the body's first 12 words when the headline is empty),
content = body; labels: the topic code as uid and its description (``label_text.tsv``) as title.
"""

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import scipy.sparse as sp  # noqa: E402

from hf_xmc.data import XMCDataset, write_xc_labels, write_xc_raw  # noqa: E402

DEFAULT_SRC = os.path.join(REPO, "..", "shared", "data", "reuters21578", "processed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=DEFAULT_SRC)
    ap.add_argument("--out", default=os.path.join(REPO, "outputs", "reuters"))
    args = ap.parse_args()
    topics = [t.strip() for t in open(os.path.join(args.src, "topics90.txt")) if t.strip()]
    descriptions = {}
    for line in open(os.path.join(args.src, "label_text.tsv"), encoding="utf-8"):
        code, field, text = line.rstrip("\n").split("\t")
        if field == "topics":
            descriptions[code] = text
    label_id = {t: i for i, t in enumerate(topics)}
    os.makedirs(args.out, exist_ok=True)
    for split, name in (("trn", "modapte_trn.jsonl"), ("tst", "modapte_tst.jsonl")):
        texts, uids, rows = [], [], []
        for line in open(os.path.join(args.src, name), encoding="utf-8"):
            doc = json.loads(line)
            ids = sorted({label_id[t] for t in doc["topics"] if t in label_id})
            if not ids:
                continue
            title = doc["title"].strip() or " ".join(doc["body"].split()[:12])
            texts.append(title)
            uids.append(str(doc["newid"]))
            rows.append(ids)
        indptr = np.cumsum([0] + [len(r) for r in rows])
        targets = sp.csr_matrix((np.ones(indptr[-1], dtype=np.float32), np.concatenate(rows), indptr), shape=(len(rows), len(topics)))
        write_xc_raw(os.path.join(args.out, f"{split}.json.gz"), XMCDataset(texts=texts, targets=targets, uids=uids))
        print(f"{split}: {len(rows)} documents")
    write_xc_labels(os.path.join(args.out, "lbl.json.gz"), topics, [descriptions.get(t, t) for t in topics])
    print(f"{len(topics)} labels -> {args.out}")


if __name__ == "__main__":
    main()
