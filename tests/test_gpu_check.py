"""benchmarks/gpu_check.sh and its bundle (benchmarks/gpu_bundle.py), on the CPU: the dry run end to end (row order,
budget, rows written as they end, the extrapolation), the plan's decisions and arithmetic, and the bundle's parts
(packages, encoder weights, data, sizes) unpacked again."""

import gzip
import json
import os
import subprocess
import sys
import tarfile
import time

import numpy as np
import pytest

from benchmarks import gpu_bundle, gpu_check

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------------ the dry run


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory, tiny_task, tiny_encoder_dir):
    """One dry run through gpu_check.sh: DEXML step-bounded on "reuters" (the full preset set to 100,000 steps, which
    no budget fits), then DEXML on "wordnet", whose probe (the dry run's prior: 120 s) cannot fit a 100 s budget."""
    tmp = tmp_path_factory.mktemp("gpu_check")
    results, out = tmp / "results", tmp / "out"
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    start = time.time()
    proc = subprocess.run(
        ["bash", os.path.join(REPO, "benchmarks", "gpu_check.sh"), "--dry_run", "--budget", "100", "--results", str(results), "--out", str(out),
         "--skip_smoke", "--datasets", "reuters", "wordnet", "--methods", "dexml", "--full_steps", "100000", "--probe_steps", "3",
         "--dry_data", tiny_task[1], "--dry_encoder", tiny_encoder_dir],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"results": results, "out": out, "seconds": time.time() - start, "stdout": proc.stdout,
            "rows": gpu_check.read_rows(str(results / gpu_check.ROWS_FILE))}


def test_dry_run_rows_in_order_bounded_then_skipped(dry_run):
    rows = dry_run["rows"]
    assert [(r["row"], r["variant"]) for r in rows] == [("reuters-dexml-gpu_preset-3steps", "step-bounded"),
                                                        ("wordnet-dexml-gpu_preset", "skipped")]
    bounded, skipped = rows
    assert bounded["steps"] == 3 and bounded["full_steps"] == 100000 and bounded["flags"][:4] == ["--preset", "gpu", "--max_steps", "3"]
    assert set(bounded["dense"]) >= {"P@1", "PSP@5"} and set(bounded["fused"]) >= {"P@1", "PSP@5"}
    assert bounded["steps_per_second"] > 0 and bounded["wall_seconds"] > 0 and bounded["peak_gpu_memory_gib"] is None  # CPU
    assert "not of the preset" in bounded["note"]
    assert "needs ~" in skipped["reason"] and skipped["estimate_seconds"] * gpu_check.SAFETY > skipped["left_seconds"]
    assert dry_run["seconds"] < 100 + 30  # the budget holds (startup of the shell and the interpreter aside)


def test_dry_run_extrapolation_is_labelled_and_adds_up(dry_run):
    row = dry_run["rows"][0]
    ex = row["extrapolated"]
    assert ex["label"] == "extrapolated" and ex["full_steps"] == 100000
    (stage,) = [s for s in row["stages"] if s["bounded_by"] == 3]  # DEXML: one trainer stage, bounded by --max_steps 3
    assert stage["steps"] == 3
    expected = row["wall_seconds"] + (100000 - 3) * stage["mean_step_seconds"]
    assert ex["full_wall_seconds"] == pytest.approx(expected, abs=0.2)


def test_dry_run_copies_finished_files_to_out(dry_run):
    out, results = dry_run["out"], dry_run["results"]
    names = sorted(os.listdir(out))
    assert names == ["gpu_check.log", gpu_check.ENV_FILE, gpu_check.ROWS_FILE]  # no smoke: --skip_smoke
    assert len(names) <= 8 and all(os.path.isfile(out / n) for n in names)  # the device tool's limits: flat, few files
    assert (out / gpu_check.ROWS_FILE).read_text() == (results / gpu_check.ROWS_FILE).read_text()
    env = json.loads((out / gpu_check.ENV_FILE).read_text())
    assert env["dry_run"] and env["smoke"] == {"skipped": "--skip_smoke"} and env["encoder"] == "tiny random BERT (dry run)"
    log = (out / "gpu_check.log").read_text()
    assert "reuters-dexml-gpu_preset-3steps: step-bounded" in log and "gpu_check.sh: exit 0" in log
    assert "| reuters | dexml | 3 of 100,000 steps (step-bounded); full ~" in gpu_check.table(dry_run["rows"])
    with pytest.raises(SystemExit, match="dry run"):  # a dry run's rows never reach dense.json
        gpu_check.merge(dry_run["rows"])


