"""PgDecodeTableSnapshotSensor while real incremental runs (extract, confirm) carry a request out."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
import structlog
from airflow.sdk.exceptions import AirflowFailException, AirflowSensorTimeout

from airflow_provider_pgdecode.capture.table_snapshot import list_snapshot_requests
from airflow_provider_pgdecode.operators import (
    PgDecodeConfirmOperator,
    PgDecodeEnsureSlotOperator,
    PgDecodeExtractOperator,
    PgDecodeTableSnapshotOperator,
)
from airflow_provider_pgdecode.sensors.table_snapshot import PgDecodeTableSnapshotSensor
from tests.operators.conftest import FakeTI

pytestmark = pytest.mark.postgres


def context(**xcoms: Any) -> dict[str, Any]:
    return {"ti": FakeTI(xcoms), "run_id": "manual__1"}


class Pipeline:
    """One slot, an incremental cycle on demand (extract, then confirm as if merged), a request filer."""

    def __init__(self, conn: psycopg.Connection[Any], slot: str, staging: Path) -> None:
        self.conn, self.slot, self.staging = conn, slot, str(staging)
        self.flowing = f"tsf_{uuid.uuid4().hex[:10]}"
        conn.execute(f"CREATE TABLE {self.flowing} (id int PRIMARY KEY)")
        PgDecodeEnsureSlotOperator(task_id="ensure_slot", slot_name=slot, two_phase=True).execute(context())
        self.checkpoint: dict[str, Any] | None = None

    def request(self, table: str, request_id: str) -> str:
        return PgDecodeTableSnapshotOperator(
            task_id="prepare",
            slot_name=self.slot,
            staging_root=self.staging,
            tables=[table],
            mode="add-table",
            request_id=request_id,
            chunk_rows=100,
        ).execute(context())

    def extract(self) -> dict[str, Any]:
        return PgDecodeExtractOperator(
            task_id="extract",
            slot_name=self.slot,
            staging_root=self.staging,
            tables=[self.flowing],
            extract_options={"snapshot_rows": 100},  # one chunk per run
        ).execute(context(confirm=self.checkpoint))

    def confirm(self, summary: dict[str, Any]) -> None:
        self.checkpoint = PgDecodeConfirmOperator(
            task_id="confirm", slot_name=self.slot, batch_path=summary["path"]
        ).execute(context(merge={"batches": [summary["path"]], "skipped": []}))

    def sensor(self, request_id: str, **kwargs: Any) -> PgDecodeTableSnapshotSensor:
        return PgDecodeTableSnapshotSensor(
            task_id="wait_for_snapshot",
            slot_name=self.slot,
            staging_root=self.staging,
            request_id=request_id,
            **kwargs,
        )


@pytest.fixture
def pipeline(source_conn: str, pg_conn: psycopg.Connection[Any], slot_name: str, tmp_path: Path) -> Pipeline:
    return Pipeline(pg_conn, slot_name, tmp_path / "staging")


def new_table(conn: psycopg.Connection[Any], rows: int, key: bool = True) -> str:
    name = f"tss_{uuid.uuid4().hex[:10]}"
    conn.execute(f"CREATE TABLE {name} (id int {'PRIMARY KEY' if key else ''}, v text)")
    conn.execute(f"INSERT INTO {name} SELECT g, 'v' || g FROM generate_series(1, {rows}) g")
    return name


def poke(sensor: PgDecodeTableSnapshotSensor) -> tuple[Any, list[str]]:
    with structlog.testing.capture_logs() as logs:
        returned = sensor.poke(context())
    return returned, [e["event"] for e in logs]


def test_waits_for_confirmed_chunks_logging_progress_on_every_poke(
    pipeline: Pipeline, pg_conn: psycopg.Connection[Any]
) -> None:
    table = new_table(pg_conn, 250)
    request = pipeline.request(table, "add-refunds")
    sensor = pipeline.sensor(request)
    assert sensor.mode == "reschedule"  # no worker is held while the copy goes on

    returned, logs = poke(sensor)
    assert not returned.is_done and logs == ["request add-refunds: no chunk confirmed yet"]

    summary = pipeline.extract()  # copies a chunk, not confirmed yet: it may never reach Delta
    returned, logs = poke(sensor)
    assert not returned.is_done and logs == ["request add-refunds: no chunk confirmed yet"]

    pipeline.confirm(summary)
    returned, logs = poke(sensor)
    assert not returned.is_done
    assert logs == [f"request add-refunds: public.{table}: 1 chunk(s), 100 rows, copying"]

    for _ in range(4):
        pipeline.confirm(pipeline.extract())
        returned, logs = poke(sensor)
        if returned.is_done:
            break
    assert returned.is_done
    assert logs[-1].startswith(f"request add-refunds: public.{table}: ") and logs[-1].endswith(" 250 rows, done")
    state = returned.xcom_value
    assert state["done"] and not state["error"] and state["tables"][f"public.{table}"]["rows"] == 250


def test_a_failed_request_fails_without_retry_and_says_what_to_do(
    pipeline: Pipeline, pg_conn: psycopg.Connection[Any]
) -> None:
    keyless = new_table(pg_conn, 5, key=False)
    request = pipeline.request(keyless, "add-keyless")
    pipeline.confirm(pipeline.extract())
    with pytest.raises(AirflowFailException) as failed:
        poke(pipeline.sensor(request))
    message = str(failed.value)
    assert message.startswith("snapshot request add-keyless failed: ") and keyless in message
    assert "primary key" in message and "file a new request with another request_id" in message


def test_a_request_that_was_never_filed_fails_without_retry(pipeline: Pipeline) -> None:
    with pytest.raises(AirflowFailException, match="no snapshot request 'add-nothing' of slot .* is filed under"):
        poke(pipeline.sensor("add-nothing"))


def test_wait_seconds_zero_does_not_wait(pipeline: Pipeline, pg_conn: psycopg.Connection[Any]) -> None:
    request = pipeline.request(new_table(pg_conn, 5), "add-later")
    sensor = pipeline.sensor(request, wait_seconds=0)
    with structlog.testing.capture_logs() as logs:
        assert sensor.execute(context()) is None
    assert [e["event"] for e in logs] == ["not waiting for request add-later (wait_seconds=0)"]
    assert [r.id for r in list_snapshot_requests(pipeline.staging, pipeline.slot)] == ["add-later"]  # still filed


def test_running_out_of_time_says_what_to_check_and_keeps_the_request(
    pipeline: Pipeline, pg_conn: psycopg.Connection[Any]
) -> None:
    request = pipeline.request(new_table(pg_conn, 5), "add-slow")
    sensor = pipeline.sensor(request, wait_seconds="0.05", mode="poke", poke_interval=0.01)  # nothing runs the copy
    with pytest.raises(AirflowSensorTimeout) as timed_out:
        sensor.execute(context())
    assert "snapshot request add-slow is not done after 0.05 s; is pgdecode_incremental running?" in str(
        timed_out.value
    )
    assert [r.id for r in list_snapshot_requests(pipeline.staging, pipeline.slot)] == ["add-slow"]


@pytest.mark.parametrize("wait", ["-1", "soon"])
def test_a_bad_wait_fails_without_retry(wait: str, pipeline: Pipeline) -> None:
    with pytest.raises(AirflowFailException, match="wait_seconds must be a number of seconds"):
        pipeline.sensor("x", wait_seconds=wait).execute(context())
