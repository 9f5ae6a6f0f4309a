"""The ``pasto`` command, and the only module of ``pasto`` that reads or writes files.

``pasto simulate`` runs the Monte-Carlo simulator and needs only numpy and scipy. Other commands are
discovered through the entry-point group ``pasto.commands`` (the service declares ``serve``, ``worker``,
``db``, ``tokens`` and ``demo`` in pyproject.toml), so this core module imports nothing outside
``pasto``: the dependency points from the service to the core, never back. An entry point names an
object with a one-line ``help`` string that is called with the command's arguments (the words after
its name) and returns the exit status. It is loaded only to run its command or to describe it in
``pasto --help``, so ``pasto simulate`` never imports the web stack, and a command whose
dependencies are not installed (the client alone, without the ``service`` extra) says in one line
what to install.

The core's scenario parser takes a dict (``pasto.scenario.scenario_from_dict``); reading a scenario
file, or a scenario shipped in the package, is done here (:func:`load_scenario`), because file I/O in
``pasto`` belongs to this module only (tests/test_layers.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import metadata, resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from pasto.scenario import Scenario

__all__ = [
    "COMMAND_GROUP",
    "build_parser",
    "discover_commands",
    "load_scenario",
    "main",
    "packaged_scenarios",
    "parse_setting",
]

SIMULATE_HELP = "Monte-Carlo simulation of a controller on a scenario"

#: The entry-point group other packages declare their ``pasto`` commands in.
COMMAND_GROUP = "pasto.commands"

_DESCRIPTION = "Learn probabilistic strategic parameters (mixtures over K settings) with PASTO."
_EPILOG = "Run `pasto COMMAND --help` for a command's options."
#: What each ``--algorithm`` is, for ``pasto simulate --help``.
ALGORITHM_HELP = {
    "paper": "Algorithm 1 of the paper, with its settings",
    "default": "the default preset (safe serving, what the service runs)",
    "scgd": "baseline: stochastic compositional gradient descent",
    "thompson": "baseline: Thompson sampling over single arms",
}
_SIMULATE_EXAMPLE = """example:
  pasto simulate setup-a --algorithm paper --runs 1000 --plot curve.png

  runs the paper's Algorithm 1 1,000 times on setup A (two arms, a guardrail on y), prints a table of
  the deployed mixture's objective, relative gain (0 = best single arm, 1 = best mixture) and
  cumulative regret at the scenario's checkpoint rounds, and draws the convergence curve."""


# --------------------------------------------------------------------------------------------------
# Scenario files


def packaged_scenarios() -> list[str]:
    """Names of the scenarios shipped with pasto (usable by name in :func:`load_scenario`)."""
    folder = resources.files("pasto") / "scenarios"
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def load_scenario(name_or_path: str | Path) -> Scenario:
    """Read and validate a scenario from a file path or by the name of a packaged scenario.

    Parameters
    ----------
    name_or_path : str or Path
        A path to a JSON file, or a packaged name such as ``"setup-a"`` (``.json`` optional).

    Raises
    ------
    ValueError
        If the file is missing, is not JSON, or fails validation (the message names the key).
    """
    path = Path(name_or_path)
    if path.is_file():
        text = path.read_text(encoding="utf-8")
        source = str(path)
    else:
        name = path.name[: -len(".json")] if path.name.endswith(".json") else path.name
        packaged = packaged_scenarios()
        if str(name_or_path) not in (name, name + ".json") or name not in packaged:
            raise ValueError(
                f"No scenario file {str(name_or_path)!r} and no packaged scenario of that name; "
                f"packaged scenarios: {', '.join(packaged)}."
            )
        text = (resources.files("pasto") / "scenarios" / f"{name}.json").read_text(encoding="utf-8")
        source = f"packaged scenario {name!r}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"The scenario in {source} is not valid JSON: {error}.") from None
    # Imported here: the service's commands (`pasto tokens`, ...) pass through this module and need no numpy.
    from pasto.scenario import scenario_from_dict

    return scenario_from_dict(data)


# --------------------------------------------------------------------------------------------------
# Commands of other packages


def discover_commands() -> dict[str, metadata.EntryPoint]:
    """The commands declared in the ``pasto.commands`` entry-point group, by name, not yet loaded.

    Sorted by name (the order of ``pasto --help``). ``simulate`` belongs to this module and cannot be
    replaced; when two installed distributions declare the same name, the first found wins.
    """
    commands: dict[str, metadata.EntryPoint] = {}
    for entry_point in metadata.entry_points(group=COMMAND_GROUP):
        if entry_point.name != "simulate":
            commands.setdefault(entry_point.name, entry_point)
    return dict(sorted(commands.items()))


