"""MUFIN on the shared engine: the bag collator of both stages, Module II mining, the image-aware evaluator and the
training script contract, on a tiny planted multimodal task (colour patches + words) with tiny random encoders."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from PIL import Image
from transformers import BertTokenizer, DistilBertConfig, DistilBertModel, ViTConfig, ViTImageProcessor, ViTModel

from hf_xmc.data import XMCDataset, load_xc_dataset, write_xc_labels, write_xc_raw
from hf_xmc.models import MUFINModel
from hf_xmc.training import XMCEvaluator
from hf_xmc.training.mufin import MUFINDataCollator, mine_mufin_shortlist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLOURS = [(230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48), (145, 30, 180), (70, 240, 240), (240, 50, 230)]
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()
NUM_LABELS = 12


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """12 labels, each a word + a colour; items show their labels' colour patches and some of their words, so both
    modalities carry signal. Written as XC raw files with image paths, plus tiny random encoders."""
    root = tmp_path_factory.mktemp("mufin_task")
    rng = np.random.default_rng(0)
    label_colour = [COLOURS[i % len(COLOURS)] for i in range(NUM_LABELS)]
    os.makedirs(root / "images")

    def patch(colours, name):
        img = np.zeros((32, 32, 3), dtype=np.uint8)
        for j, c in enumerate(colours):
            img[:, j * 32 // len(colours) : (j + 1) * 32 // len(colours)] = c
        img = np.clip(img.astype(int) + rng.integers(-20, 20, img.shape), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(root / "images" / name)
        return f"images/{name}"

    def split(n, offset):
        texts, rows, images = [], [], []
        for i in range(n):
            labels = sorted(rng.choice(NUM_LABELS, size=int(rng.integers(1, 3)), replace=False).tolist())
            words = [WORDS[label] for label in labels if rng.random() < 0.6] + list(rng.choice(WORDS, 1))
            texts.append(" ".join(words))
            rows.append(labels)
            images.append([os.path.join(str(root), patch([label_colour[label] for label in labels], f"p{offset + i}.png"))])
        targets = sp.csr_matrix((np.ones(sum(map(len, rows)), dtype=np.float32), np.concatenate(rows), np.cumsum([0] + [len(r) for r in rows])), shape=(n, NUM_LABELS))
        return XMCDataset(texts=texts, targets=targets, uids=[f"p{offset + i}" for i in range(n)], images=images)

    write_xc_raw(str(root / "trn.json.gz"), split(160, 0))
    write_xc_raw(str(root / "tst.json.gz"), split(48, 1000))
    write_xc_labels(str(root / "lbl.json.gz"), [f"l{i}" for i in range(NUM_LABELS)], WORDS[:NUM_LABELS])
    text_dir, vision_dir = str(root / "text"), str(root / "vision")
    os.makedirs(text_dir)
    with open(os.path.join(text_dir, "vocab.txt"), "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS) + "\n")
    BertTokenizer(vocab=os.path.join(text_dir, "vocab.txt")).save_pretrained(text_dir)
    torch.manual_seed(0)
    DistilBertModel(DistilBertConfig(vocab_size=len(WORDS) + 5, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64)).save_pretrained(text_dir)
    ViTModel(ViTConfig(image_size=32, patch_size=16, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)).save_pretrained(vision_dir)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(vision_dir)
    data = load_xc_dataset(str(root / "trn.json.gz"), str(root / "tst.json.gz"), str(root / "lbl.json.gz"))
    return data, root, text_dir, vision_dir


def tiny_model(task) -> MUFINModel:
    data, _, text_dir, vision_dir = task
    torch.manual_seed(0)
    model = MUFINModel.from_encoders_pretrained(
        text_dir, vision_dir, label_space_size=NUM_LABELS, embed_dim=8, attention_heads=2, shortlist_size=6, max_seq_length=8, label_max_seq_length=8
    )
    model.set_labels(data.label_texts, data.label_uids)
    return model


def collator(model, data, stage, **kwargs):
    return MUFINDataCollator(
        tokenizer=model.tokenizer, texts=data.train.texts, targets=data.train.targets, label_texts=data.label_texts,
        max_seq_length=8, label_max_seq_length=8, bag_processor=model.prepare_bags, images=data.train.images, stage=stage, **kwargs,
    )


def test_siamese_batch_bags_and_targets(task):
    data, *_ = task
    model = tiny_model(task)
    batch = collator(model, data, "siamese", num_positives=2)([{"index": i} for i in range(8)])
    pool = batch["label_ids"].numpy()
    truth = data.train.targets[:8].toarray() > 0
    assert batch["targets"].numpy().tolist() == truth[:, pool].tolist()  # every positive marked, not only sampled ones
    assert set(pool) == set(np.flatnonzero(truth.any(0)))  # <= 2 labels per item: all of them sampled
    assert batch["pixel_values"].shape[0] == 8 and batch["image_item_index"].tolist() == list(range(8))  # one image each
    assert int(batch["num_items"]) == 8 and int(batch["label_num_items"]) == len(pool)
    assert "label_pixel_values" not in batch and "pair_mask" not in batch  # text-only labels, siamese stage
    out = model(**{k: v for k, v in batch.items() if k != "indices"})
    assert out.loss is not None and out.loss.requires_grad


def test_siamese_batches_over_labels(task):
    """The paper's Module I batches: labels drawn by the sampler, each bringing up to num_positives of its items; the
    items' other labels in the batch are targets too (never in-batch negatives)."""
    data, *_ = task
    model = tiny_model(task)
    label_collator = collator(model, data, "siamese", num_positives=2, batch_over="labels")
    truth = data.train.targets.toarray() > 0
    assert label_collator.anchor_labels.tolist() == np.flatnonzero(truth.any(0)).tolist()
    anchors = label_collator.anchor_label_dataset()
    assert len(anchors) == len(label_collator.anchor_labels)
    assert (anchors.targets.toarray() > 0).tolist() == truth[:, label_collator.anchor_labels].T.tolist()  # row j: items of label j
    batch = label_collator([{"index": j} for j in (5, 0, 3)])
    pool, rows = batch["label_ids"].numpy(), batch["indices"].numpy()
    assert pool.tolist() == sorted(label_collator.anchor_labels[[5, 0, 3]].tolist())
    assert len(rows) <= 2 * 3 and len(set(rows)) == len(rows)
    assert all(truth[rows, label].sum() >= min(2, truth[:, label].sum()) for label in pool)  # its sampled items (+ others')
    assert batch["targets"].numpy().tolist() == truth[rows][:, pool].tolist()
    assert batch["pixel_values"].shape[0] == len(rows) and int(batch["label_num_items"]) == 3
    again = label_collator([{"index": j} for j in (5, 0, 3)])
    assert again["indices"].tolist() == rows.tolist()  # a batch's draw depends on (seed, epoch, its labels) only
    out = model(**{k: v for k, v in batch.items() if k != "indices"})
    assert out.loss is not None and out.loss.requires_grad
    with pytest.raises(ValueError, match="batch_over"):
        collator(model, data, "siamese", batch_over="points")


