"""`pasto demo` headless: creates and runs the demo, resumes it, stops cleanly on Ctrl-C and on
SIGHUP, leaves no server behind when killed, and the mixture it learns beats the best single blend
(checked through the API)."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pasto.algorithm import AlgorithmConfig
from pasto_client import Client, PastoAPIError, PastoConnectionError
from service import create_app
from service.auth import revoke_tokens
from service.db import get_db
from service.demo import EXPERIMENT, check_scenario, ensure_experiment, load_demo_scenario
from service.demo.groundtruth import (
    GUARDRAIL_PENALTIES,
    arms,
    experiment_objective,
    experiment_objective_spec,
    simulate_session,
    true_means,
)
from service.demo.setup import prepare_database
from bench.pgcluster import free_port
from tests.signals import as_in_a_terminal


def port_is_closed(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def demo_command(instance, port: int, rounds: int, sessions_per_second: float = 600.0) -> list[str]:
    return [sys.executable, "-m", "pasto.cli", "demo", "--headless", "--instance", str(instance),
            "--port", str(port), "--round-seconds", "1", "--rounds", str(rounds),
            "--sessions-per-second", str(sessions_per_second)]


def round_numbers(output: str) -> list[int]:
    """The rounds reported by the demo's "round N: deployed ..." lines, in order."""
    return [int(number) for number in re.findall(r"^round +(\d+): deployed", output, flags=re.MULTILINE)]


def environment_without_browser() -> dict[str, str]:
    """No display (the demo opens a browser only with one) and, for macOS, a browser that does nothing."""
    environment = {key: value for key, value in os.environ.items() if key not in ("DISPLAY", "WAYLAND_DISPLAY")}
    environment["BROWSER"] = "true"
    return environment


def process_is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an orphan's exit is reaped by whoever adopted it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(state) and not state.startswith("Z")


def start_demo_and_find_its_server(tmp_path: Path, port: int) -> tuple[subprocess.Popen, int, Path]:
    """A running headless demo (output in a file), once its server answers; returns (demo, server pid, output)."""
    output = tmp_path / "demo-output.txt"
    with open(output, "w") as sink:
        demo = subprocess.Popen(demo_command(tmp_path, port, rounds=1000, sessions_per_second=50),
                                stdout=sink, stderr=subprocess.STDOUT, preexec_fn=as_in_a_terminal)
    # Hang guard, not a tolerance: the demo starts in 5-36 s (36 s on a fresh clone); 120 s only ends a failing
    # run.
    deadline = time.monotonic() + 120
    while "Press Ctrl-C to stop." not in output.read_text():
        if demo.poll() is not None or time.monotonic() > deadline:
            demo.kill()
            demo.wait()
            pytest.fail(f"the demo did not start:\n{output.read_text()}")
        time.sleep(0.2)
    server_pid = int(re.search(r"Started pasto serve \(pid (\d+)\)", output.read_text()).group(1))
    assert process_is_running(server_pid) and not port_is_closed(port)
    return demo, server_pid, output


def wait_for_child(pid: int, seconds: float) -> int:
    """The wait status of child ``pid``; killed (and the test failed) if it outlives ``seconds``."""
    # Hang guard, not a tolerance: callers allow 60 s for an exit that takes about a second.
    deadline = time.monotonic() + seconds
    while True:
        finished, status = os.waitpid(pid, os.WNOHANG)
        if finished:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"process {pid} did not exit within {seconds} s")
        time.sleep(0.1)


def wait_until_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while process_is_running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_the_demo_runs_the_shipped_scenario():
    # The ground truth is pasto's scenario "demo" (what `pasto simulate demo` runs): the blends'
    # means, convex in the blend's weight t on watch time, and its hard guardrails and baseline blend.
    scenario = load_demo_scenario()
    means = true_means(scenario)
    t = np.linspace(0.0, 1.0, 20)
    np.testing.assert_allclose(means, np.stack([4.0 + 2.0 * t**2, 0.03 + 0.07 * (1 - t) ** 2,
                                                0.010 + 0.006 * (1 - t) ** 2]), atol=1e-9)
    assert scenario.metrics == ("watch_time", "like_rate", "share_rate")
    assert experiment_objective_spec(scenario) == {"primary": "watch_time", "baseline": "blend-10", "guardrails": [
        {"metric": "like_rate", "threshold": 0.06, "hard": True},
        {"metric": "share_rate", "threshold": -0.05, "hard": True, "relative_to": "blend-10"},
    ]}
    # What earlier demos created: the same guardrails made soft with penalties.
    assert experiment_objective_spec(scenario, GUARDRAIL_PENALTIES)["guardrails"][0] == {
        "metric": "like_rate", "threshold": 0.06, "penalty": GUARDRAIL_PENALTIES["like_rate"]}
    assert [arm["name"] for arm in arms(scenario)] == [f"blend-{k:02d}" for k in range(20)]


