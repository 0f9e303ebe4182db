"""Catalog lookups against the real test cluster: columns, primary keys, replica identity, type names."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from airflow_provider_pgdecode.decoding.events import Change
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.decoding.pgoutput import BUILTIN_TYPE_NAMES
from airflow_provider_pgdecode.decoding.test_decoding import TestDecodingParser
from airflow_provider_pgdecode.errors import CatalogError
from airflow_provider_pgdecode.postgres.catalog import Catalog, ColumnInfo, ReplicaIdentity, TableKey, source_tables

pytestmark = pytest.mark.postgres


@pytest.fixture
def schema(pg_conn: psycopg.Connection[Any]) -> Iterator[str]:
    """A fresh schema of this test's own (the database is shared with other tests)."""
    name = f"cat_{uuid.uuid4().hex[:10]}"
    pg_conn.execute(f'CREATE SCHEMA "{name}"')
    yield name
    pg_conn.execute(f'DROP SCHEMA "{name}" CASCADE')


@pytest.fixture
def catalog(pg_conn: psycopg.Connection[Any]) -> Catalog:
    return Catalog(pg_conn)


def run(conn: psycopg.Connection[Any], schema: str, sql: str) -> None:
    """Run DDL with ``schema`` first on the search path (so unqualified names land there)."""
    with conn.transaction():
        conn.execute(f'SET LOCAL search_path = "{schema}", public')
        conn.execute(sql)


# --- columns ----------------------------------------------------------------------------------


def test_columns_names_types_typmods_and_not_null(pg_conn, catalog, schema) -> None:
    run(
        pg_conn,
        schema,
        """
        CREATE TABLE t (
            id integer PRIMARY KEY,
            name character varying(20) NOT NULL,
            amount numeric(12,2),
            free numeric,
            tags text[],
            codes varchar(5)[],
            at timestamp(3) with time zone,
            flags bit(4),
            doc jsonb,
            "Odd Col" text,
            "select" int8
        )""",
    )
    columns = catalog.columns(schema, "t")
    assert [c.name for c in columns] == [
        "id",
        "name",
        "amount",
        "free",
        "tags",
        "codes",
        "at",
        "flags",
        "doc",
        "Odd Col",
        "select",
    ]
    by_name = {c.name: c for c in columns}
    # type_name: what test_decoding prints (no typmod); catalog_type: with the typmod.
    expected = {
        "id": ("integer", "integer"),
        "name": ("character varying", "character varying(20)"),
        "amount": ("numeric", "numeric(12,2)"),
        "free": ("numeric", "numeric"),
        "tags": ("text[]", "text[]"),
        "codes": ("character varying[]", "character varying(5)[]"),
        "at": ("timestamp with time zone", "timestamp(3) with time zone"),
        "flags": ("bit", "bit(4)"),
        "doc": ("jsonb", "jsonb"),
        "Odd Col": ("text", "text"),
        "select": ("bigint", "bigint"),
    }
    assert {n: (c.type_name, c.catalog_type) for n, c in by_name.items()} == expected
    assert by_name["id"].not_null and by_name["name"].not_null
    assert not by_name["amount"].not_null
    assert all(c.user_type is None for c in columns)  # all built in
    assert [c.attnum for c in columns] == list(range(1, 12))
    assert all(isinstance(c, ColumnInfo) for c in columns)


def test_dropped_columns_are_left_out_and_attnums_kept(pg_conn, catalog, schema) -> None:
    run(
        pg_conn,
        schema,
        "CREATE TABLE t (a int, b text, c int); ALTER TABLE t DROP COLUMN b; ALTER TABLE t ADD COLUMN d date",
    )
    columns = catalog.columns(schema, "t")
    assert [(c.name, c.attnum) for c in columns] == [("a", 1), ("c", 3), ("d", 4)]


