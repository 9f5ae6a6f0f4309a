"""LocalAssigner: exactly the server's assignment, refreshed on time, resilient, thread-safe."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasto_client import Assignment, LocalAssigner
from pasto.hashing import bucket, choose_arm, cumulative_probabilities

N_ARMS = 12
ARMS = [
    {"name": f"setting-{k:02d}", "params": {"w_watch": round(1 - k / N_ARMS, 3), "w_like": k / N_ARMS}}
    for k in range(N_ARMS)
]
# watch_time falls and like_rate rises with k; the like_rate guardrail rules out the first arms.
MEANS = {arm["name"]: (2.0 - 1.5 * k / N_ARMS, 0.2 + 0.6 * k / N_ARMS) for k, arm in enumerate(ARMS)}
UNITS = (
    [f"user-{i}" for i in range(600)]
    + [str(uuid.UUID(int=i, version=4)) for i in range(300)]
    + [f"ユーザー{i}" for i in range(100)]
    + [f"{i}🙂" for i in range(50)]
    + ["x" * n for n in range(1, 51)]
)


def wait_until(predicate, timeout: float = 15.0, interval: float = 0.05) -> bool:
    # Hang guard, not a tolerance: callers give 10-20 s for refreshes that come every 0.05-0.5 s.
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def observe_assigned(client, name, units, assignments, rng):
    observations = [
        {
            "id": str(uuid.uuid4()),
            "unit": unit,
            "round": a.round,
            "arm": a.arm,
            "values": {
                "watch_time": MEANS[a.arm][0] + rng.normal(0, 0.3),
                "like_rate": MEANS[a.arm][1] + rng.normal(0, 0.1),
            },
        }
        for unit, a in zip(units, assignments)
    ]
    client.observe(name, observations)


def guarded_experiment(create_experiment, **overrides) -> str:
    return create_experiment(
        arms=ARMS,
        objective={
            "primary": "watch_time",
            "guardrails": [{"metric": "like_rate", "threshold": 0.6, "penalty": 5.0}],
        },
        **overrides,
    )


def test_local_assignment_is_exactly_the_servers(admin, create_experiment):
    """Golden test: per call and in batch, every unit, over rounds whose mixtures move away from
    uniform, then paused, then stopped (deployed mixture)."""
    name = guarded_experiment(create_experiment)
    rng = np.random.default_rng(1)
    mixtures = []
    with LocalAssigner(admin, name, ttl=3600) as assigner:
        for round_index in range(8):
            assigner.refresh()
            assert assigner.round_index == round_index
            served = admin.assign_many(name, UNITS)
            assert [assigner.assign(unit) for unit in UNITS] == served
            assert assigner.assign_many(UNITS) == served
            assert {a.round for a in served} == {round_index}
            mixtures.append(np.array(assigner.mixture))
            observe_assigned(admin, name, UNITS, served, rng)
            admin.close_round(name)
        # The comparison covered non-uniform mixtures, not only the uniform first round.
        assert np.abs(mixtures[-1] - 1 / N_ARMS).max() > 0.02

        admin.pause(name)
        assigner.refresh()
        assert assigner.status == "paused"
        assert [assigner.assign(unit) for unit in UNITS] == admin.assign_many(name, UNITS)

        admin.stop(name)
        assigner.refresh()
        experiment = admin.get_experiment(name)
        assert assigner.status == "stopped"
        assert list(assigner.mixture) == experiment["deployed"]
        served = admin.assign_many(name, UNITS)
        assert [assigner.assign(unit) for unit in UNITS] == served
        assert assigner.assign_many(UNITS) == served
        assert {a.probability for a in served} <= set(experiment["deployed"])


def test_assignments_are_immutable_and_shared_per_arm(admin, create_experiment):
    name = guarded_experiment(create_experiment)
    with LocalAssigner(admin, name) as assigner:
        first = assigner.assign("user-1")
        assert assigner.assign("user-1") is first
        with pytest.raises(TypeError):
            first.params["w_watch"] = 3.0  # type: ignore[index]
        with pytest.raises(AttributeError):
            first.arm = "other"  # type: ignore[misc]
        with pytest.raises(TypeError, match="must be a string"):
            assigner.assign(17)  # type: ignore[arg-type]
        assert assigner.arms == tuple(arm["name"] for arm in ARMS)


def test_refreshes_after_the_ttl(admin, create_experiment):
    name = guarded_experiment(create_experiment)
    with LocalAssigner(admin, name, ttl=0.2) as assigner:
        admin.close_round(name)
        assert wait_until(lambda: assigner.round_index == 1)
        assert [assigner.assign(u) for u in UNITS[:200]] == admin.assign_many(name, UNITS[:200])


def test_refreshes_when_the_round_ends(scheduled_server):
    """With an hour-long TTL, only the round's ends_at can trigger the refreshes seen here."""
    with scheduled_server.client() as admin:
        name = "ends-" + uuid.uuid4().hex[:8]
        admin.create_experiment(
            name=name, arms=ARMS, metrics=["watch_time", "like_rate"],
            objective={"primary": "watch_time"}, round_seconds=1, seed=7,
        )
        with LocalAssigner(admin, name, ttl=3600, round_poll=0.05) as assigner:
            assert wait_until(lambda: assigner.round_index >= 3, timeout=20)
            # Compare with the server while both are in the same round.
            # Tolerance: one try straddles a round boundary only if the round (1 s) ends during its ~20 ms;
            # twenty tries in a row cannot all do so, and the first one in a single round is compared.
            for _ in range(20):
                local = [assigner.assign(u) for u in UNITS[:300]]
                served = admin.assign_many(name, UNITS[:300])
                if served[0].round == local[0].round:
                    break
            assert local == served


