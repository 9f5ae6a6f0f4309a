"""Python client for the pasto controller: HTTP calls, local assignment and buffered observations.

Three pieces, each usable on its own:

- :class:`Client` wraps every route of the HTTP API in a typed method and turns the server's JSON
  errors into :class:`PastoAPIError`.
- :class:`LocalAssigner` fetches an experiment's mixture, seed and round once and then assigns units
  in-process, without an HTTP round trip, with the same hashing as the server
  (:mod:`pasto.hashing`), so a unit gets exactly the arm the server would give it. It refreshes when
  the round ends or its TTL expires and keeps serving the last mixture while the server is unreachable.
- :class:`ObservationBuffer` batches observations in a background thread, stamps each with an
  idempotency id when it is added (so retries never double count), retries network errors and 5xx
  with exponential backoff, and never drops anything silently.

The module depends on the standard library, numpy (through :mod:`pasto.hashing`) and requests only;
it never imports Flask or SQLAlchemy, so a recommender can use it without the service installed.
"""

from __future__ import annotations

import atexit
import collections
import logging
import math
import random
import threading
import time
import uuid
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Any
from urllib.parse import quote, urlencode

import requests

from pasto.hashing import PrefixHasher, buckets, choose_arms, cumulative_probabilities

__all__ = [
    "Assignment",
    "BufferOverflowError",
    "Client",
    "LocalAssigner",
    "ObservationBuffer",
    "PastoAPIError",
    "PastoConnectionError",
    "PastoError",
]

logger = logging.getLogger("pasto.client")
_monotonic = time.monotonic

API_PREFIX = "/api/v1"
#: Seconds an ObservationBuffer that was never closed may spend sending its queue at exit.
EXIT_FLUSH_SECONDS = 10.0


# --------------------------------------------------------------------------------------------------
# Errors


class PastoError(Exception):
    """Base class of every error raised by :mod:`pasto.client`."""


