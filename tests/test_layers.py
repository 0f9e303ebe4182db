"""Every SQL statement and driver call lives in the PostgreSQL layer (DESIGN.md, "Layers").

The package's Python source outside ``postgres/`` (and ``testing/``: the test oracle and the
throwaway cluster) is read with ``ast``, so docstrings and comments, where SQL is explained,
never count, and no line is allow-listed. What counts:

* SQL in a string literal or f-string (``SELECT``, ``COPY``, ``SET LOCAL``, ``LOCK TABLE``,
  replication commands, ``pg_*()`` calls, ...);
* composing SQL (``sql.SQL(...)``, ``sql.Identifier(...)``, ...) or importing ``psycopg.sql`` or
  psycopg2 (the replication protocol);
* driver calls: ``.cursor(...)``, ``.execute(<something>)``, ``.executemany(...)``.

SQL quoted in an error or log message (the statement a user should run to fix something) is
advice, not a statement issued: strings inside a ``raise``, an ``...Error(...)`` /
``...Exception(...)`` / ``...Warning(...)`` construction or a logging call are not checked for
SQL text. Driver calls are checked everywhere.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

import airflow_provider_pgdecode

PACKAGE = Path(airflow_provider_pgdecode.__file__).resolve().parent
ALLOWED = ("postgres", "testing")

SQL_TEXT: list[tuple[str, re.Pattern[str]]] = [
    ("SELECT", re.compile(r"\bSELECT\b")),
    ("COPY", re.compile(r"\bCOPY\b")),
    ("SET LOCAL/SESSION/TRANSACTION", re.compile(r"\bSET\s+(LOCAL|SESSION|TRANSACTION)\b")),
    ("ISOLATION LEVEL", re.compile(r"\bISOLATION\s+LEVEL\b")),
    ("LOCK TABLE", re.compile(r"\bLOCK\s+TABLE\b")),
    ("INSERT/DELETE", re.compile(r"\bINSERT\s+INTO\b|\bDELETE\s+FROM\b")),
    ("replication command", re.compile(r"\b(CREATE_REPLICATION_SLOT|DROP_REPLICATION_SLOT|START_REPLICATION)\b")),
    ("pg_*() call", re.compile(r"\bpg_[a-z0-9_]+\s*\(")),
    ("settings function", re.compile(r"\b(set_config|current_setting)\s*\(")),
]
SQL_COMPOSITION = {"SQL", "Identifier", "Literal", "Composed", "Placeholder"}
LOGGING_METHODS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}
LOGGERS = {"log", "logger", "logging", "_log", "LOG"}


def _callee(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


def _is_message(node: ast.AST) -> bool:
    """A raise, an exception or warning being built, or a logging call: text for a person."""
    if isinstance(node, ast.Raise):
        return True
    if not isinstance(node, ast.Call):
        return False
    name = _callee(node)
    if name.endswith(("Error", "Exception", "Warning")):
        return True
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr in LOGGING_METHODS:
        owner = func.value
        owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
        return owner_name in LOGGERS
    return False


def _documentation(tree: ast.AST) -> set[int]:
    """ids of string constants that are documentation: a bare string statement (docstrings of
    modules, classes and functions, and attribute docstrings after an assignment)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


def _text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)  # type: ignore[misc]
    return None


def violations(source: str, name: str) -> Iterator[str]:
    """``name:line: what: excerpt`` for each piece of SQL or driver use in ``source``."""
    tree = ast.parse(source)
    docs = _documentation(tree)
    lines = source.splitlines()

    def where(node: ast.AST, what: str) -> str:
        line = getattr(node, "lineno", 0)
        excerpt = lines[line - 1].strip() if 0 < line <= len(lines) else ""
        return f"{name}:{line}: {what}: {excerpt[:100]}"

    def visit(node: ast.AST, in_message: bool) -> Iterator[str]:
        in_message = in_message or _is_message(node)
        text = _text(node)
        if text is not None:
            if id(node) not in docs and not in_message:
                for label, pattern in SQL_TEXT:
                    if pattern.search(text):
                        yield where(node, f"SQL ({label}) in a string")
                        break
            if isinstance(node, ast.JoinedStr):  # its parts are checked as the whole
                for part in node.values:
                    if isinstance(part, ast.FormattedValue):
                        yield from visit(part, in_message)
                return
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            owner = func.value
            if isinstance(owner, ast.Name) and owner.id == "sql" and func.attr in SQL_COMPOSITION:
                yield where(node, f"SQL composed (sql.{func.attr})")
            elif func.attr == "cursor":
                yield where(node, "driver call (.cursor)")
            elif func.attr in ("execute", "executemany") and node.args:
                is_super = isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"
                if not is_super:  # an Airflow operator's super().execute(context) is no statement
                    yield where(node, f"driver call (.{func.attr})")
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "psycopg.sql" or alias.name.split(".")[0] == "psycopg2":
                    yield where(node, f"import {alias.name}")
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            imported = {alias.name for alias in node.names}
            if (
                node.module.split(".")[0] == "psycopg2"
                or node.module == "psycopg.sql"
                or (node.module == "psycopg" and "sql" in imported)
            ):
                yield where(node, f"import from {node.module}")
        for child in ast.iter_child_nodes(node):
            yield from visit(child, in_message)

    yield from visit(tree, False)


def _modules() -> list[Path]:
    return sorted(
        path
        for path in PACKAGE.rglob("*.py")
        if path.relative_to(PACKAGE).parts[0] not in ALLOWED and "__pycache__" not in path.parts
    )


def test_no_sql_outside_the_postgres_layer() -> None:
    modules = _modules()
    assert len(modules) > 20 and any(p.name == "snapshot.py" for p in modules)  # the scan sees the package
    found = [
        v
        for path in modules
        for v in violations(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE.parent)))
    ]
    assert not found, "SQL or driver calls outside airflow_provider_pgdecode/postgres/:\n" + "\n".join(found)


def test_the_scanner_finds_sql_in_code_and_leaves_documentation_and_messages_alone() -> None:
    source = textwrap.dedent('''
        """Module doc: SELECT pg_current_wal_lsn() is explained here, COPY too."""
        import psycopg2
        from psycopg import sql

        QUERY = "SELECT 1"  # SELECT in a comment never counts
        """Attribute doc: SET LOCAL work_mem."""


        def read(conn, name):
            """Function doc: LOCK TABLE t."""
            conn.execute(QUERY)
            with conn.cursor() as cur:
                cur.copy(sql.SQL("COPY {} TO STDOUT").format(sql.Identifier(name)))
            f"x := pg_relation_size({name})"
            if not name:
                raise ValueError(f"run SELECT pg_drop_replication_slot('{name}') first")
            log.warning("COPY failed; run SELECT 1")
            message = SlotError("drop it: SELECT pg_drop_replication_slot('x')")
            super().execute(context)
            builder.execute()
            return "CREATE_REPLICATION_SLOT s LOGICAL p"
    ''')
    found = [v.split(": ")[1] for v in violations(source, "m.py")]
    lines = sorted(int(v.split(":")[1]) for v in violations(source, "m.py"))
    assert found == [
        "import psycopg2",
        "import from psycopg",
        "SQL (SELECT) in a string",
        "driver call (.execute)",
        "driver call (.cursor)",
        "SQL composed (sql.SQL)",
        "SQL (COPY) in a string",
        "SQL composed (sql.Identifier)",
        "SQL (pg_*() call) in a string",
        "SQL (replication command) in a string",
    ], found
    assert lines == [3, 4, 6, 12, 13, 14, 14, 14, 15, 22]
