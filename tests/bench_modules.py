"""The scripts of bench/ as modules, for their tests (bench/ is not a package)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load(name: str) -> ModuleType:
    """bench/<name>.py, loaded once and registered under `name` (its dataclasses look their module up)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module
