"""pgbench's workload end to end: its keyless history table loaded append_only, every table equal.

pgbench_history has no key (REPLICA IDENTITY DEFAULT) and only receives inserts; the other
pgbench tables have primary keys. With ``tables=[]`` (the DAG default) and the history
``append_only``, the extract operator loads all four, and PostgreSQL is the oracle.
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.operators.extract import PgDecodeExtractOperator
from airflow_provider_pgdecode.spark.merge_job import merge_batches
from pgdecode_testing.compare import compare_table
from pgdecode_testing.postgres_cluster import find_bindir
from tests.conftest import PLUGIN_REPEAT, full_only

pytestmark = [pytest.mark.postgres, pytest.mark.spark, pytest.mark.slow]

TABLES = ("pgbench_accounts", "pgbench_branches", "pgbench_history", "pgbench_tellers")


@pytest.mark.parametrize("plugin", [full_only("test_decoding", PLUGIN_REPEAT), "pgoutput"])
def test_pgbench_with_an_append_only_history_through_both_plugins(
    pg_cluster: Any, monkeypatch: pytest.MonkeyPatch, spark: Any, tmp_path: Path, plugin: str
) -> None:
    database = f"bench_{uuid.uuid4().hex[:8]}"
    pg_cluster.create_database(database)
    monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_DEFAULT", pg_cluster.airflow_conn_json(database))
    slot = f"bench_{uuid.uuid4().hex[:8]}"
    pgbench = [str(find_bindir() / "pgbench"), "-h", pg_cluster.host, "-p", str(pg_cluster.port)]
    pgbench += ["-U", pg_cluster.user]
    staging, delta_root = tmp_path / "staging", str(tmp_path / "delta")
    conn = pg_cluster.connect(database)
    try:
        conn.execute("CREATE PUBLICATION bench FOR ALL TABLES")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, %s, false, true)", (slot, plugin))
        subprocess.run([*pgbench, "-i", "-s", "1", "-q", database], check=True, capture_output=True)
        subprocess.run([*pgbench, "-T", "5", "-c", "2", database], check=True, capture_output=True)
        checkpoint: dict[str, Any] | None = None

        def cycle() -> BatchManifest:
            nonlocal checkpoint
            extract = PgDecodeExtractOperator(
                task_id="extract",
                slot_name=slot,
                staging_root=str(staging),
                plugin=plugin,
                publication="bench" if plugin == "pgoutput" else None,
                table_options={"public.pgbench_history": {"mode": "append_only"}},
                checkpoint_task_id=None,
                checkpoint=checkpoint,
            )
            summary = extract.execute({})
            manifest = BatchManifest.read(summary["path"])
            merge_batches(spark, [summary["path"]], delta_root)
            conn.execute("SELECT pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, manifest.end_lsn))
            checkpoint = Checkpoint.from_manifest(manifest).to_dict()
            for table in TABLES:
                result = compare_table(conn, spark, delta_root, "public", table)
                assert result.equal, result.describe()
            return manifest

        manifest = cycle()
        history = next(t for t in manifest.tables if t.table == "pgbench_history")
        assert history.mode == "append_only" and history.inserts > 0
        assert {t.table for t in manifest.tables} == set(TABLES)

        # A TRUNCATE of the history empties its Delta table; the inserts after it stay.
        conn.execute("TRUNCATE pgbench_history")
        subprocess.run([*pgbench, "-t", "20", "-c", "2", database], check=True, capture_output=True)
        manifest = cycle()
        history = next(t for t in manifest.tables if t.table == "pgbench_history")
        # Ours, and pgbench's own (it truncates pgbench_history before a run unless -n).
        assert history.truncates == 2 and history.inserts == 40
    finally:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        conn.close()
