"""Package attributes imported on first use (PEP 562): a package's public names can point at modules that
import torch and transformers without every `import spec_batch...` paying for them."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, modules: dict[str, str]) -> Callable[[str], Any]:
    """A module-level __getattr__ for `package`: name -> the relative module it is imported from; the value is
    then stored on the package, so each name is looked up once."""

    def __getattr__(name: str) -> Any:
        if name not in modules:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(modules[name], package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
