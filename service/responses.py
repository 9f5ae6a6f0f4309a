"""Response bodies of the JSON API, defined once as pydantic models.

The routes build every successful JSON response from these models (:func:`respond`), and
``service.openapi`` generates the response schemas of the OpenAPI document from them, so the published
contract is what is sent. Field order is the key order on the wire. Numbers keep the type they were
given (``Number``: an ``int`` stays ``60``, not ``60.0``), and non-finite floats are sent as null
(``Finite``): JSON has no NaN or infinity.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from json.encoder import encode_basestring_ascii
from typing import Annotated, Any, Literal

from flask import Response, jsonify
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

Number = int | float


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


#: A number, or null where it is undefined or not finite.
Finite = Annotated[Number | None, BeforeValidator(_finite_or_none)]
Timestamp = Annotated[str, Field(json_schema_extra={"format": "date-time"})]
#: ``anyOf: [{type: string, format: date-time}, {type: null}]``: the format on the string member, where
#: generators read it (beside ``anyOf`` they type the field as a plain string).
OptionalTimestamp = Timestamp | None


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Response):
    code: str
    message: str
    details: Any = None


class Error(_Response):
    error: ErrorDetail


class RoundTimes(_Response):
    index: Annotated[int, Field(ge=0)]
    started_at: Timestamp
    ends_at: Timestamp


class ArmView(_Response):
    name: str
    params: dict[str, Any]


class ArmSummary(_Response):
    """Which arms a summarised response (``?arms=N``, N < K) keeps in its per-arm arrays."""

    arms: list[int] = Field(description=(
        "Positions (0-based, in the experiment's arm order) of the N arms kept: those of largest weight "
        "max(p_t, deployed) when the response was made, largest first, ties by position. Every per-arm array of the "
        "response (also per round and per segment) holds these arms, in this order."))
    names: list[str] = Field(description="The kept arms' names, in the same order.")
    rest_arms: int = Field(description="Arms left out (K - N); each `rest` object sums them.")


class ArmRest(_Response):
    """The arms a summarised response leaves out, as one aggregate entry beside its per-arm arrays; each
    response sets the fields of the arrays it has."""

    arms: int = Field(description="How many arms are summed here (K - N).")
    probabilities: Finite = Field(default=None, description="Their summed probability in `probabilities`.")
    deployed: Finite = Field(default=None, description="Their summed probability in `deployed` (null where that "
                                                       "array is null).")
    counts: int | None = Field(default=None, description="Their summed observations (`counts`).")
    units: int | None = Field(default=None, description="Their summed distinct units (`units`).")
    best_mixture: Finite = Field(default=None, description="Their summed probability in the best mixture.")
    deployed_means: dict[str, Finite] | None = Field(default=None, description=(
        "Per metric, the sum over these arms of deployed probability x estimated mean (arms of zero "
        "deployed probability left out; null when one of the others has no observation of the metric yet: "
        "its mean in `estimate` is then only the other arms' average)."))
    deployed_variances: dict[str, Finite] | None = Field(default=None, description=(
        "Per metric, the sum over these arms of (deployed probability x standard error)^2, likewise (also null "
        "when one of them has no standard error yet)."))


class SegmentsView(_Response):
    names: list[str] = Field(description="The segments with a mixture of their own, in order; an open set's "
                                         "first is \"(other)\", the long tail.")
    by: str | None = Field(default=None, description="Open set: the attribute whose values are the segments.")
    min_units: int | None = Field(default=None, description="Open set: units a value needs for its own mixture.")
    max_segments: int | None = Field(default=None, description="Open set: most values with a mixture of their own.")
    shares: list[Number] | None = Field(description="The expected traffic shares given at creation (null: none).")
    scopes: list[Literal["segment", "global"]] = Field(description="Scope of each guardrail of the objective.")
    shrink: bool
    confidence_z: Number
    probabilities: dict[str, list[Number]] = Field(description="p_t per segment (aligned with arms).")
    deployed: dict[str, list[Number]] = Field(description="The mixture recommended now, per segment.")


class Experiment(_Response):
    name: str
    status: Literal["running", "paused", "stopped"]
    arms: list[ArmView]
    metrics: list[str]
    objective: dict[str, Any]
    algorithm: dict[str, Any] = Field(description="The complete algorithm configuration the experiment runs.")
    round_seconds: Number
    settle_seconds: Number
    seed: int
    round: RoundTimes
    applied_rounds: int = Field(description="Rounds whose update has run.")
    probabilities: list[Number] = Field(description="p_t, sampled from in the current round (aligned with arms).")
    deployed: list[Number] = Field(description="The mixture the algorithm recommends now.")
    segments: SegmentsView | None = Field(default=None, description="Segmented experiments only; "
                                          "probabilities and deployed above are then their traffic-weighted aggregate.")
    created_at: Timestamp
    updated_at: Timestamp
    archived_at: OptionalTimestamp = Field(
        None, description="When the experiment was archived (null: not archived). An archived experiment is stopped.")
    source: dict[str, Any] | None = Field(
        default=None, description="The metric source the experiment was created with (docs/scaling.md), or null.")
    arm_summary: ArmSummary | None = Field(
        default=None, description="`?arms=N` with N < K only: the arms kept in `arms`, `probabilities`, `deployed` "
                                  "and the segments' arrays.")
    rest: ArmRest | None = Field(default=None, description="`?arms=N` with N < K only: the arms left out, summed.")


class ExperimentList(_Response):
    experiments: list[Experiment]


class ExperimentDeleted(_Response):
    name: str
    deleted_rows: dict[str, Annotated[int, Field(ge=0)]] = Field(
        description="Rows deleted per table, the experiment's own row under `experiments`.")


class Assignment(_Response):
    unit: str
    arm: str
    params: dict[str, Any]
    round: int
    probability: Number = Field(description="Propensity p_{t,arm}.")
    segment: str | None = Field(default=None, description="Segmented experiments: the unit's segment, whose "
                                                           "mixture the arm was drawn from.")


class AssignmentBatch(_Response):
    assignments: list[Assignment]


class IngestResult(_Response):
    accepted: Annotated[int, Field(ge=0)]
    duplicates: Annotated[int, Field(ge=0)]


class StatisticsResult(_Response):
    batch_id: str
    duplicate: bool = Field(description="The batch id was applied before with the same content: nothing was written.")
    cells: Annotated[int, Field(ge=0)] = Field(description="Cells added (0 for a duplicate).")
    units: Annotated[int, Field(ge=0)] = Field(description="Units entries added (0 for a duplicate).")
    late_cells: Annotated[int, Field(ge=0)] = Field(description="Cells for rounds whose update had run (late data).")


class RoundClosed(_Response):
    closed_round: int | None
    applied: list[int]
    round: RoundTimes
    probabilities: list[Number]
    deployed: list[Number]


class BestSingle(_Response):
    arm: str
    value: Finite


class Guardrail(_Response):
    """One guardrail's estimate (``pasto.diagnostics.guardrail_report``; keys it may add later are left
    out until they are documented here)."""

    model_config = ConfigDict(extra="ignore")

    metric: str
    threshold: Finite
    relative_to: str | None = Field(description="The arm the threshold is relative to, if any.")
    estimate: Finite
    interval: list[Finite] = Field(description="95% interval of the estimate.")
    holds: bool | None = Field(description="The estimate is at or above the threshold; null before any observation.")
    confidently_holds: bool | None = Field(
        description="The whole interval is above the threshold; null before any observation.")


# ------------------------------------------------------------------------------ a round's stored summary
class _Stored(BaseModel):
    """A part of a round's stored summary: keys written by other versions are kept (``extra``), and a
    key a row does not have is left out again when it is written back (``exclude_unset``)."""

    model_config = ConfigDict(extra="allow", frozen=True)


class StoredGuardrail(_Stored):
    """One guardrail's estimate as ``pasto.diagnostics.guardrail_report`` gives it."""

    metric: str
    threshold: float | None = None
    relative_to: str | None = None
    estimate: float | None = None
    interval: list[float | None] | None = None
    holds: bool | None = None
    confidently_holds: bool | None = None


