"""The scripts of bench/ as modules, for their tests: bench/ is a package (run its scripts as `python -m bench.NAME`),
so this is a plain import; kept so a test can name a bench script by its file name."""

from __future__ import annotations

import importlib
from types import ModuleType


def load(name: str) -> ModuleType:
    """bench/<name>.py as the module bench.<name>."""
    return importlib.import_module(f"bench.{name}")
