"""The Engine protocol: token ids in, sampled token ids + raw log-probs out, weights hot-swapped
behind a monotonically increasing `weights_version`.

An engine sees token ids and sampling parameters, never HTTP, sessions or samples. Generation is
an async iterator of chunks (stream first); `generate` consumes it. Every completion is produced
by exactly one weights version, reported on its last chunk.
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol

from ocrl.types import Completion, FinishReason, SamplingParams, TokenChunk, TopLogprob


class EngineError(RuntimeError):
    """A generation failed inside the engine (the request gets a 5xx; the engine keeps serving)."""


class EngineBusy(EngineError):
    """Too many generations queued; the caller should retry later (HTTP 429)."""


class Final(TokenChunk, kw_only=True):
    """The last chunk of a stream: carries the finish reason and the weights version."""

    finish_reason: FinishReason
    weights_version: int


class Engine(Protocol):
    name: str
    weights_version: int
    max_context: int

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenChunk]: ...

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion: ...

    async def update_weights(self, named_tensors: dict, version: int) -> float: ...

    async def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]: ...


async def collect(stream: AsyncIterator[TokenChunk], prompt_ids: list[int]) -> Completion:
    """The non-streaming answer is the stream, consumed."""
    ids: list[int] = []
    logprobs: list[float] = []
    tops: list[list[TopLogprob]] = []
    text = []
    async for chunk in stream:
        ids += chunk.token_ids
        logprobs += chunk.logprobs
        tops += chunk.top_logprobs
        text.append(chunk.text)
        if isinstance(chunk, Final):
            return Completion(
                prompt_ids=list(prompt_ids),
                response_ids=ids,
                logprobs=logprobs,
                text="".join(text),
                finish_reason=chunk.finish_reason,
                weights_version=chunk.weights_version,
                top_logprobs=tops,
            )
    raise EngineError("generation ended without a final chunk")
