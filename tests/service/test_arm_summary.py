"""``?arms=N`` on the experiment, experiments, rounds and diagnostics reads (per-arm arrays cut to the
N arms of largest max(p_t, deployed) plus one summed ``rest``), and the diagnostics' cached optimum.

Every summarised response is checked against the full response of the same state: the kept arms'
entries are the full arrays' entries, ``rest`` is the sum over the others, and every other field is
unchanged. The cached optimum is checked against a fresh solve by a second application (its own
engine, hence its own process cache) on the same database after every kind of change.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from service.controller import reports
from service.db import get_db
from tests.service.conftest import Api, make_app

NAME = "many"
PATH = f"/api/v1/experiments/{NAME}"
N_ARMS = 12
#: True means per arm (x, y): different enough that the deployed mixture has no ties after a round.
MEANS_X = np.linspace(-1.0, 2.0, N_ARMS)
MEANS_Y = np.linspace(1.0, -1.0, N_ARMS)
#: Noise sd: two rounds of 120 units then defend a mixture (f 0.61) against the uniform start (f 0.5),
#: which the deployed mixture keeps until the evidence does (with sd 1 it did so in some runs only).
NOISE = 0.3


def body() -> dict:
    return {
        "name": NAME,
        "arms": [{"name": f"arm{k}", "params": {"k": k}} for k in range(N_ARMS)],
        "metrics": ["x", "y"],
        "objective": {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "penalty": 5.0}]},
        "round_seconds": 3600,
        "seed": 3,
    }


def play(api: Api, tag: str, units: int = 120, round_index: int | None = None, close: bool = True) -> None:
    """Assign ``units`` units, observe each one's arm with noisy values; close the round if asked."""
    # zlib.crc32, not hash(): str hashes change with every interpreter (PYTHONHASHSEED), so the data did too.
    rng = np.random.default_rng(zlib.crc32(tag.encode()))
    assigned = api("POST", f"{PATH}/assign", role="ingest",
                   json={"units": [f"{tag}{i}" for i in range(units)]}).get_json()["assignments"]
    observations = []
    for assignment in assigned:
        k = int(assignment["arm"][3:])
        observations.append({"id": assignment["unit"], "unit": assignment["unit"],
                             "round": assignment["round"] if round_index is None else round_index,
                             "values": {"x": float(MEANS_X[k] + NOISE * rng.normal()),
                                        "y": float(MEANS_Y[k] + NOISE * rng.normal())}})
    answer = api("POST", f"{PATH}/observations", role="ingest", json={"observations": observations})
    assert answer.status_code == 202, answer.get_json()
    if close:
        assert api("POST", f"{PATH}/rounds").status_code == 200


def get(api: Api, path: str) -> dict:
    answer = api("GET", path, role="read")
    assert answer.status_code == 200, answer.get_data(as_text=True)
    return answer.get_json()


def kept_arms(probabilities: list[float], deployed: list[float], count: int) -> list[int]:
    """The documented order: largest max(p_t, deployed) first, ties by arm position."""
    return sorted(range(len(deployed)), key=lambda k: (-max(probabilities[k], deployed[k]), k))[:count]


def rest_sum(values: list, kept: list[int]) -> float:
    return float(sum(value for k, value in enumerate(values) if k not in kept))


def check_arrays(full: dict, summary: dict, kept: list[int], fields: tuple[str, ...]) -> None:
    for field in fields:
        assert summary[field] == [full[field][k] for k in kept], field


def without(response: dict, *fields: str) -> dict:
    return {key: value for key, value in response.items() if key not in fields}


def check_experiment(full: dict, summary: dict, count: int) -> list[int]:
    kept = kept_arms(full["probabilities"], full["deployed"], count)
    assert summary["arm_summary"] == {"arms": kept, "names": [full["arms"][k]["name"] for k in kept],
                                      "rest_arms": N_ARMS - count}
    check_arrays(full, summary, kept, ("arms", "probabilities", "deployed"))
    assert summary["rest"]["arms"] == N_ARMS - count
    assert summary["rest"]["probabilities"] == pytest.approx(rest_sum(full["probabilities"], kept), abs=1e-12)
    assert summary["rest"]["deployed"] == pytest.approx(rest_sum(full["deployed"], kept), abs=1e-12)
    assert set(summary["rest"]) == {"arms", "probabilities", "deployed"}
    assert without(summary, "arms", "probabilities", "deployed", "arm_summary", "rest") == without(
        full, "arms", "probabilities", "deployed")
    return kept


