"""The SGLang adapter on CPU, against a double of the SGLang API it calls; plus engine selection
and --random-init.

The double mirrors sglang 0.5.23 (the version read; file paths below are inside
sgl-project/sglang's python/sglang/):
- module layout: `sglang.Engine`, `sglang.srt.managers.io_struct`, `sglang.srt.utils`
  (`MultiprocessingSerializer`), `sglang.srt.weight_sync.tensor_bucket`
  (`FlattenedTensorBucket`);
- `Engine.tokenizer_manager` and the sync `Engine` methods that call `loop.run_until_complete`
  (srt/entrypoints/engine.py);
- `TokenizerManager.generate_request(obj, request)`: an async generator of dicts
  `{"output_ids", "meta_info"}` (skip_tokenizer_init: no "text"); cumulative chunks whose
  `output_ids` is the live list unless `incremental_streaming_output`; meta_info keys `id`,
  `finish_reason` (None, or {"type": "stop", "matched": ...} / {"type": "length", "length": n}
  / {"type": "abort", "message": ...}), `prompt_tokens`, `completion_tokens`, `cached_tokens`,
  `weight_version`, `output_token_logprobs` [(logprob, token_id, None)],
  `output_top_logprobs`, `input_token_logprobs` from `logprob_start_len` with None first
  (srt/managers/tokenizer_manager.py `_handle_batch_output`, `convert_logprob_style`,
  `detokenize_logprob_tokens`; srt/managers/scheduler_components/logprob_result_processor.py);
- `pause_generation(obj)` / `continue_generation(obj)` (no request argument),
  `begin_weight_update(obj, request)` / `end_weight_update(obj, request)`,
  `update_weights_from_tensor(obj, request) -> (success, message)`,
  `load_lora_adapter_from_tensors(obj, _)` / `unload_lora_adapter(obj, _)` -> LoRAUpdateOutput,
  the unload waiting for the adapter's requests (srt/managers/tokenizer_control_mixin.py);
  `abort_request(rid="", abort_all=False)`, `auto_create_handle_loop()`;
- the flattened bucket payload `{"flattened_tensor", "metadata"}` for
  `load_format="flattened_bucket"` (srt/model_executor/model_runner_components/weight_updater.py).

The double's "model": the next token is (last + shift) % V, where shift is the value of the
weight SHIFT (plus an adapter's lora_B value); every sampled token has log-prob -(0.5 + shift/100)
and teacher-forced scoring gives the same number for a token that follows the rule, -5 otherwise.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import pickle
import re
import sys
import types
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any, Literal, Optional

import anyio
import msgspec
import pytest
import torch

from ocrl.config import Config, ConfigError
from ocrl.engine import select
from ocrl.engine.base import EngineError, Final
from ocrl.types import SamplingParams

torch.set_num_threads(1)

V = 64
SHIFT = "model.layers.0.mlp.down_proj.weight"


# -- the double ------------------------------------------------------------------------------


class GenerateReqInput(msgspec.Struct, kw_only=True):  # io_struct.GenerateReqInput (subset)
    text: Optional[str] = None
    input_ids: Optional[list] = None
    sampling_params: Optional[dict] = None
    return_logprob: Optional[bool] = None
    logprob_start_len: Optional[int] = None
    top_logprobs_num: Optional[int] = None
    token_ids_logprob: Optional[list] = None
    lora_path: Optional[Any] = None
    stream: bool = False
    rid: Optional[str] = None


class PauseGenerationReqInput(msgspec.Struct, kw_only=True):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(msgspec.Struct, kw_only=True):
    torch_empty_cache: bool = True


class BeginWeightUpdateReqInput(msgspec.Struct, kw_only=True):
    selector: Literal["target", "draft", "all"] = "all"


class EndWeightUpdateReqInput(msgspec.Struct, kw_only=True):
    pass


class UpdateWeightsFromTensorReqInput(msgspec.Struct, kw_only=True):
    serialized_named_tensors: list
    load_format: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


class LoadLoRAAdapterFromTensorsReqInput(msgspec.Struct, kw_only=True):
    lora_name: str
    config_dict: dict
    serialized_named_tensors: list
    pinned: bool = False
    lora_id: Optional[str] = None
    load_format: Optional[str] = None


class UnloadLoRAAdapterReqInput(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_id: Optional[str] = None


class LoRAUpdateOutput(msgspec.Struct, kw_only=True):
    success: bool
    error_message: Optional[str] = None
    loaded_adapters: Optional[dict] = None


class FlattenedTensorMetadata(msgspec.Struct):  # tensor_bucket.FlattenedTensorMetadata fields
    name: str
    shape: Any
    dtype: Any
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    """Same constructor forms and accessors as sglang's: named tensors in, one uint8 tensor and
    per-tensor byte ranges out."""

    supports_multi_dtypes = True

    def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None):
        if named_tensors is not None:
            parts, self.metadata, at = [], [], 0
            for name, tensor in named_tensors:
                raw = tensor.flatten().view(torch.uint8)
                self.metadata.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, at, at + raw.numel(), raw.numel()))
                parts.append(raw)
                at += raw.numel()
            self.flattened_tensor = torch.cat(parts)
        else:
            self.flattened_tensor, self.metadata = flattened_tensor, metadata

    def get_flattened_tensor(self):
        return self.flattened_tensor

    def get_metadata(self):
        return self.metadata

    def reconstruct_tensors(self):
        return [(m.name, self.flattened_tensor[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in self.metadata]


class MultiprocessingSerializer:  # srt/utils/common.py: ForkingPickler out, (safe) unpickle in
    @staticmethod
    def serialize(obj, output_str: bool = False):
        buffer = io.BytesIO()
        ForkingPickler(buffer).dump(obj)
        return buffer.getvalue()

    @staticmethod
    def deserialize(data):
        return pickle.loads(data)


class FakeTokenizerManager:
    def __init__(self, incremental: bool, tokens_per_chunk: int = 1):
        self.incremental_streaming_output = incremental
        self.tokens_per_chunk = tokens_per_chunk
        self.weights = {SHIFT: torch.tensor([1.0])}
        self.adapters: dict[str, float] = {}
        self.adapter_users: dict[str, int] = {}
        self.weight_version = "default"
        self.is_pause = False
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.session_open = False
        self.calls: list[tuple] = []
        self.aborted: list[str] = []
        self.handle_loop_started = False
        self.budget = math.inf  # tokens the scheduler may still produce (tests hold it)
        self.structured: list[dict] = []  # the structured-output params each generation got

    def auto_create_handle_loop(self):
        self.handle_loop_started = True

    def abort_request(self, rid: str = "", abort_all: bool = False):
        self.aborted.append(rid)

    def _shift(self, lora_path) -> int:
        return int(self.weights[SHIFT].item() + (self.adapters[lora_path] if lora_path else 0.0))

    async def generate_request(self, obj: GenerateReqInput, request=None):
        if obj.lora_path is not None and obj.lora_path not in self.adapters:
            raise ValueError(f"LoRA adapter {obj.lora_path} not loaded")
        sampling = obj.sampling_params
        ids = list(obj.input_ids)
        # SamplingParams.verify: at most one of regex / json_schema / ebnf, each compilable
        structured = {k: sampling[k] for k in ("regex", "json_schema", "ebnf") if sampling.get(k) is not None}
        if len(structured) > 1:
            raise ValueError("Only one of regex, json_schema, or ebnf can be set.")
        if "json_schema" in structured:
            json.loads(structured["json_schema"])
        if "regex" in structured:
            re.compile(structured["regex"])
        if obj.stream:
            self.structured.append(structured)
        if obj.lora_path:
            self.adapter_users[obj.lora_path] = self.adapter_users.get(obj.lora_path, 0) + 1
        try:
            if not obj.stream:  # a prefill for scoring: input log-probs from logprob_start_len, None first
                shift = self._shift(obj.lora_path)
                start = max(0, obj.logprob_start_len or 0)
                rule = [(-(0.5 + shift / 100) if ids[j] == (ids[j - 1] + shift) % V else -5.0) for j in range(1, len(ids))]
                values = [None] + rule[start:]  # value j belongs to token ids[start + j]
                meta = {"id": obj.rid, "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": len(ids),
                        "weight_version": self.weight_version, "completion_tokens": 1, "cached_tokens": 0,
                        "input_token_logprobs": [(v, t, None) for v, t in zip(values, ids[start:])],
                        "output_token_logprobs": [(-(0.5 + shift / 100), (ids[-1] + shift) % V, None)]}  # fmt: skip
                if obj.top_logprobs_num:
                    nxt = (ids[-1] + shift) % V
                    meta["output_top_logprobs"] = [[(-0.1, nxt, None), (-3.0, (nxt + 1) % V, None)]]
                yield {"output_ids": [(ids[-1] + shift) % V], "meta_info": meta}
                return
            output_ids: list[int] = []
            logprobs: list[tuple] = []
            tops: list = []
            last = ids[-1]
            while True:
                fresh = []
                for _ in range(self.tokens_per_chunk):
                    await self.resumed.wait()  # a paused scheduler runs no forward
                    while self.budget <= 0:
                        await asyncio.sleep(0.001)
                    self.budget -= 1
                    await asyncio.sleep(0)
                    shift = self._shift(obj.lora_path)
                    token = (last + shift) % V
                    last = token
                    output_ids.append(token)
                    logprobs.append((-(0.5 + shift / 100), token, None))
                    tops.append([(-(0.5 + shift / 100), token, None), (-2.0, (token + 1) % V, None)])
                    fresh.append(token)
                    finish = None
                    if token in sampling.get("stop_token_ids", []):
                        finish = {"type": "stop", "matched": token}
                    elif len(output_ids) >= sampling["max_new_tokens"]:
                        finish = {"type": "length", "length": len(output_ids)}
                    if finish:
                        break
                start = len(output_ids) - len(fresh) if self.incremental_streaming_output else 0
                meta = {"id": obj.rid, "finish_reason": finish, "prompt_tokens": len(ids), "weight_version": self.weight_version,
                        "completion_tokens": len(output_ids), "cached_tokens": 0, "output_token_logprobs": logprobs[start:],
                        "output_token_logprobs_length": len(logprobs)}  # fmt: skip
                if obj.top_logprobs_num:
                    meta["output_top_logprobs"] = tops[start:]
                # cumulative intermediate chunks hand out the live list, as SGLang does
                out_ids = output_ids[start:] if self.incremental_streaming_output else (output_ids if finish is None else list(output_ids))
                yield {"output_ids": out_ids, "meta_info": meta}
                if finish:
                    return
        finally:
            if obj.lora_path:
                self.adapter_users[obj.lora_path] -= 1

    async def pause_generation(self, obj: PauseGenerationReqInput):
        self.calls.append(("pause", obj.mode))
        self.is_pause = True
        self.resumed.clear()

    async def continue_generation(self, obj: ContinueGenerationReqInput):
        self.calls.append(("continue",))
        self.is_pause = False
        self.resumed.set()

    async def begin_weight_update(self, obj: BeginWeightUpdateReqInput, request=None):
        self.calls.append(("begin",))
        self.session_open = True
        return True, "Success"

    async def end_weight_update(self, obj: EndWeightUpdateReqInput, request=None):
        self.calls.append(("end",))
        self.session_open = False
        return True, "Success"

    async def update_weights_from_tensor(self, obj: UpdateWeightsFromTensorReqInput, request=None):
        assert isinstance(obj.serialized_named_tensors, list) and all(isinstance(p, bytes) for p in obj.serialized_named_tensors)
        payload = MultiprocessingSerializer.deserialize(obj.serialized_named_tensors[0])
        assert obj.load_format == "flattened_bucket" and set(payload) == {"flattened_tensor", "metadata"}
        bucket = FlattenedTensorBucket(flattened_tensor=payload["flattened_tensor"], metadata=payload["metadata"])
        named = bucket.reconstruct_tensors()
        self.calls.append(("update", tuple(n for n, _ in named), {t.dtype for _, t in named}, obj.flush_cache,
                           obj.weight_version, self.is_pause, self.session_open))  # fmt: skip
        if not self.session_open:  # 0.5.23's scheduler refuses updates outside a session
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        for name, tensor in named:
            if name == SHIFT:
                self.weights[SHIFT] = tensor.clone().float()
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version
        return True, "Success"

    async def load_lora_adapter_from_tensors(self, obj: LoadLoRAAdapterFromTensorsReqInput, _=None):
        tensors = MultiprocessingSerializer.deserialize(obj.serialized_named_tensors[0])
        b = [t for n, t in tensors.items() if ".lora_B." in n]
        self.adapters[obj.lora_name] = float(b[0].flatten()[0]) if b else 0.0
        self.calls.append(("load_lora", obj.lora_name, obj.config_dict["r"]))
        return LoRAUpdateOutput(success=True, loaded_adapters=dict.fromkeys(self.adapters, "__tensor__"))

    async def unload_lora_adapter(self, obj: UnloadLoRAAdapterReqInput, _=None):
        self.calls.append(("unregister", obj.lora_name))
        while self.adapter_users.get(obj.lora_name, 0) > 0:  # lora_registry.wait_for_unload
            await asyncio.sleep(0.001)
        del self.adapters[obj.lora_name]
        self.calls.append(("unloaded", obj.lora_name))
        return LoRAUpdateOutput(success=True)


class FakeEngine:
    """sglang.Engine: the tokenizer manager, and sync methods that run_until_complete."""

    def __init__(self, tokenizer_manager):
        self.tokenizer_manager = tokenizer_manager
        self.loop = asyncio.new_event_loop()
        self.shut_down = False

    def flush_cache(self):
        return self.loop.run_until_complete(asyncio.sleep(0, result=True))

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        return self.loop.run_until_complete(asyncio.sleep(0, result=(True, "Success")))

    def shutdown(self):
        self.shut_down = True


@pytest.fixture
def fake_sglang(monkeypatch):
    """Installs the double as the `sglang` package (and the submodules the adapter imports)."""
    modules = {name: types.ModuleType(name) for name in (
        "sglang", "sglang.srt", "sglang.srt.managers", "sglang.srt.managers.io_struct", "sglang.srt.utils",
        "sglang.srt.weight_sync", "sglang.srt.weight_sync.tensor_bucket",
    )}  # fmt: skip
    io_struct = modules["sglang.srt.managers.io_struct"]
    for cls in (GenerateReqInput, PauseGenerationReqInput, ContinueGenerationReqInput, BeginWeightUpdateReqInput,
                EndWeightUpdateReqInput, UpdateWeightsFromTensorReqInput, LoadLoRAAdapterFromTensorsReqInput,
                UnloadLoRAAdapterReqInput, LoRAUpdateOutput):  # fmt: skip
        setattr(io_struct, cls.__name__, cls)
    modules["sglang.srt.managers"].io_struct = io_struct
    modules["sglang.srt.utils"].MultiprocessingSerializer = MultiprocessingSerializer
    modules["sglang.srt.weight_sync.tensor_bucket"].FlattenedTensorBucket = FlattenedTensorBucket
    modules["sglang"].Engine = FakeEngine
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return modules


class LetterTokenizer:
    """id i -> letter chr(97 + i % 26); id 0 is the end of text."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 26) for i in ids if not (skip_special_tokens and i == 0))


