"""`bench serve --replicas N`: the daemon with N engine replicas as Ray actors against the same
daemon with 1 replica, and with the engine in its own process (no Ray), in one run, through the
real HTTP API: throughput of a burst of concurrent requests (completion tokens per second of
wall time), the median latency of one request alone, and the resident memory (now and at its
peak) of each replica actor's process, asked of the actor itself, and of the daemon. Ray is
started once here and shared by the three daemons.

On a CPU box with few cores the replicas compete for the same cores, so expect little gain; the
figure that matters is on a box with one GPU per replica.

With `--weight-sync broadcast` it also times weight swaps to the N replicas, by the broadcast
(cluster/collective.py) and by the object store alternately in one run, the router in this
process and a bare group member standing in for the trainer actor (it holds the same weights):
the median seconds of each, the router's `update_weights` from call to return.
"""

from __future__ import annotations

import statistics
import time

import anyio
import msgspec

from ocrl.bench.prompts import PROMPTS
from ocrl.bench.serving import DEFAULT_PORT, free_port, serving


async def measure(config, repeats: int, max_tokens: int, burst: int) -> dict:
    import httpx

    from ocrl.daemon import Daemon

    daemon = Daemon(config)
    await daemon.build()
    url = f"http://{config.host}:{config.port}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}

    async def request(client, i: int) -> int:
        body = {"model": "m", "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "temperature": 0,
                "max_tokens": max_tokens}
        # a session per request: affinity must not pile the burst onto one replica
        reply = await client.post(url, json=body, headers=headers | {"X-Session-Id": f"bench-{i}-{time.monotonic_ns()}"})
        reply.raise_for_status()
        return reply.json()["usage"]["completion_tokens"]

    result: dict = {}
    async with serving(daemon):
        async with httpx.AsyncClient(timeout=600) as client:
            for i in range(2 * max(1, config.replicas)):
                await request(client, i)  # warm-up, every replica
            latency, rates = [], []
            for r in range(repeats):
                started = time.perf_counter()
                await request(client, r)
                latency.append(time.perf_counter() - started)
                tokens = 0

                async def one(i: int) -> None:
                    nonlocal tokens
                    n = await request(client, i)  # not `tokens += await ...`: that reads tokens before the await
                    tokens += n

                started = time.perf_counter()
                async with anyio.create_task_group() as many:
                    for i in range(burst):
                        many.start_soon(one, i)
                rates.append(tokens / (time.perf_counter() - started))
        stats = daemon.stats()
        # each replica actor's own process, asked directly (the daemon's stats show the last look)
        own = [await replica_memory(config, i) for i in range(config.replicas)]
        result = {
            "latency_s": statistics.median(latency),
            "tokens_per_s": statistics.median(rates),
            "daemon_rss_mb": stats.memory.rss_mb,
            "replica_rss_mb": [m["rss_mb"] for m in own],
            "replica_peak_rss_mb": [m["peak_rss_mb"] for m in own],
            "routed": [r.routed for r in stats.engine.replicas or []],
        }
    return result


async def replica_memory(config, index: int) -> dict:
    """Resident memory (now and peak, MiB) of one replica actor's process."""
    import ray

    from ocrl.cluster.router import NAMESPACE, replica_name

    status = await ray.get_actor(replica_name(config, index), namespace=NAMESPACE).status.remote()
    return {"rss_mb": status["rss_mb"], "peak_rss_mb": status["peak_rss_mb"], "pid": status["pid"]}


async def bench_replicas(config, repeats: int, max_tokens: int) -> None:
    from ocrl.cluster.router import connect

    n = config.replicas
    connect(config.ray_address)  # once, shared by the daemons below (each leaves it running)
    import ray

    burst = 8 * n
    # single-turn requests: no votes, so no judge model to load
    base = msgspec.structs.replace(config, no_train=True, prm_mode="generate", weight_sync="full")
    rows = {}
    for label, replicas in (("in-process", 0), ("1 replica", 1), (f"{n} replicas", n)):
        port = config.port + replicas if config.port != DEFAULT_PORT else free_port(config.host)  # a daemon each
        rows[label] = await measure(msgspec.structs.replace(base, replicas=replicas, port=port), repeats, max_tokens, burst)
    swaps = None
    if config.weight_sync == "broadcast":
        swaps = await measure_swaps(msgspec.structs.replace(config, port=free_port(config.host)), repeats)
    ray.shutdown()
    one = rows["1 replica"]
    print(f"bench serve --replicas {n}: {config.model}{' ' + config.random_init if config.random_init else ''}, greedy, "
          f"{max_tokens} tokens a request, bursts of {burst}, {repeats} repeats (medians)")
    for label, row in rows.items():
        print(f"  {label:<12} {row['tokens_per_s']:8.1f} tok/s ({row['tokens_per_s'] / one['tokens_per_s']:5.2f}x of 1 replica)  "
              f"latency {row['latency_s'] * 1000:7.0f} ms ({row['latency_s'] / one['latency_s']:5.2f}x)  "
              f"routed {row['routed']}")
        replicas = ", ".join(f"{now:.0f} (peak {peak:.0f})" for now, peak in zip(row["replica_rss_mb"], row["replica_peak_rss_mb"]))
        print(f"  {'':<12} memory: daemon {row['daemon_rss_mb']:.0f} MiB" + (f"; each replica process {replicas} MiB, "
              f"{sum(row['replica_rss_mb']):.0f} MiB in all" if replicas else ""))
    if swaps:
        print(f"  weight swaps to {n} replicas ({swaps['bytes'] / 2**20:.1f} MiB, {swaps['backend']}, {repeats} each, alternated; medians): "
              f"broadcast {swaps['broadcast'] * 1000:.1f} ms, object store {swaps['object_store'] * 1000:.1f} ms "
              f"({swaps['broadcast'] / swaps['object_store']:.2f}x); fallbacks {swaps['fallbacks']}")


async def measure_swaps(config, repeats: int) -> dict:
    """Median seconds of the router's `update_weights` by broadcast and by the object store."""
    import ray

    from ocrl import models
    from ocrl.cluster.collective import GroupMember
    from ocrl.cluster.router import Cluster

    loaded = models.load(
        config.model, device=config.device, dtype=config.dtype, random_init=config.random_init,
        context_length=config.context_length, rope_scaling=config.rope_scaling,
    )  # fmt: skip
    cluster = await Cluster.start(config, loaded)
    try:
        sender = ray.remote(GroupMember).options(num_cpus=0).remote()
        cluster.attach_trainer(sender)
        group = cluster.group
        tensors = {n: p.detach().to("cpu", copy=True) for n, p in loaded.model.named_parameters()}
        await sender.hold.remote(tensors)
        times: dict[str, list[float]] = {"broadcast": [], "object_store": []}
        version = 0
        for r in range(repeats + 1):  # round 0 warms up (and builds the group)
            for path in times:
                version += 1
                cluster.group = group if path == "broadcast" else None
                seconds = await cluster.update_weights(tensors, version)
                if r:
                    times[path].append(seconds)
        cluster.group = group
        return {
            **{path: statistics.median(t) for path, t in times.items()}, "fallbacks": group.fallbacks, "backend": group.backend,
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()), "samples": times,
        }
    finally:
        cluster.close()
        ray.kill(sender)
