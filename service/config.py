"""Configuration: defaults, then environment variables, then the mapping passed to ``create_app``."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: Largest request body accepted; 10,000 observations with a few metrics fit comfortably.
DEFAULT_MAX_CONTENT_LENGTH = 16 * 1024 * 1024

#: Seconds between the dashboard's reads of the API.
DEFAULT_DASHBOARD_POLL_SECONDS = 5.0

#: Database deadlines in seconds, every one well under gunicorn's 30 s worker timeout: a request that
#: meets a database which is down or stalled fails with 503 after at most about pool + connect +
#: statement seconds instead of hanging until gunicorn kills its worker.
DATABASE_TIMEOUTS = {
    "PASTO_DATABASE_CONNECT_TIMEOUT": 3.0,    # opening a connection (PostgreSQL; libpq's minimum is 2)
    "PASTO_DATABASE_STATEMENT_TIMEOUT": 10.0,  # one statement (PostgreSQL server-side, and client-side)
    "PASTO_DATABASE_POOL_TIMEOUT": 5.0,        # waiting for a free connection of the pool
    "PASTO_SQLITE_BUSY_TIMEOUT": 10.0,         # waiting for SQLite's write lock
    "PASTO_HEALTHZ_TIMEOUT": 1.5,              # /healthz answers 503 when its check takes longer
    # After a failed connection (down, unreachable, stalled) a process refuses database work at once
    # for this long, then lets one request try again: one wait per window, not one per access.
    "PASTO_DATABASE_FAIL_FAST": 2.0,
}

#: Deadlines of a metric source's queries (seconds; see docs/scaling.md).
SOURCE_TIMEOUTS = {
    "PASTO_SOURCE_CONNECT_TIMEOUT": 10.0,     # opening the source engine's connection
    "PASTO_SOURCE_STATEMENT_TIMEOUT": 300.0,  # one source query (a round's aggregation)
}
#: Source experiments whose queries run at once, each in a thread of its own, off the scheduler's tick.
DEFAULT_SOURCE_WORKERS = 4

#: ``Retry-After`` (seconds) of a 503 ``database_unavailable``.
DEFAULT_DATABASE_RETRY_AFTER = 5

#: Invalid tokens one client address may send per minute before it is refused 429.
DEFAULT_AUTH_FAILURE_LIMIT = 20
DEFAULT_METRICS_TOP_ARMS = 20
DEFAULT_METRICS_TOP_SEGMENTS = 20

#: Seconds the observation ids (and distinct units, statistics batch ids) of a round are kept after its
#: update: resends within it are recognised, data for an older round is refused. 7 days covers any
#: client's retries and a replay of a day's backlog; ``forever`` keeps every id (unbounded storage).
DEFAULT_RETENTION_SECONDS = 7 * 86_400
#: Seconds between the scheduler's retention runs (each deletes old ids in bounded chunks).
DEFAULT_RETENTION_CHECK_SECONDS = 60.0


class ConfigurationError(ValueError):
    """A setting (environment variable or ``create_app`` mapping) pasto cannot use.

    The message names the setting and says what it must be; ``pasto`` prints it as
    ``pasto: error: ...`` instead of a traceback.
    """


def load_config(instance_path: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Resolve the service configuration.

    Keys: ``PASTO_DATABASE_URL`` (SQLAlchemy URL, default ``sqlite:///<instance>/pasto.sqlite``),
    ``PASTO_ADMIN_TOKEN`` (bootstrap admin token, kept only as its SHA-256 digest),
    ``PASTO_SCHEDULER_INTERVAL`` (seconds between round checks, default 1),
    ``PASTO_CHECK_SCHEMA`` (refuse to start on an un-migrated database, default true),
    ``PASTO_VERSION_CHECK_SECONDS`` (how stale a worker's cached experiment may be, default 0.05),
    ``PASTO_ANONYMOUS_LOOPBACK_READ`` (let requests from 127.0.0.1/::1 read without a token, default
    false: for a dashboard on the same machine, never behind a reverse proxy on that machine),
    ``PASTO_METRICS_ANONYMOUS`` (let anyone scrape ``/metrics`` without a token, default false: a
    scrape needs a token with the ``metrics`` role or higher),
    ``PASTO_DASHBOARD_POLL_SECONDS`` (how often the dashboard re-reads the API, default 5),
    ``PASTO_DATABASE_CONNECT_TIMEOUT`` / ``PASTO_DATABASE_STATEMENT_TIMEOUT`` /
    ``PASTO_DATABASE_POOL_TIMEOUT`` / ``PASTO_SQLITE_BUSY_TIMEOUT`` / ``PASTO_HEALTHZ_TIMEOUT`` /
    ``PASTO_DATABASE_FAIL_FAST`` (seconds, defaults in :data:`DATABASE_TIMEOUTS`), ``PASTO_DATABASE_RETRY_AFTER`` (the ``Retry-After`` of a 503
    when the database is unavailable, whole seconds, default 5), ``PASTO_AUTH_FAILURE_LIMIT`` (invalid
    tokens one client address may send per minute before it is refused 429, default 20),
    ``PASTO_METRICS_TOP_ARMS`` (``/metrics`` has per-arm series for this many arms of each
    experiment, those of highest probability, and one aggregate for the others; default 20),
    ``PASTO_METRICS_TOP_SEGMENTS`` (per-segment series for this many segments of each segmented
    experiment, those of largest traffic share, and one aggregate for the others; default 20),
    ``PASTO_EXPOSURE_LOG`` (a ``.jsonl`` or ``.parquet`` path: log one exposure per assigned unit
    there, see service/exposures.py; default unset: no exposure log),
    ``PASTO_RETENTION_SECONDS`` (how long after its update a round's observation ids, units and
    statistics batch ids are kept; data for an older round is then refused; zero or more seconds, or
    ``forever``; default 7 days, :data:`DEFAULT_RETENTION_SECONDS`), ``PASTO_RETENTION_CHECK_SECONDS``
    (seconds between the scheduler's retention runs, default 60),
    ``PASTO_SOURCE_CONNECT_TIMEOUT`` / ``PASTO_SOURCE_STATEMENT_TIMEOUT`` (seconds, a metric source's
    connect and query deadlines, defaults in :data:`SOURCE_TIMEOUTS`), ``PASTO_SOURCE_WORKERS`` (how many
    source experiments' closes run at once off the scheduler's tick, default 4),
    ``MAX_CONTENT_LENGTH`` (largest request body in bytes, default 16 MiB; Flask's key, read from the
    environment as ``PASTO_MAX_CONTENT_LENGTH`` like the other settings).

    Raises :class:`ConfigurationError` naming the setting when a value is unusable.
    """
    config: dict[str, Any] = {
        "PASTO_DATABASE_URL": f"sqlite:///{Path(instance_path) / 'pasto.sqlite'}",
        "PASTO_ADMIN_TOKEN": None,
        "PASTO_SCHEDULER_INTERVAL": 1.0,
        "PASTO_CHECK_SCHEMA": True,
        "PASTO_VERSION_CHECK_SECONDS": 0.05,
        "PASTO_ANONYMOUS_LOOPBACK_READ": False,
        "PASTO_METRICS_ANONYMOUS": False,
        "PASTO_DASHBOARD_POLL_SECONDS": DEFAULT_DASHBOARD_POLL_SECONDS,
        "MAX_CONTENT_LENGTH": DEFAULT_MAX_CONTENT_LENGTH,
        "PASTO_EXPOSURE_LOG": None,
        **DATABASE_TIMEOUTS,
        **SOURCE_TIMEOUTS,
        "PASTO_SOURCE_WORKERS": DEFAULT_SOURCE_WORKERS,
        "PASTO_DATABASE_RETRY_AFTER": DEFAULT_DATABASE_RETRY_AFTER,
        "PASTO_AUTH_FAILURE_LIMIT": DEFAULT_AUTH_FAILURE_LIMIT,
        "PASTO_METRICS_TOP_ARMS": DEFAULT_METRICS_TOP_ARMS,
        "PASTO_METRICS_TOP_SEGMENTS": DEFAULT_METRICS_TOP_SEGMENTS,
        "PASTO_RETENTION_SECONDS": DEFAULT_RETENTION_SECONDS,
        "PASTO_RETENTION_CHECK_SECONDS": DEFAULT_RETENTION_CHECK_SECONDS,
    }
    for key in ("PASTO_DATABASE_URL", "PASTO_ADMIN_TOKEN", "PASTO_SCHEDULER_INTERVAL", "PASTO_VERSION_CHECK_SECONDS",
                "PASTO_DASHBOARD_POLL_SECONDS", "PASTO_EXPOSURE_LOG", "PASTO_DATABASE_RETRY_AFTER", "PASTO_AUTH_FAILURE_LIMIT",
                "PASTO_METRICS_TOP_ARMS", "PASTO_METRICS_TOP_SEGMENTS", "PASTO_RETENTION_SECONDS",
                "PASTO_RETENTION_CHECK_SECONDS", *DATABASE_TIMEOUTS, *SOURCE_TIMEOUTS, "PASTO_SOURCE_WORKERS"):
        if os.environ.get(key):
            config[key] = os.environ[key]
    for flag in ("PASTO_ANONYMOUS_LOOPBACK_READ", "PASTO_METRICS_ANONYMOUS"):
        if os.environ.get(flag):
            config[flag] = _flag(flag, os.environ[flag])
    if os.environ.get("PASTO_MAX_CONTENT_LENGTH"):
        config["MAX_CONTENT_LENGTH"] = os.environ["PASTO_MAX_CONTENT_LENGTH"]
    if overrides:
        config.update(overrides)
    config["PASTO_SCHEDULER_INTERVAL"] = _seconds("PASTO_SCHEDULER_INTERVAL", config["PASTO_SCHEDULER_INTERVAL"])
    config["PASTO_VERSION_CHECK_SECONDS"] = _seconds("PASTO_VERSION_CHECK_SECONDS",
                                                     config["PASTO_VERSION_CHECK_SECONDS"], zero_allowed=True)
    config["PASTO_DASHBOARD_POLL_SECONDS"] = _seconds("PASTO_DASHBOARD_POLL_SECONDS",
                                                      config["PASTO_DASHBOARD_POLL_SECONDS"])
    config["MAX_CONTENT_LENGTH"] = _bytes("PASTO_MAX_CONTENT_LENGTH", config["MAX_CONTENT_LENGTH"])
    for key in (*DATABASE_TIMEOUTS, *SOURCE_TIMEOUTS):
        config[key] = _seconds(key, config[key])
    config["PASTO_SOURCE_WORKERS"] = _whole_seconds("PASTO_SOURCE_WORKERS", config["PASTO_SOURCE_WORKERS"],
                                                    "source experiments")
    config["PASTO_DATABASE_RETRY_AFTER"] = _whole_seconds("PASTO_DATABASE_RETRY_AFTER",
                                                          config["PASTO_DATABASE_RETRY_AFTER"])
    config["PASTO_AUTH_FAILURE_LIMIT"] = _whole_seconds("PASTO_AUTH_FAILURE_LIMIT",
                                                        config["PASTO_AUTH_FAILURE_LIMIT"], "invalid tokens")
    config["PASTO_METRICS_TOP_ARMS"] = _whole_seconds("PASTO_METRICS_TOP_ARMS", config["PASTO_METRICS_TOP_ARMS"],
                                                      "arms")
    config["PASTO_METRICS_TOP_SEGMENTS"] = _whole_seconds(
        "PASTO_METRICS_TOP_SEGMENTS", config["PASTO_METRICS_TOP_SEGMENTS"], "segments")
    config["PASTO_RETENTION_SECONDS"] = _retention("PASTO_RETENTION_SECONDS", config["PASTO_RETENTION_SECONDS"])
    config["PASTO_RETENTION_CHECK_SECONDS"] = _seconds("PASTO_RETENTION_CHECK_SECONDS",
                                                       config["PASTO_RETENTION_CHECK_SECONDS"])
    return config


