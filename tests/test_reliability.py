"""Nothing is lost: saves that a kill cannot half-write, faults that end every process of a run, resumes after kill -9."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Optional

import numpy as np
import pytest
import torch

from hf_xmc.models import DEXMLModel
from hf_xmc.models.io_utils import STAGING_PREFIX
from hf_xmc.training.trainer import checkpoint_is_complete

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return env


@pytest.fixture()
def saved_dexml(tiny_encoder_dir, tiny_task, tmp_path):
    data = tiny_task[0]
    torch.manual_seed(0)
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, max_seq_length=16, label_max_seq_length=16)
    model.build_label_index(data.label_texts, data.label_uids)
    out = tmp_path / "model"
    model.save_pretrained(out)
    return model, out, data


def test_kill_during_save_leaves_the_previous_model_loadable(saved_dexml, tmp_path):
    """A process killed (SIGKILL) while it saves a model of 300K labels over a saved model leaves the old model
    in place: it reloads and predicts exactly as before, and the next save clears the dead process's staging dir."""
    model, out, data = saved_dexml
    (out / "eval_results.json").write_text('{"eval_P@1": 0.5}')
    expected = model.predict(list(data.test.texts[:20]), k=5)
    script = textwrap.dedent(f"""
        import sys, torch
        from hf_xmc.models import DEXMLModel
        model = DEXMLModel.from_pretrained({str(out)!r})
        n, dim = 300_000, model.label_embeddings.shape[1]
        model.set_labels([f"label {{i}}" for i in range(n)])
        model.label_embeddings = torch.randn(n, dim)
        print("saving", flush=True)
        while True:
            model.save_pretrained({str(out)!r}, label_shard_size="256KB")
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "saving", proc.stderr.read()
        deadline = time.time() + 60
        staging = []
        while not staging and time.time() < deadline:
            staging = [n for n in os.listdir(tmp_path) if n.startswith(STAGING_PREFIX)]
            time.sleep(0.002)
        assert staging, "no staging directory appeared"
        time.sleep(0.05)  # well inside the write of ~40 MB of shards and 300K label lines
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert [n for n in os.listdir(tmp_path) if n.startswith(STAGING_PREFIX)], "the kill came after the save"
    reloaded = DEXMLModel.from_pretrained(out)
    assert reloaded.label_uids == list(data.label_uids)
    got = reloaded.predict(list(data.test.texts[:20]), k=5)
    np.testing.assert_array_equal(got.label_ids, expected.label_ids)
    np.testing.assert_allclose(got.scores, expected.scores, rtol=1e-5, atol=1e-6)
    # the next save (another process: this one) removes what the killed save left beside the directory
    reloaded.save_pretrained(out)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(STAGING_PREFIX)]
    assert (out / "eval_results.json").read_text() == '{"eval_P@1": 0.5}'


def test_save_over_a_run_directory_keeps_its_other_files_and_drops_the_old_models(saved_dexml, tmp_path):
    """Saving over a directory swaps the model's own files only: checkpoints, logs and metrics stay (hard links, the
    same bytes), the previous model's shards that the new save does not write again go, and the result reloads."""
    model, out, data = saved_dexml
    model.save_pretrained(out, label_shard_size="1KB")  # a sharded label store
    shards = sorted(n for n in os.listdir(out) if n.startswith("label_embeddings-"))
    assert len(shards) > 1
    (out / "checkpoint-5").mkdir()
    (out / "checkpoint-5" / "trainer_state.json").write_text("{}")
    (out / "runs").mkdir()
    os.symlink("checkpoint-5", out / "latest")
    (out / "eval_results.json").write_text("{}")
    inode = os.stat(out / "checkpoint-5" / "trainer_state.json").st_ino
    model.save_pretrained(out)  # one label file now
    names = set(os.listdir(out))
    assert not [n for n in names if n.startswith("label_embeddings-")] and "label_embeddings.safetensors.index.json" not in names
    assert {"checkpoint-5", "runs", "latest", "eval_results.json", "label_embeddings.safetensors"} <= names
    assert os.stat(out / "checkpoint-5" / "trainer_state.json").st_ino == inode and os.readlink(out / "latest") == "checkpoint-5"
    reloaded = DEXMLModel.from_pretrained(out)
    torch.testing.assert_close(reloaded.label_embeddings, model.label_embeddings)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(STAGING_PREFIX)]
    with pytest.raises(ValueError, match="is a file"):
        model.save_pretrained(out / "eval_results.json")


