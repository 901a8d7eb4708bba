"""The Spaces demo (spaces/app.py): prediction function and bounds, the gradio_client API, headless Chromium, image input.

The app loads the saved model DIRECTORY (``HF_XMC_MODEL``). The API and browser tests talk to ``python spaces/app.py``
run in a process where hf_xmc cannot be imported, as on a Space, so the model comes from its remote code; the direct
function tests import the app in-process (where hf_xmc's local registration picks the same code from the package).
The browser test needs Debian chromium (/usr/bin/chromium) and the ``playwright`` package (no downloaded browsers);
it skips without them unless ``HF_XMC_REQUIRE_BROWSER=1`` (set in CI), where it fails instead.
"""

import ast
import importlib.util
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # before gradio is imported: no telemetry calls from tests

import numpy as np
import pytest
import torch
from PIL import Image

REQUIRE_BROWSER = os.environ.get("HF_XMC_REQUIRE_BROWSER") == "1"
CHROMIUM = os.environ.get("HF_XMC_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SPACE_DIR = Path(__file__).resolve().parent.parent / "spaces"
APP_FILE = SPACE_DIR / "app.py"
LAUNCH = dict(prevent_thread_lock=True, server_name="127.0.0.1", share=False, quiet=True)


def _missing(what: str) -> None:
    """Skip for a missing optional tool, or fail when CI asked for the browser check (HF_XMC_REQUIRE_BROWSER=1)."""
    message = f"{what} (install the dev extra: pip install -e '.[dev]'; Debian chromium: apt-get install -y chromium)"
    if REQUIRE_BROWSER:
        pytest.fail(f"HF_XMC_REQUIRE_BROWSER=1 but {message}", pytrace=False)
    pytest.skip(message, allow_module_level=True)


try:
    import gradio as gr
    from gradio_client import Client, handle_file
except ImportError as err:
    _missing(f"gradio/gradio_client are not installed ({err})")


def _import_app(model_dir: str):
    """Import spaces/app.py as a fresh module with HF_XMC_MODEL=model_dir (it loads the model at import)."""
    saved = {name: os.environ.pop(name, None) for name in ("HF_XMC_MODEL", "HF_XMC_REVISION", "HF_XMC_MAX_CHARS", "HF_XMC_MAX_K")}
    os.environ["HF_XMC_MODEL"] = model_dir
    try:
        spec = importlib.util.spec_from_file_location("hf_xmc_space_app", APP_FILE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
    return module


@pytest.fixture(scope="module")
def saved_model(tiny_task, tiny_encoder_dir, tmp_path_factory):
    """A tiny DEXML model with its label index, saved; returns (in-process model, directory)."""
    from hf_xmc.models import DEXMLModel

    data = tiny_task[0]
    torch.manual_seed(0)
    model = DEXMLModel.from_encoder_pretrained(tiny_encoder_dir)
    model.build_label_index(data.label_texts, data.label_uids)
    directory = tmp_path_factory.mktemp("space_model")
    model.save_pretrained(directory)
    return model, str(directory)


@pytest.fixture(scope="module")
def app(saved_model):
    return _import_app(saved_model[1])


SERVER_PIDS: dict[str, int] = {}  # URL of a served app -> its process id


@pytest.fixture(scope="module")
def served(saved_model, tmp_path_factory):
    """``python spaces/app.py`` in a process where hf_xmc cannot be imported (remote code only); yields its URL."""
    from benchmarks.bench_space_load import start_space

    log_dir = tmp_path_factory.mktemp("space_server")
    try:
        proc, url = start_space(saved_model[1], str(log_dir / "server.log"))
    except RuntimeError as err:
        pytest.fail(str(err))
    SERVER_PIDS[url] = proc.pid
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGINT)  # gradio closes its server on KeyboardInterrupt
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _expected(model, text: str, k: int) -> tuple[list[int], list[str], np.ndarray]:
    pred = model.predict([text], k=k)
    return pred.label_ids[0].tolist(), pred.label_texts[0], pred.scores[0]


def _check_rows(rows, ids, texts, scores, exact: bool = True) -> None:
    """Table rows (rank, label id, label text, score) equal the model's top-k; scores read back as the same float32.

    ``exact=False`` for a model in another process (same weights and code, scores compared to 1e-6).
    """
    assert [r[0] for r in rows] == list(range(1, len(ids) + 1))
    assert [r[1] for r in rows] == ids
    assert [r[2] for r in rows] == texts
    shown = np.array([r[3] for r in rows], dtype=np.float32)
    if exact:
        np.testing.assert_array_equal(shown, np.asarray(scores, dtype=np.float32))
    else:
        np.testing.assert_allclose(shown, scores, rtol=1e-6, atol=1e-6)


def _blocks(demo, kind):
    return [block for block in demo.blocks.values() if isinstance(block, kind)]


# ---------------------------------------------------------------------------------------------- the app module
def test_app_imports_only_gradio_transformers_torch_numpy_pil():
    tree = ast.parse(APP_FILE.read_text())
    roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    third_party = {r for r in roots if r not in sys.stdlib_module_names and r != "__future__"}
    assert third_party == {"gradio", "transformers", "torch", "numpy", "PIL"}, third_party


def test_app_loads_the_model_directory(app, saved_model):
    model, directory = saved_model
    assert app.model.name_or_path == directory and not app.model.training and not app.accepts_images(app.model)
    assert app.num_labels(app.model) == len(model.label_texts)
    assert isinstance(app.demo, gr.Blocks)
    assert not _blocks(app.demo, gr.Image)
    (slider,) = _blocks(app.demo, gr.Slider)
    assert (slider.minimum, slider.maximum, slider.value) == (1, min(app.MAX_K, len(model.label_texts)), 5)
    with pytest.raises(RuntimeError, match="HF_XMC_MODEL"):
        app.load_model(os.path.join(directory, "does-not-exist"))


def test_predict_fn_equals_model_top_k(app, saved_model, tiny_task):
    model = saved_model[0]
    predict = app.make_predict_fn(app.model)
    for text in tiny_task[0].test.texts[:4]:
        for k in (1, 3, 5):
            confidences, rows = predict(text, k)
            ids, texts, scores = _expected(app.model, text, k)
            _check_rows(rows, ids, texts, scores)
            assert ids == _expected(model, text, k)[0]  # the reloaded model ranks as the one it was saved from
            # the bars: one per label, best first, the best full, all within [0, 1]
            assert len(set(texts)) == k and list(confidences) == texts
            bars = list(confidences.values())
            assert bars[0] == 1.0 and all(0.0 <= b <= 1.0 for b in bars) and bars == sorted(bars, reverse=True)


def test_page_names_the_model_and_says_what_the_bars_are(app, saved_model, tiny_task, monkeypatch):
    """The page names a local model by its folder, never its absolute path (a Hub id as it is); without a score
    calibration the bars are labelled as relative scores, not probabilities; with one they are the calibrated
    probabilities (XMCPrediction.probabilities), shown in the table too."""
    directory = saved_model[1]
    page = " ".join(str(block.value) for block in _blocks(app.demo, gr.Markdown))
    assert f"Model `{os.path.basename(directory)}`" in page and directory not in page and "not probabilities" in page
    assert app.display_name("org/dexml-debtags") == "org/dexml-debtags" and app.display_name(directory) == os.path.basename(directory)
    (bars,) = _blocks(app.demo, gr.Label)
    assert bars.label == app.SCORE_BARS_LABEL and "not a probability" in bars.label
    # a calibrated model: isotonic map from [-1, 1] onto [0, 1], so probability = (score + 1) / 2
    monkeypatch.setattr(app.model.config, "score_calibration", {"method": "isotonic", "x": [-1.0, 1.0], "y": [0.0, 1.0]})
    demo = app.build_demo(app.model)
    (bars,) = _blocks(demo, gr.Label)
    (table,) = _blocks(demo, gr.Dataframe)
    assert bars.label == app.PROBABILITY_BARS_LABEL and table.headers == app.CALIBRATED_TABLE_HEADERS
    confidences, rows = app.make_predict_fn(app.model)(tiny_task[0].test.texts[0], 5)
    probabilities = [row[4] for row in rows]
    np.testing.assert_allclose(probabilities, (np.array([row[3] for row in rows]) + 1) / 2, atol=1e-6)
    assert list(confidences.values()) == pytest.approx(probabilities)  # the bars are the probabilities, not relative scores


def test_predict_fn_bounds(app, tiny_task):
    n_labels = len(tiny_task[0].label_texts)
    text = tiny_task[0].test.texts[0]
    predict = app.make_predict_fn(app.model, max_chars=40, max_k=8)
    for empty in ("", "   \n", None):
        with pytest.raises(gr.Error, match="Type a text"):
            predict(empty, 3)
    with pytest.raises(gr.Error, match="at most 40"):
        predict("x" * 41, 3)
    assert len(predict(("a " * 20)[:40], 3)[1]) == 3  # exactly max_chars is accepted
    assert len(predict(text, 0)[1]) == 1 and len(predict(text, -7)[1]) == 1
    assert len(predict(text, 2.6)[1]) == 3
    assert len(predict(text, 10**6)[1]) == 8  # clamped to max_k
    assert len(app.make_predict_fn(app.model, max_k=10**3)(text, 10**3)[1]) == n_labels  # and to the label count
    with pytest.raises(gr.Error, match="k must be a number"):
        predict(text, "many")
    with pytest.raises(ValueError, match="max_chars and max_k"):
        app.build_demo(app.model, max_k=0)


def test_format_prediction_scores_of_any_sign_duplicates_and_empty_slots(app):
    confidences, rows = app.format_prediction([3, 4, 5, -1], np.array([0.5, -0.2, -0.3, 0.0], dtype=np.float32), ["a", "a", "b", ""])
    assert [r[1] for r in rows] == [3, 4, 5]  # the empty slot (-1) is dropped
    assert list(confidences) == ["a", "a (#4)", "b"]
    np.testing.assert_allclose(list(confidences.values()), [1.0, 0.1 / 0.8, 0.0], atol=1e-6)
    assert app.format_prediction([], np.zeros(0, dtype=np.float32), []) == ({}, [])


def test_space_card_and_requirements(app):
    from huggingface_hub import SpaceCard

    card = SpaceCard.load(SPACE_DIR / "README.md").data
    assert card.sdk == "gradio" and (SPACE_DIR / card.app_file).resolve() == APP_FILE
    assert tuple(int(x) for x in card.python_version.split(".")) >= (3, 11)  # transformers 5
    assert card.license == "apache-2.0" and app.DEFAULT_MODEL in card.models and len(card.short_description) <= 60
    pins = dict(line.split("==") for line in (SPACE_DIR / "requirements.txt").read_text().splitlines() if "==" in line)
    assert pins["gradio"] == card.sdk_version  # one gradio version on the Space
    assert card.sdk_version.split(".")[0] == gr.__version__.split(".")[0]  # the tested major version


# ---------------------------------------------------------------------------------------------- served app
def test_gradio_client_predict_equals_model_top_k(app, served, tiny_task):
    """The served Space (remote code, no hf_xmc) answers with the model's top-k through the API."""
    from gradio_client.exceptions import AppError

    client = Client(served, verbose=False, analytics_enabled=False)
    assert set(client.view_api(print_info=False, return_format="dict")["named_endpoints"]) == {"/predict"}
    for text, k in ((tiny_task[0].test.texts[1], 3), (tiny_task[0].test.texts[2], 5)):
        label, table = client.predict(text, k, api_name="/predict")
        ids, texts, scores = _expected(app.model, text, k)
        assert table["headers"] == app.TABLE_HEADERS
        _check_rows(table["data"], ids, texts, scores, exact=False)
        assert label["label"] == texts[0] and [c["label"] for c in label["confidences"]] == texts
    with pytest.raises(AppError, match="Type a text"):
        client.predict("  ", 3, api_name="/predict")
    with pytest.raises(AppError, match="at most"):
        client.predict("x" * (app.MAX_CHARS + 1), 3, api_name="/predict")
    k_max = min(app.MAX_K, len(tiny_task[0].label_texts))  # the slider's range bounds k over the API
    with pytest.raises(AppError, match="greater than maximum"):
        client.predict(tiny_task[0].test.texts[1], k_max + 1, api_name="/predict")
    with pytest.raises(AppError, match="less than minimum"):
        client.predict(tiny_task[0].test.texts[1], 0, api_name="/predict")


@pytest.fixture(scope="module")
def sync_playwright():
    """playwright's ``sync_playwright``, checked (with chromium) before any server is started for the browser test.
    Where CI installs chromium beside the test run (``HF_XMC_BROWSER_READY_FILE``), it first waits for that install
    (up to 10 minutes)."""
    ready_file = os.environ.get("HF_XMC_BROWSER_READY_FILE")
    if ready_file:
        deadline = time.monotonic() + 600
        while not os.path.exists(ready_file) and time.monotonic() < deadline:
            time.sleep(2)
        if not os.path.exists(ready_file) or Path(ready_file).read_text().strip() != "ok":
            _missing(f"installing chromium did not succeed ({ready_file}; its log: .chromium.log)")
    if not os.path.exists(CHROMIUM):
        _missing(f"chromium is not installed at {CHROMIUM}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the playwright package is not installed")
    return sync_playwright


def test_headless_chromium_screenshot(sync_playwright, app, served, tiny_task, tmp_path):
    text = tiny_task[0].test.texts[3]
    ids, texts, _ = _expected(app.model, text, 5)
    viewport = {"width": 1280, "height": 800}
    shot = tmp_path / "space.png"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=viewport)
            page.goto(served, wait_until="networkidle")
            labels = page.locator("#top-labels")
            assert texts[0] not in labels.inner_text()  # nothing shown before the click
            page.locator("#query-text textarea").fill(text)
            page.locator("#predict-button").click()
            labels.get_by_text(texts[0], exact=True).first.wait_for(timeout=30_000)
            page.locator("#top-table").get_by_text(texts[-1], exact=True).first.wait_for(timeout=30_000)
            shown = page.locator("#top-table").inner_text()
            page.screenshot(path=str(shot))
        finally:
            browser.close()
    assert all(t in shown for t in texts) and str(ids[0]) in shown
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    image = Image.open(io.BytesIO(data))
    assert image.size == (viewport["width"], viewport["height"])
    pixels = np.asarray(image.convert("L"), dtype=np.float32)
    assert pixels.std() > 10 and len(np.unique(pixels)) > 50, "blank screenshot"


