"""Simulation scenarios: validating the scenario JSON format (a parsed dict; `pasto.cli` reads files).

A scenario describes a synthetic problem for the Monte-Carlo simulator (``pasto.simulate``)::

    {
      "name": "setup-a",
      "description": "free text",
      "metrics": ["x", "y"],
      "objective": {"primary": "x",
                    "guardrails": [{"metric": "y", "threshold": 0.0, "penalty": 5.0}]},
      "arms": {"means": [[2.0, 0.0], [-2.0, 2.0]]},
      "noise": {"kind": "gaussian", "std": 2.236},
      "queries_per_round": 1,
      "rounds": 2000,
      "runs": 1000,
      "seed": 0,
      "checkpoints": [100, 500, 1000, 2000],
      "drift": {"at_round": 1000, "means": [[0.0, 2.0], [2.0, -2.0]]},
      "delay_rounds": 0
    }

Keys and their meaning:

``metrics``
    Metric names. Row ``m`` of every M x K matrix belongs to ``metrics[m]``.
``objective``
    ``{"primary": ..., "guardrails": [...]}``, passed to ``pasto.objectives.Objective.from_spec``.
    Arms are named ``"0"``, ``"1"``, ... so a relative guardrail may say ``"relative_to": "0"``.
``arms``
    Either ``{"means": M x K list}`` (fixed true means), or
    ``{"count": K, "means": {"uniform": [low, high]}}`` (every entry drawn i.i.d. uniform, afresh
    for every run), or ``{"count": K, "means": {"knob_grid": {"levels": [L1, L2, ...], "base": [...],
    "effect": [...], "tradeoff": rho}}}``: the K = L1 L2 ... settings of a grid of knobs (each knob's
    levels evenly spaced in [0, 1]), metric m's mean ``base[m] (1 + effect[m] h_m(u))`` with h_m a
    smooth random function of the knobs u drawn afresh per run (a random quadratic plus ``roughness``
    times independent per-setting noise, in units of the quadratic's spread over the grid; centred
    and scaled to at most 1 in absolute value), and every metric after the first traded off
    against the first: h_m = -rho h_0 + sqrt(1 - rho^2) g_m with g_m independent (rescaled
    likewise). With
    ``"reference": k``, the setting of median primary value is swapped into column k, so that a
    relative guardrail ``relative_to`` arm k is set against a middling production setting.
    Arm k is grid point k in row-major order of the levels.
``noise``
    How every observed metric value departs from its arm's mean. ``std`` is a number, or a list
    with one std per metric. ``kind`` is one kind for every metric, or a list with one kind per
    metric (revenue log-normal beside a conversion, say), each one of

    - ``gaussian``: N(0, std^2).
    - ``student_t``: Student t with ``df`` > 2 degrees of freedom, rescaled so that its standard
      deviation is ``std`` (heavier tails at the same variance).
    - ``lognormal``: a centred log-normal, ``std * (exp(Z) - e^(1/2)) / sqrt(e (e - 1))`` with Z
      standard normal: additive (not multiplicative) noise with mean 0 and standard deviation
      ``std``, right-skewed like dwell times and revenue (skewness about 6.2).
    - ``bernoulli``: the value itself is 1 with the arm's mean as probability, else 0: a conversion
      or a click (rare events when the means are small). Its spread follows from the mean, so its
      ``std`` entry must be 0, and its means must lie in [0, 1] (checked when the file is read).
``queries_per_round``
    Q: how many user groups are assigned an arm (drawn from p_t) in each round; each group yields
    one observation of every metric.
``rounds``, ``runs``, ``seed``
    Horizon T, Monte-Carlo runs and the seed of all randomness.
``checkpoints``
    Rounds (1-based, increasing, at most ``rounds``) at which results are reported. Defaults to
    ``[rounds]``.
``drift`` (optional)
    ``{"at_round": t, "means": ...}``: from round t (1-based) on, observations come from these means
    (same two forms as ``arms.means``); the reported objective uses the means in force.
``delay_rounds`` (optional, default 0)
    d: observations of round t reach the controller when round t + d closes.

Every problem is reported as a ``ValueError`` that names the offending key.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "NOISE_KINDS",
    "KnobGrid",
    "MeansSpec",
    "Noise",
    "Drift",
    "SegmentsSpec",
    "Scenario",
    "scenario_from_dict",
]

NOISE_KINDS = ("gaussian", "student_t", "lognormal", "bernoulli")

_TOP_LEVEL_REQUIRED = ("name", "metrics", "objective", "arms", "noise", "rounds")
_TOP_LEVEL_OPTIONAL = (
    "description",
    "queries_per_round",
    "runs",
    "seed",
    "checkpoints",
    "drift",
    "delay_rounds",
    "segments",
)
_DEFAULT_RUNS = 100


@dataclass(frozen=True)
class KnobGrid:
    """Means on a grid of knobs, drawn afresh per run (the ``knob_grid`` form of ``arms.means``)."""

    levels: tuple[int, ...]
    base: tuple[float, ...]
    effect: tuple[float, ...]
    tradeoff: float
    roughness: float = 0.0
    reference: int | None = None

    def draw(self, rng: np.random.Generator, runs: int) -> np.ndarray:
        """(runs, M, K) means."""
        axes = [np.linspace(0.0, 1.0, level) for level in self.levels]
        points = np.stack([grid.ravel() for grid in np.meshgrid(*axes, indexing="ij")], axis=-1)  # (K, d)
        features = [points] + [points[:, i:i + 1] * points[:, i:] for i in range(points.shape[1])]
        features = np.concatenate(features, axis=-1)  # (K, F): linear and quadratic terms

        def smooth(size):
            values = rng.standard_normal(size + (features.shape[1],)) @ features.T  # (..., K)
            values = values / np.std(values, axis=-1, keepdims=True)
            values = values + self.roughness * rng.standard_normal(values.shape)
            values = values - values.mean(axis=-1, keepdims=True)
            return values / np.max(np.abs(values), axis=-1, keepdims=True)

        n_metrics = len(self.base)
        shapes = np.empty((runs, n_metrics, points.shape[0]))
        shapes[:, 0] = smooth((runs,))
        for m in range(1, n_metrics):
            traded = -self.tradeoff * shapes[:, 0] + math.sqrt(1.0 - self.tradeoff**2) * smooth((runs,))
            shapes[:, m] = traded / np.max(np.abs(traded), axis=-1, keepdims=True)
        if self.reference is not None:
            # The reference setting (what production runs) is the one of median primary value,
            # moved to column ``reference``: neither the best nor the worst setting.
            middle = np.argsort(shapes[:, 0], axis=-1)[:, (shapes.shape[-1] - 1) // 2]
            order = np.tile(np.arange(shapes.shape[-1]), (runs, 1))
            order[np.arange(runs), middle] = self.reference
            order[:, self.reference] = middle
            shapes = np.take_along_axis(shapes, order[:, None, :], axis=-1)
        base, effect = np.array(self.base)[:, None], np.array(self.effect)[:, None]
        return base * (1.0 + effect * shapes)

    def to_json(self) -> dict[str, Any]:
        return {"knob_grid": {"levels": list(self.levels), "base": list(self.base), "effect": list(self.effect),
                              "tradeoff": self.tradeoff, "roughness": self.roughness, "reference": self.reference}}


@dataclass(frozen=True)
class MeansSpec:
    """True arm means: a fixed M x K matrix, or drawn afresh per run (i.i.d. uniform, or a knob grid).

    Attributes
    ----------
    fixed : tuple of tuples of float, or None
        The M x K means when they are fixed (row m = metric m).
    uniform : tuple of (float, float) or None
        ``(low, high)`` when every entry is drawn uniformly per run.
    n_arms : int
        K.
    grid : KnobGrid or None
        The knob grid the means are drawn on per run.
    """

    fixed: tuple[tuple[float, ...], ...] | None
    uniform: tuple[float, float] | None
    n_arms: int
    grid: KnobGrid | None = None

    def draw(self, rng: np.random.Generator, n_metrics: int, runs: int) -> np.ndarray:
        """Return the true means: ``(M, K)`` when fixed, ``(runs, M, K)`` drawn afresh per run."""
        if self.fixed is not None:
            return np.array(self.fixed, dtype=np.float64)
        if self.grid is not None:
            return self.grid.draw(rng, runs)
        low, high = self.uniform
        return rng.uniform(low, high, size=(runs, n_metrics, self.n_arms))

    def to_json(self) -> Any:
        if self.fixed is not None:
            return [list(row) for row in self.fixed]
        if self.grid is not None:
            return self.grid.to_json()
        return {"uniform": list(self.uniform)}


@dataclass(frozen=True)
class Noise:
    """How observations depart from their arm's mean.

    Attributes
    ----------
    kind : str or tuple of str
        One of ``NOISE_KINDS`` for every metric, or one per metric (length M; a tuple whose entries
        are all the same is stored as that one kind).
    std : tuple of float
        Standard deviation per metric (length M; 0 for a ``bernoulli`` metric).
    df : float or None
        Degrees of freedom (``student_t`` only).
    """

    kind: str | tuple[str, ...]
    std: tuple[float, ...]
    df: float | None = None

    def json_kind(self) -> str | list[str]:
        """``kind`` as the scenario file writes it."""
        return self.kind if isinstance(self.kind, str) else list(self.kind)

    def kinds(self, n_metrics: int) -> tuple[str, ...]:
        """The kind of each of the ``n_metrics`` metrics."""
        return (self.kind,) * n_metrics if isinstance(self.kind, str) else self.kind

    def standard_deviations(self, means: np.ndarray) -> np.ndarray:
        """Each observation's standard deviation under ``means`` (..., M, K): ``std`` for an additive
        metric, sqrt(mean (1 - mean)) for a ``bernoulli`` one; same shape."""
        means = np.asarray(means, dtype=float)
        spread = np.broadcast_to(np.asarray(self.std, dtype=float)[:, None], means.shape).copy()
        for metric, kind in enumerate(self.kinds(means.shape[-2])):
            if kind == "bernoulli":
                rate = np.clip(means[..., metric, :], 0.0, 1.0)
                spread[..., metric, :] = np.sqrt(rate * (1.0 - rate))
        return spread

    def observe(self, rng: np.random.Generator, expected: np.ndarray) -> np.ndarray:
        """Observed values around ``expected``, whose last axis is the metric axis (length M).

        One kind for every additive metric draws exactly what :meth:`sample` adds; with a list of
        kinds each metric draws its own in metric order.
        """
        if isinstance(self.kind, str) and self.kind != "bernoulli":
            return expected + self.sample(rng, expected.shape)
        values = np.empty_like(expected, dtype=float)
        for metric, kind in enumerate(self.kinds(expected.shape[-1])):
            mean = expected[..., metric]
            if kind == "bernoulli":
                if mean.size and (np.min(mean) < 0.0 or np.max(mean) > 1.0):
                    raise ValueError(
                        f"Metric {metric} has noise.kind bernoulli, so its means are probabilities, but one "
                        f"is {float(np.min(mean) if np.min(mean) < 0.0 else np.max(mean)):.6g}: they must lie in [0, 1].")
                values[..., metric] = rng.random(mean.shape) < mean
            else:
                values[..., metric] = mean + _standard(rng, kind, self.df, mean.shape) * self.std[metric]
        return values

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        """Draw zero-mean additive noise of ``shape`` whose last axis is the metric axis (length M).

        Raises ValueError for a ``bernoulli`` metric, whose values are not its mean plus noise
        (:meth:`observe` draws those)."""
        if not isinstance(self.kind, str) or self.kind == "bernoulli":
            raise ValueError("Bernoulli metrics and per-metric kinds are drawn by Noise.observe, not as additive noise.")
        return _standard(rng, self.kind, self.df, shape) * np.asarray(self.std)


def _standard(rng: np.random.Generator, kind: str, df: float | None, shape: tuple[int, ...]) -> np.ndarray:
    """Zero-mean, unit-variance draws of an additive noise ``kind``."""
    if kind == "gaussian":
        return rng.standard_normal(shape)
    if kind == "student_t":
        return rng.standard_t(df, shape) * math.sqrt((df - 2.0) / df)
    return (np.exp(rng.standard_normal(shape)) - math.exp(0.5)) / math.sqrt(math.e * (math.e - 1.0))


@dataclass(frozen=True)
class Drift:
    """A switch of the true means at round ``at_round`` (1-based)."""

    at_round: int
    means: MeansSpec


@dataclass(frozen=True)
class Scenario:
    """A validated scenario. Build one with ``scenario_from_dict`` (``pasto.cli.load_scenario`` reads a file or a packaged scenario)."""

    name: str
    description: str
    metrics: tuple[str, ...]
    objective_spec: dict = field(hash=False)
    means: MeansSpec
    noise: Noise
    queries_per_round: int
    rounds: int
    runs: int
    seed: int
    checkpoints: tuple[int, ...]
    drift: Drift | None = None
    delay_rounds: int = 0
    segments: SegmentsSpec | None = None

    @property
    def n_metrics(self) -> int:
        return len(self.metrics)

    @property
    def n_arms(self) -> int:
        return self.means.n_arms

    @property
    def arm_names(self) -> tuple[str, ...]:
        return tuple(str(k) for k in range(self.n_arms))

    @property
    def fixed_means(self) -> bool:
        """True when the true means are the same in every run (before and after any drift)."""
        return self.means.fixed is not None and (
            self.drift is None or self.drift.means.fixed is not None
        )

    def objective(self):
        """The scenario's ``pasto.objectives.Objective``."""
        from pasto.objectives import Objective

        return Objective.from_spec(list(self.metrics), self.objective_spec, list(self.arm_names))

    def with_overrides(
        self,
        *,
        runs: int | None = None,
        rounds: int | None = None,
        seed: int | None = None,
        noise_std: float | None = None,
    ) -> "Scenario":
        """Return a copy with the given settings replaced, validated like a scenario file.

        Checkpoints beyond a shortened horizon are dropped and the last round is always reported.
        """
        data = self.to_dict()
        if runs is not None:
            data["runs"] = runs
        if seed is not None:
            data["seed"] = seed
        if noise_std is not None:
            data["noise"]["std"] = noise_std
        if rounds is not None:
            data["rounds"] = rounds
            kept = [c for c in data["checkpoints"] if isinstance(c, int) and c < rounds]
            data["checkpoints"] = kept + [rounds]
        return scenario_from_dict(data)

    def to_dict(self) -> dict:
        """The scenario in its JSON form (``scenario_from_dict(s.to_dict()) == s``)."""
        if self.means.fixed is not None:
            arms = {"means": self.means.to_json()}
        else:
            arms = {"count": self.n_arms, "means": self.means.to_json()}
        std = self.noise.std
        noise: dict[str, Any] = {
            "kind": self.noise.json_kind(),
            "std": std[0] if len(set(std)) == 1 else list(std),
        }
        if self.noise.df is not None:
            noise["df"] = self.noise.df
        data: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "metrics": list(self.metrics),
            "objective": json.loads(json.dumps(self.objective_spec)),
            "arms": arms,
            "noise": noise,
            "queries_per_round": self.queries_per_round,
            "rounds": self.rounds,
            "runs": self.runs,
            "seed": self.seed,
            "checkpoints": list(self.checkpoints),
        }
        if self.drift is not None:
            data["drift"] = {"at_round": self.drift.at_round, "means": self.drift.means.to_json()}
        if self.delay_rounds:
            data["delay_rounds"] = self.delay_rounds
        if self.segments is not None:
            data["segments"] = self.segments.to_json()
        return data


