"""The PASTO update: exponentiated gradient on the simplex with exploration (paper Algorithm 1).

One call of :func:`update` closes round t (1-based; ``state.round_index = t - 1``) in named steps:

1. estimate (``_estimate_step``): the estimator object (:func:`pasto.estimators.make_estimator`,
   chosen once from ``config.estimation``) takes in the round's observations (Eq. 5-6 for ``ips``);
   V = its current M x K estimate, c = thresholds resolved on V;
2. gradient step (``_gradient_step``): g_t = V^T grad f(V p_t) (Eq. 7) at the probabilities p_t
   served in round t, then log w_t = log w_{t-1} + gamma_t g_t (Algorithm 1 line 7, in log space),
   normalised by logsumexp;
3. solve (``_solve_step``): in solve-per-round mode, every ``solve_every`` rounds the weights are
   moved to the maximiser of f(V p) by warm-started mirror ascent (:func:`pasto.optimum.mirror_ascent`);
4. guardrail weights (``_dual_ascent_step``, ``dual_ascent`` only);
5. exploration (``_exploration_step``): p_{t+1} = (1 - eps_{t+1}) w_t / ||w_t||_1 + eps_{t+1} / K
   (line 3), part of the exploitation mass optionally directed at plausible arms;
6. deploy (``_deploy_step``): the deployed mixture is updated (the paper's average of p_1..p_t, the
   average over the current stage, or the current exploitation mixture w_t / ||w_t||_1).

Configuration (:class:`AlgorithmConfig`) is separate from learned state (:class:`ControllerState`);
both round-trip through JSON-friendly dicts. Every array carries optional leading batch dimensions
so many independent runs advance in one call; ``round_index`` is shared by the batch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pasto.estimators import (
    ESTIMATOR_NAMES,
    Accumulators,
    Estimate,
    Estimator,
    History,
    Statistics,
    make_estimator,
)
from pasto.objectives import Objective
from pasto.optimum import mirror_ascent
from pasto.serving import ServingConfig
from pasto.special import logsumexp, softmax

__all__ = [
    "AlgorithmConfig",
    "EstimationConfig",
    "ExplorationConfig",
    "ControllerState",
    "OPTIONS",
    "PRESETS",
    "initial_state",
    "round_generator",
    "update",
    "deployed_mixture",
    "estimate",
    "exploration_rate",
    "step_size",
    "stage_of",
]

ESTIMATORS = ESTIMATOR_NAMES
STEP_SCHEDULES = ("constant", "per_arm", "horizon", "doubling", "adagrad")
EXPLORATION_SCHEDULES = ("paper", "sqrt", "constant")
DEPLOY_RULES = ("average", "stage", "last")
SOLVE_OBJECTIVES = ("plug_in", "expected")
GUARDRAIL_WEIGHT_RULES = ("fixed", "dual_ascent")
SERVING_RULES = ("exploration", "safe")

# Before a solve, log weights are lifted to at least (max - this): an arm written off under an
# earlier estimate can come back within a few mirror-ascent steps (e^-30 ~ 1e-13 of the mass).
_SOLVE_LOG_WEIGHT_FLOOR = 30.0
_LARGEST = np.finfo(float).max
_MAX_LOG_STEP = 1e6


# AlgorithmConfig's flat (API and stored) option names of safe serving, and their ServingConfig fields.
_SERVING_OPTIONS = {
    "serving_level": "level",
    "serving_posterior_draws": "posterior_draws",
    "serving_min_share": "min_share",
    "serving_holdout": "holdout",
    "change_level": "change_level",
    "change_every": "change_every",
}


def _finite(part: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{part} option {name!r} must be a finite number, got {value!r}.")
    return float(value)


@dataclass(frozen=True)
class EstimationConfig:
    """How the M x K mean matrix is estimated (either serving rule).

    Attributes
    ----------
    estimator : {"ips", "pooled", "control_variate"}
        The estimator (see :mod:`pasto.estimators`).
    discount : float
        Discount delta in (0, 1] applied per round to the estimator's history (1 = none).
    """

    estimator: str = "pooled"
    discount: float = 1.0

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"Algorithm option 'estimator' must be one of {list(ESTIMATORS)}, got {self.estimator!r}.")
        object.__setattr__(self, "discount", _finite("Algorithm", "discount", self.discount))
        if not 0.0 < self.discount <= 1.0:
            raise ValueError(f"Algorithm option 'discount' must be in (0, 1], got {self.discount}.")


@dataclass(frozen=True)
class ExplorationConfig:
    """The exploration controller: paper Algorithm 1 (``serving = "exploration"``).

    Attributes
    ----------
    step_schedule : {"constant", "per_arm", "horizon", "doubling", "adagrad"}
        gamma_t = step_size; step_size / K (the paper's 0.1 / K with step_size 0.1);
        step_size / sqrt(horizon); step_size / sqrt(last round of the current doubling stage);
        step_size * sqrt(ln K) / sqrt(sum_{s<=t} ||g_s - mean(g_s)||_inf^2).
    step_size : float
        Scale of the step schedule (>= 0).
    horizon : int or None
        T for the ``horizon`` schedule.
    stage_length : int
        T_0: stage k covers rounds T_0 (2^k - 1) + 1 .. T_0 (2^(k+1) - 1) (``doubling`` and
        ``stage`` deployment).
    exploration : {"paper", "sqrt", "constant"}
        eps_t = exploration_scale / sqrt(t + 10) (paper section 6); max(floor, scale / sqrt(t));
        scale. Always clipped to [0, 1].
    exploration_scale, exploration_floor : float
    directed_share : float
        Share rho in [0, 1] of the exploitation mass moved to *plausible* arms: those whose
        gradient g_k = (V^T grad f(V w))_k could reach the mixture's level w . g within
        ``directed_z`` standard errors (optimism in the face of uncertainty, linearised at w). Arms
        whose estimate rests on fewer than two observations are always plausible. Served
        p = (1 - eps) ((1 - rho) w + rho d) + eps / K with d uniform over the plausible arms.
    directed_z : float
    deploy : {"average", "stage", "last"}
        Average of the served p since round 1 (paper, Algorithm 1 line 9); average of the served p
        over the current stage; the current exploitation mixture w_t / ||w_t||_1 (no exploration).
    solve_every : int
        0: plain Algorithm 1. n > 0: every n rounds, after the EG step, run ``solve_steps``
        mirror-ascent steps on max_p f(V p) warm-started from the weights.
    solve_steps : int
    solve_objective : {"plug_in", "expected"}
        What the solve maximises: f(V p), or the expected objective E f(mu p) with
        mu ~ N(V, se^2) (:func:`pasto.optimum.expected_objective`), which hedges against
        guardrail estimates that are too optimistic.
    guardrail_weights : {"fixed", "dual_ascent"}
        Fixed penalties lambda, or lambda_{t+1} = max(0, lambda_t + dual_step (c - y_t)) with y_t the
        estimated guardrail metrics of the exploitation mixture.
    dual_step : float
    """

    step_schedule: str = "adagrad"
    step_size: float = 1.0
    horizon: int | None = None
    stage_length: int = 10
    exploration: str = "sqrt"
    exploration_scale: float = 1.0
    exploration_floor: float = 0.05
    directed_share: float = 0.2
    directed_z: float = 2.0
    deploy: str = "last"
    solve_every: int = 5
    solve_steps: int = 100
    solve_objective: str = "expected"
    guardrail_weights: str = "fixed"
    dual_step: float = 1.0

    def __post_init__(self) -> None:
        for name, allowed in (
            ("step_schedule", STEP_SCHEDULES),
            ("exploration", EXPLORATION_SCHEDULES),
            ("deploy", DEPLOY_RULES),
            ("solve_objective", SOLVE_OBJECTIVES),
            ("guardrail_weights", GUARDRAIL_WEIGHT_RULES),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"Algorithm option {name!r} must be one of {list(allowed)}, got {value!r}.")
        for name in ("step_size", "exploration_scale", "exploration_floor", "directed_share", "directed_z", "dual_step"):
            object.__setattr__(self, name, _finite("Algorithm", name, getattr(self, name)))
        for name in ("step_size", "exploration_scale", "dual_step", "directed_z"):
            if getattr(self, name) < 0:
                raise ValueError(f"Algorithm option {name!r} must be >= 0, got {getattr(self, name)}.")
        for name in ("exploration_floor", "directed_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"Algorithm option {name!r} must be in [0, 1], got {getattr(self, name)}.")
        for name, minimum in (("stage_length", 1), ("solve_every", 0), ("solve_steps", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"Algorithm option {name!r} must be an integer >= {minimum}, got {value!r}.")
        if self.horizon is not None and (
            isinstance(self.horizon, bool) or not isinstance(self.horizon, int) or self.horizon < 1
        ):
            raise ValueError(f"Algorithm option 'horizon' must be a positive integer, got {self.horizon!r}.")
        if self.step_schedule == "horizon" and self.horizon is None:
            raise ValueError("The 'horizon' step schedule needs the option 'horizon' (the number of rounds T).")


_ESTIMATION_OPTIONS = tuple(f.name for f in dataclasses.fields(EstimationConfig))
_EXPLORATION_OPTIONS = tuple(f.name for f in dataclasses.fields(ExplorationConfig))
# Every option's flat name, as the API, the presets and stored experiments spell it.
OPTIONS = _ESTIMATION_OPTIONS + ("serving",) + tuple(_SERVING_OPTIONS) + _EXPLORATION_OPTIONS


@dataclass(frozen=True)
class AlgorithmConfig:
    """Configuration of the controller (no learned state): an estimation part and a serving rule.

    ``serving`` is the rule, and its type says which: :class:`pasto.serving.ServingConfig` (safe
    serving, the default: per-arm pooled statistics since the last detected change, every hard
    guardrail's lower confidence bound kept by the served mixture, Thompson sampling over safe
    mixtures without a floor, the deployed mixture only when it confidently beats the best single arm) or
    :class:`ExplorationConfig` (Algorithm 1 with the ``deploy`` rule; the ``paper`` preset). The
    estimation part takes in every round under either rule; with safe serving a discount < 1 makes
    the bounds use the discounted statistics.

    The API, the presets and stored experiments use one flat dict of options (:data:`OPTIONS`):
    ``estimator``, ``discount``, ``serving`` (``"safe"`` or ``"exploration"``) and the chosen rule's
    options: ``serving_level``, ``serving_posterior_draws``,
    ``serving_min_share``, ``serving_holdout``, ``change_level``, ``change_every`` (the
    ServingConfig fields without the prefix) for safe serving, the :class:`ExplorationConfig`
    fields for exploration. :meth:`from_preset` refuses an option of the rule not chosen (it would
    do nothing); :meth:`from_dict` loads it (stored experiments carried every option) and drops it.

    Attributes
    ----------
    estimation : EstimationConfig
    serving : ServingConfig or ExplorationConfig
    """

    estimation: EstimationConfig = field(default_factory=EstimationConfig)
    serving: ServingConfig | ExplorationConfig = field(default_factory=ServingConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.estimation, EstimationConfig):
            raise ValueError(f"estimation must be an EstimationConfig, got {type(self.estimation).__name__}.")
        if not isinstance(self.serving, (ServingConfig, ExplorationConfig)):
            raise ValueError("serving must be a ServingConfig (safe serving) or an ExplorationConfig, "
                             f"got {type(self.serving).__name__}.")

    @property
    def safe(self) -> bool:
        """True with safe serving (:class:`pasto.serving.ServingConfig`)."""
        return isinstance(self.serving, ServingConfig)

    @property
    def serving_rule(self) -> str:
        """``"safe"`` or ``"exploration"`` (the flat option ``serving``)."""
        return "safe" if self.safe else "exploration"

    @property
    def exploration(self) -> ExplorationConfig:
        """The exploration controller's options; raises with safe serving, which has none."""
        if self.safe:
            raise ValueError("Safe serving has no exploration options (serving is 'safe').")
        return self.serving

    @classmethod
    def from_preset(cls, preset: str = "default", **overrides: Any) -> AlgorithmConfig:
        """A preset (``"paper"`` or ``"default"``) with any flat option overridden by keyword."""
        if preset not in PRESETS:
            raise ValueError(f"Unknown algorithm preset {preset!r}; the presets are {sorted(PRESETS)}.")
        _check_names(overrides)
        options = {**PRESETS[preset], **overrides}
        rule = options.get("serving", "safe")
        ignored = _SERVING_OPTIONS if rule == "exploration" else _EXPLORATION_OPTIONS if rule == "safe" else ()
        given = [name for name in overrides if name in ignored]
        if given:
            other = "safe" if rule == "exploration" else "exploration"
            raise ValueError(
                f"Algorithm option(s) {sorted(given)} belong to serving {other!r}, and serving {rule!r} "
                f"would ignore them: give serving {other!r} or leave them out."
            )
        return cls.from_dict(options)

    def to_dict(self) -> dict[str, Any]:
        """The flat options: estimation, ``serving`` and the chosen rule's options."""
        data: dict[str, Any] = dataclasses.asdict(self.estimation)
        data["serving"] = self.serving_rule
        if self.safe:
            data.update({flat: getattr(self.serving, name) for flat, name in _SERVING_OPTIONS.items()})
        else:
            data.update(dataclasses.asdict(self.serving))
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AlgorithmConfig:
        """Inverse of :meth:`to_dict`; the other rule's options (stored before the split) are dropped."""
        _check_names(data)
        rule = data.get("serving", "safe")
        if rule not in SERVING_RULES:
            raise ValueError(f"Algorithm option 'serving' must be one of {list(SERVING_RULES)}, got {rule!r}.")
        estimation = EstimationConfig(**{name: data[name] for name in _ESTIMATION_OPTIONS if name in data})
        if rule == "exploration":
            return cls(estimation, ExplorationConfig(**{name: data[name] for name in _EXPLORATION_OPTIONS
                                                        if name in data}))
        try:
            serving = ServingConfig(**{name: data[flat] for flat, name in _SERVING_OPTIONS.items() if flat in data})
        except ValueError as error:
            # ServingConfig names its own fields; the caller wrote the flat names.
            message = str(error).replace("Serving option", "Algorithm option")
            for flat, name in _SERVING_OPTIONS.items():
                message = message.replace(f"'{name}'", f"'{flat}'")
            raise ValueError(message) from None
        return cls(estimation, serving)


def _check_names(options: dict[str, Any]) -> None:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"Unknown algorithm option(s) {unknown}; the valid options are {list(OPTIONS)}.")


