"""The hint judges (--method opd|combine): what the next state teaches the assistant, as a hint.

- `GenerateHintJudge`: m concurrent LLM votes on the hint chat (`ocrl.judge.prompts`), each a
  boxed +1/-1 and, with +1, a hint between markers; the longest usable hint wins.
- `EmbedHintJudge`, the CPU default: where the embed judge reads the next state as a
  correction, the next state's own words are the hint.

Hints are read and selected by `ocrl.judge.votes`. This module knows nothing of sessions, the
teacher's prompt or training.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio

from ocrl.judge.llm import Complete, GenerateJudge
from ocrl.judge.prompts import HINT_END, HINT_START, clip, hint_messages
from ocrl.judge.votes import timed_hint
from ocrl.types import Hint, Vote

if TYPE_CHECKING:
    from ocrl.judge.embed import EmbedJudge

# The reference's generation budget for a hint vote (its full-weight run scripts): 8192 tokens.
HINT_MAX_TOKENS = 8192


class GenerateHintJudge:
    """m concurrent votes of an LLM on (reply, next state), each a boxed +1/-1 and, with +1, a
    hint between markers; `select_hint` keeps the longest. A failed vote is unparseable."""

    name = "generate-hint"

    def __init__(self, complete: Complete, m: int = 3, temperature: float = 0.6, max_tokens: int = HINT_MAX_TOKENS, *,
                 min_chars: int = 10, seed: int | None = None, vote_timeout: float = 600.0) -> None:
        self.voter = GenerateJudge(complete, m, temperature, max_tokens, seed=seed, vote_timeout=vote_timeout)
        self.min_chars = min_chars

    async def hint(self, response: str, next_state: str, role: str) -> Hint:
        return await timed_hint(self.name, self.voter.votes(hint_messages(response, next_state, role)), self.min_chars)


class EmbedHintJudge:
    """The CPU hint judge: where `EmbedJudge` reads the next state as a correction (a user's
    complaint or redo request, a tool's error), the next state's own words are the hint, since
    they name what was wrong; anything else carries no hint. One deterministic vote."""

    name = "embed-hint"

    def __init__(self, judge: EmbedJudge, *, min_chars: int = 10, max_chars: int = 600) -> None:
        self.judge = judge
        self.min_chars = min_chars
        self.max_chars = max_chars

    def vote(self, next_state: str, role: str, response: str = "") -> Vote:
        verdict = self.judge.classify(next_state, role, response)
        if verdict.score != -1:
            return Vote(score=-1, text=f"{verdict.text}: no correction, no hint")
        words = " ".join(next_state.split())
        return Vote(score=1, text=f"{verdict.text}: {HINT_START}{clip(words, self.max_chars)}{HINT_END}")

    async def _votes(self, next_state: str, role: str, response: str) -> list[Vote]:
        return [await anyio.to_thread.run_sync(self.vote, next_state, role, response)]

    async def hint(self, response: str, next_state: str, role: str) -> Hint:
        return await timed_hint(self.name, self._votes(next_state, role, response), self.min_chars)
