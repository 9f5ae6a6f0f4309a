"""Per-segment mixtures through the API: creation, assignment, observations, the round close,
diagnostics, and every bad segment input a 4xx naming it."""

from __future__ import annotations

import numpy as np
import pytest

from pasto.hashing import buckets, choose_arms

SEGMENTS = ["new", "returning", "mobile"]


def segmented_body(name: str = "seg", **overrides):
    body = {
        "name": name,
        "arms": [{"name": "a"}, {"name": "b"}, {"name": "c"}],
        "metrics": ["x", "y"],
        "objective": {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "hard": True}]},
        "round_seconds": 3600,
        "seed": 11,
        "segments": {"names": SEGMENTS, "shares": [0.5, 0.3, 0.2]},
    }
    body.update(overrides)
    return body


def test_segmented_experiment_serves_each_segment_its_mixture(api):
    created = api("POST", "/api/v1/experiments", json=segmented_body())
    assert created.status_code == 201, created.get_json()
    experiment = created.get_json()
    assert experiment["segments"]["names"] == SEGMENTS
    assert experiment["segments"]["scopes"] == ["global"]
    assert set(experiment["segments"]["probabilities"]) == set(SEGMENTS)
    one = api("POST", "/api/v1/experiments/seg/assign", role="ingest", json={"unit": "u1", "segment": "mobile"})
    assert one.status_code == 200, one.get_json()
    assert one.get_json()["segment"] == "mobile"
    units = [f"u{i}" for i in range(300)]
    segments = [SEGMENTS[i % 3] for i in range(300)]
    batch = api("POST", "/api/v1/experiments/seg/assign", role="ingest", json={"units": units, "segments": segments})
    assert batch.status_code == 200, batch.get_json()
    answers = batch.get_json()["assignments"]
    assert [answer["segment"] for answer in answers] == segments
    # The server's arm is the segment's mixture through pasto.hashing.
    u = buckets(11, units, 0)
    for segment in SEGMENTS:
        members = [i for i, s in enumerate(segments) if s == segment]
        expected = choose_arms(np.asarray(experiment["segments"]["probabilities"][segment]), u[members])
        assert [answers[i]["arm"] for i in members] == [["a", "b", "c"][k] for k in expected]
    means = {"new": {"a": (2, -1), "b": (0, 1), "c": (1, 0)}, "returning": {"a": (0, 1), "b": (2, -1), "c": (1, 0)},
             "mobile": {"a": (1, 0), "b": (1, 0), "c": (2, 1)}}
    rng = np.random.default_rng(0)
    for round_index in range(3):
        batch = api("POST", "/api/v1/experiments/seg/assign", role="ingest",
                    json={"units": units, "segments": segments}).get_json()["assignments"]
        observations = [
            {"id": f"{round_index}-{a['unit']}", "unit": a["unit"], "round": a["round"], "segment": a["segment"],
             "values": dict(zip(["x", "y"], np.add(means[a["segment"]][a["arm"]], rng.normal(0, 0.3, 2)).tolist()))}
            for a in batch
        ]
        posted = api("POST", "/api/v1/experiments/seg/observations", role="ingest", json={"observations": observations})
        assert posted.status_code == 202, posted.get_json()
        closed = api("POST", "/api/v1/experiments/seg/rounds", json={"round": round_index})
        assert closed.status_code == 200, closed.get_json()
    experiment = api("GET", "/api/v1/experiments/seg", role="read").get_json()
    deployed = {name: np.asarray(p) for name, p in experiment["segments"]["deployed"].items()}
    assert deployed["mobile"].argmax() == 2 and deployed["new"].argmax() != deployed["returning"].argmax()
    diagnostics = api("GET", "/api/v1/experiments/seg/diagnostics", role="read")
    assert diagnostics.status_code == 200, diagnostics.get_json()
    segments_report = diagnostics.get_json()["segments"]
    assert [entry["name"] for entry in segments_report["segments"]] == SEGMENTS
    np.testing.assert_allclose([entry["share"] for entry in segments_report["segments"]], [1 / 3] * 3, atol=0.01)
    assert segments_report["gain"]["value"] > 0
    low, high = segments_report["gain"]["interval"]
    assert low <= segments_report["gain"]["value"] <= high
    assert segments_report["platform_guardrails"][0]["metric"] == "y"
    rounds = api("GET", "/api/v1/experiments/seg/rounds", role="read").get_json()["rounds"]
    assert sum(sum(entry["counts"]) for entry in rounds) == 900
    assert [sum(entry["segments"]["observations"].values()) for entry in rounds] == [300, 300, 300, 0]
    assert rounds[0]["segments"]["observations"] == {"new": 100, "returning": 100, "mobile": 100}
    assert rounds[2]["segments"]["summary"]["segments"][2]["name"] == "mobile"
    assert rounds[3]["segments"]["summary"] is None
    assert rounds[3]["segments"]["probabilities"] == experiment["segments"]["probabilities"]


