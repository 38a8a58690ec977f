"""The GPU path, for each engine present (transformers always, SGLang when it imports): generation
with log-probs, a swap that changes outputs, swap verification, a short train-and-swap loop
while serving. Marked `gpu`; skipped without CUDA.

The model is a named architecture with random weights (`OCRL_GPU_TEST_MODEL`, default
qwen3-0.6b): nothing to download. `OCRL_GPU_TESTS_ON_CPU=1` runs the same tests on CPU with the
tiny architecture (the transformers engine only), to check the tests themselves on a machine
without a GPU.
"""

from __future__ import annotations

import contextlib
import os

import anyio
import msgspec
import pytest
import torch

from ocrl.config import Config
from ocrl.types import Message, SamplingParams

ON_CPU = os.environ.get("OCRL_GPU_TESTS_ON_CPU") == "1"
CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (CUDA or ON_CPU), reason="needs a CUDA GPU (OCRL_GPU_TESTS_ON_CPU=1 checks the tests on CPU)"),
]
if not CUDA:
    torch.set_num_threads(1)
DEVICE = "cuda" if CUDA else "cpu"
ARCH = os.environ.get("OCRL_GPU_TEST_MODEL", "qwen3-0.6b" if CUDA else "tiny")


def engines() -> list[str]:
    from ocrl.engine.select import sglang_problem

    # sglang-lora: SGLang with --weight-sync lora (the trainer's adapter is swapped, not weights)
    return ["hf"] + (["sglang", "sglang-lora"] if CUDA and sglang_problem() is None else [])


@pytest.fixture(scope="module")
def loaded():
    from ocrl import models

    return models.load(random_init=ARCH, device=DEVICE)


def config_for(which: str, **overrides) -> Config:
    kind, _, sync = which.partition("-")
    base = Config(random_init=ARCH, device=DEVICE, engine=kind, weight_sync=sync or "full", rollout_batch_size=4, seed=0, lr=1e-4,
                  engine_mem_fraction=0.4)  # fmt: skip
    return msgspec.structs.replace(base, **overrides)


@contextlib.asynccontextmanager
async def serving(which: str, loaded, **overrides):
    """The engine as the daemon builds it, its loop running beside the test; stopped after."""
    from ocrl.engine.select import build_engine

    engine = await build_engine(config_for(which, **overrides), loaded)
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        try:
            yield engine
        finally:
            tg.cancel_scope.cancel()


def prompt(loaded, text="Tell me about the sea.") -> list[int]:
    from ocrl import chat

    return chat.prompt_ids(loaded.tokenizer, [Message(role="user", content=text)])


def atol(loaded) -> float:
    """How far a served log-prob may sit from a teacher-forced one: fp32 agrees to ~1e-5; bf16
    rounds logits to ~3 significant digits."""
    return 1e-3 if next(loaded.model.parameters()).dtype == torch.float32 else 0.1


async def samples(engine, loaded, n: int):
    from ocrl.types import Sample

    out = []
    for i in range(n):
        ids = prompt(loaded, f"Question {i}: what is {i} + {i}?")
        c = await engine.generate(ids, SamplingParams(max_tokens=12, temperature=1.0, seed=i))
        assert c.response_ids, "a random model answered nothing"
        k = len(c.response_ids)
        out.append(Sample(sample_id=str(i), session_id="gpu", turn_index=i, tokens=ids + c.response_ids, response_length=k,
                          loss_mask=[1] * k, rollout_logprobs=c.logprobs, reward=1.0 if i % 2 else -1.0, weights_version=0, score=1))  # fmt: skip
    return out


def trainer_for(engine, loaded, config):
    from ocrl.train.policy import verify_relative, verify_tolerance
    from ocrl.train.trainer import Trainer

    # the daemon's probe bounds: the fp32 trainer vs a bf16 engine differ by a few bf16 units of
    # each log-prob's own size (0.13-0.28 at |lp| ~12 on an H200), so the bound is relative
    model = loaded.model
    return Trainer(config, model, engine=engine, device=DEVICE, verify_atol=verify_tolerance(model), verify_rtol=verify_relative(model), yield_to=None)


