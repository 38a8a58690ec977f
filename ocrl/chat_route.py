"""POST /v1/chat/completions: the chat request decoded (chat_request.py), served through the
shared pipeline (pipeline.py), and answered as OpenAI's chat.completion, or as its SSE stream of
chat.completion.chunk events (content as it comes, up to where a tool call may begin; tool calls,
the finish and the ocrl fields once the turn is kept).

Knows the chat answer's shape; the steps behind it (prompt, generation, sessions) are the
pipeline's.
"""

from __future__ import annotations

import time
import uuid

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ocrl import chat
from ocrl.chat_request import ChatRequest, decode_request
from ocrl.pipeline import Pipeline, Prepared
from ocrl.replies import ApiError, answered, json_response, stream_error
from ocrl.types import Completion

_encoder = msgspec.json.Encoder()


class ChatCompletions:
    def __init__(self, api: Pipeline):
        self.api = api

    async def create(self, request: Request) -> Response:
        return await answered("chat completion", self._create, request)

    async def _create(self, http: Request) -> Response:
        api = self.api
        raw = await api._read_body(http)
        api.refuse_hopeless_body(len(raw))
        body = await api.decode(decode_request, raw)
        prepared = await api.prepare(body, http)
        if body.stream:
            return StreamingResponse(
                self._sse(body, prepared), media_type="text/event-stream",
                headers={"X-Session-Id": prepared.ticket.session_id, "Cache-Control": "no-cache"},
            )
        completions = await api.generate_while_connected(prepared, http)
        if completions is None:
            return Response(status_code=499)  # nobody is listening; the turn was dropped
        turns = api.keep(prepared, completions)
        return json_response(self._response(body, completions, turns, prepared.tools is not None), headers={"X-Session-Id": prepared.ticket.session_id})

    def _response(self, body: ChatRequest, completions: list[Completion], turns: list, tools_offered: bool) -> dict:
        choices = []
        for k, completion in enumerate(completions):
            content, tool_calls, reasoning = chat.parse_completion(completion.text, tools_offered)
            message: dict = {"role": "assistant", "content": content}
            if tool_calls:
                message["tool_calls"] = tool_calls
            if reasoning:
                message["reasoning_content"] = reasoning
            finish = "tool_calls" if tool_calls else completion.finish_reason
            choice = {"index": k, "message": message, "finish_reason": finish, "logprobs": None}
            if body.logprobs:
                choice["logprobs"] = {"content": self.api._logprobs(completion.response_ids, completion.logprobs, completion.top_logprobs)}
            if len(completions) > 1:
                choice["ocrl"] = self.api._ocrl_fields(turns[k], completion)
            choices.append(choice)
        return {
            "id": "chatcmpl-" + uuid.uuid4().hex,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.api.served_name,
            "choices": choices,
            "usage": self.api._usage(completions),
            "ocrl": self.api._ocrl_fields(turns[0], completions[0]),
        }

    async def _sse(self, body: ChatRequest, prepared: Prepared):
        api = self.api
        cid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
        tools_offered = prepared.tools is not None

        def event(k: int, delta: dict, finish=None, logprobs=None, **extra) -> bytes:
            choice = {"index": k, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            chunk = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": api.served_name, "choices": [choice], **extra}
            return b"data: " + _encoder.encode(chunk) + b"\n\n"

        for k in range(len(prepared.params)):
            yield event(k, {"role": "assistant", "content": ""})
        async with api.streaming(prepared) as run:
            async for k, chunk in run:
                choice = run.choices[k]
                so_far = choice.text
                # With tools offered, content stops where a <tool_call> block may begin.
                safe = chat.streamable(so_far, tools_offered)
                logprobs = {"content": api._logprobs(chunk.token_ids, chunk.logprobs, chunk.top_logprobs)} if body.logprobs and chunk.token_ids else None
                if safe > choice.sent or logprobs:
                    yield event(k, {"content": so_far[choice.sent : max(safe, choice.sent)]}, logprobs=logprobs)
                choice.sent = max(choice.sent, safe)
        if run.failure is not None:
            yield stream_error(prepared.scope, run.failure)
            yield b"data: [DONE]\n\n"
            return
        choices, completions = run.choices, run.completions
        try:
            turns = api.keep(prepared, completions)
        except ApiError as e:  # the text went out, but the turn is not kept (a full disk): say so
            yield stream_error(prepared.scope, e)
            yield b"data: [DONE]\n\n"
            return
        for k, (choice, completion) in enumerate(zip(choices, completions)):
            content, tool_calls, _ = chat.parse_completion(completion.text, tools_offered)
            finish = completion.finish_reason
            if tool_calls:
                finish = "tool_calls"
                deltas = [{"index": i, **call} for i, call in enumerate(tool_calls)]
                yield event(k, {"tool_calls": deltas})
            elif choice.sent < len(completion.text):
                yield event(k, {"content": completion.text[choice.sent :]})
            yield event(k, {}, finish=finish, ocrl=api._ocrl_fields(turns[k], completion))
        if body.stream_options and body.stream_options.include_usage:
            usage = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": api.served_name, "choices": [], "usage": api._usage(completions)}
            yield b"data: " + _encoder.encode(usage) + b"\n\n"
        yield b"data: [DONE]\n\n"

