"""The serving engine: model, weights version, throughput, queue depth, the last weight swap.

Throughput is the growth of the engine's generated-token counter between two snapshots; the
version is the newest seen in snapshots, served turns or swaps, whichever came first.
"""

from __future__ import annotations

import time

import msgspec
from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from ocrl.stats import Stats, TrainingStats
from ocrl.types import TurnServed, WeightsSwapped


class EngineState(msgspec.Struct, frozen=True):
    model: str = "—"
    weights_version: int = 0
    tokens_per_s: float | None = None
    queue_depth: int = 0
    active: int = 0
    generated_tokens: int = 0
    turns: int = 0  # turns served since the dashboard started
    method: str = "—"  # the training method (rl | opd | combine), "off" without training


def ago(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f}s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _method(training: TrainingStats | None, known: str) -> str:
    if training is None:
        return known
    return (training.method or known) if training.enabled else "off"


class EnginePanel(Widget):
    DEFAULT_CSS = """
    EnginePanel { border: round $primary; padding: 0 1; height: auto; }
    """

    state: reactive[EngineState] = reactive(EngineState, always_update=True)  # repaint the "ago"
    last_swap: reactive[WeightsSwapped | None] = reactive(None)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._previous: tuple[float, int] | None = None  # (monotonic time, generated tokens)

    def on_mount(self) -> None:
        self.border_title = "engine"

    def apply_snapshot(self, stats: Stats, at: float) -> None:
        state = msgspec.structs.replace(
            self.state,
            model=stats.model or self.state.model,
            weights_version=max(self.state.weights_version, stats.weights_version),
            method=_method(stats.training, self.state.method),
        )
        engine = stats.engine
        if engine is not None:  # None while the daemon loads
            generated = engine.generated_tokens
            rate = state.tokens_per_s
            if self._previous is not None and at > self._previous[0] and generated >= self._previous[1]:
                rate = (generated - self._previous[1]) / (at - self._previous[0])
            self._previous = (at, generated)
            state = msgspec.structs.replace(
                state, tokens_per_s=rate, queue_depth=engine.queue_depth, active=engine.active, generated_tokens=generated
            )
        self.state = state

    def turn_served(self, turn: TurnServed) -> None:
        self.state = msgspec.structs.replace(
            self.state, weights_version=max(self.state.weights_version, turn.weights_version), turns=self.state.turns + 1
        )

    def swapped(self, swap: WeightsSwapped) -> None:
        self.last_swap = swap
        self.state = msgspec.structs.replace(self.state, weights_version=max(self.state.weights_version, swap.weights_version))

    def render(self) -> Table:
        s = self.state
        table = Table.grid(padding=(0, 1), expand=True)
        table.add_column(no_wrap=True, style="dim")
        table.add_column(justify="right", no_wrap=True, overflow="ellipsis", ratio=1)
        table.add_row("model", Text(s.model, style="bold"))
        table.add_row("version", Text(f"v{s.weights_version}", style="bold #9ece6a"))
        table.add_row("method", s.method)
        table.add_row("tokens/s", "—" if s.tokens_per_s is None else f"{s.tokens_per_s:.1f}")
        table.add_row("queue · active", f"{s.queue_depth} · {s.active}")
        table.add_row("turns seen", str(s.turns))
        swap = self.last_swap
        if swap is None:
            table.add_row("last swap", "—")
        else:
            # ✗: the served log-probs of the probe did not match the trainer's
            mark = Text("✓ ", style="#9ece6a") if swap.verified else Text("✗ ", style="bold red")
            table.add_row("last swap", mark + Text(f"v{swap.weights_version} {swap.seconds:.2f}s, {ago(time.time() - swap.at)}"))
        return table
