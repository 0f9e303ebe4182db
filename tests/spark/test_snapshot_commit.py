"""The initial load committed as staged (spark/delta_commit.py) against the Spark append it replaces.

Real PostgreSQL, real Spark and Delta: a snapshot batch merged into a new table both ways gives
the same rows (the source's, as a multiset), schema, properties, table features and watermark; a
re-run is a no-op; a crash between placing the parts and the commit leaves no table and a re-run
completes; later batches MERGE into the committed files; the same through Spark Connect.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.parquet as pq
import pytest

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.capture.snapshot import TRUNCATE_PART, create_slot_with_snapshot, stage_snapshot
from airflow_provider_pgdecode.errors import MergeInputError
from airflow_provider_pgdecode.spark import merge_job, snapshot_commit
from airflow_provider_pgdecode.spark.merge_job import MergeOptions, app_id, merge_batches, read_delta_state
from pgdecode_testing.compare import compare_table

pytestmark = [pytest.mark.postgres, pytest.mark.spark]

TABLE = ("public", "load_items")


@pytest.fixture()
def source(pg_conn: psycopg.Connection) -> None:
    c = pg_conn
    c.execute("drop table if exists load_items")
    c.execute(
        'create table load_items (id bigint primary key, "a name" text not null, amount numeric(12,2),'
        " ratio numeric(5,-2), tags int[], placed timestamptz, local_ts timestamp, day date,"
        " flag boolean, data bytea, small smallint, doc jsonb, u uuid)"
    )
    c.execute(
        "insert into load_items select g, 'item ' || g, g * 1.25,"
        " g * 100, array[g, g % 5], '2026-01-01 00:00:00+00'::timestamptz + g * interval '1 minute',"
        " '2026-01-01'::timestamp + g * interval '1 second', '2026-01-01'::date + g % 400, g % 2 = 0,"
        " decode(md5(g::text), 'hex'), (g % 300)::smallint, jsonb_build_object('g', g),"
        " md5(g::text)::uuid from generate_series(1, 2500) g"
    )
    c.execute("insert into load_items (id, \"a name\") values (0, 'nulls everywhere else')")


def snapshot_batch(pg_dsn: str, slot: str, staging: Path) -> BatchManifest:
    with create_slot_with_snapshot(pg_dsn, slot) as (lsn, name):
        return stage_snapshot(pg_dsn, name, lsn, slot, staging, [TABLE], chunk_pages=8)


def table_path(root: str) -> str:
    return f"{root}/public/load_items"


def properties(spark: Any, path: str) -> dict[str, str]:
    return {r["key"]: r["value"] for r in spark.sql(f"SHOW TBLPROPERTIES delta.`{path}`").collect()}


def detail(spark: Any, path: str) -> dict[str, Any]:
    row = spark.sql(f"DESCRIBE DETAIL delta.`{path}`").collect()[0]
    return {k: row[k] for k in ("minReaderVersion", "minWriterVersion", "tableFeatures", "properties", "numFiles")}


def with_nan(pg_conn: psycopg.Connection) -> None:
    """25 numeric NaN, which a decimal column cannot hold: stored as NULL (and counted)."""
    pg_conn.execute("update load_items set amount = 'NaN' where id % 97 = 0 and id > 0")


def test_snapshot_parts_are_delta_ready(pg_dsn, pg_conn, source, slot_name, tmp_path: Path) -> None:
    with_nan(pg_conn)
    batch = snapshot_batch(pg_dsn, slot_name, tmp_path / "staging")
    (entry,) = batch.tables
    assert entry.files[0] == TRUNCATE_PART and entry.snapshot_files == entry.files[1:]
    assert len(entry.snapshot_files) > 1
    assert entry.numeric_specials == {"amount": 25}
    by_name = {c.name: c for c in entry.columns}
    assert by_name["amount"].arrow == "decimal128(12, 2)"
    assert by_name["ratio"].arrow == "decimal128(7, 0)"
    assert by_name["local_ts"].arrow == "timestamp[us, tz=UTC]"  # wall-clock time read as UTC
    truncate = pq.read_table(Path(batch.path) / entry.path / TRUNCATE_PART)
    assert truncate.num_rows == 1 and truncate.column("_pg_op").to_pylist() == ["T"]
    for file in entry.snapshot_files:
        part = pq.read_table(Path(batch.path) / entry.path / file)
        assert set(part.column("_pg_op").to_pylist()) == {"I"}
    # An older reader of the manifest sees an ordinary batch; the new keys are only in snapshot batches.
    written = json.loads((Path(batch.path) / "manifest.json").read_text())
    assert written["tables"][0]["snapshot_files"] == entry.snapshot_files


def test_committed_as_staged_equals_the_spark_append(pg_dsn, pg_conn, source, slot_name, spark, tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    with_nan(pg_conn)
    batch = snapshot_batch(pg_dsn, slot_name, staging)
    options = MergeOptions()
    committed, appended = str(tmp_path / "committed"), str(tmp_path / "appended")

    summary = merge_batches(spark, [str(batch.path)], committed, options)
    result = summary["tables"]["public.load_items"]
    assert result["status"] == "merged" and result["created"] and result["delta_version"] == 0, result
    assert result["inserted"] == 2501 and result["numeric_specials_nulled"] == {"amount": 25}
    log = Path(table_path(committed)) / "_delta_log"
    assert sorted(p.name for p in log.glob("*.json")) == ["00000000000000000000.json"]
    assert "pgdecode (snapshot commit)" in (log / "00000000000000000000.json").read_text()
    # The template table is gone; its first commit is kept for the next run (one file).
    kept = list((tmp_path / "committed" / merge_job.TEMPLATE_DIR).iterdir())
    assert len(kept) == 1 and kept[0].is_file() and kept[0].suffix == ".json", kept

    summary = merge_batches(
        spark, [str(batch.path)], appended, MergeOptions(**{**options.__dict__, "snapshot_commit": False})
    )
    other = summary["tables"]["public.load_items"]
    assert other["inserted"] == 2501 and other["numeric_specials_nulled"] == {"amount": 25}, other

    a = spark.read.format("delta").load(table_path(committed))
    b = spark.read.format("delta").load(table_path(appended))
    assert a.schema == b.schema
    assert [f.metadata for f in a.schema.fields] == [f.metadata for f in b.schema.fields]
    assert a.exceptAll(b).count() == 0 and b.exceptAll(a).count() == 0
    assert properties(spark, table_path(committed)) == properties(spark, table_path(appended))
    da, db = detail(spark, table_path(committed)), detail(spark, table_path(appended))
    assert {k: v for k, v in da.items() if k != "numFiles"} == {k: v for k, v in db.items() if k != "numFiles"}
    for root in (committed, appended):
        state = read_delta_state(spark, table_path(root), app_id(slot_name))
        assert state.watermark == int(batch.end), state

    # A re-run is a no-op.
    again = merge_batches(spark, [str(batch.path)], committed, options)
    assert again["tables"]["public.load_items"]["status"] == "skipped", again
    assert sorted(p.name for p in log.glob("*.json")) == ["00000000000000000000.json"]

    # The slot's next batch MERGEs into the committed files (deletion vectors, data skipping on the
    # key statistics the commit wrote): through Delta's MERGE, as a table above the light write's
    # bound would be (delta-rs would rewrite the touched parts into one file).
    pg_conn.execute("update load_items set amount = null where amount = 'NaN'")  # as Delta holds them
    pg_conn.execute("update load_items set amount = 1.5, \"a name\" = 'changed' where id % 10 = 0")
    pg_conn.execute("delete from load_items where id % 17 = 0")
    pg_conn.execute("insert into load_items (id, \"a name\") values (100000, 'new')")
    follow = extract_batch(pg_conn, slot_name, staging, checkpoint=Checkpoint.from_manifest(batch))
    summary = merge_batches(spark, [str(follow.path)], committed, MergeOptions(light_write_max_bytes=0))
    assert summary["tables"]["public.load_items"]["status"] == "merged", summary
    result_cmp = compare_table(pg_conn, spark, committed, *TABLE)
    assert result_cmp.equal, result_cmp.describe()
    # numeric_special 'error' still refuses the NaN the snapshot nulled (through the Spark path).
    with pytest.raises(MergeInputError, match="NaN"):
        merge_batches(spark, [str(batch.path)], str(tmp_path / "refused"), MergeOptions(numeric_special="error"))
    pruned = spark.read.format("delta").load(table_path(committed)).where("id = 5")
    assert len(pruned.inputFiles()) < len(spark.read.format("delta").load(table_path(committed)).inputFiles())


def test_a_crash_before_the_commit_leaves_no_table(
    pg_dsn, pg_conn, source, slot_name, spark, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = snapshot_batch(pg_dsn, slot_name, tmp_path / "staging")
    root = str(tmp_path / "delta")

    def crash(*args: Any, **kwargs: Any) -> bool:
        raise RuntimeError("killed before the commit")

    monkeypatch.setattr(snapshot_commit, "_create_if_absent", crash)
    with pytest.raises(RuntimeError, match="killed before the commit"):
        merge_batches(spark, [str(batch.path)], root, MergeOptions(park=False))
    placed = [p.name for p in Path(table_path(root)).glob("*.parquet")]
    assert placed, "the parts were placed before the crash"
    assert not (Path(table_path(root)) / "_delta_log").exists()
    assert not read_delta_state(spark, table_path(root), app_id(slot_name)).exists
    monkeypatch.undo()

    summary = merge_batches(spark, [str(batch.path)], root)
    assert summary["tables"]["public.load_items"]["status"] == "merged", summary
    result = compare_table(pg_conn, spark, root, *TABLE)
    assert result.equal, result.describe()


def test_through_spark_connect(pg_dsn, pg_conn, source, slot_name, spark_connect_server, tmp_path: Path) -> None:
    from airflow_provider_pgdecode.spark.session import build_connect_session

    batch = snapshot_batch(pg_dsn, slot_name, tmp_path / "staging")
    root = str(tmp_path / "delta")
    session = build_connect_session(spark_connect_server.url)
    try:
        summary = merge_batches(session, [str(batch.path)], root)
        result = summary["tables"]["public.load_items"]
        assert result["status"] == "merged" and result["delta_version"] == 0, result
        assert (
            "pgdecode (snapshot commit)"
            in (Path(table_path(root)) / "_delta_log" / "00000000000000000000.json").read_text()
        )
        comparison = compare_table(pg_conn, session, root, *TABLE)
        assert comparison.equal, comparison.describe()
        again = merge_batches(session, [str(batch.path)], root)
        assert again["tables"]["public.load_items"]["status"] == "skipped", again
    finally:
        session.stop()
