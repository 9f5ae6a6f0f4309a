"""An OpenFeature provider that evaluates pasto experiments in-process (the ``openfeature`` extra).

``PastoProvider(client)`` makes every experiment an object flag: the flag key is the experiment's
name, the evaluation context's ``targetingKey`` the unit, its ``segment`` attribute the unit's segment
(segmented experiments). Each flag is evaluated by a :class:`~pasto_client.assigner.LocalAssigner`
(fetched once on the flag's first evaluation, refreshed in the background), so an evaluation does no
I/O and gives exactly the server's assignment (docs/assignment.md): the value is the arm's ``params``,
the variant its name, the reason ``SPLIT``, and the flag metadata ``propensity``, ``round``,
``mixture_version`` and ``segment``, as the server's OFREP endpoint answers.

Exposures are logged by the provider's hook (``after`` an evaluation that served an arm), into an
:class:`~pasto_client.exposure.ExposureLog` when an ``exposure_sink`` is given. ``track(name, context,
details)`` is an observation: metric ``name`` with ``details.value`` for the context's unit, queued in
an :class:`~pasto_client.buffer.ObservationBuffer` per experiment (its idempotency ids make every
resend count once; ``details.attributes["id"]``, when given, is the id, so that a caller's own retry of
the same event counts once too).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from openfeature.evaluation_context import EvaluationContext
from openfeature.exception import (
    FlagNotFoundError,
    GeneralError,
    InvalidContextError,
    TargetingKeyMissingError,
    TypeMismatchError,
)
from openfeature.flag_evaluation import FlagEvaluationDetails, FlagResolutionDetails, Reason
from openfeature.hook import Hook, HookContext, HookHints
from openfeature.provider import AbstractProvider, Metadata
from openfeature.track import TrackingEventDetails

from pasto_client.assigner import LocalAssigner
from pasto_client.buffer import ObservationBuffer
from pasto_client.client import Client
from pasto_client.errors import PastoAPIError
from pasto_client.exposure import ExposureContext, ExposureLog, ExposureSink, exposure_context

__all__ = ["PastoProvider"]

_SPLIT = Reason.SPLIT.value


class PastoProvider(AbstractProvider):
    """OpenFeature provider for pasto experiments, evaluated locally.

    Parameters
    ----------
    client : Client
        A client with a token of the ``ingest`` role (``track`` sends observations).
    experiments : sequence of str, optional
        Experiments to fetch when the provider is initialised (others are fetched on their first
        evaluation).
    ttl, round_poll : float
        Passed to each :class:`LocalAssigner`.
    exposure_sink : ExposureSink, ExposureLog or callable, optional
        Where the exposure hook writes (``ExposureLog`` sinks: JSON lines, Parquet, a callback).
    buffer_options : mapping, optional
        Keyword arguments of each :class:`ObservationBuffer` (``max_batch``, ``flush_interval``, ...).
    assigners : mapping of str to LocalAssigner, optional
        Assigners made by the caller, by experiment name (one started from a cached experiment
        document, say); the provider fetches the others.
    """

    def __init__(self, client: Client, experiments: Sequence[str] = (), ttl: float = 30.0, round_poll: float = 0.25,
                 exposure_sink: ExposureSink | ExposureLog | Callable[[list[dict]], None] | None = None,
                 buffer_options: Mapping[str, Any] | None = None,
                 assigners: Mapping[str, LocalAssigner] | None = None) -> None:
        super().__init__()
        self.client = client
        self.experiments = tuple(experiments)
        self.ttl = ttl
        self.round_poll = round_poll
        self.buffer_options = dict(buffer_options or {})
        self._assigners: dict[str, LocalAssigner] = dict(assigners or {})
        self._arm_positions: dict[str, dict[str, int]] = {
            name: {arm: position for position, arm in enumerate(assigner.arms)}
            for name, assigner in self._assigners.items()}
        self._buffers: dict[str, ObservationBuffer] = {}
        self._metric_names: dict[str, tuple[str, ...]] = {}
        self._served: dict[str, tuple[LocalAssigner, bool]] = {}  # name -> (assigner, segmented)
        self._metadata: dict[int, tuple[Any, Mapping[str, Any]]] = {}  # id(Assignment) -> (it, metadata)
        self._lock = threading.Lock()
        self._hooks: list[Hook] = []
        #: The exposure log the hook writes to, or None without an exposure sink.
        self.exposures: ExposureLog | None = None
        if exposure_sink is not None:
            self.exposures = (exposure_sink if isinstance(exposure_sink, ExposureLog)
                              else ExposureLog(exposure_sink, name="openfeature"))
            self._hooks = [_ExposureHook(self)]

    # -- lifecycle ---------------------------------------------------------------------------------

    def get_metadata(self) -> Metadata:
        return Metadata(name="pasto")

    def get_provider_hooks(self) -> list[Hook]:
        return self._hooks

    def initialize(self, evaluation_context: EvaluationContext) -> None:
        for name in self.experiments:
            self.assigner(name)

    def shutdown(self) -> None:
        """Send every tracked observation, stop the assigners, write the queued exposures."""
        with self._lock:
            buffers, self._buffers = list(self._buffers.values()), {}
            assigners, self._assigners = list(self._assigners.values()), {}
            self._served.clear()
        for buffer in buffers:
            buffer.close()
        for assigner in assigners:
            assigner.close()
        if self.exposures is not None:
            self.exposures.close()

    def assigner(self, name: str) -> LocalAssigner:
        """The :class:`LocalAssigner` of experiment ``name``, fetched on first use
        (``FlagNotFoundError`` when the server has no such experiment)."""
        assigner = self._assigners.get(name)
        if assigner is not None:
            return assigner
        with self._lock:
            assigner = self._assigners.get(name)
            if assigner is None:
                try:
                    assigner = LocalAssigner(self.client, name, ttl=self.ttl, round_poll=self.round_poll)
                except PastoAPIError as error:
                    if error.status == 404:
                        raise FlagNotFoundError(f"There is no experiment named {name!r}.") from None
                    raise GeneralError(str(error)) from None
                self._arm_positions[name] = {arm: position for position, arm in enumerate(assigner.arms)}
                self._assigners[name] = assigner
        self._metrics(name)  # what track() needs, fetched now rather than on the first event
        return assigner

    # -- evaluation --------------------------------------------------------------------------------

    def resolve_object_details(self, flag_key: str, default_value: Any,
                               evaluation_context: EvaluationContext | None = None) -> FlagResolutionDetails[Any]:
        served = self._served.get(flag_key) or self._serve(flag_key)
        unit = evaluation_context.targeting_key if evaluation_context is not None else None
        if not unit:
            raise TargetingKeyMissingError("The evaluation context has no targeting key: give the unit to assign.")
        segment = evaluation_context.attributes.get("segment")
        if segment is not None and not isinstance(segment, str):  # refused by every flag, as the server does
            raise InvalidContextError(f"The segment must be a string, got {type(segment).__name__}.")
        assigner, segmented = served
        try:
            if segmented:  # one context serves every flag: an unsegmented experiment ignores the segment
                assignment = assigner.assign(unit, segment)
            else:
                assignment = assigner.assign(unit)
        except (ValueError, TypeError) as error:
            raise InvalidContextError(str(error)) from None
        cached = self._metadata.get(id(assignment))
        if cached is None or cached[0] is not assignment:
            cached = self._remember_metadata(assigner, assignment)
        # params is a read-only mapping (a dict or a mappingproxy): .copy() is the cheapest fresh dict.
        return FlagResolutionDetails(value=assignment.params.copy(), reason=_SPLIT, variant=assignment.arm,
                                     flag_metadata=cached[1])

    def _serve(self, name: str) -> tuple[LocalAssigner, bool]:
        assigner = self.assigner(name)
        served = self._served[name] = (assigner, bool(assigner.segments))  # segments never change
        return served

    def _remember_metadata(self, assigner: LocalAssigner, assignment: Any) -> tuple[Any, Mapping[str, Any]]:
        """The (read-only) flag metadata of ``assignment``, built once per arm and served mixture: the
        assigner answers with one Assignment object per arm and round, which the cache holds, so its id
        is not reused while the entry lives."""
        metadata: dict[str, Any] = {"propensity": assignment.probability, "round": assignment.round,
                                    "mixture_version": assigner.mixture_version or ""}
        if assignment.segment is not None:
            metadata["segment"] = assignment.segment
        if len(self._metadata) > 100_000:
            self._metadata.clear()
        entry = self._metadata[id(assignment)] = (assignment, MappingProxyType(metadata))
        return entry

    def _not_an_object(self, flag_key: str, default_value: Any = None,
                       evaluation_context: EvaluationContext | None = None) -> FlagResolutionDetails[Any]:
        raise TypeMismatchError(f"Flag {flag_key!r} is an experiment: its value is an object (the arm's params); "
                                "evaluate it with get_object_value or get_object_details.")

    resolve_boolean_details = resolve_string_details = _not_an_object
    resolve_integer_details = resolve_float_details = _not_an_object

    # -- tracking ----------------------------------------------------------------------------------

    def track(self, tracking_event_name: str, evaluation_context: EvaluationContext | None = None,
              tracking_event_details: TrackingEventDetails | None = None) -> None:
        """Queue ``tracking_event_name`` = ``details.value`` as an observation of the context's unit.

        The experiment is ``details.attributes["experiment"]`` or, without it, every experiment this
        provider has evaluated whose metrics include the event's name. The round is
        ``attributes["round"]`` (the flag metadata's, best: the round the unit was exposed in) or the
        unit's assignment now; the server checks the arm against the unit's sticky assignment.
        """
        unit = evaluation_context.targeting_key if evaluation_context is not None else None
        if not unit:
            raise TargetingKeyMissingError("track() needs the unit: a context with a targeting key.")
        details = tracking_event_details or TrackingEventDetails()
        if details.value is None:
            raise GeneralError(f"track({tracking_event_name!r}) needs details with a value (the metric's value).")
        attributes = details.attributes
        segment = evaluation_context.attributes.get("segment")
        named = attributes.get("experiment")
        names = [named] if named is not None else [
            name for name, assigner in list(self._assigners.items()) if tracking_event_name in self._metrics(name)]
        event_id = attributes.get("id")
        for name in names:
            assigner = self.assigner(name)
            segment_used = segment if assigner.segments else None
            round_index = attributes.get("round")
            if round_index is None:
                round_index = assigner.assign(unit, segment_used).round
            self._buffer(name).add(unit, int(round_index), {tracking_event_name: float(details.value)},
                                   segment=segment_used, id=None if event_id is None else f"{event_id}:{name}")

    def flush(self, timeout: float | None = None) -> None:
        """Send every observation tracked so far and wait until the server has them."""
        for buffer in list(self._buffers.values()):
            buffer.flush(timeout)

    def _metrics(self, name: str) -> tuple[str, ...]:
        """The metrics of experiment ``name`` (fetched once)."""
        metrics = self._metric_names.get(name)
        if metrics is None:
            metrics = self._metric_names[name] = tuple(self.client.get_experiment(name, arms=1)["metrics"])
        return metrics

    def _buffer(self, name: str) -> ObservationBuffer:
        buffer = self._buffers.get(name)
        if buffer is None:
            with self._lock:
                buffer = self._buffers.get(name)
                if buffer is None:
                    buffer = self._buffers[name] = ObservationBuffer(self.client, name, **self.buffer_options)
        return buffer

    # -- exposures ---------------------------------------------------------------------------------

    def _exposure_context(self, flag_key: str, arm: str, metadata: Mapping[str, Any]) -> ExposureContext | None:
        positions = self._arm_positions.get(flag_key)
        if positions is None or arm not in positions:
            return None
        return exposure_context(flag_key, metadata["round"], arm, positions[arm], metadata["propensity"],
                                metadata.get("mixture_version") or None, metadata.get("segment"))


class _ExposureHook(Hook):
    """Logs one exposure per evaluation that served an arm (reason SPLIT), after the SDK has it."""

    def __init__(self, provider: PastoProvider) -> None:
        self.provider = provider
        self._contexts: dict[tuple, ExposureContext] = {}

    def after(self, hook_context: HookContext, details: FlagEvaluationDetails[Any], hints: HookHints) -> None:
        if details.reason != _SPLIT or details.variant is None:
            return
        metadata = details.flag_metadata
        key = (details.flag_key, details.variant, metadata.get("round"), metadata.get("segment"),
               metadata.get("mixture_version"), metadata.get("propensity"))
        context = self._contexts.get(key)
        if context is None:
            context = self.provider._exposure_context(details.flag_key, details.variant, metadata)
            if context is None:
                return
            if len(self._contexts) > 100_000:  # one entry per arm and served mixture: bounded all the same
                self._contexts.clear()
            self._contexts[key] = context
        self.provider.exposures.record(hook_context.evaluation_context.targeting_key, context)  # counts a drop
