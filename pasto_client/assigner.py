"""Local assignment: serve an experiment's mixture in-process, exactly as the server assigns.

:class:`LocalAssigner` fetches the experiment once through a :class:`~pasto_client.client.Client`, then
assigns units with the server's hashing (:mod:`pasto.hashing`) and refreshes in a background thread.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Any

import numpy as np

from pasto.hashing import PrefixHasher, buckets, cumulative_probabilities
from pasto_client.client import Assignment, Client
from pasto_client.errors import PastoError
from pasto_client.exposure import ExposureContext, ExposureLog, ExposureSink, exposure_context

logger = logging.getLogger(__name__)
_monotonic = time.monotonic
_time_ns = time.time_ns


class _Arms:
    """The experiment's arms as a :class:`LocalAssigner` keeps them: names, and parameters stored by
    column when every arm has the same parameter names (a tuple of values per arm, not a dict)."""

    __slots__ = ("names", "_keys", "_values")

    def __init__(self, arms: Sequence[Mapping[str, Any]]) -> None:
        self.names: tuple[str, ...] = tuple(arm["name"] for arm in arms)
        params = [arm.get("params") or {} for arm in arms]
        keys = tuple(params[0]) if params else ()
        if all(tuple(p) == keys for p in params):
            self._keys: tuple[str, ...] | None = keys
            self._values: tuple = tuple(tuple(p.values()) for p in params)
        else:
            self._keys = None
            self._values = tuple(dict(p) for p in params)

    def __len__(self) -> int:
        return len(self.names)

    def params(self, k: int) -> Mapping[str, Any]:
        """Arm ``k``'s parameters: a new read-only mapping (each arm's is built once per snapshot)."""
        values = self._values[k]
        return MappingProxyType(dict(values) if self._keys is None else dict(zip(self._keys, values)))


class _ServedMixture:
    """One served mixture (the experiment's, or one segment's) over the arms, for one round.

    Per arm it holds the probability and the cumulative probability (float64 arrays) and one slot
    for the arm's :class:`Assignment`, built the first time the arm is drawn and then returned to
    every unit drawing it in the round (and one for its :class:`ExposureContext` with a sink).
    """

    __slots__ = ("mixture", "cumulative", "assignments", "exposures", "arms", "round_index", "segment",
                 "_built", "_logged", "_built_objects", "_logged_objects", "_experiment", "_mixture_version",
                 "_lock", "_guide")
    # (K,) object arrays mirroring assignments / exposures, which batches index in C (``take``), and
    # (K,) bools saying which of their slots are filled.

    def __init__(self, arms: _Arms, mixture: Sequence[float], round_index: int, segment: str | None,
                 experiment: str, mixture_version: str | None) -> None:
        n_arms = len(arms)
        if len(mixture) != n_arms:
            raise ValueError(
                f"The experiment has {n_arms} arms but a mixture of {len(mixture)} probabilities."
                if segment is None else
                f"Segment {segment!r} has a mixture of {len(mixture)} probabilities for {n_arms} arms."
            )
        self.arms = arms
        self.mixture = array("d", mixture)
        self.cumulative = array("d", cumulative_probabilities(self.mixture))
        self.round_index = round_index
        self.segment = segment
        #: (K,) each arm's Assignment once drawn, else None: the hot path reads it without a lock.
        self.assignments: list[Assignment | None] = [None] * n_arms
        #: (K,) each arm's ExposureContext once logged, else None.
        self.exposures: list[ExposureContext | None] = [None] * n_arms
        self._built = np.zeros(n_arms, dtype=bool)
        self._logged = np.zeros(n_arms, dtype=bool)
        self._built_objects = np.full(n_arms, None, dtype=object)
        self._logged_objects = np.full(n_arms, None, dtype=object)
        self._experiment = experiment
        self._mixture_version = mixture_version
        self._lock = threading.Lock()
        self._guide: np.ndarray | None = None

    def assignment(self, k: int) -> Assignment:
        """Arm ``k``'s assignment, built on first use; one object per arm whichever thread asks first."""
        with self._lock:
            built = self.assignments[k]
            if built is None:
                built = Assignment(arm=self.arms.names[k], params=self.arms.params(k), round=self.round_index,
                                   probability=self.mixture[k], segment=self.segment)
                self.assignments[k] = self._built_objects[k] = built
                self._built[k] = True
            return built

    def exposure(self, k: int) -> ExposureContext:
        """Arm ``k``'s exposure context, built on first use."""
        with self._lock:
            context = self.exposures[k]
            if context is None:
                context = exposure_context(self._experiment, self.round_index, self.arms.names[k], k,
                                           self.mixture[k], self._mixture_version, segment=self.segment)
                self.exposures[k] = self._logged_objects[k] = context
                self._logged[k] = True
            return context

    def draw(self, u: np.ndarray) -> np.ndarray:
        """The arm positions of buckets ``u`` (N,): the smallest k with u < cumulative[k]
        (``np.searchsorted(cumulative, u, side="right")``, which it equals for every u)."""
        cumulative = np.frombuffer(self.cumulative, dtype=np.float64)
        n_arms = cumulative.size
        if n_arms < _GUIDE_FROM_ARMS or u.size < 64:
            return np.searchsorted(cumulative, u, side="right")
        # A binary search over 100,000 arms misses the cache at every step. A guide table (built on the
        # first batch: 4 bytes per arm) gives, for each of K equal slices of [0, 1), the answer at its
        # left end; from there an answer is a step or two away for any mixture whose mass is not
        # piled on a few slices. Units still moving after a few steps are searched the plain way.
        guide = self._guide
        if guide is None:
            guide = self._guide = np.searchsorted(cumulative, np.arange(n_arms + 1) / n_arms, side="right"
                                                  ).astype(np.int32)
        k = guide.take(np.minimum((u * n_arms).astype(np.int64), n_arms - 1)).astype(np.int64)
        np.minimum(k, n_arms - 1, out=k)
        for _ in range(_GUIDE_STEPS):  # the slice's left end can round above u: step back
            back = (k > 0) & (cumulative.take(np.maximum(k - 1, 0)) > u)
            if not back.any():
                break
            k[back] -= 1
        else:
            return np.searchsorted(cumulative, u, side="right")
        for _ in range(_GUIDE_STEPS):
            ahead = (k < n_arms - 1) & (cumulative.take(k) <= u)
            if not ahead.any():
                return k
            k[ahead] += 1
        moving = (k < n_arms - 1) & (cumulative.take(k) <= u)
        k[moving] = np.searchsorted(cumulative, u[moving], side="right")
        return k

    def assignments_of(self, arms: np.ndarray) -> list[Assignment]:
        """The assignments of arm positions ``arms`` (N,), in order."""
        return _pick(self._built_objects, self._built, arms, self.assignment)

    def exposures_of(self, arms: np.ndarray) -> list[ExposureContext]:
        """The exposure contexts of arm positions ``arms`` (N,), in order."""
        return _pick(self._logged_objects, self._logged, arms, self.exposure)


