"""A wall-clock budget for a benchmark that runs in sections (`bench gpu --budget-s`).

A section starts only when the seconds left cover its estimate: what the same kind of section
took last time (the previous architecture's, say), or `floor` seconds for a kind not seen yet. It then runs under a cancel scope at what is left, so a wrong
estimate cuts that one section instead of the whole run overrunning (work in a worker thread
finishes its current call first: the bound is the budget plus one such call). A section that
cannot start, or is cut, is recorded with its reason in `skipped` (the report's), and the owner's
`save` runs after every section, so the report on disk always says what was measured and what
was not. Knows seconds and names, never what a section measures.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import anyio


class Budget:
    """`seconds` in all, `spent` of them already gone (the process's start-up, say)."""

    def __init__(
        self, seconds: float, skipped: dict[str, str], *, spent: float = 0.0, save: Callable[[], None] = lambda: None,
        floor: float = 5.0, clock: Callable[[], float] = time.monotonic,
    ):  # fmt: skip
        self.seconds = seconds
        self.skipped = skipped  # section name -> why it was not measured (or not to the end)
        self.save = save
        self.floor = floor  # the least a section of a kind not seen yet needs
        self.clock = clock
        self.started = clock() - spent
        self.took: dict[str, float] = {}  # kind -> seconds its last finished section took

    def left(self) -> float:
        return self.seconds - (self.clock() - self.started)

    def estimate(self, kind: str | None) -> float:
        """Seconds a section of `kind` should take: the last one of that kind's, at least `floor`."""
        return max(self.floor, self.took.get(kind, 0.0)) if kind is not None else self.floor

    def skip(self, name: str, reason: str) -> None:
        self.skipped[name] = reason
        print(f"{name}: skipped ({reason})")
        self.save()

    async def run(self, name: str, work: Callable[[], Awaitable[object]], *, kind: str | None = None) -> bool:
        """`work()` as the section `name`, if the budget allows it; True when it ran to the end."""
        left, needed = self.left(), self.estimate(kind)
        if left < needed:
            self.skip(name, f"budget: {max(left, 0):.0f} s of {self.seconds:.0f} left, ~{needed:.0f} s needed")
            return False
        started = self.clock()
        with anyio.move_on_after(left) as scope:
            await work()
        seconds = self.clock() - started
        if scope.cancelled_caught:
            self.skip(name, f"budget: cut after {seconds:.0f} s, the {self.seconds:.0f} s budget spent")
            return False
        if kind is not None:
            self.took[kind] = seconds
        self.save()
        return True
