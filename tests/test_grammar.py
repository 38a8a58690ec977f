"""Constrained decoding below HTTP: which requests become which grammar (and which are refused,
by name), the token bytes a vocabulary stands for, and the HF engine sampling inside a grammar
while unconstrained rows of the same batch sample as if alone."""

from __future__ import annotations

import json
import random
import re
import threading
from pathlib import Path

import anyio
import pytest
import torch

from ocrl import grammar, schema_regex
from ocrl.engine.base import finished_end
from ocrl.grammar import GrammarError
from ocrl.types import Grammar, SamplingParams
from tests.test_engine import LetterTokenizer, tiny_engine

torch.set_num_threads(1)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


def full(g: Grammar, text: str) -> bool:
    return re.fullmatch(g.regex, text) is not None


@pytest.fixture(scope="module")
def openclaw_tools() -> list[dict]:
    tools = {}
    for line in (Path(__file__).parent / "data" / "openclaw" / "compaction.jsonl").read_text().splitlines():
        for tool in json.loads(line)["request"].get("tools") or []:
            tools.setdefault(tool["function"]["name"], tool)
    assert len(tools) >= 5
    return list(tools.values())


# -- requests -> grammars ---------------------------------------------------------------------


def test_json_schema_becomes_its_language():
    g = grammar.from_request({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}, None, None)
    assert g.source == "json_schema" and json.loads(g.json_schema) == PERSON
    assert full(g, '{"name": "Ann", "age": 31}')
    assert not full(g, '{"name": "Ann"}')  # age is required
    assert not full(g, '{"name": "Ann", "age": "31"}')  # age is an integer
    assert not full(g, '{"name": "Annabel Lee Poe", "age": 3}')  # maxLength 12


def test_json_object_is_any_object_two_levels_deep():
    g = grammar.from_request({"type": "json_object"}, None, None)
    assert json.loads(g.json_schema) == {"type": "object"}
    for text in ('{}', '{"a": 1, "b": [true, null, "x"], "c": {"d": -2.5e+3}}'):
        assert full(g, text), text
    assert not full(g, "[1]") and not full(g, '"a"') and not full(g, "Sure! {}")


def test_text_auto_and_none_ask_for_nothing():
    assert grammar.from_request(None, None, None) is None
    assert grammar.from_request({"type": "text"}, [WEATHER], "auto") is None
    assert grammar.from_request(None, [WEATHER], "none") is None


def test_required_tool_choice_is_a_call_of_any_tool_with_valid_arguments():
    g = grammar.from_request(None, [WEATHER, TIME], "required")
    assert g.source == "tool_choice:required" and g.json_schema is None
    assert full(g, '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    assert full(g, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    assert not full(g, '<tool_call>{"name": "get_time", "arguments": {"zone": "PST"}}</tool_call>')  # not in the enum
    assert not full(g, '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')  # city is required
    assert not full(g, "It is sunny.")


def test_named_tool_choice_allows_only_that_function():
    g = grammar.from_request(None, [WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert g.source == "tool_choice:get_time"
    assert full(g, '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    assert not full(g, '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')


def test_forced_tool_choice_wins_over_response_format():
    g = grammar.from_request({"type": "json_object"}, [WEATHER], "required")
    assert g.source == "tool_choice:required"


@pytest.mark.parametrize(
    "response_format, tools, tool_choice, named, param",
    [
        ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "number", "minimum": 3}}}, None, None, "`minimum`", "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "multipleOf": 3}}}, None, None, "`multipleOf`", "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}, None, None, "`not` at $.properties.a", "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "string", "format": "hostname"}}}, None, None, "hostname", "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "n"}}, None, None, "schema", "response_format.json_schema.schema"),
        ({"type": "yaml"}, None, None, "'yaml'", "response_format.type"),
        (None, None, "required", "no `tools`", "tool_choice"),
        (None, [WEATHER], {"type": "function", "function": {"name": "nope"}}, "'nope'", "tool_choice"),
        (None, [WEATHER], "always", "'always'", "tool_choice"),
        (None, [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "patternProperties": {"^x": {}}}}}], "required", "`patternProperties`", None),
    ],
)
def test_what_cannot_be_enforced_is_refused_by_name(response_format, tools, tool_choice, named, param):
    with pytest.raises(GrammarError) as refused:
        grammar.from_request(response_format, tools, tool_choice)
    assert named in str(refused.value)
    if param is not None:
        assert refused.value.param == param


def test_integer_bounds_are_enforced_as_decimal_ranges():
    # every integer in -1200..1200 against bounds drawn from -130..130 (None: unbounded)
    random.seed(0)
    edges = [*range(-130, 131), None]
    for _ in range(300):
        low, high = random.choice(edges), random.choice(edges)
        if low is not None and high is not None and low > high:
            continue
        admits = re.compile(schema_regex.integer_range_regex(low, high))
        for n in range(-1200, 1201):
            assert bool(admits.fullmatch(str(n))) == ((low is None or n >= low) and (high is None or n <= high)), (low, high, n)
        assert not admits.fullmatch("-0") and not admits.fullmatch("007")
    # exclusive bounds and fractional bounds round inwards
    assert re.fullmatch(schema_regex.schema_regex({"type": "integer", "exclusiveMinimum": 2.5, "exclusiveMaximum": 5}), "3")
    assert not re.fullmatch(schema_regex.schema_regex({"type": "integer", "exclusiveMinimum": 2.5, "exclusiveMaximum": 5}), "5")


