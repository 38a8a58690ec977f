"""The legacy completions API (POST /v1/completions): a raw prompt, as text or token ids, continued
by the policy with no chat template.

A raw prompt has no conversation in it: nothing says which words are the user's reply to an
earlier answer, so no next state can be found and nothing is judged. Completions are therefore
served and recorded as side turns (never trained on); asking for a main turn is a 400. Served
through the chat pipeline's generate and keep steps (pipeline.py), so timeouts, the queue bound and
the request log behave alike.

Accepted: `prompt` as a string or a list of token ids (or a list holding exactly one of those),
`max_tokens` (default 16, as OpenAI's), `temperature`, `top_p`, `stop`, `seed`, `n`, `logprobs`
(the top-k alternatives per token, 0-20; the sampled token's log-prob is always given with it),
`stream` (+ `stream_options.include_usage`). Refused with a 400 naming the field: `echo: true`,
`suffix`, `best_of` other than n, several prompts, token ids outside the vocabulary.
"""

from __future__ import annotations

import logging
import time
import uuid
from types import SimpleNamespace
from typing import Annotated, Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ocrl import guard
from ocrl.chat_request import StreamOptions, check_fields
from ocrl.pipeline import Prepared
from ocrl.replies import ApiError, answered, json_response, stream_error
from ocrl.types import Message

log = logging.getLogger("ocrl.completions")

DEFAULT_MAX_TOKENS = 16
_encoder = msgspec.json.Encoder()


class CompletionRequest(msgspec.Struct):
    prompt: str | list[Any]
    model: str = ""
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, msgspec.Meta(ge=guard.SEED_RANGE[0], le=guard.SEED_RANGE[1])] | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1
    best_of: int | None = None
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    session_id: str | None = None
    turn_type: Literal["main", "side"] | None = None
    session_done: bool | None = None


_decoder = msgspec.json.Decoder(CompletionRequest)


class Completions:
    def __init__(self, api):
        self.api = api

    async def create(self, http: Request) -> Response:
        return await answered("completion", self._create, http)

    async def _prompt_ids(self, prompt: str | list[Any]) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "`prompt` is empty", param="prompt")
            return list(await self.api.tokenise(len(prompt), "prompt", self.api.tokenizer.encode, prompt))
        vocabulary = len(self.api.tokenizer)
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ApiError(400, "`prompt` must be a string or a non-empty list of token ids (one prompt per request)", param="prompt")
        if any(t < 0 or t >= vocabulary for t in prompt):
            raise ApiError(400, f"`prompt` holds token ids outside the vocabulary (0..{vocabulary - 1})", param="prompt")
        return list(prompt)

    async def _create(self, http: Request) -> Response:
        api = self.api
        # 1. receive
        raw = await api._read_body(http)
        api.refuse_hopeless_body(len(raw), "prompt")  # before decoding (see there)
        try:
            body = await api.decode(_decoder.decode, raw)
        except msgspec.ValidationError as e:
            raise ApiError(400, f"invalid request: {e}") from None
        except msgspec.DecodeError as e:
            raise ApiError(400, f"malformed JSON body: {e}") from None
        for field, refused in (("echo", body.echo), ("suffix", body.suffix is not None), ("best_of", body.best_of not in (None, body.n))):
            if refused:
                raise ApiError(400, f"`{field}` is not supported", param=field)
        if (http.headers.get("x-turn-type") or body.turn_type) == "main":
            raise ApiError(400, "completions are side turns: a raw prompt has no next state to judge", param="turn_type")
        check_fields(http.headers.get("x-session-id") or body.session_id, {})
        prompt_ids = await self._prompt_ids(body.prompt)
        sampling = SimpleNamespace(
            max_completion_tokens=None, max_tokens=body.max_tokens or DEFAULT_MAX_TOKENS, stop=body.stop, temperature=body.temperature,
            top_p=body.top_p, seed=body.seed, logprobs=body.logprobs is not None, top_logprobs=body.logprobs,
        )  # fmt: skip
        params = api._sampling(sampling, api._room(prompt_ids, "prompt"))
        prompt_text = api.tokenizer.decode(prompt_ids)
        ticket = api.sessions.begin(
            session_id=http.headers.get("x-session-id") or body.session_id, turn_type="side", session_done=bool(body.session_done),
            messages=[Message(role="user", content=prompt_text)],
        )  # fmt: skip
        choices = [params] if body.n == 1 else [msgspec.structs.replace(params, seed=None if params.seed is None else params.seed + k) for k in range(body.n)]
        prepared = Prepared([], None, prompt_ids, choices, ticket, http.scope)
        if body.stream:
            return StreamingResponse(self._sse(body, prepared), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        # 2. generate  3. keep (as side turns)
        completions = await api.generate_while_connected(prepared, http)
        if completions is None:
            return Response(status_code=499)  # the client left: generation stopped
        turns = api.keep(prepared, completions)
        return json_response(
            {
                "id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()), "model": api.served_name,
                "choices": [
                    {"index": k, "text": c.text, "finish_reason": c.finish_reason, "logprobs": self._logprobs(body, c.response_ids, c.logprobs, c.top_logprobs), "ocrl": api._ocrl_fields(turn, c)}
                    for k, (c, turn) in enumerate(zip(completions, turns))
                ],
                "usage": api._usage(completions),
            }
        )  # fmt: skip

    def _logprobs(self, body: CompletionRequest, ids: list[int], logprobs: list[float], tops, offset: int = 0) -> dict | None:
        """OpenAI's legacy shape: tokens, token_logprobs, top_logprobs ({token: logprob}), text_offset."""
        if body.logprobs is None:
            return None
        decode = self.api.tokenizer.decode
        tokens = [decode([token_id]) for token_id in ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        top = [{decode([t.token_id]): t.logprob for t in (tops[i] if i < len(tops) else [])} for i in range(len(ids))]
        return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top, "text_offset": offsets}

    async def _sse(self, body: CompletionRequest, prepared: Prepared):
        api = self.api
        cid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())

        def event(choices: list[dict], **extra) -> bytes:
            chunk = {"id": cid, "object": "text_completion", "created": created, "model": api.served_name, "choices": choices, **extra}
            return b"data: " + _encoder.encode(chunk) + b"\n\n"

        async with api.streaming(prepared) as run:
            async for k, chunk in run:
                if chunk.text or chunk.token_ids:
                    offset = len(run.choices[k].text) - len(chunk.text)  # where this chunk's text starts
                    logprobs = self._logprobs(body, chunk.token_ids, chunk.logprobs, chunk.top_logprobs, offset) if chunk.token_ids else None
                    yield event([{"index": k, "text": chunk.text, "logprobs": logprobs, "finish_reason": None}])
        if run.failure is not None:
            yield stream_error(prepared.scope, run.failure)
            yield b"data: [DONE]\n\n"
            return
        completions = run.completions
        turns = api.keep(prepared, completions)
        for k, (completion, turn) in enumerate(zip(completions, turns)):
            yield event([{"index": k, "text": "", "logprobs": None, "finish_reason": completion.finish_reason}], ocrl=api._ocrl_fields(turn, completion))
        if body.stream_options and body.stream_options.include_usage:
            yield event([], usage=api._usage(completions))
        yield b"data: [DONE]\n\n"
