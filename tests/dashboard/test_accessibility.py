"""Accessibility and legibility of the dashboard: axe-core (injected into the pages) finds no serious or
critical violation on the overview and the experiment page; every chart axis has a title; an arm keeps
its colour across refreshes and charts (its position in the experiment's definition); a served figure
below the deployed one says why."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.dashboard.conftest import ARMS

pytestmark = pytest.mark.chromium

AXE = Path(__file__).resolve().parent / "node_modules" / "axe-core" / "axe.min.js"
#: service/static/dashboard/pasto.js's PALETTE: the first arms' colours, in definition order.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#882255"]


@pytest.fixture
def axe_source() -> str:
    if not AXE.exists():
        message = f"axe-core is not installed at {AXE} (npm ci --prefix tests/dashboard)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; .ci/run installs it.")
        pytest.skip(message)
    return AXE.read_text()


@pytest.fixture
def page(live_server, browser):
    live_server.app.config["PASTO_ANONYMOUS_LOOPBACK_READ"] = True
    # The pages' CSP (script-src 'self') would refuse the injected axe-core; only the test bypasses it.
    context = browser.new_context(viewport={"width": 1280, "height": 800}, bypass_csp=True)
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(str(error)))
    yield page
    context.close()
    live_server.app.config["PASTO_ANONYMOUS_LOOPBACK_READ"] = False
    assert problems == []


def serious_violations(page, axe_source: str) -> list[str]:
    page.add_script_tag(content=axe_source)
    results = page.evaluate("async () => await axe.run(document)")
    return [f"{violation['id']} ({violation['impact']}): {violation['help']}; "
            + "; ".join(node["target"][0] if isinstance(node["target"][0], str) else str(node["target"])
                        for node in violation["nodes"][:5])
            for violation in results["violations"] if violation["impact"] in ("serious", "critical")]


def open_experiment(page, live_server) -> None:
    page.goto(f"{live_server.base_url}/experiments/{live_server.experiment}")
    page.wait_for_selector("#experiment[data-rounds]:not([data-rounds='0'])")
    page.wait_for_function("() => Chart.getChart('chart-mixture') !== undefined")


def test_axe_finds_no_serious_violation_on_the_overview(live_server, page, axe_source):
    page.goto(live_server.base_url + "/")
    page.wait_for_selector("#experiments-body tr[data-experiment]")
    assert serious_violations(page, axe_source) == []


def test_axe_finds_no_serious_violation_on_the_experiment_page(live_server, page, axe_source):
    open_experiment(page, live_server)
    assert serious_violations(page, axe_source) == []


def test_every_chart_axis_has_a_title(live_server, page):
    open_experiment(page, live_server)
    untitled = page.evaluate("""() => [...document.querySelectorAll('canvas')].flatMap((canvas) => {
        const chart = Chart.getChart(canvas);
        if (!chart) return [];
        return Object.entries(chart.options.scales).filter(([, scale]) => scale.display !== false
            && !(scale.title && scale.title.display && String(scale.title.text).trim())).map(([axis]) => `${canvas.id}.${axis}`);
    })""")
    assert untitled == []
    charts = page.evaluate("() => [...document.querySelectorAll('canvas')].filter((c) => Chart.getChart(c)).length")
    assert charts >= 6  # mixture, deployed, objective, regret, observations and one per guardrail


def arm_colours(page) -> dict[str, str]:
    """Each arm's colour in the mixture chart, the deployed bars and the arms table (they must agree)."""
    return page.evaluate("""() => {
        const toHex = (colour) => {
            const probe = document.createElement('span');
            probe.style.color = colour; document.body.append(probe);
            const [r, g, b] = getComputedStyle(probe).color.match(/\\d+/g).map(Number); probe.remove();
            return '#' + [r, g, b].map((v) => v.toString(16).padStart(2, '0')).join('').toUpperCase();
        };
        const colours = {};
        const add = (arm, colour, where) => { (colours[arm] ??= {})[where] = toHex(colour); };
        for (const dataset of Chart.getChart('chart-mixture').data.datasets) add(dataset.label, dataset.borderColor, 'mixture');
        const deployed = Chart.getChart('chart-deployed');
        deployed.data.labels.forEach((label, i) => add(label, deployed.data.datasets[0].borderColor[i], 'deployed'));
        for (const row of document.querySelectorAll('#arms-body tr[data-arm]')) {
            add(row.dataset.arm, row.querySelector('.swatch').style.background, 'table');
        }
        return colours;
    }""")


def test_an_arm_keeps_its_colour_across_refreshes_and_charts(live_server, page, play_round):
    open_experiment(page, live_server)
    first = arm_colours(page)
    names = [arm["name"] for arm in ARMS]
    for arm, seen in first.items():
        if arm in names:
            assert set(seen.values()) == {PALETTE[names.index(arm)]}, (arm, seen)
    rounds = page.get_attribute("#experiment", "data-rounds")
    play_round(live_server.experiment)  # the ranks of the arms may change; their colours must not
    page.wait_for_selector(f"#experiment:not([data-rounds='{rounds}'])")
    page.reload()
    open_experiment(page, live_server)
    second = arm_colours(page)
    for arm in set(first) & set(second) & set(names):
        assert len(set(second[arm].values())) == 1 and set(second[arm].values()) == set(first[arm].values()), arm


def test_a_served_objective_below_the_deployed_one_says_why(live_server, page):
    open_experiment(page, live_server)
    diagnostics = live_server.api("GET", f"/experiments/{live_server.experiment}/diagnostics", role="read").json()
    served, deployed = diagnostics["objective"]["probabilities"], diagnostics["objective"]["deployed"]
    note = page.locator("#fig-objective .exploration-note")
    if served < deployed:
        assert note.count() == 1 and "explores" in note.inner_text()
    else:
        assert note.count() == 0
