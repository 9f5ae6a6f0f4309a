"""The OpenFeature Remote Evaluation Protocol (OFREP) on the wire: what ``service.routes.ofrep`` reads
and writes, and the pydantic models its part of the OpenAPI document is generated from.

An experiment is a flag: its name is the flag key, an arm's ``params`` object is the flag's value and
the arm's name its variant, with reason ``SPLIT`` (the value was drawn from the mixture). The metadata
carries what an analysis needs with the assignment: the ``propensity``, the ``round``, the
``mixture_version`` (the experiment's ``updated_at``, as exposure records have it) and, for a
segmented experiment, the ``segment`` whose mixture served it. Errors have the protocol's shapes:
``{"key", "errorCode", "errorDetails"}`` for one flag, ``{"errorCode", "errorDetails"}`` for a
refused bulk request.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from .schemas import Identifier, SegmentName

if TYPE_CHECKING:
    from .cache import Snapshot

#: The error codes the protocol defines for an evaluation (and FLAG_NOT_FOUND, its 404).
FLAG_NOT_FOUND = "FLAG_NOT_FOUND"
TARGETING_KEY_MISSING = "TARGETING_KEY_MISSING"
INVALID_CONTEXT = "INVALID_CONTEXT"
PARSE_ERROR = "PARSE_ERROR"
GENERAL = "GENERAL"
SPLIT = "SPLIT"

_UNIT = TypeAdapter(Identifier)
_SEGMENT = TypeAdapter(SegmentName)


class EvaluationProblem(Exception):
    """A request the protocol answers with an error code (and HTTP 400 or 404)."""

    def __init__(self, code: str, details: str, status: int = 400) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.status = status


class OfrepContext(BaseModel):
    """The evaluation context: ``targetingKey`` is the unit, ``segment`` its segment (segmented
    experiments); any other attribute is accepted and ignored."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    targetingKey: str = Field(description="The unit (user, request or session id) to assign, 1 to 256 characters.")
    segment: str | None = Field(default=None, description="The unit's segment, for segmented experiments.")


class OfrepEvaluationRequest(BaseModel):
    context: OfrepContext


class OfrepFlagMetadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    propensity: float = Field(description="The probability of the variant in the mixture the unit was drawn from.")
    round: Annotated[int, Field(ge=0)] = Field(description="The round of the assignment: report it with the "
                                                           "unit's observations.")
    mixture_version: str = Field(description="The experiment's updated_at when the mixture was served.")
    segment: str | None = Field(default=None, description="Segmented experiments only: the segment whose mixture "
                                                          "served the unit.")


class OfrepEvaluationSuccess(BaseModel):
    model_config = ConfigDict(extra="forbid")
    key: str
    value: dict[str, Any] = Field(description="The arm's params.")
    reason: Literal["SPLIT"]
    variant: str = Field(description="The arm's name.")
    metadata: OfrepFlagMetadata


class OfrepEvaluationFailure(BaseModel):
    model_config = ConfigDict(extra="forbid")
    key: str
    errorCode: Literal["PARSE_ERROR", "TARGETING_KEY_MISSING", "INVALID_CONTEXT", "GENERAL"]
    errorDetails: str


class OfrepFlagNotFound(BaseModel):
    model_config = ConfigDict(extra="forbid")
    key: str
    errorCode: Literal["FLAG_NOT_FOUND"]
    errorDetails: str


class OfrepBulkEvaluationSuccess(BaseModel):
    model_config = ConfigDict(extra="forbid")
    flags: list[OfrepEvaluationSuccess | OfrepEvaluationFailure]


class OfrepBulkEvaluationFailure(BaseModel):
    model_config = ConfigDict(extra="forbid")
    errorCode: Literal["PARSE_ERROR", "TARGETING_KEY_MISSING", "INVALID_CONTEXT", "GENERAL"]
    errorDetails: str


#: Request models and response models, for service.openapi.
REQUEST_MODELS = (OfrepEvaluationRequest,)
RESPONSE_MODELS = (OfrepEvaluationSuccess, OfrepEvaluationFailure, OfrepFlagNotFound, OfrepBulkEvaluationSuccess, OfrepBulkEvaluationFailure)


def read_context(body: bytes) -> tuple[str, str | None]:
    """The unit and segment of an evaluation request's body; :class:`EvaluationProblem` otherwise."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:
        raise EvaluationProblem(PARSE_ERROR, f"The body is not valid JSON: {error}.") from None
    if not isinstance(data, dict) or not isinstance(data.get("context"), dict):
        raise EvaluationProblem(INVALID_CONTEXT, "The body must be an object with a context object: "
                                                 '{"context": {"targetingKey": "<unit>"}}.')
    context = data["context"]
    unit = context.get("targetingKey")
    if unit is None or unit == "":
        raise EvaluationProblem(TARGETING_KEY_MISSING, "The context has no targetingKey: give the unit to assign.")
    try:
        unit = _UNIT.validate_python(unit, strict=True)
    except ValidationError as error:
        raise EvaluationProblem(INVALID_CONTEXT, f"context.targetingKey: {_first_message(error)}") from None
    segment = context.get("segment")
    if segment is not None:
        try:
            segment = _SEGMENT.validate_python(segment, strict=True)
        except ValidationError as error:
            raise EvaluationProblem(INVALID_CONTEXT, f"context.segment: {_first_message(error)}") from None
    return unit, segment


def _first_message(error: ValidationError) -> str:
    message = error.errors(include_url=False)[0]["msg"].removeprefix("Value error, ")
    return message[:1].upper() + message[1:] + ("" if message.endswith(".") else ".")


def success(snapshot: Snapshot, arm: int, probability: float, segment: str | None) -> dict[str, Any]:
    """An :class:`OfrepEvaluationSuccess` on the wire (a plain dict: this is the assignment hot path)."""
    metadata: dict[str, Any] = {"propensity": probability, "round": snapshot.round_index,
                                "mixture_version": mixture_version(snapshot)}
    if segment is not None:
        metadata["segment"] = segment
    return {"key": snapshot.name, "value": snapshot.arm_params[arm], "reason": SPLIT,
            "variant": snapshot.arm_names[arm], "metadata": metadata}


def failure(key: str, code: str, details: str) -> dict[str, str]:
    return {"key": key, "errorCode": code, "errorDetails": details}


def mixture_version(snapshot: Snapshot) -> str:
    """The experiment's ``updated_at`` as ``GET .../experiments/{name}`` and exposure records show it."""
    return snapshot.updated_at.isoformat().replace("+00:00", "Z")


def etag(body: bytes) -> str:
    """A strong ETag of a bulk answer: the same flags, variants, rounds and mixtures give the same tag."""
    return '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