def check_rounds(full: dict, summary: dict, kept: list[int], arm_summary: dict) -> None:
    assert summary["arm_summary"] == arm_summary
    assert summary["next_since"] == full["next_since"]
    assert len(summary["rounds"]) == len(full["rounds"]) > 0
    for whole, cut in zip(full["rounds"], summary["rounds"]):
        check_arrays(whole, cut, kept, ("probabilities", "counts", "units"))
        assert cut["deployed"] == (None if whole["deployed"] is None else [whole["deployed"][k] for k in kept])
        assert cut["means"] == {metric: [values[k] for k in kept] for metric, values in whole["means"].items()}
        rest = cut["rest"]
        assert rest["arms"] == N_ARMS - len(kept)
        assert rest["probabilities"] == pytest.approx(rest_sum(whole["probabilities"], kept), abs=1e-12)
        assert rest["deployed"] == (None if whole["deployed"] is None
                                    else pytest.approx(rest_sum(whole["deployed"], kept), abs=1e-12))
        assert rest["counts"] == rest_sum(whole["counts"], kept) and isinstance(rest["counts"], int)
        assert rest["units"] == rest_sum(whole["units"], kept) and isinstance(rest["units"], int)
        # What the dashboard draws from a round: every observation is in the kept arms or the rest.
        assert sum(cut["counts"]) + rest["counts"] == sum(whole["counts"])
        assert without(cut, "probabilities", "deployed", "counts", "units", "means", "rest") == without(
            whole, "probabilities", "deployed", "counts", "units", "means")


def check_diagnostics(full: dict, summary: dict, kept: list[int], arm_summary: dict, deployed: list[float]) -> None:
    assert summary["arm_summary"] == arm_summary
    assert summary["best_mixture"]["probabilities"] == [full["best_mixture"]["probabilities"][k] for k in kept]
    assert summary["units"] == [full["units"][k] for k in kept]
    for part in ("means", "standard_errors"):
        assert summary["estimate"][part] == {metric: [values[k] for k in kept]
                                             for metric, values in full["estimate"][part].items()}
    rest = summary["rest"]
    assert rest["arms"] == N_ARMS - len(kept)
    assert rest["best_mixture"] == pytest.approx(rest_sum(full["best_mixture"]["probabilities"], kept), abs=1e-12)
    assert rest["units"] == rest_sum(full["units"], kept)
    for metric in full["estimate"]["means"]:
        means, errors = full["estimate"]["means"][metric], full["estimate"]["standard_errors"][metric]
        used = [k for k in range(N_ARMS) if k not in kept and deployed[k] > 0]
        # play() observes every unit on both metrics, so an arm has data on a metric iff it has units;
        # an arm without data has no estimate (its mean in `estimate` is a stand-in): null, both sums.
        unknown = any(full["units"][k] == 0 for k in used)
        expected_mean = (None if unknown or any(means[k] is None for k in used)
                         else sum(deployed[k] * means[k] for k in used))
        expected_variance = (None if unknown or any(errors[k] is None for k in used)
                             else sum((deployed[k] * errors[k]) ** 2 for k in used))
        assert rest["deployed_means"][metric] == (None if expected_mean is None
                                                  else pytest.approx(expected_mean, abs=1e-12))
        assert rest["deployed_variances"][metric] == (None if expected_variance is None
                                                      else pytest.approx(expected_variance, abs=1e-12))
    # The deployed mixture's primary estimate, as the dashboard sums it: kept arms plus the rest.
    if all(units > 0 for p, units in zip(deployed, full["units"]) if p > 0):
        whole = sum(p * mean for p, mean in zip(deployed, full["estimate"]["means"]["x"]))
        kept_part = sum(deployed[k] * full["estimate"]["means"]["x"][k] for k in kept)
        assert kept_part + rest["deployed_means"]["x"] == pytest.approx(whole, abs=1e-9)
    assert without(summary, "best_mixture", "units", "estimate", "arm_summary", "rest") == without(
        full, "best_mixture", "units", "estimate")
    assert summary["best_mixture"]["value"] == full["best_mixture"]["value"]


