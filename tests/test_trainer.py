"""The trainer on a tiny random Llama: learning direction, micro-batching, LoRA hot-swap into a
real HFEngine, the reference policy, old log-probs, checkpoints and the run loop."""

from __future__ import annotations

import copy
import json
import math
import random
import threading
import time
from types import SimpleNamespace

import anyio
import msgspec
import pytest
import torch
from torch.testing import assert_close
from transformers import LlamaConfig, LlamaForCausalLM

from ocrl.config import Config
from ocrl.engine.hf import HFEngine
from ocrl.events import Events
from ocrl.records import Records
from ocrl.train.batch import pack, sample_problem
from ocrl.train.checkpoint import checkpoints
from ocrl.train.metrics import METRIC_KEYS
from ocrl.train.prefetch import Pending as _Pending
from ocrl.train.trainer import Trainer
from ocrl.types import Progress, Sample, TrainStep, WeightsSwapped

LORA_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def base() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()


def make_config(tmp_path=None, **overrides) -> Config:
    fields = dict(rollout_batch_size=4, lr=1e-2, lora_rank=4, lora_alpha=8, save_interval=0, seed=0)
    if tmp_path is not None:
        fields["save_dir"] = str(tmp_path / "checkpoints")
    return Config(**(fields | overrides))


def make_engine(model) -> HFEngine:
    tokenizer = SimpleNamespace(eos_token_id=0, pad_token_id=0, decode=lambda ids, **kw: "")
    return HFEngine(SimpleNamespace(model=copy.deepcopy(model), tokenizer=tokenizer, name="tiny"))


@torch.no_grad()
def teacher_forced(model, sample: Sample) -> torch.Tensor:
    """log pi(response | prompt) by one plain forward of the whole sequence, as (R,)."""
    ids = torch.tensor([sample.tokens])
    cut = len(sample.tokens) - sample.response_length
    logits = model(input_ids=ids).logits[0, cut - 1 : -1].float()  # (R, V)
    return torch.log_softmax(logits, -1).gather(-1, ids[0, cut:, None]).squeeze(-1)


def make_samples(model, n: int, reward: float = 1.0, seed: int = 0, lengths=(3, 9)) -> list[Sample]:
    """Random prompt + response ids (no pad id 0), rollout log-probs from `model`, one masked-out
    token in every other sample."""
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        prompt = [rng.randrange(1, 64) for _ in range(rng.randrange(*lengths))]
        response = [rng.randrange(1, 64) for _ in range(rng.randrange(*lengths))]
        mask = [1] * len(response)
        if i % 2:
            mask[0] = 0
        sample = Sample(
            sample_id=f"s{seed}-{i}",
            session_id=f"session-{i}",
            turn_index=0,
            tokens=prompt + response,
            response_length=len(response),
            loss_mask=mask,
            rollout_logprobs=[0.0] * len(response),
            reward=reward,
            weights_version=0,
            score=int(reward),
        )
        sample.rollout_logprobs = teacher_forced(model, sample).tolist()
        samples.append(sample)
    return samples


def mean_logprob(trainer: Trainer, samples: list[Sample]) -> float:
    return torch.cat(trainer.response_logprobs(samples)).mean().item()


# -- pure helpers -------------------------------------------------------------------------------


def test_pack_respects_the_token_budget(base):
    samples = make_samples(base, 8, lengths=(2, 12))
    groups = pack(samples, 30)
    assert sorted(s.sample_id for g in groups for s in g) == sorted(s.sample_id for s in samples)
    for group in groups:
        width = max(len(s.tokens) for s in group)
        assert len(group) == 1 or len(group) * width <= 30
    assert len(pack(samples, 10)) == 8  # every sample is over budget: each goes alone
    assert len(pack(samples, 10_000)) == 1


def test_sample_problem_flags_what_cannot_be_trained(base):
    good = make_samples(base, 1)[0]
    assert sample_problem(good) is None
    assert "masked-in" in sample_problem(msgspec.structs.replace(good, loss_mask=[0] * good.response_length))
    assert "lengths" in sample_problem(msgspec.structs.replace(good, rollout_logprobs=[0.0]))
    whole = msgspec.structs.replace(good, response_length=len(good.tokens), loss_mask=[1] * len(good.tokens))
    assert "prompt token" in sample_problem(whole)


# -- learning -----------------------------------------------------------------------------------


