"""Sessions and turns: which session a request belongs to, which turn a next state closes, and
the one sample each main turn yields, with its mask.

Rules (DESIGN.md, "The method"):
- A main turn's next state is the last message of the session's next main request; it starts
  the judging of that previous turn.
- Score +1/-1: mask 1, reward = score. Score 0: mask 0, unless the session has no effective
  (mask 1) sample yet, then promoted to mask 1. No next state (the session ended on it): mask 0,
  unless it is the session's only main turn.
- Every main turn yields exactly one sample: at its verdict, or at session end if it never got
  a next state.
- n > 1 (several samples of one prompt) opens a group in the session's next main-turn slot.
  The candidate the next main request continues (found by prefix: its reply is in that
  request's messages; candidate 0 when none is, or when the session ends first) becomes the main
  turn: it gets the next state, the verdict and the sample, as with n = 1. Its siblings never
  get a next state of their own, so they are submitted at once with mask 0 (recorded with their
  `choice` and `group_size` for inspection, never trained on): the judge scores a reply from
  what followed it, and only one reply was followed.
- --method opd|combine (see `judging.Distill`): the hint judge votes beside (combine) or instead of
  (opd) the PRM, and a turn with a hint carries the teacher's prompt in its sample.

A request without a session id is threaded by prefix: if its messages extend a known main turn's
messages + that turn's response, it continues that session. When an agent rewrites its history
(OpenClaw compacts older turns into a summary, or its system prompt changes), no prefix matches;
then the request continues the session whose last main turn's reply it contains with messages
after it (the latest such reply in the request wins; among sessions with an identical reply, the
one that answered last). Housekeeping requests and envelopes are the client rules' business
(clients.py): housekeeping is served as a side turn, and a next state reaches the judge, the
records and the sample with its envelope cut off. This module knows nothing of HTTP,
of how the judge votes or of training; it hands (turn, next state) pairs to a judging function
and finished samples to a sink. A main turn's states and their moves are `turns.py`'s; the
threading index is `session_index.py`; judging a closed turn and settling its sample by
these rules is `judging.py`; bringing sessions back after a crash is `restore.py`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from typing import Callable

import anyio

from ocrl.clients import ClientRules
from ocrl.events import NoEvents
from ocrl.jsonl import DiskFull
from ocrl.judging import Distill, JudgeFn, Judging
from ocrl.records import NoRecords
from ocrl.session_index import SessionIndex
from ocrl.turns import MainTurn, Session, Ticket, TurnState, prefix_key, response_message, sample_id, turn_sample
from ocrl.types import Completion, Hint, Message, Sample, SampleReady, SessionChanged, Turn, TurnServed

log = logging.getLogger("ocrl.sessions")


class Sessions:
    def __init__(
        self,
        *,
        judge: JudgeFn,
        submit: Callable[[Sample], None],
        records=None,
        events=None,
        default_turn_type: str = "main",
        timeout: float = 1800.0,
        parse_response: Callable[[str], tuple[str | None, list[dict]]] | None = None,
        distill: Distill | None = None,
        clients: ClientRules | None = None,
    ):
        self.submit = submit
        self.records = records if records is not None else NoRecords()
        self.events = events if events is not None else NoEvents()
        self.method = distill.method if distill else "rl"
        self.default_turn_type = default_turn_type
        self.timeout = timeout
        self.parse_response = parse_response or (lambda text: (text, []))
        self.clients = clients or ClientRules()
        self.sessions: dict[str, Session] = {}
        self.counters: Counter = Counter()
        self.index = SessionIndex(self.sessions, self.counters)
        self.judging = Judging(judge, distill, records=self.records, events=self.events, counters=self.counters, emit=self._emit)
        self._judging, self._to_judge = anyio.create_memory_object_stream[tuple[Session, MainTurn]](float("inf"))
        self._in_flight = 0

    # -- the API side -----------------------------------------------------------------------

    def begin(
        self, *, session_id: str | None, turn_type: str | None, session_done: bool, messages: list[Message], tools: list[dict] | None = None
    ) -> Ticket:
        if turn_type is None and self.clients.housekeeping_match(messages):
            # The client's own housekeeping (a memory flush, a summary): answered, never trained
            # on, and never the next state of the user's last turn. An explicit type wins.
            turn_type = "side"
            self.counters["housekeeping_turns"] += 1
        turn_type = turn_type or self.default_turn_type
        if turn_type not in ("main", "side"):
            raise ValueError(f"turn type must be 'main' or 'side', not {turn_type!r}")
        if turn_type == "main" and self.records.full:
            raise DiskFull(28, "the record dir is full: main turns cannot be kept until space returns")
        if not session_id:
            session_id = self.index.find(messages)
            if session_id is None and turn_type == "side":
                session_done = True  # a side turn of no known session: nothing to wait for
            session_id = session_id or "s-" + uuid.uuid4().hex[:16]
        session = self._session(session_id)
        session.last_seen = time.monotonic()
        if turn_type == "main" and session.turns and session.turns[-1].state == TurnState.OPEN and self._repeats(session.turns[-1], messages):
            # The same request as the open turn's, not a continuation of it: its reply never
            # reached the client (timed out or disconnected after it was generated) and this is
            # the retry (or a regenerate). The retry takes the turn's place and index; the
            # unseen reply has no next state and is never a sample (restore keeps the later).
            session.turns.pop()
            self.counters["replaced_turns"] += 1
        if turn_type == "main" and session.turns and session.turns[-1].state == TurnState.OPEN:
            if session.turns[-1].candidates:
                self._choose(session, session.turns[-1], messages)
            # The last message of this request is the next state of the previous main turn.
            self._close_turn(session, session.turns[-1], self.clients.strip(messages[-1]))
        ticket = Ticket(session_id, turn_type, session_done, messages, tools)
        if turn_type == "main":
            # A client that gave up waiting and sent the same request again: the retry is the
            # turn, the abandoned one (if it still finishes) is served as a side turn.
            ticket.key = prefix_key(messages)
            if (abandoned := session.in_flight.get(ticket.key)) is not None:
                abandoned.superseded = True
                self.counters["superseded_turns"] += 1
            session.in_flight[ticket.key] = ticket
        return ticket

    @staticmethod
    def _repeats(main_turn: MainTurn, messages: list[Message]) -> bool:
        kept = main_turn.turn.messages
        return bool(kept) and len(kept) == len(messages) and prefix_key(kept) == prefix_key(messages)

    def _done(self, ticket: Ticket) -> None:
        session = self.sessions.get(ticket.session_id)
        if session is not None and session.in_flight.get(ticket.key) is ticket:
            del session.in_flight[ticket.key]

    def complete(self, ticket: Ticket, completion: Completion) -> Turn:
        return self.complete_group(ticket, [completion])[0]

    def complete_group(self, ticket: Ticket, completions: list[Completion]) -> list[Turn]:
        """Keeps a served turn; with several completions (n > 1), a group of candidates that
        shares one main-turn slot until the next request shows which one was continued."""
        session = self._session(ticket.session_id)
        main = ticket.turn_type == "main" and not session.closed and not ticket.superseded
        n = len(completions)
        turns = [
            Turn(
                session_id=ticket.session_id,
                index=len(session.turns) if main else -1,
                turn_type="main" if main else "side",
                messages=ticket.messages,
                prompt_ids=completion.prompt_ids,
                response_ids=completion.response_ids,
                logprobs=completion.logprobs,
                response_text=completion.text,
                finish_reason=completion.finish_reason,
                weights_version=completion.weights_version,
                session_uid=session.uid if main else "",
                tools=ticket.tools,
                choice=k,
                group_size=n,
            )
            for k, completion in enumerate(completions)
        ]
        for turn in turns:  # a main turn that cannot be kept raises DiskFull here, before it counts
            self.records.turn(turn)
        self._done(ticket)
        if main:
            session.turns.append(MainTurn(turns[0], candidates=turns if n > 1 else []))
            for turn in reversed(turns):  # candidate 0 last: it is the group's reply when threading by reply
                content, calls = self.parse_response(turn.response_text)
                self.index.add(session, ticket.messages, response_message(content or "", calls))
            self.counters["main_turns"] += 1
            if n > 1:
                self.counters["group_candidates"] += n
        else:
            session.side_turns += n
            self.counters["side_turns"] += n
        seconds = time.monotonic() - ticket.started
        for turn in turns:
            self.events.publish(
                TurnServed(
                    session_id=turn.session_id, index=turn.index, turn_type=turn.turn_type, prompt_tokens=len(turn.prompt_ids),
                    completion_tokens=len(turn.response_ids), weights_version=turn.weights_version, seconds=seconds,
                )
            )
        if ticket.session_done:
            self.close(session.session_id)
        return turns

    def _reply_key(self, turn: Turn, alone: bool = False) -> str:
        """The prefix a request continuing this turn starts with: its messages and its reply
        (`alone`: the reply only, as `SessionIndex.add` keeps it for rewritten histories)."""
        content, calls = self.parse_response(turn.response_text)
        reply = response_message(content or "", calls)
        return prefix_key([reply] if alone else turn.messages + [reply])

    def _choose(
        self, session: Session, main_turn: MainTurn, messages: list[Message] | None, *, prefer: Turn | None = None,
        journaled: dict[str, bool] | None = None,
    ) -> None:
        """n > 1: the candidate `messages` continue becomes the main turn (candidate 0 when none
        is continued); its siblings are submitted now with mask 0: no next state is theirs.
        (Restoring: `prefer` is the candidate known to have been chosen; siblings already
        `journaled` are not submitted twice.)"""
        messages = messages or []
        keys = {prefix_key(messages[:end]) for end in range(1, len(messages) + 1) if messages[end - 1].role == "assistant"}
        replies = {prefix_key([m]) for m in messages if m.role == "assistant"}  # a rewritten history keeps the reply only
        chosen = (
            prefer
            or next((t for t in main_turn.candidates if self._reply_key(t) in keys), None)
            or next((t for t in main_turn.candidates if self._reply_key(t, alone=True) in replies), main_turn.candidates[0])
        )
        siblings = [t for t in main_turn.candidates if t is not chosen]
        main_turn.turn, main_turn.candidates = chosen, []
        for sibling in siblings:
            if journaled is not None and sample_id(session, sibling) in journaled:
                continue
            self.counters["group_siblings"] += 1
            self._emit(session, MainTurn(sibling), score=None, mask=0, reward=0.0, votes=[], promoted=False)

    def abort(self, ticket: Ticket) -> None:
        """A request that failed keeps no turn, and a session it said was done stays open: the
        client's retry carries the flag again (closing now would start the retry a new session
        at turn 0); a client that never retries leaves the session to the idle expiry."""
        self._done(ticket)
        self.counters["aborted_turns"] += 1

    def close(self, session_id: str) -> None:
        """Session end: the last main turn, if it never got a next state, is submitted now."""
        session = self.sessions.get(session_id)
        if session is None or session.closed:
            return
        session.closed = True
        if session.turns and session.turns[-1].state == TurnState.OPEN:
            last = session.turns[-1]
            if last.candidates:  # never continued: candidate 0 stands for the group
                self._choose(session, last, None)
            only = len(session.turns) == 1 and self.method != "opd"  # opd: no next state, no hint, nothing to learn
            self._emit(session, last, score=None, mask=1 if only else 0, reward=0.0, votes=[], promoted=False)
        self.judging.release_held(session)
        self.index.forget(session)
        self.counters["sessions_closed"] += 1
        self.sessions.pop(session_id, None)  # votes in flight keep their own reference
        self.events.publish(SessionChanged(session_id=session_id, state="closed", main_turns=len(session.turns)))

    # -- judging ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Judges closed turns as they come; owned by the daemon's task group."""
        async with anyio.create_task_group() as tg:
            async with self._to_judge:
                async for session, main_turn in self._to_judge:
                    tg.start_soon(self._judge_one, session, main_turn)

    async def expire_idle(self, every: float = 30.0) -> None:
        while True:
            await anyio.sleep(every)
            self.close_idle()

    def close_idle(self) -> None:
        now = time.monotonic()
        for session in list(self.sessions.values()):
            if not session.closed and now - session.last_seen > self.timeout:
                log.info("session %s idle for %.0fs: closed", session.session_id, now - session.last_seen)
                self.counters["sessions_expired"] += 1
                self.close(session.session_id)

    async def drain(self, timeout: float) -> None:
        """Waits (bounded) for votes in flight: used at shutdown."""
        with anyio.move_on_after(timeout):
            while self._in_flight:
                await anyio.sleep(0.05)

    def _close_turn(self, session: Session, main_turn: MainTurn, next_state: Message, *, record: bool = True) -> None:
        if record:  # durable: a crash while judging costs a re-judge, not the turn
            self.records.next_state(sample_id(session, main_turn.turn), next_state)  # DiskFull: the turn stays open
        main_turn.move(TurnState.JUDGING)
        main_turn.next_state = next_state
        self._in_flight += 1
        self._judging.send_nowait((session, main_turn))

    async def _judge_one(self, session: Session, main_turn: MainTurn) -> None:
        try:
            await self.judging.judge_turn(session, main_turn)
        finally:
            self._in_flight -= 1

    def _emit(
        self, session: Session, main_turn: MainTurn, *, score, mask, reward, votes, promoted, hint: Hint | None = None,
        experience: list[str] = (), teacher_prompt_ids: list[int] | None = None,
    ) -> None:
        if main_turn.state == TurnState.SUBMITTED:  # exactly once, whatever the order of events
            return
        main_turn.move(TurnState.SUBMITTED)
        sample = turn_sample(
            session, main_turn, score=score, mask=mask, reward=reward, votes=votes, promoted=promoted, method=self.method,
            hint=hint, experience=experience, teacher_prompt_ids=teacher_prompt_ids,
        )  # fmt: skip
        if mask:
            session.effective += 1
        self.counters["samples_mask1" if mask else "samples_mask0"] += 1
        if promoted:
            self.counters["samples_promoted"] += 1
        self.submit(sample)
        self.events.publish(SampleReady(sample=sample))

    # -- bookkeeping ------------------------------------------------------------------------

    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            session = Session(session_id)
            self.sessions[session_id] = session
            self.counters["sessions_opened"] += 1
            self.events.publish(SessionChanged(session_id=session_id, state="open", main_turns=0))
        return session

    def stats(self) -> dict:
        open_sessions = [s for s in self.sessions.values() if not s.closed]
        return {
            "sessions_open": len(open_sessions),
            "sessions_waiting_next_state": sum(s.waiting for s in open_sessions),
            "judging": self._in_flight,
            **{k: self.counters[k] for k in sorted(self.counters)},
        }
