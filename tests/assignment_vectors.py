"""The golden vectors of the assignment contract (spec/assignment-vectors.json, docs/assignment.md),
expanded for the tests: every case with the probabilities it is drawn from."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
VECTORS_PATH = REPOSITORY / "spec" / "assignment-vectors.json"
GENERATOR_PATH = REPOSITORY / "spec" / "generate_assignment_vectors.py"
#: The longest unit the server accepts (service.schemas.Identifier).
SERVER_MAX_UNIT = 256


@cache
def generator():
    """spec/generate_assignment_vectors.py as a module (its Contract and mixture rules)."""
    spec = importlib.util.spec_from_file_location("generate_assignment_vectors", GENERATOR_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def vectors() -> dict:
    return json.loads(VECTORS_PATH.read_text(encoding="utf-8"))


@cache
def mixture(name: str) -> tuple[float, ...]:
    return tuple(generator().probabilities_of(vectors()["mixtures"][name]))


@dataclass(frozen=True)
class Case:
    seed: int
    round: int
    unit: str
    mixture: str | None         # unsegmented cases
    segments: str | None        # segmented cases: the segment set
    segment: str | None
    expected: dict              # the case as stored: arm, bucket, probability, ... or error

    @property
    def error(self) -> str | None:
        return self.expected.get("error")

    @property
    def server_unit(self) -> bool:
        return len(self.unit) <= SERVER_MAX_UNIT


def cases() -> list[Case]:
    return [Case(case["seed"], case["round"], case["unit"], case.get("mixture"), case.get("segments"),
                 case.get("segment"), case) for case in vectors()["cases"]]


def experiment_document(seed: int, round_index: int, mixture_name: str | None = None,
                        segment_set: str | None = None, name: str = "vectors") -> dict:
    """What GET /api/v1/experiments/{name} returns for a running experiment in this state."""
    if segment_set is None:
        probabilities = list(mixture(mixture_name))
        segments = None
    else:
        spec = vectors()["segment_sets"][segment_set]
        per_segment = {segment: list(mixture(spec["mixtures"][segment])) for segment in spec["names"]}
        probabilities = per_segment[spec["names"][0]]
        if len({len(p) for p in per_segment.values()}) != 1:
            raise ValueError("every segment of a set needs the same K")
        segments = {"names": list(spec["names"]), "probabilities": per_segment, "deployed": per_segment,
                    "by": "country" if spec["open"] else None}
    return {
        "name": name, "status": "running", "seed": seed,
        "round": {"index": round_index, "started_at": "2026-01-01T00:00:00Z", "ends_at": None},
        "arms": [{"name": f"arm-{k}", "params": {"k": k}} for k in range(len(probabilities))],
        "probabilities": probabilities, "deployed": probabilities, "segments": segments,
        "updated_at": "2026-01-01T00:00:00Z",
    }
