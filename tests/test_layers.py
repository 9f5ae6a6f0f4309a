"""The import-layering contract: which package may import what, and where I/O may happen.

The layers (docs/architecture.md) point one way: ``service`` -> ``pasto_client`` / ``pasto`` and
``pasto_client`` -> ``pasto``, never back. ``pasto`` is the pure core: numpy and scipy, no file, network
or process I/O, except in its CLI module (``pasto/cli.py``), which reads scenario files and writes
results. Each :class:`Rule` below is checked on the source tree by reading every file's syntax tree (imports
anywhere in a file, including inside functions, and calls), so the contract holds without importing
anything. Loading a file by path (``importlib.util.spec_from_file_location``, ``runpy.run_path``, a folder put on
``sys.path``) is an import too: a rule's ``forbidden_paths`` catches the folder named in a path. To add a rule,
append one to ``RULES``, for example::

    Rule("a blueprint imports no SQLAlchemy", files=("service/routes/*.py",), forbidden_imports=("sqlalchemy",))

A rule whose ``files`` match nothing fails too, so a moved package cannot turn its rule into a no-op.
"""

from __future__ import annotations

import ast
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The service's own packages and every third-party package that only the service needs.
SERVICE_STACK = (
    "service", "migrations", "flask", "werkzeug", "jinja2", "sqlalchemy", "alembic", "psycopg",
    "pydantic", "waitress", "gunicorn", "apscheduler", "prometheus_client", "threadpoolctl",
    "duckdb", "duckdb_engine", "pyspark", "py4j",  # service/sources (the warehouse extra)
)

#: What the pure core may import: itself, numpy, scipy, highspy (pasto.optimum's exact solver) and
#: standard-library modules that compute only (an allowlist, so that no module that reads files, the
#: clock, the environment or the network, or starts threads or processes, can come in unnoticed: os,
#: sys, io, pathlib, importlib, socket, subprocess, threading, atexit, logging, time, random... are all
#: outside it).
PURE_CORE_IMPORTS = (
    "pasto", "numpy", "scipy", "highspy", "__future__", "abc", "bisect", "cmath", "collections", "copy",
    "dataclasses", "decimal", "enum", "fractions", "functools", "hashlib", "heapq", "itertools", "json",
    "math", "numbers", "operator", "re", "statistics", "string", "struct", "textwrap", "types", "typing",
    "warnings",
)

#: Builtins that do I/O or import by name; flagged wherever they are used, not only called.
IO_BUILTINS = ("open", "print", "input", "breakpoint", "exec", "eval", "compile", "__import__")
#: Methods that read or write files, whatever object they are called on (pathlib.Path, ndarray.tofile).
IO_METHODS = ("read_text", "write_text", "read_bytes", "write_bytes", "tofile")
#: numpy's file functions, by qualified name.
IO_FUNCTIONS = (
    "numpy.load", "numpy.save", "numpy.savez", "numpy.savez_compressed", "numpy.loadtxt", "numpy.savetxt",
    "numpy.genfromtxt", "numpy.fromfile", "numpy.memmap",
)


#: What the client may import: itself, the core, numpy (the core's own dependency, so always installed
#: with it; the exposure log builds its columns with it), requests and the standard library.
CLIENT_IMPORTS = ("pasto_client", "pasto", "numpy", "requests", *sorted(sys.stdlib_module_names))


@dataclass(frozen=True)
class Rule:
    """One clause of the contract.

    Attributes
    ----------
    name : str
        What the rule says, in a sentence (it heads every violation it reports).
    files : tuple of str
        Glob patterns, relative to the repository root, of the files it applies to.
    exempt : tuple of str
        Glob patterns of files it does not apply to.
    forbidden_imports : tuple of str
        Modules these files must not import (a name forbids its submodules too).
    allowed_imports : tuple of str or None
        When given, the only modules these files may import (relative imports are resolved first).
    no_io : bool
        Forbid the I/O builtins, methods and numpy functions above.
    forbidden_paths : tuple of str
        Repository folders these files must not name in a path (a string, other than a docstring, that
        is the folder's name or starts with ``<folder>/`` or ``<folder>.``, or has ``/<folder>/`` in it):
        how a script loads a module by path, which no import statement shows.
    """

    name: str
    files: tuple[str, ...]
    exempt: tuple[str, ...] = ()
    forbidden_imports: tuple[str, ...] = ()
    allowed_imports: tuple[str, ...] | None = None
    no_io: bool = False
    forbidden_paths: tuple[str, ...] = ()


