"""PostgreSQL is the oracle: after real workloads, extracted and merged, Delta equals the source."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.spark.merge_job import MergeOptions, merge_batches
from pgdecode_testing.compare import compare_table
from tests.conftest import FULL_TESTS, SESSION_MAJOR

pytestmark = [pytest.mark.postgres, pytest.mark.spark]

TABLES = ("or_customers", "or_orders", "or_types")
PUBLICATION = "oracle_pub"


MATRIX_REPEAT = (
    "the other plugin runs the oracle on this PostgreSQL, and test_both_plugins_stage_the_same_changes "
    "shows both plugins stage the same rows on it"
)


# `make test` merges the oracle on the session's major and on the oldest and newest supported
# ones; the majors between them change nothing the decoding and extract matrix tests do not see.
CI_MAJORS = (SESSION_MAJOR, 14, 18)
MIDDLE_MAJOR = (
    "the oracle runs on the oldest, the newest and the session's major, and the decoding and extract"
    " tests run on this one"
)


def oracle_plugin(major: int) -> str:
    """The plugin the oracle runs with on a major (both with PGDECODE_FULL_TESTS=1): test_decoding
    on the session's, then the plugins take turns on the matrix's, so each is merged on several."""
    if major == SESSION_MAJOR:
        return "test_decoding"
    others = [m for m in (14, 15, 16, 17, 18) if m != SESSION_MAJOR]
    return ("pgoutput", "test_decoding")[others.index(major) % 2]


def delta_version(spark, path: str) -> int:
    return spark.sql(f"DESCRIBE HISTORY delta.`{path}`").selectExpr("max(version)").first()[0]


@pytest.fixture()
def source(pg_conn: psycopg.Connection, slot_name: str):
    c = pg_conn
    c.execute(f"drop table if exists {', '.join(TABLES)} cascade; drop publication if exists {PUBLICATION}")
    c.execute("drop type if exists or_mood")
    c.execute("create type or_mood as enum ('happy', 'sad')")
    c.execute(
        "create table or_customers (id int primary key, name text not null, email varchar(80), note text);"
        " alter table or_customers alter column note set storage external;"
        " create table or_orders (id bigint primary key, customer_id int, amount numeric(12,2), status text,"
        "  tags text[], placed timestamptz);"
        " create table or_types (id int primary key, s smallint, b bigint, r real, d double precision,"
        "  n numeric, bo boolean, dt date, ts timestamp, tz timestamptz, u uuid, j json, jb jsonb, by bytea,"
        "  ia int[], ta text[], m or_mood, v varchar(10), c char(3));"
        f" create publication {PUBLICATION} for table {', '.join(TABLES)}"
    )
    c.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot_name,))
    # pgoutput decodes two-phase from 15 (protocol 3): on 14 its slot sees COMMIT PREPARED only.
    po_two_phase = int(c.info.server_version) >= 150000
    c.execute("select pg_create_logical_replication_slot(%s, 'pgoutput', false, %s)", (slot_name + "_po", po_two_phase))
    yield slot_name
    c.execute("select pg_drop_replication_slot(%s)", (slot_name + "_po",))
    c.execute(f"drop publication if exists {PUBLICATION}")


def round_one(c: psycopg.Connection) -> None:
    c.execute(
        "insert into or_customers select g, 'customer ' || g, 'c' || g || '@example.com', repeat('n', 3000)"
        " from generate_series(1, 40) g"
    )
    c.execute(
        "insert into or_orders select g, 1 + g % 40, g * 1.25, 'new', array['a', 'b' || g], '2026-01-01 00:00:00+00'::timestamptz + g * interval '1 hour'"
        " from generate_series(1, 200) g"
    )
    c.execute(
        "insert into or_types values (1, -32768, 9223372036854775807, 1.5, 'NaN', 123456789.123456789, true,"
        " '2024-02-29', '2024-01-02 03:04:05.123456', '2024-01-02 03:04:05+05:30',"
        " 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{\"a\": 1}', '{\"b\": [1, 2]}', '\\x00ff', '{1,NULL,3}',"
        " e'{\"x y\",NULL,\"q''\\\\\"u\",\"null\"}', 'sad', e'it''s\\nnl', 'ab'),"
        " (2, null, null, '-Infinity', 'Infinity', null, false, null, null, null, null, null, null, null, '{}',"
        " null, null, null, null)"
    )
    c.execute("update or_customers set name = e'O''Brien \"quoted\"\\nline' where id = 3")
    c.execute("update or_customers set email = null where id = 4")
    c.execute("begin; update or_orders set status = 'paid' where id <= 20; prepare transaction 'or_later'")
    c.execute("begin; delete from or_orders where id > 190; prepare transaction 'or_never'")


def round_two(c: psycopg.Connection) -> None:
    c.execute("commit prepared 'or_later'")
    c.execute("rollback prepared 'or_never'")
    c.execute("update or_customers set email = 'moved@example.com' where id = 5")  # note stays unchanged TOAST
    c.execute("update or_customers set id = 1005 where id = 6")  # key change moves the row
    c.execute("delete from or_orders where id between 50 and 60")
    with c.transaction():  # TRUNCATE in the middle of a batch, changes after it still apply
        c.execute("insert into or_orders values (9001, 1, 1.00, 'before truncate', null, null)")
        c.execute("truncate or_orders")
        c.execute("insert into or_orders values (9002, 2, 2.00, 'after truncate', '{}', now())")
    c.execute("insert into or_orders values (9003, 3, 3.00, 'later', '{z}', now())")
    c.execute("update or_types set r = 2.5, m = 'happy', ta = '{}' where id = 1")
    c.execute("insert into or_customers values (41, 'new', null, null)")


@pytest.mark.pg_matrix
@pytest.mark.parametrize("plugin", ["test_decoding", "pgoutput"])
def test_delta_equals_postgres_across_batches_and_replays(
    pg_conn, source, spark, tmp_path: Path, plugin: str, pg_version: int
) -> None:
    # On the session's PostgreSQL the whole test; on the matrix's other majors what the server
    # changes (extract of both rounds, merged and compared), not the Spark side again (the
    # compiled expressions, the deletes-only part, the replay).
    whole = pg_version == SESSION_MAJOR
    if plugin != oracle_plugin(pg_version) and not FULL_TESTS:
        pytest.skip(f"{MATRIX_REPEAT}; PGDECODE_FULL_TESTS=1 runs it")
    if pg_version not in CI_MAJORS and not FULL_TESTS:
        pytest.skip(f"{MIDDLE_MAJOR}; PGDECODE_FULL_TESTS=1 runs it")
    slot = source if plugin == "test_decoding" else source + "_po"
    publication = PUBLICATION if plugin == "pgoutput" else None
    staging, delta_root = tmp_path / "staging", str(tmp_path / "delta")
    # or_mood is an enum: the manifest says so, it maps to string. These runs are small, so they
    # would evaluate Spark expressions interpreted, as every other small merge test does: this one
    # compiles them (codegen_min_changes=0), so the compiled path stays under the oracle.
    options = MergeOptions(codegen_min_changes=0) if whole else MergeOptions()
    batches: list[str] = []
    checkpoint = None

    def cycle() -> None:
        nonlocal checkpoint
        manifest = extract_batch(pg_conn, slot, staging, plugin=plugin, publication=publication, checkpoint=checkpoint)
        merge_batches(spark, [str(manifest.path)], delta_root, options)
        pg_conn.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, manifest.end_lsn))
        checkpoint = Checkpoint.from_manifest(manifest)
        batches.append(str(manifest.path))

    round_one(pg_conn)
    cycle()
    two_phase = plugin == "test_decoding" or pg_version >= 15
    assert [p["gid"] for p in checkpoint.prepared_pending] == (["or_later", "or_never"] if two_phase else [])
    # The prepared transactions are not in Delta yet: the source without them is what Delta shows.
    orders = compare_table(pg_conn, spark, delta_root, "public", "or_orders")
    assert orders.equal, orders.describe()

    round_two(pg_conn)
    cycle()
    for table in TABLES:
        result = compare_table(pg_conn, spark, delta_root, "public", table)
        assert result.equal, result.describe()
        assert result.source_rows > 0
    if not whole:
        return

    # A batch in which a table has only DELETEs (its part files carry no new tuples).
    pg_conn.execute("delete from or_customers where id in (1, 2)")
    cycle()
    result = compare_table(pg_conn, spark, delta_root, "public", "or_customers")
    assert result.equal, result.describe()

    # Replaying every batch changes nothing, not even Delta's version.
    versions = {t: delta_version(spark, f"{delta_root}/public/{t}") for t in TABLES}
    summary = merge_batches(spark, batches, delta_root, options)
    assert all(entry["status"] == "skipped" for entry in summary["tables"].values()), summary
    assert {t: delta_version(spark, f"{delta_root}/public/{t}") for t in TABLES} == versions
    for table in TABLES:
        assert compare_table(pg_conn, spark, delta_root, "public", table).equal