def test_missing_values_of_columns_added_with_a_default_as_decoding_prints_them(pg_conn, catalog, schema) -> None:
    """attmissingval's element as text, under the settings the decoding pins (UTC, ISO), whatever
    the session's; none for a column added without a default, none once a rewrite materialized them."""
    run(
        pg_conn,
        schema,
        "CREATE TABLE t (id int); INSERT INTO t VALUES (1);"
        " ALTER TABLE t ADD COLUMN five int DEFAULT 5, ADD COLUMN at timestamptz DEFAULT '2024-01-02 03:04:05+02',"
        " ADD COLUMN tags text[] DEFAULT '{a,\"b c\"}', ADD COLUMN plain int, ADD COLUMN q text DEFAULT 'it''s',"
        # box arrays are ;-delimited: attmissingval prints {(1,1),(0,0)}, one element with commas.
        " ADD COLUMN b box DEFAULT '((1,1),(0,0))', ADD COLUMN boxes box[] DEFAULT '{(1,1),(0,0);(2,2),(1,1)}',"
        " ADD COLUMN quoted text DEFAULT 'a\\b \"c\"', ADD COLUMN nothing text DEFAULT NULL",
    )
    pg_conn.execute("SET TimeZone = 'America/New_York'; SET DateStyle = 'SQL, DMY'")
    assert catalog.missing_values(schema, "t") == {
        "five": "5",
        "at": "2024-01-02 01:04:05+00",
        "tags": '{a,"b c"}',
        "q": "it's",
        "b": "(1,1),(0,0)",
        "boxes": "{(1,1),(0,0);(2,2),(1,1)}",
        "quoted": 'a\\b "c"',
    }
    assert pg_conn.execute("SHOW TimeZone").fetchone()[0] == "America/New_York"  # the session keeps its own
    pg_conn.execute(f"VACUUM FULL {schema}.t")
    assert catalog.missing_values(schema, "t") == {}


def test_user_types_enum_domain_composite_range_and_arrays(pg_conn, catalog, schema) -> None:
    run(
        pg_conn,
        schema,
        """
        CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
        CREATE DOMAIN positive AS integer CHECK (VALUE > 0);
        CREATE DOMAIN short_text AS varchar(10);
        CREATE TYPE pair AS (x int, y text);
        CREATE TYPE floatrange AS RANGE (subtype = float8);
        CREATE TABLE t (
            id int PRIMARY KEY,
            m mood,
            ms mood[],
            p positive,
            s short_text,
            pr pair,
            fr floatrange,
            plain int
        )""",
    )
    by_name = {c.name: c for c in catalog.columns(schema, "t")}
    assert by_name["m"].user_type == "enum"
    assert by_name["ms"].user_type == "enum"  # an array reports its element's kind
    assert by_name["p"].user_type == "domain"
    assert by_name["s"].user_type == "domain"
    assert by_name["pr"].user_type == "composite"
    assert by_name["fr"].user_type == "range"
    assert by_name["plain"].user_type is None and by_name["id"].user_type is None
    # The schema is on no one's search path here: format_type qualifies the names.
    assert by_name["m"].type_name == f"{schema}.mood"
    assert by_name["ms"].type_name == f"{schema}.mood[]"
    assert by_name["p"].type_name == f"{schema}.positive"


def test_type_names_of_visible_user_types_are_unqualified(pg_conn, catalog, schema) -> None:
    run(pg_conn, schema, "CREATE TYPE mood AS ENUM ('a'); CREATE TABLE t (m mood, ms mood[])")
    with pg_conn.transaction():
        pg_conn.execute(f'SET LOCAL search_path = "{schema}", public')
        by_name = {c.name: c for c in catalog.columns(schema, "t")}
    assert (by_name["m"].type_name, by_name["ms"].type_name) == ("mood", "mood[]")


def test_names_are_case_sensitive_and_unquoted(pg_conn, catalog, schema) -> None:
    run(pg_conn, schema, 'CREATE TABLE "Odd Tbl" ("Col A" int PRIMARY KEY)')
    assert [c.name for c in catalog.columns(schema, "Odd Tbl")] == ["Col A"]
    with pytest.raises(CatalogError, match="does not exist"):
        catalog.columns(schema, '"Odd Tbl"')
    with pytest.raises(CatalogError, match="does not exist"):
        catalog.columns(schema, "odd tbl")


def test_a_missing_table_names_table_and_database(pg_conn, catalog, schema) -> None:
    with pytest.raises(CatalogError) as info:
        catalog.columns(schema, "nope")
    message = str(info.value)
    assert f"'{schema}'.'nope'" in message
    assert pg_conn.info.dbname in message
    # Not a table: an index or a sequence of that name does not count.
    run(pg_conn, schema, "CREATE SEQUENCE seq1; CREATE TABLE t (id int PRIMARY KEY)")
    for name in ("seq1", "t_pkey"):
        with pytest.raises(CatalogError, match="does not exist"):
            catalog.primary_key(schema, name)
        with pytest.raises(CatalogError, match="does not exist"):
            catalog.replica_identity(schema, name)