def test_segmented_answers_match_the_published_schemas(api):
    """Every segmented answer and request validates against the OpenAPI document."""
    import jsonschema

    document = api("GET", "/api/v1/openapi.json", role=None).get_json()

    def check(method, path, schema_name=None, role="admin", **kwargs):
        response = api(method, path, role=role, **kwargs)
        assert response.status_code < 300, response.get_json()
        template = path.replace("/seg", "/{name}")
        schema = document["paths"][template][method.lower()]["responses"][str(response.status_code)]
        schema = {**schema["content"]["application/json"]["schema"], "components": document["components"]}
        jsonschema.Draft202012Validator(schema).validate(response.get_json())
        if schema_name is not None:
            request_schema = {"$ref": f"#/components/schemas/{schema_name}", "components": document["components"]}
            jsonschema.Draft202012Validator(request_schema).validate(kwargs["json"])
        return response.get_json()

    check("POST", "/api/v1/experiments", "ExperimentCreate", json=segmented_body())
    check("GET", "/api/v1/experiments/seg", role="read")
    check("POST", "/api/v1/experiments/seg/assign", "AssignOne", role="ingest", json={"unit": "u", "segment": "new"})
    check("POST", "/api/v1/experiments/seg/assign", "AssignMany", role="ingest",
          json={"units": ["u", "v"], "segment": "new"})
    check("POST", "/api/v1/experiments/seg/observations", "ObservationBatch", role="ingest",
          json={"observations": [{"id": "o", "unit": "u", "round": 0, "segment": "new", "values": {"x": 1.0}}]})
    check("POST", "/api/v1/experiments/seg/rounds")
    check("GET", "/api/v1/experiments/seg/rounds", role="read")
    check("GET", "/api/v1/experiments/seg/diagnostics", role="read")


def _problems(response) -> list[dict]:
    return response.get_json()["error"]["details"]


@pytest.mark.parametrize("change, location, words", [
    (lambda b: b.update(segments={"names": ["a", "a"]}), "segments.names[1]", "Duplicate segment name 'a'"),
    (lambda b: b.update(segments=["a", "a"]), "segments[1]", "Duplicate segment name 'a'"),
    (lambda b: b.update(segments={"names": ["a", "b"], "shares": [1.0]}), "segments.shares", "one share per segment"),
    (lambda b: b.update(segments={"names": ["a", "b"], "shares": [0.5, 0.6]}), "segments.shares", "sum to 1"),
    (lambda b: b["objective"]["guardrails"][0].update(hard=False, penalty=5.0), "objective.guardrails",
     "hard guardrails only"),
    (lambda b: (b.pop("segments"), b["objective"]["guardrails"][0].update(scope="segment")),
     "objective.guardrails[0].scope", "only to an experiment with segments"),
    (lambda b: b["objective"]["guardrails"][0].update(scope="everywhere"), "objective.guardrails[0].scope", ""),
    (lambda b: b.update(segments={"by": "country", "names": ["a"]}), "segments", "either names"),
    (lambda b: b.update(segments={"by": "country", "shares": [1.0]}), "segments.shares", "no expected shares"),
    (lambda b: b.update(segments={"by": "country", "min_units": 0}), "segments.spec.min_units", "greater than or equal to 1"),
    (lambda b: b.update(segments=["new", "(other)"]), "segments", "reserved"),
])
def test_bad_segment_configuration_is_a_422_naming_it(api, change, location, words):
    body = segmented_body()
    change(body)
    response = api("POST", "/api/v1/experiments", json=body)
    assert response.status_code == 422, response.get_json()
    problems = _problems(response)
    assert any(problem.get("location") == location and words in problem.get("message", "") for problem in problems), \
        problems


