"""``pasto demo``: the whole system on one machine, with synthetic traffic.

1. Migrates the database (SQLite in the instance folder unless ``PASTO_DATABASE_URL`` says otherwise)
   and makes sure an admin and a read token exist (kept in ``demo-tokens.json`` in the instance
   folder, readable by the owner only, so a second run reuses them).
2. Starts ``pasto serve`` (waitress and the round scheduler) as a child process.
3. Creates the demo experiment, or resumes it: a recommender with 20 ranking blends (weights on
   watch time, likes and shares), watch time as the primary metric and two guardrails, like rate
   (absolute) and share rate (relative to the production blend). The true means are built so that
   a mixture of two blends strictly beats every single blend; this is checked with
   :func:`pasto.optimum.best_mixture` / :func:`pasto.optimum.best_single` at startup.
4. Generates traffic through :mod:`pasto.client` exactly as a recommender would: a
   :class:`~pasto.client.LocalAssigner` picks each session's blend locally and an
   :class:`~pasto.client.ObservationBuffer` reports the session's metrics over the HTTP API.

Ctrl-C (or SIGTERM, or SIGHUP from a closed terminal) stops the traffic, flushes the buffer, then
stops the server and its scheduler; if the demo dies without doing so, the server notices that its
stdin pipe closed and stops itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import webbrowser
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pasto.algorithm import AlgorithmConfig
from pasto_client import Client, LocalAssigner, ObservationBuffer, PastoAPIError, PastoConnectionError
from pasto.objectives import Objective
from pasto.optimum import best_mixture, best_single

log = logging.getLogger("pasto.demo")

EXPERIMENT = "demo-ranking"
METRICS = ("watch_time", "like_rate", "share_rate")
ITEMS_PER_SESSION = 20
N_BLENDS = 20
PRODUCTION_BLEND = 10
TOKENS_FILE = "demo-tokens.json"
# The default preset re-solves max f(V p) every 5 rounds and takes plain EG steps in between; those
# steps follow the gradient at the served mixture (exploration included), which here swings the
# deployed mixture from the optimum (5.14 minutes, like rate 0.060) to about 4.5-4.7 minutes and a
# like rate of 0.075 for the 4 rounds out of 5 without a solve. Solving every round (20 arms: a few
# milliseconds) keeps the deployed mixture at the hedged optimum each round.
ALGORITHM = {"preset": "default", "solve_every": 1}


# ------------------------------------------------------------------------------------ scenario
@dataclass(frozen=True)
class Scenario:
    """The demo's ground truth: arms, objective and the true per-session means.

    Blend k puts weight t_k on watch time and 1 - t_k on likes and shares (70/30). Compromise
    blends dilute both effects (the means are convex in t), so no single blend is good at watch
    time and likes at once, while randomising between an engagement blend and a social blend is:
    the situation where a mixture strictly beats every single setting.
    """

    arms: tuple[dict, ...]
    objective_spec: dict
    means: np.ndarray  # (M, K) true mean of each metric per arm, rows in METRICS order

    @property
    def arm_names(self) -> list[str]:
        return [arm["name"] for arm in self.arms]

    def objective(self) -> Objective:
        return Objective.from_spec(list(METRICS), self.objective_spec, arm_names=self.arm_names)


def build_scenario() -> Scenario:
    t = np.linspace(0.0, 1.0, N_BLENDS)
    arms = tuple(
        {"name": f"blend-{k:02d}",
         "params": {"w_watch": round(float(t[k]), 4), "w_like": round(0.7 * (1 - float(t[k])), 4),
                    "w_share": round(0.3 * (1 - float(t[k])), 4)}}
        for k in range(N_BLENDS)
    )
    means = np.stack([
        4.0 + 2.0 * t**2,               # watch_time: minutes per session
        0.03 + 0.07 * (1 - t) ** 2,     # like_rate: share of the session's items liked
        0.010 + 0.006 * (1 - t) ** 2,   # share_rate: share of the session's items shared
    ])
    objective_spec = {
        "primary": "watch_time",
        "guardrails": [
            # A like-rate shortfall of 0.001 costs 1 minute of watch time. The penalty is soft: the
            # optimum falls short by (watch time gained per unit of like rate) / (2 lambda), here
            # 28.6 / 2e6 = 0.000014, i.e. 0.0600 to four places, and the default preset, which
            # hedges against its estimates' uncertainty, deploys mixtures a little above that. With
            # lambda = 20,000 the optimum sat at 0.0593 and the dashboard showed "violated".
            {"metric": "like_rate", "threshold": 0.06, "penalty": 1_000_000.0},
            # At most 5% fewer shares than the production blend.
            {"metric": "share_rate", "threshold": -0.05, "penalty": 50000.0,
             "relative_to": arms[PRODUCTION_BLEND]["name"]},
        ],
    }
    return Scenario(arms=arms, objective_spec=objective_spec, means=means)


# The soft penalties let the optimum fall short of a guardrail by a little (see build_scenario); the
# demo's story needs that shortfall to be invisible next to the threshold.
GUARDRAIL_SLACK = 1e-3  # largest shortfall at the optimum, relative to the threshold


@dataclass(frozen=True)
class Solution:
    """The true problem solved: the best mixture and the best single blend."""

    mixture: np.ndarray  # (K,)
    mixture_value: float
    single: int
    single_value: float
    guarded: np.ndarray  # (G,) the mixture's guarded metrics
    thresholds: np.ndarray  # (G,) their resolved thresholds


def check_scenario(scenario: Scenario) -> Solution:
    """Solve the true problem; raise unless the best mixture strictly beats every single blend and
    keeps every guardrail to within ``GUARDRAIL_SLACK`` of its threshold."""
    objective = scenario.objective()
    mixture, mixture_value = best_mixture(objective, scenario.means)
    single, single_value = best_single(objective, scenario.means)
    solution = Solution(mixture=mixture, mixture_value=float(mixture_value), single=int(single),
                        single_value=float(single_value),
                        guarded=scenario.means[objective.guardrail_rows] @ mixture,
                        thresholds=objective.thresholds(scenario.means))
    if not solution.mixture_value > solution.single_value + 1e-6:
        raise RuntimeError(
            f"The demo scenario is broken: the best mixture ({mixture_value:.4f}) does not beat the "
            f"best single blend ({single_value:.4f})."
        )
    for guardrail, value, threshold in zip(objective.guardrails, solution.guarded, solution.thresholds):
        if value < threshold - GUARDRAIL_SLACK * abs(threshold):
            raise RuntimeError(
                f"The demo scenario is broken: the best mixture has {guardrail.metric} {value:.6f}, "
                f"below its guardrail {threshold:.6f}; raise the penalty."
            )
    return solution


def simulate_session(scenario: Scenario, arm_index: int, rng: np.random.Generator) -> dict[str, float]:
    """One session's metrics on blend ``arm_index``: gamma watch time (coefficient of variation
    0.5), binomial likes and shares over the session's items."""
    watch, like, share = scenario.means[:, arm_index]
    return {
        "watch_time": float(rng.gamma(4.0, watch / 4.0)),
        "like_rate": float(rng.binomial(ITEMS_PER_SESSION, like)) / ITEMS_PER_SESSION,
        "share_rate": float(rng.binomial(ITEMS_PER_SESSION, share)) / ITEMS_PER_SESSION,
    }


