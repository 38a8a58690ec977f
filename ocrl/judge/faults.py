"""Cheap textual cues that a user's message finds fault with the previous answer or waves it away,
for the embed judge's decision rule (`decide` in embed.py) to keep from +1 whatever the committee
reads: a contrast the message closes on (`closing_contrast`), a closing "come on"
(`exasperated_close`), an eye-roll (`eye_roll`), an opening that waves the answer away
(`dismissive_opening`), a fault named in its content (`faulted_content`). Each returns the matched
text, or None, and knows nothing of the classifier, its fit or the rule; the cues that a message
asks for an edit are in cues.py.
"""

from __future__ import annotations

import re

from ocrl.judge.cues import THANKS

# A closing contrast ("... sunday as the cleaning day not saturday", "... with oat milk instead of
# cow's") or a closing "though" that asks nothing ("spot on. dispose of it properly though"), in a
# message that thanks for nothing: on the labelled cases 203 of the 208 user messages that close on
# such a contrast are corrections, change requests or complaints, and 21 of the 22 that close on
# such a "though" (the others thank: "thanks though"). It is a verdict on the answer, even after
# a sign of moving on.
_CLOSING_CONTRAST = re.compile(
    r"(?i:(?<!\bbut )(?<!\bit's )(?<!\bis )(?<!\bwill )(?<!\bwas )(?<!\bare )\b(?:not|instead of|rather than)"
    r" (?:the |a |an |my |on |in |at )?[\w'-]+\W*$|\bthough(?=[\s.!]*$))"
)


def closing_contrast(text: str) -> str | None:
    """The contrast a user's message closes on ("not saturday", "instead of rice", "... though"),
    or None; none in a message that thanks."""
    match = _CLOSING_CONTRAST.search(text)
    return match.group(0).strip() if match and THANKS.search(text) is None else None


# A message that closes on "come on" ("200 lines to average a list, come on"): all 8 labelled such
# messages complain; "come on" inside a clause ("make the porch light come on at sunset") is a verb.
_EXASPERATED = re.compile(r"(?i:(?:^|[,.!?;:]\s*)come on\W*$)")


def exasperated_close(text: str) -> str | None:
    """The "come on" a user's message closes on, or None."""
    match = _EXASPERATED.search(text)
    return match.group(0).strip(" ,.!?;:") if match else None


# An eye-roll anywhere in a user's message, in emoji (🙄, 😒) or in words ("thanks for nothing"):
# of the 25 distinct labelled user messages with the emoji, 20 complain or correct, 4 are off-topic
# grumbles ("my neighbour is mowing at 7am again 🙄") and one thanks while rolling its eyes at
# someone else; "cheers, very encouraging 🙄" is sarcasm. A facepalm (🤦) is left out: most often
# the user laughs at their own mistake before thanks.
_EYE_ROLL = re.compile("[\U0001F644\U0001F612]|(?i:\\bthanks? (?:you )?for nothing\\b)")


def eye_roll(text: str) -> str | None:
    """The eye-roll in a user's message (the emoji, or "thanks for nothing"), or None."""
    match = _EYE_ROLL.search(text)
    return match.group(0) if match else None


# A message that opens by waving the answer away ("meh.", "nah", "nope"): on the labelled cases all
# 73 user messages that open so are corrections, redo requests or complaints ("meh. rebuild it from
# the ground up"); one that thanks is not waved away ("nah, that's fine, thanks").
_DISMISSIVE = re.compile(r"(?i:^\W*(meh|bleh|nah|nope|naw)\b)")


def dismissive_opening(text: str) -> str | None:
    """The word a user's message opens with that waves the answer away ("meh", "nah"), or None;
    none in a message that thanks."""
    match = _DISMISSIVE.match(text)
    return match.group(1) if match and THANKS.search(text) is None else None


# A fault found in the answer's content that no one says of a good one: code that is unreadable,
# hard-coded or full of magic numbers, or an API, library or call that is deprecated, archived,
# outdated or removed ("tui-rs is archived. ratatui is the maintained fork"), or the same thing said
# over and over in it ("six times in one answer": 6 of 6 labelled complaints; "that's the fourth
# 'buzz on the mouthpiece' tonight", "that's the fifth time": 4 of 4). On the labelled cases
# all 37 distinct user messages with such a word are corrections, redo requests or complaints; one
# that thanks may be telling of a fault the answer fixed ("thanks, the deprecated call is gone").
_FAULTED = re.compile(
    r"(?i:\b(?:unreadable|deprecated|archived|unmaintained|no longer maintained|outdated|obsolete|spaghetti"
    r"|magic numbers?|hard-?coded|hard coded|(?:was|were|got|been|is|are) removed|removed in"
    # the same thing said again and again in it ("six times in one answer", "you've said it 4 times")
    r"|(?:twice|(?:three|four|five|six|seven|eight|nine|ten|\d+) times) in (?:one|a single|the same|1|your|that|this|one single)"
    r" (?:answer|message|reply|response|list|paragraph|page|post)|you(?:'ve| have)? (?:said|told me|mentioned) (?:(?:it|that|this) )?(?:three|four|five"
    r"|six|seven|eight|nine|ten|\d+) times"
    # ... or counted as it comes again ("that's the fifth time", "that's the fourth 'buzz' tonight")
    r"|that'?s the (?:second|third|fourth|fifth|sixth|seventh|\d+(?:st|nd|rd|th)) (?:time|[^.!?]{1,40}?\b(?:tonight|today|this (?:week|morning|evening))))\b)"
)


def faulted_content(text: str) -> str | None:
    """The word of a user's message that finds a fault in the answer's content ("deprecated",
    "magic numbers"), or None; none in a message that thanks."""
    match = _FAULTED.search(text)
    return match.group(0) if match and THANKS.search(text) is None else None
