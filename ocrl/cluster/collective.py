"""`--replicas N --weight-sync broadcast`: a trained version's full weights go from the trainer
actor to every replica by one collective broadcast (torch.distributed: NCCL when the model is on
CUDA, gloo on the CPU), not through Ray's object store; only a small manifest (names, shapes,
dtypes) crosses Ray.

Contract:
 - One process group per build: the trainer actor is rank 0, the ready replicas ranks 1..n in
   the order of their index (replica i is rank i+1 when all are ready). Rendezvous by TCP on the
   trainer actor's node IP and a port it picks; every member joins with `TIMEOUT` seconds, which
   also bounds each broadcast, so a dead peer cannot hang a swap.
 - `plan(manifest)` cuts the manifest into buckets of one dtype of at most `BUCKET_BYTES` (a
   larger tensor goes alone); sender and receivers compute the same plan, so each bucket is one
   flat tensor and one `broadcast`.
 - `GroupMember` (a mixin of the trainer actor and of each replica): joins, leaves, sends what
   it holds (`hold`), receives. Its methods block in a thread; the actor's loop stays free.
 - `WeightGroup` (the router's): builds the group when none stands or its members changed (a
   replica became ready or left, an actor restarted: each member reports the generation of the
   group it is in), runs a swap's broadcast on the trainer and every ready replica at once, and
   returns the replicas that took it. When the build or the broadcast fails, the group is
   destroyed on every live member and that swap falls back to the object store for the rest
   (the router's path); the next swap builds it again with the replicas that are ready then.
   `stats()` counts swaps by broadcast, fallbacks, groups built.

Knows torch.distributed and Ray handles; nothing of routing, engines or HTTP. The trainer actor
has no other process group today; a trainer that trains with one (FSDP) would need this group
apart from its default one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from datetime import timedelta

import torch

log = logging.getLogger("ocrl.cluster")

BUCKET_BYTES = 64 * 2**20
TIMEOUT = 60.0  # seconds: a join or a broadcast that takes longer has lost a peer

Manifest = list[tuple[str, tuple[int, ...], str]]  # (name, shape, dtype as "float32")


def manifest_of(named_tensors: dict[str, torch.Tensor]) -> Manifest:
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in named_tensors.items()]


def plan(manifest: Manifest, limit: int = BUCKET_BYTES) -> list[list[tuple[str, tuple[int, ...], str]]]:
    """Buckets of one dtype each, in manifest order within a dtype, each at most `limit` bytes
    unless one tensor alone is larger."""
    by_dtype: dict[str, list] = {}
    for entry in manifest:
        by_dtype.setdefault(entry[2], []).append(entry)
    buckets = []
    for dtype, entries in by_dtype.items():
        size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        bucket, used = [], 0
        for entry in entries:
            nbytes = size * math.prod(entry[1])
            if bucket and used + nbytes > limit:
                buckets.append(bucket)
                bucket, used = [], 0
            bucket.append(entry)
            used += nbytes
        if bucket:
            buckets.append(bucket)
    return buckets


class GroupMember:
    """Mixed into the trainer actor (rank 0, sends) and each replica (receives)."""

    _generation = 0  # of the group this process is in; 0: none
    _held: dict = {}  # rank 0: the tensors of the version to send
    _device = "cpu"

    def hold(self, named_tensors: dict) -> None:
        self._held = named_tensors

    async def group_address(self) -> tuple[str, int]:
        """This node's IP and a free port for the rendezvous (rank 0 serves the store there)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    async def group_state(self, manifest: Manifest | None = None) -> dict:
        """The generation of the group this process is in, and (rank 0, given a manifest)
        whether it holds exactly those tensors to send."""
        held = manifest is None or manifest_of(self._held) == [(name, tuple(shape), dtype) for name, shape, dtype in manifest]
        return {"generation": self._generation, "holds": held}

    async def join_group(self, address: str, port: int, rank: int, world: int, backend: str, generation: int) -> None:
        await asyncio.to_thread(self._join, address, port, rank, world, backend, generation)

    def _join(self, address, port, rank, world, backend, generation) -> None:
        import torch.distributed as dist

        self._leave()
        dist.init_process_group(
            backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT)
        )
        self._device = "cuda" if backend == "nccl" else "cpu"
        self._generation = generation

    async def leave_group(self) -> None:
        await asyncio.to_thread(self._leave)

    def _leave(self) -> None:
        import torch.distributed as dist

        self._generation = 0
        if dist.is_initialized():
            dist.destroy_process_group()

    async def send_weights(self, manifest: Manifest) -> float:
        """Rank 0: broadcasts the held tensors bucket by bucket; returns the seconds it took."""
        return await asyncio.to_thread(self._send, manifest)

    def _send(self, manifest: Manifest) -> float:
        import torch.distributed as dist

        started = time.perf_counter()
        held = self._held
        for bucket in plan(manifest):
            flat = torch.cat([held[name].reshape(-1) for name, _, _ in bucket]).to(self._device)
            dist.broadcast(flat, src=0)
        return time.perf_counter() - started

    def _receive(self, manifest: Manifest) -> dict[str, torch.Tensor]:
        """Ranks 1..n: the tensors rank 0 sends, named as in the manifest, on the group's device
        (views of one flat tensor per bucket: on a GPU the whole version is held once more, in
        the replica's GPU memory, until the engine has copied it in)."""
        import torch.distributed as dist

        out = {}
        for bucket in plan(manifest):
            flat = torch.empty(sum(math.prod(shape) for _, shape, _ in bucket), dtype=getattr(torch, bucket[0][2]), device=self._device)
            dist.broadcast(flat, src=0)
            at = 0
            for name, shape, _ in bucket:
                n = math.prod(shape)
                out[name] = flat[at : at + n].view(shape)
                at += n
        return out


