"""Write spec/assignment-vectors.json, the golden vectors of the assignment contract (docs/assignment.md).

Run from the repository root: ``.venv/bin/python spec/generate_assignment_vectors.py`` (``--check`` compares
with the file instead of writing it). The expected values are computed by :class:`Contract`, a plain
transcription of docs/assignment.md that shares no code with ``pasto.hashing``; the script refuses to
write when the two disagree on any case, so the file records the contract that the server and
``LocalAssigner`` implement. Mixtures are stored as integer weights or as rules that generate them, so
that K = 10,000 costs a line, not 10,000 numbers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
from pathlib import Path

VECTORS = Path(__file__).resolve().with_name("assignment-vectors.json")
FORMAT = "pasto-assignment-vectors/1"
MASK = 0xFFFFFFFF


class Contract:
    """docs/assignment.md, step by step, in plain Python integers and floats."""

    OFFSET_BASIS = 2166136261
    PRIME = 16777619

    @classmethod
    def fnv1a(cls, data: bytes) -> int:
        h = cls.OFFSET_BASIS
        for byte in data:
            h = ((h ^ byte) * cls.PRIME) & MASK
        return h

    @staticmethod
    def fmix32(h: int) -> int:
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & MASK
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & MASK
        h ^= h >> 16
        return h

    @classmethod
    def key(cls, seed: int, round_index: int, unit: str) -> bytes:
        return f"{seed}:{round_index}:{unit}".encode("utf-8")

    @staticmethod
    def pairwise_sum(values: list[float], start: int = 0, count: int | None = None) -> float:
        """numpy's float64 summation (``numpy.sum``): blocks of up to 128 in 8 running sums, halves above."""
        n = len(values) - start if count is None else count
        if n < 8:
            total = 0.0
            for i in range(start, start + n):
                total += values[i]
            return total
        if n <= 128:
            partial = values[start:start + 8]
            i = 8
            while i < n - n % 8:
                for j in range(8):
                    partial[j] += values[start + i + j]
                i += 8
            total = ((partial[0] + partial[1]) + (partial[2] + partial[3])) + (
                (partial[4] + partial[5]) + (partial[6] + partial[7]))
            while i < n:
                total += values[start + i]
                i += 1
            return total
        half = n // 2
        half -= half % 8
        return Contract.pairwise_sum(values, start, half) + Contract.pairwise_sum(values, start + half, n - half)

    @classmethod
    def cumulative(cls, probabilities: list[float]) -> list[float]:
        total = cls.pairwise_sum(probabilities)
        running = 0.0
        cumulative = []
        for p in probabilities:
            running += p
            cumulative.append(running / total)
        cumulative[-1] = 1.0
        return cumulative

    @staticmethod
    def choose(cumulative: list[float], bucket: float) -> int:
        for k, c in enumerate(cumulative):
            if bucket < c:
                return k
        return len(cumulative) - 1


def weights_of(spec: dict) -> list[int]:
    """The integer weights a mixture entry stands for (see the file's ``mixture_rules``)."""
    if "weights" in spec:
        return list(spec["weights"])
    rule = spec["rule"]
    k, a, c, m = spec["k"], spec["a"], spec["c"], spec["m"]
    if rule == "lcg":
        return [(a * i + c) % m for i in range(k)]
    if rule == "power2":
        return [2 ** ((a * i + c) % m) for i in range(k)]
    raise ValueError(f"unknown rule {rule!r}")


def probabilities_of(spec: dict) -> list[float]:
    if "probabilities" in spec:
        return [float(p) for p in spec["probabilities"]]
    weights = weights_of(spec)
    total = sum(weights)
    assert total < 2**53, "weights must sum to less than 2**53 (exact in float64)"
    return [w / float(total) for w in weights]


def cumulative_sha256(cumulative: list[float]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(cumulative)}d", *cumulative)).hexdigest()


