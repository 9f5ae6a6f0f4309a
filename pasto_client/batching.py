"""A bounded queue drained in batches by a background thread: what the observation buffer and the
exposure log share.

:class:`BatchQueue` owns the queue, the thread and the flush/close protocol; its owner decides what
sending a batch means (an HTTP call with retries, a write to a file) and what to do when the queue is
full or closed. The producer side holds the queue's lock only to append; the batch is taken off the
queue under the lock and sent after releasing it, so a slow send never blocks a producer.
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


class BatchQueue:
    """Items queued by producers, handed to ``send`` in batches from one background thread.

    A batch is sent when ``max_batch`` items are queued, when the oldest queued item has waited
    ``flush_interval`` seconds, or on :meth:`flush` / :meth:`close`. At most ``max_queue`` items are
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
        self._condition = threading.Condition()
        self._queue: collections.deque[Any] = collections.deque()
        self._oldest_at = 0.0        # monotonic time the oldest queued item was added
        self._in_flight: list[Any] = []  # the batch being sent
        self._added = 0              # items ever queued
        self._settled = 0            # items whose send returned
        self._flush_requested = False
        self._closing = False
        self._closed = False
        #: Set by :meth:`close` when it gives up waiting: a ``send`` that retries should stop.
        self.give_up = threading.Event()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    # -- producer side -----------------------------------------------------------------------------

    def put(self, item: Any) -> bool:
        """Queue ``item``; False (nothing queued) if ``max_queue`` items are pending or the queue is
        closing (:attr:`closing` tells which)."""
        with self._condition:
            queue = self._queue
            if self._closing or len(queue) + len(self._in_flight) >= self.max_queue:
                return False
            queue.append(item)
            self._added += 1
            if len(queue) == 1:
                self._oldest_at = _monotonic()
                self._condition.notify_all()
            elif len(queue) == self.max_batch:
                self._condition.notify_all()
        return True

    def put_many(self, items: Sequence[Any]) -> int:
        """Queue as many of ``items`` as fit, in order, and return how many were queued (0 when the
        queue is closing)."""
        with self._condition:
            queue = self._queue
            room = 0 if self._closing else self.max_queue - len(queue) - len(self._in_flight)
            if room <= 0 or not items:
                return 0
            taken = items if len(items) <= room else items[:room]
            before = len(queue)
            queue.extend(taken)
            self._added += len(taken)
            if before == 0:
                self._oldest_at = _monotonic()
            if before == 0 or before < self.max_batch <= len(queue):
                self._condition.notify_all()
        return len(taken)

    @property
    def pending(self) -> int:
        """Items queued or being sent."""
        with self._condition:
            return len(self._queue) + len(self._in_flight)

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
            target = self._added
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
            self._condition.notify_all()
        self._thread.join(timeout)
        with self._condition:
            self._closed = True
            if not self._thread.is_alive():
                return []
            self.give_up.set()
            unsent = self._in_flight + list(self._queue)
            self._queue.clear()
            return unsent

    # -- the sending thread ------------------------------------------------------------------------

    def _run(self) -> None:
        condition = self._condition
        while True:
            with condition:
                while True:
                    if not self._queue:
                        if self._closing:
                            return
                        self._flush_requested = False
                        condition.wait()
                        continue
                    if len(self._queue) >= self.max_batch or self._flush_requested or self._closing:
                        break
                    remaining = self._oldest_at + self.flush_interval - _monotonic()
                    if remaining <= 0:
                        break
                    condition.wait(remaining)
                size = min(self.max_batch, len(self._queue))
                batch = [self._queue.popleft() for _ in range(size)]
                self._in_flight = batch
            try:
                self._send(batch)
            except Exception:  # a bug in send must not kill the thread and strand the queue
                logger.exception("Sending a batch of %d items failed unexpectedly.", len(batch))
            with condition:
                self._in_flight = []
                self._settled += len(batch)
                condition.notify_all()
