"""The service's layering holds:

- routes (``service/routes/``) never reach the database themselves (no SQLAlchemy, no
  ``service.store``, no ``service.models``);
- the use cases (``service/controller/``) know nothing of Flask: they are given a ``UnitOfWork``;
- the store (``service/store.py``, all SQL) knows nothing of HTTP (no Flask);
- only the store, and the modules that define the engine and the schema (``service/db.py``,
  ``service/models.py``, ``migrations/``), import SQLAlchemy. ``service/sources/`` is the one other
  place: it runs a metric source's query on the *warehouse's* engine (DuckDB, Spark, any URL), never on
  the service's database.

Checked on the import statements of each module's source, relative imports resolved, so an import
inside a function counts too; :func:`layer_violations` checks a whole tree, and a copy of the tree with
planted violations shows that it fails. (The core's contract, ``pasto`` importing nothing above it, is
``tests/test_layers.py``.)"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

SERVICE = Path(__file__).resolve().parents[2] / "service"

#: Modules a route may not import, and a prefix of each (``sqlalchemy.orm`` is SQLAlchemy too).
ROUTE_FORBIDDEN = ("sqlalchemy", "service.store", "service.models")
STORE_FORBIDDEN = ("flask", "werkzeug")
CONTROLLER_FORBIDDEN = ("flask", "werkzeug")
#: The service modules that may import SQLAlchemy (paths relative to ``service/``; a folder ends in /).
SQLALCHEMY_ALLOWED = ("store.py", "db.py", "models.py", "sources/")


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


def module_name(path: Path, root: Path) -> str:
    """``service/controller/rounds.py`` under ``root`` (the ``service`` folder) -> ``service.controller.rounds``."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts)


def layer_violations(root: Path) -> list[str]:
    """Every import that breaks the service's layering in the tree ``root`` (a ``service`` folder), as
    ``"<file>: <rule>: <module>"``; empty when the layering holds."""
    found = []

    def check(path: Path, rule: str, forbidden: tuple[str, ...]) -> None:
        for name in violations(path.read_text(), module_name(path, root), forbidden):
            found.append(f"{path.relative_to(root.parent)}: {rule}: {name}")

    for path in sorted((root / "routes").glob("*.py")):
        check(path, "a route reaches the database", ROUTE_FORBIDDEN)
    for path in sorted((root / "controller").glob("*.py")):
        check(path, "a use case imports Flask", CONTROLLER_FORBIDDEN)
    check(root / "store.py", "the store knows HTTP", STORE_FORBIDDEN)
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if not any(relative == allowed or (allowed.endswith("/") and relative.startswith(allowed))
                   for allowed in SQLALCHEMY_ALLOWED):
            check(path, "SQL outside the store", ("sqlalchemy",))
    return found


def test_the_service_keeps_its_layers():
    assert layer_violations(SERVICE) == []


def test_every_use_case_module_is_checked():
    assert {path.stem for path in (SERVICE / "controller").glob("*.py")} >= {
        "experiments", "assignment", "ingestion", "statistics", "rounds", "reports", "retention", "sources"}


@pytest.mark.parametrize(("file", "planted", "expected"), [
    ("controller/rounds.py", "from flask import current_app\n", "a use case imports Flask: flask"),
    ("controller/reports.py", "def f():\n    import werkzeug.exceptions\n", "a use case imports Flask: werkzeug.exceptions"),
    ("controller/ingestion.py", "import sqlalchemy as sa\n", "SQL outside the store: sqlalchemy"),
    ("auth.py", "from sqlalchemy.orm import Session\n", "SQL outside the store: sqlalchemy.orm"),
    ("demo/setup.py", "import sqlalchemy\n", "SQL outside the store: sqlalchemy"),
    ("cli.py", "def f():\n    import sqlalchemy as sa\n", "SQL outside the store: sqlalchemy"),
    ("routes/rounds.py", "from .. import store\n", "a route reaches the database: service.store"),
    ("store.py", "from flask import g\n", "the store knows HTTP: flask"),
])
def test_a_violation_planted_in_a_copy_of_the_tree_fails_the_check(tmp_path, file, planted, expected):
    copy = tmp_path / "service"
    shutil.copytree(SERVICE, copy, ignore=shutil.ignore_patterns("static", "templates", "__pycache__"))
    assert layer_violations(copy) == []
    target = copy / file
    target.write_text(target.read_text() + "\n" + planted)
    after = layer_violations(copy)
    assert f"service/{file}: {expected}" in after
    assert all(violation.startswith(f"service/{file}: ") for violation in after)


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
