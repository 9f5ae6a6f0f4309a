"""Buffered observations: batch them, send them from a background thread, never lose one silently."""

from __future__ import annotations

import atexit
import logging
import math
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from pasto_client.batching import BatchQueue
from pasto_client.client import Client, retry_delay
from pasto_client.errors import BufferOverflowError, PastoAPIError, PastoConnectionError, PastoError

logger = logging.getLogger(__name__)

#: Seconds an ObservationBuffer that was never closed may spend sending its queue at exit.
EXIT_FLUSH_SECONDS = 10.0


class ObservationBuffer:
    """Batch observations and send them from a background thread; never lose one silently.

    Each observation gets a uuid4 idempotency id when it is :meth:`add`-ed, so a batch retried after
    a timeout is counted once by the server. A batch is sent when ``max_batch`` observations are
    pending, ``flush_interval`` seconds after the previous send, or on :meth:`flush` /
    :meth:`close`. Network errors, 5xx and 429 are retried with exponential backoff (with jitter) up
    to ``max_backoff`` seconds between attempts, for as long as it takes. Other 4xx are not retried:
    a 422 batch is split in halves until the offending observations are isolated (the server
    accepts a batch all or nothing, so valid neighbours are still recorded), and every rejected
    observation goes to ``on_error(error, observations)``. Without ``on_error`` the first such error
    is raised from the next :meth:`add`, :meth:`flush` or :meth:`close`.

    The queue is bounded: adding to a buffer that holds ``max_queue`` pending observations (queued
    or in flight) calls ``on_overflow(observation)`` if given, else raises
    :class:`BufferOverflowError`.

    Parameters
    ----------
    client : Client
    experiment_name : str
    max_batch : int
        Observations per request (the server accepts up to 10,000).
    flush_interval : float
        Maximum seconds an observation waits before being sent.
    max_queue : int
        Maximum pending observations.
    on_error : callable(PastoAPIError, list[dict]), optional
    on_overflow : callable(dict), optional
    initial_backoff, max_backoff : float
        Seconds before the first retry, and the cap of the doubling delay. A retryable answer with
        ``Retry-After`` (503 ``database_unavailable``, 429) is retried no sooner than it asks, even
        when that is longer than ``max_backoff`` (up to
        :data:`pasto_client.client.MAX_RETRY_AFTER_SECONDS`, 300 s).
    """

    def __init__(
        self,
        client: Client,
        experiment_name: str,
        max_batch: int = 1000,
        flush_interval: float = 1.0,
        max_queue: int = 100_000,
        on_error: Callable[[PastoAPIError, list[dict]], None] | None = None,
        on_overflow: Callable[[dict], None] | None = None,
        initial_backoff: float = 0.1,
        max_backoff: float = 10.0,
    ) -> None:
        if not (isinstance(max_batch, int) and 1 <= max_batch <= 10_000):
            raise ValueError(f"max_batch must be an integer from 1 to 10000, got {max_batch!r}.")
        if not (0 < initial_backoff <= max_backoff):
            raise ValueError("The backoffs must satisfy 0 < initial_backoff <= max_backoff.")
        self.client = client
        self.experiment_name = experiment_name
        self.on_error = on_error
        self.on_overflow = on_overflow
        self.initial_backoff = float(initial_backoff)
        self.max_backoff = float(max_backoff)
        self._pending_error: PastoAPIError | None = None
        self._error_lock = threading.Lock()  # guards _pending_error
        # Written by the sender thread only.
        self.accepted = 0
        self.duplicates = 0
        self.rejected = 0
        self.retries = 0
        # Validates max_queue and flush_interval, and starts the sender thread.
        self._batches = BatchQueue(
            self._send, f"pasto-observations-{experiment_name}", max_batch, flush_interval, max_queue
        )
        self.max_batch = max_batch
        self.flush_interval = self._batches.flush_interval
        self.max_queue = max_queue
        # A daemon thread dies with the interpreter: send what is queued if close() was forgotten.
        atexit.register(self._close_at_exit)

    # -- producer side -----------------------------------------------------------------------------

    def add(
        self,
        unit: str,
        round: int,
        values: Mapping[str, float],
        arm: str | None = None,
        segment: str | None = None,
        id: str | None = None,
    ) -> str:
        """Queue one observation of ``unit`` in ``round`` and return its idempotency id.

        Parameters
        ----------
        unit : str
        round : int
            The round of the unit's assignment (``Assignment.round``).
        values : mapping of metric name to finite number
        arm : str, optional
            The assigned arm; the server checks it against the sticky assignment when given.
        segment : str, optional
            Segmented experiments: the unit's segment (``Assignment.segment``).
        id : str, optional
            The observation's idempotency id (1 to 256 characters), when the caller has one that is
            stable across its own retries (an event id): adding the same observation twice under it is
            counted once. Default: a new uuid4.
        """
        if not values or not all(
            isinstance(name, str) and _is_finite_number(value) for name, value in values.items()
        ):
            raise ValueError(
                f"The values must map metric names to finite numbers, got {dict(values)!r}."
            )
        if id is not None and not (isinstance(id, str) and 1 <= len(id) <= 256):
            raise ValueError(f"An observation id must be a string of 1 to 256 characters, got {id!r}.")
        observation: dict[str, Any] = {
            "id": str(uuid.uuid4()) if id is None else id,
            "unit": unit,
            "round": round,
            "values": dict(values),
        }
        if arm is not None:
            observation["arm"] = arm
        if segment is not None:
            observation["segment"] = segment
        self._raise_pending_error()
        overflow = not self._batches.put(observation)
        if overflow and self._batches.closing:
            raise PastoError("The observation buffer is closed.")
        if overflow:
            if self.on_overflow is None:
                raise BufferOverflowError(
                    f"The observation buffer of {self.experiment_name!r} already holds "
                    f"{self.max_queue} pending observations; the server is not keeping up or is "
                    "unreachable."
                )
            self.on_overflow(observation)
        return observation["id"]

    @property
    def pending(self) -> int:
        """Observations queued or in flight."""
        return self._batches.pending

    def flush(self, timeout: float | None = None) -> None:
        """Send everything added so far and wait until it is settled (accepted by the server or
        handed to ``on_error``).

        Raises
        ------
        TimeoutError
            If ``timeout`` seconds pass first (nothing is lost: sending continues).
        PastoAPIError
            The first rejection not handled by ``on_error``.
        """
        unsettled = self._batches.flush(timeout)
        if unsettled:
            raise TimeoutError(
                f"{unsettled} observations of {self.experiment_name!r} are still unsent after "
                f"{timeout} s; the buffer keeps retrying."
            )
        self._raise_pending_error()

    def close(self, timeout: float | None = None) -> None:
        """Send everything, then stop the background thread. Idempotent.

        Raises
        ------
        TimeoutError
            If not everything was sent within ``timeout`` seconds. Sending stops and the unsent
            observations are in the exception's ``unsent`` attribute (list of dicts, ids included:
            resending them later is safe even if the server got some of them).
        PastoAPIError
            The first rejection not handled by ``on_error``.
        """
        atexit.unregister(self._close_at_exit)
        if self._batches.closed:
            return
        unsent = self._batches.close(timeout)
        if unsent:
            error = TimeoutError(
                f"{len(unsent)} observations of {self.experiment_name!r} could not be sent "
                f"within {timeout} s."
            )
            error.unsent = unsent  # type: ignore[attr-defined]
            raise error
        self._raise_pending_error()

    def _close_at_exit(self) -> None:
        try:
            self.close(timeout=EXIT_FLUSH_SECONDS)
        except TimeoutError as error:
            logger.error(
                "Exiting with %d observations of %r unsent (ObservationBuffer.close() was not "
                "called and the server did not take them within %s s).",
                len(error.unsent), self.experiment_name, EXIT_FLUSH_SECONDS,  # type: ignore[attr-defined]
            )
        except PastoError as error:
            logger.error("Observations of %r were rejected at exit: %s", self.experiment_name, error)

    def __enter__(self) -> ObservationBuffer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _raise_pending_error(self) -> None:
        if self._pending_error is not None:
            with self._error_lock:
                error, self._pending_error = self._pending_error, None
            if error is not None:
                raise error

    # -- sender thread (the BatchQueue's) -------------------------------------------------------

    def _send(self, batch: list[dict]) -> None:
        """Send ``batch`` until it is accepted, rejected with a non-retryable error, or close() gives
        up waiting."""
        backoff = self.initial_backoff
        while not self._batches.give_up.is_set():
            try:
                result = self.client.observe(self.experiment_name, batch)
            except PastoConnectionError as error:
                reason: Exception = error
            except PastoAPIError as error:
                if not error.retryable:
                    self._reject(batch, error)
                    return
                reason = error
            except Exception as error:  # a bug must not kill the sender thread and strand the queue
                logger.exception("Unexpected error while sending observations of %r.", self.experiment_name)
                reason = error
            else:
                if isinstance(result, Mapping):
                    self.accepted += int(result.get("accepted", 0))
                    self.duplicates += int(result.get("duplicates", 0))
                return
            self.retries += 1
            delay = retry_delay(backoff, getattr(reason, "retry_after", None))
            logger.warning(
                "Sending %d observations of %r failed (%s); retrying in %.2f s.",
                len(batch), self.experiment_name, reason, delay,
            )
            self._batches.give_up.wait(delay)
            backoff = min(self.max_backoff, backoff * 2)

    def _reject(self, batch: list[dict], error: PastoAPIError) -> None:
        if (error.status == 422 or (error.status == 409 and error.code == "round_pruned")) and len(batch) > 1:
            # The server takes a batch all or nothing: bisect to isolate the invalid observations
            # (or those of a round already pruned) so that their valid neighbours are still recorded.
            half = len(batch) // 2
            self._send(batch[:half])
            self._send(batch[half:])
            return
        self.rejected += len(batch)
        logger.error(
            "The server rejected %d observations of %r: %s", len(batch), self.experiment_name, error
        )
        if self.on_error is not None:
            try:
                self.on_error(error, batch)
            except Exception:  # a failing callback must not kill the sender thread
                logger.exception("The on_error callback of the observation buffer failed.")
        else:
            with self._error_lock:
                if self._pending_error is None:
                    self._pending_error = error


def _is_finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
