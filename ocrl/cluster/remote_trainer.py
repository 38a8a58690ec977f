"""`--replicas N`: the daemon's side of the trainer's Ray actor (cluster/trainer_actor.py). The
loop, the publish and the records stay in the daemon (train/loop.py's `StepLoop`); the torch
work goes to the actor, named `ocrl-<port>-trainer` in namespace `ocrl`, restarted by Ray when
it dies (`max_restarts`).

Contract:
 - The daemon keeps the sample queue and the journal and hands the actor one batch per step;
   the actor returns the weights to publish, which go to the replicas through the router as
   before (probe verified on each). A sample is marked consumed by the step that trained it,
   once the step is published, exactly as in one process.
 - The actor dies (`ray.kill`, a crash, its node gone): Ray restarts it and the daemon restores
   it from the newest complete checkpoint (step s), seen either when a call fails or by the
   watch on its status. Then, as `--resume` does after a crash of the whole daemon: the
   consumed marks of steps after s are voided (a `resumed_at` row, records.py), and their
   samples, kept here since the last checkpoint, go back to the front of the queue with the
   batch that was in flight; so a sample lost with the actor's memory is trained once more
   into the weights that survive, and none twice. The step count goes on from s.
 - Versions never go backwards: the replicas keep serving the newest version they took (its
   weights came from the lost steps) until the restored trainer's next step, which publishes
   version + 1. So every completion records a version its replica served, and a version number
   names one set of weights.
 - `stats()` shows the actor: up or not, its incarnation and pid, restarts, the step it was
   restored from, memory.

Not here yet: prefetching reference log-probs while a batch fills (the actor computes them in
the step), a trainer larger than one GPU (FSDP across the trainer's GPUs is the next step).
"""

from __future__ import annotations

import logging
import time

import anyio

from ocrl.cluster.trainer_actor import NotRestored, TrainerActor
from ocrl.train.batch import probe_sample
from ocrl.train.loop import StepLoop
from ocrl.train.policy import trains_lora
from ocrl.train.prefetch import Pending

log = logging.getLogger("ocrl.cluster")

MAX_RESTARTS = 8  # then Ray leaves it dead: steps fail (logged), serving goes on
WATCH_EVERY = 1.0  # seconds between looks at the actor
STATUS_TIMEOUT = 5.0
RESTART_TIMEOUT = 300.0  # how long a restore waits for Ray to bring the actor back


class TrainerLost(Exception):
    """The actor died, or Ray restarted it and it has not restored yet: the call did nothing the
    daemon relies on."""


def trainer_name(config) -> str:
    return f"ocrl-{config.port}-trainer"


