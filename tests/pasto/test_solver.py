"""pasto.optimum.solve against independent oracles: exact active-set enumeration and duality certificates.

The oracle shares no code with the solver. For small K it enumerates every support S of at most
G + 1 arms (an optimum of the LP / QP uses at most that many arms above their lower bounds) and
every guess of which soft guardrails fall short and which hard ones are tight; each guess is an
equality-constrained quadratic problem solved from its KKT system written with the penalty's
Hessian (the solver writes it with the multipliers instead). The optimum is the best *feasible*
candidate, so no multiplier sign needs trusting. For large K, weak duality gives a certificate:
any mu, nu >= 0 bound the optimum from above, with mu read off the solver's mixture itself.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasto.objectives import Guardrail, Objective
from pasto.optimum import Solution, best_mixture, best_single, solve

PENALTIES = (1e-2, 5.0, 1e3, 1e6, 2e7, 1e9)


def _objective(kinds, penalties, thresholds, baseline=None, arm_names=None):
    """kinds: 'soft' / 'hard' per guardrail; metrics x, y0, y1, ..."""
    guardrails = tuple(
        Guardrail(metric=f"y{j}", threshold=float(c), hard=True) if kind == "hard"
        else Guardrail(metric=f"y{j}", threshold=float(c), penalty=float(lam))
        for j, (kind, lam, c) in enumerate(zip(kinds, penalties, thresholds))
    )
    metrics = ("x",) + tuple(f"y{j}" for j in range(len(kinds)))
    return Objective(metrics=metrics, primary=(("x", 1.0),), guardrails=guardrails,
                     arm_names=arm_names, baseline=baseline)


def _true_value(objective, means, thresholds, p):
    return float(objective.value(means @ p, thresholds))


def _oracle(objective, means, thresholds, lower):
    """(best value, p) over feasible KKT candidates, or (None, None) when no mixture meets the hard rows."""
    m, k = means.shape
    a = objective.primary_weights @ means
    rows = objective.guardrail_rows
    soft = [j for j in range(len(objective.guardrails)) if not objective.guardrails[j].hard
            and objective.guardrails[j].penalty > 0]
    hard = [j for j in range(len(objective.guardrails)) if objective.guardrails[j].hard]
    best_value, best_p = None, None
    for size in range(1, min(k, len(soft) + len(hard) + 1) + 1):
        for support in itertools.combinations(range(k), size):
            support = list(support)
            rest = [i for i in range(k) if i not in support]
            for n_short in range(len(soft) + 1):
                for short in itertools.combinations(soft, n_short):
                    for n_tight in range(len(hard) + 1):
                        if size > n_short + n_tight + 1:
                            continue
                        for tight in itertools.combinations(hard, n_tight):
                            p = _candidate(objective, means, thresholds, lower, a, rows,
                                           support, rest, short, tight)
                            if p is None:
                                continue
                            if np.any(p < lower - 1e-9):
                                continue
                            if hard and np.any(means[rows[hard]] @ p < thresholds[hard] - 1e-9):
                                continue
                            value = _true_value(objective, means, thresholds, p)
                            if best_value is None or value > best_value:
                                best_value, best_p = value, p
    return best_value, best_p


def _candidate(objective, means, thresholds, lower, a, rows, support, rest, short, tight):
    """Maximise a.p - sum_{short} lam (c - B p)^2 s.t. tight hard rows equal, sum p = 1, p_rest = lower."""
    s, t = len(support), len(tight)
    n = s + t + 1
    system = np.zeros((n, n))
    rhs = np.zeros(n)
    rest_mass = lower[rest]
    rhs[:s] = -a[support]
    for j in short:
        lam = objective.guardrails[j].penalty
        row = means[rows[j]]
        # d/dp_S of -lam (c - B p)^2 = 2 lam (c - B p) B_S
        system[:s, :s] -= 2.0 * lam * np.outer(row[support], row[support])
        rhs[:s] -= 2.0 * lam * (thresholds[j] - row[rest] @ rest_mass) * row[support]
    for position, j in enumerate(tight):
        row = means[rows[j]]
        system[:s, s + position] = row[support]
        system[s + position, :s] = row[support]
        rhs[s + position] = thresholds[j] - row[rest] @ rest_mass
    system[:s, -1] = -1.0
    system[-1, :s] = 1.0
    rhs[-1] = 1.0 - rest_mass.sum()
    try:
        solution = np.linalg.solve(system, rhs)
    except np.linalg.LinAlgError:
        return None
    # A nearly singular system (e.g. more equalities than the support can meet) gives garbage.
    if not np.all(np.isfinite(solution)) or not np.allclose(system @ solution, rhs, rtol=0, atol=1e-9 * (1.0 + np.abs(system).max() * np.abs(solution).max())):
        return None
    p = lower.copy()
    p[support] = solution[:s]
    if abs(p.sum() - 1.0) > 1e-9:
        return None
    return p


def _random_instance(rng, k, n_guardrails):
    kinds = [str(rng.choice(["soft", "hard"])) for _ in range(n_guardrails)]
    penalties = [float(rng.choice(PENALTIES)) for _ in range(n_guardrails)]
    thresholds = rng.uniform(-0.2, 0.6, n_guardrails)
    objective = _objective(kinds, penalties, thresholds)
    means = rng.uniform(-1.0, 1.0, (n_guardrails + 1, k))
    return objective, means, objective.thresholds(means)


def _close(value, reference):
    return abs(value - reference) <= 1e-6 * max(1.0, abs(reference))


@pytest.mark.parametrize("seed", range(120))
def test_solve_matches_active_set_enumeration(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(2, 8))
    n_guardrails = int(rng.integers(0, 6))  # the 0-5
    objective, means, thresholds = _random_instance(rng, k, n_guardrails)
    lower = np.zeros(k)
    min_shares = None
    if seed % 4 == 0:
        min_shares = rng.uniform(0.0, 0.5 / k, k)
        lower = min_shares
    reference, _ = _oracle(objective, means, thresholds, lower)
    solution = solve(objective, means, thresholds, min_shares=min_shares)
    p = solution.probabilities
    assert p.shape == (k,) and abs(p.sum() - 1.0) < 1e-12 and np.all(p >= lower - 1e-12)
    assert solution.value == pytest.approx(_true_value(objective, means, thresholds, p), rel=1e-12, abs=1e-12)
    if reference is None:
        assert not solution.feasible
        assert solution.largest_shortfall > 0
        return
    assert solution.feasible
    assert np.all(solution.hard_slack >= -1e-9)
    assert _close(solution.value, reference), (solution.value, reference)


@pytest.mark.parametrize("lam", [1e6, 2e7, 1e9])
def test_two_soft_guardrails_at_large_penalties_match_enumeration(lam):
    # The setting: K 5-50, two soft guardrails at c = 0.5, means U[-1, 1].
    objective = _objective(["soft", "soft"], [lam, lam], [0.5, 0.5])
    for seed in range(8):
        rng = np.random.default_rng(seed)
        means = rng.uniform(-1.0, 1.0, (3, int(rng.integers(5, 16))))
        thresholds = objective.thresholds(means)
        reference, _ = _oracle(objective, means, thresholds, np.zeros(means.shape[1]))
        assert _close(solve(objective, means).value, reference)


def test_regression_lambda_2e7_instance_mirror_ascent_got_wrong():
    # At lambda = 2e7 a mirror ascent + SLSQP solver returned 0.634828
    # here (seed 34 of a random draw: K = 7, two guardrails at 0.5); the optimum is 0.676257.
    objective = _objective(["soft", "soft"], [2e7, 2e7], [0.5, 0.5])
    rng = np.random.default_rng(34)
    k = int(rng.integers(5, 51))
    means = rng.uniform(-1.0, 1.0, (3, k))
    reference, _ = _oracle(objective, means, objective.thresholds(means), np.zeros(k))
    p, value = best_mixture(objective, means)
    assert reference == pytest.approx(0.6762566866862924, abs=1e-9)
    assert _close(value, reference)
    assert value > 0.6348283833021928 + 0.04


@pytest.mark.parametrize("penalty", [1e6, 2e7, 1e9])
def test_demo_ground_truth_matches_enumeration(penalty):
    from pasto.cli import load_scenario

    # The demo's ground truth is the shipped scenario "demo" (its guardrails hard; here soft first).
    scenario = load_scenario("demo")
    spec = scenario.objective_spec
    arm_names = list(scenario.arm_names)
    metrics = list(scenario.metrics)
    bare = [{key: value for key, value in g.items() if key not in ("hard", "penalty")} for g in spec["guardrails"]]
    guardrails = [dict(g, penalty=penalty) for g in bare]
    objective = Objective.from_spec(metrics, dict(spec, guardrails=guardrails), arm_names=arm_names)
    means = np.asarray(scenario.means.fixed, dtype=float)
    thresholds = objective.thresholds(means)
    reference, _ = _oracle(objective, means, thresholds, np.zeros(means.shape[1]))
    assert _close(solve(objective, means).value, reference)
    # The same guardrails hard: the value is the primary alone and both hold exactly.
    hard = [g | {"hard": True} for g in bare]
    hard_objective = Objective.from_spec(metrics, dict(spec, guardrails=hard), arm_names=arm_names)
    reference, _ = _oracle(hard_objective, means, thresholds, np.zeros(means.shape[1]))
    solution = solve(hard_objective, means)
    assert solution.feasible and np.all(solution.hard_slack >= -1e-12)
    assert _close(solution.value, reference)


def _certificate_gap(objective, means, thresholds, solution, lower):
    """Weak-duality bound on optimum - value, computed from the data and the solver's mixture and prices."""
    p = solution.probabilities
    a = objective.primary_weights @ means
    rows = objective.guardrail_rows
    scores = a.copy()
    constant = 0.0
    for j, g in enumerate(objective.guardrails):
        if g.hard:
            nu = solution.shadow_prices[list(objective.hard_indices).index(j)]
            assert nu >= 0
            scores += nu * means[rows[j]]
            constant -= nu * thresholds[j]
        elif g.penalty > 0:
            mu = 2.0 * g.penalty * max(thresholds[j] - means[rows[j]] @ p, 0.0)
            scores += mu * means[rows[j]]
            constant += -mu * thresholds[j] + mu**2 / (4.0 * g.penalty)
    dual = lower @ scores + (1.0 - lower.sum()) * scores.max() + constant
    return dual - _true_value(objective, means, thresholds, p)