# ---------------------------------------------------------------------------------------------- image input
class StandInMultimodalModel:
    """Test double for a multimodal hf_xmc model (MUFIN-like): ``predict(texts, images=None, k)`` over 12 labels.

    Records every call. Scores depend on the text length and the image's mean red value, so each input kind gives
    a ranking of its own.
    """

    input_modalities = ("text", "image")
    name_or_path = "stand-in/multimodal"

    def __init__(self, config_modalities=None):
        self.config = SimpleNamespace(model_type="stand_in_mufin")
        if config_modalities is not None:
            self.config.input_modalities = config_modalities
        self.label_texts = [f"label {i}" for i in range(12)]
        self.calls = []

    def predict(self, texts, images=None, k=5):
        self.calls.append((list(texts), None if images is None else list(images), k))
        red = 0.0 if images is None else float(np.asarray(images[0])[..., 0].mean())
        scores = np.cos(np.arange(12) * (1 + len(texts[0])) + red).astype(np.float32)
        order = np.argsort(-scores, kind="stable")[:k]
        return SimpleNamespace(label_ids=order.astype(np.int64)[None], scores=scores[order][None],
                               label_texts=[[self.label_texts[i] for i in order]])


def test_modalities_from_config_or_class_attribute(app):
    assert app.accepts_images(StandInMultimodalModel())  # class attribute
    assert not app.accepts_images(StandInMultimodalModel(config_modalities=("text",)))  # the config wins
    assert app.accepts_images(SimpleNamespace(config=SimpleNamespace(input_modalities="image")))
    assert not app.accepts_images(SimpleNamespace(config=SimpleNamespace(), input_modalities="text"))  # transformers' default


