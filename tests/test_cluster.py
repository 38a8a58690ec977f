"""`--replicas 2` on a local Ray cluster this test process starts in-process: the real daemon (a
subprocess, as a user starts it, joining the cluster with --ray-address HOST:PORT) with two
transformers-engine replicas of `--random-init tiny`, the real `openai` client. Routing and
session affinity, trained versions reaching both replicas (probe verified on each), and a
replica killed with ray.kill mid-request: only its request fails, the other keeps serving, Ray
restarts it and it serves the current version again; and the crash tests' accounting (every acknowledged
main turn journaled once, trained at most once, nothing kept for a failed request) after a kill
mid-traffic with training on. The trainer is a third actor: its steps reach both replicas, and
when it is killed mid-traffic it resumes from the newest checkpoint with the same accounting.
With --weight-sync lora only adapters cross the object store; with --weight-sync broadcast full
weights go from the trainer actor to the replicas by a gloo broadcast, the object store as the
fallback when the group loses a member.

One cluster and one daemon for the module: Ray and two replica processes take most of the time.
"""

from __future__ import annotations

import os
from collections import Counter
import threading
import time

import httpx
import pytest

from conftest import API_KEY, Daemon

ray = pytest.importorskip("ray", reason="--replicas needs the cluster extra (ray)")


def test_affinity_index_follows_the_longest_cached_prefix():
    from ocrl.cluster.affinity import AffinityIndex

    index = AffinityIndex(block=4)
    system = [1, 2, 3, 4]
    a = system + [10, 11, 12, 13, 14, 15, 16, 17, 18]
    b = system + [20, 21, 22, 23, 24, 25, 26, 27]
    index.remember(a, "r0")
    index.remember(b, "r1")
    assert index.match(a + [99, 98, 97, 96]) == ("r0", 12)  # a's next turn: whole blocks of a
    assert index.match(b + [5]) == ("r1", 12)
    assert index.match(system + [7, 7, 7, 7]) in (("r0", 4), ("r1", 4))  # only the shared system prompt
    assert index.match([9, 9, 9, 9, 9]) == (None, 0)
    small = AffinityIndex(block=4, capacity=3)
    small.remember(a, "r0")  # 3 blocks fit; the next sequence evicts a's deepest blocks first
    small.remember([5, 5, 5, 5], "r1")
    assert small.match(a) == ("r0", 8)


def test_a_replica_merges_the_adapter_as_the_trainer_merges_it():
    """--weight-sync lora: the replica's merge of the adapter alone (what crosses the object store)
    equals the merged weights the trainer publishes otherwise, for two versions in a row."""
    import torch

    from ocrl import models
    from ocrl.cluster.adapters import Merger, is_adapter, scaling
    from ocrl.config import Config
    from ocrl.engine.base import EngineError
    from ocrl.train.policy import Policy

    config = Config(random_init="tiny", lora_rank=4, lora_alpha=16)
    served = models.load(random_init="tiny", device="cpu", dtype="float32").model
    trained = Policy(config, models.load(random_init="tiny", device="cpu", dtype="float32").model, publish_adapters=True)
    merger = Merger(served, scaling(config))
    for _ in range(2):
        with torch.no_grad():
            for name, p in trained.model.named_parameters():
                if "lora_" in name:
                    p.add_(torch.randn_like(p) * 0.05)
        adapter = trained.published_weights()
        assert is_adapter(adapter) and sum(t.numel() for t in adapter.values()) < sum(p.numel() for p in served.parameters()) / 10
        trained.publish_adapters = False
        expected = trained.published_weights()  # W + scale * B @ A, as the trainer merges
        trained.publish_adapters = True
        merged = merger.merged(adapter)
        assert merged.keys() == expected.keys() and merged
        for name, weight in merged.items():
            torch.testing.assert_close(weight, expected[name], rtol=0, atol=1e-6)
            served.get_parameter(name).data.copy_(weight)  # served as the engine swaps it in
    name = next(iter(adapter))
    with pytest.raises(EngineError, match="only"):
        merger.merged({name: adapter[name]})
    with pytest.raises(EngineError, match="does not have"):
        merger.merged({"base_model.model.nowhere.lora_A.weight": adapter[name], "base_model.model.nowhere.lora_B.weight": adapter[name]})


