"""Signals the job layer understands from the code that drives it."""

from __future__ import annotations


class RunStopped(Exception):
    """A run stopped on purpose by the code driving it (the server's batch runner stopping, a batch being
    cancelled), raised through the job service: claims treat it as a clean interruption, as they treat Ctrl-C
    (given back without counting an attempt, jobs/claims.py). An Exception, not a KeyboardInterrupt, so nothing
    mistakes it for the user's Ctrl-C."""


__all__ = ["RunStopped"]
