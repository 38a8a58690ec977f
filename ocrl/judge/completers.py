"""The completers: what turns a model into an LLM judge's model call.

- `RemoteCompleter`: any OpenAI-compatible /chat/completions endpoint (`--prm-url`).
- `EngineCompleter`: an engine of ours (the policy's base weights by default, or `--prm-model`);
  it also gives the verdict judge its verdict-token probabilities.

Each is a `Complete` callable (`ocrl.judge.llm`) answering a `Reply`. Which model judges is the
daemon's choice; this module knows nothing of sessions, votes or training.
"""

from __future__ import annotations

from ocrl import chat
from ocrl.judge.llm import verdict_probs_from_logprobs
from ocrl.judge.votes import THINK_END, THINK_START, Reply
from ocrl.types import SamplingParams


class RemoteCompleter:
    """A judge endpoint: any OpenAI-compatible /chat/completions. A server that splits a thinking
    model's reasoning into `reasoning_content` gets it back as `<think>...</think>` before the
    answer, so the vote's text keeps it and the score is read after it."""

    def __init__(self, url: str, api_key: str, model: str):
        import httpx

        self.url = url.rstrip("/") + ("/chat/completions" if not url.rstrip("/").endswith("/chat/completions") else "")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self.client = httpx.AsyncClient(timeout=None)  # a vote's own timeout (GenerateJudge) bounds it

    async def __call__(self, messages, temperature, max_tokens, seed) -> Reply:
        body = {"model": self.model, "messages": messages, "temperature": temperature, "max_tokens": max_tokens}
        if seed is not None:
            body["seed"] = seed
        reply = await self.client.post(self.url, json=body, headers=self.headers)
        reply.raise_for_status()
        choice = reply.json()["choices"][0]
        message = choice.get("message") or {}
        text = message.get("content") or ""
        if thinking := message.get("reasoning_content"):
            # the server stopped inside the thinking when there is no answer yet: leave it open
            text = f"{THINK_START}{thinking}{THINK_END if text or choice.get('finish_reason') != 'length' else ''}{text}"
        return Reply(text, choice.get("finish_reason") or "stop")


class EngineCompleter:
    """A judge that samples from an engine of ours (the policy's base weights by default)."""

    def __init__(self, engine, tokenizer):
        self.engine, self.tokenizer = engine, tokenizer

    async def __call__(self, messages, temperature, max_tokens, seed) -> Reply:
        ids = chat.prompt_ids(self.tokenizer, chat.normalise(messages))
        room = self.engine.max_context - len(ids)  # the budget, capped by the judge's context
        if room < 1:
            raise ValueError(f"the judge prompt is {len(ids)} tokens; the judge's context is {self.engine.max_context}")
        params = SamplingParams(max_tokens=min(max_tokens, room), temperature=temperature, seed=seed)
        completion = await self.engine.generate(ids, params)
        return Reply(completion.text, completion.finish_reason)

    async def verdict_probs(self, messages) -> dict[int, float]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        first = await self.engine.next_token_logprobs(ids)
        candidates = {s: self.tokenizer.encode(s, add_special_tokens=False) for s in ("1", "-", "0", "+")}
        firsts = {s: float(first[t[0]]) for s, t in candidates.items() if len(t) == 1}
        minus, one = candidates["-"], candidates["1"]
        after_minus = await self.engine.next_token_logprobs(ids + minus)
        return verdict_probs_from_logprobs(firsts, float(after_minus[one[0]]))
