"""MUFIN model tests with a tiny random ViT and DistilBERT (spec ``shared/specs/mufin.md`` Sec. 11): the attention
block (identity init against a hand-written reference, bag-order and padding invariance, one-element bags, the
cross-attention direction, distinct A_S / A_C), the classifier's alpha modes, the shortlist index and centroids,
fusion and its cost, the two training stages, vision freezing, text-only / image-only / mixed inputs, and
save -> reload (in-process and through remote code in a process where hf_xmc cannot be imported)."""

import json
import os

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import (
    AutoModel,
    BertTokenizer,
    DistilBertConfig,
    DistilBertModel,
    ViTConfig,
    ViTImageProcessor,
    ViTModel,
)

from hf_xmc.models import MUFINConfig, MUFINModel, label_centroids_from_embeddings
from hf_xmc.models.modeling_mufin import (
    LABEL_BAGS_FILE,
    LABEL_CENTROIDS_FILE,
    LABEL_IMAGES_FILE,
    select_siamese_pairs,
)
from hf_xmc.models.xmc_losses import mufin_ranker_loss, mufin_triplet_loss
from tests.models.test_modeling_common import (
    assert_same_rows,
    check_push_uploads_exactly_the_model_files,
    pipeline_rows,
    pipeline_through_remote_code,
    predict_through_remote_code,
)

WORDS = "red green blue yellow black white apple pear car boat tree house shoe hat lamp chair cup dog cat bird".split()
D = 8


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """Directories of a tiny random DistilBERT (+ word-level tokenizer) and ViT (+ 32x32 image processor), spec Sec. 11."""
    root = tmp_path_factory.mktemp("mufin_encoders")
    text_dir, vision_dir = str(root / "text"), str(root / "vision")
    os.makedirs(text_dir)
    vocab = os.path.join(text_dir, "vocab.txt")
    with open(vocab, "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS) + "\n")
    BertTokenizer(vocab=vocab).save_pretrained(text_dir)
    torch.manual_seed(0)
    DistilBertModel(
        DistilBertConfig(vocab_size=len(WORDS) + 5, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64)
    ).save_pretrained(text_dir)
    ViTModel(
        ViTConfig(image_size=32, patch_size=16, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    ).save_pretrained(vision_dir)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(vision_dir)
    return text_dir, vision_dir


def random_image(rng: np.random.Generator, size: int = 32) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def make_labels(num_labels: int = 20, seed: int = 0):
    """Label texts and image bags: some text-only, some image-only (None text), 0..2 images each."""
    rng = np.random.default_rng(seed)
    texts, images = [], []
    for label in range(num_labels):
        n_images = label % 3
        text = None if label % 7 == 3 else " ".join(rng.choice(WORDS, size=2, replace=False))
        texts.append(text)
        images.append([random_image(rng) for _ in range(n_images or (1 if text is None else 0))])
    return texts, images


def make_model(encoders, num_labels: int = 20, build: bool = True, seed: int = 0, **kwargs) -> MUFINModel:
    torch.manual_seed(seed)
    config = dict(label_space_size=num_labels, embed_dim=D, attention_heads=2, shortlist_size=10, max_seq_length=16)
    config.update(kwargs)
    model = MUFINModel.from_encoders_pretrained(*encoders, **config)
    if build:
        texts, images = make_labels(num_labels)
        model.build_label_index(texts, label_images=images)
    return model


def perturb(model: MUFINModel, scale: float = 0.2) -> None:
    """Move A_S, A_C and the classifiers away from their (identity / symmetric) init so checks are meaningful."""
    with torch.no_grad():
        for block in (model.self_attention, model.cross_attention):
            for proj in block.projections():
                proj.parametrizations.weight.original.add_(scale * torch.randn(D, D))
                proj.bias.normal_(0, scale)
        if model.classifier is not None:
            model.classifier.alpha_logits.normal_(0, 1)
    model.invalidate_label_index()


@pytest.fixture(scope="module")
def trained_like(encoders):
    """A model with non-identity blocks, classifiers, label bags and centroids (eval mode)."""
    model = make_model(encoders, build=False)
    perturb(model)
    texts, images = make_labels(20)
    model.build_label_index(texts, label_images=images)
    rng = np.random.default_rng(1)
    points = [" ".join(rng.choice(WORDS, size=3)) for _ in range(30)]
    targets = sp.random(30, 20, density=0.1, format="csr", random_state=1)
    targets.data[:] = 1
    model.compute_label_centroids(points, None, targets)
    return model.eval()


def one_item_bag(model, rng, n_images=3, text="red apple"):
    inputs = model.prepare_bags([text], [[random_image(rng) for _ in range(n_images)]])
    return model.descriptor_bags(**inputs)


# ---------------------------------------------------------------------------------------------------- blocks
def test_pool_exactness(encoders):
    v = torch.randn(5, 32)
    torch.testing.assert_close(torch.nn.AdaptiveMaxPool1d(8)(v.unsqueeze(1)).squeeze(1), v.view(5, 8, 4).max(-1).values, rtol=0, atol=0)
    big = torch.randn(3, 768)
    torch.testing.assert_close(torch.nn.AdaptiveMaxPool1d(192)(big.unsqueeze(1)).squeeze(1), big.view(3, 192, 4).max(-1).values, rtol=0, atol=0)
    model = make_model(encoders, build=False).eval()
    batch = model.tokenize(["red apple", "blue car"], 16)
    pooled = model.pooled_embedding(batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(model.text_descriptors(batch["input_ids"], batch["attention_mask"]), pooled.view(2, 8, 4).max(-1).values)


def test_shapes_and_unit_norms(trained_like):
    model, rng = trained_like, np.random.default_rng(0)
    bags, mask = one_item_bag(model, rng, n_images=3)
    assert bags.shape == (1, 4, D) and mask.all()  # 3 images + 1 text
    attended, x1 = model.self_attend(bags, mask)
    assert attended.shape == (1, 4, D) and x1.shape == (1, D)
    torch.testing.assert_close(x1.norm(dim=-1), torch.ones(1), atol=1e-6, rtol=0)
    torch.testing.assert_close(model.label_vectors.norm(dim=-1), torch.ones(20), atol=1e-6, rtol=0)
    label_bags, label_mask = model.label_bags(torch.tensor([2, 5]))
    x2 = model.label_adapted_embedding(attended.expand(2, -1, -1), mask.expand(2, -1), label_bags, label_mask)
    torch.testing.assert_close(x2.norm(dim=-1), torch.ones(2), atol=1e-6, rtol=0)
    w = model.classifier_weights(torch.tensor([2, 5]), model.label_vectors[[2, 5]])
    torch.testing.assert_close(w.norm(dim=-1), torch.ones(2), atol=1e-6, rtol=0)  # the code's re-normalised w


def reference_attention(x, z, key_mask, heads=2):
    """LN(X + softmax(X Z^T / sqrt(d_h)) Z) per head with identity Q/K/V/O, written out by hand."""
    b, m, d = x.shape
    dh = d // heads
    outs = []
    for h in range(heads):
        q, k = x[..., h * dh : (h + 1) * dh], z[..., h * dh : (h + 1) * dh]
        s = q @ k.transpose(1, 2) / dh**0.5
        s = s.masked_fill(~key_mask[:, None, :], float("-inf"))
        outs.append(s.softmax(-1) @ k)
    return F.layer_norm(x + torch.cat(outs, dim=-1), (d,))


def test_identity_init_and_hand_written_reference(encoders):
    model = make_model(encoders, build=False).eval()
    for block in (model.self_attention, model.cross_attention):
        for proj in block.projections():
            torch.testing.assert_close(proj.parametrizations.weight.original.detach(), torch.eye(D), rtol=0, atol=0)
            torch.testing.assert_close(proj.weight.detach(), torch.eye(D), rtol=0, atol=1e-6)  # spectral norm of I is 1
            assert not proj.bias.any()
    torch.manual_seed(1)
    x, z = torch.randn(3, 4, D), torch.randn(3, 5, D)
    key_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 1, 0, 1]], dtype=torch.bool)
    for block in (model.self_attention, model.cross_attention):
        torch.testing.assert_close(block(x, z, key_mask), reference_attention(x, z, key_mask), atol=1e-5, rtol=1e-5)
        self_out = block(x, x, torch.ones(3, 4, dtype=torch.bool))
        torch.testing.assert_close(self_out, reference_attention(x, x, torch.ones(3, 4, dtype=torch.bool)), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(self_out, x, atol=1e-2)  # not the identity map even at identity init


def test_bag_order_invariance(trained_like):
    model, rng = trained_like, np.random.default_rng(2)
    images = [random_image(rng) for _ in range(3)]
    x_a = model.encode_items(["green pear"], [images])
    x_b = model.encode_items(["green pear"], [images[::-1]])
    torch.testing.assert_close(x_a, x_b, atol=1e-5, rtol=0)
    bags, mask = model.descriptor_bags(**model.prepare_bags(["green pear"], [images]))
    perm = torch.tensor([2, 0, 3, 1])
    attended, x1 = model.self_attend(bags, mask)
    attended_p, x1_p = model.self_attend(bags[:, perm], mask[:, perm])
    torch.testing.assert_close(x1, x1_p, atol=1e-5, rtol=0)
    label_bags, label_mask = model.label_bags(torch.tensor([4]))
    x2 = model.label_adapted_embedding(attended, mask, label_bags, label_mask)
    x2_p = model.label_adapted_embedding(attended_p, mask[:, perm], label_bags, label_mask)
    torch.testing.assert_close(x2, x2_p, atol=1e-5, rtol=0)


def test_padding_invariance(trained_like):
    model, rng = trained_like, np.random.default_rng(3)
    bags, mask = one_item_bag(model, rng, n_images=2)
    padded = torch.cat([bags, 5 * torch.randn(1, 3, D)], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(1, 3, dtype=torch.bool)], dim=1)
    attended, x1 = model.self_attend(bags, mask)
    attended_p, x1_p = model.self_attend(padded, padded_mask)
    torch.testing.assert_close(x1, x1_p, atol=1e-6, rtol=0)
    out, probs = model.self_attention(bags, bags, mask, output_attentions=True)
    out_p, probs_p = model.self_attention(padded, padded, padded_mask, output_attentions=True)
    assert (probs_p[..., 3:] == 0).all()  # padded keys get no attention
    torch.testing.assert_close(probs_p[:, :, :3, :3], probs, atol=1e-6, rtol=0)
    label_bags, label_mask = model.label_bags(torch.tensor([7]))
    x2 = model.label_adapted_embedding(attended, mask, label_bags, label_mask)
    label_bags_p = torch.cat([label_bags, torch.randn(1, 2, D)], dim=1)
    label_mask_p = torch.cat([label_mask, torch.zeros(1, 2, dtype=torch.bool)], dim=1)
    x2_p = model.label_adapted_embedding(attended_p, padded_mask, label_bags_p, label_mask_p)
    torch.testing.assert_close(x2, x2_p, atol=1e-6, rtol=0)
    # batching with longer bags pads this item: same vector as alone
    alone = model.encode_items(["red apple"], None)
    batched = model.encode_items(["red apple", "blue car"], [[], [random_image(rng) for _ in range(4)]])
    torch.testing.assert_close(alone[0], batched[0], atol=1e-5, rtol=0)


