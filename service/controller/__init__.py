"""The service's use cases, between the HTTP routes (``service.routes``) and the store (``service.store``).

- ``experiments``: create, list, show, pause, resume, stop; the algorithm and objective an experiment runs.
- ``assignment``: which arm a unit gets in the current round.
- ``ingestion``: observations -> sufficient statistics, exactly once, all or nothing.
- ``rounds``: the close transaction (``pasto.algorithm.update``), for the scheduler and the admin route.
- ``reports``: round history, diagnostics, the numbers behind ``/metrics``, health.

Each module owns its transactions (``Database.read()`` / ``write()``), calls ``pasto`` for the math and
``service.store`` for every SQL statement, and returns plain values (dataclasses, snapshots, dicts) that
the routes serialise. Ingestion and the close are separate modules so that one observation crosses
each file once on its way to the simplex update (``docs/architecture.md``).
"""
