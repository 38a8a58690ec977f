"""Agent-shaped benchmarks: the traffic OpenClaw sends (a long system prompt with tools, the
whole conversation re-sent each turn, ~300 tokens more per turn) and the long samples it leaves
for the trainer. `bench serve` and `bench train` print these rows beside their own.

- serve: time to first token of turns 2-6 with the HF engine's prefix cache over the same turns
  without it (sessions interleaved, same run), and the memory the cache held.
- train: trainer step time per 1k prompt tokens on samples of 3k+ prompt tokens and a short
  response, against a bare forward + backward + AdamW of the same samples; the reference pass
  alone, and with the reference's own prefix cache.
"""

from __future__ import annotations

import json
import random
import statistics
import time

from ocrl import chat
from ocrl.types import Message

AGENT_WORDS = (
    "read write file path list search grep edit patch test run build deploy config user repo branch commit diff log "
    "error warning output result value table row column query index cache memory thread lock queue event session "
    "token model request response status header body json schema field type string number array object default"
).split()
AGENT_TURNS = 6


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(AGENT_WORDS) for _ in range(n))


def agent_tools(rng: random.Random, n: int) -> list[dict]:
    """n function tools with OpenClaw-like descriptions and parameters (synthetic words)."""
    return [
        {"type": "function", "function": {
            "name": f"{rng.choice(AGENT_WORDS)}_{rng.choice(AGENT_WORDS)}_{i}",
            "description": _words(rng, 40),
            "parameters": {"type": "object", "properties": {w: {"type": "string", "description": _words(rng, 8)} for w in rng.sample(AGENT_WORDS, 3)}},
        }} for i in range(n)
    ]  # fmt: skip


def agent_system(rng: random.Random) -> tuple[str, list[dict]]:
    """A system prompt and 16 tools: ~3k tokens in SmolLM2's template, as OpenClaw's trimmed agent."""
    tools = agent_tools(rng, 16)
    return "You are a coding agent working in the user's repository. " + _words(rng, 550), tools


def tool_output(rng: random.Random) -> str:
    """~285 tokens: with the reply before it, a turn grows the conversation by ~300."""
    return "Tool output:\n" + _words(rng, 280)