MIXTURES: dict[str, dict] = {
    "two-even": {"probabilities": [0.5, 0.5]},
    "two-skewed": {"probabilities": [0.999, 0.001]},
    "three-zero-middle": {"probabilities": [0.4, 0.0, 0.6]},
    "zero-first-and-last": {"probabilities": [0.0, 0.3, 0.7, 0.0]},
    "tiny": {"probabilities": [1e-12, 0.25, 0.75 - 1e-12]},
    "subnormal": {"probabilities": [5e-324, 1.0]},
    "tiny-last": {"probabilities": [0.6, 0.4, 1e-300]},
    "unnormalised": {"probabilities": [2.0, 3.0, 5.0]},
    "thirds": {"probabilities": [1 / 3, 1 / 3, 1 / 3]},
    "served-decimals": {"probabilities": [0.1, 0.2, 0.3, 0.15, 0.25]},
    "k7-weights": {"weights": [1, 2, 3, 0, 5, 8, 13]},
    "k100-lcg": {"rule": "lcg", "k": 100, "a": 37, "c": 11, "m": 101},
    "k1000-power2": {"rule": "power2", "k": 1000, "a": 7, "c": 3, "m": 40},
    "k10000-lcg": {"rule": "lcg", "k": 10000, "a": 7919, "c": 17, "m": 65537},
    "k10000-power2": {"rule": "power2", "k": 10000, "a": 13, "c": 5, "m": 40},
    "k10000-sparse": {"rule": "lcg", "k": 10000, "a": 1, "c": 0, "m": 97},
}

UNITS = [
    "u", "0", "42", "user-42", "user-43", "User-42", " user-42", "user-42 ", "a:b:c", "7:0:x",
    "550e8400-e29b-41d4-a716-446655440000", "f47ac10b-58cc-4372-a567-0e02b2c3d479",
    "déjà vu", "e\u0301", "\u00e9", "ユーザー", "用户一二三", "Ωμέγα", "😀", "👩\u200d👩\u200d👧\u200d👦",
    "\U0010ffff", "\ud7ff", "tab\tin", "line\nbreak", "quote\"and\\backslash", "null-like-\u0001",
    "a" * 255, "b" * 256, "é" * 256, "😀" * 256, "x" * 1000, "long-" + "0123456789" * 409,
]
SEEDS = [0, 1, 7, 12345, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1]
ROUNDS = [0, 1, 2, 10, 999, 65536, 2**31 - 1]

#: The mixtures of one set have the same K (a segmented experiment has one list of arms).
SEGMENT_SETS = {
    "closed": {"open": False, "names": ["web", "app", "tv"],
               "mixtures": {"web": "three-zero-middle", "app": "thirds", "tv": "tiny"}},
    "open": {"open": True, "names": ["(other)", "de", "fr"],
             "mixtures": {"(other)": "k10000-lcg", "de": "k10000-power2", "fr": "k10000-sparse"}},
}


def expected(seed: int, round_index: int, unit: str, probabilities: list[float]) -> dict:
    fnv = Contract.fnv1a(Contract.key(seed, round_index, unit))
    h = Contract.fmix32(fnv)
    bucket = h / 2**32
    arm = Contract.choose(Contract.cumulative(probabilities), bucket)
    return {"fnv": fnv, "hash": h, "bucket": bucket, "arm": arm, "probability": probabilities[arm]}


