"""Alembic creates the whole schema on SQLite and PostgreSQL, downgrades cleanly, and the app refuses
to start on an un-migrated database."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import numpy as np
import pytest
import sqlalchemy as sa

import migrations
from service import SchemaOutOfDate, create_app
from service.models import Base

EXPECTED_TABLES = {table.name for table in Base.metadata.sorted_tables}
#: The tables below 0018, whose running totals were one row per arm (``pooled_statistics``), not arrays.
TABLES_BEFORE_0018 = EXPECTED_TABLES - {"pooled_arrays", "detector_snapshots"} | {"pooled_statistics"}
#: The per-segment statistics tables of 0009, which 0017 folds into the statistics tables (a
#: ``segment_index`` in their keys): present only between the two.
SEGMENT_STATISTICS_TABLES = {"segment_round_statistics", "segment_pooled_statistics", "segment_late_statistics"}
#: Added by 0009 (per-segment statistics): absent after any downgrade below it.
SEGMENT_TABLES = SEGMENT_STATISTICS_TABLES | {"segment_value_units"}
#: Tables of revisions after 0006 (0007 statistics batches, 0008 metric sources, 0009 segments, 0010 deleted
#: experiments, 0011 experiment events, 0012 round counts): gone whenever the round trip below downgrades to
#: 0006 or earlier.
TABLES_AFTER_0006 = {"statistics_batches", "source_cells", "source_units", "source_status", "deleted_experiments",
                     "experiment_events", "round_counts"} | SEGMENT_TABLES
TABLES_AFTER_0009 = {"deleted_experiments", "experiment_events", "round_counts"}  # 0010, 0011, 0012


#: An experiments row's columns common to every revision these tests insert at, with neutral values.
EXPERIMENT_ROW = {"config": "{}", "status": "running", "seed": 1, "round_index": 0, "applied_rounds": 0,
                  "state": "{}", "version": 1, "created_at": "2026-01-01 00:00:00",
                  "updated_at": "2026-01-01 00:00:00"}


def _insert_experiment_rows(connection, rows) -> None:
    """Insert experiments rows at the revision under test: each row is EXPERIMENT_ROW's columns,
    overridden and extended by its own (only columns that revision has)."""
    for columns in rows:
        row = {**EXPERIMENT_ROW, **columns}
        connection.execute(sa.text(f"INSERT INTO experiments ({', '.join(row)}) "
                                   f"VALUES ({', '.join(':' + column for column in row)})"), row)


def _tables(url: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()




def _check_experiment_lifecycle_round_trip(url: str) -> None:
    """0010: experiments gain archived_at and deleted_experiments appears; the downgrade (to 0009) drops the
    column in place (an archived experiment stays, stopped) without touching the rows that refer
    to the experiment (a rebuilt table's DROP would cascade into them on SQLite)."""
    engine = sa.create_engine(url)
    try:
        assert "archived_at" in [column["name"] for column in sa.inspect(engine).get_columns("experiments")]
        with engine.begin() as connection:
            _insert_experiment_rows(connection, [{"id": 41, "name": "kept", "status": "stopped",
                                                  "created_at": "2026-01-01", "updated_at": "2026-01-01",
                                                  "archived_at": "2026-01-02"}])
            connection.execute(sa.text(
                "INSERT INTO arms (experiment_id, position, name, params) VALUES (41, 0, 'a', '{}')"))
    finally:
        engine.dispose()
    migrations.downgrade(url, "0009")
    engine = sa.create_engine(url)
    try:
        assert _tables(url) == (TABLES_BEFORE_0018 - TABLES_AFTER_0009) | SEGMENT_STATISTICS_TABLES
        assert "archived_at" not in [column["name"] for column in sa.inspect(engine).get_columns("experiments")]
        with engine.begin() as connection:
            assert connection.execute(sa.text("SELECT count(*) FROM arms WHERE experiment_id = 41")).scalar() == 1
            connection.execute(sa.text("DELETE FROM arms"))
            connection.execute(sa.text("DELETE FROM experiments"))
    finally:
        engine.dispose()


def _check_token_lifecycle_round_trip(url: str) -> None:
    """0005: tokens gain expires_at/revoked_at and auth_failures appears; the downgrade deletes the
    revoked and expiring tokens (they would become valid forever) and keeps the others."""
    engine = sa.create_engine(url)
    try:
        columns = [column["name"] for column in sa.inspect(engine).get_columns("tokens")]
        assert columns[-2:] == ["expires_at", "revoked_at"]
        with engine.begin() as connection:
            connection.execute(sa.text(
                "INSERT INTO tokens (name, role, token_hash, created_at, expires_at, revoked_at) VALUES "
                "('kept', 'read', 'a', '2026-01-01', NULL, NULL), ('revoked', 'read', 'b', '2026-01-01', NULL, "
                "'2026-01-02'), ('expiring', 'read', 'c', '2026-01-01', '2027-01-01', NULL)"))
    finally:
        engine.dispose()
    migrations.downgrade(url, "0004")
    engine = sa.create_engine(url)
    try:
        assert _tables(url) == TABLES_BEFORE_0018 - TABLES_AFTER_0006 - {"auth_failures"}
        assert "expires_at" not in [column["name"] for column in sa.inspect(engine).get_columns("tokens")]
        with engine.connect() as connection:
            assert connection.execute(sa.text("SELECT name FROM tokens")).scalars().all() == ["kept"]
            connection.execute(sa.text("DELETE FROM tokens"))
            connection.commit()
    finally:
        engine.dispose()


def _check_round_trip(url: str) -> None:
    migrations.upgrade(url)
    assert _tables(url) == EXPECTED_TABLES
    engine = sa.create_engine(url)
    try:
        assert migrations.current_revision(engine) == migrations.head_revision()
        inspector = sa.inspect(engine)
        assert inspector.get_pk_constraint("observation_ids")["constrained_columns"] == ["experiment_id", "client_id"]
        assert inspector.get_pk_constraint("round_statistics")["constrained_columns"] == [
            "experiment_id", "round_index", "segment_index", "arm_index", "metric_index"]
        _check_late_schema(inspector, segmented=True, arrays=True)
        _check_ingestion_keys(inspector, engine.dialect.name, migrated=True)
        _check_retention_schema(inspector)
    finally:
        engine.dispose()
    _check_experiment_lifecycle_round_trip(url)  # down to 0009
    migrations.downgrade(url, "0006")  # 0007 alone: the batch table, pruned_rounds and the index go
    engine = sa.create_engine(url)
    try:
        inspector = sa.inspect(engine)
        assert _tables(url) == TABLES_BEFORE_0018 - TABLES_AFTER_0006
        assert "pruned_rounds" not in [column["name"] for column in inspector.get_columns("experiments")]
        assert inspector.get_indexes("observation_ids") == []
    finally:
        engine.dispose()
    _check_token_lifecycle_round_trip(url)
    migrations.downgrade(url, "0003")  # 0004 alone: back to folded_* columns and the partial index
    engine = sa.create_engine(url)
    try:
        assert _tables(url) == TABLES_BEFORE_0018 - TABLES_AFTER_0006 - {"auth_failures", "late_statistics"}
        _check_fold_schema(sa.inspect(engine), engine.dialect.name)
    finally:
        engine.dispose()
    migrations.downgrade(url, "0002")  # 0003 alone: the foreign keys and the locale collation come back
    engine = sa.create_engine(url)
    try:
        _check_ingestion_keys(sa.inspect(engine), engine.dialect.name, migrated=False)
    finally:
        engine.dispose()
    migrations.downgrade(url, "0001")  # 0002 alone: the fold's columns, index and table go, the rest stays
    engine = sa.create_engine(url)
    try:
        inspector = sa.inspect(engine)
        assert _tables(url) == TABLES_BEFORE_0018 - TABLES_AFTER_0006 - {"auth_failures", "pooled_statistics",
                                                                      "late_statistics"}
        assert [column["name"] for column in inspector.get_columns("round_statistics")] == [
            "experiment_id", "round_index", "arm_index", "metric_index", "count", "sum", "sum_of_squares"]
        assert inspector.get_indexes("round_statistics") == []
        assert migrations.current_revision(engine) == "0001"
    finally:
        engine.dispose()
    migrations.upgrade(url)
    assert _tables(url) == EXPECTED_TABLES
    migrations.downgrade(url)
    assert _tables(url) == set()
    migrations.upgrade(url)
    assert _tables(url) == EXPECTED_TABLES


def _check_retention_schema(inspector) -> None:
    """Revision 0007: ``statistics_batches`` keyed by (experiment, batch id), ``experiments.pruned_rounds``
    (NOT NULL, default 0) and the index of observation ids by round."""
    assert inspector.get_pk_constraint("statistics_batches")["constrained_columns"] == ["experiment_id", "batch_id"]
    (pruned,) = [column for column in inspector.get_columns("experiments") if column["name"] == "pruned_rounds"]
    assert pruned["nullable"] is False and "0" in str(pruned["default"])
    (index,) = inspector.get_indexes("observation_ids")
    assert index["name"] == "ix_observation_ids_round"
    assert index["column_names"] == ["experiment_id", "round_index"]


def _check_fold_schema(inspector, dialect: str) -> None:
    """Revision 0002: folded_* columns (NOT NULL, default 0), the partial index, pooled_statistics."""
    columns = {column["name"]: column for column in inspector.get_columns("round_statistics")}
    for name in ("folded_count", "folded_sum", "folded_sum_of_squares"):
        assert columns[name]["nullable"] is False and "0" in str(columns[name]["default"]), columns[name]
    (index,) = inspector.get_indexes("round_statistics")
    assert index["name"] == "ix_round_statistics_unfolded"
    assert index["column_names"] == ["experiment_id", "round_index"]
    predicate = str(index["dialect_options"][f"{dialect}_where"]).replace("(", "").replace(")", "")
    assert predicate.lower().replace('"', "") == "count <> folded_count", predicate
    assert inspector.get_pk_constraint("pooled_statistics")["constrained_columns"] == [
        "experiment_id", "metric_index", "arm_index"]
    (foreign_key,) = inspector.get_foreign_keys("pooled_statistics")
    assert foreign_key["referred_table"] == "experiments" and foreign_key["options"].get("ondelete") == "CASCADE"


def _check_late_schema(inspector, segmented: bool, arrays: bool = False) -> None:
    """Revision 0004: ``late_statistics``; ``round_statistics`` without ``folded_*`` or a second index.
    ``segmented``: revision 0017 too, ``segment_index`` (NOT NULL, no default) in every statistics key.
    ``arrays``: revision 0018 too, ``pooled_arrays`` (one row per segment and metric) in place of
    ``pooled_statistics``."""
    segment = ["segment_index"] if segmented else []
    assert [column["name"] for column in inspector.get_columns("round_statistics")] == [
        "experiment_id", "round_index", "arm_index", "metric_index", "count", "sum", "sum_of_squares", *segment]
    assert inspector.get_indexes("round_statistics") == []
    totals = ("late_statistics",) if arrays else ("pooled_statistics", "late_statistics")
    if arrays:
        assert not inspector.has_table("pooled_statistics")
        key = inspector.get_pk_constraint("pooled_arrays")
        assert (key["name"], key["constrained_columns"]) == (
            "pk_pooled_arrays", ["experiment_id", "segment_index", "metric_index"])
        (foreign_key,) = inspector.get_foreign_keys("pooled_arrays")
        assert foreign_key["referred_table"] == "experiments" and foreign_key["options"].get("ondelete") == "CASCADE"
        assert {column["name"]: column["nullable"] for column in inspector.get_columns("pooled_arrays")} == {
            "experiment_id": False, "segment_index": False, "metric_index": False, "count": False, "sum": False,
            "sum_of_squares": False}
    for table in totals:
        assert inspector.get_pk_constraint(table)["constrained_columns"] == ["experiment_id", *segment,
                                                                             "metric_index", "arm_index"]
        (foreign_key,) = inspector.get_foreign_keys(table)
        assert foreign_key["referred_table"] == "experiments" and foreign_key["options"].get("ondelete") == "CASCADE"
    for table in ("round_statistics", *totals):
        assert inspector.get_pk_constraint(table)["name"] == f"pk_{table}"
        for column in inspector.get_columns(table):
            if column["name"] == "segment_index":
                assert column["nullable"] is False and column["default"] is None, (table, column)


def _check_ingestion_keys(inspector, dialect: str, migrated: bool) -> None:
    """Revision 0003: no foreign key on the per-observation tables, byte-order keys on PostgreSQL."""
    for table, key in (("observation_ids", "client_id"), ("round_units", "unit")):
        foreign_keys = inspector.get_foreign_keys(table)
        if migrated:
            assert foreign_keys == [], (table, foreign_keys)
        else:
            (foreign_key,) = foreign_keys
            assert foreign_key["referred_table"] == "experiments" and foreign_key["options"].get("ondelete") == "CASCADE"
        if dialect == "postgresql":
            (column,) = [c for c in inspector.get_columns(table) if c["name"] == key]
            assert getattr(column["type"], "collation", None) == ("C" if migrated else None), (table, column)


def test_upgrade_downgrade_sqlite(sqlite_url):
    _check_round_trip(sqlite_url)


@pytest.mark.postgres
def test_upgrade_downgrade_postgres(postgres_url):
    _check_round_trip(postgres_url)


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_models_match_the_migration(backend, request):
    """Autogenerate finds nothing to do: the models and the migrations describe the same schema, on
    both backends (the byte-order collation of the key columns is PostgreSQL's only)."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    url = request.getfixturevalue(f"{backend}_url")
    migrations.upgrade(url)
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            differences = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    finally:
        engine.dispose()
    assert differences == []


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_the_schema_check_reads_what_alembic_reads(backend, request):
    """head_revision and current_revision (which the schema check uses without importing Alembic)
    answer what Alembic's ScriptDirectory and MigrationContext answer: never migrated, at every
    revision on the way up, and back down to none."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(str(migrations.SCRIPT_LOCATION))
    assert migrations.head_revision() == script.get_current_head()
    url = request.getfixturevalue(f"{backend}_url")
    engine = sa.create_engine(url)

    def both() -> tuple[str | None, str | None]:
        with engine.connect() as connection:
            alembic_says = MigrationContext.configure(connection).get_current_revision()
        return migrations.current_revision(engine), alembic_says

    try:
        assert both() == (None, None)
        revisions = [revision.revision for revision in reversed(list(script.walk_revisions()))]
        assert revisions[-1] == migrations.head_revision() and len(revisions) > 1
        for revision in revisions:
            migrations.upgrade(url, revision)
            assert both() == (revision, revision)
        migrations.downgrade(url)
        assert both() == (None, None)  # the version table is still there, without a row
    finally:
        engine.dispose()


def test_app_refuses_an_unmigrated_database(sqlite_url):
    with pytest.raises(SchemaOutOfDate, match="pasto db upgrade"):
        create_app({"PASTO_DATABASE_URL": sqlite_url})


def test_app_refuses_an_outdated_database(sqlite_url):
    migrations.upgrade(sqlite_url)
    migrations.downgrade(sqlite_url, "base")
    with pytest.raises(SchemaOutOfDate, match="never been migrated"):
        create_app({"PASTO_DATABASE_URL": sqlite_url})


def test_sqlite_runs_in_wal_mode(app):
    from service.db import get_db

    with get_db(app).engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() > 0


def test_healthz_reports_an_unmigrated_database(sqlite_url):
    app = create_app({"PASTO_DATABASE_URL": sqlite_url, "PASTO_CHECK_SCHEMA": False})
    response = app.test_client().get("/healthz")
    assert response.status_code == 503
    body = response.get_json()
    assert body["status"] == "unavailable"
    assert body["database"]["reachable"] is True
    assert body["schema"] == {"current": None, "head": migrations.head_revision()}


#: The revision that drops the algorithm's preset key, and the one before it.
WITHOUT_PRESET, BEFORE_WITHOUT_PRESET = "0006", "0005"


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_the_stored_algorithm_loses_its_preset_key(backend, request):
    """Rows written before the revision kept the preset beside the resolved fields; after it they hold exactly
    the configuration the experiment runs, and the downgrade leaves them readable as they are."""
    url = request.getfixturevalue(f"{backend}_url")
    migrations.upgrade(url, BEFORE_WITHOUT_PRESET)
    resolved = {"estimator": "pooled", "solve_every": 1}
    engine = sa.create_engine(url)
    try:
        with engine.begin() as connection:
            _insert_experiment_rows(connection, [
                {"name": name, "config": json.dumps({"metrics": ["x"], "algorithm": algorithm})}
                for name, algorithm in (("old", {"preset": "paper", **resolved}), ("new", dict(resolved)))])
        migrations.upgrade(url, WITHOUT_PRESET)

        def algorithms():
            with engine.connect() as connection:
                return {name: json.loads(config) if isinstance(config, str) else config for name, config in
                        connection.execute(sa.text("SELECT name, config FROM experiments"))}

        assert algorithms() == {name: {"metrics": ["x"], "algorithm": resolved} for name in ("old", "new")}
        migrations.downgrade(url, BEFORE_WITHOUT_PRESET)
        assert algorithms() == {name: {"metrics": ["x"], "algorithm": resolved} for name in ("old", "new")}
    finally:
        engine.dispose()


def _insert_experiments(connection, names, rounds: int, created_at: str) -> None:
    """Experiment rows as a revision between 0006 and 0013 has them, with ``rounds`` rounds applied."""
    _insert_experiment_rows(connection, [{"name": name, "round_index": rounds, "applied_rounds": rounds,
                                          "created_at": created_at, "updated_at": created_at} for name in names])


def test_experiment_events_record_a_creation_for_existing_experiments(sqlite_url):
    """0011: every experiment present at the upgrade gets a ``created`` event in round 0 at its
    ``created_at``; the downgrade drops the table."""
    migrations.upgrade(sqlite_url, "0006")
    engine = sa.create_engine(sqlite_url)
    try:
        with engine.begin() as connection:
            _insert_experiments(connection, ("first", "second"), 4, "2026-01-02 03:04:05")
        migrations.upgrade(sqlite_url, "0011")
        with engine.connect() as connection:
            rows = connection.execute(sa.text(
                "SELECT e.name, v.kind, v.round_index, v.at, v.details FROM experiment_events v "
                "JOIN experiments e ON e.id = v.experiment_id ORDER BY v.id")).all()
        assert [tuple(row) for row in rows] == [("first", "created", 0, "2026-01-02 03:04:05", None),
                                                ("second", "created", 0, "2026-01-02 03:04:05", None)]
        migrations.downgrade(sqlite_url, "0006")
        assert "experiment_events" not in _tables(sqlite_url)
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_event_ids_are_never_reused_after_0013(backend, request):
    """0013: on SQLite ``experiment_events`` is rebuilt with AUTOINCREMENT, keeping every row, its id, the
    foreign key's cascade and the index, so an event inserted after the newest ones were deleted gets a
    greater id than theirs (PostgreSQL's sequence already did; there the revision changes nothing).
    The downgrade rebuilds it without AUTOINCREMENT and keeps the rows."""
    url = request.getfixturevalue(f"{backend}_url")
    migrations.upgrade(url, "0012")
    engine = sa.create_engine(url)
    if backend == "sqlite":  # as the service does: without it SQLite ignores ON DELETE CASCADE
        sa.event.listen(engine, "connect", lambda dbapi_connection, _: dbapi_connection.execute(
            "PRAGMA foreign_keys=ON"))
    select_events = sa.text("SELECT id, experiment_id, kind, round_index, at, details FROM experiment_events "
                            "ORDER BY id")
    insert_event = sa.text("INSERT INTO experiment_events (experiment_id, kind, round_index, at) VALUES "
                           "(:experiment, 'paused', 1, '2026-01-03 00:00:00')")

    def sqlite_sequence(connection) -> list[tuple]:
        return [tuple(row) for row in connection.execute(sa.text(
            "SELECT name, seq FROM sqlite_sequence WHERE name = 'experiment_events'"))]

    try:
        with engine.begin() as connection:
            _insert_experiments(connection, ("first", "second"), 1, "2026-01-02 00:00:00")
            first, second = connection.execute(sa.text("SELECT id FROM experiments ORDER BY id")).scalars()
            for experiment in (first, first, second, second, second):
                connection.execute(insert_event, {"experiment": experiment})
            before = connection.execute(select_events).all()
        assert len(before) == 5

        migrations.upgrade(url, "0013")
        inspector = sa.inspect(engine)
        (foreign_key,) = inspector.get_foreign_keys("experiment_events")
        assert foreign_key["referred_table"] == "experiments" and foreign_key["options"].get("ondelete") == "CASCADE"
        assert [(index["name"], index["column_names"]) for index in inspector.get_indexes("experiment_events")] == [
            ("ix_experiment_events_experiment_id_id", ["experiment_id", "id"])]
        with engine.begin() as connection:
            assert connection.execute(select_events).all() == before
            if backend == "sqlite":
                assert sqlite_sequence(connection) == [("experiment_events", before[-1].id)]
            # The newest events go with their experiment; the next one gets an id above theirs.
            connection.execute(sa.text("DELETE FROM experiments WHERE id = :id"), {"id": second})
            assert connection.execute(select_events).all() == before[:2]
            connection.execute(insert_event, {"experiment": first})
            after = connection.execute(select_events).all()
        assert after[:2] == before[:2] and after[2].id > before[-1].id

        migrations.downgrade(url, "0012")
        with engine.connect() as connection:
            assert connection.execute(select_events).all() == after
            if backend == "sqlite":
                assert sqlite_sequence(connection) == []
                table_sql = connection.execute(sa.text(
                    "SELECT sql FROM sqlite_master WHERE name = 'experiment_events'")).scalar_one()
                assert "AUTOINCREMENT" not in table_sql.upper() and "pk_experiment_events" in table_sql
        (foreign_key,) = sa.inspect(engine).get_foreign_keys("experiment_events")
        assert foreign_key["options"].get("ondelete") == "CASCADE"
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_packed_documents_are_stored_uncompressed_on_postgres_after_0016(postgres_url):
    """0016: the packed documents' columns use STORAGE EXTERNAL (out of line, no compression attempt);
    the downgrade puts PostgreSQL's default (EXTENDED) back; the stored state reads the same throughout."""
    from service.models import Experiment

    def storage() -> dict[tuple[str, str], str]:
        with engine.connect() as connection:
            return {(table, column): connection.execute(sa.text(
                "SELECT attstorage FROM pg_attribute WHERE attrelid = CAST(:table AS regclass) AND attname = :column"),
                {"table": table, "column": column}).scalar_one()
                for table, column in (("experiments", "state"), ("experiments", "segment_state"),
                                      ("rounds", "summary_input"))}

    migrations.upgrade(postgres_url)
    engine = sa.create_engine(postgres_url)
    try:
        assert set(storage().values()) == {"e"}
        state = {"round_index": 1, "probabilities": [0.25] * 4000}
        with engine.begin() as connection:
            connection.execute(sa.insert(Experiment.__table__).values(
                id=1, name="e", config={}, status="running", seed=1, round_index=0, applied_rounds=0,
                pruned_rounds=0, state=state, version=1, created_at=datetime(2026, 1, 1, tzinfo=timezone.utc),
                updated_at=datetime(2026, 1, 1, tzinfo=timezone.utc)))
        migrations.downgrade(postgres_url, "0015")
        assert set(storage().values()) == {"x"}
        migrations.upgrade(postgres_url)
        assert set(storage().values()) == {"e"}
        with engine.connect() as connection:
            assert connection.execute(sa.select(Experiment.state)).scalar_one() == state
    finally:
        engine.dispose()


# ------------------------------------------------------------------------------ 0017: one set of statistics
#: Before 0017: an unsegmented experiment (1, ``segment_state`` SQL NULL), one whose ``segment_state`` is
#: JSON null (2: unsegmented too) and a segmented one (3, three segments); M = 2 metrics, K = 4 arms,
#: rounds 0..3 with 0..2 applied (late cells waiting). Values are multiples of 1/4, so sums are exact in
#: any order and the totals can be compared exactly.
STATISTICS_SHAPE = {1: (1, 2, 4), 2: (1, 2, 4), 3: (3, 2, 4)}
ROUND_KEYS = ("round_index", "arm_index", "metric_index")
TOTAL_KEYS = ("metric_index", "arm_index")
VALUE_COLUMNS = ("count", "sum", "sum_of_squares")


def _old_shape_rows(seed: int) -> dict[int, dict[str, np.ndarray]]:
    """Per experiment: its per-segment round rows (R, S, M, K, 3), applied totals and late cells (S, M, K, 3)."""
    rng = np.random.default_rng(seed)
    data = {}
    for experiment_id, shape in STATISTICS_SHAPE.items():
        counts = rng.integers(0, 4, (4, *shape)) * (rng.random((4, *shape)) < 0.8)  # some cells empty
        sums = rng.integers(-40, 40, counts.shape) / 4 * (counts > 0)
        squares = rng.integers(0, 80, counts.shape) / 4 * (counts > 0)
        rounds = np.stack([counts, sums, squares], axis=-1).astype(np.float64)
        late = rounds[0] * (rng.random(shape)[..., None] < 0.3)  # late cells of round 0, not folded yet
        data[experiment_id] = {"rounds": rounds, "pooled": rounds[:3].sum(axis=0), "late": late}
    return data


def _insert_old_shape(connection, data) -> None:
    """The rows as 0016's code wrote them: an unsegmented experiment's in the statistics tables; a segmented
    one's per segment in the ``segment_*`` tables and summed over segments in the statistics tables."""
    for experiment_id, stored in ((1, None), (2, "null"), (3, json.dumps({"names": ["a", "b", "c"]}))):
        _insert_experiment_rows(connection, [{"id": experiment_id, "name": f"e{experiment_id}", "round_index": 3,
                                              "applied_rounds": 3, "pruned_rounds": 0, "segment_state": stored}])
        connection.execute(sa.text("INSERT INTO arms (experiment_id, position, name, params) VALUES (:e, :k, :name, '{}')"),
                           [{"e": experiment_id, "k": k, "name": f"a{k}"}
                            for k in range(STATISTICS_SHAPE[experiment_id][2])])

    def insert(table, keys, rows):
        columns = ("experiment_id", *keys, *VALUE_COLUMNS)
        statement = sa.text(f"INSERT INTO {table} ({', '.join(columns)}) "
                            f"VALUES ({', '.join(':' + column for column in columns)})")
        if rows:
            connection.execute(statement, [dict(zip(columns, row)) for row in rows])

    for experiment_id, arrays in data.items():
        segmented = STATISTICS_SHAPE[experiment_id][0] > 1
        rounds, pooled, late = arrays["rounds"], arrays["pooled"], arrays["late"]
        summed = {"rounds": rounds.sum(axis=1), "pooled": pooled.sum(axis=0), "late": late.sum(axis=0)}
        insert("round_statistics", ROUND_KEYS, [
            (experiment_id, r, k, m, int(v[0]), v[1], v[2]) for (r, m, k), v in _cells(summed["rounds"])])
        insert("pooled_statistics", TOTAL_KEYS, [
            (experiment_id, m, k, int(v[0]), v[1], v[2]) for (m, k), v in _cells(summed["pooled"])])
        insert("late_statistics", TOTAL_KEYS, [
            (experiment_id, m, k, int(v[0]), v[1], v[2]) for (m, k), v in _cells(summed["late"])])
        if segmented:
            insert("segment_round_statistics", ("round_index", "segment_index", "arm_index", "metric_index"), [
                (experiment_id, r, s, k, m, int(v[0]), v[1], v[2]) for (r, s, m, k), v in _cells(rounds)])
            for table, cells in (("segment_pooled_statistics", pooled), ("segment_late_statistics", late)):
                insert(table, ("segment_index", "metric_index", "arm_index"), [
                    (experiment_id, s, m, k, int(v[0]), v[1], v[2]) for (s, m, k), v in _cells(cells)])


def _cells(array: np.ndarray):
    """``(index, values)`` of the cells of ``array`` (..., 3) with a count."""
    return [(tuple(int(i) for i in index), array[index].tolist()) for index in zip(*np.nonzero(array[..., 0] > 0))]


def _old_shape_tables(engine) -> dict[str, set[tuple]]:
    """Every row of the statistics tables as 0016 has them (the ``segment_*`` ones included)."""
    tables = ("round_statistics", "pooled_statistics", "late_statistics", "segment_round_statistics",
              "segment_pooled_statistics", "segment_late_statistics")
    with engine.connect() as connection:
        return {table: {tuple(row) for row in connection.execute(sa.text(f"SELECT * FROM {table}"))}
                for table in tables}


def _old_unsegmented_totals(before: dict[str, set[tuple]], experiment_id: int) -> np.ndarray:
    """(M, K, 3) pooled statistics after round 3 as 0016 read them (``pooled_statistics`` of 0016's store):
    its totals, late cells and the rows of round 3 (applied_rounds = 3), all summed over segments."""
    totals = np.zeros((*STATISTICS_SHAPE[experiment_id][1:], 3))
    for table in ("pooled_statistics", "late_statistics"):
        for e, m, k, *values in before[table]:
            if e == experiment_id:
                totals[m, k] += values
    for e, r, k, m, *values in before["round_statistics"]:
        if e == experiment_id and r == 3:
            totals[m, k] += values
    assert totals[..., 0].sum() > 0
    return totals


def _read_totals(url: str):
    """What the service reads back, through the store: per experiment its per-segment pooled statistics
    (S, M, K) after round 3 (totals, late cells, the unapplied round 3), their sums over segments, and the
    round history's per-round cells summed over segments."""
    from service import store
    from service.db import open_database

    database = open_database(url)
    try:
        with database.read() as session:
            read = {}
            for experiment_id, shape in STATISTICS_SHAPE.items():
                pooled = store.pooled_statistics(session, experiment_id, 3, *shape)
                _, history, _ = store.round_history(session, experiment_id, 0, 3, segmented=shape[0] > 1)
                read[experiment_id] = (pooled, sorted(map(tuple, history.tolist())))
        return read
    finally:
        database.engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_0017_keeps_every_total_and_the_downgrade_restores_the_old_rows(backend, request):
    """0017 on a database holding statistics in the old shape: an unsegmented experiment's rows become
    segment 0, a segmented one keeps its per-segment rows and loses the summed copies; the totals read
    back (per segment, over segments, per round) equal those of the old rows exactly; the downgrade
    gives back exactly the old rows."""
    url = request.getfixturevalue(f"{backend}_url")
    migrations.upgrade(url, "0016")
    data = _old_shape_rows(seed=17)
    engine = sa.create_engine(url)
    try:
        with engine.begin() as connection:
            _insert_old_shape(connection, data)
        before = _old_shape_tables(engine)
        migrations.upgrade(url)
        assert not _tables(url) & SEGMENT_STATISTICS_TABLES
        for experiment_id, (pooled, history) in _read_totals(url).items():
            arrays = data[experiment_id]
            expected = arrays["pooled"] + arrays["late"] + arrays["rounds"][3]  # (S, M, K, 3)
            got = np.stack([pooled.counts, pooled.sums, pooled.sums_of_squares], axis=-1)
            assert np.array_equal(got, expected), experiment_id
            # The totals over segments equal those 0016 read from its summed rows.
            assert np.array_equal(got.sum(axis=0), _old_unsegmented_totals(before, experiment_id)), experiment_id
            old_rounds = sorted((r, m, k, c, s) for e, r, k, m, c, s, _ in before["round_statistics"] if e == experiment_id)
            assert history == [tuple(float(v) for v in row) for row in old_rounds], experiment_id
        with engine.connect() as connection:
            per_experiment = dict(connection.execute(sa.text(
                "SELECT experiment_id, COUNT(*) FROM round_statistics GROUP BY experiment_id")).all())
            segments = dict(connection.execute(sa.text(
                "SELECT experiment_id, MAX(segment_index) FROM pooled_arrays GROUP BY experiment_id")).all())
        old_round_rows = {e: sum(1 for row in before["round_statistics"] if row[0] == e) for e in (1, 2)}
        assert per_experiment == {**old_round_rows, 3: len(before["segment_round_statistics"])}  # no summed copy
        assert segments == {1: 0, 2: 0, 3: 2}
        migrations.downgrade(url, "0016")
        assert _old_shape_tables(engine) == before
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_0017_refuses_summed_rows_that_are_not_the_sums_of_the_segments(backend, request):
    """A segmented experiment whose summed rows differ from its per-segment rows (a count off by one) is not
    migrated: the upgrade stops naming the key, and the database stays at 0016 with every row."""
    url = request.getfixturevalue(f"{backend}_url")
    migrations.upgrade(url, "0016")
    engine = sa.create_engine(url)
    try:
        with engine.begin() as connection:
            _insert_old_shape(connection, _old_shape_rows(seed=3))
            connection.execute(sa.text(
                "UPDATE round_statistics SET count = count + 1 WHERE experiment_id = 3 AND round_index = 2 "
                "AND arm_index = (SELECT MIN(arm_index) FROM round_statistics WHERE experiment_id = 3 "
                "AND round_index = 2 AND metric_index = 0) AND metric_index = 0"))
        before = _old_shape_tables(engine)
        with pytest.raises(RuntimeError, match="differ from the sums of their per-segment rows") as raised:
            migrations.upgrade(url)
        assert "'round_statistics'" in str(raised.value) and "(3, 2, " in str(raised.value)
        assert migrations.current_revision(engine) == "0016"
        assert _old_shape_tables(engine) == before
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_failure_late_in_0017_leaves_the_database_as_it_was(backend, request, monkeypatch):
    """The upgrade is one transaction on both backends (SQLite's DDL included, ``migrations/env.py``): when
    it fails at its last step (the drop of the ``segment_*`` tables), after the column, the rebuilt keys
    and the moved rows, the database is at 0016 with its old tables and rows, no table left half-built."""
    from alembic.operations import Operations

    url = request.getfixturevalue(f"{backend}_url")
    migrations.upgrade(url, "0016")
    engine = sa.create_engine(url)
    try:
        with engine.begin() as connection:
            _insert_old_shape(connection, _old_shape_rows(seed=5))
        before = _old_shape_tables(engine)
        tables = _tables(url)

        def fail(*args, **kwargs):
            raise RuntimeError("planted: the drop fails")

        monkeypatch.setattr(Operations, "drop_table", fail)
        with pytest.raises(RuntimeError, match="planted"):
            migrations.upgrade(url)
        assert migrations.current_revision(engine) == "0016"
        assert _tables(url) == tables
        assert "segment_index" not in [c["name"] for c in sa.inspect(engine).get_columns("round_statistics")]
        assert _old_shape_tables(engine) == before
    finally:
        engine.dispose()


# ------------------------------------------------------------------------------ 0018: totals as arrays
def _0017_totals(connection, seed: int) -> dict[tuple[int, int, int], dict[int, tuple]]:
    """Experiments 1 (K = 5, one segment) and 2 (K = 3, two segments) with per-arm totals as 0017 stores
    them: floats that are not round numbers (so a value changed in any bit shows), a negative zero, and
    arms without a row. Returns ``{(experiment, segment, metric): {arm: (count, sum, sum_of_squares)}}``."""
    rng = np.random.default_rng(seed)
    rows = {}
    for experiment_id, (n_segments, n_arms) in ((1, (1, 5)), (2, (2, 3))):
        _insert_experiment_rows(connection, [{"id": experiment_id, "name": f"e{experiment_id}", "round_index": 2,
                                              "applied_rounds": 2, "pruned_rounds": 0}])
        connection.execute(sa.text("INSERT INTO arms (experiment_id, position, name, params) VALUES (:e, :k, :n, '{}')"),
                           [{"e": experiment_id, "k": k, "n": f"a{k}"} for k in range(n_arms)])
        for segment in range(n_segments):
            for metric in range(2):
                arms = sorted(rng.choice(n_arms, size=n_arms - 1, replace=False).tolist())
                rows[(experiment_id, segment, metric)] = {
                    k: (int(rng.integers(1, 1000)), float(rng.normal() * 1e3), float(rng.random() * 1e6)) for k in arms}
    rows[(1, 0, 0)][min(rows[(1, 0, 0)])] = (2, -0.0, 0.0)
    connection.execute(sa.text(
        "INSERT INTO pooled_statistics (experiment_id, segment_index, metric_index, arm_index, count, sum, "
        "sum_of_squares) VALUES (:e, :s, :m, :k, :c, :x, :xx)"),
        [{"e": e, "s": s, "m": m, "k": k, "c": c, "x": x, "xx": xx}
         for (e, s, m), arms in rows.items() for k, (c, x, xx) in arms.items()])
    return rows


def _per_arm_rows(engine) -> set[tuple]:
    with engine.connect() as connection:
        return {(row[0], row[1], row[2], row[3], row[4], np.float64(row[5]).tobytes(), np.float64(row[6]).tobytes())
                for row in connection.execute(sa.text(
                    "SELECT experiment_id, segment_index, metric_index, arm_index, count, sum, sum_of_squares "
                    "FROM pooled_statistics"))}


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_0018_moves_the_totals_into_arrays_bit_for_bit_and_back(backend, request):
    """0018: each (experiment, segment, metric)'s per-arm totals become one row of K float64 arrays, equal
    to the rows bit for bit (a negative zero included) with zeros for arms without a row; the store reads
    them back as the same (S, M, K) statistics; the downgrade gives back exactly the old rows."""
    from service import store
    from service.db import open_database

    url = request.getfixturevalue(f"{backend}_url")
    migrations.upgrade(url, "0017")
    engine = sa.create_engine(url)
    try:
        with engine.begin() as connection:
            rows = _0017_totals(connection, seed=18)
        before = _per_arm_rows(engine)
        # The values as the database holds them (SQLite stores a negative zero REAL as the integer 0).
        rows = {key: {} for key in rows}
        for e, s, m, k, c, x, xx in before:
            rows[(e, s, m)][k] = (c, np.frombuffer(x)[0], np.frombuffer(xx)[0])
        migrations.upgrade(url, "0018")
        assert "pooled_statistics" not in _tables(url)
        with engine.connect() as connection:
            stored = {(e, s, m): [np.frombuffer(bytes(v), dtype="<f8") for v in values]
                      for e, s, m, *values in connection.execute(sa.text(
                          "SELECT experiment_id, segment_index, metric_index, count, sum, sum_of_squares FROM pooled_arrays"))}
        assert set(stored) == set(rows)
        for key, arms in rows.items():
            n_arms = 5 if key[0] == 1 else 3
            expected = np.zeros((3, n_arms))
            for k, values in arms.items():
                expected[:, k] = values
            assert all(array.shape == (n_arms,) for array in stored[key])
            assert np.stack(stored[key]).tobytes() == expected.tobytes(), key
        database = open_database(url)
        try:
            with database.read() as session:
                for experiment_id, shape in ((1, (1, 2, 5)), (2, (2, 2, 3))):
                    pooled = store.pooled_statistics(session, experiment_id, 1, *shape)
                    got = np.stack([pooled.counts, pooled.sums, pooled.sums_of_squares])
                    for (e, s, m), arms in rows.items():
                        if e == experiment_id:
                            for k in range(shape[2]):
                                assert got[:, s, m, k].tobytes() == np.array(arms.get(k, (0, 0.0, 0.0)),
                                                                             dtype=np.float64).tobytes()
        finally:
            database.engine.dispose()
        if backend == "postgres":  # stored as they are, no compression attempt (as 0016's documents)
            with engine.connect() as connection:
                assert set(connection.execute(sa.text(
                    "SELECT attstorage FROM pg_attribute WHERE attrelid = 'pooled_arrays'::regclass "
                    "AND attname IN ('count', 'sum', 'sum_of_squares')")).scalars()) == {"e"}
        migrations.downgrade(url, "0017")
        assert "pooled_arrays" not in _tables(url)
        assert _per_arm_rows(engine) == before
        migrations.upgrade(url)
        assert _tables(url) == EXPECTED_TABLES
    finally:
        engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_0018_refuses_totals_of_arms_the_experiment_does_not_have(backend, request):
    """A per-arm total whose arm is not one of the experiment's arms cannot go into an array of its K arms:
    the upgrade stops naming it, and the database stays at 0017 with every row."""
    url = request.getfixturevalue(f"{backend}_url")
    migrations.upgrade(url, "0017")
    engine = sa.create_engine(url)
    try:
        with engine.begin() as connection:
            _0017_totals(connection, seed=3)
            connection.execute(sa.text(
                "INSERT INTO pooled_statistics (experiment_id, segment_index, metric_index, arm_index, count, sum, "
                "sum_of_squares) VALUES (2, 1, 0, 7, 1, 0.5, 0.25)"))
        before = _per_arm_rows(engine)
        with pytest.raises(RuntimeError, match=r"arms the experiment does not have.*\(2, 1, 0, 7\)"):
            migrations.upgrade(url)
        assert migrations.current_revision(engine) == "0017"
        assert "pooled_arrays" not in _tables(url)
        assert _per_arm_rows(engine) == before
    finally:
        engine.dispose()


# ------------------------------------------------------------------------------ 0019: detector snapshots apart
@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_0019_moves_the_detector_snapshots_out_of_the_state_and_back(backend, request):
    """0019: a state's ``change_origin`` and ``window_origins`` become rows of ``detector_snapshots``
    holding the same packed documents (the service reads back the same numbers, bit for bit); a state
    without them is left as it is; the downgrade puts them back into the state unchanged."""
    from service import store
    from service.db import open_database
    from service.models import pack_arrays

    url = request.getfixturevalue(f"{backend}_url")
    migrations.upgrade(url, "0018")
    rng = np.random.default_rng(19)
    origin = {key: rng.normal(size=(2, 300)).tolist() for key in ("counts", "sums", "sums_of_squares")}
    windows = {key: rng.normal(size=(3, 2, 300)).tolist() for key in ("counts", "sums", "sums_of_squares")}
    rest = {"round_index": 30, "deployed": rng.random(300).tolist(), "changes": 1}
    states = {1: {**rest, "change_origin": origin, "window_origins": windows}, 2: {**rest, "window_origins": windows},
              3: dict(rest)}
    engine = sa.create_engine(url)
    try:
        with engine.begin() as connection:
            _insert_experiment_rows(connection, [
                {"id": experiment_id, "name": f"e{experiment_id}", "round_index": 30, "applied_rounds": 30,
                 "pruned_rounds": 0, "state": json.dumps(pack_arrays(state))} for experiment_id, state in states.items()])

        def stored_states():
            with engine.connect() as connection:
                return {e: json.loads(text) if isinstance(text, str) else text for e, text in connection.execute(
                    sa.text("SELECT id, state FROM experiments ORDER BY id"))}

        before = stored_states()
        migrations.upgrade(url, "0019")
        after = stored_states()
        for experiment_id, state in before.items():
            assert after[experiment_id] == {k: v for k, v in state.items() if k not in ("change_origin", "window_origins")}
        database = open_database(url)
        try:
            with database.read() as session:
                names = ("change_origin", "window_origins")
                assert store.read_detector_snapshots(session, 1, names) == {"change_origin": origin,
                                                                            "window_origins": windows}
                assert store.read_detector_snapshots(session, 2, names) == {"window_origins": windows}
                assert store.read_detector_snapshots(session, 3, names) == {}
        finally:
            database.engine.dispose()
        migrations.downgrade(url, "0018")
        assert "detector_snapshots" not in _tables(url)
        assert stored_states() == before
        migrations.upgrade(url)
        assert _tables(url) == EXPECTED_TABLES
    finally:
        engine.dispose()


# ------------------------------------------------------------------------------ 0020: no undecided rule
@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_0020_drops_the_undecided_rule_and_the_service_loads_the_experiment(backend, request):
    """0020: a stored ``serving_undecided`` (either value) is dropped, so the experiment loads; an
    experiment without it, or with exploration serving, is left as it is; the downgrade puts back
    the former default for safe serving."""
    from pasto.algorithm import AlgorithmConfig

    url = request.getfixturevalue(f"{backend}_url")
    migrations.upgrade(url, "0019")
    safe = {"estimator": "pooled", "serving": "safe", "serving_level": 0.95, "serving_posterior_draws": 4}
    stored = {"best": {**safe, "serving_undecided": "best_arm"}, "conservative": {**safe, "serving_undecided": "conservative"},
              "plain": dict(safe), "exploration": {"estimator": "pooled", "serving": "exploration"}}
    engine = sa.create_engine(url)
    try:
        with engine.begin() as connection:
            _insert_experiment_rows(connection, [
                {"name": name, "config": json.dumps({"metrics": ["x"], "algorithm": algorithm})}
                for name, algorithm in stored.items()])

        def algorithms():
            with engine.connect() as connection:
                return {name: (json.loads(config) if isinstance(config, str) else config)["algorithm"]
                        for name, config in connection.execute(sa.text("SELECT name, config FROM experiments"))}

        migrations.upgrade(url, "0020")
        after = algorithms()
        assert after == {"best": safe, "conservative": safe, "plain": safe, "exploration": stored["exploration"]}
        for algorithm in after.values():
            AlgorithmConfig.from_dict(algorithm)  # loads
        with pytest.raises(ValueError, match="Unknown algorithm option"):
            AlgorithmConfig.from_dict(stored["best"])
        migrations.downgrade(url, "0019")
        assert algorithms() == {"best": stored["best"], "conservative": stored["best"], "plain": stored["best"],
                                "exploration": stored["exploration"]}
        migrations.upgrade(url)
    finally:
        engine.dispose()