def test_broadcast_buckets_hold_one_dtype_each_under_the_limit():
    """--weight-sync broadcast: sender and receivers cut the same manifest into the same flat
    buckets: one dtype each, in manifest order, at most the limit unless one tensor is larger."""
    from ocrl.cluster.collective import plan

    manifest = [("a", (4, 4), "float32"), ("b", (8,), "bfloat16"), ("c", (2, 4), "float32"), ("d", (40,), "float32"), ("e", (1,), "float32")]
    # float32: a 64 B, c 32 B, d 160 B, e 4 B; limit 100 B: [a, c] 96 B, [d] alone (over), [e]
    names = [[name for name, _, _ in bucket] for bucket in plan(manifest, limit=100)]
    assert names == [["a", "c"], ["d"], ["e"], ["b"]]
    assert [[name for name, _, _ in bucket] for bucket in plan(manifest)] == [["a", "c", "d", "e"], ["b"]]


def test_weight_sync_broadcast_needs_replicas():
    from ocrl.config import Config, ConfigError
    from ocrl.engine import select

    with pytest.raises(ConfigError, match="needs --replicas"):
        select.adapter_rank(Config(weight_sync="broadcast"), "hf")
    assert select.adapter_rank(Config(weight_sync="broadcast", replicas=2), "hf") == 0


def remote_address() -> str:
    return ray.get_runtime_context().gcs_address


@pytest.fixture(scope="module")
def local_ray():
    import torch

    torch.set_num_threads(1)
    # Ray kills workers when the whole node nears full memory; on a box shared with other work
    # that would be someone else's memory, not the replicas' (read by the raylet ray.init starts)
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, namespace="ocrl")  # two replicas and the trainer
    try:
        yield remote_address()
    finally:
        ray.shutdown()


def cluster_daemon(tmp_path_factory, judge, address: str, *flags: str) -> Daemon:
    return Daemon(
        tmp_path_factory.mktemp("cluster") / "run", "--random-init", "tiny", "--replicas", "2",
        "--ray-address", address, "--threads", "1", "--rollout-batch-size", "4", "--batch-counts", "all",
        "--prm-mode", "generate", "--prm-url", judge.url, "--prm-m", "1", "--train-yield-max", "0", *flags,
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, scripted_judge, local_ray):
    d = cluster_daemon(tmp_path_factory, scripted_judge, local_ray)
    try:
        yield d.start(timeout=400)
    finally:
        d.stop()


def replicas(daemon) -> list[dict]:
    return daemon.stats()["engine"]["replicas"]


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def chat(client, messages, sid: str, **kw):
    return client.chat.completions.create(
        model="m", messages=messages, temperature=0, extra_headers={"X-Session-Id": sid}, **kw
    )


def replica_status(daemon, index: int) -> dict:
    """What the replica actor itself reports (more than the daemon's stats show)."""
    return ray.get(ray.get_actor(f"ocrl-{daemon.port}-replica-{index}", namespace="ocrl").status.remote())


def train_one_step(daemon, prefix: str) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=daemon.url + "/v1", api_key=API_KEY, max_retries=0)
    from test_crash import rows

    recorded = len(rows(daemon.record_dir / "metrics.jsonl"))
    for i in range(5):  # two main turns each, the first judged by the second: a batch of 4 and more
        messages = [{"role": "user", "content": f"question {i}"}]
        r = chat(client, messages, f"{prefix}{i}", max_tokens=4)
        messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "ok [votes: 1]"}]
        chat(client, messages, f"{prefix}{i}", max_tokens=4)
    # the step's metrics row is written last: by then it is published, verified and recorded
    wait_until(lambda: len(rows(daemon.record_dir / "metrics.jsonl")) > recorded, 120, "a training step")
    return daemon.stats()


