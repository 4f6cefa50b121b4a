"""Progress bars with counts and ETA (rich), silent when not on a terminal unless asked."""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator


class _Null:
    def advance(self, n: int = 1) -> None: ...
    def update(self, **kw) -> None: ...


class _Bar:
    def __init__(self, progress, task):
        self.progress, self.task = progress, task

    def advance(self, n: int = 1) -> None:
        self.progress.advance(self.task, n)

    def update(self, **kw) -> None:
        self.progress.update(self.task, **kw)


ENABLED = sys.stderr.isatty()


@contextlib.contextmanager
def bar(description: str, total: int) -> Iterator[_Bar | _Null]:
    """A progress bar on stderr: description, done/total, elapsed and remaining time."""
    if not ENABLED or total <= 0:
        yield _Null()
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("eta"), TimeRemainingColumn(), console=Console(stderr=True), transient=False) as p:
        yield _Bar(p, p.add_task(description, total=total))
