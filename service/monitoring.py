"""Prometheus metrics, served by ``GET /metrics`` (``service.routes.monitoring``: a token with the
``metrics`` role or higher, or none when ``PASTO_METRICS_ANONYMOUS`` is on).

Two kinds of series, each from the source that knows it:

* Events, counted in the process where they happen: HTTP requests and their latency per route,
  units assigned and observations accepted per experiment and arm, round updates and their duration,
  how late rounds closed. The service announces them on the signals of ``service.events``; this
  module listens. Under gunicorn (or with ``pasto worker`` beside the web server) set
  ``PROMETHEUS_MULTIPROC_DIR`` to an empty folder shared by those processes before they start: each
  process then writes its counts there and any worker's scrape adds them all up.
* Controller state, read from the database at scrape time by :class:`ControllerCollector`: round
  index, per-arm probabilities, objective estimates, guardrail margins, sample-ratio check, late data,
  scheduler lag. Every worker reads the same rows, so every worker reports the same truth, whichever
  process ran the last update, and nothing is stale after a restart. Estimates are those stored with
  the latest applied update (no optimisation runs at scrape time).
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
from flask import Flask, Response, current_app, has_app_context, request
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from . import events
from .controller import reports
from .config import DEFAULT_METRICS_TOP_ARMS, DEFAULT_METRICS_TOP_SEGMENTS
from .bootstrap import get_uow
from .db import Database, get_db, is_unavailable_error
from .models import STATUSES, utcnow
from .responses import RoundSummary, StoredLift, StoredSegments

# Event metrics of this process. A registry of their own rather than the global default, so that
# several apps in one process (tests) never register anything twice. In multiprocess mode their
# values live in files under PROMETHEUS_MULTIPROC_DIR and this registry is not read.
PROCESS_REGISTRY = CollectorRegistry()

# Requests: 1 ms .. 10 s. Round updates can solve an optimisation over thousands of arms: 1 ms .. 60 s.
_REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_UPDATE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0)
_LAG_BUCKETS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)

HTTP_REQUESTS = Counter(
    "pasto_http_requests", "HTTP requests served, by route template, method and status code.",
    ["route", "method", "status"], registry=PROCESS_REGISTRY,
)
HTTP_REQUEST_DURATION = Histogram(
    "pasto_http_request_duration_seconds", "Time from the start of a request to its response.",
    ["route", "method"], buckets=_REQUEST_BUCKETS, registry=PROCESS_REGISTRY,
)
ASSIGNMENTS = Counter(
    "pasto_assignments", "Units assigned to an arm by the assign endpoint.",
    ["experiment", "arm"], registry=PROCESS_REGISTRY,
)
OBSERVATIONS = Counter(
    "pasto_observations", "Observations accepted by the ingestion endpoint (repeated ids excluded).",
    ["experiment", "arm"], registry=PROCESS_REGISTRY,
)
OTHER_ARMS_ASSIGNMENTS = Counter(
    "pasto_other_arms_assignments",
    "Units assigned to arms outside the top PASTO_METRICS_TOP_ARMS by probability (no per-arm series).",
    ["experiment"], registry=PROCESS_REGISTRY,
)
OTHER_ARMS_OBSERVATIONS = Counter(
    "pasto_other_arms_observations",
    "Observations accepted for arms outside the top PASTO_METRICS_TOP_ARMS by probability.",
    ["experiment"], registry=PROCESS_REGISTRY,
)
DUPLICATE_OBSERVATIONS = Counter(
    "pasto_duplicate_observations", "Observations ignored because their id had been accepted before.",
    ["experiment"], registry=PROCESS_REGISTRY,
)
ROUND_UPDATES = Counter(
    "pasto_round_updates", "Round updates applied to the controller state.",
    ["experiment"], registry=PROCESS_REGISTRY,
)
ROUND_UPDATE_DURATION = Histogram(
    "pasto_round_update_duration_seconds",
    "Time of one close transaction: close the round, run its update (estimate, update, persist).",
    ["experiment"], buckets=_UPDATE_BUCKETS, registry=PROCESS_REGISTRY,
)
ROUND_CLOSE_LAG = Histogram(
    "pasto_round_close_lag_seconds",
    "Time from a round's scheduled end to its close by the scheduler (manual closes not counted).",
    ["experiment"], buckets=_LAG_BUCKETS, registry=PROCESS_REGISTRY,
)


# ------------------------------------------------------------------------------ signal receivers
# Module-level functions: connecting them again for another app in the same process is a no-op.
# They accept keyword arguments the signals may gain later.


# Labelled children by (metric, label values): ``labels()`` validates and locks on every call, which
# was most of the cost of counting a batch assignment (one call per distinct arm) and a good part of
# the per-request bookkeeping. The metrics are module-level singletons, so their ids are stable.
_children: dict[tuple, Any] = {}


def _child(metric, *labels: str):
    key = (id(metric), *labels)
    child = _children.get(key)
    if child is None:
        child = _children.setdefault(key, metric.labels(*labels))
    return child


def top_arms(probabilities: np.ndarray, limit: int) -> np.ndarray:
    """Positions of the ``limit`` arms of highest probability (ties: lower position first), sorted.

    Parameters
    ----------
    probabilities : np.ndarray, shape (K,)
    limit : int
        At least 1; all K positions when ``limit >= K``.

    Returns
    -------
    np.ndarray of int, shape (min(limit, K),)
    """
    n_arms = len(probabilities)
    if limit >= n_arms:
        return np.arange(n_arms)
    # A stable sort on -p keeps the lower position among equal probabilities (a uniform start).
    return np.sort(np.argsort(-np.asarray(probabilities), kind="stable")[:limit])


# Arms with per-arm event series, per snapshot (its serving mixture) and limit: computed once per
# snapshot version, not per request. Weak keys: a replaced snapshot takes its entry with it.
_top_by_snapshot: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _top_arm_mask(snapshot) -> np.ndarray:
    """(K,) bool: which arms of ``snapshot`` have their own event series (top by serving probability)."""
    return _assignment_counters(snapshot)[1]


def _assignment_counters(snapshot, limit: int | None = None) -> tuple[int, np.ndarray, dict[int, Any]]:
    """(limit, top-arm mask (K,), top arm position -> its assignments counter, filled as arms are
    counted) of ``snapshot``, computed once per snapshot version and limit (by default the current
    app's ``PASTO_METRICS_TOP_ARMS``)."""
    if limit is None:
        limit = current_app.config.get("PASTO_METRICS_TOP_ARMS", DEFAULT_METRICS_TOP_ARMS) if has_app_context() \
            else DEFAULT_METRICS_TOP_ARMS
    cached = _top_by_snapshot.get(snapshot)
    if cached is not None and cached[0] == limit:
        return cached
    mask = np.zeros(len(snapshot.arm_names), dtype=bool)
    mask[top_arms(snapshot.serving, limit)] = True
    cached = _top_by_snapshot[snapshot] = (limit, mask, {})
    return cached


def _arm_counter(snapshot, counters: dict[int, Any], position: int):
    counter = counters.get(position)
    if counter is None:
        counter = counters[position] = _child(ASSIGNMENTS, snapshot.name, snapshot.arm_names[position])
    return counter


def start_event_series(experiment: str, arm_names: Sequence[str], probabilities: Sequence[float],
                       limit: int) -> None:
    """Create the experiment's event series at 0 (if they do not exist yet in this process): the
    per-arm counters of its top ``limit`` arms by ``probabilities``, the "other arms" and duplicate
    counters and the round-update series. A counter that first appears at its first increment has no
    earlier sample, so ``rate()`` and ``increase()`` never see that increment; one scraped at 0 first
    counts from the start. Called when an experiment is created and, for every experiment, at each
    scrape (a restarted process starts its series again before new events arrive)."""
    for position in top_arms(np.asarray(probabilities, dtype=np.float64), limit).tolist():
        _child(ASSIGNMENTS, experiment, arm_names[position])
        _child(OBSERVATIONS, experiment, arm_names[position])
    for metric in (OTHER_ARMS_ASSIGNMENTS, OTHER_ARMS_OBSERVATIONS, DUPLICATE_OBSERVATIONS, ROUND_UPDATES,
                   ROUND_UPDATE_DURATION, ROUND_CLOSE_LAG):
        _child(metric, experiment)


def record_created(snapshot, **_) -> None:
    """``created``: the new experiment's event series, at 0."""
    limit = current_app.config.get("PASTO_METRICS_TOP_ARMS", DEFAULT_METRICS_TOP_ARMS) if has_app_context() \
        else DEFAULT_METRICS_TOP_ARMS
    start_event_series(snapshot.name, snapshot.arm_names, snapshot.serving, int(limit))


def record_assignments(snapshot, *, arms: Sequence[int], top_arms: int | None = None, **_) -> None:
    """``assigned``: count one assign response; ``arms`` holds each unit's arm position. Arms outside
    the top ``PASTO_METRICS_TOP_ARMS`` (``top_arms`` when given, else the current app's) add to
    ``pasto_other_arms_assignments`` (bounded cardinality)."""
    _, top, counters = _assignment_counters(snapshot, top_arms)
    if len(arms) == 1:  # a single-unit assignment: no need to group
        arm = int(arms[0])
        if top[arm]:
            _arm_counter(snapshot, counters, arm).inc()
        else:
            _child(OTHER_ARMS_ASSIGNMENTS, snapshot.name).inc()
        return
    arms = np.asarray(arms, dtype=np.int64)
    chosen = top[arms]
    others = len(arms) - int(np.count_nonzero(chosen))
    if others < len(arms):
        positions, counts = np.unique(arms[chosen], return_counts=True)
        for position, count in zip(positions.tolist(), counts.tolist()):
            _arm_counter(snapshot, counters, position).inc(count)
    if others:
        _child(OTHER_ARMS_ASSIGNMENTS, snapshot.name).inc(others)


def record_observations(snapshot, *, duplicates: int, arm_counts: Mapping[int, int], **_) -> None:
    """``observed``: count one committed batch; ``arm_counts`` maps arm position to accepted
    observations (arms outside the top ``PASTO_METRICS_TOP_ARMS`` add to ``pasto_other_arms_observations``)."""
    top = _top_arm_mask(snapshot)
    others = 0
    for position, count in arm_counts.items():
        if not count:
            continue
        if top[position]:
            _child(OBSERVATIONS, snapshot.name, snapshot.arm_names[position]).inc(count)
        else:
            others += count
    if others:
        _child(OTHER_ARMS_OBSERVATIONS, snapshot.name).inc(others)
    if duplicates:
        _child(DUPLICATE_OBSERVATIONS, snapshot.name).inc(duplicates)


def record_round_closed(
    experiment: str, *, applied: Sequence[int], duration_seconds: float, lag_seconds: float,
    round_index: int | None = None, **_,
) -> None:
    """``round_closed`` (sender: the experiment's name): updates applied, duration, lateness."""
    if applied:
        _child(ROUND_UPDATES, experiment).inc(len(applied))
    _child(ROUND_UPDATE_DURATION, experiment).observe(duration_seconds)
    # The service reports lag 0 for manual closes and for runs that only applied settled updates.
    if round_index is not None and lag_seconds > 0:
        _child(ROUND_CLOSE_LAG, experiment).observe(lag_seconds)


# ------------------------------------------------------------------------------ state at scrape time


def _gauge(name: str, documentation: str, *labels: str) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, labels=list(labels))


