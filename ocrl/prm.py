"""The PRM: scores one assistant turn from the next state of its session.

The next state is the message that followed the turn: the user's reply or a tool's result. This
module owns the judge prompt, the parsing of `\\boxed{..}` votes, the majority over m votes and
three judges behind one `Judge` protocol:

- `GenerateJudge`, the seed's PRM: m sampled judgements, run concurrently, majority vote.
- `VerdictJudge`: one forward pass; m votes drawn from the verdict-token probabilities.
- `EmbedJudge`, the CPU default: a learned head over sentence embeddings of the next state
  (in `ocrl.judge.embed`, re-exported here).

It also holds `evaluate` / `load_cases` to measure a judge on labelled cases. It knows nothing of
HTTP, sessions, engines or training: the model calls come in as callables.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import anyio
import msgspec

from ocrl.types import Hint, Verdict, Vote

if TYPE_CHECKING:
    import torch

# Messages as OpenAI chat dicts: {"role": ..., "content": ...}.
ChatMessages = list[dict]


class Reply(msgspec.Struct):
    """What a judge model answered: its text (thinking included, as `<think>...</think>`, when the
    model thinks) and why it stopped; "length" means it ran into its token budget."""

    text: str
    finish_reason: str = "stop"


# messages, temperature, max_tokens, seed -> the judge model's reply (a bare str: a reply that stopped by itself).
Complete = Callable[[ChatMessages, float, int, int | None], Awaitable["Reply | str"]]

# The reference's generation budgets (its run scripts' --prm-max-new-tokens): 4096 tokens for a PRM
# vote, 8192 for a hint vote. A thinking judge spends most of them thinking.
PRM_MAX_TOKENS = 4096
HINT_MAX_TOKENS = 8192
# judge messages ending in an assistant prefix "...\boxed{" -> {1: p, -1: p, 0: p}.
VerdictProbs = Callable[[ChatMessages], Awaitable[dict[int, float]]]

SCORES = (1, -1, 0)

# -- votes --------------------------------------------------------------------------------------

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


def majority(scores: Iterable[int | None]) -> int:
    """The strictly most frequent parsed score; a tie for the top, or no parsed score, gives 0."""
    counts = Counter(score for score in scores if score is not None).most_common()
    if not counts or (len(counts) > 1 and counts[0][1] == counts[1][1]):
        return 0
    return counts[0][0]


class Judge(Protocol):
    """Scores a response from the next state that followed it; `role` is "user" or "tool"."""

    name: str

    async def judge(self, response: str, next_state: str, role: str) -> Verdict: ...


# -- the judge prompt ---------------------------------------------------------------------------

# The rules are the reference's (openclaw-rl/openclaw_api_server.py, _build_prm_judge_prompt), in
# our words; what ocrl adds (complaints about length, tone or format; "ok" and an empty tool output
# as neutral) is listed with its reason in
# docs/DESIGN-departures.md ("Departures from the reference").
_RUBRIC = """\
You are a process reward model: you judge one output of an AI assistant by what happened next. \
You see the output and the "next state" that followed it, and you decide whether the output did \
what the user wanted at that step, taking the next state as the evidence.

The next state is either the user's next message, or the result of a tool the assistant called. \
A tool result only exists because the assistant made the call; a clean result with no error means \
the call worked, which is good.

Score 1 (good) when the next state shows the step went as intended: the user moves on to \
something else, thanks the assistant or approves, the environment reports success, or a tool \
returns a result without error (data, a listing, a success status, passing tests).

Score -1 (bad) when the next state shows the output was wrong, incomplete or not wanted, notably:
- the user asks for the same thing to be done again ("again", "retry", "one more time");
- the user asks to change or fix what was just done ("make it X instead", "no, I meant ...", \
"not that", "please fix ...");
- the user repeats or rewords the same request, so it was not understood or not done;
- the user complains about length, tone or format, or says it still does not work;
- the tool or environment returns an error, a failure, a traceback or a non-zero exit code.

Score 0 (neutral) when the next state is ambiguous: an unrelated follow-up that neither confirms \
nor denies that the step worked, a bare acknowledgement such as "ok", an empty tool output, \
or too little to tell.

A request to change what the assistant just did is negative feedback, never a neutral new \
instruction: it says the output did not meet the need."""

_ANSWER_WITH_REASONING = (
    "Think it through step by step: first say whether the next state is (a) progress, (b) a "
    "correction, redo or change request, or (c) ambiguous; then give the score alone on the last "
    "line as \\boxed{1}, \\boxed{-1} or \\boxed{0}."
)
_ANSWER_ONLY = "Answer with the score alone: \\boxed{1}, \\boxed{-1} or \\boxed{0}."

# The assistant prefix the verdict judge continues: the next token is the verdict.
VERDICT_PREFIX = "\\boxed{"

_SOURCES = {
    "user": "the user's next message",
    "tool": "the output of the tool the assistant called",
}


def _clip(text: str, limit: int) -> str:
    """Keep the head and the tail of a long text: errors and verdicts tend to sit at the ends."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