def test_ranker_batch_pairs_positives_and_shortlist_negatives(task):
    data, *_ = task
    model = tiny_model(task)
    n = len(data.train.texts)
    shortlist = np.stack([np.setdiff1d(np.arange(NUM_LABELS), data.train.targets[r].indices)[:6] for r in range(n)])
    col = collator(model, data, "ranker", num_positives=1, num_negatives=3)
    col.set_shortlist(shortlist)
    rows = list(range(10))
    batch = col([{"index": i} for i in rows])
    pool, pair_mask, targets = batch["label_ids"].numpy(), batch["pair_mask"].numpy(), batch["targets"].numpy()
    for b, r in enumerate(rows):
        chosen = set(pool[pair_mask[b]])
        positives = set(data.train.targets[r].indices)
        assert len(chosen & positives) == 1 and len(chosen - positives) == 3  # |S_i| = 1, |T_i| = 3
        assert chosen - positives <= set(shortlist[r])  # negatives come from the item's shortlist
        assert not targets[b][pair_mask[b]][[p not in positives for p in pool[pair_mask[b]]]].any()
    out = model(**{k: v for k, v in batch.items() if k != "indices"}, stage="ranker")
    assert out.loss is not None and torch.isfinite(out.loss)
    assert (out.logits[~batch["pair_mask"]] == 0).all()  # only the chosen pairs are scored


def test_module_two_shortlist_and_image_aware_evaluation(task):
    data, *_ = task
    model = tiny_model(task)
    shortlist = mine_mufin_shortlist(model, data.train.texts, data.train.images, data.train.targets, top_k=5)
    assert shortlist.shape == (len(data.train.texts), 5)
    for r in range(len(data.train.texts)):
        row = shortlist[r][shortlist[r] >= 0]
        assert not set(row) & set(data.train.targets[r].indices) and len(set(row)) == len(row)
    assert model.label_centroids is not None  # Module II set mu_l
    evaluator = XMCEvaluator(data.test, data.label_texts, data.label_uids, train_targets=data.train.targets, ks=(1, 3), recall_ks=(5,))
    metrics = evaluator(model)
    pred = model.predict(data.test.texts, images=data.test.images, k=3)
    np.testing.assert_array_equal(evaluator.last_predictions, pred.label_ids[:, :3])  # the evaluator used predict with images
    assert 0 <= metrics["test_P@1"] <= 100


def test_lexical_channel_fuses_the_texts_keeps_image_only_items_dense_and_reloads_through_remote_code(task, tmp_path):
    """MUFIN with the lexical channel: the weights tuned on held-out items through MUFIN's own ranking (texts and
    images), items with a text get the channel's fusion of their dense hits, image-only items keep the dense ranking,
    and predict, a reload and remote code without hf_xmc all rank the same way."""
    from hf_xmc.training.lexical import fit_lexical_channel
    from tests.models.test_modeling_common import predict_through_remote_code

    data = task[0]
    model = tiny_model(task)
    model.build_label_index(data.label_texts, data.label_uids)
    channel = fit_lexical_channel(model, data.train, data.label_texts, data.label_uids, validation=data.test.select(np.arange(24)), n_threads=1)
    assert model.lexical_channel is channel and channel.tuning["tuned_on"] == "validation"
    texts = list(data.test.texts[24:28]) + [None] * 4  # four items with a text and an image, four with an image only
    images = data.test.images[24:32]
    scores, ids, dense_scores, dense_ids = model.rank(texts, 5, return_dense=True, images=images)
    np.testing.assert_array_equal(ids[4:], dense_ids[4:])
    np.testing.assert_array_equal(scores[4:], dense_scores[4:])
    model.set_lexical_channel(None)
    deep_scores, deep_ids = model.rank(texts[:4], int(channel.settings["dense_depth"]), images=images[:4])
    np.testing.assert_array_equal(deep_ids[:, :5], dense_ids[:4])  # the dense top 5 is the head of the channel's dense hits
    model.set_lexical_channel(channel)
    want_scores, want_ids = channel.fuse(texts[:4], deep_scores, deep_ids, 5)
    np.testing.assert_array_equal(ids[:4], want_ids)
    np.testing.assert_allclose(scores[:4], want_scores, rtol=1e-6)
    # the channel is in effect on these items (its scores are not the dense ones)
    assert not np.allclose(scores[:4], dense_scores[:4])
    pred = model.predict(texts, k=5, images=images)
    np.testing.assert_array_equal(pred.label_ids, ids)
    model.save_pretrained(tmp_path / "m")
    again = MUFINModel.from_pretrained(tmp_path / "m")
    assert again.lexical_channel is not None
    np.testing.assert_array_equal(again.predict(texts, k=5, images=images).label_ids, ids)
    assert predict_through_remote_code(tmp_path / "m", tmp_path, texts, images=images)["ids"] == ids.tolist()


def script_command(task, out) -> list[str]:
    """``train_mufin.py`` on the tiny task into ``out``, at the tiny model's sizes; the caller adds the budget flags."""
    _, root, text_dir, vision_dir = task
    return [
        sys.executable, os.path.join(ROOT, "training_scripts", "train_mufin.py"),
        "--train_file", str(root / "trn.json.gz"), "--test_file", str(root / "tst.json.gz"), "--label_file", str(root / "lbl.json.gz"),
        "--model_name_or_path", text_dir, "--vision_model_name_or_path", vision_dir, "--output_dir", str(out),
        "--embed_dim", "8", "--attention_heads", "2", "--shortlist_size", "6", "--max_seq_length", "8",
    ]


