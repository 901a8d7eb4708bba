"""The static query encoder: its vectors are the normalised mean of its token rows, the fit moves it toward the tower,
it fuses with its own weights and calibration, saves and reloads with equal outputs (remote code and pipeline
included), is refused once the tower changed, and comes out of every training script with --static_query_encoder."""

import json
import logging
import os

import numpy as np
import pytest
import torch
from transformers import AutoModel

from hf_xmc import cli
from hf_xmc.models import DEXMLModel, SiameseXMLModel, UniDECModel
from hf_xmc.models.calibration import ScoreCalibration
from hf_xmc.models.provenance import StaleDerivedPartError
from hf_xmc.models.static_encoder import (
    STATIC_ENCODER_FILE,
    STATIC_ENCODER_META,
    StaticQueryEncoder,
    gather_bags,
    tower_token_vectors,
)
from hf_xmc.training.evaluation import XMCEvaluator
from hf_xmc.training.lexical import fit_lexical_channel
from hf_xmc.training.static_encoder import tune_static_query_encoder
from tests.models.test_modeling_common import predict_through_remote_code
from tests.test_training import contract_args, run_script


def tiny_model(tiny_encoder_dir, data, channel: bool = False):
    torch.manual_seed(0)
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir, max_seq_length=16)
    model.set_labels(data.label_texts, data.label_uids)
    if channel:
        fit_lexical_channel(model, data.train, ranker_weight=1.0, text_weight=0.5, n_threads=1)
    else:
        model.build_label_index()
    return model


def cosine_to_tower(model, texts) -> float:
    static = model.static_query_vectors(texts)
    tower = model.query_search_vectors(texts)
    return float(torch.nn.functional.cosine_similarity(static, tower, dim=1).mean())


def test_static_vectors_are_the_normalised_mean_of_their_token_rows(tiny_encoder_dir, tiny_task):
    data = tiny_task[0]
    model = tiny_model(tiny_encoder_dir, data)
    tokenizer = model.tokenizer
    encoder = StaticQueryEncoder(len(tokenizer), 4, output_scale=2.0)
    table = torch.randn(len(tokenizer), 4, generator=torch.Generator().manual_seed(3))
    encoder.embeddings.weight.data.copy_(table)
    long_text = " ".join(data.train.texts[:6])  # more tokens than the tower reads: cut where the tower cuts
    texts = [data.train.texts[0], long_text, ""]
    got = encoder.encode(tokenizer, texts, max_length=16)
    for text, vector in zip(texts, got):
        ids = tokenizer(text, truncation=True, max_length=16)["input_ids"]
        ids = [i for i in ids if i not in tokenizer.all_special_ids]  # the tower's tokens without [CLS] / [SEP]
        if not ids:
            np.testing.assert_array_equal(vector.numpy(), np.zeros(4, dtype=np.float32))  # no token: scores 0 everywhere
            continue
        mean = table[ids].mean(0)
        np.testing.assert_allclose(vector.numpy(), (2.0 * mean / mean.norm()).numpy(), rtol=1e-5, atol=1e-6)
    assert len(tokenizer(long_text, add_special_tokens=False)["input_ids"]) > 14  # the cut was exercised


def test_token_vectors_are_each_token_through_the_tower_between_its_special_tokens(tiny_encoder_dir, tiny_task):
    model = tiny_model(tiny_encoder_dir, tiny_task[0])
    vectors = tower_token_vectors(model, batch_size=100)
    tokenizer = model.tokenizer
    assert vectors.shape == (len(tokenizer), model.config.hidden_size if hasattr(model.config, "hidden_size") else vectors.shape[1])
    for token_id in (tokenizer.unk_token_id, 7, len(tokenizer) - 1):
        ids = torch.tensor([[tokenizer.cls_token_id, token_id, tokenizer.sep_token_id]])
        with torch.no_grad():
            expected = model.eval().embed(ids, torch.ones_like(ids))[0]
        np.testing.assert_allclose(vectors[token_id].numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)


