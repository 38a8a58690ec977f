"""One configuration struct for the whole daemon, loaded as flags > env > TOML file > defaults.

The struct is the single source of truth: the CLI builds one flag per field (`rollout_batch_size`
-> `--rollout-batch-size`), the environment offers `OCRL_<FIELD>` (plus the reference
implementation's names HOST, PORT, SGLANG_API_KEY, SERVED_MODEL_NAME), and a TOML file passed
with `--config` is decoded into the same struct, unknown keys rejected. This module knows nothing
about what the fields do.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from typing import Literal, get_args, get_origin, get_type_hints

import msgspec

from ocrl.clients import OPENCLAW_ENVELOPE, OPENCLAW_HOUSEKEEPING, ClientRules


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # serving
    model: str = "embedded"  # embedded | a local HF dir | a .gguf file | an HF id already cached
    served_model_name: str = ""  # defaults to the model's short name
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str = ""
    insecure_no_auth: bool = False
    allowed_hosts: str = ""  # Host names (comma-separated) besides IP literals, localhost and --host; "*" = any
    allowed_origins: str = ""  # browser origins (comma-separated, e.g. http://localhost:3000) allowed to call; "*" = any
    headless: bool = False
    device: str = "auto"  # auto | cpu | cuda
    engine: Literal["auto", "hf", "sglang"] = "auto"  # auto: sglang with CUDA and the gpu extra, else hf
    # how trained weights reach an sglang engine: full = the merged weights swapped in place;
    # lora = the adapter loaded as a new version (LoRA training only; the judge reads the base);
    # broadcast (--replicas only) = full weights from the trainer actor to every replica by one
    # torch.distributed broadcast (NCCL on CUDA, gloo on the CPU), the object store as fallback
    weight_sync: Literal["full", "lora", "broadcast"] = "full"
    # --replicas N: N engine replicas as Ray actors (the cluster extra), requests routed with
    # session affinity; 0 = the engine in this process. --ray-address: local | auto | HOST:PORT
    replicas: int = 0
    ray_address: str = "local"
    engine_mem_fraction: float = 0.5  # sglang: share of GPU memory for its static pool; the trainer gets the rest
    random_init: str = ""  # a named architecture with random weights (systems benchmarks without weights), e.g. qwen3-4b
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on GPU) | float32 | bfloat16 | float16
    max_batch_size: int = 8
    max_body_bytes: int = 8 * 1024 * 1024
    max_messages: int = 1024
    max_queued_requests: int = 256
    default_max_tokens: int = 0  # completion tokens of a request without max_tokens; 0 = the rest of the context
    context_length: int = 0  # prompt + completion tokens; 0 = what the model was trained for
    # past the trained window only with RoPE scaling (HF engine): positions stretched by
    # context_length / trained; quality drops and every token of a long prompt costs (README)
    rope_scaling: Literal["off", "yarn", "linear"] = "off"
    # HF engine: KV states of finished sequences kept for prompts that start with them (agent
    # turns, shared system prompts); auto = 1/16 of RAM (GPU memory on CUDA), off, 2GiB, 32k tokens
    prefix_cache: str = "auto"
    request_timeout: float = 600.0
    threads: int = 0  # torch CPU threads per call; 0 = half the cores (decode and training run at once)
    # glibc only: leave malloc's arenas and thresholds as they are and trim only after training
    # steps, not every few seconds (memory.py; without them RSS climbs GBs above the live heap)
    no_malloc_tune: bool = False
    # sessions and samples
    default_turn_type: Literal["main", "side"] = "main"
    session_timeout: float = 1800.0
    # client conventions (clients.py); giving a flag replaces OpenClaw's defaults, '' clears them
    housekeeping_pattern: list[str] = msgspec.field(default_factory=lambda: list(OPENCLAW_HOUSEKEEPING))  # ROLE:REGEX, served as side turns
    envelope_pattern: list[str] = msgspec.field(default_factory=lambda: list(OPENCLAW_ENVELOPE))  # REGEX cut from a next state's user text
    record_dir: str = ""  # default runs/<timestamp>/
    no_record_text: bool = False  # words are not written; token ids (which decode to them) still are, see retain_samples
    retain_samples: int = -1  # >= 0: once a checkpoint covers them, token ids of consumed samples are deleted but for the newest N
    # judge
    prm_mode: Literal["auto", "generate", "verdict", "embed"] = "auto"
    prm_m: int = 3
    prm_temperature: float = 0.6
    prm_max_tokens: int = 4096  # per PRM vote, as the reference's scripts; a thinking judge needs them
    hint_max_tokens: int = 8192  # per hint vote (--method opd|combine), as the reference's opd scripts
    prm_model: str = ""
    prm_url: str = ""
    prm_api_key: str = ""
    prm_margin: float = 0.0  # the embed judge's (embed.MARGIN)
    # training
    no_train: bool = False
    method: Literal["rl", "opd", "combine"] = "rl"  # binary RL, distillation from hindsight hints, or both
    w_rl: float = 1.0  # combine: A_t = w_rl * r + w_opd * (teacher - old)
    w_opd: float = 1.0
    distill_topk: int = 0  # > 0: reverse KL over the teacher's top-K tokens + a tail bin instead of the PPO distillation term
    hint_placement: Literal["user", "system"] = "user"  # where the teacher sees the hint
    hint_min_chars: int = 10  # a hint must be longer than this
    experience: Literal["off", "session", "cross-session", "posthoc"] = "off"  # earlier (posthoc: all) hints as the teacher's context
    experience_max: int = 8  # hints kept as experience (per session, or across sessions)
    rollout_batch_size: int = 16
    # what fills a step's rollout_batch_size: trained = mask-1 samples only, the loss a mean over them;
    # all = every sample the reference submits (mask 0 included, rl), the loss summed over those and
    # divided by the whole count, as the reference does
    batch_counts: Literal["trained", "all"] = "trained"
    lr: float = 1e-5
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eps_clip: float = 0.2
    eps_clip_high: float = -1.0  # < 0: by method, as the reference's scripts: 0.28 (rl, combine), eps_clip (opd)
    kl_coef: float = 0.02
    entropy_coef: float = 0.0
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    lora_rank: int = 16
    lora_alpha: int = 32
    full_finetune: bool = False
    micro_batch_tokens: int = 512  # steps give way between layers; one layer over 512 tokens ~ one CPU decode step
    # recompute each decoder layer in the backward instead of keeping its activations (~1/3 more
    # compute, a fraction of the memory): auto = for a micro-batch whose backward would otherwise
    # take over half the memory available (long agent samples); on = every micro-batch; off = never
    gradient_checkpointing: Literal["auto", "on", "off"] = "auto"
    train_yield_max: float = 10.0  # seconds a step may wait in all while the engine serves
    save_dir: str = ""  # default <record_dir>/checkpoints
    save_interval: int = 50
    resume: bool = False
    seed: int = 0

    @property
    def clip_high(self) -> float:
        """eps_high of the clip: the flag, or by method (--method opd runs the reference's symmetric clip)."""
        if self.eps_clip_high >= 0:
            return self.eps_clip_high
        return self.eps_clip if self.method == "opd" else 0.28

    @property
    def counts_untrained(self) -> bool:
        """Mask-0 samples fill batches (--batch-counts all). The reference submits mask-0 samples with
        rl only (its opd and combine drop a turn without a signal), so only rl counts them."""
        return self.batch_counts == "all" and self.method == "rl"


LEGACY_ENV = {"host": "HOST", "port": "PORT", "api_key": "SGLANG_API_KEY", "served_model_name": "SERVED_MODEL_NAME"}


class ConfigError(ValueError):
    pass


def _fields() -> dict[str, type]:
    return {name: hint for name, hint in get_type_hints(Config).items() if name in Config.__struct_fields__}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per field; defaults are None so that only flags the user typed override."""
    parser.add_argument("--config", default=None, help="TOML file with any of the fields below")
    for name, hint in _fields().items():
        flag = "--" + name.replace("_", "-")
        default = getattr(Config(), name)
        if hint is bool:
            parser.add_argument(flag, action="store_true", default=None, help=f"(default {default})")
            continue
        kwargs: dict = {"default": None, "help": f"(default {default!r})"}
        if get_origin(hint) is list:
            kwargs.update(action="append", help=f"repeat for several (default {default!r})")
        elif get_origin(hint) is Literal:
            kwargs["choices"] = list(get_args(hint))
        elif hint in (int, float):
            kwargs["type"] = hint
        parser.add_argument(flag, **kwargs)


def _env_overrides(environ: dict[str, str]) -> dict[str, str]:
    found = {}
    for name, hint in _fields().items():
        for var in ("OCRL_" + name.upper(), LEGACY_ENV.get(name)):
            if var and environ.get(var):
                found[name] = environ[var].split("\n") if get_origin(hint) is list else environ[var]  # one item a line
                break
    return found


def load(args: argparse.Namespace | None = None, environ: dict[str, str] | None = None) -> Config:
    """defaults < TOML file < environment < flags, validated by one decode."""
    environ = dict(os.environ) if environ is None else environ
    merged: dict = {}
    path = getattr(args, "config", None) if args is not None else None
    if path:
        with open(path, "rb") as f:
            merged.update(tomllib.load(f))
    merged.update(_env_overrides(environ))
    if args is not None:
        merged.update({k: v for k, v in vars(args).items() if k in Config.__struct_fields__ and v is not None})
    try:
        # strict=False lets "30000" from the environment become an int, "1" a bool.
        config = msgspec.convert(merged, Config, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid configuration: {e}") from None
    config.housekeeping_pattern = [p for p in config.housekeeping_pattern if p]  # '' clears the defaults
    config.envelope_pattern = [p for p in config.envelope_pattern if p]
    try:
        ClientRules.from_config(config)
    except ValueError as e:
        raise ConfigError(f"invalid configuration: {e}") from None
    return config
