"""What every ``training_scripts/train_<method>.py`` shares: data arguments, the train/evaluate/save flow and
``eval_results.json`` (the training script contract of DESIGN.md)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import transformers
from transformers import HfArgumentParser, set_seed

from ..data import XCData, read_filter_file
from ..models.calibration import CALIBRATION_METHODS
from ..models.io_utils import atomic_write, write_json_atomic
from ..models.model_files import WEIGHTS_FILE, WEIGHTS_INDEX_FILE
from .evaluation import XMCEvaluator
from .presets import known_presets, preset_values
from .trainer import XMCTrainer, XMCTrainingArguments

logger = logging.getLogger(__name__)

EVAL_RESULTS_FILE = "eval_results.json"


@dataclass
class XMCDataArguments:
    """Data arguments of every training script: Extreme Classification Repository raw files (``--train_file``,
    ``--test_file``, ``--label_file``), or a ``datasets`` dataset (``--dataset_name`` without the files)."""

    train_file: Optional[str] = field(default=None, metadata={"help": "Training points: XC raw JSON lines (trn.json.gz), or a .parquet/.arrow/.csv/.json[l] file (columns --text_column, --label_column)."})
    test_file: Optional[str] = field(default=None, metadata={"help": "Test points: XC raw JSON lines (tst.json.gz), or a .parquet/.arrow/.csv/.json[l] file."})
    label_file: Optional[str] = field(default=None, metadata={"help": "Labels: XC raw JSON lines (lbl.json.gz), or a .parquet/.arrow/.csv/.json[l] file (column --label_text_column); line/row i = label id i."})
    test_filter_file: Optional[str] = field(
        default=None, metadata={"help": "Pairs 'point_idx label_idx' removed from test predictions before scoring (point_idx: row of the test file or split)."}
    )
    skip_unlabeled_test_points: bool = field(
        default=False,
        metadata={"help": "Test points without a label are counted as misses by default (score 0 in P@k, nDCG@k and R@k), as pyxclib and "
                  "the XC repository's tables do. True: averaged over labelled test points only, as some papers do; name it in every "
                  "table that uses it (eval_results.json records test_unlabeled_points and test_unlabeled_counted). Training and "
                  "validation points without a label are always skipped."},
    )
    train_filter_file: Optional[str] = field(
        default=None,
        metadata={"help": "Pairs 'point_idx label_idx' of the training points (the XC repository's filter_labels_train.txt) that are neither "
                  "positives nor negatives: removed from the validation rankings that tune the run and never mined as hard negatives "
                  "(default: filter_labels_train.txt next to --train_file when there is one; 'none': no file)."},
    )
    text_fields: str = field(default="title", metadata={"help": "Comma-separated JSON fields joined into a query text."})
    label_text_fields: str = field(default="title", metadata={"help": "Comma-separated JSON fields joined into a label text."})
    dataset_name: Optional[str] = field(
        default=None,
        metadata={"help": "Without --train_file: the data, read with `datasets` (a Hub dataset id, a save_to_disk directory, or "
                  "local .parquet/.arrow/.json/.csv files, comma-separated or a folder, each named for its split: train.parquet, test.parquet, labels.parquet). With the XC files: the dataset's name on the model card "
                  "(default: the train file's folder name)."},
    )
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "The dataset's configuration (datasets.load_dataset's name)."})
    train_split: str = field(default="train", metadata={"help": "Split of the training points."})
    test_split: str = field(default="test", metadata={"help": "Split of the test points."})
    label_dataset_name: Optional[str] = field(default=None, metadata={"help": "Dataset of the label texts (default: --dataset_name)."})
    label_dataset_config_name: Optional[str] = field(
        default=None, metadata={"help": "Its configuration (default: --dataset_config_name when the labels live in the same dataset)."}
    )
    label_split: str = field(default="labels", metadata={"help": "Split of the labels (row i = label id i)."})
    text_column: str = field(default="text", metadata={"help": "Column of the query texts."})
    label_column: str = field(default="labels", metadata={"help": "Column of the label-id lists."})
    image_column: str = field(default="images", metadata={"help": "Column of the query images (paths or datasets.Image()), when present."})
    label_text_column: str = field(default="text", metadata={"help": "Column of the label texts."})
    label_image_column: str = field(default="images", metadata={"help": "Column of the label images, when present."})
    max_seq_length: int = field(default=32, metadata={"help": "Token budget of a query."})
    label_max_seq_length: Optional[int] = field(default=None, metadata={"help": "Token budget of a label (default: max_seq_length)."})
    propensity_a: Optional[float] = field(
        default=None, metadata={"help": "Propensity constant A for PSP@k (default: the Extreme Classification Repository's for the dataset's "
                                        "name, --dataset_name or the train file's folder: 0.6 Amazon, 0.5 Wikipedia, else 0.55)."})
    propensity_b: Optional[float] = field(
        default=None, metadata={"help": "Propensity constant B for PSP@k (default: the dataset's, as for A: 2.6 Amazon, 0.4 Wikipedia, else 1.5)."})
    eval_batch_size: int = field(default=256, metadata={"help": "Encoding batch size at evaluation."})
    latency_queries: int = field(
        default=0,
        metadata={"help": "Also time the final model on this many test queries one at a time (batch size 1, after 3 untimed calls): "
                  "test_latency_bs1_p50_ms in eval_results.json, what one served request waits, beside test_samples_per_second's "
                  "batched throughput. 0: not measured."},
    )
    preset: Optional[str] = field(
        default=None,
        metadata={"help": "The paper's configuration for a dataset (e.g. lf-amazontitles-1.3m; 'list' names them): its values become the defaults, explicit flags win."},
    )
    # --- the validation split: what a run tunes (fusion weights, calibration, the best checkpoint) is tuned on it ---
    validation_file: Optional[str] = field(
        default=None, metadata={"help": "Validation points: XC raw JSON lines or a .parquet/.arrow/.csv/.json[l] file (default: carved out of the training points when the run needs them)."}
    )
    validation_split: Optional[str] = field(default=None, metadata={"help": "With --dataset_name: the split of the validation points (default: carved out of the training split when needed)."})
    validation_split_percentage: Optional[float] = field(
        default=None,
        metadata={"help": "Percentage of the training points held out for validation (0 = none). Default: 5%%, at least 500 and at most 2,000 "
                  "points (never over a fifth), when the run needs a validation split (--lexical_channel, --score_calibration, "
                  "--eval_strategy, --load_best_model_at_end); none otherwise."},
    )
    validation_size: Optional[int] = field(default=None, metadata={"help": "Number of training points held out for validation, instead of a percentage (0 = none)."})

    def __post_init__(self):
        if self.propensity_a is None or self.propensity_b is None:  # the dataset's constants (hf_xmc.metrics.propensity_constants)
            from ..metrics import propensity_constants

            a, b = propensity_constants(card_dataset_name(self) if (self.dataset_name or self.train_file) else None)
            self.propensity_a = a if self.propensity_a is None else self.propensity_a
            self.propensity_b = b if self.propensity_b is None else self.propensity_b
        if self.latency_queries < 0:
            raise ValueError(f"--latency_queries is a number of test queries >= 0, got {self.latency_queries}")
        for name in ("max_seq_length", "label_max_seq_length", "eval_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name} must be >= 1, got {value}")
        if self.validation_split_percentage is not None and not 0 <= self.validation_split_percentage < 100:
            raise ValueError(f"--validation_split_percentage must be in [0, 100), got {self.validation_split_percentage}")
        if self.validation_size is not None and self.validation_size < 0:
            raise ValueError(f"--validation_size must be >= 0, got {self.validation_size}")
        given = [flag for flag, value in (("--validation_file", self.validation_file), ("--validation_split", self.validation_split),
                                          ("--validation_split_percentage", self.validation_split_percentage),
                                          ("--validation_size", self.validation_size)) if value is not None]
        if len(given) > 1:
            raise ValueError(f"give one of {' and '.join(given)}: they name the validation points in different ways")


def run_log_level(training_args: XMCTrainingArguments) -> int:
    """The level this process logs at: ``--log_level`` on the main process, ``--log_level_replica`` on the others.
    ``passive`` (the default) is INFO on the main process (WARNING elsewhere) unless transformers' verbosity was
    turned down (``TRANSFORMERS_VERBOSITY``, ``transformers.logging.set_verbosity_*``): then that verbosity."""
    from transformers.training_args import trainer_log_levels

    main = training_args.process_index == 0
    level = trainer_log_levels[training_args.log_level if main else training_args.log_level_replica]
    if level != -1:
        return level
    verbosity = transformers.utils.logging.get_verbosity()
    if os.environ.get("TRANSFORMERS_VERBOSITY") or verbosity > logging.WARNING:
        return verbosity
    return logging.INFO if main else logging.WARNING


def setup_logging(training_args: XMCTrainingArguments) -> None:
    """Log at :func:`run_log_level` for this package and transformers (``--log_level warning`` keeps INFO, the
    encoder's config among it, off the console)."""
    level = run_log_level(training_args)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout, level=level)
    # basicConfig changes nothing once the root logger has a handler (a notebook, a second run in one process)
    logging.getLogger(__name__.split(".")[0]).setLevel(level)
    transformers.utils.logging.set_verbosity(level)


