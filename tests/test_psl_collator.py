"""UniDEC's pick-some-labels pool: sampled positives first, then hard negatives, then the batch's other positives,
up to the cap; targets from the full ground truth so false negatives are masked."""

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from transformers import AutoTokenizer

from hf_xmc.training import PSLDataCollator, XMCTrainer, XMCTrainingArguments


def toy(num_labels=12):
    # 4 queries; query 3 is a head query with 6 labels, label 0 is shared by queries 0 and 1
    rows = [[0, 1], [0, 2], [3], [4, 5, 6, 7, 8, 9]]
    targets = sp.csr_matrix((np.ones(sum(map(len, rows))), (np.repeat(np.arange(4), [len(r) for r in rows]), np.concatenate(rows))), shape=(4, num_labels))
    return targets, rows


@pytest.fixture
def tok(tiny_encoder_dir):
    return AutoTokenizer.from_pretrained(tiny_encoder_dir)


def collator(tok, targets, **kwargs):
    n, num_labels = targets.shape
    return PSLDataCollator(tok, [f"query {i}" for i in range(n)], targets, [f"label {j}" for j in range(num_labels)], 8, 8, **kwargs)


def test_positives_are_drawn_with_replacement(tok):
    targets, rows = toy()
    c = collator(tok, targets, num_positives=4)
    drawn = c.sample_positives(np.arange(4), np.random.default_rng(0))
    assert [len(d) for d in drawn] == [4, 4, 4, 4]  # query 2 has one label: drawn four times
    assert drawn[2].tolist() == [3, 3, 3, 3]
    for d, r in zip(drawn, rows):
        assert set(d.tolist()) <= set(r)


def test_uncapped_pool_is_every_batch_positive_plus_negatives_with_full_targets(tok):
    targets, rows = toy()
    c = collator(tok, targets, num_positives=1, num_negatives=2)
    c.set_shortlist(np.array([[10, 11, 3], [10, 11, -1], [11, 0, -1], [10, 11, -1]]))
    batch = c([{"index": i} for i in range(4)])
    pool = batch["label_ids"].tolist()
    assert pool == sorted(set(pool))
    assert set(pool) == set(range(12))  # all batch positives (0-9) and the mined negatives 10, 11
    np.testing.assert_array_equal(batch["targets"].numpy(), targets.toarray()[:, pool] > 0)
    # label 0 was a hard negative of query 2 and is a positive of queries 0 and 1: a positive there, never a negative
    assert batch["targets"][0, pool.index(0)] and batch["targets"][1, pool.index(0)] and not batch["targets"][2, pool.index(0)]
    # positive_index points at a positive of each query
    assert batch["targets"][torch.arange(4), batch["positive_index"]].all()


def test_cap_keeps_sampled_positives_before_negatives_and_batch_positives(tok):
    targets, rows = toy()
    c = collator(tok, targets, num_positives=1, num_negatives=2, max_label_pool=4)
    c.set_shortlist(np.array([[10, 11, -1]] * 4))
    for seed in range(5):
        c.seed = seed
        rows_ = np.arange(4)
        rng = c.batch_rng(rows_)
        sampled = c.sample_positives(rows_, rng)
        batch = c([{"index": i} for i in range(4)])
        pool = set(batch["label_ids"].tolist())
        positives = {int(s[0]) for s in sampled}
        assert positives <= pool and len(pool) == 4
        assert pool - positives <= {10, 11}  # a slot left after the draws goes to a hard negative, not a batch positive


def test_cap_fills_with_hard_negatives_then_the_most_frequent_batch_positives(tok):
    targets, rows = toy()
    c = collator(tok, targets, num_positives=1, num_negatives=1, max_label_pool=7)
    c.set_shortlist(np.array([[10, -1], [10, -1], [10, -1], [11, -1]]))
    batch = c([{"index": i} for i in range(4)])
    pool = batch["label_ids"].tolist()
    assert len(pool) == 7 and {10, 11} <= set(pool)
    # every query keeps at least one of its positives in the pool
    assert batch["targets"].any(dim=1).all()
    # label 0 (in two queries' label lists) wins a fill slot before any single-query label of the head query
    assert 0 in pool


def test_cap_of_zero_means_no_cap_and_negative_is_refused(tok):
    targets, _ = toy()
    with pytest.raises(ValueError, match="max_label_pool"):
        collator(tok, targets, max_label_pool=-1)
    with pytest.raises(ValueError, match="max_label_pool"):
        XMCTrainingArguments(output_dir="/tmp/unused", label_pool="psl", max_label_pool=-3)


def test_trainer_builds_a_psl_collator(tiny_encoder_dir, tiny_task, tmp_path):
    from hf_xmc.models import UniDECModel

    data = tiny_task[0]
    model = UniDECModel.from_encoder_pretrained(tiny_encoder_dir, label_space_size=len(data.label_texts), projection_dim=16)
    args = XMCTrainingArguments(output_dir=str(tmp_path), label_pool="psl", max_label_pool=9, num_positives=3, save_strategy="no")
    trainer = XMCTrainer(model=model, args=args, train_dataset=data.train, label_texts=data.label_texts)
    assert isinstance(trainer.data_collator, PSLDataCollator) and trainer.data_collator.max_label_pool == 9
    batch = trainer.data_collator([{"index": i} for i in range(32)])
    assert len(batch["label_ids"]) == 9
