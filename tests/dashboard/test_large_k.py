"""The experiment page at large K (more arms than the page's SUMMARY_ARMS = 100): it reads the
summarised responses (``?arms=100``, docs/api.md) and draws from them what the full API says.

Its own live server: one experiment of 150 arms seeded through the HTTP API (assign, observe,
close), read anonymously from loopback.
"""

from __future__ import annotations

import math
import urllib.parse
from collections.abc import Iterator

import numpy as np
import pytest

from tests.dashboard.conftest import LiveServer, served_app
from tests.dashboard.test_pages import chart_data, open_page

pytestmark = pytest.mark.chromium

NAME = "wide"
N_ARMS = 150
SUMMARY_ARMS = 100  # service/static/dashboard/experiment.js
TOP_ARMS = 7  # the page's PALETTE has 8 colours: 7 arms and "other"
UNITS = 400
MEANS_X = np.linspace(0.0, 2.0, N_ARMS)
MEANS_Y = np.linspace(1.0, -1.0, N_ARMS)


def play(server: LiveServer, tag: str, rng: np.random.Generator) -> None:
    assigned = server.api("POST", f"/experiments/{NAME}/assign", role="ingest",
                          json={"units": [f"{tag}-{i}" for i in range(UNITS)]}).json()["assignments"]
    observations = [{"id": a["unit"], "unit": a["unit"], "round": a["round"],
                     "values": {"x": float(MEANS_X[int(a["arm"][1:])] + rng.normal()),
                                "y": float(MEANS_Y[int(a["arm"][1:])] + rng.normal())}} for a in assigned]
    server.api("POST", f"/experiments/{NAME}/observations", role="ingest", json={"observations": observations})
    server.api("POST", f"/experiments/{NAME}/rounds")


@pytest.fixture(scope="module")
def wide_server(tmp_path_factory) -> Iterator[LiveServer]:
    with served_app(tmp_path_factory.mktemp("wide"), "wide", NAME, PASTO_ANONYMOUS_LOOPBACK_READ=True) as server:
        server.api("POST", "/experiments", json={
            "name": NAME,
            "arms": [{"name": f"a{k}", "params": {"k": k}} for k in range(N_ARMS)],
            "metrics": ["x", "y"],
            # A production setting to start from: the deployed mixture leaves it only as far as the
            # evidence defends (without one it starts at the uniform mixture over 150 arms, and arms
            # seen once have no standard error, so the page rightly shows no primary estimate yet).
            "objective": {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "penalty": 5.0}],
                          "baseline": "a37"},
            "round_seconds": 3600,
            "seed": 5,
        })
        rng = np.random.default_rng(150)
        for round_position in range(4):
            play(server, f"r{round_position}", rng)
        yield server


def full_reads(server: LiveServer) -> tuple[dict, list[dict], dict]:
    """The experiment, every round and the diagnostics, unsummarised (what the API gives by default)."""
    experiment = server.api("GET", f"/experiments/{NAME}", role="read").json()
    rounds = server.api("GET", f"/experiments/{NAME}/rounds?limit=1000", role="read").json()["rounds"]
    diagnostics = server.api("GET", f"/experiments/{NAME}/diagnostics", role="read").json()
    assert "arm_summary" not in experiment and len(experiment["arms"]) == N_ARMS
    return experiment, rounds, diagnostics


def top(values: list[float], count: int) -> list[int]:
    """Largest first, ties by position: the server's and the page's order."""
    return sorted(range(len(values)), key=lambda k: (-values[k], k))[:count]


def formatted(page, function: str, *arguments) -> str:
    """``function`` of the page's own pasto.js on ``arguments`` (the module the page imported)."""
    return page.evaluate(
        "async ([name, args]) => (await import('/static/dashboard/pasto.js'))[name](...args)", [function, list(arguments)])