class ControllerCollector:
    """Gauges of every experiment's controller state, read from the database on each scrape."""

    def __init__(self, app: Flask) -> None:
        self.app = app

    def collect(self) -> Iterator[Metric]:
        status = _gauge("pasto_experiment_status", "1 for the experiment's status, 0 for the others.",
                        "experiment", "status")
        round_index = _gauge("pasto_round_index", "Index of the round being served (0-based).", "experiment")
        applied = _gauge("pasto_applied_rounds", "Rounds whose update has run.", "experiment")
        probability = _gauge("pasto_arm_probability",
                             "Probability p_t with which the arm is served in the current round "
                             "(the top PASTO_METRICS_TOP_ARMS arms by p_t).",
                             "experiment", "arm")
        deployed = _gauge("pasto_arm_deployed_probability",
                          "Weight of the arm in the mixture the controller recommends "
                          "(the top PASTO_METRICS_TOP_ARMS arms by that weight).", "experiment", "arm")
        arm_count = _gauge("pasto_arms", "Number of arms (candidate settings) of the experiment.", "experiment")
        other_probability = _gauge(
            "pasto_other_arms_probability",
            "Total p_t of the arms without a pasto_arm_probability series (0 when every arm has one).",
            "experiment")
        other_deployed = _gauge(
            "pasto_other_arms_deployed_probability",
            "Total deployed weight of the arms without a pasto_arm_deployed_probability series.", "experiment")
        limit = int(self.app.config.get("PASTO_METRICS_TOP_ARMS", DEFAULT_METRICS_TOP_ARMS))
        objective = _gauge(
            "pasto_objective_estimate",
            "Estimated objective f(V p) after the latest update, for the mixture served in that round "
            "(served), the deployed mixture, the best single arm and the best mixture.",
            "experiment", "mixture")
        regret = _gauge("pasto_regret_cumulative_estimate",
                        "Sum over applied rounds of the estimated regret of the served mixture.", "experiment")
        margin = _gauge(
            "pasto_guardrail_margin",
            "Guardrail estimate minus its threshold after the latest update, under the mixture served in "
            "that round (negative: violated). `guardrail` is the guardrail's position in the objective.",
            "experiment", "metric", "guardrail")
        holds = _gauge("pasto_guardrail_holds", "1 if the guardrail held after the latest update, else 0.",
                       "experiment", "metric", "guardrail")
        holds_by_mixture = _gauge(
            "pasto_guardrail_mixture_holds",
            "1 if the guardrail held after the latest update under `mixture` (served: the traffic of that "
            "round, exploration included; deployed: the recommended mixture), else 0; `level` estimate: "
            "the point estimate is at or above the threshold, interval: the 95% interval's lower end is.",
            "experiment", "metric", "guardrail", "mixture", "level")
        lift = _gauge(
            "pasto_lift",
            "Lift over the baseline arm after the latest update: `mixture` (served: the traffic of that round; "
            "deployed) minus the baseline on `measure` (primary metric or objective), `bound` estimate or the "
            "95% interval's lower/upper end. Absent when the objective has no baseline arm.",
            "experiment", "mixture", "measure", "bound")
        lift_relative = _gauge(
            "pasto_lift_relative",
            "pasto_lift as a share of the baseline arm's value (absent unless that value is positive).",
            "experiment", "mixture", "measure", "bound")
        srm = _gauge("pasto_srm_p_value",
                     "Sample-ratio-mismatch chi-square p-value of observed units per arm (small: split is off).",
                     "experiment")
        srm_ok = _gauge("pasto_srm_ok", "1 unless the sample-ratio-mismatch test rejects.", "experiment")
        observations = _gauge("pasto_observations_stored", "Observations stored for the experiment.", "experiment")
        late = _gauge("pasto_late_observations",
                      "Stored observations that arrived after their round's update had run.", "experiment")
        lag = _gauge("pasto_scheduler_lag_seconds",
                     "How long a round close or update has been due without running (0 when none is due).",
                     "experiment")
        last_update = _gauge("pasto_last_update_timestamp_seconds",
                             "Unix time of the latest change to the experiment's state.", "experiment")
        heartbeat = _gauge("pasto_scheduler_heartbeat_age_seconds",
                           "Seconds since the newest scheduler heartbeat (absent before the first one).")
        # Stored in the database (source_status), so every worker reports every scheduler's failures.
        source_errors = CounterMetricFamily(
            "pasto_source_errors",
            "Failed attempts to get a round's statistics from the experiment's metric source "
            "(the round stays open until one succeeds).", labels=["experiment"])
        source_failing = _gauge("pasto_source_failing",
                                "1 while the experiment's metric source is failing (its latest attempt failed).",
                                "experiment")
        segment_limit = int(self.app.config.get("PASTO_METRICS_TOP_SEGMENTS", DEFAULT_METRICS_TOP_SEGMENTS))
        segment_families = {
            "share": _gauge("pasto_segment_share",
                            "Segmented experiments: traffic share of the segment at the latest update (the top "
                            "PASTO_METRICS_TOP_SEGMENTS segments by share).", "experiment", "segment"),
            "objective": _gauge("pasto_segment_objective_estimate",
                                "Estimated primary value of the segment's deployed mixture at the latest update.",
                                "experiment", "segment"),
            "holds": _gauge("pasto_segment_guardrail_holds",
                            "1 if the guardrail's estimate in the segment under its deployed mixture is at or above "
                            "its threshold at the latest update, else 0.", "experiment", "segment", "metric",
                            "guardrail"),
            "other_share": _gauge("pasto_other_segments_share",
                                  "Total traffic share of the segments without their own pasto_segment_* series.",
                                  "experiment"),
            "other_objective": _gauge("pasto_other_segments_objective_estimate",
                                      "Share-weighted mean primary value of the segments without their own series.",
                                      "experiment"),
            "platform": _gauge("pasto_platform_guardrail_margin",
                               "Segmented experiments: traffic-weighted platform value of the guardrail minus its "
                               "threshold at the latest update (negative: violated).", "experiment", "metric",
                               "guardrail", "scope"),
            "gain": _gauge("pasto_segmenting_gain_estimate",
                           "Estimated platform value of the per-segment mixtures minus that of the best global "
                           "mixture, with its 95% interval (`bound`: estimate, lower, upper).", "experiment", "bound"),
        }

        now = utcnow()
        data = reports.controller_metrics(get_uow(self.app))
        experiments, rounds, regret_sums = data["experiments"], data["rounds"], data["regret_sums"]
        stored, arm_names, traffic, last_beat = data["stored"], data["arm_names"], data["traffic"], data["last_heartbeat"]

        by_experiment: dict[int, dict[int, Any]] = {}
        for row in rounds:
            by_experiment.setdefault(row.experiment_id, {})[row.index] = row

        for row in experiments:
            name, names = row.name, arm_names.get(row.id, [])
            own_rounds = by_experiment.get(row.id, {})
            for candidate in STATUSES:
                status.add_metric([name, candidate], float(candidate == row.status))
            round_index.add_metric([name], row.round_index)
            applied.add_metric([name], row.applied_rounds)
            arm_count.add_metric([name], len(names))
            current = own_rounds.get(row.round_index)
            if current is not None:
                _add_top_arms(probability, other_probability, name, names, current.probabilities, limit)
                start_event_series(name, names, current.probabilities, limit)
            _add_top_arms(deployed, other_deployed, name, names, row.state["deployed"], limit)

            latest = own_rounds.get(row.applied_rounds - 1)
            summary = (RoundSummary.load(latest.summary) if latest is not None else None) or RoundSummary()
            for mixture, value in (("served", summary.objective),
                                   ("deployed", summary.objective_deployed),
                                   ("best_single", None if summary.best_single is None else summary.best_single.value),
                                   ("best_mixture", summary.best_mixture)):
                if value is not None:
                    objective.add_metric([name, mixture], value)
            if regret_sums.get(row.id) is not None:
                regret.add_metric([name], regret_sums[row.id])
            for position, report in enumerate(summary.guardrails or []):
                labels = [name, report.metric, str(position)]
                if report.estimate is not None and report.threshold is not None:
                    margin.add_metric(labels, report.estimate - report.threshold)
                holds.add_metric(labels, float(bool(report.holds)))
            for mixture, guardrails in (("served", summary.guardrails), ("deployed", summary.guardrails_deployed)):
                for position, report in enumerate(guardrails or []):
                    labels = [name, report.metric, str(position), mixture]
                    holds_by_mixture.add_metric(labels + ["estimate"], float(bool(report.holds)))
                    holds_by_mixture.add_metric(labels + ["interval"], float(bool(report.confidently_holds)))

            if summary.segments is not None:
                _add_segments(segment_families, name, summary.segments, segment_limit)
            _add_lifts(lift, lift_relative, name, summary.lift)

            _, late_count, srm_report = traffic[row.id]
            if srm_report["p_value"] is not None:
                srm.add_metric([name], srm_report["p_value"])
            srm_ok.add_metric([name], float(bool(srm_report["ok"])))
            observations.add_metric([name], float(stored.get(row.id) or 0))
            late.add_metric([name], float(late_count))
            lag.add_metric([name], _overdue_seconds(row, own_rounds, now))
            last_update.add_metric([name], row.updated_at.timestamp())

        if last_beat is not None:
            heartbeat.add_metric([], max(0.0, (now - last_beat).total_seconds()))
        for row in data.get("sources", ()):
            source_errors.add_metric([row.name], float(row.errors_total))
            source_failing.add_metric([row.name], float(row.error is not None))

        yield from (status, round_index, applied, arm_count, probability, other_probability, deployed,
                    other_deployed, objective, regret, margin, holds, holds_by_mixture, lift, lift_relative,
                    srm, srm_ok, observations, late, lag, last_update, heartbeat, source_errors, source_failing,
                    *segment_families.values())


