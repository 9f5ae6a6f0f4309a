"""Objectives f(x) over the expected metric vector x = mu p (paper section 3, Eq. 3).

Row order of every M x K matrix follows ``Objective.metrics``. The objective is

    f(x) = sum_i w_i x_{primary_i} - sum_j lambda_j * min(0, x_{g_j} - c_j)^2

that is, a weighted sum of primary metrics (a single primary metric with weight 1 is the paper's
X) minus the paper's quadratic guardrail penalty (section 6, lambda = 5 in its experiments). With no
guardrails f is linear and the best mixture is a single arm. f is concave and differentiable, so
exponentiated gradient applies (Eq. 7).

A guardrail threshold is either absolute (``c_j = threshold``) or relative to a baseline arm b
(``c_j = mu[g_j, b] * (1 + threshold)``; threshold -0.02 reads "at most 2% below arm b"). Relative
thresholds are resolved on whatever mean matrix the caller passes (the current estimate during
learning, the true means in a simulation) and are treated as constants when differentiating.

A guardrail is either *soft* (the quadratic penalty above, ``"penalty": lambda``) or *hard*
(``"hard": true``, no penalty): a constraint ``y_j >= c_j`` that the exact solver
(:func:`pasto.optimum.solve`) never trades for primary value. Hard guardrails take no part in
:meth:`Objective.value` (it stays finite for charts and JSON: primary plus soft penalties); they are
reported separately by :meth:`Objective.hard_slack` (y_j - c_j, negative when broken).

An objective may name a *baseline* arm (``"baseline": "<arm>"``), the known-safe production
setting; without one, the ``relative_to`` arm of the first relative guardrail is the baseline.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Guardrail", "Objective"]

_SPEC_KEYS = {"primary", "guardrails", "baseline"}
_GUARDRAIL_KEYS = {"metric", "threshold", "penalty", "relative_to", "hard"}
_GUARDRAIL_REQUIRED = ("metric", "threshold")


#: A guardrail holds when its value y >= c - HOLD_TOLERANCE * |c| (0.1% of its threshold c): what
#: the simulator judges and what safe serving takes for a guardrail the optimum keeps.
HOLD_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Guardrail:
    """A lower bound on one metric: soft (the penalty ``penalty * min(0, y - c)^2``) or hard.

    Attributes
    ----------
    metric : str
        Name of the guarded metric.
    threshold : float
        Absolute lower bound c, or, with ``relative_to``, the relative change allowed against the
        baseline arm (c = baseline mean * (1 + threshold)).
    penalty : float
        Penalty weight lambda >= 0 of a soft guardrail; 0 for a hard one.
    relative_to : str or None
        Name of the baseline arm for a relative threshold.
    hard : bool
        A hard guardrail is a constraint y >= c (no penalty): the exact solver keeps it or reports
        the problem infeasible.
    """

    metric: str
    threshold: float
    penalty: float = 0.0
    relative_to: str | None = None
    hard: bool = False


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Objective:
    """Concave objective over the expected metric vector.

    Attributes
    ----------
    metrics : tuple of str
        All metric names; the row order of every M x K matrix.
    primary : tuple of (str, float)
        The maximised metrics and their weights.
    guardrails : tuple of Guardrail
        Lower bounds: soft (penalised) or hard (constraints).
    arm_names : tuple of str or None
        Arm names, in column order; needed only to resolve relative thresholds and the baseline.
    baseline : str or None
        The known-safe arm (the production setting), when named explicitly; see
        :attr:`baseline_index` for the arm actually used.
    """

    metrics: tuple[str, ...]
    primary: tuple[tuple[str, float], ...]
    guardrails: tuple[Guardrail, ...] = ()
    arm_names: tuple[str, ...] | None = None
    baseline: str | None = None
    # Derived index arrays, computed once so value/gradient are plain vectorised numpy.
    _primary_weights: np.ndarray = field(init=False, repr=False, compare=False)
    _guardrail_rows: np.ndarray = field(init=False, repr=False, compare=False)
    _guardrail_selector: np.ndarray = field(init=False, repr=False, compare=False)
    _penalties: np.ndarray = field(init=False, repr=False, compare=False)
    _raw_thresholds: np.ndarray = field(init=False, repr=False, compare=False)
    _relative_columns: np.ndarray = field(init=False, repr=False, compare=False)
    _hard_mask: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        metrics = tuple(self.metrics)
        object.__setattr__(self, "metrics", metrics)
        object.__setattr__(self, "primary", tuple((str(m), float(w)) for m, w in self.primary))
        object.__setattr__(self, "guardrails", tuple(self.guardrails))
        if self.arm_names is not None:
            object.__setattr__(self, "arm_names", tuple(self.arm_names))
        _validate(self)
        row = {name: index for index, name in enumerate(metrics)}
        weights = np.zeros(len(metrics))
        for name, weight in self.primary:
            weights[row[name]] += weight
        rows = np.array([row[g.metric] for g in self.guardrails], dtype=np.intp)
        selector = np.zeros((len(self.guardrails), len(metrics)))
        selector[np.arange(len(rows)), rows] = 1.0
        arm_column = {name: index for index, name in enumerate(self.arm_names or ())}
        relative = np.array(
            [arm_column[g.relative_to] if g.relative_to is not None else -1 for g in self.guardrails],
            dtype=np.intp,
        )
        for name, value in (
            ("_primary_weights", weights),
            ("_guardrail_rows", rows),
            ("_guardrail_selector", selector),
            ("_penalties", np.array([g.penalty for g in self.guardrails], dtype=float)),
            ("_raw_thresholds", np.array([g.threshold for g in self.guardrails], dtype=float)),
            ("_relative_columns", relative),
            ("_hard_mask", np.array([g.hard for g in self.guardrails], dtype=bool)),
        ):
            value.setflags(write=False)
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_spec(
        cls,
        metrics: Sequence[str],
        spec: Mapping[str, Any],
        arm_names: Sequence[str] | None = None,
    ) -> Objective:
        """Build an objective from its JSON form.

        Parameters
        ----------
        metrics : sequence of str
            Metric names in row order.
        spec : mapping
            ``{"primary": "x" | {"x": 1.0, "z": 0.5}, "guardrails": [{"metric", "threshold",
            "penalty" | "hard": true, "relative_to"?}, ...], "baseline"?: "<arm>"}``;
            ``guardrails`` and ``baseline`` may be omitted. A soft guardrail gives a ``penalty``; a
            hard one gives ``"hard": true`` and no penalty.
        arm_names : sequence of str, optional
            Arm names; required when a guardrail has ``relative_to`` or a baseline is named.

        Raises
        ------
        ValueError
            With a sentence naming the offending key when the spec is invalid.
        """
        if not isinstance(spec, Mapping):
            raise ValueError("The objective must be a JSON object with keys 'primary' and 'guardrails'.")
        unknown = sorted(set(spec) - _SPEC_KEYS)
        if unknown:
            raise ValueError(
                f"The objective has unknown key(s) {unknown}; allowed keys are 'primary', 'guardrails' "
                "and 'baseline'."
            )
        if "primary" not in spec:
            raise ValueError("The objective needs a 'primary' metric (a name or a {name: weight} object).")
        raw_primary = spec["primary"]
        if isinstance(raw_primary, str):
            primary = ((raw_primary, 1.0),)
        elif isinstance(raw_primary, Mapping):
            items = []
            for name, weight in raw_primary.items():
                if not _is_number(weight):
                    raise ValueError(f"The weight of primary metric {name!r} must be a number, got {weight!r}.")
                items.append((str(name), float(weight)))
            primary = tuple(items)
        else:
            raise ValueError(
                f"'primary' must be a metric name or a {{name: weight}} object, got {raw_primary!r}."
            )
        raw_guardrails = spec.get("guardrails", [])
        if raw_guardrails is None:
            raw_guardrails = []
        if not isinstance(raw_guardrails, Sequence) or isinstance(raw_guardrails, (str, bytes)):
            raise ValueError("'guardrails' must be a list of guardrail objects.")
        guardrails = []
        for position, raw in enumerate(raw_guardrails):
            where = f"Guardrail {position}"
            if not isinstance(raw, Mapping):
                raise ValueError(
                    f"{where} must be an object with keys 'metric', 'threshold' and 'penalty' (or 'hard': true)."
                )
            unknown = sorted(set(raw) - _GUARDRAIL_KEYS)
            if unknown:
                raise ValueError(
                    f"{where} has unknown key(s) {unknown}; allowed keys are "
                    "'metric', 'threshold', 'penalty', 'hard' and 'relative_to'."
                )
            for key in _GUARDRAIL_REQUIRED:
                if key not in raw:
                    raise ValueError(f"{where} is missing the required key {key!r}.")
            hard = raw.get("hard", False)
            if not isinstance(hard, bool):
                raise ValueError(f"{where} key 'hard' must be true or false, got {hard!r}.")
            if hard and "penalty" in raw:
                raise ValueError(
                    f"{where} is hard and also gives a penalty; a hard guardrail is a constraint with no "
                    "penalty, so give either 'hard': true or a 'penalty', not both."
                )
            if not hard and "penalty" not in raw:
                raise ValueError(
                    f"{where} is missing the required key 'penalty' (a soft guardrail's weight); "
                    "give 'hard': true instead for a constraint."
                )
            for key in ("threshold", "penalty"):
                if key in raw and not _is_number(raw[key]):
                    raise ValueError(f"{where} key {key!r} must be a number, got {raw[key]!r}.")
            relative_to = raw.get("relative_to")
            if relative_to is not None and not isinstance(relative_to, str):
                raise ValueError(f"{where} key 'relative_to' must be an arm name, got {relative_to!r}.")
            guardrails.append(
                Guardrail(
                    metric=str(raw["metric"]),
                    threshold=float(raw["threshold"]),
                    penalty=0.0 if hard else float(raw["penalty"]),
                    relative_to=relative_to,
                    hard=hard,
                )
            )
        baseline = spec.get("baseline")
        if baseline is not None and not isinstance(baseline, str):
            raise ValueError(f"The objective key 'baseline' must be an arm name, got {baseline!r}.")
        return cls(
            metrics=tuple(metrics),
            primary=primary,
            guardrails=tuple(guardrails),
            arm_names=None if arm_names is None else tuple(arm_names),
            baseline=baseline,
        )

    def to_spec(self) -> dict[str, Any]:
        """The JSON form accepted by :meth:`from_spec`."""
        if len(self.primary) == 1 and self.primary[0][1] == 1.0:
            primary: Any = self.primary[0][0]
        else:
            primary = {name: weight for name, weight in self.primary}
        guardrails = []
        for g in self.guardrails:
            item: dict[str, Any] = {"metric": g.metric, "threshold": g.threshold}
            if g.hard:
                item["hard"] = True
            else:
                item["penalty"] = g.penalty
            if g.relative_to is not None:
                item["relative_to"] = g.relative_to
            guardrails.append(item)
        spec: dict[str, Any] = {"primary": primary, "guardrails": guardrails}
        if self.baseline is not None:
            spec["baseline"] = self.baseline
        return spec

    # ------------------------------------------------------------------ numerics
    @property
    def n_metrics(self) -> int:
        return len(self.metrics)

    @property
    def primary_weights(self) -> np.ndarray:
        """(M,) weight of each metric row in the linear (primary) part."""
        return self._primary_weights

    @property
    def guardrail_rows(self) -> np.ndarray:
        """(G,) metric row of each guardrail."""
        return self._guardrail_rows

    @property
    def guardrail_selector(self) -> np.ndarray:
        """(G, M) one-hot matrix mapping guardrails to their metric rows."""
        return self._guardrail_selector

    @property
    def penalties(self) -> np.ndarray:
        """(G,) penalty weights lambda_j (0 for hard guardrails: they are constraints, not penalties)."""
        return self._penalties

    @property
    def hard_mask(self) -> np.ndarray:
        """(G,) True for hard guardrails."""
        return self._hard_mask

    @property
    def hard_indices(self) -> np.ndarray:
        """(H,) positions of the hard guardrails among the guardrails (order of :meth:`hard_slack`)."""
        return np.flatnonzero(self._hard_mask)

    @property
    def soft_indices(self) -> np.ndarray:
        """(G - H,) positions of the soft guardrails among the guardrails."""
        return np.flatnonzero(~self._hard_mask)

    @property
    def baseline_index(self) -> int | None:
        """Column of the baseline (known-safe) arm, or None when there is none.

        The explicitly named ``baseline``; else the ``relative_to`` arm of the first relative
        guardrail (a relative threshold is defined against that arm, so it is the reference setting).
        """
        name = self.baseline
        if name is None:
            name = next((g.relative_to for g in self.guardrails if g.relative_to is not None), None)
        if name is None:
            return None
        # Validation guarantees arm names whenever a baseline or relative_to is named.
        return self.arm_names.index(name)

    def hard_slack(self, x: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
        """y_j - c_j for the hard guardrails: >= 0 when held, negative by the shortfall when broken.

        Parameters
        ----------
        x : ndarray, shape (..., M)
            Expected metric vector (mu p).
        thresholds : ndarray, shape (..., G)
            Resolved thresholds of all guardrails (see :meth:`thresholds`).

        Returns
        -------
        ndarray, shape (..., H)
        """
        x = np.asarray(x, dtype=float)
        if x.shape[-1:] != (self.n_metrics,):
            raise ValueError(f"The metric vector must have shape (..., {self.n_metrics}), got {x.shape}.")
        thresholds = np.asarray(thresholds, dtype=float)
        hard = self.hard_indices
        return x[..., self._guardrail_rows[hard]] - thresholds[..., hard]

    def thresholds(self, means: np.ndarray) -> np.ndarray:
        """Resolve guardrail thresholds c_j.

        Parameters
        ----------
        means : ndarray, shape (..., M, K)
            Mean matrix used for relative thresholds (ignored by absolute ones).

        Returns
        -------
        ndarray, shape (..., G)
        """
        means = np.asarray(means, dtype=float)
        if means.ndim < 2 or means.shape[-2] != self.n_metrics:
            raise ValueError(
                f"The means must have shape (..., {self.n_metrics}, K), got {means.shape}."
            )
        batch = means.shape[:-2]
        result = np.broadcast_to(self._raw_thresholds, batch + self._raw_thresholds.shape).copy()
        relative = self._relative_columns >= 0
        if relative.any():
            if self.arm_names is not None and means.shape[-1] != len(self.arm_names):
                raise ValueError(
                    f"The means have {means.shape[-1]} arms but the objective names {len(self.arm_names)}."
                )
            rows = self._guardrail_rows[relative]
            columns = self._relative_columns[relative]
            baseline = means[..., rows, columns]
            result[..., relative] = baseline * (1.0 + self._raw_thresholds[relative])
        return result

    def threshold_weights(self, n_arms: int) -> np.ndarray:
        """w (G, K): each threshold as a linear form of its guarded row, c_j = c0_j + w_j . mu[g_j].

        Row j is 1 + theta_j on the reference arm of a relative guardrail and 0 elsewhere (all 0
        for an absolute one): how the threshold moves with the arms' means, so that a bound on the
        slack y_j - c_j can carry the reference arm's uncertainty.
        """
        weights = np.zeros((len(self.guardrails), int(n_arms)))
        relative = np.flatnonzero(self._relative_columns >= 0)
        weights[relative, self._relative_columns[relative]] = 1.0 + self._raw_thresholds[relative]
        return weights

    def _shortfall(self, x: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=float)
        if x.shape[-1:] != (self.n_metrics,):
            raise ValueError(f"The metric vector must have shape (..., {self.n_metrics}), got {x.shape}.")
        return np.minimum(0.0, x[..., self._guardrail_rows] - np.asarray(thresholds, dtype=float))

    def value(
        self, x: np.ndarray, thresholds: np.ndarray, penalties: np.ndarray | None = None
    ) -> np.ndarray:
        """f(x): the primary part minus the soft guardrails' penalties.

        Hard guardrails contribute nothing here (their penalty is 0): whether they hold is
        :meth:`hard_slack`'s answer, so the value stays finite even where a hard guardrail breaks.

        Parameters
        ----------
        x : ndarray, shape (..., M)
            Expected metric vector (mu p).
        thresholds : ndarray, shape (..., G)
            Resolved thresholds (see :meth:`thresholds`).
        penalties : ndarray, shape (..., G), optional
            Penalty weights replacing the configured ones (dual-ascent guardrail weights).

        Returns
        -------
        ndarray, shape (...)
        """
        x = np.asarray(x, dtype=float)
        lam = self._penalties if penalties is None else np.asarray(penalties, dtype=float)
        shortfall = self._shortfall(x, thresholds)
        return x @ self._primary_weights - np.sum(lam * shortfall**2, axis=-1)

    def gradient(
        self, x: np.ndarray, thresholds: np.ndarray, penalties: np.ndarray | None = None
    ) -> np.ndarray:
        """Gradient of f with respect to x; shape (..., M). Arguments as in :meth:`value`."""
        x = np.asarray(x, dtype=float)
        lam = self._penalties if penalties is None else np.asarray(penalties, dtype=float)
        shortfall = self._shortfall(x, thresholds)
        return self._primary_weights + (-2.0 * lam * shortfall) @ self._guardrail_selector

    def mixture_value(
        self, means: np.ndarray, probabilities: np.ndarray, thresholds: np.ndarray | None = None
    ) -> np.ndarray:
        """f(mu p) for means (..., M, K) and probabilities (..., K); thresholds default to ``thresholds(means)``."""
        means = np.asarray(means, dtype=float)
        if thresholds is None:
            thresholds = self.thresholds(means)
        x = np.einsum("...mk,...k->...m", means, np.asarray(probabilities, dtype=float))
        return self.value(x, thresholds)


def _validate(objective: Objective) -> None:
    metrics = objective.metrics
    if len(metrics) == 0:
        raise ValueError("The objective needs at least one metric name.")
    for name in metrics:
        if not isinstance(name, str) or not name:
            raise ValueError(f"Metric names must be non-empty strings, got {name!r}.")
    if len(set(metrics)) != len(metrics):
        raise ValueError(f"Metric names must be unique, got {list(metrics)}.")
    known = set(metrics)
    if not objective.primary:
        raise ValueError("The objective needs at least one primary metric.")
    primary_names = [name for name, _ in objective.primary]
    if len(set(primary_names)) != len(primary_names):
        raise ValueError(f"Primary metrics must be unique, got {primary_names}.")
    for name, weight in objective.primary:
        if name not in known:
            raise ValueError(f"Primary metric {name!r} is not one of the metrics {list(metrics)}.")
        if not math.isfinite(weight):
            raise ValueError(f"The weight of primary metric {name!r} must be finite, got {weight}.")
    if all(weight == 0.0 for _, weight in objective.primary):
        raise ValueError("At least one primary metric needs a non-zero weight.")
    if objective.arm_names is not None and len(set(objective.arm_names)) != len(objective.arm_names):
        raise ValueError(f"Arm names must be unique, got {list(objective.arm_names)}.")
    for position, g in enumerate(objective.guardrails):
        where = f"Guardrail {position} (metric {g.metric!r})"
        if g.metric not in known:
            raise ValueError(f"{where} refers to an unknown metric; the metrics are {list(metrics)}.")
        if g.metric in primary_names:
            raise ValueError(
                f"{where} guards a primary metric; a metric is either maximised or guarded, not both."
            )
        if not math.isfinite(g.threshold):
            raise ValueError(f"{where} key 'threshold' must be finite, got {g.threshold}.")
        if not math.isfinite(g.penalty) or g.penalty < 0:
            raise ValueError(f"{where} key 'penalty' must be a finite number >= 0, got {g.penalty}.")
        if not isinstance(g.hard, (bool, np.bool_)):
            raise ValueError(f"{where} key 'hard' must be true or false, got {g.hard!r}.")
        if g.hard and g.penalty != 0.0:
            raise ValueError(
                f"{where} is hard and has penalty {g.penalty}; a hard guardrail is a constraint with no penalty."
            )
        if g.relative_to is not None:
            if objective.arm_names is None:
                raise ValueError(
                    f"{where} key 'relative_to' names arm {g.relative_to!r}, but no arm names were given."
                )
            if g.relative_to not in objective.arm_names:
                raise ValueError(
                    f"{where} key 'relative_to' names arm {g.relative_to!r}, which is not one of the arms "
                    f"{list(objective.arm_names)}."
                )
    if objective.baseline is not None:
        if objective.arm_names is None:
            raise ValueError(f"The objective names baseline arm {objective.baseline!r}, but no arm names were given.")
        if objective.baseline not in objective.arm_names:
            raise ValueError(
                f"The objective's baseline {objective.baseline!r} is not one of the arms {list(objective.arm_names)}."
            )
