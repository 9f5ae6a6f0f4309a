"""Convergence benchmark: every algorithm on the paper's setups, and the simulator's throughput.

Writes the "## Convergence" section of docs/benchmarks.md (other sections are left alone):

- setup A (K = 2, paper section 6.1) and setup B (K = 100, true means drawn per run) at noise
  sigma 0.1, 0.3 and 1.0, with the ``paper`` and ``default`` presets, the S-SCGD and Thompson-sampling
  baselines; ablations of ``default`` (estimator, step schedule, solve-per-round, deploy rule,
  exploration) on setup A and on setup B at sigma 0.1;
- per checkpoint: f(mu p_hat) (mean, median, quartiles), the relative gain r and the mean
  cumulative regret (see ``pasto.simulate``);
- the acceptance targets of issue 2 and whether they are met;
- Monte-Carlo throughput (run-rounds per second) of the vectorised simulator against a plain
  per-run Python loop of the same algorithm, measured in the same process.

Every configuration uses the same seed, hence the same true means in every run of a setup; the
optimum per run (needed for r on setup B) is solved once and shared. Work is spread over
``--workers`` processes (one numpy thread each).

Run: ``python bench/convergence.py`` (1000 runs, takes a while); ``--runs 100`` for a quick pass;
``--print-only`` to leave docs/benchmarks.md untouched.
"""

from __future__ import annotations

import os

# One BLAS/OpenMP thread per worker process: the parallelism is across configurations.
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from pasto.estimators import Statistics  # noqa: E402
from pasto.scenario import Scenario, load_scenario, scenario_from_dict  # noqa: E402
from pasto.simulate import (  # noqa: E402
    References,
    draw_means,
    make_policy,
    reference_values,
    simulate,
)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks.md"
SIGMAS = (0.1, 0.3, 1.0)
MAIN_ALGORITHMS = ("paper", "default", "scgd", "thompson")
# Ablations of the default preset: one knob changed at a time.
ABLATIONS: tuple[tuple[str, dict], ...] = (
    ("estimator=ips", {"estimator": "ips"}),
    ("estimator=control_variate", {"estimator": "control_variate"}),
    ("step_schedule=constant", {"step_schedule": "constant", "step_size": 0.1}),
    ("step_schedule=doubling", {"step_schedule": "doubling"}),
    ("solve_every=0 (plain EG)", {"solve_every": 0}),
    ("deploy=average", {"deploy": "average"}),
    ("deploy=stage", {"deploy": "stage"}),
    ("exploration=paper", {"exploration": "paper", "exploration_scale": 0.1}),
)
# ALGORITHM.md's measured reference for the paper preset on setup A (1000 runs).
PAPER_REFERENCE_A = {100: 0.59, 500: 0.83, 1000: 0.89, 2000: 0.94}


# --------------------------------------------------------------------------- jobs


def _setups(runs: int, rounds_a: int | None, rounds_b: int | None) -> dict[str, Scenario]:
    a = load_scenario("setup-a").with_overrides(runs=runs, rounds=rounds_a)
    b = load_scenario("setup-b").with_overrides(runs=runs, rounds=rounds_b)
    setups = {"A": a}
    for sigma in SIGMAS:
        setups[f"B sigma={sigma}"] = b.with_overrides(noise_std=sigma)
    return setups


def _jobs(setups: dict[str, Scenario]) -> list[tuple[str, str, str, dict]]:
    """(setup label, row label, algorithm, overrides), slowest first so the pool ends together."""
    jobs = []
    for label in setups:
        for algorithm in MAIN_ALGORITHMS:
            jobs.append((label, algorithm, algorithm, {}))
        if label in ("A", f"B sigma={SIGMAS[0]}"):
            for name, overrides in ABLATIONS:
                jobs.append((label, f"default {name}", "default", overrides))
    cost = {"default": 10, "thompson": 8}
    jobs.sort(key=lambda job: -(cost.get(job[2], 1) * (10 if job[0].startswith("B") else 1)))
    return jobs


def _run_job(job) -> tuple[str, str, dict, float]:
    label, row, algorithm, overrides, scenario_document, references = job
    scenario = scenario_from_dict(scenario_document)
    started = time.perf_counter()
    result = simulate(scenario, make_policy(algorithm, overrides), references=references)
    return label, row, result.summary, time.perf_counter() - started