def test_at_large_k_the_page_reads_summaries_and_draws_what_the_full_api_says(wide_server, browser):
    experiment, rounds, diagnostics = full_reads(wide_server)
    n_rounds = len(rounds)
    context, page, console = open_page(browser, "desktop")
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url) if "/api/v1/" in request.url else None)
    page.goto(f"{wide_server.base_url}/experiments/{NAME}")
    page.wait_for_selector(f'#experiment[data-rounds="{n_rounds}"][data-summarised="true"]')
    assert page.locator("#experiment").get_attribute("data-arms") == str(N_ARMS)

    # Every read of the experiment, its diagnostics and its rounds asked for the summary.
    reads = [urllib.parse.urlsplit(url) for url in requested if f"/experiments/{NAME}" in url and "/events" not in url]
    assert {url.path.rsplit("/", 1)[-1] for url in reads} == {NAME, "diagnostics", "rounds"}
    for url in reads:
        assert urllib.parse.parse_qs(url.query)["arms"] == [str(SUMMARY_ARMS)], url

    # Mixture: the 7 arms of largest p_t and "other", read against the full rounds.
    kept = top([max(p, d) for p, d in zip(experiment["probabilities"], experiment["deployed"])], SUMMARY_ARMS)
    drawn = [arm for arm in top(experiment["probabilities"], TOP_ARMS) if experiment["probabilities"][arm] > 0]
    assert set(drawn) <= set(kept)  # the arms the chart names were kept: max(p_t, deployed) keeps them
    mixture = chart_data(page, "chart-mixture")
    assert [dataset["label"] for dataset in mixture] == (
        [experiment["arms"][arm]["name"] for arm in drawn] + [f"other ({N_ARMS - len(drawn)} arms)"])
    for dataset, arm in zip(mixture, drawn):
        assert dataset["x"] == [entry["index"] for entry in rounds]
        assert dataset["y"] == [entry["probabilities"][arm] for entry in rounds]
    for position, entry in enumerate(rounds):
        other = 1 - sum(entry["probabilities"][arm] for arm in drawn)
        assert math.isclose(mixture[-1]["y"][position], max(0.0, other), abs_tol=1e-12)

    # Deployed bars: the (at most) 7 largest arms of the full deployed mixture that it uses (weight
    # above 0: a zero-weight arm gets no bar), then the rest of the 150.
    deployed_top = [arm for arm in top(experiment["deployed"], TOP_ARMS) if experiment["deployed"][arm] > 0]
    assert deployed_top
    bars = chart_data(page, "chart-deployed")[0]["y"]
    assert page.evaluate("Chart.getChart('chart-deployed').data.labels") == (
        [experiment["arms"][arm]["name"] for arm in deployed_top] + [f"other ({N_ARMS - len(deployed_top)})"])
    assert bars[:-1] == [experiment["deployed"][arm] for arm in deployed_top]
    assert math.isclose(bars[-1], 1 - sum(experiment["deployed"][arm] for arm in deployed_top), abs_tol=1e-12)

    # Observations: every round's total over all 150 arms, and the total of every round.
    health = {dataset["label"]: dataset["y"] for dataset in chart_data(page, "chart-observations")}
    assert [on_time + late for on_time, late in zip(health["on time"][:-1], health["late"][:-1])] == [
        sum(entry["counts"]) for entry in rounds[:-1]]
    total = sum(sum(entry["counts"]) for entry in rounds)
    assert total >= 4 * UNITS
    assert page.locator("#fig-observations").inner_text() == formatted(page, "formatInteger", total)

    # The deployed mixture's primary estimate: kept arms plus the server's rest sums = the full sum.
    used = [k for k in range(N_ARMS) if experiment["deployed"][k] > 0]
    means, errors = diagnostics["estimate"]["means"]["x"], diagnostics["estimate"]["standard_errors"]["x"]
    assert all(means[k] is not None and errors[k] is not None for k in used)
    estimate = sum(experiment["deployed"][k] * means[k] for k in used)
    half = 1.959963984540054 * math.sqrt(sum((experiment["deployed"][k] * errors[k]) ** 2 for k in used))
    assert page.locator("#fig-primary").text_content() == (
        formatted(page, "formatNumber", estimate) + " ± " + formatted(page, "formatNumber", half, 2))

    # Arms table: the 100 kept arms (by p_t), then one row for the 50 others with their sums.
    rows = page.locator("#arms-body tr")
    assert rows.count() == SUMMARY_ARMS + 1
    names = [row.get_attribute("data-arm") for row in rows.all()]
    assert set(names[:-1]) == {experiment["arms"][arm]["name"] for arm in kept} and names[-1] == "(other)"
    assert names[0] == experiment["arms"][drawn[0]]["name"]
    other = rows.last.locator("td")
    rest = [k for k in range(N_ARMS) if k not in kept]
    assert other.nth(0).inner_text().strip() == f"other ({len(rest)} arms)"
    assert other.nth(2).inner_text() == formatted(page, "formatPercent", sum(experiment["probabilities"][k] for k in rest))
    assert other.nth(3).inner_text() == formatted(page, "formatPercent", sum(experiment["deployed"][k] for k in rest))
    assert other.nth(4).inner_text() == formatted(page, "formatInteger", sum(diagnostics["units"][k] for k in rest))
    first = names.index(experiment["arms"][kept[0]]["name"])
    assert rows.nth(first).locator("td").nth(4).inner_text() == formatted(
        page, "formatInteger", diagnostics["units"][kept[0]])
    assert page.locator('#arms-head th[data-key="samples"]').inner_text() == "Units"

    # A new round: the page reads only the rounds that can still change, and still adds up.
    requested.clear()
    play(wide_server, "later", np.random.default_rng(1))
    # Tolerance: 15 s for a redraw that a 0.5 s poll makes within a second (the machine is shared).
    page.wait_for_selector(f'#experiment[data-rounds="{n_rounds + 1}"]', timeout=15_000)
    experiment, rounds, _ = full_reads(wide_server)
    since = [int(urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["since"][0])
             for url in requested if "/rounds?" in url]
    assert since and min(since) >= n_rounds - 1, since
    mixture = chart_data(page, "chart-mixture")
    for position, entry in enumerate(rounds):
        assert math.isclose(sum(dataset["y"][position] for dataset in mixture), 1.0, abs_tol=1e-9)
    health = {dataset["label"]: dataset["y"] for dataset in chart_data(page, "chart-observations")}
    assert [on_time + late for on_time, late in zip(health["on time"][:-1], health["late"][:-1])] == [
        sum(entry["counts"]) for entry in rounds[:-1]]
    assert page.locator("#fig-observations").inner_text() == formatted(
        page, "formatInteger", sum(sum(entry["counts"]) for entry in rounds))
    assert console.problems == []
    context.close()


