"""The dashboard under Textual's pilot: a scripted event sequence in, what the widgets show out;
keys reach the source; the remote source against a small SSE server on a free port."""

from __future__ import annotations

import contextlib
import io
import functools
import logging
import socket
import sys
import threading
import time

import anyio
import msgspec
import pytest
from rich.console import Console

from ocrl.events import Events
from ocrl.types import (
    Log, Progress, Sample, SampleReady, SessionChanged, TrainStep, TurnServed, Verdict, VerdictReady, Vote,
    WeightsSwapped,
)  # fmt: skip
from tui.app import Dashboard, run_dashboard
from tui.engine_panel import EnginePanel
from tui.help_screen import HelpScreen
from tui.log_panel import LogPanel
from tui.loss_plot import LossPlot
from tui.messages import EventArrived, SnapshotTaken
from tui.plot import Plot
from tui.progress_panel import ProgressPanel, TaskProgress
from tui.requests_panel import RequestsPanel
from tui.reward_plot import RewardPlot
from tui.sample_screen import SampleScreen
from tui.samples_table import MASKED_STYLE, PROMOTED_STYLE, SamplesTable
from tui.sessions_panel import SessionsPanel
from tui.sources import ActionUnavailable, LocalSource, RemoteSource, SampleText, Source, SourceError, sse_data
from tui.status_line import StatusLine

SIZE = (140, 44)


def make_sample(sample_id, session_id, turn, *, score, mask, promoted=False, votes=(), next_state="thanks!", version=0):
    prompt, response = [1, 2, 3, 4, 5, 6, 7], [8, 9, 10]
    return Sample(
        sample_id=sample_id, session_id=session_id, turn_index=turn, tokens=prompt + response,
        response_length=len(response), loss_mask=[mask] * len(response), rollout_logprobs=[-0.5] * len(response),
        reward=float(score or 0) if mask else 0.0, weights_version=version, score=score,
        votes=[Vote(s, t) for s, t in votes], promoted=promoted, next_state=next_state,
        next_state_role="user" if next_state is not None else None,
    )  # fmt: skip


GOOD = make_sample("a:1:0", "a", 0, score=1, mask=1, votes=[(1, "good: the user moved on"), (1, "fine"), (-1, "meh")])
MASKED = make_sample("a:1:1", "a", 1, score=0, mask=0, votes=[(0, "unclear [bold]x[/bold]"), (None, "no box"), (0, "hm")])
PROMOTED = make_sample("b:2:0", "b", 0, score=0, mask=1, promoted=True, votes=[(0, "ambiguous"), (0, "?"), (1, "ok")], version=1)
ENDED = make_sample("b:2:1", "b", 1, score=None, mask=0, next_state=None, version=1)
STEPS = [
    TrainStep(step=1, weights_version=1, metrics={"pg_loss": 0.5, "kl": 0.001, "clip_frac": 0.0, "entropy": 2.1, "grad_norm": 0.8, "reward_mean": 0.5}),
    TrainStep(step=2, weights_version=2, metrics={"pg_loss": -0.2, "kl": 0.004, "clip_frac": 0.1, "entropy": 2.0, "grad_norm": float("inf"), "reward_mean": 0.25}),
]  # fmt: skip
SCRIPT = [
    SessionChanged(session_id="a", state="open", main_turns=0),
    TurnServed(session_id="a", index=0, turn_type="main", prompt_tokens=7, completion_tokens=3, weights_version=0, seconds=0.2),
    VerdictReady(session_id="a", index=0, verdict=Verdict(score=1, votes=GOOD.votes, mode="generate")),
    SampleReady(sample=GOOD),
    SampleReady(sample=MASKED),
    SessionChanged(session_id="b", state="open", main_turns=0),
    SampleReady(sample=PROMOTED),
    STEPS[0],
    WeightsSwapped(weights_version=1, seconds=0.25, verified=True),
    SessionChanged(session_id="b", state="closed", main_turns=2),
    SampleReady(sample=ENDED),
    STEPS[1],
    WeightsSwapped(weights_version=2, seconds=0.5, verified=False),
    Progress(task="checkpoint step 2", done=1, total=3),
    Log(level="warning", message="weights version 2: served log-probs differ by 0.1"),
]
SNAPSHOT = {
    "model": "tiny-test-model",
    "weights_version": 2,
    "uptime_s": 12.0,
    "run_dir": "/tmp/runs/test-run",
    "engine": {"queue_depth": 3, "active": 2, "generated_tokens": 120},
    "sessions": {
        "sessions_open": 1, "sessions_waiting_next_state": 1, "judging": 2, "main_turns": 4, "sessions_closed": 1,
        "samples_mask1": 2, "samples_mask0": 2, "samples_promoted": 1, "votes_truncated": 2, "hint_votes_truncated": 1,
    },  # fmt: skip
    "samples": {"queued": 0, "journal_backlog_at_start": 0},
    "requests": {"total": 20, "by_status": {"200": 14, "400": 4, "401": 2}, "refused": {"invalid_api_key": 2, "context_length_exceeded": 3, "invalid_request_error": 1}, "refused_total": 6},
    "training": {"enabled": True, "method": "combine", "paused": False, "steps": 2, "pending": 1, "batch_size": 2, "consumed_samples": 4, "last": {}},
}


