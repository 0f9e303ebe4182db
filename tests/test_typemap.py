"""The type map: every entry checked against the staging converters, the Spark mapping and a
real PostgreSQL; the documented table checked against the generated one."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from psycopg import sql

from airflow_provider_pgdecode import typemap
from airflow_provider_pgdecode.batch.values import arrow_type, convert_column
from airflow_provider_pgdecode.decoding.pgoutput import BUILTIN_TYPE_NAMES
from airflow_provider_pgdecode.errors import UnmappedTypeError
from airflow_provider_pgdecode.spark.spark_types import map_catalog_type, staged_spark_types

REPO = Path(__file__).resolve().parents[1]

# The decoding session's formatting settings (postgres.slot pins the same).
SESSION = {
    "DateStyle": "ISO",
    "TimeZone": "UTC",
    "IntervalStyle": "postgres",
    "bytea_output": "hex",
    "extra_float_digits": "3",
}

# One literal of every type in the type map (input syntax of the type, as `'<literal>'::<type>`).
SAMPLES: dict[str, str] = {
    "smallint": "-32768",
    "integer": "2147483647",
    "bigint": "-9223372036854775808",
    "oid": "4294967295",
    "real": "1.17549435e-38",
    "double precision": "-1.7976931348623157e308",
    "numeric": "-12345678901234567890.123456789012345678",
    "boolean": "true",
    "date": "2024-02-29",
    "timestamp without time zone": "2024-01-02 03:04:05.123456",
    "timestamp with time zone": "2024-01-02 03:04:05.654321+05:30",
    "bytea": "\\x00ff10",
    "text": 'tëxt, with "quotes" and \\ backslash',
    "character varying": "vc",
    "character": "ab",
    '"char"': "x",
    "name": "pg_class",
    "citext": "MiXeD",
    "uuid": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
    "json": '{"a": [1, 2], "b": "c\\"d"}',
    "jsonb": '{"b": null}',
    "jsonpath": "$.a[*] ? (@ > 1)",
    "xml": "<a>b &amp; c</a>",
    "inet": "192.168.0.1/24",
    "cidr": "10.0.0.0/8",
    "macaddr": "08:00:2b:01:02:03",
    "macaddr8": "08:00:2b:01:02:03:04:05",
    "money": "1234.56",
    "interval": "1 year 2 mons 3 days 04:05:06.789",
    "time without time zone": "12:34:56.789",
    "time with time zone": "12:34:56+02",
    "bit": "1",
    "bit varying": "10110",
    "pg_lsn": "16/B374D848",
    "tsvector": "a fat:1 cat:2",
    "tsquery": "fat & rat",
    "txid_snapshot": "10:20:10,14,15",
    "pg_snapshot": "10:20:10,14,15",
    "xid": "12345",
    "xid8": "12345678901",
    "cid": "7",
    "tid": "(1,2)",
    "point": "(1,2)",
    "line": "{1,2,3}",
    "lseg": "[(0,0),(1,1)]",
    "path": "[(0,0),(1,1),(2,0)]",
    "polygon": "((0,0),(1,1),(1,0))",
    "circle": "<(1,2),3>",
    "box": "(1,1),(0,0)",
    "int4range": "[1,10)",
    "int8range": "(1,10]",
    "numrange": "[1.5,2.5]",
    "tsrange": "[2024-01-01 00:00,2024-02-01 00:00)",
    "tstzrange": "[2024-01-01 00:00+00,infinity)",
    "daterange": "[2024-01-01,2024-02-01)",
    "int4multirange": "{[1,3), [5,7)}",
    "int8multirange": "{[1,3)}",
    "nummultirange": "{[1.5,2.5]}",
    "tsmultirange": "{[2024-01-01 00:00,2024-02-01 00:00)}",
    "tstzmultirange": "{[2024-01-01 00:00+00,2024-02-01 00:00+00)}",
    "datemultirange": "{[2024-01-01,2024-02-01)}",
    "regclass": "pg_class",
    "regtype": "integer",
    "regproc": "now",
    "regprocedure": "abs(integer)",
    "regoper": "||/",
    "regoperator": "+(integer,integer)",
    "regconfig": "english",
    "regdictionary": "simple",
    "regnamespace": "pg_catalog",
    "regrole": "pg_monitor",
    "regcollation": "ucs_basic",
}


def _text_of(conn: psycopg.Connection[Any], expression: sql.Composable, *params: Any) -> Any:
    row = conn.execute(sql.SQL("SELECT {}").format(expression), params).fetchone()
    assert row is not None
    return row[0]


def _decoding_session(conn: psycopg.Connection[Any]) -> None:
    for name, value in SESSION.items():
        conn.execute(sql.SQL("SET {} = {}").format(sql.Identifier(name), sql.Literal(value)))


def test_every_type_has_a_sample() -> None:
    assert sorted(SAMPLES) == sorted(entry.name for entry in typemap.TYPES)


@pytest.fixture
def extension_types(pg_conn: psycopg.Connection[Any]) -> Iterator[None]:
    """citext is an extension's type: installed for the test, removed after (if it was not there)."""
    installed = pg_conn.execute("SELECT 1 FROM pg_extension WHERE extname = 'citext'").fetchone() is not None
    pg_conn.execute("CREATE EXTENSION IF NOT EXISTS citext")
    yield
    if not installed:
        pg_conn.execute("DROP EXTENSION IF EXISTS citext")