def make_engine(incremental=True, tokens_per_chunk=1, lora=False, **kwargs):
    from ocrl.engine.sglang import SGLangEngine

    tm = FakeTokenizerManager(incremental, tokens_per_chunk)
    lora_config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "peft_type": "LORA"} if lora else None
    engine = SGLangEngine(
        FakeEngine(tm), tokenizer=LetterTokenizer(), name="fake", max_context=128, eos_ids={0}, vocab_size=V,
        dtype=torch.bfloat16, incremental=incremental, lora_config=lora_config, device="cpu", **kwargs,
    )  # fmt: skip
    return engine, tm


# -- generation ------------------------------------------------------------------------------


@pytest.mark.parametrize("incremental", [True, False])
async def test_streaming_deltas_and_logprobs_from_both_chunk_styles(fake_sglang, incremental):
    engine, _ = make_engine(incremental=incremental)
    chunks = [c async for c in engine.stream([1, 5], SamplingParams(max_tokens=6, temperature=0))]
    # shift 1 from token 5: 6, 7, 8, 9, 10, 11 -> "ghijkl"; one token per chunk, none repeated
    assert [c.token_ids for c in chunks] == [[6], [7], [8], [9], [10], [11]]
    assert "".join(c.text for c in chunks) == "ghijkl"
    assert all(c.logprobs == [pytest.approx(-0.51)] for c in chunks)
    assert isinstance(chunks[-1], Final) and chunks[-1].finish_reason == "length"
    assert engine.generated_tokens == 6 and engine.active == 0 and engine.queue_depth == 0


