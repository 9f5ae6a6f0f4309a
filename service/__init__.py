"""The pasto controller service: a Flask JSON API over SQLAlchemy that calls ``pasto`` for the math.

Layers: ``service.routes`` (one blueprint per resource: parse, call, serialise) -> ``service.controller``
(the use cases and their transactions; calls ``pasto``; given a ``service.store.UnitOfWork``) ->
``service.store`` (every SQL statement) over ``service.db`` (engine and sessions) and ``service.models``
(tables). ``service.cache`` holds the per-process experiment snapshots, ``service.bootstrap`` makes the
application's unit of work, ``service.scheduler`` runs the scheduled round closes.

``create_app(config=None)`` builds an application; ``service.wsgi:app`` is the WSGI object for
waitress or gunicorn. The scheduler that closes rounds is started by ``pasto serve`` / ``pasto worker``
(``service.scheduler``), never by the factory, so web workers under gunicorn do not each run one.
"""

from __future__ import annotations

import gc
import importlib
import os
from collections.abc import Mapping
from typing import Any

from flask import Flask

from . import db
from .config import load_config


def migrations_package():
    """The Alembic migrations beside this package: ``migrations`` in a checkout, ``pasto.migrations``
    when installed (pyproject.toml ships ``service/`` and ``migrations/`` as ``pasto.service`` and
    ``pasto.migrations``, so that installing pasto adds no generic top-level package)."""
    return importlib.import_module(f"{__name__.rpartition('service')[0]}migrations")


class SchemaOutOfDate(RuntimeError):
    """The database has not been migrated to the revision this code needs."""


def create_app(config: Mapping[str, Any] | None = None) -> Flask:
    """Create the application.

    Parameters
    ----------
    config : mapping, optional
        Overrides of the configuration read from the environment (see ``service.config``).

    Raises
    ------
    service.config.ConfigurationError
        When a setting has a value pasto cannot use (the message names it), including a
        ``PASTO_DATABASE_URL`` that is not an SQLite or PostgreSQL URL.
    service.db.DatabaseUnreachable
        When the database does not accept a connection, unless ``PASTO_CHECK_SCHEMA`` is false.
    SchemaOutOfDate
        When the database is not at the newest migration (run ``pasto db upgrade``), unless
        ``PASTO_CHECK_SCHEMA`` is false.
    """
    # Imported here, not with the package: a command that needs only the database (`pasto tokens`,
    # create_command_app) then skips the routes, Prometheus and the numerical core behind them.
    from . import auth, bootstrap, exposures, monitoring, params, routes, security
    from .errors import register_error_handlers

    app = Flask(__name__, instance_relative_config=True)
    app.config.update(load_config(app.instance_path, config))
    app.json.sort_keys = False

    register_error_handlers(app)
    params.init_app(app)  # before any route: its converter checks every path parameter
    security.init_app(app)
    database = db.init_app(app)
    if app.config["PASTO_CHECK_SCHEMA"]:
        db.check_connection(database.engine)
        check_schema(database.engine)
    auth.init_app(app)
    bootstrap.init_app(app)
    exposures.init_app(app)
    monitoring.init_app(app)
    routes.register(app)
    from .routes.assignment import FastAssign

    app.wsgi_app = FastAssign(app, app.wsgi_app)  # assign below Flask's dispatch
    one_blas_thread()  # after the routes: they load the numerical core and its BLAS libraries
    return app


# Variables through which an operator sets the BLAS libraries' thread count.
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def one_blas_thread() -> None:
    """Run the BLAS libraries loaded in this process (numpy's, scipy's) on one thread each, unless
    the operator set a count in one of :data:`BLAS_THREAD_VARIABLES`.

    The service's concurrency is its requests (server threads, gunicorn workers) and the round
    close beside them. The close's products are K x M matrix-vector products, which a second BLAS
    thread hardly shortens but which stall while BLAS threads wait for busy cores: at K = 100,000
    the `default` update took 1.1 to 2.4 s with OpenBLAS's default two threads and 0.33 to 0.65 s
    on one, on the busy 2-core machine of docs/benchmarks.md ("The round close at large K").
    """
    if any(os.environ.get(name) for name in BLAS_THREAD_VARIABLES):
        return
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")


def create_command_app(config: Mapping[str, Any] | None = None, *, unit_of_work: bool = True) -> Flask:
    """An application with the configuration and the database only (checked as :func:`create_app`
    checks it), for commands that use the database and serve nothing (``pasto tokens``, ``pasto db``):
    it starts in a fraction of the time, without the routes, the exporter and the numerical core.

    ``unit_of_work=False`` also leaves out the unit of work (and the token store and response models
    behind it), for ``pasto db``, which only hands the database's URL and engine to Alembic."""
    app = Flask(__name__, instance_relative_config=True)
    app.config.update(load_config(app.instance_path, config))
    database = db.init_app(app)
    if app.config["PASTO_CHECK_SCHEMA"]:
        db.check_connection(database.engine)
        check_schema(database.engine)
    if unit_of_work:
        from . import bootstrap

        bootstrap.init_app(app)
    return app


def freeze_startup_heap() -> None:
    """Take the objects alive now out of the cyclic garbage collector's full collections.

    For a server process, once its application is built and before it serves. A request that
    ingests a batch of observations allocates thousands of containers (the parsed JSON, one
    validated model per observation), enough to trigger a full collection every 20 batches or so,
    and a full collection walks every object of the process: the modules, SQLAlchemy's and
    pydantic's schemas, ... (about 150,000 objects, 80 ms, on the benchmark machine). Frozen, those
    are skipped, and a full collection only walks what the requests allocated. Garbage is collected
    first, so no cycle is frozen; the frozen objects were meant to live as long as the process.
    """
    gc.collect()
    gc.freeze()


def check_schema(engine) -> None:
    """Raise :class:`SchemaOutOfDate` unless the database is at the newest migration."""
    migrations = migrations_package()

    current = migrations.current_revision(engine)
    head = migrations.head_revision()
    if current != head:
        where = engine.url.render_as_string(hide_password=True)
        found = "has never been migrated" if current is None else f"is at schema revision {current}"
        raise SchemaOutOfDate(
            f"The database {where} {found}, but this version of pasto needs revision {head}. "
            "Run `pasto db upgrade` (with the same PASTO_DATABASE_URL) and start again."
        )
