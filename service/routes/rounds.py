"""``.../rounds``: close the current round now (admin), and the round history."""

from __future__ import annotations

from flask import Blueprint, current_app, request

from ..auth import require_role
from ..bootstrap import get_uow
from ..controller import reports, rounds
from ..controller.reports import segments_kept, select_arms
from ..errors import invalid
from ..params import query_integer  # digits and bounds checked before int()
from ..responses import (ArmRest, BestSingle, Guardrail, Lift, RoundClosed, RoundList, RoundSegments, RoundSummary,
                         RoundView, SourceErrorView, respond)
from ..schemas import json_body
from ..sources import SourceLimits
from .experiments import arm_summary_view, iso, round_times, summary_arms

bp = Blueprint("rounds", __name__, url_prefix="/api/v1/experiments")

#: Largest round index a request may name (rounds are 32-bit integers; SQLite overflows past 2**63).
MAX_ROUND_INDEX = 2**31 - 1

#: Without ``?limit=``, a page holds about this many per-arm cells (K per round and per-arm list),
#: so a page stays a few megabytes at K = 10,000 (20 rounds) and a short history is one page.
PAGE_ARM_ROUNDS = 200_000
MAX_DEFAULT_PAGE_ROUNDS = 1000


def default_page_rounds(n_arms: int) -> int:
    """Rounds per page when the request gives no ``limit``: ``PAGE_ARM_ROUNDS / K``, 1 to 1000."""
    return max(1, min(MAX_DEFAULT_PAGE_ROUNDS, PAGE_ARM_ROUNDS // n_arms))


@bp.post("/<name>/rounds")
@require_role("admin")
def close_current_round(name: str):
    expected = None
    # Read the body whatever Content-Length says: a chunked body has none, and ignoring it would
    # close the current round when the client asked for "only if it is round N".
    if request.get_data(cache=True).strip():
        body = json_body()
        if not isinstance(body, dict) or set(body) - {"round"}:
            raise invalid("body", "The body must be empty or {\"round\": <index of the current round>}.")
        if "round" in body:
            requested = body["round"]
            if not isinstance(requested, int) or isinstance(requested, bool) or requested < 0:
                raise invalid("round", "Must be a non-negative integer.")
            expected = requested
    advance, fresh = rounds.close_current_round(get_uow(), name, expected,
                                                limits=SourceLimits.from_config(current_app.config))
    return respond(RoundClosed(closed_round=advance.closed_round, applied=list(advance.applied),
                               round=round_times(fresh), probabilities=fresh.probabilities.tolist(),
                               deployed=fresh.deployed.tolist()))


@bp.get("/<name>/rounds")
@require_role("read")
def list_rounds(name: str):
    """Rounds oldest first, one page from ``?since=<index>`` (0): ``?limit=<n>`` rounds, by default
    :func:`default_page_rounds`; ``next_since`` is the cursor of the next page (null after the last).
    ``?arms=N``: every round's per-arm arrays keep the same N arms, those of largest max(p_t, deployed)
    now (:func:`.experiments.summary_arms`). The default page size counts K arms either way: the server
    reads every arm of each round (the summary is cut from them), so that is what bounds its memory."""
    since = query_integer("since", 0, 0, MAX_ROUND_INDEX)
    limit = query_integer("limit", None, 1, MAX_DEFAULT_PAGE_ROUNDS)  # the OpenAPI document's maximum too
    arms = summary_arms()
    if limit is None:
        limit = default_page_rounds(reports.arm_count(get_uow(), name))
    history = reports.round_history(get_uow(), name, since, limit)
    snapshot = history.snapshot
    selection = select_arms(snapshot.probabilities, snapshot.deployed, arms)

    def per_arm(values) -> list | None:
        if values is None or selection is None:
            return values.tolist() if hasattr(values, "tolist") else values
        return selection.keep(values)

    entries = []
    for round_row in history.rounds:
        position = round_row.index - since
        summary = RoundSummary.load(round_row.summary) or RoundSummary()
        best_single = summary.best_single
        rest = {} if selection is None else {"rest": ArmRest(
            arms=len(selection.rest), probabilities=selection.rest_sum(round_row.probabilities),
            deployed=None if round_row.deployed is None else selection.rest_sum(round_row.deployed),
            counts=int(history.counts[position][selection.rest].sum()),
            units=int(history.units[position][selection.rest].sum()))}
        entries.append(RoundView(
            index=round_row.index,
            started_at=iso(round_row.started_at),
            ends_at=iso(round_row.ends_at),
            closed_at=iso(round_row.closed_at),
            applied_at=iso(round_row.applied_at),
            probabilities=per_arm(round_row.probabilities),
            deployed=per_arm(round_row.deployed),
            counts=per_arm(history.counts[position]),
            units=per_arm(history.units[position]),
            late_observations=int(history.late[position]),
            means={metric: per_arm(history.means[position, m]) for m, metric in enumerate(snapshot.metrics)},
            objective=summary.objective,
            objective_deployed=summary.objective_deployed,
            best_mixture=summary.best_mixture,
            best_single=None if best_single is None else BestSingle(
                arm=snapshot.arm_names[best_single.arm_index], value=best_single.value),
            regret=summary.regret,
            guardrails=summary.guardrails_json(),
            guardrails_served=_guardrails(summary.guardrails_json()),
            guardrails_deployed=_guardrails(summary.guardrails_json(deployed=True)),
            **({} if history.segment_observations is None else {"segments": RoundSegments(
                probabilities={segment: per_arm(row) for segment, row in
                               zip(snapshot.segment_names, round_row.segment_probabilities)},
                # The segments the round served (an open set's later ones had no mixture of their own yet).
                observations=dict(zip(snapshot.segment_names[:len(round_row.segment_probabilities)],
                                      history.segment_observations[position].tolist())),
                summary=segments_kept(summary.segments, selection),
            )}),
            lift=Lift.from_summary(summary.lift, snapshot.arm_names),
            **rest,
        ))
    last = since + limit - 1
    next_since = last + 1 if last < history.snapshot.round_index else None
    return respond(RoundList(rounds=entries, next_since=next_since,
                             source_error=None if history.source_error is None else
                             SourceErrorView(**history.source_error),
                             **({} if selection is None else {"arm_summary": arm_summary_view(snapshot, selection)})))


def _guardrails(stored: list[dict] | None) -> list[Guardrail] | None:
    return None if stored is None else [Guardrail(**item) for item in stored]