@pytest.mark.parametrize("reward", [1.0, -1.0])
async def test_rewards_move_logprobs_their_way_and_every_swap_verifies(base, reward):
    events = Events()
    engine = make_engine(base)
    trainer = Trainer(make_config(), base, engine=engine, events=events)
    samples = make_samples(base, 4, reward=reward)
    before = mean_logprob(trainer, samples)
    for step in range(1, 4):
        row = await trainer.step(samples)
        assert row["step"] == step and row["weights_version"] == step
    after = mean_logprob(trainer, samples)
    assert (after - before) * reward > 0.05, (before, after)
    assert trainer.version == engine.weights_version == 3
    swaps = [e for e in events.history if isinstance(e, WeightsSwapped)]
    assert [(e.weights_version, e.verified) for e in swaps] == [(1, True), (2, True), (3, True)]
    steps = [e for e in events.history if isinstance(e, TrainStep)]
    assert [e.step for e in steps] == [1, 2, 3]


@pytest.mark.parametrize("full_finetune", [False, True])
async def test_micro_batches_give_the_full_batch_gradient(base, full_finetune):
    samples = make_samples(base, 6, lengths=(3, 12))
    whole = Trainer(make_config(full_finetune=full_finetune, micro_batch_tokens=10_000), base, engine=make_engine(base))
    micro = Trainer(make_config(full_finetune=full_finetune, micro_batch_tokens=24), base, engine=make_engine(base))
    assert len(pack(samples, 24)) >= 3  # a real split, with some samples alone over budget
    whole_metrics = whole.accumulate_gradients(samples)
    micro_metrics = micro.accumulate_gradients(samples)
    for key in ("loss", "pg_loss", "kl", "entropy", "mismatch", "ratio_mean"):
        assert_close(micro_metrics[key], whole_metrics[key], rtol=1e-5, atol=1e-6)
    grads = 0
    for (name, a), (_, b) in zip(whole.model.named_parameters(), micro.model.named_parameters()):
        if a.requires_grad:
            assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-7, msg=name)
            grads += int(a.grad.abs().sum() > 0)
    assert grads > 0
    if not full_finetune:
        # Adam's first step is lr * g / (|g| + eps): a 1e-7 relative gradient difference moves
        # a near-zero component by up to ~1e-3 * lr, so the weights agree to 1e-5 while the
        # merged delta itself is ~1e-2.
        await whole.step(samples)
        await micro.step(samples)
        merged = micro.published_weights()
        for name, tensor in whole.published_weights().items():
            assert_close(merged[name], tensor, rtol=0, atol=1e-5, msg=name)
            assert (tensor - base.state_dict()[name]).abs().max() > 1e-3, name


# -- hot-swap -----------------------------------------------------------------------------------


async def test_lora_step_swaps_merged_weights_into_the_engine(base):
    engine = make_engine(base)
    trainer = Trainer(make_config(), base, engine=engine)
    samples = make_samples(base, 4)
    await trainer.step(samples)
    await trainer.step(samples)

    served = engine.model.state_dict()
    original = base.state_dict()
    published = trainer.published_weights()
    assert len(published) == 2 * len(LORA_NAMES)  # only the adapted linears travel
    modules = dict(trainer.model.named_modules())
    for name in original:
        changed = name.removesuffix(".weight").rsplit(".", 1)[-1] in LORA_NAMES
        if not changed:
            assert torch.equal(served[name], original[name]), name
            continue
        lora = modules["base_model.model." + name.removesuffix(".weight")]
        delta = lora.scaling["default"] * lora.lora_B["default"].weight @ lora.lora_A["default"].weight
        assert delta.abs().max() > 0, name
        assert_close(served[name], original[name] + delta, rtol=0, atol=1e-6, msg=name)

    for sample in samples + make_samples(base, 2, seed=7):
        ours = trainer.response_logprobs([sample])[0]
        theirs = torch.tensor(await engine.score(*_split(sample)))
        assert (ours - theirs).abs().max() < 1e-4


def _split(sample: Sample):
    cut = len(sample.tokens) - sample.response_length
    return sample.tokens[:cut], sample.tokens[cut:]


@pytest.mark.parametrize("full_finetune", [False, True])
async def test_reference_stays_the_base_while_the_policy_moves(base, full_finetune):
    trainer = Trainer(make_config(full_finetune=full_finetune), base, engine=make_engine(base))
    samples = make_samples(base, 4)
    for _ in range(2):
        await trainer.step(samples)
    for sample, reference, policy in zip(
        samples, trainer.response_logprobs(samples, reference=True), trainer.response_logprobs(samples)
    ):
        assert_close(reference, teacher_forced(base, sample), rtol=0, atol=1e-5)
        assert (policy - reference).abs().max() > 1e-3
    assert trainer.last_metrics["kl"] > 0


