"""Logical decoding messages, from ``pg_logical_emit_message`` through staging into the messages
Delta table: both kinds, text and binary content, exactly once, for both plugins; the messages of
transactions that never commit (rolled back, streamed then aborted, prepared then rolled back)
never appear."""

from __future__ import annotations

import psycopg
import pytest

from airflow_provider_pgdecode.batch.checkpoint import Checkpoint
from airflow_provider_pgdecode.capture.extract import extract_batch
from airflow_provider_pgdecode.decoding.lsn import Lsn
from airflow_provider_pgdecode.spark.merge_job import merge_batches, summary_lines
from airflow_provider_pgdecode.spark.side_tables import messages_table_path
from tests.capture.test_extract import wait_for_flush
from tests.conftest import two_plugin_source

pytestmark = [pytest.mark.postgres, pytest.mark.spark]

PUBLICATION = "msg_pub"


@pytest.fixture
def source(pg_conn: psycopg.Connection, slot_name: str):
    ddl = "create table msg_orders (id int primary key, note text)"
    with two_plugin_source(pg_conn, slot_name, PUBLICATION, ["msg_orders"], ddl) as slot:
        yield slot
        if pg_conn.execute("select 1 from pg_prepared_xacts where gid = 'msg_later'").fetchone():
            pg_conn.execute("rollback prepared 'msg_later'")  # a test that failed before committing it


def first_batch_workload(c: psycopg.Connection) -> None:
    c.execute("insert into msg_orders values (1, 'one')")
    with c.transaction():
        c.execute("insert into msg_orders values (2, 'two')")
        c.execute("select pg_logical_emit_message(true, 'outbox', 'order 2 created')")
    c.execute("select pg_logical_emit_message(false, 'heartbeat', '\\xff00'::bytea)")
    # Never committed: rolled back; streamed past logical_decoding_work_mem, then aborted;
    # prepared, then rolled back.
    c.execute("begin")
    c.execute("select pg_logical_emit_message(true, 'outbox', 'rolled back')")
    c.execute("rollback")
    c.execute("begin")
    c.execute("insert into msg_orders select g, repeat('s', 100) from generate_series(100, 3000) g")
    c.execute("select pg_logical_emit_message(true, 'outbox', 'streamed, then aborted')")
    c.execute("rollback")
    c.execute("begin")
    c.execute("select pg_logical_emit_message(true, 'outbox', 'prepared, then rolled back')")
    c.execute("prepare transaction 'msg_never'")
    c.execute("rollback prepared 'msg_never'")
    # Prepared now, committed in the next batch.
    c.execute("begin")
    c.execute("update msg_orders set note = 'uno' where id = 1")
    c.execute("select pg_logical_emit_message(true, 'outbox', '\\x000162696e617279'::bytea)")
    c.execute("prepare transaction 'msg_later'")


def test_messages_reach_the_messages_table_exactly_once(pg_conn, source, spark, tmp_path, plugin) -> None:
    slot = source if plugin == "test_decoding" else source + "_po"
    extra = {"publication": PUBLICATION} if plugin == "pgoutput" else {}
    first_batch_workload(pg_conn)
    wait_for_flush(pg_conn, pg_conn.execute("select pg_current_wal_insert_lsn()").fetchone()[0])
    first = extract_batch(pg_conn, slot, tmp_path / "b1", plugin=plugin, **extra)
    assert first.prepared_pending, "the prepared transaction is carried to the next batch"
    pg_conn.execute("commit prepared 'msg_later'")
    end = pg_conn.execute("select pg_logical_emit_message(false, 'heartbeat', 'last')").fetchone()[0]
    wait_for_flush(pg_conn, end)
    second = extract_batch(
        pg_conn, slot, tmp_path / "b2", plugin=plugin, checkpoint=Checkpoint.from_manifest(first), **extra
    )

    delta_root = str(tmp_path / "delta")
    one = merge_batches(spark, [str(first.path)], delta_root)
    assert one["messages"]["status"] == "appended" and one["messages"]["rows"] == 2
    two = merge_batches(spark, [str(second.path)], delta_root)
    assert two["messages"]["status"] == "appended" and two["messages"]["rows"] == 2
    again = merge_batches(spark, [str(first.path), str(second.path)], delta_root)
    assert again["messages"]["status"] == "already applied" and again["messages"]["staged"] == 4
    assert any(line.startswith("messages: 4 in these batches, already applied") for line in summary_lines(again))

    table = spark.read.format("delta").load(messages_table_path(delta_root))
    rows = sorted((r.asDict() for r in table.collect()), key=lambda r: r["_pg_lsn"])
    assert [(r["prefix"], bytes(r["content"]), r["transactional"]) for r in rows] == [
        ("outbox", b"order 2 created", True),
        ("heartbeat", b"\xff\x00", False),
        ("outbox", b"\x00\x01binary", True),
        ("heartbeat", b"last", False),
    ]
    assert {r["_pg_slot"] for r in rows} == {slot}
    committed, heartbeat, prepared, _ = rows
    assert committed["_pg_commit_lsn"] > committed["_pg_lsn"] and committed["_pg_xid"]
    assert heartbeat["_pg_commit_lsn"] is None
    # The prepared transaction's message takes its COMMIT PREPARED's position, in the later batch.
    assert Lsn(prepared["_pg_commit_lsn"]) > Lsn.parse(first.end_lsn)
    merged = {r["id"]: r["note"] for r in spark.read.format("delta").load(f"{delta_root}/public/msg_orders").collect()}
    assert merged == {1: "uno", 2: "two"}


@pytest.fixture(params=["test_decoding", "pgoutput"])
def plugin(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_a_batch_of_messages_only_is_merged(pg_conn, source, tmp_path) -> None:
    """The merge operator sends a batch to Spark when it holds messages and no table rows."""
    from airflow_provider_pgdecode.cycle.merge import MergeJob
    from airflow_provider_pgdecode.operators.merge import PgDecodeMergeOperator

    end = pg_conn.execute("select pg_logical_emit_message(false, 'only', 'message')").fetchone()[0]
    wait_for_flush(pg_conn, end)
    batch = extract_batch(pg_conn, source, tmp_path / "b")
    assert not any(t.rows for t in batch.tables) and batch.messages and batch.messages["rows"] == 1
    operator = PgDecodeMergeOperator(task_id="merge", batch_paths=[str(batch.path)], delta_root=str(tmp_path / "d"))
    to_merge, empty = MergeJob(operator.cycle_arguments(), operator.log).read_batches()
    assert [m.path for m in to_merge] == [batch.path] and empty == []