class FakeSource(Source):
    """Scripted events, a fixed snapshot, and a record of what was asked."""

    url = "http://127.0.0.1:30000/v1"

    def __init__(self, events=SCRIPT, snapshot=SNAPSHOT, texts: SampleText | None = None):
        self.script = list(events)
        self.stats = msgspec.json.decode(msgspec.json.encode(snapshot))  # a copy a test may edit
        self.texts = texts
        self.calls: list[str] = []
        self.closed = False

    async def events(self):
        for event in self.script:
            yield event
        await anyio.sleep_forever()

    async def snapshot(self):
        return self.stats

    async def pause(self):
        self.calls.append("pause")

    async def resume(self):
        self.calls.append("resume")

    async def save(self):
        self.calls.append("save")
        return "/tmp/ckpt/step-2"

    async def sample_text(self, sample):
        return self.texts

    async def aclose(self):
        self.closed = True


async def until(pilot, predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the dashboard"
        await pilot.pause(0.02)


def plain(cells) -> list[str]:
    return [cell.plain for cell in cells]


async def test_widgets_show_the_scripted_events():
    source = FakeSource()
    app = Dashboard(source, poll_interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        table = app.query_one(SamplesTable)
        losses = app.query_one(LossPlot)
        await until(pilot, lambda: table.row_count == 4 and len(losses.history["kl"]) == 2)
        await until(pilot, lambda: app.query_one(SessionsPanel).counters.judging == 2)

        # newest first; every column as shown
        assert [plain(table.get_row_at(i))[0:3] for i in range(4)] == [["4", "b", "1"], ["3", "b", "0"], ["2", "a", "1"], ["1", "a", "0"]]
        assert plain(table.get_row("a:1:0")) == ["1", "a", "0", "+1 +1 -1", "+1", "1", "+1.00", "rl", "—", "7+3", "v0"]
        assert plain(table.get_row("a:1:1")) == ["2", "a", "1", "0 ? 0", "0", "0", "+0.00", "none", "—", "7+3", "v0"]
        assert plain(table.get_row("b:2:0")) == ["3", "b", "0", "0 0 +1", "0", "1 promoted", "+0.00", "rl", "—", "7+3", "v1"]
        assert plain(table.get_row("b:2:1")) == ["4", "b", "1", "—", "none", "0", "+0.00", "none", "—", "7+3", "v1"]
        # promoted and masked rows stand out; a plain trained row does not
        assert {str(cell.style) for cell in table.get_row("b:2:0")} == {PROMOTED_STYLE}
        assert {str(cell.style) for cell in table.get_row("a:1:1")} == {MASKED_STYLE}
        assert {str(cell.style) for cell in table.get_row("b:2:1")} == {MASKED_STYLE}
        assert {str(cell.style) for cell in table.get_row("a:1:0")} == {""}

        # reward: one point per sample, the moving mean beside it, one point per step
        rewards = app.query_one(RewardPlot)
        chart = rewards.query_one(Plot)
        assert chart.points("reward") == 4 and chart.points("mean") == 4
        assert rewards.means == [1.0, 0.5, 1 / 3, 0.25]
        assert rewards.step_rewards == [0.5, 0.25]
        # losses: one point per step per metric; the infinite grad norm is shown, not plotted
        assert {key: len(values) for key, values in losses.history.items()} == {
            "pg_loss": 2, "kl": 2, "clip_frac": 2, "entropy": 2, "grad_norm": 1, "teacher_advantage": 0,
        }  # fmt: skip
        assert str(losses.query_one("#value-teacher_advantage").render()) == "—"  # rl steps carry none
        assert losses.history["pg_loss"] == [0.5, -0.2]
        assert str(losses.query_one("#value-grad_norm").render()) == "inf"
        assert losses.border_subtitle == "step 2 · v2"

        engine = app.query_one(EnginePanel)
        assert (engine.state.model, engine.state.weights_version, engine.state.queue_depth, engine.state.active) == ("tiny-test-model", 2, 3, 2)
        assert engine.state.turns == 1 and engine.state.method == "combine"
        assert engine.last_swap.weights_version == 2 and not engine.last_swap.verified

        requests = app.query_one(RequestsPanel)
        assert requests.counts.refused == (("context_length_exceeded", 3), ("invalid_api_key", 2), ("invalid_request_error", 1))
        console = Console(width=40, record=True, file=io.StringIO())
        console.print(requests.render())
        shown = [line.split() for line in console.export_text().splitlines()]
        assert shown == [["answered", "·", "refused", "14", "·", "6"], ["context_length_exceeded", "3"], ["invalid_api_key", "2"], ["invalid_request_error", "1"]]

        sessions = app.query_one(SessionsPanel)
        c = sessions.counters
        assert (c.open, c.main_turns, c.waiting, c.judging, c.closed) == (1, 4, 1, 2, 1)
        assert (c.mask1, c.mask0, c.promoted) == (2, 2, 1)
        assert c.truncated == 3  # PRM and hint votes cut at their token budget
        console = Console(width=40, record=True, file=io.StringIO())
        console.print(sessions.render())
        assert ["votes", "truncated", "3"] in [line.split() for line in console.export_text().splitlines()]
        assert {sid: (a.state, a.main_turns) for sid, a in sessions.recent.items()} == {"a": ("open", 2), "b": ("closed", 2)}

        panel = app.query_one(ProgressPanel)
        await until(pilot, lambda: [bar.task_name for bar in panel.query(TaskProgress)] == ["checkpoint step 2"])
        bar = panel.query_one(TaskProgress).query_one("ProgressBar")
        await until(pilot, lambda: bar.percentage == pytest.approx(1 / 3))
        assert app.query_one(LogPanel).lines_written == 1

        status = app.query_one(StatusLine)
        assert (status.url, status.run_dir, status.training) == ("http://127.0.0.1:30000/v1", "/tmp/runs/test-run", "running")
        rendered = str(status.render())
        assert "http://127.0.0.1:30000/v1" in rendered and "/tmp/runs/test-run" in rendered
    assert source.closed


async def test_keys_pause_resume_save_and_help():
    source = FakeSource(events=[])
    app = Dashboard(source, poll_interval=60)  # one snapshot: the optimistic state stays put
    async with app.run_test(size=SIZE) as pilot:
        status = app.query_one(StatusLine)
        await until(pilot, lambda: status.training == "running")
        await pilot.press("p")
        await until(pilot, lambda: source.calls == ["pause"])
        assert status.training == "paused"
        await pilot.press("p")
        await until(pilot, lambda: source.calls == ["pause", "resume"])
        assert status.training == "running"
        await pilot.press("s")
        await until(pilot, lambda: source.calls == ["pause", "resume", "save"])
        await until(pilot, lambda: any("step-2" in n.message for n in app._notifications))

        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen))
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, HelpScreen))
        await pilot.press("q")
        await until(pilot, lambda: not app.is_running)
    assert app.return_code == 0


