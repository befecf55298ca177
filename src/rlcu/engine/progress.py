"""The progress bar of generate and run_episodes: requests (or episodes) done and the output
tokens/s so far, drawn by rich on stderr."""

from __future__ import annotations

import time


class Progress:
    """A rich progress bar over requests (or episodes: `what`), with the output tokens/s so far
    (on stderr)."""

    def __init__(self, total: int, enabled: bool, what: str = "requests", label: str = "generate"):
        self.bar = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        self.bar = RichProgress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn(what),
                            TextColumn("{task.fields[tps]:>10,.0f} tok/s"), TimeElapsedColumn(),
                            console=Console(stderr=True))
        self.task = self.bar.add_task(label, total=total, tps=0.0)
        self.t0 = time.perf_counter()

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()

    def update(self, done: int, tokens: int) -> None:
        if self.bar is not None:
            tps = tokens / max(time.perf_counter() - self.t0, 1e-9)
            self.bar.update(self.task, completed=done, tps=tps)
