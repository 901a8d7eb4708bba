"""What every benchmark script shares: the common flags of its command line, writing its JSON result, rendering its
markdown tables, and writing a table into its block of the README or a docs page.

A benchmark script reads top to bottom as: parse (:func:`bench_parser`), measure, ``write_json(args.out, result)``,
render the table from the result alone, ``publish(table, "name", args.update_docs)``. With ``--table_only`` it
measures nothing and renders the result already at ``--out``: every table in the docs can be re-rendered from the
committed JSON, and none is ever typed by hand.

A docs block is the text between two identical marker lines ``<!-- bench:NAME -->`` in README.md or a docs/*.md
page. :func:`update_docs_block` rewrites every file that holds the block, so the README can show a table of a docs
page (the LoRA table of docs/peft.md) from the same render.

Only the standard library is imported at module level: peers.py's XR-Linear worker parses its command line in an
interpreter without torch or hf_xmc; hf_xmc's file helpers are imported when a file is written.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections.abc import Iterable, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO, "benchmarks", "results")


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``'s ``model name``), for a row: times on another CPU differ."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        name = ""
    return name or platform.processor() or "unknown"


#: what a training script's eval_results say about how it trained: what ``--bf16 auto`` / ``--mining_precision auto``
#: resolved to, and the seconds of the passes that only picked training examples
TRAINING_KEYS = ("train_bf16", "train_mining_bf16", "train_mining_seconds", "train_clustering_seconds")


def tuned_settings(results: dict, prefix: str = "tuned_") -> dict:
    """The model's own ranking settings tuned on the validation split (``tuned_*`` of a script's eval_results, the
    prefix dropped: SiameseXML's classifier share, ...); ``prefix="static_tuned_"``: the static encoder's own values."""
    return {k[len(prefix):]: v for k, v in results.items() if k.startswith(prefix)}


def training_record(results: dict, extra: tuple[str, ...] = ()) -> dict:
    """:data:`TRAINING_KEYS` (and ``extra``) of a script's eval_results, None where the run did not report one."""
    return {k: results.get(k) for k in (*TRAINING_KEYS, *extra)}


def measured_or_read(args: argparse.Namespace, measure) -> dict:
    """The result a benchmark prints: with ``--table_only`` the one at ``--out``, else ``measure()``, written to
    ``--out`` (its key order kept)."""
    if args.table_only:
        return read_json(args.out)
    result = measure()
    write_json(args.out, result, sort_keys=False)
    return result


def git_commit() -> str | None:
    """The short commit of the checkout the benchmark runs from (None outside a git checkout), for each row."""
    import subprocess

    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return proc.stdout.strip() or None


def result_path(name: str) -> str:
    """``benchmarks/results/<name>``: the default ``--out`` of a benchmark."""
    return os.path.join(RESULTS_DIR, name)


#: the data directories whose builder writes a ``version`` into ``stats.json`` (WordNet-XMC: v1 kept reciprocal test
#: pairs, v2 removes them); a result row records the version it ran on (``data_version``)
VERSIONED_DATA = {"wordnet": os.path.join(REPO, "outputs", "wordnet-xmc")}


def data_version(dataset: str, data_dir: str | None = None) -> str | None:
    """The version in ``stats.json`` of a versioned dataset's directory (``"v1"`` when it predates the field), None for
    a dataset without versions or not built."""
    path = os.path.join(data_dir or VERSIONED_DATA.get(dataset, ""), "stats.json")
    if dataset not in VERSIONED_DATA or not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f).get("version", "v1")


def dataset_cell(dataset: str, version: str | None) -> str:
    """A table's dataset cell: a versioned dataset names its version (a row that predates ``data_version`` ran v1)."""
    return f"{dataset} {version or 'v1'}" if dataset in VERSIONED_DATA else dataset


def row_dataset_cell(row: dict) -> str:
    """:func:`dataset_cell` of a result row (its ``dataset`` and ``data_version``)."""
    return dataset_cell(row["dataset"], row.get("data_version"))


def docs_marker(name: str) -> str:
    """The marker line of docs block ``name``: ``<!-- bench:NAME -->``."""
    return f"<!-- bench:{name} -->"


