"""``--train_filter_file``: pairs of the training points that are neither positives nor negatives (an LF dataset's
"a point is its own label"). They follow the points into the validation split, are removed from every ranking the run
tunes on (validation metrics, calibration, the fusion weights) and are never mined as hard negatives."""

import numpy as np
import pytest
import scipy.sparse as sp

from hf_xmc.data import XMCDataset, filter_predictions
from hf_xmc.models import DEXMLModel
from hf_xmc.training import XMCTrainingArguments
from hf_xmc.training.evaluation import XMCEvaluator
from hf_xmc.training.negatives import mine_hard_negatives
from hf_xmc.training.script_utils import XMCDataArguments, load_data


def _pairs(n: int, num_labels: int) -> sp.csr_matrix:
    rows = np.arange(n)
    return sp.csr_matrix((np.ones(n, dtype=bool), (rows, (rows * 7 + 3) % num_labels)), shape=(n, num_labels))


def test_select_carries_the_filter_rows_and_a_wrong_shape_is_refused():
    targets = sp.csr_matrix(np.eye(4, 6, dtype=np.float32))
    filt = _pairs(4, 6)
    data = XMCDataset(texts=list("abcd"), targets=targets, uids=list("abcd"), filter_matrix=filt)
    part = data.select([3, 1])
    assert part.filter_matrix.dtype == bool
    np.testing.assert_array_equal(part.filter_matrix.toarray(), filt.toarray()[[3, 1]])
    assert data.select([0]).select([0]).filter_matrix.toarray().tolist() == filt.toarray()[[0]].tolist()
    with pytest.raises(ValueError, match="filter_matrix has shape"):
        XMCDataset(texts=list("abcd"), targets=targets, uids=list("abcd"), filter_matrix=_pairs(4, 5))


def test_train_filter_file_follows_its_records_into_the_validation_split(tiny_task, tmp_path):
    data, task_dir = tiny_task
    n, num_labels = len(data.train), len(data.label_texts)
    pairs = _pairs(n, num_labels)
    path = tmp_path / "filter_labels_train.txt"
    path.write_text("".join(f"{r} {c}\n" for r, c in zip(*pairs.nonzero())))
    data_args = XMCDataArguments(train_file=f"{task_dir}/trn.json.gz", test_file=f"{task_dir}/tst.json.gz", label_file=f"{task_dir}/lbl.json.gz",
                                 train_filter_file=str(path), validation_size=25)
    training_args = XMCTrainingArguments(output_dir=str(tmp_path / "out"), seed=3)
    loaded = load_data(data_args, training_args)
    assert len(loaded.validation) == 25 and len(loaded.train) == n - 25
    for part in (loaded.train, loaded.validation):
        records = part.record_indices()
        np.testing.assert_array_equal(part.filter_matrix.toarray(), pairs.toarray()[records])
    # without the file nothing is filtered
    plain = load_data(XMCDataArguments(train_file=f"{task_dir}/trn.json.gz", test_file=f"{task_dir}/tst.json.gz",
                                       label_file=f"{task_dir}/lbl.json.gz", validation_size=25), training_args)
    assert plain.train.filter_matrix is None and plain.validation.filter_matrix is None


def test_the_repository_filter_file_beside_the_training_file_is_found(tiny_task, tmp_path):
    import shutil

    data, task_dir = tiny_task
    for name in ("trn.json.gz", "tst.json.gz", "lbl.json.gz"):
        shutil.copy(f"{task_dir}/{name}", tmp_path / name)
    pairs = _pairs(len(data.train), len(data.label_texts))
    (tmp_path / "filter_labels_train.txt").write_text("".join(f"{r} {c}\n" for r, c in zip(*pairs.nonzero())))
    files = dict(train_file=str(tmp_path / "trn.json.gz"), test_file=str(tmp_path / "tst.json.gz"), label_file=str(tmp_path / "lbl.json.gz"))
    found = load_data(XMCDataArguments(**files))
    np.testing.assert_array_equal(found.train.filter_matrix.toarray(), pairs.toarray())
    assert load_data(XMCDataArguments(**files, train_filter_file="none")).train.filter_matrix is None


@pytest.fixture(scope="module")
def indexed_model(tiny_encoder_dir, tiny_task):
    data, _ = tiny_task
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, max_seq_length=16)
    model.build_label_index(data.label_texts, data.label_uids, show_progress_bar=False)
    return model


def _ranked(model, texts, depth):
    scores, ids = model.search(model.query_search_vectors(texts, show_progress_bar=False), depth)
    return scores, ids


def test_mining_never_returns_an_excluded_pair(indexed_model, tiny_task):
    data, _ = tiny_task
    model = indexed_model
    texts, targets = data.train.texts[:40], sp.csr_matrix(data.train.targets[:40])
    plain = mine_hard_negatives(model, texts, targets, top_k=5, show_progress_bar=False)
    # exclude each query's hardest negative: it is gone, and the rest of the shortlist moves up by one
    exclude = sp.csr_matrix((np.ones(40, dtype=bool), (np.arange(40), plain[:, 0])), shape=targets.shape)
    got = mine_hard_negatives(model, texts, targets, top_k=5, show_progress_bar=False, exclude=exclude)
    scores, ids = _ranked(model, texts, 5 + 2 + int(np.diff(targets.indptr).max()))
    expected, _ = filter_predictions(ids, scores, targets + exclude.astype(np.float32), 5)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got[:, :4], plain[:, 1:])
    assert not (got == plain[:, :1]).any()
    with pytest.raises(ValueError, match="exclude has shape"):
        mine_hard_negatives(model, texts, targets, top_k=5, show_progress_bar=False, exclude=exclude[:, :3])