# -- old log-probs ------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "ratio"), [("rollout", math.exp(0.1)), ("recompute", 1.0)])
async def test_old_logprobs_come_from_the_configured_source(base, mode, ratio):
    # The rollout log-probs are the base's minus 0.1. Before any step the LoRA policy *is* the
    # base (B = 0), so rho = exp(logp - old) = exp(0.1) = 1.105 against the rollout ones (inside
    # the clip range [0.8, 1.28]: no clipping), and exactly 1 against recomputed ones. The
    # mismatch |recomputed - rollout| is 0.1 either way.
    samples = [
        msgspec.structs.replace(s, rollout_logprobs=[x - 0.1 for x in s.rollout_logprobs])
        for s in make_samples(base, 4)
    ]
    trainer = Trainer(make_config(old_logprobs=mode), base, engine=make_engine(base))
    row = await trainer.step(samples)
    assert row["ratio_mean"] == pytest.approx(ratio, abs=1e-4)
    assert row["ratio_max"] == pytest.approx(ratio, abs=1e-4)
    assert row["mismatch"] == pytest.approx(0.1, abs=1e-4)
    assert row["clip_frac"] == 0.0


# -- checkpoints --------------------------------------------------------------------------------


@pytest.mark.parametrize("full_finetune", [False, True])
async def test_checkpoint_restores_weights_optimizer_and_version(base, tmp_path, full_finetune):
    events = Events()
    config = make_config(tmp_path, full_finetune=full_finetune)
    trainer = Trainer(config, base, engine=make_engine(base), events=events)
    samples = make_samples(base, 4)
    for _ in range(2):
        await trainer.step(samples)
    path = await trainer.save_checkpoint()
    assert path == tmp_path / "checkpoints" / "step-2"
    progress = [e for e in events.history if isinstance(e, Progress)]
    assert progress[-1].done == progress[-1].total and len(progress) >= 2
    assert json.loads((path / "state.json").read_text())["consumed_samples"] == 8

    engine = make_engine(base)
    restored = Trainer(config, base, engine=engine, events=events)
    assert restored.load_latest() == path
    assert (restored.steps, restored.version, restored.consumed_samples) == (2, 2, 8)
    for (name, a), (_, b) in zip(trainer.model.named_parameters(), restored.model.named_parameters()):
        if a.requires_grad:
            assert torch.equal(a, b), name
    steps = {int(s["step"]) for s in restored.optimizer.state_dict()["state"].values()}
    assert steps == {2}

    # run() on the restored trainer republishes what it restored, under the restored version.
    send, receive = anyio.create_memory_object_stream[Sample](10)
    send.close()
    with events.subscribe() as subscription:
        await restored.run(receive)
        swap = await subscription.get()
    assert swap == WeightsSwapped(weights_version=2, seconds=swap.seconds, verified=True, at=swap.at)
    assert engine.weights_version == 2
    sample = samples[0]
    assert_close(torch.tensor(await engine.score(*_split(sample))), restored.response_logprobs([sample])[0], atol=1e-5, rtol=0)


async def test_only_the_newest_three_checkpoints_stay(base, tmp_path):
    trainer = Trainer(make_config(tmp_path, rollout_batch_size=1), base, engine=make_engine(base))
    samples = make_samples(base, 4)
    for sample in samples:
        await trainer.step([sample])
        await trainer.save_checkpoint()
    assert [p.name for p in checkpoints(tmp_path / "checkpoints")] == ["step-2", "step-3", "step-4"]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


# -- the loop -----------------------------------------------------------------------------------


async def _until(condition, seconds: float = 20.0) -> None:
    with anyio.fail_after(seconds):
        while not condition():
            await anyio.sleep(0.01)


