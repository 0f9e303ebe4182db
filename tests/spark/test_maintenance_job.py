"""The maintenance job (OPTIMIZE, VACUUM) on Delta tables built by real merges, through the session's
Spark Connect server: fewer files, the same rows as PostgreSQL, every slot's watermark kept, and a
batch merged again after OPTIMIZE, VACUUM and a forced log cleanup still a no-op (for pgdecode's
reader and for Delta's own idempotent-write check). Unsafe retentions are refused before any write."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.errors import ConfigurationError, MaintenanceRefusedError
from airflow_provider_pgdecode.spark.maintenance_job import (
    LogState,
    MaintenanceOptions,
    TableRef,
    discover_tables,
    maintain_tables,
    parse_interval_hours,
    read_log_state,
    zorder_columns,
)
from airflow_provider_pgdecode.spark.merge_job import app_id, delta_ref, merge_batches, transaction_id
from airflow_provider_pgdecode.spark.session import build_connect_session
from airflow_provider_pgdecode.testing.compare import compare_table
from airflow_provider_pgdecode.testing.connect_server import LocalConnectServer
from tests.spark.staged import TableChanges, write_batch

pytestmark = [pytest.mark.postgres, pytest.mark.spark]

TABLES = ("mt_items", "mt_notes")


@pytest.fixture
def connect(spark_connect_server: LocalConnectServer) -> Iterator[Any]:
    session = build_connect_session(spark_connect_server.url)
    yield session
    session.stop()


def _log_files(table: Path) -> list[str]:
    return sorted(p.name for p in (table / "_delta_log").iterdir() if p.is_file())


def _data_files(table: Path) -> int:
    return sum(1 for p in table.rglob("*.parquet") if "_delta_log" not in p.parts)


def test_optimize_and_vacuum_keep_the_rows_and_the_watermarks_and_replays_stay_no_ops(
    pg_conn: psycopg.Connection[Any], slot_name: str, connect: Any, tmp_path: Path
) -> None:
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
        summary = merge_batches(connect, [str(manifest.path)], delta_root)
        assert summary["tables"]["public.mt_items"]["status"] == "merged", summary
        c.execute("select pg_replication_slot_advance(%s, %s::pg_lsn)", (slot_name, manifest.end_lsn))
        checkpoint = Checkpoint.from_manifest(manifest)
        batches.append(str(manifest.path))
    items = Path(delta_root) / "public" / "mt_items"
    slot_app = app_id(slot_name)
    before = {t: read_log_state(connect, str(Path(delta_root) / "public" / t)) for t in TABLES}
    assert all(slot_app in state.transactions for state in before.values()), before
    assert sorted(r.name for r in discover_tables(connect, delta_root)) == ["public.mt_items", "public.mt_notes"]

    # VACUUM with retention 0 (opted in) removes the compacted files at once; Z-ORDER BY the key.
    options = MaintenanceOptions(
        zorder=True, purge_deletion_vectors=True, retention_hours=0, allow_short_retention=True
    )
    data_files_before = _data_files(items)
    summary = maintain_tables(connect, delta_root, options=options)
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
    json.dumps(summary)  # XCom-ready

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


COLUMNS = [("id", "integer", pa.int32()), ("name", "text", pa.string())]


def test_intervals_and_an_absent_root() -> None:
    assert parse_interval_hours("interval 1 week") == 168
    assert parse_interval_hours("interval 2 days 12 hours") == 60
    assert parse_interval_hours("30 days") == 720
    assert parse_interval_hours("INTERVAL 90 MINUTES") == 1.5
    with pytest.raises(ConfigurationError, match="unit 'month'"):
        parse_interval_hours("interval 1 month")
    assert discover_tables(None, "/nonexistent/pgdecode/delta") == []  # type: ignore[arg-type]
    ref = TableRef("public", "t", "/data/delta/public/t")
    assert zorder_columns(ref, LogState(0, {}, {"pgdecode.key": '["id"]'})) == ["id"]
    assert zorder_columns(ref, LogState(0, {}, {})) == []  # append_only: no key
    assert zorder_columns(ref, LogState(0, {}, {"pgdecode.key": json.dumps(list("abcde"))})) == []  # keyless FULL


def _small_table(connect: Any, root: Path, slot: str) -> Path:
    changes = TableChanges("public", "mt_small", COLUMNS)
    for i in range(1, 6):
        changes.insert(100 + i, id=i, name=f"row {i}")
    merge_batches(connect, [write_batch(root / "staging", slot, 100, 200, [changes])], str(root / "delta"))
    return root / "delta" / "public" / "mt_small"


def test_unsafe_retentions_are_refused_before_any_write(connect: Any, tmp_path: Path) -> None:
    table = _small_table(connect, tmp_path, "pgdecode_mt_refuse")
    root = str(tmp_path / "delta")
    version = read_log_state(connect, str(table)).version

    # A VACUUM retention under Delta's safety check, without the opt-in.
    with pytest.raises(MaintenanceRefusedError) as refused:
        maintain_tables(connect, root, ["public.mt_small"], MaintenanceOptions(retention_hours=1))
    message = str(refused.value)
    assert "public.mt_small" in message and str(table) in message
    assert "168 hours" in message and "allow_short_retention" in message
    assert read_log_state(connect, str(table)).version == version

    # Transaction ids that Delta would expire after a day: refused, whatever the other options.
    connect.sql(
        f"ALTER TABLE {delta_ref(str(table))} SET TBLPROPERTIES ('delta.setTransactionRetentionDuration' = 'interval 1 days')"
    ).collect()
    version = read_log_state(connect, str(table)).version
    with pytest.raises(MaintenanceRefusedError) as refused:
        maintain_tables(connect, root, options=MaintenanceOptions(vacuum=False))
    message = str(refused.value)
    assert "public.mt_small" in message and "delta.setTransactionRetentionDuration" in message
    assert "applied twice" in message and "UNSET TBLPROPERTIES ('delta.setTransactionRetentionDuration')" in message
    assert read_log_state(connect, str(table)).version == version
    # Long enough: accepted.
    connect.sql(
        f"ALTER TABLE {delta_ref(str(table))} SET TBLPROPERTIES ('delta.setTransactionRetentionDuration' = 'interval 60 days')"
    ).collect()
    summary = maintain_tables(connect, root, options=MaintenanceOptions(vacuum=False))
    entry = summary["tables"]["public.mt_small"]
    assert entry["transactions_after"] == entry["transactions_before"] == {app_id("pgdecode_mt_refuse"): 200}


@pytest.mark.s3
def test_tables_on_object_storage_are_found_compacted_and_vacuumed(
    connect: Any, tmp_path: Path, s3_bucket: str, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Delta root on the session's S3 server: the tables are found by listing it, compacted,
    vacuumed (the files removed counted on the store), their watermarks kept."""
    for name, value in s3_server.settings.to_env().items():  # how the job gets the store's settings
        monkeypatch.setenv(name, value)
    slot, root = "pgdecode_mt_s3", f"{s3_bucket}/delta"
    for run in range(3):
        changes = TableChanges("public", "mt_s3", COLUMNS)
        for i in range(1, 6):
            changes.insert(100 * run + 10 + i, id=run * 10 + i, name=f"row {i}")
        merge_batches(connect, [write_batch(tmp_path / "staging", slot, 100 * run, 100 * run + 100, [changes])], root)
    rows = sorted(tuple(r) for r in connect.read.format("delta").load(f"s3a://{root[5:]}/public/mt_s3").collect())
    summary = maintain_tables(connect, root, options=MaintenanceOptions(retention_hours=0, allow_short_retention=True))
    entry = summary["tables"]["public.mt_s3"]
    assert entry["delta_path"] == f"s3a://{root[5:]}/public/mt_s3"
    assert entry["files_before"] == 3 and entry["files_after"] == 1 and entry["files_removed"] == 3, entry
    assert entry["transactions_before"] == entry["transactions_after"] == {app_id(slot): 300}
    assert sorted(tuple(r) for r in connect.read.format("delta").load(entry["delta_path"]).collect()) == rows


