"""``Client.send_statistics``: retried like the observation buffer (5xx, 429, network errors, no sooner
than Retry-After), safe to retry (a lost answer comes back as a duplicate), other errors raised at once."""

from __future__ import annotations

import pytest

from pasto_client import Client, PastoAPIError

CELLS = [{"round": 0, "arm": "a", "metric": "watch_time", "count": 4, "sum": 8.0, "sum_of_squares": 20.0},
         {"round": 0, "arm": "b", "metric": "like_rate", "count": 2, "sum": 1.0, "sum_of_squares": 1.0}]
UNITS = [{"round": 0, "arm": "a", "units": 3}, {"round": 0, "arm": "b", "units": 2}]


def round_counts(admin: Client, name: str) -> list[int]:
    return admin.rounds(name)[0]["counts"]


def test_a_batch_is_applied_then_a_resend_is_a_duplicate(admin, create_experiment):
    name = create_experiment()
    first = admin.send_statistics(name, "batch-1", CELLS, UNITS)
    assert first == {"batch_id": "batch-1", "duplicate": False, "cells": 2, "units": 2, "late_cells": 0}
    again = admin.send_statistics(name, "batch-1", CELLS, UNITS)
    assert again["duplicate"] is True and again["cells"] == 0
    assert round_counts(admin, name) == [4, 2, 0, 0]


def test_503_with_retry_after_is_waited_for_then_sent_again(server, proxy, create_experiment):
    name = create_experiment()
    with Client(proxy.url, server.admin_token) as through_proxy:
        proxy.script[:] = ["503 retry-after 1", "503"]
        answer = through_proxy.send_statistics(name, "batch-1", CELLS, UNITS, initial_backoff=0.01)
    sent = [at for line, at in zip(proxy.seen, proxy.seen_at) if "statistics" in line]
    assert len(sent) == 3 and sent[1] - sent[0] >= 1.0, sent
    assert answer["duplicate"] is False
    with server.client() as admin:
        assert round_counts(admin, name) == [4, 2, 0, 0]


def test_a_lost_answer_is_retried_and_counted_once(server, proxy, create_experiment):
    """The server applied the batch but the answer was lost (502): the retry is answered as a duplicate."""
    name = create_experiment()
    with Client(proxy.url, server.admin_token) as through_proxy:
        proxy.script[:] = ["lose"]
        answer = through_proxy.send_statistics(name, "batch-1", CELLS, UNITS, initial_backoff=0.01)
    assert answer == {"batch_id": "batch-1", "duplicate": True, "cells": 0, "units": 0, "late_cells": 0}
    with server.client() as admin:
        assert round_counts(admin, name) == [4, 2, 0, 0]


def test_retries_stop_after_the_attempts(server, proxy, create_experiment):
    name = create_experiment()
    with Client(proxy.url, server.admin_token) as through_proxy:
        proxy.script[:] = ["503", "503", "503"]
        with pytest.raises(PastoAPIError) as raised:
            through_proxy.send_statistics(name, "batch-1", CELLS, attempts=2, initial_backoff=0.01)
    assert raised.value.status == 503
    assert sum("statistics" in line for line in proxy.seen) == 2


def test_client_errors_are_raised_at_once(server, proxy, create_experiment):
    name = create_experiment()
    with Client(proxy.url, server.admin_token) as through_proxy:
        through_proxy.send_statistics(name, "batch-1", CELLS)
        with pytest.raises(PastoAPIError) as conflict:
            through_proxy.send_statistics(name, "batch-1", CELLS[:1])
        with pytest.raises(PastoAPIError) as invalid:
            through_proxy.send_statistics(name, "batch-2", [dict(CELLS[0], sum_of_squares=1.0)])
    assert (conflict.value.status, conflict.value.details) == (409, {"batch_id": "batch-1"})
    assert invalid.value.status == 422 and invalid.value.details[0]["location"] == "cells[0]"
    assert sum("statistics" in line for line in proxy.seen) == 3  # none of them retried


def test_invalid_arguments_are_refused_before_sending(admin):
    with pytest.raises(ValueError, match="attempts"):
        admin.send_statistics("x", "b", CELLS, attempts=0)
    with pytest.raises(ValueError, match="backoffs"):
        admin.send_statistics("x", "b", CELLS, initial_backoff=2.0, max_backoff=1.0)
