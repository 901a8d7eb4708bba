"""Gradio demo (Hugging Face Spaces) for an hf_xmc extreme multi-label classifier.

Type a text (and, for a multimodal model, add an image); the app shows the model's top-k labels with their
scores and, for a model with a score calibration, the calibrated probability that each label is relevant (the bars);
without one the bars are scores relative to the best label, and say so: a cosine score is no probability. The page
names the model by its Hub repo id, or a local directory by its folder name (never a path of the serving machine).
The model is loaded with ``AutoModel.from_pretrained(name, trust_remote_code=True)`` from a local model
directory or a Hub repo id, so the Space does not need hf_xmc installed: the model repo carries its own code.

Environment:
    HF_XMC_MODEL: model directory or Hub repo id (default: ``DEFAULT_MODEL``, a placeholder to replace).
    HF_XMC_REVISION: optional Hub revision (branch, tag or commit) to pin.
    HF_XMC_MAX_CHARS / HF_XMC_MAX_K: input bounds (defaults ``MAX_CHARS`` / ``MAX_K``).

Input bounds: a text of at most ``MAX_CHARS`` characters; ``k`` within the slider's range (1 to ``MAX_K`` or the label
count; the API refuses values outside it); one image per request, of at most ``MAX_IMAGE_BYTES`` and
``MAX_IMAGE_PIXELS`` (checked from its header: a decompression bomb is never decoded). Each is refused with a message.

Run locally: ``HF_XMC_MODEL=outputs/quickstart-dexml-debtags python spaces/app.py`` (the quickstart's model).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Optional

import gradio as gr
import numpy as np
import torch
from PIL import Image
from transformers import AutoModel

DEFAULT_MODEL = "your-org/hf-xmc-dexml-debtags"  # placeholder: also listed under `models:` in spaces/README.md
MAX_CHARS = 2000  # a query is a title or a short document; longer input only costs time (models truncate tokens)
MAX_K = 20
MAX_IMAGE_SIDE = 1024  # image encoders resize to ~224 px anyway; this only bounds the work on huge uploads
MAX_IMAGE_BYTES = 10 * 1024 * 1024  # an upload larger than this is refused (by Gradio on upload, and here)
MAX_IMAGE_PIXELS = 40_000_000  # width x height read from the header: a decompression bomb is refused before decoding
TABLE_HEADERS = ["rank", "label id", "label text", "score"]
CALIBRATED_TABLE_HEADERS = [*TABLE_HEADERS, "probability"]  # a model with a score calibration
SCORE_BARS_LABEL = "Top-k labels: score relative to the best label (not a probability)"
PROBABILITY_BARS_LABEL = "Top-k labels: calibrated probability that the label is relevant"


# ---------------------------------------------------------------------------------------------- model
def load_model(name_or_path: str, revision: Optional[str] = None) -> Any:
    """Load an hf_xmc model (directory or Hub repo id) through its remote code, in eval mode."""
    try:
        model = AutoModel.from_pretrained(name_or_path, trust_remote_code=True, revision=revision)
    except Exception as err:  # noqa: BLE001 - re-raised with the fix the user needs
        raise RuntimeError(
            f"could not load the hf_xmc model {name_or_path!r}: {err}\n"
            "Set HF_XMC_MODEL to a saved model directory or a Hub repo id of an hf_xmc model."
        ) from err
    if not callable(getattr(model, "predict", None)):
        raise TypeError(f"{name_or_path!r} loaded as {type(model).__name__}, which has no predict(): not an hf_xmc model")
    if torch.cuda.is_available():
        model = model.to("cuda")
    return model.eval()


def input_modalities(model: Any) -> tuple[str, ...]:
    """The inputs a model takes: ``config.input_modalities`` if set, else the class attribute, else text only."""
    config = getattr(model, "config", None)
    found = getattr(config, "input_modalities", None) or getattr(model, "input_modalities", None) or ("text",)
    return (found,) if isinstance(found, str) else tuple(found)


def accepts_images(model: Any) -> bool:
    """Whether the model's ``predict`` takes ``images=`` (a multimodal model such as MUFIN)."""
    return "image" in input_modalities(model)