def test_image_input_reaches_predict(app):
    model = StandInMultimodalModel()
    demo = app.build_demo(model, max_k=6)
    (image_input,) = _blocks(demo, gr.Image)
    assert image_input.type == "filepath"  # the app opens the upload itself, after checking bytes and pixels
    predict = app.make_predict_fn(model, max_k=6)
    red = Image.new("RGB", (40, 30), (200, 10, 10))

    _, rows = predict("a title", None, 4)
    assert model.calls[-1] == (["a title"], None, 4)
    _check_rows(rows, *_expected(model, "a title", 4))
    _, rows = predict("", red, 4)
    texts, images, k = model.calls[-1]
    assert texts == [""] and k == 4 and len(images) == 1 and images[0].size == (40, 30)
    _check_rows(rows, *_expected_image(model, "", red, 4))
    _, rows = predict("a title", red, 99)
    texts, images, k = model.calls[-1]
    assert texts == ["a title"] and k == 6 and np.array_equal(np.asarray(images[0]), np.asarray(red))
    with pytest.raises(gr.Error, match="Type a text"):
        predict("  ", None, 3)
    predict("", Image.new("RGBA", (3000, 600)), 3)  # huge images are bounded (and made RGB) before predict
    bounded = model.calls[-1][1][0]
    assert bounded.size[0] == app.MAX_IMAGE_SIDE and abs(bounded.size[1] - app.MAX_IMAGE_SIDE / 5) <= 1 and bounded.mode == "RGB"