def test_lora_adapters_reach_every_replica_through_the_object_store(tmp_path_factory, scripted_judge, local_ray):
    """--weight-sync lora: only the adapter crosses the object store; each replica merges it,
    the probe verifies on each, the stats show each one's version; a replica Ray restarts
    reloads the current adapter before it serves. Its own daemon, stopped before the next."""
    from ocrl import models

    daemon = cluster_daemon(tmp_path_factory, scripted_judge, local_ray, "--weight-sync", "lora", "--lora-rank", "4").start(timeout=400)
    try:
        stats = train_one_step(daemon, "l")
        version = stats["weights_version"]
        assert version == stats["training"]["steps"] >= 1 and stats["training"]["last"]["verified"] == 1.0
        wait_until(lambda: all(r["weights_version"] == version for r in replicas(daemon)), 10, "every replica at the version")
        assert all(r["probe_diff"] <= 1e-3 for r in replicas(daemon))  # the probe scored alike on each
        model_bytes = sum(p.numel() * p.element_size() for p in models.load(random_init="tiny", device="cpu", dtype="float32").model.parameters())
        for i in range(2):
            sync = replica_status(daemon, i)["last_sync"]
            assert sync["kind"] == "lora" and 0 < sync["bytes"] < model_bytes / 4, sync  # the adapter alone (rank 4)
        victim = replicas(daemon)[1]
        ray.kill(ray.get_actor(f"ocrl-{daemon.port}-replica-1", namespace="ocrl"), no_restart=False)
        back = wait_until(
            lambda: (r := replicas(daemon)[1])["ready"] and r["incarnation"] != victim["incarnation"] and r, 120, "the replica back"
        )
        assert back["weights_version"] == version
        status = replica_status(daemon, 1)
        assert status["weights_version"] == version and status["last_sync"]["kind"] == "lora"
        steps = daemon.stats()["training"]["steps"]
    finally:
        assert daemon.stop() == 0
    # the trainer actor wrote its last checkpoint before the daemon closed the cluster; --resume
    # restores a new actor from it and republishes its adapter to both new replicas
    assert (daemon.record_dir / "checkpoints" / f"step-{steps}" / "state.json").exists()
    resumed = Daemon(daemon.record_dir, *daemon.flags, "--resume").start(timeout=400)
    try:
        wait_until(lambda: all(r["weights_version"] == version for r in replicas(resumed)), 60, "the adapter republished")
        stats = resumed.stats()
        assert stats["training"]["steps"] == steps and stats["training"]["actor"]["restored_step"] == steps
        assert all(r["probe_diff"] <= 1e-3 for r in replicas(resumed))  # the restored probe verified on each
    finally:
        assert resumed.stop() == 0


