"""The lexical channel: TF-IDF features equal to scikit-learn's, pair scores, the fusion arithmetic, label edits, the
fit (Omikuji ranker + tuned weights), persistence, remote-code reload and the training-script flag."""

import json
import logging

import numpy as np
import pytest
import scipy.sparse as sp

from hf_xmc.models import DEXMLModel
from hf_xmc.models import lexical_channel as lc
from hf_xmc.models.lexical_channel import CsrRows, LexicalChannel, TfidfFeatures, pair_dot_products
from hf_xmc.training.lexical import as_scipy, fit_lexical_channel, fit_tfidf
from tests.models.test_modeling_common import predict_through_remote_code
from tests.test_training import contract_args, run_script

pytest.importorskip("omikuji")
pytest.importorskip("sklearn")

CORPUS = [
    "The quick brown fox jumps over the lazy dog", "a quick quick quick test", "Ünïcode wörds and CAPITALS Ünïcode",
    "dog dog cat", "lazy cat sleeps", "brown dog, quick fox!", "x y z",  # one-letter words are no tokens
]


def _csr(rows: CsrRows, width: int) -> np.ndarray:
    return as_scipy(rows, width).toarray()


def test_tfidf_transform_equals_scikit_learn():
    from sklearn.feature_extraction.text import TfidfVectorizer

    features = fit_tfidf(CORPUS, min_df=1)
    reference = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, norm="l2", min_df=1, dtype=np.float32).fit(CORPUS)
    texts = CORPUS + ["quick dog never seen words", "", "fox fox fox brown"]
    want = reference.transform(texts).toarray()
    got = _csr(features.transform(texts), features.num_features)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert not got[len(CORPUS) + 1].any()  # the empty text: an empty row


def test_csr_rows_select_concat_and_pair_dot_products():
    rng = np.random.default_rng(0)
    a = sp.random(7, 30, density=0.3, format="csr", dtype=np.float32, random_state=1)
    b = sp.random(5, 30, density=0.3, format="csr", dtype=np.float32, random_state=2)
    for m in (a, b):
        m.sort_indices()
    rows_a, rows_b = CsrRows(a.indptr, a.indices, a.data), CsrRows(b.indptr, b.indices, b.data)
    np.testing.assert_array_equal(_csr(rows_a.select(np.array([4, 0, 4])), 30), a.toarray()[[4, 0, 4]])
    np.testing.assert_array_equal(_csr(CsrRows.concat([rows_a, rows_b]), 30), np.vstack([a.toarray(), b.toarray()]))
    q, lab = rng.integers(0, 7, 50), rng.integers(0, 5, 50)
    want = (a.toarray()[q] * b.toarray()[lab]).sum(1)
    np.testing.assert_allclose(pair_dot_products(rows_a, rows_b, q, lab, 30), want, rtol=1e-5, atol=1e-7)


class FixedRanker:
    """A stand-in for an omikuji.Model (same ``predict`` signature) that returns fixed hits per query."""

    def __init__(self, hits):
        self.hits = hits
        self.calls = 0

    def predict(self, feature_value_pairs, beam_size=10, top_k=10):
        hits = self.hits[self.calls % len(self.hits)]
        self.calls += 1
        return hits[:top_k]


def _channel(ranker_hits, settings, label_texts=("alpha", "beta", "gamma", "delta", "epsilon", "zeta")):
    features = TfidfFeatures(["alpha", "beta", "gamma", "delta", "epsilon", "zeta"], np.ones(6, np.float32), ngram_max=1)
    return LexicalChannel(features, features.transform(list(label_texts)), FixedRanker(ranker_hits), settings=settings)


