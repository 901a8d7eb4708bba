"""SiameseXML training pieces: the two point-likelihood losses pinned to hand-computed values, Module I's label
sampler and batches, the label random walk M, Module II's label state and shortlists (and their store for a resumed run), Module IV's batches, the
shortlist merge, and the training script end to end."""

import dataclasses
import json
import logging
import math

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from scipy.stats import chisquare
from transformers import AutoModel

from hf_xmc.models.classifier_head import merge_label_scores, sum_label_scores
from hf_xmc.models.xmc_losses import point_likelihood_nll, siamese_classifier_loss, siamese_pair_loss
from hf_xmc.training.classifier_stage import ClassifierStageCollator
from hf_xmc.training.siamesexml import (
    ModuleIIStore,
    SiameseLabelCollator,
    build_label_state,
    label_correlation_matrix,
    label_sampling_probabilities,
    mine_classifier_shortlist,
    mine_label_neighbors,
)
from tests.models.test_modeling_siamesexml import make_siamesexml


def nll(v: float, positive: bool, c: float, d: float) -> float:
    return -math.log(c) + d * (1 - v) if positive else -math.log(1 - c * math.exp(d * (v - 1)))


def test_point_likelihood_spec_values():
    scores = torch.tensor([[1.0, 0.0]])
    out = point_likelihood_nll(scores, torch.tensor([[True, False]]), 0.75, 3.0)
    torch.testing.assert_close(out, torch.tensor([[0.2877, 0.03806]]), atol=1e-4, rtol=0)
    # p(+1, v) + p(-1, v) = 1: exp(-loss_pos) + exp(-loss_neg) = 1
    v = torch.linspace(-1, 1, 9).unsqueeze(0)
    pos = point_likelihood_nll(v, torch.ones_like(v, dtype=torch.bool), 0.75, 3.0)
    neg = point_likelihood_nll(v, torch.zeros_like(v, dtype=torch.bool), 0.75, 3.0)
    torch.testing.assert_close(torch.exp(-pos) + torch.exp(-neg), torch.ones_like(v))
    with pytest.raises(ValueError, match="0 < c < 1"):
        point_likelihood_nll(v, v > 0, 1.0, 3.0)


def test_siamese_pair_loss_by_hand():
    scores = torch.tensor([[0.9, 0.2, 0.5], [0.1, 0.8, 0.6]])
    targets = torch.tensor([[True, False, False], [False, True, True]])
    c, d = 0.9, 1.5
    row0 = nll(0.9, True, c, d) + nll(0.5, False, c, d)  # the hardest of the two negatives only
    row1 = nll(0.8, True, c, d) + nll(0.6, True, c, d) + nll(0.1, False, c, d)
    torch.testing.assert_close(siamese_pair_loss(scores, targets, c, d, 1), torch.tensor((row0 + row1) / 2))
    row0_k2 = row0 + nll(0.2, False, c, d)
    torch.testing.assert_close(siamese_pair_loss(scores, targets, c, d, 2), torch.tensor((row0_k2 + row1) / 2))


def test_hardest_negatives_never_pick_a_positive():
    # the positive (score -0.9) has by far the highest loss: it must not take a negative's place
    scores = torch.tensor([[-0.9, 0.1, 0.3, -0.5]])
    targets = torch.tensor([[True, False, False, False]])
    expected = nll(-0.9, True, 0.9, 1.5) + nll(0.3, False, 0.9, 1.5)
    torch.testing.assert_close(siamese_pair_loss(scores, targets, num_hard_negatives=1), torch.tensor(expected))


def decoupled_by_hand(v, negatives, s):
    """DEXML's decoupled softmax term of one positive of cosine ``v`` against ``negatives`` at scale ``s``."""
    return math.log(math.exp(s * v) + sum(math.exp(s * n) for n in negatives)) - s * v


