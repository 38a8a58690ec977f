"""Agent clients: sessions threaded through OpenClaw's history rewrites, its housekeeping served as
side turns, its envelope cut from next states. Replayed from request bodies captured from the real
OpenClaw CLI (2026.9.6, `openclaw agent --local`, lean agent) against ocrl: tests/data/openclaw/."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import anyio
import pytest

from ocrl import chat, config as config_mod
from ocrl.clients import OPENCLAW_ENVELOPE, OPENCLAW_HOUSEKEEPING, ClientRules
from ocrl.sessions import Sessions
from ocrl.types import Completion, Message, Verdict, Vote

DATA = Path(__file__).parent / "data" / "openclaw"
OPENCLAW = ClientRules(OPENCLAW_HOUSEKEEPING, OPENCLAW_ENVELOPE)


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


class Replay:
    """Feeds captured bodies through Sessions as the API does, answering each with the reply
    ocrl gave at capture time (so the next captured request's history matches it)."""

    def __init__(self, clients: ClientRules | None):
        self.samples, self.judged = [], []
        self.sessions = Sessions(
            judge=self.judge, submit=self.samples.append, clients=clients,
            parse_response=lambda text: chat.parse_completion(text, True)[:2],
        )

    async def judge(self, response: str, next_state: str, role: str) -> Verdict:
        self.judged.append(next_state)
        return Verdict(score=1, votes=[Vote(1, "\\boxed{1}")], mode="scripted")

    def play(self, row: dict):
        request = row["request"]
        messages = chat.normalise(request["messages"])
        ticket = self.sessions.begin(session_id=None, turn_type=None, session_done=False, messages=messages, tools=request.get("tools"))
        reply = row["reply"]
        if reply is None:  # the client gave up on this request: no turn kept
            self.sessions.abort(ticket)
            return None
        text = reply["content"] + "".join(
            "<tool_call>" + json.dumps({"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"] or "{}")}) + "</tool_call>"
            for c in reply["tool_calls"]
        )
        completion = Completion(prompt_ids=[1, 2], response_ids=[3], logprobs=[-0.5], text=text, finish_reason="stop", weights_version=0)
        return self.sessions.complete(ticket, completion)

    async def run(self, name: str):
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.sessions.run)
            turns = [(row["label"], turn) for row in rows(name) if (turn := self.play(row)) is not None]
            with anyio.fail_after(10):
                while self.sessions._in_flight:
                    await anyio.sleep(0.001)
            tg.cancel_scope.cancel()
        return turns


async def test_compaction_keeps_one_session_and_serves_housekeeping_as_side_turns():
    replay = Replay(OPENCLAW)
    turns = await replay.run("compaction.jsonl")
    kinds = [(label.split(" (")[0], t.turn_type) for label, t in turns]
    assert kinds == [
        ("turn 1", "main"), ("turn 2", "main"), ("turn 3", "main"), ("turn 4", "main"),
        ("memory flush", "side"), ("compaction summary", "side"), ("turn 5 after compaction", "main"),
    ]
    main = [t for _, t in turns if t.turn_type == "main"]
    assert len({t.session_id for t in main}) == 1, "the user's five turns are one session"
    assert [t.index for t in main] == [0, 1, 2, 3, 4]
    flush, summary = turns[4][1], turns[5][1]
    assert flush.session_id == main[0].session_id  # threaded by its reply, as a side turn
    assert summary.session_id not in replay.sessions.sessions  # its own session, closed at once
    counters = replay.sessions.counters
    assert counters["housekeeping_turns"] == 2
    assert counters["threaded_by_reply"] == 3  # turn 2 (new system prompt), the flush, turn 5 (rewritten)
    # Turn 4 (before the compaction) got its next state from turn 5, with the envelope cut off.
    by_index = {s.turn_index: s for s in replay.samples}
    assert sorted(by_index) == [0, 1, 2, 3]
    assert by_index[3].next_state == "Tell me about dogs."
    assert by_index[0].next_state == "Thanks. Now tell me a short fact about cats."
    assert replay.judged == [
        "Thanks. Now tell me a short fact about cats.",
        "Please check the session status with the session_status tool.",
        "What did I ask you first?",
        "Tell me about dogs.",
    ]