# Every preset is a set of flat options over the parts' defaults (one source of truth:
# ``AlgorithmConfig() == AlgorithmConfig.from_preset("default")``).
PRESETS: dict[str, dict[str, Any]] = {
    # Safe serving (pasto.serving): per-arm pooled statistics since the last detected
    # change, hard guardrails kept on their 95% lower bounds by the served traffic, Thompson
    # sampling over safe mixtures without a floor, deploy what beats the best single arm with confidence.
    "default": {},
    # Algorithm 1 with the paper's simulation settings (section 6): IPS history average with
    # U_0 = 0, gamma = 0.1 / K, eps_t = 0.1 / sqrt(t + 10), no directed exploration, no solve,
    # deploy the average of p_1..p_t.
    "paper": dict(
        estimator="ips",
        serving="exploration",
        step_schedule="per_arm",
        step_size=0.1,
        exploration="paper",
        exploration_scale=0.1,
        exploration_floor=0.0,
        directed_share=0.0,
        deploy="average",
        solve_every=0,
        solve_steps=0,
        solve_objective="plug_in",
    ),
}


#: The change detector's snapshots in a :class:`ControllerState`: 12 M x K of its numbers against
#: about 7 K for the rest, changed only when the detector looks (:func:`detector_snapshots_read`).
DETECTOR_SNAPSHOTS = ("change_origin", "window_origins")