# ------------------------------------------------------------------------------------ setup
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


def prepare_database(instance: Path | None) -> tuple[str, Path, str, str]:
    """Migrate the database and ensure the demo's tokens; returns (database URL, instance folder,
    admin token, read token)."""
    import migrations
    from . import create_app
    from .db import check_connection, get_db

    overrides: dict = {"PASTO_CHECK_SCHEMA": False}
    if instance is not None and not os.environ.get("PASTO_DATABASE_URL"):
        overrides["PASTO_DATABASE_URL"] = f"sqlite:///{instance.resolve() / 'pasto.sqlite'}"
    app = create_app(overrides)
    folder = (instance or Path(app.instance_path)).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    engine = get_db(app).engine
    url = engine.url.render_as_string(hide_password=False)
    check_connection(engine)
    migrations.upgrade(url)
    admin_token, read_token = _ensure_tokens(app, folder / TOKENS_FILE)
    engine.dispose()
    return url, folder, admin_token, read_token


def _ensure_tokens(app, path: Path) -> tuple[str, str]:
    """Reuse the tokens saved by a previous run when the database still knows them."""
    import sqlalchemy as sa

    from .auth import create_token, hash_token
    from .db import get_db
    from .models import Token

    database = get_db(app)
    saved: dict[str, str] = {}
    if path.exists():
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            saved = {}
    tokens: dict[str, str] = {}
    with database.write() as session:
        for role in ("admin", "read"):
            token = saved.get(role)
            known = token is not None and session.execute(
                sa.select(Token.role).where(Token.token_hash == hash_token(token))
            ).scalar_one_or_none() == role
            tokens[role] = token if known else create_token(session, role, f"pasto demo ({role})")
    if tokens != saved:
        path.touch(mode=0o600, exist_ok=True)
        path.chmod(0o600)
        path.write_text(json.dumps(tokens, indent=2) + "\n")
    return tokens["admin"], tokens["read"]


