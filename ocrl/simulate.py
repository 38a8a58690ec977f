"""Scripted users with hidden preferences, talking to a running daemon over HTTP with the real
`openai` client (demo and evaluation).

Each persona has a hidden rule (at most 25 words; no markdown; ends with a question; lowercase).
A user asks a few tasks, and after every answer replies in natural language: thanks and moves on
when the rule holds, asks to redo or corrects when it does not (several phrasings each). The
judge never sees the rule: whatever the policy learns, it learns from the words of the feedback.
Probes are held-out prompts sent as side turns (never trained on) to measure the rule's pass rate.

This module knows the daemon only as an OpenAI-compatible URL plus ocrl's session headers.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, field
from typing import Callable

import anyio
import msgspec


@dataclass(frozen=True)
class Persona:
    name: str
    rule: Callable[[str], bool]
    description: str
    praise: tuple[str, ...]
    complaints: tuple[str, ...]


def words(text: str) -> int:
    return len(re.findall(r"\S+", text))


MARKDOWN = re.compile(r"(^\s*([-*+]|\d+[.)])\s)|(\*\*|__)|(^#+\s)|```", re.M)

PERSONAS = {
    "brief": Persona(
        "brief",
        lambda text: 0 < words(text) <= 25,
        "answers in at most 25 words",
        ("Thanks, that's exactly what I needed.", "Perfect, thank you!", "Great, thanks. That helps.", "Nice and clear, thanks!"),
        (
            "That's way too long. Please answer again in one short sentence.",
            "Too wordy, I asked for something short. Redo it, briefly.",
            "No, that's too long. Keep it under 25 words, please.",
            "Please try again, much shorter this time.",
        ),
    ),
    "plain": Persona(
        "plain",
        lambda text: bool(text.strip()) and not MARKDOWN.search(text),
        "no markdown lists, headers or bold",
        ("Thanks, that reads well.", "Great, thank you!", "Perfect, thanks."),
        (
            "Please don't use bullet points or bold text. Write it again as plain prose.",
            "No lists please, redo it as a normal paragraph.",
            "I said no markdown formatting. Try again in plain sentences.",
        ),
    ),
    "question": Persona(
        "question",
        lambda text: text.rstrip().endswith("?"),
        "ends with a question back to the user",
        ("Thanks! Good question, let me think.", "Great, thank you for asking.", "Perfect, thanks."),
        (
            "You forgot to ask me a follow-up question at the end. Please redo it.",
            "That's not what I wanted: always end by asking me something. Try again.",
            "Wrong format, please answer again and finish with a question to me.",
        ),
    ),
    "lowercase": Persona(
        "lowercase",
        lambda text: bool(text.strip()) and text == text.lower(),
        "replies in lowercase only",
        ("thanks, that's great.", "perfect, thank you!", "nice, thanks."),
        (
            "Please redo that without any capital letters.",
            "No, I asked for all lowercase. Try again.",
            "That's wrong, write it again entirely in lowercase letters.",
        ),
    ),
}

TASKS = [
    "What is 7 times 8?", "If I have 12 apples and eat 5, how many are left?", "What is 15 plus 27?",
    "A train travels 60 km in one hour. How far does it go in 3 hours?", "What is half of 90?",
    "What is the capital of France?", "Who wrote Romeo and Juliet?", "What planet is closest to the sun?",
    "How many days are in a leap year?", "What gas do plants absorb from the air?",
    "Write a short greeting for a birthday card.", "Suggest a name for a pet goldfish.",
    "Describe the colour blue to someone.", "Give me a tip for sleeping better.", "What is a good breakfast?",
    "Explain what a rainbow is.", "Why do we need sleep?", "What is photosynthesis?",
    "How do I boil an egg?", "What is the tallest animal?", "Recommend a hobby for a rainy day.",
    "What does a thermometer measure?", "How many minutes are in two hours?", "What is 100 divided by 4?",
]
PROBES = [
    "What is 9 plus 6?", "What is the largest ocean?", "Write a one-line thank-you note.",
    "How many legs does a cat have?", "What is the boiling point of water?", "Suggest a name for a dog.",
    "What is 6 times 7?", "Why is the sky blue?", "What is the capital of Spain?", "Give me a tip for studying.",
    "What do bees make?", "How many hours are in a day?",
]


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
        queue = self.rng.sample(TASKS, tasks)
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
            passed = self.persona.rule(text)
            messages.append({"role": "assistant", "content": text})
            out_of_turns = self.max_turns is not None and self.stats.main_turns >= self.max_turns
            if passed or redos >= redo_limit or out_of_turns:
                if not queue or out_of_turns:
                    done = True
                    feedback = self.rng.choice(self.persona.praise) if passed else self.rng.choice(self.persona.complaints)
                else:
                    nxt = queue.pop(0)
                    lead = self.rng.choice(self.persona.praise) if passed else self.rng.choice(self.persona.complaints) + " Anyway,"
                    feedback = f"{lead} {nxt}"
                    redos = 0
            else:
                feedback = self.rng.choice(self.persona.complaints)
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
    client, persona: Persona, prompts=PROBES, *, max_tokens: int = 64, samples: int = 2, concurrency: int = 8,
    messages_for: Callable[[str, int], list[dict]] | None = None,
) -> dict:
    """The rule's pass rate on held-out prompts, sent as side turns (never trained on).
    `messages_for(prompt, i)` builds the chat for prompt i (default: the prompt alone)."""
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
            results.append((persona.rule(text), reply.model_extra["ocrl"]["weights_version"]))

    async with anyio.create_task_group() as tg:
        for i, prompt in enumerate(prompts):
            for s in range(samples):
                tg.start_soon(one, prompt, 1000 * s + i)
    versions = sorted({v for _, v in results})
    return {"pass_rate": sum(p for p, _ in results) / len(results), "n": len(results), "weights_versions": versions}


async def run(url: str, api_key: str, persona_name: str, sessions: int, concurrency: int, tasks: int, seed: int, max_tokens: int) -> SimStats:
    from openai import AsyncOpenAI

    persona = PERSONAS[persona_name]
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