async def test_top_logprobs_come_from_output_top_logprobs(fake_sglang):
    engine, _ = make_engine()
    completion = await engine.generate([1, 5], SamplingParams(max_tokens=2, temperature=0, top_logprobs=2))
    assert [[(t.token_id, t.logprob) for t in row] for row in completion.top_logprobs] == [
        [(6, pytest.approx(-0.51)), (7, -2.0)], [(7, pytest.approx(-0.51)), (8, -2.0)],
    ]


async def test_grammars_go_to_sglang_as_its_own_structured_output_params(fake_sglang):
    from ocrl import grammar

    engine, tm = make_engine()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    as_schema = grammar.from_request({"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}, None, None)
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    as_regex = grammar.from_request(None, [tool], "required")
    await engine.prepare(as_schema)  # SGLang compiles its own grammars: nothing to refuse here
    for g in (as_schema, as_regex, None):
        await engine.generate([1, 5], SamplingParams(max_tokens=2, temperature=0, grammar=g))
    # a JSON schema is enforced by SGLang as that schema, a forced tool call as its regex
    assert tm.structured == [{"json_schema": as_schema.json_schema}, {"regex": as_regex.regex}, {}]
    assert json.loads(tm.structured[0]["json_schema"]) == schema


class HalfEuroTokenizer(LetterTokenizer):
    """Letters, except that id 7 holds the first two bytes of "€" and id 8 the last one."""

    def decode(self, ids, skip_special_tokens=False):
        pieces = {7: b"\xe2\x82", 8: b"\xac"}
        raw = b"".join(pieces.get(i, chr(97 + i % 26).encode()) for i in ids if not (skip_special_tokens and i == 0))
        return raw.decode("utf-8", errors="replace")


@pytest.mark.parametrize("incremental", [True, False])
async def test_a_character_cut_by_the_token_limit_is_not_emitted(fake_sglang, incremental):
    engine, _ = make_engine(incremental=incremental)
    engine.tokenizer = HalfEuroTokenizer()
    cut = [c async for c in engine.stream([1, 5], SamplingParams(max_tokens=2, temperature=0))]  # ids 6, 7
    assert [i for c in cut for i in c.token_ids] == [6, 7]
    assert "".join(c.text for c in cut) == "g"
    whole = await engine.generate([1, 5], SamplingParams(max_tokens=3, temperature=0))  # ids 6, 7, 8
    assert whole.text == "g€"


async def test_eos_maps_to_stop_and_length_to_length(fake_sglang):
    engine, tm = make_engine()
    tm.weights[SHIFT] = torch.tensor([2.0])
    # from 60 by 2: 62, then 0 = eos -> SGLang's {"type": "stop", "matched": 0} is OpenAI's "stop"
    stopped = await engine.generate([60], SamplingParams(max_tokens=10, temperature=0))
    assert stopped.response_ids == [62, 0] and stopped.finish_reason == "stop"
    long = await engine.generate([1], SamplingParams(max_tokens=3, temperature=0))
    assert long.response_ids == [3, 5, 7] and long.finish_reason == "length"


async def test_abort_finish_reason_is_an_engine_error(fake_sglang):
    from ocrl.engine.sglang import _finish_reason

    assert _finish_reason(None) is None and _finish_reason({"type": "length", "length": 3}) == "length"
    with pytest.raises(EngineError, match="out of memory"):
        _finish_reason({"type": "abort", "message": "out of memory", "status_code": 500})


@pytest.mark.parametrize("tokens_per_chunk", [1, 3])
async def test_stop_string_ends_the_completion_and_aborts_the_request(fake_sglang, tokens_per_chunk):
    engine, tm = make_engine(tokens_per_chunk=tokens_per_chunk)
    # from 1: tokens 2 3 4 5 ... = "c d e f ..."; stop "de": text "c", tokens kept through the
    # one that completed it (4 = "e"); with 3 tokens a chunk, the 5 after it is dropped
    completion = await engine.generate([1], SamplingParams(max_tokens=20, temperature=0, stop=("de",)))
    assert completion.text == "c"
    assert completion.response_ids == [2, 3, 4]
    assert len(completion.logprobs) == 3 and completion.finish_reason == "stop"
    assert len(tm.aborted) == 1  # the request stops generating in SGLang too


async def test_partial_stop_is_held_back_until_it_cannot_match(fake_sglang):
    engine, _ = make_engine()
    chunks = [c async for c in engine.stream([1], SamplingParams(max_tokens=4, temperature=0, stop=("cx",)))]
    # "c" could start "cx": held; "d" releases "cd"; then "e", "f"
    assert [c.text for c in chunks] == ["", "cd", "e", "f"]


async def test_prompt_at_the_context_limit_finishes_with_length_without_calling_sglang(fake_sglang):
    engine, tm = make_engine()
    completion = await engine.generate(list(range(1, 129)), SamplingParams(max_tokens=5))
    assert completion.response_ids == [] and completion.finish_reason == "length"


async def test_score_aligns_input_logprobs_with_response_tokens(fake_sglang):
    engine, _ = make_engine()
    completion = await engine.generate([1, 5], SamplingParams(max_tokens=4, temperature=0))
    scored = await engine.score([1, 5], completion.response_ids)
    torch.testing.assert_close(torch.tensor(scored), torch.tensor(completion.logprobs))
    # a response that breaks the rule scores -5 where it breaks
    assert await engine.score([1, 5], [6, 9]) == [pytest.approx(-0.51), -5.0]


async def test_next_token_logprobs_is_a_full_row(fake_sglang):
    engine, _ = make_engine()
    row = await engine.next_token_logprobs([1, 5])
    assert row.shape == (V,) and int(row.argmax()) == 6
    assert row[6] == pytest.approx(-0.1) and row[7] == pytest.approx(-3.0)
    torch.testing.assert_close(row.exp().sum(), torch.tensor(1.0))  # the rest share what is left


# -- full-weight swaps -----------------------------------------------------------------------


async def test_full_swap_is_bucketed_per_dtype_between_pause_and_continue(fake_sglang):
    engine, tm = make_engine(bucket_bytes=16)
    before = await engine.generate([1], SamplingParams(max_tokens=2, temperature=0))
    tensors = {SHIFT: torch.tensor([3.0]), "a.weight": torch.zeros(4), "b.weight": torch.zeros(4),
               "ids.buffer": torch.zeros(2, dtype=torch.int64)}  # fmt: skip
    seconds = await engine.update_weights(tensors, version=7)
    kinds = [c[0] for c in tm.calls]
    assert kinds == ["pause", "begin", "update", "update", "update", "end", "continue"]
    assert tm.calls[0] == ("pause", "retract")
    updates = [c for c in tm.calls if c[0] == "update"]
    # fp32 -> the served bf16 (2 bytes each): SHIFT + a (10 bytes) fit 16, b starts the next; int64 alone
    assert [u[1] for u in updates] == [(SHIFT, "a.weight"), ("b.weight",), ("ids.buffer",)]
    assert [u[2] for u in updates] == [{torch.bfloat16}, {torch.bfloat16}, {torch.int64}]
    assert [u[3] for u in updates] == [False, False, True]  # flush once, after the last bucket
    assert [u[4] for u in updates] == [None, None, "7"]
    assert all(u[5] and u[6] for u in updates)  # paused, inside a weight-update session
    after = await engine.generate([1], SamplingParams(max_tokens=2, temperature=0))
    assert before.response_ids == [2, 3] and after.response_ids == [4, 7]  # shift 3 serves now
    assert after.weights_version == engine.weights_version == 7 and seconds >= 0
    assert engine.last_swap["paused_seconds"] <= engine.last_swap["seconds"]


async def test_in_place_pause_does_not_flush(fake_sglang):
    engine, tm = make_engine(pause_mode="in_place")
    await engine.update_weights({SHIFT: torch.tensor([2.0])}, version=1)
    assert tm.calls[0] == ("pause", "in_place") and [c[3] for c in tm.calls if c[0] == "update"] == [False]


async def test_a_refused_update_still_continues_generation(fake_sglang):
    engine, tm = make_engine()

    async def refuse(obj, request=None):
        return False, "boom"

    tm.update_weights_from_tensor = refuse
    with pytest.raises(EngineError, match="boom"):
        await engine.update_weights({SHIFT: torch.tensor([2.0])}, version=1)
    assert [c[0] for c in tm.calls] == ["pause", "begin", "end", "continue"] and not tm.is_pause
    assert engine.weights_version == 0


async def test_swap_during_a_stream_reports_the_newer_version_and_counts_it(fake_sglang):
    engine, tm = make_engine()
    tm.budget = 2
    received = []

    async def consume():
        async for chunk in engine.stream([1], SamplingParams(max_tokens=4, temperature=0)):
            received.append(chunk)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        while len(received) < 2:
            await asyncio.sleep(0.001)
        await engine.update_weights({SHIFT: torch.tensor([2.0])}, version=1)
        tm.budget = math.inf
    assert [c.token_ids[0] for c in received] == [2, 3, 5, 7]  # two tokens of each version
    assert received[-1].weights_version == 1 and engine.mixed_completions == 1


# -- LoRA swaps ------------------------------------------------------------------------------


def adapter(value: float) -> dict:
    return {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 4),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.full((4, 8), value)}  # fmt: skip


async def test_lora_versions_are_new_adapters_and_the_old_unloads_after_its_requests(fake_sglang):
    engine, tm = make_engine(lora=True)
    await engine.update_weights(adapter(1.0), version=1)
    assert engine.adapter == "policy-v1" and tm.calls == [("load_lora", "policy-v1", 8)]
    tm.budget = 1
    old_chunks = []

    async def old_request():
        async for chunk in engine.stream([1], SamplingParams(max_tokens=3, temperature=0)):
            old_chunks.append(chunk)

    async with anyio.create_task_group() as tg:
        tg.start_soon(old_request)
        while not old_chunks:  # the old request is in flight on policy-v1
            await asyncio.sleep(0.001)
        tg.start_soon(engine.update_weights, adapter(2.0), 2)
        while engine.adapter != "policy-v2":
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)
        # new requests get v2 at once; v1 is unregistered but not unloaded while its request runs
        assert [c[0] for c in tm.calls] == ["load_lora", "load_lora", "unregister"]
        tm.budget = math.inf
    assert [c[0] for c in tm.calls] == ["load_lora", "load_lora", "unregister", "unloaded"]
    assert [c.token_ids[0] for c in old_chunks] == [3, 5, 7]  # shift 1 + 1 throughout: one version
    assert old_chunks[-1].weights_version == 1
    new = await engine.generate([1], SamplingParams(max_tokens=2, temperature=0))
    assert new.response_ids == [4, 7] and new.weights_version == 2
    assert "policy-v1" not in tm.adapters and engine.adapter == "policy-v2"


