"""How the HTTP surface answers: a JSON body, and every failure in OpenAI's error shape
(`{"error": {"message", "type", "param", "code"}}`), whether as a response or, once a stream's
200 went out, as its last SSE event.

`ApiError` is what every route and pipeline step raises for a request it refuses; `answered`
is every generating route's last word, turning it (or an unexpected failure, as a logged 500)
into the reply. Knows HTTP shapes only: nothing of sessions, engines or routes.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from ocrl import guard
from ocrl.access_log import note
from ocrl.engine.base import EngineBusy
from ocrl.jsonl import DiskFull

log = logging.getLogger("ocrl.api")

_encoder = msgspec.json.Encoder()


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


def json_response(body: Any, headers: dict | None = None) -> Response:
    return Response(_encoder.encode(body), media_type="application/json", headers=headers)


def error_response(e: ApiError | guard.Refused) -> Response:
    body = {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}
    return Response(_encoder.encode(body), status_code=e.status, media_type="application/json", headers=getattr(e, "headers", None))


async def answered(what: str, serve, request: Request) -> Response:
    """Every generating route's last word: an ApiError becomes its OpenAI-shaped answer, anything
    else a logged 500 that takes nothing else down."""
    try:
        return await serve(request)
    except ApiError as e:
        return error_response(e)
    except Exception:
        log.exception("%s failed", what)
        return error_response(ApiError(500, "internal error while serving the request", "server_error"))


def storage_full(e: DiskFull) -> ApiError:
    """A main turn cannot be kept while the record dir is full: 503, come back later. Side turns
    and health keep answering."""
    return ApiError(
        503, f"this server cannot record main turns right now ({e.strerror or e}); retry later, or send a side turn",
        "server_error", code="storage_full", headers={"Retry-After": "30"},
    )


def stream_error(scope: dict, e: BaseException) -> bytes:
    """The SSE event a stream sends when generation fails after its 200 went out."""
    if isinstance(e, ApiError):
        note(scope, error=e.code or e.type)
        return b"data: " + _encoder.encode({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}) + b"\n\n"
    kind = "rate_limit_error" if isinstance(e, EngineBusy) else ("timeout" if isinstance(e, TimeoutError) else "server_error")
    note(scope, error=kind)
    return b"data: " + _encoder.encode({"error": {"message": str(e) or "generation timed out", "type": kind, "param": None, "code": None}}) + b"\n\n"
