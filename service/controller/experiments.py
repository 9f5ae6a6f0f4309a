"""Experiments: create, list, show, pause, resume, stop, archive, delete, and what an experiment runs.

Archiving puts a finished experiment away: it is stopped (no more rounds, ingestion refused with
409) and left out of listings and ``/metrics`` unless asked for. Assignment keeps answering with the
deployed mixture, as for any stopped experiment: archiving is bookkeeping, and a production caller
that still asks should keep getting the setting the experiment concluded on, not an error that turns a
tidy-up into an outage. Deleting removes every row of an archived experiment in one transaction;
only then do its routes answer 404. An experiment must be archived before it can be deleted, so a
running one cannot be deleted by a single mistaken request.

What an experiment stores is exactly what it runs: ``config["algorithm"]`` is the complete resolved
``AlgorithmConfig.to_dict()`` (the preset the request named is resolved at creation and not stored).
Rows written before that stored a ``preset`` key beside the resolved fields;
migration 0006 removes it, and :func:`algorithm_and_objective` still ignores it if it is there.
"""

from __future__ import annotations

import secrets
from datetime import timedelta
from typing import Any

import numpy as np

from pasto.algorithm import OPTIONS, AlgorithmConfig, initial_state
from pasto.objectives import Objective
from pasto.segments import SegmentedConfig, SegmentedState, aggregate_state, check_scopes, initial_segmented_state

from .. import events as signals
from .. import store
from ..cache import Snapshot
from ..errors import ApiError, invalid
from ..models import utcnow
from ..schemas import OTHER_SEGMENT, ExperimentCreate
from ..sources import SourceError, parse_source
from ..store import UnitOfWork


def check_source(declaration: dict[str, Any], metrics: list[str]) -> dict[str, Any]:
    """The metric source declaration as stored (unchanged), or a 422 with the problem's sentence.

    A table mapping must map exactly the experiment's metrics: a metric it leaves out would get no
    values from the source, and a name that is no metric is most likely a typo.
    """
    try:
        source = parse_source(declaration)
    except SourceError as error:
        raise invalid("source", str(error)) from None
    if source.mapping is not None:
        mapped = [metric for metric, _ in source.mapping.events.metrics]
        unknown = [metric for metric in mapped if metric not in metrics]
        if unknown:
            raise invalid("source", f"The metric source maps {unknown}, which are not metrics of the experiment "
                                    f"{metrics}.")
        missing = [metric for metric in metrics if metric not in mapped]
        if missing:
            raise invalid("source", f"The metric source's mapping.events.metrics does not map the experiment's "
                                    f"metrics {missing}; map each metric to its column.")
    return declaration


def build_objective(metrics: list[str], spec: dict[str, Any], arm_names: list[str]) -> Objective:
    try:
        return Objective.from_spec(metrics, spec, arm_names=arm_names)
    except ValueError as error:
        raise invalid("objective", str(error)) from None


def build_algorithm(spec: dict[str, Any]) -> AlgorithmConfig:
    overrides = dict(spec)
    preset = overrides.pop("preset", "default")
    try:
        return AlgorithmConfig.from_preset(preset, **overrides)
    except (TypeError, ValueError) as error:
        message = str(error)
        if isinstance(error, TypeError):
            known = ", ".join(OPTIONS)
            message = f"Unknown algorithm option in {sorted(overrides)}; the options are preset, {known}."
        raise invalid("algorithm", message) from None


def algorithm_and_objective(uow: UnitOfWork, session, experiment_id: int, config: dict[str, Any]
                            ) -> tuple[AlgorithmConfig, Objective]:
    """The experiment's algorithm configuration and objective, rebuilt from its stored config."""
    # "preset": only in rows written before migration 0006 (which removes it).
    algorithm = AlgorithmConfig.from_dict({k: v for k, v in config["algorithm"].items() if k != "preset"})
    arm_names = None
    # Arm names resolve relative thresholds and the baseline arm.
    if config["objective"].get("baseline") or any(
            guardrail.get("relative_to") for guardrail in config["objective"].get("guardrails", [])):
        arm_names = store.arm_names(session, experiment_id)
    return algorithm, Objective.from_spec(config["metrics"], config["objective"], arm_names=arm_names)


def segmented_config(config: dict[str, Any], algorithm: AlgorithmConfig) -> SegmentedConfig | None:
    """The segmented controller's configuration of a stored experiment config (None: unsegmented)."""
    segments = config.get("segments")
    if segments is None:
        return None
    return SegmentedConfig(algorithm=algorithm, scopes=tuple(segments["scopes"]), shrink=segments["shrink"],
                           confidence_z=segments["confidence_z"])