def test_the_fit_moves_the_static_vectors_toward_the_towers(tiny_encoder_dir, tiny_task):
    data = tiny_task[0]
    model = tiny_model(tiny_encoder_dir, data)
    texts = list(data.train.texts)
    model.fit_static_query_encoder(texts, epochs=0, init="random", seed=1)
    random_start = cosine_to_tower(model, texts)
    model.fit_static_query_encoder(texts, epochs=0, seed=1)
    tower_start = cosine_to_tower(model, texts)
    model.fit_static_query_encoder(texts, epochs=30, learning_rate=1e-2, seed=1)
    fitted = cosine_to_tower(model, texts)
    losses = model.static_query_encoder_meta["fit"]["epoch_losses"]
    assert tower_start > random_start + 0.1  # Model2Vec's start is already in the tower's space
    assert fitted > tower_start + 0.05 and losses[-1] < 0.7 * losses[0]
    assert fitted > cosine_to_tower(model, list(data.test.texts)) - 0.2  # held-out queries follow, less closely
    assert not any(name.startswith("_static") or "static" in name for name, _ in model.named_parameters())  # no weight of the model


def test_a_saved_static_encoder_reloads_with_equal_rankings_through_remote_code_and_the_pipeline(tiny_encoder_dir, tiny_task, tmp_path):
    data = tiny_task[0]
    model = tiny_model(tiny_encoder_dir, data, channel=True)
    model.fit_static_query_encoder(list(data.train.texts), epochs=3, seed=0)
    model.set_static_fusion_weights({"ranker_weight": 0.25, "text_weight": 1.5})
    texts = list(data.test.texts[:12])
    before = model.predict(texts, k=5, query_encoder="static")
    tower = model.predict(texts, k=5)
    model.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / STATIC_ENCODER_FILE).exists() and (tmp_path / "m" / STATIC_ENCODER_META).exists()
    reloaded = AutoModel.from_pretrained(tmp_path / "m")
    after = reloaded.predict(texts, k=5, query_encoder="static")
    np.testing.assert_array_equal(after.label_ids, before.label_ids)
    np.testing.assert_allclose(after.scores, before.scores, rtol=1e-6)
    np.testing.assert_array_equal(reloaded.predict(texts, k=5).label_ids, tower.label_ids)
    assert reloaded.static_query_encoder_meta["fusion"] == {"ranker_weight": 0.25, "text_weight": 1.5}
    remote = predict_through_remote_code(tmp_path / "m", tmp_path, texts[:4], pipeline_inputs=texts[:2], query_encoder="static")
    assert remote["ids"] == before.label_ids[:4].tolist()
    np.testing.assert_allclose(remote["scores"], before.scores[:4], rtol=1e-5)
    assert [r["label_id"] for r in remote["pipeline"]["many"][1]] == before.label_ids[1].tolist()


def test_the_static_encoder_fuses_with_its_own_weights_and_calibration(tiny_encoder_dir, tiny_task, caplog):
    data = tiny_task[0]
    model = tiny_model(tiny_encoder_dir, data, channel=True)
    model.set_score_calibration(ScoreCalibration("platt", a=5.0, b=0.0))  # the tower's
    tower_calibration = dict(model.config.score_calibration)
    model.fit_static_query_encoder(list(data.train.texts), epochs=3, seed=0)
    model.set_static_fusion_weights({"ranker_weight": 0.0, "text_weight": 2.0})
    texts = list(data.test.texts[:10])
    channel = model.lexical_channel
    pred = model.predict(texts, k=5, query_encoder="static")
    # by hand: the static vectors searched, fused with the static encoder's weights
    dense_scores, dense_ids = model.search(model.static_query_vectors(texts), int(channel.settings["dense_depth"]))
    kept = dict(channel.settings)
    channel.settings.update(ranker_weight=0.0, text_weight=2.0)
    scores, ids = channel.fuse(texts, dense_scores, dense_ids, 5)
    channel.settings.update(kept)
    np.testing.assert_array_equal(pred.label_ids, ids)
    np.testing.assert_allclose(pred.scores, scores, rtol=1e-6)
    assert (channel.settings["ranker_weight"], channel.settings["text_weight"]) == (1.0, 0.5)  # the tower's, restored
    assert pred.probabilities is None  # the tower's calibration is not the static encoder's
    # its own calibration, fitted on its own ranking; the tower's untouched
    evaluator = XMCEvaluator(data.test, data.label_texts, data.label_uids, train_targets=data.train.targets, name="eval")
    tune_static_query_encoder(model, data.test, data.train.targets, evaluator, calibration_method="isotonic")
    assert model.config.score_calibration == tower_calibration
    assert model.static_query_encoder_meta["score_calibration"]["method"] == "isotonic"
    assert set(model.static_query_encoder_meta["fusion"]) == {"ranker_weight", "text_weight"}  # tuned on the split
    calibrated = model.predict(texts, k=5, query_encoder="static")
    with model.using_query_encoder("static"):
        expected = model.score_calibration(calibrated.scores)
    np.testing.assert_allclose(calibrated.probabilities, np.where(calibrated.label_ids >= 0, expected, 0.0), rtol=1e-6)
    assert model.predict(texts, k=5).probabilities is not None  # the tower keeps its own
    # fitted again, the table changed: its calibration (tied to its ranking) is dropped, the tower's kept
    model.fit_static_query_encoder(list(data.train.texts), epochs=1, seed=5)
    model.static_query_encoder_meta["score_calibration"] = calibrated_meta = {**ScoreCalibration("platt", a=1.0, b=0.0).to_dict(),
                                                                           "fingerprint": {"query_encoder": "static:0000"}}
    with caplog.at_level(logging.WARNING):
        assert model.predict(texts, k=5, query_encoder="static").probabilities is None
    assert "query_encoder" in caplog.text and calibrated_meta is not None
    assert model.predict(texts, k=5).probabilities is not None


