"""The dashboard's main screen: the panels' layout, and the handlers that hand each posted
message to the widgets it concerns.

Messages are posted to this screen, not to the app, so they keep arriving while a help or
sample screen sits on top, and stop (unposted) once the screen is gone at shutdown.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer

from ocrl.types import Log, SampleReady, SessionChanged, TrainStep, TurnServed, VerdictReady, WeightsSwapped
from tui.engine_panel import EnginePanel
from tui.log_panel import LogPanel
from tui.loss_plot import LossPlot
from tui.messages import EventArrived, LogLine, ProgressUpdated, SnapshotFailed, SnapshotTaken
from tui.progress_panel import ProgressPanel
from tui.requests_panel import RequestsPanel
from tui.reward_plot import RewardPlot
from tui.sample_screen import SampleScreen
from tui.samples_table import SamplesTable
from tui.sessions_panel import SessionsPanel
from tui.sources import Source
from tui.status_line import StatusLine


class DashboardScreen(Screen):
    DEFAULT_CSS = """
    DashboardScreen #top { height: 1fr; min-height: 10; }
    DashboardScreen #rewards { width: 2fr; }
    DashboardScreen #engine { width: 1fr; }
    DashboardScreen #middle { height: 2fr; }
    DashboardScreen #samples { width: 2fr; }
    DashboardScreen #right { width: 1fr; }
    """

    def __init__(self, source: Source) -> None:
        super().__init__()
        self.source = source

    def compose(self) -> ComposeResult:
        with Horizontal(id="top"):
            yield RewardPlot(id="rewards")
            yield EnginePanel(id="engine")
        with Horizontal(id="middle"):
            yield SamplesTable(id="samples")
            with Vertical(id="right"):
                yield LossPlot(id="losses")
                yield SessionsPanel(id="sessions")
                yield RequestsPanel(id="requests")
        yield ProgressPanel(id="progress")
        yield LogPanel(id="log")
        yield StatusLine(self.source.url, id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(SamplesTable).focus()

    def on_event_arrived(self, message: EventArrived) -> None:
        event = message.event
        match event:
            case SampleReady(sample=sample):
                if not self.query_one(SamplesTable).add_sample(sample):
                    return  # each sample is published once; a second copy is not a second point
                self.query_one(RewardPlot).add_sample(sample)
                self.query_one(SessionsPanel).observe(event)
            case TrainStep():
                if event.teacher_advantages:
                    self.query_one(SamplesTable).set_teacher_advantages(event.teacher_advantages)
                self.query_one(LossPlot).add_step(event)
                self.query_one(RewardPlot).add_step(event)
            case TurnServed():
                self.query_one(EnginePanel).turn_served(event)
                self.query_one(SessionsPanel).observe(event)
            case SessionChanged():
                self.query_one(SessionsPanel).observe(event)
            case WeightsSwapped():
                self.query_one(EnginePanel).swapped(event)
            case VerdictReady():
                pass  # its votes arrive with the sample it produces
            case Log(level=level, message=text, at=at):
                self.query_one(LogPanel).add(level, text, at)

    def on_progress_updated(self, message: ProgressUpdated) -> None:
        self.query_one(ProgressPanel).report(message.progress)

    def on_snapshot_taken(self, message: SnapshotTaken) -> None:
        stats = message.stats
        self.query_one(StatusLine).apply_snapshot(stats, message.problem)
        self.query_one(EnginePanel).apply_snapshot(stats, message.at)
        if stats.sessions is not None:
            self.query_one(SessionsPanel).apply_snapshot(stats.sessions)
        if stats.requests is not None:
            self.query_one(RequestsPanel).apply_snapshot(stats.requests)

    def on_snapshot_failed(self, message: SnapshotFailed) -> None:
        self.query_one(StatusLine).error = message.error

    def on_log_line(self, message: LogLine) -> None:
        self.query_one(LogPanel).add(message.level, message.message)

    def on_data_table_row_selected(self, message: DataTable.RowSelected) -> None:
        table = self.query_one(SamplesTable)
        sample = table.samples.get(message.row_key.value)
        if sample is not None:
            self.app.push_screen(SampleScreen(sample, self.source, teacher_advantage=table.teacher_advantages.get(sample.sample_id)))
