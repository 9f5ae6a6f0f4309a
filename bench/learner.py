"""What the default learner serves, beside the Thompson best-arm bandit on the same runs.

For each scenario row, the ``default`` preset and ``thompson`` run on the same seed (hence the same
true means and the same optimum per run). Per run: the deployed relative gain r at the last round,
the served objective averaged over the rounds (what users got), the served regret (sum over rounds
of f_mix* - f(mu p_t)) and whether every served mixture holds the guardrails the best mixture holds
(soft ones too) under the true means. Reported with 90% bootstrap intervals over runs:

- r: mean, median, share of runs below 0 (deployed worse than the best single arm);
- the share of runs whose gap an oracle's split of the row's observations could resolve at the
  deploy level (:func:`resolvable_z`; soft guardrails only), and r's mean over them: a run whose
  gap no split of its data resolves deploys the best single arm (r = 0) by design;
- the share of runs whose served objective is above Thompson's;
- the median of the paired ratio (pasto's served regret / Thompson's);
- the share of (run, round) pairs after round 20 whose served mixture keeps the optimum's guardrails.

Run: ``python bench/learner.py --runs 100 --seed 100`` (rows in parallel over ``--workers``
processes); ``--rows online-soft,demo-soft`` picks rows; ``--write-docs`` replaces the "Learner:
served against Thompson" section of docs/benchmarks.md. Tuning used seed 11 (20 runs); acceptance
figures use a fresh seed block.
"""

from __future__ import annotations

import os

for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import argparse  # noqa: E402
import multiprocessing  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from scipy.special import ndtri  # noqa: E402

from pasto.cli import load_scenario  # noqa: E402
from pasto.optimum import best_single, solve  # noqa: E402
from pasto.serving import ServingConfig  # noqa: E402
from pasto.simulate import draw_means, make_policy, reference_values, simulate  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADING = "## Learner: served against Thompson"

# label: (scenario, noise std override, rounds)
ROWS = {
    "online-hard": ("online-hard", None, 1000),
    "online-soft": ("online-soft", None, 1000),
    "online-hard-wide": ("online-hard-wide", None, 1000),
    "online-soft-wide": ("online-soft-wide", None, 1000),
    "online-mixed": ("online-mixed", None, 1000),
    "demo-soft": ("demo-soft", None, 300),
    "demo": ("demo", None, 300),
    "setup-a": ("setup-a", None, 2000),
    "B sigma=0.3": ("setup-b", 0.3, 1000),
    "B sigma=1.0": ("setup-b", 1.0, 1000),
    "B sigma=3.0": ("setup-b", 3.0, 1000),
    "B hard": ("setup-b-hard", None, 300),
    "A drift": ("setup-a-drift", None, 2000),
}
AFTER_ROUND = 20


# A run's gap is resolvable when it is at least this many standard errors of its estimate: the
# default deploy test's one-sided level (1.645 at 95%).
RESOLVABLE_Z = float(ndtri(ServingConfig().deploy_level))


def resolvable_z(objective, means, noise, observations):
    """Per run: gap / (standard error of the estimated gap with the run's observations split best).

    The gap is f(mu p*) - f(mu e_b), p* the optimum and b the best single arm under the true means;
    its estimate from arm means seen n_k times has variance sum_k a_k^2 / n_k with a_k^2 = sum_m
    c_mk^2 sigma_mk^2 (c the gap's gradient in arm k's mean of metric m, thresholds of relative
    guardrails included), least, (sum_k a_k)^2 / N, when n_k is proportional to a_k (Neyman). An
    oracle that knew which arms matter could defend the mixture at the deploy level only where
    this is at least RESOLVABLE_Z. NaN for objectives with hard guardrails (their gap needs
    feasibility resolved too) and for runs without a gap.
    """
    if any(guardrail.hard for guardrail in objective.guardrails):
        return np.full(means.shape[0], np.nan)
    z = np.full(means.shape[0], np.nan)
    for run, mu in enumerate(means):
        sigma = noise.standard_deviations(mu)  # (M, K): a conversion's spread follows its mean
        optimum = solve(objective, mu).probabilities
        single = np.zeros_like(optimum)
        single[int(best_single(objective, mu)[0])] = 1.0

        def gap(m, optimum=optimum, single=single):
            thresholds = objective.thresholds(m)
            return objective.value(m @ optimum, thresholds) - objective.value(m @ single, thresholds)

        base = gap(mu)
        if base <= 1e-12:
            continue
        step = 1e-6 * max(1.0, float(np.abs(mu).max()))
        squares = np.zeros(mu.shape[1])
        for metric in range(mu.shape[0]):
            for arm in range(mu.shape[1]):
                moved = mu.copy()
                moved[metric, arm] += step
                squares[arm] += ((gap(moved) - base) / step * sigma[metric, arm]) ** 2
        z[run] = base / (np.sqrt(squares).sum() / np.sqrt(observations))
    return z