def test_a_broadcast_that_loses_a_replica_falls_back_and_the_group_is_rebuilt(local_ray):
    """--weight-sync broadcast, the router in this process (so the test decides when its health
    check runs): a swap goes by gloo broadcast to both replicas; replica 1 is killed and the next
    swap still names it (the router has not looked yet, as when a replica dies mid-swap): the
    broadcast fails, the object store carries that version to the rest (a fallback), the group
    is destroyed; once Ray restarted the replica and it loaded the current version, the next swap
    builds a new group and goes by broadcast to both again. What each replica serves matches the
    weights sent (its next-token log-probs against this process's model under them)."""
    import anyio
    import torch

    from ocrl import models
    from ocrl.cluster.collective import GroupMember
    from ocrl.cluster.router import Cluster
    from ocrl.config import Config

    config = Config(random_init="tiny", replicas=2, weight_sync="broadcast", threads=1, port=30871, ray_address=local_ray)
    loaded = models.load(random_init="tiny", device="cpu", dtype="float32")
    base = {n: p.detach().clone() for n, p in loaded.model.named_parameters()}
    prompt = [5, 6, 7, 8]
    torch.manual_seed(0)

    def version(v: int) -> dict:
        tensors = {n: t + 0.02 * v * torch.randn_like(t) for n, t in base.items()}
        with torch.no_grad():
            for n, t in tensors.items():
                loaded.model.get_parameter(n).copy_(t)
        return tensors

    def expected() -> torch.Tensor:
        with torch.no_grad():
            return loaded.model(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)

    async def scenario():
        cluster = await Cluster.start(config, loaded)
        try:
            sender = ray.remote(GroupMember).options(num_cpus=0).remote()  # the trainer actor's part, alone
            cluster.attach_trainer(sender)

            async def swap(v: int):
                tensors = version(v)
                await sender.hold.remote(tensors)
                await cluster.update_weights(tensors, v)
                return [await s.handle.status.remote() for s in cluster.slots if s.ready]

            statuses = await swap(1)
            sync = cluster.weight_sync_stats()
            assert (sync["broadcasts"], sync["fallbacks"], sync["groups"], sync["members"]) == (1, 0, 1, 2)
            assert [(st["weights_version"], st["last_sync"]["via"]) for st in statuses] == [(1, "broadcast")] * 2
            torch.testing.assert_close(await cluster.next_token_logprobs(prompt), expected(), atol=1e-5, rtol=0)

            ray.kill(cluster.slots[1].handle, no_restart=False)  # the router's health check has not run since
            await swap(2)
            sync = cluster.weight_sync_stats()
            assert sync["fallbacks"] == 1 and sync["broadcasts"] == 1 and sync["members"] == 0 and sync["last_error"]
            assert cluster.slots[0].ready and not cluster.slots[1].ready
            assert (await cluster.slots[0].handle.status.remote())["weights_version"] == 2
            with anyio.fail_after(120):  # Ray restarts it; the health check loads version 2 into it
                while not cluster.slots[1].ready:
                    await anyio.sleep(0.5)
                    await cluster.check()
            assert cluster.slots[1].status["last_sync"]["via"] == "object store"

            statuses = await swap(3)
            sync = cluster.weight_sync_stats()
            assert (sync["broadcasts"], sync["fallbacks"], sync["groups"], sync["members"]) == (2, 1, 2, 2)
            assert [(st["weights_version"], st["last_sync"]["via"], st["group"]) for st in statuses] == [(3, "broadcast", 2)] * 2
            assert await cluster.score(prompt, [9, 10])  # both replicas agree
            torch.testing.assert_close(await cluster.next_token_logprobs(prompt), expected(), atol=1e-5, rtol=0)
        finally:
            cluster.close()

    anyio.run(scenario)


def test_training_steps_reach_every_replica_by_broadcast(tmp_path_factory, scripted_judge, local_ray):
    """--weight-sync broadcast end to end: each step's full weights go from the trainer actor to
    both replicas by the gloo broadcast (the manifest through Ray), the probe verifies on each,
    the stats count the swaps; a replica killed between steps reloads the current version from
    the object store, and the next step builds a new group and reaches both by broadcast again.
    Its own daemon, stopped before the next."""
    daemon = cluster_daemon(tmp_path_factory, scripted_judge, local_ray, "--weight-sync", "broadcast").start(timeout=400)
    try:
        stats = train_one_step(daemon, "b")
        version = stats["weights_version"]
        assert version == stats["training"]["steps"] >= 1 and stats["training"]["last"]["verified"] == 1.0
        wait_until(lambda: all(r["weights_version"] == version for r in replicas(daemon)), 10, "every replica at the version")
        assert all(r["probe_diff"] <= 1e-3 for r in replicas(daemon))
        sync = stats["engine"]["weight_sync"]
        assert (sync["mode"], sync["backend"], sync["broadcasts"], sync["fallbacks"], sync["groups"]) == ("broadcast", "gloo", version, 0, 1)
        for i in range(2):
            last = replica_status(daemon, i)["last_sync"]
            assert (last["kind"], last["via"]) == ("full", "broadcast"), last
        victim = replicas(daemon)[1]
        ray.kill(ray.get_actor(f"ocrl-{daemon.port}-replica-1", namespace="ocrl"), no_restart=False)
        wait_until(lambda: (r := replicas(daemon)[1])["ready"] and r["incarnation"] != victim["incarnation"], 120, "the replica back")
        assert replica_status(daemon, 1)["last_sync"]["via"] == "object store"  # loaded before it was routed to
        stats = train_one_step(daemon, "c")
        version = stats["weights_version"]
        sync = stats["engine"]["weight_sync"]
        assert (sync["broadcasts"], sync["fallbacks"], sync["groups"], sync["members"]) == (version, 0, 2, 2)
        assert stats["training"]["last"]["verified"] == 1.0
        for i in range(2):
            status = replica_status(daemon, i)
            assert (status["weights_version"], status["last_sync"]["via"], status["group"]) == (version, "broadcast", 2)
    finally:
        assert daemon.stop() == 0


