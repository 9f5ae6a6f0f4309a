"""Retention (``service.controller.retention.prune``, the scheduler's job) against a real store on
SQLite and PostgreSQL: the ids of applied rounds are pruned, and a resend of a pruned round
(observations or a statistics batch) is refused 409 with the counts unchanged.

This replaces a test that ran ``pasto serve`` as a process to get there; the scheduler's wiring of the
job (``PASTO_RETENTION_SECONDS``, its interval, its log line) is tests/service/test_config.py's."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest

from service.controller import assignment, reports, rounds
from service.controller.retention import prune
from service.errors import ApiError
from service.models import utcnow

from .conftest import create, observe, push_statistics

BATCH = {"batch_id": "job/round-0", "cells": [
    {"round": 0, "arm": "a", "metric": "x", "count": 4, "sum": 2.0, "sum_of_squares": 3.0}],
    "units": [{"round": 0, "arm": "a", "units": 2}]}


def table_rows(store, experiment_id: int) -> tuple[int, int, int]:
    with store.read() as session:
        counts = store.experiment_row_counts(session, experiment_id)
    return counts["observation_ids"], counts["round_units"], counts["statistics_batches"]


def counts(store, name: str) -> tuple:
    """Observations, distinct units and means (0 where no data) per round and arm."""
    history = reports.round_history(store, name, 0, None)
    return history.counts.tolist(), history.units.tolist(), np.nan_to_num(history.means).tolist()


def test_pruned_rounds_refuse_a_resend_with_the_counts_unchanged(backend_store):
    store = backend_store
    snapshot = create(store, "retained")
    units = [f"u{i}" for i in range(50)]
    arms = assignment.assign_many(store, "retained", units)[2]
    observations = [{"id": f"o{i}", "unit": unit, "round": 0, "arm": "ab"[arms[i]], "values": {"x": float(i), "y": 1.0}}
                    for i, unit in enumerate(units)]
    assert observe(store, "retained", observations).accepted == 50
    assert push_statistics(store, "retained", BATCH).duplicate is False
    # Within the round (not applied yet): a resend is a duplicate, nothing is pruned.
    assert push_statistics(store, "retained", BATCH).duplicate is True
    nothing = prune(store, utcnow() + timedelta(days=1), retention_seconds=0)
    assert nothing.advanced == {} and table_rows(store, snapshot.id) == (50, 50, 1)

    rounds.close_current_round(store, "retained", 0)
    result = prune(store, utcnow() + timedelta(seconds=1), retention_seconds=0)
    assert result.advanced == {snapshot.id: 1} and result.finished
    assert result.deleted["observation_ids"] == 50 and result.deleted["statistics_batches"] == 1
    assert table_rows(store, snapshot.id) == (0, 0, 0)
    with store.read() as session:
        assert store.lock_for_ingestion(session, snapshot.id).pruned_rounds == 1

    before = counts(store, "retained")
    for send in (lambda: observe(store, "retained", observations), lambda: push_statistics(store, "retained", BATCH)):
        with pytest.raises(ApiError) as error:
            send()
        assert (error.value.status, error.value.code) == (409, "round_pruned")
        assert error.value.details == {"round": 0, "pruned_rounds": 1}
    assert counts(store, "retained") == before
    assert sum(reports.round_history(store, "retained", 0, None).counts[0]) == 50 + 4  # each once


def test_without_a_retention_nothing_is_pruned(store):
    create(store, "kept")
    observe(store, "kept", [{"id": "o", "unit": "u", "round": 0, "values": {"x": 1.0}}])
    rounds.close_current_round(store, "kept", 0)
    assert prune(store, utcnow() + timedelta(days=3650), retention_seconds=None).advanced == {}
    assert observe(store, "kept", [{"id": "o", "unit": "u", "round": 0, "values": {"x": 1.0}}]).duplicates == 1
