"""PgDecodeInitialSnapshotOperator against a real PostgreSQL: the slot, the staged copy, repeats and refusals."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.parquet as pq
import pytest
import structlog
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_pgdecode.batch.manifest import BatchManifest, list_batches
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.operators import PgDecodeInitialSnapshotOperator
from pgdecode_testing.postgres_cluster import ThrowawayCluster

pytestmark = pytest.mark.postgres


def new_table(conn: psycopg.Connection[Any], rows: int, key: bool = True) -> str:
    name = f"init_{uuid.uuid4().hex[:10]}"
    conn.execute(f"CREATE TABLE {name} (id int {'PRIMARY KEY' if key else ''}, v text)")
    conn.execute(f"INSERT INTO {name} SELECT g, 'v' || g FROM generate_series(1, {rows}) g")
    return name


def slot_row(conn: psycopg.Connection[Any], slot: str) -> tuple[Any, ...] | None:
    return conn.execute(
        "SELECT plugin::text, two_phase, confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
        (slot,),
    ).fetchone()


def staged_ids(manifest: BatchManifest, table: str) -> list[int]:
    summary = next(t for t in manifest.tables if t.table == table)
    data = pq.read_table(Path(manifest.path) / summary.path, columns=["id", "_pg_op"]).to_pydict()
    return sorted(i for i, op in zip(data["id"], data["_pg_op"]) if op == "I")


def test_creates_the_slot_and_stages_the_tables_at_its_consistent_point(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str, tmp_path: Path, make_context: Any
) -> None:
    orders, customers = new_table(pg_conn, 250), new_table(pg_conn, 40)
    op = PgDecodeInitialSnapshotOperator(
        task_id="initial_load",
        slot_name=slot_name,
        staging_root=str(tmp_path),
        tables=[f"public.{orders}", customers],
        chunk_rows=60,
        workers=2,
    )
    with structlog.testing.capture_logs() as logs:
        paths = op.execute(make_context())
    json.dumps(paths)  # an XCom value
    assert len(paths) == 1 and [str(p) for p in list_batches(tmp_path, slot_name)] == paths
    manifest = BatchManifest.read(paths[0])
    plugin, two_phase, confirmed = slot_row(pg_conn, slot_name) or (None, None, None)
    assert (plugin, two_phase) == ("test_decoding", True)
    # the copy sits exactly at the slot's consistent point: the slot's first batch starts there
    assert Lsn.parse(manifest.start_lsn) == Lsn(0) and manifest.end_lsn == str(Lsn.parse(confirmed))
    assert {t.table: (t.rows - t.truncates, t.truncates) for t in manifest.tables} == {
        orders: (250, 1),
        customers: (40, 1),
    }
    assert staged_ids(manifest, orders) == list(range(1, 251))
    assert f"initial load: creating slot {slot_name} and copying 2 table(s)" in [e["event"] for e in logs]


def test_a_repeat_returns_the_staged_load_instead_of_a_second_snapshot(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str, tmp_path: Path, make_context: Any
) -> None:
    table = new_table(pg_conn, 30)
    op = PgDecodeInitialSnapshotOperator(
        task_id="initial_load", slot_name=slot_name, staging_root=str(tmp_path), tables=[table]
    )
    first = op.execute(make_context())
    pg_conn.execute(f"INSERT INTO {table} VALUES (31, 'after the snapshot')")  # the slot's, not the copy's
    with structlog.testing.capture_logs() as logs:
        again = op.execute(make_context())
    assert again == first and len(list_batches(tmp_path, slot_name)) == 1
    assert staged_ids(BatchManifest.read(again[0]), table) == list(range(1, 31))
    end = BatchManifest.read(first[0]).end_lsn
    assert f"initial load of slot {slot_name} was staged before (up to {end}): merging it again" in [
        e["event"] for e in logs
    ]


def test_an_existing_slot_without_a_staged_load_fails_without_retry_and_says_what_to_do(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str, tmp_path: Path, make_context: Any
) -> None:
    table = new_table(pg_conn, 5)
    pg_conn.execute("SELECT pg_create_logical_replication_slot(%s, 'test_decoding')", (slot_name,))
    op = PgDecodeInitialSnapshotOperator(
        task_id="initial_load", slot_name=slot_name, staging_root=str(tmp_path), tables=[table]
    )
    with pytest.raises(AirflowFailException) as failed:
        op.execute(make_context())
    message = str(failed.value)
    assert f"slot {slot_name!r} already exists" in message
    assert "'add-table' or 'resnapshot'" in message and f"pg_drop_replication_slot('{slot_name}')" in message
    assert slot_row(pg_conn, slot_name) is not None  # left alone
    assert list_batches(tmp_path, slot_name) == []


def test_a_table_that_cannot_be_copied_fails_without_retry_and_drops_the_new_slot(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str, tmp_path: Path, make_context: Any
) -> None:
    keyless = new_table(pg_conn, 5, key=False)
    op = PgDecodeInitialSnapshotOperator(
        task_id="initial_load", slot_name=slot_name, staging_root=str(tmp_path), tables=[keyless]
    )
    with pytest.raises(AirflowFailException, match=keyless):
        op.execute(make_context())
    assert slot_row(pg_conn, slot_name) is None  # a re-run can start over
    assert list_batches(tmp_path, slot_name) == []


@pytest.mark.parametrize("settings", [{"chunk_rows": 0}, {"workers": -1}, {"chunk_rows": "many"}])
def test_bad_settings_fail_before_the_slot_is_created(
    settings: dict[str, Any],
    source_conn: str,
    pg_conn: psycopg.Connection[Any],
    slot_name: str,
    tmp_path: Path,
    make_context: Any,
) -> None:
    op = PgDecodeInitialSnapshotOperator(
        task_id="initial_load", slot_name=slot_name, staging_root=str(tmp_path), tables=["public.x"], **settings
    )
    with pytest.raises(AirflowFailException, match="chunk_rows"):
        op.execute(make_context())
    assert slot_row(pg_conn, slot_name) is None


@pytest.fixture
def own_database(pg_cluster: ThrowawayCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A database of its own (the shared one holds other tests' tables); ``pgdecode_default`` points at it."""
    name = f"init_{uuid.uuid4().hex[:10]}"
    pg_cluster.create_database(name)
    monkeypatch.setenv("AIRFLOW_CONN_PGDECODE_DEFAULT", pg_cluster.airflow_conn_json(name))
    yield name
    with pg_cluster.connect(name) as conn:
        conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = %s", (name,)
        )
    with pg_cluster.connect() as conn:
        conn.execute(f'DROP DATABASE "{name}"')


