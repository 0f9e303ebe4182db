"""PostgreSQL as the oracle: does a Delta table hold exactly the rows of its source table?

Used by the integration tests and by ``make demo``. Rows are read from both sides and put in
one canonical form (timestamps as naive UTC, ``bytea`` as bytes, NaN made comparable), then
compared as multisets on the source's columns. A history or soft-delete Delta table is compared
by its current rows (:func:`airflow_provider_pgdecode.spark.history.current_rows`).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from psycopg import sql
from psycopg.rows import tuple_row

from airflow_provider_pgdecode import typemap
from airflow_provider_pgdecode.batch.format import delta_path_part, join_path
from airflow_provider_pgdecode.batch.storage import spark_uri

if TYPE_CHECKING:
    import psycopg
    from pyspark.sql import SparkSession


@dataclass
class TableComparison:
    schema: str
    table: str
    source_rows: int
    delta_rows: int
    only_in_source: list[tuple[Any, ...]] = field(default_factory=list)
    only_in_delta: list[tuple[Any, ...]] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not self.only_in_source and not self.only_in_delta

    def describe(self) -> str:
        if self.equal:
            return (
                f"{self.schema}.{self.table}: {self.source_rows} rows in PostgreSQL, {self.delta_rows} in Delta, equal"
            )
        return (
            f"{self.schema}.{self.table}: {self.source_rows} rows in PostgreSQL, {self.delta_rows} in Delta, DIFFERENT; "
            f"only in PostgreSQL: {self.only_in_source[:3]}; only in Delta: {self.only_in_delta[:3]}"
        )


def canonical(value: Any) -> Any:
    """One comparable form for a value read from PostgreSQL (psycopg) or from Delta (Spark)."""
    if value is None:
        return None
    if isinstance(value, float):
        return "NaN" if math.isnan(value) else value
    if isinstance(value, datetime):
        if value.tzinfo is not None:
            value = value.astimezone(UTC).replace(tzinfo=None)
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, Decimal):
        return value.normalize() if value.is_finite() else str(value)
    if isinstance(value, (list, tuple)):
        return tuple(canonical(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, canonical(v)) for k, v in value.items()))
    return value


# character(n) keeps its padding only when read as itself (a ::text cast strips it).
_TEXT_READ_AS_ITSELF = frozenset({"text", "character varying", "character"})


def _read_as_itself(type_name: str) -> bool:
    """True when psycopg's value of the type compares equal to its Delta value: the type map
    gives it a Delta type other than text (numbers, booleans, dates, timestamps, bytea)."""
    entry = typemap.find(type_name)
    return entry is not None and (entry.delta != typemap.TEXT or entry.name in _TEXT_READ_AS_ITSELF)


def output_text(column: sql.Composable) -> sql.Composable:
    """SQL for the text PostgreSQL prints for a value (its type's output function, what ``psql``
    shows and both plugins send), NULL kept. Not ``::text``: that cast differs from the output
    for ``inet`` (``10.0.0.1/32`` where ``10.0.0.1`` is printed), ``xml`` (keeps a declaration
    the output drops), ``boolean`` and ``character``."""
    return sql.SQL("CASE WHEN num_nulls({0}) = 1 THEN NULL ELSE format('%s', {0}) END").format(column)


def output_texts(column: sql.Composable) -> sql.Composable:
    """SQL for the elements of a one-dimensional array as :func:`output_text` prints each, as
    ``text[]`` (NULL elements kept, the lower bound dropped); an array of more dimensions is cast
    with ``::text[]``."""
    element = sql.SQL("{}[i]").format(column)
    return sql.SQL(
        "CASE WHEN array_ndims({0}) > 1 THEN {0}::text[] WHEN num_nulls({0}) = 0 THEN"
        " array(SELECT {1} FROM generate_subscripts({0}, 1) i ORDER BY i) END"
    ).format(column, output_text(element))


def source_rows(
    conn: psycopg.Connection[Any], schema: str, table: str, where: str | None = None
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Column names and rows of a source table (those ``where`` holds for, an SQL condition);
    text-like types are read as PostgreSQL prints them."""
    with conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(
            "SELECT a.attname::text, format_type(a.atttypid, NULL) FROM pg_attribute a"
            " WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
            (sql.Identifier(schema, table).as_string(conn),),
        )
        columns = cur.fetchall()
        select: list[sql.Composable] = []
        for name, type_name in columns:
            element = typemap.array_element(type_name)
            ident = sql.Identifier(name)
            if element is not None and not typemap.array_staged_as_list(element):
                select.append(output_text(ident))  # box[]: kept whole as its text
            elif _read_as_itself(element if element is not None else type_name):
                select.append(ident)
            else:  # uuid, json, enums, intervals...: compare the text PostgreSQL prints
                select.append(output_text(ident) if element is None else output_texts(ident))
        cur.execute("SET LOCAL TimeZone = 'UTC'" if not conn.autocommit else "SET TimeZone = 'UTC'")
        condition = sql.SQL(" WHERE " + where if where else "")
        query = sql.SQL("SELECT {} FROM {}{}").format(
            sql.SQL(", ").join(select), sql.Identifier(schema, table), condition
        )
        cur.execute(query)
        return [c[0] for c in columns], cur.fetchall()


def compare_table(
    conn: psycopg.Connection[Any],
    spark: SparkSession,
    delta_root: str,
    schema: str,
    table: str,
    delta_table: tuple[str, str] | None = None,
    where: str | None = None,
) -> TableComparison:
    """Compare ``schema.table`` in PostgreSQL with its Delta table under ``delta_root``
    (``delta_table``: another Delta table's ``(schema, table)``, e.g. the one a renamed table flows
    into): with the Delta table's current rows, as its recorded mode defines them. ``where``: only
    the rows an SQL condition both PostgreSQL and Spark read the same way holds for (a key range:
    a large table compared a slice at a time)."""
    from airflow_provider_pgdecode.spark.history import current_rows, recorded_mode
    from airflow_provider_pgdecode.spark.merge_job import delta_ref

    names, rows = source_rows(conn, schema, table, where)
    delta_schema, delta_name = delta_table or (schema, table)
    path = spark_uri(join_path(delta_root, delta_path_part(delta_schema), delta_path_part(delta_name)))
    # Through Spark (any location and session kind it reads, Spark Connect included).
    properties = {row["key"]: row["value"] for row in spark.sql(f"SHOW TBLPROPERTIES {delta_ref(path)}").collect()}
    mode = recorded_mode(properties)
    frame = current_rows(spark.read.format("delta").load(path), mode)
    if where:
        frame = frame.where(where)
    frame = frame.select(*[f"`{n}`" for n in names])
    delta = [tuple(r) for r in frame.collect()]
    left = Counter(tuple(canonical(v) for v in row) for row in rows)
    right = Counter(tuple(canonical(v) for v in row) for row in delta)
    return TableComparison(
        schema,
        table,
        len(rows),
        len(delta),
        list((left - right).elements()),
        list((right - left).elements()),
    )
