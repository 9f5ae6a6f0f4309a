"""Convergence benchmark: every algorithm on the paper's setups, and the simulator's throughput.

Writes the "## Convergence" section of docs/benchmarks.md (other sections are left alone):

- setup A (K = 2, paper section 6.1) and setup B (K = 100, true means drawn per run) at noise
  sigma 0.1, 0.3 and 1.0, with the ``paper`` and ``default`` presets, the S-SCGD and Thompson-sampling
  baselines; ablations of ``default`` (estimator, step schedule, solve-per-round, deploy rule,
  exploration) on setup A and on setup B at sigma 0.1;
- per checkpoint: f(mu p_hat) (mean, median, quartiles), the relative gain r and the mean
  cumulative regret (see ``pasto.simulate``);
- the acceptance targets and whether they are met, with the Monte-Carlo standard error
  of the ``paper`` preset's means on setup A and its spread over ``--paper-seeds`` further seeds;
- Monte-Carlo throughput (run-rounds per second) of the vectorised simulator against a plain
  per-run Python loop of the same algorithm, measured in the same process.

Every configuration uses the same seed, hence the same true means in every run of a setup; the
optimum per run (needed for r on setup B) is solved once and shared. The deploy-rule ablations are
scored on the default row's own runs (``simulate(..., deploy_rules=...)``): the deploy rule does not
change what is served, so this equals a separate run with ``deploy`` overridden. Work is spread
over ``--workers`` processes (one numpy thread each).

Run: ``python bench/convergence.py`` (1000 runs, takes a while); ``--runs 100`` for a quick pass;
``--print-only`` to leave docs/benchmarks.md untouched. ``--serving`` runs only the
safe-serving rows; ``--noise-runs 1000`` runs their sigma 1.0 and 3.0 rows (whose median and shares
sit near their targets) on 1000 runs in blocks of 500 with seeds ``--seed`` and ``--seed + 1``, about
40 minutes on 2 cores.
"""

from __future__ import annotations

import os

# One BLAS/OpenMP thread per worker process: the parallelism is across configurations.
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from pasto.estimators import Statistics  # noqa: E402
from pasto.cli import load_scenario  # noqa: E402
from pasto.scenario import Scenario, scenario_from_dict  # noqa: E402
from pasto.simulate import (  # noqa: E402
    References,
    draw_means,
    make_policy,
    quartile_summary,
    reference_values,
    simulate,
)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks.md"
SIGMAS = (0.1, 0.3, 1.0)
MAIN_ALGORITHMS = ("paper", "default", "scgd", "thompson")
# The exploration controller: the default preset with serving "exploration" (pasto.algorithm.ExplorationConfig).
EXPLORATION = {"serving": "exploration"}
# Ablations, one knob changed at a time: of the default preset (the estimator), and of the
# exploration row (its own options; safe serving has none). Rows: (label, overrides of default).
ABLATIONS: tuple[tuple[str, dict], ...] = (
    ("default estimator=ips", {"estimator": "ips"}),
    ("default estimator=control_variate", {"estimator": "control_variate"}),
    ("exploration step_schedule=constant", {**EXPLORATION, "step_schedule": "constant", "step_size": 0.1}),
    ("exploration step_schedule=doubling", {**EXPLORATION, "step_schedule": "doubling"}),
    ("exploration solve_every=0 (plain EG)", {**EXPLORATION, "solve_every": 0}),
    ("exploration exploration=paper", {**EXPLORATION, "exploration": "paper", "exploration_scale": 0.1}),
)
# Deploy-rule ablations, scored on the exploration row's runs (the deploy rule does not feed back).
DEPLOY_ABLATIONS = ("average", "stage")
# ALGORITHM.md's measured reference for the paper preset on setup A (1000 runs).
PAPER_REFERENCE_A = {100: 0.59, 500: 0.83, 1000: 0.89, 2000: 0.94}
REFERENCE_RUNS = 1000
ABLATION_SETUPS = ("A", f"B sigma={SIGMAS[0]}")


# --------------------------------------------------------------------------- jobs


def _setups(runs: int, rounds_a: int | None, rounds_b: int | None) -> dict[str, Scenario]:
    a = load_scenario("setup-a").with_overrides(runs=runs, rounds=rounds_a)
    b = load_scenario("setup-b").with_overrides(runs=runs, rounds=rounds_b)
    setups = {"A": a}
    for sigma in SIGMAS:
        setups[f"B sigma={sigma}"] = b.with_overrides(noise_std=sigma)
    return setups


