"""The noise rows for the default's serving rules, on the same runs.

Setup B at sigma 1.0 and 3.0, round 1000: the default preset (``default``: posterior exploration
outside the plug-in support with 4 draws, its mass scaled by 2, the same as ``posterior``), the
default before the scale (``posterior-scale1``: the mass itself), the default with half of an
undecided run's own path after a best-arm bandit (``best_arm``), the default before posterior
exploration (``conservative-0``: no posterior draws), the undecided-run rules of branch noise2 without posterior
exploration (``best_arm-0``: half of an undecided run's traffic after a best-arm bandit;
``mixture_draw-0``: all of it to the optimum of one posterior draw of the means;
``mixture_draw_half-0``: half of it), and the Thompson best-arm bandit; with the share of the
observations that land on the arms of each run's true optimal mixture and the fewest observations
any of them gets. Same seed, hence the same true means and optima, for every algorithm. Runs one
job at a time (the machine is shared); every finished job is cached under ``--cache`` (keyed by
sigma, rule, a digest of the rule's resolved configuration, runs, rounds, seed), so an interrupted
run resumes. ``default`` and ``posterior`` are the same configuration today, named apart so that a
table says which row is the default (asking for both simulates it twice; the command below asks for
``posterior``).

    python bench/noise_mixture.py --runs 500 --rules posterior,posterior-scale1,conservative-0,mixture_draw-0,thompson

prints the markdown table of docs/benchmarks.md's "Noise rows: posterior exploration outside the
support".
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pasto.algorithm import AlgorithmConfig  # noqa: E402
from pasto.cli import load_scenario  # noqa: E402
from pasto.optimum import best_mixture  # noqa: E402
from pasto.simulate import draw_means, make_policy, reference_values, simulate  # noqa: E402

# Each rule is a set of options of the default preset ("thompson" is the best-arm bandit). The
# "-0" rules set serving_posterior_draws = 0: "conservative-0" is the default before posterior
# exploration outside the support, the others are the undecided-run rules of branch noise2 as they
# were measured there; "posterior" (4 draws, scale 2) is the default's setting, named for the
# tables; "posterior-scale1" is the default before serving_posterior_scale (the mass unscaled);
# "best_arm" is the default with the opt-in best-arm half for undecided runs.
RULE_OPTIONS = {
    "default": {},
    "posterior": {"serving_posterior_draws": 4, "serving_posterior_scale": 2.0},
    "posterior-scale1": {"serving_posterior_draws": 4, "serving_posterior_scale": 1.0},
    "best_arm": {"serving_undecided": "best_arm"},
    "conservative-0": {"serving_undecided": "conservative", "serving_posterior_draws": 0},
    "best_arm-0": {"serving_undecided": "best_arm", "serving_posterior_draws": 0},
    "mixture_draw-0": {"serving_undecided": "mixture_draw", "serving_posterior_draws": 0},
    "mixture_draw_half-0": {"serving_undecided": "mixture_draw_half", "serving_posterior_draws": 0},
    "thompson": None,
}
RULES = tuple(RULE_OPTIONS)
SIGMAS = (1.0, 3.0)


def _configuration_digest(options: dict | None) -> str:
    """8 hex digits of the rule's resolved configuration (every option of the default preset with the
    rule's overrides; "thompson" for the bandit), so that a cached job is not reused once a default
    it relied on changes (``default`` is ``{}``: whatever the default is when it runs)."""
    resolved = "thompson" if options is None else json.dumps(
        AlgorithmConfig.from_preset("default", **options).to_dict(), sort_keys=True)
    return hashlib.sha256(resolved.encode()).hexdigest()[:8]


def _job(name: str, sigma: float | None, rule: str, runs: int, rounds: int, seed: int, cache: Path, references,
         support) -> dict:
    if rule not in RULE_OPTIONS:
        raise ValueError(f"Unknown rule {rule!r}; the rules are {list(RULE_OPTIONS)}.")
    options = RULE_OPTIONS[rule]
    path = cache / f"{name}_sigma{sigma}_{rule}_{_configuration_digest(options)}_runs{runs}_rounds{rounds}_seed{seed}.npz"
    if path.exists():
        data = np.load(path)
        return {key: data[key] for key in data.files}
    scenario = load_scenario(name).with_overrides(runs=runs, rounds=rounds, seed=seed, noise_std=sigma)
    policy = make_policy("thompson") if options is None else make_policy("default", options)
    # The expected observations per arm: the served mixtures summed over the rounds (times the
    # queries per round), read off every state the controller returns.
    served = np.zeros(support.shape)

    def step(*arguments):
        state = policy.step(*arguments)
        served[...] += state.probabilities.reshape(served.shape)
        return state

    started = time.perf_counter()
    result = simulate(scenario, dataclasses.replace(policy, step=step), references=references)
    last = result.summary["checkpoints"][-1]
    observations = served * scenario.queries_per_round
    record = {
        "f": result.deployed_values[-1],
        "r": result.relative_gains[-1],
        # Share of the observations on the arms of the true optimal mixture, and the fewest
        # observations of any of them, per run.
        "support_share": (observations * support).sum(axis=-1) / observations.sum(axis=-1),
        "support_fewest": np.where(support, observations, np.inf).min(axis=-1),
        "served_regret": np.array(last["cumulative_regret"]["mean"]),
        "served_regret_se": np.array(last["cumulative_regret"].get("standard_error", np.nan)),
        "seconds": np.array(time.perf_counter() - started),
    }
    np.savez(path, **record)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/noise_mixture"))
    parser.add_argument("--rules", default=",".join(RULES), help="comma-separated subset of " + ",".join(RULES))
    parser.add_argument("--sigmas", default=",".join(str(s) for s in SIGMAS),
                        help="comma-separated noise levels; 'own' keeps the scenario's")
    parser.add_argument("--scenario", default="setup-b", help="a soft-guardrail scenario (setup-b, setup-a)")
    arguments = parser.parse_args(argv)
    arguments.cache.mkdir(parents=True, exist_ok=True)
    rules = arguments.rules.split(",")
    sigmas = [None if s == "own" else float(s) for s in arguments.sigmas.split(",")]
    # The sigmas share the seed, hence the true means and the optima.
    scenario = load_scenario(arguments.scenario).with_overrides(
        runs=arguments.runs, rounds=arguments.rounds, seed=arguments.seed)
    means = draw_means(scenario, scenario.runs)
    per_run = np.broadcast_to(means[0], (scenario.runs,) + means[0].shape[-2:])
    references = reference_values(scenario.objective(), means, scenario.runs)
    # The arms of each run's optimal mixture (share above 1e-3).
    support = np.array([best_mixture(scenario.objective(), run_means)[0] > 1e-3 for run_means in per_run])
    results = {}
    for sigma in sigmas:
        for rule in rules:
            record = _job(arguments.scenario, sigma, rule, arguments.runs, arguments.rounds, arguments.seed, arguments.cache, references, support)
            results[sigma, rule] = record
            print(f"sigma {sigma} {rule:<18} {float(record['seconds']):6.0f}s  median r "
                  f"{np.nanmedian(record['r']):.3f}  served regret {float(record['served_regret']):.1f}", flush=True)
    print()
    print(f"{arguments.runs} runs, round {arguments.rounds}, seed {arguments.seed}; a share of runs has a "
          f"Monte-Carlo standard error of at most {0.5 / math.sqrt(arguments.runs):.3f}.")
    print()
    print(f"{arguments.scenario}:")
    print()
    print("| sigma | rule | median r | mean r | r < 0 | f below thompson | mean f | median f | served regret (se) "
          "| observations on the optimal support (median) | fewest on a support arm (median) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (sigma, rule), record in results.items():
        r = record["r"][~np.isnan(record["r"])]
        thompson = results.get((sigma, "thompson"))
        below = "" if thompson is None or rule == "thompson" else f"{np.mean(record['f'] < thompson['f'] - 1e-12):.0%}"
        print(f"| {sigma} | {rule} | {np.median(r):.3f} | {np.mean(r):.3f} | {np.mean(r < 0):.0%} | {below} "
              f"| {np.mean(record['f']):.3f} | {np.median(record['f']):.3f} | {float(record['served_regret']):.1f} "
              f"({float(record['served_regret_se']):.1f}) | {np.median(record['support_share']):.0%} "
              f"| {np.median(record['support_fewest']):.0f} |")


if __name__ == "__main__":
    main()
