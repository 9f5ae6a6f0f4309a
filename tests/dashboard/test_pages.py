"""The dashboard in headless Chromium against a live server with a 32-round experiment."""

from __future__ import annotations

import math
import re
from urllib.parse import parse_qs, urlsplit

import numpy as np
import pytest

pytestmark = pytest.mark.chromium

VIEWPORTS = {"desktop": {"width": 1280, "height": 800}, "phone": {"width": 390, "height": 844}}


class ConsoleWatcher:
    """Collects console errors, uncaught exceptions and failed requests of one page."""

    def __init__(self, page) -> None:
        self.problems: list[str] = []
        page.on("console", lambda message: message.type == "error" and self.problems.append(message.text))
        page.on("pageerror", lambda error: self.problems.append(f"uncaught: {error}"))
        # A navigation aborts the poll in flight (net::ERR_ABORTED): that is not a failure.
        page.on("requestfailed", lambda request: request.failure != "net::ERR_ABORTED"
                and self.problems.append(f"request failed: {request.url} ({request.failure})"))


def open_page(browser, viewport: str):
    context = browser.new_context(viewport=VIEWPORTS[viewport])
    page = context.new_page()
    return context, page, ConsoleWatcher(page)


def chart_data(page, canvas_id: str) -> list[dict]:
    """Label and y values of each dataset of the Chart.js chart drawn on ``canvas_id``."""
    return page.evaluate(
        """(id) => Chart.getChart(id).data.datasets.map((dataset) => ({
               label: dataset.label,
               x: dataset.data.map((point) => (typeof point === "object" && point !== null ? point.x : null)),
               y: dataset.data.map((point) => (typeof point === "object" && point !== null ? point.y : point)),
           }))""",
        canvas_id,
    )


def legend_swatches(page, canvas_id: str) -> dict[str, bool | None]:
    """Per legend entry: whether its swatch is a dashed stroke (gaps along its middle row), False for a
    solid one, None when it is not a drawn line (a box)."""
    return page.evaluate(
        """(id) => Object.fromEntries(Chart.getChart(id).legend.legendItems.map((item) => {
               const swatch = item.pointStyle;
               if (!(swatch instanceof HTMLCanvasElement)) return [item.text, null];
               const row = swatch.getContext("2d").getImageData(0, swatch.height / 2, swatch.width, 1).data;
               let gaps = 0;
               for (let x = 1; x < swatch.width - 1; x += 1) if (row[4 * x + 3] === 0) gaps += 1;
               return [item.text, gaps > 0];
           }))""",
        canvas_id,
    )


def chart_labels(page, canvas_id: str) -> list[str]:
    return page.evaluate("(id) => Chart.getChart(id).data.labels", canvas_id)


def assert_fits_width(page, width: int) -> None:
    # Wide tables scroll inside their own box; the page itself must not scroll sideways.
    assert page.evaluate("document.documentElement.scrollWidth") <= width


def guardrail_verdict(diagnostics: dict) -> str:
    """The guardrail badge's words the dashboard should show for ``diagnostics`` (served traffic and
    deployed mixture, on the point estimate)."""
    served = [entry["metric"] for entry in diagnostics["guardrails_served"] if not entry["holds"]]
    deployed = [entry["metric"] for entry in diagnostics["guardrails_deployed"] if not entry["holds"]]
    violated = list(dict.fromkeys(served + deployed))
    total = len(diagnostics["guardrails_deployed"])
    if not violated:
        return f"{total} OK (served and deployed)"
    parts = [f"{metric} ({' and '.join(m for m, broken in (('served', served), ('deployed', deployed)) if metric in broken)})"
             for metric in violated]
    return f"{len(violated)} of {total} violated: {', '.join(parts)}"


def test_overview_asks_for_a_token_once_and_lists_experiments(live_server, browser, screenshot_dir):
    experiments = live_server.api("GET", "/experiments", role="read").json()["experiments"]
    for viewport in VIEWPORTS:
        context, page, console = open_page(browser, viewport)
        page.goto(live_server.base_url + "/")
        page.wait_for_selector("#token-dialog[open]")
        page.fill("#token-input", live_server.tokens["read"])
        page.click("#token-form button[type=submit]")
        page.wait_for_selector("#experiments-body tr[data-experiment]")
        rows = page.locator("#experiments-body tr[data-experiment]")
        assert rows.count() == len(experiments) == 2

        seeded = page.locator('tr[data-experiment="homepage-ranking"]')
        cells = seeded.locator("td")
        assert cells.nth(1).inner_text() == "running"
        seeded_round = next(entry for entry in experiments if entry["name"] == "homepage-ranking")["round"]["index"]
        assert cells.nth(2).inner_text() == str(seeded_round) and seeded_round >= 32
        assert cells.nth(3).inner_text().startswith("clicks ")
        diagnostics = live_server.api("GET", "/experiments/homepage-ranking/diagnostics", role="read").json()
        guardrail_text = cells.nth(4).inner_text()
        assert guardrail_text == guardrail_verdict(diagnostics)
        assert "bad" in cells.nth(4).locator(".badge").get_attribute("class").split() or "OK" in guardrail_text
        assert cells.nth(5).inner_text().startswith("ok" if diagnostics["srm"]["ok"] else "mismatch")
        assert "ago" in cells.nth(6).inner_text() or cells.nth(6).inner_text() == "just now"
        empty = page.locator('tr[data-experiment="search-boost"] td')
        assert [empty.nth(column).inner_text() for column in (1, 3, 4, 5)] == ["paused", "no data", "no data", "no data"]

        # The token is kept for the tab: a reload does not ask again.
        page.reload()
        page.wait_for_selector("#experiments-body tr[data-experiment]")
        assert not page.locator("#token-dialog").evaluate("dialog => dialog.open")

        assert_fits_width(page, VIEWPORTS[viewport]["width"])
        path = screenshot_dir / f"overview-{viewport}.png"
        page.screenshot(path=str(path), full_page=True)
        print(f"screenshot: {path}")
        assert console.problems == []
        context.close()


