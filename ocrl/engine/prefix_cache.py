"""The prefix cache: the KV states of recently finished sequences, kept so that a request whose
prompt starts with one of them prefills only the rest.

Agent clients re-send the whole conversation every turn, so turn k+1's prompt begins with turn
k's prompt + response; sessions of one agent also share a long system prompt. The HF engine
hands every finished row to `keep`, and asks `lookup` for the longest kept prefix of each new
prompt (longest common prefix with any entry, so a partial match such as a shared system
prompt counts too).

Contract:
- An entry is token ids + per-layer (keys, values) of shape (H, T, D) for exactly those T
  positions, computed by one weights version. `lookup` only ever answers with entries of the
  version it is asked for, and the engine calls `clear` when it swaps weights, so a cache
  computed by old weights never reaches new ones.
- `lookup` returns views into kept tensors (never written to); `batched` copies them into a
  left-padded batch for the model.
- Memory: the kept tensors' bytes stay <= `max_bytes` and their positions <= `max_tokens`; the
  least recently used entry (kept or hit) goes first; a sequence over the whole budget is not
  kept. An entry that is a prefix of a newly kept sequence is dropped (the new one answers every
  lookup it would); a sequence that is a prefix of a kept entry only refreshes that entry.
- Only plain full-attention layers (transformers' `DynamicLayer`) are kept: sliding-window or
  recurrent states cannot be cut at an arbitrary position, so such models keep nothing.

It knows transformers' `DynamicCache` layout ((B, H, T, D) per layer), never requests,
sampling or HTTP.
"""

from __future__ import annotations

import itertools
import os
import re
from collections import OrderedDict
from dataclasses import dataclass

import torch

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each (H, T, D)

AUTO_SHARE = 16  # "auto": a sixteenth of the device's memory (RAM on CPU)
_BUDGET = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(k|m|g)?\s*(b|ib|tok|toks|token|tokens)?\s*$", re.IGNORECASE)
_SCALE = {None: 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_budget(text: str, device: torch.device | str = "cpu") -> tuple[int, int]:
    """`--prefix-cache` -> (max_bytes, max_tokens); 0 disables. Accepts "auto" (a sixteenth of
    the device's memory), "0"/"off", bytes ("1.5GiB", "512MB", "800000000") or positions
    ("32k tokens", "20000tok")."""
    text = text.strip().lower()
    if text in ("", "0", "off", "none"):
        return 0, 0
    if text == "auto":
        return device_memory(device) // AUTO_SHARE, 1 << 62
    match = _BUDGET.match(text)
    if match is None:
        raise ValueError(f"--prefix-cache {text!r}: expected auto, off, a size like 2GiB or 512MB, or a count like 32k tokens")
    amount = int(float(match.group(1)) * _SCALE[match.group(2) and match.group(2).lower()])
    if (match.group(3) or "b").lower().startswith("tok"):
        return 1 << 62, amount
    return amount, 1 << 62


def device_memory(device: torch.device | str) -> int:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(eq=False)
class _Entry:
    ids: torch.Tensor  # (T,) int64, on CPU
    layers: Layers
    version: int
    nbytes: int


@dataclass
class Hit:
    length: int  # 0: a miss
    layers: Layers  # views (H, length, D) per layer; empty on a miss


MISS = Hit(0, [])


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


class PrefixCache:
    def __init__(self, max_bytes: int = 0, max_tokens: int = 0):
        self.max_bytes = max_bytes
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._keys = itertools.count()
        self.bytes = 0
        self.tokens = 0
        self.lookups = 0
        self.hits = 0
        self.hit_tokens = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and self.max_tokens > 0

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict:
        return {
            "entries": len(self._entries), "tokens": self.tokens, "bytes": self.bytes, "max_bytes": self.max_bytes,
            "lookups": self.lookups, "hits": self.hits, "hit_tokens": self.hit_tokens,
        }  # fmt: skip

    def lookup(self, ids: list[int], version: int, limit: int) -> Hit:
        """The longest kept prefix of `ids` (at most `limit` positions) computed by `version`."""
        if not self._entries or limit <= 0:
            return MISS
        self.lookups += 1
        query = torch.tensor(ids[:limit], dtype=torch.long)
        best, best_length = None, 0
        for key, entry in self._entries.items():
            if entry.version != version:
                continue
            length = _common_prefix(entry.ids, query)
            if length > best_length:
                best, best_length = key, length
        if best is None:
            return MISS
        self._entries.move_to_end(best)
        self.hits += 1
        self.hit_tokens += best_length
        layers = [(k[:, :best_length], v[:, :best_length]) for k, v in self._entries[best].layers]
        return Hit(best_length, layers)

    def keep(self, ids: list[int], layers: Layers, version: int) -> None:
        """Keeps one finished sequence: `layers` hold exactly len(ids) positions (owned copies)."""
        if not self.enabled or not ids:
            return
        nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        if nbytes > self.max_bytes or len(ids) > self.max_tokens:
            return
        new = torch.tensor(ids, dtype=torch.long)
        for key, entry in list(self._entries.items()):
            if entry.version != version:
                self._drop(key)
                continue
            length = _common_prefix(entry.ids, new)
            if length == len(new):  # already kept, as this or a longer sequence
                self._entries.move_to_end(key)
                return
            if length == len(entry.ids):  # the new sequence extends it: it answers all it would
                self._drop(key)
        self._entries[next(self._keys)] = _Entry(new, layers, version, nbytes)
        self.bytes += nbytes
        self.tokens += len(ids)
        while self.bytes > self.max_bytes or self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = self.tokens = 0

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.nbytes
        self.tokens -= len(entry.ids)


def row_of(cache, row: int, columns: torch.Tensor) -> Layers | None:
    """One batch row of a `DynamicCache`, only the given positions, as owned (H, T, D) copies;
    None when the cache holds layers that cannot be cut (sliding windows, recurrent state)."""
    from transformers.cache_utils import DynamicLayer

    layers = []
    for layer in cache.layers:
        if type(layer) is not DynamicLayer or not layer.is_initialized:
            return None
        index = columns.to(layer.keys.device)
        layers.append((layer.keys[row].index_select(1, index), layer.values[row].index_select(1, index)))
    return layers


def batched(hits: list[Hit], width: int):
    """A `DynamicCache` of len(hits) rows and `width` positions, each row's hit right-aligned
    (zeros before it, which the caller's attention mask must hide)."""
    from transformers import DynamicCache

    if len(hits) == 1 and hits[0].length == width:  # the common agent turn: no padding to add
        # DynamicCache copies what it is given (torch.cat), so the kept tensors stay untouched
        return DynamicCache(ddp_cache_data=[(k.unsqueeze(0), v.unsqueeze(0)) for k, v in hits[0].layers])
    template = next(h for h in hits if h.length).layers
    per_layer = []
    for i, (keys, values) in enumerate(template):
        heads, _, dim = keys.shape
        k = keys.new_zeros((len(hits), heads, width, dim))  # (B, H, W, D)
        v = values.new_zeros((len(hits), values.shape[0], width, values.shape[2]))
        for row, hit in enumerate(hits):
            if hit.length:
                k[row, :, width - hit.length :] = hit.layers[i][0]
                v[row, :, width - hit.length :] = hit.layers[i][1]
        per_layer.append((k, v))
    return DynamicCache(ddp_cache_data=per_layer)