def test_bad_segment_on_assign_and_observations_is_a_422_naming_it(api, setup_a):
    assert api("POST", "/api/v1/experiments", json=segmented_body()).status_code == 201
    assert api("POST", "/api/v1/experiments", json=setup_a("plain")).status_code == 201
    cases = [
        ("seg", {"unit": "u", "segment": "tablet"}, "segment", "Unknown segment 'tablet'"),
        ("seg", {"unit": "u"}, "segment", "give the unit's segment"),
        ("plain", {"unit": "u", "segment": "new"}, "segment", "has no segments"),
        ("seg", {"units": ["u", "v"], "segments": ["new", "tablet"]}, "segments[1]", "Unknown segment 'tablet'"),
        ("seg", {"units": ["u", "v"], "segments": ["new"]}, "segments", "one segment per unit"),
        ("seg", {"units": ["u"], "segment": "new", "segments": ["new"]}, "segments", "not both"),
    ]
    for name, body, location, words in cases:
        response = api("POST", f"/api/v1/experiments/{name}/assign", role="ingest", json=body)
        assert response.status_code == 422, (body, response.get_json())
        problems = _problems(response)
        assert any(p.get("location") == location and words in p.get("message", "") for p in problems), (body, problems)
    observation = {"id": "1", "unit": "u", "round": 0, "values": {"x": 1.0}}
    for name, extra, words in [("seg", {"segment": "tablet"}, "Unknown segment 'tablet'"),
                               ("seg", {}, "give the unit's segment"),
                               ("plain", {"segment": "new"}, "has no segments")]:
        response = api("POST", f"/api/v1/experiments/{name}/observations", role="ingest",
                       json={"observations": [{**observation, **extra}]})
        assert response.status_code == 422, response.get_json()
        problems = _problems(response)
        assert any(p.get("location") == "observations[0].segment" and words in p.get("message", "")
                   for p in problems), problems


# Three segments whose best arms differ, under a global (platform-wide) hard guardrail y >= 0:
# "new" prefers a and "returning" b, each at a cost in y that only "mobile"'s surplus can cover
# (per-segment oracle 2.34 with the guardrail binding; the best global mixture, arm a, 1.4).
TRUE_MEANS = {  # segment -> arm -> (x, y)
    "new": {"a": (3.0, -0.4), "b": (0.0, 1.0), "c": (0.0, 0.0)},
    "returning": {"a": (0.0, 1.0), "b": (3.0, -0.4), "c": (0.0, 0.0)},
    "mobile": {"a": (1.0, 1.0), "b": (1.0, 1.0), "c": (1.0, 1.0)},
}
TRUE_SHARES = np.array([0.4, 0.4, 0.2])


def _true_platform(deployed: dict[str, list[float]]) -> tuple[float, float]:
    """Platform primary value and y of per-segment mixtures under the true means and shares."""
    x = y = 0.0
    for share, segment in zip(TRUE_SHARES, SEGMENTS):
        for arm, p in zip("abc", deployed[segment]):
            x += share * p * TRUE_MEANS[segment][arm][0]
            y += share * p * TRUE_MEANS[segment][arm][1]
    return x, y