@pytest.fixture
def anonymous_loopback(live_server):
    live_server.app.config["PASTO_ANONYMOUS_LOOPBACK_READ"] = True
    yield
    live_server.app.config["PASTO_ANONYMOUS_LOOPBACK_READ"] = False


@pytest.mark.parametrize("viewport", list(VIEWPORTS))
def test_experiment_page_draws_every_panel_from_the_api(live_server, browser, screenshot_dir, anonymous_loopback,
                                                        viewport):
    name = live_server.experiment
    experiment = live_server.api("GET", f"/experiments/{name}", role="read").json()
    rounds = live_server.api("GET", f"/experiments/{name}/rounds", role="read").json()["rounds"]
    diagnostics = live_server.api("GET", f"/experiments/{name}/diagnostics", role="read").json()
    n_rounds = len(rounds)
    applied = sum(1 for entry in rounds if entry["objective"] is not None)
    assert n_rounds >= 33 and applied == n_rounds - 1  # 32+ closed rounds and the one being served

    context, page, console = open_page(browser, viewport)
    page.goto(f"{live_server.base_url}/experiments/{name}")
    page.wait_for_selector(f'#experiment[data-rounds="{n_rounds}"]')
    assert not page.locator("#token-dialog").evaluate("dialog => dialog.open")  # anonymous on loopback

    # (1) Mixture: one point per round in every band; the bands stack to 1 in every round.
    mixture = chart_data(page, "chart-mixture")
    assert [dataset["label"] for dataset in mixture][0] == experiment["arms"][
        max(range(len(experiment["arms"])), key=lambda arm: experiment["probabilities"][arm])]["name"]
    for dataset in mixture:
        assert dataset["x"] == [entry["index"] for entry in rounds]
    for position in range(n_rounds):
        assert math.isclose(sum(dataset["y"][position] for dataset in mixture), 1.0, abs_tol=1e-9)
    # ... and the deployed mixture beside it.
    deployed = chart_data(page, "chart-deployed")[0]["y"]
    assert math.isclose(sum(deployed), 1.0, abs_tol=1e-9)
    assert math.isclose(max(deployed), max(experiment["deployed"]), rel_tol=1e-12)

    # (2) Objective of p_t, of the deployed mixture and of the best single arm, per applied round.
    objective = {dataset["label"]: dataset["y"] for dataset in chart_data(page, "chart-objective")}
    assert objective["served p_t"] == [entry["objective"] for entry in rounds]
    assert objective["deployed mixture"] == [entry["objective_deployed"] for entry in rounds]
    assert objective["best single arm"] == [
        None if entry["best_single"] is None else entry["best_single"]["value"] for entry in rounds]
    assert sum(value is not None for value in objective["served p_t"]) == applied

    # (3) One panel per guardrail: estimate, 95% band and the threshold line.
    guardrails = experiment["objective"]["guardrails"]
    assert page.locator("#guardrail-panels .guardrail").count() == len(guardrails) == 2
    for position, spec in enumerate(guardrails):
        panel = chart_data(page, f"chart-guardrail-{position}")
        by_label = {dataset["label"]: dataset["y"] for dataset in panel}
        assert by_label["estimate"] == [None if entry["guardrails"] is None else entry["guardrails"][position]["estimate"]
                                        for entry in rounds]
        thresholds = [value for value in by_label["threshold"] if value is not None]
        assert len(thresholds) == applied
        if "relative_to" not in spec:
            assert set(thresholds) == {spec["threshold"]}
        for low, estimate, high in zip(by_label["interval low"], by_label["estimate"], by_label["95% interval"]):
            assert (low is None) == (estimate is None) or low <= estimate <= high
        heading = page.locator(f"#guardrail-panels .guardrail >> nth={position} >> h3").inner_text()
        assert heading.startswith(spec["metric"])
        assert (f"holds (deployed)" in heading) == diagnostics["guardrails_deployed"][position]["holds"]
        assert (f"holds (served)" in heading) == diagnostics["guardrails_served"][position]["holds"]
        assert ("violated (served)" in heading) == (not diagnostics["guardrails_served"][position]["holds"])

    # (4) Cumulative regret, non-decreasing, ending at the API's total.
    regret = [value for value in chart_data(page, "chart-regret")[0]["y"] if value is not None]
    assert len(regret) == applied
    assert all(later >= earlier for earlier, later in zip(regret, regret[1:]))
    assert math.isclose(regret[-1], diagnostics["regret"]["cumulative"], rel_tol=1e-9)

    # (5) Arms table: one row per arm, sortable by clicking a column.
    body_rows = page.locator("#arms-body tr")
    assert body_rows.count() == len(experiment["arms"])
    by_probability = sorted(range(len(experiment["arms"])), key=lambda arm: (-experiment["probabilities"][arm], arm))
    assert page.locator("#arms-body tr").first.get_attribute("data-arm") == experiment["arms"][by_probability[0]]["name"]
    page.click('#arms-head th[data-key="name"] button')
    names = [row.get_attribute("data-arm") for row in page.locator("#arms-body tr").all()]
    assert names == sorted(names, key=str.casefold) or names == sorted(names)
    assert page.locator('#arms-head th[data-key="name"]').get_attribute("aria-sort") == "ascending"
    page.click('#arms-head th[data-key="name"] button')
    assert page.locator("#arms-body tr").first.get_attribute("data-arm") == names[-1]
    assert "[" in body_rows.first.locator("td").nth(5).inner_text()  # mean with its interval

    # (6) Data health: observations per round (on time + late), late total, SRM p-value.
    # The round being served is its own "in progress" series, not a short data bar among the others.
    health = {dataset["label"]: dataset["y"] for dataset in chart_data(page, "chart-observations")}
    in_progress = health["current round so far (in progress)"]
    assert in_progress == [None] * (n_rounds - 1) + [sum(rounds[-1]["counts"])] and rounds[-1]["closed_at"] is None
    assert [on_time + late for on_time, late in zip(health["on time"][:-1], health["late"][:-1])] == [
        sum(entry["counts"]) for entry in rounds[:-1]]
    assert health["on time"][-1] is None and health["late"][-1] is None
    assert sum(health["late"][:-1]) == diagnostics["late_observations"] > 0
    # No empty slot before round 0: the axis starts half a round before the first bar.
    assert page.evaluate("Chart.getChart('chart-observations').scales.x.min") == -0.5

    # The Round card names the round the charts end at, in progress, and the last round updated.
    assert " ".join(page.locator("#fig-round").inner_text().split()) == (
        f"{experiment['round']['index']} in progress · updated through {experiment['applied_rounds'] - 1}")
    assert experiment["round"]["index"] == rounds[-1]["index"]

    # Legend swatches are drawn like their lines: dashed where the line is dashed.
    swatches = legend_swatches(page, "chart-objective")
    # The markers of served values off the axis are in the legend only when there are some.
    swatches.pop("served p_t off the axis", None)
    assert swatches == {"served p_t": False, "deployed mixture": False, "best single arm": True, "best mixture": True}
    assert legend_swatches(page, "chart-guardrail-0") == {"95% interval": None, "estimate": False, "threshold": True}
    assert page.locator("#fig-late").inner_text() == str(diagnostics["late_observations"])
    assert page.locator("#fig-srm-p").inner_text() != "–"

    assert_fits_width(page, VIEWPORTS[viewport]["width"])
    path = screenshot_dir / f"experiment-{viewport}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    assert console.problems == []
    context.close()


