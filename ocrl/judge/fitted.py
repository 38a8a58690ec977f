"""The CPU judge's fitted readers and their cache: what a reader of next states offers the
committee (`Reader`: the fine-tuned classifier and the n-gram model both do), where its fitted
weights live (`weights_path`, keyed by the fit data and everything else that decides them), how
they are written (`save_cached`), and `load_or_fit`: read from the cache, or fitted and cached,
by one process at a time.

Fitting happens once per box and data revision (the classifier takes minutes); the cache is
`$OCRL_CACHE/embed-judge/`, and only the newest few of each kind stay there.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ocrl.judge.cases import Case, load_cases

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ocrl.judge")

KEEP_CACHED = 4  # fitted weights of each kind (classifiers, n-gram models) kept in the cache


class Reader(Protocol):
    """A committee member: class probabilities of (next state, role, response) items, fitted on
    labelled cases, its weights saved to and loaded from its own place in the cache."""

    name: str  # what the log calls it

    def read(self, items: Sequence[tuple[str, str, str]]) -> torch.Tensor: ...

    def fit(self, cases: Sequence[Case], progress: Callable[[str], None] | None = None) -> None: ...

    def cache_path(self, data: bytes) -> Path: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None: ...


def weights_path(kind: str, *parts: bytes) -> Path:
    """Where fitted weights of this kind ("judge", "ngrams") are cached: named by a hash of
    what decides them (the fit data, the settings, the encoder's fingerprint)."""
    from ocrl.models import cache_root

    key = hashlib.sha256(b"".join(parts)).hexdigest()[:16]
    return cache_root() / "embed-judge" / f"{kind}-{key}.safetensors"


def save_cached(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Writes fitted weights to the cache (through a temporary file: another process may fit at
    once), then drops all but the newest `KEEP_CACHED` of their kind (the name's prefix) there:
    each revision of the fit data leaves one, and another checkout on the box may use an older."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(partial))
    os.replace(partial, path)
    kind = path.name.split("-")[0]
    cached = sorted(path.parent.glob(f"{kind}-*.safetensors"), key=lambda old: old.stat().st_mtime_ns, reverse=True)
    for old in cached[KEEP_CACHED:]:
        if old != path:
            old.unlink(missing_ok=True)
            lock_path(old).unlink(missing_ok=True)


def load_or_fit(reader: Reader, data_path: Path) -> Reader:
    """The reader, its weights read from the cache, or fitted on the labelled cases at
    `data_path` (progress logged) and cached when missing. One process fits a given reader at a
    time (a lock file beside the weights): another that needs it waits, then reads what the
    first wrote, rather than fitting it too (two fits on a small box each take four times as long)."""
    from safetensors.torch import load_file

    data = data_path.read_bytes()
    path = reader.cache_path(data)
    if path.exists():
        reader.load_state_dict(load_file(str(path)))
        return reader
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path(path), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("embed judge: another process is fitting the %s on this data; waiting for it", reader.name)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            reader.load_state_dict(load_file(str(path)))
            return reader
        cases = load_cases(data_path)
        log.info("embed judge: fitting the %s on %d labelled cases (first use of this data on this box; cached after)", reader.name, len(cases))
        started = time.perf_counter()
        reader.fit(cases, lambda line: log.info("embed judge: %s", line))
        save_cached(reader.state_dict(), path)
    log.info("embed judge: %s fitted in %.0fs, cached at %s", reader.name, time.perf_counter() - started, path)
    shutil.rmtree(path.parent.parent / "embed-head", ignore_errors=True)  # the earlier linear head's cache
    return reader


def lock_path(path: Path) -> Path:
    """The lock file a fit of these weights holds."""
    return path.with_name(f"{path.name}.lock")