def scenario_from_dict(data: Any) -> Scenario:
    """Validate a parsed scenario document and return a ``Scenario``.

    Raises
    ------
    ValueError
        Naming the first offending key, e.g. ``"arms.means has 3 rows but metrics names 2
        metrics."``.
    """
    if not isinstance(data, dict):
        raise ValueError(f"A scenario must be a JSON object, not {_describe(data)}.")
    _check_keys(data, "scenario", _TOP_LEVEL_REQUIRED, _TOP_LEVEL_OPTIONAL)

    name = data["name"]
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, not {_describe(name)}.")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise ValueError(f"description must be a string, not {_describe(description)}.")

    metrics = _metric_names(data["metrics"])
    rounds = _integer(data["rounds"], "rounds", minimum=1)
    means = _means(data["arms"], "arms", len(metrics), n_arms=None)
    noise = _noise(data["noise"], len(metrics))
    queries = _integer(data.get("queries_per_round", 1), "queries_per_round", minimum=1)
    runs = _integer(data.get("runs", _DEFAULT_RUNS), "runs", minimum=1)
    seed = _integer(data.get("seed", 0), "seed", minimum=0)
    checkpoints = _checkpoints(data.get("checkpoints", [rounds]), rounds)
    drift = None
    if "drift" in data:
        drift = _drift(data["drift"], len(metrics), means.n_arms)
    _check_probabilities(means, "arms.means", noise, metrics)
    if drift is not None:
        _check_probabilities(drift.means, "drift.means", noise, metrics)
    delay = _integer(data.get("delay_rounds", 0), "delay_rounds", minimum=0)
    if delay >= rounds:
        raise ValueError(
            f"delay_rounds is {delay} but the scenario has only {rounds} rounds; "
            "no observation would ever reach the controller."
        )

    objective_spec = data["objective"]
    if not isinstance(objective_spec, dict):
        raise ValueError(f"objective must be an object, not {_describe(objective_spec)}.")
    # "baseline" (the known-safe arm) and a guardrail's "hard" flag are validated by
    # Objective.from_spec, like every other objective key's value.
    _check_keys(objective_spec, "objective", ("primary",), ("guardrails", "baseline"))
    guardrails = objective_spec.get("guardrails", [])
    if not isinstance(guardrails, list):
        raise ValueError(f"objective.guardrails must be a list, not {_describe(guardrails)}.")
    for index, guardrail in enumerate(guardrails):
        where = f"objective.guardrails[{index}]"
        if not isinstance(guardrail, dict):
            raise ValueError(f"{where} must be an object, not {_describe(guardrail)}.")
        # A hard guardrail is a constraint and needs no penalty; Objective.from_spec says which
        # combinations are valid.
        _check_keys(guardrail, where, ("metric", "threshold"), ("penalty", "relative_to", "hard"))

    scenario = Scenario(
        name=name,
        description=description,
        metrics=metrics,
        objective_spec=json.loads(json.dumps(objective_spec)),
        means=means,
        noise=noise,
        queries_per_round=queries,
        rounds=rounds,
        runs=runs,
        seed=seed,
        checkpoints=checkpoints,
        drift=drift,
        delay_rounds=delay,
        segments=_segments(data["segments"], len(metrics), means.n_arms, len(guardrails)) if "segments" in data else None,
    )
    try:
        scenario.objective()
    except ValueError as error:
        raise ValueError(f"objective: {error}") from None
    return scenario


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, list):
        return f"a list of {len(value)} entries"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _check_keys(data: dict, where: str, required: tuple, optional: tuple) -> None:
    allowed = required + optional
    for key in data:
        if key not in allowed:
            prefix = "" if where == "scenario" else f"{where}."
            raise ValueError(
                f"Unknown key {prefix}{key} in {where}; allowed keys are {', '.join(allowed)}."
            )
    for key in required:
        if key not in data:
            prefix = "" if where == "scenario" else f"{where}."
            raise ValueError(f"Missing required key {prefix}{key} in {where}.")


