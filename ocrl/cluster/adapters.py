"""`--replicas N --weight-sync lora`: a transformers-engine replica takes the trainer's LoRA
adapter (what crosses Ray's object store is only lora_A and lora_B of each adapted layer) and
merges it itself into the weights it serves.

Contract:
 - `Merger(model, scaling).merged(adapter)` returns, for every layer the adapter names, the
   plain model's weight `W0 + scaling * B @ A` (named as in the plain model, in its dtype), as
   the trainer merges when it publishes merged weights (train/policy.py `published_weights`):
   fp32 arithmetic over the layer's base weight, so a replica serves what the trainer scores.
 - W0 is the layer's weight before any adapter was merged: copied (fp32) the first time an
   adapter names the layer, kept for the next version (merging into the served weight twice
   would add two deltas). That copy is the price of small transfers on this engine: a second
   copy of the adapted layers in the replica's memory. SGLang replicas would load the adapter
   natively instead.
 - Adapter names are peft's (`get_peft_model_state_dict`: `base_model.model.<module>.lora_A.weight`);
   a layer the model does not have, or an A without its B, is an EngineError (nothing changes).

Knows torch and the names; nothing of Ray or routing.
"""

from __future__ import annotations

import torch

from ocrl.engine.base import EngineError

PEFT_PREFIX = "base_model.model."


def is_adapter(named_tensors: dict) -> bool:
    return bool(named_tensors) and all(".lora_A." in n or ".lora_B." in n for n in named_tensors)


def scaling(config) -> float:
    """peft's LoRA scaling for the adapter the trainer builds (train/policy.py: r=--lora-rank,
    lora_alpha=--lora-alpha, no rsLoRA)."""
    return config.lora_alpha / config.lora_rank


class Merger:
    def __init__(self, model: torch.nn.Module, scaling: float):
        self.model = model
        self.scaling = scaling
        self.base: dict[str, torch.Tensor] = {}  # plain weight name -> its weight before any adapter, fp32

    def merged(self, adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in adapter.items():
            for part in ("lora_A", "lora_B"):
                if f".{part}." in name:
                    pairs.setdefault(name.split(f".{part}.")[0], {})[part] = tensor
                    break
            else:
                raise EngineError(f"{name} is not a LoRA tensor (lora_A or lora_B)")
        params = dict(self.model.named_parameters())
        targets = {}
        for module, ab in pairs.items():
            weight = module.removeprefix(PEFT_PREFIX) + ".weight"
            if weight not in params:
                raise EngineError(f"the adapter names {module}, which the served model does not have")
            if set(ab) != {"lora_A", "lora_B"}:
                raise EngineError(f"the adapter has only {sorted(ab)} for {module}")
            targets[weight] = ab
        out = {}
        with torch.no_grad():
            for weight, ab in targets.items():
                served = params[weight]
                base = self.base.get(weight)
                if base is None:
                    base = self.base[weight] = served.detach().to(torch.float32, copy=True)
                a, b = (ab[k].to(base.device, torch.float32) for k in ("lora_A", "lora_B"))
                if (b.shape[0], a.shape[1]) != tuple(base.shape) or b.shape[1] != a.shape[0]:
                    raise EngineError(f"adapter shapes {tuple(a.shape)}, {tuple(b.shape)} do not fit {weight} {tuple(base.shape)}")
                out[weight] = (base + (b @ a) * self.scaling).to(served.dtype)
        return out
