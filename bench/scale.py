"""Round statistics from 10^6..10^8 events on DuckDB and Spark local: pasto's source step vs the bare query.

For each engine and size N, one round's events (Parquet, written by DuckDB itself) are turned into
the round's per-(arm, metric) statistics twice, alternately, in the same run:

``pasto``
    the whole source step the scheduler runs: ``parse_source`` of the declaration (a table mapping),
    ``fetch_round_statistics`` (SQLAlchemy engine or SparkSession, file views, the generated GROUP BY,
    the rows checked and shaped into ``pasto.estimators.Statistics`` + units).
``bare``
    the same aggregation written by hand as one SQL text and run through the engine's own Python API
    (``duckdb.connect().execute(...).fetchall()``, ``spark.sql(...).collect()``): what a team would
    run without pasto.

Both read the same files and compute the same attribution (the first exposure of each unit in the
round, events in the window and not before it; see service/sources/query.py). The figure is the
best of ``--repeats`` passes of each; the ratio pasto/bare of the rates is the overhead of pasto's
step (target >= 0.8). Events per day = the pasto rate x 86,400 s: what one node like this one turns
into round statistics if it does nothing else.

Run: ``python bench/scale.py --write-docs`` (replaces the "## Scale" section of docs/benchmarks.md;
about 10 minutes with 10^8 events on 2 cores, and about 2.5 GB of Parquet in ``--data-dir``).
``--quick`` runs 10^5 events on DuckDB only (seconds; the test of this script).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shutil
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.sources import RoundWindow, fetch_round_statistics, parse_source  # noqa: E402

DOCS = ROOT / "docs" / "benchmarks.md"
EXPERIMENT = "scale"
N_ARMS = 10
METRICS = ("x", "y")
ARMS = tuple(f"arm-{k}" for k in range(N_ARMS))
START = datetime(2026, 3, 1, tzinfo=timezone.utc)
ROUND = timedelta(hours=1)
EVENTS_PER_UNIT = 50

#: The hand-written aggregation (the baseline): the same rule as pasto's generated query.
BARE_SQL = """
SELECT r.arm, count(DISTINCT r.unit) AS units,
       count(e.x) AS count_0, sum(e.x) AS sum_0, sum(e.x * e.x) AS sum_of_squares_0,
       count(e.y) AS count_1, sum(e.y) AS sum_1, sum(e.y * e.y) AS sum_of_squares_1
FROM (SELECT unit, arm, ts, row_number() OVER (PARTITION BY unit ORDER BY ts, arm) AS exposure_rank
      FROM exposures WHERE experiment = 'scale' AND round = 0) r
JOIN events e ON e.unit = r.unit AND r.exposure_rank = 1
 AND e.ts >= TIMESTAMP '2026-03-01 00:00:00' AND e.ts < TIMESTAMP '2026-03-01 01:00:00' AND e.ts >= r.ts