def test_missing_modality_and_one_element_bag(encoders):
    model, rng = make_model(encoders, build=False).eval(), np.random.default_rng(4)
    image_only = model.descriptor_bags(**model.prepare_bags(None, [[random_image(rng), random_image(rng)]]))
    text_only = model.descriptor_bags(**model.prepare_bags(["blue car"], None))
    assert image_only[0].shape == (1, 2, D) and text_only[0].shape == (1, 1, D)
    for bags, mask in (text_only, model.descriptor_bags(**model.prepare_bags(None, [random_image(rng)]))):
        attended, _ = model.self_attend(bags, mask)
        torch.testing.assert_close(attended, F.layer_norm(2 * bags, (D,)), atol=1e-5, rtol=1e-5)  # 1-key softmax: LN(x + x)
    with pytest.raises(ValueError, match="item 1 has neither text nor image"):
        model.prepare_bags(["red", None], [[], []])
    with pytest.raises(ValueError, match="item 0 has neither text nor image"):
        model.descriptor_bags(input_ids=torch.tensor([[2, 6, 3]]), text_item_index=torch.tensor([1]))


def test_cross_attention_direction(trained_like):
    block = trained_like.cross_attention
    torch.manual_seed(5)
    x, z = torch.randn(1, 3, D), torch.randn(1, 6, D)
    out = block(x, z)
    assert out.shape == (1, 3, D)  # the query's rows
    assert not torch.allclose(block(x, z + torch.randn_like(z)), out, atol=1e-3)
    x2 = x.clone()
    x2[0, 1] += torch.randn(D)
    changed = (block(x2, z) - out).abs().amax(-1)[0]
    assert changed[1] > 1e-3 and changed[0] == 0 and changed[2] == 0


def test_self_and_cross_attention_have_distinct_parameters(trained_like):
    model = trained_like
    assert model.self_attention is not model.cross_attention
    assert not {id(p) for p in model.self_attention.parameters()} & {id(p) for p in model.cross_attention.parameters()}
    before = {k: v.clone() for k, v in model.self_attention.state_dict().items()}
    optimizer = torch.optim.SGD(model.cross_attention.parameters(), lr=0.1)
    x, z = torch.randn(2, 3, D), torch.randn(2, 4, D)
    model.cross_attention(x, z).sum().backward()
    saved = {k: v.clone() for k, v in model.cross_attention.state_dict().items()}
    optimizer.step()
    optimizer.zero_grad()
    assert any(not torch.equal(saved[k], v) for k, v in model.cross_attention.state_dict().items())
    for k, v in model.self_attention.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    with torch.no_grad():  # undo the step (the fixture is shared)
        for k, v in model.cross_attention.named_parameters():
            v.copy_(saved[k] if k in saved else v)


# ---------------------------------------------------------------------------------------------------- classifier
def test_classifier_alpha_modes(encoders):
    model = make_model(encoders, build=False, renormalize_classifier=False)
    clf = model.classifier
    ids = torch.tensor([0, 3, 7])
    z = F.normalize(torch.randn(3, D), dim=-1)
    eta = F.normalize(clf.free_vectors.weight[ids].detach(), dim=-1)
    torch.testing.assert_close(clf.alpha(ids).detach(), torch.full((3,), 0.5))  # init 0.5 (logits (0, 0))
    assert torch.equal(clf.alpha_logits.detach(), torch.zeros(20, 2))
    torch.testing.assert_close(model.classifier_weights(ids, z).detach(), 0.5 * z + 0.5 * eta)
    bound = (6 / (20 + D)) ** 0.5  # xavier uniform
    assert clf.free_vectors.weight.abs().max() <= bound and clf.free_vectors.weight.std() > bound / 4
    with torch.no_grad():
        clf.alpha_logits[:, 0] = 50.0  # alpha -> 0: w = N(eta)
    torch.testing.assert_close(model.classifier_weights(ids, z).detach(), eta, atol=1e-6, rtol=0)
    model.config.renormalize_classifier = clf.renormalize = True
    with torch.no_grad():
        clf.alpha_logits.zero_()
    torch.testing.assert_close(model.classifier_weights(ids, z).detach(), F.normalize(0.5 * z + 0.5 * eta, dim=-1))
    model.config.zero_shot = True  # MUFIN(alpha=1): w is z^1 exactly
    assert torch.equal(model.classifier_weights(ids, z), z)
    sigmoid = make_model(encoders, build=False, alpha_param="sigmoid", alpha_init=0.3)
    assert sigmoid.classifier.alpha_logits.shape == (20, 1)
    torch.testing.assert_close(sigmoid.classifier.alpha(ids).detach(), torch.full((3,), 0.3))