def check_all_reads(api: Api) -> None:
    """Every read, full and summarised with several N, on the current state."""
    full = get(api, PATH)
    full_list = get(api, "/api/v1/experiments")["experiments"]
    full_rounds = get(api, f"{PATH}/rounds")
    full_diagnostics = get(api, f"{PATH}/diagnostics")
    for response in (full, full_rounds, full_diagnostics, *full_list):
        assert "arm_summary" not in response and "rest" not in response
    for count in (1, 5, N_ARMS - 1):
        summary = get(api, f"{PATH}?arms={count}")
        kept = check_experiment(full, summary, count)
        (listed,) = get(api, f"/api/v1/experiments?arms={count}")["experiments"]
        check_experiment(full_list[0], listed, count)
        check_rounds(full_rounds, get(api, f"{PATH}/rounds?arms={count}"), kept, summary["arm_summary"])
        check_diagnostics(full_diagnostics, get(api, f"{PATH}/diagnostics?arms={count}"), kept,
                          summary["arm_summary"], full["deployed"])
    # N >= K keeps every arm in arm order: the full response, byte for byte.
    for count in (N_ARMS, N_ARMS + 1, 2**31 - 1):
        assert get(api, f"{PATH}?arms={count}") == full
        assert get(api, f"{PATH}/rounds?arms={count}") == full_rounds
        assert get(api, f"{PATH}/diagnostics?arms={count}") == full_diagnostics


def test_summaries_keep_the_top_deployed_arms_and_sum_the_rest(api):
    assert api("POST", "/api/v1/experiments", json=body()).status_code == 201
    # Round 0 before any data: a uniform deployed mixture, so the kept arms are the first N (ties by position).
    assert get(api, f"{PATH}?arms=3")["arm_summary"]["arms"] == [0, 1, 2]
    check_all_reads(api)
    play(api, "r0-")
    play(api, "r1-")
    play(api, "r2-", close=False)  # the current round has observations, no summary yet
    deployed = get(api, PATH)["deployed"]
    assert len(set(deployed)) > 1  # the order is decided by the data now, not by the tie rule only
    check_all_reads(api)


def test_the_rest_has_no_deployed_mean_of_a_metric_a_deployed_arm_has_no_data_on(api):
    """docs/api.md: ``deployed_means`` and ``deployed_variances`` are null for a metric when an arm of
    positive deployed probability has no estimate of it yet; the estimate's mean of such an arm is the
    other arms' average (a stand-in), which must not enter the sum."""
    # The paper's serving: the deployed mixture is the average of the served p, every arm of positive probability.
    three = {**body(), "arms": [{"name": f"arm{k}", "params": {"k": k}} for k in range(3)],
             "algorithm": {"preset": "default", "serving": "exploration", "deploy": "average"}}
    assert api("POST", "/api/v1/experiments", json=three).status_code == 201
    means_x, means_y = [1.0, 0.5, -1.0], [0.5, 1.0, 0.2]  # arm2: the worst on x, so never the arm kept
    assigned = api("POST", f"{PATH}/assign", role="ingest",
                   json={"units": [f"u{i}" for i in range(300)]}).get_json()["assignments"]
    rng = np.random.default_rng(5)
    observations = []
    for assignment in assigned:
        k = int(assignment["arm"][3:])
        values = {"x": float(means_x[k] + rng.normal(scale=0.1))}
        if k != 2:  # arm2 is never observed on y
            values["y"] = float(means_y[k] + rng.normal(scale=0.1))
        observations.append({"id": assignment["unit"], "unit": assignment["unit"], "round": assignment["round"],
                             "values": values})
    assert {int(a["arm"][3:]) for a in assigned} == {0, 1, 2}
    assert api("POST", f"{PATH}/observations", role="ingest",
               json={"observations": observations}).status_code == 202
    assert api("POST", f"{PATH}/rounds").status_code == 200
    full = get(api, f"{PATH}/diagnostics")
    deployed = get(api, PATH)["deployed"]
    assert deployed[2] > 0
    # arm2's y mean is filled in (not null) and its standard error is not: the response says which is known.
    assert full["estimate"]["means"]["y"][2] is not None and full["estimate"]["standard_errors"]["y"][2] is None
    summary = get(api, f"{PATH}/diagnostics?arms=1")
    assert 2 not in summary["arm_summary"]["arms"]
    rest = summary["rest"]
    assert rest["deployed_means"]["y"] is None and rest["deployed_variances"]["y"] is None
    used = [k for k in range(3) if k not in summary["arm_summary"]["arms"]]
    means, errors = full["estimate"]["means"]["x"], full["estimate"]["standard_errors"]["x"]
    assert rest["deployed_means"]["x"] == pytest.approx(sum(deployed[k] * means[k] for k in used), abs=1e-12)
    assert rest["deployed_variances"]["x"] == pytest.approx(sum((deployed[k] * errors[k]) ** 2 for k in used),
                                                            abs=1e-12)