def test_a_sessions_turns_stay_on_its_replica_and_new_sessions_spread(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=cluster.url + "/v1", api_key=API_KEY, max_retries=0)
    before = [r["routed"] for r in replicas(cluster)]
    sessions = {sid: [{"role": "user", "content": f"{sid}: " + "tell me about the sea and the sky. " * 6}] for sid in ("sa", "sb")}
    for turn in range(2):
        for sid, messages in sessions.items():
            r = chat(client, messages, sid, max_tokens=6)
            if turn == 1:  # the same replica holds turn 0's prompt and answer in its prefix cache
                assert r.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens // 2, sid
            messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "more [votes: 1]"}]
    routed = [r["routed"] - b for r, b in zip(replicas(cluster), before)]
    assert routed == [2, 2]  # one session each (least load), both turns on it (affinity)


def trainer_actor(daemon):
    return ray.get_actor(f"ocrl-{daemon.port}-trainer", namespace="ocrl")


def test_trained_versions_reach_every_replica_and_verify(cluster):
    stats = train_one_step(cluster, "v")
    version = stats["weights_version"]
    assert version == stats["training"]["steps"] >= 1
    # the steps ran in the trainer's actor, a process of its own, not in the daemon
    actor = ray.get(trainer_actor(cluster).status.remote())
    assert actor["steps"] == stats["training"]["steps"] and actor["pid"] != cluster.proc.pid
    assert stats["training"]["actor"]["up"] and stats["training"]["actor"]["restarts"] == 0
    assert stats["training"]["last"]["verified"] == 1.0  # the probe agreed on every replica
    wait_until(lambda: all(r["weights_version"] == version for r in replicas(cluster)), 10, "every replica at the version")
    assert all(r["probe_diff"] <= 1e-3 for r in replicas(cluster))


def test_a_killed_replica_fails_only_its_requests_and_comes_back_with_the_current_version(cluster):
    import openai
    from openai import OpenAI

    client = OpenAI(base_url=cluster.url + "/v1", api_key=API_KEY, max_retries=0)
    outcome: dict[str, object] = {}

    def long_stream(sid: str) -> None:
        try:
            stream = chat(client, [{"role": "user", "content": f"{sid} go on"}], sid, max_tokens=1500, stream=True)
            for n, _ in enumerate(stream):
                if n == 3:  # tokens are flowing (a request with none yet would be retried elsewhere)
                    outcome[sid + ":flowing"] = time.monotonic()
            outcome[sid] = "finished"
        except openai.APIError as e:
            outcome[sid] = e

    threads = [threading.Thread(target=long_stream, args=(sid,)) for sid in ("ka", "kb")]
    for t in threads:
        t.start()
        wait_until(lambda: sum(r["inflight"] for r in replicas(cluster)) >= 1 + threads.index(t), 30, "the request in flight")
    busy = replicas(cluster)
    assert [r["inflight"] for r in busy] == [1, 1]  # least load: one on each
    victim = busy[0]
    wait_until(lambda: "ka:flowing" in outcome and "kb:flowing" in outcome, 30, "both streams under way")
    ray.kill(ray.get_actor(f"ocrl-{cluster.port}-replica-0", namespace="ocrl"), no_restart=False)
    for t in threads:
        t.join(120)
    failed = [sid for sid in ("ka", "kb") if isinstance(outcome[sid], Exception)]
    assert len(failed) == 1 and [outcome[sid] for sid in ("ka", "kb")].count("finished") == 1, outcome
    assert "replica 0 went away" in str(outcome[failed[0]])
    # Ray restarts it; it loads the current version, then serves again
    back = wait_until(
        lambda: (r := replicas(cluster)[0])["ready"] and r["incarnation"] != victim["incarnation"] and r, 120, "the replica back"
    )
    assert back["weights_version"] == cluster.stats()["weights_version"] and back["pid"] != victim["pid"]
    served_before = [r["routed"] for r in replicas(cluster)]
    for i in range(4):
        chat(client, [{"role": "user", "content": f"after {i}"}], f"after{i}", max_tokens=2)
    assert all(r["routed"] > b for r, b in zip(replicas(cluster), served_before))
    assert httpx.get(cluster.url + "/healthz").status_code == 200