class StoredBestSingle(_Stored):
    arm_index: int
    value: float | None = None


class StoredLift(_Stored):
    """``service.controller.reports.lift_summary``: per mixture and measure (``primary``, ``objective``),
    ``estimate``, ``interval``, ``relative``, ``relative_interval``."""

    baseline_index: int
    served: dict[str, dict[str, Any]]
    deployed: dict[str, dict[str, Any]]


class StoredSegment(_Stored):
    """One segment of a segmented round summary (``controller.reports.segment_summary``)."""

    name: str | None = None  # None: the segments were not named when the summary was made
    share: float | None = None  # its measured traffic share
    observations: int | None = None
    probabilities: list[float | None] | None = None  # p_t served to the segment in the round (K,)
    deployed: list[float | None] | None = None  # its deployed mixture after the update (K,)
    objective: float | None = None  # a . (means_s p_s) of the deployed mixture
    guardrails: list[StoredGuardrail] | None = None  # of the deployed mixture, on the segment's estimate


class StoredPlatformGuardrail(_Stored):
    """One guardrail over the whole platform (``pasto.segments.segment_report``'s platform_guardrails)."""

    metric: str
    scope: str | None = None  # "global" or "segment"
    threshold: float | None = None
    estimate: float | None = None
    interval: list[float | None] | None = None
    holds: bool | None = None


