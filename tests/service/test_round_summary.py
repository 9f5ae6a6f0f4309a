"""A round's summary is one typed model (``service.responses.RoundSummary``) written by the close and
read by the store, the rounds API and the Prometheus exporter; the JSON stored and served is the one
the untyped dict made, and rows stored in an older shape still load everywhere."""

from __future__ import annotations

import json

import numpy as np
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from pasto.algorithm import AlgorithmConfig, initial_state
from pasto.estimators import Statistics
from pasto.objectives import Objective
from pasto.report import round_report
from pasto.segments import pool_segments
from service import store
from service.controller.reports import finite, json_safe, lift_summary, round_summary
from service.db import get_db
from service.models import Round
from service.responses import RoundSummary


def legacy_summary(algorithm, objective, state, pooled, propensities) -> dict:
    """What controller/reports.py wrote before the model: a dict, built key by key."""
    report = round_report(algorithm, objective, state, pooled, served=propensities)
    lift = lift_summary(report)
    return {
        "objective": finite(report.served.value),
        "objective_deployed": finite(report.deployed.value),
        "best_mixture": finite(report.best_mixture_value),
        "best_single": None if report.best_single_arm is None else {
            "arm_index": report.best_single_arm, "value": finite(report.best_single_value)},
        "regret": finite(report.served.regret),
        "guardrails": json_safe(list(report.served.guardrails)),
        "guardrails_deployed": json_safe(list(report.deployed.guardrails)),
        "lift": None if lift is None else {"baseline_index": lift.baseline_index, "served": lift.served,
                                           "deployed": lift.deployed},
    }


@pytest.mark.parametrize("baseline", [None, "b"])
def test_the_stored_json_is_the_dicts_key_for_key(baseline):
    spec = {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "penalty": 5.0}]}
    if baseline is not None:
        spec["baseline"] = baseline
    objective = Objective.from_spec(["x", "y"], spec, arm_names=["a", "b"])
    config = AlgorithmConfig()
    rng = np.random.default_rng(3)
    counts = rng.integers(5, 30, (2, 2)).astype(float)
    sums = counts * np.array([[2.0, 0.0], [-2.0, 2.0]]) + rng.normal(0, 1, (2, 2))
    pooled = Statistics(counts, sums, sums ** 2 / counts + counts)
    state = initial_state(config, 2, 2, objective=objective)
    propensities = np.array([0.3, 0.7])
    typed = round_summary(config, objective, state, pooled, propensities)
    legacy = legacy_summary(config, objective, state, pooled, propensities)
    assert json.dumps(typed.to_json()) == json.dumps(legacy)  # same keys, same order, same numbers
    assert RoundSummary.load(legacy).to_json() == legacy


def play_round(api, setup_a, name: str = "summarised") -> None:
    assert api("POST", "/api/v1/experiments", json=setup_a(name)).status_code == 201
    units = [f"u{i}" for i in range(40)]
    arms = api("POST", f"/api/v1/experiments/{name}/assign", json={"units": units}).get_json()["assignments"]
    observations = [{"id": f"o{i}", "unit": a["unit"], "round": 0,
                     "values": {"x": 2.0 if a["arm"] == "a" else 0.0, "y": -2.0 if a["arm"] == "a" else 2.0}}
                    for i, a in enumerate(arms)]
    assert api("POST", f"/api/v1/experiments/{name}/observations", json={"observations": observations},
               role="ingest").status_code == 202
    assert api("POST", f"/api/v1/experiments/{name}/rounds").status_code == 200


def gauges(api) -> dict[tuple, float]:
    text = api("GET", "/metrics", role="read").get_data(as_text=True)
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name.startswith(("pasto_objective_estimate", "pasto_guardrail", "pasto_lift"))}


def test_a_row_in_the_old_shape_loads_in_the_store_the_api_and_the_exporter(api, app, setup_a):
    play_round(api, setup_a)
    before = api("GET", "/api/v1/experiments/summarised/rounds").get_json()["rounds"][0]
    with get_db(app).read() as session:
        stored = session.execute(sa.select(Round.summary).where(Round.index == 0)).scalar_one()
    assert list(stored) == ["objective", "objective_deployed", "best_mixture", "best_single", "regret",
                            "guardrails", "guardrails_deployed", "lift"]
    # A row written before objective_deployed, guardrails_deployed and lift existed.
    old = {key: stored[key] for key in ("objective", "best_mixture", "best_single", "regret", "guardrails")}
    with get_db(app).write() as session:
        session.execute(sa.update(Round).where(Round.index == 0).values(summary=old))
        experiment_id = session.execute(sa.select(Round.experiment_id).where(Round.index == 0)).scalar_one()
    after = api("GET", "/api/v1/experiments/summarised/rounds").get_json()["rounds"][0]
    for key in ("objective", "best_mixture", "best_single", "regret", "guardrails", "guardrails_served"):
        assert after[key] == before[key], key
    assert after["objective_deployed"] is None and after["guardrails_deployed"] is None and after["lift"] is None
    with get_db(app).read() as session:
        assert store.round_regrets(session, experiment_id, None) == [(0, old["regret"])]
    samples = gauges(api)
    served = ("pasto_objective_estimate", (("experiment", "summarised"), ("mixture", "served")))
    deployed = ("pasto_objective_estimate", (("experiment", "summarised"), ("mixture", "deployed")))
    assert samples[served] == pytest.approx(old["objective"]) and deployed not in samples
    assert not any(name == "pasto_guardrail_mixture_holds" and dict(labels)["mixture"] == "deployed"
                   for name, labels in samples)


