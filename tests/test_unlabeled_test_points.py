"""Test points without a label count as misses by default (pyxclib's and the XC repository's convention): the
scripts' readers keep them, the metrics average over them, the evaluator records the convention; the flag
``--skip_unlabeled_test_points`` gives the labelled-only numbers. Filter pairs that are also positives are counted."""

import json
import logging
import math

import numpy as np
import pytest
import scipy.sparse as sp

from hf_xmc.data.filters import filter_overlap_pairs
from hf_xmc.metrics import inverse_propensity, xmc_metrics
from hf_xmc.training.script_utils import XMCDataArguments, build_evaluator, load_data

NUM_LABELS = 6
# Five test queries, two without a label (rows 1 and 3), each with its fixed ranking (best first).
TEST_TRUTH = [[0, 2], [], [1, 3, 5], [], [4]]
RANKING = {"q0": [0, 1, 2, 3, 4], "q1": [1, 0, 2, 3, 4], "q2": [5, 4, 3, 2, 1], "q3": [2, 3, 4, 5, 0], "q4": [0, 4, 1, 2, 3]}
# Training points: label frequencies 3, 2, 1, 1, 1, 0 (a PSP@k with distinct propensities); the last has no label.
TRAIN_TRUTH = [[0, 1], [0, 2], [0, 3], [1, 4], []]