def _add_lifts(lift: GaugeMetricFamily, relative: GaugeMetricFamily, experiment: str,
               stored: StoredLift | None) -> None:
    """The lift gauges of one experiment from its latest round summary's ``lift`` (nothing when None):
    at most 2 mixtures x 2 measures x 3 bounds series per gauge."""
    if stored is None:
        return
    for mixture, lifts in (("served", stored.served), ("deployed", stored.deployed)):
        for measure, values in lifts.items():
            for gauge, estimate, (lower, upper) in (
                (lift, values["estimate"], values["interval"]),
                (relative, values["relative"], values["relative_interval"]),
            ):
                for bound, value in (("estimate", estimate), ("lower", lower), ("upper", upper)):
                    if value is not None:
                        gauge.add_metric([experiment, mixture, measure, bound], value)


def _add_top_arms(per_arm: GaugeMetricFamily, others: GaugeMetricFamily, experiment: str,
                  names: Sequence[str], values: Sequence[float], limit: int) -> None:
    """One ``per_arm`` sample for each of the ``limit`` arms of highest value, and their complement's
    total in ``others``: a scrape stays small at K = 10,000 arms."""
    array = np.asarray(values, dtype=np.float64)
    top = top_arms(array, limit)
    for position in top.tolist():
        per_arm.add_metric([experiment, names[position]], float(array[position]))
    rest = np.ones(len(array), dtype=bool)
    rest[top] = False
    others.add_metric([experiment], float(array[rest].sum()))