def test_agent_tool_schemas_are_enforced(openclaw_tools):
    """OpenClaw's own tools (captured from its CLI): integer minimums, a match-all
    patternProperties, free-form values, a string of up to 512 characters."""
    g = grammar.from_request(None, openclaw_tools, "required")
    assert full(g, '<tool_call>{"name": "session_status", "arguments": {"changesSince": 0}}</tool_call>')
    assert not full(g, '<tool_call>{"name": "session_status", "arguments": {"changesSince": -1}}</tool_call>')  # minimum 0
    assert full(g, '<tool_call>{"name": "tool_call", "arguments": {"id": "x", "args": {"a": [1, "b"], "c": {"d": null}}}}</tool_call>')
    assert full(g, '<tool_call>{"name": "tool_search", "arguments": {"query": null, "limit": 5}}</tool_call>')
    assert not full(g, '<tool_call>{"name": "tool_search", "arguments": {"limit": 0}}</tool_call>')  # minimum 1
    assert not full(g, '<tool_call>{"name": "tool_search", "arguments": {"queries": [{"query": ""}]}}</tool_call>')  # minLength 1


def test_bounded_strings_are_a_printable_subset_of_the_schema():
    g = schema_regex.schema_regex({"type": "string", "minLength": 2, "maxLength": 512})
    assert re.fullmatch(g, '"ab"') and re.fullmatch(g, '"' + "x" * 64 + '"')
    assert not re.fullmatch(g, '"a"')  # minLength
    assert not re.fullmatch(g, '"' + "x" * 65 + '"')  # capped at 64: still within maxLength 512
    assert not re.fullmatch(g, '"caf\u00e9"') and not re.fullmatch(g, '"a\"b"')  # no escapes, ASCII only


# -- vocabulary -------------------------------------------------------------------------------


def test_token_bytes_of_a_byte_level_vocabulary_decode_like_the_tokenizer(embedded):
    tokenizer = embedded.tokenizer
    pieces = grammar.token_bytes(tokenizer)
    assert set(tokenizer.all_special_ids).isdisjoint(pieces)
    # a word, a word with its leading space, and a 4-byte emoji split across tokens
    for text in ("hello", " world", "naïve 🌟 {\"a\": 1}"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(pieces[i] for i in ids).decode() == text


def test_finished_text_drops_an_incomplete_character_only():
    assert finished_end("ab\ufffd") == 2  # the token limit cut a character short: not emitted
    assert finished_end("ab") == 2
    assert finished_end("\ufffd") == 0
    assert finished_end("a\ufffdb") == 3  # a replacement char inside the text is the model's own


# -- the engine -------------------------------------------------------------------------------


class SpelledTokenizer(LetterTokenizer):
    """The tests' letter tokenizer with a vocabulary: id i spells chr(97 + i % 26), id 0 ends."""

    vocab_size = 64
    all_special_ids = [0]


def spelled_engine(**kwargs):
    engine = tiny_engine(**kwargs)
    engine.tokenizer = SpelledTokenizer()
    engine.grammars = grammar.Grammars(engine.tokenizer, engine.eos_ids)
    return engine


async def _with_scheduler(engine, work):
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        result = await work()
        tg.cancel_scope.cancel()
    return result


PROMPT = [1, 5, 6, 7]
WORD = Grammar(regex="b(cd|ef)+g", source="test")


async def test_sampled_text_stays_in_the_grammar_and_logprobs_stay_raw():
    engine = spelled_engine()
    params = [SamplingParams(max_tokens=20, temperature=1.5, seed=seed, grammar=WORD) for seed in range(4)]

    async def work():
        done = []
        for p in params:
            done.append(await engine.generate(PROMPT, p))
        return done

    for completion in await _with_scheduler(engine, work):
        if completion.finish_reason == "stop":  # ended by the model: the text is a whole word
            assert re.fullmatch("b(cd|ef)+g", completion.text), completion.text
            assert completion.response_ids[-1] == 0
        else:  # cut by the token limit: a prefix of one
            assert re.fullmatch("b(cd|ef)*(c|e)?", completion.text), completion.text
        # The recorded log-probs are the unmasked model's (what the trainer's forward gives),
        # of the tokens the grammar let through.
        scored = await engine.score(PROMPT, completion.response_ids)
        torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(scored), atol=1e-5, rtol=0)