class RemoteTrainer(StepLoop):
    def __init__(self, config, ray, handle, *, engine, records, events, verify_atol: float, verify_rtol: float):
        self._init_loop(config, engine=engine, records=records, events=events, verify_atol=verify_atol, verify_rtol=verify_rtol,
                        lora=trains_lora(config))  # fmt: skip
        self.ray = ray
        self.handle = handle
        self.incarnation = 0  # of the actor last restored; 0: none yet
        self.restarts = 0
        self.restored_step = 0
        self.status: dict = {}
        self.last_error = ""
        self._unsaved: dict[int, list] = {}  # step -> the samples it consumed, for steps after the last checkpoint

    @classmethod
    async def start(cls, config, cluster, *, records, events, verify_atol: float, verify_rtol: float) -> "RemoteTrainer":
        """Places the actor (one GPU when the replicas take GPUs, else one CPU) and restores it:
        from the newest checkpoint with --resume, else from the model as loaded."""
        ray = cluster.ray
        gpus = 1 if cluster.device.type == "cuda" else 0
        handle = ray.remote(TrainerActor).options(
            name=trainer_name(config), max_restarts=MAX_RESTARTS, max_task_retries=0, num_cpus=0 if gpus else 1, num_gpus=gpus,
        ).remote(config)  # fmt: skip
        cluster.attach_trainer(handle)  # --weight-sync broadcast: rank 0 of the group
        trainer = cls(config, ray, handle, engine=cluster, records=records, events=events, verify_atol=verify_atol, verify_rtol=verify_rtol)
        try:
            async with trainer._lock:
                await trainer._restore()
        except BaseException:
            trainer.close()
            raise
        log.info("trainer actor %s up (%s, pid %s) at step %d", trainer_name(config), trainer.status.get("device"),
                 trainer.status.get("pid"), trainer.steps)  # fmt: skip
        return trainer

    # -- calls --------------------------------------------------------------------------------

    async def _call(self, method: str, *args):
        ray = self.ray
        try:
            return await getattr(self.handle, method).remote(*args)
        except ray.exceptions.RayActorError as e:  # died, restarting or unreachable
            raise TrainerLost(type(e).__name__) from None
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, NotRestored):
                raise TrainerLost(str(cause)) from None
            raise cause if isinstance(cause, Exception) else RuntimeError(str(e)) from None

    async def _plans(self, samples):
        return await self._call("plans", [len(sample.tokens) for sample in samples])

    async def _compute(self, batch, references, teachers, count: int):
        metrics, tensors, probe_logprobs, self.distilled_rows = await self._call("train", batch, count)
        return metrics, tensors, probe_logprobs

    async def _current(self):
        return await self._call("current", self.probe)

    async def _write_checkpoint(self, final, state) -> bool:
        try:
            saved = await self._call("save", str(final), state)
        except TrainerLost as e:  # the previous checkpoint stands (checkpoint.py writes atomically)
            log.warning("trainer actor lost while saving step %d (%s)", state.step, e)
            await self._restore()  # under the lock save_checkpoint holds
            return False
        if saved:
            self._unsaved = {step: samples for step, samples in self._unsaved.items() if step > state.step}
        return saved

    # -- a step, and what a lost actor costs ----------------------------------------------

    async def _within_memory(self, entries: list[Pending]) -> list[Pending]:
        kept = await super()._within_memory(entries)
        self._left_out = {id(entry) for entry in entries} - {id(entry) for entry in kept}  # consumed as too long already
        return kept

    async def _step(self, entries: list[Pending]):
        self._left_out: set[int] = set()
        try:
            row = await super()._step(entries)
        except TrainerLost as e:
            back = [Pending(entry.sample) for entry in entries if id(entry) not in self._left_out]
            log.warning("trainer actor lost during a step (%s): its %d samples go back in the queue", e, len(back))
            async with self._lock:
                self._pending[:0] = back
                await self._restore()
            return None
        if row is not None:
            self._unsaved[self.steps] = [entry.sample for entry in entries if id(entry) not in self._left_out]
        return row

    async def _restore(self) -> None:
        """Brings the actor to where training stands: waits for it, restores it (the lock held),
        and, when it is a restarted one, queues again what its lost steps had consumed."""
        deadline = time.monotonic() + RESTART_TIMEOUT
        while True:
            try:
                status = await self._call("status")
                if status["restored"] and status["incarnation"] == self.incarnation:
                    return
                first = self.incarnation == 0
                load = (not first or self.config.resume) and self.save_dir is not None
                state = await self._call("restore", str(self.save_dir) if load else None)
                break
            except TrainerLost as e:
                self.last_error = str(e)
                if time.monotonic() > deadline:
                    raise TrainerLost(f"the trainer actor did not come back within {RESTART_TIMEOUT:.0f} s: {e}") from None
                await anyio.sleep(WATCH_EVERY)
        step = state["step"]
        if not first:
            lost = [sample for at in sorted(self._unsaved) if at > step for sample in self._unsaved[at]]
            self._pending[:0] = [Pending(sample) for sample in lost]
            self.records.mark_resumed(step)  # the consumed marks of the lost steps stop counting
            self.restarts += 1
            note = (f"trainer actor restarted (pid {status['pid']}): resumed from step {step} (was at {self.steps}), "
                    f"{len(lost)} samples of the lost steps queued again; replicas serve weights version {self.version} "
                    f"until the next step publishes {self.version + 1}")  # fmt: skip
            log.warning(note)
            self.events.log("warning", note)
            self._wake.set()
        self._unsaved = {}
        self.steps = self._saved_step = self.restored_step = step
        self.consumed_samples = state["consumed_samples"]
        self.version = max(self.version, state["weights_version"])  # never backwards (see the docstring)
        self.probe = probe_sample(*state["probe"]) if state["probe"] else None
        self.incarnation = state["incarnation"]
        self.status = {**status, "restored": True, "incarnation": state["incarnation"]}
        self.last_error = ""

    async def _watch(self) -> None:
        """Keeps `status` fresh and restores a restarted actor while no step needs it."""
        while True:
            await anyio.sleep(WATCH_EVERY)
            try:
                with anyio.fail_after(STATUS_TIMEOUT):
                    status = await self._call("status")
            except (TrainerLost, TimeoutError) as e:
                self.status["up"] = False
                self.last_error = str(e) or type(e).__name__
                continue
            self.status = {**status, "up": True}
            if status["incarnation"] != self.incarnation or not status["restored"]:
                async with self._lock:
                    try:
                        await self._restore()
                    except Exception as e:
                        log.warning("trainer actor not restored: %s", e)
                        self.last_error = str(e)

    async def run(self, samples) -> None:
        self.engine.users += 1  # the cluster keeps Ray up until the last checkpoint is written
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch)
                await super().run(samples)
                tg.cancel_scope.cancel()
        finally:
            self.close()
            self.engine.users -= 1

    def stats(self) -> dict:
        return {
            "name": trainer_name(self.config),
            "up": self.status.get("up", bool(self.incarnation)),
            "incarnation": self.incarnation,
            "pid": self.status.get("pid"),
            "restarts": self.restarts,
            "restored_step": self.restored_step,
            "device": self.status.get("device", ""),
            "rss_mb": self.status.get("rss_mb"),
            **({"last_error": self.last_error} if self.last_error else {}),
        }

    def close(self) -> None:
        try:
            self.ray.kill(self.handle, no_restart=True)
        except Exception:  # Ray may already be gone
            pass