# ------------------------------------------------------------------------------ the per-segment part
def legacy_segment_summary(config, objective, state, pooled, shares, names) -> dict:
    """What controller/reports.py's segment_summary returned before the model: a dict, built key by key."""
    from pasto.segments import segment_report
    from service.controller.reports import segment_observations

    report = segment_report(config, objective, state.deployed, pooled, shares)
    observations = segment_observations(pooled)
    return json_safe({
        "segments": [
            {"name": None if names is None else names[s], "share": report.shares[s],
             "observations": int(observations[s]),
             "probabilities": state.probabilities[s], "deployed": state.deployed[s],
             "objective": report.segment_values[s], "guardrails": list(report.guardrails[s])}
            for s in range(state.n_segments)
        ],
        "objective": report.platform_value,
        "platform_guardrails": list(report.platform_guardrails),
        "global_mixture": {"probabilities": report.global_mixture, "objective": report.global_value},
        "gain": {"value": report.gain, "interval": report.gain_interval},
    })


def segmented_round():
    """A segmented controller (3 segments, 3 arms, a global hard guardrail) after two updates."""
    from pasto.segments import SegmentedConfig, initial_segmented_state, segmented_update

    objective = Objective.from_spec(["x", "y"], {"primary": "x", "guardrails": [
        {"metric": "y", "threshold": 0.0, "hard": True}]}, arm_names=["a", "b", "c"])
    config = SegmentedConfig(scopes=("global",))
    state = initial_segmented_state(config, 3, 3, 2)
    means = np.array([[[2.0, 0.0, 1.0], [-1.0, 1.0, 0.0]], [[0.0, 2.0, 1.0], [1.0, -1.0, 0.0]],
                      [[1.0, 1.0, 2.0], [0.0, 0.0, 1.0]]])  # (S, M, K)
    rng = np.random.default_rng(5)
    pooled = Statistics.zeros(2, 3, (3,))
    shares = np.array([0.5, 0.3, 0.2])
    for _ in range(2):
        counts = rng.integers(10, 40, (3, 2, 3)).astype(float)
        sums = counts * means + rng.normal(0, 1, counts.shape)
        statistics = Statistics(counts, sums, sums ** 2 / counts + counts)
        pooled = pooled + statistics
        state = segmented_update(config, objective, state, statistics, pooled, shares, rng=rng)
    return config, objective, state, pooled, shares


@pytest.mark.parametrize("names", [["new", "returning", "mobile"], None])
def test_the_segment_part_is_typed_and_stored_as_the_dicts_json_key_for_key(names):
    from service.controller.reports import segment_summary
    from service.responses import StoredGain, StoredGlobalMixture, StoredPlatformGuardrail, StoredSegment, StoredSegments

    config, objective, state, pooled, shares = segmented_round()
    typed = segment_summary(config, objective, state, pooled, shares, names)
    legacy = legacy_segment_summary(config, objective, state, pooled, shares, names)
    assert isinstance(typed, StoredSegments)
    assert all(isinstance(entry, StoredSegment) for entry in typed.segments)
    assert isinstance(typed.platform_guardrails[0], StoredPlatformGuardrail)
    assert isinstance(typed.global_mixture, StoredGlobalMixture) and isinstance(typed.gain, StoredGain)
    assert [entry.name for entry in typed.segments] == (names or [None] * 3)
    assert typed.gain.interval[0] <= typed.gain.value <= typed.gain.interval[1]
    assert json.dumps(typed.to_json()) == json.dumps(legacy)  # same keys, same order, same numbers
    # In a round summary, the text stored in rounds.summary is the one the dicts made.
    algorithm = AlgorithmConfig()
    aggregate = initial_state(algorithm, 3, 2, objective=objective)
    summary = round_summary(algorithm, objective, aggregate, pool_segments(pooled), aggregate.probabilities,
                            segments=typed)
    assert json.dumps(summary.to_json()) == json.dumps({**legacy_summary(
        algorithm, objective, aggregate, pool_segments(pooled), aggregate.probabilities), "segments": legacy})
    # A row stored by the dict version loads into the typed model and is written back unchanged.
    stored = json.loads(json.dumps(summary.to_json()))
    assert json.dumps(RoundSummary.load(stored).to_json()) == json.dumps(stored)
    assert RoundSummary.load(stored).segments == typed