async def test_pause_when_training_is_off_or_refused():
    class Refusing(FakeSource):
        async def pause(self):
            raise ActionUnavailable("no trainer here")

    off = FakeSource(events=[])
    off.stats["training"] = {"enabled": False}
    off.event_error = "event stream: HTTP 404: no route /v1/ocrl/events"  # an older daemon
    app = Dashboard(off, poll_interval=60)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.query_one(StatusLine).training == "off")
        assert app.query_one(StatusLine).error == off.event_error
        await pilot.press("p")
        await pilot.pause(0.05)
        assert off.calls == []

    refusing = Refusing(events=[])
    app = Dashboard(refusing, poll_interval=60)
    async with app.run_test(size=SIZE) as pilot:
        status = app.query_one(StatusLine)
        await until(pilot, lambda: status.training == "running")
        await pilot.press("p")
        await until(pilot, lambda: any("no trainer here" in n.message for n in app._notifications))
        assert status.training == "running"  # the optimistic "paused" was taken back
        await pilot.press("ctrl+c")  # raw mode: ctrl+c is a key, and it quits too
        await until(pilot, lambda: not app.is_running)


async def test_selecting_a_row_shows_next_state_and_votes():
    source = FakeSource(texts=SampleText(prompt_tail="<|im_start|>user\nhi [red]", response="hello!"))
    app = Dashboard(source, poll_interval=60)
    async with app.run_test(size=SIZE) as pilot:
        table = app.query_one(SamplesTable)
        await until(pilot, lambda: table.row_count == 4)
        table.move_cursor(row=table.get_row_index("a:1:1"))
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, SampleScreen))
        screen = app.screen
        assert screen.sample is MASKED
        votes = [str(screen.query_one(f"#vote-{i}").render()) for i in range(3)]
        assert votes == ["unclear [bold]x[/bold]", "no box", "hm"]  # model text, never markup
        assert str(screen.query_one("#next-state").render()) == "thanks!"
        await until(pilot, lambda: str(screen.query_one("#response").render()) == "hello!")
        assert str(screen.query_one("#prompt-tail").render()) == "<|im_start|>user\nhi [red]"
        # the panels underneath keep updating while the detail view is open, and the
        # selection stays on the sample it was on
        app.main.post_message(EventArrived(SampleReady(sample=make_sample("c:3:0", "c", 0, score=1, mask=1))))
        await until(pilot, lambda: table.row_count == 5)
        assert table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value == "a:1:1"
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, SampleScreen))

        # a source that cannot decode says so and still shows the rest
        source.texts = None
        table.move_cursor(row=table.get_row_index("b:2:1"))
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, SampleScreen))
        await until(pilot, lambda: "not available" in str(app.screen.query_one("#response").render()))
        assert "session ended" in str(app.screen.query_one("#next-state").render())


