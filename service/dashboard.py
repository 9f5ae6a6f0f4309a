"""Operator dashboard: ``/`` lists every experiment, ``/experiments/<name>`` shows one in detail.

The pages are static shells: the browser reads the same JSON API as any client (with a read token kept
in sessionStorage, or anonymously on loopback when the server allows it) and polls it, so the pages
never show anything the API would not, and need no build step or network beyond this server.
"""

from __future__ import annotations

from flask import Blueprint, current_app, render_template, url_for

bp = Blueprint("dashboard", __name__)

DEFAULT_POLL_SECONDS = 5.0


def _page_config() -> dict:
    from service.auth import anonymous_read_allowed

    return {
        "apiBase": url_for("dashboard.index").rstrip("/") + "/api/v1",
        "experimentPage": url_for("dashboard.experiment", name="__name__"),
        "anonymousRead": anonymous_read_allowed(),
        "pollSeconds": float(current_app.config.get("PASTO_DASHBOARD_POLL_SECONDS", DEFAULT_POLL_SECONDS)),
    }


@bp.get("/")
def index() -> str:
    return render_template("dashboard/index.html", page_config=_page_config())


@bp.get("/experiments/<name>")
def experiment(name: str) -> str:
    # An unknown name still renders: the page reports the API's 404, which needs no second code path.
    return render_template("dashboard/experiment.html", name=name, page_config=_page_config())
