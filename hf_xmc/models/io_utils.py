"""Small I/O helpers every module of the model bundle shares: atomic file writes, JSON, sha256, staged directories
(a save written beside its target and moved into place in one step), and the one progress-bar switch.

Remote-code file: imports only the standard library (and transformers' logging, lazily).

Memory: none beyond what is written (``file_sha256`` reads 4 MB at a time).
"""

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional


def file_sha256(path: str, chunk_bytes: int = 1 << 22) -> str:
    """Hex sha256 of a file, read 4 MB at a time (a 2 GB IVF file at 1.3M labels: a few seconds)."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk_bytes), b""):
            digest.update(block)
    return digest.hexdigest()


def write_json(path: str, obj) -> None:
    """Write ``obj`` as indented JSON (UTF-8)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)


def atomic_write(path: str, write_fn) -> None:
    """Write through ``write_fn(tmp_path)`` into a temp file beside ``path`` and rename it into place."""
    tmp = temp_path_for(path)
    try:
        write_fn(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json_atomic(path: str, obj, sort_keys: bool = True) -> None:
    """Write JSON through a temp file in the same directory, then rename it into place (``sort_keys=False``: keys in
    the objects' own order, as a results file that tables read column by column keeps them)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=sort_keys)

    atomic_write(path, write)


def temp_path_for(path: str) -> str:
    """A fresh ``.tmp-*`` file beside ``path`` (same filesystem, so ``os.replace`` moves it into place atomically)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=directory)
    os.close(fd)
    return tmp


def progress_bar_disabled() -> bool:
    """True when the user turned progress bars off: ``TQDM_DISABLE`` set (tqdm's own switch, which a bar given an
    explicit ``disable=`` would ignore) or transformers' ``disable_progress_bar()`` / ``HF_HUB_DISABLE_PROGRESS_BARS``.
    Every bar of the models and the training code asks it."""
    if os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false", "no", "off"):
        return True
    from transformers.utils import logging as hf_logging  # lazily: the index itself needs no transformers

    return not hf_logging.is_progress_bar_enabled()


def write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


STAGING_PREFIX = ".tmp-save-"


def staged_directory_path(directory: str) -> str:
    """A fresh, empty staging directory beside ``directory`` (same filesystem: it can be renamed into place), named
    ``.tmp-save-<pid>-<name>-*`` so that a later save can tell one left by a killed process (and remove it)."""
    parent, name = os.path.split(directory)
    os.makedirs(parent, exist_ok=True)
    for stale in os.listdir(parent):  # left behind by a save that was killed: its process is gone
        match = re.fullmatch(re.escape(STAGING_PREFIX) + r"(\d+)-" + re.escape(name) + r"-\w+", stale)
        if match and not _process_alive(int(match.group(1))):
            shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-{name}-", dir=parent)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process, or a platform without signals: assume it lives
        return True
    return True


def commit_staged_directory(staging: str, directory: str, replaced: Callable[[str], bool]) -> None:
    """Move the complete directory ``staging`` into place at ``directory`` in one step.

    A missing ``directory`` is a plain rename. An existing one first lends ``staging`` what it holds beyond the model
    (``checkpoint-*``, ``runs/``, ``eval_results.json``, a card: every entry that ``staging`` lacks and ``replaced``
    does not claim as a file of the previous model), as hard links, so nothing is copied; then the two directories
    are exchanged atomically (Linux ``renameat2(RENAME_EXCHANGE)``) and the old one, now at ``staging``, is removed.
    A process killed at any point leaves ``directory`` holding either the old model or the new one, never a mix.
    Where the exchange is not available (another OS or filesystem) two renames do it, with a moment in between
    where ``directory`` is absent.

    Disk: the old and the new model side by side until the exchange (twice the model's size for a moment).
    """
    if not os.path.isdir(directory):
        os.rename(staging, directory)
        return
    for name in os.listdir(directory):
        if name.startswith(".tmp-") or replaced(name) or os.path.lexists(os.path.join(staging, name)):
            continue
        source, target = os.path.join(directory, name), os.path.join(staging, name)
        if os.path.isdir(source) and not os.path.islink(source):
            shutil.copytree(source, target, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(source, target)
    _exchange_directories(staging, directory)
    shutil.rmtree(staging, ignore_errors=True)


def _link_or_copy(source: str, target: str) -> None:
    if os.path.islink(source):
        os.symlink(os.readlink(source), target)
        return
    try:
        os.link(source, target)
    except OSError:  # a filesystem without hard links
        shutil.copy2(source, target)


def _exchange_directories(a: str, b: str) -> None:
    """Swap two directories of one filesystem: atomically with ``renameat2(RENAME_EXCHANGE)``, else by renames."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        renameat2 = None
    if renameat2 is not None:
        at_fdcwd, rename_exchange = -100, 2
        if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
            return
    aside = a + ".old"
    os.rename(b, aside)
    os.rename(a, b)
    os.rename(aside, a)


def read_json_file(path: Optional[str]):
    """The JSON value of the file at ``path``, or None when there is no path or no such file (a derived part's meta)."""
    if not path or not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@contextmanager
def new_directory_staged(save_directory: str, prefix: str = ".tmp-") -> Iterator[str]:
    """Write a new directory through a temporary one beside it: yields the temporary path; renamed to
    ``save_directory`` when the block ends, removed when it raises, so nothing half-written is left. A directory
    that exists and is not empty is refused (``ValueError``); an empty one is replaced."""
    save_directory = os.path.abspath(str(save_directory))
    if os.path.exists(save_directory) and os.listdir(save_directory):
        raise ValueError(f"{save_directory}: exists and is not empty; give a new directory")
    parent = os.path.dirname(save_directory)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        yield tmp
        if os.path.exists(save_directory):
            os.rmdir(save_directory)  # empty (checked above)
        os.replace(tmp, save_directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
