"""Speed-ups of the segmented simulation keep its figures: scenario 1 (segments-global-guardrail),
two runs of 120 rounds for two seeds, against values recorded from the code before them (commit
0296036: before safe serving skipped the largest-slack LP when the hopeful mixture already meets every
bound, and before the segmented update stopped having safe serving choose mixtures its joint step
replaces).

Tolerance: 1e-12 absolute, not exact equality, because a matrix product may differ in its last bits
between BLAS kernels on other CPUs; on the recording machine the figures are bit-identical, and any
change of the algorithm moves them by far more (a different served mixture changes every draw after it).
"""

from __future__ import annotations

import numpy as np
import pytest

from pasto.cli import load_scenario
from pasto.segmented_simulate import simulate_segmented
from pasto.segments import SegmentedConfig

RECORDED = {
    0: {
        "values": [[0.613597643281478, 0.6287072529554153], [0.6199542018943136, 0.6407548731163866]],
        "slack": [[[0.026402356718521966], [0.011292747044584744]], [[0.02004579810568638], [-0.0007548731163865077]]],
        "primary": [[[1.0, 0.2453254776049267, 0.2], [1.0, 0.2956908431847176, 0.2]],
                    [[1.0, 0.26651400631437877, 0.2], [1.0, 0.33584957705462176, 0.2]]],
    },
    7: {
        "values": [[0.5677533223319327, 0.4360460461441381], [0.56892615273702, 0.4324407446442414]],
        "slack": [[[0.07224667766806728], [0.023514625649654952]], [[0.07107384726298], [0.026719338094007644]]],
        "primary": [[[0.4555066446638655, 1.0, 0.2], [0.2720920922882763, 1.0, 0.0]],
                    [[0.4578523054740401, 1.0, 0.2], [0.2648814892884828, 1.0, 0.0]]],
    },
}


@pytest.mark.parametrize("seed", sorted(RECORDED))
def test_scenario_one_reproduces_the_recorded_figures(seed):
    scenario = load_scenario("segments-global-guardrail").with_overrides(runs=2, seed=seed, rounds=120)
    result = simulate_segmented(scenario, SegmentedConfig(scopes=scenario.segments.scopes))
    recorded = RECORDED[seed]
    assert result.checkpoints == (100, 120)
    np.testing.assert_allclose(result.deployed_values, recorded["values"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(result.global_slack, recorded["slack"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(result.segment_primary, recorded["primary"], rtol=0, atol=1e-12)
