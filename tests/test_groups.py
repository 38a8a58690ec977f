"""n > 1 in sessions.py: the candidate the client continues is the main turn (next state, verdict,
trainable sample); its siblings are submitted with mask 0 and never trained; a restart keeps
the rule."""

from __future__ import annotations

import anyio

from ocrl.restore import restore
from ocrl.records import Records
from ocrl.types import Completion, Message
from tests.test_sessions import Harness, judged

Q = [{"role": "user", "content": "q"}]


def group(h: Harness, messages: list[dict], replies: list[str], *, session_id=None, done=False):
    ticket = h.sessions.begin(session_id=session_id, turn_type=None, session_done=done, messages=[Message(**m) for m in messages])
    completions = [
        Completion(prompt_ids=[1, 2, 3], response_ids=[10 + k, 2], logprobs=[-0.5 - k, -0.1], text=reply, finish_reason="stop", weights_version=0)
        for k, reply in enumerate(replies)
    ]
    return h.sessions.complete_group(ticket, completions)


def continuing(reply: str, next_state: str) -> list[dict]:
    return Q + [{"role": "assistant", "content": reply}, {"role": "user", "content": next_state}]


@judged
async def test_the_continued_candidate_is_judged_and_its_siblings_are_never_trained(h):
    turns = group(h, Q, ["A0", "A1", "A2"])
    assert [(t.index, t.choice, t.group_size, t.turn_type) for t in turns] == [(0, 0, 3, "main"), (0, 1, 3, "main"), (0, 2, 3, "main")]
    # no session header: the prefix tells both the session and the candidate the client kept
    follow, _ = h.turn(continuing("A1", "thanks that works"))
    await h.settle()
    assert (follow.session_id, follow.index) == (turns[0].session_id, 1)
    uid = h.sessions.sessions[follow.session_id].uid
    by_id = {s.sample_id: s for s in h.samples}
    sid = f"{follow.session_id}:{uid}:0"
    assert set(by_id) == {f"{sid}/0", f"{sid}/1", f"{sid}/2"}
    kept = by_id[f"{sid}/1"]
    assert (kept.score, kept.reward, kept.loss_mask, kept.next_state, kept.choice, kept.group_size) == (1, 1.0, [1, 1], "thanks that works", 1, 3)
    assert kept.rollout_logprobs == [-1.5, -0.1]  # candidate 1's own tokens and log-probs
    for k in (0, 2):
        sibling = by_id[f"{sid}/{k}"]
        assert (sibling.loss_mask, sibling.score, sibling.next_state, sibling.promoted, sibling.choice) == ([0, 0], None, None, False, k)
    assert h.sessions.counters["group_siblings"] == 2 and h.sessions.counters["group_candidates"] == 3


@judged
async def test_no_continuation_means_candidate_zero_stands_for_the_group(h):
    group(h, Q, ["B0", "B1"], session_id="g")
    h.sessions.close("g")
    await h.settle()
    by_choice = {s.choice: s for s in h.samples}
    # the session's only main turn: mask 1 with reward 0, as for n = 1; the sibling is excluded
    assert (by_choice[0].loss_mask, by_choice[0].score, by_choice[0].reward) == ([1, 1], None, 0.0)
    assert by_choice[1].loss_mask == [0, 0]


@judged
async def test_a_session_header_without_a_matching_reply_continues_candidate_zero(h):
    group(h, Q, ["C0", "C1"], session_id="h")
    h.turn(continuing("something the client wrote itself", "wrong try again"), session_id="h")
    await h.settle()
    by_choice = {s.choice: s for s in h.samples if s.turn_index == 0}
    assert by_choice[0].score == -1 and by_choice[0].loss_mask == [1, 1]
    assert by_choice[1].loss_mask == [0, 0] and by_choice[1].score is None