def test_siamese_pair_softmax_loss_by_hand():
    # row 0: positives at columns 0 and 2 (a repeated label), negative at 1; row 1: positive 1, negatives 0 and 2
    scores = torch.tensor([[0.6, 0.2, 0.6], [0.1, 0.4, -0.3]])
    targets = torch.tensor([[True, False, True], [False, True, False]])
    s = 20.0

    def against(v, negatives):
        return decoupled_by_hand(v, negatives, s)

    # each positive against its row's negatives only: the repeated label is not its own negative
    expected = ((against(0.6, [0.2]) + against(0.6, [0.2])) / 2 + against(0.4, [0.1, -0.3])) / 2
    torch.testing.assert_close(siamese_pair_loss(scores, targets, loss="softmax", scale=s), torch.tensor(expected))
    with pytest.raises(ValueError, match="loss must be"):
        siamese_pair_loss(scores, targets, loss="bce")


def test_siamese_classifier_loss_by_hand():
    scores = torch.tensor([[0.9, 0.3, 0.7, 0.6, 0.0], [0.5, 0.95, 0.2, 0.0, 0.0]])
    targets = torch.tensor([[True, False, False, False, False], [True, False, False, False, False]])
    valid = torch.tensor([[True, True, True, True, False], [True, True, True, False, False]])
    c, d = 0.75, 3.0

    def term(v, positive):
        return nll(v, positive, c, d) / d

    # threshold: negatives whose scaled loss is under 0.05 (cos < 0.4388) are dropped
    assert term(0.43, False) < 0.05 < term(0.45, False)
    kept = term(0.9, True) + term(0.7, False) + term(0.6, False) + term(0.5, True) + term(0.95, False)
    torch.testing.assert_close(siamese_classifier_loss(scores, targets, valid, c, d, "threshold", 0.05), torch.tensor(kept / 2))
    # hardest (paper): kappa x |P_i| = 1 negative per point
    hardest = term(0.9, True) + term(0.7, False) + term(0.5, True) + term(0.95, False)
    torch.testing.assert_close(siamese_classifier_loss(scores, targets, valid, c, d, "hardest", hard_negative_factor=1), torch.tensor(hardest / 2))


def test_siamese_classifier_scaled_losses_by_hand():
    # two points: 2 positives + 2 negatives; 1 positive + 1 negative (one padded slot)
    scores = torch.tensor([[0.8, 0.1, 0.5, -0.2], [0.3, 0.6, 0.0, 0.0]])
    targets = torch.tensor([[True, True, False, False], [True, False, False, False]])
    valid = torch.tensor([[True, True, True, True], [True, True, False, False]])
    s = 10.0

    def bce(v, positive):
        return math.log1p(math.exp(-s * v)) if positive else math.log1p(math.exp(s * v))

    # bce over every filled slot, summed and divided by the batch size
    by_hand = (bce(0.8, True) + bce(0.1, True) + bce(0.5, False) + bce(-0.2, False) + bce(0.3, True) + bce(0.6, False)) / 2
    got = siamese_classifier_loss(scores, targets, valid, negatives="all", loss="bce", scale=s)
    torch.testing.assert_close(got, torch.tensor(by_hand))

    # decoupled softmax: each positive against the point's negatives only (not its other positive), mean over
    # positives, then points
    def against(v, negatives):
        return decoupled_by_hand(v, negatives, s)

    first = (against(0.8, [0.5, -0.2]) + against(0.1, [0.5, -0.2])) / 2
    second = against(0.3, [0.6])
    got = siamese_classifier_loss(scores, targets, valid, negatives="all", loss="softmax", scale=s)
    torch.testing.assert_close(got, torch.tensor((first + second) / 2))
    # hardest with kappa 1 keeps 2 negatives for the first point (2 positives) and 1 for the second: every negative
    # here, so the same loss; the threshold mask drops the first point's -0.2 (cos < 0.439) and keeps 0.5 and 0.6
    assert abs(siamese_classifier_loss(scores, targets, valid, negatives="hardest", hard_negative_factor=1, loss="softmax", scale=s).item() - (first + second) / 2) < 1e-5
    thresholded = (against(0.8, [0.5]) + against(0.1, [0.5])) / 2
    got = siamese_classifier_loss(scores, targets, valid, negatives="threshold", loss="softmax", scale=s)
    torch.testing.assert_close(got, torch.tensor((thresholded + second) / 2))
    with pytest.raises(ValueError, match="loss must be"):
        siamese_classifier_loss(scores, targets, valid, loss="triplet")

