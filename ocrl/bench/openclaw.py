"""`python -m ocrl bench openclaw`: the real OpenClaw CLI talks to this daemon for 5+ turns, one of
them a tool use and at least one compaction, then the run is checked: one session for the
conversation, OpenClaw's housekeeping served as side turns, the turn after the compaction threaded
to the one before it, envelope-free next states, samples written, no 5xx.

It needs node >= 24.16 and the openclaw package (INSTALL below, in a folder, then
`--openclaw FOLDER`, or `openclaw` and a recent node on PATH); without them it says so and stops.
It is never part of the test suite: it needs npm and takes minutes.

How the run is shaped (each a real OpenClaw setting, in a throwaway HOME):
- the lean agent from `openclaw-config --lean`, told the window is 4,096 tokens (the daemon's is
  larger) and replies of 64 tokens, so that OpenClaw compacts (memory flush, summary, rewritten
  history) within a few turns;
- the tool turn runs with `--model` naming a second model entry whose `params.extra_body` forces
  `tool_choice` to OpenClaw's `ls` tool (the 135M model does not call tools unforced). OpenClaw
  forces every request of that run, so the model keeps calling the tool; the run is cut by
  `--timeout` (TOOL_TURN_SECONDS), which is OpenClaw's, not ocrl's, doing.
Every request body the daemon receives is written to <run dir>/openclaw-requests.jsonl (the
source of tests/data/openclaw/).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import anyio

from ocrl import chat, openclaw
from ocrl.bench.serving import on_free_port, serving

MIN_NODE = (24, 16)
# Two steps: openclaw's own install script refuses an older system node, so node 24 comes first and
# goes first on PATH; pinned, since a resolver that skips the engine check may pick an empty 0.0.1.
INSTALL = "npm install node@24 && PATH=$PWD/node_modules/.bin:$PATH npm install openclaw@2026.9.6"
TOOL_TURN_SECONDS = 240
OPENCLAW_WINDOW = 4096
# Long-ish messages fill OpenClaw's window sooner (prefill is cheap next to decoding on a CPU).
TURNS = [
    "Hi! My name is Sam and I like sailing. I have a small dinghy on a lake near my town and I go out most weekends "
    "in the summer, usually alone, sometimes with my sister. I want to get better at it this year.",
    "What is a good name for a small sailboat? Mine is a blue fourteen-foot dinghy with a white sail; I would like "
    "something short that is easy to shout across the water and that has to do with the lake or the wind.",
    None,  # the tool turn
    "Thanks. Tell me a short story about the sea: a small boat, a storm in the afternoon, a sailor who has to decide "
    "whether to turn back or go on to the island, and how it ends when the wind drops at sunset.",
    "What did I tell you my name was, and what do I like to do at the weekend? Answer in one sentence, please, and "
    "then tell me one thing I should practise first this summer to get better at it.",
    "Give me three tips for a first sailing trip on a lake: what to check before leaving the dock, what to do if the "
    "wind picks up suddenly, and how to come back to the dock without hitting it.",
    "What should I pack for a day on the water? Think of the weather changing, of food and drink, of a phone that "
    "must stay dry, and of what I would need if the boat capsized near the shore.",
    "How do I tie a bowline knot? Describe it step by step, the way you would explain it to a child on the dock, and "
    "say what the knot is good for on a small boat.",
    "Summarise our chat in one line.",
    "Thanks, bye!",
]
TOOL_MESSAGE = "List the files in my workspace."
TIMESTAMP = re.compile(r"^\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) \d{4}-\d{2}-\d{2} ")


class Refused(RuntimeError):
    """The bench cannot run here (no node / no openclaw): the reason, for the user."""


def find_openclaw(where: str | None) -> tuple[list[str], dict[str, str]]:
    """(command, environment) that runs the openclaw CLI with a node that is recent enough."""
    env = dict(os.environ)
    folder = Path(where).expanduser() if where else None
    if folder is not None and folder.is_file():
        cli = folder
    elif folder is not None:
        cli = folder / "node_modules" / ".bin" / "openclaw"
        if not cli.exists():
            raise Refused(f"no openclaw CLI at {cli}: run `{INSTALL}` in {folder}")
        bundled = folder / "node_modules" / "node" / "bin"
        if (bundled / "node").exists():
            env["PATH"] = f"{bundled}{os.pathsep}{env.get('PATH', '')}"
    else:
        found = shutil.which("openclaw")
        if found is None:
            raise Refused(f"openclaw is not installed: `{INSTALL}` in a folder, then pass --openclaw FOLDER")
        cli = Path(found)
    node = shutil.which("node", path=env.get("PATH"))
    if node is None:
        raise Refused("node is not installed: openclaw needs node >= 24.16 (`npm install node@24` beside it)")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, env=env).stdout.strip()
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    if parts < MIN_NODE:
        raise Refused(f"node {version} at {node} is too old: openclaw needs >= {'.'.join(map(str, MIN_NODE))} (`npm install node@24`)")
    return [str(cli)], env


class Recorder:
    """ASGI middleware: every request's method, path, JSON body and response status, in order."""

    def __init__(self, app, path: Path):
        self.app, self.rows, self.path = app, [], path

    def __getattr__(self, name):  # the daemon reads the api's attributes (served_name, ...)
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        row = {"n": len(self.rows) + 1, "method": scope["method"], "path": scope["path"], "status": None, "body": None}
        self.rows.append(row)
        chunks = []

        async def recording_receive():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    try:
                        row["body"] = json.loads(b"".join(chunks) or b"null")
                    except ValueError:
                        row["body"] = None
            return message

        async def recording_send(message):
            if message["type"] == "http.response.start":
                row["status"] = message["status"]
            await send(message)

        try:
            await self.app(scope, recording_receive, recording_send)
        finally:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