def expected_shares(config: dict[str, Any], n_segments: int) -> np.ndarray:
    """The expected traffic shares (S,) of a segmented experiment's stored config (equal when not given,
    and always for an open set, whose number of segments grows)."""
    segments = config["segments"]
    if segments.get("shares") is not None:
        return np.asarray(segments["shares"], dtype=np.float64)
    return np.full(n_segments, 1.0 / n_segments)


def load_segment_state(stored: dict[str, Any]) -> tuple[SegmentedState, list[str]]:
    """The segmented state and the segment names (in state order) of ``experiments.segment_state``."""
    return SegmentedState.from_dict({key: value for key, value in stored.items() if key != "names"}), stored["names"]


def dump_segment_state(state: SegmentedState, names: list[str]) -> dict[str, Any]:
    """What ``experiments.segment_state`` stores: ``SegmentedState.to_dict()`` plus the segment names (an
    open set's grow as values get a mixture of their own)."""
    return {**state.to_dict(), "names": list(names)}


def _segments_config(body: ExperimentCreate, objective: Objective) -> dict[str, Any] | None:
    """``config["segments"]`` of a new experiment (None: unsegmented); a 422 naming what is wrong."""
    scopes = [guardrail.scope for guardrail in body.objective.guardrails]
    if body.segments is None:
        for index, scope in enumerate(scopes):
            if scope is not None:
                raise invalid(f"objective.guardrails[{index}].scope",
                              "A guardrail scope applies only to an experiment with segments; this one has none.")
        return None
    spec = body.segments
    open_set = not isinstance(spec, list) and spec.by is not None
    names = list(spec) if isinstance(spec, list) else [OTHER_SEGMENT] if open_set else list(spec.names)
    resolved = tuple(scope or "global" for scope in scopes)
    try:
        check_scopes(objective, resolved)
    except ValueError as error:
        raise invalid("objective.guardrails", f"With segments: {error}") from None
    shares = None if isinstance(spec, list) or spec.shares is None else [float(share) for share in spec.shares]
    if shares is not None:
        total = sum(shares)
        shares = [share / total for share in shares]  # summed to 1 within 1e-6: made exact
    return {
        "names": names,  # an open set's initial names: its long tail only (the current ones: segment_state)
        "by": spec.by if open_set else None,
        "min_units": spec.min_units if open_set else None,
        "max_segments": spec.max_segments if open_set else None,
        "shares": shares,
        "scopes": list(resolved),
        "shrink": True if isinstance(spec, list) else spec.shrink,
        "confidence_z": 2.0 if isinstance(spec, list) else float(spec.confidence_z),
    }


def create(uow: UnitOfWork, body: ExperimentCreate) -> Snapshot:
    """Create the experiment ``body`` describes; 409 if the name is taken."""
    arm_names = [arm.name for arm in body.arms]
    objective_spec = body.objective.model_dump(exclude_none=True)
    for guardrail in objective_spec.get("guardrails", []):
        guardrail.pop("scope", None)  # kept in config["segments"]["scopes"]; not part of the Objective
    objective = build_objective(body.metrics, objective_spec, arm_names)
    algorithm_spec = body.algorithm.model_dump()
    if body.segments is not None:
        # The segmented controller serves its own mixtures, (1 - eps) p*_s + eps / K from the joint LP
        # (pasto.segments), in place of the per-segment safe-serving rule: it runs "exploration".
        if algorithm_spec.get("serving", "exploration") != "exploration":
            raise invalid("algorithm.serving", "Safe serving is not available with segments: the segmented "
                                               "controller serves the joint solution with exploration "
                                               "(give serving 'exploration' or leave it out).")
        algorithm_spec["serving"] = "exploration"
        for option in ("serving_min_share", "serving_holdout"):
            if algorithm_spec.get(option):
                raise invalid(f"algorithm.{option}", f"'{option}' is a safe-serving option, and the segmented "
                                                     "controller does not serve that way (leave it out).")
    algorithm = build_algorithm(algorithm_spec)
    segments = _segments_config(body, objective)
    config = {
        "metrics": body.metrics,
        "objective": objective.to_spec(),
        "algorithm": algorithm.to_dict(),
        "round_seconds": body.round_seconds,
        "settle_seconds": body.settle_seconds,
    }
    if body.source is not None:
        if segments is not None:
            raise invalid("source", "A metric source cannot feed a segmented experiment yet: the statistics it "
                                    "returns carry no segment. Send per-segment statistics batches instead.")
        config["source"] = check_source(body.source, body.metrics)
    segment_state = segment_probabilities = None
    if segments is None:
        try:  # the objective names the holdout's baseline arm; the fixed shares must leave traffic to learn with
            state = initial_state(algorithm, len(arm_names), len(body.metrics), objective=objective)
        except ValueError as error:
            raise invalid("algorithm", str(error)) from None
    else:
        config["segments"] = segments
        segmented = initial_segmented_state(segmented_config(config, algorithm), len(segments["names"]),
                                            len(arm_names), len(body.metrics))
        state = aggregate_state(segmented, expected_shares(config, len(segments["names"])))
        segment_state = dump_segment_state(segmented, segments["names"])
        segment_probabilities = segmented.probabilities.tolist()
    seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
    try:
        with uow.write() as session:
            store.create_experiment(
                session, name=body.name, config=config, seed=seed, state=state.to_dict(),
                arms=[(arm.name, arm.params) for arm in body.arms], probabilities=state.probabilities.tolist(),
                now=utcnow(), round_seconds=body.round_seconds, segment_state=segment_state,
                segment_probabilities=segment_probabilities)
    except store.ExperimentExists:
        raise ApiError(409, "conflict", f"An experiment named {body.name!r} already exists.") from None
    snapshot = uow.cache.get(body.name, fresh=True)
    signals.created.send(snapshot)  # e.g. the Prometheus counters start at 0 (service.monitoring)
    return snapshot


