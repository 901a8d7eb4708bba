"""The memory-bounded structures that replace dense N x L / B x L / B x pool x P_max code (issue: million-label scale).

Each streaming or sorted path is checked against the dense computation it replaced, on inputs small enough for the
dense one, with chunk sizes small enough that the bounded path really runs in several pieces.
"""

import json

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from hf_xmc.data import filter_predictions
from hf_xmc.models import DEXMLModel, PRIMEModel
from hf_xmc.models.encoder_utils import targets_from_positive_ids
from hf_xmc.training import (
    XMCEvaluator,
    XMCTrainer,
    XMCTrainingArguments,
    label_centroids,
    label_state,
    mine_hard_negatives,
    negatives,
)


def dense_targets(query_positive_ids: torch.Tensor, label_ids: torch.Tensor) -> torch.Tensor:
    """The (queries, pool, P_max) broadcast the sorted version replaced."""
    return (query_positive_ids.unsqueeze(1) == label_ids.view(1, -1, 1)).any(dim=2)


@pytest.mark.parametrize("duplicates", [False, True])
def test_targets_from_positive_ids_equals_the_broadcast(duplicates):
    gen = torch.Generator().manual_seed(0)
    label_ids = torch.randperm(200, generator=gen)[:60]
    if duplicates:  # a label sampled by two processes appears twice in a gathered pool
        label_ids = torch.cat([label_ids, label_ids[:7]])
    positives = torch.randint(0, 200, (9, 12), generator=gen)
    positives[positives % 5 == 0] = -1  # padding
    positives[3] = -1  # a query without positives
    expected = dense_targets(positives, label_ids)
    got = targets_from_positive_ids(positives, label_ids)
    assert got.dtype == torch.bool and got.shape == (9, label_ids.numel())
    assert expected.any() and torch.equal(got, expected)


def test_targets_from_positive_ids_empty_pool_and_width():
    assert targets_from_positive_ids(torch.full((3, 2), -1), torch.tensor([4, 5])).sum() == 0
    assert targets_from_positive_ids(torch.tensor([[1, 2]]), torch.zeros(0, dtype=torch.long)).shape == (1, 0)


def test_label_centroids_stream_in_bounded_pieces(monkeypatch):
    rng = np.random.default_rng(0)
    targets = sp.random(50, 30, density=0.2, random_state=1, format="csr", dtype=np.float32)
    targets.data[:] = 1.0
    queries = torch.from_numpy(rng.standard_normal((50, 8)).astype(np.float32))
    dense = F.normalize(torch.from_numpy(np.asarray(targets.T @ F.normalize(queries, dim=-1).numpy())), dim=-1)
    sums = torch.zeros(30, 8)
    label_state.label_centroid_sums(sums, queries, targets, max_pairs=3)  # many pieces, some rows alone
    torch.testing.assert_close(F.normalize(sums, dim=-1), dense)
    torch.testing.assert_close(label_centroids(queries, targets), dense)
    # float16 query vectors (SiameseXML's store at scale) are widened piece by piece, not copied whole
    torch.testing.assert_close(label_centroids(queries.half(), targets), dense, atol=2e-3, rtol=0)
    assert (dense.norm(dim=1) == 0).any() == (np.asarray(targets.sum(axis=0)).ravel() == 0).any()


def test_streamed_label_centroids_equal_the_one_pass_centroids(tiny_encoder_dir, tiny_task):
    data, _ = tiny_task
    model = PRIMEModel.from_encoder_pretrained(tiny_encoder_dir, label_space_size=len(data.label_texts))
    texts, targets = data.train.texts[:100], data.train.targets[:100]
    one_pass = label_centroids(model.encode_queries(texts, show_progress_bar=False), targets)
    streamed = label_state.streamed_label_centroids(model, texts, targets, batch_size=16, chunk_size=7, show_progress_bar=False)
    torch.testing.assert_close(streamed, one_pass, rtol=1e-5, atol=1e-6)