async def test_run_batches_pauses_records_and_checkpoints_on_exit(base, tmp_path):
    records = Records(tmp_path / "run")
    events = Events()
    config = make_config(rollout_batch_size=2)  # save_dir defaults to <records>/checkpoints
    trainer = Trainer(config, base, engine=make_engine(base), records=records, events=events)
    samples = make_samples(base, 5)
    send, receive = anyio.create_memory_object_stream[Sample](100)
    seen, step = [], trainer._step

    async def observed(batch):  # (in the step, still queued) while each step runs
        seen.append((trainer.in_step, trainer.pending))
        return await step(batch)

    trainer._step = observed
    trainer.pause()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(trainer.run, receive)
        for sample in samples[:4]:
            await send.send(sample)
        await _until(lambda: trainer.pending == 4)
        await anyio.sleep(0.05)
        assert trainer.steps == 0  # paused: samples pile up, no step
        trainer.resume()
        await _until(lambda: trainer.steps == 2)
        await send.send(samples[4])  # half a batch: never stepped, stays in the journal
        send.close()
    records.close()

    assert trainer.steps == 2 and trainer.pending == 1
    assert seen == [(2, 2), (2, 0)] and trainer.in_step == 0  # a step's samples count as in it until it ends
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert set(METRIC_KEYS) <= set(row)
        assert all(isinstance(row[k], (int, float)) and math.isfinite(row[k]) for k in METRIC_KEYS)
        assert row["samples"] == 2 and row["reward_mean"] == 1.0 and 0 < row["masked_fraction"] <= 1
    consumed = [json.loads(line) for line in (tmp_path / "run" / "consumed.jsonl").read_text().splitlines()]
    assert sorted(consumed) == sorted([s.sample_id, 1 + i // 2] for i, s in enumerate(samples[:4]))  # [id, step]
    assert [p.name for p in checkpoints(tmp_path / "run" / "checkpoints")] == ["step-2"]


async def test_serving_continues_through_steps_and_swaps(base):
    # Completions requested while steps and swaps run all finish, each from one weights version.
    from ocrl.types import SamplingParams

    engine = make_engine(base)
    trainer = Trainer(make_config(), base, engine=engine)
    samples = make_samples(base, 4)
    completions = {}

    async def chat(seed: int) -> None:
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=seed)
        completions[seed] = await engine.generate([5, 6, 7, seed % 60 + 1], params)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(engine.run)
        async with anyio.create_task_group() as requests:
            for seed in range(6):
                requests.start_soon(chat, seed)
            for _ in range(2):
                await trainer.step(samples)
            for seed in range(6, 12):
                requests.start_soon(chat, seed)
        tasks.cancel_scope.cancel()
    assert sorted(completions) == list(range(12))
    assert {c.weights_version for c in completions.values()} <= {0, 1, 2}
    assert all(completions[seed].weights_version == 2 for seed in range(6, 12))  # asked after the swaps
    assert all(len(c.response_ids) == len(c.logprobs) >= 1 for c in completions.values())


async def test_a_non_finite_gradient_skips_the_update(base):
    # old_logprobs="rollout" with a nan rollout log-prob on a trained token: the loss and the
    # gradient are nan, and the step must leave the weights as they were.
    samples = make_samples(base, 2)
    samples[0] = msgspec.structs.replace(samples[0], rollout_logprobs=[math.nan] * samples[0].response_length)
    engine = make_engine(base)
    trainer = Trainer(make_config(old_logprobs="rollout"), base, engine=engine)
    before = {name: t.clone() for name, t in trainer.published_weights().items()}
    row = await trainer.step(samples)
    assert not math.isfinite(row["grad_norm"])
    for name, tensor in trainer.published_weights().items():
        assert torch.equal(tensor, before[name]), name
    assert row["verified"] == 1.0 and engine.weights_version == 1


# -- reference prefetch -------------------------------------------------------------------------


@pytest.mark.parametrize("full_finetune", [False, True])
async def test_prefetched_references_give_the_same_step(base, full_finetune):
    # The reference never changes, so log-probs computed one sample at a time while the batch
    # fills must give the step the loss and gradient it would compute itself. Every other sample
    # is prefetched, so micro-batches mix prefetched rows with rows computed in the step.
    samples = make_samples(base, 6, lengths=(3, 12))
    config = make_config(full_finetune=full_finetune, micro_batch_tokens=40)
    cold = Trainer(config, base, engine=make_engine(base))
    warm = Trainer(config, base, engine=make_engine(base))
    assert any(len(g) > 1 for g in pack(samples, 40))
    references = [r if i % 2 == 0 else None for i, r in enumerate(warm.response_logprobs(samples, reference=True))]
    cold_metrics = cold.accumulate_gradients(samples)
    warm_metrics = warm.accumulate_gradients(samples, references)
    for key in ("loss", "pg_loss", "kl", "entropy", "mismatch", "ratio_mean"):
        assert_close(warm_metrics[key], cold_metrics[key], rtol=1e-5, atol=1e-6)
    for (name, a), (_, b) in zip(cold.model.named_parameters(), warm.model.named_parameters()):
        if a.requires_grad:
            assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-7, msg=name)
    # after a step the policy has moved away from the reference, and a wrong reference would show
    await cold.step(samples)
    row = await warm.step(samples, [r if r is None else r + 0.0 for r in references])
    assert row["prefetched"] == 0.5
    assert_close(row["kl"], cold.last_metrics["kl"], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="reference shape"):
        await warm.step(samples, [torch.zeros(1)] * len(samples))