def _integer(value: Any, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, not {_describe(value)}.")
    if value < minimum:
        raise ValueError(f"{key} must be at least {minimum}, not {value}.")
    return value


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, not {_describe(value)}.")
    return float(value)


def _metric_names(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"metrics must be a non-empty list of names, not {_describe(value)}.")
    for index, name in enumerate(value):
        if not isinstance(name, str) or not name:
            raise ValueError(f"metrics[{index}] must be a non-empty string, not {_describe(name)}.")
    if len(set(value)) != len(value):
        duplicate = next(name for name in value if value.count(name) > 1)
        raise ValueError(f"metrics names {duplicate!r} more than once.")
    return tuple(value)


def _means(value: Any, where: str, n_metrics: int, n_arms: int | None) -> MeansSpec:
    """Parse ``arms`` (``where == "arms"``) or ``drift`` (already unwrapped to its means)."""
    if where == "arms":
        if not isinstance(value, dict):
            raise ValueError(f"arms must be an object, not {_describe(value)}.")
        _check_keys(value, "arms", ("means",), ("count",))
        count = None
        if "count" in value:
            count = _integer(value["count"], "arms.count", minimum=2)
        means = value["means"]
        key = "arms.means"
    else:
        count = n_arms
        means = value
        key = f"{where}.means"

    if isinstance(means, dict) and "knob_grid" in means:
        _check_keys(means, key, ("knob_grid",), ())
        grid = _knob_grid(means["knob_grid"], f"{key}.knob_grid", n_metrics)
        size = math.prod(grid.levels)
        if count is not None and count != size:
            raise ValueError(f"arms.count is {count} but {key}.knob_grid.levels make {size} settings.")
        return MeansSpec(fixed=None, uniform=None, n_arms=size, grid=grid)

    if isinstance(means, dict):
        _check_keys(means, key, ("uniform",), ())
        bounds = means["uniform"]
        if not isinstance(bounds, list) or len(bounds) != 2:
            raise ValueError(f"{key}.uniform must be a list [low, high], not {_describe(bounds)}.")
        low = _number(bounds[0], f"{key}.uniform[0]")
        high = _number(bounds[1], f"{key}.uniform[1]")
        if not low < high:
            raise ValueError(f"{key}.uniform must have low < high, not [{low}, {high}].")
        if count is None:
            raise ValueError(f"arms.count is required when {key} is drawn from a distribution.")
        return MeansSpec(fixed=None, uniform=(low, high), n_arms=count)

    if not isinstance(means, list):
        raise ValueError(
            f"{key} must be an M x K list of numbers or {{\"uniform\": [low, high]}}, "
            f"not {_describe(means)}."
        )
    if len(means) != n_metrics:
        raise ValueError(
            f"{key} has {len(means)} rows but metrics names {n_metrics} metrics."
        )
    for row_index, row in enumerate(means):
        if not isinstance(row, list):
            raise ValueError(f"{key}[{row_index}] must be a list, not {_describe(row)}.")
        if len(row) != len(means[0]):
            raise ValueError(
                f"{key}[{row_index}] has {len(row)} entries but {key}[0] has {len(means[0])}."
            )
        for arm_index, entry in enumerate(row):
            _number(entry, f"{key}[{row_index}][{arm_index}]")
    width = len(means[0])
    if width < 2:
        raise ValueError(f"{key} has {width} column(s); a mixture needs at least 2 arms.")
    if count is not None and count != width:
        if where == "arms":
            raise ValueError(f"arms.count is {count} but arms.means has {width} columns.")
        raise ValueError(f"{key} has {width} columns but arms has {count} arms.")
    fixed = tuple(tuple(float(entry) for entry in row) for row in means)
    return MeansSpec(fixed=fixed, uniform=None, n_arms=width)


def _knob_grid(value: Any, key: str, n_metrics: int) -> KnobGrid:
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be an object, not {_describe(value)}.")
    _check_keys(value, key, ("levels", "base", "effect", "tradeoff"), ("roughness", "reference"))
    levels = value["levels"]
    if not isinstance(levels, list) or not levels:
        raise ValueError(f"{key}.levels must be a non-empty list of integers, not {_describe(levels)}.")
    levels = tuple(_integer(level, f"{key}.levels[{i}]", minimum=2) for i, level in enumerate(levels))
    lists = {}
    for name in ("base", "effect"):
        entries = value[name]
        if not isinstance(entries, list) or len(entries) != n_metrics:
            raise ValueError(f"{key}.{name} must be a list with one number per metric ({n_metrics}), "
                             f"not {_describe(entries)}.")
        lists[name] = tuple(_number(entry, f"{key}.{name}[{i}]") for i, entry in enumerate(entries))
    if any(effect < 0 for effect in lists["effect"]):
        raise ValueError(f"{key}.effect must be >= 0 for every metric.")
    tradeoff = _number(value["tradeoff"], f"{key}.tradeoff")
    if not -1.0 <= tradeoff <= 1.0:
        raise ValueError(f"{key}.tradeoff must be in [-1, 1], not {tradeoff}.")
    roughness = _number(value.get("roughness", 0.0), f"{key}.roughness")
    if roughness < 0:
        raise ValueError(f"{key}.roughness must be >= 0, not {roughness}.")
    reference = value.get("reference")
    if reference is not None:
        reference = _integer(reference, f"{key}.reference", minimum=0)
        if reference >= math.prod(levels):
            raise ValueError(f"{key}.reference must name one of the {math.prod(levels)} settings (0 to "
                             f"{math.prod(levels) - 1}), not {reference}.")
    return KnobGrid(levels=levels, base=lists["base"], effect=lists["effect"], tradeoff=tradeoff,
                    roughness=roughness, reference=reference)


def _check_probabilities(means: MeansSpec, key: str, noise: Noise, metrics: tuple[str, ...]) -> None:
    """A ``bernoulli`` metric's means are probabilities: every value ``means`` can take lies in [0, 1]."""
    for metric, kind in enumerate(noise.kinds(len(metrics))):
        if kind != "bernoulli":
            continue
        if means.fixed is not None:
            low, high = min(means.fixed[metric]), max(means.fixed[metric])
        elif means.grid is not None:  # base (1 + effect h) with |h| <= 1
            base, effect = means.grid.base[metric], means.grid.effect[metric]
            low, high = sorted((base * (1 - effect), base * (1 + effect)))
        else:
            low, high = means.uniform
        if low < 0.0 or high > 1.0:
            raise ValueError(f"{key} of metric {metrics[metric]!r} can be {low if low < 0.0 else high:g}, but its "
                             "noise.kind is bernoulli: its means are probabilities and must lie in [0, 1].")


def _noise(value: Any, n_metrics: int) -> Noise:
    if not isinstance(value, dict):
        raise ValueError(f"noise must be an object, not {_describe(value)}.")
    _check_keys(value, "noise", ("kind", "std"), ("df",))
    kind = value["kind"]
    if isinstance(kind, list):
        if len(kind) != n_metrics:
            raise ValueError(f"noise.kind has {len(kind)} entries but metrics names {n_metrics} metrics.")
        for i, entry in enumerate(kind):
            if not isinstance(entry, str) or entry not in NOISE_KINDS:
                raise ValueError(f"noise.kind[{i}] must be one of {', '.join(NOISE_KINDS)}, not {_describe(entry)}.")
        kind = kind[0] if len(set(kind)) == 1 else tuple(kind)
    elif not isinstance(kind, str) or kind not in NOISE_KINDS:
        raise ValueError(f"noise.kind must be one of {', '.join(NOISE_KINDS)}, or a list of them, one per "
                         f"metric, not {_describe(kind)}.")
    kinds = (kind,) * n_metrics if isinstance(kind, str) else kind
    std_value = value["std"]
    if isinstance(std_value, list):
        if len(std_value) != n_metrics:
            raise ValueError(
                f"noise.std has {len(std_value)} entries but metrics names {n_metrics} metrics."
            )
        std = tuple(_number(s, f"noise.std[{i}]") for i, s in enumerate(std_value))
    else:
        std = (_number(std_value, "noise.std"),) * n_metrics
    if min(std) < 0:
        raise ValueError(f"noise.std must be non-negative, not {std_value}.")
    for i, (entry, spread) in enumerate(zip(kinds, std)):
        if entry == "bernoulli" and spread != 0:
            where = "noise.std" if not isinstance(std_value, list) else f"noise.std[{i}]"
            raise ValueError(f"{where} must be 0 for a bernoulli metric (its spread follows from its mean), "
                             f"not {spread:g}.")
    df = None
    if "student_t" in kinds:
        if "df" not in value:
            raise ValueError("noise.df is required when noise.kind is student_t.")
        df = _number(value["df"], "noise.df")
        if df <= 2:
            raise ValueError(
                f"noise.df must be greater than 2 (finite variance), not {value['df']}."
            )
    elif "df" in value:
        raise ValueError(f"noise.df only applies to noise.kind student_t, not {_describe(value['kind'])}.")
    return Noise(kind=kind, std=std, df=df)


def _checkpoints(value: Any, rounds: int) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"checkpoints must be a non-empty list of rounds, not {_describe(value)}.")
    previous = 0
    for index, checkpoint in enumerate(value):
        _integer(checkpoint, f"checkpoints[{index}]", minimum=1)
        if checkpoint <= previous:
            raise ValueError(f"checkpoints must be strictly increasing; checkpoints[{index}] is {checkpoint}.")
        if checkpoint > rounds:
            raise ValueError(f"checkpoints[{index}] is {checkpoint}, beyond rounds ({rounds}).")
        previous = checkpoint
    return tuple(value)


