"""The LLM judges: a language model reads the judge chat and scores the turn.

- `GenerateJudge`, the seed's PRM: m sampled judgements, run concurrently, majority vote. Its
  model call comes in as a `Complete` callable (`ocrl.judge.completers` builds one on an engine
  of ours or on any OpenAI-compatible endpoint).
- `VerdictJudge`: one forward pass; m votes drawn from the verdict-token probabilities, which
  come in as a `VerdictProbs` callable.

The prompts are `ocrl.judge.prompts`, the reading of votes and the verdict `ocrl.judge.votes`.
This module knows nothing of HTTP, sessions, engines or training.
"""

from __future__ import annotations

import math
import random
from collections.abc import Awaitable, Callable

import anyio

from ocrl.judge.prompts import ChatMessages, judge_messages, verdict_messages
from ocrl.judge.votes import SCORES, read_vote, timed_verdict
from ocrl.types import Verdict, Vote

# messages, temperature, max_tokens, seed -> the judge model's reply (a bare str: a reply that stopped by itself).
Complete = Callable[[ChatMessages, float, int, int | None], Awaitable["Reply | str"]]
# judge messages ending in an assistant prefix "...\boxed{" -> {1: p, -1: p, 0: p}.
VerdictProbs = Callable[[ChatMessages], Awaitable[dict[int, float]]]

# The reference's generation budget (its run scripts' --prm-max-new-tokens) for a PRM vote: 4096
# tokens. A thinking judge spends most of them thinking.
PRM_MAX_TOKENS = 4096


# -- the seed's judge: m sampled judgements -----------------------------------------------------


class GenerateJudge:
    """The seed's PRM: m judgements sampled concurrently at `temperature`; majority of the boxes.

    Each vote may generate `max_tokens` (the reference's 4096 by default: a thinking judge needs
    them); its score is read after its thinking, and a vote cut at that budget without a score is
    `truncated` (no vote). A vote whose call raises or outlives `vote_timeout` seconds counts as
    unparseable and keeps the error as its text. Vote i is sampled with seed `seed + i` when a
    seed is given."""

    name = "generate"

    def __init__(
        self,
        complete: Complete,
        m: int = 3,
        temperature: float = 0.6,
        max_tokens: int = PRM_MAX_TOKENS,
        *,
        seed: int | None = None,
        vote_timeout: float = 600.0,
    ) -> None:
        if m < 1:
            raise ValueError("m must be at least 1")
        self.complete = complete
        self.m = m
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.seed = seed
        self.vote_timeout = vote_timeout

    async def _vote(self, messages: ChatMessages, index: int) -> Vote:
        seed = None if self.seed is None else self.seed + index
        try:
            with anyio.fail_after(self.vote_timeout):
                reply = await self.complete(messages, self.temperature, self.max_tokens, seed)
        except TimeoutError:
            return Vote(score=None, text=f"error: vote timed out after {self.vote_timeout:g}s")
        except Exception as error:  # a failed vote is an unparseable vote, not a failed verdict
            return Vote(score=None, text=f"error: {type(error).__name__}: {error}")
        return read_vote(reply)

    async def votes(self, messages: ChatMessages) -> list[Vote]:
        """m votes on one judge chat, concurrently, in index order."""
        votes: list[Vote | None] = [None] * self.m

        async def cast(index: int) -> None:
            votes[index] = await self._vote(messages, index)

        async with anyio.create_task_group() as group:
            for index in range(self.m):
                group.start_soon(cast, index)
        return [vote for vote in votes if vote is not None]

    async def judge(self, response: str, next_state: str, role: str) -> Verdict:
        return await timed_verdict(self.name, self.votes(judge_messages(response, next_state, role)))


# -- one forward pass: verdict-token probabilities ----------------------------------------------


def verdict_probs_from_logprobs(first_token_logprobs: dict[str, float], minus_then_one: float) -> dict[int, float]:
    """Verdict probabilities from the next-token log-probs after `\\boxed{`.

    `first_token_logprobs` maps token strings to log-probs at the first position; surrounding
    spaces are ignored and spellings that collapse to the same token add up. In SmolLM2's
    tokenizer (like most BPE tokenizers that split digits) "-1" is two tokens, "-" then "1", so
    P(-1) = P("-") * P("1" | "-") and `minus_then_one` is log P("1" | "-"). A leading "+" is not
    counted: "+1" would need a second look-up for a spelling judges rarely use. The result is not
    normalised (the rest of the mass is on other tokens); `VerdictJudge` renormalises it."""
    probs: dict[str, float] = {}
    for token, logprob in first_token_logprobs.items():
        key = token.strip()
        probs[key] = probs.get(key, 0.0) + _exp(logprob)
    return {1: probs.get("1", 0.0), -1: probs.get("-", 0.0) * _exp(minus_then_one), 0: probs.get("0", 0.0)}


def _exp(logprob: float) -> float:
    return math.exp(logprob) if logprob > -745 else 0.0


def _format_probs(probs: dict[int, float]) -> str:
    return f"p(+1)={probs[1]:.2f} p(-1)={probs[-1]:.2f} p(0)={probs[0]:.2f}"


class VerdictJudge:
    """One forward pass: the judge prompt is continued with the assistant prefix `\\boxed{`
    (`verdict_messages`) and `verdict_probs` returns the probabilities of the next tokens spelling
    1, -1 and 0 (see `verdict_probs_from_logprobs`). The judge renormalises them over the three
    verdicts and draws m votes from a `random.Random(seed)` kept across calls; majority as usual.
    With no probability mass on any verdict every vote is unparseable and the score is 0."""

    name = "verdict"

    def __init__(self, verdict_probs: VerdictProbs, m: int = 3, *, seed: int = 0) -> None:
        if m < 1:
            raise ValueError("m must be at least 1")
        self.verdict_probs = verdict_probs
        self.m = m
        self.rng = random.Random(seed)

    async def votes(self, response: str, next_state: str, role: str) -> list[Vote]:
        """m votes drawn from one forward's verdict probabilities."""
        raw = await self.verdict_probs(verdict_messages(response, next_state, role))
        mass = {score: max(0.0, float(raw.get(score, 0.0))) for score in SCORES}
        total = sum(mass.values())
        if total <= 0.0:
            return [Vote(score=None, text="no probability on any verdict") for _ in range(self.m)]
        probs = {score: p / total for score, p in mass.items()}
        shown = _format_probs(probs)
        draws = self.rng.choices(SCORES, weights=[probs[s] for s in SCORES], k=self.m)
        return [Vote(score=draw, text=f"{shown} -> {draw}") for draw in draws]

    async def judge(self, response: str, next_state: str, role: str) -> Verdict:
        return await timed_verdict(self.name, self.votes(response, next_state, role))
