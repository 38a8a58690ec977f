"""The operator's view of HTTP traffic: one plain log line per request, and refusals counted by
reason for /v1/ocrl/stats and the dashboard.

An ASGI wrapper around the whole app (authentication included, so a 401 is seen too). A line
reads

    POST /v1/chat/completions 200 session=s-1f2e turn=main#3 prompt=812 completion=40 1.92s
    POST /v1/chat/completions 400 refused=context_length_exceeded 0.01s

and never holds message text: the handlers add only ids and counts (`note`). A refusal is any
answer with status >= 400; its reason is the error's `code`, else its `type` (OpenAI's error
shape), else `http_<status>`. A stream that fails after its 200 went out counts under the kind
of error it sent. The dashboard and stats polls (/healthz, /v1/ocrl/stats, /v1/ocrl/events) log
at DEBUG so a watching dashboard does not flood the log; everything else logs at INFO. This
module knows nothing of sessions, engines or the routes' bodies.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter

log = logging.getLogger("ocrl.access")

QUIET_PATHS = ("/healthz", "/v1/ocrl/stats", "/v1/ocrl/events")
_ERROR_BODY_LIMIT = 8192  # error bodies are small; a larger one is not parsed for its reason


def note(scope: dict, **fields) -> None:
    """What a handler adds to its request's line: session, turn, prompt, completion, error."""
    scope.setdefault("ocrl", {}).update(fields)


def _clean(value) -> str:
    """A field as one short token: a client-chosen id cannot break or forge a line."""
    text = str(value)[:80]
    return "".join(c if c.isprintable() and not c.isspace() else "?" for c in text)


def refusal_reason(status: int, body: bytes) -> str:
    try:
        error = json.loads(body)["error"]
        return _clean(error.get("code") or error.get("type") or f"http_{status}")
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"http_{status}"


class RequestLog:
    def __init__(self, app):
        self.app = app
        self.total = 0
        self.by_status: Counter = Counter()
        self.refused: Counter = Counter()

    def stats(self) -> dict:
        return {
            "total": self.total,
            "by_status": {str(k): v for k, v in sorted(self.by_status.items())},
            "refused": dict(self.refused.most_common()),
            "refused_total": sum(self.refused.values()),
        }

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        fields: dict = {}
        scope["ocrl"] = fields
        status = 0
        error_body = bytearray()

        async def watch(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400 and len(error_body) < _ERROR_BODY_LIMIT:
                error_body.extend(message.get("body", b""))
            await send(message)

        outcome = None
        try:
            await self.app(scope, receive, watch)
        except BaseException as e:  # the client went away mid-stream, or a bug below us
            outcome = "client_gone" if not isinstance(e, Exception) else f"failed:{type(e).__name__}"
            raise
        finally:
            self._record(scope, status, bytes(error_body), fields, outcome, time.monotonic() - started)

    def _record(self, scope, status: int, error_body: bytes, fields: dict, outcome: str | None, seconds: float) -> None:
        self.total += 1
        self.by_status[status] += 1
        parts = [_clean(scope.get("method", "?")), _clean(scope.get("path", "?")), str(status or "-")]
        reason = None
        if status >= 400:
            reason = refusal_reason(status, error_body)
        elif fields.get("error"):
            reason = _clean(fields["error"])
        if reason:
            self.refused[reason] += 1
            parts.append(f"refused={reason}" if status >= 400 else f"error={reason}")
        for key in ("session", "turn", "prompt", "completion", "n"):
            if fields.get(key) is not None:
                parts.append(f"{key}={_clean(fields[key])}")
        if outcome:
            parts.append(outcome)
        parts.append(f"{seconds:.2f}s")
        quiet = scope.get("path") in QUIET_PATHS and status < 400
        log.log(logging.DEBUG if quiet else logging.INFO, " ".join(parts))