def test_experiment_page_refreshes_without_reloading(live_server, browser, anonymous_loopback, play_round):
    name = live_server.experiment
    context, page, console = open_page(browser, "desktop")
    page.goto(f"{live_server.base_url}/experiments/{name}")
    before = len(live_server.api("GET", f"/experiments/{name}/rounds", role="read").json()["rounds"])
    page.wait_for_selector(f'#experiment[data-rounds="{before}"]')
    page.evaluate("window.__sameDocument = true")
    play_round(name)
    # Tolerance: a poll every 0.5 s (PASTO_DASHBOARD_POLL_SECONDS) redraws within a second; 15 s allows a
    # loaded machine 30 polls.
    page.wait_for_selector(f'#experiment[data-rounds="{before + 1}"]', timeout=15_000)
    assert page.evaluate("window.__sameDocument === true")
    assert len(chart_data(page, "chart-mixture")[0]["y"]) == before + 1
    assert " ".join(page.locator("#fig-round").inner_text().split()).startswith(f"{before} in progress")
    assert console.problems == []
    context.close()


def test_the_round_card_and_the_charts_agree_when_a_round_closes_during_a_poll(
        live_server, browser, anonymous_loopback, play_round):
    """A poll reads the experiment, then the history. A round that closes between the two reads is
    forced here (the experiment's response is taken, the round is played and closed, then the
    response is delivered): in every render the charts must hold exactly the rounds up to the Round
    card's (a paired suite run once charted a round the card did not show yet)."""
    name = live_server.experiment
    context, page, console = open_page(browser, "desktop")
    page.goto(f"{live_server.base_url}/experiments/{name}")
    before = len(live_server.api("GET", f"/experiments/{name}/rounds", role="read").json()["rounds"])
    page.wait_for_selector(f'#experiment[data-rounds="{before}"]')
    page.evaluate("""() => {
        window.__renders = [];
        const node = document.getElementById("experiment");
        new MutationObserver(() => window.__renders.push(
            [Number(node.dataset.rounds), document.getElementById("fig-round").innerText]))
          .observe(node, { attributes: true, attributeFilter: ["data-rounds"] });
    }""")
    raced = []

    def close_a_round_while_the_experiment_is_in_flight(route):
        if raced:
            route.continue_()
            return
        response = route.fetch()
        play_round(name)
        raced.append(True)
        route.fulfill(response=response)

    page.route(re.compile(rf"/experiments/{re.escape(name)}\?arms="), close_a_round_while_the_experiment_is_in_flight)
    # Tolerance: polls every 0.5 s; 15 s allows a loaded machine 30 of them.
    page.wait_for_selector(f'#experiment[data-rounds="{before + 1}"]', timeout=15_000)
    page.unroute_all()
    assert raced, "the race was not forced"
    renders = page.evaluate("window.__renders")
    assert renders, "no render was recorded"
    for rounds, card in renders:
        assert rounds == int(card.split()[0]) + 1, (rounds, card)
    assert console.problems == []
    context.close()


