"""Typed SQLAlchemy 2.0 models. Alembic (``migrations/``) is the only way the schema changes.

Hot-path writes never read-modify-write a row: ingestion aggregates into :class:`RoundStatistic`,
:class:`ArmRoundCount` and its sums over the arms :class:`RoundCount` with
``INSERT ... ON CONFLICT DO UPDATE SET count = count + excluded.count``, and idempotency rests on the primary keys of :class:`ObservationId` and :class:`RoundUnit`.

Pooled statistics are kept as running totals, not re-aggregated: :class:`PooledArrays` holds
the sums of every applied round's :class:`RoundStatistic` rows, one row per (segment, metric) with
its K arms' totals as arrays (migration 0018), and :class:`LateStatistic` the observations ingestion
accepted for rounds already applied (late data), which the next round update adds into the totals. A
round update therefore reads one round's rows, the late cells and S x M rows of totals, never the
history (``service.controller.rounds``, ``service.store``). The change detector's snapshots of the
totals (:class:`DetectorSnapshot`) are kept apart from the state and rewritten only when it looks.
"""

from __future__ import annotations

import base64
from datetime import datetime, timezone
from typing import Any

import numpy as np
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class UTCDateTime(sa.types.TypeDecorator):
    """Timezone-aware UTC datetimes on every backend (SQLite stores them naive)."""

    impl = sa.DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("Datetimes stored in the database must be timezone-aware.")
        return value.astimezone(timezone.utc).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=timezone.utc)


class PackedArraysJSON(sa.types.TypeDecorator):
    """A JSON document whose large numeric arrays are stored as float64 (or int64, bool) bytes.

    The controller state holds about (6 + 12 M) x K numbers: at K = 100,000 arms as JSON text that is
    127 MB, and writing and parsing it took longer than the rest of a round close. Here every list
    (at any depth under the document's objects) of at least :data:`PACKED_MIN` numbers of one kind
    is stored as ``{"$packed": dtype, "shape": [...], "data": base64 of the bytes}`` and read back
    as the same nested lists of the same Python numbers (bit for bit: float64 bytes round-trip
    exactly; a list that mixed ints and floats comes back as floats of the same values). Documents
    written as plain JSON read as they are. The column is still JSON: no schema change.
    """

    impl = sa.JSON
    cache_ok = True

    def process_bind_param(self, value: Any, dialect) -> Any:
        return None if value is None else pack_arrays(value)

    def process_result_value(self, value: Any, dialect) -> Any:
        return None if value is None else unpack_arrays(value)


#: Lists of fewer numbers stay JSON lists (readable in the database as they are).
PACKED_MIN = 256
_PACKED_KINDS = (np.dtype(np.float64), np.dtype(np.int64), np.dtype(np.bool_))


def pack_arrays(value: Any) -> Any:
    """``value`` with its large numeric lists packed (see :class:`PackedArraysJSON`). Numpy arrays
    are taken as the lists they hold (packed from their bytes directly: no Python float per entry),
    so ``pack_arrays(a)`` and ``pack_arrays(a.tolist())`` give the same document."""
    if isinstance(value, dict):
        return {key: pack_arrays(item) for key, item in value.items()}
    if isinstance(value, np.ndarray):
        if value.size >= PACKED_MIN and value.dtype in _PACKED_KINDS:
            return _packed(value)
        return pack_arrays(value.tolist())
    if isinstance(value, list) and len(value) > 0 and not isinstance(value[0], (str, dict)):
        try:
            array = np.asarray(value)
        except (ValueError, TypeError, OverflowError):  # ragged, or not numbers
            return value
        if array.size >= PACKED_MIN and array.dtype in _PACKED_KINDS:
            return _packed(array)
        if any(isinstance(item, np.ndarray) for item in value):
            return array.tolist()
    return value


def _packed(array: np.ndarray) -> dict[str, Any]:
    return {"$packed": array.dtype.str, "shape": list(array.shape),
            "data": base64.b64encode(array.tobytes()).decode("ascii")}


