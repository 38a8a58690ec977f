"""Composes the parts in one event loop under one anyio task group: the engine's scheduler, the
HTTP server, the judging of closed turns, idle-session expiry and (when training) the trainer.

Data flows one way: api -> engine -> sessions -> judge -> sessions -> journal -> queue -> trainer
-> engine.update_weights. This module owns start-up and shutdown order and nothing else: on
SIGINT/SIGTERM it stops accepting, lets in-flight completions and votes finish (bounded), flushes
the records, checkpoints, and returns.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import sys
import time
from pathlib import Path

import anyio
import msgspec

from ocrl import chat, memory, models, records as records_mod
from ocrl.api import Api
from ocrl.clients import ClientRules
from ocrl.config import Config, ConfigError
from ocrl.engine.hf import HFEngine
from ocrl.engine.select import build_engine
from ocrl.events import Events
from ocrl.guard import is_loopback
from ocrl.jsonl import DiskFull
from ocrl.judge.completers import EngineCompleter, RemoteCompleter
from ocrl.restore import restore
from ocrl.sessions import Sessions
from ocrl.stats import (
    EngineStats, MemoryStats, PrefixCacheStats, ReplicaStats, RequestStats, RestoredStats, SampleStats, SessionStats, Stats,
    StorageStats, TrainerActorStats, TrainingStats, WeightSyncStats, strict,
)  # fmt: skip
from ocrl.types import Progress

log = logging.getLogger("ocrl")


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr, force=True)
    for noisy in ("httpx", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def set_threads(config: Config) -> None:
    """CPU threads per torch call. By default half the cores: the engine's decode and the
    trainer's step run in two threads at once, and two OpenMP teams that each want every core
    spin against each other (measured here: 2 threads each on 2 cores ran 10x slower than 1)."""
    import os

    import torch

    torch.set_num_threads(config.threads or max(1, (os.cpu_count() or 2) // 2))


def check_access(config: Config) -> None:
    if not config.api_key and not is_loopback(config.host) and not config.insecure_no_auth:
        raise ConfigError(
            f"refusing to listen on {config.host} without an API key: set --api-key (or OCRL_API_KEY), "
            "or pass --insecure-no-auth to accept anyone who can reach this port"
        )


def check_checkpoints(config: Config) -> None:
    """A run that trains from the model as loaded refuses a checkpoint dir that holds an earlier
    run's checkpoints: its own step-N would sit beside them, and a later --resume (or a trainer
    actor that Ray restarts) would take whichever step is highest, the earlier run's included."""
    from ocrl.train import checkpoint

    if config.no_train or config.resume or not (config.record_dir or config.save_dir):
        return  # a run without --record-dir/--save-dir gets a new run dir
    directory = checkpoint.directory(config.save_dir, config.record_dir)
    found = checkpoint.checkpoints(directory)
    if found:
        raise ConfigError(
            f"{directory} holds checkpoints of an earlier run (newest {found[-1].name}): pass --resume to go on from it, "
            "or a new --record-dir (or --save-dir) to start over from the model"
        )