@pytest.mark.parametrize("k, seed", [(10_000, 0), (10_000, 1), (2_000, 2), (500, 3), (300, 4)])
def test_large_instances_carry_a_duality_certificate(k, seed):
    rng = np.random.default_rng(seed)
    objective = _objective(["soft", "hard", "soft", "hard", "soft"], [5.0, 0, 1e9, 0, 2e7],
                           [0.5, 0.4, 0.3, 0.2, 0.5])
    means = rng.uniform(-1.0, 1.0, (6, k))
    thresholds = objective.thresholds(means)
    min_shares = np.full(k, 0.1 / k) if seed % 2 else None
    lower = np.zeros(k) if min_shares is None else min_shares
    solution = solve(objective, means, min_shares=min_shares)
    assert solution.feasible and np.all(solution.hard_slack >= -1e-9)
    assert np.all(solution.probabilities >= lower - 1e-12)
    gap = _certificate_gap(objective, means, thresholds, solution, lower)
    assert -1e-9 <= gap <= 1e-6 * max(1.0, abs(solution.value))


def test_infeasible_hard_guardrail_is_reported_with_the_smallest_shortfall():
    objective = _objective(["hard"], [0.0], [0.5])
    means = np.array([[3.0, 1.0, 2.0], [0.1, 0.3, 0.2]])
    solution = solve(objective, means)
    assert not solution.feasible
    assert solution.largest_shortfall == pytest.approx(0.2, abs=1e-8)  # 0.5 - best arm's 0.3
    np.testing.assert_allclose(solution.probabilities, [0.0, 1.0, 0.0], atol=1e-7)
    assert np.isnan(solution.shadow_prices).all()
    assert solution.hard_slack[0] == pytest.approx(-0.2, abs=1e-8)