def test_a_summarised_rounds_page_has_the_default_page_size_of_k_arms(api, monkeypatch):
    """The server reads every arm of a round to cut the summary: the page size still counts K."""
    monkeypatch.setattr("service.routes.rounds.PAGE_ARM_ROUNDS", 2 * N_ARMS)
    assert api("POST", "/api/v1/experiments", json=body()).status_code == 201
    for round_position in range(4):
        play(api, f"p{round_position}-", units=30)
    full = get(api, f"{PATH}/rounds")
    page = get(api, f"{PATH}/rounds?arms=3")
    assert len(full["rounds"]) == len(page["rounds"]) == 2 and full["next_since"] == page["next_since"] == 2
    last = get(api, f"{PATH}/rounds?arms=3&since=4")
    assert [entry["index"] for entry in last["rounds"]] == [4] and last["next_since"] is None


@pytest.mark.parametrize("value", ["0", "-1", "abc", "1.5", "", "9" * 30, "2147483648"])
@pytest.mark.parametrize("read", ["", "/rounds", "/diagnostics", "list"])
def test_a_bad_arms_value_is_a_422_naming_it(api, value, read):
    assert api("POST", "/api/v1/experiments", json=body()).status_code == 201
    url = f"/api/v1/experiments?arms={value}" if read == "list" else f"{PATH}{read}?arms={value}"
    answer = api("GET", url, role="read")
    assert answer.status_code == 422, answer.get_data(as_text=True)
    error = answer.get_json()["error"]
    assert "arms" in str(error) and error["message"].endswith(".")


