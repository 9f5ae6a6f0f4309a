"""WSGI entry point: ``gunicorn -w 4 service.wsgi:app`` or ``waitress-serve service.wsgi:app``.

Rounds are closed by a separate ``pasto worker`` process in that setup.
"""

import logging

from . import create_app, freeze_startup_heap
from .db import is_unavailable_error

log = logging.getLogger(__name__)


def _create_app():
    """The application; started without the startup check when the database is unavailable.

    gunicorn imports this module in every worker it boots, also the ones that replace a worker
    during a database outage (or that were still starting when the outage began), and a worker
    whose import raises makes gunicorn's arbiter shut the whole server down ("Worker failed to
    boot", exit code 3), resetting every connection the other workers hold. A database that does
    not answer is therefore not a boot error here: the worker starts and answers 503
    ``database_unavailable`` (``/healthz`` says unreachable) until the database is back, like the
    workers already running. A schema that is not at the newest migration, or a setting pasto cannot
    use, still refuses to start (the database answered, or it is a configuration error).
    """
    try:
        return create_app()
    except Exception as error:
        if not is_unavailable_error(error):  # DatabaseUnreachable and OperationalError are; SchemaOutOfDate is not
            raise
        log.error("The database is unavailable at startup (%s); starting without the schema check, answering "
                  "503 database_unavailable until it is back.", error)
        return create_app({"PASTO_CHECK_SCHEMA": False})


app = _create_app()
freeze_startup_heap()