# ------------------------------------------------------------------------------------------------ the plan


def test_decide_full_bounded_skip():
    # full: 60 + 1200 x 0.1 = 180 s, x 1.15 = 207 <= 300 - 50
    assert gpu_check.decide(60, 0.1, 1200, 100, 20, left=300, reserve=50)[:2] == ("full", 1200)
    # the reserve for the probes to come turns it into a step-bounded row; the probe fits
    kind, steps, why, estimate = gpu_check.decide(60, 0.1, 1200, 100, 20, left=300, reserve=150)
    assert (kind, steps, estimate) == ("bounded", 100, 70) and "180" in why
    # less time: fewer steps (floor((100 / 1.15 - 60) / 0.5) = 53)
    assert gpu_check.decide(60, 0.5, 1200, 100, 20, left=100)[:2] == ("bounded", 53)
    # not even the fewest steps fit: skipped, with the time it needs
    kind, steps, why, estimate = gpu_check.decide(60, 0.5, 1200, 100, 20, left=70)
    assert (kind, steps, estimate) == ("skip", 0, 70) and "20 steps" in why
    # a pair that ran step-bounded already is only run again in full
    assert gpu_check.decide(60, 0.1, 1200, 100, 20, left=150, allow_bounded=False)[0] == "skip"


def test_estimates_fall_back_from_pair_to_dataset_to_prior():
    est = gpu_check.Estimates(gpu_check.PRIOR_STEP_SECONDS, gpu_check.PRIOR_OVERHEAD_SECONDS)
    assert est.step("prime") == gpu_check.PRIOR_STEP_SECONDS["prime"]
    assert est.overhead("debtags", "siamesexml") == gpu_check.PRIOR_OVERHEAD_SECONDS["debtags"] * gpu_check.METHOD_OVERHEAD["siamesexml"]
    est.add("reuters", "dexml", overhead=40.0, step_seconds=0.12, post=10.0)
    assert est.step("dexml") == 0.12 and est.overhead("reuters", "dexml") == 40.0 and est.post("reuters", "dexml") == 10.0
    assert est.overhead("reuters", "prime") == pytest.approx(40.0 * 1.3)  # the dataset's, scaled to the method
    assert est.post("debtags", "dexml") == gpu_check.POST_SHARE * gpu_check.PRIOR_OVERHEAD_SECONDS["debtags"]


def test_plan_each_method_on_the_smallest_then_dexml_on_the_largest():
    first, second = gpu_check.plan_pairs(["wordnet", "reuters", "debtags"], ["siamesexml", "dexml", "prime", "unidec"])
    assert first == [("reuters", "dexml"), ("reuters", "unidec"), ("reuters", "prime"), ("reuters", "siamesexml"), ("wordnet", "dexml")]
    assert second[:5] == [("reuters", "dexml"), ("reuters", "unidec"), ("reuters", "prime"), ("reuters", "siamesexml"), ("debtags", "dexml")]
    assert len(second) == 12 and second[-1] == ("wordnet", "siamesexml")
    assert gpu_check.plan_pairs(["debtags"], ["unidec"]) == ([("debtags", "unidec")], [("debtags", "unidec")])


def _stage(max_steps_arg, steps, step_seconds, begin=1000.0, first=2.0):
    ends = [begin + first + i * step_seconds for i in range(steps)]
    return {"max_steps_arg": max_steps_arg, "max_steps": steps, "begin": begin, "step_ends": ends, "end": ends[-1] + 0.5}


def test_stage_summary_leaves_out_the_warm_up_steps():
    s = gpu_check.stage_summary(_stage(100, 100, 0.25, first=5.0))
    assert s["steps"] == 100 and s["mean_step_seconds"] == pytest.approx(0.25) and s["first_step_seconds"] == pytest.approx(5.0)
    short = gpu_check.stage_summary(_stage(3, 3, 0.25, first=1.0))  # too short to leave any out: all of it
    assert short["mean_step_seconds"] == pytest.approx((1.0 + 2 * 0.25) / 3, abs=1e-4)