def _drift(value: Any, n_metrics: int, n_arms: int) -> Drift:
    if not isinstance(value, dict):
        raise ValueError(f"drift must be an object, not {_describe(value)}.")
    _check_keys(value, "drift", ("at_round", "means"), ())
    at_round = _integer(value["at_round"], "drift.at_round", minimum=2)
    means = _means(value["means"], "drift", n_metrics, n_arms)
    return Drift(at_round=at_round, means=means)



@dataclass(frozen=True)
class SegmentsSpec:
    """User segments (key ``segments``; simulated by ``pasto.segmented_simulate``).

    ``{"names": [...] | "count": S, "shares": [...] | "zipf": a, "means": S x M x K | "spread": s,
    "scopes": ["global" | "segment", ...]}``: segment names (or S segments named "0".."S-1");
    traffic shares (normalised to sum 1) or Zipf shares proportional to 1 / rank^a; per-segment true
    means, or ``arms.means`` plus ``spread`` * N(0, 1) per entry drawn afresh per run; one scope per
    objective guardrail (default: all global).
    """

    names: tuple[str, ...]
    shares: tuple[float, ...]
    means: tuple | None
    spread: float | None
    scopes: tuple[str, ...]

    def draw(self, rng: np.random.Generator, base: np.ndarray, runs: int) -> np.ndarray:
        """Per-segment true means: (S, M, K) when fixed, else (runs, S, M, K) around ``base``."""
        if self.means is not None:
            return np.array(self.means, dtype=np.float64)
        base = np.asarray(base, dtype=float)
        if base.ndim == 2:
            base = np.broadcast_to(base, (runs,) + base.shape)
        shape = (runs, len(self.names)) + base.shape[1:]
        return base[:, None] + self.spread * rng.standard_normal(shape)

    def to_json(self) -> dict:
        data: dict[str, Any] = {"names": list(self.names), "shares": list(self.shares), "scopes": list(self.scopes)}
        if self.means is not None:
            data["means"] = [[list(row) for row in segment] for segment in self.means]
        else:
            data["spread"] = self.spread
        return data