async def test_without_client_rules_the_same_traffic_splits_and_trains_on_housekeeping():
    """What the client rules fix, on the same bodies (threading by reply still on): the flush is
    taken for the user's answer to turn 4, the summary trains as a turn of its own, and the turn
    after compaction, no longer after the session's last reply, starts a session of its own."""
    replay = Replay(ClientRules())
    turns = await replay.run("compaction.jsonl")
    assert all(t.turn_type == "main" for _, t in turns)
    assert len({t.session_id for _, t in turns}) == 3
    by_index = {s.turn_index: s for s in replay.samples if s.session_id == turns[0][1].session_id}
    assert by_index[3].next_state.startswith("Pre-compaction memory flush.")
    assert "[Fri 2026-12-04 16:17 UTC] Thanks. Now tell me a short fact about cats." in replay.judged


def test_envelope_is_cut_from_user_text_only():
    first = rows("compaction.jsonl")[0]["request"]["messages"][1]["content"]
    assert first.startswith("[Fri 2026-12-04 16:15 UTC] ") and "\n\nRuntime: agent=main |" in first
    assert OPENCLAW.strip(Message(role="user", content=first)).content == "Hello! What is 2+3?"
    assert OPENCLAW.strip(Message(role="user", content="[Sat 2026-12-05 09:01:30 Europe/Paris] hi")).content == "hi"
    untouched = Message(role="tool", content="[Fri 2026-12-04 16:15 UTC] tool output", tool_call_id="c1")
    assert OPENCLAW.strip(untouched) is untouched
    typed = Message(role="user", content="see [Fri 2026-12-04 16:15 UTC] above")  # not a prefix: the user's words
    assert OPENCLAW.strip(typed).content == typed.content


def test_housekeeping_rule_reads_the_last_message_of_its_role():
    flush, summary, turn = (rows("compaction.jsonl")[i]["request"]["messages"] for i in (4, 5, 6))
    assert OPENCLAW.housekeeping_match(chat.normalise(flush)).startswith("user:")
    assert OPENCLAW.housekeeping_match(chat.normalise(summary)).startswith("system:")
    assert OPENCLAW.housekeeping_match(chat.normalise(turn)) is None
    # the user merely quoting the phrase later in a message is not housekeeping
    quoted = [Message(role="user", content="[Fri 2026-12-04 16:15 UTC] what is a Pre-compaction memory flush?")]
    assert OPENCLAW.housekeeping_match(quoted) is None
    other = ClientRules(["any:^/internal summarise"])
    assert other.housekeeping_match([Message(role="user", content="/internal summarise this")])


def test_an_explicit_turn_type_wins_over_the_housekeeping_rule():
    sessions = Sessions(judge=None, submit=lambda s: None, clients=OPENCLAW)
    flush = chat.normalise(rows("compaction.jsonl")[4]["request"]["messages"])
    assert sessions.begin(session_id="x", turn_type="main", session_done=False, messages=flush).turn_type == "main"
    assert sessions.begin(session_id="y", turn_type=None, session_done=False, messages=flush).turn_type == "side"


def test_patterns_come_from_flags_and_bad_ones_are_refused():
    parser = argparse.ArgumentParser()
    config_mod.add_flags(parser)
    default = config_mod.load(parser.parse_args([]), environ={})
    assert default.housekeeping_pattern == list(OPENCLAW_HOUSEKEEPING) and default.envelope_pattern == list(OPENCLAW_ENVELOPE)
    mine = config_mod.load(parser.parse_args(["--housekeeping-pattern", "user:^#flush", "--housekeeping-pattern", "system:^Summarise", "--envelope-pattern", ""]), environ={})
    assert mine.housekeeping_pattern == ["user:^#flush", "system:^Summarise"] and mine.envelope_pattern == []
    with pytest.raises(config_mod.ConfigError, match="ROLE:REGEX"):
        config_mod.load(parser.parse_args(["--housekeeping-pattern", "^no role"]), environ={})
    with pytest.raises(config_mod.ConfigError, match="not a valid regular expression"):
        config_mod.load(parser.parse_args(["--envelope-pattern", "(unclosed"]), environ={})
    assert config_mod.load(None, environ={"OCRL_ENVELOPE_PATTERN": "^a\n^b"}).envelope_pattern == ["^a", "^b"]