async def test_the_base_view_serves_without_the_adapter(fake_sglang):
    engine, _ = make_engine(lora=True)
    await engine.update_weights(adapter(4.0), version=1)
    policy = await engine.generate([1], SamplingParams(max_tokens=1, temperature=0))
    base = await engine.base().generate([1], SamplingParams(max_tokens=1, temperature=0))
    assert policy.response_ids == [6] and base.response_ids == [2] and base.weights_version == 0
    assert await engine.base().score([1], [2]) == [pytest.approx(-0.51)]


async def test_lora_tensors_need_an_engine_started_with_lora(fake_sglang):
    engine, _ = make_engine(lora=False)
    with pytest.raises(EngineError, match="without LoRA"):
        await engine.update_weights(adapter(1.0), version=1)


# -- the event loop, signals, shutdown -------------------------------------------------------


async def test_sync_sglang_methods_refuse_to_run_inside_the_loop(fake_sglang):
    engine, _ = make_engine()
    with pytest.raises(EngineError, match="tokenizer_manager.update_weights_from_tensor"):
        engine.inner.update_weights_from_tensor([])
    with pytest.raises(EngineError, match="run_until_complete"):
        engine.inner.flush_cache()


def test_sync_sglang_methods_still_work_outside_a_loop(fake_sglang):
    engine, _ = make_engine()
    assert engine.inner.flush_cache() is True


