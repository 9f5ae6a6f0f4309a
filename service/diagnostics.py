"""``GET .../diagnostics``: how the experiment is doing, computed from the current estimate."""

from __future__ import annotations

import numpy as np
import sqlalchemy as sa
from flask import Blueprint, jsonify

from pasto import optimum
from pasto.algorithm import ControllerState, estimate
from pasto.diagnostics import guardrail_report, sample_ratio_mismatch

from .auth import require_role
from .cache import get_cache
from .db import get_db
from .models import ArmRoundCount, Round
from .rounds import algorithm_and_objective, finite, json_safe, pooled_statistics

bp = Blueprint("diagnostics", __name__, url_prefix="/api/v1/experiments")


@bp.get("/<name>/diagnostics")
@require_role("read")
def diagnostics(name: str):
    snapshot = get_cache().get(name)
    n_arms, n_metrics = snapshot.n_arms, len(snapshot.metrics)
    with get_db().read() as session:
        algorithm, objective = algorithm_and_objective(session, snapshot.id, snapshot.config)
        pooled = pooled_statistics(session, snapshot.id, snapshot.round_index, n_metrics, n_arms)
        summaries = session.execute(
            sa.select(Round.index, Round.summary).where(Round.experiment_id == snapshot.id).order_by(Round.index)
        ).all()
        units, late, srm = traffic_report(session, snapshot.id, n_arms)
    state = ControllerState.from_dict(snapshot.state)
    current = estimate(algorithm, state, pooled)
    means = current.means
    thresholds = objective.thresholds(means)
    served_value = float(objective.mixture_value(means, snapshot.probabilities, thresholds))
    deployed_value = float(objective.mixture_value(means, snapshot.deployed, thresholds))
    best_probabilities, best_value = optimum.best_mixture(objective, means, thresholds)
    best_arm, best_single_value = optimum.best_single(objective, means, thresholds)

    per_round = [row.summary.get("regret") for row in summaries if row.summary is not None]
    return jsonify({
        "round": snapshot.round_index,
        "objective": {"probabilities": finite(served_value), "deployed": finite(deployed_value)},
        "best_mixture": {"probabilities": best_probabilities.tolist(), "value": finite(best_value)},
        "best_single": {"arm": snapshot.arm_names[int(best_arm)], "value": finite(best_single_value)},
        "mixing_gain": finite(best_value - best_single_value),
        "regret": {"cumulative": float(sum(value for value in per_round if value is not None)),
                   "per_round": per_round},
        "guardrails": json_safe(guardrail_report(objective, current, snapshot.deployed)),
        "srm": srm,
        "late_observations": late,
        "units": units.astype(np.int64).tolist(),
        "estimate": {
            "means": {metric: [finite(v) for v in means[m]] for m, metric in enumerate(snapshot.metrics)},
            "standard_errors": {metric: [finite(v) for v in current.standard_errors[m]]
                                for m, metric in enumerate(snapshot.metrics)},
        },
    })


def traffic_report(session, experiment_id: int, n_arms: int) -> tuple[np.ndarray, int, dict]:
    """Observed units per arm (K,), late observations, and the sample-ratio-mismatch test against the
    split expected from each round's logged probabilities (also read by ``service.monitoring``)."""
    counts = session.execute(
        sa.select(ArmRoundCount.round_index, ArmRoundCount.arm_index, ArmRoundCount.units,
                  ArmRoundCount.late_observations)
        .where(ArmRoundCount.experiment_id == experiment_id)
    ).all()
    round_probabilities = session.execute(
        sa.select(Round.index, Round.probabilities).where(Round.experiment_id == experiment_id).order_by(Round.index)
    ).all()
    units = np.zeros(n_arms)
    expected = np.zeros(n_arms)
    late = 0
    units_by_round: dict[int, np.ndarray] = {}
    for row in counts:
        units_by_round.setdefault(row.round_index, np.zeros(n_arms))[row.arm_index] += row.units
        late += row.late_observations
    for row in round_probabilities:
        round_units = units_by_round.get(row.index)
        if round_units is not None:
            units += round_units
            expected += round_units.sum() * np.asarray(row.probabilities, dtype=np.float64)
    if units.sum() > 0:
        srm = json_safe(sample_ratio_mismatch(units, expected / expected.sum()))
    else:
        srm = {"statistic": None, "p_value": None, "ok": True}
    return units, late, srm