def test_three_segments_end_to_end_with_the_scheduler(backend_url, app_factory, serve, admin_token):
    """Through HTTP and the real scheduler (1-second rounds) on SQLite and PostgreSQL: three segments'
    traffic assigned in batches, observed with noise; the deployed per-segment mixtures beat the best
    global mixture under the true means and keep the global guardrail."""
    import time

    import requests

    from pasto.objectives import Objective
    from pasto.segments import global_mixture, solve_joint
    from service.db import get_db
    from service.scheduler import start_scheduler

    app = app_factory(backend_url, PASTO_SCHEDULER_INTERVAL=0.2)
    scheduler = start_scheduler(app)
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {admin_token}"
    try:
        base = serve(app)
        body = segmented_body("e2e", round_seconds=1, segments={"names": SEGMENTS, "shares": TRUE_SHARES.tolist()})
        created = session.post(f"{base}/api/v1/experiments", json=body, timeout=30)
        assert created.status_code == 201, created.text
        url = f"{base}/api/v1/experiments/e2e"
        rng = np.random.default_rng(5)
        population = [f"user-{i}" for i in range(20_000)]
        population_segments = rng.choice(3, size=len(population), p=TRUE_SHARES)
        sent, last_round, batch_number = 0, -1, 0
        deadline = time.monotonic() + 120
        while last_round < 15:
            assert time.monotonic() < deadline, f"the scheduler stopped advancing rounds at {last_round}"
            picked = rng.choice(len(population), size=1500, replace=False)
            units = [population[i] for i in picked]
            segments = [SEGMENTS[population_segments[i]] for i in picked]
            answer = session.post(f"{url}/assign", json={"units": units, "segments": segments}, timeout=30)
            assert answer.status_code == 200, answer.text
            assignments = answer.json()["assignments"]
            noise = rng.normal(0.0, 0.5, size=(len(assignments), 2))
            observations = [
                {"id": f"{batch_number}:{a['unit']}", "unit": a["unit"], "round": a["round"], "arm": a["arm"],
                 "segment": a["segment"],
                 "values": {"x": TRUE_MEANS[a["segment"]][a["arm"]][0] + nx,
                            "y": TRUE_MEANS[a["segment"]][a["arm"]][1] + ny}}
                for a, (nx, ny) in zip(assignments, noise)
            ]
            posted = session.post(f"{url}/observations", json={"observations": observations}, timeout=30)
            assert posted.status_code == 202, posted.text
            assert posted.json() == {"accepted": len(observations), "duplicates": 0}
            sent += len(observations)
            batch_number += 1
            served_round = assignments[0]["round"]
            if served_round == last_round:
                time.sleep(0.1)
            last_round = served_round
        experiment = session.get(url, timeout=30).json()
        assert experiment["applied_rounds"] >= 15
        deployed = experiment["segments"]["deployed"]
        value, guardrail = _true_platform(deployed)

        objective = Objective.from_spec(["x", "y"], {"primary": "x", "guardrails": [
            {"metric": "y", "threshold": 0.0, "hard": True}]})
        means = np.array([[[TRUE_MEANS[s][arm][m] for arm in "abc"] for m in range(2)] for s in SEGMENTS])
        oracle = solve_joint(objective, means, TRUE_SHARES, ["global"]).value
        tied = global_mixture(objective, means, TRUE_SHARES, ["global"])
        global_value = _true_platform({s: tied.tolist() for s in SEGMENTS})[0]
        assert oracle > global_value + 0.3  # the scenario rewards segmenting
        # Most of the gap closed, the global guardrail kept (up to the noise of 15 rounds).
        assert value >= global_value + 0.5 * (oracle - global_value), (value, global_value, oracle, deployed)
        # Measured: value 2.35 (oracle 2.34), y -0.005: the tolerance is ten times that.
        assert guardrail >= -0.05, (guardrail, deployed)

        rounds = session.get(f"{url}/rounds", timeout=30).json()["rounds"]
        assert sum(sum(entry["counts"]) for entry in rounds) == sent
        assert sum(sum(entry["segments"]["observations"].values()) for entry in rounds) == sent
        diagnostics = session.get(f"{url}/diagnostics", timeout=30).json()["segments"]
        np.testing.assert_allclose([entry["share"] for entry in diagnostics["segments"]], TRUE_SHARES, atol=0.03)
        assert diagnostics["gain"]["interval"][0] > 0
    finally:
        scheduler.shutdown(wait=True)
        get_db(app).engine.dispose()