@pytest.mark.parametrize("which", engines())
async def test_generation_returns_logprobs_equal_to_teacher_forcing(which, loaded):
    async with serving(which, loaded) as engine:
        ids = prompt(loaded)
        completion = await engine.generate(ids, SamplingParams(max_tokens=16, temperature=1.0, seed=1, top_logprobs=2))
        assert 0 < len(completion.response_ids) == len(completion.logprobs) == len(completion.top_logprobs)
        assert all(lp <= 0 for lp in completion.logprobs) and completion.finish_reason in ("stop", "length")
        forced = await engine.score(ids, completion.response_ids)
        torch.testing.assert_close(torch.tensor(forced), torch.tensor(completion.logprobs), atol=atol(loaded), rtol=0)


@pytest.mark.parametrize("which", engines())
async def test_a_swap_changes_what_is_served(which, loaded):
    async with serving(which, loaded) as engine:
        ids = prompt(loaded)
        before = await engine.generate(ids, SamplingParams(max_tokens=8, temperature=0))
        torch.manual_seed(1)
        targets = {name: p.detach().clone() for name, p in loaded.model.named_parameters() if name.endswith("mlp.down_proj.weight")}
        changed = {name: p + 0.5 * torch.randn_like(p) for name, p in targets.items()}
        seconds = await engine.update_weights(changed, version=1)
        after = await engine.generate(ids, SamplingParams(max_tokens=8, temperature=0))
        assert seconds > 0 and after.weights_version == engine.weights_version == 1
        served_before = await engine.score(ids, before.response_ids)
        diff = (torch.tensor(served_before) - torch.tensor(before.logprobs)).abs().max().item()
        assert after.response_ids != before.response_ids or diff > 10 * atol(loaded)
        await engine.update_weights(targets, version=2)  # and back (the HF engine serves the shared model)
        again = await engine.generate(ids, SamplingParams(max_tokens=8, temperature=0))
        assert again.response_ids == before.response_ids and again.weights_version == 2


@pytest.mark.parametrize("which", engines())
async def test_each_trainer_swap_is_verified_and_moves_the_served_policy(which, loaded):
    async with serving(which, loaded) as engine:
        batch = await samples(engine, loaded, 4)
        trainer = await anyio.to_thread.run_sync(lambda: trainer_for(engine, loaded, config_for(which, lr=0.1)))
        probe_prompt, probe_response = batch[0].tokens[: -batch[0].response_length], batch[0].tokens[-batch[0].response_length :]
        before = torch.tensor(await engine.score(probe_prompt, probe_response))
        row = await trainer.step(batch)
        after = torch.tensor(await engine.score(probe_prompt, probe_response))
        assert row["verified"] == 1.0  # within the per-token bound (trainer.verify_relative)
        assert engine.weights_version == trainer.version == 1
        # the swap moved the served log-probs by more than the verification tolerance
        assert (after - before).abs().max().item() > atol(loaded)


@pytest.mark.parametrize("which", engines())
async def test_train_and_swap_while_serving(which, loaded):
    async with serving(which, loaded) as engine:
        batch = await samples(engine, loaded, 4)
        trainer = await anyio.to_thread.run_sync(lambda: trainer_for(engine, loaded, config_for(which)))
        served, rows = [], []

        async def keep_serving():
            for i in range(6):
                served.append(await engine.generate(prompt(loaded), SamplingParams(max_tokens=16, temperature=1.0, seed=i)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(keep_serving)
            for _ in range(3):
                rows.append(await trainer.step(batch))
        assert [r["weights_version"] for r in rows] == [1, 2, 3] and all(r["verified"] == 1.0 for r in rows)
        assert len(served) == 6 and all(c.response_ids for c in served)
        assert all(0 <= c.weights_version <= 3 for c in served)
        assert engine.weights_version == 3
