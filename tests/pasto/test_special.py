"""pasto.special: scipy.special's functions, imported only when first called."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from pasto import special

# scipy is imported inside the tests: importing it here would cost every xdist worker its import at
# collection, which is what pasto.special exists to spare.


def test_each_function_is_scipys_to_the_bit():
    import scipy.special

    rng = np.random.default_rng(3)
    x = rng.normal(scale=4.0, size=(7, 50))
    p = rng.uniform(size=(7, 50))
    assert np.array_equal(special.ndtr(x), scipy.special.ndtr(x))
    assert np.array_equal(special.ndtri(p), scipy.special.ndtri(p))
    assert np.array_equal(special.logsumexp(x, axis=-1, keepdims=True),
                          scipy.special.logsumexp(x, axis=-1, keepdims=True))
    assert np.array_equal(special.softmax(x, axis=-1), scipy.special.softmax(x, axis=-1))


def test_stdtrit_is_the_student_t_quantile_stats_computes():
    # The deploy tests' Student-t quantile was stats.t.ppf(level, degrees): the same numbers.
    from scipy import stats

    degrees = np.concatenate([np.arange(1.0, 3001.0), np.random.default_rng(4).uniform(1.0, 1e6, 2000)])
    for level in (0.5, 0.8, 0.9, 0.95, 0.975, 0.99, 0.999):
        assert np.array_equal(special.stdtrit(degrees, level), stats.t.ppf(level, degrees))


def test_importing_the_core_does_not_import_scipy_special():
    # Every process that imports the service imports these modules; most never compute with them.
    code = ("import sys; import pasto.algorithm, pasto.serving, pasto.optimum, pasto.diagnostics, pasto.report, "
            "pasto.segments; print(sorted(m for m in sys.modules if m.startswith('scipy.special')))")
    before = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert before.strip() == "[]"
    code = "from pasto.special import ndtr; ndtr(0.0); import sys; print('scipy.special' in sys.modules)"
    after = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert after.strip() == "True"
