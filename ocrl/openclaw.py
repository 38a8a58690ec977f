"""`python -m ocrl openclaw-config`: the provider block for OpenClaw's `openclaw.json` that matches
this daemon's flags (base URL, key, model id, context window, max tokens), and with `--lean` the
agent settings that fit a small context (no workspace bootstrap injection, no skills, the minimal
tool profile without Tool Search).

Why lean: OpenClaw's default agent sends a ~9.9k-token system prompt and ~2.7k tokens of tool
schemas; the embedded model's context is 8,192 tokens. The lean agent's first request is ~2.7k
tokens (measured with OpenClaw 2026.9.6), leaving room for a conversation before compaction.

This module reads the configuration and the model's config file; it loads no weights and knows
nothing of serving.
"""

from __future__ import annotations

import json
from pathlib import Path

PROVIDER = "ocrl"
LOCAL_KEY = "ocrl-local"  # a non-secret marker OpenClaw accepts for a loopback provider
LEAN_MAX_TOKENS = 256  # a CPU model writes ~10-20 tokens/s: longer replies make every turn slow


def model_facts(config) -> tuple[str, int]:
    """(served model id, context window) as the daemon will report and enforce them."""
    from ocrl import models

    if config.random_init:
        from ocrl import random_init

        name, trained = config.random_init, int(random_init.config_for(config.random_init).max_position_embeddings)
    else:
        kind, where = models.resolve(config.model)
        name = models.short_name(config.model, kind, where)
        if kind == "gguf":
            where = models.dequantise_to_cache(Path(where))
        trained = _trained_context(where)
    context = models.context_window(config, trained)
    return config.served_model_name or name, context


def _trained_context(where) -> int:
    from transformers import AutoConfig

    return int(getattr(AutoConfig.from_pretrained(str(where), local_files_only=True), "max_position_embeddings", 2048))


def base_url(config) -> str:
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{config.port}/v1"


def openclaw_config(config, *, lean: bool = False, model_id: str | None = None, context: int | None = None) -> dict:
    if model_id is None or context is None:
        model_id, context = model_facts(config)
    cap = config.default_max_tokens or context  # 0: a request may use what is left of the context
    max_tokens = min(cap, LEAN_MAX_TOKENS) if lean else cap
    provider = {
        "baseUrl": base_url(config),
        "apiKey": config.api_key or LOCAL_KEY,
        "api": "openai-completions",
        "timeoutSeconds": int(config.request_timeout),
        "models": [
            {
                "id": model_id,
                "name": f"{model_id} (ocrl)",
                "reasoning": False,
                "input": ["text"],
                "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                "contextWindow": context,
                "maxTokens": max_tokens,
            }
        ],
    }
    defaults: dict = {"model": {"primary": f"{PROVIDER}/{model_id}"}, "timeoutSeconds": int(config.request_timeout) + 300}
    out: dict = {"models": {"mode": "merge", "providers": {PROVIDER: provider}}, "agents": {"defaults": defaults}}
    if lean:
        defaults.update(skipBootstrap=True, contextInjection="never", skills=[])
        out["tools"] = {"profile": "minimal", "toolSearch": False}
    return out


def main(config, args) -> int:
    print(json.dumps(openclaw_config(config, lean=args.lean), indent=2))
    return 0