def test_infeasible_hard_guardrails_are_reported_at_k_10000():
    # Two hard guardrails and a soft one over 10,000 arms; y0 >= 1.5 is above every arm's y0 (at most
    # 1), so no mixture keeps it: reported infeasible with the smallest largest shortfall, 1.5 minus
    # the largest y0 (the arm with the largest y0 alone, which y1 >= -2 does not restrict).
    rng = np.random.default_rng(7)
    k = 10_000
    objective = _objective(["hard", "hard", "soft"], [0.0, 0.0, 1e9], [1.5, -2.0, 0.2])
    means = rng.uniform(-1.0, 1.0, (4, k))
    solution = solve(objective, means)
    assert not solution.feasible
    assert solution.largest_shortfall == pytest.approx(1.5 - means[1].max(), abs=1e-7)
    assert np.isnan(solution.shadow_prices).all()
    assert solution.hard_slack[0] == pytest.approx(means[1].max() - 1.5, abs=1e-7)
    assert solution.probabilities[np.argmax(means[1])] > 0.999  # the rest within the shortfall tolerance


def test_infeasible_pair_returns_the_minimax_mixture_then_the_best_objective():
    # y0 = [1, -1, -1], y1 = [-1, 1, 1], both >= 0.5: the smallest largest shortfall is 0.5, at
    # half on arm 0 and half on arms {1, 2}; among those, arm 2's higher x wins.
    objective = _objective(["hard", "hard"], [0.0, 0.0], [0.5, 0.5])
    means = np.array([[0.0, 1.0, 2.0], [1.0, -1.0, -1.0], [-1.0, 1.0, 1.0]])
    solution = solve(objective, means)
    assert not solution.feasible
    assert solution.largest_shortfall == pytest.approx(0.5, abs=1e-8)
    np.testing.assert_allclose(solution.probabilities, [0.5, 0.0, 0.5], atol=1e-7)


