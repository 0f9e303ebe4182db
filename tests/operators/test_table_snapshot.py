"""PgDecodeTableSnapshotOperator against a real PostgreSQL: requests filed once, refusals that say what to do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg
import pytest
import structlog
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_pgdecode.capture.table_snapshot import list_snapshot_requests, requests_dir
from airflow_provider_pgdecode.operators import PgDecodeTableSnapshotOperator

pytestmark = pytest.mark.postgres


@pytest.fixture
def slot(pg_conn: psycopg.Connection[Any], slot_name: str) -> str:
    pg_conn.execute("SELECT pg_create_logical_replication_slot(%s, 'test_decoding', false, true)", (slot_name,))
    return slot_name


def test_files_the_request_once_and_returns_its_id(
    source_conn: str, slot: str, tmp_path: Path, make_context: Any
) -> None:
    op = PgDecodeTableSnapshotOperator(
        task_id="prepare",
        slot_name=slot,
        staging_root=str(tmp_path),
        tables=["public.refunds", "orders"],
        mode="resnapshot",
        request_id="rebuild-orders",
        chunk_rows=1000,
    )
    with structlog.testing.capture_logs() as logs:
        request_id = op.execute(make_context())
    assert request_id == "rebuild-orders"
    filed = json.loads(requests_dir(tmp_path, slot).read_text("rebuild-orders.json"))
    assert (filed["mode"], filed["tables"], filed["chunk_rows"]) == (
        "resnapshot",
        [["public", "orders"], ["public", "refunds"]],
        1000,
    )
    assert "filed request rebuild-orders: pgdecode_incremental copies public.orders, public.refunds" in [
        e["event"] for e in logs
    ]
    # a re-run (or every run of `airflow backfill create`) finds the same request
    assert op.execute(make_context()) == "rebuild-orders"
    assert [r.id for r in list_snapshot_requests(tmp_path, slot)] == ["rebuild-orders"]
    assert json.loads(requests_dir(tmp_path, slot).read_text("rebuild-orders.json")) == filed


def test_without_a_request_id_one_request_per_dag_run(
    source_conn: str, slot: str, tmp_path: Path, make_context: Any
) -> None:
    op = PgDecodeTableSnapshotOperator(
        task_id="prepare", slot_name=slot, staging_root=str(tmp_path), tables=["public.refunds"]
    )
    first = op.execute({**make_context(), "run_id": "manual__2026-03-01T00:00:00+00:00"})
    second = op.execute({**make_context(), "run_id": "manual__2026-03-02T00:00:00+00:00"})
    assert first == "add-table-manual__2026-03-01T00_00_00+00_00"  # ":" is not kept in a file name
    assert second != first
    assert [r.id for r in list_snapshot_requests(tmp_path, slot)] == [first, second]


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ({"tables": []}, "mode 'add-table' needs the tables to copy (param 'tables')"),
        ({"tables": ["public.refunds"], "mode": "reload"}, "mode must be one of add-table, resnapshot, not 'reload'"),
        ({"tables": ["public.refunds"], "chunk_rows": 0}, "chunk_rows must be a whole number of at least 1"),
        ({"tables": ["public.refunds"], "request_id": "-"}, "invalid request id"),
    ],
)
def test_bad_arguments_fail_without_retry(
    arguments: dict[str, Any], says: str, source_conn: str, slot: str, tmp_path: Path, make_context: Any
) -> None:
    op = PgDecodeTableSnapshotOperator(task_id="prepare", slot_name=slot, staging_root=str(tmp_path), **arguments)
    with pytest.raises(AirflowFailException) as failed:
        op.execute({**make_context(), "run_id": "manual__1"})
    assert says in str(failed.value)
    assert list_snapshot_requests(tmp_path, slot) == []


def test_a_missing_slot_fails_without_retry_and_names_the_way_forward(
    source_conn: str, slot_name: str, tmp_path: Path, make_context: Any
) -> None:
    op = PgDecodeTableSnapshotOperator(
        task_id="prepare",
        slot_name=slot_name,
        staging_root=str(tmp_path),
        tables=["public.refunds"],
        request_id="r1",
    )
    with pytest.raises(AirflowFailException) as failed:
        op.execute(make_context())
    message = str(failed.value)
    assert f"slot {slot_name!r} does not exist" in message
    assert "pgdecode_incremental" in message and "mode 'initial'" in message
    assert list_snapshot_requests(tmp_path, slot_name) == []


def test_the_same_id_with_other_tables_is_refused(
    source_conn: str, slot: str, tmp_path: Path, make_context: Any
) -> None:
    def request(tables: list[str]) -> PgDecodeTableSnapshotOperator:
        return PgDecodeTableSnapshotOperator(
            task_id="prepare", slot_name=slot, staging_root=str(tmp_path), tables=tables, request_id="r1"
        )

    request(["public.refunds"]).execute(make_context())
    with pytest.raises(AirflowFailException, match="already exists with other settings.*choose another id"):
        request(["public.orders"]).execute(make_context())


def test_exclude_tables_and_a_keyless_append_only_table(
    source_conn: str, slot: str, pg_conn: psycopg.Connection[Any], tmp_path: Path, make_context: Any
) -> None:
    pg_conn.execute("DROP TABLE IF EXISTS ts_op_log; CREATE TABLE ts_op_log (at int, what text)")
    common = {"task_id": "prepare", "slot_name": slot, "staging_root": str(tmp_path), "mode": "resnapshot"}
    # A keyless append_only table cannot be copied chunk by chunk: refused by name, nothing filed.
    op = PgDecodeTableSnapshotOperator(
        **common, tables=["public.ts_op_log"], table_options={"public.ts_op_log": {"mode": "append_only"}}
    )
    with pytest.raises(AirflowFailException, match=r"table public\.ts_op_log is loaded append_only and has no key"):
        op.execute({**make_context(), "run_id": "manual__1"})
    assert list_snapshot_requests(tmp_path, slot) == []
    # exclude_tables leaves its tables out of the request.
    op = PgDecodeTableSnapshotOperator(
        **common, tables=["public.refunds", "public.ts_op_log"], exclude_tables=["public.ts_op_log"], request_id="r1"
    )
    assert op.execute(make_context()) == "r1"
    assert [list(r.tables) for r in list_snapshot_requests(tmp_path, slot)] == [[("public", "refunds")]]
    op = PgDecodeTableSnapshotOperator(**common, tables=["public.ts_op_log"], exclude_tables=["public.ts_op_log"])
    with pytest.raises(AirflowFailException, match="exclude_tables left out every one named: public.ts_op_log"):
        op.execute({**make_context(), "run_id": "manual__2"})
