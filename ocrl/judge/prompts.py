"""The judges' prompts: the PRM rubric, the hint rubric, and the chat each judge is asked.

Both chats show the assistant's reply and the next state (the user's next message or a tool's
output), each clipped at both ends so a huge tool output cannot fill the judge's context. The
PRM rubric asks for a `\\boxed{}` score, with reasoning first (the generated judge) or alone (the
verdict judge, continued from `VERDICT_PREFIX`); the hint rubric asks for a lesson between
`HINT_START` and `HINT_END`. How the answers are read is `ocrl.judge.votes`; this module knows
nothing of models or scores.
"""

from __future__ import annotations

# Messages as OpenAI chat dicts: {"role": ..., "content": ...}.
ChatMessages = list[dict]

# -- the PRM rubric -----------------------------------------------------------------------------

# The rules are the reference's (openclaw-rl/openclaw_api_server.py, _build_prm_judge_prompt), in
# our words; what ocrl adds (complaints about length, tone or format; "ok" and an empty tool output
# as neutral) is listed with its reason in
# docs/DESIGN-departures.md ("Departures from the reference").
_RUBRIC = """\
You are a process reward model: you judge one output of an AI assistant by what happened next. \
You see the output and the "next state" that followed it, and you decide whether the output did \
what the user wanted at that step, taking the next state as the evidence.

The next state is either the user's next message, or the result of a tool the assistant called. \
A tool result only exists because the assistant made the call; a clean result with no error means \
the call worked, which is good.

Score 1 (good) when the next state shows the step went as intended: the user moves on to \
something else, thanks the assistant or approves, the environment reports success, or a tool \
returns a result without error (data, a listing, a success status, passing tests).

Score -1 (bad) when the next state shows the output was wrong, incomplete or not wanted, notably:
- the user asks for the same thing to be done again ("again", "retry", "one more time");
- the user asks to change or fix what was just done ("make it X instead", "no, I meant ...", \
"not that", "please fix ...");
- the user repeats or rewords the same request, so it was not understood or not done;
- the user complains about length, tone or format, or says it still does not work;
- the tool or environment returns an error, a failure, a traceback or a non-zero exit code.

Score 0 (neutral) when the next state is ambiguous: an unrelated follow-up that neither confirms \
nor denies that the step worked, a bare acknowledgement such as "ok", an empty tool output, \
or too little to tell.

A request to change what the assistant just did is negative feedback, never a neutral new \
instruction: it says the output did not meet the need."""

_ANSWER_WITH_REASONING = (
    "Think it through step by step: first say whether the next state is (a) progress, (b) a "
    "correction, redo or change request, or (c) ambiguous; then give the score alone on the last "
    "line as \\boxed{1}, \\boxed{-1} or \\boxed{0}."
)
_ANSWER_ONLY = "Answer with the score alone: \\boxed{1}, \\boxed{-1} or \\boxed{0}."

# The assistant prefix the verdict judge continues: the next token is the verdict.
VERDICT_PREFIX = "\\boxed{"

_SOURCES = {
    "user": "the user's next message",
    "tool": "the output of the tool the assistant called",
}


def clip(text: str, limit: int) -> str:
    """Keep the head and the tail of a long text: errors and verdicts tend to sit at the ends."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


def _exchange(response: str, next_state: str, role: str, max_chars: int) -> str:
    """The reply and the next state that followed it, as both judges are shown them."""
    source = _SOURCES.get(role, f"a message from the {role or 'environment'}")
    return (
        f"Assistant reply:\n<reply>\n{clip(response, max_chars)}\n</reply>\n\n"
        f"Next state, {source}:\n<next_state>\n{clip(next_state, max_chars)}\n</next_state>\n\n"
    )


def judge_messages(
    response: str, next_state: str, role: str, *, reasoning: bool = True, max_chars: int = 6000
) -> ChatMessages:
    """The judge's chat: the rubric as system message, the response and next state as user
    message. With `reasoning=False` it asks for the boxed score alone (the verdict judge)."""
    answer = _ANSWER_WITH_REASONING if reasoning else _ANSWER_ONLY
    user = _exchange(response, next_state, role, max_chars) + f"How good was the assistant reply, judging by the next state? {answer}"
    return [{"role": "system", "content": f"{_RUBRIC}\n\n{answer}"}, {"role": "user", "content": user}]


def verdict_messages(response: str, next_state: str, role: str) -> ChatMessages:
    """The verdict judge's chat: the judge chat asking for the score alone, ending in the
    assistant prefix `\\boxed{`; the engine must render it as a prefix to continue (no
    end-of-turn token after it), e.g. `continue_final_message=True`."""
    return [
        *judge_messages(response, next_state, role, reasoning=False),
        {"role": "assistant", "content": VERDICT_PREFIX},
    ]


# -- the hint rubric (--method opd|combine) -----------------------------------------------------

HINT_START, HINT_END = "[HINT]", "[/HINT]"

_HINT_RUBRIC = f"""\
You read one reply of an AI assistant and the message that came right after it, the "next \
state": the user's next message or the output of a tool the assistant called. Decide whether \
the next state reveals something the assistant should have known when it wrote the reply: a \
correction, a preference about length, tone or format, a missing step, a fact, an error to avoid.

If it does, write that lesson as a short instruction to the assistant (one or two sentences, \
imperative, general enough to apply before the reply was written) between {HINT_START} and \
{HINT_END}, then give \\boxed{{1}} on the last line. If the next state teaches nothing (thanks, \
approval, a new unrelated task, an empty output), answer \\boxed{{-1}} with no hint."""


def hint_messages(response: str, next_state: str, role: str, *, max_chars: int = 6000) -> ChatMessages:
    """The hint judge's chat: its rubric as system message, the reply and next state as user message."""
    user = _exchange(response, next_state, role, max_chars) + (
        f"Does the next state teach the assistant something? Hint between {HINT_START} and {HINT_END}, then \\boxed{{1}}; "
        "or \\boxed{-1}."
    )
    return [{"role": "system", "content": _HINT_RUBRIC}, {"role": "user", "content": user}]