def is_calibrated(model: Any) -> bool:
    """Whether the model maps its scores to probabilities of relevance (``model.score_calibration``, fitted on a
    validation split): then ``predict`` returns ``probabilities`` and the bars show them."""
    return getattr(model, "score_calibration", None) is not None


def display_name(name_or_path: str) -> str:
    """How the page names the model: a Hub repo id as it is; a local directory by its folder name, never its path on
    the machine that serves the Space."""
    name = str(name_or_path or "")
    if os.path.isabs(name) or name.startswith((".", "~")) or os.path.exists(name):
        return os.path.basename(os.path.normpath(name)) or name
    return name


def num_labels(model: Any) -> Optional[int]:
    """Size of the model's label space, or None when it cannot be told."""
    texts = getattr(model, "label_texts", None)
    if texts is not None:
        return len(texts)
    size = getattr(getattr(model, "config", None), "label_space_size", None)
    return int(size) if isinstance(size, int) and size > 0 else None


# ---------------------------------------------------------------------------------------------- prediction
def clamp_k(k: Any, max_k: int, n_labels: Optional[int] = None) -> int:
    """``k`` as an int within ``1..min(max_k, n_labels)``; a value that is not a number is a ``gr.Error``."""
    try:
        value = int(round(float(k)))
    except (TypeError, ValueError, OverflowError):
        raise gr.Error(f"k must be a number, got {k!r}", print_exception=False) from None
    upper = max_k if n_labels is None else max(1, min(max_k, n_labels))
    return min(max(value, 1), upper)


def check_text(text: Optional[str], max_chars: int, required: bool = True) -> str:
    """The stripped text; ``gr.Error`` when it is over ``max_chars`` or, if ``required``, empty."""
    text = "" if text is None else str(text)
    if len(text) > max_chars:
        raise gr.Error(f"The text has {len(text):,} characters; this demo accepts at most {max_chars:,}.", print_exception=False)
    text = text.strip()
    if required and not text:
        raise gr.Error("Type a text to classify.", print_exception=False)  # user input, not a server fault: no traceback
    return text


def bound_image(image: Image.Image) -> Image.Image:
    """An RGB copy no larger than ``MAX_IMAGE_SIDE`` on its longer side."""
    _check_pixels(*image.size)
    image = image.convert("RGB")  # convert() copies, so the caller's image is left alone
    image.thumbnail((MAX_IMAGE_SIDE, MAX_IMAGE_SIDE))
    return image


def open_image(image: str | os.PathLike | Image.Image) -> Image.Image:
    """An uploaded image (the file path ``gr.Image(type="filepath")`` gives, or a PIL image) as a bounded RGB image.

    ``gr.Error`` for a file over ``MAX_IMAGE_BYTES``, an image over ``MAX_IMAGE_PIXELS`` (told by its header, so a
    decompression bomb is never decoded) or a file that is not an image. Memory: one decoded image of at most
    ``MAX_IMAGE_PIXELS`` pixels (3 bytes each), then its copy of at most ``MAX_IMAGE_SIDE`` on its longer side.
    """
    if isinstance(image, Image.Image):
        return bound_image(image)
    size = os.path.getsize(image)
    if size > MAX_IMAGE_BYTES:
        raise gr.Error(f"The image file has {size / 2**20:.1f} MB; this demo accepts at most {MAX_IMAGE_BYTES / 2**20:.0f} MB.", print_exception=False)
    try:
        with Image.open(image) as opened:  # reads the header only
            _check_pixels(*opened.size)
            opened.draft("RGB", (MAX_IMAGE_SIDE, MAX_IMAGE_SIDE))  # JPEG decodes straight at a reduced scale
            return bound_image(opened)
    except gr.Error:
        raise
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise gr.Error(f"The file is not an image this demo can read ({err}).", print_exception=False) from None


