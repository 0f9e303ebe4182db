"""ADD COLUMN with a default, from PostgreSQL into Delta: rows written before the column hold the
default in PostgreSQL (its fast default, no WAL for them), and in Delta too, whether they were
merged before the ALTER or staged in the same batch; a run stopped between adding the column and
filling it fills it on its retry (issue 35)."""

from __future__ import annotations

import json

import pytest

from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.spark import column_defaults
from airflow_provider_pgdecode.spark.merge_job import delta_ref, merge_batches
from pgdecode_testing.compare import compare_table
from tests.conftest import two_plugin_source

pytestmark = [pytest.mark.postgres, pytest.mark.spark]

PUBLICATION = "cd_pub"


@pytest.fixture()
def source(pg_conn, slot_name):
    ddl = "create table cd_items (id int primary key, title text)"
    with two_plugin_source(pg_conn, slot_name, PUBLICATION, ["cd_items"], ddl) as slot:
        yield slot


@pytest.mark.parametrize("plugin", ["test_decoding", "pgoutput"])
def test_rows_written_before_add_column_hold_its_default_in_delta(pg_conn, source, spark, tmp_path, plugin):
    slot = source if plugin == "test_decoding" else source + "_po"
    extra = {"publication": PUBLICATION} if plugin == "pgoutput" else {}
    c = pg_conn
    root = str(tmp_path / "delta")

    def cycle(name: str) -> None:
        upto = Lsn.parse(str(c.execute("select pg_current_wal_flush_lsn()").fetchone()[0]))
        batch = extract_batch(c, slot, tmp_path / "staging", plugin=plugin, upto_lsn=upto, **extra)
        merge_batches(spark, [str(batch.path)], root)
        c.execute("select pg_replication_slot_advance(%s, %s)", (slot, str(batch.end_lsn)))

    c.execute("insert into cd_items select g, 't' || g from generate_series(1, 3) g")
    cycle("before")
    # In the next batch: a row staged before the ALTER, the ALTER, rows after it.
    c.execute("insert into cd_items values (6, 'staged before the column'), (7, 'staged before, never changed')")
    c.execute(
        "alter table cd_items add column five int default 5,"
        " add column at timestamptz default '2024-01-02 03:04:05+02', add column tags int[] default '{1,2}',"
        " add column raw bytea default '\\x0102', add column price numeric(10,2) default 1.5,"
        " add column note text default 'it''s \"quoted\"', add column plain int"
    )
    c.execute("insert into cd_items (id, title, five) values (4, 'after', 40)")
    c.execute("update cd_items set five = 7, title = 'changed' where id = 2")
    c.execute("update cd_items set title = 'only the title' where id = 3")
    c.execute("update cd_items set five = null where id = 6")  # an explicit NULL stays NULL

    # A run stopped after recording the fill and adding one column, before filling it.
    path = f"{root}/public/cd_items"
    spark.sql(
        f"ALTER TABLE {delta_ref(path)} SET TBLPROPERTIES "
        f"('{column_defaults.FILL_PROPERTY}' = '{json.dumps({'five': 5})}')"
    )
    spark.sql(f"ALTER TABLE {delta_ref(path)} ADD COLUMNS (five int)")
    cycle("after")

    result = compare_table(c, spark, root, "public", "cd_items")
    assert result.equal, result.describe()
    rows = {r["id"]: r for r in spark.read.format("delta").load(path).collect()}
    assert [rows[i]["five"] for i in (1, 2, 3, 4, 6, 7)] == [5, 7, 5, 40, None, 5]
    assert rows[7]["tags"] == [1, 2] and rows[7]["at"] is not None and rows[7]["price"] is not None
    assert rows[1]["tags"] == [1, 2] and bytes(rows[1]["raw"]) == b"\x01\x02" and rows[6]["note"] == 'it\'s "quoted"'
    assert all(rows[i]["plain"] is None for i in rows)
    properties = {r["key"] for r in spark.sql(f"SHOW TBLPROPERTIES {delta_ref(path)}").collect()}
    assert column_defaults.FILL_PROPERTY not in properties