def write_home(home: Path, config, model_id: str, context: int) -> None:
    block = openclaw.openclaw_config(config, lean=True, model_id=model_id, context=context)
    provider = block["models"]["providers"][openclaw.PROVIDER]
    [model] = provider["models"]
    model.update(contextWindow=min(OPENCLAW_WINDOW, context), maxTokens=64)
    forced = {**model, "id": model_id + "-forced-tool", "name": "forced tool call", "maxTokens": 256}
    provider["models"].append(forced)
    defaults = block["agents"]["defaults"]
    defaults["workspace"] = str(home / "workspace")
    # each summary request may wait behind other work on a CPU: OpenClaw's 180 s default cuts it off.
    # Its quality guard wants required headings a 135M model's summary lacks, and then retries and
    # keeps the old history (seen as a second round of summary requests); not yet run with it off.
    defaults["compaction"] = {"timeoutSeconds": int(config.request_timeout), "qualityGuard": {"enabled": False}}
    defaults["models"] = {
        f"{openclaw.PROVIDER}/{forced['id']}": {"params": {"extra_body": {"tool_choice": {"type": "function", "function": {"name": "ls"}}}}}
    }
    block["models"]["mode"] = "replace"
    block["tools"].update(alsoAllow=["ls"], deny=["gateway"])  # one harmless read-only tool; no self-update
    (home / ".openclaw").mkdir(parents=True)
    (home / "workspace").mkdir()
    (home / "workspace" / "notes.txt").write_text("remember: milk, eggs\n")
    (home / ".openclaw" / "openclaw.json").write_text(json.dumps(block, indent=2))


async def run_turn(cli: list[str], env: dict, message: str, model: str | None, timeout: float) -> tuple[int, float]:
    command = [*cli, "agent", "--local", "--session-id", "bench", "--message", message, "--timeout", str(int(timeout))]
    if model:
        command += ["--model", model]
    started = time.monotonic()
    with anyio.move_on_after(timeout + 120):
        result = await anyio.run_process(command, env=env, check=False)
        return result.returncode, time.monotonic() - started
    return -1, time.monotonic() - started


COMPACTED = "The conversation history before this point was compacted"


