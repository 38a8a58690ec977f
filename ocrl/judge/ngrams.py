"""The CPU judge's lexical reader: a linear model over hashed character and word n-grams of the
text a classifier reads (`classifier.judge_text`), fitted on the same labelled cases.

The fine-tuned encoder reads meaning and smooths over the exact form of a message; this reads
the form: a status word in a tool's output ("BackOff", "Invalid: 0"), a suffix, a spelling, a
word in another language. The two err on different cases, so the judge averages their class
probabilities (`committee.MEMBERS`). It fits in seconds (full-batch Adagrad, class-balanced
cross-entropy, seeded), so it adds nothing worth counting to the install, and reads a case in
about a millisecond. Cached beside the classifiers, keyed by the fit data and its settings.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from ocrl.judge.cases import Case
from ocrl.judge.classifier import LABELS, Item, item_of, judge_text, labels_to_index
from ocrl.judge.fitted import weights_path

if TYPE_CHECKING:
    import torch

class NGramSettings(msgspec.Struct, frozen=True):
    """The n-grams read and how the model is fitted; part of the cache key. Chosen by 3-fold
    cross-validation on the fit data, by the committee's score (the model alone, argmax: 0.863
    with characters 2-5 and 2^18 slots, 0.869 as set; word trigrams, or 300 steps without L2,
    did no better)."""

    chars: tuple[int, int] = (1, 6)  # character n-gram lengths, over the lower-cased text with its whitespace squeezed
    words: int = 2  # word n-grams up to this length (punctuation marks count as words)
    buckets: int = 1 << 20  # hashed feature slots (12 MiB of weights)
    epochs: int = 150  # full-batch steps
    lr: float = 0.3  # Adagrad
    weight_decay: float = 1e-7  # L2 on the feature weights
    max_chars: int = 400  # characters kept of a long next state (as the classifier keeps them)
    seed: int = 0
    version: int = 1  # bump when the features or the fit change


_WORDS = re.compile(r"\w+|[^\w\s]")


def ngrams(text: str, settings: NGramSettings) -> dict[str, int]:
    """The text's n-grams and their counts: characters ("c" prefix, the text padded with a space
    each side) and words ("w" prefix)."""
    text = text.lower()
    padded = " " + re.sub(r"\s+", " ", text) + " "
    counts: dict[str, int] = {}
    low, high = settings.chars
    for n in range(low, high + 1):
        for start in range(len(padded) - n + 1):
            gram = "c" + padded[start : start + n]
            counts[gram] = counts.get(gram, 0) + 1
    words = _WORDS.findall(text)
    for n in range(1, settings.words + 1):
        for start in range(len(words) - n + 1):
            gram = "w" + " ".join(words[start : start + n])
            counts[gram] = counts.get(gram, 0) + 1
    return counts


def hashed(texts: Sequence[str], settings: NGramSettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The texts as an `EmbeddingBag` batch: feature slots (crc32 of each n-gram, stable across
    processes), each text's offset into them, and weights (1 + log count, L2-normalised per text)."""
    import torch

    slots: list[int] = []
    weights: list[float] = []
    offsets: list[int] = []
    for text in texts:
        offsets.append(len(slots))
        counts = ngrams(text, settings)
        norm = math.sqrt(sum((1 + math.log(count)) ** 2 for count in counts.values())) or 1.0
        for gram, count in counts.items():
            slots.append(zlib.crc32(gram.encode()) % settings.buckets)
            weights.append((1 + math.log(count)) / norm)
    return torch.tensor(slots, dtype=torch.long), torch.tensor(offsets, dtype=torch.long), torch.tensor(weights)


class NGramModel:
    """A committee member (`fitted.Reader`): class probabilities (in `classifier.LABELS` order)
    from a linear layer over hashed n-grams."""

    def __init__(self, settings: NGramSettings = NGramSettings()) -> None:
        import torch

        self.name = "n-gram model"
        self.settings = settings
        self.weight = torch.nn.EmbeddingBag(settings.buckets, len(LABELS), mode="sum")
        torch.nn.init.zeros_(self.weight.weight)
        self.bias = torch.nn.Parameter(torch.zeros(len(LABELS)))

    def texts(self, items: Sequence[Item]) -> list[str]:
        """What it reads of (next state, role, response) items: the role and the next state, as
        the classifier reads them without the response."""
        return [judge_text(next_state, role, self.settings.max_chars) for next_state, role, _ in items]

    def logits(self, texts: Sequence[str]) -> torch.Tensor:
        return self.forward(hashed(texts, self.settings))

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """(B, C) logits of a `hashed` batch."""
        slots, offsets, weights = batch
        return self.weight(slots, offsets, per_sample_weights=weights) + self.bias

    def read(self, items: Sequence[Item]) -> torch.Tensor:
        """(B, C) class probabilities of (next state, role, response) items."""
        import torch

        with torch.inference_mode():
            return self.logits(self.texts(items)).softmax(dim=-1)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight.weight.detach().contiguous(), "bias": self.bias.detach().contiguous()}

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        import torch

        with torch.no_grad():
            self.weight.weight.copy_(tensors["weight"])
            self.bias.copy_(tensors["bias"])

    def fit(self, cases: Sequence[Case], progress: Callable[[str], None] | None = None) -> None:
        """Fits it in place on labelled cases: full-batch Adagrad on class-balanced
        cross-entropy plus L2 on the feature weights, from zero weights (so deterministic)."""
        import torch

        settings = self.settings
        batch = hashed(self.texts([item_of(case) for case in cases]), settings)
        y = labels_to_index(cases)  # (N,)
        counts = torch.bincount(y, minlength=self.bias.numel()).clamp(min=1).float()
        class_weight = counts.sum() / (len(counts) * counts)  # (C,)
        optimizer = torch.optim.Adagrad([self.weight.weight, self.bias], lr=settings.lr)
        for _ in range(settings.epochs):
            loss = torch.nn.functional.cross_entropy(self.forward(batch), y, weight=class_weight)
            loss = loss + settings.weight_decay * self.weight.weight.pow(2).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    def cache_path(self, data: bytes) -> Path:
        """Where it is cached once fitted on this data: keyed by the data and the settings."""
        return weights_path("ngrams", data, msgspec.json.encode(self.settings))
