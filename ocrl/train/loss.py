"""The policy loss: pure tensor math, no model, no samples, no optimizer.

Everything here takes per-token tensors of shape (B, T) that are already aligned to the
response tokens (position t holds log pi(a_t | s_t)) plus a `loss_mask` (B, T) that is 1 on
trainable response tokens. Building those tensors from samples is the trainer's job.

Formulas (DESIGN.md, "The method"), with rho_t = pi_theta(a_t|s_t) / pi_old(a_t|s_t):

    A_t   = r                                                 (GRPO advantage, every token)
    L_pg  = -E[ min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps_high) A_t) ]      (PPO-clip)
    k3_t  = exp(ref_t - logp_t) - (ref_t - logp_t) - 1       (Schulman's low-variance KL)
    L     = L_pg + kl_coef * E[k3] - entropy_coef * E[H] + distill_coef * E_d[KL_K]

Advantages per method (`method_advantages`), with hints in the teacher's prompt:
    rl      A_t = r
    opd     A_t = log pi_teacher(a_t | s + hint) - log pi_old(a_t | s)   (distilled samples only)
    combine A_t = w_rl * r + w_opd * (teacher - old)
With top-K distillation the teacher term leaves the advantage and becomes KL_K, the reverse KL
to the teacher over its K most likely tokens plus a tail bin; E_d[.] is the mean over the
distilled samples, weighted by their share of the batch.

Where ocrl departs from textbook PPO / GRPO:
- no value function and no GAE: the reward of a turn is its advantage on every token;
- no reward normalisation (GRPO divides by the group std): rewards are already in {-1, 0, 1}
  and a live chat has no group of responses to one prompt;
- asymmetric clip (DAPO's "clip-higher"): 1 + eps_high with eps_high = 0.28 > eps = 0.2;
- E[.] is a token mean per sample, then a mean over the samples that have any masked-in
  token, so a long response does not outweigh a short one (GRPO, not DAPO's flat token mean).

Masked positions contribute nothing to the loss or its gradient, even when their
log-probs are inf or nan: they are replaced with torch.where *before* any exp, because
a multiplication by zero would turn an inf gradient into nan. Diagnostics (clip_frac,
ratio_*, mismatch) are flat means over masked-in tokens and are detached floats.
"""

from dataclasses import dataclass

import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log pi(targets) from logits (B, T, V) and target ids (B, T), in float32."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    return logprobs.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # (B, T)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at every position, in float32."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    return -(logprobs.exp() * logprobs).sum(-1)  # (B, T)