def test_the_static_encoder_keeps_its_own_ranking_settings_tuned_on_its_ranking(tiny_encoder_dir, tiny_task, tmp_path):
    """SiameseXML's classifier share (a tunable ranking setting) is tuned again with the static encoder ranking and
    kept in its meta: used while it ranks, saved and reloaded, while the tower keeps the config's value."""
    from tests.models.test_modeling_siamesexml import make_siamesexml, perturb

    data = tiny_task[0]
    torch.manual_seed(0)
    model = make_siamesexml(tiny_encoder_dir, data)
    perturb(model)
    model.config.fusion_weight = 0.5
    model.fit_static_query_encoder(list(data.train.texts), epochs=2, seed=0)
    evaluator = XMCEvaluator(data.test, data.label_texts, data.label_uids, train_targets=data.train.targets, name="eval")
    info = tune_static_query_encoder(model, data.test, data.train.targets, evaluator)
    chosen = model.static_query_encoder_meta["ranking"]["fusion_weight"]
    assert info["static_tuned_fusion_weight"] == chosen and chosen in SiameseXMLModel.tunable_ranking_settings["fusion_weight"]
    assert model.config.fusion_weight == 0.5  # the tower's, restored after the tuning
    texts = list(data.test.texts[:10])
    model.set_static_ranking_settings({"fusion_weight": 1.0})  # the classifiers alone, so the two rankings must differ
    with model.using_query_encoder("static"):
        assert model.config.fusion_weight == 1.0
    assert model.config.fusion_weight == 0.5
    static = model.predict(texts, k=5, query_encoder="static")
    vectors = model.static_query_vectors(texts)
    model.config.fusion_weight = 1.0
    expected_scores, expected_ids = model.search(vectors, 5)
    model.config.fusion_weight = 0.5
    np.testing.assert_array_equal(static.label_ids, expected_ids)
    np.testing.assert_allclose(static.scores, expected_scores, rtol=1e-6)
    other_scores, _ = model.search(vectors, 5)
    assert not np.allclose(other_scores, expected_scores)  # the setting matters to this ranking
    with pytest.raises(ValueError, match="no tunable ranking setting 'dense_weight'"):
        model.set_static_ranking_settings({"dense_weight": 1.0})
    model.save_pretrained(tmp_path / "saved")
    reloaded = SiameseXMLModel.from_pretrained(tmp_path / "saved")
    assert reloaded.static_query_encoder_meta["ranking"] == {"fusion_weight": 1.0} and reloaded.config.fusion_weight == 0.5
    np.testing.assert_array_equal(reloaded.predict(texts, k=5, query_encoder="static").label_ids, static.label_ids)