class XMCArgumentParser(HfArgumentParser):
    """The training scripts' ``HfArgumentParser``: hf_xmc's flags first, in titled groups (the model's, ``hf_xmc
    data``, ``hf_xmc training``), then transformers' ``TrainingArguments``; no prefix matching (``--max_step`` is an
    unknown flag, not ``--max_steps``); and a ``--no_<flag>`` whose help says that it turns ``--<flag>`` off."""

    def __init__(self, dataclass_types, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(dataclass_types, **kwargs)
        if "usage" not in kwargs:  # argparse's usage lists every flag (~170 lines): the required ones and where to look
            required = " ".join(f"{a.option_strings[0]} {a.metavar or a.dest.upper()}" for a in self._actions if a.required)
            self.usage = f"%(prog)s {required} [flags: --help lists them, hf_xmc's first]\n       %(prog)s config.json"

    def _add_dataclass_arguments(self, dtype) -> None:
        from typing import get_type_hints

        from transformers import TrainingArguments

        hints = get_type_hints(dtype)
        fields = [f for f in dataclasses.fields(dtype) if f.init]
        if issubclass(dtype, TrainingArguments):
            theirs = {f.name for f in dataclasses.fields(TrainingArguments)}
            groups = [("hf_xmc training", [f for f in fields if f.name not in theirs]),
                      ("transformers TrainingArguments", [f for f in fields if f.name in theirs])]
        elif dtype is XMCDataArguments:
            groups = [("hf_xmc data", fields)]
        else:
            groups = [(f"hf_xmc model ({dtype.__name__})", fields)]
        for title, group_fields in groups:
            group = self.add_argument_group(title)
            for f in group_fields:
                f.type = hints[f.name]
                self._parse_dataclass_field(group, f)
                if f.name in getattr(dtype, "AUTO_SWITCHES", ()):  # --bf16: true, false or auto (None)
                    action = next(a for a in group._group_actions if f"--{f.name}" in a.option_strings)
                    action.nargs, action.const, action.type = "?", True, _bool_or_auto  # the bare flag means true, as for a bool
                    action.metavar, action.default = "{true,false,auto}", "auto"  # argparse converts the string default
                if f.default is True:  # HfArgumentParser's --no_<name> copies the help of --<name>: say what it does
                    negation = next((a for a in group._group_actions if f"--no_{f.name}" in a.option_strings), None)
                    if negation is not None:
                        what = (negation.help or "").strip().rstrip(".")
                        negation.help = f"Switch --{f.name} off (it is on by default{': ' + what if what else ''})."
                        negation.default = argparse.SUPPRESS  # its "(default: False)" read as the opposite; --<name> sets the default


def _bool_or_auto(value: str) -> Optional[bool]:
    """An auto switch's value: ``auto`` is None (the default, resolved from the device), else a bool as transformers reads it."""
    from transformers.hf_argparser import string_to_bool

    return None if value.strip().lower() == "auto" else string_to_bool(value)


def parse_script_args(model_arguments: type, training_arguments: type, argv: Optional[list[str]] = None, method: Optional[str] = None) -> tuple:
    """Parse ``(model, XMCDataArguments, training)`` arguments from the command line (``argv``, default
    ``sys.argv[1:]``) or one ``.json`` file, then set up logging and seed everything: the seed comes before the
    model, whose fresh weights must not depend on chance.

    ``--preset NAME`` (or a ``"preset"`` key of the JSON file) applies ``method``'s preset
    (:mod:`hf_xmc.training.presets`): its values become the parser's defaults, so flags given explicitly (or keys of
    the JSON file) win. An unknown name, or ``list``, prints the known presets on one line and exits with status 2.
    """
    parser = XMCArgumentParser((model_arguments, XMCDataArguments, training_arguments))
    parser.error = functools.partial(_one_line_parser_error, parser)
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) == 1 and args[0].endswith(".json"):
        with open(os.path.abspath(args[0]), encoding="utf-8") as f:
            config = json.load(f)
        preset = _resolve_preset(parser, method, config.get("preset"))
        model_args, data_args, training_args = parser.parse_dict({**preset, **config})
    else:
        pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        pre.add_argument("--preset", default=None)
        preset = _resolve_preset(parser, method, pre.parse_known_args(args)[0].preset)
        for action in parser._actions:  # a preset may name what is otherwise required (the encoder)
            if action.dest in preset:
                action.required = False
        parser.set_defaults(**preset)
        model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=args)
    check_model_path(getattr(model_args, "model_name_or_path", None))
    setup_logging(training_args)
    if preset:
        logger.info("preset %s sets the defaults (flags given explicitly win): %s", data_args.preset, ", ".join(f"{k}={v}" for k, v in preset.items()))
    check_output_dir(training_args)
    set_seed(training_args.seed)
    return model_args, data_args, training_args


