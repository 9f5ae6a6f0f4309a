"""Prometheus metrics for the controller: ``GET /metrics``.

Two kinds of series, with two sources of truth:

* Events counted where they happen (HTTP requests, assignments served, observations accepted, round
  updates and their duration). Each process counts its own; under gunicorn, set
  ``PROMETHEUS_MULTIPROC_DIR`` to an empty directory shared by every worker (and by ``pasto worker``)
  before the process starts, and each scrape sums the files of all processes.
* Controller state (round index, per-arm probabilities, objective, guardrail margins, SRM, scheduler
  lag) read from the database at scrape time by :class:`ExperimentCollector`, so every worker reports the
  same values whichever process ran the last update, and nothing is stale after a restart.

The service calls :func:`record_assignments`, :func:`record_observations`, :func:`record_round_closed`
and :func:`record_scheduler_tick`; :func:`init_app` installs the request hooks and the endpoint.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from flask import Blueprint, Flask, Response, current_app, g, request
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

__all__ = [
    "ArmSnapshot",
    "ExperimentCollector",
    "ExperimentSnapshot",
    "GuardrailSnapshot",
    "bp",
    "init_app",
    "record_assignments",
    "record_observations",
    "record_round_closed",
    "record_scheduler_tick",
    "scrape_registry",
]

bp = Blueprint("monitoring", __name__)

# Metrics of this process only. Kept out of the global default registry so that building several apps
# in one process (tests) never registers anything twice; in multiprocess mode the values live in files
# under PROMETHEUS_MULTIPROC_DIR and this registry is not read at all.
PROCESS_REGISTRY = CollectorRegistry()
if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
    ProcessCollector(registry=PROCESS_REGISTRY)

# Buckets sized for a JSON API on one machine (1 ms .. 10 s) and for round updates, which can solve an
# optimisation problem over thousands of arms (1 ms .. 60 s).
_REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_UPDATE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0)

HTTP_REQUESTS = Counter(
    "pasto_http_requests",
    "HTTP requests served, by route template, method and status code.",
    ["route", "method", "status"],
    registry=PROCESS_REGISTRY,
)
HTTP_REQUEST_DURATION = Histogram(
    "pasto_http_request_duration_seconds",
    "Time from the start of the request to the response, by route template and method.",
    ["route", "method"],
    buckets=_REQUEST_BUCKETS,
    registry=PROCESS_REGISTRY,
)
ASSIGNMENTS = Counter(
    "pasto_assignments",
    "Units assigned to an arm by the assign endpoint.",
    ["experiment", "arm"],
    registry=PROCESS_REGISTRY,
)
OBSERVATIONS = Counter(
    "pasto_observations",
    "Observations accepted by the ingestion endpoint (repeated ids excluded).",
    ["experiment", "arm"],
    registry=PROCESS_REGISTRY,
)
DUPLICATE_OBSERVATIONS = Counter(
    "pasto_duplicate_observations",
    "Observations ignored because their id had been accepted before.",
    ["experiment"],
    registry=PROCESS_REGISTRY,
)
ROUND_UPDATES = Counter(
    "pasto_round_updates",
    "Round updates applied to the controller state.",
    ["experiment"],
    registry=PROCESS_REGISTRY,
)
ROUND_UPDATE_DURATION = Histogram(
    "pasto_round_update_duration_seconds",
    "Time to close a round and apply its update (estimate, update, persist) in one transaction.",
    ["experiment"],
    buckets=_UPDATE_BUCKETS,
    registry=PROCESS_REGISTRY,
)
ROUND_CLOSE_LAG = Histogram(
    "pasto_round_close_lag_seconds",
    "Time from a round's scheduled end to its close (rounds closed early by hand are not counted).",
    ["experiment"],
    buckets=(0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0),
    registry=PROCESS_REGISTRY,
)


# Receivers of the service's signals (``service.events``); the sender is the experiment's cache
# Snapshot. They are module-level functions, so connecting them again for another app in the same
# process changes nothing, and they accept extra keyword arguments the signals may gain later.


def record_assignments(snapshot, *, arms: Sequence[int], **_) -> None:
    """Count the units of one assign request; ``arms`` holds each unit's arm position."""
    positions, counts = np.unique(np.asarray(arms, dtype=np.int64), return_counts=True)
    for position, count in zip(positions.tolist(), counts.tolist()):
        ASSIGNMENTS.labels(snapshot.name, snapshot.arm_names[position]).inc(count)