def test_fusion_by_hand():
    """dense hits 3 (0.9), 1 (0.8), 2 (0.1); ranker hits 2 (p 0.9), 5 (p 0.5); w_rank 1:
    3 -> 0.9, 1 -> 0.8, 2 -> 0.1 + 0.9 = 1.0, 5 (not a dense hit: the last dense score, 0.1) -> 0.1 + 0.5 = 0.6."""
    channel = _channel([[(2, 0.9), (5, 0.5)]], {"ranker_weight": 1.0, "text_weight": 0.0})
    scores, ids = channel.fuse(["gamma"], np.array([[0.9, 0.8, 0.1]]), np.array([[3, 1, 2]]), k=5)
    assert ids.tolist() == [[2, 3, 1, 5, -1]]
    np.testing.assert_allclose(scores[0, :4], [1.0, 0.9, 0.8, 0.6], rtol=1e-6)
    assert scores[0, 4] == -np.inf
    # with the text channel: the query "gamma" is the label text of 2 only (cosine 1), so 2 gains w_text
    channel.settings["text_weight"] = 0.5
    scores, ids = channel.fuse(["gamma"], np.array([[0.9, 0.8, 0.1]]), np.array([[3, 1, 2]]), k=2)
    assert ids.tolist() == [[2, 3]] and np.allclose(scores, [[1.5, 0.9]])
    # weights 0: the dense ranking exactly
    channel.settings.update(ranker_weight=0.0, text_weight=0.0)
    scores, ids = channel.fuse(["gamma"], np.array([[0.9, 0.8, 0.1]]), np.array([[3, 1, 2]]), k=3)
    assert ids.tolist() == [[3, 1, 2]] and np.allclose(scores, [[0.9, 0.8, 0.1]])


def test_label_edits_follow_the_ranker():
    channel = _channel([[(1, 0.9), (4, 0.8)]], {"ranker_weight": 1.0})
    channel.select_labels(np.array([0, 2, 3, 4, 5]))  # label 1 goes; 4 becomes 3
    _, ids = channel.fuse(["alpha"], np.array([[0.5]]), np.array([[0]]), k=3)
    assert ids.tolist() == [[3, 0, -1]]  # the removed label is never returned, the kept one under its new id
    channel.add_labels(["eta theta"])
    assert channel.num_labels == 6 and channel.label_rows.row(5)[0].size == 0  # unknown words: an empty TF-IDF row


@pytest.fixture(scope="module")
def lexical_model(tiny_encoder_dir, tiny_task):
    """A DEXML model with a random encoder (so the dense ranking is weak) and a lexical channel fitted on the task."""
    data, _ = tiny_task
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir)
    model.set_labels(data.label_texts, data.label_uids)
    channel = fit_lexical_channel(model, data.train, ranker_weight=0.5, tune_queries=100, n_threads=1)  # text_weight tuned
    return model, channel


def test_fit_tunes_weights_and_the_channel_beats_the_random_dense_model(lexical_model, tiny_task):
    from hf_xmc.metrics import xmc_metrics

    data, _ = tiny_task
    model, channel = lexical_model
    assert model.config.lexical_channel == channel.settings
    fused = model.predict(data.test.texts, k=5).label_ids
    dense_scores, dense_ids = model.search(model.encode_queries(data.test.texts), 5)
    p1_fused = xmc_metrics(fused, data.test.targets, ks=(1,), recall_ks=())["P@1"]
    p1_dense = xmc_metrics(dense_ids, data.test.targets, ks=(1,), recall_ks=())["P@1"]
    assert p1_fused > p1_dense + 20, (p1_fused, p1_dense)