def _jobs(setups: dict[str, Scenario], paper_seeds: int = 0) -> list[tuple[str, str, str, dict, int | None]]:
    """(setup label, row label, algorithm, overrides, seed override), slowest first so the pool ends together.

    ``paper_seeds`` extra rows ``paper seed=s`` (s = seed + 1 ..) repeat the ``paper`` preset on
    setup A with other seeds, for the spread of its means over seeds.
    """
    jobs = []
    for label in setups:
        for algorithm in MAIN_ALGORITHMS:
            jobs.append((label, algorithm, algorithm, {}, None))
        jobs.append((label, "exploration", "default", EXPLORATION, None))
        if label in ABLATION_SETUPS:
            for name, overrides in ABLATIONS:
                jobs.append((label, name, "default", overrides, None))
    base_seed = setups["A"].seed
    for offset in range(1, paper_seeds + 1):
        jobs.append(("A", f"paper seed={base_seed + offset}", "paper", {}, base_seed + offset))
    cost = {"default": 10, "thompson": 8}  # by algorithm; the exploration rows are "default" too
    jobs.sort(key=lambda job: -(cost.get(job[2], 1) * (10 if job[0].startswith("B") else 1)))
    return jobs


def _run_job(job) -> tuple[str, str, dict, float]:
    """Simulate one row. The summary gains each checkpoint's standard deviation of f over runs and,
    for the default preset on the ablation setups, the deploy-rule ablations."""
    label, row, algorithm, overrides, seed, scenario_document, references = job
    scenario = scenario_from_dict(scenario_document)
    if seed is not None:
        scenario = scenario.with_overrides(seed=seed)
    deploy_rules = DEPLOY_ABLATIONS if (row == "exploration" and label in ABLATION_SETUPS) else ()
    started = time.perf_counter()
    result = simulate(scenario, make_policy(algorithm, overrides), references=references, deploy_rules=deploy_rules)
    summary = result.summary
    for checkpoint in summary["checkpoints"]:
        values = result.deployed_values[checkpoint["round"] - 1]
        checkpoint["objective"]["std"] = float(values.std(ddof=1)) if values.size > 1 else None
    return label, row, summary, time.perf_counter() - started


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


# --------------------------------------------------------------------------- safe serving

# (label, scenario, noise override, rounds, algorithms). Everything is judged by what is served
# (served regret, served hard guardrails under the true means) beside what is deployed, against the
# Thompson best-arm bandit on the same runs (same seed, same true means).
SERVING_ROWS: tuple[tuple[str, str, float | None, int | None, tuple[str, ...]], ...] = (
    ("demo", "demo", None, 300, ("default", "thompson")),
    ("B hard", "setup-b-hard", None, 300, ("default", "thompson")),
    ("A", "setup-a", None, 2000, ("default", "thompson")),
    ("B sigma=0.1", "setup-b", 0.1, 1000, ("default", "thompson")),
    ("B sigma=0.3", "setup-b", 0.3, 1000, ("default", "thompson")),
    ("B sigma=1.0", "setup-b", 1.0, 1000, ("default", "thompson")),
    ("B sigma=3.0", "setup-b", 3.0, 1000, ("default", "thompson")),
    ("A drift", "setup-a-drift", None, 2000, ("default", "thompson")),
)
# Relative cost per run-round (the order jobs start in: the longest first).
SERVING_COST = {"default": 6, "exploration": 3, "thompson": 1}


# The noise rows decide medians and shares that sit near their targets, so they can run on more
# runs than the rest (``--noise-runs``): in blocks of at most NOISE_BLOCK_RUNS runs with seeds
# seed, seed + 1, ... (the blocks' true means differ; default and thompson share them).
NOISE_ROWS = ("B sigma=1.0", "B sigma=3.0")
NOISE_BLOCK_RUNS = 500


