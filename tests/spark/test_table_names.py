"""Odd table names go through extract and merge into Delta, with both plugins; PostgreSQL is the oracle."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.errors import MergeInputError
from airflow_provider_pgdecode.operators.merge import delta_table_asset
from airflow_provider_pgdecode.spark.merge_job import merge_batches
from pgdecode_testing.compare import compare_table
from tests.conftest import PLUGIN_REPEAT, full_only

pytestmark = [pytest.mark.postgres, pytest.mark.spark]

SCHEMA = "odd names/x"
# A slash, a dot, a space, a percent escape, a colon, unicode and a name of dots (the unit tests of
# delta_table_path cover backquotes; glob characters and quotes went through this test as well).
NAMES = ("c/d", "a.b", "x y", "%41", "a:b", "tàble ☃", "..")
PUBLICATION = "odd_names_pub"


@pytest.fixture()
def odd_tables(pg_conn: psycopg.Connection):
    pg_conn.execute(sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(SCHEMA)))
    pg_conn.execute(sql.SQL("create schema {}").format(sql.Identifier(SCHEMA)))
    for name in NAMES:
        pg_conn.execute(sql.SQL("create table {} (id int primary key, v text)").format(sql.Identifier(SCHEMA, name)))
    pg_conn.execute(
        sql.SQL("create publication {} for tables in schema {}").format(
            sql.Identifier(PUBLICATION), sql.Identifier(SCHEMA)
        )
    )
    yield
    pg_conn.execute(sql.SQL("drop publication if exists {}").format(sql.Identifier(PUBLICATION)))
    pg_conn.execute(sql.SQL("drop schema if exists {} cascade").format(sql.Identifier(SCHEMA)))


@pytest.mark.slow  # seven tables, seven MERGEs: 70-145 s on a busy 2-core machine
@pytest.mark.parametrize("plugin", ["test_decoding", full_only("pgoutput", PLUGIN_REPEAT)])
def test_odd_table_names_flow_into_their_own_delta_tables(
    pg_conn, slot_name, odd_tables, spark, tmp_path: Path, plugin: str
) -> None:
    pg_conn.execute("select pg_create_logical_replication_slot(%s, %s, false, true)", (slot_name, plugin))
    publication = PUBLICATION if plugin == "pgoutput" else None
    staging, delta_root = tmp_path / "staging", str(tmp_path / "delta")
    for index, name in enumerate(NAMES):
        table = sql.Identifier(SCHEMA, name)
        pg_conn.execute(sql.SQL("insert into {} select g, {} from generate_series(1, 5) g").format(table, index))
        pg_conn.execute(sql.SQL("update {} set v = 'changed' where id = 2").format(table))
        pg_conn.execute(sql.SQL("delete from {} where id = 1").format(table))
    manifest = extract_batch(pg_conn, slot_name, staging, plugin=plugin, publication=publication)
    assert len({t.path for t in manifest.tables}) == len(NAMES)
    summary = merge_batches(spark, [str(manifest.path)], delta_root)
    assert {(t["schema"], t["table"]) for t in summary["tables"].values() if t["status"] == "merged"} == {
        (SCHEMA, name) for name in NAMES
    }
    # Every table has its own Delta directory, one level below the schema's.
    paths = {t["delta_path"] for t in summary["tables"].values()}
    assert len(paths) == len(NAMES)
    assert {Path(p).parent for p in paths} == {Path(delta_root) / "odd names%2Fx"}
    # The Asset of each table is the merge job's path.
    for info in summary["tables"].values():
        assert delta_table_asset(delta_root, info["schema"], info["table"]).uri == Path(info["delta_path"]).as_uri()

    for name in NAMES:
        result = compare_table(pg_conn, spark, delta_root, SCHEMA, name)
        assert result.equal, result.describe()
        assert result.source_rows == 4


@pytest.fixture()
def renamed_tables(pg_conn: psycopg.Connection):
    pg_conn.execute("drop table if exists rn_items, rn_items_v2; drop publication if exists rn_items_pub")
    pg_conn.execute("create table rn_items (id int primary key, v text, qty int)")
    pg_conn.execute("create publication rn_items_pub for all tables")
    yield
    pg_conn.execute("drop table if exists rn_items, rn_items_v2; drop publication if exists rn_items_pub")


@pytest.mark.parametrize("plugin", ["test_decoding", "pgoutput"])
def test_a_table_renamed_mid_stream_keeps_flowing_into_its_delta_table(
    pg_conn, slot_name, renamed_tables, spark, tmp_path: Path, plugin: str
) -> None:
    c = pg_conn
    c.execute("select pg_create_logical_replication_slot(%s, %s, false, true)", (slot_name, plugin))
    publication = "rn_items_pub" if plugin == "pgoutput" else None
    staging, delta_root = tmp_path / "staging", str(tmp_path / "delta")
    checkpoint = None

    def cycle() -> dict:
        nonlocal checkpoint
        manifest = extract_batch(
            c,
            slot_name,
            staging,
            plugin=plugin,
            publication=publication,
            checkpoint=checkpoint,
            tables=["public.rn_items"],  # as configured before the rename
        )
        summary = merge_batches(spark, [str(manifest.path)], delta_root)
        c.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot_name, manifest.end_lsn))
        checkpoint = Checkpoint.from_manifest(manifest)
        return summary

    c.execute("insert into rn_items select g, 'v' || g, g from generate_series(1, 10) g")
    cycle()
    # One batch: changes under the old name, the rename, changes under the new name (the same rows too),
    # and a column added and one dropped after the rename.
    c.execute("update rn_items set v = 'old name' where id <= 3")
    c.execute("alter table rn_items rename to rn_items_v2")
    c.execute("update rn_items_v2 set v = 'new name' where id = 3")
    c.execute("delete from rn_items_v2 where id = 4")
    c.execute("insert into rn_items_v2 values (11, 'eleven', 11)")
    c.execute("alter table rn_items_v2 add column note text, drop column qty")
    c.execute("update rn_items_v2 set note = 'noted' where id in (1, 11)")
    summary = cycle()
    assert list(summary["tables"]) == ["public.rn_items"]
    assert summary["tables"]["public.rn_items"]["columns_added"] == ["note"]
    result = compare_table(c, spark, delta_root, "public", "rn_items_v2", delta_table=("public", "rn_items"))
    assert result.equal, result.describe()
    assert result.source_rows == 10

    # Later batches hold the new name only; they flow into the same Delta table.
    c.execute("delete from rn_items_v2 where id = 1")
    c.execute("insert into rn_items_v2 values (12, 'twelve', 'n')")
    cycle()
    result = compare_table(c, spark, delta_root, "public", "rn_items_v2", delta_table=("public", "rn_items"))
    assert result.equal, result.describe()
    assert not Path(delta_root, "public", "rn_items_v2").exists()

    # A type change Delta cannot widen is refused, naming the table, the column, both types and
    # the way forward.
    c.execute("alter table rn_items_v2 alter column v type integer using length(v)")
    c.execute("insert into rn_items_v2 values (13, 8, null)")
    with pytest.raises(MergeInputError) as refused:
        cycle()
    message = str(refused.value)
    assert "public.rn_items column 'v' changed type from string" in message and "'integer'" in message
    assert "resnapshot public.rn_items_v2 (pgdecode_backfill mode=resnapshot)" in message  # the name it has now
