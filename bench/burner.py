"""CPU burners: processes that keep cores busy beside a timed run, as another CPU-heavy process on a user's machine
would (issue 37: a forward's slowdown under load, quiet vs busy)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

# A pure-Python loop: one core each, no threads of its own, nothing to install. It also ends when the bench that
# started it is gone (its parent changes), so a killed bench leaves no burner behind.
_LOOP = (
    "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    for _ in range(1_000_000):\n        pass\n"
)


@contextmanager
def burners(n: int) -> Iterator[None]:
    """n busy processes for the duration of the block (none when n is 0), killed by their own handles after it."""
    procs = [subprocess.Popen([sys.executable, "-c", _LOOP]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
