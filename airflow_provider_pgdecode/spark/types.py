"""PostgreSQL catalog types to Spark/Delta types, and how staged values become Delta values.

The merge job creates each Delta table from the manifest's ``columns[].catalog_type`` (the
name ``format_type`` gives, e.g. ``numeric(10,2)``, ``timestamp with time zone``, ``text[]``).
The mapping is explicit: a type that is not listed here and not given in ``type_overrides``
is refused with an error naming the column, rather than guessed. docs/merge.md has the table.

Pure Python plus ``pyspark.sql.types``: importable without a running Spark.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

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

from airflow_provider_pgdecode.errors import PgDecodeError

SPARK_MAX_DECIMAL_PRECISION = 38
DEFAULT_UNBOUNDED_NUMERIC = "decimal(38,18)"
"""Delta type for ``numeric`` declared without precision (see :func:`parse_unbounded_numeric_rule`)."""

NUMERIC_SPECIAL_VALUES = ("NaN", "Infinity", "-Infinity")
"""Values PostgreSQL's numeric can hold and a Spark decimal cannot; staged as this text."""


class UnmappedTypeError(PgDecodeError):
    """A source column's catalog type has no mapping to a Delta type."""


class _Kind:
    """How a staged value is converted to its Delta type."""

    PLAIN = "plain"  # staged already in the Delta type (or a cast without loss)
    NUMERIC = "numeric"  # staged decimal text; NaN/Infinity possible
    TIMESTAMP_AS_UTC = "timestamp_as_utc"  # staged timestamp without zone; kept as UTC


@dataclass(frozen=True)
class ColumnType:
    """The mapping of one catalog type.

    ``delta_type`` is the column's type in Delta. ``staged_type`` is the Spark type the staged
    Parquet column reads as (``None`` when several are acceptable, e.g. timestamps). ``kind``
    selects the conversion (:class:`_Kind`). ``element`` is set for arrays.
    """

    catalog_type: str
    delta_type: DataType
    staged_types: tuple[DataType, ...]
    kind: str = _Kind.PLAIN
    element: ColumnType | None = None
    unbounded: bool = False
    """``numeric`` without precision: values may have digits the mapped decimal cannot hold."""

    @property
    def is_numeric_text(self) -> bool:
        """True when staged numeric text is cast to a decimal (NaN/Infinity need handling)."""
        base = self.element if self.element is not None else self
        return base.kind == _Kind.NUMERIC and isinstance(base.delta_type, DecimalType)

    @property
    def may_lose_digits(self) -> bool:
        """True for unbounded numeric mapped to a decimal: values must be checked to fit."""
        base = self.element if self.element is not None else self
        return base.unbounded and self.is_numeric_text


_STRING_TYPES: frozenset[str] = frozenset(
    {
        "text", "character varying", "varchar", "character", "char", "bpchar", '"char"', "name",
        "citext", "uuid", "json", "jsonb", "jsonpath", "xml", "money", "inet", "cidr", "macaddr",
        "macaddr8", "interval", "time without time zone", "time with time zone", "time", "timetz",
        "bit", "bit varying", "varbit", "pg_lsn", "tsvector", "tsquery", "txid_snapshot",
        "pg_snapshot", "point", "line", "lseg", "box", "path", "polygon", "circle", "int4range",
        "int8range", "numrange", "tsrange", "tstzrange", "daterange", "int4multirange",
        "int8multirange", "nummultirange", "tsmultirange", "tstzmultirange", "datemultirange",
        "regclass", "regtype", "regproc", "regprocedure", "regoper", "regoperator", "regconfig",
        "regdictionary", "regnamespace", "regrole", "regcollation", "xid", "xid8", "cid", "tid",
    }
)
"""Types staged as the text PostgreSQL printed, kept as Delta ``string``."""

_INTEGER_TYPES: dict[str, tuple[DataType, DataType]] = {
    # catalog name -> (delta type, staged type)
    "smallint": (ShortType(), ShortType()),
    "int2": (ShortType(), ShortType()),
    "integer": (IntegerType(), IntegerType()),
    "int": (IntegerType(), IntegerType()),
    "int4": (IntegerType(), IntegerType()),
    "bigint": (LongType(), LongType()),
    "int8": (LongType(), LongType()),
    "oid": (LongType(), LongType()),
}

_FLOAT_TYPES: dict[str, DataType] = {
    "real": FloatType(),
    "float4": FloatType(),
    "double precision": DoubleType(),
    "float8": DoubleType(),
}

# Modifiers PostgreSQL prints inside a type name: varchar(20), bit(8), time(3) with time zone,
# timestamp(6) without time zone, interval(3), interval year to month.
_TYPMOD = re.compile(r"\(\s*\d+\s*(?:,\s*-?\d+\s*)?\)")
_NUMERIC = re.compile(r"^(?:numeric|decimal)(?:\(\s*(\d+)\s*(?:,\s*(-?\d+)\s*)?\))?$")
_DECIMAL_RULE = re.compile(r"^decimal\(\s*(\d+)\s*,\s*(\d+)\s*\)$")


def parse_unbounded_numeric_rule(rule: str) -> DataType:
    """The Delta type for unbounded ``numeric``: ``decimal(P,S)`` (P ≤ 38) or ``string``."""
    text = rule.strip().lower()
    if text == "string":
        return StringType()
    match = _DECIMAL_RULE.match(text)
    if match:
        precision, scale = int(match.group(1)), int(match.group(2))
        if 1 <= precision <= SPARK_MAX_DECIMAL_PRECISION and scale <= precision:
            return DecimalType(precision, scale)
    raise ValueError(
        f"unbounded numeric rule must be 'string' or 'decimal(P,S)' with 1 <= P <= 38 and S <= P: {rule!r}"
    )


