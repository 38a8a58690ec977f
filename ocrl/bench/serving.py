"""Every benchmark's one way to run a daemon: serve a built `Daemon` in the background, wait
until its HTTP server answers, and stop it (in-flight requests finish first) when the block
ends. Knows nothing of what a benchmark measures."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio


@asynccontextmanager
async def serving(daemon) -> AsyncIterator[str]:
    """`async with serving(daemon) as url:` -- `url` is the daemon's `/v1` base."""
    async with anyio.create_task_group() as tg:
        url = await tg.start(daemon.serve)
        try:
            yield url
        finally:
            daemon.server.should_exit = True
