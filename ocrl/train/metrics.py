"""What a training step reports: the loss diagnostics summed over its micro-batches, and the
step's metrics row.

`LossSums` adds up each micro-batch's diagnostics weighted by what they are means over (samples
or tokens) and divides once, so the step reports the full-batch numbers whatever the packing.
`StepMetrics` is the row a step records, publishes and returns; a field renamed here fails where
it is built, instead of reading as missing downstream. `note_teacher` adds a micro-batch's
teacher advantage (--method opd|combine) to the sums and returns the distilled records' rows.
Knows the loss's diagnostics and a micro-batch's tensors, never models, the optimizer or the
engine.
"""

from __future__ import annotations

import msgspec
import torch

from ocrl.train.loss import opd_advantages
from ocrl.train.policy import TeacherRows
from ocrl.types import Sample

# Every step's row has these (the distillation fields only with --method opd|combine).
METRIC_KEYS = (
    "step", "weights_version", "loss", "pg_loss", "kl", "clip_frac", "ratio_mean", "ratio_max",
    "entropy", "mismatch", "grad_norm", "reward_mean", "masked_fraction", "tokens", "samples",
    "step_seconds", "yield_seconds", "swap_seconds",
)  # fmt: skip


class LossSums(msgspec.Struct):
    """Weighted sums over a step's micro-batches of `policy_loss`'s diagnostics."""

    samples: int = 0  # the divisor of sample means (the step's batch, mask-0 samples included)
    loss: float = 0.0  # sample means x samples, from here to entropy
    pg_loss: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    tokens: int = 0  # masked-in tokens: the divisor of token means
    clip_frac: float = 0.0  # token means x tokens, from here to mismatch
    ratio_mean: float = 0.0
    mismatch: float = 0.0  # sum of |old - rollout| log-probs
    ratio_max: float = 0.0
    distilled: int = 0  # samples with a teacher signal
    taught_tokens: int = 0  # their masked-in tokens
    teacher_advantage: float = 0.0  # sum of teacher - old over those tokens
    distill_kl: float = 0.0  # top-K KL x distilled samples, summed over micro-batches that had one

    def add(self, diagnostics: dict[str, float], *, samples: int, tokens: int, mismatch: float) -> None:
        """One micro-batch of `samples` rows and `tokens` masked-in tokens; `mismatch` is its sum."""
        self.loss += diagnostics["loss"] * samples
        self.pg_loss += diagnostics["pg_loss"] * samples
        self.kl += diagnostics["kl"] * samples
        self.entropy += diagnostics["entropy"] * samples
        self.clip_frac += diagnostics["clip_frac"] * tokens
        self.ratio_mean += diagnostics["ratio_mean"] * tokens
        self.mismatch += mismatch
        self.tokens += tokens
        self.ratio_max = max(self.ratio_max, diagnostics["ratio_max"])

    def add_teacher(self, *, rows: int, tokens: int, advantage: float, diagnostics: dict[str, float]) -> None:
        """The distilled rows of one micro-batch: their count, tokens, summed teacher - old, and
        the loss's top-K KL (a mean over those rows) when it computed one."""
        self.distilled += rows
        self.taught_tokens += tokens
        self.teacher_advantage += advantage
        if "distill_kl" in diagnostics:
            self.distill_kl += diagnostics["distill_kl"] * rows

    def means(self, *, distill: bool, topk: bool) -> dict[str, float]:
        """The step's loss diagnostics: sample means over `samples`, token means over `tokens`."""
        per_sample, per_token = self.samples, max(self.tokens, 1)
        out = {
            "loss": self.loss / per_sample,
            "pg_loss": self.pg_loss / per_sample,
            "kl": self.kl / per_sample,
            "entropy": self.entropy / per_sample,
            "clip_frac": self.clip_frac / per_token,
            "ratio_mean": self.ratio_mean / per_token,
            "mismatch": self.mismatch / per_token,
            "ratio_max": self.ratio_max,
        }
        if distill:
            out["distilled"] = self.distilled / per_sample  # share of the batch with a teacher signal
            out["teacher_advantage"] = self.teacher_advantage / max(self.taught_tokens, 1)  # token mean
            if topk:
                out["distill_kl"] = self.distill_kl / max(self.distilled, 1)
        return out


def note_teacher(
    sums: LossSums, group: list[Sample], mask: torch.Tensor, old: torch.Tensor, teacher: TeacherRows, diagnostics: dict[str, float]
) -> list[dict]:
    """The teacher advantage (teacher - old) of a micro-batch's distilled samples: added to
    `sums` for the metrics, and returned per sample for the distilled records. `mask` (B, R) is
    the micro-batch's loss mask, `old` (B, R) its old log-probs."""
    taught_mask = mask & teacher.distilled.unsqueeze(-1)  # (B, R)
    gap = opd_advantages(teacher.logprobs, old, taught_mask)  # (B, R)
    rows = int(teacher.distilled.sum())
    sums.add_teacher(rows=rows, tokens=int(taught_mask.sum()), advantage=gap.sum().item(), diagnostics=diagnostics)
    distilled = []
    for row, sample in enumerate(group):
        if teacher.distilled[row]:
            n = int(taught_mask[row].sum())
            distilled.append({
                "sample_id": sample.sample_id, "hint": sample.hint, "experience": len(sample.experience),
                "teacher_advantage": gap[row].sum().item() / max(n, 1), "tokens": n,
            })  # fmt: skip
    return distilled


class StepMetrics(msgspec.Struct, kw_only=True):
    """One step's metrics row (the loss means, then the optimizer, batch, swap and timing)."""

    loss: float
    pg_loss: float
    kl: float
    entropy: float
    clip_frac: float
    ratio_mean: float
    mismatch: float
    ratio_max: float
    grad_norm: float
    yield_seconds: float  # waited at yield points for serving
    step_seconds: float  # the torch work, without that wait
    reward_mean: float
    masked_fraction: float  # the share of response tokens that are trained on (loss_mask 1)
    tokens: float
    samples: float  # drawn, mask-0 ones included
    trained_samples: float
    prefetched: float  # the share of the trained samples whose reference work was done before the step
    swap_seconds: float
    verified: float  # 1.0 when the engine served the probe as we computed it
    probe_diff: float
    distilled: float | None = None  # --method opd|combine only, from here on
    teacher_advantage: float | None = None
    distill_kl: float | None = None  # --distill-topk only

    def as_dict(self) -> dict[str, float]:
        """The row as records and events carry it: the fields that apply to this method."""
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}