def test_train_mufin_script_contract(task, tmp_path):
    out = tmp_path / "out"
    cmd = script_command(task, out) + [
        "--siamese_epochs", "3", "--num_train_epochs", "3", "--per_device_train_batch_size", "16",
        "--learning_rate", "2e-3", "--ranker_learning_rate", "2e-3", "--ranker_negatives", "3", "--hard_negative_top_k", "6",
        "--vision_trainable_layers", "-1", "--disable_tqdm", "true", "--use_cpu", "true", "--lexical_channel", "omikuji",
    ]
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "eval_results.json").read_text())
    for key in ("test_P@1", "test_P@3", "test_P@5", "test_nDCG@5", "test_PSP@5", "test_R@10", "train_runtime", "test_samples_per_second"):
        assert key in results, key
    # --lexical_channel: the fused ranking is test_*, MUFIN's own dense ranking test_dense_*, the weights tuned on the validation split
    assert "test_dense_P@1" in results and results["lexical_ranker_weight"] is not None
    assert json.loads((out / "config.json").read_text())["lexical_channel"]["ranker_weight"] == results["lexical_ranker_weight"]
    assert results["test_dense_P@1"] > 100.0 / NUM_LABELS * 1.5  # MUFIN itself learnt something: well above chance
    for name in ("preprocessor_config.json", "config.json", "model.safetensors", "labels.jsonl", "README.md"):
        assert (out / name).exists(), name
    # one embedding space: the saved centroids, bags and index equal those rebuilt from scratch with the saved model
    # (before, the centroids stayed those of the Module-I encoder while the bags came from the final one)
    from hf_xmc.data.splits import split_validation

    data = task[0]
    saved = MUFINModel.from_pretrained(out)
    rebuilt = MUFINModel.from_pretrained(out)
    held_out = saved.config.validation  # the channel's validation split, carved from the training file: not in the centroids
    trained_on = split_validation(data.train, held_out["queries"], held_out["seed"])[0]
    assert held_out["training_queries"] == len(trained_on) < len(data.train)
    rebuilt.compute_label_centroids(trained_on.texts, trained_on.images, trained_on.targets)
    rebuilt.build_label_index()
    torch.testing.assert_close(saved.label_centroids, rebuilt.label_centroids, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(saved.label_centroid_counts, rebuilt.label_centroid_counts)
    torch.testing.assert_close(saved.label_vectors, rebuilt.label_vectors, atol=1e-5, rtol=1e-5)
    saved_rows, saved_owners = saved.shortlist_vectors()
    rebuilt_rows, rebuilt_owners = rebuilt.shortlist_vectors()
    torch.testing.assert_close(saved_rows, rebuilt_rows, atol=1e-5, rtol=1e-5)
    assert torch.equal(saved_owners, rebuilt_owners)
    queries = saved.encode_items(data.test.texts, data.test.images)
    np.testing.assert_array_equal(saved.shortlist(queries)[0], rebuilt.shortlist(queries)[0])
    # text-only query vectors as numpy on request, as the text methods' encode_queries (sentence-transformers' rule)
    as_numpy = saved.encode_queries(data.test.texts[:3], convert_to_numpy=True)
    assert isinstance(as_numpy, np.ndarray) and as_numpy.dtype == np.float32
    np.testing.assert_array_equal(as_numpy, saved.encode_queries(data.test.texts[:3]).numpy())


def test_single_modality_ablations_strip_the_points_only(task):
    from hf_xmc.training.recipes.mufin import keep_modalities

    data, *_ = task
    text_only = keep_modalities(data, "text")
    assert text_only.train.images is None and text_only.test.texts == data.test.texts
    image_only = keep_modalities(data, "image")
    assert set(image_only.train.texts) == {""} and image_only.test.images == data.test.images
    assert image_only.label_texts == data.label_texts  # labels keep their descriptors
    with pytest.raises(ValueError, match="item_modalities"):
        keep_modalities(data, "audio")


def test_ranker_learning_rates_and_no_decay_on_label_tables(task, tmp_path):
    from hf_xmc.training import XMCTrainer, XMCTrainingArguments

    data, *_ = task
    model = tiny_model(task)
    args = XMCTrainingArguments(str(tmp_path), learning_rate=1e-4, weight_decay=0.01, use_cpu=True)
    trainer = XMCTrainer(model=model, args=args, train_dataset=data.train, data_collator=collator(model, data, "siamese"))
    optimizer = trainer.create_optimizer()
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    eta, alpha = model.classifier.free_vectors.weight, model.classifier.alpha_logits
    assert group_of[id(eta)]["lr"] == pytest.approx(1e-2) and group_of[id(eta)]["weight_decay"] == 0.0
    assert group_of[id(alpha)]["weight_decay"] == 0.0
    cross = next(p for n, p in model.named_parameters() if n.startswith("cross_attention.") and p.requires_grad)
    assert group_of[id(cross)]["lr"] == pytest.approx(1e-3)
    text = next(p for n, p in model.named_parameters() if n.startswith("encoder.") and p.requires_grad)
    assert group_of[id(text)]["lr"] == pytest.approx(1e-4)


def test_vision_learning_rate_multiplier(task, tmp_path):
    from hf_xmc.training import XMCTrainer, XMCTrainingArguments

    data, *_ = task
    model = tiny_model(task)
    model.freeze_vision_layers(-1)
    args = XMCTrainingArguments(str(tmp_path), learning_rate=1e-4, use_cpu=True)

    def vision_and_text_rates():
        trainer = XMCTrainer(model=model, args=args, train_dataset=data.train, data_collator=collator(model, data, "siamese"))
        group_of = {id(p): g["lr"] for g in trainer.create_optimizer().param_groups for p in g["params"]}
        rates = {round(group_of[id(p)], 12) for n, p in model.named_parameters() if n.startswith("vision_encoder.")}
        return rates, round(group_of[id(next(model.encoder.parameters()))], 12)

    assert vision_and_text_rates() == ({1e-4}, 1e-4)  # default: the text encoder's rate
    model.vision_learning_rate_multiplier = 10.0
    assert vision_and_text_rates() == ({1e-3}, 1e-4)


def test_default_vision_tower_is_a_small_resnet(task):
    """Without a vision checkpoint the tower is a small ResNet built at random: its pooled (N, C, 1, 1) output becomes
    one D-vector per image, and freezing keeps its last stage (the ResNet's "layers") trainable."""
    data, _, text_dir, _ = task
    torch.manual_seed(0)
    model = MUFINModel.from_encoders_pretrained(text_dir, label_space_size=NUM_LABELS, embed_dim=8, attention_heads=2, max_seq_length=8)
    assert model.config.vision_config.model_type == "resnet"
    bags = model.prepare_bags(texts=["alpha", None], images=[[data.train.images[0][0]], [data.train.images[1][0], data.train.images[2][0]]])
    assert bags["pixel_values"].shape == (3, 3, 64, 64)  # resized to the default tower's 64 x 64
    assert model.image_descriptors(bags["pixel_values"]).shape == (3, 8)
    _, mask, vectors = model.embed_bags(**bags)
    assert mask.tolist() == [[True, True], [True, True]] and vectors.shape == (2, 8)
    trainable = model.freeze_vision_layers(1)
    last_stage = len(model.config.vision_config.depths) - 1
    assert trainable and all(name.startswith(f"encoder.stages.{last_stage}.") for name in trainable)
    assert len(model.freeze_vision_layers(-1)) == len(list(model.vision_encoder.parameters()))


def test_points_without_descriptors_in_an_ablation(task):
    import dataclasses

    from hf_xmc.training.recipes.mufin import keep_modalities

    data, *_ = task
    blank = lambda split: dataclasses.replace(split, texts=[""] + list(split.texts[1:]))  # noqa: E731
    text_only = keep_modalities(dataclasses.replace(data, train=blank(data.train), test=blank(data.test)), "text")
    assert len(text_only.train) == len(data.train) - 1 and text_only.train.texts == data.train.texts[1:]  # dropped
    assert len(text_only.test) == len(data.test)  # kept, and counted as a miss
    model = tiny_model(task)
    evaluator = XMCEvaluator(text_only.test, data.label_texts, data.label_uids, ks=(1,), recall_ks=(3,))
    evaluator(model)
    assert (evaluator.last_predictions[0] == -1).all() and (evaluator.last_predictions[1:] >= 0).all()


def test_train_mufin_on_text_only_data_with_the_contract_arguments_only(tiny_task, tiny_encoder_dir, tmp_path):
    """The training script contract names no vision encoder: on text-only data MUFIN builds its small default tower and
    trains on the texts (every training script is run this way on held-out data)."""
    _, data_dir = tiny_task
    out = tmp_path / "out"
    cmd = [
        sys.executable, os.path.join(ROOT, "training_scripts", "train_mufin.py"),
        "--train_file", f"{data_dir}/trn.json.gz", "--test_file", f"{data_dir}/tst.json.gz", "--label_file", f"{data_dir}/lbl.json.gz",
        "--model_name_or_path", tiny_encoder_dir, "--output_dir", str(out),
        "--num_train_epochs", "1", "--per_device_train_batch_size", "32", "--max_seq_length", "16", "--seed", "1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "eval_results.json").read_text())
    assert all(0 <= results[k] <= 100 for k in ("test_P@1", "test_PSP@5", "test_R@100"))
    model = MUFINModel.from_pretrained(out)
    assert model.config.vision_config.model_type == "resnet"  # the default small tower, built at random ...
    assert model.config.vision_trainable_layers == -1  # ... and trained whole, not frozen at its random weights
    assert model.image_processor.size == {"height": 64, "width": 64}
    pred = model.predict(["a query"], k=5)
    assert pred.label_ids.shape == (1, 5)


def test_loads_and_predicts_texts_without_an_image_backend(task, tmp_path, monkeypatch):
    """Remote code must load with torch + transformers only: without Pillow the image processor cannot load, texts
    still predict, images give a clear error."""
    import hf_xmc.models.modeling_mufin as modeling_mufin

    data, *_ = task
    model = tiny_model(task)
    model.build_label_index(data.label_texts, data.label_uids)
    model.save_pretrained(tmp_path / "m")
    expected = model.predict(data.test.texts[:4], k=3)

    def no_pillow(*args, **kwargs):
        raise ImportError("ViTImageProcessor requires the PIL library")

    monkeypatch.setattr(modeling_mufin.AutoImageProcessor, "from_pretrained", no_pillow)
    reloaded = MUFINModel.from_pretrained(tmp_path / "m")
    assert reloaded.image_processor is None
    np.testing.assert_array_equal(reloaded.predict(data.test.texts[:4], k=3).label_ids, expected.label_ids)
    with pytest.raises(ImportError, match="PIL"):
        reloaded.predict(["x"], images=[data.test.images[0]], k=3)


@pytest.mark.slow
def test_train_mufin_resumes_after_kill_to_the_same_metrics(task, tmp_path):
    """Killed (SIGKILL) after Module IV's first checkpoint, the resumed run reads Module I back and ends with the
    uninterrupted run's metrics."""
    from tests.test_reliability import assert_same_metrics, run_killed_and_resumed

    _, root, text_dir, vision_dir = task
    out = str(tmp_path / "out")
    cmd = [
        sys.executable, os.path.join(ROOT, "training_scripts", "train_mufin.py"),
        "--train_file", str(root / "trn.json.gz"), "--test_file", str(root / "tst.json.gz"), "--label_file", str(root / "lbl.json.gz"),
        "--model_name_or_path", text_dir, "--vision_model_name_or_path", vision_dir, "--output_dir", out,
        "--embed_dim", "8", "--attention_heads", "2", "--shortlist_size", "6", "--max_seq_length", "8",
        "--siamese_epochs", "1", "--num_train_epochs", "2", "--per_device_train_batch_size", "16", "--save_strategy", "epoch",
        "--learning_rate", "2e-3", "--ranker_learning_rate", "2e-3", "--ranker_negatives", "3", "--hard_negative_top_k", "6",
        "--vision_trainable_layers", "-1", "--disable_tqdm", "true", "--use_cpu", "true", "--report_to", "none",
    ]
    results = run_killed_and_resumed(cmd, out, str(tmp_path / "reference"))
    assert_same_metrics(results)
    assert f"resuming from {out}/checkpoint-" in results["log"] and "the stage finished before; its weights are read back" in results["log"]


def test_module_one_gets_its_own_step_budget(tmp_path):
    """--siamese_max_steps bounds Module I and leaves --max_steps to Module IV; without it --max_steps bounds both
    (the training-script contract's short runs stay short); 0 is refused."""
    from hf_xmc.training.recipes.mufin import MUFINTrainingArguments, _stage_args

    args = MUFINTrainingArguments(output_dir=str(tmp_path), max_steps=5, siamese_max_steps=40, use_cpu=True)
    siamese, ranker = _stage_args(args, "siamese"), _stage_args(args, "ranker")
    assert (siamese.max_steps, ranker.max_steps) == (40, 5) and siamese.output_dir == str(tmp_path / "module1")
    args = MUFINTrainingArguments(output_dir=str(tmp_path), max_steps=5, use_cpu=True)
    assert (_stage_args(args, "siamese").max_steps, _stage_args(args, "ranker").max_steps) == (5, 5)
    args = MUFINTrainingArguments(output_dir=str(tmp_path), siamese_max_steps=-1, siamese_epochs=1.5, max_steps=5, use_cpu=True)
    assert (_stage_args(args, "siamese").max_steps, _stage_args(args, "siamese").num_train_epochs) == (-1, 1.5)
    with pytest.raises(ValueError, match="--siamese_max_steps must be -1"):
        MUFINTrainingArguments(output_dir=str(tmp_path), siamese_max_steps=0, use_cpu=True)


def test_ranker_stage_reads_the_pool_from_the_ranker_label_cache(task):
    """--ranker_label_side cache: the batch carries the pool's ids only, and the model's scores from its cached Z^1 /
    z^1 equal those of the same batch with the label bags encoded in it (eval mode: the cache is encoded without
    dropout); an empty cache is a clear error; the loss still trains the query side and the classifiers."""
    data, *_ = task
    model = tiny_model(task).eval()
    n = len(data.train.texts)
    shortlist = np.stack([np.setdiff1d(np.arange(NUM_LABELS), data.train.targets[r].indices)[:6] for r in range(n)])
    full, cached = (collator(model, data, "ranker", num_positives=1, num_negatives=3, cached_label_bags=c) for c in (False, True))
    for col in (full, cached):
        col.set_shortlist(shortlist)
    features = [{"index": i} for i in range(12)]
    full_batch, cached_batch = full(features), cached(features)
    assert not any(key.startswith("label_") and key != "label_ids" for key in cached_batch)  # nothing of the labels to encode
    assert torch.equal(full_batch["label_ids"], cached_batch["label_ids"]) and torch.equal(full_batch["pair_mask"], cached_batch["pair_mask"])
    inputs = {k: v for k, v in cached_batch.items() if k != "indices"}
    with pytest.raises(ValueError, match="cache_ranker_labels"):
        model(**inputs, stage="ranker")
    model.cache_ranker_labels()
    with torch.no_grad():
        expected = model(**{k: v for k, v in full_batch.items() if k != "indices"}, stage="ranker")
        got = model(**inputs, stage="ranker")
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)
    model.train()
    model(**inputs, stage="ranker").loss.backward()
    grad = model.classifier.free_vectors.weight.grad
    assert (grad.to_dense() if grad.is_sparse else grad).abs().sum() > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.cross_attention.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.encoder.parameters())  # through the queries