def test_sessions_are_drawn_from_the_scenarios_noise():
    scenario = load_demo_scenario()
    means = true_means(scenario)
    rng = np.random.default_rng(3)
    sessions = [simulate_session(scenario, means, 7, rng) for _ in range(20_000)]
    values = np.array([[session[metric] for metric in scenario.metrics] for session in sessions])
    # Means within 4 standard errors; standard deviations within 3% (their own relative standard
    # error is 1/sqrt(2 n) = 0.5% for Gaussian noise).
    std = np.asarray(scenario.noise.std)
    assert np.all(np.abs(values.mean(axis=0) - means[:, 7]) < 4 * std / np.sqrt(len(values)))
    np.testing.assert_allclose(values.std(axis=0), std, rtol=0.03)


def test_the_scenario_rewards_mixing_within_its_guardrails():
    scenario = load_demo_scenario()
    means = true_means(scenario)
    solution = check_scenario(scenario)
    assert solution.mixture_value > solution.single_value + 0.5
    assert solution.mixture[solution.single] < 0.5 and (solution.mixture > 0.05).sum() >= 2
    # The story the dashboard tells: the optimum keeps the hard like-rate guardrail (0.06), which
    # binds (up to the solver's tolerance), and the share-rate one outright...
    like_rate, share_rate = solution.guarded
    assert solution.thresholds[0] == 0.06 and 0.06 - 2e-5 <= like_rate < 0.06 + 1e-4
    assert round(like_rate, 4) == 0.06
    assert share_rate >= solution.thresholds[1]
    # ...and beats on watch time every single blend that keeps both guardrails.
    watch_time = means[0] @ solution.mixture
    feasible = np.all(means[1:] >= solution.thresholds[:, None], axis=0)
    assert feasible.any() and watch_time > means[0, feasible].max() + 0.5


def test_the_scenario_check_rejects_an_optimum_past_its_guardrail():
    # The penalty the demo had: its optimum's like rate was 0.0593, shown as a violated guardrail.
    with pytest.raises(RuntimeError, match="like_rate 0.0592"):
        check_scenario(load_demo_scenario(), {**GUARDRAIL_PENALTIES, "like_rate": 20000.0})


class ExperimentsInMemory:
    """The part of pasto_client.Client that ensure_experiment uses, over a dict of experiments."""

    def __init__(self, experiments: dict[str, dict]) -> None:
        self.experiments = experiments

    def get_experiment(self, name: str) -> dict:
        if name not in self.experiments:
            raise PastoAPIError(404, "not_found", f"no experiment {name!r}")
        return self.experiments[name]

    def create_experiment(self, name, arms, metrics, objective, round_seconds, algorithm) -> None:
        self.experiments[name] = {"status": "running", "arms": list(arms), "objective": objective,
                                  "algorithm": algorithm, "round_seconds": round_seconds, "round": {"index": 0}}

    def pause(self, name: str) -> None:
        self.experiments[name]["status"] = "paused"

    def resume(self, name: str) -> None:
        self.experiments[name]["status"] = "running"


def test_an_earlier_demos_experiment_is_paused_and_replaced():
    scenario = load_demo_scenario()
    spec = experiment_objective_spec(scenario, {**GUARDRAIL_PENALTIES, "like_rate": 20000.0})  # what it was
    client = ExperimentsInMemory({})
    client.create_experiment(EXPERIMENT, arms(scenario), (), spec, 5.0, {"preset": "default"})
    assert ensure_experiment(client, scenario, 5.0) == f"{EXPERIMENT}-2"
    assert client.experiments[EXPERIMENT]["status"] == "paused"
    assert client.experiments[f"{EXPERIMENT}-2"]["objective"] == experiment_objective_spec(scenario)
    # The next run passes over the old one again and resumes its replacement.
    client.experiments[f"{EXPERIMENT}-2"] = {  # as the server stores it: normalised settings
        **client.experiments[f"{EXPERIMENT}-2"], "status": "paused",
        "objective": experiment_objective(scenario).to_spec(),
        "algorithm": {"preset": "default",
                      **AlgorithmConfig.from_preset("default").to_dict()},
    }
    assert ensure_experiment(client, scenario, 5.0) == f"{EXPERIMENT}-2"
    assert client.experiments[f"{EXPERIMENT}-2"]["status"] == "running"
    assert client.experiments[EXPERIMENT]["status"] == "paused"
    # A server that stores only the resolved options (no preset name) is resumed the same way.
    del client.experiments[f"{EXPERIMENT}-2"]["algorithm"]["preset"]
    client.experiments[f"{EXPERIMENT}-2"]["status"] = "paused"
    assert ensure_experiment(client, scenario, 5.0) == f"{EXPERIMENT}-2"
    assert client.experiments[f"{EXPERIMENT}-2"]["status"] == "running"


