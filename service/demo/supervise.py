"""The demo's server process and the signals that stop the demo.

``pasto serve`` runs as a child in its own session, so that a terminal's Ctrl-C reaches only the
demo, which stops the server after flushing the traffic it already produced. SIGTERM and SIGHUP (a
closed terminal) stop the demo the same way as Ctrl-C.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pasto_client import Client, PastoAPIError, PastoConnectionError

log = logging.getLogger("pasto.demo")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class StopRequested(BaseException):
    """SIGTERM or SIGHUP arrived: leave the traffic loop and clean up like Ctrl-C.

    A BaseException, like KeyboardInterrupt: the signal handler raises it wherever the main thread
    happens to be, and an ``except Exception`` there (a retry loop, a library) must not swallow the
    one stop request (the handler ignores every later signal).
    """


def _raise_stop(*_: object) -> None:
    # Only the first signal stops the demo: a closing terminal may send SIGHUP more than once, and a
    # second StopRequested raised in the middle of the flush or of stopping the server would cut
    # them short.
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    raise StopRequested()


@contextmanager
def stop_signals_raise() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise :class:`StopRequested`; restored afterwards.

    A closed terminal sends SIGHUP, whose default action would kill the demo before it stops the
    server. A signal ignored on entry stays ignored: under nohup the demo keeps running, as asked.
    """
    previous_handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum, previous in previous_handlers.items():
        if previous is not signal.SIG_IGN:
            signal.signal(signum, _raise_stop)
    try:
        yield
    finally:
        for signum, previous in previous_handlers.items():
            if previous is not None:  # None: set outside Python, which cannot be restored from here
                signal.signal(signum, previous)


def port_in_use(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


#: The demo server's settings unless the environment says otherwise: rounds close within a quarter
#: second of their end, and a round's observation ids and units are kept 15 minutes after its update,
#: not the server's 7 days. The demo sends 600 sessions a second, so 7 days of ids would grow its
#: SQLite file by about 8 GB a day (measured: 225,000 ids, 37 MB and a 53 MB WAL, after 6.5 minutes);
#: 15 minutes bounds the ids at about 540,000 and is still far beyond any retry of the demo's buffer.
SERVER_DEFAULTS = {"PASTO_SCHEDULER_INTERVAL": "0.25", "PASTO_RETENTION_SECONDS": "900"}


class ServerProcess:
    """``pasto serve`` with its scheduler, in its own session.

    Its standard input is a pipe the demo never writes to, and the server runs with
    ``--stop-on-stdin-eof``: if the demo dies without stopping it (SIGKILL, a crash), the kernel
    closes the pipe and the server shuts down instead of holding the port.
    """

    def __init__(self, database_url: str, port: int, log_path: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self.log_path = log_path
        env = {**SERVER_DEFAULTS, **os.environ, "PASTO_DATABASE_URL": database_url}
        with open(log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pasto.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                 "--stop-on-stdin-eof"],
                env=env, stdin=subprocess.PIPE, stdout=log_file, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        log.info("Started pasto serve (pid %d).", self.process.pid)

    def wait_until_ready(self, client: Client, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"pasto serve exited with status {self.process.returncode}:\n"
                                   f"{self._log_tail()}")
            try:
                client.health()
                return
            except PastoAPIError:
                return  # it answers (an unhealthy /healthz is still an answer)
            except PastoConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"pasto serve did not answer within {timeout:.0f} s:\n{self._log_tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process.stdin.close()
        if self.process.returncode != 0:
            log.warning("pasto serve exited with status %s; its log: %s", self.process.returncode, self.log_path)

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return "(no server log)"