def record_observations(snapshot, *, duplicates: int, arm_counts: Mapping[int, int], **_) -> None:
    """Count one committed ingestion batch; ``arm_counts`` maps arm position to accepted observations."""
    for position, count in arm_counts.items():
        if count:
            OBSERVATIONS.labels(snapshot.name, snapshot.arm_names[position]).inc(count)
    if duplicates:
        DUPLICATE_OBSERVATIONS.labels(snapshot.name).inc(duplicates)


def record_round_closed(
    snapshot, *, applied: Sequence[int], duration_seconds: float, lag_seconds: float, **_
) -> None:
    """Record one round close: the updates it applied, its duration and how late it came."""
    if len(applied):
        ROUND_UPDATES.labels(snapshot.name).inc(len(applied))
    ROUND_UPDATE_DURATION.labels(snapshot.name).observe(duration_seconds)
    # A round closed by hand before its scheduled end has a negative lag: that is not scheduler lag.
    if lag_seconds >= 0:
        ROUND_CLOSE_LAG.labels(snapshot.name).observe(lag_seconds)


# --- state read at scrape time -------------------------------------------------------------------


@dataclass(frozen=True)
class ArmSnapshot:
    name: str
    probability: float  # p_t, served now
    deployed: float  # the recommended mixture's weight


@dataclass(frozen=True)
class GuardrailSnapshot:
    metric: str
    threshold: float
    estimate: float | None  # None until the metric has data
    holds: bool


@dataclass(frozen=True)
class ExperimentSnapshot:
    """What the metrics endpoint reports about one experiment, as read from the database."""

    name: str
    status: str  # running | paused | stopped
    round_index: int
    arms: tuple[ArmSnapshot, ...]
    objective_served: float | None  # estimated f(V p_t)
    objective_deployed: float | None
    objective_best_single: float | None
    objective_best_mixture: float | None
    cumulative_regret: float | None
    guardrails: tuple[GuardrailSnapshot, ...]
    srm_p_value: float | None
    late_observations: int
    stored_observations: int
    scheduler_lag_seconds: float  # how long a due round has been waiting to close; 0 if none is due
    last_update_timestamp: float | None  # unix time of the latest round close


STATUSES = ("running", "paused", "stopped")


