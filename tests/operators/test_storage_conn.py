"""``storage_conn_id`` on the operators and sensors: templated, resolved only when the task runs,
and no secret of the ``aws`` connection in a rendered field, XCom or a log line."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
import structlog

from airflow_provider_pgdecode.batch.manifest import BatchManifest
from airflow_provider_pgdecode.batch.storage import SPOOL_ENV, ObjectStoreSettings, Storage
from airflow_provider_pgdecode.capture.table_snapshot import (
    list_snapshot_requests,
    request_table_snapshot,
    write_snapshot_states,
)
from airflow_provider_pgdecode.hooks.object_store import storage_for
from airflow_provider_pgdecode.operators import (
    PgDecodeConfirmOperator,
    PgDecodeExtractOperator,
    PgDecodeInitialSnapshotOperator,
    PgDecodeReplayOperator,
    PgDecodeTableSnapshotOperator,
)
from airflow_provider_pgdecode.operators.verify_snapshot import PgDecodeVerifySnapshotOperator
from airflow_provider_pgdecode.sensors.slot_changes import PgDecodeSlotChangesSensor
from airflow_provider_pgdecode.sensors.table_snapshot import PgDecodeTableSnapshotSensor
from pgdecode_testing.s3_server import ACCESS_KEY, REGION, SECRET_KEY, LocalS3Server
from tests.operators.conftest import FakeTI

pytestmark = pytest.mark.s3

CONN_ID = "pgdecode_lake"


@pytest.fixture
def lake_conn(s3_server: LocalS3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """An ``aws`` connection to the test server (env var form); no ``AWS_*`` variable is set, so
    the store can only be reached through the connection."""
    for name in (*ObjectStoreSettings.ENV.values(), "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(
        f"AIRFLOW_CONN_{CONN_ID.upper()}",
        json.dumps(
            {
                "conn_type": "aws",
                "login": ACCESS_KEY,
                "password": SECRET_KEY,
                "extra": {"endpoint_url": s3_server.endpoint_url, "region_name": REGION},
            }
        ),
    )
    return CONN_ID


TEMPLATED = {"staging_root": "{{ params.staging_uri }}", "storage_conn_id": "{{ params.storage_conn_id }}"}


def tasks() -> list[Any]:
    return [
        PgDecodeExtractOperator(task_id="extract", slot_name="s", **TEMPLATED),
        PgDecodeConfirmOperator(
            task_id="confirm",
            slot_name="s",
            batch_path="{{ params.staging_uri }}/s/0000000000000000-0000000000000001",
            storage_conn_id="{{ params.storage_conn_id }}",
        ),
        PgDecodeInitialSnapshotOperator(task_id="initial_load", slot_name="s", **TEMPLATED),
        PgDecodeReplayOperator(task_id="replay", slot_name="s", **TEMPLATED),
        PgDecodeTableSnapshotOperator(task_id="prepare", slot_name="s", tables=["public.t"], **TEMPLATED),
        PgDecodeVerifySnapshotOperator(task_id="verify_snapshot", slot_name="s", **TEMPLATED),
        PgDecodeTableSnapshotSensor(task_id="wait_for_snapshot", slot_name="s", request_id="r", **TEMPLATED),
        PgDecodeSlotChangesSensor(task_id="wait_for_changes", slot_name="s", **TEMPLATED),
    ]


def test_storage_conn_id_is_templated_and_renders_to_the_id_alone(lake_conn: str, s3_bucket: str) -> None:
    params = {"staging_uri": f"{s3_bucket}/staging", "storage_conn_id": lake_conn}
    for task in tasks():
        assert "storage_conn_id" in task.template_fields, task.task_id
        task.render_template_fields({"params": params})
        assert task.storage_conn_id == lake_conn, task.task_id
        rendered = {name: getattr(task, name) for name in task.template_fields}
        assert SECRET_KEY not in repr(rendered), task.task_id
        assert str(task.staging_root if hasattr(task, "staging_root") else task.batch_path).startswith(s3_bucket)


def test_nothing_is_resolved_at_parse_time(monkeypatch: pytest.MonkeyPatch) -> None:
    def resolve(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a connection was looked up while the DAG was parsed")

    monkeypatch.setattr("airflow_provider_pgdecode.hooks.object_store.object_store_settings", resolve)
    tasks()  # no lookup, not even of a connection that does not exist


def test_storage_for_resolves_the_connection(lake_conn: str, s3_bucket: str, tmp_path: Any) -> None:
    assert storage_for(str(tmp_path), lake_conn) == Storage(tmp_path)  # a local path ignores the connection
    store = storage_for(f"{s3_bucket}/staging", lake_conn)
    assert isinstance(store, Storage) and store.root == f"{s3_bucket}/staging"
    assert store.settings is not None and store.settings.endpoint_url is not None
    assert SECRET_KEY not in repr(store) and SECRET_KEY not in repr(store.settings)
    store.write_text("probe.txt", "reached")  # through the connection's endpoint and keys
    assert store.read_text("probe.txt") == "reached"


def test_the_table_snapshot_sensor_reads_requests_on_s3(
    lake_conn: str, s3_server: LocalS3Server, s3_bucket: str
) -> None:
    staging = Storage(f"{s3_bucket}/staging", s3_server.settings)
    request_table_snapshot(staging, "pgdecode_s3", ["public.orders"], "add-table", request_id="add-orders")
    sensor = PgDecodeTableSnapshotSensor(
        task_id="wait_for_snapshot",
        slot_name="pgdecode_s3",
        staging_root=staging.root,
        storage_conn_id=lake_conn,
        request_id="add-orders",
    )
    context = {"ti": FakeTI()}
    with structlog.testing.capture_logs() as logs:
        assert not sensor.poke(context).is_done
        write_snapshot_states(
            staging,
            "pgdecode_s3",
            {"add-orders": {"done": True, "tables": {"public.orders": {"chunks": 1, "rows": 3, "done": True}}}},
        )
        returned = sensor.poke(context)
    assert returned.is_done and returned.xcom_value["done"] is True
    assert SECRET_KEY not in json.dumps(returned.xcom_value)
    assert SECRET_KEY not in repr(logs)
    assert any("public.orders: 1 chunk(s), 3 rows, done" in str(e.get("event")) for e in logs)


@pytest.mark.postgres
def test_the_table_snapshot_operator_files_on_s3(
    source_conn: str,
    lake_conn: str,
    s3_server: LocalS3Server,
    s3_bucket: str,
    pg_conn: psycopg.Connection[Any],
    slot_name: str,
) -> None:
    pg_conn.execute("SELECT pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot_name,))
    op = PgDecodeTableSnapshotOperator(
        task_id="prepare",
        slot_name=slot_name,
        staging_root=f"{s3_bucket}/staging",
        storage_conn_id=lake_conn,
        tables=["public.refunds"],
        mode="add-table",
        request_id="add-refunds",
    )
    ti = FakeTI()
    with structlog.testing.capture_logs() as logs:
        returned = op.execute({"ti": ti, "run_id": "manual__1"})
    assert returned == "add-refunds"
    staging = Storage(f"{s3_bucket}/staging", s3_server.settings)
    assert [r.id for r in list_snapshot_requests(staging, slot_name)] == ["add-refunds"]
    assert SECRET_KEY not in repr(returned) and SECRET_KEY not in repr(ti.xcoms)
    assert SECRET_KEY not in repr(logs)


@pytest.mark.postgres
def test_the_initial_load_stages_on_s3_and_is_found_again(
    source_conn: str,
    lake_conn: str,
    s3_server: LocalS3Server,
    s3_bucket: str,
    pg_conn: psycopg.Connection[Any],
    slot_name: str,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SPOOL_ENV, str(tmp_path / "spool"))
    pg_conn.execute("DROP TABLE IF EXISTS s3_init")
    pg_conn.execute("CREATE TABLE s3_init (id int PRIMARY KEY, v text)")
    pg_conn.execute("INSERT INTO s3_init SELECT g, 'v' || g FROM generate_series(1, 120) g")
    op = PgDecodeInitialSnapshotOperator(
        task_id="initial_load",
        slot_name=slot_name,
        staging_root=f"{s3_bucket}/staging",
        storage_conn_id=lake_conn,
        tables=["public.s3_init"],
        chunk_rows=50,
    )
    ti = FakeTI()
    with structlog.testing.capture_logs() as logs:
        paths = op.execute({"ti": ti})
        again = op.execute({"ti": ti})  # the slot exists: its staged initial load, found on S3
    assert paths == again and len(paths) == 1 and paths[0].startswith(f"{s3_bucket}/staging/{slot_name}/")
    staging = Storage(f"{s3_bucket}/staging", s3_server.settings)
    manifest = BatchManifest.read(staging.at(paths[0]))
    assert [(t.table, t.inserts) for t in manifest.tables] == [("s3_init", 120)]
    # nothing left in the local spool once uploaded
    assert not [p for p in (tmp_path / "spool").rglob("*") if p.is_file()]
    assert SECRET_KEY not in json.dumps(paths) and SECRET_KEY not in repr(logs)
