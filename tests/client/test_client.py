"""Client: every route through a real server, and the server's errors as PastoAPIError."""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid

import pytest

from pasto_client import Assignment, Client, PastoAPIError, PastoConnectionError



def closed_port() -> int:
    """A local port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_importing_the_client_does_not_import_flask_or_sqlalchemy():
    code = (
        "import sys, pasto_client\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'flask', 'sqlalchemy', 'service', 'alembic', 'werkzeug'})\n"
        "print(','.join(loaded))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


def test_every_route_round_trips(server, admin, create_experiment, true_means):
    name = create_experiment()
    assert name in [e["name"] for e in admin.list_experiments()]
    experiment = admin.get_experiment(name)
    assert experiment["status"] == "running"
    assert [arm["name"] for arm in experiment["arms"]] == list(true_means)
    assert experiment["round"]["index"] == 0

    one = admin.assign(name, "user-1")
    assert isinstance(one, Assignment)
    assert one.round == 0 and one.arm in true_means
    assert one.probability == pytest.approx(0.25)
    assert dict(one.params) == next(a["params"] for a in experiment["arms"] if a["name"] == one.arm)
    many = admin.assign_many(name, ["user-1", "user-2", "user-3"])
    assert many[0] == one and len(many) == 3

    observations = [
        {"id": str(uuid.uuid4()), "unit": a_unit, "round": 0, "arm": a.arm,
         "values": {"watch_time": true_means[a.arm][0], "like_rate": true_means[a.arm][1]}}
        for a_unit, a in zip(["user-1", "user-2", "user-3"], many)
    ]
    assert admin.observe(name, observations) == {"accepted": 3, "duplicates": 0}
    assert admin.observe(name, observations[:2]) == {"accepted": 0, "duplicates": 2}

    new_round = admin.close_round(name)
    assert new_round["closed_round"] == 0 and new_round["round"]["index"] == 1
    with pytest.raises(PastoAPIError) as stale:
        admin.close_round(name, round_index=0)
    assert stale.value.status == 409
    assert admin.close_round(name, round_index=1)["round"]["index"] == 2
    rounds = admin.rounds(name)
    assert [r["index"] for r in rounds] == [0, 1, 2]
    assert [r["index"] for r in admin.rounds(name, since=1)] == [1, 2]
    assert [r["index"] for r in admin.rounds(name, since=0, limit=2)] == [0, 1]
    assert sum(rounds[0]["counts"]) == 3
    diagnostics = admin.diagnostics(name)
    assert {"objective", "best_mixture", "best_single", "guardrails", "srm"} <= set(diagnostics)

    assert admin.pause(name)["status"] == "paused"
    assert admin.resume(name)["status"] == "running"
    assert admin.stop(name)["status"] == "stopped"
    assert admin.get_experiment(name)["status"] == "stopped"
    events = admin.events(name)
    assert [(event["kind"], event["round"]) for event in events] == [
        ("created", 0), ("paused", 2), ("resumed", 2), ("stopped", 2)]
    assert [event["kind"] for event in admin.events(name, since=events[2]["id"])] == ["resumed", "stopped"]
    health = admin.health()
    assert health["status"] == "ok" and health["database"]["reachable"] is True
    assert admin.openapi()["openapi"].startswith("3.1")


def test_large_k_summaries_are_one_argument_on_every_read(admin, create_experiment):
    """``arms=N`` asks the server for per-arm arrays cut to N arms (docs/api.md, "Large K"); each
    round of a paged read carries the arm_summary its arrays are aligned with."""
    name = create_experiment()
    admin.close_round(name)
    admin.close_round(name)
    full = admin.get_experiment(name)
    summary = admin.get_experiment(name, arms=2)
    kept = summary["arm_summary"]["arms"]
    assert len(summary["probabilities"]) == 2 and summary["rest"]["arms"] == 2
    assert summary["probabilities"] == [full["probabilities"][arm] for arm in kept]
    assert summary["arm_summary"]["names"] == [full["arms"][arm]["name"] for arm in kept]
    listed = next(e for e in admin.list_experiments(arms=2) if e["name"] == name)
    assert listed["arm_summary"] == summary["arm_summary"]
    assert "arm_summary" not in next(e for e in admin.list_experiments() if e["name"] == name)
    rounds = admin.rounds(name, arms=2)
    assert [entry["index"] for entry in rounds] == [0, 1, 2]
    full_rounds = admin.rounds(name)
    for entry, full_entry in zip(rounds, full_rounds):
        assert entry["probabilities"] == [full_entry["probabilities"][arm] for arm in entry["arm_summary"]["arms"]]
        assert "arm_summary" not in full_entry
    assert [entry["index"] for entry in admin.rounds(name, since=1, limit=1, arms=3)] == [1]
    assert admin.diagnostics(name, arms=2)["arm_summary"]["rest_arms"] == 2
    assert admin.get_experiment(name, arms=4) == full  # N >= K: the full response
    with pytest.raises(PastoAPIError) as bad:
        admin.diagnostics(name, arms=0)
    assert bad.value.status == 422 and "arms" in str(bad.value)


def test_create_experiment_sends_optional_fields(admin, create_experiment):
    name = create_experiment(algorithm={"preset": "paper"}, seed=987654321, settle_seconds=2.0)
    experiment = admin.get_experiment(name)
    assert experiment["seed"] == 987654321
    assert experiment["settle_seconds"] == 2.0


def test_server_errors_become_pasto_api_errors(server, admin, create_experiment):
    with pytest.raises(PastoAPIError) as missing:
        admin.get_experiment("no-such-experiment")
    assert missing.value.status == 404
    assert missing.value.code and "no-such-experiment" in missing.value.message

    name = create_experiment()
    with pytest.raises(PastoAPIError) as duplicate:
        create_experiment(name=name)
    assert duplicate.value.status == 409

    with pytest.raises(PastoAPIError) as invalid:
        admin.observe(name, [{"id": "x", "unit": "u", "round": 0, "values": {"nope": 1.0}}])
    assert invalid.value.status == 422
    assert "nope" in invalid.value.message or "nope" in str(invalid.value.details)
    assert not invalid.value.retryable

    with server.client(token="not-a-token") as stranger, pytest.raises(PastoAPIError) as unauthorised:
        stranger.list_experiments()
    assert unauthorised.value.status == 401

    reader_token = server.pasto("tokens", "create", "--role", "read").strip().split()[-1]
    with server.client(token=reader_token) as reader:
        assert reader.get_experiment(name)["name"] == name
        with pytest.raises(PastoAPIError) as forbidden:
            reader.assign(name, "user-1")
    assert forbidden.value.status == 403


def test_unreachable_server_raises_connection_error():
    # Not a bound: the connection is refused at once; the timeout only ends a hang.
    with Client(f"http://127.0.0.1:{closed_port()}", "token", timeout=2) as client:
        with pytest.raises(PastoConnectionError):
            client.list_experiments()


@pytest.mark.parametrize("base_url", ["127.0.0.1:8000", "ftp://example.org", ""])
def test_base_url_must_be_http(base_url):
    with pytest.raises(ValueError, match="must start with http"):
        Client(base_url, "token")


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout"):
        Client("http://127.0.0.1:8000", "token", timeout=0)


def test_archive_list_archived_and_delete(server, admin, create_experiment):
    name = create_experiment()
    with pytest.raises(PastoAPIError) as refused:
        admin.delete(name)
    assert refused.value.status == 409
    archived = admin.archive(name)
    assert archived["status"] == "stopped" and archived["archived_at"] is not None
    assert name not in [e["name"] for e in admin.list_experiments()]
    assert name in [e["name"] for e in admin.list_experiments(archived=True)]
    deleted = admin.delete(name)
    assert deleted["name"] == name and deleted["deleted_rows"]["experiments"] == 1
    with pytest.raises(PastoAPIError) as gone:
        admin.get_experiment(name)
    assert gone.value.status == 404