def test_a_static_encoder_of_another_tower_is_refused_and_not_saved(tiny_encoder_dir, tiny_task, tmp_path):
    data = tiny_task[0]
    model = tiny_model(tiny_encoder_dir, data)
    with pytest.raises(ValueError, match="no static query encoder"):
        model.predict(["a"], query_encoder="static")
    with pytest.raises(ValueError, match="query_encoder must be one of"):
        model.predict(["a"], query_encoder="bag")
    model.fit_static_query_encoder(list(data.train.texts[:100]), epochs=1)
    model.set_query_encoder("static")  # a server's default
    assert model.predict(["a"]).label_ids.shape == (1, 5)
    with torch.no_grad():
        next(model.parameters()).add_(0.01)  # trained further: the static encoder maps into a space the labels left
    with pytest.raises(StaleDerivedPartError, match="static query encoder was made from other weights"):
        model.predict(["a"])
    with pytest.raises(StaleDerivedPartError):
        model.set_query_encoder("static")
    model.set_query_encoder("transformer")
    fresh = tiny_model(tiny_encoder_dir, data)
    fresh.fit_static_query_encoder(list(data.train.texts[:100]), epochs=1)
    fresh.predict(["a"], query_encoder="static")  # checked and cached
    fresh.config.max_seq_length = 8  # the tower now reads other tokens: the cached check must not let it through
    with pytest.raises(StaleDerivedPartError, match="max_seq_length"):
        fresh.predict(["a"], query_encoder="static")
    model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved" / STATIC_ENCODER_FILE).exists()  # a stale encoder is not carried
    unidec = UniDECModel.from_encoder_pretrained(tiny_encoder_dir, label_space_size=len(data.label_texts), max_seq_length=16)
    unidec.set_labels(data.label_texts, data.label_uids)
    unidec.fit_static_query_encoder(list(data.train.texts[:100]), epochs=1)
    assert unidec.static_query_vectors(["a"]).shape[1] == unidec.query_search_vectors(["a"]).shape[1]  # its search space
    unidec.set_search_mode("de" if unidec.search_mode != "de" else "concat")
    with pytest.raises(StaleDerivedPartError, match="query_head"):  # another head: another space
        unidec.predict(["a"], query_encoder="static")


def test_a_saved_directory_missing_half_of_the_static_encoder_is_refused_in_one_line(tiny_encoder_dir, tiny_task, tmp_path):
    from hf_xmc.models.model_files import ModelFileError

    data = tiny_task[0]
    model = tiny_model(tiny_encoder_dir, data)
    model.fit_static_query_encoder(list(data.train.texts[:50]), epochs=1)
    model.save_pretrained(tmp_path / "m")
    os.remove(tmp_path / "m" / STATIC_ENCODER_META)
    with pytest.raises(ModelFileError, match=f"{STATIC_ENCODER_META}: missing"):
        AutoModel.from_pretrained(tmp_path / "m")


def test_training_scripts_fit_tune_and_report_the_static_encoder_and_the_cli_serves_it(tiny_task, tiny_encoder_dir, tmp_path, capsys):
    _, task_dir = tiny_task
    out = tmp_path / "out"
    proc = run_script(contract_args(task_dir, tiny_encoder_dir, str(out), epochs="1") + ["--lexical_channel", "omikuji", "--static_query_encoder",
                                                                                       "--static_query_encoder_epochs", "3",
                                                                                       "--static_query_encoder_precision", "bfloat16",
                                                                                       "--static_query_encoder_objective", "cosine+ranking+labels"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "eval_results.json").read_text())
    for key in ("test_static_P@1", "test_static_dense_P@1", "eval_static_P@1", "static_fit_runtime", "static_lexical_ranker_weight"):
        assert key in results, key
    assert (out / STATIC_ENCODER_FILE).exists()
    meta = json.loads((out / STATIC_ENCODER_META).read_text())
    assert meta["fusion"]["ranker_weight"] == results["static_lexical_ranker_weight"] and "score_calibration" in meta
    assert results["static_fit_bf16"] == 1 and meta["fit"]["encode_precision"] == "bfloat16"  # the flags reached the fit
    assert meta["fit"]["loss"] == "cosine+ranking+labels" and meta["fit"]["ranking_depth"] > 0 and meta["fit"]["label_weight"] == 1.0
    assert results["static_tuning_queries_seen_by_ranker"] == 0  # tuned before the channel's ranker is refit on those queries
    reloaded = AutoModel.from_pretrained(out)
    assert reloaded.score_calibration is not None  # the tower's, recorded after training (fused AdamW: see test_provenance)
    with reloaded.using_query_encoder("static"):
        assert reloaded.score_calibration is not None  # its own, carried over the ranker's refit
    # the saved model scores what the run reported, through the CLI's evaluate
    code = cli.main(["evaluate", str(out), "--test_file", f"{task_dir}/tst.json.gz", "--train_file", f"{task_dir}/trn.json.gz",
                     "--query_encoder", "static"])
    assert code == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["test_P@1"] == pytest.approx(results["test_static_P@1"], abs=1e-9)
    assert measured["test_dense_P@1"] == pytest.approx(results["test_static_dense_P@1"], abs=1e-9)
    # predict and a model without one
    assert cli.main(["predict", str(out), "--text", "some query", "--query_encoder", "static", "--k", "3"]) == 0
    assert len(json.loads(capsys.readouterr().out)["labels"]) == 3
    plain = tmp_path / "plain"
    assert run_script(contract_args(task_dir, tiny_encoder_dir, str(plain), epochs="0.2")).returncode == 0
    assert cli.main(["predict", str(plain), "--text", "q", "--query_encoder", "static"]) != 0
    assert "no static query encoder" in capsys.readouterr().err
    # hf-xmc fit-static adds one to a saved model
    code = cli.main(["fit-static", str(plain), "--train_file", f"{task_dir}/trn.json.gz", "--epochs", "2", "--output_dir", str(tmp_path / "grown"),
                     "--precision", "float32", "--objective", "cosine+labels"])
    assert code == 0
    fitted = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "grown" / STATIC_ENCODER_META).read_text())["fit"]["loss"] == "cosine+labels"  # the training file's labels reached it
    assert fitted["static_fit_queries"] > 0 and (tmp_path / "grown" / STATIC_ENCODER_FILE).exists()
    assert fitted["static_fit_bf16"] == 0 and json.loads((tmp_path / "grown" / STATIC_ENCODER_META).read_text())["fit"]["encode_precision"] == "float32"


