"""Collator, evaluator, XMCTrainer and the train_dexml.py script contract (tiny local task, CPU)."""

import gzip
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from hf_xmc.models import DEXMLModel
from hf_xmc.training import XMCDataCollator, XMCEvaluator, XMCTrainer, XMCTrainingArguments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTRACT_KEYS = ["test_P@1", "test_P@3", "test_P@5", "test_nDCG@1", "test_nDCG@3", "test_nDCG@5",
                 "test_PSP@1", "test_PSP@3", "test_PSP@5", "test_R@10", "test_R@100"]


def test_collator_pool_targets_and_false_negative_mask(tiny_encoder_dir, tiny_task):
    from transformers import AutoTokenizer

    data = tiny_task[0]
    tok = AutoTokenizer.from_pretrained(tiny_encoder_dir)
    collator = XMCDataCollator(tok, data.train.texts, data.train.targets, data.label_texts, 16, 16, seed=3)
    rows = list(range(40, 72))
    batch = collator([{"index": r} for r in rows])
    labels = [tok.decode(ids, skip_special_tokens=True) for ids in batch["label_input_ids"]]
    pool = [data.label_texts.index(t) for t in labels]
    assert pool == sorted(set(pool))  # unique, in label-id order
    truth = data.train.targets[rows][:, pool].toarray() > 0
    np.testing.assert_array_equal(batch["targets"].numpy(), truth)  # every positive in the pool is marked
    # each query's sampled positive is in the pool and is one of its labels
    assert batch["targets"][torch.arange(len(rows)), batch["positive_index"]].all()
    assert batch["input_ids"].shape[0] == len(rows) and batch["input_ids"].shape[1] <= 16


def test_collator_all_labels_pool(tiny_encoder_dir, tiny_task):
    from transformers import AutoTokenizer

    data = tiny_task[0]
    tok = AutoTokenizer.from_pretrained(tiny_encoder_dir)
    collator = XMCDataCollator(tok, data.train.texts, data.train.targets, data.label_texts, 16, 16, all_labels=True)
    batch = collator([{"index": r} for r in range(8)])
    # every label is in the pool: no pool tokens and no (batch, L) targets, only each query's positive ids
    assert set(batch) == {"input_ids", "attention_mask", "indices", "query_positive_ids"}
    rebuilt = np.zeros((8, len(data.label_texts)), dtype=bool)
    for row, ids in enumerate(batch["query_positive_ids"].tolist()):
        rebuilt[row, [i for i in ids if i >= 0]] = True
    np.testing.assert_array_equal(rebuilt, data.train.targets[:8].toarray() > 0)


def test_collator_rejects_mismatched_label_space(tiny_task):
    data = tiny_task[0]
    with pytest.raises(ValueError, match="label columns"):
        XMCDataCollator(None, data.train.texts, data.train.targets, data.label_texts[:-1])


def test_evaluator_applies_filter(tiny_encoder_dir, tiny_task):
    data = tiny_task[0]
    torch.manual_seed(0)
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, max_seq_length=16, label_max_seq_length=16)
    plain = XMCEvaluator(data.test, data.label_texts, recall_ks=(10,))
    ids, _, _ = plain.predict(model)
    # filter out every query's current top-1 label: it must vanish and the rest shift up by one
    n, L = len(data.test), len(data.label_texts)
    filt = sp.csr_matrix((np.ones(n), (np.arange(n), ids[:, 0])), shape=(n, L))
    filtered = XMCEvaluator(data.test, data.label_texts, recall_ks=(10,), filter_matrix=filt)
    fids, _, _ = filtered.predict(model)
    np.testing.assert_array_equal(fids[:, :9], ids[:, 1:10])
    metrics = filtered(model)
    assert set(metrics) >= {"test_P@1", "test_R@10", "test_samples_per_second"} and "test_PSP@1" not in metrics


def test_trainer_learns_the_planted_task(tiny_encoder_dir, tiny_task, tmp_path):
    data = tiny_task[0]
    torch.manual_seed(0)
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, max_seq_length=16, label_max_seq_length=16)
    evaluator = XMCEvaluator(data.test, data.label_texts, train_targets=data.train.targets, recall_ks=(10,))
    before = evaluator(model)
    args = XMCTrainingArguments(output_dir=str(tmp_path), num_train_epochs=4, per_device_train_batch_size=32,
                                learning_rate=5e-4, save_strategy="no", seed=0, disable_tqdm=True)
    trainer = XMCTrainer(model=model, args=args, train_dataset=data.train, label_texts=data.label_texts, evaluator=evaluator)
    trainer.train()
    assert model.label_embeddings is None  # vectors from before training are stale and must not be saved
    after = trainer.evaluate()
    assert model.label_embeddings is not None and model.label_index.num_labels == len(data.label_texts)
    assert after["eval_P@1"] > before["test_P@1"] + 20, (before, after)
    assert after["eval_PSP@5"] > before["test_PSP@5"] + 10