async def test_tokens_per_second_from_two_snapshots():
    app = Dashboard(FakeSource(events=[]), poll_interval=60)
    async with app.run_test(size=SIZE) as pilot:
        engine = app.query_one(EnginePanel)
        first = dict(SNAPSHOT, engine={"queue_depth": 0, "active": 0, "generated_tokens": 1000})
        second = dict(SNAPSHOT, engine={"queue_depth": 5, "active": 1, "generated_tokens": 1300})
        app.main.post_message(SnapshotTaken(first, at=100.0))
        await until(pilot, lambda: engine.state.generated_tokens == 1000)
        app.main.post_message(SnapshotTaken(second, at=102.0))
        await until(pilot, lambda: engine.state.generated_tokens == 1300)
        assert engine.state.tokens_per_s == pytest.approx(150.0)
        assert engine.state.queue_depth == 5


async def test_sse_parser():
    async def lines():
        for line in [": keepalive", "", "event: x", "data: {\"a\":", "data:  1}", "", "id: 7", "data: two", ""]:
            yield line

    assert [data async for data in sse_data(lines())] == ['{"a":\n 1}', "two"]


# -- in-process -------------------------------------------------------------------------------


class FakeTrainer:
    def __init__(self, checkpoint: str | None = None):
        self.checkpoint = checkpoint  # None: a daemon that saves nowhere
        self.calls: list[str] = []

    def pause(self):
        self.calls.append("pause")

    def resume(self):
        self.calls.append("resume")

    async def save_checkpoint(self):
        self.calls.append("save")
        return self.checkpoint


class FakeDaemon:
    """The parts of ocrl.daemon.Daemon a LocalSource reads."""

    def __init__(self):
        self.config = msgspec.defstruct("Config", [("host", str, "127.0.0.1"), ("port", int, 30000)])()
        self.events = Events()
        self.trainer = FakeTrainer()
        self.api = object()

    def stats(self):
        return SNAPSHOT

    @property
    def training(self):
        return self.trainer is not None

    def pause_training(self):
        self.trainer.pause()

    def resume_training(self):
        self.trainer.resume()

    async def save_checkpoint(self):
        return await self.trainer.save_checkpoint()


