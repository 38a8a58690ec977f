"""A small line chart drawn with braille dots (2 x 4 per cell), newest points at the right.

One dot column per point: a chart W cells wide shows the last 2W points of each series. A
series is drawn as dots, or joined into a line. The y axis is fixed or fits the visible points.
This module knows nothing of what the numbers mean.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

from rich.text import Text
from textual.widget import Widget

BRAILLE_BLANK = 0x2800
DOT_BITS = ((0x01, 0x08), (0x02, 0x10), (0x04, 0x20), (0x40, 0x80))  # [row in cell][column in cell]
AXIS_WIDTH = 7  # "+0.50 ┤"


class Series(NamedTuple):
    values: Sequence[float]
    style: str
    joined: bool


def axis_label(value: float) -> str:
    return f"{value:+.2f}" if abs(value) < 100 else f"{value:.3g}"


class Plot(Widget):
    DEFAULT_CSS = """
    Plot { height: 1fr; min-height: 3; }
    """

    def __init__(self, *, y_range: tuple[float, float] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.y_range = y_range
        self.series: dict[str, Series] = {}

    def plot(self, name: str, values: Sequence[float], style: str, *, joined: bool = True) -> None:
        self.series[name] = Series(list(values), style, joined)
        self.refresh()

    def points(self, name: str) -> int:
        """How many points the series holds (what is drawn is the newest that fit)."""
        return len(self.series[name].values) if name in self.series else 0

    def _bounds(self, visible: list[Sequence[float]]) -> tuple[float, float]:
        if self.y_range is not None:
            return self.y_range
        finite = [v for values in visible for v in values if math.isfinite(v)]
        if not finite:
            return -1.0, 1.0
        low, high = min(finite), max(finite)
        if high - low < 1e-9:
            low, high = low - 1.0, high + 1.0
        return low, high

    def render(self) -> Text:
        columns = max(1, self.size.width - AXIS_WIDTH)
        rows = max(1, self.size.height)
        dots_x, dots_y = columns * 2, rows * 4
        visible = {name: s.values[-dots_x:] for name, s in self.series.items()}
        low, high = self._bounds(list(visible.values()))

        def dot_row(value: float) -> int:
            share = (high - value) / (high - low)
            return min(dots_y - 1, max(0, round(share * (dots_y - 1))))

        bits = [[0] * columns for _ in range(rows)]
        styles: list[list[str | None]] = [[None] * columns for _ in range(rows)]
        for name, series in self.series.items():
            values = visible[name]
            offset = dots_x - len(values)  # right-align: the newest point in the last column
            previous: int | None = None
            for i, value in enumerate(values):
                if not math.isfinite(value):
                    previous = None
                    continue
                x, y = offset + i, dot_row(value)
                span = range(min(previous, y), max(previous, y) + 1) if series.joined and previous is not None else (y,)
                for yy in span:
                    bits[yy // 4][x // 2] |= DOT_BITS[yy % 4][x % 2]
                    styles[yy // 4][x // 2] = series.style
                previous = y

        labels = {0: axis_label(high), rows - 1: axis_label(low)}
        if low < 0 < high and rows > 2:
            labels.setdefault(dot_row(0.0) // 4, axis_label(0.0))
        text = Text(no_wrap=True, overflow="crop")
        for row in range(rows):
            text.append(f"{labels.get(row, ''):>{AXIS_WIDTH - 2}} ┤", style="dim")
            for column in range(columns):
                cell = bits[row][column]
                text.append(chr(BRAILLE_BLANK + cell) if cell else " ", style=styles[row][column] or "")
            if row < rows - 1:
                text.append("\n")
        return text
