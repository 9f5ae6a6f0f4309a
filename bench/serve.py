"""Serving benchmark: assignment and ingestion over HTTP, and the round update, each beside its baseline.

Everything runs on this machine over loopback, in bounded loops (a request cap and a time cap per
pass). Per database backend (SQLite always; PostgreSQL when a server is available):

- ``assign``: requests/s and p50/p99 latency of ``POST /api/v1/experiments/<name>/assign`` with one
  unit and with a batch of units, against a bare Flask endpoint served by the same server (same
  waitress process, same threads) that parses the same JSON body and returns a response of the same
  shape without pasto's work (no token check, no validation, no experiment cache, no hashing, no
  metrics hooks). The load comes from separate client processes (keep-alive ``http.client``
  connections, closed loop); the bare and the real passes alternate (A/B, then B/A) and each keeps
  its best pass.
- ``ingest``: observations/s of ``POST .../observations`` in batches of 1,000 over HTTP against a raw
  ``executemany`` INSERT of the same 1,000 observations per transaction into a plain table of the
  same database (same engine settings, hence the same durability), alternating and best-of-N too.
- ``update``: ``pasto.algorithm.update`` alone, and the service's full round close
  (``service.controller.rounds.close_round`` on a populated database: the statistics query, the update, the
  state write, the per-round summary) for K = 100, 1,000, 10,000 arms and M = 5 metrics, with the
  ``default`` and ``paper`` presets; and the time a worker takes to reload its cached experiment
  after the close.
- optionally (``--gunicorn 1,2``) single-unit assignment under gunicorn with that many gthread
  workers, each against the bare endpoint under the same gunicorn, for the worker-scaling claim.

On SQLite the server also counts the SQL statements it runs (``sqlite3`` trace callback) during the
assign passes: the assignment path must write nothing.

- ``--segmented-close`` (instead of everything above): the round close of a segmented experiment
  (K = 100 arms, S = 50 segments, M = 5 metrics by default, hard guardrails, one global and one
  per segment) beside the unsegmented close of the same K in the same run, on each backend; with
  ``--write-docs`` it replaces the "## Segmented round close" section.

``python bench/serve.py assign`` (apart from the rest): only the assign endpoint against the bare one,
on waitress or under ``--server gunicorn --workers N``, loaded by the Python clients or ``--wrk``
(Debian's wrk), with the server's CPU time per request (:func:`assign_main`). ``python bench/serve.py
close``: the round close at large K (``--arms 10000,100000``) beside the SQL it must run written by
hand, the update alone, the close's peak traced memory and the dashboard's ``?arms=100`` reads
(:func:`close_main`). ``python bench/serve.py best-arm``: the best-arm draws at large K by levels
against every arm scored (:func:`best_arm_main`); ``python bench/serve.py secure-delete``: clearing
a summary input on SQLite with ``secure_delete`` on and FAST (:func:`secure_delete_main`). Their figures are in docs/benchmarks.md, "## Scale
in K and in requests", written by hand.

History (``python bench/serve.py history``, apart from the rest): an experiment of K = 10,000 arms after
1,000 rounds, on SQLite, served by waitress; the bytes and milliseconds of what the dashboard's page
reads on each poll (the experiment, its diagnostics and the rounds that can still change), of its
first load (every page of the history) and of one default page of ``GET .../rounds``, full and
summarised with ``?arms=100`` as the page asks (:func:`measure_history`); ``--write-docs`` replaces the
"## Dashboard poll at K = 10,000 after 1,000 rounds" section. ``python bench/serve.py diagnostics-solve``:
one diagnostics request of that experiment in this process with the cached optimum reused vs. solved
again after ingestion (:func:`measure_diagnostics_solve`; its figures are in docs/benchmarks.md,
"## Diagnostics while traffic flows", written by hand).

Run: ``python bench/serve.py`` (``--write-docs`` replaces the "## Serving" section of
docs/benchmarks.md; ``--quick`` is a seconds-long smoke run). PostgreSQL: ``PASTO_BENCH_POSTGRES_URL``
(a server's maintenance database URL) or, when Debian's ``postgresql`` is installed, a private
loopback cluster started for the run (``bench/pgcluster.py``).
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import itertools
import json
import multiprocessing
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from array import array
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks.md"
ADMIN_TOKEN = "bench-serve-admin-token"
EXPERIMENT = "serving"
METRICS = ("watch_time", "likes", "skips", "shares", "latency")  # M = 5
OBJECTIVE = {
    "primary": {"watch_time": 1.0, "likes": 0.5},
    "guardrails": [
        {"metric": "skips", "threshold": -0.2, "penalty": 5.0},
        {"metric": "latency", "threshold": -0.5, "penalty": 5.0},
    ],
}
RAW_TABLE = "bench_raw_observations"
UNIT_POPULATION = 1_000_000


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------- workload
def arm_params(position: int, n_arms: int) -> dict[str, float]:
    return {"w_watch": 1.0, "w_like": round(position / n_arms, 6), "w_skip": 0.25}


def experiment_body(name: str, n_arms: int, preset: str = "default") -> dict[str, Any]:
    return {
        "name": name,
        "arms": [{"name": f"setting-{k}", "params": arm_params(k, n_arms)} for k in range(n_arms)],
        "metrics": list(METRICS),
        "objective": OBJECTIVE,
        "round_seconds": 86_400,
        "algorithm": {"preset": preset},
        "seed": 20260101,
    }


def observation_batch(tag: str, index: int, size: int, round_index: int) -> list[dict[str, Any]]:
    """Observation ``index`` of pass ``tag``: unique ids, units drawn from a large population, all
    five metrics (the same rows go to the HTTP endpoint and to the raw INSERT)."""
    rng = random.Random(f"{tag}:{index}")
    return [
        {"id": f"{tag}-{index}-{j}", "unit": f"user-{rng.randrange(UNIT_POPULATION)}", "round": round_index,
         "values": {metric: round(rng.gauss(0.0, 1.0), 6) for metric in METRICS}}
        for j in range(size)
    ]


WRITE_STATEMENTS = {"INSERT", "UPDATE", "DELETE", "REPLACE", "CREATE", "DROP", "ALTER", "BEGIN IMMEDIATE",
                    "BEGIN EXCLUSIVE"}


def statement_kind(sql: str) -> str:
    """First keyword of a statement (``BEGIN`` with its mode): SELECT, INSERT, BEGIN IMMEDIATE, ..."""
    words = sql.split(None, 2)
    if not words:
        return ""
    if words[0].upper() == "BEGIN" and len(words) > 1 and words[1].upper() in ("IMMEDIATE", "EXCLUSIVE", "DEFERRED"):
        return f"BEGIN {words[1].upper()}"
    return words[0].upper()


def request_bodies(task: dict[str, Any]) -> list[bytes]:
    kind, count, tag = task["kind"], task["count"], task["tag"]
    if kind == "assign":
        return [json.dumps({"unit": f"user-{tag}-{i}"}).encode() for i in range(count)]
    if kind == "assign_batch":
        size = task["batch_size"]
        return [json.dumps({"units": [f"user-{tag}-{i}-{j}" for j in range(size)]}).encode() for i in range(count)]
    if kind == "ingest":
        return [json.dumps({"observations": observation_batch(tag, i, task["batch_size"], task["round"])}).encode()
                for i in range(count)]
    raise ValueError(f"Unknown request kind {kind!r}.")


# ---------------------------------------------------------------------------------- load generator
def _client_loop(connection) -> None:
    """A client process: per task, build the bodies, connect, report ready, wait for the start
    time, send the requests back to back on one keep-alive connection, report the timings."""
    while True:
        task = connection.recv()
        if task is None:
            return
        try:
            bodies = request_bodies(task)
            client = http.client.HTTPConnection("127.0.0.1", task["port"], timeout=60)
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {task['token']}"}
            connection.send("ready")
            start_at = connection.recv()
            time.sleep(max(0.0, start_at - time.monotonic()))
            deadline = start_at + task["seconds"]
            latencies = array("d")
            errors = 0
            end = time.monotonic()
            for body in bodies:
                started = time.monotonic()
                client.request("POST", task["path"], body, headers)
                response = client.getresponse()
                response.read()
                end = time.monotonic()
                latencies.append(end - started)
                if response.status != task["status"]:
                    errors += 1
                if end >= deadline:
                    break
            client.close()
            connection.send({"count": len(latencies), "errors": errors, "end": end, "latencies": latencies.tobytes()})
        except Exception as error:  # reported to the parent, which raises
            connection.send({"error": f"{type(error).__name__}: {error}"})


class LoadGenerator:
    """``n`` client processes, forked before any database or server work (they only speak HTTP)."""

    def __init__(self, n: int) -> None:
        context = multiprocessing.get_context("fork")
        self._pipes = []
        self._processes = []
        for _ in range(n):
            parent, child = context.Pipe()
            process = context.Process(target=_client_loop, args=(child,), daemon=True)
            process.start()
            child.close()
            self._pipes.append(parent)
            self._processes.append(process)

    def run(self, tasks: list[dict[str, Any]]) -> dict[str, Any]:
        """Run one task per client (at most as many as there are clients), all starting together."""
        pipes = self._pipes[:len(tasks)]
        for pipe, task in zip(pipes, tasks):
            pipe.send(task)
        for pipe in pipes:
            answer = pipe.recv()
            if answer != "ready":
                raise RuntimeError(f"A load-generator client failed: {answer['error']}")
        start_at = time.monotonic() + 0.05
        for pipe in pipes:
            pipe.send(start_at)
        results = [pipe.recv() for pipe in pipes]
        for result in results:
            if "error" in result:
                raise RuntimeError(f"A load-generator client failed: {result['error']}")
        latencies = np.concatenate([np.frombuffer(r["latencies"], dtype=np.float64) for r in results])
        count = sum(r["count"] for r in results)
        elapsed = max(r["end"] for r in results) - start_at
        return {"count": count, "errors": sum(r["errors"] for r in results), "seconds": elapsed,
                "rate": count / elapsed, **_percentiles(latencies)}

    def close(self) -> None:
        for pipe in self._pipes:
            try:
                pipe.send(None)
            except OSError:
                pass
        for process in self._processes:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()


def _percentiles(seconds: np.ndarray) -> dict[str, float]:
    if seconds.size == 0:
        return {"p50_ms": float("nan"), "p99_ms": float("nan")}
    p50, p99 = np.percentile(seconds, [50, 99])
    return {"p50_ms": float(p50) * 1000, "p99_ms": float(p99) * 1000}


# ---------------------------------------------------------------------------------- the server
def _build_wsgi(config: dict[str, Any]):
    """The pasto app with a bare Flask app mounted beside it at ``/bare`` (this benchmark only)."""
    import sqlalchemy as sa
    from flask import Flask, jsonify, request
    from werkzeug.middleware.dispatcher import DispatcherMiddleware

    from service import create_app
    from service.db import get_db, make_engine

    app = create_app({"PASTO_DATABASE_URL": config["url"], "PASTO_ADMIN_TOKEN": ADMIN_TOKEN})
    statements: Counter[str] = Counter()
    engine = get_db(app).engine
    if config.get("trace") and engine.dialect.name == "sqlite":
        @sa.event.listens_for(engine, "connect")
        def _trace(dbapi_connection, _record):
            dbapi_connection.set_trace_callback(lambda sql: statements.update((statement_kind(sql),)))

        engine.dispose()  # every connection from now on is traced

    bare = Flask("pasto_bench_bare")
    bare.json.sort_keys = app.json.sort_keys
    arm, params = "setting-0", arm_params(0, config["n_arms"])

    @bare.post("/assign")
    def bare_assign():
        body = request.get_json()
        if "units" in body:
            return jsonify({"assignments": [
                {"unit": unit, "arm": arm, "params": params, "round": 0, "probability": 1.0} for unit in body["units"]
            ]})
        return jsonify({"unit": body["unit"], "arm": arm, "params": params, "round": 0, "probability": 1.0})

    raw_writer = make_engine(config["url"]).execution_options(pasto_write=True)
    raw_sql = raw_insert_sql(raw_writer.dialect.paramstyle)

    @bare.post("/observations")
    def bare_observations():
        # JSON in, the raw executemany INSERT of the baseline, JSON out: no validation, no aggregation.
        observations = request.get_json()["observations"]
        rows = raw_rows(observations, 0)
        with raw_writer.begin() as connection:
            connection.exec_driver_sql(raw_sql, rows)
        response = jsonify({"accepted": len(rows), "duplicates": 0})
        response.status_code = 202
        return response

    @bare.get("/ping")
    def ping():
        return "ok"

    @bare.get("/statements")
    def statement_counts():
        return jsonify(dict(statements))

    from service import freeze_startup_heap

    freeze_startup_heap()  # as `pasto serve` and service.wsgi do before serving
    return DispatcherMiddleware(app, {"/bare": bare})


def _server_main(config: dict[str, Any]) -> int:
    """``python bench/serve.py _server '<json>'``: serve until SIGTERM."""
    def stop(_signum, _frame):
        raise SystemExit(0)

    if config["server"] == "waitress":
        from waitress import create_server

        server = create_server(_build_wsgi(config), host="127.0.0.1", port=config["port"], threads=config["threads"])
        signal.signal(signal.SIGTERM, stop)
        try:
            server.run()
        finally:
            server.close()
        return 0

    import gunicorn.app.base

    class Standalone(gunicorn.app.base.BaseApplication):
        def load_config(self):
            for key, value in {
                "bind": f"127.0.0.1:{config['port']}", "workers": config["workers"], "worker_class": "gthread",
                "threads": config["threads"], "graceful_timeout": 5, "loglevel": "warning",
            }.items():
                self.cfg.set(key, value)

        def load(self):  # in each worker (no preload): its own app, engine and experiment cache
            return _build_wsgi(config)

    Standalone().run()
    return 0


class Server:
    """A server process on a free loopback port: waitress (``threads``) or gunicorn (``workers``
    gthread workers with ``threads`` each)."""

    def __init__(self, url: str, n_arms: int, server: str = "waitress", threads: int = 8, workers: int = 1,
                 trace: bool = False) -> None:
        self.port = _pgcluster.free_port()
        self.trace = trace
        config = {"url": url, "n_arms": n_arms, "server": server, "threads": threads, "workers": workers,
                  "port": self.port, "trace": trace}
        self.log = tempfile.NamedTemporaryFile(prefix="pasto-bench-server-", suffix=".log", delete=False)
        environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.process = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "_server", json.dumps(config)],
                                        stdout=self.log, stderr=subprocess.STDOUT, env=environment, cwd=ROOT)
        self._wait_ready(workers)

    def _wait_ready(self, workers: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        ready = 0
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"The benchmark server exited: {Path(self.log.name).read_text()[-3000:]}")
            try:
                if self.get("/bare/ping") == "ok":
                    ready += 1
                    if ready >= 2 * workers:  # several answers: most workers have loaded the app
                        return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("The benchmark server did not answer within a minute.")

    def get(self, path: str) -> str:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            connection.request("GET", path)
            return connection.getresponse().read().decode()
        finally:
            connection.close()

    def post(self, path: str, body: dict, token: str) -> tuple[int, Any]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            connection.request("POST", path, json.dumps(body).encode(),
                               {"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
            response = connection.getresponse()
            return response.status, json.loads(response.read() or b"null")
        finally:
            connection.close()

    def statements(self) -> dict[str, int] | None:
        """SQL statements the server has run so far, by first keyword (SQLite with ``trace`` only)."""
        return json.loads(self.get("/bare/statements")) if self.trace else None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        os.unlink(self.log.name)


# ---------------------------------------------------------------------------------- databases
def prepare_database(url: str, experiments: list[tuple[str, int, str]]):
    """Migrate ``url``, create the experiments ``(name, K, preset)`` through the API, return
    (app, ingest token)."""
    import migrations
    from service import create_app
    from service.auth import create_token
    from service.db import get_db

    migrations.upgrade(url)
    app = create_app({"PASTO_DATABASE_URL": url, "PASTO_ADMIN_TOKEN": ADMIN_TOKEN})
    client = app.test_client()
    for name, n_arms, preset in experiments:
        response = client.post("/api/v1/experiments", json=experiment_body(name, n_arms, preset),
                               headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        if response.status_code != 201:
            raise RuntimeError(f"Creating experiment {name!r} failed: {response.status_code} {response.get_data(True)}")
    with get_db(app).write() as session:
        token = create_token(session, "ingest", "bench-serve")
    return app, token


class Backend:
    """One database for the run: a SQLite file in a temporary folder, or a fresh PostgreSQL database."""

    def __init__(self, name: str, workdir: Path, postgres_server: str | None = None) -> None:
        self.name = name
        self._admin = None
        if name == "sqlite":
            self.server_url = None
            self.url_base = f"sqlite:///{workdir}/"
        else:
            self.server_url = postgres_server
        self.workdir = workdir

    def new_database(self, label: str) -> str:
        if self.name == "sqlite":
            return f"sqlite:///{self.workdir / (label + '.sqlite')}"
        import sqlalchemy as sa

        if self._admin is None:
            self._admin = sa.create_engine(self.server_url, isolation_level="AUTOCOMMIT")
        database = f"pasto_bench_{label}_{uuid.uuid4().hex[:8]}"
        with self._admin.connect() as connection:
            connection.execute(sa.text(f'CREATE DATABASE "{database}"'))
        return f"{self.server_url.rpartition('/')[0]}/{database}"

    def close(self) -> None:
        if self._admin is not None:
            self._admin.dispose()


# ---------------------------------------------------------------------------------- measurements
def _best(passes: list[dict[str, Any]]) -> dict[str, Any]:
    best = max(passes, key=lambda p: p["rate"])
    return {**best, "passes": len(passes), "errors": sum(p["errors"] for p in passes),
            "rates": [p["rate"] for p in passes]}


def paired_ratio(ours: dict[str, Any], baseline: dict[str, Any]) -> float:
    """Median over repeats of pasto's rate / the baseline's rate in the same repeat: the two passes of
    a repeat run back to back, so they share the machine's load far more than two best passes do."""
    return statistics.median(a / b for a, b in zip(ours["rates"], baseline["rates"]))