def test_release_training_state_frees_the_optimizer_and_keeps_evaluation(tiny_encoder_dir, tiny_task, tmp_path):
    """After training, the optimizer (its AdamW moments), scheduler and collator are released before evaluation and
    saving (at 1.3M labels the moments alone are 4 GB); evaluate and save_model give what they gave before."""
    import gc
    import weakref

    data = tiny_task[0]
    torch.manual_seed(0)
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, max_seq_length=16, label_max_seq_length=16)
    args = XMCTrainingArguments(output_dir=str(tmp_path), num_train_epochs=1, per_device_train_batch_size=32,
                                save_strategy="no", seed=0, disable_tqdm=True, report_to="none")
    evaluator = XMCEvaluator(data.test, data.label_texts, train_targets=data.train.targets)
    trainer = XMCTrainer(model=model, args=args, train_dataset=data.train, label_texts=data.label_texts, evaluator=evaluator)
    trainer.train()
    before = trainer.evaluate()
    inner = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert inner.state  # AdamW moments exist
    optimizer, collator = weakref.ref(inner), weakref.ref(trainer.data_collator)
    del inner
    trainer.release_training_state()
    gc.collect()
    assert optimizer() is None and collator() is None and trainer.optimizer is None
    after = trainer.evaluate()
    assert {k: v for k, v in after.items() if "P@" in k or "R@" in k} == {k: v for k, v in before.items() if "P@" in k or "R@" in k}
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = DEXMLModel.from_pretrained(tmp_path / "saved")
    np.testing.assert_array_equal(reloaded.predict(data.test.texts[:4], k=3).label_ids, model.predict(data.test.texts[:4], k=3).label_ids)


def test_trainer_refuses_remove_unused_columns(tiny_encoder_dir, tiny_task, tmp_path):
    from transformers import TrainingArguments

    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir)
    with pytest.raises(ValueError, match="remove_unused_columns"):
        XMCTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path)), train_dataset=tiny_task[0].train,
                   label_texts=tiny_task[0].label_texts)


def run_script(args, launcher=None, timeout=600, script="train_dexml.py"):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    if launcher is not None and torch.cuda.device_count() < 2:
        # Two processes on one GPU would both take cuda:0, which NCCL refuses: the multi-process tests run the
        # gloo/CPU path (as in CI) unless the machine has a GPU per process.
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = (launcher or [sys.executable]) + [os.path.join(ROOT, "training_scripts", script)] + args
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout, stdin=subprocess.DEVNULL)


def contract_args(task_dir, encoder_dir, out_dir, epochs="2"):
    return ["--train_file", f"{task_dir}/trn.json.gz", "--test_file", f"{task_dir}/tst.json.gz",
            "--label_file", f"{task_dir}/lbl.json.gz", "--model_name_or_path", encoder_dir, "--output_dir", out_dir,
            "--num_train_epochs", epochs, "--per_device_train_batch_size", "32", "--max_seq_length", "16",
            "--learning_rate", "5e-4", "--seed", "1", "--disable_tqdm", "true"]


