"""Bearer tokens with three roles, ``read`` < ``ingest`` < ``admin``.

Only the SHA-256 digest of a token is stored (the bootstrap ``PASTO_ADMIN_TOKEN`` is kept in memory as
its digest too). Digests are compared with :func:`hmac.compare_digest`. Valid tokens are cached per
process for a few seconds so the assignment hot path does not query the token table on every request.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import secrets
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone

import sqlalchemy as sa
from flask import Flask, current_app, g, request
from sqlalchemy.orm import Session

from .db import get_db
from .errors import ApiError
from .models import ROLES, Token

ROLE_RANK = {role: rank for rank, role in enumerate(ROLES)}
TOKEN_CACHE_SECONDS = 10.0
_EXTENSION = "pasto.auth"


def hash_token(token: str) -> str:
    """SHA-256 hex digest of ``token``: what the database stores."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def create_token(session: Session, role: str, name: str) -> str:
    """Store a new token for ``role`` and return it; this is the only time it is ever visible."""
    if role not in ROLE_RANK:
        raise ValueError(f"The role must be one of {', '.join(ROLES)}, got {role!r}.")
    token = secrets.token_urlsafe(32)
    session.add(Token(name=name, role=role, token_hash=hash_token(token), created_at=datetime.now(timezone.utc)))
    return token


class _Authenticator:
    def __init__(self, admin_token: str | None) -> None:
        self.admin_digest = hash_token(admin_token) if admin_token else None
        self._cache: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def role_of(self, token: str) -> str | None:
        digest = hash_token(token)
        if self.admin_digest is not None and hmac.compare_digest(digest, self.admin_digest):
            return "admin"
        cached = self._cache.get(digest)
        if cached is not None and cached[1] > time.monotonic():
            return cached[0]
        with get_db().read() as session:
            row = session.execute(sa.select(Token.token_hash, Token.role).where(Token.token_hash == digest)).first()
        if row is None or not hmac.compare_digest(row.token_hash, digest):
            return None
        with self._lock:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[digest] = (row.role, time.monotonic() + TOKEN_CACHE_SECONDS)
        return row.role


def init_app(app: Flask) -> None:
    app.extensions[_EXTENSION] = _Authenticator(app.config.get("PASTO_ADMIN_TOKEN"))


def authenticate(required_role: str) -> str:
    """Check the request's bearer token against ``required_role``; return the token's role.

    Raises 401 when the token is missing or unknown, 403 when its role is too low.
    """
    header = request.headers.get("Authorization", "")
    if not header and required_role == "read" and anonymous_read_allowed():
        g.token_role = "read"
        return "read"
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise ApiError(401, "unauthorized", "This endpoint needs an `Authorization: Bearer <token>` header.")
    role = current_app.extensions[_EXTENSION].role_of(token)
    if role is None:
        raise ApiError(401, "unauthorized", "The bearer token is not valid.")
    if ROLE_RANK[role] < ROLE_RANK[required_role]:
        raise ApiError(403, "forbidden", f"This endpoint needs the {required_role!r} role; the token has {role!r}.")
    g.token_role = role
    return role


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
