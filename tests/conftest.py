"""Shared fixtures: a throwaway PostgreSQL cluster, and the rule that CI may not skip backend suites.

PostgreSQL: ``PASTO_TEST_POSTGRES_URL`` (a server URL such as
``postgresql+psycopg://user@127.0.0.1:5432/postgres``) is used when set; otherwise, when Debian's
``postgresql`` package is installed, a private cluster (``bench/pgcluster.py``) is created in a temporary
folder, listening on loopback only, and removed at the end of the session. Each test gets a fresh database.

Timing, in every suite: no test asserts how fast something ran (bench/ measures that, as ratios). A
``timeout=`` on an HTTP request, a subprocess or a thread join, and the deadline of a polling loop, are
hang guards: far above what the step takes on a loaded 2-core machine, reached only by a failing run.
A sleep is a lower bound (waiting longer changes nothing) or is replaced by waiting for the event
itself. The few real tolerances (a bound a correct but slow run could cross) say so in a comment
next to the bound, with the reason for the figure.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest

from bench.pgcluster import Cluster as _Cluster
from bench.pgcluster import postgres_bin_dir as _postgres_bin_dir

BACKEND_MARKERS = ("postgres", "chromium", "spark")


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (_in_ci() and report.skipped):
        return
    markers = [name for name in BACKEND_MARKERS if item.get_closest_marker(name)]
    if markers:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (
            f"CI=true: a test marked {', '.join(markers)} was skipped ({reason}); "
            "CI must install and run that backend."
        )


def pytest_sessionfinish(session):
    """Collect the session's garbage now and freeze what survives. An xdist worker reports itself
    finished after this hook; then pytest's cleanup runs five full garbage collections (to report
    objects whose finaliser raised), and execnet interrupts a worker still busy 5 s after the
    controller asked it to exit. A worker's heap after a few hundred tests took longer than that
    on a loaded machine: the SIGINT landed in a gc callback and was reported as a warning. Collected
    here, before the report, the finalisers still run under pytest's hook; frozen, the survivors
    cost the later collections nothing."""
    gc.collect()
    gc.freeze()


#: Session-scoped fixtures that cost seconds to build (a JVM): the tests that use one run in one worker,
#: and so do the tests with the marker of the same name, which may ask for the fixture only while they
#: run (``request.getfixturevalue``): each worker that ran one would start a JVM of its own.
SHARED_SESSION_FIXTURES = ("spark",)

#: Tests of half a minute or more (``--durations`` of a whole run), sent to the workers first: a long test
#: that starts last keeps one worker busy after the others are done. Node id prefixes; one that no
#: longer matches only changes the order.
LONG_FIRST = (
    "tests/reliability/test_bad_input.py::test_fuzzed_requests_never_get_a_5xx",
    "tests/client/test_install.py::",
    "tests/client/test_ofrep_python_provider.py::test_ten_thousand_units_get_the_arms_assign_gives",
    "tests/docs/test_examples.py::test_every_example_runs",
    "tests/reliability/test_crash.py::test_kills_during_closes_leave_every_applied_round_summarized",
    "tests/reliability/test_database_outage.py::test_postgres_stalled_healthz_answers_and_no_worker_is_killed",
    "tests/service/test_demo.py::test_demo_runs_resumes_and_learns_a_winning_mixture",
    "tests/pasto/test_serving.py::test_served_regret_on_a_soft_guardrail_grows_sublinearly",
    "tests/pasto/test_simulate.py::test_drawn_means_report_relative_gain_and_no_fixed_optimum",
    "tests/service/test_assignment_vectors.py::test_the_server_reproduces_every_case",
    "tests/sources/test_attribution.py::",
    "tests/reliability/test_concurrency.py::test_gunicorn_four_workers_and_pasto_worker_count_concurrent_writers_once",
    "tests/reliability/test_token_lifecycle.py::",
    "tests/reliability/test_schedulers.py::test_two_workers_close_every_round_exactly_once",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``make test`` runs ``-n 6 --dist loadgroup``), tests that share an expensive
    fixture run in the same worker, so that it is built once: the tests of a module with a module-scoped
    fixture (a seeded live server, a browser) form one group, and those using a fixture of
    :data:`SHARED_SESSION_FIXTURES` another. Every other test goes to whichever worker is free. Runs before
    xdist's own hook, which reads the ``xdist_group`` marks; without xdist the marks change nothing."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    if hasattr(config, "workerinput"):  # an xdist worker's collection, which the scheduler queues from
        # Stable: every other test keeps its place. loadgroup queues the groups of several tests first
        # (largest first), then single tests in this order.
        items.sort(key=lambda item: not item.nodeid.startswith(LONG_FIRST))
    for item in items:
        definitions = getattr(item, "_fixtureinfo", None)
        if definitions is None:
            continue
        used = definitions.name2fixturedefs
        shared = [name for name in SHARED_SESSION_FIXTURES if name in used or item.get_closest_marker(name)]
        if shared:
            item.add_marker(pytest.mark.xdist_group(shared[0]))
        elif any(fixturedefs[-1].scope == "module" for fixturedefs in used.values()):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture(scope="session")
def postgres_server_url() -> Iterator[str]:
    """URL of a PostgreSQL server's maintenance database, or skip when none can be had."""
    configured = os.environ.get("PASTO_TEST_POSTGRES_URL")
    if configured:
        yield configured
        return
    bin_dir = _postgres_bin_dir()
    if bin_dir is None:
        pytest.skip("PostgreSQL is not installed (Debian package `postgresql`), "
                    "and PASTO_TEST_POSTGRES_URL is not set.")
    cluster = _Cluster(bin_dir)
    try:
        cluster.start()
    except (subprocess.CalledProcessError, OSError) as error:
        detail = getattr(error, "stderr", b"") or b""
        shutil.rmtree(cluster.root, ignore_errors=True)
        pytest.skip(f"Could not start a private PostgreSQL cluster: {error} {detail.decode(errors='replace')}")
    try:
        yield cluster.url
    finally:
        cluster.stop()


@pytest.fixture
def postgres_url(postgres_server_url: str) -> Iterator[str]:
    """SQLAlchemy URL of a fresh, empty PostgreSQL database, dropped after the test."""
    import sqlalchemy as sa

    name = f"pasto_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(postgres_server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
    base, _, _ = postgres_server_url.rpartition("/")
    try:
        yield f"{base}/{name}"
    finally:
        with admin.connect() as connection:
            # Hang guard, not a tolerance: terminated backends exit within milliseconds; DROP DATABASE is retried
            # until then.
            deadline = time.monotonic() + 10
            while True:
                connection.execute(sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :name AND pid <> pg_backend_pid()"), {"name": name})
                try:
                    connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))
                    break
                except sa.exc.OperationalError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        admin.dispose()
