"""Bearer tokens with four roles, ``metrics`` < ``read`` < ``ingest`` < ``admin``: ``metrics`` may
only scrape ``/metrics`` (a Prometheus scrape token), and ``/metrics`` needs at least that unless
``PASTO_METRICS_ANONYMOUS`` opts in to anonymous scrapes.

Only the SHA-256 digest of a token is stored (the bootstrap ``PASTO_ADMIN_TOKEN`` is kept in memory as
its digest too). Digests are compared with :func:`hmac.compare_digest`. Valid tokens are cached per
process for :data:`TOKEN_CACHE_SECONDS` (1 s) so the assignment hot path does not query the token
table on every request; a token revoked (``pasto tokens revoke``) or past its ``expires_at`` is
therefore refused by every worker within 1 s.

Unknown tokens (not revoked or expired ones: those are clients not updated yet, not guesses) are
counted per client address in the database (``auth_failures``), so the limit holds
across every worker process: the first failure of an address in a window of
:data:`AUTH_FAILURE_WINDOW_SECONDS` is logged (one line per address and window, not one per
attempt), and after ``PASTO_AUTH_FAILURE_LIMIT`` failures in the window every further unknown token
from that address is refused 429 with ``Retry-After`` until the window ends. Valid tokens (and
revoked or expired ones, which get their 401) are never throttled: the address is the TCP peer
(``REMOTE_ADDR``), which clients share behind a reverse proxy or on one host, and a burst of bad
tokens from one of them must not lock the others out.

``PASTO_ADMIN_TOKEN`` is checked at start (:func:`admin_token_weakness`): a weak one is accepted (a
placeholder is normal for a server on loopback: the demo, the tests) but logged as a warning that
says how to make a strong one.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import logging
import math
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

from flask import Flask, current_app, g, request

from . import store
from .bootstrap import get_uow
from .config import STRONG_TOKEN_BITS, admin_token_weakness, warn_if_weak_admin_token  # noqa: F401
from .errors import ApiError
from .models import ROLES, utcnow
# The token rows are the store's; these names stay importable from here, where they always were.
from .store import create_token, find_tokens, hash_token, revoke_tokens, rotate_token  # noqa: F401

log = logging.getLogger(__name__)

ROLE_RANK = {role: rank for rank, role in enumerate(ROLES)}
#: How long a worker trusts a token it has looked up: the bound on how late a revocation bites.
TOKEN_CACHE_SECONDS = 1.0
#: Invalid tokens are counted per client address over windows of this many seconds.
AUTH_FAILURE_WINDOW_SECONDS = 60.0
_EXTENSION = "pasto.auth"


class _Authenticator:
    def __init__(self, admin_token: str | None) -> None:
        self.admin_digest = hash_token(admin_token) if admin_token else None
        self._cache: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def role_of(self, token: str, address: str) -> str | None:
        """The role of ``token`` (None when it is not valid); 429 when ``address`` is throttled."""
        known = self.known_role(token)
        if known is not None:
            return known
        digest = hash_token(token)
        now = utcnow()
        with get_uow().read() as session:
            row = store.token_by_hash(session, digest)
            if row is None or not hmac.compare_digest(row.token_hash, digest):
                # Only unknown tokens are throttled: refusing every token of a throttled address
                # would let anyone who shares it (loopback, a reverse proxy, a NAT) lock the
                # valid clients out with 20 bad requests a minute. A revoked or expired token is
                # a client not updated yet, not a guess, so it does not count either.
                self._refuse_if_throttled(session, address, now)
        if row is None or not hmac.compare_digest(row.token_hash, digest):
            self._record_failure(address, now)
            return None
        if row.revoked_at is not None or (row.expires_at is not None and row.expires_at <= now):
            return None
        seconds = TOKEN_CACHE_SECONDS
        if row.expires_at is not None:
            seconds = min(seconds, (row.expires_at - now).total_seconds())
        with self._lock:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[digest] = (row.role, time.monotonic() + seconds)
        return row.role

    def known_role(self, token: str) -> str | None:
        """The role of ``token`` when it is the admin token or a valid token looked up in the last
        ``TOKEN_CACHE_SECONDS``; None otherwise (unknown here: :meth:`role_of` decides). No database
        read and no failure counted."""
        digest = hash_token(token)
        if self.admin_digest is not None and hmac.compare_digest(digest, self.admin_digest):
            return "admin"
        cached = self._cache.get(digest)
        if cached is not None and cached[1] > time.monotonic():
            return cached[0]
        return None

    def _refuse_if_throttled(self, session, address: str, now: datetime) -> None:
        row = store.auth_failures(session, address)
        if row is None or row.failures < current_app.config["PASTO_AUTH_FAILURE_LIMIT"]:
            return
        remaining = (row.window_started_at - now).total_seconds() + AUTH_FAILURE_WINDOW_SECONDS
        if remaining <= 0:
            return
        retry_after = max(1, math.ceil(remaining))
        raise ApiError(429, "too_many_requests",
                       f"Too many invalid tokens from this address ({row.failures} in "
                       f"{AUTH_FAILURE_WINDOW_SECONDS:g} s); retry in {retry_after} s.",
                       {"retry_after_seconds": retry_after}, headers={"Retry-After": str(retry_after)})

    def _record_failure(self, address: str, now: datetime) -> None:
        """Count one invalid token from ``address``; log the first of its window."""
        failures = store.count_auth_failure(get_uow().database, address, now,
                                            timedelta(seconds=AUTH_FAILURE_WINDOW_SECONDS))
        if failures == 1:
            log.warning("Invalid bearer token from %s (%s %s). Further failures from this address are "
                        "counted, not logged, for %g s; after %d of them it is refused 429 until then.",
                        address, request.method, request.path[:200], AUTH_FAILURE_WINDOW_SECONDS,
                        current_app.config["PASTO_AUTH_FAILURE_LIMIT"])


def init_app(app: Flask) -> None:
    admin_token = app.config.get("PASTO_ADMIN_TOKEN")
    warn_if_weak_admin_token(admin_token, log)
    app.extensions[_EXTENSION] = _Authenticator(admin_token)


def authenticate(required_role: str) -> str:
    """Check the request's bearer token against ``required_role``; return the token's role.

    Raises 401 when the token is missing or unknown, 403 when its role is too low.
    """
    current = request._get_current_object()  # one context lookup instead of one per attribute
    header = current.headers.get("Authorization", "")
    if not header and required_role == "metrics" and current_app.config["PASTO_METRICS_ANONYMOUS"]:
        g.token_role = "metrics"
        return "metrics"
    if not header and required_role in ("metrics", "read") and anonymous_read_allowed():
        g.token_role = "read"
        return "read"
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise ApiError(401, "unauthorized", "This endpoint needs an `Authorization: Bearer <token>` header.")
    role = current_app.extensions[_EXTENSION].role_of(token, (current.remote_addr or "unknown")[:64])
    if role is None:
        raise ApiError(401, "unauthorized", "The bearer token is not valid.")
    if ROLE_RANK[role] < ROLE_RANK[required_role]:
        raise ApiError(403, "forbidden", f"This endpoint needs the {required_role!r} role; the token has {role!r}.")
    g.token_role = role
    return role


def known_role(app: Flask, header: str) -> str | None:
    """The role of the bearer token in ``header`` (an ``Authorization`` value) when ``app`` knows it
    without a lookup (:meth:`_Authenticator.known_role`); None when :func:`authenticate` must decide."""
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return app.extensions[_EXTENSION].known_role(token)


def anonymous_read_allowed() -> bool:
    """Whether this request may read without a token: ``PASTO_ANONYMOUS_LOOPBACK_READ`` is on and the
    peer is a loopback address (a reverse proxy on the same machine would make everyone local)."""
    if not current_app.config.get("PASTO_ANONYMOUS_LOOPBACK_READ"):
        return False
    try:
        return ipaddress.ip_address(request.remote_addr or "").is_loopback
    except ValueError:
        return False


def require_role(role: str) -> Callable:
    """View decorator: the request must carry a token with at least ``role``."""
    if role not in ROLE_RANK:
        raise ValueError(f"Unknown role {role!r}.")

    def decorate(view: Callable) -> Callable:
        @functools.wraps(view)
        def wrapped(*args, **kwargs):
            authenticate(role)
            return view(*args, **kwargs)

        wrapped.required_role = role
        return wrapped

    return decorate
