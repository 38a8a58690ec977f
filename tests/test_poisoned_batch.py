"""One request's bad parameters never fail the others of its batch, and a temperature too small
to divide by is greedy, not a NaN that poisons the batch."""

from __future__ import annotations

import anyio
import httpx
import torch

from ocrl.engine.base import EngineError
from ocrl.types import SamplingParams
from test_engine import running, tiny_engine

torch.set_num_threads(1)


async def _generate_all(engine, params: list[SamplingParams]) -> list:
    results: list = [None] * len(params)

    async def one(i: int) -> None:
        try:
            results[i] = await engine.generate([1, 5, 6 + i], params[i])
        except EngineError as e:
            results[i] = e

    async with anyio.create_task_group() as tg:
        for i in range(len(params)):
            tg.start_soon(one, i)
    return results


async def test_a_failing_request_fails_alone_in_its_batch_of_8():
    engine = tiny_engine(max_batch_size=8)
    ok = SamplingParams(max_tokens=5, temperature=1.0, seed=1)
    # top_logprobs past the vocabulary makes topk raise for this row only
    params = [ok] * 3 + [SamplingParams(max_tokens=5, temperature=1.0, top_logprobs=10_000)] + [ok] * 4

    @running
    async def check(engine):
        results = await _generate_all(engine, params)
        assert isinstance(results[3], EngineError)
        others = [r for i, r in enumerate(results) if i != 3]
        assert all(not isinstance(r, Exception) and len(r.response_ids) >= 1 for r in others), others

    await check(engine)


async def test_a_tiny_temperature_is_greedy():
    engine = tiny_engine(max_batch_size=8)
    tiny = [SamplingParams(max_tokens=6, temperature=t) for t in (1e-44, 1e-39, 1e-30, 1e-8)]

    @running
    async def check(engine):
        greedy = await engine.generate([1, 5, 6], SamplingParams(max_tokens=6, temperature=0))
        for params in tiny:
            assert (await engine.generate([1, 5, 6], params)).response_ids == greedy.response_ids

    await check(engine)


async def test_a_poisoned_request_in_a_batch_of_8_over_http(daemon):
    headers = {"Authorization": f"Bearer {daemon.api_key}"}

    def body(i: int, temperature: float) -> dict:
        return {"messages": [{"role": "user", "content": f"Count to {i}"}], "max_tokens": 4, "temperature": temperature, "turn_type": "side"}

    temperatures = [0.7] * 8
    temperatures[5] = 1e-39  # before: logits / T overflowed, sampling raised, the whole batch got 500
    async with httpx.AsyncClient(timeout=120) as client:
        replies = await asyncio_gather(client, daemon.url + "/v1/chat/completions", [body(i, t) for i, t in enumerate(temperatures)], headers)
    assert [r.status_code for r in replies] == [200] * 8, [r.text for r in replies if r.status_code != 200]


async def asyncio_gather(client, url, bodies, headers) -> list:
    replies: list = [None] * len(bodies)

    async def one(i):
        replies[i] = await client.post(url, json=bodies[i], headers=headers)

    async with anyio.create_task_group() as tg:
        for i in range(len(bodies)):
            tg.start_soon(one, i)
    return replies
