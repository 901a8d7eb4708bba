#!/usr/bin/env python3
"""Build WordNet-XMC, a label-feature (LF) XMC task with ~53K labels from WordNet 3.0.

Source: Debian's ``wordnet-base`` package (the WordNet 3.0 database files ``data.noun``, ``data.verb``,
``data.adj``, ``data.adv``; WordNet 3.0 licence, Princeton University, a permissive BSD-style licence: use, copy,
modify and distribute with the copyright notice kept). Read from ``/usr/share/wordnet`` when the package is
installed, else fetched with ``apt-get download wordnet-base`` and unpacked with ``dpkg-deb -x`` into a temporary
directory (Debian's package registry is reachable where PyPI is; nothing else is downloaded).

The task, shaped like the Extreme Classification Repository's LF datasets (LF-AmazonTitles, LF-WikiSeeAlsoTitles):

* a **synset** (a set of synonyms with a gloss) is both a query and, when something points at it, a label; its text
  is ``"lemma, lemma, ...: definition"`` (underscores as spaces, the gloss without its quoted examples), e.g.
  ``"dwarf: a plant or animal that is atypically small"``: short texts, a dozen words;
* a query's labels are the synsets it points to through WordNet's semantic relations ``--relations`` (default: the
  hypernym ``@`` and instance hypernym ``@i``, the part / member / substance meronyms ``%p %m %s`` and holonyms
  ``#p #m #s``, also-see ``^`` and similar-to ``&``; lexical pointers count for their synsets);
* the labels are every synset that is the target of one of those relations from some query, all with a text;
  queries are every synset with at least one such target;
* the split is a seeded random split of the queries (``--test_fraction``); labels of test queries that no training
  query has are the unseen (zero-shot) labels, as LF datasets have;
* a query synset that is also a label never has itself as a target, and its own label would be the trivial nearest
  text: ``filter_labels_train.txt`` / ``filter_labels_test.txt`` list those ``point_idx label_idx`` pairs (the
  repository's filter files), removed from the predictions before scoring (``--test_filter_file``);
* **reciprocal pairs** (dataset version ``v2``): meronyms / holonyms are each other's inverse and also-see /
  similar-to are symmetric, so a test pair (q, l) often has its reverse (l, q) among the training pairs, a pair a
  shared encoder or a label-text score can use and a TF-IDF tree cannot. As the repository's LF datasets do, every
  test pair whose reverse is a training pair is removed from the test ground truth and listed in
  ``filter_labels_test.txt`` (predicting it is neither a hit nor a miss); a test query left without a label is
  dropped from ``tst.json.gz``. The label set is unchanged (``lbl.json.gz`` is v1's). ``--keep_reciprocal_pairs``
  builds v1, the split before this rule (the tables measured before issue 65).

Output (``--output_dir``, default ``outputs/wordnet-xmc``): ``trn.json.gz``, ``tst.json.gz`` (``uid`` = ``pos:offset``
as in WordNet's files, ``title`` = the text, ``target_ind``), ``lbl.json.gz`` (labels sorted by uid),
``filter_labels_train.txt``, ``filter_labels_test.txt``, ``README.md`` (provenance, licence, statistics, the
split) and ``stats.json``. Re-running with the same seed and package version gives the same files.

Usage: python benchmarks/make_wordnet.py [--output_dir DIR] [--seed 0] [--test_fraction 0.1] [--wordnet_dir DIR]
       [--keep_reciprocal_pairs]
Runtime: about 20 seconds (parsing the 28 MB database).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import scipy.sparse as sp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness import write_text  # noqa: E402
from hf_xmc.data import XMCDataset, write_xc_labels, write_xc_raw  # noqa: E402
from hf_xmc.metrics import inverse_propensity, propensity_constants  # noqa: E402

#: WordNet's part-of-speech letters -> the data file that holds the synset (satellite adjectives live in data.adj).
POS_FILES = {"n": "noun", "v": "verb", "a": "adj", "s": "adj", "r": "adv"}
DEFAULT_RELATIONS = ("@", "@i", "%p", "%m", "%s", "#p", "#m", "#s", "^", "&")
RELATION_NAMES = {
    "@": "hypernym", "@i": "instance hypernym", "%p": "part meronym", "%m": "member meronym", "%s": "substance meronym",
    "#p": "part holonym", "#m": "member holonym", "#s": "substance holonym", "^": "also see", "&": "similar to",
}
SYSTEM_WORDNET = "/usr/share/wordnet"
#: v1: the first split (reciprocal pairs in the test ground truth); v2: test pairs whose reverse is a training pair
#: moved from the test ground truth to the test filter, test queries left without a label dropped.
DATASET_VERSION = "v2"


def fetch_wordnet(work_dir: str) -> tuple[str, str]:
    """Download and unpack Debian's ``wordnet-base`` into ``work_dir``: (database directory, ``wordnet-base <version>``)."""
    subprocess.run(["apt-get", "download", "wordnet-base"], cwd=work_dir, check=True, capture_output=True)
    (deb,) = glob.glob(os.path.join(work_dir, "wordnet-base_*.deb"))
    subprocess.run(["dpkg-deb", "-x", deb, os.path.join(work_dir, "root")], check=True)
    version = subprocess.run(["dpkg-deb", "-f", deb, "Version"], check=True, capture_output=True, text=True).stdout.strip()
    return os.path.join(work_dir, "root", "usr", "share", "wordnet"), f"wordnet-base {version}"