def test_a_server_answers_with_the_static_encoder_it_was_started_with(tiny_encoder_dir, tiny_task):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from hf_xmc.serving import create_app
    from tests.test_serving import call, running

    data = tiny_task[0]
    model = tiny_model(tiny_encoder_dir, data)
    with pytest.raises(ValueError, match="no static query encoder"):  # hf-xmc serve --query_encoder static, before any fit
        create_app(model, query_encoder="static")
    model.fit_static_query_encoder(list(data.train.texts), epochs=2)
    texts = list(data.test.texts[:3])
    static = model.predict(texts, k=4, query_encoder="static")
    tower = model.predict(texts, k=4, query_encoder="transformer")
    assert not np.array_equal(static.label_ids, tower.label_ids)  # the two encoders rank differently here
    with running(create_app(model, max_wait_ms=0, query_encoder="static")) as url:
        status, body = call(url + "/predict", {"texts": texts, "k": 4})
    assert status == 200
    assert [[r["id"] for r in row] for row in body["predictions"]] == static.label_ids.tolist()


def test_the_static_encoder_exports_as_a_sentence_transformers_static_embedding(tiny_encoder_dir, tiny_task, tmp_path):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    data = tiny_task[0]
    model = tiny_model(tiny_encoder_dir, data)
    model.fit_static_query_encoder(list(data.train.texts), epochs=2)
    model.save_static_query_encoder(tmp_path / "st")
    texts = [*data.test.texts[:5], " ".join(data.train.texts[:6])]  # the last one longer than the tower reads
    st = sentence_transformers.SentenceTransformer(str(tmp_path / "st"), device="cpu")
    np.testing.assert_allclose(st.encode(texts, convert_to_numpy=True), model.static_query_vectors(texts).numpy(), atol=1e-6)
    with pytest.raises(ValueError, match="not empty"):
        model.save_static_query_encoder(tmp_path / "st")


def test_the_fit_encodes_the_towers_vectors_in_chunks_with_the_same_result(tiny_encoder_dir, tiny_task, monkeypatch):
    from hf_xmc.models import static_encoder

    data = tiny_task[0]
    model = tiny_model(tiny_encoder_dir, data)
    texts = list(data.train.texts[:50])
    whole, _ = static_encoder.fit_static_encoder(model, texts, epochs=2, seed=3)
    monkeypatch.setattr(static_encoder, "FIT_ENCODE_CHUNK", 7)  # 50 queries in 8 chunks, the last one short
    chunked, _ = static_encoder.fit_static_encoder(model, texts, epochs=2, seed=3)
    torch.testing.assert_close(chunked.embeddings.weight, whole.embeddings.weight)
    assert chunked.output_scale == whole.output_scale