def test_an_experiment_without_data_renders_without_errors(live_server, browser, anonymous_loopback):
    context, page, console = open_page(browser, "phone")
    page.goto(f"{live_server.base_url}/experiments/search-boost")
    page.wait_for_selector('#experiment[data-rounds="1"]')
    assert page.locator("#status-badge").inner_text() == "paused"
    assert len(chart_data(page, "chart-mixture")[0]["y"]) == 1
    assert page.locator("#arms-body tr").count() == 2
    for figure in ("#fig-srm", "#fig-guardrails"):
        assert page.locator(figure).inner_text() == "no data"
    assert " ".join(page.locator("#fig-primary").inner_text().split()) == "– no observations yet"
    assert "no data" in page.locator("#guardrail-panels h3").inner_text()
    assert page.locator("#error-banner").is_hidden()
    assert console.problems == []
    context.close()


def test_a_rejected_token_is_asked_for_again(live_server, browser):
    context, page, console = open_page(browser, "desktop")
    page.goto(live_server.base_url + "/")
    page.wait_for_selector("#token-dialog[open]")
    page.fill("#token-input", "not-a-token")
    page.click("#token-form button[type=submit]")
    page.wait_for_selector("#token-dialog[open]")
    assert "did not accept" in page.locator("#token-reason").inner_text()
    page.fill("#token-input", live_server.tokens["read"])
    page.click("#token-form button[type=submit]")
    page.wait_for_selector("#experiments-body tr[data-experiment]")
    # The browser logs the one rejected request, and nothing else.
    assert len(console.problems) == 1 and "401" in console.problems[0]
    context.close()


def test_the_time_range_draws_the_last_rounds_and_keeps_totals(live_server, browser, anonymous_loopback):
    name = live_server.experiment
    rounds = live_server.api("GET", f"/experiments/{name}/rounds", role="read").json()["rounds"]
    diagnostics = live_server.api("GET", f"/experiments/{name}/diagnostics", role="read").json()
    context, page, console = open_page(browser, "desktop")
    page.goto(f"{live_server.base_url}/experiments/{name}")
    page.wait_for_selector(f'#experiment[data-rounds="{len(rounds)}"]')
    assert page.locator("#round-range").input_value() == "1000"  # the default: every round of this one
    assert chart_data(page, "chart-mixture")[0]["x"] == [entry["index"] for entry in rounds]
    # A range shorter than the history (added here: the page's shortest is 50, this experiment has ~33).
    page.evaluate("document.getElementById('round-range').add(new Option('the last 10 rounds', '10'))")
    page.select_option("#round-range", "10")
    last = [entry["index"] for entry in rounds[-10:]]
    for chart in ("chart-mixture", "chart-objective", "chart-regret", "chart-observations", "chart-guardrail-0"):
        for dataset in chart_data(page, chart):
            if dataset["label"] == "served p_t off the axis":  # only the rounds whose served value is off it
                assert set(dataset["x"]) <= set(last), (chart, dataset["label"])
            else:
                assert dataset["x"] == last, (chart, dataset["label"])
    # Cumulative regret still sums from round 0, and the observation total counts every round.
    regret = [value for value in chart_data(page, "chart-regret")[0]["y"] if value is not None]
    assert math.isclose(regret[-1], diagnostics["regret"]["cumulative"], rel_tol=1e-9)
    assert page.locator("#fig-observations").inner_text().replace(",", "") == str(
        sum(sum(entry["counts"]) for entry in rounds))
    assert page.locator("#round-range-note").inner_text() == f"(rounds {last[0]}–{last[-1]} of {len(rounds)})"
    page.select_option("#round-range", "all")
    assert chart_data(page, "chart-mixture")[0]["x"] == [entry["index"] for entry in rounds]
    assert console.problems == []
    context.close()