def synset_text(words: list[str], gloss: str) -> str:
    """``"lemma, lemma: definition"``: lemmas with spaces for underscores (adjective markers like ``(p)`` dropped), the
    gloss's definition without its quoted examples."""
    lemmas = []
    for w in words:
        w = re.sub(r"\([a-z]+\)$", "", w).replace("_", " ")
        if w not in lemmas:
            lemmas.append(w)
    definition = "; ".join(p.strip() for p in gloss.split(";") if p.strip() and not p.strip().startswith('"'))
    return f"{', '.join(lemmas)}: {definition}" if definition else ", ".join(lemmas)


def read_wordnet(wordnet_dir: str) -> tuple[dict[str, str], dict[str, list[tuple[str, str]]]]:
    """Parse the four ``data.*`` files: ``{uid: text}`` and ``{uid: [(relation symbol, target uid), ...]}``.

    A uid is ``<file pos>:<offset>`` (``n``, ``v``, ``a``, ``r``; satellites share ``a``). Format: wndb(5WN).
    """
    texts: dict[str, str] = {}
    pointers: dict[str, list[tuple[str, str]]] = {}
    for pos, name in (("n", "noun"), ("v", "verb"), ("a", "adj"), ("r", "adv")):
        path = os.path.join(wordnet_dir, f"data.{name}")
        with open(path, encoding="latin-1") as f:
            for lineno, line in enumerate(f, 1):
                if line.startswith("  "):
                    continue  # the licence header
                head, sep, gloss = line.partition(" | ")
                fields = head.split()
                try:
                    offset, n_words = fields[0], int(fields[3], 16)
                    words = fields[4:4 + 2 * n_words:2]
                    i = 4 + 2 * n_words
                    n_pointers = int(fields[i])
                    targets = []
                    for j in range(i + 1, i + 1 + 4 * n_pointers, 4):
                        symbol, target, target_pos = fields[j], fields[j + 1], fields[j + 2]
                        targets.append((symbol, f"{'a' if POS_FILES[target_pos] == 'adj' else target_pos}:{target}"))
                except (IndexError, ValueError, KeyError):
                    raise SystemExit(f"{path}:{lineno}: not a WordNet data line: {line[:60]!r}") from None
                uid = f"{pos}:{offset}"
                texts[uid] = synset_text(words, gloss.strip() if sep else "")
                pointers[uid] = targets
    return texts, pointers


