"""What `cuvil build` shows while it works: a live display in a terminal, plain lines elsewhere.

In a terminal (stdout is a TTY, `CI` is not set, TERM is not "dumb") a rich
progress bar shows the steps done, the step that finished last and the time
spent, with the other messages ("[model/target] built: ...") printed above
it. Anywhere else (a pipe, a file, a CI log) every step that ran is one plain
line, as it has always been, so logs stay greppable and free of escape codes.
`--json` sends these lines to stderr and keeps stdout for the report.
"""
from __future__ import annotations

import os
import sys

from .dag import StepRecord, step_line


def live_terminal(stream) -> bool:
    """Whether a live display suits `stream`: a TTY, not under CI, not a dumb terminal."""
    if os.environ.get("CI") or os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class BuildDisplay:
    """Context manager: `say(message)` for messages, `step(record, ran, done, total)` as the StepGraph listener."""

    def __init__(self, stream=None, live: bool | None = None):
        self.stream = stream if stream is not None else sys.stdout
        self.live = live_terminal(self.stream) if live is None else live
        self._progress = None
        self._task = None

    def __enter__(self):
        if self.live:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                                       TimeElapsedColumn)
            console = Console(file=self.stream, force_terminal=True)
            self._progress = Progress(SpinnerColumn(), TextColumn("[bold]building[/bold]"), BarColumn(bar_width=24),
                                      MofNCompleteColumn(), TextColumn("steps"), TimeElapsedColumn(),
                                      TextColumn("{task.description}"), console=console, transient=True)
            self._progress.start()
            self._task = self._progress.add_task("", total=None)
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        return False

    def say(self, message: str) -> None:
        if self._progress is not None:
            self._progress.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=self.stream, flush=True)

    def step(self, record: StepRecord, ran: int, done: int, total: int) -> None:
        if self._progress is not None:
            name = record.name if len(record.name) <= 48 else "..." + record.name[-45:]   # one line on 80 columns
            self._progress.update(self._task, completed=done, total=total,
                                  description=f"{name} ({record.seconds:.2f} s)")
        else:
            self.say(step_line(record, ran, done, total))