@pytest.mark.postgres
@pytest.mark.parametrize("entry", typemap.TYPES, ids=lambda e: e.name)
def test_type_map_entry(entry: typemap.PgType, pg_conn: psycopg.Connection[Any], extension_types: None) -> None:
    """One entry, all three columns: the staged Arrow type, the Delta type, and a value that a
    real PostgreSQL prints (under the decoding session's settings) staged as that Arrow type."""
    _decoding_session(pg_conn)
    array = entry.name + "[]"
    as_list = entry.array_delimiter == ","
    array_arrow = f"list<item: {entry.arrow}>" if as_list else typemap.TEXT
    array_delta = f"array<{entry.delta}>" if as_list else typemap.TEXT

    # Staged Arrow type: batch/values gives exactly the type map's (pyarrow's name is the manifest's `arrow`).
    for name in (entry.name, *entry.aliases):
        assert str(arrow_type(name)) == entry.arrow, name
        assert str(arrow_type(name + "[]")) == array_arrow, name
        assert typemap.staged_arrow_type(name) == entry.arrow

    # Delta type: spark/spark_types gives exactly the type map's, with its conversion kind; the merge
    # job expects the type staged as staging stages it.
    for name in (entry.name, *entry.aliases):
        column = map_catalog_type(name)
        assert column.delta_type.simpleString() == entry.delta, name
        assert column.kind == entry.kind
        assert column.staged_types == staged_spark_types(entry.arrow)
        column = map_catalog_type(name + "[]")
        assert column.delta_type.simpleString() == array_delta, name
        assert column.staged_types == staged_spark_types(array_arrow)
    assert typemap.resolve(entry.name).arrow == typemap.staged_arrow_type(entry.name)
    assert typemap.resolve(array).arrow == typemap.staged_arrow_type(array)

    # The name is format_type's spelling; each alias is PostgreSQL's name for the same type
    # (citext is an extension's, not a type name of its own).
    assert _text_of(pg_conn, sql.SQL("format_type(%s::regtype, NULL)"), entry.name) == entry.name
    for alias in entry.aliases:
        assert _text_of(pg_conn, sql.SQL("format_type(%s::regtype, NULL)"), alias) == entry.name, alias

    # A value printed by PostgreSQL converts to exactly that Arrow type, alone and in an array.
    literal = SAMPLES[entry.name]
    value = sql.SQL("%s::{}").format(sql.SQL(entry.name))
    text = _text_of(pg_conn, sql.SQL("{}::text").format(value), literal)
    staged = convert_column(entry.name, [text, None], f"sample.{entry.name}")
    assert staged.type == arrow_type(entry.name) == _pa(entry.arrow)
    assert staged.null_count == 1 and staged[0].is_valid, (text, staged)
    array_text = _text_of(pg_conn, sql.SQL("ARRAY[{}, NULL, {}]::text").format(value, value), literal, literal)
    staged = convert_column(array, [array_text, None], f"sample.{array}")
    assert staged.type == arrow_type(array) == _pa(array_arrow)
    assert staged.null_count == 1 and staged[0].is_valid
    if as_list:
        assert len(staged[0]) == 3 and staged[0][1].as_py() is None and staged[0][0] == staged[0][2]
        assert staged[0][0].as_py() == convert_column(entry.name, [text])[0].as_py()
    else:
        assert staged[0].as_py() == array_text


def _pa(name: str) -> pa.DataType:
    if name.startswith("list<item: "):
        return pa.list_(_pa(name[len("list<item: ") : -1]))
    return {
        str(t): t
        for t in (
            pa.int16(),
            pa.int32(),
            pa.int64(),
            pa.float32(),
            pa.float64(),
            pa.bool_(),
            pa.date32(),
            pa.timestamp("us"),
            pa.timestamp("us", tz="UTC"),
            pa.binary(),
            pa.string(),
        )
    }[name]


