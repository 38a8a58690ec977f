"""Structured output end to end: the real `openai` SDK against the real daemon and the embedded
model. `.parse()` with a pydantic schema, forced tool calls whose arguments validate, refusals
by name that record nothing, and no lone replacement character at the token limit."""

from __future__ import annotations

import json

import openai
import pydantic
import pytest

from tests.test_api import WEATHER_TOOL


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    is_capital: bool  # (an unbounded integer here, greedy, runs on as 1111... to the token limit)


class WeatherArgs(pydantic.BaseModel):
    city: str


class TimeArgs(pydantic.BaseModel):
    zone: str = pydantic.Field(json_schema_extra={"enum": ["UTC", "CET", "PST"]})


TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"]},
    },
}


async def test_parse_with_a_pydantic_schema(daemon):
    async with daemon.client() as client:
        reply = await client.chat.completions.parse(
            model="m",
            messages=[{"role": "user", "content": "Name a big city in France."}],
            response_format=City,
            temperature=0,
            max_tokens=60,
        )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed
    # the recorded tokens are the constrained ones: they spell exactly the JSON that was served
    ids = reply.model_extra["ocrl"]["completion_token_ids"]
    assert reply.usage.completion_tokens == len(ids)


async def test_json_object_mode_answers_a_json_object_streaming_and_not(daemon):
    messages = [{"role": "user", "content": "Describe a cat."}]
    async with daemon.client() as client:
        reply = await client.chat.completions.create(
            model="m", messages=messages, response_format={"type": "json_object"}, temperature=0, max_tokens=60
        )
        stream = await client.chat.completions.create(
            model="m", messages=messages, response_format={"type": "json_object"}, temperature=0, max_tokens=60, stream=True
        )
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    assert streamed == reply.choices[0].message.content


async def test_required_tool_choice_returns_a_call_that_validates(daemon):
    # No earlier tool calls to imitate: unforced, the small model answers in prose.
    messages = [{"role": "user", "content": "Is it raining in Lisbon right now?"}]
    async with daemon.client() as client:
        reply = await client.chat.completions.create(
            model="m", messages=messages, tools=[WEATHER_TOOL], tool_choice="required", temperature=0, max_tokens=60
        )
        stream = await client.chat.completions.create(
            model="m", messages=messages, tools=[WEATHER_TOOL], tool_choice="required", temperature=0, max_tokens=60, stream=True
        )
        streamed_calls, streamed_text, finish = [], "", None
        async for chunk in stream:
            for choice in chunk.choices:
                streamed_calls += choice.delta.tool_calls or []
                streamed_text += choice.delta.content or ""
                finish = choice.finish_reason or finish
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    WeatherArgs.model_validate_json(call.function.arguments)
    assert finish == "tool_calls" and streamed_text == ""
    assert [(c.function.name, c.function.arguments) for c in streamed_calls] == [(call.function.name, call.function.arguments)]


async def test_named_tool_choice_calls_that_function(daemon):
    messages = [{"role": "user", "content": "What time is it in Berlin?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    async with daemon.client() as client:
        reply = await client.chat.completions.create(
            model="m", messages=messages, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=named, temperature=0, max_tokens=60
        )
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert TimeArgs.model_validate_json(call.function.arguments).zone in ("UTC", "CET", "PST")


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object", "properties": {"n": {"type": "number", "maximum": 1}}}}}}, "`maximum` at $.properties.n"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "'launch'"),
    ],
)
async def test_what_cannot_be_enforced_is_a_400_that_records_nothing(daemon, extra, named):
    before = daemon.stats()["sessions"]
    async with daemon.client() as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Count to three."}], max_tokens=5, **extra)
    error = refused.value.body
    assert named in error["message"] and error["type"] == "invalid_request_error" and error["code"] == "unsupported_constraint"
    assert daemon.stats()["sessions"] == before


async def test_a_character_cut_by_the_token_limit_is_not_emitted(daemon):
    # Greedy, this model starts its answer with the first byte tokens of a 4-byte emoji.
    messages = [{"role": "user", "content": "Reply with just one emoji."}]
    async with daemon.client() as client:
        cut = await client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=1)
        stream = await client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=1, stream=True)
        streamed = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content is not None]
        whole = await client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=3)
    assert cut.choices[0].finish_reason == "length"
    assert cut.usage.completion_tokens == 1  # the token was sampled and is kept for training...
    assert cut.choices[0].message.content == ""  # ...but its partial character is not text
    assert "\ufffd" not in "".join(streamed)
    assert whole.choices[0].message.content and "\ufffd" not in whole.choices[0].message.content


async def test_tool_choice_none_answers_plain_text_without_the_tools(daemon):
    # OpenAI's "none": the model does not call tools. The tools are not offered to the model
    # (the prompt is the one without them) and nothing in the reply is parsed as a call.
    messages = [{"role": "user", "content": "Is it raining in Lisbon right now?"}]
    async with daemon.client() as client:
        bare = await client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=20)
        offered = await client.chat.completions.create(
            model="m", messages=messages, tools=[WEATHER_TOOL], temperature=0, max_tokens=20
        )
        none = await client.chat.completions.create(
            model="m", messages=messages, tools=[WEATHER_TOOL], tool_choice="none", temperature=0, max_tokens=20
        )
    assert offered.usage.prompt_tokens > bare.usage.prompt_tokens  # the tools are in an "auto" prompt
    assert none.usage.prompt_tokens == bare.usage.prompt_tokens
    choice = none.choices[0]
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