def _one_line_parser_error(parser: argparse.ArgumentParser, message: str) -> None:
    """argparse's error without the usage block (hundreds of flags): ``<prog>: error: <message>``, exit status 2."""
    print(f"{parser.prog}: error: {message} (--help lists the flags)", file=sys.stderr)
    raise SystemExit(2)


def looks_like_local_path(path: str) -> bool:
    """Whether a model name is meant as a local path, not a Hub id (``name`` or ``org/name``): absolute, starting with
    ``.`` or ``~``, more than one ``/``, the system's own separator, or ``dir/name`` where ``dir`` is a local
    directory (``out/dexml`` mistyped)."""
    if os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1 or (os.sep != "/" and os.sep in path):
        return True
    return "/" in path and os.path.isdir(path.split("/", 1)[0])


def check_model_path(path: Optional[str]) -> None:
    """Name a ``--model_name_or_path`` that is meant as a local directory but is none (:func:`looks_like_local_path`),
    or a directory without ``config.json``, at once: before transformers spends a minute on Hub retries and turns it
    into a Hub-id error."""
    if not path or os.path.isfile(os.path.join(path, "config.json")):
        return
    if os.path.isdir(path):
        raise ValueError(f"{path}: not a model directory (no config.json); --model_name_or_path takes a saved encoder or model, or a Hub id")
    if looks_like_local_path(path):
        raise ValueError(f"{path}: no such model directory (--model_name_or_path); a Hub id is 'name' or 'org/name'")


