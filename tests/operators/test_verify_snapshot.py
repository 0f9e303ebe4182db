"""The verify snapshot operator against a real PostgreSQL: the copy, its XCom, and its refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.capture.verify import VerifySnapshot, verify_area
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.operators.verify_snapshot import PgDecodeVerifySnapshotOperator

pytestmark = pytest.mark.postgres


def test_copies_the_tables_of_a_running_pipeline(pg_conn, source_conn, slot_name, tmp_path) -> None:
    pg_conn.execute("drop table if exists vs_items; create table vs_items (id int primary key, v text)")
    pg_conn.execute("insert into vs_items select g, 'v' || g from generate_series(1, 40) g")
    operator = PgDecodeVerifySnapshotOperator(
        task_id="verify_snapshot", slot_name=slot_name, staging_root=str(tmp_path), postgres_conn_id=source_conn
    )
    with pytest.raises(AirflowFailException, match=f"replication slot '{slot_name}' does not exist"):
        operator.execute({})
    pg_conn.execute("select pg_create_logical_replication_slot(%s, 'test_decoding')", (slot_name,))
    flushed = Lsn.parse(pg_conn.execute("select pg_current_wal_flush_lsn()::text").fetchone()[0])

    result = PgDecodeVerifySnapshotOperator(
        task_id="verify_snapshot",
        slot_name=slot_name,
        staging_root=str(tmp_path),
        tables=["public.vs_items"],
        postgres_conn_id=source_conn,
        chunk_rows="10",
    ).execute({})
    snapshot = VerifySnapshot.from_dict(result)
    assert snapshot.slot == slot_name and snapshot.tables == ("public.vs_items",)
    assert snapshot.lsn >= flushed
    assert Path(snapshot.path).is_relative_to(Path(verify_area(tmp_path, slot_name).root))
    assert [(t.table, t.inserts) for t in BatchManifest.read(snapshot.path).tables] == [("vs_items", 40)]

    with pytest.raises(AirflowFailException, match="chunk_rows and workers must be whole numbers"):
        PgDecodeVerifySnapshotOperator(
            task_id="v", slot_name=slot_name, staging_root=str(tmp_path), postgres_conn_id=source_conn, chunk_rows="x"
        ).execute({})