def judge_messages(
    response: str, next_state: str, role: str, *, reasoning: bool = True, max_chars: int = 6000
) -> ChatMessages:
    """The judge's chat: the rubric as system message, the response and next state as user
    message. With `reasoning=False` it asks for the boxed score alone (the verdict judge)."""
    source = _SOURCES.get(role, f"a message from the {role or 'environment'}")
    answer = _ANSWER_WITH_REASONING if reasoning else _ANSWER_ONLY
    user = (
        f"Assistant reply:\n<reply>\n{_clip(response, max_chars)}\n</reply>\n\n"
        f"Next state, {source}:\n<next_state>\n{_clip(next_state, max_chars)}\n</next_state>\n\n"
        f"How good was the assistant reply, judging by the next state? {answer}"
    )
    return [{"role": "system", "content": f"{_RUBRIC}\n\n{answer}"}, {"role": "user", "content": user}]


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
        started = time.perf_counter()
        done = await self.votes(judge_messages(response, next_state, role))
        return Verdict(
            score=majority(vote.score for vote in done),
            votes=done,
            mode=self.name,
            seconds=time.perf_counter() - started,
            truncated=sum(vote.truncated for vote in done),
        )


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
    """One forward pass: the judge prompt is continued with the assistant prefix `\\boxed{` and
    `verdict_probs` returns the probabilities of the next tokens spelling 1, -1 and 0 (see
    `verdict_probs_from_logprobs`). The judge renormalises them over the three verdicts and
    draws m votes from a `random.Random(seed)` kept across calls; majority as usual. With no
    probability mass on any verdict every vote is unparseable and the score is 0."""

    name = "verdict"

    def __init__(self, verdict_probs: VerdictProbs, m: int = 3, *, seed: int = 0) -> None:
        if m < 1:
            raise ValueError("m must be at least 1")
        self.verdict_probs = verdict_probs
        self.m = m
        self.rng = random.Random(seed)

    @staticmethod
    def messages(response: str, next_state: str, role: str) -> ChatMessages:
        """The judge chat ending in the assistant prefix; the engine must render it as a prefix
        to continue (no end-of-turn token after it), e.g. `continue_final_message=True`."""
        return [
            *judge_messages(response, next_state, role, reasoning=False),
            {"role": "assistant", "content": VERDICT_PREFIX},
        ]

    async def judge(self, response: str, next_state: str, role: str) -> Verdict:
        started = time.perf_counter()
        raw = await self.verdict_probs(self.messages(response, next_state, role))
        mass = {score: max(0.0, float(raw.get(score, 0.0))) for score in SCORES}
        total = sum(mass.values())
        if total <= 0.0:
            votes = [Vote(score=None, text="no probability on any verdict") for _ in range(self.m)]
        else:
            probs = {score: p / total for score, p in mass.items()}
            shown = _format_probs(probs)
            draws = self.rng.choices(SCORES, weights=[probs[s] for s in SCORES], k=self.m)
            votes = [Vote(score=draw, text=f"{shown} -> {draw}") for draw in draws]
        return Verdict(
            score=majority(vote.score for vote in votes),
            votes=votes,
            mode=self.name,
            seconds=time.perf_counter() - started,
        )


# -- the CPU default: an embedding classifier of the next state ---------------------------------
# It lives in ocrl.judge.embed (encoder, features, the learned head and its fit); re-exported here
# so every judge is reachable from this module.
from ocrl.judge.embed import EmbedJudge, SentenceEncoder, tool_failure  # noqa: E402,F401


# -- the hint judge (--method opd|combine) -----------------------------------------------------

HINT_START, HINT_END = "[HINT]", "[/HINT]"

_HINT_RUBRIC = f"""\
You read one reply of an AI assistant and the message that came right after it, the "next \
state": the user's next message or the output of a tool the assistant called. Decide whether \
the next state reveals something the assistant should have known when it wrote the reply: a \
correction, a preference about length, tone or format, a missing step, a fact, an error to avoid.

If it does, write that lesson as a short instruction to the assistant (one or two sentences, \
imperative, general enough to apply before the reply was written) between {HINT_START} and \
{HINT_END}, then give \\boxed{{1}} on the last line. If the next state teaches nothing (thanks, \
approval, a new unrelated task, an empty output), answer \\boxed{{-1}} with no hint."""

_HINT_BLOCK = re.compile(re.escape(HINT_START) + r"(.*?)" + re.escape(HINT_END), re.S)


def hint_messages(response: str, next_state: str, role: str, *, max_chars: int = 6000) -> ChatMessages:
    """The hint judge's chat: its rubric as system message, the reply and next state as user message."""
    source = _SOURCES.get(role, f"a message from the {role or 'environment'}")
    user = (
        f"Assistant reply:\n<reply>\n{_clip(response, max_chars)}\n</reply>\n\n"
        f"Next state, {source}:\n<next_state>\n{_clip(next_state, max_chars)}\n</next_state>\n\n"
        f"Does the next state teach the assistant something? Hint between {HINT_START} and {HINT_END}, then \\boxed{{1}}; "
        "or \\boxed{-1}."
    )
    return [{"role": "system", "content": _HINT_RUBRIC}, {"role": "user", "content": user}]


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