def _dense_mining(model, texts, targets, top_k):
    """The one-shot mining the chunked version replaced: every query searched top_k + max positives deep."""
    model.build_label_index(show_progress_bar=False)
    queries = model.query_search_vectors(texts, show_progress_bar=False)
    max_pos = int(np.diff(targets.indptr).max())
    scores, ids = model.search(queries, top_k + max_pos)
    return filter_predictions(ids, scores, targets, top_k)[0]


def test_chunked_mining_equals_one_shot_mining(tiny_encoder_dir, tiny_task, monkeypatch):
    data, _ = tiny_task
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir)
    model.set_labels(data.label_texts)
    texts = data.train.texts[:60]
    targets = sp.csr_matrix(data.train.targets[:60]).astype(np.float32)
    # two head queries with many positives: they are searched in groups of their own
    targets = targets.tolil()
    targets[5, :30] = 1.0
    targets[17, 10:40] = 1.0
    targets = targets.tocsr()
    expected = _dense_mining(model, texts, targets, top_k=6)
    monkeypatch.setattr(negatives, "_SEARCH_BUDGET", 40)  # a handful of rows per search
    got = mine_hard_negatives(model, texts, targets, top_k=6, chunk_size=11, show_progress_bar=False)
    assert got.dtype == np.int32 and got.shape == (60, 6)
    np.testing.assert_array_equal(got, expected)
    assert (got[17] >= 0).sum() == min(6, 40 - targets[17].nnz)  # the head query still gets its negatives
    for row in range(60):  # no known positive in the shortlist
        assert not set(got[row][got[row] >= 0]) & set(targets[row].indices)


def test_depth_groups_cover_every_row_once_within_budget(monkeypatch):
    monkeypatch.setattr(negatives, "_SEARCH_BUDGET", 50)
    positives = np.array([1, 30, 2, 0, 12, 45, 3, 11, 5])
    groups = negatives._depth_groups(positives, top_k=5)
    np.testing.assert_array_equal(np.sort(np.concatenate(groups)), np.arange(len(positives)))
    for group in groups:
        depth = 5 + positives[group].max()
        assert len(group) == 1 or len(group) * depth <= 50


def test_evaluator_in_chunks_equals_one_chunk(tiny_encoder_dir, tiny_task):
    data, _ = tiny_task
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir)
    filt = sp.csr_matrix((np.ones(len(data.test)), (np.arange(len(data.test)), np.arange(len(data.test)) % len(data.label_texts))), shape=data.test.targets.shape)
    kwargs = dict(train_targets=data.train.targets, filter_matrix=filt)
    whole = XMCEvaluator(data.test, data.label_texts, **kwargs)(model, show_progress_bar=False)
    chunked_eval = XMCEvaluator(data.test, data.label_texts, chunk_size=13, **kwargs)
    chunked = chunked_eval(model, show_progress_bar=False)
    for key, value in whole.items():
        if "runtime" not in key and "per_second" not in key:
            assert chunked[key] == pytest.approx(value), key
    # the filtered pair (query i, label i mod L) never comes back
    rows = np.arange(len(data.test))
    assert not (chunked_eval.last_predictions == (rows % len(data.label_texts))[:, None]).any()


def test_prime_training_does_not_broadcast_the_centroid_bank(tiny_encoder_dir, tiny_task, tmp_path):
    data, _ = tiny_task
    model = PRIMEModel.from_encoder_pretrained(tiny_encoder_dir, label_space_size=len(data.label_texts))
    args = XMCTrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none")
    trainer = XMCTrainer(model=model, args=args, train_dataset=data.train, label_texts=data.label_texts)
    assert trainer.args.ddp_broadcast_buffers is False
    dexml = XMCTrainer(model=DEXMLModel.from_encoder_pretrained(tiny_encoder_dir), args=XMCTrainingArguments(output_dir=str(tmp_path)), train_dataset=data.train, label_texts=data.label_texts)
    assert dexml.args.ddp_broadcast_buffers is None  # models with nothing to gain keep transformers' default