def _own_label_holdout(model, data, n=30):
    """Queries whose dense top-1 label is filtered (as if it were the query itself) and whose only positive is the
    dense second: P@1 is 0 when the filter is ignored, 100 when it is applied."""
    texts = data.test.texts[:n]
    scores, ids = _ranked(model, texts, 2)
    rows = np.arange(n)
    shape = (n, len(data.label_texts))
    targets = sp.csr_matrix((np.ones(n, dtype=np.float32), (rows, ids[:, 1])), shape=shape)
    filt = sp.csr_matrix((np.ones(n, dtype=bool), (rows, ids[:, 0])), shape=shape)
    return XMCDataset(texts=list(texts), targets=targets, uids=[str(i) for i in rows], filter_matrix=filt)


def test_validation_evaluator_removes_the_points_filter_pairs(indexed_model, tiny_task):
    data, _ = tiny_task
    holdout = _own_label_holdout(indexed_model, data)
    test = XMCEvaluator(data.test, data.label_texts, data.label_uids, train_targets=data.train.targets)
    filtered = test.for_queries(holdout, "eval")(indexed_model, show_progress_bar=False)
    assert filtered["eval_P@1"] == pytest.approx(100.0)
    unfiltered = test.for_queries(XMCDataset(texts=holdout.texts, targets=holdout.targets, uids=holdout.uids), "eval")(indexed_model, show_progress_bar=False)
    assert unfiltered["eval_P@1"] == pytest.approx(0.0)


def test_fusion_weights_are_tuned_without_the_filter_pairs(indexed_model, tiny_task):
    pytest.importorskip("omikuji")
    from hf_xmc.training.lexical import fit_lexical_channel, tune_fusion_weights

    data, _ = tiny_task
    holdout = _own_label_holdout(indexed_model, data)
    channel = fit_lexical_channel(indexed_model, data.train, ranker_weight=0.0, text_weight=0.0, seed=0)
    # the ranker and the text channel weighted 0: the objective is the dense ranking's P@1 + PSP@5; the one positive
    # is within the top 5 either way (PSP@5 100), first once the filtered label is gone (P@1 100), else second (P@1 0)
    tuned = tune_fusion_weights(indexed_model, channel, holdout, data.train.targets, (0.0,), (0.0,))
    assert tuned["dense"] == pytest.approx(200.0) and tuned["objective"] == pytest.approx(200.0)
    bare = XMCDataset(texts=holdout.texts, targets=holdout.targets, uids=holdout.uids)
    tuned = tune_fusion_weights(indexed_model, channel, bare, data.train.targets, (0.0,), (0.0,))
    assert tuned["dense"] == pytest.approx(100.0)


def test_siamesexml_module2_shortlists_never_hold_a_filter_pair(tiny_encoder_dir, tiny_task, tmp_path, monkeypatch):
    # Module IV trains on Module II's shortlist negatives: a filter pair there (an LF dataset's own label, rank 1)
    # would be a negative. The tiny task has 40 labels and the shortlist 100 slots, so every label that is neither
    # a positive nor a filter pair of the point is shortlisted, and a filter pair would be too if it were not removed.
    from hf_xmc.training.recipes import siamesexml as recipe

    data, task_dir = tiny_task
    n, num_labels = len(data.train), len(data.label_texts)
    targets = sp.csr_matrix(data.train.targets)
    pairs = []
    for r in range(n):
        candidates = [(r * 7 + 3 + 9 * j) % num_labels for j in range(6)]
        pairs += [(r, c) for c in [c for c in candidates if c not in set(targets[r].indices)][:3]]
    path = tmp_path / "filter_labels_train.txt"
    path.write_text("".join(f"{r} {c}\n" for r, c in pairs))
    seen = {}
    real_mine = recipe.mine

    def mine(model, d, args):
        seen["data"], seen["collator"] = d, real_mine(model, d, args)
        return seen["collator"]

    monkeypatch.setattr(recipe, "mine", mine)
    recipe.main([
        "--train_file", f"{task_dir}/trn.json.gz", "--test_file", f"{task_dir}/tst.json.gz", "--label_file", f"{task_dir}/lbl.json.gz",
        "--train_filter_file", str(path), "--model_name_or_path", tiny_encoder_dir, "--output_dir", str(tmp_path / "out"),
        "--num_train_epochs", "0", "--classifier_max_steps", "1", "--max_seq_length", "16", "--save_strategy", "no",
        "--disable_tqdm", "true", "--report_to", "none", "--seed", "1",
    ])
    train = seen["data"].train  # the points left after the validation split, with their filter rows
    shortlist, filt, positives = seen["collator"].shortlist, sp.csr_matrix(train.filter_matrix), sp.csr_matrix(train.targets)
    assert shortlist.shape[0] == len(train) and filt.nnz >= 2 * len(train)
    for r in range(len(train)):
        got = set(shortlist[r][shortlist[r] >= 0].tolist())
        assert not got & set(filt[r].indices.tolist())
        assert got == set(range(num_labels)) - set(positives[r].indices.tolist()) - set(filt[r].indices.tolist())
