"""Which engine serves: `--engine auto|hf|sglang`.

auto picks SGLang when the model sits on a CUDA device and `import sglang` works (the `gpu`
extra), else the transformers engine, which also runs on CUDA as the fallback. `--engine sglang`
without either is a configuration error that says what is missing. This module knows engines by
name only; it imports SGLang only when the model is on CUDA.
"""

from __future__ import annotations

import logging

log = logging.getLogger("ocrl.engine")


def sglang_problem() -> str | None:
    """None when SGLang imports, else why not (importing it on a CPU box is never attempted)."""
    try:
        import sglang  # noqa: F401
    except Exception as e:  # ImportError, or a broken CUDA build raising something else
        return f"{type(e).__name__}: {e}"
    return None


def resolve(config, device_type: str, *, sglang_check=sglang_problem) -> str:
    from ocrl.config import ConfigError

    if config.engine == "hf":
        return "hf"
    if device_type != "cuda":
        if config.engine == "sglang":
            raise ConfigError(
                f"--engine sglang needs a CUDA GPU, and the model is on {device_type} "
                "(use --engine hf or auto on this machine)"
            )
        return "hf"
    problem = sglang_check()
    if problem is None:
        return "sglang"
    if config.engine == "sglang":
        raise ConfigError(
            f"--engine sglang: SGLang is not usable here ({problem}); install the gpu extra "
            "(pip install -e '.[gpu]'; ./run.sh does it on a box with nvidia-smi) or use --engine hf"
        )
    log.info("engine auto: SGLang not usable (%s); serving with transformers on CUDA", problem)
    return "hf"


def adapter_rank(config, which: str) -> int:
    """The LoRA rank the engine must accept adapters of (`--weight-sync lora`), else 0."""
    from ocrl.config import ConfigError

    if config.weight_sync == "broadcast" and not config.replicas:
        raise ConfigError("--weight-sync broadcast needs --replicas (the trainer actor broadcasts to the replicas)")
    if config.weight_sync != "lora":
        return 0
    if which != "sglang":
        raise ConfigError("--weight-sync lora needs the sglang engine (the transformers engine takes merged weights)")
    if config.lora_rank <= 0 or config.full_finetune:
        raise ConfigError("--weight-sync lora needs LoRA training (--lora-rank > 0, no --full-finetune)")
    return config.lora_rank


async def build_engine(config, loaded, *, start_sglang=None):
    device_type = next(loaded.model.parameters()).device.type
    which = resolve(config, device_type)
    rank = adapter_rank(config, which)
    log.info("engine: %s on %s%s", which, device_type, f", LoRA weight sync (rank {rank})" if rank else "")
    if which == "sglang":
        if start_sglang is None:
            from ocrl.engine.sglang import SGLangEngine

            start_sglang = SGLangEngine.start
        engine = await start_sglang(loaded, config, lora_rank=rank)
        if config.random_init:
            # SGLang started from dummy weights: serve exactly the random model we hold (the
            # trainer starts from it too), as version 0.
            await engine.update_weights({n: p.detach() for n, p in loaded.model.named_parameters()}, version=0)
        return engine
    from ocrl.engine.hf import HFEngine

    return HFEngine(
        loaded, max_batch_size=config.max_batch_size, max_queued=config.max_queued_requests, max_context=config.context_length,
        prefix_cache_budget=config.prefix_cache,
    )