async def test_local_source_replays_history_and_drives_the_trainer():
    daemon = FakeDaemon()
    daemon.events.publish(SampleReady(sample=GOOD))  # before the dashboard subscribed
    app = Dashboard(LocalSource(daemon), poll_interval=0.2)
    async with app.run_test(size=SIZE) as pilot:
        table = app.query_one(SamplesTable)
        await until(pilot, lambda: table.row_count == 1)
        daemon.events.publish(SampleReady(sample=PROMOTED))
        await until(pilot, lambda: table.row_count == 2)
        assert app.query_one(StatusLine).url == "http://127.0.0.1:30000/v1"
        await pilot.press("p", "s")
        await until(pilot, lambda: daemon.trainer.calls == ["pause", "save"])
        await until(pilot, lambda: any("nothing saved" in n.message for n in app._notifications))
    assert not daemon.events._subscribers  # the subscription closed with the app

    class Tokenizer:
        def batch_decode(self, rows, skip_special_tokens):
            return ["".join(chr(ord("a") + i) for i in row) for row in rows]

    daemon.loaded = type("Loaded", (), {"tokenizer": Tokenizer()})()
    assert await LocalSource(daemon).sample_text(GOOD) == SampleText(prompt_tail="bcdefgh", response="ijk")
    daemon.trainer = None
    with pytest.raises(ActionUnavailable):
        await LocalSource(daemon).pause()


async def test_run_dashboard_returns_when_the_daemon_stops():
    daemon = FakeDaemon()
    stop = anyio.Event()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(functools.partial(run_dashboard, daemon, stop=stop, headless=True))
            while not daemon.events._subscribers:  # the dashboard is up and reading
                await anyio.sleep(0.02)
            stop.set()
    assert not daemon.events._subscribers


async def test_log_lines_go_to_the_panel_not_the_terminal():
    root = logging.getLogger()
    terminal = logging.StreamHandler(sys.stderr)
    root.addHandler(terminal)
    try:
        app = Dashboard(FakeSource(events=[]), poll_interval=60, capture_logging=True)
        async with app.run_test(size=SIZE) as pilot:
            assert terminal not in root.handlers
            logging.getLogger("ocrl.test").warning("a warning for the panel")
            panel = app.query_one(LogPanel)
            await until(pilot, lambda: panel.lines_written == 1)
        assert terminal in root.handlers
        assert not any(type(h).__name__ == "_ToDashboard" for h in root.handlers)
    finally:
        root.removeHandler(terminal)


# -- over HTTP --------------------------------------------------------------------------------

