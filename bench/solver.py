"""Time of one exact solve (``pasto.optimum.solve``) against a plain HiGHS LP, in one run.

Instances are setup B's shape (means U[-1, 1], guardrail thresholds 0.5) with K arms and three
guardrails, in three kinds: all hard (an LP), all soft at lambda = 5 (the paper's QP), and mixed
(one hard, two soft at lambda = 1e9). The baseline is ``scipy.optimize.linprog(method="highs")`` on
the all-hard LP of the same instance, measured in the same run, so the ratio column is what the
exactness (candidates, KKT checks on every arm, column generation) costs over one LP solve. Each
figure is the best of ``--repeats`` solves (best-of filters out the other processes on the machine).

Run: ``python bench/solver.py`` (about 20 s).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from scipy.optimize import linprog

from pasto.objectives import Guardrail, Objective
from pasto.optimum import solve

KINDS = {
    "hard (LP)": (("hard", 0.0), ("hard", 0.0), ("hard", 0.0)),
    "soft lambda 5 (QP)": (("soft", 5.0), ("soft", 5.0), ("soft", 5.0)),
    "mixed, lambda 1e9": (("hard", 0.0), ("soft", 1e9), ("soft", 1e9)),
}


def _objective(kinds) -> Objective:
    guardrails = tuple(
        Guardrail(metric=f"y{j}", threshold=0.5, hard=True) if kind == "hard"
        else Guardrail(metric=f"y{j}", threshold=0.5, penalty=lam)
        for j, (kind, lam) in enumerate(kinds)
    )
    return Objective(metrics=("x", "y0", "y1", "y2"), primary=(("x", 1.0),), guardrails=guardrails)


def _best_time(function, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"{'K':>6}  {'instance':<20} {'solve ms':>9} {'linprog ms':>11} {'ratio':>6}  feasible")
    for k in (100, 1_000, 10_000):
        # A hard guardrail at 0.5 on three U[-1, 1] rows is feasible for these draws (checked below).
        means = np.random.default_rng(args.seed + k).uniform(-1.0, 1.0, (4, k))
        lp_time = _best_time(
            lambda: linprog(-means[0], A_ub=-means[1:], b_ub=np.full(3, -0.5), A_eq=np.ones((1, k)),
                            b_eq=[1.0], bounds=(0, 1), method="highs"),
            args.repeats,
        )
        for name, kinds in KINDS.items():
            objective = _objective(kinds)
            solution = solve(objective, means)
            solve_time = _best_time(lambda: solve(objective, means), args.repeats)
            print(f"{k:>6}  {name:<20} {solve_time * 1e3:>9.1f} {lp_time * 1e3:>11.1f} "
                  f"{solve_time / lp_time:>6.1f}  {solution.feasible}")


if __name__ == "__main__":
    main()
