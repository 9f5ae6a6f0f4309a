"""Operator dashboard: ``/`` lists every experiment, ``/experiments/<name>`` shows one in detail.

The pages are static shells: the browser reads the same JSON API as any client (with a read token kept
in sessionStorage, or anonymously on loopback when the server allows it) and polls it, so the pages
never show anything the API would not, and need no build step or network beyond this server.
"""

from __future__ import annotations

from flask import Blueprint, current_app, render_template, url_for

from ..auth import anonymous_read_allowed
from ..controller import reports

bp = Blueprint("dashboard", __name__)


def _page_config() -> dict:
    return {
        "apiBase": url_for("experiments.list_experiments").removesuffix("/experiments"),
        "experimentPage": url_for("dashboard.experiment", name="__name__"),
        "anonymousRead": anonymous_read_allowed(),
        "pollSeconds": current_app.config["PASTO_DASHBOARD_POLL_SECONDS"],
    }


@bp.get("/")
def index() -> str:
    return render_template("dashboard/index.html", page_config=_page_config())


@bp.get("/experiments/<name>")
def experiment(name: str) -> tuple[str, int]:
    # The page for an unknown name still renders (it shows the API's message), with the right status.
    exists = reports.experiment_exists(name)
    return render_template("dashboard/experiment.html", name=name, page_config=_page_config()), 200 if exists else 404
