"""What posterior exploration outside the support costs a round update (issue 14).

``pasto.algorithm.update`` alone (the default preset, safe serving, soft guardrails: bench/serve.py's
synthetic M = 5 experiment), with ``serving_posterior_draws`` 0 and 4 (the default), measured
alternately in the same process, so that the ratio survives a noisy machine:

    python bench/update_draws.py --arms 100,1000,10000 --repeats 3

prints the table of docs/benchmarks.md's "Round update: posterior draws".
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve import measure_update_alone  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default="100,1000,10000", help="comma-separated K")
    parser.add_argument("--rounds", type=int, default=6, help="updates per measurement (rounds 1..n)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating measurements per setting")
    arguments = parser.parse_args(argv)
    results = {}
    print("| K | update, 0 draws (ms, median of rounds) | update, 4 draws (ms) | ratio 4 / 0 (median of pairs) |")
    print("|---:|---:|---:|---:|")
    for n_arms in (int(k) for k in arguments.arms.split(",")):
        pairs = []
        for repeat in range(arguments.repeats):
            order = (0, 4) if repeat % 2 == 0 else (4, 0)  # alternate which goes first
            times = {draws: measure_update_alone(n_arms, "default", arguments.rounds, seed=repeat,
                                                 overrides={"serving_posterior_draws": draws})["median_ms"]
                     for draws in order}
            pairs.append(times)
        without = statistics.median(pair[0] for pair in pairs)
        with_draws = statistics.median(pair[4] for pair in pairs)
        ratio = statistics.median(pair[4] / pair[0] for pair in pairs)
        results[n_arms] = {"0": without, "4": with_draws, "ratio": ratio}
        print(f"| {n_arms:,} | {without:.1f} | {with_draws:.1f} | {ratio:.2f} |", flush=True)
    return results


if __name__ == "__main__":
    main()