def heavy_tail_targets(num_labels=8, seed=0):
    rng = np.random.default_rng(seed)
    rows, cols = [], []
    point = 0
    for label in range(num_labels):
        for _ in range(2 ** label):  # label l has 2^l points
            rows.append(point)
            cols.append(label)
            if rng.random() < 0.3:
                rows.append(point)
                cols.append((label + 1) % num_labels)
            point += 1
    return sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(point, num_labels))


@pytest.mark.parametrize("power", [0.45, 0.0])
def test_label_sampler_follows_frequency_power(power):
    targets = heavy_tail_targets()
    collator = SiameseLabelCollator(None, [""] * targets.shape[0], targets, [f"l{i}" for i in range(8)], power=power, draws_per_epoch=100_000, seed=3)
    draws = collator.epoch_draws()
    freq = np.asarray((targets > 0).sum(axis=0)).ravel()
    expected = freq**power / (freq**power).sum()
    np.testing.assert_allclose(label_sampling_probabilities(targets, power), expected)
    observed = np.bincount(draws, minlength=8)
    assert chisquare(observed, expected * len(draws)).pvalue > 0.01
    assert not np.array_equal(draws[:50], (collator.set_epoch(1), collator.epoch_draws())[1][:50])  # new draws per epoch


def test_label_batch_marks_shared_positives(tiny_encoder_dir, tiny_task):
    from transformers import AutoTokenizer

    # labels 0 and 1 share their only point; label 2 has its own
    targets = sp.csr_matrix(np.array([[1, 1, 0], [0, 0, 1], [0, 0, 1]]))
    collator = SiameseLabelCollator(
        AutoTokenizer.from_pretrained(tiny_encoder_dir), ["a b", "c d", "e f"], targets, ["x", "y", "z"], max_seq_length=8, label_max_seq_length=8, draws_per_epoch=6
    )
    collator._draws, collator._draws_epoch = np.array([0, 1, 2, 0, 1, 2]), 0
    batch = collator([{"index": i} for i in range(6)])
    assert batch["label_ids"].tolist() == [0, 1, 2, 0, 1, 2]
    points = batch["indices"].tolist()
    assert points[0] == points[1] == 0 and points[2] in (1, 2)
    expected = torch.from_numpy(targets[points][:, [0, 1, 2, 0, 1, 2]].toarray() > 0)
    assert torch.equal(batch["targets"], expected)
    assert batch["targets"][0, 1] and batch["targets"][1, 0]  # the shared positive counts for both labels
    assert batch["centroid_input_ids"].shape[0] == 6


def test_label_batch_with_mined_neighbors(tiny_encoder_dir):
    from transformers import AutoTokenizer

    targets = sp.csr_matrix(np.eye(6))  # label l's only point is point l
    neighbors = np.array([[1, 2], [0, -1], [-1, -1], [4, 5], [3, -1], [3, 4]])
    collator = SiameseLabelCollator(
        AutoTokenizer.from_pretrained(tiny_encoder_dir), [f"p{i}" for i in range(6)], targets, [f"l{i}" for i in range(6)],
        max_seq_length=8, label_max_seq_length=8, draws_per_epoch=7, label_neighbors=neighbors, neighbors_per_draw=1,
    )
    collator._draws, collator._draws_epoch = np.array([0, 5, 2, 5, 3, 5, 4]), 0
    for _ in range(5):
        labels = collator([{"index": i} for i in range(7)])["label_ids"].tolist()
        assert len(labels) == 7 and labels[0::2] == [0, 2, 3, 4]  # the drawn labels every other slot
        assert labels[1] in (1, 2) and labels[5] in (4, 5)  # each followed by one of its neighbours
        assert labels[3] == 5  # label 2 has none: the slot keeps its own draw
    batch = collator([{"index": i} for i in range(7)])
    assert torch.equal(batch["targets"], torch.from_numpy(targets[batch["indices"].numpy()][:, batch["label_ids"].numpy()].toarray() > 0))
    with pytest.raises(ValueError, match="needs label_neighbors"):
        SiameseLabelCollator(None, ["a"] * 6, targets, ["x"] * 6, draws_per_epoch=2, neighbors_per_draw=1)