async def test_adopt_signals_starts_the_handle_loop_and_routes_sigquit(fake_sglang, monkeypatch):
    import signal

    from ocrl.engine import sglang_process

    engine, tm = make_engine()
    health = sglang_process.Health()
    health.child_failed()  # during the launch: only logged (sglang.Engine() raises by itself)
    killed = []
    monkeypatch.setattr(sglang_process.os, "kill", lambda pid, signum: killed.append(signum))
    engine.adopt_signals(health)
    try:
        assert tm.handle_loop_started
        health.child_failed()
        assert killed == [signal.SIGTERM] and "failed" in engine.failed
        with pytest.raises(EngineError, match="failed"):
            await engine.generate([1], SamplingParams(max_tokens=1))
    finally:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGQUIT)


async def test_run_shuts_sglang_down_when_cancelled(fake_sglang):
    engine, _ = make_engine()
    inner = engine.inner
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        await asyncio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert inner.shut_down and engine.inner is None


async def test_start_launches_sglang_with_the_config_and_takes_its_signals(fake_sglang, monkeypatch):
    import signal

    from ocrl.engine.sglang import SGLangEngine

    launched = {}

    def engine_from(**kwargs):
        launched.update(kwargs)
        return FakeEngine(FakeTokenizerManager(True))

    monkeypatch.setattr(fake_sglang["sglang"], "Engine", engine_from)
    model_config = SimpleNamespace(eos_token_id=[2, 3], max_position_embeddings=4096, vocab_size=V)
    model = SimpleNamespace(config=model_config, parameters=lambda: iter([torch.zeros(1, dtype=torch.bfloat16)]))
    loaded = SimpleNamespace(model=model, path="/models/m", name="m", tokenizer=SimpleNamespace(eos_token_id=0))
    config = Config(context_length=1024, lora_alpha=32)
    engine = await SGLangEngine.start(loaded, config, lora_rank=8)
    try:
        # token ids only, the served dtype, the context asked for, LoRA up to the rank asked for
        assert launched["skip_tokenizer_init"] and launched["dtype"] == "bfloat16" and launched["context_length"] == 1024
        assert launched["enable_lora"] and launched["max_lora_rank"] == 8
        assert engine.accepts_adapters and engine.lora_config["r"] == 8 and engine.lora_config["lora_alpha"] == 32
        assert engine.eos_ids == [0, 2, 3] and engine.max_context == 1024 and engine.dtype == torch.bfloat16
        assert engine.tm.handle_loop_started
        with pytest.raises(EngineError, match="run_until_complete"):
            engine.inner.flush_cache()  # the sync conveniences are guarded on the launched instance
    finally:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGQUIT)


