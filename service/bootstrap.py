"""The one place the Flask side builds the service's dependencies and hands them out.

``create_app`` (and ``create_command_app``) call :func:`init_app` once per application: it makes the
application's :class:`~service.store.Store` (its database and per-process experiment cache) and keeps
it in ``app.extensions``. The blueprints, the scheduler's jobs, the exporter and the commands take it
from there with :func:`get_store` and pass it into the use cases (``service.controller``), which never
look it up themselves: they run the same with a store made without any application
(``Store.open(database)``, as tests/service/usecases/ do).
"""

from __future__ import annotations

from flask import Flask, current_app

from .cache import ExperimentCache
from .db import get_db
from .store import Store

_EXTENSION = "pasto.store"


def init_app(app: Flask) -> Store:
    """Make the application's store over its database (``service.db.init_app`` first)."""
    database = get_db(app)
    store = Store(database, ExperimentCache(database, float(app.config["PASTO_VERSION_CHECK_SECONDS"])))
    app.extensions[_EXTENSION] = store
    return store


def get_store(app: Flask | None = None) -> Store:
    """The :class:`~service.store.Store` of ``app`` (the current application by default)."""
    return (app or current_app).extensions[_EXTENSION]
