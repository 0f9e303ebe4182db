"""Which failures park one table instead of stopping the merge (batch/parking.py keeps its place).

A table is parked when its own Delta table cannot be read or written (a damaged ``_delta_log``:
:class:`~airflow_provider_pgdecode.errors.DeltaTableError`; a write Spark refuses while the
session itself still works: a directory it may not write, a disk quota), or when the merge
refuses its staged changes (:class:`~airflow_provider_pgdecode.errors.MergeInputError`: a type or
key change, a NULL key, a value Delta cannot hold). Nothing of that table is written, its staged
batches stay where they are, and the merge of the other tables goes on. A refused table's way
forward is the refusal's own when it changes something outside the staged changes (the Delta
table, the merge's options), or else a resnapshot, whose TRUNCATE replaces the changes staged
before it (``merge_plan.since_resnapshot``): the slot has moved on, they cannot be re-extracted.

Everything else still stops the run before the slot moves: a damaged staged part (its way forward
re-extracts the unconfirmed range), a session that is gone or out of memory.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.errors import DeltaTableError, MergeInputError, PgDecodeError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

#: Added to the parking warning of a table whose changes were refused (one wording).
REFUSAL_WAY_FORWARD = (
    ". The slot moves on for the other tables, so a way forward that re-extracts the changes no longer "
    "applies: resnapshot the table instead (pgdecode_backfill mode=resnapshot; move its Delta table aside "
    "first when the refusal asks for a rebuilt table), and the resnapshot replaces the changes refused here"
)
#: Ends the recorded reason of a table parked for a refusal (parked-tables.json, the health check).
REFUSAL_HINT = " [parked: where this says re-extract, resnapshot the table instead (docs/merge.md, 'Parked tables')]"
OUT_OF_MEMORY_SIGNS = ("java.lang.OutOfMemoryError", "Java heap space", "GC overhead limit exceeded")
_REASON_CHARS = 600
#: A Java exception's line in a py4j error: ``: java.io.X: message`` or ``Caused by: java.io.X: message``.
_JAVA_EXCEPTION = re.compile(r"^(?::\s*|Caused by:\s*)?((?:[a-z_$][\w$]*\.)+[A-Z][\w$]*(?:Exception|Error)): (.+)$")


def catch_up_only(batches: Sequence[BatchManifest], parked: Collection[str]) -> list[BatchManifest]:
    """Earlier batches given back for the parked tables: each keeps only those tables' entries
    (the other tables took them when they were first merged), and no quarantine or messages
    (appended then too)."""
    out = []
    for batch in batches:
        tables = [entry for entry in batch.tables if f"{entry.target[0]}.{entry.target[1]}" in parked]
        if tables:
            out.append(replace(batch, tables=tables, quarantine=[], messages=None))
    return out


def session_alive(spark: SparkSession) -> bool:
    """True when the session still runs a job (so an error was the table's, not the session's)."""
    try:
        return spark.range(1).count() == 1
    except Exception:  # a stopped context, a Connect server gone: the run stops
        return False


def refused(error: BaseException) -> bool:
    """True for a refusal of a table's staged changes (not of its Delta table)."""
    return isinstance(error, MergeInputError) and not isinstance(error, DeltaTableError)


def parks_merge_input(error: MergeInputError, park_refused: bool) -> bool:
    """Whether a :class:`MergeInputError` of one table parks it: its Delta table's always, a
    refusal of its staged changes only with ``park_refused`` (the one rule for both)."""
    return park_refused or not refused(error)


def table_problem(spark: SparkSession, error: BaseException, park_refused: bool = False) -> bool:
    """True when ``error``, raised while writing one table, is that table's own problem to park
    (a refusal of its changes only with ``park_refused``)."""
    if isinstance(error, MergeInputError):  # its Delta table, or a refusal of its changes
        return parks_merge_input(error, park_refused)
    if isinstance(error, PgDecodeError):  # a damaged staged part: the run stops
        return False
    text = f"{error}\n{getattr(error, 'java_exception', '')}"
    if any(sign in text for sign in OUT_OF_MEMORY_SIGNS):
        return False
    return session_alive(spark)


def reason(error: BaseException) -> str:
    """One line saying why a table is parked (Spark's errors carry pages of JVM stack).

    For an error of the JVM (py4j's ``An error occurred while calling o60.sql.``, then the Java
    exception and its causes), the innermost Java exception: the one that names the file and the
    system's refusal (``FileNotFoundException: …/_delta_log/… (Operation not permitted)``)."""
    text = str(error).strip()
    lines = text.splitlines()
    first = lines[0] if lines else type(error).__name__
    java = [m for m in (_JAVA_EXCEPTION.match(line.strip()) for line in lines) if m]
    if java:
        name, message = java[-1].groups()
        first = f"{name.rsplit('.', 1)[-1]}: {message}"
    elif not isinstance(error, PgDecodeError):
        first = f"{type(error).__name__}: {first}"
    return first if len(first) <= _REASON_CHARS else first[: _REASON_CHARS - 1] + "…"