async def _quietly(ref) -> None:
    try:
        await asyncio.wait_for(ref, 10)
    except Exception:  # dead, restarting: its process took its membership with it
        pass


class WeightGroup:
    """The router's side: which group stands, and a swap by broadcast over it."""

    def __init__(self, ray, *, backend: str):
        self.ray = ray
        self.backend = backend
        self.trainer = None  # the trainer actor's handle (RemoteTrainer attaches it); None: no broadcast
        self.generation = 0
        self.members: tuple = ()  # the slot keys of the standing group; () none
        self._handles: list = []  # every member of the standing group, rank order
        self.groups = 0
        self.broadcasts = 0
        self.fallbacks = 0
        self.last_error = ""
        self.last_seconds: dict[str, float] = {}  # "broadcast" | "object_store": the last swap's seconds by that path

    async def swap(self, slots: list, named_tensors: dict[str, torch.Tensor], version: int) -> dict:
        """Broadcasts `version` to `slots` (the ready replicas); returns {slot: seconds} of those
        that took it (empty when the group could not be built or the trainer failed)."""
        if self.trainer is None or not slots:
            return {}
        manifest = manifest_of(named_tensors)
        try:
            with_timeout = lambda aw: asyncio.wait_for(aw, TIMEOUT + 10)  # noqa: E731
            states = await with_timeout(asyncio.gather(
                self.trainer.group_state.remote(manifest), *(s.handle.group_state.remote() for s in slots)
            ))  # fmt: skip
            if not states[0]["holds"]:
                raise RuntimeError("the trainer actor does not hold this version's tensors (restarted?)")
            if tuple(s.key for s in slots) != self.members or any(st["generation"] != self.generation for st in states):
                await self._build(slots)
            results = await with_timeout(asyncio.gather(
                self.trainer.send_weights.remote(manifest),
                *(s.handle.receive_weights.remote(manifest, version) for s in slots),
                return_exceptions=True,
            ))  # fmt: skip
        except Exception as e:
            results = [e]
        took = {s: r for s, r in zip(slots, results[1:]) if not isinstance(r, BaseException)}
        if isinstance(results[0], BaseException) or len(took) < len(slots):
            failed = next(r for r in results if isinstance(r, BaseException))
            self.last_error = f"{type(failed).__name__}: {failed}"[:300]
            self.fallbacks += 1
            log.warning("weights version %d: broadcast failed (%s); the object store carries it, the group is rebuilt next swap",
                        version, self.last_error)  # fmt: skip
            await self.destroy()
            return {} if isinstance(results[0], BaseException) else took
        self.broadcasts += 1
        return took

    async def _build(self, slots: list) -> None:
        await self.destroy()
        self.generation += 1
        address, port = await self.trainer.group_address.remote()
        world = 1 + len(slots)
        handles = [self.trainer] + [s.handle for s in slots]
        self._handles = handles
        await asyncio.wait_for(asyncio.gather(*(
            h.join_group.remote(address, port, rank, world, self.backend, self.generation) for rank, h in enumerate(handles)
        )), TIMEOUT + 10)  # fmt: skip
        self.members = tuple(s.key for s in slots)
        self.groups += 1
        log.info("weight broadcast group %d: trainer + %d replicas (%s, %s:%d)", self.generation, len(slots), self.backend, address, port)

    async def destroy(self) -> None:
        """Every live member leaves the standing group (a dead one left with its process)."""
        handles, self._handles, self.members = self._handles, [], ()
        await asyncio.gather(*(_quietly(h.leave_group.remote()) for h in handles))

    def stats(self) -> dict:
        return {
            "mode": "broadcast", "backend": self.backend, "broadcasts": self.broadcasts, "fallbacks": self.fallbacks,
            "groups": self.groups, "members": len(self.members),
            **{f"last_{path}_s": round(s, 4) for path, s in self.last_seconds.items()},
            **({"last_error": self.last_error} if self.last_error else {}),
        }
