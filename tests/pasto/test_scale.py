"""One round update at K = 100,000 arms, M = 5 metrics: memory stays O(K x M), never K x K.

Every per-round computation must be linear in K x M. A dense K x K array at K = 100,000 is 80 GB,
so the update runs in a subprocess under an address-space limit (an accidental K x K allocation is
a ``MemoryError`` there, not a machine out of memory) and under ``tracemalloc``, whose peak must stay
below ``PEAK_BYTES_PER_CELL`` bytes per (arm, metric) cell: room for a few dozen float64 arrays of
shape (M, K), a thousandth of one K x K array.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

N_ARMS = 100_000
N_METRICS = 5
PEAK_BYTES_PER_CELL = 400  # 200 MB at K = 100,000, M = 5 (a K x K float64 array is 80 GB)
ADDRESS_SPACE_BYTES = 4 * 2**30  # the interpreter, numpy, scipy and HiGHS fit with room to spare

SCRIPT = r"""
import json, resource, sys, time, tracemalloc
limit = int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
import numpy as np
from pasto.algorithm import AlgorithmConfig, initial_state, round_generator, update
from pasto.estimators import Statistics
from pasto.objectives import Objective

n_arms, preset = int(sys.argv[1]), sys.argv[2]
metrics = ["watch_time", "likes", "skips", "shares", "latency"]
objective = Objective.from_spec(metrics, {
    "primary": {"watch_time": 1.0, "likes": 0.5},
    "guardrails": [{"metric": "skips", "threshold": -0.2, "penalty": 5.0},
                   {"metric": "latency", "threshold": -0.5, "penalty": 5.0}],
})
config = AlgorithmConfig.from_preset(preset)
rng = np.random.default_rng(0)
means = rng.uniform(-1.0, 1.0, (len(metrics), n_arms))
counts = rng.poisson(3, means.shape).astype(float)
sums = means * counts + rng.normal(0.0, 1.0, means.shape) * np.sqrt(counts)
statistics = Statistics(counts=counts, sums=sums, sums_of_squares=sums**2 / np.maximum(counts, 1.0) + counts)
state = initial_state(config, n_arms, len(metrics), objective=objective)
tracemalloc.start()
try:
    state = update(config, objective, state, statistics, statistics, rng=round_generator(0, 1))
except MemoryError as error:
    print(json.dumps({"error": repr(error)[:300]}))
else:
    mixture = np.asarray(state.probabilities)
    print(json.dumps({"peak": tracemalloc.get_traced_memory()[1], "shape": list(mixture.shape),
                      "total": float(mixture.sum())}))
"""


def run_one_update(n_arms: int, preset: str) -> dict:
    """One ``pasto.algorithm.update`` (round 1) in a fresh interpreter under the address-space limit."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    completed = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(n_arms), preset, str(ADDRESS_SPACE_BYTES)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def check_linear_memory(result: dict, n_arms: int) -> None:
    assert "error" not in result, f"The update allocated beyond {ADDRESS_SPACE_BYTES / 2**30:.0f} GiB: {result['error']}"
    assert result["shape"] == [n_arms]
    assert result["total"] == pytest.approx(1.0)
    limit = PEAK_BYTES_PER_CELL * n_arms * N_METRICS
    assert result["peak"] < limit, f"peak {result['peak'] / 2**20:.0f} MiB over {limit / 2**20:.0f} MiB"


def test_paper_preset_update_at_100000_arms_stays_linear_in_memory():
    check_linear_memory(run_one_update(N_ARMS, "paper"), N_ARMS)


def test_default_preset_update_at_100000_arms_stays_linear_in_memory():
    check_linear_memory(run_one_update(N_ARMS, "default"), N_ARMS)
