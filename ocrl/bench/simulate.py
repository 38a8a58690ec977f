"""Scripted users with hidden preferences, talking to a running daemon over HTTP with the real
`openai` client (demo and evaluation).

Each persona (`ocrl.bench.persona`, a data file) has a hidden rule, such as at most 25 words or no
markdown. A user asks a few of its tasks, and after every answer replies with one of its feedback
lines picked at random: thanks (often mixed with the next request) when the rule holds, a redo
request or a complaint when it does not. The judge never sees the rule: whatever the policy
learns, it learns from the words of the feedback.
Probes are held-out prompts sent as side turns (never trained on) to measure the rule's pass rate.

This module knows the daemon only as an OpenAI-compatible URL plus ocrl's session headers.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable

import anyio
import msgspec

from ocrl.bench.persona import DEFAULT_PROBES, Persona, builtin


# The built-in personas (ocrl/bench/personas/*.toml); any other comes from `persona.load(FILE)`.
PERSONAS: dict[str, Persona] = builtin()
PROBES = list(DEFAULT_PROBES)


class Judged(msgspec.Struct):
    """One user reply the simulation produced: did the rule hold on the answer it judged?"""

    session_id: str
    turn_index: int
    passed: bool


@dataclass
class SimStats:
    main_turns: int = 0
    sessions: int = 0
    failures: int = 0
    feedback: list[Judged] = field(default_factory=list)


class Simulator:
    def __init__(
        self, client, persona: Persona, *, max_tokens: int = 64, temperature: float = 1.0, seed: int = 0, max_turns: int | None = None
    ):
        self.client = client
        self.max_turns = max_turns  # sessions wind down (closing feedback, then done) once this many main turns were asked
        self.persona = persona
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.rng = random.Random(seed)
        self.stats = SimStats()

    async def session(self, session_id: str, tasks: int = 2, redo_limit: int = 2) -> None:
        """Asks `tasks` tasks; after each answer replies with feedback; redo requests repeat the
        task up to `redo_limit` times. The last request carries X-Session-Done."""
        messages: list[dict] = []
        queue = self.rng.sample(self.persona.tasks, min(tasks, len(self.persona.tasks)))
        pending = queue.pop(0)
        messages.append({"role": "user", "content": pending})
        redos = 0
        while True:
            done = False
            reply = await self._ask(messages, session_id, done=False)
            if reply is None:
                return
            text = reply.choices[0].message.content or ""
            index = reply.model_extra["ocrl"]["turn_index"]
            passed = self.persona.holds(text)
            messages.append({"role": "assistant", "content": text})
            out_of_turns = self.max_turns is not None and self.stats.main_turns >= self.max_turns
            if passed or redos >= redo_limit or out_of_turns:
                if not queue or out_of_turns:
                    done = True
                    feedback = self.rng.choice(self.persona.standalone(passed))
                else:
                    lines = self.persona.pass_lines if passed else self.persona.fail_lines
                    feedback = self.persona.moving_on(self.rng.choice(lines), queue.pop(0), passed)
                    redos = 0
            else:
                feedback = self.rng.choice(self.persona.standalone(False))
                redos += 1
            self.stats.feedback.append(Judged(session_id, index, passed))
            messages.append({"role": "user", "content": feedback})
            if done:
                # the final feedback closes the last answer; a short final turn ends the session
                await self._ask(messages, session_id, done=True, max_tokens=1)
                self.stats.sessions += 1
                return

    async def _ask(self, messages, session_id: str, *, done: bool, max_tokens: int | None = None):
        headers = {"X-Session-Id": session_id, "X-Turn-Type": "main"}
        if done:
            headers["X-Session-Done"] = "1"
        try:
            reply = await self.client.chat.completions.create(
                model="ocrl", messages=messages, max_tokens=max_tokens or self.max_tokens,
                temperature=self.temperature, extra_headers=headers,
            )
        except Exception:  # noqa: BLE001 - counted and reported; a simulation keeps going
            self.stats.failures += 1
            return None
        self.stats.main_turns += 1
        return reply


async def probe(
    client, persona: Persona, prompts=None, *, max_tokens: int = 64, samples: int = 2, concurrency: int = 8,
    messages_for: Callable[[str, int], list[dict]] | None = None,
) -> dict:
    """The rule's pass rate on held-out prompts, sent as side turns (never trained on).
    `messages_for(prompt, i)` builds the chat for prompt i (default: the prompt alone)."""
    prompts = persona.probes if prompts is None else prompts
    results: list[tuple[bool, int]] = []
    limiter = anyio.Semaphore(concurrency)

    async def one(prompt: str, seed: int) -> None:
        messages = messages_for(prompt, seed) if messages_for else [{"role": "user", "content": prompt}]
        async with limiter:
            reply = await client.chat.completions.create(
                model="ocrl", messages=messages, max_tokens=max_tokens, temperature=1.0,
                seed=seed, extra_headers={"X-Turn-Type": "side", "X-Session-Id": f"probe-{seed}-{hash(prompt) & 0xffff}", "X-Session-Done": "1"},
            )
            text = reply.choices[0].message.content or ""
            results.append((persona.holds(text), reply.model_extra["ocrl"]["weights_version"]))

    async with anyio.create_task_group() as tg:
        for i, prompt in enumerate(prompts):
            for s in range(samples):
                tg.start_soon(one, prompt, 1000 * s + i)
    versions = sorted({v for _, v in results})
    return {"pass_rate": sum(p for p, _ in results) / len(results), "n": len(results), "weights_versions": versions}


async def run(url: str, api_key: str, persona: Persona, sessions: int, concurrency: int, tasks: int, seed: int, max_tokens: int) -> SimStats:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url.rstrip("/") + ("" if url.rstrip("/").endswith("/v1") else "/v1"), api_key=api_key or "none", timeout=600, max_retries=0) as client:
        sim = Simulator(client, persona, max_tokens=max_tokens, seed=seed)
        limiter = anyio.Semaphore(concurrency)
        started = time.monotonic()

        async def one(i: int) -> None:
            async with limiter:
                await sim.session(f"sim-{persona.name}-{seed}-{i}", tasks=tasks)

        async with anyio.create_task_group() as tg:
            for i in range(sessions):
                tg.start_soon(one, i)
        passed = sum(f.passed for f in sim.stats.feedback)
        print(
            f"simulate: {persona.name} ({persona.description}): {sim.stats.sessions} sessions, {sim.stats.main_turns} main turns, "
            f"{sim.stats.failures} failed requests, rule held on {passed}/{len(sim.stats.feedback)} answers, {time.monotonic() - started:.0f}s"
        )
        return sim.stats
