"""The learning-curve experiment behind `python -m ocrl bench learn`: a daemon in this process,
a baseline probe, simulated users with a hidden preference talking to it, probes every few
training steps, a final probe. Writes `learning.jsonl` and `learning.png` into the run directory
and prints the baseline and final pass rate, the turns and wall time it took, and the judge's
agreement with the hidden rule on the turns it judged.

The rewards come from the PRM reading the users' words; the rule only writes those words and
scores the probes.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import anyio
import msgspec

from ocrl.bench import simulate
from ocrl.bench.serving import on_free_port, serving

log = logging.getLogger("ocrl.bench.learn")


def judge_agreement(feedback: list[simulate.Judged], verdicts_path: Path) -> dict:
    """How often the PRM's verdict on a turn matched the hidden rule (+1 when it held, -1 when
    not). A 0 verdict is an abstention: counted in coverage, not as agreement. Without verdicts
    (--method opd), the hint judge is scored instead: a hint counts as -1, none as +1."""
    scores = {}
    for line in verdicts_path.read_bytes().splitlines() if verdicts_path.exists() else []:
        row = msgspec.json.decode(line)
        scores[(row["session_id"], row["turn_index"])] = row["score"]
    hints_path = verdicts_path.with_name("hints.jsonl")
    if not scores and hints_path.exists():
        for line in hints_path.read_bytes().splitlines():
            row = msgspec.json.decode(line)
            scores[(row["session_id"], row["turn_index"])] = -1 if row["hint"] is not None else 1
    judged = [(f.passed, scores[(f.session_id, f.turn_index)]) for f in feedback if (f.session_id, f.turn_index) in scores]
    decided = [(p, s) for p, s in judged if s != 0]
    agree = sum((s == 1) == p for p, s in decided)
    return {
        "judged": len(judged),
        "decided": len(decided),
        "agreement": agree / len(decided) if decided else float("nan"),
        "coverage": len(decided) / len(judged) if judged else float("nan"),
    }


def distilled_share(run_dir: Path) -> float:
    """The share of the run's samples that carried a teacher signal."""
    path = run_dir / "samples.jsonl"
    rows = [msgspec.json.decode(line) for line in path.read_bytes().splitlines() if line.strip()] if path.exists() else []
    return sum(r.get("teacher_prompt_ids") is not None for r in rows) / max(1, len(rows))


def _figure(path: Path, title: str, draw, xlabel: str = "main turns") -> None:
    """One pass-rate chart: `draw(ax)` plots the lines, this styles and saves it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no %s", path.name)
        return
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    draw(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Pass rate by training step (most steps of a CPU run come after the traffic, in the drain,
    where main turns no longer move); each point is labelled with its main turns."""

    def draw(ax) -> None:
        ax.plot([r["step"] for r in rows], [r["pass_rate"] for r in rows], "o-", label="probe pass rate (hidden rule)")
        for r in rows:
            ax.annotate(f"{r['main_turns']}", (r["step"], r["pass_rate"]), textcoords="offset points", xytext=(0, 6), fontsize=7, ha="center")
        rewarded = [(r["step"], r["reward_mean"]) for r in rows if r.get("reward_mean") is not None]
        if rewarded:
            ax.plot([t for t, _ in rewarded], [(m + 1) / 2 for _, m in rewarded], "s--", label="(mean reward + 1) / 2, last step")

    _figure(path, title, draw, xlabel="training steps (points labelled with main turns)")


async def bench_learn(
    config, *, persona: simulate.Persona, turns: int, concurrency: int, probe_every: int, tasks: int, max_tokens: int, probe_samples: int,
    methods: list[str] | None = None,
) -> dict:
    """One learning curve per method, one after the other, each on a fresh daemon with the same
    persona, seed and turn budget; then the curves side by side (a table and one plot). The
    baseline probe is measured by the first method only and reused: every spec starts from the
    same weights and answers the same probes with the same seeds (the spec's seed changes the
    simulated users, not the probes)."""
    methods = methods or [config.method]
    variants = {spec: _variant(config, spec) for spec in methods}  # "opd:system" = opd with --hint-placement system
    if len(methods) == 1:
        return await learn_once(
            variants[methods[0]], persona=persona, turns=turns, concurrency=concurrency,
            probe_every=probe_every, tasks=tasks, max_tokens=max_tokens, probe_samples=probe_samples,
        )
    root = Path(config.record_dir) if config.record_dir else Path("runs") / time.strftime("learn-%Y%m%d-%H%M%S")
    results: dict[str, dict] = {}
    for method in methods:
        log.info("bench learn: method %s (%d of %d)", method, len(results) + 1, len(methods))
        first = next(iter(results.values()), None)
        results[method] = await learn_once(
            msgspec.structs.replace(variants[method], record_dir=str(root / method.replace(":", "-"))), persona=persona, turns=turns,
            concurrency=concurrency, probe_every=probe_every, tasks=tasks, max_tokens=max_tokens, probe_samples=probe_samples,
            # the placement probes (three probe sets) only when the specs compare where the hint goes
            check_placement=not results and any(o in ("user", "system") for m in methods for o in m.split(":")[1:]),
            baseline=first["rows"][0] if first else None,
        )
    plot_methods({m: r["rows"] for m, r in results.items()}, root / "learning-methods.png", f"{persona.name}: {persona.description}")
    print(f"bench learn: {len(methods)} methods side by side, persona {persona.name}, {turns} main turns each, seed {config.seed}; {root}")
    print(f"  {'method':<10} {'baseline':>8} {'final':>6} {'best':>6} {'steps':>5} {'turns':>5} {'distilled':>9} {'seconds':>7}")
    for method, r in results.items():
        print(f"  {method:<10} {r['baseline']:>8.2f} {r['final']:>6.2f} {r['best']:>6.2f} {r['steps']:>5} {r['main_turns']:>5} "
              f"{r['distilled_share']:>9.2f} {r['seconds']:>7}")
    placement = next((r["placement"] for r in results.values() if r.get("placement")), None)
    if placement:
        print(f"  hint placement (base policy, probe pass rate with a complaint as hint): none {placement['none']:.2f}, "
              f"user message {placement['user']:.2f}, system note {placement['system']:.2f}")
    print("  pass rate by training step (probe rows):")
    for method, r in results.items():
        print(f"  {method:<10} " + " ".join(f"s{row['step']}:{row['pass_rate']:.2f}" for row in r["rows"]))
    return results


