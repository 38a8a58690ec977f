"""Types that cross module lines: what the engine returns, the turns sessions keep, the judge's
verdicts, the training samples, and the events the dashboard subscribes to.

Every struct here is a msgspec Struct so the same definition is the wire format (records, SSE
events) and the validation. Nothing here knows HTTP, torch or the model.
"""

from __future__ import annotations

import time
from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "tool_calls", "abort"]
TurnType = Literal["main", "side"]


class Grammar(msgspec.Struct, frozen=True):
    """A constraint on a completion's text (built by ocrl.grammar from response_format or
    tool_choice). `regex` is the language the transformers engine enforces token by token;
    `json_schema`, when the constraint is a JSON schema, is that schema, which SGLang enforces
    with its own backend; `source` says what asked for it (for logs and errors)."""

    regex: str
    source: str
    json_schema: str | None = None


class SamplingParams(msgspec.Struct, frozen=True):
    """How the engine samples one completion. temperature 0 means greedy; a grammar restricts
    which tokens may be sampled (the recorded log-probs stay those of the unconstrained model)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0
    grammar: Grammar | None = None


class TopLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


class TokenChunk(msgspec.Struct):
    """A piece of a completion as it streams: new token ids, their log-probs, the text they
    completed (stop strings and partial UTF-8 already held back)."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    top_logprobs: list[list[TopLogprob]] = []


class Completion(msgspec.Struct):
    """A finished completion: response ids exactly as sampled and one raw log-prob per id."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: FinishReason
    weights_version: int
    top_logprobs: list[list[TopLogprob]] = []
    cached_tokens: int = 0  # prompt tokens the engine did not prefill (its prefix cache)


class Message(msgspec.Struct, omit_defaults=True):
    """An OpenAI chat message after normalisation (content is plain text)."""

    role: str
    content: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class Turn(msgspec.Struct, kw_only=True):
    """One served completion as sessions keep it."""

    session_id: str
    index: int  # position among the session's main turns; -1 for side turns
    turn_type: TurnType
    messages: list[Message]
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    response_text: str
    finish_reason: FinishReason
    weights_version: int
    created: float = msgspec.field(default_factory=time.time)
    session_uid: str = ""  # tells apart two sessions that reused one id; part of the sample id
    tools: list[dict] | None = None  # the tools the prompt was rendered with (a teacher prompt re-renders it)
    choice: int = 0  # n > 1: this candidate's place among the samples of one prompt
    group_size: int = 1  # n: how many candidates were sampled for this prompt


class Vote(msgspec.Struct):
    """One judge vote: the parsed score (None when unparseable) and the text that produced it;
    `truncated`: it ran into the judge's token budget before giving a score."""

    score: int | None
    text: str
    truncated: bool = False


class Verdict(msgspec.Struct):
    """The judge's majority over its votes: +1, -1 or 0 (tie or nothing parseable)."""

    score: int
    votes: list[Vote]
    mode: str
    seconds: float = 0.0
    truncated: int = 0  # votes cut at the token budget with no score


class Hint(msgspec.Struct):
    """The hint judge's answer on one turn: the accepted hindsight hint (None when no vote gave
    a usable one) and every vote (score +1: the next state carries a usable hint)."""

    hint: str | None
    votes: list[Vote]
    mode: str
    seconds: float = 0.0


class Sample(msgspec.Struct, kw_only=True):
    """A training sample: prompt ids + the exact response ids sampled, one mask and one rollout
    log-prob per response token, the scalar reward. With --method opd|combine a sample may also
    carry a distillation signal: the teacher scores the same response ids under
    `teacher_prompt_ids` (the prompt with the hint, and any experience, added)."""

    sample_id: str
    session_id: str
    turn_index: int
    tokens: list[int]
    response_length: int
    loss_mask: list[int]
    rollout_logprobs: list[float]
    reward: float
    weights_version: int
    score: int | None  # the verdict's score; None when the turn had no next state
    votes: list[Vote] = []
    promoted: bool = False  # mask forced to 1 by the at-least-one rule
    next_state: str | None = None
    next_state_role: str | None = None
    created: float = msgspec.field(default_factory=time.time)
    method: str = "rl"  # the --method that built it: rl | opd | combine
    hint: str | None = None  # the turn's own accepted hint
    experience: list[str] = []  # earlier hints given to the teacher as context (--experience)
    hint_votes: list[Vote] = []
    teacher_prompt_ids: list[int] | None = None  # set when the sample carries a distillation signal
    choice: int = 0  # n > 1: which candidate of its group this is (see Turn)
    group_size: int = 1

    @property
    def effective(self) -> bool:
        return any(self.loss_mask)

    @property
    def distilled(self) -> bool:
        """Carries a distillation signal (teacher log-probs under a hinted prompt)."""
        return self.teacher_prompt_ids is not None

    @property
    def kind(self) -> str:
        """rl (a reward only), opd (a teacher signal only), combine (both) or none."""
        rl = self.method != "opd" and (self.score not in (None, 0) or self.promoted)
        return {(True, True): "combine", (True, False): "rl", (False, True): "opd"}.get((rl, self.distilled), "none")


# Events: a tagged union published in-process and over /v1/ocrl/events.


class TurnServed(msgspec.Struct, tag="turn"):
    session_id: str
    index: int
    turn_type: TurnType
    prompt_tokens: int
    completion_tokens: int
    weights_version: int
    seconds: float
    at: float = msgspec.field(default_factory=time.time)


class VerdictReady(msgspec.Struct, tag="verdict"):
    session_id: str
    index: int
    verdict: Verdict
    at: float = msgspec.field(default_factory=time.time)


class SampleReady(msgspec.Struct, tag="sample"):
    sample: Sample
    at: float = msgspec.field(default_factory=time.time)


class SessionChanged(msgspec.Struct, tag="session"):
    session_id: str
    state: Literal["open", "closed"]
    main_turns: int
    at: float = msgspec.field(default_factory=time.time)


class TrainStep(msgspec.Struct, tag="step"):
    step: int
    weights_version: int
    metrics: dict[str, float]
    teacher_advantages: dict[str, float] = {}  # sample id -> token mean of teacher - old (opd/combine)
    at: float = msgspec.field(default_factory=time.time)


class WeightsSwapped(msgspec.Struct, tag="swap"):
    weights_version: int
    seconds: float
    verified: bool
    at: float = msgspec.field(default_factory=time.time)


class Progress(msgspec.Struct, tag="progress"):
    task: str
    done: float
    total: float
    at: float = msgspec.field(default_factory=time.time)


class Log(msgspec.Struct, tag="log"):
    level: str
    message: str
    at: float = msgspec.field(default_factory=time.time)


Event = TurnServed | VerdictReady | SampleReady | SessionChanged | TrainStep | WeightsSwapped | Progress | Log
