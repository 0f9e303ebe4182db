"""The type gauntlet (issue 35): every type a column of the server can have, with edge values,
through both plugins into Delta, equal to PostgreSQL as a multiset after every merge.

The types are not a hand list: they are read from the server's ``pg_type`` (every defined base,
range and multirange type below OID 10000, pseudo-types aside: scalars and arrays, including the
arrays of the catalogs' row types) and from the extensions of Debian's ``postgresql-contrib`` the
server has (their base types, domains, composite types). A type found there without edge values
here fails the test; so does a type PostgreSQL refuses as a column type unless it is one of
:data:`EXCLUDED` (checked by trying ``CREATE TABLE``), and a type listed in :data:`NO_VALUE`
whose input function accepts a value. Type modifiers (:data:`MODIFIED`) come on top.

One wide table keyed by an ``int`` id: one row per edge value (each column cycles through its
type's edge values, NULL included), every row then updated once to the next edge value (under
REPLICA IDENTITY FULL: the old row of every type is logged too), then a third of the rows deleted
(under DEFAULT: the key only). A few large values stored out of line are never updated
(:data:`UNCHANGED`): both plugins send the TOAST placeholder for them. Each phase is extracted
from the plugin's slot (the Python and the native writer staging the same batch), merged into
Delta on the ``spark`` fixture, and the Delta table is compared with PostgreSQL as a multiset of
rows (read through delta-rs, another Delta reader, which also reads 0001-01-01 00:00 where
PySpark's collect cannot):

* a column the type map keeps as ``string`` against PostgreSQL's text output of the value (the
  type's output function, as ``psql`` shows it and both plugins send it, not ``c::text``, which
  differs for ``inet``, ``xml``, ``boolean`` and ``character``), under the decoding session's
  pinned formatting settings;
* a column with a native Delta type against the value PostgreSQL printed, converted by
  :func:`expected`: the documented lossy mappings (docs/merge.md, "Type mapping") are written
  out there, not hidden;
* arrays element by element, the same way; and the Delta type of every column is the type map's.

The initial load's snapshot of the table after the INSERT (COPY's text, other converters) lands
equal too. Values docs/merge.md lists as ones the pipeline cannot carry (dates and timestamps BC
or past 9999, multi-dimensional arrays in list mode, infinite keys) are not edge values here: the
extract refuses or quarantines them by design (tests/capture/test_bad_values.py,
tests/spark/test_bad_values.py, tests/spark/test_type_map.py).
"""

from __future__ import annotations

import math
import re
import struct
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from decimal import Context, Decimal
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from deltalake import DeltaTable, QueryBuilder
from psycopg import sql
from psycopg.conninfo import make_conninfo

from airflow_provider_pgdecode import typemap
from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.native import load_native
from airflow_provider_pgdecode.capture.snapshot import create_slot_with_snapshot, stage_snapshot
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.postgres.session import pin_settings
from airflow_provider_pgdecode.spark.merge_job import merge_batches
from pgdecode_testing.compare import output_text, output_texts
from tests.capture.test_native import assert_same_batches
from tests.conftest import FULL_TESTS, full_only

pytestmark = [pytest.mark.postgres, pytest.mark.spark]

DATABASE = "pgdecode_gauntlet"
TABLE = "gauntlet_types"
"""One wide table (measured: split in two narrower ones, each merge took longer)."""
PUBLICATION = "gauntlet_pub"

# --- the types ----------------------------------------------------------------------------------

DEBIAN_CONTRIB = (
    "adminpack amcheck autoinc bloom btree_gin btree_gist citext cube dblink dict_int dict_xsyn earthdistance "
    "file_fdw fuzzystrmatch hstore insert_username intagg intarray isn lo ltree moddatetime old_snapshot pageinspect "
    "pg_buffercache pg_freespacemap pg_prewarm pg_stat_statements pg_surgery pg_trgm pg_visibility pg_walinspect "
    "pgcrypto pgrowlocks pgstattuple plpgsql postgres_fdw refint seg sslinfo tablefunc tcn tsm_system_rows "
    "tsm_system_time unaccent uuid-ossp xml2"
).split()
"""The extensions of Debian's postgresql-contrib-15 (/usr/share/postgresql/15/extension/*.control);
each one the server under test has is created, and every type it defines is in the gauntlet."""

EXCLUDED = {
    "cstring[]": "its element cstring is a pseudo-type: CREATE TABLE refuses a column of it",
    "pg_attribute[]": "pg_attribute's row has attmissingval of the pseudo-type anyarray: CREATE TABLE refuses it",
}
"""Types of ``pg_type`` a table column cannot have (the test checks CREATE TABLE refuses each, and
accepts every other type)."""

NO_VALUE = (
    "gtsvector",
    "pg_brin_bloom_summary",
    "pg_brin_minmax_multi_summary",
    # contrib: GiST/index key types
    "gbtreekey2",
    "gbtreekey4",
    "gbtreekey8",
    "gbtreekey16",
    "gbtreekey32",
    "gbtreekey_var",
    "ghstore",
    "gtrgm",
    "intbig_gkey",
    "ltree_gist",
)
"""Types whose input function refuses every value ("cannot accept a value of type ...", checked)
and whose values exist only inside index pages, out of SQL's reach: their columns hold NULL, and
their arrays NULL, ``{}`` and ``{NULL}``."""

BIG_TEXT = "repeat('ü→x', 100000)"
"""600 kB of UTF-8: stored out of line (TOAST), printed whole by both plugins."""


@dataclass(frozen=True)
class Since:
    """An edge value the server accepts from PostgreSQL ``major`` on."""

    major: int
    expr: str