def test_zero_shot_model_scores_unseen_labels(encoders):
    model = make_model(encoders, num_labels=0, build=False, zero_shot=True).eval()
    assert model.classifier is None
    texts, images = make_labels(13, seed=5)  # any label set: no per-label parameters
    model.build_label_index(texts, label_images=images)
    offsets = model.label_bag_offsets.clone()
    model.build_label_index(texts)  # the same label texts again (as an evaluator does): the images are kept
    assert torch.equal(model.label_bag_offsets, offsets)
    pred = model.predict(["red apple", "blue car"], k=3, search_mode="classifier")
    assert pred.label_ids.shape == (2, 3) and (pred.label_ids >= 0).all()
    # c = <x^{2,l}, z_l^1>
    query_bags, query_mask, _ = model.embed_bags(**model.prepare_bags(["red apple"]))
    label = torch.tensor([int(pred.label_ids[0, 0])])
    bags, mask = model.label_bags(label)
    x2 = model.label_adapted_embedding(query_bags, query_mask, bags, mask)
    np.testing.assert_allclose(pred.scores[0, 0], float(x2[0].detach() @ model.label_vectors[label[0]]), atol=1e-5)
    with pytest.raises(ValueError, match="label_space_size"):  # fewer labels than classifiers: ids would not match
        make_model(encoders, num_labels=5, build=False).set_labels(texts[:4], images=images[:4])


def test_labels_without_positives_and_added_labels_score_zero_shot(encoders):
    """Labels never positive in training (centroid count 0) and labels appended after training get w_l = z_l^1 (the
    spec's alpha = 1 path), while trained labels keep their alpha-mixed classifiers, all in one index."""
    model = make_model(encoders, build=False)
    perturb(model)
    texts, images = make_labels(20)
    model.build_label_index(texts, label_images=images)
    targets = sp.lil_matrix((6, 20))
    for point, label in enumerate([0, 1, 2, 4, 5, 6]):  # labels 3 and 7..19 have no training positive
        targets[point, label] = 1
    model.compute_label_centroids([" ".join(WORDS[i : i + 2]) for i in range(6)], None, targets.tocsr())
    model.eval()
    ids = torch.arange(20)
    trained = model.trained_classifier_mask(ids)
    assert trained.tolist() == [i in (0, 1, 2, 4, 5, 6) for i in range(20)]
    weights = model.classifier_weights(ids, model.label_vectors).detach()
    torch.testing.assert_close(weights[~trained], model.label_vectors[~trained], rtol=0, atol=0)  # exactly z
    torch.testing.assert_close(weights[trained], model.classifier(ids[trained], model.label_vectors[trained]))
    assert float((weights[trained] - model.label_vectors[trained]).norm(dim=1).min()) > 0.05  # mixed with eta
    # two labels appended without retraining: zero-shot too, in the same index as the 20 trained ones
    rng = np.random.default_rng(3)
    model.build_label_index(texts + ["red car", None], label_images=images + [[], [random_image(rng)]])
    assert model.label_centroids.shape[0] == 22 and model.label_centroid_counts[20:].tolist() == [0, 0]
    assert set(model.shortlist_row_labels.tolist()) == set(range(22))
    all_ids = torch.arange(22)
    weights = model.classifier_weights(all_ids, model.label_vectors).detach()
    torch.testing.assert_close(weights[20:], model.label_vectors[20:], rtol=0, atol=0)
    torch.testing.assert_close(weights[:20][trained], model.classifier(ids[trained], model.label_vectors[:20][trained]))
    model.config.shortlist_size = 22
    query = ["red car"]
    pred = model.predict(query, k=22, search_mode="classifier")
    assert sorted(pred.label_ids[0].tolist()) == list(range(22))
    query_bags, query_mask, _ = model.embed_bags(**model.prepare_bags(query))
    for slot, label in enumerate(pred.label_ids[0].tolist()):  # c = <x^{2,l}, w_l> with w_l = z_l^1 off the classifiers
        bags, mask = model.label_bags(torch.tensor([label]))
        x2 = model.label_adapted_embedding(query_bags, query_mask, bags, mask)[0]
        np.testing.assert_allclose(pred.scores[0, slot], float(x2 @ weights[label]), atol=1e-5)
    with pytest.raises(ValueError, match="label_space_size"):
        model.set_labels(texts[:19], images=images[:19])


def test_label_images_are_saved_and_used_to_rebuild_after_reload(trained_like, tmp_path):
    model = trained_like
    model.save_pretrained(tmp_path)
    assert (tmp_path / LABEL_IMAGES_FILE).exists()
    reloaded = AutoModel.from_pretrained(tmp_path)
    _, images = make_labels(20)
    assert [len(bag) for bag in reloaded.label_images] == [len(bag) for bag in images]
    assert all(isinstance(image, bytes) for bag in reloaded.label_images for image in bag)
    rows = model.label_bag_rows.clone()
    for rebuild in (lambda: reloaded.build_label_index(), lambda: reloaded.build_label_index(list(reloaded.label_texts))):
        rebuild()  # without images (as hf-xmc evaluate passes only texts), the stored ones are used
        torch.testing.assert_close(reloaded.label_bag_rows, rows, atol=1e-5, rtol=1e-5)
        assert torch.equal(reloaded.label_bag_offsets, model.label_bag_offsets)
    rng = np.random.default_rng(21)
    texts, query_images = ["red apple", None], [[random_image(rng)], [random_image(rng)]]
    before, after = model.predict(texts, k=5, images=query_images), reloaded.predict(texts, k=5, images=query_images)
    np.testing.assert_array_equal(before.label_ids, after.label_ids)
    np.testing.assert_allclose(before.scores, after.scores, atol=1e-5)