def test_a_bfloat16_fit_encodes_the_tower_under_autocast_and_lands_beside_the_float32_fit(tiny_encoder_dir, tiny_task, monkeypatch):
    """``encode_dtype=torch.bfloat16`` runs the tower's passes (the targets and the initial rows) under bfloat16
    autocast and says so in the fit's record; the table it fits is the float32 fit's to bfloat16's precision."""
    from hf_xmc.models import static_encoder

    data = tiny_task[0]
    model = tiny_model(tiny_encoder_dir, data)
    texts = list(data.train.texts[:50])
    seen = []
    embed = model.embed

    def recording_embed(*args, **kwargs):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return embed(*args, **kwargs)

    monkeypatch.setattr(model, "embed", recording_embed)
    full, fit32 = static_encoder.fit_static_encoder(model, texts, epochs=2, seed=3)
    assert set(seen) == {None} and fit32["encode_precision"] == "float32"
    seen.clear()
    half, fit16 = static_encoder.fit_static_encoder(model, texts, epochs=2, seed=3, encode_dtype=torch.bfloat16)
    assert set(seen) == {torch.bfloat16} and fit16["encode_precision"] == "bfloat16"
    assert model.encoding_autocast_dtype is None  # restored after the fit
    assert not torch.equal(half.embeddings.weight, full.embeddings.weight)  # the autocast was real
    cosine = torch.nn.functional.cosine_similarity(half.embeddings.weight.detach(), full.embeddings.weight.detach(), dim=1)
    assert float(cosine.min()) > 0.98


def test_the_fits_batch_gather_takes_each_chosen_bag_whole_and_in_order():
    rng = np.random.default_rng(0)
    lengths = torch.from_numpy(rng.integers(0, 6, size=40))  # empty bags included
    offsets = torch.zeros(40, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)[:-1]
    ids = torch.from_numpy(rng.integers(0, 1000, size=int(lengths.sum())))
    for rows in (torch.tensor([5]), torch.from_numpy(rng.permutation(40)[:17]), torch.tensor([3, 3, 0])):
        bag_ids, bag_offsets = gather_bags(ids, offsets, lengths, rows)
        expected = [ids[offsets[r] : offsets[r] + lengths[r]] for r in rows.tolist()]
        assert torch.equal(bag_ids, torch.cat(expected))
        assert bag_offsets.tolist() == np.concatenate([[0], np.cumsum([len(e) for e in expected])[:-1]]).tolist()


def test_the_ranking_objectives_loss_is_the_kl_of_the_towers_softmax_to_the_static_encoders_over_the_batchs_top_labels():
    """Pinned by hand: two queries, five labels (norms 2, so the temperature is 0.5 x 2 = 1), the tower's top 2 of
    each; the loss is the mean over the batch of KL(softmax(tower scores) || softmax(static scores)) over the union of
    the two top lists, computed here with numpy from the definitions."""
    from hf_xmc.models.label_index import LabelIndex
    from hf_xmc.models.static_encoder import TowerRanking

    labels = np.array([[2, 0], [0, 2], [-2, 0], [0, -2], [2 ** 0.5, 2 ** 0.5]], dtype=np.float32)
    wanted = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # tower top 2: labels {0, 4} and {1, 4}
    predicted = torch.nn.functional.normalize(torch.tensor([[0.6, 0.8], [-1.0, 0.2]]), dim=1)
    ranking = TowerRanking(LabelIndex(labels, kind="exact"), wanted.half(), depth=2, temperature=0.5)
    assert ranking.temperature == pytest.approx(1.0)
    assert sorted(ranking.top[0].tolist()) == [0, 4] and sorted(ranking.top[1].tolist()) == [1, 4]
    got = float(ranking.loss(torch.tensor([0, 1]), predicted, wanted))
    union = labels[[0, 1, 4]]

    def log_softmax(x):
        x = x - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))

    p, q = log_softmax(wanted.numpy() @ union.T), log_softmax(predicted.numpy() @ union.T)
    assert got == pytest.approx(float((np.exp(p) * (p - q)).sum(axis=1).mean()), rel=1e-5)
    assert float(ranking.loss(torch.tensor([0, 1]), wanted, wanted)) == pytest.approx(0.0, abs=1e-6)  # the tower itself: 0


