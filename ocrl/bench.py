"""Benchmarks. Each prints ratios against a baseline measured in the same run, medians of
repeats, because timings on shared machines swing several-fold between runs.

- `serve`: (a) the proxy's median end-to-end latency over calling the engine directly with the
  same prompt and sampling (the overhead of HTTP, validation, templating, sessions); (b) the wall
  time of 8 concurrent requests over 8 sequential ones (what batched decoding buys).
"""

from __future__ import annotations

import statistics
import time

import anyio
import msgspec

from ocrl import chat
from ocrl.types import Message, SamplingParams

PROMPTS = [
    "What is 2+3?",
    "Name a fruit.",
    "What colour is the sky?",
    "Say hello in French.",
    "What is the capital of Italy?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "What is 10 minus 4?",
]


async def run(which: str, config, args) -> None:
    if which == "serve":
        await bench_serve(config, args.repeats, args.max_tokens)


async def bench_serve(config, repeats: int, max_tokens: int) -> None:
    import httpx

    from ocrl.daemon import Daemon, setup_logging

    config = msgspec.structs.replace(config, no_train=True, port=config.port if config.port != 30000 else 30999, prm_mode="embed")
    daemon = Daemon(config)
    await daemon.build()
    engine, tokenizer = daemon.engine, daemon.loaded.tokenizer
    url = f"http://{config.host}:{config.port}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    params = SamplingParams(max_tokens=max_tokens, temperature=0)

    def body(prompt: str) -> dict:
        return {"model": "m", "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": max_tokens}

    async def direct(prompt: str) -> int:
        ids = chat.prompt_ids(tokenizer, [Message(role="user", content=prompt)])
        return len((await engine.generate(ids, params)).response_ids)

    async def proxied(client, prompt: str) -> int:
        reply = await client.post(url, json=body(prompt), headers=headers)
        reply.raise_for_status()
        return reply.json()["usage"]["completion_tokens"]

    async def timed(fn, *a) -> tuple[float, int]:
        started = time.perf_counter()
        n = await fn(*a)
        return time.perf_counter() - started, n

    async with anyio.create_task_group() as tg:
        tg.start_soon(daemon.serve)
        while daemon.server is None or not daemon.server.started:
            await anyio.sleep(0.05)
        async with httpx.AsyncClient(timeout=600) as client:
            await proxied(client, PROMPTS[0])  # warm-up both paths
            await direct(PROMPTS[0])
            engine_s, proxy_s = [], []
            for _ in range(repeats):  # interleaved, so drift hits both alike
                t, n_direct = await timed(direct, PROMPTS[0])
                engine_s.append(t)
                t, n_proxy = await timed(proxied, client, PROMPTS[0])
                proxy_s.append(t)
            assert n_direct == n_proxy, "the two paths must produce the same completion"
            sequential, concurrent = [], []
            for _ in range(max(1, repeats // 2)):
                started = time.perf_counter()
                for prompt in PROMPTS:
                    await proxied(client, prompt)
                sequential.append(time.perf_counter() - started)
                started = time.perf_counter()
                async with anyio.create_task_group() as burst:
                    for prompt in PROMPTS:
                        burst.start_soon(proxied, client, prompt)
                concurrent.append(time.perf_counter() - started)
        daemon.server.should_exit = True
    engine_med, proxy_med = statistics.median(engine_s), statistics.median(proxy_s)
    seq_med, conc_med = statistics.median(sequential), statistics.median(concurrent)
    overhead = (proxy_med - engine_med) / proxy_med
    print(f"bench serve: {config.model}, greedy, {n_direct} completion tokens, {repeats} repeats (medians)")
    print(f"  proxy / engine latency      {proxy_med / engine_med:6.3f}x   ({proxy_med * 1000:.0f} ms vs {engine_med * 1000:.0f} ms)")
    print(f"  proxy overhead              {overhead * 100:6.2f}% of end-to-end latency (target <= 5%)")
    print(f"  8 concurrent / 8 sequential {conc_med / seq_med:6.3f}x   ({conc_med:.2f} s vs {seq_med:.2f} s; target <= 0.5x)")
