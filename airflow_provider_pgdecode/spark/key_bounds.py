"""A single key's bounds in the MERGE's ON condition: which key types have them, and how each bound
is taken and written so that Spark reads back exactly the value it came from.

The bounds of a batch's keys go into the MERGE's condition (``t.key BETWEEN lo AND hi``) so that
Delta skips the data files outside them. A bound Spark reads as another value makes the MERGE miss
rows it should match: their updates are inserted beside them and their deletes lost. So a bound is
written as a literal of the key's own type, never as a string left to an implicit cast: a date as
``DATE '...'``, a decimal cast to its precision and scale, bytes in hex, and a timestamp as its
microseconds since the epoch (``timestamp_micros``): a timestamp collected to Python comes back in
the driver's local time zone, which the Spark session (UTC) would not read alike. Keys of other
types (floating point, with its NaN; booleans) have no bounds: the MERGE then matches by key alone.
Pure.
"""

from __future__ import annotations

from decimal import Decimal
from typing import TYPE_CHECKING, Any

from pyspark.sql import functions as F
from pyspark.sql.types import (
    BinaryType,
    DataType,
    DateType,
    DecimalType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    TimestampType,
)

from airflow_provider_pgdecode.spark.merge_plan import sql_literal

if TYPE_CHECKING:
    from pyspark.sql import Column

    from airflow_provider_pgdecode.spark.merge_plan import TablePlan

INTEGER_TYPES = (ShortType, IntegerType, LongType)
"""Delta's integer types: a single key of one of them has key ranges in buckets (:func:`integer_key`)."""

BOUNDED_KEY_TYPES = (*INTEGER_TYPES, StringType, DecimalType, DateType, TimestampType, BinaryType)
"""The Delta types of a single key whose bounds the MERGE's condition holds."""


def integer_key(plan: TablePlan) -> str | None:
    """The table's key column when it is one column of an integer type (the key ranges' case)."""
    if len(plan.key) != 1 or not isinstance(plan.types[plan.key[0]].delta_type, INTEGER_TYPES):
        return None
    return plan.key[0]


def bounded_key(plan: TablePlan) -> str | None:
    """The table's key column when it is one column of a type with bounds (:data:`BOUNDED_KEY_TYPES`)."""
    if len(plan.key) != 1 or not isinstance(plan.types[plan.key[0]].delta_type, BOUNDED_KEY_TYPES):
        return None
    return plan.key[0]


def bound_of(value: Column, delta_type: DataType) -> Column:
    """What the profile aggregates of the key's ``value``: a timestamp as its microseconds since
    the epoch (a staged timestamp without zone, the wall clock, read as UTC as the merge reads it)."""
    if isinstance(delta_type, TimestampType):
        return F.unix_micros(value.cast("timestamp"))
    return value


def arrow_bound_values(values: Any, delta_type: DataType) -> Any:
    """A part's key ``values`` (a pyarrow array) as the driver's profile takes their bounds, alike
    :func:`bound_of`: a timestamp as its microseconds since the epoch (zoneless: the wall clock's,
    read as UTC)."""
    import pyarrow as pa

    if isinstance(delta_type, TimestampType) and pa.types.is_timestamp(values.type):
        return values.cast(pa.int64())
    return values


def bound_sql(bound: Any, delta_type: DataType) -> str:
    """``bound`` (from :func:`bound_of`, or the driver's profile) as a Spark SQL literal of the key's type."""
    if isinstance(bound, bool) or bound is None:
        raise TypeError(f"no key bound of {bound!r}")
    if isinstance(delta_type, TimestampType):
        return f"timestamp_micros({int(bound)})"
    if isinstance(delta_type, DateType):
        return f"DATE '{bound.isoformat()}'"
    if isinstance(delta_type, DecimalType):
        return f"CAST('{Decimal(bound):f}' AS DECIMAL({delta_type.precision},{delta_type.scale}))"
    if isinstance(delta_type, BinaryType):
        return f"X'{bytes(bound).hex()}'"
    return sql_literal(bound)


def bound_column(bound: Any, delta_type: DataType) -> Column:
    """``bound`` as a column literal of the key's type, for a DataFrame's filter."""
    return F.expr(bound_sql(bound, delta_type))
