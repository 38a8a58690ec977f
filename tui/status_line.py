"""One line at the bottom: where the daemon answers, where it records, whether training runs,
and whether the dashboard can reach it."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

TRAINING_STYLES = {"running": "bold #9ece6a", "paused": "bold #e0af68", "off": "dim", "?": "dim"}


def training_state(snapshot: dict[str, Any]) -> str:
    training = snapshot.get("training")
    if not training:
        return "?"
    if not training.get("enabled"):
        return "off"
    return "paused" if training.get("paused") else "running"


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

    def apply_snapshot(self, snapshot: dict[str, Any], problem: str | None = None) -> None:
        self.error = problem
        self.run_dir = snapshot.get("run_dir", self.run_dir)
        self.training = training_state(snapshot)
        training = snapshot.get("training") or {}
        self.steps = (
            f"step {training.get('steps', 0)} · pending {training.get('pending', 0)}/{training.get('batch_size', '?')}"
            if training.get("enabled")
            else ""
        )

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