class Daemon:
    def __init__(self, config: Config):
        self.config = config
        self.events = Events()
        self.server = None
        self.trainer = None
        self.judge_engine = None
        self.started = time.time()
        self.trimmer = memory.Trimmer()

    # 1. build: model, engine, records, judge, sessions, api (trainer when training)
    async def build(self) -> None:
        config = self.config
        set_threads(config)
        if not config.no_malloc_tune:  # before the model loads: arenas made before stay
            tuned = memory.tune()
            if tuned:
                log.info("malloc tuned: %s", " ".join(f"{k}={v}" for k, v in tuned.items()))
        self.events.publish(Progress(task="loading model", done=0, total=3))
        loaded = await anyio.to_thread.run_sync(
            lambda: models.load(
                config.model, device=config.device, dtype=config.dtype, random_init=config.random_init,
                context_length=config.context_length, rope_scaling=config.rope_scaling,
            )
        )
        self.loaded = loaded
        self.events.publish(Progress(task="loading model", done=1, total=3))
        if config.replicas:
            from ocrl.cluster.router import Cluster

            self.engine = await Cluster.start(config, loaded)
        else:
            self.engine = await build_engine(config, loaded)
        run_dir = Path(config.record_dir) if config.record_dir else None
        if run_dir is None and config.resume:
            run_dir = records_mod.newest_run_dir()
        self.run_dir = run_dir or records_mod.new_run_dir()
        self.records = records_mod.Records(self.run_dir, record_text=not config.no_record_text)
        self.judge = await self._build_judge(loaded)
        self.events.publish(Progress(task="loading model", done=2, total=3))
        self.samples_send, self.samples_receive = anyio.create_memory_object_stream(math.inf)
        self.queued = 0
        self.unjournaled = []  # samples a full disk kept out of the journal, oldest first
        self.sessions = Sessions(
            judge=self.judge.judge,
            submit=self.submit,
            records=self.records,
            events=self.events,
            default_turn_type=config.default_turn_type,
            timeout=config.session_timeout,
            parse_response=lambda text: chat.parse_completion(text, True)[:2],
            distill=self._build_distill(loaded),
            clients=ClientRules.from_config(config),
        )
        if not config.no_train and config.replicas:  # the trainer as one more Ray actor
            from ocrl.cluster.remote_trainer import RemoteTrainer
            from ocrl.train.policy import verify_relative, verify_tolerance

            self.trainer = await RemoteTrainer.start(
                config, self.engine, records=self.records, events=self.events,
                verify_atol=verify_tolerance(loaded.model), verify_rtol=verify_relative(loaded.model),
            )
        elif not config.no_train:
            from ocrl.train.policy import train_device, verify_relative, verify_tolerance
            from ocrl.train.trainer import Trainer

            self.trainer = await anyio.to_thread.run_sync(
                lambda: Trainer(
                    config, loaded.model, engine=self.engine, records=self.records, events=self.events,
                    device=train_device(loaded.model), verify_atol=verify_tolerance(loaded.model), verify_rtol=verify_relative(loaded.model),
                )
            )
            if config.resume:
                restored = self.trainer.load_latest()
                log.info("resumed from %s", restored) if restored else log.info("--resume: no checkpoint yet")
        self.events.publish(Progress(task="loading model", done=3, total=3))
        self._requeue_backlog()
        # then the turns that had no sample yet: judged again, or waiting for their next state
        restored = restore(self.sessions, self.records.main_turns(), self.records.next_states(), self.records.journaled())
        if restored["sessions"]:
            log.info(
                "restored %d sessions of an earlier process: %d turns to judge again, %d waiting for their next state, "
                "%d excluded (text not recorded)", restored["sessions"], restored["rejudged"], restored["open"], restored["excluded_without_text"],
            )
        self.restored = dict(restored)
        # last: an Api is what says the daemon is built (a dashboard then reads every stats field)
        self.api = Api(config, self.engine, loaded.tokenizer, self.sessions, stats=self.stats, events=self.events, control=self)

    async def _build_judge(self, loaded):
        from ocrl.judge.embed import EmbedJudge
        from ocrl.judge.llm import GenerateJudge, VerdictJudge

        config = self.config
        self.completer = None
        mode = config.prm_mode
        if mode == "auto":
            mode = "generate" if (config.prm_url or self.engine.device.type == "cuda") else "embed"
        if mode == "embed":
            log.info("judge: embed (all-MiniLM-L6-v2 fine-tuned as a classifier of the next state, margin %.2f)", config.prm_margin)
            return await anyio.to_thread.run_sync(lambda: EmbedJudge.load(margin=config.prm_margin))
        if config.prm_url:
            completer = RemoteCompleter(config.prm_url, config.prm_api_key, config.prm_model or "default")
        else:
            # The judge reads the policy's base weights, never the trained ones: while training,
            # it gets its own frozen copy (or --prm-model).
            if not config.prm_model and getattr(self.engine, "accepts_adapters", False):
                # LoRA weight sync: the policy is an adapter, so the engine's base weights are the judge
                completer = EngineCompleter(self.engine.base(), loaded.tokenizer)
            elif config.prm_model or not config.no_train:
                judge_loaded = await anyio.to_thread.run_sync(
                    lambda: models.load(
                        config.prm_model or config.model, device=config.device, dtype=config.dtype,
                        random_init="" if config.prm_model else config.random_init,
                    )
                )
                self.judge_engine = HFEngine(judge_loaded, max_batch_size=config.max_batch_size, prefix_cache_budget=config.prefix_cache)
                completer = EngineCompleter(self.judge_engine, judge_loaded.tokenizer)
            else:
                completer = EngineCompleter(self.engine, loaded.tokenizer)
        self.completer = completer
        log.info("judge: %s, m=%d", mode, config.prm_m)
        if mode == "verdict":
            return VerdictJudge(completer.verdict_probs, m=config.prm_m, seed=config.seed)
        return GenerateJudge(completer, m=config.prm_m, temperature=config.prm_temperature, max_tokens=config.prm_max_tokens)

    def _build_distill(self, loaded):
        """--method opd|combine: the hint judge (the embed judge's reading of corrections on CPU,
        else m generated votes) and the teacher's prompt (the turn's messages plus hints)."""
        from ocrl.judge.hints import EmbedHintJudge, GenerateHintJudge
        from ocrl.judging import Distill

        config = self.config
        if config.method == "rl":
            return None
        if self.completer is not None:
            hinter = GenerateHintJudge(
                self.completer, m=config.prm_m, temperature=config.prm_temperature, max_tokens=config.hint_max_tokens,
                min_chars=config.hint_min_chars,
            )
        else:
            hinter = EmbedHintJudge(self.judge, min_chars=config.hint_min_chars)
        log.info("method: %s, hint judge %s, hint in the %s message, experience %s", config.method, hinter.name,
                 config.hint_placement, config.experience)
        tokenizer = loaded.tokenizer

        def teacher_prompt(turn, hints: list[str]) -> list[int]:
            return chat.prompt_ids(tokenizer, chat.with_hints(turn.messages, hints, config.hint_placement), turn.tools)

        return Distill(config.method, hinter.hint, teacher_prompt, config.experience, config.experience_max)

    # 2. samples: journaled durably, then queued for the trainer (or excluded by rule)
    def submit(self, sample) -> None:
        self.records.sample(sample)
        try:
            self.records.journal(sample)
        except DiskFull:  # held here, never queued unjournaled; `_watch_disk` retries
            self.unjournaled.append(sample)
            return
        self._queue(sample)

    def _queue(self, sample) -> None:
        if not sample.effective and not (self.trainer is not None and self.config.counts_untrained):
            self.records.consumed([sample.sample_id])  # mask 0: excluded by rule, nothing to train
        elif self.trainer is not None:  # --batch-counts all: a mask-0 sample fills its batch too
            self.samples_send.send_nowait(sample)
            self.queued += 1

    async def _watch_disk(self, every: float = 2.0) -> None:
        """While the record dir cannot be written: retries, and once it can, journals and queues
        the samples held meanwhile; main turns are taken again and the trainer goes on by itself."""
        while True:
            await anyio.sleep(every)
            if not (self.records.full or self.unjournaled or self.records.owed_consumed):
                continue
            if not self.records.recover():
                continue
            while self.unjournaled:
                try:
                    self.records.journal(self.unjournaled[0])
                except DiskFull:
                    break
                self._queue(self.unjournaled.pop(0))
            if not self.records.full:
                self.events.log("info", "the record dir can be written again")

    def _requeue_backlog(self) -> None:
        # Resumed: samples trained after the checkpoint we restored are trained again, once.
        resumed_at = self.trainer.steps if (self.trainer is not None and self.config.resume) else None
        if resumed_at is not None:
            self.records.mark_resumed(resumed_at)
        backlog = self.records.backlog(trained_through=resumed_at)
        self.backlog_at_start = len(backlog)
        if backlog:
            log.info("journal: %d samples collected earlier and not yet trained on", len(backlog))
        if self.trainer is not None:
            for sample in backlog:
                if not sample.effective and not self.config.counts_untrained:
                    self.records.consumed([sample.sample_id])  # counted under --batch-counts all, not now
                    continue
                self.samples_send.send_nowait(sample)
                self.queued += 1

    def stats(self) -> Stats:
        """The snapshot GET /v1/ocrl/stats serves and the dashboard reads (stats.py)."""
        engine = self.engine
        cache = getattr(engine, "prefix_cache", None)
        replicas = engine.stats() if self.config.replicas else None
        return Stats(
            model=self.api.served_name,
            weights_version=engine.weights_version,
            uptime_s=round(time.time() - self.started, 1),
            run_dir=str(self.run_dir),
            engine=EngineStats(
                queue_depth=engine.queue_depth,
                active=engine.active,
                generated_tokens=engine.generated_tokens,
                prefix_cache=strict(PrefixCacheStats, cache.stats()) if cache is not None else None,
                replicas=None if replicas is None else [
                    strict(ReplicaStats, {**r, "prefix_cache": strict(PrefixCacheStats, r["prefix_cache"])}) for r in replicas
                ],
                mixed_completions=getattr(engine, "mixed_completions", None),  # the engines that can mix versions
                weight_sync=strict(WeightSyncStats, sync) if replicas is not None and (sync := engine.weight_sync_stats()) else None,
            ),  # fmt: skip
            memory=strict(MemoryStats, {"rss_mb": memory.rss_mb(), **memory.heap(), "open_fds": memory.open_fds(), **self.trimmer.stats()}),
            requests=strict(RequestStats, self.api.request_log.stats()),
            storage=StorageStats(
                full=self.records.full,
                unjournaled_samples=len(self.unjournaled),
                owed_consumed=self.records.owed_consumed,
                dropped_rows=self.records.dropped_rows,
            ),
            sessions=strict(SessionStats, self.sessions.stats()),
            samples=SampleStats(
                queued=self.samples_send.statistics().current_buffer_used,
                journal_backlog_at_start=self.backlog_at_start,
                restored_at_start=strict(RestoredStats, self.restored),
            ),
            training=self._training_stats(),
        )

    # controls the dashboard and /v1/ocrl/* reach
    @property
    def training(self) -> bool:
        return self.trainer is not None

    def pause_training(self) -> None:
        self.trainer.pause()
        self.events.log("info", "training paused")

    def resume_training(self) -> None:
        self.trainer.resume()
        self.events.log("info", "training resumed")

    async def save_checkpoint(self):
        return await self.trainer.save_checkpoint()

    def _training_stats(self) -> TrainingStats:
        trainer = self.trainer
        if trainer is None:
            return TrainingStats(enabled=False)
        return TrainingStats(
            enabled=True,
            method=self.config.method,
            paused=trainer.paused,
            waiting_for_disk=trainer.waiting_for_disk,
            steps=trainer.steps,
            pending=trainer.pending,
            in_step=trainer.in_step,
            batch_size=self.config.rollout_batch_size,
            consumed_samples=trainer.consumed_samples,
            excluded_too_long=trainer.excluded_too_long,
            last=msgspec.to_builtins(trainer.last_metrics),
            actor=strict(TrainerActorStats, trainer.stats()) if self.config.replicas else None,
        )

    # 3. serve until a signal, then shut down in order
    async def serve(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # the daemon owns signals, not uvicorn
                yield

        config = self.config
        self.server = Server(
            uvicorn.Config(
                self.api, host=config.host, port=config.port, log_level="warning", access_log=False,
                lifespan="off", timeout_graceful_shutdown=30, log_config=None,
            )
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.engine.run)
            if self.judge_engine is not None:
                tg.start_soon(self.judge_engine.run)
            tg.start_soon(self.sessions.run)
            tg.start_soon(self.sessions.expire_idle)
            tg.start_soon(self._watch_disk)
            if not self.config.no_malloc_tune:
                tg.start_soon(self.trimmer.run)
            tg.start_soon(self._watch_signals)
            if self.trainer is not None:
                tg.start_soon(self.trainer.run, self.samples_receive)
            tg.start_soon(self._announce, task_status)
            try:
                await self.server.serve()
            except SystemExit as exit:  # uvicorn's way of saying it could not listen
                raise ConfigError(f"cannot listen on {config.host}:{config.port}: {exit.__context__ or f'exit {exit.code}'}") from None
            log.info("shutting down: waiting for votes in flight")
            await self.sessions.drain(timeout=60)
            tg.cancel_scope.cancel()  # the trainer finishes its step and checkpoints on the way out
        self.records.close()
        log.info("stopped")

    async def _announce(self, task_status) -> None:
        while not self.server.started:
            await anyio.sleep(0.05)
        url = f"http://{self.config.host}:{self.config.port}/v1"
        log.info("serving %s at %s (run dir %s)", self.api.served_name, url, self.run_dir)
        task_status.started(url)

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("%s: stopping (in-flight requests finish first)", signal.Signals(signum).name)
                self.server.should_exit = True
                return


async def serve(config: Config) -> None:
    check_access(config)
    check_checkpoints(config)
    daemon = Daemon(config)
    if config.headless or not sys.stdout.isatty():
        await daemon.build()
        await daemon.serve()
        return
    # On a terminal: the dashboard runs beside the daemon from the start (it shows the model
    # loading); quitting it stops the daemon the same way a signal does.
    from tui.app import run_dashboard

    stopped = anyio.Event()

    async def run() -> None:
        try:
            await daemon.build()
            await daemon.serve()
        finally:
            stopped.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await run_dashboard(daemon, stop=stopped)
        if daemon.server is None:
            tg.cancel_scope.cancel()  # quit while loading
        else:
            daemon.server.should_exit = True
