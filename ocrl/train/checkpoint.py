"""Checkpoints on disk: `<save_dir>/step-<n>/` holds the weights (the LoRA adapter, or the whole
model), the optimizer's state and `state.json` (step, weights version, consumed count, probe).

A checkpoint is written into a staging directory and renamed into place, and `state.json` is
written last, so a directory with one is complete; a crash leaves staging that the next save
removes. Only the newest `KEEP_CHECKPOINTS` stay. Everything is owner-only: the weights were
trained on people's conversations. Knows models, optimizers and files, never samples or steps'
contents.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path

import anyio
import msgspec
import torch

from ocrl.faults import crash_point
from ocrl.types import Progress

log = logging.getLogger("ocrl.train")

KEEP_CHECKPOINTS = 3
_CHECKPOINT = re.compile(r"^step-(\d+)$")


class CheckpointState(msgspec.Struct):
    """`state.json`: where training stood when the checkpoint was taken."""

    step: int
    weights_version: int
    consumed_samples: int
    lora: bool
    lora_rank: int = 0
    saved_at: float = msgspec.field(default_factory=time.time)
    # the probe sample's prompt and response ids (its conversation: None with --no-record-text)
    probe: tuple[list[int], list[int]] | None = None


def directory(save_dir: str | None, record_dir: str | Path | None) -> Path | None:
    """Where checkpoints go: --save-dir, else `checkpoints/` in the run's record dir, else
    nowhere (None: a run that keeps no records keeps no checkpoints unless told where)."""
    if save_dir:
        return Path(save_dir)
    return Path(record_dir) / "checkpoints" if record_dir is not None else None


def checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints under `directory` (a state.json is written last), oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _CHECKPOINT.match(p.name))]
    return [p for _, p in sorted(found) if (p / "state.json").exists()]


async def save(final: Path, model, optimizer: torch.optim.Optimizer, state: CheckpointState, *, lora: bool, events) -> bool:
    """Write the checkpoint `final`, publishing Progress between its stages; False (the previous
    checkpoint stands, and no staging is left) when a stage fails, e.g. on a full disk."""
    task = f"checkpoint step {state.step}"
    staging = final.with_name(f".{final.name}.tmp")
    # 1. weights -> 2. optimizer -> 3. state, rename, prune; progress between stages
    events.publish(Progress(task=task, done=0, total=3))
    try:
        await anyio.to_thread.run_sync(_write_weights, model, lora, staging)
        events.publish(Progress(task=task, done=1, total=3))
        await anyio.to_thread.run_sync(_save_private, optimizer.state_dict(), staging / "optimizer.pt")
        events.publish(Progress(task=task, done=2, total=3))
        await anyio.to_thread.run_sync(_finish, staging, final, state)
    except Exception as e:  # a full disk (OSError, or the writers own errors): the previous checkpoint stands
        shutil.rmtree(staging, ignore_errors=True)
        log.error("checkpoint of step %d failed (%s): the previous one stands", state.step, e)
        events.log("error", f"checkpoint of step {state.step} failed: {e}")
        return False
    finally:
        events.publish(Progress(task=task, done=3, total=3))
    log.info("saved %s", final)
    return True


def load(path: Path, model, optimizer: torch.optim.Optimizer, *, lora: bool, device: torch.device) -> CheckpointState:
    """Restore the weights and the optimizer from the checkpoint `path`; returns its state."""
    state = msgspec.json.decode((path / "state.json").read_bytes(), type=CheckpointState)
    if state.lora != lora:
        raise ValueError(f"{path} holds {'a LoRA adapter' if state.lora else 'full weights'}; config disagrees")
    if lora:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        loaded = load_file(str(path / "adapter" / "adapter_model.safetensors"), device=str(device))
        result = set_peft_model_state_dict(model, loaded)
        if result.unexpected_keys:
            raise ValueError(f"{path}: adapter does not fit the model: {result.unexpected_keys[:3]}")
    else:
        from safetensors.torch import load_model

        load_model(model, str(path / "model.safetensors"), device=str(device))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True, map_location=device))
    return state


def _write_weights(model, lora: bool, staging: Path) -> None:
    if staging.exists():
        shutil.rmtree(staging)
    staging.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    staging.parent.chmod(0o700)
    staging.mkdir(mode=0o700)
    if lora:
        model.save_pretrained(staging / "adapter")
    else:
        from safetensors.torch import save_model

        save_model(model, str(staging / "model.safetensors"))  # handles tied weights


def _save_private(obj, path: Path) -> None:
    """torch.save into a file only its owner can read (optimizer moments mirror the weights)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        torch.save(obj, f)


def _finish(staging: Path, final: Path, state: CheckpointState) -> None:
    crash_point("checkpoint")
    (staging / "state.json").write_bytes(msgspec.json.encode(state))
    # weights trained on people's conversations: owner only, whatever the umask
    for path in [staging, *staging.rglob("*")]:
        path.chmod(0o700 if path.is_dir() else 0o600)
    if final.exists():  # re-saving a step: swap the old one out, then drop it
        old = final.with_name(final.name + ".old")
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old)
    else:
        os.replace(staging, final)
    stale = checkpoints(final.parent)[:-KEEP_CHECKPOINTS] + list(final.parent.glob(".step-*.tmp"))
    for path in stale:  # older checkpoints, and staging left by a crash
        shutil.rmtree(path, ignore_errors=True)