async def test_run_prefetches_references_while_the_batch_fills_and_serving_is_idle(base):
    busy = True
    trainer = Trainer(make_config(rollout_batch_size=4), base, engine=make_engine(base), yield_to=lambda: busy)
    samples = make_samples(base, 4)
    send, receive = anyio.create_memory_object_stream[Sample](100)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(trainer.run, receive)
        for sample in samples[:3]:
            await send.send(sample)
        await _until(lambda: trainer.pending == 3)
        await anyio.sleep(0.2)
        assert all(entry.reference is None for entry in trainer._pending)  # serving: no prefetch
        busy = False
        await _until(lambda: all(entry.reference is not None for entry in trainer._pending))
        for entry, expected in zip(trainer._pending, trainer.response_logprobs(samples[:3], reference=True)):
            assert torch.equal(entry.reference, expected)
        forwards = []
        hook = trainer.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
        await send.send(samples[3])
        await _until(lambda: trainer.steps == 1)
        send.close()
    hook.remove()
    assert trainer.last_metrics["prefetched"] >= 0.75  # the 4th may have been prefetched in time, or not
    # the policy forward and the probe, plus one reference forward only if the 4th was not prefetched
    assert len(forwards) == 2 + (trainer.last_metrics["prefetched"] < 1)


async def test_a_prefetch_gives_up_when_a_request_arrives(base):
    busy = False
    trainer = Trainer(make_config(), base, engine=make_engine(base), yield_to=lambda: busy)
    sample = make_samples(base, 1)[0]
    expected = trainer.response_logprobs([sample], reference=True)[0]

    def arrives(module, args):
        nonlocal busy
        busy = True

    layers = trainer.model.base_model.model.model.layers
    hook = layers[0].register_forward_pre_hook(arrives)
    entry = _Pending(sample)
    trainer._prefetch(entry)
    assert (entry.reference, entry.teacher, entry.prefetched) == (None, None, False)  # abandoned at layer 1
    hook.remove()
    busy = False
    trainer._prefetch(entry)
    assert torch.equal(entry.reference, expected) and entry.teacher is None and entry.prefetched  # an rl sample has no teacher
    assert (trainer.response_logprobs([sample])[0] - expected).abs().max() == 0  # LoRA B = 0: adapters back on
    assert not trainer.model._adapters_disabled


# -- serving first ------------------------------------------------------------------------------


async def test_a_step_waits_while_the_engine_serves_and_proceeds_when_idle(base):
    engine = make_engine(base)  # not running: `active` is ours to flip
    trainer = Trainer(make_config(), base, engine=engine)  # yield_to defaults to the engine's load
    samples = make_samples(base, 4)
    forwards = []
    trainer.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    rows = []

    async def step() -> None:
        rows.append(await trainer.step(samples))

    engine.active = 1
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(step)
        await anyio.sleep(0.5)
        assert not rows and not forwards  # no torch work while a request decodes
        engine.active = 0
        await _until(lambda: rows)
    assert rows[0]["yield_seconds"] >= 0.4 and rows[0]["verified"] == 1.0
    assert set(METRIC_KEYS) <= set(rows[0])


async def test_a_step_proceeds_after_train_yield_max_under_constant_load(base):
    trainer = Trainer(make_config(train_yield_max=0.3), base, engine=make_engine(base), yield_to=lambda: True)
    row = await trainer.step(make_samples(base, 4))
    assert 0.3 <= row["yield_seconds"] < 0.3 + 0.1  # waited its budget once, then never again
    assert row["step"] == 1 and row["verified"] == 1.0


class _Arrival:
    """A request that arrives when `__call__` first runs and is served 0.3 s later."""

    def __init__(self):
        self.busy = False
        self.at: float | None = None

    def __call__(self, *args) -> None:
        if self.at is None:
            self.at = time.perf_counter()
            self.busy = True
            threading.Timer(0.3, self.served).start()

    def served(self) -> None:
        self.busy = False


async def test_a_step_gives_way_between_layers_in_the_forward(base):
    # The request arrives as layer 0 of the policy forward starts: the step must stop before
    # layer 1 until it is served, not run on to the end of the micro-batch.
    request = _Arrival()
    trainer = Trainer(make_config(), base, engine=make_engine(base), yield_to=lambda: request.busy)
    samples = make_samples(base, 4)
    references = trainer.response_logprobs(samples, reference=True)  # the first forward is the policy's
    layers = trainer.model.base_model.model.model.layers
    layers[0].register_forward_pre_hook(request)
    layer_1_saw_busy = []
    layers[1].register_forward_pre_hook(lambda module, args: layer_1_saw_busy.append(request.busy))
    row = await trainer.step(samples, references)
    assert request.at is not None and layer_1_saw_busy == [False, False]  # the policy pass, the probe
    assert row["yield_seconds"] >= 0.25