@pytest.mark.parametrize("seed", range(10))
def test_shadow_prices_match_finite_differences(seed):
    rng = np.random.default_rng(100 + seed)
    k = 12
    objective_kinds = ["hard", "soft", "hard"]
    thresholds = np.array([0.3, 0.2, 0.1])
    means = rng.uniform(-1.0, 1.0, (4, k))
    objective = _objective(objective_kinds, [0.0, 50.0, 0.0], thresholds)
    base = solve(objective, means)
    if not base.feasible:
        pytest.skip("this draw has no feasible mixture")
    step = 1e-6
    for position, j in enumerate(objective.hard_indices):
        relaxed = thresholds.copy()
        relaxed[j] -= step
        gained = (solve(objective, means, relaxed).value - base.value) / step
        assert gained == pytest.approx(base.shadow_prices[position], rel=1e-3, abs=1e-6)
    assert np.all(base.shadow_prices >= 0)


def test_constraint_means_drive_the_hard_guardrails_only():
    objective = _objective(["hard"], [0.0], [0.5])
    means = np.array([[2.0, 1.0], [1.0, 1.0]])
    pessimistic = np.array([[2.0, 1.0], [0.0, 1.0]])  # arm 0's guardrail is uncertain
    solution = solve(objective, means, constraint_means=pessimistic)
    np.testing.assert_allclose(solution.probabilities, [0.5, 0.5], atol=1e-12)
    assert solution.value == pytest.approx(1.5)
    assert solution.shadow_prices[0] == pytest.approx(1.0)


def test_fixed_and_minimum_shares_are_lower_bounds():
    objective = _objective([], [], [])
    means = np.array([[1.0, 2.0, 3.0]])
    solution = solve(objective, means, min_shares=[0.1, 0.1, 0.0], fixed_shares=[0.3, 0.0, 0.0])
    np.testing.assert_allclose(solution.probabilities, [0.3, 0.1, 0.6], atol=1e-12)
    with pytest.raises(ValueError, match="at most 1"):
        solve(objective, means, min_shares=[0.5, 0.0, 0.0], fixed_shares=[0.0, 0.6, 0.0])
    with pytest.raises(ValueError, match="one entry per arm"):
        solve(objective, means, min_shares=[0.5, 0.0])
    with pytest.raises(ValueError, match="between 0 and 1"):
        solve(objective, means, fixed_shares=[-0.1, 0.0, 0.0])


def test_solution_is_a_frozen_dataclass():
    solution = solve(_objective([], [], []), np.array([[1.0, 2.0]]))
    assert isinstance(solution, Solution)
    with pytest.raises(AttributeError):
        solution.value = 0.0