def test_a_revoked_demo_token_is_replaced(tmp_path, monkeypatch):
    # `pasto tokens revoke "pasto demo (read)"`: the next run must not print a sign-in link whose
    # token the server refuses, so it makes a new read token and keeps the admin one.
    monkeypatch.delenv("PASTO_DATABASE_URL", raising=False)
    url, _, admin, read = prepare_database(tmp_path)
    assert prepare_database(tmp_path)[2:] == (admin, read)  # reused while usable
    app = create_app({"PASTO_DATABASE_URL": url, "PASTO_CHECK_SCHEMA": False})
    with get_db(app).write() as session:
        assert [token.role for token in revoke_tokens(session, "pasto demo (read)")] == ["read"]
    get_db(app).engine.dispose()
    _, _, admin_again, read_again = prepare_database(tmp_path)
    assert admin_again == admin and read_again != read
    assert json.loads((tmp_path / "demo-tokens.json").read_text()) == {"admin": admin, "read": read_again}


def test_without_a_terminal_every_round_gets_its_own_line(tmp_path):
    # Not --headless, but stdout is a pipe (`make run > log`): no carriage returns, one line per
    # round, and with --rounds 2 both closed rounds are reported.
    command = demo_command(tmp_path, free_port(), rounds=2, sessions_per_second=50)
    command.remove("--headless")
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=environment_without_browser())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "\r" not in result.stdout
    assert round_numbers(result.stdout) == [1, 2], result.stdout
    assert re.search(r"^Stopped after", result.stdout, flags=re.MULTILINE)


# The live check below reads the experiment in WINDOW_ROUNDS rounds from the one where it holds
# WINDOW_SESSIONS sessions. Windowed by data, not by round number, so that a loaded machine (fewer
# sessions per 1-second round) does not judge the controller on less data than the bounds assume.
WINDOW_SESSIONS = 12_000
WINDOW_ROUNDS = 5


def printed_commands(output: str) -> list[str]:
    """The `pasto tokens create` commands the demo prints, as a shell would read them."""
    return [line.strip() for line in output.splitlines() if "tokens create --role" in line]


