"""`python -m tui --url http://host:port [--api-key K]`: attach the dashboard to a running
daemon. Quitting leaves the daemon running."""

from __future__ import annotations

import argparse
import os

from tui.app import Dashboard
from tui.sources import RemoteSource


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tui", description="Live dashboard of a running ocrl daemon.")
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="the daemon's address, with or without /v1")
    parser.add_argument("--api-key", default=os.environ.get("OCRL_API_KEY", ""), help="default: $OCRL_API_KEY")
    parser.add_argument("--poll", type=float, default=1.0, help="seconds between stats snapshots")
    args = parser.parse_args(argv)
    Dashboard(RemoteSource(args.url, args.api_key), poll_interval=args.poll).run()


if __name__ == "__main__":
    main()
