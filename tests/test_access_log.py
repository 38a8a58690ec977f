"""The operator's view: one plain line per request in the daemon's log (never message text), and
refusals counted by reason in /v1/ocrl/stats."""

from __future__ import annotations

import logging
import re
import time

import httpx
import openai
import pytest

from ocrl.access_log import RequestLog, refusal_reason

SECRET = "zebra-umbrella-4711"  # a word that must never reach the log


def _lines_after(daemon, offset: int, pattern: str, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        text = daemon.log_path.read_bytes()[offset:].decode(errors="replace")
        found = [line for line in text.splitlines() if re.search(pattern, line)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


async def test_one_line_per_request_with_session_turn_tokens_and_no_text(daemon):
    offset = daemon.log_path.stat().st_size
    before = daemon.stats()["requests"]
    async with daemon.client() as client:
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"Say {SECRET}."}], temperature=0, max_tokens=3,
            extra_headers={"X-Session-Id": "oplog-1"},
        )
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"Repeat {SECRET}."}], temperature=0, max_tokens=3, stream=True,
            extra_headers={"X-Session-Id": "oplog-2"},
        )
        async for _ in stream:
            pass
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"{SECRET} " * 9000}], max_tokens=2)
    assert httpx.get(daemon.url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    usage = reply.usage
    [plain] = _lines_after(daemon, offset, r"session=oplog-1 ")
    assert re.search(rf"POST /v1/chat/completions 200 session=oplog-1 turn=main#0 prompt={usage.prompt_tokens} completion={usage.completion_tokens} \d+\.\d\ds$", plain), plain
    [streamed] = _lines_after(daemon, offset, r"session=oplog-2 ")
    assert re.search(r"POST /v1/chat/completions 200 session=oplog-2 turn=main#0 prompt=\d+ completion=3 \d+\.\d\ds$", streamed), streamed
    [too_long] = _lines_after(daemon, offset, r"refused=context_length_exceeded")
    assert too_long.split(" ocrl.access: ")[1].startswith("POST /v1/chat/completions 400 refused=context_length_exceeded ")
    [bad_key] = _lines_after(daemon, offset, r"GET /v1/models 401")
    assert "refused=invalid_api_key" in bad_key
    assert SECRET not in daemon.log_path.read_bytes()[offset:].decode(errors="replace")

    after = daemon.stats()["requests"]
    assert after["total"] - before["total"] >= 4
    grew = {reason: n - before["refused"].get(reason, 0) for reason, n in after["refused"].items()}
    assert grew.get("context_length_exceeded") == 1 and grew.get("invalid_api_key") == 1
    assert after["refused_total"] == sum(after["refused"].values())


class _App:
    """A stand-in ASGI app: answers with the status and body it is given, or raises."""

    def __init__(self, status: int, body: bytes, fields: dict | None = None, fail: BaseException | None = None):
        self.status, self.body, self.fields, self.fail = status, body, fields or {}, fail

    async def __call__(self, scope, receive, send):
        scope["ocrl"].update(self.fields)
        await send({"type": "http.response.start", "status": self.status, "headers": []})
        if self.fail:
            raise self.fail
        await send({"type": "http.response.body", "body": self.body})


async def _serve(app, path="/v1/chat/completions"):
    async def send(message):
        pass

    await app({"type": "http", "method": "POST", "path": path, "headers": []}, None, send)


async def test_reasons_are_counted_and_client_ids_cannot_forge_a_line(caplog):
    caplog.set_level(logging.DEBUG, logger="ocrl.access")
    for status, body in [
        (429, b'{"error": {"message": "busy", "type": "rate_limit_error", "param": null, "code": null}}'),
        (429, b'{"error": {"message": "busy", "type": "rate_limit_error", "param": null, "code": null}}'),
        (413, b'{"error": {"message": "big", "type": "invalid_request_error", "param": null, "code": "request_too_large"}}'),
        (502, b"not json"),
    ]:
        await _serve(RequestLog(_App(status, body)))
    log = RequestLog(_App(429, b'{"error": {"type": "rate_limit_error", "code": null}}'))
    await _serve(log)
    await _serve(log)
    await _serve(RequestLog(_App(200, b"", {"session": "evil\nPOST /x 200", "turn": "main#1", "error": "timeout"})))
    with pytest.raises(RuntimeError):
        await _serve(RequestLog(_App(200, b"", fail=RuntimeError("boom"))))
    assert log.stats() == {"total": 2, "by_status": {"429": 2}, "refused": {"rate_limit_error": 2}, "refused_total": 2}
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split()[2:4] for line in lines[:4]] == [["429", "refused=rate_limit_error"], ["429", "refused=rate_limit_error"], ["413", "refused=request_too_large"], ["502", "refused=http_502"]]
    forged = lines[6]
    assert "\n" not in forged and forged.startswith("POST /v1/chat/completions 200 error=timeout session=evil?POST?/x?200 turn=main#1 ")
    assert "failed:RuntimeError" in lines[7]
    assert refusal_reason(400, b'{"error": {"message": "m", "type": "invalid_request_error", "code": null}}') == "invalid_request_error"


async def test_stats_polls_log_quietly(caplog):
    caplog.set_level(logging.INFO, logger="ocrl.access")
    await _serve(RequestLog(_App(200, b"{}")), path="/v1/ocrl/stats")
    await _serve(RequestLog(_App(401, b'{"error": {"code": "invalid_api_key"}}')), path="/v1/ocrl/stats")
    assert [r.getMessage().split()[2] for r in caplog.records] == ["401"]
