"""Keyless tables as multisets: the MERGE source of a table identified by all its columns.

A table without a primary key under REPLICA IDENTITY FULL (key source "all columns") may hold
identical rows, and each copy is a row of its own: an INSERT adds one copy, a DELETE removes
exactly one, an UPDATE changes exactly one (PostgreSQL logs the whole old row, so the old
image names the value of the copy it changed). Matching by ``=`` on all columns would collapse
copies and could not match NULLs, so these tables are merged by counts instead:

1. :func:`row_effects`: every change after the last TRUNCATE becomes +1 for its new image
   (INSERT, UPDATE; an unchanged-TOAST column of an UPDATE takes its old image's value) and -1
   for its old image (UPDATE, DELETE);
2. :func:`net_changes`: per distinct row value, the net count over the batch;
3. :func:`copies_in_target`: for the values whose net is negative, the copies ``m`` Delta holds
   (null-safe equality on every column); ``m + net < 0`` means Delta lost copies the source
   still had (:func:`diverged_error`);
4. :func:`merge_rows`: one MERGE source of ``replace`` rows (one per value with a negative net:
   every Delta copy of the value matches it and is deleted) and ``insert`` rows (``m + net``
   copies of a replaced value, ``net`` copies of a value with a positive net) that match nothing.

One MERGE, one Delta commit per table per batch, carrying the transaction id that makes
replays no-ops (exactly as the keyed MERGE). Every function here is a pure DataFrame
transformation except where it says otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, DataType, MapType, StructType

from airflow_provider_pgdecode.errors import MergeInputError
from airflow_provider_pgdecode.spark.collapse import KEEP, LSN, OP, SEQ, col, order_of

NET = "__net"
COPIES = "__copies"
ACTION = "__action"
REPLACE = "replace"
INSERT = "insert"
_META = "__meta"


def comparable(data_type: DataType) -> bool:
    """Whether Spark can test values of ``data_type`` for equality (maps it cannot)."""
    if isinstance(data_type, MapType):
        return False
    if isinstance(data_type, ArrayType):
        return comparable(data_type.elementType)
    if isinstance(data_type, StructType):
        return all(comparable(f.dataType) for f in data_type.fields)
    return True


def uncomparable_columns(types: Mapping[str, DataType]) -> list[str]:
    """The columns whose Delta type Spark cannot compare, which a multiset merge cannot match."""
    return [name for name, data_type in types.items() if not comparable(data_type)]


def row_effects(
    events: DataFrame, columns: Sequence[str], old_columns: Mapping[str, str], metadata_columns: Sequence[str]
) -> DataFrame:
    """+1 per new image (``I``, ``U``), -1 per old image (``U``, ``D``), with the row's values.

    ``old_columns`` maps each column to its old-image column in ``events``. A column the UPDATE
    did not carry (``__keep``: unchanged TOAST, or absent from its part) takes the old image's
    value: under REPLICA IDENTITY FULL the old image is the whole row. Metadata is the change's
    on +1 rows and null on -1 rows.
    """
    keeps = F.col(KEEP)
    new_values = [
        F.when((F.col(OP) == "U") & F.array_contains(keeps, name), F.col(old_columns[name]))
        .otherwise(col(name))
        .alias(name)
        for name in columns
    ]
    plus = events.where(F.col(OP).isin("I", "U")).select(
        *new_values, F.lit(1).alias(NET), *[col(m) for m in metadata_columns], F.col(LSN), F.col(SEQ)
    )
    minus = events.where(F.col(OP).isin("U", "D")).select(
        *[F.col(old_columns[name]).alias(name) for name in columns],
        F.lit(-1).alias(NET),
        *[F.lit(None).cast(events.schema[m].dataType).alias(m) for m in metadata_columns],
        F.col(LSN),
        F.col(SEQ),
    )
    return plus.unionByName(minus)


def net_changes(effects: DataFrame, columns: Sequence[str], metadata_columns: Sequence[str]) -> DataFrame:
    """Per distinct row value (NULLs equal to NULLs), the net copy count and the metadata of its
    last +1 (null when the batch added no copy of it). Values whose net is 0 are left out."""
    last_added = F.when(F.col(NET) > 0, order_of())
    grouped = effects.groupBy(*[col(name) for name in columns]).agg(
        F.sum(NET).alias(NET),
        F.max_by(F.struct(*[col(m) for m in metadata_columns]), last_added).alias(_META),
    )
    return grouped.where(F.col(NET) != 0).select(
        *[col(name) for name in columns],
        F.col(NET),
        *[F.col(_META).getField(m).alias(m) for m in metadata_columns],
    )


def same_row(left: DataFrame, right: DataFrame, left_names: Sequence[str], right_names: Sequence[str]) -> Column:
    """Null-safe equality of two frames' columns, pairwise (``<=>``)."""
    condition = F.lit(True)
    for left_name, right_name in zip(left_names, right_names, strict=True):
        condition = condition & left[_quoted(left_name)].eqNullSafe(right[_quoted(right_name)])
    return condition


