"""What the demo prints: the scenario at startup, where to look, one line per round, the goodbye.

On a terminal each round overwrites the previous line (carriage return, no newline); anywhere else
(a file, a pipe, ``--headless``) every round gets its own line, so a log stays readable.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from pathlib import Path
from urllib.parse import urlencode

import numpy as np

from pasto.objectives import Objective
from pasto.scenario import Scenario
from pasto_client import Client, PastoAPIError, PastoConnectionError

from .groundtruth import Solution, arm_names, experiment_objective
from .supervise import StopRequested

log = logging.getLogger("pasto.demo")


def print_scenario(scenario: Scenario, solution: Solution) -> None:
    """The true problem: the best single blend against the best mixture and its guarded metrics."""
    names = arm_names(scenario)
    support = ", ".join(f"{names[k]} {solution.mixture[k]:.2f}"
                        for k in np.flatnonzero(solution.mixture > 0.01))
    guardrails = ", ".join(
        f"{guardrail.metric} {value:.4f} (threshold {threshold:.4f})"
        for guardrail, value, threshold in zip(experiment_objective(scenario).guardrails, solution.guarded,
                                               solution.thresholds)
    )
    print(f"Demo scenario: best single blend {names[solution.single]} scores "
          f"{solution.single_value:.3f}; the best mixture [{support}] scores {solution.mixture_value:.3f} "
          f"(+{solution.mixture_value - solution.single_value:.3f}) with {guardrails}.", flush=True)


def sign_in_url(server_url: str, read_token: str) -> str:
    """The dashboard's address with the read token in the fragment, which the page's script stores
    as its token dialog would and then removes from the address bar; a fragment is never sent to
    the server, so the token stays out of its logs."""
    return f"{server_url}/#{urlencode({'token': read_token})}"


def tokens_command(database_url: str, role: str) -> str:
    """The exact ``pasto tokens create`` command that makes a ``role`` token in the demo's database.

    A database given in the environment is named as such, not printed: its URL may hold a password.
    """
    script = Path(sys.executable).with_name("pasto")
    if script.exists():
        relative = os.path.relpath(script)
        program = relative if not relative.startswith("..") else str(script)
    else:
        program = "pasto"
    command = f"{shlex.quote(program)} tokens create --role {role}"
    if os.environ.get("PASTO_DATABASE_URL"):
        return command
    return f"PASTO_DATABASE_URL={shlex.quote(database_url)} {command}"


def print_where_to_look(server_url: str, port: int, read_token: str, database_url: str, server_log: str) -> str:
    """One line with the signed-in dashboard address (returned), then where the server listens, how to
    get admin and ingest tokens for the same database, the server log and how to stop."""
    dashboard = sign_in_url(server_url, read_token)
    same_environment = " (with the same PASTO_DATABASE_URL)" if os.environ.get("PASTO_DATABASE_URL") else ""
    print(f"Dashboard, signed in with the demo's read token: {dashboard}\n"
          f"  The server listens on 127.0.0.1, port {port} (choose another with --port, or `make run PORT=...`).\n"
          f"  Admin and ingest tokens for this database{same_environment}, to use the API beside the demo:\n"
          f"    {tokens_command(database_url, 'admin')}\n"
          f"    {tokens_command(database_url, 'ingest')}\n"
          f"  Server log: {server_log}\n"
          f"Press Ctrl-C to stop.", flush=True)
    return dashboard


def report_round(client: Client, name: str, round_index: int, objective: Objective, means: np.ndarray,
                 names: list[str], overwrite: bool, single_value: float) -> None:
    """One line per round: the deployed mixture's true value against the best single blend."""
    try:
        experiment = client.get_experiment(name)
    except (PastoAPIError, PastoConnectionError) as error:
        log.warning("Could not read the experiment: %s", error)
        return
    _print_round_line(_round_line(round_index, np.asarray(experiment["deployed"]), objective, means, names,
                                  single_value), overwrite)


def report_past_rounds(client: Client, name: str, first_index: int, last_index: int, objective: Objective,
                       means: np.ndarray, names: list[str], overwrite: bool, single_value: float) -> None:
    """The lines of rounds ``first_index`` to ``last_index`` that closed between two looks at the round
    index (a loaded machine can stall the traffic loop for longer than a round): each round still gets
    its line, with the mixture deployed after the round before it, read from the rounds history."""
    try:
        history = client.rounds(name, since=first_index - 1, limit=last_index - first_index + 1)
    except (PastoAPIError, PastoConnectionError) as error:
        log.warning("Could not read the rounds: %s", error)
        return
    for entry in history:
        if entry["deployed"] is not None:  # None only before the round's update has run
            _print_round_line(_round_line(entry["index"] + 1, np.asarray(entry["deployed"]), objective, means,
                                          names, single_value), overwrite)


def _round_line(round_index: int, deployed: np.ndarray, objective: Objective, means: np.ndarray,
                names: list[str], single_value: float) -> str:
    true_value = float(objective.mixture_value(means, deployed, objective.thresholds(means)))
    top = np.argsort(deployed)[::-1][:2]
    mix = ", ".join(f"{names[k]} {deployed[k]:.2f}" for k in top)
    return (f"round {round_index:4d}: deployed [{mix}]  true objective {true_value:.3f} "
            f"(best single blend {single_value:.3f})")


def _print_round_line(line: str, overwrite: bool) -> None:
    try:
        if overwrite:
            print(f"\r{line}", end="", flush=True)
        else:
            print(line, flush=True)
    except OSError as error:
        # The terminal went away (EIO) and its SIGHUP has not arrived yet, or never will: stop as the
        # SIGHUP would have, instead of dying with a traceback and leaving the server running.
        sys.stdout = open(os.devnull, "w")
        raise StopRequested("The terminal went away.") from error


def end_overwritten_line() -> None:
    """A newline after the last overwritten round line, before the closing messages."""
    print(flush=True)


def rounds_overwrite_one_line(headless: bool) -> bool:
    return not headless and sys.stdout.isatty()


def has_graphical_browser() -> bool:
    # Without a display, webbrowser may pick a console browser (lynx, w3m) and take the terminal.
    return sys.platform in ("darwin", "win32") or bool(
        os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")
    )


def say_while_stopping(text: str) -> None:
    """Print a message of the shutdown; after SIGHUP the terminal may be gone (writes fail with
    EIO), which must not turn a clean stop into a traceback."""
    try:
        print(text, flush=True)
    except OSError:
        sys.stdout = open(os.devnull, "w")  # later messages and the flush at exit go nowhere