async def serve_rows(client, url: str, headers: dict, engine, tokenizer, repeats: int) -> list[str]:
    """bench serve (c): sessions with the prefix cache and without it, interleaved, one pair per repeat."""
    from ocrl.engine.prefix_cache import PrefixCache

    if not hasattr(engine, "prefix_cache"):
        return ["  agent turns: this engine keeps its own prefix cache (SGLang's radix cache); no row"]
    system, tools = agent_system(random.Random(0))
    system_tokens = len(chat.prompt_ids(tokenizer, [Message(role="system", content=system)], tools))

    async def turn(messages: list[dict]) -> tuple[float, str, dict]:
        """Time to the first sampled token (its log-prob event), the reply, the usage."""
        body = {"model": "m", "messages": messages, "tools": tools, "temperature": 0, "max_tokens": 8, "stream": True,
                "logprobs": True, "stream_options": {"include_usage": True}}  # fmt: skip
        started, first, text, usage = time.perf_counter(), None, [], {}
        async with client.stream("POST", url, json=body, headers=headers) as reply:
            reply.raise_for_status()
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    if first is None and (choice.get("logprobs") or {}).get("content"):
                        first = time.perf_counter() - started
                    text.append(choice["delta"].get("content") or "")
        return first, "".join(text) or "(tool call)", usage

    async def session(seed: int, cached: bool) -> list[tuple[float, dict]]:
        kept = engine.prefix_cache
        if not cached:
            engine.prefix_cache = PrefixCache()  # keeps nothing, finds nothing
        try:
            own = random.Random(seed)
            messages = [{"role": "system", "content": system}, {"role": "user", "content": "Fix the failing test. " + _words(own, 40)}]
            rows = []
            for _ in range(AGENT_TURNS):
                first, reply, usage = await turn(messages)
                rows.append((first, usage))
                # ~300 tokens a turn: the reply and a tool result
                messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": tool_output(own)}]
            return rows
        finally:
            engine.prefix_cache = kept

    await session(1000, cached=True)  # warm-up: long-prompt paths, and the system prompt kept
    with_cache, without, held = [], [], []
    for r in range(max(1, repeats // 2)):
        with_cache.append(await session(2 * r, cached=True))
        held.append(engine.prefix_cache.bytes)
        without.append(await session(2 * r + 1, cached=False))
    med = statistics.median
    later_with = [first for rows in with_cache for first, _ in rows[1:]]
    later_without = [first for rows in without for first, _ in rows[1:]]
    first_with, first_without = [rows[0][0] for rows in with_cache], [rows[0][0] for rows in without]
    prompts = [usage["prompt_tokens"] for _, usage in with_cache[0]]
    cached_share = sum(u["prompt_tokens_details"]["cached_tokens"] for rows in with_cache for _, u in rows[1:]) / sum(
        u["prompt_tokens"] for rows in with_cache for _, u in rows[1:]
    )
    stats = engine.prefix_cache.stats()
    return [
        f"  agent turns 2-{AGENT_TURNS}: first token, cache / none {med(later_with) / med(later_without):6.3f}x   "
            f"({med(later_with) * 1000:.0f} ms vs {med(later_without) * 1000:.0f} ms; target <= 0.2x; prompts {prompts[0]}..{prompts[-1]} tokens, "
            f"system + tools {system_tokens}; {cached_share:.0%} of their prompt tokens cached; {len(with_cache)} session pair(s), medians)",
        f"    turn 1, system prompt shared with an earlier session {med(first_with) / med(first_without):6.3f}x   "
            f"({med(first_with) * 1000:.0f} ms vs {med(first_without) * 1000:.0f} ms)",
        f"    cache memory: {max(held) / 2**20:.0f} MiB after a session at most, {stats['bytes'] / 2**20:.0f} MiB now in "
            f"{stats['entries']} entries / {stats['tokens']} tokens (bound {stats['max_bytes'] / 2**20:.0f} MiB)",
    ]


LONG_PROMPTS = (3000, 3300, 3600)  # one session's consecutive turns (OpenClaw's lean agent grows to ~8k, its default to ~13k)


async def agent_samples(engine, tokenizer, targets=LONG_PROMPTS, max_tokens: int = 16) -> list:
    """Samples of one agent session at the given prompt lengths: real completions of the engine,
    each turn's prompt the previous one's + its response + tool output."""
    from ocrl.types import Sample, SamplingParams

    rng = random.Random(7)
    system, tools = agent_system(rng)
    messages = [Message(role="system", content=system), Message(role="user", content="Fix the failing test. " + _words(rng, 40))]
    samples = []
    for target in targets:
        while len(ids := chat.prompt_ids(tokenizer, messages, tools)) < target:
            messages += [Message(role="assistant", content="Running the next tool."), Message(role="user", content=tool_output(rng))]
        c = await engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=len(samples)))
        n = len(c.response_ids)
        if n == 0:
            raise ValueError(f"a {len(ids)}-token prompt leaves no room for a response in the model's context; ask for a shorter one")
        samples.append(Sample(sample_id=f"agent-{len(samples)}", session_id="agent", turn_index=len(samples), tokens=ids + c.response_ids,
                              response_length=n, loss_mask=[1] * n, rollout_logprobs=c.logprobs, reward=1.0, weights_version=0, score=1))  # fmt: skip
        messages += [Message(role="assistant", content=c.text), Message(role="user", content=tool_output(rng))]
    return samples


def backward_memory(trainer, samples: list) -> tuple[int, int]:
    """(resident bytes a step's backward over the longest sample adds at its peak, as the
    trainer's own budget plans it (budget.py: checkpointed or not by --gradient-checkpointing);
    bytes free now on the trainer's device, or -1 where unknown)."""
    plan = trainer.budget.plan(max(len(s.tokens) for s in samples))
    return plan.need, plan.available


class PeakRSS:
    """The process's resident peak over a block, sampled every 10 ms by a thread, above what it
    held when the block began (the C heap trimmed first, see memory.py)."""

    def __enter__(self) -> "PeakRSS":
        import threading

        from ocrl import memory

        memory.trim()
        self.base = self.peak = memory.rss_mb()
        self._stop = threading.Event()

        def watch() -> None:
            while not self._stop.wait(0.01):
                self.peak = max(self.peak, memory.rss_mb())

        self._thread = threading.Thread(target=watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        from ocrl import memory

        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, memory.rss_mb())

    @property
    def added(self) -> int:
        """Bytes above the start."""
        return int((self.peak - self.base) * 2**20)


