"""Service commands of ``pasto``: ``serve``, ``worker``, ``db upgrade|downgrade|current``,
``tokens create|list|revoke|rotate``, ``demo``.

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
    "tokens": "API tokens: create, list, revoke, rotate",
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
    create.add_argument("--role", required=True, choices=("metrics", "read", "ingest", "admin"),
                        help="metrics: scrape /metrics only; read: every GET; ingest: assign and observe; "
                             "admin: everything")
    create.add_argument("--name", default="", help="what the token is for (default: the role)")
    create.add_argument("--expires-in", type=_duration, default=None, metavar="DURATION",
                        help="refuse the token after this long: seconds, or a number with s, m, h or d "
                             "(e.g. 90d); default: it does not expire")
    token_commands.add_parser("list", help="list the tokens (id, name, role, created, expires, revoked); "
                                           "never the tokens themselves")
    revoke = token_commands.add_parser("revoke", help="revoke tokens: refused by every worker within 1 s")
    revoke.add_argument("token", metavar="ID_OR_NAME", help="a token id, or a name (every usable token of it)")
    rotate = token_commands.add_parser("rotate", help="print a new token with the name, role and lifetime of "
                                                      "an old one, and revoke the old one")
    rotate.add_argument("token", metavar="ID_OR_NAME", help="a token id, or a name that one usable token has")
    rotate.add_argument("--grace", type=_duration, default=0.0, metavar="DURATION",
                        help="let the old token work this much longer (time to deploy the new one); "
                             "default: revoked at once")
    return parser


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``12h``, ``90d`` -> seconds (argparse type)."""
    number, unit = (text[:-1], text[-1]) if text[-1:].lower() in _DURATION_UNITS else (text, "s")
    try:
        seconds = float(number) * _DURATION_UNITS[unit.lower()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: use seconds or a number with s, m, h or d.")
    if not (0 <= seconds < 100 * 365 * 86400):
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration between 0 and 100 years.")
    return seconds


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
    from . import SchemaOutOfDate, create_app, create_command_app
    from .config import ConfigurationError
    from .db import DatabaseUnreachable

    # What an operator can fix (a setting, the database's address, a migration to run) is one line on
    # stderr; anything else raised here is a bug and keeps its traceback.
    try:
        if args.command == "db":
            return _db(args, create_command_app)
        app = create_command_app() if args.command == "tokens" else create_app()
    except (ConfigurationError, DatabaseUnreachable, SchemaOutOfDate) as error:
        print(f"pasto: error: {error}", file=sys.stderr)
        return 1
    if args.command == "tokens":
        return _tokens(app, args)
    if args.command == "worker":
        return _worker(app)
    return _serve(app, args.host, args.port, args.threads, scheduler=not args.no_scheduler,
                  stop_on_stdin_eof=args.stop_on_stdin_eof)


def _db(args: argparse.Namespace, create_command_app) -> int:
    from alembic.util import CommandError

    from . import migrations_package
    from .config import warn_if_weak_admin_token
    from .db import check_connection, get_db

    migrations = migrations_package()

    # The database alone, not the whole service: Alembic needs the URL and the engine. The two settings
    # create_app checks beyond the configuration's own are checked as it checks them, so that `pasto db`
    # refuses and warns exactly as before.
    app = create_command_app({"PASTO_CHECK_SCHEMA": False}, unit_of_work=False)
    warn_if_weak_admin_token(app.config.get("PASTO_ADMIN_TOKEN"), logging.getLogger(f"{__package__}.auth"))
    if app.config.get("PASTO_EXPOSURE_LOG"):
        from .exposures import check_setting

        check_setting(app.config["PASTO_EXPOSURE_LOG"])
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


def _tokens(app: Flask, args: argparse.Namespace) -> int:
    """``pasto tokens create|list|revoke|rotate``."""
    from . import store
    from .bootstrap import get_uow
    from .models import utcnow

    def shown(moment) -> str:
        return "-" if moment is None else moment.isoformat(timespec="seconds").replace("+00:00", "Z")

    uow = get_uow(app)
    if args.tokens_command == "create":
        if args.expires_in is not None and args.expires_in <= 0:
            print("pasto: error: --expires-in must be longer than 0 s.", file=sys.stderr)
            return 2
        with uow.write() as session:
            token = store.create_token(session, args.role, args.name or args.role, args.expires_in)
        print(token)
        return 0
    if args.tokens_command == "list":
        now = utcnow()
        with uow.read() as session:
            rows = store.all_tokens(session)
        print(f"{'id':>5}  {'name':<24} {'role':<7} {'created':<21} {'expires':<21} {'revoked':<21} state")
        for row in rows:
            state = ("revoked" if row.revoked_at is not None else
                     "expired" if row.expires_at is not None and row.expires_at <= now else "usable")
            print(f"{row.id:>5}  {row.name[:24]:<24} {row.role:<7} {shown(row.created_at):<21} "
                  f"{shown(row.expires_at):<21} {shown(row.revoked_at):<21} {state}")
        return 0
    try:
        with uow.write() as session:
            if args.tokens_command == "revoke":
                revoked = store.revoke_tokens(session, args.token)
                message = "\n".join(f"revoked token {t.id} ({t.name}, {t.role})" for t in revoked)
            else:
                token, old = store.rotate_token(session, args.token, args.grace)
                message = token
                note = (f"token {old.id} ({old.name}, {old.role}) "
                        + (f"expires at {shown(old.expires_at)}" if args.grace > 0 else "is revoked"))
    except LookupError as error:
        print(f"pasto: error: {error}", file=sys.stderr)
        return 2
    print(message)
    if args.tokens_command == "rotate":
        print(note, file=sys.stderr)
    return 0


def _ignore_further_sigterm() -> None:
    """Ignore SIGTERM from now on: an orderly shutdown is under way, and a repeated request changes nothing.

    Ignored (SIG_IGN), not handled by a Python function: interpreter shutdown resets every Python-level
    handler to the default action, so a second SIGTERM arriving in those last milliseconds (a process
    manager or test harness that repeats it, as tests/reliability's stop() does) would kill the process
    and turn an orderly exit with status 0 into death by signal (-15). SIGKILL still ends a stuck shutdown.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _stop_on_signal() -> threading.Event:
    """An event the first SIGINT or SIGTERM sets (a repeated SIGTERM is then ignored)."""
    stop = threading.Event()

    def request_stop(_signum, _frame) -> None:
        _ignore_further_sigterm()
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, request_stop)
    return stop


def _worker(app: Flask) -> int:
    from .scheduler import start_scheduler

    scheduler = start_scheduler(app)
    try:
        # The handlers before the ready line: a process manager may send SIGTERM as soon as it reads it,
        # and before them SIGTERM's default action kills the process (-15).
        stop = _stop_on_signal()
        logging.getLogger(__name__).info("pasto worker: closing due rounds every %s s",
                                         app.config["PASTO_SCHEDULER_INTERVAL"])
        while not stop.wait(3600):
            pass
    finally:
        scheduler.shutdown(wait=True)
    return 0


def _exit_on_signal(signum, _frame) -> None:
    # A second SIGTERM would otherwise raise SystemExit again in the middle of the cleanup below
    # (or, during interpreter shutdown, kill the process with -15).
    _ignore_further_sigterm()
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
    try:
        # waitress's run() turns SystemExit/KeyboardInterrupt into an orderly shutdown of its threads
        # (closing the listening socket alone would wait for idle keep-alive connections to time out).
        # Installed before the ready line: a SIGTERM sent as soon as it is read found the default
        # action and ended the process with -15 (test_repeated_sigterm_during_shutdown_still_exits_0,
        # seen once in a clean-clone run).
        signal.signal(signal.SIGTERM, _exit_on_signal)
        print(f"pasto: serving on http://{host}:{server.effective_port}"
              f"{'' if background else ' (no scheduler: run `pasto worker`)'}", flush=True)
        freeze_startup_heap()
        # Started inside the try: an end of file that comes at once still closes the server below.
        if stop_on_stdin_eof:
            threading.Thread(target=_terminate_on_stdin_eof, name="stdin-eof", daemon=True).start()
        server.run()
    finally:
        server.close()
        if background is not None:
            background.shutdown(wait=True)
    return 0