# ------------------------------------------------------------------------------------------------ command line
def bench_parser(doc: str, out: str | None, *, docs_block: str | None = None, marker: bool = False,
                 table_only: bool = False) -> argparse.ArgumentParser:
    """The parser of a benchmark script: its module docstring as description, and the common flags.

    * ``--out``: the JSON result (default ``out``; ``None``: written only when given);
    * with ``docs_block`` (the block's name, as the help shows it): ``--update_docs``, write the table into that
      block of README.md / docs/*.md; with ``marker`` also ``--marker NAME``, another block (default ``docs_block``);
    * with ``table_only``: ``--table_only``, render the result at ``--out`` and run nothing.
    """
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = f"default {os.path.relpath(out, REPO)}" if out else "default: not written"
    parser.add_argument("--out", default=out, help=f"JSON file of the results ({default})")
    if docs_block:
        parser.add_argument("--update_docs", action="store_true",
                            help=f"write the table between the {docs_marker(docs_block)} lines of README.md / docs/*.md")
        if marker:
            parser.add_argument("--marker", default=docs_block, help="the docs block to write instead: <!-- bench:MARKER -->")
    if table_only:
        parser.add_argument("--table_only", action="store_true",
                            help="print (and with --update_docs write) the table of the results at --out; run nothing")
    return parser


# ------------------------------------------------------------------------------------------------ results
def write_json(path: str, obj, *, sort_keys: bool = True, default=None) -> None:
    """Write ``obj`` as indented JSON (UTF-8) through a temp file renamed into place, creating the directory: a run
    stopped midway leaves the previous file whole. ``sort_keys=False`` keeps the objects' own key order (results whose
    tables read them column by column); ``default`` as in :func:`json.dump`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=sort_keys, default=default)

    _write_atomically(path, write)


def write_text(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) through a temp file renamed into place, creating the directory."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    _write_atomically(path, write)


def read_json(path: str):
    """The JSON at ``path`` (UTF-8)."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_atomically(path: str, write_fn) -> None:
    """hf_xmc's atomic write (temp file beside ``path``, then rename) with ``path``'s permissions kept (a new file
    gets ``rw-r--r--``): the temp file is created private, and a docs page or a result must stay readable."""
    from hf_xmc.models.io_utils import atomic_write

    mode = os.stat(path).st_mode & 0o777 if os.path.exists(path) else 0o644

    def write(tmp: str) -> None:
        write_fn(tmp)
        os.chmod(tmp, mode)

    atomic_write(path, write)


# ------------------------------------------------------------------------------------------------ tables
def markdown_table(header: Sequence[str], rows: Iterable[Sequence], align: str | None = None) -> str:
    """A markdown table, lines joined by newlines (no newline after the last one). ``rows`` hold the cells already
    formatted: each is written `` {cell} `` (``str()`` applied; ``""`` gives ``|  |``), but ``None`` is a blank cell,
    written ``| |``. ``align`` has one letter per column: ``l`` (``---``, markdown's default) or ``r`` (``---:``,
    numbers); default all ``l``."""
    align = align or "l" * len(header)
    if len(align) != len(header) or set(align) - {"l", "r"}:
        raise ValueError(f"align {align!r}: one of 'l' / 'r' per column of {len(header)}")
    lines = [_row(header), "|" + "".join("---:|" if a == "r" else "---|" for a in align)]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a row of {len(row)} cells under {len(header)} columns: {row}")
        lines.append(_row(row))
    return "\n".join(lines)


def _row(cells: Sequence) -> str:
    return "|" + "|".join(" " if cell is None else f" {cell} " for cell in cells) + "|"


# ------------------------------------------------------------------------------------------------ docs blocks
def replace_block(path: str, marker: str, body: str) -> None:
    """Replace the lines between the two lines ``marker`` of ``path`` by ``body`` (ending in one newline), atomically;
    the rest of the file is left byte for byte (a mention of the marker inside a line is text, not a marker).
    ValueError unless the file has exactly two marker lines."""
    with open(path, encoding="utf-8", newline="") as f:
        lines = f.read().splitlines(keepends=True)
    at = _marker_lines(lines, marker)
    if len(at) != 2:
        found = "no" if not at else f"{len(at)} (not 2)"
        raise ValueError(f"{path} holds {found} {marker} lines: a block is the text between exactly two")
    write_text(path, "".join(lines[: at[0] + 1]) + body.rstrip("\n") + "\n" + "".join(lines[at[1] :]))


