"""Judging a closed main turn and settling its one sample: the judge's verdict (and, with
--method opd|combine, the hint judge's hint) on the turn's reply and its next state, then the
sample's mask, reward and teacher prompt by the method's rules (the rules are listed in
sessions.py's docstring). With --experience posthoc a judged turn is held until its session ends.

Called by `Sessions` once a turn's next state has come; hands the settled sample back through
`emit`. Knows turns and the judge functions' signatures, never how a judge votes, HTTP, or
which session a request belongs to.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Awaitable, Callable

import anyio

from ocrl.faults import crash_point
from ocrl.turns import Held, MainTurn, Session, TurnState
from ocrl.types import Hint, Turn, Verdict, VerdictReady, Vote

log = logging.getLogger("ocrl.sessions")

JudgeFn = Callable[[str, str, str], Awaitable[Verdict]]


@dataclass
class Distill:
    """What --method opd|combine adds: a hint judge, and how to build the teacher's prompt
    (the turn's prompt with hints added) as token ids.

    - opd: a turn yields a trainable sample only when the teacher has a hint for it; no reward.
    - combine: the reward as in rl, plus the teacher signal when there is a hint; a turn with
      either is trainable, one with neither follows the rl rules (at-least-one).
    - experience: session | cross-session: the accepted hints of the session's earlier turns
      (or of recent turns of any session, newest `experience_max`) join the teacher's context,
      so a turn can be distilled without a hint of its own. posthoc: a session's judged turns
      wait for its end, then each is scored with every hint of the whole session (a turn
      judged after the end gets the hints known by then)."""

    method: str  # opd | combine
    hint: Callable[[str, str, str], Awaitable[Hint]]
    teacher_prompt: Callable[[Turn, list[str]], list[int]]
    experience: str = "off"  # off | session | cross-session | posthoc
    experience_max: int = 8


class Judging:
    """The judges of one daemon and what they settle; `emit(session, main_turn, **sample)`
    submits a sample (`Sessions._emit`, which makes sure a turn yields exactly one)."""

    def __init__(self, judge: JudgeFn, distill: Distill | None, *, records, events, counters: Counter, emit: Callable[..., None]):
        self.judge_fn = judge
        self.distill = distill
        self.method = distill.method if distill else "rl"
        self._recent_hints: deque[str] = deque(maxlen=distill.experience_max if distill else 1)
        self.records = records
        self.events = events
        self.counters = counters
        self.emit = emit

    async def judge_turn(self, session: Session, main_turn: MainTurn) -> None:
        """Votes on a turn whose next state has come, then settles its sample. Never raises:
        a failing judge costs the turn its score (or hint), never its sample."""
        turn, next_state = main_turn.turn, main_turn.next_state
        started = time.monotonic()
        verdict: Verdict | None = None
        hint: Hint | None = None

        async def score() -> None:
            nonlocal verdict
            try:
                verdict = await self.judge_fn(turn.response_text, next_state.content or "", next_state.role)
            except Exception as e:  # a broken judge costs this turn its score, never its sample
                log.warning("judge failed on %s#%d: %s", turn.session_id, turn.index, e)
                self.counters["judge_failures"] += 1
                verdict = Verdict(score=0, votes=[Vote(None, f"judge error: {type(e).__name__}: {e}")], mode="error")
            verdict.seconds = verdict.seconds or time.monotonic() - started

        async def find_hint() -> None:
            nonlocal hint
            try:
                hint = await self.distill.hint(turn.response_text, next_state.content or "", next_state.role)
            except Exception as e:  # a broken hint judge costs this turn its hint, never its sample
                log.warning("hint judge failed on %s#%d: %s", turn.session_id, turn.index, e)
                self.counters["hint_failures"] += 1
                hint = Hint(hint=None, votes=[Vote(None, f"hint judge error: {type(e).__name__}: {e}")], mode="error")

        try:
            async with anyio.create_task_group() as tg:  # in combine, the two judges vote at once
                if self.method != "opd":
                    tg.start_soon(score)
                if self.method != "rl":
                    tg.start_soon(find_hint)
            crash_point("judging")
            if verdict is not None:
                self.counters[f"verdict_{verdict.score:+d}" if verdict.score else "verdict_0"] += 1
                # votes that hit the judge's token budget with no score: the budget, not the judge, failed
                self.counters["votes_truncated"] += sum(vote.truncated for vote in verdict.votes)
                self.records.verdict(turn.session_id, turn.index, verdict, next_state.content, next_state.role)
                self.events.publish(VerdictReady(session_id=turn.session_id, index=turn.index, verdict=verdict))
            if hint is not None:
                self.counters["hints_accepted" if hint.hint else "hints_none"] += 1
                self.counters["hint_votes_truncated"] += sum(vote.truncated for vote in hint.votes)
                self.records.hint(turn.session_id, turn.index, hint)
            self._settle(session, main_turn, verdict, hint)
        except Exception:  # never take the judging loop (and the daemon) down with one turn
            log.exception("settling %s#%d failed", turn.session_id, turn.index)
            self.counters["settle_failures"] += 1

    def _settle(self, session: Session, main_turn: MainTurn, verdict: Verdict | None, hint: Hint | None) -> None:
        """The sample of a judged turn: its mask, reward and (opd/combine) teacher prompt. With
        --experience posthoc the turn waits for its session to end (see `_release_held`)."""
        own = hint.hint if hint else None
        experience = [h for h in self._experience(session) if h != own]  # what was learned before this turn
        if own:
            session.hints.append(own)
            self._recent_hints.append(own)
        if self.distill and self.distill.experience == "posthoc":
            main_turn.move(TurnState.HELD)
            session.held.append(Held(main_turn, verdict, hint))
            self.release_held(session)
            return
        self._finish(session, main_turn, verdict, hint, experience)

    def release_held(self, session: Session) -> None:
        """posthoc: once the session has ended and no turn of it is being judged, every held turn
        gets the whole session's hints as the teacher's context."""
        if not session.closed or session.judging:
            return
        for held in session.held:
            own = held.hint.hint if held.hint else None
            self._finish(session, held.main_turn, held.verdict, held.hint, [h for h in self._experience(session) if h != own])
        session.held.clear()

    def _finish(self, session: Session, main_turn: MainTurn, verdict: Verdict | None, hint: Hint | None, experience: list[str]) -> None:
        own = hint.hint if hint else None
        teacher_ids = None
        if self.distill and (own or experience):
            try:
                teacher_ids = self.distill.teacher_prompt(main_turn.turn, experience + ([own] if own and own not in experience else []))
            except Exception as e:  # a prompt that cannot be rendered costs the teacher signal only
                log.warning("teacher prompt failed on %s#%d: %s", main_turn.turn.session_id, main_turn.turn.index, e)
                self.counters["teacher_prompt_failures"] += 1
        score = verdict.score if verdict is not None else None
        if self.method == "opd":
            mask, promoted = (1 if teacher_ids is not None else 0), False
        elif score or teacher_ids is not None:
            mask, promoted = 1, False
        else:
            promoted = session.effective == 0
            mask = 1 if promoted else 0
        self.emit(
            session, main_turn, score=score, mask=mask, reward=float(score or 0), votes=verdict.votes if verdict else [],
            promoted=promoted, hint=hint, experience=experience, teacher_prompt_ids=teacher_ids,
        )

    def _experience(self, session: Session) -> list[str]:
        """Earlier accepted hints the teacher sees with this turn (--experience)."""
        mode = self.distill.experience if self.distill else "off"
        if mode in ("session", "posthoc"):
            hints = session.hints
        elif mode == "cross-session":
            hints = list(self._recent_hints)
        else:
            return []
        return list(dict.fromkeys(hints))[-self.distill.experience_max :]  # each once, newest kept