def _add_segments(families: dict[str, GaugeMetricFamily], experiment: str, report: StoredSegments,
                  limit: int) -> None:
    """Per-segment samples for the ``limit`` segments of largest share and one aggregate for the rest
    (a scrape stays small at hundreds of segments); the platform guardrails and the gain of segmenting."""
    segments = report.segments or []
    shares = np.array([entry.share or 0.0 for entry in segments], dtype=np.float64)
    top = top_arms(shares, limit)
    for position in top.tolist():
        entry = segments[position]
        families["share"].add_metric([experiment, entry.name], float(shares[position]))
        if entry.objective is not None:
            families["objective"].add_metric([experiment, entry.name], entry.objective)
        for index, guardrail in enumerate(entry.guardrails or []):
            families["holds"].add_metric([experiment, entry.name, guardrail.metric, str(index)],
                                         float(bool(guardrail.holds)))
    rest = np.ones(len(segments), dtype=bool)
    rest[top] = False
    rest_share = float(shares[rest].sum())
    families["other_share"].add_metric([experiment], rest_share)
    values = np.array([np.nan if entry.objective is None else entry.objective for entry in segments])
    if rest_share > 0 and np.all(np.isfinite(values[rest])):
        families["other_objective"].add_metric([experiment], float(shares[rest] @ values[rest] / rest_share))
    for index, guardrail in enumerate(report.platform_guardrails or []):
        if guardrail.estimate is not None and guardrail.threshold is not None:
            families["platform"].add_metric([experiment, guardrail.metric, str(index), guardrail.scope],
                                            guardrail.estimate - guardrail.threshold)
    gain = report.gain
    if gain is None:
        return
    interval = gain.interval or [None, None]
    for bound, value in (("estimate", gain.value), ("lower", interval[0]), ("upper", interval[1])):
        if value is not None:
            families["gain"].add_metric([experiment, bound], value)


