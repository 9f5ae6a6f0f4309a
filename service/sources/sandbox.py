"""What a metric source's own SQL may do, checked by parsing it; and engine messages cut for display.

A source's ``sql`` is checked when the experiment is created and again before every run
(:func:`check_source_sql`). The text is parsed by DuckDB's SQL parser (a PostgreSQL-derived
grammar; ``json_serialize_sql`` gives its syntax tree), never matched as a string:

- it must be exactly one statement, and that statement a ``SELECT`` (``WITH ... SELECT`` and
  ``UNION`` included): ``COPY``, ``ATTACH``, ``INSERT``, ``SET``, ``PRAGMA``, a second statement
  after a ``;`` are refused;
- its ``FROM`` reads tables only: no table function other than :data:`ALLOWED_TABLE_FUNCTIONS`
  (``read_text``, ``read_csv``, ``read_parquet``, ``glob``... read files the source did not
  declare), and no table named by a path (``FROM '/etc/passwd'``, Spark's ``parquet.`path```);
- it calls none of :data:`FORBIDDEN_FUNCTIONS`: functions that read files, the environment or
  settings, reach other servers or the JVM, or change settings.

The parser check is the first fence; each engine's own is the second (``service.sources.run``):
DuckDB runs with ``enable_external_access`` off, reading only the declared files' directories,
with its configuration locked; PostgreSQL runs the query in a read-only transaction with a
statement timeout; Spark refuses SQL on files (``spark.sql.runSQLOnFiles``).

:func:`display_message` cuts an engine's message before it is stored: everything quoted (where
engines put the offending value, e.g. DuckDB's ``Could not convert string '...' to INT32``) and
every number is replaced, so the sentence says what failed without echoing a row's value.
"""

from __future__ import annotations

import json
import re
import threading
from functools import lru_cache

from .spec import SourceError

__all__ = ["check_source_sql", "display_message", "ALLOWED_TABLE_FUNCTIONS", "FORBIDDEN_FUNCTIONS"]

#: Table functions a source's SQL may use in FROM (they generate rows, they read nothing).
ALLOWED_TABLE_FUNCTIONS = frozenset({"range", "generate_series", "unnest", "explode", "posexplode", "inline"})

#: Functions a source's SQL may not call on any engine (lower case).
FORBIDDEN_FUNCTIONS = frozenset({
    # files and the environment (DuckDB, PostgreSQL, Spark)
    "read_text", "read_blob", "read_csv", "read_csv_auto", "read_parquet", "read_json", "read_json_auto",
    "read_ndjson", "read_ndjson_auto", "read_files", "parquet_scan", "parquet_metadata", "parquet_schema",
    "glob", "getenv", "pg_read_file", "pg_read_binary_file", "pg_ls_dir", "pg_stat_file", "pg_ls_logdir",
    "pg_ls_waldir", "pg_ls_tmpdir", "lo_import", "lo_export", "lo_get", "lo_open", "input_file_name",
    # settings and other servers
    "current_setting", "set_config", "dblink", "dblink_exec", "dblink_connect", "query", "query_table",
    "pg_reload_conf", "pg_terminate_backend", "pg_cancel_backend", "pg_rotate_logfile",
    # the JVM (Spark)
    "reflect", "java_method", "try_reflect",
})

#: Spark SQL's "SQL on files" data sources (``SELECT * FROM parquet.`/path```).
_FILE_SOURCES = frozenset({"parquet", "csv", "json", "orc", "text", "avro", "binaryfile", "delta", "file"})