EDGES: dict[str, tuple[str | Since, ...]] = {
    # numbers
    "smallint": ("-32768", "32767", "0"),
    "integer": ("-2147483648", "2147483647", "0"),
    "bigint": ("-9223372036854775808", "9223372036854775807", "0"),
    "oid": ("0", "4294967295"),
    "real": (
        "'NaN'",
        "'Infinity'",
        "'-Infinity'",
        "'-0'",
        "'3.4028235e+38'",
        "'1.4e-45'",
        "'-1.17549435e-38'",
        "'0.1'",
    ),
    "double precision": (
        "'NaN'",
        "'Infinity'",
        "'-Infinity'",
        "'-0'",
        "'1.7976931348623157e+308'",
        "'4.9e-324'",
        "0.1",
    ),
    "numeric": (
        "'NaN'",
        "'Infinity'",
        "'-Infinity'",
        "'99999999999999999999.999999999999999999'",
        "'-99999999999999999999.999999999999999999'",
        "'0.000000000000000001'",
        "'-0.0'",
        "'1.50000000000000000000000000000'",
        "'1e19'",
    ),
    "money": ("'-92233720368547758.08'", "'92233720368547758.07'", "'0'", "'0.01'"),
    "boolean": ("true", "false"),
    # bytes and text
    "bytea": ("'\\x'", "'\\x00'", "'\\x00ff00'", "decode(repeat('00ff', 100000), 'hex')", "convert_to('ü', 'UTF8')"),
    '"char"': ("'a'", "''", "'\\377'", "'ü'", "'\"'", "','"),
    "name": ("''", "repeat('n', 63)", "'ünï \"q\" ''a'''", "'{a,b}'"),
    "text": (
        "''",
        "E'tab\\there\\nnewline \\\\ backslash \"quote\" ''apos'''",
        "'ünïcödé 𝄞 中文 😀'",
        BIG_TEXT,
        "'NULL'",
        "' spaces '",
        "'{a,\"b\"}'",
        "E'\\r\\n\\x01\\x7f'",
        "'x'' c_text[text]:''y'' id[integer]:1 old-key: '''",  # test_decoding's own syntax inside a value
    ),
    "character varying": ("''", "'ü𝄞'", "' x '", "'NULL'", BIG_TEXT),
    "character": ("''", "'ab  '", "' ü'", "'NULL'"),
    "refcursor": ("''", "'cur ü'"),
    "json": ("'{}'", "'[]'", "'null'", "'\"ü\"'", '\' { "a" : [1, 2.5e10, null, true], "a": "\\u0000" } \''),
    "jsonb": (
        "'{}'",
        "'[]'",
        "'null'",
        '\'{"ü": "😀", "b": [true, false, null, -0.0]}\'',
        "'1e400'",
        "'12345678901234567890.1234567890123456789'",
    ),
    "jsonpath": (
        "'$'",
        '\'strict $.a[*] ? (@ > 1 && @ like_regex "ü" flag "i")\'',
        "'$.\"key with space\".datetime()'",
    ),
    "xml": ("'<a>ü</a>'", "''", "'<?xml version=\"1.0\"?><r/>'", "'text &amp; more'"),
    "uuid": (
        "'00000000-0000-0000-0000-000000000000'",
        "'ffffffff-ffff-ffff-ffff-ffffffffffff'",
        "'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11'",
    ),
    # date and time (infinity only where no key is: the table's key is its id)
    "date": (
        "'infinity'",
        "'-infinity'",
        "'0001-01-01'",
        "'9999-12-31'",
        "'2024-02-29'",
        "'1970-01-01'",
        "'1969-12-31'",
    ),
    "time without time zone": ("'00:00:00'", "'23:59:59.999999'", "'24:00:00'", "'12:00:00.5'"),
    "time with time zone": ("'00:00:00+1559'", "'24:00:00-1559'", "'12:34:56.789+05:30'", "'01:02:03+00:00:07'"),
    "timestamp without time zone": (
        "'infinity'",
        "'-infinity'",
        "'0001-01-01 00:00:00'",
        "'9999-12-31 23:59:59.999999'",
        "'1969-12-31 23:59:59.999999'",
        "'1970-01-01 00:00:00'",
        "'2000-02-29 12:34:56.000001'",
    ),
    "timestamp with time zone": (
        "'infinity'",
        "'-infinity'",
        "'0001-01-01 00:00:00+00'",
        "'9999-12-31 23:59:59.999999+00'",
        "'2024-03-10 02:30:00 America/New_York'",  # a wall-clock time that does not exist there
        "'2024-11-03 01:30:00 America/New_York'",  # one that exists twice
        "'1883-11-18 12:00:00 America/New_York'",  # local mean time, before time zones
        "'1969-12-31 23:59:59.999999+00'",
        "'2024-06-30 23:59:60+00'",  # a leap second
    ),
    "interval": (
        "'0'",
        "'178000000 years'",
        "'-178000000 years'",
        "'1 mon -1 day +00:00:00.000001'",
        Since(15, "'2147483647 days 2562047788:00:54.775807'"),  # 14 refuses the hours as out of range
        Since(17, "'infinity'"),
        Since(17, "'-infinity'"),
    ),
    # bits
    "bit": ("B''", "B'1'", "B'1010'", "repeat('10', 5000)::varbit"),
    "bit varying": ("B''", "B'0'", "B'101'", "repeat('01', 5000)::varbit"),
    # network
    "cidr": ("'0.0.0.0/0'", "'::/0'", "'192.168.1.0/24'", "'2001:db8::/32'"),
    "inet": (
        "'10.0.0.1'",
        "'10.0.0.1/8'",
        "'::1'",
        "'ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff'",
        "'::ffff:1.2.3.4/120'",
    ),
    "macaddr": ("'00:00:00:00:00:00'", "'FF:FF:FF:FF:FF:FF'"),
    "macaddr8": ("'00:00:00:00:00:00:00:00'", "'ff:ff:ff:ff:ff:ff:ff:ff'", "'08:00:2b:01:02:03'"),
    # geometry
    "point": ("'(0,0)'", "'(1e308,-1e308)'", "'(NaN,Infinity)'", "'(-0,1.5)'"),
    "lseg": ("'[(0,0),(1,1)]'", "'[(-1e300,0),(1e300,0.5)]'"),
    "path": ("'((0,0),(1,1),(2,0))'", "'[(0,0),(1,1)]'"),
    "box": ("'(1,1),(0,0)'", "'(Infinity,Infinity),(-Infinity,-Infinity)'"),
    "polygon": ("'((0,0),(1,1),(1,0))'", "'((0,0))'"),
    "line": ("'{1,-1,0}'", "'{0,1,-1e300}'"),
    "circle": ("'<(0,0),1>'", "'<(1e300,-1e300),0>'"),
    # system identifiers
    "tid": ("'(0,0)'", "'(4294967295,65535)'"),
    "xid": ("'0'", "'4294967295'"),
    "xid8": ("'0'", "'18446744073709551615'"),
    "cid": ("'0'", "'4294967295'"),
    "pg_lsn": ("'0/0'", "'FFFFFFFF/FFFFFFFF'"),
    "txid_snapshot": ("'10:20:10,14,15'", "'1:1:'"),
    "pg_snapshot": ("'10:20:10,14,15'", "'1:1:'"),
    "aclitem": ("'postgres=arwdDxt/postgres'", "'=r*w/postgres'"),
    "int2vector": ("''", "'1 2 -32768'", "'32767'"),
    "oidvector": ("''", "'0 4294967295'"),
    "regproc": ("'now'", "'-'", "'pg_catalog.int4in'"),
    "regprocedure": ("'now()'", "'int4in(cstring)'", "'-'"),
    "regoper": ("'||/'", "'0'"),
    "regoperator": ("'+(integer,integer)'", "'-(NONE,integer)'", "'0'"),
    "regclass": ("'pg_class'", "'-'", f"'{TABLE}'"),
    "regtype": ("'integer'", "'character varying'", "'\"char\"'", "'-'"),
    "regconfig": ("'english'", "'simple'"),
    "regdictionary": ("'simple'", "'english_stem'"),
    "regnamespace": ("'pg_catalog'", "'public'", "'-'"),
    "regrole": ("'postgres'", "'-'", "'pg_read_all_data'"),
    "regcollation": ("'\"C\"'", "'ucs_basic'", "'pg_catalog.\"default\"'", "'-'"),
    # the planner's and the catalog's own types: no input, values from the catalog
    "pg_node_tree": ("(select ev_action from pg_rewrite where ev_class = 'pg_stat_activity'::regclass)",),
    "pg_ndistinct": (
        "(select stxdndistinct from pg_statistic_ext_data d join pg_statistic_ext s on s.oid = d.stxoid where s.stxname = 'gauntlet_stats')",
    ),
    "pg_dependencies": (
        "(select stxddependencies from pg_statistic_ext_data d join pg_statistic_ext s on s.oid = d.stxoid where s.stxname = 'gauntlet_stats')",
    ),
    "pg_mcv_list": (
        "(select stxdmcv from pg_statistic_ext_data d join pg_statistic_ext s on s.oid = d.stxoid where s.stxname = 'gauntlet_stats')",
    ),
    # text search
    "tsvector": ("''", "'a fat cat'", "'''ü'':1A ''x y'':2,3B'"),
    "tsquery": ("''", "'fat & (rat | !cat)'", "'a <-> b'", "'x:*'"),
    # ranges and multiranges
    "int4range": ("'empty'", "'(,)'", "'[-2147483648,2147483647)'", "'[1,1]'"),
    "int8range": ("'empty'", "'(,)'", "'[-9223372036854775808,9223372036854775807)'", "'[1,1]'"),
    "numrange": ("'empty'", "'(,)'", "'[1,NaN]'", "'[-Infinity,Infinity]'", "'[1.50,2.5)'"),
    "tsrange": ("'empty'", "'[-infinity,infinity]'", "'[2000-01-01,)'"),
    "tstzrange": ("'empty'", "'[\"2024-03-10 02:30 America/New_York\",infinity)'", "'(,)'"),
    "daterange": ("'empty'", "'[2000-01-01,2000-01-01]'", "'[-infinity,infinity)'"),
    "int4multirange": ("'{}'", "'{[1,3), [5,7)}'", "'{(,)}'"),
    "int8multirange": ("'{}'", "'{[1,3), [2,7)}'"),
    "nummultirange": ("'{}'", "'{[1.5,2), (3,NaN]}'"),
    "tsmultirange": ("'{}'", "'{[2000-01-01,2001-01-01), [-infinity,1999-01-01)}'"),
    "tstzmultirange": ("'{}'", "'{[\"2024-03-10 02:30 America/New_York\",infinity)}'"),
    "datemultirange": ("'{}'", "'{[2000-01-01,2000-01-01], (,1990-01-01)}'"),
    # rows of the catalogs (their arrays are built-in types)
    "pg_type": (
        "(select t from pg_type t where t.oid = 'bool'::regtype)",
        "(select t from pg_type t where t.oid = 'int4[]'::regtype)",
    ),
    "pg_proc": ("(select p from pg_proc p where p.oid = 'now'::regproc)",),
    "pg_class": ("(select c from pg_class c where c.oid = 'pg_class'::regclass)",),
    # contrib
    "citext": ("''", "'MiXeD ü'", "'NULL'", BIG_TEXT),
    "cube": ("'(0)'", "'(1,2),(3,4)'", "'(1e300, -1e-300)'", "'(1,2,3)'"),
    "earth": ("ll_to_earth(90, 180)", "ll_to_earth(0, 0)"),
    "hstore": ("''", '\'"a"=>"1", "b"=>NULL\'', '\'"ü k"=>"v \\"q\\""\''),
    "query_int": ("'1&2|!3'", "'1'"),
    "ean13": ("'0220356483481'", "'9780393040029'"),
    "isbn13": ("'978-0-393-04002-9'", "'0901690546'"),
    "isbn": ("'978-0-393-04002-9'", "'0-393-04002-X'"),
    "ismn13": ("'979-0-2600-0043-8'",),
    "ismn": ("'979-0-2600-0043-8'",),
    "issn13": ("'1436-4522'",),
    "issn": ("'1436-4522'", "'977-1436-452-00-8'"),
    "upc": ("'220356483481'",),
    "lo": ("0", "4294967295"),
    "ltree": ("''", "'a.b.c'", "'Top.Science_1'"),
    "lquery": ("'*.a|b.*{1,2}'", "'Top*@.Science'"),
    "ltxtquery": ("'Europe & Russia*@ & !Transportation'",),
    "seg": ("'1.5'", "'<1.2'", "'~6.0'", "'5 .. 7'", "'1.0e7'", "'-1e-30 .. 1e30'"),
    "dblink_pkey_results": ("'(1,\"a b\")'", "'(,)'"),
    "tablefunc_crosstab_2": ("'(x,\"\",)'",),
    "tablefunc_crosstab_3": ("'(\"ü\",a,b,c)'",),
    "tablefunc_crosstab_4": ("'(,,,,)'",),
}
"""Edge values of each type as SQL expressions (cast to the column's type when inserted), NULL
aside: every column gets NULL too."""

