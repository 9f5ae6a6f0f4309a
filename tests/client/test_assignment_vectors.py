"""The golden vectors of the assignment contract (spec/assignment-vectors.json, docs/assignment.md)
against pasto.hashing and LocalAssigner; a changed hash constant must fail them."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict

import pytest

import pasto.hashing
from pasto.hashing import bucket, buckets, cumulative_probabilities, fmix32, fnv1a_32
from pasto_client import LocalAssigner
from tests.assignment_vectors import GENERATOR_PATH, cases, experiment_document, generator, mixture, vectors


def local_assigner_mismatches(largest_k: int = 10_000) -> list[str]:
    """Cases on which LocalAssigner (assign and assign_many) differs from the vectors, grouped by the
    experiment state they need (one offline assigner per seed, round and mixture); only mixtures of
    at most ``largest_k`` arms."""
    groups: dict[tuple, list] = defaultdict(list)
    for case in cases():
        if case.mixture is not None and len(mixture(case.mixture)) > largest_k:
            continue
        groups[(case.seed, case.round, case.mixture, case.segments)].append(case)
    problems = []
    for (seed, round_index, mixture_name, segment_set), members in groups.items():
        assigner = LocalAssigner(None, "vectors", experiment=experiment_document(
            seed, round_index, mixture_name, segment_set))
        for case in members:
            try:
                answer = assigner.assign(case.unit, case.segment)
            except ValueError:
                if case.error is None:
                    problems.append(f"{case}: refused")
                continue
            if case.error is not None:
                problems.append(f"{case}: not refused")
                continue
            expected = case.expected
            got = (answer.arm, answer.probability, answer.segment)
            want = (f"arm-{expected['arm']}", expected["probability"], expected.get("served_segment"))
            if got != want:
                problems.append(f"{case.unit!r} seed {seed} round {round_index}: {got} != {want}")
        valid = [case for case in members if case.error is None]
        if valid:
            segments = None if segment_set is None else [case.segment for case in valid]
            many = assigner.assign_many([case.unit for case in valid], segments)
            for case, answer in zip(valid, many):
                if answer.arm != f"arm-{case.expected['arm']}":
                    problems.append(f"assign_many {case.unit!r} seed {seed} round {round_index}: {answer.arm}")
        assigner.close()
    return problems


def test_the_vectors_cover_what_the_contract_promises():
    all_cases = cases()
    ks = {len(mixture(name)) for name in vectors()["mixtures"]}
    assert min(ks) == 2 and max(ks) == 10_000
    assert any(p == 0.0 for name in vectors()["mixtures"] for p in mixture(name))
    assert any(0.0 < p < 1e-11 for name in vectors()["mixtures"] for p in mixture(name))
    assert any(not case.unit.isascii() for case in all_cases)
    assert any(len(case.unit) > 1000 for case in all_cases)
    assert len({case.seed for case in all_cases}) >= 8 and len({case.round for case in all_cases}) >= 7
    assert {case.error for case in all_cases} >= {None, "segment_required", "segment_unknown", "segment_not_accepted"}
    assert any(case.segments == "open" and case.expected.get("served_segment") == "(other)"
               and case.segment not in (None, "(other)") for case in all_cases)
    # Arms spread: the large mixtures' cases do not all land on one arm.
    assert len({case.expected["arm"] for case in all_cases if case.mixture == "k10000-lcg"}) > 30


def test_the_file_is_what_the_generator_writes():
    completed = subprocess.run([sys.executable, str(GENERATOR_PATH), "--check"], capture_output=True, text=True,
                               timeout=120)
    assert completed.returncode == 0, completed.stderr


def test_pasto_hashing_reproduces_every_case():
    contract = generator()
    for name, spec in vectors()["mixtures"].items():
        assert contract.cumulative_sha256(cumulative_probabilities(mixture(name))) == spec["sha256"], name
    for case in cases():
        if case.error is not None:
            continue
        key = f"{case.seed}:{case.round}:{case.unit}".encode()
        assert fnv1a_32(key) == case.expected["fnv"], case
        assert fmix32(case.expected["fnv"]) == case.expected["hash"], case
        assert bucket(case.seed, case.unit, case.round) == case.expected["bucket"], case
        assert pasto.hashing.PrefixHasher(case.seed, case.round)(case.unit) == case.expected["bucket"], case
    by_state = defaultdict(list)
    for case in cases():
        by_state[(case.seed, case.round)].append(case)
    for (seed, round_index), members in by_state.items():
        vectorised = buckets(seed, [case.unit for case in members], round_index)
        assert vectorised.tolist() == [case.expected.get("bucket", vectorised[i]) for i, case in enumerate(members)]


def test_the_summation_order_matters_for_large_mixtures():
    """The sha256 of the cumulative probabilities pins numpy's pairwise sum: the left-to-right sum gives
    other bits for the K >= 1,000 mixtures, so a port with the wrong order fails the vectors."""
    contract = generator()
    differs = []
    for name, spec in vectors()["mixtures"].items():
        p = list(mixture(name))
        running, plain = 0.0, []
        total = sum(p)
        for value in p:
            running += value
            plain.append(running / total)
        plain[-1] = 1.0
        if contract.cumulative_sha256(plain) != spec["sha256"]:
            differs.append(name)
    assert "k10000-lcg" in differs and "two-even" not in differs


def test_local_assigner_reproduces_every_case():
    assert local_assigner_mismatches() == []


@pytest.mark.parametrize("constant, value", [("FNV_PRIME", 16777619 + 2), ("FNV_OFFSET_BASIS", 2166136261 ^ 1)])
def test_a_changed_hash_constant_fails_the_vectors(monkeypatch, constant, value):
    monkeypatch.setattr(pasto.hashing, constant, value)
    if constant == "FNV_OFFSET_BASIS":  # a default argument: bound when the module was loaded
        monkeypatch.setattr(pasto.hashing.fnv1a_32, "__defaults__", (value,))
    mismatches = local_assigner_mismatches(largest_k=1000)
    valid = sum(case.error is None and case.segments is None and len(mixture(case.mixture)) <= 1000
                for case in cases())
    assert len(mismatches) > valid // 4, f"only {len(mismatches)} of {valid} cases noticed the change"
