"""`python -m ocrl bench gpu [--report FILE.json]`: every GPU figure in one command, each beside a
baseline measured in the same run, for each architecture (`--archs`, default qwen3-0.6b and
qwen3-4b with random weights in bf16: these figures depend on shapes, not on trained weights) and
each engine present (transformers always; SGLang when it imports, twice: full weight swaps, and
`sglang-lora` with `--weight-sync lora`, serving through the adapter):

- the gpu tests (`pytest -m gpu`), run first in a subprocess: passed / failed / skipped;
- serving tokens/s at batch 1, 8 and 32 (`--batches`) through the engine, over the same requests
  through the bare library (HF `model.generate`, or SGLang's plain `async_generate`);
- trainer step seconds (LoRA by default) over a bare forward + backward + AdamW step of the same
  model on the same batch;
- swap seconds (what the trainer publishes: merged weights, or the adapter for `sglang-lora`)
  over one forward pass of the served model on the step's batch;
- stall: the longest gap between tokens of a request streaming while a trainer step and its swap
  run, over its median gap without them;
- peak GPU memory of engine + trainer (torch's allocator; SGLang's static pool is reported apart).

The report (`--report`) is JSON, rewritten after every section, so a run cut short keeps what it
measured. The whole command keeps to `--budget-s` seconds of wall time (default 450, counted from
the process's start; see budget.py): the gpu tests get at most a third of what is left, and a
section that cannot finish in what remains is not started (or is cut), and is listed under
"skipped" in the report with the reason. Without CUDA the same code runs on CPU with
`--random-init tiny` as a smoke check and says so: those are not GPU figures.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import anyio
import msgspec

from ocrl.bench.budget import Budget
from ocrl.types import Message, Sample, SamplingParams

PROMPTS = ["Write a poem about the sea.", "Explain how a bicycle works.", "List ten fruits.", "Tell me a story."]
med = statistics.median


class Report:
    """The figures so far, written out after each section."""

    def __init__(self, path: str):
        self.path = Path(path) if path else None
        self.data: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "archs": {}}

    def save(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.data, indent=1, default=str) + "\n")


def environment(cuda: bool) -> dict:
    import torch
    import transformers

    from ocrl.engine import select

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0) if cuda else f"CPU ({os.cpu_count()} cores)",
           "sglang": select.sglang_problem() or "present"}  # fmt: skip
    try:
        import flash_attn  # noqa: F401

        env["flash_attn"] = flash_attn.__version__
    except ImportError:
        env["flash_attn"] = "absent (attention is SDPA)"
    return env


def gpu_tests(timeout: float) -> dict:
    """`pytest -m gpu` in a subprocess: its counts and its last lines."""
    started = time.perf_counter()
    checkout = Path(__file__).resolve().parents[2]  # ocrl/bench/gpu.py -> the repository root, where tests/ is
    if not (checkout / "tests" / "test_gpu.py").exists():
        return {"skipped": f"no tests/test_gpu.py under {checkout} (not a checkout)"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_gpu.py"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=checkout)
        said, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        said, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", said)}
    return {"rc": rc, **counts, "seconds": round(time.perf_counter() - started, 1), "tail": said[-2500:]}


def since_start() -> float:
    """Seconds since this process started (Linux; 0 where /proc says nothing): the budget counts
    the imports too."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return max(0.0, float(Path("/proc/uptime").read_text().split()[0]) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


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
    report = Report(getattr(args, "report", "") or "")
    if cuda:
        archs = [a for a in (args.archs or "qwen3-0.6b,qwen3-4b").split(",") if a] if not config.random_init else [config.random_init]
        device = "cuda"
    else:
        print("bench gpu: no CUDA device here. Running the same code on CPU with --random-init tiny as a smoke "
              "check; these are NOT GPU figures.")  # fmt: skip
        archs, device = [config.random_init or "tiny"], "cpu"
    if config.model != "embedded" and cuda and not config.random_init:
        archs = [""]  # a real model: --model as given
    batches = [int(b) for b in (args.batches or ("1,8,32" if cuda else "1,4")).split(",")]
    # sized to end within 8 minutes on one H200 with the transformers engine (~0.1 s a decode step)
    max_tokens = args.max_tokens or (32 if cuda else 8)
    repeats = max(1, min(args.repeats, 2))
    report.data["environment"] = env = environment(cuda)
    report.data["settings"] = {"batches": batches, "max_tokens": max_tokens, "repeats": repeats, "lora_rank": config.lora_rank,
                               "full_finetune": config.full_finetune, "rollout_batch_size": config.rollout_batch_size,
                               "budget_s": args.budget_s}  # fmt: skip
    budget = Budget(args.budget_s, report.data.setdefault("skipped", {}), spent=since_start(), save=report.save)
    print(f"bench gpu on {env['device']}: torch {env['torch']}, transformers {env['transformers']}, sglang {env['sglang']}; "
          f"budget {args.budget_s:.0f} s, {budget.left():.0f} s left after start-up")  # fmt: skip
    report.save()
    started = time.perf_counter()

    # 1. the gpu tests, in a process of their own (they build their own engines), within the budget
    if cuda and not args.no_gpu_tests:

        async def run_tests() -> None:
            timeout = min(args.test_timeout, budget.left() / 3)
            report.data["gpu_tests"] = tests = await anyio.to_thread.run_sync(gpu_tests, timeout)
            print(f"gpu tests: {tests.get('passed', 0)} passed, {tests.get('failed', 0)} failed, {tests.get('skipped', 0)} skipped "
                  f"(rc {tests['rc']}, {tests['seconds']:.0f}s of at most {timeout:.0f}s)")  # fmt: skip
            if tests["rc"] not in (0, 5):
                print(tests["tail"])

        if not await budget.run("gpu tests", run_tests):
            report.data["gpu_tests"] = {"skipped": budget.skipped["gpu tests"]}
    else:
        report.data["gpu_tests"] = {"skipped": "no CUDA" if not cuda else "--no-gpu-tests"}
    report.save()

    # 2. each architecture, each engine: every piece a section of the budget
    for arch in archs:
        arch_config = msgspec.structs.replace(config, random_init=arch, device=device, max_batch_size=max(max(batches), config.max_batch_size))
        set_threads(arch_config)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        held: dict = {}

        async def load(arch_config=arch_config) -> None:
            held["loaded"] = await anyio.to_thread.run_sync(
                lambda: models.load(arch_config.model, device=arch_config.device, dtype=arch_config.dtype, random_init=arch_config.random_init)
            )

        t = time.perf_counter()
        if not await budget.run(f"{arch or config.model}/load", load, kind="load"):
            continue
        loaded = held.pop("loaded")
        params = sum(p.numel() for p in loaded.model.parameters())
        first = next(loaded.model.parameters())
        entry = report.data["archs"][loaded.name] = {
            "parameters_b": round(params / 1e9, 3), "dtype": str(first.dtype).removeprefix("torch."),
            "attention": loaded.model.config._attn_implementation, "load_seconds": round(time.perf_counter() - t, 1),
            "model_gib": round(torch.cuda.memory_allocated() / 2**30, 2) if cuda else None, "engines": {},
        }  # fmt: skip
        print(f"\n{loaded.name}: {params / 1e9:.2f}B parameters, {first.device}, {entry['dtype']}, attention {entry['attention']}")
        engines = ["hf"]
        if cuda and select.sglang_problem() is None:
            engines += ["sglang", "sglang-lora"]
        for which in engines:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            out = entry["engines"][which] = {"serve": {}}
            try:
                await bench_engine(which, arch_config, loaded, batches, max_tokens, repeats, out, budget, f"{loaded.name}/{which}")
            except Exception as e:  # one engine's failure is a figure too; the others still run
                out["error"] = f"{type(e).__name__}: {e}"
                print(f"{which}: failed: {type(e).__name__}: {e}")
            if cuda:
                out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            report.save()
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        if not cuda or "sglang" not in engines:
            entry["missing"] = "SGLang rows (sglang not installed: " + env["sglang"] + "); adapter swaps are SGLang's --weight-sync lora"
        del loaded
        gc.collect()
        report.save()
    report.data["seconds"] = round(time.perf_counter() - started, 1)
    report.data["budget_left_s"] = round(budget.left(), 1)
    report.save()
    print_table(report.data)
    if report.path:
        print(f"report: {report.path}")