@pytest.mark.slow
def test_a_fault_on_one_rank_ends_every_rank(tiny_task, tiny_encoder_dir, tmp_path):
    """Two processes (accelerate launch, gloo): rank 1 raises (a bad batch) at step 2 while rank 0 waits in the
    gradient all-reduce. The run ends within a bounded time (no hang), non-zero, with rank 1's one-line message and
    exit status 2 in the launcher's summary; nothing is saved."""
    _, task_dir = tiny_task
    out = tmp_path / "out"
    fault, port = "bad_batch", 29561
    message = "train_dexml.py (rank 1): batch of step 2: injected bad batch on rank 1"
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port)]
    args = ["--train_file", f"{task_dir}/trn.json.gz", "--test_file", f"{task_dir}/tst.json.gz", "--label_file", f"{task_dir}/lbl.json.gz",
            "--model_name_or_path", tiny_encoder_dir, "--output_dir", str(out), "--max_steps", "6", "--per_device_train_batch_size", "16",
            "--max_seq_length", "16", "--disable_tqdm", "true"]
    env = dict(_env(), CUDA_VISIBLE_DEVICES="")
    start = time.time()
    proc = subprocess.run(
        launcher + [os.path.join(REPO, "tests", "dist_fault.py"), fault, os.path.join(REPO, "training_scripts", "train_dexml.py")] + args,
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300, stdin=subprocess.DEVNULL,
    )
    seconds = time.time() - start
    assert proc.returncode != 0, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert any(line.startswith(message) for line in lines), proc.stderr[-3000:]
    root_cause = proc.stderr.split("Root Cause")[-1]  # the launcher's summary: rank 1 failed first, with status 2
    assert "rank      : 1" in root_cause and "exitcode  : 2" in root_cause, proc.stderr[-2000:]
    assert not (out / "config.json").exists() and not (out / "eval_results.json").exists()
    assert seconds < 240, seconds


def test_out_of_memory_ends_on_one_line_naming_the_rank(capsys, monkeypatch):
    """Out of memory in a rank of a multi-process run: one line naming the rank, what to lower, exit status 1."""
    from hf_xmc.training.script_utils import run_script

    def main(argv):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore detail")

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert run_script(main, [], prog="train_unidec.py") == 1
    err = capsys.readouterr().err
    assert err.strip() == (
        "train_unidec.py (rank 1): out of memory (CUDA out of memory. Tried to allocate 20.00 GiB): lower "
        "--per_device_train_batch_size, or set --gradient_cache_chunk_size to encode a batch in chunks (docs/scale.md "
        "gives the memory per label and query)"
    )
    with pytest.raises(torch.OutOfMemoryError):
        run_script(main, ["--debug"], prog="train_unidec.py")


# ---------------------------------------------------------------------------------------------- resume after kill -9
METRIC_KEYS = ("test_P@1", "test_P@3", "test_P@5", "test_nDCG@5", "test_PSP@5", "test_R@10")


