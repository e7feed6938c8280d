"""The progress of an in-process run on stderr, and how Ctrl-C and SIGTERM stop it (`spec-batch run` and
`resume`)."""

from __future__ import annotations

import signal
import sys
import time
from contextlib import contextmanager
from typing import Any

from ._common import EXIT_INTERRUPTED
from ._job_display import _console, _fmt


@contextmanager
def _sigterm_as_interrupt():
    """`kill` (SIGTERM) stops a run like Ctrl-C: claimed requests go back to pending at once."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _RunDisplay:
    """The progress of a run on stderr: baseline messages, then a bar (requests done, tokens/s, acceptance)."""

    def __init__(self) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self.console = _console(stderr=True)
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("requests"),
            TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("acceptance {task.fields[acc]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self.task = None
        self.t0 = 0.0

    def on_phase(self, name: str, info: Any) -> None:
        if name == "baseline":
            self.console.print(
                f"measuring the baseline: {info} request(s) decoded with and without speculation "
                f"(--baseline-sample 0 skips it)"
            )
        elif name == "baseline_done" and info is not None:
            from ..jobs.baseline import describe_speedup

            speedup = describe_speedup(info.speedup, info.speedup_low, info.speedup_high, info.reliable)
            self.console.print(
                f"baseline: {_fmt(info.baseline_tokens_per_s, '.1f')} tok/s without speculation, "
                f"{_fmt(info.sample_tokens_per_s, '.1f')} with it: speedup {speedup}"
            )
        elif name == "run":
            self.progress.start()
            self.task = self.progress.add_task("decoding", total=info, tps="—", acc="—")
            self.t0 = time.perf_counter()

    def on_progress(self, report) -> None:
        if self.task is None:
            return
        elapsed = time.perf_counter() - self.t0
        tps = report.output_tokens / elapsed if elapsed > 0 else None
        self.progress.update(
            self.task, completed=report.done, tps=_fmt(tps, ".1f"), acc=_fmt(report.acceptance_rate, ".0%")
        )

    def hooks(self) -> dict[str, Any]:
        return {"on_phase": self.on_phase, "on_progress": self.on_progress}

    def close(self) -> None:
        self.progress.stop()


@contextmanager
def _running(job_id: str):
    """A run's display; Ctrl-C or SIGTERM stop the run (claimed requests go back at once) and exit 130."""
    display = _RunDisplay()
    try:
        with _sigterm_as_interrupt():
            yield display
    except KeyboardInterrupt:
        display.close()
        _interrupted(job_id)
    finally:
        display.close()


def _interrupted(job_id: str) -> None:
    _console(stderr=True).print(
        f"[yellow]interrupted.[/] Finished requests are stored; continue with [bold]spec-batch resume {job_id}[/]"
    )
    sys.exit(EXIT_INTERRUPTED)
