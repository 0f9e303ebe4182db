"""Generated columns in Delta: what the slot's changes carry, from the initial load on (issue 37).

test_decoding prints stored generated columns, so they are loaded and kept up to date; pgoutput
sends them only with publish_generated_columns = stored (PostgreSQL 18), so without it the
initial load leaves them out too (named in the manifest), never a column the changes leave stale.
On 17 and 18, through both plugins, and on 18 with the publication publishing them."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.snapshot import create_slot_with_snapshot, stage_snapshot
from airflow_provider_pgdecode.spark.merge_job import merge_batches

pytestmark = [pytest.mark.postgres, pytest.mark.spark]

PUBLICATION = "gen_pub"


@pytest.mark.pg_matrix(since=17)
@pytest.mark.parametrize("plugin", ["test_decoding", "pgoutput", "pgoutput_stored"])
def test_delta_holds_the_generated_columns_the_changes_carry(
    pg_conn, matrix_dsn, pg_version, slot_name, spark, tmp_path: Path, plugin
):
    stored = plugin == "pgoutput_stored"  # 18's publish_generated_columns = stored
    if stored and pg_version < 18:
        pytest.skip("publish_generated_columns came with PostgreSQL 18")
    plugin, pg_dsn = ("pgoutput" if stored else plugin), matrix_dsn
    c = pg_conn
    c.execute(f"drop table if exists gen_items; drop publication if exists {PUBLICATION}")
    c.execute("create table gen_items (id int primary key, a int, doubled int generated always as (a * 2) stored)")
    c.execute(
        f"create publication {PUBLICATION} for table gen_items"
        + (" with (publish_generated_columns = stored)" if stored else "")
    )
    c.execute("insert into gen_items (id, a) select g, g from generate_series(1, 5) g")
    publication = PUBLICATION if plugin == "pgoutput" else None
    staging, root = tmp_path / "staging", str(tmp_path / "delta")
    try:
        with create_slot_with_snapshot(pg_dsn, slot_name, plugin, two_phase=False) as snapshot:
            loaded = stage_snapshot(
                pg_dsn,
                snapshot.snapshot_name,
                snapshot.consistent_lsn,
                slot_name,
                staging,
                ["public.gen_items"],
                plugin=plugin,
                publication=publication,
            )
        merge_batches(spark, [str(loaded.path)], root)
        c.execute("update gen_items set a = a + 100 where id <= 2")
        c.execute("insert into gen_items (id, a) values (6, 6)")
        c.execute("delete from gen_items where id = 5")
        batch = extract_batch(c, slot_name, staging, plugin=plugin, publication=publication)
        merge_batches(spark, [str(batch.path)], root)
    finally:
        c.execute(f"drop publication if exists {PUBLICATION}")
    carried = ["id", "a", "doubled"] if plugin == "test_decoding" or stored else ["id", "a"]
    frame = spark.read.format("delta").load(f"{root}/public/gen_items")
    assert [f.name for f in frame.schema.fields if not f.name.startswith("_pg")] == carried
    source = sorted(c.execute(f"select {', '.join(carried)} from gen_items").fetchall())
    assert sorted(tuple(row) for row in frame.select(*carried).collect()) == source
    assert batch.tables[0].generated_not_staged == (["doubled"] if plugin == "pgoutput" and not stored else None)