def test_saved_label_images_are_read_lazily_one_batch_at_a_time(trained_like, tmp_path, monkeypatch):
    """A reload keeps the label image file's offsets only: no image is read until the labels are re-encoded, then one
    batch of bags a read; an unchanged file is copied on save; a selection (labels removed) stays lazy and is packed."""
    import filecmp

    from hf_xmc.models.processing_mufin import LazyLabelImages, image_file_bytes

    trained_like.save_pretrained(tmp_path / "a")
    reads = []
    original = LazyLabelImages._read
    monkeypatch.setattr(LazyLabelImages, "_read", lambda self, rows: reads.append(len(rows)) or original(self, rows))
    reloaded = AutoModel.from_pretrained(tmp_path / "a")
    assert isinstance(reloaded.label_images, LazyLabelImages) and reads == []  # loaded without reading an image
    _, images = make_labels(20)
    assert reloaded.label_images.counts().tolist() == [len(bag) for bag in images]
    assert reloaded.label_images[3] == [image_file_bytes(image) for image in images[3]] and reads == [1]
    reads.clear()
    reloaded.build_label_index(batch_size=6)  # re-encoded from the file, a batch of bags per read
    assert reads == [6, 6, 6, 2]
    torch.testing.assert_close(reloaded.label_bag_rows, trained_like.label_bag_rows, atol=1e-5, rtol=1e-5)
    reloaded.save_pretrained(tmp_path / "b")  # unchanged: the file is copied as it is
    assert filecmp.cmp(tmp_path / "a" / LABEL_IMAGES_FILE, tmp_path / "b" / LABEL_IMAGES_FILE, shallow=False)
    # labels added after training stay lazy (the file's bags unread, the new ones in memory after them), saved,
    # reloaded (lazy again) and one removed: a lazy selection, packed on save
    rng = np.random.default_rng(8)
    new_images = [[random_image(rng)], [random_image(rng)]]
    reads.clear()
    reloaded.add_labels(["red car", None], uids=["n1", "n2"], images=new_images)
    assert isinstance(reloaded.label_images, LazyLabelImages) and reads == []  # nothing of the file read to add two labels
    assert reloaded.label_images.counts().tolist() == [len(bag) for bag in images] + [1, 1]
    assert reloaded.label_images[21] == new_images[1] and reloaded.label_images[19:21] == [
        [image_file_bytes(image) for image in images[19]], new_images[0]
    ]
    reloaded.save_pretrained(tmp_path / "grown")
    grown = AutoModel.from_pretrained(tmp_path / "grown")
    expected = [list(bag) for bag in grown.label_images]
    grown.remove_labels(["n1"])
    assert isinstance(grown.label_images, LazyLabelImages) and len(grown.label_images) == 21
    grown.save_pretrained(tmp_path / "shrunk")
    shrunk = AutoModel.from_pretrained(tmp_path / "shrunk")
    assert [list(bag) for bag in shrunk.label_images] == expected[:20] + expected[21:]
    assert expected[20:] == [[image_file_bytes(bag[0])] for bag in new_images]
    # a selection of an extended view keeps the order of its sources, file and tail alike
    view = reloaded.label_images.select([21, 0, 20])
    assert view.counts().tolist() == [1, len(images[0]), 1] and view[0] == new_images[1] and view[2] == new_images[0]


def test_label_images_not_saved_refuse_a_text_only_rebuild(encoders, tmp_path):
    model = make_model(encoders, save_label_images=False).eval()
    model.save_pretrained(tmp_path)
    assert not (tmp_path / LABEL_IMAGES_FILE).exists()
    reloaded = AutoModel.from_pretrained(tmp_path)
    assert reloaded.label_images is None and reloaded.label_images_missing
    texts = ["red apple", "blue car"]
    np.testing.assert_array_equal(reloaded.predict(texts, k=5).label_ids, model.predict(texts, k=5).label_ids)  # saved bags
    for rebuild in (lambda: reloaded.build_label_index(), lambda: reloaded.build_label_index(list(reloaded.label_texts))):
        with pytest.raises(ValueError, match="had images, which were not saved"):
            rebuild()
    assert torch.equal(reloaded.label_bag_rows, model.label_bag_rows)  # nothing was overwritten
    label_texts, label_images = make_labels(20)
    reloaded.build_label_index(label_texts, label_images=label_images)  # given the images again, it re-encodes them
    torch.testing.assert_close(reloaded.label_bag_rows, model.label_bag_rows, atol=1e-5, rtol=1e-5)


def test_label_images_rebuild_through_remote_code(trained_like, tmp_path):
    """A remote-code reload (no hf_xmc) re-encodes its labels from the stored images and predicts as before."""
    model_dir = tmp_path / "model"
    trained_like.save_pretrained(model_dir)
    texts = ["red apple", "green tree cat"]
    before = trained_like.predict(texts, k=5)
    result = predict_through_remote_code(model_dir, tmp_path, texts, rebuild_index=True)
    assert result["ids"] == before.label_ids.tolist()
    np.testing.assert_allclose(np.array(result["scores"]), before.scores, atol=1e-5)


# ---------------------------------------------------------------------------------------------------- index, centroids
def test_index_rows_and_shortlist_against_dense_reference(trained_like):
    model = trained_like
    counts = (model.label_bag_offsets[1:] - model.label_bag_offsets[:-1]).numpy()
    texts, images = make_labels(20)
    assert counts.tolist() == [len(i) + (t is not None) for t, i in zip(texts, images)]  # m_l
    has_positives = (model.label_centroid_counts > 0).numpy()
    assert 0 < has_positives.sum() < 20
    index = model._require_shortlist_index()
    assert index.num_labels == int(counts.sum() + has_positives.sum())  # sum_l (m_l + 1), m_l without positives
    row_labels = model.shortlist_row_labels.numpy()
    assert np.bincount(row_labels, minlength=20).tolist() == (counts + has_positives).tolist()
    queries = model.encode_items(["red apple", "green house", None], [[], [], [random_image(np.random.default_rng(6))]])
    model.config.shortlist_fetch_factor = 100  # fetch every row: the exact dense reference applies
    try:
        ids, scores = model.shortlist(queries, size=8)
    finally:
        model.config.shortlist_fetch_factor = 3
    vectors, owners = model.shortlist_vectors()
    dense = (F.normalize(queries, dim=-1) @ vectors.T).numpy()
    best = np.full((3, 20), -np.inf)
    for row, label in enumerate(owners.numpy()):
        best[:, label] = np.maximum(best[:, label], dense[:, row])  # a_il = max over the label's rows
    for i in range(3):
        assert len(set(ids[i])) == 8  # unique labels
        np.testing.assert_allclose(scores[i], np.sort(best[i])[::-1][:8], atol=1e-5)
        np.testing.assert_allclose(best[i, ids[i]], scores[i], atol=1e-5)
    small_ids, _ = model.shortlist(queries, size=100)
    assert ((small_ids >= 0).sum(1) <= 20).all()  # |R| <= min(shortlist, L)
    import hf_xmc.models.mufin_label_store as store

    chunk = store.SHORTLIST_CHUNK
    store.SHORTLIST_CHUNK = 2  # queries searched two at a time: the same shortlists as one search
    try:
        chunked_ids, chunked_scores = model.shortlist(queries, size=8)
    finally:
        store.SHORTLIST_CHUNK = chunk
    one_ids, one_scores = model.shortlist(queries, size=8)
    np.testing.assert_array_equal(chunked_ids, one_ids)
    np.testing.assert_allclose(chunked_scores, one_scores, atol=1e-6)
    # Module II's positives left out chunk by chunk: what filtering a shortlist wider by the most positives of a row gives
    from scipy import sparse

    from hf_xmc.data import filter_predictions

    positives = sparse.csr_matrix((np.ones(3), ([0, 0, 2], [one_ids[0, 0], one_ids[0, 3], one_ids[2, 1]])), shape=(3, 20))
    wide_ids, wide_scores = model.shortlist(queries, size=10)
    expected, _ = filter_predictions(wide_ids, wide_scores, positives, 8)
    store.SHORTLIST_CHUNK = 2
    try:
        left_out, _ = model.shortlist(queries, size=8, exclude=positives)
    finally:
        store.SHORTLIST_CHUNK = chunk
    np.testing.assert_array_equal(left_out, expected)
    assert one_ids[0, 0] not in left_out[0] and one_ids[2, 1] not in left_out[2] and (left_out[1] == one_ids[1]).all()
    model.config.shortlist_index = "vector"
    try:
        assert model.build_shortlist_index().num_labels == 20  # P-I-vec: z_l^1 only
    finally:
        model.config.shortlist_index = "bag"
        model.build_shortlist_index()


