"""/v1/completions end to end: the real daemon, the real `openai` client, the embedded model; raw
prompts as text or token ids, log-probs equal to a teacher-forced forward, side turns only."""

from __future__ import annotations

import openai
import pytest
import torch

PROMPT = "The capital of France is"


async def test_text_and_token_prompts_with_logprobs(daemon, embedded):
    ids = embedded.tokenizer.encode(PROMPT)
    before = daemon.stats()["sessions"].get("side_turns", 0)
    async with daemon.client() as client:
        text = await client.completions.create(model="m", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
        tokens = await client.completions.create(model="m", prompt=ids, max_tokens=5, temperature=0)
    [choice] = text.choices
    assert text.object == "text_completion" and choice.finish_reason == "length"
    assert tokens.choices[0].text == choice.text  # the same prompt, given as ids
    assert text.usage.prompt_tokens == len(ids) and text.usage.completion_tokens == 5
    response_ids = choice.model_extra["ocrl"]["completion_token_ids"]
    assert choice.model_extra["ocrl"]["turn_type"] == "side"
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == choice.text and lp.text_offset[0] == 0
    assert all(len(top) == 2 for top in lp.top_logprobs)
    # the served log-probs are those of the policy on these exact tokens
    with torch.no_grad():
        logits = embedded.model(input_ids=torch.tensor([ids + response_ids])).logits[0, len(ids) - 1 : -1].float()
    forced = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response_ids).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(torch.tensor(lp.token_logprobs), forced, atol=1e-3, rtol=0)
    assert daemon.stats()["sessions"]["side_turns"] - before == 2  # served, never trained


async def test_stream_and_n(daemon):
    async with daemon.client() as client:
        whole = await client.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0)
        stream = await client.completions.create(
            model="m", prompt=PROMPT, max_tokens=6, temperature=0, stream=True, logprobs=0, stream_options={"include_usage": True}
        )
        pieces, finish, usage, logprobs = [], None, None, []
        async for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                pieces.append(choice.text)
                finish = choice.finish_reason or finish
                logprobs += choice.logprobs.token_logprobs if choice.logprobs else []
        several = await client.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=1.0, seed=3, n=2)
    assert "".join(pieces) == whole.choices[0].text and len([p for p in pieces if p]) >= 2
    assert finish == whole.choices[0].finish_reason and usage.completion_tokens == len(logprobs) == 6
    assert [c.index for c in several.choices] == [0, 1] and several.usage.completion_tokens == 8


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"prompt": PROMPT, "echo": True}, "echo"),
        ({"prompt": PROMPT, "suffix": "!"}, "suffix"),
        ({"prompt": [1, 2, 10**9]}, "prompt"),
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": PROMPT, "extra_headers": {"X-Turn-Type": "main"}}, "turn_type"),
    ],
)
async def test_refusals_name_the_field(daemon, kwargs, param):
    async with daemon.client() as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model="m", max_tokens=2, **kwargs)
    assert refused.value.body["param"] == param
