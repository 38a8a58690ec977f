"""Chat messages <-> token ids: the model's chat template on the way in, tool calls and
reasoning parsed out of the completion text on the way out.

Tool calls follow the Qwen/Hermes convention: the model writes `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`. When a model's own template knows nothing of tools (SmolLM2's
does not), the tool list is given in the system message and earlier tool calls are rendered in
that same convention, so every model sees one consistent format. This module knows nothing of
HTTP or of the engine.
"""

from __future__ import annotations

import json
import re
import uuid

from ocrl.types import Message

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.S)

TOOLS_PREAMBLE = (
    "You can call functions. The available tools, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call one, reply with <tool_call>{{\"name\": <function-name>, \"arguments\": <args-json-object>}}"
    "</tool_call>, one block per call."
)


def text_of(content) -> str | None:
    """OpenAI content is a string, a list of parts ({"type": "text", "text": ...}), or null."""
    if content is None or isinstance(content, str):
        return content
    return "".join(part.get("text") or "" for part in content if part.get("type") == "text")


def normalise(messages: list[dict]) -> list[Message]:
    """developer -> system, content parts -> text. Roles were validated by the API."""
    out = []
    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        out.append(
            Message(
                role=role,
                content=text_of(m.get("content")),
                tool_calls=m.get("tool_calls") or None,
                tool_call_id=m.get("tool_call_id"),
                name=m.get("name"),
            )
        )
    return out


def _template_knows_tools(tokenizer) -> bool:
    template = tokenizer.chat_template or ""
    return "tools" in template and "tool_call" in template


def _render_tool_calls(calls: list[dict]) -> str:
    blocks = []
    for call in calls:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass
        blocks.append("<tool_call>" + json.dumps({"name": fn.get("name"), "arguments": args}) + "</tool_call>")
    return "\n".join(blocks)


def template_messages(messages: list[Message], tools: list[dict] | None, native_tools: bool) -> list[dict]:
    """Messages as plain dicts the template can render."""
    rendered = []
    for m in messages:
        d: dict = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            if native_tools:
                d["tool_calls"] = m.tool_calls
            else:
                d["content"] = (d["content"] + "\n" if d["content"] else "") + _render_tool_calls(m.tool_calls)
        if m.role == "tool" and m.tool_call_id and native_tools:
            d["tool_call_id"] = m.tool_call_id
        rendered.append(d)
    if tools and not native_tools:
        preamble = TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t) for t in tools))
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": rendered[0]["content"] + "\n\n" + preamble}
        else:
            rendered.insert(0, {"role": "system", "content": preamble})
    return rendered


def prompt_ids(tokenizer, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
    native = _template_knows_tools(tokenizer)
    rendered = template_messages(messages, tools, native)
    kwargs = {"tools": tools} if (tools and native) else {}
    ids = tokenizer.apply_chat_template(
        rendered, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
    )
    return list(ids)


HINT_LABEL = "Hint (learned in hindsight)"


def with_hints(messages: list[Message], hints: list[str], placement: str = "user") -> list[Message]:
    """The teacher's messages: the turn's messages with hints added, either appended to the last
    user message ("user") or as a system note after it ("system"). A prompt without a user
    message gets the system note."""
    if not hints:
        return list(messages)
    body = hints[0] if len(hints) == 1 else "\n".join(f"- {hint}" for hint in hints)
    note = f"[{HINT_LABEL}]\n{body}"
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=None)
    out = list(messages)
    if placement == "user" and last_user is not None:
        message = out[last_user]
        out[last_user] = Message(role="user", content=f"{message.content or ''}\n\n{note}", name=message.name)
    else:
        at = last_user + 1 if last_user is not None else len(out)
        out.insert(at, Message(role="system", content=note))
    return out


def parse_completion(text: str, tools_offered: bool) -> tuple[str | None, list[dict], str | None]:
    """Completion text -> (content, tool_calls, reasoning). Unparseable tool blocks stay content."""
    reasoning = None
    match = THINK.match(text)
    if match:
        reasoning, text = match.group(1).strip(), text[match.end():]
    calls = []
    if tools_offered and "<tool_call>" in text:
        for block in TOOL_CALL.findall(text):
            try:
                call = json.loads(block)
            except json.JSONDecodeError:
                continue
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                continue
            args = call.get("arguments", call.get("parameters", {}))
            calls.append(
                {
                    "id": "call_" + uuid.uuid4().hex[:24],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": json.dumps(args)},
                }
            )
        if calls:
            text = text[: text.index("<tool_call>")].strip()
    return (text or None) if calls else text, calls, reasoning


def streamable(text: str, tools_offered: bool) -> int:
    """How much of a completion still being generated may go out as content: with tools offered,
    everything before a `<tool_call>` block, or before a tail that may be the start of one."""
    if not tools_offered:
        return len(text)
    at = text.find("<tool_call>")
    if at >= 0:
        return at
    marker = "<tool_call>"
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return len(text) - n
    return len(text)
