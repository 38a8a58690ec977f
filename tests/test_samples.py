"""Sessions -> PRM votes -> samples through the real HTTP API, the real `openai` client, the
embedded model, and a scripted judge endpoint (generate mode over --prm-url, m=3)."""

from __future__ import annotations

import signal

import anyio
import msgspec

from conftest import Daemon

SHORT = dict(model="m", temperature=0, max_tokens=4)


def read_jsonl(path) -> list[dict]:
    return [msgspec.json.decode(line) for line in path.read_bytes().splitlines()] if path.exists() else []


def samples_of(daemon, session_id: str | None = None) -> list[dict]:
    rows = read_jsonl(daemon.record_dir / "samples.jsonl")
    return [r for r in rows if session_id is None or r["session_id"] == session_id]


async def wait_for(predicate, timeout: float = 120):
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.1)


async def chat(client, messages, session, done=False, turn_type=None):
    headers = {"X-Session-Id": session}
    if done:
        headers["X-Session-Done"] = "1"
    if turn_type:
        headers["X-Turn-Type"] = turn_type
    return await client.chat.completions.create(messages=messages, extra_headers=headers, **SHORT)


async def run_session(client, session: str, next_states: list[str]) -> list:
    """One user turn, then one turn per next state; the last request ends the session."""
    messages = [{"role": "user", "content": "What is 2+3?"}]
    replies = []
    for i in range(len(next_states) + 1):
        done = i == len(next_states)
        reply = await chat(client, messages, session, done=done)
        replies.append(reply)
        if not done:
            messages = messages + [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": next_states[i]}]
    return replies


async def test_three_turn_session_with_majority_tie_and_unparseable(judged_daemon):
    async with judged_daemon.client() as client:
        replies = await run_session(client, "maj", ["good [votes: 1,1,-1]", "meh [votes: 1,-1,x]"])
    await wait_for(lambda: len(samples_of(judged_daemon, "maj")) == 3)
    samples = sorted(samples_of(judged_daemon, "maj"), key=lambda s: s["turn_index"])
    assert [s["score"] for s in samples] == [1, 0, None]  # majority 1; tie 1/-1/unparseable -> 0; no next state
    assert [s["loss_mask"][0] for s in samples] == [1, 0, 0]
    assert [len(s["votes"]) for s in samples] == [3, 3, 0]
    assert sorted(v["score"] is None for v in samples[1]["votes"]) == [False, False, True]
    # the sample holds exactly what the engine returned for that completion
    for sample, reply in zip(samples, replies):
        ids = reply.model_extra["ocrl"]["completion_token_ids"]
        assert sample["tokens"][-sample["response_length"] :] == ids
        assert sample["response_length"] == len(sample["rollout_logprobs"]) == len(ids)
    verdicts = [v for v in read_jsonl(judged_daemon.record_dir / "verdicts.jsonl") if v["session_id"] == "maj"]
    assert sorted(v["score"] for v in verdicts) == [0, 1]
    assert all(len(v["votes"]) == 3 and v["votes"][0]["text"] for v in verdicts)


async def test_logprobs_in_the_sample_are_those_served(judged_daemon):
    async with judged_daemon.client() as client:
        reply = await client.chat.completions.create(
            messages=[{"role": "user", "content": "Say a colour."}], extra_headers={"X-Session-Id": "lp", "X-Session-Done": "1"},
            logprobs=True, model="m", temperature=0.8, max_tokens=6, seed=3,
        )
    await wait_for(lambda: samples_of(judged_daemon, "lp"))
    [sample] = samples_of(judged_daemon, "lp")
    assert sample["rollout_logprobs"] == [e.logprob for e in reply.choices[0].logprobs.content]
    assert sample["loss_mask"] == [1] * sample["response_length"]  # the only main turn


async def test_unparseable_votes_give_zero_and_all_zero_session_promotes_one(judged_daemon):
    async with judged_daemon.client() as client:
        await run_session(client, "zeros", ["[votes: x,x,x]", "[votes: 0,0,0]", "[votes: x,0,x]"])
    await wait_for(lambda: len(samples_of(judged_daemon, "zeros")) == 4)
    samples = samples_of(judged_daemon, "zeros")
    assert all(s["score"] in (0, None) for s in samples)
    assert sum(s["promoted"] for s in samples) == 1
    assert sum(1 in s["loss_mask"] for s in samples) == 1


async def test_side_turns_yield_no_samples(judged_daemon):
    async with judged_daemon.client() as client:
        await chat(client, [{"role": "user", "content": "probe"}], "side-only", turn_type="side")
        await chat(client, [{"role": "user", "content": "probe 2"}], "side-only", turn_type="side", done=True)
    await anyio.sleep(0.5)
    assert samples_of(judged_daemon, "side-only") == []
    turns = [t for t in read_jsonl(judged_daemon.record_dir / "turns.jsonl") if t["session_id"] == "side-only"]
    assert [t["turn_type"] for t in turns] == ["side", "side"]


async def test_interleaved_headerless_clients_thread_into_two_sessions(judged_daemon):
    async with judged_daemon.client() as client:
        a = [{"role": "user", "content": "Tell me about cats."}]
        b = [{"role": "user", "content": "Tell me about dogs."}]
        ra = await client.chat.completions.create(messages=a, **SHORT)
        rb = await client.chat.completions.create(messages=b, **SHORT)
        a += [{"role": "assistant", "content": ra.choices[0].message.content}, {"role": "user", "content": "thanks [votes: 1,1,1]"}]
        b += [{"role": "assistant", "content": rb.choices[0].message.content}, {"role": "user", "content": "wrong [votes: -1,-1,-1]"}]
        rb2 = await client.chat.completions.create(messages=b, **SHORT)
        ra2 = await client.chat.completions.create(messages=a, **SHORT)
    sa, sb = ra.model_extra["ocrl"]["session_id"], rb.model_extra["ocrl"]["session_id"]
    assert sa != sb
    assert ra2.model_extra["ocrl"]["session_id"] == sa and rb2.model_extra["ocrl"]["session_id"] == sb
    await wait_for(lambda: samples_of(judged_daemon, sa) and samples_of(judged_daemon, sb))
    assert samples_of(judged_daemon, sa)[0]["score"] == 1
    assert samples_of(judged_daemon, sb)[0]["score"] == -1


async def test_body_session_fields_work_and_are_not_forwarded(judged_daemon):
    async with judged_daemon.client() as client:
        with_fields = await client.chat.completions.create(
            messages=[{"role": "user", "content": "What is 2+3?"}], extra_body={"session_id": "body", "turn_type": "main", "session_done": True}, **SHORT
        )
        plain = await client.chat.completions.create(messages=[{"role": "user", "content": "What is 2+3?"}], **SHORT)
    assert with_fields.model_extra["ocrl"]["session_id"] == "body"
    assert with_fields.usage.prompt_tokens == plain.usage.prompt_tokens  # the fields never reach the prompt
    await wait_for(lambda: samples_of(judged_daemon, "body"))


async def test_load_fifty_sessions_of_four_turns(judged_daemon):
    before = judged_daemon.stats()["sessions"]
    n_before = len(samples_of(judged_daemon))

    async def session(i, client):
        await run_session(client, f"load-{i}", ["thanks [votes: 1,1,1]", "wrong [votes: -1,-1,-1]", "ok [votes: 0,0,0]"])

    async with judged_daemon.client(timeout=600) as client:
        async with anyio.create_task_group() as tg:
            for i in range(50):
                tg.start_soon(session, i, client)
    await wait_for(lambda: len(samples_of(judged_daemon)) - n_before == 200, timeout=300)
    rows = [s for s in samples_of(judged_daemon) if s["session_id"].startswith("load-")]
    assert len(rows) == len({s["sample_id"] for s in rows}) == 200
    assert sorted({s["session_id"] for s in rows}) == sorted(f"load-{i}" for i in range(50))
    stats = judged_daemon.stats()["sessions"]
    assert stats["main_turns"] - before.get("main_turns", 0) == 200
    made = lambda st: st.get("samples_mask1", 0) + st.get("samples_mask0", 0)
    assert made(stats) - made(before) == 200
    assert stats["samples_mask1"] - before.get("samples_mask1", 0) == 100  # +1 and -1 turns
    assert stats["judging"] == 0


async def test_sigkill_after_journaling_requeues_samples_none_twice(tmp_path):
    run_dir = tmp_path / "run"
    first = Daemon(run_dir, "--no-train", "--threads", "1").start()
    try:
        async with first.client() as client:
            for i in range(3):
                await chat(client, [{"role": "user", "content": f"Hi {i}"}], f"k{i}", done=True)
        await wait_for(lambda: len(read_jsonl(run_dir / "journal.jsonl")) == 3)
    finally:
        first.stop(signal.SIGKILL)
    journaled = {r["sample_id"] for r in read_jsonl(run_dir / "journal.jsonl")}
    assert len(journaled) == 3 and not (run_dir / "consumed.jsonl").read_bytes()
    # restart on the same run dir, now training in batches of 3: the backlog is trained once
    second = Daemon(run_dir, "--threads", "1", "--rollout-batch-size", "3", "--save-interval", "0").start()
    try:
        assert second.stats()["samples"]["journal_backlog_at_start"] == 3
        await wait_for(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 1, timeout=300)
        consumed = [row[0] for row in read_jsonl(run_dir / "consumed.jsonl")]  # [sample id, step]
        assert sorted(consumed) == sorted(journaled)  # each exactly once
        assert read_jsonl(run_dir / "metrics.jsonl")[0]["samples"] == 3
    finally:
        assert second.stop() == 0


async def test_a_thinking_judge_scores_past_the_old_budget_and_a_truncated_vote_is_counted(judged_daemon):
    # The scripted judge thinks 1500 tokens before its box: three times the old 512-token budget,
    # well inside the reference's 4096 (the default now). Thinking returned apart by a reasoning
    # parser scores too. A vote that needs 5000 tokens is cut at 4096: no vote, counted as truncated
    # in the stats, in verdicts.jsonl and on each vote.
    before = judged_daemon.stats()["sessions"].get("votes_truncated", 0)
    async with judged_daemon.client() as client:
        await run_session(client, "think", ["thanks [votes: 1,1,1] [think: 1500]", "fix it [votes: -1,-1,-1] [think: 1500 split]",
                                            "ok [votes: 1,1,1] [think: 5000]"])
    await wait_for(lambda: len(samples_of(judged_daemon, "think")) == 4)
    samples = sorted(samples_of(judged_daemon, "think"), key=lambda s: s["turn_index"])
    assert [s["score"] for s in samples] == [1, -1, 0, None]
    assert [v["score"] for v in samples[1]["votes"]] == [-1, -1, -1]
    assert samples[1]["votes"][0]["text"].startswith("<think>hmm")  # the thinking stays in the record
    assert [v["truncated"] for v in samples[2]["votes"]] == [True, True, True]
    assert all(v["score"] is None and v["text"].startswith("<think>") for v in samples[2]["votes"])
    verdicts = sorted((v for v in read_jsonl(judged_daemon.record_dir / "verdicts.jsonl") if v["session_id"] == "think"),
                      key=lambda v: v["turn_index"])
    assert [v["truncated"] for v in verdicts] == [0, 0, 3]
    assert judged_daemon.stats()["sessions"]["votes_truncated"] - before == 3