def test_a_replica_killed_mid_traffic_loses_no_sample_and_trains_none_twice(cluster):
    """The crash tests' accounting, in cluster mode with training on: sessions run while the replica
    serving a long stream is killed. Every acknowledged main turn is journaled once and trained at
    most once; each failed request got OpenAI's error shape and left no turn behind (the client
    retries it, as a real one does)."""
    import openai
    from openai import OpenAI
    from test_crash import rows, standing_consumed

    client = OpenAI(base_url=cluster.url + "/v1", api_key=API_KEY, max_retries=0)
    sessions, turns = [f"f{i}" for i in range(6)], 3
    acked: dict[tuple[str, int], int] = {}  # (session, turn index) -> the weights version it was served with
    failures: list[Exception] = []
    flowing = threading.Event()

    def ask(sid: str, messages: list, done: bool, long: bool = False):
        headers = {"X-Session-Id": sid} | ({"X-Session-Done": "1"} if done else {})
        while True:
            try:
                if long:  # streamed, so the test knows its tokens are flowing before the kill
                    long, text = False, ""
                    stream = client.chat.completions.create(
                        model="m", messages=messages, max_tokens=1500, temperature=0, stream=True, extra_headers=headers
                    )
                    for n, chunk in enumerate(stream):
                        if n == 3:
                            flowing.set()
                        text += chunk.choices[0].delta.content or "" if chunk.choices else ""
                        last = chunk
                    return text, last.ocrl
                r = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0, extra_headers=headers)
                return r.choices[0].message.content, r.ocrl
            except openai.APIError as e:
                failures.append(e)  # then retried, as a client does

    def session(sid: str, long: bool = False):
        messages = [{"role": "user", "content": f"{sid}: what is {sid[1:]}+2?"}]
        for turn in range(turns):
            text, ocrl = ask(sid, messages, done=turn == turns - 1, long=long and turn == 0)
            assert ocrl["turn_type"] == "main"
            acked[(sid, ocrl["turn_index"])] = ocrl["weights_version"]
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"next [votes: {1 if turn % 2 else -1}]"}]

    steps_before = cluster.stats()["training"]["steps"]
    threads = [threading.Thread(target=session, args=(sessions[0], True))]
    threads[0].start()
    assert flowing.wait(60), "the long stream never flowed"
    victim = next(r for r in replicas(cluster) if r["inflight"])
    threads += [threading.Thread(target=session, args=(sid,)) for sid in sessions[1:]]
    for t in threads[1:]:
        t.start()
    wait_until(lambda: len(acked) >= 1, 60, "traffic under way")  # soon: the long stream must still be running
    ray.kill(ray.get_actor(f"ocrl-{cluster.port}-replica-{victim['index']}", namespace="ocrl"), no_restart=False)
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads)
    assert len(acked) == len(sessions) * turns
    # the long stream's request failed with a clear error, in OpenAI's shape; so did any other the kill cut
    assert failures and all(isinstance(e, openai.APIError) and "went away" in e.message for e in failures), failures
    for e in failures:
        assert e.body["type"] == "server_error" and set(e.body) >= {"message", "type", "param", "code"}, e.body
    wait_until(lambda: (r := replicas(cluster)[victim["index"]])["ready"] and r["incarnation"] != victim["incarnation"], 120, "the replica back")

    def mine(sample_id: str) -> bool:
        return sample_id.split(":")[0] in sessions

    def accounting() -> dict:
        main = [t for t in rows(cluster.record_dir / "turns.jsonl") if t["turn_type"] == "main" and t["session_id"] in sessions]
        journal = Counter(r["sample_id"] for r in rows(cluster.record_dir / "journal.jsonl") if mine(r["sample_id"]))
        effective = {r["sample_id"] for r in rows(cluster.record_dir / "journal.jsonl") if mine(r["sample_id"]) and any(r["loss_mask"])}
        consumed = [(i, step) for i, step in standing_consumed(cluster.record_dir) if mine(i)]
        return dict(
            main=main, main_ids={f"{t['session_id']}:{t['session_uid']}:{t['index']}" for t in main}, journal=journal,
            effective=effective, trained=Counter(i for i, step in consumed if step is not None),
        )

    def settled() -> bool:
        a = accounting()
        s = cluster.stats()
        return a["main_ids"] <= set(a["journal"]) and s["sessions"]["judging"] == 0 and s["training"]["pending"] < 4 and s["training"]["in_step"] == 0

    wait_until(settled, 180, "every turn journaled and the full batches trained")
    a = accounting()
    # nothing recorded for a failed request: the turns kept are exactly the ones the client was given
    assert {(t["session_id"], t["index"]): t["weights_version"] for t in a["main"]} == acked
    assert a["main_ids"] == set(a["journal"]) and max(a["journal"].values()) == 1  # none missing, none twice
    assert a["trained"] and max(a["trained"].values()) == 1 and set(a["trained"]) <= set(a["journal"])  # none trained twice
    assert cluster.stats()["training"]["steps"] > steps_before
    metrics = rows(cluster.record_dir / "metrics.jsonl")
    assert metrics and all(m["verified"] == 1.0 for m in metrics)  # every swap verified on the replicas that took it
    assert httpx.get(cluster.url + "/healthz").status_code == 200


