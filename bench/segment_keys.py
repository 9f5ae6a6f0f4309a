"""Statistics keyed by segment (migration 0017) beside 0016's layout: the statistics SQL alone, paired.

0016 kept an unsegmented experiment's statistics under the keys (round, arm, metric) / (metric, arm), and a
segmented experiment's twice: summed over segments under those keys, and per segment in ``segment_*`` tables.
0017 has one set of tables with ``segment_index`` in every key: segment 0 for an unsegmented experiment, the
per-segment rows only for a segmented one, whose totals over segments are read as sums. This script runs the
statements the service runs on each layout, in one scratch database per backend (tables of its own, the
DDL of the migrations), round by round with the two layouts alternating, and reports per statement group
the median milliseconds and the median of the paired ratios 0017 / 0016:

``ingest``   one round's cells upserted (``count = count + excluded.count``, as ``store.add_statistics``);
             segmented on 0016: the per-segment cells and their sums over segments, in one transaction
``fold``     the round folded into the running totals (``store.fold_statistics``), each layout's tables
``read``     the round's cells and the totals read back (``store.update_statistics``); a segmented
             experiment's totals over segments are then a numpy sum of the (S, M, K) totals on 0017 (not
             timed: microseconds), where 0016 read its summed rows too
``history``  (segmented) the round history's page of every round so far: cells per (round, metric, arm)
             summed over segments and the traffic per (round, segment, metric) (``store.round_history``,
             ``store.segment_round_traffic``)

The totals read back from the two layouts are checked equal (counts exactly) at the end. SQLite always;
PostgreSQL too with ``--postgres`` (``PASTO_BENCH_POSTGRES_URL`` or a private loopback cluster,
``bench/pgcluster.py``). ``--write-docs`` replaces the "## Statistics keyed by segment" section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import pgcluster  # noqa: E402

DOCS = ROOT / "docs" / "benchmarks.md"
HEADING = "## Statistics keyed by segment"
VALUES = "count BIGINT NOT NULL, sum DOUBLE PRECISION NOT NULL, sum_of_squares DOUBLE PRECISION NOT NULL"
UNSEGMENTED, SEGMENTED = 1, 2  # experiment ids


def create_tables(connection) -> None:
    """0016's statistics tables (``*_16``, with the ``segment_*`` ones) and 0017's (``*_17``)."""
    for name, keys in (("round_16", "round_index, arm_index, metric_index"), ("pooled_16", "metric_index, arm_index"),
                       ("segment_round_16", "round_index, segment_index, arm_index, metric_index"),
                       ("segment_pooled_16", "segment_index, metric_index, arm_index"),
                       ("round_17", "round_index, segment_index, arm_index, metric_index"),
                       ("pooled_17", "segment_index, metric_index, arm_index")):
        columns = ", ".join(f"{key} INTEGER NOT NULL" for key in ["experiment_id", *keys.split(", ")])
        connection.exec_driver_sql(f"CREATE TABLE {name} ({columns}, {VALUES}, PRIMARY KEY (experiment_id, {keys}))")


class Layout:
    """The statements of one layout on a raw DBAPI connection (``{p}``: the driver's placeholder)."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.p = "%s" if engine.dialect.name == "postgresql" else "?"

    def run(self, statements: list[tuple[str, list | tuple]]) -> tuple[float, list]:
        """Seconds of ``statements`` in one transaction, and the rows of the last one (if it reads)."""
        connection = self.engine.raw_connection()
        try:
            cursor = connection.cursor()
            started = time.perf_counter()
            rows: list = []
            for sql, parameters in statements:
                if isinstance(parameters, list) and not parameters:
                    continue  # no cells
                sql = sql.format(p=self.p)
                if parameters and isinstance(parameters[0], tuple):
                    cursor.executemany(sql, parameters)
                else:
                    cursor.execute(sql, parameters)
                    if sql.lstrip().startswith("SELECT"):
                        rows.append(cursor.fetchall())
            connection.commit()
            return time.perf_counter() - started, rows
        finally:
            connection.close()


def upsert(table: str, keys: str, rows: list[tuple]) -> tuple[str, list]:
    columns = f"experiment_id, {keys}, count, sum, sum_of_squares"
    marks = ", ".join(["{p}"] * (len(keys.split(", ")) + 4))
    return (f"INSERT INTO {table} ({columns}) VALUES ({marks}) ON CONFLICT (experiment_id, {keys}) DO UPDATE SET "
            f"count = {table}.count + excluded.count, sum = {table}.sum + excluded.sum, "
            f"sum_of_squares = {table}.sum_of_squares + excluded.sum_of_squares", rows)


def fold(rounds: str, pooled: str, keys: str, experiment: int, round_index: int) -> tuple[str, tuple]:
    return (f"INSERT INTO {pooled} (experiment_id, {keys}, count, sum, sum_of_squares) SELECT {experiment}, {keys}, "
            f"SUM(count), SUM(sum), SUM(sum_of_squares) FROM {rounds} WHERE experiment_id = {experiment} "
            f"AND round_index = {{p}} GROUP BY {keys} ORDER BY {keys} ON CONFLICT (experiment_id, {keys}) DO UPDATE "
            f"SET count = {pooled}.count + excluded.count, sum = {pooled}.sum + excluded.sum, "
            f"sum_of_squares = {pooled}.sum_of_squares + excluded.sum_of_squares", (round_index,))


def read(table: str, keys: str, experiment: int, round_index: int | None = None) -> tuple[str, tuple]:
    where = f"experiment_id = {experiment}" + ("" if round_index is None else " AND round_index = {p}")
    return (f"SELECT {keys}, count, sum, sum_of_squares FROM {table} WHERE {where}",
            () if round_index is None else (round_index,))


def measure(engine: sa.Engine, n_arms: int, n_segments: int, rounds: int, seed: int = 0) -> dict:
    with engine.begin() as connection:
        create_tables(connection)
    layout = Layout(engine)
    rng = np.random.default_rng(seed)
    n_metrics = 5
    times: dict[str, dict[str, list[float]]] = {}

    def timed(label: str, side: str, statements) -> list:
        seconds, rows = layout.run(statements)
        times.setdefault(label, {"16": [], "17": []})[side].append(seconds * 1000)
        return rows

    for round_index in range(rounds):
        counts = rng.integers(0, 4, (n_segments, n_metrics, n_arms))
        sums = np.round(rng.normal(size=counts.shape) * 4) / 4 * (counts > 0)
        squares = sums ** 2 + counts
        cell = [(s, m, k, int(counts[s, m, k]), float(sums[s, m, k]), float(squares[s, m, k]))
                for s, m, k in zip(*(axis.tolist() for axis in np.nonzero(counts)))]
        summed = [(m, k, int(counts[:, m, k].sum()), float(sums[:, m, k].sum()), float(squares[:, m, k].sum()))
                  for m, k in zip(*(axis.tolist() for axis in np.nonzero(counts.sum(axis=0))))]
        one = [(m, k, c, t, q) for s, m, k, c, t, q in cell if s == 0]  # the unsegmented experiment: segment 0's
        for side in (("16", "17") if round_index % 2 == 0 else ("17", "16")):
            if side == "16":
                timed("unsegmented ingest", side, [upsert("round_16", "round_index, arm_index, metric_index", [
                    (UNSEGMENTED, round_index, k, m, c, t, q) for m, k, c, t, q in sorted(one, key=lambda r: r[1::-1])])])
                timed("unsegmented fold", side, [fold("round_16", "pooled_16", "metric_index, arm_index", UNSEGMENTED,
                                                      round_index)])
                timed("unsegmented read", side, [read("round_16", "metric_index, arm_index", UNSEGMENTED, round_index),
                                                 read("pooled_16", "metric_index, arm_index", UNSEGMENTED)])
                timed("segmented ingest", side, [
                    upsert("segment_round_16", "round_index, segment_index, arm_index, metric_index",
                           [(SEGMENTED, round_index, s, k, m, c, t, q) for s, m, k, c, t, q in sorted(cell, key=lambda r: (r[0], r[2], r[1]))]),
                    upsert("round_16", "round_index, arm_index, metric_index",
                           [(SEGMENTED, round_index, k, m, c, t, q) for m, k, c, t, q in sorted(summed, key=lambda r: r[1::-1])])])
                timed("segmented fold", side, [
                    fold("segment_round_16", "segment_pooled_16", "segment_index, metric_index, arm_index", SEGMENTED,
                         round_index),
                    fold("round_16", "pooled_16", "metric_index, arm_index", SEGMENTED, round_index)])
                timed("segmented read", side, [
                    read("segment_round_16", "segment_index, metric_index, arm_index", SEGMENTED, round_index),
                    read("segment_pooled_16", "segment_index, metric_index, arm_index", SEGMENTED),
                    read("pooled_16", "metric_index, arm_index", SEGMENTED)])
                timed("segmented history", side, [
                    (f"SELECT round_index, metric_index, arm_index, count, sum FROM round_16 WHERE experiment_id = "
                     f"{SEGMENTED}", ()),
                    (f"SELECT round_index, segment_index, metric_index, SUM(count) FROM segment_round_16 WHERE "
                     f"experiment_id = {SEGMENTED} GROUP BY round_index, segment_index, metric_index", ())])
            else:
                keys = "round_index, segment_index, arm_index, metric_index"
                timed("unsegmented ingest", side, [upsert("round_17", keys, [
                    (UNSEGMENTED, round_index, 0, k, m, c, t, q) for m, k, c, t, q in sorted(one, key=lambda r: r[1::-1])])])
                timed("unsegmented fold", side, [fold("round_17", "pooled_17", "segment_index, metric_index, arm_index",
                                                      UNSEGMENTED, round_index)])
                timed("unsegmented read", side, [
                    read("round_17", "segment_index, metric_index, arm_index", UNSEGMENTED, round_index),
                    read("pooled_17", "segment_index, metric_index, arm_index", UNSEGMENTED)])
                timed("segmented ingest", side, [upsert("round_17", keys, [
                    (SEGMENTED, round_index, s, k, m, c, t, q) for s, m, k, c, t, q in sorted(cell, key=lambda r: (r[0], r[2], r[1]))])])
                timed("segmented fold", side, [fold("round_17", "pooled_17", "segment_index, metric_index, arm_index",
                                                    SEGMENTED, round_index)])
                timed("segmented read", side, [
                    read("round_17", "segment_index, metric_index, arm_index", SEGMENTED, round_index),
                    read("pooled_17", "segment_index, metric_index, arm_index", SEGMENTED)])
                timed("segmented history", side, [
                    (f"SELECT round_index, metric_index, arm_index, SUM(count), SUM(sum) FROM round_17 WHERE "
                     f"experiment_id = {SEGMENTED} GROUP BY round_index, arm_index, metric_index", ()),
                    (f"SELECT round_index, segment_index, metric_index, SUM(count) FROM round_17 WHERE "
                     f"experiment_id = {SEGMENTED} GROUP BY round_index, segment_index, metric_index", ())])
    # Both layouts hold the same totals.
    totals = {}
    for name, sql in (("16", f"SELECT metric_index, arm_index, SUM(count) FROM pooled_16 WHERE experiment_id = {SEGMENTED} "
                             "GROUP BY metric_index, arm_index ORDER BY metric_index, arm_index"),
                      ("17", f"SELECT metric_index, arm_index, SUM(count) FROM pooled_17 WHERE experiment_id = {SEGMENTED} "
                             "GROUP BY metric_index, arm_index ORDER BY metric_index, arm_index")):
        with engine.connect() as connection:
            totals[name] = [tuple(int(v) for v in row) for row in connection.exec_driver_sql(sql)]
    if totals["16"] != totals["17"] or not totals["16"]:
        raise SystemExit("The two layouts' totals over segments differ.")
    report = {}
    for label, sides in times.items():
        old, new = sides["16"][1:] or sides["16"], sides["17"][1:] or sides["17"]  # the first round warms up
        report[label] = {"0016_ms": statistics.median(old), "0017_ms": statistics.median(new),
                         "ratio": statistics.median(b / a for a, b in zip(old, new))}
    return report


def render(results: dict, command: str, args, seconds: float) -> str:
    load = os.getloadavg()[0]
    lines = [HEADING, "",
             f"The statistics SQL of migration 0017's layout (`segment_index` in every key, one set of tables) beside "
             f"0016's (an unsegmented key; a segmented experiment's cells also summed over segments), paired round by "
             f"round in one scratch database per backend: K = {args.arms}, M = 5, S = {args.segments} segments for the "
             f"segmented experiment, {args.rounds} rounds (the first a warm-up). Ratio: median of the paired "
             f"0017 / 0016 ratios. Measured with:", "", "```", command, "```", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other work, "
             f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {seconds:.0f} s; load average {load:.1f} after.", "",
             "| backend | statements | 0016 ms | 0017 ms | 0017 / 0016 |", "|---|---|---:|---:|---:|"]
    for backend, report in results.items():
        for label, row in report.items():
            lines.append(f"| {backend} | {label} | {row['0016_ms']:.1f} | {row['0017_ms']:.1f} | {row['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def write_section(section: str, path: Path) -> None:
    text = path.read_text()
    if HEADING in text:
        start = text.index(HEADING)
        following = text.find("\n## ", start + len(HEADING))
        text = text[:start] + section + ("" if following < 0 else "\n" + text[following + 1:])
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main(argv: list[str] | None = None, docs: Path = DOCS) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", type=int, default=100)
    parser.add_argument("--segments", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--postgres", action="store_true")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    started = time.monotonic()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="pasto-bench-segment-keys-") as workdir:
        engine = sa.create_engine(f"sqlite:///{workdir}/keys.sqlite")
        try:
            results["SQLite"] = measure(engine, args.arms, args.segments, args.rounds)
        finally:
            engine.dispose()
    if args.postgres:
        cluster = None
        url = os.environ.get("PASTO_BENCH_POSTGRES_URL")
        if url is None and pgcluster.postgres_bin_dir() is not None:
            cluster = pgcluster.Cluster(pgcluster.postgres_bin_dir())
            cluster.start()
            url = cluster.url
        try:
            if url is None:
                print("No PostgreSQL server; skipping it.", file=sys.stderr)
            else:
                database = f"pasto_bench_keys_{os.getpid()}"
                admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
                with admin.connect() as connection:
                    connection.exec_driver_sql(f'CREATE DATABASE "{database}"')
                engine = sa.create_engine(f"{url.rpartition('/')[0]}/{database}")
                try:
                    results["PostgreSQL"] = measure(engine, args.arms, args.segments, args.rounds)
                finally:
                    engine.dispose()
                    with admin.connect() as connection:
                        connection.exec_driver_sql(f'DROP DATABASE "{database}"')
                    admin.dispose()
        finally:
            if cluster is not None:
                cluster.stop()
    command = "python bench/segment_keys.py " + " ".join(argv if argv is not None else sys.argv[1:])
    section = render(results, command.strip(), args, time.monotonic() - started)
    print(section)
    if args.write_docs:
        write_section(section, docs)
    return results


if __name__ == "__main__":
    main()