def test_mine_label_neighbors_are_the_nearest_labels_with_points(tiny_encoder_dir, tiny_task):
    data = tiny_task[0]
    model = make_siamesexml(tiny_encoder_dir, data)
    targets = sp.csr_matrix(data.train.targets).tolil()
    targets[:, 3] = 0  # label 3 loses its points: never a neighbour, no neighbours of its own
    targets = targets.tocsr()
    neighbors = mine_label_neighbors(model, data.label_texts, targets, k=4)
    assert neighbors.shape == (len(data.label_texts), 4) and (neighbors[3] == -1).all()
    vectors = model.encode_labels()
    with_points = np.flatnonzero(targets.getnnz(axis=0) > 0)
    for label in with_points[:10]:
        scores = vectors[with_points] @ vectors[label]
        others = [int(j) for j in with_points[torch.argsort(scores, descending=True, stable=True).numpy()] if j != label]
        assert label not in neighbors[label] and 3 not in neighbors[label]
        assert sorted(neighbors[label].tolist()) == sorted(others[:4]) or np.allclose(
            sorted((vectors[neighbors[label]] @ vectors[label]).tolist()), sorted((vectors[others[:4]] @ vectors[label]).tolist()), atol=1e-5
        )  # the 4 nearest (ties may swap equal-scored labels)


def test_label_correlation_walk():
    rng = np.random.default_rng(0)
    rows, cols = [], []
    for point in range(400):  # labels 0..39 co-occur in pairs; 40..44 alone; 45..49 have no point
        a = int(rng.integers(0, 40))
        rows += [point, point]
        cols += [a, (a + int(rng.integers(1, 4))) % 40]
    for point, label in enumerate(range(40, 45), start=400):
        rows.append(point)
        cols.append(label)
    targets = sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(405, 50))
    m = label_correlation_matrix(targets, walk_length=100, restart=0.8, top_k=10, seed=0)
    assert m.shape == (50, 50)
    nnz = np.diff(m.indptr)
    assert nnz.max() <= 11 and (m.diagonal() > 0).all()
    for label in range(40, 50):  # never co-occurring or no point: only M_ll, which normalises to 1
        assert nnz[label] == 1 and m[label, label] == pytest.approx(1.0)
    assert (nnz[:40] > 1).all()
    # symmetric normalisation of a symmetric count pattern keeps the weights in (0, 1]
    assert m.data.max() <= 1.0 + 1e-6 and m.data.min() > 0


def test_module2_label_state_and_shortlists(tiny_encoder_dir, tiny_task):
    data = tiny_task[0]
    model = make_siamesexml(tiny_encoder_dir, data)
    targets = sp.csr_matrix(data.train.targets)
    points = build_label_state(model, data.train.texts, targets, None)
    assert points.shape == (len(data.train), model.config.embedding_dim)
    torch.testing.assert_close(model.label_text_vectors, model.encode_labels())
    first = targets[:, 0].nonzero()[0]
    torch.testing.assert_close(model.label_centroids[0], torch.nn.functional.normalize(points[first].mean(0), dim=0))
    shortlist = mine_classifier_shortlist(model, points, targets, size=10, knn_neighbors=0)
    assert shortlist.shape == (len(data.train), 10) and shortlist.dtype == np.int32
    for r in range(len(data.train)):
        assert not set(shortlist[r].tolist()) & set(targets[r].indices.tolist())  # positives removed
    # neighbour votes alone (gamma = 1): every shortlisted label is a label of one of the 3 nearest training points
    voted = mine_classifier_shortlist(model, points, targets, size=10, knn_neighbors=3, knn_weight=1.0)
    nearest = (points @ points.T).topk(3, dim=1).indices.numpy()
    for r in range(0, len(data.train), 37):
        allowed = set(np.concatenate([targets[j].indices for j in nearest[r]]).tolist())
        assert set(voted[r][voted[r] >= 0].tolist()) <= allowed