def test_best_single_skips_arms_breaking_a_hard_guardrail():
    objective = _objective(["hard"], [0.0], [0.5])
    means = np.array([[3.0, 1.0, 2.0], [0.1, 0.6, 0.7]])
    assert best_single(objective, means) == (2, 2.0)
    # None eligible: the smallest shortfall wins, whatever its primary value.
    means = np.array([[3.0, 1.0, 2.0], [0.1, 0.4, 0.2]])
    assert best_single(objective, means) == (1, 1.0)
    index, values = best_single(objective, np.stack([means, means]))
    np.testing.assert_array_equal(index, [1, 1])


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
    n_guardrails=st.integers(0, 3),
    with_shares=st.booleans(),
)
def test_simplex_invariants(k, seed, n_guardrails, with_shares):
    rng = np.random.default_rng(seed)
    objective, means, thresholds = _random_instance(rng, k, n_guardrails)
    min_shares = rng.uniform(0, 1.0 / k, k) * rng.uniform(0, 1) if with_shares else None
    lower = np.zeros(k) if min_shares is None else min_shares
    solution = solve(objective, means, min_shares=min_shares)
    p = solution.probabilities
    assert p.shape == (k,)
    assert np.all(p >= lower - 1e-12) and abs(p.sum() - 1.0) <= 1e-12
    # Two roundings of the same value (mixture_value vs value at means @ p): relative at large penalties.
    assert solution.value == pytest.approx(_true_value(objective, means, thresholds, p), rel=1e-12, abs=1e-9)
    assert solution.shadow_prices.shape == solution.hard_slack.shape == (len(objective.hard_indices),)
    if solution.feasible:
        assert np.all(solution.hard_slack >= -1e-9) and solution.largest_shortfall <= 1e-9
        # Never worse than any single arm that meets the hard guardrails (and the minimum shares).
        if min_shares is None:
            singles = objective.value(means.T, thresholds)
            eligible = np.all(objective.hard_slack(means.T, thresholds) >= 0, axis=-1)
            if eligible.any():
                assert solution.value >= singles[eligible].max() - 1e-9 * max(1.0, abs(solution.value))
    else:
        assert solution.largest_shortfall > 0