@pytest.mark.parametrize("kind", [{"penalty": 5.0}, {"hard": True}], ids=["soft", "hard"])
def test_a_guardrail_no_mixture_can_keep_is_red_on_the_overview_and_the_experiment_page(
        live_server, browser, anonymous_loopback, kind):
    """Both arms have y well below the threshold 0: whatever is served breaks the guardrail (a hard
    one has no mixture to keep it, and no baseline to fall back on), and the overview and the
    experiment page say so in red, naming the served traffic."""
    name = f"no-feasible-mixture-{'hard' if kind.get('hard') else 'soft'}"
    live_server.api("POST", "/experiments", json={
        "name": name,
        "arms": [{"name": "left", "params": {}}, {"name": "right", "params": {}}],
        "metrics": ["x", "y"],
        "objective": {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, **kind}]},
        "round_seconds": 3600,
        "seed": 5,
    })
    rng = np.random.default_rng(3)
    means = {"left": (1.0, -1.0), "right": (0.5, -0.8)}
    for round_position in range(4):
        assignments = live_server.api("POST", f"/experiments/{name}/assign", role="ingest", json={
            "units": [f"nf{round_position}-{i}" for i in range(100)]}).json()["assignments"]
        live_server.api("POST", f"/experiments/{name}/observations", role="ingest", json={"observations": [
            {"id": item["unit"], "unit": item["unit"], "round": item["round"],
             "values": dict(zip(["x", "y"], (np.array(means[item["arm"]]) + 0.1 * rng.standard_normal(2)).tolist()))}
            for item in assignments]})
        live_server.api("POST", f"/experiments/{name}/rounds")
    diagnostics = live_server.api("GET", f"/experiments/{name}/diagnostics", role="read").json()
    assert not diagnostics["guardrails_served"][0]["holds"] and not diagnostics["guardrails_deployed"][0]["holds"]
    expected = "1 of 1 violated: y (served and deployed)"
    assert guardrail_verdict(diagnostics) == expected

    context, page, console = open_page(browser, "desktop")
    page.goto(live_server.base_url + "/")
    cell = page.locator(f'tr[data-experiment="{name}"] td >> nth=4')
    cell.locator(".badge").wait_for()
    assert cell.inner_text() == expected
    assert "bad" in cell.locator(".badge").get_attribute("class").split()

    page.goto(f"{live_server.base_url}/experiments/{name}")
    page.wait_for_selector('#experiment[data-rounds="5"]')
    assert page.locator("#fig-guardrails").inner_text() == expected
    assert "bad" in page.locator("#fig-guardrails .badge").get_attribute("class").split()
    heading = page.locator("#guardrail-panels .guardrail >> nth=0 >> h3")
    assert "violated (served)" in heading.inner_text() and "violated (deployed)" in heading.inner_text()
    served_badge = heading.locator(".badge", has_text="served")
    assert "bad" in served_badge.get_attribute("class").split()


def test_the_experiment_page_reads_a_paged_history(live_server, browser, anonymous_loopback, monkeypatch):
    """The rounds endpoint pages by default (next_since): the page follows the cursor to the end."""
    from service.routes import rounds as rounds_route

    name = live_server.experiment
    rounds = live_server.api("GET", f"/experiments/{name}/rounds?limit=1000", role="read").json()["rounds"]
    n_arms = len(rounds[0]["probabilities"])
    monkeypatch.setattr(rounds_route, "PAGE_ARM_ROUNDS", 4 * n_arms)  # pages of 4 rounds
    first = live_server.api("GET", f"/experiments/{name}/rounds", role="read").json()
    assert len(first["rounds"]) == 4 < len(rounds) and first["next_since"] == 4
    context, page, console = open_page(browser, "desktop")
    page.goto(f"{live_server.base_url}/experiments/{name}")
    page.wait_for_selector(f'#experiment[data-rounds="{len(rounds)}"]')
    assert chart_data(page, "chart-mixture")[0]["x"] == [entry["index"] for entry in rounds]
    assert console.problems == []
    context.close()


def test_a_refresh_reads_only_the_rounds_that_can_still_change(live_server, browser, anonymous_loopback, play_round):
    name = live_server.experiment
    context, page, console = open_page(browser, "desktop")
    asked: list[int] = []
    page.on("request", lambda request: asked.append(int(parse_qs(urlsplit(request.url).query)["since"][0]))
            if f"/experiments/{name}/rounds?since=" in request.url else None)
    page.goto(f"{live_server.base_url}/experiments/{name}")
    before = live_server.api("GET", f"/experiments/{name}/rounds?limit=1000", role="read").json()["rounds"]
    page.wait_for_selector(f'#experiment[data-rounds="{len(before)}"]')
    assert asked[0] == 0
    first_not_final = next(entry["index"] for entry in before
                           if entry["applied_at"] is None or entry["best_mixture"] is None)
    play_round(name)
    # Tolerance: as above, 15 s for a redraw that a 0.5 s poll makes within a second.
    page.wait_for_selector(f'#experiment[data-rounds="{len(before) + 1}"]', timeout=15_000)
    after = live_server.api("GET", f"/experiments/{name}/rounds?limit=1000", role="read").json()["rounds"]
    assert asked[1:] and all(since >= first_not_final > 0 for since in asked[1:]), asked
    # What the page drew is the whole history as the server has it now.
    assert chart_data(page, "chart-mixture")[0]["x"] == [entry["index"] for entry in after]
    assert console.problems == []
    context.close()