def test_charts_name_the_arms_of_positive_weight_when_not_every_arm_gets_a_name(wide_server, browser):
    """A few arms (at most 8: 7 names and no "other" of one arm): every arm is named, a weight of 0
    included. More arms than names: only arms of positive weight are named (largest first) and the
    others are summed into "other", in full and summarised responses alike, for the deployed bars
    and the p_t bands."""
    context, page, _ = open_page(browser, "desktop")
    page.goto(f"{wide_server.base_url}/experiments/{NAME}")
    page.wait_for_selector("#experiment[data-rounds]")
    model = "(await import('/static/dashboard/model.js'))"

    def bars(deployed: list[float], summary: dict | None = None) -> list[tuple[str, float]]:
        experiment = {"deployed": deployed, "probabilities": deployed,
                      "arms": [{"name": f"a{k}"} for k in range(len(deployed))], **(summary or {})}
        drawn = page.evaluate(f"async ([e, count]) => {model}.deployedBars(e, count)", [experiment, TOP_ARMS])
        series = page.evaluate(f"async ([e, count]) => {model}.mixtureSeries(e, [e], count)", [experiment, TOP_ARMS])
        assert [entry["label"] for entry in series] == [
            label if label.startswith("a") else label.replace(")", " arms)") for label, _ in
            ((bar["label"], bar["value"]) for bar in drawn)]
        assert [entry["data"][0] for entry in series] == [bar["value"] for bar in drawn]
        return [(bar["label"], bar["value"]) for bar in drawn]

    assert bars([0.0, 1.0, 0.0]) == [("a1", 1.0), ("a0", 0.0), ("a2", 0.0)]
    eight = [0.0] * 8
    eight[5] = 1.0
    assert bars(eight) == [("a5", 1.0)] + [(f"a{k}", 0.0) for k in (0, 1, 2, 3, 4, 6, 7)]
    many = [0.0] * 20
    many[12], many[3] = 0.75, 0.25
    assert bars(many) == [("a12", 0.75), ("a3", 0.25), ("other (18)", 0.0)]
    spread = [0.05] * 20
    assert [label for label, _ in bars(spread)] == [f"a{k}" for k in range(TOP_ARMS)] + ["other (13)"]
    # A summarised response: 10 kept arms (named by position in the full list) of 150, the other 140
    # summed into rest; zero-weight kept arms are not named even though fewer than 7 arms are.
    kept = [40, 7, 99, 3, 12, 0, 1, 2, 5, 6]
    weights = [0.6, 0.3, 0.1] + [0.0] * 7
    summary = {"arm_summary": {"arms": kept, "names": [f"a{k}" for k in kept], "rest_arms": 140},
               "rest": {"arms": 140, "probabilities": 0.0, "deployed": 0.0}}
    drawn = bars(weights, summary)
    assert [label for label, _ in drawn] == ["a0", "a1", "a2", "other (147)"]
    assert math.isclose(drawn[-1][1], 0.0, abs_tol=1e-12)
    context.close()


def test_a_long_history_is_drawn_page_by_page_as_it_arrives(wide_server, browser, monkeypatch):
    """The first read of a paged history draws after each page (the rounds so far), not after the last."""
    from service.routes import rounds as rounds_route

    monkeypatch.setattr(rounds_route, "PAGE_ARM_ROUNDS", 2 * N_ARMS)  # pages of 2 rounds
    _, rounds, _ = full_reads(wide_server)
    assert len(rounds) >= 5
    context, page, console = open_page(browser, "desktop")
    # Every value the page gives data-rounds, in order (set on each draw).
    page.add_init_script("""
        window.roundsDrawn = [];
        new MutationObserver(() => {
          const value = document.getElementById("experiment")?.dataset.rounds;
          if (value !== undefined && window.roundsDrawn.at(-1) !== Number(value)) window.roundsDrawn.push(Number(value));
        }).observe(document, { attributes: true, subtree: true, attributeFilter: ["data-rounds"] });
    """)
    page.goto(f"{wide_server.base_url}/experiments/{NAME}")
    page.wait_for_selector(f'#experiment[data-rounds="{len(rounds)}"]')
    drawn = page.evaluate("window.roundsDrawn")
    assert drawn[:len(rounds) // 2 + 1] == [*range(2, len(rounds), 2), len(rounds)], drawn
    assert chart_data(page, "chart-mixture")[0]["x"] == [entry["index"] for entry in rounds]
    assert console.problems == []
    context.close()
