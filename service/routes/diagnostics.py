"""``GET .../diagnostics``: how the experiment is doing, computed from the current estimate."""

from __future__ import annotations

from flask import Blueprint

from ..auth import require_role
from ..controller import reports
from ..responses import (BestMixture, BestSingle, Diagnostics, EstimateView, Guardrail, MixtureValues, Regret,
                         SampleRatioMismatch, respond)

bp = Blueprint("diagnostics", __name__, url_prefix="/api/v1/experiments")


@bp.get("/<name>/diagnostics")
@require_role("read")
def diagnostics(name: str):
    report = reports.diagnostics(name)
    snapshot, evaluation = report.snapshot, report.evaluation
    metrics = snapshot.metrics
    return respond(Diagnostics(
        round=snapshot.round_index,
        objective=MixtureValues(probabilities=evaluation.served, deployed=evaluation.deployed),
        best_mixture=BestMixture(probabilities=evaluation.best_mixture.tolist(), value=evaluation.best_value),
        best_single=BestSingle(arm=snapshot.arm_names[evaluation.best_arm], value=evaluation.best_single_value),
        mixing_gain=evaluation.best_value - evaluation.best_single_value,
        regret=Regret(cumulative=float(sum(value for value in report.regret_per_round if value is not None)),
                      per_round=report.regret_per_round),
        guardrails=[Guardrail(**item) for item in evaluation.guardrails],
        srm=SampleRatioMismatch(**report.srm),
        late_observations=report.late_observations,
        units=report.units.astype(int).tolist(),
        estimate=EstimateView(
            means={metric: evaluation.estimate.means[m].tolist() for m, metric in enumerate(metrics)},
            standard_errors={metric: evaluation.estimate.standard_errors[m].tolist()
                             for m, metric in enumerate(metrics)},
        ),
    ))