def test_a_killed_trainer_actor_resumes_from_its_newest_checkpoint(cluster):
    """ray.kill of the trainer actor mid-traffic, one step after its newest checkpoint: Ray
    restarts it, it resumes from that checkpoint (the step count goes on from it), the samples
    of the lost step are trained again once, the replicas' versions never go backwards, and the
    crash tests' accounting holds: every acknowledged main turn journaled once, trained at most
    once, none lost, every swap verified."""
    from openai import OpenAI
    from test_crash import rows, standing_consumed

    saved = httpx.post(cluster.url + "/v1/ocrl/checkpoint", headers={"Authorization": f"Bearer {API_KEY}"}).json()["checkpoint"]
    newest = int(saved.rsplit("-", 1)[1])
    lost = train_one_step(cluster, "u")  # one step past the checkpoint: lost with the actor
    assert lost["training"]["steps"] > newest
    lost_ids = wait_until(lambda: {i for i, step in standing_consumed(cluster.record_dir) if step and step > newest}, 30, "the step recorded")
    victim = lost["training"]["actor"]

    client = OpenAI(base_url=cluster.url + "/v1", api_key=API_KEY, max_retries=0)
    sessions, turns = [f"t{i}" for i in range(4)], 3
    acked: dict[tuple[str, int], int] = {}

    def session(sid: str):
        messages = [{"role": "user", "content": f"{sid}: what is {sid[1:]}+2?"}]
        for turn in range(turns):
            headers = {"X-Session-Id": sid} | ({"X-Session-Done": "1"} if turn == turns - 1 else {})
            r = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0, extra_headers=headers)
            acked[(sid, r.ocrl["turn_index"])] = r.ocrl["weights_version"]
            messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": f"next [votes: {1 if turn % 2 else -1}]"}]

    threads = [threading.Thread(target=session, args=(sid,)) for sid in sessions]
    for t in threads:
        t.start()
    wait_until(lambda: len(acked) >= 2, 60, "traffic under way")
    ray.kill(trainer_actor(cluster), no_restart=False)
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads) and len(acked) == len(sessions) * turns  # serving never stopped
    back = wait_until(lambda: (a := cluster.stats()["training"]["actor"])["restarts"] == 1 and a["up"] and a, 120, "the trainer back")
    assert back["incarnation"] != victim["incarnation"] and back["pid"] != victim["pid"]
    assert back["restored_step"] == newest  # the newest complete checkpoint
    assert {"resumed_at": newest} in rows(cluster.record_dir / "consumed.jsonl")  # the lost step's marks void

    mine = lambda sample_id: sample_id.split(":")[0] in sessions  # noqa: E731  (the u* sessions' last turns stay open)

    def accounting() -> dict:
        main = [t for t in rows(cluster.record_dir / "turns.jsonl") if t["turn_type"] == "main" and mine(t["session_id"])]
        journal = Counter(r["sample_id"] for r in rows(cluster.record_dir / "journal.jsonl") if mine(r["sample_id"]))
        consumed = [(i, step) for i, step in standing_consumed(cluster.record_dir) if mine(i)]
        return dict(
            main_ids={f"{t['session_id']}:{t['session_uid']}:{t['index']}" for t in main}, journal=journal,
            consumed={i for i, _ in consumed}, trained=Counter(i for i, step in consumed if step is not None),
        )

    def settled() -> bool:
        a = accounting()
        s = cluster.stats()
        return a["main_ids"] <= set(a["journal"]) and s["sessions"]["judging"] == 0 and s["training"]["pending"] < 4 and s["training"]["in_step"] == 0

    wait_until(settled, 180, "every turn journaled and the full batches trained")
    stats = cluster.stats()  # first: a sample unconsumed after it was queued or in a step under way by then
    a = accounting()
    assert a["main_ids"] == set(a["journal"]) and max(a["journal"].values()) == 1  # none missing, none twice
    assert len(set(a["journal"]) - a["consumed"]) <= stats["training"]["pending"] + stats["training"]["in_step"]  # the rest waits for its batch
    trained = Counter(i for i, step in standing_consumed(cluster.record_dir) if step is not None)
    assert lost_ids and lost_ids <= set(trained)  # the lost step's samples, trained again
    assert max(trained.values()) == 1  # and none twice into the surviving weights, in the whole run
    # the step count went on from the checkpoint; versions only went up, on every replica
    metrics = rows(cluster.record_dir / "metrics.jsonl")
    restart = next(i for i in range(1, len(metrics)) if metrics[i]["step"] <= metrics[i - 1]["step"])
    after = metrics[restart:]
    assert after[0]["step"] == newest + 1 and after[0]["weights_version"] == metrics[restart - 1]["weights_version"] + 1
    versions = [m["weights_version"] for m in metrics]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert all(m["verified"] == 1.0 for m in metrics)  # every swap verified on the replicas
    assert stats["training"]["steps"] == newest + len(after) and stats["weights_version"] == versions[-1]
    wait_until(lambda: all(r["weights_version"] == versions[-1] for r in replicas(cluster)), 10, "every replica at the version")
    assert set(acked.values()) <= set(versions) | {0}  # every completion names a version that was served

    # killed again while idle: the watch restores it from the newest checkpoint before a step needs it
    saved = httpx.post(cluster.url + "/v1/ocrl/checkpoint", headers={"Authorization": f"Bearer {API_KEY}"}).json()["checkpoint"]
    newest, before = int(saved.rsplit("-", 1)[1]), cluster.stats()["training"]["actor"]
    ray.kill(trainer_actor(cluster), no_restart=False)
    back = wait_until(lambda: (a := cluster.stats()["training"]["actor"])["restarts"] == 2 and a["up"] and a, 120, "the trainer back again")
    assert back["restored_step"] == newest and back["incarnation"] != before["incarnation"]
    stats = train_one_step(cluster, "w")  # and the restored actor trains on, under the next version
    row = rows(cluster.record_dir / "metrics.jsonl")[len(metrics)]  # the first step after the restore
    assert row["step"] == newest + 1 and row["weights_version"] == versions[-1] + 1 and row["verified"] == 1.0
    assert stats["training"]["actor"]["restarts"] == 2
