"""A session's main turns and their states: the one place that says which state follows which.

A main turn moves open -> judging -> (held ->) submitted, or straight to submitted when it never
gets a next state (session end, a group's sibling, a restored turn already journaled). `held`
is --experience posthoc: judged, waiting for the session to end. Also here: the keys that thread
a request to its session (`prefix_key`), a turn's sample id, and its sample assembled once
sessions.py has decided its mask and reward. This module knows nothing of judging, records or
events; `sessions.py` drives these states.
"""

from __future__ import annotations

import enum
import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field

import msgspec

from ocrl.types import Hint, Message, Sample, Turn, Verdict


class TurnState(enum.StrEnum):
    OPEN = "open"  # served; waits for its next state (the session's next main request)
    JUDGING = "judging"  # its next state arrived; the judge votes
    HELD = "held"  # --experience posthoc: judged, waits for its session's end
    SUBMITTED = "submitted"  # its one sample is out


_NEXT: dict[TurnState, frozenset[TurnState]] = {
    TurnState.OPEN: frozenset({TurnState.JUDGING, TurnState.SUBMITTED}),
    TurnState.JUDGING: frozenset({TurnState.HELD, TurnState.SUBMITTED}),
    TurnState.HELD: frozenset({TurnState.SUBMITTED}),
    TurnState.SUBMITTED: frozenset(),
}


@dataclass
class Ticket:
    session_id: str
    turn_type: str
    session_done: bool
    messages: list[Message]
    tools: list[dict] | None = None
    started: float = field(default_factory=time.monotonic)
    key: str = ""  # prefix key of `messages` (main turns): a retry of the same request has the same
    superseded: bool = False  # a retry of this request arrived while it generated: the retry is the turn


@dataclass
class MainTurn:
    turn: Turn
    state: TurnState = TurnState.OPEN
    next_state: Message | None = None
    candidates: list[Turn] = field(default_factory=list)  # n > 1, until one is continued; `turn` is then that one

    def move(self, to: TurnState) -> None:
        if to not in _NEXT[self.state]:
            raise ValueError(f"turn {self.turn.session_id}#{self.turn.index}: no move from {self.state} to {to}")
        self.state = to


class Held(msgspec.Struct):
    """A judged turn waiting (--experience posthoc) for its session's end."""

    main_turn: MainTurn
    verdict: Verdict | None
    hint: Hint | None


@dataclass
class Session:
    session_id: str
    uid: str = field(default_factory=lambda: uuid.uuid4().hex[:8])  # a reused session id is a new session
    turns: list[MainTurn] = field(default_factory=list)
    side_turns: int = 0
    effective: int = 0  # samples submitted with mask 1
    closed: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    prefix_keys: list[str] = field(default_factory=list)
    reply_key: str = ""  # the last main turn's reply, for threading through history rewrites
    hints: list[str] = field(default_factory=list)  # accepted hints, in order (--experience session|posthoc)
    held: list[Held] = field(default_factory=list)  # posthoc: judged turns waiting for the session's end
    in_flight: dict = field(default_factory=dict)  # prefix key -> the main Ticket generating for it

    @property
    def judging(self) -> int:
        return sum(t.state == TurnState.JUDGING for t in self.turns)

    @property
    def waiting(self) -> bool:
        """Its last main turn waits for a next state."""
        return bool(self.turns) and self.turns[-1].state == TurnState.OPEN


def _message_key(message: Message) -> list:
    calls = [
        (c.get("function", {}).get("name"), json.dumps(_loads(c.get("function", {}).get("arguments")), sort_keys=True))
        for c in (message.tool_calls or [])
    ]
    return [message.role, (message.content or "").strip(), calls, message.tool_call_id or ""]


def _loads(value):
    try:
        return json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        return value


def prefix_key(messages: list[Message]) -> str:
    return hashlib.sha256(json.dumps([_message_key(m) for m in messages]).encode()).hexdigest()


def response_message(text: str, tool_calls: list[dict]) -> Message:
    return Message(role="assistant", content=text if not tool_calls else (text or None), tool_calls=tool_calls or None)


def sample_id(session: Session, turn: Turn) -> str:
    group = f"/{turn.choice}" if turn.group_size > 1 else ""
    return f"{turn.session_id}:{session.uid}:{turn.index}{group}"


def turn_sample(
    session: Session, main_turn: MainTurn, *, score, mask: int, reward: float, votes, promoted: bool, method: str,
    hint: Hint | None = None, experience=(), teacher_prompt_ids: list[int] | None = None,
) -> Sample:
    """The one sample of `main_turn`, with the mask and reward sessions.py decided for it: its
    tokens, rollout log-probs, verdict, next state and (--method opd|combine) hint."""
    turn, next_state = main_turn.turn, main_turn.next_state
    n = len(turn.response_ids)
    return Sample(
        sample_id=sample_id(session, turn),
        session_id=turn.session_id,
        turn_index=turn.index,
        tokens=turn.prompt_ids + turn.response_ids,
        response_length=n,
        loss_mask=[mask] * n,
        rollout_logprobs=turn.logprobs,
        reward=reward,
        weights_version=turn.weights_version,
        score=score,
        votes=votes,
        promoted=promoted,
        next_state=next_state.content if next_state else None,
        next_state_role=next_state.role if next_state else None,
        method=method,
        hint=hint.hint if hint else None,
        experience=list(experience),
        hint_votes=hint.votes if hint else [],
        teacher_prompt_ids=teacher_prompt_ids,
        choice=turn.choice,
        group_size=turn.group_size,
    )