def test_keeps_serving_while_the_server_is_down(fresh_server, caplog):
    with fresh_server.client(timeout=2) as admin:
        name = "down-" + uuid.uuid4().hex[:8]
        admin.create_experiment(
            name=name, arms=ARMS, metrics=["watch_time", "like_rate"],
            objective={"primary": "watch_time"}, round_seconds=3600, seed=3,
        )
        before = admin.assign_many(name, UNITS[:100])
        caplog.set_level(logging.WARNING, logger="pasto_client")
        with LocalAssigner(admin, name, ttl=0.1, round_poll=0.05) as assigner:
            fresh_server.stop()
            assert wait_until(lambda: "Could not refresh" in caplog.text)
            assert [assigner.assign(u) for u in UNITS[:100]] == before

            fresh_server.start()
            admin.close_round(name)
            assert wait_until(lambda: assigner.round_index == 1, timeout=20)
            assert [assigner.assign(u) for u in UNITS[:100]] == admin.assign_many(name, UNITS[:100])


def test_concurrent_assignment_during_refreshes_is_consistent(admin, create_experiment):
    """Threads assign while rounds change under them: every answer must be the exact assignment
    of its unit in the round it reports (no mix of two snapshots)."""
    name = guarded_experiment(create_experiment)
    rng = np.random.default_rng(2)
    samples: list[tuple[str, Assignment]] = []
    rounds_seen: set[int] = set()
    stop = threading.Event()

    def worker(offset: int) -> None:
        # Assigns until the rounds have changed under it (no fixed count: an idle machine assigned a
        # fixed 200,000 units before the first round closed); every 50th answer is kept for checking.
        local: list[tuple[str, Assignment]] = []
        seen: set[int] = set()
        i = 0
        while not stop.is_set():
            unit = f"user-{offset}-{i}"
            assignment = assigner.assign(unit)
            seen.add(assignment.round)
            if i % 50 == 0:
                local.append((unit, assignment))
            i += 1
        samples.extend(local)
        rounds_seen.update(seen)

    with LocalAssigner(admin, name, ttl=0.05) as assigner:
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
        for thread in threads:
            thread.start()
        for _ in range(4):
            served = admin.assign_many(name, UNITS[:300])
            observe_assigned(admin, name, UNITS[:300], served, rng)
            admin.close_round(name)
            current = admin.get_experiment(name)["round"]["index"]
            wait_until(lambda: assigner.round_index == current)
        stop.set()
        for thread in threads:
            thread.join()

    rounds = {r["index"]: r["probabilities"] for r in admin.rounds(name)}
    cumulative = {index: cumulative_probabilities(p) for index, p in rounds.items()}
    assert len(rounds_seen) >= 2 and len({a.round for _, a in samples}) >= 2
    for unit, a in samples:
        k = choose_arm(cumulative[a.round], bucket(12345, unit, a.round))
        assert a.arm == ARMS[k]["name"]
        assert a.probability == rounds[a.round][k]


def test_offline_assigner_from_an_experiment_document(admin, create_experiment):
    name = guarded_experiment(create_experiment)
    document = admin.get_experiment(name)
    offline = LocalAssigner(None, name, experiment=document)
    assert [offline.assign(u) for u in UNITS[:100]] == admin.assign_many(name, UNITS[:100])
    offline.refresh()  # no client: nothing to fetch
    offline.close()