def _expected_image(model, text, image, k):
    pred = model.predict([text], images=[image], k=k)
    return pred.label_ids[0].tolist(), pred.label_texts[0], pred.scores[0]


def test_image_input_through_gradio_client(app, tmp_path):
    model = StandInMultimodalModel()
    demo = app.build_demo(model)
    png = tmp_path / "red.png"
    Image.new("RGB", (32, 24), (180, 20, 20)).save(png)
    _, url, _ = demo.launch(**LAUNCH)
    try:
        client = Client(url, verbose=False, analytics_enabled=False)
        cases = (("a title", None), ("", handle_file(str(png))), ("a title", handle_file(str(png))))
        for text, image in cases:
            _, table = client.predict(text, image, 4, api_name="/predict")
            texts, images, k = model.calls[-1]
            assert texts == [text] and k == 4
            if image is None:
                assert images is None
                expected = _expected(model, text, 4)
            else:
                assert len(images) == 1 and images[0].size == (32, 24)
                assert np.array_equal(np.asarray(images[0]), np.asarray(Image.open(png).convert("RGB")))
                expected = _expected_image(model, text, images[0], 4)
            _check_rows(table["data"], *expected)
    finally:
        demo.close()


def test_a_real_mufin_model_gets_the_image_input(app, tmp_path):
    """A (tiny, random) MUFIN model declares images: the demo passes text, image or both through to its predict."""
    from transformers import BertTokenizer, DistilBertConfig, DistilBertModel

    from hf_xmc.models import MUFINModel

    words = "red green blue apple pear car".split()
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words) + "\n")
    BertTokenizer(vocab=str(tmp_path / "text" / "vocab.txt")).save_pretrained(tmp_path / "text")
    torch.manual_seed(0)
    DistilBertModel(DistilBertConfig(vocab_size=11, dim=32, n_layers=1, n_heads=2, hidden_dim=64, max_position_embeddings=64)).save_pretrained(tmp_path / "text")
    model = MUFINModel.from_encoders_pretrained(str(tmp_path / "text"), label_space_size=4, embed_dim=8, attention_heads=2, shortlist_size=4)
    model.build_label_index(["red apple", "green pear", "blue car", "red car"])
    assert app.accepts_images(model)
    predict = app.make_predict_fn(model)
    image = Image.fromarray(np.full((40, 40, 3), 200, np.uint8))
    for text, img in (("red apple", None), ("", image), ("red", image)):
        expected = model.predict([text], images=[image] if img is not None else None, k=3)
        _, rows = predict(text, img, 3)
        assert [r[1] for r in rows] == expected.label_ids[0].tolist()
        np.testing.assert_allclose([r[3] for r in rows], expected.scores[0], rtol=1e-5)