async def test_a_step_gives_way_between_layers_in_the_backward(base):
    # The request arrives as the backward reaches the last layer: layer 0's gradient must wait.
    request = _Arrival()
    trainer = Trainer(make_config(), base, engine=make_engine(base), yield_to=lambda: request.busy)
    samples = make_samples(base, 4)
    layers = trainer.model.base_model.model.model.layers

    def arrives_in_backward(module, args, out) -> None:
        if out.requires_grad:
            out.register_hook(request)  # runs when the backward reaches layer 1's output

    layers[1].register_forward_hook(arrives_in_backward)
    layer_0_grad_at = []
    lora_a = layers[0].self_attn.q_proj.lora_A["default"].weight
    lora_a.register_post_accumulate_grad_hook(lambda p: layer_0_grad_at.append(time.perf_counter()))
    row = await trainer.step(samples)
    assert request.at is not None and layer_0_grad_at[0] - request.at >= 0.25
    assert row["yield_seconds"] >= 0.25


def test_trainer_follows_the_served_model_device_and_dtype(base):
    """The daemon trains where the served model sits, with a probe tolerance for its dtype."""
    from ocrl.train.policy import train_device, verify_tolerance

    assert train_device(base) == torch.device("cpu")
    assert verify_tolerance(base) == 1e-3
    assert verify_tolerance(copy.deepcopy(base).to(torch.bfloat16)) > 0.1  # 16-bit rounding is not a failed swap


def test_flash_attention_model_trains_with_sdpa_in_fp32(base):
    """A model served with flash-attention 2 (16-bit only) gets an fp32 trainer copy on SDPA;
    the served model keeps its attention."""
    served = copy.deepcopy(base)
    served.config._attn_implementation = "flash_attention_2"  # as models.load sets it on CUDA with flash-attn
    trainer = Trainer(make_config(), served, engine=make_engine(base), yield_to=None)
    assert trainer.model.config._attn_implementation == "sdpa"
    assert served.config._attn_implementation == "flash_attention_2"
    sample = make_samples(base, 1)[0]
    assert_close(trainer.response_logprobs([sample])[0], teacher_forced(base, sample), atol=1e-5, rtol=0)


# -- reference fidelity: step accounting, KL 0, the opd clip -----------------------------------


def _untrained(sample: Sample) -> Sample:
    return msgspec.structs.replace(sample, sample_id=sample.sample_id + "-m0", loss_mask=[0] * sample.response_length, reward=0.0, score=0)


