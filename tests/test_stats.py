"""The stats snapshot is one typed tree (ocrl/stats.py): a real daemon's /v1/ocrl/stats decodes
into it with nothing left over, the dashboard shows what it holds, and a renamed counter or a
value of the wrong type fails loudly instead of showing 0."""

from __future__ import annotations

from collections import Counter

import httpx
import msgspec
import pytest

from ocrl.stats import SessionStats, Stats, read, strict


def served(daemon) -> bytes:
    reply = httpx.get(daemon.url + "/v1/ocrl/stats", headers={"Authorization": f"Bearer {daemon.api_key}"}, timeout=30)
    assert reply.status_code == 200
    return reply.content


def test_a_real_daemon_serves_exactly_the_stats_struct(daemon):
    chat = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {daemon.api_key}", "X-Session-Id": "stats-1"}
    assert httpx.post(daemon.url + "/v1/chat/completions", json=chat, headers=headers, timeout=120).status_code == 200
    raw = served(daemon)
    stats = msgspec.json.decode(raw, type=Stats)
    # every key served is a field (nothing decoded away) and every field is served
    assert msgspec.json.decode(msgspec.json.encode(stats)) == msgspec.json.decode(raw)
    assert stats.sessions.main_turns >= 1 and stats.sessions.sessions_opened >= 1
    assert stats.engine.generated_tokens >= 1 and stats.memory.rss_mb > 0
    assert stats.training.enabled is False  # --no-train
    assert stats.requests.by_status.get("200", 0) >= 1


async def test_the_dashboard_shows_a_real_daemons_stats(daemon):
    from test_tui import SIZE, FakeSource, until
    from tui.app import Dashboard
    from tui.engine_panel import EnginePanel
    from tui.requests_panel import RequestsPanel
    from tui.sessions_panel import SessionsPanel
    from tui.status_line import StatusLine

    snapshot = msgspec.json.decode(served(daemon))  # as RemoteSource hands it over
    expected = read(snapshot)
    app = Dashboard(FakeSource(events=[], snapshot=snapshot), poll_interval=60)
    async with app.run_test(size=SIZE) as pilot:
        engine = app.query_one(EnginePanel)
        await until(pilot, lambda: engine.state.model == expected.model)
        assert engine.state.generated_tokens == expected.engine.generated_tokens and engine.state.method == "off"
        counters = app.query_one(SessionsPanel).counters
        assert (counters.open, counters.main_turns, counters.closed) == (
            expected.sessions.sessions_open, expected.sessions.main_turns, expected.sessions.sessions_closed,
        )  # fmt: skip
        assert app.query_one(RequestsPanel).counts.total == expected.requests.total
        status = app.query_one(StatusLine)
        assert (status.run_dir, status.training, status.error) == (expected.run_dir, "off", None)


def test_a_renamed_counter_fails_where_the_stats_are_built():
    counters = Counter(main_turns=3, sessions_opened=1, **{"verdict_+1": 2, "verdict_-1": 1})
    sessions = strict(SessionStats, {"sessions_open": 1, "judging": 0, **counters})
    assert (sessions.main_turns, sessions.verdict_plus, sessions.verdict_minus, sessions.side_turns) == (3, 2, 1, 0)
    counters["main_turn"] = counters.pop("main_turns")  # renamed where it is counted, not in stats.py
    with pytest.raises(ValueError, match=r"SessionStats has no field for \['main_turn'\]"):
        strict(SessionStats, dict(counters))


async def test_a_snapshot_of_the_wrong_shape_is_an_error_not_zeros():
    from test_tui import SIZE, SNAPSHOT, FakeSource, until
    from tui.app import Dashboard
    from tui.sessions_panel import SessionsPanel
    from tui.status_line import StatusLine

    source = FakeSource(events=[])
    source.stats["sessions"]["main_turns"] = "4"  # a string where the Struct says int
    app = Dashboard(source, poll_interval=60)
    async with app.run_test(size=SIZE) as pilot:
        status = app.query_one(StatusLine)
        await until(pilot, lambda: status.error is not None)
        assert "main_turns" in status.error
        assert app.query_one(SessionsPanel).counters.main_turns == 0  # nothing shown from it
    assert read(SNAPSHOT).sessions.main_turns == 4


async def test_a_daemon_is_readable_from_the_moment_its_api_exists(tmp_path):
    """The dashboard (tui/sources.py) takes `daemon.api` as "built" and reads the whole snapshot
    from then on: every field must be set by then (the journal backlog and the restored sessions
    once came after it). And an engine that can mix weight versions has them counted."""
    from ocrl.config import Config
    from ocrl.daemon import Daemon

    seen = []

    class Watched(Daemon):
        def __setattr__(self, name, value):
            super().__setattr__(name, value)
            if name == "api" and value is not None:
                seen.append(self.stats())  # what a dashboard poll at this moment gets

    daemon = Watched(Config(random_init="tiny", no_train=True, record_dir=str(tmp_path / "run"), prm_mode="generate", threads=1))
    await daemon.build()
    [first] = seen
    assert first.samples.journal_backlog_at_start == 0 and first.samples.restored_at_start.sessions == 0
    assert first.engine.mixed_completions is None  # the transformers engine swaps between batches: never mixes
    daemon.engine.mixed_completions = 2  # as the SGLang engine counts them
    assert daemon.stats().engine.mixed_completions == 2