GROUP BY r.arm
"""


def generate(folder: Path, n_events: int) -> tuple[Path, Path]:
    """Write ``n_events`` events and their units' exposures as Parquet with DuckDB (deterministic hashes)."""
    import duckdb

    folder.mkdir(parents=True, exist_ok=True)
    exposures, events = folder / "exposures.parquet", folder / "events.parquet"
    if exposures.exists() and events.exists():
        return exposures, events
    units = max(n_events // EVENTS_PER_UNIT, 1)
    connection = duckdb.connect()
    connection.execute("SET TimeZone = 'UTC'")
    connection.execute("SET preserve_insertion_order = false")
    # Every unit exposed once in the round's first 10 minutes, one in ten again later (same arm);
    # events spread over the hour and 5 minutes past it, so some are before the exposure or after the
    # window; y observed on 70% of the events.
    connection.execute(f"""
        COPY (
            SELECT 'scale' AS experiment, i AS unit, 0 AS round,
                   TIMESTAMP '2026-03-01 00:00:00' + to_seconds(i % 600) AS ts,
                   'arm-' || (hash(i) % {N_ARMS}) AS arm
            FROM range({units}) t(i)
            UNION ALL
            SELECT 'scale', i, 0, TIMESTAMP '2026-03-01 00:30:00', 'arm-' || (hash(i) % {N_ARMS})
            FROM range(0, {units}, 10) t(i)
        ) TO '{exposures}' (FORMAT parquet)""")
    connection.execute(f"""
        COPY (
            SELECT (hash(i * 3 + 1) % {units})::BIGINT AS unit,
                   TIMESTAMP '2026-03-01 00:00:00' + to_milliseconds((hash(i * 5 + 2) % 3900000)::BIGINT) AS ts,
                   ((hash(i * 7 + 3) % 100000) / 1000.0)::DOUBLE AS x,
                   CASE WHEN hash(i * 11 + 4) % 10 < 7 THEN ((hash(i * 13 + 5) % 2000) / 100.0 - 5)::DOUBLE END AS y
            FROM range({n_events}) t(i)
        ) TO '{events}' (FORMAT parquet, ROW_GROUP_SIZE 1000000)""")
    connection.close()
    return exposures, events


def declaration(engine: str, exposures: Path, events: Path, spark_master: str) -> dict:
    spec = {
        "files": {"exposures": {"path": str(exposures)}, "events": {"path": str(events)}},
        "mapping": {
            "exposures": {"table": "exposures", "unit": "unit", "arm": "arm", "experiment": "experiment",
                          "round": "round", "timestamp": "ts"},
            "events": {"table": "events", "unit": "unit", "timestamp": "ts", "metrics": {"x": "x", "y": "y"}},
        },
    }
    if engine == "spark":
        spec.update(engine="spark", url=spark_master)
    return spec


def pasto_step(spec: dict):
    source = parse_source(spec)
    return fetch_round_statistics(source, EXPERIMENT, RoundWindow(0, START, START + ROUND), ARMS, METRICS)


def bare_duckdb(exposures: Path, events: Path) -> list[tuple]:
    import duckdb

    connection = duckdb.connect()
    try:
        connection.execute("SET TimeZone = 'UTC'")
        connection.execute(f"CREATE VIEW exposures AS SELECT * FROM read_parquet('{exposures}')")
        connection.execute(f"CREATE VIEW events AS SELECT * FROM read_parquet('{events}')")
        return connection.execute(BARE_SQL).fetchall()
    finally:
        connection.close()


def bare_spark(spark, exposures: Path, events: Path) -> list[tuple]:
    spark.read.parquet(str(exposures)).createOrReplaceTempView("exposures")
    spark.read.parquet(str(events)).createOrReplaceTempView("events")
    return [tuple(row) for row in spark.sql(BARE_SQL).collect()]


def same_result(statistics, rows: list[tuple]) -> bool:
    """The pasto result and the bare rows hold the same counts (the two did the same work)."""
    total = sum(row[2] for row in rows)
    return int(statistics.statistics.counts[0].sum()) == int(total)


def measure(engine: str, n_events: int, folder: Path, repeats: int, spark, spark_master: str) -> dict:
    started = time.perf_counter()
    exposures, events = generate(folder / f"{n_events}", n_events)
    generate_seconds = time.perf_counter() - started
    spec = declaration(engine, exposures, events, spark_master)
    times = {"pasto": [], "bare": []}
    checked = True
    for _ in range(repeats):
        for side in ("bare", "pasto"):  # alternate, so drifting load hits both
            started = time.perf_counter()
            if side == "pasto":
                result = pasto_step(spec)
            elif engine == "duckdb":
                rows = bare_duckdb(exposures, events)
            else:
                rows = bare_spark(spark, exposures, events)
            times[side].append(time.perf_counter() - started)
        checked = checked and same_result(result, rows)
    best = {side: min(values) for side, values in times.items()}
    return {
        "engine": engine, "events": n_events, "generate_seconds": generate_seconds,
        "pasto_seconds": best["pasto"], "bare_seconds": best["bare"],
        "pasto_rate": n_events / best["pasto"], "bare_rate": n_events / best["bare"],
        "ratio": best["bare"] / best["pasto"], "same_result": checked,
        "attributed": int(result.statistics.counts[0].sum()), "repeats": repeats,
    }


def start_spark(master: str):
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master(master).appName("pasto-bench-scale")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "4")
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.driver.memory", "4g")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    return session


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _human(n: float) -> str:
    exponent = len(str(int(n))) - 1
    mantissa = n / 10**exponent
    return f"{mantissa:.1f}e{exponent}" if round(mantissa, 1) != 1.0 else f"1e{exponent}"


