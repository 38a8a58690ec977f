"""A short loopback soak (the long one is `python -m ocrl bench soak`): 100 concurrent sessions
through the real HTTP server for a while; no request fails, resident memory stays bounded, and
every main turn's sample is journaled exactly once, and the daemon's open file descriptors come
back down once the clients are gone (a leaked socket or file would stay)."""

from __future__ import annotations

import anyio
import pytest

from conftest import API_KEY, Daemon
from ocrl.bench import soak

SESSIONS, SECONDS = 100, 20


@pytest.mark.slow  # ~80 s on two cores; `./run.sh bench soak` is the long form
async def test_soak_fails_nothing_grows_little_and_accounts_for_every_sample(tmp_path):
    # The prefix cache keeps KV on purpose (bounded, tested in test_prefix_cache.py) and its churn
    # leaves freed memory in the allocator: off here, so that growth means a leak.
    daemon = Daemon(tmp_path / "run", "--no-train", "--threads", "1", "--max-batch-size", "16", "--prefix-cache", "off").start()
    try:
        fds_before = daemon.stats()["memory"]["open_fds"]
        report = await soak.soak(daemon.url + "/v1", API_KEY, sessions=SESSIONS, seconds=SECONDS, max_tokens=2)
        with anyio.fail_after(120):  # the last verdicts
            while daemon.stats()["sessions"]["judging"]:
                await anyio.sleep(0.2)
        stats = daemon.stats()
        with anyio.move_on_after(30):  # the server closes the soak's keep-alive connections
            while (fds_after := daemon.stats()["memory"]["open_fds"]) > fds_before + 4:
                await anyio.sleep(0.5)
    finally:
        assert daemon.stop() == 0
    assert report.failures == []
    assert report.sessions >= SESSIONS and report.requests >= SESSIONS * 2
    warm, end = report.rss_growth()
    assert warm > 0 and end <= warm * 1.10 + 64, f"RSS grew from {warm:.0f} MiB to {end:.0f} MiB"
    accounting = soak.account(daemon.record_dir)
    assert accounting["main_turns"] == report.requests  # every request was a main turn
    assert accounting["missing"] == 0 and accounting["journaled_twice"] == 0
    assert accounting["journaled"] == accounting["main_turns"]
    assert stats["sessions"]["sessions_open"] == 0  # every session ended
    assert max(n for _, n in report.fds) >= fds_before + SESSIONS // 2  # the count saw the connections
    assert fds_after <= fds_before + 4


def test_a_benchmark_daemon_takes_a_free_port_unless_one_is_given():
    import socket

    from ocrl.bench.serving import DEFAULT_PORT, on_free_port
    from ocrl.config import Config

    first, second = on_free_port(Config(), no_train=True), on_free_port(Config())
    # not the fixed port two benchmarks at once used to share, and nothing listens on it
    assert DEFAULT_PORT not in (first.port, second.port) and first.no_train
    for config in (first, second):
        with socket.socket() as sock:
            sock.bind((config.host, config.port))
    assert on_free_port(Config(port=31234)).port == 31234  # --port is kept
