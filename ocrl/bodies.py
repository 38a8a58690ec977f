"""Reading a request body before anything is made of it: the size limit (413), the refusal of a
body too large for any prompt that fits the context (before decoding: decoding holds the GIL),
and JSON decoding in a worker thread for large bodies, so the event loop keeps answering.

`BodyReader` is the first part of the pipeline every generating route shares (pipeline.py) and
of /v1/ocrl/detokenize. Knows the context length and the vocabulary's longest token; nothing of
what the body says.
"""

from __future__ import annotations

import anyio
from starlette.requests import Request

from ocrl.replies import ApiError

DECODE_OFF_LOOP_ABOVE = 256 * 1024  # bytes of body past which JSON decoding leaves the event loop
BODY_SLACK = 1 << 20  # bytes of a request besides its prompt (refuse_hopeless_body)


class BodyReader:
    def __init__(self, config, engine, tokenizer):
        self.config = config
        self.engine = engine
        self.tokenizer = tokenizer
        self._token_chars: int | None = None
        self._decode_limiter = anyio.CapacityLimiter(2)  # large bodies decode in at most 2 worker threads at once
        self.decode_off_loop_above = DECODE_OFF_LOOP_ABOVE
        self.body_precheck = True  # refuse_hopeless_body (a bench turns it off to compare)

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

    def _longest_token(self) -> int:
        """The most characters one token can stand for (its vocabulary's longest entry)."""
        if self._token_chars is None:
            try:
                self._token_chars = max(map(len, self.tokenizer.get_vocab()), default=0) or 64
            except Exception:
                self._token_chars = 64
        return self._token_chars
