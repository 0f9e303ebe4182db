"""ADD COLUMN defaults: what PostgreSQL shows in rows written before a column was added.

``ALTER TABLE ... ADD COLUMN five int DEFAULT 5`` writes no WAL for the rows already there: their
value is the column's *missing value* (``pg_attribute.attmissingval``), shown by every read and
sent by the slot only for rows written after the ALTER. The extract records it per column in the
manifest (``missing``, the staged value in JSON form); here it becomes a Spark SQL literal of the
column's Delta type, which the merge gives

* to the staged inserts that predate the column (their parts lack it), instead of NULL, and
* to the Delta rows already there when the column is added to the Delta table: an ``UPDATE`` of
  every row, before the batch's MERGE (all those rows predate the column, since none of the
  slot's changes after the ALTER lacks it). The columns to fill are recorded in the table property
  :data:`FILL_PROPERTY` before the column is added and removed after the fill, so a run stopped in
  between fills them on its retry.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from pyspark.sql.types import ArrayType, BinaryType, BooleanType, DataType, DecimalType

from airflow_provider_pgdecode.batch.manifest import TableSummary
from airflow_provider_pgdecode.typemap import NUMERIC_SPECIAL_VALUES

FILL_PROPERTY = "pgdecode.fillMissing"
"""Table property: ``{column: missing value}`` of columns added to the Delta table whose rows
written before are still to be filled (set before the ``ADD COLUMNS``, removed after the fill)."""


def missing_values(entries: Iterable[TableSummary]) -> dict[str, Any]:
    """Per column, its missing value as the table's newest staged entry recorded it."""
    found: dict[str, Any] = {}
    for entry in entries:
        for column in entry.columns:
            if column.missing is not None:
                found[column.name] = column.missing
    return found


def sql_string(text: str) -> str:
    """A Spark SQL string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def sql_value(value: Any, data_type: DataType) -> str:
    """A missing value (JSON form of the staged value) as a Spark SQL expression of ``data_type``:
    what a staged row holding it becomes in Delta (numeric NaN/Infinity in a decimal: NULL)."""
    name = data_type.simpleString()
    if value is None:
        return f"CAST(NULL AS {name})"
    if isinstance(data_type, ArrayType):
        items = ", ".join(sql_value(item, data_type.elementType) for item in value)
        return f"CAST(array({items}) AS {name})"
    if isinstance(data_type, BinaryType):
        return f"unhex({sql_string(str(value))})"
    if isinstance(data_type, BooleanType):
        return "true" if value else "false"
    if isinstance(data_type, DecimalType) and str(value) in NUMERIC_SPECIAL_VALUES:
        return f"CAST(NULL AS {name})"
    if isinstance(value, float) and not math.isfinite(value):
        text = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
        return f"CAST({sql_string(text)} AS {name})"
    return f"CAST({sql_string(str(value))} AS {name})"


def pending_fill(properties: Mapping[str, str]) -> dict[str, Any]:
    """The columns a run recorded to fill and did not finish (:data:`FILL_PROPERTY`)."""
    recorded = properties.get(FILL_PROPERTY)
    return dict(json.loads(recorded)) if recorded else {}


def fill_statement(table_ref: str, assignments: Mapping[str, str]) -> str:
    """``UPDATE`` giving every row of the table the values (quoted column -> SQL expression)."""
    return f"UPDATE {table_ref} SET " + ", ".join(f"{column} = {value}" for column, value in assignments.items())
