"""Best mixture / best single arm / regret against brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


from pasto.objectives import Objective
from pasto.optimum import (
    best_mixture,
    best_single,
    expected_objective,
    expected_optimum,
    mirror_ascent,
    per_round_regret,
    regret,
    solve,
)

OBJECTIVE_A = Objective.from_spec(
    ["x", "y"], {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "penalty": 5.0}]}
)
OBJECTIVE_B = Objective.from_spec(
    ["x", "y1", "y2"],
    {"primary": "x", "guardrails": [
        {"metric": "y1", "threshold": 0.5, "penalty": 5.0},
        {"metric": "y2", "threshold": 0.5, "penalty": 5.0}]},
)


def _simplex_grid(k: int, n: int) -> np.ndarray:
    points = [c for c in itertools.product(range(n + 1), repeat=k - 1) if sum(c) <= n]
    return np.array([list(c) + [n - sum(c)] for c in points], dtype=float) / n


def test_paper_example_optimum():
    p, value = best_mixture(OBJECTIVE_A, np.array([[2.0, 0.0], [-2.0, 2.0]]))
    np.testing.assert_allclose(p, [0.5125, 0.4875], atol=1e-7)
    assert value == pytest.approx(1.0125, abs=1e-10)
    assert best_single(OBJECTIVE_A, np.array([[2.0, 0.0], [-2.0, 2.0]])) == (1, 0.0)


@pytest.mark.parametrize("seed", range(6))
def test_best_mixture_matches_brute_force_k3(seed):
    rng = np.random.default_rng(seed)
    means = rng.uniform(-1, 1, size=(3, 3))
    grid = _simplex_grid(3, 400)
    brute = OBJECTIVE_B.mixture_value(means, grid).max()
    p, value = best_mixture(OBJECTIVE_B, means)
    assert value >= brute - 1e-12
    assert value - brute < 1e-3  # the grid's resolution
    assert p.min() >= 0 and p.sum() == pytest.approx(1.0, abs=1e-12)
    assert OBJECTIVE_B.mixture_value(means, p) == pytest.approx(value)


def test_best_mixture_batched_matches_loop():
    rng = np.random.default_rng(7)
    means = rng.uniform(-1, 1, size=(2, 2, 3, 8))
    p, values = best_mixture(OBJECTIVE_B, means)
    assert p.shape == (2, 2, 8) and values.shape == (2, 2)
    for index in np.ndindex(2, 2):
        assert values[index] == pytest.approx(best_mixture(OBJECTIVE_B, means[index])[1], abs=1e-10)


def test_mixture_never_worse_than_best_single_and_linear_is_single():
    rng = np.random.default_rng(8)
    means = rng.uniform(-1, 1, size=(3, 50))
    assert best_mixture(OBJECTIVE_B, means)[1] >= best_single(OBJECTIVE_B, means)[1] - 1e-12
    linear = Objective.from_spec(["x", "y1", "y2"], {"primary": "x"})
    p, value = best_mixture(linear, means)
    assert value == pytest.approx(means[0].max())


def test_regret_is_zero_at_optimum_and_positive_elsewhere():
    means = np.array([[2.0, 0.0], [-2.0, 2.0]])
    assert regret(OBJECTIVE_A, means, np.array([0.5125, 0.4875])) == pytest.approx(0.0, abs=1e-9)
    assert regret(OBJECTIVE_A, means, np.array([0.0, 1.0])) == pytest.approx(1.0125)


def test_per_round_regret_with_stationary_means():
    means = np.broadcast_to(np.array([[2.0, 0.0], [-2.0, 2.0]]), (3, 2, 2))
    probabilities = np.array([[0.0, 1.0], [0.5, 0.5], [0.5125, 0.4875]])
    result = per_round_regret(OBJECTIVE_A, means, probabilities, estimates_by_round=means)
    np.testing.assert_allclose(result["regret"], [1.0125, 0.0125, 0.0], atol=1e-9)
    np.testing.assert_allclose(result["cumulative_regret"], [1.0125, 1.025, 1.025], atol=1e-9)
    np.testing.assert_allclose(result["empirical_regret"], result["regret"])


def test_mirror_ascent_is_monotone_and_batched():
    rng = np.random.default_rng(9)
    means = rng.uniform(-1, 1, size=(5, 3, 20))
    thresholds = OBJECTIVE_B.thresholds(means)
    values = []
    log_p = None
    for _ in range(5):
        log_p = mirror_ascent(OBJECTIVE_B, means, thresholds, log_p, steps=20)
        values.append(OBJECTIVE_B.mixture_value(means, np.exp(log_p), thresholds))
    assert np.all(np.diff(np.array(values), axis=0) >= -1e-12)
    _, optimum = best_mixture(OBJECTIVE_B, means)
    assert np.all(optimum - values[-1] < 1e-3)


def test_expected_objective_gradient_and_monte_carlo_value():
    rng = np.random.default_rng(10)
    means = rng.uniform(-1, 1, size=(3, 6))
    errors = rng.uniform(0.0, 0.3, size=(3, 6))
    p = rng.dirichlet(np.ones(6))
    variances = errors[OBJECTIVE_B.guardrail_rows] ** 2
    thresholds = OBJECTIVE_B.thresholds(means)
    value, gradient = expected_objective(OBJECTIVE_B, means, variances, thresholds, p)
    h = 1e-6
    numeric = [
        (expected_objective(OBJECTIVE_B, means, variances, thresholds, p + h * e)[0]
         - expected_objective(OBJECTIVE_B, means, variances, thresholds, p - h * e)[0]) / (2 * h)
        for e in np.eye(6)
    ]
    np.testing.assert_allclose(gradient, numeric, atol=1e-6)
    draws = means + errors * rng.standard_normal((200_000, 3, 6))
    sampled = OBJECTIVE_B.mixture_value(draws, p, thresholds)
    assert abs(sampled.mean() - value) < 4 * sampled.std() / np.sqrt(len(sampled))


def test_expected_objective_without_uncertainty_is_the_plug_in_value():
    rng = np.random.default_rng(11)
    means = rng.uniform(-1, 1, size=(4, 3, 5))
    p = rng.dirichlet(np.ones(5), size=4)
    thresholds = OBJECTIVE_B.thresholds(means)
    value, _ = expected_objective(OBJECTIVE_B, means, np.zeros((4, 2, 5)), thresholds, p)
    np.testing.assert_allclose(value, OBJECTIVE_B.mixture_value(means, p, thresholds))


def test_hedged_solution_keeps_a_safety_margin_on_an_uncertain_guardrail():
    means = np.array([[2.0, 0.0], [-2.0, 2.0]])
    thresholds = OBJECTIVE_A.thresholds(means)
    plug_in = np.exp(mirror_ascent(OBJECTIVE_A, means, thresholds, steps=300))
    errors = np.full((2, 2), 0.3)
    hedged = np.exp(mirror_ascent(OBJECTIVE_A, means, thresholds, steps=300, standard_errors=errors))
    np.testing.assert_allclose(plug_in, [0.5125, 0.4875], atol=1e-4)
    assert hedged[0] < plug_in[0] - 0.01  # less of the arm that breaks the guardrail


@pytest.mark.parametrize("seed", range(4))
def test_best_mixture_matches_brute_force_k2(seed):
    rng = np.random.default_rng(100 + seed)
    means = rng.uniform(-2, 2, size=(2, 2))
    grid = _simplex_grid(2, 20_000)
    brute = OBJECTIVE_A.mixture_value(means, grid).max()
    _, value = best_mixture(OBJECTIVE_A, means)
    assert brute - 1e-12 <= value < brute + 1e-6


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 4), st.integers(0, 3), st.integers(0, 2**32 - 1))
def test_linear_program_matches_vertex_enumeration(n, n_rows, seed):
    """pasto.optimum.linear_program against an independent oracle: every vertex of {A x <= b, sum x = 1,
    x >= 0} enumerated (n active constraints solved as a linear system), the cheapest feasible one."""
    from pasto.optimum import linear_program

    rng = np.random.default_rng(seed)
    cost, rows, bounds = rng.normal(size=n), rng.normal(size=(n_rows, n)), rng.normal(size=n_rows) + 0.3
    solved, x, duals = linear_program(cost, rows, bounds, np.ones((1, n)), [1.0])
    # Active sets: the equality, plus n - 1 of the inequality rows and the bounds x_i >= 0.
    candidates = [(rows[i], bounds[i]) for i in range(n_rows)] + [(-np.eye(n)[i], 0.0) for i in range(n)]
    best = None
    for active in itertools.combinations(candidates, n - 1):
        system = np.vstack([np.ones(n)] + [row for row, _ in active])
        if abs(np.linalg.det(system)) < 1e-9:
            continue
        vertex = np.linalg.solve(system, np.r_[1.0, [bound for _, bound in active]])
        if np.all(vertex >= -1e-9) and np.all(rows @ vertex <= bounds + 1e-9):
            best = vertex if best is None or cost @ vertex < cost @ best else best
    assert solved == (best is not None)
    if solved:
        assert cost @ x == pytest.approx(cost @ best, abs=1e-8)
        assert np.all(rows @ x <= bounds + 1e-8) and x.sum() == pytest.approx(1.0) and np.all(x >= -1e-9)
        assert duals.shape == (n_rows,) and np.all(duals <= 1e-9)


OBJECTIVE_RELATIVE = Objective.from_spec(
    ["x", "y"], {"primary": "x", "guardrails": [{"metric": "y", "threshold": -0.01, "relative_to": "2", "penalty": 10.0}]},
    arm_names=[str(k) for k in range(6)],
)


def _slsqp_optimum(objective, means, errors, thresholds, rng, starts=4):
    """The oracle: E f maximised from several random starts by SLSQP (scipy), a different method."""
    # Imported here: scipy.optimize takes 0.4 s of CPU to import, in every xdist worker that collects.
    from scipy.optimize import minimize

    variances = errors[objective.guardrail_rows] ** 2
    k = means.shape[1]

    def negative(p):
        value, gradient = expected_objective(objective, means, variances, thresholds, p)
        return -value, -gradient

    best = -np.inf
    for start in rng.dirichlet(np.ones(k), size=starts):
        result = minimize(negative, start, jac=True, method="SLSQP", bounds=[(0.0, 1.0)] * k,
                          constraints=[{"type": "eq", "fun": lambda p: p.sum() - 1.0, "jac": lambda p: np.ones(k)}],
                          options={"maxiter": 1000, "ftol": 1e-14})
        # SLSQP's last iterate can leave the simplex when it fails: judged where it lands on it.
        mixture = np.clip(result.x, 0.0, None)
        best = max(best, -negative(mixture / mixture.sum())[0])
    return best


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), relative=st.booleans(), scale=st.sampled_from([0.01, 1.0, 100.0]))
def test_expected_optimum_matches_an_independent_optimiser_and_certifies_its_gap(seed, relative, scale):
    rng = np.random.default_rng(seed)
    objective = OBJECTIVE_RELATIVE if relative else OBJECTIVE_B
    k = 6 if relative else 5
    means = rng.uniform(-1.0, 1.0, size=(objective.n_metrics, k))
    errors = rng.uniform(0.0, 0.4, size=means.shape)
    if relative:
        # A metric around 100 with effects of 1% (scale 1) to 0.01% (scale 0.01), as in the online regime.
        means = 100.0 + scale * means
        errors = scale * errors
    thresholds = objective.thresholds(means)
    solution = expected_optimum(objective, means, errors, thresholds)
    p = solution.probabilities
    assert np.all(p >= 0) and p.sum() == pytest.approx(1.0, abs=1e-12)
    value, _ = expected_objective(objective, means, errors[objective.guardrail_rows] ** 2, thresholds, p)
    assert solution.value == pytest.approx(float(value), abs=1e-12 * (1 + abs(value)))
    oracle = _slsqp_optimum(objective, means, errors, thresholds, rng)
    spread = np.ptp(means[0])
    # Never worse than the oracle beyond the stopping tolerance, and the gap bounds the distance.
    assert solution.value >= oracle - 1e-6 * spread - 1e-9
    assert solution.value + solution.optimality_gap >= oracle - 1e-9 * (1 + abs(oracle))
    assert solution.optimality_gap <= 1e-6 * spread + 1e-9 * (1 + abs(oracle))


def test_expected_optimum_without_uncertainty_is_the_exact_optimum():
    rng = np.random.default_rng(3)
    for _ in range(5):
        means = rng.uniform(-1, 1, size=(3, 7))
        thresholds = OBJECTIVE_B.thresholds(means)
        exact = solve(OBJECTIVE_B, means, thresholds)
        hedged = expected_optimum(OBJECTIVE_B, means, np.zeros_like(means), thresholds, start=np.full(7, 1 / 7))
        assert hedged.value == pytest.approx(exact.value, abs=1e-6)


def test_expected_optimum_leaves_a_vertex_in_one_step_where_multiplicative_updates_cannot():
    # The previous optimum is the single arm 0; the new one mixes arms 1 and 2. Mirror ascent
    # warm-started from arm 0 (the others at e^-30) is still there after 50 steps.
    means = np.array([[1.0, 2.0, 1.5], [1.0, -2.0, 2.0]])
    errors = np.full((2, 3), 0.05)
    thresholds = OBJECTIVE_A.thresholds(means)
    start = np.array([1.0, 0.0, 0.0])
    solution = expected_optimum(OBJECTIVE_A, means, errors, thresholds, start=start)
    assert solution.probabilities[0] < 1e-9
    assert solution.probabilities[1] > 0.1 and solution.probabilities[2] > 0.1
    stuck = np.exp(mirror_ascent(OBJECTIVE_A, means, thresholds, np.log(np.maximum(start, np.exp(-30.0))), 50,
                                 standard_errors=errors))
    assert stuck[0] > 0.5


def test_expected_optimum_respects_minimum_shares_and_refuses_hard_guardrails():
    means = np.array([[2.0, 0.0, 1.0], [-2.0, 2.0, 0.0]])
    errors = np.full((2, 3), 0.1)
    solution = expected_optimum(OBJECTIVE_A, means, errors, min_shares=np.array([0.0, 0.0, 0.3]))
    assert solution.probabilities[2] >= 0.3 - 1e-12
    hard = Objective.from_spec(["x", "y"], {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "hard": True}]})
    with pytest.raises(ValueError, match="pass them to expected_optimum as constraints"):
        expected_optimum(hard, means, errors)


OBJECTIVE_MIXED = Objective.from_spec(
    ["x", "y", "z"],
    {"primary": "x", "guardrails": [{"metric": "y", "threshold": 0.0, "hard": True},
                                    {"metric": "z", "threshold": -0.05, "relative_to": "0", "penalty": 30.0}]},
    arm_names=[str(k) for k in range(6)],
)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), level=st.sampled_from([0.0, 1.0, 2.0]))
def test_expected_optimum_with_constraints_matches_an_independent_optimiser(seed, level):
    """Hard guardrails given as rows A p >= c (here y's lower bounds at ``level`` standard errors):
    against SLSQP with the same rows, from several starts."""
    from scipy.optimize import minimize

    rng = np.random.default_rng(seed)
    k = 6
    means = rng.uniform(-1.0, 1.0, size=(3, k))
    errors = rng.uniform(0.05, 0.4, size=means.shape)
    matrix, bounds = (means[1] - level * errors[1])[None, :], np.zeros(1)
    if matrix.max() <= 0:
        matrix[0, rng.integers(k)] = 0.5  # some arm meets the row: the feasible set is not empty
    thresholds = OBJECTIVE_MIXED.thresholds(means)
    solution = expected_optimum(OBJECTIVE_MIXED, means, errors, thresholds, constraints=(matrix, bounds),
                                start=rng.dirichlet(np.ones(k)) * rng.uniform(0.5, 3.0))  # as choose passes it: unnormalised
    p = solution.probabilities
    assert np.all(p >= 0) and p.sum() == pytest.approx(1.0, abs=1e-12)
    assert np.all(matrix @ p >= bounds - 1e-9)
    variances = errors[OBJECTIVE_MIXED.guardrail_rows] ** 2

    def negative(q):
        value, gradient = expected_objective(OBJECTIVE_MIXED, means, variances, thresholds, q)
        return -value, -gradient

    oracle = -np.inf
    for start in rng.dirichlet(np.ones(k), size=6):
        result = minimize(negative, start, jac=True, method="SLSQP", bounds=[(0.0, 1.0)] * k,
                          constraints=[{"type": "eq", "fun": lambda q: q.sum() - 1.0, "jac": lambda q: np.ones(k)},
                                       {"type": "ineq", "fun": lambda q: matrix @ q - bounds, "jac": lambda q: matrix}],
                          options={"maxiter": 1000, "ftol": 1e-14})
        if result.success and np.all(matrix @ result.x >= bounds - 1e-9) and abs(result.x.sum() - 1) < 1e-9:
            oracle = max(oracle, -result.fun)
    spread = np.ptp(means[0])
    assert solution.value >= oracle - 1e-6 * spread - 1e-9
    assert solution.value + solution.optimality_gap >= oracle - 1e-9 * (1 + abs(oracle))


@pytest.mark.parametrize("constrained", [False, True])
def test_expected_optimum_does_not_depend_on_the_metrics_scale(constrained):
    # The same problem in units 1, 1e-3 and 1e-6 (penalties rescaled to match): the same mixture.
    # In the metrics' own units HiGHS's absolute tolerances made a Newton step point downhill at
    # 1e-3 (value 0.895 instead of 0.936, gap 8e-2).
    rng = np.random.default_rng(0)
    k = 60
    means = rng.uniform(-1.0, 1.0, size=(3, k))
    errors = rng.uniform(0.05, 0.4, size=means.shape)
    matrix = (means[1] - errors[1])[None, :]
    solutions = []
    for scale in (1.0, 1e-3, 1e-6):
        objective = Objective.from_spec(["x", "y", "z"], {"primary": "x", "guardrails": [
            {"metric": "y", "threshold": 0.0, "hard": True},
            {"metric": "z", "threshold": -0.05, "relative_to": "0", "penalty": 30.0 / scale}]},
            [str(i) for i in range(k)])
        if not constrained:
            objective = Objective.from_spec(["x", "y", "z"], {"primary": "x", "guardrails": [
                {"metric": "z", "threshold": -0.05, "relative_to": "0", "penalty": 30.0 / scale}]},
                [str(i) for i in range(k)])
        solution = expected_optimum(objective, means * scale, errors * scale,
                                    constraints=(matrix * scale, np.zeros(1)) if constrained else None)
        assert solution.optimality_gap <= 1e-6 * scale * np.ptp(means[0])
        solutions.append((solution.value / scale, solution.probabilities))
    for value, probabilities in solutions[1:]:
        assert value == pytest.approx(solutions[0][0], abs=1e-8)
        np.testing.assert_allclose(probabilities, solutions[0][1], atol=1e-5)


def test_expected_optimum_with_constraints_judges_the_start_as_a_mixture():
    # Arm 0 has the best x, arm 1 the y the row needs: the optimum is on y = 0.5. The start
    # (1, 0.9, 0) meets the row unnormalised (0.9) but not as a mixture (0.47): it is replaced.
    means = np.array([[2.0, 0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.3, 0.0, 0.0, 0.0], [0.0] * 6])
    errors = np.full(means.shape, 0.01)
    matrix, bounds = means[1][None, :], np.array([0.5])
    start = np.array([1.0, 0.9, 0.0, 0.0, 0.0, 0.0])
    solution = expected_optimum(OBJECTIVE_MIXED, means, errors, constraints=(matrix, bounds), start=start)
    assert matrix @ solution.probabilities >= bounds - 1e-9
    np.testing.assert_allclose(solution.probabilities[:2], [0.5, 0.5], atol=1e-9)


def test_expected_optimum_with_slack_constraints_is_the_unconstrained_one_and_refuses_empty_ones():
    rng = np.random.default_rng(5)
    means = rng.uniform(-1.0, 1.0, size=(3, 6))
    errors = np.full(means.shape, 0.1)
    thresholds = OBJECTIVE_MIXED.thresholds(means)
    soft = Objective.from_spec(["x", "y", "z"], {"primary": "x", "guardrails": [
        {"metric": "z", "threshold": -0.05, "relative_to": "0", "penalty": 30.0}]}, arm_names=[str(k) for k in range(6)])
    free = expected_optimum(soft, means, errors, thresholds[1:])
    slack = expected_optimum(OBJECTIVE_MIXED, means, errors, thresholds, constraints=(np.ones((1, 6)), np.zeros(1)))
    assert slack.value == pytest.approx(free.value, abs=1e-9)
    np.testing.assert_allclose(slack.probabilities, free.probabilities, atol=1e-6)
    with pytest.raises(ValueError, match="No mixture meets the constraints"):
        expected_optimum(OBJECTIVE_MIXED, means, errors, thresholds, constraints=(np.ones((1, 6)), np.full(1, 2.0)))


@pytest.mark.parametrize("kind", ["normal", "few values", "ascending", "descending", "infinite"])
def test_smallest_is_the_set_argpartition_selects(kind):
    # The working sets of solve and expected_optimum: the sampled search must pick the very set of
    # np.argpartition (ties included, where argpartition's own tie-breaking decides), so that the
    # solves' answers do not change.
    from pasto.optimum import _smallest

    rng = np.random.default_rng(7)
    for _ in range(60):
        size = int(rng.integers(401, 30_000))
        values = {
            "normal": lambda: rng.standard_normal(size),
            "few values": lambda: rng.integers(0, int(rng.integers(2, 400)), size).astype(float),
            "ascending": lambda: np.sort(rng.standard_normal(size)),
            "descending": lambda: -np.sort(rng.standard_normal(size)),
            "infinite": lambda: np.where(rng.random(size) < 0.01, np.inf, rng.standard_normal(size)),
        }[kind]()
        for count, kth in ((60, 60), (32, 31)):
            expected = np.sort(np.argpartition(values, kth)[:count])
            np.testing.assert_array_equal(np.sort(_smallest(values, count, kth)), expected)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8), st.integers(0, 40), st.integers(0, 2**32 - 1))
def test_coordinates_compress_as_scipy_sparse_does(n_rows, n_columns, n_entries, seed):
    """HiGHS gets the Newton model's matrix as scipy.sparse.csc_matrix would store it, to the bit
    (explicit zeros kept, rows sorted within a column), without scipy.sparse; repeated positions
    are summed (to rounding: scipy may add three or more in another order)."""
    from scipy import sparse

    from pasto.optimum import _columns, _Coordinates

    rng = np.random.default_rng(seed)
    rows, columns = rng.integers(0, n_rows, n_entries), rng.integers(0, n_columns, n_entries)
    values = rng.choice([0.0, 1.0, -2.5, 0.1, 3e-9], n_entries)
    for distinct in (False, True):
        if distinct:
            _, first = np.unique(rows * n_columns + columns, return_index=True)
            rows, columns, values = rows[first], columns[first], values[first]
        reference = sparse.csc_matrix((values, (rows, columns)), shape=(n_rows, n_columns))
        start, index, value = _columns(_Coordinates(rows, columns, values, (n_rows, n_columns)))
        assert start.dtype == reference.indptr.dtype and index.dtype == reference.indices.dtype
        assert np.array_equal(start, reference.indptr) and np.array_equal(index, reference.indices)
        if distinct:
            assert np.array_equal(value, reference.data)
        else:
            np.testing.assert_allclose(value, reference.data, rtol=1e-15, atol=1e-15)
