"""Personas as data: the built-in files, the checkers, feedback lines mixed with the next task,
and clear errors for malformed files (naming the field), also through the command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ocrl.bench import persona
from ocrl.bench.persona import Avoids, Format, Language, MaxWords, Mentions, PersonaError

ROOT = Path(__file__).resolve().parent.parent
VALID = """
name = "terse"
rule = { check = "max_words", n = 5 }
tasks = ["What is 2+2?", "Name a colour."]
pass = ["thanks", "great. {task}"]
fail = ["too long, again", "too long. {task}"]
"""


def test_the_four_builtin_personas_are_files():
    personas = persona.builtin()
    assert sorted(personas) == ["brief", "lowercase", "plain", "question"]
    assert isinstance(personas["brief"].rule, MaxWords) and personas["brief"].rule.n == 25
    assert personas["plain"].rule == Format(kind="plain")
    for p in personas.values():
        assert p.tasks and p.probes and p.standalone(True) and p.standalone(False)
    for name in ("brief", "plain"):  # the two the learning runs use: 20+ phrasings each way
        assert len(personas[name].pass_lines) >= 20 and len(personas[name].fail_lines) >= 20


@pytest.mark.parametrize(
    ("rule", "text", "holds"),
    [
        (MaxWords(n=3), "one two three", True),
        (MaxWords(n=3), "one two three four", False),
        (MaxWords(n=3), "", False),
        (Mentions(text="Paris"), "It is paris.", True),
        (Mentions(text="Paris"), "It is Lyon.", False),
        (Avoids(words=["very", "really"]), "It is big.", True),
        (Avoids(words=["very", "really"]), "It is Very big.", False),
        (Avoids(words=["very"]), "Everything is fine.", True),  # a word, not a substring
        (Language(lang="es"), "La capital de Francia es París.", True),
        (Language(lang="es"), "The capital of France is Paris.", False),
        (Language(lang="fr"), "La capitale de la France est Paris.", True),
        (Language(lang="de"), "Die Hauptstadt ist Paris und nicht Lyon.", True),
        (Format(kind="bullet_list"), "- one\n- two", True),
        (Format(kind="bullet_list"), "one and two", False),
        (Format(kind="json"), '```json\n{"a": 1}\n```', True),
        (Format(kind="json"), "a: 1", False),
        (Format(kind="plain"), "It is 56.", True),
        (Format(kind="plain"), "The answer is **56**.", False),
        (Format(kind="question"), "It is 56. Anything else?", True),
        (Format(kind="lowercase"), "It is 56.", False),
    ],
)
def test_checkers(rule, text, holds):
    assert rule.holds(text) is holds


def test_a_persona_file_loads_and_mixes_feedback_with_the_next_task(tmp_path):
    path = tmp_path / "terse.toml"
    path.write_text(VALID)
    terse = persona.load(path)
    assert terse.description == "answers in at most 5 words"  # from the rule when not given
    assert terse.probes == list(persona.DEFAULT_PROBES)
    assert terse.holds("four") and not terse.holds("one two three four five six")
    assert terse.standalone(True) == ["thanks"] and terse.standalone(False) == ["too long, again"]
    assert terse.moving_on("great. {task}", "Name a colour.", True) == "great. Name a colour."
    assert terse.moving_on("thanks", "Name a colour.", True) == "thanks Name a colour."
    assert terse.moving_on("too long, again", "Name a colour.", False) == "too long, again Anyway, Name a colour."


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (("n = 5", 'n = "five"'), "$.rule.n"),
        (("n = 5", "n = 0"), "$.rule.n"),
        (('check = "max_words"', 'check = "shout"'), "$.rule.check"),
        (('tasks = ["What is 2+2?", "Name a colour."]', "tasks = []"), "$.tasks"),
        (('pass = ["thanks", "great. {task}"]', 'pass = ["great. {task}"]'), "$.pass"),
        (('fail = ["too long, again", "too long. {task}"]', 'fail = ["too long {name}"]'), "$.fail"),
        (('fail = ["too long, again", "too long. {task}"]\n', ""), "`fail`"),
        (('name = "terse"', 'name = "terse"\ncolour = "red"'), "`colour`"),
        (("rule = { check", "rule = { kind"), "check"),
    ],
)
def test_a_malformed_persona_names_the_field(tmp_path, change, field):
    old, new = change
    assert old in VALID
    path = tmp_path / "bad.toml"
    path.write_text(VALID.replace(old, new))
    with pytest.raises(PersonaError) as error:
        persona.load(path)
    assert str(path) in str(error.value) and field in str(error.value), str(error.value)


def test_unreadable_and_invalid_toml_files(tmp_path):
    with pytest.raises(PersonaError, match="persona file .*missing.toml"):
        persona.load(tmp_path / "missing.toml")
    (tmp_path / "broken.toml").write_text("name = [")
    with pytest.raises(PersonaError, match="not valid TOML"):
        persona.load(tmp_path / "broken.toml")


def test_bench_learn_with_a_malformed_persona_file_exits_with_the_field(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(VALID.replace("n = 5", 'n = "five"'))
    done = subprocess.run(
        [sys.executable, "-m", "ocrl", "bench", "learn", "--persona-file", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2
    assert "ocrl: persona file" in done.stderr and "$.rule.n" in done.stderr, done.stderr
