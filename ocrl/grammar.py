"""Constrained decoding: OpenAI's `response_format` and forced `tool_choice` as a regular
language over the completion text, and the token masks that keep the transformers engine's
sampling inside it.

`from_request` turns the request's fields into a `Grammar` (types.py) or refuses them with a
`GrammarError` naming the construct it cannot enforce (the API answers 400 before anything is
recorded); JSON schemas become regexes in schema_regex.py. `Grammars` compiles a grammar against one tokenizer's vocabulary (outlines-core's
regex -> token automaton, cached) and hands out a `Matcher` per request: the ids allowed next,
advanced by each sampled id. This module knows nothing of HTTP, sessions or how the engine
batches; SGLang enforces the same `Grammar` with its own sampling parameters (engine/sglang.py).

Forced tool calls use the convention chat.py parses: `<tool_call>{"name": ..., "arguments":
...}</tool_call>`, one call, the arguments constrained by the tool's parameter schema.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import OrderedDict
from typing import Any

import torch

from ocrl.schema_regex import WS, SchemaError, json_object_regex, schema_regex
from ocrl.types import Grammar

_MAX_CACHED = 16  # compiled grammars kept per engine
_MASK_BYTES = 4 << 20  # per grammar: ~85 states' masks at a 49k vocabulary


class GrammarError(ValueError):
    """The request asks for a constraint ocrl cannot enforce (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _schema_regex(schema: Any, where: str) -> str:
    try:
        return schema_regex(schema, where)
    except SchemaError as e:
        raise GrammarError(str(e)) from None


def _tool_call_regex(function: dict, where: str) -> str:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    arguments = _schema_regex(parameters, f"{where}.parameters")
    name = re.escape(json.dumps(function["name"]))
    call = rf'\{{{WS}"name"{WS}:{WS}{name}{WS},{WS}"arguments"{WS}:{WS}(?:{arguments}){WS}\}}'
    return rf"<tool_call>\n?{call}\n?</tool_call>"


def _functions(tools: list[dict] | None) -> list[dict]:
    functions = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise GrammarError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", param=f"tools[{i}]")
        functions.append(function)
    return functions


def from_request(response_format: dict | None, tools: list[dict] | None, tool_choice: str | dict | None) -> Grammar | None:
    """The constraint a chat request asks for, or None. A forced tool choice wins over
    `response_format` (the reply is then a tool call, as with OpenAI)."""
    forced = tool_choice if isinstance(tool_choice, dict) else (tool_choice if tool_choice == "required" else None)
    if tool_choice is not None and not isinstance(tool_choice, dict) and tool_choice not in ("none", "auto", "required"):
        raise GrammarError(f"tool_choice must be 'none', 'auto', 'required' or a named function, not {tool_choice!r}", "tool_choice")
    if forced is not None:
        functions = _functions(tools)
        if not functions:
            raise GrammarError("tool_choice forces a tool call but no `tools` are given", "tool_choice")
        if isinstance(forced, dict):
            wanted = (forced.get("function") or {}).get("name") if forced.get("type", "function") == "function" else None
            chosen = [f for f in functions if f["name"] == wanted]
            if not chosen:
                raise GrammarError(f"tool_choice names function {wanted!r}, which is not among `tools`", "tool_choice")
            functions, source = chosen, f"tool_choice:{wanted}"
        else:
            source = "tool_choice:required"
        where = {id(f): i for i, f in enumerate(_functions(tools))}
        blocks = [_tool_call_regex(f, f"tools[{where.get(id(f), 0)}].function") for f in functions]
        return Grammar(regex="|".join(f"(?:{b})" for b in blocks), source=source)
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind in (None, "text"):
        if kind is None:
            raise GrammarError("response_format needs a `type`", "response_format.type")
        return None
    if kind == "json_object":
        return Grammar(regex=json_object_regex(), source="json_object", json_schema=json.dumps({"type": "object"}))
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise GrammarError("response_format.json_schema needs a `schema` object", "response_format.json_schema.schema")
        try:
            regex = _schema_regex(schema, "$")
        except GrammarError as e:
            raise GrammarError(f"response_format: {e}", "response_format.json_schema.schema") from None
        return Grammar(regex=regex, source="json_schema", json_schema=json.dumps(schema))
    raise GrammarError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)", "response_format.type")