def test_bench_scale_small_runs_every_stage(tmp_path):
    """The scale benchmark at 24K labels (one call: every train / reload worker is a fresh process, the fixed cost of
    this test; DEXML is left out for CI time: its hard-negative mining is UniDEC's, its model and flags are tested by
    the training and reliability tests): every variant completes every stage, reloads through remote code and ranks
    for real (the chunked paths of mining, centroids and evaluation are checked against one-shot results above). SiameseXML runs its
    bag-of-embeddings encoder (the transformer variant differs only in the encoder, covered by the model tests):
    Module II's label graph (two chunks of its 20,000 labels), label state and shortlists over every training point,
    Module IV and the fp16 ``[z~ ; v]`` store."""
    from benchmarks import bench_scale

    out = tmp_path / "scale.json"
    rows = bench_scale.main([
        "--methods", "prime,unidec,siamesexml:boe", "--num_labels", "24000", "--num_train", "1000",
        "--num_test", "200", "--steps", "2", "--batch_size", "32", "--data_dir", str(tmp_path / "task"), "--out", str(out),
    ])
    assert [(r["method"], r["variant"]) for r in rows] == [("prime", "default"), ("unidec", "default"), ("siamesexml", "boe")]
    for row in rows:
        assert row["completed"], row.get("error")
        stages = row["stages"]
        for stage in ("train:data_load", "train:train.steps", "train:evaluate.index_build", "train:save", "reload:reload", "reload:predict"):
            assert stages[stage]["seconds"] >= 0, (row["method"], stage)
        assert 0 < row["peak_rss_gib"] < 6 and row["saved_bytes"] > 20000 * 4 * 16  # the label vectors at least
        assert row["R@100"] > 0 and row["latency_ms"]["batch_1_ms"] > 0
        # --index_kind ivf --ivf_nprobe 16 (the defaults) reach the saved model through the recipe's flags
        meta = json.loads((tmp_path / "task" / "runs" / f"{row['method']}-{row['variant']}" / "label_index.json").read_text())
        assert (row["index_kind"], row["ivf_nprobe"], meta["kind"], meta["ivf_nprobe"]) == ("ivf", 16, "ivf", 16)
    by_name = {f"{r['method']}:{r['variant']}": r["stages"] for r in rows}
    assert "train:train.label_state" in by_name["prime:default"] and "train:train.clustering" in by_name["prime:default"]
    assert "train:train.hard_negative_mining" in by_name["unidec:default"]
    siamese = rows[-1]
    for stage in ("train:label_graph", "train:label_state", "train:hard_negative_mining"):
        assert siamese["stages"][stage]["calls"] >= 1, stage
    assert siamese["stages"]["train:train"]["calls"] == 2  # Module I and Module IV
    # SiameseXML's own from_encoder_pretrained (the BOE encoder) and its IDF pass are timed, once each, not nested
    assert siamese["stages"]["train:model_init"]["calls"] == 1 and siamese["stages"]["train:boe_idf"]["calls"] == 1
    assert not any(".model_init" in stage for row in rows for stage in row["stages"])
    assert siamese["saved_bytes"] > 2 * 24000 * 2 * 384  # the fp16 [z~ ; v] store at least
    assert json.loads(out.read_text()) == rows
    # the SiameseXML rows keep what --resume reads back: Module I's weights and Module II's finished store
    run = tmp_path / "task" / "runs" / "siamesexml-boe"
    assert json.loads((run / "module1" / "stage_complete.json").read_text())["global_step"] == 2
    assert json.loads((run / "module2" / "progress.json").read_text()) == {"points_done": 1000}
    assert not (tmp_path / "task" / "runs" / "siamesexml-boe.train.stages.json").exists()  # a finished process leaves no snapshot


def test_stage_recorder_times_an_override_and_the_parent_it_calls_as_one_stage():
    from benchmarks import bench_scale

    class Base:
        @classmethod
        def make(cls):
            return "base"

    class Child(Base):
        @classmethod
        def make(cls):
            return super().make() + "+child"

    recorder = bench_scale.StageRecorder()
    recorder.wrap(Base, "make", "model_init", kind="classmethod")
    recorder.wrap(Child, "make", "model_init", kind="classmethod")
    with recorder.stage("total"):
        assert Child.make() == "base+child" and Base.make() == "base"
    assert recorder.stages["total.model_init"]["calls"] == 2 and "total.model_init.model_init" not in recorder.stages


