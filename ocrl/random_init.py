"""`--random-init <name>`: a model of a named architecture with random weights, built from
hand-written hyperparameters, and a byte-level tokenizer built in memory. Nothing is downloaded
and no weights file is needed: systems figures (tokens/s, swap seconds, stalls, step seconds)
depend on the shapes, not on trained weights.

The tokenizer has 256 byte tokens plus ChatML's special tokens (ids < 260, under every
vocabulary here), so any text round-trips and the chat template works; it is not the model's
real tokenizer, and a random model's text is noise. The architecture's config and the tokenizer
are also written to a directory (`LoadedModel.path`), which is what an engine in another process
(SGLang with `load_format="dummy"`) starts from.

This module knows nothing about serving or training.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from ocrl.loaded import LoadedModel, ModelError, attn_implementation, cache_root, pick_device, pick_dtype

log = logging.getLogger("ocrl.models")

# Qwen3 dense shapes as published in each model's config.json (hidden, MLP, layers, heads,
# KV heads, head dim, tied embeddings); "tiny" is ours, for CPU tests.
ARCHITECTURES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True,
                 max_position_embeddings=2048),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}  # fmt: skip
QWEN3_COMMON = dict(vocab_size=151936, max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                    hidden_act="silu", attention_bias=False)  # fmt: skip

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def names() -> list[str]:
    return sorted(ARCHITECTURES)


def config_for(name: str):
    from transformers import Qwen3Config

    if name not in ARCHITECTURES:
        raise ModelError(f"--random-init {name!r}: known architectures are {', '.join(names())}")
    tokens = {"eos_token_id": 2, "pad_token_id": 0, "bos_token_id": None}  # <|im_end|> ends a turn
    return Qwen3Config(**{**QWEN3_COMMON, **ARCHITECTURES[name], **tokens})


def byte_tokenizer():
    """A byte-level tokenizer with no merges: ids 0-2 are the specials, 3-258 the bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(SPECIALS + sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHATML
    return tokenizer


def write_dir(name: str, config, tokenizer) -> Path:
    """config.json + tokenizer files for an engine in another process (no weights)."""
    folder = cache_root() / "random-init" / name
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": config.eos_token_id}))
    return folder


def build(name: str, *, device: str = "auto", dtype: str = "auto", seed: int = 0):
    """The named architecture with random weights, initialised directly on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    device = pick_device(device)
    torch_dtype = pick_dtype(dtype, device)
    config = config_for(name)
    config._attn_implementation = attn_implementation(device, torch_dtype)
    tokenizer = byte_tokenizer()
    started = time.monotonic()
    torch.manual_seed(seed)
    with torch.device(device):  # initialise where it will run: a 4B model in seconds on a GPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.eval()
    folder = write_dir(name, config, tokenizer)
    params = sum(p.numel() for p in model.parameters())
    log.info("random-init %s: %.2fB parameters on %s (%s, %s) in %.1fs", name, params / 1e9, device,
             str(torch_dtype).removeprefix("torch."), config._attn_implementation, time.monotonic() - started)
    return LoadedModel(model=model, tokenizer=tokenizer, name=f"random-{name}", path=str(folder))