def _check_pixels(width: int, height: int) -> None:
    if width * height > MAX_IMAGE_PIXELS:
        raise gr.Error(f"The image has {width} x {height} pixels; this demo accepts at most {MAX_IMAGE_PIXELS:,}.", print_exception=False)


def format_prediction(label_ids: Sequence[int], scores: Sequence[float], label_texts: Sequence[str],
                      probabilities: Optional[Sequence[float]] = None) -> tuple[dict[str, float], list[list]]:
    """Turn one row of a prediction into the ``gr.Label`` value and the table rows (rank, id, text, score[, probability]).

    With ``probabilities`` (a calibrated model) the bars are those probabilities, and the table has them too. Without,
    ``gr.Label`` still draws values in [0, 1] (as percentages), while XMC scores are cosines or sums of them (any sign,
    possibly above 1): each bar is then the score relative to the best one over the baseline ``min(0, lowest)``, which
    the component's label says (:data:`SCORE_BARS_LABEL`); the table keeps the raw scores.
    """
    # float(str(float32)) is the shortest decimal that reads back as the same float32: exact and legible
    rows = [[rank, int(i), str(t), float(str(np.float32(s)))] for rank, (i, s, t) in enumerate(zip(label_ids, scores, label_texts), start=1) if i >= 0]
    if not rows:
        return {}, []
    if probabilities is not None:
        kept = [float(str(np.float32(p))) for i, p in zip(label_ids, probabilities) if i >= 0]
        for row, p in zip(rows, kept):
            row.append(p)
        bars = np.clip(np.array(kept, dtype=np.float64), 0.0, 1.0)
    else:
        raw = np.array([r[3] for r in rows], dtype=np.float64)
        low = min(0.0, float(raw.min()))
        span = float(raw.max()) - low
        bars = (raw - low) / span if span > 0 else np.ones_like(raw)
    confidences: dict[str, float] = {}
    for (_, label_id, text, *_), bar in zip(rows, bars):
        key = text if text and text not in confidences else f"{text} (#{label_id})"  # gr.Label keys must be unique
        confidences[key] = float(bar)
    return confidences, rows


def make_predict_fn(model: Any, *, max_chars: int = MAX_CHARS, max_k: int = MAX_K) -> Callable[..., tuple[dict[str, float], list[list]]]:
    """The demo's prediction function: ``fn(text, k)``, or ``fn(text, image, k)`` for a multimodal model.

    Returns ``(label confidences for gr.Label, table rows)``. Bad input raises ``gr.Error``, which Gradio shows
    to the user; ``k`` is clamped (the UI's slider already refuses values outside its range, API calls included).
    A multimodal model gets ``predict([text], k=k)`` for a text alone, ``predict([""], images=[img], k=k)`` for an
    image alone (an empty text is a missing one) and ``predict([text], images=[img], k=k)`` for both.
    """
    n_labels = num_labels(model)
    calibrated = is_calibrated(model)

    def run(texts: list[str], k: Any, images: Optional[list[Image.Image]] = None) -> tuple[dict[str, float], list[list]]:
        k = clamp_k(k, max_k, n_labels)
        kwargs = {} if images is None else {"images": images}
        with torch.no_grad():
            pred = model.predict(texts, k=k, **kwargs)
        probabilities = getattr(pred, "probabilities", None) if calibrated else None
        return format_prediction(np.asarray(pred.label_ids)[0].tolist(), np.asarray(pred.scores, dtype=np.float32)[0], pred.label_texts[0],
                                 None if probabilities is None else np.asarray(probabilities, dtype=np.float32)[0])

    if not accepts_images(model):

        def predict_text(text: str, k: float) -> tuple[dict[str, float], list[list]]:
            """Top-k labels of a text."""
            return run([check_text(text, max_chars)], k)

        return predict_text

    def predict_multimodal(text: str, image: Optional[str | Image.Image], k: float) -> tuple[dict[str, float], list[list]]:
        """Top-k labels of a text, an image (a file path or a PIL image), or both."""
        text = check_text(text, max_chars, required=image is None)
        if image is None:
            return run([text], k)
        return run([text], k, images=[open_image(image)])

    return predict_multimodal


