"""A metric source around the close (``service.controller.sources`` through ``rounds``) against a real
store: the round's statistics come from the warehouse (DuckDB over CSV files here), a failing source
leaves the round open, and the error is what the reports show."""

from __future__ import annotations

import csv
from datetime import timedelta

import pytest

from service.controller import assignment, reports, rounds
from service.errors import ApiError
from service.sources import SourceLimits

from .conftest import create

pytest.importorskip("duckdb_engine")


def mapping() -> dict:
    return {"exposures": {"table": "exposures", "unit": "unit", "arm": "arm", "experiment": "experiment",
                          "round": "round", "timestamp": "ts"},
            "events": {"table": "events", "unit": "unit", "timestamp": "ts", "metrics": {"x": "x", "y": "y"}}}


def land(folder, exposures: list[tuple], events: list[tuple]) -> dict:
    """Write the two tables as CSV files; the source declaration's ``files``."""
    files = {}
    for table, header, rows in (("exposures", ("experiment", "unit", "round", "ts", "arm"), exposures),
                                ("events", ("unit", "ts", "x", "y"), events)):
        path = folder / f"{table}.csv"
        with path.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(header)
            writer.writerows(rows)
        files[table] = {"path": str(path), "format": "csv"}
    return files


def naive(moment) -> str:
    """Timestamps without a zone hold UTC in the warehouse tables."""
    return moment.replace(tzinfo=None).isoformat(sep=" ")


def test_a_round_closes_on_its_sources_statistics(uow, tmp_path):
    files = land(tmp_path, [], [])
    snapshot = create(uow, "warehoused", source={"files": files, "mapping": mapping()}, settle_seconds=0)
    units = [f"u{i}" for i in range(30)]
    arms = assignment.assign_many(uow, "warehoused", units)[2]
    at = naive(snapshot.round_started_at + timedelta(milliseconds=1))
    land(tmp_path, [("warehoused", unit, 0, at, "ab"[arms[i]]) for i, unit in enumerate(units)],
         [(unit, at, 2.0 if arms[i] == 0 else 0.0, 1.0) for i, unit in enumerate(units)])
    advance, fresh = rounds.close_current_round(uow, "warehoused", 0, limits=SourceLimits())
    assert advance.applied == (0,) and fresh.round_index == 1
    history = reports.round_history(uow, "warehoused", 0, None)
    assert history.counts[0].tolist() == [int((arms == 0).sum()), int((arms == 1).sum())]
    assert history.units[0].tolist() == history.counts[0].tolist()
    assert history.means[0, 0].tolist() == [2.0, 0.0] and history.source_error is None


def test_a_failing_source_leaves_the_round_open_and_says_why(uow, tmp_path):
    files = {"exposures": {"path": str(tmp_path / "missing-exposures.csv"), "format": "csv"},
             "events": {"path": str(tmp_path / "missing-events.csv"), "format": "csv"}}
    create(uow, "broken", source={"files": files, "mapping": mapping()})
    with pytest.raises(ApiError) as error:
        rounds.close_current_round(uow, "broken", 0, limits=SourceLimits())
    assert (error.value.status, error.value.code) == (502, "source_failed")
    assert "stays open" in error.value.message
    assert uow.cache.get("broken", fresh=True).round_index == 0
    shown = reports.round_history(uow, "broken", 0, None).source_error
    assert shown is not None and shown["failures"] == 1 and shown["message"]
    # The scheduler's close of the same experiment fails the same way and counts it.
    assert rounds.close_due_rounds(uow, uow.cache.get("broken").round_ends_at + timedelta(seconds=1)) == []
    assert reports.diagnostics(uow, "broken").source_error["failures"] == 2