def _run(job):
    label, algorithm, runs, seed = job
    name, sigma, rounds = ROWS[label]
    scenario = load_scenario(name).with_overrides(runs=runs, rounds=rounds, seed=seed, noise_std=sigma)
    means = draw_means(scenario, runs)
    references = reference_values(scenario.objective(), means, runs)
    started = time.perf_counter()
    result = simulate(scenario, make_policy(algorithm), references=references)
    best = references.best_mixture[-1]
    # Drift rows have two optima (their r is against the second, on stale and fresh data): left out.
    z = (resolvable_z(scenario.objective(), np.broadcast_to(means[0], (runs,) + means[0].shape[-2:]),
                      scenario.noise, scenario.queries_per_round * rounds)
         if algorithm == "default" and len(means) == 1 else np.full(runs, np.nan))
    return label, algorithm, seed, {
        "resolvable_z": z,
        "r": result.relative_gains[-1],
        "deployed": result.deployed_values[-1],
        "served": result.served_values.mean(axis=0),
        # Served regret against one optimum (a drift row has two: left out).
        "regret": ((best[None] - result.served_values).sum(axis=0) if references.best_mixture.shape[0] == 1
                   else np.full(runs, np.nan)),
        "keeps": result.served_holds[AFTER_ROUND:].mean(axis=0),
        "seconds": time.perf_counter() - started,
    }


def _interval(values, statistic, rng, draws=2000):
    values = np.asarray(values, dtype=float)
    values = values[~np.isnan(values)]
    if values.size == 0:
        return (float("nan"),) * 3
    picks = rng.integers(0, values.size, (draws, values.size))
    boot = np.array([statistic(values[p]) for p in picks])
    return float(statistic(values)), float(np.percentile(boot, 5)), float(np.percentile(boot, 95))


def summarise(label, default, thompson, rng):
    r = default["r"]
    ratio = default["regret"] / np.maximum(thompson["regret"], 1e-12)
    z = default["resolvable_z"]
    resolvable = np.where(np.isnan(r) | np.isnan(z), np.nan, z >= RESOLVABLE_Z)
    return {
        "label": label,
        "runs": int(r.size),
        "r_mean": _interval(r, np.mean, rng),
        "r_median": _interval(r, np.median, rng),
        "resolvable": _interval(resolvable, np.mean, rng),
        "r_mean_resolvable": _interval(np.where(resolvable == 1, r, np.nan), np.mean, rng),
        "r_negative": _interval(r, lambda v: np.mean(v < 0), rng),
        "served_above_thompson": _interval(default["served"] > thompson["served"], np.mean, rng),
        "deployed_below_thompson": _interval(default["deployed"] < thompson["deployed"] - 1e-12, np.mean, rng),
        "regret_ratio_median": _interval(ratio, np.median, rng),
        "served_regret": tuple(float(np.mean(v)) if np.isfinite(v).all() else float("nan")
                              for v in (default["regret"], thompson["regret"])),
        "keeps": (float(np.mean(default["keeps"])), float(np.mean(thompson["keeps"]))),
        "seconds": (default["seconds"], thompson["seconds"]),
    }