def test_solving_prints_nothing_on_stdout():
    # highspy's Python wrapper prints HiGHS's banner from C++ on the first instance of a process,
    # which would corrupt the JSON `pasto simulate` prints; a fresh process shows whether it leaks.
    import subprocess
    import sys

    script = (
        "import numpy as np\n"
        "from pasto.objectives import Objective\n"
        "from pasto.optimum import solve\n"
        "objective = Objective.from_spec(['x', 'y'], {'primary': 'x', 'guardrails': "
        "[{'metric': 'y', 'threshold': 0.0, 'penalty': 5.0}]})\n"
        "solve(objective, np.array([[2.0, 0.0], [-2.0, 2.0]]))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert run.stdout == ""


# The API admits metric values, thresholds, weights and penalties up to 1e100 in magnitude (service
# schemas MAX_MAGNITUDE): HiGHS treats |values| >= 1e20 as infinite and drops entries below 1e-9, so
# unscaled such instances made solve raise "HiGHS solved none of the formulations" (a 500 from the
# diagnostics endpoint under the schemathesis fuzz test).
MAGNITUDES = st.one_of(
    st.just(0.0),
    st.builds(lambda sign, exponent: sign * 10.0**exponent, st.sampled_from([-1.0, 1.0]), st.floats(-100, 100)),
)


def _check_valid(objective, means, thresholds, solution, k):
    p = solution.probabilities
    assert p.shape == (k,) and np.all(np.isfinite(p))
    assert np.all(p >= -1e-12) and abs(p.sum() - 1.0) <= 1e-12
    assert np.isfinite(solution.value)
    # Two roundings of the value: exact up to the size of its terms (a single arm's value shows it).
    singles = objective.value(means.T, thresholds)
    size = max(float(np.abs(singles).max()), 1e-300)
    assert solution.value == pytest.approx(_true_value(objective, means, thresholds, p), rel=1e-9, abs=1e-12 * size)
    rows = objective.guardrail_rows[objective.hard_indices]
    sizes = np.maximum(np.abs(means[rows]).max(axis=1), np.abs(thresholds[objective.hard_indices]))
    if solution.feasible:
        assert np.all(solution.hard_slack >= -1e-9 * sizes)
        eligible = np.all(objective.hard_slack(means.T, thresholds) >= 0, axis=-1)
        if eligible.any():
            # The solver's tolerances are relative to the data's size (arms 1e-9 apart of a spread
            # 1 are ties to it; so are shortfalls 1e-9 of their row's largest entry), not to the
            # optimum's value, which can be 0: the primary's range and each penalty times its row's
            # size squared.
            best = singles[eligible].max()
            soft = objective.soft_indices
            rows = objective.guardrail_rows[soft]
            row_sizes = np.maximum(np.abs(means[rows]).max(axis=1), np.abs(thresholds[soft]))
            scale = max(np.abs(singles).max(), abs(solution.value),
                        float(np.max(objective.penalties[soft] * row_sizes**2, initial=0.0)), 1e-300)
            assert solution.value >= best - 1e-8 * scale
    else:
        assert solution.largest_shortfall > 0


@settings(max_examples=150, deadline=None)
@given(
    k=st.integers(1, 20),
    kinds=st.lists(st.sampled_from(["soft", "hard"]), max_size=3),
    data=st.data(),
    shape=st.sampled_from(["spread", "identical arms", "one arm differs"]),
)
def test_solve_never_fails_on_magnitudes_the_api_admits(k, kinds, data, shape):
    g = len(kinds)
    values = lambda n: np.array(data.draw(st.lists(MAGNITUDES, min_size=n, max_size=n)))  # noqa: E731
    thresholds = values(g)
    penalties = np.abs(values(g))
    weight = float(abs(data.draw(MAGNITUDES))) or 1.0
    guardrails = tuple(
        Guardrail(metric=f"y{j}", threshold=float(thresholds[j]), hard=True) if kind == "hard"
        else Guardrail(metric=f"y{j}", threshold=float(thresholds[j]), penalty=float(penalties[j]))
        for j, kind in enumerate(kinds)
    )
    objective = Objective(metrics=("x",) + tuple(f"y{j}" for j in range(g)), primary=(("x", weight),),
                          guardrails=guardrails)
    means = values((g + 1) * k).reshape(g + 1, k)
    if shape != "spread":
        means = np.repeat(means[:, :1], k, axis=1)
    if shape == "one arm differs":
        means[:, -1] = values(g + 1)
    resolved = objective.thresholds(means)
    _check_valid(objective, means, resolved, solve(objective, means), k)


@pytest.mark.parametrize("seed", range(40))
def test_scaled_instances_keep_the_enumerated_optimum(seed):
    # Scaling metric j by s_j (its threshold too, its penalty by 1 / s_j^2) and the primary by w
    # leaves the optimal mixture unchanged and multiplies the objective by w: the solver must find
    # it at any factors between 1e-100 and 1e100, to the oracle's accuracy.
    rng = np.random.default_rng(1000 + seed)
    k, n_guardrails = int(rng.integers(2, 7)), int(rng.integers(1, 4))
    objective, means, thresholds = _random_instance(rng, k, n_guardrails)
    reference, _ = _oracle(objective, means, thresholds, np.zeros(k))
    factors = 10.0 ** rng.uniform(-80, 80, n_guardrails + 1)
    primary_scale = 10.0 ** rng.uniform(-80, 80)
    guardrails = tuple(
        Guardrail(metric=g.metric, threshold=g.threshold * factors[j + 1], hard=g.hard,
                  penalty=0.0 if g.hard else g.penalty * primary_scale / factors[j + 1] ** 2)
        for j, g in enumerate(objective.guardrails)
    )
    scaled = Objective(metrics=objective.metrics, primary=(("x", primary_scale / factors[0]),),
                       guardrails=guardrails)
    scaled_means = means * factors[:, None]
    solution = solve(scaled, scaled_means)
    if reference is None:  # infeasible at every scale, and reported so
        assert not solution.feasible and solution.largest_shortfall > 0
        assert np.isnan(solution.shadow_prices).all()
        return
    assert solution.feasible
    assert solution.value == pytest.approx(reference * primary_scale, rel=1e-6)


def test_degenerate_shapes_the_api_can_produce():
    huge = Objective(metrics=("x", "y0", "y1"), primary=(("x", 1e100),), guardrails=(
        Guardrail(metric="y0", threshold=1e50, penalty=1e100),
        Guardrail(metric="y1", threshold=1e100, hard=True),
    ))
    # One arm: the only mixture, whatever the magnitudes (its hard guardrail broken).
    single = solve(huge, np.array([[1e100], [0.0], [0.0]]))
    np.testing.assert_array_equal(single.probabilities, [1.0])
    assert not single.feasible and single.largest_shortfall == pytest.approx(1e100)
    # Identical arms: every mixture is the same; penalty 1e100 on a shortfall 1e50 is -1e200.
    identical = solve(huge, np.array([[1e-100] * 3, [0.0] * 3, [1e100] * 3]))
    assert identical.feasible and identical.value == pytest.approx(1e-200 - 1e200)
    np.testing.assert_allclose(identical.probabilities, [1 / 3] * 3)
    # Penalty 1e100 on shortfalls 1e50 against primary 1e200: with q on the first arm (the third
    # meets y0), 1e200 q - 1e100 (1e50 q)^2 is best at q = 1/2.
    means = np.array([[1e100, 1e99, 0.0], [0.0, 0.0, 1e50], [1e100, 1e100, 1e100]])
    solution = solve(huge, means)
    assert solution.feasible
    np.testing.assert_allclose(solution.probabilities, [0.5, 0.0, 0.5], rtol=1e-9, atol=1e-12)
    assert solution.value == pytest.approx(0.25e200, rel=1e-9)
    # Tiny values (1e-100) throughout: the same problem as at unit scale.
    tiny = Objective(metrics=("x", "y0"), primary=(("x", 1e-100),),
                     guardrails=(Guardrail(metric="y0", threshold=0.5e-100, hard=True),))
    small = solve(tiny, np.array([[2e-100, 0.0], [0.0, 1e-100]]))
    np.testing.assert_allclose(small.probabilities, [0.5, 0.5], rtol=1e-9)
    assert small.feasible and small.shadow_prices[0] == pytest.approx(2e-100 / 1e-100 * 1e-100, rel=1e-6)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), spread=st.sampled_from([0.0, 0.01, 0.3, 2.0]))
