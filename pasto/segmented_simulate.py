"""Monte-Carlo simulator for per-segment mixtures (scenario key ``segments``).

Each round, every run draws Q queries; a query's segment is drawn by the traffic shares, its arm
from that segment's served mixture, and it observes every metric under the segment's true means
plus the scenario's noise. The round's statistics (R, S, M, K) go to
:func:`pasto.segments.segmented_update`. With one segment the draws are exactly those of
:func:`pasto.simulate.simulate` (same streams, same order), so one segment reproduces the
unsegmented simulator.

Oracle values under the true means, per run: the best single arm served everywhere, the best
global mixture (one p for every segment), the best per-segment mixtures with independent
(per-segment) guardrails and with the scenario's scopes (global guardrails on the traffic-weighted
platform value).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pasto.estimators import Statistics
from pasto.objectives import Objective
from pasto.scenario import Scenario
from pasto.segments import (
    SegmentedConfig,
    _solve_tied,
    initial_segmented_state,
    resolve_thresholds,
    segment_statistics,
    segmented_update,
    segmented_values,
    solve_joint,
)
from pasto.simulate import controller_generator, draw_means, sample_arms, simulation_streams

__all__ = ["SegmentOracles", "draw_segment_means", "segment_oracles", "SegmentedResult", "simulate_segmented"]


def draw_segment_means(scenario: Scenario, runs: int) -> np.ndarray:
    """True means per run and segment, (runs, S, M, K); ``arms`` gives the base of a ``spread``."""
    if scenario.segments is None:
        raise ValueError(f"The scenario {scenario.name!r} has no 'segments' key.")
    base = draw_means(scenario, runs)[0]
    _, _, segments_seed = np.random.SeedSequence(scenario.seed).spawn(3)
    drawn = scenario.segments.draw(np.random.default_rng(segments_seed), base, runs)
    n_segments = len(scenario.segments.names)
    return np.broadcast_to(drawn, (runs, n_segments, scenario.n_metrics, scenario.n_arms)).copy()


@dataclass(frozen=True)
class SegmentOracles:
    """Oracle platform values per run, shape (R,); the best global mixture (R, K); the joint
    optimum's shadow prices of the global guardrails (R, G), which price a segment's use of them."""

    best_single: np.ndarray
    best_global: np.ndarray
    independent: np.ndarray
    joint: np.ndarray
    global_mixture: np.ndarray = field(repr=False)
    joint_prices: np.ndarray = field(repr=False, default=None)


def _single_arm_value(objective: Objective, means, shares, scopes, thresholds) -> float:
    """The best arm served to every segment that meets every guardrail (-inf if none)."""
    n_segments, _, n_arms = means.shape
    best = -np.inf
    for arm in range(n_arms):
        p = np.zeros((n_segments, n_arms))
        p[:, arm] = 1.0
        value, slack, primary = segmented_values(objective, means, shares, p, thresholds)
        x = means[:, objective.guardrail_rows, arm]
        per_segment_ok = all(
            scope == "global" or np.all(x[:, j] >= thresholds[:, j] - 1e-12) for j, scope in enumerate(scopes)
        )
        global_ok = all(scope == "segment" or slack[j] >= -1e-12 for j, scope in enumerate(scopes))
        if per_segment_ok and global_ok:
            best = max(best, float(value))
    return best


def segment_oracles(objective: Objective, means: np.ndarray, shares: np.ndarray, scopes) -> SegmentOracles:
    """The four oracle values per run for true means (R, S, M, K)."""
    runs = means.shape[0]
    single, tied, independent, joint = (np.empty(runs) for _ in range(4))
    mixtures = np.empty((runs, means.shape[-1]))
    prices = np.empty((runs, len(scopes)))
    segment_scopes = ["segment"] * len(scopes)
    for run in range(runs):
        thresholds = resolve_thresholds(objective, means[run], shares, scopes)
        single[run] = _single_arm_value(objective, means[run], shares, scopes, thresholds)
        mixtures[run] = _solve_tied(objective, means[run], shares, scopes)
        tied_p = np.broadcast_to(mixtures[run], (means.shape[1], means.shape[-1]))
        tied[run] = segmented_values(objective, means[run], shares, tied_p, thresholds)[0]
        independent[run] = solve_joint(objective, means[run], shares, segment_scopes).value
        solution = solve_joint(objective, means[run], shares, scopes)
        joint[run], prices[run] = solution.value, solution.global_shadow_prices
    return SegmentOracles(single, tied, independent, joint, mixtures, prices)


@dataclass(frozen=True)
class SegmentedResult:
    """What :func:`simulate_segmented` measured.

    Attributes
    ----------
    oracles : SegmentOracles
    deployed_values : ndarray, shape (C, R)
        Platform value of the deployed per-segment mixtures at each checkpoint.
    global_slack : ndarray, shape (C, R, G)
        sum_s w_s (y_{s,j} - c_{s,j}) of the deployed mixtures under the true means.
    segment_primary : ndarray, shape (C, R, S)
        Each segment's primary value under its deployed mixture.
    global_segment_primary : ndarray, shape (R, S)
        Each segment's primary value under the best global mixture.
    checkpoints : tuple of int
    shares : ndarray, shape (S,)
    """

    oracles: SegmentOracles
    deployed_values: np.ndarray
    global_slack: np.ndarray
    segment_primary: np.ndarray
    global_segment_primary: np.ndarray
    checkpoints: tuple[int, ...]
    shares: np.ndarray


def simulate_segmented(
    scenario: Scenario,
    config: SegmentedConfig,
    *,
    oracles: SegmentOracles | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> SegmentedResult:
    """Run ``scenario.runs`` runs of the segmented controller for ``scenario.rounds`` rounds at once."""
    if scenario.segments is None:
        raise ValueError(f"The scenario {scenario.name!r} has no 'segments' key.")
    if scenario.drift is not None or scenario.delay_rounds:
        raise ValueError("The segmented simulator does not model drift or delayed observations.")
    runs, rounds, queries = scenario.runs, scenario.rounds, scenario.queries_per_round
    n_metrics, n_arms = scenario.n_metrics, scenario.n_arms
    objective = scenario.objective()
    shares = np.asarray(scenario.segments.shares)
    n_segments = shares.size
    scopes = scenario.segments.scopes
    if tuple(config.scopes) != tuple(scopes):
        raise ValueError(f"The config's guardrail scopes {list(config.scopes)} differ from the scenario's {list(scopes)}.")
    means = draw_segment_means(scenario, runs)
    if oracles is None:
        oracles = segment_oracles(objective, means, shares, scopes)
    thresholds = np.stack([resolve_thresholds(objective, means[r], shares, scopes) for r in range(runs)])

    rng, controller_seed = simulation_streams(scenario.seed)
    state = initial_segmented_state(config, n_segments, n_arms, n_metrics, (runs,))
    pooled = Statistics.zeros(n_metrics, n_arms, (runs, n_segments))
    cumulative_shares = np.cumsum(shares)
    run_index = np.arange(runs)[:, None]
    checkpoints = scenario.checkpoints
    deployed_values = np.empty((len(checkpoints), runs))
    slack = np.empty((len(checkpoints), runs, len(scopes)))
    primary = np.empty((len(checkpoints), runs, n_segments))
    for round_number in range(1, rounds + 1):
        served = state.probabilities  # (R, S, K)
        if n_segments == 1:
            # Exactly pasto.simulate's draws: no segment draw, arms for all Q queries at once.
            segments = np.zeros((runs, queries), dtype=np.intp)
            arms = sample_arms(rng, served[:, 0], queries)
        else:
            segments = np.minimum(np.searchsorted(cumulative_shares, rng.random((runs, queries)), side="right"), n_segments - 1)
            per_query = served[run_index, segments].reshape(runs * queries, n_arms)
            arms = sample_arms(rng, per_query, 1).reshape(runs, queries)
        expected = means[run_index, segments, :, arms]  # (R, Q, M)
        values = scenario.noise.observe(rng, expected)
        statistics = segment_statistics(segments, arms, values, n_segments, n_arms)
        pooled = pooled + statistics
        state = segmented_update(config, objective, state, statistics, pooled, shares,
                                 rng=controller_generator(controller_seed, round_number))
        if round_number in checkpoints:
            index = checkpoints.index(round_number)
            deployed_values[index], slack[index], primary[index] = segmented_values(
                objective, means, shares, state.deployed, thresholds
            )
        if progress is not None:
            progress("rounds", round_number, rounds)
    tied = np.broadcast_to(oracles.global_mixture[:, None, :], (runs, n_segments, n_arms))
    global_primary = segmented_values(objective, means, shares, tied, thresholds)[2]
    return SegmentedResult(oracles, deployed_values, slack, primary, global_primary, checkpoints, shares)
