"""The run directory: JSONL records of turns, verdicts, samples and metrics, and the sample journal.

The journal is what makes samples survive a crash: a sample is appended and fsynced to
`journal.jsonl` before it is queued, and its id is appended to `consumed.jsonl` once a training
step has used it. On restart, journaled minus consumed is the backlog to re-queue. Main turns
(`turns.jsonl`) and the next states that close them (`next_states.jsonl`) are fsynced too, so a
turn that had no sample yet when the process died is judged (or waits for its next state) again.
A resumed run that restored an older checkpoint appends `{"resumed_at": step}` to
`consumed.jsonl`: rows of later steps before it no longer count (those weights were lost). This
module knows nothing of how samples are made or trained on, nor of bytes on disk: each file is
a `jsonl.Appender`, which writes a row whole or not at all.

A failed write (a full disk) raises `DiskFull` for the rows that must not be lost (turns, next
states, the journal) and sets `full`; consumed marks that cannot be written are owed and written first once
space returns (`recover`); rows that are only a report (verdicts, metrics, ...) are dropped
and counted.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import msgspec

from ocrl.jsonl import Appender, DiskFull, decoded, has_room, lines
from ocrl.types import Message, Sample, Turn, Vote

log = logging.getLogger("ocrl.records")

_sample_decoder = msgspec.json.Decoder(Sample)


class Consumed(msgspec.Struct, array_like=True):
    id: str
    step: int | None


class Excluded(msgspec.Struct, array_like=True):
    """A Consumed row (step None: excluded by rule) that says which rule; read back as Consumed."""

    id: str
    step: None
    reason: str


class Resumed(msgspec.Struct):
    resumed_at: int


class NextState(msgspec.Struct):
    sample_id: str
    message: Message


_consumed_decoder = msgspec.json.Decoder(Consumed | dict | str)
_next_state_decoder = msgspec.json.Decoder(NextState)


def new_run_dir(root: str = "runs") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(root) / stamp
    n = 1
    while path.exists():
        n += 1
        path = Path(root) / f"{stamp}-{n}"
    return path


def newest_run_dir(root: str = "runs") -> Path | None:
    runs = sorted((p for p in Path(root).glob("*") if (p / "journal.jsonl").exists()), key=lambda p: p.stat().st_mtime)
    return runs[-1] if runs else None


def _without_text(sample: Sample) -> Sample:
    """The sample with the words of the conversation dropped (--no-record-text); ids stay."""
    return msgspec.structs.replace(
        sample, next_state=None, hint=None if sample.hint is None else "", experience=["" for _ in sample.experience],
        hint_votes=[Vote(v.score, "") for v in sample.hint_votes],
    )


class NoRecords:
    """Records for a run that keeps none: the real signatures, nothing written, never full."""

    dir = None
    full = False

    def turn(self, turn) -> None:
        pass

    def next_state(self, sample_id: str, message: Message) -> None:
        pass

    def verdict(self, session_id: str, index: int, verdict, next_state: str | None, role: str | None) -> None:
        pass

    def hint(self, session_id: str, index: int, hint) -> None:
        pass

    def metric(self, row: dict) -> None:
        pass

    def distill(self, rows: list[dict]) -> None:
        pass

    def consumed(self, sample_ids: list[str], step: int | None = None, reason: str | None = None) -> None:
        pass

    def forget_token_ids(self, through_step: int, keep: int = 0) -> int:
        return 0


class Records:
    def __init__(self, directory: Path, *, record_text: bool = True):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.record_text = record_text
        self.turns = Appender(self.dir / "turns.jsonl", durable=True)
        self._next_states = Appender(self.dir / "next_states.jsonl", durable=True)
        self.verdicts = Appender(self.dir / "verdicts.jsonl")
        self.hints = Appender(self.dir / "hints.jsonl")  # --method opd|combine: the hint judge's answers
        self.distilled = Appender(self.dir / "distilled.jsonl")  # per distilled sample: its teacher advantage at its step
        self.samples = Appender(self.dir / "samples.jsonl")
        self.metrics = Appender(self.dir / "metrics.jsonl")
        self._journal = Appender(self.dir / "journal.jsonl", durable=True)
        self._consumed = Appender(self.dir / "consumed.jsonl", durable=True)
        self.full = False  # a write failed; main turns wait until `recover` finds space
        self.dropped_rows = 0  # report rows (verdicts, metrics, ...) lost to a failed write
        self._owed: list[Consumed | Excluded] = []  # consumed marks not yet written
        self._forgotten: set[str] = set()  # sample ids whose token ids were blanked (--retain-samples)

    def _critical(self, appender: Appender, rows: list) -> None:
        try:
            appender.write_many(rows)
        except DiskFull:
            if not self.full:
                log.error("the record dir %s cannot be written (disk full?): new main turns are refused until it can", self.dir)
            self.full = True
            raise

    def _report(self, appender: Appender, row) -> None:
        try:
            appender.write(row)
        except DiskFull:
            self.full = True
            self.dropped_rows += 1

    def recover(self, headroom: int = 1 << 20) -> bool:
        """After a failed write: writes the owed consumed marks, then checks that `headroom`
        bytes fit beside the records; True (and `full` cleared) when both succeed."""
        if not self.full and not self._owed:
            return True
        if self._owed:
            try:
                self._consumed.write_many(self._owed)
            except DiskFull:
                return False
            self._owed = []
        if not has_room(self.dir, headroom):
            return False
        if self.full:
            log.info("the record dir can be written again: main turns are taken again")
        self.full = False
        return True

    def consumed_ids(self, trained_through: int | None = None) -> set[str]:
        """Ids marked consumed. With `trained_through` (the step of the checkpoint a resumed run
        starts from), ids trained by later steps do not count: those weights were lost, so the
        samples go back in the queue and are trained once into the weights that survive."""
        rows = self.consumed_rows()
        return {r.id for r in rows if trained_through is None or r.step is None or r.step <= trained_through}

    def consumed_rows(self) -> list[Consumed]:
        """The rows that stand: those voided by a later `resumed_at` marker left out."""
        rows: list[Consumed] = []
        for line in lines(self.dir / "consumed.jsonl"):
            try:
                row = _consumed_decoder.decode(line)
                if isinstance(row, dict):
                    row = msgspec.convert(row, Resumed)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # a torn last line
            if isinstance(row, Resumed):
                rows = [r for r in rows if r.step is None or r.step <= row.resumed_at]
            else:
                rows.append(Consumed(row, None) if isinstance(row, str) else row)
        return rows

    def mark_resumed(self, step: int) -> None:
        """A resumed run restored the checkpoint of `step`: later steps' rows stop counting."""
        if any(r.step is not None and r.step > step for r in self.consumed_rows()):
            self._critical(self._consumed, [Resumed(step)])

    def journaled(self) -> dict[str, bool]:
        """Journaled sample ids -> whether the sample is effective (has a loss-mask 1 token)."""
        return {sample.sample_id: sample.effective for sample in decoded(self.dir / "journal.jsonl", _sample_decoder)}

    def main_turns(self) -> list[Turn]:
        """Main turns recorded by earlier processes (text fields empty when not recorded)."""
        out = []
        for line in lines(self.dir / "turns.jsonl"):
            try:
                row = msgspec.json.decode(line)
                if row.get("turn_type") != "main":
                    continue
                row["messages"] = row.get("messages") or []
                row["response_text"] = row.get("response_text") or ""
                out.append(msgspec.convert(row, Turn))
            except (msgspec.DecodeError, msgspec.ValidationError, AttributeError):
                continue  # a torn last line, or a row of an older format
        return out

    def next_state(self, sample_id: str, message: Message) -> None:
        if not self.record_text:
            message = msgspec.structs.replace(message, content=None, tool_calls=None)
        self._critical(self._next_states, [NextState(sample_id, message)])

    def next_states(self) -> dict[str, Message]:
        return {row.sample_id: row.message for row in decoded(self.dir / "next_states.jsonl", _next_state_decoder)}

    def backlog(self, trained_through: int | None = None) -> list[Sample]:
        """Samples journaled by an earlier process and not yet trained on, in journal order."""
        consumed = self.consumed_ids(trained_through)
        seen, out = set(), []
        for sample in decoded(self.dir / "journal.jsonl", _sample_decoder):
            if sample.sample_id not in consumed and sample.sample_id not in seen:
                seen.add(sample.sample_id)
                out.append(sample)
        return out


    def journal(self, sample: Sample) -> None:
        """Raises `DiskFull` when the sample could not be made durable (it must not be queued)."""
        if not self.record_text:  # token ids stay: they are what training needs
            sample = _without_text(sample)
        self._critical(self._journal, [sample])

    def consumed(self, sample_ids: list[str], step: int | None = None, reason: str | None = None) -> None:
        """Marks samples used: by training step `step`, or (None) excluded by rule (mask 0; or
        `reason`, e.g. too_long: the row says which). On a failed write the marks are owed
        (`owed_consumed`) and written by `recover`."""
        rows = [Excluded(sample_id, None, reason) if reason else Consumed(sample_id, step) for sample_id in sample_ids]
        if self._owed:  # in order: owed marks first
            rows, self._owed = self._owed + rows, []
        try:
            self._critical(self._consumed, rows)
        except DiskFull:
            self._owed = rows

    @property
    def owed_consumed(self) -> int:
        return len(self._owed)

    def _text(self, obj: dict, *keys: str) -> dict:
        if not self.record_text:
            for key in keys:
                if key in obj:
                    obj[key] = None
        return obj

    def turn(self, turn) -> None:
        """A main turn raises `DiskFull` when it cannot be kept; a side turn is only a report."""
        row = self._text(msgspec.to_builtins(turn), "messages", "response_text", "tools")
        if not self.record_text and turn.turn_type != "main":  # never trained on: its ids serve no one
            row["prompt_ids"], row["response_ids"], row["logprobs"] = [], [], []
        if turn.turn_type == "main":
            self._critical(self.turns, [row])
        else:
            self._report(self.turns, row)

    def verdict(self, session_id: str, index: int, verdict, next_state: str | None, role: str | None) -> None:
        row = {"session_id": session_id, "turn_index": index, "role": role, "next_state": next_state, **msgspec.to_builtins(verdict)}
        if not self.record_text:
            row["next_state"] = None
        self._report(self.verdicts, row)

    def hint(self, session_id: str, index: int, hint) -> None:
        row = {"session_id": session_id, "turn_index": index, **msgspec.to_builtins(hint)}
        if not self.record_text:
            row["hint"], row["votes"] = (None if row["hint"] is None else ""), [{**v, "text": ""} for v in row["votes"]]
        self._report(self.hints, row)

    def distill(self, rows: list[dict]) -> None:
        for row in rows:
            self._report(self.distilled, self._text(dict(row), "hint"))

    def sample(self, sample: Sample) -> None:
        if not self.record_text:
            sample = _without_text(sample)
        self._report(self.samples, msgspec.to_builtins(sample))

    def metric(self, row: dict) -> None:
        self._report(self.metrics, row)

    def forget_token_ids(self, through_step: int, keep: int = 0) -> int:
        """--retain-samples: blanks the token ids (the conversation, in another alphabet) of
        samples consumed by step `through_step` or earlier, or excluded by rule, in the journal,
        the sample log and the main turns, keeping the newest `keep` of them. Call once a
        checkpoint covers `through_step`: those samples are never read again. Returns how many
        were forgotten now."""
        covered = list(dict.fromkeys(r.id for r in self.consumed_rows() if r.step is None or r.step <= through_step))
        forget = set(covered[: len(covered) - keep] if keep else covered) - self._forgotten
        if not forget:
            return 0

        def blank(row: dict, *keys: str) -> dict:
            for key in keys:
                if row.get(key):
                    row[key] = [] if key != "teacher_prompt_ids" else None
            return row

        def sample_row(row: dict) -> dict:
            return blank(row, "tokens", "rollout_logprobs", "teacher_prompt_ids") if row.get("sample_id") in forget else row

        def turn_row(row: dict) -> dict:
            if f"{row.get('session_id')}:{row.get('session_uid')}:{row.get('index')}" in forget:
                return blank(row, "prompt_ids", "response_ids", "logprobs")
            return row

        try:
            self._journal = self._journal.rewritten(sample_row)
            self.samples = self.samples.rewritten(sample_row)
            self.turns = self.turns.rewritten(turn_row)
        except OSError as e:  # a full disk: the ids stay until the next checkpoint tries again
            log.warning("could not forget the token ids of %d consumed samples: %s", len(forget), e)
            return 0
        self._forgotten |= forget
        return len(forget)

    def close(self) -> None:
        if self._owed:
            self.recover(headroom=0)
        for appender in (self.turns, self._next_states, self.verdicts, self.hints, self.distilled, self.samples, self.metrics, self._journal, self._consumed):
            appender.close()