def _marker_lines(lines: Sequence[str], marker: str) -> list[int]:
    """Indices of the lines that are ``marker`` alone."""
    return [i for i, line in enumerate(lines) if line.rstrip("\r\n") == marker]


def doc_files() -> list[str]:
    """README.md and docs/*.md: the files benchmark tables are written into."""
    return [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]


def update_docs_block(name: str, body: str, files: Sequence[str] | None = None) -> list[str]:
    """Write ``body`` into block ``name`` of every file of ``files`` (default :func:`doc_files`) that has a marker line
    of it; returns the paths written. ValueError when no file has one (or a file has one or three)."""
    marker = docs_marker(name)
    candidates = list(files) if files is not None else doc_files()
    holders = {}
    for path in candidates:
        with open(path, encoding="utf-8", newline="") as f:
            count = len(_marker_lines(f.read().splitlines(keepends=True), marker))
        if count:
            holders[path] = count
    if not holders:
        raise ValueError(f"no block {marker} in {', '.join(os.path.relpath(p, REPO) for p in candidates)}")
    broken = [f"{path} ({count})" for path, count in holders.items() if count != 2]
    if broken:  # checked before any file is written: all holders are updated or none
        raise ValueError(f"{marker} lines, not 2, in {', '.join(broken)}")
    for path in holders:
        replace_block(path, marker, body)
    return list(holders)


def publish(table: str, name: str, update_docs: bool) -> None:
    """Print a benchmark's table and, with ``update_docs``, write it into docs block ``name``."""
    print(table)
    if update_docs:
        for path in update_docs_block(name, table):
            print(f"{os.path.relpath(path, REPO)} updated")


# ------------------------------------------------------------------------------------------------ choosing
#: what every sweep and every "which default" decision is scored by: P@1 + PSP@5 on the run's validation split (the
#: final model, fused where the run has a lexical channel; the objective the channel's weights are tuned by). The test
#: split is read once per reported row and never to choose.
SELECTION_KEYS = ("eval_P@1", "eval_PSP@5")
#: the prefix of every key a choice may read: the training scripts' final validation metrics
SELECTION_PREFIX = "eval_"


def selection_score(row: dict, keys: Sequence[str] = SELECTION_KEYS) -> float:
    """The sum of ``keys`` of a result row (a training script's ``eval_results.json`` merged into it). ValueError for
    a key that is not a validation key (``eval_*``), and for a row that lacks one (a run without a validation split:
    give it ``--validation_size``)."""
    bad = [k for k in keys if not k.startswith(SELECTION_PREFIX)]
    if bad:
        raise ValueError(f"{', '.join(bad)}: a choice reads validation metrics ({SELECTION_PREFIX}*) only, never the test split")
    missing = [k for k in keys if row.get(k) is None]
    if missing:
        raise ValueError(f"a row without {', '.join(missing)} (its run held out no validation split): cannot be chosen by them")
    return float(sum(row[k] for k in keys))


def choose(rows: Sequence[dict], keys: Sequence[str] = SELECTION_KEYS) -> dict:
    """The row of ``rows`` with the best :func:`selection_score` (ties: the first). ValueError for no rows."""
    if not rows:
        raise ValueError("no rows to choose from")
    return max(rows, key=lambda r: selection_score(r, keys))


def chosen_by_group(rows: Sequence[dict], group, keys: Sequence[str] = SELECTION_KEYS, metrics=None) -> set[int]:
    """The ``id()`` of the row :func:`choose` picks within each group of ``rows`` (``group``: a key, e.g.
    ``"dataset"``, or a function of a row), skipping groups where a row has no validation metrics (rows measured
    before the scripts reported them). ``metrics`` (default: the row itself) gives the dict of a row the ``keys``
    are read from, for rows that keep their validation metrics under a key of their own."""
    key = group if callable(group) else (lambda r: r[group])
    of = metrics or (lambda r: r)
    picked = set()
    for value in dict.fromkeys(key(r) for r in rows):
        members = [r for r in rows if key(r) == value]
        if all(all(of(r).get(k) is not None for k in keys) for r in members):
            picked.add(id(max(members, key=lambda r: selection_score(of(r), keys))))
    return picked
