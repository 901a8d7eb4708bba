"""The package's layers, checked from the source: no import cycle, and no layer importing one above it.

data (the lowest: files, datasets, synthetic tasks) and metrics import neither models nor training; models (the flat
remote-code folder) imports only its siblings; training imports data, metrics and models; the top level (CLI, Hub,
quickstart) any of them. Every import counts, a lazy one inside a function too (``if TYPE_CHECKING`` blocks excepted).
docs/architecture.md draws the same picture.
"""

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hf_xmc")
LAYER_MAY_IMPORT = {
    "data": {"data"},
    "metrics": {"metrics"},
    "models": {"models"},
    "training": {"training", "models", "data", "metrics"},
}
MAX_MODULE_LINES = 900


def module_name(path: str) -> str:
    relative = os.path.relpath(path, os.path.dirname(PACKAGE))[: -len(".py")].replace(os.sep, ".")
    return relative[: -len(".__init__")] if relative.endswith(".__init__") else relative


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported_modules(path: str, name: str, known: set[str]) -> set[str]:
    """The hf_xmc modules ``path`` imports (a ``from pkg import module`` names the module itself)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    skipped = {id(n) for block in ast.walk(tree) if _type_checking_only(block) for n in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "hf_xmc")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "hf_xmc":
                continue
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known)
    return {m for m in found if m in known and m != name}


@pytest.fixture(scope="module")
def import_graph() -> dict[str, set[str]]:
    paths = {}
    for directory, _, files in os.walk(PACKAGE):
        if "__pycache__" not in directory:
            paths.update({module_name(os.path.join(directory, f)): os.path.join(directory, f) for f in files if f.endswith(".py")})
    known = set(paths) | {m.rsplit(".", 1)[0] for m in paths if "." in m}
    # a package's __init__ re-exports its modules: importing the package is not importing each of them
    return {m: {d for d in imported_modules(p, m, known) if not m.startswith(d + ".")} for m, p in paths.items()}


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYER_MAY_IMPORT) else "top"


def test_no_import_cycle(import_graph):
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(import_graph.get(module, ())):
            if state.get(dep) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state and dep in import_graph:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(import_graph):
        if module not in state:
            visit(module, [module])


def test_no_layer_imports_one_above_it(import_graph):
    upward = [
        f"{module} imports {dep}" for module, deps in sorted(import_graph.items()) for dep in sorted(deps)
        if layer(module) in LAYER_MAY_IMPORT and layer(dep) not in LAYER_MAY_IMPORT[layer(module)]
    ]
    assert not upward, upward


def test_no_module_over_the_line_budget():
    long = []
    for directory, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py") and "__pycache__" not in directory:
                with open(os.path.join(directory, f), encoding="utf-8") as handle:
                    lines = sum(1 for _ in handle)
                if lines >= MAX_MODULE_LINES:
                    long.append(f"{os.path.relpath(os.path.join(directory, f), PACKAGE)}: {lines} lines")
    assert not long, long


def test_the_data_layer_reads_the_progress_bar_switch_as_the_models_do(monkeypatch):
    """The data layer keeps its own reading of the switch (it may not import models): the two must agree."""
    from hf_xmc.data.xc_raw import progress_bar_disabled as data_switch
    from hf_xmc.models.io_utils import progress_bar_disabled as models_switch

    for value in ("1", "0", "", "off", "yes"):
        monkeypatch.setenv("TQDM_DISABLE", value)
        assert data_switch() == models_switch(), value
