"""`pasto demo` headless: creates and runs the demo, resumes it, stops cleanly on Ctrl-C, and the
mixture it learns beats the best single blend (checked through the API)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time


from pasto.client import Client, PastoAPIError, PastoConnectionError
from service.demo import EXPERIMENT, build_scenario, check_scenario
from tests.pgcluster import free_port


def port_is_closed(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def demo_command(instance, port: int, rounds: int) -> list[str]:
    return [sys.executable, "-m", "pasto.cli", "demo", "--headless", "--instance", str(instance),
            "--port", str(port), "--round-seconds", "1", "--rounds", str(rounds)]


def test_the_scenario_rewards_mixing():
    mixture, mixture_value, single, single_value = check_scenario(build_scenario())
    assert mixture_value > single_value + 0.5
    assert mixture[single] < 0.5 and (mixture > 0.05).sum() >= 2


def test_demo_runs_resumes_and_learns_a_winning_mixture(tmp_path):
    port = free_port()
    first = subprocess.run(demo_command(tmp_path, port, rounds=4), capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"Dashboard: http://127.0.0.1:{port}/" in first.stdout
    assert "read token:" in first.stdout
    assert "Created experiment" in first.stderr
    assert port_is_closed(port), "the demo left its server running"
    tokens = json.loads((tmp_path / "demo-tokens.json").read_text())
    assert (tmp_path / "demo-tokens.json").stat().st_mode & 0o077 == 0

    # Second run: resumes the same experiment; stopped with Ctrl-C (SIGINT) once 20 rounds have run.
    second = subprocess.Popen(demo_command(tmp_path, port, rounds=1000), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        with Client(f"http://127.0.0.1:{port}", tokens["read"], timeout=10) as reader:
            deadline = time.monotonic() + 120
            diagnostics = None
            while time.monotonic() < deadline and second.poll() is None:
                try:
                    if reader.get_experiment(EXPERIMENT)["round"]["index"] >= 20:
                        diagnostics = reader.diagnostics(EXPERIMENT)
                        break
                except (PastoConnectionError, PastoAPIError):
                    pass  # the server is still starting
                time.sleep(0.2)
            assert diagnostics is not None, "the demo did not reach round 20"
            assert diagnostics["objective"]["deployed"] > diagnostics["best_single"]["value"]
            assert sum(diagnostics["units"]) > 5000
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