def _targets_matrix(label_lists: list[list[int]], num_labels: int) -> sp.csr_matrix:
    """Binary CSR ``(len(label_lists) x num_labels)`` from per-row sorted label ids."""
    indptr = np.cumsum([0] + [len(r) for r in label_lists])
    indices = np.concatenate([np.asarray(r, dtype=np.int64) for r in label_lists]) if indptr[-1] else np.zeros(0, np.int64)
    return sp.csr_matrix((np.ones(indptr[-1], dtype=np.float32), indices, indptr), shape=(len(label_lists), num_labels))


def split_queries(queries: list[str], targets: dict[str, list[str]], test_fraction: float, seed: int,
                  keep_reciprocal: bool = False) -> dict:
    """The seeded split in uid space: ``trn`` / ``tst`` query uids with their label uids, and the reciprocal pairs.

    A test pair (q, l) is reciprocal when its reverse (l, q) is a training pair (a label and a query are the same synset
    when their uids are equal). Unless ``keep_reciprocal``, those pairs leave the test ground truth for
    ``reciprocal`` (``{test uid: [label uid, ...]}``), and the test queries left without a label go to
    ``dropped_test``. Returns ``{"trn": [(uid, [label uid, ...]), ...], "tst": [...], "tst_before": [...],
    "reciprocal": {...}, "dropped_test": [...], "reciprocal_within_test": int, "reverse_in_train": int}``.
    """
    order = np.random.default_rng(seed).permutation(len(queries))
    n_test = int(round(test_fraction * len(queries)))
    trn = [(queries[i], targets[queries[i]]) for i in sorted(order[n_test:].tolist())]
    tst_before = [(queries[i], targets[queries[i]]) for i in sorted(order[:n_test].tolist())]
    train_pairs = {(q, t) for q, ts in trn for t in ts}
    test_pairs = {(q, t) for q, ts in tst_before for t in ts}
    tst, reciprocal, dropped = [], {}, []
    for q, ts in tst_before:
        rec = [] if keep_reciprocal else [t for t in ts if (t, q) in train_pairs]
        kept = [t for t in ts if t not in rec]
        if rec:
            reciprocal[q] = rec
        if kept:
            tst.append((q, kept))
        else:
            dropped.append(q)  # every label was reciprocal: no ground truth left to score
    # pairs whose reverse is also a test pair: neither side is seen in training, so nothing leaks (counted, kept)
    within_test = sum((t, q) in test_pairs for q, ts in tst for t in ts)
    reverse_in_train = sum((t, q) in train_pairs for q, ts in tst for t in ts)  # 0 unless keep_reciprocal
    return {"trn": trn, "tst": tst, "tst_before": tst_before, "reciprocal": reciprocal, "dropped_test": dropped,
            "reciprocal_within_test": within_test, "reverse_in_train": reverse_in_train}


def build_task(texts: dict[str, str], pointers: dict[str, list[tuple[str, str]]], relations, test_fraction: float, seed: int,
               keep_reciprocal: bool = False):
    """Queries, labels, split and filter pairs (see the module docstring). Returns a dict of everything written."""
    relations = set(relations)
    targets = {uid: sorted({t for s, t in ps if s in relations}) for uid, ps in pointers.items()}
    targets = {uid: t for uid, t in sorted(targets.items()) if t}
    label_uids = sorted({t for ts in targets.values() for t in ts})
    label_id = {uid: i for i, uid in enumerate(label_uids)}
    split = split_queries(list(targets), targets, test_fraction, seed, keep_reciprocal)
    out = {"label_uids": label_uids, "label_texts": [texts[u] for u in label_uids],
           "version": "v1" if keep_reciprocal else DATASET_VERSION}
    for name in ("trn", "tst"):
        uids = [q for q, _ in split[name]]
        Y = _targets_matrix([[label_id[t] for t in ts] for _, ts in split[name]], len(label_uids))
        out[name] = XMCDataset(texts=[texts[u] for u in uids], targets=Y, uids=uids)
        own = {(i, label_id[u]) for i, u in enumerate(uids) if u in label_id}
        rec = {(i, label_id[t]) for i, u in enumerate(uids) for t in split["reciprocal"].get(u, [])} if name == "tst" else set()
        out[f"filter_{name}"] = sorted(own | rec)
    # the test split before the rule, and its reciprocal pairs, for the statistics (what the removed pairs carried)
    before = split["tst_before"]
    out["tst_before_targets"] = _targets_matrix([[label_id[t] for t in ts] for _, ts in before], len(label_uids))
    out["tst_before_reciprocal"] = _targets_matrix(
        [sorted(label_id[t] for t in split["reciprocal"].get(q, [])) for q, _ in before], len(label_uids))
    out["dropped_test"] = split["dropped_test"]
    out["reciprocal_within_test"] = split["reciprocal_within_test"]
    out["reverse_in_train"] = split["reverse_in_train"]
    return out


