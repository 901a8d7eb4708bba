"""The ``hf-xmc`` console command: ``train``, ``evaluate``, ``predict`` and ``push`` over the package's own code.

    hf-xmc train dexml --train_file trn.json.gz --test_file tst.json.gz --label_file lbl.json.gz \\
        --model_name_or_path sentence-transformers/all-MiniLM-L6-v2 --output_dir out/dexml
    accelerate launch --num_processes 2 -m hf_xmc.cli train unidec ...     # several processes
    hf-xmc evaluate out/dexml --test_file tst.json.gz --train_file trn.json.gz --output_file metrics.json
    hf-xmc predict out/dexml --text "The Grasshopper Trap" --k 5
    hf-xmc predict org/name --input_file queries.txt --output_file preds.jsonl
    hf-xmc add-labels out/dexml new_labels.json.gz [--remove uid1,uid2] [--output_dir out/dexml-grown]
    hf-xmc push out/dexml org/name --private

``train`` runs the recipe that ``training_scripts/train_<method>.py`` runs (:mod:`hf_xmc.training.recipes`), with the
same flags; ``evaluate`` runs the evaluator the recipes use (:func:`hf_xmc.training.script_utils.build_evaluator`);
``push`` is :func:`hf_xmc.hub.push_to_hub`. A fault in the user's input (a missing file, an unknown method, a
directory that holds no model, a malformed data line, a flag value the machine cannot honour) is one line on stderr
and exit status 2, before any model loads where it can be told; a command that fails writes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import math
import os
import re
import sys
from collections.abc import Iterator, Sequence
from typing import IO, Any, Optional

#: ``hf_xmc.models.static_encoder.FIT_OBJECTIVE_CHOICES``, spelled out: the parser is built without importing torch (a
#: test checks the two agree)
STATIC_FIT_OBJECTIVES = ("auto", "cosine", "cosine+ranking", "cosine+labels", "cosine+ranking+labels")

PROG = "hf-xmc"
EXIT_USER_ERROR = 2
STDIN_NAMES = ("-", "/dev/stdin")  # --input_file values that read standard input (plain text, one query per line)
PREDICT_CHUNK = 8192  # queries per model.predict call: bounds the query vectors held at once on large input files
JSON_SUFFIXES = (".json", ".json.gz", ".jsonl", ".jsonl.gz")
_REPO_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


class UserError(Exception):
    """A fault in what the user asked for; reported as ``hf-xmc <command>: <message>`` with exit status 2."""


# ---------------------------------------------------------------------------------------------------------- helpers
def _require_file(path: Optional[str], flag: str) -> None:
    """Refuse a missing input file (or a directory) before any model is loaded (loading can take minutes); a pipe or
    a device (``<(...)``, ``/dev/stdin``) is read like a file."""
    if path is None or path in STDIN_NAMES:
        return
    if not os.path.exists(path):
        raise UserError(f"{path}: no such file ({flag})")
    if os.path.isdir(path):
        raise UserError(f"{path}: is a directory, not a file ({flag})")


def _require_positive(value: Optional[int], flag: str) -> None:
    if value is not None and value < 1:
        raise UserError(f"{flag} must be at least 1, got {value}")


def _require_finite(value: Optional[float], flag: str, least: Optional[float] = None) -> None:
    """Refuse ``nan`` / ``inf`` (argparse's ``float`` takes both) and a value below ``least``."""
    if value is None:
        return
    if not math.isfinite(value):
        raise UserError(f"{flag} must be a finite number, got {value}")
    if least is not None and value < least:
        raise UserError(f"{flag} must be at least {least:g}, got {value:g}")


def _check_output_file(path: Optional[str]) -> None:
    """Refuse an ``--output_file`` that cannot be a file (a directory, or under a file) before the model loads."""
    if path is None:
        return
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        raise UserError(f"{path}: --output_file is a directory; give the path of a file")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UserError(f"{path}: --output_file cannot be written, {parent} is a file")


def _check_device(device: Optional[str]) -> None:
    """Refuse a ``--device`` this machine does not have, in one line, before the model loads."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise UserError(f"--device {device}: not a torch device ({_first_line(err)})") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(f"--device {device}: torch sees no CUDA GPU here; use --device cpu (or leave --device out)")
        if dev.index is not None and dev.index >= count:
            raise UserError(f"--device {device}: torch sees {count} CUDA GPU(s) here (cuda:0 to cuda:{count - 1})")
    elif dev.type == "mps" and not (getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()):
        raise UserError(f"--device {device}: torch sees no MPS device here; use --device cpu")


def load_model(name_or_path: str, revision: Optional[str] = None):
    """``AutoModel.from_pretrained(name_or_path, trust_remote_code=True)``, refusing anything but an hf_xmc model
    with labels; ``name_or_path`` is a model directory or a Hub repo id (whose own code runs), ``revision`` a branch,
    tag or commit of that repo (its code comes from the same revision). A path meant as local
    (:func:`~hf_xmc.training.script_utils.looks_like_local_path`) that does not exist is refused at once, not after
    a minute of Hub retries."""
    from transformers import AutoModel

    from .training.script_utils import looks_like_local_path

    if os.path.exists(name_or_path):
        if not os.path.isdir(name_or_path):
            raise UserError(f"{name_or_path}: not a model directory (a file)")
        if revision is not None:
            raise UserError(f"{name_or_path}: --revision pins a commit of a Hub repo, and this is a local directory")
        where = f"{name_or_path}: cannot load a model from this directory"
    elif _REPO_ID.match(name_or_path) and not looks_like_local_path(name_or_path):
        where = f"{name_or_path}: no such directory, and loading it as a Hub repo id failed"
    else:
        raise UserError(f"{name_or_path}: no such model directory (a Hub repo id is 'name' or 'org/name')")
    try:
        model = AutoModel.from_pretrained(name_or_path, trust_remote_code=True, **({} if revision is None else {"revision": revision}))
    except ImportError as err:  # an optional dependency the model needs (peft for an adapter-only save)
        raise UserError(f"{name_or_path}: cannot load the model here ({_first_line(err)})") from None
    except (OSError, ValueError) as err:  # transformers' "no config.json", "not a valid model identifier", ...
        if type(err).__name__ == "ModelFileError":  # a file of the directory, named with its fault (model_files.py;
            raise UserError(_first_line(err)) from None  # by name: the remote-code copy of the class is another class)
        raise UserError(f"{where} ({_first_line(err)})") from None
    if not getattr(model, "label_texts", None) or not hasattr(model, "predict"):
        raise UserError(f"{name_or_path}: not an hf_xmc model with labels (no labels.jsonl beside the weights)")
    return model


def _first_line(err: BaseException) -> str:
    """The first non-empty line of an exception's message (transformers' messages run to several lines)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def _config_value(model, name: str):
    """``model.config.<name>``, or the training scripts' default when the config lacks the field."""
    from .training.script_utils import XMCDataArguments

    return getattr(model.config, name, XMCDataArguments.__dataclass_fields__[name].default)


