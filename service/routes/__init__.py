"""HTTP routes: one blueprint per module. A route parses the request (``service.schemas``), calls the
controller (``service.controller``) and serialises the answer (``service.responses``); it never touches
the database itself (``tests/service/test_layers.py`` checks that no module here imports SQLAlchemy,
``service.store`` or ``service.models``)."""

from __future__ import annotations

from flask import Flask


def register(app: Flask) -> None:
    """Register every blueprint of the service on ``app``."""
    from . import (assignment, dashboard, diagnostics, experiments, health, monitoring, observations, ofrep,
                   rounds, statistics)

    for module in (health, experiments, assignment, observations, statistics, rounds, diagnostics, monitoring,
                   ofrep, dashboard):
        app.register_blueprint(module.bp)
