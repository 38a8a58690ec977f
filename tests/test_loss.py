"""Hand-computed checks of ocrl.train.loss; every expected value is derived in a comment."""

import math

import pytest
import torch
from torch.testing import assert_close

from ocrl.train.loss import (
    combined_advantages,
    entropy_from_logits,
    grpo_advantages,
    opd_advantages,
    topk_reverse_kl,
    k3_kl,
    masked_mean_per_sample_then_batch,
    policy_loss,
    token_logprobs,
)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_token_logprobs_and_entropy_by_hand():
    # Row 0: uniform over V=4 -> log p = -ln 4 = -1.3863, H = ln 4 = 1.3863.
    # Row 1: logits [0, ln 3, -inf, -inf] -> p = [1/4, 3/4, 0, 0];
    #   target 1 -> ln 0.75 = -0.2877; H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623.
    logits = t([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3), -1e4, -1e4]]])  # (1, 2, 4)
    targets = torch.tensor([[2, 1]])
    assert_close(token_logprobs(logits, targets), t([[-1.3863, -0.2877]]), atol=1e-4, rtol=0)
    assert_close(entropy_from_logits(logits), t([[1.3863, 0.5623]]), atol=1e-4, rtol=0)


def test_token_logprobs_upcast_to_float32_and_match_log_softmax():
    logits = torch.randn(2, 3, 11).bfloat16()
    targets = torch.randint(0, 11, (2, 3))
    out = token_logprobs(logits, targets)
    assert out.dtype == torch.float32 and out.shape == (2, 3)
    expected = torch.log_softmax(logits.float(), -1)[0, 1, targets[0, 1]]
    assert_close(out[0, 1], expected)


def test_grpo_advantages_broadcast_masked_and_unnormalised():
    # r = [1, -1] broadcast over response tokens, 0 where the mask is 0.
    mask = t([[0, 1, 1], [1, 1, 0]])
    assert_close(grpo_advantages(t([1, -1]), mask), t([[0, 1, 1], [-1, -1, 0]]))
    # No normalisation: equal rewards stay 2 (a std-normalised GRPO would give 0 or nan).
    assert_close(grpo_advantages(t([2, 2]), torch.ones(2, 2)), t([[2, 2], [2, 2]]))


# One token, old log-prob 0, so ratio = e^logp; eps = 0.2, eps_high = 0.28 -> clip [0.8, 1.28].
CLIP_CASES = [
    # (logp, A, pg, clipped branch taken)
    # ratio e^0.5 = 1.6487 > 1.28, A=+1 -> min(1.6487, 1.28) = 1.28 clipped -> pg = -1.28
    (0.5, 1.0, -1.28, True),
    # ratio 1.1 inside the band -> both branches 1.1 -> pg = -1.1, not clipped
    (math.log(1.1), 1.0, -1.1, False),
    # ratio e^-0.5 = 0.6065 < 0.8, A=+1 -> min(0.6065, 0.8) = 0.6065 unclipped -> pg = -0.6065
    (-0.5, 1.0, -0.6065, False),
    # ratio 1.6487, A=-1 -> min(-1.6487, -1.28) = -1.6487 unclipped -> pg = +1.6487
    (0.5, -1.0, 1.6487, False),
    # ratio 1.1, A=-1 -> pg = +1.1, not clipped
    (math.log(1.1), -1.0, 1.1, False),
    # ratio 0.6065 < 0.8, A=-1 -> min(-0.6065, -0.8) = -0.8 clipped -> pg = +0.8
    (-0.5, -1.0, 0.8, True),
]


@pytest.mark.parametrize(("logp", "advantage", "pg", "is_clipped"), CLIP_CASES)
def test_clipping_both_sides_both_signs(logp, advantage, pg, is_clipped):
    logprobs = t([[logp]]).requires_grad_()
    loss, metrics = policy_loss(logprobs, t([[0.0]]), t([[advantage]]), t([[1.0]]))
    assert_close(loss.detach(), torch.tensor(pg), atol=1e-4, rtol=0)
    assert metrics["clip_frac"] == (1.0 if is_clipped else 0.0)
    loss.backward()
    # Clipped branch is constant in logp -> grad 0; unclipped: d(-ratio A)/dlogp = -A ratio.
    expected_grad = 0.0 if is_clipped else -advantage * math.exp(logp)
    assert_close(logprobs.grad, t([[expected_grad]]), atol=1e-5, rtol=0)


def test_k3_zero_when_equal_positive_otherwise():
    logprobs = torch.randn(3, 5)
    assert_close(k3_kl(logprobs, logprobs.clone()), torch.zeros(3, 5))
    assert (k3_kl(logprobs, torch.randn(3, 5)) > 0).all()
    # ref - logp = -1: e^-1 + 1 - 1 = 0.3679;  ref - logp = +1: e - 1 - 1 = 0.7183.
    assert_close(k3_kl(t([[0.0, 0.0]]), t([[-1.0, 1.0]])), t([[0.3679, 0.7183]]), atol=1e-4, rtol=0)