def _pick_device(model, device: Optional[str]) -> None:  # device checked by _check_device
    """Move ``model`` to ``device`` (default: the first GPU when there is one)."""
    import torch

    model.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))


# ---------------------------------------------------------------------------------------------------------- train
def cmd_train(args: argparse.Namespace) -> int:
    """Run ``args.method``'s recipe with the remaining arguments, exactly as its training script would."""
    from .training.recipes import RECIPES, get_recipe

    if args.method not in RECIPES:
        raise UserError(f"unknown method {args.method!r} (choose from {', '.join(sorted(RECIPES))})")
    main = get_recipe(args.method)
    # The recipe parses sys.argv like its script does (help shows 'hf-xmc train <method>', and one .json argument
    # is read as a config file); the caller's sys.argv comes back afterwards.
    from .training.script_utils import run_script

    saved = sys.argv
    sys.argv = [f"{PROG} train {args.method}", *args.recipe_args]
    try:
        return run_script(main, list(args.recipe_args), prog=f"{PROG} train")
    finally:
        sys.argv = saved


# ---------------------------------------------------------------------------------------------------------- evaluate
def cmd_evaluate(args: argparse.Namespace) -> int:
    """Score a saved model on a test file with the training scripts' evaluator; print (and write) the metrics."""
    from .data import XCData
    from .data.data_files import read_points_file
    from .models.io_utils import write_json_atomic
    from .training.script_utils import XMCDataArguments, build_evaluator, dataset_name_from_path

    _require_file(args.test_file, "--test_file")
    _require_file(args.train_file, "--train_file")
    _require_file(args.test_filter_file, "--test_filter_file")
    _require_positive(args.batch_size, "--batch_size")
    _require_finite(args.propensity_a, "--propensity_a")
    _require_finite(args.propensity_b, "--propensity_b")
    _check_output_file(args.output_file)
    _check_device(args.device)
    model = load_model(args.model)
    _pick_device(model, args.device)
    num_labels = len(model.label_texts)  # the test file is read against the model's label space
    fields = tuple(args.text_fields.split(","))
    # XC JSON lines, parquet, csv, jsonl, arrow; points without a label are kept (scored 0) unless asked otherwise
    test = read_points_file(args.test_file, num_labels, "test", text_fields=fields, skip_unlabeled=args.skip_unlabeled_test_points)
    # The propensity constants default to the ones the model was trained (and evaluated) with.
    data_args = XMCDataArguments(
        train_file=args.train_file or "",
        test_file=args.test_file,
        label_file="",
        test_filter_file=args.test_filter_file,
        skip_unlabeled_test_points=args.skip_unlabeled_test_points,
        text_fields=args.text_fields,
        propensity_a=args.propensity_a if args.propensity_a is not None else _config_value(model, "propensity_a"),
        propensity_b=args.propensity_b if args.propensity_b is not None else _config_value(model, "propensity_b"),
        eval_batch_size=args.batch_size,
        latency_queries=args.latency_queries,
        dataset_name=dataset_name_from_path(args.train_file or args.test_file),
    )
    if args.train_file:
        train = read_points_file(args.train_file, num_labels, "train", text_fields=fields)
    else:
        train = None  # no propensities: build_evaluator leaves the PS metrics out
        print(f"{PROG} evaluate: note: no --train_file, so no label propensities: PSP@k and PSnDCG@k are left out",
              file=sys.stderr)
    data = XCData(train=train, test=test, label_texts=model.label_texts, label_uids=model.label_uids)
    with _query_encoder_of(model, args.model, args.query_encoder):
        metrics = build_evaluator(data, data_args)(model)
    if getattr(model, "lexical_channel", None) is not None:  # a file of the queries the ranker was refit on: said, and recorded
        seen = model.lexical_channel.queries_seen_by_ranker(test.uids)
        if seen:
            metrics["queries_seen_by_lexical_ranker"] = seen
            print(f"{PROG} evaluate: warning: {seen} of the {len(test)} queries of {args.test_file} trained the model's lexical ranker "
                  "(its training script's validation split): the fused metrics are not held out", file=sys.stderr)
    if args.output_file:
        write_json_atomic(args.output_file, metrics)
    print(json.dumps(metrics, indent=2, sort_keys=True))
    return 0


