"""Training engine inside XMCTrainer: gradient caching, cluster batching, hard negatives, propensity sampling, resume."""

import os

import numpy as np
import pytest
import torch
from transformers import TrainerCallback

from hf_xmc.models import DEXMLModel
from hf_xmc.training import XMCEvaluator, XMCTrainer, XMCTrainingArguments


def make_trainer(encoder_dir, data, out_dir, seed=0, **kwargs):
    torch.manual_seed(seed)
    model = DEXMLModel.from_encoder_pretrained(encoder_dir, max_seq_length=16, label_max_seq_length=16)
    args = dict(output_dir=str(out_dir), num_train_epochs=1, per_device_train_batch_size=32, learning_rate=5e-4,
                save_strategy="no", seed=seed, disable_tqdm=True)
    args.update(kwargs)
    evaluator = XMCEvaluator(data.test, data.label_texts, train_targets=data.train.targets, recall_ks=(10,))
    return XMCTrainer(model=model, args=XMCTrainingArguments(**args), train_dataset=data.train, label_texts=data.label_texts,
                      evaluator=evaluator)


def test_gradient_cache_trains_like_the_plain_loss(tiny_encoder_dir, tiny_task, tmp_path):
    # 4 optimiser steps with gradient accumulation 2. Dropout off here: chunked encoding draws dropout masks in
    # another order than one full-batch pass (tests/test_gradcache.py checks the replay of masks chunk by chunk).
    # Float32 (bf16=False): under bf16 autocast a chunk and the whole batch round differently
    data = tiny_task[0]
    same = dict(encoder_dropout=0.0, max_steps=4, gradient_accumulation_steps=2, bf16=False)
    plain = make_trainer(tiny_encoder_dir, data, tmp_path / "a", **same)
    plain.train()
    cached = make_trainer(tiny_encoder_dir, data, tmp_path / "b", gradient_cache_chunk_size=5, **same)
    cached.train()
    moved = 0
    for (name, a), (_, b) in zip(plain.model.named_parameters(), cached.model.named_parameters()):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=name)
        moved += 1
    assert moved and plain.state.log_history[-1]["train_loss"] == pytest.approx(cached.state.log_history[-1]["train_loss"], rel=1e-4)


def test_cluster_batching_groups_similar_queries(tiny_encoder_dir, tiny_task, tmp_path):
    data = tiny_task[0]
    trainer = make_trainer(tiny_encoder_dir, data, tmp_path, num_train_epochs=4, cluster_batching=True, cluster_init_size=4,
                           cluster_curriculum_epochs=[3], cluster_refresh_interval=1)
    metrics = trainer.train().metrics
    # the clustering at epoch 3 is timed and reported (no mining here); a part of the training time
    assert 0 < metrics["train_clustering_seconds"] < metrics["train_runtime"] and metrics["train_mining_seconds"] == 0
    sampler = trainer.cluster_sampler
    # epochs 0-2 filled the memory bank with every training query; epoch 3 clustered it into clusters of 8
    assert trainer.memory_bank.num_filled == len(data.train)
    assign = sampler.state_dict()["assignment"]
    assert assign is not None and np.bincount(assign).max() - np.bincount(assign).min() <= 1
    # pairs of queries in one cluster share a label far more often than random pairs
    Y = ((data.train.targets > 0).astype(np.float32)).tocsr()

    def shared_label_rate(groups):
        pairs = shared = 0
        for rows in groups:
            S = (Y[rows] @ Y[rows].T).toarray() > 0
            shared += S.sum() - len(rows)
            pairs += len(rows) * (len(rows) - 1)
        return shared / pairs

    clusters = [np.flatnonzero(assign == c) for c in range(assign.max() + 1)]
    rng = np.random.default_rng(0)
    random_groups = [rng.choice(len(data.train), len(c), replace=False) for c in clusters]
    assert shared_label_rate(clusters) > 2 * shared_label_rate(random_groups)