def test_the_segments_table_reads_the_diagnostics(live_server, browser, anonymous_loopback):
    """A segmented experiment's page has a per-segment table whose shares, objectives and guardrail
    badges are the diagnostics' segments, and the platform figures below it; an unsegmented
    experiment's page hides the panel."""
    name = "by-segment"
    segments = ["new", "returning", "mobile"]
    live_server.api("POST", "/experiments", json={
        "name": name,
        "arms": [{"name": "a", "params": {}}, {"name": "b", "params": {}}, {"name": "c", "params": {}}],
        "metrics": ["x", "y"],
        "objective": {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "hard": True}]},
        "segments": {"names": segments, "shares": [0.5, 0.3, 0.2]},
        "round_seconds": 3600,
        "seed": 9,
    })
    rng = np.random.default_rng(4)
    means = {"new": {"a": (2, -0.5), "b": (0, 1), "c": (1, 0)}, "returning": {"a": (0, 1), "b": (2, -0.5), "c": (1, 0)},
             "mobile": {"a": (1, 1), "b": (1, 1), "c": (1, 1)}}
    for round_position in range(3):
        units = [f"sg{round_position}-{i}" for i in range(300)]
        unit_segments = [segments[i % 3] for i in range(300)]
        assignments = live_server.api("POST", f"/experiments/{name}/assign", role="ingest", json={
            "units": units, "segments": unit_segments}).json()["assignments"]
        live_server.api("POST", f"/experiments/{name}/observations", role="ingest", json={"observations": [
            {"id": item["unit"], "unit": item["unit"], "round": item["round"], "segment": item["segment"],
             "values": dict(zip(["x", "y"], (np.array(means[item["segment"]][item["arm"]])
                                             + 0.2 * rng.standard_normal(2)).tolist()))}
            for item in assignments]})
        live_server.api("POST", f"/experiments/{name}/rounds")
    report = live_server.api("GET", f"/experiments/{name}/diagnostics", role="read").json()["segments"]

    context, page, console = open_page(browser, "desktop")
    page.goto(f"{live_server.base_url}/experiments/{name}")
    page.wait_for_selector('#experiment[data-rounds="4"]')
    assert page.locator("#panel-segments").is_visible()
    rows = page.locator("#segments-body tr")
    assert rows.count() == 3
    for position, segment in enumerate(report["segments"]):
        row = page.locator(f'#segments-body tr[data-segment="{segment["name"]}"]')
        assert row.locator("th").inner_text() == segment["name"]
        assert float(row.locator("td[data-share]").get_attribute("data-share")) == pytest.approx(segment["share"])
        assert float(row.locator("td[data-objective]").get_attribute("data-objective")) == \
            pytest.approx(segment["objective"])
        badges = row.locator(".badge")
        assert badges.count() == len(segment["guardrails"])
        for index, guardrail in enumerate(segment["guardrails"]):
            kind = "ok" if guardrail["holds"] else "bad"
            assert kind in badges.nth(index).get_attribute("class").split()
        top_arm = max(range(3), key=lambda k: segment["deployed"][k])
        assert row.locator("td.params").inner_text().startswith("abc"[top_arm] + " ")
    # The gain and its interval, as the page formats numbers (formatNumber in pasto.js).
    shown = page.locator("#fig-segments-gain").text_content()
    format_number = page.evaluate_handle('import("/static/dashboard/pasto.js")')
    expected = page.evaluate("([module, values]) => values.map((v) => module.formatNumber(v))",
                             [format_number, [report["gain"]["value"], *report["gain"]["interval"]]])
    assert shown == f"{expected[0]}[{expected[1]}, {expected[2]}]"
    platform = page.locator("#fig-segments-platform .badge")
    assert platform.count() == 1 and platform.inner_text().startswith("y (global)")
    assert console.problems == []

    page.goto(f"{live_server.base_url}/experiments/{live_server.experiment}")
    page.wait_for_selector("#experiment[data-rounds]")
    assert not page.locator("#panel-segments").is_visible()


def objective_axis(page) -> dict:
    """The objective chart's y-range and, per line, the pixel row of each value."""
    return page.evaluate(
        """() => {
               const chart = Chart.getChart("chart-objective");
               const y = chart.scales.y;
               return {min: y.min, max: y.max, pixel: (value) => y.getPixelForValue(value),
                       pixels: Object.fromEntries(chart.data.datasets.map((dataset) => [dataset.label,
                           dataset.data.map((point) => (point.y === null ? null : y.getPixelForValue(point.y)))])),
                       off: chart.data.datasets[4].data.map((point) => [point.x, point.y])};
           }""")