# ---------------------------------------------------------------------------------------------------------- predict
def read_queries(path: str, text_fields: Sequence[str] = ("title",)) -> list[str]:
    """Queries of a file: XC raw JSON lines (``.json``/``.jsonl``, optionally ``.gz``; ``text_fields`` joined) or
    plain text, one query per line (blank lines skipped; ``.gz`` read compressed). ``-`` or ``/dev/stdin`` reads
    standard input as plain text."""
    import contextlib

    from .data.xc_raw import _get_text, _iter_lines, _open_text, _parse_object

    texts: list[str] = []
    stdin = path in STDIN_NAMES
    is_json = not stdin and path.endswith(JSON_SUFFIXES)
    name = "<stdin>" if stdin else path
    with (contextlib.nullcontext(sys.stdin) if stdin else _open_text(path)) as f:
        for lineno, line in _iter_lines(f, name):
            if not line.strip():
                continue
            texts.append(_get_text(_parse_object(line, path, lineno), text_fields, path, lineno) if is_json else line)
    if not texts:
        raise UserError(f"{name}: no queries in the input")
    return texts


def prediction_records(model, texts: Sequence[Optional[str]], k: Optional[int], batch_size: int, images: Optional[Sequence[Optional[str]]] = None,
                       threshold: Optional[float] = None, query_encoder: Optional[str] = None) -> Iterator[dict[str, Any]]:
    """``{"text", "labels": [{"id", "uid", "text", "score"[, "probability"]}, ...]}`` per query (``"image"`` too when
    given), best label first (``model.predict`` top-``k``, or with ``threshold`` the labels whose calibrated probability
    reaches it; empty slots are dropped)."""
    from .serving import label_records

    if k is not None:
        k = min(k, len(model.label_texts))  # no (queries, k) arrays wider than the label count (--k 1000000000)
    for start in range(0, len(texts), PREDICT_CHUNK):
        chunk = list(texts[start : start + PREDICT_CHUNK])
        extra = {}
        if images is not None:
            extra["images"] = [[] if image is None else [image] for image in images[start : start + PREDICT_CHUNK]]
        if threshold is not None:
            extra["threshold"] = threshold
        if query_encoder is not None:
            extra["query_encoder"] = query_encoder
        pred = model.predict(chunk if any(t is not None for t in chunk) else None, k=k, batch_size=batch_size, **extra)
        probabilities = pred.probabilities.tolist() if pred.probabilities is not None else [None] * len(chunk)
        for i, (text, ids, scores, probs) in enumerate(zip(chunk, pred.label_ids.tolist(), pred.scores.tolist(), probabilities)):
            record = {"text": text, "labels": label_records(model, ids, scores, probs)}
            if images is not None:
                record["image"] = images[start + i]
            yield record


def _require_text_model(model, name: str, what: str) -> None:
    """Refuse, in one line, a model with a single query encoder (MUFIN: texts with images) for ``what``."""
    if model.takes_images:
        raise UserError(f"{name}: a {type(model).__name__} ranks texts with images; {what} is for the text models")


def _query_encoder_of(model, name: str, query_encoder: Optional[str]):
    """The context ``model.using_query_encoder(query_encoder)`` (None: the model's own), its faults (no static encoder,
    one fitted to other weights, a model with one encoder) checked first and given as one line."""
    if query_encoder is None:
        return contextlib.nullcontext()
    _require_text_model(model, name, "--query_encoder")
    if query_encoder == "static":
        try:
            model.check_static_query_encoder()
        except ValueError as err:
            raise UserError(f"{name}: {_first_line(err)}") from None
    return model.using_query_encoder(query_encoder)


def cmd_predict(args: argparse.Namespace) -> int:
    """Top-k labels for texts given on the command line or in a file, as JSON lines."""
    _require_positive(args.k, "--k")
    _require_positive(args.batch_size, "--batch_size")
    if args.threshold is not None and not 0 <= args.threshold <= 1:
        raise UserError(f"--threshold is a probability in [0, 1], got {args.threshold}")
    _require_file(args.input_file, "--input_file")
    _check_output_file(args.output_file)
    _check_device(args.device)
    images = None
    if args.image:
        for image in args.image:
            if not image.startswith("file://"):
                _require_file(image, "--image")
        if args.input_file:
            raise UserError("--image goes with --text (one text per image, or none), not with --input_file")
        texts = args.text
        if texts is not None and len(texts) != len(args.image):
            raise UserError(f"got {len(texts)} --text but {len(args.image)} --image: give one text per image, or only images")
        texts = texts if texts is not None else [None] * len(args.image)
        images = args.image
    else:
        if args.text is None and args.input_file is None:
            raise UserError("give --text, --input_file or --image")
        texts = args.text if args.text is not None else read_queries(args.input_file, tuple(args.text_fields.split(",")))
    model = load_model(args.model)
    _pick_device(model, args.device)
    if images is not None and "images" not in inspect.signature(model.predict).parameters:
        raise UserError(f"{args.model}: a {type(model).__name__} ranks texts only; --image needs a MUFIN model")
    with _query_encoder_of(model, args.model, args.query_encoder):  # checked now: a stale or missing static encoder is one line
        calibrated = model.score_calibration is not None
    if args.threshold is not None and not calibrated:
        raise UserError(f"{args.model}: the model has no score calibration{' for its static query encoder' if args.query_encoder == 'static' else ''}, "
                        "so --threshold has no probabilities to cut (train it with a validation split)")
    records = prediction_records(model, texts, args.k, args.batch_size, images, threshold=args.threshold, query_encoder=args.query_encoder)
    if args.output_file is None:
        _write_json_lines(sys.stdout, records)
    else:
        from .models.io_utils import atomic_write

        os.makedirs(os.path.dirname(os.path.abspath(args.output_file)), exist_ok=True)
        atomic_write(args.output_file, lambda tmp: _write_json_lines(tmp, records))  # no half-written file on failure
    return 0


