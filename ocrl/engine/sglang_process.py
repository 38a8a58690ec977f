"""SGLang's processes: launching its scheduler and detokenizer for a model, taking signal
handling back from it, and keeping its synchronous conveniences off the daemon's event loop.

Process hazards handled here: importing SGLang sets a uvloop policy and the `spawn` start
method, so entry points need a `__main__` guard (`python -m ocrl` has one); a failing child
sends SIGQUIT, whose default kills this whole process, so we pass `custom_sigquit_handler` and
turn it into an orderly SIGTERM of the daemon; SGLang's own SIGTERM handler is removed (the
daemon owns shutdown). The `sglang.Engine` convenience methods are synchronous
(`loop.run_until_complete`) and fail inside a running loop; they are replaced on our instance by
a guard that says so.

Knows how SGLang is started and stopped, never a request: generation and log-probs are
sglang.py's, weight swaps sglang_swap.py's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading

from ocrl.engine.base import EngineError

log = logging.getLogger("ocrl.engine")

# The sync conveniences of sglang.Engine that call loop.run_until_complete.
SYNC_METHODS = (
    "generate", "encode", "flush_cache", "update_weights_from_tensor", "update_weights_from_disk",
    "update_weights_from_distributed", "load_lora_adapter", "load_lora_adapter_from_tensors",
    "unload_lora_adapter", "release_memory_occupation", "resume_memory_occupation", "get_weights_by_name",
    "begin_weight_update", "end_weight_update",
)  # fmt: skip


def launch(loaded, config, *, lora_rank: int, health: Health):
    """Starts SGLang's processes for `loaded`'s model (blocks the loop for the launch, like
    loading a model does): `(sglang.Engine, the LoRA config of adapters it takes or None)`.
    `lora_rank > 0` enables LoRA adapters up to that rank."""
    os.environ.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")  # raw log-probs, as the HF engine
    import sglang  # lazy: sets a uvloop policy and the spawn start method on import

    dtype = next(loaded.model.parameters()).dtype
    kwargs = dict(
        model_path=loaded.path, tokenizer_path=loaded.path, skip_tokenizer_init=True,
        mem_fraction_static=config.engine_mem_fraction, dtype=str(dtype).removeprefix("torch."),
        random_seed=config.seed, incremental_streaming_output=True, log_level="error",
        custom_sigquit_handler=health.child_failed,
        load_format="dummy" if getattr(config, "random_init", "") else "auto",
    )  # fmt: skip
    if config.context_length > 0:
        kwargs["context_length"] = config.context_length
    lora_config = None
    if lora_rank > 0:
        from ocrl.loaded import LORA_TARGETS

        kwargs |= dict(enable_lora=True, max_lora_rank=lora_rank, lora_target_modules=list(LORA_TARGETS), max_loras_per_batch=2)
        lora_config = {"r": lora_rank, "lora_alpha": config.lora_alpha, "target_modules": list(LORA_TARGETS),
                       "peft_type": "LORA", "task_type": "CAUSAL_LM", "bias": "none", "lora_dropout": 0.0}  # fmt: skip
    return sglang.Engine(**kwargs), lora_config


def take_signals(tokenizer_manager, health: Health) -> None:
    """Start SGLang's response loop on our loop now, then take SIGTERM back (the daemon
    drains and checkpoints; SGLang's handler would kill the process tree) and route SIGQUIT
    from a failing child to an orderly stop."""
    tokenizer_manager.auto_create_handle_loop()
    if threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGQUIT):
        loop.remove_signal_handler(signum)
    loop.add_signal_handler(signal.SIGQUIT, health.child_failed)


def guard_sync_methods(inner) -> None:
    """Replace the instance's sync methods with ones that refuse to run inside a running loop."""
    for name in SYNC_METHODS:
        method = getattr(inner, name, None)
        if method is None:
            continue

        def guarded(*args, _name=name, _method=method, **kwargs):
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return _method(*args, **kwargs)
            raise EngineError(
                f"sglang.Engine.{_name}() is synchronous (it calls loop.run_until_complete) and cannot run "
                f"inside the daemon's event loop; await engine.tokenizer_manager.{_name}(...) instead"
            )

        setattr(inner, name, guarded)


class Health:
    """SIGQUIT from a failing SGLang child: mark the engine failed and stop the daemon in order
    (SIGTERM to ourselves) instead of SGLang's default of killing the whole process tree."""

    def __init__(self):
        self.engine = None  # the engine once launched: its `failed` says why it stopped

    def child_failed(self, signum=None, frame=None) -> None:
        log.error("an sglang child process failed (SIGQUIT)")
        if self.engine is None:
            return  # still launching: sglang.Engine() raises on its own
        self.engine.failed = "an sglang child process failed; the daemon is stopping"
        os.kill(os.getpid(), signal.SIGTERM)