def test_objective_chart_scales_to_the_lines_it_compares_and_regret_says_which_mixture(
        live_server, browser, anonymous_loopback):
    """Constant 50% exploration over an arm with x = -40 drags the served objective far below the
    deployed mixture, the best mixture and the best single arm. The axis is scaled to those three
    (each distinguishable), the served line is clipped and each clipped round is marked on the axis's
    lower edge; the regret panel names the served traffic and the best mixture; with no baseline
    arm the lift cards say so."""
    name = "exploring"
    live_server.api("POST", "/experiments", json={
        "name": name,
        "arms": [{"name": "watch", "params": {}}, {"name": "likes", "params": {}}, {"name": "bad", "params": {}}],
        "metrics": ["x", "y"],
        "objective": {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "penalty": 5.0}]},
        "algorithm": {"preset": "default", "serving": "exploration", "exploration": "constant",
                      "exploration_scale": 0.5},
        "round_seconds": 3600,
        "seed": 8,
    })
    rng = np.random.default_rng(4)
    means = {"watch": (2.0, -2.0), "likes": (0.0, 2.0), "bad": (-40.0, 0.0)}
    for round_position in range(6):
        assignments = live_server.api("POST", f"/experiments/{name}/assign", role="ingest", json={
            "units": [f"ex{round_position}-{i}" for i in range(150)]}).json()["assignments"]
        live_server.api("POST", f"/experiments/{name}/observations", role="ingest", json={"observations": [
            {"id": item["unit"], "unit": item["unit"], "round": item["round"],
             "values": dict(zip(["x", "y"], (np.array(means[item["arm"]]) + 0.1 * rng.standard_normal(2)).tolist()))}
            for item in assignments]})
        live_server.api("POST", f"/experiments/{name}/rounds")
    rounds = live_server.api("GET", f"/experiments/{name}/rounds", role="read").json()["rounds"]
    applied = [entry for entry in rounds if entry["objective"] is not None]
    compared = [value for entry in applied
                for value in (entry["objective_deployed"], entry["best_mixture"], entry["best_single"]["value"])]
    low, high = min(compared), max(compared)
    assert max(entry["objective"] for entry in applied) < low - (high - low) / 10  # the dip is real

    context, page, console = open_page(browser, "desktop")
    page.goto(f"{live_server.base_url}/experiments/{name}")
    page.wait_for_selector(f'#experiment[data-rounds="{len(rounds)}"]')
    axis = objective_axis(page)
    # The range is the three lines' own, padded by a tenth of their spread: not the served line's.
    pad = (high - low) / 10
    assert axis["min"] == pytest.approx(low - pad) and axis["max"] == pytest.approx(high + pad)
    # Every served value is below it: each is marked on the lower edge, none silently lost.
    assert axis["off"] == [[entry["index"], axis["min"]] for entry in applied]
    # Deployed, best mixture and best single arm are told apart on screen: the gain of mixing of the
    # last round spans at least a fifth of the plot's height.
    pixels = axis["pixels"]
    height = page.evaluate("Chart.getChart('chart-objective').chartArea.height")
    last = len(rounds) - 2
    gap = abs(pixels["best mixture"][last] - pixels["best single arm"][last])
    assert rounds[last]["best_mixture"] - rounds[last]["best_single"]["value"] > 0.1
    assert gap >= height / 5, (gap, height)
    clipped_note = page.locator("#objective-clipped").inner_text()
    assert f"leaves it in {len(applied)} of these rounds" in clipped_note

    # The regret panel says whose regret it is, against what.
    assert page.locator("#panel-regret h2").inner_text() == "Cumulative regret of the served traffic"
    explained = page.locator("#regret-explained").inner_text()
    assert "best mixture p*" in explained and "served in each round" in explained
    assert "not the deployed mixture" in explained
    assert chart_data(page, "chart-regret")[0]["label"] == "cumulative regret of served p_t against the best mixture"

    # No baseline arm: the lift cards say so.
    assert page.locator("#fig-lift-served").inner_text() == "no baseline"
    assert page.locator("#fig-lift-deployed").inner_text() == "no baseline"
    assert console.problems == []
    context.close()