class _Conflicting:
    """A session whose first OPTIMIZEs lose a Delta conflict (the error text a Connect client gets)."""

    def __init__(
        self, conflicts: int, error: str = "[DELTA_CONCURRENT_DELETE_READ] ConcurrentDeleteReadException"
    ) -> None:
        self.conflicts, self.error, self.statements = conflicts, error, []

    def sql(self, statement: str) -> Any:
        self.statements.append(statement)
        if self.conflicts:
            self.conflicts -= 1
            raise RuntimeError(f"{self.error}: a concurrent transaction removed a file this one read")

        class Result:
            def collect(self) -> list[Any]:
                return []

        return Result()


def test_an_optimize_that_loses_a_conflict_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_pgdecode.spark import maintenance_job

    monkeypatch.setattr(maintenance_job.time, "sleep", lambda seconds: None)
    ref = maintenance_job.TableRef("public", "t", "/data/delta/public/t")
    session = _Conflicting(2)
    assert maintenance_job.optimize_with_retries(session, ref, ["id"], 3) == ({}, 3)  # type: ignore[arg-type]
    assert session.statements == ["OPTIMIZE delta.`/data/delta/public/t` ZORDER BY (`id`)"] * 3
    with pytest.raises(RuntimeError, match="DELTA_CONCURRENT"):
        maintenance_job.optimize_with_retries(_Conflicting(3), ref, [], 3)  # type: ignore[arg-type]
    other = _Conflicting(1, error="[DELTA_TABLE_NOT_FOUND]")
    with pytest.raises(RuntimeError, match="TABLE_NOT_FOUND"):  # anything else is not retried
        maintenance_job.optimize_with_retries(other, ref, [], 3)  # type: ignore[arg-type]
    assert len(other.statements) == 1