class ServerProcess:
    """``pasto serve`` with its scheduler, in its own session so that a terminal's Ctrl-C reaches
    only the demo, which stops the server after flushing the traffic it already produced.

    Its standard input is a pipe the demo never writes to, and the server runs with
    ``--stop-on-stdin-eof``: if the demo dies without stopping it (SIGKILL, a crash), the kernel
    closes the pipe and the server shuts down instead of holding the port.
    """

    def __init__(self, database_url: str, port: int, log_path: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        # Rounds close within a quarter second of their end unless the environment says otherwise.
        env = {"PASTO_SCHEDULER_INTERVAL": "0.25", **os.environ, "PASTO_DATABASE_URL": database_url}
        with open(log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pasto.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                 "--stop-on-stdin-eof"],
                env=env, stdin=subprocess.PIPE, stdout=log_file, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        log.info("Started pasto serve (pid %d).", self.process.pid)

    def wait_until_ready(self, client: Client, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"pasto serve exited with status {self.process.returncode}:\n"
                                   f"{self._log_tail()}")
            try:
                client.health()
                return
            except PastoAPIError:
                return  # it answers (an unhealthy /healthz is still an answer)
            except PastoConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"pasto serve did not answer within {timeout:.0f} s:\n{self._log_tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process.stdin.close()
        if self.process.returncode != 0:
            log.warning("pasto serve exited with status %s; its log: %s", self.process.returncode, self.log_path)

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return "(no server log)"


def _same_settings(experiment: dict, scenario: Scenario) -> bool:
    """Whether ``experiment`` (as the API returns it) has the objective and algorithm this demo creates."""
    overrides = dict(ALGORITHM)
    preset = overrides.pop("preset")
    algorithm = {"preset": preset, **AlgorithmConfig.from_preset(preset, **overrides).to_dict()}
    return experiment["objective"] == scenario.objective().to_spec() and experiment["algorithm"] == algorithm


def ensure_experiment(client: Client, scenario: Scenario, round_seconds: float) -> str:
    """Create the demo experiment, resume it if paused, or start a new one if it was stopped or made
    with other settings by an earlier demo."""
    name = EXPERIMENT
    for attempt in range(1, 1000):
        try:
            experiment = client.get_experiment(name)
        except PastoAPIError as error:
            if error.status != 404:
                raise
            client.create_experiment(
                name=name, arms=scenario.arms, metrics=METRICS, objective=scenario.objective_spec,
                round_seconds=round_seconds, algorithm=ALGORITHM,
            )
            log.info("Created experiment %r (%d blends, %.0f s rounds).", name, len(scenario.arms), round_seconds)
            return name
        if experiment["status"] == "stopped":
            name = f"{EXPERIMENT}-{attempt + 1}"
            continue
        if [arm["name"] for arm in experiment["arms"]] != scenario.arm_names:
            raise RuntimeError(f"An experiment named {name!r} exists but is not the demo's; "
                               "use another --instance folder or database.")
        if not _same_settings(experiment, scenario):
            # Made by an earlier version of the demo (its like-rate penalty once put the optimum
            # past the guardrail): resuming it would show the old story, so it is left paused.
            if experiment["status"] == "running":
                client.pause(name)
            following = f"{EXPERIMENT}-{attempt + 1}"
            log.info("Experiment %r has an earlier demo's objective or algorithm; it stays paused and "
                     "the demo uses %r.", name, following)
            name = following
            continue
        if experiment["status"] == "paused":
            client.resume(name)
        if experiment["round_seconds"] != round_seconds:
            log.info("Resuming %r with its own %.0f s rounds.", name, experiment["round_seconds"])
        log.info("Resuming experiment %r at round %d.", name, experiment["round"]["index"])
        return name
    raise RuntimeError("Too many stopped demo experiments; use a fresh --instance folder.")


# ------------------------------------------------------------------------------------ traffic
class _Stop(Exception):
    """SIGTERM or SIGHUP arrived: leave the traffic loop and clean up like Ctrl-C."""


def _raise_stop(*_: object) -> None:
    # Only the first signal stops the demo: a closing terminal may send SIGHUP more than once, and a
    # second _Stop raised in the middle of the flush or of stopping the server would cut them short.
    for signum in _STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    raise _Stop()


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@dataclass
class TrafficStats:
    sessions: int = 0


def run_traffic(client: Client, name: str, scenario: Scenario, args: argparse.Namespace,
                stats: TrafficStats) -> None:
    """Send synthetic sessions until ``args.rounds`` rounds have closed or the demo is interrupted
    (the buffer is flushed either way); ``stats`` counts the sessions reported."""
    rng = np.random.default_rng(args.seed)
    arm_index = {arm_name: k for k, arm_name in enumerate(scenario.arm_names)}
    objective = scenario.objective()
    thresholds = objective.thresholds(scenario.means)
    _, single_value = best_single(objective, scenario.means)
    # On a terminal, each round overwrites the previous line (carriage return, no newline);
    # anywhere else (a file, a pipe, --headless) one line per round, so a log stays readable.
    overwrite = not args.headless and sys.stdout.isatty()
    tick = 0.05
    per_tick = args.sessions_per_second * tick
    carry = 0.0
    with LocalAssigner(client, name, ttl=30.0, round_poll=0.1) as assigner, \
            ObservationBuffer(client, name, max_batch=2000, flush_interval=0.5, max_queue=200_000) as buffer:
        first_round = assigner.round_index
        shown_round = first_round
        next_tick = time.monotonic()
        while True:
            # Reported before the stop test, so that the round whose close ends the demo is shown.
            current_round = assigner.round_index
            if current_round != shown_round:
                shown_round = current_round
                _report_round(client, name, shown_round, objective, scenario, thresholds, overwrite,
                              single_value)
            if args.rounds is not None and shown_round >= first_round + args.rounds:
                break
            carry += per_tick
            batch, carry = int(carry), carry - int(carry)
            for _ in range(batch):
                unit = f"user-{int(rng.integers(10**9))}"
                assignment = assigner.assign(unit)
                values = simulate_session(scenario, arm_index[assignment.arm], rng)
                buffer.add(unit, assignment.round, values, arm=assignment.arm)
            stats.sessions += batch
            next_tick += tick
            time.sleep(max(0.0, next_tick - time.monotonic()))
        if overwrite and shown_round != first_round:
            print(flush=True)  # end the overwritten line before the closing messages
        log.info("Flushing %d pending observations.", buffer.pending)


def _report_round(client: Client, name: str, round_index: int, objective: Objective, scenario: Scenario,
                  thresholds: np.ndarray, overwrite: bool, single_value: float) -> None:
    """One line per round: the deployed mixture's true value against the best single blend."""
    try:
        experiment = client.get_experiment(name)
    except (PastoAPIError, PastoConnectionError) as error:
        log.warning("Could not read the experiment: %s", error)
        return
    deployed = np.asarray(experiment["deployed"])
    true_value = float(objective.mixture_value(scenario.means, deployed, thresholds))
    top = np.argsort(deployed)[::-1][:2]
    mix = ", ".join(f"{scenario.arm_names[k]} {deployed[k]:.2f}" for k in top)
    _print_round_line(f"round {round_index:4d}: deployed [{mix}]  true objective {true_value:.3f} "
                      f"(best single blend {single_value:.3f})", overwrite)


def _print_round_line(line: str, overwrite: bool) -> None:
    if overwrite:
        print(f"\r{line}", end="", flush=True)
    else:
        print(line, flush=True)


# ------------------------------------------------------------------------------------ main
def _has_graphical_browser() -> bool:
    # Without a display, webbrowser may pick a console browser (lynx, w3m) and take the terminal.
    return sys.platform in ("darwin", "win32") or bool(
        os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")
    )


def _say_while_stopping(text: str) -> None:
    """Print a message of the shutdown; after SIGHUP the terminal may be gone (writes fail with
    EIO), which must not turn a clean stop into a traceback."""
    try:
        print(text, flush=True)
    except OSError:
        sys.stdout = open(os.devnull, "w")  # later messages and the flush at exit go nowhere


def _port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _validate(args, parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("alembic", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    if _port_in_use(args.port):
        print(f"pasto demo: error: port {args.port} on 127.0.0.1 is already in use (another `pasto demo` "
              "or server?); choose another with --port.", file=sys.stderr)
        return 1
    from .config import ConfigurationError
    from .db import DatabaseUnreachable

    try:
        database_url, folder, admin_token, read_token = prepare_database(args.instance)
    except (ConfigurationError, DatabaseUnreachable) as error:  # as `pasto serve` reports them
        print(f"pasto demo: error: {error}", file=sys.stderr)
        return 1
    server = ServerProcess(database_url, args.port, folder / "demo-server.log")
    # A closed terminal sends SIGHUP, whose default action would kill the demo before it stops the
    # server. A signal ignored on entry stays ignored: under nohup the demo keeps running, as asked.
    previous_handlers = {signum: signal.getsignal(signum) for signum in _STOP_SIGNALS}
    for signum, previous in previous_handlers.items():
        if previous is not signal.SIG_IGN:
            signal.signal(signum, _raise_stop)
    stats = TrafficStats()
    try:
        # Solved while the server boots.
        scenario = build_scenario()
        solution = check_scenario(scenario)
        support = ", ".join(f"{scenario.arm_names[k]} {solution.mixture[k]:.2f}"
                            for k in np.flatnonzero(solution.mixture > 0.01))
        guardrails = ", ".join(
            f"{guardrail.metric} {value:.4f} (threshold {threshold:.4f})"
            for guardrail, value, threshold in zip(scenario.objective().guardrails, solution.guarded,
                                                   solution.thresholds)
        )
        print(f"Demo scenario: best single blend {scenario.arm_names[solution.single]} scores "
              f"{solution.single_value:.3f}; the best mixture [{support}] scores {solution.mixture_value:.3f} "
              f"(+{solution.mixture_value - solution.single_value:.3f}) with {guardrails}.", flush=True)
        with Client(server.url, admin_token) as client:
            server.wait_until_ready(client)
            name = ensure_experiment(client, scenario, args.round_seconds)
            dashboard = f"{server.url}/"
            print(f"Dashboard: {dashboard}  (read token: {read_token})\n"
                  f"Experiment page: {server.url}/experiments/{name}\n"
                  f"Server log: {server.log_path}\nPress Ctrl-C to stop.", flush=True)
            if not args.headless and _has_graphical_browser():
                webbrowser.open(dashboard)
            run_traffic(client, name, scenario, args, stats)
    except (KeyboardInterrupt, _Stop):
        _say_while_stopping("\nStopping...")
    except (RuntimeError, PastoAPIError, PastoConnectionError) as error:
        print(f"pasto demo: error: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        server.stop()
        for signum, previous in previous_handlers.items():
            if previous is not None:  # None: set outside Python, which cannot be restored from here
                signal.signal(signum, previous)
    _say_while_stopping(f"Stopped after {stats.sessions:,} sessions; run `pasto demo` again to resume.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
