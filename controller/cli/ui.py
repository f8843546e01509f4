"""The terminal view of a run: a rich progress bar (step, loss, tokens/s, attempt) on stderr and a
summary table at the end. Quiet under --json so stdout stays one JSON document."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from controller.progress import RunProgress


class ProgressView:
    def __init__(self, name: str, total_steps: int, *, quiet: bool) -> None:
        self.console = Console(stderr=True)
        self.quiet = quiet
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=self.console,
            disable=quiet,
        )
        self.task = self.progress.add_task(name, total=total_steps, info="starting")
        self._last_logged_step = -1

    def __enter__(self) -> "ProgressView":
        # The bar starts with the first step, so errors before it are the only output.
        self._started = False
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._started:
            self.progress.stop()

    def update(self, p: RunProgress, attempt: int = 0, note: str = "") -> None:
        tps = p.tokens_per_s[-1] if p.tokens_per_s else 0.0
        info = f"loss {p.loss:.4f}  {tps:,.0f} tok/s  attempt {attempt}" + (f"  {note}" if note else "")
        if not self._started:
            self.progress.start()
            self._started = True
        self.progress.update(self.task, completed=p.step, info=info)
        # Without a terminal (CI, pipes) the bar does not redraw: log a line instead, for the first step
        # seen and then once per ten steps. The view samples the run, so it may never see step 1 or
        # step 10 exactly (a loaded machine runs two steps between two looks): a line is due when the
        # step enters another ten, backwards too (a restart from a checkpoint).
        if not self.console.is_terminal and not self.quiet and self._due(p.step):
            self.console.print(f"step {p.step}: {info}")

    def show(self, step: int, total: int, loss: float | None, attempt: int) -> None:
        """The bar from a Run object's numbers (goodput status --watch)."""
        if not self._started:
            self.progress.start()
            self._started = True
        info = f"loss {loss:.4f}  attempt {attempt}" if loss is not None else f"attempt {attempt}"
        self.progress.update(self.task, completed=step, total=total, info=info)
        if not self.console.is_terminal and not self.quiet and self._due(step):
            self.console.print(f"step {step}: {info}")

    def _due(self, step: int) -> bool:
        """Whether a step is worth a line of its own: the first one seen, then one per ten steps."""
        if self._last_logged_step >= 0 and step // 10 == self._last_logged_step // 10:
            return False
        self._last_logged_step = step
        return True

    def note(self, text: str) -> None:
        if not self.quiet:  # plain text: an error message's "[/path/file.cc:537]" is no markup tag
            self.console.print(text, markup=False, highlight=False)

    @staticmethod
    def print_summary(summary: dict[str, Any]) -> None:
        table = Table(title=f"run {summary.get('name')}: {summary.get('state')}", show_header=False)
        for key, value in summary.items():
            if key in ("history", "events", "placement", "name"):
                continue
            if isinstance(value, float):
                value = f"{value:.4g}"
            table.add_row(key, Text(str(value)))
        Console().print(table)