class StoredGlobalMixture(_Stored):
    """The best single mixture for every segment under the same guardrails, and its platform value."""

    probabilities: list[float | None] | None = None
    objective: float | None = None


class StoredGain(_Stored):
    """What segmenting gains over the global mixture, with its 95% interval."""

    value: float | None = None
    interval: list[float | None] | None = None


class StoredSegments(_Stored):
    """The per-segment part of a segmented experiment's round summary and of its diagnostics
    (``controller.reports.segment_summary``)."""

    segments: list[StoredSegment] | None = None
    objective: float | None = None  # the platform value of the deployed per-segment mixtures
    platform_guardrails: list[StoredPlatformGuardrail] | None = None
    global_mixture: StoredGlobalMixture | None = None
    gain: StoredGain | None = None

    def to_json(self) -> dict[str, Any]:
        """As stored (and as the rounds and diagnostics answers send it)."""
        return self.model_dump(mode="json", exclude_unset=True)


class RoundSummary(_Stored):
    """What the service knows of a round after its update, stored as JSON in ``rounds.summary``: written
    by the close (``service.controller.rounds``, from ``controller.reports.round_summary``) and read
    by the store (the regrets), the rounds API (:class:`RoundView`, whose fields the dashboard draws)
    and the Prometheus exporter (``service.monitoring``).

    Every key is optional when read: rows written by older versions lack the later ones
    (``objective_deployed``, ``guardrails_deployed``, ``lift``) and read as None; :meth:`to_json`
    writes back exactly the keys a summary was made or loaded with, so stored rows keep their shape.
    """

    objective: float | None = None  # f(V p_t): the traffic served in the round
    objective_deployed: float | None = None  # the mixture recommended after its update
    best_mixture: float | None = None
    best_single: StoredBestSingle | None = None
    regret: float | None = None
    guardrails: list[StoredGuardrail] | None = None  # under the traffic served in the round
    guardrails_deployed: list[StoredGuardrail] | None = None  # under the recommended mixture
    lift: StoredLift | None = None  # None: the objective has no baseline arm
    segments: StoredSegments | None = None  # segmented experiments: controller.reports.segment_summary

    @classmethod
    def load(cls, stored: dict[str, Any] | None) -> RoundSummary | None:
        """The summary of a ``rounds.summary`` value (None: no summary yet)."""
        return None if stored is None else cls.model_validate(stored)

    def to_json(self) -> dict[str, Any]:
        """What ``rounds.summary`` stores."""
        return self.model_dump(mode="json", exclude_unset=True)

    def guardrails_json(self, deployed: bool = False) -> list[dict[str, Any]] | None:
        """The served (``deployed``: the recommended mixture's) guardrails as stored."""
        guardrails = self.guardrails_deployed if deployed else self.guardrails
        return None if guardrails is None else [guardrail.model_dump(mode="json", exclude_unset=True)
                                                for guardrail in guardrails]


class RoundSegments(_Response):
    probabilities: dict[str, list[Number]] = Field(description="p_t served in the round, per segment.")
    observations: dict[str, int] = Field(description="Observations in the round, per segment.")
    summary: dict[str, Any] | None = Field(description=(
        "After the round's update: per segment its share, mixtures, objective and guardrails, the platform-wide "
        "guardrails and the gain of segmenting (as the diagnostics' segments; null until applied)."))


class LiftValue(_Response):
    estimate: Finite = Field(description="The mixture's value minus the baseline arm's.")
    interval: list[Finite] = Field(description="95% interval of the estimate (delta method); null ends while an "
                                               "arm in use has too little data.")
    relative: Finite = Field(description="The estimate as a share of the baseline's value (null unless that "
                                         "value is positive).")
    relative_interval: list[Finite] = Field(description="95% interval of the relative lift.")


