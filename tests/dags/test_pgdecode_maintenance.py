"""pgdecode_maintenance run through Airflow (``dag.test()``), its task a client session of the test
session's Spark Connect server, on Delta tables built by real extracts and merges: fewer files, the
same rows as PostgreSQL, every slot's watermark kept, the summary in XCom, and a batch merged again
after OPTIMIZE, VACUUM and a forced log cleanup still a no-op (for pgdecode's reader and for Delta's
own idempotent-write check)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.spark.maintenance_job import discover_tables, read_log_state
from airflow_provider_pgdecode.spark.merge_job import MergeOptions, app_id, delta_ref, merge_batches, transaction_id
from pgdecode_testing.compare import compare_table

pytestmark = [pytest.mark.postgres, pytest.mark.spark, pytest.mark.slow]

TABLES = ("mt_items", "mt_notes")


@pytest.fixture(scope="module")
def airflow_db():
    from airflow.utils import db

    db.resetdb()


def _log_files(table: Path) -> list[str]:
    return sorted(p.name for p in (table / "_delta_log").iterdir() if p.is_file())


def _data_files(table: Path) -> int:
    return sum(1 for p in table.rglob("*.parquet") if "_delta_log" not in p.parts)


def _return_value(dag_id: str, run_id: str, task_id: str) -> Any:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        row = session.scalars(
            select(XComModel).where(
                XComModel.dag_id == dag_id,
                XComModel.run_id == run_id,
                XComModel.task_id == task_id,
                XComModel.key == "return_value",
            )
        ).one()
        return json.loads(row.value) if isinstance(row.value, str) else row.value


def test_the_dag_compacts_and_vacuums_every_table_keeping_rows_and_watermarks_and_replays_stay_no_ops(
    pg_conn: psycopg.Connection[Any],
    slot_name: str,
    connect: Any,
    merge_through_connect: None,
    airflow_db: None,
    tmp_path: Path,
) -> None:
    from airflow.dag_processing.dagbag import DagBag
    from airflow.utils.state import DagRunState

    c = pg_conn
    c.execute("drop table if exists mt_items, mt_notes")
    c.execute(
        "create table mt_items (id int primary key, name text, qty int);"
        " create table mt_notes (id bigint primary key, body text)"
    )
    c.execute("select pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot_name,))
    staging, delta_root = tmp_path / "staging", str(tmp_path / "delta")
    checkpoint, batches = None, []
    for run in range(4):  # four merges: many small files, deletion vectors from the updates and deletes
        base = run * 40
        c.execute(
            "insert into mt_items select g, 'item ' || g, g from generate_series(%s::int, %s::int) g", (base, base + 39)
        )
        c.execute(
            "insert into mt_notes select g, repeat('n', 50) from generate_series(%s::int, %s::int) g", (base, base + 19)
        )
        if run:
            c.execute("update mt_items set qty = qty + 1 where id %% 7 = %s", (run,))
            c.execute("delete from mt_items where id between %s and %s", (base - 40, base - 35))
            c.execute("delete from mt_notes where id = %s", (base - 20,))
        manifest = extract_batch(c, slot_name, staging, checkpoint=checkpoint)
        # Through Delta's MERGE: delta-rs would rewrite these small tables' touched files into one,
        # without deletion vectors, leaving OPTIMIZE and the purge nothing to do.
        summary = merge_batches(connect, [str(manifest.path)], delta_root, MergeOptions(light_write_max_bytes=0))
        assert summary["tables"]["public.mt_items"]["status"] == "merged", summary
        c.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot_name, manifest.end_lsn))
        checkpoint = Checkpoint.from_manifest(manifest)
        batches.append(str(manifest.path))
    items = Path(delta_root) / "public" / "mt_items"
    slot_app = app_id(slot_name)
    before = {t: read_log_state(connect, str(Path(delta_root) / "public" / t)) for t in TABLES}
    assert all(slot_app in state.transactions for state in before.values()), before
    assert sorted(r.name for r in discover_tables(connect, delta_root)) == ["public.mt_items", "public.mt_notes"]

    (Path(delta_root) / "public" / "not_delta").mkdir()  # a directory without a Delta log is left alone

    # Through the DAG: VACUUM with retention 0 (opted in) removes the compacted files at once;
    # Z-ORDER BY the key; the deletion vectors purged.
    bag = DagBag(dag_folder=str(Path(__file__).resolve().parents[2] / "dags"))
    assert not bag.import_errors, bag.import_errors
    conf = {
        "delta_root": delta_root,
        "retention_hours": 0,
        "allow_short_retention": True,
        "zorder": True,
        "purge_deletion_vectors": True,
    }
    data_files_before = _data_files(items)
    dag_run = bag.dags["pgdecode_maintenance"].test(run_conf=conf)
    states = {ti.task_id: ti.state for ti in dag_run.get_task_instances()}
    assert dag_run.state == DagRunState.SUCCESS, states
    summary = _return_value("pgdecode_maintenance", dag_run.run_id, "maintenance")
    assert sorted(summary["tables"]) == ["public.mt_items", "public.mt_notes"]
    entry = summary["tables"]["public.mt_items"]
    assert entry["files_before"] >= 4 and entry["files_after"] == 1, entry
    assert entry["zorder_by"] == ["id"] and entry["optimized"] and entry["deletion_vectors_purged"]
    assert entry["vacuumed"] and entry["files_removed"] > 0 and entry["retention_hours"] == 0
    assert entry["storage_files_before"] >= data_files_before > entry["storage_files_after"]
    assert _data_files(items) == 1
    for table in TABLES:
        e = summary["tables"][f"public.{table}"]
        assert e["transactions_before"] == e["transactions_after"] == {slot_app: before[table].transactions[slot_app]}
        assert e["version_after"] > e["version_before"]
        result = compare_table(c, connect, delta_root, "public", table)
        assert result.equal, result.describe()

    # A forced log cleanup: a checkpoint on every commit and a log retention of one hour, the log's
    # commits made to look three days old; the next commit checkpoints and deletes the old commits.
    connect.sql(
        f"ALTER TABLE {delta_ref(str(items))} SET TBLPROPERTIES "
        "('delta.checkpointInterval' = '1', 'delta.logRetentionDuration' = 'interval 1 hours',"
        " 'delta.deletedFileRetentionDuration' = 'interval 1 hours')"  # Delta: log retention >= this one
    ).collect()
    old = time.time() - 3 * 86400
    for name in _log_files(items):
        if name.endswith(".json") or ".checkpoint." in name:
            os.utime(items / "_delta_log" / name, (old, old))
    connect.sql(f"ALTER TABLE {delta_ref(str(items))} SET TBLPROPERTIES ('pgdecode.test.cleanup' = '1')").collect()
    names = _log_files(items)
    assert f"{0:020d}.json" not in names, names  # the first commits are gone
    assert any(".checkpoint." in n for n in names), names
    state = read_log_state(connect, str(items))
    assert state.transactions[slot_app] == before["mt_items"].transactions[slot_app]

    # Every batch merged again: skipped, nothing committed.
    versions = {t: read_log_state(connect, str(Path(delta_root) / "public" / t)).version for t in TABLES}
    again = merge_batches(connect, batches, delta_root)
    assert all(e["status"] == "skipped" for e in again["tables"].values()), again
    assert {t: read_log_state(connect, str(Path(delta_root) / "public" / t)).version for t in TABLES} == versions
    # Delta's own idempotent-write check still knows the watermark: a write carrying it is skipped.
    with transaction_id(connect, slot_name, state.transactions[slot_app]):
        connect.sql(f"UPDATE {delta_ref(str(items))} SET qty = -1").collect()
    assert read_log_state(connect, str(items)).version == versions["mt_items"]
    result = compare_table(c, connect, delta_root, "public", "mt_items")
    assert result.equal, result.describe()
