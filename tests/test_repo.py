"""Repository contract: the README starts with the two commands, CI runs the test one verbatim, the package's
Python floor and the Space's requirements agree with the dependencies, and importing the package is quiet."""

import os
import re

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands() -> list[str]:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_starts_with_two_commands_and_ci_runs_the_test_one():
    commands = readme_commands()
    assert len(commands) == 2, commands
    assert "hf_xmc.quickstart" in commands[0] and "pytest" in commands[1]
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    assert commands[1] in ci.splitlines()



def package_requirements() -> tuple[str, dict[str, Requirement]]:
    """``python_requires`` and every requirement of setup.cfg (install_requires and all extras), by canonical name."""
    import configparser

    from packaging.utils import canonicalize_name

    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"), encoding="utf-8")
    lines = [line for line in cfg["options"]["install_requires"].splitlines() if line.strip()]
    for extra in cfg["options.extras_require"].values():
        # setuptools' rule: a value over several lines is one requirement a line (a marker's ";" kept), else ";"-separated
        lines += [part for part in (extra.splitlines() if "\n" in extra.strip() else extra.split(";")) if part.strip()]
    requirements = {}
    for line in lines:
        req = Requirement(line.strip())
        requirements.setdefault(canonicalize_name(req.name), req)  # install_requires first, then the extras
    return cfg["options"]["python_requires"], requirements


def lower_bound(specifier) -> Version:
    floors = [Version(s.version) for s in specifier if s.operator in (">=", "==", "~=")]
    return max(floors) if floors else Version("0")


def test_python_requires_covers_what_the_dependencies_need():
    """python_requires is no lower than the Requires-Python of any installed hard dependency (transformers 5.23+
    needs 3.11)."""
    import importlib.metadata

    from packaging.specifiers import SpecifierSet

    python_requires, _ = package_requirements()
    ours = lower_bound(SpecifierSet(python_requires))
    for name in ("transformers", "torch", "accelerate", "datasets", "huggingface-hub", "safetensors", "numpy", "scipy"):
        needed = importlib.metadata.metadata(name).get("Requires-Python")
        if needed:
            assert ours >= lower_bound(SpecifierSet(needed)), f"python_requires {python_requires} but {name} needs {needed}"


def test_space_requirements_agree_with_the_package():
    """Every pin of spaces/requirements.txt lies inside setup.cfg's range for the same package: its floor is admitted
    by the package's specifier (so not below the package's floor) and it keeps the package's upper bounds."""
    from packaging.utils import canonicalize_name

    _, package = package_requirements()
    lines = open(os.path.join(ROOT, "spaces", "requirements.txt"), encoding="utf-8").read().splitlines()
    space = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    shared = [req for req in space if canonicalize_name(req.name) in package]
    assert {canonicalize_name(r.name) for r in shared} >= {"torch", "transformers", "huggingface-hub", "safetensors"}
    for req in shared:
        ours = package[canonicalize_name(req.name)].specifier
        floor = lower_bound(req.specifier)
        assert floor in ours, f"spaces/requirements.txt: {req} admits {floor}, outside setup.cfg's {req.name}{ours}"
        pinned = any(s.operator == "==" for s in req.specifier)
        for bound in (Version(s.version) for s in ours if s.operator == "<"):
            space_bounds = [Version(s.version) for s in req.specifier if s.operator == "<"]
            assert pinned or (space_bounds and min(space_bounds) <= bound), f"spaces/requirements.txt: {req} lacks setup.cfg's <{bound}"


QUIET_IMPORT = """
import sys
sys.modules["torchvision"] = None  # an install without the vision extra (and without torchvision)
import hf_xmc, hf_xmc.hub, hf_xmc.training  # noqa: E401
from hf_xmc.cli import main
try:
    main(["--help"])
except SystemExit as stop:
    assert stop.code == 0, stop.code
"""


def test_import_and_cli_help_print_nothing_to_stderr():
    """No image-processor warnings (nor anything else) on import or ``hf-xmc --help`` without torchvision."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", QUIET_IMPORT], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr == "", proc.stderr[-2000:]
    assert "usage: hf-xmc" in proc.stdout


def test_readme_and_reliability_docs_quote_the_bad_input_corpus_size():
    """The "N kinds of bad input" of the README and docs/reliability.md is the corpus the tests hold."""
    from tests.test_bad_data import BAD_DATA_KINDS
    from tests.test_bad_inputs import BAD_INPUT_KINDS
    from tests.test_bad_model_dirs import MODEL_DIR_KINDS

    total = BAD_INPUT_KINDS + BAD_DATA_KINDS + MODEL_DIR_KINDS
    assert f"{total} kinds of bad input" in open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    reliability = open(os.path.join(ROOT, "docs", "reliability.md"), encoding="utf-8").read()
    assert f"**{total} kinds**" in reliability
    table = re.findall(r"^\| [^|]+ \| (\d+) \|", reliability.split("## Nothing unsafe")[0], flags=re.M)
    assert sum(map(int, table)) == total, table


def docs_pages() -> list[str]:
    """Every page of docs/ (``docs/*.md``), sorted."""
    import glob

    return sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def test_every_docs_page_has_sections():
    """Every docs page is cut into ``## `` sections (a reader finds a topic in the outline, and links reach it)."""
    pages = docs_pages()
    assert len(pages) > 1 and any(p.endswith("architecture.md") for p in pages), pages
    flat = [os.path.relpath(p, ROOT) for p in pages if not re.search(r"^## \S", open(p, encoding="utf-8").read(), flags=re.M)]
    assert not flat, f"docs pages without a '## ' heading: {flat}"


def test_architecture_page_names_every_model_module():
    """docs/architecture.md names every file of hf_xmc/models (as `file.py`), so a module added or renamed there
    cannot leave the page silently stale."""
    text = open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8").read()
    modules = sorted(f for f in os.listdir(os.path.join(ROOT, "hf_xmc", "models")) if f.endswith(".py"))
    assert "modeling_xmc.py" in modules and len(modules) > 10, modules
    missing = [f for f in modules if f"`{f}`" not in text]
    assert not missing, f"docs/architecture.md does not name {missing}"
