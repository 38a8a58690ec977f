"""The trainer: turns batches of samples into optimizer steps and publishes each new policy.
This module is the torch work of a step, in this process; the loop around it (batches from the
queue, the publish, the records, checkpoints on schedule) is loop.py's `StepLoop`, which the
trainer's Ray actor under --replicas fills in too (cluster/remote_trainer.py).

It sees samples (token ids, a loss mask and rollout log-probs per response token, a reward),
never sessions or HTTP. It reaches the engine only through `update_weights` (the new weights
under a new `weights_version`) and `score` (a teacher-forced probe that proves the swap landed).
The pieces it narrates live beside it: the models and their forwards in policy.py, the loss in
loss.py, micro-batches in batch.py, yielding to serving in give_way.py, the metrics row in
metrics.py, the swap and its probe in swap.py, checkpoints in checkpoint.py, and the reference
work done while a batch fills in prefetch.py.

One step (`step`), in order:
 1. pack the batch into micro-batches under a token budget (a long sample goes alone);
 2. per micro-batch: reference log-probs (no grad) of the samples that have none prefetched,
    then the policy forward; old log-probs; the policy loss; backward, weighted so the
    accumulated gradient is the full-batch one;
 3. clip the gradient norm, one AdamW step;
 4. merge the weights and publish them to the engine as version + 1;
 5. score a probe (the batch's first sample) on the engine and compare with our own log-probs;
 6. record the metrics row and the consumed sample ids; publish TrainStep.

Serving comes first: the torch work of a step waits at yield points while the engine is busy,
up to `train_yield_max` seconds per step (see give_way.py).

While `run` waits for a batch to fill (most of the time, online), it prefetches the reference
log-probs of each pending sample while serving is idle (see prefetch.py). The probe cannot be
prefetched or reused from the step: it must be scored with the weights after the optimizer step.

"Recompute" old log-probs are taken from the policy forward of step 2, detached: each batch
gets exactly one optimizer step and the weights do not move between micro-batches, so that
forward *is* the current policy before the update, and a separate no-grad pass would give the
same numbers at the cost of one more forward (ratio = 1 exactly, as in on-policy PPO).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import anyio
import torch

from ocrl.train import checkpoint
from ocrl.train.batch import MicroBatch, pack, probe_sample
from ocrl.train.budget import Plan
from ocrl.train.give_way import GiveWay, YieldTo
from ocrl.train.loop import StepLoop
from ocrl.train.loss import TopKTeacher, method_advantages, policy_loss
from ocrl.train.metrics import LossSums, note_teacher
from ocrl.train.policy import Policy, Teacher, trains_lora
from ocrl.train.prefetch import Pending, Prefetcher
from ocrl.types import Sample

log = logging.getLogger("ocrl.train")


class Trainer(StepLoop, Policy):
    """The policy (policy.py) with its optimizer, its queue of pending samples and the engine it
    publishes to. `yield_to`: when to give way to serving, by default while the engine decodes
    or queues (see give_way.py)."""

    def __init__(
        self,
        config,
        model,
        *,
        engine,
        records=None,
        events=None,
        device: str | torch.device = "cpu",
        verify_atol: float = 1e-3,
        verify_rtol: float = 0.0,
        yield_to: YieldTo = "engine",
    ):
        super().__init__(config, model, device=device, publish_adapters=getattr(engine, "accepts_adapters", False))
        self._init_loop(config, engine=engine, records=records, events=events, verify_atol=verify_atol, verify_rtol=verify_rtol,
                        lora=trains_lora(config))  # fmt: skip
        self.give_way = GiveWay(yield_to, engine)
        self.give_way.attach(self.model, self.reference)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.lr, betas=(0.9, 0.98), weight_decay=config.weight_decay
        )
        self.prefetcher = Prefetcher(self, self.give_way, self._lock)

    # -- the loop's seams (loop.py): the torch work, here in this process -------------------

    async def _plans(self, samples: list[Sample]) -> list[Plan]:
        return [self.budget.plan(len(sample.tokens)) for sample in samples]

    async def _compute(self, batch, references, teachers, count: int):
        return await anyio.to_thread.run_sync(self._train, batch, references, teachers, count)

    async def _current(self) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        tensors = await anyio.to_thread.run_sync(self.published_weights)
        probe_logprobs = None
        if self.probe is not None:
            probe_logprobs = (await anyio.to_thread.run_sync(self.response_logprobs, [self.probe]))[0]
        return tensors, probe_logprobs

    async def _write_checkpoint(self, final: Path, state: checkpoint.CheckpointState) -> bool:
        return await checkpoint.save(final, self.model, self.optimizer, state, lora=self.lora, events=self.events)

    # -- one step's torch work ---------------------------------------------------------------

    def _train(
        self, batch: list[Sample], references: list[torch.Tensor | None] | None = None, teachers: list[Teacher | None] | None = None,
        count: int | None = None,
    ) -> tuple[dict[str, float], dict[str, torch.Tensor], torch.Tensor]:
        """The torch part of a step (a worker thread): gradients, clip, AdamW, merge, probe.
        Gives way to serving at its yield points; step_seconds excludes that wait."""
        started = time.perf_counter()
        with self.give_way.within(self.config.train_yield_max) as waited:
            metrics = self.accumulate_gradients(batch, references, teachers, count=count)
            max_norm = self.config.grad_clip if self.config.grad_clip > 0 else math.inf
            metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
            if math.isfinite(metrics["grad_norm"]):
                self.optimizer.step()
            else:  # one poisoned batch must not wreck the weights being served
                log.warning("skipping the update: gradient norm is %s", metrics["grad_norm"])
            self.optimizer.zero_grad(set_to_none=True)
            tensors = self.published_weights()
            self.give_way.point()
            probe_logprobs = self.response_logprobs([self.probe])[0]
        metrics["yield_seconds"] = waited.spent
        metrics["step_seconds"] = time.perf_counter() - started - waited.spent
        return metrics, tensors, probe_logprobs

    def accumulate_gradients(
        self, batch: list[Sample], references: list[torch.Tensor | None] | None = None, teachers: list[Teacher | None] | None = None,
        *, count: int | None = None,
    ) -> dict[str, float]:
        """Backward the full-batch policy loss over micro-batches; returns its diagnostics.

        `references` holds each sample's prefetched (R,) reference log-probs, or None where the
        step must compute them; `teachers` the same for distilled samples (--method opd|combine).
        policy_loss takes a token mean per sample, then a mean over samples; weighting each
        micro-batch's loss by its share of the batch's samples makes the accumulated gradient
        equal to the one-big-batch gradient (the top-K term, a mean over a micro-batch's
        distilled samples, comes weighted by their share of it).

        `count` (default len(batch)) is what the summed per-sample means are divided by: with
        --batch-counts all, the whole batch the step drew, mask-0 samples included, as the
        reference divides by its global batch size. With --kl-coef 0 no reference log-probs are
        computed at all (the KL term would be multiplied by 0).
        """
        config = self.config
        distill = config.method != "rl"
        topk = distill and config.distill_topk > 0
        self.optimizer.zero_grad(set_to_none=True)
        sums = LossSums(samples=count or len(batch))
        prefetched = {id(s): r for s, r in zip(batch, references or []) if r is not None}
        taught = {id(s): t for s, t in zip(batch, teachers or []) if t is not None}
        self.distilled_rows = []
        for group in pack(batch, config.micro_batch_tokens):
            self.give_way.point()
            micro = MicroBatch.of(group, self.device)
            mask = micro.loss_mask.bool()  # (B, R)
            ref_logprobs = self.reference_rows(group, micro, prefetched) if config.kl_coef != 0 else None  # (B, R)
            teacher = self.teacher_rows(group, micro, taught) if distill else None
            self.give_way.point()
            checkpoint = self.budget.plan(micro.input_ids.numel()).checkpoint  # --gradient-checkpointing
            policy = self.forward(self.model, micro, entropy=True, every=topk, checkpoint=checkpoint)  # (B, R); (B, R, V) with top-K
            old = policy.logprobs.detach() if config.old_logprobs == "recompute" else micro.rollout_logprobs
            loss, diagnostics = policy_loss(
                policy.logprobs,
                old,
                self._advantages(micro, old, *((teacher.logprobs, teacher.distilled) if teacher else (None, None))),
                micro.loss_mask,
                ref_logprobs,
                eps_clip=config.eps_clip,
                eps_clip_high=config.clip_high,
                kl_coef=config.kl_coef,
                entropy=policy.entropy,
                entropy_coef=config.entropy_coef,
                topk=TopKTeacher(
                    policy.every, teacher.top_ids, teacher.top_logprobs, teacher.distilled,
                    coef=config.w_opd if config.method == "combine" else 1.0,
                ) if topk else None,
            )  # fmt: skip
            (loss * (len(group) / sums.samples)).backward()
            mismatch = torch.where(mask, policy.logprobs.detach() - micro.rollout_logprobs, 0.0).abs().sum().item()
            sums.add(diagnostics, samples=len(group), tokens=int(mask.sum()), mismatch=mismatch)
            if teacher is not None:
                self.distilled_rows += note_teacher(sums, group, mask, old, teacher, diagnostics)
        return sums.means(distill=distill, topk=topk)

    def _advantages(self, micro: MicroBatch, old: torch.Tensor, teacher: torch.Tensor | None, distilled: torch.Tensor | None) -> torch.Tensor:
        """A_t by --method (see loss.method_advantages)."""
        config = self.config
        return method_advantages(
            config.method, micro.rewards, micro.loss_mask, old, teacher, distilled,
            w_rl=config.w_rl, w_opd=config.w_opd, topk=config.distill_topk > 0,
        )  # fmt: skip

    # -- prefetch, reached from the trainer ------------------------------------------------

    def _needs_prefetch(self, sample: Sample) -> bool:  # the prefetcher's, reached from the trainer
        return self.prefetcher.needs(sample)

    def _prefetch(self, entry: Pending) -> None:  # one sample's prefetch, now (a worker thread)
        self.prefetcher.prefetch(entry)

    # -- checkpoints ------------------------------------------------------------------------

    def load_latest(self, save_dir: str | Path | None = None) -> Path | None:
        """Restore weights, optimizer, step, version and consumed count from the newest complete
        checkpoint; None when there is none. Call before `run`, which then republishes."""
        directory = Path(save_dir) if save_dir else self.save_dir
        found = checkpoint.checkpoints(directory) if directory is not None else []
        if not found:
            return None
        path = found[-1]
        state = checkpoint.load(path, self.model, self.optimizer, lora=self.lora, device=self.device)
        self.steps = self._saved_step = state.step
        self.version = state.weights_version
        self.consumed_samples = state.consumed_samples
        self.probe = probe_sample(*state.probe) if state.probe else None
        log.info("resumed from %s (step %d, weights version %d)", path, self.steps, self.version)
        return path