@pytest.mark.parametrize("full_finetune", [False, True])
async def test_batch_counts_all_divides_by_every_sample_drawn(base, tmp_path, full_finetune):
    # The reference sums each sample's token mean and divides by the samples it drew (mask 0
    # included, contributing 0). With 2 trained samples of 4 drawn that is half ocrl's mean over
    # the trained ones: every gradient is exactly half, and nothing runs on the mask-0 samples.
    trained = make_samples(base, 2)
    drawn = [trained[0], _untrained(trained[0]), trained[1], _untrained(trained[1])]
    counted = Trainer(make_config(batch_counts="all", full_finetune=full_finetune), base, engine=make_engine(base))
    plain = Trainer(make_config(full_finetune=full_finetune), base, engine=make_engine(base))
    half = counted.accumulate_gradients(trained, count=4)
    whole = plain.accumulate_gradients(trained)
    assert_close(half["loss"], whole["loss"] / 2, rtol=1e-5, atol=1e-7)
    assert_close(half["pg_loss"], whole["pg_loss"] / 2, rtol=1e-5, atol=1e-7)
    for (name, a), (_, b) in zip(plain.model.named_parameters(), counted.model.named_parameters()):
        if a.requires_grad:
            assert_close(b.grad, a.grad / 2, rtol=1e-4, atol=1e-8, msg=name)

    records = Records(tmp_path / "run")
    counted = Trainer(make_config(batch_counts="all", full_finetune=full_finetune), base, engine=make_engine(base), records=records)
    forwards = []
    hook = counted.model.register_forward_pre_hook(lambda module, args, kwargs: forwards.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    row = await counted.step(drawn)
    hook.remove()
    assert (row["samples"], row["trained_samples"]) == (4.0, 2.0)
    assert counted.consumed_samples == 4
    assert sorted(c.id for c in records.consumed_rows() if c.step == 1) == sorted(s.sample_id for s in drawn)
    assert sum(forwards[:-1]) <= 4  # policy + reference rows of the 2 trained samples; the last is the probe
    # without --batch-counts all a mask-0 sample is no training sample at all
    with pytest.raises(ValueError, match="no masked-in token"):
        await plain.step(drawn)
    # a batch of mask-0 samples only: consumed, no optimizer step
    before = [p.detach().clone() for p in counted.params]
    assert await counted.step([_untrained(s) for s in trained]) is None
    assert counted.steps == 1 and counted.consumed_samples == 6
    assert all(torch.equal(a, b) for a, b in zip(before, counted.params))


@pytest.mark.parametrize("full_finetune", [False, True])
async def test_kl_coef_zero_skips_the_reference_forward(base, full_finetune):
    samples = make_samples(base, 4)
    trainer = Trainer(make_config(kl_coef=0.0, full_finetune=full_finetune), base, engine=make_engine(base))
    assert trainer.reference is None  # LoRA never has a copy; full fine-tuning keeps none it would never read
    # LoRA: the reference is the model with adapters off; count forwards made with them off
    calls = {"reference": 0, "policy": 0}
    original = trainer._reference_mode
    trainer._reference_mode = lambda: (calls.__setitem__("reference", calls["reference"] + 1), original())[1]
    row = await trainer.step(samples)
    assert calls["reference"] == 0
    assert row["kl"] == 0.0 and row["prefetched"] == 1.0  # nothing was left for the step to prefetch
    assert not trainer._needs_prefetch(samples[0])
    # the policy-gradient term is the one a trainer with the KL on computes on the same weights
    with_kl = Trainer(make_config(full_finetune=full_finetune), base, engine=make_engine(base))
    assert_close(with_kl.accumulate_gradients(samples)["pg_loss"], row["pg_loss"], rtol=1e-5, atol=1e-6)


def test_opd_clips_symmetrically_as_the_reference_unless_told():
    assert Config().clip_high == 0.28
    assert Config(method="combine").clip_high == 0.28
    assert Config(method="opd").clip_high == 0.2  # slime: eps_clip_high defaults to eps_clip
    assert Config(method="opd", eps_clip=0.1).clip_high == 0.1
    assert Config(method="opd", eps_clip_high=0.28).clip_high == 0.28


@pytest.mark.parametrize(("method", "batch_counts", "queued"), [("rl", "trained", False), ("rl", "all", True), ("opd", "all", False)])
def test_the_daemon_queues_mask_0_samples_only_when_they_count(base, tmp_path, method, batch_counts, queued):
    # --batch-counts all: a mask-0 sample goes to the trainer (it fills a step) instead of being
    # consumed as excluded at once; the reference's opd submits no such sample, so opd never counts it.
    from ocrl.daemon import Daemon

    daemon = Daemon(make_config(method=method, batch_counts=batch_counts))
    daemon.records, daemon.trainer, daemon.queued = Records(tmp_path / "run"), object(), 0
    daemon.samples_send, receive = anyio.create_memory_object_stream[Sample](10)
    sample = _untrained(make_samples(base, 1)[0])
    daemon.submit(sample)
    assert daemon.queued == int(queued)
    assert [c.id for c in daemon.records.consumed_rows()] == ([] if queued else [sample.sample_id])


@pytest.mark.parametrize("rtol, error, verified", [(0.0, 0.03, False), (2**-4, 0.03, True), (2**-4, 0.09, False)])
async def test_the_probe_tolerance_grows_with_each_log_probs_size(base, rtol, error, verified):
    """A 16-bit engine's gap to the fp32 trainer grows with |log-prob| (trainer.verify_relative):
    a served log-prob off by 3% of itself verifies under 8 bf16 units (6.25%) but not under the
    flat bound alone, and 9% fails both: the check still catches a swap that is really off."""
    from ocrl.train.policy import verify_relative

    assert verify_relative(base) == 0.0
    assert verify_relative(copy.deepcopy(base).to(torch.bfloat16)) == 8 * 2**-7
    engine = make_engine(base)
    true_score = engine.score

    async def off_score(prompt_ids, response_ids):  # every served log-prob off by `error` of itself
        return [lp * (1 + error) for lp in await true_score(prompt_ids, response_ids)]

    engine.score = off_score
    trainer = Trainer(make_config(), base, engine=engine, verify_atol=1e-3, verify_rtol=rtol)
    row = await trainer.step(make_samples(base, 2))
    assert row["verified"] == (1.0 if verified else 0.0)
    assert row["probe_diff"] > 1e-3  # the flat bound alone is exceeded in every case


# -- gradient checkpointing and the memory budget ----------------------------------------------


@pytest.mark.parametrize("full_finetune", [False, True])
async def test_gradient_checkpointing_gives_the_same_loss_gradients_and_step(base, full_finetune):
    """--gradient-checkpointing on recomputes every decoder layer in the backward (it really
    runs twice) and changes nothing else: the same loss, the same gradients (LoRA adapters, or
    every weight), the same weights after the step."""
    samples = make_samples(base, 6, lengths=(3, 12))
    on, off = (Trainer(make_config(full_finetune=full_finetune, gradient_checkpointing=mode, micro_batch_tokens=24), base, engine=make_engine(base))
               for mode in ("on", "off"))  # fmt: skip
    runs = {id(on): 0, id(off): 0}
    for trainer in (on, off):
        for layer in trainer._checkpointed_layers or [m for m in trainer.model.modules() if type(m).__name__ == "LlamaDecoderLayer"]:
            # runs with grad: the policy's forward, and its recompute (the reference runs without)
            layer.self_attn.register_forward_hook(lambda *_, t=trainer: runs.__setitem__(id(t), runs[id(t)] + torch.is_grad_enabled()))
    metrics_on, metrics_off = on.accumulate_gradients(samples), off.accumulate_gradients(samples)
    micro_batches = len(pack(samples, 24))
    assert runs[id(off)] == 2 * micro_batches and runs[id(on)] == 2 * 2 * micro_batches  # 2 layers; each again in the backward
    for key in ("loss", "pg_loss", "kl", "entropy", "mismatch", "ratio_mean"):
        assert_close(metrics_on[key], metrics_off[key], rtol=1e-5, atol=1e-7)
    grads = 0
    for (name, a), (_, b) in zip(off.model.named_parameters(), on.model.named_parameters()):
        if a.requires_grad:
            assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)
            grads += int(a.grad.abs().sum() > 0)
    assert grads > 0
    assert not any(layer.training for layer in on._checkpointed_layers)  # eval (no dropout) again after the forward
    await on.step(samples)
    await off.step(samples)
    for (name, a), (_, b) in zip(off.model.named_parameters(), on.model.named_parameters()):
        assert_close(b, a, rtol=0, atol=1e-6, msg=name)
    assert on.version == off.version == 1


