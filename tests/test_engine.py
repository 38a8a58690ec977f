"""The HF engine on a tiny random Llama: batching, exact log-probs, stops, faults, swaps."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ocrl.engine.base import EngineBusy, EngineError, Final
from ocrl.engine.hf import HFEngine
from ocrl.types import SamplingParams

torch.set_num_threads(1)


class LetterTokenizer:
    """id i -> letter chr(97 + i % 26); id 0 is the end of text."""

    eos_token_id = 0
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 26) for i in ids if not (skip_special_tokens and i == 0))


def tiny_engine(**kwargs) -> HFEngine:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=128, eos_token_id=0, pad_token_id=0, bos_token_id=1,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = 0
    return HFEngine(SimpleNamespace(model=model, tokenizer=LetterTokenizer(), name="tiny"), **kwargs)


@pytest.fixture
def engine():
    return tiny_engine()


def running(test):
    """Runs the test with the engine's scheduler beside it, in one task group."""

    async def wrapper(engine):
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            await test(engine)
            tg.cancel_scope.cancel()

    wrapper.__name__ = test.__name__
    return wrapper


PROMPTS = [[1, 5, 6], [1, 7, 8, 9, 10, 11, 12], [1, 3], [1, 20, 21, 22, 23]]


@running
async def test_batched_logprobs_equal_teacher_forced_forward(engine):
    results = [None] * len(PROMPTS)

    async def run(i):
        results[i] = await engine.generate(PROMPTS[i], SamplingParams(max_tokens=12, temperature=1.0, seed=i))

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(run, i)
    for prompt, completion in zip(PROMPTS, results):
        assert len(completion.logprobs) == len(completion.response_ids) > 0
        forced = await engine.score(prompt, completion.response_ids)
        torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(forced), atol=1e-4, rtol=0)


@running
async def test_greedy_in_a_batch_equals_greedy_alone(engine):
    alone = [await engine.generate(p, SamplingParams(max_tokens=10, temperature=0)) for p in PROMPTS]
    together = [None] * len(PROMPTS)

    async def run(i):
        together[i] = await engine.generate(PROMPTS[i], SamplingParams(max_tokens=10, temperature=0))

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(run, i)
    assert [c.response_ids for c in together] == [c.response_ids for c in alone]


@running
async def test_stop_string_is_cut_and_never_streamed(engine):
    free = await engine.generate(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0))
    text = free.text
    assert len(text) >= 6
    stop = text[3:5]
    chunks = [c async for c in engine.stream(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0, stop=(stop,)))]
    streamed = "".join(c.text for c in chunks)
    assert streamed == text[: text.index(stop)]
    assert isinstance(chunks[-1], Final) and chunks[-1].finish_reason == "stop"
    # the tokens that completed the stop string are kept: they are what was sampled
    assert sum(len(c.token_ids) for c in chunks) == text.index(stop) + len(stop)


@running
async def test_max_tokens_gives_length(engine):
    completion = await engine.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0))
    assert len(completion.response_ids) <= 3
    if len(completion.response_ids) == 3 and completion.response_ids[-1] != 0:
        assert completion.finish_reason == "length"


@running
async def test_request_arriving_mid_batch_completes(engine):
    done = {}

    async def long():
        done["long"] = await engine.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=1.0, seed=3))

    async def late():
        while not engine.active:
            await anyio.sleep(0.001)
        done["late"] = await engine.generate(PROMPTS[2], SamplingParams(max_tokens=5, temperature=1.0, seed=4))

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(long)
            tg.start_soon(late)
    assert done["late"].response_ids and done["long"].response_ids


@running
async def test_consumer_leaving_early_does_not_hurt_the_engine(engine):
    stream = engine.stream(PROMPTS[1], SamplingParams(max_tokens=50, temperature=1.0, seed=1))
    async for _ in stream:
        break
    await stream.aclose()
    with anyio.fail_after(30):
        completion = await engine.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0))
    assert completion.response_ids


@running
async def test_a_failing_forward_fails_its_requests_only(engine):
    real_forward = engine.model.forward
    engine.model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(EngineError, match="boom"):
        await engine.generate(PROMPTS[0], SamplingParams(max_tokens=5))
    engine.model.forward = real_forward
    completion = await engine.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0))
    assert completion.response_ids


@running
async def test_swap_waits_for_the_batch_and_every_completion_has_one_version(engine):
    new = {name: p.detach() + 0.05 for name, p in engine.model.named_parameters()}
    results = {}

    async def generate():
        results["before"] = await engine.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=1.0, seed=9))

    async def swap():
        while not engine.active:
            await anyio.sleep(0.001)
        results["seconds"] = await engine.update_weights(new, version=1)

    async with anyio.create_task_group() as tg:
        tg.start_soon(generate)
        tg.start_soon(swap)
    assert results["before"].weights_version == 0
    after = await engine.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0))
    assert after.weights_version == engine.weights_version == 1
    name, tensor = next(iter(new.items()))
    torch.testing.assert_close(dict(engine.model.named_parameters())[name].detach(), tensor)
    with pytest.raises(EngineError, match="unknown tensors"):
        await engine.update_weights({"no.such.weight": tensor}, version=2)
    assert engine.weights_version == 1


async def test_queue_bound_answers_busy():
    engine = tiny_engine(max_queued=2)  # scheduler not running: requests stay queued
    streams = [engine.stream(PROMPTS[0], SamplingParams(max_tokens=2)) for _ in range(3)]
    pending = []
    async with anyio.create_task_group() as tg:
        for s in streams[:2]:
            tg.start_soon(s.__anext__)
            pending.append(s)
        await anyio.sleep(0.05)
        with pytest.raises(EngineBusy):
            await streams[2].__anext__()
        tg.cancel_scope.cancel()


@running
async def test_a_waiting_swap_closes_the_running_batch_to_newcomers(engine):
    """Requests join a running batch, but not once a swap waits for the weights: the swap
    lands when the batch drains, and a later request is served by the new version."""
    new = {name: p.detach() + 0.05 for name, p in engine.model.named_parameters()}
    results = {}

    async def long():  # greedy on this prompt runs to the length limit
        results["long"] = await engine.generate([1, 20, 21], SamplingParams(max_tokens=60, temperature=0))

    async def swap_then_request():
        while not engine.generated_tokens:
            await anyio.sleep(0.001)
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.update_weights, new, 1)
            while not engine._model_lock.statistics().tasks_waiting:
                await anyio.sleep(0.001)
            results["late"] = await engine.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0))

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(long)
            tg.start_soon(swap_then_request)
    assert results["long"].weights_version == 0 and len(results["long"].response_ids) == 60
    assert results["late"].weights_version == 1