def test_demo_runs_resumes_and_learns_a_winning_mixture(tmp_path):
    port = free_port()
    first = subprocess.run(demo_command(tmp_path, port, rounds=4), capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "Created experiment" in first.stderr
    assert round_numbers(first.stdout) == [1, 2, 3, 4], first.stdout  # the round that ends the demo too
    assert port_is_closed(port), "the demo left its server running"
    tokens = json.loads((tmp_path / "demo-tokens.json").read_text())
    assert (tmp_path / "demo-tokens.json").stat().st_mode & 0o077 == 0
    # One URL, signed in: the read token travels in the fragment (never sent to the server).
    urls = re.findall(r"https?://\S+", first.stdout)
    assert [url for url in urls if "token" in url] == [f"http://127.0.0.1:{port}/#token={tokens['read']}"], urls
    assert f"port {port}" in first.stdout
    database = f"sqlite:///{tmp_path.resolve() / 'pasto.sqlite'}"
    commands = printed_commands(first.stdout)
    assert [command.rsplit(" ", 1)[1] for command in commands] == ["admin", "ingest"], first.stdout
    assert all(command.startswith(f"PASTO_DATABASE_URL={database} ") for command in commands), commands

    # The ground truth the demo serves, to judge what it deploys without the estimates' noise.
    means = true_means(load_demo_scenario())
    solution = check_scenario(load_demo_scenario())
    watch_single = means[0, solution.single]  # the best single blend that keeps the guardrails
    watch_best = means[0] @ solution.mixture
    # Second run: resumes the same experiment; read through the API in WINDOW_ROUNDS rounds (see
    # above), then stopped with Ctrl-C (SIGINT).
    second = subprocess.Popen(demo_command(tmp_path, port, rounds=1000), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, preexec_fn=as_in_a_terminal)
    try:
        with Client(f"http://127.0.0.1:{port}", tokens["read"], timeout=10) as reader:
            # Hang guard, not a tolerance: WINDOW_ROUNDS rounds of the demo take about a minute; rounds missed by
            # a slow poll are not required (any WINDOW_ROUNDS rounds do), so load only makes the window later.
            deadline = time.monotonic() + 180
            by_round: dict[int, tuple[dict, list[float]]] = {}
            while time.monotonic() < deadline and second.poll() is None and len(by_round) < WINDOW_ROUNDS:
                try:
                    index = reader.get_experiment(EXPERIMENT)["round"]["index"]
                    if index not in by_round:
                        diagnostics = reader.diagnostics(EXPERIMENT)
                        experiment = reader.get_experiment(EXPERIMENT)
                        if (diagnostics["round"] == experiment["round"]["index"]
                                and (by_round or sum(diagnostics["units"]) >= WINDOW_SESSIONS)):
                            by_round[diagnostics["round"]] = (diagnostics, experiment["deployed"])
                except (PastoConnectionError, PastoAPIError):
                    pass  # the server is still starting
                time.sleep(0.1)
            assert len(by_round) == WINDOW_ROUNDS, f"the demo was read in rounds {sorted(by_round)} only"
            # The commands the demo printed make working admin and ingest tokens for its database.
            made = {command.rsplit(" ", 1)[1]: subprocess.run(command, shell=True, capture_output=True,
                                                              text=True, timeout=60)
                    for command in commands}
            assert all(result.returncode == 0 for result in made.values()), made
            with Client(f"http://127.0.0.1:{port}", made["ingest"].stdout.strip(), timeout=10) as ingest:
                assert ingest.assign(EXPERIMENT, "a-curious-user").arm.startswith("blend-")
            with Client(f"http://127.0.0.1:{port}", made["admin"].stdout.strip(), timeout=10) as admin:
                admin.create_experiment(name="beside-the-demo", arms=[{"name": "a", "params": {}},
                                        {"name": "b", "params": {}}], metrics=["x"],
                                        objective={"primary": "x"}, round_seconds=60)
        for index, (diagnostics, deployed) in sorted(by_round.items()):
            deployed = np.asarray(deployed)
            # Judged on the ground truth, not on the estimates. On the estimates the test once failed
            # (deployed 4.755 against 70% of the gain, 4.857), and it fails in about 1% of
            # the runs of an offline replica of this window (bench/demo_test_bounds.py --estimates:
            # 2 of 300): the estimated best mixture and best single blend are maxima over noisy
            # estimates (biased upward), the deployed mixture hedges against that noise by design,
            # and with the like-rate penalty of 1e6 a like-rate error of one standard error (0.0006)
            # moves any penalised value near the threshold by 1e6 * 0.0006^2 = 0.36, more than the
            # 70% bound's whole margin. The tolerances below come from 12,000 runs of the replica
            # (bench/demo_test_bounds.py --runs 4000 at 300, 630 and 1,000 sessions per round):
            # the deployed mixture's true watch time had at least 51% of the gain of mixing (0.1%
            # quantile 59%, 1% quantile 68%, median 94%), so half the gain was asked for. With safe
            # serving (hard guardrails on bounds, a baseline below the like-rate threshold
            # trusted only until refuted) the replica's 300 runs at 630 sessions per round give
            # minimum 22%, 0.1% quantile 23%, 1% quantile 27%, median 89% (24 runs below half), so
            # a fifth is asked for: more than the best single blend, at a fifth of the gain; ...
            watch = float(means[0] @ deployed)
            assert watch >= watch_single + 0.2 * (watch_best - watch_single), (index, watch, deployed)
            like_rate = next(item for item in diagnostics["guardrails"] if item["metric"] == "like_rate")
            # ... the like rate the mixture leans on holds on the estimate (it is solved on that
            # estimate with a hedge: smallest margin 0.00074, about 1.3 standard errors), and its
            # true like rate was at worst 2.5 standard errors of that estimate below the threshold,
            # so 4 are allowed (a mixture that ignored the guardrail would be 25 or more below).
            assert like_rate["holds"], (index, like_rate)
            standard_error = (like_rate["interval"][1] - like_rate["interval"][0]) / (2 * 1.959964)
            true_like_rate = float(means[1] @ deployed)
            assert true_like_rate >= like_rate["threshold"] - 4 * standard_error, (index, true_like_rate, like_rate)
        second.send_signal(signal.SIGINT)
        output, _ = second.communicate(timeout=60)
    finally:
        if second.poll() is None:
            second.kill()
            second.communicate()
    assert second.returncode == 0, output
    assert "Resuming experiment 'demo-ranking'" in output
    assert "Stopping" in output and "Stopped after" in output
    assert "Traceback" not in output
    assert port_is_closed(port)


def test_sighup_stops_the_demo_and_its_server(tmp_path):
    # What a closed terminal sends: the demo must stop its server (in its own session, so the
    # terminal's SIGHUP does not reach it) before exiting.
    port = free_port()
    demo, server_pid, output = start_demo_and_find_its_server(tmp_path, port)
    try:
        demo.send_signal(signal.SIGHUP)
        demo.wait(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        if process_is_running(server_pid):
            os.kill(server_pid, signal.SIGKILL)
            pytest.fail("SIGHUP left the demo's server running")
    log = output.read_text()
    assert demo.returncode == 0, log
    assert "Stopping" in log and "Stopped after" in log and "Traceback" not in log
    assert "pasto serve exited with status" not in log, (tmp_path / "demo-server.log").read_text()
    assert port_is_closed(port)


def test_a_killed_demo_takes_its_server_down(tmp_path):
    # SIGKILL gives the demo no chance to clean up: the server stops because its stdin pipe closes.
    port = free_port()
    demo, server_pid, _ = start_demo_and_find_its_server(tmp_path, port)
    demo.kill()
    demo.wait()
    try:
        assert wait_until_gone(server_pid, seconds=30), "the server outlived the killed demo"
    finally:
        if process_is_running(server_pid):
            os.kill(server_pid, signal.SIGKILL)
    assert port_is_closed(port)


def test_closing_the_terminal_stops_the_demo_and_its_server(tmp_path):
    # The real thing behind SIGHUP: the demo runs on a pseudo-terminal (session leader, like a
    # shell's job) and the terminal goes away, so writing "Stopping..." fails too (EIO).
    port = free_port()
    stderr_path = tmp_path / "demo-stderr.txt"
    command = demo_command(tmp_path, port, rounds=1000, sessions_per_second=50)
    command.remove("--headless")  # interactive, as in a terminal
    environment = environment_without_browser()
    pid, terminal = pty.fork()
    if pid == 0:  # the child: stderr to a file (it outlives the terminal), then the demo
        try:
            as_in_a_terminal()
            os.dup2(os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
            os.execve(command[0], command, environment)
        finally:
            os._exit(127)
    shown = b""
    try:
        # Hang guard, not a tolerance: the first round line shows within seconds of the start.
        deadline = time.monotonic() + 120
        while b"round    1:" not in shown:
            assert time.monotonic() < deadline, shown.decode(errors="replace")
            if select.select([terminal], [], [], 1.0)[0]:
                shown += os.read(terminal, 4096)
        server_pid = int(re.search(r"Started pasto serve \(pid (\d+)\)", stderr_path.read_text()).group(1))
        assert process_is_running(server_pid)
        assert b"\rround    1:" in shown  # on a terminal the round line is overwritten in place
    finally:
        os.close(terminal)  # hang up
        status = wait_for_child(pid, seconds=60)
    if process_is_running(server_pid):
        os.kill(server_pid, signal.SIGKILL)
        pytest.fail("closing the terminal left the demo's server running")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, stderr_path.read_text()
    assert "Traceback" not in stderr_path.read_text()
    assert port_is_closed(port)



def test_the_demo_server_keeps_ids_fifteen_minutes_unless_the_environment_says_otherwise(tmp_path, monkeypatch):
    """At 600 sessions a second the server's 7-day retention would grow the demo's database by GBs a day."""
    from service.demo import supervise

    started = []

    class Started:
        pid = 1

        def __init__(self, command, env, **kwargs):
            started.append(env)

    monkeypatch.setattr(supervise.subprocess, "Popen", Started)
    monkeypatch.delenv("PASTO_RETENTION_SECONDS", raising=False)
    supervise.ServerProcess("sqlite:///x.sqlite", 8000, tmp_path / "server.log")
    monkeypatch.setenv("PASTO_RETENTION_SECONDS", "forever")
    supervise.ServerProcess("sqlite:///x.sqlite", 8000, tmp_path / "server.log")
    assert [env["PASTO_RETENTION_SECONDS"] for env in started] == ["900", "forever"]
    assert started[0]["PASTO_DATABASE_URL"] == "sqlite:///x.sqlite"
