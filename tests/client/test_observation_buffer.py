"""ObservationBuffer against the real server: batching, interval flushes, retries, idempotency,
rejections and overflow, and nothing ever lost silently."""

from __future__ import annotations

import logging
import math
import socket
import subprocess
import sys
import time

import pytest

from pasto_client import BufferOverflowError, Client, LocalAssigner, ObservationBuffer, PastoAPIError


def counted(client: Client, name: str, round_index: int = 0) -> int:
    """Observations the server has recorded for ``round_index``."""
    return sum(next(r for r in client.rounds(name) if r["index"] == round_index)["counts"])


def wait_until(predicate, timeout: float = 15.0) -> bool:
    # Hang guard, not a tolerance: 15 s by default for sends that take milliseconds.
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def add_assigned(buffer: ObservationBuffer, assigner: LocalAssigner, n: int, true_means, prefix="u"):
    for i in range(n):
        unit = f"{prefix}-{i}"
        a = assigner.assign(unit)
        watch, like = true_means[a.arm]
        buffer.add(unit, a.round, {"watch_time": watch, "like_rate": like}, arm=a.arm)


def test_batches_are_sent_and_counted_once(admin, create_experiment, true_means):
    name = create_experiment()
    with LocalAssigner(admin, name) as assigner, ObservationBuffer(admin, name, max_batch=1000) as buffer:
        add_assigned(buffer, assigner, 2500, true_means)
    assert buffer.pending == 0
    assert (buffer.accepted, buffer.duplicates, buffer.rejected) == (2500, 0, 0)
    assert counted(admin, name) == 2500


def test_flush_interval_sends_without_an_explicit_flush(admin, create_experiment, true_means):
    name = create_experiment()
    buffer = ObservationBuffer(admin, name, max_batch=10_000, flush_interval=0.1)
    with LocalAssigner(admin, name) as assigner:
        add_assigned(buffer, assigner, 3, true_means)
    assert wait_until(lambda: buffer.accepted == 3)
    assert counted(admin, name) == 3
    buffer.close()


def test_flush_waits_for_everything_added(admin, create_experiment, true_means):
    name = create_experiment()
    with ObservationBuffer(admin, name, max_batch=100, flush_interval=60) as buffer:
        with LocalAssigner(admin, name) as assigner:
            add_assigned(buffer, assigner, 250, true_means)
        buffer.flush(timeout=30)
        assert buffer.accepted == 250 and buffer.pending == 0
        assert counted(admin, name) == 250


def test_5xx_is_retried(server, proxy, create_experiment, true_means, caplog):
    name = create_experiment()
    caplog.set_level(logging.WARNING, logger="pasto_client")
    with Client(proxy.url, server.admin_token) as through_proxy:
        with LocalAssigner(through_proxy, name) as assigner:
            proxy.script[:] = ["503", "503"]
            buffer = ObservationBuffer(through_proxy, name, initial_backoff=0.01)
            add_assigned(buffer, assigner, 10, true_means)
            buffer.close(timeout=30)
    assert buffer.retries == 2 and buffer.accepted == 10
    assert "retrying" in caplog.text
    with server.client() as admin:
        assert counted(admin, name) == 10


def test_503_with_retry_after_waits_at_least_that_long(server, proxy, create_experiment, true_means):
    """The database is away: the 503's Retry-After (1 s) is honoured although the backoff is 0.01 s."""
    name = create_experiment()
    with Client(proxy.url, server.admin_token) as through_proxy:
        with LocalAssigner(through_proxy, name) as assigner:
            proxy.script[:] = ["503 retry-after 1"]
            buffer = ObservationBuffer(through_proxy, name, initial_backoff=0.01)
            add_assigned(buffer, assigner, 10, true_means)
            buffer.close(timeout=30)
    sent = [at for line, at in zip(proxy.seen, proxy.seen_at) if "observations" in line]
    assert len(sent) == 2 and sent[1] - sent[0] >= 1.0, sent
    assert buffer.retries == 1 and buffer.accepted == 10
    with server.client() as admin:
        assert counted(admin, name) == 10


def send_after_one_503(server, proxy, create_experiment, true_means, retry_after: int) -> ObservationBuffer:
    """10 observations through a buffer whose first send is answered 503 with ``retry_after``;
    the backoff's own cap (0.2 s) is below it."""
    name = create_experiment()
    with Client(proxy.url, server.admin_token) as through_proxy:
        with LocalAssigner(through_proxy, name) as assigner:
            proxy.script[:] = [f"503 retry-after {retry_after}"]
            buffer = ObservationBuffer(through_proxy, name, initial_backoff=0.01, max_backoff=0.2)
            add_assigned(buffer, assigner, 10, true_means)
            buffer.close(timeout=30)
    assert buffer.retries == 1 and buffer.accepted == 10 and buffer.pending == 0
    return buffer


