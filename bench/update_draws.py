"""What posterior exploration outside the support costs a round update.

``pasto.algorithm.update`` alone (the default preset, safe serving, soft guardrails: bench/serve.py's
synthetic M = 5 experiment), with ``serving_posterior_draws`` 0 and 4 (the default), measured
alternately in the same process, so that the ratio survives a noisy machine:

    python bench/update_draws.py --arms 100,1000,10000 --repeats 3

prints the table of docs/benchmarks.md's "Round update: posterior draws"; ``--option`` and
``--values`` compare two values of another option, e.g. what the best-arm half of undecided runs
costs:

    python bench/update_draws.py --option serving_undecided --values conservative,best_arm
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve import measure_update_alone  # noqa: E402


def _value(text: str):
    return int(text) if text.lstrip("-").isdigit() else text


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default="100,1000,10000", help="comma-separated K")
    parser.add_argument("--rounds", type=int, default=6, help="updates per measurement (rounds 1..n)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating measurements per setting")
    parser.add_argument("--option", default="serving_posterior_draws", help="the algorithm option compared")
    parser.add_argument("--values", default="0,4", help="its two values, comma-separated (the second over the first)")
    arguments = parser.parse_args(argv)
    first, second = (_value(text) for text in arguments.values.split(","))
    results = {}
    print(f"| K | update, {arguments.option} = {first} (ms, median of rounds) | {arguments.option} = {second} (ms) "
          f"| ratio (median of pairs) |")
    print("|---:|---:|---:|---:|")
    for n_arms in (int(k) for k in arguments.arms.split(",")):
        pairs = []
        for repeat in range(arguments.repeats):
            order = (first, second) if repeat % 2 == 0 else (second, first)  # alternate which goes first
            times = {value: measure_update_alone(n_arms, "default", arguments.rounds, seed=repeat,
                                                 overrides={arguments.option: value})["median_ms"]
                     for value in order}
            pairs.append(times)
        before = statistics.median(pair[first] for pair in pairs)
        after = statistics.median(pair[second] for pair in pairs)
        ratio = statistics.median(pair[second] / pair[first] for pair in pairs)
        results[n_arms] = {str(first): before, str(second): after, "ratio": ratio}
        print(f"| {n_arms:,} | {before:.1f} | {after:.1f} | {ratio:.2f} |", flush=True)
    return results


if __name__ == "__main__":
    main()
