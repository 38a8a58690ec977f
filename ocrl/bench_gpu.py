"""`python -m ocrl bench gpu`: the GPU path's systems figures, each beside a baseline measured in
the same run, for each engine present (transformers always; SGLang when it imports, twice: full
weight swaps, and `sglang-lora` with `--weight-sync lora`, serving through the adapter).

- serving tokens/s: `--concurrency` requests of `--max-tokens` tokens at once through the
  engine, over the same requests through the bare library (HF `model.generate`, or the plain
  `sglang.Engine.async_generate` of the same engine, log-probs on in both);
- swap seconds: one `update_weights` of what the trainer publishes, over one torch forward pass
  of the model on the step's batch;
- stall: the longest gap between tokens of a request streaming while a swap lands, over its
  median gap without a swap (and beside the swap itself: the target is stall <= swap);
- step seconds: one trainer step (LoRA by default; `--full-finetune`), over the same forward.

The model is `--model`, or a named architecture with random weights (`--random-init`,
default qwen3-4b on CUDA): these figures depend on shapes, not on trained weights. Without
CUDA it runs the same code on CPU with `--random-init tiny` as a smoke check and says so: those
are not GPU figures.
"""

from __future__ import annotations

import statistics
import time

import anyio
import msgspec

from ocrl.types import Message, SamplingParams

PROMPTS = ["Write a poem about the sea.", "Explain how a bicycle works.", "List ten fruits.", "Tell me a story."]


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def bench_gpu(config, args) -> None:
    import torch

    from ocrl import models
    from ocrl.daemon import set_threads
    from ocrl.engine import select

    cuda = torch.cuda.is_available()
    if cuda:
        random_init = config.random_init or ("qwen3-4b" if config.model == "embedded" else "")
        device = "cuda"
    else:
        print("bench gpu: no CUDA device here. Running the same code on CPU with --random-init tiny as a smoke "
              "check; these are NOT GPU figures.")  # fmt: skip
        random_init, device = config.random_init or "tiny", "cpu"
    config = msgspec.structs.replace(config, random_init=random_init, device=device)
    set_threads(config)
    started = time.perf_counter()
    loaded = await anyio.to_thread.run_sync(
        lambda: models.load(config.model, device=config.device, dtype=config.dtype, random_init=config.random_init)
    )
    params = sum(p.numel() for p in loaded.model.parameters())
    first = next(loaded.model.parameters())
    print(f"model {loaded.name}: {params / 1e9:.2f}B parameters, {first.device}, {str(first.dtype).removeprefix('torch.')}, "
          f"attention {loaded.model.config._attn_implementation}, loaded in {time.perf_counter() - started:.1f}s")  # fmt: skip
    engines = ["hf"]
    if cuda:
        problem = select.sglang_problem()
        # sglang-lora: the same engine with --weight-sync lora (adapters swapped, not weights)
        engines += ["sglang", "sglang-lora"] if problem is None else []
        if problem:
            print(f"sglang: not measured ({problem})")
    concurrency = args.concurrency or 8
    max_tokens = args.max_tokens or 128
    repeats = max(1, min(args.repeats, 3))
    results = {}
    for which in engines:
        results[which] = await bench_engine(which, config, loaded, concurrency, max_tokens, repeats)
        if cuda:
            torch.cuda.empty_cache()
    print()
    print(f"{'engine':8} {'serve tok/s':>12} {'baseline':>10} {'ratio':>6}   {'swap s':>8} {'forward s':>10} {'ratio':>7}"
          f"   {'stall s':>8} {'gap s':>8} {'ratio':>7}   {'step s':>8} {'ratio':>7}  verified")  # fmt: skip
    for which, r in results.items():
        print(f"{which:8} {r['serve']:12.1f} {r['serve_base']:10.1f} {r['serve'] / r['serve_base']:6.2f}   "
              f"{r['swap']:8.3f} {r['forward']:10.4f} {r['swap'] / r['forward']:7.1f}   "
              f"{r['stall']:8.3f} {r['gap']:8.4f} {r['stall'] / r['gap']:7.1f}   "
              f"{r['step']:8.3f} {r['step'] / r['forward']:7.1f}  {r['verified']} (probe diff {r['probe_diff']:.3g})")  # fmt: skip
    print(f"\nstall vs swap: " + ", ".join(f"{w} {r['stall']:.3f}s vs {r['swap']:.3f}s" for w, r in results.items())
          + "; mixed-version completions: " + (", ".join(f"{w} {r['mixed']}" for w, r in results.items() if w != "hf") or "-"))  # fmt: skip
    print(f"targets (Qwen3-4B class, one H100/H200): swap <= 1 s; stall <= swap; sglang serve ratio >= 0.90. "
          f"total {time.perf_counter() - started:.0f}s")  # fmt: skip


