"""The prefix cache: its bookkeeping on hand-made tensors, then the HF engine with the cache
against the same engine without it (same weights): same greedy tokens, same log-probs within
1e-4, for multi-turn sessions, mixed batches, across a weight swap and for late arrivals."""

from __future__ import annotations

import anyio
import pytest
import torch

from ocrl.engine.prefix_cache import PrefixCache, parse_budget
from ocrl.types import SamplingParams
from tests.test_engine import tiny_engine

torch.set_num_threads(1)


def layers(n: int, fill: float = 1.0, n_layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) of shape (H=2, T=n, D=4); position t holds fill + t."""
    pos = torch.arange(n, dtype=torch.float32).view(1, n, 1).expand(2, n, 4)
    return [(fill + pos.clone(), -(fill + pos.clone())) for _ in range(n_layers)]


BYTES_PER_TOKEN = 2 * 2 * 2 * 4 * 4  # layers x (k, v) x H x D x fp32 = 128


# -- the bookkeeping ------------------------------------------------------------------------


def test_lookup_finds_the_longest_common_prefix_and_honours_the_limit():
    cache = PrefixCache(max_bytes=1 << 20, max_tokens=1 << 20)
    cache.keep([1, 2, 3, 4, 5], layers(5), version=0)
    cache.keep([1, 2, 9, 9], layers(4, fill=100.0), version=0)
    hit = cache.lookup([1, 2, 3, 4, 7, 8], version=0, limit=5)
    assert hit.length == 4  # [1, 2, 3, 4] is shared with the first entry, only [1, 2] with the second
    assert hit.layers[0][0].shape == (2, 4, 4)
    torch.testing.assert_close(hit.layers[1][1][0, :, 0], -torch.tensor([1.0, 2.0, 3.0, 4.0]))
    # the limit leaves at least the last prompt position to compute
    assert cache.lookup([1, 2, 3, 4, 5], version=0, limit=4).length == 4
    assert cache.lookup([1, 2, 9, 9, 9], version=0, limit=2).length == 2
    assert cache.lookup([7, 1, 2], version=0, limit=2).length == 0


def test_an_entry_is_served_only_to_the_version_that_computed_it():
    cache = PrefixCache(max_bytes=1 << 20, max_tokens=1 << 20)
    cache.keep([1, 2, 3], layers(3), version=4)
    assert cache.lookup([1, 2, 3, 4], version=5, limit=3).length == 0
    assert cache.lookup([1, 2, 3, 4], version=4, limit=3).length == 3
    cache.clear()
    assert cache.lookup([1, 2, 3, 4], version=4, limit=3).length == 0
    assert cache.bytes == cache.tokens == len(cache) == 0


def test_a_longer_turn_replaces_the_entry_it_extends():
    cache = PrefixCache(max_bytes=1 << 20, max_tokens=1 << 20)
    cache.keep([1, 2, 3], layers(3), version=0)
    cache.keep([1, 2, 3, 4, 5], layers(5), version=0)  # the next turn of the same session
    assert len(cache) == 1 and cache.tokens == 5
    cache.keep([1, 2], layers(2), version=0)  # already covered: nothing new is kept
    assert len(cache) == 1 and cache.tokens == 5 and cache.bytes == 5 * BYTES_PER_TOKEN


def test_memory_bound_evicts_the_least_recently_used():
    cache = PrefixCache(max_bytes=10 * BYTES_PER_TOKEN, max_tokens=1 << 20)
    cache.keep([1, 1, 1, 1], layers(4), version=0)
    cache.keep([2, 2, 2, 2], layers(4), version=0)
    assert cache.lookup([1, 1, 1, 1, 9], version=0, limit=4).length == 4  # [1...] is now the most recent
    cache.keep([3, 3, 3, 3], layers(4), version=0)  # 12 tokens > 10: the least recently used goes
    assert cache.bytes == 8 * BYTES_PER_TOKEN and len(cache) == 2
    assert cache.lookup([2, 2, 2, 2, 9], version=0, limit=4).length == 0
    assert cache.lookup([1, 1, 1, 1, 9], version=0, limit=4).length == 4
    cache.keep(list(range(11)), layers(11), version=0)  # over the whole budget: not kept
    assert cache.bytes == 8 * BYTES_PER_TOKEN
    by_tokens = PrefixCache(max_bytes=1 << 30, max_tokens=6)
    by_tokens.keep([1, 1, 1, 1], layers(4), version=0)
    by_tokens.keep([2, 2, 2, 2], layers(4), version=0)
    assert by_tokens.tokens == 4 and by_tokens.lookup([1, 1, 1, 1, 1], 0, 4).length == 0


def test_budget_flag():
    assert parse_budget("0") == (0, 0) and parse_budget("off") == (0, 0)
    assert parse_budget("2GiB")[0] == 2 << 30
    assert parse_budget("512MB")[0] == 512 << 20
    assert parse_budget("1000")[0] == 1000
    assert parse_budget("32k tokens")[1] == 32 << 10
    assert parse_budget("20000tok")[1] == 20000
    auto_bytes, _ = parse_budget("auto")
    assert 0 < auto_bytes < 1 << 42
    with pytest.raises(ValueError, match="prefix-cache"):
        parse_budget("lots")


def test_a_bad_budget_flag_stops_the_daemon_before_it_loads_anything():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "ocrl", "serve", "--prefix-cache", "lots"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--prefix-cache 'lots'" in done.stderr


# -- the engine, with the cache against without it ---------------------------------------------


def running(test):
    """Runs the test with two engines of the same weights, with and without the cache."""

    async def wrapper():
        cached, plain = tiny_engine(prefix_cache_budget="auto"), tiny_engine(prefix_cache_budget="0")
        async with anyio.create_task_group() as tg:
            tg.start_soon(cached.run)
            tg.start_soon(plain.run)
            with anyio.fail_after(120):
                await test(cached, plain)
            tg.cancel_scope.cancel()

    wrapper.__name__ = test.__name__
    return wrapper


GREEDY = SamplingParams(max_tokens=8, temperature=0)


def assert_same(with_cache, without):
    assert with_cache.response_ids == without.response_ids
    torch.testing.assert_close(torch.tensor(with_cache.logprobs), torch.tensor(without.logprobs), atol=1e-4, rtol=0)
    assert with_cache.weights_version == without.weights_version


async def both(cached, plain, prompt, params=GREEDY):
    return await cached.generate(prompt, params), await plain.generate(prompt, params)


@running
async def test_a_session_prefills_only_its_new_tokens_and_samples_the_same(cached, plain):
    prompt = [1, 5, 6, 7, 8, 9, 10]
    expected = 0  # nothing cached before the first turn
    for turn in range(4):
        with_cache, without = await both(cached, plain, prompt)
        assert_same(with_cache, without)
        # turn k+1 starts with turn k's prompt and response; all but the last response token
        # (never fed back) were kept
        assert with_cache.cached_tokens == expected
        assert without.cached_tokens == 0
        expected = len(prompt) + len(with_cache.response_ids) - 1
        prompt = prompt + with_cache.response_ids + [3, 4, 11 + turn]
    # sampled at temperature 1 with a seed: the same draws too
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    with_cache, without = await both(cached, plain, prompt, params)
    assert with_cache.cached_tokens > 0
    assert_same(with_cache, without)
    forced = await cached.score(prompt, with_cache.response_ids)
    torch.testing.assert_close(torch.tensor(with_cache.logprobs), torch.tensor(forced), atol=1e-4, rtol=0)


@running
async def test_one_batch_mixes_rows_with_different_cached_lengths(cached, plain):
    system = [1, 30, 31, 32, 33, 34, 35, 36, 37, 38]
    first, _ = await both(cached, plain, system + [40, 41])
    turn2 = system + [40, 41] + first.response_ids + [42]  # a long hit
    other = system + [50, 51, 52]  # shares only the system prompt with the kept sequence
    fresh = [2, 60, 61]  # a miss
    prompts = [turn2, other, fresh, system + [40]]
    results: dict = {}

    async def run(engine, i):
        results[engine, i] = await engine.generate(prompts[i], GREEDY)

    for engine in (cached, plain):  # all four in one batch
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(run, engine, i)
    for i in range(len(prompts)):
        assert_same(results[cached, i], results[plain, i])
    # the last prompt is all kept, but its last position is computed again for its logits
    hits = [len(system) + 2 + len(first.response_ids) - 1, len(system), 0, len(system)]
    assert [results[cached, i].cached_tokens for i in range(4)] == hits


@running
async def test_a_swap_invalidates_every_entry_and_the_turn_records_its_version(cached, plain):
    prompt = [1, 5, 6, 7, 8, 9, 10]
    first, _ = await both(cached, plain, prompt)
    assert len(cached.prefix_cache) == 1
    new = {name: p.detach() + 0.05 for name, p in cached.model.named_parameters()}
    await cached.update_weights(new, version=1)
    await plain.update_weights(new, version=1)
    assert len(cached.prefix_cache) == 0
    prompt = prompt + first.response_ids + [3, 4]
    with_cache, without = await both(cached, plain, prompt)
    assert with_cache.cached_tokens == 0  # computed by version 0: never reused by version 1
    assert_same(with_cache, without)
    assert with_cache.weights_version == 1
    prompt = prompt + with_cache.response_ids + [5]
    with_cache, without = await both(cached, plain, prompt)
    assert with_cache.cached_tokens > 0  # version 1's own entry
    assert_same(with_cache, without)


@running
async def test_a_request_joining_a_running_batch_reuses_the_cache(cached, plain):
    prompt = [1, 5, 6, 7, 8, 9, 10]
    first, _ = await both(cached, plain, prompt)
    follow_up = prompt + first.response_ids + [3, 4]
    long = SamplingParams(max_tokens=60, temperature=1.0, seed=4)
    for engine in (cached, plain):  # no end-of-sequence token: the long one runs to its length limit
        engine.eos_ids = set()
    results, order = {}, []

    async def early(engine):
        results[engine, "long"] = await engine.generate([1, 20, 21], long)
        order.append((engine, "long"))

    async def late(engine):
        while not engine.generated_tokens or not engine.active:  # the long one is decoding
            await anyio.sleep(0.001)
        results[engine] = await engine.generate(follow_up, GREEDY)
        order.append((engine, "late"))

    for engine in (cached, plain):
        async with anyio.create_task_group() as tg:
            tg.start_soon(early, engine)
            tg.start_soon(late, engine)
        # it joined the running batch: done while the long one still decoded
        assert results[engine, "long"].finish_reason == "length"
        assert order[-2:] == [(engine, "late"), (engine, "long")]
    assert results[cached].cached_tokens == len(prompt) + len(first.response_ids) - 1
    assert_same(results[cached], results[plain])
    assert_same(results[cached, "long"], results[plain, "long"])


# -- end to end -------------------------------------------------------------------------------


async def test_the_next_turn_reports_its_cached_prompt_tokens(daemon):
    """The real daemon and client: turn 2 of a conversation re-sends turn 1, and the usage says
    how much of it the engine did not prefill again (OpenAI's prompt_tokens_details)."""
    messages = [
        {"role": "system", "content": "You are a terse assistant for a lighthouse keeper named Ilse."},
        {"role": "user", "content": "Which lamp oil burns longest?"},
    ]
    async with daemon.client() as client:
        first = await client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=12)
        messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "And the cheapest?"}]
        second = await client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=12)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    stats = daemon.stats()["engine"]["prefix_cache"]
    assert stats["hits"] >= 1 and 0 < stats["bytes"] <= stats["max_bytes"]


