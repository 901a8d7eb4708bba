"""SiameseXML model tests: the shared XMC mixin (transformer and bag-of-embeddings encoders), the fused ranking
against a brute-force computation, the encoder, the residual block, the re-parameterised classifiers and their
sparse gradients."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hf_xmc.models import SiameseXMLConfig, SiameseXMLModel
from hf_xmc.models.classifier_head import fuse_shortlist_scores
from hf_xmc.models.xmc_losses import decoupled_softmax_loss
from tests.models.test_modeling_common import XMCModelTesterMixin


def make_siamesexml(encoder_dir, data, **kwargs):
    model = SiameseXMLModel.from_encoder_pretrained(
        encoder_dir, label_space_size=len(data.label_texts), max_seq_length=16, label_max_seq_length=16, **kwargs
    )
    model.set_labels(data.label_texts, data.label_uids)
    return model


def perturb(model):
    """Label state, refinement vectors and residual block away from their initial values (reloads must carry them)."""
    generator = torch.Generator().manual_seed(0)
    labels = model.encode_labels()
    dim = labels.shape[1]
    centroids = labels + 0.5 * torch.randn(labels.shape, generator=generator)
    centroids[::7] = 0.0  # labels without training points: no centroid
    model.set_label_state(labels + 0.2 * torch.randn(labels.shape, generator=generator), centroids)
    with torch.no_grad():
        model.classifier.weight.copy_(0.3 * torch.randn(model.classifier.weight.shape, generator=generator))
        model.residual.weight.add_(0.1 * torch.randn(dim, dim, generator=generator))
        model.residual.bias.copy_(0.1 * torch.randn(dim, generator=generator))


class TestSiameseXMLModel(XMCModelTesterMixin):
    model_class = SiameseXMLModel
    encoder_type = "transformer"

    def make_model(self, encoder_dir, data):
        model = make_siamesexml(encoder_dir, data, encoder_type=self.encoder_type)
        if self.encoder_type == "boe":
            df = np.random.default_rng(0).integers(0, 50, model.config.boe_vocab_size)
            model.set_idf(df, 100)
        perturb(model)
        model.build_label_index()
        return model

    def test_predict_contract(self, model, tiny_task):
        """The fused ranking equals a brute-force computation of the code fusion over every label (the shortlist of
        500 covers the 40 labels)."""
        texts = tiny_task[0].test.texts[:6]
        pred = model.predict(texts, k=5)
        assert pred.label_ids.shape == (6, 5) and pred.label_ids.dtype == np.int64 and pred.scores.dtype == np.float32
        assert np.all(np.diff(pred.scores, axis=1) <= 1e-6)
        u = model.encode_queries(texts)
        model.eval()
        with torch.no_grad():
            e = model.final_embedding(u)
            w = F.normalize(model.label_text_vectors + model.classifier.weight, dim=-1)
        sims = u @ model.label_text_vectors.T + u @ model.label_centroids.T
        beta = model.config.fusion_weight
        fused = beta * torch.exp(5 * (e @ w.T - 1)) + (1 - beta) * torch.sigmoid(sims)
        np.testing.assert_array_equal(pred.label_ids, fused.topk(5, dim=1).indices.numpy())
        np.testing.assert_allclose(pred.scores, fused.topk(5, dim=1).values.numpy(), atol=1e-5)
        assert [[tiny_task[0].label_texts[i] for i in row] for row in pred.label_ids] == pred.label_texts
        with pytest.raises(ValueError, match="k must be"):
            model.predict(texts, k=0)

    def test_search_modes(self, model, tiny_task):
        texts = tiny_task[0].test.texts[:6]
        u = model.encode_queries(texts)
        model.eval()
        with torch.no_grad():
            e = model.final_embedding(u)
            w = F.normalize(model.label_text_vectors + model.classifier.weight, dim=-1)
        expected = {
            "label_text": u @ model.label_text_vectors.T,
            "shortlist": u @ model.label_text_vectors.T + u @ model.label_centroids.T,
            "classifier": e @ w.T,
        }
        for mode, scores in expected.items():
            model.set_search_mode(mode)
            pred = model.predict(texts, k=5)
            np.testing.assert_array_equal(pred.label_ids, scores.topk(5, dim=1).indices.numpy(), err_msg=mode)
        model.config.fusion = "paper"
        model.set_search_mode("fusion")
        alpha = model.config.fusion_weight
        paper = alpha * (e @ w.T) + (1 - alpha) * (e @ (model.label_text_vectors + model.label_centroids).T)
        np.testing.assert_array_equal(model.predict(texts, k=5).label_ids, paper.topk(5, dim=1).indices.numpy())
        with pytest.raises(ValueError, match="search mode"):
            model.set_search_mode("both")

    def test_search_goes_in_chunks_of_queries(self, model, tiny_task, monkeypatch):
        """Many queries are shortlisted and ranked SEARCH_CHUNK at a time (bounded hit memory), with the one-pass result."""
        from hf_xmc.models import modeling_siamesexml

        u = model.encode_queries(tiny_task[0].test.texts[:7])
        whole_scores, whole_ids = model.search(u, k=5)
        monkeypatch.setattr(modeling_siamesexml, "SEARCH_CHUNK", 3)
        sizes = []
        one_chunk = model._search_chunk
        monkeypatch.setattr(model, "_search_chunk", lambda queries, k: (sizes.append(len(queries)), one_chunk(queries, k))[1])
        scores, ids = model.search(u, k=5)
        assert sizes == [3, 3, 1]
        np.testing.assert_array_equal(ids, whole_ids)
        np.testing.assert_allclose(scores, whole_scores, rtol=1e-6)

    def test_shortlist_limits_what_is_scored(self, model, tiny_task):
        """Only the shortlist is ranked: the 2 x shortlist_per_source best rows of the index over [z~ ; v], summed per
        label (a label missing from one search adds 0), best shortlist_size kept."""
        texts = tiny_task[0].test.texts[:4]
        model.config.shortlist_size, model.config.shortlist_per_source = 3, 3
        model.set_search_mode("classifier")
        pred = model.predict(texts, k=3)
        u = model.encode_queries(texts)
        rows = u @ torch.cat([model.label_text_vectors, model.label_centroids]).T
        num_labels = model.config.label_space_size
        for i, row in enumerate(rows):
            best = row.topk(6)
            sims = {}
            for score, r in zip(best.values.tolist(), best.indices.tolist()):
                sims[r % num_labels] = sims.get(r % num_labels, 0.0) + score
            expected = sorted(sims, key=lambda label: -sims[label])[:3]
            assert set(pred.label_ids[i].tolist()) == set(expected)

    def test_classifier_starts_at_label_text_vectors(self, tiny_encoder_dir, tiny_task):
        """Module III: eta = 0, so before training cos(w_l, E(x)) = cos(z~_l, E(x))."""
        data = tiny_task[0]
        fresh = make_siamesexml(tiny_encoder_dir, data, encoder_type=self.encoder_type)
        assert torch.count_nonzero(fresh.classifier.weight) == 0
        fresh.set_label_state(fresh.encode_labels(), None)
        fresh.eval()
        u = fresh.encode_queries(data.test.texts[:5])
        with torch.no_grad():
            e = fresh.final_embedding(u)
            scores = fresh.shortlist_scores(e, np.tile(np.arange(len(data.label_texts)), (5, 1)))["classifier"]
        np.testing.assert_allclose(scores, (e @ fresh.label_text_vectors.T).numpy(), atol=1e-5)

    def test_classifier_stage_gradients_are_sparse_rows(self, model):
        dim = model.config.embedding_dim
        ids = torch.tensor([[3, 5, 7, -1], [5, 9, -1, -1]])
        targets = torch.tensor([[True, False, False, False], [True, False, False, False]])
        model.train()
        for p in model.encoder.parameters():
            p.requires_grad_(False)
        out = model(query_vectors=F.normalize(torch.randn(2, dim), dim=-1), candidate_ids=ids, candidate_targets=targets)
        out.loss.backward()
        grad = model.classifier.weight.grad.coalesce()
        assert grad.is_sparse
        touched = sorted(set(grad.indices()[0].tolist()) - {0})  # padded slots gather row 0 with a zero gradient
        assert touched == [3, 5, 7, 9]
        assert model.residual.weight.grad is not None and model.label_text_vectors.grad is None


class TestSiameseXMLBagOfEmbeddingsModel(TestSiameseXMLModel):
    encoder_type = "boe"

    def test_encoder_is_a_tfidf_bag_of_embeddings(self, model, tiny_task):
        """f_E(x) = N(GELU(E x)) with x the L2-normalised TF-IDF vector; siamese: the same tokens give cosine 1."""
        text = tiny_task[0].label_texts[3]
        batch = model.tokenize([text, text + " " + text.split()[0], text], 16)
        model.eval()
        f = model.pooled_embedding(batch["input_ids"], batch["attention_mask"])
        torch.testing.assert_close(f.norm(dim=1), torch.ones(3))
        ids = batch["input_ids"][1][batch["attention_mask"][1].bool()]
        x = torch.zeros(model.config.boe_vocab_size)
        x.index_add_(0, ids, model.encoder.idf[ids])  # tf x idf
        x = x / x.norm()
        expected = F.normalize(F.gelu(x @ model.encoder.token_embeddings.weight), dim=0)
        torch.testing.assert_close(f[1], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(f[0], f[2])
        # special tokens have no weight: [CLS] / [SEP] change nothing
        assert model.encoder.idf[model.tokenizer.cls_token_id] == 0 and model.encoder.idf[model.tokenizer.pad_token_id] == 0
        label = model.encode_labels([text])
        query = model.encode_queries([text])
        torch.testing.assert_close(label, query)

    def test_token_gradients_reach_only_batch_tokens(self, model, tiny_task):
        batch = model.tokenize(tiny_task[0].train.texts[:4], 16)
        model.train()
        model.pooled_embedding(batch["input_ids"], batch["attention_mask"]).sum().backward()
        grad = model.encoder.token_embeddings.weight.grad
        assert grad.is_sparse
        grad = grad.coalesce()
        rows = set(grad.indices()[0][grad.values().abs().sum(dim=1) > 0].tolist())  # padding rows carry zeros
        assert rows == set(batch["input_ids"][batch["attention_mask"].bool()].tolist()) - set(model.tokenizer.all_special_ids)


def test_residual_block_is_identity_initialised_and_spectrally_normalised(tiny_encoder_dir, tiny_task):
    model = make_siamesexml(tiny_encoder_dir, tiny_task[0])
    block = model.residual
    torch.testing.assert_close(block.weight, torch.eye(block.weight.shape[0]))
    assert float(block.scale) == 1.0 and torch.count_nonzero(block.bias) == 0
    block.eval()
    u = F.normalize(torch.randn(5, block.weight.shape[0]), dim=-1)
    torch.testing.assert_close(block(u), u + F.relu(u))  # SN(I) = I
    assert (F.cosine_similarity(block(u), u) > 0).all()
    with torch.no_grad():
        block.weight.mul_(7.0)  # spectral normalisation undoes the scale
    torch.testing.assert_close(block(u), u + F.relu(u))
    # a general W: the power iteration converges to the largest singular value
    with torch.no_grad():
        block.weight.copy_(torch.randn(block.weight.shape, generator=torch.Generator().manual_seed(0)))
    block.train()
    for _ in range(200):
        sigma = block.spectral_norm()
    torch.testing.assert_close(sigma, torch.linalg.matrix_norm(block.weight.detach(), ord=2), rtol=1e-3, atol=1e-4)


def test_reparameterisation_equals_training_a_free_matrix(tiny_encoder_dir, tiny_task):
    """Spec check 7: training eta with z~ fixed equals training W = z~ + eta directly (Adam, no weight decay)."""
    model = make_siamesexml(tiny_encoder_dir, tiny_task[0], sparse_label_gradients=False)
    num_labels, dim = model.label_text_vectors.shape
    model.set_label_state(torch.randn(num_labels, dim), None)
    free = torch.nn.Parameter(model.label_text_vectors.clone())
    opt_eta = torch.optim.Adam([model.classifier.weight], lr=0.05)
    opt_free = torch.optim.Adam([free], lr=0.05)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, num_labels, (6, 5), generator=generator)
    for _ in range(3):
        e = F.normalize(torch.randn(6, dim, generator=generator), dim=-1)
        target = torch.rand(6, 5, generator=generator)
        for opt, weights in ((opt_eta, lambda: model.classifier_weights(ids)), (opt_free, lambda: F.normalize(free[ids], dim=-1))):
            opt.zero_grad()
            ((weights() @ e.unsqueeze(-1)).squeeze(-1) - target).square().sum().backward()
            opt.step()
    e = F.normalize(torch.randn(3, dim), dim=-1)
    with torch.no_grad():
        all_ids = torch.arange(num_labels)
        torch.testing.assert_close(model.classifier_weights(all_ids) @ e.T, F.normalize(free, dim=-1) @ e.T, atol=1e-6, rtol=1e-5)


def test_forward_uses_the_configured_losses(tiny_encoder_dir, tiny_task):
    """Module I with the softmax loss and Module IV with the bce loss equal the losses of the model's own scores."""
    data = tiny_task[0]
    model = make_siamesexml(tiny_encoder_dir, data, siamese_loss="softmax", siamese_scale=10.0, classifier_loss="bce", classifier_scale=5.0)
    model.eval()

    def tokens(texts):
        return model.tokenizer(list(texts), padding=True, truncation=True, max_length=16, return_tensors="pt")

    q, lab, cen = tokens(data.train.texts[:3]), tokens(data.label_texts[:3]), tokens(data.train.texts[3:6])
    targets = torch.eye(3, dtype=torch.bool)
    targets[0, 1] = True
    out = model(input_ids=q["input_ids"], attention_mask=q["attention_mask"], label_input_ids=lab["input_ids"],
                label_attention_mask=lab["attention_mask"], targets=targets, centroid_input_ids=cen["input_ids"],
                centroid_attention_mask=cen["attention_mask"])
    with torch.no_grad():
        x = model.pooled_embedding(q["input_ids"], q["attention_mask"])
        z = model.pooled_embedding(lab["input_ids"], lab["attention_mask"])
        c = F.normalize(model.pooled_embedding(cen["input_ids"], cen["attention_mask"]) + z, dim=-1)
    w = model.config.siamese_centroid_weight
    expected = (1 - w) * decoupled_softmax_loss(10.0 * x @ z.T, targets) + w * decoupled_softmax_loss(10.0 * x @ c.T, targets)
    torch.testing.assert_close(out.loss, expected)

    ids = torch.tensor([[0, 4, 7], [2, 5, -1]])
    positive = torch.tensor([[True, False, False], [True, False, False]])
    u = F.normalize(torch.randn(2, x.shape[1], generator=torch.Generator().manual_seed(0)), dim=-1)
    out = model(query_vectors=u, candidate_ids=ids, candidate_targets=positive)
    with torch.no_grad():
        scores = (model.classifier_weights(ids.clamp(min=0)) @ model.final_embedding(u).unsqueeze(-1)).squeeze(-1)
    per_slot = F.binary_cross_entropy_with_logits(5.0 * scores, positive.float(), reduction="none")
    torch.testing.assert_close(out.loss, per_slot[ids >= 0].sum() / 2)  # kappa 3 keeps both negatives of each point