def _retention(key: str, value: Any) -> float | None:
    """``value`` as seconds of retention (zero or more), or None for ``forever``/None: keep every id."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "forever"):
        return None
    try:
        return _seconds(key, value, zero_allowed=True)
    except ConfigurationError:
        raise ConfigurationError(f"{key} must be zero or a positive number of seconds, or 'forever', "
                                 f"got {value!r}.") from None


def _whole_seconds(key: str, value: Any, unit: str = "seconds") -> int:
    """``value`` (an integer, or its text from the environment) as a positive whole number of ``unit``."""
    wanted = f"{key} must be a positive whole number of {unit}"
    number = value
    if isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            raise ConfigurationError(f"{wanted}, got {value!r}.") from None
    if isinstance(number, bool) or not isinstance(number, int) or number < 1 or number > 86_400:
        raise ConfigurationError(f"{wanted} (at most 86400), got {value!r}.")
    return number


def _seconds(key: str, value: Any, zero_allowed: bool = False) -> float:
    """``value`` (a number, or its text from the environment) as a finite number of seconds."""
    wanted = "zero or a positive number of seconds" if zero_allowed else "a positive number of seconds"
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigurationError(f"{key} must be {wanted}, got {value!r}.") from None
    if isinstance(value, bool) or not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not zero_allowed):
        raise ConfigurationError(f"{key} must be {wanted}, got {value!r}.")
    return seconds


def _bytes(key: str, value: Any) -> int:
    """``value`` (an integer, or its text from the environment) as a positive number of bytes."""
    wanted = f"{key} must be a positive whole number of bytes (e.g. {DEFAULT_MAX_CONTENT_LENGTH} for 16 MiB)"
    number = value
    if isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            raise ConfigurationError(f"{wanted}, got {value!r}.") from None
    if isinstance(number, bool) or not isinstance(number, int) or number < 1:
        raise ConfigurationError(f"{wanted}, got {value!r}.")
    return number


def _flag(key: str, text: str) -> bool:
    value = text.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ConfigurationError(f"{key} must be 1/true/yes/on or 0/false/no/off, got {text!r}.")


#: An admin token with fewer bits (estimated from its length and character classes) is weak.
STRONG_TOKEN_BITS = 128


def admin_token_weakness(token: str) -> str | None:
    """Why ``token`` is too weak for ``PASTO_ADMIN_TOKEN`` (None when it is strong): its estimated
    strength, length times log2 of the size of the character classes it uses, is under
    :data:`STRONG_TOKEN_BITS`, or one character makes up half of it."""
    classes = [(str.islower, 26), (str.isupper, 26), (str.isdigit, 10)]
    alphabet = sum(size for test, size in classes if any(test(c) for c in token if c.isascii()))
    if any(not (c.isascii() and c.isalnum()) for c in token):
        alphabet += 33
    bits = len(token) * math.log2(max(alphabet, 2))
    most_common = max(token.count(c) for c in set(token)) if token else 0
    if bits < STRONG_TOKEN_BITS or most_common * 2 >= len(token):
        return f"{len(token)} characters, about {min(bits, 2 * len(token)):.0f} bits"
    return None


def warn_if_weak_admin_token(admin_token: str | None, log: logging.Logger) -> None:
    """Log on ``log`` that ``PASTO_ADMIN_TOKEN`` is weak, if it is set and weak (``service.auth``'s
    start-up check; here, without the token store, so that ``pasto db`` makes it too and stays light)."""
    if admin_token:
        weakness = admin_token_weakness(admin_token)
        if weakness is not None:
            log.warning("PASTO_ADMIN_TOKEN is weak (%s): anyone who guesses it administers every experiment. "
                        "Use at least 32 random characters, e.g. the output of `python3 -c \"import secrets; "
                        "print(secrets.token_urlsafe(32))\"`, or none and `pasto tokens create --role admin`.",
                        weakness)
