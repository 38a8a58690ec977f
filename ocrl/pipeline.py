"""The steps every generating route shares (chat completions, responses, completions):

1. receive: the body read and decoded (bodies.py), the request validated, the session fields
   taken off what the model sees, the prompt rendered and tokenised off the event loop, the
   turn opened with the sessions (`prepare`);
2. generate: one engine stream per choice, under the request's time limit, streamed to the
   client (`streaming`) or consumed (`generate`), stopped when the client leaves
   (`generate_while_connected`); a failure aborts the turn, in one place for every route;
3. keep: the finished main or side turn handed to the sessions (`keep`).

Plus the pieces of an OpenAI answer every route writes alike: usage, token log-probs, the ocrl
fields. On any failure the turn is aborted and an ApiError (replies.py) says why. Never judges
or trains; knows nothing of any one route's request or response shape.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

import anyio
import msgspec
from starlette.requests import Request

from ocrl import chat, grammar
from ocrl.access_log import note
from ocrl.bodies import BodyReader
from ocrl.chat_request import ChatRequest, check_fields, header_bool
from ocrl.engine.base import GREEDY_BELOW, EngineBusy, EngineError
from ocrl.jsonl import DiskFull
from ocrl.replies import ApiError, storage_full
from ocrl.streams import Accumulator, merged
from ocrl.types import Completion, Grammar, Message, SamplingParams, TokenChunk

_encoder = msgspec.json.Encoder()


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


class Streaming:
    """One request's choices as their chunks arrive, each chunk added to its choice's
    accumulator before it is handed on; see `Pipeline.streaming`."""

    def __init__(self, streams: list[AsyncIterator[TokenChunk]], prompt_ids: list[int], n: int):
        self.choices = [Accumulator(prompt_ids) for _ in range(n)]
        self.failure: EngineError | TimeoutError | None = None  # what ended generation early
        self._chunks = merged(streams)

    def __aiter__(self) -> Streaming:
        return self

    async def __anext__(self) -> tuple[int, TokenChunk]:
        k, chunk = await anext(self._chunks)
        self.choices[k].add(chunk)
        return k, chunk

    @property
    def completions(self) -> list[Completion]:
        return [choice.completion for choice in self.choices]

    async def aclose(self) -> None:
        """Closes the engine streams: the engine drops requests still generating."""
        await self._chunks.aclose()


class Pipeline(BodyReader):
    """Receive, generate, keep, over an engine, a tokenizer and the sessions."""

    def __init__(self, config, engine, tokenizer, sessions):
        super().__init__(config, engine, tokenizer)
        self.sessions = sessions
        self.served_name = config.served_model_name or engine.name
        self._render_limiter = anyio.CapacityLimiter(1)  # one prompt renders at a time: one core, one tokenizer

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
                session_done=bool(header_bool(headers.get("x-session-done")) or body.session_done),
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

    def _room(self, prompt_ids: list[int], param: str) -> int:
        room = self.engine.max_context - len(prompt_ids)
        if room < 1:
            raise ApiError(
                400, f"prompt is {len(prompt_ids)} tokens; the context is {self.engine.max_context}", param=param, code="context_length_exceeded",
            )
        return room

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

    def streams(self, prepared: Prepared) -> list[AsyncIterator[TokenChunk]]:
        """2. generate: one engine stream per choice."""
        return [self.engine.stream(prepared.prompt_ids, params) for params in prepared.params]

    @asynccontextmanager
    async def streaming(self, prepared: Prepared) -> AsyncIterator[Streaming]:
        """2. generate, as it comes: `async for k, chunk in run` inside the block gives each
        choice's chunks under the request's time limit, each already added to `run.choices[k]`.
        An engine failure or the time limit ends the block quietly with the turn aborted and
        `run.failure` set (each route says so in its own shape); anything else (the client gone)
        aborts the turn and goes on. The engine streams are closed either way."""
        run = Streaming(self.streams(prepared), prepared.prompt_ids, len(prepared.params))
        try:
            with anyio.fail_after(self.config.request_timeout):
                yield run
            if any(c.completion is None for c in run.choices):
                raise EngineError("generation ended without a final chunk")
        except (EngineError, TimeoutError) as e:
            self.sessions.abort(prepared.ticket)
            run.failure = e
        except BaseException:
            self.sessions.abort(prepared.ticket)  # the client went away: no turn to keep
            raise
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled request still frees the engine's slots
                await run.aclose()

    async def generate(self, prepared: Prepared) -> list[Completion]:
        """2. generate, consumed (the non-streaming answer). On any failure the turn is dropped."""
        async with self.streaming(prepared) as run:
            async for _ in run:
                pass
        if isinstance(run.failure, TimeoutError):
            raise ApiError(504, f"generation took longer than {self.config.request_timeout}s", "timeout") from None
        if isinstance(run.failure, EngineBusy):
            raise ApiError(429, f"server busy: {run.failure}", "rate_limit_error", headers={"Retry-After": "1"}) from None
        if run.failure is not None:
            raise ApiError(500, f"generation failed: {run.failure}", "server_error") from None
        return run.completions

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

    @staticmethod
    def _usage(completions: list[Completion]) -> dict:
        p, c = len(completions[0].prompt_ids), sum(len(completion.response_ids) for completion in completions)
        return {
            "prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": completions[0].cached_tokens},
        }  # fmt: skip