def test_gradient_checkpointing_off_leaves_the_model_alone(base):
    trainer = Trainer(make_config(gradient_checkpointing="off"), base, engine=make_engine(base))
    assert trainer._checkpointed_layers == []
    assert not trainer.budget.plan(10**6).checkpoint  # never, however long


def test_auto_checkpoints_a_micro_batch_only_when_its_plain_backward_would_crowd_memory(base):
    from ocrl.train.budget import AUTO_SHARE, Budget

    budget = Budget("auto", base.config, torch.device("cpu"), lora_rank=4)
    per_position = budget.need(1000, checkpointed=False) / 1000
    assert budget.need(1000, checkpointed=True) < per_position * 1000  # 2 layers here; 30 (SmolLM2): ~10x less
    budget.available = lambda: int(per_position * 1000 / AUTO_SHARE) + 10**6
    short, long = budget.plan(1000), budget.plan(1200)
    assert not short.checkpoint and short.need == budget.need(1000, checkpointed=False)
    assert long.checkpoint and long.need == budget.need(1200, checkpointed=True) and long.fits
    budget.available = lambda: -1  # unknown: plain
    assert not budget.plan(10**6).checkpoint and budget.plan(10**6).fits


@pytest.mark.parametrize("mode", ["auto", "off"])
async def test_a_sample_too_long_for_the_memory_free_is_left_out_by_rule(base, tmp_path, mode):
    """A sample whose backward would not fit even checkpointed (auto), or plain (off), is not
    trained: the step trains the rest; the sample is marked consumed as too_long (not by the
    step), counted, logged; never an OOM kill, never silently gone."""
    records = Records(tmp_path / "run")
    events = Events()
    trainer = Trainer(make_config(gradient_checkpointing=mode), base, engine=make_engine(base), records=records, events=events)
    samples = make_samples(base, 4, lengths=(3, 9))
    long = make_samples(base, 1, seed=1, lengths=(40, 41))[0]
    # free memory: room for the short samples' backward, not for the long one's (checkpointed or not)
    trainer.budget.available = lambda: int(trainer.budget.need(30, checkpointed=False) / 0.8)
    assert not trainer.budget.plan(len(long.tokens)).fits and all(trainer.budget.plan(len(s.tokens)).fits for s in samples)
    row = await trainer.step(samples + [long])
    assert row["samples"] == 4 and trainer.steps == 1
    assert trainer.excluded_too_long == 1
    lines = [json.loads(line) for line in (tmp_path / "run" / "consumed.jsonl").read_text().splitlines()]
    assert [long.sample_id, None, "too_long"] in lines
    assert {s.sample_id for s in samples} == {line[0] for line in lines if line[1] == 1}  # the step consumed the rest
    assert long.sample_id in records.consumed_ids()  # excluded by rule: not queued again after a restart
    assert long.sample_id not in {s.sample_id for s in records.backlog()}
    # a batch of only such samples: no step, accounted all the same
    assert await trainer.step([long]) is None and trainer.steps == 1 and trainer.excluded_too_long == 2
    records.close()
