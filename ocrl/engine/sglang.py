"""The SGLang engine: the Engine protocol over an in-process `sglang.Engine` (read against
sglang 0.5.23: python/sglang/srt/entrypoints/engine.py, managers/tokenizer_manager.py,
managers/tokenizer_control_mixin.py, managers/io_struct.py).

Token ids in and out: SGLang starts with `skip_tokenizer_init`, so it never tokenizes; this
adapter decodes text only to honour stop strings (as the HF engine does) and stops the request
itself. Log-probs are the raw ones (before temperature; `SGLANG_RETURN_ORIGINAL_LOGPROB=1`), so
they equal a teacher-forced forward, like the HF engine's.

Everything runs on the daemon's event loop through the async `engine.tokenizer_manager`
methods. Starting SGLang's processes, its signals and its synchronous conveniences are
sglang_process.py's; `shutdown()` stops those processes (SGLang's way: every descendant of this
one).

Weight swaps, two paths behind `update_weights` (one `weights_version` either way):
- full weights (what the trainer sends today, merged tensors named as in the HF model): cast to
  the served dtype, flattened into buckets per dtype (`load_format="flattened_bucket"`, one
  CUDA-IPC handle per bucket), sent between `pause_generation` and `continue_generation`.
  `retract` (default) frees the in-flight KV, so the swap can flush the prefix cache and those
  requests re-prefill under the new weights; `in_place` keeps their KV and does not flush.
  Either way a completion that spans a swap mixes two versions; its final chunk reports the
  newer one (`mixed_completions` counts them).
- LoRA (tensors named `...lora_A.weight` / `...lora_B.weight`; needs `lora_rank > 0` at start):
  each version is a new adapter `policy-v<N>`; a request uses the adapter current when it
  starts, so every completion is exactly one version; the previous adapter is unloaded once
  its requests finish (SGLang's registry waits for them). `base()` serves the base weights of
  the same engine (a judge that must not see the policy).
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from typing import AsyncIterator

import anyio

from ocrl.engine.base import EngineBusy, EngineError, Final, collect, find_stop, finished_end, ready_end
from ocrl.engine.sglang_process import Health, guard_sync_methods, launch, take_signals
from ocrl.engine.sglang_swap import BUCKET_BYTES, WeightSwaps, _make
from ocrl.types import Completion, Grammar, SamplingParams, TokenChunk, TopLogprob

log = logging.getLogger("ocrl.engine")

CURRENT = object()  # score / next_token_logprobs: the adapter new requests use
TOP_FOR_NEXT_TOKEN = 256  # next_token_logprobs: top-K exact, the rest share what is left


def _finish_reason(reason) -> str | None:
    """SGLang's `meta_info["finish_reason"]` (None, or a dict with "type") -> OpenAI's."""
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    if kind in ("stop", "length"):
        return kind
    if kind == "abort":
        raise EngineError(f"sglang aborted the request: {reason.get('message', 'aborted')}")
    raise EngineError(f"sglang finished with an unknown reason {reason!r}")


class _Stream:
    """One request's progress: ids and log-probs seen so far, text emitted so far."""

    def __init__(self, incremental: bool):
        self.incremental = incremental
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[list[TopLogprob]] = []
        self.emitted_chars = 0

    def new_tokens(self, out: dict, want_tops: bool) -> tuple[list[int], list[float], list[list[TopLogprob]]]:
        """The tokens this chunk adds. Cumulative chunks repeat everything so far (and
        `output_ids` may be SGLang's live list), so we slice at once; incremental ones are deltas."""
        meta = out["meta_info"]
        start = 0 if self.incremental else len(self.ids)
        ids = list(out["output_ids"][start:])
        triples = meta.get("output_token_logprobs") or []
        logprobs = [float(t[0]) for t in triples[start : start + len(ids)]]
        if len(logprobs) != len(ids):
            raise EngineError(f"sglang returned {len(ids)} tokens but {len(logprobs)} log-probs")
        tops: list[list[TopLogprob]] = []
        if want_tops:
            rows = (meta.get("output_top_logprobs") or [])[start : start + len(ids)]
            tops = [[TopLogprob(int(t[1]), float(t[0])) for t in (row or [])] for row in rows]
        self.ids += ids
        self.logprobs += logprobs
        self.tops += tops
        return ids, logprobs, tops


