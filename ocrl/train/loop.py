"""The trainer's loop and what a step records, apart from where its torch work runs.

`StepLoop` takes samples from the daemon's queue, steps on every `rollout_batch_size` of them,
publishes each new policy to the engine (swap.py: the probe proves it landed), records the step
(metrics row, consumed ids, distilled rows), checkpoints on schedule and on the way out, and
pauses and resumes on request. The torch work sits behind four seams a subclass fills:

 - `_plans(samples)`: how each sample's backward would run (budget.py), so a sample that cannot
   fit is left out by rule before a step;
 - `_compute(batch, references, teachers, count)`: one optimizer step; returns its metrics, the
   weights to publish and the probe's log-probs under them (sets `distilled_rows`);
 - `_current()`: the weights to publish now and the probe's log-probs (a resumed trainer);
 - `_write_checkpoint(final, state)`: write `<save_dir>/step-<n>` (checkpoint.py).

The in-process `Trainer` (trainer.py) fills them with its own model; `--replicas` fills them
with calls to the trainer's Ray actor (cluster/remote_trainer.py). Knows samples, the engine's
`update_weights`/`score` (through swap.py), records and events; never a model or an optimizer.
"""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import torch

from ocrl import memory
from ocrl.faults import crash_point
from ocrl.events import NoEvents
from ocrl.records import NoRecords
from ocrl.train import checkpoint
from ocrl.train.batch import probe_sample, sample_problem, split_prompt
from ocrl.train.budget import Plan
from ocrl.train.metrics import StepMetrics
from ocrl.train.prefetch import Pending
from ocrl.train.swap import swap
from ocrl.types import Sample, TrainStep

log = logging.getLogger("ocrl.train")

DISK_POLL = 1.0  # seconds between looks at the records while the disk is full


class StepLoop:
    """The loop's state is set by `_init_loop`; `prefetcher` (prefetch.py) is None where nothing
    is prefetched."""

    prefetcher = None

    def _init_loop(self, config, *, engine, records=None, events=None, verify_atol: float = 1e-3, verify_rtol: float = 0.0, lora: bool) -> None:
        self.config = config
        self.engine = engine
        self.records = records if records is not None else NoRecords()
        self.events = events if events is not None else NoEvents()
        self.verify_atol = verify_atol  # fp32 engines agree to ~1e-6; a bf16 engine needs more
        self.verify_rtol = verify_rtol  # and a 16-bit one's gap grows with |log-prob| (verify_relative)
        self.lora = lora
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
        self._pending: list[Pending] = []
        self._in_step = 0  # samples of the step under way: out of the queue, not yet consumed
        self._paused = False
        self.waiting_for_disk = False  # steps wait while the records cannot be written
        self._wake = anyio.Event()  # for the step loop: a sample arrived, or resume

    # -- the seams (see the module docstring) -----------------------------------------------

    async def _plans(self, samples: list[Sample]) -> list[Plan]:
        raise NotImplementedError

    async def _compute(self, batch, references, teachers, count: int) -> tuple[dict[str, float], dict[str, torch.Tensor], torch.Tensor]:
        raise NotImplementedError

    async def _current(self) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        raise NotImplementedError

    async def _write_checkpoint(self, final: Path, state: checkpoint.CheckpointState) -> bool:
        raise NotImplementedError

    # -- one step ---------------------------------------------------------------------------

    async def step(self, batch: list[Sample], references: list[torch.Tensor | None] | None = None) -> dict[str, float]:
        """One optimizer step on `batch`, then publish, verify, record. Returns the metrics row.
        `references`: each sample's reference log-probs where already known, else None."""
        references = references if references is not None else [None] * len(batch)
        if len(references) != len(batch):
            raise ValueError(f"{len(references)} references for {len(batch)} samples")
        return await self._step([Pending(s, r, prefetched=r is not None) for s, r in zip(batch, references)])

    async def _within_memory(self, entries: list[Pending]) -> list[Pending]:
        """The entries whose backward fits the memory free now (budget.py); each one that does
        not, even checkpointed, is left out by rule: marked consumed as too long, counted in
        `excluded_too_long`, logged. Better one sample untrained than the trainer killed."""
        kept = []
        for entry, plan in zip(entries, await self._plans([entry.sample for entry in entries])):
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

    def _prefetched(self, entry: Pending) -> bool:
        return entry.prefetched or (self.prefetcher is not None and not self.prefetcher.needs(entry.sample))

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
        entries = await self._within_memory(effective)
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
            trained, tensors, probe_logprobs = await self._compute(batch, references, teachers, len(drawn))
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
                prefetched=sum(self._prefetched(e) for e in entries) / len(batch),
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
            tensors, probe_logprobs = await self._current()
            _, verified, _ = await self._publish(tensors, self.version, probe_logprobs)
            return verified

    # -- the loop ---------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def in_step(self) -> int:
        return self._in_step

    def pause(self) -> None:
        """Stop taking steps; samples keep accumulating."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._wake.set()
        if self.prefetcher is not None:
            self.prefetcher.arrived()

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
                    if self.prefetcher is not None:
                        self.prefetcher.arrived()
            closed = True
            self._wake.set()

        size = max(1, self.config.rollout_batch_size)
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(read)
                if self.prefetcher is not None:
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
                    self._in_step = len(batch)
                    try:
                        with anyio.CancelScope(shield=True):  # a step is atomic: train, swap, record
                            stepped = await self._step(batch)
                    except Exception as e:  # the samples stay unconsumed in the journal
                        log.exception("training step failed")
                        self.events.log("error", f"training step failed: {type(e).__name__}: {e}")
                        continue
                    finally:
                        self._in_step = 0
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
            if not await self._write_checkpoint(final, state):
                return None
            self._saved_step = self.steps
            if self.config.retain_samples >= 0:  # the checkpoint covers these samples now
                forgotten = self.records.forget_token_ids(self.steps, keep=self.config.retain_samples)
                if forgotten:
                    log.info("forgot the token ids of %d consumed samples (--retain-samples %d)", forgotten, self.config.retain_samples)
            return final
