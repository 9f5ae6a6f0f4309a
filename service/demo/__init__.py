"""``pasto demo``: the whole system on one machine, with synthetic traffic.

1. Migrates the database (SQLite in the instance folder unless ``PASTO_DATABASE_URL`` says otherwise)
   and makes sure an admin and a read token exist (kept in ``demo-tokens.json`` in the instance
   folder, readable by the owner only, so a second run reuses them): :mod:`.setup`.
2. Starts ``pasto serve`` (waitress and the round scheduler) as a child process: :mod:`.supervise`.
3. Creates the demo experiment, or resumes it (:mod:`.setup`): a recommender with 20 ranking blends
   (weights on watch time, likes and shares), watch time as the primary metric and two guardrails,
   like rate (absolute) and share rate (relative to the production blend). The ground truth is the
   shipped pasto scenario ``demo`` (:mod:`.groundtruth`), whose true means make a mixture of two
   blends strictly beat every single blend; this is checked at startup.
4. Generates traffic through :mod:`pasto_client` exactly as a recommender would: :mod:`.traffic`.
   What it prints is :mod:`.console`'s.

Ctrl-C (or SIGTERM, or SIGHUP from a closed terminal) stops the traffic, flushes the buffer, then
stops the server and its scheduler; if the demo dies without doing so, the server notices that its
stdin pipe closed and stops itself.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import webbrowser
from pathlib import Path

from pasto_client import Client, PastoAPIError, PastoConnectionError

from . import console
from .groundtruth import check_scenario, load_demo_scenario
from .setup import EXPERIMENT, ensure_experiment, prepare_database
from .supervise import ServerProcess, StopRequested, port_in_use, stop_signals_raise
from .traffic import TrafficStats, run_traffic

__all__ = ["EXPERIMENT", "check_scenario", "ensure_experiment", "load_demo_scenario", "main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pasto demo",
        description="Start the controller with a live demo experiment and synthetic traffic.",
    )
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="stop after this many rounds have closed (default: run until Ctrl-C)")
    parser.add_argument("--round-seconds", type=float, default=5.0,
                        help="round length of a newly created demo experiment (default 5)")
    parser.add_argument("--sessions-per-second", type=float, default=600.0,
                        help="synthetic traffic rate (default 600, i.e. 3,000 sessions per 5 s round)")
    parser.add_argument("--instance", type=Path, default=None,
                        help="folder for the SQLite database (unless PASTO_DATABASE_URL is set), "
                             "the demo's tokens and the server log (default: the service's "
                             "instance folder)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic traffic")
    parser.add_argument("--headless", action="store_true",
                        help="never open a browser; one plain line per round (for scripts and tests)")
    return parser


def _validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if not 1 <= args.port <= 65535:
        parser.error(f"--port must be from 1 to 65535, got {args.port}.")
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}.")
    if not args.round_seconds >= 1:
        parser.error(f"--round-seconds must be at least 1 (the API's minimum), got {args.round_seconds}.")
    if not args.sessions_per_second > 0:
        parser.error(f"--sessions-per-second must be positive, got {args.sessions_per_second}.")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _validate(args, parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("alembic", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    if port_in_use(args.port):
        print(f"pasto demo: error: port {args.port} on 127.0.0.1 is already in use (another `pasto demo` "
              "or server?); choose another with --port (`make run PORT=8001`).", file=sys.stderr)
        return 1
    from ..config import ConfigurationError
    from ..db import DatabaseUnreachable

    try:
        database_url, folder, admin_token, read_token = prepare_database(args.instance)
    except (ConfigurationError, DatabaseUnreachable) as error:  # as `pasto serve` reports them
        print(f"pasto demo: error: {error}", file=sys.stderr)
        return 1
    server = ServerProcess(database_url, args.port, folder / "demo-server.log")
    stats = TrafficStats()
    with stop_signals_raise():
        try:
            # Solved while the server boots.
            scenario = load_demo_scenario()
            console.print_scenario(scenario, check_scenario(scenario))
            with Client(server.url, admin_token) as client:
                server.wait_until_ready(client)
                name = ensure_experiment(client, scenario, args.round_seconds)
                dashboard = console.print_where_to_look(server.url, server.port, read_token, database_url,
                                                        str(server.log_path))
                if not args.headless and console.has_graphical_browser():
                    webbrowser.open(dashboard)
                run_traffic(client, name, scenario, args, stats)
        except (KeyboardInterrupt, StopRequested):
            console.say_while_stopping("\nStopping...")
        except (RuntimeError, PastoAPIError, PastoConnectionError) as error:
            print(f"pasto demo: error: {error}", file=sys.stderr, flush=True)
            return 1
        finally:
            server.stop()
    # `make run` says how it started the demo (PASTO_DEMO_COMMAND), so the hint names what the user typed.
    again = os.environ.get("PASTO_DEMO_COMMAND") or "pasto demo"
    console.say_while_stopping(f"Stopped after {stats.sessions:,} sessions; run `{again}` again to resume.")
    return 0