def _write(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


@pytest.fixture
def xc_files(tmp_path):
    """A task in XC raw files whose test and training files hold points without a label, and a validation file too."""
    _write(tmp_path / "lbl.json", [{"uid": f"l{j}", "title": f"label {j}"} for j in range(NUM_LABELS)])
    _write(tmp_path / "trn.json", [{"uid": f"t{i}", "title": f"train {i}", "target_ind": t} for i, t in enumerate(TRAIN_TRUTH)])
    _write(tmp_path / "tst.json", [{"uid": f"q{i}", "title": f"q{i}", "target_ind": t} for i, t in enumerate(TEST_TRUTH)])
    _write(tmp_path / "val.json", [{"uid": "v0", "title": "v0", "target_ind": [1]}, {"uid": "v1", "title": "v1", "target_ind": []}])
    return tmp_path


def _args(directory, **kwargs) -> XMCDataArguments:
    return XMCDataArguments(train_file=str(directory / "trn.json"), test_file=str(directory / "tst.json"),
                            label_file=str(directory / "lbl.json"), **kwargs)


def pyxclib_reference(rankings, truth_lists, inv_p, k: int) -> dict[str, float]:
    """P@k, nDCG@k, R@k and PSP@k (%) the way pyxclib computes them, one query at a time over ALL rows: a row without
    positives divides by max(1, ...) and so scores 0; PSP@k is the sum of the hits' inverse propensities over the sum
    of the best achievable ones."""
    n = len(truth_lists)
    p = ndcg = recall = ps_hits = ps_best = 0.0
    for ranked, positives in zip(rankings, truth_lists):
        positives = set(positives)
        hits = [1.0 if label >= 0 and label in positives else 0.0 for label in list(ranked)[:k]]
        p += sum(hits) / k
        dcg = sum(h / math.log2(rank + 2) for rank, h in enumerate(hits))
        ideal = sum(1 / math.log2(rank + 2) for rank in range(min(k, len(positives))))
        ndcg += dcg / max(1.0, ideal)
        recall += sum(hits) / max(1, len(positives))
        ps_hits += sum(inv_p[label] for label, h in zip(ranked, hits) if h)
        ps_best += sum(sorted((inv_p[label] for label in positives), reverse=True)[:k])
    return {f"P@{k}": 100 * p / n, f"nDCG@{k}": 100 * ndcg / n, f"R@{k}": 100 * recall / n, f"PSP@{k}": 100 * ps_hits / ps_best}


def _truth(lists) -> sp.csr_matrix:
    rows = [i for i, row in enumerate(lists) for _ in row]
    cols = [j for row in lists for j in row]
    return sp.csr_matrix((np.ones(len(cols), dtype=np.float32), (rows, cols)), shape=(len(lists), NUM_LABELS))


def _train_inv_propensity() -> np.ndarray:
    return inverse_propensity(_truth([t for t in TRAIN_TRUTH if t]))  # the reader skips the unlabelled training point


class FixedRanker:
    """The slice of a model the evaluator calls, ranking each query text by :data:`RANKING`."""

    takes_images = False
    lexical_channel = None
    score_calibration = None

    def label_index_is_current(self, label_texts) -> bool:
        return True

    def rank(self, texts, k, batch_size=None, show_progress_bar=None, return_dense=False, images=None):
        ids = np.full((len(texts), k), -1, dtype=np.int64)
        for i, text in enumerate(texts):
            ranked = RANKING[text][:k]
            ids[i, : len(ranked)] = ranked
        return np.broadcast_to(-np.arange(k, dtype=np.float32), ids.shape).copy(), ids


# ---------------------------------------------------------------------------------------------------- reading
def test_the_scripts_keep_unlabelled_test_points_and_skip_unlabelled_training_and_validation_points(xc_files):
    data = load_data(_args(xc_files, validation_file=str(xc_files / "val.json")))
    assert data.test.uids == ["q0", "q1", "q2", "q3", "q4"] and data.test.num_skipped == 0
    assert np.diff(data.test.targets.indptr).tolist() == [2, 0, 3, 0, 1]
    assert data.test.record_indices().tolist() == [0, 1, 2, 3, 4]  # a filter file's point_idx is the file's row
    assert len(data.train) == 4 and data.train.num_skipped == 1
    assert data.validation.uids == ["v0"] and data.validation.num_skipped == 1  # nothing to tune on in an empty row

    skipped = load_data(_args(xc_files, skip_unlabeled_test_points=True))
    assert skipped.test.uids == ["q0", "q2", "q4"] and skipped.test.num_skipped == 2
    assert skipped.test.record_indices().tolist() == [0, 2, 4]


def test_a_datasets_format_test_file_keeps_its_unlabelled_rows_too(xc_files):
    pytest.importorskip("datasets")
    _write(xc_files / "test.jsonl", [{"text": f"q{i}", "labels": t} for i, t in enumerate(TEST_TRUTH)])
    args = XMCDataArguments(train_file=str(xc_files / "trn.json"), test_file=str(xc_files / "test.jsonl"), label_file=str(xc_files / "lbl.json"))
    assert np.diff(load_data(args).test.targets.indptr).tolist() == [2, 0, 3, 0, 1]
    args.skip_unlabeled_test_points = True
    assert load_data(args).test.texts == ["q0", "q2", "q4"]


# ---------------------------------------------------------------------------------------------------- metrics
def test_metrics_over_every_row_match_a_pyxclib_style_reference():
    topk = np.array([RANKING[f"q{i}"] for i in range(5)])
    truth, inv_p = _truth(TEST_TRUTH), _train_inv_propensity()
    got = xmc_metrics(topk, truth, inv_p, ks=(1, 3, 5), recall_ks=(5,))
    for k in (1, 3, 5):
        ref = pyxclib_reference(topk, TEST_TRUTH, inv_p, k)
        for name in (f"P@{k}", f"nDCG@{k}", f"PSP@{k}"):
            assert got[name] == pytest.approx(ref[name], abs=1e-9), name
    assert got["R@5"] == pytest.approx(pyxclib_reference(topk, TEST_TRUTH, inv_p, 5)["R@5"], abs=1e-9)
    # by hand: P@1 hits q0 and q2 of 5 rows; P@5 has 2 + 3 + 1 hits in 25 slots; every positive is in the top 5
    assert got["P@1"] == pytest.approx(40.0) and got["P@5"] == pytest.approx(24.0) and got["R@5"] == pytest.approx(60.0)
    # nDCG@3: q0 (1 + 1/log2 4) / (1 + 1/log2 3), q2 (1 + 1/log2 4) / (1 + 1/log2 3 + 1/2), q4 (1/log2 3) / 1, over 5 rows
    by_hand = (1.5 / (1 + 1 / math.log2(3)) + 1.5 / (1.5 + 1 / math.log2(3)) + 1 / math.log2(3)) / 5
    assert got["nDCG@3"] == pytest.approx(100 * by_hand)

    labelled = [i for i, t in enumerate(TEST_TRUTH) if t]
    only = xmc_metrics(topk[labelled], truth[labelled], inv_p, ks=(1, 3, 5), recall_ks=(5,))
    assert only["P@1"] == pytest.approx(200 / 3) and only["R@5"] == pytest.approx(100.0)
    for name in ("P@1", "P@3", "P@5", "nDCG@1", "nDCG@3", "nDCG@5", "R@5"):  # inflated by n_all / n_labelled = 5 / 3
        assert got[name] == pytest.approx(only[name] * 3 / 5), name
    for name in ("PSP@1", "PSP@3", "PSP@5", "PSnDCG@5"):  # a ratio of sums: an empty row adds 0 to both
        assert got[name] == pytest.approx(only[name]), name


# ---------------------------------------------------------------------------------------------------- evaluator
def test_the_scripts_evaluator_counts_them_and_records_the_convention(xc_files):
    args = _args(xc_files)
    metrics = build_evaluator(load_data(args), args)(FixedRanker())
    topk, inv_p = np.array([RANKING[f"q{i}"] for i in range(5)]), _train_inv_propensity()
    for k in (1, 3, 5):
        ref = pyxclib_reference(topk, TEST_TRUTH, inv_p, k)
        for name in (f"P@{k}", f"nDCG@{k}", f"PSP@{k}"):
            assert metrics[f"test_{name}"] == pytest.approx(ref[name], abs=1e-9), name
    assert metrics["test_R@10"] == pytest.approx(60.0)
    assert metrics["test_unlabeled_points"] == 2 and metrics["test_unlabeled_counted"] is True
    assert "test_filter_overlap_pairs" not in metrics  # no filter file
    assert all(np.isfinite(float(value)) for value in metrics.values())  # every other metric takes the empty rows

    args = _args(xc_files, skip_unlabeled_test_points=True)
    labelled_only = build_evaluator(load_data(args), args)(FixedRanker())
    assert labelled_only["test_P@1"] == pytest.approx(200 / 3) and labelled_only["test_R@10"] == pytest.approx(100.0)
    assert labelled_only["test_P@5"] == pytest.approx(metrics["test_P@5"] * 5 / 3)
    assert labelled_only["test_PSP@5"] == pytest.approx(metrics["test_PSP@5"])
    assert labelled_only["test_unlabeled_points"] == 2 and labelled_only["test_unlabeled_counted"] is False


def test_the_scripts_latency_flag_times_the_final_model_one_query_at_a_time(xc_files):
    """``--latency_queries n`` reaches the scripts' evaluator: ``test_latency_bs1_p50_ms`` from n single-query calls
    (after 3 untimed), absent by default; a negative count is refused when the arguments are parsed."""
    calls = []

    class CountingRanker(FixedRanker):
        def rank(self, texts, k, batch_size=None, **kwargs):
            calls.append((len(texts), batch_size))
            return super().rank(texts, k, batch_size, **kwargs)

    args = _args(xc_files, latency_queries=4)
    metrics = build_evaluator(load_data(args), args)(CountingRanker())
    assert metrics["test_latency_bs1_p50_ms"] > 0
    assert calls.count((1, 1)) == 3 + 4  # 3 warm-up calls and 4 timed ones, one query each
    assert "test_latency_bs1_p50_ms" not in build_evaluator(load_data(_args(xc_files)), _args(xc_files))(FixedRanker())
    with pytest.raises(ValueError, match="--latency_queries"):
        _args(xc_files, latency_queries=-1)


def test_the_evaluator_refuses_a_convention_its_queries_contradict(xc_files):
    from hf_xmc.training.evaluation import XMCEvaluator

    kept = load_data(_args(xc_files))
    with pytest.raises(ValueError, match="unlabeled_counted=False, but the queries hold 2 without a label"):
        XMCEvaluator(kept.test, kept.label_texts, unlabeled_counted=False)
    skipped = load_data(_args(xc_files, skip_unlabeled_test_points=True))
    with pytest.raises(ValueError, match="and 2 were skipped by the reader"):
        XMCEvaluator(skipped.test, skipped.label_texts, unlabeled_counted=True)


def test_downstream_summaries_take_empty_rows(xc_files):
    """The card's summary (per-frequency precision) and the calibration pairs work on a test split with empty rows."""
    from hf_xmc.training.calibration import ranked_pairs
    from hf_xmc.training.cards import evaluation_summary

    args = _args(xc_files)
    evaluator = build_evaluator(load_data(args), args)
    metrics = evaluator(FixedRanker())
    summary = evaluation_summary(evaluator)
    assert summary["num_queries"] == 5 and summary["unlabeled_points"] == 2 and summary["unlabeled_counted"] is True
    assert 100 * sum(b["precision_contribution"] for b in summary["buckets"]) == pytest.approx(metrics["test_P@5"])
    ids = np.array([RANKING[f"q{i}"] for i in range(5)])
    _, relevant = ranked_pairs(ids, -np.tile(np.arange(5.0), (5, 1)), evaluator.data.targets, depth=5)
    assert relevant.reshape(5, 5)[[1, 3]].sum() == 0 and relevant.sum() == 6  # an empty row's pairs are all irrelevant


def test_the_model_card_names_the_convention(xc_files, tiny_encoder_dir):
    pytest.importorskip("jinja2")
    pytest.importorskip("matplotlib")
    from hf_xmc.models import DEXMLModel
    from hf_xmc.training.cards import evaluation_summary, generate_model_card

    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir)
    texts = {}
    for skip in (False, True):
        args = _args(xc_files, skip_unlabeled_test_points=skip)
        evaluator = build_evaluator(load_data(args), args)
        evaluator(FixedRanker())
        texts[skip] = generate_model_card(model, evaluation_summary(evaluator), model_id="org/m").files["README.md"].decode()
    assert "(5 queries). 2 of them have no label and count as misses" in texts[False]
    assert "(3 queries). 2 queries without a label were left out" in texts[True]


