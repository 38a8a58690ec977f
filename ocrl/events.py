"""In-process pub/sub of Events: the dashboard and /v1/ocrl/events subscribe; publishers never wait.

A slow subscriber loses its oldest events rather than stalling the daemon. This module knows
nothing of what the events mean.
"""

from __future__ import annotations

import logging
from collections import deque

import anyio

from ocrl.types import Event, Log

log = logging.getLogger("ocrl.events")


class Subscription:
    def __init__(self, hub: "Events", limit: int):
        self._hub = hub
        self._buffer: deque[Event] = deque(maxlen=limit)
        self._ready = anyio.Event()
        self.dropped = 0

    def _put(self, event: Event) -> None:
        if len(self._buffer) == self._buffer.maxlen:
            self.dropped += 1
        self._buffer.append(event)
        self._ready.set()

    async def get(self) -> Event:
        while not self._buffer:
            await self._ready.wait()
            self._ready = anyio.Event()
        return self._buffer.popleft()

    def __aiter__(self):
        return self

    async def __anext__(self) -> Event:
        return await self.get()

    def close(self) -> None:
        self._hub._subscribers.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NoEvents:
    """Events for a run nobody watches: the real signatures, nothing published."""

    def publish(self, event: Event) -> None:
        pass

    def log(self, level: str, message: str) -> None:
        pass


class Events:
    def __init__(self, history: int = 500):
        self._subscribers: set[Subscription] = set()
        self.history: deque[Event] = deque(maxlen=history)  # replayed to late subscribers

    def publish(self, event: Event) -> None:
        self.history.append(event)
        for subscriber in list(self._subscribers):
            subscriber._put(event)

    def subscribe(self, limit: int = 10_000, replay: bool = False) -> Subscription:
        subscription = Subscription(self, limit)
        if replay:
            for event in self.history:
                subscription._put(event)
        self._subscribers.add(subscription)
        return subscription

    def log(self, level: str, message: str) -> None:
        self.publish(Log(level=level, message=message))