def test_label_refresh_callback_keeps_the_cache_through_weight_updates_and_re_encodes_it_on_schedule(task):
    """MUFINLabelRefreshCallback takes Module II's store when the stage begins (no second encoding), keeps it while the
    trainer invalidates the store at every step, re-encodes it every N steps (not at the stage's last step, which
    the centroid refresh follows), drops it when the stage ends, and refuses a negative schedule."""
    from types import SimpleNamespace

    from hf_xmc.training.mufin import MUFINLabelRefreshCallback

    model = tiny_model(task)
    model.encode_label_bags()  # what Module II leaves
    store = model.label_vectors
    callback = MUFINLabelRefreshCallback(refresh_steps=3)
    args, control = SimpleNamespace(disable_tqdm=True), SimpleNamespace()
    callback.on_train_begin(args, SimpleNamespace(global_step=0, max_steps=9), control, model=model)
    assert model.ranker_label_cache[2] is store  # taken as it is, not encoded again
    with torch.no_grad():
        for p in model.encoder.parameters():
            p.add_(0.05 * torch.randn_like(p))
    for step in (1, 2):
        model.invalidate_label_index()  # what XMCTrainer.compute_loss does before every step
        callback.on_step_end(args, SimpleNamespace(global_step=step, max_steps=9), control, model=model)
    assert model.ranker_label_cache[2] is store and callback.refreshes == 0
    callback.on_step_end(args, SimpleNamespace(global_step=3, max_steps=9), control, model=model)
    assert callback.refreshes == 1 and not torch.allclose(model.ranker_label_cache[2], store)
    torch.testing.assert_close(model.ranker_label_cache[2], model.encode_items(model.label_texts, model.label_images))
    callback.on_step_end(args, SimpleNamespace(global_step=9, max_steps=9), control, model=model)
    assert callback.refreshes == 1  # the last step: the centroid callback re-encodes everything after it
    callback.on_train_end(args, SimpleNamespace(global_step=9, max_steps=9), control, model=model)
    assert model.ranker_label_cache is None
    fresh = tiny_model(task)  # a resumed stage: no store left by Module II, the cache is encoded
    callback.on_train_begin(args, SimpleNamespace(global_step=0, max_steps=9), control, model=fresh)
    torch.testing.assert_close(fresh.ranker_label_cache[2], fresh.encode_items(fresh.label_texts, fresh.label_images))
    with pytest.raises(ValueError, match="refresh_steps"):
        MUFINLabelRefreshCallback(refresh_steps=-1)


