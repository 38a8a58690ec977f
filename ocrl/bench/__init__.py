"""Benchmarks. Each prints ratios against a baseline measured in the same run, medians of
repeats, because timings on shared machines swing several-fold between runs.

- `train` (bench/train.py): a trainer step over a bare fwd+bwd+AdamW step, a swap over a forward,
  and what a step does to requests streaming or arriving meanwhile.
- `soak`: many concurrent sessions for a while through the real HTTP API (training on unless
  --no-train): failed requests, latency, resident memory at the end over once warm, and every
  main turn's sample accounted for in the run directory.
- `refuse`: /healthz latency while four 7.9 MB chat bodies (sent from another process, as by
  real clients) are refused at once, over its latency idle, per `--modes`: refused by their
  byte size before decoding ("byte check"), by their character count after decoding in a worker
  thread ("pre-check") or on the loop ("decoded on loop"), or by their token count after
  templating and tokenising in the worker thread ("tokenised").
- `serve`: (a) the proxy's median end-to-end latency over calling the engine directly with the
  same prompt and sampling (the overhead of HTTP, validation, templating, sessions); (b) the wall
  time of 8 concurrent requests over 8 sequential ones (what batched decoding buys); (c) agent
  traffic as OpenClaw sends it (a ~3k-token system prompt with tools, the whole conversation
  re-sent each turn, ~300 tokens more per turn, 6 turns): time to first token of turns 2-6 with
  the engine's prefix cache over the same turns without it, sessions interleaved, and the memory
  the cache held. With `--replicas N`: N Ray replicas against 1 and against no Ray
  (bench/cluster.py).
"""

from __future__ import annotations

import math
import statistics
import time

import anyio
import msgspec

from ocrl import chat
from ocrl.bench import agent as bench_agent
from ocrl.bench.prompts import PROMPTS
from ocrl.bench.serving import on_free_port, serving
from ocrl.bench.train import bench_train
from ocrl.types import Message, SamplingParams

async def run(which: str, config, args) -> None:
    if which == "serve" and config.replicas:
        from ocrl.bench.cluster import bench_replicas

        await bench_replicas(config, args.repeats, args.max_tokens or 32)
    elif which == "serve":
        await bench_serve(config, args.repeats, args.max_tokens or 32)
    elif which == "train":
        await bench_train(config, args.repeats, args.max_tokens or 32)
    elif which == "train-long":
        from ocrl.bench.train import bench_train_long

        prompts = tuple(int(n) for n in (args.long_prompts or "3000,3300,3600").split(","))
        await bench_train_long(config, prompts, args.max_tokens or 16)
    elif which == "refuse":
        await bench_refuse(config, args.repeats, *([refuse_modes(args.modes)] if getattr(args, "modes", None) else []))
    elif which == "soak":
        await bench_soak(config, sessions=args.concurrency, seconds=args.seconds, max_tokens=args.max_tokens or 4)
    elif which == "judge":
        await anyio.to_thread.run_sync(bench_judge, args.repeats)
    elif which == "openclaw":
        from ocrl.bench.openclaw import bench_openclaw

        return await bench_openclaw(config, args)
    elif which == "gpu":
        from ocrl.bench.gpu import bench_gpu

        await bench_gpu(config, args)
    elif which == "learn":
        from ocrl.bench.learn import bench_learn

        await bench_learn(
            config, persona=args.persona, turns=args.turns, concurrency=args.concurrency, probe_every=args.probe_every,
            tasks=args.tasks, max_tokens=args.max_tokens or 48, probe_samples=args.probe_samples,
            methods=[m.strip() for m in args.methods.split(",") if m.strip()] if getattr(args, "methods", None) else None,
        )


