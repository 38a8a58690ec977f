"""The trainer: turns batches of samples into optimizer steps and publishes each new policy.

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

from ocrl import memory
from ocrl.events import NoEvents
from ocrl.faults import crash_point
from ocrl.records import NoRecords
from ocrl.train import checkpoint
from ocrl.train.batch import MicroBatch, pack, probe_sample, sample_problem, split_prompt
from ocrl.train.give_way import GiveWay, YieldTo
from ocrl.train.loss import TopKTeacher, method_advantages, policy_loss
from ocrl.train.metrics import LossSums, StepMetrics, note_teacher
from ocrl.train.policy import Policy, Teacher
from ocrl.train.prefetch import Pending, Prefetcher
from ocrl.train.swap import swap
from ocrl.types import Sample, TrainStep

log = logging.getLogger("ocrl.train")

DISK_POLL = 1.0  # seconds between looks at the records while the disk is full


class Trainer(Policy):
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
        self.engine = engine
        self.give_way = GiveWay(yield_to, engine)
        self.give_way.attach(self.model, self.reference)
        self.records = records if records is not None else NoRecords()
        self.events = events if events is not None else NoEvents()
        self.verify_atol = verify_atol  # fp32 engines agree to ~1e-6; a bf16 engine needs more
        self.verify_rtol = verify_rtol  # and a 16-bit one's gap grows with |log-prob| (verify_relative)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.lr, betas=(0.9, 0.98), weight_decay=config.weight_decay
        )
        self.steps = 0
        self.version = 0  # the weights_version the engine last acknowledged from us
        self.consumed_samples = 0
        self.excluded_too_long = 0  # samples left out because their backward would not fit in memory
        self.last_metrics: dict[str, float] = {}
        self.probe: Sample | None = None  # the last step's first sample: proves each swap landed
        self.distilled_rows: list[dict] = []  # the last step's distilled samples and their teacher advantages
        self.save_dir = checkpoint.directory(config.save_dir, self.records.dir)
        self._saved_step = 0
        self._lock = anyio.Lock()  # a step, a prefetch and a checkpoint never interleave
        self.prefetcher = Prefetcher(self, self.give_way, self._lock)
        self._pending: list[Pending] = []
        self._paused = False
        self.waiting_for_disk = False  # steps wait while the records cannot be written
        self._wake = anyio.Event()  # for the step loop: a sample arrived, or resume

    # -- one step ---------------------------------------------------------------------------

    async def step(self, batch: list[Sample], references: list[torch.Tensor | None] | None = None) -> dict[str, float]:
        """One optimizer step on `batch`, then publish, verify, record. Returns the metrics row.
        `references`: each sample's reference log-probs where already known, else None."""
        references = references if references is not None else [None] * len(batch)
        if len(references) != len(batch):
            raise ValueError(f"{len(references)} references for {len(batch)} samples")
        return await self._step([Pending(s, r, prefetched=r is not None) for s, r in zip(batch, references)])

    def _within_memory(self, entries: list[Pending]) -> list[Pending]:
        """The entries whose backward fits the memory free now (budget.py); each one that does
        not, even checkpointed, is left out by rule: marked consumed as too long, counted in
        `excluded_too_long`, logged. Better one sample untrained than the daemon killed."""
        kept = []
        for entry in entries:
            plan = self.budget.plan(len(entry.sample.tokens))
            if plan.fits:
                kept.append(entry)
                continue
            self.excluded_too_long += 1
            self.records.consumed([entry.sample.sample_id], reason="too_long")
            note = (f"sample {entry.sample.sample_id} left out of training: {len(entry.sample.tokens)} tokens need ~{plan.need / 2**30:.1f} GiB "
                    f"for the backward{' checkpointed' if plan.checkpoint else ''}, {plan.available / 2**30:.1f} GiB free")  # fmt: skip
            log.warning(note)
            self.events.log("warning", note)
        return kept

    async def _step(self, entries: list[Pending]) -> dict[str, float] | None:
        """One step on `entries`. With --batch-counts all (rl) mask-0 samples may be among them:
        they count toward the batch and its divisor, but no forward runs on them; a batch of only
        those is consumed without an optimizer step (None is returned)."""
        drawn = [entry.sample for entry in entries]
        counts_untrained = self.config.counts_untrained
        for sample in drawn:
            if problem := sample_problem(sample, untrained_ok=counts_untrained):
                raise ValueError(f"sample {sample.sample_id}: {problem}")
        if not drawn:
            raise ValueError("empty batch")
        effective = [entry for entry in entries if entry.sample.effective]
        entries = self._within_memory(effective)
        if left_out := {id(e.sample) for e in effective} - {id(e.sample) for e in entries}:  # accounted for already
            drawn = [s for s in drawn if id(s) not in left_out]
        batch = [entry.sample for entry in entries]
        if not batch:
            if not drawn:
                return None
            self.records.consumed([s.sample_id for s in drawn])
            self.consumed_samples += len(drawn)
            log.info("a batch of %d mask-0 samples: consumed without a step", len(drawn))
            return None
        async with self._lock:
            # read under the lock: a prefetch in flight when the batch was taken has landed
            references = [entry.reference for entry in entries]
            teachers = [entry.teacher for entry in entries]
            for sample, reference in zip(batch, references):
                if reference is not None and reference.shape != (sample.response_length,):
                    raise ValueError(f"sample {sample.sample_id}: reference shape {tuple(reference.shape)}")
            # 1-3. micro-batched gradients, clip, AdamW; merged weights and our probe log-probs
            self.probe = probe_sample(*split_prompt(batch[0]))
            trained, tensors, probe_logprobs = await anyio.to_thread.run_sync(self._train, batch, references, teachers, len(drawn))
            crash_point("train_step")
            self.steps += 1
            self.consumed_samples += len(drawn)
            # 4-5. swap into the engine as the next version, and check it serves what we trained
            swap_seconds, verified, probe_diff = await self._publish(tensors, self.version + 1, probe_logprobs)
            # 6. record
            metrics = StepMetrics(
                **trained,
                reward_mean=sum(s.reward for s in drawn) / len(drawn),
                masked_fraction=sum(sum(s.loss_mask) for s in drawn) / sum(s.response_length for s in drawn),
                tokens=float(sum(len(s.tokens) for s in batch)),
                samples=float(len(drawn)),
                trained_samples=float(len(batch)),
                prefetched=sum(e.prefetched or not self.prefetcher.needs(e.sample) for e in entries) / len(batch),
                swap_seconds=swap_seconds,
                verified=float(verified),
                probe_diff=probe_diff,
            ).as_dict()
            self.last_metrics = metrics
            row = {"step": self.steps, "weights_version": self.version, **metrics}
            # consumed first: a reader that sees the metrics row sees the whole batch marked used
            self.records.consumed([s.sample_id for s in drawn], step=self.steps)
            self.records.metric(row)
            if self.distilled_rows:
                self.records.distill([{"step": self.steps, **r} for r in self.distilled_rows])
            self.events.publish(TrainStep(
                step=self.steps, weights_version=self.version, metrics=metrics,
                teacher_advantages={r["sample_id"]: r["teacher_advantage"] for r in self.distilled_rows},
            ))
            return row

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

    async def _publish(
        self, tensors: dict[str, torch.Tensor], version: int, probe_logprobs: torch.Tensor | None
    ) -> tuple[float, bool, float]:
        """Swap `tensors` into the engine as `version` and verify the probe (see swap.py)."""
        swapped = await swap(
            self.engine, self.events, tensors, version, serving_version=self.version,
            probe=self.probe, probe_logprobs=probe_logprobs, atol=self.verify_atol, rtol=self.verify_rtol,
        )  # fmt: skip
        if swapped.landed:
            self.version = version
        return swapped.seconds, swapped.verified, swapped.probe_diff

    async def publish(self) -> bool:
        """Push the current weights to the engine under the current version (after a resume)."""
        async with self._lock:
            tensors = await anyio.to_thread.run_sync(self.published_weights)
            probe_logprobs = None
            if self.probe is not None:
                probe_logprobs = (await anyio.to_thread.run_sync(self.response_logprobs, [self.probe]))[0]
            _, verified, _ = await self._publish(tensors, self.version, probe_logprobs)
            return verified

    # -- the loop ---------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def pending(self) -> int:
        return len(self._pending)

    def pause(self) -> None:
        """Stop taking steps; samples keep accumulating."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._wake.set()
        self.prefetcher.arrived()

    def _needs_prefetch(self, sample: Sample) -> bool:  # the prefetcher's, reached from the trainer
        return self.prefetcher.needs(sample)

    def _prefetch(self, entry: Pending) -> None:  # one sample's prefetch, now (a worker thread)
        self.prefetcher.prefetch(entry)

    async def run(self, samples) -> None:
        """Step on every `rollout_batch_size` samples from the stream until it closes or we are
        cancelled; checkpoint every `save_interval` steps and on the way out."""
        if self.steps and self.engine.weights_version != self.version:
            await self.publish()  # a resumed trainer serves what it restored
        closed = False

        async def read() -> None:
            nonlocal closed
            async with samples:
                async for sample in samples:
                    if problem := sample_problem(sample, untrained_ok=self.config.counts_untrained):
                        log.warning("dropping sample %s: %s", sample.sample_id, problem)
                        continue
                    self._pending.append(Pending(sample))
                    self._wake.set()
                    self.prefetcher.arrived()
            closed = True
            self._wake.set()

        size = max(1, self.config.rollout_batch_size)
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(read)
                tasks.start_soon(self.prefetcher.run, self._pending, lambda: self.paused)
                while True:
                    if self.records.full and len(self._pending) >= size and not self._paused:
                        # a step now could not mark its samples consumed (nor checkpoint): wait
                        # for the records to be writable again, then go on by ourselves
                        if closed:
                            tasks.cancel_scope.cancel()
                            break
                        self.waiting_for_disk = True
                        await anyio.sleep(DISK_POLL)
                        continue
                    self.waiting_for_disk = False
                    if self._paused or len(self._pending) < size:
                        if closed:
                            tasks.cancel_scope.cancel()  # the prefetch has nothing left to do
                            break
                        await self._wake.wait()
                        self._wake = anyio.Event()
                        continue
                    batch = self._pending[:size]
                    del self._pending[:size]
                    try:
                        with anyio.CancelScope(shield=True):  # a step is atomic: train, swap, record
                            stepped = await self._step(batch)
                    except Exception as e:  # the samples stay unconsumed in the journal
                        log.exception("training step failed")
                        self.events.log("error", f"training step failed: {type(e).__name__}: {e}")
                        continue
                    # the step's activations and gradients are freed: hand the pages back to the
                    # OS rather than leave them in glibc's arenas (see memory.py)
                    await anyio.to_thread.run_sync(memory.trim)
                    if stepped and self.config.save_interval > 0 and self.steps % self.config.save_interval == 0:
                        await self.save_checkpoint()
        finally:
            if self.steps > self._saved_step:
                with anyio.CancelScope(shield=True):
                    await self.save_checkpoint()

    # -- checkpoints ------------------------------------------------------------------------

    async def save_checkpoint(self) -> Path | None:
        """Write `<save_dir>/step-<n>` (see checkpoint.py); None when there is nowhere to write."""
        if self.save_dir is None:
            return None
        if self.records.full:  # a checkpoint past consumed marks still owed would retrain them twice
            log.warning("checkpoint of step %d skipped: the record dir cannot be written", self.steps)
            return None
        async with self._lock:
            final = self.save_dir / f"step-{self.steps}"
            if self._saved_step == self.steps and final.exists():
                return final
            state = checkpoint.CheckpointState(
                step=self.steps,
                weights_version=self.version,
                consumed_samples=self.consumed_samples,
                lora=self.lora,
                lora_rank=self.config.lora_rank if self.lora else 0,
                # the probe is a sample's token ids, i.e. its conversation: not kept with --no-record-text
                probe=split_prompt(self.probe) if self.probe is not None and not self.config.no_record_text else None,
            )
            if not await checkpoint.save(final, self.model, self.optimizer, state, lora=self.lora, events=self.events):
                return None
            self._saved_step = self.steps
            if self.config.retain_samples >= 0:  # the checkpoint covers these samples now
                forgotten = self.records.forget_token_ids(self.steps, keep=self.config.retain_samples)
                if forgotten:
                    log.info("forgot the token ids of %d consumed samples (--retain-samples %d)", forgotten, self.config.retain_samples)
            return final

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
