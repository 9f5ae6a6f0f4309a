"""The object the use cases are given (``service.store.Store``): the statements of ``service.store``
through one object, those that open their own transactions bound to its database."""

from __future__ import annotations

import functools
import inspect

import pytest

import service.store as statements
from service.store import STATEMENTS


def test_statements_in_the_callers_transaction_are_the_modules_functions(store):
    assert store.lock_experiment is statements.lock_experiment
    assert store.ExperimentExists is statements.ExperimentExists


def test_statements_that_open_their_own_transactions_are_bound_to_its_database(store):
    bound = store.update_statistics
    assert isinstance(bound, functools.partial) and bound.func is statements.update_statistics
    assert bound.args == (store.database,)
    assert store.write_heartbeat("test:1", statements.utcnow()) is None
    with store.read() as session:
        assert store.last_heartbeat(session) is not None


def test_every_public_function_of_the_module_is_handed_out_and_nothing_else(store):
    public = {name for name, value in vars(statements).items() if not name.startswith("_")
              and inspect.isfunction(value) and value.__module__ == statements.__name__}
    assert public <= STATEMENTS and {"KeysExist", "ExperimentExists"} <= STATEMENTS
    for name in ("_execute_raw", "sa", "np", "Session", "no_such_statement"):
        with pytest.raises(AttributeError):
            getattr(store, name)


def test_a_replaced_statement_is_obeyed(store, monkeypatch):
    """A test that replaces a statement in the module (monkeypatch) replaces it for every store."""
    monkeypatch.setattr(statements, "experiment_names", lambda session, archived=False: ["replaced"])
    with store.read() as session:
        assert store.experiment_names(session) == ["replaced"]
