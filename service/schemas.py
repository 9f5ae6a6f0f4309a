"""Request bodies, validated with pydantic in strict mode (no silent coercion of ``"1"`` to 1).

The same models generate the request schemas of the OpenAPI document (``service.openapi``), so the
validation and the published contract cannot drift apart.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection
from typing import Annotated, Any, Literal

from flask import request
from pydantic import (AfterValidator, BaseModel, ConfigDict, Discriminator, Field, FiniteFloat, Tag,
                      ValidationError, model_validator)
from werkzeug.exceptions import RequestEntityTooLarge

from .errors import ApiError, body_order, format_location, invalid, problems_error, validation_problems

MAX_BATCH = 10_000
MAX_ARMS = 100_000
MAX_SEED = 2**63 - 1
#: Largest magnitude of a metric value, threshold, weight or penalty: sums of squares of many values
#: must stay finite in float64.
MAX_MAGNITUDE = 1e100
#: Longest round or settle time (about 31 years): datetimes must stay representable.
MAX_SECONDS = 1e9


def _storable(text: str) -> str:
    # PostgreSQL text cannot hold NUL, and lone surrogates (legal in JSON escapes) are not UTF-8.
    if "\x00" in text:
        raise ValueError("must not contain the NUL character")
    if text.isascii():  # the common case, checked without encoding (ids and units of every observation)
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError("must be valid Unicode (no unpaired surrogates)") from error
    return text


def _json_value(value: Any, depth: int = 0) -> Any:
    if depth > 32:
        raise ValueError("must not nest deeper than 32 levels")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must contain only finite numbers (no NaN or Infinity)")
    if isinstance(value, str):
        _storable(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            _storable(key)
            _json_value(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _json_value(item, depth + 1)
    return value


Identifier = Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_storable)]
ShortName = Annotated[str, Field(min_length=1, max_length=128), AfterValidator(_storable)]
MetricName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$")]
#: Longest experiment name (also the longest name a request path may hold: ``service.params``).
MAX_EXPERIMENT_NAME = 64
ExperimentName = Annotated[str, Field(pattern=rf"^[a-z0-9_-]{{1,{MAX_EXPERIMENT_NAME}}}$")]
Number = Annotated[FiniteFloat, Field(ge=-MAX_MAGNITUDE, le=MAX_MAGNITUDE)]
Seconds = Annotated[FiniteFloat, Field(le=MAX_SECONDS)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class ArmSpec(_Strict):
    name: ShortName
    params: Annotated[dict[str, Any], AfterValidator(_json_value)] = Field(default_factory=dict)


def _primary_kind(value: Any) -> str | None:
    return "metric" if isinstance(value, str) else "weights" if isinstance(value, dict) else None


#: One metric, or weights per metric. Tagged by the JSON type, so an error names the member the client
#: meant (``objective.primary.weights.x: Input should be a finite number``), not every member.
Primary = Annotated[
    Annotated[MetricName, Tag("metric")] | Annotated[dict[MetricName, Number], Tag("weights")],
    Discriminator(_primary_kind, custom_error_type="invalid_primary",
                  custom_error_message="Must be a metric name or an object of weights per metric"),
]


class GuardrailSpec(_Strict):
    metric: MetricName
    threshold: Number
    #: Soft guardrails give a penalty; hard ones (``hard: true``) give none (checked by pasto.objectives).
    penalty: Annotated[Number, Field(ge=0)] | None = None
    relative_to: ShortName | None = None
    hard: bool = False
    #: Segmented experiments: held in every segment ("segment") or on the traffic-weighted platform
    #: value ("global", the default there). Refused for an unsegmented experiment.
    scope: Literal["segment", "global"] | None = None


class ObjectiveSpec(_Strict):
    primary: Primary
    guardrails: list[GuardrailSpec] = Field(default_factory=list, max_length=64)
    #: The known-safe arm (production setting) that safe serving pads traffic with.
    baseline: ShortName | None = None


MAX_SEGMENTS = 1_000
#: The segment of an open set that serves every value without a mixture of its own (and units without a value).
OTHER_SEGMENT = "(other)"
SegmentName = ShortName


class SegmentsSpec(_Strict):
    """A closed list of segments; ``shares`` are the expected traffic shares (measured shares replace
    them once there are observations), ``shrink`` and ``confidence_z`` tune the segmented controller
    (``pasto.segments.SegmentedConfig``)."""

    names: Annotated[list[SegmentName], Field(min_length=1, max_length=MAX_SEGMENTS)] | None = None
    #: Open set: the attribute whose values are the segments; a value gets its own mixture once
    #: ``min_units`` distinct units were observed with it (at most ``max_segments`` values), and is
    #: served the shared mixture of the long tail (segment "(other)") until then.
    by: ShortName | None = None
    min_units: Annotated[int, Field(ge=1, le=10**9)] = 100
    max_segments: Annotated[int, Field(ge=1, le=MAX_SEGMENTS - 1)] = 100
    shares: Annotated[list[Annotated[FiniteFloat, Field(ge=0)]], Field(min_length=1, max_length=MAX_SEGMENTS)] | None = None
    shrink: bool = True
    confidence_z: Annotated[FiniteFloat, Field(ge=0, le=10)] = 2.0

    @model_validator(mode="after")
    def _consistent(self) -> SegmentsSpec:
        if (self.names is None) == (self.by is None):
            raise invalid("segments", "Give either names (a closed list of segments) or by (an open set of an "
                                      "attribute's values), not both or neither.")
        if self.by is not None:
            if self.shares is not None:
                raise invalid("segments.shares", "An open set has no expected shares: the measured ones are used.")
            return self
        if OTHER_SEGMENT in self.names:
            raise invalid("segments.names", f"{OTHER_SEGMENT!r} is reserved (the long tail of an open set).")
        _require_unique(self.names, "segments.names", "segment name")
        if self.shares is not None:
            if len(self.shares) != len(self.names):
                raise invalid("segments.shares", f"Give one share per segment: {len(self.names)} segments, "
                                                 f"{len(self.shares)} shares.")
            if not math.isclose(sum(self.shares), 1.0, abs_tol=1e-6):
                raise invalid("segments.shares", f"The shares must sum to 1; they sum to {sum(self.shares):g}.")
        return self


def _segments_kind(value: Any) -> str | None:
    return "names" if isinstance(value, list) else "spec" if isinstance(value, (dict, SegmentsSpec)) else None


#: A list of segment names or a :class:`SegmentsSpec`, tagged by the JSON type so that an error names the
#: member the client meant (``segments.min_units: ...``), not both.
Segments = Annotated[
    Annotated[list[SegmentName], Tag("names")] | Annotated[SegmentsSpec, Tag("spec")],
    Discriminator(_segments_kind, custom_error_type="invalid_segments",
                  custom_error_message="Must be a list of segment names or an object (names or by, ...)"),
]


class AlgorithmSpec(BaseModel):
    """``preset`` plus any ``AlgorithmConfig`` field overrides (checked by ``pasto.algorithm``)."""

    model_config = ConfigDict(strict=True, extra="allow")
    preset: Literal["paper", "default"] = "default"


class ExperimentCreate(_Strict):
    name: ExperimentName
    arms: Annotated[list[ArmSpec], Field(min_length=2, max_length=MAX_ARMS)]
    metrics: Annotated[list[MetricName], Field(min_length=1, max_length=64)]
    objective: ObjectiveSpec
    round_seconds: Annotated[Seconds, Field(ge=1)]
    settle_seconds: Annotated[Seconds, Field(ge=0)] = 0.0
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    #: A metric source (``service.sources.spec``): checked by ``parse_source`` at creation.
    source: Annotated[dict[str, Any], AfterValidator(_json_value)] | None = Field(
        default=None, description="Warehouse-native metric source (docs/scaling.md): the scheduler queries it at "
                                  "each round's update. Secrets by environment-variable name only.")
    #: Per-segment mixtures (docs/segments.md): a list of segment names or a :class:`SegmentsSpec`.
    segments: Segments | None = None

    @model_validator(mode="after")
    def _unique_names(self) -> ExperimentCreate:
        _require_unique([arm.name for arm in self.arms], "arms", "arm name", suffix=".name")
        _require_unique(self.metrics, "metrics", "metric")
        if isinstance(self.segments, list):
            if not 1 <= len(self.segments) <= MAX_SEGMENTS:
                raise invalid("segments", f"Give between 1 and {MAX_SEGMENTS} segment names, not {len(self.segments)}.")
            _require_unique(self.segments, "segments", "segment name")
            if OTHER_SEGMENT in self.segments:
                raise invalid("segments", f"{OTHER_SEGMENT!r} is reserved (the long tail of an open set).")
        return self


class AssignOne(_Strict):
    unit: Identifier
    #: The unit's segment (segmented experiments only).
    segment: SegmentName | None = None


class AssignMany(_Strict):
    units: Annotated[list[Identifier], Field(min_length=1, max_length=MAX_BATCH)]
    #: One segment for every unit of the batch, or ``segments``: one per unit (segmented experiments only).
    segment: SegmentName | None = None
    segments: Annotated[list[SegmentName], Field(min_length=1, max_length=MAX_BATCH)] | None = None

    @model_validator(mode="after")
    def _segments_match_units(self) -> AssignMany:
        if self.segment is not None and self.segments is not None:
            raise invalid("segments", "Send either segment (one for every unit) or segments (one per unit), not both.")
        if self.segments is not None and len(self.segments) != len(self.units):
            raise invalid("segments", f"Give one segment per unit: {len(self.units)} units, "
                                      f"{len(self.segments)} segments.")
        return self

    def unit_segments(self) -> list[str] | None:
        """The segment of each unit, or None when the request names none."""
        if self.segments is not None:
            return self.segments
        return None if self.segment is None else [self.segment] * len(self.units)


class Observation(_Strict):
    id: Identifier
    unit: Identifier
    round: Annotated[int, Field(ge=0, le=2**31 - 1)]
    arm: ShortName | None = None
    values: Annotated[dict[MetricName, Number], Field(min_length=1, max_length=64)]
    #: The unit's segment (required by a segmented experiment, refused by an unsegmented one).
    segment: SegmentName | None = None


class ObservationBatch(_Strict):
    observations: Annotated[list[Observation], Field(min_length=1, max_length=MAX_BATCH)]


#: Largest count of one statistics cell or units entry: counts stay exact in float64.
MAX_COUNT = 2**53
#: How far ``sum**2 / count`` may exceed ``sum_of_squares`` before a cell is refused: the rounding of
#: the engine that summed the values (a plain running sum of 10^9 float64 values errs by at most about
#: 10^9 x 1.1e-16 = 1.1e-7 relative), with room to spare; a cell whose fields were swapped or whose
#: squares were not summed is off by far more.
SUM_OF_SQUARES_TOLERANCE = 1e-6


#: An arm named in a statistics batch: it must be one of the experiment's (checked by the controller), so
#: the storable-text check of new names (``_storable``, a Python call per item that cost ~30 us each at
#: 5,000 cells) is not needed.
ArmReference = Annotated[str, Field(min_length=1, max_length=128)]


class StatisticsCell(_Strict):
    """Pre-aggregated statistics of one metric for one arm in one round."""

    round: Annotated[int, Field(ge=0, le=2**31 - 1)]
    arm: ArmReference
    metric: MetricName
    count: Annotated[int, Field(ge=1, le=MAX_COUNT)]
    sum: FiniteFloat
    sum_of_squares: Annotated[FiniteFloat, Field(ge=0)]
    #: The segment the cell's observations belong to (segmented experiments, as an observation's).
    segment: SegmentName | None = None

    @model_validator(mode="after")
    def _consistent(self) -> StatisticsCell:
        mean = self.sum / self.count
        if abs(mean) > MAX_MAGNITUDE or self.sum_of_squares / self.count > MAX_MAGNITUDE**2:
            raise ValueError(f"the values a cell summarises must stay within +/-{MAX_MAGNITUDE:g} like observed "
                             f"values: its mean is {mean:g} and its mean square {self.sum_of_squares / self.count:g}")
        if mean * self.sum > self.sum_of_squares * (1 + SUM_OF_SQUARES_TOLERANCE):
            raise ValueError(f"the sum of squares {self.sum_of_squares!r} is smaller than sum**2 / count = "
                             f"{mean * self.sum!r}, which no real values have (tolerance "
                             f"{SUM_OF_SQUARES_TOLERANCE:g} relative)")
        return self


class StatisticsUnits(_Strict):
    """Distinct units with data for one arm in one round (for the sample-ratio-mismatch check)."""

    round: Annotated[int, Field(ge=0, le=2**31 - 1)]
    arm: ArmReference
    units: Annotated[int, Field(ge=0, le=MAX_COUNT)]


class StatisticsBatch(_Strict):
    batch_id: Identifier
    cells: Annotated[list[StatisticsCell], Field(min_length=1, max_length=MAX_BATCH)]
    units: Annotated[list[StatisticsUnits], Field(max_length=MAX_BATCH)] = Field(default_factory=list)


def _require_unique(names: list[str], field: str, what: str, suffix: str = "") -> None:
    seen: dict[str, int] = {}
    for index, name in enumerate(names):
        if name in seen:
            raise invalid(f"{field}[{index}]{suffix}",
                          f"Duplicate {what} {name!r} (first at {field}[{seen[name]}]).")
        seen[name] = index


def json_body() -> Any:
    """The request's JSON body; 415 when it is not JSON, 413 when too large, 400 when it does not parse."""
    return decode_json(json_bytes())


