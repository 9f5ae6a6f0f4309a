"""Errors raised by :mod:`pasto_client`: one base class, what the server said, what the network did."""

from __future__ import annotations

from typing import Any


class PastoError(Exception):
    """Base class of every error raised by :mod:`pasto_client`."""


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
    retry_after : float or None
        Seconds the server asked the client to wait before sending the request again (its
        ``Retry-After`` header, for example on 503 ``database_unavailable``), or None.
    """

    def __init__(self, status: int, code: str, message: str, details: Any = None,
                 retry_after: float | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.details = details
        self.retry_after = retry_after

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
