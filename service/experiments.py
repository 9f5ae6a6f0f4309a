"""Experiments: create, list, read, pause, resume, stop. Serialization of experiments lives here."""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from flask import Blueprint, jsonify

from pasto.algorithm import AlgorithmConfig, initial_state
from pasto.objectives import Objective

from .auth import require_role
from .cache import Snapshot, get_cache
from .db import get_db
from .errors import ApiError, invalid
from .models import Arm, Experiment, Round, utcnow
from .schemas import ExperimentCreate, json_body, parse

bp = Blueprint("experiments", __name__, url_prefix="/api/v1/experiments")


def iso(moment: datetime | None) -> str | None:
    """RFC 3339 UTC timestamp with a ``Z``, or None."""
    return None if moment is None else moment.isoformat().replace("+00:00", "Z")


def experiment_json(snapshot: Snapshot) -> dict[str, Any]:
    config = snapshot.config
    return {
        "name": snapshot.name,
        "status": snapshot.status,
        "arms": [{"name": name, "params": params} for name, params in zip(snapshot.arm_names, snapshot.arm_params)],
        "metrics": list(snapshot.metrics),
        "objective": config["objective"],
        "algorithm": config["algorithm"],
        "round_seconds": config["round_seconds"],
        "settle_seconds": config["settle_seconds"],
        "seed": snapshot.seed,
        "round": {
            "index": snapshot.round_index,
            "started_at": iso(snapshot.round_started_at),
            "ends_at": iso(snapshot.round_ends_at),
        },
        "applied_rounds": snapshot.applied_rounds,
        "probabilities": snapshot.probabilities.tolist(),
        "deployed": snapshot.deployed.tolist(),
        "created_at": iso(snapshot.created_at),
        "updated_at": iso(snapshot.updated_at),
    }


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
            known = ", ".join(field for field in AlgorithmConfig.__dataclass_fields__)
            message = f"Unknown algorithm option in {sorted(overrides)}; the options are preset, {known}."
        raise invalid("algorithm", message) from None


@bp.post("")
@require_role("admin")
def create():
    body = parse(ExperimentCreate, json_body())
    arm_names = [arm.name for arm in body.arms]
    objective = build_objective(body.metrics, body.objective.model_dump(exclude_none=True), arm_names)
    algorithm = build_algorithm(body.algorithm.model_dump())
    state = initial_state(algorithm, len(arm_names), len(body.metrics))
    now = utcnow()
    config = {
        "metrics": body.metrics,
        "objective": objective.to_spec(),
        "algorithm": {"preset": body.algorithm.preset, **algorithm.to_dict()},
        "round_seconds": body.round_seconds,
        "settle_seconds": body.settle_seconds,
    }
    seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
    database = get_db()
    try:
        with database.write() as session:
            exists = session.execute(sa.select(Experiment.id).where(Experiment.name == body.name)).first()
            if exists is not None:
                raise _duplicate(body.name)
            experiment = Experiment(
                name=body.name, config=config, status="running", seed=seed, round_index=0, applied_rounds=0,
                state=state.to_dict(), version=1, created_at=now, updated_at=now,
            )
            session.add(experiment)
            session.flush()
            session.execute(sa.insert(Arm), [
                {"experiment_id": experiment.id, "position": position, "name": arm.name, "params": arm.params}
                for position, arm in enumerate(body.arms)
            ])
            session.add(Round(
                experiment_id=experiment.id, index=0, started_at=now,
                ends_at=now + timedelta(seconds=body.round_seconds), probabilities=state.probabilities.tolist(),
            ))
    except sa.exc.IntegrityError:
        # Two concurrent creations with the same name: the unique constraint decides.
        raise _duplicate(body.name) from None
    response = jsonify(experiment_json(get_cache().get(body.name, fresh=True)))
    response.status_code = 201
    return response


def _duplicate(name: str) -> ApiError:
    return ApiError(409, "conflict", f"An experiment named {name!r} already exists.")


@bp.get("")
@require_role("read")
def list_experiments():
    with get_db().read() as session:
        names = session.execute(sa.select(Experiment.name).order_by(Experiment.id)).scalars().all()
    cache = get_cache()
    experiments = []
    for name in names:
        try:
            experiments.append(experiment_json(cache.get(name)))
        except ApiError:  # deleted meanwhile
            continue
    return jsonify({"experiments": experiments})


@bp.get("/<name>")
@require_role("read")
def show(name: str):
    return jsonify(experiment_json(get_cache().get(name)))


# Allowed status transitions: target -> statuses it may be reached from (same status: no-op).
_TRANSITIONS = {"paused": {"running"}, "running": {"paused"}, "stopped": {"running", "paused"}}


def set_status(name: str, target: str) -> Snapshot:
    """Move experiment ``name`` to ``target``; resuming restarts the current round's clock."""
    snapshot = get_cache().get(name)
    with get_db().write() as session:
        experiment = session.execute(
            sa.select(Experiment).where(Experiment.id == snapshot.id).with_for_update()
        ).scalar_one()
        if experiment.status != target:
            if experiment.status not in _TRANSITIONS[target]:
                raise ApiError(409, "conflict",
                               f"Experiment {name!r} is {experiment.status}; it cannot become {target}.")
            now = utcnow()
            if target == "running":
                # A round does not run while paused: it gets a full round_seconds after resuming.
                session.execute(
                    sa.update(Round)
                    .where(Round.experiment_id == experiment.id, Round.index == experiment.round_index)
                    .values(ends_at=now + timedelta(seconds=experiment.config["round_seconds"]))
                )
            experiment.status = target
            experiment.version += 1
            experiment.updated_at = now
    return get_cache().get(name, fresh=True)


@bp.post("/<name>/pause")
@require_role("admin")
def pause(name: str):
    return jsonify(experiment_json(set_status(name, "paused")))


@bp.post("/<name>/resume")
@require_role("admin")
def resume(name: str):
    return jsonify(experiment_json(set_status(name, "running")))


@bp.post("/<name>/stop")
@require_role("admin")
def stop(name: str):
    return jsonify(experiment_json(set_status(name, "stopped")))