def test_per_segment_prometheus_series_are_bounded_to_the_top_segments(sqlite_url):
    """PASTO_METRICS_TOP_SEGMENTS = 2 of 3: series for the two largest segments, one aggregate for the
    third; the platform guardrail margin and the gain of segmenting are exported."""
    import math

    from prometheus_client.parser import text_string_to_metric_families

    from service.auth import create_token
    from service.db import get_db
    from tests.service.conftest import Api, make_app

    application = make_app(sqlite_url, PASTO_METRICS_TOP_SEGMENTS=2)
    with get_db(application).write() as session:
        tokens = {role: create_token(session, role, f"test-{role}") for role in ("read", "ingest", "admin")}
    api = Api(application.test_client(), tokens)
    assert api("POST", "/api/v1/experiments", json=segmented_body()).status_code == 201
    units = [f"u{i}" for i in range(600)]
    segments = ["new"] * 300 + ["returning"] * 200 + ["mobile"] * 100
    answers = api("POST", "/api/v1/experiments/seg/assign", role="ingest",
                  json={"units": units, "segments": segments}).get_json()["assignments"]
    rng = np.random.default_rng(3)
    observations = [{"id": a["unit"], "unit": a["unit"], "round": 0, "segment": a["segment"],
                     "values": {"x": float(rng.normal()), "y": float(rng.normal(0.5))}} for a in answers]
    assert api("POST", "/api/v1/experiments/seg/observations", role="ingest",
               json={"observations": observations}).status_code == 202
    assert api("POST", "/api/v1/experiments/seg/rounds").status_code == 200
    text = api("GET", "/metrics", role="read").get_data(as_text=True)
    samples = {family.name: family.samples for family in text_string_to_metric_families(text)}
    shares = {s.labels["segment"]: s.value for s in samples["pasto_segment_share"]}
    assert set(shares) == {"new", "returning"}
    assert math.isclose(shares["new"], 0.5) and math.isclose(shares["returning"], 1 / 3)
    (other,) = samples["pasto_other_segments_share"]
    assert math.isclose(other.value, 1 / 6)
    assert {s.labels["segment"] for s in samples["pasto_segment_objective_estimate"]} == {"new", "returning"}
    assert {s.labels["bound"] for s in samples["pasto_segmenting_gain_estimate"]} == {"estimate", "lower", "upper"}
    (margin,) = samples["pasto_platform_guardrail_margin"]
    assert margin.labels == {"experiment": "seg", "metric": "y", "guardrail": "0", "scope": "global"}
    diagnostics = api("GET", "/api/v1/experiments/seg/rounds", role="read").get_json()["rounds"][0]["segments"]
    platform = diagnostics["summary"]["platform_guardrails"][0]
    assert math.isclose(margin.value, platform["estimate"] - platform["threshold"])
    get_db(application).engine.dispose()


def test_late_observations_reach_the_segment_totals_and_a_stopped_experiment_serves_each_segments_deployed(api):
    assert api("POST", "/api/v1/experiments", json=segmented_body()).status_code == 201

    def observe(ids, round_index, segment):
        answers = api("POST", "/api/v1/experiments/seg/assign", role="ingest",
                      json={"units": ids, "segment": segment}).get_json()["assignments"]
        body = {"observations": [{"id": f"{a['unit']}-{round_index}", "unit": a["unit"], "round": round_index,
                                  "segment": segment, "values": {"x": 1.0, "y": 0.5}} for a in answers]}
        response = api("POST", "/api/v1/experiments/seg/observations", role="ingest", json=body)
        assert response.status_code == 202, response.get_json()

    observe([f"n{i}" for i in range(40)], 0, "new")
    observe([f"r{i}" for i in range(20)], 0, "returning")
    assert api("POST", "/api/v1/experiments/seg/rounds", json={"round": 0}).status_code == 200
    # Late for round 0 (its update ran): the sticky arm is recomputed under round 0's segment mixture.
    late_units = [f"late{i}" for i in range(10)]
    body = {"observations": [{"id": f"late-{unit}", "unit": unit, "round": 0, "segment": "mobile",
                              "values": {"x": 2.0}} for unit in late_units]}
    assert api("POST", "/api/v1/experiments/seg/observations", role="ingest", json=body).status_code == 202
    before = api("GET", "/api/v1/experiments/seg/diagnostics", role="read").get_json()["segments"]["segments"]
    assert [entry["observations"] for entry in before] == [40, 20, 10]  # totals + late cells, read without writing
    assert api("POST", "/api/v1/experiments/seg/rounds", json={"round": 1}).status_code == 200
    rounds = api("GET", "/api/v1/experiments/seg/rounds", role="read").get_json()["rounds"]
    assert rounds[0]["late_observations"] == 10 and rounds[0]["segments"]["observations"]["mobile"] == 10
    # Round 1's update folded the late cells into the per-segment totals its summary was computed on.
    summary = rounds[1]["segments"]["summary"]["segments"]
    assert [entry["observations"] for entry in summary] == [40, 20, 10]

    stopped = api("POST", "/api/v1/experiments/seg/stop").get_json()
    for segment in SEGMENTS:
        deployed = stopped["segments"]["deployed"][segment]
        answers = api("POST", "/api/v1/experiments/seg/assign", role="ingest",
                      json={"units": [f"s{i}" for i in range(200)], "segment": segment}).get_json()["assignments"]
        for answer in answers:
            assert answer["probability"] == deployed["abc".index(answer["arm"])]


