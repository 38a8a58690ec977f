"""sessions.py with a scripted judge double: masks, at-least-one, threading, exactly once."""

from __future__ import annotations

import anyio
import pytest

from ocrl.restore import restore
from ocrl.sessions import Sessions
from ocrl.types import Completion, Message, Verdict, Vote

SCORES = {"thanks": 1, "wrong": -1, "hmm": 0}


async def scripted_judge(response: str, next_state: str, role: str) -> Verdict:
    if next_state == "explode":
        raise RuntimeError("judge down")
    score = SCORES[next_state.split()[0]]
    return Verdict(score=score, votes=[Vote(score, f"\\boxed{{{score}}}")] * 3, mode="scripted")


class Harness:
    def __init__(self, judge=scripted_judge, **kwargs):
        self.samples = []
        self.sessions = Sessions(judge=judge, submit=self.samples.append, **kwargs)
        self.turn_counter = 0

    def turn(self, messages: list[dict], *, session_id=None, turn_type=None, done=False, response="ok"):
        msgs = [Message(**m) for m in messages]
        ticket = self.sessions.begin(session_id=session_id, turn_type=turn_type, session_done=done, messages=msgs)
        self.turn_counter += 1
        n = self.turn_counter
        completion = Completion(
            prompt_ids=[1, 2, n], response_ids=[10 + n, 20 + n, 2], logprobs=[-0.1 * n, -0.2, -0.3],
            text=response, finish_reason="stop", weights_version=0,
        )
        return self.sessions.complete(ticket, completion), completion

    async def settle(self):
        with anyio.fail_after(10):
            while self.sessions._in_flight:
                await anyio.sleep(0.001)


def judged(test):
    async def wrapper():
        harness = Harness()
        async with anyio.create_task_group() as tg:
            tg.start_soon(harness.sessions.run)
            await test(harness)
            await harness.settle()
            tg.cancel_scope.cancel()

    wrapper.__name__ = test.__name__
    return wrapper


def by_turn(samples):
    return {s.turn_index: s for s in samples}


@judged
async def test_three_turn_session_masks(h):
    u = lambda text: {"role": "user", "content": text}
    h.turn([u("q1")], session_id="a")
    h.turn([u("q1"), {"role": "assistant", "content": "ok"}, u("thanks next")], session_id="a")
    h.turn([u("q1"), {"role": "assistant", "content": "ok"}, u("thanks next"), {"role": "assistant", "content": "ok"}, u("wrong again")], session_id="a", done=True)
    await h.settle()
    samples = by_turn(h.samples)
    assert len(h.samples) == 3
    assert [samples[i].loss_mask[0] for i in range(3)] == [1, 1, 0]
    assert [samples[i].reward for i in range(3)] == [1.0, -1.0, 0.0]
    assert [samples[i].score for i in range(3)] == [1, -1, None]
    assert samples[0].next_state == "thanks next" and samples[0].next_state_role == "user"
    assert not any(s.promoted for s in h.samples)


@judged
async def test_a_failed_last_request_leaves_the_session_open_for_its_retry(h):
    u = lambda text: {"role": "user", "content": text}
    h.turn([u("q1")], session_id="r")
    last = [u("q1"), {"role": "assistant", "content": "ok"}, u("thanks next")]
    h.sessions.abort(h.sessions.begin(session_id="r", turn_type=None, session_done=True, messages=[Message(**m) for m in last]))
    assert "r" in h.sessions.sessions and not h.sessions.sessions["r"].closed
    retried, _ = h.turn(last, session_id="r", done=True)  # the client's retry: the same session, the next index
    await h.settle()
    assert retried.index == 1 and retried.session_uid == h.samples[0].sample_id.split(":")[1]
    assert "r" not in h.sessions.sessions  # closed by the retry's flag
    assert sorted(s.turn_index for s in h.samples) == [0, 1]


@judged
async def test_single_turn_session_gets_mask_one(h):
    h.turn([{"role": "user", "content": "hi"}], session_id="solo", done=True)
    [sample] = h.samples
    assert sample.loss_mask == [1, 1, 1] and sample.score is None and sample.reward == 0.0


@judged
async def test_all_zero_session_has_exactly_one_promoted_sample(h):
    history = [{"role": "user", "content": "q"}]
    for i in range(4):
        h.turn(history, session_id="z", done=(i == 3))
        history = history + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"hmm {i}"}]
    await h.settle()
    assert len(h.samples) == 4
    assert sum(s.promoted for s in h.samples) == 1
    assert sum(s.effective for s in h.samples) == 1
    assert by_turn(h.samples)[3].score is None and not by_turn(h.samples)[3].effective


@judged
async def test_zero_after_an_effective_sample_is_not_promoted(h):
    h.turn([{"role": "user", "content": "q"}], session_id="p")
    h.turn([{"role": "user", "content": "thanks"}], session_id="p")
    await h.settle()
    h.turn([{"role": "user", "content": "hmm"}], session_id="p", done=True)
    await h.settle()
    samples = by_turn(h.samples)
    assert samples[0].effective and not samples[1].effective and not samples[1].promoted


@judged
async def test_side_turns_yield_no_sample_and_close_nothing(h):
    h.turn([{"role": "user", "content": "q"}], session_id="s")
    h.turn([{"role": "user", "content": "probe"}], session_id="s", turn_type="side")
    assert h.samples == [] and h.sessions._in_flight == 0
    h.turn([{"role": "user", "content": "thanks"}], session_id="s", done=True)
    await h.settle()
    assert sorted(s.turn_index for s in h.samples) == [0, 1]
    assert h.sessions.counters["side_turns"] == 1


