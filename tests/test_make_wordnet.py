"""benchmarks/make_wordnet.py on a hand-written WordNet database in the wndb(5WN) format."""

import gzip
import json

import numpy as np

from benchmarks import make_wordnet

LICENCE = "  1 This software and database is being provided to you, the LICENSEE, by  \n"
DATA = {
    "noun": [
        "00000001 03 n 01 animal 0 000 | a living organism; \"animals move\"",
        "00000002 05 n 02 dog 0 domestic_dog 0 002 @ 00000001 n 0000 %p 00000003 n 0000 | a domesticated canid; \"the dog barked\"",
        "00000003 05 n 01 tail 0 001 #p 00000002 n 0000 | the rear part",
        "00000004 05 n 01 cat 0 001 @ 00000001 n 0000 | a feline",
        "00000005 05 n 01 rock 0 001 ! 00000001 n 0101 | a stone",  # antonym only: not a query
    ],
    "verb": [
        "00000001 38 v 01 run 0 001 @ 00000002 v 0000 01 + 02 00 | move fast",
        "00000002 38 v 01 move 0 000 01 + 01 00 | change position",
    ],
    "adj": [
        "00000001 00 a 01 big(a) 0 001 & 00000002 s 0000 | above average in size; \"a big car\"",
        "00000002 00 s 01 huge 0 001 & 00000001 a 0000 | unusually large",
    ],
    "adv": ["00000001 02 r 01 quickly 0 001 \\ 00000001 a 0101 | with speed"],  # pertainym: not a query
}


def _database(directory):
    directory.mkdir()
    for name, lines in DATA.items():
        (directory / f"data.{name}").write_text(LICENCE + "".join(line + "  \n" for line in lines), encoding="latin-1")
    return directory


def _read(path):
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def _filter(out, split):
    text = (out / f"filter_labels_{'train' if split == 'trn' else 'test'}.txt").read_text()
    return [tuple(map(int, line.split())) for line in text.splitlines()]


def test_make_wordnet_builds_the_lf_task(tmp_path):
    db = _database(tmp_path / "dict")
    out = tmp_path / "out"
    # seed 1 puts big, dog and cat in test, huge, tail and run in training (see the reciprocal-pair test)
    stats = make_wordnet.main(["--wordnet_dir", str(db), "--output_dir", str(out), "--test_fraction", "0.5", "--seed", "1"])
    labels = _read(out / "lbl.json.gz")
    uid_text = {r["uid"]: r["title"] for r in labels}
    # labels: every relation target; the antonym and the pertainym make no pair
    assert sorted(uid_text) == ["a:00000001", "a:00000002", "n:00000001", "n:00000002", "n:00000003", "v:00000002"]
    assert uid_text["n:00000002"] == "dog, domestic dog: a domesticated canid"  # lemmas, definition, no example
    assert uid_text["a:00000001"] == "big: above average in size"  # the (a) marker dropped
    label_uids = [r["uid"] for r in labels]
    points = {split: _read(out / f"{split}.json.gz") for split in ("trn", "tst")}
    # the training filter lists exactly the (point, own label) pairs of points that are labels
    assert _filter(out, "trn") == [(i, label_uids.index(r["uid"])) for i, r in enumerate(points["trn"]) if r["uid"] in uid_text]
    expected = {  # every query's relation targets; in test, those whose reverse is a training pair are gone
        "n:00000002": {"n:00000001"}, "n:00000003": {"n:00000002"}, "n:00000004": {"n:00000001"},
        "v:00000001": {"v:00000002"}, "a:00000002": {"a:00000001"},
    }
    got = {r["uid"]: {label_uids[j] for j in r["target_ind"]} for rows in points.values() for r in rows}
    assert got == expected
    assert (stats["num_train"], stats["num_test"], stats["num_labels"]) == (3, 2, 6)
    train_labels = {j for r in points["trn"] for j in r["target_ind"]}
    unseen = {j for r in points["tst"] for j in r["target_ind"]} - train_labels
    # a label no training query has is a test-only (unseen) one, or one whose only pair was a removed reciprocal one
    assert stats["test_labels_unseen_in_training"] == len(unseen) == 1
    assert stats["labels_without_training_query"] == len(unseen) + stats["labels_without_any_query"] == 3
    readme = (out / "README.md").read_text()
    assert "WordNet 3.0 Copyright 2006 by Princeton University" in readme
    assert "**Version**: v2" in readme and "neither a hit nor a miss" in readme
    # seeded: the same files again
    again = tmp_path / "again"
    make_wordnet.main(["--wordnet_dir", str(db), "--output_dir", str(again), "--test_fraction", "0.5", "--seed", "1"])
    for name in ("trn.json.gz", "tst.json.gz", "lbl.json.gz", "filter_labels_test.txt"):
        assert (gzip.open(out / name).read() if name.endswith(".gz") else (out / name).read_bytes()) == (
            gzip.open(again / name).read() if name.endswith(".gz") else (again / name).read_bytes())
    assert np.isclose(stats["labels_per_train_query"], sum(len(r["target_ind"]) for r in points["trn"]) / 3, atol=1e-3)