def test_one_cluster_per_batch_keeps_the_step_count(tiny_encoder_dir, tiny_task, tmp_path):
    # UniDEC batching: leaves of at most 32 queries, one leaf per step, random leaves before the first clustering;
    # every epoch has the same number of steps, so the Trainer's schedule (computed from epoch 0) holds to the end
    data = tiny_task[0]
    trainer = make_trainer(tiny_encoder_dir, data, tmp_path, num_train_epochs=2, cluster_batching=True,
                           cluster_batch_mode="one_per_batch", cluster_curriculum_epochs=[1], cluster_refresh_interval=1)
    sampler = trainer.cluster_sampler
    leaves = sampler.num_leaves()
    assert sampler.mode == "one_per_batch" and leaves * 32 >= len(data.train) > leaves * 16
    trainer.train()
    assert trainer.state.global_step == 2 * leaves and sampler.clustered_epoch == 1
    assign = sampler.assignment
    assert np.bincount(assign).size == leaves and np.bincount(assign).max() <= 32
    for batch in sampler:  # epoch 1's batches: each one whole cluster
        assert sorted(batch) == np.flatnonzero(assign == assign[batch[0]]).tolist()
    with pytest.raises(ValueError, match="cluster_batch_mode"):
        XMCTrainingArguments(output_dir=str(tmp_path), cluster_batch_mode="leaf")


def test_hard_negatives_enter_the_pool(tiny_encoder_dir, tiny_task, tmp_path):
    data = tiny_task[0]
    trainer = make_trainer(tiny_encoder_dir, data, tmp_path, hard_negatives=3, hard_negative_start_epoch=0, hard_negative_top_k=10)
    trainer.train()
    collator = trainer.data_collator
    shortlist = collator.shortlist
    assert shortlist.shape == (len(data.train), 10)
    for r in range(0, len(data.train), 37):  # known positives are never in the shortlist
        assert not set(shortlist[r].tolist()) & set(data.train.targets[r].indices.tolist())
    rows = list(range(16))
    with_neg = collator([{"index": r} for r in rows])
    collator.set_shortlist(None)
    without = collator([{"index": r} for r in rows])
    assert len(with_neg["label_ids"]) > len(without["label_ids"])
    assert set(without["label_ids"].tolist()) <= set(with_neg["label_ids"].tolist())


def test_fractional_mining_schedule_mines_within_epochs(tiny_encoder_dir, tiny_task, tmp_path, monkeypatch):
    from hf_xmc.training import callbacks as callbacks_module

    data = tiny_task[0]
    steps_per_epoch = -(-len(data.train) // 32)
    trainer = make_trainer(tiny_encoder_dir, data, tmp_path, num_train_epochs=2, hard_negatives=2, hard_negative_top_k=10,
                           hard_negative_start_epoch=0.5, hard_negative_refresh_interval=0.5, mining_precision="bfloat16")
    mined_at, precisions = [], []
    real = callbacks_module.mine_hard_negatives

    def recording(model, *args, **kwargs):
        mined_at.append((trainer.state.global_step, model.training))
        precisions.append(model.encoding_autocast_dtype)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(callbacks_module, "mine_hard_negatives", recording)
    trainer.train()
    # schedule points 0.5, 1.0 and 1.5 epochs: mid-epoch ones before the first step past them, 1.0 at the epoch start
    expected = [int(np.ceil(0.5 * steps_per_epoch)), steps_per_epoch, int(np.ceil(1.5 * steps_per_epoch))]
    assert [step for step, _ in mined_at] == expected
    # --mining_precision bfloat16: the mining passes ran under bf16 autocast, training and evaluation did not
    assert precisions == [torch.bfloat16] * 3 and trainer.model.encoding_autocast_dtype is None
    assert trainer.data_collator.shortlist is not None and trainer.data_collator.shortlist.shape == (len(data.train), 10)
    callback = next(c for c in trainer.callback_handler.callbacks if hasattr(c, "mining_due"))
    assert callback.mined_epoch == pytest.approx(1.5)
    assert callback.mining_due(trainer.args, 1.99) is None and callback.mining_due(trainer.args, 2.0) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="hard_negative_refresh_interval"):
        XMCTrainingArguments(output_dir=str(tmp_path), hard_negative_refresh_interval=0)