def test_catalog_type_names_are_what_test_decoding_prints(pg_conn, catalog, schema, slot_name) -> None:
    run(
        pg_conn,
        schema,
        """
        CREATE TYPE mood AS ENUM ('ok');
        CREATE TABLE t (id int PRIMARY KEY, v varchar(9), n numeric(5,1), a int[], ts timestamptz(2),
                        b bit(3), m mood, ms mood[], j json)""",
    )
    pg_conn.execute("SELECT pg_create_logical_replication_slot(%s, 'test_decoding')", (slot_name,))
    run(pg_conn, schema, "INSERT INTO t VALUES (1, 'x', 1.5, '{1}', now(), B'101', 'ok', '{ok}', '{}')")
    rows = pg_conn.execute(
        "SELECT lsn::text, data FROM pg_logical_slot_peek_changes(%s, NULL, NULL, 'include-xids', '0',"
        " 'skip-empty-xacts', '1')",
        (slot_name,),
    ).fetchall()
    parser = TestDecodingParser()
    changes = [e for e in (parser.parse(Lsn.parse(lsn), None, data) for lsn, data in rows) if isinstance(e, Change)]
    assert len(changes) == 1
    printed = dict(zip(changes[0].new.names, changes[0].new.types))
    assert printed == {c.name: c.type_name for c in catalog.columns(schema, "t")}


# --- primary keys -----------------------------------------------------------------------------


def test_primary_key_in_index_order_not_column_order(pg_conn, catalog, schema) -> None:
    run(
        pg_conn,
        schema,
        """
        CREATE TABLE composite (a int, b text, c int, d int, PRIMARY KEY (c, a));
        CREATE TABLE single (x int, y int PRIMARY KEY);
        CREATE TABLE nokey (x int, y int);
        CREATE TABLE unique_only (x int NOT NULL UNIQUE, y int);
        CREATE TABLE with_include (a int, b int, c int, PRIMARY KEY (b) INCLUDE (a, c))""",
    )
    assert catalog.primary_key(schema, "composite") == ["c", "a"]
    assert catalog.primary_key(schema, "single") == ["y"]
    assert catalog.primary_key(schema, "nokey") == []
    assert catalog.primary_key(schema, "unique_only") == []  # a unique index is not a primary key
    assert catalog.primary_key(schema, "with_include") == ["b"]  # INCLUDE columns are not key columns


def test_primary_key_follows_ddl(pg_conn, catalog, schema) -> None:
    run(pg_conn, schema, "CREATE TABLE t (a int, b int)")
    assert catalog.primary_key(schema, "t") == []
    run(pg_conn, schema, "ALTER TABLE t ADD PRIMARY KEY (b, a)")
    assert catalog.primary_key(schema, "t") == ["b", "a"]
    run(pg_conn, schema, "ALTER TABLE t DROP CONSTRAINT t_pkey")
    assert catalog.primary_key(schema, "t") == []


def test_primary_key_of_a_partitioned_table_and_its_partitions(pg_conn, catalog, schema) -> None:
    run(
        pg_conn,
        schema,
        """
        CREATE TABLE parted (region text, id int, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
        CREATE TABLE parted_eu PARTITION OF parted FOR VALUES IN ('eu')""",
    )
    assert catalog.primary_key(schema, "parted") == ["id", "region"]
    assert catalog.primary_key(schema, "parted_eu") == ["id", "region"]


# --- replica identity -------------------------------------------------------------------------


