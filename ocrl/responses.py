"""The Responses API (POST /v1/responses, GET /v1/responses/{id}) mapped onto the chat pipeline.

A Responses request is translated into the chat request it means, then served exactly as a chat
completion is: same validation, prompt template, session threading, turn records and judging. So
a Responses client forms sessions, gets next states and yields samples like a chat client.

Translation (request -> chat):
- `instructions` -> a leading system message; `input` as a string -> one user message.
- input items: `message` (roles user/system/developer/assistant; text parts input_text,
  output_text, text) -> that message; `function_call` -> a tool call on the assistant message it
  follows (or a new one); `function_call_output` -> a tool message; `reasoning` items are
  dropped (the model's reasoning is not fed back); anything else (images, files, item
  references, hosted tool calls) is a 400 naming it.
- function tools {type, name, description, parameters} -> chat tools; `tool_choice` and
  `text.format` (json_object / json_schema) -> their chat forms; `max_output_tokens` ->
  max_tokens; `include: ["message.output_text.logprobs"]` (+ `top_logprobs`) -> logprobs.
- `previous_response_id`: the conversation that response ended (its input and its output,
  not its instructions) comes before this input. Responses are kept in a bounded in-memory store
  (the newest STORE_LIMIT; `store: false` keeps none); an unknown id is a 400.

Output: a `reasoning` item when the model thought aloud, a `message` item with one output_text
part when it wrote text, one `function_call` item per tool call. A completion cut at the token
limit is `status: incomplete` (reason max_output_tokens). Streaming sends the event sequence the
openai SDK accumulates: response.created, response.in_progress, output_item.added,
content_part.added, output_text.delta..., output_text.done, content_part.done,
output_item.done, function_call_arguments.delta/.done, then response.completed (or
response.incomplete; response.failed when generation fails after the stream began).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from typing import Annotated, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ocrl import chat
from ocrl.chat_request import decode_request
from ocrl.replies import ApiError, answered, error_response, json_response, stream_error

log = logging.getLogger("ocrl.responses")

STORE_LIMIT = 512
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_encoder = msgspec.json.Encoder()


class ResponsesRequest(msgspec.Struct):
    """Fields of the Responses API that ocrl does not use (metadata, user, reasoning, store
    options, prompt_cache_key, ...) are accepted and ignored."""

    input: str | list[dict[str, Any]]
    model: str = ""
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    include: list[str] | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, Any] | None = None
    session_id: str | None = None
    turn_type: str | None = None  # main | side, any case (checked by the chat path)
    session_done: bool | None = None


_decoder = msgspec.json.Decoder(ResponsesRequest)


def _text(content, where: str) -> str:
    """Message content (a string or a list of text parts) as plain text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of parts", param=f"{where}.content")
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        else:
            raise ApiError(400, f"unsupported content part {kind!r} at {where}.content[{i}]: only text parts", param=f"{where}.content")
    return "".join(out)