# -- selection -------------------------------------------------------------------------------


def test_resolve_picks_sglang_only_with_cuda_and_sglang():
    ok, missing = (lambda: None), (lambda: "ImportError: No module named 'sglang'")
    assert select.resolve(Config(engine="auto"), "cuda", sglang_check=ok) == "sglang"
    assert select.resolve(Config(engine="auto"), "cuda", sglang_check=missing) == "hf"
    assert select.resolve(Config(engine="auto"), "cpu", sglang_check=ok) == "hf"
    assert select.resolve(Config(engine="hf"), "cuda", sglang_check=ok) == "hf"
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        select.resolve(Config(engine="sglang"), "cpu", sglang_check=ok)
    with pytest.raises(ConfigError, match="gpu extra"):
        select.resolve(Config(engine="sglang"), "cuda", sglang_check=missing)


def test_resolve_never_imports_sglang_for_a_cpu_model():
    def boom():
        raise AssertionError("sglang imported for a CPU model")

    assert select.resolve(Config(engine="auto"), "cpu", sglang_check=boom) == "hf"


# -- random init -----------------------------------------------------------------------------


def test_random_init_configs_have_the_published_sizes():
    from ocrl import random_init

    # parameters of Qwen3-4B (tied embeddings) and Qwen3-8B, from the shapes alone
    def count(name):
        c = random_init.config_for(name)
        attn = c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) + 2 * c.head_dim
        mlp = 3 * c.hidden_size * c.intermediate_size
        layer = attn + mlp + 2 * c.hidden_size
        embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
        return c.num_hidden_layers * layer + embed + c.hidden_size

    assert 4.0e9 < count("qwen3-4b") < 4.1e9
    assert 8.1e9 < count("qwen3-8b") < 8.3e9
    assert 1.7e9 < count("qwen3-1.7b") < 2.1e9