def detector_snapshots_read(config: AlgorithmConfig, round_index: int, rounds: int) -> tuple[str, ...]:
    """The snapshots (of :data:`DETECTOR_SNAPSHOTS`) that updating ``rounds`` rounds from a state at
    ``round_index`` reads, and the only ones it can change.

    Safe serving reads ``change_origin`` (the evidence starts there) in every round and
    ``window_origins`` only in a round that looks for a change (t a multiple of ``change_every``,
    detection on); the exploration rule reads neither. An update whose state lacks a snapshot it
    does not read returns it missing as well, so a caller that keeps the snapshots apart from the
    state (the service) loads and stores just these.
    """
    if not config.safe:
        return ()
    rule = config.serving
    first = round_index + 1
    looks = rule.change_level > 0 and any(t % rule.change_every == 0 for t in range(first, first + rounds))
    return DETECTOR_SNAPSHOTS if looks else DETECTOR_SNAPSHOTS[:1]


@dataclass(frozen=True)
class ControllerState:
    """Learned state of the controller.

    Attributes
    ----------
    round_index : int
        0-based index of the round now being served (round t = round_index + 1 in the paper).
    probabilities : ndarray, shape (..., K)
        p served in the current round (the logged propensities).
    deployed : ndarray, shape (..., K)
        The mixture recommended now.
    log_weights : ndarray, shape (..., K)
        Normalised log w (log of the exploitation mixture).
    probability_sum : ndarray, shape (..., K)
        Sum of the p served in rounds 1..round_index.
    stage_probability_sum : ndarray, shape (..., K)
        Sum of the p served in the rounds of the current stage that have closed.
    gradient_square_sum : ndarray, shape (...)
        sum_s ||g_s - mean(g_s)||_inf^2 (AdaGrad-style step).
    guardrail_weights : ndarray, shape (..., G)
        Current penalties lambda (fixed unless dual ascent).
    history : History or None
        Running sums of per-round estimates (``ips`` and ``control_variate``).
    baseline : ndarray, shape (..., M, K), or None
        Control-variate baseline for the round being served.
    discounted : Statistics or None
        Discounted pooled statistics (``pooled`` with discount < 1).
    change_origin : Statistics or None
        ``serving = "safe"``: the pooled statistics, shape (..., M, K), when each run's last change
        was detected (its evidence is the pooled statistics minus these); None before any change.
    window_origins : Statistics or None
        ``serving = "safe"``: the pooled statistics, shape (W, ..., M, K), at the start of each of
        the change detector's W windows (:data:`pasto.serving.CHANGE_WINDOWS`); None before the
        first look.
    changes : ndarray of int, shape (...), or None
        ``serving = "safe"``: changes detected so far per run.
    """

    round_index: int
    probabilities: np.ndarray
    deployed: np.ndarray
    log_weights: np.ndarray
    probability_sum: np.ndarray
    stage_probability_sum: np.ndarray
    gradient_square_sum: np.ndarray
    guardrail_weights: np.ndarray
    history: History | None = None
    baseline: np.ndarray | None = None
    discounted: Statistics | None = None
    change_origin: Statistics | None = None
    window_origins: Statistics | None = None
    changes: np.ndarray | None = None

    @property
    def n_arms(self) -> int:
        return int(self.log_weights.shape[-1])

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.log_weights.shape[:-1])

    @property
    def accumulators(self) -> Accumulators:
        """The estimator's accumulators (``history``, ``baseline``, ``discounted``) as one value."""
        return Accumulators(history=self.history, baseline=self.baseline, discounted=self.discounted)

    def to_dict(self, arrays: bool = False) -> dict[str, Any]:
        """JSON-friendly dict (nested lists of floats); ``arrays``: the same dict with numpy arrays in
        place of the lists (for a store that writes array bytes, without building K Python floats)."""
        data: dict[str, Any] = {"round_index": int(self.round_index)}

        def listed(value: Any) -> Any:
            return np.asarray(value) if arrays else np.asarray(value).tolist()

        for name in (
            "probabilities",
            "deployed",
            "log_weights",
            "probability_sum",
            "stage_probability_sum",
            "gradient_square_sum",
            "guardrail_weights",
        ):
            data[name] = listed(getattr(self, name))
        if self.history is not None:
            data["history"] = {
                "sums": listed(self.history.sums),
                "sums_of_squares": listed(self.history.sums_of_squares),
                "weights": listed(self.history.weights),
            }
        if self.baseline is not None:
            data["baseline"] = listed(self.baseline)
        for name in ("discounted", "change_origin", "window_origins"):
            statistics = getattr(self, name)
            if statistics is not None:
                data[name] = {
                    "counts": listed(statistics.counts),
                    "sums": listed(statistics.sums),
                    "sums_of_squares": listed(statistics.sums_of_squares),
                }
        if self.changes is not None:
            data["changes"] = listed(self.changes)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ControllerState:
        required = (
            "round_index",
            "probabilities",
            "deployed",
            "log_weights",
            "probability_sum",
            "stage_probability_sum",
            "gradient_square_sum",
            "guardrail_weights",
        )
        missing = [name for name in required if name not in data]
        if missing:
            raise ValueError(f"The controller state is missing the key(s) {missing}.")
        optional = {"history", "baseline", "discounted", "change_origin", "window_origins", "changes"}
        unknown = sorted(set(data) - set(required) - optional)
        if unknown:
            raise ValueError(f"The controller state has unknown key(s) {unknown}.")

        def array(value: Any) -> np.ndarray:
            return np.asarray(value, dtype=float)

        history = None
        if data.get("history") is not None:
            h = data["history"]
            history = History(array(h["sums"]), array(h["sums_of_squares"]), array(h["weights"]))
        def statistics(name: str) -> Statistics | None:
            return None if data.get(name) is None else _statistics_from_dict(data[name])

        return cls(
            round_index=int(data["round_index"]),
            probabilities=array(data["probabilities"]),
            deployed=array(data["deployed"]),
            log_weights=array(data["log_weights"]),
            probability_sum=array(data["probability_sum"]),
            stage_probability_sum=array(data["stage_probability_sum"]),
            gradient_square_sum=array(data["gradient_square_sum"]),
            guardrail_weights=array(data["guardrail_weights"]),
            history=history,
            baseline=None if data.get("baseline") is None else array(data["baseline"]),
            discounted=statistics("discounted"),
            change_origin=statistics("change_origin"),
            window_origins=statistics("window_origins"),
            changes=None if data.get("changes") is None else np.asarray(data["changes"], dtype=int),
        )

    def with_detector_snapshots(self, documents: dict[str, Any]) -> ControllerState:
        """This state with the change detector's snapshots (:data:`DETECTOR_SNAPSHOTS`) taken from
        ``documents`` (their ``to_dict`` form, stored apart from the state), the rest as it is."""
        unknown = sorted(set(documents) - set(DETECTOR_SNAPSHOTS))
        if unknown:
            raise ValueError(f"{unknown} are not detector snapshots ({list(DETECTOR_SNAPSHOTS)}).")
        return dataclasses.replace(self, **{name: None if document is None else _statistics_from_dict(document)
                                            for name, document in documents.items()})