def test_image_bounds_are_refused_with_a_message(app, tmp_path, monkeypatch):
    """An upload over the byte limit, an image over the pixel limit (told by its header: a decompression bomb of
    50M pixels in a small PNG is refused without decoding it) and a file that is not an image: each a gr.Error."""
    model = StandInMultimodalModel()
    predict = app.make_predict_fn(model, max_k=6)
    bomb = tmp_path / "bomb.png"
    Image.new("1", (10_000, 5_000)).save(bomb)  # 50M pixels, a few KB on disk
    assert bomb.stat().st_size < 100_000
    with pytest.raises(gr.Error, match="10000 x 5000 pixels; this demo accepts at most 40,000,000"):
        predict("", str(bomb), 3)
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    with pytest.raises(gr.Error, match="not an image this demo can read"):
        predict("", str(junk), 3)
    small = tmp_path / "small.png"
    Image.new("RGB", (64, 48), (0, 90, 200)).save(small)
    _, rows = predict("a title", str(small), 3)  # within bounds: opened and passed on
    assert model.calls[-1][1][0].size == (64, 48) and len(rows) == 3
    monkeypatch.setattr(app, "MAX_IMAGE_BYTES", 100)
    with pytest.raises(gr.Error, match="this demo accepts at most 0 MB"):
        predict("", str(small), 3)
    with pytest.raises(gr.Error, match="accepts at most 40,000,000"):
        predict("", Image.new("1", (10_000, 5_000)), 3)  # a PIL image (a direct call) is bounded too