def _missing_dependency_message(name: str, entry_point: metadata.EntryPoint, error: ModuleNotFoundError) -> str:
    """One line saying what to install so that the command ``name`` can run."""
    extras = list(entry_point.extras)
    distribution = entry_point.dist.name if entry_point.dist is not None else "pasto"
    if extras:
        # pasto is not on PyPI: the hint names this project's extra, installed from the checkout.
        install = (f"install {distribution} with its {extras[0]} extra: `pip install '.[{extras[0]}]'` "
                   "from the source checkout")
    else:
        install = f"reinstall {distribution}: `pip install .` from the source checkout"
    missing = error.name or ""
    module = entry_point.module
    if missing and (module == missing or module.startswith(missing + ".")):
        problem = f"comes from the module {module!r}, which is not installed"
    elif missing:
        problem = f"needs the Python package {missing!r}, which is not installed"
    else:
        problem = "needs a Python package that is not installed"
    return f"pasto: error: the command {name!r} {problem}; {install} (`pasto simulate` works without it).\n"


def _load_command(name: str, entry_point: metadata.EntryPoint, stderr: TextIO):
    """The command's object, or None after one line on ``stderr`` when its dependencies are missing."""
    try:
        return entry_point.load()
    except ModuleNotFoundError as error:
        stderr.write(_missing_dependency_message(name, entry_point, error))
        return None


def _describe(name: str, entry_point: metadata.EntryPoint) -> str:
    """The one-line help of a discovered command, for ``pasto --help`` (loads it)."""
    try:
        command = entry_point.load()
    except ModuleNotFoundError as error:
        extras = list(entry_point.extras)
        needs = f"the {extras[0]} extra" if extras else f"the package {error.name!r}"
        return f"(not installed here: needs {needs})"
    return str(getattr(command, "help", "") or "")


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