def test_ranker_label_cache_survives_the_same_labels_attached_again(task):
    """The Module IV trainer attaches the run's labels once more (set_labels): the cache of Module II's encoding stays
    for the same texts and images, and goes when the labels differ (other images, none, another text)."""
    data, *_ = task
    model = tiny_model(task)
    model.set_labels(data.label_texts, data.label_uids, list(data.train.images[:NUM_LABELS]))
    model.cache_ranker_labels()
    cache = model.ranker_label_cache
    model.set_labels(list(data.label_texts), data.label_uids, list(data.train.images[:NUM_LABELS]))  # the same labels again
    assert model.ranker_label_cache is cache
    for texts, images in (
        (data.label_texts, list(data.train.images[1 : NUM_LABELS + 1])),  # other images
        (data.label_texts, None),  # the images dropped
        (["x"] + list(data.label_texts[1:]), None),  # another text
    ):
        model.cache_ranker_labels()
        model.set_labels(texts, data.label_uids, images)
        assert model.ranker_label_cache is None


def test_train_mufin_with_the_cached_label_side(tiny_task, tiny_encoder_dir, tmp_path):
    """--ranker_label_side cache through the script: Module IV trains from the cache through the trainer (whose steps
    invalidate the label store), re-encodes it on schedule, and the saved model predicts as its evaluation did."""
    _, data_dir = tiny_task
    out = tmp_path / "out"
    cmd = [
        sys.executable, os.path.join(ROOT, "training_scripts", "train_mufin.py"),
        "--train_file", f"{data_dir}/trn.json.gz", "--test_file", f"{data_dir}/tst.json.gz", "--label_file", f"{data_dir}/lbl.json.gz",
        "--model_name_or_path", tiny_encoder_dir, "--output_dir", str(out), "--num_train_epochs", "2", "--per_device_train_batch_size", "32",
        "--max_seq_length", "16", "--seed", "1", "--ranker_label_side", "cache", "--ranker_label_refresh_steps", "10", "--disable_tqdm", "true",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("label bags re-encoded at step") == 2  # steps 10 and 20 of 30 (the run logs to stdout)
    assert "no cached label bags yet" not in proc.stdout  # Module II's encoding was kept for Module IV, not done again
    results = json.loads((out / "eval_results.json").read_text())
    assert results["test_P@1"] > 100.0 / 40 * 2  # well above chance on the tiny task's 40 labels
    data = load_xc_dataset(f"{data_dir}/trn.json.gz", f"{data_dir}/tst.json.gz", f"{data_dir}/lbl.json.gz")
    model = MUFINModel.from_pretrained(out)
    assert model.ranker_label_cache is None
    from hf_xmc.metrics import xmc_metrics

    predicted = model.predict(data.test.texts, k=5)
    assert xmc_metrics(predicted.label_ids, data.test.targets, ks=(1,))["P@1"] == pytest.approx(results["test_P@1"], abs=1e-6)
    from hf_xmc.training.recipes.mufin import MUFINTrainingArguments

    for bad, message in (({"ranker_label_side": "store"}, "--ranker_label_side must be"), ({"ranker_label_refresh_steps": -1}, "--ranker_label_refresh_steps must be")):
        with pytest.raises(ValueError, match=message):
            MUFINTrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, **bad)


