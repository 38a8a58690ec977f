"""The daemon's stats snapshot, defined once: a tree of msgspec Structs.

The daemon builds a `Stats` from its parts (`Daemon.stats`), GET /v1/ocrl/stats serves it as
JSON, and the dashboard turns what it gets (this Struct in process, the JSON over HTTP) back into
the same `Stats` with `read()` and reads it by attribute. A field renamed here fails where it
is built or read, instead of showing 0 on a panel.

Two rules keep old and partial snapshots readable:
- A field with a default may be missing (a counter nothing has counted yet, a block a loading
  daemon has not filled: those blocks are None). The dashboard shows the default.
- Where the JSON leaves out what does not apply (an engine without a prefix cache, a process off
  glibc, a replica that never failed), the Struct says `omit_defaults` and only those fields
  have defaults; the rest are required.

The parts report plain dicts (sessions' counters, the request log, the prefix cache, the
replicas); `strict()` turns each into its Struct and refuses a key this file does not name, so a
counter renamed at its source fails the test that reads the stats. Knows nothing of where the
numbers come from.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

T = TypeVar("T", bound=msgspec.Struct)


class PrefixCacheStats(msgspec.Struct, kw_only=True):
    entries: int = 0
    tokens: int = 0
    bytes: int = 0
    max_bytes: int = 0
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0


class ReplicaStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One replica of a --replicas cluster, as the router last saw it."""

    index: int
    ready: bool
    weights_version: int | None  # None until its first status
    inflight: int
    routed: int
    served: int
    generated_tokens: int
    rss_mb: float | None
    pid: int | None
    incarnation: int
    prefix_cache: PrefixCacheStats
    probe_diff: float | None = None  # after a weight swap was probed
    last_error: str = ""  # why it is out of service


class WeightSyncStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    """--replicas --weight-sync broadcast: how trained versions reached the replicas."""

    mode: str  # broadcast
    backend: str  # nccl | gloo
    broadcasts: int  # swaps every ready replica took by the broadcast
    fallbacks: int  # swaps the object store carried (in part) after the group failed
    groups: int  # groups built (the first, and one after each fallback or change of members)
    members: int  # replicas in the standing group
    last_broadcast_s: float | None = None  # the last swap by broadcast, seconds
    last_object_store_s: float | None = None  # the last swap the object store carried
    last_error: str = ""


class EngineStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    queue_depth: int
    active: int
    generated_tokens: int
    prefix_cache: PrefixCacheStats | None = None  # engines that keep one
    replicas: list[ReplicaStats] | None = None  # --replicas
    mixed_completions: int | None = None  # sglang, full-weight swaps: completions that spanned a swap
    weight_sync: WeightSyncStats | None = None  # --replicas --weight-sync broadcast


class MemoryStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    """MiB (memory.py); the C heap's figures on glibc only."""

    rss_mb: float
    heap_in_use_mb: float | None = None
    heap_free_mb: float | None = None
    heap_mmap_mb: float | None = None
    open_fds: int | None = None  # sockets, files and pipes held open (Linux, macOS)
    trims: int = 0  # periodic malloc trims (memory.Trimmer) so far
    trim_ms_mean: float = 0.0


class RequestStats(msgspec.Struct, kw_only=True):
    """The access log's counts (access_log.py): answers by HTTP status, refusals by reason."""

    total: int = 0
    by_status: dict[str, int] = {}
    refused: dict[str, int] = {}  # reason -> count, most frequent first
    refused_total: int = 0


class StorageStats(msgspec.Struct, kw_only=True):
    full: bool = False  # the record dir refused a write: main turns are refused until it recovers
    unjournaled_samples: int = 0
    owed_consumed: int = 0
    dropped_rows: int = 0


