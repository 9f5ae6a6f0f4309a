"""The exposure log: one record per assignment, exactly the assignment, in the documented schema,
written off the assignment path, nothing lost on a clean close, failures and drops reported."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pasto_client import CallbackSink, ExposureLog, JsonLinesSink, LocalAssigner, ParquetSink
from pasto_client.exposure import COLUMN_NAMES, EXPOSURE_COLUMNS, arrow_schema

ROOT = Path(__file__).resolve().parents[2]
N_ARMS = 7
N_UNITS = 10_000
UPDATED_AT = "2026-11-23T21:00:00.123456+00:00"


def experiment_document(round_index: int = 5, status: str = "running") -> dict:
    """An experiment as ``GET /api/v1/experiments/<name>`` returns it, with a non-uniform mixture."""
    probabilities = np.random.default_rng(3).dirichlet(np.ones(N_ARMS)).tolist()
    return {
        "name": "feed", "status": status, "seed": 987,
        "round": {"index": round_index, "started_at": None, "ends_at": None},
        "arms": [{"name": f"blend-{k}", "params": {"w": k}} for k in range(N_ARMS)],
        "probabilities": probabilities, "deployed": probabilities[::-1],
        "updated_at": UPDATED_AT,
    }


UNITS = [f"user-{i}" for i in range(N_UNITS // 2)] + [f"ユーザー-{i}\"\\" for i in range(N_UNITS // 2)]


def assign_all(assigner: LocalAssigner, batch: bool) -> list:
    if batch:
        return [a for start in range(0, len(UNITS), 1000) for a in assigner.assign_many(UNITS[start:start + 1000])]
    return [assigner.assign(unit) for unit in UNITS]


def expected_rows(assignments: list) -> list[tuple]:
    arms = [f"blend-{k}" for k in range(N_ARMS)]
    return [("feed", unit, a.round, a.arm, arms.index(a.arm), a.probability, UPDATED_AT)
            for unit, a in zip(UNITS, assignments)]


def read_json_lines(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as file:
        return [json.loads(line) for line in file]


@pytest.mark.parametrize("batch", [False, True], ids=["assign", "assign_many"])
@pytest.mark.parametrize("kind", ["callback", "jsonl", "parquet"])
def test_records_are_exactly_the_assignments(tmp_path, kind, batch):
    received: list[dict] = []
    path = tmp_path / f"exposures.{kind}"
    sink = {"callback": lambda: CallbackSink(received.extend),
            "jsonl": lambda: JsonLinesSink(path),
            "parquet": lambda: ParquetSink(path)}[kind]()
    before = datetime.now(timezone.utc)
    # Small batches and a short interval: many writes while assigning, not one at close.
    log = ExposureLog(sink, max_batch=997, flush_interval=0.01, name="feed")
    assigner = LocalAssigner(None, "feed", experiment=experiment_document(), exposure_sink=log)
    assignments = assign_all(assigner, batch)
    assigner.close()
    after = datetime.now(timezone.utc)
    if kind == "callback":
        records = received
    elif kind == "jsonl":
        records = read_json_lines(path)
    else:
        records = pq.read_table(path).to_pylist()
    assert len(records) == N_UNITS
    assert [(r["experiment"], r["unit"], r["round"], r["arm"], r["arm_index"], r["probability"],
             r["mixture_version"]) for r in records] == expected_rows(assignments)
    assert {a.arm for a in assignments} == {f"blend-{k}" for k in range(N_ARMS)}
    stamps = [r["timestamp"] if isinstance(r["timestamp"], datetime)
              else datetime.fromisoformat(r["timestamp"]) for r in records]
    assert all(s.utcoffset() == timedelta(0) for s in stamps)
    # Millisecond precision: the timestamp is truncated, so it may fall up to 1 ms before `before`.
    # No wall-clock tolerance beyond that: `before` and `after` are read around the assignments, so any
    # load only widens the interval the stamps must fall in.
    assert before - timedelta(milliseconds=1) <= min(stamps) and max(stamps) <= after
    assert stamps == sorted(stamps)  # one thread: assignment order is time order
    assert (log.written, log.dropped, log.failed, log.pending) == (N_UNITS, 0, 0, 0)


def test_json_lines_schema(tmp_path):
    path = tmp_path / "exposures.jsonl"
    with LocalAssigner(None, "feed", experiment=experiment_document(), exposure_sink=JsonLinesSink(path)) as assigner:
        assigner.assign("u-1")
        assigner.assign_many(["u-2", "u-3"])
    lines = path.read_text(encoding="ascii").splitlines()  # ASCII only: non-ASCII units are escaped
    assert len(lines) == 3
    for line in lines:
        record = json.loads(line)
        assert tuple(record) == COLUMN_NAMES
        # segment is null for an unsegmented experiment (tests/service/test_segments.py: segmented rows).
        assert [type(record[name]) for name in COLUMN_NAMES] == [str, str, int, str, int, float, str, type(None), str]
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", record["timestamp"])


def test_parquet_schema_is_the_documented_one(tmp_path):
    path = tmp_path / "exposures.parquet"
    with LocalAssigner(None, "feed", experiment=experiment_document(), exposure_sink=ParquetSink(path)) as assigner:
        assigner.assign_many(UNITS[:100])
    table = pq.read_table(path)
    assert table.schema.names == list(COLUMN_NAMES)
    assert [str(t) for t in table.schema.types] == [
        "string", "string", "int64", "string", "int64", "double", "string", "string", "timestamp[ms, tz=UTC]",
    ]
    assert table.schema.equals(arrow_schema(pa))
    assert table.num_rows == 100


def test_the_documented_table_is_the_schema():
    text = (ROOT / "docs" / "client.md").read_text(encoding="utf-8")
    section = text.split("## Exposure log", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", section, re.MULTILINE)
    assert [name for name, _ in rows] == list(COLUMN_NAMES)
    assert [kind.strip() for _, kind in rows] == [kind for _, kind, _ in EXPOSURE_COLUMNS]


def test_a_stopped_experiment_logs_the_deployed_mixture(tmp_path):
    received: list[dict] = []
    document = experiment_document(status="stopped")
    with LocalAssigner(None, "feed", experiment=document, exposure_sink=received.extend) as assigner:
        assignments = [assigner.assign(u) for u in UNITS[:500]]
    assert [r["probability"] for r in received] == [a.probability for a in assignments]
    deployed = dict(zip((f"blend-{k}" for k in range(N_ARMS)), document["deployed"]))
    assert all(r["probability"] == deployed[r["arm"]] for r in received)


def test_close_writes_everything_queued(tmp_path):
    jsonl, parquet = tmp_path / "e.jsonl", tmp_path / "e.parquet"
    # Nothing would be written before close: batches larger than the run, a one-hour interval.
    logs = [ExposureLog(JsonLinesSink(jsonl), max_batch=50_000, flush_interval=3600),
            ExposureLog(ParquetSink(parquet), max_batch=50_000, flush_interval=3600)]
    assigners = [LocalAssigner(None, "feed", experiment=experiment_document(), exposure_sink=log) for log in logs]
    for assigner in assigners:
        assign_all(assigner, batch=False)
    assert jsonl.stat().st_size == 0
    assert [log.pending for log in logs] == [N_UNITS, N_UNITS]
    for assigner in assigners:
        assigner.close()
    assert len(read_json_lines(jsonl)) == N_UNITS
    assert pq.read_table(parquet).num_rows == N_UNITS


def test_flush_writes_without_closing(tmp_path):
    path = tmp_path / "e.jsonl"
    log = ExposureLog(JsonLinesSink(path), flush_interval=3600)
    assigner = LocalAssigner(None, "feed", experiment=experiment_document(), exposure_sink=log)
    assigner.assign_many(UNITS[:300])
    log.flush(timeout=30)
    assert len(read_json_lines(path)) == 300
    assigner.assign("one-more")
    assigner.close()
    assert len(read_json_lines(path)) == 301


def test_a_forgotten_close_still_writes_at_exit(tmp_path):
    jsonl, parquet = tmp_path / "e.jsonl", tmp_path / "e.parquet"
    script = (
        "import json, sys\n"
        "from pasto_client import JsonLinesSink, LocalAssigner, ParquetSink\n"
        "for sink in (JsonLinesSink(sys.argv[1]), ParquetSink(sys.argv[2])):\n"
        "    assigner = LocalAssigner(None, 'feed', experiment=json.loads(sys.argv[3]), exposure_sink=sink)\n"
        "    for i in range(2500):\n"
        "        assigner.assign(f'u{i}')\n"
    )
    subprocess.run([sys.executable, "-c", script, str(jsonl), str(parquet), json.dumps(experiment_document())],
                   check=True, timeout=120)
    assert [r["unit"] for r in read_json_lines(jsonl)] == [f"u{i}" for i in range(2500)]
    assert pq.read_table(parquet).column("unit").to_pylist() == [f"u{i}" for i in range(2500)]


def test_concurrent_assigning_threads_lose_nothing(tmp_path):
    path = tmp_path / "e.jsonl"
    log = ExposureLog(JsonLinesSink(path), max_batch=500, flush_interval=0.01)
    assigner = LocalAssigner(None, "feed", experiment=experiment_document(), exposure_sink=log)
    answers: dict[str, str] = {}

    def work(offset: int) -> None:
        for i in range(offset, N_UNITS, 4):
            answers[UNITS[i]] = assigner.assign(UNITS[i]).arm

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assigner.close()
    records = read_json_lines(path)
    assert len(records) == N_UNITS
    assert {r["unit"]: r["arm"] for r in records} == answers


class FailingSink:
    """A sink whose storage fails, as a full disk or an unreachable broker would."""

    def __init__(self, fail_times: int) -> None:
        self.fail_times = fail_times
        self.batches: list[list[dict]] = []

    def write(self, batch) -> None:
        if self.fail_times > 0:
            self.fail_times -= 1
            raise OSError("No space left on device")
        self.batches.append(batch.records())

    def close(self) -> None:
        """Nothing to release: the sink keeps its batches in memory for the test to read."""


def test_a_failing_sink_is_reported_and_never_breaks_assignment(caplog):
    caplog.set_level(logging.ERROR, logger="pasto_client.exposure")
    # Only full batches are written before the flush (one-hour interval): batches of exactly 100.
    log = ExposureLog(FailingSink(fail_times=1), max_batch=100, flush_interval=3600, name="feed")
    assigner = LocalAssigner(None, "feed", experiment=experiment_document(), exposure_sink=log)
    plain = LocalAssigner(None, "feed", experiment=experiment_document())
    assert [assigner.assign(u) for u in UNITS[:100]] == [plain.assign(u) for u in UNITS[:100]]
    with pytest.raises(OSError, match="No space left"):
        log.flush(timeout=30)
    assert "failed to write 100 exposures" in caplog.text
    assert assigner.assign_many(UNITS[100:300]) == plain.assign_many(UNITS[100:300])
    assigner.close()  # the error was raised once (from flush); the later batches were written
    assert (log.failed, log.written, log.dropped) == (100, 200, 0)
    assert sum(len(b) for b in log.sink.batches) == 200


def test_a_real_write_error_is_raised_from_close(tmp_path):
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")
    assigner = LocalAssigner(None, "feed", experiment=experiment_document(),
                             exposure_sink=JsonLinesSink("/dev/full"))
    assigner.assign_many(UNITS[:1000])
    with pytest.raises(OSError):
        assigner.close()
    assert assigner.exposures.failed == 1000
    assert assigner.assign("after").arm  # the assigner keeps serving


def test_on_error_receives_the_failed_batch():
    failures = []
    log = ExposureLog(FailingSink(fail_times=2), max_batch=50, flush_interval=3600,
                      on_error=lambda error, batch: failures.append((str(error), len(batch))))
    assigner = LocalAssigner(None, "feed", experiment=experiment_document(), exposure_sink=log)
    assigner.assign_many(UNITS[:150])
    assigner.close()  # handled by on_error: nothing raised
    assert failures == [("No space left on device", 50)] * 2
    assert (log.failed, log.written) == (100, 50)


class BlockingSink:
    """A sink that cannot keep up: each write waits until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.written = 0

    def write(self, batch) -> None:
        self.entered.set()
        self.release.wait(60)
        self.written += len(batch)

    def close(self) -> None:
        """Nothing to release: the sink keeps its batches in memory for the test to read."""


