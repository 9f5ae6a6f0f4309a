"""Signals for observers such as the Prometheus exporter (``service.monitoring``).

Senders are experiment :class:`~service.cache.Snapshot` objects (``round_closed``: the experiment
name). Sending costs almost nothing when nobody is connected. Receivers must be quick and must not
raise: they run inside the request or the scheduler job.

- ``assigned``: ``arms`` (sequence of arm positions) after an assignment response is built.
- ``observed``: ``accepted`` (int), ``duplicates`` (int), ``arm_counts`` ({arm position: accepted
  observations}) after an ingestion transaction committed.
- ``created``: after a new experiment's transaction committed.
- ``round_closed``: ``round_index`` (the round closed), ``applied`` (round indices whose update ran),
  ``duration_seconds`` (time spent in the transaction), ``lag_seconds`` (now - the round's ends_at).
"""

from __future__ import annotations

from blinker import Namespace

_signals = Namespace()

created = _signals.signal("pasto.created")
assigned = _signals.signal("pasto.assigned")
observed = _signals.signal("pasto.observed")
round_closed = _signals.signal("pasto.round_closed")