def test_replica_identity_kinds(pg_conn, catalog, schema) -> None:
    run(
        pg_conn,
        schema,
        """
        CREATE TABLE dflt (a int, b int, c text, PRIMARY KEY (b, a));
        CREATE TABLE dflt_nokey (a int, b text);
        CREATE TABLE idx (a int, b int NOT NULL, c int NOT NULL, d text);
        CREATE UNIQUE INDEX idx_cb ON idx (c, b);
        ALTER TABLE idx REPLICA IDENTITY USING INDEX idx_cb;
        CREATE TABLE full_t (a int PRIMARY KEY, b text, gone int, c jsonb);
        ALTER TABLE full_t DROP COLUMN gone;
        ALTER TABLE full_t REPLICA IDENTITY FULL;
        CREATE TABLE nothing_t (a int PRIMARY KEY, b text);
        ALTER TABLE nothing_t REPLICA IDENTITY NOTHING""",
    )
    assert catalog.replica_identity(schema, "dflt") == ReplicaIdentity("default", ("b", "a"))
    assert catalog.replica_identity(schema, "dflt_nokey") == ReplicaIdentity("default", ())
    assert catalog.replica_identity(schema, "idx") == ReplicaIdentity("index", ("c", "b"), "idx_cb")
    assert catalog.replica_identity(schema, "full_t") == ReplicaIdentity("full", ("a", "b", "c"))
    assert catalog.replica_identity(schema, "nothing_t") == ReplicaIdentity("nothing", ())


def test_replica_identity_of_a_dropped_index_is_nothing(pg_conn, catalog, schema) -> None:
    run(
        pg_conn,
        schema,
        """
        CREATE TABLE t (a int NOT NULL, b text);
        CREATE UNIQUE INDEX t_a ON t (a);
        ALTER TABLE t REPLICA IDENTITY USING INDEX t_a""",
    )
    assert catalog.replica_identity(schema, "t") == ReplicaIdentity("index", ("a",), "t_a")
    run(pg_conn, schema, "DROP INDEX t_a")
    # PostgreSQL keeps relreplident = 'i' and logs no old key: as NOTHING.
    kind = pg_conn.execute(
        "SELECT relreplident::text FROM pg_class WHERE oid = %s::regclass", (f'"{schema}".t',)
    ).fetchone()[0]
    assert kind == "i"
    assert catalog.replica_identity(schema, "t") == ReplicaIdentity("nothing", ())


# --- the table-key rule -----------------------------------------------------------------------


def test_table_key_is_the_primary_key_whatever_the_replica_identity(pg_conn, catalog, schema) -> None:
    run(
        pg_conn,
        schema,
        """
        CREATE TABLE pk (a int, b text, c int, PRIMARY KEY (c, a));
        CREATE TABLE pk_full (a int PRIMARY KEY, b text);
        ALTER TABLE pk_full REPLICA IDENTITY FULL;
        CREATE TABLE pk_nothing (a int PRIMARY KEY, b text);
        ALTER TABLE pk_nothing REPLICA IDENTITY NOTHING;
        CREATE TABLE pk_and_index (a int PRIMARY KEY, b int NOT NULL);
        CREATE UNIQUE INDEX pk_and_index_b ON pk_and_index (b);
        ALTER TABLE pk_and_index REPLICA IDENTITY USING INDEX pk_and_index_b""",
    )
    assert catalog.table_key(schema, "pk") == TableKey(("c", "a"), "default", "primary key")
    assert catalog.table_key(schema, "pk_full") == TableKey(("a",), "full", "primary key")
    assert catalog.table_key(schema, "pk_and_index") == TableKey(("a",), "index", "primary key")
    assert catalog.table_key(schema, "pk").unique


def test_table_key_without_primary_key_is_the_replica_identity_index(pg_conn, catalog, schema) -> None:
    run(
        pg_conn,
        schema,
        """
        CREATE TABLE t (a int, b int NOT NULL, c int NOT NULL, d text);
        CREATE UNIQUE INDEX t_cb ON t (c, b) INCLUDE (d);
        ALTER TABLE t REPLICA IDENTITY USING INDEX t_cb""",
    )
    key = catalog.table_key(schema, "t")
    assert key == TableKey(("c", "b"), "index", "replica identity index")  # index order, INCLUDE left out
    assert key.unique


def test_table_key_under_replica_identity_full_without_primary_key_is_all_columns(pg_conn, catalog, schema) -> None:
    run(
        pg_conn,
        schema,
        """
        CREATE TABLE t (a int, gone int, b text, c jsonb, "Odd Col" point);
        ALTER TABLE t DROP COLUMN gone;
        CREATE UNIQUE INDEX t_a ON t (a);  -- unique, but not the replica identity: not a key
        ALTER TABLE t REPLICA IDENTITY FULL""",
    )
    key = catalog.table_key(schema, "t")
    assert key == TableKey(("a", "b", "c", "Odd Col"), "full", "all columns")  # attnum order, live columns only
    assert not key.unique  # rows may repeat, columns may be NULL