def bench_judge(repeats: int) -> None:
    """The embed judge, one case at a time as a session calls it (`classify`: the committee's
    forward, then the decision), on the blind held-out cases; the baselines, on the same cases in
    the same run: the forward of the committee's first member alone (what the committee costs
    over one classifier) and of the committee alone (what the decision adds). Medians of
    `repeats` passes, on the threads torch is given."""
    from ocrl.judge.cases import load_cases
    from ocrl.judge.classifier import item_of
    from ocrl.judge.embed import BLIND_SET, EmbedJudge

    cases = load_cases(BLIND_SET)
    judge = EmbedJudge.load()
    judge.classify("warm up", "user")
    items = [item_of(case) for case in cases]
    first = judge.classifier.members[0]
    judged, forwards, singles = [], [], []
    for _ in range(max(1, repeats)):
        for times, forward in ((singles, first.read), (forwards, judge.classifier)):
            started = time.perf_counter()
            for item in items:
                forward([item])
            times.append((time.perf_counter() - started) * 1000 / len(cases))
        started = time.perf_counter()
        for case in cases:
            judge.classify(case.next_state, case.role, case.response or "")
        judged.append((time.perf_counter() - started) * 1000 / len(cases))
    judge_ms, forward_ms, single_ms = (statistics.median(times) for times in (judged, forwards, singles))
    members = len(judge.classifier.members)
    print(f"embed judge, {len(cases)} held-out cases, median of {len(judged)} passes (threads {torch_threads()}):")
    print(f"  one classifier's forward       {single_ms:7.1f} ms/case")
    print(f"  the committee's forward ({members})   {forward_ms:7.1f} ms/case  ({forward_ms / single_ms:.2f}x one classifier)")
    print(f"  judge (classify)               {judge_ms:7.1f} ms/case  ({judge_ms / forward_ms:.2f}x the committee's forward; target < 50 ms)")


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


async def bench_serve(config, repeats: int, max_tokens: int) -> None:
    import httpx

    from ocrl.daemon import Daemon

    config = on_free_port(config, no_train=True, prm_mode="embed")
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

    async with serving(daemon):
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
            agent_rows = await bench_agent.serve_rows(client, url, headers, engine, tokenizer, repeats)
    engine_med, proxy_med = statistics.median(engine_s), statistics.median(proxy_s)
    seq_med, conc_med = statistics.median(sequential), statistics.median(concurrent)
    overhead = (proxy_med - engine_med) / proxy_med
    print(f"bench serve: {config.model}, greedy, {n_direct} completion tokens, {repeats} repeats (medians)")
    print(f"  proxy / engine latency      {proxy_med / engine_med:6.3f}x   ({proxy_med * 1000:.0f} ms vs {engine_med * 1000:.0f} ms)")
    print(f"  proxy overhead              {overhead * 100:6.2f}% of end-to-end latency (target <= 5%)")
    print(f"  8 concurrent / 8 sequential {conc_med / seq_med:6.3f}x   ({conc_med:.2f} s vs {seq_med:.2f} s; target <= 0.5x)")
    print("\n".join(agent_rows))


async def bench_soak(config, *, sessions: int, seconds: float, max_tokens: int) -> None:
    from ocrl.bench import soak
    from ocrl.daemon import Daemon

    config = on_free_port(config)
    daemon = Daemon(config)
    await daemon.build()
    async with serving(daemon) as url:
        report = await soak.soak(url, config.api_key, sessions=sessions, seconds=seconds, max_tokens=max_tokens, seed=config.seed)
        with anyio.move_on_after(120):  # the last verdicts
            while daemon.sessions.stats()["judging"]:
                await anyio.sleep(0.2)
        accounting = soak.account(daemon.run_dir)
    soak.print_report(report, accounting, sessions)


REFUSE_MODES = ("decoded on loop", "pre-check", "byte check", "tokenised")


def refuse_modes(text: str) -> tuple[str, ...]:
    """`--modes` of bench refuse: comma-separated names from REFUSE_MODES."""
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in REFUSE_MODES]
    if unknown or not modes:
        raise SystemExit(f"ocrl: bench refuse --modes: unknown {unknown or [text]}; choose from {', '.join(REFUSE_MODES)}")
    return modes