@judged
async def test_headerless_clients_thread_by_prefix(h):
    a1 = [{"role": "user", "content": "alpha?"}]
    b1 = [{"role": "user", "content": "beta?"}]
    ta, _ = h.turn(a1, response="A")
    tb, _ = h.turn(b1, response="B")
    ta2, _ = h.turn(a1 + [{"role": "assistant", "content": "A"}, {"role": "user", "content": "thanks a"}], response="A2")
    tb2, _ = h.turn(b1 + [{"role": "assistant", "content": "B"}, {"role": "user", "content": "wrong b"}], response="B2")
    ta3, _ = h.turn(
        a1 + [{"role": "assistant", "content": "A"}, {"role": "user", "content": "thanks a"}, {"role": "assistant", "content": "A2"}, {"role": "user", "content": "hmm"}]
    )
    assert ta.session_id == ta2.session_id == ta3.session_id
    assert tb.session_id == tb2.session_id
    assert ta.session_id != tb.session_id
    assert (ta2.index, ta3.index, tb2.index) == (1, 2, 1)
    # an edited history (the assistant's answer changed) is a new conversation
    other, _ = h.turn(a1 + [{"role": "assistant", "content": "something else"}, {"role": "user", "content": "x"}])
    assert other.session_id not in (ta.session_id, tb.session_id)
    await h.settle()
    scores = {(s.session_id, s.turn_index): s.score for s in h.samples}
    assert scores == {(ta.session_id, 0): 1, (tb.session_id, 0): -1, (ta.session_id, 1): 0}


@judged
async def test_sample_carries_the_exact_tokens_and_logprobs(h):
    turn, completion = h.turn([{"role": "user", "content": "q"}], session_id="t", done=True)
    [sample] = h.samples
    assert sample.tokens == completion.prompt_ids + completion.response_ids
    assert sample.tokens[-sample.response_length :] == completion.response_ids
    assert sample.rollout_logprobs == completion.logprobs
    assert sample.weights_version == completion.weights_version


@judged
async def test_failing_judge_still_yields_exactly_one_sample(h):
    h.turn([{"role": "user", "content": "q"}], session_id="f")
    h.turn([{"role": "user", "content": "explode"}], session_id="f", done=True)
    await h.settle()
    samples = by_turn(h.samples)
    assert len(h.samples) == 2
    assert samples[0].score == 0 and samples[0].promoted and "judge down" in samples[0].votes[0].text
    assert h.sessions.counters["judge_failures"] == 1


@judged
async def test_exactly_once_whatever_the_order(h):
    h.turn([{"role": "user", "content": "q"}], session_id="e")
    h.sessions.close("e")
    h.sessions.close("e")
    h.turn([{"role": "user", "content": "thanks"}], session_id="e", done=True)  # same id: a new session
    await h.settle()
    ids = [s.sample_id for s in h.samples]
    assert len(ids) == len(set(ids)) == 2


async def test_idle_sessions_close_as_if_done():
    h = Harness(timeout=0.0)
    h.turn([{"role": "user", "content": "q"}], session_id="idle")
    h.turn([{"role": "user", "content": "q2"}], session_id="busy", turn_type="side")
    await anyio.sleep(0.01)
    h.sessions.close_idle()
    assert [s.session_id for s in h.samples] == ["idle"] and h.samples[0].effective
    assert h.sessions.stats()["sessions_open"] == 0


def test_bad_turn_type_is_refused():
    with pytest.raises(ValueError):
        Harness().turn([{"role": "user", "content": "q"}], turn_type="sideways")


async def test_restore_after_a_crash_judges_again_and_reopens_what_had_no_sample(tmp_path):
    from ocrl.records import Records

    def harness(records):
        h = Harness(records=records)
        h.sessions.submit = lambda sample: (records.journal(sample), h.samples.append(sample))
        return h

    # the first process: no judging loop runs, as if it died before the votes came back
    first = harness(Records(tmp_path))
    q = [{"role": "user", "content": "q"}]
    first.turn(q, session_id="a")
    first.turn(q + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "thanks a lot"}], session_id="a")
    first.turn(q, session_id="b", done=True)  # a one-turn session: its sample is journaled at once
    uid = first.sessions.sessions["a"].uid
    assert [s.sample_id for s in first.samples] == [f"b:{first.samples[0].sample_id.split(':')[1]}:0"]

    records = Records(tmp_path)
    second = harness(records)
    done = restore(second.sessions, records.main_turns(), records.next_states(), records.journaled())
    assert (done["sessions"], done["rejudged"], done["open"]) == (1, 1, 1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(second.sessions.run)
        await second.settle()
        assert [(s.sample_id, s.score, s.next_state) for s in second.samples] == [(f"a:{uid}:0", 1, "thanks a lot")]
        # the client carries on without a header: its prefix threads it into the restored session
        history = q + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "thanks a lot"}, {"role": "assistant", "content": "ok"}]
        turn, _ = second.turn(history + [{"role": "user", "content": "wrong again"}], done=True)
        await second.settle()
        tg.cancel_scope.cancel()
    assert (turn.session_id, turn.index, turn.session_uid) == ("a", 2, uid)
    by_id = {s.sample_id: s for s in second.samples}
    assert by_id[f"a:{uid}:1"].score == -1 and by_id[f"a:{uid}:2"].score is None
    # a third process finds nothing left to restore
    records = Records(tmp_path)
    assert restore(harness(records).sessions, records.main_turns(), records.next_states(), records.journaled())["sessions"] == 0