def test_centroids_are_mean_of_positive_embeddings(trained_like):
    rng = np.random.default_rng(7)
    x = F.normalize(torch.randn(12, D), dim=-1)
    y = (rng.random((12, 5)) < 0.3).astype(np.float32)
    y[:, 4] = 0  # a label without positives
    centroids, counts = label_centroids_from_embeddings(x, sp.csr_matrix(y))
    for label in range(4):
        rows = np.nonzero(y[:, label])[0]
        if rows.size:
            torch.testing.assert_close(centroids[label], x[rows].mean(0), atol=1e-6, rtol=0)
    assert counts.tolist() == y.sum(0).astype(int).tolist() and not centroids[4].any()
    dense_centroids, _ = label_centroids_from_embeddings(x.numpy(), torch.from_numpy(y))
    torch.testing.assert_close(dense_centroids, centroids)
    model = trained_like  # compute_label_centroids = Y^T X / counts of the items' x^1
    points = ["red apple", "blue car", "red car"]
    targets = np.zeros((3, 20), dtype=np.float32)
    targets[[0, 2], 1] = 1
    saved = (model.label_centroids, model.label_centroid_counts)
    try:
        mu = model.compute_label_centroids(points, None, sp.csr_matrix(targets))
        x1 = model.encode_items(points)
        torch.testing.assert_close(mu[1], (x1[0] + x1[2]) / 2, atol=1e-6, rtol=0)
        assert model.label_centroid_counts.tolist() == [0, 2] + [0] * 18
    finally:
        model.set_label_centroids(*saved)


# ---------------------------------------------------------------------------------------------------- prediction
def test_predict_contract_and_inputs(trained_like):
    model, rng = trained_like, np.random.default_rng(8)
    images = [[random_image(rng), random_image(rng)], [], [random_image(rng)]]
    both = model.predict(["red apple", "blue car", None], k=5, images=images)
    assert both.label_ids.shape == (3, 5) and both.label_ids.dtype == np.int64 and both.scores.dtype == np.float32
    assert np.all(np.diff(both.scores, axis=1) <= 1e-6)
    assert [[model.label_texts[i] for i in row] for row in both.label_ids] == both.label_texts
    text_only = model.predict(["red apple", "blue car"], k=5)
    np.testing.assert_array_equal(text_only.label_ids[1], both.label_ids[1])  # item 2 had no images either way
    image_only = model.predict(images=[images[2][0]], k=5)  # a flat list: one image per item
    np.testing.assert_array_equal(image_only.label_ids[0], both.label_ids[2])
    np.testing.assert_allclose(image_only.scores[0], both.scores[2], atol=1e-5)
    assert model.predict("red apple", k=2).label_ids.shape == (1, 2)
    wide = model.predict(["red apple"], k=15)  # more than the shortlist: empty slots
    assert (wide.label_ids[0, 10:] == -1).all() and np.isneginf(wide.scores[0, 10:]).all() and wide.label_texts[0][12] == ""
    with pytest.raises(ValueError, match="k must be"):
        model.predict(["red"], k=0)
    with pytest.raises(ValueError, match="item 0 has neither"):
        model.predict([None], images=[[]])


def test_fusion_scores_and_ranking(trained_like):
    model = trained_like
    query = ["red apple house"]
    retrieval = model.predict(query, k=10, search_mode="retrieval")
    classifier = model.predict(query, k=10, search_mode="classifier")
    fusion = model.predict(query, k=10)
    assert set(retrieval.label_ids[0]) == set(classifier.label_ids[0]) == set(fusion.label_ids[0])  # the shortlist only
    a = dict(zip(retrieval.label_ids[0], retrieval.scores[0]))
    c = dict(zip(classifier.label_ids[0], classifier.scores[0]))
    expected = {label: 0.7 * c[label] + 0.3 * a[label] for label in a}
    np.testing.assert_allclose(fusion.scores[0], [expected[label] for label in fusion.label_ids[0]], atol=1e-5)
    assert list(fusion.label_ids[0]) == sorted(expected, key=lambda label: -expected[label])
    # crafted: the last shortlisted label gets a classifier aligned with x^{2,l} (c = 1), the others the opposite
    # (c = -1): fusion moves it to the top although retrieval ranks it last
    target = int(retrieval.label_ids[0, -1])
    query_bags, query_mask, _ = model.embed_bags(**model.prepare_bags(query))
    saved = model.classifier.state_dict()
    try:
        with torch.no_grad():
            model.classifier.alpha_logits[:, 0] = 50.0  # alpha -> 0: w = N(eta)
            for label in retrieval.label_ids[0]:
                bags, mask = model.label_bags(torch.tensor([int(label)]))
                x2 = model.label_adapted_embedding(query_bags, query_mask, bags, mask)[0]
                model.classifier.free_vectors.weight[int(label)] = x2 if label == target else -x2
        crafted = model.predict(query, k=10)
        assert int(crafted.label_ids[0, 0]) == target
        np.testing.assert_allclose(crafted.scores[0, 0], 0.7 * 1.0 + 0.3 * a[target], atol=1e-4)
        assert int(model.predict(query, k=10, search_mode="retrieval").label_ids[0, -1]) == target
    finally:
        model.classifier.load_state_dict(saved)


def count_evaluations(model, texts, k=5):
    calls = {"cross_attention": 0, "classifier": 0}
    hooks = [
        model.cross_attention.register_forward_hook(lambda m, args, out: calls.__setitem__("cross_attention", calls["cross_attention"] + args[0].shape[0])),
        model.classifier.register_forward_hook(lambda m, args, out: calls.__setitem__("classifier", calls["classifier"] + args[0].numel())),
    ]
    try:
        pred = model.predict(texts, k=k)
    finally:
        for hook in hooks:
            hook.remove()
    shortlisted = int((model.shortlist(model.encode_items(texts))[0] >= 0).sum())
    return calls, shortlisted, pred


def test_cost_is_shortlist_size_whatever_the_label_count(encoders):
    texts = ["red apple", "blue car house", "green tree"]
    small = make_model(encoders, num_labels=20)
    rng = np.random.default_rng(9)
    many = [" ".join(rng.choice(WORDS, size=3)) for _ in range(2000)]
    large = make_model(encoders, num_labels=2000, build=False)
    large.build_label_index(many)
    for model in (small, large):
        calls, shortlisted, _ = count_evaluations(model, texts)
        assert shortlisted == 3 * model.config.shortlist_size  # |R_t| = 10 per query
        assert calls == {"cross_attention": shortlisted, "classifier": shortlisted}


# ---------------------------------------------------------------------------------------------------- training
def bag_batch(model, texts, images, prefix=""):
    inputs = model.prepare_bags(texts, images)
    return {prefix + k: v for k, v in inputs.items()}


def test_siamese_pair_selection():
    sims = torch.tensor([[0.9375, 0.5, 0.25, 0.75, 0.125], [0.96875, 0.9375, 0.25, 0.375, 0.625], [0.125, 0.25, 0.375, 0.5, 0.75]])
    positives = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    drawn = set()
    for seed in range(8):
        pos, pos_mask, neg, neg_mask = select_siamese_pairs(sims, positives, 2, 3, 0.9, torch.Generator().manual_seed(seed))
        assert set(pos[0][pos_mask[0]].tolist()) == {0.5, 0.25}  # cos > 0.9 never sampled
        assert pos[1][pos_mask[1]].tolist() == [0.9375, 0.96875]  # all above 0.9: falls back to the least similar
        assert neg[0][neg_mask[0]].tolist() == [0.75, 0.125]  # only 2 non-positives: never a positive as negative
        assert neg[1][neg_mask[1]].tolist() == [0.625, 0.375, 0.25]  # the hardest negatives, best first
        assert pos_mask[2].all() and neg[2][neg_mask[2]].tolist() == [0.75]
        drawn.add(tuple(sorted(pos[2].tolist())))
    assert len(drawn) > 1  # positives are sampled, not always the same two