def test_total_loss_adds_kl_and_subtracts_entropy():
    # ratio 1, A=+1 -> pg = -1; ref - logp = -1 -> k3 = 0.3679; entropy 2.
    # loss = -1 + 0.02 * 0.3679 - 0.01 * 2 = -1.012642
    loss, metrics = policy_loss(
        t([[0.0]]), t([[0.0]]), t([[1.0]]), t([[1.0]]), t([[-1.0]]),
        kl_coef=0.02, entropy=t([[2.0]]), entropy_coef=0.01,
    )
    assert_close(loss, torch.tensor(-1.012642), atol=1e-5, rtol=0)
    assert metrics["loss"] == pytest.approx(-1.012642, abs=1e-5)
    assert metrics["pg_loss"] == pytest.approx(-1.0)
    assert metrics["kl"] == pytest.approx(0.3679, abs=1e-4)
    assert metrics["entropy"] == pytest.approx(2.0)
    assert all(type(value) is float for value in metrics.values())


def test_masked_tokens_contribute_no_loss_and_no_gradient():
    mask = t([[1, 1, 0], [1, 0, 0]])
    old = torch.randn(2, 3)
    ref = torch.randn(2, 3)
    advantages = t([[1, 1, 1], [-1, -1, -1]])
    clean = old + 0.1 * torch.randn(2, 3)
    # Poison every masked position: huge, inf, -inf and nan log-probs and neighbours.
    poisoned = clean.clone()
    poisoned[0, 2], poisoned[1, 1], poisoned[1, 2] = 1e4, float("inf"), float("nan")
    bad_old, bad_ref, bad_adv = old.clone(), ref.clone(), advantages.clone()
    bad_old[1, 1], bad_ref[1, 2], bad_adv[0, 2] = -float("inf"), float("nan"), float("nan")
    entropy = torch.rand(2, 3)
    bad_entropy = entropy.clone()
    bad_entropy[1, 2] = float("nan")

    def run(logp, old, adv, ref, ent):
        logp = logp.clone().requires_grad_()
        ent = ent.clone().requires_grad_()
        loss, metrics = policy_loss(logp, old, adv, mask, ref, entropy=ent, entropy_coef=0.1)
        loss.backward()
        return loss, metrics, logp.grad, ent.grad

    loss, metrics, grad, ent_grad = run(poisoned, bad_old, bad_adv, bad_ref, bad_entropy)
    ref_loss, ref_metrics, ref_grad, ref_ent_grad = run(clean, old, advantages, ref, entropy)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and torch.isfinite(ent_grad).all()
    assert_close(loss, ref_loss)
    assert_close(grad, ref_grad)
    assert_close(ent_grad, ref_ent_grad)
    assert (grad[mask == 0] == 0).all() and (ent_grad[mask == 0] == 0).all()
    assert (grad[mask == 1] != 0).all()
    assert metrics == pytest.approx(ref_metrics)


def test_per_sample_then_batch_mean_differs_from_flat_token_mean():
    # Sample 0: four tokens of 1 -> mean 1.  Sample 1: one token of 4 -> mean 4.
    # Per sample then batch: (1 + 4) / 2 = 2.5.  Flat token mean would be 8 / 5 = 1.6.
    # Sample 2 has an all-zero mask: left out, so not (1 + 4 + 0) / 3 = 1.667.
    x = t([[1, 1, 1, 1], [4, 0, 0, 0], [9, 9, 9, 9]])
    mask = t([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert_close(masked_mean_per_sample_then_batch(x, mask), torch.tensor(2.5))


def test_all_masked_out_gives_zero_with_grad_path():
    x = t([[float("inf"), 3.0]]).requires_grad_()
    out = masked_mean_per_sample_then_batch(x, t([[0, 0]]))
    assert out.item() == 0.0
    out.backward()
    assert_close(x.grad, t([[0.0, 0.0]]))


def test_policy_loss_uses_per_sample_mean():
    # ratio 1 everywhere. Sample 0: 2 tokens, A=+1 -> pg -1 each -> mean -1.
    # Sample 1: 1 token, A=-1 -> pg +1.  Loss = (-1 + 1) / 2 = 0 (flat would be -1/3).
    mask = t([[1, 1], [1, 0]])
    advantages = grpo_advantages(t([1, -1]), mask)
    loss, _ = policy_loss(torch.zeros(2, 2), torch.zeros(2, 2), advantages, mask)
    assert_close(loss, torch.tensor(0.0))


def test_clip_frac_ratio_and_mismatch_metrics():
    # old = 0, so ratio = e^logp: [[1.6487, 1], [1, e^5 (masked)]], A = +1 on masked-in tokens.
    # clip_frac: only (0,0) has 1.28 * A < 1.6487 * A -> 1/3 (ratio 1 gives equal branches).
    # ratio_mean = (1.6487 + 1 + 1) / 3 = 1.2162; ratio_max = 1.6487 (masked e^5 ignored).
    # mismatch = mean |old - rollout| = (0.1 + 0.2 + 0.3) / 3 = 0.2 (masked 100 ignored).
    mask = t([[1, 1], [1, 0]])
    _, metrics = policy_loss(
        t([[0.5, 0.0], [0.0, 5.0]]), torch.zeros(2, 2), grpo_advantages(t([1, 1]), mask), mask,
        rollout_logprobs=t([[0.1, -0.2], [0.3, 100.0]]),
    )
    assert metrics["clip_frac"] == pytest.approx(1 / 3)
    assert metrics["ratio_mean"] == pytest.approx(1.2162, abs=1e-4)
    assert metrics["ratio_max"] == pytest.approx(1.6487, abs=1e-4)
    assert metrics["mismatch"] == pytest.approx(0.2)
    no_rollout = policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), t([[1]]), t([[1]]))[1]
    assert "mismatch" not in no_rollout