def test_make_wordnet_moves_reciprocal_test_pairs_to_the_filter(tmp_path):
    """dog %p tail / tail #p dog and big & huge / huge & big are reverse pairs; seed 1 puts dog, big and cat in test."""
    from hf_xmc.data.filters import read_filter_file

    db = _database(tmp_path / "dict")
    out = tmp_path / "out"
    stats = make_wordnet.main(["--wordnet_dir", str(db), "--output_dir", str(out), "--test_fraction", "0.5", "--seed", "1"])
    label_uids = [r["uid"] for r in _read(out / "lbl.json.gz")]
    lid = {u: i for i, u in enumerate(label_uids)}
    trn, tst = _read(out / "trn.json.gz"), _read(out / "tst.json.gz")
    train_pairs = {(r["uid"], label_uids[j]) for r in trn for j in r["target_ind"]}
    assert {("n:00000003", "n:00000002"), ("a:00000002", "a:00000001")} <= train_pairs  # tail -> dog, huge -> big
    # no test pair's reverse is a training pair
    assert not [(r["uid"], label_uids[j]) for r in tst for j in r["target_ind"] if (label_uids[j], r["uid"]) in train_pairs]
    # big's only label (huge) was reciprocal: big is dropped; dog keeps animal and loses tail to the filter
    assert [r["uid"] for r in tst] == ["n:00000002", "n:00000004"]
    assert tst[0]["target_ind"] == [lid["n:00000001"]]
    filt = _filter(out, "tst")
    assert filt == sorted({(0, lid["n:00000002"]), (0, lid["n:00000003"])})  # dog's own synset and the removed pair
    matrix = read_filter_file(out / "filter_labels_test.txt", len(tst), len(label_uids))  # the reader takes it
    assert matrix.nnz == 2 and matrix[0, lid["n:00000003"]]
    assert (stats["version"], stats["reciprocal_pairs_removed"], stats["test_points_dropped_without_label"]) == ("v2", 2, 1)
    assert stats["test_pairs_before_removal"] == 4 and stats["test_pairs"] == 2 and stats["filter_pairs_test"] == 2
    assert 0 < stats["reciprocal_pairs_psp5_ideal_mass_share"] < 1
    assert json.loads((out / "stats.json").read_text())["reciprocal_pairs_removed"] == 2
    # --keep_reciprocal_pairs builds v1: every relation target in test, the filter only the own synsets
    v1 = tmp_path / "v1"
    stats1 = make_wordnet.main(["--wordnet_dir", str(db), "--output_dir", str(v1), "--test_fraction", "0.5", "--seed", "1",
                                "--keep_reciprocal_pairs"])
    tst1 = _read(v1 / "tst.json.gz")
    assert [r["uid"] for r in tst1] == ["a:00000001", "n:00000002", "n:00000004"]
    assert tst1[1]["target_ind"] == [lid["n:00000001"], lid["n:00000003"]]
    assert _filter(v1, "tst") == [(0, lid["a:00000001"]), (1, lid["n:00000002"])]
    assert (stats1["version"], stats1["reciprocal_pairs_removed"], stats1["num_test"]) == ("v1", 0, 3)
    assert (stats1["test_pairs_with_reverse_in_training"], stats["test_pairs_with_reverse_in_training"]) == (2, 0)
    assert (v1 / "trn.json.gz").read_bytes() == (out / "trn.json.gz").read_bytes()


def test_split_queries_on_a_hand_made_relation_set():
    """Reverse pairs by hand: a <-> b symmetric, c -> d with d -> c (inverse relations), e -> f one way only."""
    targets = {"a": ["b", "x"], "b": ["a"], "c": ["d"], "d": ["c", "y"], "e": ["f"], "f": ["z"], "g": ["e"]}
    queries = sorted(targets)
    for seed in range(50):  # a seed that leaves both a partial removal and a dropped query in test
        split = make_wordnet.split_queries(queries, targets, 3 / 7, seed)
        if split["dropped_test"] and any(q not in split["dropped_test"] for q in split["reciprocal"]):
            break
    else:
        raise AssertionError("no seed gives both cases")
    train_pairs = {(q, t) for q, ts in split["trn"] for t in ts}
    test_queries = [q for q, _ in split["tst_before"]]
    assert sorted(test_queries + [q for q, _ in split["trn"]]) == queries
    for q in test_queries:
        kept = dict(split["tst"]).get(q, [])
        removed = split["reciprocal"].get(q, [])
        assert sorted(kept + removed) == targets[q]  # every pair either stays in test or is reciprocal
        assert all((t, q) in train_pairs for t in removed) and not any((t, q) in train_pairs for t in kept)
        assert (q in split["dropped_test"]) == (not kept)
    # keeping them reproduces the split before the rule
    v1 = make_wordnet.split_queries(queries, targets, 3 / 7, seed, keep_reciprocal=True)
    assert v1["tst"] == split["tst_before"] and not v1["reciprocal"] and not v1["dropped_test"]


def test_make_wordnet_names_a_broken_line(tmp_path):
    import pytest

    db = _database(tmp_path / "dict")
    (db / "data.verb").write_text(LICENCE + "00000001 38 v zz run\n", encoding="latin-1")
    with pytest.raises(SystemExit, match=r"data\.verb:2: not a WordNet data line"):
        make_wordnet.main(["--wordnet_dir", str(db), "--output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