def test_clustering_within_the_first_epoch_reuses_the_mining_pass(tiny_encoder_dir, tiny_task, tmp_path, monkeypatch):
    # --cluster_start_epoch 0.5 with the shortlist mined at the same point: one encoding pass serves both, and the
    # second half of the epoch is cut from clusters; without mining at that point the queries are encoded for it
    data = tiny_task[0]
    steps_per_epoch = -(-len(data.train) // 32)
    encoded, mining = [], []  # encoding passes over every training query outside the mining pass
    encode, search_vectors = DEXMLModel.encode_queries, DEXMLModel.query_search_vectors

    def counting_encode(self, texts, *args, **kwargs):
        if not mining and len(texts) == len(data.train):
            encoded.append(1)
        return encode(self, texts, *args, **kwargs)

    def mining_vectors(self, *args, **kwargs):
        mining.append(1)
        try:
            return search_vectors(self, *args, **kwargs)
        finally:
            mining.pop()

    monkeypatch.setattr(DEXMLModel, "encode_queries", counting_encode)
    monkeypatch.setattr(DEXMLModel, "query_search_vectors", mining_vectors)
    flags = dict(num_train_epochs=1, cluster_batching=True, cluster_init_size=8, cluster_curriculum_epochs=[5], cluster_start_epoch=0.5)
    trainer = make_trainer(tiny_encoder_dir, data, tmp_path / "a", hard_negatives=2, hard_negative_top_k=10, hard_negative_start_epoch=0.5, **flags)
    trainer.train()
    sampler = trainer.cluster_sampler
    assert encoded == [] and sampler.assignment is not None and sampler.clustered_epoch == 0
    assert np.bincount(sampler.assignment).max() <= 8 and trainer.state.global_step == steps_per_epoch
    # the split is where the epoch was when the point came (the loader may have drawn a batch ahead)
    assert steps_per_epoch // 2 <= sampler.split_batch <= steps_per_epoch // 2 + 2
    alone = make_trainer(tiny_encoder_dir, data, tmp_path / "b", **flags)
    alone.train()
    assert encoded == [1] and alone.cluster_sampler.assignment is not None and alone.data_collator.shortlist is None
    with pytest.raises(ValueError, match="cluster_start_epoch"):
        XMCTrainingArguments(output_dir=str(tmp_path), cluster_start_epoch=0.5, cluster_batch_mode="one_per_batch")
    # --cluster_min_labels above the task's label count: random batches, and the arguments say so
    small = make_trainer(tiny_encoder_dir, data, tmp_path / "c", cluster_min_labels=data.train.targets.shape[1] + 1, **flags)
    assert small.cluster_sampler is None and not small.args.cluster_batching
    assert make_trainer(tiny_encoder_dir, data, tmp_path / "d", cluster_min_labels=data.train.targets.shape[1], **flags).cluster_sampler is not None


def test_a_cpu_multiplies_bf16_with_amx_or_avx512_bf16(tmp_path):
    from hf_xmc.training.negatives import cpu_multiplies_bf16

    def cpuinfo(flags: str) -> str:
        path = tmp_path / f"cpuinfo-{len(list(tmp_path.iterdir()))}"
        path.write_text(f"processor\t: 0\nmodel name\t: some CPU\nflags\t\t: fpu sse2 avx2 {flags}\n\nprocessor\t: 1\n")
        return str(path)

    assert cpu_multiplies_bf16(cpuinfo("avx512f amx_bf16 amx_tile"))  # Intel with AMX (Sapphire Rapids on)
    assert cpu_multiplies_bf16(cpuinfo("avx512f avx512_bf16"))  # AVX512-BF16 alone (AMD Zen 4 / 5, Cooper Lake)
    assert not cpu_multiplies_bf16(cpuinfo("avx512f avx512_vnni"))  # AVX-512 without bf16: emulated
    assert not cpu_multiplies_bf16(cpuinfo("avx512_bf16x"))  # a flag is a whole word
    assert not cpu_multiplies_bf16(str(tmp_path / "missing"))


def test_mining_precision_picks_bfloat16_where_the_hardware_runs_it(tiny_encoder_dir, monkeypatch):
    from hf_xmc.training import negatives

    cpu = torch.device("cpu")
    assert negatives.mining_autocast_dtype("float32", cpu) is None
    assert negatives.mining_autocast_dtype("bfloat16", cpu) is torch.bfloat16
    for native in (True, False):
        monkeypatch.setattr(negatives, "cpu_multiplies_bf16", lambda native=native: native)
        assert negatives.mining_autocast_dtype("auto", cpu) is (torch.bfloat16 if native else None)
    with pytest.raises(ValueError, match="mining_precision"):
        negatives.mining_autocast_dtype("fp8", cpu)
    with pytest.raises(ValueError, match="mining_precision"):
        XMCTrainingArguments(output_dir="unused", mining_precision="half")
    # the model's encoding passes under bf16 autocast: float32 vectors near the float32 pass, not equal to it (the
    # autocast took effect), and the model's own precision back after the block, also when it raises
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, max_seq_length=16)
    texts = [f"query number {i} about topic {i % 7}" for i in range(40)]
    full = model.encode_queries(texts)
    with model.encoding_autocast(torch.bfloat16):
        fast = model.encode_queries(texts)
    assert fast.dtype == torch.float32 and not torch.equal(fast, full)
    torch.testing.assert_close(fast, full, atol=3e-2, rtol=0)
    with pytest.raises(RuntimeError), model.encoding_autocast(torch.bfloat16):
        raise RuntimeError("inside")
    assert model.encoding_autocast_dtype is None and torch.equal(model.encode_queries(texts), full)


