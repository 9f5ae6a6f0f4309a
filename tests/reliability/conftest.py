"""Fixtures of the process-level reliability tests: real service processes on 127.0.0.1.

Every process (``pasto serve``, ``gunicorn -w N service.wsgi:app``, ``pasto worker``) runs exactly as
in production: its own interpreter, configured only by ``PASTO_DATABASE_URL``, ``PASTO_ADMIN_TOKEN``
and ``PASTO_SCHEDULER_INTERVAL``, against a database migrated beforehand. Each one is the leader of
its own process group (gunicorn's master and its workers share it), so ``kill -9`` of a group is a
crash of the whole server, and the fixture's finaliser kills every group it started, whatever
happened in the test. Logs go to files in the test's ``tmp_path``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
import sqlalchemy as sa

import migrations
from tests.migrated import upgrade_to_head
from service.db import make_engine
from tests.service.conftest import ADMIN_TOKEN
from bench.pgcluster import free_port

PYTHON = sys.executable
#: How long a starting process may take to answer /healthz (interpreter start, imports, migrations check).
START_SECONDS = 60.0


def all_threads_stopped(group: int) -> bool:
    """Whether every thread of every process in process group ``group`` is stopped (state ``T`` in
    ``/proc/<pid>/task/<tid>/stat``), or the group has no process left."""
    for stat in Path("/proc").glob("[0-9]*/task/[0-9]*/stat"):
        with contextlib.suppress(OSError):  # the thread or process ended meanwhile
            # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after its ")".
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == group and fields[0] not in ("T", "t", "Z", "X"):
                return False
    return True


@dataclass
class ServiceProcess:
    """One service process (and its children) in a process group of its own."""

    label: str
    command: list[str]
    env: dict[str, str]
    log_path: Path
    port: int | None = None
    access_log: Path | None = None  # gunicorn only
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        assert self.port is not None, f"{self.label} serves no HTTP"
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> ServiceProcess:
        with open(self.log_path, "ab") as log:
            log.write(f"--- start: {' '.join(self.command)}\n".encode())
            log.flush()
            # start_new_session: the process leads a new process group, so a signal to the group
            # reaches gunicorn's workers too, and nothing of ours is left behind.
            self.process = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_healthy(self, deadline_seconds: float = START_SECONDS) -> None:
        """Block until ``GET /healthz`` answers 200 (schema current, database reachable)."""
        # Hang guard, not a tolerance: START_SECONDS (60) is ~20x a start on a loaded machine (interpreter,
        # imports, schema check).
        deadline = time.monotonic() + deadline_seconds
        while True:
            if not self.running():
                raise RuntimeError(f"{self.label} exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            with contextlib.suppress(requests.RequestException):  # not listening yet: try again
                if requests.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.label} did not become healthy in {deadline_seconds} s:\n"
                                   f"{self.log()[-4000:]}")
            time.sleep(0.1)

    def wait_for_log(self, text: str, *, count: int = 1, deadline_seconds: float = START_SECONDS) -> None:
        """Block until ``text`` appears ``count`` times in the process's log."""
        # Hang guard, not a tolerance: START_SECONDS (60) is ~20x a start on a loaded machine.
        deadline = time.monotonic() + deadline_seconds
        while self.log().count(text) < count:
            if not self.running():
                raise RuntimeError(f"{self.label} exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.label} logged {text!r} {self.log().count(text)} of {count} times in "
                                   f"{deadline_seconds} s:\n{self.log()[-4000:]}")
            time.sleep(0.1)

    def wait_scheduling(self, deadline_seconds: float = START_SECONDS) -> None:
        """Block until ``pasto worker`` has logged that its scheduler runs."""
        self.wait_for_log("pasto worker: closing due rounds", deadline_seconds=deadline_seconds)

    def signal_group(self, signum: int) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):  # the group has already exited
            os.killpg(self.process.pid, signum)

    def kill9(self) -> None:
        """Crash: SIGKILL to the whole process group, no cleanup of any kind runs."""
        if self.process is None:
            return
        self.signal_group(signal.SIGKILL)
        self.process.wait(timeout=30)

    def freeze(self) -> None:
        """SIGSTOP the group: every thread stops where it is (open transactions stay open). Returns once
        the kernel reports every thread of the group stopped: SIGSTOP is delivered asynchronously, and a
        thread still running after kill() returned could commit what the test means to catch open."""
        self.signal_group(signal.SIGSTOP)
        if self.process is None:
            return
        # A hang guard only: stopping takes microseconds; 10 s covers a 2-core machine under load.
        deadline = time.monotonic() + 10
        while not all_threads_stopped(self.process.pid):
            assert time.monotonic() < deadline, f"{self.label} did not stop within 10 s of SIGSTOP"
            time.sleep(0.001)

    def thaw(self) -> None:
        self.signal_group(signal.SIGCONT)

    def stop(self, timeout: float = 20.0) -> int | None:
        """Orderly shutdown (SIGTERM), SIGKILL if that takes longer than ``timeout``."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.signal_group(signal.SIGCONT)  # a frozen process cannot handle SIGTERM
            self.signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill9()
        # Children (gunicorn workers) that outlived their master would keep the port and connections.
        self.signal_group(signal.SIGKILL)
        return self.process.returncode


class ServiceProcesses:
    """Starts service processes for one test; :meth:`cleanup` ends every one of them."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[ServiceProcess] = []

    def _env(self, database_url: str, scheduler_interval: float) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith("PASTO_")}
        env.update({
            "PASTO_DATABASE_URL": database_url,
            "PASTO_ADMIN_TOKEN": ADMIN_TOKEN,
            "PASTO_SCHEDULER_INTERVAL": str(scheduler_interval),
            "PYTHONUNBUFFERED": "1",
        })
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        return env

    def _launch(self, label: str, command: list[str], database_url: str, scheduler_interval: float,
                port: int | None, access_log: Path | None = None,
                settings: dict[str, str] | None = None) -> ServiceProcess:
        count = sum(1 for process in self.started if process.label == label)
        log_path = self.log_dir / f"{label}-{count}.log"
        env = {**self._env(database_url, scheduler_interval), **(settings or {})}
        process = ServiceProcess(label, command, env, log_path, port, access_log)
        self.started.append(process)
        process.start()
        return process

    def serve(self, database_url: str, *, threads: int = 8, scheduler: bool = False,
              scheduler_interval: float = 0.2, wait: bool = True,
              settings: dict[str, str] | None = None) -> ServiceProcess:
        """``pasto serve`` (waitress with ``threads`` threads), healthy when returned (if ``wait``);
        ``settings``: more environment variables (``PASTO_*`` settings)."""
        port = free_port()
        command = [PYTHON, "-m", "pasto.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                   "--threads", str(threads)]
        if not scheduler:
            command.append("--no-scheduler")
        process = self._launch("serve", command, database_url, scheduler_interval, port, settings=settings)
        if wait:
            process.wait_healthy()
        return process

    def gunicorn(self, database_url: str, *, workers: int = 4, wait: bool = True, timeout: int = 30,
                 settings: dict[str, str] | None = None) -> ServiceProcess:
        """``gunicorn -c python:service.gunicorn_conf -w N -b 127.0.0.1:PORT service.wsgi:app`` (the documented
        command line), healthy when returned (if ``wait``).

        The access log records the pid of the worker that served each request (``%(p)s``), so a
        test can tell which of the N workers answered what, and the time the worker spent on it in
        microseconds (``%(D)s``), so a slow answer shows whether the server or the client waited.
        """
        port = free_port()
        access_log = self.log_dir / f"gunicorn-access-{len(self.started)}.log"
        command = [PYTHON, "-m", "gunicorn", "-c", "python:service.gunicorn_conf", "-w", str(workers),
                   "-b", f"127.0.0.1:{port}",
                   "--access-logfile", str(access_log),
                   "--access-logformat", "%(p)s %(m)s %(U)s %(q)s %(s)s %(D)s",
                   "--graceful-timeout", "5", "--timeout", str(timeout), "service.wsgi:app"]
        process = self._launch("gunicorn", command, database_url, 1.0, port, access_log, settings)
        if wait:
            process.wait_healthy()
            # One worker answers /healthz while the others may still be importing the application; a
            # test that then stops the database would see a worker boot into the outage.
            process.wait_for_log("Worker ready (pid:", count=workers)
        return process

    def worker(self, database_url: str, *, scheduler_interval: float = 0.2, wait: bool = True) -> ServiceProcess:
        """``pasto worker`` (the round scheduler alone); its scheduler started when returned (if ``wait``)."""
        process = self._launch("worker", [PYTHON, "-m", "pasto.cli", "worker"], database_url,
                               scheduler_interval, None)
        if wait:
            process.wait_scheduling()
        return process

    def cleanup(self) -> None:
        for process in reversed(self.started):
            try:
                process.stop(timeout=10)
            except Exception:  # keep going: every other process must still be ended
                process.signal_group(signal.SIGKILL)


@pytest.fixture
def service_processes(tmp_path) -> Iterator[ServiceProcesses]:
    """Start `pasto serve`, gunicorn and `pasto worker` processes; all are killed after the test."""
    processes = ServiceProcesses(tmp_path)
    try:
        yield processes
    finally:
        processes.cleanup()


@pytest.fixture
def migrated_sqlite(tmp_path) -> str:
    """A fresh SQLite database in the test's folder, migrated to the newest schema."""
    url = f"sqlite:///{tmp_path / 'pasto.sqlite'}"
    upgrade_to_head(url)
    return url


@pytest.fixture
def migrated_postgres(postgres_url) -> str:
    """A fresh PostgreSQL database (tests/conftest.py's private cluster), migrated to the newest schema."""
    migrations.upgrade(postgres_url)
    return postgres_url


@pytest.fixture
def inspect_engine() -> Iterator:
    """``inspect_engine(url)``: an engine of the test's own for looking at the database; disposed after."""
    engines: list[sa.Engine] = []

    def create(url: str) -> sa.Engine:
        engine = make_engine(url)
        engines.append(engine)
        return engine

    yield create
    for engine in engines:
        engine.dispose()