def run_killed_and_resumed(cmd: list[str], out: str, reference_out: str, env: Optional[dict] = None, timeout: float = 600, **swap) -> dict:
    """Run ``cmd`` (a training run whose ``--output_dir`` is ``out``) to its end into ``reference_out`` and, beside
    it, into ``out`` until its first checkpoint of the final stage is complete, then SIGKILL its whole process
    group; run it again with ``--resume_from_checkpoint true``. ``swap`` maps more arguments to their value in the
    reference run (a launcher's port). Returns both runs' ``eval_results.json`` and the resumed run's log."""
    env = env or dict(_env(), CUDA_VISIBLE_DEVICES="")
    swap = {out: reference_out, **swap}
    reference_cmd = [swap.get(arg, arg) for arg in cmd]
    reference = subprocess.Popen(reference_cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    killed = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + timeout
        while time.time() < deadline and killed.poll() is None:
            if os.path.isdir(out) and any(checkpoint_is_complete(os.path.join(out, n)) for n in os.listdir(out) if n.startswith("checkpoint-")):
                break  # killed once a checkpoint is complete: its trainer_state.json, written last, reads as JSON
            time.sleep(0.02)
        assert killed.poll() is None, f"the run ended before it was killed: {killed.stderr.read()[-2000:]}"
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(timeout=60)
        assert not os.path.exists(os.path.join(out, "eval_results.json"))
        resumed = subprocess.run(cmd + ["--resume_from_checkpoint", "true"], env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert reference.wait(timeout=timeout) == 0, reference.stderr.read()[-3000:]
    finally:
        for proc in (reference, killed):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    with open(os.path.join(reference_out, "eval_results.json")) as f, open(os.path.join(out, "eval_results.json")) as g:
        return {"reference": json.load(f), "resumed": json.load(g), "log": resumed.stdout + resumed.stderr}


def assert_same_metrics(results: dict) -> None:
    for key in METRIC_KEYS:
        assert results["resumed"][key] == pytest.approx(results["reference"][key], abs=1e-6), (key, results["resumed"], results["reference"])


RESUME_RUNS = {
    # cluster batching and mined hard negatives: their state comes back from the checkpoint (run with 2 processes below)
    "dexml": ["--num_train_epochs", "3", "--cluster_batching", "true", "--cluster_init_size", "8", "--cluster_curriculum_epochs", "1",
              "--hard_negatives", "2", "--hard_negative_start_epoch", "1", "--hard_negative_top_k", "10"],
    # two stages: PRIME, then its classifier stage (the finished first stage is read back, not trained again)
    "prime": ["--num_train_epochs", "1", "--classifier_stage", "true", "--classifier_epochs", "2", "--classifier_batch_size", "32"],
    "unidec": ["--num_train_epochs", "2", "--projection_dim", "16"],
    # Module I (siamese), Module II (mining), Module IV (classifiers): killed in Module IV
    "siamesexml": ["--num_train_epochs", "1", "--classifier_epochs", "2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["prime", "unidec", "siamesexml"])  # DEXML: the 2-process test below; MUFIN: test_mufin_training
def test_resume_after_kill_gives_the_same_metrics(method, tiny_task, tiny_encoder_dir, tmp_path):
    _, task_dir = tiny_task
    out = str(tmp_path / "out")
    cmd = [sys.executable, os.path.join(REPO, "training_scripts", f"train_{method}.py"),
           "--train_file", f"{task_dir}/trn.json.gz", "--test_file", f"{task_dir}/tst.json.gz", "--label_file", f"{task_dir}/lbl.json.gz",
           "--model_name_or_path", tiny_encoder_dir, "--output_dir", out, "--per_device_train_batch_size", "32", "--max_seq_length", "16",
           "--learning_rate", "5e-4", "--seed", "1", "--save_strategy", "epoch", "--disable_tqdm", "true", "--report_to", "none",
           *RESUME_RUNS[method]]
    results = run_killed_and_resumed(cmd, out, str(tmp_path / "reference"))
    assert_same_metrics(results)
    assert f"resuming from {out}/checkpoint-" in results["log"]
    if method in ("prime", "siamesexml"):  # the finished first stage was not trained again
        assert "the stage finished before; its weights are read back" in results["log"]
    if method == "siamesexml":  # and Module II's label state and shortlists come back from OUT/module2, not mined again
        assert "Module II's label state and point vectors read back" in results["log"]
        from hf_xmc.data import default_validation_size

        n = len(tiny_task[0].train)
        n -= default_validation_size(n)  # held out to tune the fusion weight on (--fusion_weight not given)
        assert f"shortlists of {n} / {n} training points read back" in results["log"]


@pytest.mark.slow
def test_two_process_run_resumes_after_kill_to_the_same_metrics(tiny_task, tiny_encoder_dir, tmp_path):
    """accelerate launch, 2 processes (gloo), a LoRA adapter on the encoder: the launcher and both ranks killed with
    SIGKILL after the first checkpoint; the resumed 2-process run ends with the uninterrupted run's metrics."""
    _, task_dir = tiny_task
    out = str(tmp_path / "out")
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29563"]
    cmd = launcher + [os.path.join(REPO, "training_scripts", "train_dexml.py"),
                      "--train_file", f"{task_dir}/trn.json.gz", "--test_file", f"{task_dir}/tst.json.gz", "--label_file", f"{task_dir}/lbl.json.gz",
                      "--model_name_or_path", tiny_encoder_dir, "--output_dir", out, "--per_device_train_batch_size", "16", "--max_seq_length", "16",
                      "--learning_rate", "5e-4", "--seed", "1", "--save_strategy", "epoch", "--disable_tqdm", "true", "--report_to", "none",
                      *RESUME_RUNS["dexml"], "--peft", "lora", "--lora_r", "4"]
    results = run_killed_and_resumed(cmd, out, str(tmp_path / "reference"), **{"29563": "29564"})
    assert_same_metrics(results)
    assert f"resuming from {out}/checkpoint-" in results["log"]
    checkpoint = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))[-1]
    with open(os.path.join(out, checkpoint, "config.json")) as f:  # checkpoints keep the adapter, the final model has it merged
        assert json.load(f)["encoder_adapter"]["r"] == 4
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["encoder_adapter"] is None


def test_resume_passes_over_a_half_written_checkpoint(tmp_path, caplog):
    """A save killed midway leaves checkpoint-N without trainer_state.json (written last), or with one cut short
    while it was written: resuming picks the newest complete checkpoint and removes the half-written ones."""
    from types import SimpleNamespace

    from hf_xmc.training import XMCTrainer

    for step, state in ((10, "{}"), (20, '{"global_step": 20}'), (30, '{"global_st'), (40, ""), (50, None)):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "model.safetensors").write_bytes(b"x")
        if state is not None:
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(state)
    (tmp_path / "checkpoint-x").mkdir()  # not a checkpoint name
    trainer = SimpleNamespace(args=SimpleNamespace(output_dir=str(tmp_path), should_save=True))
    assert XMCTrainer.last_complete_checkpoint(trainer) == str(tmp_path / "checkpoint-20")
    assert not any((tmp_path / f"checkpoint-{step}").exists() for step in (30, 40, 50)) and (tmp_path / "checkpoint-10").exists()
    assert all(f"checkpoint-{step}: an incomplete checkpoint" in caplog.text for step in (30, 40, 50))
    trainer.args.output_dir = str(tmp_path / "absent")
    assert XMCTrainer.last_complete_checkpoint(trainer) is None