def build() -> dict:
    mixtures = {name: dict(spec) for name, spec in MIXTURES.items()}
    probabilities = {name: probabilities_of(spec) for name, spec in mixtures.items()}
    cases: list[dict] = []

    def add(seed: int, round_index: int, unit: str, mixture: str) -> None:
        cases.append({"seed": seed, "round": round_index, "unit": unit, "mixture": mixture,
                      **expected(seed, round_index, unit, probabilities[mixture])})

    names = [name for name in MIXTURES if len(probabilities[name]) <= 1000]
    # Every unit under every seed and round once, the mixtures of K <= 1,000 in turn (a deterministic mix;
    # the K = 10,000 mixtures get their own cases below, few experiment states with many units each).
    i = 0
    for unit in UNITS:
        for seed in SEEDS:
            add(seed, ROUNDS[i % len(ROUNDS)], unit, names[i % len(names)])
            i += 1
    for round_index in ROUNDS:
        for unit in UNITS[:12]:
            add(12345, round_index, unit, names[i % len(names)])
            i += 1
    # The large mixtures with enough units to spread over their arms.
    for name in ("k1000-power2", "k10000-lcg", "k10000-power2", "k10000-sparse"):
        for j in range(40):  # 4 experiment states of 10 units each: a port builds each K = 10,000 state once
            add(SEEDS[-1 - j // 10], ROUNDS[-1 - j // 10], f"{name}-unit-{j}", name)
    # Boundaries: a mixture whose first cumulative equals the unit's bucket exactly (bucket < c is
    # strict: the next arm), and one a hair above it (the first arm).
    for j, unit in enumerate(["edge-0", "edge-1", "edge-ü", "edge-😀", "user-42"]):
        seed, round_index = SEEDS[j], ROUNDS[j]
        h = Contract.fmix32(Contract.fnv1a(Contract.key(seed, round_index, unit)))
        for offset in (0, 1):
            name = f"boundary-{j}-{offset}"
            mixtures[name] = {"weights": [h + offset, 2**32 - h - offset]}
            probabilities[name] = probabilities_of(mixtures[name])
            add(seed, round_index, unit, name)
    # Segments: a closed set (the segment is required and must be one of the names) and an open set
    # (any value or none; a value without a mixture of its own is served the long tail's, "(other)").
    segment_cases = [
        ("closed", "web"), ("closed", "app"), ("closed", "tv"), ("closed", None), ("closed", "radio"),
        ("open", "de"), ("open", "fr"), ("open", "(other)"), ("open", "es"), ("open", None),
    ]
    for j, (set_name, segment) in enumerate(segment_cases * 3):
        unit, seed, round_index = UNITS[j % len(UNITS)], SEEDS[j // 10], ROUNDS[j // 10]
        segment_set = SEGMENT_SETS[set_name]
        case = {"seed": seed, "round": round_index, "unit": unit, "segments": set_name, "segment": segment}
        if segment in segment_set["mixtures"]:
            served = segment
        elif segment_set["open"]:
            served = segment_set["names"][0]
        else:
            case["error"] = "segment_required" if segment is None else "segment_unknown"
            cases.append(case)
            continue
        case["served_segment"] = served
        case.update(expected(seed, round_index, unit, probabilities[segment_set["mixtures"][served]]))
        cases.append(case)
    cases.append({"seed": 7, "round": 0, "unit": "user-42", "mixture": "two-even", "segment": "web",
                  "error": "segment_not_accepted"})
    for name, spec in mixtures.items():
        spec["sha256"] = cumulative_sha256(Contract.cumulative(probabilities[name]))
    return {
        "format": FORMAT,
        "contract": "docs/assignment.md",
        "mixture_rules": {
            "probabilities": "the probabilities as given (JSON numbers, float64)",
            "weights": "p_k = w_k / W in float64, W = sum of the integer weights (exact: W < 2**53)",
            "lcg": "weights w_k = (a*k + c) mod m for k = 0..K-1 (K = k), then as 'weights'",
            "power2": "weights w_k = 2 ** ((a*k + c) mod m) for k = 0..K-1 (K = k), then as 'weights'",
            "sha256": "SHA-256 (hex) of the cumulative probabilities of docs/assignment.md step 5 as K "
                      "little-endian IEEE-754 float64 values",
        },
        "mixtures": mixtures,
        "segment_sets": SEGMENT_SETS,
        "cases": cases,
    }


def render(vectors: dict) -> str:
    """One case per line: small diffs, a file a person can read."""
    head = {key: value for key, value in vectors.items() if key != "cases"}
    text = json.dumps(head, ensure_ascii=False, indent=1)[:-2]
    lines = [json.dumps(case, ensure_ascii=False, separators=(",", ":")) for case in vectors["cases"]]
    return text + ',\n "cases": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n"


def agrees_with_pasto(vectors: dict) -> list[str]:
    """Cases on which pasto.hashing disagrees with :class:`Contract` (empty: none)."""
    sys.path.insert(0, str(VECTORS.parents[1]))
    from pasto.hashing import bucket, choose_arm, cumulative_probabilities

    problems = []
    for name, spec in vectors["mixtures"].items():
        if cumulative_sha256(cumulative_probabilities(probabilities_of(spec))) != spec["sha256"]:
            problems.append(f"mixture {name}: cumulative probabilities differ")
    for case in vectors["cases"]:
        if "error" in case:
            continue
        mixture = case.get("mixture") or SEGMENT_SETS[case["segments"]]["mixtures"][case["served_segment"]]
        u = bucket(case["seed"], case["unit"], case["round"])
        arm = choose_arm(cumulative_probabilities(probabilities_of(vectors["mixtures"][mixture])), u)
        if (u, arm) != (case["bucket"], case["arm"]):
            problems.append(f"case {case['unit']!r} seed {case['seed']} round {case['round']}: {(u, arm)}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    arguments = parser.parse_args()
    vectors = build()
    problems = agrees_with_pasto(vectors)
    if problems:
        print("pasto.hashing disagrees with the contract:", *problems[:20], sep="\n  ", file=sys.stderr)
        return 1
    text = render(vectors)
    if arguments.check:
        if VECTORS.read_text(encoding="utf-8") != text:
            print(f"{VECTORS} is not what this script writes; run it without --check.", file=sys.stderr)
            return 1
        print(f"{VECTORS.name}: {len(vectors['cases'])} cases, up to date")
        return 0
    VECTORS.write_text(text, encoding="utf-8")
    print(f"wrote {VECTORS} ({len(vectors['cases'])} cases, {len(text):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