def test_bench_scale_resumed_row_adds_up_its_parts(tmp_path):
    """A row stopped midway: the recorder's snapshot holds the open stages up to now; --resume turns it into a part
    and the row's stages add up the parts (seconds and calls summed, the highest peak, steps recomputed)."""
    import time

    from benchmarks import bench_scale

    recorder = bench_scale.StageRecorder()
    with recorder.stage("total"):
        with recorder.stage("data_load"):
            pass
        with recorder.stage("hard_negative_mining"):
            time.sleep(0.05)
            open_stages = recorder.snapshot()  # as the snapshot thread sees a process that is stopped here
    assert open_stages["total.hard_negative_mining"]["seconds"] >= 0.05 and open_stages["total.hard_negative_mining"]["calls"] == 1
    assert open_stages["total"]["seconds"] >= open_stages["total.hard_negative_mining"]["seconds"]
    assert open_stages["total.data_load"]["calls"] == 1 and open_stages["total.hard_negative_mining"]["peak_rss_gib"] > 0

    log, out_dir = str(tmp_path / "siamesexml-boe"), tmp_path / "siamesexml-boe"
    out_dir.mkdir()
    part1 = {"total": {"seconds": 100.0, "peak_rss_gib": 19.0, "calls": 1},
             "total.hard_negative_mining": {"seconds": 60.0, "peak_rss_gib": 19.0, "calls": 1}}
    (tmp_path / "siamesexml-boe.train.stages.json").write_text(json.dumps(part1))
    parts = bench_scale.earlier_parts(log, str(out_dir), resume=True)
    assert parts == [part1] and (tmp_path / "siamesexml-boe.train.part1.json").exists() and out_dir.exists()
    part2 = {"total": {"seconds": 50.0, "peak_rss_gib": 12.0, "calls": 1}, "total.train": {"seconds": 30.0, "peak_rss_gib": 12.0, "calls": 2},
             "total.train.checkpoint": {"seconds": 5.0, "peak_rss_gib": 12.0, "calls": 2},
             "total.hard_negative_mining": {"seconds": 10.0, "peak_rss_gib": 17.5, "calls": 1}}
    merged = bench_scale.with_steps_stage(bench_scale.merge_parts(parts + [part2]))
    assert merged["total"] == {"seconds": 150.0, "peak_rss_gib": 19.0, "calls": 2}
    assert merged["total.hard_negative_mining"] == {"seconds": 70.0, "peak_rss_gib": 19.0, "calls": 2}
    assert merged["total.train.steps"]["seconds"] == 25.0  # train minus the checkpoint saves nested in it
    # without --resume the row starts fresh: earlier parts and the model directory are removed
    assert bench_scale.earlier_parts(log, str(out_dir), resume=False) == []
    assert not out_dir.exists() and not list(tmp_path.glob("siamesexml-boe.train.*"))


def test_bench_scale_row_killed_midway_keeps_its_last_snapshot(tmp_path, monkeypatch):
    """A training process the kernel kills (out of memory) leaves no result: the failed row takes its stage figures
    and peak from the recorder's last snapshot."""
    import argparse

    from benchmarks import bench_scale

    snapshot = {"total": {"seconds": 90.0, "peak_rss_gib": 19.9, "calls": 1},
                "total.hard_negative_mining": {"seconds": 60.0, "peak_rss_gib": 19.9, "calls": 1}}

    def killed(kind, cfg, log_path, timeout):
        with open(cfg["stages_file"], "w") as f:
            json.dump(snapshot, f)
        raise RuntimeError(f"{kind} worker failed (exit -9):\n...")

    monkeypatch.setattr(bench_scale, "run_worker", killed)
    args = argparse.Namespace(batch_size=0, all_label_steps=2, steps=5, train_args="", work_dir=str(tmp_path), data_dir=str(tmp_path),
                              max_seq_length=16, index_kind="ivf", ivf_nprobe=16, encoder_layers=0, vision_layers=0, encoder=None,
                              resume=False, timeout=60)
    task = {"num_labels": 100, "num_train": 200, "num_test": 20}
    row = bench_scale.run_variant("mufin", "text", args, task, encoder="enc")
    assert not row["completed"] and "exit -9" in row["error"]
    assert row["stages"]["train:hard_negative_mining"] == snapshot["total.hard_negative_mining"] and row["peak_rss_gib"] == 19.9