def test_ranker_queries_in_threads_rank_as_one_after_the_other(lexical_model, tiny_task):
    import threading

    _, channel = lexical_model
    queries = channel.features.transform(tiny_task[0].test.texts)
    seen = set()
    predict = channel.ranker.predict

    class Recording:  # the omikuji model, recording which thread ran each query
        def predict(self, *args, **kwargs):
            seen.add(threading.current_thread().name)
            return predict(*args, **kwargs)

    original, channel.ranker = channel.ranker, Recording()
    try:
        channel.ranker_threads = 1
        one_by_one = channel.rank_with_ranker(queries, 20)
        assert seen == {threading.current_thread().name}
        seen.clear()
        channel.ranker_threads = 3
        threaded = channel.rank_with_ranker(queries, 20)
        assert seen and all(name.startswith("omikuji") for name in seen)  # the pool's threads walked the forest
    finally:
        channel.ranker, channel.ranker_threads = original, lc.RANKER_THREADS
    np.testing.assert_array_equal(threaded[0], one_by_one[0])
    np.testing.assert_array_equal(threaded[1], one_by_one[1])
    assert (one_by_one[0] >= 0).any()


def test_weights_tuned_on_held_out_queries(tiny_encoder_dir, tiny_task, monkeypatch):
    """Both weights tuned: on the planted task the words predict the labels and the random encoder does not, so the
    chosen pair puts weight on the lexical scores and beats the dense ranking on the held-out queries."""
    from hf_xmc.training import lexical

    data, _ = tiny_task
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir)
    model.set_labels(data.label_texts, data.label_uids)
    seen = {}
    tune = lexical.tune_fusion_weights
    monkeypatch.setattr(lexical, "tune_fusion_weights", lambda *a, **k: seen.setdefault("result", tune(*a, **k)))
    channel = fit_lexical_channel(model, data.train, tune_queries=100, n_threads=1)
    result = seen["result"]
    assert {f"{wr:g},{wt:g}" for wr in lexical.RANKER_WEIGHTS for wt in lexical.TEXT_WEIGHTS} <= set(result["grid"])
    # both ends of the fusion were scored: the dense ranking alone and the ranker weight at its cap
    cap = result["ranker_weights"][-1]
    assert cap > lexical.RANKER_WEIGHTS[-1] and "0,0" in result["grid"] and f"{cap:g},0" in result["grid"]
    assert len(result["grid"]) == len(result["ranker_weights"]) * len(result["text_weights"])
    assert isinstance(result["on_edge"], list) and channel.tuning["on_edge"] == result["on_edge"]
    assert result["objective"] == max(result["grid"].values()) > result["dense"] + 50
    assert (channel.settings["ranker_weight"], channel.settings["text_weight"]) == (result["ranker_weight"], result["text_weight"]) != (0, 0)


class RankerByWord:
    """A stand-in for an omikuji.Model whose hits are named by a word of the query (so the ranker's threads cannot
    hand one query's hits to another)."""

    def __init__(self, terms, hits_by_word):
        self.hits = {terms.index(word): hits for word, hits in hits_by_word.items()}

    def predict(self, feature_value_pairs, beam_size=10, top_k=10):
        return next((self.hits[t][:top_k] for t, _ in feature_value_pairs if t in self.hits), [])


class DenseStub:
    """What the weight tuning reads of a model: the propensity constants and a fixed dense ranking of its queries."""

    takes_images = False

    def __init__(self, scores, ids):
        from types import SimpleNamespace

        self.scores, self.ids = np.asarray(scores, np.float32), np.asarray(ids, np.int64)
        self.config = SimpleNamespace(propensity_a=0.55, propensity_b=1.5)

    def ensure_label_index(self):
        pass

    def rank(self, texts, k, **kwargs):
        assert len(texts) == len(self.ids)
        return None, None, self.scores[:, :k], self.ids[:, :k]


WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]  # the six label texts