def test_the_ranking_objective_fits_the_towers_ranking_closer_than_the_cosine_alone(tiny_encoder_dir, tiny_task):
    """Same start, epochs and seed: the fit with the ranking objective ends nearer the tower's ranking of the fitted
    queries (the KL it minimises, measured with the same TowerRanking) than the cosine-only fit, and says how it was
    fitted in its record."""
    from hf_xmc.models import static_encoder

    data = tiny_task[0]
    model = tiny_model(tiny_encoder_dir, data)
    texts = list(data.train.texts)
    tower = torch.nn.functional.normalize(model.query_search_vectors(texts).float(), dim=1)
    measure = static_encoder.TowerRanking(model.ensure_label_index(), tower, depth=8, temperature=0.05)

    def ranking_gap(encoder):
        static = torch.nn.functional.normalize(encoder.encode(model.tokenizer, texts, int(model.config.max_seq_length)), dim=1)
        return float(measure.loss(torch.arange(len(texts)), static, tower))

    cosine, fit_cosine = static_encoder.fit_static_encoder(model, texts, epochs=6, learning_rate=1e-2, seed=2)
    ranked, fit_ranked = static_encoder.fit_static_encoder(model, texts, epochs=6, learning_rate=1e-2, seed=2, objective="cosine+ranking",
                                                           ranking_depth=8, ranking_weight=1.0)
    assert ranking_gap(ranked) < 0.9 * ranking_gap(cosine)
    assert fit_cosine["loss"] == "cosine" and "ranking_depth" not in fit_cosine
    assert fit_ranked["loss"] == "cosine+ranking" and fit_ranked["ranking_depth"] == 8 and fit_ranked["ranking_weight"] == 1.0
    with pytest.raises(ValueError, match="objective must be one of"):
        static_encoder.fit_static_encoder(model, texts, epochs=1, objective="ranking")
    for bad in ({"ranking_temperature": float("inf")}, {"ranking_temperature": float("nan")}, {"ranking_weight": float("inf")},
                {"ranking_weight": -1.0}, {"ranking_depth": 2.5}, {"ranking_depth": 0}):
        with pytest.raises(ValueError, match="need an integer ranking_depth"):
            static_encoder.fit_static_encoder(model, texts, epochs=1, objective="cosine+ranking", **bad)


def test_the_label_objectives_loss_is_each_querys_own_labels_cross_entropy_over_the_batchs_candidates():
    """Pinned by hand: the labels of the test above (temperature 1), the tower's top 2 of each query; query 0's labels
    are {0, 2}, query 1's {3} and query 2 has none (it adds nothing). The candidates are the union of the tower's top
    rows and the labels' rows, {0, 1, 2, 3, 4}; the loss is the mean over the labelled queries of -mean log softmax of
    their labels. A model of two index rows per label (SiameseXML) counts both of a label's rows as its positives."""
    import scipy.sparse as sp

    from hf_xmc.models.label_index import LabelIndex
    from hf_xmc.models.static_encoder import TowerRanking

    labels = np.array([[2, 0], [0, 2], [-2, 0], [0, -2], [2 ** 0.5, 2 ** 0.5]], dtype=np.float32)
    wanted = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    predicted = torch.nn.functional.normalize(torch.tensor([[0.6, 0.8], [-1.0, 0.2], [0.3, 0.3]]), dim=1)
    ranking = TowerRanking(LabelIndex(labels, kind="exact"), wanted.half(), depth=2, temperature=0.5)
    targets = sp.csr_matrix(np.array([[1, 0, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 0, 0]], dtype=np.float32))
    got = float(ranking.label_loss(torch.tensor([0, 1, 2]), predicted, targets))
    scores = predicted.numpy() @ labels.T
    log_p = scores - np.log(np.exp(scores).sum(axis=1, keepdims=True))
    assert got == pytest.approx(-((log_p[0, 0] + log_p[0, 2]) / 2 + log_p[1, 3]) / 2, rel=1e-5)
    # two rows a label: rows l and 5 + l are label l's (the index of 10 rows holds the same vectors twice)
    doubled = TowerRanking(LabelIndex(np.concatenate([labels, labels]), kind="exact"), wanted.half(), depth=2, temperature=0.5)
    scores = predicted.numpy() @ np.concatenate([labels, labels]).T
    candidates = sorted(set(doubled.top[:3].flatten().tolist()) | {0, 5, 2, 7, 3, 8})
    log_p = scores[:, candidates] - np.log(np.exp(scores[:, candidates]).sum(axis=1, keepdims=True))
    at = {row: j for j, row in enumerate(candidates)}
    expected = -((log_p[0, at[0]] + log_p[0, at[5]] + log_p[0, at[2]] + log_p[0, at[7]]) / 4 + (log_p[1, at[3]] + log_p[1, at[8]]) / 2) / 2
    assert float(doubled.label_loss(torch.tensor([0, 1, 2]), predicted, targets)) == pytest.approx(expected, rel=1e-5)