def _statistics_from_dict(data: dict[str, Any]) -> Statistics:
    return Statistics(np.asarray(data["counts"], dtype=float), np.asarray(data["sums"], dtype=float),
                      np.asarray(data["sums_of_squares"], dtype=float))


def round_generator(seed: int, round_number: int) -> np.random.Generator:
    """The random generator of one experiment's close of round ``round_number``.

    Derived from both (``numpy.random.SeedSequence([seed, round_number])``): the same experiment
    and round always draw the same numbers, and two experiments with different seeds never share
    their draws in the same round.
    """
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(round_number)]))


# ---------------------------------------------------------------------------- schedules
def exploration_rate(config: ExplorationConfig, round_number: int) -> float:
    """eps_t for the 1-based round t (clipped to [0, 1])."""
    t = float(round_number)
    if config.exploration == "paper":
        eps = config.exploration_scale / math.sqrt(t + 10.0)
    elif config.exploration == "sqrt":
        eps = max(config.exploration_floor, config.exploration_scale / math.sqrt(t))
    else:
        eps = config.exploration_scale
    return min(1.0, max(0.0, eps))


def stage_of(config: ExplorationConfig, round_number: int) -> int:
    """Stage k of the 1-based round t: T_0 (2^k - 1) < t <= T_0 (2^(k+1) - 1)."""
    return int(math.floor(math.log2((round_number - 1) / config.stage_length + 1.0)))


