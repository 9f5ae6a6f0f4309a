"""The golden vectors of the assignment contract (spec/assignment-vectors.json) against the server:
``POST .../assign`` (one unit and batches) and the OFREP endpoint, on experiments put in each case's
state (seed, round, mixture) directly in the database."""

from __future__ import annotations

from collections import defaultdict
from datetime import timedelta

import sqlalchemy as sa

from service.bootstrap import get_uow
from service.db import get_db
from service.models import Experiment, Round, utcnow
from tests.assignment_vectors import cases, mixture, vectors

HARD = {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "hard": True}]}


def put_state(app, name: str, round_index: int, probabilities: list[float],
              segment_probabilities: list[list[float]] | None = None, segment_names: list[str] | None = None) -> None:
    """Make ``round_index`` the current round of experiment ``name``, serving ``probabilities`` (and per
    segment ``segment_probabilities``; an open set's ``segment_names``: the values that have a mixture)."""
    now = utcnow()
    with get_db(app).write() as session:
        experiment = session.execute(sa.select(Experiment).where(Experiment.name == name)).scalar_one()
        if segment_names is not None and experiment.config["segments"].get("by") is not None:
            experiment.segment_state = {**experiment.segment_state, "names": list(segment_names)}
        current = session.get(Round, (experiment.id, round_index))
        if current is None:
            current = Round(experiment_id=experiment.id, index=round_index, started_at=now,
                            ends_at=now + timedelta(hours=1), closed_at=None, applied_at=None)
            session.add(current)
        current.probabilities = probabilities
        current.segment_probabilities = segment_probabilities
        experiment.round_index = round_index
        experiment.version = experiment.version + 1
    # The next request serves the new version now, not after the check interval: checked here, as a
    # request would, the new version is loaded with the arms of the cached one (they never change;
    # parsing K = 10,000 arms' params again at each state was most of this test's CPU).
    snapshot = get_uow(app).cache.get(name, fresh=True)
    assert (snapshot.version, snapshot.round_index) == (experiment.version, round_index)


def _state(mixture_name: str | None, segment_set: str | None):
    """(probabilities, per-segment probabilities or None, segment names or None) of a case's state."""
    if segment_set is None:
        return list(mixture(mixture_name)), None, None
    spec = vectors()["segment_sets"][segment_set]
    per_segment = [list(mixture(spec["mixtures"][segment])) for segment in spec["names"]]
    return per_segment[0], per_segment, spec["names"]


def test_the_server_reproduces_every_case(app, api, setup_a):
    # One experiment per seed, number of arms and segment set; put_state moves it to each state
    # (round, mixture) of its cases in turn, rounds in increasing order.
    experiments: dict[tuple, dict[tuple, list]] = defaultdict(lambda: defaultdict(list))
    for case in cases():
        if case.server_unit:
            k = len(_state(case.mixture, case.segments)[0])
            experiments[(case.seed, k, case.segments)][(case.round, case.mixture)].append(case)
    checked = 0
    for position, ((seed, k, segment_set), states) in enumerate(experiments.items()):
        name = f"v-{position}"
        body = setup_a(name, seed=seed, arms=[{"name": f"arm-{i}", "params": {"k": i}} for i in range(k)],
                       objective=HARD)
        if segment_set is not None:
            # An open set starts with its long tail only; its values get their mixtures from observed
            # data, which put_state stands in for.
            spec = vectors()["segment_sets"][segment_set]
            body["segments"] = {"by": "country"} if spec["open"] else spec["names"]
        created = api("POST", "/api/v1/experiments", json=body)
        assert created.status_code == 201, created.get_json()
        for (round_index, mixture_name), members in sorted(states.items(), key=lambda item: item[0][0]):
            checked += _check_state(app, api, name, segment_set, round_index, mixture_name, members)
    assert checked > 400


def _check_state(app, api, name: str, segment_set: str | None, round_index: int, mixture_name: str | None,
                 members: list) -> int:
    """Put experiment ``name`` in the state of ``members`` and check each case, one by one and as a batch;
    returns how many valid cases were checked one by one."""
    probabilities, per_segment, segment_names = _state(mixture_name, segment_set)
    put_state(app, name, round_index, probabilities, per_segment, segment_names)
    checked = 0
    assign = f"/api/v1/experiments/{name}/assign"
    valid = [case for case in members if case.error is None]
    for case in members:
        request = {"unit": case.unit} if case.segment is None else {"unit": case.unit, "segment": case.segment}
        one = api("POST", assign, role="ingest", json=request)
        context = {"targetingKey": case.unit} if case.segment is None else {"targetingKey": case.unit,
                                                                           "segment": case.segment}
        flag = api("POST", f"/ofrep/v1/evaluate/flags/{name}", role="ingest", json={"context": context})
        if case.error is not None:
            if case.error == "segment_not_accepted":
                assert one.status_code == 422, case  # OFREP ignores a segment an experiment does not use
            else:
                assert one.status_code == 422 and flag.get_json()["errorCode"] == "INVALID_CONTEXT", case
            continue
        expected = case.expected
        answer = one.get_json()
        assert (answer["arm"], answer["round"], answer["probability"], answer.get("segment")) == (
            f"arm-{expected['arm']}", round_index, expected["probability"], expected.get("served_segment")), case
        evaluation = flag.get_json()
        assert (evaluation["variant"], evaluation["metadata"]["propensity"], evaluation["metadata"]["round"]) == (
            f"arm-{expected['arm']}", expected["probability"], round_index), case
        checked += 1
    # A batch's "segments" names one segment per unit: an open set's unit without one goes alone above.
    valid = [case for case in valid if segment_set is None or case.segment is not None]
    if valid:
        batch = {"units": [case.unit for case in valid]}
        if segment_set is not None:
            batch["segments"] = [case.segment for case in valid]
        answers = api("POST", assign, role="ingest", json=batch).get_json()["assignments"]
        assert [a["arm"] for a in answers] == [f"arm-{case.expected['arm']}" for case in valid]
    return checked
