"""The exposure log: one record per assignment, written to a pluggable sink off the assignment path.

An exposure says which arm a unit was served, in which round, with which propensity, from which
mixture, and when. Its columns (:data:`EXPOSURE_COLUMNS`) are the exposure table a warehouse-side
aggregation reads (unit, experiment, round or timestamp, arm), so a team can land the files as they
are. docs/client.md ("Exposure log") documents the schema and the policies.

The assignment path only appends ``(unit, context, time_ns)`` to the bounded queue of a
:class:`~pasto_client.batching.BatchQueue` (the observation buffer's); its background thread turns
batches into records and hands them to the sink: :class:`CallbackSink`, :class:`JsonLinesSink` or
:class:`ParquetSink` (needs the ``parquet`` extra: pyarrow), or any object with ``write(batch)`` and
``close()``.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from json.encoder import encode_basestring_ascii
from operator import attrgetter, itemgetter
from os import PathLike
from typing import Any, Protocol, runtime_checkable

import numpy as np

from pasto_client.batching import BatchQueue

logger = logging.getLogger(__name__)

#: The exposure schema: (column, type, meaning). The timestamp has millisecond precision: JSON lines
#: carry it as an ISO 8601 string in UTC (``2026-11-23T22:15:19.538Z``), Parquet as
#: ``timestamp[ms, tz=UTC]``.
EXPOSURE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("unit", "string", "the unit id given to assign"),
    ("experiment", "string", "the experiment's name"),
    ("round", "int64", "the round index the assignment belongs to"),
    ("arm", "string", "the assigned arm's name"),
    ("arm_index", "int64", "the arm's position in the experiment's arm list (0-based)"),
    ("probability", "float64", "the propensity the arm was drawn with (its mixture weight)"),
    ("mixture_version", "string", "the experiment's updated_at of the state served (null if unknown)"),
    ("segment", "string", "segmented experiments: the unit's segment, whose mixture served it (else null)"),
    ("timestamp", "timestamp (UTC, milliseconds)", "when the unit was assigned"),
)
COLUMN_NAMES: tuple[str, ...] = tuple(name for name, _, _ in EXPOSURE_COLUMNS)

#: Seconds an exposure log that was never closed may spend writing its queue at exit.
EXIT_FLUSH_SECONDS = 10.0
#: Minimum seconds between two warnings about dropped exposures.
DROP_WARNING_INTERVAL = 10.0

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_serials = itertools.count()  # next() on it is atomic: contexts made by several threads stay unique
_time_ns = time.time_ns


@dataclass(frozen=True, slots=True)
class ExposureContext:
    """What every exposure of one arm of one served mixture shares; built once per arm when a mixture
    is fetched, so that logging an exposure costs a tuple, not a record.

    Attributes
    ----------
    experiment : str
    round : int
    arm : str
    arm_index : int
    probability : float
    mixture_version : str or None
    segment : str or None
    json_middle : str
        What a JSON line holds between the unit and the timestamp's value
        (``,"experiment":...,"mixture_version":...,"timestamp":"``), precomputed for
        :meth:`ExposureBatch.json_lines`.
    serial : int
        Unique among the contexts of this process (columnar sinks group entries by it).
    """

    experiment: str
    round: int
    arm: str
    arm_index: int
    probability: float
    mixture_version: str | None
    segment: str | None
    json_middle: str
    serial: int


def exposure_contexts(
    experiment: str,
    round_index: int,
    arms: Sequence[str],
    mixture: Sequence[float],
    mixture_version: str | None,
    segment: str | None = None,
) -> tuple[ExposureContext, ...]:
    """One :class:`ExposureContext` per arm of the mixture being served.

    Parameters
    ----------
    experiment : str
    round_index : int
    arms : sequence of str, shape (K,)
    mixture : sequence of float, shape (K,)
        The probabilities the arms are drawn with.
    mixture_version : str or None
        What identifies the served state (the experiment's ``updated_at``).
    segment : str or None
        Segmented experiments: the segment this mixture is served to.
    """
    return tuple(
        exposure_context(experiment, round_index, arm, index, probability, mixture_version, segment)
        for index, (arm, probability) in enumerate(zip(arms, mixture, strict=True))
    )


def exposure_context(
    experiment: str,
    round_index: int,
    arm: str,
    arm_index: int,
    probability: float,
    mixture_version: str | None,
    segment: str | None = None,
) -> ExposureContext:
    """The :class:`ExposureContext` of one arm (position ``arm_index``) of the mixture being served;
    see :func:`exposure_contexts`."""
    fields = {
        "experiment": experiment,
        "round": int(round_index),
        "arm": arm,
        "arm_index": int(arm_index),
        "probability": float(probability),
        "mixture_version": mixture_version,
        "segment": segment,
    }
    members = json.dumps(fields, separators=(",", ":"))[1:-1]
    return ExposureContext(**fields, json_middle=f',{members},"timestamp":"', serial=next(_serials))


class ExposureBatch:
    """Exposures handed to a sink in one call, in assignment order.

    ``entries`` are ``(unit, ExposureContext, time_ns)`` tuples (``time_ns``: nanoseconds since the
    epoch, UTC); :meth:`records`, :meth:`json_lines` and :meth:`columns` give them in the
    documented schema.
    """

    __slots__ = ("entries",)

    def __init__(self, entries: list[tuple[str, ExposureContext, int]]) -> None:
        self.entries = entries

    def __len__(self) -> int:
        return len(self.entries)

    def records(self) -> list[dict[str, Any]]:
        """One dict per exposure, keys as :data:`COLUMN_NAMES`; ``timestamp`` is an aware UTC
        datetime (milliseconds)."""
        return [
            {
                "unit": unit,
                "experiment": c.experiment,
                "round": c.round,
                "arm": c.arm,
                "arm_index": c.arm_index,
                "probability": c.probability,
                "mixture_version": c.mixture_version,
                "segment": c.segment,
                "timestamp": _EPOCH + timedelta(milliseconds=ns // 1_000_000),
            }
            for unit, c, ns in self.entries
        ]

    def json_lines(self) -> str:
        """The batch as JSON lines: one object per line, members in schema order, ASCII only."""
        if not self.entries:
            return ""
        units, contexts, times = _unzip(self.entries)
        # Built column by column with C-level map/slice assignments and one join: the writer thread
        # shares the interpreter lock with the assigning threads, so its cost per record is taken
        # from the assignment rate (bench/client.py measures the result).
        parts = [_LINE_BREAK] * (4 * len(units))
        parts[0::4] = map(encode_basestring_ascii, units)
        parts[1::4] = map(_json_middle, contexts)
        parts[2::4] = _iso_milliseconds(times)
        parts[0] = _LINE_START + parts[0]
        parts[-1] = _LINE_END
        return "".join(parts)  # one copy of the batch's text, not three

    def columns(self) -> dict[str, Any]:
        """The batch column by column, keys as :data:`COLUMN_NAMES`: ``unit`` a list of str, the
        other columns numpy arrays (object arrays for strings), ``timestamp`` int64 milliseconds
        since the epoch, UTC. All of length ``len(self)``."""
        units, distinct, indices, milliseconds = self.indexed()

        def gather(field: str, dtype: Any) -> np.ndarray:
            return np.array([getattr(c, field) for c in distinct], dtype=dtype)[indices]

        return {
            "unit": units,
            "experiment": gather("experiment", object),
            "round": gather("round", np.int64),
            "arm": gather("arm", object),
            "arm_index": gather("arm_index", np.int64),
            "probability": gather("probability", np.float64),
            "mixture_version": gather("mixture_version", object),
            "segment": gather("segment", object),
            "timestamp": milliseconds,
        }

    def indexed(self) -> tuple[list[str], list[ExposureContext], np.ndarray, np.ndarray]:
        """The batch as ``(units, distinct_contexts, indices, milliseconds)``: entry ``i`` is unit
        ``units[i]`` with context ``distinct_contexts[indices[i]]`` at ``milliseconds[i]`` (int64,
        since the epoch, UTC). A batch holds few distinct contexts (one per arm and served mixture),
        so a columnar sink gathers the context columns from them instead of reading every entry."""
        entries = self.entries
        serials = np.fromiter(map(_serial, map(_second, entries)), np.int64, len(entries))
        _, first, indices = np.unique(serials, return_index=True, return_inverse=True)
        distinct = [entries[i][1] for i in first.tolist()]
        times = np.fromiter(map(_third, entries), np.int64, len(entries))
        return list(map(_first, entries)), distinct, indices.ravel(), times // 1_000_000


def _unzip(entries: list[tuple[str, ExposureContext, int]]) -> tuple[list, list, list]:
    """Units, contexts and times of ``entries`` as three lists (C-level maps: zip(*entries) passes
    every entry as an argument and is about twice as slow)."""
    return (list(map(_first, entries)), list(map(_second, entries)), list(map(_third, entries)))


_first, _second, _third = itemgetter(0), itemgetter(1), itemgetter(2)
_serial = attrgetter("serial")
_LINE_START = '{"unit":'
_LINE_END = '"}\n'
_LINE_BREAK = _LINE_END + _LINE_START
_json_middle = attrgetter("json_middle")


def _iso_milliseconds(times_ns: Sequence[int]) -> list[str]:
    """ISO 8601 UTC strings (``...T22:15:19.538Z``) of nanosecond epoch times, formatted once per
    distinct millisecond."""
    milliseconds = np.array(times_ns, dtype=np.int64) // 1_000_000
    distinct, inverse = np.unique(milliseconds, return_inverse=True)
    text = np.char.add(np.datetime_as_string(distinct.astype("datetime64[ms]"), unit="ms"), "Z")
    return text.astype(object)[inverse].tolist()


@runtime_checkable
class ExposureSink(Protocol):
    """Where exposures go: ``write`` is called from the exposure log's background thread only, one
    batch at a time; ``close`` once, after the last ``write``."""

    def write(self, batch: ExposureBatch) -> None: ...

    def close(self) -> None: ...


class CallbackSink:
    """Calls ``callback(records)`` with each batch as a list of dicts (:meth:`ExposureBatch.records`),
    e.g. to produce them to a Kafka topic. The callback runs on the exposure log's thread; an
    exception it raises is reported as a failed batch."""

    def __init__(self, callback: Callable[[list[dict[str, Any]]], None]) -> None:
        if not callable(callback):
            raise TypeError(f"The callback must be callable, got {type(callback).__name__}.")
        self.callback = callback

    def write(self, batch: ExposureBatch) -> None:
        self.callback(batch.records())

    def close(self) -> None:
        pass


class JsonLinesSink:
    """Appends each batch to a UTF-8 JSON-lines file (one exposure per line, schema order) and
    flushes it to the operating system after every batch, so a reader sees whole batches.

    The file is opened (created if missing) when the sink is made, so a wrong path fails there,
    not in the background.
    """

    def __init__(self, path: str | PathLike[str]) -> None:
        self.path = path
        self._file = open(path, "a", encoding="utf-8")

    def write(self, batch: ExposureBatch) -> None:
        self._file.write(batch.json_lines())
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def arrow_schema(pa: Any) -> Any:
    """The exposure schema as a ``pyarrow.Schema`` (``pa`` is the pyarrow module)."""
    return pa.schema([
        pa.field("unit", pa.string(), nullable=False),
        pa.field("experiment", pa.string(), nullable=False),
        pa.field("round", pa.int64(), nullable=False),
        pa.field("arm", pa.string(), nullable=False),
        pa.field("arm_index", pa.int64(), nullable=False),
        pa.field("probability", pa.float64(), nullable=False),
        pa.field("mixture_version", pa.string()),
        pa.field("segment", pa.string()),
        pa.field("timestamp", pa.timestamp("ms", tz="UTC"), nullable=False),
    ])


class ParquetSink:
    """Writes the exposures to a Parquet file, one row group per batch (needs the ``parquet``
    extra: ``pip install 'pasto[parquet]'``, i.e. pyarrow).

    Parquet keeps its index in a footer written by :meth:`close`: the file is readable once the
    sink is closed (a clean close of the assigner or exposure log, or at interpreter exit). The
    file is created, and replaced if it exists, when the sink is made.

    Parameters
    ----------
    path : str or path-like
    compression : str
        Parquet codec (``"zstd"``, ``"snappy"``, ``"gzip"``, ``"none"``...).
    """

    def __init__(self, path: str | PathLike[str], compression: str = "zstd") -> None:
        try:
            # pyarrow is an optional extra: the client's base install is numpy, scipy and requests.
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError as error:
            raise ImportError(
                "ParquetSink needs pyarrow, which is the client's optional 'parquet' extra: install "
                "it with pip install 'pasto[parquet]' (or pip install pyarrow)."
            ) from error
        self.path = path
        self._pa = pa
        self._schema = arrow_schema(pa)
        # Units are nearly all distinct: a dictionary page for them would cost time and save nothing.
        dictionary_columns = [name for name in self._schema.names if name != "unit"]
        self._writer = pq.ParquetWriter(
            path, self._schema, compression=compression, use_dictionary=dictionary_columns
        )

    def write(self, batch: ExposureBatch) -> None:
        pa = self._pa
        units, distinct, indices, milliseconds = batch.indexed()
        positions = pa.array(indices, type=pa.int64())
        arrays = []
        for field in self._schema:
            if field.name == "unit":
                arrays.append(pa.array(units, type=field.type))
            elif field.name == "timestamp":
                arrays.append(pa.array(milliseconds, type=field.type))
            else:  # gathered in C++ from the few distinct contexts
                values = pa.array([getattr(c, field.name) for c in distinct], type=field.type)
                arrays.append(values.take(positions))
        self._writer.write_table(pa.Table.from_arrays(arrays, schema=self._schema))

    def close(self) -> None:
        self._writer.close()


def as_sink(sink: Any) -> ExposureSink:
    """``sink`` itself if it has ``write`` and ``close``, a :class:`CallbackSink` around a plain
    callable."""
    if isinstance(sink, ExposureSink):
        return sink
    if callable(sink):
        return CallbackSink(sink)
    raise TypeError(
        "An exposure sink must have write(batch) and close() methods (CallbackSink, JsonLinesSink, "
        f"ParquetSink) or be a callable taking a list of records, got {type(sink).__name__}."
    )


class ExposureLog:
    """A bounded queue of exposures written to ``sink`` in batches by a background thread.

    Producers (``LocalAssigner``) only append to the queue; the thread writes a batch when
    ``max_batch`` exposures are queued, ``flush_interval`` seconds after the oldest was queued, and
    on :meth:`flush` and :meth:`close`. :meth:`close` (or interpreter exit, if it was never called)
    writes everything queued, then closes the sink.

    Policies, chosen so that logging can never break or slow down assignment:

    - **Queue full** (the sink does not keep up, ``max_queue`` exposures pending), or log closed:
      the exposure is dropped and counted in :attr:`dropped`, with a warning on the
      ``pasto_client.exposure`` logger at most every 10 s. Assignment never blocks on the sink.
    - **Sink failure** (``write`` raises): the batch is counted in :attr:`failed` and logged as an
      error; it goes to ``on_error(error, batch)`` if given, otherwise the first such error is raised
      from the next :meth:`flush` or :meth:`close`. It is not retried (a partial write would be
      duplicated). Assignment goes on.

    Parameters
    ----------
    sink : ExposureSink or callable(list[dict])
    max_batch : int
        Exposures per ``write``.
    flush_interval : float
        Maximum seconds an exposure waits before it is written.
    max_queue : int
        Maximum exposures pending (about 200 bytes each while queued).
    on_error : callable(Exception, ExposureBatch), optional
    name : str
        Names the thread and the log messages (the experiment's name, usually).
    """

    def __init__(
        self,
        sink: ExposureSink | Callable[[list[dict[str, Any]]], None],
        max_batch: int = 10_000,
        flush_interval: float = 1.0,
        max_queue: int = 1_000_000,
        on_error: Callable[[Exception, ExposureBatch], None] | None = None,
        name: str = "exposures",
    ) -> None:
        self.sink = as_sink(sink)
        self.on_error = on_error
        self.name = name
        # Written by the writer thread only.
        self.written = 0
        self.failed = 0
        self._dropped = 0
        self._last_drop_warning = float("-inf")
        self._lock = threading.Lock()  # guards _dropped and _pending_error, never held while writing
        self._pending_error: Exception | None = None
        self._batches = BatchQueue(
            self._write, f"pasto-exposures-{name}", max_batch, flush_interval, max_queue
        )
        #: Queue one ``(unit, ExposureContext, time_ns)`` entry; False if it was refused (then call
        #: :meth:`refused`). The bound method itself, so the assignment path pays one call.
        self.put = self._batches.put
        atexit.register(self._close_at_exit)

    # -- producer side -----------------------------------------------------------------------------

    def record(self, unit: str, context: ExposureContext, time_ns: int | None = None) -> bool:
        """Queue the exposure of ``unit`` (now, unless ``time_ns`` is given); False if dropped."""
        entry = (unit, context, _time_ns() if time_ns is None else time_ns)
        if self._batches.put(entry):
            return True
        self.refused(1)
        return False

    def record_many(
        self,
        units: Sequence[str],
        contexts: Sequence[ExposureContext],
        time_ns: int | None = None,
    ) -> int:
        """Queue the exposures of ``units`` (aligned with ``contexts``), all stamped with one time;
        return how many were queued (the rest are dropped and counted)."""
        now = _time_ns() if time_ns is None else time_ns
        entries = list(zip(units, contexts, itertools.repeat(now)))
        queued = self._batches.put_many(entries)
        if queued < len(entries):
            self.refused(len(entries) - queued)
        return queued

    def refused(self, count: int) -> None:
        """Count ``count`` exposures the queue refused as dropped (and warn, at most every 10 s)."""
        now = time.monotonic()
        with self._lock:
            self._dropped += count
            dropped = self._dropped
            warn = now - self._last_drop_warning >= DROP_WARNING_INTERVAL
            if warn:
                self._last_drop_warning = now
        if warn:
            reason = (
                "the exposure log is closed" if self._batches.closing
                else f"{self._batches.max_queue} exposures are already pending (the sink is not keeping up)"
            )
            logger.warning("Dropped exposures of %r because %s; %d dropped so far.",
                           self.name, reason, dropped)

    # -- state -------------------------------------------------------------------------------------

    @property
    def dropped(self) -> int:
        """Exposures refused because the queue was full or the log closed."""
        with self._lock:
            return self._dropped

    @property
    def pending(self) -> int:
        """Exposures queued or being written."""
        return self._batches.pending

    def flush(self, timeout: float | None = None) -> None:
        """Write everything queued so far and wait until the sink has taken it.

        Raises
        ------
        TimeoutError
            If ``timeout`` seconds pass first (writing continues).
        Exception
            The first sink error not handled by ``on_error``.
        """
        unwritten = self._batches.flush(timeout)
        if unwritten:
            raise TimeoutError(
                f"{unwritten} exposures of {self.name!r} are still unwritten after {timeout} s."
            )
        self._raise_pending_error()

    def close(self, timeout: float | None = None) -> None:
        """Write everything queued, then close the sink. Idempotent; later exposures are dropped.

        Raises
        ------
        TimeoutError
            If not everything was written within ``timeout`` seconds (the rest is counted in
            :attr:`dropped`).
        Exception
            The first sink error not handled by ``on_error`` (also if closing the sink fails).
        """
        atexit.unregister(self._close_at_exit)
        if self._batches.closed:
            return
        unwritten = self._batches.close(timeout)
        if unwritten:
            # The writer thread may still be inside sink.write: closing the sink under it is unsafe.
            with self._lock:
                self._dropped += len(unwritten)
            raise TimeoutError(
                f"{len(unwritten)} exposures of {self.name!r} could not be written within "
                f"{timeout} s; the sink is left open."
            )
        try:
            self.sink.close()
        except Exception as error:
            logger.exception("Closing the exposure sink of %r failed.", self.name)
            self._keep_error(error)
        self._raise_pending_error()

    def __enter__(self) -> ExposureLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _close_at_exit(self) -> None:
        try:
            self.close(timeout=EXIT_FLUSH_SECONDS)
        except Exception as error:
            logger.error("Exposures of %r were not all written at exit: %s", self.name, error)

    # -- the writer thread -------------------------------------------------------------------------

    def _write(self, entries: list[tuple[str, ExposureContext, int]]) -> None:
        batch = ExposureBatch(entries)
        try:
            self.sink.write(batch)
        except Exception as error:
            self.failed += len(batch)
            logger.error("The exposure sink of %r failed to write %d exposures: %r",
                         self.name, len(batch), error)
            if self.on_error is not None:
                try:
                    self.on_error(error, batch)
                except Exception:  # a failing callback must not kill the writer thread
                    logger.exception("The on_error callback of the exposure log of %r failed.", self.name)
            else:
                self._keep_error(error)
        else:
            self.written += len(batch)

    def _keep_error(self, error: Exception) -> None:
        with self._lock:
            if self._pending_error is None:
                self._pending_error = error

    def _raise_pending_error(self) -> None:
        with self._lock:
            error, self._pending_error = self._pending_error, None
        if error is not None:
            raise error