@pytest.mark.parametrize(
    ("ddl", "kind"),
    [
        ("CREATE TABLE t (a int, b text)", "DEFAULT"),
        ("CREATE TABLE t (a int NOT NULL UNIQUE, b text)", "DEFAULT"),  # a unique index alone is not a key
        ("CREATE TABLE t (a int, b text); ALTER TABLE t REPLICA IDENTITY NOTHING", "NOTHING"),
        # The replica identity index was dropped: PostgreSQL logs no old key, as under NOTHING.
        (
            "CREATE TABLE t (a int NOT NULL, b text); CREATE UNIQUE INDEX t_a ON t (a);"
            " ALTER TABLE t REPLICA IDENTITY USING INDEX t_a; DROP INDEX t_a",
            "NOTHING",
        ),
    ],
    ids=["default", "unique-but-default", "nothing", "dropped-index"],
)
def test_table_key_refuses_a_table_without_one_and_says_what_to_do(pg_conn, catalog, schema, ddl, kind) -> None:
    run(pg_conn, schema, ddl)
    with pytest.raises(CatalogError) as info:
        catalog.table_key(schema, "t")
    message = str(info.value)
    assert message.startswith(f"table {schema}.t has no primary key and REPLICA IDENTITY {kind}: ")
    assert "cannot be matched in Delta" in message
    for way in ("Add a primary key", "REPLICA IDENTITY USING INDEX", "REPLICA IDENTITY FULL", "tables option"):
        assert way in message


@pytest.mark.parametrize(
    "ddl",
    [
        "CREATE TABLE t (a int PRIMARY KEY, b text); ALTER TABLE t REPLICA IDENTITY NOTHING",
        # A replica identity index dropped: PostgreSQL behaves as NOTHING, the primary key notwithstanding.
        "CREATE TABLE t (a int PRIMARY KEY, b int NOT NULL); CREATE UNIQUE INDEX t_b ON t (b);"
        " ALTER TABLE t REPLICA IDENTITY USING INDEX t_b; DROP INDEX t_b",
    ],
    ids=["nothing", "dropped-index"],
)
def test_table_key_refuses_a_primary_key_under_replica_identity_nothing_by_name(pg_conn, catalog, schema, ddl) -> None:
    run(pg_conn, schema, ddl)
    with pytest.raises(CatalogError) as info:
        catalog.table_key(schema, "t")
    message = str(info.value)
    assert message.startswith(f"table {schema}.t has a primary key (a) but REPLICA IDENTITY NOTHING: ")
    assert "no primary key" not in message
    assert f'ALTER TABLE "{schema}"."t" REPLICA IDENTITY DEFAULT' in message


def test_source_tables_lists_tables_with_what_decides_their_key(pg_conn, catalog, schema) -> None:
    run(
        pg_conn,
        schema,
        """
        CREATE TABLE keyed (id int PRIMARY KEY);
        CREATE TABLE keyless (id int);
        CREATE TABLE full_rows (id int); ALTER TABLE full_rows REPLICA IDENTITY FULL;
        CREATE TABLE pk_nothing (id int PRIMARY KEY); ALTER TABLE pk_nothing REPLICA IDENTITY NOTHING;
        CREATE TABLE by_index (id int NOT NULL); CREATE UNIQUE INDEX by_index_id ON by_index (id);
        ALTER TABLE by_index REPLICA IDENTITY USING INDEX by_index_id;
        CREATE VIEW a_view AS SELECT * FROM keyed;
        CREATE TABLE parted (id int, region text) PARTITION BY LIST (region);
        CREATE TABLE parted_eu PARTITION OF parted FOR VALUES IN ('eu')""",
    )
    mine = {t.table: (t.replica_identity, t.has_primary_key) for t in source_tables(catalog) if t.schema == schema}
    assert mine == {
        "by_index": ("index", False),
        "full_rows": ("full", False),
        "keyed": ("default", True),
        "keyless": ("default", False),
        "parted": ("default", False),  # its partition parted_eu lands in it: listed as the root only
        "pk_nothing": ("nothing", True),
    }
    roots = catalog.partition_roots()
    parted = catalog.relation_oids([(schema, "parted")])[(schema, "parted")]
    assert roots[(schema, "parted_eu")] == (parted, (schema, "parted"))
    assert (schema, "parted") not in roots
    everything = [(t.schema, t.table) for t in source_tables(catalog)]
    assert everything == sorted(everything)
    assert not any(s in ("pg_catalog", "information_schema") for s, _ in everything)
    named = next(t for t in source_tables(catalog) if (t.schema, t.table) == (schema, "keyless"))
    assert named.describe_identity() == "REPLICA IDENTITY DEFAULT and no primary key"
    # For pgoutput: only the publication's tables; a partitioned one as its root, though the
    # publication lists its partitions (no publish_via_partition_root).
    pg_conn.execute(f"CREATE PUBLICATION pub_{schema} FOR TABLE {schema}.keyed, {schema}.full_rows, {schema}.parted")
    try:
        published = [t.table for t in source_tables(catalog, publication=f"pub_{schema}")]
        assert catalog.in_publication(f"pub_{schema}", schema, "parted")
        assert not catalog.in_publication(f"pub_{schema}", schema, "keyless")
    finally:
        pg_conn.execute(f"DROP PUBLICATION pub_{schema}")
    assert published == ["full_rows", "keyed", "parted"]