def numeric_delta_type(precision: int | None, scale: int | None, unbounded: DataType) -> DataType:
    """Delta type of ``numeric(precision, scale)``.

    ``numeric`` without precision takes ``unbounded``; ``numeric(p)`` is ``numeric(p,0)``.
    A negative scale (PostgreSQL 15+: rounds to tens, hundreds...) widens to
    ``decimal(p - scale, 0)``; a scale above the precision gives ``decimal(scale, scale)``.
    Precision above 38 (Spark's limit) is kept exactly as ``string``.
    """
    if precision is None:
        return unbounded
    scale = scale or 0
    if scale < 0:
        precision, scale = precision - scale, 0
    elif scale > precision:
        precision = scale
    if precision > SPARK_MAX_DECIMAL_PRECISION:
        return StringType()
    return DecimalType(precision, scale)


def _strip_modifiers(name: str) -> str:
    return re.sub(r"\s+", " ", _TYPMOD.sub("", name)).strip()


def map_catalog_type(
    catalog_type: str,
    *,
    unbounded_numeric: DataType | None = None,
    type_overrides: Mapping[str, str] | None = None,
) -> ColumnType:
    """Map one catalog type name to its :class:`ColumnType`, or raise :class:`UnmappedTypeError`.

    ``type_overrides`` maps a catalog type name (as the manifest spells it, without ``[]``) to
    a Spark SQL type name; it is how user-defined types such as enums and domains are mapped
    (``{"mood": "string"}``). Overrides are allowed only for types staged as text.
    """
    unbounded = unbounded_numeric if unbounded_numeric is not None else parse_unbounded_numeric_rule(
        DEFAULT_UNBOUNDED_NUMERIC
    )
    text = catalog_type.strip()
    if text.endswith("[]"):
        element_name = text[:-2]
        while element_name.endswith("[]"):  # format_type prints one [] for any dimension count
            element_name = element_name[:-2]
        element = map_catalog_type(element_name, unbounded_numeric=unbounded, type_overrides=type_overrides)
        if element.element is not None:  # pragma: no cover - stripped above
            raise UnmappedTypeError(f"nested array type {catalog_type!r} has no mapping")
        return ColumnType(
            catalog_type=catalog_type,
            delta_type=ArrayType(element.delta_type, True),
            staged_types=tuple(ArrayType(t, True) for t in element.staged_types),
            kind=element.kind,
            element=element,
        )

    overrides = type_overrides or {}
    if text in overrides:
        if overrides[text].strip().lower() != "string":
            raise UnmappedTypeError(
                f"type override {text!r} -> {overrides[text]!r}: a user-defined type is staged as the text "
                f"PostgreSQL printed and can only map to 'string'"
            )
        return ColumnType(catalog_type, StringType(), (StringType(),))

    lowered = text.lower()
    if lowered in _INTEGER_TYPES:
        delta_type, staged = _INTEGER_TYPES[lowered]
        return ColumnType(catalog_type, delta_type, (staged,))
    if lowered in _FLOAT_TYPES:
        delta_type = _FLOAT_TYPES[lowered]
        return ColumnType(catalog_type, delta_type, (delta_type,))
    numeric = _NUMERIC.match(lowered.replace(" ", ""))
    if numeric:
        precision = int(numeric.group(1)) if numeric.group(1) else None
        scale = int(numeric.group(2)) if numeric.group(2) else None
        delta_type = numeric_delta_type(precision, scale, unbounded)
        return ColumnType(
            catalog_type, delta_type, (StringType(),), kind=_Kind.NUMERIC, unbounded=precision is None
        )
    if lowered in ("boolean", "bool"):
        return ColumnType(catalog_type, BooleanType(), (BooleanType(),))
    if lowered == "date":
        return ColumnType(catalog_type, DateType(), (DateType(),))
    if lowered == "bytea":
        return ColumnType(catalog_type, BinaryType(), (BinaryType(),))
    base = _strip_modifiers(lowered)
    if base in ("timestamp with time zone", "timestamptz"):
        return ColumnType(catalog_type, TimestampType(), (TimestampType(),))
    if base in ("timestamp without time zone", "timestamp"):
        return ColumnType(
            catalog_type, TimestampType(), (TimestampNTZType(), TimestampType()), kind=_Kind.TIMESTAMP_AS_UTC
        )
    if base in _STRING_TYPES or base.startswith("interval"):
        return ColumnType(catalog_type, StringType(), (StringType(),))
    raise UnmappedTypeError(
        f"catalog type {catalog_type!r} has no Delta mapping. If it is an enum, a domain over text or "
        f"another type PostgreSQL prints as text, map it with a type override "
        f"(--type-map '{text}=string'); otherwise it is not supported (docs/merge.md lists the mapping)."
    )


def staged_type_matches(column_type: ColumnType, staged: DataType) -> bool:
    """True when a staged Parquet column read as ``staged`` is what ``column_type`` expects."""
    return any(staged == expected for expected in column_type.staged_types)


def delta_type_sql(data_type: DataType) -> str:
    """Spark SQL spelling of a Delta column type (for ALTER TABLE and messages)."""
    return data_type.simpleString()