def test_an_open_set_gives_a_value_its_own_mixture_after_min_units(backend_api):
    """{"by": "country", "min_units": 50}: every value starts on the long tail's mixture ("(other)");
    after a close, a value with 50 units has its own segment (its earlier data stay in the long tail's
    statistics), one with fewer does not; unknown values and no value fall back to the long tail; the
    server and an offline LocalAssigner agree."""
    from pasto_client import LocalAssigner

    api = backend_api  # SQLite and PostgreSQL
    body = segmented_body("open", segments={"by": "country", "min_units": 50, "max_segments": 5})
    created = api("POST", "/api/v1/experiments", json=body)
    assert created.status_code == 201, created.get_json()
    view = created.get_json()["segments"]
    assert view["names"] == ["(other)"] and view["by"] == "country" and view["min_units"] == 50

    def play(round_index, counts):
        observations = []
        for value, count in counts.items():
            units = [f"{value}-{round_index}-{i}" for i in range(count)]
            payload = {"units": units} if value is None else {"units": units, "segment": value}
            answers = api("POST", "/api/v1/experiments/open/assign", role="ingest", json=payload).get_json()
            for answer in answers["assignments"]:
                observation = {"id": f"{round_index}-{answer['unit']}", "unit": answer["unit"], "round": round_index,
                               "values": {"x": 1.0, "y": 0.2}}
                if value is not None:
                    observation["segment"] = value
                observations.append(observation)
        response = api("POST", "/api/v1/experiments/open/observations", role="ingest",
                       json={"observations": observations})
        assert response.status_code == 202, response.get_json()

    one = api("POST", "/api/v1/experiments/open/assign", role="ingest", json={"unit": "u", "segment": "fr"}).get_json()
    assert one["segment"] == "(other)"
    play(0, {"fr": 60, "de": 20, None: 30})
    assert api("POST", "/api/v1/experiments/open/rounds").status_code == 200
    experiment = api("GET", "/api/v1/experiments/open", role="read").get_json()
    assert experiment["segments"]["names"] == ["(other)", "fr"]
    assert len(experiment["segments"]["probabilities"]) == 2
    answers = api("POST", "/api/v1/experiments/open/assign", role="ingest",
                  json={"units": ["a", "b", "c"], "segments": ["fr", "de", "jp"]}).get_json()["assignments"]
    assert [answer["segment"] for answer in answers] == ["fr", "(other)", "(other)"]
    # Late for round 0: "fr" was served the long tail's mixture then, and its data stay there.
    late = [{"id": f"late-{i}", "unit": f"fr-0-{i}", "round": 0, "segment": "fr", "values": {"x": 1.0}} for i in range(5)]
    assert api("POST", "/api/v1/experiments/open/observations", role="ingest",
               json={"observations": late}).status_code == 202
    play(1, {"fr": 40, "de": 40})  # "de" reaches 60 units: its own mixture at the next close
    assert api("POST", "/api/v1/experiments/open/rounds").status_code == 200
    experiment = api("GET", "/api/v1/experiments/open", role="read").get_json()
    assert experiment["segments"]["names"] == ["(other)", "fr", "de"]
    rounds = api("GET", "/api/v1/experiments/open/rounds", role="read").get_json()["rounds"]
    assert rounds[0]["segments"]["observations"] == {"(other)": 115}
    assert rounds[1]["segments"]["observations"] == {"(other)": 40, "fr": 40}
    diagnostics = api("GET", "/api/v1/experiments/open/diagnostics", role="read").get_json()["segments"]
    assert [entry["name"] for entry in diagnostics["segments"]] == ["(other)", "fr", "de"]
    assert [entry["observations"] for entry in diagnostics["segments"]] == [155, 40, 0]

    units = [f"x{i}" for i in range(3000)]
    values = [["fr", "de", "jp", "(other)"][i % 4] for i in range(3000)]
    served = api("POST", "/api/v1/experiments/open/assign", role="ingest",
                 json={"units": units, "segments": values}).get_json()["assignments"]
    local = LocalAssigner(None, "open", experiment=experiment)
    mine = local.assign_many(units, values)
    assert [(a.arm, a.probability, a.segment) for a in mine] == \
        [(s["arm"], s["probability"], s["segment"]) for s in served]
    assert local.assign("x0").segment == "(other)"