def build_parser(
    commands: dict[str, metadata.EntryPoint] | None = None, describe: bool = True
) -> argparse.ArgumentParser:
    """The parser of ``pasto``: ``simulate`` with its options, and the discovered commands by name.

    Parameters
    ----------
    commands : dict of str to EntryPoint, optional
        The discovered commands (default: :func:`discover_commands`); their options are parsed by
        their own modules, so only their names and help lines are listed here.
    describe : bool
        Load every discovered command to show its help line (``pasto --help``); False keeps
        ``pasto simulate`` from importing them.
    """
    from pasto.simulate import ALGORITHMS

    if commands is None:
        commands = discover_commands()
    parser = argparse.ArgumentParser(prog="pasto", description=_DESCRIPTION, epilog=_EPILOG)
    subparsers = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    shipped = packaged_scenarios()
    segmented = [name for name in shipped if name.startswith("segments-")]
    listing = "\n".join(
        ["shipped scenarios (by name):", *(f"  {name}" + ("  (segments: bench/segments.py runs it)" if name in segmented
                                                         else "") for name in shipped),
         "", "algorithms (--algorithm):",
         *(f"  {name:<9} {ALGORITHM_HELP.get(name, '')}" for name in ALGORITHMS)])
    simulate = subparsers.add_parser(
        "simulate",
        help=SIMULATE_HELP,
        description="Run many independent simulated experiments at once and report how well the "
        "deployed mixture does under the true means.",
        epilog=listing + "\n\n" + _SIMULATE_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    simulate.add_argument(
        "scenario",
        help="a scenario JSON file, or the name of a shipped scenario (listed below)",
    )
    simulate.add_argument(
        "--algorithm", choices=ALGORITHMS, default="default",
        help="controller to simulate (listed below; default: %(default)s)",
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
    simulate.add_argument("--quiet", action="store_true", help="no progress report on stderr")
    for name, entry_point in commands.items():
        # Listed only: main() hands these to their own module before this parser sees them.
        subparsers.add_parser(name, help=_describe(name, entry_point) if describe else None, add_help=False)
    return parser


class _Progress:
    """Progress on stderr: on a terminal, a carriage-return line redrawn at most ten times a second;
    elsewhere (a log, a pipe), one plain line at every tenth of a phase and at its end."""

    UNITS = {"optimum": "runs' optima solved", "rounds": "rounds"}

    def __init__(self, stream: TextIO, label: str, terminal: bool = True) -> None:
        self.stream = stream
        self.label = label
        self.terminal = terminal
        self.phase = ""
        self.started = time.monotonic()
        self.last_drawn = 0.0
        self.last_tenth = -1

    def __call__(self, phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        if phase != self.phase:
            self.phase, self.started, self.last_tenth = phase, now, -1
        elif self.terminal and done < total and now - self.last_drawn < 0.1:
            return
        if not self.terminal:
            tenth = 10 * done // total
            if tenth == self.last_tenth:
                return
            self.last_tenth = tenth
            elapsed = now - self.started
            remaining = elapsed / done * (total - done) if done else 0.0
            self.stream.write(f"{self.label}: {done}/{total} {self.UNITS.get(phase, phase)}, "
                              f"{elapsed:.0f}s elapsed, ~{remaining:.0f}s left\n")
            self.stream.flush()
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
    axes.plot(rounds, centre, label=f"{summary['algorithm']} ({'mean' if fixed else 'median'} over runs)")
    axes.fill_between(rounds, low, high, alpha=0.25, label="25th-75th percentile")
    # Early dips are real: round 1 deploys the uniform mixture (in setup-a already almost the optimum,
    # f = 1.0 of 1.01), and the first updates act on estimates from a few noisy observations (one per
    # round there), which push the mixture away from it, mostly towards the arm that keeps the
    # guardrail; the curve recovers as the estimates sharpen. Mark the lowest point and say so.
    lowest = int(np.nanargmin(centre))
    if 0 < lowest < len(rounds) - 1 and centre[0] - centre[lowest] > 0.05 * abs(centre[0]) + 1e-12:
        axes.plot([rounds[lowest]], [centre[lowest]], marker="v", color="C3", linestyle="none",
                  label=f"lowest: {centre[lowest]:.2f} at round {rounds[lowest]}")
    drawn = "f(mu p_hat) of the deployed mixture under the true means" if fixed else "the relative gain r"
    figure.text(0.01, 0.01, (
        f"Drawn: {drawn}, per round, over {summary['runs']} runs.\n"
        "Round 1 deploys the uniform mixture; the first updates act on estimates from few noisy observations,\n"
        "so the curve can dip before the estimates sharpen and it recovers. The y-range fits the rounds\n"
        "after the first 10%: earlier ones can fall outside it."), fontsize=7, va="bottom")
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
    figure.tight_layout(rect=(0, 0.12, 1, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _reference_line(summary: dict[str, Any], references) -> str | None:
    """For means drawn per run, the reference line the table has for fixed means: the mean over runs
    of the best single arm's and the best mixture's objective under each run's true means."""
    if "best_mixture" in summary:
        return None  # fixed means: the table has it
    single, mixture = references.best_single[0], references.best_mixture[0]
    return (f"best single arm f = {float(single.mean()):.4f}   best mixture f = {float(mixture.mean()):.4f}   "
            f"(means over the runs' drawn true means; gap {float((mixture - single).mean()):.4f})")


def _simulate(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    from pasto.simulate import draw_means, format_table, make_policy, reference_values, simulate

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
    show_progress = not args.quiet and long_run
    progress = _Progress(stderr, f"{scenario.name}/{policy.name}", terminal=stderr.isatty()) if show_progress else None
    # The references (each run's best single arm and best mixture) are computed here and handed to the
    # simulation, so the table can carry their line for drawn means too, at no extra cost.
    references = reference_values(scenario.objective(), draw_means(scenario, scenario.runs), scenario.runs, progress)
    result = simulate(scenario, policy, references=references, progress=progress)
    table = format_table(result.summary).split("\n")
    reference = _reference_line(result.summary, references)
    if reference is not None:
        table.insert(1, reference)
    stdout.write("\n".join(table) + "\n")
    if args.out is not None:
        args.out.write_text(result.to_json() + "\n", encoding="utf-8")
        stdout.write(f"wrote {args.out}\n")
    if args.plot is not None:
        _plot(result, args.plot)
        stdout.write(f"wrote {args.plot}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pasto`` command; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = discover_commands()
    if argv and argv[0] in commands:
        command = _load_command(argv[0], commands[argv[0]], sys.stderr)
        return 2 if command is None else command(argv[1:])
    parser = build_parser(commands, describe=not argv or argv[0] != "simulate")
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