def test_ranker_label_side_auto_caches_from_ten_thousand_labels(tmp_path):
    """--ranker_label_side auto: the cached label side on large label spaces, the paper's end-to-end one on small."""
    from hf_xmc.training.recipes.mufin import RANKER_CACHE_MIN_LABELS, MUFINTrainingArguments, resolve_ranker_label_side

    assert RANKER_CACHE_MIN_LABELS == 10_000
    assert [resolve_ranker_label_side("auto", n) for n in (90, 9_999, 10_000, 1_300_000)] == ["encoder", "encoder", "cache", "cache"]
    assert [resolve_ranker_label_side(side, 1_300_000) for side in ("encoder", "cache")] == ["encoder", "cache"]
    assert MUFINTrainingArguments(output_dir=str(tmp_path), use_cpu=True, ranker_label_side="auto").ranker_label_side == "auto"


def test_module_two_shortlists_leave_out_the_training_filter_pairs(task, tmp_path):
    """--train_filter_file pairs are never Module IV negatives: the recipe's Module II removes them from the shortlists
    beside the positives (before, only the positives were removed: a filtered pair ranked first stayed first)."""
    from hf_xmc.training.recipes.mufin import MUFINTrainingArguments, pretrain_and_mine

    data, *_ = task
    unfiltered = mine_mufin_shortlist(tiny_model(task), data.train.texts, data.train.images, data.train.targets, top_k=5)
    # the filter: each item's best-ranked negative, the pair an LF dataset's own-label text would be
    rows = np.arange(len(data.train.texts))
    train_filter = sp.csr_matrix((np.ones(len(rows), dtype=bool), (rows, unfiltered[:, 0])), shape=data.train.targets.shape)
    filtered_data = dataclasses.replace(data, train=dataclasses.replace(data.train, filter_matrix=train_filter))
    args = MUFINTrainingArguments(output_dir=str(tmp_path), siamese_epochs=0, hard_negative_top_k=5, use_cpu=True, disable_tqdm=True)
    shortlist = pretrain_and_mine(tiny_model(task), filtered_data, args).shortlist
    assert not (shortlist == unfiltered[:, :1]).any()  # no filtered pair anywhere in a shortlist
    for r in rows:  # the rest keeps its order: the unfiltered shortlist without its filtered label
        assert shortlist[r][:4].tolist() == unfiltered[r][1:].tolist()
        assert not set(shortlist[r]) & set(data.train.targets[r].indices)


def test_train_mufin_refuses_to_resume_on_another_training_filter(task, tmp_path):
    """A checkpoint records what its shortlists were mined from (targets, training filter); a run resumed from it
    with another --train_filter_file is refused in one line (exit 2) instead of drawing negatives from them."""
    out = tmp_path / "out"
    cmd = script_command(task, out) + [
        "--siamese_epochs", "1", "--num_train_epochs", "2", "--per_device_train_batch_size", "32", "--save_strategy", "epoch",
        "--ranker_negatives", "3", "--hard_negative_top_k", "6", "--vision_trainable_layers", "-1",
        "--disable_tqdm", "true", "--use_cpu", "true", "--report_to", "none", "--score_calibration", "none",
    ]
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, stdin=subprocess.DEVNULL)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = sorted((p for p in out.iterdir() if p.name.startswith("checkpoint-")), key=lambda p: int(p.name.split("-")[1]))
    assert len(checkpoints) == 2 and all((p / "mufin_shortlist.json").exists() for p in checkpoints)
    shutil.rmtree(checkpoints[-1])  # as if killed during the second epoch: the resume starts from the first
    (out / "eval_results.json").unlink()
    filter_file = tmp_path / "filter_labels_train.txt"
    filter_file.write_text("0 3\n5 7\n")
    resumed = subprocess.run(cmd + ["--resume_from_checkpoint", "true", "--train_filter_file", str(filter_file)],
                             capture_output=True, text=True, env=env, timeout=600, stdin=subprocess.DEVNULL)
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    last = resumed.stderr.strip().splitlines()[-1]
    assert last.startswith("train_mufin: error: ") and "training shortlists were made from other train_filter" in last and "refused" in last
    assert "Traceback" not in resumed.stderr and not (out / "eval_results.json").exists()


def test_added_and_removed_labels_carry_the_lexical_channel_through_save_and_reload(task, tmp_path):
    """add_labels / remove_labels on a MUFIN model with a lexical channel (the path of ``hf-xmc add-labels``): the
    channel gets the new labels' text rows (before, a retrieved new label raised in the channel and the saved model no
    longer reloaded), removing a label renumbers the kept labels' rows with them (before, a kept label got the removed
    one's text score), and the grown and shrunk models reload with equal outputs."""
    from hf_xmc.training.lexical import fit_lexical_channel

    data = task[0]
    queries = list(data.test.texts[:12])

    base = tiny_model(task)
    base.build_label_index(data.label_texts, data.label_uids)
    fit_lexical_channel(base, data.train, data.label_texts, data.label_uids, validation=data.test.select(np.arange(24, 48)), n_threads=1)
    base.config.shortlist_size = NUM_LABELS + 2  # every label is shortlisted: the new ones are always retrieved
    base.save_pretrained(tmp_path / "base")  # one channel (its ranker is not bit-reproducible) for both arms below

    def with_channel():
        return MUFINModel.from_pretrained(tmp_path / "base")

    model = with_channel()
    new_texts = ["alpha kilo lima", "bravo juliet"]
    assert model.add_labels(new_texts, uids=["n1", "n2"]).tolist() == [NUM_LABELS, NUM_LABELS + 1]
    assert model.lexical_channel.num_labels == NUM_LABELS + 2
    grown = model.predict(queries, k=NUM_LABELS + 2)
    assert (grown.label_ids >= NUM_LABELS).any(axis=1).all()  # the new labels are ranked (and fused) for every query
    model.save_pretrained(tmp_path / "grown")
    reloaded = MUFINModel.from_pretrained(tmp_path / "grown")
    assert reloaded.lexical_channel is not None and reloaded.lexical_channel.num_labels == NUM_LABELS + 2
    again = reloaded.predict(queries, k=NUM_LABELS + 2)
    np.testing.assert_array_equal(again.label_ids, grown.label_ids)
    np.testing.assert_allclose(again.scores, grown.scores, rtol=1e-5, atol=1e-6)
    # removing the first added label: the second (now id 12) keeps its own text row, as if only it had been added
    assert reloaded.remove_labels(["n1"]).tolist() == [*range(NUM_LABELS), NUM_LABELS + 1]
    reference = with_channel()
    reference.add_labels(new_texts[1:], uids=["n2"])
    want = reference.predict(queries, k=NUM_LABELS + 1)
    shrunk = reloaded.predict(queries, k=NUM_LABELS + 1)
    np.testing.assert_array_equal(shrunk.label_ids, want.label_ids)
    np.testing.assert_allclose(shrunk.scores, want.scores, rtol=1e-5, atol=1e-6)
    reloaded.save_pretrained(tmp_path / "shrunk")
    final = MUFINModel.from_pretrained(tmp_path / "shrunk").predict(queries, k=NUM_LABELS + 1)
    np.testing.assert_array_equal(final.label_ids, want.label_ids)
    np.testing.assert_allclose(final.scores, want.scores, rtol=1e-5, atol=1e-6)


