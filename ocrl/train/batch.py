"""Samples as tensors: which samples can be trained on, micro-batches under a token budget, and
the prompt/response views a probe and the teacher read.

Knows samples and token ids, never models, the loss or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ocrl.types import Sample


def sample_problem(sample: Sample, *, untrained_ok: bool = False) -> str | None:
    """Why a sample cannot be trained on, or None if it can. `untrained_ok`: a mask-0 sample may
    come too (--batch-counts all: it fills the batch and trains nothing)."""
    n = sample.response_length
    if n < 1 or n >= len(sample.tokens):
        return f"response_length {n} must be in [1, {len(sample.tokens)}) (a prompt token first)"
    if len(sample.loss_mask) != n or len(sample.rollout_logprobs) != n:
        return f"loss_mask/rollout_logprobs lengths {len(sample.loss_mask)}/{len(sample.rollout_logprobs)} != {n}"
    if not sample.effective and not untrained_ok:
        return "no masked-in token"
    return None


def split_prompt(sample: Sample) -> tuple[list[int], list[int]]:
    cut = len(sample.tokens) - sample.response_length
    return list(sample.tokens[:cut]), list(sample.tokens[cut:])


def teacher_view(sample: Sample) -> Sample:
    """The sample as the teacher reads it: the same response ids after the hinted prompt."""
    return probe_sample(sample.teacher_prompt_ids, split_prompt(sample)[1])


def probe_sample(prompt_ids: list[int], response_ids: list[int]) -> Sample:
    """Token ids only: what a swap probe needs, and all a checkpoint keeps of one."""
    n = len(response_ids)
    return Sample(
        sample_id="probe",
        session_id="",
        turn_index=-1,
        tokens=list(prompt_ids) + list(response_ids),
        response_length=n,
        loss_mask=[1] * n,
        rollout_logprobs=[0.0] * n,
        reward=0.0,
        weights_version=-1,
        score=None,
    )


@dataclass
class MicroBatch:
    """Samples left-padded to one width; response tensors right-aligned to R columns.

    Left padding puts every response at the end of its row, so the logits of the last R + 1
    positions cover every response token and the (often long) prompts cost no vocab projection.
    """

    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    position_ids: torch.Tensor  # (B, T)
    targets: torch.Tensor  # (B, R) the response ids
    loss_mask: torch.Tensor  # (B, R)
    rollout_logprobs: torch.Tensor  # (B, R)
    rewards: torch.Tensor  # (B,)

    @classmethod
    def of(cls, samples: list[Sample], device: torch.device) -> "MicroBatch":
        width = max(len(s.tokens) for s in samples)
        span = max(s.response_length for s in samples)
        ids = torch.zeros((len(samples), width), dtype=torch.long)
        attention = torch.zeros((len(samples), width), dtype=torch.long)
        loss_mask = torch.zeros((len(samples), span), dtype=torch.long)
        rollout = torch.zeros((len(samples), span), dtype=torch.float32)
        for row, sample in enumerate(samples):
            n, r = len(sample.tokens), sample.response_length
            ids[row, width - n :] = torch.tensor(sample.tokens)
            attention[row, width - n :] = 1
            loss_mask[row, span - r :] = torch.tensor(sample.loss_mask)
            rollout[row, span - r :] = torch.tensor(sample.rollout_logprobs, dtype=torch.float32)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        return cls(
            *(t.to(device) for t in (ids, attention, positions, ids[:, width - span :], loss_mask, rollout, rewards))
        )


def pack(samples: list[Sample], budget: int) -> list[list[Sample]]:
    """Greedy micro-batches whose padded size (rows x longest row) fits `budget` tokens.

    Longest first, so each group's width is its first sample; a sample over budget goes alone.
    """
    groups: list[list[Sample]] = []
    current: list[Sample] = []
    for sample in sorted(samples, key=lambda s: len(s.tokens), reverse=True):
        if current and (len(current) + 1) * len(current[0].tokens) > budget:
            groups.append(current)
            current = []
        current.append(sample)
    if current:
        groups.append(current)
    return groups
