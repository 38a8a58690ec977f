"""Reference work done ahead of a step, while its batch fills.

Online, the trainer spends most of its time waiting for a batch to fill. Meanwhile it prefetches
the reference log-probs of each pending sample (unless --kl-coef 0) and, for a distilled sample
under --method opd|combine, its teacher's: one sample at a time, oldest first, and only while
serving is idle. The reference never changes, so they are the numbers the step would compute, off
its critical path. A prefetch gives way at once when a request arrives: it is abandoned and redone
later (`GiveWay.preemptible`). The swap probe cannot be prefetched: it must be scored with the
weights after the optimizer step.

Knows the policy's log-prob forwards and when serving is busy; never the optimizer, the loss or
the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import anyio
import torch

from ocrl.train.give_way import GiveWay, Preempted
from ocrl.train.policy import Policy, Teacher
from ocrl.types import Sample

PREFETCH_POLL = 0.02  # seconds between looks at the engine while a prefetch waits to start


@dataclass(eq=False)
class Pending:
    """A sample waiting for its batch, with its reference (and teacher) log-probs once prefetched."""

    sample: Sample
    reference: torch.Tensor | None = None  # (R,)
    teacher: Teacher | None = None
    prefetched: bool = False  # everything the step would compute for it is here


class Prefetcher:
    """Prefetches for `policy` (its config says what a step needs), giving way to serving through
    `give_way`; `lock` keeps its torch work apart from a step's."""

    def __init__(self, policy: Policy, give_way: GiveWay, lock: anyio.Lock):
        self.policy = policy
        self.give_way = give_way
        self.lock = lock
        self._arrived = anyio.Event()

    def needs(self, sample: Sample) -> bool:
        """Whether a step would run the reference for it: its KL term (unless --kl-coef 0) or
        its teacher (a distilled sample, --method opd|combine); never for a mask-0 sample."""
        if not sample.effective:
            return False
        config = self.policy.config
        return config.kl_coef != 0 or (sample.distilled and config.method != "rl")

    def prefetch(self, entry: Pending) -> None:
        """A pending sample's reference log-probs (unless --kl-coef 0) and, when it is distilled,
        its teacher's (a worker thread); left as it was when a request arrived meanwhile and the
        work was abandoned."""
        sample, config = entry.sample, self.policy.config
        with self.give_way.preemptible():
            try:
                reference = self.policy.response_logprobs([sample], reference=True)[0] if config.kl_coef != 0 else None
                teacher = self.policy.teacher_logprobs([sample])[0] if sample.distilled and config.method != "rl" else None
            except Preempted:
                return
        entry.reference, entry.teacher, entry.prefetched = reference, teacher, True

    def arrived(self) -> None:
        """A sample arrived, or training resumed: look at the pending samples again."""
        self._arrived.set()

    async def run(self, pending: list[Pending], paused: Callable[[], bool]) -> None:
        """Prefetch `pending` (the trainer's queue, which steps take from), oldest first, while
        serving is idle and training is not paused; until cancelled."""
        while True:
            entry = next((e for e in pending if not e.prefetched and self.needs(e.sample)), None)
            if entry is None or paused():
                await self._arrived.wait()
                self._arrived = anyio.Event()
                continue
            if self.give_way.busy():
                await anyio.sleep(PREFETCH_POLL)
                continue
            async with self.lock:  # never alongside a step's torch work
                if entry in pending and not entry.prefetched:  # not taken by a step meanwhile
                    await anyio.to_thread.run_sync(self.prefetch, entry)