def test_openclaw_config_matches_the_daemon_flags(capsys):
    from ocrl.__main__ import main

    assert main(["openclaw-config", "--port", "31999", "--api-key", "k-123", "--context-length", "4096", "--default-max-tokens", "300"]) == 0
    block = json.loads(capsys.readouterr().out)
    [model] = block["models"]["providers"]["ocrl"]["models"]
    provider = block["models"]["providers"]["ocrl"]
    assert provider["baseUrl"] == "http://127.0.0.1:31999/v1" and provider["apiKey"] == "k-123" and provider["api"] == "openai-completions"
    assert (model["id"], model["contextWindow"], model["maxTokens"]) == ("SmolLM2-135M-Instruct", 4096, 300)
    assert block["agents"]["defaults"]["model"]["primary"] == "ocrl/SmolLM2-135M-Instruct"
    assert "tools" not in block and "contextInjection" not in block["agents"]["defaults"]
    assert main(["openclaw-config", "--lean", "--served-model-name", "mine"]) == 0
    lean = json.loads(capsys.readouterr().out)
    [model] = lean["models"]["providers"]["ocrl"]["models"]
    assert (model["id"], model["contextWindow"], model["maxTokens"]) == ("mine", 8192, 256)  # the embedded model's trained window
    assert lean["models"]["providers"]["ocrl"]["apiKey"] == "ocrl-local"
    assert lean["agents"]["defaults"]["contextInjection"] == "never" and lean["agents"]["defaults"]["skills"] == []
    assert lean["tools"] == {"profile": "minimal", "toolSearch": False}
    assert main(["openclaw-config", "--context-length", "4096"]) == 0  # no --default-max-tokens: the context is the cap
    [model] = json.loads(capsys.readouterr().out)["models"]["providers"]["ocrl"]["models"]
    assert model["maxTokens"] == model["contextWindow"] == 4096


def test_rope_scaling_stretches_the_window_only_when_asked(capsys, caplog):
    from ocrl import models
    from ocrl.__main__ import main

    where = models.dequantise_to_cache(models.embedded_gguf())
    with caplog.at_level("WARNING", logger="ocrl.models"):
        stretched = models.scaled_config(where, 16384, "yarn")
    assert stretched.max_position_embeddings == 16384
    assert stretched.rope_parameters["rope_type"] == "yarn" and stretched.rope_parameters["factor"] == 2.0
    assert stretched.rope_parameters["original_max_position_embeddings"] == 8192
    assert "RoPE yarn scaling x2.00" in caplog.text
    assert models.scaled_config(where, 4096, "linear").max_position_embeddings == 8192  # within the window: unchanged
    assert main(["openclaw-config", "--context-length", "16384"]) == 0  # without scaling: capped at the trained window
    assert json.loads(capsys.readouterr().out)["models"]["providers"]["ocrl"]["models"][0]["contextWindow"] == 8192
    assert main(["openclaw-config", "--context-length", "16384", "--rope-scaling", "yarn"]) == 0
    assert json.loads(capsys.readouterr().out)["models"]["providers"]["ocrl"]["models"][0]["contextWindow"] == 16384


async def test_tool_loop_and_a_model_switch_stay_in_one_session():
    """From `bench openclaw` (OpenClaw 2026.9.6): two turns, a turn run with `--model` naming a
    forced-tool entry (the Runtime line of the system prompt names the model, so no prefix
    matches: threaded by the last reply), six forced `ls` calls whose tool results are the next
    states, an aborted run, four more turns, then chunked compaction summaries (side turns)."""
    replay = Replay(OPENCLAW)
    turns = await replay.run("tool-loop.jsonl")
    main = [t for label, t in turns if t.turn_type == "main"]
    side = [(label, t) for label, t in turns if t.turn_type == "side"]
    assert len(main) == 12 and len({t.session_id for t in main}) == 1
    assert [label for label, _ in side] == ["compaction summary"] * 3  # and two the client gave up on
    assert replay.sessions.counters["threaded_by_reply"] == 1  # the model switch
    roles = [s.next_state_role for s in sorted(replay.samples, key=lambda s: s.turn_index)]
    assert roles[2:8] == ["tool"] * 6  # each forced call is judged by the tool result that followed it
    assert all(not s.next_state.startswith("[") for s in replay.samples if s.next_state_role == "user")
