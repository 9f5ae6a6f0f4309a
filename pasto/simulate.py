"""Vectorised Monte-Carlo simulator: many independent runs of a controller on a scenario at once.

All runs advance together; every array carries the runs as its leading batch dimension, so one
round of R runs is a handful of numpy operations, not R Python iterations. Each round:

1. p_t = ``state.probabilities`` (R, K);
2. Q queries per run draw arms i ~ p_t by inverse CDF; each observes all M metrics,
   ``means[:, i] + noise``;
3. the round's ``Statistics`` (counts, sums, sums of squares per metric and arm) are queued; with
   ``delay_rounds = d`` the statistics of round t reach the controller when round t + d closes,
   together with the p they were sampled with (the logged propensities);
4. ``update`` closes the round with what arrived and the pooled statistics of everything so far;
5. the deployed mixture p_hat_t = ``state.deployed`` is scored under the true means in force.

Reported per checkpoint: f(mu p_hat_t), the relative gain
r = (f(mu p_hat_t) - f_single*) / (f_mix* - f_single*) (runs whose gap is below 1e-9 are excluded
and counted), and the mean cumulative regret sum_{s <= t} (f_mix*(s) - f(mu_s p_s)) of the mixtures
actually served.

Randomness: ``SeedSequence(seed)`` is split into one stream for the true means, one for the world
(the arms the queries draw and the noise) and one seed for the controller, whose generator at round
t is ``round_generator(that seed, t)`` as in the service. Every algorithm sees the same true means
for the same seed; what the world draws does not depend on how many numbers the controller draws
(two controllers that serve the same mixtures see the same observations), and the same seed gives
identical results.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pasto import baselines
from pasto.estimators import Statistics
from pasto.objectives import HOLD_TOLERANCE, Objective
from pasto.scenario import Scenario

__all__ = [
    "ALGORITHMS",
    "GAP_TOLERANCE",
    "Policy",
    "References",
    "SimulationResult",
    "make_policy",
    "draw_means",
    "simulation_streams",
    "controller_generator",
    "reference_values",
    "sample_arms",
    "round_statistics",
    "simulate",
    "format_table",
    "quartile_summary",
]

ALGORITHMS = ("paper", "default", "scgd", "thompson")
GAP_TOLERANCE = 1e-9
# Served hard guardrails are judged over the (run, round) pairs after this round.
HOLD_AFTER_ROUND = 20


# --------------------------------------------------------------------------- policies


@dataclass(frozen=True)
class Policy:
    """A controller the simulator can run: a name, its configuration and the two contract functions.

    ``initial(config, n_arms, n_metrics, batch_shape)`` and ``step(config, objective, state,
    round_statistics, pooled_statistics, propensities, rng)`` follow ``pasto.algorithm``'s
    ``initial_state`` / ``update`` (with an ``rng`` for baselines that randomise).
    """

    name: str
    config: Any
    initial: Callable[..., Any] = field(repr=False)
    step: Callable[..., Any] = field(repr=False)

    def initial_state(
        self, n_arms: int, n_metrics: int, batch_shape: tuple[int, ...] = (), objective: Objective | None = None
    ):
        if self.name in ("paper", "default"):
            return self.initial(self.config, n_arms, n_metrics, batch_shape, objective)
        return self.initial(self.config, n_arms, n_metrics, batch_shape)

    def update(self, objective, state, round_statistics, pooled_statistics, propensities, rng):
        return self.step(
            self.config, objective, state, round_statistics, pooled_statistics, propensities, rng
        )

    def config_dict(self) -> dict[str, Any]:
        return self.config.to_dict()


def _algorithm_update(config, objective, state, round_statistics, pooled_statistics, propensities, rng):
    from pasto import algorithm

    return algorithm.update(config, objective, state, round_statistics, pooled_statistics, propensities, rng=rng)


def make_policy(name: str, overrides: dict[str, Any] | None = None) -> Policy:
    """The controller called ``name`` (one of ``ALGORITHMS``) with configuration ``overrides``.

    ``paper`` and ``default`` are the presets of ``pasto.algorithm.AlgorithmConfig``; ``scgd`` and
    ``thompson`` are the baselines of ``pasto.baselines``. An override naming an unknown setting is a
    ``ValueError`` naming it.
    """
    overrides = dict(overrides or {})
    if name in ("paper", "default"):
        from pasto import algorithm

        names = set(algorithm.OPTIONS)
        for key in overrides:
            if key not in names:
                raise ValueError(
                    f"Unknown algorithm setting {key!r}; the settings are {', '.join(sorted(names))}."
                )
        config = algorithm.AlgorithmConfig.from_preset(name, **overrides)
        return Policy(name, config, algorithm.initial_state, _algorithm_update)
    if name == "scgd":
        config = baselines.ScgdConfig.from_dict(overrides)
        return Policy(name, config, baselines.scgd_initial_state, baselines.scgd_update)
    if name == "thompson":
        config = baselines.ThompsonConfig.from_dict(overrides)
        return Policy(name, config, baselines.thompson_initial_state, baselines.thompson_update)
    raise ValueError(f"Unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}.")


# --------------------------------------------------------------------------- true means and optima


@dataclass(frozen=True)
class References:
    """Optimal values under the true means, per run, for each regime (before / after a drift).

    Attributes
    ----------
    best_single : ndarray, shape (regimes, R)
        f_single*: f of the best single arm.
    best_mixture : ndarray, shape (regimes, R)
        f_mix*: f of the best mixture (never below ``best_single``).
    optimum_holds : ndarray of bool, shape (regimes, R, G), or None
        Which guardrails (soft ones too) the best mixture holds, to ``HOLD_TOLERANCE``.
    """

    best_single: np.ndarray
    best_mixture: np.ndarray
    optimum_holds: np.ndarray | None = None


def simulation_streams(seed: int) -> tuple[np.random.Generator, int]:
    """The world's generator (arms drawn by the queries, noise) and the controller's seed.

    Children 1 and 3 of ``SeedSequence(seed)`` (0 draws the true means, 2 the segments' means):
    the controller's draws come from their own stream, so the world's draws do not depend on them.
    """
    children = np.random.SeedSequence(seed).spawn(4)
    return np.random.default_rng(children[1]), int(children[3].generate_state(1, np.uint64)[0])


def controller_generator(controller_seed: int, round_number: int) -> np.random.Generator:
    """The controller's generator at the close of round ``round_number``: the service's derivation
    (``pasto.algorithm.round_generator``) from the simulation's controller seed."""
    from pasto.algorithm import round_generator

    return round_generator(controller_seed, round_number)


def draw_means(scenario: Scenario, runs: int) -> list[np.ndarray]:
    """The true means of each regime: ``[before]`` or ``[before, after drift]``.

    Each is ``(M, K)`` when fixed or ``(runs, M, K)`` when drawn per run; drawn from the seed's
    dedicated stream, so they do not depend on the algorithm.
    """
    means_seed, _ = np.random.SeedSequence(scenario.seed).spawn(2)
    rng = np.random.default_rng(means_seed)
    regimes = [scenario.means.draw(rng, scenario.n_metrics, runs)]
    if scenario.drift is not None:
        regimes.append(scenario.drift.means.draw(rng, scenario.n_metrics, runs))
    return regimes


def reference_values(
    objective: Objective,
    regimes: list[np.ndarray],
    runs: int,
    progress: Callable[[str, int, int], None] | None = None,
) -> References:
    """f_single*, f_mix* and the guardrails the optimum holds, per run and regime.

    One exact solve (:func:`pasto.optimum.solve`) per distinct means, and the best single arm of
    :func:`pasto.optimum.best_single` (both keep the hard guardrails: f_mix* is nan when no mixture
    keeps them, f_single* when no single arm does). ``progress("optimum", runs_solved, runs)`` is
    called after each per-run solve.
    """
    from pasto.optimum import best_single, solve

    singles, mixtures, holds = [], [], []
    hard = objective.hard_indices
    for means in regimes:
        batch = means if means.ndim == 3 else means[None]
        thresholds = objective.thresholds(batch)
        index, single = best_single(objective, batch, thresholds)
        arm_means = np.take_along_axis(batch, np.asarray(index)[..., None, None], axis=-1)[..., 0]
        slack = objective.hard_slack(arm_means, thresholds)
        single = np.where(np.all(slack >= -1e-12 * (1.0 + np.abs(thresholds[..., hard])), axis=-1), single, np.nan)
        mixture = np.empty(len(batch))
        held = np.empty((len(batch), len(objective.guardrails)), dtype=bool)
        for run, run_means in enumerate(batch):
            solution = solve(objective, run_means, thresholds[run])
            mixture[run] = solution.value if solution.feasible else np.nan
            values = _guardrail_values(objective, run_means, solution.probabilities)
            held[run] = values >= thresholds[run] - HOLD_TOLERANCE * np.abs(thresholds[run])
            if progress is not None and means.ndim == 3:
                progress("optimum", run + 1, runs)
        # A single arm is a mixture: the solver's optimum is never below it (up to its tolerance).
        mixture = np.where(np.isnan(mixture), mixture, np.fmax(mixture, single))
        singles.append(np.broadcast_to(single, (runs,)).astype(float))
        mixtures.append(np.broadcast_to(mixture, (runs,)).astype(float))
        holds.append(np.broadcast_to(held, (runs, held.shape[-1])))
    return References(np.stack(singles), np.stack(mixtures), np.stack(holds))


# --------------------------------------------------------------------------- one round


def sample_arms(rng: np.random.Generator, probabilities: np.ndarray, queries: int) -> np.ndarray:
    """Draw ``queries`` arms per run from ``probabilities`` (R, K) by inverse CDF; returns (R, Q).

    All runs are searched at once: run r's CDF is shifted by r so that the R CDFs form one sorted
    array.
    """
    runs, n_arms = probabilities.shape
    cumulative = np.cumsum(probabilities, axis=1)
    cumulative /= cumulative[:, -1:]
    offsets = np.arange(runs, dtype=float)[:, None]
    positions = np.searchsorted((cumulative + offsets).ravel(), (rng.random((runs, queries)) + offsets).ravel(), side="right")
    arms = positions.reshape(runs, queries) - np.arange(runs)[:, None] * n_arms
    # u + r can round up to r + 1, which lands one past the run's last arm.
    return np.minimum(arms, n_arms - 1)


def round_statistics(arms: np.ndarray, values: np.ndarray, n_arms: int) -> Statistics:
    """Statistics of one round: ``arms`` (R, Q) and ``values`` (R, Q, M) -> arrays (R, M, K)."""
    runs, queries, n_metrics = values.shape
    run_index = np.arange(runs)[:, None, None]
    metric_index = np.arange(n_metrics)[None, None, :]
    flat = ((run_index * n_metrics + metric_index) * n_arms + arms[:, :, None]).ravel()
    size = runs * n_metrics * n_arms
    shape = (runs, n_metrics, n_arms)
    counts = np.bincount(flat, minlength=size).reshape(shape).astype(float)
    sums = np.bincount(flat, weights=values.ravel(), minlength=size).reshape(shape)
    squares = np.bincount(flat, weights=(values**2).ravel(), minlength=size).reshape(shape)
    return Statistics(counts, sums, squares)


def _observe(rng, scenario: Scenario, means: np.ndarray, arms: np.ndarray) -> np.ndarray:
    """Observed values (R, Q, M) of the chosen arms under ``means`` (M, K) or (R, M, K)."""
    if means.ndim == 2:
        expected = np.moveaxis(means[:, arms], 0, -1)
    else:
        expected = np.swapaxes(np.take_along_axis(means, arms[:, None, :], axis=2), 1, 2)
    return scenario.noise.observe(rng, expected)


def _mixture_values(objective: Objective, means: np.ndarray, thresholds, probabilities) -> np.ndarray:
    if means.ndim == 2:
        x = probabilities @ means.T
    else:
        x = np.einsum("rmk,rk->rm", means, probabilities)
    return objective.value(x, thresholds)


def _guardrail_values(objective: Objective, means: np.ndarray, probabilities: np.ndarray) -> np.ndarray:
    """Guarded metrics (R, G) of the mixtures (R, K) under ``means`` (M, K) or (R, M, K)."""
    if means.ndim == 2:
        x = probabilities @ means.T
    else:
        x = np.einsum("rmk,rk->rm", means, probabilities)
    return x[..., objective.guardrail_rows]


def _guardrails_hold(objective, means, thresholds, probabilities, mask) -> np.ndarray:
    """Per run: every guardrail in ``mask`` holds to ``HOLD_TOLERANCE`` of its threshold; (R,)."""
    values = _guardrail_values(objective, means, probabilities)
    thresholds = np.broadcast_to(thresholds, values.shape)
    held = values >= thresholds - HOLD_TOLERANCE * np.abs(thresholds)
    return np.all(held[:, mask], axis=-1)


def _breaking_single_arm(objective, means, thresholds, deployed) -> np.ndarray:
    """Per run: the deployed mixture is one arm alone and that arm breaks some guardrail; (R,)."""
    if not objective.guardrails:
        return np.zeros(deployed.shape[0], dtype=bool)
    single = deployed.max(axis=-1) >= 1.0 - 1e-9
    every = np.ones(len(objective.guardrails), dtype=bool)
    return single & ~_guardrails_hold(objective, means, thresholds, deployed, every)


# --------------------------------------------------------------------------- results


def quartile_summary(values: np.ndarray) -> dict[str, float | None]:
    """Mean, median and quartiles of ``values`` (1-D), each None when it is empty: a checkpoint's shape."""
    if values.size == 0:
        return {"mean": None, "median": None, "p25": None, "p75": None}
    p25, median, p75 = np.percentile(values, [25, 50, 75])
    return {"mean": float(values.mean()), "median": float(median), "p25": float(p25), "p75": float(p75)}


@dataclass(frozen=True)
class SimulationResult:
    """What ``simulate`` measured.

    Attributes
    ----------
    summary : dict
        The JSON document (see ``to_json``).
    deployed_values : ndarray, shape (T, R)
        f(mu p_hat_t) per round and run.
    relative_gains : ndarray, shape (T, R)
        r per round and run (nan where the run is excluded).
    served_values : ndarray, shape (T, R)
        f(mu p_t) of the mixture served in each round and run (what users got).
    served_holds : ndarray of bool, shape (T, R)
        Whether the served mixture held every guardrail (soft ones too) that the best mixture
        holds, under the true means in force.
    """

    summary: dict[str, Any]
    deployed_values: np.ndarray = field(repr=False)
    relative_gains: np.ndarray = field(repr=False)
    served_values: np.ndarray = field(repr=False)
    served_holds: np.ndarray = field(repr=False)

    def to_json(self) -> str:
        return json.dumps(self.summary, indent=2)


def simulate(
    scenario: Scenario,
    policy: Policy,
    *,
    references: References | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    deploy_rules: Sequence[str] = (),
) -> SimulationResult:
    """Run ``scenario.runs`` independent runs of ``policy`` for ``scenario.rounds`` rounds at once.

    Parameters
    ----------
    scenario : Scenario
    policy : Policy
        From ``make_policy``.
    references : References, optional
        Precomputed ``reference_values`` for this scenario's seed and runs (the optimum is solved
        per run when means are drawn, which is worth sharing between algorithms).
    progress : callable, optional
        Called as ``progress("optimum", runs_solved, runs)`` while the per-run optima are solved
        (drawn means only) and ``progress("rounds", rounds_done, rounds)`` after every round.
    deploy_rules : sequence of str, optional
        PASTO presets only: also score the mixtures that these deploy rules (``average``,
        ``stage``, ``last``) would recommend along the same run. The deploy rule does not change
        what is served, so this equals running the policy with ``deploy`` overridden, at the
        cost of scoring one more mixture per round. Reported under ``summary["deploy_rules"]``.

    Returns
    -------
    SimulationResult
    """
    if scenario.segments is not None and len(scenario.segments.names) > 1:
        # Its means are per segment: read as one population they would give meaningless figures (one
        # segment is one population: pasto.segmented_simulate checks it reproduces this simulator).
        raise ValueError(
            f"Scenario {scenario.name!r} has segments; simulate it with "
            "pasto.segmented_simulate.simulate_segmented (bench/segments.py), not as one population."
        )
    runs, rounds, queries = scenario.runs, scenario.rounds, scenario.queries_per_round
    n_metrics, n_arms = scenario.n_metrics, scenario.n_arms
    objective = scenario.objective()
    regimes = draw_means(scenario, runs)
    if references is None:
        references = reference_values(objective, regimes, runs, progress)
    expected = (len(regimes), runs)
    if references.best_single.shape != expected or references.best_mixture.shape != expected:
        raise ValueError(
            f"The references have shape {references.best_single.shape} but the scenario needs {expected} "
            "(regimes, runs); compute them with reference_values for the same scenario."
        )
    deploy_rules = tuple(deploy_rules)
    if deploy_rules:
        from pasto import algorithm

        if not isinstance(policy.config, algorithm.AlgorithmConfig):
            raise ValueError(f"deploy_rules applies to the PASTO presets, not to {policy.name!r}.")
        for rule in deploy_rules:
            if rule not in algorithm.DEPLOY_RULES:
                raise ValueError(f"Unknown deploy rule {rule!r}; the rules are {list(algorithm.DEPLOY_RULES)}.")
    thresholds = [objective.thresholds(means) for means in regimes]
    drift_round = scenario.drift.at_round if scenario.drift is not None else rounds + 1

    rng, controller_seed = simulation_streams(scenario.seed)
    state = policy.initial_state(n_arms, n_metrics, (runs,), objective)
    pooled = Statistics.zeros(n_metrics, n_arms, (runs,))
    empty = Statistics.zeros(n_metrics, n_arms, (runs,))
    in_flight: deque[tuple[Statistics, np.ndarray]] = deque()

    # Hard guardrails are judged on what is served and deployed, under the true means in force:
    # held when y >= c - HOLD_TOLERANCE |c| (every hard guardrail at once).
    hard = np.array([bool(getattr(g, "hard", False)) for g in objective.guardrails], dtype=bool)
    served_holds = np.ones((rounds, runs), dtype=bool)
    deployed_holds = np.ones((rounds, runs), dtype=bool)
    deployed_values = np.empty((rounds, runs))
    served_values = np.empty((rounds, runs))
    served_keeps_optimum = np.ones((rounds, runs), dtype=bool)
    every_guardrail = np.ones(len(objective.guardrails), dtype=bool)
    rule_values = {rule: np.empty((rounds, runs)) for rule in deploy_rules}
    regret = np.zeros(runs)
    checkpoint_regret = {}
    checkpoint_regret_error = {}
    checkpoints = set(scenario.checkpoints)
    for round_number in range(1, rounds + 1):
        regime = 0 if round_number < drift_round else 1
        means = regimes[regime]
        served = state.probabilities
        arms = sample_arms(rng, served, queries)
        values = _observe(rng, scenario, means, arms)
        in_flight.append((round_statistics(arms, values, n_arms), served))
        if len(in_flight) > scenario.delay_rounds:
            arrived, propensities = in_flight.popleft()
            pooled = pooled + arrived
        else:
            arrived, propensities = empty, served
        state = policy.update(objective, state, arrived, pooled, propensities,
                              controller_generator(controller_seed, round_number))

        served_values[round_number - 1] = _mixture_values(objective, means, thresholds[regime], served)
        regret += references.best_mixture[regime] - served_values[round_number - 1]
        if references.optimum_holds is not None and every_guardrail.any():
            held = _guardrail_values(objective, means, served) >= (
                thresholds[regime] - HOLD_TOLERANCE * np.abs(thresholds[regime]))
            served_keeps_optimum[round_number - 1] = np.all(held | ~references.optimum_holds[regime], axis=-1)
        deployed_values[round_number - 1] = _mixture_values(objective, means, thresholds[regime], state.deployed)
        if hard.any():
            for holds, mixture in ((served_holds, served), (deployed_holds, state.deployed)):
                holds[round_number - 1] = _guardrails_hold(objective, means, thresholds[regime], mixture, hard)
        for rule, values_by_round in rule_values.items():
            values_by_round[round_number - 1] = _mixture_values(
                objective, means, thresholds[regime], algorithm.deployed_mixture(state, rule)
            )
        if round_number in checkpoints:
            checkpoint_regret[round_number] = float(np.nanmean(regret))
            finite = regret[np.isfinite(regret)]
            checkpoint_regret_error[round_number] = (
                float(np.std(finite, ddof=1) / np.sqrt(finite.size)) if finite.size > 1 else None
            )
        if progress is not None:
            progress("rounds", round_number, rounds)

    regime_by_round = (np.arange(1, rounds + 1) >= drift_round).astype(int)
    single = references.best_single[regime_by_round]
    gap = references.best_mixture[regime_by_round] - single
    included = gap >= GAP_TOLERANCE

    def checkpoint_rows(values: np.ndarray) -> tuple[list[dict[str, Any]], np.ndarray]:
        gains_by_round = np.where(included, (values - single) / np.where(included, gap, 1.0), np.nan)
        rows = []
        for checkpoint in scenario.checkpoints:
            index = checkpoint - 1
            mask = included[index]
            gains = quartile_summary(gains_by_round[index][mask])
            gains["excluded"] = int(runs - mask.sum())
            rows.append(
                {
                    "round": checkpoint,
                    "objective": quartile_summary(values[index]),
                    "relative_gain": gains,
                    "cumulative_regret": {
                        "mean": float(checkpoint_regret[checkpoint]),
                        "standard_error": checkpoint_regret_error[checkpoint],
                    },
                }
            )
        return rows, gains_by_round

    rows, relative_gains = checkpoint_rows(deployed_values)
    summary: dict[str, Any] = {
        "scenario": scenario.name,
        "algorithm": policy.name,
        "config": policy.config_dict(),
        "runs": runs,
        "rounds": rounds,
        "seed": scenario.seed,
        "noise": {"kind": scenario.noise.json_kind(), "std": list(scenario.noise.std)},
        "checkpoints": rows,
    }
    if hard.any():
        after = slice(min(HOLD_AFTER_ROUND, rounds - 1), rounds)
        summary["hard_guardrails"] = {
            "tolerance": HOLD_TOLERANCE,
            "after_round": HOLD_AFTER_ROUND,
            "served_hold_share": float(served_holds[after].mean()),
            "deployed_hold_share": float(deployed_holds[after].mean()),
            "deployed_hold_share_at": {str(c): float(deployed_holds[c - 1].mean()) for c in scenario.checkpoints},
        }
    if every_guardrail.any():
        after = slice(min(HOLD_AFTER_ROUND, rounds - 1), rounds)
        summary["served_keeps_optimum_guardrails"] = float(served_keeps_optimum[after].mean())
    summary["runs_ending_on_a_breaking_arm"] = int(_breaking_single_arm(
        objective, regimes[-1] if drift_round <= rounds else regimes[0],
        thresholds[-1] if drift_round <= rounds else thresholds[0], state.deployed,
    ).sum())
    if deploy_rules:
        summary["deploy_rules"] = {rule: checkpoint_rows(values)[0] for rule, values in rule_values.items()}
    for regime, means in enumerate(regimes):
        if means.ndim == 2 and (regime == 0 or drift_round <= rounds):
            suffix = "" if regime == 0 else "_after_drift"
            summary["best_single" + suffix] = float(references.best_single[regime][0])
            summary["best_mixture" + suffix] = float(references.best_mixture[regime][0])
    return SimulationResult(summary, deployed_values, relative_gains, served_values, served_keeps_optimum)


# --------------------------------------------------------------------------- presentation


def _cell(value: float | None, width: int, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-".rjust(width)
    return f"{value:{width}.{digits}f}"


def format_table(summary: dict[str, Any]) -> str:
    """The result document as a plain-text table (what ``pasto simulate`` prints)."""
    lines = [
        f"scenario {summary['scenario']}  algorithm {summary['algorithm']}  "
        f"runs {summary['runs']}  rounds {summary['rounds']}  seed {summary['seed']}"
    ]
    if "best_mixture" in summary:
        line = f"best single arm f = {summary['best_single']:.4f}   best mixture f = {summary['best_mixture']:.4f}"
        if "best_mixture_after_drift" in summary:
            line += (
                f"   (after drift: {summary['best_single_after_drift']:.4f} / "
                f"{summary['best_mixture_after_drift']:.4f})"
            )
        lines.append(line)
    # Two header lines: what each group of columns measures, then each column's own label.
    groups = (
        f"{'':>6} | {'objective f(mu p_hat), over runs':<35} | {'relative gain r, over runs':<44} | "
        f"{'cumulative':>10}"
    )
    header = (
        f"{'round':>6} | {'mean':>8} {'median':>8} {'p25':>8} {'p75':>8} | "
        f"{'mean':>8} {'median':>8} {'p25':>8} {'p75':>8} {'excluded':>8} | {'regret':>10}"
    )
    lines += [groups, header, "-" * len(header)]
    for row in summary["checkpoints"]:
        objective, gain = row["objective"], row["relative_gain"]
        lines.append(
            f"{row['round']:>6} | {_cell(objective['mean'], 8)} {_cell(objective['median'], 8)} "
            f"{_cell(objective['p25'], 8)} {_cell(objective['p75'], 8)} | "
            f"{_cell(gain['mean'], 8)} {_cell(gain['median'], 8)} {_cell(gain['p25'], 8)} "
            f"{_cell(gain['p75'], 8)} {gain['excluded']:>8} | {_cell(row['cumulative_regret']['mean'], 10, 2)}"
        )
    lines += [
        "objective: f(mu p_hat), the deployed mixture p_hat scored under the true means mu; mean, median and "
        "25th/75th percentiles over the runs.",
        "relative gain: r = (f - f_single*) / (f_mix* - f_single*): 0 at the best single arm, 1 at the optimal "
        "mixture; same statistics.",
        "excluded: runs left out of r because their optimal mixture beats their best single arm by less than "
        f"{GAP_TOLERANCE:g} (r is undefined).",
        "regret: sum over rounds so far of f_mix* - f(mu p_t) for the mixtures p_t actually served, mean over "
        "runs.",
    ]
    return "\n".join(lines)