# ------------------------------------------------------------------------------------------------ a full disk
_DISK_FULL_WORDS = ("no space left on device", "storagefull", "disk quota exceeded", "os error 28", "file write failed")


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` says the disk (or the quota) is full: an ``OSError`` with ``ENOSPC`` / ``EDQUOT``, or an error
    raised from native code that says so in words (safetensors' ``SafetensorError``, torch's ``file write failed``)."""
    import errno

    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return True
    text = str(err).lower()
    return any(word in text for word in _DISK_FULL_WORDS)


class DiskFullError(OSError):
    """A save that ran out of disk: the message names the directory, the space the save needs and the space free."""


def estimated_save_bytes(model) -> int:
    """About how many bytes a save of ``model`` writes: its weights and buffers plus the label vectors and label texts
    stored beside them."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for block in model.label_embedding_blocks or ():
        total += int(getattr(block, "nbytes", 0)) or block.numel() * block.element_size()
    total += sum(len(t.encode("utf-8")) + 32 for t in model.label_texts or ())  # labels.jsonl
    return total


def _human_bytes(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def disk_full_message(directory: str, model=None, what: str = "the model", factor: float = 1.0) -> str:
    """``<directory>: no space left on device while saving <what> (about N needed, M free there)``."""
    parts = []
    if model is not None:
        parts.append(f"about {_human_bytes(estimated_save_bytes(model) * factor)} needed")
    existing = os.path.abspath(directory)
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    try:
        parts.append(f"{_human_bytes(shutil.disk_usage(existing).free)} free there")
    except OSError:
        pass
    detail = f" ({', '.join(parts)})" if parts else ""
    return f"{directory}: no space left on device while saving {what}{detail}: free some space or save elsewhere"


@contextlib.contextmanager
def disk_full_named(directory: str, model=None, what: str = "the model", factor: float = 1.0):
    """Turn a full disk met inside the block (an ``OSError``, or a ``SafetensorError`` / ``RuntimeError`` from native
    code) into a :class:`DiskFullError` naming ``directory`` and the space ``model``'s save needs (``factor`` times its
    files: 3 for a checkpoint, which adds the optimizer's two moments). Saves are staged, so the previous model stays."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as err:
        if not is_disk_full(err):
            raise
        raise DiskFullError(disk_full_message(directory, model, what, factor)) from err


DEBUG_ENV = "HF_XMC_DEBUG"  # set (to anything but 0) for the full traceback of an input fault


def debug_requested() -> bool:
    """Whether ``HF_XMC_DEBUG`` asks for the full traceback instead of the one-line error."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def error_line(err: BaseException) -> str:
    """The one line an input fault ends on: ``<file>: <reason>`` for an ``OSError`` that names its file ("[Errno 2] No
    such file ..." -> "<file>: no such file or directory"), else the first line of the message."""
    if isinstance(err, OSError) and err.filename and err.strerror:
        return f"{err.filename}: {err.strerror[:1].lower()}{err.strerror[1:]}"
    return _first_line(err)


def run_script(main, argv: Optional[list[str]] = None, prog: Optional[str] = None) -> int:
    """Run a training script's ``main``: a fault in the input (a data file, a model or output directory, an argument
    value, a missing optional dependency, a full disk; ``ValueError`` / ``OSError`` / ``ImportError`` and the IO errors
    of native code, which name the file and the fault) ends as ONE line on stderr, ``<prog>: <message>``, and exit
    status 2, nothing written by the run; running out of memory ends as one line with what to
    lower, exit status 1. In a run of several processes the line names the rank (``<prog> (rank 1): ...``); the
    launcher (``accelerate launch`` / ``torchrun``) then stops the other ranks, which would wait for it forever.
    ``--debug`` (or ``HF_XMC_DEBUG=1``) re-raises with the traceback. Returns the exit status."""
    import torch
    from safetensors import SafetensorError

    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or debug_requested()
    args = [a for a in args if a != "--debug"]
    prog = prog or os.path.basename(sys.argv[0])
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        prog = f"{prog} (rank {os.environ.get('RANK', '?')})"
    out_of_memory = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), MemoryError)
    try:
        main(args)
    except out_of_memory as err:  # before RuntimeError: torch's OutOfMemoryError is one
        if debug:
            raise
        print(
            f"{prog}: out of memory ({_first_line(err)}): lower --per_device_train_batch_size, or set "
            "--gradient_cache_chunk_size to encode a batch in chunks (docs/scale.md gives the memory per label and query)",
            file=sys.stderr,
        )
        return 1
    except (ValueError, OSError, ImportError, SafetensorError, RuntimeError) as err:  # XMCDataError is a ValueError
        # ImportError: an optional dependency missing; SafetensorError / RuntimeError: native code's IO faults (a full
        # disk); any other RuntimeError is a bug and keeps its traceback
        if debug or (isinstance(err, RuntimeError) and not is_disk_full(err)):
            raise
        print(f"{prog}: {error_line(err)}", file=sys.stderr)
        return 2
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # a process group still alive when the interpreter exits can abort the process ("terminate called without an
        # active exception") after a run that succeeded
        torch.distributed.destroy_process_group()
    return 0


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def resume_argument(training_args) -> Optional[str | bool]:
    """``--resume_from_checkpoint``: ``true`` / ``last`` resume from the newest complete checkpoint of
    ``--output_dir`` (``True`` for :meth:`XMCTrainer.train`); anything else names a checkpoint directory."""
    value = training_args.resume_from_checkpoint
    if value is None or value is True:
        return value
    if str(value).lower() in ("true", "last"):
        return True
    if not os.path.isdir(value):
        raise ValueError(f"{value}: --resume_from_checkpoint names no checkpoint directory (use 'true' for the last one in --output_dir)")
    return value


STAGE_WEIGHTS_FILE = "stage_weights.safetensors"  # an earlier stage's result, for a resumed run to start from
STAGE_DONE_FILE = "stage_complete.json"


def stage_finished(stage_dir: str, resume) -> bool:
    """True when a resumed run (``resume``: what :func:`resume_argument` gives) finds the stage trained into
    ``stage_dir`` finished: :func:`train_stage` reads its weights back instead of training it. A recipe can then skip
    what only sets up that stage's start (SiameseXML's IDF pass: the stage's weights carry the IDF)."""
    return bool(resume) and os.path.isfile(os.path.join(stage_dir, STAGE_DONE_FILE))


# config.validation of a run that holds no split out (a None would not be written to a checkpoint's config.json, and a
# resumed run could not tell "no split" from "a checkpoint from before the record")
NO_VALIDATION_SPLIT = {"source": "none", "queries": 0}


def check_resumed_split(checkpoint_dir: Optional[str], record: Optional[dict]) -> None:
    """Refuse to resume from ``checkpoint_dir`` when it trained with another validation split than this run's
    (``record``: ``data.validation_record``, None without a split): the split is part of what a checkpoint was derived
    from (``provenance.py``, part ``validation_split``, policy ``refuse``). Resumed with a split it had not held out, a
    run would tune on queries it trained on; with another seed at the same size, its restored shortlists would belong
    to other rows. A checkpoint from before the record (no ``validation`` key in its config.json) is not compared."""
    config_path = os.path.join(str(checkpoint_dir), "config.json") if checkpoint_dir else None
    if not config_path or not os.path.isfile(config_path):
        return
    with open(config_path, encoding="utf-8") as f:
        saved = json.load(f)
    if "validation" in saved:
        check_split_record(checkpoint_dir, saved["validation"], record)


def check_split_record(subject: str, saved: Optional[dict], record: Optional[dict]) -> None:
    """One line, exit 2 (a :class:`StaleDerivedPartError`) when the validation split ``saved`` with ``subject`` (a
    checkpoint, a finished stage) is not this run's ``record`` (None: no split)."""
    from ..models.provenance import check_derived

    def inputs(value: Optional[dict]) -> dict:
        value = value or NO_VALIDATION_SPLIT
        return {"source": value.get("source"), "queries": value.get("queries"), "seed": value.get("seed"), "fingerprint": value.get("fingerprint")}

    check_derived("validation_split", inputs(saved), inputs(record), subject,
                  "resume with the same validation flags and --seed, or train into a new --output_dir")


def train_stage(trainer: XMCTrainer, resume, validation_record: Optional[dict] = None) -> None:
    """Train an earlier stage of a multi-stage recipe (SiameseXML's and MUFIN's Module I, PRIME before its classifier
    stage) in its own directory under ``--output_dir``, so that a run killed at any point resumes (``resume``: what
    :func:`resume_argument` gives) to the metrics of an uninterrupted one: a finished stage is not trained again but
    its weights are read back (``stage_weights.safetensors``, then ``stage_complete.json``, written when the stage
    ends if the run saves checkpoints at all); a stage killed midway resumes from its last complete checkpoint.

    Disk: one copy of the model's weights per finished stage (PRIME at 1.3M labels: its centroid bank, 2 GB)."""
    from safetensors.torch import load_model, save_model

    out = trainer.args.output_dir
    model = trainer.accelerator.unwrap_model(trainer.model)
    if validation_record is None:
        validation_record = getattr(model.config, "validation", None)
    model.config.validation = validation_record or NO_VALIDATION_SPLIT  # the stage's checkpoints record their split
    weights, done = os.path.join(out, STAGE_WEIGHTS_FILE), os.path.join(out, STAGE_DONE_FILE)
    if stage_finished(out, resume):
        with open(done, encoding="utf-8") as f:
            finished = json.load(f)
        if "validation" in finished:  # a stage finished with another split is refused like a checkpoint
            check_split_record(done, finished["validation"], validation_record)
        load_model(model, weights, strict=True, device=str(trainer.args.device))
        logger.info("%s: the stage finished before; its weights are read back, not trained again", out)
        return
    checkpoint = trainer.last_complete_checkpoint() if resume else None
    check_resumed_split(checkpoint, validation_record)
    with disk_full_named(out, model, "a checkpoint (weights and optimizer state)", factor=3):
        trainer.train(resume_from_checkpoint=checkpoint)
    if trainer.args.save_strategy != "no" and trainer.is_world_process_zero():
        with disk_full_named(out, model, "the stage's weights"):
            atomic_write(weights, lambda p: save_model(model, p, metadata={"format": "pt"}))
            write_json_atomic(done, {"global_step": trainer.state.global_step, "weights": STAGE_WEIGHTS_FILE, "validation": validation_record})
    trainer.accelerator.wait_for_everyone()


def check_output_dir(training_args) -> None:
    """Refuse to train into a directory that holds a finished model (``config.json`` beside weights or
    ``eval_results.json``) unless ``--overwrite_output_dir`` is given or ``--resume_from_checkpoint`` continues a run
    there: checked before any work, so an hour of mining is not spent on a run that would overwrite a model."""
    out = training_args.output_dir
    if out and os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"{out}: --output_dir is a file, not a directory")
    resume_argument(training_args)  # a checkpoint that does not exist is named before any work
    if not out or training_args.overwrite_output_dir or training_args.resume_from_checkpoint:
        return
    finished = os.path.isfile(os.path.join(out, "config.json")) and any(
        os.path.isfile(os.path.join(out, name)) for name in (EVAL_RESULTS_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE)
    )
    if finished:
        raise ValueError(
            f"{out}: already holds a finished model; pass --overwrite_output_dir true to train over it, "
            "--resume_from_checkpoint to continue a run there, or another --output_dir"
        )


def _resolve_preset(parser: HfArgumentParser, method: Optional[str], name: Optional[str]) -> dict:
    """The values of ``method``'s preset ``name`` ({} for no preset); exits with status 2 and one line naming the
    known presets when ``name`` is unknown or ``list``."""
    if name is None:
        return {}
    try:
        return preset_values(method or "", name)
    except KeyError:
        known = ", ".join(known_presets(method or "")) or "none"
        what = "known presets" if name == "list" else f"unknown preset {name!r}"
        print(f"{parser.prog}: error: --preset: {what} for {method or 'this script'}: {known}", file=sys.stderr)
        raise SystemExit(2) from None


def model_config_kwargs(model_args, data_args: XMCDataArguments) -> dict:
    """Config fields for ``<Model>.from_encoder_pretrained``: every field of a script's model-argument dataclass (they
    are named after the config fields) except ``model_name_or_path``, plus the token budgets and propensity constants
    of the data arguments."""
    kwargs = {f.name: getattr(model_args, f.name) for f in dataclasses.fields(model_args) if f.name != "model_name_or_path"}
    kwargs.update(
        max_seq_length=data_args.max_seq_length,
        label_max_seq_length=data_args.label_max_seq_length or data_args.max_seq_length,
        propensity_a=data_args.propensity_a,
        propensity_b=data_args.propensity_b,
    )
    return kwargs


def uses_hf_dataset(data_args: XMCDataArguments) -> bool:
    """True when the data comes from ``datasets`` (``--dataset_name`` and no XC files); raises a ValueError naming
    what is missing when neither source is complete."""
    files = [data_args.train_file, data_args.test_file, data_args.label_file]
    if all(files):
        return False
    if any(files):
        missing = [flag for flag, f in zip(("--train_file", "--test_file", "--label_file"), files) if not f]
        raise ValueError(f"the XC files come in threes: {', '.join(missing)} missing")
    if not data_args.dataset_name:
        raise ValueError("no data: give --train_file, --test_file and --label_file, or --dataset_name (a Hub dataset, a save_to_disk directory or data files)")
    return True


def load_data(data_args: XMCDataArguments, training_args: Optional[XMCTrainingArguments] = None, tuned_by_recipe: Sequence[str] = ()) -> XCData:
    """Read the train/test/label files named by the data arguments, or the ``datasets`` dataset of ``--dataset_name``;
    with ``training_args``, also the validation points the run needs (:func:`prepare_validation`; ``tuned_by_recipe``:
    the recipe's own settings that it tunes on them, e.g. SiameseXML's ``--fusion_weight`` left unset)."""
    if uses_hf_dataset(data_args):
        from ..data import load_hf_xc_data

        data = load_hf_xc_data(
            data_args.dataset_name, data_args.dataset_config_name, data_args.train_split, data_args.test_split,
            label_dataset_name=data_args.label_dataset_name, label_dataset_config_name=data_args.label_dataset_config_name,
            label_split=data_args.label_split, text_column=data_args.text_column, label_column=data_args.label_column,
            image_column=data_args.image_column, label_text_column=data_args.label_text_column, label_image_column=data_args.label_image_column,
            validation_split=data_args.validation_split, skip_unlabeled_test_points=data_args.skip_unlabeled_test_points,
        )
        logger.info("data from datasets %s: %d train, %d test points, %d labels", data_args.dataset_name, len(data.train), len(data.test), len(data.label_texts))
    else:
        if data_args.validation_split is not None:
            raise ValueError("--validation_split names a split of --dataset_name; with XC files give --validation_file")
        from ..data.data_files import load_data_files

        # one file per split, each XC raw JSON lines or a parquet / arrow / csv / json file read with datasets
        data = load_data_files(
            data_args.train_file, data_args.test_file, data_args.label_file, data_args.validation_file,
            text_fields=tuple(data_args.text_fields.split(",")), label_text_fields=tuple(data_args.label_text_fields.split(",")),
            text_column=data_args.text_column, label_column=data_args.label_column, image_column=data_args.image_column,
            label_text_column=data_args.label_text_column, label_image_column=data_args.label_image_column,
            skip_unlabeled_test_points=data_args.skip_unlabeled_test_points,
        )
        logger.info("data: %d train, %d test points, %d labels", len(data.train), len(data.test), len(data.label_texts))
    train_filter = training_filter_file(data_args)
    if train_filter:
        # rows index records of the training file (as a test filter file's do the test file's); select() carries
        # them into the validation points carved out below
        filt = read_filter_file(train_filter, num_points=data.train.num_source_records, num_labels=len(data.label_texts))
        data.train.filter_matrix = filt[data.train.record_indices()]
        logger.info("training filter %s: %d (point, label) pairs are neither positives nor negatives", train_filter, data.train.filter_matrix.nnz)
    if training_args is not None:
        data = prepare_validation(data, data_args, training_args, tuned_by_recipe)
    return data


TRAIN_FILTER_FILE = "filter_labels_train.txt"  # the Extreme Classification Repository's name, beside trn.json.gz


def training_filter_file(data_args: XMCDataArguments) -> Optional[str]:
    """The training filter file of the run: ``--train_filter_file``, or the repository's ``filter_labels_train.txt``
    beside the training file when the flag is not given (None: no file, or ``--train_filter_file none``)."""
    given = data_args.train_filter_file
    if given is not None:
        return None if given.lower() == "none" else given
    if data_args.train_file and not uses_hf_dataset(data_args):
        beside = os.path.join(os.path.dirname(os.path.abspath(data_args.train_file)), TRAIN_FILTER_FILE)
        if os.path.isfile(beside):
            logger.info("%s beside the training file: its pairs are not scored on the validation split nor mined as negatives "
                        "(--train_filter_file none: not used)", beside)
            return beside
    return None


def needs_validation(training_args: XMCTrainingArguments) -> list[str]:
    """The flags of a run that tune on a validation split (empty: the run needs none)."""
    from transformers.trainer_utils import IntervalStrategy

    needs = []
    if getattr(training_args, "lexical_channel", "none") != "none":
        needs.append("--lexical_channel")
    if getattr(training_args, "score_calibration", "auto") in CALIBRATION_METHODS:
        needs.append("--score_calibration")
    if training_args.eval_strategy != IntervalStrategy.NO:
        needs.append("--eval_strategy")
    if training_args.load_best_model_at_end:
        needs.append("--load_best_model_at_end")
    return needs


def prepare_validation(data: XCData, data_args: XMCDataArguments, training_args: XMCTrainingArguments, tuned_by_recipe: Sequence[str] = ()) -> XCData:
    """The validation points of the run, before anything trains: the ones of ``--validation_file`` /
    ``--validation_split`` when given (already in ``data.validation``), else ``--validation_size`` queries or
    ``--validation_split_percentage`` percent of the training queries, else, when the run needs a split
    (:func:`needs_validation`), :func:`hf_xmc.data.splits.default_validation_size` of them; none otherwise. The draw
    uses ``--seed`` only, so every process of a run (and a resumed run) holds out the same queries. Recorded in
    ``data.validation_record`` (the saved config's ``validation`` and the card)."""
    from ..data.splits import carve_validation, default_validation_size, validation_record

    required = needs_validation(training_args)
    needs = required + list(tuned_by_recipe)  # a recipe's own tuning falls back to its default without a split
    if data.validation is not None:
        source = data_args.validation_file or f"split {data_args.validation_split!r}"
        data.validation_record = validation_record(data, source)
        logger.info("validation: %d points from %s", len(data.validation), source)
        return data
    n = len(data.train)
    if data_args.validation_size is not None:
        size = data_args.validation_size
    elif data_args.validation_split_percentage is not None:
        size = int(round(n * data_args.validation_split_percentage / 100))
    else:
        size = default_validation_size(n) if needs else 0
    if size == 0:
        if needs:
            if data_args.validation_size == 0 or data_args.validation_split_percentage == 0:
                logger.warning("no validation split (asked for 0 points): %s tune on training points the model has seen", ", ".join(needs))
            elif required:
                raise ValueError(f"{', '.join(required)} tune on a validation split, and {n} training points are too few to hold one out: give --validation_file")
        data.validation_record = None
        return data
    if size >= n:
        raise ValueError(f"--validation_size {size} leaves no training points (there are {n})")
    data = carve_validation(data, size, training_args.seed)
    data.validation_record = validation_record(data, "training split", seed=training_args.seed)
    logger.info("validation: %d of the %d training points held out (seed %d), %d left to train on", size, n, training_args.seed, len(data.train))
    return data


def build_evaluator(data: XCData, data_args: XMCDataArguments) -> XMCEvaluator:
    """The test-set evaluator of the contract (``test_*`` keys, filter file applied when given, and the convention of
    test points without a label recorded: ``test_unlabeled_points``, ``test_unlabeled_counted``); ``data.train`` may be
    None (no propensities, so no PSP@k / PSnDCG@k)."""
    filt = None
    if data_args.test_filter_file:
        filt = read_filter_file(data_args.test_filter_file, num_points=data.test.num_source_records, num_labels=len(data.label_texts))
        filt = filt[data.test.record_indices()]  # filter rows index file records; unlabeled ones were skipped
    return XMCEvaluator(
        data.test,
        data.label_texts,
        data.label_uids,
        train_targets=data.propensity_targets() if data.train is not None else None,  # no train split: no PS metrics
        propensity_a=data_args.propensity_a,
        propensity_b=data_args.propensity_b,
        filter_matrix=filt,
        name="test",
        batch_size=data_args.eval_batch_size,
        dataset_name=card_dataset_name(data_args),
        dataset_id=hub_dataset_id(data_args),
        unlabeled_counted=not data_args.skip_unlabeled_test_points,
        latency_queries=data_args.latency_queries,
    )


def hub_dataset_id(data_args: XMCDataArguments) -> Optional[str]:
    """The Hub id of a dataset the training read with ``datasets`` (the card's ``datasets:``); None for local data."""
    name = data_args.dataset_name
    if not name or data_args.train_file or data_args.test_file or os.path.exists(name) or any(os.path.exists(f) for f in name.split(",")):
        return None
    return name


def card_dataset_name(data_args: XMCDataArguments) -> str:
    """The dataset's name on the card: ``--dataset_name`` (a local directory or file by its name), else the folder
    of the XC train file."""
    name = data_args.dataset_name
    if name and not (data_args.train_file or data_args.test_file) and not hub_dataset_id(data_args):
        return os.path.basename(os.path.normpath(name.split(",")[0])) or name
    return name or dataset_name_from_path(data_args.train_file)


def dataset_name_from_path(path: str) -> str:
    """A dataset's name from one of its files: the folder name (``.../LF-AmazonTitles-131K/trn.json.gz``)."""
    return os.path.basename(os.path.dirname(os.path.abspath(path))) or "dataset"


def validation_evaluator(data: XCData, evaluator: XMCEvaluator) -> Optional[XMCEvaluator]:
    """The evaluator of the run's validation points (keys ``eval_*``: what ``--eval_strategy`` logs and
    ``--metric_for_best_model`` reads), a twin of the test ``evaluator``; None without a validation split."""
    return evaluator.for_queries(data.validation, "eval") if data.validation is not None else None


def stage_evaluation(data: XCData, evaluator: XMCEvaluator) -> dict:
    """``XMCTrainer`` keyword arguments for an earlier stage of a multi-stage recipe (SiameseXML's and MUFIN's Module I,
    PRIME before PRIME (W)): its ``--eval_strategy`` evaluates on the validation split too, with the twin of the test
    ``evaluator`` ({} without a split)."""
    if data.validation is None:
        return {}
    return {"evaluator": validation_evaluator(data, evaluator), "eval_dataset": data.validation}


def check_validation(training_args: XMCTrainingArguments, validation: Optional[XMCEvaluator]) -> None:
    """Refuse ``--eval_strategy`` / ``--load_best_model_at_end`` without validation points (they never read the test file)."""
    from transformers.trainer_utils import IntervalStrategy

    if validation is None and (training_args.eval_strategy != IntervalStrategy.NO or training_args.load_best_model_at_end):
        raise ValueError("--eval_strategy / --load_best_model_at_end evaluate on a validation split, and this run has none "
                         "(--validation_size 0?): give --validation_file, --validation_size N or --validation_split_percentage P")


def tune_after_training(model, trainer: XMCTrainer, data: XCData, validation: Optional[XMCEvaluator], evaluator: XMCEvaluator,
                        training_args: XMCTrainingArguments, tune_settings: Optional[Sequence[str]], metrics: dict) -> tuple[str, dict]:
    """What a run fits on the validation split once training is done, in order: the model's tunable ranking settings,
    the lexical channel (fused on top of that ranking), the score calibration (on the fused ranking, as deep as
    ``predict(threshold=)`` reads it), then the channel's ranker trained again on every query. Adds the runtimes and
    choices to ``metrics``; returns the calibration method (``"none"``) and the fitted calibrations by method."""
    tunable = [name for name in model.tunable_ranking_settings if tune_settings is None or name in tune_settings]
    if tunable and validation is not None:  # the model's own ranking first: the channel is fused on top of it
        from .evaluation import tune_ranking_settings

        start = time.perf_counter()
        chosen = tune_ranking_settings(model, validation, tunable)
        metrics.update({f"tuned_{name}": value for name, value in chosen.items()}, ranking_tuning_runtime=round(time.perf_counter() - start, 4))
    start = time.perf_counter()
    channel = trainer.fit_lexical_channel(data.validation, batch_size=evaluator.batch_size)  # None without --lexical_channel
    if channel is not None:
        metrics["lexical_fit_runtime"] = round(time.perf_counter() - start, 4)
        metrics["lexical_ranker_weight"], metrics["lexical_text_weight"] = channel.settings["ranker_weight"], channel.settings["text_weight"]
        on_edge = (channel.tuning or {}).get("on_edge", [])  # 1: the tuned weight ended on its grid's cap (docs/lexical.md)
        metrics["lexical_ranker_weight_on_edge"], metrics["lexical_text_weight_on_edge"] = int("ranker_weight" in on_edge), int("text_weight" in on_edge)
    method = training_args.score_calibration
    if method == "auto":
        method = "isotonic" if validation is not None else "none"
    calibrations: dict = {}
    if method != "none":
        from .calibration import fit_score_calibration

        start = time.perf_counter()
        other = tuple(m for m in CALIBRATION_METHODS if m != method)  # fitted beside it: its test ECE is reported too
        calibrations = fit_score_calibration(model, validation, method, also=other)
        metrics["calibration_runtime"] = round(time.perf_counter() - start, 4)
    if validation is not None:
        # the final model's validation metrics (eval_*, eval_dense_* with a channel): what a sweep or a "which
        # default" decision reads, never the test split; before the ranker is trained again on these queries
        trainer.evaluator = validation
        metrics.update({k: v for k, v in trainer.evaluate(metric_key_prefix=validation.name).items() if k != "epoch"})
    if training_args.static_query_encoder:  # fitted to the final tower, tuned on the same validation queries
        from .static_encoder import fit_and_tune_static_query_encoder

        metrics.update(fit_and_tune_static_query_encoder(
            model, data.train.texts, data.validation, data.train.targets, validation, method, epochs=training_args.static_query_encoder_epochs,
            max_queries=training_args.static_query_encoder_max_queries, seed=training_args.seed, precision=training_args.static_query_encoder_precision,
            objective=training_args.static_query_encoder_objective, ranker_weight=training_args.lexical_ranker_weight,
            text_weight=training_args.lexical_text_weight, batch_size=evaluator.batch_size, show_progress_bar=not training_args.disable_tqdm))
        if validation is not None:
            trainer.evaluator = validation
            with model.using_query_encoder("static"):
                metrics.update({k: v for k, v in trainer.evaluate(metric_key_prefix=f"{validation.name}_static").items() if k != "epoch"})
    if training_args.lexical_channel != "none" and data.validation is not None and training_args.lexical_refit_ranker:
        from .lexical import refit_lexical_ranker

        start = time.perf_counter()  # after the calibration: it is fitted on queries the ranker has not seen
        calibrations_by_encoder = {}
        for encoder in ("transformer", "static") if model.static_query_encoder is not None else ("transformer",):
            with model.using_query_encoder(encoder):
                calibrations_by_encoder[encoder] = model.score_calibration
        refit_lexical_ranker(model.lexical_channel, data.train, data.validation)
        for encoder, calibration in calibrations_by_encoder.items():
            if calibration is not None:
                # carried over on purpose, and stamped with the refit ranker: the calibration models how this ranker family
                # scores queries it has not trained on, which is what the refit ranker meets on every new query
                with model.using_query_encoder(encoder):
                    model.set_score_calibration(calibration)
        metrics["lexical_fit_runtime"] += round(time.perf_counter() - start, 4)
    return method, calibrations


def train_and_evaluate(
    model,
    data: XCData,
    evaluator: XMCEvaluator,
    training_args: XMCTrainingArguments,
    card_kwargs: Optional[dict] = None,
    tune_settings: Optional[Sequence[str]] = None,
    **trainer_kwargs,
) -> dict:
    """Train ``model`` on ``data.train``, tune what the run tunes on ``data.validation`` (the lexical channel's weights,
    the score calibration; ``--eval_strategy`` evaluates on it during training and ``--load_best_model_at_end`` keeps
    the best checkpoint by it), evaluate it with ``evaluator`` (the test file), save it (with labels, vectors, index and
    model card) to ``output_dir``, write ``eval_results.json`` there and, with ``--push_to_hub``, upload the
    directory; returns the metrics (``train_*``, ``<evaluator name>_*``). ``--max_steps 0`` trains nothing (the
    untrained encoder, with whatever the run fits after training: the zero-shot baseline). ``card_kwargs`` go to
    ``XMCTrainer.create_model_card`` (``dataset``, ``finetuned_from``, ``model_name``, ``license``, ``tags``).
    ``tune_settings``: which of the model's ``tunable_ranking_settings`` to tune on the validation split after training,
    before the lexical channel is fitted on top (None: all of them; ``()``: none, the values given are kept)."""
    validation = validation_evaluator(data, evaluator)
    check_validation(training_args, validation)
    if getattr(training_args, "static_query_encoder", False) and model.takes_images:  # before training, not after
        raise ValueError(f"--static_query_encoder: {type(model).__name__} ranks texts with images; a static query encoder is for the text models")
    model.config.validation = data.validation_record or NO_VALIDATION_SPLIT  # checkpoints record it: resume compares
    set_seed(training_args.seed)
    trainer = XMCTrainer(
        model=model,
        args=training_args,
        train_dataset=data.train,
        label_texts=data.label_texts,
        label_uids=data.label_uids,
        label_images=data.label_images,
        evaluator=validation,
        eval_dataset=data.validation,  # transformers asks for one with --eval_strategy; the evaluator is what runs
        **trainer_kwargs,
    )
    if training_args.max_steps == 0:
        logger.info("--max_steps 0: no training step; the model is its starting point")
        metrics = {"train_runtime": 0.0, "train_steps": 0}
    else:
        resume = resume_argument(training_args)
        if resume is True:
            resume = trainer.last_complete_checkpoint()
            if resume is None:  # killed before its first checkpoint (or, in a multi-stage recipe, in an earlier stage)
                logger.warning("%s: no complete checkpoint to resume from: training from the start", training_args.output_dir)
        if resume:
            logger.info("resuming from %s", resume)
            check_resumed_split(resume if isinstance(resume, str) else None, data.validation_record)
        with disk_full_named(training_args.output_dir, model, "a checkpoint (weights and optimizer state)", factor=3):
            train_result = trainer.train(resume_from_checkpoint=resume)
        metrics = dict(train_result.metrics)
    trainer.release_training_state()  # the optimizer's moments and the batches' data: not needed from here on
    try:  # never lose a finished training to a fit that fails after it: save what trained, then report the error
        method, calibrations = tune_after_training(model, trainer, data, validation, evaluator, training_args, tune_settings, metrics)
    except Exception:
        logger.error("tuning after training failed: saving the trained model to %s first (without what failed to fit)", training_args.output_dir)
        trainer.save_model(training_args.output_dir)
        raise
    trainer.evaluator = evaluator  # the test file, read for this final evaluation only (and the model card)
    try:
        metrics.update(trainer.evaluate(metric_key_prefix=evaluator.name))
    except Exception:  # never lose a finished training to an evaluation error: save what trained, then report the error
        logger.error("the final evaluation failed: saving the trained model to %s first", training_args.output_dir)
        trainer.save_model(training_args.output_dir)
        raise
    metrics.pop("epoch", None)
    if method != "none" and evaluator.last_ranking is not None:
        from .calibration import calibration_metrics

        for name, calibration in calibrations.items():  # the chosen method's ECE is <name>_ECE; each one's under its name
            value = calibration_metrics(model, *evaluator.last_ranking, evaluator.data.targets, calibration=calibration)["ECE"]
            metrics[f"{evaluator.name}_ECE_{name}"] = round(value, 4)
        metrics["calibration_method"] = method
        metrics["calibration_reliability"] = evaluator.last_reliability  # the reliability diagram's rows on the test split
    if training_args.static_query_encoder:  # the static encoder's test metrics: test_static_*, test_static_dense_*
        with model.using_query_encoder("static"):
            metrics.update({k: v for k, v in trainer.evaluate(metric_key_prefix=f"{evaluator.name}_static").items() if k != "epoch"})
    with disk_full_named(training_args.output_dir, model):  # one line naming the directory and the space a save needs
        trainer.save_model(training_args.output_dir)  # after evaluate: the saved index matches the final weights
        if trainer.is_world_process_zero():
            write_json_atomic(os.path.join(training_args.output_dir, EVAL_RESULTS_FILE), metrics)
            logger.info("test metrics: %s", json.dumps({k: round(v, 2) for k, v in metrics.items() if k.startswith("test_")}))
        trainer.create_model_card(**(card_kwargs or {}))  # README.md + plot from this run's results, beside the model
    if training_args.push_to_hub:
        trainer.push_to_hub()  # to --hub_model_id: the model directory with its card, labels and index
    return metrics
