"""``GET .../diagnostics``: how the experiment is doing, computed from the current estimate."""

from __future__ import annotations

from flask import Blueprint

from ..auth import require_role
from ..controller import reports
from ..controller.reports import json_safe
from ..responses import (BestMixture, BestSingle, Diagnostics, EstimateView, Guardrail, MixtureValues, Regret,
                         SampleRatioMismatch, SourceErrorView, respond)

bp = Blueprint("diagnostics", __name__, url_prefix="/api/v1/experiments")


@bp.get("/<name>/diagnostics")
@require_role("read")
def diagnostics(name: str):
    diagnostics = reports.diagnostics(name)
    snapshot, report = diagnostics.snapshot, diagnostics.report
    metrics = snapshot.metrics
    return respond(Diagnostics(
        round=snapshot.round_index,
        objective=MixtureValues(probabilities=report.served.value, deployed=report.deployed.value),
        best_mixture=BestMixture(probabilities=report.best_mixture.tolist(), value=report.best_mixture_value),
        best_single=BestSingle(arm=snapshot.arm_names[report.best_single_arm], value=report.best_single_value),
        mixing_gain=report.mixing_gain,
        regret=Regret(cumulative=float(sum(value for value in diagnostics.regret_per_round if value is not None)),
                      per_round=diagnostics.regret_per_round),
        guardrails=[Guardrail(**item) for item in json_safe(list(report.deployed.guardrails))],
        guardrails_served=[Guardrail(**item) for item in json_safe(list(report.served.guardrails))],
        guardrails_deployed=[Guardrail(**item) for item in json_safe(list(report.deployed.guardrails))],
        srm=SampleRatioMismatch(**diagnostics.srm),
        late_observations=diagnostics.late_observations,
        units=diagnostics.units.astype(int).tolist(),
        estimate=EstimateView(
            means={metric: report.estimate.means[m].tolist() for m, metric in enumerate(metrics)},
            standard_errors={metric: report.estimate.standard_errors[m].tolist() for m, metric in enumerate(metrics)},
        ),
        source_error=None if diagnostics.source_error is None else SourceErrorView(**diagnostics.source_error),
        **({"segments": diagnostics.segments} if diagnostics.segments is not None else {}),
    ))