def analyse(rows: list[dict], run_dir: Path, counters: Counter, clients) -> dict:
    chats = [r for r in rows if r["path"] == "/v1/chat/completions"]
    turns = [json.loads(line) for line in (run_dir / "turns.jsonl").read_text().splitlines()]
    main = [t for t in turns if t["turn_type"] == "main"]
    samples = (run_dir / "samples.jsonl").read_text().splitlines() if (run_dir / "samples.jsonl").exists() else []
    next_states = [json.loads(line)["message"] for line in (run_dir / "next_states.jsonl").read_text().splitlines()]
    housekeeping = [r for r in chats if r["body"] and clients.housekeeping_match(chat.normalise(r["body"].get("messages") or []))]
    summaries = [r for r in housekeeping if (r["body"]["messages"][0].get("role") == "system")
                 and "summarization" in str(r["body"]["messages"][0].get("content"))]
    tool_results = [r for r in chats if r["body"] and any(m.get("role") == "tool" for m in r["body"].get("messages") or [])]
    conversation = Counter(t["session_id"] for t in main).most_common(1)[0][0] if main else None
    rewritten = [t for t in main if any(COMPACTED in (m.get("content") or "") for m in t["messages"])]
    return {
        "requests": len(rows),
        "statuses": dict(Counter(r["status"] for r in rows)),
        "main_turns": len(main),
        "main_sessions": len({t["session_id"] for t in main}),
        "side_turns": len(turns) - len(main),
        "housekeeping_kept_as_main": sum(bool(clients.housekeeping_match(chat.normalise(t["messages"]))) for t in main),
        "turns_after_compaction": len(rewritten),
        "turns_after_compaction_in_session": sum(t["session_id"] == conversation for t in rewritten),
        "housekeeping_requests": len(housekeeping),
        "compaction_summaries": len(summaries),
        "requests_with_tool_results": len(tool_results),
        "threaded_by_prefix": counters["threaded_by_prefix"],
        "threaded_by_reply": counters["threaded_by_reply"],
        "samples": len(samples),
        "next_states_with_envelope": sum(bool(TIMESTAMP.match(m.get("content") or "")) for m in next_states),
    }


def checks(figures: dict) -> list[tuple[str, bool]]:
    return [
        ("no 5xx", not any(s >= 500 for s in figures["statuses"] if s)),
        ("5+ main turns", figures["main_turns"] >= 5),
        ("one session for the conversation", figures["main_sessions"] == 1),
        ("a tool use (a tool result sent back)", figures["requests_with_tool_results"] >= 1),
        ("a compaction (summary request)", figures["compaction_summaries"] >= 1),
        ("housekeeping served as side turns", figures["side_turns"] >= 1 and figures["housekeeping_kept_as_main"] == 0),
        ("the turn after compaction continues the session", figures["turns_after_compaction_in_session"] >= 1),
        ("samples written for closed turns", figures["samples"] >= figures["main_turns"] - 1),
        ("next states without envelope", figures["next_states_with_envelope"] == 0),
    ]


async def bench_openclaw(config, args) -> int:
    from ocrl.daemon import Daemon

    try:
        cli, env = find_openclaw(getattr(args, "openclaw", None) or os.environ.get("OCRL_OPENCLAW"))
    except Refused as e:
        print(f"bench openclaw: not run: {e}")
        return 2
    config = on_free_port(config)
    daemon = Daemon(config)
    await daemon.build()
    recorder = Recorder(daemon.api, daemon.run_dir / "openclaw-requests.jsonl")
    daemon.api = recorder
    home = Path(tempfile.mkdtemp(prefix="ocrl-openclaw-"))
    model_id = daemon.api.served_name
    write_home(home, config, model_id, daemon.engine.max_context)
    env = {**env, "HOME": str(home), "NO_COLOR": "1"}
    forced = f"{openclaw.PROVIDER}/{model_id}-forced-tool"
    log = []
    async with serving(daemon):
        compacted_at = None
        for k, message in enumerate(TURNS):
            tool = message is None
            before = len(recorder.rows)
            code, seconds = await run_turn(cli, env, TOOL_MESSAGE if tool else message, forced if tool else None,
                                           TOOL_TURN_SECONDS if tool else config.request_timeout)
            new = recorder.rows[before:]
            summary = any(r["body"] and COMPACTED in json.dumps(r["body"].get("messages", [])) for r in new)
            log.append((k + 1, "tool" if tool else "chat", code, round(seconds), len(new), summary))
            print(f"turn {k + 1}: {'tool' if tool else 'chat'} exit {code} in {seconds:.0f}s, {len(new)} requests{', after compaction' if summary else ''}", flush=True)
            if summary and compacted_at is None:
                compacted_at = k
            if k >= 4 and compacted_at is not None:  # 5+ turns, one of them after a compaction
                break
        await daemon.sessions.drain(timeout=120)
    figures = analyse(recorder.rows, daemon.run_dir, daemon.sessions.counters, daemon.sessions.clients)
    print(json.dumps({"turns": log, **figures}, indent=1))
    results = checks(figures)
    for name, ok in results:
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    print(f"run dir {daemon.run_dir}; OpenClaw home {home}")
    return 0 if all(ok for _, ok in results) else 1