def test_retry_after_is_honoured_beyond_max_backoff(server, proxy, create_experiment, true_means):
    """The server knows when it can answer: a Retry-After longer than the backoff cap still holds."""
    send_after_one_503(server, proxy, create_experiment, true_means, 2)
    sent = [at for line, at in zip(proxy.seen, proxy.seen_at) if "observations" in line]
    assert len(sent) == 2 and sent[1] - sent[0] >= 2.0, sent


def test_a_far_retry_after_is_bounded(server, proxy, create_experiment, true_means, monkeypatch):
    """A far date (a misconfigured proxy) waits MAX_RETRY_AFTER_SECONDS, not an hour."""
    monkeypatch.setattr("pasto_client.client.MAX_RETRY_AFTER_SECONDS", 0.2)
    send_after_one_503(server, proxy, create_experiment, true_means, 3600)


def test_the_client_reports_retry_after(server, proxy, create_experiment):
    name = create_experiment()
    with Client(proxy.url, server.admin_token) as through_proxy:
        proxy.script[:] = ["503 retry-after 7"]
        with pytest.raises(PastoAPIError) as raised:
            through_proxy.observe(name, [{"id": "o1", "unit": "u1", "round": 0, "values": {"watch_time": 1.0}}])
    assert (raised.value.status, raised.value.code, raised.value.retry_after) == (503, "database_unavailable", 7.0)
    assert raised.value.retryable


def test_a_lost_response_is_retried_without_double_counting(server, proxy, create_experiment, true_means):
    """The server commits the batch but the answer is lost: the retry carries the same ids."""
    name = create_experiment()
    with Client(proxy.url, server.admin_token) as through_proxy:
        with LocalAssigner(through_proxy, name) as assigner:
            proxy.script[:] = ["lose"]
            buffer = ObservationBuffer(through_proxy, name, initial_backoff=0.01)
            add_assigned(buffer, assigner, 20, true_means)
            buffer.close(timeout=30)
    assert [line.split()[-1] for line in proxy.seen if "observations" in line] == ["lose", "forward"]
    assert (buffer.accepted, buffer.duplicates, buffer.retries) == (0, 20, 1)
    with server.client() as admin:
        assert counted(admin, name) == 20


def test_invalid_observations_are_isolated_and_reported(admin, create_experiment, true_means):
    """A 422 is not retried; bisection keeps the valid neighbours of a bad observation."""
    name = create_experiment()
    rejected: list[tuple[PastoAPIError, list[dict]]] = []
    buffer = ObservationBuffer(admin, name, max_batch=16, flush_interval=60,
                               on_error=lambda error, batch: rejected.append((error, batch)))
    with LocalAssigner(admin, name) as assigner:
        add_assigned(buffer, assigner, 7, true_means, prefix="before")
        bad_id = buffer.add("bad-unit", 0, {"no_such_metric": 1.0})
        add_assigned(buffer, assigner, 8, true_means, prefix="after")
    buffer.close(timeout=30)
    assert buffer.accepted == 15 and buffer.rejected == 1 and buffer.retries == 0
    assert len(rejected) == 1
    error, batch = rejected[0]
    assert error.status == 422 and [o["id"] for o in batch] == [bad_id]
    assert counted(admin, name) == 15


def test_rejections_raise_without_an_on_error_callback(admin, create_experiment):
    name = create_experiment()
    buffer = ObservationBuffer(admin, name)
    buffer.add("u", 0, {"no_such_metric": 1.0})
    with pytest.raises(PastoAPIError) as raised:
        buffer.flush(timeout=30)
    assert raised.value.status == 422
    buffer.close()


def test_stopped_experiment_rejects_with_409(admin, create_experiment):
    name = create_experiment()
    admin.stop(name)
    buffer = ObservationBuffer(admin, name)
    buffer.add("u", 0, {"watch_time": 1.0})
    with pytest.raises(PastoAPIError) as raised:
        buffer.close(timeout=30)
    assert raised.value.status == 409


def test_unreachable_server_overflow_and_close_timeout():
    client = Client(f"http://127.0.0.1:{closed_port()}", "token", timeout=1)
    buffer = ObservationBuffer(client, "x", max_batch=2, max_queue=5, initial_backoff=0.01,
                               max_backoff=0.05)
    ids = [buffer.add(f"u{i}", 0, {"m": float(i)}) for i in range(5)]
    with pytest.raises(BufferOverflowError, match="5 pending observations"):
        buffer.add("one-too-many", 0, {"m": 1.0})
    assert wait_until(lambda: buffer.retries >= 2)
    with pytest.raises(TimeoutError) as timed_out:
        # Nothing listens, so no wait is long enough: any timeout raises; 0.3 s only keeps the test short.
        buffer.close(timeout=0.3)
    assert sorted(o["id"] for o in timed_out.value.unsent) == sorted(ids)
    assert buffer.accepted == 0


