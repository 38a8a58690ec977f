"""Hostile web pages, hopeless bodies, retries and impossible fields: each refused with a clear
4xx in OpenAI's error shape that changes nothing, or handled without losing or doubling a turn."""

from __future__ import annotations

import json
import time

import anyio
import httpx
import pytest

from ocrl import guard
from ocrl.config import Config, ConfigError
from ocrl.daemon import check_access, check_checkpoints


def _post(daemon, path: str, body: bytes, **headers) -> httpx.Response:
    headers = {"Authorization": f"Bearer {daemon.api_key}", "Content-Type": "application/json", **headers}
    return httpx.post(daemon.url + path, content=body, headers=headers, timeout=120)


def _counters(daemon) -> dict:
    sessions = daemon.stats()["sessions"]
    return {k: sessions.get(k, 0) for k in ("main_turns", "side_turns", "sessions_opened", "aborted_turns")}


def _error(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text[:300]
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


CHAT = json.dumps({"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2}).encode()


# -- bind ---------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["", "0.0.0.0", "::", "[::]"])
def test_empty_or_wildcard_host_is_not_loopback(host):
    assert not guard.is_loopback(host)
    with pytest.raises(ConfigError):  # before: "" counted as loopback and bound every interface without a key
        check_access(Config(host=host))
    check_access(Config(host=host, api_key="k"))


def test_loopback_hosts_still_need_no_key():
    for host in ("127.0.0.1", "localhost", "::1", "[::1]"):
        assert guard.is_loopback(host)
        check_access(Config(host=host))


def test_a_fresh_run_refuses_the_checkpoints_of_an_earlier_one(tmp_path):
    """Training from the model as loaded into a checkpoint dir that holds an earlier run's step-7
    would leave that step-7 the newest for a later --resume (or a restarted trainer actor)."""
    import subprocess
    import sys

    run = tmp_path / "run"
    (run / "checkpoints" / "step-7").mkdir(parents=True)
    (run / "checkpoints" / "step-7" / "state.json").write_text("{}")
    with pytest.raises(ConfigError, match="step-7.*--resume"):
        check_checkpoints(Config(record_dir=str(run)))
    with pytest.raises(ConfigError, match="--resume"):  # --save-dir names the same place
        check_checkpoints(Config(record_dir=str(tmp_path / "other"), save_dir=str(run / "checkpoints")))
    check_checkpoints(Config(record_dir=str(run), resume=True))  # going on from it
    check_checkpoints(Config(record_dir=str(run), no_train=True))  # nothing trained, nothing written
    check_checkpoints(Config(record_dir=str(tmp_path / "new")))
    (run / "checkpoints" / "step-7" / "state.json").unlink()  # an incomplete one is not a checkpoint
    check_checkpoints(Config(record_dir=str(run)))
    (run / "checkpoints" / "step-7" / "state.json").write_text("{}")
    # as a user meets it: refused before the model loads, exit 2, the reason on stderr
    done = subprocess.run([sys.executable, "-m", "ocrl", "serve", "--headless", "--record-dir", str(run)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "--resume" in done.stderr and "step-7" in done.stderr, done.stderr[-500:]


# -- browsers -----------------------------------------------------------------------------


def test_a_rebinding_host_name_is_refused(daemon):
    before = _counters(daemon)
    for path in ("/v1/ocrl/stats", "/v1/ocrl/events", "/healthz"):
        reply = httpx.get(daemon.url + path, headers={"Authorization": f"Bearer {daemon.api_key}", "Host": "attacker.example:8080"}, timeout=30)
        assert _error(reply, 403)["code"] == "host_not_allowed"
    assert _error(_post(daemon, "/v1/chat/completions", CHAT, Host="rebind.attacker.example"), 403)["code"] == "host_not_allowed"
    # IP literals and localhost are this server's own names
    for host in (f"127.0.0.1:{daemon.port}", f"localhost:{daemon.port}"):
        assert httpx.get(daemon.url + "/healthz", headers={"Host": host}, timeout=30).status_code == 200
    assert _counters(daemon) == before


def test_a_foreign_origin_is_refused_and_changes_nothing(daemon):
    before = _counters(daemon)
    for origin in ("https://evil.example", "null", f"http://127.0.0.1:{daemon.port + 1}"):
        reply = _post(daemon, "/v1/chat/completions", CHAT, Origin=origin)
        assert _error(reply, 403)["code"] == "origin_not_allowed"
        assert _error(_post(daemon, "/v1/ocrl/train/pause", b"", Origin=origin), 403)["code"] == "origin_not_allowed"
    # the daemon's own origin (its own pages, a same-origin fetch) is fine
    assert _post(daemon, "/v1/chat/completions", CHAT, Origin=f"http://127.0.0.1:{daemon.port}").status_code == 200
    after = _counters(daemon)
    assert after["main_turns"] == before["main_turns"] + 1 and after["sessions_opened"] == before["sessions_opened"] + 1


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None])
def test_json_endpoints_require_application_json(daemon, content_type):
    """A cross-site form (or no-cors fetch) can POST these types without asking first; before,
    chat answered 200 and kept the turn, and /train/pause paused training."""
    before = _counters(daemon)
    headers = {"Authorization": f"Bearer {daemon.api_key}"} | ({"Content-Type": content_type} if content_type else {})
    for path in ("/v1/chat/completions", "/v1/ocrl/train/pause", "/v1/ocrl/detokenize"):
        reply = httpx.post(daemon.url + path, content=CHAT, headers=headers, timeout=30)
        assert _error(reply, 415)["code"] == "unsupported_media_type"
    assert _counters(daemon) == before
    assert _post(daemon, "/v1/chat/completions", CHAT, **{"Content-Type": "application/json; charset=utf-8"}).status_code == 200


def test_allowed_origins_and_hosts_flags():
    config = Config(allowed_origins="http://localhost:3000", allowed_hosts="ocrl.lan")
    scope = lambda **h: {"method": "GET", "headers": [(k.encode(), v.encode()) for k, v in h.items()]}  # noqa: E731
    assert guard.browser_refusal(scope(host="ocrl.lan:30000", origin="http://localhost:3000"), config) is None
    assert guard.browser_refusal(scope(host="ocrl.lan:30000", origin="http://localhost:3001"), config).code == "origin_not_allowed"
    assert guard.browser_refusal(scope(host="other.lan"), config).code == "host_not_allowed"
    assert guard.browser_refusal(scope(host="anything.example"), Config(allowed_hosts="*")) is None


# -- fields that no route can honour --------------------------------------------------------


DEEP = '{"a":' * 1000 + '"x"' + "}" * 1000  # json.dumps itself cannot write this: it is raw JSON

BAD_FIELDS = {  # raw JSON of the extra fields, and the param the 400 names
    "seed 2^64": (f'"seed": {2**64}', "seed"),
    "seed -2^63-1": (f'"seed": {-(2**63) - 1}', "seed"),
    "tools nested 1000 deep": ('"tools": [{"type": "function", "function": {"name": "f", "parameters": %s}}]' % DEEP, "nested_too_deep"),
    "tool_choice nested 1000 deep": (f'"tool_choice": {DEEP}', "nested_too_deep"),
    "tools nested 100 deep": ('"tools": [{"type": "function", "function": {"name": "f", "parameters": %s}}]' % ('{"a":' * 100 + '"x"' + "}" * 100), "tools"),
    "emoji session id": ('"session_id": ' + json.dumps("chat-\U0001F600"), "session_id"),
    "RTL session id": ('"session_id": ' + json.dumps("abc\u202edcba"), "session_id"),
    "NUL session id": ('"session_id": ' + json.dumps("a\x00b"), "session_id"),
    "CRLF session id": ('"session_id": ' + json.dumps("a\r\nX-Injected: 1"), "session_id"),
    "1 MB session id": ('"session_id": ' + json.dumps("s" * (1 << 20)), "session_id"),
}


@pytest.mark.parametrize("case", list(BAD_FIELDS))
def test_impossible_fields_are_400_and_record_nothing(daemon, case):
    extra, param = BAD_FIELDS[case]
    before = _counters(daemon)
    for stream in ("false", "true"):
        body = '{"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "stream": %s, %s}' % (stream, extra)
        error = _error(_post(daemon, "/v1/chat/completions", body.encode()), 400)
        assert param in (error["param"], error["code"]), error
    assert _counters(daemon) == before


# -- hopeless bodies ------------------------------------------------------------------------


async def test_four_huge_bodies_are_refused_while_another_request_completes(daemon):
    huge = json.dumps({"messages": [{"role": "user", "content": "word " * 1_580_000}], "max_tokens": 2}).encode()
    assert 7_800_000 < len(huge) < 8 * 1024 * 1024
    headers = {"Authorization": f"Bearer {daemon.api_key}", "Content-Type": "application/json"}
    replies: list = []
    async with httpx.AsyncClient(timeout=120) as client:

        async def refuse() -> None:
            replies.append(await client.post(daemon.url + "/v1/chat/completions", content=huge, headers=headers))

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(refuse)
            other = await client.post(daemon.url + "/v1/chat/completions", content=CHAT, headers=headers)
            health = await client.get(daemon.url + "/healthz")
    assert other.status_code == 200 and health.status_code == 200
    assert [_error(r, 400)["code"] for r in replies] == ["context_length_exceeded"] * 4


@pytest.mark.parametrize("path, param", [("/v1/chat/completions", "messages"), ("/v1/completions", "prompt"), ("/v1/responses", "input")])
def test_a_hopeless_body_is_refused_before_it_is_decoded(daemon, path, param):
    # not even JSON (never closed): a 400 for its size, not for its syntax, shows it was never decoded
    field = {"messages": '"messages": [{"role": "user", "content": "', "prompt": '"prompt": "', "input": '"input": "'}[param]
    body = ('{"model": "m", "max_tokens": 2, ' + field + "word " * 1_580_000).encode()
    before = _counters(daemon)
    error = _error(_post(daemon, path, body), 400)
    assert (error["code"], error["param"], error["type"]) == ("context_length_exceeded", param, "invalid_request_error")
    assert _counters(daemon) == before


async def test_the_openai_client_gets_context_length_exceeded_for_a_huge_completion_or_response(daemon):
    import openai

    client = daemon.client(timeout=120)
    huge = "word " * 1_580_000
    before = _counters(daemon)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model="m", prompt=huge, max_tokens=2)
    assert (refused.value.code, refused.value.param) == ("context_length_exceeded", "prompt")
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model="m", input=huge, max_output_tokens=16)
    assert (refused.value.code, refused.value.param) == ("context_length_exceeded", "input")
    assert _counters(daemon) == before


# -- retries and clients that leave -----------------------------------------------------------


def test_a_retry_of_an_in_flight_turn_replaces_it():
    """Client sends turn 1, times out, sends it again while the first still generates: the retry
    is the main turn; the abandoned one, if it finishes, is a side turn (before: both were main
    turns, 1 and 2, and turn 1 never became a sample)."""
    from ocrl.sessions import Sessions
    from ocrl.types import Completion, Message

    async def judge(*args):
        raise AssertionError("no next state here")

    submitted = []
    sessions = Sessions(judge=judge, submit=submitted.append)
    messages = [Message(role="user", content="hello")]
    done = lambda text: Completion(prompt_ids=[1], response_ids=[2], logprobs=[-0.1], text=text, finish_reason="stop", weights_version=0)  # noqa: E731
    first = sessions.begin(session_id="a", turn_type="main", session_done=False, messages=messages)
    retry = sessions.begin(session_id="a", turn_type="main", session_done=False, messages=messages)
    assert sessions.complete(first, done("late")).turn_type == "side"
    kept = sessions.complete(retry, done("retry"))
    assert (kept.turn_type, kept.index) == ("main", 0)
    assert [t.turn.response_text for t in sessions.sessions["a"].turns] == ["retry"]
    sessions.close("a")
    assert len(submitted) == 1 and submitted[0].turn_index == 0
    # a different request of the same session is not a retry
    other = sessions.begin(session_id="b", turn_type="main", session_done=False, messages=messages)
    second = sessions.begin(session_id="b", turn_type="main", session_done=False, messages=messages + [Message(role="user", content="more")])
    assert sessions.complete(other, done("x")).turn_type == "main" and sessions.complete(second, done("y")).index == 1


async def test_a_retried_turn_whose_reply_was_lost_is_one_main_turn(daemon):
    """The first request finished, but its reply never reached the client (it timed out), which
    sends the same turn again (the real openai client): the retry takes the finished turn's place
    (same index), the next request closes that one turn, and no turn is left without a next
    state. Before: the retry closed turn 0 with its own user message as the next state and
    became turn 1, so one exchange was judged twice, once against a bogus next state."""
    import uuid

    client = daemon.client()
    sid = "retry-" + uuid.uuid4().hex[:8]
    messages = [{"role": "user", "content": "Name a colour."}]
    ask = dict(model="m", max_tokens=4, temperature=0, extra_headers={"X-Session-Id": sid})
    before = daemon.stats()["sessions"].get("replaced_turns", 0)
    await client.chat.completions.create(messages=messages, **ask)  # its reply is "lost"
    retry = await client.chat.completions.create(messages=messages, **ask)
    follow_up = messages + [{"role": "assistant", "content": retry.choices[0].message.content}, {"role": "user", "content": "Another."}]
    await client.chat.completions.create(messages=follow_up, **ask)
    assert daemon.stats()["sessions"]["replaced_turns"] == before + 1

    def rows(name):
        return [json.loads(line) for f in daemon.record_dir.rglob(name) for line in f.read_text().splitlines() if line.strip()]

    assert [r["index"] for r in rows("turns.jsonl") if r["session_id"] == sid and r["turn_type"] == "main"] == [0, 0, 1]
    closed = [r for r in rows("next_states.jsonl") if r["sample_id"].startswith(sid + ":")]
    assert [(r["sample_id"].rsplit(":", 1)[1], r["message"]["content"]) for r in closed] == [("0", "Another.")]


def test_a_non_streaming_request_whose_client_left_stops_generating(daemon):
    before = _counters(daemon)
    body = {"messages": [{"role": "user", "content": "Count from 1 to 500, separated by commas."}], "max_tokens": 400, "temperature": 0, "turn_type": "side"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(daemon.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {daemon.api_key}"}, timeout=httpx.Timeout(30, read=2))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and daemon.stats()["engine"]["active"]:
        time.sleep(0.2)
    engine = daemon.stats()["engine"]
    assert engine["active"] == 0 and engine["queue_depth"] == 0  # before: it went on for all 400 tokens
    tokens = engine["generated_tokens"]
    time.sleep(1.0)
    assert daemon.stats()["engine"]["generated_tokens"] == tokens
    after = _counters(daemon)
    assert after["aborted_turns"] == before["aborted_turns"] + 1 and after["side_turns"] == before["side_turns"]