def unpack_arrays(value: Any) -> Any:
    """The document :func:`pack_arrays` packed, with its lists back."""
    if isinstance(value, dict):
        if "$packed" in value:
            array = np.frombuffer(base64.b64decode(value["data"]), dtype=np.dtype(value["$packed"]))
            return array.reshape(value["shape"]).tolist()
        return {key: unpack_arrays(item) for key, item in value.items()}
    return value


NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: sa.JSON, list[Any]: sa.JSON, datetime: UTCDateTime}


ROLES = ("metrics", "read", "ingest", "admin")  # each role can do what the ones before it can
STATUSES = ("running", "paused", "stopped")


class Experiment(Base):
    """One experiment: its configuration, status and the learned controller state.

    ``round_index`` is the round being served now. ``applied_rounds`` counts rounds whose update has
    run: rounds ``< applied_rounds`` are final, and rounds in ``[applied_rounds, round_index)`` have
    ended and are waiting ``settle_seconds`` for late data. ``version`` increases with every change
    that affects assignment, so workers know when to refresh their cached copy.
    """

    __tablename__ = "experiments"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(64), unique=True)
    config: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(sa.String(16))
    seed: Mapped[int] = mapped_column(sa.BigInteger)
    round_index: Mapped[int]
    applied_rounds: Mapped[int]
    #: Rounds ``< pruned_rounds`` had their observation ids, units and statistics batch ids deleted
    #: (retention, ``service.controller.retention``): data for them is refused, as it could no longer
    #: be de-duplicated.
    pruned_rounds: Mapped[int] = mapped_column(default=0, server_default="0")
    #: ``pasto.algorithm.ControllerState.to_dict()``, its arrays stored packed (:class:`PackedArraysJSON`).
    state: Mapped[dict[str, Any]] = mapped_column(PackedArraysJSON)
    #: Segmented experiments only: ``pasto.segments.SegmentedState.to_dict()`` (``state`` then holds the
    #: traffic-weighted aggregate that the unsegmented reports read).
    segment_state: Mapped[dict[str, Any] | None] = mapped_column(PackedArraysJSON)
    version: Mapped[int]
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    archived_at: Mapped[datetime | None]  # archived: stopped, and left out of listings and /metrics


class DeletedExperiment(Base):
    """An experiment deleted with all its rows (``DELETE /api/v1/experiments/<name>``). Its id is kept
    so that no id is given out twice (``service.store.create_experiment``; migration 0010)."""

    __tablename__ = "deleted_experiments"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    name: Mapped[str] = mapped_column(sa.String(64))
    deleted_at: Mapped[datetime]


class Arm(Base):
    __tablename__ = "arms"
    __table_args__ = (sa.UniqueConstraint("experiment_id", "name"),)

    experiment_id: Mapped[int] = mapped_column(
        sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True
    )
    position: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    name: Mapped[str] = mapped_column(sa.String(128))
    params: Mapped[dict[str, Any]]


class Round(Base):
    """One round: when it ran, the propensities served, and the summary computed at its update."""

    __tablename__ = "rounds"

    experiment_id: Mapped[int] = mapped_column(
        sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True
    )
    index: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    started_at: Mapped[datetime]
    ends_at: Mapped[datetime]
    closed_at: Mapped[datetime | None]
    applied_at: Mapped[datetime | None]
    probabilities: Mapped[list[Any]]
    #: Segmented experiments only: the S x K propensities served per segment (``probabilities`` is
    #: then their traffic-weighted aggregate).
    segment_probabilities: Mapped[list[Any] | None]
    deployed: Mapped[list[Any] | None]
    summary: Mapped[dict[str, Any] | None]
    #: What the summary is computed from (state and pooled statistics right after the update), written
    #: with the update and cleared with the summary's write: a summary lost to a crash is repaired from it.
    #: The last round a close applies only refers to the experiment's row (``{"from_experiment":
    #: {"applied_rounds": n}}``: its state and running totals are the round's until the next update,
    #: which writes the input in full first if the summary is still missing); other rounds' inputs hold
    #: the state and the pooled statistics, their arrays packed (:class:`PackedArraysJSON`).
    summary_input: Mapped[dict[str, Any] | None] = mapped_column(PackedArraysJSON, deferred=True)


