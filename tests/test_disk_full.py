"""A full disk loses nothing and stops nothing else: every record append is whole or absent, a
torn tail is cut when the file is opened, a full record dir refuses new main turns with a 503
and Retry-After while side turns and health answer, the trainer waits instead of stepping on
samples it could not mark, and everything goes on by itself once space returns.

The disk is filled by a fault-injected writer (`records._write`: short writes, then ENOSPC),
in-process for the record files and through `OCRL_DISK_FULL_IF` for the daemon."""

from __future__ import annotations

import errno
import json
import os

import anyio
import httpx
import msgspec
import pytest

from ocrl import jsonl
from ocrl.jsonl import DiskFull
from ocrl.records import Records
from ocrl.types import Sample


def sample(i: int, mask: int = 1) -> Sample:
    return Sample(
        sample_id=f"s:{i}", session_id="s", turn_index=i, tokens=[1, 2, 3, 4 + i], response_length=2,
        loss_mask=[mask, mask], rollout_logprobs=[-0.5, -0.25], reward=1.0, weights_version=0, score=1,
    )


def lines(path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def test_short_writes_still_append_whole_rows(tmp_path, monkeypatch):
    # write(2) on a nearly full disk takes a few bytes at a time: every row must still land whole
    monkeypatch.setattr(jsonl, "_write", lambda fd, data: os.write(fd, data[:7]))
    records = Records(tmp_path)
    for i in range(5):
        records.journal(sample(i))
    records.close()
    assert [s.sample_id for s in Records(tmp_path).backlog()] == [f"s:{i}" for i in range(5)]
    assert all(line.endswith(b"\n") for line in lines(tmp_path / "journal.jsonl"))


def test_enospc_mid_row_leaves_no_torn_row_and_says_so(tmp_path, monkeypatch):
    records = Records(tmp_path)
    records.journal(sample(0))
    before = (tmp_path / "journal.jsonl").read_bytes()

    room = [30]  # bytes left on the disk: part of the row goes in, then ENOSPC

    def full(fd, data):
        if room[0] == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = os.write(fd, data[: room[0]])
        room[0] -= n
        return n

    monkeypatch.setattr(jsonl, "_write", full)
    with pytest.raises(DiskFull):
        records.journal(sample(1))
    assert records.full
    assert (tmp_path / "journal.jsonl").read_bytes() == before  # cut back to where it was
    records.metric({"step": 1})  # a report row is dropped and counted, never raised
    assert records.dropped_rows == 1
    assert not records.recover()  # still full

    monkeypatch.setattr(jsonl, "_write", os.write)  # space returns
    assert records.recover() and not records.full
    records.journal(sample(1))
    records.close()
    assert [s.sample_id for s in Records(tmp_path).backlog()] == ["s:0", "s:1"]


def test_a_torn_tail_is_cut_on_open_so_the_next_row_survives(tmp_path):
    records = Records(tmp_path)
    records.journal(sample(0))
    records.close()
    with open(tmp_path / "journal.jsonl", "ab") as f:  # the process died mid-row
        f.write(msgspec.json.encode(sample(1))[:40])
    records = Records(tmp_path)  # --resume
    records.journal(sample(2))
    records.close()
    # before: sample 2 was glued onto the torn line and lost with it
    assert [s.sample_id for s in Records(tmp_path).backlog()] == ["s:0", "s:2"]


def test_consumed_marks_are_owed_then_written_in_order(tmp_path, monkeypatch):
    records = Records(tmp_path)
    records.journal(sample(0))
    records.journal(sample(1))
    monkeypatch.setattr(jsonl, "_write", lambda fd, data: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    records.consumed(["s:0"], step=1)  # the step happened; its mark must not be lost
    assert records.full and records.owed_consumed == 1
    assert records.consumed_ids() == set()
    monkeypatch.setattr(jsonl, "_write", os.write)
    assert records.recover()
    assert records.owed_consumed == 0 and records.consumed_ids() == {"s:0"}
    assert [s.sample_id for s in records.backlog()] == ["s:1"]


def test_main_turns_wait_side_turns_go_on(tmp_path, monkeypatch):
    """Sessions: with the records full a main turn is refused before it counts (nothing
    changes), a side turn is served, and the same main turn is taken once space returns."""
    from ocrl.sessions import Sessions
    from ocrl.types import Completion, Message, Verdict

    submitted = []

    async def judge(response, next_state, role):
        return Verdict(score=1, votes=[])

    records = Records(tmp_path)
    sessions = Sessions(judge=judge, submit=submitted.append, records=records)
    completion = Completion(prompt_ids=[1, 2], response_ids=[3], logprobs=[-0.1], text="hi", finish_reason="stop", weights_version=0)
    messages = [Message(role="user", content="hello")]
    ticket = sessions.begin(session_id="a", turn_type="main", session_done=False, messages=messages)
    monkeypatch.setattr(jsonl, "_write", lambda fd, data: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(DiskFull):
        sessions.complete(ticket, completion)  # generated, but cannot be kept: not a turn
    assert sessions.sessions["a"].turns == [] and records.full
    with pytest.raises(DiskFull):
        sessions.begin(session_id="a", turn_type="main", session_done=False, messages=messages)
    side = sessions.begin(session_id="a", turn_type="side", session_done=False, messages=messages)
    assert sessions.complete(side, completion).turn_type == "side"
    monkeypatch.setattr(jsonl, "_write", os.write)
    assert records.recover()
    ticket = sessions.begin(session_id="a", turn_type="main", session_done=False, messages=messages)
    assert sessions.complete(ticket, completion).index == 0
    records.close()
    assert [t.index for t in Records(tmp_path).main_turns()] == [0]


async def test_daemon_on_a_full_disk_refuses_main_turns_pauses_training_and_recovers(tmp_path, scripted_judge):
    from conftest import Daemon

    flag = tmp_path / "disk-full"
    run_dir = tmp_path / "run"
    d = Daemon(
        run_dir, "--threads", "1", "--rollout-batch-size", "2", "--save-interval", "1", "--prm-mode", "generate",
        "--prm-url", scripted_judge.url, "--prm-m", "1", "--train-yield-max", "0", "--max-batch-size", "8",
        env={"OCRL_DISK_FULL_IF": str(flag)},
    ).start()
    headers = {"Authorization": f"Bearer {d.api_key}", "Content-Type": "application/json"}
    acknowledged = set()

    async def turn(client, sid: str, messages: list, turn_type: str = "main", done: bool = False) -> httpx.Response:
        body = {"messages": messages, "max_tokens": 3, "temperature": 0, "session_id": sid, "turn_type": turn_type, "session_done": done}
        reply = await client.post(d.url + "/v1/chat/completions", json=body, headers=headers)
        if reply.status_code == 200 and turn_type == "main":
            acknowledged.add((sid, reply.json()["ocrl"]["turn_index"]))
        return reply

    def history(i: int, n: int) -> list:
        out = [{"role": "user", "content": f"What is {i}+{n}?"}]
        for k in range(n):
            out += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"next {k} [votes: 1]"}]
        return out

    try:
        async with httpx.AsyncClient(timeout=120) as client:
            # 1. a0, a1: turn 0 closed by turn 1 (+1 each: the first step); b0, b1: one open turn each
            for sid in ("a0", "a1"):
                for n in range(2):
                    assert (await turn(client, sid, history(int(sid[1]), n))).status_code == 200
            for sid in ("b0", "b1"):
                assert (await turn(client, sid, history(5, 0))).status_code == 200
            await wait_for(lambda: d.stats()["training"]["steps"] >= 1, 120)
            flag.touch()  # 2. the disk fills
            refused = await turn(client, "a0", history(0, 2))  # its next state cannot be kept
            assert refused.status_code == 503, refused.text
            assert int(refused.headers["Retry-After"]) > 0 and refused.json()["error"]["code"] == "storage_full"
            assert (await turn(client, "a1", history(1, 2))).status_code == 503  # refused up front now
            for sid in ("b0", "b1"):  # side turns are served; ending b's sessions yields samples the journal cannot take
                assert (await turn(client, sid, history(5, 1), "side", done=True)).status_code == 200
            assert (await client.get(d.url + "/healthz")).status_code == 200
            stats = d.stats()
            assert stats["storage"]["full"] and stats["storage"]["unjournaled_samples"] == 2
            assert stats["training"]["steps"] == 1 and stats["training"]["pending"] == 0  # nothing unjournaled reaches the trainer
            flag.unlink()  # 3. space returns: the held samples are journaled and trained, main turns are taken again
            await wait_for(lambda: not d.stats()["storage"]["full"] and d.stats()["storage"]["unjournaled_samples"] == 0, 30)
            for sid in ("a0", "a1"):
                assert (await turn(client, sid, history(int(sid[1]), 2), done=True)).status_code == 200
            await wait_for(lambda: d.stats()["training"]["steps"] >= 3 and d.stats()["sessions"]["judging"] == 0, 180)
    finally:
        assert d.stop() == 0
    turns = [json.loads(line) for line in (run_dir / "turns.jsonl").read_bytes().splitlines()]
    mains = {(t["session_id"], t["index"]) for t in turns if t["turn_type"] == "main"}
    assert mains == acknowledged and len(mains) == 8  # every acknowledged main turn kept, no refused one
    journal = [json.loads(line) for line in (run_dir / "journal.jsonl").read_bytes().splitlines()]
    ids = [r["sample_id"] for r in journal]
    assert len(ids) == len(set(ids)) == 8  # each turn's sample exactly once
    consumed = [json.loads(line) for line in (run_dir / "consumed.jsonl").read_bytes().splitlines()]
    trained = [row[0] for row in consumed if row[1] is not None]
    assert len(trained) == len(set(trained)) == 6  # three steps of two, none twice
    assert len([row for row in consumed if row[1] is None]) == 2  # a's last turns: excluded by rule
    assert not list((run_dir / "checkpoints").glob(".step-*.tmp"))


async def wait_for(predicate, timeout: float):
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.2)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs (root with mount rights only; skipped elsewhere): a real full disk."""
    import shutil
    import subprocess

    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_real_full_tmpfs_keeps_every_journal_row_whole(small_tmpfs):
    filler = small_tmpfs / "filler"
    filler.write_bytes(b"\0" * (1024 * 1024 - 100 * 1024))  # ~100 KB left, as the reproduction
    records = Records(small_tmpfs / "run")
    big = lambda i: msgspec.structs.replace(sample(i), tokens=list(range(3000)))  # ~15 KB a row  # noqa: E731
    written = 0
    with pytest.raises(DiskFull):
        for i in range(1000):
            records.journal(big(i))
            written += 1
    assert 0 < written < 1000 and records.full
    filler.unlink()  # space returns
    try:
        assert records.recover(headroom=64 * 1024)  # (the daemon asks for 1 MiB: this disk is 1 MiB)
        records.journal(big(written))
    finally:
        records.close()
    journal = (small_tmpfs / "run" / "journal.jsonl").read_bytes()
    assert journal.endswith(b"\n")
    assert [s.sample_id for s in Records(small_tmpfs / "run").backlog()] == [f"s:{i}" for i in range(written + 1)]


async def test_a_checkpoint_that_hits_a_full_disk_leaves_no_staging_and_the_previous_stands(tmp_path, monkeypatch):
    from test_trainer import base as _base_fixture  # noqa: F401
    from test_trainer import make_config, make_engine, make_samples
    from transformers import LlamaConfig, LlamaForCausalLM

    from ocrl.train.checkpoint import checkpoints
    from ocrl.train.trainer import Trainer

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128)).eval()
    trainer = Trainer(make_config(tmp_path, rollout_batch_size=2), model, engine=make_engine(model))
    await trainer.step(make_samples(model, 2))
    first = await trainer.save_checkpoint()
    await trainer.step(make_samples(model, 2, seed=1))

    def full(obj, path):  # the optimizer state does not fit (before: the error escaped, the staging dir stayed)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("ocrl.train.checkpoint._save_private", full)
    assert await trainer.save_checkpoint() is None
    assert checkpoints(tmp_path / "checkpoints") == [first]
    assert not list((tmp_path / "checkpoints").glob(".step-*"))
    monkeypatch.undo()
    assert (await trainer.save_checkpoint()).name == "step-2"  # space returned: saved as usual
