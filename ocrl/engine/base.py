"""The Engine protocol: token ids in, sampled token ids + raw log-probs out, weights hot-swapped
behind a monotonically increasing `weights_version`.

An engine sees token ids and sampling parameters, never HTTP, sessions or samples. Generation is
an async iterator of chunks (stream first); `generate` consumes it. Every completion is produced
by exactly one weights version, reported on its last chunk.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Protocol, runtime_checkable

from ocrl.types import Completion, FinishReason, Grammar, SamplingParams, TokenChunk, TopLogprob


def find_stop(text: str, stops: tuple[str, ...], emitted_chars: int) -> int:
    """Where the first stop string starts in `text` (decoded so far), or -1. Only the tail that
    could hold a new match is searched: text already emitted had none."""
    if not stops:
        return -1
    window = max(0, emitted_chars - max(len(s) for s in stops))
    hits = [i for s in stops if (i := text.find(s, window)) >= 0]
    return min(hits) if hits else -1


def ready_end(text: str, stops: tuple[str, ...], emitted_chars: int) -> int:
    """How far `text` may be emitted while the completion goes on: not into a multi-byte
    character still incomplete, nor into what might become a stop string."""
    if text.endswith("\ufffd"):
        return emitted_chars
    return len(text) - held_back(text, stops)


def finished_end(text: str) -> int:
    """How far `text` is emitted when the completion ends without a stop string (end of text or
    the token limit): all of it but trailing bytes of a character the tokens never completed.
    They decode to U+FFFD, which would reach the client as a lone replacement character; the
    token ids that hold them are still returned and trained on."""
    return len(text.rstrip("\ufffd"))


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing chars might be the start of a stop string (and so must wait)."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                hold = max(hold, n)
                break
    return hold


# Below this temperature sampling is greedy: logits / T overflows to inf/NaN in fp32 long before
# T reaches 0 (1e-38 does), and the distribution is already an argmax to float precision.
GREEDY_BELOW = 1e-5


class EngineError(RuntimeError):
    """A generation failed inside the engine (the request gets a 5xx; the engine keeps serving)."""


class EngineBusy(EngineError):
    """Too many generations queued; the caller should retry later (HTTP 429)."""


class Final(TokenChunk, kw_only=True):
    """The last chunk of a stream: carries the finish reason, the weights version and how many
    prompt tokens came from a cache instead of a prefill."""

    finish_reason: FinishReason
    weights_version: int
    cached_tokens: int = 0


@runtime_checkable
class Engine(Protocol):
    """Everything the daemon, the API, the trainer and the benchmarks use on an engine: the HF
    engine, the SGLang engine and the cluster of replicas all provide it (tests/test_seams.py)."""

    name: str
    weights_version: int  # the version new requests are served with
    max_context: int  # prompt + completion tokens
    device: Any  # torch.device the weights sit on
    active: int  # requests decoding now
    generated_tokens: int  # since start
    accepts_adapters: bool  # update_weights takes a LoRA adapter (--weight-sync lora), not merged weights

    @property
    def queue_depth(self) -> int: ...

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenChunk]: ...

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion: ...

    async def prepare(self, grammar: Grammar) -> None:
        """Readies a grammar before its request is accepted; raises ocrl.grammar.GrammarError
        when this engine cannot enforce it."""

    async def update_weights(self, named_tensors: dict, version: int) -> float: ...

    async def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]: ...

    async def next_token_logprobs(self, prompt_ids: list[int]) -> Any:
        """Log-probs (V,) of the token after `prompt_ids` (the judges read them)."""

    async def run(self) -> None:
        """The scheduler loop; returns when cancelled."""


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
                cached_tokens=chunk.cached_tokens,
            )
    raise EngineError("generation ended without a final chunk")
