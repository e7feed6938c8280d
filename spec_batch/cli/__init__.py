"""Command line: `spec-batch`. Importing the area modules registers their commands on the group."""

from . import db, drafters, generate, history, jobs, models, queue, report, serve, wait
from ._group import main

__all__ = ["main"]