def reciprocal_mass_share(task: dict, k: int = 5) -> float:
    """Share of the ideal PSP@k mass of the test split before the rule (each query's k rarest true labels' inverse
    propensities, summed over queries) that sits on the reciprocal pairs (propensities from the training split)."""
    before, rec = task["tst_before_targets"], task["tst_before_reciprocal"]
    if not rec.nnz:
        return 0.0
    inv = inverse_propensity(task["trn"].targets, *propensity_constants("wordnet-xmc"))
    total = carried = 0.0
    for i in range(before.shape[0]):
        labels = before.indices[before.indptr[i]:before.indptr[i + 1]]
        top = labels[np.argsort(-inv[labels], kind="stable")[:k]]
        total += float(inv[top].sum())
        carried += float(inv[np.intersect1d(top, rec.indices[rec.indptr[i]:rec.indptr[i + 1]])].sum())
    return carried / total if total else 0.0


def statistics(task: dict, relations) -> dict:
    """The figures of ``stats.json`` and the README: sizes, frequencies, unseen labels, filters, reciprocal pairs."""
    trn, tst = task["trn"].targets, task["tst"].targets
    train_freq = np.asarray(trn.sum(0)).ravel()
    all_freq = train_freq + np.asarray(tst.sum(0)).ravel()
    test_labels = np.unique(tst.indices)
    unseen = test_labels[train_freq[test_labels] == 0]
    words = lambda ts: float(np.mean([len(t.split()) for t in ts]))  # noqa: E731
    return {
        "relations": list(relations),
        "num_labels": int(trn.shape[1]),
        "num_train": int(trn.shape[0]),
        "num_test": int(tst.shape[0]),
        "labels_per_train_query": round(trn.nnz / trn.shape[0], 3),
        "labels_per_test_query": round(tst.nnz / tst.shape[0], 3),
        "queries_per_label": round(float(all_freq.mean()), 3),
        "max_queries_per_label": int(all_freq.max()),
        "labels_with_one_query": int((all_freq == 1).sum()),
        "labels_without_training_query": int((train_freq == 0).sum()),
        "test_labels_unseen_in_training": int(len(unseen)),
        "test_pairs_with_unseen_label": int(np.isin(tst.indices, unseen).sum()),
        "words_per_query": round(words(task["trn"].texts), 2),
        "words_per_label": round(words(task["label_texts"]), 2),
        "filter_pairs_train": len(task["filter_trn"]),
        "filter_pairs_test": len(task["filter_tst"]),
        "version": task["version"],
        "reciprocal_pairs_removed": int(task["tst_before_reciprocal"].nnz),
        "reciprocal_pairs_psp5_ideal_mass_share": round(reciprocal_mass_share(task), 4),
        "test_points_dropped_without_label": len(task["dropped_test"]),
        "test_pairs_before_removal": int(task["tst_before_targets"].nnz),
        "test_pairs": int(tst.nnz),
        "reciprocal_pairs_within_test": int(task["reciprocal_within_test"]),
        "test_pairs_with_reverse_in_training": int(task["reverse_in_train"]),
        "labels_without_any_query": int((all_freq == 0).sum()),
        "top_labels": [(task["label_texts"][i][:60], int(all_freq[i])) for i in np.argsort(-all_freq)[:5]],
    }