def test_table_key_of_a_missing_table(catalog, schema) -> None:
    with pytest.raises(CatalogError, match="does not exist"):
        catalog.table_key(schema, "nope")


def test_unorderable_columns_are_those_order_by_refuses(pg_conn, catalog, schema) -> None:
    run(
        pg_conn,
        schema,
        """
        CREATE TYPE mood AS ENUM ('sad', 'ok');
        CREATE TYPE with_json AS (x int, y json);
        CREATE TYPE plain_pair AS (x int, y text);
        CREATE DOMAIN doc AS json;
        CREATE TABLE t (i int, v varchar(3), jb jsonb, ia int[], m mood, r int4range, pp plain_pair,
                        j json, p point, x xml, ja json[], wj with_json, d doc)""",
    )
    columns = catalog.columns(schema, "t")
    assert [c.name for c in catalog.unorderable_columns(schema, "t", columns)] == ["j", "p", "x", "ja", "wj", "d"]
    sortable = [c for c in columns if c.name in ("i", "v", "jb", "ia", "m", "r", "pp")]
    assert catalog.unorderable_columns(schema, "t", sortable) == []
    assert catalog.unorderable_columns(schema, "t", []) == []
    # Inside a transaction the refused probes leave it usable (savepoints).
    with pg_conn.transaction():
        assert [c.name for c in catalog.unorderable_columns(schema, "t", columns[-2:])] == ["wj", "d"]
        assert pg_conn.execute("SELECT 1").fetchone() == (1,)


def test_in_publication(pg_conn, catalog, schema) -> None:
    run(pg_conn, schema, "CREATE TABLE a (id int PRIMARY KEY); CREATE TABLE b (id int PRIMARY KEY)")
    publication = f"{schema}_pub"
    pg_conn.execute(f'CREATE PUBLICATION "{publication}" FOR TABLE "{schema}".a')
    try:
        assert catalog.in_publication(publication, schema, "a")
        assert not catalog.in_publication(publication, schema, "b")
        assert not catalog.in_publication("no_such_publication", schema, "a")
    finally:
        pg_conn.execute(f'DROP PUBLICATION "{publication}"')


# --- type names and tables with a primary key --------------------------------------------------


def test_relation_oids_name_every_table_at_once_as_pg_class_does(pg_conn, catalog, schema) -> None:
    run(
        pg_conn,
        schema,
        'CREATE TABLE plain (id int); CREATE TABLE "Odd.Name ""q""" (id int); CREATE VIEW seen AS SELECT 1 AS x;'
        " CREATE INDEX plain_id ON plain (id)",
    )
    want = {
        name: pg_conn.execute("SELECT %s::regclass::oid::int8", (f'"{schema}".{quoted}',)).fetchone()[0]
        for name, quoted in [((schema, "plain"), "plain"), ((schema, 'Odd.Name "q"'), '"Odd.Name ""q"""')]
    }
    want[(schema, "seen")] = pg_conn.execute("SELECT %s::regclass::oid::int8", (f'"{schema}".seen',)).fetchone()[0]
    asked = [*want, (schema, "plain"), (schema, "plain_id"), (schema, "missing"), ("public", 'Odd.Name "q"')]
    assert catalog.relation_oids(asked) == want  # no index, no missing name, nothing of another schema
    assert catalog.relation_oids([]) == {}


