"""What stays on disk: checkpoints only their owner can read, --no-record-text without tool
schemas or a probe conversation, and --retain-samples deleting the token ids (which decode to
the conversation) of samples a checkpoint covers."""

from __future__ import annotations

import json
import os
import stat

import torch

from ocrl.records import Records
from ocrl.train.trainer import Trainer
from ocrl.types import Sample, Turn
from test_trainer import base, make_config, make_engine, make_samples  # noqa: F401  (base is a fixture)

torch.set_num_threads(1)


def _modes(root) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


async def test_checkpoints_are_private_whatever_the_umask(base, tmp_path):  # noqa: F811
    old = os.umask(0o022)  # before: dirs 0755, files 0644 (README promised 0600)
    try:
        trainer = Trainer(make_config(tmp_path, rollout_batch_size=2), base, engine=make_engine(base))
        await trainer.step(make_samples(base, 2))
        path = await trainer.save_checkpoint()
    finally:
        os.umask(old)
    modes = _modes(tmp_path / "checkpoints")
    assert path is not None and len(modes) >= 4
    for name, mode in modes.items():
        is_dir = (tmp_path / "checkpoints" / name).is_dir()
        assert mode == (0o700 if is_dir else 0o600), (name, oct(mode))
    assert json.loads((path / "state.json").read_text())["probe"]  # kept when text is recorded (to verify after --resume)


async def test_no_record_text_keeps_no_probe_conversation_in_the_checkpoint(base, tmp_path):  # noqa: F811
    trainer = Trainer(make_config(tmp_path, rollout_batch_size=2, no_record_text=True), base, engine=make_engine(base))
    await trainer.step(make_samples(base, 2))
    path = await trainer.save_checkpoint()
    assert json.loads((path / "state.json").read_text())["probe"] is None


def _turn(session: str, index: int, turn_type: str = "main") -> Turn:
    return Turn(
        session_id=session, index=index, turn_type=turn_type, messages=[], prompt_ids=[5, 6, 7], response_ids=[8, 9],
        logprobs=[-0.1, -0.2], response_text="hi", finish_reason="stop", weights_version=0, session_uid="u" if turn_type == "main" else "",
        tools=[{"type": "function", "function": {"name": "secret_tool", "parameters": {"type": "object"}}}],
    )


def _sample(session: str, index: int) -> Sample:
    return Sample(
        sample_id=f"{session}:u:{index}", session_id=session, turn_index=index, tokens=[5, 6, 7, 8, 9], response_length=2,
        loss_mask=[1, 1], rollout_logprobs=[-0.1, -0.2], reward=1.0, weights_version=0, score=1,
    )


def test_no_record_text_drops_tool_schemas_and_side_turn_ids(tmp_path):
    records = Records(tmp_path, record_text=False)
    records.turn(_turn("a", 0))
    records.turn(_turn("a", -1, "side"))
    records.close()
    raw = (tmp_path / "turns.jsonl").read_text()
    assert "secret_tool" not in raw  # before: tools were kept verbatim
    main, side = [json.loads(line) for line in raw.splitlines()]
    assert main["prompt_ids"] == [5, 6, 7]  # a main turn's ids are what training needs
    assert side["prompt_ids"] == [] and side["response_ids"] == []  # a side turn is never trained


def test_retain_samples_forgets_the_token_ids_a_checkpoint_covers(tmp_path):
    records = Records(tmp_path)
    for i, session in enumerate("abcde"):
        records.turn(_turn(session, 0))
        records.sample(_sample(session, 0))
        records.journal(_sample(session, 0))
    records.consumed(["a:u:0", "b:u:0"], step=1)
    records.consumed(["c:u:0"], step=None)  # excluded by rule
    records.consumed(["d:u:0"], step=2)  # not covered by the checkpoint of step 1
    assert records.forget_token_ids(through_step=1, keep=1) == 2  # a, b, c covered; the newest (c) kept
    records.journal(_sample("f", 0))  # appending goes on after the rewrite
    records.close()

    def tokens(name: str, key: str, id_of) -> dict:
        return {id_of(row): row[key] for row in map(json.loads, (tmp_path / name).read_text().splitlines())}

    journal = tokens("journal.jsonl", "tokens", lambda r: r["sample_id"])
    assert journal == {"a:u:0": [], "b:u:0": [], "c:u:0": [5, 6, 7, 8, 9], "d:u:0": [5, 6, 7, 8, 9], "e:u:0": [5, 6, 7, 8, 9], "f:u:0": [5, 6, 7, 8, 9]}
    assert tokens("samples.jsonl", "tokens", lambda r: r["sample_id"])["a:u:0"] == []
    turns = tokens("turns.jsonl", "response_ids", lambda r: r["session_id"])
    assert turns == {"a": [], "b": [], "c": [8, 9], "d": [8, 9], "e": [8, 9]}
    reopened = Records(tmp_path)
    assert [s.sample_id for s in reopened.backlog()] == ["e:u:0", "f:u:0"]  # what training still needs is whole
    assert reopened.backlog()[0].tokens == [5, 6, 7, 8, 9]
    assert reopened.forget_token_ids(through_step=2, keep=0) == 4  # a, b again (idempotent), c, d
    assert all(os.stat(tmp_path / name).st_mode & 0o077 == 0 for name in ("journal.jsonl", "samples.jsonl", "turns.jsonl"))


async def test_the_trainer_forgets_after_the_checkpoint_that_covers_them(base, tmp_path):  # noqa: F811
    records = Records(tmp_path / "run")
    samples = make_samples(base, 4)
    for sample in samples:
        records.journal(sample)
    trainer = Trainer(make_config(None, rollout_batch_size=2, retain_samples=0), base, engine=make_engine(base), records=records)
    await trainer.step(samples[:2])
    journal = lambda: {r["sample_id"]: r["tokens"] for r in map(json.loads, (tmp_path / "run" / "journal.jsonl").read_text().splitlines())}  # noqa: E731
    assert all(journal().values())  # trained, but no checkpoint covers them yet: kept
    await trainer.save_checkpoint()
    assert [bool(t) for t in journal().values()] == [False, False, True, True]
