"""Odd table names go through extract and merge into Delta, with both plugins; PostgreSQL is the oracle."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.operators.merge import delta_table_asset
from airflow_provider_pgdecode.spark.merge_job import merge_batches
from airflow_provider_pgdecode.testing.compare import compare_table

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


@pytest.mark.parametrize("plugin", ["test_decoding", "pgoutput"])
def test_odd_table_names_flow_into_their_own_delta_tables(
    pg_conn, slot_name, odd_tables, spark, tmp_path: Path, plugin: str
) -> None:
    pg_conn.execute("select pg_create_logical_replication_slot(%s, %s, false, true)", (slot_name, plugin))
    publication = PUBLICATION if plugin == "pgoutput" else None
    staging, delta_root = tmp_path / "staging", str(tmp_path / "delta")
    checkpoint = None

    def cycle() -> dict:
        nonlocal checkpoint
        manifest = extract_batch(
            pg_conn, slot_name, staging, plugin=plugin, publication=publication, checkpoint=checkpoint
        )
        summary = merge_batches(spark, [str(manifest.path)], delta_root)
        pg_conn.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot_name, manifest.end_lsn))
        checkpoint = Checkpoint.from_manifest(manifest)
        return summary

    for index, name in enumerate(NAMES):
        table = sql.Identifier(SCHEMA, name)
        pg_conn.execute(sql.SQL("insert into {} select g, {} from generate_series(1, 5) g").format(table, index))
        pg_conn.execute(sql.SQL("update {} set v = 'changed' where id = 2").format(table))
    summary = cycle()
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
        table = sql.Identifier(SCHEMA, name)
        pg_conn.execute(sql.SQL("delete from {} where id = 1").format(table))
        pg_conn.execute(sql.SQL("insert into {} values (6, 'six')").format(table))
    cycle()
    for name in NAMES:
        result = compare_table(pg_conn, spark, delta_root, SCHEMA, name)
        assert result.equal, result.describe()
        assert result.source_rows == 5
