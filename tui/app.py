"""The live dashboard: a passive subscriber of one daemon's events and stats.

Two background workers own the reading: one turns the source's events into messages, one polls
the stats snapshot every `poll_interval` seconds. They reach the widgets only by posting
messages to the main screen (tui/dashboard_screen.py). Keys act through the source (pause,
resume, save), never on the daemon directly. Nothing here can stall the daemon: a local
subscription drops its oldest events when the dashboard falls behind.
"""

from __future__ import annotations

import contextlib
import time

import anyio
from textual.app import App
from textual.binding import Binding
from textual.worker import Worker, WorkerCancelled

from ocrl.types import Progress
from tui.dashboard_screen import DashboardScreen
from tui.help_screen import HelpScreen
from tui.log_capture import LogCapture
from tui.messages import EventArrived, LogLine, ProgressUpdated, SnapshotFailed, SnapshotTaken
from tui.sources import ActionUnavailable, LocalSource, Source, SourceError
from tui.status_line import StatusLine


def describe(error: BaseException) -> str:
    """One line: the status line and notifications have no room for tracebacks."""
    if isinstance(error, SourceError):
        return str(error).splitlines()[0]
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


class Dashboard(App[None]):
    TITLE = "ocrl"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("p", "toggle_training", "Pause/resume training"),
        Binding("s", "save", "Save checkpoint"),
        Binding("question_mark", "help", "Help", key_display="?"),
        # The terminal is in raw mode, so ctrl+c is a key, not SIGINT: make it do what it says.
        Binding("ctrl+c", "quit", show=False, priority=True),
    ]

    def __init__(self, source: Source, *, poll_interval: float = 1.0, capture_logging: bool = False) -> None:
        super().__init__()
        self.source = source
        self.poll_interval = poll_interval
        self.main = DashboardScreen(source)
        self.log_capture = LogCapture(self.main.post_message) if capture_logging else None
        self._readers: list[Worker] = []

    def get_default_screen(self) -> DashboardScreen:
        return self.main

    def on_mount(self) -> None:
        if self.log_capture is not None:
            self.log_capture.adopt()
        self._readers = [
            self.run_worker(self._read_events(), name="events", exit_on_error=False),
            self.run_worker(self._poll_snapshots(), name="snapshots", exit_on_error=False),
        ]

    async def on_unmount(self) -> None:
        for worker in self._readers:  # stop reading before the source closes under them
            worker.cancel()
        for worker in self._readers:
            with contextlib.suppress(WorkerCancelled, Exception):
                await worker.wait()
        if self.log_capture is not None:
            self.log_capture.release()
        await self.source.aclose()

    # -- the two readers ---------------------------------------------------------------------

    async def _read_events(self) -> None:
        try:
            async with contextlib.aclosing(self.source.events()) as events:
                async for event in events:
                    self.main.post_message(ProgressUpdated(event) if isinstance(event, Progress) else EventArrived(event))
        except Exception as e:
            self.main.post_message(LogLine("error", f"event stream failed: {describe(e)}"))

    async def _poll_snapshots(self) -> None:
        while True:
            try:
                taken = SnapshotTaken(await self.source.snapshot(), time.monotonic(), self.source.event_error)
            except Exception as e:  # unreachable, refused, or not a snapshot
                self.main.post_message(SnapshotFailed(describe(e)))
            else:
                self.main.post_message(taken)
            if self.log_capture is not None:
                self.log_capture.adopt()  # loggers configured since (uvicorn's, at server start)
            await anyio.sleep(self.poll_interval)

    # -- keys ----------------------------------------------------------------------------------

    def action_toggle_training(self) -> None:
        status = self.main.query_one(StatusLine)
        if status.training == "off":
            self.notify("training is off in this daemon", severity="warning")
            return
        before = status.training
        # Shown at once; the next snapshot confirms or corrects it.
        status.training = "running" if before == "paused" else "paused"
        work = self._resume() if before == "paused" else self._pause()
        self.run_worker(self._act(work, undo=before), group="actions")

    def action_save(self) -> None:
        self.notify("saving a checkpoint…")
        self.run_worker(self._act(self._save()), group="actions")

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    async def _pause(self) -> str:
        await self.source.pause()
        return "training paused"

    async def _resume(self) -> str:
        await self.source.resume()
        return "training resumed"

    async def _save(self) -> str:
        path = await self.source.save()
        return f"checkpoint saved: {path}" if path else "nothing saved: this daemon has no checkpoint directory"

    async def _act(self, work, undo: str | None = None) -> None:
        """Run one key's work through the source and say how it went."""
        try:
            self.notify(await work)
        except ActionUnavailable as e:
            self._undo(undo)
            self.notify(str(e), severity="warning")
        except Exception as e:
            self._undo(undo)
            self.notify(describe(e), severity="error")

    def _undo(self, training: str | None) -> None:
        if training is not None:
            self.main.query_one(StatusLine).training = training


async def run_dashboard(daemon, *, stop: anyio.Event | None = None, headless: bool = False) -> None:
    """Run the dashboard on `daemon` in the current event loop until the user quits, or until
    `stop` is set (the daemon stopped on a signal); the caller then stops the daemon. This
    process's log lines go to the dashboard meanwhile."""
    app = Dashboard(LocalSource(daemon), capture_logging=True)
    async with anyio.create_task_group() as tasks:

        async def exit_on_stop() -> None:
            await stop.wait()
            app.exit()

        if stop is not None:
            tasks.start_soon(exit_on_stop)
        await app.run_async(headless=headless)
        tasks.cancel_scope.cancel()
