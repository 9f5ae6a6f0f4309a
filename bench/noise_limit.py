"""How often can any allocation of a run's observations tell the best mixture from the best single arm?

Setup B (issue 14's noise targets): K = 100 arms, Q = 10 observations per round, noise sigma. For
each run's true means, the deploy-what-you-can-defend rule deploys the best mixture p* over the best
single arm b only when the estimated difference f(V p*) - f(V e_b) exceeds z_0.95 = 1.645 standard
errors (delta method). With N = T Q observations split n_k over the arms, that standard error is
sigma sqrt(sum_k ||c_k||^2 / n_k), c[m, k] = df/dx_m(mu p*) p*_k - df/dx_m(mu e_b) [k = b]; the best
split (Neyman, n_k proportional to ||c_k||) gives sigma sum_k ||c_k|| / sqrt(N). So

    z_max = (f_mix* - f_single*) sqrt(N) / (sigma sum_k ||c_k||)

is the largest z any exploration can reach by round T, even one that knew p* and b from the start.
Runs with z_max < 1.645 cannot be deployed a defended mixture at round T: their r is <= 0, and it is
< 0 unless the deployed single arm is exactly the best one. Prints the share of such runs.

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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
