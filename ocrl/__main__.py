"""The command line: `python -m ocrl serve | simulate | bench | openclaw-config`. Flags mirror config fields."""

from __future__ import annotations

import argparse
import os
import sys

from ocrl import config as config_mod


def cause(error: BaseException) -> BaseException:
    """The one error inside nested single-error groups (a task group wraps what its task raised)."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def run_async(fn, *args) -> None:
    import anyio

    try:
        import uvloop  # noqa: F401

        return anyio.run(fn, *args, backend_options={"use_uvloop": True})
    except ImportError:
        return anyio.run(fn, *args)


def add_simulation_flags(parser: argparse.ArgumentParser) -> None:
    from ocrl.bench.persona import builtin_names

    parser.add_argument("--persona", choices=builtin_names(), default="brief", help="a built-in persona (ocrl/bench/personas/NAME.toml)")
    parser.add_argument("--persona-file", default=None, help="a persona file (TOML, see ocrl/bench/persona.py); overrides --persona")
    parser.add_argument("--turns", type=int, default=200, help="learn: main turns to simulate")
    parser.add_argument("--concurrency", type=int, default=None, help="sessions at once (bench soak: 100 when not given)")
    parser.add_argument("--tasks", type=int, default=2, help="tasks per session")
    parser.add_argument("--probe-every", type=int, default=2, help="learn: probe every N training steps")
    parser.add_argument("--probe-samples", type=int, default=2, help="learn: samples per probe prompt")
    parser.add_argument("--methods", default=None, help="learn: comma-separated methods to run one after the other, e.g. rl,opd,combine (opd:system = opd with --hint-placement system, combine:topk16 = combine with --distill-topk 16)")


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever fetched from a model hub
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(prog="ocrl", description="online RL of a language model from live conversations")
    commands = parser.add_subparsers(dest="command")
    serve = commands.add_parser("serve", help="serve the model and learn from its conversations (default)")
    config_mod.add_flags(serve)
    bench = commands.add_parser("bench", help="benchmarks, each a ratio against a baseline in the same run")
    bench.add_argument(
        "which", choices=["serve", "train", "train-long", "learn", "soak", "gpu", "openclaw", "refuse", "judge"],
        help="serve: proxy overhead and batching; train: step, swap and stall; train-long: a step on long agent samples with gradient checkpointing and without (time, peak RSS); learn: a learning curve; soak: concurrent sessions for --seconds; gpu: engines on CUDA (swap, stall, step, tokens/s); openclaw: the real OpenClaw CLI end to end (needs node >= 24.16 and openclaw); refuse: healthz while four 7.9 MB bodies are refused; judge: the embed judge's ms per case on the held-out cases against the encoder's forward alone",
    )
    bench.add_argument("--openclaw", default=None, help="openclaw: the folder where node@24 and openclaw@2026.9.6 were installed (see README) (or the CLI; default: on PATH, or $OCRL_OPENCLAW)")
    bench.add_argument("--long-prompts", default=None, help="train-long: prompt lengths of one agent session's turns (default 3000,3300,3600)")
    bench.add_argument("--seconds", type=float, default=60.0, help="soak: how long to drive --concurrency sessions")
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--max-tokens", type=int, default=None, help="completion tokens per request (serve/train 32, learn 48)")
    bench.add_argument("--report", default="", help="gpu: write every figure to this JSON file (rewritten after each section)")
    bench.add_argument("--archs", default=None, help="gpu: --random-init architectures to measure (default qwen3-0.6b,qwen3-4b on CUDA)")
    bench.add_argument("--batches", default=None, help="gpu: concurrent requests for the tokens/s rows (default 1,8,32 on CUDA)")
    bench.add_argument("--modes", default=None, help="refuse: comma-separated modes to measure, of 'decoded on loop', 'pre-check', 'byte check', 'tokenised' (default all; the tokenised one takes minutes)")
    bench.add_argument("--no-gpu-tests", action="store_true", help="gpu: skip the `pytest -m gpu` run")
    bench.add_argument("--test-timeout", type=float, default=240.0, help="gpu: seconds the gpu tests may take (at most a third of the budget left)")
    bench.add_argument("--budget-s", type=float, default=450.0,
                       help="gpu: wall-clock seconds for the whole command, from its start; a section that cannot finish in what is left is skipped, and the report says so")
    add_simulation_flags(bench)
    config_mod.add_flags(bench)
    oc = commands.add_parser("openclaw-config", help="print an openclaw.json provider block matching these serve flags")
    oc.add_argument("--lean", action="store_true", help="add agent settings that fit a small context (no bootstrap, no skills, minimal tools)")
    config_mod.add_flags(oc)
    sim = commands.add_parser("simulate", help="scripted users with a hidden preference talk to a running daemon")
    sim.add_argument("--url", default="http://127.0.0.1:30000/v1")
    sim.add_argument("--api-key", default=os.environ.get("OCRL_API_KEY", ""))
    sim.add_argument("--sessions", type=int, default=8)
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--max-tokens", type=int, default=48)
    add_simulation_flags(sim)
    args = parser.parse_args(argv if argv is not None else (sys.argv[1:] or ["serve"]))
    if args.command is None:
        args = parser.parse_args(["serve", *(argv or sys.argv[1:])])
    if getattr(args, "concurrency", 0) is None:
        args.concurrency = 100 if getattr(args, "which", None) == "soak" else 8
    from ocrl.daemon import setup_logging

    setup_logging()
    if hasattr(args, "persona"):
        from ocrl.bench import persona as persona_mod

        try:
            args.persona = persona_mod.load(args.persona_file or persona_mod.BUILTIN_DIR / f"{args.persona}.toml")
        except persona_mod.PersonaError as e:
            print(f"ocrl: {e}", file=sys.stderr)
            return 2
    if args.command == "simulate":
        from ocrl.bench import simulate

        run_async(simulate.run, args.url, args.api_key, args.persona, args.sessions, args.concurrency, args.tasks, args.seed, args.max_tokens)
        return 0
    try:
        config = config_mod.load(args)
        from ocrl.engine.prefix_cache import parse_budget

        parse_budget(config.prefix_cache)  # a bad --prefix-cache fails here, not once the model is loaded
    except (config_mod.ConfigError, OSError, ValueError) as e:
        print(f"ocrl: {e}", file=sys.stderr)
        return 2
    if args.command == "openclaw-config":
        from ocrl import models, openclaw

        try:
            return openclaw.main(config, args)
        except models.ModelError as e:
            print(f"ocrl: {e}", file=sys.stderr)
            return 2
    if args.command == "serve":
        from ocrl.daemon import serve as serve_daemon

        try:
            run_async(serve_daemon, config)
        except Exception as e:
            if isinstance(cause(e), config_mod.ConfigError) or type(cause(e)).__name__ == "ModelError":
                print(f"ocrl: {cause(e)}", file=sys.stderr)
                return 2
            raise
        return 0
    if args.command == "bench":
        from ocrl import bench as bench_mod

        try:
            return run_async(bench_mod.run, args.which, config, args) or 0
        except Exception as e:
            if isinstance(cause(e), config_mod.ConfigError):
                print(f"ocrl: {cause(e)}", file=sys.stderr)
                return 2
            raise
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
