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


def test_make_wordnet_builds_the_lf_task(tmp_path):
    db = _database(tmp_path / "dict")
    out = tmp_path / "out"
    stats = make_wordnet.main(["--wordnet_dir", str(db), "--output_dir", str(out), "--test_fraction", "0.5", "--seed", "3"])
    labels = _read(out / "lbl.json.gz")
    uid_text = {r["uid"]: r["title"] for r in labels}
    # labels: every relation target; the antonym and the pertainym make no pair
    assert sorted(uid_text) == ["a:00000001", "a:00000002", "n:00000001", "n:00000002", "n:00000003", "v:00000002"]
    assert uid_text["n:00000002"] == "dog, domestic dog: a domesticated canid"  # lemmas, definition, no example
    assert uid_text["a:00000001"] == "big: above average in size"  # the (a) marker dropped
    label_uids = [r["uid"] for r in labels]
    points = {}
    for split in ("trn", "tst"):
        rows = _read(out / f"{split}.json.gz")
        points[split] = rows
        filt = [tuple(map(int, line.split())) for line in (out / f"filter_labels_{'train' if split == 'trn' else 'test'}.txt").read_text().splitlines()]
        # the filter lists exactly the (point, own label) pairs of points that are labels
        assert filt == [(i, label_uids.index(r["uid"])) for i, r in enumerate(rows) if r["uid"] in uid_text]
    expected = {
        "n:00000002": {"n:00000001", "n:00000003"}, "n:00000003": {"n:00000002"}, "n:00000004": {"n:00000001"},
        "v:00000001": {"v:00000002"}, "a:00000001": {"a:00000002"}, "a:00000002": {"a:00000001"},
    }
    got = {r["uid"]: {label_uids[j] for j in r["target_ind"]} for rows in points.values() for r in rows}
    assert got == expected
    assert (stats["num_train"], stats["num_test"], stats["num_labels"]) == (3, 3, 6)
    train_labels = {j for r in points["trn"] for j in r["target_ind"]}
    unseen = {j for r in points["tst"] for j in r["target_ind"]} - train_labels
    # every label is some query's target: the labels no training query has are the test-only (unseen) ones
    assert stats["test_labels_unseen_in_training"] == stats["labels_without_training_query"] == len(unseen)
    assert "WordNet 3.0 Copyright 2006 by Princeton University" in (out / "README.md").read_text()
    # seeded: the same files again
    again = tmp_path / "again"
    make_wordnet.main(["--wordnet_dir", str(db), "--output_dir", str(again), "--test_fraction", "0.5", "--seed", "3"])
    for name in ("trn.json.gz", "tst.json.gz", "lbl.json.gz", "filter_labels_test.txt"):
        assert (gzip.open(out / name).read() if name.endswith(".gz") else (out / name).read_bytes()) == (
            gzip.open(again / name).read() if name.endswith(".gz") else (again / name).read_bytes())
    assert np.isclose(stats["labels_per_train_query"], sum(len(r["target_ind"]) for r in points["trn"]) / 3, atol=1e-3)


def test_make_wordnet_names_a_broken_line(tmp_path):
    import pytest

    db = _database(tmp_path / "dict")
    (db / "data.verb").write_text(LICENCE + "00000001 38 v zz run\n", encoding="latin-1")
    with pytest.raises(SystemExit, match=r"data\.verb:2: not a WordNet data line"):
        make_wordnet.main(["--wordnet_dir", str(db), "--output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