def test_train_script_contract(tiny_task, tiny_encoder_dir, tmp_path):
    _, task_dir = tiny_task
    out = tmp_path / "out"
    filter_file = tmp_path / "filter.txt"
    filter_file.write_text("0 0\n1 5\n")
    proc = run_script(contract_args(task_dir, tiny_encoder_dir, str(out)) + ["--test_filter_file", str(filter_file)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.load(open(out / "eval_results.json"))
    for key in CONTRACT_KEYS:
        assert math.isfinite(results[key]) and 0 <= results[key] <= 100, key
    assert results["train_runtime"] > 0 and results["test_samples_per_second"] > 0
    # DEXML's defaults mine a shortlist (a twentieth into the first epoch, then each epoch) and do not cluster (under
    # 10,000 labels): the mining passes' time is reported, a part of the training time
    assert 0 < results["train_mining_seconds"] < results["train_runtime"] and results["train_clustering_seconds"] == 0
    # --bf16 auto and --mining_precision auto, as resolved on this machine, are recorded
    from hf_xmc.training.negatives import runs_bf16_natively

    native = int(runs_bf16_natively(torch.device("cpu")))
    assert (results["train_bf16"], results["train_mining_bf16"]) == (native, native)
    assert results["test_P@1"] > 20  # the planted task is learnable in two epochs
    model = DEXMLModel.from_pretrained(out)
    assert model.predict(["anything at all"], k=3).label_ids.shape == (1, 3)
    # exact kinds search the label vectors themselves: only approximate ones save a faiss file
    assert (out / "label_index.faiss").exists() == (json.load(open(out / "label_index.json"))["kind"] in ("hnsw", "ivf"))


def test_train_script_reports_bad_input(tiny_task, tiny_encoder_dir, tmp_path):
    _, task_dir = tiny_task
    bad = tmp_path / "bad"
    shutil.copytree(task_dir, bad)
    with gzip.open(bad / "trn.json.gz", "at") as f:
        f.write(json.dumps({"uid": "x", "title": "w", "target_ind": [999]}) + "\n")
    proc = run_script(contract_args(str(bad), tiny_encoder_dir, str(tmp_path / "out")))
    # one line naming the file, the line and the fault; exit status 2; no traceback, nothing written
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert last.startswith("train_dexml.py: ") and "trn.json.gz, line 481: label id 999 out of range" in last
    assert not (tmp_path / "out" / "eval_results.json").exists()
    # --debug gives the traceback back: the error is re-raised (checked in this process: a second interpreter only
    # re-imports torch)
    from hf_xmc.training.recipes import dexml
    from hf_xmc.training.script_utils import run_script as run_main

    with pytest.raises(ValueError, match="trn.json.gz, line 481: label id 999 out of range"):
        run_main(dexml.main, contract_args(str(bad), tiny_encoder_dir, str(tmp_path / "out")) + ["--debug"], prog="train_dexml.py")


@pytest.mark.slow
def test_train_script_under_accelerate_two_processes(tiny_task, tiny_encoder_dir, tmp_path):
    _, task_dir = tiny_task
    out = tmp_path / "out"
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29531"]
    # DEXML's clustering (first a twentieth into the first epoch: clusters of 8, of 16 from epoch 1) on 40 labels
    engine = ["--cluster_batching", "true", "--cluster_min_labels", "0", "--cluster_init_size", "8", "--cluster_curriculum_epochs", "1",
              "--cluster_refresh_interval", "1", "--hard_negatives", "2", "--hard_negative_start_epoch", "1",
              "--hard_negative_top_k", "10", "--gradient_cache_chunk_size", "8"]
    proc = run_script(contract_args(task_dir, tiny_encoder_dir, str(out), epochs="2") + engine, launcher=launcher)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "Total train batch size (w. parallel, distributed & accumulation) = 64" in log  # 2 processes x 32
    assert "clustered 480 queries into clusters of 8" in log and "clustered 480 queries into clusters of 16" in log
    assert "mined a shortlist of 10 hard negatives" in log
    results = json.load(open(out / "eval_results.json"))
    assert all(0 <= results[k] <= 100 for k in CONTRACT_KEYS)
    assert results["test_P@1"] > 20


@pytest.mark.slow
def test_unidec_one_cluster_per_batch_under_accelerate_two_processes(tiny_task, tiny_encoder_dir, tmp_path):
    # 480 queries, global batch 2 x 8 = 16: 32 leaves of 15, each split into two slices of 8 (the odd leaf repeats a
    # member), so both ranks step with the same batch size, as the gathers of pools and memory bank need
    _, task_dir = tiny_task
    out = tmp_path / "out"
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29532"]
    engine = ["--per_device_train_batch_size", "8", "--cluster_batching", "true", "--cluster_batch_mode", "one_per_batch",
              "--cluster_curriculum_epochs", "1", "--cluster_start_epoch", "1", "--cluster_refresh_interval", "1", "--hard_negatives", "0",
              "--cluster_min_labels", "0"]
    proc = run_script(contract_args(task_dir, tiny_encoder_dir, str(out), epochs="2") + engine, launcher=launcher,
                      script="train_unidec.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "Total optimization steps = 64" in log  # 32 leaves per epoch, before and after the clustering
    assert "clustered 480 queries into clusters of 16" in log
    results = json.load(open(out / "eval_results.json"))
    assert all(0 <= results[k] <= 100 for k in CONTRACT_KEYS)


def test_training_into_a_finished_model_refuses_unless_asked(tiny_task, tiny_encoder_dir, tmp_path):
    """A second run into a directory that holds a finished model stops before any work (the model is untouched)
    unless --overwrite_output_dir is given."""
    from hf_xmc.training.recipes.dexml import main

    _, task_dir = tiny_task
    out = tmp_path / "out"
    argv = contract_args(task_dir, tiny_encoder_dir, str(out), epochs="1") + ["--save_strategy", "no"]
    main(argv)
    before = (out / "model.safetensors").stat().st_mtime_ns
    with pytest.raises(ValueError, match="already holds a finished model; pass --overwrite_output_dir true"):
        main(argv)
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    main(argv + ["--overwrite_output_dir", "true"])
    assert (out / "model.safetensors").stat().st_mtime_ns != before