def _stage_end(config: ExplorationConfig, stage: int) -> int:
    return config.stage_length * (2 ** (stage + 1) - 1)


def step_size(
    config: ExplorationConfig, round_number: int, n_arms: int, gradient_square_sum: np.ndarray
) -> np.ndarray:
    """gamma_t for the 1-based round t; shape (...) like ``gradient_square_sum``."""
    g2 = np.asarray(gradient_square_sum, dtype=float)
    if config.step_schedule == "constant":
        gamma = config.step_size
    elif config.step_schedule == "per_arm":
        gamma = config.step_size / n_arms
    elif config.step_schedule == "horizon":
        gamma = config.step_size / math.sqrt(config.horizon)
    elif config.step_schedule == "doubling":
        gamma = config.step_size / math.sqrt(_stage_end(config, stage_of(config, round_number)))
    else:
        numerator = config.step_size * math.sqrt(math.log(n_arms))
        return np.divide(numerator, np.sqrt(g2), out=np.zeros_like(g2), where=g2 > 0)
    return np.full_like(g2, gamma)


# ---------------------------------------------------------------------------- state
def initial_state(
    config: AlgorithmConfig,
    n_arms: int,
    n_metrics: int,
    batch_shape: tuple[int, ...] = (),
    objective: Objective | None = None,
) -> ControllerState:
    """State before round 1: uniform weights (Algorithm 1 line 1), p_1 uniform.

    Parameters
    ----------
    config : AlgorithmConfig
    n_arms, n_metrics : int
        K and M.
    batch_shape : tuple of int
        Leading batch dimensions (independent runs).
    objective : Objective, optional
        Supplies the initial guardrail weights lambda_0; without it the first update takes them
        from the objective it is given. With ``serving = "safe"`` and a ``serving_holdout``, it
        names the baseline arm, whose holdout share p_1 already serves.
    """
    if isinstance(n_arms, bool) or not isinstance(n_arms, (int, np.integer)) or n_arms < 1:
        raise ValueError(f"The number of arms must be a positive integer, got {n_arms!r}.")
    if isinstance(n_metrics, bool) or not isinstance(n_metrics, (int, np.integer)) or n_metrics < 1:
        raise ValueError(f"The number of metrics must be a positive integer, got {n_metrics!r}.")
    batch_shape = tuple(int(b) for b in batch_shape)
    vector_shape = batch_shape + (int(n_arms),)
    uniform = np.full(vector_shape, 1.0 / n_arms)
    served = uniform
    if config.safe:
        from pasto import serving

        served = np.broadcast_to(serving.starting_probabilities(config.serving, objective, int(n_arms)),
                                 vector_shape).copy()
    penalties = np.zeros(0) if objective is None else objective.penalties
    accumulators = _estimator(config).start(n_metrics, n_arms, batch_shape)
    return ControllerState(
        round_index=0,
        probabilities=served,
        deployed=uniform.copy(),
        log_weights=np.full(vector_shape, -math.log(n_arms)),
        probability_sum=np.zeros(vector_shape),
        stage_probability_sum=np.zeros(vector_shape),
        gradient_square_sum=np.zeros(batch_shape),
        guardrail_weights=np.broadcast_to(penalties, batch_shape + penalties.shape).copy(),
        history=accumulators.history,
        baseline=accumulators.baseline,
        discounted=accumulators.discounted,
        changes=np.zeros(batch_shape, dtype=int) if config.safe else None,
    )


def _check_statistics(name: str, statistics: Statistics, shape: tuple[int, ...]) -> None:
    if not isinstance(statistics, Statistics):
        raise ValueError(f"{name} must be a pasto.estimators.Statistics, got {type(statistics).__name__}.")
    if statistics.shape != shape:
        raise ValueError(f"{name} must have shape {shape} (batch, metrics, arms), got {statistics.shape}.")
    for part in (statistics.counts, statistics.sums, statistics.sums_of_squares):
        if not np.all(np.isfinite(part)):
            raise ValueError(f"{name} contains non-finite values.")
    if np.any(statistics.counts < 0):
        raise ValueError(f"{name} has negative counts.")


def estimate(config: AlgorithmConfig, state: ControllerState, pooled_statistics: Statistics) -> Estimate:
    """The algorithm's current estimate of the M x K means.

    Parameters
    ----------
    config : AlgorithmConfig
    state : ControllerState
    pooled_statistics : Statistics
        Observations over every round so far, shape (..., M, K) (used by ``pooled``).
    """
    return _estimator(config).estimate(state.accumulators, pooled_statistics)


def _estimator(config: AlgorithmConfig) -> Estimator:
    """The estimator object of ``config`` (its name and discount)."""
    return make_estimator(config.estimation.estimator, config.estimation.discount)


def _exploitation(log_weights: np.ndarray) -> np.ndarray:
    return softmax(log_weights, axis=-1)


def _plausible_arms(
    objective: Objective,
    current: Estimate,
    mixture: np.ndarray,
    thresholds: np.ndarray,
    penalties: np.ndarray | None,
    z: float,
) -> np.ndarray:
    """Uniform distribution over the arms that could belong to the optimal support; (..., K).

    At the optimum of f(V p) every arm has g_k <= w . g (equality on the support). An arm is
    plausible when g_k + z * se(g_k) >= w . g, with se(g_k) = sqrt(sum_m (df/dx_m)^2 se[m, k]^2);
    undefined standard errors count as infinite.
    """
    means = current.means
    x = np.einsum("...mk,...k->...m", means, mixture)
    gradient_x = objective.gradient(x, thresholds, penalties)
    gradient = np.einsum("...mk,...m->...k", means, gradient_x)
    level = np.sum(mixture * gradient, axis=-1, keepdims=True)
    errors = np.where(np.isnan(current.standard_errors), np.inf, current.standard_errors)
    relevant = gradient_x[..., :, None] != 0
    variance = np.sum(np.where(relevant, (gradient_x[..., :, None] * errors) ** 2, 0.0), axis=-2)
    with np.errstate(invalid="ignore"):
        plausible = gradient + z * np.sqrt(variance) >= level - 1e-12 * np.abs(level)
    plausible = plausible | (mixture >= np.max(mixture, axis=-1, keepdims=True))
    return plausible / plausible.sum(axis=-1, keepdims=True)


