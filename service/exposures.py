"""The service's exposure log: one record per unit that ``POST .../assign`` assigns.

Enabled by ``PASTO_EXPOSURE_LOG``, a file path ending in ``.jsonl`` or ``.parquet``. The records have
the client's schema (:data:`pasto_client.exposure.EXPOSURE_COLUMNS`, docs/client.md "Exposure log"):
``LocalAssigner`` and the server write the same rows for the same assignment.

The request only appends ``(unit, context, time)`` to an in-memory queue (no I/O, no lock); each
process writes its queue from its own thread, through the client's
:class:`~pasto_client.exposure.ExposureLog`, which also sets the policies (a full queue drops and
counts, a failing sink is logged and counted; assignment is never refused because of the log):

- ``.jsonl``: every process appends to the one file; each batch is one ``write`` of whole lines to
  a file opened in append mode, so batches from several processes never interleave within a line.
- ``.parquet``: a Parquet file has one writer, so each process writes ``<stem>.<pid>.parquet`` next to
  the configured path; a file is readable once its process has exited cleanly.

A process writes what is queued when it exits through the interpreter's normal exit (``atexit``:
``pasto serve`` does on SIGTERM); one killed outright loses at most its queue.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from flask import Flask, current_app

from pasto_client.exposure import (
    ExposureContext,
    ExposureLog,
    JsonLinesSink,
    ParquetSink,
    exposure_contexts,
)

from .cache import Snapshot
from .config import ConfigurationError

logger = logging.getLogger(__name__)
_EXTENSION = "pasto_exposures"
SUFFIXES = (".jsonl", ".parquet")
#: Seconds before a process retries opening an exposure file it could not open.
REOPEN_SECONDS = 10.0


class ExposureRecorder:
    """The exposure log of each process of the service, made on first use in that process (a log
    made before gunicorn forks its workers would have no writer thread in them)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()  # serialises making the log, never taken per exposure
        self._pid: int | None = None
        self._log: ExposureLog | None = None
        self._reopen_at = 0.0  # monotonic time before which a failed open is not retried
        # experiment id -> (version, contexts): the contexts of the snapshot served, rebuilt once per
        # version (a dict item assignment is atomic, so request threads need no lock).
        self._contexts: dict[int, tuple[int, tuple[ExposureContext, ...]]] = {}

    @property
    def log(self) -> ExposureLog | None:
        """This process's exposure log; None while its file cannot be opened (logged as an error,
        retried every ``REOPEN_SECONDS``): assignment is served without it meanwhile."""
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid() and time.monotonic() >= self._reopen_at:
                    try:
                        sink = self._make_sink()
                    except (OSError, ImportError) as error:
                        self._reopen_at = time.monotonic() + REOPEN_SECONDS
                        logger.error("Cannot open the exposure log %s (%s); assignments are served without "
                                     "exposures, retrying in %.0f s.", self.path, error, REOPEN_SECONDS)
                        return None
                    self._log = ExposureLog(sink, name=f"server-{os.getpid()}")
                    self._contexts = {}
                    self._pid = os.getpid()
        return self._log if self._pid == os.getpid() else None

    def _make_sink(self):
        if self.path.suffix == ".jsonl":
            return JsonLinesSink(self.path)
        return ParquetSink(self.path.with_name(f"{self.path.stem}.{os.getpid()}.parquet"))

    def contexts(self, snapshot: Snapshot) -> tuple[ExposureContext, ...]:
        """The exposure contexts of the arms of ``snapshot``, shape (K,), built once per version."""
        cached = self._contexts.get(snapshot.id)
        if cached is not None and cached[0] == snapshot.version:
            return cached[1]
        # The mixture version is the experiment's updated_at exactly as GET .../experiments/<name>
        # shows it (routes/experiments.py iso()), so that server and LocalAssigner rows agree.
        mixture_version = snapshot.updated_at.isoformat().replace("+00:00", "Z")
        contexts = exposure_contexts(snapshot.name, snapshot.round_index, snapshot.arm_names,
                                     snapshot.serving.tolist(), mixture_version)
        self._contexts[snapshot.id] = (snapshot.version, contexts)
        return contexts

    def segment_contexts(self, snapshot: Snapshot) -> dict[str, tuple[ExposureContext, ...]]:
        """Segmented experiments: per segment name, the exposure contexts of its mixture (K,), built once
        per version."""
        key = -1 - snapshot.id  # beside contexts()'s keys, never equal to one
        cached = self._contexts.get(key)
        if cached is not None and cached[0] == snapshot.version:
            return cached[1]
        mixture_version = snapshot.updated_at.isoformat().replace("+00:00", "Z")
        contexts = {name: exposure_contexts(snapshot.name, snapshot.round_index, snapshot.arm_names,
                                            snapshot.segment_serving[position].tolist(), mixture_version, segment=name)
                    for position, name in enumerate(snapshot.segment_names)}
        self._contexts[key] = (snapshot.version, contexts)
        return contexts

    def record(self, snapshot: Snapshot, units: Sequence[str], arms: Sequence[int] | np.ndarray,
               segments: Sequence[str] | None = None) -> None:
        """Queue the exposures of ``units``, assigned to the arm positions ``arms`` (shape (N,))
        from ``snapshot`` (segmented: from the mixtures of their ``segments``); one clock read for them all."""
        log = self.log
        if log is None:
            return
        positions = arms.tolist() if isinstance(arms, np.ndarray) else arms
        if segments is not None:
            by_segment = self.segment_contexts(snapshot)
            # An open set's value without a mixture of its own (or no value) was served the long tail's.
            tail = by_segment[snapshot.segment_names[0]]
            log.record_many(units, [by_segment.get(segment, tail)[arm] for segment, arm in zip(segments, positions)])
            return
        contexts = self.contexts(snapshot)
        if len(units) == 1:
            log.record(units[0], contexts[positions[0]])
        else:
            log.record_many(units, [contexts[arm] for arm in positions])


def check_setting(value: str) -> None:
    """Raise :class:`ConfigurationError` unless ``value`` is a usable ``PASTO_EXPOSURE_LOG``."""
    path = Path(value)
    if path.suffix not in SUFFIXES:
        raise ConfigurationError(
            f"PASTO_EXPOSURE_LOG must end in .jsonl or .parquet (the format), got {value!r}."
        )
    if not path.parent.is_dir():
        raise ConfigurationError(
            f"PASTO_EXPOSURE_LOG is {value!r}, but its directory {str(path.parent)!r} does not exist."
        )
    if path.suffix == ".parquet" and importlib.util.find_spec("pyarrow") is None:
        raise ConfigurationError(
            "PASTO_EXPOSURE_LOG names a Parquet file, which needs pyarrow, the 'parquet' extra: "
            "pip install 'pasto[service,parquet]'."
        )


def init_app(app: Flask) -> None:
    value = app.config.get("PASTO_EXPOSURE_LOG")
    if value:
        check_setting(value)
        app.extensions[_EXTENSION] = ExposureRecorder(value)


def get_exposures(app: Flask | None = None) -> ExposureRecorder | None:
    """The app's exposure recorder, or None when ``PASTO_EXPOSURE_LOG`` is not set."""
    return (app or current_app).extensions.get(_EXTENSION)

