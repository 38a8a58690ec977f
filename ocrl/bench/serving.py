"""Every benchmark's one way to run a daemon: on a port free when it starts (unless --port named
one, so two benchmarks at once never collide), served in the background, waited for until its
HTTP server answers, and stopped (in-flight requests finish first) when the block ends. Knows
nothing of what a benchmark measures."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import msgspec

from ocrl.config import Config

DEFAULT_PORT = Config().port  # the daemon's own default: a benchmark given it picks a free port


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks it; another process could take it before the
    daemon binds, but never a fixed one two benchmarks share)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def on_free_port(config, **changes):
    """`config` with `changes`, on a free port unless --port gave one other than the default."""
    port = config.port if config.port != DEFAULT_PORT else free_port(config.host)
    return msgspec.structs.replace(config, port=port, **changes)


@asynccontextmanager
async def serving(daemon) -> AsyncIterator[str]:
    """`async with serving(daemon) as url:` -- `url` is the daemon's `/v1` base."""
    async with anyio.create_task_group() as tg:
        url = await tg.start(daemon.serve)
        try:
            yield url
        finally:
            daemon.server.should_exit = True