def test_fifty_concurrent_requests_complete_with_flat_memory(app, served, tiny_task):
    """50 requests at once through gradio_client, twice: every answer is the model's top-k and the server's resident
    memory after the second round is where the first left it (benchmarks/bench_space_load.py measures more rounds).

    A request gradio_client itself reports as cancelled (its cancel watcher thread can win the race against the
    result stream under load: once in a full CI run on 2 cores, 2026-11-30; nothing here cancels) is asked again,
    one at a time; a few such are allowed, any other error fails."""
    from benchmarks.bench_space_load import fire_concurrent, rss_mib

    texts = list(tiny_task[0].test.texts[:50])
    client = Client(served, verbose=False, analytics_enabled=False)
    pid = SERVER_PIDS[served]
    memory = []
    for _ in range(2):
        results, _, errors = fire_concurrent(client, texts, 5)
        assert not [e for e in errors if not e.startswith("CancelledError")], errors[:3]
        cancelled = [i for i, result in enumerate(results) if result is None]
        assert len(cancelled) <= len(texts) // 10, errors[:3]
        for i in cancelled:
            results[i] = client.predict(texts[i], 5, api_name="/predict")
        for text, (_, table) in zip(texts, results):
            assert [row[1] for row in table["data"]] == _expected(app.model, text, 5)[0]
        memory.append(rss_mib(pid))
    assert memory[1] - memory[0] < 20, memory  # MiB