def test_unclipped_gradient_is_minus_advantage_times_ratio_over_length():
    # One sample, T = 4, all inside [0.8, 1.28]: loss = -(1/T) sum_t ratio_t A_t,
    # so dL/dlogp_t = -A_t ratio_t / T:
    #   A=+1, e^0.1  = 1.10517 -> -0.27629;  A=+1, e^-0.1 = 0.90484 -> -0.22621
    #   A=-1, e^0.2  = 1.22140 -> +0.30535;  A=+2, e^0    = 1       -> -0.5
    logprobs = t([[0.1, -0.1, 0.2, 0.0]]).requires_grad_()
    loss, _ = policy_loss(logprobs, torch.zeros(1, 4), t([[1, 1, -1, 2]]), torch.ones(1, 4))
    loss.backward()
    assert_close(logprobs.grad, t([[-0.27629, -0.22621, 0.30535, -0.5]]), atol=1e-5, rtol=0)


def test_opd_advantage_is_teacher_minus_old_on_masked_tokens():
    # [-1 - (-1.5), masked out, -3 - (-2)] = [0.5, 0, -1]
    a = opd_advantages(t([[-1.0, -2.0, -3.0]]), t([[-1.5, -1.0, -2.0]]), t([[1, 0, 1]]))
    assert_close(a, t([[0.5, 0.0, -1.0]]))


def test_combined_advantage_weights_both_terms_and_only_hinted_samples_distill():
    teacher, old, mask = t([[-1.0, -2.0], [-1.0, -2.0]]), t([[-1.5, -1.0], [-1.5, -1.0]]), t([[1, 1], [1, 1]])
    rewards, hinted = t([1.0, -1.0]), torch.tensor([True, False])
    a = combined_advantages(rewards, teacher, old, mask, hinted, w_rl=1.0, w_opd=2.0)
    # sample 0: 1 + 2 * [0.5, -1] = [2, -1]; sample 1 (no hint): the RL term only, [-1, -1]
    assert_close(a, t([[2.0, -1.0], [-1.0, -1.0]]))


def test_topk_reverse_kl_by_hand_with_the_tail_bin():
    # student p = [0.5, 0.3, 0.2]; teacher top-1 = token 0 with p 0.8
    # bins: student [0.5, tail 0.5], teacher [0.8, tail 0.2]
    # KL = 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2) = 0.5 * (-0.470004) + 0.5 * 0.916291 = 0.223144
    student = torch.log(t([[[0.5, 0.3, 0.2]]]))
    kl = topk_reverse_kl(student, torch.tensor([[[0]]]), torch.log(t([[[0.8]]])), t([[1]]))
    assert_close(kl, t([[0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)]]))
    assert abs(kl.item() - 0.223144) < 1e-5


def test_topk_reverse_kl_zero_when_equal_masked_and_differentiable():
    logits = torch.randn(1, 2, 6, requires_grad=True)
    logprobs = torch.log_softmax(logits, -1)
    top = logprobs.detach().topk(3, dim=-1)
    kl = topk_reverse_kl(logprobs, top.indices, top.values, t([[1, 0]]))
    assert_close(kl, t([[0.0, 0.0]]), atol=1e-6, rtol=0)  # same distribution: 0; masked: 0
    shifted = topk_reverse_kl(logprobs, top.indices, top.values - 0.5, t([[1, 1]]))
    assert (shifted > 0).all()  # the teacher puts less mass on the top-K: KL > 0
    shifted.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
