"""Reward over time: each sample's reward as a dot, their moving mean as a line, and the mean
reward of each training step as a sparkline underneath.

Every sample counts, masked or not (a masked sample's reward is its judged score or 0): the
plot shows how conversations are being judged; the per-step line shows what was trained on.
"""

from __future__ import annotations

import math

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.widgets import Label, Sparkline

from ocrl.types import Sample, TrainStep
from tui.plot import Plot

KEEP = 2048  # points kept per series: more than any terminal is wide, bounded over a long run
SAMPLE_STYLE = "#7aa2f7"
MEAN_STYLE = "bold #e0af68"


class RewardPlot(Vertical):
    DEFAULT_CSS = """
    RewardPlot { border: round $primary; padding: 0 1; }
    RewardPlot #step-row { height: 1; }
    RewardPlot #step-label { width: 11; color: $text-muted; }
    RewardPlot #step-rewards { width: 1fr; }
    """

    rewards: reactive[list[float]] = reactive(list, init=False)
    step_rewards: reactive[list[float]] = reactive(list, init=False)

    def __init__(self, *, window: int = 16, **kwargs) -> None:
        super().__init__(**kwargs)
        self.window = window
        self.means: list[float] = []  # the moving mean after each sample
        self.samples_seen = 0

    def compose(self) -> ComposeResult:
        yield Plot(y_range=(-1.0, 1.0), id="reward-chart")
        with Horizontal(id="step-row"):
            yield Label("per step", id="step-label")
            yield Sparkline([], id="step-rewards")

    def on_mount(self) -> None:
        self.border_title = "reward"
        self._legend()

    def add_sample(self, sample: Sample) -> None:
        self.samples_seen += 1
        self.rewards.append(sample.reward)
        recent = self.rewards[-self.window :]
        self.means.append(sum(recent) / len(recent))
        del self.rewards[:-KEEP], self.means[:-KEEP]
        self.mutate_reactive(RewardPlot.rewards)

    def add_step(self, step: TrainStep) -> None:
        reward = step.metrics.get("reward_mean")
        if reward is not None and math.isfinite(reward):
            self.step_rewards.append(reward)
            del self.step_rewards[:-KEEP]
            self.mutate_reactive(RewardPlot.step_rewards)

    def watch_rewards(self, rewards: list[float]) -> None:
        chart = self.query_one(Plot)
        chart.plot("reward", rewards, SAMPLE_STYLE, joined=False)
        chart.plot("mean", self.means, MEAN_STYLE)
        self._legend()

    def watch_step_rewards(self, step_rewards: list[float]) -> None:
        self.query_one("#step-rewards", Sparkline).data = list(step_rewards)
        self._legend()

    def _legend(self) -> None:
        parts = [f"{self.samples_seen} samples"]
        if self.means:
            parts.append(f"[{MEAN_STYLE}]━ mean of {self.window}: {self.means[-1]:+.2f}[/]")
        if self.step_rewards:
            parts.append(f"step: {self.step_rewards[-1]:+.2f}")
        self.border_subtitle = " · ".join(parts)