# (query text, its relevant label, dense ids best first, their dense scores, the ranker's hits, how many such queries)
TUNING_CASES = {
    # the label text beats the dense score only above text weight 0.8 ("gamma": cosine 1 with label 2, dense 0.1 against
    # 0.9), and costs a query above 1.42 ("alpha alpha delta": cosines 0.86 with label 0 and 0.51 with the relevant 3,
    # which has a dense lead of 0.5): the best text weight, 1, is above the default grid's top (0.5)
    "text beyond the grid": [
        ("gamma", 2, [0, 2, 1, 3, 4, 5], [0.9, 0.1, 0.05, 0.0, -0.05, -0.1], [], 6),
        ("alpha alpha delta", 3, [3, 0, 1, 2, 4, 5], [0.5, 0.0, -0.02, -0.04, -0.06, -0.1], [], 3),
    ],
    # the ranker prefers the relevant label by 0.0012 in probability against a dense lead of 2 (a cosine of 1 against
    # -1): only a ranker weight above 1,667 ranks it first, and the cap is 2,000 (spread 2 / TIE_RESOLUTION)
    "ranker on its cap": [
        ("typec", 5, [0, 1, 2, 3, 4, 5], [1.0, 0.6, 0.2, -0.2, -0.6, -1.0], [(5, 0.5012), (0, 0.5)], 4),
    ],
    # the dense model is right on one half, the ranker on the other: a ranker weight in (0.44, 0.89) gets both
    "dense and ranker each right on half": [
        ("typed", 1, [1, 0, 2, 3, 4, 5], [0.9, 0.1, 0.05, 0.0, -0.05, -0.1], [(0, 0.9)], 4),
        ("typee", 3, [0, 3, 1, 2, 4, 5], [0.9, 0.5, 0.0, -0.1, -0.2, -0.3], [(3, 0.9)], 4),
    ],
}


def _tuning_case(name):
    """(model, channel, holdout, training targets) of one of :data:`TUNING_CASES`, and the ranker's own top-5."""
    from hf_xmc.data import XMCDataset

    rows = [row for *row, count in TUNING_CASES[name] for _ in range(count)]
    terms = WORDS + ["typec", "typed", "typee"]
    features = TfidfFeatures(terms, np.ones(len(terms), np.float32), ngram_max=1)
    ranker = RankerByWord(terms, {text: hits for text, _, _, _, hits in rows if hits})
    channel = LexicalChannel(features, features.transform(WORDS), ranker, settings={})
    texts = [text for text, *_ in rows]
    targets = sp.csr_matrix((np.ones(len(rows)), ([i for i in range(len(rows))], [label for _, label, *_ in rows])), shape=(len(rows), 6))
    holdout = XMCDataset(texts, targets, [str(i) for i in range(len(rows))])
    ranker_top = np.full((len(rows), 5), -1)
    for i, (*_, hits) in enumerate(rows):
        ranked = [label for label, _ in sorted(hits, key=lambda hit: -hit[1])][:5]
        ranker_top[i, : len(ranked)] = ranked
    train_targets = sp.csr_matrix(np.ones((3, 6), np.float32))  # every label equally frequent
    return DenseStub([r[3] for r in rows], [r[2] for r in rows]), channel, holdout, train_targets, ranker_top


def test_tuning_extends_the_text_grid_past_its_top_until_the_best_is_interior():
    from hf_xmc.training.lexical import TEXT_WEIGHTS, tune_fusion_weights

    result = tune_fusion_weights(*_tuning_case("text beyond the grid")[:4])
    assert (result["ranker_weight"], result["text_weight"]) == (0.0, 1.0) and result["on_edge"] == []
    # scored up to the first step past the best (1.5), then the cap (spread 1 / TIE_RESOLUTION), nothing between
    assert result["text_weights"] == [*TEXT_WEIGHTS, 0.75, 1.0, 1.5, 1000.0]
    assert result["grid"]["0,1"] == result["objective"] == 200.0  # every query right: P@1 100 + PSP@5 100
    assert result["grid"]["0,0.5"] < result["objective"] and result["grid"]["0,1.5"] < result["objective"]
    assert result["grid"]["0,1000"] < result["objective"]