# The four bodies go from another process, as from real clients: sent from the daemon's own event
# loop (as before), writing 31.6 MB into sockets cost that loop as much as reading them did.
REFUSE_SENDER = """
import json, sys, threading, time
import httpx
url, body_path, headers = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
body = open(body_path, "rb").read()
print("ready", flush=True)
for _ in sys.stdin:  # a line per round: four bodies at once, then their statuses and wall time
    statuses = []
    def send():
        statuses.append(httpx.post(url, content=body, headers=headers, timeout=600).status_code)
    threads = [threading.Thread(target=send) for _ in range(4)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"wall": time.perf_counter() - started, "statuses": statuses}), flush=True)
"""


async def bench_refuse(config, repeats: int, modes: tuple[str, ...] = REFUSE_MODES) -> None:
    import json
    import sys
    import tempfile
    from pathlib import Path

    import httpx
    from anyio.streams.buffered import BufferedByteReceiveStream

    from ocrl.bodies import DECODE_OFF_LOOP_ABOVE
    from ocrl.daemon import Daemon

    config = on_free_port(config, no_train=True)
    daemon = Daemon(config)
    await daemon.build()
    huge = msgspec.json.encode({"messages": [{"role": "user", "content": "word " * 1_580_000}], "max_tokens": 2})
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {config.api_key}"} if config.api_key else {})
    results: dict[str, tuple[list[float], list[float], list[int]]] = {}
    with tempfile.TemporaryDirectory() as folder:
        body_path = Path(folder) / "body.json"
        body_path.write_bytes(huge)
        async with serving(daemon):
            base = f"http://{config.host}:{config.port}"
            sender = await anyio.open_process([sys.executable, "-c", REFUSE_SENDER, base + "/v1/chat/completions", str(body_path), json.dumps(headers)], stderr=None)
            replies = BufferedByteReceiveStream(sender.stdout)
            await replies.receive_until(b"\n", 64)  # ready: imported and read the body
            async with sender, httpx.AsyncClient(base_url=base, timeout=600) as client:

                async def pings(until: anyio.Event, into: list[float]) -> None:
                    while not until.is_set():
                        started = time.perf_counter()
                        await client.get("/healthz")
                        into.append(time.perf_counter() - started)
                        await anyio.sleep(0.02)

                idle: list[float] = []
                done = anyio.Event()
                async with anyio.create_task_group() as inner:
                    inner.start_soon(pings, done, idle)
                    await anyio.sleep(2.0)
                    done.set()
                for mode in modes:
                    # "decoded on loop": the pre-check, but the JSON decoded on the event loop as before
                    daemon.api.decode_off_loop_above = math.inf if mode == "decoded on loop" else DECODE_OFF_LOOP_ABOVE
                    daemon.api.body_precheck = mode == "byte check"  # refused by size, never decoded
                    if mode == "tokenised":  # the pre-check off: every body reaches the tokenizer
                        daemon.api._token_chars = 10**9
                    latencies, walls, statuses = [], [], []
                    for _ in range(repeats):
                        done = anyio.Event()
                        async with anyio.create_task_group() as inner:
                            inner.start_soon(pings, done, latencies)
                            await sender.stdin.send(b"go\n")
                            round_ = json.loads(await replies.receive_until(b"\n", 1 << 16))
                            done.set()
                        walls.append(round_["wall"])
                        statuses += round_["statuses"]
                    results[mode] = (latencies, walls, statuses)
                await sender.stdin.aclose()
    idle_med = statistics.median(idle)
    print(f"bench refuse: four {len(huge) / 1e6:.1f} MB chat bodies at once, {repeats} repeats; /healthz idle median {idle_med * 1000:.1f} ms")
    for mode, (latencies, walls, statuses) in results.items():
        print(
            f"  {mode:15s} healthz median {statistics.median(latencies) * 1000:7.1f} ms ({statistics.median(latencies) / idle_med:5.1f}x idle), "
            f"max {max(latencies) * 1000:7.1f} ms over {len(latencies)} pings; four refused in {statistics.median(walls):.2f} s (median); statuses {sorted(set(statuses))}"
        )