def render(rows: list[dict], command: str, args, elapsed: float, load_before: float) -> str:
    lines = [
        "## Scale",
        "",
        "Warehouse-native round statistics: one round's per-(arm, metric) count, sum and sum of "
        "squares plus distinct units per arm, from N events in Parquet, on DuckDB (in-process) and on Spark "
        f"local mode ({args.spark_master}). K = {N_ARMS} arms, M = {len(METRICS)} metrics, "
        f"{EVENTS_PER_UNIT} events per unit, every unit exposed in the round (10% twice). **pasto** is the "
        "whole source step (declaration parsed, engine opened, file views, generated GROUP BY, rows checked "
        "into `Statistics`); **bare** is the same aggregation as hand-written SQL through the engine's own "
        "Python API, alternated with it in the same run, after one unmeasured pass of each; best of the passes each.",
        "",
        f"Command: `{command}`. Machine: {platform.machine()}, {_cpu_name()}, {os.cpu_count()} cores "
        f"(shared: load average {load_before:.1f} at the start), Python {platform.python_version()}; "
        f"run took {elapsed / 60:.1f} min.",
        "",
        "| engine | events | pasto s | bare s | pasto events/s | bare events/s | pasto/bare | same counts |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row['engine']} | {_human(row['events'])} | {row['pasto_seconds']:.2f} | {row['bare_seconds']:.2f} "
            f"| {row['pasto_rate']:,.0f} | {row['bare_rate']:,.0f} | {row['ratio']:.2f} "
            f"| {'yes' if row['same_result'] else 'NO'} |")
    lines += ["", "### Events per day on one node", ""]
    for engine in ("duckdb", "spark"):
        measured = [row for row in rows if row["engine"] == engine]
        if not measured:
            continue
        largest = max(measured, key=lambda row: row["events"])
        per_day = largest["pasto_rate"] * 86_400
        lines.append(
            f"- {engine}: {per_day:.2g} events/day: {_human(largest['events'])} events in "
            f"{largest['pasto_seconds']:.1f} s through pasto's source step ({largest['pasto_rate']:,.0f} events/s), "
            "x 86,400 s, the node doing nothing else.")
    duckdb_rows = [row for row in rows if row["engine"] == "duckdb"]
    lines += ["", "### Targets (benchmark figures, not tests)", "",
              "| target | measured | met |", "| --- | --- | --- |"]
    for row in rows:
        lines.append(f"| {row['engine']} {_human(row['events'])}: pasto >= 0.8 of the bare query's rate "
                     f"| {row['ratio']:.2f} | {'yes' if row['ratio'] >= 0.8 else 'no'} |")
    largest = max(duckdb_rows, key=lambda row: row["events"]) if duckdb_rows else None
    if largest is not None and largest["events"] >= 10**8:
        lines.append(f"| a 10^8-event round closes on DuckDB in under 60 s | {largest['pasto_seconds']:.1f} s "
                     f"| {'yes' if largest['pasto_seconds'] < 60 else 'no'} |")
    lines += ["", "### Reading", "", *READING, ""]
    return "\n".join(lines)


