"""The service's layering holds: routes (``service/routes/``) never reach the database themselves (no
SQLAlchemy, no ``service.store``, no ``service.models``), and the store (``service/store.py``, all SQL)
knows nothing of HTTP (no Flask). Checked on the import statements of each module's source, relative
imports resolved, so an import inside a function counts too. (The core's contract, ``pasto`` importing
nothing above it, is ``tests/test_layers.py``.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVICE = Path(__file__).resolve().parents[2] / "service"

#: Modules a route may not import, and a prefix of each (``sqlalchemy.orm`` is SQLAlchemy too).
ROUTE_FORBIDDEN = ("sqlalchemy", "service.store", "service.models")
STORE_FORBIDDEN = ("flask", "werkzeug")


def imported_modules(source: str, module: str) -> set[str]:
    """Every module ``source`` (the text of module ``module``, dotted) imports, absolute names; for
    ``from package import name`` both ``package`` and ``package.name`` (``name`` may be a module)."""
    package = module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            found.add(origin)
            found.update(f"{origin}.{alias.name}" for alias in node.names)
    return found


def violations(source: str, module: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(name for name in imported_modules(source, module)
                  if any(name == prefix or name.startswith(prefix + ".") for prefix in forbidden))


def route_modules() -> list[Path]:
    return sorted((SERVICE / "routes").glob("*.py"))


def test_there_are_routes_to_check():
    assert {path.stem for path in route_modules()} >= {
        "experiments", "assignment", "observations", "rounds", "diagnostics", "health", "dashboard", "monitoring"}


@pytest.mark.parametrize("path", route_modules(), ids=lambda path: path.name)
def test_routes_do_not_touch_the_database(path):
    # "service.routes.__init__" too: its relative imports resolve against service.routes, like the others'.
    assert violations(path.read_text(), f"service.routes.{path.stem}", ROUTE_FORBIDDEN) == []


def test_the_store_does_not_know_http():
    assert violations((SERVICE / "store.py").read_text(), "service.store", STORE_FORBIDDEN) == []


@pytest.mark.parametrize(("source", "module", "forbidden", "expected"), [
    ("import sqlalchemy as sa\n", "service.routes.planted", ROUTE_FORBIDDEN, ["sqlalchemy"]),
    ("from sqlalchemy.orm import Session\n", "service.routes.planted", ROUTE_FORBIDDEN, ["sqlalchemy.orm",
                                                                                        "sqlalchemy.orm.Session"]),
    ("from .. import store\n", "service.routes.planted", ROUTE_FORBIDDEN, ["service.store"]),
    ("def f():\n    from ..models import Round\n", "service.routes.planted", ROUTE_FORBIDDEN,
     ["service.models", "service.models.Round"]),
    ("from service.store import add_rows\n", "service.routes.planted", ROUTE_FORBIDDEN,
     ["service.store", "service.store.add_rows"]),
    ("from flask import current_app\n", "service.store", STORE_FORBIDDEN, ["flask", "flask.current_app"]),
    ("from ..controller import reports\nfrom .experiments import iso\n", "service.routes.planted",
     ROUTE_FORBIDDEN, []),
])
def test_a_planted_violation_is_caught(source, module, forbidden, expected):
    """The check can fail: forbidden imports written each way are found, allowed ones are not."""
    assert violations(source, module, forbidden) == expected
