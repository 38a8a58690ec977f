"""The SGLang engine's weight swaps, both paths behind `update_weights` (see sglang.py's
docstring): full weights cast, flattened into per-dtype buckets and sent between a pause and a
continue; or a LoRA adapter per version, the previous one unloaded once its requests finish.

A mixin of `SGLangEngine`: it reads the engine's tokenizer manager (`tm`), dtype, device, pause
mode, LoRA config and swap lock. Knows tensors and SGLang's weight-update requests, never
generation.
"""

from __future__ import annotations

import logging
import time

import anyio

from ocrl.engine.base import EngineError

log = logging.getLogger("ocrl.engine")

BUCKET_BYTES = 1 << 30  # per flattened bucket: bounds the extra GPU memory a swap needs


def _make(cls, **kwargs):
    """An io_struct request with the fields this SGLang version knows (they grew over 0.5.x)."""
    known = getattr(cls, "__struct_fields__", None) or getattr(cls, "__dataclass_fields__", None)
    return cls(**{k: v for k, v in kwargs.items() if known is None or k in known})


def _is_lora(named_tensors: dict) -> bool:
    return bool(named_tensors) and all(".lora_A." in n or ".lora_B." in n for n in named_tensors)


class WeightSwaps:
    """`update_weights` and its two paths, for SGLangEngine."""

    async def update_weights(self, named_tensors: dict, version: int) -> float:
        """Full weights or a LoRA adapter (by the tensors' names); returns the seconds it took."""
        self._check_alive()
        started = time.perf_counter()
        async with self._swap_lock:
            if _is_lora(named_tensors):
                await self._load_adapter(named_tensors, version)
            else:
                await self._swap_full(named_tensors, version)
            self.weights_version = version
        seconds = time.perf_counter() - started
        self.last_swap["seconds"] = seconds
        return seconds

    def _buckets(self, named_tensors: dict) -> list[dict]:
        """Named tensors -> flattened buckets, one dtype each, at most bucket_bytes each (one
        oversized tensor goes alone). On the GPU the flat tensor is shared by CUDA IPC."""
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        by_dtype: dict = {}
        for name, tensor in named_tensors.items():
            tensor = tensor.detach()
            if self.dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(self.dtype)
            if tensor.device != self.device:
                tensor = tensor.to(self.device)
            by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
        buckets = []
        for group in by_dtype.values():
            current, size = [], 0
            for name, tensor in group:
                nbytes = tensor.numel() * tensor.element_size()
                if current and size + nbytes > self.bucket_bytes:
                    buckets.append(current)
                    current, size = [], 0
                current.append((name, tensor))
                size += nbytes
            if current:
                buckets.append(current)
        out = []
        for bucket in buckets:
            flat = FlattenedTensorBucket(named_tensors=bucket)
            out.append({"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()})
        return out

    async def _swap_full(self, named_tensors: dict, version: int) -> None:
        from sglang.srt.managers import io_struct
        from sglang.srt.utils import MultiprocessingSerializer

        buckets = await anyio.to_thread.run_sync(self._buckets, named_tensors)
        flush = self.pause_mode == "retract"
        session = hasattr(self.tm, "begin_weight_update")  # sglang >= 0.5.2x opens a weight-update session
        paused_at = time.perf_counter()
        await self.tm.pause_generation(_make(io_struct.PauseGenerationReqInput, mode=self.pause_mode))
        try:
            if session:
                self._check(await self.tm.begin_weight_update(_make(io_struct.BeginWeightUpdateReqInput), None))
            try:
                for i, bucket in enumerate(buckets):
                    last = i == len(buckets) - 1
                    payload = MultiprocessingSerializer.serialize(bucket)
                    request = _make(
                        io_struct.UpdateWeightsFromTensorReqInput, serialized_named_tensors=[payload] * self.tp_size,
                        load_format="flattened_bucket", flush_cache=flush and last,
                        weight_version=str(version) if last else None,
                    )  # fmt: skip
                    self._check(await self.tm.update_weights_from_tensor(request, None))
            finally:
                if session:
                    self._check(await self.tm.end_weight_update(_make(io_struct.EndWeightUpdateReqInput), None))
        finally:
            await self.tm.continue_generation(_make(io_struct.ContinueGenerationReqInput, torch_empty_cache=False))
            self.last_swap["paused_seconds"] = time.perf_counter() - paused_at

    @staticmethod
    def _check(result) -> None:
        """(success, message) tuples and LoRAUpdateOutput-like objects alike."""
        if isinstance(result, tuple):
            success, message = result[0], result[1] if len(result) > 1 else ""
        else:
            success, message = getattr(result, "success", True), getattr(result, "error_message", None) or getattr(result, "message", "")
        if not success:
            raise EngineError(f"sglang refused the weight update: {message}")

    async def _load_adapter(self, named_tensors: dict, version: int) -> None:
        from sglang.srt.managers import io_struct
        from sglang.srt.utils import MultiprocessingSerializer

        if self.lora_config is None:
            raise EngineError("LoRA tensors sent to an sglang engine started without LoRA (lora_rank 0)")
        name = f"policy-v{version}"
        tensors = {k: v.detach().to(self.dtype) if self.dtype is not None else v.detach() for k, v in named_tensors.items()}
        payload = MultiprocessingSerializer.serialize(tensors)
        request = _make(
            io_struct.LoadLoRAAdapterFromTensorsReqInput, lora_name=name, config_dict=self.lora_config,
            serialized_named_tensors=[payload] * self.tp_size,
        )  # fmt: skip
        self._check(await self.tm.load_lora_adapter_from_tensors(request, None))
        previous, self.adapter = self.adapter, name
        self._adapter_versions[name] = version
        if previous is not None:
            if self._task_group is not None:
                self._task_group.start_soon(self._unload, previous)
            else:
                await self._unload(previous)

    async def _unload(self, name: str) -> None:
        """SGLang unregisters the adapter at once (no new requests) and unloads it when the
        requests using it have finished."""
        from sglang.srt.managers import io_struct

        try:
            self._check(await self.tm.unload_lora_adapter(_make(io_struct.UnloadLoRAAdapterReqInput, lora_name=name), None))
            self._adapter_versions.pop(name, None)
        except Exception:
            log.exception("unloading adapter %s failed", name)