class GenerateHintJudge:
    """m concurrent votes of an LLM on (reply, next state), each a boxed +1/-1 and, with +1, a
    hint between markers; `select_hint` keeps the longest. A failed vote is unparseable."""

    name = "generate-hint"

    def __init__(self, complete: Complete, m: int = 3, temperature: float = 0.6, max_tokens: int = HINT_MAX_TOKENS, *,
                 min_chars: int = 10, seed: int | None = None, vote_timeout: float = 600.0) -> None:
        self.voter = GenerateJudge(complete, m, temperature, max_tokens, seed=seed, vote_timeout=vote_timeout)
        self.min_chars = min_chars

    async def hint(self, response: str, next_state: str, role: str) -> Hint:
        started = time.perf_counter()
        votes = await self.voter.votes(hint_messages(response, next_state, role))
        return Hint(hint=select_hint(votes, self.min_chars), votes=votes, mode=self.name, seconds=time.perf_counter() - started)


class EmbedHintJudge:
    """The CPU hint judge: where `EmbedJudge` reads the next state as a correction (a user's
    complaint or redo request, a tool's error), the next state's own words are the hint, since
    they name what was wrong; anything else carries no hint. One deterministic vote."""

    name = "embed-hint"

    def __init__(self, judge: EmbedJudge, *, min_chars: int = 10, max_chars: int = 600) -> None:
        self.judge = judge
        self.min_chars = min_chars
        self.max_chars = max_chars

    def vote(self, next_state: str, role: str) -> Vote:
        verdict = self.judge.classify(next_state, role)
        if verdict.score != -1:
            return Vote(score=-1, text=f"{verdict.text}: no correction, no hint")
        words = " ".join(next_state.split())
        return Vote(score=1, text=f"{verdict.text}: {HINT_START}{_clip(words, self.max_chars)}{HINT_END}")

    async def hint(self, response: str, next_state: str, role: str) -> Hint:
        started = time.perf_counter()
        vote = await anyio.to_thread.run_sync(self.vote, next_state, role)
        return Hint(hint=select_hint([vote], self.min_chars), votes=[vote], mode=self.name, seconds=time.perf_counter() - started)


# -- measuring a judge --------------------------------------------------------------------------


class Case(msgspec.Struct):
    """One labelled example: a response, its next state and the verdict a good judge gives."""

    response: str
    next_state: str
    role: str
    expected: Literal[1, -1, 0]
    kind: str = ""


def load_cases(path: str | Path) -> list[Case]:
    """Cases from a JSONL file, one object per line; decoding with the type validates them."""
    decoder = msgspec.json.Decoder(Case)
    return [decoder.decode(line) for line in Path(path).read_bytes().splitlines() if line.strip()]


async def evaluate(judge: Judge, cases: Sequence[Case], *, show: bool = True) -> dict:
    """Accuracy of a judge on cases, one at a time. `confusion[expected][predicted]` counts the
    verdicts; `misses` lists the cases it got wrong with the first vote's text. With `show` it
    prints the report (`format_report`): accuracy, the confusion matrix and every miss."""
    confusion = {expected: {predicted: 0 for predicted in SCORES} for expected in SCORES}
    misses = []
    started = time.perf_counter()
    for case in cases:
        verdict = await judge.judge(case.response, case.next_state, case.role)
        confusion[case.expected][verdict.score] += 1
        if verdict.score != case.expected:
            first = verdict.votes[0].text if verdict.votes else ""
            misses.append(
                {"kind": case.kind, "next_state": case.next_state, "expected": case.expected,
                 "score": verdict.score, "vote": first}
            )
    n = len(cases)
    correct = sum(confusion[score][score] for score in SCORES)
    report = {
        "judge": judge.name,
        "n": n,
        "accuracy": correct / n if n else 0.0,
        "confusion": confusion,
        "seconds_per_case": (time.perf_counter() - started) / n if n else 0.0,
        "misses": misses,
    }
    if show:
        print(format_report(report))
    return report


def format_report(report: dict) -> str:
    """An `evaluate` report as text: accuracy, the confusion matrix (rows: expected, columns:
    the judge's score) and one line per miss."""
    confusion = report["confusion"]
    correct = sum(confusion[score][score] for score in SCORES)
    lines = [
        f"judge {report['judge']}: {correct}/{report['n']} = {report['accuracy']:.3f}, "
        f"{1000 * report['seconds_per_case']:.0f} ms/case",
        "expected \\ judged     +1     -1      0",
    ]
    for expected in SCORES:
        lines.append(f"{expected:>+17d} " + " ".join(f"{confusion[expected][judged]:>6d}" for judged in SCORES))
    lines.append(f"misses ({len(report['misses'])}):")
    for miss in report["misses"]:
        state = " ".join(miss["next_state"].split())
        state = state if len(state) <= 90 else state[:87] + "..."
        lines.append(f"  {miss['expected']:+d} judged {miss['score']:+d}  [{miss['kind']}] {state!r}  ({miss['vote']})")
    return "\n".join(lines)