class SessionStats(msgspec.Struct, kw_only=True):
    """The sessions' gauges, then their counters (sessions.py, session_index.py, restore.py),
    served flat under "sessions" as they always were."""

    sessions_open: int = 0
    sessions_waiting_next_state: int = 0
    judging: int = 0  # turns being judged now
    # sessions
    sessions_opened: int = 0
    sessions_closed: int = 0
    sessions_expired: int = 0
    sessions_restored: int = 0
    threaded_by_prefix: int = 0
    threaded_by_reply: int = 0
    # turns
    main_turns: int = 0
    side_turns: int = 0
    housekeeping_turns: int = 0
    aborted_turns: int = 0
    replaced_turns: int = 0
    superseded_turns: int = 0
    group_candidates: int = 0
    group_siblings: int = 0
    # the judge
    verdict_plus: int = msgspec.field(default=0, name="verdict_+1")
    verdict_0: int = 0
    verdict_minus: int = msgspec.field(default=0, name="verdict_-1")
    votes_truncated: int = 0  # PRM votes cut at their token budget with no score
    judge_failures: int = 0
    hints_accepted: int = 0
    hints_none: int = 0
    hint_votes_truncated: int = 0
    hint_failures: int = 0
    teacher_prompt_failures: int = 0
    settle_failures: int = 0
    # samples
    samples_mask1: int = 0
    samples_mask0: int = 0
    samples_promoted: int = 0


class RestoredStats(msgspec.Struct, kw_only=True):
    """What restore.py brought back from an earlier process."""

    sessions: int = 0
    rejudged: int = 0
    open: int = 0
    excluded_without_text: int = 0


class SampleStats(msgspec.Struct, kw_only=True):
    queued: int = 0  # waiting for the trainer
    journal_backlog_at_start: int = 0
    restored_at_start: RestoredStats = msgspec.field(default_factory=RestoredStats)


class TrainerActorStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    """--replicas: the trainer's Ray actor, as the daemon last saw it."""

    name: str
    up: bool
    incarnation: int  # changes when Ray restarts it
    pid: int | None
    restarts: int  # restarts the daemon restored it from (each from the newest checkpoint)
    restored_step: int  # the step the current incarnation started from
    device: str = ""
    rss_mb: float | None = None
    last_error: str = ""


class TrainingStats(msgspec.Struct, kw_only=True):
    enabled: bool = False  # False: --no-train, and every other field keeps its default
    method: str = ""
    paused: bool = False
    waiting_for_disk: bool = False
    steps: int = 0
    pending: int = 0  # samples towards the next step
    in_step: int = 0  # samples of the step under way (taken from the queue, not yet marked consumed)
    batch_size: int = 0
    consumed_samples: int = 0
    excluded_too_long: int = 0  # samples left out: their backward would not fit in the memory free (consumed.jsonl says too_long)
    last: dict[str, float | None] = {}  # the last step's metrics row (an infinite value is null in JSON)
    actor: TrainerActorStats | None = None  # --replicas: the trainer's Ray actor


class Stats(msgspec.Struct, kw_only=True):
    """GET /v1/ocrl/stats."""

    model: str = ""
    weights_version: int = 0
    uptime_s: float = 0.0
    run_dir: str = ""
    engine: EngineStats | None = None
    memory: MemoryStats | None = None
    requests: RequestStats | None = None
    storage: StorageStats | None = None
    sessions: SessionStats | None = None
    samples: SampleStats | None = None
    training: TrainingStats | None = None


def strict(cls: type[T], data: dict[str, Any]) -> T:
    """`data` as a `cls`, refusing a key `cls` has no field for (the nested values are checked
    by type, as msgspec converts them)."""
    unknown = set(data) - set(cls.__struct_encode_fields__)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field for {sorted(unknown)}: name it in ocrl/stats.py")
    return msgspec.convert(data, cls)


def read(snapshot: Stats | dict[str, Any]) -> Stats:
    """The dashboard's one way in: a `Stats` as it is, or decoded JSON converted into one (a
    value of the wrong type raises msgspec.ValidationError; an unknown key from a newer daemon is
    ignored)."""
    return snapshot if isinstance(snapshot, Stats) else msgspec.convert(snapshot, Stats)