def list_all(uow: UnitOfWork, archived: bool = False) -> list[Snapshot]:
    """Every experiment not archived (``archived``: every archived one), oldest first."""
    with uow.read() as session:
        names = store.experiment_names(session, archived=archived)
    cache = uow.cache
    snapshots = []
    for name in names:
        try:
            snapshots.append(cache.get(name))
        except ApiError:  # deleted meanwhile
            continue
    return snapshots


def show(uow: UnitOfWork, name: str) -> Snapshot:
    return uow.cache.get(name)


def events(uow: UnitOfWork, name: str, since: int, limit: int) -> list:
    """At most ``limit`` events ``(id, kind, round_index, at, details)`` of experiment ``name`` from
    event id ``since`` on, oldest first; 404 if there is no such experiment."""
    snapshot = uow.cache.get(name)
    with uow.read() as session:
        return store.experiment_events(session, snapshot.id, since, limit)


# Allowed status transitions: target -> statuses it may be reached from (same status: no-op).
_TRANSITIONS = {"paused": {"running"}, "running": {"paused"}, "stopped": {"running", "paused"}}
# The event each target status records (running is only reached by resuming).
_EVENT_KINDS = {"paused": "paused", "running": "resumed", "stopped": "stopped"}


def set_status(uow: UnitOfWork, name: str, target: str) -> Snapshot:
    """Move experiment ``name`` to ``target``; resuming restarts the current round's clock."""
    snapshot = uow.cache.get(name)
    with uow.write() as session:
        experiment = store.lock_experiment(session, snapshot.id)
        if experiment is None:
            raise ApiError(404, "not_found", f"There is no experiment named {name!r}.")
        if experiment.status != target:
            if experiment.status not in _TRANSITIONS[target]:
                raise ApiError(409, "conflict",
                               f"Experiment {name!r} is {experiment.status}; it cannot become {target}.")
            now = utcnow()
            # A round does not run while paused: it gets a full round_seconds after resuming.
            ends_at = now + timedelta(seconds=experiment.config["round_seconds"]) if target == "running" else None
            store.set_status(session, experiment, target, now, current_round_ends_at=ends_at)
            store.add_event(session, experiment.id, _EVENT_KINDS[target], experiment.round_index, now)
    return uow.cache.get(name, fresh=True)


def archive(uow: UnitOfWork, name: str) -> Snapshot:
    """Archive experiment ``name`` (stopping it if it is not); archiving an archived one changes nothing."""
    snapshot = uow.cache.get(name)
    with uow.write() as session:
        experiment = store.lock_experiment(session, snapshot.id)
        if experiment is None:
            raise ApiError(404, "not_found", f"There is no experiment named {name!r}.")
        if experiment.archived_at is None:
            now = utcnow()
            store.archive_experiment(session, experiment, now)
            if experiment.status != "stopped":  # archiving stopped it: the time axis shows that as any stop
                store.add_event(session, experiment.id, _EVENT_KINDS["stopped"], experiment.round_index, now)
    return uow.cache.get(name, fresh=True)


def delete(uow: UnitOfWork, name: str) -> dict[str, int]:
    """Delete archived experiment ``name`` with every row of it, in one transaction; the rows deleted
    per table. 409 when it is not archived."""
    cache = uow.cache
    snapshot = cache.get(name, fresh=True)
    with uow.write() as session:
        experiment = store.lock_experiment(session, snapshot.id)
        if experiment is None:
            cache.forget(name)
            raise ApiError(404, "not_found", f"There is no experiment named {name!r}.")
        if experiment.archived_at is None:
            raise ApiError(409, "conflict", f"Experiment {name!r} is not archived; archive it "
                                            f"(POST /api/v1/experiments/{name}/archive) before deleting it.")
        deleted = store.delete_experiment(session, experiment, utcnow())
    cache.forget(name)
    return deleted