def readme(stats: dict, source: str, seed: int, test_fraction: float) -> str:
    rel = ", ".join(f"`{s}` {RELATION_NAMES.get(s, s)}" for s in stats["relations"])
    top = "; ".join(f"{t!r} ({n})" for t, n in stats["top_labels"])
    if stats["version"] == "v1":
        version_note = "the first split, reciprocal pairs kept in the test ground truth; built with `--keep_reciprocal_pairs`"
        reciprocal_rule = (f"In this version they are kept: {stats['test_pairs_with_reverse_in_training']:,} test "
                           f"pairs (of {stats['test_pairs']:,}) have their reverse among the training pairs, and "
                           f"{stats['reciprocal_pairs_within_test']:,} among the test pairs.")
    else:
        version_note = "reciprocal test pairs moved to the test filter, test queries left without a label dropped"
        reciprocal_rule = (
            f"As the LF datasets' reciprocal-pair files do, the {stats['reciprocal_pairs_removed']:,} test pairs (of "
            f"{stats['test_pairs_before_removal']:,}) whose reverse is a training pair are removed from the test ground "
            f"truth and listed in `filter_labels_test.txt`, so predicting one is neither a hit nor a miss; they carried "
            f"{stats['reciprocal_pairs_psp5_ideal_mass_share']:.1%} of PSP@5's ideal mass. The "
            f"{stats['test_points_dropped_without_label']:,} test queries whose labels were all reciprocal carry no "
            "ground truth and are dropped from `tst.json.gz`. A test pair whose reverse is also a test pair is kept "
            "(neither side is seen in training); the label set is the same as v1's (a label whose only query was a "
            "removed pair has no query now).")
    reciprocal = textwrap.fill(
        "**Reciprocal pairs**: meronyms and holonyms are each other's inverse, also-see and similar-to are symmetric, so "
        "a test pair (query q, label l) can have its reverse (l, q) among the training pairs (the same synset is a query "
        f"and a label), a pair a shared encoder or a label-text score can use and a TF-IDF tree cannot. {reciprocal_rule}",
        width=117, break_on_hyphens=False)
    return f"""# WordNet-XMC

A label-feature extreme multi-label task built from WordNet 3.0 by `benchmarks/make_wordnet.py` (hf_xmc).

**Source**: Debian package `{source}` (the WordNet 3.0 database files `data.noun`, `data.verb`, `data.adj`,
`data.adv`). **Licence**: WordNet 3.0 licence (Princeton University): permission to use, copy, modify and distribute
for any purpose without fee, provided the copyright notice "WordNet 3.0 Copyright 2006 by Princeton University. All
rights reserved." and the disclaimer appear on all copies (see the package's `copyright` file).

**Task**: a query is a synset (text `"lemma, lemma: definition"`, the gloss without its examples); its labels are the
synsets it points to through {rel}. Labels are every synset that is such a target; all have a text.

**Version**: {stats['version']} ({version_note}).

**Split**: seeded random split of the queries (seed {seed}, {test_fraction:.0%} test). Filter files list the pairs
(query, the query's own synset as a label): remove them from predictions before scoring (`--test_filter_file
filter_labels_test.txt`), as the Extreme Classification Repository's LF datasets do.

{reciprocal}

| statistic | value |
|---|---:|
| labels | {stats['num_labels']:,} |
| training queries | {stats['num_train']:,} |
| test queries | {stats['num_test']:,} |
| labels per training / test query | {stats['labels_per_train_query']:.2f} / {stats['labels_per_test_query']:.2f} |
| queries per label (mean / max) | {stats['queries_per_label']:.2f} / {stats['max_queries_per_label']:,} |
| labels with one query | {stats['labels_with_one_query']:,} |
| labels without a training query | {stats['labels_without_training_query']:,} |
| test labels unseen in training (their test pairs) | {stats['test_labels_unseen_in_training']:,} ({stats['test_pairs_with_unseen_label']:,}) |
| words per query / label text | {stats['words_per_query']:.1f} / {stats['words_per_label']:.1f} |
| test pairs | {stats['test_pairs']:,} |
| filter pairs train / test | {stats['filter_pairs_train']:,} / {stats['filter_pairs_test']:,} |
| reciprocal test pairs removed (share of PSP@5's ideal mass) | {stats['reciprocal_pairs_removed']:,} ({stats['reciprocal_pairs_psp5_ideal_mass_share']:.1%}) |
| test queries dropped (every label reciprocal) | {stats['test_points_dropped_without_label']:,} |
| test pairs whose reverse is a test pair (kept) | {stats['reciprocal_pairs_within_test']:,} |
| labels without any query | {stats['labels_without_any_query']:,} |

Most frequent labels: {top}.

Files: `trn.json.gz`, `tst.json.gz` (`uid` = `pos:offset` of WordNet's data files, `title`, `target_ind`),
`lbl.json.gz` (labels sorted by uid), `filter_labels_train.txt`, `filter_labels_test.txt`, `stats.json`.
"""


