"""The bench scripts are files, not a package: the tests load them by path."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


@contextmanager
def bench_script(stem: str) -> Iterator[ModuleType]:
    """``bench/<stem>.py`` as a module, registered in ``sys.modules`` while in use (a worker pool
    pickles its functions by module name) and removed afterwards."""
    spec = importlib.util.spec_from_file_location(f"bench_{stem}", BENCH / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