# Line breaks to str.splitlines() that JSON leaves raw in a string: escaped, so one record stays one line for every reader
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def _write_json_lines(out: str | IO[str], records: Iterator[dict[str, Any]]) -> None:
    """Write one JSON object per line to a stream or to a file path."""
    if isinstance(out, str):
        with open(out, "w", encoding="utf-8") as f:
            _write_json_lines(f, records)
        return
    for record in records:
        out.write(json.dumps(record, ensure_ascii=False).translate(_LINE_BREAKS) + "\n")


# ---------------------------------------------------------------------------------------------------------- labels
def _blank_label_line(path: str, index: int) -> int:
    """The line number of the ``index``-th label of an XC label file (its reader skips blank lines)."""
    from .data.xc_raw import _iter_lines, _open_text

    seen = -1
    with _open_text(path) as f:
        for lineno, line in _iter_lines(f, path):
            seen += bool(line.strip())
            if seen == index:
                return lineno
    return index + 1


def cmd_add_labels(args: argparse.Namespace) -> int:
    """Add the labels of an XC label file (and remove labels by uid) without retraining; save the grown model and
    print what changed: ``removed`` counts the labels removed (every label that carries a given uid goes, so a uid
    repeated in the model removes several), ``removed_uids`` how many went per uid."""
    from .data import read_xc_labels
    from .training.script_utils import disk_full_named

    _require_file(args.label_file, "label_file")
    _require_positive(args.batch_size, "--batch_size")
    _check_device(args.device)
    if args.label_file is None and not args.remove:
        raise UserError("nothing to do: give a label file and/or --remove UIDS")
    if not args.output_dir and not os.path.isdir(args.model):
        raise UserError(f"{args.model}: not a local model directory; give --output_dir for the grown model")
    out = os.path.abspath(args.output_dir or args.model)
    if args.output_dir and os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"{args.output_dir}: --output_dir is a file, not a directory")
    if args.output_dir and os.path.exists(out) and os.listdir(out) and out != os.path.abspath(args.model):
        raise UserError(f"{args.output_dir}: exists and is not empty")
    uids, texts = (read_xc_labels(args.label_file, text_fields=tuple(args.text_fields.split(","))) if args.label_file else ([], []))
    blank = next((i for i, text in enumerate(texts) if not text.strip()), None)
    if blank is not None:  # a label nobody can tell apart, scored from an empty text: refused, not added silently
        raise UserError(f"{args.label_file}, line {_blank_label_line(args.label_file, blank)}: blank label text "
                        f"(field(s) {args.text_fields!r}); every label needs a text")
    model = load_model(args.model)
    _pick_device(model, args.device)
    removed_uids: dict[str, int] = {}
    try:
        if args.remove:
            wanted = list(dict.fromkeys(u for u in args.remove.split(",") if u))
            counts = {u: 0 for u in wanted}
            for uid in model.label_uids:
                if uid in counts:
                    counts[uid] += 1
            model.remove_labels(wanted)
            removed_uids = counts
    except ValueError as err:  # an unknown uid, or every label
        raise UserError(f"{args.model}: {_first_line(err)}") from None
    try:
        new_ids = model.add_labels(list(texts), uids=list(uids), batch_size=args.batch_size) if texts else []
    except ValueError as err:  # a uid taken
        raise UserError(f"{args.label_file}: {_first_line(err)}") from None
    importlib.import_module("hf_xmc.training.cards").refresh_card(model)  # the card's label count and config table follow the labels
    with disk_full_named(out, model):
        model.save_pretrained(out)  # a complete directory or none: staged beside the target, then moved into place
    print(json.dumps({"model": out, "labels": len(model.label_texts), "added": len(new_ids),
                      "removed": sum(removed_uids.values()), "removed_uids": removed_uids}))
    return 0