def json_bytes() -> bytes:
    """The request's body, unparsed; 415 when it is not declared JSON, 413 when it is too large."""
    current = request._get_current_object()  # one context lookup instead of one per attribute
    if not current.is_json:
        raise ApiError(415, "unsupported_media_type", "The request body must be JSON (Content-Type: application/json).")
    data = current.get_data(cache=True)
    if current.content_length is None and (limit := current.max_content_length) is not None and len(data) >= limit:
        # A streamed (chunked) body is cut at the limit without an error (werkzeug, gunicorn): say it
        # is too large rather than "not valid JSON" about the truncated text.
        raise RequestEntityTooLarge()
    return data


def decode_json(data: bytes) -> Any:
    """``data`` parsed as JSON; 400 when it does not parse, or when an object repeats a key (JSON
    parsers, Python's and pydantic's, silently keep the last value: ``{"unit": "x", "unit": "y"}``
    would assign ``y``)."""
    try:
        # json.loads(data, object_pairs_hook=_unique_keys), with the decoder made once.
        text = data if isinstance(data, str) else data.decode(json.detect_encoding(data), "surrogatepass")
        if isinstance(data, str) and text.startswith("\ufeff"):
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        return _DECODER.decode(text)
    except _RepeatedKey:
        raise repeated_key_error(data) from None
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise ApiError(400, "invalid_json", f"The request body is not valid JSON: {error}.") from None
    except RecursionError:
        raise ApiError(400, "invalid_json", "The request body nests JSON too deeply.") from None