def test_a_segment_part_with_keys_missing_or_unknown_loads_and_keeps_its_shape():
    config, objective, state, pooled, shares = segmented_round()
    legacy = legacy_segment_summary(config, objective, state, pooled, shares, ["new", "returning", "mobile"])
    odd = {key: value for key, value in legacy.items() if key != "gain"}  # a key not written
    odd["segments"] = [{**entry, "added_later": [1, 2]} for entry in legacy["segments"]]  # keys of other versions
    odd["platform_guardrails"] = [{key: value for key, value in entry.items() if key != "interval"}
                                  for entry in legacy["platform_guardrails"]]
    summary = RoundSummary.load({"objective": 0.5, "segments": odd})
    assert summary.segments.gain is None and summary.segments.platform_guardrails[0].interval is None
    assert summary.segments.segments[0].added_later == [1, 2]
    assert json.dumps(summary.to_json()) == json.dumps({"objective": 0.5, "segments": odd})


def test_a_segmented_row_in_the_stored_shape_is_served_and_exported_as_stored(api, app):
    """The rounds API sends the stored per-segment JSON byte for byte (also cut to ?arms=N as the dict
    was), and the exporter reads it; an old row without ``gain`` is served without it."""
    from tests.service.test_segments import segmented_body

    body = segmented_body(arms=[{"name": name} for name in "abcd"])
    assert api("POST", "/api/v1/experiments", json=body).status_code == 201
    units = [f"u{i}" for i in range(120)]
    segments = [("new", "returning", "mobile")[i % 3] for i in range(120)]
    answers = api("POST", "/api/v1/experiments/seg/assign", role="ingest",
                  json={"units": units, "segments": segments}).get_json()["assignments"]
    rng = np.random.default_rng(2)
    observations = [{"id": f"o-{a['unit']}", "unit": a["unit"], "round": 0, "segment": a["segment"],
                     "values": {"x": float("abcd".index(a["arm"])) + rng.normal(), "y": rng.normal()}}
                    for a in answers]
    assert api("POST", "/api/v1/experiments/seg/observations", role="ingest",
               json={"observations": observations}).status_code == 202
    assert api("POST", "/api/v1/experiments/seg/rounds").status_code == 200
    with get_db(app).read() as session:
        stored = session.execute(sa.select(Round.summary).where(Round.index == 0)).scalar_one()
    assert list(stored["segments"]) == ["segments", "objective", "platform_guardrails", "global_mixture", "gain"]

    def served(path: str) -> str:
        response = api("GET", path, role="read")
        assert response.status_code == 200, response.get_json()
        return json.dumps(json.loads(response.get_data())["rounds"][0]["segments"]["summary"])

    assert served("/api/v1/experiments/seg/rounds") == json.dumps(stored["segments"])
    kept = json.loads(api("GET", "/api/v1/experiments/seg/rounds?arms=2", role="read").get_data())[
        "arm_summary"]["arms"]
    cut = {**stored["segments"],
           "segments": [{**entry, "probabilities": [entry["probabilities"][k] for k in kept],
                         "deployed": [entry["deployed"][k] for k in kept]} for entry in stored["segments"]["segments"]],
           "global_mixture": {**stored["segments"]["global_mixture"],
                              "probabilities": [stored["segments"]["global_mixture"]["probabilities"][k] for k in kept]}}
    assert served("/api/v1/experiments/seg/rounds?arms=2") == json.dumps(cut)

    old = {**stored, "segments": {key: value for key, value in stored["segments"].items() if key != "gain"}}
    with get_db(app).write() as session:
        session.execute(sa.update(Round).where(Round.index == 0).values(summary=old))
    assert served("/api/v1/experiments/seg/rounds") == json.dumps(old["segments"])
    text = api("GET", "/metrics", role="read").get_data(as_text=True)
    samples = {family.name: family.samples for family in text_string_to_metric_families(text)}
    shares = {sample.labels["segment"]: sample.value for sample in samples["pasto_segment_share"]}
    assert shares == {entry["name"]: pytest.approx(entry["share"]) for entry in old["segments"]["segments"]}
    assert not samples["pasto_segmenting_gain_estimate"]
