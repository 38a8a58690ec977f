"""chat.py: rendering messages with the template, parsing tool calls and reasoning."""

from __future__ import annotations

import json

import pytest

from ocrl import chat
from ocrl.types import Message

TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def test_content_parts_and_developer_role_are_normalised():
    messages = chat.normalise(
        [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
        ]
    )
    assert messages == [Message(role="system", content="Be brief."), Message(role="user", content="Hello there")]


def test_tools_go_to_the_system_message_when_the_template_has_none():
    rendered = chat.template_messages([Message(role="system", content="Be brief."), Message(role="user", content="2+2?")], [TOOL], native_tools=False)
    assert rendered[0]["role"] == "system"
    assert rendered[0]["content"].startswith("Be brief.\n\n")
    assert json.dumps(TOOL) in rendered[0]["content"]
    rendered = chat.template_messages([Message(role="user", content="2+2?")], [TOOL], native_tools=False)
    assert rendered[0]["role"] == "system" and rendered[1] == {"role": "user", "content": "2+2?"}


def test_earlier_tool_calls_render_in_the_tool_call_convention():
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    rendered = chat.template_messages([Message(role="assistant", content=None, tool_calls=[call])], None, native_tools=False)
    assert rendered == [{"role": "assistant", "content": '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'}]


def test_parse_tool_calls_from_the_exact_template_text():
    text = 'Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n<tool_call>{"name": "neg", "arguments": {"x": 3}}</tool_call>'
    content, calls, reasoning = chat.parse_completion(text, tools_offered=True)
    assert content == "Let me add."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("add", {"a": 1, "b": 2}), ("neg", {"x": 3})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert reasoning is None


@pytest.mark.parametrize(
    "text",
    ['<tool_call>{"name": "add", "arguments": </tool_call>', '<tool_call>["add"]</tool_call>', "plain answer"],
)
def test_unparseable_tool_blocks_stay_content(text):
    content, calls, _ = chat.parse_completion(text, tools_offered=True)
    assert calls == [] and content == text


def test_tool_blocks_are_content_when_no_tools_were_offered():
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    assert chat.parse_completion(text, tools_offered=False) == (text, [], None)


def test_reasoning_is_split_from_content():
    content, calls, reasoning = chat.parse_completion("<think>2 and 3 make 5</think>\nIt is 5.", tools_offered=False)
    assert (content, calls, reasoning) == ("It is 5.", [], "2 and 3 make 5")
