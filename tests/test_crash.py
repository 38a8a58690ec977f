"""SIGKILL at the worst moments, then `--resume`: every main turn is trained exactly once, still
queued, or excluded by rule; none missing, none twice, and the restored checkpoint is consistent.

The daemon kills itself at a named crash point (`OCRL_CRASH_AT`, see ocrl/faults.py) while the
`openai` client drives sessions through it; the client then carries on against the restarted
daemon as a real one would (retrying the request that failed)."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter

import anyio
import openai
import pytest

from conftest import Daemon

SESSIONS, TURNS, BATCH = 6, 3, 2


def rows(path) -> list:
    out = []
    for line in path.read_bytes().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line torn by the kill
    return out


def standing_consumed(run_dir) -> list[tuple[str, int | None]]:
    """consumed.jsonl as it counts: rows of steps after a `resumed_at` marker's step are void."""
    standing = []
    for row in rows(run_dir / "consumed.jsonl"):
        if isinstance(row, dict):
            standing = [(i, s) for i, s in standing if s is None or s <= row["resumed_at"]]
        else:
            standing.append((row[0], row[1]))  # a third item says which rule excluded it (too_long)
    return standing


class Client:
    """SESSIONS sessions of TURNS main turns; each next state votes +1 or -1 (one vote)."""

    def __init__(self):
        self.messages = {f"c{i}": [{"role": "user", "content": f"What is {i}+2?"}] for i in range(SESSIONS)}
        self.turn = Counter()

    @property
    def finished(self) -> bool:
        return all(self.turn[s] == TURNS for s in self.messages)

    async def drive(self, daemon: Daemon) -> None:
        """Sends what is left of every session, concurrently, until done or the daemon is gone."""
        async with daemon.client(timeout=120) as client:

            async def session(sid: str) -> None:
                while self.turn[sid] < TURNS:
                    done = self.turn[sid] == TURNS - 1
                    headers = {"X-Session-Id": sid} | ({"X-Session-Done": "1"} if done else {})
                    try:
                        r = await client.chat.completions.create(
                            model="m", messages=self.messages[sid], max_tokens=4, temperature=0, extra_headers=headers
                        )
                    except (openai.APIConnectionError, openai.APITimeoutError):
                        return  # the daemon died under us; this request is retried after the restart
                    self.turn[sid] += 1
                    if not done:
                        vote = 1 if (int(sid[1:]) + self.turn[sid]) % 2 else -1
                        self.messages[sid] += [
                            {"role": "assistant", "content": r.choices[0].message.content},
                            {"role": "user", "content": f"next [votes: {vote}]"},
                        ]

            async with anyio.create_task_group() as tg:
                for sid in self.messages:
                    tg.start_soon(session, sid)


def accounting(run_dir) -> dict:
    main_ids = {f"{t['session_id']}:{t['session_uid']}:{t['index']}" for t in rows(run_dir / "turns.jsonl") if t["turn_type"] == "main"}
    journal = [r for r in rows(run_dir / "journal.jsonl")]
    journal_ids = Counter(r["sample_id"] for r in journal)
    effective = {r["sample_id"] for r in journal if any(r["loss_mask"])}
    trained = Counter(i for i, step in standing_consumed(run_dir) if step is not None)
    excluded = {i for i, step in standing_consumed(run_dir) if step is None}
    return dict(main_ids=main_ids, journal_ids=journal_ids, effective=effective, trained=trained, excluded=excluded)


async def wait_for(predicate, timeout: float):
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.2)


@pytest.mark.parametrize("point", ["judging:3", "train_step:2", "swap:2", "checkpoint:2"])
async def test_sigkill_at_a_crash_point_then_resume_accounts_for_every_turn(tmp_path, scripted_judge, point):
    run_dir = tmp_path / "run"
    flags = [
        "--threads", "1", "--rollout-batch-size", str(BATCH), "--save-interval", "1", "--lr", "1e-4",
        "--prm-mode", "generate", "--prm-url", scripted_judge.url, "--prm-m", "1", "--train-yield-max", "0",
    ]
    client = Client()
    first = Daemon(run_dir, *flags, env={"OCRL_CRASH_AT": point}).start()
    try:
        await client.drive(first)
        deadline = time.monotonic() + 300
        while first.proc.poll() is None and time.monotonic() < deadline:
            await anyio.sleep(0.2)
        assert first.proc.returncode == -signal.SIGKILL, f"the daemon did not die at {point}"
    finally:
        first.stop(signal.SIGKILL)
    crashed = accounting(run_dir)
    assert crashed["main_ids"], "the crash came before any turn was served"

    second = Daemon(run_dir, *flags, "--resume").start()
    try:
        checkpoints = sorted((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
        # the newest complete checkpoint is what trains and serves now
        state = json.loads((checkpoints[-1] / "state.json").read_text()) if checkpoints else {"step": 0, "weights_version": 0}
        at_start = second.stats()
        assert at_start["training"]["steps"] == state["step"]
        # what the crash left for the restart to do
        if point.startswith("judging"):
            assert at_start["samples"]["restored_at_start"]["rejudged"] >= 1  # votes that were in flight
        elif point.startswith(("train_step", "swap")):
            assert at_start["samples"]["journal_backlog_at_start"] >= BATCH  # the batch of the killed step
        else:
            assert {"resumed_at": 1} in rows(run_dir / "consumed.jsonl")  # step 2 was consumed, its checkpoint lost
        await wait_for(lambda: second.stats()["weights_version"] == state["weights_version"], timeout=60)
        await client.drive(second)
        assert client.finished

        def settled() -> bool:
            a = accounting(run_dir)
            untrained = a["effective"] - set(a["trained"])
            return a["main_ids"] <= set(a["journal_ids"]) and len(untrained) < BATCH and second.stats()["sessions"]["judging"] == 0

        await wait_for(settled, timeout=600)
    finally:
        assert second.stop() == 0
    a = accounting(run_dir)
    assert len(a["main_ids"]) >= SESSIONS * TURNS
    assert a["main_ids"] == set(a["journal_ids"])  # none missing: every main turn has its sample
    assert max(a["journal_ids"].values()) == 1  # and only one
    assert max(a["trained"].values()) == 1  # none trained twice into the surviving weights
    assert set(a["trained"]) <= a["effective"] and a["excluded"].isdisjoint(a["effective"])
    queued = a["effective"] - set(a["trained"])
    assert len(queued) < BATCH  # what is left waits for the next batch (still in the journal)
    assert a["excluded"] | set(a["trained"]) | queued == set(a["journal_ids"])
    metrics = rows(run_dir / "metrics.jsonl")
    assert metrics and all(m["verified"] == 1.0 for m in metrics)
    assert not list((run_dir / "checkpoints").glob(".step-*.tmp"))  # staging of a killed save is gone