# Batches over at least this many arms draw through a guide table (``_ServedMixture.draw``), which
# tries this many steps from the table's answer before a plain search.
_GUIDE_FROM_ARMS = 1024
_GUIDE_STEPS = 4


def _pick(slots: np.ndarray, filled: np.ndarray, positions: np.ndarray, build: Callable[[int], Any]) -> list:
    """``[slots[k] for k in positions]`` at C speed, building (``build(k)``) the slots not yet ``filled``."""
    missing = ~filled.take(positions)
    if missing.any():
        for k in np.unique(positions[missing]).tolist():
            build(k)
    return slots.take(positions).tolist()


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """Everything needed to assign locally in one round, precomputed once."""

    round_index: int
    status: str
    seed: int
    served: _ServedMixture              # the mixture served: probabilities, or deployed if stopped
    cumulative: array                   # (K,) served.cumulative, here for the hot path
    assignments: list                   # (K,) served.assignments, here for the hot path
    hasher: PrefixHasher
    hash_unit: Callable[[str], float]    # hasher.__call__ bound once: cheaper to call than hasher
    refresh_at: float                   # time.monotonic() after which the snapshot is refreshed
    overdue_poll: float = 0.0           # current poll delay while the round is past its ends_at
    # Segmented experiments: per segment name, the mixture served to it.
    segments: Mapping[str, _ServedMixture] | None = None
    # Open sets: the long tail's mixture, served to values without one of their own (and to no value).
    tail: _ServedMixture | None = None
    mixture_version: str | None = None  # the experiment's updated_at when it was fetched


def _parse_timestamp(value: str | None) -> datetime | None:
    if value is None:
        return None
    parsed = datetime.fromisoformat(value)
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=timezone.utc)