def test_tuning_reports_a_weight_left_on_its_cap(caplog):
    from hf_xmc.training.lexical import RANKER_WEIGHTS, TIE_RESOLUTION, tune_fusion_weights, weight_cap

    model, channel, holdout, train_targets, _ = _tuning_case("ranker on its cap")
    assert weight_cap(2.0, RANKER_WEIGHTS[-1]) == 2.0 / TIE_RESOLUTION == 2000.0
    result = tune_fusion_weights(model, channel, holdout, train_targets, RANKER_WEIGHTS, (0.0,))
    assert (result["ranker_weight"], result["text_weight"]) == (2000.0, 0.0)
    assert result["on_edge"] == ["ranker_weight"]  # the text weight was fixed: never extended, never on an edge
    assert result["text_weights"] == [0.0]
    # the gap below the cap was scanned step by step (none of them ranks the relevant label first) before giving up
    assert result["ranker_weights"] == [*RANKER_WEIGHTS, 75.0, 100.0, 150.0, 200.0, 300.0, 500.0, 750.0, 1000.0, 1500.0, 2000.0]
    assert result["grid"]["1500,0"] < result["grid"]["2000,0"] == result["objective"]
    # without the extension the top of the grid is reported as its edge
    fixed = tune_fusion_weights(model, channel, holdout, train_targets, RANKER_WEIGHTS, (0.0,), extend=False)
    assert fixed["ranker_weight"] == 2000.0 and fixed["on_edge"] == ["ranker_weight"] and fixed["ranker_weights"][-2:] == [50.0, 2000.0]


@pytest.mark.parametrize("case", sorted(TUNING_CASES))
def test_tuned_fusion_is_at_least_the_dense_and_the_channel_dominated_ranking(case):
    """The invariant of the tuning on the queries it tunes on, against the two ends computed here without the fusion:
    the dense model's ranking and the ranker's own."""
    from hf_xmc.metrics import inverse_propensity, xmc_metrics
    from hf_xmc.training.lexical import tune_fusion_weights

    model, channel, holdout, train_targets, ranker_top = _tuning_case(case)
    result = tune_fusion_weights(model, channel, holdout, train_targets)
    inv_prop = inverse_propensity(train_targets, 0.55, 1.5)

    def objective(ids):
        m = xmc_metrics(ids[:, :5], holdout.targets, inv_prop, ks=(1, 5), recall_ks=())
        return m["P@1"] + m["PSP@5"]

    dense, ranker_alone = objective(model.ids), objective(ranker_top)
    assert result["objective"] >= max(dense, ranker_alone) - 1e-3, (result["objective"], dense, ranker_alone)
    assert result["dense"] == pytest.approx(dense, abs=1e-3)
    # the two ends are pairs of the grid: (0, 0) ranks as the dense model, the ranker's cap as the ranker (then dense)
    assert result["grid"]["0,0"] == pytest.approx(dense, abs=1e-3)
    assert result["grid"][f"{result['ranker_weights'][-1]:g},0"] >= ranker_alone - 1e-3
    if case == "dense and ranker each right on half":  # each end puts half the queries' label first, the fusion all
        assert (result["ranker_weight"], result["text_weight"], result["on_edge"]) == (0.5, 0.0, [])
        assert result["objective"] >= max(dense, ranker_alone) + 50


def test_fit_warns_when_a_tuned_weight_ends_on_its_cap(tiny_encoder_dir, tiny_task, monkeypatch, caplog):
    from hf_xmc.training import lexical

    data, _ = tiny_task
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir)
    model.set_labels(data.label_texts, data.label_uids)
    on_cap = {"ranker_weight": 2000.0, "text_weight": 0.0, "objective": 1.0, "dense": 0.0, "on_edge": ["ranker_weight"],
              "ranker_weights": [0.0, 2000.0], "text_weights": [0.0, 0.5], "grid": {}}
    monkeypatch.setattr(lexical, "tune_fusion_weights", lambda *a, **k: dict(on_cap))
    with caplog.at_level(logging.WARNING, logger="hf_xmc.training.lexical"):
        channel = fit_lexical_channel(model, data.train, tune_queries=100, n_threads=1)
    assert "the tuned ranker_weight ended on its grid's cap (2000)" in caplog.text and "text_weight ended" not in caplog.text
    assert channel.tuning["on_edge"] == ["ranker_weight"] and channel.settings["ranker_weight"] == 2000.0


