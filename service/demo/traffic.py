"""The demo's synthetic traffic, sent through :mod:`pasto_client` exactly as a recommender would.

A :class:`~pasto_client.LocalAssigner` picks each session's blend locally and an
:class:`~pasto_client.ObservationBuffer` reports the session's metrics over the HTTP API.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass

import numpy as np

from pasto.optimum import best_single
from pasto.scenario import Scenario
from pasto_client import Client, LocalAssigner, ObservationBuffer

from . import console
from .groundtruth import arm_names, experiment_objective, simulate_session, true_means

log = logging.getLogger("pasto.demo")

TICK_SECONDS = 0.05  # sessions are sent in small batches this often
#: How long an interrupted demo keeps sending the observations it has queued before it stops.
STOP_FLUSH_SECONDS = 10.0


@dataclass
class TrafficStats:
    sessions: int = 0


def run_traffic(client: Client, name: str, scenario: Scenario, args: argparse.Namespace,
                stats: TrafficStats) -> None:
    """Send synthetic sessions until ``args.rounds`` rounds have closed or the demo is interrupted
    (the buffer is flushed either way); ``stats`` counts the sessions reported."""
    rng = np.random.default_rng(args.seed)
    names = arm_names(scenario)
    arm_index = {arm_name: k for k, arm_name in enumerate(names)}
    means = true_means(scenario)
    objective = experiment_objective(scenario)
    _, single_value = best_single(objective, means)
    overwrite = console.rounds_overwrite_one_line(args.headless)
    per_tick = args.sessions_per_second * TICK_SECONDS
    carry = 0.0
    with LocalAssigner(client, name, ttl=30.0, round_poll=0.1) as assigner, \
            ObservationBuffer(client, name, max_batch=2000, flush_interval=0.5, max_queue=200_000) as buffer:
        first_round = assigner.round_index
        shown_round = first_round
        next_tick = time.monotonic()
        try:
            while True:
                # Reported before the stop test, so that the round whose close ends the demo is shown.
                current_round = assigner.round_index
                if current_round != shown_round:
                    # Every round gets its line, also those that closed while the loop was stalled (a loaded
                    # machine), up to the round that ends the demo; the current round's from the experiment.
                    last_shown = current_round if args.rounds is None else min(current_round,
                                                                               first_round + args.rounds)
                    if last_shown > shown_round + 1 or last_shown < current_round:
                        console.report_past_rounds(client, name, shown_round + 1, min(last_shown, current_round - 1),
                                                   objective, means, names, overwrite, single_value)
                    if last_shown == current_round:
                        console.report_round(client, name, current_round, objective, means, names, overwrite,
                                             single_value)
                    shown_round = current_round
                if args.rounds is not None and shown_round >= first_round + args.rounds:
                    break
                carry += per_tick
                batch, carry = int(carry), carry - int(carry)
                for _ in range(batch):
                    unit = f"user-{int(rng.integers(10**9))}"
                    assignment = assigner.assign(unit)
                    values = simulate_session(scenario, means, arm_index[assignment.arm], rng)
                    buffer.add(unit, assignment.round, values, arm=assignment.arm)
                stats.sessions += batch
                next_tick += TICK_SECONDS
                time.sleep(max(0.0, next_tick - time.monotonic()))
        except BaseException:
            # Interrupted (Ctrl-C, SIGTERM, SIGHUP): send what is queued for at most STOP_FLUSH_SECONDS.
            # On a loaded machine the queue can hold a backlog of minutes (up to 200,000 sessions), and
            # flushing all of it could make a stop outlast the minute a process manager (or the demo
            # tests) waits before killing the demo, which then leaves its server running.
            try:
                buffer.close(timeout=STOP_FLUSH_SECONDS)
            except TimeoutError as error:
                unsent = len(error.unsent)
                stats.sessions -= unsent
                log.warning("Stopped with %d observations unsent after %s s; their sessions are not counted.",
                            unsent, STOP_FLUSH_SECONDS)
            raise
        if overwrite and shown_round != first_round:
            console.end_overwritten_line()
        log.info("Flushing %d pending observations.", buffer.pending)