def test_module2_store_resumes_mining_where_it_stopped(tiny_encoder_dir, tiny_task, tmp_path):
    # a run killed while mining keeps the label state, the point vectors and every flushed chunk; the resumed run
    # mines only the rest and ends with the uninterrupted run's shortlists
    data = tiny_task[0]
    targets = sp.csr_matrix(data.train.targets)
    n = len(data.train)
    model = make_siamesexml(tiny_encoder_dir, data, index_kind="ivf")
    points = build_label_state(model, data.train.texts, targets, None)
    reference = mine_classifier_shortlist(model, points, targets, size=10, knn_neighbors=3, chunk_size=64)
    settings = {"num_points": n, "train_shortlist_size": 10}
    store = ModuleIIStore(str(tmp_path / "module2"), settings)
    store.save_label_state(model, points)
    out, first = store.open_shortlist(n, 10)
    assert first == 0 and isinstance(out, np.memmap)

    def killed_after_two_chunks(done):
        store.mark_done(done)
        if done >= 128:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        mine_classifier_shortlist(model, points, targets, size=10, knn_neighbors=3, chunk_size=64, out=out, first=0, on_chunk=killed_after_two_chunks)
    del out

    resumed = make_siamesexml(tiny_encoder_dir, data, index_kind="ivf")  # a fresh process's model: the label state comes from the store
    resumed_store = ModuleIIStore(str(tmp_path / "module2"), settings)
    resumed_points = resumed_store.load_label_state(resumed)
    assert torch.equal(resumed_points, points)
    assert torch.equal(resumed.label_text_vectors, model.label_text_vectors)  # bit for bit: the index fingerprint matches
    assert torch.equal(resumed.label_centroids, model.label_centroids)
    out, first = resumed_store.open_shortlist(n, 10)
    assert first == 128 and np.array_equal(out[:128], reference[:128])
    mined = []
    shortlist = resumed.shortlist
    resumed.shortlist = lambda queries, *a, **k: (mined.append(len(queries)), shortlist(queries, *a, **k))[1]
    result = mine_classifier_shortlist(resumed, resumed_points, targets, size=10, knn_neighbors=3, chunk_size=64, out=out, first=first, on_chunk=resumed_store.mark_done)
    assert sum(mined) == n - 128  # the flushed chunks were not mined again
    assert np.array_equal(result, reference)
    assert np.array_equal(np.load(tmp_path / "module2" / "shortlist.npy"), reference)
    # a reader process gets an in-memory copy; other settings (another shortlist size) read as no store
    reader, done = ModuleIIStore(str(tmp_path / "module2"), settings, writer=False).open_shortlist(n, 10)
    assert done == n and not isinstance(reader, np.memmap) and np.array_equal(reader, reference)
    assert ModuleIIStore(str(tmp_path / "module2"), {**settings, "train_shortlist_size": 20}).load_label_state(resumed) is None
    # a run that computed its label state afresh does not read shortlists left by an earlier one
    fresh, done = ModuleIIStore(str(tmp_path / "module2"), settings, writer=False).open_shortlist(n, 10, resume=False)
    assert done == 0 and (fresh == -1).all()


def test_module2_shortlists_leave_out_the_excluded_pairs(tiny_encoder_dir, tiny_task):
    # exclude each point's first shortlisted label (as --train_filter_file's "the point's own label" would): it is
    # gone, the rest moves up by one and the next label fills the last slot; the neighbour votes are unchanged
    data = tiny_task[0]
    targets = sp.csr_matrix(data.train.targets)
    model = make_siamesexml(tiny_encoder_dir, data)
    points = build_label_state(model, data.train.texts, targets, None)
    plain = mine_classifier_shortlist(model, points, targets, size=11, knn_neighbors=3)
    n = len(data.train)
    exclude = sp.csr_matrix((np.ones(n, dtype=bool), (np.arange(n), plain[:, 0])), shape=targets.shape)
    got = mine_classifier_shortlist(model, points, targets, size=10, knn_neighbors=3, exclude=exclude)
    np.testing.assert_array_equal(got, plain[:, 1:])
    with pytest.raises(ValueError, match="exclude has shape"):
        mine_classifier_shortlist(model, points, targets, size=10, knn_neighbors=3, exclude=exclude[:, :5])


