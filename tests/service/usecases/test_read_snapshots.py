"""A read use case reads one snapshot: a close committed by another connection between two of its
statements is not half seen (the rule of docs/architecture.md; PostgreSQL's default READ COMMITTED
would show each statement what was committed before it, SQLite's read transaction keeps its snapshot).

The race that made it a 500: an open set of segments (docs/segments.md) grows at a close, and the
diagnostics read the stored segment state and then the statistics; between the two, a close that
gave a value its own segment and an ingestion into that segment made the statistics have a segment
the state had not (an IndexError filling the (S, M, K) arrays)."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from service import store
from service.controller import experiments, reports, rounds
from service.errors import ApiError
from service.schemas import ExperimentCreate

from .conftest import observe, open_uow

NAME = "open"


def open_set_body() -> dict[str, Any]:
    return {
        "name": NAME,
        "arms": [{"name": "a"}, {"name": "b"}, {"name": "c"}],
        "metrics": ["x", "y"],
        "objective": {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "hard": True}]},
        "round_seconds": 3600,
        "seed": 11,
        "segments": {"by": "country", "min_units": 5, "max_segments": 5},
    }


def play(uow, round_index: int, counts: dict[str, int]) -> None:
    observe(uow, NAME, [{"id": f"{round_index}-{value}-{i}", "unit": f"{value}-{round_index}-{i}",
                         "round": round_index, "segment": value, "values": {"x": 1.0, "y": 0.2}}
                        for value, count in counts.items() for i in range(count)])


def test_closes_that_add_a_segment_between_the_diagnostics_reads_are_not_seen(backend_uow, monkeypatch):
    """The diagnostics read the segment state (2 segments); before they read the statistics, other
    connections close round 1 (giving "de" its own segment, the third), ingest into it in round 2 and
    close round 2 (its segment-2 rows folded into the running totals). The answer is the snapshot of
    the first read (2 segments, round 1 not yet applied), on both backends, not an IndexError."""
    uow = backend_uow  # SQLite and PostgreSQL
    experiments.create(uow, ExperimentCreate.model_validate(open_set_body()))
    play(uow, 0, {"fr": 10})
    rounds.close_current_round(uow, NAME, 0)  # "fr" gets its own segment
    play(uow, 1, {"fr": 10, "de": 10})  # "de" still on the long tail's mixture, 10 units
    assert uow.cache.get(NAME, fresh=True).segment_names == ("(other)", "fr")

    read_state = store.segment_state
    interleaved = []

    def state_then_closes(session, experiment_id):
        state = read_state(session, experiment_id)
        if not interleaved:
            interleaved.append(True)
            # Other connections, each committed: the scheduler's closes and an ingestion between them.
            rounds.close_current_round(uow, NAME, 1)  # "de" graduates: 3 segments
            assert uow.cache.get(NAME, fresh=True).segment_names == ("(other)", "fr", "de")
            play(uow, 2, {"de": 10, "fr": 10})  # round statistics of segment 2
            rounds.close_current_round(uow, NAME, 2)  # folded into the running totals
        return state

    monkeypatch.setattr(store, "segment_state", state_then_closes)
    diagnostics = reports.diagnostics(uow, NAME)  # the cached snapshot: round 1
    assert interleaved
    assert diagnostics.snapshot.round_index == 1
    segments = diagnostics.segments
    assert [entry.name for entry in segments.segments] == ["(other)", "fr"]
    # Round 0's "fr" and round 1's "de" in the long tail's statistics, round 1's "fr" in its own.
    assert [entry.observations for entry in segments.segments] == [20, 10]

    monkeypatch.setattr(store, "segment_state", read_state)
    after = reports.diagnostics(uow, NAME)
    assert after.snapshot.round_index == 3
    assert [entry.name for entry in after.segments.segments] == ["(other)", "fr", "de"]
    assert [entry.observations for entry in after.segments.segments] == [20, 20, 10]


@pytest.mark.postgres
def test_postgresql_reads_at_repeatable_read_and_writes_at_read_committed(postgres_url):
    """The level is set per checkout and reset at checkin: a pooled connection a read used serves the
    next write at READ COMMITTED, and the other way round."""
    uow = open_uow(postgres_url)
    try:
        for _ in range(3):  # pool_size connections or fewer: the same ones serve both kinds
            with uow.read() as session:
                assert session.execute(sa.text("SHOW transaction_isolation")).scalar_one() == "repeatable read"
            with uow.write() as session:
                assert session.execute(sa.text("SHOW transaction_isolation")).scalar_one() == "read committed"
    finally:
        uow.database.engine.dispose()


def test_a_delete_before_the_diagnostics_read_of_a_segmented_experiment_is_a_404(backend_uow, monkeypatch):
    """Deleted after the diagnostics took the cached snapshot and before their read transaction: a
    404, not the 500 of reading a state row that is gone."""
    uow = backend_uow
    experiments.create(uow, ExperimentCreate.model_validate(open_set_body()))
    experiments.archive(uow, NAME)
    build = reports.algorithm_and_objective

    def delete_then_build(*args, **kwargs):
        experiments.delete(uow, NAME)  # another connection, committed (no statement of the read yet)
        return build(*args, **kwargs)

    monkeypatch.setattr(reports, "algorithm_and_objective", delete_then_build)
    with pytest.raises(ApiError) as raised:
        reports.diagnostics(uow, NAME)
    assert raised.value.status == 404 and raised.value.code == "not_found"