def test_fusion_formulas_by_hand():
    classifier = np.array([[1.0, 0.5]], dtype=np.float32)
    shortlist = np.array([[0.0, 2.0]], dtype=np.float32)
    fused = fuse_shortlist_scores(classifier, shortlist, 0.25, "code")
    expected = [0.25 * 1.0 + 0.75 * 0.5, 0.25 * np.exp(-2.5) + 0.75 / (1 + np.exp(-2.0))]
    np.testing.assert_allclose(fused[0], expected, rtol=1e-6)
    paper = fuse_shortlist_scores(classifier, shortlist, 0.25, "paper", label_side=np.array([[0.4, 1.2]]))
    np.testing.assert_allclose(paper[0], [0.25 + 0.75 * 0.4, 0.125 + 0.75 * 1.2], rtol=1e-6)
    with pytest.raises(ValueError, match="label-side"):
        fuse_shortlist_scores(classifier, shortlist, 0.5, "paper")


def test_config_validation():
    with pytest.raises(ValueError, match="label_space_size"):
        SiameseXMLConfig(label_space_size=0).validate_xmc()
    with pytest.raises(ValueError, match="boe_vocab_size"):
        SiameseXMLConfig(label_space_size=3, encoder_type="boe").validate_xmc()
    with pytest.raises(ValueError, match="siamese_c"):
        SiameseXMLConfig(label_space_size=3, siamese_c=1.0).validate_xmc()
    with pytest.raises(ValueError, match="classifier_negatives"):
        SiameseXMLConfig(label_space_size=3, classifier_negatives="random").validate_xmc()
    with pytest.raises(ValueError, match="siamese_loss"):
        SiameseXMLConfig(label_space_size=3, siamese_loss="bce").validate_xmc()
    with pytest.raises(ValueError, match="classifier_loss"):
        SiameseXMLConfig(label_space_size=3, classifier_loss="triplet").validate_xmc()
    with pytest.raises(ValueError, match="siamese_scale"):
        SiameseXMLConfig(label_space_size=3, siamese_scale=0.0).validate_xmc()
