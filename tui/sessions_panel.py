"""Sessions: the counters from the polled stats (open, main turns, waiting for their next
state, judging, closed, samples by mask, judge votes cut at their token budget) and, from events, the most recently active sessions
with their main-turn count and state.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import msgspec
from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from ocrl.stats import SessionStats
from ocrl.types import SampleReady, SessionChanged, TurnServed
from tui.engine_panel import ago


class SessionCounters(msgspec.Struct, frozen=True):
    open: int = 0
    main_turns: int = 0
    waiting: int = 0
    judging: int = 0
    closed: int = 0
    mask1: int = 0
    mask0: int = 0
    promoted: int = 0
    truncated: int = 0  # PRM and hint votes that ran out of tokens before a score


class Activity(msgspec.Struct):
    state: str
    main_turns: int
    at: float


class SessionsPanel(Widget):
    DEFAULT_CSS = """
    SessionsPanel { border: round $primary; padding: 0 1; height: 1fr; }
    """

    counters: reactive[SessionCounters] = reactive(SessionCounters, always_update=True)  # repaint the "ago"s
    recent: reactive[OrderedDict[str, Activity]] = reactive(OrderedDict, init=False)

    def __init__(self, *, shown: int = 5, **kwargs) -> None:
        super().__init__(**kwargs)
        self.shown = shown

    def on_mount(self) -> None:
        self.border_title = "sessions"

    def apply_snapshot(self, sessions: SessionStats) -> None:
        self.counters = SessionCounters(
            open=sessions.sessions_open,
            main_turns=sessions.main_turns,
            waiting=sessions.sessions_waiting_next_state,
            judging=sessions.judging,
            closed=sessions.sessions_closed,
            mask1=sessions.samples_mask1,
            mask0=sessions.samples_mask0,
            promoted=sessions.samples_promoted,
            truncated=sessions.votes_truncated + sessions.hint_votes_truncated,
        )

    def observe(self, event: SessionChanged | TurnServed | SampleReady) -> None:
        match event:
            case SessionChanged(session_id=sid, state=state, main_turns=turns, at=at):
                self._touch(sid, at, state=state, main_turns=turns)
            case TurnServed(session_id=sid, turn_type="main", index=index, at=at):
                self._touch(sid, at, main_turns=index + 1)
            case SampleReady(sample=sample, at=at):
                self._touch(sample.session_id, at, main_turns=sample.turn_index + 1)
            case _:
                return
        self.mutate_reactive(SessionsPanel.recent)

    def _touch(self, session_id: str, at: float, *, state: str | None = None, main_turns: int | None = None) -> None:
        activity = self.recent.pop(session_id, None) or Activity(state="open", main_turns=0, at=at)
        activity.at = max(activity.at, at)
        if state is not None:
            activity.state = state
        if main_turns is not None:
            activity.main_turns = max(activity.main_turns, main_turns)
        self.recent[session_id] = activity  # most recent last
        while len(self.recent) > 100:
            self.recent.popitem(last=False)

    def render(self) -> Group:
        c = self.counters
        counters = Table.grid(padding=(0, 1), expand=True)
        counters.add_column(no_wrap=True)
        counters.add_column(justify="right", no_wrap=True, ratio=1)
        counters.add_row("open", Text(str(c.open), style="bold"))
        counters.add_row("main turns", str(c.main_turns))
        counters.add_row("waiting next state", str(c.waiting))
        counters.add_row("judging", Text(str(c.judging), style="bold #e0af68" if c.judging else ""))
        counters.add_row("closed", str(c.closed))
        counters.add_row("mask 1 · 0 · promoted", f"{c.mask1} · {c.mask0} · {c.promoted}")
        # a judge that keeps running out of tokens needs a larger --prm-max-tokens / --hint-max-tokens
        counters.add_row("votes truncated", Text(str(c.truncated), style="bold #f7768e" if c.truncated else ""))
        recent = Table.grid(padding=(0, 1), expand=True)
        recent.add_column(no_wrap=True, overflow="ellipsis", ratio=1)
        recent.add_column(justify="right", no_wrap=True)
        now = time.time()
        for session_id, activity in list(reversed(self.recent.items()))[: self.shown]:
            style = "dim" if activity.state == "closed" else ""
            recent.add_row(
                Text(session_id, style=style),
                Text(f"{activity.main_turns} turns · {activity.state} {ago(now - activity.at)}", style="dim"),
            )
        return Group(counters, Text(""), recent) if self.recent else Group(counters)