def _segments(value: Any, n_metrics: int, n_arms: int, n_guardrails: int) -> SegmentsSpec:
    if not isinstance(value, dict):
        raise ValueError(f"segments must be an object, not {_describe(value)}.")
    _check_keys(value, "segments", (), ("names", "count", "shares", "zipf", "means", "spread", "scopes"))
    for first, second in (("names", "count"), ("shares", "zipf"), ("means", "spread")):
        if (first in value) == (second in value):
            raise ValueError(f"segments needs exactly one of {first!r} and {second!r}.")
    if "names" in value:
        names = value["names"]
        if not isinstance(names, list) or len(names) < 1 or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"segments.names must be a non-empty list of non-empty strings, not {_describe(names)}.")
        if len(set(names)) != len(names):
            raise ValueError("segments.names names a segment more than once.")
        names = tuple(names)
    else:
        names = tuple(str(s) for s in range(_integer(value["count"], "segments.count", minimum=1)))
    count = len(names)
    if "shares" in value:
        raw = value["shares"]
        if not isinstance(raw, list) or len(raw) != count:
            raise ValueError(f"segments.shares must be a list with one share per segment ({count}), not {_describe(raw)}.")
        shares = np.array([_number(x, f"segments.shares[{i}]") for i, x in enumerate(raw)])
        if np.any(shares < 0) or shares.sum() <= 0:
            raise ValueError("segments.shares must be non-negative and not all 0.")
    else:
        exponent = _number(value["zipf"], "segments.zipf")
        if exponent < 0:
            raise ValueError(f"segments.zipf must be >= 0, not {exponent}.")
        shares = 1.0 / np.arange(1, count + 1) ** exponent
    if abs(shares.sum() - 1.0) > 1e-12:  # normalised once, so a round trip keeps the same floats
        shares = shares / shares.sum()
    shares = tuple(float(x) for x in shares)
    means = spread = None
    if "means" in value:
        raw = value["means"]
        if not isinstance(raw, list) or len(raw) != count:
            raise ValueError(f"segments.means must be a list of one M x K matrix per segment ({count}).")
        parsed = [_means(matrix, f"segments[{s}]", n_metrics, n_arms) for s, matrix in enumerate(raw)]
        means = tuple(spec.fixed for spec in parsed)
        if any(spec.fixed is None for spec in parsed):
            raise ValueError("segments.means must give fixed M x K matrices.")
    else:
        spread = _number(value["spread"], "segments.spread")
        if spread < 0:
            raise ValueError(f"segments.spread must be >= 0, not {spread}.")
    scopes = value.get("scopes", ["global"] * n_guardrails)
    if not isinstance(scopes, list) or len(scopes) != n_guardrails or any(s not in ("global", "segment") for s in scopes):
        raise ValueError(
            f"segments.scopes must list 'global' or 'segment' for each of the {n_guardrails} guardrail(s), "
            f"not {_describe(scopes)}."
        )
    return SegmentsSpec(names=names, shares=shares, means=means, spread=spread, scopes=tuple(scopes))