def test_bf16_default_follows_the_hardware_and_the_steps_run_under_autocast(tiny_encoder_dir, tiny_task, tmp_path, monkeypatch):
    from hf_xmc.training import negatives
    from hf_xmc.training.recipes.dexml import DEXMLModelArguments, DEXMLTrainingArguments
    from hf_xmc.training.script_utils import parse_script_args

    for native in (True, False):  # auto (None): on where the CPU runs bfloat16 in hardware, off elsewhere
        monkeypatch.setattr(negatives, "cpu_multiplies_bf16", lambda native=native: native)
        assert XMCTrainingArguments(output_dir="unused").bf16 is native
        assert XMCTrainingArguments(output_dir="unused", bf16=False).bf16 is False  # an explicit choice wins
        assert XMCTrainingArguments(output_dir="unused", bf16=True).bf16 is True
        assert XMCTrainingArguments(output_dir="unused", bf16="auto").bf16 is native  # "auto" from a JSON config
    monkeypatch.setattr(negatives, "cpu_multiplies_bf16", lambda: True)
    _, task_dir = tiny_task
    contract = ["--model_name_or_path", tiny_encoder_dir, "--train_file", f"{task_dir}/trn.json.gz", "--test_file", f"{task_dir}/tst.json.gz",
                "--label_file", f"{task_dir}/lbl.json.gz", "--output_dir", str(tmp_path / "args")]
    for flags, expected in (([], True), (["--bf16", "false"], False), (["--bf16"], True), (["--bf16", "true"], True), (["--bf16", "auto"], True)):
        assert parse_script_args(DEXMLModelArguments, DEXMLTrainingArguments, contract + flags, method="dexml")[2].bf16 is expected, flags
    with pytest.raises(SystemExit):  # transformers' other None-default bools are not auto switches
        parse_script_args(DEXMLModelArguments, DEXMLTrainingArguments, [*contract, "--tf32", "auto"], method="dexml")

    # what the flag does: the training step's encoder layers run under bfloat16 autocast, and not without it
    seen = {}
    for bf16 in (True, False):
        trainer = make_trainer(tiny_encoder_dir, tiny_task[0], tmp_path / f"bf16-{bf16}", max_steps=1, bf16=bf16)
        layer = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Linear))

        def record(*_, _bf16=bf16) -> None:  # returns None: the layer's output stays as it is
            seen.setdefault(_bf16, (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))

        layer.register_forward_hook(record)
        trainer.train()
    assert seen[True] == (True, torch.bfloat16) and seen[False][0] is False
    # after the run the model is float32 again, called directly or through encode (what it evaluates, predicts and is
    # saved with), and a second trainer on the same model (a method's next module) runs under its own precision
    trainer = make_trainer(tiny_encoder_dir, tiny_task[0], tmp_path / "after", max_steps=1, bf16=True)
    trainer.train()
    after = []
    layer = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Linear))
    hook = layer.register_forward_hook(lambda *_: after.append(torch.is_autocast_enabled("cpu")))  # returns None: output kept
    trainer.model.encode_queries(["a query"])
    batch = trainer.model.tokenizer(["a query"], return_tensors="pt")
    trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert len(after) == 2 and not any(after)
    hook.remove()
    data = tiny_task[0]
    for bf16 in (False, True):
        args = XMCTrainingArguments(output_dir=str(tmp_path / f"second-{bf16}"), max_steps=1, per_device_train_batch_size=32,
                                    save_strategy="no", disable_tqdm=True, bf16=bf16)
        second = XMCTrainer(model=trainer.model, args=args, train_dataset=data.train, label_texts=data.label_texts)
        during = []
        hook = layer.register_forward_hook(lambda *_, during=during: during.append(torch.is_autocast_enabled("cpu")))
        second.train()
        hook.remove()
        assert during and all(d is bf16 for d in during), bf16