MODIFIED: tuple[tuple[str, tuple[str | Since, ...]], ...] = (
    ("character(5)", ("''", "'ab'", "'üüüüü'")),
    ("character varying(3)", ("''", "'ü𝄞x'")),
    ("bit(8)", ("B'00000000'", "B'10101010'")),
    ("bit varying(5)", ("B''", "B'10101'")),
    ("numeric(5,2)", ("'999.99'", "'-999.99'", "'0.005'", "'NaN'")),
    ("numeric(38,0)", ("'99999999999999999999999999999999999999'", "'-1'")),
    ("numeric(50,10)", ("'1234567890123456789012345678901234567890.0123456789'", "'NaN'", "'-0.0000000001'")),
    ("numeric(3,-2)", (Since(15, "'99900'"), Since(15, "'-12345'"))),
    ("numeric(2,5)", (Since(15, "'0.00099'"), Since(15, "'-0.00012'"))),
    ("time(0) without time zone", ("'23:59:59.6'", "'00:00:00.4'")),
    ("time(2) with time zone", ("'12:00:00.555+01'",)),
    ("timestamp(0) without time zone", ("'2000-01-01 00:00:00.5'", "'infinity'")),
    ("timestamp(3) with time zone", ("'2024-01-01 00:00:00.1235+00'", "'-infinity'")),
    ("interval year to month", ("'1 year 2 months 3 days'",)),
    ("interval(0)", ("'1.5 seconds'",)),
    ("interval day to second(3)", ("'1 day 00:00:00.12345'",)),
)
"""Type modifiers ``format_type`` prints and the type map reads (numeric's precision and scale
decide the Delta type; the others change nothing but the values)."""