def test_save_reload_and_remote_code_give_the_same_top_k(lexical_model, tiny_task, tmp_path):
    data, _ = tiny_task
    model, channel = lexical_model
    texts = data.test.texts[:8]
    want = model.predict(texts, k=5)
    model.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / lc.LEXICAL_FILE).exists()
    assert json.load(open(tmp_path / "m" / "config.json"))["lexical_channel"]["ranker_weight"] == channel.settings["ranker_weight"]
    assert "omikuji" in model.runtime_requirements()
    again = DEXMLModel.from_pretrained(tmp_path / "m")
    got = again.predict(texts, k=5)
    np.testing.assert_array_equal(got.label_ids, want.label_ids)
    np.testing.assert_allclose(got.scores, want.scores, rtol=1e-5, atol=1e-6)
    remote = predict_through_remote_code(tmp_path / "m", tmp_path, texts)
    assert remote["ids"] == want.label_ids.tolist()
    # the channel is named by config.json: a directory without its file is refused, not silently dense
    (tmp_path / "m" / lc.LEXICAL_FILE).unlink()
    with pytest.raises(ValueError, match="lexical channel"):
        DEXMLModel.from_pretrained(tmp_path / "m")


def test_a_ranker_refit_on_the_validation_queries_says_so_after_a_save_and_evaluate_flags_them(tiny_encoder_dir, tiny_task, tmp_path, caplog, capsys):
    """The ranker trained again on the validation split (--lexical_refit_ranker) records which queries it saw; a saved
    and reloaded model still knows, hf-xmc evaluate on those queries says its fused figures are not held out, and
    tuning the static encoder's weights on them warns; queries the ranker never saw are not flagged."""
    from hf_xmc import cli
    from hf_xmc.data import write_xc_raw
    from hf_xmc.data.splits import split_validation
    from hf_xmc.training.lexical import queries_seen_by_ranker

    data, task_dir = tiny_task
    train, validation = split_validation(data.train, size=40, seed=0)
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir)
    model.set_labels(data.label_texts, data.label_uids)
    channel = fit_lexical_channel(model, train, ranker_weight=0.5, text_weight=0.1, n_threads=1, validation=validation, refit_ranker=True)
    assert channel.queries_seen_by_ranker(validation.uids) == 40
    assert channel.queries_seen_by_ranker(train.uids) == 0 and channel.queries_seen_by_ranker(data.test.uids) == 0
    assert channel.queries_seen_by_ranker(validation.uids[:7] + data.test.uids[:5]) == 7
    model.save_pretrained(tmp_path / "m")
    loaded = DEXMLModel.from_pretrained(tmp_path / "m")
    assert loaded.lexical_channel.queries_seen_by_ranker(validation.uids) == 40
    with caplog.at_level(logging.WARNING):
        assert queries_seen_by_ranker(loaded, validation, "tuned on") == 40
    assert "40 of the 40 queries tuned on trained the lexical channel's ranker" in caplog.text
    write_xc_raw(tmp_path / "val.json.gz", validation)
    capsys.readouterr()
    for points, flagged in ((tmp_path / "val.json.gz", 40), (f"{task_dir}/tst.json.gz", 0)):
        out = tmp_path / f"metrics-{flagged}.json"
        assert cli.main(["evaluate", str(tmp_path / "m"), "--test_file", str(points), "--output_file", str(out)]) == 0
        err = capsys.readouterr().err
        assert json.load(open(out)).get("queries_seen_by_lexical_ranker") == (flagged or None)
        assert ("the fused metrics are not held out" in err) == bool(flagged)
    # hf-xmc fit-static tunes the static encoder's weights on them: said, and recorded in what it prints
    assert cli.main(["fit-static", str(tmp_path / "m"), "--train_file", f"{task_dir}/trn.json.gz", "--validation_file", str(tmp_path / "val.json.gz"),
                     "--epochs", "1", "--precision", "float32", "--output_dir", str(tmp_path / "static")]) == 0
    assert json.loads(capsys.readouterr().out)["static_tuning_queries_seen_by_ranker"] == 40
    # a ranker trained again (on the training queries only, as a user refitting it would) forgets the record
    loaded.lexical_channel.set_ranker(loaded.lexical_channel.ranker)
    assert loaded.lexical_channel.queries_seen_by_ranker(validation.uids) == 0