@pytest.mark.postgres
def test_builtin_type_names_of_the_decoding_core_are_mapped(pg_conn: psycopg.Connection[Any]) -> None:
    """pgoutput names built-in types by OID without asking the catalog: each of those names is
    format_type's, and the type map maps each: natively where it has an entry, else as the text
    PostgreSQL prints (point, tsquery, pg_lsn ...), arrays of them as arrays of that text."""
    rows = pg_conn.execute(
        "SELECT oid::int8, format_type(oid, NULL) FROM pg_type WHERE oid = ANY(%s)", (list(BUILTIN_TYPE_NAMES),)
    ).fetchall()
    assert dict(rows) == BUILTIN_TYPE_NAMES
    for name in BUILTIN_TYPE_NAMES.values():
        element = typemap.array_element(name)
        entry = typemap.find(element if element is not None else name)
        delta = map_catalog_type(name).delta_type.simpleString()
        if entry is None:
            assert delta in ("string", "array<string>"), (name, delta)


def test_rules() -> None:
    assert typemap.resolve("numeric(12,2)").delta == "decimal(12,2)"
    assert typemap.resolve("numeric(12,2)").kind == typemap.Kind.NUMERIC_TEXT
    assert typemap.resolve("numeric").unbounded and not typemap.resolve("numeric(12,2)").unbounded
    assert typemap.resolve("numeric", unbounded_numeric="string").delta == "string"
    assert typemap.resolve("numeric(5,-2)").delta == "decimal(7,0)"
    assert typemap.resolve("numeric(2,5)").delta == "decimal(5,5)"
    assert typemap.resolve("numeric(39,2)").delta == "string"
    assert typemap.resolve("character varying(20)").delta == "string"
    assert typemap.resolve("timestamp(3) without time zone").kind == typemap.Kind.TIMESTAMP_AS_UTC
    assert typemap.resolve("interval year to month").delta == "string"
    mapped = typemap.resolve("numeric(6,2)[]")
    assert (mapped.arrow, mapped.delta, mapped.kind) == ("list<item: string>", "array<decimal(6,2)>", "numeric")
    assert typemap.resolve("mood[]", user_type="enum").delta == "array<string>"
    assert typemap.resolve("mood", type_overrides={"mood": "string"}).delta == "string"
    # A type without a native mapping (an extension's, a user's) is its text, arrays of it too.
    assert typemap.resolve("mood[]").delta == "array<string>"
    assert (typemap.resolve("public.hstore").arrow, typemap.resolve("ltree").delta) == ("string", "string")
    with pytest.raises(UnmappedTypeError, match="can only map to 'string'"):
        typemap.resolve("mood", type_overrides={"mood": "int"})
    assert typemap.staged_arrow_type("mood") == typemap.staged_arrow_type('myschema."Odd"') == "string"
    assert typemap.staged_arrow_type("mood[]") == "list<item: string>"
    assert typemap.parse_unbounded_numeric_rule(" Decimal( 20 , 4 ) ") == "decimal(20,4)"
    with pytest.raises(ValueError):
        typemap.parse_unbounded_numeric_rule("decimal(40,2)")


def test_docs_table_is_generated_from_the_type_map() -> None:
    merge = (REPO / typemap.DOC_FILE).read_text(encoding="utf-8")
    assert typemap.doc_section(merge) == typemap.markdown_table(), (
        "docs/merge.md's type table is stale: run .venv/bin/python -m airflow_provider_pgdecode.typemap --update-docs"
    )
    staging = (REPO / "docs" / "staging-format.md").read_text(encoding="utf-8")
    assert "merge.md#type-mapping" in staging and "### Type mapping" in merge
    result = subprocess.run(
        [sys.executable, "-m", "airflow_provider_pgdecode.typemap", "--markdown"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout == typemap.markdown_table()


def test_typemap_imports_no_third_party_package() -> None:
    code = (
        "import json, sys; before = set(sys.modules); import airflow_provider_pgdecode.typemap; "
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    loaded = json.loads(result.stdout)
    ours = {m for m in loaded if m.split(".")[0] == "airflow_provider_pgdecode"}
    assert ours == {
        "airflow_provider_pgdecode",
        "airflow_provider_pgdecode.errors",
        "airflow_provider_pgdecode.typemap",
    }
    foreign = [m for m in loaded if m not in ours and m.split(".")[0] not in sys.stdlib_module_names]
    assert foreign == []
