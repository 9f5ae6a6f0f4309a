"""A bounded queue drained in batches by a background thread: what the observation buffer and the
exposure log share.

:class:`BatchQueue` owns the queue, the thread and the flush/close protocol; its owner decides what
sending a batch means (an HTTP call with retries, a write to a file) and what to do when the queue is
full or closed. Producers take no lock: :meth:`put` is a length check and a ``deque.append``
(atomic in CPython), so the exposure log can sit on the assignment path; the sending thread takes
batches off the queue under its own lock and sends them after releasing it, so a slow send never
blocks a producer.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)
_monotonic = time.monotonic
_NEVER = float("inf")


class BatchQueue:
    """Items queued by producers, handed to ``send`` in batches from one background thread.

    A batch is sent when ``max_batch`` items are queued, every ``flush_interval`` seconds (so an item
    waits at most about that long), and on :meth:`flush` / :meth:`close`. At most ``max_queue`` items are
    pending (queued or in the batch being sent): :meth:`put` refuses more and the owner applies its
    policy (raise, call back, drop and count).

    Parameters
    ----------
    send : callable(list)
        Sends one batch. It runs on the background thread, outside the queue's lock; an exception it
        raises is logged and the batch counts as settled (the owner's ``send`` reports its own
        failures).
    thread_name : str
    max_batch : int
        Items per batch, at least 1.
    flush_interval : float
        Maximum seconds an item waits before its batch is sent.
    max_queue : int
        Maximum pending items, at least ``max_batch``.
    """

    def __init__(
        self,
        send: Callable[[list[Any]], None],
        thread_name: str,
        max_batch: int,
        flush_interval: float,
        max_queue: int,
    ) -> None:
        if not (isinstance(max_batch, int) and max_batch >= 1):
            raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}.")
        if not (isinstance(max_queue, int) and max_queue >= max_batch):
            raise ValueError(
                f"max_queue must be an integer at least max_batch ({max_batch}), got {max_queue!r}."
            )
        if not (flush_interval > 0):
            raise ValueError(f"flush_interval must be positive, got {flush_interval!r}.")
        self.max_batch = max_batch
        self.flush_interval = float(flush_interval)
        self.max_queue = max_queue
        self._send = send
        # Producers only append to _queue and read the ints below; the sending thread pops from
        # _queue and updates the counters while holding _condition, so that flush() can read a
        # consistent "everything added so far" (taken + still queued).
        self._condition = threading.Condition(threading.Lock())
        self._queue: collections.deque[Any] = collections.deque()
        self._in_flight = 0          # size of the batch being sent
        # What put() compares len(queue) with, kept up to date by the sending thread and close() so
        # that the producer's check is one comparison each: max_queue - _in_flight (0 once
        # closing), and the length at which to wake the thread (max_batch; _NEVER once woken).
        self._room = max_queue
        self._wake_at = max_batch
        self._taken = 0              # items ever taken off the queue
        self._settled = 0            # items whose send returned
        self._flush_requested = False
        self._closing = False
        self._closed = False
        self._unsent: list[Any] = []  # the batch being sent, kept for close() to report on timeout
        #: Set by :meth:`close` when it gives up waiting: a ``send`` that retries should stop.
        self.give_up = threading.Event()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    # -- producer side -----------------------------------------------------------------------------

    def put(self, item: Any) -> bool:
        """Queue ``item``; False (nothing queued) if ``max_queue`` items are pending or the queue is
        closing (:attr:`closing` tells which). Takes no lock: with several producer threads the bound
        may be overshot by one item per thread."""
        queue = self._queue
        if len(queue) >= self._room:
            return False
        queue.append(item)
        if len(queue) >= self._wake_at:
            self._wake_for_batch()
        return True

    def put_many(self, items: Sequence[Any]) -> int:
        """Queue as many of ``items`` as fit, in order, and return how many were queued (0 when the
        queue is closing)."""
        queue = self._queue
        room = self._room - len(queue)
        if room <= 0 or not items:
            return 0
        taken = items if len(items) <= room else items[:room]
        queue.extend(taken)
        if len(queue) >= self._wake_at:
            self._wake_for_batch()
        return len(taken)

    def _wake_for_batch(self) -> None:
        self._wake_at = _NEVER  # once per batch: the other producers skip the lock
        with self._condition:
            self._condition.notify_all()

    @property
    def pending(self) -> int:
        """Items queued or being sent."""
        return len(self._queue) + self._in_flight

    @property
    def closing(self) -> bool:
        """True once :meth:`close` has been called: :meth:`put` refuses everything."""
        return self._closing

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has returned."""
        return self._closed

    def flush(self, timeout: float | None = None) -> int:
        """Send everything queued so far and wait until it is settled; return how many of those
        items are still unsettled when ``timeout`` seconds have passed (0: all settled)."""
        with self._condition:
            target = self._taken + len(self._queue)
            self._flush_requested = True
            self._condition.notify_all()
            self._condition.wait_for(lambda: self._settled >= target, timeout=timeout)
            return max(0, target - self._settled)

    def close(self, timeout: float | None = None) -> list[Any]:
        """Send everything, then stop the thread; return the items that could not be sent within
        ``timeout`` seconds (then :attr:`give_up` is set and sending stops). Idempotent: a second
        call returns an empty list."""
        with self._condition:
            if self._closed:
                return []
            self._closing = True
            self._room = 0
            self._condition.notify_all()
        self._thread.join(timeout)
        with self._condition:
            self._closed = True
            if self._thread.is_alive():
                self.give_up.set()
                unsent = self._unsent + list(self._queue)
            else:
                # Only an item appended by a producer that checked _closing just before close() set
                # it can be left here; it is reported, not lost silently.
                unsent = list(self._queue)
            self._queue.clear()
            return unsent

    # -- the sending thread ------------------------------------------------------------------------

    def _run(self) -> None:
        condition = self._condition
        queue = self._queue
        # Producers do not signal the first item of a batch (that would cost them the lock on every
        # call): the thread wakes every flush_interval and sends what has been queued, so an item
        # waits at most about flush_interval; a full batch, flush() and close() wake it at once.
        next_send = _monotonic() + self.flush_interval
        while True:
            with condition:
                while True:
                    if len(queue) >= self.max_batch:
                        break
                    if self._flush_requested or self._closing:
                        if queue:
                            break
                        self._flush_requested = False
                        if self._closing:
                            return
                    remaining = next_send - _monotonic()
                    if remaining <= 0:
                        next_send = _monotonic() + self.flush_interval
                        if queue:
                            break
                        continue
                    condition.wait(remaining)
                size = min(self.max_batch, len(queue))
                # _in_flight first: a producer then over-counts the pending items for a moment,
                # never under-counts them.
                self._in_flight = size
                self._room = 0 if self._closing else self.max_queue - size
                batch = [queue.popleft() for _ in range(size)]
                self._taken += size
                self._unsent = batch
                self._wake_at = self.max_batch
            try:
                self._send(batch)
            except Exception:  # a bug in send must not kill the thread and strand the queue
                logger.exception("Sending a batch of %d items failed unexpectedly.", len(batch))
            with condition:
                self._in_flight = 0
                if not self._closing:
                    self._room = self.max_queue
                self._unsent = []
                self._settled += size
                condition.notify_all()