def count_solves(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = reports.solve_optimum

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(reports, "solve_optimum", counting)
    return calls


def test_the_cached_optimum_equals_a_fresh_solve_after_every_kind_of_change(sqlite_url, api, monkeypatch):
    """The application under test keeps each experiment's optimum; a second application on the same
    database (its own engine, so its own cache) solves afresh for each comparison."""
    solves = count_solves(monkeypatch)
    assert api("POST", "/api/v1/experiments", json=body()).status_code == 201

    def fresh() -> dict:
        other = make_app(sqlite_url)
        try:
            client = other.test_client()
            answer = client.get(f"{PATH}/diagnostics", headers={"Authorization": f"Bearer {api.tokens['read']}"})
            assert answer.status_code == 200
            return answer.get_json()
        finally:
            get_db(other).engine.dispose()

    def cached_equals_fresh(change: str) -> None:
        before = len(solves)
        cached = get(api, f"{PATH}/diagnostics")
        solved = len(solves) - before
        again = get(api, f"{PATH}/diagnostics")  # a poll with nothing new in between reuses the optimum
        assert len(solves) == before + solved, f"{change}: a poll without a change solved again"
        assert again == cached, change
        # The fresh application solved once more (its own cache is empty), on the same inputs.
        assert cached == fresh(), change

    cached_equals_fresh("created, no data")
    play(api, "a", close=False)
    cached_equals_fresh("observations in the current round")
    play(api, "b", units=60, close=False)
    cached_equals_fresh("more observations in the same round")
    assert api("POST", f"{PATH}/rounds").status_code == 200
    cached_equals_fresh("round closed and applied")
    play(api, "late", units=40, round_index=0, close=False)  # round 0 is applied: these are late
    assert get(api, f"{PATH}/diagnostics")["late_observations"] == 40
    cached_equals_fresh("late observations for an applied round")
    assert api("POST", f"{PATH}/pause").status_code == 200
    cached_equals_fresh("paused (a new version, same estimate)")
    assert api("POST", f"{PATH}/resume").status_code == 200
    play(api, "c")
    cached_equals_fresh("resumed, another round")
    assert api("POST", f"{PATH}/stop").status_code == 200
    cached_equals_fresh("stopped")


def test_a_segmented_experiments_per_segment_arrays_keep_the_same_arms(api):
    segments = ["new", "returning"]
    segmented = {**body(), "segments": {"names": segments, "shares": [0.6, 0.4]},
                 "objective": {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "hard": True}]}}
    assert api("POST", "/api/v1/experiments", json=segmented).status_code == 201
    rng = np.random.default_rng(4)
    for round_index in range(2):
        units = [f"s{round_index}-{i}" for i in range(200)]
        unit_segments = [segments[i % 2] for i in range(200)]
        assigned = api("POST", f"{PATH}/assign", role="ingest",
                       json={"units": units, "segments": unit_segments}).get_json()["assignments"]
        observations = [{"id": a["unit"], "unit": a["unit"], "round": a["round"], "segment": a["segment"],
                         "values": {"x": float(MEANS_X[int(a["arm"][3:])] + rng.normal()),
                                    "y": float(MEANS_Y[int(a["arm"][3:])] + rng.normal())}} for a in assigned]
        assert api("POST", f"{PATH}/observations", role="ingest",
                   json={"observations": observations}).status_code == 202
        assert api("POST", f"{PATH}/rounds").status_code == 200
    full = get(api, PATH)
    summary = get(api, f"{PATH}?arms=4")
    kept = check_experiment({key: value for key, value in full.items() if key != "segments"},
                            {key: value for key, value in summary.items() if key != "segments"}, 4)
    for field in ("probabilities", "deployed"):
        assert summary["segments"][field] == {name: [values[k] for k in kept]
                                              for name, values in full["segments"][field].items()}
    assert without(summary["segments"], "probabilities", "deployed") == without(
        full["segments"], "probabilities", "deployed")
    full_rounds, cut_rounds = get(api, f"{PATH}/rounds"), get(api, f"{PATH}/rounds?arms=4")
    for whole, cut in zip(full_rounds["rounds"], cut_rounds["rounds"], strict=True):
        assert cut["segments"]["probabilities"] == {name: [values[k] for k in kept]
                                                    for name, values in whole["segments"]["probabilities"].items()}
        assert cut["segments"]["observations"] == whole["segments"]["observations"]
        assert cut["segments"]["summary"] == segment_summary_cut(whole["segments"]["summary"], kept)
    assert any(whole["segments"]["summary"] is not None for whole in full_rounds["rounds"])  # something was cut
    full_diagnostics, cut_diagnostics = get(api, f"{PATH}/diagnostics"), get(api, f"{PATH}/diagnostics?arms=4")
    assert cut_diagnostics["segments"] == segment_summary_cut(full_diagnostics["segments"], kept)


def segment_summary_cut(summary: dict | None, kept: list[int]) -> dict | None:
    """A full response's segment report (diagnostics ``segments``, a round's ``segments.summary``) with
    each segment's probabilities and deployed and the global mixture's probabilities at the ``kept``
    positions, in their order; every other field as it was."""
    if summary is None:
        return None
    return {**summary,
            "segments": [{**segment, "probabilities": [segment["probabilities"][k] for k in kept],
                          "deployed": [segment["deployed"][k] for k in kept]} for segment in summary["segments"]],
            "global_mixture": {**summary["global_mixture"],
                               "probabilities": [summary["global_mixture"]["probabilities"][k] for k in kept]}}
