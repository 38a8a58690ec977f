"""A large request body is JSON-decoded in a worker thread, so the event loop (health checks,
other streams) never waits for it; small bodies decode inline; decode errors still surface."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import anyio
import pytest

from ocrl.api import Api
from ocrl.chat_request import decode_request
from ocrl.replies import ApiError


def api_stub(threshold: int):
    return SimpleNamespace(decode_off_loop_above=threshold, _decode_limiter=anyio.CapacityLimiter(2))


async def test_a_large_body_decodes_off_the_event_loop_and_a_small_one_inline():
    loop_thread = threading.current_thread()
    seen = []

    def fn(raw):
        seen.append(threading.current_thread())
        return decode_request(raw)

    small = b'{"messages": [{"role": "user", "content": "hi"}]}'
    large = b'{"messages": [{"role": "user", "content": "' + b"word " * 2000 + b'"}]}'
    stub = api_stub(threshold=1024)
    assert (await Api.decode(stub, fn, small)).messages[0].content == "hi"
    assert len((await Api.decode(stub, fn, large)).messages[0].content) == 10_000
    assert seen[0] is loop_thread and seen[1] is not loop_thread


async def test_a_bad_large_body_is_still_a_400():
    stub = api_stub(threshold=16)
    with pytest.raises(ApiError) as e:
        await Api.decode(stub, decode_request, b'{"messages": [{"role": "user", "content": ' + b"1" * 100 + b"}")
    assert e.value.status == 400


def test_a_body_too_large_for_any_fitting_prompt_is_refused_before_decoding():
    from ocrl.bodies import BODY_SLACK

    stub = SimpleNamespace(body_precheck=True, engine=SimpleNamespace(max_context=100), _longest_token=lambda: 10)
    most = 6 * 100 * 10 + BODY_SLACK
    Api.refuse_hopeless_body(stub, most)  # could still hold a prompt that fits: decoded as usual
    with pytest.raises(ApiError) as e:
        Api.refuse_hopeless_body(stub, most + 1)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"


def test_bench_refuse_modes_are_read_from_the_command_line():
    from ocrl.__main__ import main
    from ocrl.bench import REFUSE_MODES, refuse_modes

    assert refuse_modes("byte check, pre-check") == ("byte check", "pre-check")
    assert set(refuse_modes(",".join(REFUSE_MODES))) == set(REFUSE_MODES)
    with pytest.raises(SystemExit, match="tokenized"):  # a misspelt mode fails before any model loads
        refuse_modes("byte check,tokenized")
    with pytest.raises(SystemExit) as e:
        main(["bench", "refuse", "--modes", "nope", "--no-train"])
    assert "nope" in str(e.value)
