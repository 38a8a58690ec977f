"""The transformers engine: batched sampling with a KV cache on CPU (or one GPU as a fallback).

Requests queue in arrival order; the scheduler takes up to `max_batch_size` of them, left-pads
the prompts, prefills them together and decodes them step by step, dropping rows from the cache
as they finish. A request that arrives while a batch runs joins it between two decode steps
(prefilled on its own, then both caches left-padded to one width and stacked), room permitting
and unless a swap or a scoring pass waits for the weights: those go first, once the batch
drains. Each decode step runs in a worker thread, so the event loop stays free between steps.

Log-probs are taken from the raw logits (log_softmax in fp32, before temperature or top-p), so
they equal a teacher-forced forward of the same tokens; one sampling pass covers the whole batch
(engine/sampling.py). Weight swaps wait for the batch in
flight to finish: every completion comes from one weights version.

Finished rows (prompt + response) go to the prefix cache (engine/prefix_cache.py); a new prompt
that starts with a kept sequence prefills only the rest. Rows of one batch may then carry cached
prefixes of different lengths: the cached part of each row is right-aligned before the batch's
new tokens ([pad | cached | pad | new]), the attention mask hides both pads and each row's
position ids continue from its own cached length. A swap clears the cache.

This engine sees token ids; it decodes text only to honour stop strings.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator

import anyio
import torch

from ocrl.engine import prefix_cache
from ocrl.engine.base import EngineBusy, EngineError, Final, collect, find_stop, finished_end, ready_end
from ocrl.engine.sampling import Picked, sample_rows
from ocrl.faults import crash_point
from ocrl.grammar import GrammarError, Grammars, Matcher
from ocrl.types import Completion, FinishReason, Grammar, SamplingParams, TokenChunk, TopLogprob

COMPILE_SECONDS = 10.0  # a grammar not compiled within this is refused (400), not waited for

log = logging.getLogger("ocrl.engine")


class _Failure(TokenChunk, kw_only=True):
    error: str


@dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    send: object  # MemoryObjectSendStream[TokenChunk]
    generator: torch.Generator
    max_new: int
    response_ids: list[int] = field(default_factory=list)
    emitted_chars: int = 0
    cached_tokens: int = 0  # prompt positions served from the prefix cache
    finish: FinishReason | None = None
    closed: bool = False  # the consumer went away
    matcher: Matcher | None = None  # where the request stands in its grammar, if it has one


class HFEngine:
    def __init__(
        self, loaded, *, max_batch_size: int = 8, max_queued: int = 256, max_context: int = 0, prefix_cache_budget: str = "auto"
    ):
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.name = loaded.name
        self.device = next(self.model.parameters()).device
        self.max_batch_size = max_batch_size
        self.max_queued = max_queued
        trained_for = int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.max_context = min(max_context, trained_for) if max_context > 0 else trained_for
        self.weights_version = 0
        self.accepts_adapters = False  # swaps take merged weights
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {i for i in eos + [self.tokenizer.eos_token_id] if i is not None}
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._pending: deque[_Request] = deque()
        self._work = anyio.Event()
        self._model_lock = anyio.Lock()  # batches, scoring and swaps take turns on the weights
        self.generated_tokens = 0
        self.active = 0
        self._seed_source = random.Random()
        self.grammars = Grammars(self.tokenizer, self.eos_ids)  # compiled on first use
        self.prefix_cache = prefix_cache.PrefixCache(*prefix_cache.parse_budget(prefix_cache_budget, self.device))

    # -- public API -------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenChunk]:
        if len(self._pending) >= self.max_queued:
            raise EngineBusy(f"{len(self._pending)} generations already queued")
        send, receive = anyio.create_memory_object_stream[TokenChunk](math.inf)
        generator = torch.Generator(device="cpu")
        generator.manual_seed(params.seed if params.seed is not None else self._seed_source.getrandbits(63))
        room = self.max_context - len(prompt_ids)
        request = _Request(list(prompt_ids), params, send, generator, max(0, min(params.max_tokens, room)))
        if params.grammar is not None:
            request.matcher = await anyio.to_thread.run_sync(self.grammars.matcher, params.grammar)
        self._pending.append(request)
        self._work.set()
        try:
            async with receive:
                async for chunk in receive:
                    if isinstance(chunk, _Failure):
                        raise EngineError(chunk.error)
                    yield chunk
                    if isinstance(chunk, Final):
                        return
        finally:
            request.closed = True

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        return await collect(self.stream(prompt_ids, params), prompt_ids)

    async def prepare(self, grammar: Grammar) -> None:
        """Compiles a grammar ahead of its request, in a worker thread (the event loop keeps
        serving), within COMPILE_SECONDS: GrammarError if it cannot be enforced or takes longer.
        A thread cannot be stopped, so one past the limit is left to finish (its result is cached)."""
        with anyio.move_on_after(COMPILE_SECONDS) as scope:
            await anyio.to_thread.run_sync(self.grammars.compile, grammar, abandon_on_cancel=True)
        if scope.cancelled_caught:
            raise GrammarError(f"{grammar.source}: compiling the grammar took longer than {COMPILE_SECONDS:g} s; simplify the schema",
                               "tool_choice" if grammar.source.startswith("tool_choice") else "response_format")

    async def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """Teacher-forced log-probs of response_ids after prompt_ids under the served weights."""
        async with self._model_lock:
            return await anyio.to_thread.run_sync(self._score, prompt_ids, response_ids)

    async def next_token_logprobs(self, prompt_ids: list[int]) -> torch.Tensor:
        async with self._model_lock:
            return await anyio.to_thread.run_sync(self._next_token_logprobs, prompt_ids)

    async def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> float:
        """Copies new weights in between batches; returns the seconds the swap took."""
        async with self._model_lock:
            started = time.perf_counter()
            self.prefix_cache.clear()  # computed by the old weights (even if this copy fails halfway)
            await anyio.to_thread.run_sync(self._copy_weights, named_tensors)
            self.weights_version = version
            return time.perf_counter() - started

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    async def run(self) -> None:
        """The scheduler; owned by the daemon's task group, runs until cancelled."""
        while True:
            await self._work.wait()
            self._work = anyio.Event()
            while self._pending:
                batch = []
                while self._pending and len(batch) < self.max_batch_size:
                    request = self._pending.popleft()
                    if not request.closed:
                        batch.append(request)
                if batch:
                    async with self._model_lock:
                        await self._run_batch(batch)

    # -- the batch loop ---------------------------------------------------------------------

    async def _run_batch(self, batch: list[_Request]) -> None:
        version = self.weights_version
        self.active = len(batch)
        try:
            live = self._startable(batch, version)
            if not live:
                return
            state = await anyio.to_thread.run_sync(self._prefill, live)
            while live:
                picked = await anyio.to_thread.run_sync(self._sample, state, live)
                for request, pick in zip(live, picked):
                    if isinstance(pick, str):  # this request's sampling failed: it alone ends
                        self._send(request, _Failure(token_ids=[], logprobs=[], text="", error=pick))
                        request.send.close()
                        request.closed = True
                        continue
                    self._advance(request, *pick, version)
                keep = [i for i, r in enumerate(live) if r.finish is None and not r.closed]
                finished = [i for i, r in enumerate(live) if r.finish is not None]
                if finished and self.prefix_cache.enabled:
                    await anyio.to_thread.run_sync(self._keep_rows, state, live, finished, version)
                if not keep:
                    return
                await anyio.to_thread.run_sync(self._decode, state, [picked[i][0] for i in keep], keep, len(live))
                live = [live[i] for i in keep]
                joining = self._startable(self._joiners(len(live)), version)
                if joining:
                    batch += joining  # theirs to fail too, should the batch fail
                    state = await anyio.to_thread.run_sync(self._join, state, joining)
                    live += joining
                    self.active = len(live)
        except Exception as e:  # one bad batch fails its requests, never the engine
            log.exception("generation failed")
            for request in batch:
                if request.finish is None:
                    self._send(request, _Failure(token_ids=[], logprobs=[], text="", error=f"{type(e).__name__}: {e}"))
        finally:
            self.active = 0

    def _startable(self, requests: list[_Request], version: int) -> list[_Request]:
        """The requests that need the model; those with no room for a token finish at once."""
        for request in requests:
            if request.max_new == 0:
                request.finish = "length"
                self._finish(request, version)
        return [r for r in requests if r.finish is None]

    def _joiners(self, running: int) -> list[_Request]:
        """Queued requests that may join the running batch: room permitting, and only while
        nothing else waits for the weights (a swap would otherwise wait as long as traffic lasts)."""
        joiners: list[_Request] = []
        if self._model_lock.statistics().tasks_waiting:
            return joiners
        while self._pending and running + len(joiners) < self.max_batch_size:
            request = self._pending.popleft()
            if not request.closed:
                joiners.append(request)
        return joiners

    def _send(self, request: _Request, chunk: TokenChunk) -> None:
        try:
            request.send.send_nowait(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            request.closed = True

    def _finish(self, request: _Request, version: int, text: str = "") -> None:
        self._send(
            request,
            Final(
                token_ids=[], logprobs=[], text=text, finish_reason=request.finish, weights_version=version,
                cached_tokens=request.cached_tokens,
            ),
        )
        request.send.close()

    def _advance(self, request: _Request, token: int, logprob: float, tops: list[TopLogprob], version: int) -> None:
        request.response_ids.append(token)
        self.generated_tokens += 1
        stops = request.params.stop
        is_eos = token in self.eos_ids
        text = self.tokenizer.decode(request.response_ids, skip_special_tokens=True)
        stop_at = find_stop(text, stops, request.emitted_chars)
        if stop_at >= 0:
            request.finish = "stop"
            end = stop_at
        elif is_eos:
            request.finish = "stop"
            end = finished_end(text)
        elif len(request.response_ids) >= request.max_new:
            request.finish = "length"
            end = finished_end(text)
        else:
            end = ready_end(text, stops, request.emitted_chars)
        delta = text[request.emitted_chars : max(end, request.emitted_chars)]
        request.emitted_chars = max(end, request.emitted_chars)
        chunk_tops = [tops] if request.params.top_logprobs else []
        if request.finish is None:
            self._send(request, TokenChunk(token_ids=[token], logprobs=[logprob], text=delta, top_logprobs=chunk_tops))
        else:
            self._send(
                request,
                Final(
                    token_ids=[token],
                    logprobs=[logprob],
                    text=delta,
                    top_logprobs=chunk_tops,
                    finish_reason=request.finish,
                    weights_version=version,
                    cached_tokens=request.cached_tokens,
                ),
            )
            request.send.close()

    # -- torch work (worker threads) --------------------------------------------------------

    @torch.inference_mode()
    def _prefill(self, batch: list[_Request]) -> dict:
        from transformers import DynamicCache

        # at least one prompt position is computed: its logits give the first token
        hits = [self.prefix_cache.lookup(r.prompt_ids, self.weights_version, len(r.prompt_ids) - 1) for r in batch]
        past = max(hit.length for hit in hits)
        width = max(len(r.prompt_ids) - hit.length for r, hit in zip(batch, hits))
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)  # (B, W) the new tokens
        mask = torch.zeros((len(batch), past + width), dtype=torch.long)  # (B, P + W) cached + new
        positions = torch.zeros((len(batch), width), dtype=torch.long)  # (B, W)
        for row, (request, hit) in enumerate(zip(batch, hits)):
            rest = request.prompt_ids[hit.length :]
            n = len(rest)
            request.cached_tokens = hit.length
            ids[row, width - n :] = torch.tensor(rest)
            mask[row, past - hit.length : past] = 1
            mask[row, past + width - n :] = 1
            positions[row, width - n :] = torch.arange(hit.length, hit.length + n)
        cache = prefix_cache.batched(hits, past) if past else DynamicCache()
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return {"cache": cache, "mask": mask, "next_position": positions[:, -1] + 1, "logits": out.logits[:, -1]}

    @torch.inference_mode()
    def _join(self, running: dict, joining: list[_Request]) -> dict:
        """The running state with the joining requests' prefill stacked under it: every row
        left-padded to the wider width (the mask hides the pads; positions are per row)."""
        new = self._prefill(joining)
        width = max(running["mask"].shape[1], new["mask"].shape[1])

        def left_pad(t: torch.Tensor, dim: int) -> torch.Tensor:  # zeros before, along dim (from the end)
            missing = width - t.shape[dim]
            return torch.nn.functional.pad(t, (0, 0) * (-dim - 1) + (missing, 0)) if missing else t

        for old_layer, new_layer in zip(running["cache"].layers, new["cache"].layers):
            old_layer.keys = torch.cat([left_pad(old_layer.keys, -2), left_pad(new_layer.keys, -2)])  # (B, H, W, D)
            old_layer.values = torch.cat([left_pad(old_layer.values, -2), left_pad(new_layer.values, -2)])
        return {
            "cache": running["cache"],
            "mask": torch.cat([left_pad(running["mask"], -1), left_pad(new["mask"], -1)]),  # (B, W)
            "next_position": torch.cat([running["next_position"], new["next_position"]]),
            "logits": torch.cat([running["logits"], new["logits"]]),
        }

    @torch.inference_mode()
    def _keep_rows(self, state: dict, batch: list[_Request], rows: list[int], version: int) -> None:
        """Hands finished rows to the prefix cache: every position the cache holds for them,
        i.e. the prompt and all response tokens but the last (never fed back)."""
        for row in rows:
            request = batch[row]
            ids = request.prompt_ids + request.response_ids[:-1]
            columns = state["mask"][row].nonzero().squeeze(1)
            if len(columns) != len(ids):  # the layout is not what this engine wrote: keep nothing
                log.warning("prefix cache: row holds %d positions for %d tokens; not kept", len(columns), len(ids))
                continue
            layers = prefix_cache.row_of(state["cache"], row, columns)
            if layers is not None:
                self.prefix_cache.keep(ids, layers, version)

    @torch.inference_mode()
    def _decode(self, state: dict, tokens: list[int], keep: list[int], rows: int) -> None:
        if len(keep) < rows:  # drop finished rows so they cost nothing from now on
            index = torch.tensor(keep)
            state["cache"].batch_select_indices(index.to(self.device))
            state["mask"] = state["mask"][index]
            state["next_position"] = state["next_position"][index]
        mask = torch.cat([state["mask"], torch.ones((len(keep), 1), dtype=torch.long)], dim=1)
        positions = state["next_position"].unsqueeze(1)
        out = self.model(
            input_ids=torch.tensor(tokens).unsqueeze(1).to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            cache=state["cache"],
            use_cache=True,
        )
        state.update(mask=mask, next_position=state["next_position"] + 1, logits=out.logits[:, -1])

    def _sample(self, state: dict, batch: list[_Request]) -> list[Picked]:
        """The next token of every row of the batch (see sampling.py)."""
        return sample_rows(state["logits"], batch)

    @torch.inference_mode()
    def _score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        ids = torch.tensor([prompt_ids + response_ids], device=self.device)
        logits = self.model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()  # (R, V)
        logprobs = torch.log_softmax(logits, dim=-1)
        return logprobs.gather(-1, ids[0, len(prompt_ids) :].unsqueeze(-1)).squeeze(-1).tolist()

    @torch.inference_mode()
    def _next_token_logprobs(self, prompt_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt_ids], device=self.device)
        return torch.log_softmax(self.model(input_ids=ids).logits[0, -1].float(), dim=-1).cpu()

    @torch.no_grad()
    def _copy_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        unknown = [name for name in named_tensors if name not in params]
        if unknown:
            raise EngineError(f"update_weights: unknown tensors {unknown[:3]}")
        for i, (name, tensor) in enumerate(named_tensors.items()):
            if i == len(named_tensors) // 2:
                crash_point("swap")
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))
