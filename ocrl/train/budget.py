"""What a training forward + backward keeps in memory, and the rule the trainer follows with it:
recompute the decoder layers in the backward (activation checkpointing) when a micro-batch would
otherwise take too much, and leave out a sample that does not fit even so.

Long agent samples (a 3-13k-token prompt, a short response) hit memory before time on a CPU
box: only the response positions reach the vocabulary (`logits_to_keep`), so what grows with
the prompt is the decoder layers' saved activations. Counted exactly (torch's own allocations,
profiled on Llama-shaped models with LoRA; q/kv = heads x head_dim):
- each layer keeps ~4 fp32 vectors of hidden size, 4 of intermediate size, 2 of q and 2 of kv
  size per position (`layer_bytes`), plus the adapters' rank-r intermediates;
- the backward's transient buffers are ~2 intermediate + 2 hidden vectors per position;
- with checkpointing a layer keeps only its input (one hidden vector), and one layer at a time
  runs again in the backward with everything above.
The process's resident memory is more than that count: the step also publishes merged weights
(about the model's size again with LoRA) and the C heap keeps freed blocks resident (see
memory.py). Measured with `bench train-long` on SmolLM2-135M, the allocator tuned as the daemon
tunes it (README): resident peak = `RSS_FACTOR` x the count + `STEP_SLACK` x the model's fp32
bytes: 4-5% over the measured peak at 3k tokens, with checkpointing and without, 27-82% over at
8k (a guard errs on the safe side). The estimate is of the peak the
kernel sees, which is what an OOM kill is. On CUDA the factor and the slack are guesses.

Knows model configs, token counts and the free memory; never samples or the loss.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger("ocrl.train")

FLOAT = 4  # bytes: the trainer's copy is fp32
RSS_FACTOR = 1.2  # CPU: resident bytes per counted activation byte over a step (bench train-long, README)
STEP_SLACK = 4.0  # CPU: the rest of a step's resident peak, in fp32 model sizes (merged weights, heap slack; measured ~2 GiB on 135M)
CUDA_FACTOR, CUDA_SLACK = 1.25, 1.0  # CUDA: the caching allocator and the merged weights, guesses (not measured on a GPU yet)
AUTO_SHARE = 0.5  # --gradient-checkpointing auto: checkpoint a micro-batch that would take over this share of what is free
FIT_SHARE = 0.8  # a sample is left out when even its cheapest backward would take over this share of what is free


def _dims(model_config) -> tuple[int, int, int, int, int]:
    """(layers, hidden, intermediate, q width, kv width) of a decoder-only config."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    hidden = text.hidden_size
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    intermediate = getattr(text, "intermediate_size", None) or 4 * hidden
    return text.num_hidden_layers, hidden, intermediate, heads * head_dim, kv_heads * head_dim


def layer_bytes(model_config, lora_rank: int = 0, full_finetune: bool = False) -> int:
    """Bytes one decoder layer keeps per position for the backward (counted, see above)."""
    _, h, i, q, kv = _dims(model_config)
    kept = FLOAT * (4 * h + 4 * i + 2 * q + 2 * kv) + FLOAT * 7 * lora_rank
    return int(kept * 1.1) if full_finetune else kept  # full: the frozen-weight shortcuts are gone (+~10% counted)


def counted_bytes(model_config, positions: int, *, checkpointed: bool, lora_rank: int = 0, full_finetune: bool = False) -> int:
    """torch's live bytes at the peak of a forward + backward over `positions` (counted, above)."""
    layers, h, i, _, _ = _dims(model_config)
    layer = layer_bytes(model_config, lora_rank, full_finetune)
    transient = FLOAT * (2 * i + 2 * h)
    per_position = layers * FLOAT * h + layer + transient if checkpointed else layers * layer + transient
    return per_position * positions


def backward_bytes(
    model_config, positions: int, *, checkpointed: bool, lora_rank: int = 0, full_finetune: bool = False, model_bytes: int = 0,
    device: str = "cpu",
) -> int:
    """Estimated bytes a training step over `positions` (rows x padded width) adds at its peak,
    with or without checkpointing: resident memory on a CPU, allocator memory on CUDA.
    `model_bytes`: the trained model's parameters in fp32."""
    count = counted_bytes(model_config, positions, checkpointed=checkpointed, lora_rank=lora_rank, full_finetune=full_finetune)
    factor, slack = (CUDA_FACTOR, CUDA_SLACK) if device == "cuda" else (RSS_FACTOR, STEP_SLACK)
    return int(factor * count + slack * model_bytes)


def available_bytes(device: torch.device) -> int:
    """Memory free for the trainer now: the GPU's free memory, else the machine's (and its
    cgroup's) available memory; -1 when unknown."""
    if device.type == "cuda":  # free on the card, and what torch's cache holds free for reuse
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    free = []
    try:
        with open("/proc/meminfo") as f:
            free += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pass
    try:  # a container's limit, where it is lower than the machine's
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        if limit != "max":
            free.append(int(limit) - int(open("/sys/fs/cgroup/memory.current").read()))
    except (OSError, ValueError):
        pass
    return min(free) if free else -1


@dataclass(frozen=True)
class Plan:
    """How a micro-batch of `positions` is trained."""

    positions: int
    checkpoint: bool  # recompute its layers in the backward
    need: int  # estimated resident bytes of its backward, as planned
    available: int  # free now (-1 unknown)

    @property
    def fits(self) -> bool:
        return self.available < 0 or self.need <= FIT_SHARE * self.available


class Budget:
    """--gradient-checkpointing's rule for the trained model: `plan(positions)`."""

    def __init__(self, mode: str, model_config, device: torch.device, *, lora_rank: int = 0, full_finetune: bool = False,
                 model_bytes: int = 0, available: Callable[[], int] | None = None):  # fmt: skip
        self.mode = mode
        self.model_config = model_config
        self.model_bytes = model_bytes
        self.lora_rank, self.full_finetune = lora_rank, full_finetune
        self.device = torch.device(device)
        self.available = available or (lambda: available_bytes(self.device))

    def need(self, positions: int, checkpointed: bool) -> int:
        return backward_bytes(self.model_config, positions, checkpointed=checkpointed, lora_rank=self.lora_rank,
                              full_finetune=self.full_finetune, model_bytes=self.model_bytes, device=self.device.type)  # fmt: skip

    def plan(self, positions: int) -> Plan:
        """on: always checkpoint; off: never; auto: when the plain backward would take over
        AUTO_SHARE of what is free now (free memory unknown: plain)."""
        free = self.available()
        plain = self.need(positions, checkpointed=False)
        if self.mode == "on" or (self.mode == "auto" and free >= 0 and plain > AUTO_SHARE * free):
            return Plan(positions, True, self.need(positions, checkpointed=True), free)
        return Plan(positions, False, plain, free)