def to_messages(items: list[dict[str, Any]]) -> list[dict]:
    """Responses input items -> chat messages (see the module docstring for the rules)."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ApiError(400, f"{where}.role must be user, system, developer or assistant, not {role!r}", param=f"{where}.role")
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            name, arguments = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(arguments, str):
                raise ApiError(400, f"{where}: a function_call needs a string name and string arguments", param=where)
            call = {"id": str(item.get("call_id") or item.get("id") or ""), "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # calls made in the same turn as its text
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, where)
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""), "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise ApiError(400, f"unsupported input item type {kind!r} at {where}", param=where)
    return messages


def to_chat_tools(tools: list[dict[str, Any]]) -> list[dict]:
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ApiError(400, f"unsupported tool {kind!r} at tools[{i}]: only function tools", param=f"tools[{i}]")
        function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def to_chat_tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def to_response_format(text: dict[str, Any] | None) -> dict | None:
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt["type"]}


class Responses:
    """The two routes, over the shared chat pipeline (pipeline.py) and a bounded store of finished responses."""

    def __init__(self, api):
        self.api = api
        self.store: OrderedDict[str, tuple[list[dict], dict]] = OrderedDict()  # id -> (conversation, response)

    async def create(self, http: Request) -> Response:
        return await answered("response", self._create, http)

    async def retrieve(self, http: Request) -> Response:
        kept = self.store.get(http.path_params["response_id"])
        if kept is None:
            return error_response(ApiError(404, f"no response with id {http.path_params['response_id']!r}", code="not_found"))
        return json_response(kept[1])

    async def _create(self, http: Request) -> Response:
        # 1. receive: the Responses request, translated into the chat request it means
        raw = await self.api._read_body(http)
        self.api.refuse_hopeless_body(len(raw), "input")  # before decoding (see there)
        try:
            body = await self.api.decode(_decoder.decode, raw)
        except msgspec.ValidationError as e:
            raise ApiError(400, f"invalid request: {e}") from None
        except msgspec.DecodeError as e:
            raise ApiError(400, f"malformed JSON body: {e}") from None
        earlier: list[dict] = []
        if body.previous_response_id:
            kept = self.store.get(body.previous_response_id)
            if kept is None:
                raise ApiError(400, f"previous response {body.previous_response_id!r} not found", param="previous_response_id", code="previous_response_not_found")
            earlier = kept[0]
        items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else to_messages(body.input)
        conversation = earlier + items
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        logprobs = LOGPROBS_INCLUDE in (body.include or [])
        chat_body = {
            "messages": system + conversation, "model": body.model, "max_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "logprobs": logprobs,
            "top_logprobs": body.top_logprobs if logprobs else None,
            "tools": to_chat_tools(body.tools) if body.tools else None, "tool_choice": to_chat_tool_choice(body.tool_choice),
            "response_format": to_response_format(body.text),
            "session_id": body.session_id, "turn_type": body.turn_type, "session_done": body.session_done,
        }  # fmt: skip
        request = await self.api.decode(decode_request, _encoder.encode({k: v for k, v in chat_body.items() if v is not None}))
        prepared = await self.api.prepare(request, http)
        shape = _Shape(self.api, body, request, prepared)
        headers = {"X-Session-Id": prepared.ticket.session_id}
        if body.stream:
            return StreamingResponse(self._sse(shape, prepared, conversation), media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"})
        # 2. generate  3. keep the turn
        completions = await self.api.generate_while_connected(prepared, http)
        if completions is None:
            return Response(status_code=499)  # the client left: generation stopped, no turn kept
        [completion] = completions
        [turn] = self.api.keep(prepared, [completion])
        response = shape.final(completion, turn)
        self._keep(body, conversation, shape, response)
        return json_response(response, headers=headers)

    def _keep(self, body: ResponsesRequest, conversation: list[dict], shape: "_Shape", response: dict) -> None:
        if not body.store:
            return
        self.store[response["id"]] = (conversation + [shape.reply_message], response)
        while len(self.store) > STORE_LIMIT:
            self.store.popitem(last=False)

    async def _sse(self, shape: "_Shape", prepared, conversation: list[dict]):
        api = self.api
        sequence = 0

        def event(kind: str, **fields) -> bytes:
            nonlocal sequence
            sequence += 1
            payload = {"type": kind, "sequence_number": sequence - 1, **fields}
            return b"event: " + kind.encode() + b"\ndata: " + _encoder.encode(payload) + b"\n\n"

        yield event("response.created", response=shape.envelope("in_progress"))
        yield event("response.in_progress", response=shape.envelope("in_progress"))
        tools_offered = prepared.tools is not None
        message_id, streamed = "msg_" + uuid.uuid4().hex, None  # None: the message item is not open yet
        reasoning_sent = False
        async with api.streaming(prepared) as run:
            choice = run.choices[0]
            async for _ in run:
                reasoning, visible = split_reasoning(choice.text)
                if visible is None:
                    continue  # inside a <think> block: it becomes its own item once closed
                if reasoning and not reasoning_sent:
                    reasoning_sent = True
                    item = shape.reasoning_item(reasoning)
                    yield event("response.output_item.added", output_index=0, item=item)
                    yield event("response.output_item.done", output_index=0, item=item)
                # text streams as it comes, up to where a tool call may begin
                safe = chat.streamable(visible, tools_offered)
                if streamed is None and visible[:safe].strip():
                    streamed = ""
                    index = int(reasoning_sent)
                    yield event("response.output_item.added", output_index=index, item=shape.message_item(message_id, "", "in_progress", None))
                    yield event("response.content_part.added", item_id=message_id, output_index=index, content_index=0, part=shape.text_part("", None))
                if streamed is not None and safe > len(streamed):
                    delta = visible[len(streamed) : safe]
                    streamed += delta
                    yield event("response.output_text.delta", item_id=message_id, output_index=int(reasoning_sent), content_index=0, delta=delta, logprobs=[])
        if run.failure is not None:
            stream_error(prepared.scope, run.failure)
            failed = shape.envelope("failed")
            failed["error"] = {"code": "server_error", "message": str(run.failure) or "generation timed out"}
            yield event("response.failed", response=failed)
            return
        [completion] = run.completions
        try:
            [turn] = api.keep(prepared, [completion])
        except ApiError as e:  # the text went out, but the turn cannot be kept (a full disk): say so
            stream_error(prepared.scope, e)
            failed = shape.envelope("failed")
            failed["error"] = {"code": e.code or e.type, "message": e.message}
            yield event("response.failed", response=failed)
            return
        response = shape.final(completion, turn, message_id=message_id)
        for index, item in enumerate(response["output"]):
            if item["type"] == "reasoning":
                if reasoning_sent:
                    continue
                yield event("response.output_item.added", output_index=index, item=item)
            elif item["type"] == "message":
                part = item["content"][0]
                if streamed is None:
                    streamed = ""
                    yield event("response.output_item.added", output_index=index, item=shape.message_item(message_id, "", "in_progress", None))
                    yield event("response.content_part.added", item_id=message_id, output_index=index, content_index=0, part=shape.text_part("", None))
                rest = part["text"][len(streamed) :] if part["text"].startswith(streamed) else ""
                if rest:
                    yield event("response.output_text.delta", item_id=message_id, output_index=index, content_index=0, delta=rest, logprobs=[])
                yield event("response.output_text.done", item_id=message_id, output_index=index, content_index=0, text=part["text"], logprobs=[])
                yield event("response.content_part.done", item_id=message_id, output_index=index, content_index=0, part=part)
            elif item["type"] == "function_call":
                yield event("response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"})
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index, name=item["name"], arguments=item["arguments"])
            yield event("response.output_item.done", output_index=index, item=item)
        self._keep(shape.body, conversation, shape, response)
        yield event("response.completed" if response["status"] == "completed" else "response.incomplete", response=response)


def split_reasoning(text: str) -> tuple[str | None, str | None]:
    """(reasoning, the text after it) as far as generated: (None, text) without a <think> block,
    (None, None) while one is still open."""
    if not text.lstrip().startswith("<think>"):
        return None, text if not "<think>".startswith(text.lstrip()) or not text.strip() else None
    match = chat.THINK.match(text)
    if match is None:
        return None, None
    return match.group(1).strip() or None, text[match.end() :]


class _Shape:
    """Builds the response object of one request, in its stages."""

    def __init__(self, api, body: ResponsesRequest, request, prepared):
        self.api, self.body, self.request, self.prepared = api, body, request, prepared
        self.id = "resp_" + uuid.uuid4().hex
        self.created = time.time()
        self.reply_message: dict = {"role": "assistant", "content": ""}

    def envelope(self, status: str) -> dict:
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": None, "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": self.api.served_name, "output": [], "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id, "temperature": body.temperature, "top_p": body.top_p,
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "text": body.text or {"format": {"type": "text"}},
            "metadata": body.metadata or {}, "store": body.store, "usage": None,
        }  # fmt: skip

    @staticmethod
    def reasoning_item(reasoning: str) -> dict:
        return {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [], "content": [{"type": "reasoning_text", "text": reasoning}], "status": "completed"}

    def text_part(self, text: str, logprobs: list | None) -> dict:
        part = {"type": "output_text", "text": text, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        return part

    def message_item(self, item_id: str, text: str, status: str, logprobs: list | None) -> dict:
        content = [self.text_part(text, logprobs)] if status != "in_progress" else []
        return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}

    def final(self, completion, turn, message_id: str | None = None) -> dict:
        tools_offered = self.prepared.tools is not None
        content, tool_calls, reasoning = chat.parse_completion(completion.text, tools_offered)
        incomplete = completion.finish_reason == "length"
        output: list[dict] = []
        if reasoning:
            output.append(self.reasoning_item(reasoning))
        if content or not tool_calls:
            logprobs = None
            if self.request.logprobs:
                logprobs = self.api._logprobs(completion.response_ids, completion.logprobs, completion.top_logprobs)
            status = "incomplete" if incomplete else "completed"
            output.append(self.message_item(message_id or "msg_" + uuid.uuid4().hex, content or "", status, logprobs))
        for call in tool_calls:
            fn = call["function"]
            output.append({"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call["id"], "name": fn["name"], "arguments": fn["arguments"], "status": "completed"})
        self.reply_message = {"role": "assistant", "content": content}
        if tool_calls:
            self.reply_message["tool_calls"] = tool_calls
        prompt, generated = len(completion.prompt_ids), len(completion.response_ids)
        response = self.envelope("incomplete" if incomplete else "completed")
        response.update(
            output=output,
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            usage={
                "input_tokens": prompt, "input_tokens_details": {"cached_tokens": completion.cached_tokens},
                "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + generated,
            },  # fmt: skip
            ocrl=self.api._ocrl_fields(turn, completion),
        )
        return response