def _variant(config, spec: str):
    """A method spec: rl | opd | combine, then optionally `:user` or `:system` (where the teacher
    sees the hint), `:topk<K>` (--distill-topk K) and any config field as `:name=value`, e.g.
    `combine:system:topk16`, `rl:batch_counts=all`, `opd:topk50:kl_coef=0:lr=1e-6`."""
    method, *options = spec.split(":")
    fields: dict = {"method": method}
    for option in options:
        name, eq, value = option.partition("=")
        if option in ("user", "system") and method != "rl":
            fields["hint_placement"] = option
        elif option.startswith("topk") and option[4:].isdigit() and int(option[4:]) > 0 and method != "rl":
            fields["distill_topk"] = int(option[4:])
        elif eq and name in type(config).__struct_fields__ and name not in ("method", "record_dir", "port"):
            fields[name] = value
        else:
            method = ""  # not a spec
    if method not in ("rl", "opd", "combine"):
        raise SystemExit(
            f"ocrl: unknown method {spec!r}; choose from rl, opd, combine (opd and combine take :user, :system, :topk<K>; "
            "any takes :field=value)"
        )
    try:
        return msgspec.convert(msgspec.structs.asdict(config) | fields, type(config), strict=False)
    except msgspec.ValidationError as e:
        raise SystemExit(f"ocrl: method spec {spec!r}: {e}") from None


def plot_methods(curves: dict[str, list[dict]], path: Path, title: str) -> None:
    def draw(ax) -> None:
        for method, rows in curves.items():
            ax.plot([r["main_turns"] for r in rows], [r["pass_rate"] for r in rows], "o-", label=method)
        ax.set_ylabel("probe pass rate (hidden rule)")

    _figure(path, title, draw)


async def placement_check(client, persona: simulate.Persona, *, max_tokens: int, samples: int) -> dict[str, float]:
    """Where should the teacher see the hint? The base policy's probe pass rate with one of the
    persona's complaints as the hint, appended to the user message vs as a system note after
    it, beside no hint: the teacher whose own samples follow the rule more teaches it better."""
    from ocrl import chat
    from ocrl.types import Message

    def builder(placement: str | None):
        def messages_for(prompt: str, i: int) -> list[dict]:
            plain = [Message(role="user", content=prompt)]
            if placement is None:
                return [msgspec.to_builtins(m) for m in plain]
            complaints = persona.standalone(False)
            hint = complaints[i % len(complaints)]
            return [msgspec.to_builtins(m) for m in chat.with_hints(plain, [hint], placement)]

        return messages_for

    rates = {}
    for placement in (None, "user", "system"):
        result = await simulate.probe(client, persona, max_tokens=max_tokens, samples=samples, messages_for=builder(placement))
        rates[placement or "none"] = result["pass_rate"]
    log.info("hint placement: probe pass rate without a hint %.2f, in the user message %.2f, as a system note %.2f",
             rates["none"], rates["user"], rates["system"])
    return rates


