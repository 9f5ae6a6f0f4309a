"""The service runs its BLAS libraries on one thread per process unless the operator set a count
(service.one_blas_thread, called by create_app)."""

from __future__ import annotations

import numpy as np  # noqa: F401  (loads numpy's BLAS)
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

import service


def _blas_threads() -> set[int]:
    return {library["num_threads"] for library in threadpool_info() if library["user_api"] == "blas"}


@pytest.fixture
def restored_threads():
    before = threadpool_info()
    yield
    for library in before:
        threadpool_limits(limits=library["num_threads"], user_api=library["user_api"])


def test_without_a_thread_variable_the_blas_runs_on_one_thread(monkeypatch, restored_threads):
    for name in service.BLAS_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    threadpool_limits(limits=2, user_api="blas")
    assert _blas_threads() == {2}
    service.one_blas_thread()
    assert _blas_threads() == {1}


@pytest.mark.parametrize("variable", service.BLAS_THREAD_VARIABLES)
def test_a_thread_count_the_operator_set_is_kept(monkeypatch, restored_threads, variable):
    for name in service.BLAS_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "2")
    threadpool_limits(limits=2, user_api="blas")
    service.one_blas_thread()
    assert _blas_threads() == {2}


def test_create_app_sets_one_blas_thread(monkeypatch, restored_threads, tmp_path):
    for name in service.BLAS_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    threadpool_limits(limits=2, user_api="blas")
    service.create_app({"PASTO_DATABASE_URL": f"sqlite:///{tmp_path / 'pasto.db'}", "PASTO_CHECK_SCHEMA": False})
    assert _blas_threads() == {1}