def test_random_init_unknown_name_is_a_model_error():
    from ocrl import models

    with pytest.raises(models.ModelError, match="qwen3-4b"):
        models.load(random_init="qwen9-1t", device="cpu")


async def test_random_init_tiny_generates_through_the_hf_engine(tmp_path, monkeypatch):
    from ocrl import chat, models
    from ocrl.engine.hf import HFEngine
    from ocrl.types import Message

    monkeypatch.setenv("OCRL_CACHE", str(tmp_path))
    loaded = models.load(random_init="tiny", device="cpu")
    assert loaded.name == "random-tiny" and loaded.model.config.vocab_size == 512
    assert (tmp_path / "random-init" / "tiny" / "config.json").exists()  # what SGLang would start from
    ids = chat.prompt_ids(loaded.tokenizer, [Message(role="user", content="héllo")])
    assert max(ids) < loaded.model.config.vocab_size
    assert loaded.tokenizer.decode(ids, skip_special_tokens=True).count("héllo") == 1
    engine = HFEngine(loaded, max_batch_size=2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        completion = await engine.generate(ids, SamplingParams(max_tokens=8, temperature=1.0, seed=0))
        scored = await engine.score(ids, completion.response_ids)
        tg.cancel_scope.cancel()
    assert 0 < len(completion.response_ids) <= 8
    torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(scored), atol=1e-4, rtol=0)