def test_extrapolation_of_the_stages_the_step_bound_bounds():
    # PRIME: its (W) stage inherits --max_steps (both bounded); SiameseXML's Module IV runs its epochs (-1): whole
    prime = [gpu_check.stage_summary(_stage(100, 100, 0.3)), gpu_check.stage_summary(_stage(100, 100, 0.05))]
    ex = gpu_check.extrapolate(90.0, prime, target=100, full_steps=900)
    assert ex["full_wall_seconds"] == pytest.approx(90 + 800 * 0.3 + 800 * 0.05, abs=0.1)
    assert ex["step_seconds"] == pytest.approx(0.35) and ex["overhead_seconds"] == pytest.approx(90 - 100 * 0.35, abs=0.1)
    siamese = [gpu_check.stage_summary(_stage(100, 100, 0.3)), gpu_check.stage_summary(_stage(-1, 70, 0.02))]
    assert gpu_check.extrapolate(90.0, siamese, 100, 900)["full_wall_seconds"] == pytest.approx(90 + 800 * 0.3, abs=0.1)
    # a full row's stages bounded by the preset's own steps: nothing left to add
    assert gpu_check.extrapolate(400.0, [gpu_check.stage_summary(_stage(1200, 1200, 0.3))], 1200, 1200)["full_wall_seconds"] == 400.0


def test_make_row_full_and_cut(tmp_path):
    args = gpu_check.parse_args(["--dry_run", "--results", str(tmp_path), "--full_steps", "12"])
    run = gpu_check.Run(args)
    results = {"test_P@1": 50.0, "test_PSP@5": 40.0, "test_dense_P@1": 45.0, "test_dense_PSP@5": 35.0, "train_runtime": 3.0}
    stats = {"stages": [_stage(12, 12, 0.2)], "cut": None, "exit": 1010.0, "peak_gpu_memory_allocated": 3 * 2**30}
    row = run.make_row("reuters", "dexml", "reuters-dexml-gpu_preset", "full", 12, 12, ["--preset", "gpu"], results, stats, 20.0)
    assert row["variant"] == "full" and "extrapolated" not in row and row["peak_gpu_memory_gib"] == 3.0
    assert row["dense"] == {"P@1": 45.0, "PSP@5": 35.0} and row["fused"] == {"P@1": 50.0, "PSP@5": 40.0}
    assert row["recipe"] == "gpu_preset" and row["steps_per_second"] == pytest.approx(5.0)
    cut = {**stats, "stages": [_stage(12, 7, 0.2, first=0.2)], "cut": {"stage": 0, "step": 7}}  # a short stage: its mean is all of it
    row = run.make_row("reuters", "dexml", "reuters-dexml-gpu_preset", "full", 12, 12, ["--preset", "gpu"], results, cut, 20.0)
    assert row["variant"] == "cut by the budget" and row["extrapolated"]["full_wall_seconds"] == pytest.approx(20 + 5 * 0.2, abs=0.1)


def test_smoke_step_publishes_what_it_finished(tmp_path, monkeypatch):
    """The smoke step runs its command under the time left and copies its JSON to --out, a partial one too."""
    fake = tmp_path / "fake_smoke.py"
    fake.write_text("import json, sys\nout = sys.argv[sys.argv.index('--out') + 1]\n"
                    "json.dump({'partial': True, 'checks': [{'check': 'a', 'passed': True}, {'check': 'b', 'passed': False}]}, open(out, 'w'))\n")
    args = gpu_check.parse_args(["--dry_run", "--results", str(tmp_path / "r"), "--out", str(tmp_path / "o")])
    run = gpu_check.Run(args)
    real_run = gpu_check.run_bounded
    monkeypatch.setattr(gpu_check, "run_bounded", lambda cmd, timeout, **kw: real_run([sys.executable, str(fake), *cmd[2:]], timeout, **kw))
    run.smoke()
    assert run.env["smoke"]["passed"] == 1 and run.env["smoke"]["failed"] == ["b"]
    assert json.loads((tmp_path / "o" / gpu_check.SMOKE_FILE).read_text())["partial"] is True
    args = gpu_check.parse_args(["--dry_run", "--budget", "20", "--results", str(tmp_path / "r2")])
    run = gpu_check.Run(args)
    run.smoke()  # 30 s prior x 1.15 does not fit 20 - 15
    assert "needs ~" in run.env["smoke"]["skipped"]


