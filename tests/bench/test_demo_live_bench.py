"""bench/demo_live.py and bench/demo_served_replica.py: the live demo check and its offline replica.

Short runs only: each script applies the demo's true means to the served mixtures and reports per
round. Round 0 serves the uniform mixture, whose true like rate is 0.0540 < 0.06 (the mean of the 20
blends' like rates): both must report it broken, which checks that the truth, not an estimate, is
applied.
"""

from __future__ import annotations

import re

import pytest

from tests.bench.conftest import bench_script


@pytest.mark.timeout(300)
def test_the_live_check_reports_every_round_under_the_truth(capsys):
    with bench_script("demo_live") as module:
        status = module.main(["--rounds", "3", "--round-seconds", "1", "--sessions-per-second", "300"])
    output = capsys.readouterr().out
    rows = re.findall(r"^ +(\d+) +(\d+) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +(yes|NO)$",
                      output, flags=re.MULTILINE)
    assert [int(row[0]) for row in rows][:3] == [0, 1, 2]
    round_zero = rows[0]
    assert float(round_zero[2]) == pytest.approx(0.05395, abs=1e-5) and round_zero[7] == "NO"
    assert "rounds from 10 on breaking a guardrail (tolerance 0 of the threshold): none" in output
    assert status == 0


@pytest.mark.timeout(300)
def test_the_replica_counts_runs_breaking_a_guardrail(capsys):
    with bench_script("demo_served_replica") as module:
        module.main(["--runs", "3", "--rounds", "4", "--sessions-per-round", "600", "--after", "0"])
    output = capsys.readouterr().out
    rows = re.findall(r"^ +(\d+) +([\d.]+)% ", output, flags=re.MULTILINE)
    assert [int(row[0]) for row in rows] == [0, 1, 2, 3]
    assert float(rows[0][1]) == 100.0  # the uniform round 0 breaks the like rate in every run
    assert "runs breaking a guardrail in some round from 0 on: 100.0% (3 of 3)" in output