class ExperimentCollector:
    """Builds gauges from experiment snapshots taken when Prometheus scrapes.

    ``snapshots`` is called once per scrape and returns every experiment's current state; it is a
    parameter so the collector does not depend on how the service stores that state.
    """

    def __init__(self, snapshots: Callable[[], Iterable[ExperimentSnapshot]]) -> None:
        self._snapshots = snapshots

    def collect(self) -> Iterable[GaugeMetricFamily]:
        def family(name: str, documentation: str, labels: Sequence[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, documentation, labels=labels)

        status = family(
            "pasto_experiment_status", "1 for the experiment's current status, 0 for the others.",
            ["experiment", "status"])
        round_index = family(
            "pasto_round_index", "Index of the round being served now (0-based).", ["experiment"])
        probability = family(
            "pasto_arm_probability", "Probability p_t with which the arm is served in the current round.",
            ["experiment", "arm"])
        deployed = family(
            "pasto_arm_deployed_probability", "Weight of the arm in the mixture the controller recommends.",
            ["experiment", "arm"])
        objective = family(
            "pasto_objective_estimate",
            "Estimated objective f(V p) of a mixture: served (p_t), deployed, best_single, best_mixture.",
            ["experiment", "mixture"])
        regret = family(
            "pasto_regret_cumulative_estimate", "Estimated cumulative regret of the served mixtures.",
            ["experiment"])
        margin = family(
            "pasto_guardrail_margin",
            "Guardrail metric estimate under p_t minus its threshold (negative: violated).",
            ["experiment", "metric"])
        holds = family(
            "pasto_guardrail_holds", "1 if the guardrail holds under p_t, else 0.", ["experiment", "metric"])
        srm = family(
            "pasto_srm_p_value", "Sample-ratio-mismatch chi-square p-value (small: traffic split is off).",
            ["experiment"])
        late = family(
            "pasto_late_observations", "Observations that arrived after their round closed.",
            ["experiment"])
        stored = family(
            "pasto_observations_stored", "Observations stored for the experiment.", ["experiment"])
        lag = family(
            "pasto_scheduler_lag_seconds",
            "How long a round has been due (end plus settle time) without being closed.",
            ["experiment"])
        last_update = family(
            "pasto_last_update_timestamp_seconds", "Unix time of the latest round close.",
            ["experiment"])

        for snapshot in self._snapshots():
            name = snapshot.name
            for candidate in STATUSES:
                status.add_metric([name, candidate], float(candidate == snapshot.status))
            round_index.add_metric([name], float(snapshot.round_index))
            for arm in snapshot.arms:
                probability.add_metric([name, arm.name], arm.probability)
                deployed.add_metric([name, arm.name], arm.deployed)
            for mixture, value in (
                ("served", snapshot.objective_served),
                ("deployed", snapshot.objective_deployed),
                ("best_single", snapshot.objective_best_single),
                ("best_mixture", snapshot.objective_best_mixture),
            ):
                if value is not None:
                    objective.add_metric([name, mixture], value)
            if snapshot.cumulative_regret is not None:
                regret.add_metric([name], snapshot.cumulative_regret)
            for guardrail in snapshot.guardrails:
                if guardrail.estimate is not None:
                    margin.add_metric([name, guardrail.metric], guardrail.estimate - guardrail.threshold)
                holds.add_metric([name, guardrail.metric], float(guardrail.holds))
            if snapshot.srm_p_value is not None:
                srm.add_metric([name], snapshot.srm_p_value)
            late.add_metric([name], float(snapshot.late_observations))
            stored.add_metric([name], float(snapshot.stored_observations))
            lag.add_metric([name], snapshot.scheduler_lag_seconds)
            if snapshot.last_update_timestamp is not None:
                last_update.add_metric([name], snapshot.last_update_timestamp)

        yield from (status, round_index, probability, deployed, objective, regret, margin, holds, srm,
                    late, stored, lag, last_update)


def scrape_registry(snapshots: Callable[[], Iterable[ExperimentSnapshot]]) -> CollectorRegistry:
    """A registry for one scrape: this process's (or all processes') event metrics plus DB state."""
    registry = CollectorRegistry()
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        MultiProcessCollector(registry)
    else:
        registry.register(PROCESS_REGISTRY)
    registry.register(ExperimentCollector(snapshots))
    return registry


# --- Flask wiring --------------------------------------------------------------------------------


@bp.get("/metrics")
def metrics() -> Response:
    snapshots = current_app.extensions["pasto.monitoring"]
    return Response(generate_latest(scrape_registry(snapshots)), mimetype=CONTENT_TYPE_LATEST)


def _start_timer() -> None:
    g.pasto_request_started = time.perf_counter()


def _observe_request(response: Response) -> Response:
    started = g.pop("pasto_request_started", None)
    # The route template, not the path, keeps the label set bounded (404s share one label).
    route = request.url_rule.rule if request.url_rule is not None else "<unmatched>"
    HTTP_REQUESTS.labels(route, request.method, str(response.status_code)).inc()
    if started is not None:
        HTTP_REQUEST_DURATION.labels(route, request.method).observe(time.perf_counter() - started)
    return response


def init_app(app: Flask, snapshots: Callable[[], Iterable[ExperimentSnapshot]] | None = None) -> None:
    """Install request metrics and ``GET /metrics``; ``snapshots`` defaults to reading the database."""
    if snapshots is None:
        from service.monitoring_state import experiment_snapshots as snapshots
    app.extensions["pasto.monitoring"] = snapshots
    app.before_request(_start_timer)
    app.after_request(_observe_request)
    app.register_blueprint(bp)