class MixtureLift(_Response):
    primary: LiftValue = Field(description="Lift on the primary metric (the weighted sum of primary metrics).")
    objective: LiftValue = Field(description="Lift on the objective f (primary minus soft penalties).")


class Lift(_Response):
    baseline: str = Field(description="The arm the lifts are measured against (the objective's baseline, else "
                                      "the first relative_to arm; a holdout is served this arm).")
    served: MixtureLift = Field(description="The traffic served (p_t, exploration included).")
    deployed: MixtureLift = Field(description="The deployed mixture.")

    @classmethod
    def from_summary(cls, stored: StoredLift | None, arm_names: Sequence[str]) -> Lift | None:
        """From a round summary's lift (None stays None)."""
        if stored is None:
            return None
        return cls(baseline=arm_names[stored.baseline_index],
                   served=MixtureLift(**stored.served), deployed=MixtureLift(**stored.deployed))


class RoundView(_Response):
    index: int
    started_at: Timestamp
    ends_at: Timestamp
    closed_at: OptionalTimestamp
    applied_at: OptionalTimestamp = Field(description="When the round's update ran (settle_seconds after it ended).")
    probabilities: list[Number]
    deployed: list[Number] | None
    counts: list[int] = Field(description="Observations per arm.")
    units: list[int] = Field(description="Distinct observed units per arm.")
    late_observations: int
    means: dict[str, list[Finite]]
    objective: Finite = Field(description="Estimated f(V p_t) after the round's update.")
    objective_deployed: Finite
    best_mixture: Finite
    best_single: BestSingle | None
    regret: Finite
    guardrails: list[dict[str, Any]] | None  # as stored with the round
    guardrails_served: list[Guardrail] | None = Field(
        default=None, description="Each guardrail under the traffic served in the round (p_t, exploration "
                                  "included), on the estimate right after the round's update.")
    guardrails_deployed: list[Guardrail] | None = Field(
        default=None, description="Each guardrail under the deployed mixture right after the round's update "
                                  "(null for rounds stored before this was recorded).")
    segments: RoundSegments | None = Field(default=None, description="Segmented experiments only.")
    lift: Lift | None = Field(
        default=None, description="Lift of the served and deployed mixtures over the baseline arm, on the "
                                  "estimate right after the round's update (null without a baseline arm, or "
                                  "for rounds stored before this was recorded).")
    rest: ArmRest | None = Field(default=None, description="`?arms=N` with N < K only: the arms left out of this "
                                                           "round's per-arm arrays, summed (not `means`).")


class SourceErrorView(_Response):
    """The experiment's metric source is failing: its rounds do not close until it answers again."""

    message: str = Field(description="The source's sentence (the engine's own message kept in it).")
    since: Timestamp = Field(description="The first failed attempt of this run of failures.")
    last_failed_at: Timestamp
    failures: int = Field(description="Failed attempts of the experiment's source, ever "
                                      "(pasto_source_errors_total).")


class RoundList(_Response):
    rounds: list[RoundView]
    next_since: int | None = Field(
        description="The `since` of the next page, or null when this page ends with the current round.")
    source_error: SourceErrorView | None = Field(
        default=None, description="Null unless the experiment's metric source is failing (its round stays open).")
    arm_summary: ArmSummary | None = Field(
        default=None, description="`?arms=N` with N < K only: the arms every round's per-arm arrays keep (chosen "
                                  "once for the page, so rounds line up).")


class ExperimentEvent(_Response):
    id: int = Field(description="Orders the events of every experiment; the `since` of a page. Never given out "
                               "twice, even after a delete.")
    kind: Literal["created", "paused", "resumed", "stopped", "controller_started"] = Field(
        description="What happened; controller_started: a scheduler process (pasto serve or pasto worker) started.")
    round: int = Field(description="The round being served when it happened.")
    at: Timestamp
    details: dict[str, Any] | None = Field(
        description="What the kind adds (controller_started: the scheduler's host:pid), or null.")


class ExperimentEventList(_Response):
    events: list[ExperimentEvent]
    next_since: int | None = Field(description="The `since` of the next page, or null after the last event.")


class MixtureValues(_Response):
    probabilities: Finite
    deployed: Finite


