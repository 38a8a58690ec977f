"""Bad input, overload and strangers change nothing: fuzzed requests, limits, auth everywhere,
private files, quiet logs."""

from __future__ import annotations

import functools
import os
import stat
import subprocess
import sys

import anyio
import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT, Daemon, free_port

scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=40)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=12
)
deep = st.integers(1, 500).map(lambda depth: functools.reduce(lambda inner, _: [inner], range(depth), []))
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "wizard", ""]) | json_values
contents = st.text(max_size=300) | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", 3]), "text": json_values})) | json_values
messages = st.fixed_dictionaries(
    {"role": roles, "content": contents},
    optional={"name": json_values, "tool_calls": json_values, "tool_call_id": json_values, "extra": json_values},
)
bodies = st.fixed_dictionaries(
    # max_tokens is always present and small when valid: a fuzz case must not generate for minutes
    {"messages": st.lists(messages, max_size=4) | json_values, "max_tokens": st.integers(-3, 3) | st.text(max_size=5) | st.lists(scalars, max_size=2)},
    optional={
        "model": json_values, "temperature": json_values | st.floats(-1, 3), "top_p": json_values, "stop": json_values,
        "n": st.integers(-1, 4), "stream": st.booleans(), "tools": json_values, "logprobs": json_values,
        "top_logprobs": st.integers(-2, 30), "seed": json_values, "stream_options": json_values, "session_id": json_values,
        "turn_type": json_values, "session_done": json_values, "unknown_field": json_values, "nested": deep,
    },
)


def post(daemon, content: bytes, **headers) -> httpx.Response:
    headers = {"Authorization": f"Bearer {daemon.api_key}", "Content-Type": "application/json", **headers}
    return httpx.post(daemon.url + "/v1/chat/completions", content=content, headers=headers, timeout=120)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=bodies)
def test_fuzzed_requests_never_5xx(daemon, body):
    import json

    reply = post(daemon, json.dumps(body).encode())
    assert reply.status_code < 500, reply.text
    if reply.status_code != 200:
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_fuzzed_bytes_never_5xx(daemon, raw):
    reply = post(daemon, raw)
    assert reply.status_code in (400, 200), reply.text


def test_server_still_answers_after_the_fuzz(daemon):
    reply = post(daemon, b'{"messages": [{"role": "user", "content": "What is 2+3?"}], "max_tokens": 20, "temperature": 0}')
    assert reply.status_code == 200 and "5" in reply.json()["choices"][0]["message"]["content"]


def test_auth_on_every_route_but_healthz(daemon):
    routes = [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/v1/ocrl/stats"), ("GET", "/v1/ocrl/events"),
              ("POST", "/v1/ocrl/train/pause"), ("POST", "/v1/ocrl/train/resume"), ("POST", "/v1/ocrl/checkpoint"), ("POST", "/v1/ocrl/detokenize"), ("GET", "/nope")]
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": daemon.api_key}):
            reply = httpx.request(method, daemon.url + path, headers=headers, timeout=30)
            assert reply.status_code == 401, (method, path, headers, reply.status_code)
            assert reply.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(daemon.url + "/healthz").status_code == 200


def test_training_controls_answer_409_without_a_trainer(daemon):
    reply = httpx.post(daemon.url + "/v1/ocrl/train/pause", headers={"Authorization": f"Bearer {daemon.api_key}"})
    assert reply.status_code == 409 and reply.json()["error"]["code"] == "training_disabled"


def test_run_files_are_private_and_logs_hold_no_secrets(daemon):
    secret = "plum-velvet-4471"
    reply = post(daemon, ('{"messages": [{"role": "user", "content": "My code is %s"}], "max_tokens": 2}' % secret).encode(), **{"X-Session-Done": "1"})
    assert reply.status_code == 200
    post(daemon, b'{"messages": []}')  # an error path logs too
    files = [p for p in daemon.record_dir.iterdir() if p.is_file()]
    assert {"turns.jsonl", "journal.jsonl", "samples.jsonl"} <= {p.name for p in files}
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    log = daemon.log_path.read_text()
    assert secret not in log and daemon.api_key not in log
    assert "\x1b[" not in log  # plain lines, no colour codes, when not on a terminal


def test_refuses_a_public_address_without_a_key(tmp_path):
    cmd = [sys.executable, "-m", "ocrl", "serve", "--host", "0.0.0.0", "--port", str(free_port()), "--record-dir", str(tmp_path / "r")]
    env = {k: v for k, v in os.environ.items() if k not in ("OCRL_API_KEY", "SGLANG_API_KEY")}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2
    assert "--api-key" in done.stderr and "--insecure-no-auth" in done.stderr


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """Small limits: one queued generation, one per batch, 64 tokens of context, 4 messages."""
    daemon = Daemon(
        tmp_path_factory.mktemp("limited") / "run", "--no-train", "--threads", "1", "--max-queued-requests", "1",
        "--max-batch-size", "1", "--context-length", "64", "--max-messages", "4",
    ).start()
    yield daemon
    daemon.stop()


def test_max_tokens_is_clamped_to_the_context(limited):
    body = {"messages": [{"role": "user", "content": "Tell me a long story about a dragon."}], "max_tokens": 10**9, "temperature": 0}
    r = post(limited, msgspec.json.encode(body))
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= 64
    if r.json()["choices"][0]["finish_reason"] == "length":  # it ran until the context was full
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 64


def test_too_many_messages_or_tokens_is_400_and_changes_nothing(limited):
    before = limited.stats()["sessions"]
    five = {"messages": [{"role": "user", "content": "hi"}] * 5, "max_tokens": 2}
    r = post(limited, msgspec.json.encode(five))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages" and "at most 4" in r.json()["error"]["message"]
    long = {"messages": [{"role": "user", "content": "word " * 100}], "max_tokens": 2}
    r = post(limited, msgspec.json.encode(long))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    after = limited.stats()["sessions"]
    assert after.get("main_turns", 0) == before.get("main_turns", 0) and after["sessions_open"] == before["sessions_open"]


async def test_a_request_over_its_time_is_504_and_keeps_no_turn(tmp_path):
    daemon = Daemon(tmp_path / "run", "--no-train", "--threads", "1", "--request-timeout", "0.3").start()
    try:
        body = {"messages": [{"role": "user", "content": "Write a long poem."}], "max_tokens": 400, "temperature": 0}
        r = post(daemon, msgspec.json.encode(body))
        assert r.status_code == 504
        error = r.json()["error"]
        assert error["type"] == "timeout" and "0.3" in error["message"]
        with httpx.stream(
            "POST", daemon.url + "/v1/chat/completions", json={**body, "stream": True},
            headers={"Authorization": f"Bearer {daemon.api_key}"}, timeout=120,
        ) as streamed:
            events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        assert any('"type":"timeout"' in line for line in events) and events[-1] == "data: [DONE]"
        stats = daemon.stats()
        assert stats["sessions"].get("main_turns", 0) == 0 and stats["sessions"]["aborted_turns"] == 2
        # the engine dropped both generations: it is idle again, and the daemon still serves
        await anyio.sleep(1.0)
        engine = daemon.stats()["engine"]
        assert engine["queue_depth"] == 0 and engine["active"] == 0
        assert httpx.get(daemon.url + "/healthz").status_code == 200
    finally:
        daemon.stop()


async def test_queue_bound_answers_429_with_retry_after(limited):
    daemon = limited
    statuses, retry_after = [], []

    async def ask(client, i):
        r = await client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": f"Count to {i}"}], "max_tokens": 12},
        )
        statuses.append(r.status_code)
        if r.status_code == 429:
            retry_after.append(r.headers.get("retry-after"))
            assert r.json()["error"]["type"] == "rate_limit_error"

    headers = {"Authorization": f"Bearer {daemon.api_key}"}
    async with httpx.AsyncClient(base_url=daemon.url, headers=headers, timeout=300) as client:
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(ask, client, i)
        assert 429 in statuses and 200 in statuses and set(statuses) <= {200, 429}
        assert all(value and value.isdigit() for value in retry_after)
        after = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert after.status_code == 200


def test_a_port_in_use_is_a_one_line_error_not_a_traceback(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "ocrl", "serve", "--headless", "--random-init", "tiny", "--no-train", "--port", str(port),
             "--record-dir", str(tmp_path / "run")],
            capture_output=True, text=True, timeout=180, cwd=ROOT,
        )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"ocrl: cannot listen on 127.0.0.1:{port}" in done.stderr and "Traceback" not in done.stderr