class _RepeatedKey(Exception):
    """An object of the body has a key twice (raised by :func:`_unique_keys`; not a ValueError, which
    :func:`decode_json` reads as text that does not parse)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` of :func:`decode_json`: the object as a dict, or :class:`_RepeatedKey`.
    Called once per object of every body: one ``dict`` and a length comparison, both in C."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _RepeatedKey
    return obj


_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys)


class _Repeated(dict):
    """A decoded object that had ``key`` twice (:func:`repeated_key_error`'s second reading)."""

    key: str


def _mark_repeated(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    marked = _Repeated(obj)
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            marked.key = key
            return marked
        seen.add(key)
    raise AssertionError("_mark_repeated: fewer keys in the dict but none seen twice")


def repeated_key_error(data: bytes) -> ApiError:
    """The 400 ``duplicate_key`` of a body (which parses) with an object that repeats a key, naming the
    key and where it is: the first such object in body order, its first key seen twice. Only on this
    error path is the body read a second time, to find the place."""
    stack: list[tuple[tuple[Any, ...], Any]] = [((), json.loads(data, object_pairs_hook=_mark_repeated))]
    while stack:  # depth first, children in body order: the first object opened is found first
        location, node = stack.pop()
        if isinstance(node, _Repeated):
            where = format_location((*location, node.key))
            message = f"Duplicate key {node.key!r}: a key may appear only once in an object."
            return ApiError(400, "duplicate_key", f"{where}: {message}", [{"location": where, "message": message}])
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        stack.extend(reversed([((*location, part), child) for part, child in children]))
    raise AssertionError("repeated_key_error: no object of the body repeats a key")


#: Checks of a decoded body that need more than its model (the experiment's metrics, arms, round):
#: the problems found, as (location path, full-sentence message).
BodyCheck = Callable[[Any], list[tuple[tuple[Any, ...], str]]]


def parse(model: type[BaseModel], data: Any, also_check: BodyCheck | None = None) -> Any:
    """Validate ``data`` against ``model``; a 422 naming each offending item otherwise.

    When the model refuses ``data``, ``also_check(data)`` adds its problems to the same answer (type
    errors and unknown names together, in body order), so a client fixes everything in one go.
    """
    if not isinstance(data, dict):
        raise ApiError(422, "invalid_request", "The request body must be a JSON object.",
                       [{"location": "body", "message": "Must be a JSON object."}])
    try:
        return model.model_validate(data)
    except ValidationError as error:
        problems = validation_problems(error)
        if also_check is not None:
            # One problem per offending item: an item the schema already refuses (a metric name that
            # breaks the name pattern, say) is not also reported as unknown.
            refused = [tuple(location) for location, _ in problems]
            problems += [(location, message) for location, message in also_check(data)
                         if not any(other[:len(location)] == tuple(location) for other in refused)]
        problems.sort(key=lambda problem: body_order(data, problem[0]))  # stable: same place, same order
        raise problems_error([{"location": format_location(location), "message": message}
                              for location, message in problems]) from None


def parse_json(model: type[BaseModel], data: bytes, also_check: BodyCheck | None = None) -> Any:
    """``data`` (JSON text) validated against ``model`` (the ingestion routes: observations,
    statistics): the same result and the same errors as ``parse(model, decode_json(data))`` for a
    body whose objects do not repeat a key.

    A valid body is validated straight from the bytes by pydantic's own JSON parser, which skips
    building the Python objects of the whole document first (a 1,000-observation batch: 1.8 ms
    against 4.1 ms through :func:`decode_json`, about 9% of a whole ingestion request). That parser
    keeps the last value of a repeated key, so these two routes do too (docs/api.md): the ingestion
    hot path does not pay x2.2 for a check of what a client library never sends. Anything it refuses
    goes the two-step way, which words every error as the other routes do (400 for text that is not
    JSON or repeats a key, 422 naming each offending item).
    """
    try:
        return model.model_validate_json(data)
    except ValidationError:
        return parse(model, decode_json(data), also_check)


def unknown_metric_message(metric: str, metrics: Collection[str]) -> str:
    return f"Unknown metric {metric!r}; the metrics are {list(metrics)}."


def unknown_arm_message(arm: str) -> str:
    return f"Unknown arm {arm!r}."


def round_not_started_message(round_index: int, current_round: int) -> str:
    return f"Round {round_index} has not started; the current round is {current_round}."


def statistics_name_problems(data: Any, metrics: Collection[str], arms: Collection[str],
                             current_round: int) -> list[tuple[tuple[Any, ...], str]]:
    """Unknown metrics and arms and rounds not started yet in a decoded statistics body, wherever their
    item is well-formed enough to tell (the same words as :func:`observation_name_problems`)."""
    problems: list[tuple[tuple[Any, ...], str]] = []
    for field in ("cells", "units"):
        items = data.get(field) if isinstance(data, dict) else None
        for position, item in enumerate(items if isinstance(items, list) else []):
            if not isinstance(item, dict):
                continue
            round_index = item.get("round")
            if type(round_index) is int and round_index > current_round:
                problems.append(((field, position, "round"), round_not_started_message(round_index, current_round)))
            arm = item.get("arm")
            if isinstance(arm, str) and arm not in arms:
                problems.append(((field, position, "arm"), unknown_arm_message(arm)))
            metric = item.get("metric")
            if field == "cells" and isinstance(metric, str) and metric not in metrics:
                problems.append(((field, position, "metric"), unknown_metric_message(metric, metrics)))
    return problems


def observation_name_problems(data: Any, metrics: Collection[str], arms: Collection[str],
                              current_round: int) -> list[tuple[tuple[Any, ...], str]]:
    """Unknown metrics and arms and rounds not started yet in a decoded observations body, wherever
    their item is well-formed enough to tell, for the 422 of a body that also has type errors (a
    well-typed batch gets the same checks, same words, from ``observations.resolve_arms``)."""
    items = data.get("observations") if isinstance(data, dict) else None
    problems: list[tuple[tuple[Any, ...], str]] = []
    for position, item in enumerate(items if isinstance(items, list) else []):
        if not isinstance(item, dict):
            continue
        round_index = item.get("round")
        if type(round_index) is int and round_index > current_round:
            problems.append((("observations", position, "round"), round_not_started_message(round_index, current_round)))
        values = item.get("values")
        for metric in values if isinstance(values, dict) else ():
            if metric not in metrics:
                problems.append((("observations", position, "values", metric), unknown_metric_message(metric, metrics)))
        arm = item.get("arm")
        if isinstance(arm, str) and arm not in arms:
            problems.append((("observations", position, "arm"), unknown_arm_message(arm)))
    return problems
