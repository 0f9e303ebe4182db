"""The maintenance job (OPTIMIZE, VACUUM) through the session's Spark Connect server: unsafe
retentions refused before any write, tables on object storage found, compacted and vacuumed, a lost
conflict tried again. Its run on tables built by real merges, through the maintenance DAG, with
replays after a forced log cleanup: tests/dags/test_pgdecode_maintenance.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

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
from airflow_provider_pgdecode.spark.merge_job import app_id, delta_ref, merge_batches
from tests.spark.staged import TableChanges, write_batch

pytestmark = [pytest.mark.postgres, pytest.mark.spark]

TABLES = ("mt_items", "mt_notes")


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