#: What an :class:`ExperimentEvent` records. Nothing can change an experiment's configuration after
#: its creation today, so there is no "configuration changed" kind: status changes are the changes
#: an experiment can go through, and a controller start is the scheduler process (``pasto serve`` or
#: ``pasto worker``) starting, recorded once per start for every experiment it then serves.
EVENT_KINDS = ("created", "paused", "resumed", "stopped", "controller_started")


class ExperimentEvent(Base):
    """Something that happened to an experiment, with the round it happened in (for the time axis).

    ``id`` orders the events and is the cursor of the events endpoint's pages (never reused, so a
    cursor never skips a later event); ``details`` holds what a kind has to add (the scheduler's name
    for ``controller_started``), or None.
    """

    __tablename__ = "experiment_events"
    # AUTOINCREMENT on SQLite: an id is never given out twice, even after the newest events were deleted
    # (migration 0013). PostgreSQL's sequence never goes back.
    __table_args__ = (sa.Index("ix_experiment_events_experiment_id_id", "experiment_id", "id"),
                      {"sqlite_autoincrement": True})

    id: Mapped[int] = mapped_column(primary_key=True)
    experiment_id: Mapped[int] = mapped_column(sa.ForeignKey("experiments.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(sa.String(32))
    round_index: Mapped[int]
    at: Mapped[datetime]
    details: Mapped[dict[str, Any] | None]


class RoundStatistic(Base):
    """Sufficient statistics of one metric for one arm in one segment and round. An unsegmented
    experiment has segment 0 only; a segmented experiment's totals over segments are sums of its rows
    (migration 0017: one set of statistics tables, no summed copy)."""

    __tablename__ = "round_statistics"

    experiment_id: Mapped[int] = mapped_column(
        sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True
    )
    round_index: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    segment_index: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    arm_index: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    metric_index: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    count: Mapped[int] = mapped_column(sa.BigInteger)
    sum: Mapped[float] = mapped_column(sa.Double)
    sum_of_squares: Mapped[float] = mapped_column(sa.Double)


class _ArmMetricTotals:
    """Columns of a table of per-(segment, metric, arm) totals of an experiment: count, sum, sum of
    squares (segment 0 only for an unsegmented experiment)."""

    experiment_id: Mapped[int] = mapped_column(
        sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True
    )
    segment_index: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    metric_index: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    arm_index: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    count: Mapped[int] = mapped_column(sa.BigInteger)
    sum: Mapped[float] = mapped_column(sa.Double)
    sum_of_squares: Mapped[float] = mapped_column(sa.Double)


class PooledArrays(Base):
    """Running totals per segment and metric, for every arm at once: the sums of every
    :class:`RoundStatistic` row of the applied rounds, late data included up to the last update (the
    rest of it waits in :class:`LateStatistic`).

    ``count``, ``sum`` and ``sum_of_squares`` are each K float64 numbers, little-endian, as bytes
    (:data:`ARRAY_DTYPE`; counts are exact integers below 2^53), indexed by arm position. A round close
    reads and rewrites these S x M rows whole and adds in numpy (``service.store``): at K = 100,000 a
    fold into one row per arm was most of the close (migration 0018). A (segment, metric) never
    observed has no row: its totals are zeros.
    """

    __tablename__ = "pooled_arrays"

    experiment_id: Mapped[int] = mapped_column(
        sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True
    )
    segment_index: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    metric_index: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    count: Mapped[bytes] = mapped_column(sa.LargeBinary)
    sum: Mapped[bytes] = mapped_column(sa.LargeBinary)
    sum_of_squares: Mapped[bytes] = mapped_column(sa.LargeBinary)


class DetectorSnapshot(Base):
    """One of the change detector's snapshots of an experiment's pooled statistics
    (:class:`pasto.algorithm.ControllerState`'s ``change_origin`` or ``window_origins``), as the
    state's ``to_dict`` writes it: ``{"counts", "sums", "sums_of_squares"}``, packed.

    Kept out of ``experiments.state`` (migration 0019): they are most of a state's numbers, change
    only when the detector looks, and only a look reads the window origins, so a close reads and
    writes them only then, and nothing else that reads the experiment parses them.
    """

    __tablename__ = "detector_snapshots"

    experiment_id: Mapped[int] = mapped_column(
        sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True
    )
    name: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    document: Mapped[dict[str, Any]] = mapped_column(PackedArraysJSON)


#: The element type of :class:`PooledArrays`' arrays.
ARRAY_DTYPE = np.dtype("<f8")


class LateStatistic(_ArmMetricTotals, Base):
    """Per segment, metric and arm, the statistics of late observations (for rounds whose update
    already ran) accepted since the last update; that update adds them into :class:`PooledArrays`
    and empties this table. Ingestion writes them in the same transaction as their
    :class:`RoundStatistic` rows."""

    __tablename__ = "late_statistics"


class SegmentValueUnit(Base):
    """Open segment sets: a unit seen with a segment value that has no mixture of its own yet; a value
    gets one at a round close once it has ``min_units`` distinct units (its rows are then deleted)."""

    __tablename__ = "segment_value_units"

    experiment_id: Mapped[int] = mapped_column(
        sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True, autoincrement=False
    )
    value: Mapped[str] = mapped_column(
        sa.String(128).with_variant(sa.String(128, collation="C"), "postgresql"), primary_key=True)
    unit: Mapped[str] = mapped_column(
        sa.String(256).with_variant(sa.String(256, collation="C"), "postgresql"), primary_key=True)


class ArmRoundCount(Base):
    """Per round and arm: observations, distinct observed units (for SRM), and late observations."""

    __tablename__ = "arm_round_counts"

    experiment_id: Mapped[int] = mapped_column(
        sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True
    )
    round_index: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    arm_index: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    observations: Mapped[int] = mapped_column(sa.BigInteger)
    units: Mapped[int] = mapped_column(sa.BigInteger)
    late_observations: Mapped[int] = mapped_column(sa.BigInteger)


class RoundCount(Base):
    """Per round: :class:`ArmRoundCount` summed over the arms, kept by every writer of it in the same
    transaction, so a dashboard or scrape read of the per-round totals is one row per round, not a
    GROUP BY over K rows per round (migration 0012)."""

    __tablename__ = "round_counts"

    experiment_id: Mapped[int] = mapped_column(
        sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True
    )
    round_index: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    observations: Mapped[int] = mapped_column(sa.BigInteger)
    units: Mapped[int] = mapped_column(sa.BigInteger)
    late_observations: Mapped[int] = mapped_column(sa.BigInteger)


class SourceCell(Base):
    """What the experiment's metric source last returned for one (round, arm, metric): the part of
    :class:`RoundStatistic` that came from the source (``service.controller.sources``).

    A re-run of a round's query replaces these rows and adds the difference to the round's
    :class:`RoundStatistic` row (and to :class:`LateStatistic` once the round's update has run), so a
    value is counted once however often the round is restated. Unsegmented."""

    __tablename__ = "source_cells"

    experiment_id: Mapped[int] = mapped_column(
        sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True
    )
    round_index: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    arm_index: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    metric_index: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    count: Mapped[int] = mapped_column(sa.BigInteger)
    sum: Mapped[float] = mapped_column(sa.Double)
    sum_of_squares: Mapped[float] = mapped_column(sa.Double)


class SourceUnits(Base):
    """What the metric source last returned per (round, arm): distinct units with an event, and the
    values it counted (sum of the metric counts); the part of :class:`ArmRoundCount` from the source."""

    __tablename__ = "source_units"

    experiment_id: Mapped[int] = mapped_column(
        sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True
    )
    round_index: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    arm_index: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    units: Mapped[int] = mapped_column(sa.BigInteger)
    observations: Mapped[int] = mapped_column(sa.BigInteger)


class SourceStatus(Base):
    """The state of an experiment's metric source.

    ``error`` is the sentence of the failure of the latest attempt (None once one succeeds),
    ``error_since`` when the current run of failures began, ``errors_total`` every failed attempt
    ever (the Prometheus counter ``pasto_source_errors_total``). ``fetch_started_at`` is when the
    query of the newest applied result began: a result from a query that began earlier (another
    scheduler's, slower) is not applied over it."""

    __tablename__ = "source_status"

    experiment_id: Mapped[int] = mapped_column(
        sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True, autoincrement=False
    )
    error: Mapped[str | None] = mapped_column(sa.Text)
    error_since: Mapped[datetime | None]
    last_error_at: Mapped[datetime | None]
    errors_total: Mapped[int] = mapped_column(sa.BigInteger)
    fetch_started_at: Mapped[datetime | None]
    fetched_at: Mapped[datetime | None]


#: Text keys of the per-observation tables: byte order on PostgreSQL (SQLite always compares bytes).
ByteOrderKey = sa.String(256).with_variant(sa.String(256, collation="C"), "postgresql")


class ObservationId(Base):
    """Every observation id ever accepted: the primary key makes ingestion exactly-once.

    No foreign key to ``experiments`` here or in :class:`RoundUnit` (migration 0003): these tables get
    a row per observation, a per-row check would cost a third of each insert, and ingestion already
    holds a share lock on the experiment's row while it writes them.
    """

    __tablename__ = "observation_ids"
    #: Retention deletes the ids of old rounds in bounded chunks, found by round.
    __table_args__ = (sa.Index("ix_observation_ids_round", "experiment_id", "round_index"),)

    experiment_id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    client_id: Mapped[str] = mapped_column(ByteOrderKey, primary_key=True)
    round_index: Mapped[int]
    arm_index: Mapped[int]


class RoundUnit(Base):
    """Units seen with at least one observation in a round (distinct-unit counts for SRM)."""

    __tablename__ = "round_units"

    experiment_id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    round_index: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    unit: Mapped[str] = mapped_column(ByteOrderKey, primary_key=True)
    arm_index: Mapped[int]


class StatisticsBatch(Base):
    """A batch of pre-aggregated statistics applied once (``POST .../statistics``): its id, the SHA-256
    of its content (a resend with the same id must carry the same content), and the rounds it covers,
    so retention can delete it with them. No foreign key, as :class:`ObservationId`: ingestion holds
    the experiment's row lock while it writes."""

    __tablename__ = "statistics_batches"

    experiment_id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    batch_id: Mapped[str] = mapped_column(ByteOrderKey, primary_key=True)
    content_hash: Mapped[str] = mapped_column(sa.String(64))
    first_round: Mapped[int]
    last_round: Mapped[int]
    cells: Mapped[int]
    received_at: Mapped[datetime]


class Token(Base):
    """An API token; only the SHA-256 hex digest of the token is stored. It is refused from
    ``expires_at`` on (if set) and once ``revoked_at`` is set (rows are kept for the record)."""

    __tablename__ = "tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(128))
    role: Mapped[str] = mapped_column(sa.String(16))
    token_hash: Mapped[str] = mapped_column(sa.String(64), unique=True)
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]


class AuthFailure(Base):
    """Invalid bearer tokens sent from one client address in its current throttling window
    (``service.auth``): shared by every worker process, so the limit holds for the whole service."""

    __tablename__ = "auth_failures"

    address: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    window_started_at: Mapped[datetime]
    failures: Mapped[int]


class SchedulerHeartbeat(Base):
    """Last time each scheduler process ran its job, so any web worker can report scheduler health."""

    __tablename__ = "scheduler_heartbeats"

    scheduler: Mapped[str] = mapped_column(sa.String(128), primary_key=True)
    beat_at: Mapped[datetime]


def utcnow() -> datetime:
    """The current time, timezone-aware UTC (what every datetime column holds)."""
    return datetime.now(timezone.utc)
