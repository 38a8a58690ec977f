"""Reference log-probs of one sample that reuse the reference's work on the session's earlier
turns.

The reference policy never changes (the base with adapters off, or a frozen copy), so its KV
states for a sample's tokens stay valid for good. An agent session's turn k+1 starts with turn
k's prompt + response, so keeping each scored sample's KV in a `PrefixCache` lets the next
turn's reference pass compute only its new tokens. The policy forward cannot do this: its
weights move every step, and its gradient flows through every prompt position.

Only the logits of response positions are projected onto the vocabulary (`logits_to_keep`), as
in the trainer's own forward. Knows the model and a sample's tokens, never steps or sessions.
"""

from __future__ import annotations

import torch

from ocrl.engine import prefix_cache
from ocrl.train.loss import token_logprobs
from ocrl.types import Sample

VERSION = 0  # the reference has one version for the life of the trainer


class ReferencePrefix:
    def __init__(self, budget: str, device: torch.device):
        self.device = device
        self.cache = prefix_cache.PrefixCache(*prefix_cache.parse_budget(budget, device))

    @property
    def enabled(self) -> bool:
        return self.cache.enabled

    @torch.no_grad()
    def logprobs(self, model, sample: Sample) -> torch.Tensor:
        """(R,) log-probs of the sample's response under `model` (the reference, already in its
        mode), prefilling only the tokens no earlier sample shared; then keeps this sample's."""
        from transformers import DynamicCache

        tokens, span = sample.tokens, sample.response_length
        # the last prompt position is always computed: its logits score the first response token
        hit = self.cache.lookup(tokens, VERSION, len(tokens) - span - 1)
        cache = prefix_cache.batched([hit], hit.length) if hit.length else DynamicCache()
        rest = torch.tensor([tokens[hit.length :]], device=self.device)  # (1, T - L)
        out = model(
            input_ids=rest,
            attention_mask=torch.ones((1, len(tokens)), dtype=torch.long, device=self.device),
            position_ids=torch.arange(hit.length, len(tokens), device=self.device).unsqueeze(0),
            cache=cache,
            use_cache=True,
            logits_to_keep=span + 1,
        )
        targets = torch.tensor([tokens[-span:]], device=self.device)  # (1, R)
        logprobs = token_logprobs(out.logits[:, :-1], targets)[0]  # (R,)
        layers = prefix_cache.row_of(cache, 0, torch.arange(len(tokens)))
        if layers is not None:
            self.cache.keep(list(tokens), layers, VERSION)
        return logprobs