def test_without_omikuji_the_ranker_is_skipped_with_a_warning(lexical_model, tiny_task, tmp_path, monkeypatch, caplog):
    data, _ = tiny_task
    model, channel = lexical_model
    model.save_pretrained(tmp_path / "m")
    monkeypatch.setattr(lc, "omikuji", None)
    with caplog.at_level(logging.WARNING):
        loaded = DEXMLModel.from_pretrained(tmp_path / "m")
    assert "needs the omikuji package" in caplog.text
    assert loaded.lexical_channel.ranker is None
    texts = data.test.texts[:8]
    vectors = model.encode_queries(texts)
    scores, ids = model.search(vectors, 100)
    want = channel.candidates(texts, scores, ids, 0.0, 1.0).top_k(0.0, channel.settings["text_weight"], 5)[1]
    np.testing.assert_array_equal(loaded.predict(texts, k=5).label_ids, want)
    loaded.save_pretrained(tmp_path / "again")  # the ranker's files ride along even where omikuji is missing
    monkeypatch.setattr(lc, "omikuji", __import__("omikuji"))
    np.testing.assert_array_equal(DEXMLModel.from_pretrained(tmp_path / "again").predict(texts, k=5).label_ids, model.predict(texts, k=5).label_ids)


def test_training_script_flag_reports_fused_and_dense_metrics(tiny_task, tiny_encoder_dir, tmp_path, capsys):
    _, task_dir = tiny_task
    out = tmp_path / "out"
    proc = run_script(contract_args(task_dir, tiny_encoder_dir, str(out), epochs="1") + ["--lexical_channel", "omikuji", "--lexical_tune_queries", "100"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.load(open(out / "eval_results.json"))
    assert results["lexical_fit_runtime"] > 0
    assert results["lexical_ranker_weight_on_edge"] in (0, 1) and results["lexical_text_weight_on_edge"] in (0, 1)
    assert results["test_P@1"] > results["test_dense_P@1"]  # one epoch of a random tiny encoder: the words win
    model = DEXMLModel.from_pretrained(out)
    assert model.lexical_channel is not None and model.config.lexical_channel["ranker_weight"] == model.lexical_channel.settings["ranker_weight"]
    from hf_xmc.training.recipes import dexml
    from hf_xmc.training.script_utils import run_script as run_main

    capsys.readouterr()
    status = run_main(dexml.main, contract_args(task_dir, tiny_encoder_dir, str(tmp_path / "bad")) + ["--lexical_channel", "bm25"], prog="train_dexml.py")
    assert status == 2 and "--lexical_channel takes 'none' or 'omikuji'" in capsys.readouterr().err


def test_flag_refuses_a_missing_library_before_training(tmp_path, monkeypatch):
    import importlib.util

    from hf_xmc.training import XMCTrainingArguments

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "omikuji" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"--lexical_channel omikuji needs omikuji: pip install 'hf_xmc\[lexical\]'"):
        XMCTrainingArguments(output_dir=str(tmp_path), lexical_channel="omikuji")