def test_propensity_sampling_prefers_tail_labels(tiny_encoder_dir, tiny_task, tmp_path):
    from hf_xmc.training import XMCDataCollator

    data = tiny_task[0]
    tok = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir).tokenizer
    freq = np.asarray(data.train.targets.sum(0)).ravel()
    weights = 1.0 / (freq + 1.0) ** 2  # strongly favours rare labels
    uniform = XMCDataCollator(tok, data.train.texts, data.train.targets, data.label_texts, seed=0)
    tail = XMCDataCollator(tok, data.train.texts, data.train.targets, data.label_texts, seed=0, positive_weights=weights)
    multi = [r for r in range(len(data.train)) if data.train.targets[r].nnz > 1]
    rng_rows = np.array(multi)
    picked_uniform = np.concatenate(uniform.sample_positives(rng_rows, np.random.default_rng(1)))
    picked_tail = np.concatenate(tail.sample_positives(rng_rows, np.random.default_rng(1)))
    assert freq[picked_tail].mean() < freq[picked_uniform].mean()
    with pytest.raises(ValueError, match="positive numbers"):
        XMCDataCollator(tok, data.train.texts, data.train.targets, data.label_texts, positive_weights=np.zeros(len(data.label_texts)))


class StopAt(TrainerCallback):
    """Simulates a killed run: stop right after the checkpoint of ``step``."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = True
            control.should_training_stop = True
        return control


def test_resume_mid_epoch_matches_uninterrupted_run(tiny_encoder_dir, tiny_task, tmp_path):
    data = tiny_task[0]
    engine = dict(num_train_epochs=3, cluster_batching=True, cluster_init_size=8, cluster_curriculum_epochs=[1],
                  cluster_refresh_interval=1, hard_negatives=2, hard_negative_start_epoch=1, hard_negative_top_k=10,
                  save_strategy="steps", save_steps=1000)
    full = make_trainer(tiny_encoder_dir, data, tmp_path / "full", **engine)
    full.train()
    expected = full.evaluate()

    killed = make_trainer(tiny_encoder_dir, data, tmp_path / "resumed", **engine)
    killed.add_callback(StopAt(20))  # 15 steps per epoch: mid-epoch 1, after clustering and mining
    killed.train()
    assert killed.state.global_step == 20
    resumed = make_trainer(tiny_encoder_dir, data, tmp_path / "resumed", **engine)
    torch.manual_seed(123)  # the global RNG must come back from the checkpoint, not from this process's history
    np.random.seed(123)
    resumed.train(resume_from_checkpoint=True)
    got = resumed.evaluate()
    for key in ("eval_P@1", "eval_P@5", "eval_PSP@5", "eval_R@10"):
        assert got[key] == pytest.approx(expected[key], abs=1e-6), key
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


def test_resume_of_a_run_that_reached_max_steps_trains_no_more(tiny_encoder_dir, tiny_task, tmp_path):
    """A run killed after its last checkpoint (max_steps mid-epoch; killed in evaluation or the final save) resumes
    with that checkpoint's weights and step: transformers' loop alone would take one more step before it checks."""
    data = tiny_task[0]
    engine = dict(max_steps=4, save_strategy="steps", save_steps=1000)  # 15 steps per epoch; the last step is saved
    done = make_trainer(tiny_encoder_dir, data, tmp_path / "run", **engine)
    done.train()
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-4"]
    resumed = make_trainer(tiny_encoder_dir, data, tmp_path / "run", seed=1, **engine)  # other initial weights
    result = resumed.train(resume_from_checkpoint=True)
    assert result.global_step == resumed.state.global_step == 4
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-4"]
    for (name, a), (_, b) in zip(done.model.named_parameters(), resumed.model.named_parameters()):
        torch.testing.assert_close(a, b, msg=name)


class _RunsCode:
    """Unpickling this object would create a file: the proof that a pickle was (not) loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_checkpoint_state_is_safetensors_and_json_and_no_pickle_is_loaded(tiny_encoder_dir, tiny_task, tmp_path):
    """The trainer's own checkpoint state (sampler, memory bank, shortlist) is written as safetensors + JSON and read
    back equal; an old-style ``xmc_training_state.pt`` holding a pickle that runs code is refused, and the code does
    not run."""
    from hf_xmc.training.trainer import XMCEpochCallback

    data = tiny_task[0]
    engine = dict(num_train_epochs=2, cluster_batching=True, cluster_init_size=8, cluster_curriculum_epochs=[1],
                  cluster_refresh_interval=1, hard_negatives=2, hard_negative_start_epoch=1, hard_negative_top_k=10,
                  save_strategy="epoch")
    trainer = make_trainer(tiny_encoder_dir, data, tmp_path / "run", **engine)
    trainer.train()
    checkpoint = sorted((tmp_path / "run").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    assert (checkpoint / XMCEpochCallback.STATE_FILE).exists() and (checkpoint / XMCEpochCallback.STATE_META_FILE).exists()
    assert not (checkpoint / XMCEpochCallback.LEGACY_STATE_FILE).exists()
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, XMCEpochCallback))
    state, read = callback.state_dict(), XMCEpochCallback.read_state(str(checkpoint))
    assert read["mined_epoch"] == state["mined_epoch"] == 1
    np.testing.assert_array_equal(read["shortlist"], state["shortlist"])
    torch.testing.assert_close(read["sampler"]["assignment"], state["sampler"]["assignment"])
    assert {k: v for k, v in read["sampler"].items() if k != "assignment"} == {k: v for k, v in state["sampler"].items() if k != "assignment"}
    assert XMCEpochCallback.read_state(str(tmp_path)) is None  # no state: nothing to restore
    # a planted pickle in the old file name is never unpickled
    legacy = tmp_path / "old-checkpoint"
    legacy.mkdir()
    marker = tmp_path / "code-ran"
    torch.save({"mined_epoch": _RunsCode(marker)}, legacy / XMCEpochCallback.LEGACY_STATE_FILE)
    with pytest.raises(ValueError, match="not loaded, it is a pickle"):
        XMCEpochCallback.read_state(str(legacy))
    assert not marker.exists()
    # an old file of plain tensors (what weights_only reads) still resumes
    torch.save({"mined_epoch": None, "sampler": None, "memory_bank": None, "shortlist": None}, legacy / XMCEpochCallback.LEGACY_STATE_FILE)
    assert XMCEpochCallback.read_state(str(legacy))["shortlist"] is None