@pytest.mark.parametrize(
    "kwargs, message",
    [({"ttl": 0}, "TTL"), ({"round_poll": -1}, "round_poll"), ({"client": None}, "Give a client")],
)
def test_invalid_arguments(kwargs, message):
    arguments = {"client": None, "experiment_name": "x", "experiment": {}}
    arguments.update(kwargs)
    if "client" in kwargs and kwargs["client"] is None:
        arguments.pop("experiment")
    with pytest.raises(ValueError, match=message):
        LocalAssigner(**arguments)


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**63 - 1),
    round_index=st.integers(0, 2**31 - 1),
    weights=st.lists(st.floats(0, 1e6, allow_nan=False, allow_infinity=False), min_size=1, max_size=30)
    .filter(lambda w: sum(w) > 0),
    units=st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=30),
    status=st.sampled_from(["running", "paused", "stopped"]),
)
def test_assign_is_the_shared_core_choice(seed, round_index, weights, units, status):
    """Per call and in batch, an offline assigner answers choose_arm(bucket(...)) for any mixture,
    including zero-probability arms and unnormalised weights."""
    arms = [{"name": f"arm-{k}", "params": {"k": k}} for k in range(len(weights))]
    other = [1.0] * len(weights)
    document = {
        "status": status, "seed": seed, "arms": arms,
        "round": {"index": round_index, "started_at": None, "ends_at": None},
        "probabilities": other if status == "stopped" else weights,
        "deployed": weights if status == "stopped" else other,
    }
    assigner = LocalAssigner(None, "x", experiment=document)
    cumulative = cumulative_probabilities(weights)
    expected = [choose_arm(cumulative, bucket(seed, unit, round_index)) for unit in units]
    assert [int(a.arm.removeprefix("arm-")) for a in map(assigner.assign, units)] == expected
    assert [int(a.arm.removeprefix("arm-")) for a in assigner.assign_many(units)] == expected
    assert all(weights[k] > 0 for k in expected)
    assert all(a.round == round_index and a.probability == weights[k]
               for a, k in zip(map(assigner.assign, units), expected))


def test_polling_an_overdue_round_backs_off(admin, create_experiment):
    """Without a scheduler a round past its end stays open: the poll delay doubles up to the TTL."""
    name = guarded_experiment(create_experiment, round_seconds=1)
    with LocalAssigner(admin, name, ttl=0.5, round_poll=0.1) as assigner:
        assert wait_until(lambda: assigner._snapshot.overdue_poll > 0, timeout=10)
        assigner.close()  # refresh by hand from here on
        delays = []
        for _ in range(5):
            assigner.refresh()
            delays.append(assigner._snapshot.overdue_poll)
        assert delays[-3:] == [0.5, 0.5, 0.5]
        assert all(later == min(0.5, 2 * earlier) for earlier, later in zip(delays, delays[1:]))
        admin.close_round(name)
        assigner.refresh()
        # A new round starts the back-off afresh (it may itself be overdue on a slow machine).
        assert assigner.round_index == 1 and assigner._snapshot.overdue_poll in (0.0, 0.1)


SEGMENTS = ["new", "returning", "mobile"]


def test_segmented_local_assignment_is_exactly_the_servers(admin, create_experiment, tmp_path):
    """10,000 units in three segments: LocalAssigner (per call and in batch) gives every unit the
    server's arm and propensity, over rounds whose per-segment mixtures move apart; the exposure log
    records each unit's segment."""
    import json

    from pasto_client import JsonLinesSink

    name = create_experiment(
        objective={"primary": "watch_time",
                   "guardrails": [{"metric": "like_rate", "threshold": 0.5, "hard": True}]},
        segments={"names": SEGMENTS, "shares": [0.5, 0.3, 0.2]},
    )
    units = [f"unit-{i}" for i in range(10_000)]
    segments = [SEGMENTS[i % 3] for i in range(10_000)]
    rng = np.random.default_rng(4)
    # Watch time ranks the arms the other way round in "returning": the segments' mixtures differ.
    means = {"a": (2.0, 0.2), "b": (1.5, 0.5), "c": (1.0, 0.8), "d": (0.5, 0.6)}
    path = tmp_path / "exposures.jsonl"
    with LocalAssigner(admin, name, ttl=3600, exposure_sink=JsonLinesSink(path)) as assigner:
        assert assigner.segments == tuple(SEGMENTS)
        for round_index in range(4):
            assigner.refresh()
            served = []
            for start in range(0, len(units), 5000):
                served += admin.assign_many(name, units[start:start + 5000], segments[start:start + 5000])
            assert assigner.assign_many(units, segments) == served
            assert [assigner.assign(unit, segment) for unit, segment in zip(units[:2000], segments[:2000])] \
                == served[:2000]
            assert {a.segment for a in served} == set(SEGMENTS)
            observations = []
            for unit, segment, a in zip(units[:3000], segments[:3000], served[:3000]):
                x, y = means[a.arm]
                if segment == "returning":
                    x = -x
                observations.append({"id": f"{round_index}-{unit}", "unit": unit, "round": a.round,
                                     "segment": segment, "values": {"watch_time": x + rng.normal(0, 0.3),
                                                                    "like_rate": y + rng.normal(0, 0.1)}})
            admin.observe(name, observations)
            admin.close_round(name)
        mixtures = admin.get_experiment(name)["segments"]["probabilities"]
        assert np.abs(np.array(mixtures["new"]) - np.array(mixtures["returning"])).max() > 0.2
        with pytest.raises(ValueError, match="Unknown segment 'tablet'"):
            assigner.assign("u", "tablet")
        with pytest.raises(ValueError, match="give the unit's segment"):
            assigner.assign_many(["u"])
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 4 * (10_000 + 2000)
    assert [record["segment"] for record in records[:10_000]] == segments


