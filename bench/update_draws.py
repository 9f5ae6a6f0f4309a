"""What posterior exploration outside the support costs a round update.

``pasto.algorithm.update`` alone (the default preset, safe serving, soft guardrails: bench/serve.py's
synthetic M = 5 experiment), with ``serving_posterior_draws`` 0 and 4 (the default), measured
alternately in the same process, so that the ratio survives a noisy machine:

    python bench/update_draws.py --arms 100,1000,10000 --repeats 3

prints the table of docs/benchmarks.md's "Round update: posterior draws"; ``--option`` and
``--values`` compare two values of another option, e.g. the hard guardrails' confidence level:

    python bench/update_draws.py --option serving_level --values 0.9,0.95

``--against-bare`` times the default update against its bare baselines on the same statistics
(issue 34: "no slower than a small constant times a bare Thompson step plus one exact solve"):

    OPENBLAS_NUM_THREADS=1 python bench/update_draws.py --against-bare --arms 10,100,1000,10000,100000
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve import measure_update_against_bare, measure_update_alone  # noqa: E402


def _value(text: str):
    """An option's value as typed: an integer, else a number, else the text itself."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default="100,1000,10000", help="comma-separated K")
    parser.add_argument("--rounds", type=int, default=6, help="updates per measurement (rounds 1..n)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating measurements per setting")
    parser.add_argument("--option", default="serving_posterior_draws", help="the algorithm option compared")
    parser.add_argument("--values", default="0,4", help="its two values, comma-separated (the second over the first)")
    parser.add_argument("--against-bare", action="store_true",
                        help="time the default update against a bare Thompson step and one exact solve")
    arguments = parser.parse_args(argv)
    if arguments.against_bare:
        return against_bare(arguments)
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


def against_bare(arguments) -> dict:
    """One row per K: the default update, a bare Thompson step, one exact solve, and the ratio."""
    results = {}
    print("| K | default update (ms) | Thompson step, 1 draw (ms) | Thompson, 16 draws (ms) | one exact solve (ms) "
          "| **update / (Thompson step + solve)** |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n_arms in (int(k) for k in arguments.arms.split(",")):
        runs = [measure_update_against_bare(n_arms, arguments.rounds, seed=repeat)
                for repeat in range(arguments.repeats)]
        row = {name: statistics.median(run[name] for run in runs) for name in runs[0]}
        row["ratio"] = statistics.median(run["update"] / (run["thompson_1"] + run["solve"]) for run in runs)
        results[n_arms] = row
        print(f"| {n_arms:,} | {row['update']:.2f} | {row['thompson_1']:.3f} | {row['thompson_16']:.2f} "
              f"| {row['solve']:.2f} | **{row['ratio']:.1f}** |", flush=True)
    return results


if __name__ == "__main__":
    main()