def test_a_warm_start_finds_the_optimum_solve_finds_cold(seed, spread):
    """A nearby problem's active set is only a first guess: the answer is the cold optimum (the
    enumeration's), to the bit when both sit on the same active set; spread 2 makes the nearby
    problem an unrelated one, whose active set must fail its checks and leave HiGHS to solve."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(2, 7))
    objective, means, thresholds = _random_instance(rng, k, int(rng.integers(0, 4)))
    nearby = means + spread * rng.normal(size=means.shape)
    start = solve(objective, nearby, objective.thresholds(nearby))
    cold = solve(objective, means, thresholds)
    warm = solve(objective, means, thresholds, warm_start=start)
    assert warm.feasible == cold.feasible
    if not cold.feasible:
        return
    reference, _ = _oracle(objective, means, thresholds, np.zeros(k))
    assert _close(warm.value, reference), (warm.value, reference)
    assert warm.optimality_gap <= 1e-9 * max(1.0, abs(reference))
    if start.active_set is not None and cold.active_set is not None and all(
            np.array_equal(a, b) for a, b in zip(start.active_set, cold.active_set)):
        assert np.array_equal(warm.probabilities, cold.probabilities)


def test_a_warm_start_over_other_arms_is_refused():
    objective, means, thresholds = _random_instance(np.random.default_rng(0), 4, 2)
    start = solve(objective, means[:, :3], objective.thresholds(means[:, :3]))
    with pytest.raises(ValueError, match="warm start is a solution over 3 arms; this problem has 4"):
        solve(objective, means, thresholds, warm_start=start)


def test_a_warm_start_of_another_objective_is_refused():
    objective, means, thresholds = _random_instance(np.random.default_rng(1), 4, 2)
    other = _objective(["hard", "hard", "hard"], [0.0] * 3, [0.0] * 3)
    start = solve(other, np.random.default_rng(2).uniform(-1, 1, (4, 4)))
    with pytest.raises(ValueError, match="objective with other guardrails"):
        solve(objective, means, thresholds, warm_start=start)