def test_a_full_queue_drops_and_counts_and_never_blocks(caplog):
    caplog.set_level(logging.WARNING, logger="pasto_client.exposure")
    sink = BlockingSink()
    # A one-hour interval: only a full batch wakes the writer, so the first write holds exactly 10.
    log = ExposureLog(sink, max_batch=10, max_queue=100, flush_interval=3600, name="feed")
    assigner = LocalAssigner(None, "feed", experiment=experiment_document(), exposure_sink=log)
    for unit in UNITS[:10]:
        assigner.assign(unit)
    assert sink.entered.wait(30)  # the writer holds the first batch of 10 in a write that hangs
    assignments = [assigner.assign(u) for u in UNITS[10:500]]  # returns although the sink hangs
    assert len(assignments) == 490
    assert log.dropped == 490 - 90  # 10 in flight + 90 queued = max_queue
    assert assigner.assign_many(UNITS[500:520]) and log.dropped == 400 + 20
    assert "Dropped exposures of 'feed' because 100 exposures are already pending" in caplog.text
    sink.release.set()
    assigner.close()
    assert (sink.written, log.written, log.dropped) == (100, 100, 420)
    assigner.assign("after-close")  # still served, its exposure counted as dropped
    assert log.dropped == 421


def test_no_sink_leaves_assign_untouched():
    assigner = LocalAssigner(None, "feed", experiment=experiment_document())
    assert "assign" not in vars(assigner) and assigner.exposures is None
    assert type(assigner).assign is LocalAssigner.assign