def test_lift_cards_show_the_apis_lift_over_the_baseline(live_server, browser, anonymous_loopback):
    """The main experiment's diversity guardrail is relative to arm "control": the lifts are over it."""
    name = live_server.experiment
    diagnostics = live_server.api("GET", f"/experiments/{name}/diagnostics", role="read").json()
    rounds = live_server.api("GET", f"/experiments/{name}/rounds", role="read").json()["rounds"]
    lift = diagnostics["lift"]
    assert lift["baseline"] == "control"
    context, page, console = open_page(browser, "desktop")
    page.goto(f"{live_server.base_url}/experiments/{name}")
    page.wait_for_selector(f'#experiment[data-rounds="{len(rounds)}"]')
    for mixture in ("served", "deployed"):
        assert page.locator(f"#fig-lift-{mixture}-label").inner_text() == f"Lift over control, {mixture}"
        primary = lift[mixture]["primary"]
        low, high = primary["interval"]
        card = page.locator(f"#fig-lift-{mixture}")
        text = card.inner_text()
        assert text.startswith("+" if primary["estimate"] > 0 else "−" if primary["estimate"] < 0 else "0")
        assert "[" in text and "]" in text
        expected = "above" if low > 0 else "below" if high < 0 else "unclear"
        assert card.get_attribute("data-verdict") == expected
        # The card's figures are the API's: the estimate and both ends, to the 3 digits shown.
        shown = [float(number.replace("−", "-")) for number in
                 text.replace("[", " ").replace("]", " ").replace(",", " ").replace("+", " ").split()[:3]]
        assert shown == pytest.approx([primary["estimate"], low, high], rel=5e-3, abs=5e-3)


MARKER_RGB = (0x6A, 0x3D, 0x9A)  # MARKER_COLOUR of experiment.js


def test_pauses_and_resumes_are_marked_at_their_rounds(live_server, browser, anonymous_loopback, play_round,
                                                       screenshot_dir):
    """Pausing and resuming in round 2 and again in round 4 draws a labelled vertical marker at rounds 2
    and 4 of every round-axis chart; hovering one says what happened; the note under the range lists them."""
    from tests.dashboard.conftest import ARMS, METRICS

    name = "paused-twice"
    live_server.api("POST", "/experiments", json={
        "name": name, "arms": ARMS, "metrics": METRICS,
        "objective": {"primary": "clicks", "guardrails": [{"metric": "dwell", "threshold": 0.5, "penalty": 5.0}]},
        "round_seconds": 3600, "seed": 5,
    })
    for pause_round in (2, 4):
        while live_server.api("GET", f"/experiments/{name}", role="read").json()["round"]["index"] < pause_round:
            play_round(name)
        live_server.api("POST", f"/experiments/{name}/pause")
        live_server.api("POST", f"/experiments/{name}/resume")
    play_round(name)  # round 5 is served: the markers sit inside the axis, not on its end
    recorded = live_server.api("GET", f"/experiments/{name}/events", role="read").json()["events"]
    assert [(event["kind"], event["round"]) for event in recorded] == [
        ("created", 0), ("paused", 2), ("resumed", 2), ("paused", 4), ("resumed", 4)]

    context, page, console = open_page(browser, "desktop")
    page.goto(f"{live_server.base_url}/experiments/{name}")
    page.wait_for_selector('#experiment[data-rounds="6"]')
    for chart in ("chart-mixture", "chart-objective", "chart-regret", "chart-observations", "chart-guardrail-0"):
        markers = page.evaluate("(id) => Chart.getChart(id).options.plugins.eventMarkers.markers", chart)
        assert [(marker["round"], marker["label"]) for marker in markers] == [
            (2, "paused, resumed"), (4, "paused, resumed")], chart
        # The line is drawn: the canvas column at round 2 holds the marker's colour.
        column = page.evaluate("""(id) => {
            const chart = Chart.getChart(id);
            const ratio = chart.currentDevicePixelRatio;
            const x = Math.round(chart.scales.x.getPixelForValue(2) * ratio);
            const top = Math.round(chart.chartArea.top * ratio), bottom = Math.round(chart.chartArea.bottom * ratio);
            const data = chart.ctx.getImageData(x - 1, top, 3, bottom - top).data;
            const pixels = [];
            for (let i = 0; i < data.length; i += 4) pixels.push([data[i], data[i + 1], data[i + 2], data[i + 3]]);
            return pixels;
        }""", chart)
        marked = [pixel for pixel in column if pixel[3] > 200
                  and all(abs(value - target) <= 40 for value, target in zip(pixel, MARKER_RGB))]
        assert len(marked) > 10, chart
    # Hovering the marker names what happened and when.
    page.locator("#chart-objective").scroll_into_view_if_needed()
    box = page.locator("#chart-objective").bounding_box()
    x = page.evaluate("Chart.getChart('chart-objective').scales.x.getPixelForValue(4)")
    y = page.evaluate("(Chart.getChart('chart-objective').chartArea.top + Chart.getChart('chart-objective').chartArea.bottom) / 2")
    page.mouse.move(box["x"] + x, box["y"] + y)
    page.wait_for_function("document.getElementById('chart-objective').title !== ''")
    title = page.locator("#chart-objective").get_attribute("title")
    assert title.startswith("Round 4: paused at ") and "; resumed at " in title and title.endswith(" UTC"), title
    footer = page.evaluate("Chart.getChart('chart-objective').tooltip.footer")
    assert footer == [title], footer  # the chart's own tooltip for round 4 ends with the same words
    assert page.locator("#event-note").inner_text() == (
        "Marked on the charts: round 2 paused, resumed; round 4 paused, resumed.")
    page.screenshot(path=str(screenshot_dir / "experiment-events.png"), full_page=True)
    assert console.problems == []
    context.close()
