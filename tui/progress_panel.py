"""Long work in progress (model loading, checkpoint saving): one progress bar per task, shown
while it runs and for a moment after it completes."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, ProgressBar

from ocrl.types import Progress


class TaskProgress(Horizontal):
    DEFAULT_CSS = """
    TaskProgress { height: 1; }
    TaskProgress Label { width: 32; color: $text-muted; }
    """

    def __init__(self, progress: Progress, **kwargs) -> None:
        super().__init__(**kwargs)
        self.task_name = progress.task
        self._first = progress

    def compose(self) -> ComposeResult:
        yield Label(self.task_name)
        yield ProgressBar(total=self._first.total or None, show_eta=False)

    def on_mount(self) -> None:
        self.set_progress(self._first)

    def set_progress(self, progress: Progress) -> None:
        self.query_one(ProgressBar).update(total=progress.total or None, progress=progress.done)


class ProgressPanel(Vertical):
    DEFAULT_CSS = """
    ProgressPanel { height: auto; max-height: 4; }
    """

    def __init__(self, *, linger: float = 3.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.linger = linger  # seconds a finished bar stays up
        self.tasks: dict[str, TaskProgress] = {}

    def report(self, progress: Progress) -> None:
        bar = self.tasks.get(progress.task)
        if bar is None:
            bar = self.tasks[progress.task] = TaskProgress(progress)
            self.mount(bar)
        else:
            bar.set_progress(progress)
        if progress.total and progress.done >= progress.total:
            self.set_timer(self.linger, lambda: self._finish(progress.task, bar))

    def _finish(self, task: str, bar: TaskProgress) -> None:
        # a task that started over under the same name keeps its bar
        if self.tasks.get(task) is bar and bar.query_one(ProgressBar).percentage == 1:
            del self.tasks[task]
            bar.remove()