def test_siamese_stage_loss_and_vision_freezing(encoders):
    model, rng = make_model(encoders, build=False), np.random.default_rng(10)
    trainable = model.freeze_vision_layers()  # paper: the final layer (+ final norm and pooler)
    assert trainable and all(name.startswith(("layers.1.", "layernorm.", "pooler.")) for name in trainable)
    assert any(name.startswith("layers.1.") for name in trainable)
    texts = ["red apple", "blue car", "green tree", "black cat"]
    images = [[random_image(rng)], [], [random_image(rng), random_image(rng)], [random_image(rng)]]
    label_texts, label_images = ["red", "blue car", None], [[], [random_image(rng)], [random_image(rng)]]
    targets = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 1], [0, 0, 1]], dtype=torch.bool)
    batch = {**bag_batch(model, texts, images), **bag_batch(model, label_texts, label_images, "label_"), "targets": targets}
    model.train()
    out = model(**batch, stage="siamese")
    assert out.logits.shape == (4, 3)
    torch.testing.assert_close(out.logits, out.query_embeds @ out.label_embeds.T)
    assert out.loss.ndim == 0 and out.loss > 0
    out.loss.backward()
    for name, p in model.vision_encoder.named_parameters():
        assert (p.grad is not None and p.grad.abs().sum() > 0) == (name in trainable), name
    assert all(p.grad is not None for p in model.encoder.parameters())  # the text encoder trains end to end
    assert model.self_attention.q_proj.parametrizations.weight.original.grad is not None
    assert all(p.grad is None for p in model.cross_attention.parameters())  # Module I: no A_C ...
    assert all(p.grad is None for p in model.classifier.parameters())  # ... and no free vectors
    # the loss is the triplet loss over the selected pairs (eval: no dropout, fixed selection seed)
    model.eval()
    torch.manual_seed(0)
    out = model(**batch, stage="siamese")
    torch.manual_seed(0)
    cfg = model.config
    pos, pos_mask, neg, neg_mask = select_siamese_pairs(out.logits.T, targets.T, 2, 3, 0.9)
    torch.testing.assert_close(out.loss, mufin_triplet_loss(pos, neg, cfg.siamese_margin, pos_mask, neg_mask))
    assert model.freeze_vision_layers(0) == [] and len(model.freeze_vision_layers(4)) > len(trainable)
    assert len(model.freeze_vision_layers(-1)) == len(list(model.vision_encoder.parameters()))


def test_ranker_stage_scores_and_loss(encoders):
    model, rng = make_model(encoders, build=False), np.random.default_rng(11)
    perturb(model)
    texts = ["red apple", None, "green tree"]
    images = [[], [random_image(rng)], [random_image(rng)]]
    label_texts, label_images = ["red apple", "blue car", "house", None], [[], [random_image(rng)], [], [random_image(rng)]]
    pool_ids = torch.tensor([3, 8, 11, 15])
    targets = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 1], [0, 0, 1, 0]], dtype=torch.bool)
    pair_mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    batch = {**bag_batch(model, texts, images), **bag_batch(model, label_texts, label_images, "label_")}
    model.eval()
    out = model(**batch, label_ids=pool_ids, targets=targets, pair_mask=pair_mask, stage="ranker")
    assert (out.logits[~pair_mask] == 0).all()
    query_bags, query_mask, _ = model.embed_bags(**bag_batch(model, texts, images))
    label_bags, label_mask, label_vectors = model.embed_bags(**bag_batch(model, label_texts, label_images))
    for i, j in pair_mask.nonzero().tolist():
        x2 = model.label_adapted_embedding(query_bags[i : i + 1], query_mask[i : i + 1], label_bags[j : j + 1], label_mask[j : j + 1])
        w = model.classifier(pool_ids[j : j + 1], label_vectors[j : j + 1])
        torch.testing.assert_close(out.logits[i, j], (x2 * w).sum(), atol=1e-5, rtol=1e-5)
    expected = mufin_ranker_loss(out.logits, out.logits, 0.5, targets & pair_mask, ~targets & pair_mask, "sum")
    torch.testing.assert_close(out.loss, expected)
    manual = sum((1 - out.logits[i, j]) if targets[i, j] else (out.logits[i, j] - 0.5).clamp(min=0) for i, j in pair_mask.nonzero().tolist())
    torch.testing.assert_close(out.loss, manual)
    model.train()
    model(**batch, label_ids=pool_ids, targets=targets, pair_mask=pair_mask, stage="ranker").loss.backward()
    grad_rows = set(model.classifier.free_vectors.weight.grad.abs().sum(1).nonzero().squeeze(1).tolist())
    assert grad_rows <= set(pool_ids.tolist()) and grad_rows
    assert model.cross_attention.q_proj.parametrizations.weight.original.grad.abs().sum() > 0
    assert model.classifier.alpha_logits.grad[pool_ids].abs().sum() > 0
    with pytest.raises(ValueError, match="label_ids"):
        model(**batch, targets=targets, stage="ranker")


# ---------------------------------------------------------------------------------------------------- persistence
def test_save_and_reload_same_predictions(trained_like, tmp_path):
    model, rng = trained_like, np.random.default_rng(12)
    texts, images = ["red apple", None, "blue car house"], [[random_image(rng)], [random_image(rng)], []]
    before = model.predict(texts, k=5, images=images)
    model.save_pretrained(tmp_path)
    for name in ("config.json", "model.safetensors", "labels.jsonl", LABEL_BAGS_FILE, LABEL_CENTROIDS_FILE, "label_index.json",
                 "preprocessor_config.json", "tokenizer_config.json", "modeling_mufin.py", "configuration_mufin.py",
                 "mufin_blocks.py", "mufin_label_store.py", "mufin_vision.py", "processing_mufin.py"):
        assert (tmp_path / name).exists(), name
    reloaded = AutoModel.from_pretrained(tmp_path)
    assert type(reloaded) is MUFINModel and type(reloaded.image_processor).__name__.startswith("ViTImageProcessor")
    after = reloaded.predict(texts, k=5, images=images)
    np.testing.assert_array_equal(before.label_ids, after.label_ids)
    np.testing.assert_allclose(before.scores, after.scores, atol=1e-6)
    assert before.label_texts == after.label_texts
    for name, tensor in model.state_dict().items():  # weights (incl. spectral-norm vectors, eta, alpha) survive
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(reloaded.label_centroids, model.label_centroids)
    # re-encoding the label texts with the reloaded weights reproduces the cached bags of text-only labels
    text_only = [i for i, (t, imgs) in enumerate(zip(*make_labels(20))) if t is not None and not imgs]
    again = reloaded.encode_items([model.label_texts[i] for i in text_only])
    torch.testing.assert_close(again, model.label_vectors[text_only], atol=1e-5, rtol=1e-5)


def save_random_images(directory, rng, count: int) -> list[str]:
    """``count`` random images written as PNG files (``image_<i>.png``): images travel as paths."""
    paths = []
    for i in range(count):
        path = str(directory / f"image_{i}.png")
        random_image(rng).save(path)
        paths.append(path)
    return paths


def test_remote_code_reload_without_hf_xmc(trained_like, tmp_path):
    model, rng = trained_like, np.random.default_rng(13)
    paths = save_random_images(tmp_path, rng, 3)
    request = {"texts": ["red apple", None, "green tree cat"], "images": [[paths[0], paths[1]], [paths[2]], []]}
    before = model.predict(request["texts"], k=5, images=request["images"])
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    assert set(json.load(open(model_dir / "config.json"))["auto_map"]) == {"AutoConfig", "AutoModel"}
    result = predict_through_remote_code(model_dir, tmp_path, request["texts"], request["images"])
    assert result["ids"] == before.label_ids.tolist()
    np.testing.assert_allclose(np.array(result["scores"]), before.scores, atol=1e-5)
    assert result["texts"] == before.label_texts


