"""Benchmarks. Each prints ratios against a baseline measured in the same run, medians of
repeats, because timings on shared machines swing several-fold between runs.

- `train`: (a) one trainer step (policy forward, backward, AdamW, merge, probe; the reference
  log-probs prefetched, as `Trainer.run` does while a batch fills, and also computed inline)
  over a bare torch forward + backward + AdamW step of the same LoRA model on the same batch;
  (b) a weight swap into the engine over one forward pass of the model; (c) for a request
  already streaming when a step starts, its longest gap between tokens over the median decode
  step without training; (d) for a request that arrives while a step is inside a micro-batch,
  its time to first token over the same without training; (e) on long agent samples (bench_agent):
  step time per 1k prompt tokens, and the reference pass with and without its prefix cache.
- `soak`: many concurrent sessions for a while through the real HTTP API (training on unless
  --no-train): failed requests, latency, resident memory at the end over once warm, and every
  main turn's sample accounted for in the run directory.
- `refuse`: /healthz latency while four 7.9 MB chat bodies are refused at once, over its
  latency idle: with the character pre-check (refused before tokenising) and without it (each
  body templated and tokenised in the worker thread, then refused by its token count).
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
from ocrl.bench.serving import serving
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
    if which == "serve" and config.replicas:
        from ocrl.bench.cluster import bench_replicas

        await bench_replicas(config, args.repeats, args.max_tokens or 32)
    elif which == "serve":
        await bench_serve(config, args.repeats, args.max_tokens or 32)
    elif which == "train":
        await bench_train(config, args.repeats, args.max_tokens or 32)
    elif which == "refuse":
        await bench_refuse(config, args.repeats)
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
    """The embed judge, one case at a time as a session calls it (`classify`: features, head,
    decision), on the held-out cases; the baseline is the encoder's forward alone on the same
    next states in the same run (what the features and the head add is the ratio). Medians of
    `repeats` passes, on the threads torch is given."""
    from pathlib import Path

    from ocrl.judge.embed import EmbedJudge, load_fit_cases

    cases = load_fit_cases(Path(__file__).resolve().parent.parent / "tests" / "data" / "judge_heldout.jsonl")
    judge = EmbedJudge.load()
    judge.classify("warm up", "user")
    judged, encoded = [], []
    for _ in range(max(1, repeats)):
        started = time.perf_counter()
        for case in cases:
            judge.encode([case.next_state])
        encoded.append((time.perf_counter() - started) * 1000 / len(cases))
        started = time.perf_counter()
        for case in cases:
            judge.classify(case.next_state, case.role)
        judged.append((time.perf_counter() - started) * 1000 / len(cases))
    judge_ms, encode_ms = statistics.median(judged), statistics.median(encoded)
    print(f"embed judge, {len(cases)} held-out cases, median of {len(judged)} passes (threads {torch_threads()}):")
    print(f"  encoder forward alone   {encode_ms:7.1f} ms/case")
    print(f"  judge (classify)        {judge_ms:7.1f} ms/case  ({judge_ms / encode_ms:.2f}x the forward alone; target < 50 ms)")


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


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

    config = msgspec.structs.replace(config, port=config.port if config.port != 30000 else 30998)
    daemon = Daemon(config)
    await daemon.build()
    async with serving(daemon) as url:
        report = await soak.soak(url, config.api_key, sessions=sessions, seconds=seconds, max_tokens=max_tokens, seed=config.seed)
        with anyio.move_on_after(120):  # the last verdicts
            while daemon.sessions.stats()["judging"]:
                await anyio.sleep(0.2)
        accounting = soak.account(daemon.run_dir)
    soak.print_report(report, accounting, sessions)


def bare_step_fn(trainer, batch, lr: float):
    """The baseline for a trainer step: what any training loop must do at least on the same
    batch and the same (LoRA) model, one torch forward + backward + AdamW step, no extras."""
    import torch

    from ocrl.train.batch import MicroBatch
    from ocrl.train.loss import token_logprobs

    optimizer = torch.optim.AdamW(trainer.params, lr=lr)

    def bare_step() -> None:
        micro = MicroBatch.of(batch, trainer.device)
        out = trainer.model(input_ids=micro.input_ids, attention_mask=micro.attention_mask, position_ids=micro.position_ids,
                            use_cache=False, logits_to_keep=micro.targets.shape[1] + 1)
        logprobs = token_logprobs(out.logits[:, :-1], micro.targets)
        loss = -(logprobs * micro.rewards[:, None] * micro.loss_mask).sum() / micro.loss_mask.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return bare_step


async def bench_refuse(config, repeats: int, modes: tuple[str, ...] = ("decoded on loop", "pre-check", "byte check", "tokenised")) -> None:
    import httpx

    from ocrl.api import DECODE_OFF_LOOP_ABOVE
    from ocrl.daemon import Daemon

    config = msgspec.structs.replace(config, port=config.port if config.port != 30000 else 30997, no_train=True)
    daemon = Daemon(config)
    await daemon.build()
    huge = msgspec.json.encode({"messages": [{"role": "user", "content": "word " * 1_580_000}], "max_tokens": 2})
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {config.api_key}"} if config.api_key else {})
    results: dict[str, tuple[list[float], list[float], list[int]]] = {}
    async with serving(daemon):
        base = f"http://{config.host}:{config.port}"
        async with httpx.AsyncClient(base_url=base, timeout=600) as client:

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

                    async def refuse() -> None:
                        reply = await client.post("/v1/chat/completions", content=huge, headers=headers)
                        statuses.append(reply.status_code)

                    async with anyio.create_task_group() as inner:
                        inner.start_soon(pings, done, latencies)
                        started = time.perf_counter()
                        async with anyio.create_task_group() as four:
                            for _ in range(4):
                                four.start_soon(refuse)
                        walls.append(time.perf_counter() - started)
                        done.set()
                results[mode] = (latencies, walls, statuses)
    idle_med = statistics.median(idle)
    print(f"bench refuse: four {len(huge) / 1e6:.1f} MB chat bodies at once, {repeats} repeats; /healthz idle median {idle_med * 1000:.1f} ms")
    for mode, (latencies, walls, statuses) in results.items():
        print(
            f"  {mode:15s} healthz median {statistics.median(latencies) * 1000:7.1f} ms ({statistics.median(latencies) / idle_med:5.1f}x idle), "
            f"max {max(latencies) * 1000:7.1f} ms over {len(latencies)} pings; four refused in {statistics.median(walls):.2f} s (median); statuses {sorted(set(statuses))}"
        )


async def bench_train(config, repeats: int, max_tokens: int) -> None:
    import threading

    from ocrl import models
    from ocrl.daemon import set_threads
    from ocrl.engine.hf import HFEngine
    from ocrl.train.batch import pack
    from ocrl.train.trainer import Trainer
    from ocrl.types import Sample

    set_threads(config)  # as the daemon does: decode and training share the cores
    loaded = await anyio.to_thread.run_sync(lambda: models.load(config.model, device=config.device, dtype=config.dtype))
    engine = HFEngine(loaded, max_batch_size=config.max_batch_size)
    size = config.rollout_batch_size
    med = statistics.median
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        # 1. a batch of real completions
        batch = []
        for i in range(size):
            ids = chat.prompt_ids(loaded.tokenizer, [Message(role="user", content=PROMPTS[i % len(PROMPTS)])])
            c = await engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i))
            n = len(c.response_ids)
            batch.append(Sample(sample_id=str(i), session_id="bench", turn_index=i, tokens=ids + c.response_ids, response_length=n,
                                loss_mask=[1] * n, rollout_logprobs=c.logprobs, reward=1.0 if i % 2 else -1.0, weights_version=0, score=1))
        trainer = await anyio.to_thread.run_sync(lambda: Trainer(config, loaded.model, engine=engine))
        bare_step = bare_step_fn(trainer, batch, config.lr)
        micro_batches = len(pack(batch, config.micro_batch_tokens))

        def timed(fn, *a) -> float:
            started = time.perf_counter()
            fn(*a)
            return time.perf_counter() - started

        # 2. step (reference log-probs prefetched, and inline), bare step, swap, one forward
        started = time.perf_counter()  # what run() spends while the batch fills, one sample at a time
        references = await anyio.to_thread.run_sync(lambda: trainer.response_logprobs(batch, reference=True))
        prefetch_s = time.perf_counter() - started
        step_s, inline_s, kl0_s, bare_s, swap_s, forward_s = [], [], [], [], [], []
        with_kl, without_kl = trainer.config, msgspec.structs.replace(trainer.config, kl_coef=0.0)
        trainer.probe = batch[0]
        await anyio.to_thread.run_sync(bare_step)  # warm-up
        for _ in range(repeats):
            bare_s.append(await anyio.to_thread.run_sync(timed, bare_step))
            step_s.append(await anyio.to_thread.run_sync(timed, trainer._train, batch, references))
            inline_s.append(await anyio.to_thread.run_sync(timed, trainer._train, batch))
            trainer.config = without_kl  # --kl-coef 0: no reference forward in the step at all
            kl0_s.append(await anyio.to_thread.run_sync(timed, trainer._train, batch))
            trainer.config = with_kl
            tensors = trainer.published_weights()
            started = time.perf_counter()
            await engine.update_weights(tensors, engine.weights_version + 1)
            swap_s.append(time.perf_counter() - started)
            prompt, response = batch[0].tokens[: -batch[0].response_length], batch[0].tokens[-batch[0].response_length :]
            started = time.perf_counter()
            await engine.score(prompt, response)
            forward_s.append(time.perf_counter() - started)

        # 2b. long agent samples: step time per 1k prompt tokens, the reference with its prefix cache
        long_samples = await bench_agent.agent_samples(engine, loaded.tokenizer)
        need, available = bench_agent.backward_memory(trainer, long_samples)
        steps = available < 0 or need * 1.5 < available  # a shared box must not be pushed into swapping or OOM
        agent_rows = await anyio.to_thread.run_sync(bench_agent.train_rows, trainer, long_samples, max(1, repeats // 2), steps)
        if not steps:
            agent_rows.append(f"    step rows skipped: a backward over {max(len(s.tokens) for s in long_samples)} tokens keeps ~{need / 2**30:.1f} GiB "
                              f"of activations, {available / 2**30:.1f} GiB available")
        trainer.probe = batch[0]

        # 3. requests while a step runs, against the same requests without training
        story = chat.prompt_ids(loaded.tokenizer, [Message(role="user", content="Write a long story about the sea.")])

        async def request(params: SamplingParams, on_first_token=None) -> tuple[float, list[float]]:
            """When the request was sent and when each of its tokens arrived."""
            sent, times = time.perf_counter(), []
            async for _ in engine.stream(story, params):
                times.append(time.perf_counter())
                if len(times) == 1 and on_first_token is not None:
                    on_first_token()
            return sent, times

        def gaps(times: list[float]) -> list[float]:
            return [b - a for a, b in zip(times, times[1:])]

        rows = []

        async def step() -> None:
            rows.append(await trainer.step(batch, references))

        # 3a. a long request already streaming when a step (and its swap) starts
        long = SamplingParams(max_tokens=400, temperature=1.0, seed=1)
        quiet_gaps = gaps((await request(long))[1])
        async with anyio.create_task_group() as inner:
            _, times = await request(long, on_first_token=lambda: inner.start_soon(step))
        busy_gaps = gaps(times)
        streamed_yield = rows[-1]["yield_seconds"]
        # the step starts at the first token and gives way from its first yield point on
        gave_way = [g for g, end in zip(busy_gaps, times[1:]) if end <= times[0] + streamed_yield]
        ran = [g for g, end in zip(busy_gaps, times[1:]) if end > times[0] + streamed_yield]

        # 3b. a short request arriving inside the step's first micro-batch, at staggered points
        short = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=2)
        quiet_first = []
        for _ in range(repeats):
            sent, times = await request(short)
            quiet_first.append(times[0] - sent)
        micro_s = med(step_s) / micro_batches
        busy_first, busy_gap = [], []
        for i in range(repeats):
            working = threading.Event()
            hook = trainer.model.register_forward_pre_hook(lambda *_: working.set())
            async with anyio.create_task_group() as inner:
                inner.start_soon(step)
                while not working.is_set():
                    await anyio.sleep(0.002)
                hook.remove()
                await anyio.sleep(micro_s * (i + 0.5) / repeats)
                sent, times = await request(short)
            busy_first.append(times[0] - sent)
            busy_gap.append(max(gaps(times)))
        tg.cancel_scope.cancel()
    decode = med(quiet_gaps)

    def longest(part: list[float]) -> str:
        return f"{max(part) / decode:6.2f}x" if part else "     -"

    print(f"bench train: {config.model}, LoRA r={config.lora_rank}, batch {size} x ~{max_tokens} tokens in {micro_batches} micro-batch(es) "
          f"of <= {config.micro_batch_tokens} tokens, train_yield_max {config.train_yield_max:g} s, {repeats} repeats (medians)")
    print(f"  trainer step / bare fwd+bwd+step   {med(step_s) / med(bare_s):6.3f}x   ({med(step_s):.2f} s vs {med(bare_s):.2f} s; target <= 1.3x; "
          f"reference log-probs prefetched while the batch fills: {prefetch_s:.2f} s off the step's path)")
    print(f"    the same, reference inline       {med(inline_s) / med(bare_s):6.3f}x   ({med(inline_s):.2f} s; a step whose samples had no idle time before it)")
    print(f"    the same, --kl-coef 0            {med(kl0_s) / med(bare_s):6.3f}x   ({med(kl0_s):.2f} s, no reference forward; "
          f"{med(kl0_s) / med(inline_s):.3f}x the inline step, {med(kl0_s) / med(step_s):.3f}x the prefetched one)")
    print(f"  swap / one forward pass            {med(swap_s) / med(forward_s):6.3f}x   ({med(swap_s) * 1000:.0f} ms vs {med(forward_s) * 1000:.0f} ms; target < 1x)")
    print(f"  streaming when a step starts: longest gap / decode step    {max(busy_gaps) / decode:6.2f}x   ({max(busy_gaps) * 1000:.0f} ms vs "
          f"{decode * 1000:.0f} ms over {len(busy_gaps)} tokens, {sum(busy_gaps):.0f} s; target <= 1x)")
    print(f"    without training (the noise floor)                    {max(quiet_gaps) / decode:6.2f}x")
    print(f"    while the step gave way ({streamed_yield:4.1f} s)                   {longest(gave_way)}")
    print(f"    after, once train_yield_max was spent                 {longest(ran)}   (the step shares the cores)")
    print(f"  arriving mid-micro-batch: first token / quiet first token  {med(busy_first) / med(quiet_first):6.2f}x   "
          f"({med(busy_first) * 1000:.0f} ms vs {med(quiet_first) * 1000:.0f} ms, worst {max(busy_first) * 1000:.0f} ms; "
          f"its longest gap {max(busy_gap) / decode:.2f}x decode)")
    print("\n".join(agent_rows))