def test_the_label_objective_ranks_the_training_queries_own_labels_higher_than_the_cosine_alone(tiny_encoder_dir, tiny_task):
    """Same start, epochs and seed: the fit with the training queries' own labels ranks them higher (mean reciprocal
    rank of a query's first label in the model's index) than the cosine-only fit; it records its weight, needs the
    labels, and the CLI offers every objective the fit knows."""
    from hf_xmc.models import static_encoder

    data = tiny_task[0]
    model = tiny_model(tiny_encoder_dir, data)
    texts, targets = list(data.train.texts), data.train.targets.tocsr()

    def first_label_mrr(encoder):
        static = encoder.encode(model.tokenizer, texts, int(model.config.max_seq_length))
        _, found = model.ensure_label_index().search(static, model.ensure_label_index().num_labels)
        ranks = [next(r for r, label in enumerate(row) if targets[i, label]) + 1 for i, row in enumerate(found) if targets[i].nnz]
        return float(np.mean([1.0 / r for r in ranks]))

    cosine, _ = static_encoder.fit_static_encoder(model, texts, epochs=6, learning_rate=1e-2, seed=2)
    labelled, fit = static_encoder.fit_static_encoder(model, texts, epochs=6, learning_rate=1e-2, seed=2, objective="cosine+labels",
                                                      labels=targets, ranking_depth=4)
    assert first_label_mrr(labelled) > first_label_mrr(cosine) + 0.05
    assert fit["loss"] == "cosine+labels" and fit["label_weight"] == 1.0
    with pytest.raises(ValueError, match="needs labels"):
        static_encoder.fit_static_encoder(model, texts, epochs=1, objective="cosine+labels")
    with pytest.raises(ValueError, match="needs labels"):
        static_encoder.fit_static_encoder(model, texts, epochs=1, objective="cosine+ranking+labels", labels=targets[:2])
    assert cli.STATIC_FIT_OBJECTIVES == static_encoder.FIT_OBJECTIVE_CHOICES


def test_the_auto_objective_fits_both_from_one_tower_pass_and_keeps_the_better_on_validation(tiny_encoder_dir, tiny_task, monkeypatch):
    """``objective="auto"``: the cosine and the label fits share one pass of the tower, each is tuned and scored on the
    validation split, and the better one is the encoder left attached (whichever order they were fitted in): its
    table is what a fit of that objective alone gives, its validation score the one recorded. Without a validation
    split it is the cosine fit."""
    from hf_xmc.models import static_encoder
    from hf_xmc.training import static_encoder as fitting

    data = tiny_task[0]
    model = tiny_model(tiny_encoder_dir, data)  # dense only: the tiny task's channel alone ranks its test split perfectly
    texts, targets = list(data.train.texts), data.train.targets.tocsr()
    evaluator = XMCEvaluator(data.test, data.label_texts, data.label_uids, train_targets=targets, name="eval")
    passes = []
    prepare = static_encoder.prepare_static_fit
    monkeypatch.setattr(fitting, "prepare_static_fit", lambda *args, **kwargs: passes.append(1) or prepare(*args, **kwargs))
    kept = {}
    for order in (("cosine", "cosine+labels"), ("cosine+labels", "cosine")):
        monkeypatch.setattr(fitting, "AUTO_FIT_OBJECTIVES", order)
        info = fitting.fit_and_tune_static_query_encoder(model, texts, data.test, targets, evaluator, epochs=4, seed=0, precision="float32")
        scores = model.static_query_encoder_meta["fit"]["objective_choice"]["scores"]
        assert set(scores) == set(order) and scores["cosine"] != scores["cosine+labels"]  # two different fits were scored
        best = max(scores, key=scores.get)
        assert info["static_fit_objective"] == best == model.static_query_encoder_meta["fit"]["loss"]
        again = fitting.validation_metrics(model, evaluator)  # the table left is the one kept
        assert again["objective"] == pytest.approx(scores[best], abs=1e-3)
        assert model.static_query_encoder_meta["fit"]["objective_choice"]["validation"][best] == {k: again[k] for k in ("P@1", "PSP@5")}
        kept[order] = model.static_query_encoder.embeddings.weight.detach().clone()
    assert len(passes) == 2  # one tower pass per call, shared by its two fits
    torch.testing.assert_close(kept[("cosine", "cosine+labels")], kept[("cosine+labels", "cosine")], rtol=0, atol=0)
    alone, _ = static_encoder.fit_static_encoder(model, texts, epochs=4, seed=0, objective=best, labels=targets)
    torch.testing.assert_close(alone.embeddings.weight.detach(), kept[("cosine", "cosine+labels")], rtol=1e-6, atol=1e-6)
    info = fitting.fit_and_tune_static_query_encoder(model, texts, epochs=1, precision="float32")
    assert info["static_fit_objective"] == "cosine" and "objective_choice" not in model.static_query_encoder_meta["fit"]
    with pytest.raises(ValueError, match="objective must be one of"):
        fitting.fit_and_tune_static_query_encoder(model, texts, epochs=1, objective="labels")