# -- the trainer's reference pass ---------------------------------------------------------------


def session_samples() -> list:
    """Three turns of one session: each prompt is the previous turn's prompt + response + more."""
    from ocrl.types import Sample

    tokens, samples = [1, 5, 6, 7, 8, 9, 10], []
    for turn in range(3):
        response = [11 + turn, 12, 13, 14]
        tokens = tokens + response
        samples.append(Sample(sample_id=str(turn), session_id="s", turn_index=turn, tokens=list(tokens), response_length=4,
                              loss_mask=[1] * 4, rollout_logprobs=[-1.0] * 4, reward=1.0, weights_version=0, score=1))
        tokens = tokens + [3, 4, 20 + turn]
    return samples


def trainers(**overrides):
    """Two trainers of the same model, with and without the reference's prefix cache."""
    from ocrl.config import Config
    from ocrl.train.trainer import Trainer

    model = tiny_engine().model
    config = dict(rollout_batch_size=3, lora_rank=4, lora_alpha=8, save_interval=0, lr=1e-2) | overrides
    cached = Trainer(Config(**config, prefix_cache="64MB"), model, engine=None, yield_to=None)
    plain = Trainer(Config(**config, prefix_cache="off"), model, engine=None, yield_to=None)
    assert cached.reference_prefix.enabled and not plain.reference_prefix.enabled
    return cached, plain