ARRAY_EDGES: dict[str, tuple[str, ...]] = {
    # An explicit lower bound: a list has none; the elements are kept (docs/merge.md, the T[] rule).
    "integer": ("'[0:2]={1,NULL,3}'", "'[-5:-5]={7}'"),
    "text": ("'[-1:0]={\"a b\",NULL}'",),
    # Elements PostgreSQL quotes: NULL as text, empty, braces, backslashes, white space.
    "character varying": ('\'{"NULL","","{x}","a\\\\b"," ","\\""}\'',),
}
"""More array values of a type, as array literals."""

UNCHANGED: tuple[tuple[str, str, str], ...] = (
    ("u_text", "text", "repeat(md5('{row}'), 2000)"),
    ("u_bytea", "bytea", "decode(repeat(md5('{row}'), 2000), 'hex')"),
    ("u_jsonb", "jsonb", "(select jsonb_agg(md5(g::text || '{row}')) from generate_series(1, 2000) g)"),
    ("u_text_array", "text[]", "array_fill(md5('{row}'), ARRAY[2000])"),
    ("u_numeric_array", "numeric[]", "(select array_agg(g * 1.5) from generate_series({row}, {row} + 5000) g)"),
)
"""Large values stored out of line (``STORAGE EXTERNAL``) that the UPDATE leaves as they are: both
plugins then send the TOAST placeholder, never the value, and Delta must keep the value (DESIGN.md,
invariant 5). One per row, ``{row}`` its id."""

BUILTIN_TYPES = (
    "select format_type(oid, null) from pg_type where oid < 10000 and typtype in ('b', 'r', 'm') and typisdefined"
)

SETUP = """
create table gauntlet_stats (a int, b int);
create statistics gauntlet_stats (ndistinct, dependencies, mcv) on a, b from gauntlet_stats;
insert into gauntlet_stats select g % 10, g % 5 from generate_series(1, 1000) g;
analyze gauntlet_stats;
"""


@dataclass(frozen=True)
class Column:
    name: str
    decl: str
    """The type as declared (``pg_catalog."bit"``: without modifiers, as the type itself)."""
    edges: tuple[str, ...]
    """SQL expressions of the column's type (casts included); ``NULL`` among them."""
    updated: bool = True
    """False: the UPDATE leaves the column as it is (:data:`UNCHANGED`)."""


def _applies(edge: str | Since, major: int) -> str | None:
    if isinstance(edge, Since):
        return edge.expr if major >= edge.major else None
    return edge


def _column_name(prefix: str, type_name: str) -> str:
    return prefix + re.sub(r"[^a-z0-9]+", "_", type_name.lower()).strip("_")


