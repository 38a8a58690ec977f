"""One sample in full: its numbers, the decoded prompt tail and response (when the source can
decode tokens), the next state that was judged, the text of each judge vote and, with
--method opd|combine, the hint, the experience the teacher saw, the hint votes and the
teacher advantage."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from ocrl.types import Sample
from tui.samples_table import score_text, vote_text
from tui.sources import Source


def summary(sample: Sample, teacher_advantage: float | None = None) -> str:
    prompt = len(sample.tokens) - sample.response_length
    mask = ("1 (promoted by the at-least-one rule)" if sample.promoted else "1") if sample.effective else "0 (not trained on)"
    verdict = "none (no next state)" if sample.score is None else score_text(sample.score)
    return (
        f"session {sample.session_id} · turn {sample.turn_index} · weights v{sample.weights_version}\n"
        f"verdict {verdict} · reward {sample.reward:+.2f} · mask {mask}\n"
        f"tokens: {prompt} prompt + {sample.response_length} response · id {sample.sample_id}\n"
        f"method {sample.method} · signal {sample.kind}" + (
            "" if not sample.distilled else
            f" · teacher prompt {len(sample.teacher_prompt_ids)} tokens · teacher advantage "
            + ("not trained yet" if teacher_advantage is None else f"{teacher_advantage:+.3f} (token mean of teacher - old)")
        )
    )


class SampleScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    SampleScreen { align: center middle; }
    SampleScreen > VerticalScroll { width: 90%; height: 90%; border: round $accent; background: $surface; padding: 0 1; }
    SampleScreen .heading { text-style: bold; color: $accent; margin-top: 1; }
    SampleScreen .body { color: $text; }
    SampleScreen .missing { color: $text-muted; text-style: italic; }
    """
    BINDINGS = [("escape", "dismiss", "Close"), ("q", "dismiss", "Close")]

    def __init__(self, sample: Sample, source: Source, *, teacher_advantage: float | None = None) -> None:
        super().__init__()
        self.sample = sample
        self.source = source
        self.teacher_advantage = teacher_advantage

    def compose(self) -> ComposeResult:
        sample = self.sample
        with VerticalScroll():
            yield Static(summary(sample, self.teacher_advantage), markup=False, id="summary")
            # Texts come from users and models: never parse them as markup.
            yield Static("prompt tail", classes="heading")
            yield Static("decoding…", markup=False, classes="missing", id="prompt-tail")
            yield Static("response", classes="heading")
            yield Static("decoding…", markup=False, classes="missing", id="response")
            role = f" ({sample.next_state_role})" if sample.next_state_role else ""
            yield Static(f"next state{role}", markup=False, classes="heading")
            if sample.next_state is None:
                yield Static("none: the session ended on this turn", classes="missing", id="next-state")
            else:
                yield Static(sample.next_state, markup=False, classes="body", id="next-state")
            yield Static(f"votes ({len(sample.votes)})", classes="heading")
            for i, vote in enumerate(sample.votes):
                yield Static(f"{i + 1}. {vote_text(vote)}", classes="heading")
                yield Static(vote.text or "(empty)", markup=False, classes="body", id=f"vote-{i}")
            if sample.method != "rl":
                yield Static("hint", classes="heading")
                yield Static(sample.hint or "none accepted", markup=False, classes="body" if sample.hint else "missing", id="hint")
                if sample.experience:
                    yield Static(f"experience the teacher also saw ({len(sample.experience)})", classes="heading")
                    yield Static("\n".join(f"- {h}" for h in sample.experience), markup=False, classes="body", id="experience")
                yield Static(f"hint votes ({len(sample.hint_votes)})", classes="heading")
                for i, vote in enumerate(sample.hint_votes):
                    yield Static(f"{i + 1}. {vote_text(vote)}: {vote.text or '(empty)'}", markup=False, classes="body", id=f"hint-vote-{i}")

    def on_mount(self) -> None:
        self.run_worker(self._decode(), exit_on_error=False)

    async def _decode(self) -> None:
        prompt_tail, response = self.query_one("#prompt-tail", Static), self.query_one("#response", Static)
        try:
            text = await self.source.sample_text(self.sample)
        except Exception as e:  # the detail view is best effort: say why, keep the rest
            text, reason = None, f"could not decode: {type(e).__name__}: {e}"
        else:
            reason = "not available from this source (token counts above)"
        if text is None:
            for widget in (prompt_tail, response):
                widget.update(reason)
            return
        for widget, content in ((prompt_tail, text.prompt_tail), (response, text.response)):
            widget.remove_class("missing")
            widget.add_class("body")
            widget.update(content)