def test_type_names_by_oid(pg_conn, catalog, schema) -> None:
    run(pg_conn, schema, "CREATE TYPE mood AS ENUM ('a')")
    oid, array_oid = pg_conn.execute(
        "SELECT t.oid::int8, t.typarray::int8 FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace"
        " WHERE n.nspname = %s AND t.typname = 'mood'",
        (schema,),
    ).fetchone()
    names = catalog.type_names()
    assert names[23] == "integer" and names[1043] == "character varying" and names[1007] == "integer[]"
    assert names[oid] == f"{schema}.mood"
    assert names[array_oid] == f"{schema}.mood[]"
    assert all(isinstance(k, int) for k in names)


def test_pgoutput_builtin_type_table_agrees_with_the_server(catalog) -> None:
    # The pgoutput parser names built-in types from its own table when no catalog names are given:
    # every entry must be what format_type says on a real server.
    names = catalog.type_names()
    wrong = {oid: (name, names.get(oid)) for oid, name in BUILTIN_TYPE_NAMES.items() if names.get(oid) != name}
    assert wrong == {}


def test_tables_with_primary_key(pg_conn, catalog, schema) -> None:
    run(
        pg_conn,
        schema,
        """
        CREATE TABLE b_keyed (id int PRIMARY KEY);
        CREATE TABLE a_keyed (x int, y int, PRIMARY KEY (y, x));
        CREATE TABLE keyless (id int);
        CREATE TABLE unique_only (id int UNIQUE NOT NULL);
        CREATE VIEW keyed_view AS SELECT * FROM b_keyed;
        CREATE MATERIALIZED VIEW keyed_mv AS SELECT * FROM b_keyed;
        CREATE TABLE parted (id int, region text, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
        CREATE TABLE parted_eu PARTITION OF parted FOR VALUES IN ('eu');
        CREATE TABLE "Mixed Case" (id int PRIMARY KEY)""",
    )
    pg_conn.execute("CREATE TEMPORARY TABLE temp_keyed (id int PRIMARY KEY)")
    mine = [entry for entry in catalog.tables_with_primary_key() if entry[0] == schema]
    assert mine == [
        (schema, "Mixed Case"),
        (schema, "a_keyed"),
        (schema, "b_keyed"),
        (schema, "parted"),
        (schema, "parted_eu"),
    ]  # sorted by (schema, table); partitions listed with their parent
    everything = catalog.tables_with_primary_key()
    assert everything == sorted(everything)
    assert not any(s.startswith(("pg_temp", "pg_toast_temp")) for s, _ in everything)
    assert not any(s in ("pg_catalog", "information_schema") for s, _ in everything)
    # exclude_schemas replaces the default list.
    assert all(s != schema for s, _ in catalog.tables_with_primary_key(exclude_schemas=[schema]))
    assert any(s == "pg_catalog" for s, _ in catalog.tables_with_primary_key(exclude_schemas=[]))