def checkpoint_rows(trainer, samples: list, references: list) -> list[str]:
    """One trainer step on `samples` (reference prefetched) with the decoder layers checkpointed
    and the same without (a worker thread): step time per 1k prompt tokens and the resident peak
    each added, beside what budget.py estimates for it (its calibration). A mode the budget says
    would not fit the memory free now is not run, and the row says so."""
    from ocrl.train import budget as budget_mod

    prompt_k = sum(len(s.tokens) - s.response_length for s in samples) / 1000
    longest = max(len(s.tokens) for s in samples)
    kept_mode = trainer.budget.mode
    trainer.probe = min(samples, key=lambda s: len(s.tokens))
    results, rows = {}, []
    try:
        for mode in ("on", "off"):  # the small peak first: a later peak is not hidden by an earlier one
            trainer.budget.mode = mode
            plan = trainer.budget.plan(longest)
            if not plan.fits:
                rows.append(f"    checkpointing {mode:3}: not run: ~{plan.need / 2**30:.1f} GiB estimated for {longest} tokens, "
                            f"{plan.available / 2**30:.1f} GiB free")  # fmt: skip
                continue
            with PeakRSS() as peak:
                started = time.perf_counter()
                trainer._train(samples, references)
                seconds = time.perf_counter() - started
            results[mode] = seconds
            budget = trainer.budget
            count = budget_mod.counted_bytes(budget.model_config, longest, checkpointed=plan.checkpoint, lora_rank=budget.lora_rank,
                                             full_finetune=budget.full_finetune)  # torch's live bytes, counted  # fmt: skip
            rows.append(f"    checkpointing {mode:3}: {seconds / prompt_k:6.2f} s per 1k prompt tokens; peak RSS +{peak.added / 2**30:.2f} GiB "
                        f"({peak.added / longest / 2**20:.2f} MiB per position of the longest, {longest}); estimate {plan.need / 2**30:.2f} GiB "
                        f"(measured / estimate {peak.added / plan.need:.2f}; counted live activations {count / 2**30:.2f} GiB)")  # fmt: skip
    finally:
        trainer.budget.mode = kept_mode
    lengths = ", ".join(str(len(s.tokens) - s.response_length) for s in samples)
    head = f"  gradient checkpointing on long agent samples (prompts {lengths} tokens; one step each, reference prefetched)"
    if len(results) == 2:
        head += f": step on / off {results['on'] / results['off']:6.3f}x"
    return [head] + rows


def train_rows(trainer, samples: list, repeats: int, steps: bool = True) -> list[str]:
    """bench train on long agent samples (a worker thread): the step with the reference prefetched
    and inline, a bare forward + backward + AdamW over the same samples one by one, and the
    reference pass alone with and without its prefix cache; all per 1k prompt tokens. `steps`
    False: the reference pass only (no backward: a fraction of the memory)."""
    import torch

    from ocrl.train.batch import MicroBatch
    from ocrl.train.loss import token_logprobs

    prompt_k = sum(len(s.tokens) - s.response_length for s in samples) / 1000
    optimizer = torch.optim.AdamW(trainer.params, lr=trainer.config.lr)

    def bare() -> None:
        for sample in samples:  # one at a time, as the trainer's packing does for long samples
            micro = MicroBatch.of([sample], trainer.device)
            out = trainer.model(input_ids=micro.input_ids, attention_mask=micro.attention_mask, position_ids=micro.position_ids,
                                use_cache=False, logits_to_keep=micro.targets.shape[1] + 1)  # fmt: skip
            loss = -(token_logprobs(out.logits[:, :-1], micro.targets) * micro.loss_mask).sum() / micro.loss_mask.sum()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def reference(cached: bool) -> list:
        kept = trainer.reference_prefix.cache
        if not cached:
            trainer.reference_prefix.cache = type(kept)()  # keeps nothing, finds nothing
        else:
            kept.clear()  # only what this session's own earlier turns leave
        try:
            return trainer.response_logprobs(samples, reference=True)
        finally:
            trainer.reference_prefix.cache = kept

    def timed(fn, *a) -> float:
        started = time.perf_counter()
        fn(*a)
        return time.perf_counter() - started

    references = reference(cached=True)
    trainer.probe = samples[0]
    step_s, inline_s, bare_s, ref_s, ref_cached_s = [], [], [], [], []
    for _ in range(repeats):
        if steps:
            bare_s.append(timed(bare))
            step_s.append(timed(trainer._train, samples, references))
            trainer.reference_prefix.cache.clear()  # inline: only the session's own turns to reuse
            inline_s.append(timed(trainer._train, samples))
        ref_s.append(timed(reference, False))
        ref_cached_s.append(timed(reference, True))
    med = statistics.median
    lengths = ", ".join(str(len(s.tokens) - s.response_length) for s in samples)
    per_k = lambda xs: med(xs) / prompt_k  # noqa: E731
    rows = [
        f"  long agent samples (one session's turns, prompts {lengths} tokens, responses <= {max(s.response_length for s in samples)}; {repeats} repeats, medians)",
        f"    reference pass, prefix kept / none {med(ref_cached_s) / med(ref_s):6.3f}x   ({per_k(ref_cached_s):.2f} s vs {per_k(ref_s):.2f} s per 1k prompt tokens: "
        f"each turn computes only what the previous one did not)",
    ]
    if not steps:
        return rows
    return rows + [
        f"    trainer step / bare fwd+bwd+AdamW  {med(step_s) / med(bare_s):6.3f}x   ({per_k(step_s):.2f} s vs {per_k(bare_s):.2f} s per 1k prompt tokens; "
        f"reference prefetched)",
        f"      the same, reference inline       {med(inline_s) / med(bare_s):6.3f}x   ({per_k(inline_s):.2f} s per 1k prompt tokens; "
        f"each sample alone, through the reference's prefix cache)",
    ]
