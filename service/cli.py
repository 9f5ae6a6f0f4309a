"""Service commands of ``pasto``: ``serve``, ``worker``, ``db upgrade|downgrade|current``, ``tokens create``, ``demo``.

Each command is a :class:`Command` declared in pyproject.toml's entry-point group ``pasto.commands``;
``pasto.cli`` discovers them there and calls the one named on the command line, so the core never
imports the service (the service depends on the core, not the other way). ``demo`` is passed on to
``service.demo``. Configuration comes from the environment (``PASTO_*``), see ``service.config``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass

from flask import Flask

#: The service's commands and their one-line help, shown by ``pasto --help``.
SERVICE_COMMANDS = {
    "serve": "serve the HTTP API (waitress) with the round scheduler",
    "worker": "run the round scheduler alone (no HTTP)",
    "db": "database schema: upgrade, current, downgrade (Alembic)",
    "tokens": "API tokens: create",
    "demo": "run the service with a live demo experiment and synthetic traffic",
}


@dataclass(frozen=True)
class Command:
    """One service command as ``pasto.cli`` discovers it (entry-point group ``pasto.commands``).

    Attributes
    ----------
    name : str
        The word after ``pasto`` on the command line.
    help : str
        Its one-line help for ``pasto --help``.
    """

    name: str
    help: str

    def __call__(self, argv: list[str]) -> int:
        """Run the command with ``argv``, the words after its name; returns the exit status."""
        return main([self.name, *argv])


serve_command = Command("serve", SERVICE_COMMANDS["serve"])
worker_command = Command("worker", SERVICE_COMMANDS["worker"])
db_command = Command("db", SERVICE_COMMANDS["db"])
tokens_command = Command("tokens", SERVICE_COMMANDS["tokens"])
demo_command = Command("demo", SERVICE_COMMANDS["demo"])


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pasto", description="pasto controller service commands.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")

    serve = commands.add_parser("serve", help=SERVICE_COMMANDS["serve"])
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--threads", type=int, default=8, help="waitress worker threads (default 8)")
    serve.add_argument("--no-scheduler", action="store_true",
                       help="do not close rounds in this process (run `pasto worker` separately)")
    serve.add_argument("--stop-on-stdin-eof", action="store_true",
                       help="shut down when standard input reaches end of file; a parent that passes "
                            "a pipe it never writes to takes the server down with it, however the "
                            "parent ends (`pasto demo` does)")

    commands.add_parser("worker", help=SERVICE_COMMANDS["worker"])

    database = commands.add_parser("db", help=SERVICE_COMMANDS["db"])
    db_commands = database.add_subparsers(dest="db_command", required=True, metavar="action")
    upgrade = db_commands.add_parser("upgrade", help="migrate the database to the newest schema")
    upgrade.add_argument("--revision", default="head", help="target revision (default: head, the newest)")
    # No default target: a bare `downgrade` used to mean `base`, which drops the whole schema.
    downgrade = db_commands.add_parser("downgrade", help="migrate the database back to an older revision")
    downgrade.add_argument("--revision", required=True,
                           help="target revision, e.g. 0003; `base` drops every table and needs --yes")
    downgrade.add_argument("--yes", action="store_true",
                           help="confirm a downgrade to base, which deletes all of pasto's data")
    db_commands.add_parser("current", help="print the database's schema revision")

    tokens = commands.add_parser("tokens", help=SERVICE_COMMANDS["tokens"])
    token_commands = tokens.add_subparsers(dest="tokens_command", required=True, metavar="action")
    create = token_commands.add_parser("create", help="create a token and print it (only its hash is stored)")
    create.add_argument("--role", required=True, choices=("read", "ingest", "admin"))
    create.add_argument("--name", default="", help="what the token is for (default: the role)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a service command; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        from .demo import main as demo_main

        return demo_main(argv[1:])
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.INFO if args.command == "db" else logging.WARNING)
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    logging.getLogger("apscheduler.executors").setLevel(logging.WARNING)
    from . import SchemaOutOfDate, create_app
    from .config import ConfigurationError
    from .db import DatabaseUnreachable

    # What an operator can fix (a setting, the database's address, a migration to run) is one line on
    # stderr; anything else raised here is a bug and keeps its traceback.
    try:
        if args.command == "db":
            return _db(args, create_app)
        app = create_app()
    except (ConfigurationError, DatabaseUnreachable, SchemaOutOfDate) as error:
        print(f"pasto: error: {error}", file=sys.stderr)
        return 1
    if args.command == "tokens":
        return _create_token(app, args.role, args.name or args.role)
    if args.command == "worker":
        return _worker(app)
    return _serve(app, args.host, args.port, args.threads, scheduler=not args.no_scheduler,
                  stop_on_stdin_eof=args.stop_on_stdin_eof)


def _db(args: argparse.Namespace, create_app) -> int:
    from alembic.util import CommandError

    import migrations

    from .db import check_connection, get_db

    app = create_app({"PASTO_CHECK_SCHEMA": False})
    engine = get_db(app).engine
    url = engine.url.render_as_string(hide_password=False)
    shown = engine.url.render_as_string(hide_password=True)
    if args.db_command == "downgrade" and args.revision == "base" and not args.yes:
        engine.dispose()
        print(f"pasto: error: `pasto db downgrade --revision base` would drop every table of pasto in {shown} "
              "(experiments, arms, rounds, statistics, observation ids and API tokens) with all their data. "
              "Add --yes to do it, or give an older revision to keep the data.", file=sys.stderr)
        return 2
    check_connection(engine)
    try:
        if args.db_command == "upgrade":
            migrations.upgrade(url, args.revision)
        elif args.db_command == "downgrade":
            migrations.downgrade(url, args.revision)
    except CommandError as error:  # Alembic's word for a revision it cannot reach from here
        engine.dispose()
        print(f"pasto: error: pasto db {args.db_command} --revision {args.revision}: {error}.", file=sys.stderr)
        return 2
    current = migrations.current_revision(engine) or "none (never migrated)"
    print(f"{shown}: schema revision {current} (newest {migrations.head_revision()})")
    engine.dispose()
    return 0


def _create_token(app: Flask, role: str, name: str) -> int:
    from .auth import create_token
    from .db import get_db

    with get_db(app).write() as session:
        token = create_token(session, role, name)
    print(token)
    return 0


def _wait_for_signal() -> None:
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    while not stop.wait(3600):
        pass


def _worker(app: Flask) -> int:
    from .scheduler import start_scheduler

    scheduler = start_scheduler(app)
    logging.getLogger(__name__).info("pasto worker: closing due rounds every %s s", app.config["PASTO_SCHEDULER_INTERVAL"])
    try:
        _wait_for_signal()
    finally:
        scheduler.shutdown(wait=True)
    return 0


def _exit_on_signal(signum, _frame) -> None:
    raise SystemExit(0)


def _terminate_on_stdin_eof() -> None:
    """Read standard input until end of file, then SIGTERM this process (an orderly shutdown).

    The kernel closes a pipe's write end when its last holder exits, even by SIGKILL, so a parent
    holding it takes this process down with it, on Linux and macOS alike (prctl(PR_SET_PDEATHSIG)
    would be Linux-only).
    """
    # os.read on the descriptor, not sys.stdin: a thread blocked in a buffered read holds the
    # buffer's lock, and interpreter shutdown after a plain SIGTERM would abort waiting for it.
    try:
        while os.read(0, 65536):
            pass  # nobody is meant to write; anything written is ignored
    except OSError:
        pass  # no standard input at all counts as its end
    os.kill(os.getpid(), signal.SIGTERM)


def _serve(app: Flask, host: str, port: int, threads: int, scheduler: bool,
           stop_on_stdin_eof: bool = False) -> int:
    from waitress import create_server

    from . import freeze_startup_heap
    from .scheduler import start_scheduler

    try:
        server = create_server(app, host=host, port=port, threads=threads)
    except OSError as error:  # most often: the port is taken (another `pasto serve` or `pasto demo`?)
        print(f"pasto: error: cannot listen on {host}:{port}: {error.strerror or error}.", file=sys.stderr)
        return 1
    background = start_scheduler(app) if scheduler else None
    print(f"pasto: serving on http://{host}:{server.effective_port}"
          f"{'' if background else ' (no scheduler: run `pasto worker`)'}", flush=True)
    # waitress's run() turns SystemExit/KeyboardInterrupt into an orderly shutdown of its threads
    # (closing the listening socket alone would wait for idle keep-alive connections to time out).
    signal.signal(signal.SIGTERM, _exit_on_signal)
    freeze_startup_heap()
    try:
        # Started inside the try: an end of file that comes at once still closes the server below.
        if stop_on_stdin_eof:
            threading.Thread(target=_terminate_on_stdin_eof, name="stdin-eof", daemon=True).start()
        server.run()
    finally:
        server.close()
        if background is not None:
            background.shutdown(wait=True)
    return 0