async def test_greedy_rows_with_and_without_grammars_share_a_batch():
    engine = spelled_engine(max_batch_size=4)
    free = SamplingParams(max_tokens=12, temperature=0)
    bound = SamplingParams(max_tokens=12, temperature=0, grammar=WORD)

    async def alone():
        return [await engine.generate(PROMPT, free), await engine.generate(PROMPT, bound)]

    async def together():
        results = {}

        async def one(key, p):
            results[key] = await engine.generate(PROMPT, p)

        async with anyio.create_task_group() as tg:
            for key, p in enumerate([free, bound, free, bound]):
                tg.start_soon(one, key, p)
        return [results[k] for k in range(4)]

    solo_free, solo_bound = await _with_scheduler(engine, alone)
    batched = await _with_scheduler(engine, together)
    assert solo_free.text != solo_bound.text  # the grammar changed what greedy picks
    assert re.fullmatch("b(cd|ef)*(c|e|g)?", solo_bound.text)
    for result, expected in zip(batched, [solo_free, solo_bound, solo_free, solo_bound]):
        assert result.response_ids == expected.response_ids
        torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(expected.logprobs), atol=1e-5, rtol=0)


async def test_a_grammar_the_vocabulary_cannot_spell_is_refused_before_queueing():
    engine = spelled_engine()
    with pytest.raises(GrammarError, match="token automaton"):
        await engine.prepare(Grammar(regex="b1", source="test"))  # no token spells a digit
    assert engine.queue_depth == 0


async def test_a_grammar_row_joining_a_running_batch_leaves_it_as_it_was():
    engine = spelled_engine(max_batch_size=4)
    free = SamplingParams(max_tokens=30, temperature=0)
    bound = SamplingParams(max_tokens=12, temperature=0, grammar=WORD)

    async def alone():
        return [await engine.generate(PROMPT, free), await engine.generate([1, 9, 9], bound)]

    async def joined():
        results = {}
        started = anyio.Event()

        async def running():
            chunks = []
            async for chunk in engine.stream(PROMPT, free):
                chunks.append(chunk)
                started.set()
            results["free"] = [i for c in chunks for i in c.token_ids]

        async def joining():
            await started.wait()  # the free row is decoding: this one joins between two steps
            results["bound"] = await engine.generate([1, 9, 9], bound)

        async with anyio.create_task_group() as tg:
            tg.start_soon(running)
            tg.start_soon(joining)
        return results

    solo_free, solo_bound = await _with_scheduler(engine, alone)
    joins = []
    join = engine._join
    engine._join = lambda state, joining: joins.append(len(joining)) or join(state, joining)
    results = await _with_scheduler(engine, joined)
    assert joins == [1]  # it did join the running batch
    assert results["free"] == solo_free.response_ids
    assert results["bound"].response_ids == solo_bound.response_ids
    assert re.fullmatch("b(cd|ef)*(c|e|g)?", results["bound"].text)


async def test_compiled_grammars_are_cached_and_reused():
    engine = spelled_engine()
    await engine.prepare(WORD)
    first = engine.grammars.compile(WORD)
    await engine.prepare(Grammar(regex=WORD.regex, source="other"))  # keyed by the grammar's text
    assert engine.grammars.compile(WORD) is first
    for k in range(grammar._MAX_CACHED + 1):  # bounded: the least recently used goes first
        await engine.prepare(Grammar(regex=f"a{{{k + 1}}}", source="test"))
    assert engine.grammars.compile(WORD) is not first


async def test_a_grammar_compiling_past_the_limit_is_refused_while_the_loop_serves(monkeypatch):
    from ocrl.engine import hf

    engine = spelled_engine()
    release = threading.Event()
    real = engine.grammars.compile

    def slow(g):
        release.wait(10)
        return real(g)

    monkeypatch.setattr(engine.grammars, "compile", slow)
    monkeypatch.setattr(hf, "COMPILE_SECONDS", 0.3)
    ticks = 0

    async def ticking():
        nonlocal ticks
        while True:
            await anyio.sleep(0.01)
            ticks += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticking)
        with pytest.raises(grammar.GrammarError, match="took longer than 0.3 s") as refused:
            await engine.prepare(Grammar(regex="b+", source="json_schema"))
        tg.cancel_scope.cancel()
    release.set()
    assert refused.value.param == "response_format"
    assert ticks > 5  # the event loop kept running while the worker thread compiled


def test_every_tool_of_openclaws_full_profile_can_be_forced():
    # The tools of a real request (OpenClaw 2026.9.6, tools.profile "full", captured from its CLI):
    # each one forced by name, and all of them under "required", give a grammar.
    captured = json.loads((Path(__file__).parent / "data" / "openclaw" / "tools_full_profile.json").read_text())
    tools = captured["tools"]
    assert {"read", "exec", "edit", "write", "process"} <= {t["function"]["name"] for t in tools}
    for tool in tools:
        name = tool["function"]["name"]
        forced = grammar.from_request(None, tools, {"type": "function", "function": {"name": name}})
        assert forced.source == f"tool_choice:{name}"
    assert grammar.from_request(None, tools, "required").source == "tool_choice:required"
