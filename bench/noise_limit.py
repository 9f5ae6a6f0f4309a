"""How often can any allocation of a run's observations tell the best mixture from the best single arm?

Setup B (the noise targets): K = 100 arms, Q = 10 observations per round, noise sigma. For
each run's true means, the deploy-what-you-can-defend rule deploys the best mixture p* over the best
single arm b only when the estimated difference f(V p*) - f(V e_b) exceeds z_0.95 = 1.645 standard
errors (delta method). With N = T Q observations split n_k over the arms, that standard error is
sigma sqrt(sum_k ||c_k||^2 / n_k), c[m, k] = df/dx_m(mu p*) p*_k - df/dx_m(mu e_b) [k = b]; the best
split (Neyman, n_k proportional to ||c_k||) gives sigma sum_k ||c_k|| / sqrt(N). So

    z_max = (f_mix* - f_single*) sqrt(N) / (sigma sum_k ||c_k||)

is the largest z any exploration can reach by round T, even one that knew p* and b from the start.
Runs with z_max < 1.645 cannot be deployed a defended mixture at round T: their r is <= 0, and it is
< 0 unless the deployed single arm is exactly the best one. Prints the share of such runs.

A second table asks how good the *plug-in* mixture (not defended, just estimated) can be at round
T when exploration is perfect: an oracle that knows p*'s support and the best arm b puts all N
observations on them (n_k proportional to p*_k, b at least 5% of the weight, at least 2 each),
estimates those arms' means with noise sigma / sqrt(n_k) and solves the best mixture over them.
Its r is what no real controller, which must also find the support among the K arms, beats on
average; it separates "the noise forbids it" from "our exploration misses it".

    python bench/noise_limit.py --runs 1000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pasto.cli import load_scenario  # noqa: E402
from pasto.optimum import best_mixture, best_single  # noqa: E402
from pasto.simulate import draw_means  # noqa: E402

Z = 1.6448536269514722


def z_max(objective, means: np.ndarray, sigma: float, observations: float) -> float:
    """The largest deploy z reachable with ``observations`` observations (module docstring); one run."""
    n_arms = means.shape[1]
    mixture, mixture_value = best_mixture(objective, means)
    single, single_value = best_single(objective, means)
    thresholds = objective.thresholds(means)
    one_hot = np.eye(n_arms)[int(single)]
    coefficient = (objective.gradient(means @ mixture, thresholds)[:, None] * mixture[None, :]
                   - objective.gradient(means[:, int(single)], thresholds)[:, None] * one_hot[None, :])
    spread = np.sum(np.sqrt(np.sum(coefficient**2, axis=0)))
    gap = float(mixture_value) - float(single_value)
    return np.inf if spread == 0 else gap * np.sqrt(observations) / (sigma * spread)


def oracle_support_gain(objective, means: np.ndarray, sigma: float, observations: float,
                        rng: np.random.Generator) -> float:
    """r of the plug-in mixture of the oracle that knows p*'s support (module docstring); one run.

    Returns nan when the run has no gain of mixing (f_mix* - f_single* < 1e-9).
    """
    mixture, mixture_value = best_mixture(objective, means)
    single, single_value = best_single(objective, means)
    gap = float(mixture_value) - float(single_value)
    if gap < 1e-9:
        return float("nan")
    arms = np.flatnonzero((mixture > 1e-3) | (np.arange(mixture.size) == int(single)))
    weight = np.where(mixture[arms] > 1e-3, mixture[arms], 0.05)
    counts = np.maximum(observations * weight / weight.sum(), 2.0)
    estimate = means[:, arms] + rng.normal(0.0, sigma, means[:, arms].shape) / np.sqrt(counts)
    solved, _ = best_mixture(objective, estimate)
    plug_in = np.zeros(mixture.size)
    plug_in[arms] = solved
    value = objective.value(means @ plug_in, objective.thresholds(means))
    return (float(value) - float(single_value)) / gap


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rounds = (300, 1000, 3000, 10000)
    print("| sigma | " + " | ".join(f"runs with z_max < 1.645 at T = {t}" for t in rounds) + " | median z_max at 1000 |")
    print("|---:|" + "---:|" * (len(rounds) + 1))
    for sigma in (0.1, 0.3, 1.0, 3.0):
        scenario = load_scenario("setup-b").with_overrides(runs=args.runs, seed=args.seed, noise_std=sigma)
        objective = scenario.objective()
        (means,) = draw_means(scenario, args.runs)
        unit = np.array([z_max(objective, means[run], sigma, 1.0) for run in range(args.runs)])
        shares = [np.mean(unit * np.sqrt(t * scenario.queries_per_round) < Z) for t in rounds]
        median = np.median(unit * np.sqrt(1000 * scenario.queries_per_round))
        print(f"| {sigma} | " + " | ".join(f"{share:.3f}" for share in shares) + f" | {median:.2f} |", flush=True)
    print()
    print("Plug-in mixture of an oracle that knows the optimal support, all observations on it, at T = 1000:")
    print()
    print("| sigma | median r | mean r | r < 0 | r >= 0.9 | runs (gap > 1e-9) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for sigma in (0.1, 0.3, 1.0, 3.0):
        scenario = load_scenario("setup-b").with_overrides(runs=args.runs, seed=args.seed, noise_std=sigma)
        objective = scenario.objective()
        (means,) = draw_means(scenario, args.runs)
        rng = np.random.default_rng(args.seed + 1)
        gains = np.array([oracle_support_gain(objective, means[run], sigma, 1000.0 * scenario.queries_per_round, rng)
                          for run in range(args.runs)])
        gains = gains[~np.isnan(gains)]
        print(f"| {sigma} | {np.median(gains):.3f} | {gains.mean():.3f} | {np.mean(gains < 0):.3f} | "
              f"{np.mean(gains >= 0.9):.3f} | {gains.size} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
