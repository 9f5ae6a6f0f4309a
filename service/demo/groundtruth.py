"""The demo's ground truth: its blends, objective, true per-session means and session simulation.

Blend k puts weight t_k on watch time and 1 - t_k on likes and shares (70/30). Compromise blends
dilute both effects (the means are convex in t), so no single blend is good at watch time and likes
at once, while randomising between an engagement blend and a social blend is: the situation where a
mixture strictly beats every single setting. :func:`check_scenario` proves it at startup with
:func:`pasto.optimum.best_mixture` / :func:`pasto.optimum.best_single`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pasto.objectives import Objective
from pasto.optimum import best_mixture, best_single

METRICS = ("watch_time", "like_rate", "share_rate")
ITEMS_PER_SESSION = 20
N_BLENDS = 20
PRODUCTION_BLEND = 10


@dataclass(frozen=True)
class Scenario:
    """The demo's ground truth: arms, objective and the true per-session means."""

    arms: tuple[dict, ...]
    objective_spec: dict
    means: np.ndarray  # (M, K) true mean of each metric per arm, rows in METRICS order

    @property
    def arm_names(self) -> list[str]:
        return [arm["name"] for arm in self.arms]

    def objective(self) -> Objective:
        return Objective.from_spec(list(METRICS), self.objective_spec, arm_names=self.arm_names)


def build_scenario() -> Scenario:
    t = np.linspace(0.0, 1.0, N_BLENDS)
    arms = tuple(
        {"name": f"blend-{k:02d}",
         "params": {"w_watch": round(float(t[k]), 4), "w_like": round(0.7 * (1 - float(t[k])), 4),
                    "w_share": round(0.3 * (1 - float(t[k])), 4)}}
        for k in range(N_BLENDS)
    )
    means = np.stack([
        4.0 + 2.0 * t**2,               # watch_time: minutes per session
        0.03 + 0.07 * (1 - t) ** 2,     # like_rate: share of the session's items liked
        0.010 + 0.006 * (1 - t) ** 2,   # share_rate: share of the session's items shared
    ])
    objective_spec = {
        "primary": "watch_time",
        "guardrails": [
            # A like-rate shortfall of 0.001 costs 1 minute of watch time. The penalty is soft: the
            # optimum falls short by (watch time gained per unit of like rate) / (2 lambda), here
            # 28.6 / 2e6 = 0.000014, i.e. 0.0600 to four places, and the default preset, which
            # hedges against its estimates' uncertainty, deploys mixtures a little above that. With
            # lambda = 20,000 the optimum sat at 0.0593 and the dashboard showed "violated".
            {"metric": "like_rate", "threshold": 0.06, "penalty": 1_000_000.0},
            # At most 5% fewer shares than the production blend.
            {"metric": "share_rate", "threshold": -0.05, "penalty": 50000.0,
             "relative_to": arms[PRODUCTION_BLEND]["name"]},
        ],
    }
    return Scenario(arms=arms, objective_spec=objective_spec, means=means)


# The soft penalties let the optimum fall short of a guardrail by a little (see build_scenario); the
# demo's story needs that shortfall to be invisible next to the threshold.
GUARDRAIL_SLACK = 1e-3  # largest shortfall at the optimum, relative to the threshold


@dataclass(frozen=True)
class Solution:
    """The true problem solved: the best mixture and the best single blend."""

    mixture: np.ndarray  # (K,)
    mixture_value: float
    single: int
    single_value: float
    guarded: np.ndarray  # (G,) the mixture's guarded metrics
    thresholds: np.ndarray  # (G,) their resolved thresholds


def check_scenario(scenario: Scenario) -> Solution:
    """Solve the true problem; raise unless the best mixture strictly beats every single blend and
    keeps every guardrail to within ``GUARDRAIL_SLACK`` of its threshold."""
    objective = scenario.objective()
    mixture, mixture_value = best_mixture(objective, scenario.means)
    single, single_value = best_single(objective, scenario.means)
    solution = Solution(mixture=mixture, mixture_value=float(mixture_value), single=int(single),
                        single_value=float(single_value),
                        guarded=scenario.means[objective.guardrail_rows] @ mixture,
                        thresholds=objective.thresholds(scenario.means))
    if not solution.mixture_value > solution.single_value + 1e-6:
        raise RuntimeError(
            f"The demo scenario is broken: the best mixture ({mixture_value:.4f}) does not beat the "
            f"best single blend ({single_value:.4f})."
        )
    for guardrail, value, threshold in zip(objective.guardrails, solution.guarded, solution.thresholds):
        if value < threshold - GUARDRAIL_SLACK * abs(threshold):
            raise RuntimeError(
                f"The demo scenario is broken: the best mixture has {guardrail.metric} {value:.6f}, "
                f"below its guardrail {threshold:.6f}; raise the penalty."
            )
    return solution


def simulate_session(scenario: Scenario, arm_index: int, rng: np.random.Generator) -> dict[str, float]:
    """One session's metrics on blend ``arm_index``: gamma watch time (coefficient of variation
    0.5), binomial likes and shares over the session's items."""
    watch, like, share = scenario.means[:, arm_index]
    return {
        "watch_time": float(rng.gamma(4.0, watch / 4.0)),
        "like_rate": float(rng.binomial(ITEMS_PER_SESSION, like)) / ITEMS_PER_SESSION,
        "share_rate": float(rng.binomial(ITEMS_PER_SESSION, share)) / ITEMS_PER_SESSION,
    }
