"""One sampling pass over a batch's next-token logits: the HF engine's sampler (SGLang samples
by itself).

Log-probs are the raw ones (log_softmax in fp32, before temperature or top-p), so they equal a
teacher-forced forward of the same tokens. Each request draws from its own generator, so a seed
reproduces its sample whatever the batch; a request with a grammar samples inside it. Knows
logits, sampling parameters, generators and grammar matchers; never the model, its cache or
the scheduler.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Protocol

import torch

from ocrl.engine.base import GREEDY_BELOW
from ocrl.grammar import Matcher
from ocrl.types import SamplingParams, TopLogprob

log = logging.getLogger("ocrl.engine")

Picked = tuple[int, float, list[TopLogprob]] | str  # (token, raw log-prob, top log-probs), or the row's error


class Row(Protocol):
    """What sampling reads of a request (the HF engine's `_Request`)."""

    params: SamplingParams
    generator: torch.Generator
    matcher: Matcher | None  # where the request stands in its grammar, if it has one


@torch.inference_mode()
def sample_rows(logits: torch.Tensor, batch: Sequence[Row]) -> list[Picked]:
    """Per row of `logits` (B, V), one per request of `batch`: (token, its raw log-prob, top
    log-probs), or the error that row hit; one request's bad parameters never fail the rest of
    its batch.

    One pass over the whole batch on the logits' device: grammar masks per constrained row,
    then one softmax with per-row temperatures, top-p on one sort (only when a row asks for
    it), and inverse-CDF sampling with one uniform per row drawn from that request's own
    generator (so a seed still reproduces its sample whatever the batch). Greedy rows take
    the argmax of their (masked) logits. Only (B,)-sized results come back to the CPU."""
    logits = logits.float()  # (B, V)
    logprobs = torch.log_softmax(logits, dim=-1)  # raw: no temperature, no top-p
    rows = len(batch)
    errors: list[str | None] = [None] * rows
    masked = logits
    for row, request in enumerate(batch):
        if request.matcher is not None:  # sample inside the grammar; the log-prob stays the raw one
            if masked is logits:
                masked = logits.clone()
            try:
                masked[row] = request.matcher.mask(logits[row])
            except Exception as e:
                errors[row] = _row_failed(e, rows)
    temperatures = [r.params.temperature for r in batch]
    greedy = [t < GREEDY_BELOW for t in temperatures]
    tokens = torch.argmax(masked, dim=-1)
    if not all(greedy):
        temps = torch.tensor([1.0 if g else t for g, t in zip(greedy, temperatures)], device=masked.device)
        probs = torch.softmax(masked / temps.unsqueeze(1), dim=-1)
        top_ps = [r.params.top_p for r in batch]
        order = None
        if any(p < 1.0 and not g for p, g in zip(top_ps, greedy)):
            probs, order = torch.sort(probs, dim=-1, descending=True)
            limit = torch.tensor([p if p < 1.0 else math.inf for p in top_ps], device=masked.device)
            outside = probs.cumsum(-1) - probs > limit.unsqueeze(1)
            probs = probs.masked_fill(outside, 0.0)
        cdf = probs.cumsum(-1)
        uniforms = torch.cat([torch.rand(1, generator=r.generator) for r in batch]).to(masked.device)
        target = (uniforms * cdf[:, -1]).unsqueeze(1)
        drawn = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
        if order is not None:
            drawn = order.gather(1, drawn.unsqueeze(1)).squeeze(1)
        sampled = torch.tensor([not g for g in greedy], device=masked.device)
        tokens = torch.where(sampled, drawn, tokens)
        totals = cdf[:, -1].tolist()
        for row, (total, g) in enumerate(zip(totals, greedy)):
            if not g and errors[row] is None and not (math.isfinite(total) and total > 0):
                errors[row] = _row_failed(ValueError("no token has a finite probability"), rows)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    vocab = logprobs.shape[-1]
    for row, r in enumerate(batch):
        if (r.params.top_logprobs or 0) > vocab and errors[row] is None:
            errors[row] = _row_failed(ValueError(f"top_logprobs {r.params.top_logprobs} exceeds the vocabulary ({vocab})"), rows)
    k = min(vocab, max((r.params.top_logprobs or 0) for r in batch))
    top_values = top_indices = None
    if k:
        values, indices = torch.topk(logprobs, k, dim=-1)
        top_values, top_indices = values.tolist(), indices.tolist()
    picked: list[tuple[int, float, list[TopLogprob]] | str] = []
    for row, (request, token, logprob) in enumerate(zip(batch, tokens.tolist(), chosen.tolist())):
        if errors[row] is not None:
            picked.append(errors[row])
            continue
        want = request.params.top_logprobs or 0
        tops = [TopLogprob(i, v) for v, i in zip(top_values[row][:want], top_indices[row][:want])] if want else []
        try:
            if request.matcher is not None:
                request.matcher.advance(token)
        except Exception as e:
            picked.append(_row_failed(e, rows))
            continue
        picked.append((token, logprob, tops))
    return picked


def _row_failed(e: Exception, rows: int) -> str:
    log.warning("sampling failed for one request of a batch of %d: %s", rows, type(e).__name__)
    return f"{type(e).__name__}: {e}"