def _deployed(
    rule: str,
    round_index: int,
    probability_sum: np.ndarray,
    stage_probability_sum: np.ndarray,
    exploitation: np.ndarray,
) -> np.ndarray:
    if rule == "average":
        return probability_sum / round_index
    if rule == "stage":
        return stage_probability_sum / stage_probability_sum.sum(axis=-1, keepdims=True)
    return exploitation


def deployed_mixture(state: ControllerState, rule: str) -> np.ndarray:
    """The mixture the deploy rule ``rule`` recommends in ``state`` (after at least one round).

    The deploy rule does not feed back into what is served, so one trajectory can be scored under
    every rule: ``deployed_mixture(state, config.deploy)`` equals ``state.deployed``.
    """
    if rule not in DEPLOY_RULES:
        raise ValueError(f"Unknown deploy rule {rule!r}; the rules are {list(DEPLOY_RULES)}.")
    if state.round_index < 1:
        return state.deployed
    return _deployed(
        rule, state.round_index, state.probability_sum, state.stage_probability_sum, _exploitation(state.log_weights)
    )


def update(
    config: AlgorithmConfig,
    objective: Objective,
    state: ControllerState,
    round_statistics: Statistics,
    pooled_statistics: Statistics,
    propensities: np.ndarray | None = None,
    *,
    rng: np.random.Generator | None = None,
    choose_mixtures: bool = True,
) -> ControllerState:
    """Close round ``state.round_index`` and return the state for the next round.

    Parameters
    ----------
    config : AlgorithmConfig
    objective : Objective
    state : ControllerState
    round_statistics : Statistics, shape (..., M, K)
        Observations of the closing round only (the IPS estimators' U_t; the round's observation
        count per metric plays the role of the paper's Q).
    pooled_statistics : Statistics, shape (..., M, K)
        Observations over every round so far, late ones included (pooled estimator, and the
        control-variate baseline for the next round).
    propensities : ndarray, shape (..., K), optional
        The p served when ``round_statistics`` were sampled; defaults to ``state.probabilities``.
        With the ``ips`` and ``control_variate`` estimators an arm with observations must have p > 0.
    rng : numpy.random.Generator, optional
        Source of safe serving's posterior draws; required with ``serving = "safe"``. Derive it
        from the experiment's seed and the round (:func:`round_generator`), so that a close is
        reproducible and two experiments draw differently in the same round.
    choose_mixtures : bool, default True
        With ``serving = "safe"``, False skips :func:`pasto.serving.choose` and keeps the state's
        probabilities, deployed mixture and log-weights, every other field being updated as usual:
        for a caller that replaces those three (:func:`pasto.segments.segmented_update` with several
        segments sets them from its joint LP), the choice would be computed only to be discarded.
        The exploration path always computes its mixtures (the gradient sums and guardrail weights
        it returns come from the same steps).

    Returns
    -------
    ControllerState
        ``round_index + 1``, new probabilities (each >= eps/K, summing to 1) and deployed mixture.
    """
    n_arms = state.n_arms
    n_metrics = objective.n_metrics
    batch_shape = state.batch_shape
    matrix_shape = batch_shape + (n_metrics, n_arms)
    _check_statistics("round_statistics", round_statistics, matrix_shape)
    _check_statistics("pooled_statistics", pooled_statistics, matrix_shape)
    served = state.probabilities
    if propensities is None:
        propensities = served
    propensities = np.asarray(propensities, dtype=float)
    if propensities.shape != batch_shape + (n_arms,):
        raise ValueError(
            f"propensities must have shape {batch_shape + (n_arms,)}, got {propensities.shape}."
        )
    # Only the inverse-propensity estimators divide by p: the pooled estimator takes an unserved arm's
    # data as what it is (pushed statistics and warehouse sources can carry such cells, and under safe
    # serving most arms have p = 0).
    if config.safe and choose_mixtures and rng is None:
        raise ValueError("Safe serving draws from the posterior: pass rng, e.g. round_generator(seed, round).")
    if config.estimation.estimator != "pooled" and np.any((propensities <= 0) & (round_statistics.counts > 0).any(axis=-2)):
        raise ValueError("An arm has observations in the round but a served probability of 0, which the "
                         f"{config.estimation.estimator!r} estimator cannot weight (it divides by the probability).")

    # Metrics of absurd scale may overflow intermediate values (f, its gradient, variances);
    # every such value is sanitised below, so the warnings carry no information.
    with np.errstate(over="ignore", invalid="ignore"):
        return _advance(config, objective, state, round_statistics, pooled_statistics, propensities, rng, choose_mixtures)


def _advance(
    config: AlgorithmConfig,
    objective: Objective,
    state: ControllerState,
    round_statistics: Statistics,
    pooled_statistics: Statistics,
    propensities: np.ndarray,
    rng: np.random.Generator | None,
    choose_mixtures: bool = True,
) -> ControllerState:
    """Close round t = ``state.round_index + 1`` (inputs already validated by :func:`update`).

    The steps, in order: estimate, gradient step, solve, guardrail weights, exploration, deploy.
    """
    t = state.round_index + 1
    if config.safe:
        return _safe_advance(
            config, objective, state, round_statistics, pooled_statistics, propensities, rng, choose_mixtures
        )
    accumulators, current = _estimate_step(
        config, state, round_statistics, pooled_statistics, propensities
    )
    config = config.exploration  # the steps below read only the exploration options
    dual = config.guardrail_weights == "dual_ascent"
    thresholds = objective.thresholds(current.means)
    guardrail_weights = _starting_guardrail_weights(objective, state)
    penalties = guardrail_weights if dual else None
    log_weights, gradient_square_sum = _gradient_step(
        config, objective, state, current.means, thresholds, penalties, t
    )
    log_weights = _solve_step(config, objective, current, thresholds, penalties, log_weights, t)
    exploitation = _exploitation(log_weights)
    if dual:
        guardrail_weights = _dual_ascent_step(
            config, objective, current.means, thresholds, guardrail_weights, exploitation
        )
    probabilities = _exploration_step(config, objective, current, thresholds, penalties, exploitation, t)
    probability_sum, stage_probability_sum, deployed = _deploy_step(config, state, exploitation, t)
    return ControllerState(
        round_index=t,
        probabilities=probabilities,
        deployed=deployed,
        log_weights=log_weights,
        probability_sum=probability_sum,
        stage_probability_sum=stage_probability_sum,
        gradient_square_sum=gradient_square_sum,
        guardrail_weights=guardrail_weights,
        history=accumulators.history,
        baseline=accumulators.baseline,
        discounted=accumulators.discounted,
    )


