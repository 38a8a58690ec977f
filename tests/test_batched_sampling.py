"""The HF engine samples a whole batch in one pass on the logits' device: greedy rows and
log-probs equal the per-row reference, grammar masks and top-p still bind each row, a seed
reproduces its sample whatever else shares the batch, and one bad row fails alone."""

from __future__ import annotations

import math

import torch

from ocrl.engine.hf import HFEngine, _Request
from ocrl.types import SamplingParams

V = 500


class AllowOnly:
    """A stand-in for a grammar matcher: only `allowed` ids may come next."""

    def __init__(self, allowed):
        self.allowed = torch.zeros(V, dtype=torch.bool)
        self.allowed[list(allowed)] = True
        self.advanced = []

    def mask(self, logits):
        return logits.masked_fill(~self.allowed, -math.inf)

    def advance(self, token):
        assert self.allowed[token], "sampled outside the grammar"
        self.advanced.append(token)


def request(seed=0, matcher=None, **params) -> _Request:
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    r = _Request([1], SamplingParams(seed=seed, **params), None, generator, 16)
    r.matcher = matcher
    return r


def sample(logits, batch):
    engine = object.__new__(HFEngine)
    return engine._sample({"logits": logits}, batch)


def logits_for(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 4


def test_greedy_tokens_and_logprobs_equal_the_per_row_reference():
    logits = logits_for(8)
    batch = [request(temperature=0.0, top_logprobs=3) for _ in range(8)]
    picked = sample(logits, batch)
    for row, (token, logprob, tops) in enumerate(picked):
        reference = torch.log_softmax(logits[row].float(), dim=-1)
        assert token == int(torch.argmax(logits[row]))
        assert abs(logprob - float(reference[token])) < 1e-5
        values, indices = torch.topk(reference, 3)
        assert [t.token_id for t in tops] == indices.tolist()
        assert all(abs(t.logprob - v) < 1e-5 for t, v in zip(tops, values.tolist()))


def test_sampled_logprobs_are_the_raw_ones_and_greedy_rows_are_unmoved_by_sampled_neighbours():
    logits = logits_for(6, seed=1)
    batch = [request(seed=i, temperature=0.0 if i % 2 else 1.3, top_p=0.9 if i == 2 else 1.0) for i in range(6)]
    picked = sample(logits, batch)
    raw = torch.log_softmax(logits, dim=-1)
    for row, (token, logprob, tops) in enumerate(picked):
        assert abs(logprob - float(raw[row, token])) < 1e-5
        assert tops == []
        if row % 2:
            assert token == int(torch.argmax(logits[row]))


def test_constrained_rows_stay_constrained_greedy_or_sampled():
    logits = logits_for(8, seed=2)
    allowed = {7, 70, 321}
    matchers = [AllowOnly(allowed) if row % 2 == 0 else None for row in range(8)]
    for trial in range(20):
        batch = [request(seed=trial * 8 + row, matcher=m, temperature=(0.0 if row % 4 == 0 else 1.5), top_p=(0.5 if row == 6 else 1.0)) for row, m in enumerate(matchers)]
        picked = sample(logits, batch)
        raw = torch.log_softmax(logits, dim=-1)
        for row, (token, logprob, _) in enumerate(picked):
            if matchers[row] is not None:
                assert token in allowed
                assert abs(logprob - float(raw[row, token])) < 1e-5  # the unconstrained log-prob
    assert all(len(m.advanced) == 20 for m in matchers if m is not None)


def test_top_p_keeps_only_the_nucleus():
    logits = torch.full((2, V), -10.0)
    logits[:, 3] = 5.0  # ~0.9 of the mass after softmax
    logits[:, 4] = 3.0
    for seed in range(30):
        picked = sample(logits, [request(seed=seed, top_p=0.5), request(seed=seed + 100, top_p=1.0)])
        assert picked[0][0] == 3


def test_a_seed_reproduces_its_sample_whatever_shares_the_batch():
    logits = logits_for(5, seed=3)
    alone = sample(logits[2:3], [request(seed=42, temperature=0.8)])[0]
    together = sample(logits, [request(seed=s, temperature=t) for s, t in [(1, 1.0), (2, 0.0), (42, 0.8), (3, 2.0), (4, 0.5)]])[2]
    assert alone == together


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-12] * (V - 3)]))
    counts = [0, 0, 0]
    for seed in range(3000):
        token = sample(logits, [request(seed=seed)])[0][0]
        counts[token] += 1
    assert abs(counts[0] / 3000 - 0.5) < 0.04 and abs(counts[1] / 3000 - 0.3) < 0.04 and abs(counts[2] / 3000 - 0.2) < 0.04


def test_a_row_with_no_finite_probability_fails_alone():
    logits = logits_for(4, seed=4)
    logits[1] = float("nan")
    picked = sample(logits, [request(seed=s, temperature=1.0) for s in range(4)])
    assert isinstance(picked[1], str)
    assert all(isinstance(p, tuple) for i, p in enumerate(picked) if i != 1)
