"""The messages background work posts to the dashboard: the only way data reaches the widgets.

Events that are data points (a sample, a training step, a swap) are never dropped. Ticks that
only carry the latest state (a stats snapshot, a progress update) coalesce: when a newer one
is already queued, the older one is skipped (`can_replace`).
"""

from __future__ import annotations

from typing import Any

from textual.message import Message

from ocrl.stats import Stats, read
from ocrl.types import Event, Progress


class EventArrived(Message):
    """One ocrl event from the source (anything but Progress)."""

    def __init__(self, event: Event) -> None:
        super().__init__()
        self.event = event


class ProgressUpdated(Message):
    """Long work moved on (model loading, checkpoint saving)."""

    def __init__(self, progress: Progress) -> None:
        super().__init__()
        self.progress = progress

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, ProgressUpdated) and message.progress.task == self.progress.task


class SnapshotTaken(Message):
    """The daemon's stats, polled, as the one `Stats` type (ocrl/stats.py: a snapshot given as
    decoded JSON is converted here, and a value of the wrong type raises); `at` is
    time.monotonic() when it was read; `problem` says why events are not arriving (a daemon
    without the event stream, a dropped connection)."""

    def __init__(self, snapshot: Stats | dict[str, Any], at: float, problem: str | None = None) -> None:
        super().__init__()
        self.stats = read(snapshot)
        self.at = at
        self.problem = problem

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, (SnapshotTaken, SnapshotFailed))


class SnapshotFailed(Message):
    """The stats could not be read (a remote daemon down, a wrong key)."""

    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, (SnapshotTaken, SnapshotFailed))


class LogLine(Message):
    """A log record of this process (local mode), shown beside the daemon's Log events."""

    def __init__(self, level: str, message: str) -> None:
        super().__init__()
        self.level = level
        self.message = message
