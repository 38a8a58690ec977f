"""What agent clients add to a conversation that is not the user's: housekeeping requests and
envelopes around user text. The defaults are OpenClaw's; other agents get their own patterns
through the configuration (`--housekeeping-pattern`, `--envelope-pattern`).

- Housekeeping: a request the client makes for itself, not for its user (OpenClaw's pre-compaction
  memory flush and its compaction summary). Such a request is served as a side turn: it is
  answered, never trained on, and it never becomes the next state of the session's last main
  turn. A pattern is `ROLE:REGEX`, searched (case-insensitively, multi-line) in the text of the
  request's last message of that role (a user message with its envelope cut off); `ROLE` is
  system, user or any (the last message, whatever its role). A client that marks its turns itself (X-Turn-Type) is never second-guessed.
- Envelope: text the client wraps around what the user typed (OpenClaw's "[Fri 2026-12-04 14:34
  UTC] " timestamp prefix and its "Runtime: agent=..." trailer). Every match of every envelope
  pattern is cut from a user message before the judge reads it as a next state; the prompt the
  model saw (and is trained on) keeps it.

This module knows nothing of sessions, HTTP or the engine.
"""

from __future__ import annotations

import re

from ocrl.types import Message

# OpenClaw 2026.9: its memory-flush turn and its compaction summary request (captured bodies under
# tests/data/openclaw/).
OPENCLAW_HOUSEKEEPING = (
    "user:^Pre-compaction memory flush",
    "system:^You are a context summarization assistant",
)
OPENCLAW_ENVELOPE = (
    r"\A\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) \d{4}-\d{2}-\d{2} \d{2}:\d{2}(?::\d{2})? [A-Za-z][A-Za-z0-9+:/_-]*\] ",
    r"\n*^Runtime: agent=[^\n]*\Z",
)

ROLES = ("system", "user", "any")


class ClientRules:
    """Compiled housekeeping and envelope patterns; empty lists make it a no-op."""

    def __init__(self, housekeeping: list[str] | tuple[str, ...] = (), envelope: list[str] | tuple[str, ...] = ()):
        self.housekeeping: list[tuple[str, re.Pattern]] = []
        for pattern in housekeeping:
            role, sep, regex = pattern.partition(":")
            if not sep or role not in ROLES:
                raise ValueError(f"housekeeping pattern {pattern!r} must be ROLE:REGEX with ROLE one of {', '.join(ROLES)}")
            self.housekeeping.append((role, _compile(regex, pattern)))
        self.envelope = [_compile(regex, regex) for regex in envelope]

    @classmethod
    def from_config(cls, config) -> "ClientRules":
        return cls(config.housekeeping_pattern, config.envelope_pattern)

    def housekeeping_match(self, messages: list[Message]) -> str | None:
        """The pattern that makes this request housekeeping, or None."""
        for role, regex in self.housekeeping:
            message = _last(messages, role)
            if message is not None and message.content and regex.search(self.strip(message).content or ""):
                return f"{role}:{regex.pattern}"
        return None

    def strip(self, message: Message) -> Message:
        """The message as the user wrote it: envelopes cut from user text, others unchanged."""
        if message.role != "user" or not message.content or not self.envelope:
            return message
        text = message.content
        for regex in self.envelope:
            text = regex.sub("", text)
        if text == message.content:
            return message
        return Message(role=message.role, content=text.strip(), tool_calls=message.tool_calls, tool_call_id=message.tool_call_id, name=message.name)


def _compile(regex: str, shown: str) -> re.Pattern:
    try:
        return re.compile(regex, re.IGNORECASE | re.MULTILINE)
    except re.error as e:
        raise ValueError(f"pattern {shown!r} is not a valid regular expression: {e}") from None


def _last(messages: list[Message], role: str) -> Message | None:
    if role == "any":
        return messages[-1] if messages else None
    return next((m for m in reversed(messages) if m.role == role), None)