def _offline_document(n_arms: int, params=lambda k, n: {"w_watch": 1.0, "w_like": k / n}) -> dict:
    weights = np.random.default_rng(n_arms).dirichlet(np.ones(n_arms)).tolist()
    return {
        "status": "running", "seed": 20260101, "round": {"index": 3, "started_at": None, "ends_at": None},
        "arms": [{"name": f"setting-{k}", "params": params(k, n_arms)} for k in range(n_arms)],
        "probabilities": weights, "deployed": weights, "updated_at": "2026-01-01T00:00:00+00:00",
    }


def test_assigner_holds_little_more_per_arm_than_the_cumulative_mixture_and_the_names():
    """At K = 10,000 a fresh assigner holds its mixture and cumulative mixture (float64), the arm
    names and the parameters by column; an arm's Assignment is built when the arm is first drawn."""
    import sys
    import tracemalloc

    n_arms = 10_000
    document = _offline_document(n_arms)
    names = sum(sys.getsizeof(arm["name"]) + 8 for arm in document["arms"])
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        assigner = LocalAssigner(None, "ranking", experiment=document)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    bare = 8 * n_arms + names  # the cumulative mixture as float64 and the names
    assert held < bare + 48 * n_arms, (held / n_arms, bare / n_arms)
    units = [f"user-{i}" for i in range(20_000)]
    cumulative = cumulative_probabilities(document["probabilities"])
    expected = [choose_arm(cumulative, bucket(20260101, unit, 3)) for unit in units]
    assert [a.arm for a in assigner.assign_many(units)] == [f"setting-{k}" for k in expected]
    first = assigner.assign(units[0])
    assert first.params == {"w_watch": 1.0, "w_like": expected[0] / n_arms}
    assert first.probability == document["probabilities"][expected[0]]


def test_arms_first_drawn_from_many_threads_get_one_assignment_object_each():
    document = _offline_document(50, params=lambda k, n: {"k": k} if k % 2 else {"k": k, "odd": False})
    units = [f"user-{i}" for i in range(3000)]
    for _ in range(5):
        assigner = LocalAssigner(None, "ranking", experiment=document)
        results: list[list[Assignment]] = [None] * 8  # type: ignore[list-item]
        barrier = threading.Barrier(8)

        def work(slot: int) -> None:
            barrier.wait()
            results[slot] = (assigner.assign_many(units) if slot % 2 else [assigner.assign(u) for u in units])

        threads = [threading.Thread(target=work, args=(slot,)) for slot in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        by_arm: dict[str, Assignment] = {}
        for answers in results:
            for answer in answers:
                assert by_arm.setdefault(answer.arm, answer) is answer
        k = int(next(iter(by_arm.values())).arm.split("-")[1])
        assert dict(by_arm[f"setting-{k}"].params) == ({"k": k} if k % 2 else {"k": k, "odd": False})


@pytest.mark.parametrize("shape", ["dirichlet", "uneven", "three arms", "uniform"])
def test_batch_draw_over_many_arms_is_the_inverse_cdf_for_every_bucket(shape):
    """Over 1,024 arms and more, batches draw through a guide table: the same arm as a binary search
    over the cumulative mixture for every bucket, at and around every cumulative value too."""
    from pasto_client.assigner import _Arms, _ServedMixture

    rng = np.random.default_rng(len(shape))
    for n_arms in (1024, 5000, 100_000):
        weights = {"dirichlet": lambda: rng.dirichlet(np.ones(n_arms)),
                   "uneven": lambda: rng.dirichlet(np.full(n_arms, 0.01)),
                   "three arms": lambda: np.bincount(rng.integers(0, n_arms, 3), minlength=n_arms).astype(float),
                   "uniform": lambda: np.ones(n_arms)}[shape]()
        served = _ServedMixture(_Arms([{"name": f"a{k}"} for k in range(n_arms)]), weights.tolist(), 0, None, "x", None)
        cumulative = np.frombuffer(served.cumulative, dtype=np.float64)
        u = np.concatenate([rng.random(5000), cumulative[:-1], np.nextafter(cumulative[:-1], 0.0),
                            np.nextafter(cumulative[:-1], 1.0)])
        u = u[(u >= 0.0) & (u < 1.0)]
        np.testing.assert_array_equal(served.draw(u), np.searchsorted(cumulative, u, side="right"))