class ShadowPrice(_Response):
    """One guardrail's shadow price at the best mixture."""

    metric: str = Field(description="The guarded metric (entries are in the objective's guardrail order, as "
                                    "`guardrails`).")
    hard: bool = Field(description="Whether the guardrail is hard (a constraint); only a hard one has a price.")
    shadow_price: Finite = Field(description=(
        "Objective units the best mixture's value would gain per unit the guardrail's threshold is lowered "
        "(the derivative of the optimum in the threshold, at the point estimates): >= 0, and 0 when the "
        "guardrail does not bind. A unit is one unit of the guarded metric, i.e. of the resolved `threshold` "
        "also for a relative guardrail (lowering its relative allowance by d lowers the threshold by d times "
        "the `relative_to` arm's estimate). Null for a soft guardrail (its penalty is already in the "
        "objective) and for every hard guardrail when no mixture meets them all (the best mixture is then "
        "the one of smallest shortfall, and has no price)."))


class BestMixture(_Response):
    probabilities: list[Number]
    value: Finite
    shadow_prices: list[ShadowPrice] = Field(description=(
        "One per guardrail, in the objective's order (as `guardrails`; a list, not a map by metric, since "
        "two guardrails may guard one metric): what relaxing each hard guardrail would be worth. A property "
        "of the optimum, not of the deployed mixture, so it is here and not in `guardrails`. In a segmented "
        "experiment, those of this best mixture: one mixture for all the traffic on the pooled estimate."))


class Regret(_Response):
    cumulative: Number
    per_round: list[Finite]


class SampleRatioMismatch(_Response):
    statistic: Finite
    p_value: Finite
    ok: bool


class EstimateView(_Response):
    means: dict[str, list[Finite]]
    standard_errors: dict[str, list[Finite]]


class Diagnostics(_Response):
    round: int
    objective: MixtureValues
    best_mixture: BestMixture
    best_single: BestSingle | None = Field(description="Null before the first observation.")
    mixing_gain: Finite
    regret: Regret
    guardrails: list[Guardrail] = Field(description="Each guardrail under the deployed mixture (as guardrails_deployed).")
    guardrails_served: list[Guardrail] = Field(
        description="Each guardrail under the mixture being served now (p_t, exploration included).")
    guardrails_deployed: list[Guardrail] = Field(description="Each guardrail under the deployed mixture.")
    lift: Lift | None = Field(description="Lift of the mixture being served now and of the deployed mixture over "
                                          "the baseline arm (null when the objective has no baseline arm).")
    srm: SampleRatioMismatch
    late_observations: int
    units: list[int]
    estimate: EstimateView
    source_error: SourceErrorView | None = Field(
        default=None, description="Null unless the experiment's metric source is failing (its round stays open).")
    segments: dict[str, Any] | None = Field(default=None, description=(
        "Segmented experiments only: per segment (name, share, observations, probabilities, deployed, objective, "
        "guardrails), the platform-wide guardrails, the best global mixture and the gain of segmenting over it "
        "with a 95% interval (docs/segments.md)."))
    arm_summary: ArmSummary | None = Field(
        default=None, description="`?arms=N` with N < K only: the arms kept in `best_mixture`, `units`, `estimate` "
                                  "and the segments' arrays.")
    rest: ArmRest | None = Field(default=None, description="`?arms=N` with N < K only: the arms left out, summed.")


class HealthDatabase(_Response):
    reachable: bool
    error: str | None = None


class HealthScheduler(_Response):
    alive: bool
    last_heartbeat: OptionalTimestamp


class HealthSchema(_Response):
    current: str | None
    head: str


class HealthSource(_Response):
    experiment: str
    since: Timestamp
    message: str | None = Field(
        default=None, description="The failure's sentence, only for a request whose bearer token may read "
                                  "the experiment (engine text cut so that no row value is echoed).")


class Health(_Response):
    status: Literal["ok", "degraded", "unavailable"] = Field(
        description="ok; degraded (HTTP 200: the service serves, but a running experiment's metric source "
                    "is failing, see `sources`, or the scheduler's heartbeat went stale); unavailable (HTTP 503).")
    database: HealthDatabase
    scheduler: HealthScheduler
    schema_: HealthSchema = Field(alias="schema")
    sources: list[HealthSource] = Field(
        default_factory=list, description="Running experiments whose metric source is failing.")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


