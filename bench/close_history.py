"""Round close time vs history: pooled statistics as running totals against the full re-aggregate they replaced.

Runs ``bench/serve.py``'s round-close measurement (``service.controller.rounds.close_round`` on a database that
gains K x M ``round_statistics`` rows per round) twice per backend in one process: once with the
service as it is, once with ``service.store.update_statistics`` replaced by a copy of the full
aggregate over every row of rounds <= r that it used before migration 0002 (the running totals are
then left unused). Prints the close transaction's milliseconds by round.

    python bench/close_history.py --arms 10000 --rounds 10 --backends sqlite,postgres
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
_spec = importlib.util.spec_from_file_location("pasto_bench_serve", Path(__file__).with_name("serve.py"))
serve = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve)


def full_aggregate(database, session, experiment_id: int, round_index: int, n_segments: int, n_metrics: int,
                   n_arms: int):
    """``update_statistics`` before running totals (commit 13360da): one aggregate over all rows of rounds <= r
    (an unsegmented experiment's: segment 0, shape (1, M, K))."""
    from pasto.estimators import Statistics

    connection = session.connection()
    placeholder = "%s" if connection.dialect.paramstyle in ("format", "pyformat") else "?"
    in_round = f"round_index = {placeholder}"
    sql = (
        "SELECT metric_index, arm_index, "
        f"SUM(CASE WHEN {in_round} THEN count ELSE 0 END), SUM(CASE WHEN {in_round} THEN sum ELSE 0 END), "
        f"SUM(CASE WHEN {in_round} THEN sum_of_squares ELSE 0 END), "
        "SUM(count), SUM(sum), SUM(sum_of_squares) "
        f"FROM round_statistics WHERE experiment_id = {placeholder} AND round_index <= {placeholder} "
        "GROUP BY metric_index, arm_index"
    )
    cursor = connection.connection.cursor()
    try:
        cursor.execute(sql, (round_index, round_index, round_index, experiment_id, round_index))
        data = np.array(cursor.fetchall(), dtype=np.float64).reshape(-1, 8)
    finally:
        cursor.close()

    def statistics(columns):
        arrays = [np.zeros((n_segments, n_metrics, n_arms)) for _ in range(3)]
        metric, arm = data[:, 0].astype(np.int64), data[:, 1].astype(np.int64)
        for array, column in zip(arrays, columns):
            array[0, metric, arm] = data[:, column]
        return Statistics(*arrays)

    return statistics((2, 3, 4)), statistics((5, 6, 7))


def measure(backend, n_arms: int, rounds: int, label: str) -> list[float]:
    from service.db import get_db

    app, _ = serve.prepare_database(backend.new_database(f"history-{label}"),
                                    [(serve.close_experiment(10, "default"), 10, "default"),
                                     (serve.close_experiment(n_arms, "default"), n_arms, "default")])
    serve.measure_round_close(app, 10, "default", 5)  # warm-up
    result = serve.measure_round_close(app, n_arms, "default", rounds)
    get_db(app).engine.dispose()
    return result["transaction_by_round"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--backends", default="sqlite,postgres")
    args = parser.parse_args()
    import service.store

    running_totals = service.store.update_statistics
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.backends.split(","):
            cluster = None
            if name == "postgres":
                server_url, cluster = serve._postgres_server(args)
                if server_url is None:
                    print("No PostgreSQL server; skipping it.", file=sys.stderr)
                    continue
                backend = serve.Backend("postgres", Path(workdir), server_url)
            else:
                backend = serve.Backend("sqlite", Path(workdir))
            try:
                for label, function in (("aggregate", full_aggregate), ("totals", running_totals)):
                    service.store.update_statistics = function
                    series = measure(backend, args.arms, args.rounds, label)
                    print(f"{name} {label:9s} K = {args.arms:,}: " + ", ".join(f"{ms:.0f}" for ms in series) + " ms",
                          flush=True)
            finally:
                service.store.update_statistics = running_totals
                backend.close()
                if cluster is not None:
                    cluster.stop()


if __name__ == "__main__":
    main()
