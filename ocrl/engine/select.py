"""Which engine serves: `--engine auto|hf|sglang`.

auto picks SGLang when CUDA and the `gpu` extra are present, else the transformers engine.
"""

from __future__ import annotations

import logging

log = logging.getLogger("ocrl.engine")


def resolve(config, device_type: str) -> str:
    if config.engine != "auto":
        return config.engine
    return "hf"


async def build_engine(config, loaded):
    from ocrl.engine.hf import HFEngine

    device_type = next(loaded.model.parameters()).device.type
    which = resolve(config, device_type)
    if which != "hf":
        from ocrl.config import ConfigError

        raise ConfigError(f"--engine {which} is not available in this build")
    return HFEngine(loaded, max_batch_size=config.max_batch_size, max_queued=config.max_queued_requests, max_context=config.context_length)