def test_resume_with_another_seed_refuses_the_stored_shortlists(tiny_encoder_dir, tiny_task, tmp_path, capsys):
    # another --seed at the same --validation_size holds out other points: the stored shortlists' rows would be other
    # points' (and another --train_filter_file's negatives other ones); the resumed run is refused in one line, exit 2
    from hf_xmc.models.provenance import StaleDerivedPartError
    from hf_xmc.training.recipes import siamesexml as recipe
    from hf_xmc.training.script_utils import run_script

    data, directory = tiny_task
    out = tmp_path / "out"
    argv = [
        "--train_file", f"{directory}/trn.json.gz", "--test_file", f"{directory}/tst.json.gz", "--label_file", f"{directory}/lbl.json.gz",
        "--model_name_or_path", tiny_encoder_dir, "--output_dir", str(out), "--num_train_epochs", "0", "--classifier_max_steps", "1",
        "--max_seq_length", "16", "--save_strategy", "steps", "--save_steps", "1", "--disable_tqdm", "true", "--report_to", "none",
        "--validation_size", "40",
    ]
    recipe.main([*argv, "--seed", "1"])
    record = json.load(open(out / "module2" / "module2.json"))["fingerprint"]
    assert record["seed"] == 1 and record["train_filter"] is None and record["validation"]
    capsys.readouterr()
    assert run_script(recipe.main, [*argv, "--seed", "2", "--resume_from_checkpoint", "true"], prog="train_siamesexml.py") == 2
    lines = capsys.readouterr().err.strip().splitlines()  # (a model load's progress bars may come before it)
    err = lines[-1]
    assert [line for line in lines if "train_siamesexml.py" in line or "Traceback" in line] == [err]
    assert err.startswith("train_siamesexml.py: ") and "module2/shortlist.npy" in err
    assert "training shortlists" in err and "seed" in err and "refused" in err and "--resume_from_checkpoint" in err
    # the same seed with a training filter the shortlists were not mined without: refused for the filter alone
    filt = tmp_path / "filter_labels_train.txt"
    filt.write_text("0 1\n")
    with pytest.raises(StaleDerivedPartError, match=r"other train_filter than"):
        recipe.main([*argv, "--seed", "1", "--resume_from_checkpoint", "true", "--train_filter_file", str(filt)])
    assert json.load(open(out / "module2" / "module2.json"))["fingerprint"] == record  # nothing was mined over it


def test_module2_float16_store_halves_the_point_vectors(tiny_encoder_dir, tiny_task):
    # at scale the label store is float16 and Module II keeps the training-point vectors at that precision too: the
    # label state, the [z~ ; v] rows and the shortlists must match the float32 path up to float16 rounding
    data = tiny_task[0]
    targets = sp.csr_matrix(data.train.targets)
    full = make_siamesexml(tiny_encoder_dir, data)
    half = make_siamesexml(tiny_encoder_dir, data, label_embeddings_dtype="float16")
    half.load_state_dict(full.state_dict())
    points32 = build_label_state(full, data.train.texts, targets, None)
    points16 = build_label_state(half, data.train.texts, targets, None)
    assert points32.dtype == torch.float32 and points16.dtype == torch.float16
    torch.testing.assert_close(points16.float(), points32, atol=2e-3, rtol=0)
    torch.testing.assert_close(half.label_centroids, full.label_centroids, atol=2e-3, rtol=0)
    rows = half.label_search_vectors()
    assert rows.dtype == torch.float16 and rows.shape == (2 * len(data.label_texts), half.config.embedding_dim)
    torch.testing.assert_close(rows.float(), torch.cat([half.label_text_vectors, half.label_centroids]), atol=1e-3, rtol=0)
    short32 = mine_classifier_shortlist(full, points32, targets, size=10, knn_neighbors=3)
    short16 = mine_classifier_shortlist(half, points16, targets, size=10, knn_neighbors=3)
    overlap = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(short32.tolist(), short16.tolist())])
    assert overlap > 0.95
    # Module IV reads float32 rows of the float16 vectors
    collator = ClassifierStageCollator(targets, short16, query_vectors=points16, seed=0)
    batch = collator([{"index": 0}, {"index": 5}])
    assert batch["query_vectors"].dtype == torch.float32
    torch.testing.assert_close(batch["query_vectors"], points16[[0, 5]].float())


