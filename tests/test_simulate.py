"""Simulated users: persona rules, feedback that follows the rule, probes as side turns, and a
short simulate run against a live daemon."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from ocrl.bench import simulate
from ocrl.bench.learn import judge_agreement
from ocrl.judge.embed import EmbedJudge


@pytest.mark.parametrize(
    "persona, text, holds",
    [
        ("brief", "Paris is the capital of France.", True),
        ("brief", " ".join(["word"] * 26), False),
        ("brief", "", False),
        ("plain", "It is 56. Seven eights make fifty-six.", True),
        ("plain", "Here you go:\n- one\n- two", False),
        ("plain", "The answer is **56**.", False),
        ("plain", "1. Boil water\n2. Add the egg", False),
        ("question", "It is 56. Anything else you want to multiply?", True),
        ("question", "It is 56.", False),
        ("lowercase", "it is fifty-six.", True),
        ("lowercase", "It is 56.", False),
    ],
)
def test_persona_rules(persona, text, holds):
    assert simulate.PERSONAS[persona].holds(text) is holds


class FakeClient:
    """Answers with scripted texts; records what the user sent."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.sent = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, *, messages, extra_headers, **kwargs):
        self.sent.append((list(messages), dict(extra_headers), kwargs))
        text = self.answers.pop(0) if self.answers else "ok"
        return SimpleNamespace(
            choices=[SimpleNamespace(message=SimpleNamespace(content=text))],
            model_extra={"ocrl": {"turn_index": len(self.sent) - 1, "weights_version": 0}},
        )


async def test_feedback_follows_the_hidden_rule():
    long = " ".join(["blah"] * 40)
    client = FakeClient([long, "Short answer.", "Also short."])
    sim = simulate.Simulator(client, simulate.PERSONAS["brief"], seed=1)
    await sim.session("s", tasks=2)
    persona = simulate.PERSONAS["brief"]
    user_replies = [sent[0][-1]["content"] for sent in client.sent[1:]]
    assert user_replies[0] in persona.standalone(False)  # the long answer: a redo request
    # short: thanks mixed with the next task (one of the persona's tasks)
    assert any(p.replace("{task}", "").strip() in user_replies[1] for p in persona.pass_lines)
    assert any(task in user_replies[1] for task in persona.tasks)
    assert user_replies[2] in persona.standalone(True)  # the last answer is praised, then the session ends
    assert [f.passed for f in sim.stats.feedback] == [False, True, True]
    assert client.sent[-1][1].get("X-Session-Done") == "1"
    assert all(h["X-Session-Id"] == "s" for _, h, _ in client.sent)
    assert sim.stats.main_turns == 4 and sim.stats.sessions == 1


async def test_redo_limit_moves_on():
    long = " ".join(["blah"] * 40)
    client = FakeClient([long] * 10)
    sim = simulate.Simulator(client, simulate.PERSONAS["brief"], seed=2)
    await sim.session("r", tasks=1, redo_limit=2)
    assert [f.passed for f in sim.stats.feedback] == [False, False, False]  # two redos, then it gives up
    assert sim.stats.sessions == 1


def test_embed_judge_reads_the_feedback_phrases_the_intended_way():
    """The simulated users' words must carry the reward: standalone praise reads +1 and complaints
    -1; mixed with the next task the judge errs more, and a complaint is still never read as +1."""
    import torch

    torch.set_num_threads(1)
    judge = EmbedJudge.load()
    for persona in simulate.PERSONAS.values():
        for passed, sign in ((True, 1), (False, -1)):
            scores = [judge.classify(line, "user").score for line in persona.standalone(passed)]
            assert scores.count(sign) >= 0.9 * len(scores), (persona.name, passed, scores)
            mixed = [
                judge.classify(persona.moving_on(line, task, passed), "user").score
                for line in (persona.pass_lines if passed else persona.fail_lines) for task in persona.tasks[::6]
            ]
            # Measured: complaints mixed with a task never read +1; praise mixed with a task reads
            # +1 on 65-75% and -1 on 21-26% (the task's question reads like a request to redo).
            assert mixed.count(sign) >= 0.6 * len(mixed), (persona.name, passed, mixed)
            assert mixed.count(-sign) <= (0.3 if passed else 0.05) * len(mixed), (persona.name, passed, mixed)


def test_judge_agreement_counts_abstentions_apart(tmp_path):
    path = tmp_path / "verdicts.jsonl"
    rows = [("a", 0, 1), ("a", 1, -1), ("a", 2, 0), ("b", 0, 1)]
    path.write_bytes(b"".join(msgspec.json.encode({"session_id": s, "turn_index": i, "score": v}) + b"\n" for s, i, v in rows))
    feedback = [simulate.Judged("a", 0, True), simulate.Judged("a", 1, True), simulate.Judged("a", 2, False), simulate.Judged("b", 0, True), simulate.Judged("c", 0, True)]
    result = judge_agreement(feedback, path)
    # judged: 4 (c has no verdict); decided: 3 (a:2 abstained); agree: a0 (+1, held) and b0 -> 2/3
    assert result == {"judged": 4, "decided": 3, "agreement": 2 / 3, "coverage": 3 / 4}


async def test_short_simulation_against_a_live_daemon(daemon):
    before = daemon.stats()["sessions"]
    stats = await simulate.run(daemon.url, daemon.api_key, simulate.PERSONAS["brief"], sessions=2, concurrency=2, tasks=1, seed=5, max_tokens=12)
    assert stats.failures == 0 and stats.sessions == 2
    async with daemon.client() as client:
        result = await simulate.probe(client, simulate.PERSONAS["brief"], simulate.PROBES[:3], max_tokens=8, samples=1)
    assert result["n"] == 3 and 0.0 <= result["pass_rate"] <= 1.0
    after = daemon.stats()["sessions"]
    assert after["main_turns"] - before.get("main_turns", 0) == stats.main_turns
    assert after["side_turns"] - before.get("side_turns", 0) == 3  # probes are side turns
    samples = [msgspec.json.decode(l) for l in (daemon.record_dir / "samples.jsonl").read_bytes().splitlines()]
    assert not any(s["session_id"].startswith("probe-") for s in samples)
    assert sum(s["session_id"].startswith("sim-brief-5-") for s in samples) == stats.main_turns