def test_table_keys_reads_every_table_key_at_once_by_the_same_rule(pg_conn, catalog, schema) -> None:
    """The extract's writers stage keys by :meth:`Catalog.table_keys` (issue 35): one query, the
    same key as :meth:`Catalog.table_key` for each table, none for a table without one."""
    run(
        pg_conn,
        schema,
        """
        CREATE TABLE pk (a int, b text, c int, PRIMARY KEY (c, a));
        CREATE TABLE pk_full (a int PRIMARY KEY, b text); ALTER TABLE pk_full REPLICA IDENTITY FULL;
        CREATE TABLE pk_nothing (a int PRIMARY KEY); ALTER TABLE pk_nothing REPLICA IDENTITY NOTHING;
        CREATE TABLE by_index (a int, b int NOT NULL, c int NOT NULL, d text);
        CREATE UNIQUE INDEX by_index_cb ON by_index (c, b) INCLUDE (d);
        ALTER TABLE by_index REPLICA IDENTITY USING INDEX by_index_cb;
        CREATE TABLE dropped (a int PRIMARY KEY, b int NOT NULL); CREATE UNIQUE INDEX dropped_b ON dropped (b);
        ALTER TABLE dropped REPLICA IDENTITY USING INDEX dropped_b; DROP INDEX dropped_b;
        CREATE TABLE full_rows (a int, gone int, b text); ALTER TABLE full_rows DROP COLUMN gone;
        ALTER TABLE full_rows REPLICA IDENTITY FULL;
        CREATE TABLE keyless (a int);
        CREATE TABLE parted (d date PRIMARY KEY) PARTITION BY RANGE (d);
        CREATE TABLE parted_1 PARTITION OF parted FOR VALUES FROM ('2024-01-01') TO ('2025-01-01')""",
    )
    keys = {table: key for (s, table), key in catalog.table_keys().items() if s == schema}
    expected = {}
    for table in ("pk", "pk_full", "pk_nothing", "by_index", "dropped", "full_rows", "keyless", "parted", "parted_1"):
        try:
            expected[table] = catalog.table_key(schema, table)
        except CatalogError:
            continue
    assert keys == expected
    assert sorted(keys) == ["by_index", "full_rows", "parted", "parted_1", "pk", "pk_full"]
    assert keys["full_rows"].columns == ("a", "b") and keys["by_index"].columns == ("c", "b")


def test_describe_reads_many_tables_at_once_as_the_lookups_of_each(pg_conn, catalog, schema) -> None:
    """The extract describes every staged table with :meth:`Catalog.describe` (three queries): the
    same keys, refusals, replica identities, columns and ADD COLUMN defaults as one table at a time."""
    run(
        pg_conn,
        schema,
        """
        CREATE TABLE pk (a int, b text, c int, PRIMARY KEY (c, a));
        CREATE TABLE pk_nothing (a int PRIMARY KEY); ALTER TABLE pk_nothing REPLICA IDENTITY NOTHING;
        CREATE TABLE by_index (a int, b int NOT NULL, c int NOT NULL, d text);
        CREATE UNIQUE INDEX by_index_cb ON by_index (c, b) INCLUDE (d);
        ALTER TABLE by_index REPLICA IDENTITY USING INDEX by_index_cb;
        CREATE TABLE dropped (a int, b int NOT NULL); CREATE UNIQUE INDEX dropped_b ON dropped (b);
        ALTER TABLE dropped REPLICA IDENTITY USING INDEX dropped_b; DROP INDEX dropped_b;
        CREATE TABLE full_rows (a int, gone int, b text); ALTER TABLE full_rows DROP COLUMN gone;
        ALTER TABLE full_rows REPLICA IDENTITY FULL;
        CREATE TABLE keyless (a int);
        CREATE TABLE "Mixed Case" (id bigint PRIMARY KEY, g int GENERATED ALWAYS AS (id * 2) STORED);
        INSERT INTO "Mixed Case" (id) VALUES (1);
        ALTER TABLE "Mixed Case" ADD COLUMN added text DEFAULT 'x,y', ADD COLUMN when_ timestamptz DEFAULT '2024-01-02 03:04:05+00'""",
    )
    tables = ["pk", "pk_nothing", "by_index", "dropped", "full_rows", "keyless", "Mixed Case"]
    described = catalog.describe([(schema, t) for t in tables])
    assert sorted(described) == sorted((schema, t) for t in tables)
    for table in tables:
        got = described[(schema, table)]
        try:
            assert got.key == catalog.table_key(schema, table) and got.no_key is None, table
        except CatalogError as error:
            assert got.key is None and str(got.no_key) == str(error), table
        assert got.replica_identity == catalog.replica_identity(schema, table).kind, table
        assert got.columns == catalog.columns(schema, table), table
        assert got.missing_values == catalog.missing_values(schema, table), table
    assert described[(schema, "dropped")].replica_identity == "nothing"
    assert described[(schema, "Mixed Case")].missing_values["added"] == "x,y"
    assert described[(schema, "keyless")].key is None and described[(schema, "pk_nothing")].key is None
    with pytest.raises(CatalogError, match="does not exist"):
        catalog.describe([(schema, "pk"), (schema, "no_such_table")])
    assert catalog.describe([]) == {}