def _references_chunk(job) -> tuple[np.ndarray, np.ndarray]:
    scenario_document, chunk = job
    scenario = scenario_from_dict(scenario_document)
    references = reference_values(scenario.objective(), [chunk], chunk.shape[0])
    return references.best_single[0], references.best_mixture[0]


def _references(pool, scenario: Scenario, workers: int) -> References:
    """f_single* and f_mix* per run, the per-run solves spread over the pool."""
    means = draw_means(scenario, scenario.runs)[0]
    if means.ndim == 2:
        return reference_values(scenario.objective(), [means], scenario.runs)
    chunks = np.array_split(means, max(1, 4 * workers))
    parts = pool.map(_references_chunk, [(scenario.to_dict(), chunk) for chunk in chunks])
    return References(
        best_single=np.concatenate([single for single, _ in parts])[None, :],
        best_mixture=np.concatenate([mixture for _, mixture in parts])[None, :],
    )


# --------------------------------------------------------------------------- throughput


def per_run_loop(scenario: Scenario, algorithm: str, runs: int) -> float:
    """Seconds for ``runs`` runs done one after another with a plain Python loop, no batch dimension.

    Same work per round as the simulator: sample Q arms from p_t, observe, build the round's
    statistics, update, and score the served and deployed mixtures under the true means.
    """
    policy = make_policy(algorithm)
    objective = scenario.objective()
    all_means = draw_means(scenario, runs)[0]
    thresholds = objective.thresholds(all_means)
    rng = np.random.default_rng(scenario.seed)
    n_metrics, n_arms, queries = scenario.n_metrics, scenario.n_arms, scenario.queries_per_round
    started = time.perf_counter()
    for run in range(runs):
        means = all_means if all_means.ndim == 2 else all_means[run]
        run_thresholds = thresholds if all_means.ndim == 2 else thresholds[run]
        state = policy.initial_state(n_arms, n_metrics, ())
        pooled = Statistics.zeros(n_metrics, n_arms)
        for _ in range(scenario.rounds):
            served = state.probabilities
            arms = rng.choice(n_arms, size=queries, p=served)
            values = means[:, arms].T + scenario.noise.sample(rng, (queries, n_metrics))
            statistics = Statistics.from_observations(arms, values, n_arms)
            pooled = pooled + statistics
            state = policy.update(objective, state, statistics, pooled, served, rng)
            objective.value(means @ served, run_thresholds)
            objective.value(means @ state.deployed, run_thresholds)
    return time.perf_counter() - started


def throughput(setups: dict[str, Scenario], runs_vectorised: int, runs_loop: int, rounds: int) -> list[dict]:
    rows = []
    for label, setup in (("A", setups["A"]), ("B sigma=0.1", setups[f"B sigma={SIGMAS[0]}"])):
        for algorithm in ("paper", "default"):
            vectorised = setup.with_overrides(runs=runs_vectorised, rounds=rounds)
            references = reference_values(
                vectorised.objective(), [np.zeros((vectorised.n_metrics, vectorised.n_arms))], runs_vectorised
            )  # the optimum is not part of the loop being timed
            started = time.perf_counter()
            simulate(vectorised, make_policy(algorithm), references=references)
            vectorised_seconds = time.perf_counter() - started
            loop_seconds = per_run_loop(setup.with_overrides(runs=runs_loop, rounds=rounds), algorithm, runs_loop)
            vectorised_rate = runs_vectorised * rounds / vectorised_seconds
            loop_rate = runs_loop * rounds / loop_seconds
            rows.append({
                "setup": label, "algorithm": algorithm, "rounds": rounds,
                "vectorised_runs": runs_vectorised, "vectorised_rate": vectorised_rate,
                "loop_runs": runs_loop, "loop_rate": loop_rate, "ratio": vectorised_rate / loop_rate,
            })
            print(f"throughput {label} {algorithm}: vectorised {vectorised_rate:,.0f} run-rounds/s, "
                  f"per-run loop {loop_rate:,.0f} run-rounds/s, ratio {vectorised_rate / loop_rate:.1f}x",
                  flush=True)
    return rows


# --------------------------------------------------------------------------- report