async def bench_engine(which: str, config, loaded, concurrency: int, max_tokens: int, repeats: int) -> dict:
    import torch

    from ocrl import chat
    from ocrl.engine.select import build_engine
    from ocrl.train.trainer import Trainer, verify_tolerance
    from ocrl.types import Sample

    med = statistics.median
    kind, _, sync = which.partition("-")  # "sglang-lora": engine sglang, --weight-sync lora
    engine = await build_engine(msgspec.structs.replace(config, engine=kind, weight_sync=sync or "full"), loaded)
    device = next(loaded.model.parameters()).device
    prompts = [chat.prompt_ids(loaded.tokenizer, [Message(role="user", content=PROMPTS[i % len(PROMPTS)])]) for i in range(concurrency)]
    out: dict = {}
    trainer = await anyio.to_thread.run_sync(
        lambda: Trainer(config, loaded.model, engine=engine, device=device, verify_atol=verify_tolerance(loaded.model), yield_to=None)
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        if getattr(engine, "accepts_adapters", False):
            await trainer.publish()  # serve through the (initial) adapter, as the daemon would after a step

        # 1. serving tokens/s through the engine, then through the bare library
        async def through_engine() -> int:
            counts = [0] * concurrency

            async def one(i):
                c = await engine.generate(prompts[i], SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i))
                counts[i] = len(c.response_ids)

            async with anyio.create_task_group() as group:
                for i in range(concurrency):
                    group.start_soon(one, i)
            return sum(counts)

        bare = _bare_generate(which, engine, loaded, prompts, max_tokens)
        served, base = [], []
        await through_engine()  # warm-up (CUDA graphs, allocator)
        await bare()
        for _ in range(repeats):
            t = time.perf_counter()
            n = await through_engine()
            served.append(n / (time.perf_counter() - t))
            t = time.perf_counter()
            n = await bare()
            base.append(n / (time.perf_counter() - t))
        out["serve"], out["serve_base"] = med(served), med(base)
        print(f"{which}: serving {out['serve']:.1f} tok/s, bare {out['serve_base']:.1f} tok/s ({concurrency} x {max_tokens} tokens)")

        # 2. a batch of completions -> trainer steps (each publishes and verifies a swap)
        batch = []
        for i in range(config.rollout_batch_size):
            c = await engine.generate(prompts[i % concurrency], SamplingParams(max_tokens=32, temperature=1.0, seed=100 + i))
            n = len(c.response_ids)
            if n == 0:
                continue
            batch.append(Sample(sample_id=str(i), session_id="bench", turn_index=i, tokens=c.prompt_ids + c.response_ids,
                                response_length=n, loss_mask=[1] * n, rollout_logprobs=c.logprobs,
                                reward=1.0 if i % 2 else -1.0, weights_version=0, score=1))  # fmt: skip
        rows = [await trainer.step(batch) for _ in range(repeats + 1)][1:]  # the first warms up
        out["step"] = med(r["step_seconds"] for r in rows)
        out["swap"] = med(r["swap_seconds"] for r in rows)
        out["verified"] = all(bool(r["verified"]) for r in rows)
        out["probe_diff"] = max(r["probe_diff"] for r in rows)

        # 3. the baseline for both: one forward pass of the served model over the same batch
        out["forward"] = med([await anyio.to_thread.run_sync(_forward_seconds, loaded.model, batch, device) for _ in range(repeats + 1)][1:])
        print(f"{which}: step {out['step']:.3f}s, swap {out['swap']:.3f}s, forward {out['forward']:.4f}s, "
              f"verified {out['verified']} (probe diff {out['probe_diff']:.3g})")  # fmt: skip

        # 4. a request streaming while a swap lands, against the same request without one
        long = SamplingParams(max_tokens=max(64, max_tokens), temperature=1.0, seed=7)

        tensors = await anyio.to_thread.run_sync(trainer.published_weights)
        window = [0.0, 0.0]

        async def swap() -> None:  # from its own task, as the trainer does: the reader keeps reading
            window[0] = time.perf_counter()
            await engine.update_weights(tensors, version=engine.weights_version + 1)
            window[1] = time.perf_counter()

        async def stream_times(swap_after: int | None) -> list[float]:
            times: list[float] = []
            async with anyio.create_task_group() as group:
                async for _ in engine.stream(prompts[0], long):
                    times.append(time.perf_counter())
                    if len(times) == swap_after:
                        group.start_soon(swap)
            return times

        quiet = await stream_times(None)
        gaps = [b - a for a, b in zip(quiet, quiet[1:])]
        out["gap"] = med(gaps) if gaps else float("nan")
        times = await stream_times(8)
        t0, t1 = window
        out["swap_wall"] = t1 - t0  # includes any wait for the engine to let the swap in
        straddling = [b - a for a, b in zip(times, times[1:]) if b >= t0 and a <= t1] or [b - a for a, b in zip(times, times[1:])]
        out["stall"] = max(straddling) if straddling else float("nan")
        out["mixed"] = getattr(engine, "mixed_completions", "-")
        print(f"{which}: stall {out['stall']:.3f}s during a swap (the swap call took {out['swap_wall']:.3f}s with its "
              f"wait), median gap {out['gap']:.4f}s")  # fmt: skip
        tg.cancel_scope.cancel()
    del trainer
    return out


def _bare_generate(which: str, engine, loaded, prompts: list[list[int]], max_tokens: int):
    """The library alone on the same requests: tokens generated by one call."""
    import torch

    if which.startswith("sglang"):

        async def plain() -> int:
            results = await engine.inner.async_generate(
                input_ids=prompts, sampling_params={"max_new_tokens": max_tokens, "temperature": 1.0,
                                                    "stop_token_ids": list(engine.eos_ids)},
                return_logprob=True,
            )  # fmt: skip
            return sum(len(r["output_ids"]) for r in results)

        return plain

    model, tokenizer = loaded.model, loaded.tokenizer
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)

    def generate() -> int:
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                max_new_tokens=max_tokens, pad_token_id=pad, output_scores=True, return_dict_in_generate=True,
            )  # fmt: skip
        new = out.sequences[:, width:]
        return int((new != pad).sum())

    async def plain() -> int:
        return await anyio.to_thread.run_sync(generate)

    return plain


def _forward_seconds(model, batch, device) -> float:
    import torch

    width = max(len(s.tokens) for s in batch)
    ids = torch.tensor([s.tokens + [0] * (width - len(s.tokens)) for s in batch], device=device)
    _sync(device)
    started = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=ids, use_cache=False)
    _sync(device)
    return time.perf_counter() - started