def grpo_advantages(rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """A_t = r on every masked-in token, 0 elsewhere; no normalisation."""
    broadcast = rewards.float().unsqueeze(-1).expand(loss_mask.shape)  # (B, T)
    return torch.where(loss_mask.bool(), broadcast, 0.0)  # (B, T)


def opd_advantages(teacher_logprobs: torch.Tensor, old_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """On-policy distillation: A_t = log pi_teacher(a_t | s + hint) - log pi_old(a_t | s) on
    masked-in tokens, 0 elsewhere. The teacher is the frozen reference with the hint in context."""
    gap = teacher_logprobs.float() - old_logprobs.float()  # (B, T)
    return torch.where(loss_mask.bool(), gap, 0.0)


def combined_advantages(
    rewards: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    has_hint: torch.Tensor,
    *,
    w_rl: float = 1.0,
    w_opd: float = 1.0,
) -> torch.Tensor:
    """A_t = w_rl * r + w_opd * (teacher - old) per token; the distillation term only for the
    samples (has_hint, (B,)) whose turn got an accepted hint, the RL term for every sample."""
    rl = grpo_advantages(rewards, loss_mask)  # (B, T)
    opd = opd_advantages(teacher_logprobs, old_logprobs, loss_mask) * has_hint.float().unsqueeze(-1)  # (B, T)
    return w_rl * rl + w_opd * opd


def method_advantages(
    method: str,
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    old_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor | None,
    distilled: torch.Tensor | None,
    *,
    w_rl: float = 1.0,
    w_opd: float = 1.0,
    topk: bool = False,
) -> torch.Tensor:
    """A_t by method: rl r; opd teacher - old; combine w_rl r + w_opd (teacher - old), the
    teacher term only on the `distilled` samples (B,). With `topk` the teacher term leaves the
    advantage for the top-K term of `policy_loss` (what is left: w_rl r for combine, 0 for opd)."""
    rl = grpo_advantages(rewards, loss_mask)  # (B, T)
    if method == "rl":
        return rl
    w_rl = w_rl if method == "combine" else 0.0
    if topk:
        return w_rl * rl
    if method == "opd":
        return opd_advantages(teacher_logprobs, old_logprobs, loss_mask) * distilled.float().unsqueeze(-1)
    return combined_advantages(rewards, teacher_logprobs, old_logprobs, loss_mask, distilled, w_rl=w_rl, w_opd=w_opd)


def topk_reverse_kl(
    logprobs: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """Per-token reverse KL(student || teacher) over K+1 bins: the teacher's top-K tokens and a
    tail bin holding the rest of the mass, log(1 - sum_k p_k) on each side.

    logprobs: the student's full log-softmax (B, T, V); teacher_ids / teacher_logprobs: (B, T, K).
    Returns (B, T), 0 where the mask is 0.
    """
    student_k = logprobs.float().gather(-1, teacher_ids.long())  # (B, T, K)
    teacher_k = teacher_logprobs.float()  # (B, T, K)

    def tail(k_logprobs: torch.Tensor) -> torch.Tensor:  # log(1 - sum_k p_k), kept finite
        covered = k_logprobs.exp().sum(-1, keepdim=True).clamp(max=1.0 - 1e-6)  # (B, T, 1)
        return torch.log1p(-covered)

    student = torch.cat([student_k, tail(student_k)], dim=-1)  # (B, T, K+1)
    teacher = torch.cat([teacher_k, tail(teacher_k)], dim=-1)  # (B, T, K+1)
    kl = (student.exp() * (student - teacher)).sum(-1)  # (B, T)
    return torch.where(loss_mask.bool(), kl, 0.0)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref); >= 0, and 0 iff equal."""
    log_ratio = ref_logprobs - logprobs  # (B, T)
    return log_ratio.exp() - log_ratio - 1  # (B, T)


def masked_mean_per_sample_then_batch(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token mean over `mask` within each sample, then the mean over samples with >= 1 token.

    Samples with an all-zero mask are left out; if there are none the result is 0 and
    still part of the graph (its gradient is zero).
    """
    mask = mask.bool()
    tokens = mask.sum(-1)  # (B,)
    per_sample = torch.where(mask, x, 0.0).sum(-1) / tokens.clamp(min=1)  # (B,)
    return per_sample.sum() / (tokens > 0).sum().clamp(min=1)  # ()


def _token_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Flat mean over masked-in tokens, for diagnostics only."""
    return (torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)).item()


@dataclass
class TopKTeacher:
    """What the top-K distillation term reads: the student's whole log-softmax and the teacher's
    K most likely tokens, on the rows (`distilled`) whose turn got a hint."""

    student_logprobs: torch.Tensor  # (B, T, V) the policy's log-softmax, with gradient
    teacher_ids: torch.Tensor  # (B, T, K)
    teacher_logprobs: torch.Tensor  # (B, T, K)
    distilled: torch.Tensor  # (B,) bool
    coef: float = 1.0  # w_opd for combine, 1 for opd


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    *,
    eps_clip: float = 0.2,
    eps_clip_high: float = 0.28,
    kl_coef: float = 0.02,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    rollout_logprobs: torch.Tensor | None = None,
    topk: TopKTeacher | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss + k3 KL - entropy bonus + top-K distillation, and detached
    diagnostics.

    All tensors are (B, T). Only `logprobs` (and `entropy`, and the student's log-softmax in
    `topk`) carry gradient; the old, reference, rollout and teacher log-probs and the advantages
    are treated as constants. The top-K term is a mean over the distilled samples (`distill_kl`,
    reported when there is one), weighted by their share of the B samples.
    """
    mask = loss_mask.bool()  # (B, T)
    advantages = torch.where(mask, advantages.detach().float(), 0.0)  # (B, T)
    old_logprobs = old_logprobs.detach()

    # Masked log-ratios become 0 before exp, so an inf there cannot reach loss or grad.
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)  # (B, T)
    ratio = log_ratio.exp()  # (B, T)
    unclipped = ratio * advantages  # (B, T)
    clipped = ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages  # (B, T)
    pg = -torch.minimum(unclipped, clipped)  # (B, T)
    pg_loss = masked_mean_per_sample_then_batch(pg, mask)  # ()

    if ref_logprobs is not None:
        safe_logprobs = torch.where(mask, logprobs, 0.0)  # (B, T)
        safe_ref = torch.where(mask, ref_logprobs.detach(), 0.0)  # (B, T)
        kl = masked_mean_per_sample_then_batch(k3_kl(safe_logprobs, safe_ref), mask)  # ()
    else:
        kl = pg_loss.new_zeros(())
    loss = pg_loss + kl_coef * kl

    metrics: dict[str, float] = {}
    if entropy is not None:
        mean_entropy = masked_mean_per_sample_then_batch(entropy, mask)  # ()
        loss = loss - entropy_coef * mean_entropy
        metrics["entropy"] = mean_entropy.item()

    if topk is not None and (taught_rows := int(topk.distilled.sum())):
        taught = mask & topk.distilled.unsqueeze(-1)  # (B, T)
        kl_k = topk_reverse_kl(topk.student_logprobs, topk.teacher_ids, topk.teacher_logprobs.detach(), taught)  # (B, T)
        distill_kl = masked_mean_per_sample_then_batch(kl_k, taught)  # () mean over the distilled samples
        loss = loss + topk.coef * distill_kl * (taught_rows / mask.shape[0])
        metrics["distill_kl"] = distill_kl.item()

    with torch.no_grad():
        metrics |= {
            "loss": loss.item(),
            "pg_loss": pg_loss.item(),
            "kl": kl.item(),
            "clip_frac": _token_mean((clipped < unclipped).float(), mask),
            "ratio_mean": _token_mean(ratio, mask),
            "ratio_max": torch.where(mask, ratio, 0.0).max().item() if mask.numel() else 0.0,
        }
        if rollout_logprobs is not None:
            gap = torch.where(mask, old_logprobs - rollout_logprobs.detach(), 0.0).abs()  # (B, T)
            metrics["mismatch"] = _token_mean(gap, mask)
    return loss, metrics