@pytest.mark.parametrize("full_finetune", [False, True])
def test_the_reference_reuses_a_sessions_earlier_turns_and_gives_the_same_logprobs(full_finetune):
    cached, plain = trainers(full_finetune=full_finetune)
    samples = session_samples()
    with_cache = cached.response_logprobs(samples, reference=True)
    without = plain.response_logprobs(samples, reference=True)
    for a, b in zip(with_cache, without):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # turns 2 and 3 computed only what turn 1 and 2 had not: the whole earlier sequence was kept
    assert cached.reference_prefix.cache.hit_tokens == len(samples[0].tokens) + len(samples[1].tokens)


def test_a_step_with_long_samples_alone_takes_its_reference_from_the_cache_and_the_same_update():
    """Samples over the micro-batch budget go alone; their inline reference pass goes through
    the cache, and the step (KL term included) is the one without it."""
    cached, plain = trainers(micro_batch_tokens=8, kl_coef=0.5)
    samples = session_samples()
    for trainer in (cached, plain):
        trainer.probe = samples[0]
    for _ in range(2):  # the second step's policy has moved off the reference: a KL to get right
        metrics_cached, _, _ = cached._train(samples)
        metrics_plain, _, _ = plain._train(samples)
    assert cached.reference_prefix.cache.hit_tokens > 0
    assert metrics_cached["kl"] > 1e-4
    assert metrics_cached["kl"] == pytest.approx(metrics_plain["kl"], rel=1e-4)
    for (name, a), (_, b) in zip(cached.model.named_parameters(), plain.model.named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)


