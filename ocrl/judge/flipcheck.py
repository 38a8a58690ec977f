"""Checking a change to the embed judge's decision rule before it is made: the committee's class
probabilities over labelled cases, computed once and written to a file (`dump`: the forward,
~20 ms a case), then the rule's decisions over them re-run in seconds (`decide_all`), counted
per file (`summarise`) and set against an earlier run's (`flips`: each changed decision, toward
or away from its label). Every cue and guard of the judge was chosen this way: a rule is kept
when its flips over every labelled case (the fit data and each spent held-out set) go toward the
labels. It knows nothing of the cues; the rule is `embed.decide`.

    python -m ocrl.judge.flipcheck dump PROBS.json CASES.jsonl ...
    python -m ocrl.judge.flipcheck check PROBS.json [--save DECISIONS.json] [--against DECISIONS.json]
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ocrl.judge.cases import load_cases
from ocrl.judge.classifier import LABELS, Item, item_of

if TYPE_CHECKING:
    import torch

Row = dict  # {"file", "next_state", "role", "expected", "kind", "probs": [p(+1), p(-1), p(0)]}


def dump(read: Callable[[Sequence[Item]], torch.Tensor], paths: Sequence[str | Path], batch: int = 64) -> list[Row]:
    """One row per labelled case of the files at `paths`: the case and the class probabilities
    `read` gives it (the committee of a loaded `EmbedJudge`: `judge.classifier`), in `LABELS` order."""
    rows = []
    for path in paths:
        cases = load_cases(path)
        for start in range(0, len(cases), batch):
            chunk = cases[start : start + batch]
            probs = read([item_of(case) for case in chunk])
            for case, row in zip(chunk, probs, strict=True):
                rows.append(
                    {"file": Path(path).name, "next_state": case.next_state, "role": case.role, "expected": case.expected,
                     "kind": case.kind, "probs": [float(p) for p in row]}
                )
    return rows


def decide_all(rows: Sequence[Row], decide: Callable[..., tuple[int, str | None]] | None = None) -> list[int]:
    """The rule's score for each row (an empty next state is 0, as the judge scores it)."""
    if decide is None:
        from ocrl.judge.embed import decide
    return [
        decide(dict(zip(LABELS, row["probs"], strict=True)), row["next_state"], row["role"])[0] if row["next_state"].strip() else 0
        for row in rows
    ]


def summarise(rows: Sequence[Row], scores: Sequence[int]) -> dict[str, tuple[int, int, int]]:
    """Per file: (right, cases, corrections read as +1)."""
    out: dict[str, list[int]] = {}
    for row, score in zip(rows, scores, strict=True):
        counts = out.setdefault(row["file"], [0, 0, 0])
        counts[0] += score == row["expected"]
        counts[1] += 1
        counts[2] += score == 1 and row["expected"] == -1
    return {name: (right, total, bad) for name, (right, total, bad) in out.items()}


def flips(rows: Sequence[Row], before: Sequence[int], after: Sequence[int]) -> list[tuple[str, Row, int, int]]:
    """Each row whose score changed: ("toward" when the new score is the label, "away" when the old
    one was, else "other"), the row, the old and the new score."""
    changed = []
    for row, old, new in zip(rows, before, after, strict=True):
        if old != new:
            direction = "toward" if new == row["expected"] else "away" if old == row["expected"] else "other"
            changed.append((direction, row, old, new))
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m ocrl.judge.flipcheck dump|check ...` (see the module's docstring)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ocrl.judge.flipcheck", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    dumping = sub.add_parser("dump", help="the committee's probabilities over labelled cases, to a file")
    dumping.add_argument("probs")
    dumping.add_argument("cases", nargs="+")
    checking = sub.add_parser("check", help="the rule's decisions over cached probabilities: per file, and flips")
    checking.add_argument("probs")
    checking.add_argument("--save", default="", help="write the decisions here (to check a later rule against)")
    checking.add_argument("--against", default="", help="decisions saved before: print each flip")
    args = parser.parse_args(argv)
    if args.command == "dump":
        import torch

        from ocrl.judge.embed import EmbedJudge

        torch.set_num_threads(1)
        rows = dump(EmbedJudge.load().classifier, args.cases)
        Path(args.probs).write_text(json.dumps(rows, ensure_ascii=False))
        print(f"{len(rows)} cases from {len(args.cases)} files -> {args.probs}")
        return 0
    rows = json.loads(Path(args.probs).read_text())
    scores = decide_all(rows)
    for name, (right, total, bad) in summarise(rows, scores).items():
        print(f"{name:32s} {right}/{total} = {right / total:.3f}  corrections at +1: {bad}")
    if args.against:
        changed = flips(rows, json.loads(Path(args.against).read_text()), scores)
        for direction, row, old, new in changed:
            print(f"{direction:6s} {row['file']} {row['kind']} {row['expected']:+d}: {old:+d} -> {new:+d}  {row['next_state'][:100]!r}")
        print(f"toward {sum(d == 'toward' for d, *_ in changed)}, away {sum(d == 'away' for d, *_ in changed)}")
    if args.save:
        Path(args.save).write_text(json.dumps(scores))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
