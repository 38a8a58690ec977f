"""A loopback soak: many concurrent sessions for a fixed time through the real HTTP API, then an
accounting of the run directory. Used by `python -m ocrl bench soak` and, short, by the tests.

Each worker runs sessions back to back: a first user message, then next states that praise,
correct or are neutral (so the judge gives +1, -1 and 0), the last request ending the session;
half the sessions name themselves with X-Session-Id, half are threaded by prefix. At the
deadline a worker ends its session with one last request, so every main turn gets its sample.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx

NEXT_STATES = [
    "Thanks, that is exactly right.",
    "That's wrong, please try again.",
    "Ok. Another one then.",
    "Perfect, thank you!",
    "No, that is not what I asked.",
]


@dataclass
class SoakReport:
    sessions: int = 0
    requests: int = 0
    failures: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, MiB)
    heap: list[tuple[float, dict]] = field(default_factory=list)  # (seconds since start, C heap figures in MiB)
    steps: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, training steps so far)
    fds: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, open file descriptors)
    trims: tuple[int, float] = (0, 0.0)  # the daemon's periodic malloc trims so far, and their mean ms
    seconds: float = 0.0

    def rss_growth(self) -> tuple[float, float]:
        """(RSS once warm, at the end) in MiB: warm = the median of the second quarter, after
        the first batches allocated what they keep."""
        if not self.rss_mb:
            return 0.0, 0.0
        span = self.rss_mb[-1][0]
        warm = [mb for t, mb in self.rss_mb if span / 4 <= t <= span / 2] or [self.rss_mb[0][1]]
        return statistics.median(warm), self.rss_mb[-1][1]


async def soak(url: str, api_key: str = "", *, sessions: int = 100, seconds: float = 60.0, turns: int = 3, max_tokens: int = 4, seed: int = 0) -> SoakReport:
    base = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    report = SoakReport()
    started = time.monotonic()
    deadline = started + seconds
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=sessions + 8, max_keepalive_connections=sessions + 8)

    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=600, limits=limits) as client:

        async def request(messages: list[dict], extra: dict) -> str | None:
            body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 1.0, "seed": rng.randrange(1 << 30)}
            t = time.monotonic()
            try:
                reply = await client.post("/v1/chat/completions", json=body, headers=extra)
                if reply.status_code != 200:
                    report.failures.append(f"{reply.status_code}: {reply.text[:200]}")
                    return None
                text = reply.json()["choices"][0]["message"]["content"] or ""
            except Exception as e:  # noqa: BLE001 - every failure is counted
                report.failures.append(f"{type(e).__name__}: {e}")
                return None
            report.requests += 1
            report.latencies.append(time.monotonic() - t)
            return text

        async def worker(w: int) -> None:
            n = 0
            while time.monotonic() < deadline:
                n += 1
                report.sessions += 1
                named = (w + n) % 2 == 0
                sid = f"soak-{w}-{n}"
                messages = [{"role": "user", "content": f"What is {w % 10}+{n % 10}? ({sid})"}]
                for turn in range(turns):
                    last = turn == turns - 1 or time.monotonic() >= deadline
                    extra = ({"X-Session-Id": sid} if named else {}) | ({"X-Session-Done": "1"} if last else {})
                    text = await request(messages, extra)
                    if text is None:
                        return
                    if last:
                        break
                    messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": rng.choice(NEXT_STATES)}]

        async def watch_memory() -> None:
            while time.monotonic() < deadline + 1:
                try:
                    stats = (await client.get("/v1/ocrl/stats")).json()
                    at = time.monotonic() - started
                    report.rss_mb.append((at, stats["memory"]["rss_mb"]))
                    report.heap.append((at, {k: v for k, v in stats["memory"].items() if k.startswith("heap_")}))
                    report.steps.append((at, stats.get("training", {}).get("steps", 0)))
                    if stats["memory"].get("open_fds") is not None:
                        report.fds.append((at, stats["memory"]["open_fds"]))
                    report.trims = (stats["memory"].get("trims", 0), stats["memory"].get("trim_ms_mean", 0.0))
                except Exception:  # noqa: BLE001 - a missed sample of memory is no failure of the soak
                    pass
                await anyio.sleep(1.0)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_memory)
            for w in range(sessions):
                tg.start_soon(worker, w)
    report.seconds = time.monotonic() - started
    return report


def account(run_dir: Path) -> dict:
    """Main turns recorded vs samples journaled, and where each sample stands."""

    def rows(name: str) -> list:
        path = Path(run_dir) / name
        out = []
        for line in path.read_bytes().splitlines() if path.exists() else []:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
        return out

    main = {f"{t['session_id']}:{t['session_uid']}:{t['index']}" for t in rows("turns.jsonl") if t["turn_type"] == "main"}
    journal = rows("journal.jsonl")
    ids = [r["sample_id"] for r in journal]
    return {
        "main_turns": len(main),
        "journaled": len(set(ids)),
        "journaled_twice": len(ids) - len(set(ids)),
        "missing": len(main - set(ids)),
        "effective": sum(any(r["loss_mask"]) for r in journal),
    }


def print_report(report: SoakReport, accounting: dict, sessions: int) -> None:
    warm, end = report.rss_growth()
    lat = sorted(report.latencies) or [0.0]
    p = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]  # noqa: E731
    print(f"bench soak: {sessions} concurrent workers for {report.seconds:.0f} s: {report.sessions} sessions, {report.requests} requests, "
          f"{len(report.failures)} failed")
    print(f"  latency p50 {p(0.5):.2f} s, p99 {p(0.99):.2f} s, max {lat[-1]:.2f} s")
    print(f"  RSS end / warm {end / warm if warm else 0:6.3f}x   ({end:.0f} MiB vs {warm:.0f} MiB once warm)")
    if report.rss_mb:  # the shape: a one-time rise (the trainer's first step) then flat, or a climb
        span = report.rss_mb[-1][0]
        at = lambda series, q: next(v for t, v in series if t >= span * q)  # noqa: E731
        marks = [at(report.rss_mb, q) for q in (0.0, 0.25, 0.5, 0.75, 1.0)]
        print("  RSS at start, 1/4, middle, 3/4, end: " + ", ".join(f"{mb:.0f}" for mb in marks) + " MiB"
              f"; end / middle {marks[-1] / marks[2]:.3f}x")
        if report.steps:
            print("  training steps at the same marks: " + ", ".join(str(at(report.steps, q)) for q in (0.0, 0.25, 0.5, 0.75, 1.0)))
        if report.fds:  # a leak of sockets or files climbs here
            print("  open file descriptors at the same marks: " + ", ".join(str(at(report.fds, q)) for q in (0.0, 0.25, 0.5, 0.75, 1.0)))
        if report.trims[0]:
            print(f"  periodic malloc trims: {report.trims[0]}, {report.trims[1]:.1f} ms each (mean)")
        if report.heap and report.heap[-1][1]:
            for name, q in (("middle", 0.5), ("end", 1.0)):
                figures = at(report.heap, q)
                print(f"  C heap at the {name}: " + ", ".join(f"{k.removeprefix('heap_').removesuffix('_mb')} {v:.0f}" for k, v in figures.items()) + " MiB")
    print(f"  samples: {accounting['journaled']} journaled for {accounting['main_turns']} main turns, {accounting['missing']} missing, "
          f"{accounting['journaled_twice']} twice, {accounting['effective']} effective")
    for failure in report.failures[:5]:
        print(f"  failure: {failure}")
