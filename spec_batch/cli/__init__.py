"""Command line: `spec-batch`. Importing the area modules registers their commands on the group."""
from ._group import main
from . import db, drafters, generate, history, jobs, models, queue, report, serve, wait  # noqa: F401,E402  (registration side effects)

__all__ = ["main"]
