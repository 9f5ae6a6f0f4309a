"""``GET /metrics`` at K = 10,000 arms against K = 100, in the same run: bytes and milliseconds.

For each K, a fresh SQLite database holds one experiment with K arms; ``--units`` units (default
20,000) are assigned and observed through the API, so the per-arm event counters exist for most arms
as well as the controller gauges. Each configuration is served by a real HTTP server on 127.0.0.1
(werkzeug, in a thread: loopback only) and scraped ``--repeats`` times (default 7) with a bearer
token; the median time and the body size are printed, and the ratio of K = 10,000 to K = 100. The
first scrape of a process is reported apart: it reads every experiment's state, configuration and
arm names, which later scrapes reuse until the experiment's version changes (a round closes).
Each configuration runs in its own process: the event counters are per process, so a scrape never
includes an earlier configuration's series.
Two settings of ``PASTO_METRICS_TOP_ARMS``: the default (20) and one at least K (every arm has its
series, what /metrics did before the bound).

    .venv/bin/python bench/metrics_scrape.py            # the docs/benchmarks.md row (about a minute)
    .venv/bin/python bench/metrics_scrape.py --units 2000 --repeats 3   # quicker
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
from werkzeug.serving import make_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import migrations  # noqa: E402
from service import create_app  # noqa: E402
from service.db import get_db  # noqa: E402

ADMIN_TOKEN = "bench-metrics-scrape-admin-token"
EXPERIMENT = "scrape"
BATCH = 10_000


def experiment_body(n_arms: int) -> dict:
    return {
        "name": EXPERIMENT,
        "arms": [{"name": f"setting-{k}", "params": {"w": k / n_arms}} for k in range(n_arms)],
        "metrics": ["x", "y"],
        "objective": {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "penalty": 5.0}]},
        "round_seconds": 86_400,
        "seed": 20260101,
    }


def measure(directory: Path, n_arms: int, top_arms: int, n_units: int,
            repeats: int) -> tuple[int, float, int, float]:
    """(body bytes, median scrape ms, samples, first scrape ms) of /metrics for one experiment of
    ``n_arms`` arms."""
    url = f"sqlite:///{directory / f'k{n_arms}-top{top_arms}.sqlite'}"
    migrations.upgrade(url)
    app = create_app({"PASTO_DATABASE_URL": url, "PASTO_ADMIN_TOKEN": ADMIN_TOKEN,
                      "PASTO_METRICS_TOP_ARMS": top_arms})
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_port}"
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    try:
        with requests.Session() as session:
            created = session.post(f"{base}/api/v1/experiments", json=experiment_body(n_arms), headers=headers)
            created.raise_for_status()
            api = f"{base}/api/v1/experiments/{EXPERIMENT}"
            for start in range(0, n_units, BATCH):
                units = [f"k{n_arms}-u{i}" for i in range(start, min(n_units, start + BATCH))]
                answer = session.post(f"{api}/assign", json={"units": units}, headers=headers)
                answer.raise_for_status()
                observations = [{"id": a["unit"], "unit": a["unit"], "round": a["round"],
                                 "values": {"x": 1.0, "y": 0.5}} for a in answer.json()["assignments"]]
                session.post(f"{api}/observations", json={"observations": observations},
                             headers=headers).raise_for_status()
            started = time.perf_counter()
            session.get(f"{base}/metrics", headers=headers).raise_for_status()
            first = time.perf_counter() - started
            times, size, samples = [], 0, 0
            for _ in range(repeats):
                started = time.perf_counter()
                scrape = session.get(f"{base}/metrics", headers=headers)
                times.append(time.perf_counter() - started)
                scrape.raise_for_status()
                size = len(scrape.content)
                samples = sum(1 for line in scrape.text.splitlines() if line and not line.startswith("#"))
    finally:
        server.shutdown()
        get_db(app).engine.dispose()
    return size, statistics.median(times) * 1000, samples, first * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--units", type=int, default=20_000, help="units assigned and observed per experiment")
    parser.add_argument("--repeats", type=int, default=7, help="scrapes per configuration (median reported)")
    parser.add_argument("--one", nargs=3, metavar=("DIRECTORY", "K", "TOP"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.one:
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        directory, n_arms, top = arguments.one
        print(json.dumps(measure(Path(directory), int(n_arms), int(top), arguments.units, arguments.repeats)))
        return

    def run(directory: str, n_arms: int, top: int) -> tuple[int, float, int, float]:
        output = subprocess.run([sys.executable, __file__, "--units", str(arguments.units), "--repeats",
                                 str(arguments.repeats), "--one", directory, str(n_arms), str(top)],
                                check=True, capture_output=True, text=True).stdout
        return tuple(json.loads(output.strip().splitlines()[-1]))

    print(f"units={arguments.units} repeats={arguments.repeats}")
    print("| PASTO_METRICS_TOP_ARMS | K | bytes | samples | median ms | first scrape ms | "
          "ratio to K = 100 (bytes, ms) |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="pasto-bench-metrics-") as directory:
        for label, top in (("20 (default)", 20), ("10000 (every arm)", 10_000)):
            small = run(directory, 100, top)
            large = run(directory, 10_000, top)
            for n_arms, (size, ms, samples, first) in ((100, small), (10_000, large)):
                ratio = f"{size / small[0]:.2f}, {ms / small[1]:.2f}"
                print(f"| {label} | {n_arms:,} | {size:,} | {samples:,} | {ms:.1f} | {first:.1f} | {ratio} |",
                      flush=True)


if __name__ == "__main__":
    main()
