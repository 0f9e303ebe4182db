from __future__ import annotations

import math
from datetime import UTC, date, datetime

import pyarrow as pa
import pytest

from airflow_provider_pgdecode.batch.values import arrow_type, convert_column, parse_array_literal, python_value
from airflow_provider_pgdecode.errors import ValueConversionError


@pytest.mark.parametrize(
    "pg_type, arrow",
    [
        ("smallint", pa.int16()),
        ("integer", pa.int32()),
        ("bigint", pa.int64()),
        ("double precision", pa.float64()),
        ("real", pa.float32()),
        ("numeric", pa.string()),
        ("boolean", pa.bool_()),
        ("date", pa.date32()),
        ("timestamp with time zone", pa.timestamp("us", tz="UTC")),
        ("timestamp without time zone", pa.timestamp("us")),
        ("bytea", pa.binary()),
        ("uuid", pa.string()),
        ("jsonb", pa.string()),
        ("mood", pa.string()),
        ("integer[]", pa.list_(pa.int32())),
        ("text[]", pa.list_(pa.string())),
        ("box[]", pa.string()),
    ],
)
def test_arrow_type_mapping(pg_type: str, arrow: pa.DataType) -> None:
    assert arrow_type(pg_type) == arrow
    assert convert_column(pg_type, [None]).type == arrow


def test_scalar_conversions() -> None:
    assert python_value("bigint", "-9223372036854775808") == -(2**63)
    assert python_value("numeric", "1.50") == "1.50"
    assert math.isnan(python_value("double precision", "NaN"))
    assert python_value("real", "-Infinity") == -math.inf
    assert python_value("double precision", "1.5e+20") == 1.5e20
    assert [python_value("boolean", v) for v in ("true", "t", "false", "f")] == [True, True, False, False]
    assert python_value("date", "2024-02-29") == date(2024, 2, 29)
    assert python_value("timestamp with time zone", "2024-01-02 03:04:05.5+00") == datetime(
        2024, 1, 2, 3, 4, 5, 500000, tzinfo=UTC
    )
    assert python_value("timestamp without time zone", "1999-12-31 23:59:59") == datetime(1999, 12, 31, 23, 59, 59)
    assert python_value("bytea", "\\x00ff") == b"\x00\xff"
    assert python_value("uuid", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11") == "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"


def test_infinite_dates_are_clamped() -> None:
    assert python_value("date", "infinity") == date(9999, 12, 31)
    assert python_value("timestamp with time zone", "-infinity") == datetime(1, 1, 1, tzinfo=UTC)


def test_arrays() -> None:
    assert parse_array_literal('{"a b","c,d","e\\"f",NULL,"null","back\\\\slash"}') == [
        "a b",
        "c,d",
        'e"f',
        None,
        "null",
        "back\\slash",
    ]
    assert parse_array_literal("{}") == []
    assert parse_array_literal("[0:1]={1,2}") == ["1", "2"]
    assert python_value("integer[]", "{1,NULL,3}") == [1, None, 3]
    assert python_value("boolean[]", "{t,f}") == [True, False]
    assert python_value("bytea[]", '{"\\\\x00ff"}') == [b"\x00\xff"]
    assert convert_column("text[]", ["{a}", None, "{}"]).to_pylist() == [["a"], None, []]


@pytest.mark.parametrize(
    "texts",
    [
        ["t", None, "f", "f"],  # pgoutput
        ["true", None, "false", "false"],  # test_decoding
        ["t", None, "false", "f"],  # both: the general check
    ],
)
def test_boolean_columns_as_either_plugin_prints_them(texts: list[str | None]) -> None:
    column = convert_column("boolean", texts)
    assert column.type == pa.bool_() and column.to_pylist() == [True, None, False, False]
    assert convert_column("boolean", [None, None]).type == pa.bool_()
    with pytest.raises(ValueConversionError, match="cannot convert 'T'"):
        convert_column("boolean", [*texts, "T"])


@pytest.mark.parametrize(
    "pg_type, value, message",
    [
        ("integer", "abc", "cannot convert 'abc'"),
        ("boolean", "maybe", "cannot convert 'maybe'"),
        ("date", "0044-03-15 BC", "before year 1"),
        ("integer[]", "{{1,2},{3,4}}", "multi-dimensional"),
        ("text[]", "not an array", "malformed array"),
        ("bytea", "plain", "hex"),
    ],
)
def test_bad_values_are_named(pg_type: str, value: str, message: str) -> None:
    with pytest.raises(ValueConversionError, match=message) as info:
        convert_column(pg_type, ["1" if pg_type == "integer" else None, value], "public.t.c")
    assert "public.t.c" in str(info.value)


def test_a_table_type_map_stages_its_types_as_the_text_postgresql_printed() -> None:
    from airflow_provider_pgdecode.typemap import Staging, type_key

    kept = Staging(text_types=frozenset({type_key("numeric"), type_key("timestamptz")}))
    assert arrow_type("timestamp with time zone", kept) == pa.string()
    assert arrow_type("numeric(10,2)[]", kept) == pa.list_(pa.string())
    assert arrow_type("integer", kept) == pa.int32()
    stamps = convert_column("timestamp with time zone", ["infinity", "2024-01-02 03:04:05+00", None], staging=kept)
    assert stamps.to_pylist() == ["infinity", "2024-01-02 03:04:05+00", None]
    amounts = convert_column("numeric[]", ['{NaN,1.50,"-Infinity"}', None], staging=kept)
    assert amounts.to_pylist() == [["NaN", "1.50", "-Infinity"], None]
    as_json = convert_column("numeric[]", ["{{NaN,1.50},{2,3}}"], staging=Staging("json", kept.text_types))
    assert as_json.to_pylist() == ['[["NaN","1.50"],["2","3"]]']