# ---------------------------------------------------------------------------------------------------- filters
def test_filter_pairs_that_are_positives_are_counted_and_warned(xc_files, caplog):
    # (0, 2) is a positive of q0, (1, 3) is on an empty row, (4, 0) is not a positive: one overlap
    (xc_files / "filter.txt").write_text("0 2\n1 3\n4 0\n")
    args = _args(xc_files, test_filter_file=str(xc_files / "filter.txt"))
    with caplog.at_level(logging.WARNING, logger="hf_xmc.training.evaluation"):
        evaluator = build_evaluator(load_data(args), args)
    assert any("1 filtered (query, label) pairs are also positives" in r.getMessage() for r in caplog.records)
    metrics = evaluator(FixedRanker())
    assert metrics["test_filter_overlap_pairs"] == 1
    # q0 loses its positive 2 ([0, 1, 3, 4]: 1 hit), q2 keeps 3 hits, q4 loses 0 ([4, 1, 2, 3]: 1 hit): P@5 = 5 / 25
    assert metrics["test_P@5"] == pytest.approx(100 * (1 + 3 + 1) / 25)

    assert filter_overlap_pairs(sp.csr_matrix((1, 3)), sp.csr_matrix(np.ones((1, 3)))) == 0
    assert filter_overlap_pairs(sp.csr_matrix(np.eye(3)), sp.csr_matrix(np.ones((3, 2)))) == 2  # column 2: no target
    with pytest.raises(ValueError, match="filter matrix has 2 rows but the targets have 3"):
        filter_overlap_pairs(sp.csr_matrix((2, 3)), sp.csr_matrix((3, 3)))


# ---------------------------------------------------------------------------------------------------- hf-xmc evaluate
def test_hf_xmc_evaluate_counts_them_unless_asked(xc_files, monkeypatch, capsys):
    from hf_xmc import cli

    class Loaded(FixedRanker):
        label_texts = [f"label {j}" for j in range(NUM_LABELS)]
        label_uids = [f"l{j}" for j in range(NUM_LABELS)]

    monkeypatch.setattr(cli, "load_model", lambda name: Loaded())
    monkeypatch.setattr(cli, "_pick_device", lambda model, device: None)
    base = ["evaluate", "m", "--test_file", str(xc_files / "tst.json"), "--train_file", str(xc_files / "trn.json"),
            "--propensity_a", "0.55", "--propensity_b", "1.5"]
    assert cli.main(base) == 0
    counted = json.loads(capsys.readouterr().out)
    assert counted["test_P@1"] == pytest.approx(40.0) and counted["test_unlabeled_points"] == 2 and counted["test_unlabeled_counted"] is True
    assert cli.main([*base, "--skip_unlabeled_test_points"]) == 0
    skipped = json.loads(capsys.readouterr().out)
    assert skipped["test_P@1"] == pytest.approx(200 / 3) and skipped["test_unlabeled_counted"] is False
