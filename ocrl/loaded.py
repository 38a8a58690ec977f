"""What a loaded model is, and where it runs: the weights with their tokenizer, the error that
loading raises, the device, dtype and attention kernel picked for it, the cache it is kept in,
and the linear layers LoRA adapts in it.

`models.py` (real weights) and `random_init.py` (random ones) both produce a `LoadedModel`; the
engines and the trainer read it. Knows nothing about serving or training.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

# The attention and MLP projections of the supported (Llama/Qwen-style) families: what LoRA
# adapts, where the model has them.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ModelError(RuntimeError):
    pass


@dataclass
class LoadedModel:
    model: object  # transformers PreTrainedModel
    tokenizer: object  # transformers PreTrainedTokenizer
    name: str  # short served name
    path: str  # directory the weights were loaded from


def cache_root() -> Path:
    return Path(os.environ.get("OCRL_CACHE") or Path.home() / ".cache" / "ocrl")


def pick_dtype(dtype: str, device: str):
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def pick_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def attn_implementation(device: str, torch_dtype) -> str:
    """flash-attention 2 on CUDA in half precision when the package is installed, else SDPA."""
    import torch

    half = torch_dtype in (torch.bfloat16, torch.float16)
    if device.startswith("cuda") and half and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"
