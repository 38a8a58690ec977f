"""`python -m ocrl bench train`: what training costs and what it does to serving, each as a ratio
to a baseline measured in the same run (medians of --repeats).

(a) one trainer step (policy forward, backward, AdamW, merge, probe; the reference log-probs
prefetched, as `Trainer.run` does while a batch fills, and also computed inline, and with
--kl-coef 0) over a bare torch forward + backward + AdamW step of the same LoRA model on the same
batch (`bare_step_fn`, also the baseline of `bench gpu`); (b) a weight swap into the engine over
one forward pass of the model; (c) for a request already streaming when a step starts, its
longest gap between tokens over the median decode step without training; (d) for a request
that arrives while a step is inside a micro-batch, its time to first token over the same without
training; (e) on long agent samples (bench/agent.py): step time per 1k prompt tokens, and the
reference pass with and without its prefix cache.
"""

from __future__ import annotations

import statistics
import time

import anyio
import msgspec

from ocrl import chat
from ocrl.bench import agent as bench_agent
from ocrl.bench.prompts import PROMPTS
from ocrl.types import Message, SamplingParams


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


async def bench_train_long(config, prompts: tuple[int, ...], max_tokens: int) -> None:
    """`bench train-long`: the long agent rows alone (bench/agent.py), at the prompt lengths
    given (--long-prompts, one session's turns): one trainer step with gradient checkpointing
    and one without, time per 1k prompt tokens and resident peak of each, in the same run."""
    from ocrl import memory, models
    from ocrl.daemon import set_threads
    from ocrl.engine.hf import HFEngine
    from ocrl.train.trainer import Trainer

    set_threads(config)
    if hasattr(memory, "tune") and not getattr(config, "no_malloc_tune", False):
        memory.tune()  # the allocator as the daemon sets it, so the peaks are the daemon's
    loaded = await anyio.to_thread.run_sync(lambda: models.load(config.model, device=config.device, dtype=config.dtype, random_init=config.random_init))
    engine = HFEngine(loaded, max_batch_size=config.max_batch_size, prefix_cache_budget="off")
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        samples = await bench_agent.agent_samples(engine, loaded.tokenizer, targets=prompts, max_tokens=max_tokens)
        tg.cancel_scope.cancel()
    del engine  # what serving held is not the trainer's to measure
    trainer = await anyio.to_thread.run_sync(lambda: Trainer(config, loaded.model, engine=None, yield_to=None))
    references = await anyio.to_thread.run_sync(lambda: trainer.response_logprobs(samples, reference=True))
    print(f"bench train-long ({loaded.name}, {config.threads or 'half the'} torch threads, --gradient-checkpointing {config.gradient_checkpointing})")
    for row in await anyio.to_thread.run_sync(bench_agent.checkpoint_rows, trainer, samples, references):
        print(row)