def _scalars(type_name: str, decl: str, major: int) -> tuple[str, ...]:
    values = [e for edge in EDGES[type_name] if (e := _applies(edge, major)) is not None]
    return tuple(f"({value})::{decl}" for value in values)


def _array_edges(type_name: str, decl: str, scalars: Sequence[str]) -> tuple[str, ...]:
    """NULL, empty, one NULL element, every edge value (and a NULL) in one array, one array per
    edge value, and the type's :data:`ARRAY_EDGES`."""
    array = f"{decl}[]"
    out = ["NULL", f"'{{}}'::{array}", f"ARRAY[NULL]::{array}"]
    if scalars:
        out.append(f"ARRAY[{', '.join(scalars)}, NULL]::{array}")
        out.extend(f"ARRAY[{s}]::{array}" for s in scalars)
    out.extend(f"({e})::{array}" for e in ARRAY_EDGES.get(type_name, ()))
    return tuple(out)


@dataclass
class Inventory:
    """The gauntlet's columns on one server, and what was left out and why."""

    columns: list[Column] = field(default_factory=list)
    builtin: list[str] = field(default_factory=list)
    """``format_type`` of each built-in type in the gauntlet (arrays too)."""
    contrib: list[str] = field(default_factory=list)
    """Each contrib type in the gauntlet (arrays too)."""
    no_value: list[str] = field(default_factory=list)
    missing_edges: list[str] = field(default_factory=list)


def _try_column(conn: psycopg.Connection, decl: str) -> str | None:
    try:
        with conn.transaction():
            conn.execute(f"create temporary table gauntlet_probe (c {decl}); drop table gauntlet_probe")
    except psycopg.Error as exc:
        return str(exc).splitlines()[0]
    return None


def _refuses_input(conn: psycopg.Connection, decl: str) -> bool:
    """Whether the type's input function refuses every value: it says so, whatever the text."""
    try:
        with conn.transaction():
            conn.execute(f"select 'x'::{decl}")
    except psycopg.Error as exc:
        # "cannot accept a value of type gtsvector" (16+), "gtsvector_in not implemented" (14, 15),
        # "Not implemented" (hstore before 1.8's ghstore)...
        message = str(exc).lower()
        return "cannot accept a value of type" in message or "not implemented" in message
    return False


def inventory(conn: psycopg.Connection) -> Inventory:
    """Every built-in and contrib type of the server, each as a column with its edge values."""
    major = conn.info.server_version // 10000
    found = Inventory()
    refused: dict[str, str] = {}

    def add(prefix: str, type_name: str, decl: str, has_array: bool, scalar: bool, into: list[str]) -> None:
        kinds = []
        for kind, column_type, wanted in (("scalar", decl, scalar), ("array", f"{decl}[]", has_array)):
            if not wanted:
                continue
            error = _try_column(conn, column_type)
            if error is not None:
                refused[type_name + ("[]" if kind == "array" else "")] = error
            else:
                kinds.append(kind)
        if not kinds:
            return
        no_value = type_name in NO_VALUE
        if not no_value and type_name not in EDGES:
            found.missing_edges.append(type_name)
            return
        scalars = () if no_value else _scalars(type_name, decl, major)
        if no_value:
            assert _refuses_input(conn, decl), f"{type_name} takes input: give it edge values"
            found.no_value.append(type_name)
        if "scalar" in kinds:
            found.columns.append(Column(_column_name(prefix, type_name), decl, ("NULL", *scalars)))
            into.append(type_name)
        if "array" in kinds:
            found.columns.append(
                Column(_column_name("a_", type_name), f"{decl}[]", _array_edges(type_name, decl, scalars))
            )
            into.append(f"{type_name}[]")

    # Built-in base, range and multirange types (not arrays), and their arrays; the arrays of
    # composite or pseudo-types are built-in base types too (pg_type[], cstring[]...).
    builtin = conn.execute(
        "select format_type(t.oid, null), quote_ident(n.nspname) || '.' || quote_ident(t.typname), t.typarray <> 0,"
        " t.typtype in ('b', 'r', 'm') from pg_type t join pg_namespace n on n.oid = t.typnamespace"
        " where t.oid < 10000 and t.typisdefined and not exists (select 1 from pg_type a where a.typarray = t.oid)"
        " and (t.typtype in ('b', 'r', 'm') or exists (select 1 from pg_type a where a.oid = t.typarray"
        " and a.oid < 10000 and a.typtype = 'b')) order by t.oid"
    ).fetchall()
    for type_name, decl, has_array, scalar in builtin:
        add("c_", type_name, decl, has_array, scalar, found.builtin)
    for modified, edges in MODIFIED:
        values = tuple(f"({e})::{modified}" for edge in edges if (e := _applies(edge, major)) is not None)
        if values:
            found.columns.append(Column(_column_name("m_", modified), modified, ("NULL", *values)))
            found.builtin.append(modified)

    available = {row[0] for row in conn.execute("select name from pg_available_extensions")}
    for name in DEBIAN_CONTRIB:
        if name in available:
            conn.execute(f'create extension if not exists "{name}" cascade')
    contrib = conn.execute(
        "select format_type(t.oid, null), quote_ident(n.nspname) || '.' || quote_ident(t.typname), t.typarray <> 0"
        " from pg_type t join pg_namespace n on n.oid = t.typnamespace"
        " join pg_depend d on d.classid = 'pg_type'::regclass and d.objid = t.oid and d.deptype = 'e'"
        " join pg_extension e on e.oid = d.refobjid left join pg_class c on c.oid = t.typrelid"
        " where e.extname = any(%s) and t.typtype in ('b', 'c', 'd', 'e', 'r', 'm')"
        " and not exists (select 1 from pg_type a where a.typarray = t.oid)"
        # Not the row types of an extension's views (pg_buffercache's, pg_stat_statements' on 18):
        # a view's row, not a type the extension defines for values.
        " and (c.oid is null or c.relkind = 'c') order by t.oid",
        (DEBIAN_CONTRIB,),
    ).fetchall()
    for type_name, decl, has_array in contrib:
        add("x_", type_name, decl, has_array, True, found.contrib)

    assert refused.keys() == EXCLUDED.keys(), f"types a column cannot have: {refused}"
    # Every built-in type of the server is in the gauntlet or excluded with its reason.
    every = {row[0] for row in conn.execute(BUILTIN_TYPES)}
    assert every == {*found.builtin, *EXCLUDED} - {modified for modified, _ in MODIFIED}, "a built-in type left out"
    names = [c.name for c in found.columns]
    assert len(set(names)) == len(names), "two types gave one column name"
    return found