class PastoAPIError(PastoError):
    """The server answered with an error status.

    Attributes
    ----------
    status : int
        The HTTP status code.
    code : str
        The server's machine-readable error code (``"http_error"`` when the body was not pasto JSON,
        for example an error page from a proxy).
    message : str
        The server's human-readable message.
    details : object
        The server's ``details`` (often names the offending field or item), or None.
    """

    def __init__(self, status: int, code: str, message: str, details: Any = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.details = details

    @property
    def retryable(self) -> bool:
        """True for errors worth retrying unchanged: 5xx and 429 (too many requests)."""
        return self.status >= 500 or self.status == 429


class PastoConnectionError(PastoError):
    """The server could not be reached or did not answer in time (the request may or may not have
    been processed)."""


class BufferOverflowError(PastoError):
    """:meth:`ObservationBuffer.add` was called while the buffer already held ``max_queue`` pending
    observations and no ``on_overflow`` callback was given."""


# --------------------------------------------------------------------------------------------------
# Assignment


@dataclass(frozen=True, slots=True)
class Assignment:
    """The arm a unit is assigned to.

    Attributes
    ----------
    arm : str
        The arm's name.
    params : Mapping[str, Any]
        The arm's strategic parameters (read-only view; ``dict(params)`` for a copy).
    round : int
        The round the assignment belongs to; report it with the unit's observations.
    probability : float
        The propensity of ``arm`` in the mixture the unit was drawn from.
    """

    arm: str
    params: Mapping[str, Any]
    round: int
    probability: float


def _assignment_from_json(body: Mapping[str, Any]) -> Assignment:
    return Assignment(
        arm=body["arm"],
        params=MappingProxyType(dict(body["params"])),
        round=int(body["round"]),
        probability=float(body["probability"]),
    )


# --------------------------------------------------------------------------------------------------
# HTTP client


class Client:
    """Typed access to every route of a pasto server.

    Parameters
    ----------
    base_url : str
        Root of the server, e.g. ``"http://127.0.0.1:8000"``.
    token : str or None
        Bearer token (role ``read``, ``ingest`` or ``admin``, depending on the calls you make).
    timeout : float
        Seconds to wait for the server to connect and to answer each request.
    session : requests.Session, optional
        A session to reuse (connection pooling, proxies, TLS settings); one is created otherwise.

    Every method raises :class:`PastoAPIError` when the server answers with an error and
    :class:`PastoConnectionError` when it cannot be reached.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None,
        timeout: float = 10.0,
        session: requests.Session | None = None,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"The base URL must start with http:// or https://, got {base_url!r}.")
        if not (timeout > 0):
            raise ValueError(f"The timeout must be a positive number of seconds, got {timeout!r}.")
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self._session = session if session is not None else requests.Session()
        self._headers = {"Accept": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"

    def __repr__(self) -> str:
        return f"Client({self.base_url!r})"

    # -- plumbing ----------------------------------------------------------------------------------

    def request(self, method: str, path: str, json: Any = None) -> Any:
        """Send one request to ``path`` (relative to the base URL) and return the decoded JSON body."""
        url = self.base_url + path
        try:
            response = self._session.request(
                method, url, json=json, headers=self._headers, timeout=self.timeout
            )
        except requests.RequestException as error:
            raise PastoConnectionError(f"{method} {url} failed: {error}") from error
        if response.status_code >= 400:
            raise _api_error(response)
        if response.status_code == 204 or not response.content:
            return None
        try:
            return response.json()
        except ValueError as error:
            raise PastoAPIError(
                response.status_code,
                "invalid_response",
                f"The server answered {method} {url} with a body that is not JSON.",
            ) from error

    def close(self) -> None:
        """Close the underlying HTTP session."""
        self._session.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @staticmethod
    def _experiment_path(name: str, suffix: str = "") -> str:
        return f"{API_PREFIX}/experiments/{quote(name, safe='')}{suffix}"

    # -- service -----------------------------------------------------------------------------------

    def health(self) -> dict:
        """``GET /healthz``: database reachable, scheduler alive, schema version."""
        return self.request("GET", "/healthz")

    def openapi(self) -> dict:
        """``GET /api/v1/openapi.json``: the OpenAPI document of the server."""
        return self.request("GET", f"{API_PREFIX}/openapi.json")

    # -- experiments -------------------------------------------------------------------------------

    def create_experiment(
        self,
        name: str,
        arms: Sequence[Mapping[str, Any]],
        metrics: Sequence[str],
        objective: Mapping[str, Any],
        round_seconds: float,
        settle_seconds: float = 0.0,
        algorithm: Mapping[str, Any] | None = None,
        seed: int | None = None,
    ) -> dict:
        """``POST /api/v1/experiments`` (admin): create an experiment and return it.

        Parameters
        ----------
        name : str
            Unique name, ``[a-z0-9_-]{1,64}``.
        arms : sequence of {"name": str, "params": dict}
        metrics : sequence of str
            Every metric name; the objective refers to them.
        objective : dict
            ``{"primary": metric, "guardrails": [{"metric", "threshold", "penalty",
            "relative_to"?}]}``.
        round_seconds : float
            Length of a round (>= 1).
        settle_seconds : float
            Wait after a round ends for late observations before updating.
        algorithm : dict, optional
            ``{"preset": "paper" | "default", **overrides}``.
        seed : int, optional
            Hash seed; the server draws one otherwise.
        """
        body: dict[str, Any] = {
            "name": name,
            "arms": [dict(arm) for arm in arms],
            "metrics": list(metrics),
            "objective": dict(objective),
            "round_seconds": round_seconds,
            "settle_seconds": settle_seconds,
        }
        if algorithm is not None:
            body["algorithm"] = dict(algorithm)
        if seed is not None:
            body["seed"] = seed
        return self.request("POST", f"{API_PREFIX}/experiments", json=body)

    def list_experiments(self) -> list[dict]:
        """``GET /api/v1/experiments``: every experiment."""
        return self.request("GET", f"{API_PREFIX}/experiments")["experiments"]

    def get_experiment(self, name: str) -> dict:
        """``GET /api/v1/experiments/<name>``: configuration and current state (status, round,
        probabilities, deployed mixture)."""
        return self.request("GET", self._experiment_path(name))

    def pause(self, name: str) -> dict:
        """``POST .../pause`` (admin): keep serving the current mixture, stop advancing rounds."""
        return self.request("POST", self._experiment_path(name, "/pause"))

    def resume(self, name: str) -> dict:
        """``POST .../resume`` (admin): advance rounds again."""
        return self.request("POST", self._experiment_path(name, "/resume"))

    def stop(self, name: str) -> dict:
        """``POST .../stop`` (admin): serve the deployed mixture from now on, close ingestion."""
        return self.request("POST", self._experiment_path(name, "/stop"))

    # -- assignment and observations ---------------------------------------------------------------

    def assign(self, name: str, unit: str) -> Assignment:
        """``POST .../assign`` (ingest): the server's assignment of one unit."""
        body = self.request("POST", self._experiment_path(name, "/assign"), json={"unit": unit})
        return _assignment_from_json(body)

    def assign_many(self, name: str, units: Sequence[str]) -> list[Assignment]:
        """``POST .../assign`` (ingest) with up to 10,000 units: their assignments, in order."""
        body = self.request(
            "POST", self._experiment_path(name, "/assign"), json={"units": list(units)}
        )
        return [_assignment_from_json(item) for item in body["assignments"]]

    def observe(self, name: str, observations: Sequence[Mapping[str, Any]]) -> dict:
        """``POST .../observations`` (ingest): record up to 10,000 observations, all or nothing.

        Each observation is ``{"id": idempotency key, "unit", "round", "arm"?, "values": {metric:
        number}}``. Returns ``{"accepted": n, "duplicates": d}`` (an id seen before counts once, ever).
        """
        return self.request(
            "POST",
            self._experiment_path(name, "/observations"),
            json={"observations": [dict(item) for item in observations]},
        )

    # -- rounds and diagnostics --------------------------------------------------------------------

    def close_round(self, name: str, round_index: int | None = None) -> dict:
        """``POST .../rounds`` (admin): close the current round now and run the pending updates.

        With ``round_index``, only if that is still the current round (409 otherwise), so two
        callers cannot close two rounds by accident. Returns ``{"closed_round", "applied", "round":
        {"index", "started_at", "ends_at"}, "probabilities", "deployed"}``: the new round.
        """
        body = None if round_index is None else {"round": round_index}
        return self.request("POST", self._experiment_path(name, "/rounds"), json=body)

    def rounds(self, name: str, since: int | None = None, limit: int | None = None) -> list[dict]:
        """``GET .../rounds``: one entry per round, oldest first (probabilities, counts, means,
        estimated objective and regret); ``since`` (first round index) and ``limit`` page through
        long histories."""
        query = urlencode({k: v for k, v in (("since", since), ("limit", limit)) if v is not None})
        path = self._experiment_path(name, "/rounds") + (f"?{query}" if query else "")
        return self.request("GET", path)["rounds"]

    def diagnostics(self, name: str) -> dict:
        """``GET .../diagnostics``: objective estimates, best mixture vs best single arm, regret,
        guardrails with intervals, sample-ratio mismatch, late observations."""
        return self.request("GET", self._experiment_path(name, "/diagnostics"))


def _api_error(response: requests.Response) -> PastoAPIError:
    try:
        error = response.json()["error"]
        return PastoAPIError(
            response.status_code,
            str(error.get("code", "http_error")),
            str(error.get("message", "")),
            error.get("details"),
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        text = response.text.strip()
        return PastoAPIError(
            response.status_code,
            "http_error",
            text[:500] if text else response.reason or f"HTTP {response.status_code}",
        )


# --------------------------------------------------------------------------------------------------
# Local assignment


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """Everything needed to assign locally in one round, precomputed once."""

    round_index: int
    status: str
    seed: int
    mixture: tuple[float, ...]          # (K,) the mixture served: probabilities, or deployed if stopped
    cumulative: list[float]             # (K,) from cumulative_probabilities(mixture)
    hasher: PrefixHasher
    hash_unit: Callable[[str], float]    # hasher.__call__ bound once: cheaper to call than hasher
    assignments: tuple[Assignment, ...]  # (K,) one immutable answer per arm for this round
    refresh_at: float                   # time.monotonic() after which the snapshot is refreshed
    overdue_poll: float = 0.0           # current poll delay while the round is past its ends_at


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
    """

    def __init__(
        self,
        client: Client | None,
        experiment_name: str,
        ttl: float = 30.0,
        round_poll: float = 0.25,
        experiment: Mapping[str, Any] | None = None,
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
        self._thread: threading.Thread | None = None
        if client is not None:
            self._thread = threading.Thread(
                target=self._refresh_loop, name=f"pasto-assigner-{experiment_name}", daemon=True
            )
            self._thread.start()

    # -- the hot path ------------------------------------------------------------------------------

    def assign(self, unit: str) -> Assignment:
        """The assignment of ``unit`` in the current round (the same object for every unit on the
        same arm in the same round)."""
        snapshot = self._snapshot
        try:
            u = snapshot.hash_unit(unit)
        except AttributeError:
            raise TypeError(f"The unit must be a string, got {type(unit).__name__}.") from None
        # u < 1.0 == cumulative[-1], so the index is always a valid arm: this is choose_arm without
        # its (here moot) clamp, inlined because it is the hot path.
        return snapshot.assignments[bisect_right(snapshot.cumulative, u)]

    def assign_many(self, units: Sequence[str]) -> list[Assignment]:
        """Vectorised :meth:`assign` (numpy hashing): the assignments of ``units``, in order, all from
        one snapshot."""
        snapshot = self._snapshot
        u = buckets(snapshot.seed, units, snapshot.round_index)
        assignments = snapshot.assignments
        return [assignments[k] for k in choose_arms(snapshot.mixture, u).tolist()]

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
        return self._snapshot.mixture

    @property
    def arms(self) -> tuple[str, ...]:
        """Arm names, in the server's order."""
        return tuple(a.arm for a in self._snapshot.assignments)

    def refresh(self) -> None:
        """Fetch the experiment now (blocking) and serve it; raises if the server cannot be reached
        (the previous snapshot then stays in service)."""
        if self.client is None:
            return
        with self._lock:
            experiment = self.client.get_experiment(self.experiment_name)
            self._snapshot = self._build_snapshot(experiment, previous=self._snapshot)

    def close(self) -> None:
        """Stop the background refresher; the last snapshot keeps being served."""
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

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

    def _build_snapshot(
        self, experiment: Mapping[str, Any], previous: _Snapshot | None = None
    ) -> _Snapshot:
        fetched_at = _monotonic()
        status = experiment["status"]
        round_info = experiment["round"]
        round_index = int(round_info["index"])
        served = experiment["deployed"] if status == "stopped" else experiment["probabilities"]
        mixture = tuple(float(x) for x in served)
        arms = experiment["arms"]
        if len(arms) != len(mixture):
            raise ValueError(
                f"The experiment has {len(arms)} arms but a mixture of {len(mixture)} probabilities."
            )
        cumulative = cumulative_probabilities(mixture)
        assignments = tuple(
            Assignment(
                arm=arm["name"],
                params=MappingProxyType(dict(arm.get("params") or {})),
                round=round_index,
                probability=p,
            )
            for arm, p in zip(arms, mixture)
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
        return _Snapshot(
            round_index=round_index,
            status=status,
            seed=seed,
            mixture=mixture,
            cumulative=cumulative,
            hasher=hasher,
            hash_unit=hasher.__call__,
            assignments=assignments,
            refresh_at=fetched_at + delay,
            overdue_poll=overdue_poll,
        )


# --------------------------------------------------------------------------------------------------
# Buffered observations


class ObservationBuffer:
    """Batch observations and send them from a background thread; never lose one silently.

    Each observation gets a uuid4 idempotency id when it is :meth:`add`-ed, so a batch retried after
    a timeout is counted once by the server. A batch is sent when ``max_batch`` observations are
    pending, ``flush_interval`` seconds after the previous send, or on :meth:`flush` /
    :meth:`close`. Network errors, 5xx and 429 are retried with exponential backoff (with jitter) up
    to ``max_backoff`` seconds between attempts, for as long as it takes. Other 4xx are not retried:
    a 422 batch is split in halves until the offending observations are isolated (the server
    accepts a batch all or nothing, so valid neighbours are still recorded), and every rejected
    observation goes to ``on_error(error, observations)``. Without ``on_error`` the first such error
    is raised from the next :meth:`add`, :meth:`flush` or :meth:`close`.

    The queue is bounded: adding to a buffer that holds ``max_queue`` pending observations (queued
    or in flight) calls ``on_overflow(observation)`` if given, else raises
    :class:`BufferOverflowError`.

    Parameters
    ----------
    client : Client
    experiment_name : str
    max_batch : int
        Observations per request (the server accepts up to 10,000).
    flush_interval : float
        Maximum seconds an observation waits before being sent.
    max_queue : int
        Maximum pending observations.
    on_error : callable(PastoAPIError, list[dict]), optional
    on_overflow : callable(dict), optional
    initial_backoff, max_backoff : float
        Seconds before the first retry, and the cap of the doubling delay.
    """

    def __init__(
        self,
        client: Client,
        experiment_name: str,
        max_batch: int = 1000,
        flush_interval: float = 1.0,
        max_queue: int = 100_000,
        on_error: Callable[[PastoAPIError, list[dict]], None] | None = None,
        on_overflow: Callable[[dict], None] | None = None,
        initial_backoff: float = 0.1,
        max_backoff: float = 10.0,
    ) -> None:
        if not (isinstance(max_batch, int) and 1 <= max_batch <= 10_000):
            raise ValueError(f"max_batch must be an integer from 1 to 10000, got {max_batch!r}.")
        if not (isinstance(max_queue, int) and max_queue >= max_batch):
            raise ValueError(
                f"max_queue must be an integer at least max_batch ({max_batch}), got {max_queue!r}."
            )
        if not (flush_interval > 0):
            raise ValueError(f"flush_interval must be positive, got {flush_interval!r}.")
        if not (0 < initial_backoff <= max_backoff):
            raise ValueError("The backoffs must satisfy 0 < initial_backoff <= max_backoff.")
        self.client = client
        self.experiment_name = experiment_name
        self.max_batch = max_batch
        self.flush_interval = float(flush_interval)
        self.max_queue = max_queue
        self.on_error = on_error
        self.on_overflow = on_overflow
        self.initial_backoff = float(initial_backoff)
        self.max_backoff = float(max_backoff)

        self._condition = threading.Condition()
        self._queue: collections.deque[dict] = collections.deque()
        self._oldest_at = 0.0            # monotonic time the oldest queued observation was added
        self._in_flight: list[dict] = []  # the batch being sent
        self._added = 0                  # observations ever queued
        self._settled = 0                # observations accepted by the server or handed to on_error
        self._flush_requested = False
        self._closing = False
        self._closed = False
        self._give_up = threading.Event()  # set by close() on timeout: stop retrying
        self._pending_error: PastoAPIError | None = None
        # Written by the sender thread only.
        self.accepted = 0
        self.duplicates = 0
        self.rejected = 0
        self.retries = 0
        self._thread = threading.Thread(
            target=self._run, name=f"pasto-observations-{experiment_name}", daemon=True
        )
        self._thread.start()
        # A daemon thread dies with the interpreter: send what is queued if close() was forgotten.
        atexit.register(self._close_at_exit)

    # -- producer side -----------------------------------------------------------------------------

    def add(
        self,
        unit: str,
        round: int,
        values: Mapping[str, float],
        arm: str | None = None,
    ) -> str:
        """Queue one observation of ``unit`` in ``round`` and return its idempotency id.

        Parameters
        ----------
        unit : str
        round : int
            The round of the unit's assignment (``Assignment.round``).
        values : mapping of metric name to finite number
        arm : str, optional
            The assigned arm; the server checks it against the sticky assignment when given.
        """
        if not values or not all(
            isinstance(name, str) and _is_finite_number(value) for name, value in values.items()
        ):
            raise ValueError(
                f"The values must map metric names to finite numbers, got {dict(values)!r}."
            )
        observation: dict[str, Any] = {
            "id": str(uuid.uuid4()),
            "unit": unit,
            "round": round,
            "values": dict(values),
        }
        if arm is not None:
            observation["arm"] = arm
        with self._condition:
            self._raise_pending_error()
            if self._closing:
                raise PastoError("The observation buffer is closed.")
            overflow = len(self._queue) + len(self._in_flight) >= self.max_queue
            if not overflow:
                queue = self._queue
                queue.append(observation)
                self._added += 1
                if len(queue) == 1:
                    self._oldest_at = _monotonic()
                    self._condition.notify_all()
                elif len(queue) == self.max_batch:
                    self._condition.notify_all()
        if overflow:
            if self.on_overflow is None:
                raise BufferOverflowError(
                    f"The observation buffer of {self.experiment_name!r} already holds "
                    f"{self.max_queue} pending observations; the server is not keeping up or is "
                    "unreachable."
                )
            self.on_overflow(observation)
        return observation["id"]

    @property
    def pending(self) -> int:
        """Observations queued or in flight."""
        with self._condition:
            return len(self._queue) + len(self._in_flight)

    def flush(self, timeout: float | None = None) -> None:
        """Send everything added so far and wait until it is settled (accepted by the server or
        handed to ``on_error``).

        Raises
        ------
        TimeoutError
            If ``timeout`` seconds pass first (nothing is lost: sending continues).
        PastoAPIError
            The first rejection not handled by ``on_error``.
        """
        with self._condition:
            target = self._added
            self._flush_requested = True
            self._condition.notify_all()
            if not self._condition.wait_for(lambda: self._settled >= target, timeout=timeout):
                raise TimeoutError(
                    f"{target - self._settled} observations of {self.experiment_name!r} are still "
                    f"unsent after {timeout} s; the buffer keeps retrying."
                )
            self._raise_pending_error()

    def close(self, timeout: float | None = None) -> None:
        """Send everything, then stop the background thread. Idempotent.

        Raises
        ------
        TimeoutError
            If not everything was sent within ``timeout`` seconds. Sending stops and the unsent
            observations are in the exception's ``unsent`` attribute (list of dicts, ids included:
            resending them later is safe even if the server got some of them).
        PastoAPIError
            The first rejection not handled by ``on_error``.
        """
        atexit.unregister(self._close_at_exit)
        with self._condition:
            if self._closed:
                return
            self._closing = True
            self._condition.notify_all()
        self._thread.join(timeout)
        with self._condition:
            self._closed = True
            if self._thread.is_alive():
                self._give_up.set()
                unsent = self._in_flight + list(self._queue)
                self._queue.clear()
                error = TimeoutError(
                    f"{len(unsent)} observations of {self.experiment_name!r} could not be sent "
                    f"within {timeout} s."
                )
                error.unsent = unsent  # type: ignore[attr-defined]
                raise error
            self._raise_pending_error()

    def _close_at_exit(self) -> None:
        try:
            self.close(timeout=EXIT_FLUSH_SECONDS)
        except TimeoutError as error:
            logger.error(
                "Exiting with %d observations of %r unsent (ObservationBuffer.close() was not "
                "called and the server did not take them within %s s).",
                len(error.unsent), self.experiment_name, EXIT_FLUSH_SECONDS,  # type: ignore[attr-defined]
            )
        except PastoError as error:
            logger.error("Observations of %r were rejected at exit: %s", self.experiment_name, error)

    def __enter__(self) -> ObservationBuffer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _raise_pending_error(self) -> None:
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise error

    # -- sender thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        condition = self._condition
        while True:
            with condition:
                while True:
                    if not self._queue:
                        if self._closing:
                            return
                        self._flush_requested = False
                        condition.wait()
                        continue
                    if len(self._queue) >= self.max_batch or self._flush_requested or self._closing:
                        break
                    remaining = self._oldest_at + self.flush_interval - _monotonic()
                    if remaining <= 0:
                        break
                    condition.wait(remaining)
                size = min(self.max_batch, len(self._queue))
                batch = [self._queue.popleft() for _ in range(size)]
                self._in_flight = batch
            self._send(batch)
            with condition:
                self._in_flight = []
                self._settled += len(batch)
                condition.notify_all()

    def _send(self, batch: list[dict]) -> None:
        """Send ``batch`` until it is accepted, rejected with a non-retryable error, or close() gives
        up waiting."""
        backoff = self.initial_backoff
        while not self._give_up.is_set():
            try:
                result = self.client.observe(self.experiment_name, batch)
            except PastoConnectionError as error:
                reason: Exception = error
            except PastoAPIError as error:
                if not error.retryable:
                    self._reject(batch, error)
                    return
                reason = error
            except Exception as error:  # a bug must not kill the sender thread and strand the queue
                logger.exception("Unexpected error while sending observations of %r.", self.experiment_name)
                reason = error
            else:
                if isinstance(result, Mapping):
                    self.accepted += int(result.get("accepted", 0))
                    self.duplicates += int(result.get("duplicates", 0))
                return
            self.retries += 1
            delay = backoff * (0.5 + random.random())
            logger.warning(
                "Sending %d observations of %r failed (%s); retrying in %.2f s.",
                len(batch), self.experiment_name, reason, delay,
            )
            self._give_up.wait(delay)
            backoff = min(self.max_backoff, backoff * 2)

    def _reject(self, batch: list[dict], error: PastoAPIError) -> None:
        if error.status == 422 and len(batch) > 1:
            # The server takes a batch all or nothing: bisect to isolate the invalid observations
            # so that their valid neighbours are still recorded.
            half = len(batch) // 2
            self._send(batch[:half])
            self._send(batch[half:])
            return
        self.rejected += len(batch)
        logger.error(
            "The server rejected %d observations of %r: %s", len(batch), self.experiment_name, error
        )
        if self.on_error is not None:
            try:
                self.on_error(error, batch)
            except Exception:  # a failing callback must not kill the sender thread
                logger.exception("The on_error callback of the observation buffer failed.")
        else:
            with self._condition:
                if self._pending_error is None:
                    self._pending_error = error


def _is_finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