# ---------------------------------------------------------------------------------------------------------- static encoder
def cmd_fit_static(args: argparse.Namespace) -> int:
    """Fit a saved model's static query encoder on a training file (``hf_xmc.training.static_encoder``), tune its own
    fusion weights and calibration on a validation file when given, and save the model again (in place unless
    ``--output_dir``); prints what was fitted, with the validation metrics of both query encoders."""
    from .data import XCData
    from .data.data_files import read_points_file
    from .training.script_utils import XMCDataArguments, build_evaluator, disk_full_named
    from .training.static_encoder import fit_and_tune_static_query_encoder

    _require_file(args.train_file, "--train_file")
    _require_file(args.validation_file, "--validation_file")
    _require_positive(args.epochs, "--epochs")
    _require_positive(args.max_queries, "--max_queries")
    _check_device(args.device)
    if not args.output_dir and not os.path.isdir(args.model):
        raise UserError(f"{args.model}: not a local model directory; give --output_dir for the model with its static encoder")
    out = os.path.abspath(args.output_dir or args.model)
    if args.output_dir and os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"{args.output_dir}: --output_dir is a file, not a directory")
    model = load_model(args.model)
    _pick_device(model, args.device)
    _require_text_model(model, args.model, "a static query encoder")
    num_labels = len(model.label_texts)
    fields = tuple(args.text_fields.split(","))
    train = read_points_file(args.train_file, num_labels, "train", text_fields=fields)
    validation = evaluator = None
    if args.validation_file:
        validation = read_points_file(args.validation_file, num_labels, "validation", text_fields=fields)
        data_args = XMCDataArguments(train_file=args.train_file, test_file=args.validation_file, label_file="", text_fields=args.text_fields,
                                     propensity_a=_config_value(model, "propensity_a"), propensity_b=_config_value(model, "propensity_b"))
        data = XCData(train=train, test=validation, label_texts=model.label_texts, label_uids=model.label_uids)
        evaluator = build_evaluator(data, data_args)
        evaluator.name = "eval"
    calibration = args.score_calibration
    if calibration == "auto":  # as the tower: calibrated when the tower is and there is a split to fit on
        calibration = ((model.config.score_calibration or {}).get("method") or "isotonic") if model.config.score_calibration and evaluator else "none"
    try:
        info = fit_and_tune_static_query_encoder(model, train.texts, validation, train.targets, evaluator, calibration, epochs=args.epochs,
                                                 max_queries=args.max_queries, seed=args.seed, precision=args.precision,
                                                 objective=args.objective)
    except ValueError as err:
        raise UserError(f"{args.model}: {_first_line(err)}") from None
    if evaluator is not None:
        for encoder in ("transformer", "static"):
            with model.using_query_encoder(encoder):
                measured = evaluator(model)
            info[f"{encoder}_eval"] = {k[len("eval_"):]: round(v, 2) for k, v in measured.items() if k[len("eval_"):] in ("P@1", "P@5", "PSP@5", "R@100")}
    with disk_full_named(out, model):
        model.save_pretrained(out)  # a complete directory or none: staged beside the target, then moved into place
    print(json.dumps({"model": out, **info}))
    return 0


# ---------------------------------------------------------------------------------------------------------- push
def cmd_push(args: argparse.Namespace) -> int:
    """Upload a saved model directory to the Hub with :func:`hf_xmc.hub.push_to_hub`; prints the commit URL."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:  # checked first, --dry_run too: a repo id the Hub refuses would fail the push after the work
        validate_repo_id(args.repo_id)
    except HFValidationError as err:
        raise UserError(f"{args.repo_id}: not a valid Hub repo id ({_first_line(err)})") from None
    if not os.path.isdir(args.model_dir):
        raise UserError(f"{args.model_dir}: no such model directory")
    hub = importlib.import_module("hf_xmc.hub")  # imported here: the upload machinery is for push only
    local_base = importlib.import_module("hf_xmc.training.cards").adapter_base_warning(args.model_dir)
    if local_base:  # an adapter-only model that loads nowhere else: said before the push (and its dry run)
        print(f"{PROG} push: warning: {local_base}", file=sys.stderr)
    if args.dry_run:  # the files the push would upload, one per line; nothing is written or uploaded
        try:
            files = hub.upload_file_list(args.model_dir)
        except ValueError as err:
            message = _first_line(err)
            raise UserError(message if args.model_dir in message else f"{args.model_dir}: {message}") from None
        print("\n".join(files))
        return 0
    try:
        url = hub.push_to_hub(
            args.model_dir,
            args.repo_id,
            revision=args.revision,
            private=args.private,
            create_pr=args.create_pr,
            commit_message=args.commit_message,
            token=args.token,
        )
    except ValueError as err:  # push_to_hub's check of the directory (no weights, no labels, ...)
        message = _first_line(err)
        raise UserError(message if args.model_dir in message else f"{args.model_dir}: {message}") from None
    except OSError as err:  # HfHubHTTPError (authentication, permissions), offline mode, no connection
        print(f"{PROG} push: upload to {args.repo_id} failed: {_first_line(err)}", file=sys.stderr)
        return 1
    print(url)
    return 0


# ---------------------------------------------------------------------------------------------------------- parser
SERVE_LIMIT_FLAGS = ("max_texts", "max_chars", "max_k", "max_images", "max_image_bytes", "max_body_bytes", "max_pixels", "max_queue",
                     "request_timeout", "max_connections", "max_worker_restarts")  # ServingLimits' fields, one flag each


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the model and serve it until interrupted (``hf_xmc.serving``); exit status 1 when its prediction worker
    died for good (for a process supervisor to start it again)."""
    for flag in ("port", "workers", "max_batch", "max_texts", "max_chars", "max_k", "max_images", "max_image_bytes", "max_body_bytes",
                 "max_pixels", "max_queue", "max_connections"):
        _require_positive(getattr(args, flag), f"--{flag}")
    _require_finite(args.max_wait_ms, "--max_wait_ms", least=0)
    _require_finite(args.request_timeout, "--request_timeout")
    if args.request_timeout <= 0:
        raise UserError(f"--request_timeout must be more than 0 seconds, got {args.request_timeout:g}")
    if args.max_worker_restarts < 0:
        raise UserError(f"--max_worker_restarts must be at least 0, got {args.max_worker_restarts}")
    _check_device(args.device)
    try:
        import fastapi  # noqa: F401 - both checked before the model loads
        import uvicorn  # noqa: F401

        from .serving import ServingLimits, serve
    except ImportError as err:
        raise UserError(f"serving needs fastapi and uvicorn (pip install 'hf_xmc[serving]'): {_first_line(err)}") from None
    limits = ServingLimits(**{flag: getattr(args, flag) for flag in SERVE_LIMIT_FLAGS})
    if args.workers > 1:
        return serve_with_workers(args, limits)
    model = load_model(args.model, revision=args.revision)
    _pick_device(model, args.device)
    try:
        code = serve(model, host=args.host, port=args.port, limits=limits, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
                     backend=args.backend, query_encoder=args.query_encoder, wait_for_arrivals=args.wait_for_arrivals)
    except ValueError as err:  # --backend onnx without (a current) export; --query_encoder static without a current one
        raise UserError(f"{args.model}: {_first_line(err)}") from None
    if code:
        print(f"{PROG} serve: the prediction worker failed {args.max_worker_restarts + 1} time(s) in a row; stopped (exit status 1)",
              file=sys.stderr)
    return code


