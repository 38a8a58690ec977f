"""How the trainer's torch work yields to serving.

The trainer shares the cores (or the GPU) with the engine, and a user waiting for tokens matters
more than a step finishing sooner. The torch work stops at yield points: before each
micro-batch, before the probe, and before each decoder layer of the trained and reference models,
forward and backward (`attach` hooks the layers). What a yield point does depends on what the
trainer is doing:
- between steps: nothing;
- in a step (`within`): wait while serving is busy, up to a budget of seconds per step, then
  proceed, so training never starves under constant load;
- in a prefetch (`preemptible`): give up at once (raise `Preempted`); the work is redone later.

Knows a "busy" signal and torch modules, never samples, the loss or the optimizer.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Literal

import torch

YIELD_POLL = 0.005  # seconds between looks at the engine while a step gives way

# What the trainer yields to: the engine's load ("engine"), a callable that says when serving is
# busy, or None (never yield).
YieldTo = Callable[[], bool] | Literal["engine"] | None


class Preempted(Exception):
    """Raised at a yield point to abandon work that can be redone later (a prefetch)."""


def serving(engine) -> Callable[[], bool]:
    """True while `engine` has a request decoding or queued."""
    return lambda: engine.active > 0 or engine.queue_depth > 0


def _never() -> bool:
    return False


def _proceed() -> None:
    pass


class Waited:
    """The seconds a step has waited at its yield points, within its budget."""

    def __init__(self, busy: Callable[[], bool], budget: float):
        self.busy = busy
        self.budget = budget
        self.spent = 0.0

    def __call__(self) -> None:
        if self.spent >= self.budget or not self.busy():
            return
        started = time.perf_counter()
        while self.busy() and self.spent + (time.perf_counter() - started) < self.budget:
            time.sleep(YIELD_POLL)
        self.spent += time.perf_counter() - started


class GiveWay:
    """The trainer's yield points and what they do now (see the module docstring)."""

    def __init__(self, yield_to: YieldTo, engine=None):
        self.busy: Callable[[], bool] = serving(engine) if yield_to == "engine" else (yield_to or _never)
        self._at_point: Callable[[], None] = _proceed

    def attach(self, *models) -> None:
        """A yield point before each decoder layer's forward, and after its backward."""
        for model in models:
            for layer in _decoder_layers(model) if model is not None else []:
                layer.register_forward_pre_hook(self._layer, with_kwargs=True)

    def point(self) -> None:
        """A yield point between pieces of torch work."""
        self._at_point()

    @contextlib.contextmanager
    def within(self, budget: float) -> Iterator[Waited]:
        """A step: yield points wait while serving is busy, `budget` seconds in all."""
        waited = Waited(self.busy, budget)
        self._at_point = waited
        try:
            yield waited
        finally:
            self._at_point = _proceed

    @contextlib.contextmanager
    def preemptible(self) -> Iterator[None]:
        """A prefetch: the first yield point that finds serving busy raises `Preempted`."""
        self._at_point = self._preempt
        try:
            yield
        finally:
            self._at_point = _proceed

    def _preempt(self) -> None:
        if self.busy():
            raise Preempted

    def _layer(self, module, args, kwargs) -> None:
        self.point()
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(lambda grad: self.point())


def _decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks of a transformer: the longest ModuleList in it."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []
