"""The proxy end to end: the real daemon, the real `openai` client, the embedded model."""

from __future__ import annotations

import json

import anyio
import httpx
import openai
import pytest
import torch

from ocrl import chat
from ocrl.types import Message

QUESTION = [{"role": "user", "content": "What is 2+3?"}]


async def test_plain_answer(daemon):
    async with daemon.client() as client:
        reply = await client.chat.completions.create(model="any", messages=QUESTION, temperature=0, max_tokens=30)
    choice = reply.choices[0]
    assert "5" in choice.message.content
    assert choice.finish_reason == "stop"
    assert reply.model == "SmolLM2-135M-Instruct"
    assert reply.usage.completion_tokens == len(reply.model_extra["ocrl"]["completion_token_ids"])
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


async def test_stream_matches_greedy_answer(daemon):
    messages = [{"role": "user", "content": "Name three colours."}]
    async with daemon.client() as client:
        whole = await client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=24)
        stream = await client.chat.completions.create(
            model="m", messages=messages, temperature=0, max_tokens=24, stream=True, stream_options={"include_usage": True}
        )
        pieces, finish, usage = [], None, None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    pieces.append(choice.delta.content)
                finish = choice.finish_reason or finish
    assert len(pieces) >= 3, pieces  # sent as produced, not in one piece at the end
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


async def test_max_tokens_and_stop(daemon):
    async with daemon.client() as client:
        short = await client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=2)
        assert short.choices[0].finish_reason == "length"
        assert short.usage.completion_tokens == 2
        full = await client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=30)
        text = full.choices[0].message.content
        stop = text[text.index("3") :][:2]  # a stop string inside the greedy answer
        stopped = await client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=30, stop=[stop])
    assert stopped.choices[0].message.content == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


async def test_seed_reproduces_a_sample(daemon):
    async with daemon.client() as client:
        kwargs = dict(model="m", messages=[{"role": "user", "content": "Tell me a word."}], temperature=1.0, max_tokens=12, seed=1234)
        a = await client.chat.completions.create(**kwargs)
        b = await client.chat.completions.create(**kwargs)
    assert a.model_extra["ocrl"]["completion_token_ids"] == b.model_extra["ocrl"]["completion_token_ids"]


async def test_eight_concurrent_requests_complete(daemon):
    async with daemon.client() as client:
        results = [None] * 8

        async def ask(i):
            results[i] = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"What is {i}+1?"}], temperature=0, max_tokens=16
            )

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(ask, i)
    assert all(r.choices[0].message.content for r in results)
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in results)


async def test_logprobs_equal_teacher_forced_forward(daemon, embedded):
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    async with daemon.client() as client:
        reply = await client.chat.completions.create(
            model="m", messages=messages, temperature=0.9, max_tokens=20, seed=7, logprobs=True, top_logprobs=3
        )
    ids = reply.model_extra["ocrl"]["completion_token_ids"]
    served = [entry.logprob for entry in reply.choices[0].logprobs.content]
    assert len(served) == len(ids) > 0
    assert all(len(entry.top_logprobs) == 3 for entry in reply.choices[0].logprobs.content)
    prompt = chat.prompt_ids(embedded.tokenizer, [Message(role="user", content=messages[0]["content"])])
    with torch.no_grad():
        logits = embedded.model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    forced = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(torch.tensor(served), forced, atol=1e-3, rtol=0)


async def test_models_and_health(daemon):
    async with daemon.client() as client:
        models = await client.models.list()
        one = await client.models.retrieve("SmolLM2-135M-Instruct")
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.models.retrieve("gpt-unknown")
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
    assert (one.id, one.object, one.owned_by) == ("SmolLM2-135M-Instruct", "model", "ocrl")
    assert unknown.value.body["code"] == "model_not_found" and unknown.value.body["param"] == "model"
    health = httpx.get(daemon.url + "/healthz")  # no key needed
    assert health.status_code == 200 and health.json()["status"] == "ok"


def _post(daemon, body: bytes | str, key: str | None = "default", **headers):
    key = daemon.api_key if key == "default" else key
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    headers.setdefault("Content-Type", "application/json")
    return httpx.post(daemon.url + "/v1/chat/completions", content=body, headers=headers, timeout=120)


def _error(reply, status: int) -> dict:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in reply.text
    return body["error"]


@pytest.mark.parametrize(
    "body, param",
    [
        ('{"messages": [{"role": "user", "content": "hi"}', None),  # malformed JSON
        ('{"messages": "hello"}', "messages"),
        ('{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
        ('{"messages": []}', "messages"),
        ('{"messages": [{"role": "wizard", "content": "hi"}]}', "messages[0].role"),
        ('{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "temperature"),
        ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', "max_tokens"),
        ('{"messages": [{"role": "user", "content": "hi"}], "n": 0}', "n"),
        ('{"messages": [{"role": "user", "content": "hi"}], "n": 17}', "n"),
        ('[1, 2]', None),
    ],
)
def test_bad_request_is_400_naming_the_field(daemon, body, param):
    error = _error(_post(daemon, body), 400)
    assert error["type"] == "invalid_request_error"
    if param:
        assert error["param"] == param


@pytest.mark.parametrize(
    ("headers", "body_field", "turn_type"),
    [
        ({"X-Turn-Type": "Main"}, None, "main"),
        ({"X-Turn-Type": "SIDE"}, None, "side"),
        ({}, " side ", "side"),
        ({}, "Side", "side"),
        ({}, "MAIN", "main"),
    ],
)
def test_turn_type_is_read_in_any_case(daemon, headers, body_field, turn_type):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "session_done": True}
    if body_field is not None:
        body["turn_type"] = body_field
    reply = _post(daemon, json.dumps(body), **headers)
    assert reply.status_code == 200, reply.text
    assert reply.json()["ocrl"]["turn_type"] == turn_type


@pytest.mark.parametrize(("headers", "body_field"), [({"X-Turn-Type": "mian"}, None), ({}, "background")])
def test_an_unknown_turn_type_is_400_naming_the_allowed_values(daemon, headers, body_field):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    if body_field is not None:
        body["turn_type"] = body_field
    error = _error(_post(daemon, json.dumps(body), **headers), 400)
    assert error["param"] == "turn_type" and "'main' or 'side'" in error["message"]


def test_no_max_tokens_may_use_the_rest_of_the_context():
    # OpenAI's API has no 512 cap, and the reference forwards the client's request unchanged
    from types import SimpleNamespace

    import msgspec

    from ocrl.api import Api
    from ocrl.chat_request import ChatRequest
    from ocrl.config import Config

    plain = msgspec.convert({"messages": [{"role": "user", "content": "hi"}]}, ChatRequest)
    api = SimpleNamespace(config=Config())
    assert Api._sampling(api, plain, 5000).max_tokens == 5000
    assert Api._sampling(api, msgspec_replace(plain, max_tokens=7), 5000).max_tokens == 7
    assert Api._sampling(api, msgspec_replace(plain, max_tokens=9000), 5000).max_tokens == 5000  # clamped to the room
    assert Api._sampling(SimpleNamespace(config=Config(default_max_tokens=64)), plain, 5000).max_tokens == 64


def msgspec_replace(struct, **fields):
    import msgspec

    return msgspec.structs.replace(struct, **fields)


def test_prompt_longer_than_context(daemon):
    words = "hello " * 9000  # ~9000 tokens > the 8192 context
    error = _error(_post(daemon, '{"messages": [{"role": "user", "content": "%s"}]}' % words), 400)
    assert error["code"] == "context_length_exceeded"


def test_body_over_limit_is_413(daemon):
    body = '{"messages": [{"role": "user", "content": "%s"}]}' % ("x" * (9 * 1024 * 1024))
    _error(_post(daemon, body), 413)


@pytest.mark.parametrize("key", [None, "wrong-key", "test-key-but-longer"])
def test_bad_or_missing_key_is_401(daemon, key):
    error = _error(_post(daemon, '{"messages": [{"role": "user", "content": "hi"}]}', key=key), 401)
    assert error["type"] == "authentication_error"
    assert _error(httpx.get(daemon.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}), 401)


async def test_server_answers_normally_after_bad_input(daemon):
    for body in (b"{", b'{"messages": []}', b"\xff\xfe", b'{"messages": [{"role": "user"}]}', b'{"messages": [{"role": "user", "content": "\xff"}]}'):
        assert _post(daemon, body).status_code in (400, 413)
    async with daemon.client() as client:
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="m", messages=[])
        reply = await client.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=30)
    assert "5" in reply.choices[0].message.content


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _weather_history(city: str) -> list[dict]:
    """Two earlier tool calls in the conversation: greedy decoding then imitates a third."""
    history = []
    for i, (earlier, weather) in enumerate([("Paris", "sunny, 21C"), ("Rome", "rain, 15C")]):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city": "{earlier}"}}'}}
        history += [
            {"role": "user", "content": f"What is the weather in {earlier}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": f'{{"weather": "{weather}"}}'},
            {"role": "assistant", "content": f"It is {weather} in {earlier}."},
        ]
    return history + [{"role": "user", "content": f"What is the weather in {city}?"}]


async def test_tool_call_comes_back_as_tool_calls(daemon):
    async with daemon.client() as client:
        reply = await client.chat.completions.create(
            model="m", messages=_weather_history("Berlin"), tools=[WEATHER_TOOL], temperature=0, max_tokens=40
        )
        stream = await client.chat.completions.create(
            model="m", messages=_weather_history("Berlin"), tools=[WEATHER_TOOL], temperature=0, max_tokens=40, stream=True
        )
        streamed_calls, streamed_text, finish = [], "", None
        async for chunk in stream:
            for choice in chunk.choices:
                streamed_calls += choice.delta.tool_calls or []
                streamed_text += choice.delta.content or ""
                finish = choice.finish_reason or finish
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Berlin"}
    assert finish == "tool_calls" and streamed_text == ""
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed_calls] == [("get_weather", {"city": "Berlin"})]
