"""Consuming engine streams on the API side: one choice's chunks accumulated into a Completion as
they arrive, and the streams of several choices (n > 1) merged in arrival order.

Knows token chunks and completions, never HTTP or sessions. A merged iteration that stops early
(an error, a client gone) closes every engine stream, so the engine drops their requests.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from ocrl.engine.base import Final
from ocrl.types import Completion, TokenChunk, TopLogprob


class Accumulator:
    """One choice as its chunks arrive; `completion` is set by the final chunk."""

    def __init__(self, prompt_ids: list[int]):
        self.prompt_ids = prompt_ids
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[list[TopLogprob]] = []
        self.pieces: list[str] = []
        self.sent = 0  # chars of text already streamed to the client
        self.completion: Completion | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, chunk: TokenChunk) -> None:
        self.ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.tops += chunk.top_logprobs
        self.pieces.append(chunk.text)
        if isinstance(chunk, Final):
            self.completion = Completion(
                prompt_ids=list(self.prompt_ids), response_ids=self.ids, logprobs=self.logprobs, text=self.text,
                finish_reason=chunk.finish_reason, weights_version=chunk.weights_version, top_logprobs=self.tops,
                cached_tokens=chunk.cached_tokens,
            )


async def merged(streams: list[AsyncIterator[TokenChunk]]) -> AsyncIterator[tuple[int, TokenChunk]]:
    """(choice index, chunk) from every stream, as each arrives. An exception from any stream
    ends the iteration (the others are closed) and propagates."""
    if len(streams) == 1:  # the common case, without tasks
        try:
            async for chunk in streams[0]:
                yield 0, chunk
        finally:
            await streams[0].aclose()
        return
    iterators = [stream.__aiter__() for stream in streams]
    pending = {asyncio.ensure_future(anext(it)): k for k, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=pending.get):
                k = pending.pop(future)
                try:
                    chunk = future.result()
                except StopAsyncIteration:
                    continue
                yield k, chunk
                pending[asyncio.ensure_future(anext(iterators[k]))] = k
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            await it.aclose()