def test_step_clock_times_steps_and_stops_at_the_deadline(tmp_path):
    """The hook's callback on a real transformers Trainer: every step timed, training stopped at the deadline."""
    import torch
    from transformers import Trainer, TrainingArguments

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(4, 1)

        def forward(self, x):
            return {"loss": self.w(x).pow(2).mean()}

    data = [{"x": torch.randn(4)} for _ in range(64)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=4, report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True, logging_strategy="no")
    stats, ended = {"stages": [], "cut": None}, []
    remove = gpu_check.install_step_clock(stats, time.time(), lambda: ended.append(1))  # the deadline: now
    try:
        Trainer(model=Tiny(), args=args, train_dataset=data).train()
    finally:
        remove()
    (stage,) = stats["stages"]
    assert len(stage["step_ends"]) == 1 and stage["global_step"] == 1 and stage["max_steps_arg"] == 12 and ended == [1]
    assert stats["cut"] == {"stage": 0, "step": 1} and gpu_check.stage_summary(stage)["steps"] == 1
    assert Trainer.__init__.__name__ == "__init__"  # taken off again


def test_run_bounded_kills_at_the_limit():
    start = time.time()
    assert gpu_check.run_bounded([sys.executable, "-c", "import time; time.sleep(30)"], 1.0) is None
    assert time.time() - start < 10
    assert gpu_check.run_bounded([sys.executable, "-c", "raise SystemExit(3)"], 30.0) == 3


def test_full_steps_flag():
    assert gpu_check.parse_args(["--full_steps", "50", "prime=7"]).full_steps == [("*", 50), ("prime", 7)]
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--full_steps", "nope=3"])


# ------------------------------------------------------------------------------------------------ the bundle


def test_plan_packages_carries_what_the_image_lacks_or_holds_too_old():
    installed = {
        "transformers": ("5.25.0", ["huggingface-hub>=2.4", "regex>=2025.10.22", "kernels>=0.19", "tqdm"]),
        "huggingface-hub": ("2.4.0", ["httpx2>=2", "click>=8.4.2", "pyyaml"]),
        "httpx2": ("2.16.2", []), "click": ("8.5.1", []), "regex": ("2026.11.19", []), "datasets": ("5.2.0", ["dill", "pyarrow>=24"]),
        "dill": ("0.4.1", ['objgraph; extra == "graph"']), "torch": ("2.14.1", []), "numpy": ("2.4.6", []),
    }
    image = {"transformers", "huggingface-hub", "torch", "numpy", "click", "regex", "tqdm", "pyyaml", "pyarrow"}
    versions = {"transformers": "5.17.0", "huggingface-hub": "1.33.0", "torch": "2.11.0", "numpy": "2.5.2"}
    plan = gpu_bundle.plan_packages(["torch>=2.4", "transformers>=5.23", "numpy>=1.24", "datasets>=3"], installed, image, versions)
    assert set(plan["carry"]) == {"transformers", "huggingface-hub", "httpx2", "datasets", "dill"}
    assert plan["carry"]["transformers"][0] == "5.25.0" and "image has 5.17.0" in plan["carry"]["transformers"][1]
    assert set(plan["insurance"]) == {"regex", "click"}  # floors a carried package sets on an image package of unknown version
    assert "pyarrow" in plan["assumed"] and "kernels" in plan["optional"] and not plan["errors"]
    too_old_torch = gpu_bundle.plan_packages(["torch>=2.12"], installed, image, versions)
    assert too_old_torch["errors"] and not too_old_torch["carry"]


