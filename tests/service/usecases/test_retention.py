"""Retention (``service.controller.retention.prune``, the scheduler's job) against a real store on
SQLite and PostgreSQL: the ids of applied rounds are pruned, and a resend of a pruned round
(observations or a statistics batch) is refused 409 with the counts unchanged.

This replaces a test that ran ``pasto serve`` as a process to get there; the scheduler's wiring of the
job (``PASTO_RETENTION_SECONDS``, its interval, its log line) is tests/service/test_config.py's."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest

from service import store
from service.controller import assignment, reports, rounds
from service.controller.retention import prune
from service.errors import ApiError
from service.models import utcnow

from .conftest import create, observe, push_statistics

BATCH = {"batch_id": "job/round-0", "cells": [
    {"round": 0, "arm": "a", "metric": "x", "count": 4, "sum": 2.0, "sum_of_squares": 3.0}],
    "units": [{"round": 0, "arm": "a", "units": 2}]}


def table_rows(uow, experiment_id: int) -> tuple[int, int, int]:
    with uow.read() as session:
        counts = store.experiment_row_counts(session, experiment_id)
    return counts["observation_ids"], counts["round_units"], counts["statistics_batches"]


def counts(uow, name: str) -> tuple:
    """Observations, distinct units and means (0 where no data) per round and arm."""
    history = reports.round_history(uow, name, 0, None)
    return history.counts.tolist(), history.units.tolist(), np.nan_to_num(history.means).tolist()


def test_pruned_rounds_refuse_a_resend_with_the_counts_unchanged(backend_uow):
    uow = backend_uow
    snapshot = create(uow, "retained")
    units = [f"u{i}" for i in range(50)]
    arms = assignment.assign_many(uow, "retained", units)[2]
    observations = [{"id": f"o{i}", "unit": unit, "round": 0, "arm": "ab"[arms[i]], "values": {"x": float(i), "y": 1.0}}
                    for i, unit in enumerate(units)]
    assert observe(uow, "retained", observations).accepted == 50
    assert push_statistics(uow, "retained", BATCH).duplicate is False
    # Within the round (not applied yet): a resend is a duplicate, nothing is pruned.
    assert push_statistics(uow, "retained", BATCH).duplicate is True
    nothing = prune(uow, utcnow() + timedelta(days=1), retention_seconds=0)
    assert nothing.advanced == {} and table_rows(uow, snapshot.id) == (50, 50, 1)

    rounds.close_current_round(uow, "retained", 0)
    result = prune(uow, utcnow() + timedelta(seconds=1), retention_seconds=0)
    assert result.advanced == {snapshot.id: 1} and result.finished
    assert result.deleted["observation_ids"] == 50 and result.deleted["statistics_batches"] == 1
    assert table_rows(uow, snapshot.id) == (0, 0, 0)
    with uow.read() as session:
        assert store.lock_for_ingestion(session, snapshot.id).pruned_rounds == 1

    before = counts(uow, "retained")
    for send in (lambda: observe(uow, "retained", observations), lambda: push_statistics(uow, "retained", BATCH)):
        with pytest.raises(ApiError) as error:
            send()
        assert (error.value.status, error.value.code) == (409, "round_pruned")
        assert error.value.details == {"round": 0, "pruned_rounds": 1}
    assert counts(uow, "retained") == before
    assert sum(reports.round_history(uow, "retained", 0, None).counts[0]) == 50 + 4  # each once


def test_without_a_retention_nothing_is_pruned(uow):
    create(uow, "kept")
    observe(uow, "kept", [{"id": "o", "unit": "u", "round": 0, "values": {"x": 1.0}}])
    rounds.close_current_round(uow, "kept", 0)
    assert prune(uow, utcnow() + timedelta(days=3650), retention_seconds=None).advanced == {}
    assert observe(uow, "kept", [{"id": "o", "unit": "u", "round": 0, "values": {"x": 1.0}}]).duplicates == 1