def _statistics_difference(total: Statistics, origin: Statistics | None) -> Statistics:
    """``total - origin`` (counts and sums since ``origin``; None counts as no observations)."""
    if origin is None:
        return total
    counts = np.maximum(total.counts - origin.counts, 0.0)
    # A cell without new observations is exactly empty (not a rounding residue of two big sums).
    empty = counts == 0
    return Statistics(
        counts,
        np.where(empty, 0.0, total.sums - origin.sums),
        np.where(empty, 0.0, np.maximum(total.sums_of_squares - origin.sums_of_squares, 0.0)),
    )


def _statistics_where(condition: np.ndarray, chosen: Statistics, other: Statistics | None) -> Statistics:
    """Per run (``condition``, shape (...)): ``chosen`` where True, else ``other`` (None = zeros)."""
    mask = np.asarray(condition)[..., None, None]
    if other is None:
        other = Statistics.zeros(*chosen.shape[-2:], chosen.shape[:-2])
    return Statistics(
        np.where(mask, chosen.counts, other.counts),
        np.where(mask, chosen.sums, other.sums),
        np.where(mask, chosen.sums_of_squares, other.sums_of_squares),
    )


def _safe_advance(
    config: AlgorithmConfig,
    objective: Objective,
    state: ControllerState,
    round_statistics: Statistics,
    pooled_statistics: Statistics,
    propensities: np.ndarray,
    rng: np.random.Generator | None,
    choose_mixtures: bool = True,
) -> ControllerState:
    """Close round t with ``serving = "safe"``: :func:`pasto.serving.choose` on the evidence since
    the last detected change.

    The evidence is the pooled statistics minus ``change_origin`` (late observations included).
    Every ``change_every`` rounds the detector looks (:func:`pasto.serving.change_detected`): each
    window (the pooled statistics minus its origin, :data:`pasto.serving.CHANGE_WINDOWS` looks
    long) is tested against the rest of the evidence; a window that has reached its length starts
    afresh. A run where some window differs drops all its evidence (``change_origin`` and every
    window origin = the pooled statistics now, and its discounted statistics are zeroed) and is
    served uniformly until its bounds are defined again; until then it keeps its deployed mixture.
    The EG step and the solve of the exploration path are skipped. With ``choose_mixtures`` False
    the state's probabilities, deployed mixture and weights are kept (the caller replaces them;
    see :func:`update`).
    """
    from pasto import serving

    t = state.round_index + 1
    accumulators = _estimator(config).absorb(state.accumulators, round_statistics, pooled_statistics, propensities)
    rule = config.serving
    # Safe serving deploys by its own test; the served mixtures' sum is kept for the report.
    probability_sum = state.probability_sum + state.probabilities
    change_origin, window_origins = state.change_origin, state.window_origins
    changes = state.changes if state.changes is not None else np.zeros(state.batch_shape, dtype=int)
    evidence = _statistics_difference(pooled_statistics, change_origin)
    if rule.change_level > 0 and t % rule.change_every == 0:
        look = t // rule.change_every
        lengths = serving.CHANGE_WINDOWS
        if window_origins is None:
            starts = [change_origin] * len(lengths)
        else:
            starts = [Statistics(window_origins.counts[i], window_origins.sums[i], window_origins.sums_of_squares[i])
                      for i in range(len(lengths))]
        windows = [_statistics_difference(pooled_statistics, start) for start in starts]
        changed = serving.change_detected(evidence, windows, rule.change_level, look)
        if changed.any():
            change_origin = _statistics_where(changed, pooled_statistics, change_origin)
            evidence = _statistics_difference(pooled_statistics, change_origin)
            if accumulators.discounted is not None:
                kept = _statistics_where(~changed, accumulators.discounted, None)
                accumulators = dataclasses.replace(accumulators, discounted=kept)
            changes = changes + changed
        # A window restarts when it reaches its length, or with the evidence after a change.
        starts = [_statistics_where(changed | (look % length == 0), pooled_statistics, start)
                  for start, length in zip(starts, lengths)]
        window_origins = Statistics(*(np.stack([getattr(start, name) for start in starts])
                                      for name in ("counts", "sums", "sums_of_squares")))
    if choose_mixtures:
        statistics = evidence if accumulators.discounted is None else accumulators.discounted
        batch = max(1, int(np.prod(state.batch_shape)))
        observations = float(round_statistics.counts[..., 0, :].sum()) / batch
        probabilities, deployed, log_weights = serving.choose(
            rule, objective, statistics, t, state.log_weights, observations, state.deployed, rng
        )
        log_weights = np.maximum(log_weights, log_weights.max(axis=-1, keepdims=True) - 700.0)
    else:
        probabilities, deployed, log_weights = state.probabilities, state.deployed, state.log_weights
    return ControllerState(
        round_index=t,
        probabilities=probabilities,
        deployed=deployed,
        log_weights=log_weights,
        probability_sum=probability_sum,
        stage_probability_sum=state.stage_probability_sum,
        gradient_square_sum=state.gradient_square_sum,
        guardrail_weights=_starting_guardrail_weights(objective, state),
        history=accumulators.history,
        baseline=accumulators.baseline,
        discounted=accumulators.discounted,
        change_origin=change_origin,
        window_origins=window_origins,
        changes=changes,
    )


