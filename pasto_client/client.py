"""The HTTP client: one typed method per route of the pasto API, and the answer types it returns.

Errors are turned into :class:`~pasto_client.errors.PastoAPIError` (the server answered with an error)
and :class:`~pasto_client.errors.PastoConnectionError` (it could not be reached).
"""

from __future__ import annotations

import datetime
import email.utils
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any
from urllib.parse import quote, urlencode

import requests

from pasto_client.errors import PastoAPIError, PastoConnectionError

API_PREFIX = "/api/v1"
#: The longest ``Retry-After`` the retrying calls honour: the server asks for seconds (a database
#: outage's 5 s, the rest of a throttling minute), so a far date is a misconfigured proxy, not a
#: reason to stall a client for hours.
MAX_RETRY_AFTER_SECONDS = 300.0

logger = logging.getLogger(__name__)


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
    segment : str or None
        Segmented experiments: the unit's segment, whose mixture the arm was drawn from.
    """

    arm: str
    params: Mapping[str, Any]
    round: int
    probability: float
    segment: str | None = None


def _assignment_from_json(body: Mapping[str, Any]) -> Assignment:
    return Assignment(
        arm=body["arm"],
        params=MappingProxyType(dict(body["params"])),
        round=int(body["round"]),
        probability=float(body["probability"]),
        segment=body.get("segment"),
    )


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
        source: Mapping[str, Any] | None = None,
        segments: Sequence[str] | Mapping[str, Any] | None = None,
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
        source : dict, optional
            A warehouse-native metric source (docs/scaling.md): the scheduler queries it at each
            round's close and update. Secrets by environment-variable name only.
        segments : list of str or dict, optional
            Per-segment mixtures: segment names, or ``{"names", "shares"?, "shrink"?, "confidence_z"?}``
            (docs/segments.md).
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
        if source is not None:
            body["source"] = dict(source)
        if segments is not None:
            body["segments"] = list(segments) if not isinstance(segments, Mapping) else dict(segments)
        return self.request("POST", f"{API_PREFIX}/experiments", json=body)

    def list_experiments(self, archived: bool = False, arms: int | None = None) -> list[dict]:
        """``GET /api/v1/experiments``: every experiment not archived (``archived``: the archived ones).
        ``arms``: summarise each experiment's per-arm arrays to its N arms of largest weight
        (docs/api.md, "Large K")."""
        query = _query(("archived", "true" if archived else None), ("arms", arms))
        return self.request("GET", f"{API_PREFIX}/experiments{query}")["experiments"]

    def get_experiment(self, name: str, arms: int | None = None) -> dict:
        """``GET /api/v1/experiments/<name>``: configuration and current state (status, round,
        probabilities, deployed mixture). ``arms``: keep the N arms of largest weight in the per-arm
        arrays and sum the others into ``rest`` (``arm_summary`` names the kept arms)."""
        return self.request("GET", self._experiment_path(name) + _query(("arms", arms)))

    def pause(self, name: str) -> dict:
        """``POST .../pause`` (admin): keep serving the current mixture, stop advancing rounds."""
        return self.request("POST", self._experiment_path(name, "/pause"))

    def resume(self, name: str) -> dict:
        """``POST .../resume`` (admin): advance rounds again."""
        return self.request("POST", self._experiment_path(name, "/resume"))

    def stop(self, name: str) -> dict:
        """``POST .../stop`` (admin): serve the deployed mixture from now on, close ingestion."""
        return self.request("POST", self._experiment_path(name, "/stop"))

    def archive(self, name: str) -> dict:
        """``POST .../archive`` (admin): stop the experiment and leave it out of listings and metrics;
        assignment keeps serving the deployed mixture."""
        return self.request("POST", self._experiment_path(name, "/archive"))

    def delete(self, name: str) -> dict:
        """``DELETE /api/v1/experiments/<name>`` (admin): delete an archived experiment with every row
        of it; returns ``{"name", "deleted_rows": {table: rows}}``."""
        return self.request("DELETE", self._experiment_path(name))

    # -- assignment and observations ---------------------------------------------------------------

    def assign(self, name: str, unit: str, segment: str | None = None) -> Assignment:
        """``POST .../assign`` (ingest): the server's assignment of one unit (of its ``segment`` in a
        segmented experiment)."""
        body: dict[str, Any] = {"unit": unit}
        if segment is not None:
            body["segment"] = segment
        return _assignment_from_json(self.request("POST", self._experiment_path(name, "/assign"), json=body))

    def assign_many(self, name: str, units: Sequence[str],
                    segments: Sequence[str] | str | None = None) -> list[Assignment]:
        """``POST .../assign`` (ingest) with up to 10,000 units: their assignments, in order.
        ``segments`` (segmented experiments): one per unit, or one segment name for all of them."""
        body: dict[str, Any] = {"units": list(units)}
        if isinstance(segments, str):
            body["segment"] = segments
        elif segments is not None:
            body["segments"] = list(segments)
        body = self.request("POST", self._experiment_path(name, "/assign"), json=body)
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

    def send_statistics(
        self,
        name: str,
        batch_id: str,
        cells: Sequence[Mapping[str, Any]],
        units: Sequence[Mapping[str, Any]] = (),
        *,
        attempts: int = 10,
        initial_backoff: float = 0.1,
        max_backoff: float = 10.0,
    ) -> dict:
        """``POST .../statistics`` (ingest): add one batch of pre-aggregated statistics, exactly once.

        ``cells``: up to 10,000 ``{"round", "arm", "metric", "count", "sum", "sum_of_squares"}`` (one
        per round, arm and metric); ``units``: up to 10,000 ``{"round", "arm", "units"}`` (distinct
        units with data, one per round and arm). The server adds them to the rounds' statistics, as
        observations of those rounds would be.

        Network errors, 5xx and 429 are retried, at most ``attempts`` sends in all, with the same
        exponential backoff (with jitter) as :class:`~pasto_client.ObservationBuffer`, and no sooner
        than a ``Retry-After`` asks (up to :data:`MAX_RETRY_AFTER_SECONDS`). Retrying is safe: a batch the server
        applied before its answer was lost comes back as a duplicate. Returns ``{"batch_id",
        "duplicate", "cells", "units", "late_cells"}``; ``duplicate`` is true when this id was applied
        before with the same content (nothing was added). Other errors raise :class:`PastoAPIError` at
        once: 422 (invalid cells, each listed in ``details``), 409 (the id was applied with other
        content, or a round is older than the server's retention); so does the last retryable one.
        """
        if not (isinstance(attempts, int) and attempts >= 1):
            raise ValueError(f"attempts must be a positive integer, got {attempts!r}.")
        if not (0 < initial_backoff <= max_backoff):
            raise ValueError("The backoffs must satisfy 0 < initial_backoff <= max_backoff.")
        body = {"batch_id": batch_id, "cells": [dict(cell) for cell in cells],
                "units": [dict(entry) for entry in units]}
        path = self._experiment_path(name, "/statistics")
        backoff = float(initial_backoff)
        for attempt in range(1, attempts + 1):
            try:
                return self.request("POST", path, json=body)
            except PastoConnectionError as error:
                reason: PastoConnectionError | PastoAPIError = error
            except PastoAPIError as error:
                if not error.retryable:
                    raise
                reason = error
            if attempt == attempts:
                raise reason
            delay = retry_delay(backoff, getattr(reason, "retry_after", None))
            logger.warning("Sending statistics batch %r of %r failed (%s); retrying in %.2f s.",
                           batch_id, name, reason, delay)
            time.sleep(delay)
            backoff = min(max_backoff, backoff * 2)
        raise AssertionError("unreachable: the loop returns or raises")

    # -- rounds and diagnostics --------------------------------------------------------------------

    def close_round(self, name: str, round_index: int | None = None) -> dict:
        """``POST .../rounds`` (admin): close the current round now and run the pending updates.

        With ``round_index``, only if that is still the current round (409 otherwise), so two
        callers cannot close two rounds by accident. Returns ``{"closed_round", "applied", "round":
        {"index", "started_at", "ends_at"}, "probabilities", "deployed"}``: the new round.
        """
        body = None if round_index is None else {"round": round_index}
        return self.request("POST", self._experiment_path(name, "/rounds"), json=body)

    def rounds(self, name: str, since: int | None = None, limit: int | None = None,
               arms: int | None = None) -> list[dict]:
        """``GET .../rounds``: one entry per round, oldest first (probabilities, counts, means,
        estimated objective and regret), from round ``since`` (default 0). Without ``limit``, every
        round to the current one (the server's pages, followed by their ``next_since`` cursor); with
        it, at most ``limit`` rounds (one request).

        ``arms``: every round's per-arm arrays keep the N arms of largest weight (docs/api.md, "Large
        K"). The server picks them per response, and a round that closes between two pages can
        change them, so each round returned carries its page's ``arm_summary`` (the positions and
        names its arrays are aligned with)."""
        path = self._experiment_path(name, "/rounds")
        if limit is not None:
            page = self.request("GET", path + _query(("since", since), ("limit", limit), ("arms", arms)))
            return _with_arm_summary(page)
        rounds: list[dict] = []
        cursor: int | None = since or 0
        while cursor is not None:
            page = self.request("GET", path + _query(("since", cursor), ("arms", arms)))
            rounds.extend(_with_arm_summary(page))
            cursor = page.get("next_since")  # absent from servers before pagination: one page was all
        return rounds

    def events(self, name: str, since: int | None = None) -> list[dict]:
        """``GET .../events``: what happened to the experiment (created, paused, resumed, stopped,
        controller_started), each with its round, oldest first, from event id ``since`` (default 0);
        every page, followed by its ``next_since`` cursor. Event ids are never given out twice, so a
        ``since`` kept across a delete and re-creation of the name misses none of the new events."""
        events: list[dict] = []
        cursor: int | None = since or 0
        while cursor is not None:
            page = self.request("GET", self._experiment_path(name, "/events") + f"?since={cursor}")
            events.extend(page["events"])
            cursor = page["next_since"]
        return events

    def diagnostics(self, name: str, arms: int | None = None) -> dict:
        """``GET .../diagnostics``: objective estimates, best mixture vs best single arm, regret,
        guardrails with intervals, sample-ratio mismatch, late observations. ``arms``: per-arm arrays
        summarised to the N arms of largest weight (docs/api.md, "Large K")."""
        return self.request("GET", self._experiment_path(name, "/diagnostics") + _query(("arms", arms)))


def _query(*pairs: tuple[str, Any]) -> str:
    """``?k=v&...`` of the pairs whose value is not None; "" when none is."""
    present = [(key, value) for key, value in pairs if value is not None]
    return f"?{urlencode(present)}" if present else ""


def _with_arm_summary(page: dict) -> list[dict]:
    """A rounds page's rounds, each with the page's ``arm_summary`` when the page has one."""
    if "arm_summary" not in page:
        return page["rounds"]
    return [{**entry, "arm_summary": dict(page["arm_summary"])} for entry in page["rounds"]]


def retry_delay(backoff: float, retry_after: float | None) -> float:
    """Seconds to wait before a retry: ``backoff`` with jitter (0.5x to 1.5x), and no less than the
    server's ``Retry-After`` (503 ``database_unavailable``: retrying sooner only adds load to its
    outage; 429: a retry before the window ends is refused again), up to
    :data:`MAX_RETRY_AFTER_SECONDS` so that a far date cannot stall the client. The backoff's own cap
    does not bound the ``Retry-After``: the server knows when it can answer, the client does not."""
    delay = backoff * (0.5 + random.random())
    if retry_after is not None:
        delay = max(delay, min(retry_after, MAX_RETRY_AFTER_SECONDS))
    return delay


def _retry_after(response: requests.Response) -> float | None:
    """The ``Retry-After`` of ``response`` in seconds (delay-seconds or an HTTP date), or None."""
    value = response.headers.get("Retry-After")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds())


def _api_error(response: requests.Response) -> PastoAPIError:
    retry_after = _retry_after(response)
    try:
        error = response.json()["error"]
        return PastoAPIError(
            response.status_code,
            str(error.get("code", "http_error")),
            str(error.get("message", "")),
            error.get("details"),
            retry_after,
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        text = response.text.strip()
        return PastoAPIError(
            response.status_code,
            "http_error",
            text[:500] if text else response.reason or f"HTTP {response.status_code}",
            retry_after=retry_after,
        )