def test_add_and_remove_labels_without_retraining(encoders, tmp_path):
    """add_labels encodes only the new bags (in place == a full re-encoding), trained labels keep their scores, the
    grown model saves and reloads, and removing the added labels gives the trained model's predictions back."""
    from transformers import AutoModel

    model = make_model(encoders, build=False)
    perturb(model)
    texts, images = make_labels(20)
    model.build_label_index(texts, label_images=images)
    targets = sp.lil_matrix((6, 20))
    for point, label in enumerate([0, 1, 2, 4, 5, 6]):
        targets[point, label] = 1
    model.compute_label_centroids([" ".join(WORDS[i : i + 2]) for i in range(6)], None, targets.tocsr())
    model.eval()
    model.config.shortlist_size = 22
    rng = np.random.default_rng(5)
    queries = ["red apple", "blue car house", "green tree"]
    before = model.predict(queries, k=20)
    ids = model.add_labels(["red car", None], uids=["n1", "n2"], images=[[], [random_image(rng)]])
    assert ids.tolist() == [20, 21] and model.label_uids[-2:] == ["n1", "n2"] and model.label_texts[-2:] == ["red car", ""]
    assert model.label_centroid_counts[20:].tolist() == [0, 0] and set(model.shortlist_row_labels.tolist()) == set(range(22))
    grown_vectors = model.label_vectors.clone()
    after = model.predict(queries, k=22)
    for b_ids, b_s, a_ids, a_s in zip(before.label_ids, before.scores, after.label_ids, after.scores):
        was = dict(zip(b_ids.tolist(), b_s.tolist()))
        assert all(abs(was[i] - s) < 1e-5 for i, s in zip(a_ids.tolist(), a_s.tolist()) if i in was)
    assert (after.label_ids >= 20).any()
    model.save_pretrained(tmp_path / "grown")
    reloaded = AutoModel.from_pretrained(tmp_path / "grown")
    np.testing.assert_array_equal(reloaded.predict(queries, k=5).label_ids, model.predict(queries, k=5).label_ids)
    model.build_label_index()  # in place == re-encoding every label bag
    torch.testing.assert_close(model.label_vectors, grown_vectors, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="has a trained classifier"):
        model.remove_labels([model.label_uids[0]])
    assert model.remove_labels(["n1", "n2"]).tolist() == list(range(20))
    again = model.predict(queries, k=20)
    np.testing.assert_array_equal(again.label_ids, before.label_ids)
    np.testing.assert_allclose(again.scores, before.scores, atol=1e-5)


def test_pipeline_with_images_without_hf_xmc(trained_like, tmp_path):
    from transformers import pipeline

    from hf_xmc.models import XMC_PIPELINE_TASK

    model, rng = trained_like, np.random.default_rng(14)
    paths = save_random_images(tmp_path, rng, 2)
    want = pipeline_rows(model.predict(["red apple", None, "green tree cat"], k=5, images=[[paths[0]], [paths[1]], []]), 5)
    # a text + image item (the image as a file:// URL), an image-only item (a PIL image in process, a path remotely), a text
    pipe = pipeline(XMC_PIPELINE_TASK, model=model, device="cpu")
    from PIL import Image

    with Image.open(paths[1]) as image:
        got = pipe([{"text": "red apple", "image": "file://" + paths[0]}, image, "green tree cat"], top_k=5)
    assert_same_rows(got, want)
    with pytest.raises(TypeError, match="input 0: expected a text"):
        pipe([3.5])
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    inputs = [{"text": "red apple", "images": [paths[0]]}, {"image": paths[1]}, "green tree cat"]
    result = pipeline_through_remote_code(model_dir, tmp_path, inputs)
    assert_same_rows([result["one"]], [want[0][:3]])
    assert_same_rows(result["many"], want)


REMOTE_PROCESSOR = """
import json, sys
sys.modules["hf_xmc"] = None  # the processor comes from the model directory, not the package
from transformers import AutoProcessor
processor = AutoProcessor.from_pretrained(sys.argv[1], trust_remote_code=True)
request = json.loads(sys.argv[2])
out = processor(text=request["texts"], images=request["images"], max_length=request["max_length"])
print("RESULT " + json.dumps({"class": type(processor).__name__, "module": type(processor).__module__,
                              "input_ids": out["input_ids"].tolist(), "pixel_values": out["pixel_values"].tolist()}))
"""


def test_auto_processor_without_hf_xmc(trained_like, tmp_path):
    """AutoProcessor on a saved MUFIN model: the tokenizer and image processor as one MUFINProcessor, loaded through
    remote code where hf_xmc cannot be imported, preparing inputs exactly as the model does (file:// URLs too)."""
    import subprocess
    import sys

    model, rng = trained_like, np.random.default_rng(21)
    paths = save_random_images(tmp_path, rng, 2)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    assert (model_dir / "processor_config.json").exists() and (model_dir / "processing_mufin.py").exists()
    assert json.load(open(model_dir / "processor_config.json"))["auto_map"]["AutoProcessor"] == "processing_mufin.MUFINProcessor"
    texts = ["red apple house tree cat", "blue"]
    request = {"texts": texts, "images": [paths[0], "file://" + paths[1]], "max_length": model.config.max_seq_length}
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), PYTHONPATH="")
    proc = subprocess.run([sys.executable, "-c", REMOTE_PROCESSOR, str(model_dir), json.dumps(request)], capture_output=True,
                          text=True, env=env, cwd=str(tmp_path), timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][0][7:])
    assert result["class"] == "MUFINProcessor" and result["module"].startswith("transformers_modules")
    bags = model.prepare_bags(texts=texts, images=[[paths[0]], [paths[1]]])
    assert result["input_ids"] == bags["input_ids"].tolist()
    np.testing.assert_allclose(np.array(result["pixel_values"]), bags["pixel_values"].numpy(), atol=1e-6)
    # predict takes the same file:// URL as the path
    url = model.predict(["red apple"], k=5, images=[["file://" + paths[0]]])
    path = model.predict(["red apple"], k=5, images=[[paths[0]]])
    np.testing.assert_array_equal(url.label_ids, path.label_ids)
    # hf-xmc predict --image (an image-only query, and a text + image one)
    import contextlib
    import io

    from hf_xmc.cli import main as cli_main

    for argv, want in (
        (["--image", paths[1]], model.predict(images=[paths[1]], k=3)),
        (["--text", "red apple", "--image", "file://" + paths[0]], path),
    ):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli_main(["predict", str(model_dir), "--k", "3", *argv]) == 0
        record = json.loads(out.getvalue().splitlines()[0])
        assert [label["id"] for label in record["labels"]] == want.label_ids[0, :3].tolist()
        assert record["image"] == argv[-1]


def test_push_uploads_exactly_the_model_files(trained_like, tmp_path, capsys):
    """MUFIN directories push (they hold label bags, no label_embeddings.safetensors) with their label images."""
    check_push_uploads_exactly_the_model_files(trained_like, tmp_path, capsys)
    assert (tmp_path / "pushed" / LABEL_IMAGES_FILE).exists()


