"""PostgreSQL catalog types to Spark/Delta types, and how staged values become Delta values.

The merge job creates each Delta table from the manifest's ``columns[].catalog_type`` (the
name ``format_type`` gives, e.g. ``numeric(10,2)``, ``timestamp with time zone``, ``text[]``).
Every decision — which Delta type, which staged Arrow type, which conversion, what is refused —
is :mod:`airflow_provider_pgdecode.typemap`'s (docs/merge.md has its table). This module only
turns its type names into ``pyspark.sql.types`` objects: the Delta type string into a
:class:`DataType`, and the staged Arrow type into the Spark type(s) Spark reads it as.

Pure Python plus ``pyspark.sql.types``: importable without a running Spark.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    TimestampNTZType,
    TimestampType,
)

from airflow_provider_pgdecode import typemap
from airflow_provider_pgdecode.typemap import (
    DEFAULT_UNBOUNDED_NUMERIC,
    NUMERIC_SPECIAL_VALUES,
    SPARK_MAX_DECIMAL_PRECISION,
    Kind,
)

if TYPE_CHECKING:
    import pyarrow as pa


@dataclass(frozen=True)
class ColumnType:
    """The mapping of one catalog type.

    ``delta_type`` is the column's type in Delta. ``staged_types`` are the Spark types the
    staged Parquet column may read as (several for timestamps without zone). ``kind`` selects
    the conversion (:class:`airflow_provider_pgdecode.typemap.Kind`). ``element`` is set for arrays.
    """

    catalog_type: str
    delta_type: DataType
    staged_types: tuple[DataType, ...]
    kind: str = Kind.PLAIN
    element: ColumnType | None = None
    unbounded: bool = False
    """``numeric`` without precision: values may have digits the mapped decimal cannot hold."""

    @property
    def is_numeric_text(self) -> bool:
        """True when staged numeric text is cast to a decimal (NaN/Infinity need handling)."""
        base = self.element if self.element is not None else self
        return base.kind == Kind.NUMERIC_TEXT and isinstance(base.delta_type, DecimalType)

    @property
    def may_lose_digits(self) -> bool:
        """True for unbounded numeric mapped to a decimal: values must be checked to fit."""
        base = self.element if self.element is not None else self
        return base.unbounded and self.is_numeric_text


# Delta (Spark SQL) type names the type map uses, as DataType.simpleString() spells them.
_SPARK_TYPES: dict[str, DataType] = {
    t.simpleString(): t
    for t in (
        ShortType(),
        IntegerType(),
        LongType(),
        FloatType(),
        DoubleType(),
        BooleanType(),
        DateType(),
        TimestampType(),
        TimestampNTZType(),
        BinaryType(),
        StringType(),
    )
}
_DECIMAL = re.compile(r"^decimal\((\d+),(\d+)\)$")

# How Spark reads each staged Arrow type from Parquet. A timestamp without zone reads as
# timestamp_ntz or, depending on the reader's settings, as timestamp.
_SPARK_READS: dict[str, tuple[DataType, ...]] = {
    "int16": (ShortType(),),
    "int32": (IntegerType(),),
    "int64": (LongType(),),
    "float": (FloatType(),),
    "double": (DoubleType(),),
    "bool": (BooleanType(),),
    "date32[day]": (DateType(),),
    "timestamp[us]": (TimestampNTZType(), TimestampType()),
    "timestamp[us, tz=UTC]": (TimestampType(),),
    "binary": (BinaryType(),),
    "string": (StringType(),),
}
_LIST_PREFIX = "list<item: "
_ARROW_DECIMAL = re.compile(r"^decimal128\((\d+), ?(\d+)\)$")


def spark_type(delta_type: str) -> DataType:
    """The :class:`DataType` of a Delta type name the type map produces (``int``,
    ``decimal(10,2)``, ``array<string>`` ...). No Spark session needed."""
    text = delta_type.strip().lower()
    if text.startswith("array<") and text.endswith(">"):
        return ArrayType(spark_type(text[len("array<") : -1]), True)
    match = _DECIMAL.match(text.replace(" ", ""))
    if match:
        return DecimalType(int(match.group(1)), int(match.group(2)))
    try:
        return _SPARK_TYPES[text]
    except KeyError:
        raise ValueError(f"{delta_type!r} is not a Delta type the type map produces") from None


def staged_spark_types(arrow: str) -> tuple[DataType, ...]:
    """The Spark types a staged Parquet column of Arrow type ``arrow`` may read as."""
    if arrow.startswith(_LIST_PREFIX) and arrow.endswith(">"):
        return tuple(ArrayType(t, True) for t in staged_spark_types(arrow[len(_LIST_PREFIX) : -1]))
    match = _ARROW_DECIMAL.match(arrow)
    if match:  # a snapshot's bounded numeric, staged with its Delta type
        return (DecimalType(int(match.group(1)), int(match.group(2))),)
    try:
        return _SPARK_READS[arrow]
    except KeyError:
        raise ValueError(f"{arrow!r} is not an Arrow type the type map uses") from None


def parse_unbounded_numeric_rule(rule: str) -> DataType:
    """The Delta type for unbounded ``numeric``: ``decimal(P,S)`` (P ≤ 38) or ``string``."""
    return spark_type(typemap.parse_unbounded_numeric_rule(rule))


def numeric_delta_type(precision: int | None, scale: int | None, unbounded: DataType) -> DataType:
    """Delta type of ``numeric(precision, scale)`` (:func:`airflow_provider_pgdecode.typemap.numeric_delta_type`).

    ``numeric`` without precision takes ``unbounded``; ``numeric(p)`` is ``numeric(p,0)``.
    A negative scale (PostgreSQL 15+: rounds to tens, hundreds...) widens to
    ``decimal(p - scale, 0)``; a scale above the precision gives ``decimal(scale, scale)``.
    Precision above 38 (Spark's limit) is kept exactly as ``string``.
    """
    if precision is None:
        return unbounded
    return spark_type(typemap.numeric_delta_type(precision, scale, delta_type_sql(unbounded)))


def _column_type(mapping: typemap.ColumnMapping) -> ColumnType:
    return ColumnType(
        catalog_type=mapping.catalog_type,
        delta_type=spark_type(mapping.delta),
        staged_types=staged_spark_types(mapping.arrow),
        kind=mapping.kind,
        element=_column_type(mapping.element) if mapping.element is not None else None,
        unbounded=mapping.unbounded,
    )


def map_catalog_type(
    catalog_type: str,
    *,
    unbounded_numeric: DataType | None = None,
    type_overrides: Mapping[str, str] | None = None,
    user_type: str | None = None,
    arrays: str = typemap.ARRAYS_AS_LIST,
) -> ColumnType:
    """Map one catalog type name to its :class:`ColumnType`, or raise :class:`UnmappedTypeError`.

    ``type_overrides`` maps a catalog type name (as the manifest spells it, without ``[]``) to
    a Spark SQL type name; it is how user-defined types such as enums and domains are mapped
    (``{"mood": "string"}``). Overrides are allowed only for types staged as text.
    ``user_type`` (the manifest's) maps a user-defined type to ``string`` unless overridden.
    The rules are :func:`airflow_provider_pgdecode.typemap.resolve`.
    """
    rule = delta_type_sql(unbounded_numeric) if unbounded_numeric is not None else DEFAULT_UNBOUNDED_NUMERIC
    return _column_type(
        typemap.resolve(
            catalog_type, unbounded_numeric=rule, type_overrides=type_overrides, user_type=user_type, arrays=arrays
        )
    )


def staged_type_matches(column_type: ColumnType, staged: DataType) -> bool:
    """True when a staged Parquet column read as ``staged`` is what ``column_type`` expects: one
    of its staged types, or, for a numeric staged as text elsewhere, its Delta decimal itself (a
    snapshot stages bounded numeric so, capture/snapshot.py)."""
    if column_type.is_numeric_text and column_type.element is None and staged == column_type.delta_type:
        return True
    return any(staged == expected for expected in column_type.staged_types)


def delta_ready(column_type: ColumnType, arrow: str) -> bool:
    """True when a column staged as Arrow type ``arrow`` (the manifest's) reads in Spark exactly
    as its Delta type, so a staged part can be committed into the Delta table as it is."""
    try:
        reads = staged_spark_types(arrow)
    except ValueError:
        return False
    return reads[0] == column_type.delta_type


def wall_clock_as_utc(kind: pa.DataType, column_type: ColumnType) -> pa.DataType | None:
    """For a ``timestamp without time zone`` (or an array of them) staged as Arrow's zoneless
    microseconds and kept in Delta as a ``timestamp``: the same microseconds as UTC, which is what
    Spark's cast gives in pgdecode's sessions (time zone UTC: the wall-clock time read as UTC).
    ``None`` for any other column."""
    import pyarrow as pa

    naive = pa.timestamp("us")
    utc = pa.timestamp("us", tz="UTC")
    target = column_type.delta_type
    if kind.equals(naive) and isinstance(target, TimestampType):
        return utc
    is_list = pa.types.is_list(kind) and kind.value_type.equals(naive)
    if is_list and isinstance(target, ArrayType) and isinstance(target.elementType, TimestampType):
        return pa.list_(pa.field("item", utc))
    return None


#: Integral types by width, with the decimal digits each needs (Delta's minimum decimal target).
_INTEGRAL_DIGITS: tuple[tuple[type[DataType], int], ...] = ((ShortType, 5), (IntegerType, 10), (LongType, 20))


def _integral_rank(data_type: DataType) -> int | None:
    for rank, (kind, _) in enumerate(_INTEGRAL_DIGITS):
        if type(data_type) is kind:
            return rank
    return None


def widens(old: DataType, new: DataType) -> bool:
    """True when Delta's type widening (Delta 4.0 and later) changes a column of type ``old`` to
    ``new`` in place, without rewriting data: a wider integer; ``int`` or narrower to ``double``;
    an integer to a decimal with room for all its digits; ``float`` to ``double``; a decimal to
    one with at least as many more digits as more scale (``decimal(p,s)`` to
    ``decimal(p+k1,s+k2)``, ``k1 >= k2 >= 0``). The same type is no widening."""
    if old == new:
        return False
    rank = _integral_rank(old)
    if rank is not None:
        new_rank = _integral_rank(new)
        if new_rank is not None:
            return new_rank > rank
        if isinstance(new, DoubleType):
            return not isinstance(old, LongType)  # a double holds every int, not every bigint
        digits = _INTEGRAL_DIGITS[rank][1]
        return isinstance(new, DecimalType) and new.precision - new.scale >= digits
    if isinstance(old, FloatType):
        return isinstance(new, DoubleType)
    if isinstance(old, DecimalType) and isinstance(new, DecimalType):
        more_digits, more_scale = new.precision - old.precision, new.scale - old.scale
        return more_digits >= more_scale >= 0
    return False


def prints_as_its_text(staged: DataType, delta: DataType) -> bool:
    """True when a value staged as ``staged``, cast to Delta's ``string``, reads as PostgreSQL
    converts it to text whatever the session's settings: an integer (its digits) or a boolean
    (``true``/``false``, as ``boolean::text``). So rows staged while a column was an integer or a
    boolean merge into the string column it became again (``ALTER ... TYPE text``, a column
    changed back), as PostgreSQL converted its own rows."""
    return isinstance(delta, StringType) and (_integral_rank(staged) is not None or isinstance(staged, BooleanType))


def delta_type_sql(data_type: DataType) -> str:
    """Spark SQL spelling of a Delta column type (for ALTER TABLE and messages)."""
    return data_type.simpleString()


__all__ = [
    "DEFAULT_UNBOUNDED_NUMERIC",
    "NUMERIC_SPECIAL_VALUES",
    "SPARK_MAX_DECIMAL_PRECISION",
    "ColumnType",
    "delta_ready",
    "delta_type_sql",
    "map_catalog_type",
    "numeric_delta_type",
    "parse_unbounded_numeric_rule",
    "spark_type",
    "staged_spark_types",
    "staged_type_matches",
    "widens",
]
