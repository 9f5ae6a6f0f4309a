"""The ``pasto`` command.

``pasto simulate`` runs the Monte-Carlo simulator and needs only numpy and scipy. Every other
command (``serve``, ``worker``, ``db``, ``tokens``, ``demo``) belongs to the HTTP service and is
handed to ``service.cli.main`` on demand, so ``pasto simulate`` never imports the web stack.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

__all__ = ["main", "build_parser", "parse_setting", "SERVICE_COMMANDS"]

SIMULATE_HELP = "Monte-Carlo simulation of a controller on a scenario"

#: The service's commands and their one-line help. Their options are parsed by ``service.cli``; they
#: are named here too, without importing the service, so that ``pasto --help`` and an unknown
#: command list every command.
SERVICE_COMMANDS = {
    "serve": "serve the HTTP API (waitress) with the round scheduler",
    "worker": "run the round scheduler alone (no HTTP)",
    "db": "database schema: upgrade, current, downgrade (Alembic)",
    "tokens": "API tokens: create",
    "demo": "run the service with a live demo experiment and synthetic traffic",
}

_DESCRIPTION = "Learn probabilistic strategic parameters (mixtures over K settings) with PASTO."
_EPILOG = "Run `pasto COMMAND --help` for a command's options."


def parse_setting(text: str) -> tuple[str, Any]:
    """Parse ``key=value`` from ``--set``; the value is JSON when it parses as JSON, else a string."""
    key, separator, raw = text.partition("=")
    key = key.strip()
    if not separator or not key:
        raise argparse.ArgumentTypeError(f"--set expects key=value, got {text!r}.")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key, value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}.") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}.")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}.") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}.")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}.") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite non-negative number, got {text!r}.")
    return value


def build_parser() -> argparse.ArgumentParser:
    from pasto.simulate import ALGORITHMS

    parser = argparse.ArgumentParser(prog="pasto", description=_DESCRIPTION, epilog=_EPILOG)
    commands = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    simulate = commands.add_parser(
        "simulate",
        help=SIMULATE_HELP,
        description="Run many independent simulated experiments at once and report how well the "
        "deployed mixture does under the true means.",
    )
    simulate.add_argument(
        "scenario",
        help="a scenario JSON file, or the name of a packaged scenario (setup-a, setup-b)",
    )
    simulate.add_argument(
        "--algorithm", choices=ALGORITHMS, default="default",
        help="controller to simulate (default: %(default)s)",
    )
    simulate.add_argument("--runs", type=_positive_int, help="Monte-Carlo runs (default: the scenario's)")
    simulate.add_argument("--rounds", type=_positive_int, help="rounds per run (default: the scenario's)")
    simulate.add_argument("--seed", type=_non_negative_int, help="seed (default: the scenario's)")
    simulate.add_argument(
        "--noise-std", type=_positive_float, metavar="STD",
        help="replace the scenario's noise standard deviation (every metric)",
    )
    simulate.add_argument(
        "--set", dest="settings", action="append", type=parse_setting, default=[], metavar="KEY=VALUE",
        help="override a setting of the algorithm's configuration (repeatable; VALUE is JSON or a string)",
    )
    simulate.add_argument("--out", type=Path, metavar="RESULT.json", help="write the result document here")
    simulate.add_argument("--plot", type=Path, metavar="CURVE.png", help="plot the convergence curve (needs matplotlib)")
    simulate.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    for name, help_text in SERVICE_COMMANDS.items():
        # Listed only: main() hands these to service.cli before this parser sees them.
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


class _Progress:
    """A carriage-return progress line on a terminal, redrawn at most ten times a second."""

    UNITS = {"optimum": "runs' optima solved", "rounds": "rounds"}

    def __init__(self, stream: TextIO, label: str) -> None:
        self.stream = stream
        self.label = label
        self.phase = ""
        self.started = time.monotonic()
        self.last_drawn = 0.0

    def __call__(self, phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        if phase != self.phase:
            self.phase, self.started = phase, now
        elif done < total and now - self.last_drawn < 0.1:
            return
        self.last_drawn = now
        width = 30
        filled = width * done // total
        elapsed = now - self.started
        remaining = elapsed / done * (total - done) if done else 0.0
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
            f"{self.UNITS.get(phase, phase)}, {elapsed:.0f}s elapsed, ~{remaining:.0f}s left "
        )
        if done == total:
            self.stream.write("\n")
        self.stream.flush()


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib, which is not installed; install this project's plot extra: "
            "`pip install -e '.[plot]'` from the source checkout."
        ) from None
    return plt


def _plot(result, path: Path) -> None:
    import numpy as np

    plt = _pyplot()

    summary = result.summary
    rounds = np.arange(1, summary["rounds"] + 1)
    fixed = "best_mixture" in summary
    values = result.deployed_values if fixed else result.relative_gains
    figure, axes = plt.subplots(figsize=(7, 4.5))
    if fixed:
        centre = values.mean(axis=1)
        low, high = np.percentile(values, [25, 75], axis=1)
        axes.set_ylabel("f(mu p_hat): mean, 25th-75th percentile")
        axes.axhline(summary["best_mixture"], color="black", linestyle="--", label="best mixture")
        axes.axhline(summary["best_single"], color="grey", linestyle=":", label="best single arm")
    else:
        centre = np.nanmedian(values, axis=1)
        low, high = np.nanpercentile(values, [25, 75], axis=1)
        axes.set_ylabel("relative gain r: median, 25th-75th percentile")
        axes.axhline(1.0, color="black", linestyle="--", label="best mixture (r = 1)")
        axes.axhline(0.0, color="grey", linestyle=":", label="best single arm (r = 0)")
    axes.plot(rounds, centre, label=summary["algorithm"])
    axes.fill_between(rounds, low, high, alpha=0.25)
    # Scale to the later 90% of the rounds: the first few rounds can sit far below and flatten the rest.
    reference_low, reference_high = (summary["best_single"], summary["best_mixture"]) if fixed else (0.0, 1.0)
    settled = slice(len(rounds) // 10, None)
    bottom = min(reference_low, float(np.nanmin(low[settled])))
    top = max(reference_high, float(np.nanmax(high[settled])))
    margin = 0.05 * (top - bottom) or 0.05
    axes.set_ylim(bottom - margin, top + margin)
    axes.set_xlabel("round")
    axes.set_title(f"{summary['scenario']}: {summary['algorithm']}, {summary['runs']} runs")
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _simulate(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    from pasto.scenario import load_scenario
    from pasto.simulate import format_table, make_policy, simulate

    settings: dict[str, Any] = {}
    for key, value in args.settings:
        if key in settings:
            raise ValueError(f"--set {key} is given more than once.")
        settings[key] = value
    scenario = load_scenario(args.scenario).with_overrides(
        runs=args.runs, rounds=args.rounds, seed=args.seed, noise_std=args.noise_std
    )
    policy = make_policy(args.algorithm, settings)
    if args.plot is not None:
        if args.plot.suffix.lower() not in (".png", ".pdf", ".svg"):
            raise ValueError(f"--plot {args.plot} must end in .png, .pdf or .svg.")
        _pyplot()  # fail before a long simulation, not after it
    for option, path in (("--out", args.out), ("--plot", args.plot)):
        if path is not None and not path.resolve().parent.is_dir():
            raise ValueError(f"{option} {path}: the directory {path.resolve().parent} does not exist.")
    # Long runs only: many run-rounds, or an optimum to solve per run.
    long_run = scenario.runs * scenario.rounds >= 100_000 or not scenario.fixed_means
    show_progress = not args.quiet and stderr.isatty() and long_run
    progress = _Progress(stderr, f"{scenario.name}/{policy.name}") if show_progress else None
    result = simulate(scenario, policy, progress=progress)
    stdout.write(format_table(result.summary) + "\n")
    if args.out is not None:
        args.out.write_text(result.to_json() + "\n", encoding="utf-8")
        stdout.write(f"wrote {args.out}\n")
    if args.plot is not None:
        _plot(result, args.plot)
        stdout.write(f"wrote {args.plot}\n")
    return 0


def _service(argv: list[str], stderr: TextIO) -> int:
    try:
        from service.cli import main as service_main
    except ModuleNotFoundError as error:
        if error.name in ("service", "service.cli"):
            stderr.write(
                f"pasto: error: the command {argv[0]!r} belongs to the pasto service, whose module "
                "service.cli is not installed here; `pasto simulate` works without it.\n"
            )
            return 2
        stderr.write(
            f"pasto: error: the command {argv[0]!r} needs the Python package {error.name!r}, "
            "which is not installed; reinstall this project with `pip install -e .` from the source "
            "checkout.\n"
        )
        return 2
    return service_main(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pasto`` command; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SERVICE_COMMANDS:
        return _service(argv, sys.stderr)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return _simulate(args, sys.stdout, sys.stderr)
    except ValueError as error:
        sys.stderr.write(f"pasto simulate: error: {error}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("\npasto simulate: interrupted.\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