def test_config_validation():
    with pytest.raises(ValueError, match="label_space_size"):
        MUFINModel(MUFINConfig(label_space_size=0))
    with pytest.raises(ValueError, match="multiple of attention_heads"):
        MUFINConfig(label_space_size=2, embed_dim=10, attention_heads=4).validate_xmc()
    with pytest.raises(ValueError, match="alpha_init"):
        MUFINConfig(label_space_size=2, alpha_init=1.0).validate_xmc()
    config = MUFINConfig(label_space_size=2)
    assert config.encoder_config.model_type == "distilbert" and config.vision_config.model_type == "vit"
    assert (config.embed_dim, config.attention_heads, config.attention_dropout, config.fusion_beta, config.shortlist_size) == (192, 12, 0.3, 0.7, 100)


@pytest.fixture(scope="module")
def open_clip_dir(tmp_path_factory):
    """A tiny random CLIP saved the way open_clip's ``local-dir:`` schema reads it (open_clip_config.json + weights)."""
    open_clip = pytest.importorskip("open_clip", reason="open_clip vision towers need the vision extra")
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("open_clip")
    model_cfg = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 16},
        "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 16, "heads": 2, "layers": 1},
    }
    preprocess_cfg = {"size": 32, "mean": [0.4, 0.45, 0.5], "std": [0.25, 0.26, 0.27]}
    with open(root / "open_clip_config.json", "w") as f:
        json.dump({"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}, f)
    torch.manual_seed(3)
    clip = open_clip.CLIP(**model_cfg)
    with torch.no_grad():
        clip.visual.proj.normal_()  # away from anything an init would give, so a missed load shows
    save_file(clip.state_dict(), str(root / "open_clip_model.safetensors"))
    return str(root), clip.eval()


def test_open_clip_vision_tower(encoders, open_clip_dir, tmp_path):
    """``open_clip:local-dir:...`` gives MUFIN the CLIP's image tower (its weights, its projected embedding as the
    pooled output, its preprocessing), layer freezing over its resblocks, and a remote-code reload that predicts the same."""
    clip_dir, clip = open_clip_dir
    model = make_model((encoders[0], "open_clip:local-dir:" + clip_dir), embed_dim=8)
    assert model.config.open_clip_config["model_cfg"]["embed_dim"] == 16 and model.config.open_clip_config["preprocess_cfg"]["size"] in (32, [32, 32])
    for name, tensor in clip.visual.state_dict().items():
        torch.testing.assert_close(model.vision_encoder.visual.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    rng = np.random.default_rng(21)
    image = random_image(rng, size=40)
    pixels = model.prepare_bags(images=[[image]])["pixel_values"]
    assert pixels.shape == (1, 3, 32, 32)  # resized and centre-cropped to the CLIP's 32 x 32
    # the CLIP's own normalisation (per-channel mean / std of the stored preprocess_cfg)
    raw = model.image_processor(images=[image], do_normalize=False, return_tensors="pt")["pixel_values"]
    mean, std = torch.tensor([0.4, 0.45, 0.5]).view(1, 3, 1, 1), torch.tensor([0.25, 0.26, 0.27]).view(1, 3, 1, 1)
    torch.testing.assert_close(pixels, (raw - mean) / std, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        expected = F.adaptive_max_pool1d(clip.visual(pixels).unsqueeze(1), 8).squeeze(1)  # projected 16 -> D = 8
        torch.testing.assert_close(model.eval().image_descriptors(pixels), expected, atol=1e-5, rtol=1e-5)
    trainable = model.freeze_vision_layers(1)
    assert any(n.startswith("visual.transformer.resblocks.1.") for n in trainable)
    assert not any(n.startswith(("visual.transformer.resblocks.0.", "visual.conv1", "visual.ln_pre", "visual.positional_embedding")) for n in trainable)
    assert {"visual.ln_post.weight", "visual.proj"} <= set(trainable)
    from hf_xmc.training.recipes.mufin import fit_dimensions

    dims = {"embed_dim": None, "attention_heads": 12}
    fit_dimensions(dims, encoders[0], "open_clip:local-dir:" + clip_dir)  # train_mufin.py's sizing of D
    assert dims == {"embed_dim": 16, "attention_heads": 4}  # the CLIP's 16-d projection is the narrowest width

    paths = save_random_images(tmp_path, rng, 2)
    request = {"texts": ["red apple", None], "images": [[paths[0]], [paths[1]]]}
    before = model.predict(request["texts"], k=5, images=request["images"])
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    reloaded = AutoModel.from_pretrained(model_dir)
    np.testing.assert_array_equal(reloaded.predict(request["texts"], k=5, images=request["images"]).label_ids, before.label_ids)
    result = predict_through_remote_code(model_dir, tmp_path, request["texts"], request["images"])
    assert result["ids"] == before.label_ids.tolist()
    np.testing.assert_allclose(np.array(result["scores"]), before.scores, atol=1e-5)


def test_a_lazy_label_image_view_never_reads_the_file_saved_over_it(trained_like, tmp_path):
    """Loaded from D, an added label that is not the last removed, saved into D: the re-packed file replaces the one
    the view's offsets point into. The view moves to the new file (before, the next save copied bytes cut at the old
    offsets, undecoded), so a second save, a re-encoding and a reload give the same images and predictions; a view
    whose file was replaced behind its back refuses to read it in one line."""
    from hf_xmc.models.processing_mufin import image_file_bytes

    directory = tmp_path / "D"
    rng = np.random.default_rng(31)
    new_images = [[random_image(rng), random_image(rng)], [random_image(rng)], [random_image(rng)]]
    grown = AutoModel.from_pretrained(_saved(trained_like, tmp_path / "base"))
    grown.add_labels(["red car", "blue hat", None], uids=["n1", "n2", "n3"], images=new_images)
    grown.save_pretrained(directory)
    model = AutoModel.from_pretrained(directory)
    expected = [list(bag) for bag in model.label_images]
    model.remove_labels(["n2"])  # added, not the last
    expected = expected[:21] + expected[22:]
    queries, query_images = ["red apple", None, "blue car house"], [[random_image(rng)], [random_image(rng)], []]
    before = model.predict(queries, k=5, images=query_images)
    model.save_pretrained(directory)  # written over the file the view was reading
    assert [list(bag) for bag in model.label_images] == expected
    model.save_pretrained(directory)  # the second save: the images as they were, not bytes cut at stale offsets
    reloaded = AutoModel.from_pretrained(directory)
    assert [list(bag) for bag in reloaded.label_images] == expected
    assert expected[21] == [image_file_bytes(new_images[2][0])]
    for m in (model, reloaded):
        rows = m.label_bag_rows.clone()
        m.build_label_index()  # re-encoded from the images the view reads now: the same bags
        torch.testing.assert_close(m.label_bag_rows, rows, atol=1e-5, rtol=1e-5)
        after = m.predict(queries, k=5, images=query_images)
        np.testing.assert_array_equal(after.label_ids, before.label_ids)
        np.testing.assert_allclose(after.scores, before.scores, atol=1e-5)
    # a file replaced by someone else: the view refuses to read it rather than cut other bytes at its offsets
    stale = AutoModel.from_pretrained(directory)
    other = AutoModel.from_pretrained(directory)
    other.remove_labels(["n1"])
    other.save_pretrained(directory)
    with pytest.raises(ValueError, match=r"the label image file was replaced after this model read its offsets") as err:
        stale.label_images[20]
    assert "\n" not in str(err.value)
    # saved into its own directory without label images: the file goes, so the view's bags are read into memory first
    fresh = AutoModel.from_pretrained(directory)
    fresh.config.save_label_images = False
    fresh.save_pretrained(directory)
    assert not (directory / LABEL_IMAGES_FILE).exists()
    assert isinstance(fresh.label_images, list) and fresh.label_images == expected[:20] + expected[21:]


def _saved(model, directory):
    model.save_pretrained(directory)
    return directory
