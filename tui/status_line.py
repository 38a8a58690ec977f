"""One line at the bottom: where the daemon answers, where it records, whether training runs,
and whether the dashboard can reach it."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from ocrl.stats import Stats

TRAINING_STYLES = {"running": "bold #9ece6a", "paused": "bold #e0af68", "off": "dim", "?": "dim"}


def training_state(stats: Stats) -> str:
    training = stats.training
    if training is None:
        return "?"
    if not training.enabled:
        return "off"
    return "paused" if training.paused else "running"


class StatusLine(Widget):
    DEFAULT_CSS = """
    StatusLine { height: 1; background: $panel; padding: 0 1; }
    """

    url: reactive[str] = reactive("")
    run_dir: reactive[str] = reactive("")
    training: reactive[str] = reactive("?")
    steps: reactive[str] = reactive("")
    error: reactive[str | None] = reactive(None)

    def __init__(self, url: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.url = url

    def apply_snapshot(self, stats: Stats, problem: str | None = None) -> None:
        self.error = problem
        self.run_dir = stats.run_dir or self.run_dir
        self.training = training_state(stats)
        training = stats.training
        self.steps = f"step {training.steps} · pending {training.pending}/{training.batch_size}" if training and training.enabled else ""

    def render(self) -> Text:
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append("● ", style="bold red" if self.error else "bold #9ece6a")
        text.append(self.url or "—", style="bold")
        text.append("   run ", style="dim")
        text.append(self.run_dir or "—")
        text.append("   training ", style="dim")
        text.append(self.training, style=TRAINING_STYLES.get(self.training, ""))
        if self.steps:
            text.append(f" ({self.steps})", style="dim")
        if self.error:
            text.append(f"   {self.error}", style="bold red")
        return text