# --- the source ---------------------------------------------------------------------------------


@dataclass
class Phase:
    what: str
    lsn: Lsn
    rows: list[tuple[Any, ...]]
    """The table as PostgreSQL prints it at ``lsn``: each value its output text (a list of element
    texts for a column staged as a list), NULL as None."""


@dataclass
class Gauntlet:
    dsn: str
    major: int
    inventory: Inventory
    columns: list[tuple[str, str]]
    """``(name, format_type with modifiers)`` of every column, id first."""
    slots: dict[str, str]
    phases: list[Phase]
    snapshot: str
    """The initial-load snapshot batch of the table as after the INSERT (phase 0)."""


def _delta_type(pg_type: str) -> str:
    return typemap.resolve(pg_type).delta


def _text_select(columns: Sequence[tuple[str, str]]) -> sql.Composable:
    """Each column as its type's output text (the oracle's :func:`output_text`: not ``::text``,
    which differs for inet, xml, boolean, character), arrays staged as lists as lists of their
    elements' output texts."""
    parts = []
    for name, pg_type in columns:
        column = sql.Identifier(name)
        if pg_type in ('"char"', '"char"[]'):  # as bytes: PostgreSQL 14 prints some as no text (_char_output)
            element = column if pg_type == '"char"' else sql.SQL("{}[i]").format(column)
            value = sql.SQL("CASE WHEN num_nulls({0}) = 0 THEN textsend(format('%s', {0})) END").format(element)
            if pg_type == '"char"[]':
                value = sql.SQL(
                    "CASE WHEN num_nulls({0}) = 0 THEN array(SELECT {1} FROM generate_subscripts({0}, 1) i ORDER BY i) END"
                ).format(column, value)
            parts.append(value)
        elif _delta_type(pg_type).startswith("array<"):
            parts.append(output_texts(column))
        else:
            parts.append(output_text(column))
    return sql.SQL("select {} from {}").format(sql.SQL(", ").join(parts), sql.Identifier(TABLE))


def _char_output(raw: bytes | None) -> str | None:
    """A ``"char"`` as PostgreSQL 15+ prints it: a byte above 127 as a backslash and three octal
    digits. PostgreSQL 14 prints the byte itself, no UTF-8: staged as 15+ prints it
    (decoding/raw_char.py; docs/merge.md, the ``"char"`` row of the type table)."""
    if raw is None:
        return None
    return f"\\{raw[0]:03o}" if raw[:1] >= b"\x80" else raw.decode()


def _read_phase(conn: psycopg.Connection, what: str, columns: Sequence[tuple[str, str]]) -> Phase:
    lsn = Lsn.parse(str(conn.execute("select pg_current_wal_flush_lsn()").fetchone()[0]))
    with conn.transaction():
        pin_settings(conn, local=True)  # as the decoding session prints values
        rows = [tuple(row) for row in conn.execute(_text_select(columns)).fetchall()]
    chars = [(index, pg_type) for index, (_, pg_type) in enumerate(columns) if pg_type in ('"char"', '"char"[]')]
    for number, row in enumerate(rows):
        values = list(row)
        for index, pg_type in chars:
            value = values[index]
            values[index] = (
                _char_output(value)
                if pg_type == '"char"'
                else None
                if value is None
                else [_char_output(v) for v in value]
            )
        rows[number] = tuple(values)
    return Phase(what, lsn, rows)


def _stage_snapshot(dsn: str, staging: Path) -> str:
    """The table staged by an initial load's snapshot (its COPY, not the decoding)."""
    slot = f"gauntlet_snapshot_{uuid.uuid4().hex[:8]}"
    try:
        with create_slot_with_snapshot(dsn, slot, two_phase=False) as (lsn, name):
            return str(stage_snapshot(dsn, name, lsn, slot, staging, [f"public.{TABLE}"]).path)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "select pg_drop_replication_slot(slot_name) from pg_replication_slots where slot_name = %s", (slot,)
            )