def print_table(data: dict) -> None:
    print(f"\n{data['environment']['device']}, torch {data['environment']['torch']}, {data['seconds']:.0f}s in all "
          f"(budget {data['settings']['budget_s']:.0f}s)")  # fmt: skip
    for arch, entry in data["archs"].items():
        for which, r in entry["engines"].items():
            if "error" in r:
                print(f"{arch:18} {which:11} error: {r['error']}")
            serve = "  ".join(f"b{b}: {s['tokens_per_s']:.0f} tok/s = {s['ratio']:.2f}x bare" for b, s in r["serve"].items())
            print(f"{arch:18} {which:11} {serve or 'no serving figures'}")
            if "step_s" in r:
                print(f"{'':30} step {r['step_s']:.3f}s = {r['step_ratio']:.2f}x bare fwd+bwd+AdamW ({r['bare_step_s']:.3f}s); "
                      f"swap ({r['swap_kind']}) {r['swap_s']:.3f}s = {r['swap_ratio']:.2f}x a forward ({r['forward_s']:.4f}s); "
                      f"verified {r['verified']}; peak {r.get('peak_gib', '-')} GiB")  # fmt: skip
            if "stall_s" in r:
                print(f"{'':30} stall {r['stall_s']:.3f}s = {r['stall_ratio']:.1f}x median decode step ({r['decode_step_s']:.4f}s)")
        if "missing" in entry:
            print(f"{'':30} not measured: {entry['missing']}")
    for name, reason in data.get("skipped", {}).items():
        print(f"skipped {name}: {reason}")


