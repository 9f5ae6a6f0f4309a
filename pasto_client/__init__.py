"""Python client for the pasto controller: HTTP calls, local assignment and buffered observations.

Three pieces, each usable on its own, each in its own module:

- :class:`Client` (:mod:`pasto_client.client`) wraps every route of the HTTP API in a typed method
  and turns the server's JSON errors into :class:`PastoAPIError`.
- :class:`LocalAssigner` (:mod:`pasto_client.assigner`) fetches an experiment's mixture, seed and
  round once and then assigns units in-process, without an HTTP round trip, with the same hashing as
  the server (:mod:`pasto.hashing`), so a unit gets exactly the arm the server would give it. It
  refreshes when the round ends or its TTL expires and keeps serving the last mixture while the
  server is unreachable.
- :class:`ObservationBuffer` (:mod:`pasto_client.buffer`) batches observations in a background
  thread, stamps each with an idempotency id when it is added (so retries never double count),
  retries network errors and 5xx with exponential backoff, and never drops anything silently.
- :class:`ExposureLog` (:mod:`pasto_client.exposure`) records one exposure per assignment (unit,
  experiment, round, arm, probability, mixture version, time) and writes them in batches from a
  background thread to a sink: :class:`CallbackSink`, :class:`JsonLinesSink` or :class:`ParquetSink`
  (the ``parquet`` extra); ``LocalAssigner(..., exposure_sink=...)`` attaches one.

The package depends on the standard library, the pure ``pasto`` core (numpy, scipy) and requests
only; it never imports Flask, SQLAlchemy or the service, so a recommender installs it without the
service's dependencies (README, "Install"). pyarrow, for Parquet, is imported only when a
:class:`ParquetSink` is made.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pasto_client.assigner import LocalAssigner
    from pasto_client.buffer import ObservationBuffer
    from pasto_client.client import Assignment, Client
    from pasto_client.errors import BufferOverflowError, PastoAPIError, PastoConnectionError, PastoError
    from pasto_client.exposure import CallbackSink, ExposureBatch, ExposureLog, JsonLinesSink, ParquetSink

#: The module of each name exported here. Loaded on first use (PEP 562), not with the package: the
#: service imports ``pasto_client.exposure`` alone, which then costs neither requests nor urllib3.
_MODULES = {
    "LocalAssigner": "assigner",
    "ObservationBuffer": "buffer",
    "Assignment": "client",
    "Client": "client",
    "BufferOverflowError": "errors",
    "PastoAPIError": "errors",
    "PastoConnectionError": "errors",
    "PastoError": "errors",
    "CallbackSink": "exposure",
    "ExposureBatch": "exposure",
    "ExposureLog": "exposure",
    "JsonLinesSink": "exposure",
    "ParquetSink": "exposure",
}


def __getattr__(name: str):
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next lookup is an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULES})


__all__ = [
    "Assignment",
    "BufferOverflowError",
    "CallbackSink",
    "Client",
    "ExposureBatch",
    "ExposureLog",
    "JsonLinesSink",
    "ParquetSink",
    "LocalAssigner",
    "ObservationBuffer",
    "PastoAPIError",
    "PastoConnectionError",
    "PastoError",
]
