"""Progress on stderr for slow work (first-run import, download, calibration, prefill,
benchmark runs), so stdout stays clean for `--json` and pipes.

On a terminal each task is a transient bar, shown from its first update (cached work shows
nothing). Otherwise each phase is one plain line, so a log says what the seconds went to.
One display holds every task: Rich allows one live display at a time.
"""

from __future__ import annotations

import sys
from typing import Optional


class Task:
    """One task line: `phase(text, total)` starts a step, `update`/`advance` count it.
    Callable as a (done, total) progress callback."""

    def __init__(self, owner: "StderrProgress", title: str, each: bool):
        self.owner, self.title, self.each = owner, title, each
        self.id = None  # the Rich task, created on first use
        self.logged = False

    def phase(self, text: Optional[str] = None, total: Optional[int] = None) -> None:
        """A new step of this task: `total` units, or an indeterminate one (a spinner)."""
        description = f"{self.title}: {text}" if text else self.title
        if self.owner.lines:
            self.owner.line(description)
            self.logged = True
        if self.id is not None:  # Rich keeps an old total when given None: start a fresh line
            self.owner.bars.remove_task(self.id)
            self.id = None
        self._bar(description=description, total=total, completed=0)

    def update(self, done: int, total: Optional[int] = None, text: Optional[str] = None) -> None:
        description = self.title if not text else f"{self.title} {text}" if self.each else f"{self.title}: {text}"
        if self.owner.lines:
            if self.each and (total is None or done < total):
                self.owner.line(f"[{done + 1}/{total}] {description}")
            elif not self.logged:  # one line per task when steps are not logged
                self.owner.line(self.title)
            self.logged = True
        self._bar(description=description, total=total, completed=done)

    __call__ = update

    def advance(self, units: int = 1) -> None:
        if self.id is not None:
            self.owner.bars.advance(self.id, units)

    def _bar(self, **fields) -> None:
        bars = self.owner.start_bars()
        if bars is None:
            return
        if self.id is None:
            self.id = bars.add_task(fields.pop("description", self.title), total=fields.pop("total", None))
        bars.update(self.id, **fields)


class StderrProgress:
    """Context manager holding the tasks of one command.

    Args:
        mode: "bars" (a terminal), "lines" (plain lines) or "off"; None picks bars when
            stderr is a terminal, else lines.
    """

    def __init__(self, mode: Optional[str] = None):
        self.mode = mode or ("bars" if sys.stderr.isatty() else "lines")
        self.lines = self.mode == "lines"
        self.bars = None

    def task(self, title: str, *, each: bool = False) -> Task:
        """A task; `each`: in lines mode, log every step ("[3/12] ...") rather than once."""
        return Task(self, title, each)

    def line(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def start_bars(self):
        if self.mode != "bars":
            return None
        if self.bars is None:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self.bars = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                 _when_counted(BarColumn()), _when_counted(MofNCompleteColumn()), TimeElapsedColumn(),
                                 console=Console(stderr=True), transient=True)
            self.bars.start()
        return self.bars

    def __enter__(self) -> "StderrProgress":
        return self

    def __exit__(self, *exc) -> bool:
        if self.bars is not None:
            self.bars.stop()
            self.bars = None
        return False


def _when_counted(column):
    """`column` for a step with a known total; nothing for an open-ended one, which shows its
    spinner and elapsed time instead of a bar that looks stuck at 0/?."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class Counted(ProgressColumn):
        def render(self, task):
            return column.render(task) if task.total is not None else Text("")

    return Counted()


def progress_mode(enabled: bool) -> str:
    """The mode for a library call's `progress=` flag: off, or whatever suits stderr."""
    return StderrProgress().mode if enabled else "off"
