"""The OpenAI-compatible HTTP surface: /v1/chat/completions (+SSE), /v1/models, /healthz and
/v1/ocrl/*; /v1/responses (responses.py) and /v1/completions (completions.py) are served
through the same pipeline.

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
from dataclasses import dataclass
from typing import Annotated, Any, AsyncIterator, Literal

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ocrl import chat, grammar, guard
from ocrl.access_log import RequestLog, note
from ocrl.engine.base import GREEDY_BELOW, EngineBusy, EngineError
from ocrl.records import DiskFull
from ocrl.streams import Accumulator, merged
from ocrl.types import Completion, Grammar, Message, SamplingParams, TokenChunk

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


class Detokenize(msgspec.Struct):
    ids: list[list[Annotated[int, msgspec.Meta(ge=0, lt=2**31)]]]


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


_encoder = msgspec.json.Encoder()
DECODE_OFF_LOOP_ABOVE = 256 * 1024  # bytes of body past which JSON decoding leaves the event loop
BODY_SLACK = 1 << 20  # bytes of a request besides its prompt (refuse_hopeless_body)
_request_decoder = msgspec.json.Decoder(ChatRequest)
_AT = re.compile(r" - at `\$\.?([^`]*)`")


def error_response(e: ApiError | guard.Refused) -> Response:
    body = {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}
    return Response(_encoder.encode(body), status_code=e.status, media_type="application/json", headers=getattr(e, "headers", None))


async def answered(what: str, serve, request: Request) -> Response:
    """Every generating route's last word: an ApiError becomes its OpenAI-shaped answer, anything
    else a logged 500 that takes nothing else down."""
    try:
        return await serve(request)
    except ApiError as e:
        return error_response(e)
    except Exception:
        log.exception("%s failed", what)
        return error_response(ApiError(500, "internal error while serving the request", "server_error"))


def storage_full(e: DiskFull) -> ApiError:
    """A main turn cannot be kept while the record dir is full: 503, come back later. Side turns
    and health keep answering."""
    return ApiError(
        503, f"this server cannot record main turns right now ({e.strerror or e}); retry later, or send a side turn",
        "server_error", code="storage_full", headers={"Retry-After": "30"},
    )


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


def _header_bool(value: str | None) -> bool | None:
    if value is None:
        return None
    return value.strip().lower() in ("1", "true", "yes", "on")


@dataclass
class Prepared:
    """A request made ready to generate: its prompt, one sampling setup per choice, and the
    sessions' ticket its turn is kept under."""

    messages: list[Message]
    tools: list[dict] | None
    prompt_ids: list[int]
    params: list[SamplingParams]
    ticket: Any
    scope: dict


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
        self._token_chars: int | None = None
        self._render_limiter = anyio.CapacityLimiter(1)  # one prompt renders at a time: one core, one tokenizer
        self._decode_limiter = anyio.CapacityLimiter(2)  # large bodies decode in at most 2 worker threads at once
        self.decode_off_loop_above = DECODE_OFF_LOOP_ABOVE
        self.body_precheck = True  # refuse_hopeless_body (a bench turns it off to compare)
        from ocrl.completions import Completions  # these build on this module
        from ocrl.responses import Responses

        self.responses = Responses(self)
        self.completions = Completions(self)
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
                Route("/v1/responses", self.responses.create, methods=["POST"]),
                Route("/v1/completions", self.completions.create, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.responses.retrieve, methods=["GET"]),
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
        self.request_log = RequestLog(self._authorised)

    async def __call__(self, scope, receive, send):
        await self.request_log(scope, receive, send)

    async def _authorised(self, scope, receive, send):
        if scope["type"] == "http" and (refused := guard.browser_refusal(scope, self.config)) is not None:
            await error_response(refused)(scope, receive, send)
            return
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

    def _model_card(self) -> dict:
        return {"id": self.served_name, "object": "model", "created": int(self.started), "owned_by": "ocrl"}

    async def models(self, request: Request) -> Response:
        return json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id != self.served_name:
            return error_response(ApiError(404, f"the model {model_id!r} does not exist; this server serves {self.served_name!r}", param="model", code="model_not_found"))
        return json_response(self._model_card())

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
        return await answered("chat completion", self._chat_completions, request)

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

    async def decode(self, fn, raw: bytes):
        """`fn(raw)` (JSON decoding and validation) in a worker thread when the body is large: a
        multi-megabyte body takes tens of milliseconds to decode, which every other request on
        the event loop (health checks, streams) would otherwise wait out. Small bodies decode
        inline, where a thread hop would cost more than the decode."""
        if len(raw) <= self.decode_off_loop_above:
            return fn(raw)
        return await anyio.to_thread.run_sync(fn, raw, limiter=self._decode_limiter)

    def refuse_hopeless_body(self, size: int, param: str = "messages") -> None:
        """Before decoding: a body too large for any prompt that fits the context is refused
        unread. A prompt character takes at most 6 bytes of JSON (a \\uXXXX escape), and the
        rest of a request (sampling fields, a schema, logit_bias) gets 1 MiB of slack. Decoding
        holds the GIL (10-60 ms per 8 MB here), so a worker thread cannot spare the event loop
        that cost; this check can."""
        if not self.body_precheck:
            return
        most = 6 * self.engine.max_context * self._longest_token() + BODY_SLACK
        if size > most:
            raise ApiError(
                400, f"request body is {size} bytes; a prompt that fits the context of {self.engine.max_context} tokens needs at most {most}",
                param=param, code="context_length_exceeded",
            )

    async def _chat_completions(self, http: Request) -> Response:
        raw = await self._read_body(http)
        self.refuse_hopeless_body(len(raw))
        body = await self.decode(decode_request, raw)
        prepared = await self.prepare(body, http)
        if body.stream:
            return StreamingResponse(
                self._sse(body, prepared), media_type="text/event-stream",
                headers={"X-Session-Id": prepared.ticket.session_id, "Cache-Control": "no-cache"},
            )
        completions = await self.generate_while_connected(prepared, http)
        if completions is None:
            return Response(status_code=499)  # nobody is listening; the turn was dropped
        turns = self.keep(prepared, completions)
        return json_response(self._response(body, completions, turns, prepared.tools is not None), headers={"X-Session-Id": prepared.ticket.session_id})

    # -- the pipeline every generating route shares ----------------------------------------

    async def prepare(self, body: ChatRequest, http: Request) -> Prepared:
        """1. receive: validate, separate the session fields from what the model sees, render
        the prompt, open the turn with the sessions."""
        if len(body.messages) > self.config.max_messages:
            raise ApiError(400, f"at most {self.config.max_messages} messages", param="messages")
        messages = chat.normalise([msgspec.to_builtins(m) for m in body.messages])
        # tool_choice "none" (OpenAI: the model does not call tools; the reply is plain text): the
        # tools are neither written into the prompt nor parsed out of the reply
        tools = None if body.tool_choice == "none" else (body.tools or None)
        prompt_ids = await self.render(messages, tools)
        params = self._sampling(body, self._room(prompt_ids, "messages"))
        constraint = self._constraint(body)
        if constraint is not None:  # compiled now, so a grammar the engine cannot enforce records nothing
            await self._prepare(constraint)
            params = msgspec.structs.replace(params, grammar=constraint)
        headers = http.headers
        given = headers.get("x-turn-type") or body.turn_type
        # any case, as the reference reads it; but an unknown value is refused, not taken as side
        # (the reference's rule), so a typo cannot silently turn a client's turns into no training data
        turn_type = given.strip().lower() if given else None
        if turn_type not in (None, "main", "side"):
            raise ApiError(400, f"X-Turn-Type must be 'main' or 'side', not {given!r}", param="turn_type")
        session_id = headers.get("x-session-id") or body.session_id
        check_fields(session_id, {})
        try:
            ticket = self.sessions.begin(
                session_id=session_id,
                turn_type=turn_type,
                session_done=bool(_header_bool(headers.get("x-session-done")) or body.session_done),
                messages=messages,
                tools=tools,
            )
        except DiskFull as e:
            raise storage_full(e) from None
        note(http.scope, session=ticket.session_id, n=body.n if body.n > 1 else None)
        choices = [params] if body.n == 1 else [msgspec.structs.replace(params, seed=None if params.seed is None else params.seed + k) for k in range(body.n)]
        return Prepared(messages, tools, prompt_ids, choices, ticket, http.scope)

    async def render(self, messages: list[Message], tools: list[dict] | None, param: str = "messages") -> list[int]:
        """Prompt ids of a chat, rendered and tokenised off the event loop (see `tokenise`)."""
        chars = sum(len(m.content or "") + len(str(m.tool_calls or "")) for m in messages) + (len(_encoder.encode(tools)) if tools else 0)
        try:
            return await self.tokenise(chars, param, chat.prompt_ids, self.tokenizer, messages, tools)
        except ApiError:
            raise
        except Exception as e:
            raise ApiError(400, f"cannot apply the chat template to these messages: {e}", param=param) from None

    async def tokenise(self, chars: int, param: str, fn, *args):
        """`fn(*args)` (templating, tokenising) in a worker thread: a long prompt takes seconds of
        CPU that the event loop must not lose. First, a prompt of `chars` characters that
        cannot fit the context whatever it tokenises to is refused without tokenising."""
        most = self.engine.max_context * self._longest_token()
        if chars > most:
            raise ApiError(
                400, f"prompt is {chars} characters; no more than {most} can fit the context of {self.engine.max_context} tokens",
                param=param, code="context_length_exceeded",
            )
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._render_limiter)

    def _longest_token(self) -> int:
        """The most characters one token can stand for (its vocabulary's longest entry)."""
        if self._token_chars is None:
            try:
                self._token_chars = max(map(len, self.tokenizer.get_vocab()), default=0) or 64
            except Exception:
                self._token_chars = 64
        return self._token_chars

    def _room(self, prompt_ids: list[int], param: str) -> int:
        room = self.engine.max_context - len(prompt_ids)
        if room < 1:
            raise ApiError(
                400, f"prompt is {len(prompt_ids)} tokens; the context is {self.engine.max_context}", param=param, code="context_length_exceeded",
            )
        return room

    def streams(self, prepared: Prepared) -> list[AsyncIterator[TokenChunk]]:
        """2. generate: one engine stream per choice."""
        return [self.engine.stream(prepared.prompt_ids, params) for params in prepared.params]

    async def generate(self, prepared: Prepared) -> list[Completion]:
        """2. generate, consumed (the non-streaming answer). On any failure the turn is dropped."""
        choices = [Accumulator(prepared.prompt_ids) for _ in prepared.params]
        try:
            with anyio.fail_after(self.config.request_timeout):
                async for k, chunk in merged(self.streams(prepared)):
                    choices[k].add(chunk)
            if any(c.completion is None for c in choices):
                raise EngineError("generation ended without a final chunk")
        except TimeoutError:
            self.sessions.abort(prepared.ticket)
            raise ApiError(504, f"generation took longer than {self.config.request_timeout}s", "timeout") from None
        except EngineBusy as e:
            self.sessions.abort(prepared.ticket)
            raise ApiError(429, f"server busy: {e}", "rate_limit_error", headers={"Retry-After": "1"}) from None
        except EngineError as e:
            self.sessions.abort(prepared.ticket)
            raise ApiError(500, f"generation failed: {e}", "server_error") from None
        except BaseException:
            self.sessions.abort(prepared.ticket)
            raise
        return [c.completion for c in choices]

    async def generate_while_connected(self, prepared: Prepared, http: Request) -> list[Completion] | None:
        """`generate`, stopped (the engine drops the request, the turn is aborted) as soon as the
        client disconnects; None then. The body has been read, so the next message the server
        can receive is the disconnect."""
        completions, failure = None, None
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while (await http.receive())["type"] != "http.disconnect":
                    pass
                note(prepared.scope, error="client_gone")
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                completions = await self.generate(prepared)
            except Exception as e:  # raised after the group, not wrapped in an exception group
                failure = e
            tg.cancel_scope.cancel()
        if failure is not None:
            raise failure
        return completions

    def keep(self, prepared: Prepared, completions: list[Completion]) -> list:
        """3. keep the turn (n > 1: the group of candidates) with the sessions."""
        try:
            if len(completions) == 1:
                turns = [self.sessions.complete(prepared.ticket, completions[0])]
            else:
                turns = self.sessions.complete_group(prepared.ticket, completions)
        except DiskFull as e:  # generated, but it cannot be kept: the client must not take it as a turn
            self.sessions.abort(prepared.ticket)
            raise storage_full(e) from None
        first = turns[0]
        note(
            prepared.scope, turn=f"main#{first.index}" if first.turn_type == "main" else "side",
            prompt=len(prepared.prompt_ids), completion=sum(len(c.response_ids) for c in completions),
        )
        return turns

    @staticmethod
    def stream_error(scope: dict, e: BaseException) -> bytes:
        """The SSE event a stream sends when generation fails after its 200 went out."""
        if isinstance(e, ApiError):
            note(scope, error=e.code or e.type)
            return b"data: " + _encoder.encode({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}) + b"\n\n"
        kind = "rate_limit_error" if isinstance(e, EngineBusy) else ("timeout" if isinstance(e, TimeoutError) else "server_error")
        note(scope, error=kind)
        return b"data: " + _encoder.encode({"error": {"message": str(e) or "generation timed out", "type": kind, "param": None, "code": None}}) + b"\n\n"

    @staticmethod
    def _constraint(body: ChatRequest) -> Grammar | None:
        try:
            return grammar.from_request(body.response_format, body.tools, body.tool_choice)
        except grammar.GrammarError as e:
            raise ApiError(400, str(e), param=e.param, code="unsupported_constraint") from None

    async def _prepare(self, constraint: Grammar) -> None:
        try:
            await self.engine.prepare(constraint)
        except grammar.GrammarError as e:
            raise ApiError(400, str(e), param=e.param, code="unsupported_constraint") from None

    def _sampling(self, body: ChatRequest, room: int) -> SamplingParams:
        # no max_tokens: up to the rest of the context, as OpenAI's API and the reference (which forwards
        # the request as it came) do; --default-max-tokens N caps it
        wanted = body.max_completion_tokens or body.max_tokens or self.config.default_max_tokens or room
        stop = body.stop if isinstance(body.stop, list) else ([body.stop] if body.stop else [])
        if len(stop) > 16 or any(not s for s in stop):
            raise ApiError(400, "`stop` takes up to 16 non-empty strings", param="stop")
        return SamplingParams(
            max_tokens=min(wanted, room),
            # a temperature too small to divide by is greedy (it is, to float precision)
            temperature=1.0 if body.temperature is None else (0.0 if body.temperature < GREEDY_BELOW else body.temperature),
            top_p=1.0 if body.top_p is None else body.top_p,
            stop=tuple(stop),
            seed=body.seed,
            top_logprobs=(body.top_logprobs or 0) if body.logprobs else 0,
        )

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
                choice["logprobs"] = {"content": self._logprobs(completion.response_ids, completion.logprobs, completion.top_logprobs)}
            if len(completions) > 1:
                choice["ocrl"] = self._ocrl_fields(turns[k], completion)
            choices.append(choice)
        return {
            "id": "chatcmpl-" + uuid.uuid4().hex,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.served_name,
            "choices": choices,
            "usage": self._usage(completions),
            "ocrl": self._ocrl_fields(turns[0], completions[0]),
        }

    @staticmethod
    def _usage(completions: list[Completion]) -> dict:
        p, c = len(completions[0].prompt_ids), sum(len(completion.response_ids) for completion in completions)
        return {
            "prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": completions[0].cached_tokens},
        }  # fmt: skip

    async def _sse(self, body: ChatRequest, prepared: Prepared):
        cid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
        tools_offered = prepared.tools is not None

        def event(k: int, delta: dict, finish=None, logprobs=None, **extra) -> bytes:
            choice = {"index": k, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            chunk = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.served_name, "choices": [choice], **extra}
            return b"data: " + _encoder.encode(chunk) + b"\n\n"

        choices = [Accumulator(prepared.prompt_ids) for _ in prepared.params]
        for k in range(len(choices)):
            yield event(k, {"role": "assistant", "content": ""})
        try:
            with anyio.fail_after(self.config.request_timeout):
                async for k, chunk in merged(self.streams(prepared)):
                    choice = choices[k]
                    choice.add(chunk)
                    so_far = choice.text
                    # With tools offered, content stops where a <tool_call> block may begin.
                    safe = self._streamable(so_far, tools_offered)
                    logprobs = {"content": self._logprobs(chunk.token_ids, chunk.logprobs, chunk.top_logprobs)} if body.logprobs and chunk.token_ids else None
                    if safe > choice.sent or logprobs:
                        yield event(k, {"content": so_far[choice.sent : max(safe, choice.sent)]}, logprobs=logprobs)
                    choice.sent = max(choice.sent, safe)
            if any(c.completion is None for c in choices):
                raise EngineError("generation ended without a final chunk")
        except (EngineError, TimeoutError) as e:
            self.sessions.abort(prepared.ticket)
            yield self.stream_error(prepared.scope, e)
            yield b"data: [DONE]\n\n"
            return
        except BaseException:
            self.sessions.abort(prepared.ticket)  # the client went away: no turn to keep
            raise
        completions = [c.completion for c in choices]
        try:
            turns = self.keep(prepared, completions)
        except ApiError as e:  # the text went out, but the turn is not kept (a full disk): say so
            yield self.stream_error(prepared.scope, e)
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
            yield event(k, {}, finish=finish, ocrl=self._ocrl_fields(turns[k], completion))
        if body.stream_options and body.stream_options.include_usage:
            usage = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.served_name, "choices": [], "usage": self._usage(completions)}
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