def _check_servable_model(args: argparse.Namespace) -> None:
    """Load the model as a worker of ``hf-xmc serve --workers N`` will and raise, in one line, what serving it would
    refuse (a stale ONNX export or static encoder); the model is let go when this returns."""
    from .serving import check_servable

    model = load_model(args.model, revision=args.revision)
    _pick_device(model, args.device)
    try:
        check_servable(model, args.backend, args.query_encoder)
    except ValueError as err:  # --backend onnx without (a current) export; --query_encoder static without a current one
        raise UserError(f"{args.model}: {_first_line(err)}") from None


def serve_with_workers(args: argparse.Namespace, limits) -> int:
    """``hf-xmc serve --workers N``: check here what each worker would refuse (one line, before the port is bound),
    holding no model while it serves, and serve with N processes (:func:`hf_xmc.serving.serve_workers`), each loading
    the model through :func:`serve_worker_app` with its share of the cores."""
    import dataclasses
    import gc

    from .serving import serve_workers, threads_per_worker

    _check_servable_model(args)
    gc.collect()  # the checked model's cycles (modules, hooks) go now, not at some later collection
    spec = {"model": args.model, "revision": args.revision, "device": args.device, "limits": dataclasses.asdict(limits),
            "max_batch": args.max_batch, "max_wait_ms": args.max_wait_ms, "backend": args.backend, "query_encoder": args.query_encoder,
            "wait_for_arrivals": args.wait_for_arrivals, "workers": args.workers, "threads": threads_per_worker(args.workers)}
    return serve_workers("hf_xmc.cli:serve_worker_app", spec, args.workers, host=args.host, port=args.port, limits=limits)


def serve_worker_app():
    """One worker process of ``hf-xmc serve --workers N`` (uvicorn's application factory): the model loaded as the
    parent loaded it, with the settings the parent left in ``WORKER_SPEC_ENV``. A prediction worker that fails past
    ``--max_worker_restarts`` stops this process (as SIGTERM would); the parent starts another."""
    import signal

    from .serving import WORKER_SPEC_ENV, ServingLimits, create_app, use_threads

    spec = json.loads(os.environ[WORKER_SPEC_ENV])
    model = load_model(spec["model"], revision=spec["revision"])
    _pick_device(model, spec["device"])
    use_threads(model, spec["threads"], spec["backend"])

    def on_dead(reason: str) -> None:
        print(f"{PROG} serve: worker process {os.getpid()}: the prediction worker is dead ({reason}); stopping it", file=sys.stderr)
        os.kill(os.getpid(), signal.SIGTERM)

    return create_app(model, ServingLimits(**spec["limits"]), spec["max_batch"], spec["max_wait_ms"], backend=spec["backend"],
                      on_dead=on_dead, query_encoder=spec["query_encoder"], wait_for_arrivals=spec["wait_for_arrivals"],
                      workers=spec["workers"])


