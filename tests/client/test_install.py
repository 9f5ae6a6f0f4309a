"""Installing the client alone, as the README says, in a fresh virtual environment.

A recommender that only assigns locally and reports observations installs the project without the
``service`` extra: it gets the core and the client (numpy, scipy, requests) and none of the controller's
web and database stack. The check runs the installed client against a live server (the session's
``pasto serve``), so it proves the install works, not only that it is small.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: What the `service` extra brings and a client-only install must not (pip's normalised names).
SERVICE_ONLY = {
    "flask", "werkzeug", "sqlalchemy", "alembic", "apscheduler", "waitress", "gunicorn",
    "prometheus-client", "psycopg", "psycopg-binary", "pydantic", "threadpoolctl",
}

CLIENT_SCRIPT = """
import json, sys
from pasto_client import Client, LocalAssigner

url, token, name = sys.argv[1:4]
units = [f"user-{i}" for i in range(200)]
with Client(url, token) as client, LocalAssigner(client, name) as assigner:
    assignments = assigner.assign_many(units)
    single = [assigner.assign(unit) for unit in units]
    print(json.dumps({
        "round": assigner.round_index,
        "arms": [a.arm for a in assignments],
        "single": [a.arm for a in single],
        "loaded": sorted(m for m in sys.modules if m.split(".")[0] in {"flask", "sqlalchemy", "service"}),
    }))
"""


def _copy_of_the_checkout(destination: Path) -> Path:
    """The checkout's files a build reads, copied so that the build leaves the checkout untouched."""
    ignore = shutil.ignore_patterns(".git", ".venv", "tests", "bench", "instance", "build", "dist",
                                    "*.egg-info", "__pycache__", "*.sqlite", "test-output")
    shutil.copytree(ROOT, destination, ignore=ignore)
    return destination


@pytest.mark.slow
def test_the_client_alone_installs_without_the_service_stack_and_assigns_like_the_server(
    tmp_path, server, admin, create_experiment
):
    # Nothing of this checkout or of the test's environment may leak into the fresh one.
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    environment = tmp_path / "venv"
    venv.create(environment, with_pip=True)
    python = environment / "bin" / "python"
    checkout = _copy_of_the_checkout(tmp_path / "checkout")

    # The README's command for the client alone: `pip install ./path/to/checkout` (no extra).
    install = subprocess.run([python, "-m", "pip", "install", "--quiet", str(checkout)],
                             capture_output=True, text=True, timeout=900, env=env)
    assert install.returncode == 0, install.stderr[-3000:]

    listed = subprocess.run([python, "-m", "pip", "list", "--format=json"],
                            capture_output=True, text=True, timeout=120, check=True, env=env)
    installed = {package["name"].lower().replace("_", "-") for package in json.loads(listed.stdout)}
    assert {"pasto", "numpy", "scipy", "requests"} <= installed
    assert installed & SERVICE_ONLY == set(), f"the client install pulled {sorted(installed & SERVICE_ONLY)}"
    assert "pyarrow" not in installed  # the Parquet exposure sink's optional `parquet` extra
    # Only pasto's own names at the top of site-packages: the service and its migrations are inside
    # `pasto` (pasto.service, pasto.migrations), never a generic `service` or `migrations`.
    top_level = subprocess.run([python, "-c", "from importlib.metadata import distribution; "
                                "print(distribution('pasto').read_text('top_level.txt'))"],
                               capture_output=True, text=True, timeout=120, check=True, env=env, cwd=tmp_path)
    assert sorted(top_level.stdout.split()) == ["pasto", "pasto_client"]
    shipped = subprocess.run([python, "-c", "import importlib.util as u; print([u.find_spec(n) is None for n in "
                              "('service', 'migrations')], u.find_spec('pasto.service') is not None, "
                              "u.find_spec('pasto.migrations') is not None)"],
                             capture_output=True, text=True, timeout=120, check=True, env=env, cwd=tmp_path)
    assert shipped.stdout.split() == ["[True,", "True]", "True", "True"], shipped.stdout

    # LocalAssigner from that environment against the live server gives the server's assignments.
    name = create_experiment()
    admin.close_round(name)  # round 1: the assigner must follow the server's round, not assume 0
    run = subprocess.run([python, "-c", CLIENT_SCRIPT, server.url, server.admin_token, name],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    units = [f"user-{i}" for i in range(200)]
    expected = [assignment.arm for assignment in admin.assign_many(name, units)]
    assert result["round"] == 1
    assert result["arms"] == expected and result["single"] == expected
    assert result["loaded"] == []

    # The `pasto` command: simulate works (packaged scenarios are installed), a service command says in
    # one line which extra to install.
    pasto = environment / "bin" / "pasto"
    simulate = subprocess.run([pasto, "simulate", "setup-a", "--runs", "3", "--rounds", "20", "--quiet"],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert simulate.returncode == 0, simulate.stderr
    assert "scenario setup-a" in simulate.stdout
    serve = subprocess.run([pasto, "serve"], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert serve.returncode == 2
    assert serve.stderr.count("\n") == 1, serve.stderr
    assert "needs the Python package 'flask'" in serve.stderr and "pip install '.[service]'" in serve.stderr
    listing = subprocess.run([pasto, "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert listing.returncode == 0
    assert "(not installed here: needs the service extra)" in listing.stdout


def test_every_package_folder_of_the_service_is_in_the_wheel():
    """pyproject.toml lists the service's packages by hand (a package-dir mapping cannot be found
    automatically): a new sub-package folder must be listed, or the install would miss it."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(("pasto",) + path.parent.relative_to(ROOT).parts)
               for top in ("service", "migrations") for path in (ROOT / top).rglob("*.py")
               if "__pycache__" not in path.parts}
    assert folders <= listed, sorted(folders - listed)
