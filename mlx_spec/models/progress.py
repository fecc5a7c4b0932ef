"""Progress display for slow model work (GGUF import, downloads), on stderr so stdout stays
clean for `--json` and pipes."""

from __future__ import annotations

from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)


class _Bar:
    """One task line whose description names the current phase."""

    def __init__(self, progress: Progress | None, title: str):
        self._progress = progress
        self._title = title
        self._task = progress.add_task(title, total=None) if progress else None

    def phase(self, text: str) -> None:
        """An indeterminate step (spinner only)."""
        if self._progress:
            self._progress.update(self._task, description=f"{self._title}: {text}",
                                  total=None, completed=0)

    def start(self, text: str, total: int) -> None:
        """A counted step of `total` units."""
        if self._progress:
            self._progress.update(self._task, description=f"{self._title}: {text}",
                                  total=total, completed=0)

    def advance(self, units: int = 1) -> None:
        if self._progress:
            self._progress.advance(self._task, units)


@contextmanager
def progress_bar(enabled: bool, title: str):
    """Yields a `_Bar`; a no-op one when `enabled` is false."""
    if not enabled:
        yield _Bar(None, title)
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        yield _Bar(progress, title)