API_KEY = "tui-key"
_encoder = msgspec.json.Encoder()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SseDaemon:
    """A stand-in for the /v1/ocrl endpoints that drops its event stream on cue. Each connection to the event
    stream replays the history plus one new event from `live` and closes, until `live` runs
    out: the client has to reconnect and must not see the replayed events twice."""

    def __init__(self, history, live):
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response, StreamingResponse
        from starlette.routing import Route

        self.history = list(history)
        self.live = list(live)
        self.calls: list[str] = []
        self.connections = 0

        def authorised(request: Request) -> bool:
            return request.headers.get("authorization") == f"Bearer {API_KEY}"

        async def events(request: Request):
            if not authorised(request):
                return JSONResponse({"error": {"message": "invalid or missing API key"}}, status_code=401)
            self.connections += 1
            fresh = [self.live.pop(0)] if self.live else []
            self.history += fresh

            async def stream():
                yield b": connected\n\n"
                for event in self.history:
                    yield b"data: " + _encoder.encode(event) + b"\n\n"
                if not self.live:  # nothing left to reveal: stay open, as a daemon does
                    await anyio.sleep_forever()

            return StreamingResponse(stream(), media_type="text/event-stream")

        async def stats(request: Request):
            if not authorised(request):
                return JSONResponse({"error": {"message": "invalid or missing API key"}}, status_code=401)
            return Response(_encoder.encode(SNAPSHOT), media_type="application/json")

        def action(name, body):
            async def endpoint(request: Request):
                if not authorised(request):
                    return JSONResponse({"error": {"message": "invalid or missing API key"}}, status_code=401)
                self.calls.append(name)
                return JSONResponse(body)

            return endpoint

        async def detokenize(request: Request):
            ids = msgspec.json.decode(await request.body())["ids"]
            return JSONResponse({"texts": [" ".join(f"<{i}>" for i in row) for row in ids]})

        self.app = Starlette(
            routes=[
                Route("/v1/ocrl/detokenize", detokenize, methods=["POST"]),
                Route("/v1/ocrl/events", events),
                Route("/v1/ocrl/stats", stats),
                Route("/v1/ocrl/train/pause", action("pause", {"paused": True}), methods=["POST"]),
                Route("/v1/ocrl/train/resume", action("resume", {"paused": False}), methods=["POST"]),
                Route("/v1/ocrl/checkpoint", action("save", {"checkpoint": "/runs/x/checkpoints/step-2"}), methods=["POST"]),
            ]
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "test server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(5)


@pytest.fixture
def sse_daemon():
    live = [SampleReady(sample=PROMOTED), STEPS[0], SessionChanged(session_id="c", state="open", main_turns=0)]
    with SseDaemon(history=[SampleReady(sample=GOOD), SampleReady(sample=MASKED)], live=live) as daemon:
        yield daemon


async def test_remote_source_decodes_events_once_across_reconnects(sse_daemon):
    source = RemoteSource(sse_daemon.url + "/v1/", API_KEY, reconnect_delay=0.01)
    try:
        received = []
        with anyio.fail_after(10):
            async with contextlib.aclosing(source.events()) as events:
                async for event in events:
                    received.append(event)
                    if len(received) == 5:
                        break
        assert [type(e).__name__ for e in received] == ["SampleReady", "SampleReady", "SampleReady", "TrainStep", "SessionChanged"]
        assert received[0].sample == GOOD and received[2].sample == PROMOTED and received[3] == STEPS[0]
        assert sse_daemon.connections >= 3  # three streams, each replaying what came before

        assert (await source.snapshot()) == SNAPSHOT
        await source.pause()
        await source.resume()
        assert await source.save() == "/runs/x/checkpoints/step-2"
        assert sse_daemon.calls == ["pause", "resume", "save"]
        assert await source.sample_text(GOOD) == SampleText(prompt_tail="<1> <2> <3> <4> <5> <6> <7>", response="<8> <9> <10>")
    finally:
        await source.aclose()

    older = RemoteSource(sse_daemon.url + "/elsewhere", API_KEY)  # every /v1/ocrl route answers 404
    try:
        assert await older.sample_text(GOOD) is None
        assert not older._can_detokenize  # asked once, not on every row
    finally:
        await older.aclose()


async def test_remote_source_with_a_wrong_key(sse_daemon):
    source = RemoteSource(sse_daemon.url, "wrong", reconnect_delay=0.01)
    try:
        with pytest.raises(SourceError, match="HTTP 401: invalid or missing API key"):
            await source.snapshot()
        with pytest.raises(ActionUnavailable, match="invalid or missing API key"):
            await source.pause()
        with anyio.move_on_after(0.3):
            async with contextlib.aclosing(source.events()) as events:
                async for _ in events:
                    pass
        assert source.event_error == "event stream: HTTP 401: invalid or missing API key"
    finally:
        await source.aclose()

    app = Dashboard(RemoteSource(sse_daemon.url, "wrong"), poll_interval=60)
    async with app.run_test(size=SIZE) as pilot:
        status = app.query_one(StatusLine)
        await until(pilot, lambda: status.error == "HTTP 401: invalid or missing API key")
        assert "HTTP 401" in str(status.render())


async def test_dashboard_attached_over_http(sse_daemon):
    app = Dashboard(RemoteSource(sse_daemon.url, API_KEY, reconnect_delay=0.01), poll_interval=0.2)
    async with app.run_test(size=SIZE) as pilot:
        table = app.query_one(SamplesTable)
        await until(pilot, lambda: table.row_count == 3 and app.query_one(LossPlot).last is not None)
        assert app.query_one(StatusLine).url == sse_daemon.url + "/v1"
        await until(pilot, lambda: app.query_one(EnginePanel).state.model == "tiny-test-model")
        await pilot.press("p")
        await until(pilot, lambda: sse_daemon.calls == ["pause"])


def test_command_line(monkeypatch):
    import tui.__main__ as cli

    started = []
    monkeypatch.setattr(cli.Dashboard, "run", lambda self: started.append((self.source.url, self.source._client.headers.get("authorization"))))
    monkeypatch.setenv("OCRL_API_KEY", "from-env")
    cli.main(["--url", "http://10.0.0.5:30000/v1/"])
    cli.main(["--url", "http://10.0.0.5:30000", "--api-key", "flag"])
    assert started == [("http://10.0.0.5:30000/v1", "Bearer from-env"), ("http://10.0.0.5:30000/v1", "Bearer flag")]


async def test_dashboard_attached_to_the_daemon_api():
    """The real ocrl Api (stats, SSE events, training controls) served on a free port in this
    event loop, a daemon's parts faked behind it: what the daemon publishes reaches the table,
    and the keys reach the daemon's controls."""
    import uvicorn

    from ocrl.api import Api
    from ocrl.config import Config

    daemon = FakeDaemon()
    daemon.trainer = FakeTrainer(checkpoint="/runs/y/checkpoints/step-1")
    engine = type("Engine", (), {"name": "tiny-test-model", "weights_version": 0})()
    api = Api(Config(api_key=API_KEY), engine, None, None, stats=daemon.stats, events=daemon.events, control=daemon)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(api, host="127.0.0.1", port=port, log_level="error", lifespan="off"))
    daemon.events.publish(SampleReady(sample=GOOD))  # history, replayed on connect
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(server.serve)
        while not server.started:
            await anyio.sleep(0.01)
        app = Dashboard(RemoteSource(f"http://127.0.0.1:{port}/v1", API_KEY), poll_interval=0.2)
        async with app.run_test(size=SIZE) as pilot:
            table = app.query_one(SamplesTable)
            await until(pilot, lambda: table.row_count == 1)
            daemon.events.publish(SampleReady(sample=PROMOTED))
            daemon.events.publish(STEPS[0])
            await until(pilot, lambda: table.row_count == 2 and app.query_one(LossPlot).last == STEPS[0])
            await until(pilot, lambda: app.query_one(StatusLine).run_dir == "/tmp/runs/test-run")
            await pilot.press("p", "s")
            await until(pilot, lambda: daemon.trainer.calls == ["pause", "save"])
            await until(pilot, lambda: any("/runs/y/checkpoints/step-1" in n.message for n in app._notifications))
        server.should_exit = True