def installed_version() -> str:
    """``wordnet-base <version>`` of the installed Debian package, or ``wordnet-base`` when dpkg does not know it."""
    proc = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "wordnet-base"], capture_output=True, text=True)
    return f"wordnet-base {proc.stdout.strip()}" if proc.returncode == 0 and proc.stdout.strip() else "wordnet-base"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output_dir", default=os.path.join(REPO, "outputs", "wordnet-xmc"))
    ap.add_argument("--wordnet_dir", default=None, help=f"WordNet's dict directory (default {SYSTEM_WORDNET} if present, else apt-get download wordnet-base).")
    ap.add_argument("--relations", nargs="+", default=list(DEFAULT_RELATIONS), help="WordNet pointer symbols whose targets are a query's labels.")
    ap.add_argument("--test_fraction", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep_reciprocal_pairs", action="store_true",
                    help="Build v1: keep the test pairs whose reverse is a training pair in the test ground truth.")
    args = ap.parse_args(argv)
    if not 0 < args.test_fraction < 1:
        ap.error(f"--test_fraction must be in (0, 1), got {args.test_fraction}")
    with tempfile.TemporaryDirectory() as work:
        wordnet_dir, source = args.wordnet_dir, "wordnet-base"
        if wordnet_dir is None and os.path.exists(os.path.join(SYSTEM_WORDNET, "data.noun")):
            wordnet_dir, source = SYSTEM_WORDNET, installed_version()
        if wordnet_dir is None:
            wordnet_dir, source = fetch_wordnet(work)
        texts, pointers = read_wordnet(wordnet_dir)
    task = build_task(texts, pointers, args.relations, args.test_fraction, args.seed, args.keep_reciprocal_pairs)
    stats = statistics(task, args.relations)
    stats["source"] = source
    os.makedirs(args.output_dir, exist_ok=True)
    for name in ("trn", "tst"):
        write_xc_raw(os.path.join(args.output_dir, f"{name}.json.gz"), task[name])
        pairs = "".join(f"{i} {j}\n" for i, j in task[f"filter_{name}"])
        write_text(os.path.join(args.output_dir, f"filter_labels_{'train' if name == 'trn' else 'test'}.txt"), pairs)
    write_xc_labels(os.path.join(args.output_dir, "lbl.json.gz"), task["label_uids"], task["label_texts"])
    write_text(os.path.join(args.output_dir, "stats.json"), json.dumps(stats, indent=2))
    write_text(os.path.join(args.output_dir, "README.md"), readme(stats, source, args.seed, args.test_fraction))
    print(json.dumps({k: v for k, v in stats.items() if k != "top_labels"}))
    return stats


if __name__ == "__main__":
    main()
