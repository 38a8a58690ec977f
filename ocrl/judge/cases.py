"""Measuring a judge: labelled cases (a response, its next state, the verdict a good judge
gives), loaded from JSONL, and a judge's accuracy on them with its confusion matrix and misses.

Used by the tests, `python -m ocrl.judge.embed` and the benchmarks; it calls a judge only
through the `Judge` protocol and knows nothing of how any judge works.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import msgspec

from ocrl.judge.votes import SCORES, Judge


class Case(msgspec.Struct):
    """One labelled example: a next state, its role, the verdict a good judge gives, and the
    response before it (some fit lines have none: the embed judge does not read it)."""

    next_state: str
    role: str
    expected: Literal[1, -1, 0]
    kind: str = ""
    response: str = ""


def load_cases(path: str | Path) -> list[Case]:
    """Cases from a JSONL file, one object per line; decoding with the type validates them."""
    decoder = msgspec.json.Decoder(Case)
    return [decoder.decode(line) for line in Path(path).read_bytes().splitlines() if line.strip()]


async def evaluate(judge: Judge, cases: Sequence[Case], *, show: bool = True) -> dict:
    """Accuracy of a judge on cases, one at a time. `confusion[expected][predicted]` counts the
    verdicts; `misses` lists the cases it got wrong with the first vote's text. With `show` it
    prints the report (`format_report`): accuracy, the confusion matrix and every miss."""
    started = time.perf_counter()
    judged = []
    for case in cases:
        verdict = await judge.judge(case.response, case.next_state, case.role)
        judged.append((verdict.score, verdict.votes[0].text if verdict.votes else ""))
    report = tally(judge.name, cases, judged, time.perf_counter() - started)
    if show:
        print(format_report(report))
    return report


def tally(name: str, cases: Sequence[Case], judged: Sequence[tuple[int, str]], seconds: float) -> dict:
    """The report of a judge's (score, first vote text) per case: accuracy, the confusion matrix
    `confusion[expected][predicted]` and the misses (what `format_report` prints)."""
    confusion = {expected: {predicted: 0 for predicted in SCORES} for expected in SCORES}
    misses = []
    for case, (score, vote) in zip(cases, judged, strict=True):
        confusion[case.expected][score] += 1
        if score != case.expected:
            misses.append({"kind": case.kind, "next_state": case.next_state, "expected": case.expected, "score": score, "vote": vote})
    n = len(cases)
    return {
        "judge": name,
        "n": n,
        "accuracy": sum(confusion[score][score] for score in SCORES) / n if n else 0.0,
        "confusion": confusion,
        "seconds_per_case": seconds / n if n else 0.0,
        "misses": misses,
    }


def format_report(report: dict) -> str:
    """An `evaluate` report as text: accuracy, the confusion matrix (rows: expected, columns:
    the judge's score) and one line per miss."""
    confusion = report["confusion"]
    correct = sum(confusion[score][score] for score in SCORES)
    lines = [
        f"judge {report['judge']}: {correct}/{report['n']} = {report['accuracy']:.3f}, "
        f"{1000 * report['seconds_per_case']:.0f} ms/case",
        "expected \\ judged     +1     -1      0",
    ]
    for expected in SCORES:
        lines.append(f"{expected:>+17d} " + " ".join(f"{confusion[expected][judged]:>6d}" for judged in SCORES))
    lines.append(f"misses ({len(report['misses'])}):")
    for miss in report["misses"]:
        state = " ".join(miss["next_state"].split())
        state = state if len(state) <= 90 else state[:87] + "..."
        lines.append(f"  {miss['expected']:+d} judged {miss['score']:+d}  [{miss['kind']}] {state!r}  ({miss['vote']})")
    return "\n".join(lines)