def measure_assign(server: Server, loadgen: LoadGenerator, token: str, args, kind: str) -> dict[str, dict]:
    """Bare vs pasto assignment, alternating A/B then B/A, best pass of each."""
    status = 200
    paths = {"bare": "/bare/assign", "pasto": f"/api/v1/experiments/{EXPERIMENT}/assign"}
    passes: dict[str, list] = {"bare": [], "pasto": []}
    count = args.requests if kind == "assign" else max(1, args.requests // 5)

    def tasks(side: str, tag: str, n: int, seconds: float) -> list[dict]:
        return [{"kind": kind, "count": n, "tag": f"{tag}c{c}", "batch_size": args.batch_size, "port": server.port,
                 "path": paths[side], "token": token, "seconds": seconds, "status": status}
                for c in range(args.clients)]

    for side in ("bare", "pasto"):  # warm-up: connections, caches, code paths
        loadgen.run(tasks(side, f"warm-{kind}-{side}", max(5, count // 20), args.seconds / 5))
    statements_before = server.statements()
    for repeat in range(args.repeats):
        order = ("bare", "pasto") if repeat % 2 == 0 else ("pasto", "bare")
        for side in order:
            passes[side].append(loadgen.run(tasks(side, f"{kind}-{side}-{repeat}", count, args.seconds)))
    result = {side: _best(side_passes) for side, side_passes in passes.items()}
    statements_after = server.statements()
    if statements_before is not None and statements_after is not None:
        delta = {key: statements_after.get(key, 0) - statements_before.get(key, 0) for key in statements_after}
        requests = sum(p["count"] for p in passes["pasto"]) + sum(p["count"] for p in passes["bare"])
        result["statements"] = {"requests": requests, **{k: v for k, v in delta.items() if v}}
    return result


def raw_insert_sql(paramstyle: str) -> str:
    placeholder = "%s" if paramstyle in ("format", "pyformat") else "?"
    columns = ["client_id", "experiment_id", "unit", "round_index"] + [f"v{m}" for m in range(len(METRICS))]
    return f"INSERT INTO {RAW_TABLE} ({', '.join(columns)}) VALUES ({', '.join([placeholder] * len(columns))})"


def raw_rows(observations: list[dict], experiment_id: int) -> list[tuple]:
    """One plain row per observation: id, experiment, unit, round and its five values."""
    return [(o["id"], experiment_id, o["unit"], o["round"], *(o["values"].get(m) for m in METRICS))
            for o in observations]


def raw_insert_pass(url: str, batches: list[list[dict]], experiment_id: int) -> dict[str, Any]:
    """Insert each batch's rows with one executemany in one transaction; observations/s."""
    from service.db import make_engine

    engine = make_engine(url)
    sql = raw_insert_sql(engine.dialect.paramstyle)
    rows = [raw_rows(batch, experiment_id) for batch in batches]
    writer = engine.execution_options(pasto_write=True)  # BEGIN IMMEDIATE on SQLite, like ingestion
    with writer.begin() as connection:  # connect outside the timing (the server's pool is warm too)
        connection.exec_driver_sql(f"SELECT COUNT(*) FROM {RAW_TABLE}")
    latencies = []
    for batch_rows in rows:
        started = time.perf_counter()
        with writer.begin() as connection:
            connection.exec_driver_sql(sql, batch_rows)
        latencies.append(time.perf_counter() - started)
    engine.dispose()
    total = sum(latencies)
    observations = sum(len(batch) for batch in rows)
    return {"count": len(rows), "errors": 0, "seconds": total, "rate": observations / total,
            **_percentiles(np.asarray(latencies))}


def create_raw_table(url: str) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    values = ", ".join(f"v{m} DOUBLE PRECISION" for m in range(len(METRICS)))
    with engine.begin() as connection:
        connection.exec_driver_sql(
            f"CREATE TABLE {RAW_TABLE} (client_id VARCHAR(256) PRIMARY KEY, experiment_id INTEGER NOT NULL, "
            f"unit VARCHAR(256) NOT NULL, round_index INTEGER NOT NULL, {values})")
    engine.dispose()


def measure_ingest(server: Server, loadgen: LoadGenerator, url: str, token: str, experiment_id: int,
                   args) -> dict[str, dict]:
    """HTTP batches of ``args.observations`` vs raw executemany INSERT of the same rows, alternating."""
    size = args.observations
    path = f"/api/v1/experiments/{EXPERIMENT}/observations"
    passes: dict[str, list] = {"raw INSERT": [], "bare": [], "pasto": []}

    def http_pass(tag: str, n: int, target: str) -> dict:
        result = loadgen.run([{"kind": "ingest", "count": n, "tag": tag, "batch_size": size, "round": 0,
                               "port": server.port, "path": path if target == "pasto" else "/bare/observations",
                               "token": token, "seconds": args.seconds * 2, "status": 202}])
        return {**result, "rate": result["rate"] * size}

    warm = http_pass("warm-pasto", 2, "pasto")
    http_pass("warm-bare", 2, "bare")
    raw_insert_pass(url, [observation_batch("warm-raw", i, size, 0) for i in range(2)], experiment_id)
    for repeat in range(args.repeats):
        order = ("raw INSERT", "bare", "pasto") if repeat % 2 == 0 else ("pasto", "bare", "raw INSERT")
        for side in order:
            tag = f"ingest-{side.split()[0]}-{repeat}"
            if side == "raw INSERT":
                batches = [observation_batch(tag, i, size, 0) for i in range(args.batches)]
                passes[side].append(raw_insert_pass(url, batches, experiment_id))
            else:
                passes[side].append(http_pass(tag, args.batches, side))
    result = {side: _best(side_passes) for side, side_passes in passes.items()}
    answered = [warm] + passes["pasto"]
    result["pasto"]["sent"] = sum(p["count"] - p["errors"] for p in answered) * size
    return result


def _count_observations(url: str, experiment_id: int) -> int:
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    with engine.connect() as connection:
        total = connection.execute(sa.text("SELECT COUNT(*) FROM observation_ids WHERE experiment_id = :e"),
                                   {"e": experiment_id}).scalar_one()
    engine.dispose()
    return int(total)


def synthetic_statistics(rng: np.random.Generator, means: np.ndarray, per_cell: int):
    from pasto.estimators import Statistics

    counts = rng.poisson(per_cell, means.shape).astype(float)
    noise = rng.normal(0.0, 1.0, means.shape)
    sums = means * counts + noise * np.sqrt(counts)
    sums_of_squares = sums**2 / np.maximum(counts, 1.0) + counts
    return Statistics(counts=counts, sums=sums, sums_of_squares=sums_of_squares)


def _is_solve_round(preset: str, round_number: int) -> bool:
    from pasto.algorithm import AlgorithmConfig

    config = AlgorithmConfig.from_preset(preset)
    if config.safe:
        return False  # safe serving has no solve rounds: every round solves exactly
    rule = config.exploration
    return bool(rule.solve_every and round_number % rule.solve_every == 0 and rule.solve_steps > 0)


def measure_update_alone(n_arms: int, preset: str, rounds: int, seed: int = 0,
                         overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Milliseconds per ``pasto.algorithm.update`` call, rounds 1..``rounds`` on synthetic data
    (``overrides``: options of the preset, e.g. ``{"serving_posterior_draws": 0}``)."""
    from pasto.algorithm import AlgorithmConfig, initial_state, round_generator, update
    from pasto.estimators import Statistics
    from pasto.objectives import Objective

    rng = np.random.default_rng(seed)
    config = AlgorithmConfig.from_preset(preset, **(overrides or {}))
    objective = Objective.from_spec(list(METRICS), OBJECTIVE)
    warm = initial_state(config, 3, len(METRICS), objective=objective)  # first calls import and set up
    warm_statistics = synthetic_statistics(np.random.default_rng(1), np.zeros((len(METRICS), 3)), 3)
    update(config, objective, warm, warm_statistics, warm_statistics, rng=round_generator(seed, 0))
    state = initial_state(config, n_arms, len(METRICS), objective=objective)
    means = rng.uniform(-1.0, 1.0, (len(METRICS), n_arms))
    pooled = Statistics.zeros(len(METRICS), n_arms)
    times = {}
    for t in range(1, rounds + 1):
        round_statistics = synthetic_statistics(rng, means, 3)
        pooled = pooled + round_statistics
        started = time.perf_counter()
        state = update(config, objective, state, round_statistics, pooled, rng=round_generator(seed, t))
        times[t] = (time.perf_counter() - started) * 1000
    return _split_rounds(times, preset)


def measure_update_against_bare(n_arms: int, rounds: int, seed: int = 0) -> dict[str, float]:
    """Median milliseconds over rounds 1..``rounds`` of the default ``update`` and, on the same
    statistics in the same round, its bare baselines: one Thompson-sampling step (one posterior draw
    per arm and metric, the arm that scores best: ``baselines.thompson_update`` with ``draws=1``;
    also the benchmarks' Thompson with 16 draws) and one exact solve of the plug-in means
    (``optimum.solve``). The order of the four is rotated every round."""
    from pasto.algorithm import AlgorithmConfig, initial_state, round_generator, update
    from pasto.baselines import ThompsonConfig, thompson_initial_state, thompson_update
    from pasto.estimators import Statistics
    from pasto.objectives import Objective
    from pasto.optimum import solve

    rng = np.random.default_rng(seed)
    config = AlgorithmConfig.from_preset("default")
    objective = Objective.from_spec(list(METRICS), OBJECTIVE)
    thompson_one, thompson_many = ThompsonConfig(draws=1), ThompsonConfig()
    warm = initial_state(config, 3, len(METRICS), objective=objective)  # first calls import and set up
    warm_statistics = synthetic_statistics(np.random.default_rng(1), np.zeros((len(METRICS), 3)), 3)
    update(config, objective, warm, warm_statistics, warm_statistics, rng=round_generator(seed, 0))
    thompson_update(thompson_one, objective, thompson_initial_state(thompson_one, 3, len(METRICS)),
                    warm_statistics, warm_statistics, rng=np.random.default_rng(0))
    solve(objective, warm_statistics.sums / np.maximum(warm_statistics.counts, 1.0))
    state = initial_state(config, n_arms, len(METRICS), objective=objective)
    thompson_state = thompson_initial_state(thompson_one, n_arms, len(METRICS))
    means = rng.uniform(-1.0, 1.0, (len(METRICS), n_arms))
    pooled = Statistics.zeros(len(METRICS), n_arms)
    times: dict[str, list[float]] = {"update": [], "thompson_1": [], "thompson_16": [], "solve": []}
    for t in range(1, rounds + 1):
        round_statistics = synthetic_statistics(rng, means, 3)
        pooled = pooled + round_statistics
        plug_in = pooled.sums / np.maximum(pooled.counts, 1.0)
        steps = {
            "update": lambda: update(config, objective, state, round_statistics, pooled,
                                     rng=round_generator(seed, t)),
            "thompson_1": lambda: thompson_update(thompson_one, objective, thompson_state, round_statistics,
                                                  pooled, rng=np.random.default_rng([seed, t])),
            "thompson_16": lambda: thompson_update(thompson_many, objective, thompson_state, round_statistics,
                                                   pooled, rng=np.random.default_rng([seed, t])),
            "solve": lambda: solve(objective, plug_in),
        }
        names = list(steps)
        names = names[t % len(names):] + names[:t % len(names)]
        for name in names:
            started = time.perf_counter()
            result = steps[name]()
            times[name].append((time.perf_counter() - started) * 1000)
            if name == "update":
                state = result
    return {name: statistics.median(values) for name, values in times.items()}


def _split_rounds(times: dict[int, float], preset: str) -> dict[str, Any]:
    plain = [ms for t, ms in times.items() if not _is_solve_round(preset, t)]
    solve = [ms for t, ms in times.items() if _is_solve_round(preset, t)]
    return {"median_ms": statistics.median(plain) if plain else None,
            "max_ms": max(plain) if plain else None,
            "solve_ms": max(solve) if solve else None,
            "rounds": len(times)}


def close_experiment(n_arms: int, preset: str) -> str:
    return f"close-{preset}-{n_arms}"


def measure_round_close(app, n_arms: int, preset: str, rounds: int, seed: int = 0) -> dict[str, Any]:
    """``close_round`` on a database holding the experiment's statistics: the close transaction
    (lock, statistics query, update, state write, next round), the whole call (plus the per-round
    summary written after the lock), and a worker's reload of the cached experiment afterwards."""
    import sqlalchemy as sa

    from service.bootstrap import get_uow
    from service.controller.rounds import close_round
    from service.db import get_db
    from service.models import Experiment, RoundStatistic

    name = close_experiment(n_arms, preset)
    database = get_db(app)
    with database.read() as session:
        experiment_id = session.execute(sa.select(Experiment.id).where(Experiment.name == name)).scalar_one()
    rng = np.random.default_rng(seed)
    means = rng.uniform(-1.0, 1.0, (len(METRICS), n_arms))
    table = RoundStatistic.__table__
    transaction, total, reload = {}, {}, {}
    cache = get_uow(app).cache
    for round_index in range(rounds):
        statistics_ = synthetic_statistics(rng, means, 3)
        rows = [
            {"experiment_id": experiment_id, "round_index": round_index, "segment_index": 0, "arm_index": k,
             "metric_index": m, "count": int(statistics_.counts[m, k]), "sum": float(statistics_.sums[m, k]),
             "sum_of_squares": float(statistics_.sums_of_squares[m, k])}
            for m in range(len(METRICS)) for k in range(n_arms) if statistics_.counts[m, k] > 0
        ]
        with database.write() as session:
            session.execute(sa.insert(table), rows)
        started = time.perf_counter()
        advance = close_round(get_uow(app), experiment_id, round_index)
        total[round_index + 1] = (time.perf_counter() - started) * 1000
        if advance is None or advance.applied != (round_index,):
            raise RuntimeError(f"Closing round {round_index} of {name!r} did not apply its update: {advance}.")
        transaction[round_index + 1] = advance.duration_seconds * 1000
        started = time.perf_counter()
        snapshot = cache.get(name, fresh=True)
        reload[round_index + 1] = (time.perf_counter() - started) * 1000
        if snapshot.round_index != round_index + 1:
            raise RuntimeError("The cached experiment did not move to the new round.")
    return {"transaction": _split_rounds(transaction, preset), "total": _split_rounds(total, preset),
            "reload_ms": statistics.median(reload.values()), "transaction_by_round": list(transaction.values())}


# ---------------------------------------------------------------------------------- segmented close
SEGMENTED_OBJECTIVE = {
    "primary": {"watch_time": 1.0, "likes": 0.5},
    "guardrails": [
        {"metric": "skips", "threshold": -0.2, "hard": True, "scope": "global"},
        {"metric": "latency", "threshold": -0.5, "hard": True, "scope": "segment"},
    ],
}


def segmented_experiment_body(name: str, n_arms: int, n_segments: int) -> dict[str, Any]:
    body = experiment_body(name, n_arms)
    shares = np.arange(1, n_segments + 1, dtype=float) ** -1.0  # Zipf shares: very unequal segments
    body.update(objective=SEGMENTED_OBJECTIVE, segments={
        "names": [f"segment-{s}" for s in range(n_segments)], "shares": (shares / shares.sum()).tolist()})
    return body


def measure_segmented_close(url: str, n_arms: int, n_segments: int, rounds: int, seed: int = 0) -> dict[str, Any]:
    """``close_round`` of a segmented experiment (statistics in every (segment, metric, arm) cell each
    round: S x M x K rows) beside the unsegmented close of the same K and preset, rounds interleaved."""
    import sqlalchemy as sa

    import migrations
    from service import create_app
    from service.bootstrap import get_uow
    from service.controller.rounds import close_round
    from service.db import get_db
    from service.models import Experiment, RoundStatistic

    migrations.upgrade(url)
    app = create_app({"PASTO_DATABASE_URL": url, "PASTO_ADMIN_TOKEN": ADMIN_TOKEN})
    client = app.test_client()
    plain = experiment_body("close-plain", n_arms)
    # Exploration serving, as every segmented experiment runs: the synthetic rounds observe every arm.
    plain["algorithm"] = {"preset": "default", "serving": "exploration"}
    plain["objective"] = {**SEGMENTED_OBJECTIVE, "guardrails": [
        {key: value for key, value in guardrail.items() if key != "scope"} for guardrail in SEGMENTED_OBJECTIVE["guardrails"]]}
    bodies = {"plain": plain,
              "segmented": segmented_experiment_body("close-segmented", n_arms, n_segments)}
    for body in bodies.values():
        response = client.post("/api/v1/experiments", json=body, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        if response.status_code != 201:
            raise RuntimeError(f"Creating {body['name']!r} failed: {response.status_code} {response.get_data(True)}")
    database = get_db(app)
    with database.read() as session:
        ids = {kind: session.execute(sa.select(Experiment.id).where(Experiment.name == body["name"])).scalar_one()
               for kind, body in bodies.items()}
    rng = np.random.default_rng(seed)
    means = rng.uniform(-1.0, 1.0, (n_segments, len(METRICS), n_arms))
    times: dict[str, dict[str, dict[int, float]]] = {kind: {"transaction": {}, "total": {}} for kind in bodies}
    for round_index in range(rounds):
        per_segment = synthetic_statistics(rng, means, 3)  # (S, M, K)
        pooled = [per_segment.counts.sum(0), per_segment.sums.sum(0), per_segment.sums_of_squares.sum(0)]
        for kind, experiment_id in ids.items():
            if kind == "plain":  # the same observations in its one segment
                rows = [
                    {"experiment_id": experiment_id, "round_index": round_index, "segment_index": 0, "arm_index": k,
                     "metric_index": m, "count": int(pooled[0][m, k]), "sum": float(pooled[1][m, k]),
                     "sum_of_squares": float(pooled[2][m, k])}
                    for m in range(len(METRICS)) for k in range(n_arms) if pooled[0][m, k] > 0
                ]
            else:
                rows = [
                    {"experiment_id": experiment_id, "round_index": round_index, "segment_index": s,
                     "arm_index": k, "metric_index": m, "count": int(per_segment.counts[s, m, k]),
                     "sum": float(per_segment.sums[s, m, k]),
                     "sum_of_squares": float(per_segment.sums_of_squares[s, m, k])}
                    for s in range(n_segments) for m in range(len(METRICS)) for k in range(n_arms)
                    if per_segment.counts[s, m, k] > 0
                ]
            with database.write() as session:
                session.execute(sa.insert(RoundStatistic.__table__), rows)
            started = time.perf_counter()
            advance = close_round(get_uow(app), experiment_id, round_index)
            times[kind]["total"][round_index + 1] = (time.perf_counter() - started) * 1000
            if advance is None or advance.applied != (round_index,):
                raise RuntimeError(f"Closing round {round_index} of {kind} did not apply its update: {advance}.")
            times[kind]["transaction"][round_index + 1] = advance.duration_seconds * 1000
    database.engine.dispose()
    return {kind: {part: {"median_ms": statistics.median(values.values()), "max_ms": max(values.values())}
                   for part, values in parts.items()} for kind, parts in times.items()}


def render_segmented(results: dict[str, Any], command: str, args, seconds: float) -> str:
    lines = [
        "## Segmented round close",
        "",
        f"The round close of a segmented experiment (docs/segments.md): K = {args.arms} arms, S = {args.segments} "
        f"segments with Zipf traffic shares, M = {len(METRICS)} metrics, two hard guardrails (one global, one per "
        f"segment; the unsegmented experiment has the same two), the `default` preset (the joint LP over the K x S mixture entries runs in round 1 and every "
        f"`solve_every` rounds), statistics in every (segment, metric, arm) cell each round; beside the unsegmented "
        f"close of the same K in the same run (rounds interleaved). {args.update_rounds} rounds each; the close "
        "transaction holds the experiment's row lock, the whole call adds the round's summary written after it "
        "(for a segmented experiment: the per-segment report, the global mixture and the gain). Measured with:",
        "",
        "```",
        command,
        "```",
        "",
        "| backend | unsegmented transaction (median / max ms) | segmented transaction (median / max ms) "
        "| segmented whole call (median / max ms) | ratio of transaction medians |",
        "|---|---|---|---|---|",
    ]
    for backend, result in results.items():
        plain, segmented = result["plain"], result["segmented"]
        lines.append(
            f"| {backend} | {plain['transaction']['median_ms']:.0f} / {plain['transaction']['max_ms']:.0f} "
            f"| {segmented['transaction']['median_ms']:.0f} / {segmented['transaction']['max_ms']:.0f} "
            f"| {segmented['total']['median_ms']:.0f} / {segmented['total']['max_ms']:.0f} "
            f"| {segmented['transaction']['median_ms'] / plain['transaction']['median_ms']:.1f} |")
    lines += ["", f"Target: under 1 s on PostgreSQL. Load average before the run "
                  f"{args.load_before:.1f}; {seconds:.0f} s in all. {args.postgres_note or ''}".rstrip(), ""]
    return "\n".join(lines)


def run_segmented_close(args, docs: Path) -> dict[str, Any]:
    started = time.monotonic()
    results: dict[str, Any] = {}
    cluster = None
    try:
        with tempfile.TemporaryDirectory(prefix="pasto-bench-segments-") as workdir:
            for name in [b.strip() for b in args.backends.split(",") if b.strip()]:
                if name == "postgres":
                    server_url, cluster = _postgres_server(args)
                    if server_url is None:
                        print("No PostgreSQL server; skipping it.", file=sys.stderr)
                        continue
                    backend = Backend("postgres", Path(workdir), server_url)
                    args.postgres_note = (f"PostgreSQL: a private loopback cluster ({_server_version(server_url)}, "
                                          "fsync=off)." if cluster is not None else
                                          f"PostgreSQL: {_server_version(server_url)}.")
                else:
                    backend = Backend("sqlite", Path(workdir))
                label = "SQLite" if name == "sqlite" else "PostgreSQL"
                print(f"[{name}] segmented round close, K = {args.arms}, S = {args.segments} ...", flush=True)
                try:
                    results[label] = measure_segmented_close(backend.new_database("segments"), args.arms,
                                                             args.segments, args.update_rounds)
                finally:
                    backend.close()
    finally:
        if cluster is not None:
            cluster.stop()
    command = "python bench/serve.py " + " ".join(args.argv)
    section = render_segmented(results, command.strip(), args, time.monotonic() - started)
    print(section)
    if args.write_docs:
        _client_bench.write_section(section, docs)
        print(f"Wrote the Segmented round close section of {docs}.")
    return {"results": results, "section": section}


# ---------------------------------------------------------------------------------- one backend
def run_backend(backend: Backend, loadgen: LoadGenerator, args) -> dict[str, Any]:
    url = backend.new_database("serving")
    app, token = prepare_database(url, [(EXPERIMENT, args.arms, "default")])
    from service.bootstrap import get_uow
    from service.db import get_db

    experiment_id = get_uow(app).cache.get(EXPERIMENT).id
    get_db(app).engine.dispose()
    create_raw_table(url)
    results: dict[str, Any] = {}
    server = Server(url, args.arms, threads=args.threads, trace=backend.name == "sqlite")
    try:
        status, answer = server.post(f"/api/v1/experiments/{EXPERIMENT}/assign", {"unit": "probe"}, token)
        if status != 200 or answer.get("round") != 0:
            raise RuntimeError(f"The assign endpoint answered {status} {answer}.")
        print(f"[{backend.name}] assign, single unit ...", flush=True)
        results["assign"] = measure_assign(server, loadgen, token, args, "assign")
        print(f"[{backend.name}] assign, batches of {args.batch_size} ...", flush=True)
        results["assign_batch"] = measure_assign(server, loadgen, token, args, "assign_batch")
        print(f"[{backend.name}] ingestion, batches of {args.observations} ...", flush=True)
        results["ingest"] = measure_ingest(server, loadgen, url, token, experiment_id, args)
    finally:
        server.stop()
    expected = results["ingest"]["pasto"]["sent"]
    stored = _count_observations(url, experiment_id)
    if stored != expected:
        raise RuntimeError(f"{stored} observations stored, {expected} accepted: ingestion lost or duplicated some.")
    results["ingest"]["pasto"]["stored"] = stored
    cases = [(n_arms, preset) for n_arms in args.update_arms for preset in ("default", "paper")]
    app, _ = prepare_database(backend.new_database("close"),
                              [(close_experiment(*case), *case) for case in [(10, "default")] + cases])
    measure_round_close(app, 10, "default", 5)  # warm-up: imports, first SLSQP call, connection pool
    results["close"] = {}
    for n_arms, preset in cases:
        print(f"[{backend.name}] round close, K = {n_arms}, {preset} ...", flush=True)
        results["close"][f"{n_arms}/{preset}"] = measure_round_close(app, n_arms, preset, args.update_rounds)
    get_db(app).engine.dispose()
    return results


def run_gunicorn(backend: Backend, loadgen: LoadGenerator, args) -> dict[str, Any]:
    url = backend.new_database("gunicorn")
    app, token = prepare_database(url, [(EXPERIMENT, args.arms, "default")])
    from service.db import get_db

    get_db(app).engine.dispose()
    results = {}
    for workers in args.gunicorn:
        print(f"[{backend.name}] gunicorn -w {workers}: assign, single unit ...", flush=True)
        server = Server(url, args.arms, server="gunicorn", threads=args.gunicorn_threads, workers=workers)
        try:
            results[workers] = measure_assign(server, loadgen, token, args, "assign")
        finally:
            server.stop()
    return results


# ---------------------------------------------------------------------------------- report
def _rate(value: float) -> str:
    return f"{value:,.0f}"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else (f"{value:.2f}" if value < 10 else f"{value:.1f}")


def render(all_results: dict[str, Any], update_alone: dict[str, Any], command: str, args,
           elapsed: float) -> str:
    lines = [
        "## Serving",
        "",
        "HTTP serving throughput and latency, each figure paired with its baseline in the same run, and the "
        "cost of a round update. Measured with:",
        "",
        "```",
        command,
        "```",
        "",
        f"Machine: {platform.machine()}, {_client_bench._cpu_name()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {elapsed:.0f} s of wall "
        f"time; load average {args.load_before:.1f} before and {os.getloadavg()[0]:.1f} after the run (other "
        "work shares the machine: absolute figures move with it, the paired ratios much less).",
        "",
        f"Setup: waitress, one process, {args.threads} threads (as `pasto serve`); {args.clients} load-generator "
        f"processes on the same machine, each a closed loop of requests on one keep-alive connection; every pass is "
        f"capped at {args.requests:,} requests per client (a fifth of that for batches) and {args.seconds:g} s; "
        f"bare and pasto passes alternate (A/B, B/A, ...); rates and latencies are each side's best of {args.repeats} "
        "passes, and a ratio is the median over the repeats of the two sides' rates in the same repeat (passes run "
        "back to back, so they share the machine's load). The experiment "
        f"has K = {args.arms} arms and M = {len(METRICS)} metrics; the token is a stored `ingest` token (cached by the "
        "service). Latencies are client-side, from sending the request to reading the whole response, in the best "
        "pass.",
        "",
        "SQLite runs with the service's settings (WAL, synchronous=NORMAL). "
        + (args.postgres_note or "") + " Each pair runs on the same database, so the ratios are like for like.",
        "",
    ]
    targets = []
    for backend, results in all_results.items():
        lines += [f"### {backend}", "",
                  "| measurement | baseline | baseline rate | pasto rate | pasto / baseline (paired) | baseline p50 / p99 ms "
                  "| pasto p50 / p99 ms |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for key, label, unit in (("assign", "assign, 1 unit", "req/s"),
                                 ("assign_batch", f"assign, {args.batch_size} units", "req/s")):
            r = results[key]
            ratio = paired_ratio(r["pasto"], r["bare"])
            lines.append(f"| {label} | bare Flask endpoint | {_rate(r['bare']['rate'])} {unit} | "
                         f"{_rate(r['pasto']['rate'])} {unit} | {ratio:.2f} | {_ms(r['bare']['p50_ms'])} / "
                         f"{_ms(r['bare']['p99_ms'])} | {_ms(r['pasto']['p50_ms'])} / {_ms(r['pasto']['p99_ms'])} |")
            if key == "assign":
                targets.append((f"{backend}: assign >= 70% of the bare endpoint", f"{ratio:.2f}", ratio >= 0.7))
        r = results["ingest"]
        for side, label in (("raw INSERT", "raw executemany INSERT (no HTTP)"),
                            ("bare", "bare endpoint: HTTP + JSON + the same INSERT")):
            ratio = paired_ratio(r["pasto"], r[side])
            lines.append(f"| ingest, batches of {args.observations:,} | {label} | "
                         f"{_rate(r[side]['rate'])} obs/s | {_rate(r['pasto']['rate'])} obs/s | {ratio:.2f} | "
                         f"{_ms(r[side]['p50_ms'])} / {_ms(r[side]['p99_ms'])} | "
                         f"{_ms(r['pasto']['p50_ms'])} / {_ms(r['pasto']['p99_ms'])} |")
        ratio = paired_ratio(r["pasto"], r["raw INSERT"])
        targets.append((f"{backend}: ingestion >= 50% of the raw INSERT", f"{ratio:.2f}", ratio >= 0.5))
        batch = results["assign_batch"]["pasto"]
        errors = sum(results[k][side]["errors"] for k in ("assign", "assign_batch") for side in ("bare", "pasto"))
        errors += sum(results["ingest"][side]["errors"] for side in ("raw INSERT", "bare", "pasto"))
        lines += ["", f"Batch assignment: {_rate(batch['rate'] * args.batch_size)} units/s. Non-2xx answers in all "
                      f"passes: {errors}. Observations stored after the passes: {results['ingest']['pasto']['stored']:,} "
                      "(every one sent, once)."]
        statements = dict(results["assign"].get("statements") or {})
        if statements:
            requests = statements.pop("requests")
            writes = sum(v for k, v in statements.items() if k in WRITE_STATEMENTS)
            shown = ", ".join(f"{v:,} {k}" for k, v in sorted(statements.items())) or "none"
            lines += ["", f"SQL statements the server ran during the single-unit assign passes ({requests:,} requests, "
                          f"bare and pasto): {shown}; {writes} writes (INSERT, UPDATE, DELETE, BEGIN IMMEDIATE, ...). "
                          "The SELECTs are the per-process version checks (at most one per experiment every "
                          "`PASTO_VERSION_CHECK_SECONDS` = 0.05 s) and the token lookups (at most one per token every "
                          "10 s, in a read-only deferred transaction: the BEGIN / ROLLBACK pairs)."]
            targets.append((f"{backend}: no database write on the assignment path", f"{writes} writes", writes == 0))
        if "gunicorn" in results:
            lines += ["", f"gunicorn (gthread workers, {args.gunicorn_threads} threads each), assign 1 unit, same "
                          "clients:", "",
                      "| workers | bare req/s | pasto req/s | pasto / bare (paired) | pasto p50 / p99 ms |", "|---:|---:|---:|---:|---:|"]
            for workers, g in results["gunicorn"].items():
                lines.append(f"| {workers} | {_rate(g['bare']['rate'])} | {_rate(g['pasto']['rate'])} | "
                             f"{paired_ratio(g['pasto'], g['bare']):.2f} | {_ms(g['pasto']['p50_ms'])} / "
                             f"{_ms(g['pasto']['p99_ms'])} |")
        lines.append("")
    lines += [
        f"### Round update vs K (M = {len(METRICS)})",
        "",
        f"Milliseconds. `update` alone: `pasto.algorithm.update` on synthetic statistics, rounds 1..{args.update_rounds}; "
        "close: `service.controller.rounds.close_round` on a database holding the experiment's per-round statistics "
        "(transaction = lock, statistics query, update, state and next round written; whole call = the "
        "transaction plus the per-round summary computed and written after the lock is released); reload = one "
        "worker's refresh of its cached experiment after the version bump. `default` re-solves every 5th round "
        "(column \"solve round\"); other rounds are the median (max in brackets).",
        "",
    ]
    backends = list(all_results)
    header = "| K | preset | update alone | update alone, solve round |"
    rule = "|---:|---|---:|---:|"
    for backend in backends:
        header += f" {backend} close transaction | {backend} close, solve round | {backend} whole call (worst) | {backend} reload |"
        rule += "---:|---:|---:|---:|"
    lines += [header, rule]
    slowest = 0.0
    for n_arms in args.update_arms:
        for preset in ("default", "paper"):
            alone = update_alone[f"{n_arms}/{preset}"]
            row = f"| {n_arms:,} | {preset} | {_ms(alone['median_ms'])} ({_ms(alone['max_ms'])}) | {_ms(alone['solve_ms'])} |"
            slowest = max(slowest, alone["max_ms"] or 0.0, alone["solve_ms"] or 0.0)
            for backend in backends:
                close = all_results[backend]["close"][f"{n_arms}/{preset}"]
                tx, whole = close["transaction"], close["total"]
                whole_worst = max(whole["max_ms"] or 0.0, whole["solve_ms"] or 0.0)
                row += (f" {_ms(tx['median_ms'])} ({_ms(tx['max_ms'])}) | {_ms(tx['solve_ms'])} | "
                        f"{_ms(whole['median_ms'])} ({_ms(whole_worst)}) | {_ms(close['reload_ms'])} |")
            lines.append(row)
    largest = max(args.update_arms)
    lines += ["", f"Close transaction by round at K = {largest:,} (`default`, rounds 1..{args.update_rounds}; a close adds "
                  "its round's K x M statistics rows into running totals, so it should not grow with the rounds):"]
    for backend in backends:
        series = all_results[backend]["close"][f"{largest}/default"]["transaction_by_round"]
        lines.append(f"{backend} {', '.join(_ms(ms) for ms in series)} ms.")
    worst = max(max(update_alone[f"{largest}/{p}"]["max_ms"] or 0.0, update_alone[f"{largest}/{p}"]["solve_ms"] or 0.0)
                for p in ("default", "paper"))
    targets.append((f"one update at K = {largest:,}, M = 5 under 100 ms (worst round, either preset)",
                    f"{worst:.1f} ms", worst < 100))
    lines += ["", "### Targets (benchmark figures, not tests)", "", "| target | measured | met |",
              "|---|---:|:---:|"]
    lines += [f"| {target} | {value} | {'yes' if ok else '**no**'} |" for target, value, ok in targets]
    lines += ["", "### Reading", "", *READING, ""]
    return "\n".join(lines)


READING = [
    "- **Assignment.** On top of what the bare endpoint does (parse the body, build the same JSON answer), "
    "pasto checks the bearer token (SHA-256, role cached for 10 s), validates the body (pydantic, strict), takes "
    "the experiment from the per-process cache (a one-row version read at most every 0.05 s), hashes the unit "
    "(FNV-1a with the round's prefix hashed once) and bisects the cumulative mixture, and counts the request and "
    "the assignment for Prometheus. It writes nothing to the database: the statement counts above are the proof "
    "on SQLite, and the code path is the same on PostgreSQL. The batch ratio is lower because pasto then does "
    "work that grows with the batch (numpy hashing and validation of every unit, one counter per arm drawn) "
    "while the bare endpoint only copies the units into its answer. Each gunicorn worker holds its own cache "
    "and does its own version checks, so assignment scales with workers as far as the cores allow (here two "
    "cores shared with the load generator and other jobs).",
    "- **Ingestion.** The raw INSERT is the floor for storing 1,000 rows: no HTTP, no JSON, no validation, one "
    "table, one executemany. A pasto batch is one HTTP request of about 170 KB of JSON: validated straight from "
    "the bytes (pydantic's JSON parser), every observation's sticky arm recomputed from the hash, then one "
    "transaction inserts the 1,000 ids (exactly-once: a plain INSERT, and when an id exists the transaction "
    "runs again with `ON CONFLICT DO NOTHING RETURNING`), up to 1,000 "
    "first-seen units of the round, and adds to up to K x M statistics cells and K per-arm counts (about 2,600 "
    "rows at K = 100, in four statements). The bare-endpoint row separates the transport (HTTP and JSON, same "
    "INSERT) from pasto's own work. On SQLite the raw executemany is a C loop, about 2 ms per 1,000 rows: half "
    "its rate is 4 ms per batch, less than the bare endpoint needs with no validation and one table (the bare "
    "rate over the raw rate, about 0.3, is the ceiling for any HTTP endpoint here), so that target is out of reach for an endpoint that "
    "parses the body at all. On PostgreSQL the raw executemany sends one protocol message per row (pipelined, "
    "about 13 ms per 1,000 rows), which leaves room: pasto's two per-observation tables have no foreign keys "
    "and compare their text keys bytewise (migration 0003), statistics upserts touch no indexed column so they "
    "can be heap-only updates (late data goes to its own small table: migration 0004), each column goes "
    "to the server as the text of one array literal, and new ids skip the conflict check (about 2 ms of "
    "PostgreSQL's time per 1,000).",
    "- **Update.** `pasto.algorithm.update` alone stays well under 100 ms at K = 10,000, solve rounds "
    "included. A round close in the service costs more, and almost all of it is database work: it reads the "
    "round's K x M statistics rows and the late cells, adds them into the running totals (M rows of K-arrays "
    "since migration 0018, read and written whole), and parses and rewrites the controller state (about 1 MB of JSON at K = 10,000 with "
    "`default`, 3 MB with `paper`, whose IPS history is M x K twice). None of it grows with the number of "
    "rounds (see the by-round line). A close runs once per round, off the request path, and assignment keeps "
    "serving the cached mixture meanwhile; but it holds the experiment's lock (on SQLite the database's write "
    "lock), so ingestion of that experiment waits for it. The per-round summary (exact best mixture) runs "
    "after the lock is released. The reload is what each worker pays, once per new version, to pick up the "
    "new round.",
]


# ---------------------------------------------------------------------------------- main
def _backend(name: str, args, workdir) -> tuple[Backend | None, Any]:
    """The backend ``name`` ("sqlite" or "postgres") in ``workdir`` and the cluster started for it (to
    stop), or (None, None) when there is no PostgreSQL server to use."""
    if name == "sqlite":
        return Backend("sqlite", Path(workdir)), None
    server_url, cluster = _postgres_server(args)
    if server_url is None:
        print("No PostgreSQL server; skipping it.", file=sys.stderr)
        return None, None
    return Backend("postgres", Path(workdir), server_url), cluster


def _postgres_server(args):
    """(URL of a PostgreSQL server, cluster to stop or None), or (None, None) when there is none."""
    configured = os.environ.get("PASTO_BENCH_POSTGRES_URL")
    if configured:
        return configured, None
    bin_dir = _pgcluster.postgres_bin_dir()
    if bin_dir is None:
        return None, None
    cluster = _pgcluster.Cluster(bin_dir)
    try:
        cluster.start()
    except (subprocess.CalledProcessError, OSError) as error:
        print(f"Could not start a private PostgreSQL cluster ({error}); skipping PostgreSQL.", file=sys.stderr)
        return None, None
    return cluster.url, cluster


def _server_version(url: str) -> str:
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            return "PostgreSQL " + connection.execute(sa.text("SHOW server_version")).scalar_one().split()[0]
    finally:
        engine.dispose()


def _parse_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="sqlite,postgres",
                        help="comma-separated: sqlite, postgres (skipped when no server can be had)")
    parser.add_argument("--clients", type=int, default=2, help="load-generator processes")
    parser.add_argument("--threads", type=int, default=8, help="waitress threads (pasto serve's default)")
    parser.add_argument("--requests", type=int, default=20_000, help="request cap per client and pass")
    parser.add_argument("--seconds", type=float, default=2.0, help="time cap per pass")
    parser.add_argument("--repeats", type=int, default=5, help="passes per side; the best one counts")
    parser.add_argument("--arms", type=int, default=100, help="K of the served experiment")
    parser.add_argument("--batch-size", type=int, default=100, help="units per batch assignment")
    parser.add_argument("--observations", type=int, default=1000, help="observations per ingestion batch")
    parser.add_argument("--batches", type=int, default=20, help="ingestion batches per pass")
    parser.add_argument("--update-arms", type=_parse_list, default=[100, 1000, 10_000])
    parser.add_argument("--update-rounds", type=int, default=6, help="round closes per K and preset")
    parser.add_argument("--gunicorn", type=_parse_list, default=[],
                        help="also measure assignment under gunicorn with these worker counts (SQLite), e.g. 1,2")
    parser.add_argument("--gunicorn-threads", type=int, default=4)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: SQLite, K = 100, a few hundred requests, seconds in all")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument("--segmented-close", action="store_true",
                        help="only the segmented round close (K = --arms, S = --segments) beside the unsegmented one")
    parser.add_argument("--segments", type=int, default=50, help="S of the segmented close")
    parser.add_argument("--write-docs", action="store_true",
                        help="replace the '## Serving' section of docs/benchmarks.md")
    return parser


HISTORY_EXPERIMENT = "history"


def build_history(url: str, n_arms: int, n_rounds: int, units: int) -> tuple[str, int]:
    """An experiment of ``n_arms`` arms whose rounds 0 .. ``n_rounds`` - 1 are applied and round
    ``n_rounds`` is being served; (read token, rows of the rounds table).

    Round 0 is played through the API (``units`` units assigned and observed, the round closed: its
    propensities, deployed mixture, summary and statistics are real); rounds 1 .. ``n_rounds`` - 1
    are copies of its rows (SQL ``INSERT ... SELECT``): closing 1,000 rounds at K = 10,000 would take
    most of an hour, and what is measured is reading them.
    """
    import sqlalchemy as sa

    from service.auth import create_token
    from service.db import get_db

    app, _ = prepare_database(url, [(HISTORY_EXPERIMENT, n_arms, "default")])
    client = app.test_client()
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    api = f"/api/v1/experiments/{HISTORY_EXPERIMENT}"
    assigned = client.post(f"{api}/assign", json={"units": [f"h{i}" for i in range(units)]},
                           headers=headers).get_json()["assignments"]
    rng = np.random.default_rng(7)
    observations = [{"id": a["unit"], "unit": a["unit"], "round": 0,
                     "values": {metric: float(value) for metric, value in zip(METRICS, rng.normal(size=len(METRICS)))}}
                    for a in assigned]
    for start in range(0, units, 5_000):
        answer = client.post(f"{api}/observations", json={"observations": observations[start:start + 5_000]},
                             headers=headers)
        if answer.status_code != 202:
            raise RuntimeError(f"Ingesting the history's round 0 failed: {answer.get_data(True)[:500]}")
    if client.post(f"{api}/rounds", headers=headers).status_code != 200:
        raise RuntimeError("Closing the history's round 0 failed.")
    database = get_db(app)
    with database.write() as session:
        experiment_id = session.execute(sa.text("SELECT id FROM experiments WHERE name = :name"),
                                        {"name": HISTORY_EXPERIMENT}).scalar_one()
        key = {"e": experiment_id}
        session.execute(sa.text('UPDATE rounds SET "index" = :last WHERE experiment_id = :e AND "index" = 1'),
                        {**key, "last": n_rounds})
        for offset in range(1, n_rounds):
            shifted = {**key, "k": offset}
            session.execute(sa.text(
                'INSERT INTO rounds (experiment_id, "index", started_at, ends_at, closed_at, applied_at, '
                'probabilities, deployed, summary) SELECT experiment_id, "index" + :k, started_at, ends_at, '
                'closed_at, applied_at, probabilities, deployed, summary FROM rounds '
                'WHERE experiment_id = :e AND "index" = 0'), shifted)
            session.execute(sa.text(
                "INSERT INTO round_statistics (experiment_id, round_index, segment_index, arm_index, metric_index, "
                "count, sum, sum_of_squares) SELECT experiment_id, round_index + :k, segment_index, arm_index, "
                "metric_index, count, sum, sum_of_squares FROM round_statistics WHERE experiment_id = :e "
                "AND round_index = 0"), shifted)
            session.execute(sa.text(
                "INSERT INTO arm_round_counts (experiment_id, round_index, arm_index, observations, units, "
                "late_observations) SELECT experiment_id, round_index + :k, arm_index, observations, units, "
                "late_observations FROM arm_round_counts WHERE experiment_id = :e AND round_index = 0"), shifted)
            session.execute(sa.text(
                "INSERT INTO round_counts (experiment_id, round_index, observations, units, late_observations) "
                "SELECT experiment_id, round_index + :k, observations, units, late_observations FROM round_counts "
                "WHERE experiment_id = :e AND round_index = 0"), shifted)
        session.execute(sa.text("UPDATE experiments SET round_index = :n, applied_rounds = :n, version = version + 1 "
                                "WHERE id = :e"), {**key, "n": n_rounds})
        rows = session.execute(sa.text("SELECT count(*) FROM rounds WHERE experiment_id = :e"), key).scalar_one()
        token = create_token(session, "read", "bench-history")
    database.engine.dispose()
    return token, rows


def _timed_get(port: int, path: str, token: str) -> tuple[float, int, Any]:
    """(seconds, body bytes, decoded JSON) of one GET with a bearer token, on a new connection."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        started = time.perf_counter()
        connection.request("GET", path, headers={"Authorization": f"Bearer {token}"})
        response = connection.getresponse()
        body = response.read()
        seconds = time.perf_counter() - started
        if response.status != 200:
            raise RuntimeError(f"GET {path}: {response.status} {body[:300]!r}")
        return seconds, len(body), json.loads(body)
    finally:
        connection.close()


#: What the dashboard asks for (``SUMMARY_ARMS`` in service/static/dashboard/experiment.js).
DASHBOARD_SUMMARY_ARMS = 100
HISTORY_HEADING = "## Dashboard poll at K = 10,000 after 1,000 rounds"


def measure_history(workdir: Path, n_arms: int, n_rounds: int, units: int, repeats: int) -> dict[str, Any]:
    """Bytes and milliseconds of the dashboard's reads of experiment ``history``
    (:func:`build_history`), as ``service/static/dashboard/experiment.js`` makes them, full (every arm,
    the API's default) and summarised (``?arms=100``, what the page asks for), in the same run with
    the two kinds of poll alternating, so both see the same machine:

    - ``poll``: what each poll reads once the page has the history: ``GET .../<name>`` and
      ``GET .../diagnostics`` (in parallel in the browser, added here), then ``GET .../rounds?since=``
      the first round that is not final (the current one), following ``next_since``;
    - ``first diagnostics``: the first summarised diagnostics request of the server process (it builds
      the running traffic sums from every round and solves the optimum; later polls reuse both);
    - ``first load``: the same poll with the history from round 0, every page;
    - ``rounds page``: one ``GET .../rounds`` with its default page size.
    """
    url = f"sqlite:///{workdir / 'history.sqlite'}"
    build_started = time.monotonic()
    token, rows = build_history(url, n_arms, n_rounds, units)
    build_seconds = time.monotonic() - build_started
    server = Server(url, n_arms)
    api = f"/api/v1/experiments/{HISTORY_EXPERIMENT}"

    def rounds_from(since: int, query: str) -> tuple[float, int, int, int]:
        seconds = size = pages = count = 0
        cursor: int | None = since
        while cursor is not None:
            took, length, page = _timed_get(server.port, f"{api}/rounds?since={cursor}{query}", token)
            seconds, size, pages, count = seconds + took, size + length, pages + 1, count + len(page["rounds"])
            cursor = page["next_since"]
        return seconds, size, pages, count

    def poll(since: int, arms: int | None) -> dict[str, Any]:
        first, more = ("", "") if arms is None else (f"?arms={arms}", f"&arms={arms}")
        experiment = _timed_get(server.port, f"{api}{first}", token)
        diagnostics = _timed_get(server.port, f"{api}/diagnostics{first}", token)
        history = rounds_from(since, more)
        return {"ms": 1000 * (experiment[0] + diagnostics[0] + history[0]),
                "bytes": experiment[1] + diagnostics[1] + history[1],
                "parts": {"experiment": (1000 * experiment[0], experiment[1]),
                          "diagnostics": (1000 * diagnostics[0], diagnostics[1]),
                          "rounds": (1000 * history[0], history[1], history[2], history[3])}}

    def summarise(polls: list[dict[str, Any]]) -> dict[str, Any]:
        """The best poll, with the median of the totals and of each part."""
        best = min(polls, key=lambda p: p["ms"])
        return best | {"median_ms": statistics.median(p["ms"] for p in polls),
                       "median_parts": {part: statistics.median(p["parts"][part][0] for p in polls)
                                        for part in ("experiment", "diagnostics", "rounds")}}

    summary = DASHBOARD_SUMMARY_ARMS
    try:
        _timed_get(server.port, api, token)  # the worker loads its cached snapshot once
        results: dict[str, Any] = {"rows": rows, "build_seconds": build_seconds,
                                   "load_before": os.getloadavg()[0]}
        took, size, _ = _timed_get(server.port, f"{api}/diagnostics?arms={summary}", token)
        results["first_diagnostics"] = {"ms": 1000 * took, "bytes": size}
        full_polls, summary_polls = [], []
        for _ in range(repeats):  # alternating: both kinds of poll see the same load
            full_polls.append(poll(n_rounds, None))
            summary_polls.append(poll(n_rounds, summary))
        results["poll"] = summarise(full_polls)
        results["summary_poll"] = summarise(summary_polls)
        # Every page of a long history at large K is hundreds of megabytes in full: measured only when
        # smaller; summarised it is N numbers per array and round.
        results["first_load"] = poll(0, None) if n_arms * n_rounds <= 2_000_000 else None
        results["summary_first_load"] = poll(0, summary)
        pages = [_timed_get(server.port, f"{api}/rounds", token) for _ in range(repeats)]
        results["rounds_page"] = {"median_ms": 1000 * statistics.median(p[0] for p in pages), "bytes": pages[0][1],
                                  "rounds": len(pages[0][2]["rounds"])}
        results["load_after"] = os.getloadavg()[0]
    finally:
        server.stop()
    return results


def render_history(results: dict[str, Any], command: str, n_arms: int, n_rounds: int, units: int) -> str:
    """The table of :func:`measure_history` (and, for ``--write-docs``, its docs/benchmarks.md section)."""
    full, cut = results["poll"], results["summary_poll"]
    n = DASHBOARD_SUMMARY_ARMS

    def rows(label: str, result: dict[str, Any]) -> list[str]:
        rounds = result["parts"]["rounds"]
        out = [f"| {label}: the whole poll | {2 + rounds[2]} | {result['bytes']:,} | "
               f"{result['median_ms']:.0f}; {result['ms']:.0f} |"]
        for part in ("experiment", "diagnostics"):
            out.append(f"| - of which {part} | 1 | {result['parts'][part][1]:,} | "
                       f"{result['median_parts'][part]:.0f}; {result['parts'][part][0]:.0f} |")
        out.append(f"| - of which rounds ({rounds[3]} round) | {rounds[2]} | {rounds[1]:,} | "
                   f"{result['median_parts']['rounds']:.0f}; {rounds[0]:.0f} |")
        return out

    lines = [
        f"K = {n_arms:,}, {n_rounds:,} applied rounds ({results['rows']:,} rounds rows), {units:,} units a round; "
        f"built in {results['build_seconds']:.0f} s. Load average (1 min) {results['load_before']:.1f} before the "
        f"polls and {results['load_after']:.1f} after (2 cores).",
        "",
        "| read | requests | bytes | ms (median; best) |",
        "|---|---|---|---|",
        *rows("full (every arm, the API's default)", full),
        *rows(f"summarised (`?arms={n}`, what the page asks for)", cut),
        f"| summarised: the first diagnostics request of a process | 1 | {results['first_diagnostics']['bytes']:,} | "
        f"{results['first_diagnostics']['ms']:.0f} |",
    ]
    first = results["first_load"]
    if first is not None:
        ms, size, pages, count = first["parts"]["rounds"]
        lines.append(f"| full: first load, every page of the history ({count:,} rounds) | {pages} | {size:,} | {ms:.0f} |")
    ms, size, pages, count = results["summary_first_load"]["parts"]["rounds"]
    lines.append(f"| summarised: first load, every page of the history ({count:,} rounds) | {pages} | {size:,} | {ms:.0f} |")
    page = results["rounds_page"]
    lines.append(f"| full: `GET .../rounds`, one default page ({page['rounds']} rounds) | 1 | {page['bytes']:,} | "
                 f"{page['median_ms']:.0f} |")
    ratio_bytes = full["bytes"] / cut["bytes"]
    ratio_ms = full["median_ms"] / cut["median_ms"]
    met = cut["median_ms"] < 200 and cut["bytes"] < 200_000
    lines += ["", f"Summarised against full in the same run: {ratio_bytes:.0f}x fewer bytes, {ratio_ms:.1f}x less time "
                  f"(medians). Target (a poll under 200 ms and 200 kB): "
                  f"**{'met' if met else 'missed'}** by the summarised poll "
                  f"({cut['bytes']:,} bytes, {cut['median_ms']:.0f} ms median)."]
    table = "\n".join(lines)
    return (f"{HISTORY_HEADING}\n\n"
            "What the experiment page (`service/static/dashboard/experiment.js`) reads on each poll, once it has\n"
            "the history: `GET .../<name>` and `GET .../diagnostics` (in parallel in the browser, added here),\n"
            "then `GET .../rounds?since=` the first round that is not final (the current one). The page asks for\n"
            f"`?arms={n}` on each (docs/api.md: the {n} arms of largest max(p_t, deployed) and one summed `rest`);\n"
            "the full reads, the API's default, are measured in the same run, the two kinds of poll alternating.\n"
            "One experiment of K arms and M = 5 metrics on SQLite, served by waitress. Round 0 is played through\n"
            "the API (the units observed, the round closed with its summary); the later rounds are SQL copies of\n"
            "its rows, because closing 1,000 rounds at K = 10,000 would take most of an hour and what is measured\n"
            "is reading them.\n\n"
            "<!-- doctest: skip (a benchmark of several minutes) -->\n"
            f"```sh\n.venv/bin/python {command}\n```\n\n"
            f"{table}\n\n"
            "The diagnostics' best mixture and best single arm are solved once per estimate and reused by the\n"
            "polls that follow (a per-process cache keyed by the experiment's version and a digest of the\n"
            "objective, the means and the thresholds): the first diagnostics request of a process pays for the\n"
            "solve and for building the running traffic sums from every round. What a poll's diagnostics still\n"
            "reads every time is the per-round count totals (`store.round_totals`: one `round_counts` row per\n"
            "round, kept by ingestion, migration 0012) and the indexes of the summarised rounds (the regret per\n"
            "round is cached per process: a round's summary is written once and never restated).\n")


def measure_diagnostics_solve(workdir: Path, n_arms: int, n_rounds: int, units: int, repeats: int,
                              batch: int) -> dict[str, Any]:
    """Milliseconds of one summarised diagnostics request (``?arms=100``) of experiment ``history``
    (:func:`build_history`) in this process (Flask's test client, no HTTP), with the cached optimum
    reused (``hit``: nothing changed since the previous request) and with it solved again (``solve``:
    ``batch`` observations of the current round ingested just before, untimed, as a poll finds it
    while traffic flows: the pooled estimate includes the open round). The two alternate, ``repeats``
    times each, so both see the same machine."""
    from service import create_app
    from service.controller import reports
    from service.db import get_db

    url = f"sqlite:///{workdir / 'history.sqlite'}"
    token, _ = build_history(url, n_arms, n_rounds, units)
    app = create_app({"PASTO_DATABASE_URL": url, "PASTO_ADMIN_TOKEN": ADMIN_TOKEN})
    client = app.test_client()
    api = f"/api/v1/experiments/{HISTORY_EXPERIMENT}"
    read = {"Authorization": f"Bearer {token}"}
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    def diagnostics() -> float:
        started = time.perf_counter()
        answer = client.get(f"{api}/diagnostics?arms={DASHBOARD_SUMMARY_ARMS}", headers=read)
        seconds = time.perf_counter() - started
        if answer.status_code != 200:
            raise RuntimeError(f"GET diagnostics: {answer.status_code} {answer.get_data(True)[:300]}")
        return 1000 * seconds

    def ingest(index: int) -> None:
        answer = client.post(f"{api}/observations", headers=admin,
                             json={"observations": observation_batch("between", index, batch, n_rounds)})
        if answer.status_code != 202:
            raise RuntimeError(f"Ingesting between polls failed: {answer.get_data(True)[:300]}")

    def cached_optimum():
        """This process's cached (key, optimum) of the experiment: a new object when a request solved."""
        entries = reports._optimum_caches[get_db(app).engine].entries
        (entry,) = entries.values()
        return entry

    diagnostics()  # the first request builds the running traffic sums and solves once
    load_before = os.getloadavg()[0]
    hits, solves = [], []
    solved = {"hit": 0, "solve": 0}  # requests of each kind that solved (checked: 0 and repeats)
    for repeat in range(repeats):
        for side in (("hit", "solve") if repeat % 2 == 0 else ("solve", "hit")):
            if side == "solve":
                ingest(repeat)
            else:
                diagnostics()  # whatever the previous request left, this one's inputs are now cached
            before = cached_optimum()
            (solves if side == "solve" else hits).append(diagnostics())
            solved[side] += cached_optimum() is not before
    hit, solve = statistics.median(hits), statistics.median(solves)
    return {"hit_ms": hit, "solve_ms": solve, "ratio": solve / hit, "hits": hits, "solves": solves,
            "solved": solved, "load_before": load_before, "load_after": os.getloadavg()[0]}


def diagnostics_solve_main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="One diagnostics request with the cached optimum reused "
                                                 "vs. solved again after ingestion (measure_diagnostics_solve).")
    parser.add_argument("--arms", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3, help="applied rounds (the solve does not depend on them)")
    parser.add_argument("--units", type=int, default=1_000, help="units observed in round 0")
    parser.add_argument("--repeats", type=int, default=20, help="requests of each kind (medians)")
    parser.add_argument("--batch", type=int, default=20, help="observations ingested before each solving request")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pasto-bench-solve-") as workdir:
        results = measure_diagnostics_solve(Path(workdir), args.arms, args.rounds, args.units, args.repeats,
                                            args.batch)
    print(f"K = {args.arms:,}: diagnostics?arms={DASHBOARD_SUMMARY_ARMS} in-process, medians of {args.repeats}: "
          f"cached optimum {results['hit_ms']:.1f} ms, solved after ingestion {results['solve_ms']:.1f} ms "
          f"(ratio {results['ratio']:.1f}); load average (1 min) {results['load_before']:.1f} before, "
          f"{results['load_after']:.1f} after.")
    return results


def history_main(argv: list[str], docs: Path = DOCS) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="The dashboard's reads after a long history (measure_history).")
    parser.add_argument("--arms", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=1_000)
    parser.add_argument("--units", type=int, default=20_000, help="units observed in each round")
    parser.add_argument("--repeats", type=int, default=5, help="polls of each kind measured (median and best)")
    parser.add_argument("--write-docs", action="store_true",
                        help=f"replace the '{HISTORY_HEADING[3:]}' section of docs/benchmarks.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pasto-bench-history-") as workdir:
        results = measure_history(Path(workdir), args.arms, args.rounds, args.units, args.repeats)
    command = "bench/serve.py history " + " ".join(a for a in argv if a != "--write-docs")
    section = render_history(results, command.strip(), args.arms, args.rounds, args.units)
    print(section)
    if args.write_docs:
        _client_bench.write_section(section, docs)
        print(f"Wrote the {HISTORY_HEADING[3:]!r} section of {docs}.")
    return results


# ---------------------------------------------------------------------------------- assign only
WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %(token)s"
counter = 0
batch = %(batch)d
body = function(n)
  if batch == 0 then return '{"unit":"user-' .. n .. '"}' end
  local units = {}
  for j = 1, batch do units[j] = '"user-' .. n .. '-' .. j .. '"' end
  return '{"units":[' .. table.concat(units, ",") .. ']}'
end
request = function()
  counter = counter + 1
  return wrk.format(nil, nil, nil, body(counter))
end
refused = false
response = function(status, headers, body)
  if status ~= 200 and not refused then
    refused = true
    io.write("first refused: " .. status .. " " .. body .. "\\n")
  end
end
"""


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and of its live descendants (gunicorn's workers)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total, pending = 0.0, [pid]
    while pending:
        current = pending.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(child) for child in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def wrk_pass(port: int, path: str, token: str, kind: str, batch_size: int, seconds: float,
             connections: int, server_pid: int | None = None) -> dict[str, Any]:
    """One ``wrk`` pass (Debian's wrk, 1 thread, ``connections`` keep-alive connections) against ``path``:
    requests/s, the count of non-2xx answers and (with ``server_pid``) the server's CPU microseconds per
    request. Every request names a new unit (or batch of units)."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(WRK_SCRIPT % {"token": token, "batch": 0 if kind == "assign" else batch_size})
    cpu = process_cpu_seconds(server_pid) if server_pid else 0.0
    try:
        completed = subprocess.run(
            ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "-s", script.name, f"http://127.0.0.1:{port}{path}"],
            capture_output=True, text=True, check=True, timeout=seconds + 60,
        )
    finally:
        os.unlink(script.name)
    cpu = process_cpu_seconds(server_pid) - cpu if server_pid else float("nan")
    out = completed.stdout
    if completed.stderr.strip():
        raise RuntimeError(f"wrk: {completed.stderr.strip()[:500]}")
    rate = float(out.split("Requests/sec:")[1].split()[0])
    errors = int(out.split("Non-2xx or 3xx responses:")[1].split()[0]) if "Non-2xx" in out else 0
    refused = out.split("first refused: ", 1)[1].strip()[:300] if "first refused: " in out else None
    count = int(out.split(" requests in ")[0].split()[-1])
    return {"rate": rate, "errors": errors, "count": count, "refused": refused, "cpu_us": cpu / max(count, 1) * 1e6}


def assign_main(argv: list[str]) -> dict[str, Any]:
    """``python bench/serve.py assign``: only the assign endpoint against the bare one, per backend and
    server (waitress with ``--threads``, or gunicorn ``-w --workers`` gthread), single units and batches,
    A/B then B/A, with the Python load generator or ``--wrk`` (Debian's wrk); the median paired ratio."""
    parser = argparse.ArgumentParser(prog="bench/serve.py assign")
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--server", choices=("waitress", "gunicorn"), default="waitress")
    parser.add_argument("--workers", type=int, default=4, help="gunicorn workers")
    parser.add_argument("--threads", type=int, default=8, help="waitress threads, or threads per gunicorn worker")
    parser.add_argument("--arms", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--wrk", action="store_true", help="load with wrk instead of the Python clients")
    parser.add_argument("--connections", type=int, default=8, help="wrk connections")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--requests", type=int, default=50_000)
    args = parser.parse_args(argv)
    loadgen = None if args.wrk else LoadGenerator(args.clients)
    cluster = None
    results: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="pasto-bench-assign-") as workdir:
            for name in [b.strip() for b in args.backends.split(",") if b.strip()]:
                backend, started = _backend(name, args, workdir)
                cluster = started or cluster
                if backend is None:
                    continue
                try:
                    url = backend.new_database("assign")
                    app, token = prepare_database(url, [(EXPERIMENT, args.arms, "default")])
                    from service.db import get_db

                    get_db(app).engine.dispose()
                    workers = args.workers if args.server == "gunicorn" else 1
                    server = Server(url, args.arms, server=args.server, threads=args.threads, workers=workers)
                    try:
                        for kind in ("assign", "assign_batch"):
                            results[f"{name}/{kind}"] = _assign_passes(server, loadgen, token, args, kind)
                    finally:
                        server.stop()
                finally:
                    backend.close()
    finally:
        if loadgen is not None:
            loadgen.close()
        if cluster is not None:
            cluster.stop()
    server_name = (f"gunicorn -w {args.workers} (gthread, {args.threads} threads)" if args.server == "gunicorn"
                   else f"waitress ({args.threads} threads)")
    print(f"\n{server_name}, K = {args.arms}, load: "
          + (f"wrk -t1 -c{args.connections}" if args.wrk else f"{args.clients} Python clients") + f", "
          f"{args.repeats} x {args.seconds:g} s per side; requests/s (best pass) and the median paired ratio\n")
    print("| backend | request | bare, req/s | pasto, req/s | pasto / bare | server CPU per request, bare / pasto, us "
          "| bare / pasto CPU |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for key, result in results.items():
        backend, kind = key.split("/")
        label = "1 unit" if kind == "assign" else f"{args.batch_size} units"
        bare_cpu, pasto_cpu = result["bare"].get("cpu_min", float("nan")), result["pasto"].get("cpu_min", float("nan"))
        print(f"| {backend} | {label} | {result['bare']['rate']:,.0f} | {result['pasto']['rate']:,.0f} | "
              f"{paired_ratio(result['pasto'], result['bare']):.2f} | {bare_cpu:,.0f} / {pasto_cpu:,.0f} | "
              f"{bare_cpu / pasto_cpu:.2f} |")
    return results


def _assign_passes(server: Server, loadgen, token: str, args, kind: str) -> dict[str, Any]:
    paths = {"bare": "/bare/assign", "pasto": f"/api/v1/experiments/{EXPERIMENT}/assign"}
    if loadgen is not None:
        return measure_assign(server, loadgen, token, args, kind)
    passes: dict[str, list] = {"bare": [], "pasto": []}
    for side in ("bare", "pasto"):  # warm-up
        wrk_pass(server.port, paths[side], token, kind, args.batch_size, 1, args.connections)
    for repeat in range(args.repeats):
        for side in (("bare", "pasto") if repeat % 2 == 0 else ("pasto", "bare")):
            passes[side].append(wrk_pass(server.port, paths[side], token, kind, args.batch_size, args.seconds,
                                         args.connections, server.process.pid))
    for side, side_passes in passes.items():
        if any(p["errors"] for p in side_passes):
            raise RuntimeError(f"The {side} endpoint answered errors: {side_passes}")
    return {side: {**max(side_passes, key=lambda p: p["rate"]), "rates": [p["rate"] for p in side_passes],
                   "cpu_min": min(p["cpu_us"] for p in side_passes)}
            for side, side_passes in passes.items()}


# ---------------------------------------------------------------------------------- the close at large K
def bare_close_sql(database, experiment_id: int, round_index: int, n_arms: int, n_metrics: int) -> float:
    """Seconds of the SQL a round close must run, written by hand on the DBAPI connection and rolled
    back: lock the experiment row, read the round's cells and the late cells (the statements the
    service runs: on PostgreSQL packed per segment and metric into bytea by the server, on SQLite one
    cell index per row flattened into numpy) and the running totals (one row of K-arrays per metric, migration 0018), write
    the totals back (the same upsert of one row per metric, arrays of K float64), empty the late
    cells, write back the controller state it read (the stored document, of the size the close
    writes: its arrays as the service packs them; the change detector's snapshots, which a close reads
    and writes only when the detector looks, are not in it) and the next round's K probabilities. What any
    implementation of the close pays for its data. The experiment row is read with its state, as the
    close reads it. (Before 0018 the totals were one row per arm: an upsert of M x K rows from the
    round's cells in SQL, and a read of M x K rows.)"""
    from service.store import _placeholder

    engine = database.engine
    p = _placeholder(engine)
    postgres = engine.dialect.name == "postgresql"
    blob = "%b" if postgres else p
    probabilities = json.dumps(np.full(n_arms, 1.0 / n_arms).tolist())
    connection = engine.raw_connection()
    try:
        cursor = connection.cursor()
        started = time.perf_counter()
        if not postgres:
            cursor.execute("BEGIN IMMEDIATE")
            lock = f"SELECT id, state FROM experiments WHERE id = {p}"
        else:
            lock = f"SELECT id, state FROM experiments WHERE id = {p} FOR UPDATE"
        cursor.execute(lock, (experiment_id,))
        (_, state), = cursor.fetchall()
        state = state if isinstance(state, str) else json.dumps(state)  # psycopg parses a json column
        for table, where, parameters in (("round_statistics", f"AND round_index = {p}", (experiment_id, round_index)),
                                         ("late_statistics", "", (experiment_id,))):
            if postgres:  # each (segment, metric)'s columns packed by the server into bytea, read in binary
                cursor.execute(
                    "SELECT segment_index, metric_index, string_agg(int4send(arm_index), ''::bytea), "
                    "string_agg(int8send(count), ''::bytea), string_agg(float8send(sum), ''::bytea), "
                    f"string_agg(float8send(sum_of_squares), ''::bytea) FROM {table} WHERE experiment_id = {p} "
                    f"{where} GROUP BY segment_index, metric_index", parameters, binary=True)
                for _, _, *columns in cursor.fetchall():
                    [np.frombuffer(column, dtype=dtype) for column, dtype in zip(columns, (">i4", ">i8", ">f8", ">f8"))]
            else:  # one cell index per row, flattened into numpy
                cursor.execute(f"SELECT (segment_index * {n_metrics} + metric_index) * {n_arms} + arm_index, count, "
                               f"sum, sum_of_squares FROM {table} WHERE experiment_id = {p} {where}", parameters)
                rows = cursor.fetchall()
                np.fromiter(itertools.chain.from_iterable(rows), np.float64, count=4 * len(rows))
        cursor.execute(f"SELECT segment_index, metric_index, count, sum, sum_of_squares FROM pooled_arrays "
                       f"WHERE experiment_id = {p}", (experiment_id,))
        totals = {(s, m): [bytes(v) for v in values] for s, m, *values in cursor.fetchall()}
        zeros = np.zeros(n_arms).tobytes()
        cursor.executemany(
            f"INSERT INTO pooled_arrays (experiment_id, segment_index, metric_index, count, sum, sum_of_squares) "
            f"VALUES ({p}, {p}, {p}, {blob}, {blob}, {blob}) ON CONFLICT (experiment_id, segment_index, metric_index) "
            "DO UPDATE SET count = excluded.count, sum = excluded.sum, sum_of_squares = excluded.sum_of_squares",
            [(experiment_id, 0, m, *totals.get((0, m), [zeros] * 3)) for m in range(n_metrics)])
        cursor.execute(f"DELETE FROM late_statistics WHERE experiment_id = {p}", (experiment_id,))
        cursor.execute(f"UPDATE experiments SET state = {p} WHERE id = {p}", (state, experiment_id))
        cursor.execute(f'UPDATE rounds SET probabilities = {p} WHERE experiment_id = {p} AND "index" = {p}',
                       (probabilities, experiment_id, round_index))
        seconds = time.perf_counter() - started
        connection.rollback()
        cursor.close()
    finally:
        connection.close()
    return seconds


#: What ``close --parts`` times inside ``close_round``: (module, function, label). Nested calls are
#: timed apart: ``advance_experiment`` includes the ORM flush it triggers (the round rows and the
#: summary input), and ``commit`` the rest of the flush.
CLOSE_PARTS = (
    ("service.store", "lock_experiment", "lock and state read"),
    ("service.store", "_read_cells", "statistics read (round and late cells)"),
    ("service.store", "_read_pooled_arrays", "totals read"),
    ("service.store", "_write_pooled_arrays", "totals write"),
    ("service.controller.rounds", "update", "update"),
    ("service.controller.rounds", "_summary_input", "summary input built"),
    ("service.store", "advance_experiment", "state write (with the flush)"),
    ("service.store", "read_detector_snapshots", "detector snapshots read"),
    ("service.store", "write_detector_snapshots", "detector snapshots written"),
    ("sqlalchemy.orm.SessionTransaction", "commit", "commit"),
    ("service.controller.rounds", "_summary", "summary computed"),
    ("service.store", "store_summaries", "summary written"),
)


def _time_close_parts(totals: dict[str, float]):
    """Wrap :data:`CLOSE_PARTS` so that each call adds its seconds to ``totals[label]``; returns an undo."""
    import functools
    import importlib

    undo = []
    for module_name, name, label in CLOSE_PARTS:
        if module_name == "sqlalchemy.orm.SessionTransaction":
            from sqlalchemy.orm import SessionTransaction as owner
        else:
            owner = importlib.import_module(module_name)
        original = getattr(owner, name)

        def timed(*args, _original=original, _label=label, **kwargs):
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[_label] = totals.get(_label, 0.0) + time.perf_counter() - started

        setattr(owner, name, functools.wraps(original)(timed))
        undo.append((owner, name, original))
    return lambda: [setattr(owner, name, original) for owner, name, original in undo]


def close_main(argv: list[str]) -> dict[str, Any]:
    """``python bench/serve.py close``: the round close at large K beside the SQL it must run (bare,
    :func:`bare_close_sql`) and the update alone, per backend; the close's peak traced memory; the
    dashboard's summarised poll (``?arms=100``) afterwards."""
    parser = argparse.ArgumentParser(prog="bench/serve.py close")
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--arms", type=_parse_list, default=[10_000])
    parser.add_argument("--preset", default="default")
    parser.add_argument("--rounds", type=int, default=3, help="closes per K (the first one is a warm-up)")
    parser.add_argument("--parts", action="store_true",
                        help="time the close's parts (lock, fold, reads, update, state write, summary) per round")
    parser.add_argument("--statement-timeout", type=float, default=120.0,
                        help="PASTO_DATABASE_STATEMENT_TIMEOUT for the run (the fold of 500,000 cells at K = 100,000 "
                             "can exceed the 10 s default on a loaded machine)")
    args = parser.parse_args(argv)
    os.environ["PASTO_DATABASE_STATEMENT_TIMEOUT"] = str(args.statement_timeout)
    import tracemalloc

    import sqlalchemy as sa

    from service.bootstrap import get_uow
    from service.db import get_db
    from service.models import Experiment, RoundStatistic

    parts: dict[str, float] = {}
    undo_parts = _time_close_parts(parts) if args.parts else None
    import service.controller.rounds as rounds_module
    from service.controller.rounds import close_round

    # The update inside each close (pasto's math, no SQL), timed always: the close's floor is its SQL
    # plus its update, and "(bare SQL + update) / close" is what the close costs beyond both.
    inner_update: list[float] = []
    timed_update = rounds_module.update

    def update_timed(*update_args, **update_kwargs):
        update_started = time.perf_counter()
        try:
            return timed_update(*update_args, **update_kwargs)
        finally:
            inner_update.append(time.perf_counter() - update_started)

    rounds_module.update = update_timed

    results: dict[str, Any] = {}
    cluster = None
    try:
        with tempfile.TemporaryDirectory(prefix="pasto-bench-close-") as workdir:
            for name in [b.strip() for b in args.backends.split(",") if b.strip()]:
                backend, started = _backend(name, args, workdir)
                cluster = started or cluster
                if backend is None:
                    continue
                try:
                    for n_arms in args.arms:
                        experiment = close_experiment(n_arms, args.preset)
                        created = time.perf_counter()
                        app, token = prepare_database(backend.new_database(f"close{n_arms}"),
                                                      [(experiment, n_arms, args.preset)])
                        created = time.perf_counter() - created
                        database = get_db(app)
                        with database.read() as session:
                            experiment_id = session.execute(
                                sa.select(Experiment.id).where(Experiment.name == experiment)).scalar_one()
                        rng = np.random.default_rng(0)
                        means = rng.uniform(-1.0, 1.0, (len(METRICS), n_arms))
                        row = {"created_s": created, "close_ms": [], "bare_ms": [], "error": None, "parts_ms": [],
                               "inner_update_ms": []}
                        for round_index in range(args.rounds + 1):
                            statistics_ = synthetic_statistics(rng, means, 3)
                            rows = [{"experiment_id": experiment_id, "round_index": round_index, "segment_index": 0,
                                     "arm_index": k, "metric_index": m, "count": int(statistics_.counts[m, k]),
                                     "sum": float(statistics_.sums[m, k]),
                                     "sum_of_squares": float(statistics_.sums_of_squares[m, k])}
                                    for m in range(len(METRICS)) for k in range(n_arms) if statistics_.counts[m, k] > 0]
                            for start in range(0, len(rows), 20_000):  # within the statement timeout
                                with database.write() as session:
                                    session.execute(sa.insert(RoundStatistic.__table__), rows[start:start + 20_000])
                            bare = bare_close_sql(database, experiment_id, round_index, n_arms, len(METRICS))
                            traced = round_index == args.rounds  # the last close: under tracemalloc, not timed
                            if traced:
                                tracemalloc.start()
                            parts.clear()
                            inner_update.clear()
                            started = time.perf_counter()
                            try:
                                # No metric source: the scheduler and the admin's close say so
                                # (has_source), and the close skips the source read.
                                close_round(get_uow(app), experiment_id, round_index, has_source=False)
                            except MemoryError as error:
                                row["error"] = f"MemoryError: {str(error)[:120]}"
                                if traced:
                                    tracemalloc.stop()
                                break
                            seconds = time.perf_counter() - started
                            if traced:
                                row["peak_mb"] = tracemalloc.get_traced_memory()[1] / 2**20
                                tracemalloc.stop()
                            elif round_index > 0:
                                row["close_ms"].append(seconds * 1000)
                                row["bare_ms"].append(bare * 1000)
                                row["inner_update_ms"].append(sum(inner_update) * 1000)
                                # Every part, 0 for one this close did not call (the detector's
                                # snapshots are written only when it looks).
                                row["parts_ms"].append({label: parts.get(label, 0.0) * 1000
                                                        for _, _, label in CLOSE_PARTS})
                            print(f"[{name}] K = {n_arms:,} round {round_index}: close {seconds * 1000:,.0f} ms, "
                                  f"bare SQL {bare * 1000:,.0f} ms, update in the close "
                                  f"{sum(inner_update) * 1000:,.0f} ms", flush=True)
                            if args.parts:
                                print("    " + ", ".join(f"{label} {value * 1000:,.0f} ms" for label, value in
                                                         sorted(parts.items(), key=lambda item: -item[1])), flush=True)
                        if row["error"] is None:
                            client = app.test_client()
                            headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
                            for label, path in (("experiment", f"/api/v1/experiments/{experiment}?arms=100"),
                                                ("rounds", f"/api/v1/experiments/{experiment}/rounds?arms=100")):
                                started = time.perf_counter()
                                response = client.get(path, headers=headers)
                                row[f"poll_{label}"] = (response.status_code, (time.perf_counter() - started) * 1000,
                                                        len(response.get_data()))
                        update = measure_update_alone(n_arms, args.preset, 3) if row["error"] is None else None
                        row["update_ms"] = None if update is None else update["median_ms"]
                        results[f"{name}/{n_arms}"] = row
                        database.engine.dispose()
                finally:
                    backend.close()
    finally:
        rounds_module.update = timed_update
        if cluster is not None:
            cluster.stop()
        if undo_parts is not None:
            undo_parts()
    print(f"\nRound close, preset {args.preset!r}, M = {len(METRICS)}: median over rounds 1..{args.rounds - 1} "
          "(round 0 is a warm-up; the last close runs under tracemalloc for its peak)\n")
    print("| backend | K | close, ms | bare SQL of the close, ms | bare SQL / close (median of paired rounds) | "
          "update in the close, ms | (bare SQL + update) / close (paired) | update alone, ms | "
          "peak traced memory of the close, MB | GET experiment / rounds ?arms=100: status, ms, bytes |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for key, row in results.items():
        backend, n_arms = key.split("/")
        if row["error"] is not None:
            print(f"| {backend} | {int(n_arms):,} | {row['error']} | | | | | | | |")
            continue
        close_ms, bare_ms = statistics.median(row["close_ms"]), statistics.median(row["bare_ms"])
        # Each close against the bare SQL run right before it, then the median of those ratios.
        row["paired_ratio"] = statistics.median(bare / close for bare, close in zip(row["bare_ms"], row["close_ms"]))
        # The same with the close's own update added to its floor (the update is in the close, not in the SQL).
        row["floor_ratio"] = statistics.median((bare + inner) / close for bare, inner, close in
                                               zip(row["bare_ms"], row["inner_update_ms"], row["close_ms"]))
        polls = "; ".join(f"{status}, {ms:,.0f} ms, {size:,} B" for status, ms, size in
                          (row["poll_experiment"], row["poll_rounds"]))
        print(f"| {backend} | {int(n_arms):,} | {close_ms:,.0f} | {bare_ms:,.0f} | {row['paired_ratio']:.2f} | "
              f"{statistics.median(row['inner_update_ms']):,.0f} | {row['floor_ratio']:.2f} | "
              f"{row['update_ms']:,.0f} | {row['peak_mb']:,.0f} | {polls} |")
    if args.parts:
        print("\nParts of the close, ms (median over the timed rounds; nested calls timed apart)\n")
        labels = [label for _, _, label in CLOSE_PARTS]
        print("| backend | K | " + " | ".join(labels) + " |")
        print("|---|---:|" + "---:|" * len(labels))
        for key, row in results.items():
            if row["error"] is None and row["parts_ms"]:
                backend, n_arms = key.split("/")
                print(f"| {backend} | {int(n_arms):,} | " + " | ".join(
                    f"{statistics.median(p.get(label, 0.0) for p in row['parts_ms']):,.0f}" for label in labels) + " |")
    return results


def secure_delete_main(argv: list[str]) -> dict[str, Any]:
    """``python bench/serve.py secure-delete``: on SQLite (WAL, synchronous=NORMAL, as the service opens
    it), a packed document the size of the round's summary input at ``--arms`` (22 arrays of K
    float64, base64) written into a row and then cleared, as the close and its summary do, with
    ``PRAGMA secure_delete`` on (Debian's build default) and FAST (the service's), alternating;
    milliseconds of the clear per setting and the median paired ratio."""
    import base64
    import sqlite3

    parser = argparse.ArgumentParser(prog="bench/serve.py secure-delete")
    parser.add_argument("--arms", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args(argv)
    text = base64.b64encode(np.random.default_rng(0).random(22 * args.arms).tobytes()).decode()
    times: dict[str, list[float]] = {"1": [], "FAST": []}
    with tempfile.TemporaryDirectory(prefix="pasto-bench-secure-delete-") as workdir:
        for repeat in range(args.repeats):
            for mode in (("1", "FAST") if repeat % 2 == 0 else ("FAST", "1")):
                connection = sqlite3.connect(Path(workdir) / f"{mode}-{repeat}.sqlite", isolation_level=None)
                for pragma in ("journal_mode=WAL", "synchronous=NORMAL", f"secure_delete={mode}"):
                    connection.execute(f"PRAGMA {pragma}")
                connection.execute("CREATE TABLE rounds (id INTEGER PRIMARY KEY, summary_input TEXT, summary TEXT)")
                for statement, parameters in (("INSERT INTO rounds VALUES (1, ?, NULL)", (text,)),
                                              ("UPDATE rounds SET summary_input = NULL, summary = '{}' WHERE id = 1", ())):
                    started = time.perf_counter()
                    connection.execute("BEGIN IMMEDIATE")
                    connection.execute(statement, parameters)
                    connection.execute("COMMIT")
                    seconds = time.perf_counter() - started
                connection.close()
                times[mode].append(seconds * 1000)  # the clear
    ratio = statistics.median(on / fast for on, fast in zip(times["1"], times["FAST"]))
    print(f"\nSQLite {sqlite3.sqlite_version}, a {len(text) / 2**20:.1f} MB summary input cleared; medians of "
          f"{args.repeats}\n")
    print("| K | clear, secure_delete on, ms | clear, FAST, ms | **on / FAST** (paired) |")
    print("|---:|---:|---:|---:|")
    print(f"| {args.arms:,} | {statistics.median(times['1']):,.0f} | {statistics.median(times['FAST']):,.0f} | "
          f"**{ratio:.1f}** |")
    return {"times": times, "ratio": ratio}


def best_arm_main(argv: list[str]) -> dict[str, Any]:
    """``python bench/serve.py best-arm``: ``pasto.serving.best_arm_probabilities`` at large K, its draws
    by levels (the path from ``_BEST_ARM_LEVELS_FROM`` arms on) against every arm scored in every draw
    (the path below it), on the posterior of the close benchmark's data after ``--rounds`` rounds
    (K arms, M = 5, the soft-guardrail objective); the two alternate (A/B, then B/A), ratio per pair."""
    from pasto import serving
    from pasto.estimators import Statistics
    from pasto.objectives import Objective

    parser = argparse.ArgumentParser(prog="bench/serve.py best-arm")
    parser.add_argument("--arms", type=_parse_list, default=[10_000, 100_000])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of synthetic statistics pooled")
    parser.add_argument("--repeats", type=int, default=4, help="pairs per K")
    args = parser.parse_args(argv)
    objective = Objective.from_spec(list(METRICS), OBJECTIVE)
    results: dict[str, Any] = {}
    saved = serving._BEST_ARM_LEVELS_FROM
    try:
        for n_arms in args.arms:
            rng = np.random.default_rng(0)
            means = rng.uniform(-1.0, 1.0, (len(METRICS), n_arms))
            pooled = Statistics.zeros(len(METRICS), n_arms)
            for _ in range(args.rounds):
                pooled = pooled + synthetic_statistics(rng, means, 3)
            posterior = serving.arm_posterior(pooled)
            thresholds = objective.thresholds(posterior.means)
            rows = []
            for repeat in range(args.repeats):
                times = {}
                for path in (("every", "levels") if repeat % 2 == 0 else ("levels", "every")):
                    serving._BEST_ARM_LEVELS_FROM = 10**12 if path == "every" else saved
                    started = time.perf_counter()
                    serving.best_arm_probabilities(objective, posterior.means, posterior.standard_errors, thresholds,
                                                   np.random.default_rng(repeat))
                    times[path] = (time.perf_counter() - started) * 1000
                rows.append(times)
                print(f"K = {n_arms:,} pair {repeat}: every arm {times['every']:,.0f} ms, "
                      f"levels {times['levels']:,.0f} ms", flush=True)
            results[n_arms] = rows
    finally:
        serving._BEST_ARM_LEVELS_FROM = saved
    print(f"\nbest_arm_probabilities, M = {len(METRICS)}, {args.rounds} rounds of data; medians over {args.repeats} pairs\n")
    print("| K | every arm scored, ms | draws by levels, ms | **every arm / levels** (paired) |")
    print("|---:|---:|---:|---:|")
    for n_arms, rows in results.items():
        every = statistics.median(r["every"] for r in rows)
        levels = statistics.median(r["levels"] for r in rows)
        ratio = statistics.median(r["every"] / r["levels"] for r in rows)
        print(f"| {n_arms:,} | {every:,.0f} | {levels:,.0f} | **{ratio:.1f}** |")
    return results


def main(argv: list[str] | None = None, docs: Path = DOCS) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_server"]:
        raise SystemExit(_server_main(json.loads(argv[1])))
    if argv[:1] == ["history"]:
        return history_main(argv[1:], docs)
    if argv[:1] == ["diagnostics-solve"]:
        return diagnostics_solve_main(argv[1:])
    if argv[:1] == ["assign"]:
        return assign_main(argv[1:])
    if argv[:1] == ["close"]:
        return close_main(argv[1:])
    if argv[:1] == ["best-arm"]:
        return best_arm_main(argv[1:])
    if argv[:1] == ["secure-delete"]:
        return secure_delete_main(argv[1:])
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.segmented_close:
        args.load_before = os.getloadavg()[0]
        args.postgres_note = None
        if args.quick:
            args.backends, args.segments, args.update_rounds = "sqlite", 5, 3
        return run_segmented_close(args, docs)
    if args.quick:
        args.backends, args.requests, args.seconds, args.repeats = "sqlite", 100, 0.5, 1
        args.batches, args.update_arms, args.update_rounds = 2, [100], 5
    args.load_before = os.getloadavg()[0]
    args.postgres_note = None
    started = time.monotonic()
    loadgen = LoadGenerator(args.clients)  # forked first: the clients inherit no database state
    cluster = None
    all_results: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="pasto-bench-serve-") as workdir:
            for name in [b.strip() for b in args.backends.split(",") if b.strip()]:
                if name == "sqlite":
                    backend = Backend("sqlite", Path(workdir))
                elif name == "postgres":
                    server_url, cluster = _postgres_server(args)
                    if server_url is None:
                        print("No PostgreSQL server (set PASTO_BENCH_POSTGRES_URL or install Debian's postgresql); "
                              "skipping it.", file=sys.stderr)
                        continue
                    backend = Backend("postgres", Path(workdir), server_url)
                    args.postgres_note = (
                        "PostgreSQL " + ("is a private loopback cluster started for the run (bench/pgcluster.py: "
                                         f"fsync=off, synchronous_commit=off, full_page_writes=off; {_server_version(server_url)}), "
                                         "so its absolute write figures are optimistic for a durable server."
                                         if cluster is not None else f"is the server at PASTO_BENCH_POSTGRES_URL "
                                         f"({_server_version(server_url)})."))
                else:
                    raise SystemExit(f"Unknown backend {name!r}: use sqlite or postgres.")
                label = "SQLite" if name == "sqlite" else "PostgreSQL"
                try:
                    all_results[label] = run_backend(backend, loadgen, args)
                    if name == "sqlite" and args.gunicorn:
                        all_results[label]["gunicorn"] = run_gunicorn(backend, loadgen, args)
                finally:
                    backend.close()
        update_alone = {}
        for n_arms in args.update_arms:
            for preset in ("default", "paper"):
                update_alone[f"{n_arms}/{preset}"] = measure_update_alone(n_arms, preset, max(args.update_rounds, 10))
    finally:
        loadgen.close()
        if cluster is not None:
            cluster.stop()
    command = "python bench/serve.py " + " ".join(argv)
    section = render(all_results, update_alone, command.strip(), args, time.monotonic() - started)
    print(section)
    if args.json:
        args.json.write_text(json.dumps({"results": all_results, "update_alone": update_alone}, indent=1,
                                        default=str) + "\n")
    if args.write_docs:
        _client_bench.write_section(section, docs)
        print(f"Wrote the Serving section of {docs}.")
    return {"results": all_results, "update_alone": update_alone, "section": section}


_client_bench = _load("pasto_bench_client", ROOT / "bench" / "client.py")
_pgcluster = _load("pasto_bench_pgcluster", ROOT / "bench" / "pgcluster.py")

if __name__ == "__main__":
    main()
