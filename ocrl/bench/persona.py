"""Personas as data: a simulated user's hidden rule, the tasks it asks, the probes that measure
the rule, and the words it answers with when the rule held or did not.

A persona is a TOML file (the built-in ones are `ocrl/bench/personas/*.toml`):

    name = "brief"
    description = "answers in at most 25 words"
    rule = { check = "max_words", n = 25 }
    tasks = ["What is 7 times 8?", ...]
    probes = ["What is 9 plus 6?", ...]       # optional: the built-in probe prompts
    pass = ["Thanks, that's what I needed.", "Great. {task}", ...]
    fail = ["Too long, please answer again in one sentence.", "Too wordy, but fine. {task}", ...]

`rule.check` is one of the built-in checkers: `max_words` (n), `mentions` (text), `avoids`
(words), `language` (lang: en, es, fr, de) and `format` (kind: bullet_list, json, plain,
question, lowercase). A feedback line with `{task}` mixes the feedback with the next request;
it is used when the user moves on, the lines without it for redo requests and the last reply.
Decoding with the types is the validation; a malformed file raises `PersonaError` naming the
field. This module knows nothing of HTTP, the daemon or the judge.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Literal

import msgspec

BUILTIN_DIR = Path(__file__).with_name("personas")
TASK = "{task}"

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
Lines = Annotated[list[NonEmpty], msgspec.Meta(min_length=1)]


def words(text: str) -> int:
    return len(re.findall(r"\S+", text))


MARKDOWN = re.compile(r"(^\s*([-*+]|\d+[.)])\s)|(\*\*|__)|(^#+\s)|```", re.M)
_BULLET = re.compile(r"^\s*(?:[-*+\u2022]|\d+[.)])\s+\S", re.M)
_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$")

# The most frequent short words of each language: a reply is in the language whose list covers
# the largest share of its words (a crude check, enough to tell these four apart).
_STOPWORDS = {
    "en": "the a an and of to is in it that you for on with are this be as at or was not have i your".split(),
    "es": "el la los las de que y en un una es por para con no se del al lo como su más pero muy".split(),
    "fr": "le la les de des et en un une est que pour dans ce qui pas sur au avec du il vous je".split(),
    "de": "der die das und ist nicht ein eine zu den mit von für auf ich sie es im dem des auch".split(),
}


class MaxWords(msgspec.Struct, tag="max_words", tag_field="check", forbid_unknown_fields=True):
    n: Annotated[int, msgspec.Meta(ge=1)]

    def holds(self, text: str) -> bool:
        return 0 < words(text) <= self.n

    def describe(self) -> str:
        return f"answers in at most {self.n} words"


class Mentions(msgspec.Struct, tag="mentions", tag_field="check", forbid_unknown_fields=True):
    text: NonEmpty

    def holds(self, text: str) -> bool:
        return self.text.lower() in text.lower()

    def describe(self) -> str:
        return f"mentions {self.text!r}"


class Avoids(msgspec.Struct, tag="avoids", tag_field="check", forbid_unknown_fields=True):
    words: Lines

    def holds(self, text: str) -> bool:
        lowered = text.lower()
        return bool(text.strip()) and not any(re.search(rf"(?<!\w){re.escape(w.lower())}(?!\w)", lowered) for w in self.words)

    def describe(self) -> str:
        return "never uses " + ", ".join(repr(w) for w in self.words)


class Language(msgspec.Struct, tag="language", tag_field="check", forbid_unknown_fields=True):
    lang: Literal["en", "es", "fr", "de"]

    def holds(self, text: str) -> bool:
        tokens = re.findall(r"[^\W\d_]+", text.lower())
        if not tokens:
            return False
        share = {lang: sum(t in stop for t in tokens) for lang, stop in _STOPWORDS.items()}
        return share[self.lang] > 0 and share[self.lang] == max(share.values())

    def describe(self) -> str:
        return f"answers in {self.lang}"


class Format(msgspec.Struct, tag="format", tag_field="check", forbid_unknown_fields=True):
    kind: Literal["bullet_list", "json", "plain", "question", "lowercase"]

    def holds(self, text: str) -> bool:
        if not text.strip():
            return False
        match self.kind:
            case "bullet_list":
                return len(_BULLET.findall(text)) >= 2
            case "json":
                try:
                    json.loads(_FENCE.sub("", text.strip()))
                except ValueError:
                    return False
                return True
            case "plain":
                return not MARKDOWN.search(text)
            case "question":
                return text.rstrip().endswith("?")
            case "lowercase":
                return text == text.lower()
        return False

    def describe(self) -> str:
        return {
            "bullet_list": "answers as a bullet list", "json": "answers in JSON", "plain": "no markdown lists, headers or bold",
            "question": "ends with a question back to the user", "lowercase": "replies in lowercase only",
        }[self.kind]


Rule = MaxWords | Mentions | Avoids | Language | Format

DEFAULT_PROBES = (
    "What is 9 plus 6?", "What is the largest ocean?", "Write a one-line thank-you note.",
    "How many legs does a cat have?", "What is the boiling point of water?", "Suggest a name for a dog.",
    "What is 6 times 7?", "Why is the sky blue?", "What is the capital of Spain?", "Give me a tip for studying.",
    "What do bees make?", "How many hours are in a day?",
)


class Persona(msgspec.Struct, forbid_unknown_fields=True):
    """A simulated user. `rule` is hidden from the daemon: it only decides which words the user
    sends (`pass_lines` when it held, `fail_lines` when not) and scores the probes."""

    name: NonEmpty
    rule: Rule
    tasks: Lines
    pass_lines: Lines = msgspec.field(name="pass")
    fail_lines: Lines = msgspec.field(name="fail")
    description: str = ""
    probes: Lines = msgspec.field(default_factory=lambda: list(DEFAULT_PROBES))

    def __post_init__(self) -> None:
        if not self.description:
            self.description = self.rule.describe()
        for field, lines in (("pass", self.pass_lines), ("fail", self.fail_lines)):
            if not [line for line in lines if TASK not in line]:
                raise msgspec.ValidationError(f"needs a line without {TASK} (redo requests and last replies) - at `$.{field}`")
            for line in lines:
                if line.count(TASK) > 1 or ("{" in line.replace(TASK, "")) or ("}" in line.replace(TASK, "")):
                    raise msgspec.ValidationError(f"line {line!r}: the only placeholder is {TASK}, once - at `$.{field}`")

    def holds(self, text: str) -> bool:
        """Did the answer follow the hidden rule?"""
        return self.rule.holds(text)

    def standalone(self, passed: bool) -> list[str]:
        """Feedback lines that stand alone (a redo request, the reply to a last answer)."""
        return [line for line in (self.pass_lines if passed else self.fail_lines) if TASK not in line]

    def moving_on(self, line: str, task: str, passed: bool) -> str:
        """A feedback line mixed with the next request."""
        if TASK in line:
            return line.replace(TASK, task)
        return f"{line} {task}" if passed else f"{line} Anyway, {task}"


class PersonaError(ValueError):
    """A persona file that cannot be read or is malformed; the message names the file and field."""




def load(path: str | Path) -> Persona:
    """A persona from a TOML file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise PersonaError(f"persona file {path}: {error.strerror or error}") from None
    try:
        return msgspec.toml.decode(raw, type=Persona)
    except msgspec.ValidationError as error:
        raise PersonaError(f"persona file {path}: {error}") from None
    except msgspec.DecodeError as error:
        raise PersonaError(f"persona file {path}: not valid TOML: {error}") from None


def builtin() -> dict[str, Persona]:
    """The personas shipped with ocrl, by name."""
    return {path.stem: load(path) for path in sorted(BUILTIN_DIR.glob("*.toml"))}


def builtin_names() -> list[str]:
    return sorted(path.stem for path in BUILTIN_DIR.glob("*.toml"))
