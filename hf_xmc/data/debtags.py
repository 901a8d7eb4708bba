"""The bundled Debtags dataset: Debian package short descriptions -> Debtags tags (597 labels).

The files in ``hf_xmc/data/debtags/`` (``trn.json.gz``, ``tst.json.gz``, ``lbl.json.gz``, XC raw
format) are produced by ``benchmarks/make_debtags.py``; see ``hf_xmc/data/debtags/README.md`` for
provenance, licence and statistics.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from .xc_raw import XCData, load_xc_dataset

__all__ = ["DEBTAGS_DIR", "load_debtags"]

#: Directory holding the bundled Debtags files (inside the installed package).
DEBTAGS_DIR: Path = Path(__file__).resolve().parent / "debtags"


def load_debtags() -> XCData:
    """Load the bundled Debtags dataset (every point has at least one tag)."""
    root = resources.files(__package__) / "debtags"
    with resources.as_file(root / "trn.json.gz") as trn, resources.as_file(root / "tst.json.gz") as tst, \
            resources.as_file(root / "lbl.json.gz") as lbl:
        return load_xc_dataset(trn, tst, lbl)