def test_classifier_stage_collator():
    targets = sp.csr_matrix(np.array([[1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 0, 0]]))
    shortlist = np.array([[3, 4, -1], [0, 5, 2]], dtype=np.int32)
    vectors = torch.randn(2, 4)
    collator = ClassifierStageCollator(targets, shortlist, query_vectors=vectors, max_positives=2, seed=0)
    batch = collator([{"index": 0}, {"index": 1}])
    ids, pos = batch["candidate_ids"], batch["candidate_targets"]
    assert ids.shape == (2, 4)
    assert set(ids[0, :2].tolist()) <= {0, 1, 2} and pos[0, :2].all() and ids[0, 2:].tolist() == [3, 4]
    assert ids[1].tolist() == [3, 0, 5, 2] and pos[1].tolist() == [True, False, False, False]
    torch.testing.assert_close(batch["query_vectors"], vectors)
    with pytest.raises(ValueError, match="one row per training point"):
        ClassifierStageCollator(targets, shortlist[:1], query_vectors=vectors)


def test_merge_label_scores():
    # query 0: label 2 from both searches (0.5 + 0.25), label 1 from one; query 1: nothing
    ids, scores = merge_label_scores(np.array([0, 0, 0]), np.array([2, 1, 2]), np.array([0.5, 0.6, 0.25]), 2, 5, 3)
    assert ids.tolist() == [[2, 1, -1], [-1, -1, -1]]
    np.testing.assert_allclose(scores[0, :2], [0.75, 0.6])
    assert np.isneginf(scores[0, 2]) and np.isneginf(scores[1]).all()


def test_sum_label_scores_sums_repeated_pairs_in_query_label_order():
    queries, labels, sums = sum_label_scores(np.array([1, 0, 1, 0]), np.array([3, 2, 3, 4]), np.array([0.5, 1.0, 0.25, 2.0]), 5)
    assert queries.tolist() == [0, 0, 1] and labels.tolist() == [2, 4, 3]
    np.testing.assert_allclose(sums, [1.0, 2.0, 0.75])


def test_training_script_end_to_end_and_a_resumed_run(tiny_encoder_dir, tiny_task, tmp_path, monkeypatch, caplog):
    # the bag-of-embeddings encoder through the recipe (the transformer encoder: test_reliability's kill/resume run)
    from hf_xmc.models.label_index import LabelIndex
    from hf_xmc.training.recipes import siamesexml as recipe

    data, directory = tiny_task
    out = tmp_path / "out"
    argv = [
        "--train_file", f"{directory}/trn.json.gz", "--test_file", f"{directory}/tst.json.gz", "--label_file", f"{directory}/lbl.json.gz",
        "--model_name_or_path", tiny_encoder_dir, "--output_dir", str(out), "--encoder_type", "boe", "--index_kind", "ivf",
        "--num_train_epochs", "1", "--classifier_epochs", "2", "--max_seq_length", "16", "--save_strategy", "epoch",
        "--disable_tqdm", "true", "--report_to", "none", "--seed", "1", "--label_negatives_per_draw", "1",
    ]
    mined = []
    real_mine = recipe.mine_label_neighbors
    monkeypatch.setattr(recipe, "mine_label_neighbors", lambda *a, **k: mined.append(1) or real_mine(*a, **k))
    metrics = recipe.main(argv)
    assert mined == [1]  # Module I's batches carried mined label negatives
    saved = json.load(open(out / "eval_results.json"))
    for key in ("test_P@1", "test_P@5", "test_PSP@5", "test_R@100", "train_runtime", "test_samples_per_second"):
        assert key in saved and saved[key] == pytest.approx(metrics[key])
    model = AutoModel.from_pretrained(out)
    assert model.config.encoder_type == "boe" and bool(model.label_state_initialized)
    # --fusion_weight not given: tuned on the validation split the run held out for it, and saved
    assert saved["tuned_fusion_weight"] in model.tunable_ranking_settings["fusion_weight"]
    assert model.config.fusion_weight == saved["tuned_fusion_weight"] and model.config.validation["queries"] > 0
    assert torch.count_nonzero(model.classifier.weight) > 0  # Module IV moved the refinement vectors
    assert (model.encoder.idf > 0).any() and model.encoder.idf[model.tokenizer.cls_token_id] == 0
    assert model.encoder.idf.min() < model.encoder.idf.max()  # set from the texts, not the initial ones
    pred = model.predict(data.test.texts[:5], k=5)
    assert (pred.label_ids >= 0).all()
    for name in ("label_index", "point_index"):  # Module II's two IVF indexes are kept with its store
        assert (out / "module2" / name / "label_index.faiss").is_file()

    # resumed: Module I finished, so its weights carry the IDF (no pass over the texts); Module II's indexes are read
    # back, not built; the run ends with the first one's model and metrics
    monkeypatch.setattr(recipe, "bag_of_embeddings_document_frequency", lambda *a, **k: pytest.fail("Module I's weights carry the IDF"))
    builds = []
    real_build = LabelIndex._build_faiss
    monkeypatch.setattr(LabelIndex, "_build_faiss", lambda self: builds.append(self.num_labels) or real_build(self))
    with caplog.at_level(logging.INFO):
        resumed = recipe.main(argv + ["--resume_from_checkpoint", "true"])
    assert caplog.text.count("the search index is read back, not built again") == 2  # [z~ ; v] and the points
    assert len(data.train) not in builds  # the neighbour index over the training points was not built again
    assert mined == [1]  # nor Module I's label neighbours (Module I finished)
    assert torch.equal(AutoModel.from_pretrained(out).encoder.idf, model.encoder.idf)
    for key in ("test_P@1", "test_PSP@5", "test_R@100"):
        assert resumed[key] == pytest.approx(metrics[key], abs=1e-6)