def _overdue_seconds(experiment, rounds: Mapping[int, Any], now) -> float:
    """How long the oldest due work of a running experiment has waited: closing the current round
    after its end, or applying an ended round's update after its settle time."""
    if experiment.status != "running":
        return 0.0
    due = []
    current = rounds.get(experiment.round_index)
    if current is not None:
        due.append(current.ends_at)
    pending = rounds.get(experiment.applied_rounds)
    if experiment.applied_rounds < experiment.round_index and pending is not None:
        due.append(pending.ends_at + timedelta(seconds=experiment.config["settle_seconds"]))
    return max([0.0] + [(now - moment).total_seconds() for moment in due])


class DatabaseGuardedCollector:
    """A Prometheus collector around ``inner`` (one that reads the database at scrape time) that adds
    ``pasto_database_up``: 1 when the database answered, 0 when it is unavailable, in which case the
    scrape still succeeds with the other series (event counters, this gauge) instead of failing."""

    def __init__(self, inner, database: Database) -> None:
        self.inner = inner
        self.database = database

    def collect(self) -> Iterator[Metric]:
        try:
            collected = list(self.inner.collect())
        except Exception as error:
            if not is_unavailable_error(error):
                raise
            self.database.status.failed(error)
            collected = []
        yield from collected
        up = GaugeMetricFamily("pasto_database_up",
                               "1 when this process last found the database usable, 0 during an outage.")
        up.add_metric([], 1.0 if self.database.status.up else 0.0)
        yield up