def test_on_overflow_receives_the_observation():
    client = Client(f"http://127.0.0.1:{closed_port()}", "token", timeout=1)
    overflowed: list[dict] = []
    buffer = ObservationBuffer(client, "x", max_batch=1, max_queue=1, initial_backoff=0.01,
                               max_backoff=0.05, on_overflow=overflowed.append)
    buffer.add("kept", 0, {"m": 1.0})
    returned_id = buffer.add("overflowing", 0, {"m": 2.0}, arm="a")
    assert [(o["unit"], o["id"], o["arm"]) for o in overflowed] == [("overflowing", returned_id, "a")]
    with pytest.raises(TimeoutError):
        # Nothing listens, so no wait is long enough: any timeout raises; 0.2 s only keeps the test short.
        buffer.close(timeout=0.2)


@pytest.mark.parametrize("values", [{}, {"m": math.nan}, {"m": math.inf}, {"m": "1"}, {"m": True}])
def test_values_are_checked_when_added(admin, values):
    with ObservationBuffer(admin, "x") as buffer, pytest.raises(ValueError, match="finite numbers"):
        buffer.add("u", 0, values)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"max_batch": 0}, "max_batch"), ({"max_batch": 10_001}, "max_batch"),
     ({"max_queue": 10}, "max_queue"), ({"flush_interval": 0}, "flush_interval"),
     ({"initial_backoff": 5, "max_backoff": 1}, "backoff")],
)
def test_invalid_arguments(admin, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ObservationBuffer(admin, "x", **kwargs)


def test_adding_after_close_is_an_error(admin):
    buffer = ObservationBuffer(admin, "x")
    buffer.close()
    buffer.close()  # idempotent
    with pytest.raises(Exception, match="closed"):
        buffer.add("u", 0, {"m": 1.0})


def test_a_forgotten_close_still_sends_at_exit(server, admin, create_experiment):
    name = create_experiment()
    script = (
        "import sys\n"
        "from pasto_client import Client, ObservationBuffer\n"
        "client = Client(sys.argv[1], sys.argv[2])\n"
        "buffer = ObservationBuffer(client, sys.argv[3], flush_interval=60)\n"
        "for i in range(50):\n"
        "    buffer.add(f'u{i}', 0, {'watch_time': 1.0})\n"
    )
    subprocess.run([sys.executable, "-c", script, server.url, server.admin_token, name],
                   check=True, timeout=60)
    assert counted(admin, name) == 50


def test_a_pruned_round_observation_is_isolated_and_its_neighbours_accepted(server, admin, create_experiment,
                                                                             true_means):
    """A 409 round_pruned (an observation of a round retention pruned) is not retried either: bisection
    keeps its valid neighbours, as for a 422."""
    from datetime import timedelta

    from service import create_app
    from service.controller.retention import prune
    from service.bootstrap import get_uow
    from service.db import get_db
    from service.models import utcnow

    name = create_experiment()
    admin.close_round(name)
    admin.close_round(name)  # round 0 applied a round ago; round 2 is served
    # Retention (the scheduler's job) prunes round 0's ids: its data can no longer be de-duplicated.
    app = create_app({"PASTO_DATABASE_URL": server.database_url, "PASTO_ADMIN_TOKEN": server.admin_token})
    prune(get_uow(app), utcnow() + timedelta(seconds=1), 0)
    get_db(app).engine.dispose()
    rejected: list[tuple[PastoAPIError, list[dict]]] = []
    buffer = ObservationBuffer(admin, name, max_batch=16, flush_interval=60,
                               on_error=lambda error, batch: rejected.append((error, batch)))
    with LocalAssigner(admin, name) as assigner:
        add_assigned(buffer, assigner, 7, true_means, prefix="before")
        pruned_id = buffer.add("pruned-unit", 0, {"watch_time": 1.0})
        add_assigned(buffer, assigner, 8, true_means, prefix="after")
    buffer.close(timeout=30)
    assert buffer.accepted == 15 and buffer.rejected == 1 and buffer.retries == 0
    error, batch = rejected[0]
    assert (error.status, error.code) == (409, "round_pruned") and [o["id"] for o in batch] == [pruned_id]
    assert counted(admin, name, round_index=2) == 15