class SGLangEngine(WeightSwaps):
    def __init__(
        self, inner, *, tokenizer, name: str, max_context: int, eos_ids, vocab_size: int, dtype=None,
        incremental: bool = True, pause_mode: str = "retract", lora_config: dict | None = None,
        max_queued: int = 256, bucket_bytes: int = BUCKET_BYTES, tp_size: int = 1, device: str = "cuda",
    ):  # fmt: skip
        if pause_mode not in ("retract", "in_place"):
            raise ValueError(f"pause_mode {pause_mode!r}: retract or in_place")
        guard_sync_methods(inner)
        self.inner = inner
        self.tm = inner.tokenizer_manager
        self.tokenizer = tokenizer
        self.name = name
        self.max_context = max_context
        self.eos_ids = sorted(eos_ids)
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.incremental = incremental
        self.pause_mode = pause_mode
        self.lora_config = lora_config
        self.max_queued = max_queued
        self.bucket_bytes = bucket_bytes
        self.tp_size = tp_size
        self.weights_version = 0
        self.adapter: str | None = None  # the LoRA adapter new requests use (None: base weights)
        self._adapter_versions: dict[str | None, int] = {None: 0}
        self._swap_lock = anyio.Lock()
        self._task_group = None
        self._waiting = 0  # submitted, no token yet
        self.active = 0  # streaming tokens
        self.generated_tokens = 0
        self.mixed_completions = 0
        self.last_swap: dict[str, float] = {}
        self.failed: str | None = None
        import torch

        self.device = torch.device(device)

    # -- start and stop ---------------------------------------------------------------------

    @classmethod
    async def start(cls, loaded, config, *, lora_rank: int = 0, pause_mode: str = "retract") -> "SGLangEngine":
        """Launches SGLang's processes for `loaded`'s model (sglang_process.py) and takes back
        signal handling. `lora_rank > 0` enables the LoRA swap path (adapters up to that rank)."""
        health = Health()
        started = time.monotonic()
        inner, lora_config = launch(loaded, config, lora_rank=lora_rank, health=health)
        model_config = loaded.model.config
        eos = model_config.eos_token_id
        eos_ids = {i for i in (eos if isinstance(eos, list) else [eos]) + [loaded.tokenizer.eos_token_id] if i is not None}
        trained_for = int(getattr(model_config, "max_position_embeddings", 2048))
        engine = cls(
            inner, tokenizer=loaded.tokenizer, name=loaded.name,
            max_context=min(config.context_length, trained_for) if config.context_length > 0 else trained_for,
            eos_ids=eos_ids, vocab_size=int(model_config.vocab_size), dtype=next(loaded.model.parameters()).dtype,
            lora_config=lora_config, max_queued=config.max_queued_requests, pause_mode=pause_mode,
        )  # fmt: skip
        engine.adopt_signals(health)
        log.info("sglang engine up in %.1fs (static pool %.0f%% of GPU memory)", time.monotonic() - started,
                 100 * config.engine_mem_fraction)
        return engine

    def adopt_signals(self, health: Health) -> None:
        """A failing SGLang child now stops this engine's daemon in order (see `take_signals`)."""
        health.engine = self
        take_signals(self.tm, health)

    async def run(self) -> None:
        """Owned by the daemon's task group: hosts adapter unloads; shuts SGLang down when
        cancelled."""
        try:
            async with anyio.create_task_group() as tg:
                self._task_group = tg
                await anyio.sleep_forever()
        finally:
            self._task_group = None
            self.shutdown()

    def shutdown(self) -> None:
        """Stops SGLang's processes (and, SGLang's way, every other descendant of this process)."""
        inner, self.inner = self.inner, None
        if inner is not None:
            inner.shutdown()

    # -- generation -------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return self._waiting

    @property
    def accepts_adapters(self) -> bool:
        """Started with LoRA: the trainer publishes its adapter, not merged weights."""
        return self.lora_config is not None

    def base(self) -> "BaseWeights":
        """The same engine serving its base weights (no adapter): for a judge."""
        return BaseWeights(self)

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenChunk]:
        return self._stream(prompt_ids, params, self.adapter)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        return await collect(self.stream(prompt_ids, params), prompt_ids)

    async def prepare(self, grammar: Grammar) -> None:
        """Nothing to do here: SGLang compiles (and caches) the grammar it is given per request."""

    def _sampling(self, params: SamplingParams, max_new: int) -> dict:
        sampling = {
            "max_new_tokens": max_new, "temperature": params.temperature, "top_p": params.top_p,
            "stop_token_ids": list(self.eos_ids), "skip_special_tokens": True,
        }  # fmt: skip
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        if params.grammar is not None:  # SGLang's own structured output (its grammar backend)
            if params.grammar.json_schema is not None:
                sampling["json_schema"] = params.grammar.json_schema
            else:
                sampling["regex"] = params.grammar.regex
        return sampling

    def _check_alive(self) -> None:
        if self.failed or self.inner is None:
            raise EngineError(self.failed or "the sglang engine is shut down")

    async def _stream(self, prompt_ids: list[int], params: SamplingParams, adapter: str | None) -> AsyncIterator[TokenChunk]:
        from sglang.srt.managers.io_struct import GenerateReqInput

        self._check_alive()
        if self._waiting >= self.max_queued:
            raise EngineBusy(f"{self._waiting} generations already queued")
        version = self._adapter_versions.get(adapter, self.weights_version)
        max_new = max(0, min(params.max_tokens, self.max_context - len(prompt_ids)))
        if max_new == 0:
            yield Final(token_ids=[], logprobs=[], text="", finish_reason="length", weights_version=version)
            return
        rid = uuid.uuid4().hex
        request = _make(
            GenerateReqInput, input_ids=list(prompt_ids), sampling_params=self._sampling(params, max_new),
            return_logprob=True, top_logprobs_num=params.top_logprobs, stream=True, rid=rid, lora_path=adapter,
        )  # fmt: skip
        progress = _Stream(self.incremental)
        outputs = self.tm.generate_request(request, None)
        stops = params.stop
        self._waiting += 1
        streaming = False
        finished = stopped = False
        try:
            async for out in outputs:
                if not streaming:
                    self._waiting -= 1
                    self.active += 1
                    streaming = True
                ids, logprobs, tops = progress.new_tokens(out, params.top_logprobs > 0)
                self.generated_tokens += len(ids)
                finish = _finish_reason(out["meta_info"].get("finish_reason"))
                text = self.tokenizer.decode(progress.ids, skip_special_tokens=True)
                stop_at = find_stop(text, stops, progress.emitted_chars)
                if stop_at >= 0:
                    finish, end, stopped = "stop", stop_at, True
                    keep = self._tokens_through(progress, stops)
                    drop = len(progress.ids) - keep
                    if drop:  # tokens after the one that completed the stop string: never emitted
                        ids, logprobs, tops = ids[: len(ids) - drop], logprobs[: len(logprobs) - drop], tops[: len(tops) - drop]
                elif finish is not None:
                    end = finished_end(text)
                else:
                    end = ready_end(text, stops, progress.emitted_chars)
                delta = text[progress.emitted_chars : max(end, progress.emitted_chars)]
                progress.emitted_chars = max(end, progress.emitted_chars)
                if finish is None:
                    if ids or delta:
                        yield TokenChunk(token_ids=ids, logprobs=logprobs, text=delta, top_logprobs=tops)
                    continue
                # settle before the final chunk: a consumer stops reading at it and never resumes us
                finished = True
                self._settle(rid, streaming, abort=stopped)
                yield Final(
                    token_ids=ids, logprobs=logprobs, text=delta, top_logprobs=tops, finish_reason=finish,
                    weights_version=self._final_version(adapter, version, out["meta_info"]),
                )  # fmt: skip
                return
            raise EngineError("sglang ended the stream without a finish reason")
        finally:
            if not finished:  # an error, or a consumer that left: free SGLang's slot now
                self._settle(rid, streaming, abort=True)
            await outputs.aclose()

    def _settle(self, rid: str, streaming: bool, *, abort: bool) -> None:
        if streaming:
            self.active -= 1
        else:
            self._waiting -= 1
        if abort:
            self.tm.abort_request(rid)

    def _tokens_through(self, progress: _Stream, stops) -> int:
        """How many tokens it took to complete the first stop string (those are kept; a chunk
        may carry several tokens, and the ones after the stop were never meant to be sampled)."""
        for n in range(1, len(progress.ids) + 1):
            text = self.tokenizer.decode(progress.ids[:n], skip_special_tokens=True)
            if any(s in text for s in stops):
                return n
        return len(progress.ids)

    def _final_version(self, adapter: str | None, started_with: int, meta: dict) -> int:
        if adapter is not None or self.lora_config is not None:
            return started_with  # one adapter per request: exact
        served = meta.get("weight_version")
        finished_with = int(served) if isinstance(served, str) and served.isdigit() else self.weights_version
        if finished_with != started_with:
            self.mixed_completions += 1
        return finished_with

    async def _prefill(self, ids: list[int], adapter: str | None, **logprob_args) -> dict:
        from sglang.srt.managers.io_struct import GenerateReqInput

        self._check_alive()
        request = _make(
            GenerateReqInput, input_ids=list(ids), sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            return_logprob=True, stream=False, lora_path=adapter, **logprob_args,
        )  # fmt: skip
        return await self.tm.generate_request(request, None).__anext__()

    async def score(self, prompt_ids: list[int], response_ids: list[int], *, adapter=CURRENT) -> list[float]:
        """Teacher-forced log-probs of response_ids after prompt_ids: one prefill with input
        log-probs from the last prompt position (SGLang reports None for the first position
        of the range, so we start one early and drop it)."""
        adapter = self.adapter if adapter is CURRENT else adapter
        if not response_ids:
            return []
        out = await self._prefill(prompt_ids + response_ids, adapter, logprob_start_len=max(0, len(prompt_ids) - 1))
        triples = out["meta_info"]["input_token_logprobs"][-len(response_ids) :]
        if [int(t[1]) for t in triples] != list(response_ids) or any(t[0] is None for t in triples):
            raise EngineError("sglang's input log-probs do not line up with the response tokens")
        return [float(t[0]) for t in triples]

    async def next_token_logprobs(self, prompt_ids: list[int], *, adapter=CURRENT):
        """(V,) log-probs of the next token: the top TOP_FOR_NEXT_TOKEN exact, every other token
        given an equal share of the probability left (a full-vocabulary row is not returned)."""
        import torch

        adapter = self.adapter if adapter is CURRENT else adapter
        out = await self._prefill(prompt_ids, adapter, top_logprobs_num=TOP_FOR_NEXT_TOKEN)
        top = out["meta_info"]["output_top_logprobs"][0]
        values = torch.tensor([float(t[0]) for t in top], dtype=torch.float32)
        index = torch.tensor([int(t[1]) for t in top], dtype=torch.long)
        left = max(1e-12, 1.0 - float(values.exp().sum()))
        rest = self.vocab_size - len(top)
        row = torch.full((self.vocab_size,), math.log(left / rest) if rest > 0 else -math.inf)
        row[index] = values
        return row


class BaseWeights:
    """The engine with no adapter: generation and log-probs from the base weights."""

    def __init__(self, engine: SGLangEngine):
        self.engine = engine
        self.name = engine.name
        self.max_context = engine.max_context
        self.weights_version = 0

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenChunk]:
        return self.engine._stream(prompt_ids, params, None)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        return await collect(self.stream(prompt_ids, params), prompt_ids)

    async def prepare(self, grammar: Grammar) -> None:
        await self.engine.prepare(grammar)

    async def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        return await self.engine.score(prompt_ids, response_ids, adapter=None)

    async def next_token_logprobs(self, prompt_ids: list[int]):
        return await self.engine.next_token_logprobs(prompt_ids, adapter=None)

    async def run(self) -> None:
        await anyio.sleep_forever()


