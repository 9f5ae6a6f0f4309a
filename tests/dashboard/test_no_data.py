"""A fresh experiment: every figure that needs data is null in the API and "–" with a reason on the page
until a round with observations has been updated, and numbers after it."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.dashboard.conftest import ARMS, METRICS, _play_round, served_app

pytestmark = pytest.mark.chromium

NAME = "fresh-ranking"
ESTIMATE_FIGURES = ("#fig-primary", "#fig-objective", "#fig-deployed", "#fig-best-single", "#fig-gain",
                    "#fig-lift-served", "#fig-lift-deployed")
DIGIT = re.compile(r"\d")


def _create(server) -> None:
    server.api("POST", "/experiments", json={
        "name": NAME, "arms": ARMS, "metrics": METRICS,
        "objective": {"primary": "clicks", "guardrails": [
            {"metric": "dwell", "threshold": 0.5, "penalty": 5.0},
            {"metric": "diversity", "threshold": -0.05, "penalty": 5.0, "relative_to": "control"},
        ]},
        "round_seconds": 3600, "seed": 5,
    })


def _figures(page) -> dict[str, str]:
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll(
        '#summary-figures dd, #health-figures dd')].map((dd) => [dd.id, dd.innerText.trim()]))""")


def _mean_cells(page) -> list[str]:
    # The arms table: name, parameters, p_t, deployed, units, then one column per metric.
    return page.evaluate("""() => [...document.querySelectorAll('#arms-body tr')].flatMap((row) =>
        [...row.querySelectorAll('td')].slice(5).map((cell) => cell.innerText.trim()))""")


def test_a_fresh_experiment_shows_no_figure_until_a_round_has_data(tmp_path, browser):
    with served_app(tmp_path, "no-data", NAME, PASTO_ANONYMOUS_LOOPBACK_READ=True) as server:
        _create(server)
        diagnostics = server.api("GET", f"/experiments/{NAME}/diagnostics", role="read").json()
        assert diagnostics["objective"] == {"probabilities": None, "deployed": None}
        assert diagnostics["best_single"] is None
        assert diagnostics["mixing_gain"] is None and diagnostics["best_mixture"]["value"] is None
        for values in [*diagnostics["estimate"]["means"].values(), *diagnostics["estimate"]["standard_errors"].values()]:
            assert values == [None] * len(ARMS)
        for guardrail in diagnostics["guardrails_served"] + diagnostics["guardrails_deployed"]:
            assert guardrail["estimate"] is None and guardrail["holds"] is None
        assert diagnostics["srm"] == {"statistic": None, "p_value": None, "ok": True}
        assert diagnostics["lift"]["served"]["primary"]["estimate"] is None

        context = browser.new_context(viewport={"width": 1280, "height": 800})
        page = context.new_page()
        problems: list[str] = []
        page.on("pageerror", lambda error: problems.append(str(error)))
        page.goto(f"{server.base_url}/experiments/{NAME}")
        page.wait_for_selector('#experiment[data-rounds="1"]')
        figures = _figures(page)
        # Round 0 is an index, not an estimate; every other figure is a dash or words, never a "0".
        assert {key: text for key, text in figures.items() if key != "fig-round" and DIGIT.search(text)} == {}
        for figure in ESTIMATE_FIGURES:
            assert " ".join(page.locator(figure).inner_text().split()) == "– no observations yet", figure
        assert set(_mean_cells(page)) == {"–"}
        for note in ("#mixture-empty", "#objective-empty", "#regret-empty"):
            assert page.locator(note).is_visible(), note

        _play_round(server, NAME, 0, np.random.default_rng(7))
        diagnostics = server.api("GET", f"/experiments/{NAME}/diagnostics", role="read").json()
        assert isinstance(diagnostics["objective"]["deployed"], float)
        assert diagnostics["best_single"]["arm"] in {arm["name"] for arm in ARMS}
        assert all(value is not None for values in diagnostics["estimate"]["means"].values() for value in values)
        assert diagnostics["srm"]["p_value"] is not None
        page.wait_for_selector('#experiment[data-rounds="2"]')
        for figure in ("#fig-objective", "#fig-deployed", "#fig-gain"):
            # The figure's first line; a second one may note that an exploring round's served figure
            # is below the deployed mixture's.
            float(page.locator(figure).inner_text().splitlines()[0].replace("−", "-").replace(",", ""))
        assert DIGIT.search(page.locator("#fig-best-single").inner_text())
        assert DIGIT.search(page.locator("#fig-observations").inner_text())
        assert all(DIGIT.search(cell) for cell in _mean_cells(page))
        for note in ("#mixture-empty", "#objective-empty", "#regret-empty"):
            assert page.locator(note).is_hidden(), note
        assert problems == []
        context.close()