def test_select_parts_keeps_required_then_optional_in_order():
    mib = gpu_bundle.MIB
    parts = {"site/transformers-5": 4 * mib, "minilm": 37 * mib, "data/reuters": mib, "site/faiss-cpu-1": 9 * mib, "data/wordnet-xmc": 8 * mib}
    kept, left, total = gpu_bundle.select_parts(5 * mib, parts, 64 * mib, 1 * mib)
    assert left == ["data/wordnet-xmc"] and "site/faiss-cpu-1" in kept and total == 56 * mib  # 5 + 4 + 37 + 1 + 9; + 8 > 63
    kept, left, total = gpu_bundle.select_parts(5 * mib, parts, 80 * mib, 1 * mib)
    assert not left and total == 64 * mib
    kept, left, total = gpu_bundle.select_parts(25 * mib, parts, 64 * mib, 1 * mib)  # required alone are over: said by total
    assert total > 64 * mib and left == ["site/faiss-cpu-1", "data/wordnet-xmc"]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_weights_round_trip(tmp_path, dtype):
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(0)
    tensors = {"a.weight": rng.standard_normal((7, 5)).astype(np.float32) * 0.05, "b.bias": rng.standard_normal(3).astype(np.float32),
               "position_ids": np.arange(6, dtype=np.int64)[None]}
    save_file(tensors, str(tmp_path / "w.safetensors"), metadata={"format": "pt"})
    blob, index = gpu_bundle.pack_weights(str(tmp_path / "w.safetensors"), dtype)
    back = gpu_bundle.unpack_weights(blob, index)
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        expected = value.astype(dtype).astype(value.dtype) if value.dtype.kind == "f" else value
        np.testing.assert_array_equal(back[name], expected)  # exactly the rounded values (float32: the values)
    if dtype == "float16":
        assert 0 < np.abs(back["a.weight"] - tensors["a.weight"]).max() <= np.abs(tensors["a.weight"]).max() * 2**-11
    assert set(load_file(str(tmp_path / "w.safetensors"))) == set(back)


def test_bundle_restores_packages_encoder_and_data(tmp_path, tiny_encoder_dir, tiny_task, monkeypatch):
    monkeypatch.setattr(gpu_bundle, "CACHE", str(tmp_path / "cache"))
    bundle, stage = tmp_path / "bundle", tmp_path / "stage"
    pkg = tmp_path / "pkg"
    (pkg / "toypkg").mkdir(parents=True)
    (pkg / "toypkg" / "__init__.py").write_text("VALUE = 7\n")
    gpu_bundle.tar_xz(str(bundle / "site" / "toypkg-1.0.tar.xz"), {"toypkg": str(pkg / "toypkg")})
    gpu_bundle.encoder_part(str(bundle), tiny_encoder_dir)
    gpu_bundle.data_part(str(bundle), "reuters", tiny_task[1])
    (bundle / "manifest.json").write_text("{}")
    with tarfile.open(bundle / "data" / "reuters.tar.xz") as tar:  # stored unzipped, for xz
        assert "reuters/trn.json" in tar.getnames() and "reuters/trn.json.gz" not in tar.getnames()
    done = gpu_bundle.restore(str(bundle), str(stage))
    assert done["site"] == ["toypkg-1.0"] and done["data"] == ["reuters"]
    assert (stage / "site" / "toypkg" / "__init__.py").read_text() == "VALUE = 7\n"
    for name in ("trn.json.gz", "tst.json.gz", "lbl.json.gz"):
        with gzip.open(stage / "data" / "reuters" / name) as restored, gzip.open(os.path.join(tiny_task[1], name)) as original:
            assert restored.read() == original.read()
    from safetensors.numpy import load_file

    original = load_file(os.path.join(tiny_encoder_dir, "model.safetensors"))
    restored = load_file(str(stage / "minilm" / "model.safetensors"))
    assert set(restored) == set(original)
    for name, value in original.items():
        np.testing.assert_array_equal(restored[name], value.astype(np.float16).astype(value.dtype) if value.dtype.kind == "f" else value)
    assert "float16" in json.loads((stage / "minilm" / "gpu_bundle_weights.json").read_text())["weights"]
    assert "float16" in gpu_check.encoder_provenance(str(stage / "minilm"), dry=False)
    assert os.path.exists(stage / "minilm" / "config.json") and not os.path.exists(stage / "minilm" / gpu_bundle.PLANES)
    (stage / "site" / "toypkg" / "marker").write_text("kept")  # a second restore of the same parts leaves the stage as it is
    gpu_bundle.restore(str(bundle), str(stage))
    assert (stage / "site" / "toypkg" / "marker").exists()


def test_tree_bytes_counts_the_checkout():
    assert gpu_bundle.tree_bytes() > os.path.getsize(os.path.join(REPO, "benchmarks", "gpu_check.py"))
