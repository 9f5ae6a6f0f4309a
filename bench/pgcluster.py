"""A private, throwaway PostgreSQL cluster on loopback, for the test suite and the benchmarks.

Used by ``bench/serve.py`` and ``bench/statistics_push.py``, which load this file by path, and by the
test suite (``tests/conftest.py``'s ``postgres_server_url`` fixture; the tests that start servers take
``free_port`` from here too), which imports it as ``bench.pgcluster``: it lives in bench/ because bench/
imports nothing from tests/ (tests/test_layers.py). It imports nothing beyond the standard library. The cluster lives in a temporary folder, listens on 127.0.0.1 only,
trusts local connections, runs without fsync (nothing in it outlives the process that made it) and
is removed by :meth:`Cluster.stop`.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def postgres_bin_dir() -> str | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` with an ``initdb`` (Debian's layout), or None."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return os.path.dirname(candidates[-1]) if candidates else None


class Cluster:
    """A private PostgreSQL cluster in a temporary folder (run as user ``postgres`` when we are root)."""

    #: Off: a commit returns before its WAL is written, so a crash of the server loses the last
    #: acknowledged commits. A test that kills the server itself sets it on (the WAL then reaches the
    #: operating system before the commit returns, which a killed process cannot lose; fsync stays off).
    synchronous_commit = "off"

    def __init__(self, bin_dir: str) -> None:
        self.bin_dir = bin_dir
        self.root = tempfile.mkdtemp(prefix="pasto-pg-")
        self.data_dir = os.path.join(self.root, "data")
        self.port = free_port()
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
        self.start_server()

    def start_server(self) -> None:
        """Start the server of the initialised cluster (again, after a crash: it recovers first)."""
        options = (f"-c listen_addresses=127.0.0.1 -c port={self.port} "
                   f"-c unix_socket_directories={self.root} -c fsync=off "
                   f"-c synchronous_commit={self.synchronous_commit} -c full_page_writes=off -c max_connections=200")
        self._run(os.path.join(self.bin_dir, "pg_ctl"), "-D", self.data_dir, "-o", options,
                  "-l", os.path.join(self.root, "server.log"), "-w", "start")

    def postmaster_pid(self) -> int:
        """The pid of the running server's postmaster (first line of ``postmaster.pid``)."""
        with open(os.path.join(self.data_dir, "postmaster.pid")) as pid_file:
            return int(pid_file.readline())

    def stop(self) -> None:
        try:
            self._run(os.path.join(self.bin_dir, "pg_ctl"), "-D", self.data_dir, "-m", "immediate", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://{self.user}@127.0.0.1:{self.port}/postgres"