# -- the token side (transformers engine) -----------------------------------------------------


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: each byte is written as one printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def token_bytes(tokenizer) -> dict[int, bytes]:
    """The bytes each (non-special) token id stands for: byte-level BPE pieces through GPT-2's
    table, SentencePiece pieces with ▁ as a space and <0xNN> as that byte, anything else (a
    tokenizer without a vocabulary, like the tests' letter tokenizer) by decoding it alone."""
    special = set(getattr(tokenizer, "all_special_ids", None) or [getattr(tokenizer, "eos_token_id", None)])
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else None
    if vocab is None:
        size = getattr(tokenizer, "vocab_size", None) or 0
        return {i: tokenizer.decode([i]).encode() for i in range(size) if i not in special}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
    byte_level = '"ByteLevel"' in json.dumps(decoder)
    table = _byte_level_table() if byte_level else None
    added = {i for i in getattr(tokenizer, "added_tokens_decoder", {}) or {}}
    out = {}
    for piece, i in vocab.items():
        if i in special:
            continue
        if table is not None and i not in added and all(c in table for c in piece):
            out[i] = bytes(table[c] for c in piece)
        elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            out[i] = bytes([int(piece[3:5], 16)])
        else:
            out[i] = piece.replace("▁", " ").encode()
    return out


class Compiled:
    """One grammar's token automaton, with the allowed-id mask of each state cached (JSON
    strings revisit the same few states at every step) up to 4 MiB of masks per grammar; past
    that, masks of new states are built at each step instead of kept."""

    def __init__(self, index, eos_ids: list[int]):
        self.index = index
        self.eos_ids = eos_ids
        self._masks: dict[tuple[int, int, str], torch.Tensor] = {}
        self._kept_bytes = 0

    def allowed_mask(self, state: int, vocab_size: int, device) -> torch.Tensor:
        """(V,) bool: which ids may come next from `state`."""
        key = (state, vocab_size, str(device))
        mask = self._masks.get(key)
        if mask is None:
            allowed = self.index.get_allowed_tokens(state) or []
            # the automaton knows one end-of-text id (the first); every end id of the model ends it
            if self.eos_ids[0] in allowed:
                allowed = allowed + self.eos_ids
            ids = torch.tensor([i for i in allowed if i < vocab_size], dtype=torch.long)  # ids past the head never come
            mask = torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, ids, True).to(device)
            if self._kept_bytes + vocab_size <= _MASK_BYTES:
                self._masks[key] = mask
                self._kept_bytes += vocab_size
        return mask


class Matcher:
    """One request's place in its grammar: which ids may come next; `advance` with each id."""

    def __init__(self, compiled: Compiled):
        self.compiled = compiled
        self.state = compiled.index.get_initial_state()

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """(V,) logits with every id the grammar forbids next at -inf."""
        allowed = self.compiled.allowed_mask(self.state, logits.shape[-1], logits.device)
        return logits.masked_fill(~allowed, -math.inf)

    def advance(self, token: int) -> None:
        if token in self.compiled.eos_ids:
            return
        following = self.compiled.index.get_next_state(self.state, token)
        if following is None:
            raise GrammarError(f"token {token} is outside the grammar")
        self.state = following


class Grammars:
    """Compiles grammars against one tokenizer, least recently used dropped past 16. The
    vocabulary is built on first use (a third of a second for 49k tokens)."""

    def __init__(self, tokenizer, eos_ids: set[int]):
        self.tokenizer = tokenizer
        self.eos_ids = sorted(eos_ids)
        self._vocabulary = None
        self._cache: OrderedDict[str, Compiled] = OrderedDict()
        self._lock = threading.Lock()

    def _vocab(self):
        if self._vocabulary is None:
            from outlines_core import Vocabulary

            pieces: dict[bytes, list[int]] = {}
            for i, piece in token_bytes(self.tokenizer).items():
                if i not in self.eos_ids and piece:
                    pieces.setdefault(piece, []).append(i)
            self._vocabulary = Vocabulary(self.eos_ids[0], pieces)
        return self._vocabulary

    def compile(self, grammar: Grammar) -> Compiled:
        """Blocking (up to seconds for a new grammar): call it from a worker thread."""
        with self._lock:  # worker threads compile side by side; the cache is shared
            compiled = self._cache.get(grammar.regex)
            if compiled is not None:
                self._cache.move_to_end(grammar.regex)
                return compiled
            vocabulary = self._vocab()
        from outlines_core import Index

        try:
            index = Index(grammar.regex, vocabulary)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{grammar.source}: cannot build a token automaton: {str(e)[:300]}") from None
        compiled = Compiled(index, self.eos_ids)
        with self._lock:
            self._cache[grammar.regex] = compiled
            while len(self._cache) > _MAX_CACHED:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, grammar: Grammar) -> Matcher:
        return Matcher(self.compile(grammar))
