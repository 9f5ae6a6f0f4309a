"""The service's use cases, between the HTTP routes (``service.routes``) and the store (``service.store``).

- ``experiments``: create, list, show, pause, resume, stop; the algorithm and objective an experiment runs.
- ``assignment``: which arm a unit gets in the current round.
- ``ingestion``: observations -> sufficient statistics, exactly once, all or nothing.
- ``rounds``: the close transaction (``pasto.algorithm.update``), for the scheduler and the admin route.
- ``statistics``: pre-aggregated statistics batches, exactly once per batch id.
- ``retention``: prunes old observation ids and units (a scheduler job).
- ``sources``: an experiment's warehouse metric source around the close.
- ``reports``: round history, diagnostics, the numbers behind ``/metrics``, health.

Every use case takes a :class:`service.store.UnitOfWork` (``uow``) as its first argument: the routes
and the scheduler's jobs pass the application's (``service.bootstrap.get_uow``), a test can pass one
made from a database alone (``UnitOfWork.open(database)``, tests/service/usecases/). Nothing here
imports Flask or looks anything up in an application. Each module owns its transactions
(``uow.read()`` / ``uow.write()``), calls ``pasto`` for the math and ``service.store`` for every SQL
statement, and returns plain values (dataclasses, snapshots, dicts) that the routes serialise. Ingestion and the close are
separate modules so that one observation crosses each file once on its way to the simplex update
(``docs/architecture.md``).
"""
