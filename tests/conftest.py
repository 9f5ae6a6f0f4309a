"""Shared fixtures: a throwaway PostgreSQL cluster, and the rule that CI may not skip backend suites.

PostgreSQL: ``PASTO_TEST_POSTGRES_URL`` (a server URL such as
``postgresql+psycopg://user@127.0.0.1:5432/postgres``) is used when set; otherwise, when Debian's
``postgresql`` package is installed, a private cluster is created in a temporary folder, listening on
loopback only, and removed at the end of the session. Each test gets a fresh database.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator

import pytest

BACKEND_MARKERS = ("postgres", "chromium")


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (_in_ci() and report.skipped):
        return
    markers = [name for name in BACKEND_MARKERS if item.get_closest_marker(name)]
    if markers:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (
            f"CI=true: a test marked {', '.join(markers)} was skipped ({reason}); "
            "CI must install and run that backend."
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _postgres_bin_dir() -> str | None:
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return os.path.dirname(candidates[-1]) if candidates else None


class _Cluster:
    """A private PostgreSQL cluster in a temporary folder (run as user ``postgres`` when we are root)."""

    def __init__(self, bin_dir: str) -> None:
        self.bin_dir = bin_dir
        self.root = tempfile.mkdtemp(prefix="pasto-pg-")
        self.data_dir = os.path.join(self.root, "data")
        self.port = _free_port()
        self.as_postgres = os.geteuid() == 0
        if self.as_postgres:
            shutil.chown(self.root, user="postgres", group="postgres")
        self.user = "postgres" if self.as_postgres else os.environ.get("USER", "postgres")

    def _run(self, *args: str) -> None:
        command = list(args)
        if self.as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True, cwd=self.root)

    def start(self) -> None:
        self._run(os.path.join(self.bin_dir, "initdb"), "-D", self.data_dir, "-A", "trust",
                  "-U", self.user, "-E", "UTF8", "--no-sync")
        options = (f"-c listen_addresses=127.0.0.1 -c port={self.port} "
                   f"-c unix_socket_directories={self.root} -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._run(os.path.join(self.bin_dir, "pg_ctl"), "-D", self.data_dir, "-o", options,
                  "-l", os.path.join(self.root, "server.log"), "-w", "start")

    def stop(self) -> None:
        try:
            self._run(os.path.join(self.bin_dir, "pg_ctl"), "-D", self.data_dir, "-m", "immediate", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://{self.user}@127.0.0.1:{self.port}/postgres"


@pytest.fixture(scope="session")
def postgres_server_url() -> Iterator[str]:
    """URL of a PostgreSQL server's maintenance database, or skip when none can be had."""
    configured = os.environ.get("PASTO_TEST_POSTGRES_URL")
    if configured:
        yield configured
        return
    bin_dir = _postgres_bin_dir()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (Debian package `postgresql`), "
                    "and PASTO_TEST_POSTGRES_URL is not set.")
    cluster = _Cluster(bin_dir)
    try:
        cluster.start()
    except (subprocess.CalledProcessError, OSError) as error:
        detail = getattr(error, "stderr", b"") or b""
        shutil.rmtree(cluster.root, ignore_errors=True)
        pytest.skip(f"Could not start a private PostgreSQL cluster: {error} {detail.decode(errors='replace')}")
    try:
        yield cluster.url
    finally:
        cluster.stop()


@pytest.fixture
def postgres_url(postgres_server_url: str) -> Iterator[str]:
    """SQLAlchemy URL of a fresh, empty PostgreSQL database, dropped after the test."""
    import sqlalchemy as sa

    name = f"pasto_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(postgres_server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
    base, _, _ = postgres_server_url.rpartition("/")
    try:
        yield f"{base}/{name}"
    finally:
        with admin.connect() as connection:
            deadline = time.monotonic() + 10
            while True:
                connection.execute(sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :name AND pid <> pg_backend_pid()"), {"name": name})
                try:
                    connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
                    break
                except sa.exc.OperationalError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        admin.dispose()