def build_gauntlet(admin_dsn: str, staging: Path) -> Gauntlet:
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(
            "select pg_drop_replication_slot(slot_name) from pg_replication_slots where database = %s", (DATABASE,)
        )
        admin.execute(f"drop database if exists {DATABASE} with (force)")
        admin.execute(f"create database {DATABASE} template template0 encoding 'UTF8' locale 'C'")
    dsn = make_conninfo(admin_dsn, dbname=DATABASE)
    with psycopg.connect(dsn, autocommit=True) as conn:
        major = conn.info.server_version // 10000
        conn.execute(SETUP)
        conn.execute(f"create table {TABLE} (id int primary key)")  # regclass edge values name it
        found = inventory(conn)
        assert not found.missing_edges, f"types without edge values: {found.missing_edges}"
        for name, decl, value in UNCHANGED:
            edges = tuple(f"({value.format(row=row)})::{decl}" for row in range(16))
            found.columns.append(Column(name, decl, edges, updated=False))
        conn.execute(
            f"alter table {TABLE} "
            + ", ".join(f'add column "{c.name}" {c.decl}' for c in found.columns)
            + "".join(f', alter column "{name}" set storage external' for name, _, _ in UNCHANGED)
        )
        columns = conn.execute(
            "select attname::text, format_type(atttypid, atttypmod) from pg_attribute"
            " where attrelid = %s::regclass and attnum > 0 and not attisdropped order by attnum",
            (TABLE,),
        ).fetchall()
        conn.execute(f"create publication {PUBLICATION} for table {TABLE}")
        slots = {}
        for plugin in ("test_decoding", "pgoutput"):
            slots[plugin] = f"gauntlet_{plugin}_{uuid.uuid4().hex[:8]}"
            conn.execute("select pg_create_logical_replication_slot(%s, %s)", (slots[plugin], plugin))

        rows = max(len(c.edges) for c in found.columns)

        def value(column: Column, row: int) -> str:
            return column.edges[row % len(column.edges)]

        names = ", ".join(f'"{c.name}"' for c in found.columns)
        values = ", ".join(f"({row}, {', '.join(value(c, row) for c in found.columns)})" for row in range(rows))
        conn.execute(f"insert into {TABLE} (id, {names}) values {values}")
        phases = [_read_phase(conn, "insert", columns)]
        snapshot = _stage_snapshot(dsn, staging)
        # The UPDATEs log the old row whole (REPLICA IDENTITY FULL: every type in the old image too),
        # the DELETEs the key only (DEFAULT).
        with conn.transaction():
            conn.execute(f"alter table {TABLE} replica identity full")
            for row in range(rows):  # each row to the next edge value of each column
                sets = ", ".join(f'"{c.name}" = {value(c, row + 1)}' for c in found.columns if c.updated)
                conn.execute(f"update {TABLE} set {sets} where id = {row}")
        phases.append(_read_phase(conn, "update", columns))
        with conn.transaction():
            conn.execute(f"alter table {TABLE} replica identity default")
            conn.execute(f"delete from {TABLE} where id % 3 = 1")
        phases.append(_read_phase(conn, "delete", columns))
    return Gauntlet(dsn, major, found, columns, slots, phases, snapshot)


def drop_gauntlet(gauntlet: Gauntlet) -> None:
    with psycopg.connect(make_conninfo(gauntlet.dsn, dbname="postgres"), autocommit=True) as admin:
        admin.execute(
            "select pg_drop_replication_slot(slot_name) from pg_replication_slots where database = %s", (DATABASE,)
        )
        admin.execute(f"drop database if exists {DATABASE} with (force)")


# --- what Delta holds -------------------------------------------------------------------------------

NUMERIC_SPECIALS = frozenset(typemap.NUMERIC_SPECIAL_VALUES)
DECIMALS = Context(prec=1000)


def _float32(value: float) -> float:
    return float(struct.unpack("f", struct.pack("f", value))[0])


def _timestamp(text: str, zoned: bool) -> datetime:
    if zoned:
        assert text.endswith("+00"), text  # TimeZone UTC, pinned
        text = text[:-3]
    return datetime.fromisoformat(text)


def expected(delta_type: str, text: str | None) -> Any:
    """The Delta value docs/merge.md ("Type mapping") promises for a value PostgreSQL printed as ``text``."""
    if text is None:
        return None
    if delta_type.startswith("array<"):
        raise AssertionError("arrays are compared element by element")
    if delta_type == "string":
        return text  # as printed
    if delta_type in ("smallint", "int", "bigint"):
        return int(text)
    if delta_type == "float":
        return _float32(float(text))  # NaN, Infinity, -Infinity kept
    if delta_type == "double":
        return float(text)
    if delta_type.startswith("decimal("):
        # "Numeric NaN, Infinity, -Infinity ... become NULL in a decimal column (also inside arrays)"
        return None if text in NUMERIC_SPECIALS else Decimal(text)
    if delta_type == "boolean":
        return {"t": True, "f": False}[text]
    if delta_type == "date":
        # "infinity / -infinity become 9999-12-31 / 0001-01-01" (outside a key column)
        return {"infinity": date(9999, 12, 31), "-infinity": date(1, 1, 1)}.get(text) or date.fromisoformat(text)
    if delta_type.startswith("timestamp"):
        # "infinity / -infinity become 9999-12-31 23:59:59.999999 / 0001-01-01 00:00:00" (outside a
        # key column); timestamptz as its UTC instant, timestamp's wall-clock time read as UTC.
        infinities = {"infinity": datetime(9999, 12, 31, 23, 59, 59, 999999), "-infinity": datetime(1, 1, 1)}
        return infinities.get(text) or _timestamp(text, text.endswith("+00"))
    if delta_type == "binary":
        assert text.startswith("\\x"), text
        return bytes.fromhex(text[2:])
    raise AssertionError(f"no expectation for Delta type {delta_type}")


def comparable(value: Any) -> Any:
    """One hashable form for a value of either side: floats by their exact repr (-0.0 is not 0.0),
    NaN equal to NaN, decimals by their value, lists as tuples."""
    if isinstance(value, float):
        return ("float", "NaN" if math.isnan(value) else repr(value))
    if isinstance(value, Decimal):  # normalized without rounding (the default context keeps 28 digits)
        return ("decimal", value.normalize(DECIMALS) if value else Decimal(0))
    if isinstance(value, datetime) and value.tzinfo is not None:
        return value.astimezone(UTC).replace(tzinfo=None)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, (list, tuple)):
        return tuple(comparable(v) for v in value)
    return value


def _element_type(delta_type: str) -> str:
    return delta_type[len("array<") : -1]


def expected_row(delta_types: Sequence[str], row: Sequence[Any]) -> tuple[Any, ...]:
    out = []
    for delta_type, value in zip(delta_types, row, strict=True):
        if delta_type.startswith("array<") and value is not None:
            out.append(comparable([expected(_element_type(delta_type), v) for v in value]))
        else:
            out.append(comparable(expected(delta_type, value)))
    return tuple(out)


