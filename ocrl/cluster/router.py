"""`--replicas N`: N engine replicas as Ray actors behind one object that is an Engine to the rest
of the daemon (the HTTP API, sessions, judge, trainer and stats see the engine protocol of
engine/base.py and nothing of Ray).

Contract:
 - Start-up (`Cluster.start`): joins the Ray cluster `--ray-address` names (`local`: starts one in
   this process unless Ray is already initialised here; `auto`: the cluster `ray start` began on
   this node; `HOST:PORT`: that head), then places N `Replica` actors (cluster/replica.py), each
   with one GPU when the daemon's model is on CUDA, else one CPU, restarted by Ray when they die
   (`max_restarts`). It returns once every replica has loaded the weights.
 - Routing (`stream`, `generate`): among replicas that are up and hold the current weights
   version, the one whose prefix cache holds the longest start of the prompt when that covers at
   least `AFFINITY_SHARE` of it (a session's next turn; cluster/affinity.py), unless that replica
   is a whole batch busier than the least loaded; otherwise the least loaded (requests in flight
   through this router, then fewest served). Each completion's final chunk carries the version
   the replica that produced it served.
 - Weights (`update_weights`): merged weights, or with `--weight-sync lora` the trainer's LoRA
   adapter (`accepts_adapters`; each replica merges it itself, cluster/adapters.py, and the
   judge reads the base weights this process holds, `base()`): the tensors go into Ray's object
   store once and every ready replica copies them in (at once); with `--weight-sync broadcast`
   the trainer actor broadcasts them instead (cluster/collective.py; the object store carries
   them only to replicas the broadcast missed). The router also keeps every tensor trained
   since version 0 so a replica that (re)starts later loads the current version before it is routed to. A
   replica that fails the swap is taken out until it has reloaded; the swap fails only when no
   replica took it. `score` (the trainer's probe) runs on every ready replica and raises when
   any two disagree beyond the trainer's tolerance, so a verified swap is verified everywhere.
 - Faults: a replica that dies fails only the requests it was serving, with an EngineError that
   names it (a request that got no token yet is retried once on another replica); the rest
   keep serving; the health loop (`run`) sees Ray's restarted actor, loads it and routes to it
   again.
 - `stats()` shows each replica: up or not, the version it serves, its load, memory and prefix
   cache.

The trainer runs as one more actor (cluster/remote_trainer.py). Not here yet: SGLang replicas; the
NCCL broadcast has run only as gloo on the CPU (the same code, another backend).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import anyio
import torch

from ocrl.cluster.affinity import AffinityIndex
from ocrl.cluster.collective import WeightGroup
from ocrl.cluster.replica import NotLoaded, Replica
from ocrl.engine.base import EngineBusy, EngineError, Final, collect
from ocrl.types import Completion, Grammar, SamplingParams, TokenChunk

log = logging.getLogger("ocrl.cluster")

AFFINITY_SHARE = 0.5  # of the prompt a replica must hold before a request follows it there
MAX_RESTARTS = 8  # per replica, then Ray leaves it dead and the rest serve
HEALTH_EVERY = 0.5  # seconds between looks at each replica
STATUS_TIMEOUT = 5.0
CLOSE_WAIT = 120.0  # seconds the shutdown waits for the trainer's last checkpoint before closing Ray
NAMESPACE = "ocrl"


def ray_module():
    try:
        import ray
    except ImportError as e:
        from ocrl.config import ConfigError

        raise ConfigError(f"--replicas needs Ray: pip install -e '.[cluster]' ({e})") from None
    return ray


def connect(address: str) -> bool:
    """Joins or starts the Ray cluster; True when this call started it (and so shuts it down)."""
    ray = ray_module()
    if ray.is_initialized():
        return False
    # one namespace, so replicas are found by name (replica_name) from any driver
    if address == "local":
        ray.init(include_dashboard=False, log_to_driver=False, namespace=NAMESPACE)
    else:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, namespace=NAMESPACE)
    return True


def replica_name(config, index: int) -> str:
    """The Ray actor's name: one daemon's replicas per port, so two daemons share a cluster."""
    return f"ocrl-{config.port}-replica-{index}"


@dataclass(eq=False)
class _Slot:
    index: int
    handle: object
    ready: bool = False  # up and holding the current weights version
    incarnation: int = 0  # 0: not seen yet
    inflight: int = 0
    routed: int = 0
    status: dict = field(default_factory=dict)
    last_error: str = ""

    @property
    def key(self) -> tuple[int, int]:
        return self.index, self.incarnation


class Cluster:
    def __init__(self, ray, slots: list[_Slot], *, name: str, max_context: int, device: torch.device, max_batch_size: int,
                 agree_atol: float, owns_ray: bool):
        self.ray = ray
        self.slots = slots
        self.name = name
        self.max_context = max_context
        self.device = device
        self.max_batch_size = max_batch_size
        self.agree_atol = agree_atol
        self.owns_ray = owns_ray
        self.weights_version = 0
        self.accepts_adapters = False  # replicas take merged weights; --weight-sync lora: the adapter
        self._base = None  # --weight-sync lora: the base weights in this process, for the judge
        self.trained: dict[str, torch.Tensor] = {}  # every tensor trained since version 0, newest value
        self._trained_ref = None  # the same, in the object store (put once per version)
        self.group: WeightGroup | None = None  # --weight-sync broadcast (cluster/collective.py)
        self.affinity = AffinityIndex()
        self._swap_lock = anyio.Lock()  # swaps and (re)loads take turns
        self.routed_by_affinity = 0
        self.retried = 0
        self.failed_by_replica = 0
        self.users = 0  # others holding actors in this Ray session (the trainer's): Ray stays up for them

    @classmethod
    async def start(cls, config, loaded) -> "Cluster":
        from ocrl.config import ConfigError

        if config.replicas < 1:
            raise ConfigError(f"--replicas {config.replicas}: give 1 or more (0 serves without Ray)")
        if config.engine == "sglang":
            raise ConfigError("--replicas runs transformers-engine replicas so far; SGLang replicas are not done yet")
        adapters = config.weight_sync == "lora"
        if adapters and (config.lora_rank <= 0 or config.full_finetune):
            raise ConfigError("--weight-sync lora needs LoRA training (--lora-rank > 0, no --full-finetune)")
        ray = ray_module()
        owns_ray = connect(config.ray_address)
        model_device = next(loaded.model.parameters()).device
        gpus = 1 if model_device.type == "cuda" else 0
        actor = ray.remote(Replica)
        placement = dict(
            max_restarts=MAX_RESTARTS, max_task_retries=0, num_cpus=0 if gpus else 1, num_gpus=gpus,
            max_concurrency=1000,  # requests stream concurrently; the engine batches them
        )
        # named, so an operator (or a test) can find one: ray.get_actor(name, namespace=...)
        slots = [_Slot(i, actor.options(name=replica_name(config, i), **placement).remote(config, i)) for i in range(config.replicas)]
        from ocrl.train.policy import verify_tolerance

        cluster = cls(
            ray, slots, name=loaded.name, max_context=0, device=model_device, max_batch_size=config.max_batch_size,
            agree_atol=verify_tolerance(loaded.model), owns_ray=owns_ray,
        )
        if config.weight_sync == "broadcast":  # the trainer actor joins when it starts (attach_trainer)
            cluster.group = WeightGroup(ray, backend="nccl" if gpus else "gloo")
        if adapters:
            from ocrl.engine.hf import HFEngine

            cluster.accepts_adapters = True
            # the policy is an adapter: the base weights (this process's copy, which nothing
            # trains or swaps) are what the judge reads, as on SGLang (`base()`)
            cluster._base = HFEngine(loaded, max_batch_size=config.max_batch_size, prefix_cache_budget=config.prefix_cache)
        try:
            first = await slots[0].handle.status.remote()
            cluster.name, cluster.max_context = first["name"], first["max_context"]
            await cluster.check()
            if not any(s.ready for s in slots):
                raise EngineError("no engine replica came up: " + "; ".join(f"{s.index}: {s.last_error}" for s in slots))
        except BaseException:
            cluster.close()  # no named actors left behind to block the next start
            raise
        log.info("cluster: %d replicas ready (%s)", sum(s.ready for s in slots), ", ".join(s.status.get("device", "?") for s in slots))
        return cluster

    # -- the Engine protocol ----------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return sum(s.status.get("queue_depth", 0) for s in self.slots if s.ready)

    @property
    def active(self) -> int:
        return sum(s.inflight for s in self.slots)

    @property
    def generated_tokens(self) -> int:
        return sum(s.status.get("generated_tokens", 0) for s in self.slots)

    def _pick(self, prompt_ids: list[int], exclude: tuple[_Slot, ...] = ()) -> _Slot:
        ready = [s for s in self.slots if s.ready and s not in exclude]
        if not ready:
            raise EngineBusy("no engine replica is serving right now (restarting); retry shortly")
        least = min(ready, key=lambda s: (s.inflight, s.routed))
        key, tokens = self.affinity.match(prompt_ids)
        if key is not None and tokens >= AFFINITY_SHARE * len(prompt_ids):
            held = next((s for s in ready if s.key == key), None)
            if held is not None and held.inflight < least.inflight + self.max_batch_size:
                self.routed_by_affinity += 1
                return held
        return least

    async def stream(self, prompt_ids: list[int], params: SamplingParams):
        ray = self.ray
        tried: tuple[_Slot, ...] = ()
        while True:
            slot = self._pick(prompt_ids, exclude=tried)
            slot.inflight += 1
            slot.routed += 1
            key = slot.key
            response: list[int] = []
            gen = slot.handle.stream.options(num_returns="streaming").remote(list(prompt_ids), params)
            done = False
            try:
                async for ref in gen:
                    chunk: TokenChunk = await ref
                    response += chunk.token_ids
                    if isinstance(chunk, Final):  # before the yield: a consumer may stop at the final chunk
                        done = True
                        self.affinity.remember(list(prompt_ids) + response, key)
                        yield chunk
                        return
                    yield chunk
                raise EngineError(f"replica {slot.index} ended the stream without a final chunk")
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if isinstance(getattr(e, "cause", None), BaseException) else None
                if isinstance(cause, NotLoaded) and not response and not tried:
                    self._take_out(slot, "restarted, not loaded yet")
                    tried += (slot,)
                    self.retried += 1
                    continue
                raise (cause if isinstance(cause, EngineError) else EngineError(f"replica {slot.index}: {e}")) from None
            except ray.exceptions.RayActorError as e:  # died, restarting or unreachable
                self._take_out(slot, type(e).__name__)
                if not response and not tried and len(self.slots) > 1:
                    tried += (slot,)
                    self.retried += 1
                    continue
                self.failed_by_replica += 1
                raise EngineError(
                    f"engine replica {slot.index} went away during this request ({type(e).__name__}); "
                    "the other replicas keep serving: retry the request"
                ) from None
            finally:
                slot.inflight -= 1
                if not done:
                    with _quiet():
                        ray.cancel(gen)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        return await collect(self.stream(prompt_ids, params), prompt_ids)

    async def _call_one(self, method: str, *args):
        slot = self._pick([])
        try:
            return await getattr(slot.handle, method).remote(*args)
        except self.ray.exceptions.RayTaskError as e:
            raise e.cause if isinstance(getattr(e, "cause", None), Exception) else EngineError(str(e)) from None
        except self.ray.exceptions.RayActorError as e:
            self._take_out(slot, type(e).__name__)
            raise EngineError(f"engine replica {slot.index} went away ({type(e).__name__}); retry") from None

    async def prepare(self, grammar: Grammar) -> None:
        await self._call_one("prepare", grammar)

    async def next_token_logprobs(self, prompt_ids: list[int]) -> torch.Tensor:
        return await self._call_one("next_token_logprobs", prompt_ids)

    async def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """The probe on every ready replica: the first's log-probs when all agree with it within
        the trainer's tolerance, else EngineError (the swap does not verify)."""
        slots = [s for s in self.slots if s.ready]
        if not slots:
            raise EngineError("no engine replica is serving to score on")
        rows = await asyncio.gather(*(s.handle.score.remote(prompt_ids, response_ids) for s in slots), return_exceptions=True)
        first = None
        for slot, row in zip(slots, rows):
            if isinstance(row, self.ray.exceptions.RayActorError):
                # died while scoring: out until Ray restarts it and it reloads the current version;
                # the probe stands on the replicas that answered
                self._take_out(slot, f"died scoring the probe: {type(row).__name__}")
                continue
            if isinstance(row, BaseException):
                slot.status["probe"] = f"failed: {type(row).__name__}"
                raise EngineError(f"replica {slot.index} could not score the probe: {row}")
            if first is None:
                first = row
            diff = max((abs(a - b) for a, b in zip(row, first)), default=0.0) if len(row) == len(first) else float("inf")
            slot.status["probe_diff"] = diff
            if diff > self.agree_atol:
                raise EngineError(f"replica {slot.index} serves log-probs {diff:.3g} away from the first that scored")
        if first is None:
            raise EngineError("every replica went away while scoring the probe")
        return first

    async def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> float:
        started = time.perf_counter()
        async with self._swap_lock:
            # copies taken now: the trainer's tensors are views it changes after we return
            self.trained.update({n: t.detach().to("cpu", copy=True) for n, t in named_tensors.items()})
            self._trained_ref = None
            slots = [s for s in self.slots if s.ready]
            # --weight-sync broadcast: the data by the trainer actor's broadcast; the object store
            # carries it to the replicas that did not take it (no group yet, a peer lost)
            by_broadcast = await self.group.swap(slots, named_tensors, version) if self.group is not None else {}
            rest = [s for s in slots if s not in by_broadcast]
            ref = self.ray.put({n: self.trained[n] for n in named_tensors}) if rest else None
            results = await asyncio.gather(*(s.handle.update_weights.remote(ref, version) for s in rest), return_exceptions=True)
            self.weights_version = version  # replicas not at it are not routed to until they load it
            took = len(by_broadcast)
            for slot in by_broadcast:
                slot.status["weights_version"] = version
            for slot, result in zip(rest, results):
                if isinstance(result, BaseException):
                    self._take_out(slot, f"swap to {version} failed: {type(result).__name__}")
                else:
                    took += 1
                    slot.status["weights_version"] = version
            if not took:
                raise EngineError(f"no replica took weights version {version}")
        seconds = time.perf_counter() - started
        if self.group is not None:
            self.group.last_seconds["object_store" if rest else "broadcast"] = seconds
        return seconds

    # -- health: restarted replicas load the current version before they serve ------------

    def attach_trainer(self, handle) -> None:
        """The trainer actor's handle: rank 0 of the broadcast group (--weight-sync broadcast)."""
        if self.group is not None:
            self.group.trainer = handle

    def weight_sync_stats(self) -> dict | None:
        return None if self.group is None else self.group.stats()

    def base(self):
        """--weight-sync lora: an engine serving the base weights (no adapter), for the judge."""
        if self._base is None:
            raise EngineError("the base weights are served apart only with --weight-sync lora")
        return self._base

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                if self._base is not None:
                    tg.start_soon(self._base.run)
                while True:
                    await anyio.sleep(HEALTH_EVERY)
                    await self.check()
        finally:
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(CLOSE_WAIT):
                    while self.users:  # the trainer's last checkpoint, written by its actor
                        await anyio.sleep(0.05)
                self.close()

    async def check(self) -> None:
        await asyncio.gather(*(self._check(s) for s in self.slots))

    async def _check(self, slot: _Slot) -> None:
        try:
            status = await asyncio.wait_for(slot.handle.status.remote(), STATUS_TIMEOUT)
        except Exception as e:  # dead, restarting, or too busy to answer: not routed to meanwhile
            self._take_out(slot, type(e).__name__)
            return
        slot.status.update(status)
        if status["incarnation"] == slot.incarnation and status["weights_version"] == self.weights_version:
            slot.ready = True
            return
        async with self._swap_lock:
            version = self.weights_version
            if status["incarnation"] == slot.incarnation and slot.status.get("weights_version") == version:
                slot.ready = True  # a swap that was under way when we looked has brought it up to date
                return
            if self._trained_ref is None:
                self._trained_ref = self.ray.put(dict(self.trained))
            try:
                status = await slot.handle.load.remote(self._trained_ref, version)
            except Exception as e:
                self._take_out(slot, f"load failed: {type(e).__name__}")
                return
        restarted = bool(slot.incarnation) and status["incarnation"] != slot.incarnation
        slot.status.update(status)
        slot.incarnation = status["incarnation"]
        slot.ready = True
        slot.last_error = ""
        if restarted:
            log.warning("replica %d restarted (pid %s); loaded weights version %d, serving again", slot.index, status["pid"], version)

    def _take_out(self, slot: _Slot, why: str) -> None:
        if slot.ready:
            log.warning("replica %d out of service: %s", slot.index, why)
        slot.ready = False
        slot.last_error = why

    def stats(self) -> list[dict]:
        return [
            {
                "index": s.index,
                "ready": s.ready,
                "weights_version": s.status.get("weights_version"),
                "inflight": s.inflight,
                "routed": s.routed,
                "served": s.status.get("served", 0),
                "generated_tokens": s.status.get("generated_tokens", 0),
                "rss_mb": s.status.get("rss_mb"),
                "pid": s.status.get("pid"),
                "incarnation": s.incarnation,
                "prefix_cache": s.status.get("prefix_cache", {}),
                **({"probe_diff": s.status["probe_diff"]} if "probe_diff" in s.status else {}),
                **({"last_error": s.last_error} if s.last_error else {}),
            }
            for s in self.slots
        ]

    def close(self) -> None:
        for slot in self.slots:
            with _quiet():
                self.ray.kill(slot.handle, no_restart=True)
        if self.owns_ray:
            with _quiet():
                self.ray.shutdown()


class _quiet:
    """Best effort on the way out: Ray may already be gone."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return exc[0] is not None and issubclass(exc[0], Exception)