#: What the figures mean, beyond the table (kept with the script so a re-run keeps it).
READING = [
    "- The ratio is pasto's overhead on the same engine and files: engine/session opened, file views registered, "
    "the generated query (bound parameters) and the rows checked. On DuckDB it stays within 0.8-1.0 of the bare "
    "query's rate; the whole cost of a round is the engine's aggregation itself.",
    "- On Spark pasto's side ran faster than the bare query in every pair. The two texts differ only in the "
    "window's bound parameters (`spark.sql(text, args=...)`) against literals and a no-op `CAST(... AS DOUBLE)`, "
    "and the bare query runs first in each pair; the cause was not isolated: read it as no measurable overhead, "
    "not as a speedup.",
    "- Timings are of a machine shared with seven other engineers' jobs (load average 9-14 on 2 cores during the "
    "run): absolute seconds are several times an idle machine's; the paired ratios are the robust figures. The "
    "60 s target for 10^8 events on DuckDB is missed here because the engine's own query took longer than 60 s "
    "under that load, not because of pasto's step.",
    "- A platform of 10^10 events/day with hourly rounds has about 4.2e8 events per round: at the DuckDB rate "
    "above one such node needs about 6 minutes per round, about 10% of its hour; Spark local is the step "
    "towards a cluster (Spark Connect, same SQL), not a faster single node.",
]


# One section writer for every bench script: bench/client.py's (bench/serve.py uses it too).
_spec = importlib.util.spec_from_file_location("pasto_bench_client", Path(__file__).with_name("client.py"))
_client_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_client_bench)
write_section = _client_bench.write_section


def main(argv: list[str] | None = None, docs: Path = DOCS) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000000,10000000,100000000",
                        help="comma-separated event counts (default 10^6, 10^7, 10^8)")
    parser.add_argument("--engines", default="duckdb,spark", help="comma-separated: duckdb, spark")
    parser.add_argument("--spark-sizes", default=None,
                        help="event counts for Spark when different from --sizes")
    parser.add_argument("--spark-master", default="local[2]")
    parser.add_argument("--repeats", type=int, default=3, help="passes per side below 10^8 events")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="where the Parquet files go (default: a temporary folder, removed at the end)")
    parser.add_argument("--quick", action="store_true", help="10^5 events, DuckDB only")
    parser.add_argument("--write-docs", action="store_true",
                        help="replace the '## Scale' section of docs/benchmarks.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.engines, args.spark_sizes = "100000", "duckdb", None
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    spark_sizes = [int(float(s)) for s in args.spark_sizes.split(",")] if args.spark_sizes else sizes
    engines = args.engines.split(",")
    folder = args.data_dir or Path(tempfile.mkdtemp(prefix="pasto-scale-"))
    free = shutil.disk_usage(folder.parent if not folder.exists() else folder).free
    need = max(sizes + spark_sizes) * 25  # bytes of Parquet per event, with room to spare
    if free < need:
        raise SystemExit(f"{folder} has {free / 1e9:.1f} GB free; {max(sizes):,} events need about "
                         f"{need / 1e9:.1f} GB.")
    spark = start_spark(args.spark_master) if "spark" in engines else None
    rows = []
    try:
        for engine in engines:
            engine_sizes = spark_sizes if engine == "spark" else sizes
            # One unmeasured pass of each side first: Spark's JIT and file-listing caches, DuckDB's
            # extension loading, would otherwise land on whichever side runs first.
            measure(engine, min(engine_sizes), folder, 1, spark, args.spark_master)
            for n_events in engine_sizes:
                repeats = 1 if n_events >= 10**8 else args.repeats
                row = measure(engine, n_events, folder, repeats, spark, args.spark_master)
                print(f"{engine} {n_events:,}: pasto {row['pasto_seconds']:.2f} s, bare {row['bare_seconds']:.2f} s, "
                      f"ratio {row['ratio']:.2f} (generated in {row['generate_seconds']:.1f} s)", flush=True)
                rows.append(row)
    finally:
        if spark is not None:
            spark.stop()
        if args.data_dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    command = "python bench/scale.py " + " ".join(argv if argv is not None else sys.argv[1:])
    section = render(rows, command.strip(), args, time.monotonic() - started, load_before)
    print(section)
    if args.write_docs:
        write_section(section, docs)
        print(f"Wrote the Scale section of {docs}.")
    return {"rows": rows, "section": section}


if __name__ == "__main__":
    main()
