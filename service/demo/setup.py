"""The demo's database, tokens and experiment: everything it sets up before traffic flows."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from pasto.algorithm import AlgorithmConfig
from pasto.scenario import Scenario
from pasto_client import Client, PastoAPIError

from .groundtruth import arm_names, arms, experiment_objective, experiment_objective_spec

log = logging.getLogger("pasto.demo")

EXPERIMENT = "demo-ranking"
TOKENS_FILE = "demo-tokens.json"
# Safe serving (the default preset): the served traffic, exploration included, keeps the hard
# guardrails' 95% lower bounds, padding with the production blend while no mixture is known to keep them.
ALGORITHM = {"preset": "default"}


def prepare_database(instance: Path | None) -> tuple[str, Path, str, str]:
    """Migrate the database and ensure the demo's tokens; returns (database URL, instance folder,
    admin token, read token)."""
    from .. import create_app, migrations_package
    from ..db import check_connection, get_db

    migrations = migrations_package()

    overrides: dict = {"PASTO_CHECK_SCHEMA": False}
    if instance is not None and not os.environ.get("PASTO_DATABASE_URL"):
        overrides["PASTO_DATABASE_URL"] = f"sqlite:///{instance.resolve() / 'pasto.sqlite'}"
    app = create_app(overrides)
    folder = (instance or Path(app.instance_path)).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    engine = get_db(app).engine
    url = engine.url.render_as_string(hide_password=False)
    check_connection(engine)
    migrations.upgrade(url)
    admin_token, read_token = _ensure_tokens(app, folder / TOKENS_FILE)
    engine.dispose()
    return url, folder, admin_token, read_token


def _ensure_tokens(app, path: Path) -> tuple[str, str]:
    """Reuse the tokens saved by a previous run while the database still accepts them (known, with
    the same role, neither revoked nor expired); make new ones otherwise."""
    from .. import store
    from ..bootstrap import get_uow
    from ..models import utcnow

    uow = get_uow(app)
    saved: dict[str, str] = {}
    if path.exists():
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            saved = {}
    tokens: dict[str, str] = {}
    with uow.write() as session:
        for role in ("admin", "read"):
            token = saved.get(role)
            row = None if token is None else store.token_by_hash(session, store.hash_token(token))
            usable = (row is not None and row.role == role and row.revoked_at is None
                      and (row.expires_at is None or row.expires_at > utcnow()))
            tokens[role] = token if usable else store.create_token(session, role, f"pasto demo ({role})")
    if tokens != saved:
        path.touch(mode=0o600, exist_ok=True)
        path.chmod(0o600)
        path.write_text(json.dumps(tokens, indent=2) + "\n")
    return tokens["admin"], tokens["read"]


def _same_settings(experiment: dict, scenario: Scenario) -> bool:
    """Whether ``experiment`` (as the API returns it) has the objective and algorithm this demo creates.

    The algorithm is compared option by option; a ``preset`` key is left out, as the server may or
    may not echo the preset name beside the options it resolved.
    """
    overrides = dict(ALGORITHM)
    preset = overrides.pop("preset")
    algorithm = AlgorithmConfig.from_preset(preset, **overrides)
    served = {key: value for key, value in experiment["algorithm"].items() if key != "preset"}
    # Loaded, not compared as dicts: an experiment stored with options its rule ignores is the same.
    try:
        same_algorithm = AlgorithmConfig.from_dict(served) == algorithm
    except ValueError:
        same_algorithm = False
    return experiment["objective"] == experiment_objective(scenario).to_spec() and same_algorithm


def ensure_experiment(client: Client, scenario: Scenario, round_seconds: float) -> str:
    """Create the demo experiment, resume it if paused, or start a new one if it was stopped or made
    with other settings by an earlier demo."""
    name = EXPERIMENT
    for attempt in range(1, 1000):
        try:
            experiment = client.get_experiment(name)
        except PastoAPIError as error:
            if error.status != 404:
                raise
            client.create_experiment(
                name=name, arms=arms(scenario), metrics=scenario.metrics,
                objective=experiment_objective_spec(scenario),
                round_seconds=round_seconds, algorithm=ALGORITHM,
            )
            log.info("Created experiment %r (%d blends, %.0f s rounds).", name, scenario.n_arms, round_seconds)
            return name
        if experiment["status"] == "stopped":
            name = f"{EXPERIMENT}-{attempt + 1}"
            continue
        if [arm["name"] for arm in experiment["arms"]] != arm_names(scenario):
            raise RuntimeError(f"An experiment named {name!r} exists but is not the demo's; "
                               "use another --instance folder or database.")
        if not _same_settings(experiment, scenario):
            # Made by an earlier version of the demo (its like-rate penalty once put the optimum
            # past the guardrail): resuming it would show the old story, so it is left paused.
            if experiment["status"] == "running":
                client.pause(name)
            following = f"{EXPERIMENT}-{attempt + 1}"
            log.info("Experiment %r has an earlier demo's objective or algorithm; it stays paused and "
                     "the demo uses %r.", name, following)
            name = following
            continue
        if experiment["status"] == "paused":
            client.resume(name)
        if experiment["round_seconds"] != round_seconds:
            log.info("Resuming %r with its own %.0f s rounds.", name, experiment["round_seconds"])
        log.info("Resuming experiment %r at round %d.", name, experiment["round"]["index"])
        return name
    raise RuntimeError("Too many stopped demo experiments; use a fresh --instance folder.")
