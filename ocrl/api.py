"""The OpenAI-compatible HTTP surface: /v1/chat/completions (+SSE), /v1/models, /healthz and
/v1/ocrl/*.

Requests are decoded into msgspec Structs (decoding is the validation); every failure answers in
OpenAI's error shape and changes nothing else. The API turns messages into prompt ids (chat.py),
asks the engine for tokens, and hands each finished main or side turn to the sessions; it never
judges or trains. Session fields (X-Session-Id / X-Turn-Type / X-Session-Done headers or
session_id / turn_type / session_done body fields) are taken off the request before generation.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
import uuid
from typing import Annotated, Any, Literal

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ocrl import chat
from ocrl.engine.base import EngineBusy, EngineError, Final
from ocrl.types import Completion, SamplingParams, TokenChunk

log = logging.getLogger("ocrl.api")

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
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    n: int = 1
    session_id: str | None = None
    turn_type: Literal["main", "side"] | None = None
    session_done: bool | None = None


class Detokenize(msgspec.Struct):
    ids: list[list[Annotated[int, msgspec.Meta(ge=0, lt=2**31)]]]


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


_encoder = msgspec.json.Encoder()
_request_decoder = msgspec.json.Decoder(ChatRequest)
_AT = re.compile(r" - at `\$\.?([^`]*)`")


def error_response(e: ApiError) -> Response:
    body = {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}
    return Response(_encoder.encode(body), status_code=e.status, media_type="application/json", headers=e.headers)


def json_response(body: Any, headers: dict | None = None) -> Response:
    return Response(_encoder.encode(body), media_type="application/json", headers=headers)


def decode_request(body: bytes) -> ChatRequest:
    try:
        request = _request_decoder.decode(body)
    except msgspec.ValidationError as e:
        text = str(e)
        match = _AT.search(text)
        raise ApiError(400, f"invalid request: {text}", param=match.group(1) if match else None) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None
    if not request.messages:
        raise ApiError(400, "`messages` must contain at least one message", param="messages")
    if request.n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    for i, message in enumerate(request.messages):
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            raise ApiError(400, f"messages[{i}] ({message.role}) needs `content`", param=f"messages[{i}].content")
        for part in message.content if isinstance(message.content, list) else ():
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"unsupported content part of type {part.type!r}: only text parts", param=f"messages[{i}].content")
    return request


def _header_bool(value: str | None) -> bool | None:
    if value is None:
        return None
    return value.strip().lower() in ("1", "true", "yes", "on")


class Api:
    """Builds the Starlette app around an engine, a tokenizer and the sessions."""

    def __init__(self, config, engine, tokenizer, sessions, *, stats=None, events=None, control=None):
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self.sessions = sessions
        self.stats = stats or (lambda: {})
        self.events = events
        self.control = control  # pause_training(), resume_training(), async save_checkpoint()
        self.served_name = config.served_model_name or engine.name
        self.started = time.time()
        self.in_flight = 0
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/healthz", self.healthz, methods=["GET"]),
                Route("/v1/ocrl/stats", self.ocrl_stats, methods=["GET"]),
                Route("/v1/ocrl/events", self.ocrl_events, methods=["GET"]),
                Route("/v1/ocrl/train/pause", self.ocrl_pause, methods=["POST"]),
                Route("/v1/ocrl/train/resume", self.ocrl_resume, methods=["POST"]),
                Route("/v1/ocrl/checkpoint", self.ocrl_checkpoint, methods=["POST"]),
                Route("/v1/ocrl/detokenize", self.ocrl_detokenize, methods=["POST"]),
            ],
            exception_handlers={404: self._not_found, 405: self._not_allowed},
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.config.api_key and scope["path"] != "/healthz":
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.config.api_key.encode()):
                error = ApiError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _not_found(self, request: Request, exc) -> Response:
        return error_response(ApiError(404, f"no route {request.url.path}", code="not_found"))

    async def _not_allowed(self, request: Request, exc) -> Response:
        return error_response(ApiError(405, f"{request.method} not allowed on {request.url.path}"))

    # -- routes -----------------------------------------------------------------------------

    async def healthz(self, request: Request) -> Response:
        return json_response({"status": "ok", "model": self.served_name, "weights_version": self.engine.weights_version})

    async def models(self, request: Request) -> Response:
        model = {"id": self.served_name, "object": "model", "created": int(self.started), "owned_by": "ocrl"}
        return json_response({"object": "list", "data": [model]})

    async def ocrl_stats(self, request: Request) -> Response:
        return json_response(self.stats())

    async def ocrl_events(self, request: Request) -> Response:
        """Server-sent events: every daemon Event, msgspec JSON, recent history first."""
        if self.events is None:
            return error_response(ApiError(404, "no event stream in this process", code="not_found"))

        async def stream():
            with self.events.subscribe(replay=True) as subscription:
                yield b": ocrl events\n\n"
                while True:
                    with anyio.move_on_after(15) as idle:
                        event = await subscription.get()
                    if idle.cancelled_caught:
                        yield b": keep-alive\n\n"
                        continue
                    yield b"data: " + _encoder.encode(event) + b"\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def ocrl_detokenize(self, request: Request) -> Response:
        """Token ids -> text, for the dashboard's sample view when attached remotely."""
        try:
            body = msgspec.json.decode(await self._read_body(request), type=Detokenize)
            texts = self.tokenizer.batch_decode(body.ids, skip_special_tokens=False)
        except ApiError as e:
            return error_response(e)
        except (msgspec.DecodeError, ValueError, TypeError, OverflowError) as e:
            return error_response(ApiError(400, f"invalid request: {e}", param="ids"))
        return json_response({"texts": texts})

    def _training_control(self):
        if self.control is None or not self.control.training:
            raise ApiError(409, "training is off in this daemon (--no-train)", code="training_disabled")
        return self.control

    async def ocrl_pause(self, request: Request) -> Response:
        try:
            self._training_control().pause_training()
        except ApiError as e:
            return error_response(e)
        return json_response({"paused": True})

    async def ocrl_resume(self, request: Request) -> Response:
        try:
            self._training_control().resume_training()
        except ApiError as e:
            return error_response(e)
        return json_response({"paused": False})

    async def ocrl_checkpoint(self, request: Request) -> Response:
        try:
            path = await self._training_control().save_checkpoint()
        except ApiError as e:
            return error_response(e)
        return json_response({"checkpoint": str(path) if path else None})

    async def chat_completions(self, request: Request) -> Response:
        try:
            return await self._chat_completions(request)
        except ApiError as e:
            return error_response(e)
        except Exception:
            log.exception("chat completion failed")
            return error_response(ApiError(500, "internal error while serving the request", "server_error"))

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > limit:
                raise ApiError(413, f"request body over {limit} bytes", code="request_too_large")
        return bytes(body)

    async def _chat_completions(self, http: Request) -> Response:
        # 1. receive: validate, separate the session fields from what the model sees
        body = decode_request(await self._read_body(http))
        if len(body.messages) > self.config.max_messages:
            raise ApiError(400, f"at most {self.config.max_messages} messages", param="messages")
        raw_messages = [msgspec.to_builtins(m) for m in body.messages]
        messages = chat.normalise(raw_messages)
        tools = body.tools or None
        try:
            prompt_ids = chat.prompt_ids(self.tokenizer, messages, tools)
        except Exception as e:
            raise ApiError(400, f"cannot apply the chat template to these messages: {e}", param="messages") from None
        room = self.engine.max_context - len(prompt_ids)
        if room < 1:
            raise ApiError(
                400,
                f"prompt is {len(prompt_ids)} tokens; the context is {self.engine.max_context}",
                param="messages",
                code="context_length_exceeded",
            )
        params = self._sampling(body, room)
        headers = http.headers
        turn_type = headers.get("x-turn-type") or body.turn_type
        if turn_type not in (None, "main", "side"):
            raise ApiError(400, f"X-Turn-Type must be 'main' or 'side', not {turn_type!r}", param="turn_type")
        ticket = self.sessions.begin(
            session_id=headers.get("x-session-id") or body.session_id,
            turn_type=turn_type,
            session_done=bool(_header_bool(headers.get("x-session-done")) or body.session_done),
            messages=messages,
            tools=tools,
        )
        # 2. generate
        tokens = self.engine.stream(prompt_ids, params)
        if body.stream:
            return StreamingResponse(
                self._sse(body, ticket, prompt_ids, tokens, tools is not None),
                media_type="text/event-stream",
                headers={"X-Session-Id": ticket.session_id, "Cache-Control": "no-cache"},
            )
        try:
            with anyio.fail_after(self.config.request_timeout):
                completion = await self._collect(tokens, prompt_ids)
        except TimeoutError:
            self.sessions.abort(ticket)
            raise ApiError(504, f"generation took longer than {self.config.request_timeout}s", "timeout") from None
        except BaseException:
            self.sessions.abort(ticket)
            raise
        # 3. keep the turn
        turn = self.sessions.complete(ticket, completion)
        return json_response(self._response(body, completion, turn, tools is not None), headers={"X-Session-Id": ticket.session_id})

    def _sampling(self, body: ChatRequest, room: int) -> SamplingParams:
        wanted = body.max_completion_tokens or body.max_tokens or self.config.default_max_tokens
        stop = body.stop if isinstance(body.stop, list) else ([body.stop] if body.stop else [])
        if len(stop) > 16 or any(not s for s in stop):
            raise ApiError(400, "`stop` takes up to 16 non-empty strings", param="stop")
        return SamplingParams(
            max_tokens=min(wanted, room),
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            stop=tuple(stop),
            seed=body.seed,
            top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0,
        )

    async def _collect(self, tokens, prompt_ids) -> Completion:
        from ocrl.engine.base import collect

        try:
            return await collect(tokens, prompt_ids)
        except EngineBusy as e:
            raise ApiError(429, f"server busy: {e}", "rate_limit_error", headers={"Retry-After": "1"}) from None
        except EngineError as e:
            raise ApiError(500, f"generation failed: {e}", "server_error") from None

    # -- response shapes --------------------------------------------------------------------

    def _logprobs(self, ids: list[int], logprobs: list[float], tops) -> list[dict]:
        out = []
        for i, (token_id, logprob) in enumerate(zip(ids, logprobs)):
            text = self.tokenizer.decode([token_id])
            entry = {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}
            if i < len(tops):
                for top in tops[i]:
                    t = self.tokenizer.decode([top.token_id])
                    entry["top_logprobs"].append({"token": t, "logprob": top.logprob, "bytes": list(t.encode())})
            out.append(entry)
        return out

    def _ocrl_fields(self, turn, completion: Completion) -> dict:
        return {
            "session_id": turn.session_id,
            "turn_type": turn.turn_type,
            "turn_index": turn.index,
            "weights_version": completion.weights_version,
            "completion_token_ids": completion.response_ids,
        }

    def _response(self, body: ChatRequest, completion: Completion, turn, tools_offered: bool) -> dict:
        content, tool_calls, reasoning = chat.parse_completion(completion.text, tools_offered)
        message: dict = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        if reasoning:
            message["reasoning_content"] = reasoning
        finish = "tool_calls" if tool_calls else completion.finish_reason
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if body.logprobs:
            choice["logprobs"] = {"content": self._logprobs(completion.response_ids, completion.logprobs, completion.top_logprobs)}
        return {
            "id": "chatcmpl-" + uuid.uuid4().hex,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.served_name,
            "choices": [choice],
            "usage": self._usage(completion),
            "ocrl": self._ocrl_fields(turn, completion),
        }

    @staticmethod
    def _usage(completion: Completion) -> dict:
        p, c = len(completion.prompt_ids), len(completion.response_ids)
        return {
            "prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": completion.cached_tokens},
        }  # fmt: skip

    async def _sse(self, body: ChatRequest, ticket, prompt_ids, tokens, tools_offered: bool):
        cid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())

        def event(delta: dict, finish=None, logprobs=None, **extra) -> bytes:
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            chunk = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.served_name, "choices": [choice], **extra}
            return b"data: " + _encoder.encode(chunk) + b"\n\n"

        yield event({"role": "assistant", "content": ""})
        ids, lps, tops, text = [], [], [], []
        sent = 0  # chars of content already streamed
        completion = None
        try:
            with anyio.fail_after(self.config.request_timeout):
                async for chunk in tokens:
                    ids += chunk.token_ids
                    lps += chunk.logprobs
                    tops += chunk.top_logprobs
                    text.append(chunk.text)
                    so_far = "".join(text)
                    # With tools offered, content stops where a <tool_call> block may begin.
                    safe = self._streamable(so_far, tools_offered)
                    if safe > sent or chunk.token_ids:
                        logprobs = {"content": self._logprobs(chunk.token_ids, chunk.logprobs, chunk.top_logprobs)} if body.logprobs else None
                        if safe > sent or logprobs:
                            yield event({"content": so_far[sent:safe]}, logprobs=logprobs)
                        sent = max(sent, safe)
                    if isinstance(chunk, Final):
                        completion = Completion(
                            prompt_ids=list(prompt_ids), response_ids=ids, logprobs=lps, text=so_far,
                            finish_reason=chunk.finish_reason, weights_version=chunk.weights_version, top_logprobs=tops,
                            cached_tokens=chunk.cached_tokens,
                        )
        except (EngineError, TimeoutError) as e:
            self.sessions.abort(ticket)
            kind = "rate_limit_error" if isinstance(e, EngineBusy) else ("timeout" if isinstance(e, TimeoutError) else "server_error")
            yield b"data: " + _encoder.encode({"error": {"message": str(e) or "generation timed out", "type": kind, "param": None, "code": None}}) + b"\n\n"
            yield b"data: [DONE]\n\n"
            return
        except BaseException:
            self.sessions.abort(ticket)  # the client went away: no turn to keep
            raise
        turn = self.sessions.complete(ticket, completion)
        content, tool_calls, _ = chat.parse_completion(completion.text, tools_offered)
        finish = completion.finish_reason
        if tool_calls:
            finish = "tool_calls"
            deltas = [{"index": i, **call} for i, call in enumerate(tool_calls)]
            yield event({"tool_calls": deltas})
        elif sent < len(completion.text):
            yield event({"content": completion.text[sent:]})
        yield event({}, finish=finish, ocrl=self._ocrl_fields(turn, completion))
        if body.stream_options and body.stream_options.include_usage:
            usage = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.served_name, "choices": [], "usage": self._usage(completion)}
            yield b"data: " + _encoder.encode(usage) + b"\n\n"
        yield b"data: [DONE]\n\n"

    @staticmethod
    def _streamable(text: str, tools_offered: bool) -> int:
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
