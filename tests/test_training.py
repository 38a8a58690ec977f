"""Training on the embedded model: LoRA steps move log-probs the way the reward says, the daemon
trains from real traffic while it keeps serving, and --resume continues at the saved step."""

from __future__ import annotations

import copy
import dataclasses

import anyio
import httpx
import msgspec
import torch

from conftest import Daemon
from ocrl import chat
from ocrl.config import Config
from ocrl.engine.hf import HFEngine
from ocrl.train.trainer import Trainer
from ocrl.types import Message, Sample, SamplingParams


def read_jsonl(path) -> list[dict]:
    return [msgspec.json.decode(line) for line in path.read_bytes().splitlines()] if path.exists() else []


async def test_lora_on_embedded_raises_rewarded_and_lowers_punished(embedded):
    # the engine swaps trained weights into its model: a copy, not the shared fixture's
    embedded = dataclasses.replace(embedded, model=copy.deepcopy(embedded.model))
    engine = HFEngine(embedded)
    config = Config(lr=1e-3, rollout_batch_size=4, lora_rank=8, lora_alpha=16)
    trainer = Trainer(config, embedded.model, engine=engine)
    prompts = ["Name a fruit.", "Name a colour.", "Name an animal.", "Name a city."]
    samples = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        for i, prompt in enumerate(prompts):
            ids = chat.prompt_ids(embedded.tokenizer, [Message(role="user", content=prompt)])
            c = await engine.generate(ids, SamplingParams(max_tokens=8, temperature=1.0, seed=i))
            samples.append(
                Sample(
                    sample_id=f"s{i}", session_id="t", turn_index=i, tokens=ids + c.response_ids,
                    response_length=len(c.response_ids), loss_mask=[1] * len(c.response_ids),
                    rollout_logprobs=c.logprobs, reward=1.0 if i < 2 else -1.0, weights_version=0, score=1 if i < 2 else -1,
                )
            )
        before = [sum(await engine.score(s.tokens[: -s.response_length], s.tokens[-s.response_length :])) for s in samples]
        for _ in range(2):
            metrics = await trainer.step(samples)
        after = [sum(await engine.score(s.tokens[: -s.response_length], s.tokens[-s.response_length :])) for s in samples]
        tg.cancel_scope.cancel()
    assert engine.weights_version == 2 and metrics["verified"] == 1.0
    assert after[0] > before[0] and after[1] > before[1], (before, after)  # reward +1
    assert after[2] < before[2] and after[3] < before[3], (before, after)  # reward -1
    # the served weights equal the trainer's: a fixed prompt scores the same on both
    probe = samples[0]
    served = torch.tensor(await engine.score(probe.tokens[: -probe.response_length], probe.tokens[-probe.response_length :]))
    [own] = trainer.response_logprobs([probe])
    torch.testing.assert_close(served, own.float(), atol=1e-3, rtol=0)


async def test_daemon_trains_from_traffic_keeps_serving_and_resumes(tmp_path, scripted_judge):
    run_dir = tmp_path / "run"
    flags = ["--threads", "1", "--rollout-batch-size", "2", "--lr", "1e-4", "--prm-mode", "generate", "--prm-url", scripted_judge.url]
    daemon = Daemon(run_dir, *flags).start()
    failures, served_versions = [], []
    try:
        async with daemon.client(timeout=300) as client:

            async def session(i):
                messages = [{"role": "user", "content": f"What is {i}+1?"}]
                try:
                    r = await client.chat.completions.create(model="m", messages=messages, max_tokens=6, extra_headers={"X-Session-Id": f"t{i}"})
                    messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "thanks [votes: 1,1,1]"}]
                    r2 = await client.chat.completions.create(
                        model="m", messages=messages, max_tokens=6, extra_headers={"X-Session-Id": f"t{i}", "X-Session-Done": "1"}
                    )
                    served_versions.extend([r.model_extra["ocrl"]["weights_version"], r2.model_extra["ocrl"]["weights_version"]])
                except Exception as e:  # noqa: BLE001 - every failure is reported below
                    failures.append(repr(e))

            async def chatter_while_training():
                # requests keep flowing while the steps run and swap
                while len(read_jsonl(run_dir / "metrics.jsonl")) < 2:
                    try:
                        r = await client.chat.completions.create(
                            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3, extra_headers={"X-Turn-Type": "side"}
                        )
                        served_versions.append(r.model_extra["ocrl"]["weights_version"])
                    except Exception as e:  # noqa: BLE001
                        failures.append(repr(e))
                    await anyio.sleep(0.2)

            with anyio.fail_after(600):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(chatter_while_training)
                    for i in range(4):  # 4 sessions -> 4 effective samples -> 2 steps of 2
                        tg.start_soon(session, i)
        metrics = read_jsonl(run_dir / "metrics.jsonl")
        assert failures == []
        assert [m["step"] for m in metrics] == [1, 2]
        assert [m["weights_version"] for m in metrics] == [1, 2]
        assert all(m["verified"] == 1.0 for m in metrics)
        health = httpx.get(daemon.url + "/healthz").json()
        assert health["weights_version"] == 2
        assert max(served_versions) <= 2
    finally:
        assert daemon.stop() == 0  # SIGTERM: finish, checkpoint, exit 0
    assert (run_dir / "checkpoints").is_dir()
    resumed = Daemon(run_dir, *flags, "--resume").start()
    try:
        with anyio.fail_after(120):
            while httpx.get(resumed.url + "/healthz").json()["weights_version"] != 2:
                await anyio.sleep(0.2)
        assert resumed.stats()["training"]["steps"] == 2
        async with resumed.client() as client:
            r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.model_extra["ocrl"]["weights_version"] == 2
    finally:
        assert resumed.stop() == 0
