"""Local assignment throughput: pasto's LocalAssigner against the raw hash and the GrowthBook SDK.

Measures single-threaded assignments per second, in one process and one run:

- ``hash only``: ``PrefixHasher(seed, round)(unit)``, the floor any per-call assignment pays;
- ``pasto assign``: ``LocalAssigner.assign(unit)`` (hash + bisection + a prebuilt Assignment);
- ``pasto assign_many``: ``LocalAssigner.assign_many(units)`` in batches (numpy hashing);
- ``pasto.hashing.buckets``: the hash ``assign_many`` runs, alone (what choosing the arms and
  returning one answer per unit adds is the difference);
- ``numpy batch hash``: the bare baseline of ``assign_many``: the same hash written by hand in numpy
  over the same batches (:func:`numpy_batch_hash`: fixed-width bytes, FNV-1a column by column in
  uint32 under a length mask, the finaliser), without choosing arms or returning answers;
- ``growthbook hash+choose``: the GrowthBook Python SDK's own ``gbhash`` + ``chooseVariation``;
- ``growthbook run()``: its full ``GrowthBook.run(Experiment)`` after ``set_attributes``;
- ``pasto assign + JSON-lines sink`` / ``+ Parquet sink``: ``LocalAssigner.assign`` with an exposure
  sink attached (target: at least half the rate without). Each pass makes a fresh assigner
  and file and is timed up to ``exposures.flush()``, so the writer thread's work for the pass (it
  shares the interpreter lock) is inside the timing; every pass checks that all its exposures were
  written and none dropped.

Every row assigns the same units to K arms with the same non-uniform mixture; each figure is the
best of ``--repeats`` passes over ``--units`` distinct units (best-of filters out the other
processes sharing the machine). Two unit shapes are measured: ``user-<n>`` ids (10-11 bytes) and
uuid4 strings (36 bytes): the hash is a byte loop, so throughput depends on the unit's length.

Run: ``python bench/client.py`` (``--write-docs`` replaces the "## Client" section of
docs/benchmarks.md). Needs the ``bench`` extra for the GrowthBook rows (``pip install -e '.[bench]'``)
and the ``parquet`` extra for the Parquet row.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from pasto_client import JsonLinesSink, LocalAssigner, ParquetSink
from pasto.hashing import PrefixHasher, buckets, fnv1a_32

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks.md"
SEED = 20260101
ROUND_INDEX = 42
EXPERIMENT = "ranking"


def make_experiment(n_arms: int) -> dict:
    """An experiment document like ``GET /api/v1/experiments/<name>`` returns, with a Dirichlet
    mixture so that the bisection does real work."""
    probabilities = np.random.default_rng(0).dirichlet(np.ones(n_arms)).tolist()
    return {
        "name": EXPERIMENT,
        "status": "running",
        "seed": SEED,
        "round": {"index": ROUND_INDEX, "started_at": None, "ends_at": None},
        "arms": [{"name": f"setting-{k}", "params": {"w_watch": 1.0, "w_like": k / n_arms}}
                 for k in range(n_arms)],
        "probabilities": probabilities,
        "deployed": probabilities,
        "updated_at": "2026-01-01T00:00:00.000000+00:00",
    }


def numpy_batch_hash(seed: int, round_index: int):
    """The bare batch hash of ASCII units in numpy, as a team would write it: the buckets of a batch,
    shape (N,), equal to ``pasto.hashing.buckets`` (checked in :func:`measure`)."""
    prefix = fnv1a_32(f"{seed}:{round_index}:".encode())
    prime = np.uint32(16777619)

    def hash_batch(units: list[str]) -> np.ndarray:
        matrix = np.array(units, dtype=np.bytes_)
        lengths = np.fromiter(map(len, units), dtype=np.intp, count=len(units))
        columns = matrix.view(np.uint8).reshape(len(units), matrix.dtype.itemsize).T
        h = np.full(len(units), prefix, dtype=np.uint32)
        for column in range(columns.shape[0]):
            h = np.where(lengths > column, (h ^ columns[column]) * prime, h)
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
        return h * (1.0 / 2**32)

    return hash_batch


ASSIGN = "pasto LocalAssigner.assign"
HASH_BATCH = "numpy batch hash (bare baseline of assign_many)"
BUCKETS = "pasto.hashing.buckets (assign_many's hash alone)"
SINK_ROWS = {
    "pasto LocalAssigner.assign + JSON-lines sink": ("exposures.jsonl", JsonLinesSink),
    "pasto LocalAssigner.assign + Parquet sink": ("exposures.parquet", ParquetSink),
}
#: Rows whose process CPU time is reported too: the sink ratios are given both ways.
CPU_ROWS = (ASSIGN, *SINK_ROWS)


def logged_pass(experiment: dict, units: list[str], file_name: str, make_sink) -> tuple[float, float]:
    """Wall-clock and process CPU seconds (both threads) to assign ``units`` one call at a time with
    an exposure sink writing to a fresh file, up to the moment the sink has taken every exposure
    (``flush``)."""
    with tempfile.TemporaryDirectory() as directory:
        assigner = LocalAssigner(None, EXPERIMENT, experiment=experiment,
                                 exposure_sink=make_sink(os.path.join(directory, file_name)))
        assign = assigner.assign
        start, cpu = time.perf_counter(), time.process_time()
        for unit in units:
            assign(unit)
        assigner.exposures.flush()
        seconds = time.perf_counter() - start, time.process_time() - cpu
        assigner.close()
        log = assigner.exposures
        if (log.written, log.dropped, log.failed) != (len(units), 0, 0):
            raise RuntimeError(f"The {file_name} sink wrote {log.written} of {len(units)} exposures "
                               f"({log.dropped} dropped, {log.failed} failed).")
    return seconds


def timed_pass(function, units, batch_size: int | None) -> tuple[float, float]:
    """Wall-clock and process CPU seconds for one pass of ``function`` over ``units`` (one call per
    unit, or per batch)."""
    if batch_size is None:
        start, cpu = time.perf_counter(), time.process_time()
        for unit in units:
            function(unit)
        return time.perf_counter() - start, time.process_time() - cpu
    batches = [units[i:i + batch_size] for i in range(0, len(units), batch_size)]
    start, cpu = time.perf_counter(), time.process_time()
    for batch in batches:
        function(batch)
    return time.perf_counter() - start, time.process_time() - cpu


def measure(units: list[str], n_arms: int, batch_size: int, repeats: int, batch_only: bool = False) -> dict[str, float]:
    """Assignments per second of every row on ``units`` (wall clock); the rows named in
    ``CPU_ROWS`` also get an entry ``"<row> [cpu]"``: assignments per second of process CPU time.

    The rows are timed round-robin, one pass each per repeat, and each keeps its best pass: load
    from other processes then hits every row alike instead of whichever happened to run during it.
    """
    experiment = make_experiment(n_arms)
    assigner = LocalAssigner(None, EXPERIMENT, experiment=experiment)
    hasher = PrefixHasher(SEED, ROUND_INDEX)
    rows: dict[str, tuple] = {
        "hash only (PrefixHasher)": (hasher, None),
        ASSIGN: (assigner.assign, None),
        f"pasto LocalAssigner.assign_many (batches of {batch_size})": (
            assigner.assign_many, batch_size
        ),
        HASH_BATCH: (numpy_batch_hash(SEED, ROUND_INDEX), batch_size),
        BUCKETS: (lambda batch: buckets(SEED, batch, ROUND_INDEX), batch_size),
    }
    if not np.array_equal(rows[HASH_BATCH][0](units[:batch_size]), buckets(SEED, units[:batch_size], ROUND_INDEX)):
        raise RuntimeError("The bare numpy batch hash does not give pasto's buckets.")
    if batch_only:  # the batch rows alone (at large K: GrowthBook's choice scans every arm per call)
        rows = {name: row for name, row in rows.items() if row[1] is not None}
        best = {name: min(timed_pass(function, units, size)[0] for _ in range(repeats))
                for name, (function, size) in rows.items()}
        return {name: len(units) / seconds for name, seconds in best.items()}
    growthbook = None
    try:
        from growthbook import Experiment, GrowthBook
        from growthbook.core import chooseVariation, gbhash, getBucketRanges
    except ImportError:
        print("growthbook is not installed (pip install -e '.[bench]'); skipping its rows.",
              file=sys.stderr)
    else:
        weights = experiment["probabilities"]
        ranges = getBucketRanges(n_arms, 1.0, weights)

        def growthbook_hash_and_choose(unit: str) -> int:
            return chooseVariation(gbhash(EXPERIMENT, unit, 1), ranges)

        gb_experiment = Experiment(key=EXPERIMENT, variations=list(range(n_arms)), weights=weights)
        growthbook = GrowthBook(attributes={"id": units[0]})

        def growthbook_run(unit: str) -> int:
            growthbook.set_attributes({"id": unit})
            return growthbook.run(gb_experiment).variationId

        # Same SDK path both ways: run() must pick what hash+choose picks.
        assert all(growthbook_run(u) == growthbook_hash_and_choose(u) for u in units[:100])
        rows["growthbook hash+choose (gbhash v1 + chooseVariation)"] = (
            growthbook_hash_and_choose, None
        )
        rows["growthbook GrowthBook.run()"] = (growthbook_run, None)
    passes = {name: (lambda f=function, s=size: timed_pass(f, units, s))
              for name, (function, size) in rows.items()}
    for name, (file_name, make_sink) in SINK_ROWS.items():
        try:
            make_sink(os.path.join(tempfile.gettempdir(), "pasto-bench-probe")).close()
        except ImportError as error:
            print(f"{error} Skipping the row {name!r}.", file=sys.stderr)
            continue
        finally:
            Path(tempfile.gettempdir(), "pasto-bench-probe").unlink(missing_ok=True)
        passes[name] = lambda f=file_name, m=make_sink: logged_pass(experiment, units, f, m)
    best = {name: float("inf") for name in passes}
    best_cpu = {name: float("inf") for name in passes}
    for _ in range(repeats):
        for name, one_pass in passes.items():
            wall, cpu = one_pass()
            best[name] = min(best[name], wall)
            best_cpu[name] = min(best_cpu[name], cpu)
    if growthbook is not None:
        growthbook.destroy()
    rates = {name: len(units) / seconds for name, seconds in best.items()}
    rates.update({f"{name} [cpu]": len(units) / best_cpu[name] for name in CPU_ROWS if name in best})
    return rates


def render(table: dict[str, dict[str, float]], command: str, args: argparse.Namespace) -> str:
    shapes = list(table)
    rows = [row for row in table[shapes[0]] if not row.endswith(" [cpu]")]
    lines = [
        "## Client",
        "",
        "Local assignment throughput, single-threaded, assignments per second (best of "
        f"{args.repeats} passes over {args.units:,} distinct units, K = {args.arms} arms, "
        "non-uniform mixture). Measured with:",
        "",
        "```",
        command,
        "```",
        "",
        f"Machine: {platform.machine()}, {_cpu_name()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; load average "
        f"{args.load_before:.1f} before and {os.getloadavg()[0]:.1f} after the run (other work shares "
        "the machine). Absolute figures fall with load; the rows are timed interleaved, so the ratios "
        "below compare like with like.",
        "",
        "| | " + " | ".join(shapes) + " |",
        "|---|" + "---:|" * len(shapes),
    ]
    for row in rows:
        cells = [f"{table[shape][row]:,.0f}" if row in table[shape] else "n/a" for shape in shapes]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    first = table[shapes[0]][ASSIGN]
    lines += [
        "",
        f"Target: at least 300,000 assignments per second per call ({shapes[0]}): "
        f"{'met' if first >= 300_000 else 'not met'} in this run ({first:,.0f}/s).",
        "",
        "Ratios (same run):",
        "",
    ]
    for shape in shapes:
        r = table[shape]
        ours = r[ASSIGN]
        parts = [f"assign / hash only = {ours / r['hash only (PrefixHasher)']:.2f}"]
        gb_hash = r.get("growthbook hash+choose (gbhash v1 + chooseVariation)")
        gb_run = r.get("growthbook GrowthBook.run()")
        if gb_hash:
            parts.append(f"assign / growthbook hash+choose = {ours / gb_hash:.2f}")
        if gb_run:
            parts.append(f"assign / growthbook run() = {ours / gb_run:.1f}")
        batch = next(v for k, v in r.items() if k.startswith("pasto LocalAssigner.assign_many"))
        parts.append(f"assign_many / assign = {batch / ours:.2f}")
        parts.append(f"assign_many / numpy batch hash = {batch / r[HASH_BATCH]:.2f} (target >= 0.8)")
        parts.append(f"assign_many / its hash alone = {batch / r[BUCKETS]:.2f}")
        lines.append(f"- {shape}: " + "; ".join(parts) + ".")
    lines += [
        "",
        "Exposure sink overhead: `LocalAssigner.assign` rate with an exposure sink attached "
        "over its rate without, same run; target: ratio >= 0.5. Given both in wall-clock time and in "
        "process CPU time (both threads; the passes with a sink are timed up to the sink's `flush`). "
        "The CPU-time ratio is the work the sink adds, which is what an unloaded core would show; the "
        "wall-clock ratio also carries the waits of two threads of ours for the interpreter lock and "
        "of our process for a core, which grow with the machine's load.",
        "",
        "| sink | " + " | ".join(f"wall, {shape} | CPU, {shape}" for shape in shapes) + " | target met (wall / CPU) |",
        "|---|" + "---:|---:|" * len(shapes) + "---|",
    ]
    for row in SINK_ROWS:
        cells, met = [], {"wall": True, "CPU": True}
        for shape in shapes:
            r = table[shape]
            for clock, suffix in (("wall", ""), ("CPU", " [cpu]")):
                if row + suffix in r:
                    ratio = r[row + suffix] / r[ASSIGN + suffix]
                    cells.append(f"{ratio:.2f}")
                    met[clock] &= ratio >= 0.5
                else:
                    cells.append("n/a")
                    met[clock] = False
        verdict = " / ".join("yes" if met[clock] else "**no**" for clock in ("wall", "CPU"))
        lines.append(f"| {row.split(' + ')[1]} | " + " | ".join(cells) + f" | {verdict} |")
    lines += [
        "",
        "Reading: a per-call assignment is the hash of the unit's bytes (a Python loop, FNV-1a with "
        "the `seed:round:` prefix hashed once per round) plus a bisection over the cumulative "
        "mixture and the return of an `Assignment` prebuilt per arm for the round, so it costs "
        "little more than the hash alone and scales with the unit's length. GrowthBook's "
        "hash-and-choose hashes `unit + seed` on every call and scans the bucket ranges linearly; "
        "its `run()` adds attribute handling, conditions and tracking. The batch path hashes all "
        "units column by column in numpy. With an exposure sink, `assign` also appends "
        "`(unit, arm context, time)` to the exposure log's queue (no lock, no I/O); the log's "
        "thread builds the records column by column and writes them, sharing the interpreter "
        "lock, which is why that thread's work is timed with the pass.",
        "",
    ]
    return "\n".join(lines)


def measure_memory(n_arms: int) -> dict[str, float]:
    """Bytes per arm a fresh ``LocalAssigner`` holds (tracemalloc, after construction), after it has
    assigned 200,000 units (each arm drawn builds its Assignment once), and the bare minimum: the
    cumulative mixture as float64 and the arm names."""
    import gc
    import tracemalloc

    experiment = make_experiment(n_arms)
    names = sum(sys.getsizeof(arm["name"]) + 8 for arm in experiment["arms"])
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        assigner = LocalAssigner(None, EXPERIMENT, experiment=experiment)
        held = tracemalloc.get_traced_memory()[0] - before
        assigner.assign_many([f"user-{i}" for i in range(200_000)])
        gc.collect()
        drawn = len(set(a.arm for a in assigner.assign_many([f"user-{i}" for i in range(200_000)])))
        after = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return {"held": held / n_arms, "after": after / n_arms, "bare": (8 * n_arms + names) / n_arms,
            "drawn": drawn}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def write_section(section: str, path: Path = DOCS) -> None:
    """Replace the section of ``path`` that ``section`` heads (its first line, e.g. ``## Client``, up to
    the next ``## `` heading), or append it; other sections are left as they are. bench/serve.py
    writes its ``## Serving`` section with this function too."""
    heading = section.split("\n", 1)[0]
    if not heading.startswith("## "):
        raise ValueError(f"A section must start with a '## ' heading, got {heading!r}.")
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: section.rstrip("\n") + "\n\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    path.write_text(text.rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--units", type=int, default=100_000, help="distinct units per pass")
    parser.add_argument("--arms", type=int, default=20, help="number of arms K")
    parser.add_argument("--batch-size", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5, help="passes; the best one counts")
    parser.add_argument("--write-docs", action="store_true",
                        help="replace the '## Client' section of docs/benchmarks.md")
    parser.add_argument("--memory-arms", default="",
                        help="only print the bytes per arm a LocalAssigner holds at these K, e.g. 10000,100000")
    parser.add_argument("--batch-only", action="store_true",
                        help="only print the batch rows (assign_many and its two baselines), e.g. at --arms 100000")
    args = parser.parse_args(argv)
    if args.batch_only:
        units = [f"user-{i}" for i in range(args.units)]
        rates = measure(units, args.arms, args.batch_size, args.repeats, batch_only=True)
        print(f"K = {args.arms:,}, {args.units:,} user-<n> units, batches of {args.batch_size:,}, best of {args.repeats}:")
        for name, rate in rates.items():
            print(f"| {name} | {rate:,.0f} |")
        batch = next(v for k, v in rates.items() if k.startswith("pasto LocalAssigner.assign_many"))
        print(f"assign_many / numpy batch hash = {batch / rates[HASH_BATCH]:.2f}; "
              f"assign_many / its hash alone = {batch / rates[BUCKETS]:.2f}")
        return
    if args.memory_arms:
        print("| K | held after construction, B/arm | after 200,000 units, B/arm (arms drawn) | "
              "bare: float64 cumulative + names, B/arm | held / bare |")
        print("|---:|---:|---:|---:|---:|")
        for n_arms in (int(k) for k in args.memory_arms.split(",")):
            m = measure_memory(n_arms)
            print(f"| {n_arms:,} | {m['held']:.0f} | {m['after']:.0f} ({m['drawn']:,}) | {m['bare']:.0f} | "
                  f"{m['held'] / m['bare']:.2f} |")
        return
    args.load_before = os.getloadavg()[0]
    shapes = {
        "user-<n> ids (10-11 bytes)": [f"user-{i}" for i in range(args.units)],
        "uuid4 ids (36 bytes)": [str(uuid.UUID(int=i * 7919 + 1, version=4)) for i in range(args.units)],
    }
    table = {name: measure(units, args.arms, args.batch_size, args.repeats)
             for name, units in shapes.items()}
    command = "python bench/client.py " + " ".join(argv if argv is not None else sys.argv[1:])
    section = render(table, command.strip(), args)
    print(section)
    if args.write_docs:
        write_section(section)
        print(f"Wrote the Client section of {DOCS}.")


if __name__ == "__main__":
    main()