async def test_groups_survive_a_restart(tmp_path):
    def harness(records):
        h = Harness(records=records)
        h.sessions.submit = lambda sample: (records.journal(sample), h.samples.append(sample))
        return h

    # the first process: a resolved group (its verdict never came) and an open one, then it dies
    first = harness(Records(tmp_path))
    group(first, Q, ["D0", "D1"], session_id="r")
    first.turn(continuing("D1", "thanks a lot"), session_id="r")
    group(first, [{"role": "user", "content": "other"}], ["E0", "E1"], session_id="s")
    uid_r, uid_s = first.sessions.sessions["r"].uid, first.sessions.sessions["s"].uid
    assert [s.sample_id for s in first.samples] == [f"r:{uid_r}:0/0"]  # the sibling, journaled at once

    records = Records(tmp_path)
    second = harness(records)
    done = restore(second.sessions, records.main_turns(), records.next_states(), records.journaled())
    assert (done["sessions"], done["rejudged"], done["open"]) == (2, 1, 2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(second.sessions.run)
        await second.settle()
        # the open group: the client now continues E1, by prefix
        second.turn([{"role": "user", "content": "other"}, {"role": "assistant", "content": "E1"}, {"role": "user", "content": "wrong"}])
        await second.settle()
        tg.cancel_scope.cancel()
    by_id = {s.sample_id: s for s in second.samples}
    assert (by_id[f"r:{uid_r}:0/1"].score, by_id[f"r:{uid_r}:0/1"].next_state) == (1, "thanks a lot")
    assert f"r:{uid_r}:0/0" not in by_id  # journaled before the crash: not submitted twice
    assert by_id[f"s:{uid_s}:0/1"].score == -1 and by_id[f"s:{uid_s}:0/0"].loss_mask == [0, 0]


async def test_n_choices_over_http_are_one_group_and_the_continued_one_goes_on(daemon):
    import json
    import time

    question = [{"role": "user", "content": "Name a fruit."}]
    async with daemon.client() as client:
        reply = await client.chat.completions.create(
            model="m", messages=question, n=3, temperature=1.0, seed=11, max_tokens=6, extra_headers={"X-Session-Id": "http-group"}
        )
        kept = reply.choices[1].message.content
        follow = await client.chat.completions.create(
            model="m", messages=question + [{"role": "assistant", "content": kept}, {"role": "user", "content": "Thanks!"}], max_tokens=2,
        )
        # (streamed after the follow-up: the same samples in another session share its prefixes)
        stream = await client.chat.completions.create(
            model="m", messages=question, n=3, temperature=1.0, seed=11, max_tokens=6, stream=True, extra_headers={"X-Session-Id": "http-group-s"}
        )
        streamed, finished = {0: "", 1: "", 2: ""}, set()
        async for chunk in stream:
            for choice in chunk.choices:
                streamed[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    finished.add(choice.index)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    ids = [c.model_extra["ocrl"]["completion_token_ids"] for c in reply.choices]
    assert len({tuple(i) for i in ids}) > 1  # distinct samples (seed + k per choice)
    assert reply.usage.completion_tokens == sum(len(i) for i in ids)
    assert [c.model_extra["ocrl"]["turn_index"] for c in reply.choices] == [0, 0, 0]
    # the same seeds stream the same three samples, interleaved by index
    assert finished == {0, 1, 2} and [streamed[k] for k in range(3)] == [c.message.content for c in reply.choices]
    # no header on the follow-up: the prefix finds the session and the candidate it continues
    assert (follow.model_extra["ocrl"]["session_id"], follow.model_extra["ocrl"]["turn_index"]) == ("http-group", 1)
    path = daemon.record_dir / "samples.jsonl"
    deadline = time.monotonic() + 30
    while True:
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        group_rows = {r["choice"]: r for r in rows if r["session_id"] == "http-group" and r["turn_index"] == 0}
        if len(group_rows) == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {k: (r["group_size"], max(r["loss_mask"]), r["next_state"]) for k, r in group_rows.items()} == {
        0: (3, 0, None), 1: (3, group_rows[1]["loss_mask"][0], "Thanks!"), 2: (3, 0, None)
    }
    assert group_rows[1]["tokens"][-len(ids[1]):] == ids[1]
