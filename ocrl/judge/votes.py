"""Votes and what they add up to: the rules every judge shares.

A vote is read from a judge model's `Reply`: the answer part after its thinking (a `<think>`
never closed is no answer), the last `\\boxed{}` score as the reference parses it, and
`truncated` when the reply ran into its token budget without a score. The verdict is the
majority of the votes; the hint is the longest usable hint of a +1 vote. `timed_verdict` and
`timed_hint` are the one place a judge's votes become its timed `Verdict` or `Hint`. The `Judge`
protocol is what sessions call. This module knows nothing of prompts, models or engines.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Awaitable, Iterable, Sequence
from typing import Protocol

import msgspec

from ocrl.judge.prompts import HINT_END, HINT_START
from ocrl.types import Hint, Verdict, Vote

SCORES = (1, -1, 0)


class Reply(msgspec.Struct):
    """What a judge model answered: its text (thinking included, as `<think>...</think>`, when the
    model thinks) and why it stopped; "length" means it ran into its token budget."""

    text: str
    finish_reason: str = "stop"


class Judge(Protocol):
    """Scores a response from the next state that followed it; `role` is "user" or "tool"."""

    name: str

    async def judge(self, response: str, next_state: str, role: str) -> Verdict: ...


# -- reading one vote ---------------------------------------------------------------------------

# What the reference accepts: a box holding one digit with an optional sign and nothing else.
_BOXED = re.compile(r"\\boxed\{([-+]?\d)\}")
THINK_START, THINK_END = "<think>", "</think>"


def after_thinking(text: str) -> str | None:
    """The answer part of a judge's text: what follows its last `</think>`, the whole text when it
    did not think, None when a `<think>` was never closed (the vote stopped mid-thought)."""
    if THINK_END in text:
        return text.rsplit(THINK_END, 1)[1]
    return None if THINK_START in text else text


def parse_boxed(text: str) -> int | None:
    """The score of a vote, parsed as the reference parses it, after the thinking: of the boxes
    that hold a single digit with an optional sign (`\\boxed{1}`, `\\boxed{+1}`, `\\boxed{-0}`),
    the last; it counts when it is 1, -1 or 0, else the vote is unparseable (`\\boxed{2}` as the
    last such box is not skipped for an earlier one). Boxes with anything else inside
    (`\\boxed{ 1 }`, `\\boxed{10}`, `\\boxed{good}`) are not scores and are passed over."""
    answer = after_thinking(text or "")
    digits = _BOXED.findall(answer) if answer is not None else []
    if not digits:
        return None
    score = int(digits[-1])
    return score if score in SCORES else None


def read_vote(reply: Reply | str) -> Vote:
    """A vote from a judge's reply. A reply cut at its token budget with no score is `truncated`:
    no vote, counted apart, since it says the budget (not the judge) failed."""
    reply = Reply(reply) if isinstance(reply, str) else reply
    score = parse_boxed(reply.text)
    return Vote(score=score, text=reply.text, truncated=score is None and reply.finish_reason == "length")


# -- what the votes add up to -------------------------------------------------------------------


def majority(scores: Iterable[int | None]) -> int:
    """The strictly most frequent parsed score; a tie for the top, or no parsed score, gives 0."""
    counts = Counter(score for score in scores if score is not None).most_common()
    if not counts or (len(counts) > 1 and counts[0][1] == counts[1][1]):
        return 0
    return counts[0][0]


_HINT_BLOCK = re.compile(re.escape(HINT_START) + r"(.*?)" + re.escape(HINT_END), re.S)


def parse_hint(text: str) -> str | None:
    """The text of the last complete hint block after the judge's thinking, whitespace collapsed;
    None without one (a block drafted inside the thinking is not the answer)."""
    blocks = _HINT_BLOCK.findall(after_thinking(text or "") or "")
    return " ".join(blocks[-1].split()) if blocks else None


def select_hint(votes: Sequence[Vote], min_chars: int = 10) -> str | None:
    """The hint of the votes: the longest hint of a vote that scored +1 (the next state carries
    a usable hint), when it is longer than `min_chars` characters; else None (no OPD signal)."""
    hints = [parse_hint(vote.text) for vote in votes if vote.score == 1]
    usable = [hint for hint in hints if hint and len(hint) > min_chars]
    return max(usable, key=len) if usable else None


async def _timed(votes: Awaitable[list[Vote]]) -> tuple[list[Vote], float]:
    started = time.perf_counter()
    done = await votes
    return done, time.perf_counter() - started


async def timed_verdict(mode: str, votes: Awaitable[list[Vote]]) -> Verdict:
    """The verdict of a judge's votes, awaited here: their majority, how many were cut at their
    token budget, and the seconds they took."""
    done, seconds = await _timed(votes)
    return Verdict(
        score=majority(vote.score for vote in done),
        votes=done,
        mode=mode,
        seconds=seconds,
        truncated=sum(vote.truncated for vote in done),
    )


async def timed_hint(mode: str, votes: Awaitable[list[Vote]], min_chars: int) -> Hint:
    """The hint of a hint judge's votes, awaited here (`select_hint`), and the seconds they took."""
    done, seconds = await _timed(votes)
    return Hint(hint=select_hint(done, min_chars), votes=done, mode=mode, seconds=seconds)
