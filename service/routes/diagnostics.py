"""``GET .../diagnostics``: how the experiment is doing, computed from the current estimate."""

from __future__ import annotations

import numpy as np
from flask import Blueprint

from ..auth import require_role
from ..bootstrap import get_uow
from ..controller import reports
from ..controller.reports import ArmSelection, json_safe, lift_summary, segments_kept, select_arms
from ..responses import (ArmRest, BestMixture, BestSingle, Diagnostics, EstimateView, Guardrail, Lift, MixtureValues,
                         Regret, SampleRatioMismatch, ShadowPrice, SourceErrorView, respond)

from .experiments import arm_summary_view, summary_arms

bp = Blueprint("diagnostics", __name__, url_prefix="/api/v1/experiments")


@bp.get("/<name>/diagnostics")
@require_role("read")
def diagnostics(name: str):
    """How the experiment is doing; ``?arms=N`` keeps the N arms of largest max(p_t, deployed) in
    every per-arm array and sums the others into ``rest`` (:func:`.experiments.summary_arms`)."""
    arms = summary_arms()
    diagnostics = reports.diagnostics(get_uow(), name)
    snapshot, report = diagnostics.snapshot, diagnostics.report
    metrics = snapshot.metrics
    selection = select_arms(snapshot.probabilities, snapshot.deployed, arms)

    def per_arm(values) -> list:
        return values.tolist() if selection is None else selection.keep(values)

    # A metric no arm has an observation of has no estimate (null), not the estimator's stand-in; once
    # some arms have data, an unobserved arm's mean is the documented fill-in and its standard error null.
    unobserved = ~np.asarray(diagnostics.observed, dtype=bool).any(axis=-1, keepdims=True)
    means = np.where(unobserved, np.nan, report.estimate.means)
    errors = np.where(unobserved, np.nan, report.estimate.standard_errors)

    return respond(Diagnostics(
        round=snapshot.round_index,
        objective=MixtureValues(probabilities=report.served.value, deployed=report.deployed.value),
        best_mixture=BestMixture(probabilities=per_arm(report.best_mixture), value=report.best_mixture_value,
                                 shadow_prices=[ShadowPrice(**item) for item in json_safe(list(report.shadow_prices))]),
        best_single=None if report.best_single_arm is None else BestSingle(
            arm=snapshot.arm_names[report.best_single_arm], value=report.best_single_value),
        mixing_gain=report.mixing_gain,
        regret=Regret(cumulative=float(sum(value for value in diagnostics.regret_per_round if value is not None)),
                      per_round=diagnostics.regret_per_round),
        guardrails=[Guardrail(**item) for item in json_safe(list(report.deployed.guardrails))],
        guardrails_served=[Guardrail(**item) for item in json_safe(list(report.served.guardrails))],
        guardrails_deployed=[Guardrail(**item) for item in json_safe(list(report.deployed.guardrails))],
        lift=Lift.from_summary(lift_summary(report), snapshot.arm_names),
        srm=SampleRatioMismatch(**diagnostics.srm),
        late_observations=diagnostics.late_observations,
        units=per_arm(diagnostics.units.astype(int)),
        estimate=EstimateView(
            means={metric: per_arm(means[m]) for m, metric in enumerate(metrics)},
            standard_errors={metric: per_arm(errors[m]) for m, metric in enumerate(metrics)},
        ),
        source_error=None if diagnostics.source_error is None else SourceErrorView(**diagnostics.source_error),
        **({"segments": segments_kept(diagnostics.segments, selection)} if diagnostics.segments is not None else {}),
        **({} if selection is None else {
            "arm_summary": arm_summary_view(snapshot, selection),
            "rest": _rest(selection, snapshot.deployed, report, diagnostics.units, diagnostics.observed, metrics)}),
    ))


def _rest(selection: ArmSelection, deployed, report, units, observed, metrics) -> ArmRest:
    """The arms ``selection`` leaves out of the diagnostics, summed: enough for the deployed mixture's
    estimate and its interval (``sum p_k mean_k`` and ``sum (p_k se_k)^2`` per metric).

    An arm without an observation of a metric (``observed`` (M, K) False) has no estimate of it: its
    mean is only the estimator's stand-in, so it counts as unknown (nan) in both sums, and a metric's
    sums are null when such an arm has positive deployed probability (arms of zero probability add
    nothing, known or not). A variance is also null when a used arm with data has no standard error
    yet (pooled: fewer than two observations)."""
    unknown = ~np.asarray(observed, dtype=bool)
    means = np.where(unknown, np.nan, report.estimate.means)
    errors = np.where(unknown, np.nan, report.estimate.standard_errors)
    return ArmRest(
        arms=len(selection.rest), best_mixture=selection.rest_sum(report.best_mixture),
        units=int(selection.rest_sum(units)),
        deployed_means={metric: selection.rest_weighted(deployed, means[m]) for m, metric in enumerate(metrics)},
        deployed_variances={metric: selection.rest_weighted(deployed ** 2, errors[m] ** 2)
                            for m, metric in enumerate(metrics)},
    )

