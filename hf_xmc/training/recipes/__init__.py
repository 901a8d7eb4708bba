"""Training recipes, one module per method: the model-argument dataclass, the method's training-argument defaults and
``main(argv=None) -> dict`` (train, evaluate on the test file, save, write ``eval_results.json``).

``training_scripts/train_<method>.py`` and ``hf-xmc train <method>`` both run these ``main`` functions, so the
script and the console command are one code path. A new method adds its module here and one line to
:data:`RECIPES`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

#: Method name -> module that defines the recipe's ``main``. Modules are imported on demand, so listing the
#: methods (``hf-xmc train --help``) does not build every recipe's argument classes.
RECIPES: dict[str, str] = {
    "dexml": "hf_xmc.training.recipes.dexml",
    "prime": "hf_xmc.training.recipes.prime",
    "unidec": "hf_xmc.training.recipes.unidec",
    "mufin": "hf_xmc.training.recipes.mufin",
    "siamesexml": "hf_xmc.training.recipes.siamesexml",
}


def get_recipe(method: str) -> Callable[..., dict]:
    """The ``main(argv=None) -> dict`` of ``method``'s recipe; ``KeyError`` naming the known methods otherwise."""
    if method not in RECIPES:
        raise KeyError(f"unknown method {method!r} (known: {', '.join(sorted(RECIPES))})")
    return importlib.import_module(RECIPES[method]).main


__all__ = ["RECIPES", "get_recipe"]