def test_synthetic_images_point_at_the_pool_images_of_their_labels(tmp_path):
    """``draw_images``: Binomial(15, mean / 15) images per owner, each its labels' pool image with probability
    ``label_share`` (1: always; 0: never a deliberate pick), the pool written once as PNG files of the asked size."""
    import numpy as np
    from PIL import Image

    from benchmarks import bench_scale

    pool = bench_scale.write_image_pool(str(tmp_path / "images"), 16, 8)
    assert len(pool) == 16 and Image.open(pool[3]).size == (8, 8)
    assert bench_scale.write_image_pool(str(tmp_path / "images"), 16, 8) == pool  # files already there are kept
    owners = [np.array([1, 21]), np.array([5]), np.array([], dtype=np.int64)] * 200
    images = bench_scale.draw_images(pool, owners, 4.9, seed=0, label_share=1.0)
    counts = np.array([len(x) for x in images])
    assert counts.max() <= bench_scale.MAX_IMAGES and abs(counts.mean() - 4.9) < 0.5
    for labels, paths in zip(owners, images):
        allowed = {pool[label % 16] for label in labels.tolist()} if len(labels) else set(pool)
        assert set(paths) <= allowed
    assert {pool[1], pool[5]} <= {p for paths in images for p in paths}
    assert bench_scale.draw_images(pool, owners, 4.9, seed=0, label_share=1.0) == images  # seeded


def test_bench_scale_multimodal_mufin_reads_and_ranks_images(tmp_path):
    """mufin:multimodal on a small synthetic task with images: the task's items and labels point at the generated
    PNG files, every stage runs through a random ViT, the saved model keeps the label images and its ivf index (the
    script's --index_kind), and the reloaded model ranks test items given with their images."""
    from benchmarks import bench_scale
    from hf_xmc.data import read_xc_raw

    data = tmp_path / "task"
    rows = bench_scale.main([
        "--methods", "mufin:multimodal", "--num_labels", "400", "--num_train", "200", "--num_test", "40", "--steps", "2",
        "--batch_size", "16", "--labels_per_point", "1", "4", "--images_per_item", "3", "--image_pool", "32",
        "--image_size", "16", "--data_dir", str(data), "--out", str(tmp_path / "scale.json"),
    ])
    row = rows[0]
    assert row["completed"], row.get("error")
    assert row["task"]["image_pool"] == 32 and 2 < row["task"]["images_per_item"] < 4 and row["vision_layers"] == 0
    test = read_xc_raw(str(data / "tst.json.gz"), num_labels=400)
    assert sum(map(len, test.images)) > 0 and all(p.startswith(str(data / "images")) for paths in test.images for p in paths)
    for stage in ("train:train.steps", "train:hard_negative_mining", "train:train.label_state", "reload:predict"):
        assert row["stages"][stage]["seconds"] >= 0, stage
    run = data / "runs" / "mufin-multimodal"
    assert (run / "mufin_label_images.safetensors").exists()
    meta = json.loads((run / "label_index.json").read_text())  # --index_kind ivf --ivf_nprobe 16 reach MUFIN's script
    assert (meta["kind"], meta["ivf_nprobe"]) == ("ivf", 16)
    assert row["R@100"] > 0 and row["latency_ms"]["batch_256_ms"] > 0
    assert f"mufin:multimodal ({row['task']['images_per_item']} images an item)" in bench_scale.format_table(rows)
    with pytest.raises(SystemExit, match="needs a task with images"):
        bench_scale.main(["--methods", "mufin:multimodal", "--num_labels", "400", "--num_train", "200", "--num_test", "40",
                          "--data_dir", str(tmp_path / "text"), "--out", str(tmp_path / "text.json")])
