"""A real pasto server (``pasto serve`` in a subprocess on 127.0.0.1) for the client tests, and a
misbehaving HTTP proxy to put in front of it.

The server runs exactly as in production: migrated SQLite database, waitress, and (when asked) the
scheduler that closes rounds. The proxy is the kind of component that sits between a recommender
and pasto in real deployments (a load balancer); it forwards requests to the real server but can be
told to answer 503 without forwarding, or to forward and then lose the response (502), so the
client's retry and idempotency logic is tested against the real server's behaviour.
"""

from __future__ import annotations

import http.server
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from tests.migrated import upgrade_to_head

from pasto_client import Client
from bench.pgcluster import free_port


@dataclass
class LiveServer:
    """One ``pasto serve`` process; can be stopped and started again on the same port and database."""

    database_url: str
    admin_token: str
    port: int
    scheduler: bool
    log_path: Path
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "PASTO_DATABASE_URL": self.database_url,
            "PASTO_ADMIN_TOKEN": self.admin_token,
            "PASTO_SCHEDULER_INTERVAL": "0.2",
        }

    def client(self, token: str | None = None, timeout: float = 10.0) -> Client:
        return Client(self.url, self.admin_token if token is None else token, timeout=timeout)

    def pasto(self, *args: str) -> str:
        """Run a ``pasto`` CLI command against this server's database and return its stdout."""
        result = subprocess.run(
            [sys.executable, "-m", "pasto.cli", *args],
            env=self.env, capture_output=True, text=True, timeout=60,
        )
        if result.returncode != 0:
            raise RuntimeError(f"pasto {' '.join(args)} failed: {result.stderr}")
        return result.stdout

    def start(self) -> None:
        command = [sys.executable, "-m", "pasto.cli", "serve", "--host", "127.0.0.1",
                   "--port", str(self.port)]
        if not self.scheduler:
            command.append("--no-scheduler")
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        # Hang guard, not a tolerance: `pasto serve` answers in 1-3 s on a quiet machine; beside the suite's
        # other workers, importing and starting on a loaded 2-core machine, a start took over 30 s.
        deadline = time.monotonic() + 120
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"pasto serve exited: {self.log_path.read_text()[-3000:]}")
            try:
                if requests.get(self.url + "/healthz", timeout=1).status_code < 600:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pasto serve did not answer: {self.log_path.read_text()[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=15)
        self.process = None


def make_server(tmp_path: Path, scheduler: bool) -> LiveServer:
    database_url = f"sqlite:///{tmp_path / 'pasto.sqlite'}"
    server = LiveServer(
        database_url=database_url,
        admin_token="admin-" + secrets.token_hex(16),
        port=free_port(),
        scheduler=scheduler,
        log_path=tmp_path / "server.log",
    )
    upgrade_to_head(database_url)
    server.start()
    return server


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Iterator[LiveServer]:
    """A server without scheduler (rounds are closed by the tests), shared by the client tests:
    every test uses its own experiment name."""
    live = make_server(tmp_path_factory.mktemp("server"), scheduler=False)
    try:
        yield live
    finally:
        live.stop()


@pytest.fixture
def fresh_server(tmp_path) -> Iterator[LiveServer]:
    """A server of the test's own (the test may stop and restart it)."""
    live = make_server(tmp_path, scheduler=False)
    try:
        yield live
    finally:
        live.stop()


@pytest.fixture
def scheduled_server(tmp_path) -> Iterator[LiveServer]:
    """A server whose scheduler closes rounds (checks every 0.2 s), for the test alone: an idle
    scheduler still costs about 1.4% of a core, which a session-long server would spend until its
    worker's last test."""
    live = make_server(tmp_path, scheduler=True)
    try:
        yield live
    finally:
        live.stop()


@pytest.fixture
def admin(server: LiveServer) -> Iterator[Client]:
    with server.client() as client:
        yield client


ARMS = [
    {"name": "a", "params": {"w_watch": 1.0, "w_like": 0.0}},
    {"name": "b", "params": {"w_watch": 0.5, "w_like": 0.5}},
    {"name": "c", "params": {"w_watch": 0.0, "w_like": 1.0}},
    {"name": "d", "params": {"w_watch": 0.2, "w_like": 0.3, "label": "déjà vu"}},
]


@pytest.fixture
def create_experiment(admin: Client):
    """``create_experiment(**overrides) -> name``: a small experiment (4 arms, a primary metric and
    one guardrail, 1-hour rounds so that only the test closes them) under a fresh name."""

    def create(**overrides) -> str:
        spec = {
            "name": "exp-" + secrets.token_hex(6),
            "arms": ARMS,
            "metrics": ["watch_time", "like_rate"],
            "objective": {
                "primary": "watch_time",
                "guardrails": [{"metric": "like_rate", "threshold": 0.5, "penalty": 5.0}],
            },
            "round_seconds": 3600.0,
            "settle_seconds": 0.0,
            "seed": 12345,
        }
        spec.update(overrides)
        admin.create_experiment(**spec)
        return spec["name"]

    return create


#: True means (watch_time, like_rate) per arm: "a" is best on watch time but breaks the guardrail,
#: so the learned mixture moves away from uniform.
TRUE_MEANS = {"a": (2.0, 0.0), "b": (1.0, 0.6), "c": (0.0, 1.0), "d": (0.5, 0.4)}


@pytest.fixture
def true_means() -> dict[str, tuple[float, float]]:
    return TRUE_MEANS


# --------------------------------------------------------------------------------------------------
# A proxy that fails on request


@dataclass
class FlakyProxy:
    """Forwards to ``upstream``; ``script`` lists what to do with the next requests:
    ``"503"`` (answer 503, do not forward), ``"503 retry-after N"`` (the server's 503
    ``database_unavailable`` with ``Retry-After: N``, not forwarded) or ``"lose"`` (forward, then answer 502 as if the
    response was lost). When the script is empty, requests are forwarded faithfully."""

    upstream: str
    port: int = 0
    script: list[str] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)
    seen_at: list[float] = field(default_factory=list)  # time.monotonic() of each entry of seen
    _server: http.server.ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        proxy = self
        session = requests.Session()
        lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with lock:
                    action = proxy.script.pop(0) if proxy.script else "forward"
                    proxy.seen.append(f"{self.command} {self.path} {action}")
                    proxy.seen_at.append(time.monotonic())
                if action == "503":
                    self._answer(503, b"Service Unavailable", "text/plain")
                    return
                if action.startswith("503 retry-after "):
                    # What the server answers while its database is away, with the asked delay.
                    error = {"error": {"code": "database_unavailable", "message": "The database is unavailable.",
                                       "details": None}}
                    self._answer(503, json.dumps(error).encode(), "application/json",
                                 {"Retry-After": action.removeprefix("503 retry-after ")})
                    return
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() in ("authorization", "content-type", "accept")}
                upstream = session.request(self.command, proxy.upstream + self.path,
                                           data=body, headers=headers, timeout=30)
                if action == "lose":
                    self._answer(502, b"Bad Gateway", "text/plain")
                    return
                self._answer(upstream.status_code, upstream.content,
                             upstream.headers.get("Content-Type", "application/json"))

            def _answer(self, status: int, content: bytes, content_type: str,
                        headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                for header, value in (headers or {}).items():
                    self.send_header(header, value)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = _handle

            def log_message(self, *args) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


@pytest.fixture
def proxy(server: LiveServer) -> Iterator[FlakyProxy]:
    flaky = FlakyProxy(upstream=server.url)
    flaky.start()
    try:
        yield flaky
    finally:
        flaky.stop()
