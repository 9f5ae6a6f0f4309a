"""SQLite ingestion rate over a long stream into one experiment: does it decay, and where.

Ingests ``--observations`` observations (default 10^6) into one experiment on a fresh SQLite file in
batches of ``--batch`` (1,000), in-process through the Flask test client (the HTTP layer is not what
decays), and prints the rate of each 10% slice and the ratio of the last slice's rate to the first's
(target: >= 0.8). Ids are random UUID-like strings, units UUID-like strings drawn from
a population of 10^6, five metrics per observation (the workload of ``bench/serve.py``). Only the
POSTs are timed: the request bodies are built before each one's clock starts.

``--pragma NAME=VALUE`` (repeatable) runs an extra ``PRAGMA`` on every connection after pasto's own
(``service.db._configure_sqlite``), to measure a hypothesis against the same run without it, e.g.
``--pragma cache_size=-2000`` restores SQLite's default page cache. The pages the ingestion tables
and their indexes take are printed at the end (``dbstat``, when the SQLite build has it).

    .venv/bin/python bench/sqlite_decay.py                        # the bench row (about 2-3 minutes)
    .venv/bin/python bench/sqlite_decay.py --observations 200000  # quicker, for development
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import sys
import tempfile
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import migrations  # noqa: E402
from service import create_app  # noqa: E402
from service.controller.retention import prune  # noqa: E402
from service.bootstrap import get_uow  # noqa: E402
from service.db import get_db  # noqa: E402
from service.models import utcnow  # noqa: E402

ADMIN_TOKEN = "bench-sqlite-decay-admin-token"
EXPERIMENT = "decay"
METRICS = ("watch_time", "likes", "skips", "shares", "latency")
UNIT_POPULATION = 1_000_000
SLICES = 10


def experiment_body(n_arms: int) -> dict:
    return {
        "name": EXPERIMENT,
        "arms": [{"name": f"setting-{k}", "params": {"w": k / n_arms}} for k in range(n_arms)],
        "metrics": list(METRICS),
        "objective": {"primary": {"watch_time": 1.0, "likes": 0.5},
                      "guardrails": [{"metric": "skips", "threshold": -0.2, "penalty": 5.0}]},
        "round_seconds": 86_400,
        "seed": 20260101,
    }


def uuid_like(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def batch_body(rng: random.Random, size: int, round_index: int = 0) -> bytes:
    """One request body: ``size`` observations with random UUID-like ids and units, all five metrics."""
    observations = []
    for _ in range(size):
        unit = uuid.UUID(int=random.Random(rng.randrange(UNIT_POPULATION)).getrandbits(128), version=4)
        observations.append({"id": uuid_like(rng), "unit": f"user-{unit}", "round": round_index,
                             "values": {metric: round(rng.gauss(0.0, 1.0), 6) for metric in METRICS}})
    return json.dumps({"observations": observations}).encode()


def written_bytes() -> int:
    """Bytes this process has caused to be written to storage (Linux ``/proc/self/io``; 0 elsewhere)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def table_pages(engine: sa.Engine) -> dict[str, int]:
    """Pages of each table and index of the ingestion tables (empty if SQLite lacks ``dbstat``)."""
    try:
        with engine.connect() as connection:
            rows = connection.exec_driver_sql(
                "SELECT name, count(*) FROM dbstat WHERE name LIKE '%observation_ids%' "
                "OR name LIKE '%round_units%' GROUP BY name ORDER BY name").all()
    except sa.exc.OperationalError:
        return {}
    return {name: pages for name, pages in rows}


def without_rowid(path: Path) -> None:
    """Hypothesis test: rebuild ``observation_ids`` and ``round_units`` as WITHOUT ROWID tables."""
    connection = sqlite3.connect(path)
    for table, columns in (("observation_ids", "experiment_id INTEGER NOT NULL, client_id VARCHAR(256) NOT NULL, "
                                               "round_index INTEGER NOT NULL, arm_index INTEGER NOT NULL, "
                                               "PRIMARY KEY (experiment_id, client_id)"),
                           ("round_units", "experiment_id INTEGER NOT NULL, round_index INTEGER NOT NULL, "
                                           "unit VARCHAR(256) NOT NULL, arm_index INTEGER NOT NULL, "
                                           "PRIMARY KEY (experiment_id, round_index, unit)")):
        connection.executescript(f"DROP TABLE {table}; CREATE TABLE {table} ({columns}) WITHOUT ROWID;")
    connection.close()


