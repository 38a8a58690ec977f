"""After a restart: brings back the sessions of an earlier process from its records, so that no
main turn is lost to a crash. It drives `Sessions` through the same steps a live request would
(threading index, group choice, closing a turn, submitting a sample); it knows nothing of files:
the caller reads the records and hands their turns, next states and journal here.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

from ocrl.turns import MainTurn, Session, TurnState, response_message, sample_id
from ocrl.types import Message, Turn

if TYPE_CHECKING:
    from ocrl.sessions import Sessions

log = logging.getLogger("ocrl.sessions")


def restore(sessions: Sessions, turns: list[Turn], next_states: dict[str, Message], journaled: dict[str, bool]) -> Counter:
    """Brings back the sessions of an earlier process that still have main turns without a
    journaled sample, so that no turn is lost to a crash. Such a turn whose next state had
    arrived is judged again; the open last turn of a session waits for its next request (by
    session id, or by prefix when text was recorded) or for the idle timeout, as before.
    `journaled` maps sample id -> effective. Call before `run`; returns what it did."""
    groups: dict[tuple[str, str], dict[int, list[Turn]]] = {}
    for turn in sorted(turns, key=lambda t: t.created):
        if turn.turn_type == "main" and turn.session_uid:
            groups.setdefault((turn.session_id, turn.session_uid), {}).setdefault(turn.index, []).append(turn)
    done: Counter = Counter()
    for (session_id, uid), by_index in groups.items():
        # a slot holds one turn, or (n > 1) the candidates of one prompt, by choice
        slots = [sorted({t.choice: t for t in by_index[i]}.values(), key=lambda t: t.choice) for i in sorted(by_index)]
        session = Session(session_id, uid=uid)
        every_id = [sample_id(session, t) for slot in slots for t in slot]
        if all(i in journaled for i in every_id):
            continue
        if [slot[0].index for slot in slots] != list(range(len(slots))):
            log.warning("session %s: recorded main turns %s have gaps; restoring what is there", session_id, [slot[0].index for slot in slots])
        if session_id in sessions.sessions:  # the id was reused: the older session ends here
            sessions.close(session_id)
        session.effective = sum(journaled.get(i, False) for i in every_id)
        sessions.sessions[session_id] = session
        sessions.counters["sessions_restored"] += 1
        for k, slot in enumerate(slots):
            main_turn = MainTurn(slot[0], candidates=slot if len(slot) > 1 else [])
            session.turns.append(main_turn)
            for turn in reversed(slot):
                if turn.messages and turn.response_text is not None:
                    content, calls = sessions.parse_response(turn.response_text)
                    sessions.index.add(session, turn.messages, response_message(content or "", calls))
            later = slots[k + 1][0] if k + 1 < len(slots) else None
            if main_turn.candidates:
                continued = next((t for t in slot if sample_id(session, t) in next_states or journaled.get(sample_id(session, t))), None)
                if continued is not None or later is not None:  # the group was resolved before the crash
                    sessions._choose(session, main_turn, [] if continued else later.messages, prefer=continued, journaled=journaled)
            turn = main_turn.turn
            sid = sample_id(session, turn)
            if sid in journaled:
                main_turn.move(TurnState.SUBMITTED)
                continue
            next_state = next_states.get(sid) or (later.messages[-1] if later and later.messages else None)
            if next_state is not None and next_state.content is not None and turn.messages:  # text recorded
                sessions._close_turn(session, main_turn, next_state, record=sid not in next_states)
                done["rejudged"] += 1
            elif next_state is not None or later is not None:  # it had one; its text was not recorded
                main_turn.next_state = next_state
                sessions._emit(session, main_turn, score=None, mask=0, reward=0.0, votes=[], promoted=False)
                done["excluded_without_text"] += 1
            else:
                done["open"] += 1  # the last turn: its next request may still come
    done["sessions"] = sessions.counters["sessions_restored"]
    return done
