"""The background jobs: APScheduler 3.x running :func:`run_scheduled_work` (closes rounds) and
:func:`run_retention` (prunes old observation ids).

``pasto serve`` starts it beside the web server, ``pasto worker`` runs it alone. Several schedulers
may run against one database: closing is a compare-and-set (see ``service.controller.rounds``). Each run
writes a heartbeat row, so ``/healthz`` in any web worker can tell whether a scheduler is alive. The
first run of a started scheduler that reaches the database records the start (a ``controller_started``
event per experiment not stopped, in the round it is serving), so restarts show on the dashboard.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import datetime, timezone

from apscheduler.schedulers.background import BackgroundScheduler
from flask import Flask

from .controller.retention import PruneResult, prune
from .controller.rounds import (RoundAdvance, SourceCloses, close_due_rounds, record_controller_start,
                                record_heartbeat)
from .bootstrap import get_uow
from .db import is_unavailable_error
from .models import utcnow
from .sources import SourceLimits
from .store import UnitOfWork

log = logging.getLogger(__name__)


def scheduler_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def heartbeat(uow: UnitOfWork, name: str, now: datetime) -> None:
    """Record that scheduler ``name`` is alive (``/healthz`` reads the newest heartbeat)."""
    record_heartbeat(uow, name, now)


@dataclass
class ControllerStart:
    """A scheduler process's start, not yet recorded until ``recorded`` (its ticks run one at a time)."""

    at: datetime
    recorded: bool = False


def run_scheduled_work(app: Flask, name: str, start: ControllerStart | None = None,
                       source_closes: SourceCloses | None = None) -> list[RoundAdvance]:
    """One scheduler tick: record the heartbeat and, the first time, the scheduler's ``start``; then
    close due rounds (experiments with a metric source: handed to ``source_closes`` when given, so a
    slow source never holds the tick, its heartbeat or another experiment's close).

    The start is recorded before any close, so each experiment's event names the round it was serving
    when the controller came back (rounds that ended while it was down close right after). While the
    database is unavailable a tick does nothing (the next one tries again, the start included) and
    the outage is logged once, not once per tick."""
    uow = get_uow(app)
    now = utcnow()
    try:
        heartbeat(uow, name, now)
        if start is not None and not start.recorded:
            record_controller_start(uow, name, start.at)
            start.recorded = True
        advances = close_due_rounds(uow, now, limits=SourceLimits.from_config(app.config),
                                    source_closes=source_closes)
    except Exception as error:
        if not is_unavailable_error(error):
            raise
        uow.database.status.failed(error)
        return []
    for advance in advances:
        log.info("Experiment %s: closed round %s, applied %s, now serving round %s (%.1f ms)",
                 advance.experiment, advance.closed_round, list(advance.applied), advance.round_index,
                 advance.duration_seconds * 1000)
    return advances


def run_retention(app: Flask) -> PruneResult | None:
    """One retention run (``service.controller.retention.prune``) with ``PASTO_RETENTION_SECONDS``;
    None while the database is unavailable (the next run tries again)."""
    uow = get_uow(app)
    try:
        result = prune(uow, utcnow(), app.config["PASTO_RETENTION_SECONDS"])
    except Exception as error:
        if not is_unavailable_error(error):
            raise
        uow.database.status.failed(error)
        return None
    if result.advanced or any(result.deleted.values()):
        log.info("Retention: pruned rounds below %s (experiment id: rounds); deleted %s%s", result.advanced,
                 result.deleted, "" if result.finished else " (more left for the next run)")
    return result


def start_scheduler(app: Flask) -> BackgroundScheduler:
    """Start a daemon BackgroundScheduler running :func:`run_scheduled_work` every
    ``PASTO_SCHEDULER_INTERVAL`` (its first run, at once, records this start; source experiments'
    closes run off the tick, ``PASTO_SOURCE_WORKERS`` at once) and :func:`run_retention` every
    ``PASTO_RETENTION_CHECK_SECONDS``."""
    interval = float(app.config["PASTO_SCHEDULER_INTERVAL"])
    scheduler = BackgroundScheduler(timezone=timezone.utc, daemon=True)
    source_closes = SourceCloses(get_uow(app), app.config["PASTO_SOURCE_WORKERS"], SourceLimits.from_config(app.config),
                                 clock=lambda: utcnow())
    scheduler.add_job(
        run_scheduled_work, "interval", seconds=interval,
        args=[app, scheduler_name(), ControllerStart(utcnow()), source_closes],
        id="pasto-close-rounds", max_instances=1, coalesce=True, misfire_grace_time=None,
        next_run_time=datetime.now(timezone.utc),
    )
    if app.config["PASTO_RETENTION_SECONDS"] is not None:
        scheduler.add_job(
            run_retention, "interval", seconds=float(app.config["PASTO_RETENTION_CHECK_SECONDS"]), args=[app],
            id="pasto-retention", max_instances=1, coalesce=True, misfire_grace_time=None,
        )
    scheduler.start()
    return scheduler