def test_encoder_dropout_flag_sets_the_backbone_layers_and_keeps_the_adapter_dropout(tiny_encoder_dir, tiny_task, tmp_path):
    data = tiny_task[0]
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, max_seq_length=16)
    batch = model.tokenizer(list(data.test.texts[:4]), padding=True, return_tensors="pt")
    model.train()
    assert not torch.equal(model.embed(**batch), model.embed(**batch))  # the checkpoint's dropout draws masks
    trainer = make_trainer(tiny_encoder_dir, data, tmp_path, encoder_dropout=0.0)
    dropouts = [m for m in trainer.model.encoder.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.p == 0.0 for m in dropouts)
    trainer.model.train()
    torch.testing.assert_close(trainer.model.embed(**batch), trainer.model.embed(**batch), rtol=0, atol=0)
    assert trainer.model.encoder.config.hidden_dropout_prob == 0.1  # nothing of it is saved
    # with a LoRA adapter the adapter's own dropout keeps --lora_dropout
    lora = make_trainer(tiny_encoder_dir, data, tmp_path, encoder_dropout=0.0, peft="lora", lora_r=2, lora_dropout=0.3,
                        lora_target_modules="query")
    named = {n: m.p for n, m in lora.model.encoder.named_modules() if isinstance(m, torch.nn.Dropout)}
    assert {p for n, p in named.items() if "lora_" in n} == {0.3} and {p for n, p in named.items() if "lora_" not in n} == {0.0}
    with pytest.raises(ValueError, match="--encoder_dropout must be in"):
        XMCTrainingArguments(output_dir=str(tmp_path), encoder_dropout=1.0)