REMOTE_THRESHOLD = """
import json, sys
sys.modules["hf_xmc"] = None  # the model's own files only
from transformers import AutoModel
model = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True)
request = json.loads(sys.argv[2])
try:
    model.predict(request["texts"], k=5, images=request["images"], threshold=0.5)
    print("RESULT " + json.dumps({"error": None}))
except ValueError as err:
    print("RESULT " + json.dumps({"error": str(err)}))
"""


def test_image_only_items_get_no_probability_from_the_fused_ranking_calibration(task, tmp_path):
    """With a lexical channel the score calibration maps the fused ranking's scores; image-only items are ranked
    without the channel, so their probabilities are NaN and threshold= with one of them is refused in one line (before,
    the fused map was applied to their dense scores), in process and after a reload through remote code."""
    from hf_xmc.models.calibration import ScoreCalibration
    from hf_xmc.training.lexical import fit_lexical_channel
    from tests.models.test_modeling_common import predict_through_remote_code

    data = task[0]
    model = tiny_model(task)
    model.build_label_index(data.label_texts, data.label_uids)
    fit_lexical_channel(model, data.train, data.label_texts, data.label_uids, validation=data.test.select(np.arange(24)), n_threads=1)
    calibration = ScoreCalibration("platt", a=4.0, b=-1.0)
    model.set_score_calibration(calibration)
    texts, images = list(data.test.texts[24:27]) + [None, None], data.test.images[24:29]  # three with a text, two image-only
    pred = model.predict(texts, k=5, images=images)
    assert np.isnan(pred.probabilities[3:]).all() and np.isfinite(pred.probabilities[:3]).all()
    np.testing.assert_allclose(pred.probabilities[:3], np.where(pred.label_ids[:3] >= 0, calibration(pred.scores[:3]), 0.0), rtol=1e-6)
    assert model.unfused_items(texts, images).tolist() == [False, False, False, True, True]
    with pytest.raises(ValueError, match=r"^threshold: item 3 has no text, so it is ranked without the lexical channel") as err:
        model.predict(texts, k=5, images=images, threshold=0.5)
    assert "\n" not in str(err.value)
    kept = model.predict(texts[:3], k=5, images=images[:3], threshold=0.5)  # items with a text: thresholded as before
    assert (kept.probabilities[kept.label_ids >= 0] >= 0.5).all()
    model.set_lexical_channel(None)  # without the channel every item gets the ranking the map is for... once refitted
    model.set_score_calibration(calibration)
    assert np.isfinite(model.predict(texts, k=5, images=images).probabilities).all()
    model.set_lexical_channel(fit_lexical_channel(model, data.train, data.label_texts, data.label_uids, validation=data.test.select(np.arange(24)), n_threads=1))
    model.set_score_calibration(calibration)
    model.save_pretrained(tmp_path / "m")
    reloaded = MUFINModel.from_pretrained(tmp_path / "m")
    assert np.isnan(reloaded.predict(texts, k=5, images=images).probabilities[3:]).all()
    remote = predict_through_remote_code(tmp_path / "m", tmp_path, texts, images=images)
    assert np.isnan(np.array(remote["probabilities"])[3:]).all() and np.isfinite(np.array(remote["probabilities"])[:3]).all()
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", PYTHONPATH="")
    proc = subprocess.run([sys.executable, "-c", REMOTE_THRESHOLD, str(tmp_path / "m"), json.dumps({"texts": texts, "images": images})],
                          capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    error = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][0][7:])["error"]
    assert error is not None and error.startswith("threshold: item 3 has no text")


def test_a_prediction_under_another_search_mode_gets_no_probability_from_the_calibration(task):
    """MUFIN's predict takes a search_mode per call; the calibration was fitted on config.search_mode's scores, so a
    call in another mode gets no probabilities, and a threshold is refused in one line (before, the map was applied)."""
    from hf_xmc.models.calibration import ScoreCalibration
    from hf_xmc.models.configuration_mufin import MUFIN_SEARCH_MODES

    data = task[0]
    model = tiny_model(task)
    model.build_label_index(data.label_texts, data.label_uids)
    model.set_score_calibration(ScoreCalibration("platt", a=4.0, b=-1.0))
    texts, images = list(data.test.texts[:3]), data.test.images[:3]
    assert model.predict(texts, k=5, images=images).probabilities is not None
    other = next(mode for mode in MUFIN_SEARCH_MODES if mode != model.config.search_mode)
    assert model.predict(texts, k=5, images=images, search_mode=other).probabilities is None
    with pytest.raises(ValueError, match=rf"^threshold: the score calibration was fitted on the {model.config.search_mode!r} ranking, not on {other!r}"):
        model.predict(texts, k=5, images=images, search_mode=other, threshold=0.5)
    assert model.predict(texts, k=5, images=images, search_mode=model.config.search_mode, threshold=0.0).probabilities is not None


def test_the_calibration_fit_leaves_out_items_ranked_without_the_channel(task):
    """A calibration fitted with a lexical channel maps the fused ranking; validation items without a text (ranked
    without the channel) are not fitted on (before, their dense scores were pooled with the fused ones)."""
    import dataclasses

    from hf_xmc.training.calibration import fit_score_calibration
    from hf_xmc.training.evaluation import XMCEvaluator
    from hf_xmc.training.lexical import fit_lexical_channel

    data = task[0]
    model = tiny_model(task)
    model.build_label_index(data.label_texts, data.label_uids)
    fit_lexical_channel(model, data.train, data.label_texts, data.label_uids, validation=data.test.select(np.arange(24)), n_threads=1)
    validation = data.test.select(np.arange(24, 48))
    texts = list(validation.texts)
    texts[:6] = [""] * 6  # six image-only items
    validation = dataclasses.replace(validation, texts=texts)
    evaluator = XMCEvaluator(validation, data.label_texts, data.label_uids, train_targets=data.train.targets, name="eval",
                             label_images=data.label_images)
    calibration = fit_score_calibration(model, evaluator, "isotonic", depth=5)
    assert model.unfused_items(texts, validation.images).sum() == 6
    assert calibration.info["queries"] == 18
    ids, _, _ = evaluator.predict(model)
    assert calibration.info["pairs"] == int((ids[6:, :5] >= 0).sum())  # the 18 fused items' ranks only