#: Every response model, for the OpenAPI document (``service.openapi``).
MODELS = (Error, Experiment, ExperimentList, ExperimentDeleted, Assignment, AssignmentBatch, IngestResult,
          StatisticsResult, RoundClosed, RoundList, Diagnostics, Health, ExperimentEventList)


def assignments(units: list[str], arms: list[int], probabilities: list[float], arm_names: tuple[str, ...],
                arm_params: tuple[dict[str, Any], ...], round_index: int,
                segments: list[str] | None = None) -> list[dict[str, Any]]:
    """:class:`Assignment` objects on the wire: unit ``units[i]`` got arm position ``arms[i]`` with
    propensity ``probabilities[i]`` in round ``round_index``.

    Plain dicts with the model's fields in its order (``tests/service/test_openapi.py`` checks both
    against the model and the published schema), not model instances: assignment is the hottest
    path, and building and dumping a model per unit costs about 12 ms per 1,000 units, when the whole
    request takes about 4 ms without.
    """
    if segments is not None:  # segmented experiments: each answer names the segment whose mixture served it
        return [{"unit": unit, "arm": arm_names[arm], "params": arm_params[arm], "round": round_index,
                 "probability": probability, "segment": segment}
                for unit, arm, probability, segment in zip(units, arms, probabilities, segments)]
    return [{"unit": unit, "arm": arm_names[arm], "params": arm_params[arm], "round": round_index,
             "probability": probability}
            for unit, arm, probability in zip(units, arms, probabilities)]


def respond_json(body: dict[str, Any] | list[Any], status: int = 200) -> Response:
    """A body already in wire form (:func:`assignments`) as the JSON response."""
    response = jsonify(body)
    response.status_code = status
    return response


def respond(body: BaseModel, status: int = 200) -> Response:
    """``body`` as the JSON response (through Flask's JSON provider: its key order and separators).

    Fields left unset are left out (the routes set every field but optional ones such as the health
    report's database ``error``, which only an unreachable database has)."""
    response = jsonify(body.model_dump(mode="json", by_alias=True, exclude_unset=True))
    response.status_code = status
    return response


# ------------------------------------------------------------------------------ assign, the hot path
# An assign answer differs per unit only in the unit: the members after it are fixed per arm (and
# segment) for a snapshot, so they are written once (:func:`assignment_members`) and every answer is
# the unit's JSON string and those members, put together by str.format in C: the same bytes as
# ``jsonify`` of the :func:`assignments` dicts (tests/service/test_assignment.py compares them), at a
# fraction of the cost of encoding a dict per unit.


def compact_json(app) -> bool:
    """Whether ``jsonify`` writes compact JSON with ``app``'s provider, as :func:`respond_assignments`
    does: not in debug mode (indented), ASCII-escaped, keys in insertion order."""
    if app.debug:
        return False
    provider = app.json
    return (getattr(provider, "compact", None) is not False and getattr(provider, "ensure_ascii", None) is True
            and getattr(provider, "sort_keys", None) is False)


def assignment_members(arm_name: str, params: dict[str, Any], round_index: int, probability: float,
                       segment: str | None = None) -> str:
    """The members of an :class:`Assignment` after ``unit`` as compact JSON (``"arm":...,"probability":...``,
    then ``"segment"`` for a segmented experiment), exactly as ``jsonify`` writes them."""
    members = {"arm": arm_name, "params": params, "round": round_index, "probability": probability}
    if segment is not None:
        members["segment"] = segment
    return json.dumps(members, ensure_ascii=True, separators=(",", ":"))[1:-1]


def respond_assignments(app, units: Sequence[str], members: Sequence[str], batch: bool) -> Response:
    """``app``'s assign response: one :class:`Assignment` (``batch`` false, one unit) or an
    :class:`AssignmentBatch`, from each unit and its answer's :func:`assignment_members`."""
    return app.response_class(assignments_text(units, members, batch), mimetype=app.json.mimetype)


def assignments_text(units: Sequence[str], members: Sequence[str], batch: bool) -> str:
    """The body of :func:`respond_assignments`."""
    units_json = map(encode_basestring_ascii, units)
    if batch:
        return '{"assignments":[' + ",".join(map(_ANSWER.format, units_json, members)) + "]}\n"
    return _ANSWER.format(next(units_json), members[0]) + "\n"


_ANSWER = '{{"unit":{},{}}}'
