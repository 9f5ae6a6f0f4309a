"""Operator dashboard: ``/`` lists every experiment, ``/experiments/<name>`` shows one in detail.

The pages are static shells: the browser reads the same JSON API as any client (with a read token kept
in sessionStorage, or anonymously on loopback when the server allows it) and polls it, so the pages
never show anything the API would not, and need no build step or network beyond this server.
"""

from __future__ import annotations

from flask import Blueprint, current_app, render_template, url_for

from ..auth import anonymous_read_allowed

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
def experiment(name: str) -> str:
    # The same page for every name, without looking it up: the page needs no token, so its status
    # must not tell who may not read the API which experiments exist. The page reads the experiment
    # through the API with the viewer's token and shows the API's message when there is none.
    return render_template("dashboard/experiment.html", name=name, page_config=_page_config())