def test_the_agent_bench_sends_openclaw_shaped_prompts(embedded):
    """bench serve's agent row: a ~3k-token system prompt with tools, ~300 tokens more a turn."""
    import random

    from ocrl import chat
    from ocrl.bench.agent import agent_system, tool_output
    from ocrl.types import Message

    system, tools = agent_system(random.Random(0))
    messages = [Message(role="system", content=system), Message(role="user", content="Fix the failing test.")]
    first = len(chat.prompt_ids(embedded.tokenizer, messages, tools))
    messages += [Message(role="assistant", content="I will read the file first."), Message(role="user", content=tool_output(random.Random(1)))]
    second = len(chat.prompt_ids(embedded.tokenizer, messages, tools))
    assert 2700 <= first <= 3300 and 270 <= second - first <= 330


def test_bench_train_sizes_the_long_sample_backward_before_running_it():
    """bench train's guard asks the trainer's own budget (budget.py), checkpointing as it would."""
    from ocrl.bench.agent import backward_memory
    from ocrl.train.budget import backward_bytes

    cached, _ = trainers()
    need, available = backward_memory(cached, session_samples())
    checkpointed = cached.budget.plan(25).checkpoint
    assert need == backward_bytes(cached.model.config, 25, checkpointed=checkpointed, lora_rank=4, model_bytes=cached.budget.model_bytes)  # 25: the longest sample
    assert available == -1 or available > 0