def test_statistics_batches_carry_the_segment_of_each_cell(api, setup_a):
    """POST .../statistics: a segmented experiment's cells name their segment (two cells of one round,
    arm and metric in two segments are stored apart and summed for the experiment's round history); a
    missing or unknown segment, or one sent to an unsegmented experiment, is a 422 naming the cell."""
    assert api("POST", "/api/v1/experiments", json=segmented_body()).status_code == 201
    assert api("POST", "/api/v1/experiments", json=setup_a("plain")).status_code == 201
    cells = [{"round": 0, "arm": "a", "metric": "x", "count": 10, "sum": 20.0, "sum_of_squares": 50.0, "segment": "new"},
             {"round": 0, "arm": "a", "metric": "x", "count": 5, "sum": 5.0, "sum_of_squares": 9.0,
              "segment": "mobile"},
             {"round": 0, "arm": "b", "metric": "y", "count": 4, "sum": 2.0, "sum_of_squares": 3.0,
              "segment": "returning"}]
    response = api("POST", "/api/v1/experiments/seg/statistics", role="ingest",
                   json={"batch_id": "b1", "cells": cells, "units": [{"round": 0, "arm": "a", "units": 15}]})
    assert response.status_code < 300, response.get_json()
    again = api("POST", "/api/v1/experiments/seg/statistics", role="ingest",
                json={"batch_id": "b1", "cells": cells, "units": [{"round": 0, "arm": "a", "units": 15}]})
    assert again.get_json()["duplicate"] is True
    rounds = api("GET", "/api/v1/experiments/seg/rounds", role="read").get_json()["rounds"]
    assert rounds[0]["counts"] == [15, 4, 0]
    assert rounds[0]["segments"]["observations"] == {"new": 10, "returning": 4, "mobile": 5}
    assert api("POST", "/api/v1/experiments/seg/rounds").status_code == 200
    summary = api("GET", "/api/v1/experiments/seg/rounds", role="read").get_json()["rounds"][0]["segments"]["summary"]
    assert [entry["observations"] for entry in summary["segments"]] == [10, 4, 5]

    for name, cell, words in [
        ("seg", {k: v for k, v in cells[0].items() if k != "segment"}, "give the unit's segment"),
        ("seg", {**cells[0], "segment": "tablet"}, "Unknown segment 'tablet'"),
        ("plain", {**cells[0], "segment": "new"}, "has no segments"),
    ]:
        response = api("POST", f"/api/v1/experiments/{name}/statistics", role="ingest",
                       json={"batch_id": f"bad-{name}-{words}", "cells": [cell]})
        assert response.status_code == 422, response.get_json()
        assert any(p["location"] == "cells[0].segment" and words in p["message"] for p in _problems(response))


def test_a_segmented_experiment_runs_exploration_serving_and_refuses_safe_serving(api):
    """The segmented controller serves the joint LP's mixtures with exploration: the default
    AlgorithmConfig's safe serving is replaced by it, and asking for safe serving is a 422 saying why."""
    created = api("POST", "/api/v1/experiments", json=segmented_body()).get_json()
    assert created["algorithm"]["serving"] == "exploration"
    response = api("POST", "/api/v1/experiments", json=segmented_body("safe", algorithm={"serving": "safe"}))
    assert response.status_code == 422
    assert any(p["location"] == "algorithm.serving" and "not available with segments" in p["message"]
               for p in _problems(response))
    # Its options, too: a holdout the segmented controller would not serve is refused, not ignored.
    response = api("POST", "/api/v1/experiments", json=segmented_body("held", algorithm={"serving_holdout": 0.1}))
    assert response.status_code == 422
    assert any(p["location"] == "algorithm.serving_holdout" and "safe-serving option" in p["message"]
               for p in _problems(response))
