"""Balanced 2-means tree and NGAME cluster batching (sampler, schedule, replicas, resume, memory bank)."""

import io

import numpy as np
import pytest
import torch

from hf_xmc.training.clustering import balanced_2means_tree, clusters_from_assignment, num_tree_levels
from hf_xmc.training.samplers import ClusterBatchSampler, EmbeddingMemoryBank


def blobs(num_blobs: int = 8, per_blob: int = 64, dim: int = 32, spread: float = 0.1, seed: int = 0):
    """Well-separated gaussian blobs (shuffled rows) and the blob id of every row."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((num_blobs, dim))
    labels = np.repeat(np.arange(num_blobs), per_blob)
    x = centers[labels] + spread * rng.standard_normal((labels.size, dim)) / np.sqrt(dim) * np.linalg.norm(centers, axis=1).mean()
    perm = rng.permutation(labels.size)
    return x[perm].astype(np.float32), labels[perm]


# --------------------------------------------------------------------------- clustering


def test_balanced_at_every_level_and_ids():
    x = np.random.default_rng(1).standard_normal((1003, 16)).astype(np.float32)
    assign = balanced_2means_tree(x, 100, seed=0)  # rounded up to 128 leaves
    assert assign.dtype == np.int64 and assign.shape == (1003,)
    assert set(np.unique(assign)) == set(range(128))
    for level in range(8):  # the parent of leaf c at level l is c >> (7 - l)
        counts = np.bincount(assign >> (7 - level), minlength=2**level)
        assert counts.max() - counts.min() <= 1, (level, counts.min(), counts.max())


def test_cluster_count_capped_and_trivial_cases():
    x = np.random.default_rng(2).standard_normal((5, 4)).astype(np.float32)
    assign = balanced_2means_tree(x, 64)
    assert num_tree_levels(5, 64) == 2 and sorted(np.bincount(assign)) == [1, 1, 1, 2]
    assert (balanced_2means_tree(x, 1) == 0).all()
    assert balanced_2means_tree(x[:1], 8).tolist() == [0]


def test_deterministic_and_seed_dependent_and_input_untouched():
    x = torch.randn(600, 24, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    before = x.clone()
    a = balanced_2means_tree(x, 32, seed=7)
    assert np.array_equal(a, balanced_2means_tree(x, 32, seed=7))
    assert np.array_equal(a, balanced_2means_tree(x.numpy().astype(np.float32), 32, seed=7))
    assert not np.array_equal(a, balanced_2means_tree(x, 32, seed=8))
    assert torch.equal(x, before)


@pytest.mark.parametrize("gram_threshold", [0, 10**6])  # iterations on features vs on Gram matrices
def test_planted_blobs_are_recovered(gram_threshold):
    x, labels = blobs()
    assign = balanced_2means_tree(x, 8, seed=0, gram_threshold=gram_threshold)
    for members in clusters_from_assignment(assign):
        assert len(members) == 64
        assert len(set(labels[members])) == 1  # each cluster is exactly one blob


def test_clusters_are_tighter_than_a_random_balanced_partition():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2048, 16)).astype(np.float32)
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)

    def cohesion(assign):
        sums = np.zeros((assign.max() + 1, 16))
        np.add.at(sums, assign, xn)
        return np.linalg.norm(sums, axis=1).sum() / len(x)  # mean cosine to the (normalised) centroid

    assign = balanced_2means_tree(x, 64, seed=0)
    assert cohesion(assign) > 1.5 * cohesion(rng.permutation(assign))


def test_clusters_from_assignment():
    groups = clusters_from_assignment(np.array([2, 0, 2, 1, 0]))
    assert [g.tolist() for g in groups] == [[1, 4], [3], [0, 2]]


# --------------------------------------------------------------------------- sampler


def test_random_batches_before_clustering_cover_each_index_once():
    s = ClusterBatchSampler(103, 10, seed=5)
    batches = list(s)
    assert len(batches) == len(s) == 11 and [len(b) for b in batches] == [10] * 10 + [3]
    assert sorted(i for b in batches for i in b) == list(range(103))
    s.set_epoch(1)
    assert list(s) != batches  # reshuffled every epoch
    dl = ClusterBatchSampler(103, 10, drop_last=True)
    assert len(dl) == 10 and all(len(b) == 10 for b in dl)


def test_batches_follow_clusters_after_update():
    x, labels = blobs(num_blobs=8, per_blob=16, dim=16)
    s = ClusterBatchSampler(128, 16, init_cluster_size=8, curriculum_epochs=(1,), refresh_interval=1, seed=0)
    assert any(len(set(labels[b])) > 1 for b in s)  # epoch 0: random batches mix blobs
    s.set_epoch(1)
    assert s.needs_refresh() and s.cluster_size() == 16 and s.num_clusters() == 8
    s.update_clusters(x)
    batches = list(s)
    assert sorted(i for b in batches for i in b) == list(range(128))
    assert all(len(set(labels[b])) == 1 for b in batches)  # each batch is one blob
    assert not s.needs_refresh(1)


def test_schedule_curriculum_and_refresh():
    def simulate(sampler, epochs):
        """Epochs at which a training loop that follows needs_refresh re-clusters."""
        done = []
        for e in range(epochs):
            if sampler.needs_refresh(e):
                sampler.set_assignment(np.zeros(sampler.num_samples, dtype=np.int64), epoch=e)
                done.append(e)
        return done

    s = ClusterBatchSampler(294_805, 1600)  # NGAME LF-AmazonTitles-131K
    assert s.needs_refresh(12)  # never clustered yet
    assert simulate(s, 31) == [10, 15, 20, 25, 30]
    assert [s.cluster_size(e) for e in (0, 9, 10, 24, 25, 50, 199, 200, 299)] == [4, 4, 8, 8, 16, 32, 512, 1024, 1024]
    assert s.num_clusters(10) == 2**16 and s.num_clusters(25) == 2**15 and s.num_clusters(200) == 2**9
    assert not s.needs_refresh(30) and not s.needs_refresh(31) and s.needs_refresh(35)
    # a cluster-size change forces a refresh off the periodic grid
    assert simulate(ClusterBatchSampler(100, 10, curriculum_epochs=(3, 7), refresh_interval=5), 10) == [3, 7, 8]
    assert not any(ClusterBatchSampler(100, 10, curriculum_epochs=()).needs_refresh(e) for e in range(50))


def test_replicas_share_global_batches():
    x, _ = blobs(num_blobs=4, per_blob=25, dim=8)
    assign = balanced_2means_tree(x, 16)
    ranks = [ClusterBatchSampler(100, 8, num_replicas=2, rank=r, seed=1) for r in range(2)]
    single = ClusterBatchSampler(100, 16, seed=1)
    for s in ranks + [single]:
        s.set_assignment(assign, epoch=0)
    b0, b1 = list(ranks[0]), list(ranks[1])
    assert len(b0) == len(b1) == len(ranks[0]) == 7 and all(len(b) == 8 for b in b0 + b1)
    ref = list(single)
    for g in range(6):  # full global batches: the two slices are disjoint and make up the global batch
        assert not set(b0[g]) & set(b1[g]) and b0[g] + b1[g] == ref[g]
    last = b0[6] + b1[6]  # last global batch: 4 real points, padded by wrapping around to the epoch's start
    assert last[:4] == ref[6] and last[4:] == ref[0][:12]
    assert set(i for b in b0 + b1 for i in b) == set(range(100))
    dl = [ClusterBatchSampler(100, 8, num_replicas=2, rank=r, drop_last=True) for r in range(2)]
    assert len(list(dl[0])) == len(list(dl[1])) == len(dl[0]) == 6


def test_state_dict_round_trip_reproduces_batches():
    x, _ = blobs(num_blobs=4, per_blob=32, dim=8)
    s = ClusterBatchSampler(128, 10, init_cluster_size=2, curriculum_epochs=(2,), seed=3)
    s.set_epoch(2)
    s.update_clusters(torch.from_numpy(x))
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    r = ClusterBatchSampler(128, 10, init_cluster_size=2, curriculum_epochs=(2,), seed=0)
    r.load_state_dict(torch.load(buf, weights_only=True))
    assert r.epoch == 2 and r.seed == 3 and not r.needs_refresh()
    assert list(r) == list(s)
    with pytest.raises(ValueError):
        ClusterBatchSampler(64, 10).load_state_dict(s.state_dict())


def test_clustering_within_an_epoch_reorders_only_what_the_epoch_has_not_served():
    x, labels = blobs(num_blobs=8, per_blob=16, dim=16)
    s = ClusterBatchSampler(128, 16, init_cluster_size=16, curriculum_epochs=(), refresh_interval=1, seed=2, start_epoch=0.25)
    plain = list(ClusterBatchSampler(128, 16, seed=2))  # the same epoch never clustered
    assert s.first_clustering == 0.25 and not s.needs_refresh(0)
    assert not s.clustering_due_within(0.2) and s.clustering_due_within(0.25)
    batches = iter(s)
    head = [next(batches) for _ in range(3)]
    s.cluster_within_epoch(torch.from_numpy(x))
    rest = list(batches)
    assert head == plain[:3] and len(head + rest) == len(s) == 8
    assert sorted(i for b in head + rest for i in b) == list(range(128))  # every query once this epoch
    served = set(i for b in head for i in b)
    assert set(i for b in rest for i in b) == set(range(128)) - served
    # what is left comes cluster by cluster (each cluster's unserved members contiguous): here clusters are the blobs
    blob_runs = labels[np.concatenate(rest)]
    assert np.count_nonzero(blob_runs[1:] != blob_runs[:-1]) == len(set(blob_runs.tolist())) - 1
    assert s.split_batch == 3 and not s.clustering_due_within(0.5)  # once
    # the epoch boundary after the split re-clusters (every refresh_interval from epoch 1); a resumed run rebuilds the order
    assert s.needs_refresh(1)
    r = ClusterBatchSampler(128, 16, init_cluster_size=16, curriculum_epochs=(), seed=0, start_epoch=0.25)
    r.load_state_dict(s.state_dict())
    assert list(r) == head + rest
    with pytest.raises(ValueError, match="start_epoch"):
        ClusterBatchSampler(128, 16, mode="one_per_batch", start_epoch=0.5)
    with pytest.raises(RuntimeError, match="first clustering"):
        s.cluster_within_epoch(torch.from_numpy(x))


def test_memory_bank_update_state_and_auto_refresh():
    bank = EmbeddingMemoryBank(6, 3)
    bank.update(torch.tensor([4, 1]), torch.tensor([[1.0, 2, 3], [4, 5, 6]], requires_grad=True))
    assert bank.filled.tolist() == [False, True, False, False, True, False] and bank.num_filled == 2
    assert bank.embeddings[1].tolist() == [4, 5, 6] and not bank.embeddings.requires_grad
    with pytest.raises(ValueError):
        bank.update([0], torch.zeros(1, 4))
    half = EmbeddingMemoryBank(6, 3, dtype="float16")
    half.load_state_dict(bank.state_dict())
    assert half.embeddings.dtype == torch.float16 and torch.equal(half.embeddings.float(), bank.embeddings)
    assert torch.equal(half.filled, bank.filled)

    x, labels = blobs(num_blobs=4, per_blob=8, dim=8)
    mb = EmbeddingMemoryBank(32, 8)
    s = ClusterBatchSampler(32, 8, init_cluster_size=4, curriculum_epochs=(1,), seed=0, memory_bank=mb)
    for b in s:  # epoch 0: the training loop writes the embeddings of its batches
        mb.update(b, torch.from_numpy(x[b]))
    assert mb.num_filled == 32 and s.assignment is None
    s.set_epoch(1)
    batches = list(s)  # re-clusters from the bank at iter time
    assert s.clustered_epoch == 1 and all(len(set(labels[b])) == 1 for b in batches)


def test_feature_and_gram_iterations_agree():
    # same algorithm, two code paths: incremental centroid sums on features vs exact sums via Gram matrices
    x, _ = blobs(num_blobs=16, per_blob=32, dim=16, spread=0.8, seed=5)
    a = balanced_2means_tree(x, 64, seed=2, gram_threshold=0)
    assert np.array_equal(a, balanced_2means_tree(x, 64, seed=2, gram_threshold=10**6))


# --------------------------------------------------------------------------- one cluster per batch (UniDEC)


def test_one_per_batch_each_batch_is_one_leaf_and_epochs_cover_every_query():
    x, labels = blobs(num_blobs=8, per_blob=25, dim=16)  # 200 queries, batch 32: 2^ceil(log2(6.25)) = 8 leaves of 25
    s = ClusterBatchSampler(200, 32, curriculum_epochs=(1,), refresh_interval=1, seed=0, mode="one_per_batch")
    assert len(s) == s.num_leaves() == 8 and s.cluster_size() == 32
    before = list(s)  # epoch 0: random leaves, already leaf-sized, so the Trainer's step count holds
    assert len(before) == 8 and sorted(len(b) for b in before) == [25] * 8
    assert sorted(i for b in before for i in b) == list(range(200)) and any(len(set(labels[b])) > 1 for b in before)
    s.set_epoch(1)
    assert s.needs_refresh()
    assign = s.update_clusters(x)
    batches = list(s)
    assert len(batches) == len(s) == 8
    assert sorted(i for b in batches for i in b) == list(range(200))  # every query once per epoch
    members = {c: set(np.flatnonzero(assign == c).tolist()) for c in range(assign.max() + 1)}
    for b in batches:  # every batch is exactly one cluster's members
        assert set(b) == members[int(assign[b[0]])] and len(b) == len(set(b))
        assert len(set(labels[b])) == 1  # here a leaf is one blob
    assert not s.needs_refresh(1) and s.needs_refresh(2)
    s.set_epoch(2)  # same assignment, next epoch: the leaves come in another order, members reshuffled
    again = list(s)
    assert again != batches and sorted(map(sorted, again)) == sorted(map(sorted, batches))


def test_one_per_batch_leaves_never_exceed_the_batch_and_differ_by_one():
    x = np.random.default_rng(3).standard_normal((1003, 8)).astype(np.float32)
    for batch in (17, 64, 125, 2000):
        s = ClusterBatchSampler(1003, batch, curriculum_epochs=(0,), seed=1, mode="one_per_batch")
        s.update_clusters(x)
        sizes = [len(b) for b in s]
        assert len(sizes) == len(s) and sum(sizes) == 1003
        assert max(sizes) <= batch and max(sizes) - min(sizes) <= 1 and (max(sizes) > batch // 2 or len(sizes) == 1)
    # the paper's |Q_B| are N / 2^k: leaves equal the batch (LF-AmazonTitles-1.3M, UniDEC: 2,248,619 / 2048 = 1098)
    big = ClusterBatchSampler(2_248_619, 1098, mode="one_per_batch")
    assert big.num_leaves() == 2048


def test_one_per_batch_replicas_split_one_leaf():
    x, _ = blobs(num_blobs=4, per_blob=25, dim=8)  # 100 queries; global batch 2 x 16 = 32 -> 4 leaves of 25
    ranks = [ClusterBatchSampler(100, 16, num_replicas=2, rank=r, seed=2, mode="one_per_batch") for r in range(2)]
    single = ClusterBatchSampler(100, 32, seed=2, mode="one_per_batch")
    assign = balanced_2means_tree(x, 4)
    for s in ranks + [single]:
        s.set_assignment(assign, epoch=0)
    b0, b1 = list(ranks[0]), list(ranks[1])
    ref = list(single)
    assert len(b0) == len(b1) == len(ranks[0]) == len(ref) == 4
    for g, leaf in enumerate(ref):
        assert len(b0[g]) == len(b1[g]) == 13  # ceil(25 / 2): same batch size on every rank
        assert b0[g] + b1[g][:-1] == leaf and b1[g][-1] == leaf[0]  # contiguous slices; the odd one repeats a member
    assert set(i for b in b0 + b1 for i in b) == set(range(100))


def test_one_per_batch_state_dict_round_trip():
    x, _ = blobs(num_blobs=4, per_blob=32, dim=8)
    s = ClusterBatchSampler(128, 40, curriculum_epochs=(2,), seed=3, mode="one_per_batch")
    s.set_epoch(2)
    s.update_clusters(torch.from_numpy(x))
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    r = ClusterBatchSampler(128, 40, curriculum_epochs=(2,), seed=0, mode="one_per_batch")
    r.load_state_dict(torch.load(buf, weights_only=True))
    assert r.epoch == 2 and not r.needs_refresh() and len(r) == len(s) == 4
    assert list(r) == list(s)
    with pytest.raises(ValueError, match="mode"):
        ClusterBatchSampler(128, 40, mode="leaves")