def test_invalid_sinks_and_settings(tmp_path):
    with pytest.raises(TypeError, match="write\\(batch\\) and close\\(\\)"):
        LocalAssigner(None, "feed", experiment=experiment_document(), exposure_sink="exposures.jsonl")
    with pytest.raises(FileNotFoundError):
        JsonLinesSink(tmp_path / "missing-directory" / "e.jsonl")  # at once, not in the background
    with pytest.raises(ValueError, match="max_queue"):
        ExposureLog(lambda records: None, max_batch=100, max_queue=10)


def test_the_client_works_without_pyarrow(tmp_path):
    script = (
        "import json, sys\n"
        "sys.modules['pyarrow'] = None  # as if the 'parquet' extra were not installed\n"
        "from pasto_client import JsonLinesSink, LocalAssigner, ParquetSink\n"
        "with LocalAssigner(None, 'feed', experiment=json.loads(sys.argv[2]), exposure_sink=JsonLinesSink(sys.argv[1])) as a:\n"
        "    a.assign('u')\n"
        "try:\n"
        "    ParquetSink(sys.argv[1] + '.parquet')\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "e.jsonl"), json.dumps(experiment_document())],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'pasto[parquet]'" in result.stdout and "'parquet' extra" in result.stdout
    assert len(read_json_lines(tmp_path / "e.jsonl")) == 1


def test_mixture_version_and_assignments_follow_the_server(server, admin, create_experiment, tmp_path):
    name = create_experiment()
    path = tmp_path / "e.jsonl"
    with LocalAssigner(admin, name, exposure_sink=JsonLinesSink(path)) as assigner:
        local = assigner.assign_many(UNITS[:2000])
    served = admin.assign_many(name, UNITS[:2000])
    experiment = admin.get_experiment(name)
    records = read_json_lines(path)
    assert [(r["unit"], r["arm"], r["round"], r["probability"]) for r in records] == [
        (u, a.arm, a.round, a.probability) for u, a in zip(UNITS, served)
    ]
    assert [a.arm for a in local] == [a.arm for a in served]
    assert {r["mixture_version"] for r in records} == {experiment["updated_at"]}
    assert {r["experiment"] for r in records} == {name}
