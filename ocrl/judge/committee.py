"""The CPU judge's committee: the readers of a next state it averages (`MEMBERS`: the fine-tuned
classifier of classifier.py and the n-gram model of ngrams.py, each with its weight), how they are
built and loaded from the cache (`new_member`, `load_committee`; each fits itself, and
fitted.py keeps their weights), and how
their class probabilities are combined (`Committee`: a weighted geometric mean). It knows nothing
of verdicts: the decision rule is in embed.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ocrl.judge.classifier import FIT_DATA, Classifier, FitSettings, Item
from ocrl.judge.fitted import Reader, load_or_fit
from ocrl.judge.ngrams import NGramModel, NGramSettings

if TYPE_CHECKING:
    import torch

# The committee the judge uses: each member with its weight in the weighted geometric mean of
# their class probabilities (a weighted mean of log-probabilities, renormalised). Chosen by 3-fold
# cross-validation on the fit data (4,848 cases; the decision rule on the out-of-fold
# probabilities, its margin and guards tuned with the weights): the fine-tuned classifier alone
# scored 0.902 with 30 corrections at +1 under the rule it was tuned with (0.906 / 30 at best
# retuned), the n-gram model alone reads 0.869 (argmax), and the two at 0.4 / 0.6 score 0.914
# with 27 (weights 0.5 / 0.5: 0.914 / 30): the encoder reads meaning, the n-grams the form, and
# they err on different cases. A member that reads the response too (RESPONSE_READER) measured
# 0.909 / 24 beside the classifier (an arithmetic mean, before the n-grams), but it more than
# doubles the judge's time (43 ms a case on one thread against 19) and the fitting at install
# (~11 minutes more on two cores), which took a fresh clone's `./run.sh test` past 30 minutes; it
# is ready for a box with the time for it.
RESPONSE_READER = FitSettings(response_chars=300, max_length=192)
MEMBERS: tuple[tuple[FitSettings | NGramSettings, float], ...] = ((FitSettings(), 0.4), (NGramSettings(), 0.6))


class Committee:
    """Readers fitted on the same cases that read them differently (`MEMBERS`): the weighted
    geometric mean of their class probabilities, renormalised (where one member is sure and the
    other hesitates, the sure one counts for more than in an arithmetic mean)."""

    def __init__(self, members: Sequence[Reader], weights: Sequence[float] | None = None) -> None:
        self.members = list(members)
        weights = list(weights) if weights is not None else [1.0] * len(self.members)
        self.weights = [weight / sum(weights) for weight in weights]  # summing to 1

    def __call__(self, items: Sequence[Item]) -> torch.Tensor:
        import torch

        logs = torch.stack([member.read(items).clamp(min=1e-6).log() for member in self.members])  # (M, B, C)
        return (logs * torch.tensor(self.weights).view(-1, 1, 1)).sum(0).softmax(dim=-1)  # (B, C)


def new_member(model_path: str | Path, settings: FitSettings | NGramSettings) -> Reader:
    """An unfitted committee member of these settings (an n-gram model reads no encoder)."""
    return NGramModel(settings) if isinstance(settings, NGramSettings) else Classifier(model_path, settings)


def load_committee(
    model_path: str | Path,
    members: Sequence[tuple[FitSettings | NGramSettings, float]] = MEMBERS,
    data_path: Path = FIT_DATA,
) -> Committee:
    """The committee of (settings, weight) members, each read from the cache or fitted."""
    readers = [load_or_fit(new_member(model_path, settings), data_path) for settings, _ in members]
    return Committee(readers, [weight for _, weight in members])