def _estimate_step(
    config: AlgorithmConfig,
    state: ControllerState,
    round_statistics: Statistics,
    pooled_statistics: Statistics,
    propensities: np.ndarray,
) -> tuple[Accumulators, Estimate]:
    """Step 1: the estimator takes in the closing round; returns its accumulators and V_t (M x K)."""
    estimator = _estimator(config)
    accumulators = estimator.absorb(state.accumulators, round_statistics, pooled_statistics, propensities)
    return accumulators, estimator.estimate(accumulators, pooled_statistics)


def _starting_guardrail_weights(objective: Objective, state: ControllerState) -> np.ndarray:
    """The penalties lambda (..., G) in force for this round.

    A state made without the objective (as the service and the simulator make it) carries no
    penalties yet and starts from the objective's.
    """
    if state.guardrail_weights.shape[-1:] != objective.penalties.shape:
        return np.broadcast_to(objective.penalties, state.batch_shape + objective.penalties.shape).copy()
    return state.guardrail_weights


def _gradient_step(
    config: ExplorationConfig,
    objective: Objective,
    state: ControllerState,
    means: np.ndarray,
    thresholds: np.ndarray,
    penalties: np.ndarray | None,
    t: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Steps 2-3: g_t = V^T grad f(V p_t) (Eq. 7) at the served p_t, then one EG step in log space.

    Returns the normalised log weights (..., K) and the new sum of squared gradient spreads (...).
    """
    x = np.einsum("...mk,...k->...m", means, state.probabilities)
    gradient = np.einsum("...mk,...m->...k", means, objective.gradient(x, thresholds, penalties))
    # EG ignores constants added to g, so the centred gradient is used; it is handled as
    # scale * direction (|direction| <= 2) so that absurd metric scales cannot overflow to inf/nan.
    gradient = np.nan_to_num(gradient, nan=0.0, posinf=_LARGEST, neginf=-_LARGEST)
    scale = np.max(np.abs(gradient), axis=-1)
    scale = np.where(scale > 0, scale, 1.0)
    direction = gradient / scale[..., None]
    direction = direction - direction.mean(axis=-1, keepdims=True)
    spread = np.max(np.abs(direction), axis=-1) * scale
    gradient_square_sum = state.gradient_square_sum + spread**2
    gamma = step_size(config, t, state.n_arms, gradient_square_sum)
    # No log weight moves by more than _MAX_LOG_STEP in one round (only reachable with
    # gradients of absurd size; the order of the arms' moves is kept).
    move = np.minimum(gamma * scale, _MAX_LOG_STEP)
    log_weights = state.log_weights + move[..., None] * direction
    log_weights = log_weights - logsumexp(log_weights, axis=-1, keepdims=True)
    return log_weights, gradient_square_sum


def _solve_step(
    config: ExplorationConfig,
    objective: Objective,
    current: Estimate,
    thresholds: np.ndarray,
    penalties: np.ndarray | None,
    log_weights: np.ndarray,
    t: int,
) -> np.ndarray:
    """Step 4: in solve-per-round mode, every ``solve_every`` rounds, move the log weights (..., K)
    to the maximiser of f(V p) (or of the expected objective) by warm-started mirror ascent.

    In every round the log weights are then floored so that they stay finite.
    """
    if config.solve_every and t % config.solve_every == 0 and config.solve_steps > 0:
        lifted = np.maximum(log_weights, log_weights.max(axis=-1, keepdims=True) - _SOLVE_LOG_WEIGHT_FLOOR)
        errors = current.standard_errors if config.solve_objective == "expected" else None
        log_weights = mirror_ascent(
            objective, current.means, thresholds, lifted, config.solve_steps, penalties, standard_errors=errors
        )
    # Arms far below the best keep a finite log weight (their mass, < e^-700, is zero anyway).
    return np.maximum(log_weights, log_weights.max(axis=-1, keepdims=True) - 700.0)


def _dual_ascent_step(
    config: ExplorationConfig,
    objective: Objective,
    means: np.ndarray,
    thresholds: np.ndarray,
    guardrail_weights: np.ndarray,
    exploitation: np.ndarray,
) -> np.ndarray:
    """Step 5 (``dual_ascent`` only): lambda <- max(0, lambda + dual_step (c - y)), shape (..., G),
    with y the estimated guardrail metrics of the exploitation mixture."""
    y = np.einsum("...mk,...k->...m", means, exploitation)[..., objective.guardrail_rows]
    raised = guardrail_weights + config.dual_step * (thresholds - y)
    raised = np.where(np.isnan(raised), guardrail_weights, raised)
    return np.clip(raised, 0.0, _LARGEST)


def _exploration_step(
    config: ExplorationConfig,
    objective: Objective,
    current: Estimate,
    thresholds: np.ndarray,
    penalties: np.ndarray | None,
    exploitation: np.ndarray,
    t: int,
) -> np.ndarray:
    """Step 6: p_{t+1} = (1 - eps_{t+1}) ((1 - rho) w + rho d) + eps_{t+1} / K, shape (..., K)
    (Algorithm 1 line 3; d uniform over the plausible arms, rho = ``directed_share``)."""
    eps = exploration_rate(config, t + 1)
    target = exploitation
    if config.directed_share > 0:
        directed = _plausible_arms(objective, current, exploitation, thresholds, penalties, config.directed_z)
        target = (1.0 - config.directed_share) * exploitation + config.directed_share * directed
    return (1.0 - eps) * target + eps / exploitation.shape[-1]


def _deploy_step(
    config: ExplorationConfig, state: ControllerState, exploitation: np.ndarray, t: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step 7: add the served p_t to the running sums; returns them and the deployed mixture (..., K)."""
    served = state.probabilities
    probability_sum = state.probability_sum + served
    if t == 1 or stage_of(config, t) != stage_of(config, t - 1):
        stage_probability_sum = served.copy()
    else:
        stage_probability_sum = state.stage_probability_sum + served
    deployed = _deployed(config.deploy, t, probability_sum, stage_probability_sum, exploitation)
    return probability_sum, stage_probability_sum, deployed
