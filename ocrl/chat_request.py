"""The chat completions request as it arrives: its msgspec Structs, decoded and validated in one
step (`decode_request`), and the field checks every generating route shares (`check_fields`).

Decoding with the type is the validation: a field of the wrong type or out of range is a 400
that names it (`param`). Fields OpenAI defines and ocrl does not use are ignored. Knows JSON and
guard.py's limits; nothing of prompts, engines or sessions.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from ocrl import guard
from ocrl.replies import ApiError

Role = Literal["system", "developer", "user", "assistant", "tool"]


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ToolFunction(msgspec.Struct):
    name: str
    arguments: str = "{}"


class ToolCall(msgspec.Struct):
    function: ToolFunction
    id: str = ""
    type: str = "function"


class ChatMessage(msgspec.Struct):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ChatRequest(msgspec.Struct):
    """Fields OpenAI defines and ocrl does not use (user, penalties, ...) are ignored."""

    messages: list[ChatMessage]
    model: str = ""
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, msgspec.Meta(ge=guard.SEED_RANGE[0], le=guard.SEED_RANGE[1])] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1  # several samples of one prompt: a group (sessions.py)
    session_id: str | None = None
    turn_type: str | None = None  # main | side, any case; checked with the header
    session_done: bool | None = None


_request_decoder = msgspec.json.Decoder(ChatRequest)
_AT = re.compile(r" - at `\$\.?([^`]*)`")


def decode_request(body: bytes) -> ChatRequest:
    try:
        request = _request_decoder.decode(body)
    except msgspec.ValidationError as e:
        text = str(e)
        match = _AT.search(text)
        raise ApiError(400, f"invalid request: {text}", param=match.group(1) if match else None) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None
    except RecursionError:
        raise ApiError(400, f"the JSON body nests too deep (at most {guard.MAX_NESTING} levels in tools / tool_choice)", code="nested_too_deep") from None
    if not request.messages:
        raise ApiError(400, "`messages` must contain at least one message", param="messages")
    check_fields(request.session_id, {"tools": request.tools, "tool_choice": request.tool_choice})
    for i, message in enumerate(request.messages):
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            raise ApiError(400, f"messages[{i}] ({message.role}) needs `content`", param=f"messages[{i}].content")
        for part in message.content if isinstance(message.content, list) else ():
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"unsupported content part of type {part.type!r}: only text parts", param=f"messages[{i}].content")
    return request


def check_fields(session_id: str | None, nested: dict[str, Any]) -> None:
    """The field checks every generating route shares (guard.py): a session id that can go back
    in a header and into the records; JSON objects that do not nest absurdly deep."""
    if session_id is not None and (problem := guard.session_id_problem(session_id)):
        raise ApiError(400, f"invalid session id: {problem}", param="session_id")
    for name, value in nested.items():
        if value is not None and (problem := guard.nesting_problem(value)):
            raise ApiError(400, f"`{name}` is {problem}", param=name, code="nested_too_deep")


def header_bool(value: str | None) -> bool | None:
    if value is None:
        return None
    return value.strip().lower() in ("1", "true", "yes", "on")
