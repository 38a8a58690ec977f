"""One engine replica as a Ray actor: the same engine class the single-process daemon serves with
(today the transformers engine, on the CPUs or the GPU Ray gives the actor), behind a few
remote methods the router (cluster/router.py) calls.

Contract:
 - The actor loads the model itself from the daemon's `Config` (`--model`, `--random-init`,
   dtype, context), on its own device, and starts its engine's scheduler in the actor's event
   loop. It then serves nothing until `load(tensors, version)` has run: a fresh actor, and one
   Ray restarted after a crash, first takes the current weights (every tensor trained since
   version 0, sent through Ray's object store) and only then takes requests. A request that
   arrives before that fails with `NotLoaded` (the router routes around it).
 - `--weight-sync lora`: what `load` and `update_weights` receive is the trainer's LoRA adapter
   (only lora_A and lora_B cross the object store); the replica merges it into its base weights
   itself (cluster/adapters.py) before its engine swaps them in. `--weight-sync broadcast`:
   `receive_weights(manifest, version)` takes the full weights from the trainer actor's broadcast
   (cluster/collective.py) instead of the object store. `status()["last_sync"]` says what the
   last swap received (kind, tensors, bytes, and `via`: object store or broadcast).
 - `stream` is a streaming generator of the engine's own chunks (`TokenChunk`, the last a
   `Final` that carries the weights version this replica served it with); `update_weights`,
   `score`, `next_token_logprobs` and `prepare` are the engine's, unchanged.
 - `status` answers at once (never behind a batch): incarnation, loaded version, load, memory
   (resident now and at its peak).

This module knows nothing about routing, sessions or HTTP.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid

from ocrl.cluster.collective import GroupMember, Manifest
from ocrl.engine.base import EngineError


class NotLoaded(EngineError):
    """The replica has not taken the current weights yet (just started or restarted)."""


def peak_rss_mb() -> float | None:
    """This process's peak resident memory in MiB (Linux's VmHWM), None where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


class Replica(GroupMember):
    """Wrapped by `ray.remote` in router.py (this module imports no Ray, so it loads without the extra)."""

    def __init__(self, config, index: int):
        import torch

        from ocrl import models
        from ocrl.engine.hf import HFEngine

        torch.set_num_threads(config.threads or 1)  # one actor per CPU Ray gives it
        self.index = index
        self.incarnation = uuid.uuid4().int % 2**31 + 1  # changes when Ray restarts the actor (never 0)
        self.started = time.time()
        loaded = models.load(
            config.model, device=config.device, dtype=config.dtype, random_init=config.random_init,
            context_length=config.context_length, rope_scaling=config.rope_scaling,
        )
        self.engine = HFEngine(
            loaded, max_batch_size=config.max_batch_size, max_queued=config.max_queued_requests,
            max_context=config.context_length, prefix_cache_budget=config.prefix_cache,
        )
        self.merger = None
        if config.weight_sync == "lora":  # the trainer sends its adapter; merged here (adapters.py)
            from ocrl.cluster.adapters import Merger, scaling

            self.merger = Merger(self.engine.model, scaling(config))
        self.loaded_version: int | None = None
        self.served = 0
        self.last_sync: dict = {}  # what the last swap or load received
        self._scheduler = None

    def _ensure_running(self) -> None:
        # the actor's event loop exists only once a remote call runs, not in __init__
        if self._scheduler is None:
            self._scheduler = asyncio.get_running_loop().create_task(self.engine.run())

    def _check_loaded(self) -> None:
        if self.loaded_version is None:
            raise NotLoaded(f"replica {self.index} has not loaded the current weights yet")

    def _received(self, named_tensors: dict, via: str = "object store") -> dict:
        """What the engine takes: the tensors as sent, or (--weight-sync lora) the layers the
        adapter names, merged into their base weights."""
        from ocrl.cluster.adapters import is_adapter

        adapter = is_adapter(named_tensors)
        if adapter and self.merger is None:
            raise EngineError("a LoRA adapter sent to a replica started without --weight-sync lora")
        self.last_sync = {
            "kind": "lora" if adapter else "full", "tensors": len(named_tensors),
            "bytes": sum(t.numel() * t.element_size() for t in named_tensors.values()), "via": via,
        }
        return self.merger.merged(named_tensors) if adapter else named_tensors

    async def load(self, named_tensors: dict, version: int) -> dict:
        """Takes the current weights (all tensors trained so far, or the current adapter; empty at
        version 0 of a model every replica loads alike) before serving; returns `status()`."""
        self._ensure_running()
        if named_tensors:
            await self.engine.update_weights(await asyncio.to_thread(self._received, named_tensors), version)
        self.engine.weights_version = version
        self.loaded_version = version
        return await self.status()

    async def update_weights(self, named_tensors: dict, version: int) -> float:
        self._ensure_running()
        self._check_loaded()
        seconds = await self.engine.update_weights(await asyncio.to_thread(self._received, named_tensors), version)
        self.loaded_version = version
        return seconds

    async def receive_weights(self, manifest: Manifest, version: int) -> float:
        """--weight-sync broadcast: this replica's part of the trainer actor's broadcast, then the
        swap as `update_weights` does it. It takes part before any check: a member that left the
        collective would hold up the others until the timeout."""
        self._ensure_running()
        named_tensors = await asyncio.to_thread(self._receive, manifest)
        self._check_loaded()
        seconds = await self.engine.update_weights(await asyncio.to_thread(self._received, named_tensors, "broadcast"), version)
        self.loaded_version = version
        return seconds

    async def stream(self, prompt_ids: list[int], params):
        self._ensure_running()
        self._check_loaded()
        self.served += 1
        async for chunk in self.engine.stream(prompt_ids, params):
            yield chunk

    async def prepare(self, grammar) -> None:
        await self.engine.prepare(grammar)

    async def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        self._ensure_running()
        self._check_loaded()
        return await self.engine.score(prompt_ids, response_ids)

    async def next_token_logprobs(self, prompt_ids: list[int]):
        self._ensure_running()
        self._check_loaded()
        return await self.engine.next_token_logprobs(prompt_ids)

    async def status(self) -> dict:
        from ocrl.memory import rss_mb

        engine = self.engine
        return {
            "index": self.index,
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "weights_version": self.loaded_version,
            "queue_depth": engine.queue_depth,
            "active": engine.active,
            "generated_tokens": engine.generated_tokens,
            "served": self.served,
            "rss_mb": rss_mb(),
            "peak_rss_mb": peak_rss_mb(),
            "last_sync": self.last_sync,
            "group": self._generation,
            "prefix_cache": engine.prefix_cache.stats(),
            "device": str(engine.device),
            "max_context": engine.max_context,
            "name": engine.name,
        }