_PARAMETER = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")
_QUOTED = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|`[^`]*`")
#: The parser connection is shared by threads: one query at a time.
_parser_lock = threading.Lock()
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w.])")


@lru_cache(maxsize=1)
def _parser():
    import duckdb

    return duckdb.connect(":memory:", config={"enable_external_access": False})


def _parse(sql: str, engine: str) -> tuple[list, dict]:
    import duckdb

    # DuckDB spells a named parameter $name; Spark quotes names with backquotes.
    text = _PARAMETER.sub(lambda match: "$" + match.group(1), sql)
    if engine == "spark":
        text = text.replace("`", '"')
    try:
        statements = duckdb.extract_statements(text)
    except duckdb.Error as error:
        raise SourceError(f"The metric source's SQL does not parse: {_first_line(error)}") from None
    tree = {}
    if len(statements) == 1 and statements[0].type == duckdb.StatementType.SELECT:
        with _parser_lock:
            tree = json.loads(_parser().execute("SELECT json_serialize_sql(?::VARCHAR)", [text]).fetchone()[0])
        if tree.get("error"):
            raise SourceError(f"The metric source's SQL does not parse: {tree.get('error_message', '')}")
    return statements, tree


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _walk(node, functions: set[str], table_functions: set[str], tables: list[tuple[str, str]]) -> None:
    if isinstance(node, dict):
        if node.get("class") == "FUNCTION" and isinstance(node.get("function_name"), str):
            functions.add(node["function_name"].lower())
        if node.get("type") == "TABLE_FUNCTION":
            function = node.get("function") or {}
            table_functions.add(str(function.get("function_name", "")).lower())
        if node.get("type") == "BASE_TABLE":
            tables.append((str(node.get("schema_name", "")), str(node.get("table_name", ""))))
        for value in node.values():
            _walk(value, functions, table_functions, tables)
    elif isinstance(node, list):
        for value in node:
            _walk(value, functions, table_functions, tables)


def check_source_sql(sql: str, engine: str) -> None:
    """Refuse SQL that is not one read-only SELECT over tables (see the module docstring).

    Parameters
    ----------
    sql : str
        The source's SQL, with ``:name`` bound parameters.
    engine : str
        ``"spark"`` (backquoted names) or the SQLAlchemy backend name (``"duckdb"``, ``"postgresql"``...).

    Raises
    ------
    SourceError
        Saying why the SQL is refused.
    """
    import duckdb

    statements, tree = _parse(sql, engine)
    if len(statements) != 1:
        kinds = ", ".join(statement.type.name for statement in statements) or "none"
        raise SourceError(f"The metric source's SQL must be exactly one SELECT; it has {len(statements)} "
                          f"statements ({kinds}).")
    if statements[0].type != duckdb.StatementType.SELECT:
        raise SourceError(f"The metric source's SQL is a statement of type {statements[0].type.name}; a metric source "
                          "runs one read-only SELECT.")
    functions: set[str] = set()
    table_functions: set[str] = set()
    tables: list[tuple[str, str]] = []
    _walk(tree.get("statements", []), functions, table_functions, tables)
    forbidden = sorted((functions | table_functions) & FORBIDDEN_FUNCTIONS)
    if forbidden:
        raise SourceError(f"The metric source's SQL calls {forbidden}; a metric source reads its declared "
                          "tables and files only.")
    other = sorted(table_functions - ALLOWED_TABLE_FUNCTIONS)
    if other:
        raise SourceError(f"The metric source's SQL reads from the table functions {other}; a metric source reads "
                          "its declared tables and files only (declare files under \"files\").")
    for schema, table in tables:
        if any(character in table for character in "/\\:") or re.search(r"\.\w+$", table):
            raise SourceError(f"The metric source's SQL reads the path {table!r} as a table; declare files under "
                              "\"files\" and read them by name.")
        if engine == "spark" and schema.lower() in _FILE_SOURCES:
            raise SourceError(f"The metric source's SQL reads files with {schema}.`...`; declare files under "
                              "\"files\" and read them by name.")


def display_message(text: str, limit: int = 400) -> str:
    """An engine's message as it may be stored and shown: its first line, quoted text and numbers cut.

    A query's values reach error messages quoted (``Could not convert string '...'``, ``invalid input
    syntax for type integer: "..."``, ``The value '...' of the type "STRING"``) or as numbers; both
    become ``…``, so the message names what failed and never a value a row held.
    """
    line = (text.strip().splitlines() or [""])[0].strip()
    line = _QUOTED.sub("…", line)
    line = _NUMBER.sub("…", line)
    return line if len(line) <= limit else line[:limit - 3] + "..."

