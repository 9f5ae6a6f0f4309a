"""Where the bounds of tests/service/test_demo.py's live check come from: an offline replica.

The live test resumes the demo (its algorithm ``service.demo.setup.ALGORITHM``, 1-second rounds) and reads
it in 5 rounds from the one where the experiment holds 12,000 sessions. This replica runs the same
controller on the demo's ground truth (the shipped scenario ``demo``: means and noise), without the
service, for many runs at once, and reports over those 5 rounds:

- the deployed mixture's true watch time as a share of the gain of mixing (0 = the best single
  blend that keeps the guardrails, 1 = the best mixture): the test asks for 0.5;
- its true like rate, in standard errors of the controller's own estimate of it, below the
  threshold: the test allows 3;
- the smallest margin of its estimated like rate over the threshold (the test asks it to hold);
- with ``--estimates``, how often the old check on the estimates (deployed objective above 70% of
  the estimated gain of mixing, a flaky failure once) fails. That takes a few minutes.

Usage: ``.venv/bin/python bench/demo_test_bounds.py --runs 2000 --sessions-per-round 630``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pasto.algorithm import AlgorithmConfig, estimate, initial_state, round_generator, update
from pasto.estimators import Statistics
from pasto.optimum import best_mixture, best_single
from pasto.simulate import round_statistics, sample_arms
from service.demo.groundtruth import experiment_objective, load_demo_scenario, true_means
from service.demo.setup import ALGORITHM

WINDOW_SESSIONS = 12_000  # as in tests/service/test_demo.py
WINDOW_ROUNDS = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--sessions-per-round", type=int, default=630,
                        help="the live test sees about 630 (600 a second, 1-second rounds)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--estimates", action="store_true", help="also score the old check on the estimates")
    args = parser.parse_args()

    scenario = load_demo_scenario()
    objective, means = experiment_objective(scenario), true_means(scenario)
    n_metrics, n_arms = means.shape
    mixture, _ = best_mixture(objective, means)
    single, _ = best_single(objective, means)
    watch_single, watch_best = means[0, single], means[0] @ mixture
    # The demo's own algorithm (safe serving), as the live test runs it.
    options = dict(ALGORITHM)
    config = AlgorithmConfig.from_preset(options.pop("preset"), **options)
    rng = np.random.default_rng(args.seed)
    runs, queries = args.runs, args.sessions_per_round
    state = initial_state(config, n_arms, n_metrics, (runs,))
    pooled = Statistics.zeros(n_metrics, n_arms, (runs,))

    first = -(-WINDOW_SESSIONS // queries)  # the first round whose close holds WINDOW_SESSIONS
    share = np.full(runs, np.inf)
    like_rate_z = np.full(runs, np.inf)
    estimate_margin = np.full(runs, np.inf)
    old_check_margin = np.full(runs, np.inf)
    started = time.perf_counter()
    for round_number in range(1, first + WINDOW_ROUNDS):
        served = state.probabilities
        arms = sample_arms(rng, served, queries)  # (runs, Q)
        # As the demo draws a session: its blend's true means plus the scenario's noise.
        values = np.moveaxis(means[:, arms], 0, -1) + scenario.noise.sample(rng, (runs, queries, n_metrics))
        statistics = round_statistics(arms, values, n_arms)
        pooled = pooled + statistics
        state = update(config, objective, state, statistics, pooled, served,
                       rng=round_generator(args.seed, round_number))
        if round_number < first:
            continue
        deployed = state.deployed  # (runs, K)
        share = np.minimum(share, (deployed @ means[0] - watch_single) / (watch_best - watch_single))
        current = estimate(config, state, pooled)
        thresholds = objective.thresholds(current.means)  # (runs, G)
        like_rate_error = np.sqrt(((deployed * current.standard_errors[:, 1]) ** 2).sum(axis=-1))
        like_rate_z = np.minimum(like_rate_z, (deployed @ means[1] - 0.06) / like_rate_error)
        estimated_like_rate = np.einsum("rk,rk->r", current.means[:, 1], deployed)
        estimate_margin = np.minimum(estimate_margin, estimated_like_rate - thresholds[:, 0])
        if args.estimates:
            deployed_value = objective.mixture_value(current.means, deployed, thresholds)
            _, best_value = best_mixture(objective, current.means, thresholds)
            _, single_value = best_single(objective, current.means, thresholds)
            old_check_margin = np.minimum(
                old_check_margin, deployed_value - (single_value + 0.7 * (best_value - single_value)))

    print(f"{runs} runs, {queries} sessions per round, rounds {first}-{first + WINDOW_ROUNDS - 1}, "
          f"seed {args.seed}, {time.perf_counter() - started:.0f} s")
    quantiles = (0.0, 0.001, 0.01, 0.5)
    print("true watch time, share of the gain of mixing (min, 0.1%, 1%, median):",
          np.round(np.quantile(share, quantiles), 3), f"below 0.5 in {(share < 0.5).sum()} runs")
    print("true like rate above 0.06 in standard errors (min, 0.1%, 1%, median):",
          np.round(np.quantile(like_rate_z, quantiles), 2), f"below -3 in {(like_rate_z < -3).sum()} runs")
    print(f"estimated like rate over its threshold: smallest margin {estimate_margin.min():.5f}, "
          f"below it in {(estimate_margin < 0).sum()} runs")
    if args.estimates:
        print(f"old check on the estimates (70% of the estimated gain) fails in {(old_check_margin <= 0).sum()} "
              f"of {runs} runs")


if __name__ == "__main__":
    main()