def run(observations: int, batch: int, n_arms: int, pragmas: list[str], folder: Path,
        page_size: int | None = None, rowid: bool = True, prune_every: int | None = None) -> dict:
    url = f"sqlite:///{folder / 'decay.sqlite'}"
    if page_size:  # only a new, empty file takes a page size (before WAL mode, which fixes it)
        sqlite3.connect(folder / "decay.sqlite").execute(f"PRAGMA page_size={page_size}").connection.execute(
            "VACUUM").connection.close()
    migrations.upgrade(url)
    if not rowid:
        without_rowid(folder / "decay.sqlite")
    app = create_app({"PASTO_DATABASE_URL": url, "PASTO_ADMIN_TOKEN": ADMIN_TOKEN})
    engine = get_db(app).engine
    if pragmas:
        @sa.event.listens_for(engine, "connect")
        def extra_pragmas(dbapi_connection, _record):
            cursor = dbapi_connection.cursor()
            for pragma in pragmas:
                cursor.execute(f"PRAGMA {pragma}")
            cursor.close()
        engine.dispose()  # connections opened before the listener existed would miss the pragmas
    client = app.test_client()
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"}
    created = client.post("/api/v1/experiments", json=experiment_body(n_arms), headers=headers)
    if created.status_code != 201:
        raise SystemExit(f"Creating the experiment failed: {created.status_code} {created.get_data(as_text=True)}")
    path = f"/api/v1/experiments/{EXPERIMENT}/observations"
    rng = random.Random(20261123)
    batches = observations // batch
    per_slice = batches // SLICES
    if per_slice == 0:
        raise SystemExit(f"--observations must be at least {SLICES} batches ({SLICES * batch}).")
    slice_seconds = [0.0] * SLICES
    slice_cpu = [0.0] * SLICES
    slice_bytes = [0] * SLICES
    accepted = 0
    round_index = 0
    for index in range(per_slice * SLICES):
        body = batch_body(rng, batch, round_index)
        start, cpu_start, bytes_start = time.perf_counter(), time.process_time(), written_bytes()
        answer = client.post(path, data=body, headers=headers)
        if prune_every and (index + 1) * batch % prune_every == 0:
            # Retention as the scheduler runs it, timed with the stream: close the round, then prune
            # every applied round (retention 0 s), chunk by chunk until nothing is left.
            closed = client.post(f"/api/v1/experiments/{EXPERIMENT}/rounds", headers=headers)
            if closed.status_code != 200:
                raise SystemExit(f"Closing round {round_index} failed: {closed.get_data(as_text=True)}")
            round_index += 1
            while not prune(get_uow(app), utcnow(), 0.0).finished:
                pass
        slice_seconds[index // per_slice] += time.perf_counter() - start
        slice_cpu[index // per_slice] += time.process_time() - cpu_start
        slice_bytes[index // per_slice] += written_bytes() - bytes_start
        if answer.status_code != 202:
            raise SystemExit(f"Batch {index} was refused: {answer.status_code} {answer.get_data(as_text=True)}")
        accepted += answer.get_json()["accepted"]
    rates = [per_slice * batch / seconds for seconds in slice_seconds]
    database_file = folder / "decay.sqlite"
    result = {"observations": per_slice * SLICES * batch, "accepted": accepted, "rates": rates,
              "cpu_us": [seconds / (per_slice * batch) * 1e6 for seconds in slice_cpu],
              "written_kb": [written / (per_slice * batch) / 1024 for written in slice_bytes],
              "ratio": rates[-1] / rates[0],
              "seconds": sum(slice_seconds), "cpu_seconds": sum(slice_cpu), "pages": table_pages(engine),
              "file_mb": database_file.stat().st_size / 2**20}
    engine.dispose()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--observations", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=1_000, help="observations per request")
    parser.add_argument("--arms", type=int, default=10)
    parser.add_argument("--pragma", action="append", default=[], metavar="NAME=VALUE",
                        help="an extra PRAGMA on every connection (repeatable)")
    parser.add_argument("--page-size", type=int, help="hypothesis: create the file with this page size")
    parser.add_argument("--without-rowid", action="store_true",
                        help="hypothesis: rebuild observation_ids and round_units WITHOUT ROWID before ingesting")
    parser.add_argument("--prune-every", type=int, metavar="N",
                        help="retention: close the round every N observations and prune the ids of applied rounds "
                             "(PASTO_RETENTION_SECONDS=0), timed with the stream")
    parser.add_argument("--folder", type=Path, help="where the SQLite file goes (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        result = run(args.observations, args.batch, args.arms, args.pragma, Path(folder), args.page_size,
                     not args.without_rowid, args.prune_every)
    print(f"SQLite ingestion, {result['observations']:,} observations in batches of {args.batch:,} into one "
          f"experiment ({result['accepted']:,} accepted){', pragmas ' + ', '.join(args.pragma) if args.pragma else ''}"
          f"{f', page size {args.page_size}' if args.page_size else ''}{', WITHOUT ROWID' if args.without_rowid else ''}"
          f"{f', round closed and ids pruned every {args.prune_every:,}' if args.prune_every else ''}")
    print("  slice (% of the stream)   observations/s   CPU us/observation   written KB/observation")
    for position, rate in enumerate(result["rates"]):
        print(f"  {position + 1:2d} ({position * 10:3d}-{position * 10 + 10:3d}%)   {rate:18,.0f}   "
              f"{result['cpu_us'][position]:18.0f}   {result['written_kb'][position]:22.1f}")
    cpu = result["cpu_us"]
    print(f"last/first slice rate: {result['ratio']:.2f}; by CPU time per observation: {cpu[0] / cpu[-1]:.2f}  (database file {result['file_mb']:.0f} MB)")
    print(f"ingestion: {result['seconds']:.1f} s wall, {result['cpu_seconds']:.1f} s CPU "
          f"({result['observations'] / result['seconds']:,.0f} observations/s overall)")
    for name, pages in result["pages"].items():
        print(f"  {name}: {pages:,} pages")


if __name__ == "__main__":
    main()
