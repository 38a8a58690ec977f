"""The trainer as a Ray actor (`--replicas N`): the policy, its optimizer and its checkpoints in a
process of their own (its own GPU when the daemon's model is on CUDA, else one CPU), behind a
few remote methods the daemon's `RemoteTrainer` (cluster/remote_trainer.py) calls one at a time.

Contract:
 - The actor loads the model itself from the daemon's `Config` and builds the same `Trainer`
   (train/trainer.py) the single-process daemon trains with; it yields to nothing (serving runs
   elsewhere). It trains nothing until `restore(save_dir)` has run: a fresh actor starts from
   the model as loaded (save_dir None) or the newest complete checkpoint under save_dir
   (`Trainer.load_latest`), and one Ray restarted after a crash must be restored before it
   trains again; until then its other methods raise `NotRestored`.
 - `train(batch, count)` is one step's torch work (`Trainer._train`): the metrics, the weights
   to publish (merged, or the LoRA adapter with --weight-sync lora) on the CPU, the probe's
   log-probs under them, the distilled rows. It publishes nothing and records nothing: the
   daemon swaps the weights into the replicas, verifies the probe and marks the samples.
 - `save(final, state)` writes the checkpoint the daemon composed (checkpoint.py, atomically);
   `plans` is the memory budget of the trainer's device; `current(probe)` the weights to
   publish now; `status` answers at once, even during a step.
 - `--weight-sync broadcast`: the actor keeps the weights it returned last (`hold`) and is rank 0
   of the group that broadcasts them to the replicas (cluster/collective.py).

Knows the trainer and checkpoints; nothing of routing, records or HTTP.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from types import SimpleNamespace

from ocrl.cluster.collective import GroupMember


class NotRestored(RuntimeError):
    """The actor (just started, or restarted by Ray) has not restored its checkpoint yet."""


class TrainerActor(GroupMember):
    """Wrapped by `ray.remote` in remote_trainer.py (this module imports no Ray)."""

    def __init__(self, config):
        import torch

        from ocrl import models
        from ocrl.train.policy import train_device
        from ocrl.train.trainer import Trainer

        torch.set_num_threads(config.threads or 1)
        self.incarnation = uuid.uuid4().int % 2**31 + 1  # changes when Ray restarts the actor (never 0)
        loaded = models.load(
            config.model, device=config.device, dtype=config.dtype, random_init=config.random_init,
            context_length=config.context_length, rope_scaling=config.rope_scaling,
        )
        # publishes nothing itself: `accepts_adapters` only says what `published_weights` hands over
        publishes_to = SimpleNamespace(accepts_adapters=config.weight_sync == "lora")
        self.trainer = Trainer(config, loaded.model, engine=publishes_to, device=train_device(loaded.model), yield_to=None)
        self.restored_step: int | None = None  # the step this incarnation started from; None: not restored
        self.steps = 0  # steps trained by this incarnation
        self.broadcasts = config.weight_sync == "broadcast"  # keeps what it returned, to broadcast it

    def _check(self) -> None:
        if self.restored_step is None:
            raise NotRestored(f"trainer actor {self.incarnation} has not restored its checkpoint yet")

    async def restore(self, save_dir: str | None) -> dict:
        """Start from the newest complete checkpoint under `save_dir` (None: from the model as
        loaded); returns where it stands (step, weights version, consumed count, probe)."""
        trainer = self.trainer
        path = await asyncio.to_thread(trainer.load_latest, save_dir) if save_dir else None
        self.restored_step = trainer.steps
        from ocrl.train.batch import split_prompt

        return {
            "incarnation": self.incarnation,
            "path": str(path) if path else None,
            "step": trainer.steps,
            "weights_version": trainer.version,
            "consumed_samples": trainer.consumed_samples,
            "probe": split_prompt(trainer.probe) if trainer.probe is not None else None,
        }

    async def plans(self, lengths: list[int]) -> list:
        self._check()
        return [self.trainer.budget.plan(n) for n in lengths]

    async def train(self, batch: list, count: int) -> tuple:
        from ocrl import memory
        from ocrl.train.batch import probe_sample, split_prompt

        self._check()
        trainer = self.trainer
        trainer.probe = probe_sample(*split_prompt(batch[0]))
        metrics, tensors, probe_logprobs = await asyncio.to_thread(trainer._train, batch, None, None, count)
        self.steps += 1
        tensors = self._returned(tensors)
        await asyncio.to_thread(memory.trim)
        return metrics, tensors, probe_logprobs.detach().cpu(), trainer.distilled_rows

    async def current(self, probe) -> tuple:
        """The weights to publish now and `probe`'s log-probs under them (None: no probe)."""
        self._check()
        trainer = self.trainer
        trainer.probe = probe
        tensors, probe_logprobs = await trainer._current()
        return self._returned(tensors), None if probe_logprobs is None else probe_logprobs.cpu()

    def _returned(self, tensors: dict) -> dict:
        """CPU copies of the weights to publish (the trainer's are views it changes next step),
        kept for the broadcast too under --weight-sync broadcast."""
        tensors = {n: t.detach().to("cpu", copy=True) for n, t in tensors.items()}
        if self.broadcasts:
            self.hold(tensors)
        return tensors

    async def save(self, final: str, state) -> bool:
        self._check()
        return await self.trainer._write_checkpoint(Path(final), state)

    async def status(self) -> dict:
        from ocrl.cluster.replica import peak_rss_mb
        from ocrl.memory import rss_mb

        return {
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "restored": self.restored_step is not None,
            "restored_step": self.restored_step,
            "steps": self.steps,
            "device": str(self.trainer.device),
            "rss_mb": rss_mb(),
            "peak_rss_mb": peak_rss_mb(),
        }
