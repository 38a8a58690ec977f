"""Requests: how many the daemon answered and, by reason, how many it refused (a wrong key, a
prompt over the context, a full queue, ...), from the polled stats' `requests` block. The
operator sees a client being turned away here without reading the log.
"""

from __future__ import annotations

import msgspec
from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from ocrl.stats import RequestStats


class RequestCounts(msgspec.Struct, frozen=True):
    total: int = 0
    refused_total: int = 0
    refused: tuple[tuple[str, int], ...] = ()  # (reason, count), most frequent first


class RequestsPanel(Widget):
    DEFAULT_CSS = """
    RequestsPanel { border: round $primary; padding: 0 1; height: auto; }
    """

    counts: reactive[RequestCounts] = reactive(RequestCounts)

    def __init__(self, *, shown: int = 3, **kwargs) -> None:
        super().__init__(**kwargs)
        self.shown = shown

    def on_mount(self) -> None:
        self.border_title = "requests"

    def apply_snapshot(self, requests: RequestStats) -> None:
        self.counts = RequestCounts(
            total=requests.total,
            refused_total=requests.refused_total,
            refused=tuple(sorted(requests.refused.items(), key=lambda item: (-item[1], item[0]))),
        )

    def render(self) -> Table:
        c = self.counts
        table = Table.grid(padding=(0, 1), expand=True)
        table.add_column(no_wrap=True, overflow="ellipsis", ratio=1)
        table.add_column(justify="right", no_wrap=True)
        refused = Text(str(c.refused_total), style="bold #e0af68" if c.refused_total else "")
        table.add_row("answered · refused", Text(f"{c.total - c.refused_total} · ") + refused)
        for reason, count in c.refused[: self.shown]:
            table.add_row(Text(f"  {reason}", style="dim"), str(count))
        if len(c.refused) > self.shown:
            rest = sum(count for _, count in c.refused[self.shown :])
            table.add_row(Text("  other", style="dim"), str(rest))
        return table