async def learn_once(
    config, *, persona: simulate.Persona, turns: int, concurrency: int, probe_every: int, tasks: int, max_tokens: int, probe_samples: int,
    check_placement: bool = False, baseline: dict | None = None,
) -> dict:
    from openai import AsyncOpenAI

    from ocrl.daemon import Daemon

    config = on_free_port(config, no_train=False)
    daemon = Daemon(config)
    await daemon.build()
    run_dir = daemon.run_dir
    rows: list[dict] = []
    started = time.monotonic()
    base_url = f"http://{config.host}:{config.port}/v1"
    summary: dict = {}
    async with serving(daemon):
        async with AsyncOpenAI(base_url=base_url, api_key=config.api_key or "none", timeout=900, max_retries=0) as client:
            sim = simulate.Simulator(client, persona, max_tokens=max_tokens, seed=config.seed, max_turns=turns)

            async def measure(tag: str) -> None:
                result = await simulate.probe(client, persona, max_tokens=max_tokens, samples=probe_samples)
                trainer = daemon.trainer
                row = {
                    "tag": tag, "main_turns": sim.stats.main_turns, "step": trainer.steps, "weights_version": daemon.engine.weights_version,
                    "pass_rate": result["pass_rate"], "probes": result["n"], "probe_versions": result["weights_versions"],
                    "reward_mean": trainer.last_metrics.get("reward_mean"), "seconds": round(time.monotonic() - started, 1),
                    "method": config.method, "distilled": trainer.last_metrics.get("distilled"),
                    "teacher_advantage": trainer.last_metrics.get("teacher_advantage"),
                    **judge_agreement(sim.stats.feedback, run_dir / "verdicts.jsonl"),
                }
                rows.append(row)
                with open(run_dir / "learning.jsonl", "ab") as f:
                    f.write(msgspec.json.encode(row) + b"\n")
                log.info("probe %s: pass rate %.2f at %d main turns, step %d", tag, row["pass_rate"], row["main_turns"], row["step"])

            # 1. baseline, 2. simulated traffic with probes every `probe_every` steps, 3. final
            if baseline is None:
                await measure("baseline")
            else:  # the same weights, probes and seeds as the run that measured it
                rows.append(baseline | {"tag": "baseline (reused)", "method": config.method})
            if check_placement:
                summary_placement = await placement_check(client, persona, max_tokens=max_tokens, samples=probe_samples)
            limiter = anyio.Semaphore(concurrency)

            async def one(i: int) -> None:
                try:
                    await sim.session(f"learn-{i}", tasks=tasks)
                finally:
                    limiter.release()

            drained = anyio.Event()

            async def probes() -> None:
                # every `probe_every` steps, through the traffic and the drain after it; a probe
                # in flight when the drain ends is finished, not cancelled
                next_probe = probe_every
                while not drained.is_set():
                    with anyio.move_on_after(0.5):
                        await drained.wait()
                    if not drained.is_set() and daemon.trainer.steps >= next_probe:
                        next_probe = daemon.trainer.steps + probe_every
                        await measure(f"step-{daemon.trainer.steps}")

            async with anyio.create_task_group() as watch:
                watch.start_soon(probes)
                async with anyio.create_task_group() as sessions:
                    i = 0
                    while True:
                        await limiter.acquire()
                        if sim.stats.main_turns >= turns:
                            limiter.release()
                            break
                        sessions.start_soon(one, i)
                        i += 1
                # let the trainer take the steps its queue already holds, then the final probe
                with anyio.move_on_after(600):
                    while daemon.trainer.pending >= config.rollout_batch_size:
                        await anyio.sleep(0.5)
                drained.set()
            await measure("final")
            summary = {
                "persona": persona.name, "baseline": rows[0]["pass_rate"], "final": rows[-1]["pass_rate"],
                "main_turns": sim.stats.main_turns, "sessions": sim.stats.sessions, "failed_requests": sim.stats.failures,
                "steps": daemon.trainer.steps, "seconds": round(time.monotonic() - started), "best": max(r["pass_rate"] for r in rows[1:]),
                **judge_agreement(sim.stats.feedback, run_dir / "verdicts.jsonl"),
                "rule_held_in_training": sum(f.passed for f in sim.stats.feedback) / max(1, len(sim.stats.feedback)),
                "method": config.method, "rows": rows, "distilled_share": distilled_share(run_dir),
                "placement": summary_placement if check_placement else None,
            }
    title = (
        f"{persona.name}: {persona.description}; judge {daemon.judge.name}, LoRA r={config.lora_rank}, lr={config.lr:g}, "
        f"batch {config.rollout_batch_size}"
    )
    plot(rows, run_dir / "learning.png", title)
    print(f"bench learn: method {config.method}, persona {persona.name} ({persona.description}), run dir {run_dir}")
    print(f"  probe pass rate  baseline {summary['baseline']:.2f} -> final {summary['final']:.2f} (best {summary['best']:.2f}), "
          f"{summary['final'] - summary['baseline']:+.2f}")
    print(f"  {summary['main_turns']} main turns in {summary['sessions']} sessions, {summary['steps']} training steps, "
          f"{summary['seconds']} s wall, {summary['failed_requests']} failed requests")
    print(f"  judge vs hidden rule: agreement {summary['agreement']:.2f} on {summary['decided']} decided of {summary['judged']} judged turns "
          f"(coverage {summary['coverage']:.2f}); rule held on {summary['rule_held_in_training']:.2f} of training answers")
    return summary
