"""The help screen: what each panel shows and the keys."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

HELP = """\
# ocrl dashboard

| key | does |
|---|---|
| `q` | quit (a daemon in this process stops with it; an attached one keeps running) |
| `p` | pause / resume training (samples keep being collected) |
| `s` | save a checkpoint now |
| `enter` | open the selected sample: prompt tail, response, next state, each vote |
| `?` | this help (`escape` closes it) |

- **reward**: each sample's reward (dots) and their moving mean (line); underneath, the mean
  reward of each training step.
- **latest samples**: newest first. *Highlighted*: mask forced to 1 by the at-least-one rule
  (promoted). *Dim italic*: mask 0, recorded but not trained on. `votes` lists each judge
  vote (`?`: no parseable score; `✂`: cut at the judge's token budget, no vote); verdict `none`: the session ended before a next state.
- **losses per step**: policy-gradient loss, KL to the reference, clip fraction, entropy,
  gradient norm, each on its own scale.
- **sessions** and **engine**: the daemon's counters, read every second; under sessions,
  the most recently active ones. `votes truncated` counts judge votes cut at their token
  budget (`--prm-max-tokens`, `--hint-max-tokens`); a growing count means the budget is too small.
"""


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 84; max-width: 95%; height: auto; max-height: 90%;
        border: round $accent; background: $surface; padding: 0 1; }
    """
    BINDINGS = [("escape", "dismiss", "Close"), ("question_mark", "dismiss", "Close"), ("q", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Markdown(HELP)