async def bench_engine(
    which: str, config, loaded, batches: list[int], max_tokens: int, repeats: int, out: dict, budget: Budget, label: str
) -> None:
    """Every figure of one engine into `out`, each piece a section of `budget` named `label/...`."""
    from ocrl import chat
    from ocrl.bench.train import bare_step_fn
    from ocrl.engine.select import build_engine
    from ocrl.train.policy import verify_relative, verify_tolerance
    from ocrl.train.trainer import Trainer

    kind, _, sync = which.partition("-")  # "sglang-lora": engine sglang, --weight-sync lora
    held: dict = {}  # what a section hands the next ones: the engine, the trainer and its batch

    async def start() -> None:  # SGLang launches its processes: not free
        held["engine"] = await build_engine(msgspec.structs.replace(config, engine=kind, weight_sync=sync or "full"), loaded)

    if not await budget.run(f"{label}/start", start, kind=f"{which}/start"):
        return
    engine = held["engine"]
    device = next(loaded.model.parameters()).device
    prompts = [chat.prompt_ids(loaded.tokenizer, [Message(role="user", content=PROMPTS[i % len(PROMPTS)])]) for i in range(max(batches))]
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run)

        # 1. serving tokens/s at each batch size, through the engine and through the bare library
        async def serve(size: int) -> None:
            async def through_engine() -> int:
                counts = [0] * size

                async def one(i):
                    c = await engine.generate(prompts[i], SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i))
                    counts[i] = len(c.response_ids)

                async with anyio.create_task_group() as group:
                    for i in range(size):
                        group.start_soon(one, i)
                return sum(counts)

            bare = _bare_generate(which, engine, loaded, prompts[:size], max_tokens)
            await through_engine()  # warm-up (allocator, kernels)
            await bare()
            served, base = [], []
            for _ in range(repeats):
                t = time.perf_counter()
                served.append(await through_engine() / (time.perf_counter() - t))
                t = time.perf_counter()
                base.append(await bare() / (time.perf_counter() - t))
            out["serve"][size] = {"tokens_per_s": med(served), "bare_tokens_per_s": med(base), "ratio": med(served) / med(base)}
            print(f"{which}: batch {size}: {med(served):.1f} tok/s through the engine, {med(base):.1f} bare ({size} x {max_tokens} tokens)")

        for size in batches:
            await budget.run(f"{label}/serve b{size}", lambda size=size: serve(size), kind=f"{which}/serve")

        # 2. a batch of completions; the trainer as the daemon builds it (it gives way to serving)
        async def train() -> None:
            completions: list = [None] * config.rollout_batch_size

            async def complete(i: int) -> None:  # seeded: the same sample whatever shares the batch
                completions[i] = await engine.generate(prompts[i % len(prompts)], SamplingParams(max_tokens=32, temperature=1.0, seed=100 + i))

            async with anyio.create_task_group() as group:
                for i in range(config.rollout_batch_size):
                    group.start_soon(complete, i)
            batch = [
                Sample(sample_id=str(i), session_id="bench", turn_index=i, tokens=c.prompt_ids + c.response_ids,
                       response_length=len(c.response_ids), loss_mask=[1] * len(c.response_ids), rollout_logprobs=c.logprobs,
                       reward=1.0 if i % 2 else -1.0, weights_version=0, score=1)
                for i, c in enumerate(completions) if c.response_ids
            ]  # fmt: skip
            trainer = await anyio.to_thread.run_sync(
                lambda: Trainer(config, loaded.model, engine=engine, device=device, verify_atol=verify_tolerance(loaded.model), verify_rtol=verify_relative(loaded.model))
            )
            if getattr(engine, "accepts_adapters", False):
                await trainer.publish()  # serve through the (initial) adapter, as the daemon would after a step
            bare_step = bare_step_fn(trainer, batch, config.lr)

            def timed(fn) -> float:
                _sync(device)
                t = time.perf_counter()
                fn()
                _sync(device)
                return time.perf_counter() - t

            await anyio.to_thread.run_sync(bare_step)  # warm-up
            bare_s = [await anyio.to_thread.run_sync(timed, bare_step) for _ in range(repeats)]
            rows = [await trainer.step(batch) for _ in range(repeats + 1)][1:]  # the first warms up
            out["bare_step_s"] = med(bare_s)
            out["step_s"] = med(r["step_seconds"] for r in rows)
            out["step_ratio"] = out["step_s"] / out["bare_step_s"]
            out["swap_s"] = med(r["swap_seconds"] for r in rows)
            out["swap_kind"] = "adapter" if getattr(engine, "accepts_adapters", False) else "merged"
            out["verified"] = all(bool(r["verified"]) for r in rows)
            out["probe_diff"] = max(r["probe_diff"] for r in rows)
            out["forward_s"] = med([await anyio.to_thread.run_sync(_forward_seconds, loaded.model, batch, device) for _ in range(repeats + 1)][1:])
            out["swap_ratio"] = out["swap_s"] / out["forward_s"]
            held.update(trainer=trainer, batch=batch)
            print(f"{which}: step {out['step_s']:.3f}s vs bare {out['bare_step_s']:.3f}s; swap ({out['swap_kind']}) {out['swap_s']:.3f}s vs "
                  f"forward {out['forward_s']:.4f}s; verified {out['verified']} (probe diff {out['probe_diff']:.3g})")  # fmt: skip

        trained = await budget.run(f"{label}/train", train, kind=f"{which}/train")

        # 3. a request streaming while a trainer step and its swap run, against the same without
        async def stall() -> None:
            trainer, batch = held["trainer"], held["batch"]
            long = SamplingParams(max_tokens=max(96, max_tokens), temperature=1.0, seed=7)
            window = [0.0, 0.0]

            async def step() -> None:
                window[0] = time.perf_counter()
                await trainer.step(batch)
                window[1] = time.perf_counter()

            async def stream_times(step_after: int | None) -> list[float]:
                times: list[float] = []
                async with anyio.create_task_group() as group:
                    async for _ in engine.stream(prompts[0], long):
                        times.append(time.perf_counter())
                        if len(times) == step_after:
                            group.start_soon(step)
                return times

            quiet = await stream_times(None)
            gaps = [b - a for a, b in zip(quiet, quiet[1:])]
            out["decode_step_s"] = med(gaps)
            times = await stream_times(8)
            t0, t1 = window
            during = [b - a for a, b in zip(times, times[1:]) if b >= t0 and a <= t1] or [b - a for a, b in zip(times, times[1:])]
            out["stall_s"] = max(during)
            out["stall_ratio"] = out["stall_s"] / out["decode_step_s"]
            out["step_and_swap_wall_s"] = t1 - t0 if t1 else None
            out["mixed_completions"] = getattr(engine, "mixed_completions", None)
            print(f"{which}: longest gap {out['stall_s']:.3f}s while a step + swap ran ({out['step_and_swap_wall_s']}s), median decode step "
                  f"{out['decode_step_s']:.4f}s")  # fmt: skip

        if trained:
            await budget.run(f"{label}/stall", stall, kind=f"{which}/stall")
        else:
            budget.skip(f"{label}/stall", "needs the train section, which did not run to the end")
        tg.cancel_scope.cancel()


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
