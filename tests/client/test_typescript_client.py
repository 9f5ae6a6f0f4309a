"""The TypeScript reference implementation (clients/typescript): its own test command passes the golden
vectors, and OpenFeature's Node OFREP provider, unchanged, evaluates a running pasto experiment as
/assign assigns. Needs Node 20 and npm (.ci/run installs the package's dependencies with ``npm ci``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.assignment_vectors import REPOSITORY

PACKAGE = REPOSITORY / "clients" / "typescript"
N_UNITS = 10_000


@pytest.fixture(scope="module")
def package() -> str:
    """The package, installed (``npm ci`` when node_modules is missing) and compiled; its directory."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("node and npm are needed by clients/typescript (.ci/run installs them)")
        pytest.skip("node and npm are not installed")
    if not (PACKAGE / "node_modules").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=PACKAGE, check=True, capture_output=True,
                       timeout=300)
    subprocess.run(["npm", "run", "build"], cwd=PACKAGE, check=True, capture_output=True, timeout=300)
    return str(PACKAGE)


def test_npm_test_passes_the_golden_vectors(package):
    completed = subprocess.run(["npm", "test"], cwd=package, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "# fail 0" in completed.stdout and "# pass 6" in completed.stdout, completed.stdout[-2000:]


def test_the_node_ofrep_provider_evaluates_a_running_experiment(package, server, admin, create_experiment,
                                                                true_means, tmp_path):
    name = create_experiment()
    segmented = create_experiment(segments=["web", "app"], objective={
        "primary": "watch_time", "guardrails": [{"metric": "like_rate", "threshold": 0.5, "hard": True}]})
    units = [f"user-{i}" for i in range(N_UNITS - 3)] + ["déjà vu", "ユーザー", "😀"]
    first = admin.assign_many(name, units[:2000])
    admin.observe(name, [{"id": f"o-{i}", "unit": units[i], "round": 0,
                          "values": dict(zip(("watch_time", "like_rate"), true_means[a.arm]))}
                         for i, a in enumerate(first)])
    admin.close_round(name)  # a mixture away from uniform
    expected = admin.assign_many(name, units)
    served = admin.get_experiment(name)
    (tmp_path / "units.json").write_text(json.dumps(units), encoding="utf-8")
    completed = subprocess.run(
        ["node", "dist/test/ofrep-interop.js"], cwd=package, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PASTO_URL": server.url, "PASTO_TOKEN": server.admin_token, "PASTO_FLAG": name,
             "PASTO_SEGMENTED_FLAG": segmented, "PASTO_UNITS": str(tmp_path / "units.json")})
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout)
    evaluations = result["evaluations"]
    assert len(evaluations) == len(units)
    arms = [arm["name"] for arm in served["arms"]]
    for want, got in zip(expected, evaluations):
        assert (got["variant"], got["value"], got["reason"], got["errorCode"]) == (
            want.arm, dict(want.params), "SPLIT", None)
        assert got["metadata"]["propensity"] == want.probability == served["probabilities"][arms.index(want.arm)]
        assert got["metadata"]["round"] == 1 and got["metadata"]["mixture_version"] == served["updated_at"]
    errors = result["errors"]
    assert errors["noTargetingKey"]["errorCode"] == "TARGETING_KEY_MISSING"
    assert errors["unknownFlag"]["errorCode"] == "FLAG_NOT_FOUND"
    assert errors["overlongUnit"]["errorCode"] == "INVALID_CONTEXT"
    assert errors["noSegment"]["errorCode"] == "INVALID_CONTEXT"
    assert errors["unknownSegment"]["errorCode"] == "INVALID_CONTEXT"
    assert all(errors[key]["value"] == {"fallback": True} for key in errors if key != "web")
    web = errors["web"]
    assert (web["variant"], web["metadata"]["segment"]) == (admin.assign(segmented, "u", segment="web").arm, "web")