def _quoted(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def copies_in_target(
    negatives: DataFrame, target: DataFrame | None, columns: Sequence[str], metadata_columns: Sequence[str]
) -> DataFrame:
    """``negatives`` (values with a negative net) with ``__copies``: how many copies Delta holds,
    and for those copies the metadata of the latest one where the batch added none."""
    if target is None:
        return negatives.withColumn(COPIES, F.lit(0).cast("long"))
    renamed = [f"__t_{i}" for i in range(len(columns))]
    meta_renamed = [f"__tm_{i}" for i in range(len(metadata_columns))]
    held = target.select(
        *[col(name).alias(alias) for name, alias in zip(columns, renamed, strict=True)],
        *[col(name).alias(alias) for name, alias in zip(metadata_columns, meta_renamed, strict=True)],
    )
    joined = negatives.join(held, same_row(negatives, held, columns, renamed), "left")
    present = F.col(renamed[0]).isNotNull() if columns else F.lit(False)
    for alias in renamed[1:]:
        present = present | F.col(alias).isNotNull()
    # A copy whose every column is NULL still counts: its commit LSN is never NULL.
    matched = F.col(meta_renamed[0]).isNotNull() if metadata_columns else present
    latest = F.max_by(
        F.struct(*[F.col(alias).alias(name) for alias, name in zip(meta_renamed, metadata_columns, strict=True)]),
        F.when(matched, F.col(meta_renamed[0])),
    )
    counted = joined.groupBy(*[col(name) for name in columns], F.col(NET), *[col(m) for m in metadata_columns]).agg(
        F.sum(F.when(matched, 1).otherwise(0)).cast("long").alias(COPIES), latest.alias(_META)
    )
    return counted.select(
        *[col(name) for name in columns],
        F.col(NET),
        *[F.coalesce(col(m), F.col(_META).getField(m)).alias(m) for m in metadata_columns],
        F.col(COPIES),
    )


def merge_rows(
    net: DataFrame, counted: DataFrame, columns: Sequence[str], metadata_columns: Sequence[str]
) -> DataFrame:
    """The MERGE source: ``replace`` rows for values with a negative net (``counted``, with their
    copies in Delta) and ``insert`` rows: ``copies + net`` of each replaced value, ``net`` of each
    value with a positive net."""
    carried = [*[col(name) for name in columns], *[col(m) for m in metadata_columns]]
    replace = counted.where(F.col(COPIES) > 0).select(*carried, F.lit(REPLACE).alias(ACTION))
    kept = counted.select(*carried, (F.col(COPIES) + F.col(NET)).alias("__n"))
    added = net.where(F.col(NET) > 0).select(*carried, F.col(NET).cast("long").alias("__n"))
    inserts = (
        kept.unionByName(added)
        .where(F.col("__n") > 0)
        .select(*carried, F.explode(F.array_repeat(F.lit(INSERT), F.col("__n").cast("int"))).alias(ACTION))
    )
    return replace.unionByName(inserts)


def merge_condition(columns: Sequence[str]) -> str:
    """ON: a ``replace`` row matches every Delta copy of its value (``<=>`` on every column);
    ``insert`` rows match nothing."""
    equal = " AND ".join(f"t.{_quoted(name)} <=> s.{_quoted(name)}" for name in columns)
    return f"s.{ACTION} = '{REPLACE}'" + (f" AND {equal}" if equal else "")


def diverged_error(table: str, values: int, missing: int) -> MergeInputError:
    """A DELETE or UPDATE of a copy Delta does not hold: Delta and the source differ."""
    return MergeInputError(
        f"table {table} (no key; REPLICA IDENTITY FULL, merged as a multiset): this batch removes {missing} "
        f"cop{'y' if missing == 1 else 'ies'} of {values} row value(s) that the Delta table does not hold, so "
        "Delta has diverged from the source (changed by hand, or changes lost before this batch). Nothing was "
        "written. Resnapshot the table (the backfill DAG's mode 'resnapshot', or PgDecodeTableSnapshotOperator "
        "with mode='resnapshot'), then merge again"
    )


def uncomparable_error(table: str, columns: Sequence[str], types: Mapping[str, DataType]) -> MergeInputError:
    """A keyless table with a column Spark cannot compare cannot be merged as a multiset."""
    described = ", ".join(f"{name!r} ({types[name].simpleString()})" for name in columns)
    return MergeInputError(
        f"table {table} has no key and is merged as a multiset (every column identifies a row), but Spark cannot "
        f"compare column(s) {described}. Add a primary key to the source table, or load it with table_options "
        "mode 'append_only' if it only receives inserts, or exclude it"
    )