def build_parser() -> argparse.ArgumentParser:
    """The ``hf-xmc`` argument parser (one subparser per command)."""
    from . import __version__
    from .training.recipes import RECIPES
    from .training.script_utils import XMCDataArguments

    defaults = XMCDataArguments.__dataclass_fields__  # evaluate's defaults are the training scripts' defaults
    # allow_abbrev=False everywhere: a mistyped flag (--tex, --max_step) is an error, never another flag's prefix
    parser = argparse.ArgumentParser(prog=PROG, description="Extreme multi-label classification models: train, evaluate, predict, push.",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,evaluate,predict,add-labels,fit-static,push,serve}")

    methods = ",".join(sorted(RECIPES))
    p = sub.add_parser(
        "train",
        allow_abbrev=False,
        help="train a method (the recipe of training_scripts/train_<method>.py)",
        description=f"Train a method with its recipe; every flag of training_scripts/train_<method>.py passes through "
        f"('{PROG} train <method> --help' lists them).",
    )
    p.add_argument("method", metavar=f"{{{methods}}}", help="the method to train")
    p.add_argument("recipe_args", nargs=argparse.REMAINDER, help="the recipe's flags (--train_file ... --output_dir ...)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("evaluate", allow_abbrev=False, help="P@k, nDCG@k, PSP@k, R@k of a saved model on a test file",
                       description="Evaluate a model directory or Hub repo id on XC raw test data with the evaluator "
                       "of the training scripts; prints the metrics as JSON (keys as in eval_results.json).")
    p.add_argument("model", help="model directory or Hub repo id")
    p.add_argument("--test_file", required=True, help="test points: XC raw JSON lines (tst.json.gz)")
    p.add_argument("--train_file", help="training points, for the label propensities of PSP@k (without it PSP is left out)")
    p.add_argument("--test_filter_file", help="pairs 'point_idx label_idx' removed from the predictions before scoring")
    p.add_argument("--skip_unlabeled_test_points", action="store_true",
                   help="average over the test points that have a label only (default: the others count as misses, as pyxclib does)")
    p.add_argument("--latency_queries", type=int, default=0,
                   help="also time this many test queries one at a time (test_latency_bs1_p50_ms, the median ms); 0: not measured")
    p.add_argument("--text_fields", default=defaults["text_fields"].default, help="comma-separated JSON fields joined into a query text")
    p.add_argument("--propensity_a", type=float, help="propensity constant A (default: the model's config)")
    p.add_argument("--propensity_b", type=float, help="propensity constant B (default: the model's config)")
    p.add_argument("--batch_size", type=int, default=defaults["eval_batch_size"].default, help="encoding batch size")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--output_file", help="also write the metrics JSON here")
    p.add_argument("--query_encoder", choices=["transformer", "static"], help="rank with the trained tower or the model's static query encoder (default: the model's)")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("predict", allow_abbrev=False, help="top-k labels for texts, as JSON lines",
                       description='Rank the model\'s labels for each query; one JSON line per query: {"text": ..., '
                       '"labels": [{"id", "uid", "text", "score"}, ...]}, best first.')
    p.add_argument("model", help="model directory or Hub repo id")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", action="append", help="a query (repeat for several)")
    src.add_argument("--input_file", help="plain text (one query per line) or XC raw JSON lines (.json/.json.gz); '-' (or /dev/stdin): standard input, plain text")
    p.add_argument("--image", action="append", help="MUFIN: a query image, a path or file:// URL (repeat for several; "
                   "with --text, one text per image)")
    p.add_argument("--text_fields", default="title", help="JSON fields joined into a query text (JSON input)")
    p.add_argument("--k", type=int, default=None, help="labels per query (default 5; with --threshold, the 100 best are cut)")
    p.add_argument("--threshold", type=float, help="keep the labels whose calibrated probability of being relevant is at least this (a model trained with a validation split)")
    p.add_argument("--batch_size", type=int, default=128, help="encoding batch size")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--output_file", help="write the JSON lines here (default: stdout)")
    p.add_argument("--query_encoder", choices=["transformer", "static"], help="rank with the trained tower or the model's static query encoder "
                   "(fit-static; its own fusion weights and calibration); default: the model's")
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("add-labels", allow_abbrev=False, help="add (or remove) labels of a trained model without retraining",
                       description="Append the labels of an XC label file (lbl.json.gz lines: uid, title), scored zero-shot "
                       "from their text while trained labels keep their parameters; --remove drops labels by uid. The "
                       "model is saved again (in place unless --output_dir), written beside and moved into place.")
    p.add_argument("model", help="model directory or Hub repo id")
    p.add_argument("label_file", nargs="?", help="labels to add: XC raw JSON lines (uid + text fields)")
    p.add_argument("--remove", help="comma-separated uids of labels to remove (before adding); every label with such a uid goes, "
                   "and the output's 'removed' counts them ('removed_uids': per uid)")
    p.add_argument("--text_fields", default="title", help="JSON fields joined into a label text")
    p.add_argument("--output_dir", help="where the grown model goes (default: the model directory itself)")
    p.add_argument("--batch_size", type=int, default=128, help="encoding batch size")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    p.set_defaults(func=cmd_add_labels)

    p = sub.add_parser("push", allow_abbrev=False, help="upload a saved model directory to the Hugging Face Hub",
                       description="Upload a model directory (weights, labels, label index, card) to a Hub repo.")
    p.add_argument("model_dir", help="directory written by training or save_pretrained")
    p.add_argument("repo_id", help="Hub repo id, e.g. org/name")
    p.add_argument("--revision", help="branch to push to")
    p.add_argument("--private", action=argparse.BooleanOptionalAction, default=None,
                   help="create the repo private (--no-private: public; default: the Hub's default)")
    p.add_argument("--create_pr", action="store_true", help="open a pull request instead of committing")
    p.add_argument("--commit_message", help="commit message")
    p.add_argument("--token", help="Hub token (default: the logged-in one)")
    p.add_argument("--dry_run", action="store_true", help="print the files the push would upload, one per line, and upload nothing")
    p.set_defaults(func=cmd_push)

    p = sub.add_parser("serve", allow_abbrev=False, help="an HTTP endpoint for a model (POST /predict, GET /health, GET /labels/{uid})",
                       description="Serve a model directory or Hub repo id over HTTP (FastAPI + uvicorn); concurrent requests "
                       "are batched into one predict call (docs/serving.md). A Hub repo id runs that repo's own Python code "
                       "(the model loads with trust_remote_code=True): serve only repos you trust, and pin the code you "
                       "reviewed with --revision <commit sha>.")
    p.add_argument("model", help="model directory or Hub repo id (a repo's code runs in this process: trust_remote_code=True)")
    p.add_argument("--revision", help="the Hub repo's branch, tag or commit to load, code included (a commit sha pins it); "
                   "not for a local directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--workers", type=int, default=1, help="processes serving the port (uvicorn's supervisor: each loads the "
                   "model, takes its share of the cores' threads and is started again if it dies; the limits hold per process)")
    p.add_argument("--max_batch", type=int, default=64, help="most texts one predict call serves")
    p.add_argument("--max_wait_ms", type=float, default=2.0, help="how long a batch waits for more requests after its first")
    p.add_argument("--wait_for_arrivals", action="store_true", default=True, help="(the default) a batch waits --max_wait_ms only "
                   "while another request has arrived and is being read; a request alone runs at once")
    p.add_argument("--no_wait_for_arrivals", dest="wait_for_arrivals", action="store_false", help="a batch always waits "
                   "--max_wait_ms after its first request (4-12 %% more queries a second at 16 clients at 53K labels, "
                   "twice the one-client latency: docs/serving.md)")
    p.add_argument("--max_texts", type=int, default=64, help="most items (texts) a request may send (more: 413)")
    p.add_argument("--max_chars", type=int, default=2000, help="most characters a text may have (more: 413)")
    p.add_argument("--max_k", type=int, default=100, help="largest k a request may ask for (more: 422)")
    p.add_argument("--max_images", type=int, default=16, help="most images an item may send, for a model that takes images (more: 413)")
    p.add_argument("--max_image_bytes", type=int, default=5_000_000, help="most encoded bytes an image may have (more: 413)")
    p.add_argument("--max_body_bytes", type=int, default=10_000_000, help="most bytes a request body may have, refused before "
                   "it is parsed (more: 413)")
    p.add_argument("--max_pixels", type=int, default=40_000_000, help="most decoded pixels a request's images may have in all, "
                   "read from their headers before decoding (more: 413); a batch decodes at most this many")
    p.add_argument("--max_queue", type=int, default=256, help="most items waiting for the prediction worker (more: 503)")
    p.add_argument("--request_timeout", type=float, default=30.0, help="seconds a request may wait for its answer (then 503); "
                   "also how long a batch may run before /health says 'stalled'")
    p.add_argument("--max_connections", type=int, default=64, help="most connections and requests handled at once (more: 503)")
    p.add_argument("--max_worker_restarts", type=int, default=3, help="times the prediction worker starts again after failing "
                   "with no batch served in between; one more failure stops the server with exit status 1")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--backend", choices=["torch", "onnx"], default="torch",
                   help="query encoder: torch, or the model's exported ONNX encoder (model.export_onnx(), saved beside it)")
    p.add_argument("--query_encoder", choices=["transformer", "static"], help="answer every request with the trained tower or the model's "
                   "static query encoder (fit-static: a bag of token vectors, ~0.2 ms a query on a CPU); default: the model's")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("fit-static", allow_abbrev=False, help="fit a saved model's static query encoder (a bag of token vectors) to its query tower",
                       description="Fit a static query encoder to a saved text model's query tower on training queries, tune its own "
                       "fusion weights and calibration on --validation_file, and save the model again (in place unless --output_dir). "
                       "predict / serve --query_encoder static use it.")
    p.add_argument("model", help="model directory (or Hub repo id with --output_dir)")
    p.add_argument("--train_file", required=True, help="training points (XC raw JSON lines): the queries the static encoder is fitted on")
    p.add_argument("--validation_file", help="held-out points the fusion weights and calibration are tuned on (never the test file)")
    p.add_argument("--text_fields", default="title", help="JSON fields joined into a query text")
    p.add_argument("--epochs", type=int, default=8, help="passes over the training queries")
    p.add_argument("--max_queries", type=int, help="fit on a seeded sample of at most this many training queries")
    p.add_argument("--score_calibration", choices=["auto", "isotonic", "platt", "none"], default="auto",
                   help="the static encoder's own calibration on --validation_file (auto: the tower's method, when the tower is calibrated)")
    p.add_argument("--seed", type=int, default=42, help="seed of the sample and the fit's batches")
    p.add_argument("--precision", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="precision of the tower's pass over the training queries (auto: bfloat16 where the hardware multiplies it natively)")
    p.add_argument("--objective", choices=STATIC_FIT_OBJECTIVES, default="auto",
                   help="what the fit minimises: the cosine to the tower's query vectors, plus a distillation of the tower's ranking "
                        "(+ranking) and / or the training loss on the training queries' own labels (+labels); auto: cosine and "
                        "cosine+labels both fitted, the better on --validation_file kept (cosine without one)")
    p.add_argument("--output_dir", help="where the model goes (default: the model directory itself)")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    p.set_defaults(func=cmd_fit_static)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``hf-xmc`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    from .data import XMCDataError
    from .training.script_utils import debug_requested, error_line

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (UserError, XMCDataError) as err:  # XMCDataError names the file, the line and the fault
        print(f"{PROG} {args.command}: {err}", file=sys.stderr)
    except OSError as err:  # a file that cannot be read or written (permissions, a full disk: DiskFullError)
        if debug_requested():
            raise
        print(f"{PROG} {args.command}: {error_line(err)}", file=sys.stderr)
    return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