# ---------------------------------------------------------------------------------------------- UI
def build_demo(model: Any, *, max_chars: int = MAX_CHARS, max_k: int = MAX_K, title: Optional[str] = None) -> gr.Blocks:
    """The demo's ``gr.Blocks``: text (and image) input, a k slider and a button; top-k bars and a table.

    The event has ``api_name="predict"``: ``gradio_client.Client(url).predict(text, k, api_name="/predict")``
    (multimodal: ``predict(text, image, k, ...)``).
    """
    if max_chars < 1 or max_k < 1:
        raise ValueError(f"max_chars and max_k must be >= 1, got {max_chars} and {max_k}")
    n_labels = num_labels(model)
    k_max = max_k if n_labels is None else max(1, min(max_k, n_labels))
    with_image = accepts_images(model)
    calibrated = is_calibrated(model)
    name = display_name(getattr(model, "name_or_path", "")) or type(model).__name__
    method = getattr(getattr(model, "config", None), "model_type", "") or type(model).__name__
    title = title or "hf_xmc: extreme multi-label classification"
    predict = make_predict_fn(model, max_chars=max_chars, max_k=max_k)

    with gr.Blocks(title=title) as demo:
        gr.Markdown(
            f"# {title}\n"
            f"Model `{name}` ({method}), {n_labels if n_labels is not None else 'unknown number of'} labels. "
            f"{'Type a text and/or add an image' if with_image else 'Type a text'}, choose k and press **Predict**: "
            + ("the bars show each label's calibrated probability of being relevant (fitted on validation queries), the "
               "table the raw scores and those probabilities." if calibrated else
               "the bars show each label's score relative to the best label (the best is full): scores, not probabilities "
               "(this model has no score calibration); the table shows the raw scores.")
        )
        with gr.Row():
            with gr.Column():
                text = gr.Textbox(
                    label="Text",
                    placeholder="e.g. a product or package title",
                    lines=3,
                    max_length=max_chars,
                    elem_id="query-text",
                )
                inputs: list[gr.components.Component] = [text]
                if with_image:
                    # a file path: open_image checks bytes and pixels before anything is decoded
                    inputs.append(gr.Image(type="filepath", label="Image (optional)", elem_id="query-image"))
                k = gr.Slider(1, k_max, value=min(5, k_max), step=1, label="k (labels to show)", elem_id="k-slider")
                inputs.append(k)
                button = gr.Button("Predict", variant="primary", elem_id="predict-button")
            with gr.Column():
                bars = gr.Label(num_top_classes=k_max, label=PROBABILITY_BARS_LABEL if calibrated else SCORE_BARS_LABEL, elem_id="top-labels")
                table = gr.Dataframe(
                    headers=CALIBRATED_TABLE_HEADERS if calibrated else TABLE_HEADERS,
                    datatype=["number", "number", "str", "number"] + (["number"] if calibrated else []),
                    interactive=False,
                    label="Scores",
                    elem_id="top-table",
                )
        # one endpoint for the button and Enter in the textbox
        gr.on([button.click, text.submit], predict, inputs=inputs, outputs=[bars, table], api_name="predict")
    return demo


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


# Spaces run this file and tests import it: the model is loaded once, at import.
model = load_model(os.environ.get("HF_XMC_MODEL", "").strip() or DEFAULT_MODEL, revision=os.environ.get("HF_XMC_REVISION") or None)
demo = build_demo(model, max_chars=_env_int("HF_XMC_MAX_CHARS", MAX_CHARS), max_k=_env_int("HF_XMC_MAX_K", MAX_K))

if __name__ == "__main__":
    demo.launch(max_file_size=MAX_IMAGE_BYTES)  # larger uploads are refused before they reach the app
