"""The URL `pasto demo` (`make run`) prints opens the dashboard signed in: a real demo, headless Chromium."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.pgcluster import free_port
from tests.signals import as_in_a_terminal

pytestmark = pytest.mark.chromium

ROUNDS_SHOWN = 3  # closed rounds the experiment page must draw before the test looks at it


def start_demo(instance: Path, port: int, output: Path) -> subprocess.Popen:
    """A headless demo with 1-second rounds (the API's shortest) and light traffic, output to a file."""
    with open(output, "w") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "pasto.cli", "demo", "--headless", "--instance", str(instance),
             "--port", str(port), "--round-seconds", "1", "--rounds", "1000", "--sessions-per-second", "100"],
            stdout=sink, stderr=subprocess.STDOUT, preexec_fn=as_in_a_terminal,
        )


def printed_sign_in_url(demo: subprocess.Popen, output: Path, seconds: float = 120) -> str:
    # Hang guard, not a tolerance: the demo starts in 5-36 s; 120 s only ends a failing run.
    deadline = time.monotonic() + seconds
    while "Press Ctrl-C to stop." not in output.read_text():
        if demo.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the demo did not start:\n{output.read_text()}")
        time.sleep(0.2)
    urls = re.findall(r"https?://\S+", output.read_text())
    signed_in = [url for url in urls if "#token=" in url]
    assert len(signed_in) == 1, output.read_text()
    return signed_in[0]


def wait_until(page, expression: str, seconds: float = 60) -> None:
    """Poll ``expression`` with page.evaluate until it is true (page.wait_for_function evaluates a
    string, which the dashboard's Content-Security-Policy forbids)."""
    # Hang guard, not a tolerance: the page shows data within a few of the demo's 2 s rounds.
    deadline = time.monotonic() + seconds
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            pytest.fail(f"{expression} stayed false for {seconds} s")
        time.sleep(0.2)


def test_the_printed_url_opens_the_experiment_page_signed_in(tmp_path, browser, screenshot_dir):
    port = free_port()
    output = tmp_path / "demo-output.txt"
    demo = start_demo(tmp_path, port, output)
    try:
        url = printed_sign_in_url(demo, output)
        assert url.startswith(f"http://127.0.0.1:{port}/#token=")
        read_token = url.split("#token=", 1)[1]
        assert read_token and read_token in (tmp_path / "demo-tokens.json").read_text()

        context = browser.new_context(viewport={"width": 1280, "height": 800})
        page = context.new_page()
        problems: list[str] = []
        page.on("pageerror", lambda error: problems.append(f"uncaught: {error}"))
        requested: list[str] = []
        page.on("request", lambda request: requested.append(request.url))
        page.goto(url)
        # The overview lists the demo's experiment without asking for a token, and the token left the
        # address bar (it is kept in the tab's session storage, as the token dialog keeps it).
        page.wait_for_selector('tr[data-experiment="demo-ranking"] a')
        assert not page.locator("#token-dialog").evaluate("dialog => dialog.open")
        assert page.evaluate("window.location.href") == f"http://127.0.0.1:{port}/"
        assert page.evaluate("sessionStorage.getItem('pasto.readToken')") == read_token
        assert not any(read_token in request for request in requested)  # not in any URL sent

        page.click('tr[data-experiment="demo-ranking"] a')
        page.wait_for_url(f"http://127.0.0.1:{port}/experiments/demo-ranking")
        wait_until(page, f"() => Number(document.getElementById('experiment').dataset.rounds || 0) > {ROUNDS_SHOWN}")
        assert not page.locator("#token-dialog").evaluate("dialog => dialog.open")
        assert page.locator("#error-banner").is_hidden()
        assert page.locator("#fig-round").inner_text() not in ("", "–")
        mixture_points = page.evaluate("Chart.getChart('chart-mixture').data.datasets[0].data.length")
        assert mixture_points > ROUNDS_SHOWN
        path = screenshot_dir / "demo-signed-in-experiment.png"
        page.screenshot(path=str(path), full_page=True)
        print(f"screenshot: {path}")
        assert problems == []
        context.close()
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGINT)
            try:
                demo.wait(timeout=60)
            except subprocess.TimeoutExpired:
                demo.kill()
                demo.wait()
    assert demo.returncode == 0, output.read_text()


def test_a_rejected_token_in_the_link_falls_back_to_the_dialog(live_server, browser):
    # A stale link (the database was reset): the page says the token was not accepted and asks for
    # one; the address bar is clean either way.
    context = browser.new_context()
    page = context.new_page()
    page.goto(f"{live_server.base_url}/experiments/{live_server.experiment}#token=not-a-token")
    page.wait_for_selector("#token-dialog[open]")
    assert "did not accept" in page.locator("#token-reason").inner_text()
    assert page.evaluate("window.location.href") == f"{live_server.base_url}/experiments/{live_server.experiment}"
    page.fill("#token-input", live_server.tokens["read"])
    page.click("#token-form button[type=submit]")
    wait_until(page, "() => Number(document.getElementById('experiment').dataset.rounds || 0) > 30")
    assert not page.locator("#token-dialog").evaluate("dialog => dialog.open")
    context.close()
