"""Publishing the trainer's weights to the engine, and proving they landed.

A swap hands the engine new tensors under a new `weights_version`; then the engine scores a probe
(a sample's response, teacher-forced) and its log-probs are compared with the trainer's own, per
token, within the larger of a flat and a relative bound (policy.verify_tolerance and
verify_relative). A failed swap is reported, not raised: the next step sends all the changing
weights again, so the engine catches up. Knows the engine's `update_weights` and `score`, and
events; never the optimizer or the loss.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ocrl.train.batch import split_prompt
from ocrl.types import Sample, WeightsSwapped

log = logging.getLogger("ocrl.train")


@dataclass
class Swapped:
    landed: bool  # the engine took the weights (serves `version` now)
    seconds: float = 0.0
    verified: bool = False  # and served the probe as the trainer computes it
    probe_diff: float = math.inf  # the largest |served - ours| on the probe (nan: nothing probed)


async def swap(
    engine, events, tensors: dict[str, torch.Tensor], version: int, *, serving_version: int,
    probe: Sample | None, probe_logprobs: torch.Tensor | None, atol: float, rtol: float,
) -> Swapped:
    """Swap `tensors` into `engine` as `version` (it serves `serving_version` until then) and
    check the probe against `probe_logprobs` (None: nothing to check, not verified)."""
    try:
        seconds = await engine.update_weights(tensors, version=version)
    except Exception as e:
        log.exception("weight swap to version %d failed", version)
        events.log("error", f"weight swap to version {version} failed: {type(e).__name__}: {e}")
        events.publish(WeightsSwapped(weights_version=serving_version, seconds=0.0, verified=False))
        return Swapped(landed=False)
    probe_diff = math.nan
    over = True
    if probe is not None and probe_logprobs is not None:
        try:
            served = torch.tensor(await engine.score(*split_prompt(probe)), dtype=torch.float32)
            same = served.shape == probe_logprobs.shape
            probe_diff = (served - probe_logprobs).abs().max().item() if same else math.inf
            if same and probe_diff < math.inf:  # per token: the larger of the flat and the relative bound
                limits = torch.clamp(rtol * probe_logprobs.abs(), min=atol)
                over = bool(((served - probe_logprobs).abs() >= limits).any())
        except Exception:
            log.exception("scoring the probe of version %d failed", version)
            probe_diff = math.inf
    verified = probe_diff < math.inf and not over  # False when nothing was probed (nan) or scoring failed
    if probe_logprobs is not None and not verified:
        log.warning("swap to version %d did not verify: probe differs by %.3g", version, probe_diff)
        events.log("warning", f"weights version {version}: served log-probs differ by {probe_diff:.3g}")
    events.publish(WeightsSwapped(weights_version=version, seconds=seconds, verified=verified))
    return Swapped(landed=True, seconds=seconds, verified=verified, probe_diff=probe_diff)