def _short(row: tuple[Any, ...], names: Sequence[str], other: tuple[Any, ...] | None) -> dict[str, Any]:
    """The columns of ``row`` that differ from ``other`` (all when none), values cut short."""
    return {
        name: (repr(value)[:120])
        for index, (name, value) in enumerate(zip(names, row, strict=True))
        if other is None or other[index] != value
    }


def delta_rows(path: str, names: Sequence[str]) -> list[dict[str, Any]]:
    """The Delta table's current rows, read by delta-rs (deletion vectors applied): the Delta
    reader a consumer outside Spark uses, and one that reads 0001-01-01 00:00 as a datetime
    (PySpark's collect cannot)."""
    select = ", ".join(f'"{name}"' for name in names)
    query = QueryBuilder().register("t", DeltaTable(path)).execute(f"select {select} from t")
    return list(pa.table(query.read_all()).to_pylist())


def assert_delta_equals(spark: Any, root: str, gauntlet: Gauntlet, phase: Phase) -> None:
    """The Delta table has the type map's type for every column and holds the rows of ``phase``,
    as a multiset, each value the Delta value :func:`expected` of the text PostgreSQL printed."""
    what = f"{TABLE} after the {phase.what}"
    path, columns, rows = f"{root}/public/{TABLE}", gauntlet.columns, phase.rows
    names = [name for name, _ in columns]
    frame = spark.read.format("delta").load(path)
    schema = {f.name: f.dataType.simpleString() for f in frame.schema.fields if not f.name.startswith("_pg_")}
    # The Delta type of each column is the type map's.
    assert schema == {name: _delta_type(pg_type) for name, pg_type in columns}, what
    delta_types = [schema[name] for name in names]
    source = Counter(expected_row(delta_types, row) for row in rows)
    delta = Counter(tuple(comparable(row[name]) for name in names) for row in delta_rows(path, names))
    if source != delta:
        missing, extra = list((source - delta).elements()), list((delta - source).elements())
        by_id = {row[0]: row for row in extra}
        details = [
            f"id {row[0]}: PostgreSQL {_short(row, names, by_id.get(row[0]))}, "
            f"Delta {_short(by_id[row[0]], names, row) if row[0] in by_id else 'no row'}"
            for row in missing
        ]
        details += [f"id {row[0]}: only in Delta" for row in extra if row[0] not in {m[0] for m in missing}]
        raise AssertionError(f"{what}: Delta differs from PostgreSQL:\n" + "\n".join(details[:20]))


# --- the tests ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gauntlets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``get(request, major)``: the gauntlet of the server a test runs on, built by the first test
    that asks (after the INSERT, UPDATE and DELETE, the table as each left it), shared by the others."""
    built: dict[str, Gauntlet] = {}

    def get(request: pytest.FixtureRequest, major: int) -> Gauntlet:
        if major != 18 and not FULL_TESTS:
            pytest.skip(
                "the gauntlet runs on PostgreSQL 18 (the newest: every built-in type of the others, and Debian's "
                "contrib); PGDECODE_FULL_TESTS=1 runs it on every major"
            )
        dsn = str(request.getfixturevalue("matrix_dsn"))  # after the skip: no cluster started for nothing
        if dsn not in built:
            built[dsn] = build_gauntlet(dsn, tmp_path_factory.mktemp(f"gauntlet-pg{major}"))
        return built[dsn]

    yield get
    for gauntlet in built.values():
        drop_gauntlet(gauntlet)


# CI time: both plugins carry each value as its output function's text (pgoutput in its text
# format), staged by the same converters; the plugins differ in framing, which the extract tests
# cover for both. The pgoutput run of the gauntlet passes with PGDECODE_FULL_TESTS=1.
PGOUTPUT_REPEAT = "the test_decoding run stages the same text of every type through the same converters"


@pytest.mark.pg_matrix
@pytest.mark.parametrize("plugin", ["test_decoding", full_only("pgoutput", PGOUTPUT_REPEAT)])
def test_every_type_with_edge_values_lands_in_delta_as_postgres_shows_it(
    gauntlets: Any, request: pytest.FixtureRequest, spark: Any, tmp_path: Path, plugin: str, pg_version: int
) -> None:
    gauntlet = gauntlets(request, pg_version)
    slot = gauntlet.slots[plugin]
    publication = PUBLICATION if plugin == "pgoutput" else None
    root = str(tmp_path / "delta")
    checkpoint = None
    with psycopg.connect(gauntlet.dsn, autocommit=True) as conn:
        for phase in gauntlet.phases:  # INSERT, UPDATE, DELETE: one batch each
            options = {"plugin": plugin, "publication": publication, "upto_lsn": phase.lsn, "checkpoint": checkpoint}
            batch = extract_batch(conn, slot, tmp_path / "python", native=False, **options)
            if load_native() is not None:  # the C writer stages the same batch
                assert_same_batches(batch, extract_batch(conn, slot, tmp_path / "native", native=True, **options))
            merge_batches(spark, [str(batch.path)], root)
            assert_delta_equals(spark, root, gauntlet, phase)
            conn.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, batch.end_lsn))
            checkpoint = Checkpoint.from_manifest(batch)


@pytest.mark.pg_matrix
def test_every_type_with_edge_values_lands_in_delta_through_an_initial_snapshot(
    gauntlets: Any, request: pytest.FixtureRequest, spark: Any, tmp_path: Path, pg_version: int
) -> None:
    # The initial load stages the same values from COPY's text (another reader, other converters:
    # bounded numeric as decimal128) into the same Delta types.
    gauntlet = gauntlets(request, pg_version)
    root = str(tmp_path / "delta")
    merge_batches(spark, [gauntlet.snapshot], root)
    assert_delta_equals(spark, root, gauntlet, gauntlet.phases[0])