async def test_a_distilled_sample_shows_its_signal_hint_and_teacher_advantage():
    source = FakeSource()
    app = Dashboard(source, poll_interval=60)
    distilled = msgspec.structs.replace(
        make_sample("d:4:0", "d", 0, score=-1, mask=1, votes=[(-1, "redo")], next_state="Too long. Answer in one sentence."),
        method="combine", hint="Too long. Answer in one sentence.", experience=["End with a question [bold]."],
        hint_votes=[Vote(1, "[HINT]Too long. Answer in one sentence.[/HINT]")], teacher_prompt_ids=[1, 2, 3, 4, 5, 6, 7, 11, 12],
    )
    async with app.run_test(size=SIZE) as pilot:
        table = app.query_one(SamplesTable)
        await until(pilot, lambda: table.row_count == 4)
        app.main.post_message(EventArrived(SampleReady(sample=distilled)))
        await until(pilot, lambda: table.row_count == 5)
        assert plain(table.get_row("d:4:0"))[7:9] == ["combine", "…"]  # waiting for its step
        app.main.post_message(EventArrived(TrainStep(step=3, weights_version=3, metrics={"pg_loss": 0.1, "teacher_advantage": -0.25}, teacher_advantages={"d:4:0": -0.25, "gone": 1.0})))
        await until(pilot, lambda: plain(table.get_row("d:4:0"))[8] == "-0.25")
        assert str(app.query_one(LossPlot).query_one("#value-teacher_advantage").render()) == "-0.25"
        table.move_cursor(row=table.get_row_index("d:4:0"))
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, SampleScreen))
        screen = app.screen
        summary_text = str(screen.query_one("#summary").render())
        assert "method combine · signal combine" in summary_text and "teacher prompt 9 tokens" in summary_text and "-0.250" in summary_text
        assert str(screen.query_one("#hint").render()) == "Too long. Answer in one sentence."
        assert str(screen.query_one("#experience").render()) == "- End with a question [bold]."  # never markup
        assert str(screen.query_one("#hint-vote-0").render()) == "1. +1: [HINT]Too long. Answer in one sentence.[/HINT]"


def test_a_truncated_vote_shows_as_cut():
    from tui.samples_table import vote_text

    assert [vote_text(v) for v in (Vote(1, "\\boxed{1}"), Vote(None, "no idea"), Vote(None, "<think>...", truncated=True))] == ["+1", "?", "✂"]