def test_without_tables_every_table_is_copied_or_named_in_an_error(
    own_database: str, pg_cluster: ThrowawayCluster, slot_name: str, tmp_path: Path, make_context: Any
) -> None:
    with pg_cluster.connect(own_database) as conn:
        keyed, keyless, other = new_table(conn, 12), new_table(conn, 7, key=False), new_table(conn, 3, key=False)
    op = PgDecodeInitialSnapshotOperator(task_id="initial_load", slot_name=slot_name, staging_root=str(tmp_path))
    with pytest.raises(AirflowFailException, match="2 table\\(s\\) cannot be loaded") as info:
        op.execute(make_context())
    assert f"public.{keyless}: REPLICA IDENTITY DEFAULT and no primary key" in str(info.value)
    assert f"public.{other}: " in str(info.value) and keyed not in str(info.value)
    with pg_cluster.connect(own_database) as conn:
        assert slot_row(conn, slot_name) is None  # refused before the slot is created

    # The keyless one loaded append_only (no key needed), the other left out.
    op = PgDecodeInitialSnapshotOperator(
        task_id="initial_load",
        slot_name=slot_name,
        staging_root=str(tmp_path),
        table_options={f"public.{keyless}": {"mode": "append_only"}},
        exclude_tables=[f"public.{other}"],
    )
    manifest = BatchManifest.read(op.execute(make_context())[0])
    assert sorted(t.table for t in manifest.tables) == sorted([keyed, keyless])
    assert staged_ids(manifest, keyed) == list(range(1, 13))
    assert staged_ids(manifest, keyless) == list(range(1, 8))
    entry = next(t for t in manifest.tables if t.table == keyless)
    assert (entry.mode, entry.key, entry.key_source) == ("append_only", [], None)


def test_a_database_without_a_keyed_table_fails_before_the_slot_is_created(
    own_database: str, pg_cluster: ThrowawayCluster, slot_name: str, tmp_path: Path, make_context: Any
) -> None:
    op = PgDecodeInitialSnapshotOperator(task_id="initial_load", slot_name=slot_name, staging_root=str(tmp_path))
    with pytest.raises(AirflowFailException, match="no table to load"):
        op.execute(make_context())
    with pg_cluster.connect(own_database) as conn:
        assert slot_row(conn, slot_name) is None


@pytest.mark.spark
def test_copy_on_spark_stages_what_the_threads_stage(
    source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str, tmp_path: Path, make_context: Any, spark: Any
) -> None:
    table = new_table(pg_conn, 3000)
    op = PgDecodeInitialSnapshotOperator(
        task_id="initial_load",
        slot_name=slot_name,
        staging_root=str(tmp_path),
        tables=[table],
        chunk_rows=500,
        copy_on="spark",
        spark_master="local[2]",
    )
    with structlog.testing.capture_logs() as logs:
        paths = op.execute(make_context())
    manifest = BatchManifest.read(paths[0])
    (summary,) = manifest.tables
    assert staged_ids(manifest, table) == list(range(1, 3001)) and len(summary.snapshot_files) > 2
    assert any(e["event"].startswith("initial load: copying the chunks as Spark tasks") for e in logs), logs
    assert not spark.sparkContext._jsc.sc().isStopped()  # the test's session, already running, is left running
    with pytest.raises(AirflowFailException, match="copy_on"):
        PgDecodeInitialSnapshotOperator(
            task_id="bad", slot_name=slot_name, staging_root=str(tmp_path), copy_on="executors"
        ).execute(make_context())
