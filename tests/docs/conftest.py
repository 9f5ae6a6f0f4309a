"""A throwaway pasto server for the doc tests: ``pasto serve`` (with its scheduler) on a free port of
127.0.0.1, a temporary SQLite database migrated with ``pasto db upgrade``, a random bootstrap admin
token and ingest/read tokens made with ``pasto tokens create``, all through the installed ``pasto``
command, as the documentation has a reader do it."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from bench.pgcluster import free_port

#: The installed console script, beside the interpreter running the tests.
PASTO_COMMAND = Path(sys.executable).parent / "pasto"
REPOSITORY = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class DocServer:
    url: str
    environment: dict[str, str]  # what the documentation assumes the reader has exported


def _pasto(environment: dict[str, str], *args: str) -> str:
    completed = subprocess.run([str(PASTO_COMMAND), *args], env=environment, capture_output=True, text=True,
                               timeout=120)
    assert completed.returncode == 0, f"pasto {' '.join(args)}: {completed.stderr}"
    return completed.stdout.strip()


@contextlib.contextmanager
def running_doc_server(folder: Path) -> Iterator[DocServer]:
    """``pasto serve`` on a new database in ``folder``, set up with the installed commands; stopped on exit."""
    port = free_port()
    admin = secrets.token_urlsafe(24)
    base = {key: value for key, value in os.environ.items() if not key.startswith("PASTO")}
    server_environment = {**base, "PASTO_DATABASE_URL": f"sqlite:///{folder / 'docs.sqlite'}",
                          "PASTO_ADMIN_TOKEN": admin, "PASTO_SCHEDULER_INTERVAL": "0.5"}
    _pasto(server_environment, "db", "upgrade")
    tokens = {role: _pasto(server_environment, "tokens", "create", "--role", role, "--name", f"docs-{role}")
              for role in ("ingest", "read")}
    log_path = folder / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([str(PASTO_COMMAND), "serve", "--host", "127.0.0.1", "--port", str(port)],
                                   env=server_environment, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        # Hang guard, not a tolerance: `pasto serve` answers in 1-3 s on a loaded machine.
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log_path.read_text()
            # Not listening yet, or listening but not answering yet (its first answer loads the app,
            # which took over 2 s on a machine busy with other jobs): ask again until the deadline.
            with contextlib.suppress(requests.ConnectionError, requests.Timeout):
                if requests.get(f"{url}/healthz", timeout=10).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"pasto serve did not answer in 60 s:\n{log_path.read_text()}"
            time.sleep(0.2)
        environment = {**server_environment, "PASTO": url, "ADMIN": admin, "INGEST": tokens["ingest"],
                       "READ": tokens["read"]}
        yield DocServer(url, environment)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def doc_server(tmp_path: Path) -> Iterator[DocServer]:
    """A server of the test's own: a documentation page's examples run against a new database, as a
    reader's would (pages create experiments of the same names)."""
    with running_doc_server(tmp_path) as server:
        yield server


@pytest.fixture(scope="module")
def harness_server(tmp_path_factory) -> Iterator[DocServer]:
    """One server for the tests of the harness itself: each uses its own experiment names or only reads."""
    with running_doc_server(tmp_path_factory.mktemp("harness")) as server:
        yield server


def pytest_terminal_summary(terminalreporter) -> None:
    """One line with how many documented examples the doc tests run and how many are marked skip."""
    from tests.docs.markdown_examples import documentation_files, extract_examples

    examples = [example for path in documentation_files(REPOSITORY)
                for example in extract_examples(path.read_text(), str(path.relative_to(REPOSITORY)))]
    skipped = [example for example in examples if not example.runnable]
    terminalreporter.write_line(f"doc tests: {len(examples) - len(skipped)} of {len(examples)} shell/Python/HTTP examples "
                                f"in README.md and docs/*.md run against a live server, {len(skipped)} marked skip")