RULES = (
    Rule(
        "the core (pasto) imports neither the service, its web and database stack, HTTP, nor the client",
        files=("pasto/**/*.py",),
        forbidden_imports=(*SERVICE_STACK, "requests", "urllib3", "http", "pasto_client"),
    ),
    Rule(
        "the core (pasto) outside its CLI module imports only itself, numpy, scipy and pure "
        "standard-library modules, and does no file, network or process I/O",
        files=("pasto/**/*.py",),
        exempt=("pasto/cli.py", "pasto/cli/**/*.py"),
        allowed_imports=PURE_CORE_IMPORTS,
        no_io=True,
    ),
    Rule(
        "the client (pasto_client) imports neither the service nor its web and database stack",
        files=("pasto_client/**/*.py",),
        forbidden_imports=SERVICE_STACK,
    ),
    Rule(
        "the client (pasto_client) imports only itself, the core, numpy, requests and the standard "
        "library (requests is its one third-party dependency beyond the core's numpy and scipy)",
        files=("pasto_client/**/*.py",),
        exempt=("pasto_client/exposure.py", "pasto_client/openfeature_provider.py"),
        allowed_imports=CLIENT_IMPORTS,
    ),
    Rule(
        "the client's OpenFeature provider may also import the OpenFeature SDK, the optional "
        "'openfeature' extra (pasto_client imports it only when pasto_client.openfeature_provider is)",
        files=("pasto_client/openfeature_provider.py",),
        allowed_imports=(*CLIENT_IMPORTS, "openfeature"),
    ),
    Rule(
        "the client's exposure log may also import pyarrow, the optional 'parquet' extra, which "
        "its Parquet sink imports when one is made (tests/client/test_exposure.py checks that the "
        "client works without it)",
        files=("pasto_client/exposure.py",),
        allowed_imports=(*CLIENT_IMPORTS, "pyarrow"),
    ),
    Rule(
        "bench/ imports nothing from tests/, neither by an import nor by loading a file or folder by path: "
        "what both use lives in bench/ (bench/pgcluster.py), and the tests import it from there",
        files=("bench/**/*.py",),
        forbidden_imports=("tests",),
        forbidden_paths=("tests",),
    ),
)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.Module, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``tree``, relative ones resolved."""
    found = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if not node.level:
                found.append((node.lineno, node.module))
                continue
            parts = package.split(".")
            base = parts[: len(parts) - (node.level - 1)]
            if node.module:
                found.append((node.lineno, ".".join([*base, node.module])))
            else:  # `from .. import name`: each name is a module (or a name of the package) under base
                found.extend((node.lineno, ".".join([*base, alias.name])) for alias in node.names)
    return found


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> qualified name, for every import binding (``np`` -> ``numpy``)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _qualified(node: ast.expr, aliases: dict[str, str]) -> str | None:
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _qualified(node.value, aliases)
        return f"{base}.{node.attr}" if base else None
    return None


def _io_uses(tree: ast.Module) -> list[tuple[int, str]]:
    aliases = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in IO_BUILTINS:
            found.append((node.lineno, f"uses the builtin {node.id}()"))
        elif isinstance(node, ast.Attribute) and node.attr in IO_METHODS:
            found.append((node.lineno, f"calls .{node.attr}()"))
        elif isinstance(node, (ast.Name, ast.Attribute)):
            name = _qualified(node, aliases)
            if name in IO_FUNCTIONS:
                found.append((node.lineno, f"uses {name}()"))
    return found


def _path_uses(tree: ast.Module, folders: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, what) of every string in ``tree``, docstrings and other bare string statements aside, that
    names one of ``folders`` as a path or a dotted module name (``ROOT / "tests" / "x.py"``,
    ``"tests/x.py"``, ``f"{ROOT}/tests/x.py"``, ``import_module("tests.x")``)."""
    if not folders:
        return []
    pattern = re.compile(r"(^|/)(" + "|".join(map(re.escape, folders)) + r")([./]|$)")
    statements = {id(node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in statements:
            match = pattern.search(node.value)
            if match:
                found.append((node.lineno, f"names the path {match.group(2)}/ ({node.value!r})"))
    return found


def _matches(name: str, modules: tuple[str, ...]) -> bool:
    return any(name == module or name.startswith(module + ".") for module in modules)


def rule_files(rule: Rule, root: Path) -> list[Path]:
    """The files ``rule`` applies to under ``root``, sorted."""
    files = {path for pattern in rule.files for path in root.glob(pattern)}
    exempt = {path for pattern in rule.exempt for path in root.glob(pattern)}
    return sorted(files - exempt)


def violations(root: Path, rules: tuple[Rule, ...] = RULES) -> list[str]:
    """Every breach of ``rules`` in the source tree at ``root``, as ``path:line: rule: what``."""
    found = []
    for rule in rules:
        files = rule_files(rule, root)
        if not files:
            found.append(f"{rule.files}: {rule.name}: no file matches, so the rule checks nothing")
        for path in files:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            module = _module_name(path, root)
            where = path.relative_to(root)
            breaches = []
            for line, name in _imports(tree, module, path.name == "__init__.py"):
                if _matches(name, rule.forbidden_imports):
                    breaches.append((line, f"imports {name}"))
                elif rule.allowed_imports is not None and not _matches(name, rule.allowed_imports):
                    breaches.append((line, f"imports {name}, which is not in its allowed list"))
            if rule.no_io:
                breaches.extend(_io_uses(tree))
            breaches.extend(_path_uses(tree, rule.forbidden_paths))
            found.extend(f"{where}:{line}: {rule.name}: {what}" for line, what in sorted(breaches))
    return found


def test_the_source_tree_keeps_the_contract():
    assert violations(ROOT) == []


def test_every_rule_checks_files():
    for rule in RULES:
        assert rule_files(rule, ROOT), rule.name
    assert ROOT / "pasto" / "cli.py" not in rule_files(RULES[1], ROOT)
    assert ROOT / "pasto" / "cli.py" in rule_files(RULES[0], ROOT)


#: (file, one line appended to it, the violations it must produce: none where it is allowed, one per rule
#: it breaks). In the core outside the CLI, a forbidden import also breaks the allowlist.
NOT_ALLOWED = "which is not in its allowed list"
PLANTED = [
    ("pasto/scenario.py", "import flask", ("imports flask", f"imports flask, {NOT_ALLOWED}")),
    ("pasto/scenario.py", "from service.db import get_db", ("imports service.db", f"imports service.db, {NOT_ALLOWED}")),
    ("pasto/scenario.py", "import pasto_client", ("imports pasto_client", f"imports pasto_client, {NOT_ALLOWED}")),
    ("pasto/scenario.py", "import requests", ("imports requests", f"imports requests, {NOT_ALLOWED}")),
    ("pasto/scenario.py", "_leak = lambda path: open(path).read()", ("uses the builtin open()",)),
    ("pasto/scenario.py", "import os", (f"imports os, {NOT_ALLOWED}",)),
    ("pasto/estimators.py", "from pathlib import Path", (f"imports pathlib, {NOT_ALLOWED}",)),
    ("pasto/estimators.py", "_read = lambda path: path.read_text()", ("calls .read_text()",)),
    ("pasto/estimators.py", "from importlib import resources", (f"imports importlib, {NOT_ALLOWED}",)),
    ("pasto/estimators.py", "import subprocess", (f"imports subprocess, {NOT_ALLOWED}",)),
    ("pasto/estimators.py", "import threading", (f"imports threading, {NOT_ALLOWED}",)),
    ("pasto/estimators.py", "import atexit", (f"imports atexit, {NOT_ALLOWED}",)),
    ("pasto/estimators.py", "_save = lambda: np.save('x.npy', np.zeros(2))", ("uses numpy.save()",)),
    ("pasto/hashing.py", "from . import scenario", ()),  # a module of the core
    ("pasto/hashing.py", "from .. import service", ("imports service", f"imports service, {NOT_ALLOWED}")),
    ("pasto/cli.py", "_write = lambda path: open(path, 'w').close()", ()),  # the CLI module may do I/O
    ("pasto/cli.py", "import sqlalchemy", ("imports sqlalchemy",)),
    ("pasto_client/client.py", "from service import create_app", ("imports service", f"imports service, {NOT_ALLOWED}")),
    ("pasto_client/client.py", "import flask", ("imports flask", f"imports flask, {NOT_ALLOWED}")),
    ("pasto_client/client.py", "from sqlalchemy import select", ("imports sqlalchemy", f"imports sqlalchemy, {NOT_ALLOWED}")),
    ("pasto_client/client.py", "import pydantic", ("imports pydantic", f"imports pydantic, {NOT_ALLOWED}")),
    ("pasto_client/buffer.py", "import growthbook", (f"imports growthbook, {NOT_ALLOWED}",)),
    ("pasto_client/buffer.py", "import pyarrow", (f"imports pyarrow, {NOT_ALLOWED}",)),  # only the exposure log
    ("pasto_client/exposure.py", "import pyarrow.parquet", ()),  # the Parquet sink's optional extra
    ("pasto_client/exposure.py", "import pandas", (f"imports pandas, {NOT_ALLOWED}",)),
    ("pasto_client/buffer.py", "import threading, urllib.parse", ()),  # the standard library
    ("pasto_client/assigner.py", "from pasto.hashing import bucket", ()),  # the core
]


def test_the_checker_catches_planted_violations(tmp_path):
    for package in ("pasto", "pasto_client", "bench"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    assert violations(tmp_path) == [], "the unchanged copy must be clean"
    expected = set()
    for relative, code, messages in PLANTED:
        path = tmp_path / relative
        text = path.read_text(encoding="utf-8")
        if not text.endswith("\n"):
            text += "\n"
        path.write_text(text + code + "\n", encoding="utf-8")
        expected.update((relative, text.count("\n") + 1, message) for message in messages)
    found = set()
    for violation in violations(tmp_path):
        location, rule, what = violation.split(": ")
        relative, _, line = location.rpartition(":")
        found.add((relative, int(line), what))
    assert found == expected


@pytest.mark.parametrize("source", ["print('x')", "f = open", "x = eval('1')", "__import__('os')"])
def test_io_builtins_are_caught_even_when_not_called(tmp_path, source):
    (tmp_path / "pasto").mkdir()
    (tmp_path / "pasto" / "core.py").write_text(source + "\n", encoding="utf-8")
    rule = Rule("no io", files=("pasto/*.py",), no_io=True)
    assert len(violations(tmp_path, (rule,))) == 1


def test_a_rule_that_matches_no_file_fails(tmp_path):
    rule = Rule("a blueprint imports no SQLAlchemy", files=("service/routes/*.py",), forbidden_imports=("sqlalchemy",))
    assert violations(tmp_path, (rule,)) == [
        "('service/routes/*.py',): a blueprint imports no SQLAlchemy: no file matches, so the rule checks nothing"
    ]
    (tmp_path / "service" / "routes").mkdir(parents=True)
    (tmp_path / "service" / "routes" / "rounds.py").write_text("from sqlalchemy import select\n", encoding="utf-8")
    assert violations(tmp_path, (rule,)) == [
        "service/routes/rounds.py:1: a blueprint imports no SQLAlchemy: imports sqlalchemy"
    ]


#: (a line appended to a bench script, how many violations it must produce).
BENCH_PLANTED = [
    ("import tests.migrated", 1),
    ("from tests.pgcluster import free_port", 1),
    ("from tests import signals", 1),
    ("_spec = importlib.util.spec_from_file_location('m', ROOT / 'tests' / 'pgcluster.py')", 1),
    ("_spec = importlib.util.spec_from_file_location('m', Path(__file__).parents[1] / 'tests/migrated.py')", 1),
    ("_spec = importlib.util.spec_from_file_location('m', f'{ROOT}/tests/migrated.py')", 1),
    ("_module = runpy.run_path(str(ROOT / 'tests' / 'signals.py'))", 1),
    ("sys.path.insert(0, str(ROOT / 'tests'))", 1),
    ("_module = importlib.import_module('tests.round_counts')", 1),
    ("_spec = importlib.util.spec_from_file_location('m', ROOT / 'bench' / 'pgcluster.py')", 0),  # bench/ itself
    ("'''A bare string may say what tests/service/test_demo.py checks.'''", 0),
    ("_message = 'the bounds of the tests/ folder'", 0),  # prose, not a path
    ("_latest = 'latests/x.py'", 0),  # another folder whose name ends in tests
]


def test_the_checker_catches_bench_loading_tests(tmp_path):
    rule = next(rule for rule in RULES if rule.files == ("bench/**/*.py",))
    (tmp_path / "bench").mkdir()
    expected = {}
    for position, (code, count) in enumerate(BENCH_PLANTED):
        (tmp_path / "bench" / f"script_{position}.py").write_text(
            f'"""A bench script."""\nimport importlib.util\n{code}\n', encoding="utf-8")
        expected[f"bench/script_{position}.py"] = count
    found = dict.fromkeys(expected, 0)
    for violation in violations(tmp_path, (rule,)):
        found[violation.split(":")[0]] += 1
    assert found == expected
