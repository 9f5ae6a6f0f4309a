"""``/api/v1/experiments``: create, list, show, pause, resume, stop, archive, delete, and the events of an
experiment."""

from __future__ import annotations

from datetime import datetime

from flask import Blueprint

from ..auth import require_role
from ..bootstrap import get_uow
from ..cache import Snapshot
from ..controller import experiments
from ..controller.reports import ArmSelection, select_arms
from ..params import query_flag, query_integer
from ..responses import (ArmRest, ArmSummary, ArmView, Experiment, ExperimentDeleted, ExperimentEvent, ExperimentEventList, ExperimentList,
                         RoundTimes, SegmentsView, respond)
from ..schemas import ExperimentCreate, json_body, parse

bp = Blueprint("experiments", __name__, url_prefix="/api/v1/experiments")

#: Events per page: without ``?limit=``, and at most.
EVENTS_PAGE = 1000
#: Largest event id a request may name (ids are 32-bit integers on PostgreSQL).
MAX_EVENT_ID = 2**31 - 1


def iso(moment: datetime | None) -> str | None:
    """RFC 3339 UTC timestamp with a ``Z``, or None."""
    return None if moment is None else moment.isoformat().replace("+00:00", "Z")


def round_times(snapshot: Snapshot) -> RoundTimes:
    return RoundTimes(index=snapshot.round_index, started_at=iso(snapshot.round_started_at),
                      ends_at=iso(snapshot.round_ends_at))


#: Largest ``?arms=`` a request may give (more than any experiment's K keeps every arm anyway).
MAX_SUMMARY_ARMS = 2**31 - 1


def summary_arms() -> int | None:
    """``?arms=N`` of a read (experiment, experiments, rounds, diagnostics): keep the N arms of largest
    max(p_t, deployed) in every per-arm array and sum the others into ``rest``; None without it."""
    return query_integer("arms", None, 1, MAX_SUMMARY_ARMS)


def arm_summary_view(snapshot: Snapshot, selection: ArmSelection) -> ArmSummary:
    return ArmSummary(arms=selection.kept.tolist(), names=[snapshot.arm_names[k] for k in selection.kept],
                      rest_arms=len(selection.rest))


def experiment_view(snapshot: Snapshot, arms: int | None = None) -> Experiment:
    """The experiment's JSON; with ``arms`` (``?arms=N``) its per-arm arrays summarised (:func:`summary_arms`)."""
    selection = select_arms(snapshot.probabilities, snapshot.deployed, arms)
    config = snapshot.config
    positions = range(snapshot.n_arms) if selection is None else selection.kept.tolist()

    def per_arm(values) -> list:
        return values.tolist() if selection is None else selection.keep(values)

    return Experiment(
        name=snapshot.name,
        status=snapshot.status,
        arms=[ArmView(name=snapshot.arm_names[k], params=snapshot.arm_params[k]) for k in positions],
        metrics=list(snapshot.metrics),
        objective=config["objective"],
        algorithm=config["algorithm"],
        round_seconds=config["round_seconds"],
        settle_seconds=config["settle_seconds"],
        seed=snapshot.seed,
        round=round_times(snapshot),
        applied_rounds=snapshot.applied_rounds,
        probabilities=per_arm(snapshot.probabilities),
        deployed=per_arm(snapshot.deployed),
        created_at=iso(snapshot.created_at),
        updated_at=iso(snapshot.updated_at),
        archived_at=iso(snapshot.archived_at),
        source=config.get("source"),
        **({"segments": segments_view(snapshot, selection)} if snapshot.segmented else {}),  # unsegmented: no key
        **({} if selection is None else {  # unsummarised: no keys at all
            "arm_summary": arm_summary_view(snapshot, selection),
            "rest": ArmRest(arms=len(selection.rest), probabilities=selection.rest_sum(snapshot.probabilities),
                            deployed=selection.rest_sum(snapshot.deployed))}),
    )


def segments_view(snapshot: Snapshot, selection: ArmSelection | None = None) -> SegmentsView | None:
    if not snapshot.segmented:
        return None
    spec = snapshot.config["segments"]
    return SegmentsView(
        names=list(snapshot.segment_names), by=spec.get("by"), min_units=spec.get("min_units"),
        max_segments=spec.get("max_segments"), shares=spec["shares"], scopes=spec["scopes"], shrink=spec["shrink"],
        confidence_z=spec["confidence_z"],
        probabilities={name: row.tolist() if selection is None else selection.keep(row)
                       for name, row in zip(snapshot.segment_names, snapshot.segment_probabilities)},
        deployed={name: row.tolist() if selection is None else selection.keep(row)
                  for name, row in zip(snapshot.segment_names, snapshot.segment_deployed)},
    )


@bp.post("")
@require_role("admin")
def create():
    return respond(experiment_view(experiments.create(get_uow(), parse(ExperimentCreate, json_body()))), 201)


@bp.get("")
@require_role("read")
def list_experiments():
    archived = query_flag("archived", False)  # true: the archived experiments instead of the others
    arms = summary_arms()
    return respond(ExperimentList(experiments=[experiment_view(snapshot, arms)
                                               for snapshot in experiments.list_all(get_uow(), archived=archived)]))


@bp.get("/<name>")
@require_role("read")
def show(name: str):
    arms = summary_arms()
    return respond(experiment_view(experiments.show(get_uow(), name), arms))


@bp.post("/<name>/pause")
@require_role("admin")
def pause(name: str):
    return respond(experiment_view(experiments.set_status(get_uow(), name, "paused")))


@bp.post("/<name>/resume")
@require_role("admin")
def resume(name: str):
    return respond(experiment_view(experiments.set_status(get_uow(), name, "running")))


@bp.post("/<name>/stop")
@require_role("admin")
def stop(name: str):
    return respond(experiment_view(experiments.set_status(get_uow(), name, "stopped")))


@bp.post("/<name>/archive")
@require_role("admin")
def archive(name: str):
    return respond(experiment_view(experiments.archive(get_uow(), name)))


@bp.delete("/<name>")
@require_role("admin")
def delete(name: str):
    return respond(ExperimentDeleted(name=name, deleted_rows=experiments.delete(get_uow(), name)))


@bp.get("/<name>/events")
@require_role("read")
def events(name: str):
    """Events oldest first, one page from event id ``?since=`` (0) of ``?limit=`` (1,000) events;
    ``next_since`` is the cursor of the next page (null after the last event)."""
    since = query_integer("since", 0, 0, MAX_EVENT_ID)
    limit = query_integer("limit", EVENTS_PAGE, 1, EVENTS_PAGE)
    rows = experiments.events(get_uow(), name, since, limit + 1)  # one more tells whether another page follows
    page = [ExperimentEvent(id=row.id, kind=row.kind, round=row.round_index, at=iso(row.at), details=row.details)
            for row in rows[:limit]]
    return respond(ExperimentEventList(events=page, next_since=rows[limit].id if len(rows) > limit else None))
