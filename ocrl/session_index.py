"""Which session a request without a session id continues: the index of every open session's
main turns by prompt + reply (a request that extends one threads to it) and by the last reply
alone (a client that rewrote its history). It knows sessions only by id and key; the turns and
their states are `sessions.py`'s.
"""

from __future__ import annotations

from collections import Counter

from ocrl.turns import Session, prefix_key
from ocrl.types import Message


class SessionIndex:
    def __init__(self, sessions: dict[str, Session], counters: Counter):
        self.sessions = sessions  # the live sessions (Sessions owns them): a closed one is never found
        self.counters = counters
        self.by_prefix: dict[str, str] = {}
        self.by_reply: dict[str, str] = {}  # reply key -> the session whose last main turn gave it

    def add(self, session: Session, messages: list[Message], reply: Message) -> None:
        """Makes a main turn findable by the next request: by its prompt + reply, and (as the
        session's last) by its reply alone."""
        key = prefix_key(messages + [reply])
        self.by_prefix[key] = session.session_id
        session.prefix_keys.append(key)
        if self.by_reply.get(session.reply_key) == session.session_id:
            del self.by_reply[session.reply_key]
        session.reply_key = prefix_key([reply])
        self.by_reply[session.reply_key] = session.session_id

    def forget(self, session: Session) -> None:
        for key in session.prefix_keys:
            self.by_prefix.pop(key, None)
        if self.by_reply.get(session.reply_key) == session.session_id:
            del self.by_reply[session.reply_key]

    def find(self, messages: list[Message]) -> str | None:
        return self.by_prefix_of(messages) or self.by_reply_in(messages)

    def by_prefix_of(self, messages: list[Message]) -> str | None:
        """The session whose last known prefix this request extends (longest match wins)."""
        for end in range(len(messages) - 1, 0, -1):
            if messages[end - 1].role != "assistant":
                continue
            found = self.by_prefix.get(prefix_key(messages[:end]))
            if found in self.sessions:
                self.counters["threaded_by_prefix"] += 1
                return found
        return None

    def by_reply_in(self, messages: list[Message]) -> str | None:
        """A rewritten history: the session whose last main turn's reply this request contains,
        followed by at least one message (the latest reply in the request wins)."""
        for at in range(len(messages) - 2, -1, -1):
            if messages[at].role != "assistant":
                continue
            found = self.by_reply.get(prefix_key([messages[at]]))
            if found in self.sessions:
                self.counters["threaded_by_reply"] += 1
                return found
        return None