def _blocks(label: str, runs: int, noise_runs: int | None, seed: int) -> list[tuple[int, int]]:
    """(runs, seed) of each block of a row: one block unless it is a noise row with ``noise_runs``."""
    if label not in NOISE_ROWS or noise_runs is None:
        return [(runs, seed)]
    count = max(1, math.ceil(noise_runs / NOISE_BLOCK_RUNS))
    if noise_runs % count:
        raise SystemExit(f"--noise-runs {noise_runs} does not split into {count} equal blocks of at most "
                         f"{NOISE_BLOCK_RUNS} runs.")
    return [(noise_runs // count, seed + block) for block in range(count)]


def _serving_scenarios(runs: int, seed: int, rows=None, noise_runs: int | None = None) -> dict[str, list[Scenario]]:
    """Each row's scenario per block: {label: [scenario, ...]}."""
    scenarios = {}
    for label, name, sigma, rounds, _ in (rows or SERVING_ROWS):
        scenarios[label] = [
            load_scenario(name).with_overrides(runs=block_runs, rounds=rounds, seed=block_seed, noise_std=sigma)
            for block_runs, block_seed in _blocks(label, runs, noise_runs, seed)
        ]
    return scenarios


def _run_serving_job(job):
    label, block, algorithm, scenario_document, references = job
    scenario = scenario_from_dict(scenario_document)
    started = time.perf_counter()
    result = simulate(scenario, make_policy(algorithm), references=references)
    checkpoints = [c - 1 for c in scenario.checkpoints]
    return (label, block, algorithm, result.summary, result.deployed_values[checkpoints],
            result.relative_gains[checkpoints], time.perf_counter() - started)


def _pool_blocks(parts: list[tuple[dict, np.ndarray, np.ndarray, float]]) -> tuple[dict, np.ndarray, np.ndarray, float]:
    """One row's (summary, f, r, seconds) from its blocks' (f and r are (checkpoints, runs))."""
    if len(parts) == 1:
        return parts[0]
    summaries = [summary for summary, _, _, _ in parts]
    f = np.concatenate([values for _, values, _, _ in parts], axis=1)
    r = np.concatenate([gains for _, _, gains, _ in parts], axis=1)
    sizes = np.array([summary["runs"] for summary in summaries], dtype=float)
    pooled = {**summaries[0], "runs": int(sizes.sum()), "seed": [summary["seed"] for summary in summaries],
              "runs_ending_on_a_breaking_arm": sum(s["runs_ending_on_a_breaking_arm"] for s in summaries)}
    if "hard_guardrails" in pooled:  # shares of (run, round) pairs: weighted by the blocks' runs
        hard = [summary["hard_guardrails"] for summary in summaries]
        pooled["hard_guardrails"] = {
            **hard[0],
            **{key: float(np.dot(sizes, [h[key] for h in hard]) / sizes.sum())
               for key in ("served_hold_share", "deployed_hold_share")},
            "deployed_hold_share_at": {at: float(np.dot(sizes, [h["deployed_hold_share_at"][at] for h in hard])
                                                 / sizes.sum()) for at in hard[0]["deployed_hold_share_at"]},
        }
    checkpoints = []
    for index, checkpoint in enumerate(summaries[0]["checkpoints"]):
        gains = r[index][~np.isnan(r[index])]
        relative_gain = quartile_summary(gains)
        relative_gain["excluded"] = int(r.shape[1] - gains.size)
        regrets = [s["checkpoints"][index]["cumulative_regret"] for s in summaries]
        errors = [regret["standard_error"] for regret in regrets]
        checkpoints.append({
            "round": checkpoint["round"],
            "objective": quartile_summary(f[index]),
            "relative_gain": relative_gain,
            # The mean of equal-weighted blocks' means and its standard error (blocks independent).
            "cumulative_regret": {
                "mean": float(np.dot(sizes, [regret["mean"] for regret in regrets]) / sizes.sum()),
                "standard_error": (None if None in errors
                                   else float(np.sqrt(np.dot(sizes**2, np.square(errors))) / sizes.sum())),
            },
        })
    pooled["checkpoints"] = checkpoints
    return pooled, f, r, sum(seconds for _, _, _, seconds in parts)


def run_serving(runs: int, seed: int, workers: int, rows=None, noise_runs: int | None = None) -> dict:
    """Every SERVING_ROWS row; returns {label: {"scenario", "references", algorithm: (summary, f, r, seconds)}}.

    A noise row run in blocks (``noise_runs``) is pooled: its f and r hold every block's runs.
    """
    rows = rows or SERVING_ROWS
    scenarios = _serving_scenarios(runs, seed, rows, noise_runs)
    context = multiprocessing.get_context("fork")
    results: dict = {}
    with context.Pool(workers) as pool:
        references: dict[tuple[str, int], References] = {}
        solved: dict[tuple, References] = {}
        for label, blocks in scenarios.items():
            for block, scenario in enumerate(blocks):
                objective = scenario.objective()
                if scenario.fixed_means or any(getattr(g, "hard", False) for g in objective.guardrails):
                    references[label, block] = reference_values(
                        objective, draw_means(scenario, scenario.runs), scenario.runs)
                    continue
                # The sigmas of setup B share the true means (same seed and runs), hence the optima.
                key = (scenario.name, scenario.runs, scenario.seed)
                if key not in solved:
                    solved[key] = _references(pool, scenario, workers)
                references[label, block] = solved[key]
        jobs = [(label, block, algorithm, scenarios[label][block].to_dict(), references[label, block])
                for label, _, _, _, algorithms in rows for algorithm in algorithms
                for block in range(len(scenarios[label]))]
        jobs.sort(key=lambda job: -SERVING_COST[job[2]] * scenarios[job[0]][job[1]].rounds
                  * scenarios[job[0]][job[1]].runs * scenarios[job[0]][job[1]].queries_per_round ** 0.5)
        parts: dict = {}
        for label, block, algorithm, summary, f, r, seconds in pool.imap_unordered(_run_serving_job, jobs):
            parts[label, algorithm, block] = (summary, f, r, seconds)
            print(f"serving {label:>12} {algorithm:<9} block {block} {seconds:6.0f}s  served regret "
                  f"{summary['checkpoints'][-1]['cumulative_regret']['mean']:.1f}", flush=True)
    for label, _, _, _, algorithms in rows:
        blocks = scenarios[label]
        pooled_references = references[label, 0] if len(blocks) == 1 else References(
            best_single=np.concatenate([references[label, b].best_single for b in range(len(blocks))], axis=1),
            best_mixture=np.concatenate([references[label, b].best_mixture for b in range(len(blocks))], axis=1),
        )
        results[label] = {"scenario": blocks[0], "references": pooled_references,
                          "runs": sum(scenario.runs for scenario in blocks),
                          "seeds": [scenario.seed for scenario in blocks]}
        for algorithm in algorithms:
            results[label][algorithm] = _pool_blocks([parts[label, algorithm, b] for b in range(len(blocks))])
    return results


def _bootstrap(values: np.ndarray, statistic, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 90% percentile-bootstrap interval of ``statistic`` over runs (axis -1 of ``values``)."""
    rng = np.random.default_rng(seed)
    n = values.shape[-1]
    estimates = [statistic(values[..., rng.integers(0, n, n)]) for _ in range(draws)]
    return float(np.percentile(estimates, 5)), float(np.percentile(estimates, 95))


def _share(mask) -> float:
    mask = np.asarray(mask)
    return float(mask.mean()) if mask.size else float("nan")


def render_serving(results: dict, command: str, runs: int, elapsed: float, commit: str | None = None) -> str:
    """The "### Safe serving" subsection: per-row table and the acceptance targets."""
    lines = [
        "### Safe serving",
        "",
        "```",
        command,
        "```",
        "",
        f"{runs} Monte-Carlo runs per row, measured {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} "
        f"in {elapsed / 60:.0f} min; {commit or _commit()}. `default` is the default preset, safe serving "
        "(`pasto.algorithm` with `serving='safe'`, the path the service runs: per-arm empirical-Bayes "
        "bounds, optimistic objective, pessimistic hard guardrails, no exploration floor, soft-guardrail "
        "traffic: Thompson sampling over safe mixtures (`serving_posterior_draws` draws, each solved "
        "exactly with the guardrails the optimum keeps on their pessimistic bounds) and, while no "
        "mixture is defended, half of the traffic after each arm's posterior probability of being the "
        "best single arm until one is at the deploy level, then after the best known safe mixture; deploy-what-you-can-defend, moved from the starting mixture only as far as the "
        "evidence defends; change detection); `thompson` the Thompson "
        "best-arm bandit, on the same runs (same seed, same true means). Served regret = mean over runs "
        "of sum_t (f_mix* - f(mu p_t)) for the mixtures actually served (hard guardrails: f is the primary "
        "metric, the guardrails are judged separately). Served/deployed hold = share of (run, round) pairs "
        "after round 20 where every hard guardrail holds under the true means to 0.1% of its threshold. "
        "f/f* = mean over runs of the deployed objective over the (constrained) optimum. A share of runs "
        "has a Monte-Carlo standard error of at most 0.5 / sqrt(runs) "
        f"(= {0.5 / math.sqrt(runs):.3f} here).",
    ]
    pooled = {label: row for label, row in results.items() if row.get("runs", runs) != runs}
    if pooled:
        row = next(iter(pooled.values()))
        lines[-1] += (
            f" Rows {', '.join(pooled)}: {row['runs']} runs each, in {len(row['seeds'])} blocks of "
            f"{row['scenario'].runs} (seeds {', '.join(str(seed) for seed in row['seeds'])}; each block its "
            "own true means), pooled: their medians and shares sit near their targets, where 100 runs "
            "cannot tell them apart (blocks of 100 runs of one rule gave a sigma 1.0 median r from 0.79 "
            "to 0.95), so their targets below carry 90% bootstrap intervals over runs."
        )
    lines += [
        "",
        "| setup | algorithm | round | f mean (se) | f median | f/f* | r mean | r median | r < 0 | f below thompson "
        "| served regret (se) | served hold | deployed hold | ends on a breaking arm |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    checks = []
    for label, row in results.items():
        scenario, references = row["scenario"], row["references"]
        regime_at = [0 if scenario.drift is None or c < scenario.drift.at_round else 1 for c in scenario.checkpoints]
        for algorithm in [a for a in ("default", "exploration", "thompson") if a in row]:
            summary, f, r, _ = row[algorithm]
            hard = summary.get("hard_guardrails")
            for index, checkpoint in enumerate(summary["checkpoints"]):
                optimum = references.best_mixture[regime_at[index]]
                ratio = float(np.nanmean(f[index] / optimum)) if np.all(optimum > 0) else None
                gains = r[index][~np.isnan(r[index])]
                below = None
                if "thompson" in row and algorithm != "thompson":
                    below = _share(f[index] < row["thompson"][1][index] - 1e-12)
                last = index == len(summary["checkpoints"]) - 1
                f_error = float(np.std(f[index], ddof=1) / math.sqrt(len(f[index]))) if len(f[index]) > 1 else None
                regret_error = checkpoint["cumulative_regret"].get("standard_error")
                lines.append(
                    f"| {label} | {algorithm} | {checkpoint['round']} | {_number(checkpoint['objective']['mean'])} "
                    f"({_number(f_error)}) | "
                    f"{_number(checkpoint['objective']['median'])} | {_number(ratio)} | "
                    f"{_number(checkpoint['relative_gain']['mean'])} | {_number(checkpoint['relative_gain']['median'])} | "
                    f"{_number(_share(gains < 0) if gains.size else None, 2)} | {_number(below, 2)} | "
                    f"{_number(checkpoint['cumulative_regret']['mean'], 1)}"
                    f"{f' ({_number(regret_error, 1)})' if regret_error is not None else ''} | "
                    f"{_number(hard['served_hold_share'], 4) if hard and last else '-'} | "
                    f"{_number(hard['deployed_hold_share'], 4) if hard and last else '-'} | "
                    f"{summary['runs_ending_on_a_breaking_arm'] if last else '-'} |"
                )
                checks.append((label, algorithm, checkpoint["round"], checkpoint, ratio, gains, below, hard, summary))
    lines += ["", "Targets, all for `default`:", "", "| target | measured | met |", "|---|---:|:---:|"]

    def find(label, round_number):
        return next((c for c in checks if c[0] == label and c[1] == "default" and c[2] == round_number), None)

    def add(target, value, ok):
        lines.append(f"| {target} | {value} | {'yes' if ok else '**no**'} |")

    for label in ("demo", "B hard"):
        c = find(label, 300)
        if c is None:
            continue
        hard = c[7]
        add(f"{label}: served holds every hard guardrail in >= 97% of (run, round) pairs after round 20",
            f"{hard['served_hold_share']:.4f}", hard["served_hold_share"] >= 0.97)
        add(f"{label}: deployed f >= 0.97 of the constrained optimum at 300 (mean f/f*)",
            _number(c[4]), c[4] is not None and c[4] >= 0.97)
    if (c := find("A", 500)) is not None:
        add("A: deployed mean f at 500 >= 0.97", _number(c[3]["objective"]["mean"]), c[3]["objective"]["mean"] >= 0.97)
    if (c := find("A", 2000)) is not None:
        value = c[3]["cumulative_regret"]["mean"]
        add("A: served cumulative regret at 2000 <= 100 (exploration serving: 260)", f"{value:.1f}", value <= 100)
    if (c := find("B sigma=0.1", 300)) is not None:
        value = c[3]["relative_gain"]["median"]
        add("B sigma 0.1: median r at 300 >= 0.95", _number(value), value is not None and value >= 0.95)
    if (c := find("B sigma=0.1", 1000)) is not None:
        value = c[3]["cumulative_regret"]["mean"]
        add("B sigma 0.1: served cumulative regret at 1000 <= 80 (exploration serving: 156)", f"{value:.1f}", value <= 80)
    def interval(label, values, statistic, digits=3, scale=1.0):
        if label not in pooled or values.shape[-1] < 2:
            return ""
        low, high = _bootstrap(values, statistic)
        return f" (90%: {low * scale:.{digits}f} to {high * scale:.{digits}f})"

    if (c := find("B sigma=1.0", 1000)) is not None:
        value = c[3]["relative_gain"]["median"]
        add("B sigma 1.0, round 1000: median r >= 0.9",
            _number(value) + interval("B sigma=1.0", c[5], np.median), value is not None and value >= 0.9)
        negative = _share(c[5] < 0)
        add("B sigma 1.0, round 1000: r < 0 in <= 5% of runs (exploration serving: 15%)",
            f"{negative:.3f}" + interval("B sigma=1.0", c[5] < 0, np.mean), negative <= 0.05)
    if (c := find("B sigma=3.0", 1000)) is not None:
        safe_f = results["B sigma=3.0"]["default"][1][-1]
        thompson_f = results["B sigma=3.0"]["thompson"][1][-1]
        paired = np.stack([safe_f, thompson_f])
        add("B sigma 3.0, round 1000: median f >= thompson's",
            f"{np.median(safe_f):.4f} vs {np.median(thompson_f):.4f}"
            + interval("B sigma=3.0", paired, lambda pair: np.median(pair[0]) - np.median(pair[1]), 4).replace(
                "(90%: ", "(difference, 90%: "),
            np.median(safe_f) >= np.median(thompson_f))
        add("B sigma 3.0, round 1000: f below thompson's in <= 25% of runs (exploration serving: 50%)",
            f"{c[6]:.3f}" + interval("B sigma=3.0", safe_f < thompson_f - 1e-12, np.mean), c[6] <= 0.25)
    drift = results.get("A drift")
    if drift is not None and "default" in drift:
        scenario = drift["scenario"]
        within = [c for c in checks if c[0] == "A drift" and c[1] == "default"
                  and scenario.drift.at_round < c[2] <= scenario.drift.at_round + 300]
        if within:
            c = within[-1]
            add(f"drift: deployed mean r >= 0.9 within 300 rounds of the change (round {c[2]})",
                _number(c[3]["relative_gain"]["mean"]), c[3]["relative_gain"]["mean"] >= 0.9)
        ending = drift["default"][0]["runs_ending_on_a_breaking_arm"]
        add("drift: no run ends on a guardrail-breaking single arm", str(ending), ending == 0)
    return "\n".join(lines) + "\n"


_SERVING_SUBSECTION = re.compile(r"^### Safe serving\n.*?(?=^### |^## |\Z)", re.MULTILINE | re.DOTALL)


def write_serving_subsection(subsection: str, path: Path | None = None) -> None:
    """Replace (or add at the top of the Convergence section) the safe-serving subsection of ``path``."""
    path = DOCS if path is None else path
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    subsection = subsection.rstrip("\n") + "\n\n"
    if _SERVING_SUBSECTION.search(text):
        text = _SERVING_SUBSECTION.sub(lambda _: subsection, text, count=1)
    elif "## Convergence\n" in text:
        head, _, rest = text.partition("## Convergence\n")
        text = head + "## Convergence\n\n" + subsection + rest.lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n## Convergence\n\n" + subsection
    path.write_text(text.rstrip("\n") + "\n")


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


def _standard_error(checkpoint: dict, runs: int) -> float | None:
    std = checkpoint["objective"].get("std")
    return None if std is None else std / math.sqrt(runs)


def _paper_against_reference(results: dict, paper_seeds: dict, runs: int) -> tuple[list[str], dict]:
    """The paper preset's setup-A means beside ALGORITHM.md's reference, with their Monte-Carlo noise.

    Returns the table's lines and, per checkpoint, (mean, standard error, within-noise flag).
    """
    paper = results.get("A", {}).get("paper")
    if paper is None:
        return [], {}
    lines = [
        "| round | reference (ALGORITHM.md) | `paper`, seed 0 +- s.e. | z | "
        f"{len(paper_seeds)} more seeds: range of means | seeds within +- 0.02 of the reference "
        f"| all {len(paper_seeds) + 1} seeds pooled +- s.e. |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    checks = {}
    for round_number, reference in PAPER_REFERENCE_A.items():
        try:
            checkpoint = _at(paper, round_number)
        except StopIteration:
            continue
        mean, error = checkpoint["objective"]["mean"], _standard_error(checkpoint, runs)
        # The reference is itself a mean over 1000 runs of the same process: its standard error is
        # ours rescaled to 1000 runs, and the two add in quadrature.
        z = None
        if error:
            reference_error = error * math.sqrt(runs / REFERENCE_RUNS)
            z = (mean - reference) / math.hypot(error, reference_error)
        checks[round_number] = (mean, error, z)
        others = [_at(summary, round_number) for summary in paper_seeds.values()]
        if others:
            means = [c["objective"]["mean"] for c in others]
            seed_range = f"{min(means):.3f} - {max(means):.3f}"
            everything = [checkpoint] + others
            within = sum(abs(c["objective"]["mean"] - reference) <= 0.02 for c in everything)
            within = f"{within} of {len(everything)}"
            pooled_mean = float(np.mean([c["objective"]["mean"] for c in everything]))
            # Equal run counts: the pooled variance is the mean within-seed variance plus the
            # variance of the seed means (ddof 0 over seeds, times (n-1)/n corrections neglected).
            variances = [c["objective"]["std"] ** 2 for c in everything]
            total_runs = runs * len(everything)
            pooled_variance = float(np.mean(variances) + np.var([c["objective"]["mean"] for c in everything]))
            pooled = f"{pooled_mean:.3f} +- {math.sqrt(pooled_variance / total_runs):.3f}"
        else:
            seed_range, within, pooled = "-", "-", "-"
        lines.append(
            f"| {round_number} | {reference} | {mean:.3f} +- {_number(error)} | {_number(z, 2)} | {seed_range} "
            f"| {within} | {pooled} |"
        )
    return lines, checks


def _acceptance(results: dict, runs: int, paper_checks: dict) -> list[str]:
    lines = ["| target | measured | met |", "|---|---:|:---:|"]

    def add(target: str, value: str, ok: bool | None) -> None:
        verdict = "(report)" if ok is None else ("yes" if ok else "**no**")
        lines.append(f"| {target} | {value} | {verdict} |")

    for round_number, reference in PAPER_REFERENCE_A.items():
        if round_number not in paper_checks:
            continue
        mean, error, z = paper_checks[round_number]
        shown = f"{mean:.3f}" + ("" if error is None else f" +- {error:.3f}")
        add(f"paper, A, mean f at {round_number} = {reference} +- 0.02 (ALGORITHM.md)", shown,
            abs(mean - reference) <= 0.02)
        if z is not None:
            add(f"paper, A, mean f at {round_number} within Monte-Carlo noise of {reference}: "
                "abs(z) <= 2 (see below)", f"z = {z:.2f}", abs(z) <= 2.0)
    a = results.get("A", {})
    if "exploration" in a:
        try:
            checkpoint = _at(a["exploration"], 500)
            value = checkpoint["objective"]["mean"]
            error = _standard_error(checkpoint, runs)
            add("exploration, A, mean f at 500 >= 0.97", f"{value:.3f}" + ("" if error is None else f" +- {error:.3f}"),
                value >= 0.97)
        except StopIteration:
            pass
    for index, sigma in enumerate(SIGMAS):
        b = results.get(f"B sigma={sigma}", {})
        if "exploration" not in b:
            continue
        for round_number, statistic, bound in ((300, "median", 0.95), (1000, "mean", 0.90)):
            try:
                value = _at(b["exploration"], round_number)["relative_gain"][statistic]
            except StopIteration:
                continue
            if index == 0:
                add(f"exploration, B sigma {sigma}, {statistic} r at {round_number} >= {bound}", _number(value),
                    value is not None and value >= bound)
            else:
                add(f"exploration, B sigma {sigma}, {statistic} r at {round_number}", _number(value), None)
    if runs != 1000:
        lines.append("")
        lines.append(f"(Measured with {runs} runs; the targets are stated for 1000.)")
    return lines


def _commit() -> str:
    """The commit measured (taken when the run starts), and whether the measured code differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "pasto", "bench/convergence.py"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "an unknown commit (no git)"
    changes = " with uncommitted changes to pasto/ or bench/convergence.py" if dirty else ""
    return f"commit {head}{changes} (at the start of the run)"


def render(results: dict, timings: dict, speed: list[dict], command: str, args, elapsed: float,
           paper_seeds: dict | None = None, commit: str | None = None) -> str:
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    paper_lines, paper_checks = _paper_against_reference(results, paper_seeds or {}, args.runs)
    lines = [
        "## Convergence",
        "",
        "```",
        command,
        "```",
        "",
        f"{args.runs} Monte-Carlo runs per row, seed {args.seed}, measured {now} on "
        f"{os.cpu_count()} CPU(s) shared with other jobs, in {elapsed / 60:.0f} min of wall time "
        f"over {args.workers} worker process(es); {commit or _commit()}.",
        "",
        "f = f(mu p_hat_t): the objective of the mixture the algorithm would deploy after t rounds, "
        "under the true means. r = (f - f_single*) / (f_mix* - f_single*) per run: 0 is the best single "
        "arm, 1 the best mixture (runs where f_mix* - f_single* < 1e-9 are excluded; the count is "
        "shown). Cumulative regret = sum over rounds of f_mix* - f(mu p_t) for the mixtures actually "
        "served (exploration included). All rows of a setup see the same true means. `exploration` is the "
        "default preset with serving `exploration` (`pasto.algorithm.ExplorationConfig`); `default x=y` and "
        "`exploration x=y` rows are ablations: that row with one setting changed. "
        "Baselines: `scgd` is S-SCGD (paper Fig. 3) with the paper's step and exploration, `thompson` "
        "a Thompson-sampling best-arm bandit on the scalarised objective (what an A/B-testing platform "
        "would run; it deploys one arm, so its r is at most 0). The deploy-rule ablations "
        "(`exploration deploy=...`) are scored on the exploration row's own runs: the deploy rule does not "
        "change what is served, so this is the same as running them separately (and their cumulative "
        "regret is the exploration row's).",
        "",
        "### Targets with exploration serving",
        "",
        "s.e. = Monte-Carlo standard error of a mean over runs (standard deviation over runs / sqrt(runs)). "
        "Rows marked (report) have no target.",
        "",
        *_acceptance(results, args.runs, paper_checks),
        "",
    ]
    if paper_lines:
        lines += [
            "### The `paper` preset on setup A against the reference",
            "",
            "ALGORITHM.md's reference is one sample mean over 1000 runs; ours is another (seed 0, the "
            "`paper` row of the setup-A table), repeated with further seeds. z = (ours - reference) / "
            "s.e. of the difference, where the reference's standard error is ours rescaled to 1000 runs "
            "(the same process), so |z| <= 2 is within Monte-Carlo noise. The pooled mean over all seeds "
            "estimates the expectation of the preset's mean objective. The distribution of f has a long "
            "left tail (a run that has drifted to arm 0 scores down to -18), which makes the mean noisy. The "
            "reference is quoted to two decimals (+- 0.005).",
            "",
            *paper_lines,
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
        seconds = ", ".join(
            f"{name} {timings[label][name]:.0f}s" if isinstance(timings[label][name], float)
            else f"{name} ({timings[label][name]})"
            for name in rows
        )
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


def write_section(section: str, path: Path | None = None) -> None:
    """Replace the ``## Convergence`` section of ``path`` (default ``DOCS``, up to the next ``## ``
    heading), or append it. The file is read at write time, so other sections written meanwhile by
    other scripts are kept."""
    path = DOCS if path is None else path
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    kept = _SERVING_SUBSECTION.search(text)
    if kept is not None and "### Safe serving\n" not in section:
        # The safe-serving rows are measured by --serving; a full run keeps them.
        heading, _, rest = section.partition("\n")
        section = heading + "\n\n" + kept.group(0).rstrip("\n") + "\n\n" + rest.lstrip("\n")
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
    parser.add_argument("--paper-seeds", type=int, default=9,
                        help="further seeds of the paper preset on setup A, for the spread of its means (default 9)")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--json", type=Path, help="also write every result document here")
    parser.add_argument("--print-only", action="store_true", help="do not touch docs/benchmarks.md")
    parser.add_argument("--serving", action="store_true",
                        help="run only the safe-serving rows and write their subsection")
    parser.add_argument("--noise-runs", type=int,
                        help="with --serving: runs of the sigma 1.0 and 3.0 rows, in blocks of at most "
                             f"{NOISE_BLOCK_RUNS} (seeds --seed, --seed + 1, ...), pooled (default: --runs)")
    args = parser.parse_args(argv)
    command = "python bench/convergence.py " + " ".join(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    if args.serving:
        commit = _commit()  # the code measured: a commit made during a 40-minute run is not it
        results = run_serving(args.runs, args.seed, args.workers, noise_runs=args.noise_runs)
        subsection = render_serving(results, command.strip(), args.runs, time.perf_counter() - started, commit)
        print(subsection)
        if not args.print_only:
            write_serving_subsection(subsection)
            print(f"Wrote the safe-serving subsection of {DOCS}.")
        return 0
    commit = _commit()

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
        job_list = _jobs(setups, args.paper_seeds)
        jobs = [(label, row, algorithm, overrides, seed, setups[label].to_dict(), references[label])
                for label, row, algorithm, overrides, seed in job_list]
        collected: dict[tuple[str, str], tuple[dict, float]] = {}
        for label, row, summary, seconds in pool.imap_unordered(_run_job, jobs):
            collected[(label, row)] = (summary, seconds)
            last = summary["checkpoints"][-1]
            print(f"[{len(collected)}/{len(jobs)}] {label:>12} {row:<36} {seconds:6.0f}s  "
                  f"f {last['objective']['mean']:.3f}  median r {_number(last['relative_gain']['median'])}  "
                  f"({(time.perf_counter() - started) / 60:.1f} min)",
                  flush=True)

    results: dict[str, dict[str, dict]] = {}
    timings: dict[str, dict[str, float | str]] = {}
    paper_seeds: dict[str, dict] = {}
    for label in setups:
        rows = [row for row_label, row, _, _, seed in job_list if row_label == label and seed is None]
        order = [name for name in MAIN_ALGORITHMS if name in rows] + [r for r in rows if r not in MAIN_ALGORITHMS]
        results[label] = {row: collected[(label, row)][0] for row in order}
        timings[label] = {row: collected[(label, row)][1] for row in order}
        exploration = results[label].get("exploration", {})
        for rule, checkpoints in exploration.get("deploy_rules", {}).items():
            row = f"exploration deploy={rule}"
            results[label][row] = {**exploration, "config": {**exploration["config"], "deploy": rule},
                                   "checkpoints": checkpoints}
            timings[label][row] = "scored on the exploration row's runs"
    paper_seeds = {row: collected[("A", row)][0] for _, row, _, _, seed in job_list if seed is not None}

    section = render(results, timings, speed, command.strip(), args, time.perf_counter() - started, paper_seeds, commit)
    print(section)
    if args.json is not None:
        args.json.write_text(
            json.dumps({"results": results, "paper_seeds": paper_seeds, "throughput": speed}, indent=1) + "\n"
        )
    if not args.print_only:
        write_section(section)
        print(f"Wrote the Convergence section of {DOCS}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