def _cell(triple, digits=3):
    value, low, high = triple
    if np.isnan(value):
        return "-"
    return f"{value:.{digits}f} ({low:.{digits}f} to {high:.{digits}f})"


def table(rows, runs, seed, commit, chunk=0):
    command = f"python bench/learner.py --runs {runs} --seed {seed}" + (f" --chunk {chunk}" if chunk else "")
    lines = [
        HEADING,
        "",
        f"`{command}` at {commit}: the `default` preset and Thompson "
        "best-arm sampling on the same runs (same true means). r is the deployed relative gain at the last "
        "round (runs whose best mixture is no better than the best single arm are left out); \"resolvable\" is "
        f"the share of runs whose gap is at least {RESOLVABLE_Z:.3f} standard errors of its estimate with the row's "
        "observations split best for it (`resolvable_z`; soft guardrails only), and r's mean over them; served figures "
        "are what users got, round by round, under the true means; 90% bootstrap intervals over runs. "
        f"\"Keeps\" is the share of (run, round) pairs after round {AFTER_ROUND} whose served mixture holds "
        "every guardrail the best mixture holds (pasto / Thompson).",
        "",
        "| row | runs | r mean | r median | r < 0 | resolvable | r mean, resolvable runs | deployed below Thompson "
        "| served above Thompson | served regret ratio (median) | served regret pasto / Thompson "
        "| keeps pasto / Thompson |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['label']} | {row['runs']} | {_cell(row['r_mean'])} | {_cell(row['r_median'])} | "
            f"{_cell(row['r_negative'])} | {_cell(row['resolvable'])} | {_cell(row['r_mean_resolvable'])} | "
            f"{_cell(row['deployed_below_thompson'])} | "
            f"{_cell(row['served_above_thompson'])} | "
            f"{_cell(row['regret_ratio_median'])} | {row['served_regret'][0]:.1f} / {row['served_regret'][1]:.1f} | "
            f"{row['keeps'][0]:.3f} / {row['keeps'][1]:.3f} |")
    return "\n".join(lines) + "\n"


def write_docs(section: str) -> None:
    text = DOCS.read_text()
    pattern = re.compile(rf"^{re.escape(HEADING)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(section + "\n", text)
    else:
        text = text.rstrip() + "\n\n" + section
    DOCS.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--seed", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=0,
                        help="split each row into chunks of this many runs, seeded seed, seed + 1, ... (so one "
                             "row's runs spread over the workers); 0: one chunk of --runs seeded --seed")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    labels = [label.strip() for label in args.rows.split(",") if label.strip()]
    unknown = [label for label in labels if label not in ROWS]
    if unknown:
        raise SystemExit(f"Unknown row(s) {unknown}; the rows are {list(ROWS)}.")
    # The commit the runs start at (the code they measure).
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    size = args.chunk if args.chunk > 0 else args.runs
    chunks = [(min(size, args.runs - first), args.seed + index) for index, first in enumerate(range(0, args.runs, size))]
    jobs = [(label, algorithm, runs, seed) for label in labels for algorithm in ("default", "thompson")
            for runs, seed in chunks]
    with multiprocessing.get_context("fork").Pool(args.workers) as pool:
        parts = {(label, algorithm, seed): value for label, algorithm, seed, value in pool.imap_unordered(_run, jobs)}
    # The chunks' runs in seed order, every figure per run.
    results = {(label, algorithm): {key: (np.concatenate([parts[label, algorithm, seed][key] for _, seed in chunks])
                                          if key != "seconds" else sum(parts[label, algorithm, seed][key]
                                                                       for _, seed in chunks))
                                    for key in parts[label, algorithm, chunks[0][1]]}
               for label in labels for algorithm in ("default", "thompson")}
    rng = np.random.default_rng(0)
    rows = [summarise(label, results[label, "default"], results[label, "thompson"], rng) for label in labels]
    section = table(rows, args.runs, args.seed, commit, args.chunk)
    print(section)
    if args.write_docs:
        write_docs(section)


if __name__ == "__main__":
    main()
