"""The last few log lines: the daemon's Log events and, in-process, its Python log records."""

from __future__ import annotations

import time

from rich.text import Text
from textual.widgets import RichLog

LEVEL_STYLES = {"debug": "dim", "info": "", "warning": "#e0af68", "error": "bold red", "critical": "bold red"}


class LogPanel(RichLog):
    DEFAULT_CSS = """
    LogPanel { height: 4; border: round $primary-darken-2; padding: 0 1; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(max_lines=500, markup=False, wrap=True, **kwargs)
        self._last: tuple[str, str] | None = None
        self.lines_written = 0

    def on_mount(self) -> None:
        self.border_title = "log"

    def add(self, level: str, message: str, at: float | None = None) -> None:
        level = level.lower()
        if self._last == (level, message):  # the same line from the event and the logger
            return
        self._last = (level, message)
        stamp = time.strftime("%H:%M:%S", time.localtime(at or time.time()))
        self.write(Text.assemble((stamp + " ", "dim"), (message, LEVEL_STYLES.get(level, ""))))
        self.lines_written += 1