def scrape_registry(app: Flask) -> CollectorRegistry:
    """The registry one scrape reads: event metrics (of this process, or of all processes in
    multiprocess mode) and the controller state."""
    registry = CollectorRegistry()
    # The controller state first: reading it starts every experiment's event series at 0
    # (start_event_series), before the event metrics are collected. Adds pasto_database_up; an outage
    # does not fail the scrape.
    registry.register(DatabaseGuardedCollector(ControllerCollector(app), get_db(app)))
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        MultiProcessCollector(registry)
    else:
        registry.register(PROCESS_REGISTRY)
    return registry


# ------------------------------------------------------------------------------ Flask wiring


def _start_timer() -> None:
    request.environ[_STARTED] = time.perf_counter()


def _count_request(response: Response) -> Response:
    current = request._get_current_object()  # one context lookup instead of one per attribute
    started = current.environ.pop(_STARTED, None)
    rule = current.url_rule
    count_request(None if rule is None else rule.rule, current.method, response.status_code, started)
    return response


def count_request(route: str | None, method: str, status: int, started: float | None) -> None:
    """Count one answered request of route template ``route`` (None: no route matched) and observe
    its duration since ``started`` (``time.perf_counter``; None: not timed)."""
    # The route template, not the path, keeps the label set bounded; unmatched paths share one label.
    key = (route, method, status)
    children = _request_children.get(key)
    if children is None:
        label = "<unmatched>" if route is None else route
        children = _request_children.setdefault(key, (
            _child(HTTP_REQUESTS, label, method, str(status)),
            _child(HTTP_REQUEST_DURATION, label, method)))
    children[0].inc()
    if started is not None:
        children[1].observe(time.perf_counter() - started)


_STARTED = "pasto.request_started"
#: (route template, method, status) -> (request counter, duration histogram) children.
_request_children: dict[tuple, tuple] = {}


def init_app(app: Flask) -> None:
    """Count requests and listen to the service's events (``GET /metrics`` is ``service.routes.monitoring``)."""
    app.before_request(_start_timer)
    app.after_request(_count_request)
    events.created.connect(record_created)
    events.assigned.connect(record_assignments)
    events.observed.connect(record_observations)
    events.round_closed.connect(record_round_closed)
