import json

import pytest
import torch

from ocrl.judge import embed, flipcheck


def _cases(tmp_path):
    path = tmp_path / "set.jsonl"
    lines = [
        {"response": "r", "next_state": "thanks!", "role": "user", "expected": 1, "kind": "thanks"},
        {"response": "r", "next_state": "meh. rebuild it", "role": "user", "expected": -1, "kind": "redo"},
        {"response": "r", "next_state": "Traceback (most recent call last):\nValueError: x", "role": "tool", "expected": -1, "kind": "tool_error"},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_dump_caches_the_readers_probabilities_per_case_and_the_rule_reruns_on_them(tmp_path):
    read_calls = []

    def read(items):  # a committee that reads every next state as sure approval
        read_calls.append(list(items))
        return torch.tensor([[0.97, 0.02, 0.01]] * len(items))

    rows = flipcheck.dump(read, [_cases(tmp_path)])
    assert [row["file"] for row in rows] == ["set.jsonl"] * 3 and len(read_calls) == 1
    assert read_calls[0][0] == ("thanks!", "user", "r") and rows[1]["probs"] == pytest.approx([0.97, 0.02, 0.01])
    # the rule: "meh." waves the answer away, a traceback is a failure, whatever the committee read
    scores = flipcheck.decide_all(rows)
    assert scores == [1, -1, -1]
    assert flipcheck.summarise(rows, scores) == {"set.jsonl": (3, 3, 0)}
    # a rule that reads the probabilities alone (the argmax) flips two of them away from their labels
    argmax = flipcheck.decide_all(rows, decide=lambda probs, text, role: (max(probs, key=probs.get), None))
    assert argmax == [1, 1, 1] and flipcheck.summarise(rows, argmax) == {"set.jsonl": (1, 3, 2)}
    changed = flipcheck.flips(rows, argmax, scores)
    assert [(direction, row["kind"]) for direction, row, _, _ in changed] == [("toward", "redo"), ("toward", "tool_error")]
    assert embed.decide({1: 0.97, -1: 0.02, 0: 0.01}, "thanks!", "user") == (1, None)


def test_check_prints_each_file_and_the_flips_against_saved_decisions(tmp_path, capsys):
    rows = flipcheck.dump(lambda items: torch.tensor([[0.97, 0.02, 0.01]] * len(items)), [_cases(tmp_path)])
    probs, before = tmp_path / "probs.json", tmp_path / "before.json"
    probs.write_text(json.dumps(rows))
    before.write_text(json.dumps([1, 1, 1]))
    assert flipcheck.main(["check", str(probs), "--against", str(before), "--save", str(tmp_path / "after.json")]) == 0
    out = capsys.readouterr().out
    assert "set.jsonl" in out and "3/3" in out and "toward 2, away 0" in out
    assert json.loads((tmp_path / "after.json").read_text()) == [1, -1, -1]