class LocalAssigner:
    """Assign units to arms in-process, exactly as the server would, without an HTTP round trip.

    The experiment is fetched once; afterwards :meth:`assign` costs one hash of the unit and a
    bisection over the cumulative mixture, with no lock, clock or I/O on the way. A background
    thread refreshes the experiment when the round's ``ends_at`` passes (polling every
    ``round_poll`` seconds until the server has opened the next round) and at the latest ``ttl``
    seconds after the last fetch. If a refresh fails, a warning is logged, the last mixture keeps
    being served and the refresh is retried with exponential backoff (up to ``ttl``). Thread-safe:
    every call reads one immutable snapshot, which the refresher replaces atomically.

    The served mixture follows the server: ``probabilities`` (p_t) while the experiment is running
    or paused, ``deployed`` once it is stopped. Around a round change the assigner may serve the
    previous round for up to ``round_poll`` seconds (or longer while the server is unreachable);
    such assignments carry their round, so their observations are still attributed correctly (the
    server keeps them as late observations of that round).

    Parameters
    ----------
    client : Client or None
        Where to fetch the experiment. None only together with ``experiment``: a fixed, offline
        assigner that never refreshes.
    experiment_name : str
    ttl : float
        Maximum age in seconds of the served mixture before it is fetched again.
    round_poll : float
        Seconds before fetching again once a round is past its ``ends_at`` but the server has not
        yet opened the next one (the scheduler closes rounds shortly after ``ends_at``; the delay
        doubles, up to ``ttl``, while the round stays open), and the first retry delay after a
        failed fetch.
    experiment : dict, optional
        An experiment document as returned by :meth:`Client.get_experiment` (e.g. cached on disk) to
        start from instead of fetching, so a process can start while the server is unreachable.
    exposure_sink : ExposureSink, callable, ExposureLog or None
        Where to log one exposure per assigned unit (:mod:`pasto_client.exposure`): a sink
        (``JsonLinesSink(path)``, ``ParquetSink(path)``, ``CallbackSink(f)``), a callable taking a
        list of record dicts, or an :class:`ExposureLog` built with other batching settings. The
        assigner owns it: :meth:`close` writes what is queued and closes the sink. :meth:`assign`
        then also appends ``(unit, arm context, time)`` to the log's in-memory queue; the
        records are built and written by the log's background thread.
    """

    def __init__(
        self,
        client: Client | None,
        experiment_name: str,
        ttl: float = 30.0,
        round_poll: float = 0.25,
        experiment: Mapping[str, Any] | None = None,
        exposure_sink: ExposureSink | ExposureLog | Callable[[list[dict]], None] | None = None,
    ) -> None:
        if not (ttl > 0):
            raise ValueError(f"The TTL must be a positive number of seconds, got {ttl!r}.")
        if not (round_poll > 0):
            raise ValueError(f"round_poll must be a positive number of seconds, got {round_poll!r}.")
        if client is None and experiment is None:
            raise ValueError("Give a client to fetch the experiment from, or an experiment document.")
        self.client = client
        self.experiment_name = experiment_name
        self.ttl = float(ttl)
        self.round_poll = float(round_poll)
        self._lock = threading.Lock()  # serialises refreshes, never taken by assign
        self._stopped = threading.Event()
        if experiment is None:
            experiment = client.get_experiment(experiment_name)
        self._snapshot: _Snapshot = self._build_snapshot(experiment)
        #: The exposure log, or None without an exposure sink.
        self.exposures: ExposureLog | None = None
        if exposure_sink is not None:
            self.exposures = (
                exposure_sink if isinstance(exposure_sink, ExposureLog)
                else ExposureLog(exposure_sink, name=experiment_name)
            )
            self._put_exposure = self.exposures.put
            # Instance attributes shadow the methods: without a sink, assign stays exactly the
            # unlogged hot path (not even a test for the sink is added to it).
            self.assign = self._assign_logged  # type: ignore[method-assign]
            self.assign_many = self._assign_many_logged  # type: ignore[method-assign]
        self._thread: threading.Thread | None = None
        if client is not None:
            self._thread = threading.Thread(
                target=self._refresh_loop, name=f"pasto-assigner-{experiment_name}", daemon=True
            )
            self._thread.start()

    # -- the hot path ------------------------------------------------------------------------------

    def assign(self, unit: str, segment: str | None = None) -> Assignment:
        """The assignment of ``unit`` in the current round (the same object for every unit on the
        same arm in the same round). A segmented experiment needs the unit's ``segment`` and draws
        from that segment's mixture (``ValueError`` naming a missing or unknown one, as the server's 422)."""
        snapshot = self._snapshot
        try:
            u = snapshot.hash_unit(unit)
        except AttributeError:
            raise TypeError(f"The unit must be a string, got {type(unit).__name__}.") from None
        if segment is not None or snapshot.segments is not None:
            served = _segment_mixture(snapshot, self.experiment_name, segment)
            k = bisect_right(served.cumulative, u)
            return served.assignments[k] or served.assignment(k)
        # u < 1.0 == cumulative[-1], so the index is always a valid arm: this is choose_arm without
        # its (here moot) clamp, inlined because it is the hot path.
        k = bisect_right(snapshot.cumulative, u)
        return snapshot.assignments[k] or snapshot.served.assignment(k)

    def assign_many(self, units: Sequence[str], segments: Sequence[str] | str | None = None) -> list[Assignment]:
        """Vectorised :meth:`assign` (numpy hashing): the assignments of ``units``, in order, all from
        one snapshot. ``segments``: one per unit, or one name for all of them (segmented experiments)."""
        snapshot = self._snapshot
        u = buckets(snapshot.seed, units, snapshot.round_index)
        if segments is not None or snapshot.segments is not None:
            return [served.assignments[k] or served.assignment(k)
                    for served, k in self._segment_arms(snapshot, units, segments, u)]
        served = snapshot.served
        return served.assignments_of(served.draw(u))

    def _assign_logged(self, unit: str, segment: str | None = None) -> Assignment:
        """:meth:`assign` with an exposure sink: also queues the exposure (no I/O, no wait)."""
        snapshot = self._snapshot
        try:
            u = snapshot.hash_unit(unit)
        except AttributeError:
            raise TypeError(f"The unit must be a string, got {type(unit).__name__}.") from None
        served = snapshot if segment is None and snapshot.segments is None else _segment_mixture(
            snapshot, self.experiment_name, segment)
        served = served.served if served is snapshot else served
        k = bisect_right(served.cumulative, u)
        if not self._put_exposure((unit, served.exposures[k] or served.exposure(k), _time_ns())):
            self.exposures.refused(1)
        return served.assignments[k] or served.assignment(k)

    def _assign_many_logged(self, units: Sequence[str], segments: Sequence[str] | str | None = None
                            ) -> list[Assignment]:
        """:meth:`assign_many` with an exposure sink: also queues one exposure per unit, all
        stamped with the time of the call."""
        snapshot = self._snapshot
        u = buckets(snapshot.seed, units, snapshot.round_index)
        if segments is not None or snapshot.segments is not None:
            drawn = self._segment_arms(snapshot, units, segments, u)
            self.exposures.record_many(units, [served.exposures[k] or served.exposure(k) for served, k in drawn])
            return [served.assignments[k] or served.assignment(k) for served, k in drawn]
        served = snapshot.served
        arms = served.draw(u)
        self.exposures.record_many(units, served.exposures_of(arms))
        return served.assignments_of(arms)

    def _segment_arms(self, snapshot: _Snapshot, units: Sequence[str], segments: Sequence[str] | str | None,
                      u) -> list[tuple[_ServedMixture, int]]:
        """(segment mixture, arm position) of each unit; ``u`` their buckets, shape (N,)."""
        if segments is None or isinstance(segments, str):
            segments = [segments] * len(units)
        elif len(segments) != len(units):
            raise ValueError(f"Give one segment per unit: {len(units)} units, {len(segments)} segments.")
        mixtures = [_segment_mixture(snapshot, self.experiment_name, segment) for segment in segments]
        return [(served, bisect_right(served.cumulative, bucket)) for served, bucket in zip(mixtures, u.tolist())]

    # -- state -------------------------------------------------------------------------------------

    @property
    def round_index(self) -> int:
        """The round of the snapshot being served."""
        return self._snapshot.round_index

    @property
    def status(self) -> str:
        """The experiment's status when it was last fetched (running, paused or stopped)."""
        return self._snapshot.status

    @property
    def mixture(self) -> tuple[float, ...]:
        """The mixture being served, aligned with :attr:`arms`."""
        return tuple(self._snapshot.served.mixture)

    @property
    def mixture_version(self) -> str | None:
        """The experiment's ``updated_at`` when it was last fetched: what identifies the served mixture
        (exposure records and the server's OFREP metadata carry the same string)."""
        return self._snapshot.mixture_version

    @property
    def arms(self) -> tuple[str, ...]:
        """Arm names, in the server's order."""
        return self._snapshot.served.arms.names

    def refresh(self) -> None:
        """Fetch the experiment now (blocking) and serve it; raises if the server cannot be reached
        (the previous snapshot then stays in service)."""
        if self.client is None:
            return
        with self._lock:
            experiment = self.client.get_experiment(self.experiment_name)
            self._snapshot = self._build_snapshot(experiment, previous=self._snapshot)

    def close(self, timeout: float | None = None) -> None:
        """Stop the background refresher (the last snapshot keeps being served, exposures of later
        assignments are dropped and counted), then write the queued exposures and close the
        exposure sink, waiting up to ``timeout`` seconds for them.

        Raises
        ------
        TimeoutError, Exception
            From :meth:`ExposureLog.close`: exposures not written in time, or the first sink error
            not handled by the log's ``on_error``.
        """
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self.exposures is not None:
            self.exposures.close(timeout)

    def __enter__(self) -> LocalAssigner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _refresh_loop(self) -> None:
        failures = 0
        while not self._stopped.is_set():
            # Recomputed every pass: refresh() may have been called from another thread meanwhile.
            delay = self._snapshot.refresh_at - _monotonic()
            if delay > 0:
                self._stopped.wait(delay)
                continue
            try:
                self.refresh()
            except (PastoError, KeyError, TypeError, ValueError) as error:
                failures += 1
                retry_in = min(self.ttl, self.round_poll * 2 ** min(failures - 1, 30))
                current = self._snapshot
                logger.warning(
                    "Could not refresh experiment %r (%s); serving the mixture of round %d, "
                    "retrying in %.2f s.",
                    self.experiment_name, error, current.round_index, retry_in,
                )
                with self._lock:
                    self._snapshot = replace(self._snapshot, refresh_at=_monotonic() + retry_in)
            else:
                failures = 0

    @property
    def segments(self) -> tuple[str, ...]:
        """The segment names of a segmented experiment (empty otherwise)."""
        return tuple(self._snapshot.segments or ())

    def _build_snapshot(
        self, experiment: Mapping[str, Any], previous: _Snapshot | None = None
    ) -> _Snapshot:
        fetched_at = _monotonic()
        status = experiment["status"]
        round_info = experiment["round"]
        round_index = int(round_info["index"])
        arms = _Arms(experiment["arms"])
        mixture_version = experiment.get("updated_at")
        served = _ServedMixture(
            arms, [float(x) for x in (experiment["deployed"] if status == "stopped" else experiment["probabilities"])],
            round_index, None, self.experiment_name, mixture_version,
        )
        seed = int(experiment["seed"])
        same_round = previous is not None and previous.seed == seed and previous.round_index == round_index
        delay = self.ttl
        overdue_poll = 0.0
        ends_at = _parse_timestamp(round_info.get("ends_at"))
        if status == "running" and ends_at is not None:
            remaining = (ends_at - datetime.now(timezone.utc)).total_seconds()
            if remaining > 0:
                delay = min(delay, remaining)
            else:
                # A round past its end is normally closed by the scheduler within a second; poll
                # for it, backing off in case no scheduler runs (rounds closed by hand).
                overdue_poll = self.round_poll
                if same_round and previous.overdue_poll > 0:
                    overdue_poll = min(self.ttl, 2 * previous.overdue_poll)
                delay = min(delay, overdue_poll)
        hasher = previous.hasher if same_round else PrefixHasher(seed, round_index)
        segments = tail = None
        if experiment.get("segments") is not None:
            view = experiment["segments"]
            per_segment = view["deployed"] if status == "stopped" else view["probabilities"]
            segments = MappingProxyType({
                name: _ServedMixture(arms, [float(x) for x in per_segment[name]], round_index, name,
                                     self.experiment_name, mixture_version)
                for name in view["names"]
            })
            if view.get("by") is not None:
                tail = segments[view["names"][0]]
        return _Snapshot(
            round_index=round_index,
            status=status,
            seed=seed,
            served=served,
            cumulative=served.cumulative,
            assignments=served.assignments,
            hasher=hasher,
            hash_unit=hasher.__call__,
            refresh_at=fetched_at + delay,
            overdue_poll=overdue_poll,
            segments=segments,
            tail=tail,
            mixture_version=experiment.get("updated_at"),
        )


def _segment_mixture(snapshot: _Snapshot, experiment: str, segment: str | None) -> _ServedMixture:
    """The mixture ``segment`` is served in ``snapshot``; ``ValueError`` with the server's words otherwise."""
    if snapshot.segments is None:
        raise ValueError(f"Experiment {experiment!r} has no segments; send no segment.")
    if snapshot.tail is not None:
        return snapshot.segments.get(segment, snapshot.tail)
    if segment is None:
        raise ValueError(f"Experiment {experiment!r} is segmented: give the unit's segment, one of "
                         f"{list(snapshot.segments)}.")
    served = snapshot.segments.get(segment)
    if served is None:
        raise ValueError(f"Unknown segment {segment!r}; the segments are {list(snapshot.segments)}.")
    return served
