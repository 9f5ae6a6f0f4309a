"""The one place the Flask side builds what the use cases are given, and hands it out.

``create_app`` (and ``create_command_app``) call :func:`init_app` once per application: it makes the
application's :class:`~service.store.UnitOfWork` (its database and per-process experiment cache) and
keeps it in ``app.extensions``. The blueprints, the scheduler's jobs, the exporter and the commands
take it from there with :func:`get_uow` and pass it into the use cases (``service.controller``), which
never look it up themselves: they run the same with one made without any application
(``UnitOfWork.open(database)``, as tests/service/usecases/ do).
"""

from __future__ import annotations

from flask import Flask, current_app

from .cache import ExperimentCache
from .db import get_db
from .store import UnitOfWork

_EXTENSION = "pasto.uow"


def init_app(app: Flask) -> UnitOfWork:
    """Make the application's unit of work over its database (``service.db.init_app`` first)."""
    database = get_db(app)
    uow = UnitOfWork(database, ExperimentCache(database, float(app.config["PASTO_VERSION_CHECK_SECONDS"])))
    app.extensions[_EXTENSION] = uow
    return uow


def get_uow(app: Flask | None = None) -> UnitOfWork:
    """The :class:`~service.store.UnitOfWork` of ``app`` (the current application by default)."""
    return (app or current_app).extensions[_EXTENSION]
