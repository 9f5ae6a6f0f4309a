"""Offline replica of the live check (bench/demo_live.py): how often the demo's served traffic breaks a guardrail.

The live check runs the service once; whether its served mixture keeps the demo's hard guardrails
under the true means in *every* round after the 10th is a property of the controller over many
runs. This replica runs the demo's algorithm (``service.demo.setup.ALGORITHM``, the service's
``pasto.algorithm.update`` path) on the demo's ground truth for ``--runs`` runs at once, with the
live check's ``--sessions-per-round`` (1,500 a second, 2-second rounds), and reports per round the
share of runs whose served mixture breaks a guardrail under the truth, then the share of runs that
break one in some round from ``--after`` on (the live check fails in those runs).

Usage: ``.venv/bin/python bench/demo_served_replica.py --runs 100 --rounds 60`` (about 2 minutes).
Options of the algorithm can be overridden for comparison, e.g. ``--option serving_level=0.99``.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from pasto.algorithm import AlgorithmConfig, initial_state, round_generator, update
from pasto.estimators import Statistics
from pasto.simulate import round_statistics, sample_arms
from service.demo.groundtruth import experiment_objective, load_demo_scenario, true_means
from service.demo.setup import ALGORITHM


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--sessions-per-round", type=int, default=3000)
    parser.add_argument("--after", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--option", action="append", default=[],
                        help="NAME=JSON overriding an option of the demo's algorithm")
    args = parser.parse_args(argv)

    scenario = load_demo_scenario()
    objective, means = experiment_objective(scenario), true_means(scenario)
    thresholds = objective.thresholds(means)
    rows = objective.guardrail_rows
    options = dict(ALGORITHM)
    preset = options.pop("preset")
    for override in args.option:
        name, _, value = override.partition("=")
        options[name] = json.loads(value)
    config = AlgorithmConfig.from_preset(preset, **options)
    n_metrics, n_arms = means.shape
    rng = np.random.default_rng(args.seed)
    runs, queries = args.runs, args.sessions_per_round
    state = initial_state(config, n_arms, n_metrics, (runs,))
    pooled = Statistics.zeros(n_metrics, n_arms, (runs,))
    broken_after = np.zeros(runs, dtype=bool)
    worst = np.zeros(runs)
    started = time.perf_counter()
    print(f"options {options}; {runs} runs, {queries} sessions per round")
    print("round  broken runs  worst shortfall (of threshold)  mean served like  mean served watch")
    for round_index in range(args.rounds):
        served = state.probabilities  # p_t: round t's traffic
        guarded = served @ means[rows].T  # (runs, G)
        shortfall = np.max((thresholds - guarded) / np.abs(thresholds), axis=-1)
        broken = shortfall > 0
        if round_index >= args.after:
            broken_after |= broken
            worst = np.maximum(worst, shortfall)
        print(f"{round_index:5d}  {broken.mean():11.2%}  {max(0.0, shortfall.max()):30.4%}"
              f"  {guarded[:, 0].mean():16.5f}  {(served @ means[0]).mean():17.3f}")
        arms = sample_arms(rng, served, queries)
        values = np.moveaxis(means[:, arms], 0, -1) + scenario.noise.sample(rng, (runs, queries, n_metrics))
        statistics = round_statistics(arms, values, n_arms)
        pooled = pooled + statistics
        state = update(config, objective, state, statistics, pooled, served,
                       rng=round_generator(args.seed, round_index + 1))
    print(f"runs breaking a guardrail in some round from {args.after} on: {broken_after.mean():.1%} "
          f"({broken_after.sum()} of {runs}); worst shortfall {worst.max():.3%} of the threshold; "
          f"beyond 0.1%: {(worst > 0.001).mean():.1%}; {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
