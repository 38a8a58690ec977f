"""The latest training samples, newest first: session, turn, votes, verdict, mask, reward, the
signal it carries (rl, opd, combine or none), its teacher advantage once a step trained on it
(--method opd|combine), tokens, weights version. A row promoted by the at-least-one rule, or
masked out, is styled so it stands out. Keeps the samples it shows so a selected row can be
opened in full.
"""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.widgets import DataTable

from ocrl.types import Sample

PROMOTED_STYLE = "bold #e0af68"  # mask forced to 1 by the at-least-one rule
MASKED_STYLE = "dim italic"  # mask 0: kept in the records, not trained on
COLUMNS = (
    ("#", "seq"), ("session", "session"), ("turn", "turn"), ("votes", "votes"), ("verdict", "verdict"),
    ("mask", "mask"), ("reward", "reward"), ("signal", "kind"), ("teacher", "teacher"), ("tokens", "tokens"), ("ver", "version"),
)  # fmt: skip


def score_text(score: int | None) -> str:
    return "?" if score is None else f"{score:+d}" if score else "0"


def vote_text(vote) -> str:
    """A vote as the table shows it; `✂` for one cut at the judge's token budget (no score)."""
    return "✂" if vote.truncated else score_text(vote.score)


def row_style(sample: Sample) -> str:
    if sample.promoted:
        return PROMOTED_STYLE
    return "" if sample.effective else MASKED_STYLE


def short(session_id: str, width: int = 14) -> str:
    return session_id if len(session_id) <= width else session_id[: width - 1] + "…"


def row_cells(seq: int, sample: Sample) -> list[str]:
    prompt = len(sample.tokens) - sample.response_length
    return [
        str(seq),
        short(sample.session_id),
        str(sample.turn_index),
        " ".join(vote_text(vote) for vote in sample.votes) or "—",
        "none" if sample.score is None else score_text(sample.score),
        ("1 promoted" if sample.promoted else "1") if sample.effective else "0",
        f"{sample.reward:+.2f}",
        sample.kind,
        "…" if sample.distilled else "—",  # filled in when a step trains on it
        f"{prompt}+{sample.response_length}",
        f"v{sample.weights_version}",
    ]


class SamplesTable(DataTable):
    DEFAULT_CSS = """
    SamplesTable { border: round $primary; height: 1fr; }
    """

    def __init__(self, *, max_rows: int = 500, **kwargs) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self.max_rows = max_rows
        self.samples: dict[str, Sample] = {}
        self.teacher_advantages: dict[str, float] = {}  # sample id -> token mean of teacher - old
        self._order: deque[str] = deque()
        self._seq = 0

    def on_mount(self) -> None:
        self.border_title = "latest samples"
        for label, key in COLUMNS:
            self.add_column(label, key=key)

    def add_sample(self, sample: Sample) -> bool:
        """Show `sample` on top; False when it is already shown."""
        if sample.sample_id in self.samples:
            return False
        following = self.cursor_row <= 0  # at the top: keep showing the newest
        selected = None if following or not self.row_count else self.coordinate_to_cell_key(self.cursor_coordinate).row_key
        self._seq += 1
        style = row_style(sample)
        self.add_row(*(Text(cell, style=style) for cell in row_cells(self._seq, sample)), key=sample.sample_id)
        self.samples[sample.sample_id] = sample
        self._order.append(sample.sample_id)
        while len(self._order) > self.max_rows:
            oldest = self._order.popleft()
            self.remove_row(oldest)
            self.samples.pop(oldest, None)
            self.teacher_advantages.pop(oldest, None)
        self.sort("seq", key=lambda cell: -int(cell.plain))
        if selected is not None and selected.value in self.samples:
            self.move_cursor(row=self.get_row_index(selected), animate=False)
        else:
            self.move_cursor(row=0, animate=False)
        self.border_subtitle = f"{len(self.samples)} shown"
        return True

    def set_teacher_advantages(self, advantages: dict[str, float]) -> None:
        """A step's teacher advantages, shown on the rows still in the table."""
        for sample_id, advantage in advantages.items():
            if sample_id in self.samples:
                self.teacher_advantages[sample_id] = advantage
                self.update_cell(sample_id, "teacher", Text(f"{advantage:+.2f}", style=row_style(self.samples[sample_id])))