async def test_a_consumer_that_leaves_aborts_its_request(fake_sglang):
    engine, tm = make_engine()
    stream = engine.stream([1], SamplingParams(max_tokens=50, temperature=0))
    async for _ in stream:
        break
    await stream.aclose()
    assert len(tm.aborted) == 1 and engine.active == 0 and engine.queue_depth == 0


# -- --weight-sync lora ----------------------------------------------------------------------


def test_weight_sync_lora_needs_sglang_and_lora_training():
    assert select.adapter_rank(Config(), "sglang") == 0  # full weights by default
    assert select.adapter_rank(Config(weight_sync="lora", lora_rank=8), "sglang") == 8
    with pytest.raises(ConfigError, match="needs the sglang engine"):
        select.adapter_rank(Config(weight_sync="lora"), "hf")
    for bad in (Config(weight_sync="lora", lora_rank=0), Config(weight_sync="lora", full_finetune=True)):
        with pytest.raises(ConfigError, match="needs LoRA training"):
            select.adapter_rank(bad, "sglang")


async def test_build_engine_starts_sglang_with_adapters_only_for_lora_sync(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(select, "resolve", lambda config, device_type: "sglang")
    started = []

    async def start(loaded, config, *, lora_rank):
        started.append(lora_rank)
        return SimpleNamespace()

    loaded = SimpleNamespace(model=torch.nn.Linear(2, 2))
    await select.build_engine(Config(lora_rank=8), loaded, start_sglang=start)
    await select.build_engine(Config(lora_rank=8, weight_sync="lora"), loaded, start_sglang=start)
    assert started == [0, 8]


async def test_the_trainer_publishes_its_adapter_to_an_engine_that_accepts_adapters(fake_sglang):
    """--weight-sync lora: the trainer sends peft's adapter tensors (not merged weights); the
    engine loads them as the next version's adapter and the base view stays the base."""
    from peft import get_peft_model_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    from ocrl.train.policy import ADAPTER
    from ocrl.train.trainer import Trainer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2, intermediate_size=32)).eval()  # fmt: skip
    engine, tm = make_engine(lora=True)
    assert engine.accepts_adapters and not make_engine(lora=False)[0].accepts_adapters
    trainer = Trainer(Config(lora_rank=4, lora_alpha=8, save_interval=0), model, engine=engine, yield_to=None)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.25)  # a trained adapter: B is no longer zero
    published = trainer.published_weights()
    expected = get_peft_model_state_dict(trainer.model, adapter_name=ADAPTER)
    assert published.keys() == expected.keys() and all(".lora_A." in n or ".lora_B." in n for n in published)
    assert all(torch.equal(published[n], expected[n]) for n in expected)
    await engine.update_weights(published, version=1)
    assert engine.adapter == "policy-v1" and tm.adapters["policy-v1"] == pytest.approx(0.25)
    assert tm.calls[-1] == ("load_lora", "policy-v1", 8)