def test_max_steps_bound_module_one_and_classifier_max_steps_module_four(tmp_path):
    from hf_xmc.training.recipes.siamesexml import SiameseXMLTrainingArguments, _module_args

    args = SiameseXMLTrainingArguments(output_dir=str(tmp_path), max_steps=5, classifier_epochs=3, report_to="none")
    siamese, classifier = _module_args(args, "siamese"), _module_args(args, "classifier")
    assert siamese.max_steps == 5 and siamese.output_dir == str(tmp_path / "module1")
    assert classifier.max_steps == -1 and classifier.num_train_epochs == 3  # Module IV runs its epochs, not Module I's steps
    bounded = _module_args(dataclasses.replace(args, classifier_max_steps=7), "classifier")
    assert bounded.max_steps == 7


def test_fusion_weight_is_tuned_to_the_best_validation_ranking(tiny_encoder_dir, tiny_task):
    from hf_xmc.data import XMCDataset
    from hf_xmc.metrics import xmc_metrics
    from hf_xmc.training.evaluation import XMCEvaluator, tune_ranking_settings
    from tests.models.test_modeling_siamesexml import make_siamesexml, perturb

    data = tiny_task[0]
    model = make_siamesexml(tiny_encoder_dir, data)
    perturb(model)
    model.build_label_index()
    texts = data.test.texts[:30]
    # relevant: the classifiers' first label for one half of the queries, the shortlist similarity's for the other
    tops = {}
    for mode in ("classifier", "shortlist"):
        with model.using_search_mode(mode):
            tops[mode] = model.predict(texts, k=1).label_ids[:, 0]
    relevant = np.where(np.arange(30) < 15, tops["classifier"], tops["shortlist"])
    targets = sp.csr_matrix((np.ones(30, dtype=np.float32), (np.arange(30), relevant)), shape=(30, len(data.label_texts)))
    validation = XMCDataset(texts=list(texts), targets=targets, uids=[str(i) for i in range(30)])
    evaluator = XMCEvaluator(data.test, data.label_texts, data.label_uids, train_targets=data.train.targets).for_queries(validation, "eval")
    expected = {}  # each value's objective through predict, independently of the evaluator
    for value in model.tunable_ranking_settings["fusion_weight"]:
        model.config.fusion_weight = value
        m = xmc_metrics(model.predict(texts, k=5).label_ids, targets, evaluator.inv_propensity, ks=(1, 5), recall_ks=())
        expected[value] = m["P@1"] + m["PSP@5"]
    model.config.fusion_weight = 0.5
    chosen = tune_ranking_settings(model, evaluator)
    best = max(expected.values())
    assert chosen == {"fusion_weight": model.config.fusion_weight}
    assert expected[chosen["fusion_weight"]] == pytest.approx(best)
    if expected[0.5] < best - 1e-9:  # the value it had is kept only on a tie; otherwise the smallest best one
        assert chosen["fusion_weight"] == min(v for v, score in expected.items() if score >= best - 1e-9)
    assert tune_ranking_settings(model, evaluator, names=()) == {}

