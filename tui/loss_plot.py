"""Losses per training step: one sparkline per diagnostic (each on its own scale) and its last
value. Non-finite values (a skipped update's grad norm) are shown as text, not plotted.
"""

from __future__ import annotations

import math
from statistics import fmean

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.widgets import Label, Sparkline

from ocrl.types import TrainStep

LOSS_KEYS = ("pg_loss", "kl", "clip_frac", "entropy", "grad_norm", "teacher_advantage")
LABELS = {"teacher_advantage": "teacher"}  # opd/combine: token mean of teacher - old; "—" under rl
KEEP = 2048  # steps kept per diagnostic


def metric_value(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    return f"{value:.3g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"


class LossPlot(Vertical):
    DEFAULT_CSS = """
    LossPlot { border: round $primary; padding: 0 1; height: auto; }
    LossPlot Horizontal { height: 1; }
    LossPlot .name { width: 10; color: $text-muted; }
    LossPlot Sparkline { width: 1fr; }
    LossPlot .value { width: 10; text-align: right; }
    """

    history: reactive[dict[str, list[float]]] = reactive(lambda: {key: [] for key in LOSS_KEYS}, init=False)
    last: reactive[TrainStep | None] = reactive(None)

    def compose(self) -> ComposeResult:
        for key in LOSS_KEYS:
            with Horizontal(id=f"row-{key}"):
                yield Label(LABELS.get(key, key), classes="name")
                yield Sparkline([], summary_function=fmean, id=f"spark-{key}")
                yield Label("—", classes="value", id=f"value-{key}")

    def on_mount(self) -> None:
        self.border_title = "losses per step"

    def add_step(self, step: TrainStep) -> None:
        for key in LOSS_KEYS:
            value = step.metrics.get(key)
            if value is not None and math.isfinite(value):
                self.history[key].append(value)
                del self.history[key][:-KEEP]
        self.mutate_reactive(LossPlot.history)
        self.last = step

    def watch_history(self, history: dict[str, list[float]]) -> None:
        for key in LOSS_KEYS:
            self.query_one(f"#spark-{key}", Sparkline).data = list(history[key])

    def watch_last(self, step: TrainStep | None) -> None:
        if step is None:
            return
        for key in LOSS_KEYS:
            value = step.metrics.get(key)
            self.query_one(f"#value-{key}", Label).update("—" if value is None else metric_value(value))
        self.border_subtitle = f"step {step.step} · v{step.weights_version}"