def _number(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def _table(rows: list[tuple[str, dict]]) -> list[str]:
    lines = [
        "| algorithm | round | f mean | f median | f p25 | f p75 | r mean | r median | r p25 | r p75 "
        "| excluded | cum. regret |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row_label, summary in rows:
        for checkpoint in summary["checkpoints"]:
            objective, gain = checkpoint["objective"], checkpoint["relative_gain"]
            lines.append(
                f"| {row_label} | {checkpoint['round']} | {_number(objective['mean'])} | "
                f"{_number(objective['median'])} | {_number(objective['p25'])} | {_number(objective['p75'])} | "
                f"{_number(gain['mean'])} | {_number(gain['median'])} | {_number(gain['p25'])} | "
                f"{_number(gain['p75'])} | {gain['excluded']} | {_number(checkpoint['cumulative_regret']['mean'], 1)} |"
            )
    return lines


def _at(summary: dict, round_number: int) -> dict:
    return next(c for c in summary["checkpoints"] if c["round"] == round_number)


def _acceptance(results: dict, runs: int) -> list[str]:
    lines = ["| target | measured | met |", "|---|---:|:---:|"]

    def add(target: str, value: float | None, ok: bool) -> None:
        lines.append(f"| {target} | {_number(value)} | {'yes' if ok else '**no**'} |")

    a = results.get("A", {})
    if "paper" in a:
        for round_number, reference in PAPER_REFERENCE_A.items():
            try:
                value = _at(a["paper"], round_number)["objective"]["mean"]
            except StopIteration:
                continue
            add(f"paper, A, mean f at {round_number} = {reference} +- 0.02 (ALGORITHM.md)", value,
                abs(value - reference) <= 0.02)
    if "default" in a:
        try:
            value = _at(a["default"], 500)["objective"]["mean"]
            add("default, A, mean f at 500 >= 0.97", value, value >= 0.97)
        except StopIteration:
            pass
    b = results.get(f"B sigma={SIGMAS[0]}", {})
    if "default" in b:
        for round_number, statistic, bound in ((300, "median", 0.95), (1000, "mean", 0.90)):
            try:
                value = _at(b["default"], round_number)["relative_gain"][statistic]
            except StopIteration:
                continue
            add(f"default, B sigma 0.1, {statistic} r at {round_number} >= {bound}", value,
                value is not None and value >= bound)
    if runs != 1000:
        lines.append("")
        lines.append(f"(Measured with {runs} runs; the targets are stated for 1000.)")
    return lines


def render(results: dict, timings: dict, speed: list[dict], command: str, args, elapsed: float) -> str:
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "## Convergence",
        "",
        "```",
        command,
        "```",
        "",
        f"{args.runs} Monte-Carlo runs per row, seed {args.seed}, measured {now} on "
        f"{os.cpu_count()} CPU(s) shared with other jobs, in {elapsed / 60:.0f} min of wall time "
        f"over {args.workers} worker process(es).",
        "",
        "f = f(mu p_hat_t): the objective of the mixture the algorithm would deploy after t rounds, "
        "under the true means. r = (f - f_single*) / (f_mix* - f_single*) per run: 0 is the best single "
        "arm, 1 the best mixture (runs where f_mix* - f_single* < 1e-9 are excluded; the count is "
        "shown). Cumulative regret = sum over rounds of f_mix* - f(mu p_t) for the mixtures actually "
        "served (exploration included). All rows of a setup see the same true means. `default x=y` rows "
        "are ablations: the default preset with one setting changed (see `pasto.algorithm.AlgorithmConfig`). "
        "Baselines: `scgd` is S-SCGD (paper Fig. 3) with the paper's step and exploration, `thompson` "
        "a Thompson-sampling best-arm bandit on the scalarised objective (what an A/B-testing platform "
        "would run; it deploys one arm, so its r is at most 0).",
        "",
        "### Acceptance targets (issue 2)",
        "",
        *_acceptance(results, args.runs),
        "",
    ]
    for label, rows in results.items():
        if label == "A":
            scenario_line = ("### Setup A: K = 2, mu = [[2, 0], [-2, 2]], c = 0, lambda = 5, "
                             "noise N(0, 5), Q = 1")
        else:
            scenario_line = (f"### Setup B, {label.split(' ', 1)[1].replace('sigma=', 'sigma = ')}: K = 100, "
                             "means U[-1, 1] per run, c = 0.5 (two guardrails), lambda = 5, Q = 10")
        lines += [scenario_line, ""]
        first = next(iter(rows.values()))
        if "best_mixture" in first:
            lines += [f"Best single arm f = {first['best_single']:.4f}; best mixture f = {first['best_mixture']:.4f}.", ""]
        ordered = [(name, rows[name]) for name in rows]
        lines += _table(ordered)
        seconds = ", ".join(f"{name} {timings[label][name]:.0f}s" for name in rows)
        lines += ["", f"Wall time per row: {seconds}.", ""]
    lines += [
        "### Simulator throughput",
        "",
        "Run-rounds per second (one round of one run = sample Q arms, observe, build statistics, update, "
        "score the served and deployed mixtures) of `pasto.simulate` (all runs in one batch) against a "
        "plain Python loop over runs calling the same `update` without a batch dimension, timed one after "
        "the other in the same process. Absolute figures depend on the shared machine; the ratio is the "
        "figure.",
        "",
        "| setup | algorithm | rounds | vectorised runs | vectorised run-rounds/s | loop runs "
        "| loop run-rounds/s | ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in speed:
        lines.append(
            f"| {row['setup']} | {row['algorithm']} | {row['rounds']} | {row['vectorised_runs']} | "
            f"{row['vectorised_rate']:,.0f} | {row['loop_runs']} | {row['loop_rate']:,.0f} | "
            f"{row['ratio']:.0f}x |"
        )
    return "\n".join(lines) + "\n"


def write_section(section: str, path: Path = DOCS) -> None:
    """Replace the ``## Convergence`` section of ``path`` (up to the next ``## `` heading), or append it."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(r"^## Convergence\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: section.rstrip("\n") + "\n\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    path.write_text(text.rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000, help="Monte-Carlo runs per row (default 1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--rounds-a", type=int, help="shorten setup A (default: the scenario's 2000)")
    parser.add_argument("--rounds-b", type=int, help="shorten setup B (default: the scenario's 1000)")
    parser.add_argument("--throughput-rounds", type=int, default=200)
    parser.add_argument("--throughput-loop-runs", type=int, default=10,
                        help="runs timed with the per-run loop (the rate is per run-round)")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--json", type=Path, help="also write every result document here")
    parser.add_argument("--print-only", action="store_true", help="do not touch docs/benchmarks.md")
    args = parser.parse_args(argv)
    command = "python bench/convergence.py " + " ".join(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()

    setups = {label: scenario.with_overrides(seed=args.seed)
              for label, scenario in _setups(args.runs, args.rounds_a, args.rounds_b).items()}
    speed = [] if args.skip_throughput else throughput(
        setups, args.runs, args.throughput_loop_runs, args.throughput_rounds)

    context = multiprocessing.get_context("fork")
    with context.Pool(args.workers) as pool:
        references = {"A": _references(pool, setups["A"], args.workers)}
        shared_b = _references(pool, setups[f"B sigma={SIGMAS[0]}"], args.workers)
        for label in setups:
            references.setdefault(label, shared_b)  # the sigmas share the seed, hence the true means
        print(f"optima solved after {time.perf_counter() - started:.0f}s", flush=True)
        jobs = [(label, row, algorithm, overrides, setups[label].to_dict(), references[label])
                for label, row, algorithm, overrides in _jobs(setups)]
        collected: dict[tuple[str, str], tuple[dict, float]] = {}
        for label, row, summary, seconds in pool.imap_unordered(_run_job, jobs):
            collected[(label, row)] = (summary, seconds)
            last = summary["checkpoints"][-1]
            print(f"[{len(collected)}/{len(jobs)}] {label:>12} {row:<36} {seconds:6.0f}s  "
                  f"f {last['objective']['mean']:.3f}  median r {_number(last['relative_gain']['median'])}",
                  flush=True)

    results: dict[str, dict[str, dict]] = {}
    timings: dict[str, dict[str, float]] = {}
    for label in setups:
        rows = [row for (row_label, row) in [(job[0], job[1]) for job in _jobs(setups)] if row_label == label]
        order = [name for name in MAIN_ALGORITHMS if name in rows] + [r for r in rows if r not in MAIN_ALGORITHMS]
        results[label] = {row: collected[(label, row)][0] for row in order}
        timings[label] = {row: collected[(label, row)][1] for row in order}

    section = render(results, timings, speed, command.strip(), args, time.perf_counter() - started)
    print(section)
    if args.json is not None:
        args.json.write_text(json.dumps({"results": results, "throughput": speed}, indent=1) + "\n")
    if not args.print_only:
        write_section(section)
        print(f"Wrote the Convergence section of {DOCS}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