def test_modality_subset_metrics_score_the_rows_that_carry_each_modality(task):
    """The metrics over the test points with a text / with an image are the same ranking's rows of those points, with
    the evaluator's propensities; a modality no point carries gives its count (0) and no metric."""
    from hf_xmc.metrics import xmc_metrics
    from hf_xmc.training.recipes.mufin import modality_subset_metrics

    data = task[0]
    n = len(data.test)
    texts, images = list(data.test.texts), list(data.test.images)
    texts[:10] = [""] * 5 + [" "] * 5  # ten points without text (a blank text is a missing one)
    images[5:20] = [[]] * 15  # fifteen without an image, five of them without text too
    points = dataclasses.replace(data.test, texts=texts, images=images)
    evaluator = XMCEvaluator(data.test, data.label_texts, data.label_uids, train_targets=data.train.targets)
    truth = data.test.targets.tocsr()
    ranking = np.tile(np.arange(5), (n, 1))
    ranking[::2, 0] = [truth.indices[truth.indptr[i]] for i in range(0, n, 2)]  # every other point: a hit at rank 1
    evaluator.last_predictions = ranking
    out = modality_subset_metrics(evaluator, points, "text,image")
    with_text, with_image = np.arange(10, n), np.r_[0:5, 20:n]
    assert out["test_points_with_text"] == len(with_text) and out["test_points_with_image"] == len(with_image)
    for name, rows in (("text", with_text), ("image", with_image)):
        hits = sum(int(truth[i, ranking[i, 0]] > 0) for i in rows)
        assert out[f"test_with_{name}_P@1"] == pytest.approx(100.0 * hits / len(rows))
        expected = xmc_metrics(ranking[rows], truth[rows], evaluator.inv_propensity, ks=(1, 3, 5), recall_ks=())
        assert {k: out[f"test_with_{name}_{k}"] for k in expected} == pytest.approx(expected)
    assert set(modality_subset_metrics(evaluator, points, "text")) == {k for k in out if "text" in k}
    no_images = modality_subset_metrics(evaluator, dataclasses.replace(points, images=None), "image")
    assert no_images == {"test_points_with_image": 0}


def test_text_only_ablation_reports_its_metrics_on_the_test_points_with_text(task, tmp_path, monkeypatch):
    """Issue 65: the text-only ablation cannot hit a test point without text (it gets no prediction), so besides
    test_P@1 over all points eval_results.json holds test_with_text_* over the points with a text in the data: the
    rows of the same ranking, with the propensities of every training point (the one without text included)."""
    from hf_xmc.data import write_xc_raw
    from hf_xmc.metrics import inverse_propensity, xmc_metrics
    from hf_xmc.training.recipes import mufin as recipe

    data, root, *_ = task
    textless = np.arange(0, len(data.test), 4)  # 12 of the 48 test points: an image, no text
    test_texts = ["" if i in set(textless.tolist()) else t for i, t in enumerate(data.test.texts)]
    write_xc_raw(str(tmp_path / "tst.json.gz"), dataclasses.replace(data.test, texts=test_texts))
    write_xc_raw(str(tmp_path / "trn.json.gz"), dataclasses.replace(data.train, texts=[""] + list(data.train.texts[1:])))
    out = tmp_path / "out"
    argv = script_command(task, out)[2:]
    argv[argv.index("--train_file") + 1], argv[argv.index("--test_file") + 1] = str(tmp_path / "trn.json.gz"), str(tmp_path / "tst.json.gz")
    argv += ["--item_modalities", "text", "--siamese_epochs", "1", "--num_train_epochs", "1", "--per_device_train_batch_size", "16",
             "--learning_rate", "2e-3", "--ranker_learning_rate", "2e-3", "--ranker_negatives", "3", "--hard_negative_top_k", "6",
             "--propensity_a", "0.55", "--propensity_b", "1.5", "--disable_tqdm", "true", "--use_cpu", "true", "--seed", "0"]
    built, build_evaluator = [], recipe.build_evaluator

    def recorded(*args, **kwargs):  # the run's test evaluator: its last ranking is what the subset metrics score
        built.append(build_evaluator(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(recipe, "build_evaluator", recorded)
    returned = recipe.main(argv)
    results = json.loads((out / "eval_results.json").read_text())
    subset = {k: v for k, v in results.items() if "with_" in k}
    assert subset and {k: returned[k] for k in subset} == subset
    n, with_text = len(data.test), np.setdiff1d(np.arange(len(data.test)), textless)
    assert results["test_points_with_text"] == len(with_text) == 36 and "test_points_with_image" not in results
    assert not any(k.startswith("test_with_image_") for k in results)  # a text-only run: its own modality only
    (evaluator,) = built
    ranking, truth = evaluator.last_predictions, evaluator.data.targets.tocsr()
    assert (ranking[textless] == -1).all() and (ranking[with_text] >= 0).all()  # the textless points: no prediction
    hits = sum(int(truth[i, ranking[i, 0]] > 0) for i in with_text)
    assert hits > 0 and results["test_with_text_P@1"] == pytest.approx(100.0 * hits / len(with_text))
    # the textless rows are all misses, so P@k and nDCG@k (means over the rows) are test_* rescaled by n / n_with_text
    for key in ("P@1", "P@3", "P@5", "nDCG@5"):
        assert results[f"test_with_text_{key}"] == pytest.approx(results[f"test_{key}"] * n / len(with_text)), key
    # PSP@k: the propensities of all 160 training points, though the run trained on the 159 with a text
    full = inverse_propensity(data.train.targets, 0.55, 1.5)
    np.testing.assert_allclose(evaluator.inv_propensity, full)
    expected = xmc_metrics(ranking[with_text], truth[with_text], full, ks=(1, 3, 5), recall_ks=())
    assert {k: results[f"test_with_text_{k}"] for k in expected} == pytest.approx(expected)
    dropped = xmc_metrics(ranking[with_text], truth[with_text], inverse_propensity(data.train.targets[1:], 0.55, 1.5), ks=(5,), recall_ks=())
    assert dropped["PSP@5"] != pytest.approx(expected["PSP@5"], abs=1e-9)  # the check above tells the two apart


def test_bench_mufin_table_shows_the_metrics_on_the_points_with_the_runs_modality():
    """benchmarks/bench_mufin.py: P@1 / P@5 with text and with an image per row, "-" where a row lacks them (a run
    that does not use the modality, or one that predates the keys: the committed rows)."""
    from benchmarks.bench_mufin import BENCH_SHOWN, mufin_table

    base = {k: 10.0 for k in BENCH_SHOWN}
    results = {"siamese_epochs": "1", "epochs": "1", "args": ["--learning_rate", "3e-4", "--ranker_learning_rate", "3e-4"], "rows": [
        {"description": "old", "wall_seconds": 1.0, **base},
        {"description": "text", "wall_seconds": 1.0, **base, "test_with_text_P@1": 12.5, "test_with_text_P@5": 6.25},
    ]}
    lines = mufin_table(results).splitlines()
    assert lines[0].endswith("| P@1 with text | P@5 with text | P@1 with image | P@5 with image | wall s |")
    assert lines[2].endswith("| 10.00 | - | - | - | - | 1 |") and lines[3].endswith("| 10.00 | 12.50 | 6.25 | - | - | 1 |")
